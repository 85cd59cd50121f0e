"""The CUDA paths' rules, checked on the CPU: device keys, the pinned arena's size and when it
is pinned, kvikio's configuration, the bench's device keys, and the prefetch queue's lifetime
rules on a fake asynchronous device (copies and consumer kernels run later, on a device
thread, in an order the test controls). Nothing here needs or touches CUDA."""

# Over 600 lines: one fake asynchronous device serves every CUDA rule checked here.

from __future__ import annotations

import contextlib
import enum
import errno
import gc
import subprocess
import sys
import threading
import types
import weakref
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch
from tierstore.bench.prefetch import stats_key
from tierstore.bench.tiers import engine_reads_direct
from tierstore.cache import HostCache
from tierstore.cache import pinned as pinned_mod
from tierstore.cache.slab import PAGE
from tierstore.nvme.engines import (
    _kvikio_compat_mode,
    configure_kvikio,
    kvikio_oserror,
    make_engine,
    resolve_engine,
)
from tierstore.trainer.train.fetch import BufferPool

from tierstore.devices import normalize_device
from tierstore.prefetch import PrefetchQueue

pytestmark = pytest.mark.timeout(60)

# --------------------------------------------------------------------------- device keys


def test_normalize_device_indexes_cuda_and_leaves_cpu_unindexed() -> None:
    zero = lambda device_type: 0  # noqa: E731  (stands in for the current-device query)
    assert normalize_device("cuda", zero) == torch.device("cuda", 0)
    assert normalize_device(torch.device("cuda"), zero) == torch.device("cuda:0")
    assert normalize_device("cuda:1", zero) == torch.device("cuda", 1)
    assert normalize_device("cuda", lambda t: 3) == torch.device("cuda:3")
    # The bug this guards against: the bare and the indexed forms are different keys.
    assert torch.device("cuda") != torch.device("cuda:0")
    assert normalize_device("cpu") == torch.device("cpu")
    assert normalize_device("cpu:0") == torch.device("cpu")
    assert normalize_device(None) == torch.device("cpu")
    assert normalize_device("meta") == torch.device("meta")
    # What a tensor reports is already normal.
    assert normalize_device(torch.empty(1).device) == torch.empty(1).device


def test_buffer_pool_reuses_across_device_spellings() -> None:
    pool = BufferPool()
    t = pool.take((4, 3), torch.device("cpu"))
    pool.give([t])
    assert pool.take((4, 3), "cpu:0") is t  # given under the tensor's device, found anyway
    pool.give([t])
    assert pool.take((4, 3), "cpu") is t
    m = pool.take((2,), "meta")
    assert m.device == torch.device("meta")
    pool.give([m])
    assert pool.take((2,), torch.device("meta")) is m
    assert len(pool) == 0
    assert BufferPool.key((2,), torch.float32, "cuda:0") == BufferPool.key(
        (2,), torch.float32, torch.device("cuda", 0))


def test_buffer_pool_keeps_shapes_and_dtypes_apart() -> None:
    pool = BufferPool()
    a = pool.take((4,), "cpu")
    pool.give([a])
    assert pool.take((4,), "cpu", torch.float16) is not a
    assert pool.take((2, 2), "cpu") is not a
    assert pool.take((4,), "cpu") is a


# --------------------------------------------------------------------------- pinned arena


@pytest.fixture
def no_cuda_consumer(monkeypatch: pytest.MonkeyPatch) -> None:
    """The pinning module as in a process with no CUDA consumer yet: on a GPU machine an
    earlier test of the same run may have made one, which pins every arena from then on."""
    monkeypatch.setattr(pinned_mod, "_consumer", False)
    monkeypatch.setattr(pinned_mod, "_lazy", weakref.WeakSet())


def test_cache_arena_is_exactly_its_capacity_page_aligned_and_unpinned(
        no_cuda_consumer: None) -> None:
    cache = HostCache(5 * PAGE + 123)
    assert cache.capacity_bytes == 5 * PAGE
    assert cache.arena.numel() == 5 * PAGE
    assert cache.arena.data_ptr() % PAGE == 0
    host = cache._host
    assert host is not None and host.nbytes == 5 * PAGE  # no alignment page, no rounding
    assert not cache.pinned and not host.pinned


