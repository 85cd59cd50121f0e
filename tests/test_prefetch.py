"""The device prefetch queue on the CPU "device": priority order, de-duplication, the byte
budget, release/cancel, error propagation, close, and a randomized multi-thread stress.

Start order is observed through the queue's ``on_start`` hook (called under the queue's lock
as a transfer takes its credits), and stage 1 is held back where needed by wrapping the
store's ``_host_bytes`` with a gate. Nothing here asserts on time.
"""

# Over 600 lines: the queue's contract, one section per rule, sharing one gated store.

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import wait

import pytest
import torch

import tierstore
from tierstore.interface import Meta
from tierstore.prefetch import IO_THREADS, MAX_COPY_BATCH_BYTES, DeviceQueues, PrefetchQueue

MiB = 1 << 20
pytestmark = pytest.mark.timeout(60)


def wait_until(cond: Callable[[], bool], what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.005)


def raw(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)


def prefetch_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("tierstore-prefetch")]


class Watch:
    """Records every transfer start (key, bytes in use after it took its credits) and, with
    ``gate(names)``, holds stage 1 of those entries until ``open()``."""

    def __init__(self, st: tierstore.Store, device: str | None = None) -> None:
        self.st = st
        self.queue = st._queues.get(device)
        self.started: list[tuple[str, str]] = []
        self.in_use: list[int] = []
        self.queue.on_start = self._on_start
        self._gate = threading.Event()
        self._gated: set[str] = set()
        self.loads: list[list[tuple[str, str]]] = []  # the keys of each stage-1 load
        load = st._host_bytes

        def gated_load(keys, **kw):
            self.loads.append(list(keys))
            if any(name in self._gated for name, _ in keys):
                assert self._gate.wait(30), "gate never opened"
            return load(keys, **kw)

        st._host_bytes = gated_load

    def _on_start(self, key: tuple[str, str], in_use: int) -> None:
        self.started.append(key)
        self.in_use.append(in_use)

    def gate(self, names: Iterable[str]) -> None:
        self._gated.update(names)

    def open(self) -> None:
        self._gate.set()

    def names(self) -> list[str]:
        return [name for name, _ in self.started]

    def block_io(self) -> list:
        """Occupy every stage-1 thread with a gated entry; returns their futures."""
        blockers = [f"blocker.{i}" for i in range(IO_THREADS)]
        for name in blockers:
            self.st.put(name, torch.zeros(16))
        self.gate(blockers)
        # One priority each: an I/O thread that found the other still starting would
        # otherwise take both blockers as one batch, and leave nothing blocked.
        futs = [self.st.prefetch(name, priority=(-1, i))[0] for i, name in enumerate(blockers)]
        wait_until(lambda: len(self.started) >= IO_THREADS, "the I/O threads to take blockers")
        return futs


def put_entries(st: tierstore.Store, n: int, numel: int = MiB // 4, prefix: str = "e") -> dict:
    gen = torch.Generator().manual_seed(n)
    data = {f"{prefix}.{i}": torch.randn(numel, generator=gen) for i in range(n)}
    for name, t in data.items():
        st.put(name, t)
    return data


def pf_stats(st: tierstore.Store, device: str = "cpu") -> dict:
    return st.stats()["prefetch"][device]


# -- values -------------------------------------------------------------------------------
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int8,
          torch.complex64, torch.bool, torch.uint8]


