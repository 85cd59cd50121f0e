"""Inference throughput over the store: resident, ring at several K, expert mode, on demand.

One model and one set of prompts, run through every expert source:

- **resident**: every expert loaded onto the device first (the ceiling);
- **ring K**: K slots of one MoE layer's experts each, refilled behind the compute
  (``trainer.infer.ring``), for each K asked and for ``auto``;
- **expert**: routed experts only, the next layer's router predicting them, a device expert
  cache (``trainer.infer.expert_mode``);
- **on-demand**: each layer's routed experts read synchronously when it runs, nothing kept
  (``trainer.infer.sources.OnDemandSource``: what accelerate's offloading does).

Two phases. **Prefill** (many prompt tokens per pass): per-layer compute is large, the ring
should hide its transfers and run near the resident speed. **Decode** (one token per
sequence per pass): per-layer compute is small, the ring must move every layer's experts
for every token and is bound by the tier's bandwidth; its limit is ``bandwidth / bytes
read from the tier per token``, with the bandwidth measured in the same run, in every
round, by a timed ``Store.get_many`` of whole layers' experts through the same tier (and
through the prefetch queue; the faster of the two sets the limit).

Tiers (``tier``): ``nvme`` (or ``backing``, whatever the store's backing tier is): no host
cache, so every transfer reads the backing tier (O_DIRECT, crc32c-verified); ``host``: a
host cache holding every expert. On a CPU device the prefetch
queue lends views of pinned host-cache slots instead of copying (stage 2 is a pin), so on the
host tier no byte moves and a ring layer's "transfer" is the queue's control path: its cost
is measured the same way, as the queue's rate over whole layers.

The model is the store's (``--store``), an imported HF checkpoint (``--model-dir``), or by
default a synthetic Mixtral-shaped one written with random weights through the public API
(no ``transformers`` needed). Modes alternate in rounds; every round is kept in the results
and each mode reports its median. On a CPU the decode phase computes with one thread fewer
than the cores in every mode, leaving one to the queue's I/O threads.

With a peer (``--peer accelerate``) the benchmark is :mod:`tierstore.bench.peers`' study
instead: the same Hugging Face checkpoint through the peer and every mode, each run a fresh
process, cold, optionally under a memory limit.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from tierstore.hf.layout import stored_model
from tierstore.hf.loader import Loaded, build
from tierstore.hf.served import ServedModel
from tierstore.hf.strategies import make_source
from tierstore.trainer.infer.generate import GenerationResult, generate

import tierstore

from .hf_models import hf_config, write_hf_checkpoint
from .report import write_json

MiB = 1 << 20
TIERS = ("nvme", "backing", "host")


def check_synthetic(shape: str, layers: int, experts: int, hidden: int, ffn: int) -> None:
    """A ``ValueError`` naming what is wrong with a synthetic model's shape: what the
    family's config class refuses, and what an import of it would (two experts per token
    of one, say)."""
    from tierstore.hf.config import hf_config as checked

    cfg = hf_config(shape, layers=layers, experts=experts, hidden=hidden, ffn=ffn, vocab=512)
    try:
        checked(cfg.to_dict(), f"a synthetic {shape} model")
    except tierstore.StoreError as e:
        raise ValueError(str(e)) from None


def layer_names(served: ServedModel, layer: int) -> list[str]:
    """Every entry of one MoE layer's experts."""
    return [n for e in range(served.n_experts) for n in served.expert_names(layer, e)]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_bandwidth(store: tierstore.Store, served: ServedModel, device: torch.device,
                      repeats: int = 2) -> dict[str, Any]:
    """Bytes per second of ``get_many`` of whole MoE layers' experts onto ``device``, the
    path every source's transfers take (median over the layers and repeats)."""
    rates, nbytes = [], 0
    dev = None if device.type == "cpu" else device
    for _ in range(repeats):
        for layer in served.moe_layers:
            names = layer_names(served, layer)
            t0 = time.perf_counter()
            got = store.get_many(names, device=dev)
            _sync(device)
            dt = time.perf_counter() - t0
            nbytes = sum(t.numel() * t.element_size() for t in got.values())
            rates.append(nbytes / dt)
            del got
    return {"bytes_per_s": statistics.median(rates), "layer_bytes": nbytes,
            "t_transfer_layer_s": nbytes / statistics.median(rates)}


