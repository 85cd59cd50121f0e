"""``tierstore bench cache``: every eviction policy against Belady's optimum on a trace.

Hit rate, bytes read from the backing tier and bytes written back, per policy and capacity;
``opt_fraction`` is a policy's hit rate over Belady's at the same capacity, both measured in
the same run on the same trace.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import tierstore
from tierstore import lab


def parse_capacities(text: str, distinct_bytes: int) -> list[float]:
    """Fractions of the trace's distinct bytes; absolute sizes ("64MiB") are converted."""
    out = []
    for item in filter(None, (p.strip() for p in text.split(","))):
        try:
            value = float(item)
        except ValueError:
            value = tierstore.parse_size(item) / distinct_bytes
        if not 0 < value <= 1 and "." in item:
            raise tierstore.StoreError(f"capacity fraction {item} is not in (0, 1]")
        out.append(value if value <= 1 else value / distinct_bytes)
    return out


def parse_policy_args(items: tuple[str, ...]) -> dict[str, dict[str, Any]]:
    """``lfu-decay:beta=0.5,period=512`` -> {"lfu-decay": {"beta": 0.5, "period": 512}}."""
    out: dict[str, dict[str, Any]] = {}
    for item in items:
        name, _, rest = item.partition(":")
        args = out.setdefault(name, {})
        for kv in filter(None, rest.split(",")):
            k, _, v = kv.partition("=")
            args[k] = float(v) if "." in v or "e" in v else int(v)
    return out


def run_cache_lab(
    *,
    trace_file: str | None,
    synthetic: str | None,
    capacities: str,
    policies: str,
    write_fraction: float,
    policy_args: dict[str, dict[str, Any]],
    json_out: str | None,
    plot_out: str | None,
    overhead_entries: int,
    echo: Callable[[str], object] = print,
) -> int:
    if (trace_file is None) == (synthetic is None):
        raise tierstore.StoreError("give exactly one of --trace FILE or --synthetic SPEC")
    trace = lab.read_trace(trace_file) if trace_file else lab.generate_trace(synthetic)
    names = list(lab.POLICIES) if policies == "all" else policies.split(",")
    unknown = set(names) - set(lab.POLICIES)
    if unknown:
        raise tierstore.StoreError(f"unknown policies {sorted(unknown)}; known: {lab.POLICIES}")
    if "belady" not in names:
        names.append("belady")
    fractions = parse_capacities(capacities, trace.distinct_bytes())
    rows = lab.sweep(trace, names, fractions, policy_args=policy_args,
                     write_fraction=write_fraction)
    source = trace_file or f"synthetic {synthetic}"
    echo(f"trace: {source}: {len(trace)} accesses, "
         f"{tierstore.format_size(trace.distinct_bytes())} distinct")
    echo(f"{'policy':10} " + " ".join(f"{f:>14.2f}" for f in fractions))
    for name in names:
        cells = [r for r in rows if r["policy"] == name]
        echo(f"{name:10} " + " ".join(
            f"{r['hit_rate']:6.3f} ({r['opt_fraction']:.2f})" for r in cells))
    echo("cells: hit rate (fraction of belady's); columns: capacity as a fraction of the "
         "distinct bytes")
    overhead = {}
    if overhead_entries:
        for name in names:
            overhead[name] = lab.policy_overhead_ns(name, overhead_entries,
                                                    policy_args=policy_args.get(name))
        echo(f"per-access overhead at {overhead_entries} entries (ns): " + ", ".join(
            f"{k} {v:.0f}" for k, v in overhead.items()))
    if json_out:
        with open(json_out, "w") as f:
            json.dump({"benchmark": "cache", "trace": source, "accesses": len(trace),
                       "distinct_bytes": trace.distinct_bytes(),
                       "write_fraction": write_fraction, "policy_args": policy_args,
                       "results": rows, "overhead_ns": overhead,
                       "overhead_entries": overhead_entries}, f, indent=1)
    if plot_out:
        plot(rows, names, source, plot_out)
    return 0


def plot(rows: list[dict[str, Any]], names: list[str], title: str, out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in sorted(names, key=lambda n: n != "belady"):
        pts = sorted((r["capacity_fraction"], r["hit_rate"]) for r in rows if r["policy"] == name)
        style = dict(color="black", linestyle="--", linewidth=2) if name == "belady" else {}
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name, **style)
    ax.set_xlabel("host cache capacity (fraction of the trace's distinct bytes)")
    ax.set_ylabel("hit rate")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
