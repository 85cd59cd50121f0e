"""The memory budget of a training run over a store.

A process training under a budget (docs/trainer.md, "Memory budget") holds the interpreter
with torch, the dense states (``DENSE_STATE_FACTOR`` × the dense parameters' fp32 bytes:
weights, gradients and both AdamW moments, and their serialised copy while a checkpoint is
written), the host cache (``--host-cache``), the device budget (``--device-budget``) and a
fixed overhead. The device budget bounds the step's working set:

- the activations one micro-batch keeps for its backward pass (bounded from the batch and
  the model's shape, :func:`activation_bytes`);
- the AdamW moments of the layer being updated (of two with moments read ahead);
- the rest, the expert weights the step fetches and their gradients (as large again): the
  fetch modes hold at most half of it in weights (:attr:`TrainBudget.fetch_bytes`).

The first two are known before the first step and come off the budget first; a budget
that then cannot hold one token's experts is an error before anything runs, and a step
whose routing touches more experts than the rest holds fails with the budget it needs.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

import tierstore

from ..model import model_config
from ..presets import MoEConfig
from .checkpoint import TrainerError
from .layout import ExpertLayout
from .resident import TrainConfig

# Dense parameters' fp32 bytes, times this: weights, gradients and two AdamW moments, and
# the serialised copy a checkpoint makes of the weights and moments.
DENSE_STATE_FACTOR = 7


def _fmt(n: int) -> str:
    return tierstore.format_size(n)


@dataclass(frozen=True)
class TrainShape:
    """The sizes a micro-batch's activations are bounded by: layers, hidden size, attention
    heads, the widest per-token FFN intermediate (``top_k`` routed experts, a dense FFN or a
    shared expert), experts per layer and vocabulary."""

    n_layers: int
    hidden: int
    heads: int
    ffn: int
    top_k: int
    n_experts: int
    vocab: int

    @classmethod
    def of_preset(cls, cfg: MoEConfig) -> TrainShape:
        mc = model_config(cfg)
        return cls(mc.n_layers, mc.hidden_size, mc.n_heads,
                   max(mc.moe_ffn * mc.top_k, mc.dense_ffn), mc.top_k,
                   mc.n_experts, mc.vocab_size)


def activation_bytes(shape: TrainShape, tc: TrainConfig) -> int:
    """A bound on what one micro-batch's forward keeps for its backward pass: per layer the
    hidden states, attention projections and scores, the routed tokens' copies and the
    experts' intermediates; then the logits and their gradient."""
    n = tc.batch_size * tc.seq_len
    h, k = shape.hidden, shape.top_k
    per_layer = n * (14 * h + 4 * k * h + 4 * shape.ffn + 2 * shape.n_experts) * 4
    scores = 2 * tc.batch_size * shape.heads * tc.seq_len * tc.seq_len * 4
    head = 3 * n * shape.vocab * 4
    return shape.n_layers * (per_layer + scores) + head


def moment_bytes(layout: ExpertLayout, tc: TrainConfig, read_ahead: bool) -> int:
    """The moments of the experts one MoE layer can touch in a step, for one layer (two
    with moments read ahead)."""
    tokens = tc.grad_accum * tc.batch_size * tc.seq_len
    return (2 if read_ahead else 1) * 2 * layout.per_step_experts(tokens) * layout.expert_bytes


