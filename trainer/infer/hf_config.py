"""Hugging Face ``config.json`` -> :class:`trainer.model.ModelConfig`, checked.

:func:`build_from_hf` reads a config of a supported family (:data:`SUPPORTED_FAMILIES`:
Mixtral, Qwen2-MoE, OLMoE, Qwen3-MoE as ``transformers`` defines them) into the model's
config: every way they differ is a field of it (router renormalisation, q/k norms, biases,
shared expert, dense layers, sliding windows, tied embeddings).

Nothing is allocated on the strength of ``config.json`` alone: :func:`check_config` checks
every number an import uses to be a whole number in a sane range first, each error naming
the file and the key (:class:`HFImportError`).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from typing import Any

import tierstore

from ..model import DTYPES, ModelConfig
from ..train.data import file_kind

SUPPORTED_FAMILIES: dict[str, str] = {
    # family (= HF model_type) -> HF architecture
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "olmoe": "OlmoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "tierstore": "checkpoints of tierstore train",
}
HF_FAMILIES = ("mixtral", "qwen2_moe", "olmoe", "qwen3_moe")
_ARCHITECTURES = {SUPPORTED_FAMILIES[f]: f for f in HF_FAMILIES}


def supported_text() -> str:
    """One line naming what can be loaded, for error messages."""
    return ", ".join(f"{k} ({v})" for k, v in SUPPORTED_FAMILIES.items())


class HFImportError(tierstore.StoreError):
    """The directory cannot be imported (reported by the CLI as one line)."""


def read_hf_config(model_dir: str) -> dict[str, Any]:
    """``config.json`` of a model directory, with clear errors for anything else."""
    if not os.path.isdir(model_dir):
        raise HFImportError(f"{model_dir}: no such model directory")
    path = os.path.join(model_dir, "config.json")
    if not os.path.lexists(path):
        raise HFImportError(f"{model_dir}: not a Hugging Face model directory (no config.json)")
    if not os.path.isfile(path):  # opening a FIFO would wait for a writer for ever
        mode = os.stat(path).st_mode if os.path.exists(path) else None
        what = file_kind(mode) if mode is not None else "a symbolic link to nothing"
        raise HFImportError(f"{path}: {what}, not a config file; put the model's config.json "
                            "there")
    try:
        with open(path, encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, ValueError) as e:
        raise HFImportError(f"{path}: unreadable config: {e}; use the model's original "
                            "config.json") from e
    if not isinstance(cfg, dict):
        raise HFImportError(f"{path}: config is not a JSON object; use the model's original "
                            "config.json")
    return cfg


# Sane ranges of the config numbers an import sizes or loops by. Far beyond any released
# model; they stop a garbled config before its numbers are used at all, and the checkpoint's
# own tensors then pin them exactly (``hf_checkpoint.check_against_weights``).
MAX_LAYERS = 4096
MAX_EXPERTS = 1 << 16
MAX_WIDTH = 1 << 22  # hidden, FFN and head sizes
MAX_VOCAB = 1 << 26
MAX_HEADS = 1 << 14
MAX_POSITION = 1 << 40
_REQUIRED = object()


class _ConfigCheck:
    """Checks of ``config.json`` values, each error naming the file and the key."""

    def __init__(self, hf: dict[str, Any], path: str, family: str) -> None:
        self.hf, self.path, self.family = hf, path, family

    def bad(self, key: str, what: str) -> HFImportError:
        return HFImportError(f"{self.path}: {key} is {self.hf.get(key)!r}, {what}; fix config.json "
                             "(or use the model's original one)")

    def whole(self, key: str, lo: int, hi: int, default: Any = _REQUIRED) -> Any:
        """The value of ``key``: an int in ``lo..hi``; ``default`` where it is missing or
        null (a required key has none)."""
        v = self.hf.get(key)
        if v is None:
            if default is _REQUIRED:
                raise HFImportError(f"{os.path.dirname(self.path) or '.'}: config.json lacks "
                                    f"{key!r}, which a {self.family} model needs; use the "
                                    "model's original config.json")
            return default
        if type(v) is not int or not lo <= v <= hi:
            raise self.bad(key, f"not a whole number from {lo} to {hi}")
        return v

    def first_int(self, keys: tuple[str, ...], lo: int, hi: int) -> tuple[str, int]:
        """(key, value) of the first of ``keys`` set to a non-zero value (as the config
        reader takes them), which must be an int in ``lo..hi``."""
        for key in keys:
            if self.hf.get(key):
                return key, self.whole(key, lo, hi)
        return keys[0], self.whole(keys[0], lo, hi)  # lacking, or 0: its error

    def number(self, key: str, positive: bool = True) -> None:
        v = self.hf.get(key)
        if v is None:
            return
        if type(v) not in (int, float) or not math.isfinite(v) or (positive and v <= 0):
            raise self.bad(key, "not a finite number" + (" above 0" if positive else ""))

    def ids(self, key: str) -> None:
        v = self.hf.get(key)
        vs = v if isinstance(v, list) else [v]
        if v is not None and (len(vs) > MAX_VOCAB
                              or not all(type(x) is int and 0 <= x < MAX_VOCAB for x in vs)):
            raise self.bad(key, "not a token id or a list of token ids")


def check_config(hf: dict[str, Any], path: str, family: str) -> dict[str, int]:
    """Check every config value the import uses; returns the sizes it is built from (keyed
    by their config.json names) for the check against the weights."""
    c = _ConfigCheck(hf, path, family)
    sizes = {
        "hidden_size": c.whole("hidden_size", 1, MAX_WIDTH),
        "num_hidden_layers": c.whole("num_hidden_layers", 1, MAX_LAYERS),
        "vocab_size": c.whole("vocab_size", 1, MAX_VOCAB),
        "num_attention_heads": c.whole("num_attention_heads", 1, MAX_HEADS),
    }
    c.whole("num_key_value_heads", 1, MAX_HEADS, None)
    c.whole("head_dim", 1, MAX_WIDTH, None)
    c.whole("max_position_embeddings", 1, MAX_POSITION, None)
    c.whole("sliding_window", 0, MAX_POSITION, None)
    c.whole("intermediate_size", 1, MAX_WIDTH, None)
    if family == "mixtral":
        experts_key, n_experts = "num_local_experts", c.whole("num_local_experts", 1, MAX_EXPERTS)
        c.whole("intermediate_size", 1, MAX_WIDTH)
    else:
        experts_key, n_experts = c.first_int(("num_experts", "num_local_experts"), 1,
                                             MAX_EXPERTS)
        c.first_int(("moe_intermediate_size", "intermediate_size"), 1, MAX_WIDTH)
        c.whole("decoder_sparse_step", 0, MAX_LAYERS, None)
        c.whole("shared_expert_intermediate_size", 0, MAX_WIDTH, None)
        only = hf.get("mlp_only_layers")
        if only is not None and (not isinstance(only, list) or len(only) > MAX_LAYERS or not all(
                type(i) is int and 0 <= i < MAX_LAYERS for i in only)):
            raise c.bad("mlp_only_layers", "not a list of layer numbers")
        types = hf.get("layer_types")
        if types is not None and (not isinstance(types, list) or not all(
                isinstance(t, str) for t in types)
                or len(types) != sizes["num_hidden_layers"]):
            raise c.bad("layer_types", "not a list of one layer type per layer")
    sizes[experts_key] = n_experts
    c.whole("num_experts_per_tok", 1, n_experts)
    for key in ("rms_norm_eps", "rope_theta", "clip_qkv"):
        c.number(key)
    for key in ("rope_parameters", "rope_scaling"):
        rope = hf.get(key)
        if rope is not None and not isinstance(rope, dict):
            raise c.bad(key, "not an object")
        if isinstance(rope, dict):
            sub = _ConfigCheck(rope, f"{path} ({key})", family)
            sub.number("rope_theta")
            sub.number("factor")
    for key in ("eos_token_id", "bos_token_id", "pad_token_id"):
        c.ids(key)
    for key in ("dtype", "torch_dtype"):
        v = hf.get(key)
        if v is not None and v not in DTYPES:
            raise c.bad(key, f"not a dtype a model is imported in ({', '.join(DTYPES)})")
    arch = hf.get("architectures")
    if arch is not None and (not isinstance(arch, list)
                             or not all(isinstance(a, str) for a in arch)):
        raise c.bad("architectures", "not a list of names")
    return sizes


def config_dtype(hf: Mapping[str, Any]) -> str | None:
    """The dtype ``config.json`` names (``dtype``, or ``torch_dtype`` as older configs
    spell it): what ``transformers`` builds the model in and casts every weight to."""
    v = hf.get("dtype") or hf.get("torch_dtype")
    return str(v) if v is not None else None


def generation_eos(model_dir: str) -> tuple[int, ...]:
    """End-of-sequence ids of ``generation_config.json`` (what ``generate`` stops at)."""
    path = os.path.join(model_dir, "generation_config.json")
    if not os.path.isfile(path):
        return ()
    try:
        with open(path, encoding="utf-8") as f:
            gen = json.load(f)
    except (OSError, ValueError) as e:
        raise HFImportError(f"{path}: unreadable ({e}); fix or remove it") from e
    v = gen.get("eos_token_id") if isinstance(gen, dict) else None
    vs = v if isinstance(v, list) else [v]
    if v is not None and not all(type(x) is int and 0 <= x < MAX_VOCAB for x in vs):
        raise HFImportError(f"{path}: eos_token_id is {v!r}, not a token id or a list of them; "
                            "fix or remove it")
    return () if v is None else tuple(vs)


def _ids(v: Any) -> tuple[int, ...]:
    if v is None:
        return ()
    return tuple(int(x) for x in (v if isinstance(v, list | tuple) else [v]))


def _rope(hf: Mapping[str, Any]) -> tuple[float, float]:
    """(theta, linear scale) from ``rope_parameters`` (transformers 5) or ``rope_theta`` +
    ``rope_scaling`` (older configs); other rope types are refused rather than run wrong."""
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    kind = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if kind == "default":
        return theta, 1.0
    if kind == "linear":
        return theta, float(params.get("factor", scaling.get("factor", 1.0)))
    raise ValueError(f"rope type {kind!r} is not supported (default and linear are)")


def family_of(hf: Mapping[str, Any]) -> str:
    """The family of an HF config dict, or a ValueError naming the supported ones."""
    mt = hf.get("model_type")
    if mt in HF_FAMILIES:
        return str(mt)
    if mt is None:  # some hand-written configs name only the architecture
        for arch in hf.get("architectures") or []:
            fam = _ARCHITECTURES.get(arch)
            if fam:
                return fam
    arch = ", ".join(hf.get("architectures") or []) or "none given"
    raise ValueError(f"unsupported architecture (model_type {mt!r}, architectures {arch}); "
                     f"supported: {supported_text()}")


def build_from_hf(hf_config: Mapping[str, Any]) -> ModelConfig:
    """A :class:`ModelConfig` from a ``config.json`` dict of a supported family (raises
    ``ValueError`` naming the supported families for anything else)."""
    hf = hf_config
    family = family_of(hf)
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {hf.get('hidden_act')!r} is not supported (silu is)")
    hidden, n_layers = int(hf["hidden_size"]), int(hf["num_hidden_layers"])
    n_heads = int(hf["num_attention_heads"])
    n_kv = int(hf.get("num_key_value_heads") or n_heads)
    head_dim = int(hf.get("head_dim") or hidden // n_heads)
    theta, scale = _rope(hf)
    windows: tuple[int, ...] = ()
    kw: dict[str, Any] = {}
    if family == "mixtral":
        n_experts, ffn = int(hf["num_local_experts"]), int(hf["intermediate_size"])
        moe_layers = tuple(range(n_layers))
        if hf.get("sliding_window"):
            windows = (int(hf["sliding_window"]),) * n_layers
        kw.update(norm_topk_prob=True)
    else:
        n_experts = int(hf.get("num_experts") or hf.get("num_local_experts"))
        ffn = int(hf.get("moe_intermediate_size") or hf["intermediate_size"])
        if family == "olmoe":
            moe_layers = tuple(range(n_layers))
            kw.update(qk_norm="full", qkv_bias=bool(hf.get("attention_bias", False)),
                      o_bias=bool(hf.get("attention_bias", False)), clip_qkv=hf.get("clip_qkv"))
        else:
            only = set(hf.get("mlp_only_layers") or [])
            step = int(hf.get("decoder_sparse_step", 1) or 1)
            moe_layers = tuple(i for i in range(n_layers)
                               if i not in only and n_experts > 0 and (i + 1) % step == 0)
            if family == "qwen2_moe":
                kw.update(qkv_bias=bool(hf.get("qkv_bias", True)),
                          shared_ffn=int(hf.get("shared_expert_intermediate_size") or 0))
                types = hf.get("layer_types")
                if hf.get("use_sliding_window") and types:
                    w = int(hf.get("sliding_window") or 0)
                    windows = tuple(w if t == "sliding_attention" else 0 for t in types)
            else:  # qwen3_moe
                bias = bool(hf.get("attention_bias", False))
                kw.update(qk_norm="head", qkv_bias=bias, o_bias=bias)
                if hf.get("use_sliding_window") and hf.get("sliding_window"):
                    windows = (int(hf["sliding_window"]),) * n_layers
        kw.setdefault("norm_topk_prob", bool(hf.get("norm_topk_prob", False)))
    if family == "qwen2_moe" and not kw.get("shared_ffn"):
        raise ValueError("qwen2_moe config without shared_expert_intermediate_size")
    if not any(windows):
        windows = ()
    dtype = config_dtype(hf) or "float32"
    return ModelConfig(
        family=family, vocab_size=int(hf["vocab_size"]), hidden_size=hidden, n_layers=n_layers,
        n_heads=n_heads, n_kv_heads=n_kv, head_dim=head_dim, n_experts=n_experts,
        top_k=int(hf["num_experts_per_tok"]), moe_ffn=ffn, moe_layers=moe_layers,
        dense_ffn=int(hf.get("intermediate_size") or ffn), rope_theta=theta, rope_scale=scale,
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)), sliding_windows=windows,
        eos_token_ids=_ids(hf.get("eos_token_id")), pad_token_id=hf.get("pad_token_id"),
        bos_token_id=hf.get("bos_token_id"),
        max_position=int(hf.get("max_position_embeddings") or 4096),
        dtype=dtype if dtype in DTYPES else "float32", **kw)
