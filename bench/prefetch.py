"""Prefetch against on-demand loading on a layered synthetic MoE workload.

A store holds ``layers`` × ``experts`` fp32 expert matrices of ``expert_bytes`` each, shaped
``(rows, hidden)``. A layer's compute is real matmuls over its experts: ``repeat`` times, for
each expert, ``(tokens × hidden) @ (hidden × rows)``. Each step runs every layer in order,
two ways, each on a freshly opened store (empty host cache) after the slab files were
dropped from the page cache:

- on-demand: ``get_many`` a layer's experts when the layer is reached, then compute;
- prefetch: while layer i computes, layers i+1 (and i+2 if the budget holds three layers)
  are requested at priority ``(step, layer)``; experts are acquired at use and released
  after the layer.

The host cache is smaller than the experts (half a layer by default), so reads go to the
backing tier. Reported: step time both ways, and over its own compute time (1.0: every
transfer hidden; a ratio within one run, so robust to the load of a shared machine);
per-layer compute and transfer time, measured in the on-demand run (compute again under
prefetch, where I/O competes for the cores); the stall fraction with prefetch (time spent
waiting in ``acquire`` over step time); bytes moved to the device and bytes read from the
backing tier.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import wait
from typing import Any

import torch

import tierstore
from tierstore.devices import normalize_device

from .tiers import drop_page_cache

MiB = 1 << 20


def stats_key(device: str | torch.device,
              current_index: Callable[[str], int] | None = None) -> str:
    """The key of ``device``'s queue in ``stats()["prefetch"]``: the store names queues by
    their indexed device (``cuda:0``), never by a bare ``cuda``."""
    return str(normalize_device(device, current_index))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _compute(ws: list[torch.Tensor], x: torch.Tensor, out: torch.Tensor, repeat: int) -> None:
    for _ in range(repeat):
        for w in ws:
            torch.mm(x, w.t(), out=out)


def _calibrate(st: tierstore.Store, names: list[list[str]], x: torch.Tensor,
               out: torch.Tensor, device: torch.device, ratio: float = 1.5) -> int:
    """Matmul repeats that make a layer's compute about ``ratio`` times its cold transfer."""
    dev = None if device.type == "cpu" else device
    transfer, compute = [], []
    for layer_names in names:
        t0 = time.perf_counter()
        got = st.get_many(layer_names, device=dev)
        _sync(device)
        transfer.append(time.perf_counter() - t0)
        ws = [got[n] for n in layer_names]
        _compute(ws, x, out, 1)  # warm-up: first calls pay for thread pools and caches
        for _ in range(3):
            t0 = time.perf_counter()
            _compute(ws, x, out, 1)
            _sync(device)
            compute.append(time.perf_counter() - t0)
    return max(1, math.ceil(ratio * statistics.mean(transfer) / statistics.median(compute)))


def _backing_read(st: tierstore.Store) -> int:
    return sum(t["bytes_read"] for t in st.stats()["tiers"].values())


