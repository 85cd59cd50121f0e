"""A Hugging Face ``config.json`` as ``transformers`` reads it, checked before it sizes
anything, and the model it describes built on the meta device (no memory).

The checks are generic: every whole number an architecture is sized by lies in a sane range
(a garbled ``num_hidden_layers`` of 10^9 would otherwise build a billion modules), the
family is one ``transformers`` knows, and its own config class accepts the values (its
dataclass validation). A quantized checkpoint is refused here, by the method named in its
``quantization_config``, never imported with wrong numbers.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from .checkpoint import HFImportError

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
QUANTIZED_FORMATS_NOTE = ("quantized experts are imported by a later release of tierstore; "
                          "import the checkpoint's bf16 or fp32 weights")


def read_config_json(model_dir: str) -> dict[str, Any]:
    """``config.json`` of a model directory, with clear errors for anything else."""
    if not os.path.isdir(model_dir):
        raise HFImportError(f"{model_dir}: no such model directory")
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise HFImportError(f"{model_dir}: not a Hugging Face model directory (no config.json)")
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
    quant = hf.get("quantization_config")
    if quant is not None:
        method = quant.get("quant_method", "an unknown method") if isinstance(quant, dict) \
            else "an unreadable quantization_config"
        raise HFImportError(f"{where}: a {family} checkpoint quantized with {method}: "
                            f"{QUANTIZED_FORMATS_NOTE}")
    _check_numbers(hf, where)
    # As transformers reads config.json: special floats ({"__float__": "Infinity"}) decoded.
    body = PreTrainedConfig._decode_special_floats(
        {k: v for k, v in hf.items() if k != "transformers_version"})
    try:
        return CONFIG_MAPPING[family].from_dict(body)
    except Exception as e:  # noqa: BLE001  (the config class's own validation, any type)
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise HFImportError(f"{where}: transformers refuses this {family} config: {first}; "
                            "fix config.json (or use the model's original one)") from e


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
