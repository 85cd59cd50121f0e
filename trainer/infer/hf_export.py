"""``tierstore export-hf``: a stored model as a directory ``transformers`` loads.

:func:`export_hf` writes ``config.json``, the weights as sharded safetensors with
``model.safetensors.index.json``, and the tokenizer files:

* A model imported with ``tierstore import-hf`` goes back in the checkpoint's own layout
  (the ``hf_layout`` its import recorded, :mod:`trainer.infer.hf_layout`: the same tensor
  names, per-expert or fused experts in the same orientation) with its original
  ``config.json`` (its ``dtype`` set to the export's) and tokenizer files. A store imported
  before layouts were recorded is written in the per-expert layout ``save_pretrained`` writes.
* A ``tierstore train`` run becomes the closest ``transformers`` architecture
  (:func:`trainer_hf_config`): Mixtral when every layer is an MoE layer, else Qwen2-MoE with
  the dense layers as ``mlp_only_layers`` and a shared expert of zeros (which adds exactly
  nothing). The mapping is checked by reading the written config back
  (:func:`trainer.infer.hf_config.build_from_hf`): any architecture field that would come
  back different is an error naming it, so what is written computes what the run computes.
  Its byte-level vocabulary gets a byte-level ``tokenizer.json`` (token id = byte value).

Values are the latest ones: the live expert entries and ``dense.`` entries of an import
(after a fine-tune, its fp32 masters: :mod:`trainer.train.checkpoint` says where they live),
a run's expert entries and the dense state of its latest checkpoint. A run interrupted after
its latest checkpoint may hold experts some steps ahead of its dense weights: export a
finished run, or restore its latest checkpoint first. They are read one entry
at a time and streamed into the shards (a fused tensor one expert slice at a time), so an
export's memory is bounded by a few entries, not by the model. Every float tensor is
written in one dtype: the one asked for, else the checkpoint's own (the dtype its experts
were imported in; fp32 for a trainer run, whose weights are fp32 masters).

The files are written into a hidden directory beside ``out_dir`` and moved into place at
the end, so an interrupted export leaves no partial checkpoint under ``out_dir``; the
hidden directory a killed export leaves is removed by the next export into the same
parent directory (it names its process and is locked while that runs).
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import shutil
import stat
import struct
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

import tierstore

from ..model import ModelConfig, expert_names
from .hf_checkpoint import INDEX_FILE
from .hf_config import SUPPORTED_FAMILIES, build_from_hf
from .hf_layout import EXPERT_SLOT, OUT_IN, canonical_layout, check_layout, dense_names
from .loading import DENSE_PREFIX, model_info, tokenizer_files

DEFAULT_SHARD_SIZE = "5GB"  # transformers 4's default, and the Hub's advice per file
EXPORT_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_ST_CODES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
# Weight files a previous export or checkpoint in the directory could leave behind, which
# transformers would load instead of (or besides) the new ones.
_STALE = (".safetensors", ".safetensors.index.json", ".bin", ".bin.index.json", ".pt", ".pth")

Progress = Callable[[int], Any]


class HFExportError(tierstore.StoreError):
    """The store cannot be exported as asked (reported by the CLI as one line)."""


def dtype_name(dt: torch.dtype) -> str:
    return str(dt).removeprefix("torch.")


# --------------------------------------------------------------------------- the trainer's model


# Fields that only training reads: they change nothing a checkpoint computes.
_TRAINING_ONLY = {"family", "dtype", "router_aux_coef", "router_z_coef", "router_aux_form",
                  "init_std"}


def trainer_hf_config(cfg: ModelConfig, dtype: str) -> tuple[dict[str, Any], dict[str, list[int]]]:
    """The ``config.json`` of the closest ``transformers`` architecture for a model of
    tierstore's own family, and the tensors to write as zeros (name -> shape).

    Every layer an MoE layer: Mixtral. Dense layers among them: Qwen2-MoE, whose
    ``mlp_only_layers`` are the dense layers and whose obligatory shared expert is one unit
    wide and all zeros, so it adds exactly 0. The config is read back with our own reader
    and every field that decides what the model computes must come back equal; where one
    does not (a feature neither architecture has), :class:`HFExportError` names it."""
    eos: Any = list(cfg.eos_token_ids) if len(cfg.eos_token_ids) > 1 else (
        cfg.eos_token_ids[0] if cfg.eos_token_ids else None)
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scale != 1.0:
        rope = {"rope_type": "linear", "rope_theta": cfg.rope_theta, "factor": cfg.rope_scale}
    hf: dict[str, Any] = {
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim, "hidden_act": "silu",
        "max_position_embeddings": cfg.max_position, "rms_norm_eps": cfg.norm_eps,
        "rope_parameters": rope, "tie_word_embeddings": cfg.tie_embeddings,
        "num_experts_per_tok": cfg.top_k, "bos_token_id": cfg.bos_token_id,
        "eos_token_id": eos, "pad_token_id": cfg.pad_token_id,
        "initializer_range": cfg.init_std, "attention_dropout": 0.0, "use_cache": True,
        "output_router_logits": False, "router_aux_loss_coef": cfg.router_aux_coef,
        "dtype": dtype,
    }
    zeros: dict[str, list[int]] = {}
    dense_layers = [i for i in range(cfg.n_layers) if not cfg.is_moe(i)]
    if not dense_layers:
        family = "mixtral"
        hf.update(intermediate_size=cfg.moe_ffn, num_local_experts=cfg.n_experts,
                  sliding_window=None, router_jitter_noise=0.0)
    else:
        family = "qwen2_moe"
        shared = cfg.shared_ffn or 1
        hf.update(intermediate_size=cfg.dense_ffn, moe_intermediate_size=cfg.moe_ffn,
                  num_experts=cfg.n_experts, decoder_sparse_step=1,
                  mlp_only_layers=dense_layers, shared_expert_intermediate_size=shared,
                  norm_topk_prob=cfg.norm_topk_prob, qkv_bias=cfg.qkv_bias,
                  use_sliding_window=False, sliding_window=None, max_window_layers=cfg.n_layers,
                  layer_types=["full_attention"] * cfg.n_layers)
        if not cfg.shared_ffn:
            h = cfg.hidden_size
            for i in cfg.moe_layers:
                p = f"model.layers.{i}.mlp.shared_expert"
                zeros.update({f"{p}.gate_proj.weight": [1, h], f"{p}.up_proj.weight": [1, h],
                              f"{p}.down_proj.weight": [h, 1], f"{p}_gate.weight": [1, h]})
    hf = {"architectures": [SUPPORTED_FAMILIES[family]], "model_type": family, **hf}
    back = build_from_hf(hf)
    ours, theirs = cfg.to_dict(), back.to_dict()
    skip = set(_TRAINING_ONLY)
    if not cfg.shared_ffn:
        skip.add("shared_ffn")  # the shared expert of zeros
    if not dense_layers:
        skip.add("dense_ffn")  # no dense layer uses it
    wrong = [f"{k} is {ours[k]!r}, {family} would make it {theirs[k]!r}"
             for k in ours if k not in skip and ours[k] != theirs[k]]
    if wrong:
        raise HFExportError(f"this {cfg.family} model has no exact transformers counterpart: "
                            f"{'; '.join(wrong)}")
    return hf, zeros


def byte_tokenizer_files(max_length: int) -> dict[str, bytes]:
    """``tokenizer.json`` and ``tokenizer_config.json`` of tierstore's byte-level vocabulary:
    token id = byte value of the UTF-8 text, no special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    # GPT-2's printable stand-ins for the 256 byte values, which the ByteLevel steps use.
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    tok = Tokenizer(models.BPE(vocab={chars[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_length,
              "clean_up_tokenization_spaces": False}
    return {"tokenizer.json": tok.to_str().encode(),
            "tokenizer_config.json": json.dumps(config, indent=2).encode()}


# --------------------------------------------------------------------------- values


class _Values:
    """Where the values come from: the store's expert entries and its dense weights (the
    ``dense.`` entries of an import, or a run's latest checkpoint)."""

    def __init__(self, store: tierstore.Store, info: dict[str, Any]) -> None:
        self.store = store
        self.dense_state: dict[str, Tensor] | None = None
        if info["family"] == "tierstore":
            from ..train.checkpoint import latest_dense_state

            payload = latest_dense_state(store)
            assert payload is not None  # model_info found it
            if payload.get("dense") != "entries":  # else the weights are dense.* entries
                self.dense_state = {k: v for k, v in payload["model"].items()
                                    if ".experts." not in k and not k.startswith("rope_")}
        self.prefix = info.get("dense_prefix", DENSE_PREFIX)

    def dense(self, name: str) -> Tensor:
        if self.dense_state is not None:
            if name not in self.dense_state:
                raise HFExportError(f"store {self.store.path}: the latest checkpoint lacks "
                                    f"{name}")
            return self.dense_state[name]
        return self._get(self.prefix + name)

    def expert(self, layer: int, e: int, weights: tuple[str, ...]) -> dict[str, Tensor]:
        names = dict(zip(("w1", "w2", "w3"), expert_names(layer, e)))
        return {w: self._get(names[w]) for w in weights}

    def _get(self, name: str) -> Tensor:
        try:
            return self.store.get(name)
        except tierstore.EntryNotFoundError:
            raise HFExportError(f"store {self.store.path}: the model's entry {name} is missing; "
                                "the import or training run did not finish") from None


# --------------------------------------------------------------------------- the plan


@dataclass
class _Item:
    """One tensor of the checkpoint: its name, shape and how its bytes are produced."""

    name: str
    shape: list[int]
    source: tuple[Any, ...]  # ("dense", name) | ("expert", layer, w) | ("fused", layer,
    #                           part, orient) | ("zeros",)

    def nbytes(self, dt: torch.dtype) -> int:
        return math.prod(self.shape) * dt.itemsize


def _plan(cfg: ModelConfig, layout: dict[str, Any], shapes: dict[str, list[int]]) -> list[_Item]:
    """Every tensor to write, in layer order (so that shards hold whole layers)."""
    items: list[tuple[tuple[int, int, str], _Item]] = []

    def rank(name: str) -> int:
        if name.startswith("layers."):
            return int(name.split(".")[1])
        return -1 if name == "tok_emb.weight" else cfg.n_layers

    for hf, ours in layout["dense"].items():
        items.append(((rank(ours), 0, hf), _Item(hf, shapes[ours], ("dense", ours))))
    for hf, shape in layout["zeros"].items():
        layer = int(hf.split(".")[2]) if hf.startswith("model.layers.") else cfg.n_layers
        items.append(((layer, 0, hf), _Item(hf, list(shape), ("zeros",))))
    h, f, n_e = cfg.hidden_size, cfg.moe_ffn, cfg.n_experts
    want = cfg.expert_shapes()
    for key, spec in layout["experts"].items():
        layer = int(key)
        if "fused" in spec:
            for part, (hf, orient) in spec["fused"].items():
                rows = [2 * f, h] if part == "gate_up_proj" else [h, f]
                shape = [n_e, *(rows if orient == OUT_IN else rows[::-1])]
                items.append(((layer, 1, hf), _Item(hf, shape, ("fused", layer, part, orient))))
            continue
        for e in range(n_e):
            for w, template in spec["per_expert"].items():
                hf = template.replace(EXPERT_SLOT, str(e))
                items.append(((layer, 1 + e, w),
                              _Item(hf, list(want[w]), ("expert", layer, e, w))))
    return [it for _, it in sorted(items, key=lambda x: x[0])]


def _shards(items: list[_Item], dt: torch.dtype, limit: int) -> list[list[_Item]]:
    """Items in order into shards of at most ``limit`` bytes (a larger tensor alone)."""
    shards: list[list[_Item]] = [[]]
    size = 0
    for it in items:
        n = it.nbytes(dt)
        if shards[-1] and size + n > limit:
            shards.append([])
            size = 0
        shards[-1].append(it)
        size += n
    return shards


def _chunks(it: _Item, values: _Values, dt: torch.dtype, n_experts: int) -> Iterator[Tensor]:
    """The bytes of one item as contiguous tensors in ``dt``, in file order."""
    kind = it.source[0]
    if kind == "dense":
        t = values.dense(it.source[1])
        if list(t.shape) != it.shape:
            raise HFExportError(f"{it.source[1]} has shape {list(t.shape)}, the config implies "
                                f"{it.shape}")
        yield t.to(dt).contiguous()
    elif kind == "zeros":
        yield torch.zeros(it.shape, dtype=dt)
    elif kind == "expert":
        _, layer, e, w = it.source
        yield values.expert(layer, e, (w,))[w].to(dt).contiguous()
    else:  # one expert slice of a fused tensor at a time
        _, layer, part, orient = it.source
        for e in range(n_experts):
            if part == "gate_up_proj":
                ws = values.expert(layer, e, ("w1", "w3"))
                t = torch.cat([ws["w1"], ws["w3"]], dim=0)
            else:
                t = values.expert(layer, e, ("w2",))["w2"]
            yield (t if orient == OUT_IN else t.t()).to(dt).contiguous()


def _write_shard(path: str, items: list[_Item], values: _Values, dt: torch.dtype,
                 n_experts: int, advance: Progress) -> None:
    """One safetensors file, streamed: the header first (every shape is known), then each
    tensor's bytes as they are read."""
    header: dict[str, Any] = {}
    offset = 0
    for it in items:
        n = it.nbytes(dt)
        header[it.name] = {"dtype": _ST_CODES[dt], "shape": it.shape,
                           "data_offsets": [offset, offset + n]}
        offset += n
    header["__metadata__"] = {"format": "pt"}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(raw)))
        fh.write(raw)
        for it in items:
            written = 0
            for t in _chunks(it, values, dt, n_experts):
                fh.write(t.reshape(-1).view(torch.uint8).numpy())
                written += t.numel() * dt.itemsize
                advance(t.numel() * dt.itemsize)
            if written != it.nbytes(dt):
                raise HFExportError(f"{it.name}: wrote {written} bytes, its shape needs "
                                    f"{it.nbytes(dt)}")
        fh.flush()
        os.fsync(fh.fileno())


# --------------------------------------------------------------------------- the directory


# The hidden directory an export writes into: ".{out_dir's name}.{pid}.{random}.export-hf",
# locked (flock) by its export while it runs.
_SCRATCH_SUFFIX = ".export-hf"


def _prepare(out_dir: str, force: bool) -> tuple[str, int]:
    """Check ``out_dir``; return a fresh hidden directory beside it to write into and the
    descriptor that holds its lock. Directories that killed exports left there are removed
    first (:func:`_remove_leftovers`)."""
    if os.path.exists(out_dir):
        if not os.path.isdir(out_dir):
            raise HFExportError(f"{out_dir} exists and is not a directory")
        if os.listdir(out_dir) and not force:
            raise HFExportError(f"{out_dir} is not empty; pass --force to write the export into "
                                "it (its weight files are replaced)")
    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    _remove_leftovers(parent)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(os.path.abspath(out_dir))}."
                           f"{os.getpid()}.", suffix=_SCRATCH_SUFFIX, dir=parent)
    fd = os.open(tmp, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    fcntl.flock(fd, fcntl.LOCK_EX)  # waits only while a cleaner looks at it (see below)
    return tmp, fd


def _remove_leftovers(parent: str) -> None:
    """Remove the hidden directories of exports into ``parent`` that were killed (an
    export that fails otherwise removes its own): this user's, named as :func:`_prepare`
    names them, whose process is gone and whose lock nobody holds. Either test alone could
    err: a lock is taken a moment after its directory is made, and a process id may be
    another machine's (a shared file system) or reused; together they spare every live
    export."""
    for name in os.listdir(parent):
        stem = name.removesuffix(_SCRATCH_SUFFIX)
        parts = stem.rsplit(".", 2)
        if (not name.startswith(".") or stem == name or len(parts) != 3
                or not parts[1].isdigit()):
            continue
        path = os.path.join(parent, name)
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or _alive(int(parts[1])):
            continue
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            shutil.rmtree(path, ignore_errors=True)
        except BlockingIOError:
            pass  # a live export's
        finally:
            os.close(fd)


def _alive(pid: int) -> bool:
    """Whether a process ``pid`` exists (one of another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True
    return True


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _move_into_place(tmp: str, out_dir: str) -> None:
    """The finished export becomes ``out_dir``: renamed whole where ``out_dir`` is missing or
    empty, else (``--force``) its stale weight files removed and the new files moved in."""
    _fsync_dir(tmp)
    if os.path.isdir(out_dir) and not os.listdir(out_dir):
        os.rmdir(out_dir)
    if not os.path.exists(out_dir):
        os.rename(tmp, out_dir)
    else:
        for name in os.listdir(out_dir):
            path = os.path.join(out_dir, name)
            if name.endswith(_STALE) and os.path.isfile(path):
                os.remove(path)
        for name in sorted(os.listdir(tmp), key=lambda n: n == "config.json"):  # config last
            os.replace(os.path.join(tmp, name), os.path.join(out_dir, name))
        os.rmdir(tmp)
    _fsync_dir(out_dir)
    _fsync_dir(os.path.dirname(os.path.abspath(out_dir)))


def _write_file(path: str, data: bytes) -> None:
    with open(path, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())


# --------------------------------------------------------------------------- export


def export_hf(store_path: str | os.PathLike[str], out_dir: str | os.PathLike[str], *,
              dtype: str | torch.dtype | None = None, shard_size: int | str = DEFAULT_SHARD_SIZE,
              force: bool = False, progress: bool | Progress = True) -> dict[str, Any]:
    """Export the model in the store at ``store_path`` to ``out_dir`` (see the module
    docstring) and return a summary: ``family`` (the architecture written), ``source`` (the
    store's family), ``dtype``, ``files``, ``shards``, ``tensors`` and ``bytes``.

    ``dtype``: ``"bf16"``, ``"fp16"``, ``"fp32"`` or a torch float dtype (default: the
    checkpoint's own). ``shard_size``: the most bytes per shard (a larger tensor gets a shard
    of its own). ``force``: write into a non-empty ``out_dir``, replacing its weight files.
    ``progress``: ``True`` for a tqdm bar over the bytes written, or a callable that
    receives byte counts."""
    store_path, out_dir = os.fspath(store_path), os.fspath(out_dir)
    dt = _export_dtype(dtype)
    limit = tierstore.parse_size(shard_size)
    if limit <= 0:
        raise HFExportError(f"shard size must be above 0, got {shard_size!r}")
    if not os.path.isdir(store_path):
        raise HFExportError(f"{store_path}: no such store")
    with tierstore.open(store_path, host_cache=0) as store:
        info = model_info(store)  # a StoreError naming the ways to get a model if none
        cfg = ModelConfig.from_dict(info["config"])
        source = info["family"]
        if source == "tierstore":
            dt = dt or torch.float32
            hf, zeros = trainer_hf_config(cfg, dtype_name(dt))
            family = hf["model_type"]
            layout = canonical_layout(cfg, family)
            layout["zeros"] = zeros
            toks = byte_tokenizer_files(cfg.max_position) if cfg.vocab_size >= 256 else {}
        else:
            dt = dt or _export_dtype(cfg.dtype) or torch.float32
            hf = dict(info.get("hf_config") or {})
            if not hf:
                raise HFExportError(f"store {store.path}: the model's entry holds no "
                                    "config.json to export")
            family = source
            layout = info.get("hf_layout") or canonical_layout(cfg, family)
            toks = tokenizer_files(store)
            if "torch_dtype" in hf:
                hf["torch_dtype"] = dtype_name(dt)
            if "dtype" in hf or "torch_dtype" not in hf:
                hf["dtype"] = dtype_name(dt)
        problems = check_layout(layout, cfg)
        if problems:
            raise HFExportError(f"store {store.path}: the recorded checkpoint layout does not "
                                f"fit the model: {'; '.join(problems)}")
        items = _plan(cfg, layout, dense_names(cfg))
        shards = _shards(items, dt, limit)
        total = sum(it.nbytes(dt) for it in items)
        values = _Values(store, info)
        tmp, lock = _prepare(out_dir, force)
        bar: Any = None
        try:
            if progress is True:
                from tqdm import tqdm

                bar = tqdm(total=total, desc="export-hf", unit="B", unit_scale=True,
                           unit_divisor=1024, disable=None, dynamic_ncols=True)
                advance: Progress = bar.update
            elif callable(progress):
                advance = progress
            else:
                def advance(n: int) -> None:
                    return None

            weight_map: dict[str, str] = {}
            for i, shard in enumerate(shards):
                fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                _write_shard(os.path.join(tmp, fname), shard, values, dt, cfg.n_experts,
                             advance)
                weight_map.update({it.name: fname for it in shard})
            index = {"metadata": {"total_size": total},
                     "weight_map": dict(sorted(weight_map.items()))}
            _write_file(os.path.join(tmp, INDEX_FILE), json.dumps(index, indent=2).encode())
            for fname, data in sorted(toks.items()):
                _write_file(os.path.join(tmp, os.path.basename(fname)), data)
            _write_file(os.path.join(tmp, "config.json"),
                        json.dumps(hf, indent=2, sort_keys=True).encode() + b"\n")
            files = sorted(os.listdir(tmp))
            _move_into_place(tmp, out_dir)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        finally:
            os.close(lock)
            if bar is not None:
                bar.close()
    return {"family": family, "source": source, "dtype": dtype_name(dt), "files": files,
            "shards": len(shards), "tensors": len(items), "bytes": total}


def _export_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        if dtype is not None and dtype not in _ST_CODES:
            raise HFExportError(f"cannot export in {dtype}; use bf16, fp16 or fp32")
        return dtype
    name = str(dtype).removeprefix("torch.")
    by_name = {**EXPORT_DTYPES, "bfloat16": torch.bfloat16, "float16": torch.float16,
               "float32": torch.float32}
    if name not in by_name:
        raise HFExportError(f"cannot export in {dtype!r}; use bf16, fp16 or fp32")
    return by_name[name]
