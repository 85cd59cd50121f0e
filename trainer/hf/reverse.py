"""The model's parameters as the family's checkpoint tensors, through ``transformers``' own
reverse mapping, one expert at a time.

``save_pretrained`` (``transformers`` 5) reverts the loading conversion before it writes
(``core_model_loading.revert_weight_conversion``): the transforms of
``conversion_mapping.get_model_conversion_mapping(model)`` in reverse order, each reversed
(``reverse_transform()``: patterns swapped, operations reversed and each replaced by its
``reverse_op``, so ``MergeModulelist`` becomes ``SplitModulelist`` and ``Concatenate``
``Chunk``); every state-dict name goes to at most one reversed converter
(``apply_converters``), which gathers the names that make the same checkpoint tensors, and
the renamings (``apply_renamings``) name what comes out. :func:`reverse_plan` groups the
names as that function does, and runs each group on meta tensors for the names and shapes
it writes; the whole is checked against ``revert_weight_conversion`` itself, run on the
meta state dict.

A group whose sources are fused expert parameters of one experts module is then converted
one expert at a time: expert ``e``'s slice ``[1, ...]`` of each source, through the same
reversed converter, gives either that expert's own checkpoint tensors (``SplitModulelist``
numbers them 0; they are renamed to ``e``) or its slice of a fused checkpoint tensor, written
at its place in the file. That is exact only while the operations keep experts apart
(:data:`~tierstore.hf.convert.PER_EXPERT_OPS` up to the ``SplitModulelist``, per-expert
tensors after it) and the names and shapes of all experts together are exactly those of the
whole conversion; a group that fails either is converted whole (one fused parameter of one
layer in memory, at worst).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from .convert import PER_EXPERT_OPS, ExpertParam, _OneExpert


class ReverseError(ValueError):
    """The family's reverse mapping cannot be run (one line)."""


@dataclass
class Output:
    """One tensor the export writes."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype  # the model's dtype of it (floats are cast to the export's)
    experts: int = 0  # a fused tensor written one expert's slice at a time: the number of experts
    packed: bool = False  # a quantized tensor as shipped, written in its own dtype


@dataclass
class Group:
    """State-dict names that one reversed transform turns into checkpoint tensors."""

    key: str  # revert_weight_conversion's key for it (the first target's name)
    transform: Any  # a reversed WeightConverter, or a WeightRenaming
    sources: list[tuple[str, str]] = field(default_factory=list)  # (state-dict name, pattern)
    experts: int = 0  # converted one expert at a time: the number of experts
    outputs: list[Output] = field(default_factory=list)
    # per expert: the name the one-expert run gives -> the output it is (for each expert)
    expert_names: list[dict[str, str]] = field(default_factory=list)
    # Quantized sources (tierstore.hf.quant_export): which stored tensor of each the group
    # converts (0 packed, 1 scales), and the names its outputs are written under.
    part: int | None = None
    renamed: dict[str, str] = field(default_factory=dict)

    def source_names(self) -> list[str]:
        return [n for n, _ in self.sources]


@dataclass
class ReversePlan:
    model: nn.Module
    groups: list[Group]
    renamings: list[Any]
    params: dict[str, ExpertParam]  # the fused expert parameters (by state-dict name)

    def outputs(self) -> Iterator[Output]:
        for g in self.groups:
            yield from g.outputs


def _reversed_mapping(model: nn.Module) -> tuple[list[Any], list[Any]]:
    """The renamings and converters ``revert_weight_conversion`` uses for a model that was
    not loaded with ``from_pretrained`` (the mapping less its ``PrefixChange`` transforms and
    the legacy renamings), reversed."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import PrefixChange, WeightConverter, WeightRenaming

    forward = [t for t in get_model_conversion_mapping(model, add_legacy=False)
               if not isinstance(t, PrefixChange)]
    reverse = [t.reverse_transform() for t in forward[::-1]]
    return ([t for t in reverse if isinstance(t, WeightRenaming)],
            [t for t in reverse if isinstance(t, WeightConverter)])


def _group(names: list[str], renamings: list[Any], converters: list[Any]) -> list[Group]:
    """``names`` grouped as ``revert_weight_conversion`` groups them, in its order."""
    from transformers.core_model_loading import (
        WeightRenaming,
        apply_converters,
        apply_renamings,
        dot_natural_key,
    )

    by_pattern = {p: c for c in converters for p in c.source_patterns}
    groups: dict[str, Group] = {}
    for name in sorted(names, key=dot_natural_key):
        key, pattern = apply_converters(name, converters)
        if pattern is None:
            key = apply_renamings(name, renamings)
            pattern = name
            transform: Any = WeightRenaming(name, key)
        else:
            transform = by_pattern[pattern]
        group = groups.get(key)
        if group is None:
            group = groups[key] = Group(key, copy.deepcopy(transform))
        group.sources.append((name, pattern))
    return list(groups.values())


def run(group: Group, plan: ReversePlan, tensors: dict[str, Tensor], *,
        one_expert: bool = False, rename: bool = True) -> dict[str, Tensor]:
    """``group``'s reversed transform over ``tensors`` (state-dict name -> tensor), as
    ``revert_weight_conversion`` runs it: the converter's outputs renamed afterwards
    (``rename=False`` leaves them as the converter names them). ``one_expert``: the fused
    expert parameters are one expert wide."""
    from transformers.core_model_loading import WeightConverter, apply_renamings

    conv = copy.deepcopy(group.transform)
    for name, pattern in group.sources:
        conv.add_tensor(group.key, name, pattern, tensors[name])
    model: Any = _OneExpert(plan.model, plan.params) if one_expert else plan.model
    got = conv.convert(group.key, model=model, config=plan.model.config)
    out = {}
    for name, t in got.items():
        if rename and isinstance(conv, WeightConverter):
            name = apply_renamings(name, plan.renamings)
        out[name] = t[0] if isinstance(t, list) else t
    return out


