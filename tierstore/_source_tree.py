"""Importing tierstore from the repository itself, as ``python -m tierstore`` run from the
clone's root does.

pyproject.toml's ``package-dir`` installs sibling folders of ``tierstore/`` under it
(``cache/`` as ``tierstore.cache`` ...). An installed copy (a wheel, or setuptools' editable
finder) knows that mapping; the source folder alone does not, and under ``-m`` the working
directory comes first on ``sys.path``, so from the clone's root ``tierstore`` is the source
folder whatever is installed. When this package is imported from a source tree, a finder
maps the subpackages to their folders as the wheel lays them out, read from that tree's own
pyproject.toml: adding a line to ``package-dir`` is all a new mapped subpackage needs. An
installed copy has no pyproject.toml beside it and is left alone.
"""

from __future__ import annotations

import os
import re
import sys
from importlib.machinery import ModuleSpec
from importlib.util import spec_from_file_location
from pathlib import Path
from types import ModuleType
from typing import Any

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: read the one table by hand (see _read_table)
    tomllib = None  # type: ignore[assignment]

TOP = "tierstore"


def package_dirs(pyproject: Path) -> dict[str, str]:
    """``[tool.setuptools.package-dir]`` of a pyproject.toml: package -> folder, relative to
    the file's directory; empty if the file is not tierstore's."""
    text = pyproject.read_text(encoding="utf-8")
    if tomllib is not None:
        data: dict[str, Any] = tomllib.loads(text)
        if data.get("project", {}).get("name") != TOP:
            return {}
        table = data.get("tool", {}).get("setuptools", {}).get("package-dir", {})
        return {str(k): str(v) for k, v in table.items()}
    return read_table(text) if re.search(rf'^name\s*=\s*"{TOP}"\s*$', text, re.M) else {}


_ROW = re.compile(r'^\s*"([^"]+)"\s*=\s*"([^"]*)"\s*(?:#.*)?$')


def read_table(text: str) -> dict[str, str]:
    """The package-dir table as this repository writes it (one ``"package" = "folder"`` per
    line), for interpreters without tomllib; tests/test_packaging.py checks it against
    tomllib on the real file."""
    rows: dict[str, str] = {}
    inside = False
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("["):
            inside = stripped == "[tool.setuptools.package-dir]"
            continue
        if inside and (m := _ROW.match(line)):
            rows[m.group(1)] = m.group(2)
    return rows


class SourceTreeFinder:
    """Finds the mapped subpackages of a source tree (a meta path finder).

    Only the names pyproject maps are answered; their own subpackages and modules are then
    found through their ``__path__`` as usual. A folder mapped under one name is refused
    under the name its location would otherwise give it (``trainer/hf`` mapped as
    ``tierstore.hf`` is not also ``tierstore.trainer.hf``), so no module is loaded twice.
    """

    def __init__(self, folders: dict[str, str]) -> None:
        self.folders = folders  # package -> absolute folder
        self.names = {folder: name for name, folder in folders.items()}

    def find_spec(self, fullname: str, path: Any = None,
                  target: ModuleType | None = None) -> ModuleSpec | None:
        if not fullname.startswith(TOP + "."):
            return None
        folder = self.folders.get(fullname)
        if folder is not None:
            return spec_from_file_location(fullname, os.path.join(folder, "__init__.py"))
        child = fullname.rpartition(".")[2]
        for entry in path or ():
            other = self.names.get(os.path.join(entry, child))
            if other is not None:
                raise ModuleNotFoundError(f"No module named {fullname!r} ({other} is that "
                                          "folder's package)", name=fullname)
        return None


def install(package: Path) -> None:
    """Maps the subpackages if ``package`` (tierstore's folder) is in a source tree."""
    package = package.resolve()
    pyproject = package.parent / "pyproject.toml"
    if not pyproject.is_file():
        return
    root = pyproject.parent
    dirs = package_dirs(pyproject)
    own = dirs.get(TOP)
    if own is None or (root / own).resolve() != package:
        return
    folders = {name: os.path.normpath(root / folder) for name, folder in dirs.items()
               if name != TOP and (root / folder / "__init__.py").is_file()}
    if not any(isinstance(f, SourceTreeFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, SourceTreeFinder(folders))


# tierstore/__init__.py imports this module first, before anything imports a subpackage.
install(Path(__file__).parent)
