"""``tierstore import-hf``: a Hugging Face MoE model directory into a store.

Reads ``config.json`` (and ``generation_config.json`` for end-of-sequence ids), the weights
from one ``*.safetensors`` file or a sharded set with its ``model.safetensors.index.json``,
and the tokenizer files, and writes the layout :mod:`trainer.decoder` loads: every expert as
``layers.{i}.experts.{e}.w1|w2|w3`` in ONE ``put_many`` (its three tensors commit
together), the dense weights under ``dense.`` with the decoder's names, the tokenizer files
under ``tokenizer.``, and ``model.json`` last, so a store whose import was interrupted holds
no model rather than half of one.

An import first records where it comes from (``import.json``: the HF config and the weight
files' names and sizes). ``resume=True`` (``--resume``) continues an interrupted import of
the same checkpoint: an expert whose three tensors are stored with the shapes and dtype the
checkpoint has is kept (they were committed together), as is a dense tensor stored as the
checkpoint has it; everything else is imported (the small tokenizer files always are).

Experts are accepted both per expert (``experts.{e}.w1/w2/w3`` as Mixtral checkpoints have
them, ``experts.{e}.gate_proj/up_proj/down_proj`` as Qwen and OLMoE have them; what
``transformers`` 5's ``save_pretrained`` writes by default) and fused into 3-D tensors over
the experts (``experts.gate_up_proj`` ``[E, 2*ffn, hidden]`` or ``[E, hidden, 2*ffn]``,
``experts.down_proj`` ``[E, hidden, ffn]`` or ``[E, ffn, hidden]``; what ``transformers``
5 holds in memory and writes with ``save_original_format=False``). A fused tensor is read one
expert slice at a time, so the import never holds more than one expert's tensors.

Nothing is allocated on the strength of ``config.json`` alone: every number the import uses
is checked to be a whole number in a sane range, then against the safetensors headers (the
layers, experts and shapes the checkpoint actually holds), before a model object is built or
a store opened. Experts and dense tensors are read in shard order with at most two shard
files open, so an import's memory is bounded by one expert and the shards it is reading,
not by the checkpoint's size.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

import tierstore
from tierstore.interchange import safetensors_dtypes

from .decoder import (
    DENSE_PREFIX,
    MODEL_ENTRY,
    MODEL_FORMAT,
    TOKENIZER_KIND,
    TOKENIZER_PREFIX,
    DecoderConfig,
    MoEDecoder,
    build_from_hf,
    expert_names,
    family_of,
    json_entry,
)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json",
                   "generation_config.json", "chat_template.jinja")
INDEX_FILE = "model.safetensors.index.json"

_LAYER = re.compile(r"^(?:model\.)?layers\.(\d+)\.(.+)$")
_ATTN = {"q_proj": "wq", "k_proj": "wk", "v_proj": "wv", "o_proj": "wo",
         "q_norm": "q_norm", "k_norm": "k_norm"}
_FFN = {"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3", "w1": "w1", "w2": "w2",
        "w3": "w3"}
_MOE_BLOCK = r"(?:block_sparse_moe|mlp)"
_PER_EXPERT = re.compile(rf"^{_MOE_BLOCK}\.experts\.(\d+)\.(\w+)\.weight$")
_FUSED = re.compile(rf"^{_MOE_BLOCK}\.experts\.(gate_up_proj|down_proj)$")


IMPORT_ENTRY = ("import.json", "meta")  # the source of an import under way
# safetensors' dtype codes torch reads, as torch dtypes
_ST_DTYPES = safetensors_dtypes()


class HFImportError(tierstore.StoreError):
    """The directory cannot be imported (reported by the CLI as one line)."""


def _fail(msg: str) -> HFImportError:
    return HFImportError(msg)


def read_hf_config(model_dir: str) -> dict[str, Any]:
    """``config.json`` of a model directory, with clear errors for anything else."""
    if not os.path.isdir(model_dir):
        raise _fail(f"{model_dir}: no such model directory")
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise _fail(f"{model_dir}: not a Hugging Face model directory (no config.json)")
    try:
        with open(path, encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, ValueError) as e:
        raise _fail(f"{path}: unreadable config: {e}; use the model's original config.json") \
            from e
    if not isinstance(cfg, dict):
        raise _fail(f"{path}: config is not a JSON object; use the model's original "
                    "config.json")
    return cfg


# Sane ranges of the config numbers an import sizes or loops by. Far beyond any released
# model; they stop a garbled config before its numbers are used at all, and the checkpoint's
# own tensors then pin them exactly (_check_against_weights).
MAX_LAYERS = 4096
MAX_EXPERTS = 1 << 16
MAX_WIDTH = 1 << 22  # hidden, FFN and head sizes
MAX_VOCAB = 1 << 26
MAX_HEADS = 1 << 14
MAX_POSITION = 1 << 40
_REQUIRED = object()


class _ConfigCheck:
    """Checks of ``config.json`` values, each error naming the file and the key."""

    def __init__(self, hf: dict[str, Any], path: str, family: str) -> None:
        self.hf, self.path, self.family = hf, path, family

    def bad(self, key: str, what: str) -> HFImportError:
        return _fail(f"{self.path}: {key} is {self.hf.get(key)!r}, {what}; fix config.json "
                     "(or use the model's original one)")

    def whole(self, key: str, lo: int, hi: int, default: Any = _REQUIRED) -> Any:
        """The value of ``key``: an int in ``lo..hi``; ``default`` where it is missing or
        null (a required key has none)."""
        v = self.hf.get(key)
        if v is None:
            if default is _REQUIRED:
                raise _fail(f"{os.path.dirname(self.path) or '.'}: config.json lacks {key!r}, "
                            f"which a {self.family} model needs; use the model's original "
                            "config.json")
            return default
        if type(v) is not int or not lo <= v <= hi:
            raise self.bad(key, f"not a whole number from {lo} to {hi}")
        return v

    def first_int(self, keys: tuple[str, ...], lo: int, hi: int) -> tuple[str, int]:
        """(key, value) of the first of ``keys`` set to a non-zero value (as the config
        reader takes them), which must be an int in ``lo..hi``."""
        for key in keys:
            if self.hf.get(key):
                return key, self.whole(key, lo, hi)
        return keys[0], self.whole(keys[0], lo, hi)  # lacking, or 0: its error

    def number(self, key: str, positive: bool = True) -> None:
        v = self.hf.get(key)
        if v is None:
            return
        if type(v) not in (int, float) or not math.isfinite(v) or (positive and v <= 0):
            raise self.bad(key, "not a finite number" + (" above 0" if positive else ""))

    def ids(self, key: str) -> None:
        v = self.hf.get(key)
        vs = v if isinstance(v, list) else [v]
        if v is not None and (len(vs) > MAX_VOCAB
                              or not all(type(x) is int and 0 <= x < MAX_VOCAB for x in vs)):
            raise self.bad(key, "not a token id or a list of token ids")


def _check_config(hf: dict[str, Any], path: str, family: str) -> dict[str, int]:
    """Check every config value the import uses; returns the sizes it is built from (keyed
    by their config.json names) for the check against the weights."""
    c = _ConfigCheck(hf, path, family)
    sizes = {
        "hidden_size": c.whole("hidden_size", 1, MAX_WIDTH),
        "num_hidden_layers": c.whole("num_hidden_layers", 1, MAX_LAYERS),
        "vocab_size": c.whole("vocab_size", 1, MAX_VOCAB),
        "num_attention_heads": c.whole("num_attention_heads", 1, MAX_HEADS),
    }
    c.whole("num_key_value_heads", 1, MAX_HEADS, None)
    c.whole("head_dim", 1, MAX_WIDTH, None)
    c.whole("max_position_embeddings", 1, MAX_POSITION, None)
    c.whole("sliding_window", 0, MAX_POSITION, None)
    c.whole("intermediate_size", 1, MAX_WIDTH, None)
    if family == "mixtral":
        experts_key, n_experts = "num_local_experts", c.whole("num_local_experts", 1, MAX_EXPERTS)
        c.whole("intermediate_size", 1, MAX_WIDTH)
    else:
        experts_key, n_experts = c.first_int(("num_experts", "num_local_experts"), 1,
                                             MAX_EXPERTS)
        c.first_int(("moe_intermediate_size", "intermediate_size"), 1, MAX_WIDTH)
        c.whole("decoder_sparse_step", 0, MAX_LAYERS, None)
        c.whole("shared_expert_intermediate_size", 0, MAX_WIDTH, None)
        only = hf.get("mlp_only_layers")
        if only is not None and (not isinstance(only, list) or len(only) > MAX_LAYERS or not all(
                type(i) is int and 0 <= i < MAX_LAYERS for i in only)):
            raise c.bad("mlp_only_layers", "not a list of layer numbers")
        types = hf.get("layer_types")
        if types is not None and (not isinstance(types, list) or not all(
                isinstance(t, str) for t in types)
                or len(types) != sizes["num_hidden_layers"]):
            raise c.bad("layer_types", "not a list of one layer type per layer")
    sizes[experts_key] = n_experts
    c.whole("num_experts_per_tok", 1, n_experts)
    for key in ("rms_norm_eps", "rope_theta", "clip_qkv"):
        c.number(key)
    for key in ("rope_parameters", "rope_scaling"):
        rope = hf.get(key)
        if rope is not None and not isinstance(rope, dict):
            raise c.bad(key, "not an object")
        if isinstance(rope, dict):
            sub = _ConfigCheck(rope, f"{path} ({key})", family)
            sub.number("rope_theta")
            sub.number("factor")
    for key in ("eos_token_id", "bos_token_id", "pad_token_id"):
        c.ids(key)
    arch = hf.get("architectures")
    if arch is not None and (not isinstance(arch, list)
                             or not all(isinstance(a, str) for a in arch)):
        raise c.bad("architectures", "not a list of names")
    return sizes


class _Head:
    """One checkpoint tensor as its safetensors header describes it."""

    __slots__ = ("dtype", "path", "shape")

    def __init__(self, path: str, dtype: str, shape: list[int]) -> None:
        self.path, self.dtype, self.shape = path, dtype, shape


def _headers(path: str, names: list[str] | None = None) -> dict[str, _Head]:
    """The headers of one safetensors file (of ``names`` only, if given: each must be
    there); reads no tensor data."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(path, framework="pt") as st:
            keys = list(st.keys())
            if names is not None:
                lacking = sorted(set(names) - set(keys))
                if lacking:
                    raise _fail(f"{path}: lacks tensor {lacking[0]!r}, which {INDEX_FILE} puts "
                                "there; fix the index or re-download the shard")
                keys = names
            out = {}
            for k in keys:
                sl = st.get_slice(k)
                out[k] = _Head(path, sl.get_dtype(), list(sl.get_shape()))
            return out
    except (SafetensorError, OSError, ValueError, TypeError) as e:
        raise _fail(f"{path}: unreadable safetensors file: {e}; re-download or re-save it") \
            from e