@dataclass
class TrainBudget:
    """A device budget split for training: ``activations`` and ``moments`` first, the rest
    for the step's expert weights and their gradients."""

    device: int
    activations: int
    moments: int

    @property
    def reserved(self) -> int:
        return self.activations + self.moments

    @property
    def fetch_bytes(self) -> int:
        """Expert weights a step may hold: half of what is left (gradients take the rest)."""
        return max(0, self.device - self.reserved) // 2

    def need_for(self, weights: int) -> int:
        """The device budget that holds ``weights`` bytes of expert weights."""
        return self.reserved + 2 * weights

    def too_small(self, what: str, weights: int) -> TrainerError:
        return TrainerError(
            f"--device-budget {_fmt(self.device)} is below what {what} needs: "
            f"{_fmt(self.activations)} of activations + {_fmt(self.moments)} of AdamW moments "
            f"+ {_fmt(2 * weights)} of expert weights and gradients; raise it to at least "
            f"{_fmt(self.need_for(weights))}")

    def step_error(self, layer: int, weights: int, worst: int) -> TrainerError:
        """The error of a step whose experts up to ``layer`` come to ``weights`` bytes."""
        err = self.too_small(f"this step (up to MoE layer {layer})", weights)
        return TrainerError(f"{err} (a step of this model and batch can touch up to "
                            f"{_fmt(self.need_for(worst))})")


def train_budget(shape: TrainShape, layout: ExpertLayout, tc: TrainConfig,
                 device_budget: int | str | None, read_ahead: bool) -> TrainBudget | None:
    """The split of ``device_budget`` (None: no budget) for training a model of ``shape``
    whose experts are ``layout`` with ``tc``; raises :class:`TrainerError` where it cannot
    hold even one token's experts."""
    if device_budget is None:
        return None
    plan = TrainBudget(device=tierstore.parse_size(device_budget),
                       activations=activation_bytes(shape, tc),
                       moments=moment_bytes(layout, tc, read_ahead))
    least = len(layout.keys) * layout.top_k * layout.expert_bytes
    if plan.fetch_bytes < least:
        raise plan.too_small(f"a step of one token ({layout.top_k} experts in every MoE "
                             "layer)", least)
    return plan


def check_step_fits(shape: TrainShape, tc: TrainConfig, device: torch.device, *,
                    dense_params: int, layout: ExpertLayout | None, host_cache: int = 0,
                    read_ahead: bool = False) -> None:
    """Refuse a step that cannot fit ``device``'s memory before anything is allocated: its
    activations, with the store trainer (``layout``: the experts in the store) also one
    layer's AdamW moments and one token's experts (the least any step holds), beside the
    dense states of ``dense_params`` parameters (every weight, resident) and, on a CPU, the
    host cache. The error names the batch size that fits, or the sequence length when not
    even one sequence does."""
    from ..infer.budget import device_memory

    states = DENSE_STATE_FACTOR * 4 * dense_params
    memory = device_memory(device)
    cache = host_cache if device.type == "cpu" else 0
    room = memory - states - cache
    acts = activation_bytes(shape, tc)
    rest = 0 if layout is None else (moment_bytes(layout, tc, read_ahead)
                                     + 2 * len(layout.keys) * layout.top_k * layout.expert_bytes)
    if acts + rest <= room:
        return
    most = (room - rest) // activation_bytes(shape, replace(tc, batch_size=1))
    spare = room + cache - rest - acts  # what the batch would leave without a host cache
    if most >= 1:
        fix = f"lower --batch-size to at most {most}"
    elif cache and spare > 0:
        fix = f"lower --host-cache to at most {_fmt(spare)}"
    else:
        fix = "lower --seq-len"
    what = f"{_fmt(acts)} of activations" + (
        "" if layout is None else f" + {_fmt(rest)} of AdamW moments and expert weights")
    beside = f"{_fmt(states)} of dense states" + (f" and the {_fmt(cache)} host cache"
                                                   if cache else "")
    place = "this machine" if device.type == "cpu" else str(device)
    raise TrainerError(
        f"a step of --batch-size {tc.batch_size} x --seq-len {tc.seq_len} needs {what}, more "
        f"than the {_fmt(max(room, 0))} that {place}'s {_fmt(memory)} of memory leaves beside "
        f"{beside}; {fix}")


def dense_state_bytes(net: torch.nn.Module) -> int:
    """What the dense parameters come to in the budget (see ``DENSE_STATE_FACTOR``)."""
    return DENSE_STATE_FACTOR * 4 * sum(p.numel() for p in net.parameters())
