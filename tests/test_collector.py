"""A store call holds Python's cycle collector off, and gives it back as it found it."""

from __future__ import annotations

import gc
from typing import Any

import torch

import tierstore
from tierstore.collector import paused


def test_a_put_and_a_get_of_many_entries_set_off_at_most_one_collection(tmp_path) -> None:
    """Held off while the call runs, the collector gets at most one turn as it ends (what
    the call made and still holds, its result, counts); the same put with it on has many."""
    values = {f"e{i}": torch.full((1024,), i % 251, dtype=torch.uint8) for i in range(3000)}
    seen: list[int] = []

    def count(phase: str, info: dict) -> None:
        if phase == "start":
            seen.append(info["generation"])

    def collections(call: Any) -> int:
        before = len(seen)
        call()
        return len(seen) - before

    with tierstore.open(tmp_path / "s", create=True, host_cache=0) as st:
        st.put_many(values)  # the keys' checks are remembered from here on
        st.get_many(list(values))
        gc.callbacks.append(count)
        try:
            assert collections(lambda: st.put_many(values)) <= 1
            assert collections(lambda: st.get_many(list(values))) <= 1
            unpaused = type(st).put_many.__wrapped__  # the same put, collector on
            assert collections(lambda: unpaused(st, values)) > 1
        finally:
            gc.callbacks.remove(count)
        assert gc.isenabled()
        got = st.get_many(list(values))
    assert all(torch.equal(got[k], v) for k, v in values.items())


def test_the_collector_resumes_when_the_last_call_ends_and_stays_off_if_it_was() -> None:
    assert gc.isenabled()
    outer, inner = paused(), paused()
    outer.__enter__()
    inner.__enter__()  # another thread's call, overlapping
    assert not gc.isenabled()
    outer.__exit__(None, None, None)
    assert not gc.isenabled()  # one call still runs
    inner.__exit__(None, None, None)
    assert gc.isenabled()
    gc.disable()
    try:
        with paused():
            assert not gc.isenabled()
        assert not gc.isenabled()  # the process had turned it off
    finally:
        gc.enable()
