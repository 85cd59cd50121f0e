"""``tierstore.hf.load``: a stored model as its own ``transformers`` class, its experts in
the store.

The model is built on the meta device with the ``tierstore`` experts implementation. Each
experts module is bound to its entries (:func:`tierstore.hf.backend.bind`) and loses its
fused expert parameters, which are never allocated; only the dense weights are read, from
the store, and assigned as they are. What is still on meta afterwards (non-persistent
buffers such as rotary tables) is made on the device and initialised by ``transformers``'
own ``initialize_weights``, which skips everything loaded. The source that feeds the
experts (the mode) is attached by :mod:`tierstore.hf.strategies`.
"""

from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

import tierstore

from .backend import IMPLEMENTATION, ROLES, ExpertLayer, ExpertParam, bind
from .config import FLOAT_DTYPES, hf_config, meta_model
from .families import UnservedFamilyError, check_served
from .layout import StoredModel, stored_model
from .quant import FP8, MXFP4, Dequantizer
from .served import Passes, ServedModel
from .warmup import NotDispatchedError, check_dispatch, narrow_source

QUANT_FORMATS = (MXFP4, FP8)
_LAYER_NUMBER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def open_store(store: str | os.PathLike[str] | tierstore.Store, *,
               host_cache: int | str | None = None,
               device_budget: int | str | None = None) -> tuple[tierstore.Store, bool]:
    """``store`` opened: a store directory (``tierstore.open``), a daemon's socket
    (``tierstore.connect``) or an open store; and whether the caller owns it (closes it)."""
    if isinstance(store, tierstore.Store):
        return store, False
    path = os.fspath(store)
    kw: dict[str, Any] = {}
    if device_budget is not None:
        kw["device_budget"] = device_budget
    try:
        is_socket = stat.S_ISSOCK(os.stat(path).st_mode)
    except OSError:
        is_socket = False
    if is_socket:
        return tierstore.connect(path, **kw), True
    if host_cache is not None:
        kw["host_cache"] = host_cache
    return tierstore.open(path, **kw), True


def dtype_of(name: str | torch.dtype | None) -> torch.dtype | None:
    if name is None or isinstance(name, torch.dtype):
        return name
    try:
        return FLOAT_DTYPES[str(name).removeprefix("torch.")]
    except KeyError:
        raise tierstore.StoreError(f"unsupported dtype {name!r}; use one of "
                                   f"{', '.join(sorted(FLOAT_DTYPES))}") from None


def _layer_keys(names: list[str]) -> list[int]:
    """Each experts module's key for the sources: its decoder layer's number where every
    module has a distinct one, else its position."""
    nums = [_LAYER_NUMBER.search(n + ".") for n in names]
    keys = [int(m.group(1)) for m in nums if m]
    if len(keys) == len(names) and len(set(keys)) == len(keys):
        return keys
    return list(range(len(names)))


