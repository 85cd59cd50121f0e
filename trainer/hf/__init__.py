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
from .strategies import MODES, make_source, resolve_mode

register()

__all__ = ["IMPLEMENTATION", "MODES", "Loaded", "causal_lm_families", "export_hf", "import_hf",
           "load"]


def load(store: str | os.PathLike[str] | tierstore.Store, *, mode: str = "auto",
         device: str | torch.device | None = None, dtype: str | torch.dtype | None = None,
         device_budget: int | str | None = None, host_cache: int | str | None = None,
         ring_slots: int | str = "auto") -> Any:
    """The store's model as its ``transformers`` class, in eval mode, its experts served
    from the store by ``mode`` (``auto``, ``expert``, ``on-demand``, ``ring``,
    ``resident``; ``model.tierstore.mode`` says which ``auto`` chose and
    ``model.tierstore.notes`` why).

    ``store``: a store directory, a daemon's socket, or an open :class:`tierstore.Store`
    (left open). ``device``: default CUDA where there is one, else the CPU. ``dtype``: the
    compute dtype (default: the stored one). ``device_budget`` / ``host_cache``: the
    store's budgets (bytes or sizes such as ``"2GiB"``), as ``tierstore.open`` takes them.
    """
    dev = torch.device(device if device is not None else
                       ("cuda" if torch.cuda.is_available() else "cpu"))
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
