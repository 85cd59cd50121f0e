"""Host-memory cache for tierstore: eviction policies, a slab-backed cache, traces, simulator.

A leaf package: it imports only the standard library, numpy and torch, never tierstore or
its other parts. Keys are opaque hashables (the store uses (name, kind); traces use
(layer, expert)).
"""

from .hostcache import CacheStats, Handle, HostCache, WriteBack
from .policies import (
    POLICIES,
    ArcPolicy,
    BeladyPolicy,
    LfuDecayPolicy,
    LfuPolicy,
    LruPolicy,
    Policy,
    SemoePolicy,
    admit_miss,
    make_policy,
)
from .simulate import AccountingCache, SimResult, policy_overhead_ns, simulate, sweep
from .slab import PAGE, BuddyAllocator
from .traces import (
    Trace,
    TraceRecorder,
    TraceSpec,
    generate_trace,
    parse_spec,
    read_trace,
    write_trace,
)

__all__ = [
    "PAGE",
    "POLICIES",
    "AccountingCache",
    "ArcPolicy",
    "BeladyPolicy",
    "BuddyAllocator",
    "CacheStats",
    "Handle",
    "HostCache",
    "LfuDecayPolicy",
    "LfuPolicy",
    "LruPolicy",
    "Policy",
    "SemoePolicy",
    "SimResult",
    "Trace",
    "TraceRecorder",
    "TraceSpec",
    "WriteBack",
    "admit_miss",
    "generate_trace",
    "make_policy",
    "parse_spec",
    "policy_overhead_ns",
    "read_trace",
    "simulate",
    "sweep",
    "write_trace",
]