def test_acquired_values_equal_get(make_store, cache_kw) -> None:
    st = make_store(chunk_size="64KiB", **cache_kw)
    gen = torch.Generator().manual_seed(1)
    # random bytes under every dtype: bool bytes other than 0/1 and sub-byte placeholder
    # dtypes (no copy kernels) must come back bit for bit
    want = {f"t.{dt}": torch.randint(0, 256, (3, 40_000), dtype=torch.uint8,
                                     generator=gen).view(dt) for dt in DTYPES}
    want["t.int4"] = torch.randint(0, 256, (33,), dtype=torch.uint8, generator=gen).view(torch.int4)
    want["t.scalar"] = torch.tensor(3.5)
    want["t.empty"] = torch.empty(0, 7)
    for name, t in want.items():
        st.put(name, t)
    st.flush()
    futs = st.prefetch(list(want), priority=(0, 1))
    for (name, t), fut in zip(want.items(), futs):
        got = st.acquire(name)
        assert got is fut.result()
        ref = st.get(name)
        assert got.dtype == ref.dtype == t.dtype and got.shape == ref.shape == t.shape
        assert torch.equal(raw(got), raw(ref)) and torch.equal(raw(got), raw(t)), name
    # "cpu" and None are one device, one queue
    assert st.acquire("t.scalar", device="cpu") is futs[list(want).index("t.scalar")].result()
    assert set(st.stats()["prefetch"]) == {"cpu"}


def test_acquire_without_prefetch_fetches_now(make_store) -> None:
    st = make_store()
    data = put_entries(st, 3)
    for name, t in data.items():
        assert torch.equal(st.acquire(name), t)
    s = pf_stats(st)
    assert s["transfers"] == 3 and s["resident"] == 3 and s["in_use_bytes"] == 3 * MiB


# -- ordering -----------------------------------------------------------------------------
def test_transfers_start_in_priority_order(make_store) -> None:
    st = make_store()
    w = Watch(st)
    blockers = w.block_io()
    put_entries(st, 8)
    order = [(5, "e.0"), ((2, 9), "e.1"), (3, "e.2"), ((2, 1), "e.3"), (3, "e.4"),
             (0.5, "e.5"), ((7,), "e.6"), (9, "e.7")]
    futs = [st.prefetch(name, priority=p)[0] for p, name in order]
    st.prefetch("e.7", priority=(2, 5))  # raised: between (2, 1) and (2, 9)
    st.prefetch("e.0", priority=99)  # lowering is ignored
    w.open()
    for f in blockers + futs:
        f.result(timeout=30)
    # tuples compare lexicographically with numbers as 1-tuples; ties keep request order
    assert w.names()[IO_THREADS:] == ["e.5", "e.3", "e.7", "e.1", "e.2", "e.4", "e.0", "e.6"]


def test_acquire_overtakes_queued_prefetches(make_store) -> None:
    st = make_store()
    w = Watch(st)
    blockers = w.block_io()
    data = put_entries(st, 4)
    futs = st.prefetch(list(data), priority=1)
    got: list[torch.Tensor] = []
    t = threading.Thread(target=lambda: got.append(st.acquire("e.3")))
    t.start()
    wait_until(lambda: w.queue._entries[("e.3", "param")].urgent, "acquire to mark e.3 urgent")
    w.open()
    t.join(30)
    for f in blockers + futs:
        f.result(timeout=30)
    assert w.names()[IO_THREADS:] == ["e.3", "e.0", "e.1", "e.2"]
    assert torch.equal(got[0], data["e.3"])
    s = pf_stats(st)
    assert s["stalled_acquires"] == 1 and s["stall_s"] > 0
    assert set(s["stall_s_by_layer"]) == {1}  # an acquire keeps the request's layer


def test_stall_accounting_per_layer(make_store) -> None:
    st = make_store()
    w = Watch(st)
    data = put_entries(st, 2)
    st.prefetch("e.0", priority=(0, 4))[0].result(timeout=30)
    st.acquire("e.0")  # landed already: no stall
    blockers = w.block_io()
    st.prefetch("e.1", priority=(0, 7))
    got: list[torch.Tensor] = []
    t = threading.Thread(target=lambda: got.append(st.acquire("e.1")))
    t.start()
    wait_until(lambda: w.queue._entries[("e.1", "param")].urgent, "acquire to wait on e.1")
    w.open()  # only now can e.1 start: the acquire has stalled
    t.join(30)
    for f in blockers:
        f.result(timeout=30)
    assert torch.equal(got[0], data["e.1"])
    s = pf_stats(st)
    assert s["acquires"] == 2 and s["stalled_acquires"] == 1
    assert s["stall_s"] > 0 and s["stall_s_by_layer"] == {7: s["stall_s"]}


