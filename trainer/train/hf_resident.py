"""An imported model fine-tuned in memory: what the fine-tune over the store is held to,
and the in-memory side of ``bench train --model-dir``.

The model is ``transformers``' own with every weight in memory, its experts computed by
``transformers``' own eager code (the experts class's original ``forward``). Each fused
expert parameter ``[E, ...]`` is split into ``E`` parameters, one per expert
(:class:`PerExpert`), stacked back into the module's attribute before every call of the
experts module, so ``torch.optim.AdamW`` holds one parameter per expert. After the backward
passes of a step, an expert no token reached in that step has its gradient set to ``None``
(the stack gives it zeros), and AdamW leaves it alone: the lazy rule of the store trainer,
by torch's own optimizer. One global-norm clip (``torch.nn.utils.clip_grad_norm_``) covers
every gradient; the loss is ``transformers``' own (:func:`.hf_finetune.hf_losses`).

``rule="dense"`` keeps the fused parameters (:class:`Fused`): an unrouted expert's slice has
a zero gradient and ``torch.optim.AdamW`` updates it, the store trainer's dense rule
(:mod:`.dense_rule`).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from tierstore.hf.families import experts_modules
from torch import Tensor, nn

from .data import Corpus
from .heap import SteadyHeap
from .hf_finetune import hf_losses
from .optim import grad_norms, total_norm
from .resident import Metrics, TrainConfig, param_groups, step_metrics, training_batches


class PerExpert:
    """Every experts module of ``model`` with its fused parameters split per expert, and
    the experts each module was called with since :meth:`clear` (see the module
    docstring). Expert ``e``'s slice of ``{module}.{attr}`` is the parameter
    ``{module}.{attr}_experts.{e}``, and :meth:`weights` names it as the store does,
    ``{module}.{e}.{attr}``."""

    SUFFIX = "_experts"

    def __init__(self, model: nn.Module) -> None:
        self.split: dict[str, tuple[nn.Module, int, list[str]]] = {}
        self.routed: dict[str, set[int]] = {}
        for name, module in experts_modules(model):
            n = int(module.num_experts)
            attrs = [a for a, p in module.named_parameters(recurse=False)
                     if p.dim() >= 1 and p.shape[0] == n]
            for a in attrs:
                fused = getattr(module, a)
                per = nn.ParameterList(nn.Parameter(fused.detach()[e].clone())
                                       for e in range(n))
                delattr(module, a)
                module.register_module(a + self.SUFFIX, per)
            module.register_forward_pre_hook(self._stack(name), with_kwargs=True)
            self.split[name] = (module, n, attrs)

    def _stack(self, name: str) -> Callable[..., None]:
        def hook(mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            _, n, attrs = self.split[name]
            for a in attrs:
                setattr(mod, a, torch.stack(list(getattr(mod, a + self.SUFFIX))))
            ids = kwargs.get("top_k_index", args[1] if len(args) > 1 else None)
            if isinstance(ids, Tensor):
                got = self.routed.setdefault(name, set())
                got.update(e for e in torch.unique(ids).tolist() if 0 <= e < n)

        return hook

    def clear(self) -> None:
        self.routed = {}

    def drop_unrouted_grads(self) -> None:
        """An expert that no token reached since :meth:`clear` gets no gradient."""
        for name, (module, _, attrs) in self.split.items():
            routed = self.routed.get(name, set())
            for a in attrs:
                for e, p in enumerate(getattr(module, a + self.SUFFIX)):
                    if e not in routed:
                        p.grad = None

    def weights(self) -> dict[str, Tensor]:
        """Every expert's weights by their store names."""
        return {f"{name}.{e}.{a}": p.detach()
                for name, (module, _, attrs) in self.split.items() for a in attrs
                for e, p in enumerate(getattr(module, a + self.SUFFIX))}


