"""Eviction and admission policies shared by the host cache and the trace simulator.

``base`` defines the interface every policy implements and the protocol the cache layer
drives it through; ``lfu_decay`` holds the default policy and ``baselines`` the policies it
is compared with. This module keeps the registry: ``make_policy`` builds any of them by name.
"""

from __future__ import annotations

from typing import Any

from .base import IsEvictable, Key, Policy, admit_miss, heap_walk
from .baselines import ArcPolicy, BeladyPolicy, LfuPolicy, LruPolicy, SemoePolicy
from .lfu_decay import CLOCKS, LfuDecayPolicy

__all__ = [
    "CLOCKS",
    "POLICIES",
    "ArcPolicy",
    "BeladyPolicy",
    "IsEvictable",
    "Key",
    "LfuDecayPolicy",
    "LfuPolicy",
    "LruPolicy",
    "Policy",
    "SemoePolicy",
    "admit_miss",
    "heap_walk",
    "make_policy",
]

_REGISTRY: dict[str, type[Policy]] = {
    cls.name: cls
    for cls in (LfuDecayPolicy, SemoePolicy, LruPolicy, LfuPolicy, ArcPolicy, BeladyPolicy)
}

#: Policy names ``make_policy`` accepts; the first is the default.
POLICIES: tuple[str, ...] = tuple(_REGISTRY)


def make_policy(name: str, **args: Any) -> Policy:
    """Build a policy by name; ``args`` go to its constructor (``belady`` needs ``future``)."""
    try:
        cls = _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; known: {', '.join(POLICIES)}") from None
    return cls(**args)
