"""Fine-tuning a model that ``tierstore import-hf`` put in a store, through its own
``transformers`` class.

Any family the :mod:`tierstore.hf` backend serves trains: the model is built by
:func:`tierstore.hf.loader.build` (the checkpoint's class on the meta device, its dense
weights loaded from the store as fp32 masters, every experts module bound to its entries)
and its experts are served by the trainer's :class:`~.expert_states.ExpertStates`
(:meth:`tierstore.hf.loader.Loaded.attach_trainable`): fp32 leaves that require grad, so
``transformers``' own attention, routers and losses run unchanged and autograd gives each
routed expert's gradient. Everything else is the store trainer's: the experts' AdamW moments
live in the store and are updated under the dense rule by default (:mod:`.dense_rule`; or
the lazy one), the dense parameters train with ``torch.optim.AdamW`` on the device, one
global norm clips both, checkpoints are snapshots.

Loss: ``transformers``' own, ``model(input_ids, labels=..., shift_labels=...)`` over every
position of a packed window (the targets are the next tokens), which adds the router's
auxiliary loss (``router_aux_loss_coef`` times ``load_balancing_loss_func``) where the
checkpoint's ``config.json`` sets ``output_router_logits``. The metrics report its parts:
``loss`` the cross-entropy, ``aux_loss`` the router loss, ``z_loss`` 0.

Data: text encoded by the model's own tokenizer (:func:`tokenize_corpus`).

Compute: fp32, or bf16 through autocast for a bf16 checkpoint (fp16 ones compute in fp32:
autocast in fp16 would need loss scaling), or what ``TrainConfig.dtype`` says; the weights
are fp32 masters either way.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from tierstore.hf.layout import MODEL_ENTRY, StoredModel, stored_model
from tierstore.hf.quant_train import build_trainable
from tierstore.hf.served import ServedModel
from tierstore.hf.tokenizer import load_tokenizer
from torch import Tensor

import tierstore

from ..infer.budget import PassShape
from .budget import TrainShape
from .checkpoint import TrainerError, initialise_imported
from .data import Corpus, CorpusError
from .expert_states import ExpertStates
from .layout import ExpertLayout, LayerEntries
from .nets import TrainNet

if TYPE_CHECKING:
    import tokenizers

    from .resident import TrainConfig

# The compute dtype of a checkpoint's dtype, where TrainConfig.dtype leaves it open.
COMPUTE = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float32"}


def imported(store: tierstore.Store) -> StoredModel | None:
    """The model ``tierstore import-hf`` put in ``store``; ``None`` when it holds none (an
    empty store, a trainer run). A store of an import format this release no longer reads
    is a one-line :class:`tierstore.StoreError`."""
    return stored_model(store) if MODEL_ENTRY in store else None


def served_layout(served: ServedModel, store: tierstore.Store) -> ExpertLayout:
    """The store trainer's view of a loaded model's experts: each bound experts module's
    entries in the order the backend hands them over, their shapes as stored."""
    layers = []
    for key in served.moe_layers:
        layer = served.layers[key]
        parts = tuple(part for p in layer.params for part in p.parts)
        shapes = tuple(tuple(store.info(n).shape) for n in layer.entry_names(0))
        layers.append(LayerEntries(key, layer.prefix, parts, shapes))
    return ExpertLayout(tuple(layers), served.n_experts, served.top_k)


def train_shape(config: Any, layout: ExpertLayout) -> TrainShape:
    """The activation bound's sizes, read off a ``transformers`` config: the widest
    intermediate of the config's FFN sizes, ``top_k`` times (a bound on ``k`` experts, a
    dense FFN and a shared expert alike)."""
    p = PassShape.of(config, layout.top_k)
    c = config.get_text_config()
    return TrainShape(int(getattr(c, "num_hidden_layers", 0) or len(layout.keys)), p.hidden,
                      p.heads, p.ffn * layout.top_k, layout.top_k, layout.n_experts, p.vocab)


def compute_dtype(stored_dtype: str, tc: TrainConfig) -> str:
    return tc.dtype or COMPUTE.get(stored_dtype, "float32")


def _aux_coef(model: Any) -> float | None:
    """The factor ``transformers`` adds the router loss with, as the family's forward reads
    it (None: read elsewhere)."""
    for v in (getattr(model, "router_aux_loss_coef", None), getattr(model, "aux_loss_coef", None),
              getattr(model.config.get_text_config(), "router_aux_loss_coef", None)):
        if isinstance(v, int | float):
            return float(v)
    return None


def hf_losses(model: Any, x: Tensor, y: Tensor, autocast: bool
              ) -> tuple[Tensor, dict[str, Tensor]]:
    """``transformers``' own loss of a packed window (``y``: the next tokens of ``x``) and
    its detached parts: cross-entropy, router loss, no z-loss. Shared by the fine-tune over
    the store and the one in memory (:mod:`.hf_resident`)."""
    ctx = (torch.autocast(device_type=x.device.type, dtype=torch.bfloat16) if autocast
           else nullcontext())
    with ctx:
        out = model(input_ids=x, labels=y, shift_labels=y, use_cache=False)
    loss = out.loss
    aux = getattr(out, "aux_loss", None)
    zero = loss.new_zeros(()).detach()
    if aux is None:
        return loss, {"ce": loss.detach(), "aux_loss": zero, "z_loss": zero}
    aux = aux.detach().to(loss.device)
    coef = _aux_coef(model)
    if coef is not None:
        ce = loss.detach() - coef * aux
    else:
        with torch.no_grad():
            ce = model.loss_function(logits=out.logits, labels=y, shift_labels=y,
                                     vocab_size=out.logits.shape[-1])
    return loss, {"ce": ce, "aux_loss": aux, "z_loss": zero}


class HFNet(TrainNet):
    """An imported model fine-tuned over its store (see the module docstring)."""

    finetune = True

    def __init__(self, store: tierstore.Store, stored: StoredModel, tc: TrainConfig,
                 device: torch.device, world: Any = None) -> None:
        # world: an expert-parallel rank's, whose node's ranks unpack a quantized store
        # together (tierstore.hf.quant_train)
        model, loaded = build_trainable(store, False, device, world)
        self.module, self.loaded = model, loaded
        limit = getattr(model.config.get_text_config(), "max_position_embeddings", None)
        if isinstance(limit, int) and tc.seq_len > limit:
            raise ValueError(f"seq_len {tc.seq_len} exceeds the model's {limit} positions")
        self.layout = served_layout(loaded.served, store)
        self.shape = train_shape(model.config, self.layout)
        self.record = {"finetune": stored.family, "hf_config": stored.hf_config}
        self.autocast = compute_dtype(stored.dtype, tc) == "bfloat16"
        self.entries = dense_entries(model, loaded.stored)
        model.train()

    def attach(self, experts: ExpertStates) -> None:
        self.loaded.attach_trainable(experts)

    def losses(self, x: Tensor, y: Tensor, experts: ExpertStates
               ) -> tuple[Tensor, dict[str, Tensor]]:
        return hf_losses(self.module, x, y, self.autocast)

    def initialise(self, store: tierstore.Store, seed: int) -> None:
        initialise_imported(store, self.layout)
        self.load_dense(store, {})

    def dense_payload(self, store: tierstore.Store) -> dict[str, Any]:
        write_dense(store, self.entries)
        return {"dense": "entries"}

    def load_dense(self, store: tierstore.Store, payload: dict[str, Any]) -> None:
        read_dense(store, self.entries)

    def tokenizer(self, store: tierstore.Store) -> tokenizers.Tokenizer:
        tok = load_tokenizer(store)
        if tok is None:
            raise CorpusError(f"store {store.path} holds no tokenizer.json to encode the "
                              "training text with; import the model from a directory that "
                              "has one")
        return tok


def dense_entries(model: Any, stored: StoredModel) -> dict[str, tuple[str, Tensor]]:
    """A loaded model's dense tensors by the names their entries are kept under (a tied
    weight under each name the import stored it by): ``{name: (entry, tensor)}``. The
    trained weights, and the buffers the checkpoint holds (a router's score correction),
    which stay as they are but are kept as fp32 too, so that the dense part of a fine-tune
    is one precision."""
    named = [*model.named_parameters(remove_duplicate=False), *model.named_buffers()]
    return {name: (stored.dense[name], t) for name, t in named if name in stored.dense}


def write_dense(store: tierstore.Store, entries: dict[str, tuple[str, Tensor]]) -> None:
    """Put :func:`dense_entries`' tensors into their entries, floating ones as fp32."""
    store.put_many([(entry, "param", _master(t)) for entry, t in entries.values()])


@torch.no_grad()
def read_dense(store: tierstore.Store, entries: dict[str, tuple[str, Tensor]]) -> None:
    """Copy the store's :func:`dense_entries` into the model's tensors, in place (an
    optimizer holding them keeps them)."""
    got = store.get_many([entry for entry, _ in entries.values()])
    for entry, p in entries.values():
        t = got[entry]
        if tuple(t.shape) != tuple(p.shape):
            raise TrainerError(f"store {store.path}: {entry} is {list(t.shape)}, the model "
                               f"needs {list(p.shape)}")
        p.copy_(t)


def _master(t: Tensor) -> Tensor:
    t = t.detach().to("cpu")
    return t.to(torch.float32) if t.is_floating_point() else t


def eos_id(config: Any) -> int | None:
    """The first end-of-sequence id of a ``transformers`` config (None: it names none)."""
    eos = getattr(config.get_text_config(), "eos_token_id", None)
    if isinstance(eos, list | tuple):
        eos = eos[0] if eos else None
    return eos if isinstance(eos, int) else None


def tokenize_corpus(corpus: Corpus, tokenizer: tokenizers.Tokenizer, eos: int | None,
                    vocab_size: int) -> Corpus:
    """``corpus`` (bytes, as :func:`trainer.train.data.load_corpus` reads it) encoded by the
    model's tokenizer and packed: each document encoded on its own (with the special tokens
    the tokenizer adds, a Llama tokenizer's ``<s>`` say), followed by the model's first
    end-of-sequence token, all joined into one ``int32`` stream per split that the sampler
    cuts windows from. A corpus already encoded is returned as it is."""
    if not corpus.is_bytes:
        return corpus
    sep = np.asarray([] if eos is None else [eos], dtype=np.int64)

    def encode(data: np.ndarray, lengths: list[int]) -> np.ndarray:
        bounds = np.cumsum([0, *lengths]) if lengths else np.array([0, data.size])
        docs = [data[a:b].tobytes().decode("utf-8", errors="replace")
                for a, b in zip(bounds[:-1], bounds[1:])]
        parts = []
        for enc in tokenizer.encode_batch(docs):
            parts += [np.asarray(enc.ids, dtype=np.int64), sep]
        out = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
        if out.size and (out.max() >= vocab_size or out.min() < 0):
            raise CorpusError(f"the tokenizer gives token id {int(out.max())}, beyond the "
                              f"model's vocabulary of {vocab_size}")
        return out.astype(np.int32)

    return replace(corpus, train=encode(corpus.train, corpus.train_lengths),
                   val=encode(corpus.val, corpus.val_lengths))


def model_corpus(corpus: Corpus, tokenizer: tokenizers.Tokenizer, config: Any) -> Corpus:
    """:func:`tokenize_corpus` with the model's end-of-sequence id and vocabulary."""
    return tokenize_corpus(corpus, tokenizer, eos_id(config),
                           int(config.get_text_config().vocab_size))