def _run_mode(
    st: tierstore.Store, mode: str, names: list[list[str]], x: torch.Tensor, out: torch.Tensor,
    repeat: int, steps: int, device: torch.device, lookahead: int,
) -> dict[str, Any]:
    """One warm-up step, then ``steps`` measured steps; figures are per measured step.

    The measured window starts with layers the warm-up step already prefetched, so it also
    takes in the requests its last layers make for the step after it: every window holds
    ``steps`` steps' worth of transfers."""
    dev = None if device.type == "cpu" else device
    layers = len(names)
    step_s: list[float] = []
    compute_s: list[float] = []
    transfer_s: list[float] = []
    seq = [(s, layer) for s in range(steps + 2) for layer in range(layers)]
    run = seq[: (steps + 1) * layers]  # the last step of seq is only prefetched, never run
    tail = []
    before: dict[str, Any] = {}
    if mode == "prefetch":
        st.prefetch(names[0], device=dev, priority=(0, 0))
    step_start = time.perf_counter()
    for i, (step, layer) in enumerate(run):
        if layer == 0 and step == 1:  # the warm-up step is over
            before = {"pf": st.stats()["prefetch"].get(stats_key(device), {}),
                      "read": _backing_read(st)}
            step_start = time.perf_counter()
        if mode == "prefetch":
            for s, nxt in seq[i + 1 : i + 1 + lookahead]:
                futs = st.prefetch(names[nxt], device=dev, priority=(s, nxt))
                if s > steps:
                    tail += futs
        t0 = time.perf_counter()
        if mode == "prefetch":
            ws = [st.acquire(n, device=dev) for n in names[layer]]
        else:
            got = st.get_many(names[layer], device=dev)
            ws = [got[n] for n in names[layer]]
        _sync(device)
        t1 = time.perf_counter()
        _compute(ws, x, out, repeat)
        _sync(device)
        t2 = time.perf_counter()
        if mode == "prefetch":
            for n in names[layer]:
                st.release(n, device=dev)
        if step >= 1:
            transfer_s.append(t1 - t0)
            compute_s.append(t2 - t1)
            if layer == layers - 1:
                now = time.perf_counter()
                step_s.append(now - step_start)
                step_start = now
    wait(tail)
    pf = st.stats()["prefetch"].get(stats_key(device), {})
    stall = pf.get("stall_s", 0.0) - before["pf"].get("stall_s", 0.0)
    total = sum(step_s)
    row: dict[str, Any] = {
        "mode": mode,
        "step_ms": 1e3 * statistics.mean(step_s),
        "step_ms_min": 1e3 * min(step_s),
        "compute_ms_per_layer": 1e3 * statistics.mean(compute_s),
        # the step over its own compute, both from this run: 1.0 is fully hidden transfers
        "step_over_compute": sum(step_s) / sum(compute_s),
        # on-demand: the get_many of a layer; prefetch: what acquire still waited for
        "wait_ms_per_layer": 1e3 * statistics.mean(transfer_s),
        "stall_ms_per_step": 1e3 * stall / steps if mode == "prefetch" else None,
        "stall_fraction": stall / total if mode == "prefetch" else None,
        "backing_bytes_read_per_step": (_backing_read(st) - before["read"]) / steps,
    }
    if mode == "prefetch":
        row["device_bytes_per_step"] = (pf["bytes_moved"] - before["pf"].get("bytes_moved", 0)
                                        ) / steps
        earlier = before["pf"].get("stall_s_by_layer", {})
        row["stall_ms_by_layer"] = {str(k): 1e3 * (v - earlier.get(k, 0.0)) / steps
                                    for k, v in sorted(pf["stall_s_by_layer"].items(), key=str)
                                    if v > earlier.get(k, 0.0)}
    else:
        row["device_bytes_per_step"] = sum(
            st.info(n).nbytes for layer_names in names for n in layer_names)
        row["stall_fraction_if_all_waits"] = sum(transfer_s) / total
    return row


