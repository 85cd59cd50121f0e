"""The training half of ``tierstore demo``: train a small MoE model whose experts live in a
store, check the store, then generate text from the trained model through the
:mod:`tierstore.hf` backend (the run read as its ``transformers`` architecture) in ring mode
and in expert mode, reading the same store, and compare their tokens with those of the same
model held entirely in memory.

The host cache is deliberately smaller than the expert states, so the run exercises the
whole path: cache misses read crc32c-verified entries from the backing tier, dirty victims
are written back copy-on-write, checkpoints are snapshots. The ending is there to be judged:
the loss curve, the generated text, and whether offloaded generation reproduced the
in-memory model's tokens exactly. The corpus is the Zen of Python, short enough for a
minute of CPU training to pick up its words (on the standard library, that much training
learns little beyond spaces), so the text shows what was learned.
"""

from __future__ import annotations

import ast
import codecs
import shutil
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from tierstore.hf import load

import tierstore

from ..infer.generate import decode_tokens, generate
from ..model import EXPERT_WEIGHTS, MoEModel, expert_name
from ..presets import MoEConfig, model_size
from .checkpoint import latest_dense_state
from .data import Corpus, decode, default_corpus_root
from .resident import Metrics, TrainConfig, resolve_model_config
from .store_trainer import train_store

PROMPT = "Beautiful is "
MODES = ("ring", "expert")
_BARS = "▁▂▃▄▅▆▇█"


@dataclass
class DemoResult:
    """What the training demo did: the run's metrics, fsck's verdict, and the greedy tokens
    after ``prompt`` of the in-memory model and of each offloaded mode."""

    history: list[Metrics]
    fsck_ok: bool
    prompt: str
    reference: list[int]
    text: str  # the prompt and the in-memory model's continuation
    generated: dict[str, list[int]] = field(default_factory=dict)

    @property
    def identical(self) -> bool:
        return bool(self.generated) and all(t == self.reference
                                            for t in self.generated.values())

    @property
    def continuation(self) -> str:
        """The text the model added after the prompt."""
        return self.text[len(self.prompt):]

    @property
    def ok(self) -> bool:
        """The store is sound and offloading changed no token (how much the model learned
        is for the reader to judge)."""
        return self.fsck_ok and self.identical


def zen_corpus() -> Corpus:
    """The Zen of Python as a corpus: the standard library's ``this.py`` keeps it
    rot13-encoded in ``s``. The demo never validates, so both splits hold all of it."""
    path = default_corpus_root() / "this.py"
    tree = ast.parse(path.read_text(encoding="utf-8"))
    encoded = next(node.value.value for node in tree.body
                   if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
                   and any(isinstance(t, ast.Name) and t.id == "s" for t in node.targets))
    data = np.frombuffer(codecs.decode(encoded, "rot13").encode("utf-8"), dtype=np.uint8)
    return Corpus(data.copy(), data.copy(), [path.name], [path.name], [str(path.parent)])


