"""The memory-side rows of ``bench tiers``, and its plot.

PMem tier: the same ``put_many``/``get_many`` as the NVMe rows on a pmem-backed store,
beside the same durable copy without the store into a file on the pool's filesystem
(writes: ``pmem_memcpy_persist`` on DAX, a copy and ``pmem_msync`` elsewhere) and plain
memcpy (reads), with the same bytes and threads. Host cache: hits against memcpy. GPU:
host-device copies through the store against a plain pinned copy, where CUDA is present.
The NVMe rows, the shared row format and the command are in :mod:`bench.tiers`.
"""

from __future__ import annotations

import os
import shutil
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

import tierstore

from .tiers import (
    CHUNK,
    _latencies,
    _row,
    _store_read,
    _store_write,
    _write_source,
    _young_heap,
)


def measure_pmem(
    root: str, pool_dir: str, block: int, threads: int, total: int, repeats: int = 3,
) -> list[dict[str, Any]]:
    """PMem tier through the store against the same durable copy without it
    (:class:`tierstore.probes.DurableCopy`: ``pmem_memcpy_persist`` on DAX, a copy and
    ``pmem_msync`` elsewhere) with the same bytes and threads; reads against memcpy.

    Writes, like for like, as the NVMe rows: the store's first ``put_many`` lands in
    never-written pool space and the ceiling's first copy in its never-written file (the
    ``fresh`` figures); the row's writes rewrite space written before on both sides (the
    store's later puts, which copy-on-write places in the space the one before last
    freed). Then ``repeats`` rounds: each side once, the side going first alternating, each
    under ``_young_heap``; medians. Reads: an untimed pass of each kind, then ``repeats``
    rounds into memory reused from round to round (the row), and as fresh results
    (``read_fresh_gbps``: on the development VM fresh memory is paid for again in page
    faults whenever the host has taken it back, 0.4-0.6 GB/s in such rounds).
    ``pmem_memcpy_persist`` into a plain file is reported beside (``memcpy_flush_gbps``):
    a cache-flushing copy that is not durable there. The store's rewrites and reads are
    also timed from and into a caller's ``torch.empty`` tensors (one per entry, up to
    256 MiB of them, reused), in the same rounds (``torch_empty_gbps``, and its ratio to
    the row's own)."""
    n = max(threads, total // block)
    nbytes = n * block
    path = os.path.join(root, f"pmem-{block}")
    pool = os.path.join(pool_dir, f"bench-{os.getpid()}-{block}.pool")
    data = torch.randint(0, 255, (block,), dtype=torch.uint8)
    source = _write_source(data)  # a buffer of its own, as the ceiling's (see there)
    names = [f"bench.experts.{i}.w" for i in range(n)]
    runs: dict[str, list[float]] = {"store": [], "ceiling": [], "read": [], "fresh": [],
                                    "theirs": [], "read_theirs": []}
    theirs = [torch.empty(block, dtype=torch.uint8).copy_(data)  # touched, as a user's
              for _ in range(max(1, min(n, (256 << 20) // block)))]
    # Reads land in memory allocated before the clock and reused, as memcpy's destination
    # is (and as the NVMe rows read); fresh results are timed beside.
    into = tierstore.read_buffer(min(nbytes, 256 << 20))
    ceiling = tierstore.probes.DurableCopy(
        os.path.join(pool_dir, f"ceiling-{os.getpid()}-{block}.pool"), nbytes, threads)
    try:
        # Two versions of every entry (copy-on-write), and room for the latency puts.
        with tierstore.open(path, create=True, backing="pmem", pmem_path=pool,
                            pmem_size=2 * nbytes + (64 << 20), io_threads=threads,
                            chunk_size=CHUNK, host_cache=0) as st:
            engine = st.describe().split(": ", 1)[1].split(",")[0]
            with _young_heap():
                fresh = _store_write(st, names, source)
                fresh_ceiling = ceiling.write()
                _store_write(st, names, source)  # the second version: fresh space again
            for r in range(repeats):
                for side in ("store", "theirs", "ceiling")[:: 1 if r % 2 == 0 else -1]:
                    with _young_heap():
                        runs[side].append(ceiling.write() if side == "ceiling" else
                                          _store_write(st, names, source if side == "store"
                                                       else theirs))
            _store_read(st, names, block, set(), into)
            _store_read(st, names, block, set())
            for _ in range(repeats):
                with _young_heap():
                    runs["read"].append(_store_read(st, names, block, set(), into))
                    runs["read_theirs"].append(_store_read(st, names, block, set(), theirs))
                    runs["fresh"].append(_store_read(st, names, block, set()))
            lat = _latencies(st, names, data)
    finally:
        ceiling.close()
        shutil.rmtree(path, ignore_errors=True)
        if os.path.exists(pool):
            os.unlink(pool)
    span = min(nbytes, 256 << 20)
    flush = tierstore.probes.pmem_memcpy_persist_gbps(
        os.path.join(pool_dir, f"flush-{os.getpid()}.pool"), span, threads)
    memcpy = tierstore.probes.memcpy_gbps(span, threads)
    med = {k: statistics.median(v) for k, v in runs.items()}
    return [
        _row("pmem", "write", engine, block, threads, med["store"], lat["write"],
             med["ceiling"], ceiling.name, repeats=repeats,
             store_runs=[round(x, 3) for x in runs["store"]],
             ceiling_runs={ceiling.name: [round(x, 3) for x in runs["ceiling"]]},
             write_fresh_gbps=round(fresh, 3), fresh_ceiling=ceiling.name,
             fresh_ceilings={ceiling.name: round(fresh_ceiling, 3)},
             fresh_ratio=round(fresh / fresh_ceiling, 3),
             memcpy_gbps=round(memcpy, 3), memcpy_flush_gbps=round(flush or 0.0, 3),
             **_theirs(runs["theirs"], med["store"])),
        _row("pmem", "read", engine, block, threads, med["read"], lat["read"],
             memcpy, "memcpy", repeats=repeats, store_runs=[round(x, 3) for x in runs["read"]],
             read_fresh_gbps=round(med["fresh"], 3),
             read_fresh_runs=[round(x, 3) for x in runs["fresh"]],
             **_theirs(runs["read_theirs"], med["read"])),
    ]


def _theirs(runs: list[float], ours: float) -> dict[str, Any]:
    """A row's figures from a caller's ``torch.empty`` tensors (see measure_pmem)."""
    med = statistics.median(runs)
    return {"torch_empty_gbps": round(med, 3), "torch_empty_ratio": round(med / ours, 3),
            "torch_empty_runs": [round(x, 3) for x in runs]}


def measure_host(root: str, block: int, threads: int, total: int) -> list[dict[str, Any]]:
    """Host cache hits: ``get`` of resident entries (a copy out of the slot) against a plain
    memcpy of the same bytes."""
    n = max(1, min(total, 512 << 20) // block)
    path = os.path.join(root, f"host-{block}")
    with tierstore.open(path, create=True, host_cache=2 * n * block + (16 << 20),
                        slab_size=n * block + (16 << 20)) as st:
        data = torch.randint(0, 255, (block,), dtype=torch.uint8)
        names = [f"bench.experts.{i}.w" for i in range(n)]
        st.put_many([(name, data) for name in names])
        st.get_many(names)  # every page of the slots and results touched once
        lat = []
        t0 = time.perf_counter()
        for name in names:
            t1 = time.perf_counter()
            st.get(name)
            lat.append(time.perf_counter() - t1)
        gbps = n * block / (time.perf_counter() - t0) / 1e9
        hits = st.stats()["cache"]["hits"]
    shutil.rmtree(path, ignore_errors=True)
    if hits < n:
        raise tierstore.StoreError(f"host cache benchmark: only {hits} of {n} gets were hits")
    ceiling = tierstore.probes.memcpy_gbps(block, 1, repeat=5)
    return [_row("host", "read", "cache hit", block, 1, gbps, lat, ceiling, "memcpy")]


def measure_gpu(root: str, block: int) -> list[dict[str, Any]]:
    """Host to device through the store (a pinned cache slot copied to the GPU) against a
    plain pinned-to-device copy of the same size; device to host likewise for ``put``."""
    dev = torch.device("cuda")
    path = os.path.join(root, f"gpu-{block}")
    with tierstore.open(path, create=True, host_cache=4 * block + (16 << 20),
                        slab_size=2 * block + (16 << 20)) as st:
        src = torch.randint(0, 255, (block,), dtype=torch.uint8, device=dev)
        st.put("bench.w", src)
        st.get("bench.w", device=dev)
        h2d, d2h = [], []
        for _ in range(8):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            st.get("bench.w", device=dev)
            torch.cuda.synchronize()
            h2d.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            st.put("bench.w", src)
            d2h.append(time.perf_counter() - t0)
    shutil.rmtree(path, ignore_errors=True)
    pinned = torch.empty(block, dtype=torch.uint8, pin_memory=True)

    def copy_secs(fn: Callable[[], object]) -> float:
        best = float("inf")
        for _ in range(8):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t0)
        return best

    up = block / copy_secs(lambda: pinned.to(dev, non_blocking=True)) / 1e9
    down = block / copy_secs(lambda: pinned.copy_(src, non_blocking=True)) / 1e9
    name = torch.cuda.get_device_name(dev)
    return [
        _row("gpu", "h2d", name, block, 1, block / min(h2d) / 1e9, h2d, up, "pinned copy"),
        _row("gpu", "d2h", name, block, 1, block / min(d2h) / 1e9, d2h, down, "pinned copy"),
    ]


def plot(rows: list[dict[str, Any]], out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({(r["tier"], r["op"]) for r in rows})
    fig, axes = plt.subplots(1, len(groups), figsize=(4 * len(groups), 3.6), squeeze=False)
    for ax, (tier, op) in zip(axes[0], groups):
        series = sorted({(r["engine"], r["threads"]) for r in rows if (r["tier"], r["op"]) == (tier, op)})
        for engine, threads in series:
            pts = sorted((r["block_bytes"], r["gbps"], r["ceiling_gbps"]) for r in rows
                         if (r["tier"], r["op"], r["engine"], r["threads"]) == (tier, op, engine, threads))
            xs = [p[0] / 2**20 for p in pts]
            line, = ax.plot(xs, [p[1] for p in pts], marker="o", label=f"{engine} x{threads}")
            ax.plot(xs, [p[2] for p in pts], linestyle="--", color=line.get_color())
        ax.set_xscale("log", base=2)
        ax.set_xlabel("entry size (MiB)")
        ax.set_ylabel("GB/s (dashed: ceiling)")
        ax.set_title(f"{tier} {op}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
