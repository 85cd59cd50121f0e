"""A pass through a loaded model with narrow zero experts, which reads no store.

It serves two ends. :func:`check_dispatch` runs one token through the model at load time
and checks that every bound experts module was called through the backend: a family whose
experts class is decorated but whose layer computes its experts some other way would
otherwise run them from memory without a word. :func:`warm_up` runs the prompt once before
a generation's clock starts (llama.cpp warms up the same way): a cold process's first pass
pages in the code of every operation, and with a cold page cache each page is a read queued
behind the experts' reads (docs/inference.md).

The zero experts keep every shape but the intermediate width, cut to :data:`WIDTH`, so the
pass runs every kernel a real one runs at a fraction of its compute.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from .backend import ExpertLayer, binding
from .served import ServedModel

WIDTH = 64  # the zero experts' intermediate width


class NarrowExperts:
    """A source whose every expert is zeros :data:`WIDTH` wide (see the module docstring),
    in the compute dtype, never packed (``shapes``: each layer's parameters as
    ``transformers`` holds one expert's)."""

    dequantized = True  # the experts function uses them as they are

    def __init__(self, served: ServedModel, modules: Mapping[int, nn.Module],
                 shapes: Mapping[int, Sequence[Sequence[int]]]) -> None:
        self.weights: dict[int, tuple[Tensor, ...]] = {}
        self.visits: list[int] = []  # the MoE layers in the order passes run them
        kw = {"dtype": served.dtype, "device": served.device}
        for key, layer in served.layers.items():
            module = modules[key]
            self.weights[key] = tuple(torch.zeros(s, **kw)
                                      for s in _narrow(layer.plain(), module, shapes[key]))

    def experts(self, layer: int, ids: list[int], x: Tensor) -> Mapping[int, tuple[Tensor, ...]]:
        self.visits.append(layer)
        w = self.weights[layer]
        return {e: w for e in ids}

    def layer_done(self, layer: int) -> None:
        pass


def _narrow(layer: ExpertLayer, module: nn.Module, shapes: Sequence[Sequence[int]]
            ) -> list[list[int]]:
    """Entry shapes with the intermediate dimension cut so that the widest is WIDTH."""
    transposed = bool(module.is_transposed)
    out: list[list[int]] = []
    i = 0
    inter = None
    for p in layer.params:  # the down projection's inner dimension is the intermediate one
        if p.role == "down":
            s = shapes[i]
            inter = s[0] if transposed else s[1]
        i += len(p.parts)
    ratio = max(1, (inter or WIDTH) // WIDTH)
    i = 0
    for p in layer.params:
        for _ in p.parts:
            s = list(shapes[i])
            i += 1
            if p.role == "up":
                d = 1 if transposed else 0
            elif p.role == "up_bias":
                d = 0
            elif p.role == "down":
                d = 0 if transposed else 1
            else:
                out.append(s)
                continue
            s[d] = max(1, s[d] // ratio)
            out.append(s)
    return out


def _run(model: nn.Module, served: ServedModel, source: Any, ids: Tensor,
         mask: Tensor | None) -> None:
    with _feeding(model, served, source), torch.no_grad():
        model(input_ids=ids, attention_mask=mask, use_cache=False)


@contextlib.contextmanager
def _feeding(model: nn.Module, served: ServedModel, source: Any) -> Iterator[None]:
    """Every experts module fed by ``source`` for the block, and the attached source's
    passes left alone (a warm-up is not one of its passes)."""
    layers = list(served.layers.values())
    saved = [layer.source for layer in layers]
    loaded = getattr(model, "tierstore", None)
    passes = loaded.passes if loaded is not None else None
    saved_pass = passes.source if passes is not None else None
    for layer in layers:
        layer.source = source
    if passes is not None:
        passes.source = None
    try:
        yield
    finally:
        for layer, s in zip(layers, saved):
            layer.source = s
        if passes is not None:
            passes.source = saved_pass


def narrow_source(model: nn.Module, served: ServedModel,
                  shapes: Mapping[int, Sequence[Sequence[int]]]) -> NarrowExperts:
    modules = {b.key: m for m in model.modules() if (b := binding(m)) is not None}
    return NarrowExperts(served, modules, shapes)


def check_dispatch(model: nn.Module, served: ServedModel, source: NarrowExperts,
                   family: str) -> None:
    """Run one token; every bound experts module must have been called through the backend
    (see the module docstring). Learns the experts per token from the call."""
    before = {k: layer.calls for k, layer in served.layers.items()}
    ids = torch.zeros((1, 1), dtype=torch.long, device=served.device)
    source.visits.clear()
    _run(model, served, source, ids, None)
    served.visit_order = list(source.visits)
    missed = [layer.module_name for k, layer in served.layers.items() if layer.calls == before[k]]
    if missed:
        raise NotDispatchedError(
            f"{family}: {missed[0]} computed its experts without calling transformers' experts "
            "interface, so they would run from memory instead of the store; this family "
            "cannot be served")
    ks = {layer.top_k for layer in served.layers.values() if layer.top_k}
    if ks:
        served.top_k = max(ks)


class NotDispatchedError(RuntimeError):
    pass


def warm_up(model: nn.Module, served: ServedModel, source: NarrowExperts, ids: Tensor,
            mask: Tensor | None) -> None:
    """The prompt through the model once, with ``source``'s zero experts."""
    _run(model, served, source, ids, mask)


def _cache_tensors_bytes(cache: Any) -> int:
    total = 0
    for layer in getattr(cache, "layers", []) or []:
        for v in vars(layer).values():
            if isinstance(v, Tensor):
                total += v.numel() * v.element_size()
    return total


def cache_bytes(model: nn.Module, served: ServedModel, source: NarrowExperts) -> tuple[int, int]:
    """``(per position, besides)``: the bytes the family's own cache holds for one sequence,
    measured by running one and two tokens (whatever its layers keep: keys and values,
    MLA's compressed latents, a linear-attention layer's fixed state). A sliding-window
    layer is counted as if it kept every position, a bound."""
    sizes = []
    with _feeding(model, served, source), torch.no_grad():
        for n in (1, 2):
            ids = torch.zeros((1, n), dtype=torch.long, device=served.device)
            out = model(input_ids=ids, use_cache=True)
            cache = getattr(out, "cache", None)
            if cache is None:
                cache = out.past_key_values
            sizes.append(_cache_tensors_bytes(cache))
    per = max(0, sizes[1] - sizes[0])
    return per, max(0, sizes[0] - per)
