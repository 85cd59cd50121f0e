"""The host-cache policy inside the store trainer, where the lab's traces are only routing.

The cache lab replays routing traces: one access per routed expert per step. The store
trainer's host cache sees more than that: each step reads the routed experts' weights in the
forward pass, then reads their weights and AdamW moments again, and writes all three, in the
update. This trains the same model from the same seed over fresh stores, once per host-cache
size and ``lfu-decay`` setting, and reports the cache's hit rate and the bytes read from the
backing tier. Every run computes the same losses (the cache never changes a number).

    python -m tierstore.bench.train_cache --host-cache 48MiB,96MiB,192MiB --turn 0,1.1
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from dataclasses import replace
from typing import Any

from tierstore.trainer import TrainConfig, train_store

import tierstore


def run(host_caches: list[str], turns: list[float], *, model: str = "medium", steps: int = 25,
        batch_size: int = 1, seq_len: int = 16, echo: Any = print) -> list[dict[str, Any]]:
    """One row per (host cache, turn): hit rate, bytes read, the last loss."""
    tc = replace(TrainConfig(), batch_size=batch_size, seq_len=seq_len, eval_every=0)
    rows = []
    for cache in host_caches:
        for turn in turns:
            tmp = tempfile.mkdtemp(prefix="tierstore-train-cache-", dir=".")
            try:
                with tierstore.open(f"{tmp}/store", create=True, host_cache=cache,
                                    policy_args={"turn": turn}) as st:
                    hist = train_store(model, steps, 0, tc, store_path=None, host_cache=None,
                                       store=st)
                    stats = st.stats()
                    row = {"host_cache": cache, "turn": turn,
                           "hit_rate": stats["cache"]["hit_rate"],
                           "bytes_read": stats["tiers"][st.backing]["bytes_read"],
                           "loss": hist[-1]["loss"]}
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
            rows.append(row)
            echo(f"host cache {cache:>8}  turn {turn:<4}  hit rate {row['hit_rate']:.3f}  "
                 f"read {row['bytes_read'] / 2**20:8.0f} MiB  loss {row['loss']:.4f}")
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--host-cache", default="48MiB,96MiB,192MiB",
                    help="comma-separated host cache sizes")
    ap.add_argument("--turn", default="0,1.1", help="comma-separated lfu-decay turn values")
    ap.add_argument("--model", default="medium")
    ap.add_argument("--steps", type=int, default=25)
    ap.add_argument("--json", help="write the rows here")
    a = ap.parse_args(argv)
    rows = run(a.host_cache.split(","), [float(t) for t in a.turn.split(",")],
               model=a.model, steps=a.steps)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"model": a.model, "steps": a.steps, "rows": rows}, f, indent=2)
            f.write("\n")


if __name__ == "__main__":
    main()
