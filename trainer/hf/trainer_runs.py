"""A ``tierstore train`` run read as the ``transformers`` model that computes what it does.

The trainer's own model (:mod:`trainer.model`, family ``tierstore``) is a plain decoder:
full multi-head rotary attention, RMSNorm, SwiGLU experts with Mixtral's renormalised top-k
routing, untied head, and optionally dense SwiGLU layers between the MoE ones. Mixtral is
that model when every layer is an MoE layer; Qwen2-MoE otherwise, its dense layers as
``mlp_only_layers`` and its obligatory shared expert one unit wide and all zeros (which
adds exactly nothing: a sigmoid gate of 0.5 times zeros). The run's experts keep their
entries (``layers.{i}.experts.{e}.w1|w2|w3``): ``w1`` and ``w3`` are the two halves of the
module's ``gate_up_proj``, joined at compute time; the dense weights come from the run's
latest checkpoint, renamed. The trainer keeps fp32 masters whatever it computed in, so the
model is read in fp32.
"""

from __future__ import annotations

from typing import Any

import torch

import tierstore

from .layout import ExpertsModule, StoredModel

_ATTN = {"wq": "q_proj", "wk": "k_proj", "wv": "v_proj", "wo": "o_proj"}
_PROJ = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}


def hf_name(name: str) -> str:
    """``transformers``' name of one of the trainer model's dense tensors."""
    if name == "tok_emb.weight":
        return "model.embed_tokens.weight"
    if name == "norm.weight":
        return "model.norm.weight"
    if name == "lm_head.weight":
        return name
    _, i, part, rest = name.split(".", 3)
    p = f"model.layers.{i}."
    if part == "attn_norm":
        return p + "input_layernorm.weight"
    if part == "ffn_norm":
        return p + "post_attention_layernorm.weight"
    if part == "attn":
        sub, what = rest.split(".")
        return f"{p}self_attn.{_ATTN[sub]}.{what}"
    if part == "router":
        return f"{p}mlp.gate.weight"
    if part == "mlp":
        return f"{p}mlp.{_PROJ[rest]}.weight"
    raise ValueError(f"no transformers name for {name}")


def hf_config_of(cfg: Any, dtype: str = "float32") -> tuple[dict[str, Any], dict[str, list[int]]]:
    """``config.json`` of the ``transformers`` architecture a trainer model is (``cfg``: its
    :class:`trainer.model.ModelConfig`, family ``tierstore``), and the tensors that are
    zeros (name -> shape)."""
    hf: dict[str, Any] = {
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim, "hidden_act": "silu",
        "max_position_embeddings": cfg.max_position, "rms_norm_eps": cfg.norm_eps,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "tie_word_embeddings": False, "num_experts_per_tok": cfg.top_k,
        "bos_token_id": cfg.bos_token_id, "pad_token_id": cfg.pad_token_id,
        "eos_token_id": (list(cfg.eos_token_ids) if len(cfg.eos_token_ids) > 1 else
                         cfg.eos_token_ids[0] if cfg.eos_token_ids else None),
        "initializer_range": cfg.init_std, "attention_dropout": 0.0, "use_cache": True,
        "output_router_logits": False, "router_aux_loss_coef": cfg.router_aux_coef,
        "dtype": dtype,
    }
    zeros: dict[str, list[int]] = {}
    dense_layers = [i for i in range(cfg.n_layers) if i not in cfg.moe_layers]
    if not dense_layers:
        hf.update(model_type="mixtral", architectures=["MixtralForCausalLM"],
                  intermediate_size=cfg.moe_ffn, num_local_experts=cfg.n_experts,
                  sliding_window=None, router_jitter_noise=0.0)
    else:
        h = cfg.hidden_size
        hf.update(model_type="qwen2_moe", architectures=["Qwen2MoeForCausalLM"],
                  intermediate_size=cfg.dense_ffn, moe_intermediate_size=cfg.moe_ffn,
                  num_experts=cfg.n_experts, decoder_sparse_step=1,
                  mlp_only_layers=dense_layers, shared_expert_intermediate_size=1,
                  norm_topk_prob=True, qkv_bias=False, use_sliding_window=False,
                  sliding_window=None, max_window_layers=cfg.n_layers,
                  layer_types=["full_attention"] * cfg.n_layers)
        for i in cfg.moe_layers:
            p = f"model.layers.{i}.mlp.shared_expert"
            zeros.update({f"{p}.gate_proj.weight": [1, h], f"{p}.up_proj.weight": [1, h],
                          f"{p}.down_proj.weight": [h, 1], f"{p}_gate.weight": [1, h]})
    return hf, zeros


def experts_modules(cfg: Any) -> list[ExpertsModule]:
    return [ExpertsModule(f"model.layers.{i}.mlp.experts", f"layers.{i}.experts", cfg.n_experts,
                          [("gate_up_proj", ["w1", "w3"]), ("down_proj", ["w2"])])
            for i in cfg.moe_layers]


def trainer_run_model(store: tierstore.Store) -> StoredModel:
    """The run in ``store`` as a :class:`StoredModel` (see the module docstring)."""
    from tierstore.trainer.presets import MoEConfig
    from tierstore.trainer.train.checkpoint import latest_dense_state

    payload = latest_dense_state(store)
    if payload is None or "model" not in payload:
        raise tierstore.StoreError(
            f"store {store.path} holds no model: import one with `tierstore import-hf` or "
            "train one with `tierstore train`")
    cfg = MoEConfig.from_dict(payload["model_config"]).model_config()
    hf, zeros = hf_config_of(cfg)
    state = {hf_name(k): v.to(torch.float32) for k, v in payload["model"].items()
             if ".experts." not in k and not k.startswith("rope_")}
    return StoredModel(family=hf["model_type"], hf_config=hf, experts=experts_modules(cfg),
                       dense={}, dtype="float32", zeros=zeros, dense_state=state,
                       step=int(payload["step"]))