def _prompts(vocab: int, batch: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    # Lengths differ a little so that left padding is exercised.
    return [torch.randint(3, vocab, (max(1, length - 3 * i),), generator=g).tolist()
            for i in range(batch)]


def _tier_bytes(store: tierstore.Store) -> int:
    """Bytes the store has read from its backing tier so far."""
    return int(store.stats()["tiers"][store.backing]["bytes_read"])


def _run(model: Any, mode: str, prompts: list[list[int]], new_tokens: int, *,
         slots: int | str = "auto", budget: int | None = None, source: Any = None
         ) -> GenerationResult:
    """One generation in ``mode`` (a new source of it, or ``source``, kept open), with no
    end-of-sequence token: every run makes ``new_tokens`` tokens."""
    loaded: Loaded = model.tierstore
    made = source is None
    if made:
        source = make_source(mode, loaded.store, loaded.served, ring_slots=slots, budget=budget)
    loaded.attach(source, mode, close_previous=False)
    gen = model.generation_config
    saved = gen.eos_token_id
    gen.eos_token_id = None
    try:
        return generate(model, prompts, new_tokens, greedy=True, warm=False)
    finally:
        gen.eos_token_id = saved
        loaded.detach()
        if made:
            source.close()


def _row(name: str, res: GenerationResult, phase: str, stats: dict[str, Any],
         tier_bytes: int) -> dict[str, Any]:
    b = len(res.tokens)
    steps = max(len(t) for t in res.tokens) - 1  # the first new token came from prefill
    if phase == "prefill":
        tokens = stats["prompt_tokens"]
        seconds = res.prefill_s
    else:
        tokens = b * steps
        seconds = res.decode_s
    row = {"mode": name, "tokens": tokens, "seconds": seconds,
           "tokens_per_s": tokens / seconds if seconds > 0 else 0.0,
           "stall_frac": res.stall_frac,
           # every pass of the run (the prefill and each decode step) read this much
           "tier_bytes_per_pass": tier_bytes / (1 + steps)}
    for k in ("slots", "slot_history", "hit_rate", "spec_accuracy", "spec_precision",
              "spec_requested", "spec_skipped", "bytes_moved", "bytes_read", "t_compute_s",
              "t_transfer_s", "cache_bytes"):
        if res.source.get(k) is not None:
            row[k] = res.source[k]
    return row


def _median_row(tries: list[dict[str, Any]]) -> dict[str, Any]:
    """The median of a mode's rounds: its tokens/s, the other figures from the round at
    (or just below) the median; every round's tokens/s kept alongside."""
    rates = [r["tokens_per_s"] for r in tries]
    mid = statistics.median_low(rates)
    row = dict(next(r for r in tries if r["tokens_per_s"] == mid))
    row["tokens_per_s"] = statistics.median(rates)
    row["tokens_per_s_runs"] = rates
    return row


def _paired(runs: list[float], base: list[float]) -> float | None:
    """The median over rounds of ``runs[i] / base[i]`` (None if no base is positive)."""
    ratios = [a / b for a, b in zip(runs, base, strict=True) if b > 0]
    return statistics.median(ratios) if ratios else None


def run_infer(store_path: str | None = None, model_dir: str | None = None, *,
              json_out: str | None = None, layers: int = 8, experts: int = 8,
              hidden: int = 512, ffn: int = 1024, prefill_batch: int = 4,
              prefill_len: int = 128, decode_batch: int = 1, decode_tokens: int = 8,
              ring_slots: Sequence[int] = (2, 4), host_cache: int | None = None,
              expert_budget: float = 0.6, device: str | None = None, seed: int = 0,
              repeats: int = 5, tier: str = "backing", vocab: int | None = None,
              peer: str | None = None, memory_limit: str | float | int | None = None,
              cold: bool = True, device_budget: int | None = None,
              threads: int | None = None, engine: str = "auto", shape: str = "mixtral",
              quantized: str | None = None, echo: Callable[[str], Any] = print) -> dict[str, Any]:
    """Run the benchmark (see the module docstring); returns (and writes) the results.

    ``shape``: the synthetic checkpoint's (:data:`~.hf_models.SHAPES`) when neither
    ``store_path`` nor ``model_dir`` is given.

    With ``peer`` (``"accelerate"``) it is the study of :mod:`tierstore.bench.peers`
    instead: the checkpoint in ``model_dir`` (or a synthetic Mixtral-shaped one saved with
    ``transformers``) through the peer and every tierstore mode, one fresh process per run,
    ``repeats`` alternated rounds, one prompt of ``prefill_len`` tokens and
    ``decode_tokens`` greedy tokens, ``cold`` (page cache dropped before every run) and
    optionally under ``memory_limit`` (a size, or a fraction of the checkpoint's size).

    ``quantized`` (``mxfp4``, ``fp8``, with ``peer``): a synthetic checkpoint quantized as
    gpt-oss or DeepSeek-V3 ship theirs, against its bf16 twin (:func:`.peers.run_peer_study`).

    ``engine`` is the NVMe I/O engine the store is opened with (``tierstore.open``'s
    ``engine``: ``auto``, or ``posix-direct`` to measure the thread-pool fallback)."""
    if peer is not None:
        if engine != "auto":
            raise tierstore.StoreError("--engine applies to the in-process benchmark; the "
                                       "fresh processes of --peer open their stores with "
                                       "the default engine")
        if store_path is not None:
            raise tierstore.StoreError("--peer needs a Hugging Face checkpoint the peer can "
                                       "load: --model-dir, or none for a synthetic one (not "
                                       "--store)")
        from .peers import run_peer_study

        return run_peer_study(
            peer=peer, model_dir=model_dir, shape=shape, layers=layers, experts=experts,
            hidden=hidden,
            ffn=ffn, vocab=vocab or 32000, prompt_len=prefill_len, new_tokens=decode_tokens,
            rounds=repeats, memory_limit=memory_limit, cold=cold, host_cache=host_cache,
            device_budget=device_budget, seed=seed, threads=threads, json_out=json_out,
            quantized=quantized, device=device, echo=echo)
    if quantized is not None:
        raise tierstore.StoreError("--quantized applies to the fresh processes of --peer")
    if memory_limit is not None:
        raise tierstore.StoreError("--memory-limit applies to the fresh processes of --peer")
    if tier not in TIERS:
        raise tierstore.StoreError(f"unknown tier {tier!r}; choose one of {', '.join(TIERS)}")
    if repeats < 1:
        raise tierstore.StoreError(f"repeats must be at least 1, got {repeats}")
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    tmp = None
    try:
        if store_path is None:
            tmp = tempfile.mkdtemp(prefix="tierstore-infer-", dir=".")
            store_path = os.path.join(tmp, "store")
            if model_dir is not None:
                from tierstore.hf import import_hf

                import_hf(model_dir, store_path, progress=False)
            else:
                from tierstore.hf import import_hf

                model_dir = os.path.join(tmp, "hf")
                write_hf_checkpoint(model_dir, shape, layers=layers, experts=experts,
                                    hidden=hidden, ffn=ffn, vocab=vocab or 512, seed=seed)
                import_hf(model_dir, store_path, progress=False)
        # tier "nvme"/"backing": no host cache, so every transfer reads the backing tier
        # (O_DIRECT, checksums verified), the setting the store exists for; tier "host":
        # every expert fits the host cache.
        with tierstore.open(store_path, host_cache=0) as probe:
            every_expert = sum(probe.info(n).nbytes for m in stored_model(probe).experts
                               for e in range(m.num_experts) for a, parts in m.params
                               for n in (f"{m.prefix}.{e}.{p}" for p in parts))
            backing = probe.backing
        if tier == "nvme" and backing != "nvme":
            raise tierstore.StoreError(f"--tier nvme needs a store on NVMe; this one is on "
                                       f"{backing} (use --tier backing)")
        cache = host_cache
        if cache is None:  # tier host: room for every expert plus the per-slot rounding
            cache = int(every_expert * 1.25) + 64 * MiB if tier == "host" else 0
        with tierstore.open(store_path, host_cache=cache, engine=engine,
                            device_budget=device_budget or "1TiB") as store:
            return _bench(store, dev, json_out=json_out, prefill_batch=prefill_batch,
                          prefill_len=prefill_len, decode_batch=decode_batch,
                          decode_tokens=decode_tokens, ring_slots=ring_slots,
                          expert_budget=expert_budget, seed=seed, echo=echo,
                          host_cache=cache, repeats=repeats,
                          tier="host" if tier == "host" else backing)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def _queue_stats(store: tierstore.Store, device: torch.device) -> dict[str, Any]:
    dev = device
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return (store.stats().get("prefetch") or {}).get(str(dev)) or {}


def measure_queue_bandwidth(store: tierstore.Store, served: ServedModel,
                            device: torch.device) -> tuple[float, float]:
    """Bytes per second of whole MoE layers' experts through the store's device prefetch
    queue (the ring's and expert mode's transfer path): four layers requested at once, each
    at its own priority, timed until the last has landed; and the fraction of those bytes
    the queue read from the backing tier (the rest were host-cache hits)."""
    layers = served.moe_layers[:4]
    names = {layer: layer_names(served, layer) for layer in layers}
    before = _queue_stats(store, device)
    t0 = time.perf_counter()
    futures = [f for i, layer in enumerate(layers)
               for f in store.prefetch(names[layer], device=device, priority=i)]
    nbytes = sum(f.result().numel() * f.result().element_size() for f in futures)
    _sync(device)
    dt = time.perf_counter() - t0
    del futures
    store.cancel([n for layer in layers for n in names[layer]], device=device)
    after = _queue_stats(store, device)
    read = after.get("bytes_read", 0) - before.get("bytes_read", 0)
    return nbytes / dt, read / nbytes if nbytes else 0.0


def _echo_row(echo: Callable[[str], Any], phase: str, row: dict[str, Any]) -> None:
    echo(f"{phase:7s} {row['mode']:12s} {row['tokens_per_s']:9.1f} tokens/s  "
         f"stall {row['stall_frac'] * 100:5.1f} %"
         + (f"  K {row['slots']}" if "slots" in row else "")
         + (f"  hit {row['hit_rate']:.2f}" if row.get("hit_rate") is not None else "")
         + (f"  spec {row['spec_accuracy']:.2f}" if row.get("spec_accuracy") is not None
            else ""))


def _bench(store: tierstore.Store, dev: torch.device, *, json_out: str | None,
           prefill_batch: int, prefill_len: int, decode_batch: int, decode_tokens: int,
           ring_slots: Sequence[int], expert_budget: float, seed: int,
           echo: Callable[[str], Any], host_cache: int | None, repeats: int, tier: str
           ) -> dict[str, Any]:
    model, loaded = build(store, False, device=dev, dtype=None)
    served = loaded.served
    n_moe = len(served.moe_layers)
    one = served.expert_bytes()
    layer_bytes = served.n_experts * one
    vocab = int(model.config.get_text_config().vocab_size)
    total_expert_bytes = n_moe * layer_bytes
    echo(f"model: {loaded.stored.family} ({type(model).__name__}), {n_moe} MoE layers x "
         f"{served.n_experts} experts of {tierstore.format_size(one)}, "
         f"{tierstore.format_size(total_expert_bytes)} of experts; device {dev}; "
         f"experts from the {tier} tier ({store.describe()})")
    measure_bandwidth(store, served, dev, repeats=1)  # warms the host cache: one tier for all
    # The ring and expert mode switch the CPU queue to views when they start; so does the
    # bench, so that the queue's bandwidth is measured on their path from the first round.
    if dev.type == "cpu":
        store.prefetch_views(dev)
    ks = sorted({k for k in ring_slots if 1 <= k < n_moe})
    expert_bytes_budget = max(int(expert_budget * total_expert_bytes),
                              2 * served.n_experts * one + one * served.n_experts // 2)
    modes: list[tuple[str, str, Any, int | None]] = [("resident", "resident", "auto", None)]
    modes += [(f"ring K={k}", "ring", k, k * layer_bytes) for k in ks]
    modes += [("ring auto", "ring", "auto", max(ks, default=2) * layer_bytes)]
    modes += [("expert", "expert", "auto", expert_bytes_budget),
              ("on-demand", "on-demand", "auto", None)]
    resident_src = make_source("resident", store, served)
    results: dict[str, Any] = {
        "device": str(dev), "tier": tier, "backend": store.describe(),
        "model": {"family": loaded.stored.family, "class": type(model).__name__,
                  "moe_layers": n_moe, "experts": served.n_experts, "top_k": served.top_k,
                  "expert_bytes": one, "hf_config": loaded.stored.hf_config},
        "host_cache": host_cache,
        "expert_bytes_total": total_expert_bytes, "layer_bytes": layer_bytes,
        "repeats": repeats, "ring_auto_budget_bytes": max(ks, default=2) * layer_bytes,
        "expert_mode_budget_bytes": expert_bytes_budget}
    bw_get: list[float] = []
    bw_queue: list[float] = []
    queue_reads: list[float] = []
    threads = torch.get_num_threads()
    for phase in ("prefill", "decode"):
        if phase == "prefill":
            prompts = _prompts(vocab, prefill_batch, prefill_len, seed)
            new = 1
        else:
            prompts = _prompts(vocab, decode_batch, 8, seed + 1)
            new = decode_tokens
            if dev.type == "cpu":
                # On the CPU the queue's threads share the cores with the compute threads,
                # whose spin-waiting starves them while a decode step waits for experts; one
                # compute thread fewer leaves them a core (every mode alike).
                torch.set_num_threads(max(1, threads - 1))
        results.setdefault("compute_threads", {})[phase] = torch.get_num_threads()
        stats = {"prompt_tokens": sum(len(p) for p in prompts)}
        _run(model, "resident", prompts, min(new, 2), source=resident_src)  # warm-up
        # The queue holds four layers at once where get_many holds one: unmeasured, once,
        # so that neither is timed faulting in memory the process has not touched yet.
        measure_queue_bandwidth(store, served, dev)
        tries: dict[str, list[dict[str, Any]]] = {name: [] for name, *_ in modes}
        # Rounds interleave the modes, so that load from other work on a shared machine
        # falls on all of them alike; each mode reports its median round. The bandwidth is
        # measured in every round the same way.
        for _ in range(repeats):
            bw_get.append(measure_bandwidth(store, served, dev, repeats=1)["bytes_per_s"])
            rate, read_frac = measure_queue_bandwidth(store, served, dev)
            bw_queue.append(rate)
            queue_reads.append(read_frac)
            for name, mode, slots, budget in modes:
                before = _tier_bytes(store)
                res = _run(model, mode, prompts, new, slots=slots, budget=budget,
                           source=resident_src if mode == "resident" else None)
                tries[name].append(_row(name, res, phase, stats, _tier_bytes(store) - before))
        rows = []
        for name, *_ in modes:
            row = _median_row(tries[name])
            rows.append(row)
            _echo_row(echo, phase, row)
        results[phase] = {"prompts": len(prompts), "prompt_tokens": stats["prompt_tokens"],
                          "new_tokens": new, "rows": rows}
    torch.set_num_threads(threads)
    resident_src.close()
    loaded.close()
    # Bandwidths: medians of the rounds. The limit for reads from the backing tier is the
    # faster of get_many and the queue (a higher bandwidth makes a higher limit, so the
    # ratios against it are the conservative ones); on the host tier no byte is read and
    # the ring's per-layer cost is the queue's own (pins on a CPU, copies on CUDA).
    reads_tier = tier != "host"
    bw_get_med, bw_queue_med = statistics.median(bw_get), statistics.median(bw_queue)
    bw = max(bw_get_med, bw_queue_med) if reads_tier else bw_queue_med
    t_transfer = layer_bytes / bw
    results["bandwidth"] = {
        "get_many_bytes_per_s": bw_get_med, "queue_bytes_per_s": bw_queue_med,
        "get_many_runs": bw_get, "queue_runs": bw_queue,
        "queue_read_from_tier_frac": statistics.median(queue_reads),
        "bytes_per_s": bw, "t_transfer_layer_s": t_transfer,
        "limit_basis": ("bytes read from the backing tier per pass / the tier's bandwidth"
                        if reads_tier else
                        "no bytes read from the backing tier: the queue's per-layer cost")}
    echo(f"bandwidth: get_many {bw_get_med / 1e9:.2f} GB/s, prefetch queue "
         f"{bw_queue_med / 1e9:.2f} GB/s ({statistics.median(queue_reads):.0%} of it read from "
         f"the {tier} tier); one layer's experts: {t_transfer * 1e3:.1f} ms")
    for phase in ("prefill", "decode"):
        ph = results[phase]
        by = {r["mode"]: r for r in ph["rows"]}
        seq = ph["prompts"]
        passes = 1 if phase == "prefill" else max(by["resident"]["tokens"] / seq, 1)
        t_compute = by["resident"]["seconds"] / passes / n_moe
        ph.update(t_compute_layer_s=t_compute, t_transfer_layer_s=t_transfer,
                  compute_bound=t_compute >= t_transfer)
        resident = by["resident"]["tokens_per_s"]
        # A ring with K < MoE layers moves every layer's experts in every pass: it can go no
        # faster than the slower of computing (the resident speed) and moving them all.
        tokens_per_pass = ph["prompt_tokens"] if phase == "prefill" else seq
        move_limit = tokens_per_pass / (n_moe * t_transfer)
        limit = min(resident, move_limit) if resident else move_limit
        ph["ring_limit_tokens_per_s"] = limit
        ph["ring_move_limit_tokens_per_s"] = move_limit
        res_runs = by["resident"]["tokens_per_s_runs"]
        for r in ph["rows"]:
            # Against the run of the same round: load from other work on a shared machine
            # moves whole rounds (±15 % here), and the modes of one round run back to back.
            runs = r["tokens_per_s_runs"]
            r["vs_resident"] = _paired(runs, res_runs)
            r["vs_on_demand"] = _paired(runs, by["on-demand"]["tokens_per_s_runs"])
            r["vs_resident_of_medians"] = r["tokens_per_s"] / resident if resident else None
            if r["mode"].startswith("ring") and r.get("slots", n_moe) < n_moe:
                r["vs_ring_limit"] = _paired(runs, [min(x, move_limit) for x in res_runs])
                if reads_tier and move_limit < resident:  # transfer-bound: the bytes decide
                    r["vs_bandwidth_limit"] = r["tokens_per_s"] / move_limit
        echo(f"{phase}: per-layer compute {t_compute * 1e3:.1f} ms (resident), transfer "
             f"{t_transfer * 1e3:.1f} ms: "
             + ("compute-bound" if t_compute >= t_transfer else "transfer-bound")
             + f"; a ring's limit {limit:.1f} tokens/s")
        for r in ph["rows"]:
            if r["mode"] == "resident":
                continue
            extra = (f", {r['vs_bandwidth_limit']:.2f} of the bandwidth limit"
                     if "vs_bandwidth_limit" in r else "")
            echo(f"  {r['mode']:12s} {r['vs_resident']:.2f} x resident, "
                 f"{r['vs_on_demand']:.2f} x on-demand{extra}")
    write_json(json_out, results, echo)
    return results