class Fused:
    """Every experts module of ``model`` with its fused parameters left as they are (the
    dense rule's reference); :meth:`weights` names each expert's slice as the store does."""

    def __init__(self, model: nn.Module) -> None:
        self.modules: dict[str, tuple[nn.Module, list[str]]] = {}
        for name, module in experts_modules(model):
            n = int(module.num_experts)
            self.modules[name] = (module, [a for a, p in module.named_parameters(recurse=False)
                                           if p.dim() >= 1 and p.shape[0] == n])

    def weights(self) -> dict[str, Tensor]:
        return {f"{name}.{e}.{a}": p.detach()[e]
                for name, (module, attrs) in self.modules.items() for a in attrs
                for p in [getattr(module, a)] for e in range(p.shape[0])}


def train_hf_resident(model: nn.Module, steps: int, seed: int = 0,
                      train: TrainConfig | None = None, *, corpus: Corpus,
                      device: str | torch.device = "cpu", autocast: bool = False,
                      on_step: Callable[[Metrics], None] | None = None,
                      rule: str = "lazy") -> tuple[list[Metrics], PerExpert | Fused]:
    """Fine-tune ``model`` (a ``transformers`` causal LM, fp32, every weight in memory) for
    ``steps`` steps on ``corpus`` (already in the model's tokens) as the module docstring
    says, with the batches, learning-rate schedule, weight decay groups and metrics of the
    store trainer; ``autocast``: compute in bf16; ``rule``: the update rule, ``lazy`` (one
    parameter per expert) or ``dense`` (the fused parameters). Returns the steps' metrics and
    the experts (their ``weights()``)."""
    tc = train or TrainConfig()
    dev = torch.device(device)
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed % 2**32)
    sampler, val_batches = training_batches(tc, seed, corpus)
    model.set_experts_implementation("eager")
    model.to(dev)
    experts: PerExpert | Fused = PerExpert(model) if rule == "lazy" else Fused(model)
    model.train()
    named = list(model.named_parameters())
    params = [p for _, p in named]
    opt = torch.optim.AdamW(param_groups(named, tc.weight_decay), lr=tc.lr, betas=tc.betas,
                            eps=tc.eps)
    history: list[Metrics] = []
    with SteadyHeap() as heap:
        for step in range(steps):
            t0 = time.perf_counter()
            lr = tc.lr_for(step)
            for group in opt.param_groups:
                group["lr"] = lr
            if isinstance(experts, PerExpert):
                experts.clear()
            sums = {"ce": 0.0, "aux_loss": 0.0, "z_loss": 0.0}
            for _ in range(tc.grad_accum):
                x, y = sampler.next_batch()
                loss, parts = hf_losses(model, x.to(dev), y.to(dev), autocast)
                (loss / tc.grad_accum).backward()
                for k in sums:
                    sums[k] += float(parts[k])
            if isinstance(experts, PerExpert):
                experts.drop_unrouted_grads()
            if tc.clip is not None:
                norm = torch.nn.utils.clip_grad_norm_(params, tc.clip)
            else:
                norm = total_norm(grad_norms(p.grad for p in params if p.grad is not None))
            opt.step()
            opt.zero_grad(set_to_none=True)
            m = step_metrics(step, tc, dev, t0, sums["ce"], sums["aux_loss"], sums["z_loss"],
                             norm, lr)
            heap.step_done()
            done = step + 1
            if tc.eval_every > 0 and (done % tc.eval_every == 0 or done == steps):
                m["val_loss"] = _evaluate(model, val_batches, dev, autocast)
            history.append(m)
            if on_step is not None:
                on_step(m)
    return history, experts


@torch.no_grad()
def _evaluate(model: nn.Module, batches: list[tuple[Tensor, Tensor]], dev: torch.device,
              autocast: bool) -> float:
    model.eval()
    try:
        total = sum(float(hf_losses(model, x.to(dev), y.to(dev), autocast)[1]["ce"])
                    for x, y in batches)
    finally:
        model.train()
    return total / max(1, len(batches))
