"""Distributed fine-tuning of an imported Hugging Face checkpoint at several pipeline
granularities (``tierstore bench dist --model-dir DIR --pipeline 1,2,4,auto``).

The harness is :mod:`tierstore.bench.dist`'s: every (batch, world, chunk count) is a real
distributed run, one torchrun agent per node, each node with its own store (into which this
module imports the checkpoint before the run, as ``tierstore import-hf`` would on every
machine) and daemon. Every MoE block runs token-centric, in ``N`` chunks (MPMoE,
``trainer/dist/pipeline.py``); ``auto`` lets the performance model choose per block.

Per run, from every rank's per-step metrics (the steps after the first; the first holds
``auto``'s unchunked measurement): the chunks, the experts' compute time, the time spent
waiting for exchanges, the compute that overlapped an exchange in flight and the part of it
that hid one still incomplete, the experts' fetch from the store and the part of it that ran
under compute, and the bytes moved. Per step and rank, summed over the MoE blocks (the
run's table), and per block (``pipeline_blocks``, the per-block table): mean over the ranks
and steps, the bytes summed over the ranks, so the blocks' bytes add up to the run's.
The communication time is the exchanges' exposed time (a pipelined block's waits, an
unchunked block's exchanges) plus the hidden time; the hidden fraction is
``hidden / (comm + hidden)``: the share of the exchanges' time that ran under compute.

The performance model's figures come from the ``auto`` run of the same batch and world: rank
0 logs each block's α (the chunk counts' exchange), β (per byte), the dispatch's bytes and
the compute ``c``, and ``T(N) = (N - 1)·max(c/N, m) + c/N + 2m``, ``m = α + β·bytes/N``, is
given per block for every ``N`` asked, and summed over the blocks beside each run. Beside
each block's, the measured ``T``: its exchanges' exposed time plus its compute (the fetch
apart), per step; the model's is per forward pass, times the block's passes per step.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from tierstore.trainer.dist.pipeline import model_time

import tierstore

from .dist import _launch, _table, emit, failed, fmt_bytes, layout, rank_metrics

# What a family's config calls its routed experts per layer.
_EXPERT_FIELDS = ("num_local_experts", "n_routed_experts", "num_experts")
# hf_parallel's line for each block auto chose (rank 0, once per block).
_MODEL_LINE = re.compile(
    r"pipeline: (?P<block>\S+): (?P<n>\d+) chunk\(s\) \(alpha (?P<alpha>[\d.]+) us, beta "
    r"(?P<beta>[\d.]+) ns/B, (?P<kb>[\d.]+) kB, compute (?P<c>[\d.]+) ms")
COUNTERS = ("pipeline_compute_s", "pipeline_wait_s", "pipeline_overlapped_s",
            "pipeline_hidden_s", "pipeline_fetch_s", "pipeline_fetch_hidden_s",
            "pipeline_fetches_ahead", "comm_s", "step_time_s")
BLOCK_COUNTERS = ("calls", "compute_s", "comm_s", "overlapped_s", "hidden_s", "fetch_s",
                  "fetch_wait_s", "fetch_hidden_s", "fetches_ahead")
NOTES = [
    "Per run, the trainer's counters are per step and rank, summed over the blocks; per "
    "block, each MoE block's (mean over the ranks and the steps after the first; bytes summed "
    "over the ranks). The model's T(N) is per block, from the auto run's logged alpha, beta, "
    "bytes and c, and summed over the blocks; per block beside the measured T (exchanges' "
    "exposed time plus compute, per step).",
    "On this machine's 2 CPU cores every rank, daemon and gloo thread share the cores: the "
    "times (compute, wait, step) cannot rank the chunk counts, and alpha absorbs the ranks' "
    "skew. The figures to trust are the hidden fraction (how much of the exchanges ran under "
    "compute) and the bytes moved (exact: the rows the collectives carried).",
]


TINY_EXPERTS = 8


def write_tiny_family(model_dir: Path, shape: str) -> None:
    """A tiny ``shape`` checkpoint (``bench/hf_models.py``) with a made-up tokenizer."""
    from transformers.utils import logging

    from .hf_models import write_hf_checkpoint
    from .llamacpp import write_made_up_tokenizer

    vocab = 512
    logging.disable_progress_bar()
    write_hf_checkpoint(str(model_dir), shape, layers=2, experts=TINY_EXPERTS, hidden=64,
                        ffn=128, vocab=vocab)
    write_made_up_tokenizer(model_dir, vocab)


def expert_count(model_dir: str | os.PathLike[str]) -> int:
    """The routed experts per layer that ``model_dir``'s config.json declares."""
    try:
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{model_dir} has no readable config.json ({e})") from None
    cfg = cfg.get("text_config", cfg)
    for name in _EXPERT_FIELDS:
        if isinstance(cfg.get(name), int):
            return int(cfg[name])
    raise ValueError(f"{model_dir}'s config.json names no experts per layer "
                     f"({', '.join(_EXPERT_FIELDS)})")


