"""Synthetic Hugging Face MoE checkpoints for the inference benchmarks, in three shapes:

* ``mixtral``: eight experts of a wide SwiGLU FFN per layer, top-2, grouped-query attention;
* ``deepseek_v3``: multi-head latent attention, many small routed experts (top-6 of 64 by
  default) in groups with group-limited routing, a shared expert, a first dense layer;
* ``gpt_oss``: experts with biases in the transposed, interleaved layout and a clamped gate,
  attention sinks, alternating sliding-window layers.

Each is the family's own ``transformers`` class with random weights saved by
``save_pretrained`` in its default format, so every system reads the same file. Weights are
drawn with a standard deviation of 1/sqrt(fan-in), norms near 1, so activations stay O(1)
and greedy tokens are far from ties.
"""

from __future__ import annotations

from typing import Any

SHAPES = ("mixtral", "deepseek_v3", "gpt_oss")


def hf_config(shape: str, *, layers: int, experts: int, hidden: int, ffn: int,
              vocab: int) -> Any:
    """The ``transformers`` config of one shape."""
    import transformers

    heads = max(1, hidden // 64)
    common = dict(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
                  max_position_embeddings=4096, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                  tie_word_embeddings=False)
    if shape == "mixtral":
        return transformers.MixtralConfig(
            **common, intermediate_size=ffn, num_attention_heads=heads,
            num_key_value_heads=max(1, heads // 4), num_local_experts=experts,
            num_experts_per_tok=2)
    if shape == "deepseek_v3":
        groups = 8 if experts % 8 == 0 else 1
        return transformers.DeepseekV3Config(
            **common, intermediate_size=4 * ffn, moe_intermediate_size=ffn,
            num_attention_heads=heads, num_key_value_heads=heads, n_routed_experts=experts,
            num_experts_per_tok=min(6, experts), n_group=groups,
            topk_group=max(1, groups // 2), n_shared_experts=1, first_k_dense_replace=1,
            kv_lora_rank=max(16, hidden // 4), q_lora_rank=max(32, hidden // 2),
            qk_rope_head_dim=32, qk_nope_head_dim=32, v_head_dim=64,
            # What transformers' class always computes, said in config.json as DeepSeek-V3's
            # own says it: other readers of the file (llama.cpp's converter) go by these.
            scoring_func="sigmoid", topk_method="noaux_tc")
    if shape == "gpt_oss":
        return transformers.GptOssConfig(
            **common, intermediate_size=ffn, num_attention_heads=heads,
            num_key_value_heads=max(1, heads // 4), head_dim=64, num_local_experts=experts,
            num_experts_per_tok=min(4, experts), sliding_window=128)
    raise ValueError(f"unknown shape {shape!r}; choose one of {', '.join(SHAPES)}")


def write_hf_checkpoint(model_dir: str, shape: str = "mixtral", *, layers: int, experts: int,
                        hidden: int, ffn: int, vocab: int, seed: int = 0) -> None:
    """A ``shape`` checkpoint with random fp32 weights in ``model_dir`` (see the module
    docstring)."""
    import torch
    import transformers
    from tierstore.hf.families import experts_modules

    cfg = hf_config(shape, layers=layers, experts=experts, hidden=hidden, ffn=ffn, vocab=vocab)
    torch.manual_seed(seed)
    with torch.device("meta"):
        shell = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model = shell.to_empty(device="cpu")
    transposed = {id(p) for _, m in experts_modules(model) if m.is_transposed
                  for p in m.parameters(recurse=False)}
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                fan_in = p.shape[-2] if id(p) in transposed else p.shape[-1]
                p.normal_(0.0, fan_in ** -0.5)
        # to_empty left the buffers as uninitialised memory: the saved ones (score
        # corrections) start at zero; the rest (rotary tables) are not saved.
        for _, b in model.named_buffers():
            if b.is_floating_point():
                b.zero_()
    model.eval()
    model.save_pretrained(model_dir)
    del model, shell
