"""Tier bandwidth against a ceiling measured in the same run.

The NVMe and PMem tiers are measured with the host cache off (``host_cache=0``), so the
figures are the tiers' own; the host cache is measured on its own (hits against memcpy), and
host-device copies where CUDA is present (against a plain pinned copy). The memory-side
tiers (PMem, the host cache, the GPU copies) and the plot are in :mod:`bench.tiers_memory`.

NVMe tier: the store writes ``n`` entries of a block size with ``put_many`` (copy-on-write,
fdatasync, one commit) and reads them back with ``get_many`` (crc32c-verified). Beside each,
in the same run and on the same slab file, three ceilings: fio ``psync`` with a job per I/O
thread, fio ``io_uring`` (``libaio`` where io_uring is unavailable) at queue depth 32, both
with the request size the store issues (the entry, cut into the store's chunks) and the same
O_DIRECT flag, and DeepSpeed's DeepNVMe ``aio_handle`` (1 MiB blocks, queue depth 32, page-
locked buffers; :mod:`bench.deepnvme`) where deepspeed is installed. They read the region the
entries occupy and write a part of the slab of their own, ending with an fsync as the store
does (:mod:`bench.ceilings`). All sides are timed in their steady state, writes rewriting
space written once before, and reported beside it, into never-written space (see
:func:`measure_nvme`). The store's
ratio to the best ceiling is the figure of merit. Where CUDA, kvikio and ``gdsio`` are present,
the same measurement runs with the kvikio engine against gdsio (GPUDirect Storage) as the
``gds`` rows (gdsio on a file of its own beside the slab). Those rows are not like for like, and say so: the store reads into host
memory (it never hands the medium a device buffer, see :mod:`nvme.engines`), gdsio reads
into device memory; the ratio is how far the store's host-staged path is from GDS, not an
efficiency. Whether kvikio bypasses the page cache depends on what the installed kvikio
accepted (:func:`nvme.engines.configure_kvikio`), so the page cache is dropped before every
kvikio read pass, and fio's ceiling uses the same O_DIRECT flag as the engine really used.

Small entries against large: beside the table, each engine's ``put_many`` and
``get_many(out=...)`` of 256 KiB entries are held against the same calls on 16 MiB entries
in one store, alternated (:func:`measure_entry_sizes`): what per-entry overhead costs. The
two sizes' rows in the table are minutes apart and carry the disk's drift.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

import tierstore

from .ceilings import gds_unavailable, nvme_ceilings

CHUNK = 8 << 20
FRESH = "store, fresh results"
UNALIGNED = "store, unaligned source"
# The entry sizes held against each other (measure_entry_sizes): the trainer's small
# presets' experts, and a large expert matrix.
SMALL_ENTRY, LARGE_ENTRY = 256 << 10, 16 << 20


def engine_reads_direct(engine: str, described: str = "") -> bool:
    """Whether the store's reads through ``engine`` bypass the page cache: POSIX O_DIRECT
    and AIO (``auto`` is one of them) do; kvikio does only if the installed version took
    ``auto_direct_io_read``, which the store's ``describe()`` (``described``) reports."""
    if engine in ("posix-direct", "aio", "auto"):
        return "refused by the filesystem" not in described
    return engine == "kvikio" and "reads direct I/O" in described


def drop_page_cache(paths: set[str]) -> None:
    """Evict files from the page cache, so buffered reads that follow really hit the disk."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _lead(row: dict[str, Any], op: str) -> str:
    """A printed row's first columns: tier, ``op``, engine, entry size, threads."""
    return (f"{row['tier']:5} {op:5} {row['engine'][:15]:15} "
            f"{tierstore.format_size(row['block_bytes']):>9} {row['threads']:>3}")