def _weight_files(model_dir: str) -> dict[str, _Head]:
    """Tensor name -> its header, from the index of a sharded checkpoint or every
    ``*.safetensors`` file of the directory."""
    index = os.path.join(model_dir, INDEX_FILE)
    if os.path.isfile(index):
        try:
            with open(index, encoding="utf-8") as f:
                wmap = json.load(f)["weight_map"]
            if not isinstance(wmap, dict) or not all(
                    isinstance(k, str) and isinstance(v, str) for k, v in wmap.items()):
                raise TypeError("weight_map is not a map of tensor names to file names")
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise _fail(f"{index}: unreadable index: {e}; re-download it, or delete it to "
                        "import every *.safetensors file of the directory") from e
        by_file: dict[str, list[str]] = {}
        for k, v in wmap.items():
            if os.path.isabs(v) or os.path.normpath(v).startswith(".."):
                raise _fail(f"{index}: shard {v!r} of {k!r} lies outside the model directory; "
                            "fix the index")
            by_file.setdefault(v, []).append(k)
        missing = sorted(f for f in by_file if not os.path.isfile(os.path.join(model_dir, f)))
        if missing:
            raise _fail(f"{model_dir}: shards named in {INDEX_FILE} are missing: "
                        f"{', '.join(missing[:3])}; download them into the directory")
        out: dict[str, _Head] = {}
        for f in sorted(by_file):
            out.update(_headers(os.path.join(model_dir, f), by_file[f]))
        return out
    files = sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors"))
    if not files:
        raise _fail(f"{model_dir}: no *.safetensors weights (only safetensors checkpoints "
                    "are imported)")
    out = {}
    for f in files:
        heads = _headers(os.path.join(model_dir, f))
        twice = sorted(set(heads) & set(out))
        if twice:
            raise _fail(f"{model_dir}: tensor {twice[0]!r} is in both {f} and "
                        f"{os.path.basename(out[twice[0]].path)}; remove the stale file")
        out.update(heads)
    return out


