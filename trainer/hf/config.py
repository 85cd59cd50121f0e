"""A Hugging Face ``config.json`` as ``transformers`` reads it, checked before it sizes
anything, and the model it describes built on the meta device (no memory).

The checks are generic: every whole number an architecture is sized by lies in a sane range
(a garbled ``num_hidden_layers`` of 10^9 would otherwise build a billion modules), the
family is one ``transformers`` knows, and its own config class accepts the values (its
dataclass validation). A quantized checkpoint is recognised here by the method named in its
``quantization_config``: MXFP4 and 128x128 block FP8 are imported compact
(:mod:`tierstore.hf.quant`), any other is refused, never imported with wrong numbers.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from .checkpoint import HFImportError
from .quant import quant_method

# Sane ranges of the numbers a config sizes a model by; far beyond any released model.
LIMITS = {
    "num_hidden_layers": 4096, "num_layers": 4096, "n_layers": 4096,
    "hidden_size": 1 << 22, "intermediate_size": 1 << 22, "moe_intermediate_size": 1 << 22,
    "shared_expert_intermediate_size": 1 << 22, "head_dim": 1 << 16,
    "num_attention_heads": 1 << 14, "num_key_value_heads": 1 << 14,
    "vocab_size": 1 << 26, "max_position_embeddings": 1 << 40,
    "num_experts": 1 << 16, "num_local_experts": 1 << 16, "n_routed_experts": 1 << 16,
    "moe_num_experts": 1 << 16, "num_experts_per_tok": 1 << 16,
    "kv_lora_rank": 1 << 20, "q_lora_rank": 1 << 20,
}
ANY_INT_LIMIT = 1 << 48  # any other whole number of the config


def read_config_json(model_dir: str) -> dict[str, Any]:
    """``config.json`` of a model directory, with clear errors for anything else."""
    if not os.path.isdir(model_dir):
        raise HFImportError(f"{model_dir}: no such model directory")
    path = os.path.join(model_dir, "config.json")
    if not os.path.lexists(path):
        raise HFImportError(f"{model_dir}: not a Hugging Face model directory (no config.json)")
    if not os.path.isfile(path):  # opening a FIFO would wait for a writer for ever
        from tierstore.trainer.train.data import file_kind

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


def _check_numbers(hf: Mapping[str, Any], where: str, depth: int = 0) -> None:
    for key, v in hf.items():
        if isinstance(v, Mapping) and depth < 4:
            _check_numbers(v, f"{where} ({key})", depth + 1)
            continue
        if isinstance(v, bool) or v is None:
            continue
        limit = LIMITS.get(key)
        if limit is not None and (type(v) is not int or not 0 <= v <= limit):
            raise HFImportError(f"{where}: {key} is {v!r}, not a whole number from 0 to {limit}; "
                                "fix config.json (or use the model's original one)")
        if type(v) is int and abs(v) > ANY_INT_LIMIT:
            raise HFImportError(f"{where}: {key} is {v!r}, out of any sane range; fix "
                                "config.json (or use the model's original one)")
        if isinstance(v, list) and len(v) > (1 << 20):
            raise HFImportError(f"{where}: {key} holds {len(v)} values; fix config.json")


POSITIVE_FLOATS = ("rope_theta", "factor", "rms_norm_eps", "layer_norm_eps", "norm_eps")
LAYER_COUNTS = ("num_hidden_layers", "num_layers", "n_layers")
TOP_K = ("num_experts_per_tok", "moe_topk", "num_experts_per_topk", "n_activated_experts")
EXPERT_COUNTS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


def _bad(where: str, key: str, v: Any, what: str) -> HFImportError:
    return HFImportError(f"{where}: {key} is {v!r}, {what}; fix config.json (or use the "
                         "model's original one)")


def _check_meanings(hf: Mapping[str, Any], where: str, vocab: int | None = None,
                    depth: int = 0) -> None:
    """What a value of a well-known field means, whatever the family: epsilons and rotary
    bases positive and finite, windows whole and not negative, token ids inside the
    vocabulary, at least one layer, experts per token within the experts."""
    vocab = hf.get("vocab_size") if isinstance(hf.get("vocab_size"), int) else vocab
    experts = max((v for k in EXPERT_COUNTS if type(v := hf.get(k)) is int), default=None)
    for key, v in hf.items():
        if isinstance(v, Mapping) and depth < 4:
            if key != "quantization_config":
                _check_meanings(v, f"{where} ({key})", vocab, depth + 1)
            continue
        if v is None or not isinstance(key, str):  # id2label's keys are labels' numbers
            continue
        if key in POSITIVE_FLOATS or key.endswith("_eps"):
            if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) \
                    or v <= 0:
                raise _bad(where, key, v, "not a finite number above 0")
        elif key in ("rope_scaling", "rope_parameters"):
            raise _bad(where, key, v, "not an object")
        elif key == "sliding_window" and (type(v) is not int or v < 0):
            raise _bad(where, key, v, "not a whole number of positions")
        elif key.endswith("_token_id"):
            ids = v if isinstance(v, list) else [v]
            if not all(type(x) is int and 0 <= x < (vocab or ANY_INT_LIMIT) for x in ids):
                raise _bad(where, key, v, "not a token id of the vocabulary, or a list of them")
        elif key == "architectures" and (not isinstance(v, list) or
                                         not all(isinstance(a, str) for a in v)):
            raise _bad(where, key, v, "not a list of class names")
        elif key in LAYER_COUNTS and type(v) is int and v < 1:
            raise _bad(where, key, v, "not a number of layers (at least 1)")
        elif key in TOP_K and type(v) is int and experts is not None and not 1 <= v <= experts:
            raise _bad(where, key, v, f"not a number of experts from 1 to {experts}")


def check_generation_config(gen: Any, where: str, vocab: int | None) -> None:
    """``generation_config.json``'s values, checked as ``config.json``'s are."""
    if not isinstance(gen, dict):
        raise HFImportError(f"{where}: not a JSON object; fix or remove it")
    _check_meanings(gen, where, vocab)


FLOAT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def config_dtype(hf: Mapping[str, Any]) -> torch.dtype | None:
    """The dtype ``config.json`` names (``dtype``, or ``torch_dtype`` as older configs spell
    it): what ``transformers`` builds the model in and casts every weight to."""
    v = hf.get("dtype") or hf.get("torch_dtype")
    return FLOAT_DTYPES.get(str(v)) if v is not None else None


def _refusal(e: Exception, hf: Mapping[str, Any], where: str, family: str) -> HFImportError:
    """transformers' validation error as one line naming the field and its value."""
    text = str(e).strip()
    first = text.splitlines()[0] if text else type(e).__name__
    m = re.match(r"Validation error for field '(\w+)'", first)
    cause = e.__cause__ if e.__cause__ is not None else e
    why = str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__
    if m:
        key = m.group(1)
        value = hf.get(key, "missing") if key in hf else "missing"
        return HFImportError(f"{where}: {key} is {value!r}, which transformers' {family} "
                             f"config refuses ({why}); fix config.json (or use the model's "
                             "original one)")
    return HFImportError(f"{where}: transformers refuses this {family} config: "
                         f"{why if why != first else first}; fix config.json (or use the "
                         "model's original one)")


