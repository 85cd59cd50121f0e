"""A ``transformers`` model whose experts are served from a store, as the expert sources
see it.

The sources (on demand, resident, the ring, expert mode: :mod:`trainer.infer`) were written
against a model that names each expert's entries, knows its MoE layers in order and can
apply the next layer's router to a hidden state. :class:`ServedModel` is that view of a
``transformers`` model: its bound experts modules (:class:`~tierstore.hf.backend.ExpertLayer`)
in module order, and each layer's router found beside its experts module, called through
the module itself (a hook on ``transformers``' code, not a copy of it). It also turns the
model's forward calls into the sources' passes: a forward pre-hook begins a pass over the
call's tokens, a forward hook ends it, whatever the call raised.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from .backend import ExpertLayer

TOP_K_FIELDS = ("num_experts_per_tok", "moe_topk", "top_k", "num_experts_per_topk",
                "moe_k", "experts_per_token", "n_activated_experts")


def _find_router(parent: nn.Module, experts: nn.Module, n: int, hidden: int) -> nn.Module | None:
    """The module beside ``experts`` that scores tokens over its ``n`` experts: one with a
    ``[n, hidden]`` weight."""
    for _, child in parent.named_children():
        if child is experts:
            continue
        w = getattr(child, "weight", None)
        if isinstance(w, Tensor) and tuple(w.shape) == (n, hidden):
            return child
    return None


def config_top_k(config: Any) -> int | None:
    """Experts per token, from the config fields the families use for it."""
    configs = [config] + [getattr(config, s) for s in ("text_config",)
                          if getattr(config, s, None) is not None]
    for c in configs:
        for f in TOP_K_FIELDS:
            v = getattr(c, f, None)
            if isinstance(v, int) and v > 0:
                return v
    return None


class ServedModel:
    """See the module docstring. ``layers``: the bound experts modules in module order."""

    def __init__(self, model: nn.Module, layers: Sequence[ExpertLayer],
                 modules: dict[str, nn.Module], device: torch.device, dtype: torch.dtype,
                 expert_shapes: Sequence[Sequence[int]], *,
                 stored_bytes: int | None = None) -> None:
        self.model = model
        self.layers = {layer.key: layer for layer in layers}
        self.moe_layers = [layer.key for layer in layers]
        self.n_experts = layers[0].num_experts
        self.device, self.dtype = device, dtype
        self.top_k = config_top_k(model.config) or 1
        # The MoE layers as one pass runs them (learnt at load): module order, once each,
        # except in looped models, which run some layers again.
        self.visit_order = list(self.moe_layers)
        self._numel = sum(math.prod(s) for s in expert_shapes)
        # Quantized experts: the bytes one takes as stored, which is what the sources fetch
        # and hold (the experts function dequantizes each into a reused buffer).
        self._stored_bytes = stored_bytes
        self.fetch_dtype: torch.dtype | None = None if stored_bytes is not None else dtype
        self._next = {a.key: b.key for a, b in zip(layers, layers[1:])}
        named = dict(model.named_modules())
        hidden = int(getattr(model.config.get_text_config(), "hidden_size", 0) or 0)
        self._routers: dict[int, nn.Module | None] = {}
        for layer in layers:
            experts = modules[layer.module_name]
            parent_name = layer.module_name.rpartition(".")[0]
            parent = named.get(parent_name)
            router = (None if parent is None else
                      _find_router(parent, experts, layer.num_experts, hidden))
            self._routers[layer.key] = router
            if router is not None and not self._callable(layer.key, hidden):
                self._routers[layer.key] = None

    def expert_names(self, layer: int, expert: int) -> tuple[str, ...]:
        return self.layers[layer].entry_names(expert)

    def expert_bytes(self) -> int:
        """Bytes of one expert as the sources hold it: in the compute dtype, or as stored
        where it is quantized."""
        if self._stored_bytes is not None:
            return self._stored_bytes
        return self._numel * torch.empty(0, dtype=self.dtype).element_size()

    def next_moe_layer(self, layer: int) -> int | None:
        return self._next.get(layer)

    @torch.no_grad()
    def router_topk(self, layer: int, x: Tensor) -> tuple[Tensor, Tensor]:
        """``(ids [N, k], weights [N, k])`` MoE layer ``layer``'s router gives hidden states
        ``x``: its own top-k where it returns one, else the top-k of the scores it returns.
        A guess for prefetching, not the layer's routing (a family's group limits or score
        corrections may choose otherwise)."""
        router = self._routers.get(layer)
        if router is None:
            raise ValueError(f"MoE layer {layer} has no router module the backend can call")
        out = router(x.to(router.weight.dtype))
        outs = out if isinstance(out, tuple) else (out,)
        ids = next((t for t in outs if isinstance(t, Tensor) and not t.is_floating_point()
                    and t.dim() == 2), None)
        if ids is not None:
            weights = next((t for t in outs if isinstance(t, Tensor) and t.is_floating_point()
                            and t.shape == ids.shape), torch.ones_like(ids, dtype=torch.float32))
            return ids.long(), weights.float()
        scores = next(t for t in outs if isinstance(t, Tensor) and t.is_floating_point()
                      and t.shape[-1] == self.n_experts)
        w, i = scores.reshape(-1, self.n_experts).float().topk(self.top_k, dim=-1)
        return i, w

    def _callable(self, layer: int, hidden: int) -> bool:
        """Whether the router answers a hidden state alone (some families' routers take
        more arguments from their MoE block: those layers are not predicted)."""
        w = self._routers[layer].weight  # type: ignore[union-attr]
        try:
            ids, _ = self.router_topk(layer, torch.zeros(1, hidden, dtype=w.dtype, device=w.device))
        except Exception:  # noqa: BLE001  (a family's router, any error: no prediction)
            return False
        return ids.shape[0] == 1

    def can_predict(self) -> bool:
        return all(r is not None for r in self._routers.values())


def _tokens(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    ids = kwargs.get("input_ids", args[0] if args else None)
    if isinstance(ids, Tensor):
        return int(ids.numel())
    embeds = kwargs.get("inputs_embeds")
    if isinstance(embeds, Tensor):
        return int(embeds.shape[0] * embeds.shape[1])
    return 1


class Passes:
    """The model's forward calls as passes of the source (see the module docstring)."""

    def __init__(self, model: nn.Module, served: ServedModel) -> None:
        self.served = served
        self.source: Any = None
        self.count = 0
        self._handles = [
            model.register_forward_pre_hook(self._begin, with_kwargs=True),
            model.register_forward_hook(self._end, always_call=True),
        ]

    def _begin(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if self.source is not None:
            self.source.begin_pass(self.served, _tokens(args, kwargs))

    def _end(self, module: nn.Module, args: Any, output: Any) -> None:
        if self.source is not None:
            self.count += 1
            self.source.end_pass()

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
