"""The CUDA paths on a real GPU: device memory over training steps, buffer reuse under busy
consumer streams, how much host memory is pinned, bf16 through every CUDA path, a store on
the kvikio engine, staged copies of unpinned sources, strided device destinations and
checkpoint RNG state from a machine with more GPUs.
Skipped without CUDA (see conftest). The CPU-side rules behind them are in
test_gpu_paths.py."""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import pytest
import torch
from tierstore.cache import pinned as pinned_mod

import tierstore

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]

MiB = 1 << 20
# Long enough that a kernel queued behind it is still pending when the host moves on.
SLEEP_CYCLES = 500_000_000


def raw(t: torch.Tensor) -> torch.Tensor:
    # Viewed as bytes where it lies, then copied: a copy of bytes needs no kernel for the
    # dtype (the sub-byte ones have none on some devices).
    if not t.numel():
        return torch.empty(0, dtype=torch.uint8)
    return t.detach().contiguous().reshape(-1).view(torch.uint8).cpu()


def _open(tmp_path: Path, **kw: Any) -> tierstore.Store:
    opts: dict[str, Any] = {"create": True, "slab_size": "256MiB", "host_cache": "64MiB"}
    opts.update(kw)
    return tierstore.open(tmp_path / "st", **opts)


def test_trainer_device_memory_is_flat_over_20_steps(tmp_path: Path) -> None:
    from tierstore.trainer.train.data import load_corpus
    from tierstore.trainer.train.resident import TrainConfig
    from tierstore.trainer.train.store_trainer import train_store

    tc = TrainConfig(batch_size=4, seq_len=32, grad_accum=2, eval_every=0, lr=3e-3,
                     warmup_steps=2, decay_steps=20)
    corpus = load_corpus(max_bytes=1024 * 1024)
    for fetch in ("direct", "queue"):
        used: list[int] = []
        train_store("tiny", 20, seed=0, train=tc, corpus=corpus,
                    store_path=tmp_path / fetch, host_cache="8MiB", slab_size="64MiB",
                    device="cuda", fetch=fetch,
                    on_step=lambda m, used=used: used.append(torch.cuda.memory_allocated()))
        assert len(used) == 20
        # After warm-up (optimizer state, pools), a step allocates what it frees.
        assert max(used[5:]) <= used[4] + MiB, (fetch, used)
        assert used[-1] <= used[5] + MiB, (fetch, used)


def test_reuse_after_release_waits_for_a_busy_consumer(tmp_path: Path) -> None:
    n = 4 * MiB // 4
    with _open(tmp_path, device_budget={"cuda": 4 * MiB}) as st:  # one entry at a time
        st.put("a", torch.full((n,), 1.0))
        st.put("b", torch.full((n,), 2.0))
        consumer = torch.cuda.Stream()
        with torch.cuda.stream(consumer):
            a = st.acquire("a", device="cuda")
            torch.cuda._sleep(SLEEP_CYCLES)  # the consumer is busy ...
            total = a.sum()  # ... so this reads `a` long after the host moves on
            st.release("a", device="cuda")
        del a
        b = st.prefetch("b", device="cuda")[0].result(timeout=120)  # wants a's budget
        consumer.synchronize()
        assert total.item() == pytest.approx(float(n))  # a's bytes were not overwritten
        assert b.sum().item() == pytest.approx(2.0 * n)
        st.release("b", device="cuda")
        torch.cuda.synchronize()
        s = st.stats()["prefetch"][f"cuda:{torch.cuda.current_device()}"]
        assert s["in_use_bytes"] == 0 and s["peak_in_use_bytes"] <= 4 * MiB


def test_a_futures_tensor_used_on_another_stream(tmp_path: Path) -> None:
    n = 2 * MiB // 4
    with _open(tmp_path, device_budget={"cuda": 2 * MiB}) as st:
        st.put("a", torch.full((n,), 3.0))
        st.put("b", torch.full((n,), 5.0))
        t = st.prefetch("a", device="cuda")[0].result(timeout=120)
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            torch.cuda._sleep(SLEEP_CYCLES)
            total = t.sum()
            st.release("a", device="cuda")  # on the stream that used it
        del t
        gc.collect()
        b = st.acquire("b", device="cuda")
        side.synchronize()
        assert total.item() == pytest.approx(3.0 * n)
        assert b.sum().item() == pytest.approx(5.0 * n)
        st.release("b", device="cuda")


def _host_allocator_bytes() -> int:
    if not hasattr(torch.cuda, "host_memory_stats"):  # newer torch only
        pytest.skip("this torch has no torch.cuda.host_memory_stats")
    stats = torch.cuda.host_memory_stats()
    return max((int(v) for k, v in stats.items()
                if k.endswith("bytes.current") and isinstance(v, int)), default=0)


