"""``tierstore import-hf``: a Hugging Face MoE model directory into a store.

Reads ``config.json`` (and ``generation_config.json`` for end-of-sequence ids,
:mod:`trainer.infer.hf_config`), the weights (:mod:`trainer.infer.hf_checkpoint`) and the
tokenizer files, and writes the layout :mod:`trainer.infer.loading` loads: every expert as
``layers.{i}.experts.{e}.w1|w2|w3`` in ONE ``put_many`` (its three tensors commit
together), the dense weights under ``dense.`` with the model's names, the tokenizer files
under ``tokenizer.``, and ``model.json`` last, so a store whose import was interrupted holds
no model rather than half of one. ``model.json`` keeps the original ``config.json`` and the
checkpoint's layout (its tensor names, per-expert or fused experts:
:mod:`trainer.infer.hf_layout`), from which ``tierstore export-hf`` writes it back.

An import first records where it comes from (``import.json``: the HF config and the weight
files' names and sizes). ``resume=True`` (``--resume``) continues an interrupted import of
the same checkpoint: an expert whose three tensors are stored with the checkpoint's shapes in the
model's dtype is kept (they were committed together), as is a dense tensor stored so;
everything else is imported (the small tokenizer files always are).

Every number the import uses is checked before a model object is built or a store opened:
the config's values in sane ranges, then against the safetensors headers (the layers,
experts and shapes the checkpoint actually holds), and every tensor's dtype against the
model's (:func:`~trainer.infer.hf_checkpoint.check_dtype`: what transformers would cast
with a loss, or is no weight at all, is refused; the rest is stored in the model's dtype).
The tokenizer is loaded once to prove it works. Experts and dense tensors are read in
shard order with at most two shard files open, so an import's memory is bounded by one
expert and the shards it is reading, not by the checkpoint's size.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

import tierstore

from ..model import ModelConfig, expert_names
from .hf_checkpoint import (
    CheckpointReader,
    check_against_weights,
    check_complete,
    check_dtypes,
    fused_expert,
    model_dtype,
    plan,
    weight_files,
)
from .hf_config import (
    HFImportError,
    build_from_hf,
    check_config,
    family_of,
    generation_eos,
    read_hf_config,
)
from .hf_layout import record_layout
from .loading import (
    DENSE_PREFIX,
    MODEL_ENTRY,
    MODEL_FORMAT,
    TOKENIZER_KIND,
    TOKENIZER_PREFIX,
    json_entry,
    parse_tokenizer,
)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json",
                   "generation_config.json", "chat_template.jinja")

IMPORT_ENTRY = ("import.json", "meta")  # the source of an import under way


def import_hf(model_dir: str | os.PathLike[str], store_path: str | os.PathLike[str],
              progress: bool | Callable[[int], Any] = True, *,
              resume: bool = False) -> dict[str, Any]:
    """Import the model in ``model_dir`` into the store at ``store_path`` (created if
    missing) and return its ``model.json`` content. ``progress``: ``True`` for a tqdm bar
    over the bytes imported, or a callable that receives byte counts. ``resume``: continue
    an interrupted import of the same checkpoint (see the module docstring).

    Everything is checked (config values, the config against the weights' headers, every
    tensor's shape and dtype, the tokenizer) before the store is opened; a checkpoint that
    fails a check leaves no store behind."""
    model_dir = os.fspath(model_dir)
    hf = read_hf_config(model_dir)
    hf_path = os.path.join(model_dir, "config.json")
    try:
        family = family_of(hf)
    except ValueError as e:
        raise HFImportError(f"{model_dir}: {e}") from e
    sizes = check_config(hf, hf_path, family)
    heads = weight_files(model_dir)
    check_against_weights(hf_path, sizes, heads)
    try:
        cfg = build_from_hf(hf)
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        msg = str(e) if isinstance(e, ValueError) else f"config.json lacks or garbles {e}"
        raise HFImportError(f"{model_dir}: {msg}; fix config.json") from e
    eos = generation_eos(model_dir)
    if eos:
        cfg = replace(cfg, eos_token_ids=tuple(dict.fromkeys((*cfg.eos_token_ids, *eos))))
    dense, per_expert, fused = plan(cfg, sorted(heads))
    check_complete(cfg, dense, per_expert, fused, heads, hf_path)
    dtype = model_dtype(hf, heads)
    check_dtypes([*dense.values(), *(n for e in per_expert.values() for n in e.values()),
                  *(n for f in fused.values() for n in f.values())], heads, dtype)
    tokenizer = read_tokenizer_files(model_dir)
    layout = record_layout(cfg, dense, per_expert, fused,
                           {k: h.shape for k, h in heads.items()}, sorted(heads))
    reader = CheckpointReader(heads, dtype=dtype)
    files = sorted({h.path for h in heads.values()})

    total = sum(os.path.getsize(p) for p in files)
    bar: Any = None
    if progress is True:
        from tqdm import tqdm

        bar = tqdm(total=total, desc="import-hf", unit="B", unit_scale=True,
                   unit_divisor=1024, disable=None, dynamic_ncols=True)
        advance: Callable[[int], Any] = bar.update
    elif callable(progress):
        advance = progress
    else:
        def advance(n: int) -> None:
            return None

    source = {"hf_config": hf,
              "files": sorted((os.path.basename(p), os.path.getsize(p)) for p in files)}
    # No host cache: an import reads nothing back, and each expert should be durable once
    # its put_many returns, so that an interrupted import can be resumed from there.
    with tierstore.open(store_path, create=True, host_cache=0) as store:
        _begin(store, source, resume)
        keep = _Keep(store, resume)
        try:
            _put_experts(store, reader, cfg, per_expert, fused, advance, keep)
            cfg = replace(cfg, dtype=str(dtype).removeprefix("torch."))
            for name, hf_name in sorted(dense.items(), key=lambda d: (reader.rank(d[1]), d[0])):
                shape, src = reader.shape(hf_name), reader.dtype(hf_name)
                assert src is not None  # check_dtypes refused the rest
                if not keep(DENSE_PREFIX + name, shape, dtype):
                    store.put(DENSE_PREFIX + name, reader.get(hf_name).contiguous())
                advance(math.prod(shape) * src.itemsize)
            reader.close()
            for fname, raw in tokenizer.items():
                store.put(TOKENIZER_PREFIX + fname,
                          torch.frombuffer(bytearray(raw), dtype=torch.uint8)
                          if raw else torch.zeros(0, dtype=torch.uint8), kind=TOKENIZER_KIND)
            toks = list(tokenizer)
            info = {"format": MODEL_FORMAT, "family": cfg.family, "config": cfg.to_dict(),
                    "hf_config": hf, "hf_layout": layout, "dense_prefix": DENSE_PREFIX,
                    "tokenizer": toks}
            store.put(MODEL_ENTRY[0], json_entry(info), kind=MODEL_ENTRY[1])
            store.delete(IMPORT_ENTRY[0], IMPORT_ENTRY[1], missing_ok=True)
            store.flush()
        finally:
            reader.close()
            if bar is not None:
                bar.close()
    return info


def read_tokenizer_files(model_dir: str) -> dict[str, bytes]:
    """The model directory's tokenizer files (:data:`TOKENIZER_FILES`), read and proven
    before anything is stored: ``tokenizer.json`` loads and encodes text (what ``tierstore
    generate --prompt`` will do with it), and each JSON file beside it parses. A file that
    does not is refused, naming it."""
    out: dict[str, bytes] = {}
    for fname in TOKENIZER_FILES:
        path = os.path.join(model_dir, fname)
        if not os.path.isfile(path):
            continue
        try:
            with open(path, "rb") as f:
                raw = f.read()
        except OSError as e:
            raise HFImportError(f"{path}: unreadable ({e}); fix its permissions or "
                                "remove it") from e
        if fname == "tokenizer.json":
            parse_tokenizer(raw, path, "use the model's original tokenizer.json, or remove "
                            "it to import the model without a tokenizer")
        elif fname.endswith(".json"):
            try:
                json.loads(raw)
            except ValueError as e:
                raise HFImportError(f"{path}: not JSON ({e}); use the model's original "
                                    "file, or remove it") from e
        out[fname] = raw
    return out


def _begin(store: tierstore.Store, source: dict[str, Any], resume: bool) -> None:
    """Refuse a store that holds a model, or another import; record this import's source
    (or, resuming, check that the interrupted import had the same one)."""
    if MODEL_ENTRY in store:
        raise HFImportError(f"store {store.path} already holds a model; import into a new store")
    begun = IMPORT_ENTRY in store
    if not begun and not store.names("layers."):
        store.put(IMPORT_ENTRY[0], json_entry(source), kind=IMPORT_ENTRY[1])
        return
    if not begun:
        raise HFImportError(f"store {store.path} already holds expert entries; import into a "
                            "new store")
    if not resume:
        raise HFImportError(f"store {store.path} holds an interrupted import; continue it with "
                            "--resume, or import into a new store")
    was = json.loads(bytes(store.get(*IMPORT_ENTRY).numpy()).decode())
    if was != json.loads(json.dumps(source)):
        raise HFImportError(f"store {store.path} holds an interrupted import of another checkpoint "
                            "(its config or weight files differ); import into a new store")


class _Keep:
    """Resuming: whether an entry is already stored as the checkpoint has it."""

    def __init__(self, store: tierstore.Store, resume: bool) -> None:
        self.store, self.resume = store, resume

    def __call__(self, name: str, shape: list[int], dtype: torch.dtype | None) -> bool:
        if not self.resume or dtype is None or name not in self.store:
            return False
        info = self.store.info(name)
        return info.dtype == dtype and list(info.shape) == list(shape)


def _put_experts(store: tierstore.Store, reader: CheckpointReader, cfg: ModelConfig,
                 per_expert: dict[tuple[int, int], dict[str, str]],
                 fused: dict[int, dict[str, str]], advance: Callable[[int], Any],
                 keep: _Keep) -> None:
    """Every expert in one ``put_many`` each, in the model's dtype (those ``keep`` says are
    stored already are skipped)."""
    want = [[cfg.moe_ffn, cfg.hidden_size], [cfg.hidden_size, cfg.moe_ffn],
            [cfg.moe_ffn, cfg.hidden_size]]

    def first(layer: int, e: int) -> str:
        return fused[layer]["gate_up_proj"] if layer in fused else per_expert[(layer, e)]["w1"]

    # In the order of the files, so that each is read through before the next is opened.
    work = sorted(((layer, e) for layer in cfg.moe_layers for e in range(cfg.n_experts)),
                  key=lambda le: (reader.rank(first(*le)), le))
    for layer, e in work:
        src = reader.dtype(first(layer, e))
        assert src is not None  # check_dtypes refused the rest
        names = expert_names(layer, e)
        if all(keep(n, w, reader.target) for n, w in zip(names, want)):
            advance(sum(math.prod(w) for w in want) * src.itemsize)
            continue
        if layer in fused:
            w1, w2, w3 = fused_expert(reader, cfg, layer, fused[layer], e)
        else:
            hf_names = per_expert[(layer, e)]
            w1, w2, w3 = (reader.get(hf_names[w]) for w in ("w1", "w2", "w3"))
        shapes = [list(w.shape) for w in (w1, w2, w3)]
        if shapes != want:
            raise HFImportError(f"layer {layer} expert {e}: shapes {shapes}, config says {want}")
        store.put_many(list(zip(names, (w1, w2, w3))))
        advance(sum(math.prod(w) for w in want) * src.itemsize)
