"""A rank of a user's own fine-tuning loop under torchrun, over ``tierstore.hf.load(store,
trainable=True, process_group=True)``: what tests/test_dist_finetune_hf.py runs.

``python tests/dist_hf_loop.py SPEC.json``: SPEC holds ``store`` (a path with ``{node}``),
``steps``, ``seed``, ``train`` (TrainConfig fields; ``batch_size`` per rank),
``corpus_bytes`` and ``out``. Every rank draws the global batch and trains its slice; rank 0
writes the per-step losses and the exchanges' figures to ``out``. Before training, every rank
probes the pipelining of the token-centric blocks (:func:`probe_pipeline`); training then
runs with SPEC's ``paradigm`` and ``pipeline``, as ``load`` takes them."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import replace
from typing import Any

import tierstore.hf
import torch
import torch.distributed as dist
from tierstore.hf.tokenizer import load_tokenizer
from tierstore.trainer.train.data import load_corpus
from tierstore.trainer.train.hf_finetune import hf_losses, model_corpus
from tierstore.trainer.train.resident import TrainConfig, param_groups, training_batches


def probe_pipeline(model: Any, experts: Any, x: torch.Tensor, y: torch.Tensor, rank: int,
                   b: int) -> dict[str, Any]:
    """This rank's slice of one batch through the token-centric blocks in 1, 2 and 4
    chunks and with ``auto`` (its first pass measures each block unchunked, its second
    runs the choice), forward and backward, nothing stepped: for each setting whether the
    loss, logits, dense and owned experts' gradients equal one chunk's bit for bit, and
    its pipeline counters (every rank's gradients compared, the verdict all of theirs);
    and what auto chose. The loop's own setting is restored after."""
    x, y = x[rank * b:(rank + 1) * b], y[rank * b:(rank + 1) * b]
    parallel = model.tierstore.parallel
    kept = parallel.pipeline

    def run(pipeline: int | str) -> tuple[list[torch.Tensor], dict[str, Any]]:
        parallel.pipeline = pipeline
        parallel.begin()
        out = model(input_ids=x, labels=y, shift_labels=y, use_cache=False)
        out.loss.backward()
        got = [out.loss.detach(), out.logits.detach()]
        got += [p.grad.clone() for p in model.parameters() if p.grad is not None]
        got += [g.clone() for g in model.tierstore.experts.grads()]
        model.zero_grad(set_to_none=True)
        experts.zero_grad()
        return got, parallel.step_figures()

    base, figures = run(1)
    report: dict[str, Any] = {"1": {"same": True, **figures}}
    for i, setting in enumerate((2, 4, "auto", "auto")):
        got, figures = run(setting)
        same = len(got) == len(base) and all(torch.equal(a, c) for a, c in zip(base, got))
        every = torch.tensor([int(same)])
        dist.all_reduce(every, op=dist.ReduceOp.MIN)
        same = bool(every.item())
        report[f"{setting}" if i < 2 else f"auto{i - 1}"] = {"same": same, **figures}
    report["chosen"] = {str(k): v for k, v in parallel.chunks.items()}
    parallel.pipeline = kept
    return report


def main() -> None:
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    dist.init_process_group("gloo")
    rank, w = dist.get_rank(), dist.get_world_size()
    store = spec["store"].format(node=int(os.environ.get("GROUP_RANK", "0")))
    tc = TrainConfig(**spec["train"])
    global_tc = replace(tc, batch_size=tc.batch_size * w)
    torch.manual_seed(spec["seed"])
    model = tierstore.hf.load(store, trainable=True, process_group=dist.group.WORLD,
                              device="cpu", host_cache="4MiB", paradigm=spec["paradigm"],
                              pipeline=spec["pipeline"])
    corpus = model_corpus(load_corpus(max_bytes=spec["corpus_bytes"]),
                          load_tokenizer(model.tierstore.store), model.config)
    sampler, _ = training_batches(global_tc, spec["seed"], corpus)
    dense = torch.optim.AdamW(param_groups(list(model.named_parameters()), tc.weight_decay),
                              lr=tc.lr, betas=tc.betas, eps=tc.eps)
    experts = tierstore.hf.ExpertAdamW(model, lr=tc.lr, betas=tc.betas, eps=tc.eps,
                                       weight_decay=tc.weight_decay)
    b = tc.batch_size
    probe = probe_pipeline(model, experts, *training_batches(global_tc, spec["seed"],
                                                             corpus)[0].next_batch(), rank, b)
    model.tierstore.parallel.begin()  # the counters from here on are the training's alone
    losses = []
    for step in range(spec["steps"]):
        for opt in (dense, experts):
            for group in opt.param_groups:
                group["lr"] = tc.lr_for(step)
        total = torch.zeros(1, dtype=torch.float64)
        for _ in range(tc.grad_accum):
            x, y = sampler.next_batch()
            loss, parts = hf_losses(model, x[rank * b:(rank + 1) * b], y[rank * b:(rank + 1) * b],
                                    False)
            (loss / tc.grad_accum).backward()
            total += float(parts["ce"])
        tierstore.hf.reduce_gradients(model)
        tierstore.hf.clip_grad_norm_(model, tc.clip)
        dense.step()
        experts.step()
        dense.zero_grad(set_to_none=True)
        experts.zero_grad()
        dist.all_reduce(total)
        losses.append(float(total[0]) / (tc.grad_accum * w))
    # A loop may save on some ranks only (the dense weights are every rank's): the others'
    # experts are then left behind the last step under the dense rule, for export-hf.
    if rank in spec.get("save_ranks", range(w)):
        tierstore.hf.save(model)
    figures = model.tierstore.parallel.step_figures()  # what the exchanges moved, all steps
    model.tierstore.close()
    if rank == 0:
        with open(spec["out"], "w") as f:
            json.dump({"losses": losses, "figures": figures, "probe": probe}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
