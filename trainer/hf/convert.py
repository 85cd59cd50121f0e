"""A checkpoint's tensors as the model's parameters, through ``transformers``' own mapping.

``transformers`` 5 loads a checkpoint through a list of weight transforms for the family
(``conversion_mapping.get_model_conversion_mapping``): renamings, and converters whose
operations build a fused parameter from checkpoint tensors (``MergeModulelist`` stacks the
experts, ``Concatenate`` joins gate and up, ``Transpose``, ``Interleave``, ``Chunk``,
``Split``). :func:`plan` sorts a checkpoint's tensor names with that list
(``core_model_loading.rename_source_key``, the loader's own function) into

* dense groups, converted as ``transformers`` converts them, whole;
* expert groups: the sources of one fused expert parameter ``[E, ...]``, converted one
  expert at a time by the same converter: a per-expert source (its ``*`` is the expert
  number) contributes that expert's tensor, a source already fused over the experts its
  ``[e:e+1]`` slice, and the operations then make ``[1, ...]``: expert ``e``'s slice of the
  parameter, never the layer's. That is exact only for operations that keep experts apart:
  :data:`PER_EXPERT_OPS`, each on a dimension past the experts'; any other is refused.

Shapes are checked by running the same conversions on meta tensors of the headers' shapes
before a byte is read.
"""

from __future__ import annotations

import copy
import functools
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from .checkpoint import HFImportError

# Operation class name -> whether it keeps experts apart given its dimension(s).
PER_EXPERT_OPS: dict[str, Callable[[Any], bool]] = {
    "MergeModulelist": lambda op: op.dim == 0,  # stacks the experts (dim 0 is theirs)
    "Concatenate": lambda op: op.dim >= 1,
    "Chunk": lambda op: op.dim >= 1,
    "Split": lambda op: op.dim >= 1,
    "Interleave": lambda op: op.dim >= 1,
    "Transpose": lambda op: min(op.dim0, op.dim1) >= 1,
    # Dequantizes experts [E, ...] with per-expert scales indexed along dim 0 (and hands a
    # lone tensor through): an [e:e+1] slice of each source gives expert e's values.
    "Inkling2LoopDequantizeExperts": lambda op: True,
}


@dataclass
class ExpertParam:
    """A fused expert parameter of the model: ``model.layers.3.mlp.experts.gate_up_proj``."""

    name: str
    module: str  # the experts module's qualified name
    attr: str
    shape: tuple[int, ...]  # [E, ...]


@dataclass
class Source:
    """One checkpoint tensor of a group."""

    key: str
    pattern: str  # the converter's source pattern it matched (the key itself for a rename)
    expert: int | None = None  # per-expert sources: the expert it holds
    fused: bool = False  # a tensor over every expert (sliced per expert)


@dataclass
class Group:
    """The checkpoint tensors that make one parameter (or, for a one-to-many converter,
    several), and the transform ``transformers`` would make them with."""

    target: str  # transformers' first target name
    transform: Any  # a WeightConverter, or None for a plain rename
    sources: list[Source] = field(default_factory=list)

    def source_keys(self) -> list[str]:
        return [s.key for s in self.sources]


@dataclass
class Plan:
    dense: dict[str, Group]
    experts: dict[str, Group]  # fused expert parameter name -> its group
    expert_params: dict[str, ExpertParam]
    unexpected: list[str]  # checkpoint tensors the model has no place for (transformers skips them)


def expert_params(model: nn.Module, modules: Iterable[tuple[str, nn.Module]]
                  ) -> dict[str, ExpertParam]:
    """Every fused per-expert parameter (leading dimension the module's ``num_experts``)."""
    out = {}
    for mname, m in modules:
        n = int(m.num_experts)
        for attr, p in m.named_parameters(recurse=False):
            if p.dim() >= 1 and p.shape[0] == n:
                name = f"{mname}.{attr}" if mname else attr
                out[name] = ExpertParam(name, mname, attr, tuple(p.shape))
    return out


def _expert_of(pattern: str, key: str) -> int | None:
    """The expert number a per-expert source holds: what the pattern's ``*`` matched."""
    if "*" not in pattern:
        return None
    rx = pattern.replace("*", r"(?P<tsexpert>\d+)", 1).replace("*", r"\d+")
    m = re.search(rx, key)
    return int(m.group("tsexpert")) if m else None


