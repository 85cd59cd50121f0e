"""What every benchmark writes beside its table: the JSON record, and the machine's load."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any


def write_json(path: str | os.PathLike[str] | None, result: Any,
               echo: Callable[[str], Any] | None = None, indent: int = 2) -> None:
    """Write ``result`` to ``path`` (nothing when ``path`` is empty), ending in a newline so
    that the files diff cleanly in docs/, and say where it went."""
    if not path:
        return
    with open(path, "w") as f:
        json.dump(result, f, indent=indent)
        f.write("\n")
    if echo is not None:
        echo(f"wrote {path}")


def load_average() -> list[str]:
    """The 1, 5 and 15 minute load averages as /proc prints them: the figure that says
    how far a shared machine's timings can be trusted."""
    return [f"{x:.2f}" for x in os.getloadavg()]
