"""Where a ``get_many(names, out=outs)`` spends its time, per kind of caller's memory.

``python -m tierstore.bench.profile_reads [TOTAL_MiB] [SIZES_KiB] [ROUNDS]``: one store
(``host_cache=0``, the ``auto`` engine, 8 I/O threads, 8 MiB chunks) holding TOTAL of
entries of each size; each kind of memory (:func:`bench.tiers_kinds.memory_kinds`) is read
into in turn, alternated, page cache dropped first, then profiled once with ``cProfile``
(the AIO engine submits and reaps the whole batch on the calling thread; the crc32c and
bounce copies of landed requests run on the chunk workers, which the profile does not see,
except where the calling thread waits for them). Prints GB/s (median) and the calling
thread's shares: waiting for the disk (the engine's loop and its system calls), waiting
for the chunk workers' checks, crc32c and copies (bounce buffers or a copy after the
reads) taken on the calling thread, the rest.
"""

from __future__ import annotations

import cProfile
import os
import pstats
import shutil
import statistics
import sys
import tempfile
import time

import torch

import tierstore

from .tiers import drop_page_cache
from .tiers_kinds import memory_kinds

# (file, function) of the profile's entries in each share. The engine's system calls are
# made in libaio.py's _call (ctypes calls do not show as entries of their own); a bounce's
# copy is copy_checked's own time (its crc32c calls are the crc32c share). The calling
# thread waits on a lock only for the chunk workers' checks (the engine's batch holds none).
BUCKETS = {"disk": [("libaio.py", "_call"), ("aio.py", "_run")],
           "checks behind": [("~", "acquire")],
           "crc32c": [("~", "crc32c")],
           "bounce copy": [("landing.py", "copy_checked"), ("landing.py", "land")],
           "copy after": [("reads.py", "_deliver"), ("~", "copyto")]}


def _shares(prof: cProfile.Profile) -> dict[str, float]:
    stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]
    total = sum(v[2] for v in stats.values())
    out = dict.fromkeys(BUCKETS, 0.0)
    for (path, _, fn), v in stats.items():
        for bucket, where in BUCKETS.items():
            if any(path.endswith(f) and name in fn for f, name in where):
                out[bucket] += v[2]
                break
    out["other"] = total - sum(out.values())
    return {k: round(v / total, 2) for k, v in out.items()}


def main(total: int, sizes: list[int], rounds: int) -> None:
    root = tempfile.mkdtemp(prefix="tierstore-profile-", dir=os.getcwd())
    try:
        with tierstore.open(os.path.join(root, "st"), create=True, host_cache=0,
                            io_threads=8, chunk_size=8 << 20) as st:
            print(st.describe())
            for size in sizes:
                n = max(1, total // size)
                names = [f"p.{size}.{j}" for j in range(n)]
                data = torch.randint(0, 255, (size,), dtype=torch.uint8)
                st.put_many([(name, data) for name in names])
                slab = {st.info(names[0]).path}
                kinds = {k: dict(zip(names, make())) for k, make in memory_kinds(size, n).items()}
                for outs in kinds.values():
                    for t in outs.values():
                        t.zero_()  # touched, as a user's tensors are
                got: dict[str, list[float]] = {k: [] for k in kinds}
                for r in range(rounds):
                    for k in list(kinds) if r % 2 == 0 else list(kinds)[::-1]:
                        drop_page_cache(slab)
                        t0 = time.perf_counter()
                        st.get_many(names, out=kinds[k])
                        got[k].append(n * size / (time.perf_counter() - t0) / 1e9)
                for k, outs in kinds.items():
                    drop_page_cache(slab)
                    prof = cProfile.Profile()
                    prof.enable()
                    st.get_many(names, out=outs)
                    prof.disable()
                    assert torch.equal(outs[names[-1]].cpu(), data), k
                    print(f"{tierstore.format_size(size):>9} {k:16} "
                          f"{statistics.median(got[k]):6.3f} GB/s  {_shares(prof)}")
                for name in names:
                    st.delete(name)
                del kinds
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    args = sys.argv[1:]
    main(int(args[0]) << 20 if args else 256 << 20,
         [int(s) << 10 for s in args[1].split(",")] if len(args) > 1 else [1 << 20, 16 << 20],
         int(args[2]) if len(args) > 2 else 3)