def plan(model: nn.Module, family: str, keys: Iterable[str],
         shapes: dict[str, list[int]], params: dict[str, ExpertParam]) -> Plan:
    """Sort the checkpoint's tensor names (see the module docstring)."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import (
        WeightConverter,
        WeightRenaming,
        dot_natural_key,
        rename_source_key,
    )

    mapping = get_model_conversion_mapping(model)
    renamings = [t for t in mapping if isinstance(t, WeightRenaming)]
    converters = [t for t in mapping if isinstance(t, WeightConverter)]
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    meta = model.state_dict()
    prefix = getattr(model, "base_model_prefix", None)
    dense: dict[str, Group] = {}
    experts: dict[str, Group] = {}
    unexpected: list[str] = []
    for key in sorted(keys, key=dot_natural_key):
        target, pattern = rename_source_key(key, renamings, converters, prefix, meta)
        if target not in meta and key in meta:
            target, pattern = rename_source_key(key, [], [], prefix, meta)
        if target not in meta and target not in params:
            unexpected.append(key)
            continue
        transform = by_pattern[pattern] if pattern is not None else None
        groups = experts if target in params else dense
        group = groups.get(target)
        if group is None:
            group = groups[target] = Group(target, copy.deepcopy(transform))
        src = Source(key, pattern if pattern is not None else key)
        if target in params:
            src.expert = _expert_of(src.pattern, key) if transform is not None else None
            src.fused = src.expert is None
            if src.fused and (not shapes[key] or shapes[key][0] != params[target].shape[0]):
                raise HFImportError(
                    f"{family}: checkpoint tensor {key} {shapes[key]} maps to {target} "
                    f"{list(params[target].shape)} but is neither one expert's nor "
                    f"{params[target].shape[0]} experts'")
        group.sources.append(src)
    for group in experts.values():
        _check_per_expert(family, group)
    return Plan(dense, experts, params, unexpected)


def _check_per_expert(family: str, group: Group) -> None:
    ops = getattr(group.transform, "operations", [])
    for op in ops:
        ok = PER_EXPERT_OPS.get(type(op).__name__)
        if ok is None:
            raise HFImportError(
                f"{family}: transformers' mapping builds {group.target} with {type(op).__name__}, "
                "an operation the importer does not understand (it converts experts one at a "
                "time); this checkpoint cannot be imported")
        if not ok(op):
            raise HFImportError(
                f"{family}: transformers' mapping builds {group.target} with {op!r}, which "
                "mixes experts; this checkpoint cannot be imported one expert at a time")
    per = [s for s in group.sources if not s.fused]
    if per and not any(type(op).__name__ == "MergeModulelist" for op in ops):
        raise HFImportError(f"{family}: per-expert tensors {per[0].key} map to {group.target} "
                            "without being stacked; this checkpoint cannot be imported")


class _OneExpert:
    """The model as an operation asking for a parameter's shape sees it while one expert is
    converted: fused expert parameters one expert wide."""

    def __init__(self, model: nn.Module, params: dict[str, ExpertParam]) -> None:
        self._model, self._params = model, params

    def get_parameter(self, name: str) -> Tensor:
        p = self._params.get(name)
        if p is not None:
            return torch.empty((1, *p.shape[1:]), device="meta")
        return self._model.get_parameter(name)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)


def _run(group: Group, model: Any, config: Any,
         tensors: dict[str, list[Callable[[], Tensor]]]) -> dict[str, Tensor]:
    """``group``'s transform over ``tensors`` (source pattern -> loaders), as transformers
    runs it; a plain rename hands its one tensor through."""
    if group.transform is None:
        (only,) = [t for ts in tensors.values() for t in ts]
        return {group.target: only()}
    conv = copy.deepcopy(group.transform)
    for pattern, loaders in tensors.items():
        for load in loaders:
            conv.add_tensor(group.target, pattern, pattern, load)
    out = conv.convert(group.target, model=model, config=config)
    return {k: (v[0] if isinstance(v, list) else v) for k, v in out.items()}


def convert_dense(group: Group, model: nn.Module, load: Callable[[str], Tensor]
                  ) -> dict[str, Tensor]:
    """A dense group's parameters, as ``transformers`` makes them."""
    tensors: dict[str, list[Callable[[], Tensor]]] = {}
    for s in group.sources:
        tensors.setdefault(s.pattern, []).append(functools.partial(load, s.key))
    return _run(group, model, model.config, tensors)


