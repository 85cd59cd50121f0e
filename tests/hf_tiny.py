"""Tiny random checkpoints of the installed transformers' MoE families (placeholder)."""

from __future__ import annotations

from pathlib import Path

import torch

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=64, moe_intermediate_size=32,
            expert_intermediate_size=32, shared_expert_intermediate_size=32, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, n_routed_experts=8,
            num_experts=8, num_local_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
            kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8,
            v_head_dim=16, max_position_embeddings=256, first_k_dense_replace=1,
            n_shared_experts=1, num_shared_experts=1, moe_topk=2, top_k=2,
            num_experts_per_topk=2, sliding_window=32, bos_token_id=1, eos_token_id=2,
            pad_token_id=0)


class TinyUnavailable(Exception):
    pass


def tiny_config(model_type: str):
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    d = CONFIG_MAPPING[model_type]().to_dict()
    kw = {k: v for k, v in TINY.items() if k in d}
    if "qk_rope_head_dim" in d:
        kw.pop("head_dim", None)
        kw["num_key_value_heads"] = kw.get("num_attention_heads", 4)
    try:
        return CONFIG_MAPPING[model_type](**kw)
    except Exception as e:  # noqa: BLE001
        raise TinyUnavailable(f"{model_type}: {str(e).splitlines()[0]}") from e


def tiny_checkpoint(model_type: str, out_dir: Path, seed: int = 0) -> Path:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = tiny_config(model_type)
    try:
        model = AutoModelForCausalLM.from_config(cfg)
        model(torch.zeros(1, 2, dtype=torch.long))
    except Exception as e:  # noqa: BLE001
        raise TinyUnavailable(f"{model_type}: {type(e).__name__}: "
                              f"{str(e).splitlines()[0][:120]}") from e
    n = None
    for m in model.modules():
        if hasattr(m, "num_experts") and hasattr(m, "down_proj"):
            n = int(m.num_experts)
    h = cfg.get_text_config().hidden_size
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2 and tuple(p.shape) == (n, h) and "experts" not in name:
                p.normal_(0.0, 1.0)
    model.save_pretrained(out_dir)
    return Path(out_dir)