def sparkline(values: Sequence[float], width: int = 40) -> str:
    """``values`` as a row of block characters, lowest ``▁`` to highest ``█``, averaged
    down to at most ``width`` columns."""
    if not values:
        return ""
    cols = min(width, len(values))
    means = [statistics.fmean(values[i * len(values) // cols:(i + 1) * len(values) // cols])
             for i in range(cols)]
    lo, hi = min(means), max(means)
    span = (hi - lo) or 1.0
    return "".join(_BARS[round((v - lo) / span * (len(_BARS) - 1))] for v in means)


@torch.no_grad()
def in_memory_tokens(store: tierstore.Store, prompt: list[int], new_tokens: int) -> list[int]:
    """Greedy tokens after ``prompt`` from the store's latest checkpoint loaded whole into
    an in-memory :class:`trainer.model.MoEModel` (dense state and every expert, as the
    resident trainer holds them), each token from a full forward pass over the sequence so
    far: no KV cache, no expert source."""
    payload = latest_dense_state(store)
    if payload is None:
        raise tierstore.StoreError(f"store {store.path} holds no trained model")
    cfg = MoEConfig.from_dict(payload["model_config"])
    net = MoEModel(cfg, seed=None)
    state = dict(payload["model"])
    state.update(store.get_many([expert_name(layer, e, w) for layer in cfg.moe_layers
                                 for e in range(cfg.n_experts) for w in EXPERT_WEIGHTS]))
    net.load_state_dict(state)
    net.eval()
    ids = torch.tensor([prompt], dtype=torch.long)
    out: list[int] = []
    for _ in range(new_tokens):
        logits = net(ids)[0]
        nxt = int(logits[0, -1].argmax())
        out.append(nxt)
        ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
    return out


def demo_training(store: str, *, model: str = "small", steps: int = 60, seed: int = 0,
                  new_tokens: int = 48, prompt: str = PROMPT,
                  echo: Callable[[str], Any] = print) -> DemoResult:
    """Train ``model`` on :func:`zen_corpus` for ``steps`` steps in a fresh store at
    ``store``, verify the store, and generate ``new_tokens`` greedy tokens after ``prompt``
    in memory (:func:`in_memory_tokens`) and through each of :data:`MODES`, reporting as it
    goes."""
    from tqdm import tqdm

    shutil.rmtree(store, ignore_errors=True)
    tc = TrainConfig(eval_every=0)
    cfg = resolve_model_config(model, tc)
    corpus = zen_corpus()
    states = model_size(cfg).expert_state_bytes
    cache = max(8 << 20, states // 2)
    first_line = next(line for line in decode(corpus.train).splitlines()[1:] if line)
    echo("")
    echo(f"training: model {model} ({tierstore.format_size(states)} of expert states: weights "
         f"and AdamW moments) in {store}, host cache {tierstore.format_size(cache)}, on the "
         f"Zen of Python ({corpus.train.size} bytes: {first_line!r} ...)")
    with tqdm(total=steps, desc="train", unit="step", disable=None, dynamic_ncols=True) as bar:
        history = train_store(cfg, steps, seed, tc, store_path=store, host_cache=cache,
                              corpus=corpus, checkpoint_every=max(1, steps // 2),
                              on_step=lambda m: bar.update(1))
    tail = history[-min(10, len(history)):]
    losses = [m["loss"] for m in history]
    echo(f"  loss           {losses[0]:.3f} -> {losses[-1]:.3f} over {len(history)} steps  "
         f"{sparkline(losses)}")
    echo(f"  speed          {statistics.median(m['tokens_per_s'] for m in tail):,.0f} "
         f"tokens/s, host cache hit rate {statistics.fmean(m['hit_rate'] for m in tail):.0%}")
    moved = {"read": sum(m["bytes_read"] for m in history),
             "written": sum(m["bytes_written"] for m in history)}
    echo(f"  tiers          backing tier: {tierstore.format_size(moved['read'])} read, "
         f"{tierstore.format_size(moved['written'])} written back over the run; "
         f"{sum(m['evictions'] for m in history)} evictions, stall "
         f"{statistics.fmean(m['stall_frac'] for m in tail):.0%} of step time")
    # Generation reads only the weights (a third of the states): the cache holds them all.
    with tierstore.open(store, host_cache=states // 2) as st:
        report = st.fsck()
        snaps = [s.tag for s in st.snapshots()]
        echo(f"  checkpoints    {', '.join(snaps)}; fsck: {report.entries} stored versions "
             f"verified, {'clean' if report.ok else report.problems}")
        ids = [list(prompt.encode("utf-8"))]  # a trainer run's tokens are bytes
        tok = None
        reference = in_memory_tokens(st, ids[0], new_tokens)
        result = DemoResult(history, report.ok, prompt, reference,
                            prompt + decode_tokens(tok, reference))
        echo(f"  generate       {new_tokens} greedy tokens after {prompt!r}, every expert in "
             f"memory:")
        echo(f"                 {result.text!r}")
        for mode in MODES:
            model = load(st, mode=mode, device="cpu")
            try:
                res = generate(model, ids, new_tokens, greedy=True)
            finally:
                model.tierstore.close()
            result.generated[mode] = res.tokens[0]
            same = "yes" if res.tokens[0] == reference else "NO"
            echo(f"  generate ({mode:6s}) experts from the store, {res.tokens_per_s:,.1f} "
                 f"tokens/s, stall {res.stall_frac:.0%}: identical to the in-memory model: "
                 f"{same}")
    return result


def run_demo_training(store: str, *, model: str = "small", steps: int = 60, seed: int = 0,
                      new_tokens: int = 48, echo: Callable[[str], Any] = print) -> int:
    """Train ``model`` for ``steps`` steps in a fresh store at ``store``, verify it, and
    generate from it (see :func:`demo_training`); returns 0 when everything checked out:
    fsck clean, and offloaded generation identical to the in-memory model."""
    return 0 if demo_training(store, model=model, steps=steps, seed=seed,
                              new_tokens=new_tokens, echo=echo).ok else 1
