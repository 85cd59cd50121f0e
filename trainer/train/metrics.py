"""The store trainer's per-step figures from the store and the process, and the JSON-lines
metrics file a resumed run continues."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import tierstore

from .heap import SteadyHeap
from .resident import Metrics

PathLike = str | os.PathLike[str]


class MetricsLog:
    """One JSON object per line. A resumed run keeps the lines of the steps its checkpoint
    covers and drops the rest (the steps it is about to run again). ``last`` is the
    checkpoint step's own line, kept in the checkpoint: a crash between the snapshot and
    writing that line would otherwise leave a gap."""

    def __init__(self, path: PathLike, keep_through: int, last: Metrics | None = None) -> None:
        kept: dict[int, str] = {}
        p = Path(path)
        if keep_through > 0 and p.exists():
            for line in p.read_text().splitlines():
                try:
                    step = int(json.loads(line)["step"])
                except (ValueError, KeyError, TypeError):
                    continue  # a line torn by a crash
                if step <= keep_through:
                    kept[step] = line
        if last is not None and last["step"] <= keep_through:
            kept.setdefault(last["step"], json.dumps(last))
        self._f = open(p, "w", encoding="utf-8")  # noqa: SIM115  (closed in close())
        for _, line in sorted(kept.items()):
            self._f.write(line + "\n")
        self._f.flush()

    def write(self, m: Metrics) -> None:
        self._f.write(json.dumps(m) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()


def run_steps(steps: range, step: Callable[[int], Metrics], log: MetricsLog | None,
              on_step: Callable[[Metrics], None] | None) -> list[Metrics]:
    """Run ``step`` for each of ``steps``: each step's metrics go to ``log`` (closed at the
    end, whatever happens, so a crash leaves the lines of the steps that ran) and to
    ``on_step``; returns them all. The run's long-lived objects are set aside from the
    cycle collector after the first step (see :mod:`.heap`)."""
    history: list[Metrics] = []
    try:
        with SteadyHeap() as heap:
            for s in steps:
                m = step(s)
                heap.step_done()
                history.append(m)
                if log is not None:
                    log.write(m)
                if on_step is not None:
                    on_step(m)
    finally:
        if log is not None:
            log.close()
    return history


def peak_rss() -> int:
    """The process's peak resident set so far, in bytes (see
    :func:`trainer.infer.budget.peak_rss_bytes`)."""
    from ..infer.budget import peak_rss_bytes

    return peak_rss_bytes()


def store_counters(store: tierstore.Store) -> dict[str, int]:
    """The store's cumulative cache and backing-tier counters, for :func:`store_metrics`."""
    s = store.stats()
    cache = s["cache"] or {}
    tiers = s["tiers"].values()
    return {"hits": cache.get("hits", 0), "misses": cache.get("misses", 0),
            "evictions": cache.get("evictions", 0),
            "bytes_read": sum(t["bytes_read"] for t in tiers),
            "bytes_written": sum(t["bytes_written"] for t in tiers)}


def store_metrics(before: dict[str, int], after: dict[str, int]) -> Metrics:
    """A step's host-cache and backing-tier figures from the counters around it."""
    d = {k: after[k] - before[k] for k in after}
    accesses = d["hits"] + d["misses"]
    return {"hit_rate": d["hits"] / accesses if accesses else None,
            "cache_hits": d["hits"], "cache_misses": d["misses"], "evictions": d["evictions"],
            "bytes_read": d["bytes_read"], "bytes_written": d["bytes_written"]}
