"""Tiny quantized checkpoints as the shipped ones are laid out: gpt-oss in MXFP4 (experts'
``*_blocks`` / ``*_scales``) and DeepSeek-V3 in 128x128 block FP8 (per-expert and dense
``weight`` in float8_e4m3fn beside its ``weight_scale_inv``), each quantized here from a
random tiny model, with the ``quantization_config`` transformers reads. Test support code,
not a test module."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
MXFP4_CONFIG = {"quant_method": "mxfp4", "modules_to_not_convert": [
    "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
FP8_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
              "weight_block_size": [128, 128]}
BLOCK = 128


def mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [..., R, H]`` as MXFP4: blocks ``[..., R, H/32, 16]`` (two e2m1 codes a byte, the
    even element in the low nibble) and E8M0 scales ``[..., R, H/32]`` (bias 127)."""
    g = w.float().reshape(*w.shape[:-1], w.shape[-1] // 32, 32)
    amax = g.abs().amax(-1).clamp_min(2.0 ** -100)
    exp = torch.floor(torch.log2(amax)) - 2  # 6 = 1.5 * 2^2 is e2m1's largest
    x = g / torch.exp2(exp).unsqueeze(-1)
    lut = torch.tensor(E2M1)
    codes = (x.unsqueeze(-1) - lut).abs().argmin(-1).to(torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks.contiguous(), (exp + 127).to(torch.uint8)


def fp8_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [R, C]`` (multiples of 128) as DeepSeek's FP8: e4m3 weights and one fp32
    ``weight_scale_inv`` per 128x128 block (weight = fp8 * scale)."""
    r, c = w.shape
    b = w.float().reshape(r // BLOCK, BLOCK, c // BLOCK, BLOCK)
    scale = b.abs().amax(dim=(1, 3)).clamp_min(1e-12) / 448.0
    q = (b / scale[:, None, :, None]).to(torch.float8_e4m3fn)
    return q.reshape(r, c).contiguous(), scale.contiguous()


def _save(model: Any, out: Path, tensors: dict[str, torch.Tensor], quant: dict[str, Any]) -> None:
    from transformers import GenerationConfig

    model.generation_config = GenerationConfig.from_model_config(model.config)
    model.generation_config.do_sample = False
    model.save_pretrained(out)  # config, generation config; the weights are replaced below
    for f in out.glob("*.safetensors*"):
        f.unlink()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"] = quant
    (out / "config.json").write_text(json.dumps(cfg, indent=2))


def gpt_oss_config(layers: int = 2) -> Any:
    from transformers import GptOssConfig

    return GptOssConfig(vocab_size=128, hidden_size=64, intermediate_size=32,
                        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                        sliding_window=4, max_position_embeddings=256,
                        layer_types=["sliding_attention", "full_attention"][:layers],
                        dtype="bfloat16", pad_token_id=0, bos_token_id=1, eos_token_id=2)


def _random_model(config: Any, router: str, seed: int) -> Any:
    """A random bf16 model of ``config``, its router weights (names ending ``router``)
    drawn at std 1 so that routing varies from token to token."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    for name, p in model.named_parameters():
        if name.endswith(router):
            with torch.no_grad():
                p.normal_(0.0, 1.0)
    return model


def gpt_oss_mxfp4(out: str | Path, seed: int = 0) -> Path:
    """A tiny gpt-oss checkpoint, its experts in MXFP4 as gpt-oss ships them."""
    out = Path(out)
    model = _random_model(gpt_oss_config(), "router.weight", seed)
    tensors = {}
    for name, p in model.state_dict().items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            # gpt-oss holds [E, in, out]; the checkpoint packs [E, out, in / 32, 16].
            blocks, scales = mxfp4(p.transpose(1, 2))
            tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
        else:
            tensors[name] = p.contiguous()
    _save(model, out, tensors, MXFP4_CONFIG)
    return out


def deepseek_config(layers: int = 2, **over: Any) -> Any:
    from transformers import DeepseekV3Config

    return DeepseekV3Config(**{**dict(
        vocab_size=128, hidden_size=128, intermediate_size=128, moe_intermediate_size=256,
        num_hidden_layers=layers, first_k_dense_replace=1 if layers > 1 else 0,
        num_attention_heads=2, num_key_value_heads=2, n_routed_experts=4, n_shared_experts=1,
        num_experts_per_tok=2, n_group=1, topk_group=1, q_lora_rank=128, kv_lora_rank=128,
        qk_nope_head_dim=48, qk_rope_head_dim=16, v_head_dim=16,
        max_position_embeddings=256, dtype="bfloat16",
        pad_token_id=0, bos_token_id=1, eos_token_id=2), **over})


def deepseek_fp8(out: str | Path, seed: int = 0, spread: bool = False, **over: Any) -> Path:
    """A tiny DeepSeek-V3 checkpoint in block FP8 as DeepSeek ships it: every linear weight
    whose sides are multiples of 128 (experts, shared expert, dense MLP, attention) in e4m3
    with its ``weight_scale_inv``; embeddings, norms, the router and the head as saved.
    ``spread``: every weight drawn larger (tests/hf_models.py), so that training moves
    each by its gradient, not by rounding noise. ``over``: config fields."""
    out = Path(out)
    model = _random_model(deepseek_config(**over), "mlp.gate.weight", seed)
    if spread:
        from hf_models import spread as draw_larger

        draw_larger(model)
    # save_pretrained's own layout (per-expert gate/up/down_proj), then quantized.
    model.save_pretrained(out / "_plain")
    from safetensors.torch import load_file

    plain = {}
    for f in sorted((out / "_plain").glob("*.safetensors")):
        plain.update(load_file(f))
    tensors = {}
    for name, t in plain.items():
        quantize = (name.endswith(".weight") and t.dim() == 2 and "embed" not in name
                    and "lm_head" not in name and not name.endswith("mlp.gate.weight")
                    and t.shape[0] % BLOCK == 0 and t.shape[1] % BLOCK == 0)
        if quantize:
            tensors[name], tensors[name + "_scale_inv"] = fp8_blocks(t)
        else:
            tensors[name] = t.contiguous()
    import shutil

    shutil.rmtree(out / "_plain")
    _save(model, out, tensors, FP8_CONFIG)
    return out


def export_fp32(store: str | Path, out: str | Path) -> Any:
    """``tierstore export-hf --dtype fp32`` of ``store`` into ``out`` (exit status 0), as
    ``from_pretrained`` loads it in fp32."""
    from click.testing import CliRunner
    from transformers import AutoModelForCausalLM

    from tierstore.cli import main

    r = CliRunner().invoke(main, ["export-hf", "--store", str(store), str(out), "--dtype", "fp32"])
    assert r.exit_code == 0, r.output
    return AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)


def reference(model_dir: str | Path, dtype: torch.dtype = torch.float32) -> Any:
    """transformers' own model of a quantized checkpoint, dequantized on the CPU at load."""
    from transformers import AutoConfig, AutoModelForCausalLM, FineGrainedFP8Config, Mxfp4Config

    method = AutoConfig.from_pretrained(model_dir).quantization_config["quant_method"]
    qc = Mxfp4Config(dequantize=True) if method == "mxfp4" else \
        FineGrainedFP8Config(weight_block_size=(BLOCK, BLOCK), dequantize=True)
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype,
                                                quantization_config=qc).eval()
