"""Tiny random ``transformers`` models of five families with a tiny tokenizer, saved with
``save_pretrained`` and imported into stores: the fixtures of the inference, generation and
budget tests (support code, not a test module; the every-family matrix is
``test_hf_backend.py``, built by :mod:`hf_tiny`)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import transformers
from tierstore.hf import import_hf

ATOL = 1e-4
SENTENCES = [
    "the store keeps experts on fast disks",
    "a ring of slots holds the next layers",
    "tokens route to two experts in every layer",
    "the router picks experts and the cache keeps them",
]

COMMON: dict[str, Any] = dict(vocab_size=160, hidden_size=32, num_hidden_layers=3,
                              num_attention_heads=4, num_key_value_heads=2,
                              intermediate_size=48, max_position_embeddings=256,
                              bos_token_id=1, eos_token_id=2, pad_token_id=0)


def hf_config(family: str, **over: Any) -> Any:
    kw = dict(COMMON)
    if family == "mixtral":
        kw.update(num_local_experts=6, num_experts_per_tok=2)
        kw.update(over)
        return transformers.MixtralConfig(**kw)
    if family == "qwen2_moe":
        kw.update(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=24,
                  shared_expert_intermediate_size=40, mlp_only_layers=[1], norm_topk_prob=False)
        kw.update(over)
        return transformers.Qwen2MoeConfig(**kw)
    if family == "olmoe":
        kw.update(num_experts=6, num_experts_per_tok=2, norm_topk_prob=False)
        kw.update(over)
        return transformers.OlmoeConfig(**kw)
    if family == "qwen3_moe":
        kw.update(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=24, head_dim=16,
                  decoder_sparse_step=2, norm_topk_prob=True)
        kw.update(over)
        return transformers.Qwen3MoeConfig(**kw)
    if family == "deepseek_v3":  # MLA attention: head sizes of its own, no grouped queries
        kw.update(n_routed_experts=6, num_experts_per_tok=2, moe_intermediate_size=24,
                  n_shared_experts=1, first_k_dense_replace=1, n_group=2, topk_group=1,
                  kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=8,
                  v_head_dim=8, num_key_value_heads=4)
        kw.update(over)
        return transformers.DeepseekV3Config(**kw)
    raise ValueError(family)


def make_tokenizer(model_dir: Path) -> Any:
    """A small word-level tokenizer trained on a few sentences, saved as tokenizer.json."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordLevelTrainer(special_tokens=["<pad>", "<s>", "</s>", "<unk>"])
    tok.train_from_iterator(SENTENCES, trainer)
    os.makedirs(model_dir, exist_ok=True)
    tok.save(str(model_dir / "tokenizer.json"))
    return tok


def spread(model: Any) -> Any:
    """``model`` with weights drawn larger than the default init (norms near 1), so routing
    and attention are far from uniform."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.15)
    return model


def make_hf_model(family: str, model_dir: Path, seed: int = 0, save_original_format: bool = True,
                  max_shard_size: str | None = None, **over: Any) -> Any:
    """A random fp32 ``transformers`` model of ``family`` saved to ``model_dir`` with a tiny
    tokenizer. Weights are drawn larger than the default init so routing and attention are
    far from uniform. Shared with the inference tests (test_infer, test_generate)."""
    torch.manual_seed(seed)
    cfg = hf_config(family, **over)
    model = spread(transformers.AutoModelForCausalLM.from_config(cfg,
                                                                 attn_implementation="eager"))
    model.eval()
    kw: dict[str, Any] = {"save_original_format": save_original_format}
    if max_shard_size:
        kw["max_shard_size"] = max_shard_size
    model.save_pretrained(model_dir, **kw)
    make_tokenizer(model_dir)
    return model


def imported_path(family: str, root: Path, **kw: Any) -> tuple[Any, Path]:
    """A tiny ``family`` model saved under ``root / "hf"`` and imported into ``root /
    "store"``: (the transformers model, the store's path)."""
    hf = make_hf_model(family, root / "hf", **kw)
    import_hf(root / "hf", root / "store", progress=False)
    return hf, root / "store"


def prompt_ids(batch: int, t: int, vocab: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (batch, t), generator=g)




def load_bound(store: Any, device: str = "cpu", dtype: torch.dtype | None = None) -> Any:
    """The store's model with its experts modules bound and no source attached: each test
    attaches the source it is about (:func:`attached`). The store stays the caller's."""
    from tierstore.hf.loader import build

    model, _ = build(store, False, device=torch.device(device), dtype=dtype)
    return model


@contextlib.contextmanager
def attached(model: Any, source: Any, mode: str = "test") -> Iterator[Any]:
    """``source`` feeding ``model``'s experts for the block (left open: the test closes
    it)."""
    loaded = model.tierstore
    loaded.attach(source, mode, close_previous=False)
    try:
        yield model
    finally:
        loaded.detach()


def logits(model: Any, source: Any, ids: torch.Tensor, mask: torch.Tensor | None = None
           ) -> torch.Tensor:
    """Full-sequence logits with ``source`` feeding the experts."""
    with attached(model, source), torch.no_grad():
        return model(ids, attention_mask=mask).logits


def generate_with(model: Any, source: Any, prompts: list[list[int]], new: int,
                  eos: list[int] | tuple[int, ...] | None = (), **kw: Any) -> Any:
    """``tierstore.trainer.infer.generate`` with ``source`` attached; ``eos`` replaces the
    model's end-of-sequence ids (``()``: none, every row runs to ``new``; None: the
    model's)."""
    from tierstore.trainer.infer.generate import generate

    gen = model.generation_config
    saved = gen.eos_token_id
    if eos is not None:
        gen.eos_token_id = list(eos) or None
    try:
        with attached(model, source):
            return generate(model, prompts, new, **kw)
    finally:
        gen.eos_token_id = saved


def count_expert_calls(monkeypatch: Any) -> list[int]:
    """The layers of every call for a step's trainable experts, from now on (the list
    grows as they are made)."""
    from tierstore.trainer.train.expert_states import ExpertStates

    calls: list[int] = []
    real = ExpertStates.experts

    def counted(self: ExpertStates, layer: int, ids: list[int], x: torch.Tensor) -> Any:
        calls.append(layer)
        return real(self, layer, ids, x)

    monkeypatch.setattr(ExpertStates, "experts", counted)
    return calls


@contextlib.contextmanager
def daemon_serving(store: Path, sock: Path, host_cache: str = "64MiB") -> Iterator[None]:
    """``tierstore serve`` of ``store`` on ``sock`` for the block (ended with SIGTERM)."""
    import subprocess
    import sys
    import time

    proc = subprocess.Popen([sys.executable, "-m", "tierstore", "serve", "--store", str(store),
                             "--socket", str(sock), "--host-cache", host_cache],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for _ in range(600):
            if sock.exists():
                break
            if proc.poll() is not None:
                raise RuntimeError(proc.stderr.read() if proc.stderr else "the daemon ended")
            time.sleep(0.05)
        yield
    finally:
        proc.terminate()
        proc.wait(timeout=60)
