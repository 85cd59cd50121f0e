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
fine-tunes a fresh import of it (``tierstore import-hf``, not timed) through its own
``transformers`` class, and the resident side fine-tunes the same ``transformers`` model with
every weight in memory and ``torch.optim.AdamW`` on one parameter per expert
(``trainer.train.hf_resident``), on the same tokenized text. ``peer="deepspeed"`` adds, after
the rounds, the same checkpoint under DeepSpeed ZeRO-3 with its parameters and optimizer
states offloaded to NVMe (:mod:`.peer_deepspeed_hf`), on the same batches for the same
steps, in a fresh process: its step time against the store side's, and its peak RSS.
"""

from __future__ import annotations

import math
import os
import shutil
import statistics
import tempfile
from collections.abc import Callable
from typing import Any

import torch
from tierstore.trainer import TrainConfig, model_size, train_resident, train_store
from tierstore.trainer.train.layout import preset_layout
from tierstore.trainer.train.resident import corpus_for, resolve_model_config, training_batches
from tierstore.trainer.train.store_trainer import cuda_budget

import tierstore
from tierstore.devices import normalize_device

from .report import write_json

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
    peer: str | None = None,
) -> dict[str, Any]:
    """Run the comparison; returns (and optionally writes) the report. ``model_dir``: a
    Hugging Face checkpoint to fine-tune instead of the preset ``model``; ``engine``: the
    store's NVMe I/O engine (``tierstore.open``'s ``engine``); ``peer``: ``"deepspeed"``
    to add DeepSpeed ZeRO-3 with NVMe offload on ``model_dir``."""
    if steps < 1 or warmup < 0 or rounds < 1:
        raise ValueError("--steps and --rounds must be at least 1, --warmup at least 0")
    if peer is not None and (peer != "deepspeed" or model_dir is None):
        raise ValueError("--peer deepspeed needs --model-dir (a Hugging Face checkpoint)")
    tc = TrainConfig(eval_every=0, **(overrides or {}))
    total = warmup + steps
    scratch = store or tempfile.mkdtemp(prefix="tierstore-bench-train-", dir=".")
    os.makedirs(scratch, exist_ok=True)
    ds: dict[str, Any] | None = None
    try:
        cfg: Any = None
        if model_dir is not None:
            model = os.path.basename(os.path.normpath(model_dir))
            described, corpus, state_bytes, autocast = _imported(model_dir, scratch, tc)
        else:
            cfg, corpus = resolve_model_config(model, tc), corpus_for(tc)
            described, state_bytes = cfg.to_dict(), model_size(cfg).expert_state_bytes
        resident: list[Metrics] = []
        stored: list[Metrics] = []
        backend = None
        echo(f"model {model}: {state_bytes / 2**20:.1f} MiB of expert states, "
             f"host cache {tierstore.format_size(tierstore.parse_size(host_cache))}, "
             f"{rounds} round(s) of {warmup} warm-up + {steps} measured steps per side")
        for r in range(rounds):
            for side in (("resident", "store") if r % 2 == 0 else ("store", "resident")):
                if side == "resident":
                    if model_dir is not None:
                        hist = _in_memory(model_dir, total, tc, corpus, device, autocast)
                    else:
                        hist = train_resident(cfg, total, 0, tc, corpus=corpus, device=device)
                    resident += _measured(hist, warmup)
                else:
                    path = os.path.join(scratch, f"round-{r}")
                    shutil.rmtree(path, ignore_errors=True)
                    if model_dir is not None:
                        _import(model_dir, path)
                    st = _open_store(path, host_cache, engine, cfg, tc, device)
                    try:
                        backend = st.describe()
                        hist = train_store(cfg, total, 0, tc,
                                           store_path=path, host_cache=host_cache,
                                           corpus=corpus, device=device, store=st)
                    finally:
                        st.close()
                    stored += _measured(hist, warmup)
                    shutil.rmtree(path, ignore_errors=True)
                last = _measured(hist, warmup)
                echo(f"  round {r + 1} {side:8s} median step "
                     f"{statistics.median(m['step_time_s'] for m in last) * 1e3:.1f} ms")
        if peer == "deepspeed" and model_dir is not None:
            ds = _deepspeed(model_dir, tc, corpus, total, warmup, os.path.join(scratch, "ds"))
    finally:
        if store is None:
            shutil.rmtree(scratch, ignore_errors=True)
    res, st = _side(resident), _side(stored)
    report = {
        "model": model,
        "model_dir": model_dir,
        "config": described,
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
    if ds is not None:
        report["deepspeed"] = ds
        if ds.get("ran"):
            report["deepspeed_step_time_ratio"] = ds["step_time_s"] / st["step_time_s"]
            echo(f"deepspeed zero-3 nvme {ds['step_time_s'] * 1e3:.1f} ms/step, peak RSS "
                 f"{ds['peak_rss_bytes'] / 2**20:,.0f} MiB; deepspeed / store step time: "
                 f"{report['deepspeed_step_time_ratio']:.3f}")
        else:
            echo(f"deepspeed zero-3 nvme did not run: {ds.get('cannot_run')}")
    write_json(json_out, report)
    return report


def _open_store(path: str, host_cache: int | str, engine: str, cfg: Any, tc: TrainConfig,
                device: str) -> tierstore.Store:
    """The store ``train_store`` would open for itself (the same host cache, and on CUDA the
    same device budget: a fine-tune's is set once its model is known), opened here so that
    the I/O engine can be named."""
    dev = normalize_device(device)
    budget = ({str(dev): cuda_budget(preset_layout(cfg), tc, dev)}
              if dev.type == "cuda" and cfg is not None else None)
    return tierstore.open(path, create=True, host_cache=host_cache, device_budget=budget,
                          engine=engine)


def _import(model_dir: str, path: str) -> None:
    import tierstore.hf

    tierstore.hf.import_hf(model_dir, path, progress=False)


def _imported(model_dir: str, scratch: str, tc: TrainConfig
              ) -> tuple[dict[str, Any], Any, int, bool]:
    """The checkpoint described (``family``, ``hf_config``), the corpus in the model's
    tokens, the bytes of its expert states (fp32 masters and two moments) and whether it
    computes in bf16, from an import of it."""
    from tierstore.hf.config import hf_config
    from tierstore.hf.layout import stored_model
    from tierstore.hf.tokenizer import load_tokenizer
    from tierstore.trainer.train.hf_finetune import compute_dtype, model_corpus

    path = os.path.join(scratch, "imported")
    shutil.rmtree(path, ignore_errors=True)
    _import(model_dir, path)
    try:
        with tierstore.open(path, host_cache=0) as st:
            sm = stored_model(st)
            tok = load_tokenizer(st)
            if tok is None:
                raise tierstore.StoreError(f"{model_dir} has no tokenizer.json to encode the "
                                           "training text with")
            corpus = model_corpus(corpus_for(tc), tok, hf_config(sm.hf_config, model_dir))
            numel = sum(m.num_experts * math.prod(st.info(f"{m.prefix}.0.{part}").shape)
                        for m in sm.experts for _, parts in m.params for part in parts)
    finally:
        shutil.rmtree(path, ignore_errors=True)
    described = {"family": sm.family, "hf_config": sm.hf_config}
    return described, corpus, 12 * numel, compute_dtype(sm.dtype, tc) == "bfloat16"


def _in_memory(model_dir: str, steps: int, tc: TrainConfig, corpus: Any, device: str,
               autocast: bool) -> list[Metrics]:
    """The checkpoint fine-tuned in memory (``trainer.train.hf_resident``), under the update
    rule the store's fine-tune runs (dense unless asked otherwise: what transformers with
    torch.optim.AdamW does)."""
    from tierstore.trainer.train.hf_resident import train_hf_resident
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return train_hf_resident(model, steps, 0, tc, corpus=corpus, device=device,
                             autocast=autocast, rule=tc.update_rule or "dense")[0]


def _deepspeed(model_dir: str, tc: TrainConfig, corpus: Any, steps: int, warmup: int,
               scratch: str) -> dict[str, Any]:
    """The peer on the batches the store side trained on (its sampler, seed 0)."""
    from .peer_deepspeed_hf import run_hf_peer

    sampler, _ = training_batches(tc, 0, corpus)
    batches = [sampler.next_batch() for _ in range(steps * tc.grad_accum)]
    return run_hf_peer(model_dir, batches, tc.grad_accum, tc.lr, warmup, scratch)