@pytest.fixture
def fake_cudart(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[Any]]:
    """cudaHostRegister/Unregister recorded instead of called, and the module's view of
    CUDA consumers and lazily pinned arenas fresh (caches other tests left alive are not
    this test's business)."""
    calls: dict[str, list[Any]] = {"register": [], "unregister": []}
    monkeypatch.setattr(pinned_mod, "_register",
                        lambda p, n: calls["register"].append((p, n)))
    monkeypatch.setattr(pinned_mod, "_unregister", calls["unregister"].append)
    monkeypatch.setattr(pinned_mod, "_consumer", False)
    monkeypatch.setattr(pinned_mod, "_lazy", weakref.WeakSet())
    yield calls
    gc.collect()  # arenas "pinned" here go while the fakes are still in place


def test_arena_allocation_asks_for_exact_bytes_and_never_pins_without_a_consumer(
        fake_cudart: dict[str, list[Any]]) -> None:
    registered = fake_cudart["register"]
    t, arena = pinned_mod.arena_tensor(3 * PAGE + 10)
    assert t.numel() == 3 * PAGE + 10 and t.dtype == torch.uint8
    assert registered == [] and not arena.pinned
    t[:] = 7  # the mapping is writable
    pinned_mod.cuda_consumer()  # a CUDA consumer appears: waiting arenas get pinned, exactly
    assert registered == [(arena.ptr, 3 * PAGE + 10)] and arena.pinned
    assert pinned_mod.pinned_bytes() >= 3 * PAGE + 10
    _, later = pinned_mod.arena_tensor(PAGE)  # made after the consumer: pinned at once
    assert later.pinned and registered[-1] == (later.ptr, PAGE)
    _, never = pinned_mod.arena_tensor(PAGE, pin=False)
    assert not never.pinned
    del t, arena, later, never