class _Reader:
    """Tensors out of the checkpoint's files, at most ``max_open`` files open at a time
    (the least recently used one is closed first, unmapping it)."""

    def __init__(self, heads: dict[str, _Head], max_open: int = 2) -> None:
        self.heads, self.max_open = heads, max_open
        self._open: OrderedDict[str, Any] = OrderedDict()

    def _handle(self, name: str) -> Any:
        from safetensors import safe_open

        path = self.heads[name].path
        if path in self._open:
            self._open.move_to_end(path)
            return self._open[path]
        while len(self._open) >= self.max_open:
            self._open.popitem(last=False)[1].__exit__(None, None, None)
        try:
            self._open[path] = safe_open(path, framework="pt").__enter__()
        except Exception as e:  # noqa: BLE001  (safetensors raises its own error types)
            raise _fail(f"{path}: unreadable safetensors file: {e}") from e
        return self._open[path]

    def close(self) -> None:
        while self._open:
            self._open.popitem()[1].__exit__(None, None, None)

    def _read(self, name: str, at: int | None = None) -> torch.Tensor:
        from safetensors import SafetensorError

        f = self._handle(name)
        try:
            return f.get_tensor(name) if at is None else f.get_slice(name)[at]
        except (SafetensorError, OSError, ValueError, TypeError, RuntimeError) as e:
            raise _fail(f"{self.heads[name].path}: tensor {name!r} is unreadable: {e}; "
                        "re-download or re-save the file") from e

    def get(self, name: str) -> torch.Tensor:
        return self._read(name)

    def shape(self, name: str) -> list[int]:
        return list(self.heads[name].shape)

    def dtype(self, name: str) -> torch.dtype | None:
        return _ST_DTYPES.get(self.heads[name].dtype)

    def expert_slice(self, name: str, e: int) -> torch.Tensor:
        return self._read(name, e)

    def rank(self, name: str) -> str:
        """Sort key: the file ``name`` is in (reading in this order reads shard by shard)."""
        return self.heads[name].path