def parse_pipelines(values: Sequence[str]) -> list[int | str]:
    out: list[int | str] = []
    for v in values:
        if v == "auto":
            out.append(v)
            continue
        try:
            n = int(v)
        except ValueError:
            n = 0
        if n < 1:
            raise ValueError(f"a pipeline setting is a chunk count N >= 1 or auto, not {v!r}")
        out.append(n)
    return out


def model_figures(log: str) -> list[dict[str, Any]]:
    """Each block's α, β (s, s/B), bytes and compute (s) from rank 0's ``auto`` lines."""
    return [{"block": m["block"], "auto_chunks": int(m["n"]), "alpha_s": float(m["alpha"]) * 1e-6,
             "beta_s_per_byte": float(m["beta"]) * 1e-9, "bytes": float(m["kb"]) * 1e3,
             "compute_s": float(m["c"]) * 1e-3} for m in _MODEL_LINE.finditer(log)]


def summarise_hf(ranks: list[list[dict[str, Any]]]) -> dict[str, Any]:
    """One run's pipeline figures from every rank's per-step metrics."""
    measured = [h[1:] or h for h in ranks]
    out: dict[str, Any] = {
        name: statistics.fmean(statistics.fmean(m[name] for m in h) for h in measured)
        for name in COUNTERS}
    out["chunks_per_step"] = sorted({m["pipeline_chunks"] for h in measured for m in h})
    # comm_s: the exchanges' exposed time (a pipelined block's waits, an unchunked block's
    # exchanges); the hidden part ran under compute besides.
    out["comm_time_s"] = out["comm_s"] + out["pipeline_hidden_s"]
    out["hidden_frac"] = out["pipeline_hidden_s"] / out["comm_time_s"] if out["comm_time_s"] \
        else 0.0
    n_steps = min(len(h) for h in ranks)
    out["moved_bytes"] = statistics.fmean(
        sum(h[s][f"tokens_{w}_bytes"] for h in ranks for w in ("intra", "cross"))
        for s in range(n_steps))
    out["cross_bytes"] = statistics.fmean(sum(h[s]["tokens_cross_bytes"] for h in ranks)
                                          for s in range(n_steps))
    out["losses"] = [m["loss"] for m in ranks[0][:n_steps]]
    out["blocks"] = summarise_blocks(measured, ranks, n_steps)
    return out


def summarise_blocks(measured: list[list[dict[str, Any]]], ranks: list[list[dict[str, Any]]],
                     n_steps: int) -> list[dict[str, Any]]:
    """One row per token-centric MoE block: its counters (``pipeline_blocks``, mean over
    the ranks and the measured steps), the chunk counts it ran in, and its bytes (summed
    over the ranks, mean over every step, as the run's ``moved_bytes``)."""
    keys = sorted({k for h in ranks for m in h for k in m.get("pipeline_blocks", {})}, key=int)
    rows = []
    for key in keys:
        seen = [[m["pipeline_blocks"][key] for m in h if key in m.get("pipeline_blocks", {})]
                for h in measured]
        row: dict[str, Any] = {"layer": int(key), "block": seen[0][0]["block"],
                               "n": sorted({b["n"] for h in seen for b in h})}
        for name in BLOCK_COUNTERS:
            row[name] = statistics.fmean(statistics.fmean(b[name] for b in h) for h in seen)
        row["comm_time_s"] = row["comm_s"] + row["hidden_s"]
        row["hidden_frac"] = row["hidden_s"] / row["comm_time_s"] if row["comm_time_s"] \
            else 0.0
        row["fetch_hidden_frac"] = row["fetch_hidden_s"] / row["fetch_s"] if row["fetch_s"] \
            else 0.0
        row["measured_T_s"] = row["compute_s"] + row["comm_s"]
        row["bytes"] = statistics.fmean(
            sum(h[s]["pipeline_blocks"].get(key, {}).get("bytes", 0) for h in ranks)
            for s in range(n_steps))
        rows.append(row)
    return rows


