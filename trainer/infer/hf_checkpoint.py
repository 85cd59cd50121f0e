"""Reading a Hugging Face safetensors checkpoint for an import, and checking it.

The weights come from one ``*.safetensors`` file or a sharded set with its
``model.safetensors.index.json`` (:func:`weight_files`: tensor headers only, no data).
:func:`plan` sorts the checkpoint's tensor names into the model's dense weights, per-expert
tensors and fused expert tensors; :func:`check_against_weights` and :func:`check_complete`
hold the config against what the headers say the checkpoint holds, before anything is
allocated. :class:`CheckpointReader` then reads tensors with at most two shard files open.

Experts are accepted both per expert (``experts.{e}.w1/w2/w3`` as Mixtral checkpoints have
them, ``experts.{e}.gate_proj/up_proj/down_proj`` as Qwen and OLMoE have them; what
``transformers`` 5's ``save_pretrained`` writes by default) and fused into 3-D tensors over
the experts (``experts.gate_up_proj`` ``[E, 2*ffn, hidden]`` or ``[E, hidden, 2*ffn]``,
``experts.down_proj`` ``[E, hidden, ffn]`` or ``[E, ffn, hidden]``; what ``transformers``
5 holds in memory and writes with ``save_original_format=False``). A fused tensor is read one
expert slice at a time (:func:`fused_expert`), so an import never holds more than one
expert's tensors.
"""

from __future__ import annotations

import json
import os
import re
import stat
from collections import OrderedDict
from typing import Any

import torch

from tierstore.interchange import safetensors_dtypes

from ..model import DTYPES, ModelConfig, MoEDecoder
from ..train.data import file_kind
from .hf_config import HFImportError, config_dtype

INDEX_FILE = "model.safetensors.index.json"

_LAYER = re.compile(r"^(?:model\.)?layers\.(\d+)\.(.+)$")
_ATTN = {"q_proj": "wq", "k_proj": "wk", "v_proj": "wv", "o_proj": "wo",
         "q_norm": "q_norm", "k_norm": "k_norm"}
_FFN = {"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3", "w1": "w1", "w2": "w2",
        "w3": "w3"}
_MOE_BLOCK = r"(?:block_sparse_moe|mlp)"
_PER_EXPERT = re.compile(rf"^{_MOE_BLOCK}\.experts\.(\d+)\.(\w+)\.weight$")
_FUSED = re.compile(rf"^{_MOE_BLOCK}\.experts\.(gate_up_proj|down_proj)$")

# safetensors' dtype codes torch reads, as torch dtypes
_ST_DTYPES = safetensors_dtypes()


class TensorHeader:
    """One checkpoint tensor as its safetensors header describes it."""

    __slots__ = ("dtype", "path", "shape")

    def __init__(self, path: str, dtype: str, shape: list[int]) -> None:
        self.path, self.dtype, self.shape = path, dtype, shape


def _read_headers(path: str, names: list[str] | None = None) -> dict[str, TensorHeader]:
    """The headers of one safetensors file (of ``names`` only, if given: each must be
    there); reads no tensor data."""
    from safetensors import SafetensorError, safe_open

    try:
        mode = os.stat(path).st_mode
    except OSError as e:
        raise HFImportError(f"{path}: unreadable ({e.strerror})") from e
    if not stat.S_ISREG(mode):  # opening a FIFO would wait for a writer for ever
        raise HFImportError(f"{path}: {file_kind(mode)}, not a safetensors file; put the "
                            "checkpoint's file there")
    try:
        with safe_open(path, framework="pt") as st:
            keys = list(st.keys())
            if names is not None:
                lacking = sorted(set(names) - set(keys))
                if lacking:
                    raise HFImportError(f"{path}: lacks tensor {lacking[0]!r}, which "
                                        f"{INDEX_FILE} puts there; fix the index or "
                                        "re-download the shard")
                keys = names
            out = {}
            for k in keys:
                sl = st.get_slice(k)
                out[k] = TensorHeader(path, sl.get_dtype(), list(sl.get_shape()))
            return out
    except (SafetensorError, OSError, ValueError, TypeError) as e:
        raise HFImportError(f"{path}: unreadable safetensors file: {e}; re-download or "
                            "re-save it") from e