def run_prefetch(
    store: str | None = None,
    *,
    layers: int = 8,
    experts: int = 8,
    expert_bytes: int = 4 * MiB,
    hidden: int = 1024,
    tokens: int = 256,
    repeat: int | None = None,
    steps: int = 5,
    device_budget: int | None = None,
    host_cache: int | None = None,
    device: str | None = None,
    json_out: str | None = None,
    echo: Callable[[str], object] = print,
) -> int:
    """Run the layered workload on-demand and with prefetch; print a table, write JSON.

    - ``store``: scratch directory (a fresh store is made in it and removed afterwards);
      None: a temporary directory under the current directory, on its filesystem.
    - ``layers``, ``experts``: the model shape; ``expert_bytes``: size of one expert, an fp32
      ``(rows, hidden)`` matrix (``expert_bytes`` must be a multiple of ``4 * hidden``).
    - ``hidden``, ``tokens``, ``repeat``: the compute. Per layer, ``repeat`` times per expert,
      a ``(tokens × hidden) @ (hidden × rows)`` matmul. None: calibrated before the runs
      (a cold ``get_many`` of two layers against one pass of their matmuls) so that a
      layer's compute takes about 1.5 times its transfer on the machine at hand.
    - ``steps``: measured steps per mode (after one warm-up step).
    - ``device_budget``: prefetch budget in bytes; None: three layers (the current one and
      two ahead). It must hold at least one layer. Lookahead is two layers when it holds
      three, else one.
    - ``host_cache``: host cache bytes; None: half a layer, so that reads hit the backing tier.
    - ``device``: where compute runs and experts are moved to (None: the CPU).
    - ``json_out``: write ``{"benchmark": "prefetch", "config", "results", "summary"}`` here.
    - ``echo``: where the table is printed.
    """
    if min(layers, experts, hidden, tokens, steps, repeat or 1) < 1:
        raise tierstore.StoreError("layers, experts, hidden, tokens, repeat and steps must be >= 1")
    if expert_bytes <= 0 or expert_bytes % (4 * hidden):
        raise tierstore.StoreError(f"expert_bytes must be a positive multiple of 4 * hidden "
                                   f"({4 * hidden}), got {expert_bytes}")
    dev = normalize_device(device or "cpu")
    rows = expert_bytes // (4 * hidden)
    layer_bytes = experts * expert_bytes
    budget = device_budget if device_budget is not None else 3 * layer_bytes
    if budget < layer_bytes:
        raise tierstore.StoreError(f"device_budget {tierstore.format_size(budget)} cannot hold "
                                   f"one layer ({tierstore.format_size(layer_bytes)})")
    lookahead = 2 if budget >= 3 * layer_bytes else 1
    cache = host_cache if host_cache is not None else layer_bytes // 2
    total_bytes = layers * layer_bytes
    names = [[f"layers.{i}.experts.{e}.w" for e in range(experts)] for i in range(layers)]

    root = store or tempfile.mkdtemp(prefix="tierstore-bench-", dir=os.getcwd())
    os.makedirs(root, exist_ok=True)
    path = tempfile.mkdtemp(prefix="prefetch-", dir=root)
    opts = {"host_cache": cache, "device_budget": budget}
    results = []
    try:
        slab = max(64 * MiB, total_bytes + total_bytes // 4)
        with tierstore.open(path, create=True, slab_size=slab, **opts) as st:
            gen = torch.Generator().manual_seed(0)
            for layer_names in names:
                st.put_many({n: torch.randn(rows, hidden, generator=gen) * 0.02
                             for n in layer_names})
            st.flush()
            slabs = {st.info(n).path for layer_names in names for n in layer_names}
        slabs.discard(None)
        x = torch.randn(tokens, hidden, device=dev)
        out = torch.empty(tokens, rows, device=dev)
        if repeat is None:
            drop_page_cache(slabs)
            with tierstore.open(path, **opts) as st:
                repeat = _calibrate(st, names[: min(2, layers)], x, out, dev)
        for mode in ("on-demand", "prefetch"):
            drop_page_cache(slabs)
            with tierstore.open(path, **opts) as st:
                results.append(_run_mode(st, mode, names, x, out, repeat, steps, dev, lookahead))
    finally:
        shutil.rmtree(path, ignore_errors=True)
        if store is None:
            shutil.rmtree(root, ignore_errors=True)

    demand, pre = results
    summary = {
        "compute_ms_per_layer": demand["compute_ms_per_layer"],
        "transfer_ms_per_layer": demand["wait_ms_per_layer"],
        "compute_over_transfer": demand["compute_ms_per_layer"] / demand["wait_ms_per_layer"],
        "speedup": demand["step_ms"] / pre["step_ms"],
        "stall_fraction": pre["stall_fraction"],
    }
    config = {"layers": layers, "experts": experts, "expert_bytes": expert_bytes,
              "expert_shape": [rows, hidden], "tokens": tokens, "repeat": repeat,
              "steps": steps, "device": str(dev), "device_budget": budget,
              "lookahead": lookahead, "host_cache": cache, "torch_threads": torch.get_num_threads()}
    _print(echo, config, results, summary)
    if json_out:
        with open(json_out, "w") as f:
            json.dump({"benchmark": "prefetch", "config": config, "results": results,
                       "summary": summary}, f, indent=1)
    return 0


def _print(echo: Callable[[str], object], config: dict[str, Any], results: list[dict[str, Any]],
           summary: dict[str, Any]) -> None:
    fs = tierstore.format_size
    echo(f"{config['layers']} layers x {config['experts']} experts of "
         f"{fs(config['expert_bytes'])} ({fs(config['layers'] * config['experts'] * config['expert_bytes'])}"
         f" in all); compute {config['repeat']} x ({config['tokens']} x {config['expert_shape'][1]}) @ "
         f"({config['expert_shape'][1]} x {config['expert_shape'][0]}) per expert on "
         f"{config['device']}; budget {fs(config['device_budget'])}, lookahead "
         f"{config['lookahead']}, host cache {fs(config['host_cache'])}")
    echo(f"{'mode':10} {'step ms':>9} {'compute ms/layer':>17} {'wait ms/layer':>14} "
         f"{'step/compute':>13} {'stall ms/step':>14} {'stall %':>8} {'device MiB/step':>16} "
         f"{'backing MiB/step':>17}")
    for r in results:
        stall_ms = "-" if r["stall_ms_per_step"] is None else f"{r['stall_ms_per_step']:.1f}"
        stall_pct = "-" if r["stall_fraction"] is None else f"{100 * r['stall_fraction']:.1f}"
        echo(f"{r['mode']:10} {r['step_ms']:9.1f} {r['compute_ms_per_layer']:17.2f} "
             f"{r['wait_ms_per_layer']:14.2f} {r['step_over_compute']:13.3f} {stall_ms:>14} "
             f"{stall_pct:>8} "
             f"{r['device_bytes_per_step'] / MiB:16.1f} "
             f"{r['backing_bytes_read_per_step'] / MiB:17.1f}")
    echo(f"per layer: compute {summary['compute_ms_per_layer']:.2f} ms, transfer "
         f"{summary['transfer_ms_per_layer']:.2f} ms (on-demand get_many), ratio "
         f"{summary['compute_over_transfer']:.2f}; prefetch speedup {summary['speedup']:.2f}x, "
         f"stall fraction {100 * summary['stall_fraction']:.1f} %")
    if summary["compute_over_transfer"] < 1:
        echo("note: a layer's compute is shorter than its transfer here, so prefetch cannot "
             "hide all of it; raise repeat or tokens")