def test_the_cache_pins_exactly_its_capacity_and_only_for_a_cuda_consumer(
        tmp_path: Path) -> None:
    gc.collect()  # an arena an earlier test left must not go mid-test
    before_torch = _host_allocator_bytes()
    before = pinned_mod.pinned_bytes()
    with _open(tmp_path, host_cache="64MiB") as st:
        assert st._cache is not None
        st.put("x", torch.ones(1024))
        st.flush()
        st.prefetch("x", device="cuda")[0].result(timeout=60)  # a CUDA consumer
        assert st._cache.pinned and st._cache.arena.is_pinned()
        assert pinned_mod.pinned_bytes() - before == 64 * MiB
        # Not through torch's caching host allocator (which would round 64 MiB + a page up
        # to 128 MiB and keep it after close).
        assert _host_allocator_bytes() - before_torch < 64 * MiB
        st.release("x", device="cuda")
    del st
    gc.collect()
    assert pinned_mod.pinned_bytes() == before


def test_bf16_through_every_cuda_path(tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(5)
    # Every bit pattern class: NaN payloads and subnormals must survive as bytes.
    bits = torch.randint(-(1 << 15), 1 << 15, (3, 4099), dtype=torch.int16, generator=gen)
    want = bits.view(torch.bfloat16)
    for host_cache in ("64MiB", 0):
        with _open(tmp_path / str(host_cache), host_cache=host_cache) as st:
            st.put("w", want)
            st.flush()
            got = st.get("w", device="cuda")
            assert got.is_cuda and got.dtype == torch.bfloat16
            assert torch.equal(raw(got), raw(want))
            out = torch.empty_like(want, device="cuda")
            st.get_many(["w"], device="cuda", out={"w": out})
            assert torch.equal(raw(out), raw(want))
            fut = st.prefetch("w", device="cuda")[0]
            acquired = st.acquire("w", device="cuda")
            assert torch.equal(raw(acquired), raw(want))
            assert torch.equal(raw(fut.result(timeout=60)), raw(want))
            st.release("w", device="cuda")


def test_a_store_on_the_kvikio_engine_round_trips_and_reopens(tmp_path: Path) -> None:
    pytest.importorskip("kvikio")
    gen = torch.Generator().manual_seed(11)
    want = {f"e{i}": torch.randn(257 * 1024 + i, generator=gen) for i in range(6)}
    for host_cache in ("64MiB", 0):
        path = tmp_path / f"kv{host_cache}"
        with tierstore.open(path, create=True, engine="kvikio", slab_size="256MiB",
                            host_cache=host_cache) as st:
            assert "kvikio" in st.describe()
            st.put_many(want)
            st.flush()
            got = st.get_many(list(want), device="cuda")
            assert all(got[k].is_cuda and torch.equal(got[k].cpu(), v) for k, v in want.items())
        with tierstore.open(path, engine="kvikio", host_cache=host_cache) as st:
            assert all(torch.equal(st.get(k), v) for k, v in want.items())
            assert st.fsck().ok


def test_an_unpinned_source_larger_than_the_staging_ring_lands_whole(tmp_path: Path) -> None:
    # No host cache: the read's own buffer is not page-locked, so the copy goes through
    # the copier's staging chunks, which wrap more than once for 80 MiB.
    big = torch.arange(20 * MiB, dtype=torch.float32)
    with _open(tmp_path, host_cache=0, device_budget={"cuda": 256 * MiB}) as st:
        st.put("big", big)
        got = st.get("big", device="cuda")
        assert got.is_cuda and torch.equal(got.cpu(), big)
        (fut,) = st.prefetch(["big"], device="cuda")
        assert torch.equal(fut.result(timeout=120).cpu(), big)
        st.release("big", device="cuda")


def test_reads_into_a_non_contiguous_cuda_tensor(tmp_path: Path) -> None:
    src = torch.randn(64, 48)
    with _open(tmp_path) as st:
        st.put("w", src)
        base = torch.zeros(48, 64, device="cuda")
        out = base.t()  # (64, 48), not contiguous
        assert not out.is_contiguous()
        st.get("w", out=out)
        assert torch.equal(out.cpu(), src) and torch.equal(base.t().cpu(), src)


def test_rng_state_of_a_machine_with_more_gpus_restores_here() -> None:
    from tierstore.trainer.train.resident import rng_state, set_rng_state

    state = rng_state()
    state["cuda"] = list(state["cuda"]) + [state["cuda"][0].clone()] * 7  # saved on 8+ GPUs
    set_rng_state(state)  # this machine's devices get theirs; the rest are not asked for
    assert torch.equal(torch.cuda.get_rng_state(0), state["cuda"][0])

