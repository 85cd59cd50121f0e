"""Synthetic quantized checkpoints for the inference benchmarks, laid out as the shipped ones
are, each beside the same weights dequantized to bf16:

* ``mxfp4`` on the ``gpt_oss`` shape: per layer ``mlp.experts.gate_up_proj_blocks``
  ``[E, 2I, H/32, 16]`` and ``..._scales`` ``[E, 2I, H/32]`` (E8M0), the same for
  ``down_proj``, bf16 biases; the rest in bf16, as gpt-oss ships it.
* ``fp8`` on the ``deepseek_v3`` shape: per expert ``gate_proj``, ``up_proj`` and
  ``down_proj`` weights in e4m3 with one fp32 ``weight_scale_inv`` per 128x128 block; the
  rest in bf16 (DeepSeek also ships its attention and dense MLPs in FP8: tierstore
  dequantizes those once at load, so they change nothing in how experts stream).

The packed codes and scales are drawn directly (no float model is ever held), one layer at
a time, and each layer's experts are dequantized with ``transformers``' own functions into
the bf16 checkpoint, so the two hold exactly the same values: what the study compares is
bytes, not numbers. Scales are chosen so that weights have a standard deviation near
1/sqrt(fan-in), as :mod:`.hf_models` draws them.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

from .hf_models import hf_config

FORMATS = {"mxfp4": "gpt_oss", "fp8": "deepseek_v3"}
QUANT_CONFIGS = {
    "mxfp4": {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
        "lm_head"]},
    "fp8": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
            "weight_block_size": [128, 128]}}
E2M1_RMS = math.sqrt(sum(v * v for v in (0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)) / 8)


class _Shards:
    """A checkpoint written one shard at a time (``n`` of them), then its index."""

    def __init__(self, model_dir: str, n: int) -> None:
        os.makedirs(model_dir, exist_ok=True)
        self.dir, self.n, self.written = model_dir, n, 0
        self.weight_map: dict[str, str] = {}
        self.total = 0

    def add(self, tensors: dict[str, Any]) -> None:
        from safetensors.torch import save_file

        self.written += 1
        name = f"model-{self.written:05d}-of-{self.n:05d}.safetensors"
        save_file(tensors, os.path.join(self.dir, name), metadata={"format": "pt"})
        for k, t in tensors.items():
            self.weight_map[k] = name
            self.total += t.numel() * t.element_size()

    def finish(self, cfg: Any, quant: dict[str, Any] | None) -> None:
        from transformers import GenerationConfig

        with open(os.path.join(self.dir, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": self.total}, "weight_map": self.weight_map},
                      f, indent=1)
        cfg.save_pretrained(self.dir)
        GenerationConfig.from_model_config(cfg).save_pretrained(self.dir)
        if quant is not None:
            path = os.path.join(self.dir, "config.json")
            with open(path) as f:
                data = json.load(f)
            data["quantization_config"] = quant
            with open(path, "w") as f:
                json.dump(data, f, indent=2)


def check_quant_shape(fmt: str, hidden: int, ffn: int) -> None:
    """A ``ValueError`` naming a width the format cannot hold: MXFP4 packs blocks of 32
    along each expert's input, FP8 scales whole 128x128 blocks."""
    block = 32 if fmt == "mxfp4" else 128
    if hidden % block or ffn % block:
        raise ValueError(f"--quantized {fmt} needs --hidden and --ffn in multiples of {block} "
                         f"(its blocks), got {hidden} and {ffn}")


