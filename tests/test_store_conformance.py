"""One suite, every store: the same calls, the same answers, the same errors.

Every test here runs once per implementation of :class:`tierstore.Store`, through the
``subject`` fixture:

- ``nvme-cache`` / ``nvme-nocache``: a local store on NVMe slab files, with a small host
  cache and with none (``host_cache=0``, every put committed before it returns);
- ``pmem-cache`` / ``pmem-nocache``: the same on a persistent-memory pool (a plain file:
  libpmem where it is installed, else the mmap fallback, as the rest of the suite runs it);
- ``daemon-nvme`` / ``daemon-pmem``: a ``tierstore.connect`` client of a daemon serving such
  a store (a daemon always has a host cache: clients read out of it). The daemon runs in
  this process, on a thread, so that each test gets a store of its own cheaply;
  ``test_real_serve_process`` runs a real ``tierstore serve`` once.

Only the public interface is used. Where the documented behaviour legitimately differs (an
uncached store never renews a borrow, ``info`` of an unflushed entry may say ``"host"``),
the test says so and keys the difference off ``capabilities`` or the fixture's own
parameters, never off the implementation's class.
"""

# Over 600 lines: it is the interface's whole contract, one section per part of the API,
# all sharing one fixture; split, the parts would each need the harness and drift apart.
from __future__ import annotations

import contextlib
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import tierstore

pytestmark = pytest.mark.timeout(120)

# nvme-*: the engine auto picks (Linux AIO where it runs); nvme-posix-*: the thread pool.
IMPLS = ("nvme-cache", "nvme-nocache", "nvme-posix-nocache", "pmem-cache", "pmem-nocache", "daemon-nvme",
         "daemon-pmem")
HOST_CACHE = "4MiB"  # local stores with a cache
DAEMON_CACHE = "8MiB"
PAGE = 4096


# -- the stores under test ------------------------------------------------------------------
class Subject:
    """One implementation under test, with ``store`` open on a fresh, empty store.

    ``reopen()`` replaces ``store`` with one that sees only what reached the backing tier:
    a local store is closed and opened again; for a daemon, the client disconnects, the
    daemon stops (it flushes) and a new daemon and client start on the same store.
    ``new_client()`` (daemon only) connects a second client to the running daemon.
    ``close()`` closes everything and deletes every file the subject made.
    """

    def __init__(self, impl: str, root: Path) -> None:
        self.impl = impl
        self.backing = "pmem" if "pmem" in impl else "nvme"
        self.engine = {"engine": "posix-direct"} if "posix" in impl else {}
        self.remote = impl.startswith("daemon")
        self.cached = self.remote or impl.endswith("-cache")
        self.root = root
        self.path = root / "store"
        self.pool = root / "pool"
        self.opened: list[Any] = []
        self.logs: list[str] = []
        self._server: Any = None
        self._thread: threading.Thread | None = None
        # Unix socket paths are limited to 107 bytes: pytest's tmp_path may be longer.
        self._sockdir = Path(tempfile.mkdtemp(prefix="tsconf-")) if self.remote else None
        self.sock = self._sockdir / "s.sock" if self._sockdir is not None else None
        try:
            if self.remote:
                tierstore.open(self.path, create=True, host_cache=0, **self._options()).close()
                self._start_daemon()
                self.store = self._connect()
            else:
                self.store = self._open(create=True)
        except BaseException:
            self.close()
            raise

    def _options(self) -> dict[str, Any]:
        if self.backing == "nvme":
            return {"backing": "nvme", "slab_size": "8MiB"}
        return {"backing": "pmem", "pmem_path": str(self.pool), "pmem_size": "16MiB"}

    def _open(self, create: bool = False) -> Any:
        cache = HOST_CACHE if self.cached else 0
        if create:
            st = tierstore.open(self.path, create=True, host_cache=cache, **self.engine,
                                **self._options())
        else:
            st = tierstore.open(self.path, host_cache=cache, **self.engine)
        self.opened.append(st)
        return st

    def _start_daemon(self) -> None:
        from tierstore.daemon.server import Server

        self._server = Server(str(self.path), str(self.sock), host_cache=DAEMON_CACHE,
                              log=self.logs.append)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True,
                                        name="conformance-daemon")
        self._thread.start()

    def _stop_daemon(self) -> None:
        if self._server is None:
            return
        server, thread, self._server, self._thread = self._server, self._thread, None, None
        server.stop()
        if thread is not None:
            thread.join(60)
            assert not thread.is_alive(), "the daemon did not stop"

    def _connect(self) -> Any:
        st = tierstore.connect(self.sock)
        self.opened.append(st)
        return st

    def new_client(self) -> Any:
        assert self.remote
        return self._connect()

    def reopen(self) -> Any:
        self.store.close()
        if self.remote:
            self._stop_daemon()
            self._start_daemon()
            self.store = self._connect()
        else:
            self.store = self._open()
        return self.store

    def close(self) -> None:
        try:
            for st in reversed(self.opened):
                with contextlib.suppress(Exception):
                    st.close()
            self._stop_daemon()
        finally:
            for p in (self.path, self._sockdir):
                if p is not None:
                    shutil.rmtree(p, ignore_errors=True)
            with contextlib.suppress(FileNotFoundError):
                self.pool.unlink()
        internal = [m for m in self.logs if "internal error" in m]
        assert not internal, internal


@pytest.fixture(params=IMPLS)
def subject(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Subject]:
    s = Subject(request.param, tmp_path)
    try:
        yield s
    finally:
        s.close()


@pytest.fixture
def st(subject: Subject) -> Any:
    return subject.store