def _splits_experts(group: Group) -> bool:
    """Whether the operations keep experts apart: each one before a ``SplitModulelist``
    over the experts works past their dimension (after it, tensors are one expert's)."""
    for op in getattr(group.transform, "operations", []):
        kind = type(op).__name__
        if kind == "SplitModulelist":
            return op.dim == 0
        ok = PER_EXPERT_OPS.get(kind)
        if ok is None or not ok(op):
            return False
    return True


def _expert_renamer(group: Group) -> Callable[[str, int], str]:
    """The name of expert ``e``'s tensor, given the name the one-expert run gives it
    (``SplitModulelist`` numbers the only expert 0 where the pattern has its ``*``)."""
    marks = [(p.replace("*", "0"), p) for p in getattr(group.transform, "target_patterns", [])
             if "*" in p]

    def name_of(name: str, e: int) -> str:
        for zero, pattern in marks:
            at = name.rfind(zero)
            if at >= 0:
                return name[:at] + pattern.replace("*", str(e)) + name[at + len(zero):]
        return name

    return name_of


def _per_expert(group: Group, plan: ReversePlan, meta: dict[str, Tensor],
                whole: dict[str, Tensor]) -> bool:
    """Set ``group`` up to be converted one expert at a time, if that gives exactly what
    converting it whole gives (``whole``: the meta outputs); False if not."""
    from transformers.core_model_loading import WeightConverter, apply_renamings

    params = [plan.params.get(n) for n in group.source_names()]
    if not params or any(p is None for p in params) or len({p.module for p in params}) > 1 \
            or not _splits_experts(group):
        return False
    n = params[0].shape[0]
    one = {name: torch.empty((1, *meta[name].shape[1:]), dtype=meta[name].dtype, device="meta")
           for name in group.source_names()}
    try:
        got = run(group, plan, one, one_expert=True, rename=False)
    except Exception:  # noqa: BLE001  (an operation that needs every expert: convert it whole)
        return False
    renamer = _expert_renamer(group)
    rename = (lambda s: apply_renamings(s, plan.renamings)) \
        if isinstance(group.transform, WeightConverter) else (lambda s: s)
    fused: list[Output] = []
    split: list[list[Output]] = [[] for _ in range(n)]
    names: list[dict[str, str]] = [{} for _ in range(n)]
    covered: set[str] = set()
    for raw, t in got.items():
        per = [rename(renamer(raw, e)) for e in range(n)]
        if n > 1 and len(set(per)) == n:  # each expert's own tensor
            for e, name in enumerate(per):
                w = whole.get(name)
                if w is None or tuple(w.shape) != tuple(t.shape):
                    return False
                split[e].append(Output(name, tuple(t.shape), w.dtype))
                names[e][raw] = name
        elif len(set(per)) == 1:  # expert e's slice of a tensor over every expert
            w = whole.get(per[0])
            if w is None or t.dim() == 0 or t.shape[0] != 1 \
                    or tuple(w.shape) != (n, *t.shape[1:]):
                return False
            fused.append(Output(per[0], tuple(w.shape), w.dtype, experts=n))
            for e in range(n):
                names[e][raw] = per[0]
        else:
            return False
        covered.update(per)
    if covered != set(whole):
        return False
    group.experts = n
    group.outputs = fused + [o for per_e in split for o in per_e]
    group.expert_names = names
    return True


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def reverse_plan(model: nn.Module, names: list[str], params: dict[str, ExpertParam]
                 ) -> ReversePlan:
    """How the state-dict ``names`` of ``model`` (on meta) are written as checkpoint
    tensors (see the module docstring). :class:`ReverseError` if ``transformers`` cannot
    run the reverse mapping, or if the grouping here differs from its own."""
    from transformers.core_model_loading import revert_weight_conversion

    renamings, converters = _reversed_mapping(model)
    state = model.state_dict()
    meta = {n: torch.empty(state[n].shape, dtype=state[n].dtype, device="meta") for n in names}
    plan = ReversePlan(model, _group(names, renamings, converters), renamings, params)
    for group in plan.groups:
        try:
            whole = run(group, plan, meta)
        except Exception as e:  # noqa: BLE001  (any operation's failure, as save_pretrained's)
            raise ReverseError(f"transformers' reverse mapping cannot convert "
                               f"{group.sources[0][0]}: {_first_line(e)}") from e
        if not _per_expert(group, plan, meta, whole):
            group.outputs = [Output(k, tuple(t.shape), t.dtype) for k, t in whole.items()]
    try:
        theirs = revert_weight_conversion(model, dict(meta))
    except Exception as e:  # noqa: BLE001
        raise ReverseError(f"transformers' reverse mapping fails for this model: "
                           f"{_first_line(e)}") from e
    ours = {o.name: o.shape for o in plan.outputs()}
    want = {k: tuple(t.shape) for k, t in theirs.items()}
    if ours != want:
        diff = sorted(set(ours) ^ set(want)) or sorted(k for k in ours if ours[k] != want[k])
        raise ReverseError(f"the export's reading of transformers' reverse mapping differs "
                           f"from revert_weight_conversion at {diff[0]}")
    return plan