def hf_config(hf: dict[str, Any], where: str) -> Any:
    """The ``transformers`` config object of a ``config.json`` dict (checked)."""
    from transformers import PreTrainedConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    family = hf.get("model_type")
    if not isinstance(family, str) or not family:
        raise HFImportError(f"{where}: config.json has no model_type; use the model's original "
                            "config.json")
    if family not in CONFIG_MAPPING:
        raise HFImportError(f"{where}: model_type {family!r} is not a family the installed "
                            "transformers knows; upgrade transformers or check config.json")
    quant_method(hf, where)  # refuses every method but those imported compact
    for key in ("dtype", "torch_dtype"):
        v = hf.get(key)
        if v is not None and v not in FLOAT_DTYPES:
            raise _bad(where, key, v, "not a dtype a model is imported in "
                                      f"({', '.join(FLOAT_DTYPES)})")
    _check_numbers(hf, where)
    # As transformers reads config.json: special floats ({"__float__": "Infinity"}) decoded.
    # The model is built unquantized: the experts function dequantizes (tierstore.hf.quant).
    body = PreTrainedConfig._decode_special_floats(
        {k: v for k, v in hf.items() if k not in ("transformers_version", "quantization_config")})
    _check_meanings(body, where)
    try:
        return CONFIG_MAPPING[family].from_dict(body)
    except Exception as e:  # noqa: BLE001  (the config class's own validation, any type)
        raise _refusal(e, hf, where, family) from e


def meta_model(config: Any, family: str, *, experts_implementation: str | None = None,
               dtype: torch.dtype | None = None) -> nn.Module:
    """The family's causal-LM class built on the meta device (nothing allocated)."""
    from transformers import AutoModelForCausalLM

    kw: dict[str, Any] = {}
    if experts_implementation is not None:
        kw["experts_implementation"] = experts_implementation
    if dtype is not None:
        kw["dtype"] = dtype
    try:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config, **kw)
    except ValueError as e:
        if "Unrecognized configuration class" in str(e):
            raise HFImportError(f"{family}: transformers has no causal language model class "
                                "for this family; tierstore serves causal LMs") from e
        raise HFImportError(f"{family}: transformers cannot build this model: "
                            f"{str(e).splitlines()[0]}") from e
    except Exception as e:  # noqa: BLE001  (a family's own constructor, any error type)
        raise HFImportError(f"{family}: transformers cannot build this model from its config: "
                            f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                            ) from e
