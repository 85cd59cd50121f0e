"""Where a model's experts live in the store, as the store trainer sees them.

The trainer's expert machinery (:class:`~.expert_states.ExpertStates`, the fetch modes, the
step counts, the budget) knows nothing of a model's code: it asks an :class:`ExpertLayout`
for the MoE layers, each expert's entry names and their shapes. The model gives the layout:

- a trainer preset (:func:`preset_layout`): ``layers.{i}.experts.{e}.w1|w2|w3``;
- a ``transformers`` model loaded with :mod:`tierstore.hf` (built by
  :func:`trainer.train.hf_finetune.served_layout`): each experts module's entries,
  ``{module}.{e}.{part}`` (``model.layers.3.mlp.experts.5.gate_up_proj``), in the order the
  backend hands them to the experts function.

A layer's per-expert AdamW step counts are one entry named by the layer's prefix, kind
``step`` (:meth:`ExpertLayout.counts_name`; ``layers.{i}.experts`` for a preset).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

from ..model import EXPERT_WEIGHTS, ModelConfig, model_config
from ..presets import MoEConfig


@dataclass(frozen=True)
class LayerEntries:
    """One MoE layer's experts in the store: entries ``{prefix}.{e}.{part}``, one per part,
    of the given shapes (fp32 in training)."""

    key: int  # the layer's key, as the model's experts call the trainer with it
    prefix: str
    parts: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]

    def names(self, expert: int) -> tuple[str, ...]:
        return tuple(f"{self.prefix}.{expert}.{p}" for p in self.parts)

    @property
    def numel(self) -> int:
        """Elements of one expert (every part)."""
        return sum(math.prod(s) for s in self.shapes)


@dataclass(frozen=True)
class ExpertLayout:
    """The experts of a model: its MoE layers in order, ``n_experts`` each, ``top_k`` routed
    per token."""

    layers: tuple[LayerEntries, ...]
    n_experts: int
    top_k: int
    # Several ranks of a node share its store and each updates only the experts it owns:
    # each keeps its step counts (and the dense rule's history) in an entry of its own,
    # named with this suffix, and ``owned`` says which experts are its (all where None).
    counts_suffix: str = ""
    owned: range | None = None

    @cached_property
    def _by_key(self) -> dict[int, LayerEntries]:
        return {lay.key: lay for lay in self.layers}

    @property
    def keys(self) -> list[int]:
        return [lay.key for lay in self.layers]

    def layer(self, key: int) -> LayerEntries:
        return self._by_key[key]

    def names(self, key: int, expert: int) -> tuple[str, ...]:
        """The store names of one expert's tensors, in the order its leaves are handed."""
        return self._by_key[key].names(expert)

    def shapes(self, key: int) -> tuple[tuple[int, ...], ...]:
        """Their shapes, in the same order."""
        return self._by_key[key].shapes

    @property
    def expert_ids(self) -> range:
        """The experts of every layer that this layout trains."""
        return range(self.n_experts) if self.owned is None else self.owned

    def counts_name(self, key: int) -> str:
        """The entry (kind ``step``) holding the layer's per-expert AdamW step counts."""
        return self._by_key[key].prefix + self.counts_suffix

    @cached_property
    def _shape_of(self) -> dict[tuple[str, str], tuple[int, ...]]:
        return {(lay.prefix, p): s for lay in self.layers for p, s in zip(lay.parts, lay.shapes)}

    def shape_of(self, name: str) -> tuple[int, ...]:
        """The shape of expert entry ``name`` (``{prefix}.{e}.{part}``)."""
        prefix, _, part = name.rsplit(".", 2)
        return self._shape_of[(prefix, part)]

    @property
    def expert_bytes(self) -> int:
        """fp32 bytes of one expert's weights (the largest layer's)."""
        return 4 * max((lay.numel for lay in self.layers), default=0)

    def per_step_experts(self, tokens: int) -> int:
        """The most experts one MoE layer can touch in a step of ``tokens`` tokens."""
        return min(self.n_experts, tokens * self.top_k)

    @property
    def state_bytes(self) -> int:
        """fp32 bytes of every expert's weights and two AdamW moments."""
        return 3 * 4 * self.n_experts * sum(lay.numel for lay in self.layers)


def owned_suffix(ids: range) -> str:
    """The suffix of the step-count and history entries of a rank that owns ``ids``."""
    return f".owned{ids.start}-{ids.stop - 1}"


def owned_of_suffix(suffix: str) -> range | None:
    """The experts :func:`owned_suffix` named (None: a suffix it did not make)."""
    lo, sep, hi = suffix.removeprefix(".owned").partition("-")
    if not suffix.startswith(".owned") or not sep or not (lo.isdigit() and hi.isdigit()):
        return None
    return range(int(lo), int(hi) + 1)


def preset_layout(cfg: MoEConfig | ModelConfig) -> ExpertLayout:
    """The layout of a trainer model: ``layers.{i}.experts.{e}.w1|w2|w3``."""
    mc = model_config(cfg)
    shapes = mc.expert_shapes()
    return ExpertLayout(
        tuple(LayerEntries(i, f"layers.{i}.experts", EXPERT_WEIGHTS,
                           tuple(shapes[w] for w in EXPERT_WEIGHTS)) for i in mc.moe_layers),
        mc.n_experts, mc.top_k)
