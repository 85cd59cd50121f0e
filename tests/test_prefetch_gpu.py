"""The prefetch queue with a CUDA device: pinned host bytes copied on the queue's side stream,
ordered before the consumer's kernels by an event. Skipped without CUDA (see conftest)."""

from __future__ import annotations

import pytest
import torch

MiB = 1 << 20
pytestmark = [pytest.mark.gpu, pytest.mark.timeout(120)]


def raw(t: torch.Tensor) -> torch.Tensor:
    # Viewed as bytes where it lies, then copied: a copy of bytes needs no kernel for the
    # dtype (the sub-byte ones have none on some devices).
    if not t.numel():
        return torch.empty(0, dtype=torch.uint8)
    return t.detach().contiguous().reshape(-1).view(torch.uint8).cpu()


@pytest.mark.parametrize("host_cache", ["64MiB", 0], ids=["pinned-cache", "no-cache"])
def test_acquired_device_tensors_equal_get(make_store, host_cache) -> None:
    st = make_store(host_cache=host_cache)
    gen = torch.Generator().manual_seed(3)
    want = {f"t.{dt}": torch.randint(0, 256, (5, 30_000), dtype=torch.uint8, generator=gen).view(dt)
            for dt in (torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.uint8)}
    want["t.int4"] = torch.randint(0, 256, (33,), dtype=torch.uint8, generator=gen).view(torch.int4)
    want["t.scalar"] = torch.tensor(2.5)
    want["t.empty"] = torch.empty(0, 3)
    for name, t in want.items():
        st.put(name, t)
    st.flush()
    futs = st.prefetch(list(want), device="cuda", priority=(0, 0))
    for (name, t), fut in zip(want.items(), futs):
        got = st.acquire(name, device="cuda")
        assert got.is_cuda and got.dtype == t.dtype and got.shape == t.shape, name
        assert torch.equal(raw(got), raw(st.get(name))) and torch.equal(raw(got), raw(t)), name
        assert fut.result(timeout=30) is got
    assert set(st.stats()["prefetch"]) == {f"cuda:{torch.cuda.current_device()}"}


def test_pinned_async_copies_on_the_side_stream_land_the_right_bytes(make_store) -> None:
    st = make_store(host_cache="256MiB", slab_size="512MiB", device_budget={"cuda": "32MiB"})
    queue = st._queues.get("cuda")
    # The queue is a CUDA consumer: the cache's arena is page-locked from now on.
    assert st._cache is not None and st._cache.pinned and st._cache.arena.is_pinned()
    n = 8
    data = {f"big.{i}": torch.randn(8 * MiB // 4) + i for i in range(n)}  # 8 MiB each
    for name, t in data.items():
        st.put(name, t)
    sums = {name: t.double().sum().item() for name, t in data.items()}
    consumer = torch.cuda.Stream()
    assert queue._stream is not None and queue._stream != torch.cuda.current_stream()
    peak = []
    queue.on_start = lambda key, in_use: peak.append(in_use)
    with torch.cuda.stream(consumer):
        for step in range(3):
            st.prefetch(list(data), device="cuda", priority=(step, 0))
            results = []
            for name in data:
                t = st.acquire(name, device="cuda")  # no host wait: the stream waits on the copy
                results.append((name, t.double().sum(), t[:1024].clone()))
                st.release(name, device="cuda")
            consumer.synchronize()
            for name, total, head in results:
                assert total.item() == pytest.approx(sums[name], rel=1e-9), name
                assert torch.equal(head.cpu(), data[name][:1024]), name
    assert max(peak) <= 32 * MiB  # 4 of the 8 entries at a time
    s = st.stats()["prefetch"][str(queue.device)]
    assert s["in_use_bytes"] == 0 and s["transfers"] == 3 * n
    assert s["bytes_moved"] == 3 * n * 8 * MiB
