"""tierstore for Hugging Face MoE models, through ``transformers``' own model code.

Importing this package registers ``"tierstore"`` with ``transformers``' ``ExpertsInterface``
(:mod:`tierstore.hf.backend`). :func:`load` returns a stored model as the checkpoint's own
class (``DeepseekV3ForCausalLM``, ``GptOssForCausalLM``, ...), its dense weights loaded and
its experts left in the store: every experts module asks the store, through the mode's
source, for exactly the experts its tokens route to. ``transformers`` keeps attention,
routing, caches and ``generate``::

    import tierstore.hf

    model = tierstore.hf.load("store")                # an import-hf store, or a daemon socket
    out = model.generate(input_ids, max_new_tokens=32)
    model.tierstore.close()                           # the source, and the store it opened

``load(store, trainable=True)`` gives the model to fine-tune in a loop of one's own
(:mod:`tierstore.hf.train`): ``model.parameters()`` are the dense weights, for any torch
optimizer, and :class:`ExpertAdamW` trains the experts, their masters and moments in the
store; :func:`clip_grad_norm_` clips both by one norm, :class:`CombinedOptimizer` steps both
(for ``transformers.Trainer``), :func:`save` puts the dense weights in the store too;
:func:`save_checkpoint` and :func:`load_checkpoint` (:mod:`tierstore.hf.resume`) checkpoint
the loop as a store snapshot and resume it bit for bit.

:func:`import_hf` (``tierstore import-hf``) puts any checkpoint of a family whose experts
``transformers`` dispatches through that interface into a store, mapped with
``transformers``' own conversion mapping; :func:`export_hf` (``tierstore export-hf``) writes a
stored model back as the checkpoint ``save_pretrained`` writes for its family, through the
reverse of that mapping, one expert at a time.
"""

from __future__ import annotations

import os
from typing import Any

import torch

import tierstore

from .backend import IMPLEMENTATION, register
from .exporter import export_hf
from .families import causal_lm_families
from .importer import import_hf
from .loader import Loaded, build, dtype_of, open_store
from .resume import Checkpoint, CheckpointCallback, load_checkpoint, save_checkpoint
from .strategies import MODES, make_source, resolve_mode
from .train import (
    CombinedOptimizer,
    ExpertAdamW,
    clip_grad_norm_,
    load_trainable,
    reduce_gradients,
    save,
)

register()

__all__ = ["IMPLEMENTATION", "MODES", "Checkpoint", "CheckpointCallback", "CombinedOptimizer",
           "ExpertAdamW", "Loaded", "causal_lm_families", "clip_grad_norm_", "export_hf",
           "import_hf", "load", "load_checkpoint", "reduce_gradients", "save",
           "save_checkpoint"]


def load(store: str | os.PathLike[str] | tierstore.Store, *, trainable: bool = False,
         mode: str = "auto", device: str | torch.device | None = None,
         dtype: str | torch.dtype | None = None, device_budget: int | str | None = None,
         host_cache: int | str | None = None, ring_slots: int | str = "auto",
         fetch: str = "auto", process_group: Any = None, paradigm: str = "auto",
         pipeline: int | str = "auto") -> Any:
    """The store's model as its ``transformers`` class, in eval mode, its experts served
    from the store by ``mode`` (``auto``, ``expert``, ``on-demand``, ``ring``,
    ``resident``; ``model.tierstore.mode`` says which ``auto`` chose and
    ``model.tierstore.notes`` why).

    ``trainable=True``: the model in training mode, its dense weights fp32 parameters, its
    experts trained through the store by :class:`ExpertAdamW` (:mod:`tierstore.hf.train`);
    ``mode`` and ``ring_slots`` are the inference sources' and do not apply, ``fetch`` says
    how experts reach the device (``auto``, ``queue``, ``direct``), and ``dtype`` can only
    be fp32 (compute in bf16 with ``torch.autocast``); ``process_group`` trains it
    expert-parallel under torchrun, its MoE blocks exchanged by ``paradigm`` and
    ``pipeline`` as ``tierstore train --distributed`` does
    (:func:`tierstore.hf.train.load_trainable`).

    ``store``: a store directory, a daemon's socket, or an open :class:`tierstore.Store`
    (left open). ``device``: default CUDA where there is one, else the CPU. ``dtype``: the
    compute dtype (default: the stored one). ``device_budget`` / ``host_cache``: the
    store's budgets (bytes or sizes such as ``"2GiB"``), as ``tierstore.open`` takes them.
    """
    dev = torch.device(device if device is not None else
                       ("cuda" if torch.cuda.is_available() else "cpu"))
    if trainable:
        if mode != "auto":
            raise ValueError(f"mode {mode!r} serves inference; a trainable model's experts "
                             "come from the store trainer (fetch= says how)")
        if dtype_of(dtype) not in (None, torch.float32):
            raise ValueError("a trainable model keeps fp32 weights; compute in bf16 with "
                             "torch.autocast")
        return load_trainable(store, device=dev, host_cache=host_cache,
                              device_budget=device_budget, fetch=fetch,
                              process_group=process_group, paradigm=paradigm,
                              pipeline=pipeline)
    if process_group is not None:
        raise ValueError("process_group is for training (trainable=True)")
    st, owns = open_store(store, host_cache=host_cache, device_budget=device_budget)
    try:
        model, loaded = build(st, owns, device=dev, dtype=dtype_of(dtype))
        chosen, why = resolve_mode(mode, st, loaded.served, None)
        if why:
            loaded.notes.append(f"mode auto: {chosen}, as {why}")
        loaded.attach(make_source(chosen, st, loaded.served, ring_slots=ring_slots), chosen)
    except BaseException:
        if owns:
            st.close()
        raise
    return model
