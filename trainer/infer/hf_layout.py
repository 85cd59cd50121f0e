"""How a stored model's tensors are named and laid out in a Hugging Face checkpoint.

A *layout* is what ``tierstore export-hf`` needs to write a checkpoint back as it was
imported. It is JSON, kept in ``model.json`` under ``hf_layout``:

* ``dense``: checkpoint tensor name -> the decoder's name of the tensor that holds its
  value (several names may share one: a tied ``lm_head.weight`` the checkpoint carried
  anyway maps to ``tok_emb.weight``);
* ``experts``: per MoE layer (the layer number as a string), either
  ``{"per_expert": {"w1": name, "w2": name, "w3": name}}``, each name holding ``{e}`` where
  the expert number goes (``model.layers.0.block_sparse_moe.experts.{e}.w1.weight``), or
  ``{"fused": {"gate_up_proj": [name, orient], "down_proj": [name, orient]}}``, one 3-D
  tensor over the experts whose ``orient`` is ``"out_in"`` (``[E, 2*ffn, hidden]`` and
  ``[E, hidden, ffn]``, as ``transformers`` 5 holds them) or ``"in_out"`` (transposed);
* ``zeros``: checkpoint tensor name -> shape of tensors written as zeros (the shared expert
  that stands in for none when the trainer's model is exported as Qwen2-MoE).

:func:`record_layout` describes a checkpoint being imported; :func:`canonical_layout` is the
per-expert layout ``save_pretrained`` writes by default, used for the trainer's own model and
for stores imported before layouts were recorded.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch

from ..model import EXPERT_WEIGHTS, ModelConfig, MoEDecoder

LAYOUT_VERSION = 1
EXPERT_SLOT = "{e}"
OUT_IN, IN_OUT = "out_in", "in_out"

# The decoder's names -> transformers' (the inverse of hf_checkpoint's reading).
_ATTN = {"wq": "q_proj", "wk": "k_proj", "wv": "v_proj", "wo": "o_proj",
         "q_norm": "q_norm", "k_norm": "k_norm"}
_PROJ = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}
_PER_EXPERT_TAIL = re.compile(r"\.experts\.(\d+)\.\w+\.weight$")


def record_layout(cfg: ModelConfig, dense: Mapping[str, str],
                  per_expert: Mapping[tuple[int, int], Mapping[str, str]],
                  fused: Mapping[int, Mapping[str, str]],
                  shapes: Mapping[str, list[int]], names: list[str]) -> dict[str, Any]:
    """The layout of a checkpoint, from ``hf_checkpoint.plan``'s sorting of its tensor
    ``names`` (``dense``: decoder name -> checkpoint name; ``per_expert``; ``fused``) and the
    checkpoint's tensor ``shapes``."""
    out_dense = {hf: ours for ours, hf in dense.items()}
    if cfg.tie_embeddings and "lm_head.weight" in names:
        out_dense["lm_head.weight"] = "tok_emb.weight"
    experts: dict[str, Any] = {}
    h, f = cfg.hidden_size, cfg.moe_ffn
    for layer in cfg.moe_layers:
        if layer in fused:
            gu, dn = fused[layer]["gate_up_proj"], fused[layer]["down_proj"]
            # Where both orientations have one shape, the import read transformers' own.
            experts[str(layer)] = {"fused": {
                "gate_up_proj": [gu, OUT_IN if shapes[gu][1:] == [2 * f, h] else IN_OUT],
                "down_proj": [dn, OUT_IN if shapes[dn][1:] == [h, f] else IN_OUT]}}
            continue
        templates = {}
        for w, hf in per_expert[(layer, 0)].items():
            m = _PER_EXPERT_TAIL.search(hf)
            assert m is not None  # plan() matched the same pattern
            templates[w] = hf[:m.start(1)] + EXPERT_SLOT + hf[m.end(1):]
        experts[str(layer)] = {"per_expert": templates}
    return {"version": LAYOUT_VERSION, "dense": out_dense, "experts": experts, "zeros": {}}


def _hf_dense_name(cfg: ModelConfig, family: str, name: str) -> str:
    """transformers' name of one of the decoder's dense tensors, as ``save_pretrained``
    writes it for ``family``."""
    if name == "tok_emb.weight":
        return "model.embed_tokens.weight"
    if name == "norm.weight":
        return "model.norm.weight"
    if name == "lm_head.weight":
        return name
    _, i, part, rest = name.split(".", 3)
    p = f"model.layers.{i}."
    moe_block = "block_sparse_moe" if family == "mixtral" else "mlp"
    if part == "attn_norm":
        return p + "input_layernorm.weight"
    if part == "ffn_norm":
        return p + "post_attention_layernorm.weight"
    if part == "attn":
        sub, what = rest.split(".")
        return f"{p}self_attn.{_ATTN[sub]}.{what}"
    if part == "router":
        return f"{p}{moe_block}.gate.weight"
    if part == "shared_gate":
        return p + "mlp.shared_expert_gate.weight"
    if part == "shared":
        return f"{p}mlp.shared_expert.{_PROJ[rest]}.weight"
    if part == "mlp":
        return f"{p}mlp.{_PROJ[rest]}.weight"
    raise ValueError(f"no transformers name for {name}")


def dense_names(cfg: ModelConfig) -> dict[str, list[int]]:
    """The decoder's dense tensors (name -> shape), from a model on the meta device."""
    with torch.device("meta"):
        return {k: list(v.shape) for k, v in MoEDecoder(cfg).state_dict().items()}


def canonical_layout(cfg: ModelConfig, family: str) -> dict[str, Any]:
    """The per-expert layout ``transformers``' ``save_pretrained`` writes for ``family``
    (Mixtral: ``block_sparse_moe.experts.{e}.w1``; the others: ``mlp.experts.{e}.gate_proj``)."""
    dense = {_hf_dense_name(cfg, family, n): n for n in dense_names(cfg)}
    experts: dict[str, Any] = {}
    for layer in cfg.moe_layers:
        p = f"model.layers.{layer}."
        if family == "mixtral":
            t = {w: f"{p}block_sparse_moe.experts.{EXPERT_SLOT}.{w}.weight" for w in EXPERT_WEIGHTS}
        else:
            t = {w: f"{p}mlp.experts.{EXPERT_SLOT}.{_PROJ[w]}.weight" for w in EXPERT_WEIGHTS}
        experts[str(layer)] = {"per_expert": t}
    return {"version": LAYOUT_VERSION, "dense": dense, "experts": experts, "zeros": {}}


def check_layout(layout: Mapping[str, Any], cfg: ModelConfig) -> list[str]:
    """What is wrong with a layout for ``cfg`` (empty: nothing): every dense tensor of the
    decoder is written, and every MoE layer's experts are."""
    problems = []
    if layout.get("version") != LAYOUT_VERSION:
        problems.append(f"layout version {layout.get('version')!r}, not {LAYOUT_VERSION}")
        return problems
    ours = set(dense_names(cfg))
    lacking = sorted(ours - set(layout["dense"].values()))
    if lacking:
        problems.append(f"no checkpoint name for {', '.join(lacking[:5])}")
    unknown = sorted(set(layout["dense"].values()) - ours)
    if unknown:
        problems.append(f"the model has no tensor {', '.join(unknown[:5])}")
    layers = sorted(int(k) for k in layout["experts"])
    if layers != sorted(cfg.moe_layers):
        problems.append(f"experts of layers {layers}, the config's MoE layers are "
                        f"{sorted(cfg.moe_layers)}")
    return problems
