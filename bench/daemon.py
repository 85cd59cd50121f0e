"""``tierstore bench daemon``: get throughput through the sidecar daemon against in-process.

The store holds ``entries`` entries of ``entry_bytes`` (expert-sized tensors) and a host
cache that holds them all, so both sides measure the data path of a cache hit, not the
disk. In-process: N threads share one ``tierstore.open`` store, each doing ``gets`` random
``get`` calls (a copy out of the cache slot into a new tensor). Through the daemon: N client
processes, each with ``tierstore.connect``, doing the same gets (a copy out of the shared
mapping into a new tensor; after each entry's first get, without a round trip, through the
daemon's published index), and, separately, the same number of zero-copy ``view`` calls
(which always take the socket: they measure the control path alone, nothing is copied). Both sides are warmed first and
start together at an agreed instant; throughput is the bytes delivered over the time from
that instant to the last client's finish. In-process and daemon runs alternate ``repeat``
times and medians are reported; the ratio is daemon / in-process at the same N.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

import tierstore

from .report import write_json

START_DELAY_S = 0.3


def _names(entries: int) -> list[str]:
    return [f"bench.layers.0.experts.{i}.w1" for i in range(entries)]


def _schedule(entries: int, gets: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, entries, gets).tolist()


def _wait_until(t0: float) -> None:
    while (left := t0 - time.monotonic()) > 0:
        time.sleep(min(left, 0.01))


def _inprocess(path: str, cache: int, entries: int, gets: int, counts: list[int]
               ) -> dict[int, float]:
    """GB/s of N threads doing gets on one in-process store, for each N."""
    names = _names(entries)
    out = {}
    with tierstore.open(path, host_cache=cache) as st:
        for name in names:  # warm: every entry in the cache
            st.get(name)
        for n in counts:
            t0 = time.monotonic() + START_DELAY_S
            ends = [0.0] * n

            def work(i: int, t0: float = t0, ends: list[float] = ends) -> None:
                order = _schedule(entries, gets, i)
                _wait_until(t0)
                for j in order:
                    st.get(names[j])
                ends[i] = time.monotonic()

            threads = [threading.Thread(target=work, args=(i,)) for i in range(n)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            out[n] = n * gets * st.info(names[0]).nbytes / (max(ends) - t0) / 1e9
    return out


def _client(sock: str, entries: int, gets: int, index: int, jobs: Any, results: Any) -> None:
    """A daemon client process: waits for (mode, start time) jobs and reports its finish."""
    names = _names(entries)
    with tierstore.connect(sock) as st:
        for name in names:  # warm: fault in this process's mapping of every slot
            st.get(name)
        results.put(("ready", index, 0.0))
        while (job := jobs.get()) is not None:
            mode, t0 = job
            order = _schedule(entries, gets, index)
            _wait_until(t0)
            if mode == "get":
                for j in order:
                    st.get(names[j])
            else:
                for j in order:
                    v = st.view(names[j])
                    del v
            results.put((mode, index, time.monotonic()))


def _daemon(path: str, cache: int, entries: int, gets: int, counts: list[int],
            scratch: str) -> dict[str, dict[int, float]]:
    """GB/s of N client processes through a daemon (get), and views per second."""
    sock = os.path.join(scratch, "bench.sock")
    proc = subprocess.Popen([sys.executable, "-m", "tierstore.cli", "serve", "--store", path,
                             "--socket", sock, "--host-cache", str(cache)],
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not os.path.exists(sock):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise tierstore.StoreError(f"the daemon did not start: {proc.stderr.read()}")
            time.sleep(0.05)
        ctx = mp.get_context("spawn")
        results = ctx.Queue()
        workers = []
        for i in range(max(counts)):
            jobs = ctx.Queue()
            p = ctx.Process(target=_client, args=(sock, entries, gets, i, jobs, results))
            p.start()
            workers.append((p, jobs))
        for _ in workers:
            results.get(timeout=300)
        nbytes = None
        with tierstore.connect(sock) as st:
            nbytes = st.info(_names(entries)[0]).nbytes
        out: dict[str, dict[int, float]] = {"get": {}, "view": {}}
        for mode in ("get", "view"):
            for n in counts:
                t0 = time.monotonic() + START_DELAY_S
                for _, jobs in workers[:n]:
                    jobs.put((mode, t0))
                ends = [results.get(timeout=600)[2] for _ in range(n)]
                rate = n * gets / (max(ends) - t0)
                out[mode][n] = rate * nbytes / 1e9 if mode == "get" else rate
        for _, jobs in workers:
            jobs.put(None)
        for p, _ in workers:
            p.join(timeout=60)
    finally:
        proc.terminate()
        proc.wait(timeout=120)
    return out


def run_daemon_bench(store: str | None, *, entry_bytes: int, entries: int, clients: list[int],
                     gets: int, repeat: int, json_out: str | None,
                     echo: Callable[[str], Any] = print) -> dict[str, Any]:
    """Measure and print the table; write JSON to ``json_out`` if given."""
    if entry_bytes < 4096 or entry_bytes % 4:
        raise tierstore.StoreError("--entry-bytes must be a multiple of 4 of at least 4KiB")
    scratch = tempfile.mkdtemp(prefix="bench-daemon-", dir=store or ".")
    path = os.path.join(scratch, "store")
    cache = 1 << max(entries * entry_bytes * 2 - 1, 1).bit_length()  # all entries fit
    try:
        with tierstore.open(path, create=True, host_cache=0,
                            slab_size=max(entries * entry_bytes, 64 << 20)) as st:
            gen = torch.Generator().manual_seed(0)
            for name in _names(entries):
                st.put(name, torch.rand(entry_bytes // 4, generator=gen))
        rounds: list[dict[str, Any]] = []
        for r in range(repeat):
            echo(f"round {r + 1}/{repeat}: in-process")
            local = _inprocess(path, cache, entries, gets, clients)
            echo(f"round {r + 1}/{repeat}: daemon")
            remote = _daemon(path, cache, entries, gets, clients, scratch)
            rounds.append({"inprocess": local, **remote})
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    rows = []
    for n in clients:
        local = statistics.median(rd["inprocess"][n] for rd in rounds)
        remote = statistics.median(rd["get"][n] for rd in rounds)
        views = statistics.median(rd["view"][n] for rd in rounds)
        rows.append({"clients": n, "inprocess_gbps": local, "daemon_gbps": remote,
                     "ratio": remote / local, "daemon_view_per_s": views,
                     "rounds": [{k: rd[k][n] for k in ("inprocess", "get", "view")}
                                for rd in rounds]})
    result = {"entry_bytes": entry_bytes, "entries": entries, "gets_per_client": gets,
              "repeat": repeat, "cpus": os.cpu_count(), "host_cache_bytes": cache,
              "rows": rows}
    echo("| clients | in-process GB/s | daemon GB/s | ratio | daemon views/s (no copy) |")
    echo("|---|---|---|---|---|")
    for row in rows:
        echo(f"| {row['clients']} | {row['inprocess_gbps']:.2f} | {row['daemon_gbps']:.2f} | "
             f"{row['ratio']:.2f} | {row['daemon_view_per_s']:,.0f} |")
    write_json(json_out, result)
    return result
