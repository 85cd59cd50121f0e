"""The wheel: one top-level package, every subpackage in it, and an install that works
without the repository.

- The wheel is built from a copy of the repository's sources (``pip wheel --no-deps
  --no-build-isolation``), so the build leaves nothing in the working tree (setuptools writes
  ``build/`` and ``*.egg-info`` next to ``pyproject.toml``). Its top-level entries are only
  ``tierstore/`` and ``tierstore-*.dist-info/``, and every folder with an ``__init__.py`` under
  the repository's ``tierstore/``, ``cache/``, ``nvme/``, ``pmem/``, ``trainer/`` and ``bench/``
  is in it, with every module: a subpackage missing from ``packages`` in pyproject.toml fails.
- The wheel installed into a fresh virtual environment imports from outside the repository,
  and there the bare names ``cache``, ``nvme``, ``pmem``, ``trainer`` and ``bench`` do not
  exist. The environment is made without pip and without system site-packages (the current
  environment is usually itself a virtualenv, whose packages ``--system-site-packages`` would
  not expose); a ``.pth`` file lists the current interpreter's site-packages so that torch
  and the other dependencies import. Directories listed in a ``.pth`` are not scanned for
  ``.pth`` files of their own, so an editable install of tierstore there stays inactive: the
  fresh environment's own copy is the one imported, which the test checks.
- A script run from a directory that also holds ``cache.py``, ``trainer.py``, ``bench.py``,
  ``nvme.py`` and ``pmem.py`` (junk, or raising ImportError) still imports tierstore, puts and
  gets an entry, and runs ``tierstore demo --help``: nothing imports the bare names. It runs
  under the current interpreter and under the fresh environment's.
- Every documented way in works from the clone's root and from any other directory, with a
  regular install (the wheel) and with an editable one (``pip install -e`` of a copy of the
  sources, into a fresh environment made as above): ``python -m tierstore --help``, a store
  command, ``python -m tierstore train --help``, the ``tierstore`` script and torchrun's
  ``-m tierstore``. From the clone's root ``python -m`` puts the working directory first on
  ``sys.path``, so the source folder ``tierstore/`` is imported rather than the installed
  copy; its subpackages held by sibling folders (pyproject's package-dir) must resolve there
  all the same, every module from one tree and none under two names.
- The source tree's mapping is pyproject's package-dir and nothing else: a subpackage mapped
  there (one folder inside another's) imports under its own name and not under the name its
  location would give it; the reader used where tomllib is missing agrees with tomllib.
"""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
import textwrap
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import tomllib

pytestmark = pytest.mark.timeout(300)

ROOT = Path(__file__).resolve().parent.parent
# Package -> the repository folder it installs from (pyproject's package-dir).
PACKAGE_DIRS: dict[str, str] = tomllib.loads((ROOT / "pyproject.toml").read_text())[
    "tool"]["setuptools"]["package-dir"]
# The repository's top-level folders that hold them.
SOURCE_FOLDERS = sorted({folder.split("/", 1)[0] for folder in PACKAGE_DIRS.values()})
BARE = ("cache", "nvme", "pmem", "trainer", "bench")
SOURCE_IGNORE = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "build")


def clean_env() -> dict[str, str]:
    """The environment without anything that would point Python at the repository."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "PYTHONSAFEPATH")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    env["PIP_NO_INPUT"] = "1"
    return env


def run(cmd: list[str], cwd: Path, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([str(c) for c in cmd], cwd=cwd, env=clean_env(), capture_output=True,
                          text=True, timeout=timeout)
    return succeeded(done)


def succeeded(done: subprocess.CompletedProcess[str]) -> subprocess.CompletedProcess[str]:
    assert done.returncode == 0, (
        f"{' '.join(map(str, done.args))} exited {done.returncode}\n"
        f"stdout:\n{done.stdout[-4000:]}\nstderr:\n{done.stderr[-4000:]}")
    return done


def run_together(cmds: list[list[str]], cwd: Path,
                 timeout: float = 240) -> list[subprocess.CompletedProcess[str]]:
    """``run`` for commands that do not depend on each other, started at once (each spends
    its time importing torch)."""
    procs = [subprocess.Popen([str(c) for c in cmd], cwd=cwd, env=clean_env(), text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for cmd in cmds]
    try:
        done = []
        for proc in procs:
            out, err = proc.communicate(timeout=timeout)
            done.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
        return [succeeded(d) for d in done]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def repo_packages() -> dict[str, Path]:
    """Every package in the repository's package folders: dotted name -> folder. A folder is
    named after the innermost package-dir entry that holds it."""
    mapped = {(ROOT / folder).resolve(): package for package, folder in PACKAGE_DIRS.items()}
    found = {}
    for folder in SOURCE_FOLDERS:
        for init in sorted((ROOT / folder).rglob("__init__.py")):
            if "__pycache__" in init.parts:
                continue
            here, rel = init.parent.resolve(), []
            while here not in mapped:
                rel.insert(0, here.name)
                here = here.parent
            found[".".join([mapped[here], *rel])] = init.parent
    return found


def copy_sources(dest: Path) -> Path:
    """The files a build reads, copied to ``dest`` (a clone without git's files)."""
    dest.mkdir(parents=True)
    for f in ROOT.iterdir():
        if f.is_file() and (f.name == "pyproject.toml" or f.name.startswith(("README",
                                                                                "LICENSE"))):
            shutil.copy2(f, dest / f.name)
    for folder in SOURCE_FOLDERS:
        shutil.copytree(ROOT / folder, dest / folder, ignore=SOURCE_IGNORE)
    return dest


def wheel_path(package: str) -> str:
    return package.replace(".", "/")


# -- building -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    work = tmp_path_factory.mktemp("wheel")
    src = copy_sources(work / "src")
    out = work / "dist"
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
         "--no-index", "-w", out, src], cwd=work)
    wheels = list(out.glob("tierstore-*.whl"))
    assert len(wheels) == 1, list(out.iterdir())
    try:
        yield wheels[0]
    finally:
        shutil.rmtree(work, ignore_errors=True)


