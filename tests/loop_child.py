"""Child process of tests/test_hf_loop_resume.py: a user's own training loop over a store,
checkpointed with ``tierstore.hf.save_checkpoint`` and resumed with ``load_checkpoint``.

``python loop_child.py STORE LOG STEPS EVERY [KILL]``, or :func:`run` in a process of its own
(the test forks them from a server that has imported torch and transformers once).

Fine-tunes the imported model in STORE (fp32, attention dropout on) to STEPS steps, from its
latest checkpoint: two micro-batches a step whose rows are drawn with numpy's, Python's and
torch's global RNGs, a dense ``torch.optim.AdamW``, ``ExpertAdamW``, the global clip and a
``LambdaLR`` on each optimizer, a checkpoint every EVERY steps (the data position in
``extra``). Each step appends ``{"step", "loss", "norm"}`` to LOG as one JSON line.

KILL makes it SIGKILL itself:
- ``POINT@N``: at a named point of step N or of the checkpoint after step N (0: the first
  ``load_checkpoint``'s): ``backward`` (the step's gradients computed, nothing applied),
  ``dense`` (the dense optimizer stepped, the experts not), ``experts`` (both stepped, the
  schedules not), ``ckpt-dense`` (the dense weights written, the payload not),
  ``ckpt-flush`` (the snapshot's write-back done, its catalog transaction not),
  ``ckpt-commit`` (the snapshot committed, older ones not dropped), ``ckpt-drop`` (one
  older snapshot dropped, the rest not).
- ``random:SEED``: at an instant drawn from SEED, inside a step or a checkpoint.
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import threading
from typing import Any

import numpy as np
import tierstore.hf
import torch

SEED, LR, CLIP, BATCH, SEQ = 11, 3e-3, 0.5, 2, 8
KILL = [""]
where = {"ckpt": -1}  # the step whose checkpoint is being taken


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def point(name: str, step: int) -> None:
    if KILL[0] == f"{name}@{step}":
        die()


def arm_store(store: Any) -> None:
    """Kill points inside a checkpoint, around the store's own calls."""

    def wrap(attr: str, before: str | None, after: str | None) -> None:
        inner = getattr(store, attr)

        def call(*a: Any, **kw: Any) -> Any:
            if before and where["ckpt"] >= 0:
                point(before, where["ckpt"])
            out = inner(*a, **kw)
            if after and where["ckpt"] >= 0:
                point(after, where["ckpt"])
            return out

        setattr(store, attr, call)

    wrap("put", "ckpt-dense", None)        # the payload's put comes after the dense weights
    wrap("_flush", None, "ckpt-flush")     # snapshot(): write-back, then its transaction
    wrap("snapshot", None, "ckpt-commit")
    wrap("drop_snapshot", None, "ckpt-drop")


def random_killer(steps: int, every: int) -> tuple[int, bool, float]:
    """(step, in its checkpoint?, delay): where a ``random:SEED`` kill lands."""
    rng = random.Random(int(KILL[0].split(":", 1)[1]))
    in_ckpt = rng.random() < 0.5
    if in_ckpt:
        return rng.choice(range(0, steps + 1, every)), True, rng.uniform(0.0, 0.05)
    return rng.randint(1, steps), False, rng.uniform(0.0, 0.4)


def run(store_path: str, log: str, steps: int, every: int, kill: str = "",
        fetch: str = "direct") -> None:
    KILL[0] = kill
    torch.manual_seed(SEED)
    random.seed(SEED)
    np.random.seed(SEED)
    model = tierstore.hf.load(store_path, trainable=True, device="cpu", host_cache="64KiB",
                              fetch=fetch)
    arm_store(model.tierstore.store)
    timer_at = random_killer(steps, every) if kill.startswith("random:") else None

    def maybe_timer(step: int, in_ckpt: bool) -> None:
        if timer_at is not None and timer_at[:2] == (step, in_ckpt):
            threading.Timer(timer_at[2], die).start()

    dense = torch.optim.AdamW(model.parameters(), lr=LR)
    experts = tierstore.hf.ExpertAdamW(model, lr=LR)
    opts = [dense, experts]
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (1.0 + 0.5 * s)) for o in opts]
    vocab = model.config.vocab_size
    where["ckpt"] = 0
    maybe_timer(0, True)
    ck = tierstore.hf.load_checkpoint(model, optimizers=opts, schedulers=scheds)
    where["ckpt"] = -1
    seen = 0 if ck.extra is None else ck.extra["rows_seen"]
    with open(log, "a") as out:
        for step in range(ck.step + 1, steps + 1):
            maybe_timer(step, False)
            loss_sum = 0.0
            for _ in range(2):
                # rows from numpy, their lengths from Python, their tokens from torch
                rows = np.random.randint(0, 1000, size=BATCH)
                length = random.randint(SEQ // 2, SEQ)
                g = torch.Generator().manual_seed(int(rows.sum()))
                x = torch.randint(3, vocab, (BATCH, length), generator=g)
                x = torch.where(torch.rand(x.shape) < 0.1, torch.full_like(x, 3), x)
                loss = model(input_ids=x, labels=x).loss
                (loss / 2).backward()
                loss_sum += float(loss.detach()) / 2
                seen += BATCH
            point("backward", step)
            norm = tierstore.hf.clip_grad_norm_(model, CLIP)
            dense.step()
            point("dense", step)
            experts.step()
            point("experts", step)
            for s in scheds:
                s.step()
            dense.zero_grad()
            experts.zero_grad()
            out.write(json.dumps({"step": step, "loss": loss_sum, "norm": float(norm)}) + "\n")
            out.flush()
            if step % every == 0:
                where["ckpt"] = step
                maybe_timer(step, True)
                tierstore.hf.save_checkpoint(model, step, optimizers=opts, schedulers=scheds,
                                             extra={"rows_seen": seen})
                where["ckpt"] = -1
    model.tierstore.close()


if __name__ == "__main__":
    run(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), *sys.argv[5:])
