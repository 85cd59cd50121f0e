"""``tierstore import-hf``: any Hugging Face MoE checkpoint into a store, through
``transformers``' own name mapping.

The family's causal-LM class is built on the meta device from ``config.json``; its experts
modules are those ``transformers`` dispatches through the experts interface
(:mod:`tierstore.hf.families`; any other MoE family is refused). The checkpoint's tensor
names are sorted with ``transformers``' conversion mapping (:mod:`tierstore.hf.convert`):
each expert of each experts module is converted on its own and stored as one entry per
fused parameter, ``{module}.{e}.{attr}``, the module's experts put one ``put_many`` per
expert (its tensors commit together); every other parameter as ``dense.{name}``; then the
tokenizer files, and ``model.json`` (:mod:`tierstore.hf.layout`) last, so an interrupted
import holds no model rather than half of one.

Everything is checked before the store is opened: the config's numbers, the family, every
conversion run on meta tensors of the headers' shapes against the model's, every expert
present, every tensor's dtype, and the tokenizer loaded once. Tensors are read in shard
order with at most two files open, a fused tensor one expert's slice at a time, so the
import's memory is bounded by one expert, the largest dense parameter and the shards being
read, not by the checkpoint.

``resume=True`` continues an interrupted import of the same checkpoint (``import.json``
records its config and weight files): an expert whose entries are stored with the shapes
and dtype the conversion gives is kept, as is a dense entry; the rest is imported.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from typing import Any

import torch

import tierstore

from .checkpoint import ST_DTYPES, CheckpointReader, HFImportError, weight_files
from .config import check_generation_config, hf_config, meta_model, read_config_json
from .convert import Plan, check_shapes, convert_dense, convert_expert, expert_params, plan
from .families import UnservedFamilyError, check_served
from .layout import (
    DENSE_PREFIX,
    IMPORT_ENTRY,
    MODEL_ENTRY,
    TOKENIZER_KIND,
    TOKENIZER_PREFIX,
    ExpertsModule,
    StoredModel,
    json_entry,
)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json",
                   "chat_template.jinja")
GENERATION_CONFIG = "generation_config.json"
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _read_json_file(path: str) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise HFImportError(f"{path}: unreadable ({e}); fix or remove it") from e


def _dt(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def check_dtypes(family: str, heads: dict[str, Any], p: Plan, model: torch.nn.Module
                 ) -> torch.dtype:
    """Every tensor has the kind of dtype its parameter has in the model: a float of a
    dtype ``transformers`` computes in where the model holds a float (an integer tensor
    there would be cast to nonsense, or zeroed, without a word), the model's own dtype
    where it holds anything else (a routing table of integers); and the experts share
    one dtype, which is returned. A mismatch names the tensor."""
    want = {**{k: v.dtype for k, v in model.state_dict().items()}}
    expert_dtypes: set[torch.dtype] = set()
    for groups, experts in ((p.dense, False), (p.experts, True)):
        for target, group in groups.items():
            target_dt = torch.float32 if experts else want.get(target, torch.float32)
            for s in group.sources:
                h = heads[s.key]
                dt = ST_DTYPES.get(h.dtype)
                if dt is None:
                    raise HFImportError(f"{h.path}: tensor {s.key!r} has dtype {h.dtype}, which "
                                        "the import cannot read; convert the checkpoint to "
                                        "bfloat16, float16 or float32")
                if target_dt.is_floating_point and dt not in FLOAT_DTYPES:
                    raise HFImportError(
                        f"{h.path}: tensor {s.key!r} is {_dt(dt)}, where {family}'s {target} is "
                        "a float; transformers would cast it to nonsense. Use the "
                        "checkpoint's original weights")
                if not target_dt.is_floating_point and dt != target_dt:
                    raise HFImportError(f"{h.path}: tensor {s.key!r} is {_dt(dt)}, where "
                                        f"{family}'s {target} is {_dt(target_dt)}; use the "
                                        "checkpoint's original weights")
                if experts:
                    expert_dtypes.add(dt)
    if len(expert_dtypes) > 1:
        names = ", ".join(sorted(_dt(d) for d in expert_dtypes))
        raise HFImportError(f"{family}: the checkpoint's experts mix dtypes ({names}); save "
                            "them in one")
    return next(iter(expert_dtypes)) if expert_dtypes else torch.float32


def check_tokenizer(model_dir: str) -> None:
    """Load ``tokenizer.json`` once, so a damaged one is refused at import, not at the
    first prompt."""
    path = os.path.join(model_dir, "tokenizer.json")
    if not os.path.isfile(path):
        return
    import tokenizers

    try:
        tokenizers.Tokenizer.from_file(path)
    except Exception as e:  # noqa: BLE001  (the tokenizers library raises its own types)
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise HFImportError(f"{path}: not a tokenizer the tokenizers library loads ({first}); "
                            "use the model's original tokenizer.json or remove it") from e


class Checked:
    """A checkpoint that passed every check: its config, meta model, plan and reader."""

    def __init__(self, model_dir: str) -> None:
        self.model_dir = model_dir
        self.hf = read_config_json(model_dir)
        where = os.path.join(model_dir, "config.json")
        self.config = hf_config(self.hf, where)
        self.family = str(self.config.model_type)
        self.heads = weight_files(model_dir)
        self.model = meta_model(self.config, self.family)
        try:
            modules = check_served(self.model, self.family)
        except UnservedFamilyError as e:
            raise HFImportError(str(e)) from e
        self.modules = modules
        params = expert_params(self.model, modules)
        shapes = {k: list(h.shape) for k, h in self.heads.items()}
        self.plan: Plan = plan(self.model, self.family, self.heads, shapes, params)
        self.dtype = check_dtypes(self.family, self.heads, self.plan, self.model)
        headers = {k: (list(h.shape), ST_DTYPES[h.dtype]) for k, h in self.heads.items()}
        check_shapes(self.plan, self.model, self.family, headers)
        gen = os.path.join(model_dir, GENERATION_CONFIG)
        self.generation_config = _read_json_file(gen) if os.path.isfile(gen) else None
        if self.generation_config is not None:
            vocab = getattr(self.config.get_text_config(), "vocab_size", None)
            check_generation_config(self.generation_config, gen, vocab)
        check_tokenizer(model_dir)

    def experts_layout(self) -> list[ExpertsModule]:
        by_module: dict[str, list[str]] = {}
        for p in self.plan.expert_params.values():
            by_module.setdefault(p.module, []).append(p.attr)
        out = []
        for name, m in self.modules:
            attrs = by_module.get(name, [])
            out.append(ExpertsModule(name, name, int(m.num_experts), [(a, [a]) for a in attrs]))
        return out


def slab_size_for(checkpoint_bytes: int) -> int:
    """The slab size of a store made for a checkpoint: the default 1 GiB, or for a smaller
    checkpoint its size rounded up to 64 MiB (slabs are preallocated: a 1 GiB slab for a
    model of a few megabytes is a gigabyte of disk for nothing). An existing store keeps
    its own."""
    step = 64 << 20
    return int(min(1 << 30, max(step, -(-checkpoint_bytes * 5 // 4 // step) * step)))


def import_hf(model_dir: str | os.PathLike[str], store_path: str | os.PathLike[str],
              progress: bool | Callable[[int], Any] = True, *,
              resume: bool = False) -> dict[str, Any]:
    """Import the model in ``model_dir`` into the store at ``store_path`` (created if
    missing) and return its ``model.json`` content. ``progress``: ``True`` for a tqdm bar
    over the bytes imported, or a callable that receives byte counts. ``resume``: continue
    an interrupted import of the same checkpoint (see the module docstring)."""
    model_dir = os.fspath(model_dir)
    ck = Checked(model_dir)
    reader = CheckpointReader(ck.heads)
    files = sorted({h.path for h in ck.heads.values()})
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

    source = {"hf_config": ck.hf,
              "files": sorted((os.path.basename(p), os.path.getsize(p)) for p in files)}
    layout = ck.experts_layout()
    # No host cache: an import reads nothing back, and each expert should be durable once
    # its put_many returns, so that an interrupted import can be resumed from there.
    with tierstore.open(store_path, create=True, host_cache=0,
                        slab_size=slab_size_for(total)) as store:
        _begin(store, source, resume, layout)
        try:
            _put_experts(store, ck, reader, layout, advance, resume)
            dense = _put_dense(store, ck, reader, advance, resume)
            reader.close()
            toks = _put_tokenizer(store, model_dir)
            info = StoredModel(family=ck.family, hf_config=ck.hf, experts=layout, dense=dense,
                               dtype=str(ck.dtype).removeprefix("torch."),
                               generation_config=ck.generation_config, tokenizer=toks)
            store.put(MODEL_ENTRY[0], json_entry(info.to_json()), kind=MODEL_ENTRY[1])
            store.delete(IMPORT_ENTRY[0], IMPORT_ENTRY[1], missing_ok=True)
            store.flush()
        finally:
            reader.close()
            if bar is not None:
                bar.close()
    return info.to_json()


def _begin(store: tierstore.Store, source: dict[str, Any], resume: bool,
           layout: list[ExpertsModule]) -> None:
    """Refuse a store that holds a model, or another import; record this import's source
    (or, resuming, check that the interrupted import had the same one)."""
    if MODEL_ENTRY in store:
        raise HFImportError(f"store {store.path} already holds a model; import into a new store")
    begun = IMPORT_ENTRY in store
    if not begun:
        if store.names(DENSE_PREFIX) or any(store.names(m.prefix + ".") for m in layout) \
                or store.names("layers."):
            raise HFImportError(f"store {store.path} already holds model entries; import into "
                                "a new store")
        store.put(IMPORT_ENTRY[0], json_entry(source), kind=IMPORT_ENTRY[1])
        return
    if not resume:
        raise HFImportError(f"store {store.path} holds an interrupted import; continue it with "
                            "--resume, or import into a new store")
    was = json.loads(bytes(store.get(*IMPORT_ENTRY).numpy()).decode())
    if was != json.loads(json.dumps(source)):
        raise HFImportError(f"store {store.path} holds an interrupted import of another checkpoint "
                            "(its config or weight files differ); import into a new store")


def _kept(store: tierstore.Store, resume: bool, name: str, shape: list[int],
          dtype: torch.dtype) -> bool:
    """Resuming: whether ``name`` is already stored as the conversion makes it."""
    if not resume or name not in store:
        return False
    info = store.info(name)
    return info.dtype == dtype and list(info.shape) == list(shape)


def _put_experts(store: tierstore.Store, ck: Checked, reader: CheckpointReader,
                 layout: list[ExpertsModule], advance: Callable[[int], Any],
                 resume: bool) -> None:
    """Every expert of every experts module, one ``put_many`` per expert, in the order of
    the shard files, so each is read through before the next is opened."""
    groups = {m.module: [ck.plan.experts[f"{m.module}.{a}" if m.module else a]
                         for a, _ in m.params] for m in layout}

    def first_key(m: ExpertsModule, e: int) -> str:
        g = groups[m.module][0]
        src = next((s for s in g.sources if s.fused or s.expert == e), g.sources[0])
        return reader.rank(src.key)

    work = sorted(((m, e) for m in layout for e in range(m.num_experts)),
                  key=lambda me: (first_key(*me), me[0].module, me[1]))
    for m, e in work:
        shapes = {a: list(ck.plan.expert_params[f"{m.module}.{a}"].shape[1:]) for a, _ in m.params}
        names = {a: f"{m.prefix}.{e}.{a}" for a, _ in m.params}
        nbytes = sum(math.prod(s) for s in shapes.values()) * ck.dtype.itemsize
        if all(_kept(store, resume, names[a], shapes[a], ck.dtype) for a in names):
            advance(nbytes)
            continue
        out: dict[str, torch.Tensor] = {}
        for group in groups[m.module]:
            got = convert_expert(group, ck.plan, ck.model, e, reader.get, reader.expert_slice)
            out.update(got)
        put = []
        for a, _ in m.params:
            t = out[f"{m.module}.{a}"]
            if list(t.shape) != shapes[a]:
                raise HFImportError(f"{m.module} expert {e}: {a} converts to {list(t.shape)}, "
                                    f"the config implies {shapes[a]}")
            put.append((names[a], t.contiguous()))
        store.put_many(put)
        advance(nbytes)


def _put_dense(store: tierstore.Store, ck: Checked, reader: CheckpointReader,
               advance: Callable[[int], Any], resume: bool) -> dict[str, str]:
    """Every dense group, converted whole; returns parameter name -> entry name."""
    dense: dict[str, str] = {}
    want = ck.model.state_dict()
    order = sorted(ck.plan.dense.values(), key=lambda g: (reader.rank(g.sources[0].key), g.target))
    for group in order:
        keys = group.source_keys()
        size = sum(math.prod(reader.shape(k)) * (reader.dtype(k) or ck.dtype).itemsize
                   for k in keys)
        if group.transform is None and group.target in want and _kept(
                store, resume, DENSE_PREFIX + group.target, list(want[group.target].shape),
                reader.dtype(keys[0]) or ck.dtype):
            dense[group.target] = DENSE_PREFIX + group.target
            advance(size)
            continue
        for name, t in convert_dense(group, ck.model, reader.get).items():
            store.put(DENSE_PREFIX + name, t.contiguous())
            dense[name] = DENSE_PREFIX + name
        advance(size)
    return dense


def _put_tokenizer(store: tierstore.Store, model_dir: str) -> list[str]:
    toks = []
    for fname in (*TOKENIZER_FILES, GENERATION_CONFIG):
        path = os.path.join(model_dir, fname)
        if not os.path.isfile(path):
            continue
        try:
            with open(path, "rb") as f:
                raw = f.read()
        except OSError as e:
            raise HFImportError(f"{path}: unreadable ({e}); fix its permissions or "
                                "remove it") from e
        store.put(TOKENIZER_PREFIX + fname,
                  torch.frombuffer(bytearray(raw), dtype=torch.uint8)
                  if raw else torch.zeros(0, dtype=torch.uint8), kind=TOKENIZER_KIND)
        toks.append(fname)
    return toks