def test_priorities_are_validated(make_store) -> None:
    st = make_store()
    put_entries(st, 1)
    for bad in ("soon", (1, "a"), (), float("nan"), None):
        with pytest.raises(tierstore.StoreError, match="priority"):
            st.prefetch("e.0", priority=bad)
    with pytest.raises(tierstore.StoreError):
        st.prefetch([("e.0", "param", "x")])
    with pytest.raises(tierstore.StoreError):
        st.prefetch("e.0", kind="Bad Kind")


# -- de-duplication -----------------------------------------------------------------------
def test_duplicate_requests_share_one_transfer(make_store, cache_kw) -> None:
    st = make_store(**cache_kw)
    w = Watch(st)
    data = put_entries(st, 2)
    st.flush()
    reads = st.stats()["tiers"][st.backing]["reads"]
    w.gate(["e.0"])
    a = st.prefetch(["e.0", "e.1"], priority=3)
    b = st.prefetch([("e.0", "param"), "e.0"], priority=1)  # while e.0 is in flight
    assert b[0] is a[0] and b[1] is a[0]
    w.open()
    a[1].result(timeout=30)
    c = st.prefetch("e.1")  # resident
    assert c[0] is a[1]
    assert torch.equal(st.acquire("e.0"), data["e.0"])
    assert st.acquire("e.0") is a[0].result()
    s = pf_stats(st)
    assert (s["requests"], s["dedup_hits"], s["transfers"]) == (2, 3, 2)
    assert s["bytes_moved"] == 2 * MiB and s["in_use_bytes"] == 2 * MiB
    assert w.names() == ["e.0", "e.1"]
    assert st.stats()["tiers"][st.backing]["reads"] - reads <= 2


