"""Distributed training: bytes moved between ranks per step in each paradigm, beside Janus's
formula, and step time at several world sizes (``tierstore bench dist``).

Every configuration (preset, per-rank batch, world, paradigm) is a real distributed run:
one torchrun agent per node (``python -m torch.distributed.run --nnodes N --node-rank i
--nproc-per-node M --master-addr 127.0.0.1``), each rank running
:mod:`tierstore.bench.dist_rank` (:func:`tierstore.trainer.dist.train_distributed`), each
node with its own store directory and daemon, all on this machine over gloo. The per-rank
metrics (``{metrics}.rank{r}``, one JSON object per step) give:

- the bytes each rank sent to other ranks, by what (tokens, experts, gradients) and where
  (inside its node, or to another node); summed over the ranks they are the bytes moved
  per step. These counts are exact: they are the rows the collectives carried.
- the step time (the slowest rank's, median over the steps after the first), the time in
  collectives, and each rank's and each node daemon's peak resident set.

Janus's formula (its Eq. 1), for one MoE block with ``T = B*S*k`` routed tokens per rank,
``m`` ranks per node, ``n`` nodes, hidden size ``H``, ``E`` experts per rank and ``P_e``
parameters per expert: the expert-centric (token) exchange moves
``Comm_EC = 2*m*H*T*(n-1)/n`` elements out of each node forward (dispatch and combine) and
the same again backward; the data-centric one ``Comm_DC = P_e*E*m*(n-1)`` elements of
expert weights into each node forward and as many gradient elements backward. Their ratio
is ``R = Comm_EC / Comm_DC`` (:func:`tierstore.trainer.dist.janus_ratio`; ``auto`` picks
data-centric where R > 1). The formula assumes balanced routing (a fraction (n-1)/n of the
tokens leave their node) and that every node needs every remote expert, so for the
data-centric paradigm it is an upper bound: a node pulls only the remote experts its tokens
routed to. The token exchange also sends each row's expert id (8 bytes), which the formula
leaves out.

Paradigm ``token-2stage`` is token-centric with SE-MoE's two-stage all-to-all
(``--hierarchical-a2a``): the same rows cross between nodes, after a first exchange inside
each node. It runs only on worlds of several nodes of several ranks.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from tierstore.trainer import PRESETS
from tierstore.trainer.dist import janus_ratio, stop_daemon_at
from tierstore.trainer.dist.world import World

RANK_MODULE = "tierstore.bench.dist_rank"
KINDS = ("tokens", "experts", "grads")
# token-2stage: token-centric with SE-MoE's two-stage all-to-all (--hierarchical-a2a), run
# only on worlds of several nodes of several ranks, where it differs from the flat exchange.
PARADIGMS = ("token", "data", "token-2stage")
WHERE = ("intra", "cross")
NOTES = [
    "Bytes moved are exact: the rows each collective carried, summed over the ranks, mean "
    "over the steps.",
    "Step times come from one machine whose 2 CPU cores run every rank and every node's "
    "daemon (at W=4, four ranks and two daemons), over gloo on loopback: a step at W>1 "
    "includes waiting for a core and the collectives' copies through the kernel, not a "
    "network. They show the distributed trainer's overhead on shared cores, not the "
    "scaling W machines would give, nor a network's cost for the bytes above.",
]


def layout(spec: str) -> tuple[int, int]:
    """``(nodes, ranks per node)`` for a world spec: ``NxM``, or a world size W (1: one
    node, even W: two nodes of W/2, odd W: one node of W)."""
    try:
        if "x" in spec:
            a, b = spec.split("x")
            nodes, per = int(a), int(b)
        else:
            w = int(spec)
            nodes, per = (1, 1) if w == 1 else (2, w // 2) if w % 2 == 0 else (1, w)
    except ValueError:
        raise ValueError(f"a world is a size W or NODESxRANKS, not {spec!r}") from None
    if nodes < 1 or per < 1:
        raise ValueError(f"a world needs at least one node of one rank, not {spec!r}")
    return nodes, per


def janus(preset: str, batch: int, seq_len: int, nodes: int, per_node: int) -> dict[str, Any]:
    """Janus's R and its predicted cross-node volumes for one configuration."""
    cfg = PRESETS[preset]
    w = nodes * per_node
    world = World(rank=0, size=w, local_rank=0, node=0,
                  nodes=[list(range(i * per_node, (i + 1) * per_node)) for i in range(nodes)],
                  backend="gloo", device=torch.device("cpu"))
    h = cfg.d_model
    t = batch * seq_len * cfg.top_k
    e = cfg.n_experts // w
    p_e = sum(a * b for a, b in cfg.expert_shapes().values())
    blocks = len(cfg.moe_layers)
    act = torch.empty(0, dtype=getattr(torch, cfg.dtype)).element_size()
    ec = 2 * per_node * h * t * (nodes - 1) / nodes  # elements out of a node, forward
    dc = p_e * e * per_node * (nodes - 1)  # elements into a node, forward
    ratio = janus_ratio(cfg, batch * seq_len, world)
    return {
        "R": ratio, "auto": "data" if ratio > 1 else "token",
        "T_per_rank": t, "H": h, "E_per_rank": e, "P_e": p_e, "m": per_node, "n": nodes,
        "moe_blocks": blocks,
        "comm_ec_elements_per_block_per_node_fwd": ec,
        "comm_dc_elements_per_block_per_node_fwd": dc,
        # per step, every node and MoE block: forward and backward
        "tokens_cross_bytes": 2 * ec * act * nodes * blocks,
        "experts_cross_bytes": dc * 4 * nodes * blocks,  # fp32 masters
        "grads_cross_bytes": dc * 4 * nodes * blocks,
    }


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def stop_daemons(folder: Path) -> None:
    """Stop every node daemon a run left answering under ``folder`` (a run that succeeds
    stops its own)."""
    for sock in folder.glob("node*.run/daemon.sock"):
        stop_daemon_at(sock)