def _predict(rows: list[dict[str, Any]]) -> None:
    """Beside every run, the model's T(N) from the auto run of its batch and world."""
    for auto in rows:
        blocks = auto.get("model_blocks")
        if not blocks:
            continue
        for r in rows:
            if (r["batch_size"], r["world"]) != (auto["batch_size"], auto["world"]):
                continue
            n = r["pipeline"] if isinstance(r["pipeline"], int) else None
            # auto: each block's own choice
            per = [model_time(n or b["auto_chunks"], b["alpha_s"], b["beta_s_per_byte"],
                              b["bytes"], b["compute_s"]) for b in blocks]
            r["model_T_s_per_block"] = per
            r["model_T_s"] = sum(per)
            by_name = dict(zip((b["block"] for b in blocks), per))
            for row in r.get("blocks", []):
                if row["block"] in by_name:  # per forward pass: times the passes per step
                    row["model_T_s"] = by_name[row["block"]] * row["calls"]


def report_lines(result: dict[str, Any]) -> list[str]:
    ok = [r for r in result["rows"] if "error" not in r]
    rows = [["B", "W", "N", "chunks/step", "compute ms", "comm ms", "hidden ms", "hidden %",
             "overlap ms", "step ms", "model T ms", "moved", "cross"]]
    for r in ok:
        t = r.get("model_T_s")
        rows.append([str(r["batch_size"]), r["world"], str(r["pipeline"]),
                     ",".join(map(str, r["chunks_per_step"])),
                     f"{r['pipeline_compute_s'] * 1e3:.2f}", f"{r['comm_time_s'] * 1e3:.2f}",
                     f"{r['pipeline_hidden_s'] * 1e3:.2f}", f"{r['hidden_frac'] * 100:.0f}",
                     f"{r['pipeline_overlapped_s'] * 1e3:.2f}",
                     f"{r['step_time_s'] * 1e3:.1f}", "-" if t is None else f"{t * 1e3:.2f}",
                     fmt_bytes(r["moved_bytes"]), fmt_bytes(r["cross_bytes"])])
    lines = [f"{result['settings']['model']}: per run, mean over the ranks and the steps after "
             "the first (times per step, summed over the MoE blocks):"]
    lines += _table(rows)
    lines += ["", "per MoE block, mean over the ranks and the steps after the first (times per "
              "step; bytes per step, every rank's):"]
    lines += _table(block_rows(ok))
    for r in ok:
        for b in r.get("model_blocks") or []:
            lines.append(f"  model B={r['batch_size']} W={r['world']} {b['block']}: alpha "
                         f"{b['alpha_s'] * 1e6:.0f} us, beta {b['beta_s_per_byte'] * 1e9:.2f} "
                         f"ns/B, {b['bytes'] / 1e3:.1f} kB, c {b['compute_s'] * 1e3:.2f} ms -> "
                         f"{b['auto_chunks']} chunk(s)")
    for r in result["rows"]:
        if "error" in r:
            lines.append(f"FAILED B={r['batch_size']} W={r['world']} N={r['pipeline']}: "
                         f"{r['error']}")
    return lines + [""] + result["notes"]


def block_rows(ok: list[dict[str, Any]]) -> list[list[str]]:
    rows = [["B", "W", "N", "block", "n", "compute ms", "comm ms", "hidden %", "fetch ms",
             "fetch hidden %", "bytes", "model T ms", "measured T ms"]]
    for r in ok:
        for b in r.get("blocks", []):
            t = b.get("model_T_s")
            rows.append([str(r["batch_size"]), r["world"], str(r["pipeline"]), b["block"],
                         ",".join(map(str, b["n"])), f"{b['compute_s'] * 1e3:.2f}",
                         f"{b['comm_time_s'] * 1e3:.2f}", f"{b['hidden_frac'] * 100:.0f}",
                         f"{b['fetch_s'] * 1e3:.2f}", f"{b['fetch_hidden_frac'] * 100:.0f}",
                         fmt_bytes(b["bytes"]), "-" if t is None else f"{t * 1e3:.2f}",
                         f"{b['measured_T_s'] * 1e3:.2f}"])
    return rows


