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
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

import tierstore

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
# safetensors' dtype codes, for telling whether a stored tensor already is the checkpoint's
_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
              "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32,
              "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}


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
        with open(path) as f:
            cfg = json.load(f)
    except (OSError, ValueError) as e:
        raise _fail(f"{path}: unreadable config: {e}") from e
    if not isinstance(cfg, dict):
        raise _fail(f"{path}: config is not a JSON object")
    return cfg


def _weight_files(model_dir: str) -> dict[str, str]:
    """Tensor name -> file path, from the index of a sharded checkpoint or every
    ``*.safetensors`` file of the directory."""
    from safetensors import safe_open

    index = os.path.join(model_dir, INDEX_FILE)
    if os.path.isfile(index):
        try:
            with open(index) as f:
                wmap = json.load(f)["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise _fail(f"{index}: unreadable index: {e}") from e
        missing = sorted({f for f in wmap.values()
                          if not os.path.isfile(os.path.join(model_dir, f))})
        if missing:
            raise _fail(f"{model_dir}: shards named in {INDEX_FILE} are missing: "
                        f"{', '.join(missing[:3])}")
        return {k: os.path.join(model_dir, v) for k, v in wmap.items()}
    files = sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors"))
    if not files:
        raise _fail(f"{model_dir}: no *.safetensors weights (only safetensors checkpoints "
                    "are imported)")
    out: dict[str, str] = {}
    for f in files:
        path = os.path.join(model_dir, f)
        try:
            with safe_open(path, framework="pt") as st:
                out.update(dict.fromkeys(st.keys(), path))
        except Exception as e:  # safetensors raises its own error types
            raise _fail(f"{path}: unreadable safetensors file: {e}") from e
    return out


class _Reader:
    """Open safetensors files on demand, each once."""

    def __init__(self, files: dict[str, str]) -> None:
        self.files = files
        self._open: dict[str, Any] = {}

    def _handle(self, name: str) -> Any:
        from safetensors import safe_open

        path = self.files[name]
        if path not in self._open:
            try:
                self._open[path] = safe_open(path, framework="pt")
            except Exception as e:
                raise _fail(f"{path}: unreadable safetensors file: {e}") from e
        return self._open[path]

    def get(self, name: str) -> torch.Tensor:
        return self._handle(name).get_tensor(name)

    def shape(self, name: str) -> list[int]:
        return list(self._handle(name).get_slice(name).get_shape())

    def dtype(self, name: str) -> torch.dtype | None:
        return _ST_DTYPES.get(self._handle(name).get_slice(name).get_dtype())

    def expert_slice(self, name: str, e: int) -> torch.Tensor:
        return self._handle(name).get_slice(name)[e]


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
    try:
        with open(path) as f:
            v = json.load(f).get("eos_token_id")
    except (OSError, ValueError, AttributeError):
        return ()
    if v is None:
        return ()
    return tuple(int(x) for x in (v if isinstance(v, list) else [v]))


def import_hf(model_dir: str | os.PathLike[str], store_path: str | os.PathLike[str],
              progress: bool | Callable[[int], Any] = True, *,
              resume: bool = False) -> dict[str, Any]:
    """Import the model in ``model_dir`` into the store at ``store_path`` (created if
    missing) and return its ``model.json`` content. ``progress``: ``True`` for a tqdm bar
    over the bytes imported, or a callable that receives byte counts. ``resume``: continue
    an interrupted import of the same checkpoint (see the module docstring)."""
    model_dir = os.fspath(model_dir)
    hf = read_hf_config(model_dir)
    try:
        cfg = build_from_hf(hf)
    except (ValueError, KeyError, TypeError) as e:
        msg = str(e) if isinstance(e, ValueError) else f"config.json lacks or garbles {e}"
        raise _fail(f"{model_dir}: {msg}") from e
    eos = _generation_eos(model_dir)
    if eos:
        cfg = replace(cfg, eos_token_ids=tuple(dict.fromkeys((*cfg.eos_token_ids, *eos))))
    files = _weight_files(model_dir)
    dense, per_expert, fused = _plan(cfg, sorted(files))
    reader = _Reader(files)
    _check_complete(cfg, dense, per_expert, fused)

    total = sum(os.path.getsize(p) for p in set(files.values()))
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
              "files": sorted((os.path.basename(p), os.path.getsize(p))
                              for p in set(files.values()))}
    # No host cache: an import reads nothing back, and each expert should be durable once
    # its put_many returns, so that an interrupted import can be resumed from there.
    with tierstore.open(store_path, create=True, host_cache=0) as store:
        _begin(store, source, resume)
        keep = _Keep(store, resume)
        try:
            stored_dtype = _put_experts(store, reader, cfg, per_expert, fused, advance, keep)
            cfg = replace(cfg, dtype=stored_dtype)
            for name, hf_name in dense.items():
                shape, src = reader.shape(hf_name), reader.dtype(hf_name)
                if src is None or not keep(DENSE_PREFIX + name, shape, src):
                    t = reader.get(hf_name)
                    store.put(DENSE_PREFIX + name, t.contiguous())
                    src = t.dtype
                advance(math.prod(shape) * src.itemsize)
            toks = []
            for fname in TOKENIZER_FILES:
                path = os.path.join(model_dir, fname)
                if os.path.isfile(path):
                    with open(path, "rb") as f:
                        raw = f.read()
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
                    fused: dict[int, dict[str, str]]) -> None:
    with torch.device("meta"):
        expected = set(MoEDecoder(cfg).state_dict())
    missing = sorted(expected - set(dense))
    if missing:
        raise _fail(f"checkpoint lacks dense tensors for the {cfg.family} config: "
                    f"{', '.join(missing[:5])}")
    for layer in cfg.moe_layers:
        if layer in fused:
            if set(fused[layer]) != {"gate_up_proj", "down_proj"}:
                raise _fail(f"layer {layer}: fused experts need gate_up_proj and down_proj")
            continue
        for e in range(cfg.n_experts):
            got = per_expert.get((layer, e), {})
            if set(got) != {"w1", "w2", "w3"}:
                raise _fail(f"layer {layer} expert {e}: checkpoint lacks its "
                            f"{', '.join(sorted({'w1', 'w2', 'w3'} - set(got)))} weights")
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
    for layer in cfg.moe_layers:
        for e in range(cfg.n_experts):
            src = reader.dtype(fused[layer]["gate_up_proj"] if layer in fused
                               else per_expert[(layer, e)]["w1"])
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
