"""Shared test setup.

- ``gpu`` marker: tests marked ``@pytest.mark.gpu`` are skipped where CUDA is absent.
- ``slow`` marker: long campaigns (crash loops, 256 MiB entries, four-rank runs, DeepSpeed's
  JIT-built ops) run only with ``--slow`` (``scripts/test.sh --slow``), so the default run
  fits CI's budget on 2 cores.
- ``backing``: every store test runs once per backing tier (``nvme``, ``pmem``), and the
  NVMe tier once more on the fallback I/O engine: ``nvme`` opens stores with the engine
  ``auto`` picks (Linux AIO where it runs), ``nvme-posix`` with the thread-pool engine.
  The fixture's value is the tier (``nvme`` for both); select with ``-k "not pmem"`` etc.
- ``make_store``: a factory that opens stores on the parametrized backing, closes them at
  teardown and then deletes their files (slabs and pools are preallocated: hundreds of
  tests would otherwise leave gigabytes behind in pytest's retained temp directories);
  ``store`` is one such store at the default path (with the default host cache).
- ``cache_kw``: ``{}`` (the default host cache: puts land in memory, ``flush()`` commits) or
  ``{"host_cache": 0}`` (every put committed before it returns), for tests whose subject
  behaves differently on the two paths.
- ``other_user``: a second, real user of this machine, made for the test (``useradd``) and
  removed after it, with a folder both users may write to (``shared``, mode 1777 like
  /tmp) and ``serve``, which starts that user's own ``tierstore serve``. Skipped, saying
  why, where users cannot be made (not root, no ``useradd``).
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

import tierstore

BACKINGS = ("nvme", "nvme-posix", "pmem")
ENGINE_OF = {"nvme-posix": "posix-direct"}  # engines besides auto's, by test id

# Options that only mean something to one backing; make_store drops the other backing's.
_NVME_ONLY = {"slab_size"}
_PMEM_ONLY = {"pmem_path", "pmem_size"}


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--slow", action="store_true",
                     help="also run the tests marked slow (long campaigns)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    no_gpu = pytest.mark.skip(reason="needs CUDA (torch.cuda.is_available() is false)")
    no_slow = pytest.mark.skip(reason="a long campaign: run with --slow")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(no_gpu)
        if "slow" in item.keywords and not config.getoption("--slow"):
            item.add_marker(no_slow)


@pytest.fixture
def one_thread() -> Iterator[None]:
    """One intra-op thread for the test: tiny tensors gain nothing from more, and on a busy
    machine OpenMP waits for them cost up to a hundred times the work (a 64-channel conv1d:
    7 ms instead of 0.07). It also fixes how a kernel splits its sums: on an AMD EPYC VM,
    two threads put DeepSeek-V3 adapters trained over the store 3.6e-5 from transformers'
    own after two AdamW steps (within 1e-5 on the Intel VM of earlier runs, and here with
    one thread)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(params=BACKINGS)
def backing(request: pytest.FixtureRequest) -> str:
    return str(request.param).split("-")[0]


def engine_of(request: pytest.FixtureRequest) -> str | None:
    """The I/O engine the test's ``backing`` id names (None: what ``auto`` picks)."""
    params = getattr(request.node, "callspec", None)
    return ENGINE_OF.get(params.params.get("backing", "")) if params else None


def backing_options(backing: str, path: Path, default_pool: Path | None = None) -> dict[str, Any]:
    """Creation options for a small store at ``path`` on ``backing``. (A pmem store grows
    its pool by at least 64 MiB at a time, so a small pool also exercises pool growth.)"""
    if backing == "nvme":
        return {"backing": "nvme", "slab_size": "8MiB"}
    pool = default_pool if default_pool is not None else Path(f"{path}.pool")
    return {"backing": "pmem", "pmem_path": str(pool), "pmem_size": "16MiB"}


