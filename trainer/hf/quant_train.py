"""A full fine-tune of a quantized checkpoint (:mod:`tierstore.hf.quant`): the packed
experts become fp32 masters, trained like an unquantized import's, and ``export-hf``
re-quantizes them to the checkpoint's own format.

The first time a store holding packed weights is loaded for training (:func:`build_trainable`;
``tierstore.hf.load(store, trainable=True)`` and ``tierstore train`` of an import), every
packed expert weight is dequantized in fp32, as ``transformers`` dequantizes it, into an
entry of its own beside the packed ones (``…gate_up_proj_fp32``), and so is each FP8 dense
weight of a DeepSeek-style checkpoint (its dense weights are trained as fp32 masters too).
Once every master is durable, one commit of ``model.json`` points the model at them and
records each one's format (``requantize``); only then are the packed entries deleted. A
kill before that commit leaves the packed model as it was (the next load starts over, the
masters it rewrites being the same values); a kill after it leaves packed entries no
model names, which the next trainable load deletes. The ranks of an expert-parallel run
that share a node's store unpack it together, each writing its own experts' masters, under
the same one commit (:func:`_unpack_on_ranks`). From there on the store is an unquantized
import's as the trainer sees it (moments, step counts, both update rules, compute in the
masters' cast to the compute dtype).

``export-hf`` writes each master back packed (:func:`requantize`): MXFP4 as
``quantize_to_mxfp4`` makes it, FP8 as ``Fp8Quantize``; the checkpoint's
``quantization_config`` with them, so ``from_pretrained`` loads the export as it loads the
original. The round trip is lossy: the export states the largest weight error against
the masters (:class:`RoundTrip`) and the logit error it makes (:mod:`.quant_logits`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor, nn

import tierstore

from .layout import MODEL_ENTRY, ExpertsModule, StoredModel, json_entry
from .quant import FP8, SUFFIXES, Dequantizer, as_module_holds, quantize

MASTER = "_fp32"  # the suffix of a master's entry beside its packed ones


def packed(sm: StoredModel) -> bool:
    """Whether the store's model holds packed weights (shipped or quantized at import)."""
    return bool(sm.dense_scales) or any(m.formats for m in sm.experts)


def _transposed(model: nn.Module, m: ExpertsModule) -> bool:
    return bool(getattr(model.get_submodule(m.module), "is_transposed", False))


def write_masters(store: tierstore.Store, sm: StoredModel, model: nn.Module,
                  writes: Callable[[int], bool] | None = None, dense: bool = True) -> None:
    """Put the fp32 master of every packed weight of ``sm`` beside its packed entries
    (nothing names them yet). ``model``: the family's model, for each experts module's
    orientation. ``writes(e)``: whether to write expert ``e`` (of every layer; all by
    default); ``dense``: whether to write the dense weights' masters too."""
    deq = Dequantizer()
    for m in sm.experts:
        transposed = _transposed(model, m)
        params = dict(m.params)
        for e in range(m.num_experts):
            if writes is not None and not writes(e):
                continue
            names = [f"{m.prefix}.{e}.{p}" for a in m.formats for p in params[a]]
            got = store.get_many(names)
            items = []
            for a, fmt in m.formats.items():
                q, s = (got[f"{m.prefix}.{e}.{p}"] for p in params[a])
                w = deq(fmt, q, s, torch.float32, reuse=False)
                items.append((f"{m.prefix}.{e}.{a}{MASTER}",
                              as_module_holds(w, fmt, transposed).contiguous()))
            store.put_many(items)
    if dense:
        for name, scales in sm.dense_scales.items():
            got = store.get_many([sm.dense[name], scales])
            w = deq.fp8(got[sm.dense[name]], got[scales], torch.float32, reuse=False)
            store.put(sm.dense[name] + MASTER, w.clone())
    store.flush()  # every master durable before the model names them


def name_masters(store: tierstore.Store, sm: StoredModel) -> StoredModel:
    """The one commit that points ``sm``'s model at the masters :func:`write_masters`
    wrote (and records each one's format to pack it in again), then the packed entries
    dropped; returns the model committed."""
    requant: dict[str, str] = {}
    experts = []
    for m in sm.experts:
        for a, fmt in m.formats.items():
            requant[f"{m.module}.{a}" if m.module else a] = fmt
        experts.append(replace(m, params=[(a, [a + MASTER] if a in m.formats else parts)
                                          for a, parts in m.params], formats={}))
    dense = dict(sm.dense)
    for name in sm.dense_scales:
        dense[name] = sm.dense[name] + MASTER
        requant[name] = FP8
    if sm.quantized_at_import:
        requant = {}  # the checkpoint's own format is its unquantized one
    out = replace(sm, experts=experts, dense=dense, dense_scales={}, requantize=requant)
    store.put(MODEL_ENTRY[0], json_entry(out.to_json()), kind=MODEL_ENTRY[1])
    store.flush()
    drop_packed(store, out)
    return out


