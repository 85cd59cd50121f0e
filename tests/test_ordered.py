"""tierstore.ordered: calls run in the order given, at most a lane's worth at once."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor, wait

import pytest

from tierstore.ordered import InOrder, usable_cores


class _Counting(ThreadPoolExecutor):
    """A real pool that counts the jobs handed to it."""

    def __init__(self, workers: int) -> None:
        super().__init__(workers)
        self.handed = 0

    def submit(self, fn, /, *args, **kwargs):  # type: ignore[override]
        self.handed += 1
        return super().submit(fn, *args, **kwargs)


def test_calls_run_in_the_order_given_on_one_lane() -> None:
    ran: list[int] = []
    with ThreadPoolExecutor(4) as pool:
        jobs = InOrder(pool, 1)
        futs = [jobs.submit(ran.append, k) for k in range(50)]
        wait(futs)
    assert ran == list(range(50))
    assert all(f.result() is None for f in futs)


def test_no_more_pool_jobs_than_lanes_and_every_call_runs() -> None:
    release = threading.Event()

    def held(k: int) -> int:
        assert release.wait(30)
        return k * k

    with _Counting(8) as pool:
        jobs = InOrder(pool, 2)
        futs = [jobs.submit(held, k) for k in range(6)]
        # Decided as each call is handed over: two lanes while the first two are held.
        assert pool.handed == 2
        release.set()
        assert [f.result(timeout=30) for f in futs] == [k * k for k in range(6)]
        # Every lane ended with nothing left; the next call starts one afresh.
        assert jobs.submit(held, 7).result(timeout=30) == 49


def test_a_failing_call_fails_its_future_only() -> None:
    def job(k: int) -> int:
        if k == 2:
            raise ValueError("bad call")
        return k

    with ThreadPoolExecutor(2) as pool:
        jobs = InOrder(pool, 1)
        futs = [jobs.submit(job, k) for k in range(5)]
        wait(futs)
    with pytest.raises(ValueError, match="bad call"):
        futs[2].result()
    assert [f.result() for k, f in enumerate(futs) if k != 2] == [0, 1, 3, 4]


def test_a_pool_shut_down_raises_every_time_and_queues_nothing() -> None:
    pool = ThreadPoolExecutor(2)
    pool.shutdown()
    jobs = InOrder(pool, 1)
    for _ in range(2):  # the lane given back: not a call queued behind a lane that never runs
        with pytest.raises(RuntimeError):
            jobs.submit(len, "abc")


def test_usable_cores_is_at_least_one() -> None:
    assert usable_cores() >= 1
