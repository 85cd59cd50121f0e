"""A rank of a distributed training run for tests/test_dist_train.py, started by torchrun.

``python tests/dist_child.py SPEC.json``: SPEC holds ``model`` (a preset name, a model
config dict, or null: the model ``import-hf`` put in the node stores), ``steps``, ``seed``,
``train`` (TrainConfig fields), ``corpus_bytes``,
``store`` (a path with ``{node}`` for this node's index), ``paradigm``, ``credits``,
``checkpoint_every``, ``resume``, ``node_stores``, ``metrics`` and ``out``, and optionally
``kill``:
``[phase, n, rank]``, at which that rank SIGKILLs itself: a checkpoint's ``snapshot`` or
``manifest`` of step n, a re-shard's n-th expert ``moved`` (written on its new node) or
``sent`` (deleted on its old one), (fine-tuning an import) step n's ``backward``, or (the
ranks unpacking a compact import, :func:`arm_unpack`) its n-th write of ``masters`` or the
moment the model has ``named`` them (n 1); and
``pause``: ``[phase, step, rank, folder]``, at which
that rank makes ``folder/paused`` and waits until ``folder/go`` exists (a run held live while
a test tries something).
Rank 0 writes its metrics and final dense state to ``out``. A refusal is one line on stderr
and exit status 2, as from the command line."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch
from tierstore.trainer.dist import train_distributed
from tierstore.trainer.presets import config_from_dict
from tierstore.trainer.train.data import load_corpus
from tierstore.trainer.train.resident import TrainConfig


def main() -> None:
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    node = int(os.environ.get("GROUP_RANK", "0"))
    rank = int(os.environ["RANK"])
    kill = spec.get("kill")

    pause = spec.get("pause")

    def on_phase(phase: str, step: int) -> None:
        if kill and phase == kill[0] and step == kill[1] and rank == kill[2]:
            os.kill(os.getpid(), signal.SIGKILL)
        if pause and [phase, step, rank] == pause[:3]:
            Path(pause[3], "paused").touch()
            deadline = time.monotonic() + 300
            while not Path(pause[3], "go").exists() and time.monotonic() < deadline:
                time.sleep(0.05)

    if kill and kill[0] in ("masters", "named"):
        arm_unpack(*kill, rank, spec["metrics"])
    model = spec["model"]
    if isinstance(model, dict):
        model = config_from_dict(model)
    history = train_distributed(
        model, spec["steps"], spec.get("seed", 0), TrainConfig(**spec["train"]),
        store_path=spec["store"].format(node=node), paradigm=spec.get("paradigm", "auto"),
        credits=spec.get("credits"), hierarchical=spec.get("hierarchical", False),
        checkpoint_every=spec.get("checkpoint_every", 0),
        resume=spec.get("resume", False), metrics_path=spec.get("metrics"),
        corpus=load_corpus(max_bytes=spec.get("corpus_bytes", 256 * 1024)),
        on_phase=on_phase, host_cache=spec.get("host_cache", 64 << 20),
        connect=spec.get("connect"), node_stores=spec.get("node_stores", ()),
        device=spec.get("device", "cpu"))
    if rank == 0 and spec.get("out"):
        torch.save({"history": history}, spec["out"])


def arm_unpack(phase: str, n: int, victim: int, rank: int, mark: str) -> None:
    """Rank ``victim`` SIGKILLs itself inside the ranks' unpack (tierstore.hf.quant_train,
    whose functions it calls by their module's names), having touched ``mark + ".killed"``:
    ``masters``, at its n-th ``put_many`` of masters, once the node leader (rank 0) waits
    at the first barrier (or, were the commit not to wait for every rank, has made it:
    ``mark + ".leader"``), so the kill lands while the leader could commit; ``named`` (the
    leader), at the packed entries' drop, right after the commit that names the masters."""
    from tierstore.hf import quant_train
    from tierstore.trainer.dist import world

    leader = Path(mark + ".leader")
    if phase == "masters" and rank == 0 and victim != 0:
        barrier, name_masters = world.barrier, quant_train.name_masters

        def waits(*a: Any, **kw: Any) -> None:
            leader.touch()
            barrier(*a, **kw)

        def named(*a: Any, **kw: Any) -> Any:
            out = name_masters(*a, **kw)
            leader.touch()
            return out

        world.barrier, quant_train.name_masters = waits, named  # (imported at the unpack)
    if rank != victim:
        return

    def die() -> None:
        Path(mark + ".killed").touch()
        os.kill(os.getpid(), signal.SIGKILL)

    if phase == "named":
        quant_train.drop_packed = lambda *a, **kw: die()
        return
    writes = [0]
    write_masters = quant_train.write_masters

    class Counted:
        def __init__(self, store: Any) -> None:
            self.store = store

        def __getattr__(self, name: str) -> Any:
            return getattr(self.store, name)

        def put_many(self, *a: Any, **kw: Any) -> Any:
            writes[0] += 1
            if writes[0] == n:
                deadline = time.monotonic() + 120
                while not leader.exists() and time.monotonic() < deadline:
                    time.sleep(0.01)
                die()
            return self.store.put_many(*a, **kw)

    quant_train.write_masters = lambda store, *a, **kw: write_masters(Counted(store), *a, **kw)


if __name__ == "__main__":
    from tierstore.cli_options import run_command

    run_command(main)  # errors as `tierstore train --distributed` reports them: one line
