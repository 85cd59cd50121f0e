"""The store as a user calls it, beside DeepNVMe as a user calls that (``bench tiers --peer
deepnvme``): reads into, and writes from, each kind of memory a caller hands the store.

The main table (:mod:`bench.tiers`) reads into slices of one :func:`tierstore.read_buffer`,
memory made for I/O. A user reads into tensors of their own: ``torch.empty`` (torch's
allocator places large tensors 64 bytes into a page, so O_DIRECT cannot fill them), a
``read_buffer`` per entry, slices of one buffer, a slice at an odd offset, pinned host
memory (page-aligned; on a machine without CUDA the store's own page-aligned arenas, the same
code path) and, where CUDA is present, a device tensor. Each is a row.

Setup, per entry size: one store (``host_cache=0``, the ``auto`` engine, ``io_threads``),
``total`` bytes of entries. Reads are ``get_many(names, out=...)`` 256 MiB per call
(``read_call`` bytes, where asked: a layer's experts are tens of MiB, and DeepNVMe then
reads as much per call), into destinations made and touched before the clock starts and
reused every round (as DeepNVMe reuses its page-locked buffer); writes are ``put_many``
from sources of each kind (one per entry, up to 256 MiB of them, reused) with its fsync and
commit, all ``total`` bytes in one call (or ``write_call`` bytes a call, each durable, and
DeepNVMe then fsyncs each call's write). Beside them, on the same
slab file: DeepNVMe's ``aio_handle`` (1 MiB blocks, queue depth 32, intra-op parallelism 2)
into its ``new_cpu_locked_tensor`` buffer, its writes ending with an fsync, and fio at queue
depth 32 (io_uring where it runs). Every side runs once a round, in an order rotated every
round and reversed every other, page cache dropped before each read; medians of the rounds.
Unlike the main table, nothing is set aside from Python's cycle collector
(``gc.freeze``): the process's own objects (torch's, DeepSpeed's) are in its reach, as in a
user's. The headline per size is the worst kind's ratio to DeepNVMe (of the medians), with
the median of each round's own ratio beside it: a disk that slows for everyone in the middle
of a round moves the first and not the second. Each row also has the CPU
time the process spent per GB moved (the store's, DeepNVMe's, medians of the same rounds):
on a machine whose cores are shared, what decides how far the bandwidth falls.
"""

from __future__ import annotations

import os
import resource
import shutil
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

import tierstore
from tierstore import landing
from tierstore.errors import StoreError

from .ceilings import nvme_ceilings
from .tiers import CHUNK, drop_page_cache

GROUP = 256 << 20  # bytes per get_many call, and of each kind's destinations (by default)
PEER = "DeepNVMe aio_handle"


def _pinned(nbytes: int) -> torch.Tensor:
    """Page-locked memory where CUDA is present; elsewhere what the store's code sees of
    it: page-aligned memory of exactly ``nbytes`` on 4 KiB pages (an anonymous mapping)."""
    if torch.cuda.is_available():
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    import mmap
    import warnings

    with warnings.catch_warnings():  # torch warns that the mapping's buffer is writable
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8)


def memory_kinds(block: int, count: int) -> dict[str, Callable[[], list[torch.Tensor]]]:
    """Each kind of caller's memory: makes ``count`` tensors of ``block`` bytes."""

    def sliced(skip: int) -> list[torch.Tensor]:
        buf = tierstore.read_buffer(count * block + skip)
        return [buf[skip + j * block : skip + (j + 1) * block] for j in range(count)]

    kinds: dict[str, Callable[[], list[torch.Tensor]]] = {
        "torch.empty": lambda: [torch.empty(block, dtype=torch.uint8) for _ in range(count)],
        "read_buffer each": lambda: [tierstore.read_buffer(block) for _ in range(count)],
        "slices of one": lambda: sliced(0),
        "slices at +100": lambda: sliced(100),
        "pinned": lambda: [_pinned(block) for _ in range(count)],
        # Not a default kind: aligned as O_DIRECT needs on a virtio disk, not to a page.
        "slices at +512": lambda: sliced(512),
    }
    if torch.cuda.is_available():
        kinds["cuda"] = lambda: [torch.empty(block, dtype=torch.uint8, device="cuda")
                                 for _ in range(count)]
    return kinds