def _plan(cfg: DecoderConfig, names: list[str]) -> tuple[dict[str, str], dict[tuple[int, int],
                                                                             dict[str, str]],
                                                         dict[int, dict[str, str]]]:
    """Sort checkpoint tensors into dense (decoder name -> HF name), per-expert ((layer, e) ->
    {w1|w2|w3: HF name}) and fused (layer -> {gate_up_proj|down_proj: HF name})."""
    dense: dict[str, str] = {}
    per_expert: dict[tuple[int, int], dict[str, str]] = {}
    fused: dict[int, dict[str, str]] = {}
    unknown: list[str] = []
    for hf in names:
        if hf in ("model.embed_tokens.weight", "embed_tokens.weight"):
            dense["tok_emb.weight"] = hf
        elif hf in ("model.norm.weight", "norm.weight"):
            dense["norm.weight"] = hf
        elif hf == "lm_head.weight":
            if not cfg.tie_embeddings:
                dense["lm_head.weight"] = hf
        elif (m := _LAYER.match(hf)) is None:
            unknown.append(hf)
        else:
            i, rest = int(m.group(1)), m.group(2)
            target = _layer_target(cfg, i, rest)
            if target is not None:
                dense[target] = hf
            elif (pe := _PER_EXPERT.match(rest)) and pe.group(2) in _FFN:
                per_expert.setdefault((i, int(pe.group(1))), {})[_FFN[pe.group(2)]] = hf
            elif fu := _FUSED.match(rest):
                fused.setdefault(i, {})[fu.group(1)] = hf
            elif rest.endswith("rotary_emb.inv_freq"):
                continue  # recomputed from the config
            else:
                unknown.append(hf)
    if unknown:
        raise _fail(f"checkpoint tensors this {cfg.family} import does not know: "
                    f"{', '.join(unknown[:5])}" + (" ..." if len(unknown) > 5 else ""))
    return dense, per_expert, fused