@dataclass
class Loaded:
    """A loaded model's tierstore side: the store, the served view, and the source."""

    store: tierstore.Store
    owns_store: bool
    stored: StoredModel
    served: ServedModel
    passes: Passes
    source: Any = None
    mode: str = ""
    notes: list[str] = field(default_factory=list)
    narrow: Any = None  # zero experts for a warm-up pass (tierstore.hf.warmup)
    experts: Any = None  # the trainer's ExpertStates, once attach_trainable gave them
    # An expert-parallel source (tierstore.trainer.dist.hf_parallel) between the experts
    # modules and ``experts``, which then holds this rank's own experts only.
    parallel: Any = None
    hot: Any = None  # quantized experts kept dequantized (tierstore.hf.hot_experts)

    def keep_dequantized(self, nbytes: int) -> None:
        """Keep up to ``nbytes`` of the hottest quantized experts dequantized, for the
        source attached now (:class:`tierstore.hf.hot_experts.HotExperts`); 0 keeps none."""
        from .hot_experts import HotExperts

        self.hot = HotExperts(nbytes) if nbytes > 0 else None
        for layer in self.served.layers.values():
            layer.hot = self.hot if layer.quantized else None
        if self.hot is not None:
            self.hot.bind(self.source)

    def attach(self, source: Any, mode: str, *, close_previous: bool = True) -> None:
        """Feed every experts module from ``source`` (closing the one before, unless
        ``close_previous`` is false: the caller keeps and closes it)."""
        if close_previous and self.source is not None and self.source is not source:
            self.source.close()
        self.source, self.mode = source, mode
        if self.hot is not None:
            self.hot.bind(source)
        self.swap_source(source)
        source.prepare(self.served)

    def detach(self) -> None:
        """Forget the source without closing it (its owner does)."""
        self.source, self.mode = None, ""
        if self.hot is not None:
            self.hot.bind(None)
        self.swap_source(None)

    def swap_source(self, source: Any) -> None:
        """Feed the experts from ``source`` without preparing it or closing the one before
        (a wrapper around the attached source, for one generation)."""
        self.passes.source = source
        for layer in self.served.layers.values():
            layer.source = source

    def attach_trainable(self, states: Any, parallel: Any = None) -> None:
        """Train the experts: feed every experts module from a trainer's expert states
        (:class:`tierstore.trainer.ExpertStates`), whose experts are fp32 leaves that
        require grad, shared by a step's micro-batches and by recomputations, and put the
        model in training mode. The experts function is the same: autograd gives each
        routed expert's weight gradient, and the router's through ``top_k_weights``. The
        inference source, if any, is closed; forward calls are no longer passes of one.
        ``experts`` keeps the states (:meth:`close` closes them). ``parallel``: an
        expert-parallel source the experts modules call instead, which computes this rank's
        own experts from ``states``."""
        if self.source is not None:
            self.source.close()
            self.source = None
        if self.hot is not None:
            self.hot.bind(None)
        self.mode = "train"
        self.experts, self.parallel = states, parallel
        self.passes.source = None
        for layer in self.served.layers.values():
            layer.source = states if parallel is None else parallel
        self.served.model.train()

    def stats(self) -> dict[str, Any]:
        out = dict(self.source.stats()) if self.source is not None else {}
        if self.hot is not None:
            out["dequantized_cache"] = self.hot.stats()
        return out

    def close(self) -> None:
        """Give back what the source (or the trainable experts) hold and close the store if
        ``load`` opened it."""
        if self.source is not None:
            self.source.close()
            self.source = None
        if self.parallel is not None:  # its fetch thread first: it uses the states
            self.parallel.close()
            self.parallel = None
        if self.hot is not None:
            self.hot.bind(None)
        if self.experts is not None:
            self.experts.close()
            self.experts = None
        self.passes.remove()
        if self.owns_store:
            self.store.close()


def build(store: tierstore.Store, owns: bool, *, device: torch.device,
          dtype: torch.dtype | None) -> tuple[nn.Module, Loaded]:
    """The model with its dense weights loaded and its experts modules bound (no source
    attached yet)."""
    sm = stored_model(store)
    where = f"store {store.path}"
    config = hf_config(sm.hf_config, where)
    dt = dtype or dtype_of(sm.dtype) or torch.float32
    model = meta_model(config, sm.family, experts_implementation=IMPLEMENTATION, dtype=dt)
    try:
        modules = dict(check_served(model, sm.family))
    except UnservedFamilyError as e:
        raise tierstore.StoreError(str(e)) from e
    stored_names = [m.module for m in sm.experts]
    if sorted(stored_names) != sorted(modules):
        raise tierstore.StoreError(
            f"{where}: the stored experts ({len(stored_names)} modules) do not match the "
            f"{sm.family} model's ({len(modules)}); import the checkpoint again")
    if sm.quant not in (None, *QUANT_FORMATS):
        raise tierstore.StoreError(f"{where}: its model is quantized as {sm.quant!r}, which this "
                                   "release does not read; import the checkpoint again")
    keys = _layer_keys(stored_names)
    layers: list[ExpertLayer] = []
    shapes: list[list[int]] = []
    logical: dict[int, list[list[int]]] = {}  # quantized layers: one expert as transformers holds it
    dequantizer = Dequantizer()  # one set of reused buffers for every layer
    for key, m in zip(keys, sm.experts):
        module = modules[m.module]
        unknown = [a for a, p in module.named_parameters(recurse=False)
                   if p.dim() >= 1 and p.shape[0] == m.num_experts and a not in ROLES]
        if unknown:
            raise tierstore.StoreError(
                f"{sm.family}: {m.module} has a per-expert parameter {unknown[0]} the tierstore "
                "backend does not know how to apply")
        params = tuple(ExpertParam(a, tuple(parts), m.formats.get(a)) for a, parts in m.params)
        layer = ExpertLayer(key, m.module, m.prefix, params, m.num_experts)
        if layer.quantized:
            layer.dtype, layer.dequantizer = dt, dequantizer
            layer.transposed = bool(getattr(module, "is_transposed", False))
            logical[key] = [list(getattr(module, a).shape[1:]) for a, _ in m.params]
        if not shapes:
            shapes = [list(getattr(module, a).shape[1:]) for a, _ in m.params]
        for a, _ in m.params:
            delattr(module, a)  # never allocated: the store holds them
        module._is_hf_initialized = True
        bind(module, layer)
        layers.append(layer)
    if len({layer.num_experts for layer in layers}) > 1:
        raise tierstore.StoreError(f"{sm.family}: MoE layers with different numbers of experts "
                                   "are not served yet")
    _load_dense(model, store, sm, where)
    if sm.generation_config:
        from transformers import GenerationConfig

        model.generation_config = GenerationConfig.from_dict(sm.generation_config)
    model.to(device)
    model.eval()
    stored = sum(store.info(n).nbytes for n in layers[0].entry_names(0)) \
        if layers[0].quantized else None
    served = ServedModel(model, layers, modules, device, dt, shapes, stored_bytes=stored)
    entry_shapes = {layer.key: logical.get(layer.key) or
                    [list(store.info(n).shape) for n in layer.entry_names(0)]
                    for layer in layers}
    narrow = narrow_source(model, served, entry_shapes)
    try:
        check_dispatch(model, served, narrow, sm.family)
    except NotDispatchedError as e:
        raise tierstore.StoreError(str(e)) from e
    loaded = Loaded(store, owns, sm, served, Passes(model, served), narrow=narrow)
    model.tierstore = loaded
    return model, loaded


