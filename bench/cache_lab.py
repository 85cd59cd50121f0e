"""``tierstore bench cache``: every eviction policy against Belady's optimum on a trace.

Hit rate, bytes read from the backing tier and bytes written back, per policy and capacity;
``opt_fraction`` is a policy's hit rate over Belady's at the same capacity, both measured in
the same run on the same trace.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from typing import Any

import click

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
        if not math.isfinite(value):
            raise tierstore.StoreError(f"capacity {item} is not a finite number")
        if not 0 < value <= 1 and "." in item:
            raise tierstore.StoreError(f"capacity fraction {item} is not in (0, 1]")
        out.append(value if value <= 1 else value / distinct_bytes)
    return out


def parse_policy_args(items: tuple[str, ...]) -> dict[str, dict[str, Any]]:
    """``lfu-decay:beta=0.5,period=512,clock=step`` ->
    {"lfu-decay": {"beta": 0.5, "period": 512, "clock": "step"}}; values that are not
    numbers stay strings."""
    out: dict[str, dict[str, Any]] = {}
    for item in items:
        name, _, rest = item.partition(":")
        args = out.setdefault(name, {})
        for kv in filter(None, rest.split(",")):
            k, eq, v = kv.partition("=")
            if not eq or not k:
                raise tierstore.StoreError(f"bad policy argument {kv!r} in {item!r}: want K=V")
            args[k] = _number_or_text(v)
    return out


def _number_or_text(text: str) -> int | float | str:
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


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
    stray = set(policy_args) - set(lab.POLICIES)
    if stray:
        raise tierstore.StoreError(
            f"--policy-arg names unknown policies {sorted(stray)} (want POLICY:K=V,...); "
            f"known: {lab.POLICIES}")
    for name, args in policy_args.items():
        if name != "belady":  # belady's arguments need the trace
            try:
                lab.make_policy(name, **args)
            except (TypeError, ValueError) as e:
                raise tierstore.StoreError(f"--policy-arg {name}: {e}") from None
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


# The sweep behind lfu-decay's defaults (README, "Host cache"): the two clocks that count
# steps (ticks from the trainer, or passes the policy finds itself) with short memories,
# and the per-access clock over periods from a fraction of a decode step (4 accesses) to
# several training steps (512).
SWEEP_STEP_CLOCK = [
    (clock, beta, period, theta)
    for clock in ("pass", "step")
    for beta in (0.5, 0.6, 0.65, 0.7, 0.75, 0.8, 0.9)
    for period in (1, 2, 4)
    for theta in ((0.0, 2.0, 4.0) if period == 1 else (2.0,))
]
SWEEP_ACCESS_CLOCK = [
    ("access", beta, period, 2.0)
    for beta in (0.5, 0.7)
    for period in (4, 16, 64, 128, 512)
]
ONLINE_RIVALS = ("lru", "lfu", "arc", "semoe")


def sweep_defaults(
    traces: list[tuple[str, str, float]],
    capacities: list[float],
    grid: list[tuple[str, float, int, float]] | None = None,
    *,
    json_out: str | None = None,
    echo: Callable[[str], object] = print,
) -> dict[str, Any]:
    """lfu-decay at every (clock, beta, period, theta) of ``grid`` against the best online
    rival (lru, lfu, arc, semoe) at each capacity of each trace.

    ``traces``: (label, trace file or synthetic spec, write fraction). For each setting the
    report gives, per trace, the hit rates and the margins over the best rival (negative:
    lfu-decay loses there); settings are ranked by their worst margin over all traces.
    """
    from tqdm import tqdm

    grid = list(grid or SWEEP_STEP_CLOCK + SWEEP_ACCESS_CLOCK)
    loaded = []
    for label, source, wf in traces:
        trace = (lab.read_trace(source) if os.path.exists(source)
                 else lab.generate_trace(source))
        loaded.append((label, source, wf, trace))
    rivals: dict[str, dict[str, list[float]]] = {}
    bar = tqdm(total=len(loaded) * (len(ONLINE_RIVALS) + 1 + len(grid)) * len(capacities),
               desc="sweep", unit="run", disable=None, dynamic_ncols=True)
    for label, _, wf, trace in loaded:
        rivals[label] = {}
        for name in (*ONLINE_RIVALS, "belady"):
            rivals[label][name] = []
            for c in capacities:
                rivals[label][name].append(
                    lab.simulate(trace, name, capacity_fraction=c, write_fraction=wf).hit_rate)
                bar.update()
    settings = []
    for clock, beta, period, theta in grid:
        args = dict(clock=clock, beta=beta, period=period, theta=theta)
        per_trace = {}
        for label, _, wf, trace in loaded:
            rates = []
            for c in capacities:
                rates.append(lab.simulate(trace, "lfu-decay", capacity_fraction=c,
                                          write_fraction=wf, policy_args=args,
                                          tick_per_step=clock == "step").hit_rate)
                bar.update()
            best = [max(rivals[label][n][i] for n in ONLINE_RIVALS)
                    for i in range(len(capacities))]
            per_trace[label] = {"hit_rate": rates,
                                "margin": [r - b for r, b in zip(rates, best, strict=True)]}
        worst = min(min(t["margin"]) for t in per_trace.values())
        settings.append({**args, "worst_margin": worst, "traces": per_trace})
    bar.close()
    settings.sort(key=lambda s: -s["worst_margin"])
    echo("margin of lfu-decay over the best of lru/lfu/arc/semoe (worst over capacities "
         f"{', '.join(f'{c:g}' for c in capacities)}; [capacities lost])")
    echo(f"{'clock':7}{'beta':>5}{'K':>5}{'theta':>6}  " +
         "  ".join(f"{label:>16}" for label, *_ in loaded))
    for s in settings:
        cells = []
        for label, *_ in loaded:
            m = s["traces"][label]["margin"]
            cells.append(f"{min(m):+8.3f} [{sum(x < 0 for x in m):2d}]   ")
        echo(f"{s['clock']:7}{s['beta']:5.2f}{s['period']:5d}{s['theta']:6.1f}  " +
             "  ".join(f"{c:>16}" for c in cells))
    report = {"benchmark": "cache-sweep", "capacities": capacities,
              "traces": [{"label": lb, "source": src, "write_fraction": wf,
                          "accesses": len(tr), "steps": int(len(set(tr.step.tolist())))}
                         for lb, src, wf, tr in loaded],
              "rivals": rivals, "settings": settings}
    if json_out:
        with open(json_out, "w") as f:
            json.dump(report, f, indent=1)
    return report


@click.command()
@click.option("--trace", "traces", multiple=True, required=True, metavar="LABEL=SOURCE[@WF]",
              help="A trace to sweep on: LABEL=FILE or LABEL=SYNTHETIC-SPEC, optionally "
                   "@WRITE-FRACTION (default 0). Repeatable.")
@click.option("--capacity", "capacities", default="0.1,0.15,0.2,0.25,0.3,0.35,0.4,0.45,0.5",
              show_default=True, help="Capacities as fractions of each trace's distinct bytes.")
@click.option("--json", "json_out", type=click.Path(dir_okay=False),
              help="Write every setting's hit rates and margins here.")
def sweep_command(traces: tuple[str, ...], capacities: str, json_out: str | None) -> None:
    """The lfu-decay parameter sweep behind its defaults (see the README, "Host cache").

    \b
    python -m tierstore.bench.cache_lab --trace train=zipf:steps=200@1 --trace rec=docs/t.csv@1
    """
    parsed = []
    for item in traces:
        label, eq, rest = item.partition("=")
        source, _, wf = rest.rpartition("@") if "@" in rest else (rest, "", "0")
        try:
            parsed.append((label, source, float(wf)))
            if not eq or not label:
                raise ValueError("no label")
            if not os.path.exists(source):
                lab.parse_spec(source)
        except ValueError as e:
            raise click.UsageError(f"--trace {item!r}: want LABEL=FILE or LABEL=SPEC, "
                                   f"optionally @WRITE-FRACTION ({e})") from None
    try:
        fractions = [float(c) for c in capacities.split(",")]
    except ValueError:
        raise click.UsageError(f"--capacity {capacities!r}: want fractions like 0.1,0.5") from None
    sweep_defaults(parsed, fractions, json_out=json_out)


if __name__ == "__main__":
    sweep_command()
