"""Which Hugging Face families the backend serves, asked of ``transformers`` itself.

A family is served when its experts class is decorated with ``@use_experts_implementation``
and dispatches through ``ExpertsInterface``: the decorator gives every such class one and
the same ``forward`` (a closure over the interface it looks implementations up in), so the
check is by that function's code object and its closure, not by a list of ours. A family
whose experts are computed by code of its own (llama4's dense ``bmm`` over every expert,
dbrx, jetmoe, switch_transformers, ...) would accept any registered implementation without a
word and then run its experts from memory; :func:`check_served` refuses it by name.
"""

from __future__ import annotations

import functools
import pathlib
from collections.abc import Iterator
from typing import Any

from torch import nn

# Config fields that say a model routes tokens to experts (any family, decorated or not).
EXPERT_COUNT_FIELDS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts",
                       "num_experts_per_layer", "ffn_num_experts")


class UnservedFamilyError(ValueError):
    """A checkpoint whose experts the backend cannot serve; the message is one line."""


@functools.cache
def _wrapper() -> tuple[Any, Any]:
    """The decorator's ``forward`` code object, and the interface it dispatches through."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, use_experts_implementation

    class _Probe(nn.Module):
        def __init__(self, config: Any) -> None:
            super().__init__()

        def forward(self, *args: Any) -> Any:
            return None

    use_experts_implementation(_Probe)
    return _Probe.forward.__code__, ALL_EXPERTS_FUNCTIONS


def _interface_of(cls: type) -> Any:
    """The interface the decorated ``forward`` of ``cls`` or of a class it derives from
    dispatches through (a subclass may wrap it: ergo's experts apply a per-expert norm
    around their decorated parent's forward), or None."""
    code, _ = _wrapper()
    for klass in cls.__mro__:
        fwd = klass.__dict__.get("forward")
        if getattr(fwd, "__code__", None) is code:
            cells = dict(zip(fwd.__code__.co_freevars, fwd.__closure__ or ()))
            cell = cells.get("experts_interface")
            return cell.cell_contents if cell is not None else None
    return None


def is_decorated(module: nn.Module) -> bool:
    """Whether ``module``'s class dispatches through ``transformers``' ``ExpertsInterface``
    (not through another registry such as the FP8 experts'). Whether every call really
    reaches the backend is checked by running the model once (:mod:`tierstore.hf.loader`)."""
    _, interface = _wrapper()
    return _interface_of(type(module)) is interface


def experts_modules(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """``(qualified name, module)`` of every decorated experts module, in module order."""
    for name, module in model.named_modules():
        if is_decorated(module):
            yield name, module


def _own_weights(module: nn.Module) -> bool:
    """Whether ``module`` holds parameters that no decorated module inside it holds."""
    if is_decorated(module):
        return False
    if any(True for _ in module.parameters(recurse=False)):
        return True
    return any(_own_weights(child) for child in module.children())


def _expert_count(config: Any) -> int:
    seen = [config]
    for sub in ("text_config", "language_config", "llm_config"):
        if getattr(config, sub, None) is not None:
            seen.append(getattr(config, sub))
    counts = [getattr(c, f, None) for c in seen for f in EXPERT_COUNT_FIELDS]
    return max((int(n) for n in counts if isinstance(n, int)), default=0)


def check_served(model: nn.Module, family: str) -> list[tuple[str, nn.Module]]:
    """The model's experts modules; :class:`UnservedFamilyError` when it has experts that
    would not go through the backend: a family whose experts class is not decorated, or
    experts modules of an undecorated class beside decorated ones."""
    served = list(experts_modules(model))
    # A module named like experts that holds weights of its own outside any decorated
    # module it contains (a decorated one inside, as ergo's projections, is served).
    stray = [name for name, m in model.named_modules()
             if name.rsplit(".", 1)[-1] == "experts" and not is_decorated(m)
             and _own_weights(m)]
    if stray:
        raise UnservedFamilyError(
            f"{family}: {stray[0]} ({type(dict(model.named_modules())[stray[0]]).__name__}) "
            "computes its experts in code of its own, not through transformers' experts "
            "interface, so they would run from memory instead of the store; this family "
            "cannot be served")
    if not served:
        if family in causal_lm_families() and _expert_count(model.config) > 1:
            raise UnservedFamilyError(
                f"{family}: this config builds no mixture-of-experts layer (check its layer "
                "counts and MoE layer settings in config.json); tierstore stores the experts "
                "of MoE models only")
        if _expert_count(model.config) > 1:
            raise UnservedFamilyError(
                f"{family}: its experts are computed in code of its own, not through "
                "transformers' experts interface (@use_experts_implementation), so they "
                "would run from memory instead of the store; this family cannot be served")
        raise UnservedFamilyError(f"{family}: the model has no mixture-of-experts layers; "
                                  "tierstore stores the experts of MoE models only")
    return served


@functools.cache
def causal_lm_families() -> tuple[str, ...]:
    """Every model type of the installed ``transformers`` that has a causal-LM class and
    whose modeling module decorates an experts class (read from its source, without
    importing 60-odd modeling modules)."""
    import transformers
    from transformers.models.auto.configuration_auto import model_type_to_module_name
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    root = pathlib.Path(transformers.__file__).parent / "models"
    decorated = {f.parent.name for f in root.glob("*/modeling_*.py")
                 if "@use_experts_implementation" in f.read_text(encoding="utf-8")}
    return tuple(sorted(mt for mt in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
                        if model_type_to_module_name(mt) in decorated))