def weight_files(model_dir: str) -> dict[str, TensorHeader]:
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
            raise HFImportError(f"{index}: unreadable index: {e}; re-download it, or delete it to "
                                "import every *.safetensors file of the directory") from e
        by_file: dict[str, list[str]] = {}
        for k, v in wmap.items():
            if os.path.isabs(v) or os.path.normpath(v).startswith(".."):
                raise HFImportError(f"{index}: shard {v!r} of {k!r} lies outside the model "
                                    "directory; fix the index")
            by_file.setdefault(v, []).append(k)
        missing = sorted(f for f in by_file if not os.path.isfile(os.path.join(model_dir, f)))
        if missing:
            raise HFImportError(f"{model_dir}: shards named in {INDEX_FILE} are missing: "
                                f"{', '.join(missing[:3])}; download them into the directory")
        out: dict[str, TensorHeader] = {}
        for f in sorted(by_file):
            out.update(_read_headers(os.path.join(model_dir, f), by_file[f]))
        return out
    files = sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors"))
    if not files:
        raise HFImportError(f"{model_dir}: no *.safetensors weights (only safetensors checkpoints "
                            "are imported)")
    out = {}
    for f in files:
        heads = _read_headers(os.path.join(model_dir, f))
        twice = sorted(set(heads) & set(out))
        if twice:
            raise HFImportError(f"{model_dir}: tensor {twice[0]!r} is in both {f} and "
                                f"{os.path.basename(out[twice[0]].path)}; remove the stale file")
        out.update(heads)
    return out


class CheckpointReader:
    """Tensors out of the checkpoint's files, at most ``max_open`` files open at a time
    (the least recently used one is closed first, unmapping it), cast to ``dtype`` where
    given (the model's: :func:`check_dtype` has found each cast lossless)."""

    def __init__(self, heads: dict[str, TensorHeader], max_open: int = 2,
                 dtype: torch.dtype | None = None) -> None:
        self.heads, self.max_open, self.target = heads, max_open, dtype
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
            raise HFImportError(f"{path}: unreadable safetensors file: {e}") from e
        return self._open[path]

    def close(self) -> None:
        while self._open:
            self._open.popitem()[1].__exit__(None, None, None)

    def _read(self, name: str, at: int | None = None) -> torch.Tensor:
        from safetensors import SafetensorError

        f = self._handle(name)
        try:
            t = f.get_tensor(name) if at is None else f.get_slice(name)[at]
        except (SafetensorError, OSError, ValueError, TypeError, RuntimeError) as e:
            raise HFImportError(f"{self.heads[name].path}: tensor {name!r} is unreadable: {e}; "
                                "re-download or re-save the file") from e
        return t if self.target is None else t.to(self.target)

    def get(self, name: str) -> torch.Tensor:
        return self._read(name)

    def shape(self, name: str) -> list[int]:
        return list(self.heads[name].shape)

    def dtype(self, name: str) -> torch.dtype | None:
        """The tensor's dtype in the file (``None``: one torch cannot read)."""
        return _ST_DTYPES.get(self.heads[name].dtype)

    def expert_slice(self, name: str, e: int) -> torch.Tensor:
        return self._read(name, e)

    def rank(self, name: str) -> str:
        """Sort key: the file ``name`` is in (reading in this order reads shard by shard)."""
        return self.heads[name].path


