"""Our MoE decoder against ``transformers``: tiny random models of every supported family,
saved with ``save_pretrained``, imported into a store, and compared logit for logit (fp32,
1e-4) on full sequences, through the KV cache, and on left-padded batches."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from tierstore.trainer.infer.hf_config import SUPPORTED_FAMILIES, build_from_hf
from tierstore.trainer.infer.hf_import import import_hf
from tierstore.trainer.infer.loading import load_model, load_tokenizer
from tierstore.trainer.infer.sources import OnDemandSource, ResidentSource
from tierstore.trainer.model import ModelConfig, MoEDecoder

import tierstore

transformers = pytest.importorskip("transformers")

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


def make_hf_model(family: str, model_dir: Path, seed: int = 0, save_original_format: bool = True,
                  max_shard_size: str | None = None, **over: Any) -> Any:
    """A random fp32 ``transformers`` model of ``family`` saved to ``model_dir`` with a tiny
    tokenizer. Weights are drawn larger than the default init so routing and attention are
    far from uniform. Shared with the inference tests (test_infer, test_generate)."""
    torch.manual_seed(seed)
    cfg = hf_config(family, **over)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.15)
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


def imported(family: str, tmp_path: Path, **kw: Any) -> tuple[Any, tierstore.Store]:
    hf, path = imported_path(family, tmp_path, **kw)
    return hf, tierstore.open(path)


def prompt_ids(batch: int, t: int, vocab: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (batch, t), generator=g)


def check_family(family: str, tmp_path: Path, **kw: Any) -> None:
    hf, store = imported(family, tmp_path, **kw)
    with store:
        model = load_model(store, "cpu", torch.float32)
        src = ResidentSource(store, model)
        ids = prompt_ids(2, 12, model.cfg.vocab_size)
        ref = hf(ids).logits
        # Full sequence, empty cache.
        ours = model(ids, src)
        assert ours.dtype == torch.float32
        torch.testing.assert_close(ours, ref, atol=ATOL, rtol=0)
        # Prefill 7 tokens, then one token at a time through the KV cache.
        cache = model.new_cache(2, 16)
        steps = [model(ids[:, :7], src, cache)]
        for j in range(7, 12):
            steps.append(model(ids[:, j:j + 1], src, cache))
        assert cache.length == 12
        torch.testing.assert_close(torch.cat(steps, dim=1), ref, atol=ATOL, rtol=0)
        # Left padding: row 0 padded by 4; its real tokens compute what they compute alone.
        mask = torch.ones(2, 12, dtype=torch.long)
        mask[0, :4] = 0
        padded = ids.clone()
        padded[0, :4] = 0
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        ref_pad = hf(padded, attention_mask=mask, position_ids=pos).logits
        cache = model.new_cache(2, 14)
        got = model(padded, src, cache, attention_mask=mask)
        torch.testing.assert_close(got[0, 4:], ref_pad[0, 4:], atol=ATOL, rtol=0)
        torch.testing.assert_close(got[1], ref[1], atol=ATOL, rtol=0)
        alone = hf(ids[:1, 4:]).logits
        torch.testing.assert_close(got[0, 4:], alone[0], atol=ATOL, rtol=0)
        # A decode step after the padded prefill, mask extended by the cache.
        nxt = prompt_ids(2, 1, model.cfg.vocab_size, seed=5)
        step = model(nxt, src, cache)
        full = hf(torch.cat([ids[:1, 4:], nxt[:1]], dim=1)).logits
        torch.testing.assert_close(step[0, 0], full[0, -1], atol=ATOL, rtol=0)
        # On-demand loading computes the same thing.
        od = OnDemandSource(store)
        torch.testing.assert_close(model(ids, od), ours, atol=0, rtol=0)
        assert od.loads > 0


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "olmoe", "qwen3_moe"])
def test_logits_match_transformers(family: str, tmp_path: Path) -> None:
    check_family(family, tmp_path)


def test_mixtral_fused_expert_layout(tmp_path: Path) -> None:
    check_family("mixtral", tmp_path, save_original_format=False)


def test_tied_embeddings_and_olmoe_renormalised(tmp_path: Path) -> None:
    check_family("olmoe", tmp_path, tie_word_embeddings=True, norm_topk_prob=True,
                 clip_qkv=2.0)


def test_qwen2_moe_sparse_step_and_renormalised(tmp_path: Path) -> None:
    check_family("qwen2_moe", tmp_path, mlp_only_layers=[], decoder_sparse_step=2,
                 norm_topk_prob=True, qkv_bias=False)


def test_sliding_window_mixtral(tmp_path: Path) -> None:
    hf, store = imported("mixtral", tmp_path, sliding_window=5)
    with store:
        model = load_model(store, "cpu")
        assert model.cfg.sliding_windows == (5,) * 3
        ids = prompt_ids(1, 12, model.cfg.vocab_size)
        torch.testing.assert_close(model(ids, ResidentSource(store, model)), hf(ids).logits,
                                   atol=ATOL, rtol=0)


def test_config_fields(tmp_path: Path) -> None:
    q2 = build_from_hf(hf_config("qwen2_moe").to_dict())
    assert q2.moe_layers == (0, 2) and q2.shared_ffn == 40 and q2.qkv_bias
    assert not q2.norm_topk_prob and q2.dense_ffn == 48 and q2.moe_ffn == 24
    q3 = build_from_hf(hf_config("qwen3_moe").to_dict())
    assert q3.moe_layers == (1,) and q3.qk_norm == "head" and q3.head_dim == 16
    ol = build_from_hf(hf_config("olmoe").to_dict())
    assert ol.qk_norm == "full" and not ol.norm_topk_prob
    mx = build_from_hf(hf_config("mixtral").to_dict())
    assert mx.norm_topk_prob and mx.eos_token_ids == (2,)
    assert mx.expert_bytes(torch.float32) == 3 * 32 * 48 * 4
    assert mx.expert_bytes("bfloat16") == 3 * 32 * 48 * 2
    assert ModelConfig.from_dict(mx.to_dict()) == mx
    with torch.device("meta"):
        m = MoEDecoder(q2)
    assert m.next_moe_layer(0) == 2 and m.next_moe_layer(2) is None
    assert not any(".experts." in n for n in m.state_dict())


def test_unsupported_architecture_names_the_supported() -> None:
    cfg = {"model_type": "llama", "architectures": ["LlamaForCausalLM"]}
    with pytest.raises(ValueError) as e:
        build_from_hf(cfg)
    for fam in SUPPORTED_FAMILIES:
        assert fam in str(e.value)
    assert "LlamaForCausalLM" in str(e.value)


def test_router_topk_and_tokenizer(tmp_path: Path) -> None:
    _, store = imported("qwen3_moe", tmp_path)
    with store:
        model = load_model(store, "cpu")
        x = torch.randn(5, model.cfg.hidden_size)
        ids, w = model.router_topk(1, x)
        assert ids.shape == (5, 2) and w.dtype == torch.float32
        torch.testing.assert_close(w.sum(-1), torch.ones(5))
        with pytest.raises(ValueError):
            model.router_topk(0, x)
        tok = load_tokenizer(store)
        assert tok is not None
        enc = tok.encode(SENTENCES[0])
        assert tok.decode(enc.ids) == SENTENCES[0]


@pytest.mark.parametrize("moe_every", [1, 2])
def test_trainer_checkpoint_through_decoder(tmp_path: Path, moe_every: int) -> None:
    """A store the trainer wrote (family "tierstore"): the decoder over its latest checkpoint
    computes what trainer.model.MoEModel computes."""
    from dataclasses import replace

    from tierstore.trainer.model import MoEModel
    from tierstore.trainer.presets import PRESETS
    from tierstore.trainer.train.checkpoint import DENSE_ENTRY
    from tierstore.trainer.train.checkpoint import unpack as _unpack
    from tierstore.trainer.train.data import load_corpus
    from tierstore.trainer.train.resident import TrainConfig
    from tierstore.trainer.train.store_trainer import train_store

    cfg = replace(PRESETS["tiny"], moe_every=moe_every)
    tc = TrainConfig(batch_size=2, seq_len=16, eval_every=0, lr=1e-2)
    train_store(cfg, 3, seed=4, train=tc, corpus=load_corpus(max_bytes=64 * 1024),
                store_path=tmp_path / "st", host_cache="4MiB", slab_size="16MiB")
    with tierstore.open(tmp_path / "st") as store:
        model = load_model(store, "cpu")
        assert model.cfg.family == "tierstore" and model.cfg.moe_layers == tuple(cfg.moe_layers)
        assert load_tokenizer(store) is None
        ref = MoEModel(cfg, resident_experts=False)
        ref.load_state_dict(_unpack(store.get(*DENSE_ENTRY))["model"])
        ref.eval()

        def provider(layer: int, ids: list[int]) -> dict[int, Any]:
            src = OnDemandSource(store, model)
            return dict(src.experts(layer, ids, torch.empty(0)))

        ids = prompt_ids(2, 20, 256)
        with torch.no_grad():
            want = ref(ids, experts=provider)[0]
        got = model(ids, ResidentSource(store, model))
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
        cache = model.new_cache(2, 24)
        steps = [model(ids[:, :15], OnDemandSource(store), cache)]
        steps += [model(ids[:, j:j + 1], OnDemandSource(store), cache) for j in range(15, 20)]
        torch.testing.assert_close(torch.cat(steps, 1), want, atol=1e-5, rtol=0)


def greedy(model: MoEDecoder, source: Any, prompts: list[list[int]], n: int) -> list[list[int]]:
    """Left-padded batched greedy decoding through the KV cache (no stop tokens)."""
    t = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), t, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, t - len(p):] = torch.tensor(p)
        mask[i, t - len(p):] = 1
    cache = model.new_cache(len(prompts), t + n)
    logits = model(ids.to(model.device), source, cache, attention_mask=mask.to(model.device))
    out = []
    for _ in range(n):
        nxt = logits[:, -1].argmax(-1, keepdim=True)
        out.append(nxt)
        # The new token's mask alone: the cache keeps the prompt's padding.
        logits = model(nxt, source, cache, attention_mask=torch.ones_like(nxt))
    return torch.cat(out, 1).tolist()


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "olmoe", "qwen3_moe"])
def test_greedy_matches_generate(family: str, tmp_path: Path) -> None:
    """Positions and masks under left padding are what transformers' generate uses."""
    hf, store = imported(family, tmp_path)
    prompts = [[5, 9, 12, 40, 33, 7, 8], [17, 22, 3]]
    with store:
        model = load_model(store, "cpu")
        ours = greedy(model, ResidentSource(store, model), prompts, 8)
    ids = torch.tensor([prompts[0], [0] * 4 + prompts[1]])
    mask = (torch.arange(7)[None] >= torch.tensor([[0], [4]])).long()
    ref = hf.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False,
                      eos_token_id=None, pad_token_id=0)[:, 7:]
    assert ours == ref.tolist()