@contextlib.contextmanager
def every_subject(root: Path) -> Iterator[dict[str, Subject]]:
    """A fresh store of every implementation at once."""
    made: dict[str, Subject] = {}
    try:
        for impl in IMPLS:
            d = root / impl
            d.mkdir()
            made[impl] = Subject(impl, d)
        yield made
    finally:
        for s in made.values():
            s.close()


# -- helpers --------------------------------------------------------------------------------
def same(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Equal dtype, shape and bytes (bit for bit: NaNs and -0.0 included)."""
    if got.dtype != want.dtype or tuple(got.shape) != tuple(want.shape):
        return False
    if want.numel() == 0:
        return True
    g = got.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    w = want.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    return torch.equal(g, w)


def sample(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_complex:
        return torch.randn(shape, dtype=dtype, generator=g)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(max(info.min, -1000), min(info.max, 1000) + 1, shape, generator=g,
                         dtype=torch.int64).to(dtype)


DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8,
          torch.uint8, torch.int16, torch.int32, torch.int64, torch.bool, torch.complex64]
if hasattr(torch, "float8_e4m3fn"):
    DTYPES.append(torch.float8_e4m3fn)
SHAPES = [(), (0,), (2, 0, 3), (1,), (7,), (3, 5), (2, 3, 4), (64, 257)]


def dtype_shape_cases() -> dict[str, torch.Tensor]:
    cases = {}
    for i, dtype in enumerate(DTYPES):
        for j, shape in enumerate(SHAPES):
            name = f"t.{str(dtype).removeprefix('torch.')}.{'x'.join(map(str, shape)) or 'scalar'}"
            cases[name] = sample(dtype, shape, seed=100 * i + j)
    return cases


def raises_type(fn: Callable[[], Any]) -> type[BaseException] | None:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 (the type is the result)
        return type(e)
    return None


# -- what a store is ------------------------------------------------------------------------
def test_is_a_store_and_declares_capabilities(subject: Subject, st: Any) -> None:
    assert isinstance(st, tierstore.Store)
    caps = st.capabilities
    assert isinstance(caps, tierstore.Capabilities)
    assert isinstance(caps.zero_copy, bool)
    assert caps.remote is subject.remote
    assert caps.backing == subject.backing == st.backing
    assert caps.host_cache is subject.cached
    # Lending the host cache's own memory needs a cache in this process.
    assert not caps.zero_copy or (subject.cached and not subject.remote)
    if subject.remote:
        assert isinstance(st, tierstore.RemoteStore)
    else:
        assert isinstance(st, tierstore.LocalStore)


def test_describe_names_the_backing(st: Any) -> None:
    text = st.describe()
    assert isinstance(text, str) and st.backing in text


# -- round trips ----------------------------------------------------------------------------
def test_round_trip_of_dtypes_and_shapes(st: Any) -> None:
    cases = dtype_shape_cases()
    for name, t in list(cases.items())[::2]:  # half one at a time, half in one batch
        st.put(name, t)
    st.put_many({n: t for n, t in list(cases.items())[1::2]})
    for name, t in cases.items():
        got = st.get(name)
        assert same(got, t), name
        info = st.info(name)
        assert (info.dtype, info.shape, info.nbytes) == (t.dtype, tuple(t.shape),
                                                         t.numel() * t.element_size()), name
    got = st.get_many(list(cases))
    assert list(got) == list(cases)
    for name, t in cases.items():
        assert same(got[name], t), name


def test_round_trip_of_odd_inputs(st: Any) -> None:
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    cases = {
        "transposed": base.t(),  # not contiguous
        "strided": base[:, ::2],
        "sliced": base[1:3],  # an offset into its storage
        "grad": torch.ones(3, requires_grad=True),
        "scalar.bf16": torch.tensor(1.5, dtype=torch.bfloat16),
        "empty.bf16": torch.empty(0, 5, dtype=torch.bfloat16),
        "nan": torch.tensor([float("nan"), -0.0, float("inf")]),
    }
    st.put_many(cases)
    for name, t in cases.items():
        got = st.get(name)
        assert same(got, t.detach()), name
        assert got.is_contiguous() and not got.requires_grad


def test_get_returns_a_tensor_of_its_own(st: Any) -> None:
    t = torch.arange(100, dtype=torch.int32)
    st.put("w", t)
    a = st.get("w")
    a.add_(1)  # the caller's to change
    b = st.get("w")
    assert same(b, t)
    b.zero_()
    assert same(st.get_many(["w"])["w"], t)
    assert same(st.get("w"), t)


def test_put_many_forms_and_get_many_keys(st: Any) -> None:
    a, b, c = torch.randn(10), torch.arange(7), torch.ones(3, 3, dtype=torch.bfloat16)
    v1 = st.put_many({"m.a": a, "m.b": b})
    v2 = st.put_many([("p.a", a), ("p.b", b)], kind="grad")
    v3 = st.put_many([("t.a", "exp_avg", a), ("t.c", "master", c), ("t.b", b)], kind="grad")
    assert st.put_many([]) == [] and st.put_many({}) == []
    assert (len(v1), len(v2), len(v3)) == (2, 2, 3)
    versions = v1 + v2 + v3
    assert versions == sorted(versions) and len(set(versions)) == len(versions)
    assert ("p.a", "grad") in st and "p.a" not in st
    assert ("t.b", "grad") in st and ("t.c", "master") in st

    got = st.get_many(["m.a", "m.b"])
    assert list(got) == ["m.a", "m.b"] and same(got["m.a"], a) and same(got["m.b"], b)
    got = st.get_many(["p.a", "p.b"], kind="grad")
    assert same(got["p.a"], a) and same(got["p.b"], b)
    mixed = st.get_many([("t.a", "exp_avg"), ("t.c", "master"), "m.b"])
    assert list(mixed) == [("t.a", "exp_avg"), ("t.c", "master"), "m.b"]
    assert same(mixed[("t.a", "exp_avg")], a) and same(mixed[("t.c", "master")], c)
    assert st.get_many([]) == {}


def test_out_receives_values_in_place(st: Any) -> None:
    a, b = torch.randn(4, 8), torch.arange(5, dtype=torch.int16)
    st.put_many({"a": a, "b": b})
    st.put("g", a * 2, kind="grad")
    out = torch.empty(4, 8)
    got = st.get("a", out=out)
    assert got.data_ptr() == out.data_ptr() and same(out, a)
    outs = {"a": torch.zeros(4, 8), ("g", "grad"): torch.zeros(4, 8)}
    got = st.get_many(["a", "b", ("g", "grad")], out=outs)
    assert got["a"].data_ptr() == outs["a"].data_ptr() and same(outs["a"], a)
    assert got[("g", "grad")].data_ptr() == outs[("g", "grad")].data_ptr()
    assert same(outs[("g", "grad")], a * 2)
    assert same(got["b"], b)  # no out given: a tensor of its own
    # A non-contiguous out is filled as well.
    wide = torch.zeros(8, 4)
    st.get("a", out=wide.t())
    assert same(wide.t().contiguous(), a)
    with pytest.raises(tierstore.ShapeMismatchError):
        st.get("a", out=torch.empty(8, 4))
    with pytest.raises(tierstore.ShapeMismatchError):
        st.get("a", out=torch.empty(4, 8, dtype=torch.float64))
    with pytest.raises(tierstore.ShapeMismatchError):
        st.get_many(["a", "b"], out={"b": torch.empty(5, dtype=torch.int32)})
    assert same(st.get("a"), a)


def test_kinds_are_separate_entries(st: Any) -> None:
    assert "param" in tierstore.KINDS
    values = {k: torch.full((3,), float(i)) for i, k in enumerate(tierstore.KINDS)}
    values["my_state2"] = torch.full((2, 2), -1.0)  # any lowercase identifier is a kind
    for k, t in values.items():
        st.put("w", t, kind=k)
    for k, t in values.items():
        assert same(st.get("w", kind=k), t), k
        assert ("w", k) in st and st.info("w", k).kind == k
    assert same(st.get("w"), values["param"])  # kind defaults to param
    assert st.keys() == sorted(("w", k) for k in values)
    st.delete("w", "grad")
    assert ("w", "grad") not in st and ("w", "exp_avg") in st


def test_versions_increase(st: Any) -> None:
    v1 = st.put("w", torch.zeros(10))
    assert isinstance(v1, int) and st.info("w").version == v1
    v2 = st.put("w", torch.ones(10))
    v3 = st.put("other", torch.ones(1), kind="grad")
    v4 = st.put("w", torch.full((3, 4), 2, dtype=torch.int16))  # a new dtype and shape
    assert v1 < v2 < v3 < v4
    info = st.info("w")
    assert (info.version, info.dtype, info.shape, info.nbytes) == (v4, torch.int16, (3, 4), 24)
    batch = st.put_many({f"b{i}": torch.tensor([i]) for i in range(5)})
    assert batch == sorted(batch) and batch[0] > v4
    st.delete("w")
    v5 = st.put("w", torch.zeros(1))
    assert v5 > batch[-1], "a name used again still gets a newer version"
    st.flush()
    assert st.info("w").version == v5


def test_delete_and_missing_ok(st: Any) -> None:
    st.put("w", torch.randn(3000))
    st.put("w", torch.randn(10), kind="grad")
    st.put("flushed", torch.randn(10))
    st.flush()
    st.put("unflushed", torch.randn(10))
    assert st.delete("w") is True
    assert "w" not in st and ("w", "grad") in st
    with pytest.raises(tierstore.EntryNotFoundError):
        st.get("w")
    with pytest.raises(tierstore.EntryNotFoundError):
        st.delete("w")
    assert st.delete("w", missing_ok=True) is False
    assert st.delete("never", "grad", missing_ok=True) is False
    assert st.delete("w", "grad") is True
    assert st.delete("flushed") is True and st.delete("unflushed") is True
    assert st.keys() == []
    st.put("w", torch.arange(4))  # the name can be used again
    assert same(st.get("w"), torch.arange(4))
    st.put("e", torch.empty(0))
    assert st.delete("e") is True and "e" not in st
    assert st.fsck().ok


# -- errors ---------------------------------------------------------------------------------
def test_missing_entries_raise_entry_not_found(st: Any) -> None:
    st.put("present", torch.arange(4, dtype=torch.float32))
    calls: list[Callable[[], Any]] = [
        lambda: st.get("missing"),
        lambda: st.get("present", "grad"),
        lambda: st.get_many(["present", "missing"]),
        lambda: st.info("missing"),
        lambda: st.delete("missing"),
        lambda: st.view("missing"),
        lambda: st.borrow_many(["present", "missing"]),
    ]
    for call in calls:
        with pytest.raises(tierstore.EntryNotFoundError) as ei:
            call()
        assert "missing" in str(ei.value) or "grad" in str(ei.value)
        assert isinstance(ei.value, KeyError)  # EntryNotFoundError is a KeyError too
    assert same(st.get("present"), torch.arange(4, dtype=torch.float32))


def refusals(calls: dict[str, Callable[[], Any]], want: type[BaseException]
             ) -> dict[str, str]:
    """The calls that did not raise ``want``, with what they did instead."""
    wrong = {}
    for op, call in calls.items():
        t = raises_type(call)
        if t is None or not issubclass(t, want):
            wrong[op] = "no error" if t is None else t.__name__
    return wrong


@pytest.mark.parametrize("name", ["", "a\0b", "n" * 1000, 3, None, b"bytes"],
                         ids=["empty", "nul", "long", "int", "none", "bytes"])
def test_invalid_names_are_refused(st: Any, name: Any) -> None:
    t = torch.zeros(2)
    key = (name, "param")  # read calls take names or (name, kind) pairs: a pair for sure
    wrong = refusals({
        "put": lambda: st.put(name, t), "put_many": lambda: st.put_many([(name, t)]),
        "get": lambda: st.get(name), "get_many": lambda: st.get_many([key]),
        "delete": lambda: st.delete(name), "info": lambda: st.info(name),
        "view": lambda: st.view(name), "borrow_many": lambda: st.borrow_many([key]),
        "prefetch": lambda: st.prefetch([key], device="cpu"),
        "stage_many": lambda: st.stage_many([(name, "param", torch.float32, (2,))]),
    }, tierstore.StoreError)
    assert not wrong, f"invalid name {name!r} not refused with a StoreError: {wrong}"
    assert st.keys() == []


@pytest.mark.parametrize("kind", ["", "Param", "1x", "a-b", "k" * 40, 7],
                         ids=["empty", "upper", "digit", "dash", "long", "int"])
def test_invalid_kinds_are_refused(st: Any, kind: Any) -> None:
    t = torch.zeros(2)
    st.put("w", t)
    wrong = refusals({
        "put": lambda: st.put("w", t, kind=kind),
        "put_many": lambda: st.put_many({"x": t}, kind=kind),
        "get": lambda: st.get("w", kind), "get_many": lambda: st.get_many([("w", kind)]),
        "delete": lambda: st.delete("w", kind), "info": lambda: st.info("w", kind),
        "view": lambda: st.view("w", kind),
        "borrow_many": lambda: st.borrow_many(["w"], kind=kind),
        "prefetch": lambda: st.prefetch(["w"], device="cpu", kind=kind),
        "stage_many": lambda: st.stage_many([("w", kind, torch.float32, (2,))]),
    }, tierstore.StoreError)
    assert not wrong, f"invalid kind {kind!r} not refused with a StoreError: {wrong}"
    assert st.keys() == [("w", "param")]


@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor:UserWarning")
def test_unsupported_tensors_are_refused(st: Any) -> None:
    st.put("keep", torch.arange(3))
    for bad in (torch.eye(3).to_sparse(), [1, 2, 3], torch.quantize_per_tensor(
            torch.ones(3), 0.1, 0, torch.qint8)):
        with pytest.raises(tierstore.UnsupportedTensorError):
            st.put("bad", bad)
        with pytest.raises(tierstore.UnsupportedTensorError):
            st.put_many([("new", torch.ones(2)), ("bad", bad)])
    assert st.keys() == [("keep", "param")], "a refused batch left entries behind"


def test_error_types_agree_across_implementations(tmp_path: Path) -> None:
    """The same bad call raises the same exception class on every implementation."""
    ops: dict[str, Callable[[Any], Any]] = {
        "get missing": lambda s: s.get("missing"),
        "get other kind": lambda s: s.get("present", "grad"),
        "get_many missing": lambda s: s.get_many(["present", "missing"]),
        "info missing": lambda s: s.info("missing"),
        "delete missing": lambda s: s.delete("missing"),
        "view missing": lambda s: s.view("missing"),
        "borrow missing": lambda s: s.borrow_many(["missing"]),
        "acquire missing": lambda s: s.acquire("missing", device="cpu", timeout=30),
        "out shape": lambda s: s.get("present", out=torch.empty(3)),
        "out dtype": lambda s: s.get("present", out=torch.empty(4, dtype=torch.int32)),
        "get_many out": lambda s: s.get_many(["present"], out={"present": torch.empty(5)}),
        "put empty name": lambda s: s.put("", torch.ones(1)),
        "put NUL name": lambda s: s.put("a\0b", torch.ones(1)),
        "put long name": lambda s: s.put("n" * 1000, torch.ones(1)),
        "put int name": lambda s: s.put(3, torch.ones(1)),
        "put bad kind": lambda s: s.put("x", torch.ones(1), kind="Bad"),
        "get bad kind": lambda s: s.get("present", kind="a-b"),
        "info bad kind": lambda s: s.info("present", "a-b"),
        "delete bad name": lambda s: s.delete(""),
        "delete bad kind": lambda s: s.delete("present", "A"),
        "put sparse": lambda s: s.put("x", torch.eye(2).to_sparse()),
        "put a list": lambda s: s.put("x", [1.0]),
        "stage bad name": lambda s: s.stage_many([("", "param", torch.float32, (1,))]),
        "stage bad kind": lambda s: s.stage_many([("x", "B", torch.float32, (1,))]),
        "snapshot bad tag": lambda s: s.snapshot("bad tag!"),
        "snapshot taken tag": lambda s: s.snapshot("taken"),
        "restore missing": lambda s: s.restore("nope"),
        "restore bad tag": lambda s: s.restore("bad tag!"),
        "drop missing": lambda s: s.drop_snapshot("nope"),
    }
    seen: dict[str, dict[str, str]] = {}
    not_store_errors = []
    with every_subject(tmp_path) as subjects:
        for impl, subj in subjects.items():
            s = subj.store
            s.put("present", torch.zeros(4))
            s.snapshot("taken")
            for op, call in ops.items():
                t = raises_type(lambda call=call, s=s: call(s))
                seen.setdefault(op, {})[impl] = "no error" if t is None else t.__name__
                if t is None or not issubclass(t, tierstore.StoreError):
                    not_store_errors.append(f"  {impl}: {op}: {seen[op][impl]}")
            assert s.keys() == [("present", "param")], impl
    differ = [f"  {op}: {by}" for op, by in seen.items() if len(set(by.values())) > 1]
    assert not differ and not not_store_errors, (
        "error classes differ between implementations:\n" + "\n".join(differ)
        + "\nnot a StoreError:\n" + "\n".join(not_store_errors))


# -- catalog queries ------------------------------------------------------------------------
def test_info_fields(subject: Subject, st: Any) -> None:
    t = torch.randn(100, 3, dtype=torch.float64)
    v = st.put("w", t, kind="exp_avg")
    info = st.info("w", "exp_avg")
    assert isinstance(info, tierstore.EntryInfo)
    assert (info.name, info.kind, info.dtype, info.shape, info.nbytes, info.version) == (
        "w", "exp_avg", torch.float64, (100, 3), 2400, v)
    assert info.tier in ("host", subject.backing)
    if not subject.cached:
        assert info.tier == subject.backing, "without a cache a put is committed at once"
    st.flush()
    info = st.info("w", "exp_avg")
    assert (info.tier, info.version, info.nbytes) == (subject.backing, v, 2400)
    assert isinstance(info.checksum, str) and info.checksum.startswith("crc32c:")
    assert info.path is not None and Path(info.path).is_file()
    assert info.offset is not None and info.offset % PAGE == 0
    st.put("w2", t)
    st.put("w", t + 1, kind="exp_avg")
    st.flush()
    assert st.info("w2").checksum == info.checksum, "the checksum follows the contents"
    assert st.info("w", "exp_avg").checksum != info.checksum
    st.put("e", torch.empty(0, 4))
    st.flush()
    empty = st.info("e")
    assert (empty.nbytes, empty.shape, empty.path, empty.offset) == (0, (0, 4), None, None)
    with pytest.raises(tierstore.EntryNotFoundError):
        st.info("w")  # only the exp_avg kind exists


def test_keys_names_and_contains(st: Any) -> None:
    entries = [
        ("layers.1.experts.0.w1", "param"), ("layers.1.experts.0.w1", "exp_avg"),
        ("layers.1.experts.1.w1", "param"), ("layers.10.experts.0.w1", "grad"),
        ("layers.2.norm", "param"), ("embed", "master"), ("a", "param"), ("a.b", "param"),
        ("ünïcode.名前", "param"),
    ]
    st.put_many([(n, k, torch.arange(2)) for n, k in entries[:5]])
    st.flush()
    st.put_many([(n, k, torch.arange(2)) for n, k in entries[5:]])  # maybe only in a cache
    assert st.keys() == sorted(entries)
    assert st.names() == sorted({n for n, _ in entries})
    assert st.names("layers.1.") == ["layers.1.experts.0.w1", "layers.1.experts.1.w1"]
    assert st.names("layers.1") == ["layers.1.experts.0.w1", "layers.1.experts.1.w1",
                                    "layers.10.experts.0.w1"]
    assert st.names(kind="exp_avg") == ["layers.1.experts.0.w1"]
    assert st.names("layers.", kind="grad") == ["layers.10.experts.0.w1"]
    assert st.names(kind="nothing") == [] and st.names("zzz") == []
    assert st.names("a") == ["a", "a.b"] and st.names("ünï") == ["ünïcode.名前"]
    assert st.keys("layers.1.experts.0.") == [("layers.1.experts.0.w1", "exp_avg"),
                                              ("layers.1.experts.0.w1", "param")]
    for key in entries:
        assert key in st
    assert "a" in st and ("embed", "param") not in st and "embed" not in st
    assert "nothing" not in st


# -- zero-copy reads ------------------------------------------------------------------------
def test_view_equals_the_data_and_keeps_its_version(st: Any) -> None:
    old, new = torch.randn(64, 16), torch.randn(64, 16)
    st.put("w", old)
    st.put("s", torch.tensor(3, dtype=torch.int8))
    st.put("e", torch.empty(0, 2))
    st.flush()
    v = st.view("w")
    assert same(v, old)
    assert same(st.view("s"), torch.tensor(3, dtype=torch.int8))
    assert same(st.view("e"), torch.empty(0, 2))
    st.put("w", new)
    st.flush()
    assert same(v, old), "a view changed under a put"
    assert same(st.view("w"), new) and same(st.get("w"), new)
    del v


def test_borrow_many_lends_the_data(subject: Subject, st: Any) -> None:
    a, b, g = torch.randn(32, 32), torch.arange(10), torch.randn(5, dtype=torch.bfloat16)
    st.put_many({"a": a, "b": b})
    st.put("g", g, kind="grad")
    st.put("e", torch.empty(0, 3))
    st.flush()
    st.put("b", b)  # one entry newer in the cache than on the backing tier
    with st.borrow_many(["a", "b", ("g", "grad"), "e"]) as lent:
        assert isinstance(lent, tierstore.Borrowed)
        assert list(lent.tensors) == ["a", "b", ("g", "grad"), "e"]
        assert same(lent.tensors["a"], a) and same(lent.tensors["b"], b)
        assert same(lent.tensors[("g", "grad")], g) and same(lent.tensors["e"], torch.empty(0, 3))
        st.put("a", a + 1)  # a new version while the old one is lent
        assert same(lent.tensors["a"], a), "a borrowed view changed under a put"
        assert same(st.get("a"), a + 1)
        lent.tensors["a"].requires_grad_(True)  # the borrower's own tensor object
    with st.borrow_many(["a"], kind="param") as again:
        assert same(again.tensors["a"], a + 1) and not again.tensors["a"].requires_grad
    with st.borrow_many([("g", "grad")]) as by_kind, st.borrow_many(["g"], kind="grad") as k2:
        assert same(by_kind.tensors[("g", "grad")], g) and same(k2.tensors["g"], g)
    with st.borrow_many([]) as nothing:
        assert nothing.tensors == {}
    # Borrowing changed nothing that is stored.
    assert same(st.get("a"), a + 1) and same(st.get("b"), b)
    assert st.fsck().ok


def test_borrow_renew(subject: Subject, st: Any) -> None:
    a, b = torch.randn(1000), torch.arange(50)
    st.put_many({"a": a, "b": b})
    lent = st.borrow_many(["a", "b"])
    with pytest.raises(tierstore.StoreError):
        lent.renew()  # still lent
    lent.release()
    lent.release()  # twice is harmless
    renewed = lent.renew()
    assert isinstance(renewed, bool)
    if st.capabilities.zero_copy:
        assert renewed, "an unchanged borrow of cached entries is renewed"
    if not subject.cached:
        assert not renewed, "nothing is cached: nothing can be renewed"
    if renewed:
        assert same(lent.tensors["a"], a) and same(lent.tensors["b"], b)
        lent.release()
    st.put("a", a * 2)
    assert lent.renew() is False, "renewed a borrow of an entry a put replaced"
    with st.borrow_many(["a", "b"]) as fresh:
        assert same(fresh.tensors["a"], a * 2) and same(fresh.tensors["b"], b)
    other = st.borrow_many(["b"])
    other.release()
    st.delete("b")
    assert other.renew() is False, "renewed a borrow of a deleted entry"


# -- staged writes --------------------------------------------------------------------------
def test_stage_many_commit_makes_new_versions_visible(st: Any) -> None:
    old = torch.arange(8, dtype=torch.float32)
    v_old = st.put("w", old)
    items = [("w", "param", torch.float32, (8,)), ("n", "grad", torch.int64, (2, 3)),
             ("s", "param", torch.bfloat16, ()), ("e", "master", torch.float16, (0, 4))]
    staged = st.stage_many(items)
    assert isinstance(staged, tierstore.Staged)
    assert set(staged.tensors) == {("w", "param"), ("n", "grad"), ("s", "param"),
                                   ("e", "master")}
    for (name, kind, dtype, shape) in items:
        t = staged.tensors[(name, kind)]
        assert t.dtype == dtype and tuple(t.shape) == shape, name
    new = {("w", "param"): torch.arange(8, dtype=torch.float32) * -1,
           ("n", "grad"): torch.arange(6).reshape(2, 3),
           ("s", "param"): torch.tensor(2.5, dtype=torch.bfloat16),
           ("e", "master"): torch.empty(0, 4, dtype=torch.float16)}
    for key, t in new.items():
        staged.tensors[key].copy_(t)
    # Readers see the current versions until the commit.
    assert same(st.get("w"), old) and st.info("w").version == v_old
    assert ("n", "grad") not in st and "s" not in st and ("e", "master") not in st
    versions = staged.commit()
    assert len(versions) == 4 and versions == sorted(versions) and versions[0] > v_old
    for (key, t), v in zip(new.items(), versions):
        assert same(st.get(*key), t), key
        assert st.info(*key).version == v, key
    staged.discard()  # after a commit: nothing to discard
    assert same(st.get("w"), new[("w", "param")])
    st.flush()
    assert st.fsck().ok


def test_stage_many_discard_leaves_the_old_versions(st: Any) -> None:
    old = torch.ones(16)
    v_old = st.put("w", old)
    before = st.keys()
    staged = st.stage_many([("w", "param", torch.float32, (16,)),
                            ("new", "param", torch.int32, (4,))])
    staged.tensors[("w", "param")].fill_(7)
    staged.tensors[("new", "param")].fill_(7)
    staged.discard()
    staged.discard()
    assert same(st.get("w"), old) and st.info("w").version == v_old
    assert st.keys() == before
    # A with block that ends without a commit discards too.
    with st.stage_many([("w", "param", torch.float32, (16,))]) as s2:
        s2.tensors[("w", "param")].fill_(9)
    assert same(st.get("w"), old) and st.info("w").version == v_old
    with pytest.raises(RuntimeError):
        s2.commit()  # a discarded stage cannot be committed
    # A with block that commits keeps its versions.
    with st.stage_many([("w", "param", torch.float32, (16,))]) as s3:
        s3.tensors[("w", "param")].fill_(3)
        (v3,) = s3.commit()
    assert same(st.get("w"), torch.full((16,), 3.0)) and st.info("w").version == v3 > v_old


def test_stage_many_in_a_failing_with_block_leaves_nothing(st: Any) -> None:
    old = torch.arange(4)
    v_old = st.put("w", old)

    class Boom(Exception):
        pass

    with pytest.raises(Boom), st.stage_many([("w", "param", torch.int64, (4,)),
                                             ("x", "grad", torch.float32, (3,))]) as staged:
        staged.tensors[("w", "param")].fill_(-5)
        staged.tensors[("x", "grad")].fill_(1)
        raise Boom
    assert same(st.get("w"), old) and st.info("w").version == v_old
    assert ("x", "grad") not in st and st.keys() == [("w", "param")]
    st.flush()
    assert st.fsck().ok
    # The store is fully usable afterwards, the same keys included.
    with st.stage_many([("x", "grad", torch.float32, (3,))]) as staged:
        staged.tensors[("x", "grad")].fill_(2)
        staged.commit()
    assert same(st.get("x", "grad"), torch.full((3,), 2.0))


def test_stage_many_refuses_bad_entries(st: Any) -> None:
    with pytest.raises(tierstore.UnsupportedTensorError):
        st.stage_many([("q", "param", torch.qint8, (2,))])
    with pytest.raises(ValueError):
        st.stage_many([("neg", "param", torch.float32, (2, -1))])
    assert st.keys() == []


# -- device prefetch on the CPU -------------------------------------------------------------
def test_prefetch_acquire_release_on_cpu(st: Any) -> None:
    a, b, c = torch.randn(100), torch.arange(30), torch.randn(7, dtype=torch.bfloat16)
    st.put_many({"a": a, "c": c})
    st.put("b", b, kind="grad")
    futs = st.prefetch(["a", ("b", "grad")], device="cpu", priority=(1, 0))
    assert len(futs) == 2
    assert same(futs[0].result(timeout=30), a) and same(futs[1].result(timeout=30), b)
    assert same(st.acquire("a", device="cpu", timeout=30), a)
    assert same(st.acquire("b", device="cpu", kind="grad", timeout=30), b)
    (fut,) = st.prefetch("a", device="cpu")  # already resident: shared
    assert same(fut.result(timeout=30), a)
    assert st.release("a", device="cpu") is True
    assert st.release("a", device="cpu") is False, "released twice"
    assert st.release("b", device="cpu", kind="grad") is True
    # Never prefetched: fetched at once. device=None is the CPU "device" too.
    assert same(st.acquire("c", timeout=30), c)
    assert st.release("c") is True
    (fut,) = st.prefetch(["c"])
    assert same(fut.result(timeout=30), c)
    assert st.cancel(["c", "never"], device="cpu") == 1
    # A read that fails fails its own future only.
    bad, good = st.prefetch(["missing", "a"], device="cpu")
    with pytest.raises(tierstore.EntryNotFoundError):
        bad.result(timeout=30)
    assert same(good.result(timeout=30), a)
    st.cancel(["missing", "a"], device="cpu")
    with pytest.raises(tierstore.EntryNotFoundError):
        st.acquire("missing", device="cpu", timeout=30)
    prefetch = st.stats()["prefetch"]
    assert isinstance(prefetch, dict)


def test_prefetch_views_on_cpu(st: Any) -> None:
    a = torch.randn(64, 64)
    st.put("a", a)
    st.flush()
    assert st.prefetch_views("cpu") is True
    got = st.acquire("a", device="cpu", timeout=30)
    assert same(got, a)
    assert st.release("a", device="cpu") is True
    assert same(got, a), "a tensor handed out stays valid after release"
    del got
    assert st.prefetch_views("cpu", enabled=False) is False
    assert same(st.acquire("a", device="cpu", timeout=30), a)
    st.release("a", device="cpu")
    assert same(st.get("a"), a)


# -- figures --------------------------------------------------------------------------------
def test_tick_stats_and_status(subject: Subject, st: Any) -> None:
    st.put("a", torch.zeros(1000, dtype=torch.uint8))
    for _ in range(3):
        st.tick()
        st.get("a")
    st.flush()
    stats = st.stats()
    assert isinstance(stats, dict)
    assert stats["entries"] == 1 and stats["bytes_stored"] == 1000
    assert subject.backing in stats["tiers"]
    assert isinstance(stats["prefetch"], dict)
    if subject.cached:
        assert isinstance(stats["cache"], dict) and stats["cache"]["hits"] >= 1
    else:
        assert stats["cache"] is None
    status = st.status()
    assert isinstance(status, dict)
    assert 0.0 <= status["hit_rate"] <= 1.0


# -- snapshots ------------------------------------------------------------------------------
def test_snapshot_restore_and_drop(st: Any) -> None:
    a1, b1 = torch.arange(5), torch.randn(3, 3, dtype=torch.bfloat16)
    st.put_many({"a": a1, "b": b1})
    va, vb = st.info("a").version, st.info("b").version
    info = st.snapshot("s1")
    assert isinstance(info, tierstore.SnapshotInfo)
    assert (info.tag, info.entries) == ("s1", 2) and info.nbytes == 5 * 8 + 9 * 2
    with pytest.raises(tierstore.SnapshotError):
        st.snapshot("s1")
    st.put("a", torch.arange(5) * 10)
    st.delete("b")
    st.put("c", torch.ones(2))
    st.snapshot("s2")
    assert [s.tag for s in st.snapshots()] == ["s1", "s2"]
    assert [s.entries for s in st.snapshots()] == [2, 2]

    restored = st.restore("s1")
    assert restored.tag == "s1"
    assert st.keys() == [("a", "param"), ("b", "param")]
    assert same(st.get("a"), a1) and same(st.get("b"), b1)
    assert (st.info("a").version, st.info("b").version) == (va, vb)
    assert "c" not in st
    v = st.put("d", torch.zeros(1))
    assert v > va and v > vb, "versions keep increasing after a restore"

    st.restore("s2")
    assert st.keys() == [("a", "param"), ("c", "param")]
    assert same(st.get("a"), torch.arange(5) * 10)

    st.drop_snapshot("s1")
    assert [s.tag for s in st.snapshots()] == ["s2"]
    with pytest.raises(tierstore.SnapshotError):
        st.restore("s1")
    with pytest.raises(tierstore.SnapshotError):
        st.drop_snapshot("s1")
    st.drop_snapshot("s2")
    assert st.snapshots() == []
    assert same(st.get("a"), torch.arange(5) * 10)
    report = st.fsck()
    assert report.ok, report.problems


def test_restore_discards_unflushed_puts(st: Any) -> None:
    st.put("a", torch.zeros(3))
    st.snapshot("s")
    st.put("a", torch.ones(3))  # may be only in a host cache
    st.put("new", torch.ones(3))
    st.restore("s")
    assert same(st.get("a"), torch.zeros(3)) and "new" not in st
    st.flush()
    assert same(st.get("a"), torch.zeros(3)) and st.keys() == [("a", "param")]


# -- verification and durability ------------------------------------------------------------
def test_fsck_is_clean(st: Any) -> None:
    st.put_many({f"e{i}": torch.full((i * 300 + 1,), i, dtype=torch.int32) for i in range(20)})
    st.snapshot("s")
    st.put("e3", torch.zeros(2))
    st.delete("e4")
    seen: list[int] = []
    report = st.fsck(progress=seen.append)
    assert isinstance(report, tierstore.FsckReport)
    assert report.ok and report.problems == [], report.problems
    assert report.entries >= 19 and report.nbytes > 0
    assert seen and seen[-1] == report.nbytes


def test_flush_then_reopen_sees_the_data(subject: Subject) -> None:
    st = subject.store
    cases = {
        "f32": torch.randn(33, 7), "bf16": torch.randn(5, 9).to(torch.bfloat16),
        "scalar": torch.tensor(-2, dtype=torch.int16), "empty": torch.empty(0, 3),
        "bool": torch.tensor([True, False, True]),
    }
    versions = dict(zip(cases, st.put_many(cases)))
    v_grad = st.put("f32", torch.ones(2), kind="grad")
    st.delete("bool")
    st.snapshot("before")
    st.put("late", torch.arange(3))
    st.flush()
    if subject.remote:  # another client sees it at once
        other = subject.new_client()
        assert same(other.get("late"), torch.arange(3))
        assert other.keys() == st.keys()
        other.close()
    st = subject.reopen()
    assert st.keys() == sorted([(n, "param") for n in cases if n != "bool"]
                               + [("f32", "grad"), ("late", "param")])
    for name, t in cases.items():
        if name != "bool":
            assert same(st.get(name), t), name
            assert st.info(name).version == versions[name]
    assert st.info("f32", "grad").version == v_grad
    assert same(st.get("late"), torch.arange(3))
    assert [s.tag for s in st.snapshots()] == ["before"]
    assert st.put("after", torch.zeros(1)) > v_grad, "versions go on after a reopen"
    assert st.fsck().ok


def test_closed_store_refuses_use(subject: Subject) -> None:
    st = subject.store
    st.put("a", torch.arange(3))
    with st:
        pass  # the context manager closes it
    st.close()  # and closing again is harmless
    t = torch.zeros(3)
    calls: dict[str, Callable[[], Any]] = {
        "put": lambda: st.put("b", t), "put_many": lambda: st.put_many({"b": t}),
        "get": lambda: st.get("a"), "get_many": lambda: st.get_many(["a"]),
        "get out": lambda: st.get("a", out=torch.empty(3, dtype=torch.int64)),
        "delete": lambda: st.delete("a"), "view": lambda: st.view("a"),
        "borrow_many": lambda: st.borrow_many(["a"]),
        "stage_many": lambda: st.stage_many([("a", "param", torch.int64, (3,))]),
        "prefetch": lambda: st.prefetch(["a"], device="cpu"),
        "acquire": lambda: st.acquire("a", device="cpu", timeout=5),
        "release": lambda: st.release("a", device="cpu"),
        "cancel": lambda: st.cancel(["a"], device="cpu"),
        "prefetch_views": lambda: st.prefetch_views("cpu"),
        "contains": lambda: "a" in st, "keys": lambda: st.keys(), "names": lambda: st.names(),
        "info": lambda: st.info("a"), "stats": lambda: st.stats(),
        "status": lambda: st.status(), "tick": lambda: st.tick(), "flush": lambda: st.flush(),
        "snapshot": lambda: st.snapshot("s"), "snapshots": lambda: st.snapshots(),
        "restore": lambda: st.restore("s"), "drop_snapshot": lambda: st.drop_snapshot("s"),
        "fsck": lambda: st.fsck(),
    }
    wrong = {op: raises_type(call) for op, call in calls.items()}
    wrong = {op: t for op, t in wrong.items()
             if t is None or not issubclass(t, tierstore.StoreClosedError)}
    assert not wrong, f"on a closed store these did not raise StoreClosedError: {wrong}"
    subject.reopen()
    assert same(subject.store.get("a"), torch.arange(3))


# -- a real daemon process ------------------------------------------------------------------
def test_real_serve_process(tmp_path: Path) -> None:
    """The daemon as deployed: ``tierstore serve`` in its own process, a client here."""
    store = tmp_path / "store"
    tierstore.open(store, create=True, host_cache=0, slab_size="8MiB").close()
    sockdir = Path(tempfile.mkdtemp(prefix="tsconf-"))
    sock, log = sockdir / "s.sock", tmp_path / "serve.log"
    with open(log, "w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tierstore.cli", "serve", "--store", str(store),
             "--socket", str(sock), "--host-cache", DAEMON_CACHE],
            stdout=subprocess.DEVNULL, stderr=err)
    try:
        deadline = time.monotonic() + 90
        while "serving" not in log.read_text():
            assert proc.poll() is None, f"the daemon exited: {log.read_text()}"
            assert time.monotonic() < deadline, "the daemon did not start"
            time.sleep(0.05)
        a = torch.randn(300, dtype=torch.float64)
        with tierstore.connect(sock) as st:
            assert isinstance(st, tierstore.Store) and st.capabilities.remote
            v = st.put("a", a)
            with st.borrow_many(["a"]) as lent:
                assert same(lent.tensors["a"], a)
            with st.stage_many([("s", "grad", torch.int32, (3,))]) as staged:
                staged.tensors[("s", "grad")].copy_(torch.tensor([1, 2, 3], dtype=torch.int32))
                staged.commit()
            st.flush()
        with tierstore.connect(sock) as st:
            assert same(st.get("a"), a) and st.info("a").version == v
            assert same(st.get("s", "grad"), torch.tensor([1, 2, 3], dtype=torch.int32))
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, log.read_text()
        with tierstore.open(store) as st:
            assert same(st.get("a"), a) and st.info("a").version == v
            assert st.fsck().ok
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
        shutil.rmtree(sockdir, ignore_errors=True)
        shutil.rmtree(store, ignore_errors=True)
