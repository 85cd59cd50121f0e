"""The cache policy lab: routing traces, their generators and recorder, the eviction policies
(``make_policy``) and the simulator that replays a trace against every eviction policy
(Belady's optimum included)."""

from tierstore.cache import (
    POLICIES,
    Trace,
    TraceRecorder,
    TraceSpec,
    admit_miss,
    generate_trace,
    make_policy,
    parse_spec,
    policy_overhead_ns,
    read_trace,
    simulate,
    sweep,
    write_trace,
)

__all__ = [
    "POLICIES",
    "Trace",
    "TraceRecorder",
    "TraceSpec",
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