def _launch(folder: Path, spec: dict[str, Any], nodes: int, per_node: int, threads: int,
            timeout: float) -> tuple[list[int], str]:
    """Run one configuration; returns the agents' exit codes and the tail of their logs."""
    spec_path = folder / "spec.json"
    spec_path.write_text(json.dumps(spec))
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    port = _port()
    procs, logs = [], []
    for i in range(nodes):
        logs.append(folder / f"node{i}.log")
        with open(logs[-1], "w") as log:
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nodes),
                 "--node-rank", str(i), "--nproc-per-node", str(per_node),
                 "--master-addr", "127.0.0.1", "--master-port", str(port),
                 "-m", RANK_MODULE, str(spec_path)],
                env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True))
    deadline = time.monotonic() + timeout
    codes = []
    try:
        for p in procs:
            try:
                codes.append(p.wait(timeout=max(1.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                codes.append(124)
    finally:
        for p in procs:  # an agent still running after the deadline
            if p.poll() is None:
                # SIGTERM: the agent stops its ranks (each in a session of its own) and exits
                p.terminate()
                try:
                    p.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(p.pid, signal.SIGKILL)
                    p.wait()
        stop_daemons(folder)
    tail = ""
    if any(codes):
        tail = "\n".join(
            f"--- node {i}: " + "\n".join(log.read_text(errors="replace").splitlines()[-15:])
            for i, log in enumerate(logs))
    return codes, tail


def summarise(ranks: list[list[dict[str, Any]]], daemons: list[dict[str, Any]]
              ) -> dict[str, Any]:
    """One configuration's figures from every rank's per-step metrics."""
    n_steps = min(len(h) for h in ranks)
    per_step = []
    for s in range(n_steps):
        row = {f"{k}_{w}_bytes": sum(h[s][f"{k}_{w}_bytes"] for h in ranks)
               for k in KINDS for w in WHERE}
        row["step_time_s"] = max(h[s]["step_time_s"] for h in ranks)
        row["comm_s"] = max(h[s]["comm_s"] for h in ranks)
        per_step.append(row)
    measured = per_step[1:] or per_step
    out: dict[str, Any] = {
        f"{k}_{w}_bytes": statistics.fmean(r[f"{k}_{w}_bytes"] for r in per_step)
        for k in KINDS for w in WHERE}
    out["intra_bytes"] = sum(out[f"{k}_intra_bytes"] for k in KINDS)
    out["cross_bytes"] = sum(out[f"{k}_cross_bytes"] for k in KINDS)
    out["max_step"] = {f"{k}_cross_bytes": max(r[f"{k}_cross_bytes"] for r in per_step)
                       for k in KINDS}
    out["step_time_s"] = statistics.median(r["step_time_s"] for r in measured)
    out["step_times_s"] = [r["step_time_s"] for r in per_step]
    out["comm_s"] = statistics.median(r["comm_s"] for r in measured)
    out["tokens_per_s"] = ranks[0][0]["tokens"] / out["step_time_s"]
    out["paradigm_used"] = ranks[0][-1]["paradigm"]
    out["losses"] = [m["loss"] for m in ranks[0][:n_steps]]
    out["per_step_bytes"] = [{k: v for k, v in r.items() if k.endswith("_bytes")}
                             for r in per_step]
    out["rank_peak_rss_bytes"] = [max(m["peak_rss_bytes"] for m in h) for h in ranks]
    out["peak_rss_bytes"] = max(out["rank_peak_rss_bytes"])
    out["daemon_peak_rss_bytes"] = [d.get("peak_rss_bytes") for d in daemons]
    if len(ranks) == 1:  # one rank alone on its daemon: the node's writes are its own
        out["store_bytes_written_per_step"] = statistics.fmean(
            m["bytes_written"] for m in ranks[0][1:] or ranks[0])
    return out


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def _table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.rjust(w) if i > 0 else c.ljust(w)
                      for i, (c, w) in enumerate(zip(r, widths))) for r in rows]


def report_lines(result: dict[str, Any]) -> list[str]:
    """The readable tables of a result: traffic, then time and memory."""
    ok = [r for r in result["rows"] if "error" not in r]
    head = ["preset", "B", "W", "paradigm", "R", "tok intra", "tok cross", "exp intra",
            "exp cross", "grad intra", "grad cross", "Janus cross", "meas/Janus"]
    rows = [head]
    for r in ok:
        j = r["janus"]
        if r["paradigm"] != "data":
            pred, meas = j["tokens_cross_bytes"], r["tokens_cross_bytes"]
        else:
            pred = j["experts_cross_bytes"] + j["grads_cross_bytes"]
            meas = r["experts_cross_bytes"] + r["grads_cross_bytes"]
        rows.append([r["preset"], str(r["batch_size"]), r["world"], r["paradigm"],
                     f"{j['R']:.2f}"]
                    + [fmt_bytes(r[f"{k}_{w}_bytes"]) for k in KINDS for w in WHERE]
                    + [fmt_bytes(pred), f"{meas / pred:.2f}" if pred else "-"])
    lines = ["bytes moved between ranks per step (all ranks; mean over the steps), "
             "Janus's cross-node prediction for the row's paradigm (forward + backward):"]
    lines += _table(rows)
    head = ["preset", "B", "W", "paradigm", "step ms", "comm ms", "tok/s", "rank RSS max",
            "daemon RSS max"]
    rows = [head]
    for r in ok:
        daemons = [d for d in r["daemon_peak_rss_bytes"] if d is not None]
        rows.append([r["preset"], str(r["batch_size"]), r["world"], r["paradigm"],
                     f"{r['step_time_s'] * 1e3:.1f}", f"{r['comm_s'] * 1e3:.1f}",
                     f"{r['tokens_per_s']:,.0f}", fmt_bytes(r["peak_rss_bytes"]),
                     fmt_bytes(max(daemons) if daemons else None)])
    lines += ["", "step time (slowest rank, median over the steps after the first) and "
              "peak RSS:"]
    lines += _table(rows)
    for preset, peer in result.get("peer", {}).items():
        lines.append("")
        if peer.get("cannot_run"):
            lines.append(f"DeepSpeed ({preset}): cannot run: {peer['cannot_run']}")
            continue
        ours = [r for r in ok if r["preset"] == preset and r["world_size"] == 1
                and r["batch_size"] == peer["batch_size"]]
        lines.append(f"DeepSpeed {peer['config']['variant']} ({preset}, B={peer['batch_size']},"
                     f" one process, states on NVMe): {peer['step_time_s'] * 1e3:.1f} ms/step, "
                     f"{fmt_bytes(peer['bytes_written_nvme'])} written/step, peak RSS "
                     f"{fmt_bytes(peer['peak_rss_bytes'])}")
        for r in ours:
            lines.append(f"  tierstore W=1 {r['paradigm']}: {r['step_time_s'] * 1e3:.1f} "
                         f"ms/step, {fmt_bytes(r.get('store_bytes_written_per_step'))} "
                         f"written to the store/step, peak RSS {fmt_bytes(r['peak_rss_bytes'])}"
                         f" + daemon {fmt_bytes(r['daemon_peak_rss_bytes'][0])}")
    failed = [r for r in result["rows"] if "error" in r]
    for r in failed:
        lines.append(f"FAILED {r['preset']} B={r['batch_size']} W={r['world']} "
                     f"{r['paradigm']}: {r['error']}")
    lines += [""] + result["notes"]
    return lines


def run_dist_bench(presets: Sequence[str] = ("tiny",), batch_sizes: Sequence[int] = (2, 8, 32),
                   seq_len: int = 64, steps: int = 4, worlds: Sequence[str] = ("1", "2", "4"),
                   paradigms: Sequence[str] = ("token", "data"), host_cache: int = 128 << 20,
                   threads: int = 1, scratch: str | None = None, peer: str | None = None,
                   peer_batch: int | None = None, json_out: str | None = None,
                   timeout: float = 600.0, echo: Callable[[str], Any] = print
                   ) -> dict[str, Any]:
    """Run every configuration (see the module docstring); returns the result written to
    ``json_out``: ``rows`` (one per configuration), ``peer`` (with ``peer='deepspeed'``)
    and ``notes``."""
    bad = [p for p in presets if p not in PRESETS]
    if bad:
        raise ValueError(f"unknown model preset {bad[0]!r}; choose from {', '.join(PRESETS)}")
    if any(p not in PARADIGMS for p in paradigms) or not paradigms:
        raise ValueError(f"paradigms are {', '.join(PARADIGMS)}, not {','.join(paradigms)}")
    if steps < 2:
        raise ValueError("steps must be at least 2 (the first step is not timed)")
    if not batch_sizes or min(batch_sizes) < 1 or seq_len < 1:
        raise ValueError("batch sizes and the sequence length must be positive")
    if peer not in (None, "deepspeed"):
        raise ValueError(f"the only peer is deepspeed, not {peer!r}")
    shapes = [(w, *layout(w)) for w in worlds]
    for preset in presets:
        cfg = PRESETS[preset]
        if seq_len > cfg.max_seq_len:
            raise ValueError(f"--seq-len {seq_len} exceeds {preset}'s {cfg.max_seq_len}")
        for w, n, m in shapes:
            if cfg.n_experts % (n * m):
                raise ValueError(f"{preset}'s {cfg.n_experts} experts do not split over "
                                 f"world {w} ({n * m} ranks)")
    configs = [(p, b, w, n, m, par) for p in presets for b in batch_sizes
               for w, n, m in shapes for par in paradigms
               if par != "token-2stage" or (n > 1 and m > 1)]
    root = Path(scratch) if scratch else Path(tempfile.mkdtemp(prefix="tierstore-bench-dist-",
                                                               dir="."))
    root.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {
        "settings": {"presets": list(presets), "batch_sizes": list(batch_sizes),
                     "seq_len": seq_len, "steps": steps, "worlds": list(worlds),
                     "paradigms": list(paradigms), "host_cache": host_cache,
                     "threads_per_rank": threads, "cpus": os.cpu_count(),
                     "torch": torch.__version__, "backend": "gloo"},
        "rows": [], "notes": NOTES}
    echo(f"{len(configs)} distributed runs of {steps} steps, seq len {seq_len}, "
         f"{threads} compute thread(s) per rank, {os.cpu_count()} CPU(s) here")
    try:
        for i, (preset, batch, _w, n, m, par) in enumerate(configs):
            label = f"{preset} B={batch} W={n * m} ({n} node(s) x {m}) {par}"
            echo(f"[{i + 1}/{len(configs)}] {label} ...")
            folder = root / f"run{i:03d}"
            folder.mkdir()
            spec = {"model": preset, "steps": steps, "seed": 0,
                    "paradigm": par.split("-")[0], "hierarchical": par == "token-2stage",
                    "train": {"batch_size": batch, "seq_len": seq_len, "eval_every": 0,
                              "corpus_max_bytes": 2 << 20},
                    "store": str(folder / "node{node}"), "host_cache": host_cache,
                    "metrics": str(folder / "metrics.jsonl")}
            t0 = time.monotonic()
            codes, tail = _launch(folder, spec, n, m, threads, timeout)
            row: dict[str, Any] = {"preset": preset, "batch_size": batch, "seq_len": seq_len,
                                   "world": f"{n}x{m}", "world_size": n * m, "nodes": n,
                                   "ranks_per_node": m, "paradigm": par, "steps": steps,
                                   "janus": janus(preset, batch, seq_len, n, m),
                                   "wall_s": time.monotonic() - t0}
            if not failed(row, codes, tail, echo):
                ranks = rank_metrics(folder, n * m)
                daemons = [json.loads((folder / f"metrics.jsonl.daemon{k}").read_text())
                           for k in range(n)]
                row.update(summarise(ranks, daemons))
                echo(f"    {row['wall_s']:.1f} s: moved {fmt_bytes(row['intra_bytes'])} intra"
                     f" + {fmt_bytes(row['cross_bytes'])} cross-node per step, step "
                     f"{row['step_time_s'] * 1e3:.1f} ms")
                shutil.rmtree(folder, ignore_errors=True)
            result["rows"].append(row)
        if peer == "deepspeed":
            from tierstore.bench.peer_deepspeed_moe import run_peer

            pb = peer_batch if peer_batch is not None else (
                8 if 8 in batch_sizes else batch_sizes[0])
            result["peer"] = {}
            for preset in presets:
                echo(f"DeepSpeed on {preset}, B={pb} (one process, states on NVMe) ...")
                res = run_peer(preset, steps, batch_size=pb, seq_len=seq_len, timeout=timeout)
                res["batch_size"] = pb
                result["peer"][preset] = res
    finally:
        if scratch is None:
            shutil.rmtree(root, ignore_errors=True)
    _compare(result["rows"])
    emit(result, report_lines(result), json_out, echo)
    return result


def rank_metrics(folder: Path, world_size: int) -> list[list[dict[str, Any]]]:
    """Every rank's per-step metrics of the run in ``folder``."""
    return [[json.loads(x) for x in (folder / f"metrics.jsonl.rank{r}").read_text()
             .splitlines()] for r in range(world_size)]


def failed(row: dict[str, Any], codes: list[int], tail: str, echo: Callable[[str], Any]
           ) -> bool:
    """Whether a run failed (then said in ``row`` and echoed)."""
    if not any(codes):
        return False
    row["error"] = f"exit codes {codes}"
    row["log_tail"] = tail
    echo(f"    failed ({row['error']}):\n{tail}")
    return True


def emit(result: dict[str, Any], lines: list[str], json_out: str | None,
         echo: Callable[[str], Any]) -> None:
    """Echo a result's tables and write it to ``json_out``."""
    for line in lines:
        echo(line)
    if json_out:
        with open(json_out, "w") as f:
            json.dump(result, f, indent=1)
            f.write("\n")


def _compare(rows: list[dict[str, Any]]) -> None:
    """Where both paradigms ran on one configuration: the measured ratio of their
    cross-node bytes (token / data), Janus's R measured."""
    done = [r for r in rows if "error" not in r]
    for r in done:
        if r["paradigm"] != "data":
            continue
        for t in done:
            if (t["paradigm"] == "token" and t["preset"] == r["preset"]
                    and t["batch_size"] == r["batch_size"] and t["world"] == r["world"]):
                dc = r["experts_cross_bytes"] + r["grads_cross_bytes"]
                ratio = t["tokens_cross_bytes"] / dc if dc else None
                r["measured_ratio"] = t["measured_ratio"] = ratio