def run_dist_hf_bench(model_dir: str | None, family: str | None,
                      pipelines: Sequence[str] = ("1", "2", "4", "auto"),
                      batch_sizes: Sequence[int] = (2,), seq_len: int = 64, steps: int = 4,
                      worlds: Sequence[str] = ("2", "4"), host_cache: int = 128 << 20,
                      threads: int = 1, scratch: str | None = None,
                      json_out: str | None = None, timeout: float = 600.0,
                      echo: Callable[[str], Any] = print) -> dict[str, Any]:
    """Run every configuration (the module docstring); returns the result written to
    ``json_out``: ``rows`` (one per run), ``settings`` and ``notes``."""
    chunks = parse_pipelines(pipelines)
    if not chunks:
        raise ValueError("--pipeline names no setting")
    if steps < 2:
        raise ValueError("steps must be at least 2 (the first step is not timed)")
    if not batch_sizes or min(batch_sizes) < 1 or seq_len < 1:
        raise ValueError("batch sizes and the sequence length must be positive")
    shapes = [(w, *layout(w)) for w in worlds]
    root = Path(scratch) if scratch else Path(tempfile.mkdtemp(prefix="tierstore-bench-dist-",
                                                               dir="."))
    root.mkdir(parents=True, exist_ok=True)
    try:
        experts = TINY_EXPERTS if model_dir is None else expert_count(model_dir)
        for w, n, m in shapes:
            if experts % (n * m):
                raise ValueError(f"{model_dir}'s {experts} experts do not split over world "
                                 f"{w} ({n * m} ranks)")
            for c in chunks:
                if isinstance(c, int) and (experts // (n * m)) % c:
                    raise ValueError(f"{c} chunks do not split the {experts // (n * m)} "
                                     f"experts each rank owns at world {w}")
        if model_dir is None:
            src = root / f"{family}-tiny"
            if not (src / "config.json").is_file():
                echo(f"writing a tiny {family} checkpoint in {src} ...")
                write_tiny_family(src, str(family))
            model_dir = str(src)
        configs = [(b, w, n, m, c) for b in batch_sizes for w, n, m in shapes for c in chunks]
        result: dict[str, Any] = {
            "settings": {"model": os.path.basename(os.path.normpath(model_dir)),
                         "model_dir": model_dir, "experts": experts,
                         "pipelines": [str(c) for c in chunks],
                         "batch_sizes": list(batch_sizes), "seq_len": seq_len, "steps": steps,
                         "worlds": list(worlds), "host_cache": host_cache,
                         "threads_per_rank": threads, "cpus": os.cpu_count(),
                         "loadavg": os.getloadavg(), "torch": torch.__version__,
                         "backend": "gloo", "paradigm": "token"},
            "rows": [], "notes": NOTES}
        echo(f"{len(configs)} distributed runs of {steps} steps of {model_dir}, seq len "
             f"{seq_len}, {threads} compute thread(s) per rank, {os.cpu_count()} CPU(s) here")
        for i, (batch, _w, n, m, c) in enumerate(configs):
            echo(f"[{i + 1}/{len(configs)}] B={batch} W={n * m} ({n} node(s) x {m}) "
                 f"pipeline {c} ...")
            folder = root / f"run{i:03d}"
            folder.mkdir()
            for k in range(n):  # what `tierstore import-hf` does on every node
                tierstore.hf.import_hf(model_dir, folder / f"node{k}", progress=False)
            spec = {"model": None, "steps": steps, "seed": 0, "paradigm": "token",
                    "pipeline": c,
                    "train": {"batch_size": batch, "seq_len": seq_len, "eval_every": 0,
                              "corpus_max_bytes": 256 << 10},
                    "store": str(folder / "node{node}"), "host_cache": host_cache,
                    "metrics": str(folder / "metrics.jsonl")}
            t0 = time.monotonic()
            codes, tail = _launch(folder, spec, n, m, threads, timeout)
            row: dict[str, Any] = {"batch_size": batch, "seq_len": seq_len, "world": f"{n}x{m}",
                                   "world_size": n * m, "nodes": n, "ranks_per_node": m,
                                   "pipeline": c, "steps": steps,
                                   "wall_s": time.monotonic() - t0}
            if not failed(row, codes, tail, echo):
                ranks = rank_metrics(folder, n * m)
                row.update(summarise_hf(ranks))
                if c == "auto":
                    row["model_blocks"] = model_figures((folder / "node0.log").read_text())
                echo(f"    {row['wall_s']:.1f} s: {fmt_bytes(row['moved_bytes'])} moved per "
                     f"step, {row['hidden_frac'] * 100:.0f}% of the exchanges hidden")
                shutil.rmtree(folder, ignore_errors=True)
            result["rows"].append(row)
    finally:
        if scratch is None:
            shutil.rmtree(root, ignore_errors=True)
    _predict(result["rows"])
    emit(result, report_lines(result), json_out, echo)
    return result
