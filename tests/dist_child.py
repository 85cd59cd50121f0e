"""A rank of a distributed training run for tests/test_dist_train.py, started by torchrun.

``python tests/dist_child.py SPEC.json``: SPEC holds ``model`` (a preset name, a model
config dict, or null: the model ``import-hf`` put in the node stores), ``steps``, ``seed``,
``train`` (TrainConfig fields), ``corpus_bytes``,
``store`` (a path with ``{node}`` for this node's index), ``paradigm``, ``credits``,
``checkpoint_every``, ``resume``, ``node_stores``, ``metrics`` and ``out``, and optionally
``kill``:
``[phase, n, rank]``, at which that rank SIGKILLs itself: a checkpoint's ``snapshot`` or
``manifest`` of step n, a re-shard's n-th expert ``moved`` (written on its new node) or
``sent`` (deleted on its old one), or (fine-tuning an import) step n's ``backward``; and ``pause``: ``[phase, step, rank, folder]``, at which
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


if __name__ == "__main__":
    from tierstore.cli_options import run_command

    run_command(main)  # errors as `tierstore train --distributed` reports them: one line
