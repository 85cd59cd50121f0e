"""The package's layers, read from the source with ``ast`` (nothing is imported).

The repository's folders install as one package (pyproject.toml's package-dir):
``tierstore/`` is the core (``tierstore``, ``tierstore.daemon``, ...), ``cache/``, ``nvme/`` and
``pmem/`` are the leaf packages ``tierstore.cache``, ``tierstore.nvme`` and ``tierstore.pmem``,
and ``trainer/`` and ``bench/`` are the applications ``tierstore.trainer`` and
``tierstore.bench``. Every import is resolved to the absolute module it names (relative ones
too, ``from . import x`` to ``package.x``; ``importlib.import_module`` of a constant string
counts), and:

1. the core never imports the applications (``tierstore.trainer``, ``tierstore.bench``, or
   the bare ``trainer``/``bench``): they register their commands through entry points;
2. a leaf imports nothing of tierstore outside its own package: not the core, not the
   applications, and not another leaf (so each leaf can be read, tested and replaced on its
   own; none needs another today). Relative imports inside its own package are fine;
3. no module, tests included, imports the bare names ``cache``, ``nvme``, ``pmem``,
   ``trainer`` or ``bench``: installed, only ``tierstore.*`` exists;
4. the applications use tierstore's public API only: no private name (``_x``, dunders
   aside) and no private module of a tierstore package other than their own, whether
   imported (``from tierstore.store import _Meta``) or reached through an imported module
   (``tierstore.store._Meta``);
5. a module of over 600 lines says why at its top, the convention being a line
   ``# Over 600 lines: <reason>`` among the comments before its first import or definition
   (after the docstring, if any), or a line ``Over 600 lines: <reason>`` in its docstring.

Each failure lists every offending module with the line and the import.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _package_dirs() -> dict[str, str]:
    """Repository folder -> the package it installs as, from pyproject.toml's package-dir."""
    import tomllib

    with open(ROOT / "pyproject.toml", "rb") as f:
        mapping = tomllib.load(f)["tool"]["setuptools"]["package-dir"]
    return {folder: package for package, folder in mapping.items()}


PACKAGE_DIRS = _package_dirs()
MAPPED = tuple(f for f in PACKAGE_DIRS if f != "tierstore")
LEAVES = ("tierstore.cache", "tierstore.nvme", "tierstore.pmem")
APPS = ("tierstore.trainer", "tierstore.hf", "tierstore.bench")
CORE = "tierstore"
BARE = {f for f in MAPPED if "/" not in f}
INSTALLED = {p for p in PACKAGE_DIRS.values() if p != CORE}  # tierstore.cache, tierstore.hf, ...
MAX_LINES = 600
REASON = re.compile(r"^\s*#\s*Over 600 lines:\s*\S.{8,}")
DOC_REASON = re.compile(r"^\s*Over 600 lines:\s*\S.{8,}", re.MULTILINE)


@dataclass(frozen=True)
class Module:
    path: Path
    name: str  # dotted, as installed
    is_package: bool

    @property
    def rel(self) -> str:
        return str(self.path.relative_to(ROOT))

    @property
    def package(self) -> str:
        return self.name if self.is_package else self.name.rpartition(".")[0]


@dataclass(frozen=True)
class Import:
    line: int
    text: str  # the statement as written
    targets: tuple[str, ...]  # absolute modules (or module.attribute) it names
    level: int  # 0: absolute
    names: tuple[str, ...]  # for ``from X import a, b``: a, b