def _layer_target(cfg: DecoderConfig, i: int, rest: str) -> str | None:
    """The decoder's name for a dense tensor of layer ``i`` (``None``: an expert tensor or
    something unknown)."""
    p = f"layers.{i}."
    if rest == "input_layernorm.weight":
        return p + "attn_norm.weight"
    if rest == "post_attention_layernorm.weight":
        return p + "ffn_norm.weight"
    m = re.match(r"^self_attn\.(\w+)\.(weight|bias)$", rest)
    if m and m.group(1) in _ATTN:
        return f"{p}attn.{_ATTN[m.group(1)]}.{m.group(2)}"
    if re.match(rf"^{_MOE_BLOCK}\.gate\.weight$", rest):
        return p + "router.weight"
    m = re.match(r"^mlp\.shared_expert\.(\w+)\.weight$", rest)
    if m and m.group(1) in _FFN:
        return f"{p}shared.{_FFN[m.group(1)]}"
    if rest == "mlp.shared_expert_gate.weight":
        return p + "shared_gate.weight"
    m = re.match(r"^mlp\.(gate_proj|up_proj|down_proj)\.weight$", rest)
    if m and not cfg.is_moe(i):
        return f"{p}mlp.{_FFN[m.group(1)]}"
    return None


def _fused_expert(reader: _Reader, cfg: DecoderConfig, layer: int, names: dict[str, str],
                  e: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Expert ``e``'s (w1, w2, w3) out of a layer's fused 3-D tensors. The layout is told by
    the shapes; where hidden == 2*ffn (or hidden == ffn) both read alike and transformers'
    own ``[E, out, in]`` is taken."""
    h, f = cfg.hidden_size, cfg.moe_ffn
    gu_name, dn_name = names["gate_up_proj"], names["down_proj"]
    gu_shape, dn_shape = reader.shape(gu_name), reader.shape(dn_name)
    gu = reader.expert_slice(gu_name, e)
    if gu_shape[1:] == [2 * f, h]:
        w1, w3 = gu[:f], gu[f:]
    elif gu_shape[1:] == [h, 2 * f]:
        w1, w3 = gu[:, :f].t(), gu[:, f:].t()
    else:
        raise _fail(f"{gu_name}: shape {gu_shape} is neither [E, 2*ffn, hidden] nor "
                    f"[E, hidden, 2*ffn] for hidden {h}, ffn {f}")
    dn = reader.expert_slice(dn_name, e)
    if dn_shape[1:] == [h, f]:
        w2 = dn
    elif dn_shape[1:] == [f, h]:
        w2 = dn.t()
    else:
        raise _fail(f"{dn_name}: shape {dn_shape} is neither [E, hidden, ffn] nor "
                    f"[E, ffn, hidden] for hidden {h}, ffn {f}")
    return w1.contiguous(), w2.contiguous(), w3.contiguous()


def _generation_eos(model_dir: str) -> tuple[int, ...]:
    """End-of-sequence ids of ``generation_config.json`` (what ``generate`` stops at)."""
    path = os.path.join(model_dir, "generation_config.json")
    if not os.path.isfile(path):
        return ()
    try:
        with open(path, encoding="utf-8") as f:
            gen = json.load(f)
    except (OSError, ValueError) as e:
        raise _fail(f"{path}: unreadable ({e}); fix or remove it") from e
    v = gen.get("eos_token_id") if isinstance(gen, dict) else None
    vs = v if isinstance(v, list) else [v]
    if v is not None and not all(type(x) is int and 0 <= x < MAX_VOCAB for x in vs):
        raise _fail(f"{path}: eos_token_id is {v!r}, not a token id or a list of them; "
                    "fix or remove it")
    return () if v is None else tuple(vs)


def _check_against_weights(hf_path: str, sizes: dict[str, int],
                           heads: dict[str, _Head]) -> None:
    """The config's layer, expert, vocabulary and hidden sizes are those of the tensors the
    checkpoint holds (read from the headers: nothing is allocated yet)."""
    fix = "fix config.json or use the weights it belongs to"
    for name, h in heads.items():
        if h.dtype not in _ST_DTYPES:
            raise _fail(f"{h.path}: tensor {name!r} has dtype {h.dtype}, which the import "
                        "cannot read; convert the checkpoint to bfloat16, float16 or float32")
    layers: set[int] = set()
    experts: dict[int, int] = {}  # layer -> highest expert id + 1
    fused_experts: dict[str, int] = {}
    for name, h in heads.items():
        if (m := _LAYER.match(name)) is None:
            continue
        layer = int(m.group(1))
        layers.add(layer)
        if pe := _PER_EXPERT.match(m.group(2)):
            experts[layer] = max(experts.get(layer, 0), int(pe.group(1)) + 1)
        elif _FUSED.match(m.group(2)):
            if len(h.shape) != 3:
                raise _fail(f"{h.path}: fused expert tensor {name!r} has shape {h.shape}, not "
                            "[experts, rows, columns]; use complete weights")
            fused_experts[name] = h.shape[0]
    n = sizes["num_hidden_layers"]
    if len(layers) != n or (layers and (min(layers), max(layers)) != (0, n - 1)):
        held = (f"layers {min(layers)}..{max(layers)} ({len(layers)} of them)" if layers
                else "no layers")
        raise _fail(f"{hf_path}: num_hidden_layers is {n} but the checkpoint holds {held}; "
                    f"{fix}")
    embed = next((n for n in ("model.embed_tokens.weight", "embed_tokens.weight")
                  if n in heads), None)
    if embed is None:
        raise _fail(f"{hf_path}: the checkpoint lacks the token embedding "
                    "(model.embed_tokens.weight); use complete weights")
    want = [sizes["vocab_size"], sizes["hidden_size"]]
    if heads[embed].shape != want:
        raise _fail(f"{hf_path}: vocab_size x hidden_size is {want} but {embed} has shape "
                    f"{heads[embed].shape}; {fix}")
    key = next(k for k in sizes if k in ("num_experts", "num_local_experts"))
    held = set(experts.values()) | set(fused_experts.values())
    if not held:
        raise _fail(f"{hf_path}: the checkpoint holds no expert tensors; import-hf takes "
                    "Mixture-of-Experts models")
    if held != {sizes[key]}:
        raise _fail(f"{hf_path}: {key} is {sizes[key]} but the checkpoint's layers hold "
                    f"{', '.join(map(str, sorted(held)))} experts; {fix}")


def import_hf(model_dir: str | os.PathLike[str], store_path: str | os.PathLike[str],
              progress: bool | Callable[[int], Any] = True, *,
              resume: bool = False) -> dict[str, Any]:
    """Import the model in ``model_dir`` into the store at ``store_path`` (created if
    missing) and return its ``model.json`` content. ``progress``: ``True`` for a tqdm bar
    over the bytes imported, or a callable that receives byte counts. ``resume``: continue
    an interrupted import of the same checkpoint (see the module docstring).

    Everything is checked (config values, the config against the weights' headers, every
    tensor's shape) before the store is opened; a checkpoint that fails a check leaves no
    store behind."""
    model_dir = os.fspath(model_dir)
    hf = read_hf_config(model_dir)
    hf_path = os.path.join(model_dir, "config.json")
    try:
        family = family_of(hf)
    except ValueError as e:
        raise _fail(f"{model_dir}: {e}") from e
    sizes = _check_config(hf, hf_path, family)
    heads = _weight_files(model_dir)
    _check_against_weights(hf_path, sizes, heads)
    try:
        cfg = build_from_hf(hf)
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        msg = str(e) if isinstance(e, ValueError) else f"config.json lacks or garbles {e}"
        raise _fail(f"{model_dir}: {msg}; fix config.json") from e
    eos = _generation_eos(model_dir)
    if eos:
        cfg = replace(cfg, eos_token_ids=tuple(dict.fromkeys((*cfg.eos_token_ids, *eos))))
    dense, per_expert, fused = _plan(cfg, sorted(heads))
    _check_complete(cfg, dense, per_expert, fused, heads, hf_path)
    reader = _Reader(heads)
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
            stored_dtype = _put_experts(store, reader, cfg, per_expert, fused, advance, keep)
            cfg = replace(cfg, dtype=stored_dtype)
            for name, hf_name in sorted(dense.items(), key=lambda d: (reader.rank(d[1]), d[0])):
                shape, src = reader.shape(hf_name), reader.dtype(hf_name)
                if src is None or not keep(DENSE_PREFIX + name, shape, src):
                    t = reader.get(hf_name)
                    store.put(DENSE_PREFIX + name, t.contiguous())
                    src = t.dtype
                advance(math.prod(shape) * src.itemsize)
            reader.close()
            toks = []
            for fname in TOKENIZER_FILES:
                path = os.path.join(model_dir, fname)
                if os.path.isfile(path):
                    try:
                        with open(path, "rb") as f:
                            raw = f.read()
                    except OSError as e:
                        raise _fail(f"{path}: unreadable ({e}); fix its permissions or "
                                    "remove it") from e
                    store.put(TOKENIZER_PREFIX + fname,
                              torch.frombuffer(bytearray(raw), dtype=torch.uint8)
                              if raw else torch.zeros(0, dtype=torch.uint8), kind=TOKENIZER_KIND)
                    toks.append(fname)
            info = {"format": MODEL_FORMAT, "family": cfg.family, "config": cfg.to_dict(),
                    "hf_config": hf, "dense_prefix": DENSE_PREFIX, "tokenizer": toks}
            store.put(MODEL_ENTRY[0], json_entry(info), kind=MODEL_ENTRY[1])
            store.delete(IMPORT_ENTRY[0], IMPORT_ENTRY[1], missing_ok=True)
            store.flush()
        finally:
            reader.close()
            if bar is not None:
                bar.close()
    return info


def _begin(store: tierstore.Store, source: dict[str, Any], resume: bool) -> None:
    """Refuse a store that holds a model, or another import; record this import's source
    (or, resuming, check that the interrupted import had the same one)."""
    if MODEL_ENTRY in store:
        raise _fail(f"store {store.path} already holds a model; import into a new store")
    begun = IMPORT_ENTRY in store
    if not begun and not store.names("layers."):
        store.put(IMPORT_ENTRY[0], json_entry(source), kind=IMPORT_ENTRY[1])
        return
    if not begun:
        raise _fail(f"store {store.path} already holds expert entries; import into a new store")
    if not resume:
        raise _fail(f"store {store.path} holds an interrupted import; continue it with "
                    "--resume, or import into a new store")
    was = json.loads(bytes(store.get(*IMPORT_ENTRY).numpy()).decode())
    if was != json.loads(json.dumps(source)):
        raise _fail(f"store {store.path} holds an interrupted import of another checkpoint "
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


def _check_complete(cfg: DecoderConfig, dense: dict[str, str],
                    per_expert: dict[tuple[int, int], dict[str, str]],
                    fused: dict[int, dict[str, str]], heads: dict[str, _Head],
                    hf_path: str) -> None:
    """Every tensor the config implies is in the checkpoint with the shape it implies
    (from the headers, and a model on the meta device: nothing is allocated)."""
    fix = "fix config.json or use the weights it belongs to"
    with torch.device("meta"):
        expected = {k: list(v.shape) for k, v in MoEDecoder(cfg).state_dict().items()}
    missing = sorted(set(expected) - set(dense))
    if missing:
        raise _fail(f"checkpoint lacks dense tensors for the {cfg.family} config: "
                    f"{', '.join(missing[:5])}")
    for name, hf_name in sorted(dense.items()):
        if name in expected and heads[hf_name].shape != expected[name]:
            raise _fail(f"{hf_path}: implies shape {expected[name]} for {hf_name}, the "
                        f"checkpoint has {heads[hf_name].shape}; {fix}")
    h, f, n_e = cfg.hidden_size, cfg.moe_ffn, cfg.n_experts
    want = {"w1": [f, h], "w2": [h, f], "w3": [f, h]}
    for layer in cfg.moe_layers:
        if layer in fused:
            if set(fused[layer]) != {"gate_up_proj", "down_proj"}:
                raise _fail(f"layer {layer}: fused experts need gate_up_proj and down_proj")
            for part, layouts in (("gate_up_proj", ([2 * f, h], [h, 2 * f])),
                                  ("down_proj", ([h, f], [f, h]))):
                shape = heads[fused[layer][part]].shape
                if len(shape) != 3 or shape[0] != n_e or shape[1:] not in layouts:
                    raise _fail(f"{hf_path}: implies {fused[layer][part]} of shape "
                                f"[{n_e}, {' or '.join(map(str, layouts))}], the checkpoint "
                                f"has {shape}; {fix}")
            continue
        for e in range(n_e):
            got = per_expert.get((layer, e), {})
            if set(got) != {"w1", "w2", "w3"}:
                raise _fail(f"layer {layer} expert {e}: checkpoint lacks its "
                            f"{', '.join(sorted({'w1', 'w2', 'w3'} - set(got)))} weights")
            for w, hf_name in got.items():
                if heads[hf_name].shape != want[w]:
                    raise _fail(f"{hf_path}: implies shape {want[w]} for {hf_name}, the "
                                f"checkpoint has {heads[hf_name].shape}; {fix}")
    stray = sorted({layer for layer, _ in per_expert} | set(fused))
    extra = [layer for layer in stray if not cfg.is_moe(layer)]
    if extra:
        raise _fail(f"checkpoint has experts in layers {extra}, which the config makes dense")


def _put_experts(store: tierstore.Store, reader: _Reader, cfg: DecoderConfig,
                 per_expert: dict[tuple[int, int], dict[str, str]],
                 fused: dict[int, dict[str, str]], advance: Callable[[int], Any],
                 keep: _Keep) -> str:
    """Every expert in one ``put_many`` each (those ``keep`` says are stored already are
    skipped); returns the experts' dtype name."""
    dtype = "float32"
    want = [[cfg.moe_ffn, cfg.hidden_size], [cfg.hidden_size, cfg.moe_ffn],
            [cfg.moe_ffn, cfg.hidden_size]]

    def first(layer: int, e: int) -> str:
        return fused[layer]["gate_up_proj"] if layer in fused else per_expert[(layer, e)]["w1"]

    # In the order of the files, so that each is read through before the next is opened.
    work = sorted(((layer, e) for layer in cfg.moe_layers for e in range(cfg.n_experts)),
                  key=lambda le: (reader.rank(first(*le)), le))
    for layer, e in work:
        src = reader.dtype(first(layer, e))
        names = expert_names(layer, e)
        if all(keep(n, w, src) for n, w in zip(names, want)):
            assert src is not None
            dtype = str(src).removeprefix("torch.")
            advance(sum(math.prod(w) for w in want) * src.itemsize)
            continue
        if layer in fused:
            w1, w2, w3 = _fused_expert(reader, cfg, layer, fused[layer], e)
        else:
            hf_names = per_expert[(layer, e)]
            w1, w2, w3 = (reader.get(hf_names[w]) for w in ("w1", "w2", "w3"))
        shapes = [list(w.shape) for w in (w1, w2, w3)]
        if shapes != want:
            raise _fail(f"layer {layer} expert {e}: shapes {shapes}, config says {want}")
        store.put_many(list(zip(names, (w1, w2, w3))))
        dtype = str(w1.dtype).removeprefix("torch.")
        advance(sum(w.numel() * w.element_size() for w in (w1, w2, w3)))
    return dtype
