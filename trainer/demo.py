"""The training half of ``tierstore demo``: train a small MoE model whose experts live in a
store, check the store, then generate text from the trained model through the ring-memory
inferencer (and the expert-granular mode) reading the same store.

The host cache is deliberately smaller than the expert states, so the run exercises the
whole path: cache misses read crc32c-verified entries from the backing tier, dirty victims
are written back copy-on-write, checkpoints are snapshots.
"""

from __future__ import annotations

import shutil
import statistics
from collections.abc import Callable
from typing import Any

import tierstore

from .decoder import load_model
from .generate import decode_tokens, encode_prompts, generate, make_source
from .model import model_size
from .resident import TrainConfig, resolve_model_config
from .store_trainer import train_store

PROMPT = "def "


def run_demo_training(store: str, *, model: str = "small", steps: int = 60, seed: int = 0,
                      new_tokens: int = 48, echo: Callable[[str], Any] = print) -> int:
    """Train ``model`` for ``steps`` steps in a fresh store at ``store``, verify it, and
    generate from it; returns 0 when everything checked out."""
    from tqdm import tqdm

    shutil.rmtree(store, ignore_errors=True)
    tc = TrainConfig(eval_every=0)
    cfg = resolve_model_config(model, tc)
    states = model_size(cfg).expert_state_bytes
    cache = max(8 << 20, states // 2)
    echo("")
    echo(f"training: model {model} ({tierstore.format_size(states)} of expert states: weights "
         f"and AdamW moments) in {store}, host cache {tierstore.format_size(cache)}")
    with tqdm(total=steps, desc="train", unit="step", disable=None, dynamic_ncols=True) as bar:
        history = train_store(cfg, steps, seed, tc, store_path=store, host_cache=cache,
                              checkpoint_every=max(1, steps // 2),
                              on_step=lambda m: bar.update(1))
    tail = history[-min(10, len(history)):]
    echo(f"  loss           {history[0]['loss']:.3f} -> {history[-1]['loss']:.3f} over "
         f"{len(history)} steps, {statistics.median(m['tokens_per_s'] for m in tail):,.0f} "
         f"tokens/s, host cache hit rate {statistics.fmean(m['hit_rate'] for m in tail):.0%}")
    # Generation reads only the weights (a third of the states): the cache holds them all.
    moved = {"read": sum(m["bytes_read"] for m in history),
             "written": sum(m["bytes_written"] for m in history)}
    echo(f"  tiers          backing tier: {tierstore.format_size(moved['read'])} read, "
         f"{tierstore.format_size(moved['written'])} written back over the run; "
         f"{sum(m['evictions'] for m in history)} evictions, stall "
         f"{statistics.fmean(m['stall_frac'] for m in tail):.0%} of step time")
    with tierstore.open(store, host_cache=states // 2) as st:
        report = st.fsck()
        snaps = [s.tag for s in st.snapshots()]
        echo(f"  checkpoints    {', '.join(snaps)}; fsck: {report.entries} stored versions "
             f"verified, {'clean' if report.ok else report.problems}")
        net = load_model(st, "cpu")
        ids, tok = encode_prompts(st, "tierstore", [PROMPT])
        for mode in ("ring", "expert"):
            source = make_source(mode, st, net)
            try:
                res = generate(net, source, ids, new_tokens, greedy=True)
            finally:
                close = getattr(source, "close", None)
                if close is not None:
                    close()
            text = PROMPT + decode_tokens(tok, res.tokens[0])
            echo(f"  generate ({mode:6s}) {res.tokens_per_s:,.1f} tokens/s, stall "
                 f"{res.stall_frac:.0%}: {text!r}")
    return 0 if report.ok else 1
