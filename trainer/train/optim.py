"""Optimizer arithmetic shared by the resident and the store-backed trainers.

The store-backed trainer cannot hand expert weights to ``torch.optim.AdamW``: they are
fetched from the store for the experts a step touched and written back afterwards. It runs
:func:`adamw_step` on each touched expert instead, with that expert's own step count.

Lazy semantics: an expert that received no token in a step has no gradient, is not updated
(no weight decay, no moment decay) and its step count does not advance. This is also what
``torch.optim.AdamW`` does for a parameter whose ``.grad`` is ``None``, so a resident model
that keeps one parameter per expert (``trainer.model.ExpertBank``) follows the same rule.
The dense rule of an imported model's fine-tune (:mod:`.dense_rule`) runs :func:`adamw_step`
with a zero gradient for the steps an expert missed, as ``torch.optim.AdamW`` does to the
unrouted slices of a fused expert parameter.

Gradient clipping across dense and expert gradients must see one global norm; the helpers
below reproduce ``torch.nn.utils.clip_grad_norm_`` for gradients that are not all ``.grad``
attributes of one parameter list.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch
from torch import Tensor


@torch.no_grad()
def adamw_step(param: Tensor, grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, step: int,
               lr: float, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
               weight_decay: float = 0.01,
               out: tuple[Tensor, Tensor, Tensor] | None = None) -> None:
    """One AdamW update of ``param``, ``exp_avg`` and ``exp_avg_sq``: in place, or with
    ``out=(param', exp_avg', exp_avg_sq')`` into those tensors, the inputs left as they were
    (the store trainer reads lent cache slots and writes staged ones).

    ``step`` is this parameter's step count *including* this update (1 on its first one).
    The arithmetic is torch.optim.AdamW's single-tensor path operation for operation (the
    out-of-place form runs the same kernels, so both give the same bits): decoupled weight
    decay ``param *= 1 - lr * wd``, moments ``m = lerp(m, g, 1 - b1)``,
    ``v = b2 * v + (1 - b2) * g * g``, then ``param -= lr / (1 - b1^t) * m /
    (sqrt(v) / sqrt(1 - b2^t) + eps)``.
    """
    if step < 1:
        raise ValueError(f"step counts from 1, got {step}")
    p_out, m_out, v_out = out if out is not None else (param, exp_avg, exp_avg_sq)
    beta1, beta2 = betas
    if weight_decay != 0:
        torch.mul(param, 1 - lr * weight_decay, out=p_out)
    elif p_out is not param:
        p_out.copy_(param)
    torch.lerp(exp_avg, grad, 1 - beta1, out=m_out)
    torch.mul(exp_avg_sq, beta2, out=v_out).addcmul_(grad, grad, value=1 - beta2)
    t = float(step)
    bias_correction1 = 1 - beta1**t
    bias_correction2 = 1 - beta2**t
    step_size = lr / bias_correction1
    denom = (v_out.sqrt() / bias_correction2**0.5).add_(eps)
    p_out.addcdiv_(m_out, denom, value=-step_size)


def grad_norms(grads: Iterable[Tensor]) -> list[Tensor]:
    """Per-tensor L2 norms (fp32 scalars), to be combined by :func:`total_norm`. A trainer
    that sees its gradients in pieces (dense now, experts layer by layer) collects these."""
    return [torch.linalg.vector_norm(g, 2) for g in grads]


def total_norm(norms: Sequence[Tensor]) -> Tensor:
    """The global L2 norm from per-tensor norms, as ``clip_grad_norm_`` computes it."""
    if not norms:
        return torch.tensor(0.0)
    device = norms[0].device
    return torch.linalg.vector_norm(torch.stack([n.to(device) for n in norms]), 2)


def clip_coef(norm: Tensor, max_norm: float) -> Tensor:
    """The factor ``min(max_norm / (norm + 1e-6), 1)`` every gradient is multiplied by."""
    return torch.clamp(max_norm / (norm + 1e-6), max=1.0)


@torch.no_grad()
def clip_grads_(grads: Sequence[Tensor], max_norm: float) -> Tensor:
    """Scale ``grads`` in place to a global norm of at most ``max_norm``; returns the norm
    before clipping. Equal to ``torch.nn.utils.clip_grad_norm_`` on the same tensors."""
    norm = total_norm(grad_norms(grads))
    coef = clip_coef(norm, max_norm)
    for g in grads:
        g.mul_(coef.to(g.device))
    return norm


def lr_at(step: int, lr: float, warmup_steps: int = 0, decay_steps: int | None = None,
          min_lr: float = 0.0) -> float:
    """Learning rate of update ``step`` (0-based): linear warmup over ``warmup_steps``, then
    cosine decay to ``min_lr`` over ``decay_steps`` (constant when ``None``).

    The schedule is fixed by these arguments alone, not by the run's length, so a run that
    is stopped and resumed with a larger ``--steps`` sees the same rates as one that was not.
    """
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if decay_steps is None or decay_steps <= 0:
        return lr
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * progress))
