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

pytestmark = pytest.mark.timeout(300)

ROOT = Path(__file__).resolve().parent.parent
# Repository folder -> the package it installs as.
PACKAGE_DIRS = {
    "tierstore": "tierstore",
    "cache": "tierstore.cache",
    "nvme": "tierstore.nvme",
    "pmem": "tierstore.pmem",
    "trainer": "tierstore.trainer",
    "bench": "tierstore.bench",
}
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
    assert done.returncode == 0, (
        f"{' '.join(map(str, cmd))} exited {done.returncode}\n"
        f"stdout:\n{done.stdout[-4000:]}\nstderr:\n{done.stderr[-4000:]}")
    return done


def repo_packages() -> dict[str, Path]:
    """Every package in the repository's package folders: dotted name -> folder."""
    found = {}
    for folder, package in PACKAGE_DIRS.items():
        base = ROOT / folder
        for init in sorted(base.rglob("__init__.py")):
            rel = init.parent.relative_to(base)
            if "__pycache__" in rel.parts:
                continue
            found[".".join([package, *rel.parts])] = init.parent
    return found


def wheel_path(package: str) -> str:
    return package.replace(".", "/")


# -- building -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    work = tmp_path_factory.mktemp("wheel")
    src = work / "src"
    src.mkdir()
    for f in ROOT.iterdir():
        if f.is_file() and (f.name == "pyproject.toml" or f.name.startswith(("README",
                                                                                "LICENSE"))):
            shutil.copy2(f, src / f.name)
    for folder in PACKAGE_DIRS:
        shutil.copytree(ROOT / folder, src / folder, ignore=SOURCE_IGNORE)
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
@pytest.fixture(scope="module")
def venv_python(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The python of a fresh environment with the wheel installed (see the module docstring)."""
    work = tmp_path_factory.mktemp("venv")
    env_dir = work / "env"
    run([sys.executable, "-m", "venv", "--without-pip", env_dir], cwd=work)
    python = env_dir / "bin" / "python"
    purelib = Path(run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                       cwd=work).stdout.strip())
    deps = [p for p in site.getsitepackages() if Path(p).is_dir()]
    (purelib / "current-environment.pth").write_text("".join(f"{p}\n" for p in deps))
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