def _load_dense(model: nn.Module, store: tierstore.Store, sm: StoredModel, where: str) -> None:
    """Assign the dense weights (cast to the dtype ``transformers`` built each one in), the
    stored zeros, then make and initialise whatever is still on meta."""
    want = model.state_dict()
    if sm.dense_state is not None:
        state = dict(sm.dense_state)
    else:
        got = store.get_many(list(sm.dense.values()))
        state = {name: got[entry] for name, entry in sm.dense.items()}
    for name, shape in sm.zeros.items():
        state[name] = torch.zeros(shape)
    stray = sorted(set(state) - set(want))
    if stray:
        raise tierstore.StoreError(f"{where}: dense weight {stray[0]} has no place in the "
                                   f"{sm.family} model; import the checkpoint again")
    if sm.dense_scales:  # fp8 weights kept packed: dequantized here, as transformers does
        scales = store.get_many(sorted(set(sm.dense_scales.values())))
        deq = Dequantizer()
        for name, entry in sm.dense_scales.items():
            if name not in state:
                continue
            try:
                state[name] = deq.fp8(state[name], scales[entry], want[name].dtype, reuse=False)
            except (RuntimeError, ValueError) as e:
                raise tierstore.StoreError(f"{where}: the fp8 weight {name} does not fit its "
                                           f"scales {entry}: {e}") from e
    for name, t in state.items():
        if tuple(t.shape) != tuple(want[name].shape):
            raise tierstore.StoreError(f"{where}: dense weight {name} is {list(t.shape)}, the "
                                       f"model needs {list(want[name].shape)}")
        state[name] = t.to(dtype=want[name].dtype)
    model.load_state_dict(state, strict=False, assign=True)
    loaded = set(state)
    for name, p in [*model.named_parameters(), *model.named_buffers()]:
        if name in loaded:
            p._is_hf_initialized = True
    # Still on meta: non-persistent buffers (rotary tables) and anything the checkpoint
    # left to initialisation. Real memory for them, then transformers' own initialisation.
    tied = set(getattr(model, "all_tied_weights_keys", {}) or {})
    lacking = []
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if t.device.type != "meta":
            continue
        owner_name, _, attr = name.rpartition(".")
        owner = model.get_submodule(owner_name)
        if attr in owner._buffers:
            owner._buffers[attr] = torch.empty_like(t, device="cpu")
        elif name not in tied:
            lacking.append(name)
    if lacking:
        raise tierstore.StoreError(f"{where}: the store lacks the dense weight {lacking[0]}; "
                                   "import the checkpoint again")
    model.initialize_weights()
    model.tie_weights()
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()]
            if t.device.type == "meta"]
    if left:
        raise tierstore.StoreError(f"{where}: {left[0]} could not be loaded or initialised")
