"""A model in a store: its layout, and loading its dense part for inference.

Store layout of a model (written by :mod:`trainer.infer.hf_import`; a trainer run keeps its
experts under the same names and its dense state in its latest checkpoint):

* ``model.json`` (kind ``meta``): UTF-8 JSON as a uint8 tensor, ``{"format": 1, "family",
  "config": ModelConfig fields, "hf_config", "hf_layout", "dense_prefix": "dense.",
  "tokenizer": [file names]}`` (``hf_layout``: the checkpoint's tensor names and expert
  layout, :mod:`trainer.infer.hf_layout`; absent in stores imported before it was recorded);
* ``layers.{i}.experts.{e}.w1|w2|w3`` (kind ``param``): gate ``[ffn, hidden]``, down
  ``[hidden, ffn]``, up ``[ffn, hidden]``, in the model's dtype (config.json's);
* ``dense.{name}`` (kind ``param``): the model's own state-dict names;
* ``tokenizer.{file}`` (kind ``meta``): tokenizer files as uint8 tensors.

:func:`load_model` builds a :class:`trainer.model.MoEDecoder` from it; its experts stay in
the store and reach it through an expert source (:mod:`trainer.infer.sources`,
:mod:`trainer.infer.ring`, :mod:`trainer.infer.expert_mode`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

import tierstore

from ..model import ModelConfig, MoEDecoder, dtype_of
from .hf_config import supported_text

if TYPE_CHECKING:
    import tokenizers

MODEL_ENTRY = ("model.json", "meta")
DENSE_PREFIX = "dense."
TOKENIZER_PREFIX = "tokenizer."
TOKENIZER_KIND = "meta"
MODEL_FORMAT = 1


def read_json_entry(store: tierstore.Store, name: str, kind: str = "meta") -> Any:
    return json.loads(store.get(name, kind).numpy().tobytes())


def json_entry(obj: Any) -> Tensor:
    """A JSON-serialisable object as a uint8 tensor (how ``model.json`` is stored)."""
    raw = bytearray(json.dumps(obj, sort_keys=True).encode())
    return torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.zeros(0, dtype=torch.uint8)


def model_info(store: tierstore.Store) -> dict[str, Any]:
    """``model.json`` of the store, or for a trainer run the equivalent built from its
    latest checkpoint (family ``tierstore``); :class:`tierstore.StoreError` if neither."""
    if MODEL_ENTRY in store:
        return read_json_entry(store, *MODEL_ENTRY)
    payload = _trainer_payload(store)
    from ..presets import MoEConfig

    # The trainer keeps fp32 master weights whatever it computed in: decode in fp32.
    cfg = replace(MoEConfig.from_dict(payload["model_config"]).model_config(), dtype="float32")
    return {"format": MODEL_FORMAT, "family": "tierstore", "config": cfg.to_dict(),
            "hf_config": None, "dense_prefix": DENSE_PREFIX, "tokenizer": [],
            "step": int(payload["step"])}


def _trainer_payload(store: tierstore.Store) -> dict[str, Any]:
    from ..train.checkpoint import latest_dense_state

    payload = latest_dense_state(store)
    if payload is None:
        raise tierstore.StoreError(
            f"store {store.path} holds no model: import one with `tierstore import-hf` or "
            f"train one with `tierstore train` (supported: {supported_text()})")
    return payload


def load_config(store: tierstore.Store) -> ModelConfig:
    return ModelConfig.from_dict(model_info(store)["config"])


def load_model(store: tierstore.Store, device: torch.device | str = "cpu",
               dtype: torch.dtype | str | None = None) -> MoEDecoder:
    """The dense part of the store's model on ``device`` in ``dtype`` (default: the stored
    dtype), in eval mode. Experts stay in the store; pass an expert source."""
    info = model_info(store)
    cfg = ModelConfig.from_dict(info["config"])
    dt = dtype_of(dtype) or dtype_of(cfg.dtype) or torch.float32
    with torch.device("meta"):
        model = MoEDecoder(cfg)
    if info["family"] == "tierstore":
        state = {k: v for k, v in _trainer_payload(store)["model"].items()
                 if ".experts." not in k and not k.startswith("rope_")}
    else:
        prefix = info.get("dense_prefix", DENSE_PREFIX)
        names = store.names(prefix, kind="param")
        state = {n[len(prefix):]: t for n, t in store.get_many(names).items()}
    expected = set(model.state_dict())
    missing, extra = expected - set(state), set(state) - expected
    if missing or extra:
        raise tierstore.StoreError(
            f"store {store.path}: dense weights do not fit the {cfg.family} config "
            f"(missing {sorted(missing)[:5]}, unexpected {sorted(extra)[:5]})")
    model.load_state_dict({k: v.to(dtype=dt) for k, v in state.items()}, assign=True)
    return model.to(device=device).eval()


def load_tokenizer(store: tierstore.Store) -> tokenizers.Tokenizer | None:
    """The store's ``tokenizer.json`` as a ``tokenizers.Tokenizer``; ``None`` when the model
    has no tokenizer (a trainer run is byte-level: token ids are bytes)."""
    name = TOKENIZER_PREFIX + "tokenizer.json"
    if (name, TOKENIZER_KIND) not in store:
        return None
    return parse_tokenizer(store.get(name, TOKENIZER_KIND).numpy().tobytes(),
                           f"store {store.path}: its tokenizer.json",
                           "import the model again from a directory whose tokenizer loads")


def parse_tokenizer(raw: bytes, where: str, fix: str) -> tokenizers.Tokenizer:
    """``tokenizer.json``'s bytes as a ``tokenizers.Tokenizer`` that has encoded and decoded
    a line of text; anything else is a :class:`tierstore.StoreError` naming ``where`` and
    saying what to do (``fix``)."""
    import tokenizers

    try:
        tok = tokenizers.Tokenizer.from_str(raw.decode("utf-8"))
        tok.decode(tok.encode("The quick brown fox, 0123456789.").ids)
    except Exception as e:  # noqa: BLE001  (tokenizers raises plain Exceptions)
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise tierstore.StoreError(f"{where} does not load as a tokenizer ({why}); "
                                   f"{fix}") from e
    return tok


def tokenizer_files(store: tierstore.Store) -> dict[str, bytes]:
    """Every stored tokenizer file, by its original file name."""
    names = store.names(TOKENIZER_PREFIX, kind=TOKENIZER_KIND)
    return {n[len(TOKENIZER_PREFIX):]: store.get(n, TOKENIZER_KIND).numpy().tobytes()
            for n in names}


def stop_tokens(cfg: ModelConfig, extra: Sequence[int] = ()) -> tuple[int, ...]:
    """End-of-sequence ids of the model plus ``extra``."""
    return tuple(dict.fromkeys((*cfg.eos_token_ids, *extra)))