def test_a_refused_registration_leaves_a_lazy_arena_unpinned_with_a_warning(
        fake_cudart: dict[str, list[Any]], monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(ptr: int, nbytes: int) -> None:
        raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed: 2")

    monkeypatch.setattr(pinned_mod, "_register", refuse)
    t, arena = pinned_mod.arena_tensor(2 * PAGE)
    with pytest.warns(RuntimeWarning, match="stays unpinned"):
        pinned_mod.cuda_consumer()  # the consumer's read goes on: it is staged instead
    assert not arena.pinned and pinned_mod.pinned_bytes() >= 0
    with pytest.warns(RuntimeWarning, match="stays unpinned"):
        _, later = pinned_mod.arena_tensor(PAGE)
    assert not later.pinned
    with pytest.raises(RuntimeError, match="cudaHostRegister"):
        pinned_mod.arena_tensor(PAGE, pin=True)  # asked for outright: the caller's error
    del t, arena, later


def test_arena_is_unregistered_and_unmapped_when_its_last_view_goes(
        fake_cudart: dict[str, list[Any]]) -> None:
    gone = fake_cudart["unregister"]
    t, arena = pinned_mod.arena_tensor(2 * PAGE, pin=True)
    ptr, ref = arena.ptr, weakref.ref(arena)
    view = t[PAGE:]
    del t, arena
    gc.collect()
    assert ref() is not None and ptr not in gone  # a view still uses the memory
    assert int(view.sum()) == 0
    del view
    gc.collect()
    assert ref() is None and gone.count(ptr) == 1


def test_opening_a_store_with_a_cache_does_not_touch_cuda(tmp_path: Any) -> None:
    # In a fresh interpreter: in this one an earlier test (on a GPU machine) may have
    # initialised CUDA or made a CUDA consumer already.
    script = f"""
import torch, tierstore
with tierstore.open({str(tmp_path / "s")!r}, create=True, slab_size="8MiB",
                    host_cache="4MiB") as st:
    st.put("a", torch.arange(10.0))
    assert torch.equal(st.get("a"), torch.arange(10.0))
    assert st._cache is not None and st._cache.arena.numel() == 4 << 20
    assert not st._cache.pinned
assert not torch.cuda.is_initialized()
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


# --------------------------------------------------------------------------- kvikio engine


class _FakeDefaults:
    """kvikio.defaults of 25.x and later: get(name) / set(name, value)."""

    def __init__(self, known: set[str]) -> None:
        self.values: dict[str, Any] = {"num_threads": 1}
        self.known = known

    def set(self, key: Any, value: Any = None) -> None:
        if isinstance(key, dict):
            raise TypeError("this fake takes one name at a time")
        if key not in self.known:
            raise KeyError(key)
        self.values[key] = value

    def get(self, key: str) -> Any:
        if key not in self.known:
            raise KeyError(key)
        return self.values.get(key)


def test_kvikio_pool_and_direct_io_follow_the_store_settings() -> None:
    defaults = _FakeDefaults({"num_threads", "auto_direct_io_read", "auto_direct_io_write"})
    applied = configure_kvikio(types.SimpleNamespace(defaults=defaults), 8, True)
    assert defaults.values == {"num_threads": 8, "auto_direct_io_read": True,
                               "auto_direct_io_write": True}
    assert applied == defaults.values


def test_kvikio_settings_a_version_lacks_are_reported_missing() -> None:
    defaults = _FakeDefaults({"num_threads"})
    applied = configure_kvikio(types.SimpleNamespace(defaults=defaults), 4, True)
    assert applied == {"num_threads": 4}  # no claim of direct I/O it did not take


def test_kvikio_legacy_thread_pool_api() -> None:
    calls: list[int] = []
    legacy = types.SimpleNamespace(num_threads_reset=calls.append,
                                   get_num_threads=lambda: calls[-1])
    applied = configure_kvikio(types.SimpleNamespace(defaults=legacy), 6, False)
    assert calls == [6] and applied == {"num_threads": 6}


class _CompatMode(enum.IntEnum):  # kvikio's CompatMode (an int enum, AUTO truthy)
    OFF = 0
    ON = 1
    AUTO = 2


@pytest.mark.parametrize("defaults, label", [
    (types.SimpleNamespace(get=lambda key: _CompatMode.AUTO), "AUTO"),  # 25.x
    (types.SimpleNamespace(compat_mode=lambda: _CompatMode.AUTO), "AUTO"),  # 24.12-25.02
    (types.SimpleNamespace(compat_mode=lambda: _CompatMode.OFF), "OFF"),
    (types.SimpleNamespace(compat_mode=lambda: True), "ON"),  # the oldest: a bool
    (types.SimpleNamespace(compat_mode=lambda: False), "OFF"),
    (types.SimpleNamespace(), "unknown"),
])
def test_kvikio_compat_mode_is_named_across_versions(defaults: Any, label: str) -> None:
    assert _kvikio_compat_mode(types.SimpleNamespace(defaults=defaults)) == label


@pytest.mark.parametrize("message, code", [
    ("cuFile error: No space left on device", errno.ENOSPC),
    ("pwrite failed: Disk quota exceeded", errno.EDQUOT),
    ("CUfileException: cuFileRead failed", errno.EIO),
])
def test_kvikio_failures_become_the_oserrors_the_store_handles(message: str, code: int) -> None:
    e = kvikio_oserror(RuntimeError(message), "writing", "/s/slab-0", 4096, 1 << 20)
    assert isinstance(e, OSError) and e.errno == code and e.filename == "/s/slab-0"
    assert message in str(e) and "at offset 4096" in str(e)


def test_real_kvikio_engine_configuration(tmp_path: Any) -> None:
    pytest.importorskip("kvikio")
    from tierstore.nvme.engines import KvikioEngine

    engine = KvikioEngine(threads=5, direct=True)
    try:
        assert engine.settings.get("num_threads") == 5
        assert "5-thread pool" in engine.describe()
    finally:
        engine.close()


def test_auto_engine_is_never_kvikio_and_kvikio_only_when_named() -> None:
    assert resolve_engine("auto") in ("aio", "posix-direct")  # aio where libaio runs
    engine = make_engine("auto", threads=1)
    try:
        assert engine.name == resolve_engine("auto")
    finally:
        engine.close()
    assert resolve_engine("kvikio") == "kvikio"


def test_bench_tiers_direct_flag_follows_what_the_engine_did() -> None:
    assert engine_reads_direct("posix-direct")
    assert not engine_reads_direct("posix-buffered")
    assert not engine_reads_direct("kvikio", "nvme: kvikio (compat mode ON, 8-thread pool, "
                                             "reads through the page cache), 8 threads")
    assert engine_reads_direct("kvikio", "nvme: kvikio (compat mode ON, 8-thread pool, "
                                         "reads direct I/O), 8 threads")


# --------------------------------------------------------------------------- bench keys


def test_bench_prefetch_looks_queues_up_by_indexed_device() -> None:
    assert stats_key("cuda", lambda t: 0) == "cuda:0"
    assert stats_key(torch.device("cuda"), lambda t: 1) == "cuda:1"
    assert stats_key("cuda:2") == "cuda:2"
    assert stats_key("cpu") == "cpu"
    assert stats_key(torch.device("cpu")) == str(torch.device("cpu"))


# --------------------------------------------------------------------------- fake device


class FakeEvent:
    def __init__(self) -> None:
        self._done = threading.Event()

    def query(self) -> bool:
        return self._done.is_set()

    def synchronize(self) -> None:
        self._done.wait()  # a device always gets there; pytest's timeout guards a bug


class FakeStream:
    def __init__(self, name: str, held: bool) -> None:
        self.name, self.held = name, held
        self.ops: deque[tuple[Any, ...]] = deque()

    def __repr__(self) -> str:
        return f"<stream {self.name}>"


class FakeDevice:
    """Streams of queued operations run by one device thread, in order per stream. A held
    stream runs nothing until :meth:`resume`; a ``wait`` op blocks its stream until its
    event is done. Ordering is decided by the queues and the test, never by timing."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._stop = False
        self._local = threading.local()
        self.streams: list[FakeStream] = []
        self.default = self.stream("default")
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def stream(self, name: str, held: bool = False) -> FakeStream:
        s = FakeStream(name, held)
        with self._cond:
            self.streams.append(s)
        return s

    @contextlib.contextmanager
    def using(self, stream: FakeStream) -> Iterator[None]:
        before = getattr(self._local, "stream", None)
        self._local.stream = stream
        try:
            yield
        finally:
            self._local.stream = before

    @property
    def current(self) -> FakeStream:
        return getattr(self._local, "stream", None) or self.default

    def enqueue(self, stream: FakeStream, *op: Any) -> None:
        with self._cond:
            stream.ops.append(op)
            self._cond.notify_all()

    def record(self, stream: FakeStream) -> FakeEvent:
        ev = FakeEvent()
        self.enqueue(stream, "record", ev)
        return ev

    def resume(self, stream: FakeStream) -> None:
        with self._cond:
            stream.held = False
            self._cond.notify_all()

    def hold(self, stream: FakeStream) -> None:
        with self._cond:
            stream.held = True

    def pending_reads(self, ptr: int) -> list[FakeStream]:
        with self._cond:
            return [s for s in self.streams
                    if any(op[0] == "kernel" and ptr in op[2] for op in s.ops)]

    def _ready(self) -> FakeStream | None:
        for s in self.streams:
            if s.held or not s.ops:
                continue
            op = s.ops[0]
            if op[0] == "wait" and not op[1].query():
                continue
            return s
        return None

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._stop and (s := self._ready()) is None:
                    self._cond.wait()
                if self._stop:
                    return
                op = s.ops[0]
            if op[0] == "copy":
                np.copyto(op[1].numpy(), op[2].numpy())
            elif op[0] == "record":
                op[1]._done.set()
            elif op[0] == "kernel":
                op[1]()
            with self._cond:
                s.ops.popleft()  # only now: pending_reads sees a running kernel as pending
                self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join()


class FakeCopier:
    """The DeviceCopier a prefetch queue drives, over a FakeDevice; ``violations`` lists the
    buffers the queue let go of while a consumer's kernel on them was still queued."""

    def __init__(self, dev: FakeDevice) -> None:
        self.dev = dev
        self.device = torch.device("cpu")
        self.stream = dev.stream("copy")
        self.violations: list[str] = []
        self.retired: list[int] = []

    def empty(self, nbytes: int) -> torch.Tensor:
        return torch.full((nbytes,), 0xEE, dtype=torch.uint8)  # garbage until the copy runs

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> FakeEvent:
        self.dev.enqueue(self.stream, "copy", dst, src)
        return self.dev.record(self.stream)

    def wait(self, event: FakeEvent, tensor: torch.Tensor) -> None:
        self.dev.enqueue(self.dev.current, "wait", event)

    def mark(self, tensor: torch.Tensor) -> FakeEvent:
        return self.dev.record(self.dev.current)

    def retire(self, tensor: torch.Tensor) -> None:
        ptr = tensor.untyped_storage().data_ptr()
        self.retired.append(ptr)
        busy = self.dev.pending_reads(ptr)
        if busy:
            self.violations.append(f"buffer {ptr:#x} released while {busy} still read it")


def kernel(dev: FakeDevice, stream: FakeStream, t: torch.Tensor,
           out: list[torch.Tensor]) -> None:
    """A consumer kernel on ``stream`` that reads ``t`` (a copy of it lands in ``out``)."""
    dev.enqueue(stream, "kernel", lambda: out.append(t.clone()),
                {t.untyped_storage().data_ptr()})


@dataclass
class Meta:
    dtype: str
    shape: tuple[int, ...]
    nbytes: int


class Slot:
    """A host-cache slot's handle: releasing it lets the cache reuse the slot, which this
    fake does at once (it scribbles over the bytes), so a copy that reads a released slot
    lands the wrong bytes."""

    def __init__(self, key: Any, buf: np.ndarray) -> None:
        self.key, self.buf, self.released = key, buf, False

    def release(self) -> None:
        self.released = True
        self.buf[:] = 0xAB


class Host:
    """Entries of float32 values; ``load`` hands out slots as the store's _host_bytes does."""

    def __init__(self, entries: dict[str, torch.Tensor]) -> None:
        self.entries = entries

    def data(self, name: str) -> torch.Tensor:
        return self.entries[name]

    def load(self, keys: list[Any]) -> tuple[dict[Any, Any], list[Any]]:
        found, handles = {}, []
        for key in keys:
            t = self.entries[key[0]]
            buf = t.reshape(-1).view(torch.uint8).numpy().copy()
            found[key] = (Meta("float32", tuple(t.shape), buf.size), buf)
            handles.append(Slot(key, buf))
        return found, handles

    def size_of(self, key: Any) -> int:
        t = self.entries[key[0]]
        return t.numel() * t.element_size()


@pytest.fixture
def fake() -> Iterator[tuple[FakeDevice, FakeCopier]]:
    dev = FakeDevice()
    try:
        yield dev, FakeCopier(dev)
    finally:
        dev.close()


def make_queue(copier: FakeCopier, host: Host, budget: int) -> PrefetchQueue:
    return PrefetchQueue(torch.device("cpu"), budget, host.load, host.size_of, io_threads=1,
                         copier=copier)


def entries(n: int, numel: int = 256) -> dict[str, torch.Tensor]:
    return {f"e{i}": torch.arange(numel, dtype=torch.float32) + 1000 * i for i in range(n)}


def key(name: str) -> tuple[str, str]:
    return (name, "param")


def test_acquire_orders_the_consumer_after_a_copy_that_has_not_run(fake) -> None:
    dev, copier = fake
    dev.hold(copier.stream)  # the copy is issued but does not run until resumed
    host = Host(entries(1))
    q = make_queue(copier, host, budget=1 << 20)
    try:
        consumer = dev.stream("consumer")
        seen: list[torch.Tensor] = []
        with dev.using(consumer):
            t = q.acquire(key("e0"), timeout=30)  # returns without the copy having run
            kernel(dev, consumer, t, seen)
        fut = q.request([key("e0")])[0]
        assert not fut.done()  # a future resolves only once its copy has landed
        dev.resume(copier.stream)
        assert torch.equal(fut.result(timeout=30), host.data("e0"))
        with dev.using(consumer):
            dev.record(consumer).synchronize()
        assert torch.equal(seen[0], host.data("e0"))  # the kernel ran after the copy
    finally:
        q.close()


def test_host_bytes_stay_until_the_copy_has_read_them(fake) -> None:
    dev, copier = fake
    dev.hold(copier.stream)
    host = Host(entries(3))
    q = make_queue(copier, host, budget=1 << 20)
    try:
        futs = q.request([key(n) for n in host.entries])
        dev.resume(copier.stream)
        for name, f in zip(host.entries, futs):
            assert torch.equal(f.result(timeout=30), host.data(name)), name
    finally:
        q.close()


def test_release_before_the_consumer_finishes_keeps_budget_and_buffer(fake) -> None:
    dev, copier = fake
    host = Host(entries(2))
    nbytes = host.size_of(key("e0"))
    q = make_queue(copier, host, budget=nbytes)  # one entry at a time
    try:
        consumer = dev.stream("consumer", held=True)  # busy: its kernels have not run
        seen: list[torch.Tensor] = []
        q.request([key("e0")])[0].result(timeout=30)  # landed: resident from here on
        with dev.using(consumer):
            a = q.acquire(key("e0"), timeout=30)
            kernel(dev, consumer, a, seen)
            assert q.drop([key("e0")], release=True) == 1
        del a
        nxt = q.request([key("e1")])[0]
        s = q.stats()
        # The consumer has not passed its release point: e0 keeps its credits, so e1
        # cannot start, and the buffer has not been let go of.
        assert s["in_use_bytes"] == nbytes and s["draining"] == 1
        assert not nxt.done() and copier.retired == []
        dev.resume(consumer)
        got = nxt.result(timeout=30)
        assert torch.equal(got, host.data("e1"))
        assert torch.equal(seen[0], host.data("e0"))
        assert copier.violations == [] and len(copier.retired) == 1
        q.drop([key("e1")], release=True)  # on the default stream: done once it gets there
        dev.record(dev.default).synchronize()
        s = q.stats()
        assert s["in_use_bytes"] == 0 and s["draining"] == 0
    finally:
        q.close()
    assert copier.violations == []


def test_a_future_used_on_another_stream_is_safe_to_release_there(fake) -> None:
    dev, copier = fake
    host = Host(entries(1))
    q = make_queue(copier, host, budget=1 << 20)
    try:
        fut = q.request([key("e0")])[0]
        t = fut.result(timeout=30)  # copy landed: usable on any stream
        side = dev.stream("side", held=True)
        seen: list[torch.Tensor] = []
        with dev.using(side):
            kernel(dev, side, t, seen)
            q.drop([key("e0")], release=True)  # released on the stream that used it
        del t
        assert q.stats()["draining"] == 1 and copier.retired == []
        dev.resume(side)
        with dev.using(side):
            dev.record(side).synchronize()
        assert q.stats()["in_use_bytes"] == 0
        assert torch.equal(seen[0], host.data("e0")) and copier.violations == []
    finally:
        q.close()


def test_close_waits_for_consumers_before_letting_buffers_go(fake) -> None:
    dev, copier = fake
    host = Host(entries(1))
    q = make_queue(copier, host, budget=1 << 20)
    consumer = dev.stream("consumer", held=True)
    with dev.using(consumer):
        t = q.acquire(key("e0"), timeout=30)
        kernel(dev, consumer, t, [])
        q.drop([key("e0")], release=True)
    closing = threading.Thread(target=q.close)
    closing.start()
    dev.resume(consumer)
    closing.join(30)
    assert not closing.is_alive()
    assert copier.violations == [] and len(copier.retired) == 1


def test_the_harness_detects_a_buffer_let_go_under_a_running_consumer(fake) -> None:
    """The detector the tests above rely on: retiring a buffer that a queued kernel still
    reads is reported (what returning credits at release, as before, would do)."""
    dev, copier = fake
    consumer = dev.stream("consumer", held=True)
    buf = copier.empty(64)
    kernel(dev, consumer, buf, [])
    copier.retire(buf)
    assert len(copier.violations) == 1
    dev.resume(consumer)
    dev.record(consumer).synchronize()
    copier.retire(buf)
    assert len(copier.violations) == 1


def test_cancelled_in_flight_entry_keeps_credits_until_its_copy_lands(fake) -> None:
    dev, copier = fake
    dev.hold(copier.stream)
    host = Host(entries(1))
    q = make_queue(copier, host, budget=1 << 20)
    try:
        fut = q.request([key("e0")])[0]
        # Cancelled before it lands (whether it is still loading or copying): its credits
        # come back only once its bytes have landed, and nothing was handed out.
        q.drop([key("e0")], release=False)
        assert fut.cancelled()
        dev.resume(copier.stream)
        q.request([])  # the queue is still usable
        with dev.using(dev.default):
            again = q.acquire(key("e0"), timeout=30)
            dev.record(dev.default).synchronize()  # the stream waited for the copy
        assert torch.equal(again, host.data("e0"))
    finally:
        q.close()
    assert copier.violations == []



# --------------------------------------------------------------------------- raw-byte copies


def test_bytes_to_device_copies_bytes_not_values() -> None:
    from tierstore.devices import bytes_to_device

    src = np.array([0, 1, 2, 255], dtype=np.uint8)  # bool bytes other than 0/1
    t = bytes_to_device(src, 4, torch.bool, (2, 2), "cpu")
    assert t.dtype == torch.bool and t.shape == (2, 2)
    assert t.reshape(-1).view(torch.uint8).tolist() == [0, 1, 2, 255]
    out = torch.zeros(4, dtype=torch.bool)
    assert bytes_to_device(torch.from_numpy(src), 4, torch.bool, (4,), None, out=out) is out
    assert out.view(torch.uint8).tolist() == [0, 1, 2, 255]
    bf = torch.tensor([1.5, -2.0], dtype=torch.bfloat16)
    got = bytes_to_device(bf.view(torch.uint8), 4, torch.bfloat16, (2,), "cpu")
    assert torch.equal(got, bf)
    assert bytes_to_device(np.empty(0, np.uint8), 0, torch.float32, (0, 3), "cpu").shape == (0, 3)
