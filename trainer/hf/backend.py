"""tierstore as an experts implementation of ``transformers``.

``transformers`` 5 routes the expert computation of every class decorated with
``@use_experts_implementation`` through one registry, ``ExpertsInterface``: the decorated
``forward`` looks ``config._experts_implementation`` up on every call and calls
``fn(experts_module, hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k])``.
Importing this module registers :data:`IMPLEMENTATION` there. The family's attention,
routers, caches and ``generate`` stay ``transformers``'; this function supplies only the
routed experts' weights, from an :class:`~trainer.model.ExpertSource` over the store.

The module carries no layer index, so :func:`bind` tags each experts module with an
:class:`ExpertLayer`: its qualified name, the store entries that hold one expert's slice of
each fused parameter, and the source to ask. The math is the per-expert loop of
``transformers``' eager reference (``integrations/moe.py``), on the routed experts only:
the module's own ``_apply_gate`` (or ``act_fn`` where ``has_gate`` is false), its
orientation (``is_transposed``), biases and post-expert norm, and the routing weights
applied in fp32 and summed over the k slots as ``batched_mm`` does. Experts run in
ascending id order, each looked up just before it runs, so a source may still be loading
the later ones.

A quantized checkpoint's experts (:mod:`tierstore.hf.quant`) reach this function as they are
stored, packed, through every tier; each routed expert is dequantized here, on the device
the source put it on, into a buffer the next expert reuses, just before it runs.

A source with a ``forward_layer(module, layer, hidden_states, top_k_index,
top_k_weights)`` method takes the whole call instead: an expert-parallel source dispatches
the routed rows to the ranks that own their experts and combines what comes back, with
:func:`expert_output` on the owners, so the family's model code stays ``transformers``'.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .quant import MXFP4, as_module_holds

IMPLEMENTATION = "tierstore"
BINDING = "_tierstore_experts"  # the attribute an experts module's ExpertLayer is kept in

# The per-expert parameters transformers' experts functions know, by role. A fused
# parameter is ``[E, ...]``; the store keeps each expert's slice as an entry of its own.
ROLES = {"gate_up_proj": "up", "up_proj": "up", "down_proj": "down",
         "gate_up_proj_bias": "up_bias", "up_proj_bias": "up_bias",
         "down_proj_bias": "down_bias"}


class NotServedError(RuntimeError):
    """An experts module the backend cannot serve (not bound, or an unknown parameter)."""


@dataclass
class ExpertParam:
    """One fused parameter of an experts module and the entries that hold an expert's
    slice of it: one entry, or parts joined along the output dimension (a trainer run keeps
    the gate and up projections apart, ``w1`` and ``w3``, where the module fuses them)."""

    attr: str  # gate_up_proj, down_proj, ...
    parts: tuple[str, ...]  # entry name suffixes under the layer's prefix and expert number
    format: str | None = None  # quantized: mxfp4 or fp8, its parts (packed, scales)

    @property
    def role(self) -> str:
        return ROLES[self.attr]


@dataclass
class ExpertLayer:
    """What the backend knows of one experts module: its key for the sources (the decoder
    layer's number), its qualified name, where its experts live in the store, and the
    source it asks for them."""

    key: int
    module_name: str
    prefix: str  # entry names are f"{prefix}.{expert}.{part}"
    params: tuple[ExpertParam, ...]
    num_experts: int
    source: Any = None  # an ExpertSource; set by the strategy before the first forward
    top_k: int | None = None  # learnt from the first call
    calls: int = field(default=0, repr=False)
    dtype: torch.dtype | None = None  # quantized layers: the compute dtype to dequantize to
    dequantizer: Any = field(default=None, repr=False)  # a tierstore.hf.quant.Dequantizer
    hot: Any = field(default=None, repr=False)  # a tierstore.hf.hot_experts.HotExperts
    transposed: bool = False  # the module holds [in, out] (gpt-oss)
    _plain: Any = field(default=None, repr=False)

    @property
    def quantized(self) -> bool:
        return any(p.format for p in self.params)

    def plain(self) -> ExpertLayer:
        """This layer as one whose experts come in the compute dtype, one tensor a
        parameter (what a warm-up's zero experts are); itself if not quantized."""
        if not self.quantized:
            return self
        if self._plain is None:
            params = tuple(ExpertParam(p.attr, (p.attr,)) for p in self.params)
            self._plain = ExpertLayer(self.key, self.module_name, self.prefix, params,
                                      self.num_experts)
        return self._plain

    def entry_names(self, expert: int) -> tuple[str, ...]:
        """The store names of one expert's tensors, in the order the sources return them."""
        return tuple(f"{self.prefix}.{expert}.{part}" for p in self.params for part in p.parts)

    def split(self, tensors: Sequence[Tensor]) -> dict[str, list[Tensor]]:
        """One expert's tensors (in :meth:`entry_names` order) by role."""
        out: dict[str, list[Tensor]] = {}
        i = 0
        for p in self.params:
            n = len(p.parts)
            out[p.role] = list(tensors[i:i + n])
            i += n
        return out

    def dequantize(self, tensors: Sequence[Tensor], reuse: bool) -> dict[str, list[Tensor]]:
        """One expert's stored tensors by role in the compute dtype: packed parameters
        dequantized (into the dequantizer's reused buffers where ``reuse``), the others
        cast (copied where not ``reuse``: a source's tensors are borrowed slots)."""
        out = self.split(tensors)
        for p in self.params:
            got = out[p.role]
            if p.format is not None:
                w = self.dequantizer(p.format, got[0], got[1], self.dtype, reuse=reuse)
                out[p.role] = [as_module_holds(w, p.format, self.transposed)]
            else:
                out[p.role] = [t.to(self.dtype, copy=not reuse) for t in got]
        return out

    def dequantized_bytes(self, tensors: Sequence[Tensor]) -> int:
        """The bytes :meth:`dequantize` gives for one expert's stored ``tensors``."""
        size = torch.empty(0, dtype=self.dtype).element_size()
        n = 0
        for p, got in zip(self.params, self.split(tensors).values()):
            # MXFP4: two values a packed byte; FP8: one a byte; the rest as they are.
            n += got[0].numel() * (2 if p.format == MXFP4 else 1) if p.format is not None \
                else sum(t.numel() for t in got)
        return n * size


def _project(x: Tensor, parts: list[Tensor], bias: list[Tensor] | None,
             transposed: bool) -> Tensor:
    """``x`` through one expert's projection, given as parts joined along its output."""
    outs = [x @ w if transposed else F.linear(x, w) for w in parts]
    y = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
    if bias:
        y = y + bias[0]
    return y


def expert_output(module: nn.Module, x: Tensor, weights: dict[str, list[Tensor]]) -> Tensor:
    """One expert of ``module`` applied to its tokens ``x`` ``[N, H]``."""
    transposed = bool(module.is_transposed)
    h = _project(x, weights["up"], weights.get("up_bias"), transposed)
    h = module._apply_gate(h) if module.has_gate else module.act_fn(h)
    y = _project(h, weights["down"], weights.get("down_bias"), transposed)
    if getattr(module, "has_post_expert_norm", False):
        y = module.post_expert_norm(y)
    return y


def experts_forward(module: nn.Module, hidden_states: Tensor, top_k_index: Tensor,
                    top_k_weights: Tensor) -> Tensor:
    """The registered experts function (see the module docstring)."""
    layer: ExpertLayer | None = getattr(module, BINDING, None)
    if layer is None or layer.source is None:
        raise NotServedError(
            f"{type(module).__name__} has no tierstore binding: load the model with "
            "tierstore.hf.load(store), which binds every experts module to the store")
    n_tok, k = top_k_index.shape
    layer.top_k = k
    layer.calls += 1
    parallel = getattr(layer.source, "forward_layer", None)
    if parallel is not None:
        # An expert-parallel source: the routed rows go to the ranks that own their experts
        # and come back computed (tierstore.trainer.dist.hf_parallel), inside this call.
        return parallel(module, layer, hidden_states, top_k_index, top_k_weights)  # type: ignore[no-any-return]
    return local_forward(module, layer, layer.source, hidden_states, top_k_index, top_k_weights)


def local_forward(module: nn.Module, layer: ExpertLayer, source: Any, hidden_states: Tensor,
                  top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
    """The experts of ``module`` on this process's tokens, their weights from ``source``
    (an expert-parallel source that pulled them computes here too)."""
    n_tok, k = top_k_index.shape
    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True)  # slots grouped by expert, ascending ids
    ids, counts = torch.unique_consecutive(flat[order], return_counts=True)
    id_list, count_list = ids.tolist(), counts.tolist()
    # Ids past the module's experts are expert-parallel sentinels: owned elsewhere.
    routed = [e for e in id_list if 0 <= e < layer.num_experts]
    # Autograd keeps an expert's weight for the input's gradient. An inference source's
    # weights are borrowed (host-cache slots, the ring's slots) and reused after the layer,
    # so frozen experts under a backward (adapters trained on the rest) compute with a copy;
    # trainable experts (leaves that require grad) are the trainer's own and stay as given.
    keep = torch.is_grad_enabled() and hidden_states.requires_grad
    # A warm-up's zero experts come dequantized (tierstore.hf.warmup).
    packed = layer.quantized and not getattr(source, "dequantized", False)
    # Experts held dequantized (tierstore.hf.hot_experts) are not asked of the source.
    hot = layer.hot if packed and not keep and layer.hot is not None \
        and layer.hot.serves(source) else None
    held = {(layer.key, e) for e in routed if hot.holds((layer.key, e))} \
        if hot is not None else set()
    if held:
        routed = [e for e in routed if (layer.key, e) not in held]
        noted = getattr(source, "routed_held", None)  # a routing trace records them too
        if noted is not None:
            noted(layer.key, sorted(e for _, e in held))
    found: Mapping[int, Sequence[Tensor]] = source.experts(layer.key, routed, hidden_states) \
        if routed else {}
    token_of = order // k
    pieces = []
    start = 0
    for e, c in zip(id_list, count_list):
        rows = token_of[start:start + c]
        start += c
        if not 0 <= e < layer.num_experts:
            pieces.append(hidden_states.new_zeros(c, hidden_states.shape[-1]))
            continue
        if (layer.key, e) in held:
            pieces.append(expert_output(module, hidden_states[rows], hot.hit((layer.key, e))))
            continue
        if e not in found:  # not a lookup's KeyError: a source's own errors pass through
            raise KeyError(f"expert {e} of {layer.module_name} was routed to but its weights "
                           "were not supplied")
        weights = found[e]
        if hot is not None:
            split = hot.miss((layer.key, e), layer.dequantized_bytes(weights),
                             lambda reuse, w=weights: layer.dequantize(w, reuse=reuse), held)
        elif packed:
            split = layer.dequantize(weights, reuse=not keep)
        else:
            if keep:
                weights = [w if w.requires_grad else w.clone() for w in weights]
            split = layer.plain().split(weights)
        pieces.append(expert_output(module, hidden_states[rows], split))
    source.layer_done(layer.key)
    y_sorted = torch.cat(pieces)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    y = y_sorted[inverse].view(n_tok, k, -1)
    # As batched_mm: the routing weights in fp32 (they arrive so), summed over the k slots.
    sentinel = (top_k_index >= layer.num_experts) | (top_k_index < 0)
    w = top_k_weights.masked_fill(sentinel, 0.0) if bool(sentinel.any()) else top_k_weights
    return (y * w.unsqueeze(-1)).sum(dim=1).to(hidden_states.dtype)


def register() -> None:
    """Register :data:`IMPLEMENTATION` with ``transformers``' ``ExpertsInterface`` (what
    importing :mod:`tierstore.hf` does; calling it again changes nothing)."""
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(IMPLEMENTATION, experts_forward)


def bind(module: nn.Module, layer: ExpertLayer) -> None:
    """Tag ``module`` with ``layer`` (before anything wraps or renames modules)."""
    setattr(module, BINDING, layer)


def binding(module: nn.Module) -> ExpertLayer | None:
    return getattr(module, BINDING, None)
