"""What every ``tierstore`` command module shares: the size option type and the wrapper that
turns store errors into one line. A module of its own, so that command modules need not
import ``tierstore.cli`` (which ``python -m tierstore.cli`` runs as ``__main__``)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import click

from .errors import StoreError
from .sizes import parse_size


class SizeType(click.ParamType):
    """Bytes, or a size string such as ``4MiB`` or ``2GiB``."""

    name = "size"

    def convert(self, value: Any, param: Any, ctx: Any) -> int:
        try:
            return parse_size(value)
        except ValueError as e:
            self.fail(str(e), param, ctx)


SIZE = SizeType()


def run_command(fn: Callable[[], int | None]) -> None:
    """Run a command's body: store errors, and OS errors on the files it was given, become
    one line and exit status 2 instead of a traceback; otherwise exit with the body's
    status."""
    try:
        code = fn()
    except StoreError as e:
        click.echo(f"tierstore: {e}", err=True)
        sys.exit(2)
    except OSError as e:  # a file the user named (or its directory) could not be used
        where = f"{e.filename}: " if e.filename else ""
        click.echo(f"tierstore: {where}{e.strerror or e}", err=True)
        sys.exit(2)
    sys.exit(code or 0)