def test_concurrent_duplicate_requests(make_store) -> None:
    st = make_store()
    w = Watch(st)
    put_entries(st, 4)
    barrier = threading.Barrier(8)
    futs: list[list] = []

    def ask() -> None:
        barrier.wait()
        futs.append(st.prefetch([f"e.{i}" for i in range(4)], priority=random.random()))

    threads = [threading.Thread(target=ask) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert all(f == futs[0] for f in futs)
    for f in futs[0]:
        f.result(timeout=30)
    assert sorted(w.names()) == [f"e.{i}" for i in range(4)]
    s = pf_stats(st)
    assert s["transfers"] == 4 and s["requests"] == 4 and s["dedup_hits"] == 28


# -- the budget ---------------------------------------------------------------------------
def test_budget_is_never_exceeded(make_store) -> None:
    st = make_store(device_budget=3 * MiB + 100)
    w = Watch(st)
    data = put_entries(st, 10)
    futs = st.prefetch(list(data), priority=(0, 0))
    for f in futs[:3]:
        f.result(timeout=30)
    s = pf_stats(st)
    assert (s["resident"], s["queued"], s["in_use_bytes"]) == (3, 7, 3 * MiB)
    assert not any(f.done() for f in futs[3:])
    for i, name in enumerate(data):  # acquire and release in order: each release admits one
        assert torch.equal(st.acquire(name), data[name])
        assert st.release(name)
        assert not st.release(name)
        if i + 3 < len(futs):
            futs[i + 3].result(timeout=30)
    assert w.names() == list(data)
    assert max(w.in_use) <= 3 * MiB + 100
    s = pf_stats(st)
    assert s["in_use_bytes"] == 0 and s["peak_in_use_bytes"] == 3 * MiB
    assert s["releases"] == 10


def test_head_of_queue_waits_for_credits_lower_priority_waits_behind(make_store) -> None:
    st = make_store(device_budget=2 * MiB)
    w = Watch(st)
    put_entries(st, 2)
    st.put("big", torch.zeros(MiB // 2))  # 2 MiB
    st.put("small", torch.zeros(16))
    st.acquire("e.0")
    big, small = st.prefetch("big", priority=1)[0], st.prefetch("small", priority=2)[0]
    # "small" would fit, but "big" is sooner and needs the whole budget: both wait
    assert pf_stats(st)["queued"] == 2 and not big.done() and not small.done()
    st.release("e.0")
    big.result(timeout=30)
    assert pf_stats(st)["queued"] == 1 and not small.done()
    st.release("big")
    small.result(timeout=30)
    assert w.names() == ["e.0", "big", "small"]


def test_entry_larger_than_budget_fails_clearly(make_store) -> None:
    st = make_store(device_budget="1MiB")
    st.put("huge", torch.zeros(MiB // 4 + 1))
    st.put("fits", torch.zeros(MiB // 4))
    fut = st.prefetch("huge")[0]
    with pytest.raises(tierstore.StoreError, match="more than the whole prefetch budget"):
        fut.result(timeout=5)
    with pytest.raises(tierstore.StoreError, match="budget"):
        st.acquire("huge")
    assert torch.equal(st.acquire("fits"), torch.zeros(MiB // 4))
    assert pf_stats(st)["in_use_bytes"] == MiB


def test_budgets_per_device_and_defaults(make_store) -> None:
    st = make_store(device_budget={"cpu": "3MiB"})
    assert st.stats()["prefetch"] == {}  # no queue before a device's first request
    assert st.prefetch([]) == []
    assert pf_stats(st)["budget_bytes"] == 3 * MiB
    assert DeviceQueues(None, None)._budget(torch.device("cpu")) == 1 << 30
    assert DeviceQueues(None, None, "2GiB")._budget(torch.device("cpu")) == 2 << 30
    with pytest.raises(ValueError):
        DeviceQueues(None, None, "lots")


def test_entry_rewritten_with_another_size_while_queued(make_store) -> None:
    st = make_store(device_budget=2 * MiB)
    w = Watch(st)
    st.put("grows", torch.zeros(16))
    st.put("too.big", torch.zeros(16))
    w.gate(["grows", "too.big"])
    a, b = st.prefetch(["grows", "too.big"])  # sized and started at 64 bytes each
    wait_until(lambda: len(w.started) == 2, "both to start")
    st.put("grows", torch.ones(MiB // 4))  # 1 MiB
    st.put("too.big", torch.ones(3 * MiB // 4))  # 3 MiB: more than the budget
    w.open()
    assert torch.equal(a.result(timeout=30), torch.ones(MiB // 4))
    with pytest.raises(tierstore.StoreError, match="grew"):
        b.result(timeout=30)
    assert w.names().count("grows") == 2  # re-queued at its new size
    assert pf_stats(st)["in_use_bytes"] == MiB


# -- stage-1 batches ----------------------------------------------------------------------
def test_copy_path_loads_a_request_in_one_call(make_store) -> None:
    st = make_store()
    w = Watch(st)
    blockers = w.block_io()
    data = put_entries(st, 8, numel=16)
    first, second = list(data)[:4], list(data)[4:]
    futs = st.prefetch(first, priority=1) + st.prefetch(second, priority=2)
    w.open()
    for f in blockers + futs:
        f.result(timeout=30)
    for name, f in zip(data, futs):
        assert torch.equal(f.result(), data[name])
    loads = [sorted(n for n, _ in keys) for keys in w.loads if keys[0][0].startswith("e.")]
    # The first request is the head of the heap and a thread's share (at least half of
    # what is queued): one load. A load never mixes priorities.
    assert first in loads
    assert all(set(names) <= set(first) or set(names) <= set(second) for names in loads)
    assert sorted(n for names in loads for n in names) == sorted(data)
    s = pf_stats(st)
    assert not s["zero_copy"] and s["transfers"] == 8 + IO_THREADS
    assert s["bytes_copied"] == s["bytes_moved"]


def test_copy_path_batches_stop_at_max_copy_batch_bytes(make_store) -> None:
    st = make_store()
    w = Watch(st)
    blockers = w.block_io()
    data = put_entries(st, 3, numel=MAX_COPY_BATCH_BYTES // 8 + 1)  # over half the cap
    futs = st.prefetch(list(data), priority=1)
    w.open()
    for f in blockers + futs:
        f.result(timeout=30)
    for name, f in zip(data, futs):
        assert torch.equal(f.result(), data[name])
    loads = [keys for keys in w.loads if keys[0][0].startswith("e.")]
    assert sorted(len(keys) for keys in loads) == [1, 1, 1]


class Lease:
    """One handle over a whole load, naming no key (as the daemon client's lease)."""

    def __init__(self) -> None:
        self.released = 0

    def release(self) -> None:
        self.released += 1


def test_copy_path_releases_a_shared_lease_once_every_copy_has_landed() -> None:
    data = {(f"s.{i}", "param"): torch.arange(64, dtype=torch.float32) + 100 * i
            for i in range(5)}
    loads: list[tuple[list, Lease]] = []
    gate = threading.Event()

    def load(keys):
        if keys[0][0] == "s.0":
            assert gate.wait(30), "gate never opened"
        lease = Lease()
        loads.append((list(keys), lease))
        return {k: (Meta("float32", (64,), 256, 0), data[k].view(torch.uint8).numpy().copy())
                for k in keys}, [lease]

    started: list = []
    q = PrefetchQueue(torch.device("cpu"), 1 << 20, load, lambda k: 256, io_threads=1)
    q.on_start = lambda key, _: started.append(key)
    try:
        blocker = q.request([("s.0", "param")], priority=0)[0]
        wait_until(lambda: started, "the I/O thread to take s.0")
        keys = [(f"s.{i}", "param") for i in range(1, 5)]
        futs = q.request(keys, priority=1)
        gate.set()
        for k, f in zip([("s.0", "param"), *keys], [blocker, *futs]):
            assert torch.equal(f.result(timeout=30), data[k])
        assert [ks for ks, _ in loads] == [[("s.0", "param")], keys]  # one call for four
        assert [lease.released for _, lease in loads] == [1, 1]
    finally:
        q.close()


# -- release and cancel -------------------------------------------------------------------
def test_cancel_queued_takes_no_credit(make_store) -> None:
    st = make_store()
    w = Watch(st)
    blockers = w.block_io()
    data = put_entries(st, 3)
    a, b, c = st.prefetch(list(data))
    assert st.cancel(["e.0", "e.2", "missing.name"]) == 2
    assert b.cancel()  # the future's own cancel is a cancel of the request too
    assert a.cancelled() and b.cancelled() and c.cancelled()
    assert not wait([a, b, c], timeout=5).not_done  # cancelled futures count as done
    assert pf_stats(st)["queued"] == 0
    w.open()
    for f in blockers:
        f.result(timeout=30)
    assert "e.0" not in w.names() and "e.1" not in w.names() and "e.2" not in w.names()
    s = pf_stats(st)
    assert s["cancels"] == 3 and s["in_use_bytes"] == 2 * 64 and s["transfers"] == IO_THREADS
    # a cancelled entry is requested afresh, with a new future
    again = st.prefetch("e.1")[0]
    assert again is not b and torch.equal(again.result(timeout=30), data["e.1"])


def test_cancel_in_flight_returns_credit_once_landed(make_store) -> None:
    st = make_store()
    w = Watch(st)
    data = put_entries(st, 1)
    w.gate(["e.0"])
    fut = st.prefetch("e.0")[0]
    wait_until(lambda: w.names() == ["e.0"], "e.0 to start")
    assert st.cancel("e.0") == 1 and fut.cancelled()
    assert pf_stats(st)["in_use_bytes"] == MiB  # its bytes are still on their way
    w.open()
    wait_until(lambda: pf_stats(st)["in_use_bytes"] == 0, "the credit to come back")
    assert torch.equal(st.acquire("e.0"), data["e.0"])
    assert w.names() == ["e.0", "e.0"]


def test_release_and_cancel_resident(make_store) -> None:
    st = make_store(device_budget=2 * MiB)
    data = put_entries(st, 3)
    st.prefetch(["e.0", "e.1"])[1].result(timeout=30)
    first = st.acquire("e.0")
    assert pf_stats(st)["in_use_bytes"] == 2 * MiB
    assert st.release("e.0")
    assert st.cancel(["e.1"]) == 1
    s = pf_stats(st)
    assert s["in_use_bytes"] == 0 and s["resident"] == 0
    assert s["releases"] == 1 and s["cancels"] == 1
    again = st.acquire("e.0")  # after a release: transferred again, a new tensor
    assert again is not first and torch.equal(again, data["e.0"])
    assert torch.equal(first, data["e.0"])  # what was handed out stays valid
    assert pf_stats(st)["transfers"] == 3


def test_acquire_waiting_on_a_cancelled_request_fetches_again(make_store) -> None:
    st = make_store()
    w = Watch(st)
    blockers = w.block_io()
    data = put_entries(st, 1)
    st.prefetch("e.0")
    got: list[torch.Tensor] = []
    t = threading.Thread(target=lambda: got.append(st.acquire("e.0")))
    t.start()
    wait_until(lambda: w.queue._entries[("e.0", "param")].urgent, "acquire to wait on e.0")
    st.cancel("e.0")
    w.open()
    t.join(30)
    for f in blockers:
        f.result(timeout=30)
    assert torch.equal(got[0], data["e.0"])


# -- errors -------------------------------------------------------------------------------
def flip_byte(info: tierstore.EntryInfo, at: int) -> None:
    assert info.path is not None and info.offset is not None
    with open(info.path, "r+b") as f:
        f.seek(info.offset + at)
        b = f.read(1)
        f.seek(info.offset + at)
        f.write(bytes([b[0] ^ 0x5A]))


def test_failed_read_fails_its_future_only(make_store) -> None:
    st = make_store(chunk_size="64KiB")
    data = put_entries(st, 4)
    st.close()
    st = make_store(st.path, reopen=True, host_cache=0, chunk_size="64KiB")
    flip_byte(st.info("e.1"), 70_000)
    futs = st.prefetch(["e.0", "e.1", "e.2"], priority=(0, 1))
    with pytest.raises(tierstore.CorruptEntryError) as ei:
        futs[1].result(timeout=30)
    assert (ei.value.name, ei.value.kind) == ("e.1", "param")
    with pytest.raises(tierstore.CorruptEntryError):
        st.acquire("e.1")
    for i in (0, 2):
        assert torch.equal(futs[i].result(timeout=30), data[f"e.{i}"])
    assert torch.equal(st.acquire("e.3"), data["e.3"])  # the queue keeps serving
    missing = st.prefetch("no.such")[0]
    with pytest.raises(tierstore.EntryNotFoundError):
        missing.result(timeout=30)
    s = pf_stats(st)
    assert s["failures"] == 3 and s["resident"] == 3 and s["in_use_bytes"] == 3 * MiB
    for name in ("e.0", "e.2", "e.3"):
        st.release(name)
    assert pf_stats(st)["in_use_bytes"] == 0


# -- close --------------------------------------------------------------------------------
def test_close_cancels_queued_waits_for_running_and_joins(make_store) -> None:
    st = make_store()
    assert prefetch_threads() == []  # a store that never prefetched starts none
    w = Watch(st)
    blockers = w.block_io()
    data = put_entries(st, 4)
    queued = st.prefetch(list(data), priority=3)
    errors: list[BaseException] = []

    def acquire_queued() -> None:
        try:
            st.acquire("e.3")
        except BaseException as e:
            errors.append(e)

    waiter = threading.Thread(target=acquire_queued)
    waiter.start()
    wait_until(lambda: w.queue._entries[("e.3", "param")].urgent, "acquire to wait on e.3")
    closer = threading.Thread(target=st.close)
    closer.start()
    wait_until(lambda: all(f.cancelled() for f in queued), "close to cancel queued requests")
    assert not any(f.done() for f in blockers)  # running transfers are waited for
    w.open()
    closer.join(30)
    waiter.join(30)
    assert not closer.is_alive() and not waiter.is_alive()
    assert all(isinstance(f.result(timeout=0), torch.Tensor) for f in blockers)
    assert len(errors) == 1 and isinstance(errors[0], tierstore.StoreClosedError)
    assert prefetch_threads() == []
    with pytest.raises(tierstore.StoreClosedError):
        st.prefetch("e.0")
    with pytest.raises(tierstore.StoreClosedError):
        st.acquire("e.0")


# -- stress -------------------------------------------------------------------------------
def test_randomized_threads_keep_the_budget_and_leak_nothing(make_store) -> None:
    sizes = [4096, 64 * 1024, 256 * 1024, 600 * 1024, MiB]
    budget = 2 * MiB + 300 * 1024
    st = make_store(device_budget=budget, host_cache="1MiB", chunk_size="64KiB")
    w = Watch(st)
    rng = random.Random(1234)
    names = [f"s.{i}" for i in range(16)]
    want = {n: torch.full((rng.choice(sizes) // 4,), float(i)) for i, n in enumerate(names)}
    for name, t in want.items():
        st.put(name, t)
    errors: list[BaseException] = []
    stop = time.monotonic() + 4

    def worker(seed: int) -> None:
        r = random.Random(seed)
        try:
            while time.monotonic() < stop:
                batch = r.sample(names, r.randint(1, 4))
                futs = st.prefetch(batch, priority=(r.randint(0, 3), r.randint(0, 5)))
                op = r.random()
                if op < 0.15:
                    st.cancel(r.sample(batch, 1))
                elif op < 0.25:
                    r.choice(futs).cancel()
                for name in batch:
                    try:
                        t = st.acquire(name, timeout=2)
                    except TimeoutError:
                        continue  # the budget is held by others' batches: let go and go on
                    assert torch.equal(t, want[name]), name
                for name in batch:
                    if r.random() < 0.8:
                        st.release(name)
                    else:
                        st.cancel([name])
                # dropped: each future lands or is cancelled, none is left hanging
                assert not wait(futs, timeout=20).not_done, batch
                for name, f in zip(batch, futs):
                    if not f.cancelled():
                        assert torch.equal(f.result(), want[name]), name
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(40)
    assert not any(t.is_alive() for t in threads), "deadlock: workers still running"
    assert not errors, errors
    assert w.in_use and max(w.in_use) <= budget
    st.cancel(names)  # in-flight ones give their credits back once landed
    wait_until(lambda: pf_stats(st)["in_use_bytes"] == 0, "every credit to come back")
    s = pf_stats(st)
    assert (s["in_use_bytes"], s["queued"], s["resident"]) == (0, 0, 0), s
    assert s["transfers"] > 0 and s["peak_in_use_bytes"] <= budget
    # and the queue still serves everything afterwards
    for f, name in zip(st.prefetch(names), names):
        assert torch.equal(f.result(timeout=30), want[name])
        st.release(name)
    st.close()
    assert prefetch_threads() == []


# -- zero copy on the CPU -----------------------------------------------------------------
def in_arena(st: tierstore.Store, t: torch.Tensor) -> bool:
    arena = st._cache.arena
    return arena.data_ptr() <= t.data_ptr() < arena.data_ptr() + arena.numel()


def churn(st: tierstore.Store, names: list[str]) -> None:
    """Read other entries through a small host cache, so that unpinned slots are evicted
    and reused."""
    for _ in range(3):
        for name in names:
            st.get(name)


def test_cpu_acquire_is_a_view_of_the_pinned_cache_slot(make_store) -> None:
    st = make_store(host_cache="1MiB")  # two of these entries
    data = put_entries(st, 5, numel=MiB // 8)
    st.flush()
    assert st.prefetch_views()
    view = st.acquire("e.0")
    assert in_arena(st, view) and torch.equal(view, data["e.0"])
    s = pf_stats(st)
    assert s["zero_copy"] and s["bytes_copied"] == 0 and s["bytes_moved"] == MiB // 2
    churn(st, ["e.1", "e.2", "e.3", "e.4"])  # pinned: never evicted nor overwritten
    assert st._cache.peek(("e.0", "param")) is not None
    assert torch.equal(view, data["e.0"])
    # Released but still referenced: the view keeps its slot.
    assert st.release("e.0")
    churn(st, ["e.1", "e.2", "e.3", "e.4"])
    assert torch.equal(view, data["e.0"])
    # Once the last tensor over it is gone the pin goes too, and the slot can be evicted.
    del view
    wait_until(lambda: churn(st, ["e.1", "e.2", "e.3"]) or
               st._cache.peek(("e.0", "param")) is None, "e.0 to be evicted")


def test_cancelled_and_dropped_entries_release_their_pins(make_store) -> None:
    st = make_store(host_cache="1MiB")
    data = put_entries(st, 4, numel=MiB // 8)
    st.flush()
    st.prefetch_views()
    fut = st.prefetch("e.0")[0]
    assert torch.equal(fut.result(timeout=30), data["e.0"])
    assert st.cancel("e.0") == 1
    del fut
    # Cancelled while its stage 1 runs: the pin taken by the read goes when it lands.
    w = Watch(st)
    w.gate(["e.1"])
    st.prefetch("e.1")
    wait_until(lambda: w.names() == ["e.1"], "e.1 to start")
    assert st.cancel("e.1") == 1
    w.open()
    wait_until(lambda: pf_stats(st)["in_use_bytes"] == 0, "e.1's credits to come back")
    wait_until(lambda: churn(st, ["e.2", "e.3"]) or
               (st._cache.peek(("e.0", "param")) is None
                and st._cache.peek(("e.1", "param")) is None), "e.0 and e.1 to be evicted")


def test_entries_the_cache_does_not_take_are_read_into_their_own_buffers(make_store) -> None:
    st = make_store(host_cache="1MiB")
    st.put("big", torch.arange(MiB, dtype=torch.float32))  # 4 MiB: larger than the cache
    st.put("small", torch.ones(1000))
    st.flush()
    st.prefetch_views()
    big = st.acquire("big")
    assert not in_arena(st, big) and torch.equal(big, torch.arange(MiB, dtype=torch.float32))
    s = pf_stats(st)
    assert s["bytes_read"] == 4 * MiB and s["bytes_copied"] == 0
    st.acquire("small")
    assert pf_stats(st)["bytes_read"] == 4 * MiB  # a cache hit reads nothing


def test_copies_until_views_are_asked_for(make_store) -> None:
    st = make_store(host_cache="1MiB")
    data = put_entries(st, 2, numel=MiB // 8)
    st.flush()
    got = st.acquire("e.0")  # a caller's own copy: writing into it is allowed
    assert not in_arena(st, got) and torch.equal(got, data["e.0"])
    got.zero_()
    assert torch.equal(st.get("e.0"), data["e.0"])
    s = pf_stats(st)
    assert not s["zero_copy"] and s["bytes_copied"] == s["bytes_moved"] == MiB // 2
    assert st.prefetch_views() and pf_stats(st)["zero_copy"]
    assert in_arena(st, st.acquire("e.1"))
    assert not st.prefetch_views(enabled=False)
    st.release("e.0")
    assert not in_arena(st, st.acquire("e.0"))