def unpack(store: tierstore.Store, sm: StoredModel, model: nn.Module) -> StoredModel:
    """Give every packed weight of ``sm`` an fp32 master and commit the model that names
    them (see the module docstring); returns it."""
    write_masters(store, sm, model)
    return name_masters(store, sm)


def drop_packed(store: tierstore.Store, sm: StoredModel) -> None:
    """Delete the packed entries beside ``sm``'s masters, which it no longer names."""
    suffixes = {x for pair in SUFFIXES.values() for x in pair}
    gone = []
    for m in sm.experts:
        for a, parts in m.params:
            if parts == [a + MASTER]:
                gone += [f"{m.prefix}.{e}.{a}{x}" for e in range(m.num_experts) for x in suffixes]
    for entry in sm.dense.values():
        if entry.endswith(MASTER):
            base = entry[: -len(MASTER)]
            gone += [base, base + SUFFIXES[FP8][1]]
    found = [name for name in gone if name in store]
    for name in found:
        store.delete(name)
    if found:
        store.flush()


def build_trainable(store: tierstore.Store, owns: bool, device: torch.device,
                    world: Any = None) -> tuple[nn.Module, Any]:
    """``loader.build`` in fp32 for training: a store of packed weights is unpacked first
    (once), and the model built over its masters. ``world``: this rank's place in an
    expert-parallel run (:class:`~tierstore.trainer.dist.world.World`), whose ranks unpack
    their node's store together (:func:`_unpack_on_ranks`)."""
    from .loader import build

    model, loaded = build(store, owns, device=device, dtype=torch.float32)
    if not packed(loaded.stored):
        if world is None or world.is_node_leader:
            drop_packed(store, loaded.stored)  # left by a kill after the commit, if any
        return model, loaded
    if world is None:
        unpack(store, loaded.stored, model)
    else:
        _unpack_on_ranks(store, loaded.stored, model, world)
    loaded.passes.remove()
    return build(store, owns, device=device, dtype=torch.float32)


def _unpack_on_ranks(store: tierstore.Store, sm: StoredModel, model: nn.Module,
                     world: Any) -> None:
    """:func:`unpack` shared by the ranks of a node's store: each rank writes the masters
    of the experts it owns, and the experts no rank of its node owns are shared out among
    the node's ranks (every node's store keeps all its experts, as an unquantized import's
    does); the node leader writes the dense masters. Once every rank's are durable (a
    barrier), the node leader's one commit names them all; a second barrier holds the
    ranks until it is made. Every rank sees the same store at the first barrier, so all
    take this path or none; a kill before the commit leaves the packed model, which the
    next start unpacks again."""
    from tierstore.trainer.dist.world import barrier, owner

    local = world.nodes[world.node]

    def writes(e: int, n: int) -> bool:
        o = owner(e, n, world.size)
        return (o if o in local else local[e % len(local)]) == world.rank

    for m in sm.experts:  # one module at a time: each may have its own expert count
        write_masters(store, replace(sm, experts=[m], dense_scales={}), model,
                      lambda e, n=m.num_experts: writes(e, n), dense=False)
    if world.is_node_leader:
        write_masters(store, replace(sm, experts=[]), model)
    barrier(world)
    if world.is_node_leader:
        name_masters(store, sm)
    barrier(world)


@dataclass
class RoundTrip:
    """The error of writing fp32 masters back packed: the largest absolute difference
    between a master and its packed value dequantized, and the largest master."""

    max_abs_error: float = 0.0
    max_abs_master: float = 0.0

    @property
    def relative(self) -> float:
        return self.max_abs_error / self.max_abs_master if self.max_abs_master else 0.0

    def add(self, master: Tensor, again: Tensor) -> None:
        self.max_abs_error = max(self.max_abs_error, float((again - master).abs().max()))
        self.max_abs_master = max(self.max_abs_master, float(master.abs().max()))

    def to_json(self) -> dict[str, float]:
        return {"max_abs_weight_error": self.max_abs_error,
                "max_abs_master": self.max_abs_master, "relative": self.relative}


def requantize(fmt: str, master: Tensor, transposed: bool, part: int,
               error: RoundTrip | None = None) -> Tensor:
    """``master`` (fp32, as its module holds it) packed in ``fmt``: the packed tensor
    (``part`` 0) or its scales (1). ``error`` takes the round trip's error."""
    q, s = quantize(fmt, master, transposed)
    if error is not None and part == 0:
        w = Dequantizer()(fmt, q, s, torch.float32, reuse=False)
        error.add(master.to(torch.float32), as_module_holds(w, fmt, transposed))
    return q if part == 0 else s
