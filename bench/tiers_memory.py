"""The memory-side rows of ``bench tiers``, and its plot.

PMem tier: the same ``put_many``/``get_many`` as the NVMe rows on a pmem-backed store,
beside ``pmem_memcpy_persist`` into a file on the pool's filesystem (writes) and plain
memcpy (reads) with the same bytes and threads. Host cache: hits against memcpy. GPU:
host-device copies through the store against a plain pinned copy, where CUDA is present.
The NVMe rows, the shared row format and the command are in :mod:`bench.tiers`.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from typing import Any

import torch

import tierstore

from .tiers import CHUNK, _latencies, _row, _store_read, _store_write


def _store_rw(st: tierstore.Store, block: int, n: int, drop_cache: bool) -> dict[str, Any]:
    """Time ``put_many`` and ``get_many`` of ``n`` entries of ``block`` bytes, and the
    latency of single puts and gets. One untimed read pass comes first: the timed one then
    lands in memory the process already has, as a steady stream of reads does (and as fio's
    reused buffers do)."""
    data = torch.randint(0, 255, (block,), dtype=torch.uint8)
    names = [f"bench.experts.{i}.w" for i in range(n)]
    write = _store_write(st, names, data)
    infos = [st.info(name) for name in names]
    paths = {i.path for i in infos if i.path} if drop_cache else set()
    _store_read(st, names, block, paths)
    read = _store_read(st, names, block, paths)
    lat = _latencies(st, names, data)
    return {"write": (write, lat["write"]), "read": (read, lat["read"]), "infos": infos}


def measure_pmem(
    root: str, pool_dir: str, block: int, threads: int, total: int
) -> list[dict[str, Any]]:
    """PMem tier through the store; ceilings: pmem_memcpy_persist into a file beside the
    pool (writes) and plain memcpy (reads), same bytes and threads."""
    n = max(threads, total // block)
    path = os.path.join(root, f"pmem-{block}")
    pool = os.path.join(pool_dir, f"bench-{os.getpid()}-{block}.pool")
    try:
        with tierstore.open(path, create=True, backing="pmem", pmem_path=pool,
                            pmem_size=n * block + (64 << 20), io_threads=threads,
                            chunk_size=CHUNK, host_cache=0) as st:
            engine = st.describe().split(": ", 1)[1].split(",")[0]
            got = _store_rw(st, block, n, drop_cache=False)
    finally:
        shutil.rmtree(path, ignore_errors=True)
        if os.path.exists(pool):
            os.unlink(pool)
    nbytes = min(n * block, 256 << 20)
    persist = tierstore.probes.pmem_memcpy_persist_gbps(
        os.path.join(pool_dir, f"ceiling-{os.getpid()}.pool"), nbytes, threads)
    memcpy = tierstore.probes.memcpy_gbps(nbytes, threads)
    write_ceiling, write_name = (persist, "pmem_memcpy_persist") if persist else (memcpy, "memcpy")
    return [
        _row("pmem", "write", engine, block, threads, got["write"][0], got["write"][1],
             write_ceiling, write_name, memcpy_gbps=round(memcpy, 3)),
        _row("pmem", "read", engine, block, threads, got["read"][0], got["read"][1],
             memcpy, "memcpy", pmem_memcpy_persist_gbps=round(persist or 0.0, 3)),
    ]


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