def _mxfp4_layer(prefix: str, e: int, h: int, i: int, g: Any
                 ) -> tuple[dict[str, Any], dict[str, Any]]:
    """One gpt-oss layer's experts: the packed tensors and their bf16 dequantization."""
    import torch
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    packed, plain = {}, {}
    for name, rows, fan_in in (("gate_up_proj", 2 * i, h), ("down_proj", h, i)):
        exp = round(math.log2(fan_in ** -0.5 / E2M1_RMS)) + 127
        blocks = torch.randint(0, 256, (e, rows, fan_in // 32, 16), generator=g,
                               dtype=torch.int32).to(torch.uint8)
        scales = (exp + torch.randint(-1, 2, (e, rows, fan_in // 32), generator=g,
                                      dtype=torch.int32)).to(torch.uint8)
        bias = (0.02 * torch.randn(e, rows, generator=g)).to(torch.bfloat16)
        packed[f"{prefix}.{name}_blocks"] = blocks
        packed[f"{prefix}.{name}_scales"] = scales
        packed[f"{prefix}.{name}_bias"] = plain[f"{prefix}.{name}_bias"] = bias
        plain[f"{prefix}.{name}"] = convert_moe_packed_tensors(blocks, scales,
                                                               dtype=torch.bfloat16)
    return packed, plain


def _fp8_layer(prefix: str, e: int, h: int, i: int, g: Any
               ) -> tuple[dict[str, Any], dict[str, Any]]:
    """One DeepSeek-V3 layer's experts, per expert: e4m3 weights with their block scales,
    and their bf16 dequantization."""
    import torch
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    deq = Fp8Dequantize(None)._dequantize_one
    packed, plain = {}, {}
    for x in range(e):
        for name, rows, cols in (("gate_proj", i, h), ("up_proj", i, h), ("down_proj", h, i)):
            # e4m3 codes of a unit normal, each block scaled to a std of 1/sqrt(fan-in)
            w = torch.randn(rows, cols, generator=g).clamp(-8, 8).to(torch.float8_e4m3fn)
            s = cols ** -0.5 * (0.8 + 0.4 * torch.rand(rows // 128, cols // 128, generator=g))
            key = f"{prefix}.{x}.{name}.weight"
            packed[key], packed[key + "_scale_inv"] = w, s
            plain[key] = deq(w, s, output_dtype=torch.bfloat16)
    return packed, plain


def write_quantized_checkpoints(quant_dir: str, bf16_dir: str, fmt: str, *, layers: int,
                                experts: int, hidden: int, ffn: int, vocab: int,
                                seed: int = 0) -> dict[str, Any]:
    """A ``fmt`` checkpoint (:data:`FORMATS` names its shape) in ``quant_dir`` and the same
    weights in bf16 in ``bf16_dir``; one shard per layer. Returns both sizes in bytes."""
    import torch
    import transformers
    from tierstore.hf.families import experts_modules

    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; choose one of {', '.join(FORMATS)}")
    check_quant_shape(fmt, hidden, ffn)
    cfg = hf_config(FORMATS[fmt], layers=layers, experts=experts, hidden=hidden, ffn=ffn,
                    vocab=vocab)
    cfg.dtype = torch.bfloat16
    with torch.device("meta"):
        shell = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    cfg.architectures = [type(shell).__name__]  # as save_pretrained writes it
    modules = {name: m for name, m in experts_modules(shell)}
    g = torch.Generator().manual_seed(seed)
    dense = {}
    buffers = {name for name, _ in shell.named_buffers()}
    for name, t in shell.state_dict().items():
        if name.rsplit(".", 1)[0] in modules:
            continue
        if name in buffers:
            dense[name] = torch.zeros(t.shape, dtype=t.dtype)  # score corrections
        elif t.dim() == 1:
            dense[name] = (1.0 + 0.1 * torch.randn(t.shape, generator=g)).to(t.dtype)
        else:
            dense[name] = (t.shape[-1] ** -0.5 * torch.randn(t.shape, generator=g)).to(t.dtype)
    qs, ps = _Shards(quant_dir, len(modules) + 1), _Shards(bf16_dir, len(modules) + 1)
    qs.add(dense)
    ps.add(dense)
    inter = cfg.intermediate_size if fmt == "mxfp4" else cfg.moe_intermediate_size
    make = _mxfp4_layer if fmt == "mxfp4" else _fp8_layer
    for name in modules:  # a layer's experts in bf16 is the most held at once
        packed, plain = make(name, experts, hidden, inter, g)
        qs.add(packed)
        ps.add(plain)
        del packed, plain
    qs.finish(cfg, QUANT_CONFIGS[fmt])
    ps.finish(cfg, None)
    size = {d: sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d)
                   if f.endswith(".safetensors")) for d in (quant_dir, bf16_dir)}
    return {"quant_bytes": size[quant_dir], "bf16_bytes": size[bf16_dir]}