def plan(cfg: ModelConfig, names: list[str]) -> tuple[dict[str, str], dict[tuple[int, int],
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
        raise HFImportError(f"checkpoint tensors this {cfg.family} import does not know: "
                            f"{', '.join(unknown[:5])}" + (" ..." if len(unknown) > 5 else ""))
    return dense, per_expert, fused


def _layer_target(cfg: ModelConfig, i: int, rest: str) -> str | None:
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


def fused_expert(reader: CheckpointReader, cfg: ModelConfig, layer: int, names: dict[str, str],
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
        raise HFImportError(f"{gu_name}: shape {gu_shape} is neither [E, 2*ffn, hidden] nor "
                            f"[E, hidden, 2*ffn] for hidden {h}, ffn {f}")
    dn = reader.expert_slice(dn_name, e)
    if dn_shape[1:] == [h, f]:
        w2 = dn
    elif dn_shape[1:] == [f, h]:
        w2 = dn.t()
    else:
        raise HFImportError(f"{dn_name}: shape {dn_shape} is neither [E, hidden, ffn] nor "
                            f"[E, ffn, hidden] for hidden {h}, ffn {f}")
    return w1.contiguous(), w2.contiguous(), w3.contiguous()


def check_against_weights(hf_path: str, sizes: dict[str, int],
                           heads: dict[str, TensorHeader]) -> None:
    """The config's layer, expert, vocabulary and hidden sizes are those of the tensors the
    checkpoint holds (read from the headers: nothing is allocated yet)."""
    fix = "fix config.json or use the weights it belongs to"
    for name, h in heads.items():
        if h.dtype not in _ST_DTYPES:
            raise HFImportError(f"{h.path}: tensor {name!r} has dtype {h.dtype}, which the "
                                "import cannot read; convert the checkpoint to bfloat16, "
                                "float16 or float32")
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
                raise HFImportError(f"{h.path}: fused expert tensor {name!r} has shape "
                                    f"{h.shape}, not [experts, rows, columns]; use complete "
                                    "weights")
            fused_experts[name] = h.shape[0]
    n = sizes["num_hidden_layers"]
    if len(layers) != n or (layers and (min(layers), max(layers)) != (0, n - 1)):
        held = (f"layers {min(layers)}..{max(layers)} ({len(layers)} of them)" if layers
                else "no layers")
        raise HFImportError(f"{hf_path}: num_hidden_layers is {n} but the checkpoint holds {held}; "
                            f"{fix}")
    embed = next((n for n in ("model.embed_tokens.weight", "embed_tokens.weight")
                  if n in heads), None)
    if embed is None:
        raise HFImportError(f"{hf_path}: the checkpoint lacks the token embedding "
                            "(model.embed_tokens.weight); use complete weights")
    want = [sizes["vocab_size"], sizes["hidden_size"]]
    if heads[embed].shape != want:
        raise HFImportError(f"{hf_path}: vocab_size x hidden_size is {want} but {embed} has shape "
                            f"{heads[embed].shape}; {fix}")
    key = next(k for k in sizes if k in ("num_experts", "num_local_experts"))
    held = set(experts.values()) | set(fused_experts.values())
    if not held:
        raise HFImportError(f"{hf_path}: the checkpoint holds no expert tensors; import-hf takes "
                            "Mixture-of-Experts models")
    if held != {sizes[key]}:
        raise HFImportError(f"{hf_path}: {key} is {sizes[key]} but the checkpoint's layers hold "
                            f"{', '.join(map(str, sorted(held)))} experts; {fix}")


def check_complete(cfg: ModelConfig, dense: dict[str, str],
                    per_expert: dict[tuple[int, int], dict[str, str]],
                    fused: dict[int, dict[str, str]], heads: dict[str, TensorHeader],
                    hf_path: str) -> None:
    """Every tensor the config implies is in the checkpoint with the shape it implies
    (from the headers, and a model on the meta device: nothing is allocated)."""
    fix = "fix config.json or use the weights it belongs to"
    with torch.device("meta"):
        expected = {k: list(v.shape) for k, v in MoEDecoder(cfg).state_dict().items()}
    missing = sorted(set(expected) - set(dense))
    if missing:
        raise HFImportError(f"checkpoint lacks dense tensors for the {cfg.family} config: "
                            f"{', '.join(missing[:5])}")
    for name, hf_name in sorted(dense.items()):
        if name in expected and heads[hf_name].shape != expected[name]:
            raise HFImportError(f"{hf_path}: implies shape {expected[name]} for {hf_name}, the "
                                f"checkpoint has {heads[hf_name].shape}; {fix}")
    h, f, n_e = cfg.hidden_size, cfg.moe_ffn, cfg.n_experts
    want = {"w1": [f, h], "w2": [h, f], "w3": [f, h]}
    for layer in cfg.moe_layers:
        if layer in fused:
            if set(fused[layer]) != {"gate_up_proj", "down_proj"}:
                raise HFImportError(f"layer {layer}: fused experts need gate_up_proj and down_proj")
            for part, layouts in (("gate_up_proj", ([2 * f, h], [h, 2 * f])),
                                  ("down_proj", ([h, f], [f, h]))):
                shape = heads[fused[layer][part]].shape
                if len(shape) != 3 or shape[0] != n_e or shape[1:] not in layouts:
                    raise HFImportError(f"{hf_path}: implies {fused[layer][part]} of shape "
                                        f"[{n_e}, {' or '.join(map(str, layouts))}], the "
                                        f"checkpoint has {shape}; {fix}")
            continue
        for e in range(n_e):
            got = per_expert.get((layer, e), {})
            if set(got) != {"w1", "w2", "w3"}:
                raise HFImportError(f"layer {layer} expert {e}: checkpoint lacks its "
                                    f"{', '.join(sorted({'w1', 'w2', 'w3'} - set(got)))} weights")
            for w, hf_name in got.items():
                if heads[hf_name].shape != want[w]:
                    raise HFImportError(f"{hf_path}: implies shape {want[w]} for {hf_name}, the "
                                        f"checkpoint has {heads[hf_name].shape}; {fix}")
    stray = sorted({layer for layer, _ in per_expert} | set(fused))
    extra = [layer for layer in stray if not cfg.is_moe(layer)]
    if extra:
        raise HFImportError(f"checkpoint has experts in layers {extra}, which the config "
                            "makes dense")


# --------------------------------------------------------------------------- dtypes

# Casts that keep every value: to the same dtype, or from a 16-bit float to fp32.
_LOSSLESS = {(torch.float16, torch.float32), (torch.bfloat16, torch.float32)}


def model_dtype(hf: dict[str, Any], heads: dict[str, TensorHeader]) -> torch.dtype:
    """The dtype ``transformers`` would build the model in, as ``from_pretrained`` with its
    default ``dtype="auto"`` picks it: the one ``config.json`` names, else the checkpoint's
    own (its token embedding's), else fp32. The import stores every tensor in it."""
    named = config_dtype(hf)
    if named is not None:
        return DTYPES[named]  # check_config has made sure it is one
    embed = next((heads[n] for n in ("model.embed_tokens.weight", "embed_tokens.weight")
                  if n in heads), None)
    own = _ST_DTYPES.get(embed.dtype) if embed is not None else None
    return own if own in DTYPES.values() else torch.float32


def check_dtype(name: str, dtype: torch.dtype, expected: torch.dtype, where: str = "") -> None:
    """Refuse checkpoint tensor ``name`` of ``dtype`` in a model of ``expected`` dtype
    unless casting it keeps every value: ``transformers`` would cast it all the same,
    silently rounding (fp32 into a bf16 model) or turning integers into weights (an int32
    tensor in a float model is no weight, whatever its values)."""
    if dtype == expected or (dtype, expected) in _LOSSLESS:
        return
    if not dtype.is_floating_point or dtype.itemsize == 1:
        what = "an integer or boolean" if not dtype.is_floating_point else "an fp8"
        why = (f"{what} tensor is no weight of an unquantized model; re-download the "
               "checkpoint or save it again from the model")
    else:
        why = (f"casting it to {_name(expected)} would lose precision; convert the "
               f"checkpoint to {_name(expected)}, or fix config.json's dtype if it is wrong")
    raise HFImportError(f"{where + ': ' if where else ''}tensor {name!r} is {_name(dtype)}, the "
                        f"model is {_name(expected)}: {why}")


def check_dtypes(names: list[str], heads: dict[str, TensorHeader],
                 expected: torch.dtype) -> None:
    """Every tensor the import takes (``names``) has a dtype the model's casts losslessly
    (:func:`check_dtype`; read from the headers: nothing is allocated yet)."""
    for name in sorted(names):
        h = heads[name]
        dtype = _ST_DTYPES.get(h.dtype)
        if dtype is None:  # check_against_weights refuses these first
            raise HFImportError(f"{h.path}: tensor {name!r} has dtype {h.dtype}, which the "
                                "import cannot read")
        check_dtype(name, dtype, expected, h.path)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