def package_modules() -> list[Module]:
    found = []
    for folder, package in PACKAGE_DIRS.items():
        base = ROOT / folder
        for path in sorted(base.rglob("*.py")):
            rel = path.relative_to(base)
            if "__pycache__" in rel.parts:
                continue
            if any(str(Path(folder) / rel).startswith(other + "/") for other in MAPPED
                   if other != folder and other.startswith(folder + "/")) or (
                    folder == "tierstore" and rel.parts[0] in MAPPED):
                continue  # a mapped folder is its own package, scanned from its own folder
            parts = list(rel.with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            if is_package:
                parts.pop()
            found.append(Module(path, ".".join([package, *parts]), is_package))
    return found


def repo_test_modules() -> list[Module]:
    return [Module(p, f"tests.{p.stem}", False) for p in sorted((ROOT / "tests").glob("*.py"))]


def parse(path: Path) -> ast.Module:
    return _parse(path.read_text(encoding="utf-8"), str(path))


@cache
def _parse(text: str, filename: str) -> ast.Module:
    return ast.parse(text, filename=filename)


def resolve(module: Module, level: int, name: str | None) -> str:
    if level == 0:
        return name or ""
    parts = module.package.split(".")
    if level - 1 >= len(parts):
        return "<beyond the top: " + "." * level + (name or "") + ">"
    base = parts[: len(parts) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def imports(module: Module) -> list[Import]:
    found = []
    for node in ast.walk(parse(module.path)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                found.append(Import(node.lineno, f"import {alias.name}", (alias.name,), 0, ()))
        elif isinstance(node, ast.ImportFrom):
            base = resolve(module, node.level, node.module)
            names = tuple(a.name for a in node.names)
            targets = (base, *(f"{base}.{n}" for n in names if n != "*"))
            text = f"from {'.' * node.level}{node.module or ''} import {', '.join(names)}"
            found.append(Import(node.lineno, text, targets, node.level, names))
        elif (isinstance(node, ast.Call) and node.args
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)
              and dotted(node.func) in ("importlib.import_module", "import_module",
                                        "__import__")):
            target = node.args[0].value
            if not target.startswith("."):
                found.append(Import(node.lineno, f"{dotted(node.func)}({target!r})", (target,),
                                    0, ()))
    return sorted(found, key=lambda i: i.line)


def dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        inner = dotted(node.value)
        return f"{inner}.{node.attr}" if inner else ""
    return ""


def owner(name: str) -> str | None:
    """The layer a module belongs to: a leaf or application package, the core, or None
    (not tierstore)."""
    parts = name.split(".")
    if parts[0] != "tierstore":
        return None
    if len(parts) > 1 and f"tierstore.{parts[1]}" in INSTALLED:
        return f"tierstore.{parts[1]}"
    return CORE


def layer_of(module: Module) -> str:
    found = owner(module.name)
    assert found is not None, module
    return found


def is_private(part: str) -> bool:
    return part.startswith("_") and not (part.startswith("__") and part.endswith("__"))


def report(problems: list[str], rule: str) -> None:
    assert not problems, f"{rule}:\n" + "\n".join(f"  {p}" for p in problems)


# -- the rules --------------------------------------------------------------------------------
def test_the_scan_finds_every_layer() -> None:
    modules = package_modules()
    layers = {layer_of(m) for m in modules}
    assert layers == {CORE, *LEAVES, *APPS}, layers
    assert any(m.name == "tierstore" and m.is_package for m in modules)
    assert any(m.name == "tierstore.daemon" and m.is_package for m in modules)
    assert any(m.name == "tierstore.cache" and m.is_package for m in modules)


def test_core_never_imports_the_applications() -> None:
    problems = []
    for m in package_modules():
        if layer_of(m) != CORE:
            continue
        for imp in imports(m):
            bad = [t for t in imp.targets if owner(t) in APPS]
            if imp.level == 0 and imp.targets[0].split(".")[0] in ("trainer", "bench"):
                bad.append(imp.targets[0])
            if bad:
                problems.append(f"{m.rel}:{imp.line}: {imp.text}  (imports {bad[0]})")
    report(problems, "modules of tierstore's core import the applications")


def test_leaves_import_only_their_own_package() -> None:
    problems = []
    for m in package_modules():
        mine = layer_of(m)
        if mine not in LEAVES:
            continue
        for imp in imports(m):
            for t in imp.targets:
                theirs = owner(t)
                if t.startswith("<beyond") or (theirs is not None and theirs != mine):
                    what = "tierstore's core" if theirs == CORE else (theirs or t)
                    problems.append(f"{m.rel}:{imp.line}: {imp.text}  (imports {what})")
                    break
    report(problems, "leaf packages (cache, nvme, pmem) import outside their own package")


def test_no_module_imports_the_bare_names() -> None:
    problems = []
    for m in package_modules() + repo_test_modules():
        for imp in imports(m):
            if imp.level == 0 and imp.targets[0].split(".")[0] in BARE:
                problems.append(f"{m.rel}:{imp.line}: {imp.text}  (import tierstore."
                                f"{imp.targets[0]} instead)")
    report(problems, "modules import the bare names cache, nvme, pmem, trainer or bench")


def test_applications_use_only_public_names() -> None:
    problems = []
    for m in package_modules():
        mine = layer_of(m)
        if mine not in APPS:
            continue
        bound: dict[str, str] = {}  # a name in the module -> the tierstore module it is
        for imp in imports(m):
            base = imp.targets[0]
            if owner(base) in (None, mine):
                continue
            module_parts = base.split(".")
            private = [p for p in module_parts if is_private(p)]
            private += [n for n in imp.names if is_private(n)]
            if private:
                problems.append(f"{m.rel}:{imp.line}: {imp.text}  (private {private[0]} of "
                                f"{base})")
        for node in ast.walk(parse(m.path)):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if owner(alias.name) not in (None, mine):
                        if alias.asname:
                            bound[alias.asname] = alias.name
                        else:
                            top = alias.name.split(".")[0]
                            bound[top] = top
            elif isinstance(node, ast.ImportFrom):
                base = resolve(m, node.level, node.module)
                for alias in node.names:
                    target = f"{base}.{alias.name}"
                    if owner(target) not in (None, mine):
                        bound[alias.asname or alias.name] = target
        for node in ast.walk(parse(m.path)):
            if not isinstance(node, ast.Attribute) or not is_private(node.attr):
                continue
            chain = dotted(node)
            root, _, rest = chain.partition(".")
            if root not in bound:
                continue
            full = f"{bound[root]}.{rest}"
            if owner(full) in (None, mine):
                continue
            problems.append(f"{m.rel}:{node.lineno}: {chain}  (private {node.attr} of "
                            f"{full.rpartition('.')[0]})")
    report(problems, "the applications (trainer, bench) reach into private names of tierstore")


def top_reason(path: Path) -> bool:
    """Whether the module states why it is long (see the module docstring, rule 5)."""
    tree = parse(path)
    doc = ast.get_docstring(tree, clean=False)
    if doc and DOC_REASON.search(doc):
        return True
    body = [n for n in tree.body
            if not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)
                    and isinstance(n.value.value, str))]
    first_code = body[0].lineno if body else len(path.read_text().splitlines()) + 1
    lines = path.read_text(encoding="utf-8").splitlines()[: first_code - 1]
    return any(REASON.match(line) for line in lines)


