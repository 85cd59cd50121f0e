"""``export-hf`` of a store imported compact (:mod:`tierstore.hf.quant`): each quantized
parameter is written back as the checkpoint shipped it, its packed tensor and its scales
byte for byte, under the checkpoint's names (``…_blocks`` / ``…_scales`` for MXFP4,
``…weight`` / ``…weight_scale_inv`` for FP8), beside the ``quantization_config`` of the
stored ``config.json``.

Every reversed group (:mod:`tierstore.hf.reverse`) whose sources are quantized becomes two:
the same reversed converter run over the packed tensors, then over the scales, each planned
on meta tensors of the shapes the store holds them in, one expert at a time where the
logical group is. Stacking, splitting and chunking along whole blocks keep each scale over
its own block, as on import.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import Tensor

import tierstore

from .outdir import HFExportError
from .quant import FP8, MXFP4, PACKED_DTYPES, SCALE_DTYPES, packed_shapes
from .quant_train import requantize
from .reverse import Group, Output, ReversePlan, _per_expert, run

# How a logical output's name becomes the packed tensor's and the scales'.
NAMES = {MXFP4: ("{}_blocks", "{}_scales"), FP8: ("{}", "{}_scale_inv")}


class PackedValues:
    """The stored packed tensors (``part`` 0) or scales (``part`` 1) of quantized
    parameters, as the exporter's values give logical ones (``_Values``); of a fine-tuned
    one, its fp32 master packed again (:func:`~tierstore.hf.quant_train.requantize`), the
    round trip's error gathered in ``values.round_trip``."""

    def __init__(self, values: Any, part: int) -> None:
        self.values, self.part = values, part

    def _master(self, name: str, entry: str, transposed: bool,
                owner: tierstore.Store | None = None) -> Tensor:
        w = self.values._get([entry], owner)[entry]  # owner: the store that trained it
        fmt = self.values.sm.requantize[name]
        return requantize(fmt, w, transposed, self.part, self.values.round_trip)

    def entry(self, name: str, e: int) -> str:
        m, parts, _ = self.values.experts[name]
        return f"{m.prefix}.{e}.{parts[self.part]}"

    def dense_entry(self, name: str) -> str:
        sm = self.values.sm
        return sm.dense[name] if self.part == 0 else sm.dense_scales[name]

    def expert(self, names: list[str], e: int) -> dict[str, Tensor]:
        if self.values.sm.requantize:
            m, parts, out_dim = self.values.experts[names[0]]
            owner = self.values.owners.get((m.prefix, e))
            return {n: self._master(n, f"{m.prefix}.{e}.{self.values.experts[n][1][0]}",
                                    self.values.experts[n][2] == -1, owner).unsqueeze(0)
                    for n in names}
        entries = {n: self.entry(n, e) for n in names}
        got = self.values._get(list(entries.values()))
        return {n: got[x].unsqueeze(0) for n, x in entries.items()}

    def value(self, name: str) -> Tensor:
        if name in self.values.experts:
            n = self.values.experts[name][0].num_experts
            return torch.cat([self.expert([name], e)[name] for e in range(n)])
        if self.values.sm.requantize:
            return self._master(name, self.values.sm.dense[name], False)
        entry = self.dense_entry(name)
        return self.values._get([entry])[entry]


def _format(values: Any, name: str) -> str | None:
    if values.sm.requantize:
        return values.sm.requantize.get(name)
    got = values.experts.get(name)
    if got is not None:
        m, _, _ = got
        attr = name[len(m.module) + 1:] if m.module else name
        return m.formats.get(attr)
    return FP8 if name in values.sm.dense_scales else None


def _meta(store: tierstore.Store, packed: PackedValues, name: str) -> Tensor:
    """A meta tensor of what the store holds for ``name`` (over every expert if fused), or
    of a fine-tuned one, what packing its master makes."""
    sm = packed.values.sm
    if sm.requantize:
        fmt = sm.requantize[name]
        dtype = (PACKED_DTYPES if packed.part == 0 else SCALE_DTYPES)[fmt]
        if name in packed.values.experts:
            m, parts, out_dim = packed.values.experts[name]
            logical = list(store.info(f"{m.prefix}.0.{parts[0]}").shape)
            shape = packed_shapes(fmt, logical, out_dim == -1)[packed.part]
            return torch.empty((m.num_experts, *shape), dtype=dtype, device="meta")
        shape = packed_shapes(fmt, list(store.info(sm.dense[name]).shape))[packed.part]
        return torch.empty(tuple(shape), dtype=dtype, device="meta")
    if name in packed.values.experts:
        info = store.info(packed.entry(name, 0))
        n = packed.values.experts[name][0].num_experts
        return torch.empty((n, *info.shape), dtype=info.dtype, device="meta")
    info = store.info(packed.dense_entry(name))
    return torch.empty(tuple(info.shape), dtype=info.dtype, device="meta")


def expand(plan: ReversePlan, values: Any, store: tierstore.Store) -> None:
    """Replace every group of quantized sources in ``plan`` by its packed and scales
    groups (see the module docstring)."""
    groups: list[Group] = []
    for g in plan.groups:
        fmts = {_format(values, n) for n in g.source_names()}
        if fmts == {None}:
            groups.append(g)
            continue
        if len(fmts) > 1:
            raise HFExportError(f"store {store.path}: {g.source_names()[0]} is exported together "
                                "with tensors of another format; import the checkpoint again")
        (fmt,) = fmts
        assert fmt is not None
        for part in (0, 1):
            sub = Group(g.key, copy.deepcopy(g.transform), list(g.sources), part=part)
            packed = PackedValues(values, part)
            meta = {n: _meta(store, packed, n) for n in sub.source_names()}
            whole = run(sub, plan, meta)
            if not _per_expert(sub, plan, meta, whole):
                sub.outputs = [Output(k, tuple(t.shape), t.dtype) for k, t in whole.items()]
            pattern = NAMES[fmt][part]
            for o in sub.outputs:
                sub.renamed[o.name] = pattern.format(o.name)
                o.name, o.packed = sub.renamed[o.name], True
            for per in sub.expert_names:
                for raw in per:
                    per[raw] = pattern.format(per[raw])
            groups.append(sub)
    plan.groups = groups