def _percentiles(samples: list[float]) -> tuple[float, float]:
    s = sorted(samples)
    return s[len(s) // 2] * 1e3, s[min(len(s) - 1, int(len(s) * 0.99))] * 1e3


@contextlib.contextmanager
def _young_heap() -> Iterator[None]:
    """Time with only the run's own objects in reach of Python's cycle collector, as
    ``timeit`` turns the collector off while it times. The benchmark's process holds the
    200,000 objects that torch and DeepSpeed leave, a full collection of them took 82-96 ms
    on the development machine, and a put of 1,024 small entries allocates enough to set
    one off: it landed in the timed 256 KiB put of 2 rounds in 5, the same rounds from run
    to run. Objects made before the clock are set aside (``gc.freeze``) for every side
    alike; the collector still runs over what the timed work allocates."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _store_write(st: tierstore.Store, names: list[str],
                 data: torch.Tensor | list[torch.Tensor]) -> float:
    """GB/s of one ``put_many`` of every name (copy-on-write, fdatasync, one commit), from
    ``data``, or from tensors of a caller's (a list: name ``j`` from ``data[j % len]``)."""
    srcs = data if isinstance(data, list) else [data]
    items = [(name, srcs[j % len(srcs)]) for j, name in enumerate(names)]
    t0 = time.perf_counter()
    st.put_many(items)
    return len(names) * srcs[0].nbytes / (time.perf_counter() - t0) / 1e9


def _write_source(data: torch.Tensor) -> torch.Tensor:
    """A copy of ``data`` in memory made for I/O, as fio's and DeepNVMe's buffers are their
    own single allocations made for it: a :func:`tierstore.read_buffer` (page-aligned, on
    2 MiB pages; a small source gets a 2 MiB buffer of its own). On the development VM the
    raw AIO engine, no store code, wrote 256 MiB from a 64 MiB source at 7.8 GB/s on 2 MiB
    pages and at 4.4 from a fresh source on 4 KiB pages, while fio's own 4 KiB-page buffers
    wrote at 3.0-7.5 from one process to the next: the disk takes at most 254 segments a
    request, and how many a request needs depends on where its pages sit."""
    buf = tierstore.read_buffer(max(data.nbytes, 2 << 20))[: data.nbytes]
    return buf.view(data.dtype).view(data.shape).copy_(data)


def _store_read(st: tierstore.Store, names: list[str], block: int, paths: set[str],
                into: torch.Tensor | list[torch.Tensor] | None = None) -> float:
    """GB/s of reading every name with ``get_many`` (crc32c-verified), 256 MiB per call:
    into ``into`` (``out=``, one slice per name, or a list of a caller's tensors, one per
    name of a call: memory the caller reuses, as fio and DeepNVMe reuse theirs), or as
    fresh results dropped as a caller moving on to the next batch would. ``paths`` are evicted from the page cache first, so buffered reads start
    cold as fio's do."""
    if paths:
        drop_page_cache(paths)
    group = max(1, (256 << 20) // block)
    parts = [names[i : i + group] for i in range(0, len(names), group)]
    outs = [None if into is None else {
        name: into[j] if isinstance(into, list) else into[j * block : (j + 1) * block]
        for j, name in enumerate(part)} for part in parts]
    t0 = time.perf_counter()  # the caller's out= mapping is made before, as fio's buffers
    for part, out in zip(parts, outs):
        st.get_many(part, out=out)
    return len(names) * block / (time.perf_counter() - t0) / 1e9


def _latencies(st: tierstore.Store, names: list[str], data: torch.Tensor) -> dict[str, list[float]]:
    """Seconds per single ``put`` and per single ``get`` of the first 16 names."""
    lat: dict[str, list[float]] = {"write": [], "read": []}
    for name in names[:16]:
        t0 = time.perf_counter()
        st.put(name, data)
        lat["write"].append(time.perf_counter() - t0)
    for name in names[:16]:
        t0 = time.perf_counter()
        st.get(name)
        lat["read"].append(time.perf_counter() - t0)
    return lat


def _row(tier: str, op: str, engine: str, block: int, threads: int, gbps: float,
         lat: list[float], ceiling: float, ceiling_name: str, **extra: Any) -> dict[str, Any]:
    p50, p99 = _percentiles(lat)
    return {
        "tier": tier, "op": op, "engine": engine, "block_bytes": block, "threads": threads,
        "gbps": round(gbps, 3), "ceiling_gbps": round(ceiling, 3), "ceiling": ceiling_name,
        "ratio": round(gbps / ceiling, 3), "p50_ms": round(p50, 3), "p99_ms": round(p99, 3),
        **extra,
    }


def _rss() -> tuple[float, float]:
    """(peak, current) resident set size of this process in MB."""
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    with open("/proc/self/statm") as f:
        now = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    return round(peak, 1), round(now, 1)


def measure_nvme(
    root: str, engine: str, block: int, threads: int, total: int, repeats: int = 3,
    ceiling: str = "fio",
) -> list[dict[str, Any]]:
    """Store and its ceilings (see :func:`nvme_ceilings`; gdsio for the kvikio engine's GDS
    rows) on the same slab file, same request size and O_DIRECT flag; medians over
    ``repeats`` fresh stores, and the store's ratio to the best ceiling.

    Writes, like for like: the slab is fallocated, and the first write into a region of it
    converts its unwritten extents, which on the development machine's ext4 halved fio's
    bandwidth (3.1 against 5.3-6.9 GB/s at 256 KiB). So the store and every ceiling are
    timed twice on their own region: once into never-written space (the ``fresh`` figures:
    the store's second ``put_many``, the first having set up its staging buffers as fio sets
    up its own before timing), then rewriting it (the row: the store's later puts, which
    copy-on-write places in the space the one before freed, as a store in use does). gdsio
    writes a file of its own that is written in full before its first use, so the ``gds``
    rows have no fresh figures. Every side ends with an fsync, as the store's fdatasync.
    The rewrites are timed once a side each round, in an order rotated every round. Each
    round times with only its own objects in reach of the cycle collector (``_young_heap``).
    Reads: one untimed store pass of each kind, then the store (into
    memory allocated before its clock starts and reused, as fio's and DeepNVMe's buffers
    are; and, reported beside it, as fresh results) and every ceiling read the same region,
    in an order reversed every round and rotated between repeats, so a drift of the shared
    disk lands on all sides alike."""
    n = max(threads, total // block)
    path = os.path.join(root, f"{engine}-{ceiling}-{block}")
    direct = engine_reads_direct(engine)  # kvikio: settled once its store says (below)
    bs = min(block, CHUNK)
    lat: dict[str, list[float]] = {"write": [], "read": []}
    data = torch.randint(0, 255, (block,), dtype=torch.uint8)
    # The ceilings write from buffers of their own, made and filled before their clocks
    # start (DeepNVMe's page-locked): the store's write row writes from one too (see
    # _write_source). A tensor of torch's allocator is not page-aligned, and O_DIRECT then
    # needs a staging copy: that write is timed as well (``write_unaligned_gbps``).
    aligned = _write_source(data)
    # The store reads into memory allocated before the clock starts and reused every
    # round, as fio's and DeepNVMe's buffers are; fresh results are timed too.
    into = tierstore.read_buffer(min(n * block, 256 << 20))
    fresh: list[float] = []
    names = [f"bench.experts.{i}.w" for i in range(n)]
    runs: dict[str, dict[str, list[float]]] = {}
    unaligned: list[float] = []
    fresh_write: list[float] = []
    fresh_ceiling: dict[str, list[float]] = {}
    described = engine
    rss: list[tuple[float, float]] = []

    for r in range(repeats):  # a fresh store each time: same free layout, same slab state
        ceilings, closers = nvme_ceilings(ceiling, bs, threads, direct, n * block)
        regions = 3 + len(ceilings)
        try:
            with tierstore.open(path, create=True, engine=engine, io_threads=threads,
                                host_cache=0, slab_size=regions * n * block + (64 << 20),
                                chunk_size=CHUNK) as st, _young_heap():
                described = st.describe().split(": ", 1)[-1]
                direct = engine_reads_direct(engine, st.describe())
                for op in ("write", "read"):
                    runs.setdefault(op, {}).setdefault("store", [])
                    for name in ceilings:
                        runs[op].setdefault(name, [])
                _store_write(st, names, data)  # region 0, untimed
                fresh_write.append(_store_write(st, names, aligned))  # region 1, never written
                slab = st.info(names[0]).path
                # The store's copy-on-write keeps to its first three regions (two versions
                # and the one being written); each ceiling writes a region after them.
                region = -(-n * block // bs) * bs
                at = {name: (3 + j) * region for j, name in enumerate(ceilings)}
                if ceiling == "fio":  # gdsio writes a file of its own, written in full
                    for name, fn in ceilings.items():
                        fresh_ceiling.setdefault(name, []).append(
                            fn(slab, "write", at[name], n * block))
                # Each side writes once a round, in an order rotated every round, so a
                # drift of the shared disk lands on all sides alike. The store's two
                # sources rewrite regions 0 and 1 in turns (copy-on-write frees the older).
                sides = ["store", UNALIGNED, *ceilings]
                for side in sides[r % len(sides):] + sides[: r % len(sides)]:
                    if side == "store":
                        runs["write"]["store"].append(_store_write(st, names, aligned))
                    elif side == UNALIGNED:
                        unaligned.append(_store_write(st, names, data))
                    else:
                        runs["write"][side].append(
                            ceilings[side](slab, "write", at[side], n * block))
                infos = [st.info(name) for name in names]
                # kvikio's direct reads are a request that its version may ignore: drop
                # the page cache for it regardless, so a cached read is never counted.
                paths = {slab} if not direct or engine == "kvikio" else set()
                used = (min(i.offset for i in infos) // bs * bs,
                        max(i.offset + block for i in infos))
                if used[1] > 3 * region:
                    raise RuntimeError(f"the store wrote past its regions ({used[1]} > "
                                       f"{3 * region}): the ceilings' writes overlapped it")
                _store_read(st, names, block, paths, into)
                _store_read(st, names, block, paths)
                sides = ["store", FRESH, *ceilings]
                sides = sides[r % len(sides):] + sides[: r % len(sides)]
                for side in sides + sides[::-1]:
                    if side == "store":
                        runs["read"]["store"].append(
                            _store_read(st, names, block, paths, into))
                    elif side == FRESH:
                        fresh.append(_store_read(st, names, block, paths))
                    else:
                        span = (used[1] - used[0]) // bs * bs
                        runs["read"][side].append(ceilings[side](slab, "read", used[0], span))
                got = _latencies(st, names, data)
                rss.append(_rss())
        finally:
            for c in closers:
                c.close()
            shutil.rmtree(path, ignore_errors=True)
        for op in ("write", "read"):
            lat[op] += got[op]
    tier = "nvme" if ceiling == "fio" else "gds"
    extra: dict[str, Any] = {"direct": direct, "engine_described": described,
                             "peak_rss_mb": max(p for p, _ in rss),
                             "rss_mb": max(c for _, c in rss)}
    extra_write = {"write_unaligned_gbps": round(statistics.median(unaligned), 3),
                   "write_unaligned_runs": [round(x, 3) for x in unaligned],
                   **(_fresh(fresh_write, fresh_ceiling) if fresh_ceiling else {})}
    extra_read = {"read_fresh_gbps": round(statistics.median(fresh), 3),
                  "read_fresh_runs": [round(x, 3) for x in fresh]}
    if ceiling == "gdsio":
        extra["compares"] = "store into host memory vs gdsio into device memory"
    rows = []
    for op in ("write", "read"):
        medians = {name: statistics.median(v) for name, v in runs[op].items() if name != "store"}
        best = max(medians, key=lambda k: medians[k])
        rows.append(_row(
            tier, op, engine, block, threads, statistics.median(runs[op]["store"]), lat[op],
            medians[best], best, repeats=repeats, **extra,
            **(extra_write if op == "write" else extra_read),
            ceilings={k: round(v, 3) for k, v in medians.items()},
            store_runs=[round(x, 3) for x in runs[op]["store"]],
            ceiling_runs={k: [round(x, 3) for x in v] for k, v in runs[op].items()
                          if k != "store"}))
    return rows


def _fresh(store: list[float], ceilings: dict[str, list[float]]) -> dict[str, Any]:
    """The writes into never-written space (see :func:`measure_nvme`), reported beside the
    row: the store's median, each ceiling's, and the ratio to the best of them."""
    medians = {name: statistics.median(v) for name, v in ceilings.items()}
    best = max(medians, key=lambda k: medians[k])
    got = statistics.median(store)
    return {"write_fresh_gbps": round(got, 3), "write_fresh_runs": [round(x, 3) for x in store],
            "fresh_ceilings": {k: round(v, 3) for k, v in medians.items()},
            "fresh_ceiling_runs": {k: [round(x, 3) for x in v] for k, v in ceilings.items()},
            "fresh_ceiling": best, "fresh_ratio": round(got / medians[best], 3)}


def measure_entry_sizes(root: str, engine: str, threads: int, total: int, repeats: int = 3,
                        small: int = SMALL_ENTRY, large: int = LARGE_ENTRY) -> dict[str, Any]:
    """The store's bandwidth with ``small`` entries against ``large`` ones, in one store and
    one rotation: ``put_many`` and ``get_many(out=...)`` of ``total`` bytes as entries of
    each size, in turns whose order reverses every round, ``repeats`` rounds of two each.
    The main table's rows for two sizes are minutes apart, so their ratio carries the
    disk's drift between them; this one is measured side by side. Two untimed puts of
    each size come first, so every timed one rewrites space (see :func:`measure_nvme`)
    where ``total`` is at least ``large``; below that, a large put may reach past it."""
    path = os.path.join(root, f"{engine}-entry-sizes")
    sizes = (small, large)
    n = {b: max(1, total // b) for b in sizes}
    names = {b: [f"bench.sizes.{b}.{i}" for i in range(n[b])] for b in sizes}
    data = {b: _write_source(torch.randint(0, 255, (b,), dtype=torch.uint8)) for b in sizes}
    into = tierstore.read_buffer(min(max(n[b] * b for b in sizes), 256 << 20))
    runs: dict[str, dict[int, list[float]]] = {"write": {b: [] for b in sizes},
                                               "read": {b: [] for b in sizes}}
    described = engine
    try:
        with tierstore.open(path, create=True, engine=engine, io_threads=threads, host_cache=0,
                            slab_size=4 * max(n[b] * b for b in sizes) + (64 << 20),
                            chunk_size=CHUNK) as st:
            described = st.describe().split(": ", 1)[-1]
            paths: set[str] = set()
            for b in sizes:  # untimed: staging buffers and read destinations set up, and
                # two versions written, so every timed put rewrites space (see measure_nvme)
                _store_write(st, names[b], data[b])
                _store_write(st, names[b], data[b])
                if not engine_reads_direct(engine, st.describe()):
                    paths.add(st.info(names[b][0]).path)
                _store_read(st, names[b], b, paths, into)
            with _young_heap():
                for r in range(repeats):
                    order = list(sizes) if r % 2 == 0 else list(sizes)[::-1]
                    for b in order + order[::-1]:
                        runs["write"][b].append(_store_write(st, names[b], data[b]))
                        runs["read"][b].append(_store_read(st, names[b], b, paths, into))
    finally:
        shutil.rmtree(path, ignore_errors=True)
    out: dict[str, Any] = {"engine": engine, "engine_described": described, "threads": threads,
                           "small_bytes": small, "large_bytes": large, "repeats": repeats}
    for op in ("write", "read"):
        med = {b: statistics.median(v) for b, v in runs[op].items()}
        out[op] = {"small_gbps": round(med[small], 3), "large_gbps": round(med[large], 3),
                   "ratio": round(med[small] / med[large], 3),
                   "small_runs": [round(x, 3) for x in runs[op][small]],
                   "large_runs": [round(x, 3) for x in runs[op][large]]}
    return out


def run_tiers(
    store: str | None,
    sizes: list[int],
    threads: list[int],
    total: int,
    json_out: str | None,
    *,
    engines: tuple[str, ...] = ("auto", "posix-direct"),
    tiers: tuple[str, ...] = ("nvme", "pmem", "host", "gpu"),
    pmem_dir: str | None = None,
    plot_out: str | None = None,
    repeats: int = 3,
    echo: Callable[[str], object] = print,
    peer: str | None = None,
    paths: tuple[str, ...] = (),
    read_call: int = 256 << 20,
    write_call: int | None = None,
    kinds: list[str] | None = None,
) -> int:
    """Measure the chosen tiers at every entry size (and thread count, for the NVMe and
    PMem tiers); print a table, and write JSON and a plot if asked. The NVMe tier also
    reads into and writes from each kind of caller's memory beside DeepNVMe
    (:mod:`bench.tiers_kinds`), printed first, worst kind first; ``peer="deepnvme"``
    measures only that, and refuses to run without DeepNVMe. Those rows read ``read_call``
    bytes a call, and write ``write_call`` (all in one call where None), of the memory
    ``kinds`` named (:func:`bench.tiers_kinds.memory_kinds`; all but its
    ``EXTRA_KINDS`` where None)."""
    from .tiers_kinds import report_kinds, run_kinds, unavailable

    if peer == "deepnvme" and (why := unavailable()) is not None:
        raise tierstore.StoreError(why)
    if "nvme" in tiers and shutil.which("fio") is None:
        raise tierstore.StoreError("fio is not installed (apt-get install fio): it measures "
                                   "the ceiling every figure is compared with")
    from tqdm import tqdm

    from .tiers_memory import measure_gpu, measure_host, measure_pmem, plot

    root = store or tempfile.mkdtemp(prefix="tierstore-bench-", dir=os.getcwd())
    os.makedirs(root, exist_ok=True)
    rows: list[dict[str, Any]] = []
    kind_rows: list[dict[str, Any]] = []
    sizes_rows: list[dict[str, Any]] = []
    notes: list[str] = []
    gds = gds_unavailable() if "gpu" in tiers else None
    if gds is not None:
        notes.append(f"gds: not measured ({gds}); the GDS ceiling row runs gdsio where CUDA, "
                     "kvikio and gdsio are all present")
    elif "gpu" in tiers:
        notes.append("gds: the store (kvikio engine) reads into host memory, gdsio into device "
                     "memory: the ratio is the distance to GDS, not a like-for-like efficiency")
    try:
        plan: list[tuple[str, Any, int, int]] = []
        for block in sizes:
            for t in threads:
                plan += [("nvme", e, block, t) for e in engines if "nvme" in tiers]
                plan += [("pmem", "", block, t)] if "pmem" in tiers else []
            plan += [("host", "", block, 1)] if "host" in tiers else []
            if "gpu" in tiers and torch.cuda.is_available():
                plan.append(("gpu", "", block, 1))
            if "gpu" in tiers and gds is None:
                plan += [("gds", "kvikio", block, t) for t in threads]
        if "nvme" in tiers:
            plan += [("sizes", e, 0, max(threads)) for e in engines]
            from . import deepnvme

            why = deepnvme.unavailable()
            if why is not None:
                notes.append(f"DeepNVMe ceiling: not measured ({why})")
        if "nvme" in tiers or peer is not None:
            kind_rows = run_kinds(root, sizes, max(threads), total, repeats,
                                  engines=engines, paths=paths, read_call=read_call,
                                  write_call=write_call, kinds=kinds)
        if peer is not None:
            plan = []
        for tier, engine, block, t in tqdm(plan, desc="bench tiers", disable=None):
            if tier == "nvme":
                rows += measure_nvme(root, engine, block, t, total, repeats)
            elif tier == "pmem":
                rows += measure_pmem(root, pmem_dir or root, block, t, total, repeats)
            elif tier == "gds":
                rows += measure_nvme(root, engine, block, t, total, repeats, ceiling="gdsio")
            elif tier == "sizes":
                sizes_rows.append(measure_entry_sizes(root, engine, t, total, repeats))
            elif tier == "host":
                rows += measure_host(root, block, t, total)
            else:
                rows += measure_gpu(root, block)
    finally:
        if store is None:
            shutil.rmtree(root, ignore_errors=True)
    report_kinds(kind_rows, echo)
    if peer is not None:
        rows, notes = [], []
    if rows:
        echo(f"{'tier':5} {'op':5} {'engine':15} {'block':>9} {'thr':>3} {'GB/s':>7} "
             f"{'ceiling':>20} {'GB/s':>7} {'ratio':>6} {'p50 ms':>8} {'p99 ms':>8}")
    for r in rows:
        if r["tier"] == "nvme" and r["engine"] == "auto":  # say what auto picked
            r["engine"] = "auto=" + r["engine_described"].split(" ", 1)[0]
        echo(f"{_lead(r, r['op'])} {r['gbps']:7.3f} "
             f"{r['ceiling']:>20} {r['ceiling_gbps']:7.3f} {r['ratio']:6.2f} "
             f"{r['p50_ms']:8.2f} {r['p99_ms']:8.2f}")
    theirs = [r for r in rows if "torch_empty_gbps" in r]
    if theirs:
        echo("the same into, and from, a caller's torch.empty tensors (one per entry), "
             "against the rows above:")
    for r in theirs:
        echo(f"{_lead(r, r['op'])} {r['torch_empty_gbps']:7.3f} {r['torch_empty_ratio']:6.2f}")
    fresh = [r for r in rows if "write_fresh_gbps" in r]
    if fresh:
        echo("the writes above rewrite space written once before; the same writes into "
             "never-written (fallocated) space:")
    for r in fresh:
        echo(f"{_lead(r, 'fresh')} "
             f"{r['write_fresh_gbps']:7.3f} {r['fresh_ceiling']:>20} "
             f"{r['fresh_ceilings'][r['fresh_ceiling']]:7.3f} {r['fresh_ratio']:6.2f}")
    for z in sizes_rows:
        name = z["engine"] + ("=" + z["engine_described"].split(" ", 1)[0]
                              if z["engine"] == "auto" else "")
        small, large = (tierstore.format_size(z[k]) for k in ("small_bytes", "large_bytes"))
        echo(f"nvme  {name}: {small} entries against {large} ones, side by side: "
             + "; ".join(f"{op} {z[op]['ratio']:.2f} ({z[op]['small_gbps']:.3f} / "
                         f"{z[op]['large_gbps']:.3f} GB/s)" for op in ("read", "write")))
    for note in notes:
        echo(note)
    if json_out:
        with open(json_out, "w") as f:
            json.dump({"benchmark": "tiers", "results": rows, "memory_kinds": kind_rows,
                       "entry_sizes": sizes_rows, "notes": notes}, f, indent=1)
    if plot_out:
        plot(rows, plot_out)
    return 0
