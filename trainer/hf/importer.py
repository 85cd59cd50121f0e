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
from .config import (
    check_generation_config,
    config_dtype,
    hf_config,
    meta_model,
    read_config_json,
)
from .convert import Group, Plan, check_shapes, convert_dense, convert_expert, expert_params, plan
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
from .quant import (
    FP8,
    FP8_BLOCK,
    MXFP4,
    MXFP4_GROUP,
    PACKED_DTYPES,
    SCALE_DTYPES,
    check_ops,
    fold,
    packed_shapes,
    quant_method,
    quantize,
)
from .quant import SUFFIXES as QUANT_SUFFIXES
from .quant import parts as quant_parts
from .tokenizer import parse_tokenizer

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json",
                   "chat_template.jinja")
GENERATION_CONFIG = "generation_config.json"
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
TOKENIZER_JSON = ("tokenizer_config.json", "special_tokens_map.json", "added_tokens.json")


def _read_json_file(path: str) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise HFImportError(f"{path}: unreadable ({e}); fix or remove it") from e


def _dt(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# Casts that keep every value: to the same dtype, or from a 16-bit float to fp32.
LOSSLESS = {(torch.float16, torch.float32), (torch.bfloat16, torch.float32)}


def model_dtype(hf: dict[str, Any], heads: dict[str, Any]) -> torch.dtype:
    """The dtype ``transformers`` builds the model in, as ``from_pretrained``'s default
    ``dtype="auto"`` picks it: the one ``config.json`` names, else the checkpoint's own (the
    dtype most of its floats have), else fp32. The import stores every weight in it."""
    named = config_dtype(hf)
    if named is not None:
        return named
    counts: dict[torch.dtype, int] = {}
    for h in heads.values():
        dt = ST_DTYPES.get(h.dtype)
        if dt in FLOAT_DTYPES:
            counts[dt] = counts.get(dt, 0) + 1
    return max(counts, key=lambda d: counts[d]) if counts else torch.float32


def check_dtype(name: str, dtype: torch.dtype, expected: torch.dtype, where: str) -> None:
    """Refuse checkpoint tensor ``name`` of ``dtype`` for a parameter of ``expected`` dtype
    unless casting it keeps every value: ``transformers`` would cast it all the same,
    silently rounding (fp32 into a bf16 model) or turning integers into weights (an int32
    tensor where a float weight belongs is no weight, whatever its values)."""
    if dtype == expected or (dtype, expected) in LOSSLESS:
        return
    if expected.is_floating_point and (not dtype.is_floating_point or dtype.itemsize == 1):
        what = "an integer or boolean" if not dtype.is_floating_point else "an fp8"
        why = (f"{what} tensor is no weight of an unquantized model; re-download the "
               "checkpoint or save it again from the model")
    elif expected.is_floating_point:
        why = (f"casting it to {_dt(expected)} would lose precision; convert the checkpoint "
               f"to {_dt(expected)}, or fix config.json's dtype if it is wrong")
    else:
        why = "use the checkpoint's original weights"
    raise HFImportError(f"{where}: tensor {name!r} is {_dt(dtype)}, the model is "
                        f"{_dt(expected)}: {why}")


def check_dtypes(heads: dict[str, Any], p: Plan, model: torch.nn.Module
                 ) -> dict[str, torch.dtype]:
    """Every tensor the import takes casts losslessly to the dtype its parameter has in the
    model (:func:`check_dtype`, from the headers: nothing is read yet); returns each
    tensor's target dtype."""
    want = {k: v.dtype for k, v in model.state_dict().items()}
    targets: dict[str, torch.dtype] = {}
    for groups in (p.dense, p.experts):
        for target, group in groups.items():
            expected = want.get(target, torch.float32)
            for s in group.sources:
                h = heads[s.key]
                dt = ST_DTYPES.get(h.dtype)
                if dt is None:
                    raise HFImportError(f"{h.path}: tensor {s.key!r} has dtype {h.dtype}, which "
                                        "the import cannot read; convert the checkpoint to "
                                        "bfloat16, float16 or float32")
                check_dtype(s.key, dt, expected, h.path)
                targets[s.key] = expected
    return targets


def check_tokenizer(model_dir: str) -> None:
    """Load ``tokenizer.json`` once (and encode and decode a line with it) and parse the
    tokenizer's other JSON files, so a damaged one is refused at import, not at the first
    prompt."""
    path = os.path.join(model_dir, "tokenizer.json")
    if os.path.isfile(path):
        with open(path, "rb") as f:
            raw = f.read()
        parse_tokenizer(raw, path, "use the model's original tokenizer.json or remove it")
    for name in TOKENIZER_JSON:
        other = os.path.join(model_dir, name)
        if not os.path.isfile(other):
            continue
        try:
            with open(other, "rb") as f:
                json.loads(f.read().decode("utf-8"))
        except (OSError, ValueError) as e:
            raise HFImportError(f"{other}: not JSON ({type(e).__name__}); use the model's "
                                "original file or remove it") from e


class Checked:
    """A checkpoint that passed every check: its config, meta model, plan and reader."""

    def __init__(self, model_dir: str, expert_format: str | None = None) -> None:
        self.model_dir = model_dir
        self.hf = read_config_json(model_dir)
        where = os.path.join(model_dir, "config.json")
        self.config = hf_config(self.hf, where)
        self.family = str(self.config.model_type)
        self.heads = weight_files(model_dir)
        dtype = model_dtype(self.hf, self.heads)
        # A quantized checkpoint: each packed weight stands in for the plan as the weight it
        # dequantizes to (tierstore.hf.quant); it is stored packed.
        self.method = quant_method(self.hf, where)
        plan_heads, self.quant = self.heads, {}
        if self.method is not None:
            plan_heads, self.quant = fold(self.heads, self.method, dtype)
            if not self.quant:
                raise HFImportError(f"{where}: config.json declares {self.method} quantization "
                                    f"but the checkpoint holds no {self.method} tensors; fix "
                                    "config.json or use the checkpoint it belongs to")
        self.model = meta_model(self.config, self.family, dtype=dtype)
        try:
            modules = check_served(self.model, self.family)
        except UnservedFamilyError as e:
            raise HFImportError(str(e)) from e
        self.modules = modules
        params = expert_params(self.model, modules)
        shapes = {k: list(h.shape) for k, h in plan_heads.items()}
        self.plan: Plan = plan(self.model, self.family, plan_heads, shapes, params)
        self.targets = check_dtypes(plan_heads, self.plan, self.model)
        for k in self.quant:  # read as stored, never cast
            self.targets.pop(k, None)
        first = next(iter(self.plan.expert_params))
        self.dtype = self.model.get_parameter(first).dtype  # the experts' stored dtype
        headers = {k: (list(h.shape), ST_DTYPES[h.dtype]) for k, h in plan_heads.items()}
        check_shapes(self.plan, self.model, self.family, headers)
        self.formats = {t: self._format(g, t in self.plan.expert_params)
                        for groups in (self.plan.dense, self.plan.experts)
                        for t, g in groups.items()}
        self.quantize = self._quantize_at_import(expert_format, where)
        gen = os.path.join(model_dir, GENERATION_CONFIG)
        self.generation_config = _read_json_file(gen) if os.path.isfile(gen) else None
        if self.generation_config is not None:
            vocab = getattr(self.config.get_text_config(), "vocab_size", None)
            check_generation_config(self.generation_config, gen, vocab)
        check_tokenizer(model_dir)

    def _quantize_at_import(self, fmt: str | None, where: str) -> set[str]:
        """``--expert-format``: the expert parameters quantized as they are stored (every
        weight; biases stay as they are), each checked to fit the format's blocks: FP8 in
        whole 128x128 blocks of a module that holds ``[out, in]``; MXFP4 in groups of 32
        inputs, either orientation (:func:`~tierstore.hf.quant.quantize_mxfp4`)."""
        if fmt is None:
            return set()
        if self.method is not None:
            raise HFImportError(f"{where}: the checkpoint is already quantized ({self.method}) "
                                "and is kept as shipped; import it without --expert-format")
        chosen = set()
        for name, p in self.plan.expert_params.items():
            if len(p.shape) != 3:
                continue  # a bias: kept as it is
            transposed = self.transposed(p.module)
            if fmt == MXFP4:
                inner = p.shape[1] if transposed else p.shape[2]
                if inner % MXFP4_GROUP:
                    raise HFImportError(f"--expert-format mxfp4: {name} has {inner} inputs an "
                                        "expert, not whole groups of 32; import without "
                                        "--expert-format")
            elif any(d % FP8_BLOCK for d in p.shape[1:]):
                raise HFImportError(f"--expert-format fp8: {name} is {list(p.shape[1:])} an "
                                    "expert, not whole 128x128 blocks; import without "
                                    "--expert-format")
            elif transposed:
                raise HFImportError(f"--expert-format fp8: {name} is held transposed by "
                                    f"{self.family}; import without --expert-format, or with "
                                    "mxfp4")
            self.formats[name] = fmt
            chosen.add(name)
        return chosen

    def transposed(self, module: str) -> bool:
        """Whether experts module ``module`` holds its weights ``[in, out]`` (gpt-oss)."""
        return bool(getattr(self.model.get_submodule(module), "is_transposed", False))

    def file_key(self, key: str) -> str:
        """The checkpoint tensor plan key ``key`` is read from first."""
        q = self.quant.get(key)
        return key if q is None else q.packed

    def _format(self, group: Group, expert: bool) -> str | None:
        """The quantization ``group``'s sources are held in (None: not quantized), checked
        to be one the store keeps packed for this parameter."""
        fmts = {self.quant[s.key].format if s.key in self.quant else None for s in group.sources}
        if len(fmts) > 1:
            raise HFImportError(f"{self.family}: {group.target} is made of quantized and "
                                f"unquantized tensors ({group.source_keys()[0]}, ...); use the "
                                "model's original checkpoint")
        fmt = fmts.pop()
        if fmt is None:
            return None
        if not expert and (fmt != FP8 or group.transform is not None):
            raise HFImportError(f"{self.family}: {group.source_keys()[0]} is a {fmt} weight "
                                f"outside the experts that transformers converts to "
                                f"{group.target}; tierstore keeps only plain fp8 dense weights "
                                "packed: import the checkpoint's bf16 weights")
        check_ops(self.family, group.target, group.transform, fmt)
        return fmt

    def experts_layout(self) -> list[ExpertsModule]:
        by_module: dict[str, list[str]] = {}
        for p in self.plan.expert_params.values():
            by_module.setdefault(p.module, []).append(p.attr)
        out = []
        for name, m in self.modules:
            attrs = by_module.get(name, [])
            fmts = {a: f for a in attrs
                    if (f := self.formats.get(f"{name}.{a}" if name else a)) is not None}
            out.append(ExpertsModule(name, name, int(m.num_experts),
                                     [(a, quant_parts(a, fmts[a]) if a in fmts else [a])
                                      for a in attrs], fmts))
        return out

    def expert_entries(self, m: ExpertsModule, e: int) -> dict[str, tuple[list[int], torch.dtype]]:
        """Expert ``e``'s entries as the import stores them: name -> (shape, dtype)."""
        want: dict[str, tuple[list[int], torch.dtype]] = {}
        for a, parts in m.params:
            logical = list(self.plan.expert_params[f"{m.module}.{a}" if m.module else a].shape[1:])
            fmt = m.formats.get(a)
            if fmt is None:
                want[f"{m.prefix}.{e}.{a}"] = (logical, self.dtype)
                continue
            packed, scales = packed_shapes(fmt, logical, self.transposed(m.module))
            want[f"{m.prefix}.{e}.{parts[0]}"] = (packed, PACKED_DTYPES[fmt])
            want[f"{m.prefix}.{e}.{parts[1]}"] = (scales, SCALE_DTYPES[fmt])
        return want


def slab_size_for(checkpoint_bytes: int) -> int:
    """The slab size of a store made for a checkpoint: the default 1 GiB, or for a smaller
    checkpoint its size rounded up to 64 MiB (slabs are preallocated: a 1 GiB slab for a
    model of a few megabytes is a gigabyte of disk for nothing). An existing store keeps
    its own."""
    step = 64 << 20
    return int(min(1 << 30, max(step, -(-checkpoint_bytes * 5 // 4 // step) * step)))


def import_hf(model_dir: str | os.PathLike[str], store_path: str | os.PathLike[str],
              progress: bool | Callable[[int], Any] = True, *,
              resume: bool = False, expert_format: str | None = None) -> dict[str, Any]:
    """Import the model in ``model_dir`` into the store at ``store_path`` (created if
    missing) and return its ``model.json`` content. ``progress``: ``True`` for a tqdm bar
    over the bytes imported, or a callable that receives byte counts. ``resume``: continue
    an interrupted import of the same checkpoint (see the module docstring).
    ``expert_format="fp8"`` or ``"mxfp4"``: store the experts' weights of a bf16/fp32
    checkpoint in 128x128 block FP8 or in MXFP4 (lossy; the default keeps them as the
    checkpoint has them)."""
    model_dir = os.fspath(model_dir)
    ck = Checked(model_dir, expert_format)
    reader = CheckpointReader(ck.heads, dtypes=ck.targets)
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
    if expert_format is not None:  # resuming with another format is another import
        source["expert_format"] = expert_format
    layout = ck.experts_layout()
    # No host cache: an import reads nothing back, and each expert should be durable once
    # its put_many returns, so that an interrupted import can be resumed from there.
    with tierstore.open(store_path, create=True, host_cache=0,
                        slab_size=slab_size_for(total)) as store:
        _begin(store, source, resume, layout)
        try:
            _put_experts(store, ck, reader, layout, advance, resume)
            dense, dense_scales = _put_dense(store, ck, reader, advance, resume)
            reader.close()
            toks = _put_tokenizer(store, model_dir)
            info = StoredModel(family=ck.family, hf_config=ck.hf, experts=layout, dense=dense,
                               dtype=str(ck.dtype).removeprefix("torch."),
                               generation_config=ck.generation_config, tokenizer=toks,
                               quant=ck.method or (expert_format if ck.quantize else None),
                               quantized_at_import=bool(ck.quantize),
                               dense_scales=dense_scales)
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
        return reader.rank(ck.file_key(src.key))

    work = sorted(((m, e) for m in layout for e in range(m.num_experts)),
                  key=lambda me: (first_key(*me), me[0].module, me[1]))
    for m, e in work:
        want = ck.expert_entries(m, e)
        nbytes = sum(math.prod(sh) * dt.itemsize for sh, dt in want.values())
        if all(_kept(store, resume, n, sh, dt) for n, (sh, dt) in want.items()):
            advance(nbytes)
            continue
        out: dict[str, torch.Tensor] = {}
        for group in groups[m.module]:
            fmt = ck.formats[group.target]
            if fmt is None or group.target in ck.quantize:
                got = convert_expert(group, ck.plan, ck.model, e, reader.get, reader.expert_slice)
                for t, v in got.items():
                    if t in ck.quantize:  # --expert-format: stored packed as shipped
                        tf = ck.formats[t]
                        packed, scales = quantize(tf, v, ck.transposed(m.module))
                        for suffix, q in zip(QUANT_SUFFIXES[tf], (packed, scales)):
                            out[_entry(m, e, t) + suffix] = q
                    else:
                        out[_entry(m, e, t)] = v
                continue
            # The packed tensors and their scales, each through the same converter.
            for which, suffix in zip(("packed", "scales"), QUANT_SUFFIXES[fmt]):
                def load(k: str, which: str = which) -> torch.Tensor:
                    return reader.get(getattr(ck.quant[k], which))

                def load_slice(k: str, i: int, which: str = which) -> torch.Tensor:
                    return reader.expert_slice(getattr(ck.quant[k], which), i)

                got = convert_expert(group, ck.plan, ck.model, e, load, load_slice)
                out.update({_entry(m, e, t) + suffix: v for t, v in got.items()})
        put = []
        for name, (shape, dtype) in want.items():
            t = out[name]
            if list(t.shape) != shape or t.dtype != dtype:
                raise HFImportError(f"{m.module} expert {e}: {name} converts to {t.dtype} "
                                    f"{list(t.shape)}, the config implies {dtype} {shape}")
            put.append((name, t.contiguous()))
        store.put_many(put)
        advance(nbytes)


def _entry(m: ExpertsModule, e: int, target: str) -> str:
    """The entry of expert ``e``'s slice of fused parameter ``target``."""
    attr = target[len(m.module) + 1:] if m.module else target
    return f"{m.prefix}.{e}.{attr}"


def _put_dense(store: tierstore.Store, ck: Checked, reader: CheckpointReader,
               advance: Callable[[int], Any], resume: bool
               ) -> tuple[dict[str, str], dict[str, str]]:
    """Every dense group, converted whole; returns parameter name -> entry name, and for
    each fp8 weight (kept packed, dequantized at load) the entry of its scales."""
    dense: dict[str, str] = {}
    scales: dict[str, str] = {}
    want = ck.model.state_dict()
    order = sorted(ck.plan.dense.values(), key=lambda g: (reader.rank(ck.file_key(g.sources[0].key)), g.target))
    for group in order:
        keys = group.source_keys()
        size = sum(math.prod(h.shape) * ST_DTYPES[h.dtype].itemsize
                   for k in keys for h in _read_heads(ck, k))
        entry = DENSE_PREFIX + group.target
        if ck.formats[group.target] is not None:  # plain fp8 (Checked._format)
            q = ck.quant[keys[0]]
            shape = list(want[group.target].shape)
            if not (_kept(store, resume, entry, shape, PACKED_DTYPES[FP8])
                    and _kept(store, resume, entry + "_scale_inv",
                              packed_shapes(FP8, shape)[1], SCALE_DTYPES[FP8])):
                store.put_many([(entry, reader.get(q.packed).contiguous()),
                                (entry + "_scale_inv", reader.get(q.scales).contiguous())])
            dense[group.target], scales[group.target] = entry, entry + "_scale_inv"
            advance(size)
            continue
        if group.transform is None and group.target in want and _kept(
                store, resume, entry, list(want[group.target].shape), ck.targets[keys[0]]):
            dense[group.target] = entry
            advance(size)
            continue
        for name, t in convert_dense(group, ck.model, reader.get).items():
            store.put(DENSE_PREFIX + name, t.contiguous())
            dense[name] = DENSE_PREFIX + name
        advance(size)
    return dense, scales


def _read_heads(ck: Checked, key: str) -> list[Any]:
    """The checkpoint tensors read for plan key ``key`` (a packed weight's two)."""
    q = ck.quant.get(key)
    return [ck.heads[key]] if q is None else [ck.heads[q.packed], ck.heads[q.scales]]


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