def test_long_modules_say_why() -> None:
    problems = []
    tests = sorted(Path(__file__).parent.glob("*.py"))
    for path, rel in [(m.path, m.rel) for m in package_modules()] + [(t, t.name) for t in tests]:
        n = len(path.read_text(encoding="utf-8").splitlines())
        if n > MAX_LINES and not top_reason(path):
            problems.append(f"{rel}: {n} lines, and no '# Over 600 lines: <reason>' at its top")
    report(problems, f"modules over {MAX_LINES} lines without a reason")


# -- the checker itself -------------------------------------------------------------------------
@pytest.mark.parametrize(("module", "level", "name", "want"), [
    (Module(ROOT / "tierstore/daemon/client.py", "tierstore.daemon.client", False), 2, "store",
     "tierstore.store"),
    (Module(ROOT / "tierstore/daemon/__init__.py", "tierstore.daemon", True), 1, "client",
     "tierstore.daemon.client"),
    (Module(ROOT / "cache/hostcache.py", "tierstore.cache.hostcache", False), 1, None,
     "tierstore.cache"),
    (Module(ROOT / "cache/hostcache.py", "tierstore.cache.hostcache", False), 2, "store",
     "tierstore.store"),
    (Module(ROOT / "x.py", "tierstore.x", False), 3, "y", "<beyond the top: ...y>"),
])
def test_relative_imports_resolve(module: Module, level: int, name: str | None,
                                  want: str) -> None:
    assert resolve(module, level, name) == want


def test_the_checks_catch_what_they_forbid(tmp_path: Path) -> None:
    src = tmp_path / "mod.py"
    src.write_text("import trainer\nfrom ..store import _Meta\nimport tierstore.store as ts\n"
                   "x = ts._Meta\nimport importlib\nimportlib.import_module('bench.x')\n")
    m = Module(src, "tierstore.cache.mod", False)
    got = imports(m)
    assert [i.targets[0] for i in got] == ["trainer", "tierstore.store", "tierstore.store",
                                           "importlib", "bench.x"]
    assert [owner(i.targets[0]) for i in got] == [None, CORE, CORE, None, None]
    assert is_private("_Meta") and not is_private("__version__") and not is_private("Meta")
    long = tmp_path / "long.py"
    long.write_text('"""Doc."""\n\n# Over 600 lines: one state machine, split it loses '
                    'the thread.\nimport os\n' + "x = 1\n" * 700)
    assert top_reason(long)
    long.write_text('"""Doc."""\nimport os\n# Over 600 lines: too late, after the code.\n')
    assert not top_reason(long)
    long.write_text('"""Doc.\n\nOver 600 lines: the protocol is one table.\n"""\nimport os\n')
    assert top_reason(long)
