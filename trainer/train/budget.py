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

With a budget or without one, the same working set (and the dense states, and on a CPU the
host cache) must fit the memory of the machine or device: :func:`check_step_fits` refuses a
batch that cannot, naming the batch size that would, before anything is allocated.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

import tierstore

from ..infer.budget import device_memory
from ..model import MoEModel, model_config
from ..presets import TrainModel
from .checkpoint import TrainerError
from .resident import TrainConfig

# Dense parameters' fp32 bytes, times this: weights, gradients and two AdamW moments, and
# the serialised copy a checkpoint makes of the weights and moments.
DENSE_STATE_FACTOR = 7


def _fmt(n: int) -> str:
    return tierstore.format_size(n)


def expert_bytes(cfg: TrainModel) -> int:
    """One expert's fp32 weights (w1, w2, w3)."""
    return sum(4 * a * b for a, b in cfg.expert_shapes().values())


def activation_bytes(cfg: TrainModel, tc: TrainConfig) -> int:
    """A bound on what one micro-batch's forward keeps for its backward pass: per layer the
    hidden states, attention projections and scores, the routed tokens' copies and the
    experts' intermediates; then the logits and their gradient."""
    mc = model_config(cfg)
    n = tc.batch_size * tc.seq_len
    h, k = mc.hidden_size, mc.top_k
    ffn = max(mc.moe_ffn * k, mc.dense_ffn, mc.shared_ffn)
    per_layer = n * (14 * h + 4 * k * h + 4 * ffn + 2 * mc.n_experts) * 4
    scores = 2 * tc.batch_size * mc.n_heads * tc.seq_len * tc.seq_len * 4
    head = 3 * n * mc.vocab_size * 4
    return mc.n_layers * (per_layer + scores) + head


def moment_bytes(cfg: TrainModel, tc: TrainConfig, read_ahead: bool) -> int:
    """The moments of the experts one MoE layer can touch in a step, for one layer (two
    with moments read ahead)."""
    tokens = tc.grad_accum * tc.batch_size * tc.seq_len
    per_layer = min(cfg.n_experts, tokens * cfg.top_k)
    return (2 if read_ahead else 1) * 2 * per_layer * expert_bytes(cfg)


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


def train_budget(cfg: TrainModel, tc: TrainConfig, device_budget: int | str | None,
                 read_ahead: bool) -> TrainBudget | None:
    """The split of ``device_budget`` (None: no budget) for training ``cfg`` with ``tc``;
    raises :class:`TrainerError` where it cannot hold even one token's experts."""
    if device_budget is None:
        return None
    plan = TrainBudget(device=tierstore.parse_size(device_budget),
                       activations=activation_bytes(cfg, tc),
                       moments=moment_bytes(cfg, tc, read_ahead))
    least = least_expert_bytes(cfg)
    if plan.fetch_bytes < least:
        raise plan.too_small(f"a step of one token ({cfg.top_k} experts in every MoE layer)",
                             least)
    return plan


def least_expert_bytes(cfg: TrainModel) -> int:
    """The expert weights a step of one token touches: ``top_k`` experts in every MoE
    layer."""
    return len(cfg.moe_layers) * cfg.top_k * expert_bytes(cfg)


def check_step_fits(cfg: TrainModel, tc: TrainConfig, device: torch.device, *,
                    host_cache: int = 0, resident: bool = False,
                    read_ahead: bool = False) -> None:
    """Refuse a step that cannot fit ``device``'s memory before anything is allocated: its
    activations, with the store trainer also one layer's AdamW moments and one token's
    experts (the least any step holds), beside the dense states (every weight's with
    ``resident``) and, on a CPU, the host cache. The error names the batch size that fits,
    or the sequence length when not even one sequence does."""
    with torch.device("meta"):
        net = MoEModel(cfg, seed=None, resident_experts=resident)
    states = dense_state_bytes(net)
    memory = device_memory(device)
    cache = host_cache if device.type == "cpu" else 0
    room = memory - states - cache
    acts = activation_bytes(cfg, tc)
    rest = 0 if resident else (moment_bytes(cfg, tc, read_ahead)
                               + 2 * least_expert_bytes(cfg))
    if acts + rest <= room:
        return
    most = (room - rest) // activation_bytes(cfg, replace(tc, batch_size=1))
    spare = room + cache - rest - acts  # what the batch would leave without a host cache
    if most >= 1:
        fix = f"lower --batch-size to at most {most}"
    elif cache and spare > 0:
        fix = f"lower --host-cache to at most {_fmt(spare)}"
    else:
        fix = "lower --seq-len"
    what = f"{_fmt(acts)} of activations" + (
        "" if resident else f" + {_fmt(rest)} of AdamW moments and expert weights")
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