def convert_expert(group: Group, plan_: Plan, model: nn.Module, e: int,
                   load: Callable[[str], Tensor], load_slice: Callable[[str, int], Tensor]
                   ) -> dict[str, Tensor]:
    """Expert ``e``'s slice of each parameter ``group`` makes (``[...]``, the expert
    dimension gone)."""
    tensors: dict[str, list[Callable[[], Tensor]]] = {}
    for s in group.sources:
        if s.fused:
            tensors.setdefault(s.pattern, []).append(functools.partial(load_slice, s.key, e))
        elif s.expert == e:
            tensors.setdefault(s.pattern, []).append(functools.partial(load, s.key))
    if group.transform is None:
        out = {group.target: next(iter(tensors.values()))[0]()}
    else:
        out = _run(group, _OneExpert(model, plan_.expert_params), model.config, tensors)
    return {k: v[0] for k, v in out.items()}


def experts_held(group: Group) -> dict[str, set[int]]:
    """The experts each source pattern of a group holds per expert (fused sources, which
    hold all of them, are left out)."""
    held: dict[str, set[int]] = {}
    for s in group.sources:
        if not s.fused and s.expert is not None:
            held.setdefault(s.pattern, set()).add(s.expert)
    return held


def check_shapes(p: Plan, model: nn.Module, family: str,
                 headers: dict[str, tuple[list[int], torch.dtype]]) -> None:
    """Every group converted on meta tensors of the checkpoint's shapes gives the model's
    shapes, every expert of every expert parameter is there, and every dense parameter the
    model needs (tied ones aside) is made by some group."""
    def meta(k: str) -> Tensor:
        shape, dtype = headers[k]
        return torch.empty(shape, dtype=dtype, device="meta")

    def meta_slice(k: str, e: int) -> Tensor:
        shape, dtype = headers[k]
        return torch.empty((1, *shape[1:]), dtype=dtype, device="meta")

    fix = "fix config.json or use the weights it belongs to"
    want = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    made: set[str] = set()
    for group in p.dense.values():
        try:
            out = convert_dense(group, model, meta)
        except HFImportError:
            raise
        except Exception as e:  # noqa: BLE001  (any op's failure is the checkpoint's)
            raise HFImportError(f"{family}: converting {group.source_keys()[0]} to {group.target} "
                                f"failed: {e}; {fix}") from e
        for name, t in out.items():
            if name in want and tuple(t.shape) != want[name]:
                raise HFImportError(f"{family}: checkpoint's {group.source_keys()[0]} makes {name} of "
                                    f"shape {list(t.shape)}, the config implies "
                                    f"{list(want[name])}; {fix}")
            made.add(name)
    for param, group in p.experts.items():
        n = p.expert_params[param].shape[0]
        # One expert is converted on meta below: every other expert's tensor of the same
        # pattern must have its shape.
        first: dict[str, Source] = {}
        for s in group.sources:
            ref = first.setdefault(s.pattern, s)
            if headers[s.key][0] != headers[ref.key][0]:
                raise HFImportError(f"{family}: checkpoint tensor {s.key} has shape "
                                    f"{headers[s.key][0]}, its peers such as {ref.key} "
                                    f"{headers[ref.key][0]}; {fix}")
        for pattern, held in experts_held(group).items():
            if held != set(range(n)):
                lacking = sorted(set(range(n)) - held)
                what = f"lacks expert {lacking[0]}" if lacking else f"holds {len(held)} experts"
                raise HFImportError(f"{family}: the checkpoint {what} of {param} ({pattern}; "
                                    f"{n} experts in the config); {fix}")

        try:
            out = convert_expert(group, p, model, 0, meta, meta_slice)
        except HFImportError:
            raise
        except Exception as e:  # noqa: BLE001
            raise HFImportError(f"{family}: converting {group.source_keys()[0]} to {param} failed: "
                                f"{e}; {fix}") from e
        for name, t in out.items():
            exp = p.expert_params.get(name)
            if exp is None or tuple(t.shape) != exp.shape[1:]:
                shape = list(exp.shape[1:]) if exp else "no expert parameter"
                raise HFImportError(f"{family}: checkpoint's {group.source_keys()[0]} makes one "
                                    f"expert of {name} {list(t.shape)}, the config implies "
                                    f"{shape}; {fix}")
            made.add(name)
    tied = set(getattr(model, "all_tied_weights_keys", {}) or {})
    missing = sorted(k for k in want if k not in made and k not in tied)
    if missing:
        raise HFImportError(f"{family}: the checkpoint lacks {missing[0]}"
                            f"{f' and {len(missing) - 1} more' if len(missing) > 1 else ''}; "
                            f"{fix}")
