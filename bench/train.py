"""The store trainer against the resident trainer on the same model, data and seed.

Each round trains the model twice in this process, ``warmup + steps`` optimizer steps each:
once with everything in memory (``train_resident``, the ceiling) and once with the experts
and their AdamW moments in a fresh store (``train_store``). The order alternates between
rounds, so slow drift in a shared machine's load hits both sides alike. Reported per side: the
median step time over the measured steps of every round, tokens/s, and for the store the
stall fraction (time waiting for expert weights and moments over step time), host-cache hit
rate and bytes read from and written to the backing tier. The headline is the ratio of the
median step times (1.0: the store costs nothing; the target is at most 1.15 when the host
cache holds a step's working set).

With ``model_dir`` the model is a Hugging Face checkpoint instead of a preset: the store side
fine-tunes a fresh import of it (``tierstore import-hf``, not timed) and the resident side
trains the same weights, config and tokenized text in memory.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import tempfile
from collections.abc import Callable
from typing import Any

import torch
from tierstore.trainer import TrainConfig, model_size, train_resident, train_store
from tierstore.trainer.train.finetune import (
    finetune_config,
    imported_model,
    imported_state,
    tokenize_corpus,
)
from tierstore.trainer.train.resident import corpus_for, resolve_model_config
from tierstore.trainer.train.store_trainer import cuda_budget

import tierstore
from tierstore.devices import normalize_device

Metrics = dict[str, Any]


def _measured(history: list[Metrics], warmup: int) -> list[Metrics]:
    return [m for m in history if m["step"] > warmup]


def _side(rows: list[Metrics]) -> dict[str, Any]:
    times = [m["step_time_s"] for m in rows]
    out: dict[str, Any] = {
        "step_time_s": statistics.median(times),
        "step_time_spread_s": [min(times), max(times)],
        "tokens_per_s": statistics.median(m["tokens_per_s"] for m in rows),
        "steps_measured": len(rows),
    }
    if rows and rows[0].get("hit_rate") is not None:
        out["stall_frac"] = statistics.median(m["stall_frac"] for m in rows)
        out["hit_rate"] = statistics.fmean(m["hit_rate"] for m in rows)
        out["bytes_read_per_step"] = statistics.fmean(m["bytes_read"] for m in rows)
        out["bytes_written_per_step"] = statistics.fmean(m["bytes_written"] for m in rows)
        out["experts_touched_per_step"] = statistics.fmean(m["experts_touched"] for m in rows)
        out["peak_rss_bytes"] = max(m["peak_rss_bytes"] for m in rows)
    return out


def run_train_bench(
    *,
    model: str = "medium",
    steps: int = 10,
    warmup: int = 3,
    rounds: int = 2,
    host_cache: int | str = "2GiB",
    store: str | None = None,
    device: str = "cpu",
    overrides: dict[str, Any] | None = None,
    json_out: str | None = None,
    echo: Callable[[str], Any] = print,
    model_dir: str | None = None,
    engine: str = "auto",
) -> dict[str, Any]:
    """Run the comparison; returns (and optionally writes) the report. ``model_dir``: a
    Hugging Face checkpoint to fine-tune instead of the preset ``model``; ``engine``: the
    store's NVMe I/O engine (``tierstore.open``'s ``engine``)."""
    if steps < 1 or warmup < 0 or rounds < 1:
        raise ValueError("--steps and --rounds must be at least 1, --warmup at least 0")
    tc = TrainConfig(eval_every=0, **(overrides or {}))
    total = warmup + steps
    scratch = store or tempfile.mkdtemp(prefix="tierstore-bench-train-", dir=".")
    os.makedirs(scratch, exist_ok=True)
    try:
        if model_dir is not None:
            model = os.path.basename(os.path.normpath(model_dir))
            cfg, init, corpus, state_bytes = _imported(model_dir, scratch, tc)
        else:
            cfg, init, corpus = resolve_model_config(model, tc), None, corpus_for(tc)
            state_bytes = model_size(cfg).expert_state_bytes  # type: ignore[arg-type]
        resident: list[Metrics] = []
        stored: list[Metrics] = []
        backend = None
        echo(f"model {model}: {state_bytes / 2**20:.1f} MiB of expert states, "
             f"host cache {tierstore.format_size(tierstore.parse_size(host_cache))}, "
             f"{rounds} round(s) of {warmup} warm-up + {steps} measured steps per side")
        for r in range(rounds):
            for side in (("resident", "store") if r % 2 == 0 else ("store", "resident")):
                if side == "resident":
                    hist = train_resident(cfg, total, 0, tc, init_state=init, corpus=corpus,
                                          device=device)
                    resident += _measured(hist, warmup)
                else:
                    path = os.path.join(scratch, f"round-{r}")
                    shutil.rmtree(path, ignore_errors=True)
                    if model_dir is not None:
                        _import(model_dir, path)
                    st = _open_store(path, host_cache, engine, cfg, tc, device)
                    try:
                        backend = st.describe()
                        hist = train_store(None if model_dir else cfg, total, 0, tc,
                                           store_path=path, host_cache=host_cache,
                                           corpus=corpus, device=device, store=st)
                    finally:
                        st.close()
                    stored += _measured(hist, warmup)
                    shutil.rmtree(path, ignore_errors=True)
                last = _measured(hist, warmup)
                echo(f"  round {r + 1} {side:8s} median step "
                     f"{statistics.median(m['step_time_s'] for m in last) * 1e3:.1f} ms")
    finally:
        if store is None:
            shutil.rmtree(scratch, ignore_errors=True)
    res, st = _side(resident), _side(stored)
    report = {
        "model": model,
        "model_dir": model_dir,
        "config": cfg.to_dict(),
        "expert_state_bytes": state_bytes,
        "host_cache_bytes": tierstore.parse_size(host_cache),
        "device": str(device),
        "engine": engine,
        "backend": backend,
        "torch_threads": torch.get_num_threads(),
        "batch_tokens": tc.batch_size * tc.seq_len * tc.grad_accum,
        "warmup": warmup,
        "steps": steps,
        "rounds": rounds,
        "resident": res,
        "store": st,
        "step_time_ratio": st["step_time_s"] / res["step_time_s"],
        "target_ratio": 1.15,
    }
    echo(f"resident {res['step_time_s'] * 1e3:.1f} ms/step ({res['tokens_per_s']:,.0f} tok/s); "
         f"store {st['step_time_s'] * 1e3:.1f} ms/step ({st['tokens_per_s']:,.0f} tok/s), "
         f"stall {st['stall_frac']:.1%}, hit rate {st['hit_rate']:.1%}")
    echo(f"store / resident step time: {report['step_time_ratio']:.3f} (target <= 1.15)")
    if json_out:
        with open(json_out, "w") as f:
            json.dump(report, f, indent=2)
    return report


def _open_store(path: str, host_cache: int | str, engine: str, cfg: Any, tc: TrainConfig,
                device: str) -> tierstore.Store:
    """The store ``train_store`` would open for itself (the same host cache, and on CUDA the
    same device budget), opened here so that the I/O engine can be named."""
    dev = normalize_device(device)
    budget = {str(dev): cuda_budget(cfg, tc, dev)} if dev.type == "cuda" else None
    return tierstore.open(path, create=True, host_cache=host_cache, device_budget=budget,
                          engine=engine)


def _import(model_dir: str, path: str) -> None:
    from tierstore.trainer.infer.hf_import import import_hf

    import_hf(model_dir, path, progress=False)


def _imported(model_dir: str, scratch: str, tc: TrainConfig
              ) -> tuple[Any, dict[str, torch.Tensor], Any, int]:
    """The fine-tune's config, the imported weights (fp32), the corpus in the model's
    tokens and the bytes of its expert states (fp32 masters and two moments)."""
    path = os.path.join(scratch, "imported")
    shutil.rmtree(path, ignore_errors=True)
    _import(model_dir, path)
    try:
        with tierstore.open(path, host_cache=0) as st:
            model = imported_model(st)
            assert model is not None
            cfg = finetune_config(model, tc)
            init = imported_state(st, cfg)
            corpus = tokenize_corpus(corpus_for(tc), model.tokenizer(), cfg)
    finally:
        shutil.rmtree(path, ignore_errors=True)
    n_experts = len(cfg.moe_layers) * cfg.n_experts
    return cfg, init, corpus, n_experts * 3 * cfg.expert_bytes("float32")