class StoreFactory:
    """``make_store(path=None, *, reopen=False, **kw)``.

    Creates a store (``create=True`` with the backing's small defaults, overridden by
    ``kw``) or, with ``reopen=True``, opens an existing one with only ``kw``. Options that
    belong to the other backing (``slab_size`` vs ``pmem_path``/``pmem_size``) are dropped,
    so one call serves both backings.
    """

    def __init__(self, backing: str, tmp_path: Path, engine: str | None = None) -> None:
        self.backing = backing
        self.engine = engine
        self.tmp_path = tmp_path
        self.default_path = tmp_path / "store"
        self.opened: list[tierstore.Store] = []
        self.created: list[Path] = []  # store directories and pool files, to delete

    def options(self, path: str | os.PathLike[str] | None = None, **kw: Any) -> dict[str, Any]:
        p = Path(path) if path is not None else self.default_path
        pool = self.tmp_path / "pool" if p == self.default_path else None
        opts = backing_options(self.backing, p, pool)
        if self.engine is not None and self.backing == "nvme":
            opts["engine"] = self.engine
        opts.update(kw)
        drop = _PMEM_ONLY if self.backing == "nvme" else _NVME_ONLY
        return {k: v for k, v in opts.items() if k not in drop}

    def __call__(
        self, path: str | os.PathLike[str] | None = None, *, reopen: bool = False, **kw: Any
    ) -> tierstore.Store:
        p = Path(path) if path is not None else self.default_path
        if reopen:
            if self.engine is not None and self.backing == "nvme":
                kw.setdefault("engine", self.engine)
            st = tierstore.open(p, **kw)
        else:
            opts = self.options(p, **kw)
            self.created.append(p)
            if "pmem_path" in opts:
                self.created.append(Path(opts["pmem_path"]))
            st = tierstore.open(p, create=True, **opts)
        self.opened.append(st)
        return st

    def close_all(self) -> None:
        try:
            for st in reversed(self.opened):
                st.close()
        finally:
            for p in self.created:
                if p.is_dir() and not p.is_symlink():
                    shutil.rmtree(p, ignore_errors=True)
                else:
                    with contextlib.suppress(FileNotFoundError):
                        p.unlink()


@pytest.fixture(params=["cache", "nocache"])
def cache_kw(request: pytest.FixtureRequest) -> dict[str, Any]:
    return {} if request.param == "cache" else {"host_cache": 0}


@pytest.fixture
def make_store(backing: str, tmp_path: Path,
               request: pytest.FixtureRequest) -> Iterator[StoreFactory]:
    factory = StoreFactory(backing, tmp_path, engine_of(request))
    try:
        yield factory
    finally:
        factory.close_all()


@pytest.fixture
def store(make_store: Callable[..., tierstore.Store]) -> tierstore.Store:
    return make_store()


@dataclass
class OtherUser:
    """A second user of this machine (see ``other_user``)."""

    name: str
    uid: int
    gid: int
    shared: Path  # a folder both users may write to, as /tmp is

    def own(self, path: Path, mode: int) -> None:
        """``path`` as this user made it, with ``mode``."""
        os.chown(path, self.uid, self.gid)
        os.chmod(path, mode)

    def serve(self, store: Path, sock: Path, *extra: str) -> subprocess.Popen[bytes]:
        """This user's own ``tierstore serve --create``, once it answers (its log beside
        the socket's folder)."""
        log = self.shared / f"serve-{uuid.uuid4().hex[:8]}.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                [sys.executable, str(Path(__file__).with_name("as_user.py")), str(self.uid),
                 str(self.gid), "serve", "--create", "--store", str(store), "--socket",
                 str(sock), "--host-cache", "16MiB", *extra],
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 90
        while "tierstore serve: serving" not in log.read_text(errors="replace"):
            if proc.poll() is not None:
                raise AssertionError(f"{self.name}'s daemon exited: {log.read_text()}")
            assert time.monotonic() < deadline, f"{self.name}'s daemon did not start"
            time.sleep(0.05)
        return proc


@pytest.fixture
def other_user() -> Iterator[OtherUser]:
    if os.geteuid() != 0:
        pytest.skip("a second user can be made only by root (useradd)")
    useradd, userdel = shutil.which("useradd"), shutil.which("userdel")
    if useradd is None or userdel is None:
        pytest.skip("useradd/userdel are not installed: no second user can be made")
    name = f"tsother{uuid.uuid4().hex[:8]}"
    made = subprocess.run([useradd, "--system", "--user-group", "--no-create-home", "--shell",
                           "/usr/sbin/nologin", name], capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"useradd could not make a second user: {made.stderr.strip()}")
    shared = Path(tempfile.mkdtemp(prefix="tierstore-shared-", dir="/tmp"))
    try:
        os.chmod(shared, 0o1777)
        pw = pwd.getpwnam(name)
        yield OtherUser(name, pw.pw_uid, pw.pw_gid, shared)
    finally:
        shutil.rmtree(shared, ignore_errors=True)
        subprocess.run([userdel, name], capture_output=True)
