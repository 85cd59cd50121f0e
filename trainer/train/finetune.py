"""Fine-tuning a Hugging Face checkpoint that ``tierstore import-hf`` put in a store.

A store that holds an imported model (its ``model.json``) is trained as that model: the
same :class:`trainer.model.ModelConfig` inference runs, with the family's training losses as
``transformers`` computes them (:func:`finetune_config`), on text encoded by the model's own
tokenizer (:func:`tokenize_corpus`). Everything else is the store trainer's: the experts'
fp32 masters and AdamW moments live in the store, the dense weights train on the device, and
checkpoints are snapshots. Where each trained weight lives afterwards, and how the imported
entries become fp32 masters, is :mod:`trainer.train.checkpoint`'s to say.

Losses: cross-entropy over every position (targets are the next tokens of a packed window)
plus, where the checkpoint's ``config.json`` sets ``output_router_logits``, its
``router_aux_loss_coef`` times transformers' ``load_balancing_loss_func`` (one Switch loss
over every MoE layer's tokens, :func:`trainer.model.load_balancing_loss`); without it
``transformers`` adds no router loss, and neither does this. The families have no router
z-loss in ``transformers``, so it is off.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor

import tierstore

from ..model import EXPERT_WEIGHTS, ModelConfig, expert_name
from .data import Corpus, CorpusError

if TYPE_CHECKING:
    import tokenizers

    from .resident import TrainConfig

PathLike = str | os.PathLike[str]

# transformers' defaults where config.json leaves router_aux_loss_coef out.
AUX_COEF_DEFAULTS = {"mixtral": 0.001, "qwen2_moe": 0.001, "olmoe": 0.01, "qwen3_moe": 0.001}
# Compute dtypes training runs in: fp16 weights train with fp32 compute (autocast in fp16
# would need loss scaling, which the trainer does not do).
_COMPUTE = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float32"}


@dataclass(frozen=True)
class ImportedModel:
    """What fine-tuning needs of a store's imported model: ``model.json`` and the tokenizer
    (``tokenizer.json``'s text; ``None`` if the import had none)."""

    info: dict[str, Any]
    tokenizer_json: bytes | None
    where: str

    @property
    def family(self) -> str:
        return str(self.info["family"])

    def tokenizer(self) -> tokenizers.Tokenizer:
        if self.tokenizer_json is None:
            raise CorpusError(f"{self.where} holds no tokenizer.json to encode the training text "
                              "with; import the model from a directory that has one")
        from ..infer.loading import parse_tokenizer

        return parse_tokenizer(self.tokenizer_json, f"{self.where}: its tokenizer.json",
                               "import the model again from a directory whose tokenizer "
                               "loads")


def imported_model(store: PathLike | tierstore.Store | None) -> ImportedModel | None:
    """The imported model the store (an open one, or the path of one) holds; ``None`` when
    there is no store or it holds no imported model (an empty store, a trainer run)."""
    from ..infer.loading import MODEL_ENTRY, TOKENIZER_KIND, TOKENIZER_PREFIX

    if store is None:
        return None
    if isinstance(store, str | os.PathLike):
        try:
            opened = tierstore.open(store, host_cache=0)
        except tierstore.NotAStoreError:
            return None
        with opened:
            return imported_model(opened)
    if MODEL_ENTRY not in store:
        return None
    info = json.loads(store.get(*MODEL_ENTRY).numpy().tobytes())
    tok = TOKENIZER_PREFIX + "tokenizer.json"
    raw = (store.get(tok, TOKENIZER_KIND).numpy().tobytes()
           if (tok, TOKENIZER_KIND) in store else None)
    return ImportedModel(info, raw, f"store {store.path}")


def finetune_config(model: ImportedModel | dict[str, Any], tc: TrainConfig | None = None
                    ) -> ModelConfig:
    """The config an imported model trains with: its own, with the family's router losses as
    ``transformers`` computes them (see the module docstring) and the compute dtype ``tc``
    asks for (by default the checkpoint's: bf16 weights compute in bf16 under autocast)."""
    info = model.info if isinstance(model, ImportedModel) else model
    cfg = ModelConfig.from_dict(info["config"])
    hf = info.get("hf_config") or {}
    coef = 0.0
    if hf.get("output_router_logits"):
        coef = float(hf.get("router_aux_loss_coef", AUX_COEF_DEFAULTS.get(cfg.family, 0.001)))
    dtype = (tc.dtype if tc is not None and tc.dtype else None) or _COMPUTE.get(cfg.dtype,
                                                                                "float32")
    if tc is not None and tc.seq_len > cfg.max_position:
        raise ValueError(f"seq_len {tc.seq_len} exceeds the model's {cfg.max_position} "
                         "positions")
    return replace(cfg, router_aux_form="transformers", router_aux_coef=coef,
                   router_z_coef=0.0, dtype=dtype)


def tokenize_corpus(corpus: Corpus, tokenizer: tokenizers.Tokenizer, cfg: ModelConfig
                    ) -> Corpus:
    """``corpus`` (bytes, as :func:`trainer.train.data.load_corpus` reads it) encoded by the
    model's tokenizer and packed: each document encoded on its own (with the special tokens
    the tokenizer adds, a Llama tokenizer's ``<s>`` say), followed by the model's first
    end-of-sequence token, all joined into one ``int32`` stream per split that the sampler
    cuts windows from. A corpus already encoded is returned as it is."""
    if not corpus.is_bytes:
        return corpus
    eos = np.asarray(cfg.eos_token_ids[:1], dtype=np.int64)

    def encode(data: np.ndarray, lengths: list[int]) -> np.ndarray:
        bounds = np.cumsum([0, *lengths]) if lengths else np.array([0, data.size])
        docs = [data[a:b].tobytes().decode("utf-8", errors="replace")
                for a, b in zip(bounds[:-1], bounds[1:])]
        parts = []
        for enc in tokenizer.encode_batch(docs):
            parts += [np.asarray(enc.ids, dtype=np.int64), eos]
        out = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
        if out.size and (out.max() >= cfg.vocab_size or out.min() < 0):
            raise CorpusError(f"the tokenizer gives token id {int(out.max())}, beyond the "
                              f"model's vocabulary of {cfg.vocab_size}")
        return out.astype(np.int32)

    return replace(corpus, train=encode(corpus.train, corpus.train_lengths),
                   val=encode(corpus.val, corpus.val_lengths))


def imported_state(store: tierstore.Store, cfg: ModelConfig) -> dict[str, Tensor]:
    """The imported model's whole state as fp32 tensors under :class:`trainer.model.MoEModel`'s
    names (dense weights and every expert): the starting point of a fine-tune held in memory
    (the resident reference, ``bench train``)."""
    from ..infer.loading import DENSE_PREFIX

    names = store.names(DENSE_PREFIX, kind="param")
    state = {n[len(DENSE_PREFIX):]: t.float() for n, t in store.get_many(names).items()}
    for layer in cfg.moe_layers:
        keys = [expert_name(layer, e, w) for e in range(cfg.n_experts) for w in EXPERT_WEIGHTS]
        for n, t in store.get_many(keys).items():
            state[str(n)] = t.to(torch.float32)
    return state