def test_wheel_has_one_top_level_package(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
    top = {n.split("/", 1)[0] for n in names}
    dist_info = {t for t in top if t.startswith("tierstore-") and t.endswith(".dist-info")}
    assert len(dist_info) == 1, top
    assert top == {"tierstore", *dist_info}, f"unexpected top-level entries: {top - dist_info}"
    for package in ("tierstore/cache/", "tierstore/nvme/", "tierstore/pmem/",
                    "tierstore/trainer/", "tierstore/bench/", "tierstore/daemon/"):
        assert any(n.startswith(package) for n in names), f"{package} is not in the wheel"


def test_wheel_holds_every_subpackage_and_module(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
    packages = repo_packages()
    assert "tierstore.cache" in packages and "tierstore.trainer" in packages
    missing_packages = [p for p in packages if f"{wheel_path(p)}/__init__.py" not in names]
    assert not missing_packages, (
        f"subpackages missing from the wheel (add them to [tool.setuptools] packages in "
        f"pyproject.toml): {missing_packages}")
    missing_modules = [
        f"{wheel_path(p)}/{m.name}" for p, folder in packages.items()
        for m in sorted(folder.glob("*.py")) if f"{wheel_path(p)}/{m.name}" not in names]
    assert not missing_modules, f"modules missing from the wheel: {missing_modules}"


def test_wheel_entry_points_name_modules_it_holds(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as zf:
        (ep_file,) = [n for n in zf.namelist() if n.endswith(".dist-info/entry_points.txt")]
        text = zf.read(ep_file).decode()
        names = set(zf.namelist())
    assert "tierstore = tierstore.cli:main" in text
    targets = [line.split("=", 1)[1].strip().split(":")[0] for line in text.splitlines()
               if "=" in line and not line.startswith("[")]
    assert targets
    for module in targets:
        path = wheel_path(module)
        assert f"{path}.py" in names or f"{path}/__init__.py" in names, (
            f"entry point module {module} is not in the wheel")


# -- installing -----------------------------------------------------------------------------
def fresh_environment(work: Path) -> Path:
    """A new environment that sees the current one's packages but not its tierstore (see the
    module docstring); its python."""
    env_dir = work / "env"
    run([sys.executable, "-m", "venv", "--without-pip", env_dir], cwd=work)
    python = env_dir / "bin" / "python"
    purelib = Path(run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                       cwd=work).stdout.strip())
    deps = [p for p in site.getsitepackages() if Path(p).is_dir()]
    (purelib / "current-environment.pth").write_text("".join(f"{p}\n" for p in deps))
    return python


@pytest.fixture(scope="module")
def venv_python(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The python of a fresh environment with the wheel installed (see the module docstring)."""
    work = tmp_path_factory.mktemp("venv")
    python = fresh_environment(work)
    run([sys.executable, "-m", "pip", "--python", python, "install", "--no-deps",
         "--no-index", wheel], cwd=work)
    try:
        yield python
    finally:
        shutil.rmtree(work, ignore_errors=True)


IMPORT_CHECK = textwrap.dedent("""
    import importlib.util, json, sys
    import tierstore, tierstore.cache, tierstore.nvme, tierstore.pmem
    import tierstore.trainer, tierstore.bench
    print(json.dumps({
        "files": {m: sys.modules[m].__file__ for m in (
            "tierstore", "tierstore.cache", "tierstore.nvme", "tierstore.pmem",
            "tierstore.trainer", "tierstore.bench")},
        "bare": {n: importlib.util.find_spec(n) is not None for n in %r},
        "loaded": sorted(n for n in %r if n in sys.modules),
    }))
""") % (BARE, BARE)


def test_installed_wheel_imports_without_the_repository(venv_python: Path,
                                                       tmp_path: Path) -> None:
    done = run([venv_python, "-c", IMPORT_CHECK], cwd=tmp_path)
    out = json.loads(done.stdout.strip().splitlines()[-1])
    env_dir = venv_python.parent.parent
    for module, file in out["files"].items():
        assert Path(file).resolve().is_relative_to(env_dir.resolve()), (
            f"{module} was imported from {file}, not from the fresh environment")
        assert not Path(file).resolve().is_relative_to(ROOT), file
    assert out["bare"] == dict.fromkeys(BARE, False), (
        f"bare names importable in the fresh environment: {out['bare']}")
    assert out["loaded"] == []


def test_installed_console_script_runs(venv_python: Path, tmp_path: Path) -> None:
    script = venv_python.parent / "tierstore"
    assert script.is_file(), "the wheel installed no tierstore console script"
    done = run([venv_python, script, "--help"], cwd=tmp_path)
    for command in ("serve", "fsck", "demo", "bench"):
        assert command in done.stdout, f"`tierstore --help` does not list {command}"


# -- a working directory full of look-alike modules -----------------------------------------
HOSTILE_MODULES = {
    "cache.py": "raise ImportError('the bare name cache was imported')\n",
    "trainer.py": "POLICIES = None\nENGINES = None\n",
    "bench.py": "raise ImportError('the bare name bench was imported')\n",
    "nvme.py": "ENGINES = None\nSlabMedium = None\n",
    "pmem.py": "raise ImportError('the bare name pmem was imported')\n",
}

HOSTILE_SCRIPT = textwrap.dedent("""
    import os, subprocess, sys
    from pathlib import Path

    here = Path(__file__).resolve().parent
    assert Path(sys.path[0]).resolve() == here and Path.cwd().resolve() == here

    import torch
    import tierstore
    import tierstore.bench
    import tierstore.cache
    import tierstore.trainer
    assert tierstore.cache.POLICIES, "tierstore.cache is the look-alike"

    for cache in ("4MiB", 0):
        with tierstore.open(here / f"store{cache}", create=True, slab_size="8MiB",
                            host_cache=cache) as st:
            st.put("layers.0.experts.0.w1", torch.arange(12, dtype=torch.float32))
            st.flush()
            got = st.get("layers.0.experts.0.w1")
            assert torch.equal(got, torch.arange(12, dtype=torch.float32))
            assert st.fsck().ok

    commands = [[sys.executable, "-m", "tierstore.cli", "demo", "--help"]]
    script = Path(sys.executable).parent / "tierstore"
    if script.is_file():
        commands.append([str(script), "demo", "--help"])
    for cmd in commands:
        done = subprocess.run(cmd, cwd=here, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, (cmd, done.stdout, done.stderr)
        assert "Usage" in done.stdout and "demo" in done.stdout, done.stdout

    loaded = [n for n in ("cache", "nvme", "pmem", "trainer", "bench") if n in sys.modules]
    assert not loaded, f"look-alike modules were imported: {loaded}"
    print("ok")
""")


@pytest.fixture(params=["current", "installed"])
def python_for(request: pytest.FixtureRequest) -> Path:
    if request.param == "current":
        return Path(sys.executable)
    return request.getfixturevalue("venv_python")


def test_lookalike_modules_in_the_working_directory_are_never_imported(
        python_for: Path, tmp_path: Path) -> None:
    here = tmp_path / "hostile"
    here.mkdir()
    for name, text in HOSTILE_MODULES.items():
        (here / name).write_text(text)
    (here / "script.py").write_text(HOSTILE_SCRIPT)
    try:
        done = run([python_for, "script.py"], cwd=here)
        assert done.stdout.strip().splitlines()[-1] == "ok", done.stdout
    finally:
        for store in here.glob("store*"):
            shutil.rmtree(store, ignore_errors=True)


# -- every documented way in, from the clone's root and from elsewhere ----------------------
@pytest.fixture(scope="module")
def editable_clone(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Path]]:
    """A copy of the sources installed editable into a fresh environment: (python, clone)."""
    work = tmp_path_factory.mktemp("editable")
    clone = copy_sources(work / "clone")
    python = fresh_environment(work)
    run([sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-index",
         "--no-build-isolation", "-e", clone], cwd=work)
    try:
        yield python, clone
    finally:
        shutil.rmtree(work, ignore_errors=True)


MODULE_FILES = textwrap.dedent("""
    import json, sys
    import tierstore, tierstore.cache, tierstore.nvme, tierstore.pmem
    import tierstore.trainer.commands, tierstore.bench.commands
    print(json.dumps([[n, m.__file__] for n, m in list(sys.modules.items())
                      if isinstance(getattr(m, "__file__", None), str)]))
""")


@pytest.mark.parametrize("where", ["root", "elsewhere"])
@pytest.mark.parametrize("kind", ["regular", "editable"])
def test_documented_commands_work_from_the_clone_root_and_elsewhere(
        kind: str, where: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    if kind == "regular":
        # The repository itself is the clone whose tierstore/ shadows the installed copy.
        python, clone = request.getfixturevalue("venv_python"), ROOT
        installed = python.parent.parent
    else:
        python, clone = request.getfixturevalue("editable_clone")
        installed = clone
    cwd = clone if where == "root" else tmp_path
    expected = clone if where == "root" else installed

    store = tmp_path / "store"
    cmds = [[python, "-m", "tierstore", "--help"],
            [python, "-m", "tierstore", "init", store, "--slab-size", "8MiB"],
            [python, "-m", "tierstore", "train", "--help"],
            [python, "-c", MODULE_FILES]]
    if where == "root":
        cmds.append([python.parent / "tierstore", "--help"])
    if where == "root" and kind == "regular":  # the README's torchrun line
        cmds.append([python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                     "1", "-m", "tierstore", "train", "--help"])
    top, init, train, modules, *rest = run_together(cmds, cwd)
    for done in (top, *rest[:1]):
        for command in ("serve", "fsck", "train", "generate", "bench"):
            assert command in done.stdout, f"{done.args} does not list {command}"
    assert init.stdout.startswith(f"created {store}"), init.stdout
    for done in (train, *rest[1:]):
        assert "Usage: python -m tierstore train" in done.stdout, done.stdout

    # Every tierstore module from one tree, each under one name only.
    done = modules
    loaded = json.loads(done.stdout.strip().splitlines()[-1])
    ours = [(name, Path(file).resolve()) for name, file in loaded
            if name == "tierstore" or name.startswith("tierstore.")]
    assert len(ours) > 20
    for name, file in ours:
        assert file.is_relative_to(expected.resolve()), f"{name} was imported from {file}"
    sources = [tree / folder for tree in {ROOT, clone.resolve()} for folder in SOURCE_FOLDERS]
    files = [Path(file).resolve() for _, file in loaded]
    ours_files = {file for _, file in ours}
    twice = {str(f) for f in files if files.count(f) > 1
             and (f in ours_files or any(f.is_relative_to(s) for s in sources))}
    assert not twice, f"modules imported under two names: {twice}"


def test_a_subpackage_mapped_in_pyproject_needs_nothing_else(tmp_path: Path) -> None:
    """One line in package-dir maps a folder inside another mapped folder (as trainer/hf will
    be), from a source tree; the name its location would give it is refused."""
    clone = copy_sources(tmp_path / "clone")
    (clone / "trainer" / "extra").mkdir()
    (clone / "trainer" / "extra" / "__init__.py").write_text("NAME = 'extra'\n")
    pyproject = clone / "pyproject.toml"
    line = '"tierstore.trainer" = "trainer"\n'
    assert line in pyproject.read_text()
    pyproject.write_text(pyproject.read_text().replace(
        line, line + '"tierstore.extra" = "trainer/extra"\n'))
    script = textwrap.dedent("""
        import tierstore.cache, tierstore.extra
        print(tierstore.extra.NAME, tierstore.extra.__file__, tierstore.cache.__file__)
        try:
            import tierstore.trainer.extra
        except ModuleNotFoundError as e:
            print("refused:", e)
    """)
    done = run([sys.executable, "-c", script], cwd=clone)
    name, extra, cache, *_ = done.stdout.split()
    assert name == "extra"
    assert Path(extra) == clone / "trainer" / "extra" / "__init__.py"
    assert Path(cache) == clone / "cache" / "__init__.py"  # not the editable install's tree
    assert "refused: No module named 'tierstore.trainer.extra' (tierstore.extra" in done.stdout


def test_the_reader_without_tomllib_agrees_with_tomllib(monkeypatch: pytest.MonkeyPatch) -> None:
    from tierstore import _source_tree

    monkeypatch.setattr(_source_tree, "tomllib", None)
    assert _source_tree.package_dirs(ROOT / "pyproject.toml") == PACKAGE_DIRS
    assert "tierstore.cache" in PACKAGE_DIRS