# Kinds a run measures only when named (``bench tiers --kinds``).
EXTRA_KINDS = ("slices at +512",)


def unavailable() -> str | None:
    """What ``--peer deepnvme`` needs and does not have here, in one line, or None."""
    from . import deepnvme

    why = deepnvme.unavailable()
    if why is None:
        return None
    return (f"DeepNVMe cannot run here: {why}. It needs deepspeed (pip install '.[peers]') "
            "and libaio-dev (apt-get install libaio-dev) to build its op")


def measure_kinds(root: str, block: int, threads: int, total: int, repeats: int,
                  kinds: list[str] | None = None, engine: str = "auto",
                  paths: tuple[str, ...] = (), read_call: int = GROUP,
                  write_call: int | None = None) -> list[dict[str, Any]]:
    """Rows of GB/s per (op, kind) for entries of ``block`` bytes through the store's
    ``engine``, each with DeepNVMe's and fio's medians from the same rounds (see the module
    docstring). With ``paths`` ("batch", "workers"), each kind is a side once per path,
    named ``kind [path]``, every batch sent that way (:data:`tierstore.landing.ROUTE`)
    instead of by the store's rule. Reads ask for ``read_call`` bytes of entries at a time,
    writes put ``write_call`` (all of them where None)."""
    n = max(1, total // block)
    span = n * block
    count = max(1, min(n, read_call // block))
    per_put = n if write_call is None else max(1, min(n, write_call // block))
    made = memory_kinds(block, count)
    kinds = [k for k in (kinds or [k for k in made if k not in EXTRA_KINDS]) if k in made]
    route = {f"{k} [{p}]": (k, p) for k in kinds for p in paths} or {k: (k, None) for k in kinds}
    data = torch.randint(0, 255, (block,), dtype=torch.uint8)
    mem: dict[str, list[torch.Tensor]] = {}
    for k in kinds:  # touched before any clock starts, as a user's tensors are
        mem[k] = made[k]()
        for t in mem[k]:
            t.copy_(data)
    names = [f"bench.kinds.{j}" for j in range(n)]
    path = os.path.join(root, f"kinds-{engine}-{block}")
    bs = min(block, CHUNK)
    ceilings, closers = nvme_ceilings(
        "fio", bs, threads, True, span, read_call=count * block,
        write_call=None if write_call is None else per_put * block)
    peers = {name: fn for name, fn in ceilings.items() if name != "fio psync"}
    runs: dict[str, dict[str, list[float]]] = {"read": {}, "write": {}}
    # CPU seconds per GB moved, of this process (the store, DeepNVMe's threads; fio runs in
    # a process of its own and is not counted): what a loaded machine's cores must supply.
    cpu: dict[str, dict[str, list[float]]] = {"read": {}, "write": {}}
    region = -(-span // bs) * bs
    segments = next((round(c.segments, 1) for c in closers
                     if getattr(c, "segments", None) is not None), None)
    try:
        with tierstore.open(path, create=True, engine=engine, host_cache=0, io_threads=threads,
                            chunk_size=CHUNK, slab_size=(3 + len(peers)) * region + (64 << 20)
                            ) as st:
            # Untimed: set up, and both regions a put alternates between (copy-on-write)
            # written once, as the peers' are below. A slab is fallocated, its extents
            # unwritten until first written, and the first timed put into the second
            # region ran at 0.4-0.5 of the rest (2.2 against 4.3-4.9 GB/s at 256 KiB).
            for _ in range(2):
                st.put_many([(name, data) for name in names])
            slab = st.info(names[0]).path
            at = {name: (3 + j) * region for j, name in enumerate(peers)}
            for name in peers:  # their regions written once, as the store's are
                peers[name](slab, "write", at[name], span)

            def write(side: str) -> float:
                kind, landing.ROUTE = route[side]
                srcs = mem[kind]
                items = [(name, srcs[j % count]) for j, name in enumerate(names)]
                try:
                    t0 = time.perf_counter()
                    for i in range(0, n, per_put):
                        st.put_many(items[i : i + per_put])
                    return span / (time.perf_counter() - t0) / 1e9
                finally:
                    landing.ROUTE = None

            def read(side: str) -> float:
                kind, landing.ROUTE = route[side]
                outs = mem[kind]
                groups = [names[i : i + count] for i in range(0, n, count)]
                maps = [dict(zip(g, outs)) for g in groups]
                drop_page_cache({slab})
                try:
                    t0 = time.perf_counter()
                    for g, m in zip(groups, maps):
                        st.get_many(g, out=m)
                    if outs[0].device.type == "cuda":
                        torch.cuda.synchronize()
                    return span / (time.perf_counter() - t0) / 1e9
                finally:
                    landing.ROUTE = None

            read(next(iter(route)))  # untimed: the store's bounce buffers set up
            for r in range(repeats):
                for op in ("write", "read"):
                    infos = [st.info(name) for name in names] if op == "read" else []
                    used = min((i.offset for i in infos), default=0) // bs * bs
                    sides = [*route, *peers]
                    sides = sides[r % len(sides):] + sides[: r % len(sides)]
                    for side in sides if r % 2 == 0 else sides[::-1]:
                        used_cpu = _cpu_seconds()
                        if side in peers:
                            if op == "read":
                                drop_page_cache({slab})
                            got = peers[side](slab, op, at[side] if op == "write" else used,
                                              span)
                        else:
                            got = (write if op == "write" else read)(side)
                        runs[op].setdefault(side, []).append(got)
                        cpu[op].setdefault(side, []).append(
                            (_cpu_seconds() - used_cpu) / (span / 1e9))
            for k in kinds:  # the bytes are right in every kind
                if not torch.equal(mem[k][0].cpu(), data):
                    raise RuntimeError(f"bench tiers: the read into {k} gave wrong bytes")
            described = st.describe().split(": ", 1)[-1]
    finally:
        for c in closers:
            c.close()
        shutil.rmtree(path, ignore_errors=True)
    rows = []
    for op in ("read", "write"):
        med = {side: statistics.median(v) for side, v in runs[op].items()}
        ref = PEER if PEER in med else next(s for s in med if s.startswith("fio"))
        for k in route:
            rows.append({
                "op": op, "kind": k, "path": route[k][1] or "auto", "engine": engine,
                "block_bytes": block, "threads": threads, "read_call_bytes": count * block,
                "write_call_bytes": per_put * block,
                "total_bytes": span, "repeats": repeats, "engine_described": described,
                "gbps": round(med[k], 3), "reference": ref,
                "reference_gbps": round(med[ref], 3), "ratio": round(med[k] / med[ref], 3),
                # Each round's own ratio (the sides ran next to each other), their median: a
                # disk whose rate shifts between or within rounds moves it less.
                "paired_ratio": round(statistics.median(
                    a / b for a, b in zip(runs[op][k], runs[op][ref])), 3),
                "peers": {s: round(med[s], 3) for s in peers},
                "runs": [round(x, 3) for x in runs[op][k]],
                "peer_runs": {s: [round(x, 3) for x in runs[op][s]] for s in peers},
                "cpu_s_per_gb": round(statistics.median(cpu[op][k]), 3),
                "peer_cpu_s_per_gb": {s: round(statistics.median(cpu[op][s]), 3)
                                      for s in peers if not s.startswith("fio")},
                # Segments per 1 MiB block of DeepNVMe's buffer (see bench.deepnvme): what
                # its rate in this process owes to where its pages happened to land.
                "peer_segments_per_mib": segments,
            })
    return rows


def _cpu_seconds() -> float:
    """User and system CPU time of this process so far, every thread's."""
    u = resource.getrusage(resource.RUSAGE_SELF)
    return u.ru_utime + u.ru_stime


def report_kinds(rows: list[dict[str, Any]], echo: Callable[[str], object]) -> None:
    """The worst kind per size and op first (the headline), then every row."""
    if not rows:
        return
    echo("caller's memory against DeepNVMe (store GB/s / peer GB/s; worst kind first):")
    keys = sorted({(r["op"], r["block_bytes"], r["engine"]) for r in rows})
    w = max(16, *(len(r["kind"]) for r in rows))  # "slices at +100 [workers]" with --paths
    for op, block, engine in keys:
        mine = [r for r in rows
                if r["op"] == op and r["block_bytes"] == block and r["engine"] == engine]
        worst = min(mine, key=lambda r: r["ratio"])
        call = worst[f"{op}_call_bytes"]
        calls = (f" in calls of {tierstore.format_size(call)}"
                 if call < worst["total_bytes"] else "")
        echo(f"{op:5} {tierstore.format_size(block):>9} {_engine(worst):16} worst: "
             f"{worst['kind']:{w}} "
             f"{worst['ratio']:5.2f}x {worst['reference']} ({worst['gbps']:.3f} / "
             f"{worst['reference_gbps']:.3f} GB/s, {worst['repeats']} rounds, "
             f"{tierstore.format_size(worst['total_bytes'])}{calls}; each round's own "
             f"ratio {worst['paired_ratio']:.2f}{_segments(worst)})")
    echo(f"{'op':5} {'block':>9} {'engine':16} {'memory':{w}} {'GB/s':>7} {'ratio':>6} "
         f"{'CPU s/GB':>8}  peers (GB/s; CPU s/GB)")
    for r in sorted(rows, key=lambda r: (r["op"], r["block_bytes"], r["engine"], r["ratio"])):
        peers = ", ".join(
            f"{k} {v:.3f}" + (f"; {r['peer_cpu_s_per_gb'][k]:.2f}"
                              if k in r["peer_cpu_s_per_gb"] else "")
            for k, v in r["peers"].items())
        echo(f"{r['op']:5} {tierstore.format_size(r['block_bytes']):>9} {_engine(r):16} "
             f"{r['kind']:{w}} "
             f"{r['gbps']:7.3f} {r['ratio']:6.2f} {r['cpu_s_per_gb']:8.2f}  {peers}")


def _segments(row: dict[str, Any]) -> str:
    seg = row.get("peer_segments_per_mib")
    return "" if seg is None else f"; {PEER}'s buffer {seg:.0f} segments per MiB"


def _engine(row: dict[str, Any]) -> str:
    """The row's engine as ``bench tiers`` names it, with what ``auto`` picked."""
    picked = row["engine_described"].split(" ", 1)[0]
    return f"auto={picked}" if row["engine"] == "auto" else row["engine"]


def run_kinds(root: str, sizes: list[int], threads: int, total: int, repeats: int,
              progress: bool = True, engines: tuple[str, ...] = ("auto",),
              paths: tuple[str, ...] = (), read_call: int = GROUP,
              write_call: int | None = None,
              kinds: list[str] | None = None) -> list[dict[str, Any]]:
    """:func:`measure_kinds` at every size, through each of ``engines`` (and ``paths``),
    of ``kinds`` (all but :data:`EXTRA_KINDS` where None); a kind this machine does not
    have is refused before anything runs."""
    from tqdm import tqdm

    known = list(memory_kinds(1, 1))
    missing = [k for k in kinds or () if k not in known]
    if missing:
        raise StoreError(f"no kind of memory {missing[0]!r} here; the kinds: "
                         f"{', '.join(known)}")

    rows: list[dict[str, Any]] = []
    plan = [(block, e) for block in sizes for e in engines]
    for block, engine in tqdm(plan, desc="bench tiers: caller's memory",
                              disable=None if progress else True):
        rows += measure_kinds(root, block, threads, total, repeats, kinds=kinds,
                              engine=engine, paths=paths, read_call=read_call,
                              write_call=write_call)
    return rows
