"""A Hugging Face model in a store: what ``model.json`` records, and reading it back.

Store layout (format 2, written by :mod:`tierstore.hf.importer`):

* ``model.json`` (kind ``meta``): UTF-8 JSON as a uint8 tensor: ``{"format": 2, "family",
  "hf_config": config.json, "generation_config": generation_config.json or null, "dtype",
  "experts": [{"module", "prefix", "num_experts", "params": [[attr, [part, ...]], ...]}],
  "dense": {model parameter name: entry name}, "zeros": {name: shape}, "tokenizer": [file
  names]}``;
* ``{module}.{e}.{attr}`` (kind ``param``): expert ``e``'s slice of the experts module's fused
  parameter ``attr`` (``model.layers.3.mlp.experts.5.gate_up_proj``), in the checkpoint's dtype;
  a quantized one as its packed tensor and its scales, kept as shipped
  (``…gate_up_proj_blocks`` and ``…_scales`` for MXFP4, ``…gate_up_proj`` in e4m3 and
  ``…_scale_inv`` for FP8; :mod:`tierstore.hf.quant`);
* ``dense.{name}`` (kind ``param``): every other parameter, by the model's own names;
* ``tokenizer.{file}`` (kind ``meta``): tokenizer files as uint8 tensors.

A ``tierstore train`` run is read as the ``transformers`` architecture its export writes
(:func:`tierstore.hf.trainer_runs.hf_config_of`: Mixtral, or Qwen2-MoE with a shared
expert of zeros), its experts' ``w1``/``w3`` entries the two parts of ``gate_up_proj``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

import tierstore

MODEL_ENTRY = ("model.json", "meta")
IMPORT_ENTRY = ("import.json", "meta")  # the source of an import under way
DENSE_PREFIX = "dense."
TOKENIZER_PREFIX = "tokenizer."
TOKENIZER_KIND = "meta"
FORMAT = 2


def read_json_entry(store: tierstore.Store, name: str, kind: str = "meta") -> Any:
    return json.loads(store.get(name, kind).numpy().tobytes())


def json_entry(obj: Any) -> Tensor:
    """A JSON-serialisable object as a uint8 tensor (how ``model.json`` is stored)."""
    raw = bytearray(json.dumps(obj, sort_keys=True).encode())
    return torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.zeros(0, dtype=torch.uint8)


@dataclass
class ExpertsModule:
    """One experts module as the store holds it."""

    module: str  # qualified name in the model
    prefix: str  # entries are f"{prefix}.{e}.{part}"
    num_experts: int
    params: list[tuple[str, list[str]]]  # (fused attr, entry parts joined along its output)
    # Quantized parameters: attr -> format; their parts are (packed, scales).
    formats: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {"module": self.module, "prefix": self.prefix,
                             "num_experts": self.num_experts,
                             "params": [[a, list(p)] for a, p in self.params]}
        if self.formats:
            d["formats"] = dict(self.formats)
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> ExpertsModule:
        return cls(d["module"], d["prefix"], int(d["num_experts"]),
                   [(str(a), [str(x) for x in p]) for a, p in d["params"]],
                   {str(k): str(v) for k, v in (d.get("formats") or {}).items()})


@dataclass
class StoredModel:
    """What loading needs to know of a store's model."""

    family: str
    hf_config: dict[str, Any]
    experts: list[ExpertsModule]
    dense: dict[str, str]  # model parameter/buffer name -> entry name
    dtype: str
    generation_config: dict[str, Any] | None = None
    zeros: dict[str, list[int]] = field(default_factory=dict)
    tokenizer: list[str] = field(default_factory=list)
    quant: str | None = None  # the checkpoint's quantization, kept compact (tierstore.hf.quant)
    dense_scales: dict[str, str] = field(default_factory=dict)  # fp8 dense weight -> its scales
    quantized_at_import: bool = False  # import-hf --expert-format: the checkpoint was not
    # A fine-tuned quantized checkpoint (tierstore.hf.quant_train): state-dict name -> the
    # format export-hf re-quantizes its fp32 master to.
    requantize: dict[str, str] = field(default_factory=dict)
    step: int | None = None  # a trainer run: the step of the checkpoint its dense state is
    # A trainer run's dense weights, out of its latest checkpoint, by the model's names
    # (an import's are entries, named in ``dense``).
    dense_state: dict[str, Tensor] | None = field(default=None, repr=False)

    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT, "family": self.family, "hf_config": self.hf_config,
                "generation_config": self.generation_config, "dtype": self.dtype,
                "experts": [m.to_json() for m in self.experts], "dense": self.dense,
                "zeros": self.zeros, "tokenizer": self.tokenizer, "quant": self.quant,
                "dense_scales": self.dense_scales,
                "quantized_at_import": self.quantized_at_import,
                "requantize": self.requantize}

    @classmethod
    def from_json(cls, d: dict[str, Any], where: str) -> StoredModel:
        try:
            return cls(family=str(d["family"]), hf_config=dict(d["hf_config"]),
                       experts=[ExpertsModule.from_json(m) for m in d["experts"]],
                       dense={str(k): str(v) for k, v in d["dense"].items()},
                       dtype=str(d["dtype"]), generation_config=d.get("generation_config"),
                       zeros={str(k): [int(x) for x in v]
                              for k, v in (d.get("zeros") or {}).items()},
                       tokenizer=[str(t) for t in d.get("tokenizer") or []],
                       quant=d.get("quant"),
                       quantized_at_import=bool(d.get("quantized_at_import")),
                       dense_scales={str(k): str(v)
                                     for k, v in (d.get("dense_scales") or {}).items()},
                       requantize={str(k): str(v)
                                   for k, v in (d.get("requantize") or {}).items()})
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise tierstore.StoreError(f"{where}: model.json is damaged ({e!r}); import the "
                                       "model again into a new store") from e


def stored_model(store: tierstore.Store) -> StoredModel:
    """The store's model: an import's ``model.json``, or a trainer run read as the
    architecture its export writes; :class:`tierstore.StoreError` if it holds neither."""
    if MODEL_ENTRY in store:
        info = read_json_entry(store, *MODEL_ENTRY)
        if not isinstance(info, dict) or info.get("format") != FORMAT:
            fmt = info.get("format") if isinstance(info, dict) else None
            raise tierstore.StoreError(
                f"store {store.path} holds a model imported in format {fmt!r}, which this "
                "release no longer reads; import the checkpoint again into a new store")
        return StoredModel.from_json(info, str(store.path))
    from .trainer_runs import trainer_run_model

    return trainer_run_model(store)