@pytest.mark.gpu
def test_cuda_matches_cpu(tmp_path: Path) -> None:
    hf, store = imported("qwen2_moe", tmp_path)
    with store:
        model = load_model(store, "cuda", torch.float32)
        ids = prompt_ids(2, 12, model.cfg.vocab_size)
        ref = hf(ids).logits
        got = model(ids.cuda(), ResidentSource(store, model)).cpu()
        torch.testing.assert_close(got, ref, atol=ATOL, rtol=0)
        got = model(ids.cuda(), OnDemandSource(store)).cpu()
        torch.testing.assert_close(got, ref, atol=ATOL, rtol=0)
        prompts = [[5, 9, 12, 40, 33, 7, 8], [17, 22, 3]]
        cpu = load_model(store, "cpu")
        assert greedy(model, OnDemandSource(store), prompts, 6) == \
            greedy(cpu, ResidentSource(store, cpu), prompts, 6)
        bf = load_model(store, "cuda", torch.bfloat16)
        out = bf(ids.cuda(), ResidentSource(store, bf))
        assert out.dtype == torch.float32 and torch.isfinite(out).all()


def test_older_config_keys() -> None:
    """transformers 4.x configs: top-level rope_theta/rope_scaling and torch_dtype."""
    d = hf_config("mixtral").to_dict()
    d.pop("rope_parameters")
    d.pop("dtype", None)
    d.update(rope_theta=5e5, rope_scaling={"type": "linear", "factor": 2.0},
             torch_dtype="bfloat16")
    cfg = build_from_hf(d)
    assert (cfg.rope_theta, cfg.rope_scale, cfg.dtype) == (5e5, 2.0, "bfloat16")
    d.update(rope_scaling={"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(ValueError, match="yarn"):
        build_from_hf(d)
    d = hf_config("olmoe").to_dict()
    d.pop("model_type")
    d["architectures"] = ["OlmoeForCausalLM"]
    assert build_from_hf(d).family == "olmoe"  # told by the architecture alone
