"""The cache policy lab: routing traces, their generators and recorder, and the simulator
that replays a trace against every eviction policy (Belady's optimum included)."""

from cache import (
    POLICIES,
    Trace,
    TraceRecorder,
    TraceSpec,
    generate_trace,
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
    "generate_trace",
    "parse_spec",
    "policy_overhead_ns",
    "read_trace",
    "simulate",
    "sweep",
    "write_trace",
]
