"""Tiny random checkpoints of every Mixture-of-Experts causal-LM family of the installed
``transformers``, derived from transformers itself.

The families are enumerated from the library (:func:`moe_families`: every causal-LM model type
whose experts class carries ``@use_experts_implementation``), and each tiny config is derived
from the family's own config class: its defaults are shrunk by rules keyed on field names
(sizes, head counts, expert counts, token ids), its per-layer lists are cut down to one layer of
each distinct kind (so dense-first, sliding/full and linear/full patterns all survive), and
what the config class then validates decides the rest. Test support code, not a test module.
"""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path
from typing import Any

import torch
from huggingface_hub.errors import StrictDataclassError

VOCAB = 128
HIDDEN = 64
HEADS = 4
MAX_LAYERS = 4  # distinct layer kinds kept; a family with more is cut to its first four kinds
HEAD_DIM_TARGET = 32  # the largest head dimension after the common shrink factor


class TinyUnavailable(Exception):
    """A family that cannot be built tiny on a CPU; the message says why, on one line."""


def moe_families() -> list[str]:
    """Every causal-LM model type whose experts class is decorated with
    ``@use_experts_implementation`` (enumerated from the installed transformers)."""
    import transformers
    from transformers.models.auto.configuration_auto import model_type_to_module_name
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    root = Path(transformers.__file__).parent / "models"
    decorated = {f.parent.name for f in root.glob("*/modeling_*.py")
                 if "@use_experts_implementation" in f.read_text()}
    return sorted(mt for mt in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
                  if model_type_to_module_name(mt) in decorated)


# --- rules keyed on field names -------------------------------------------------------------

# Absolute sizes. Expert counts, top-k and expert widths are set even where the default is None
# (families whose MoE block is off by default, e.g. gemma4_text); the rest keep None.
SIZES: dict[str, int] = {
    "vocab_size": VOCAB, "vocab_size_per_layer_input": VOCAB, "unpadded_vocab_size": VOCAB,
    "hidden_size": HIDDEN,
    # Vision/audio towers of composite families feed the text model through adapters.
    "adapter_in_dim": HIDDEN, "adapter_input_size": HIDDEN, "adapter_out_dim": HIDDEN,
    "out_hidden_size": HIDDEN, "downsample_hidden_size": 32,
    "intermediate_size": 96, "ffn_hidden_size": 96, "dense_intermediate_size": 96,
    "first_dense_intermediate_size": 96, "mlp_only_intermediate_size": 96,
    "prefix_dense_intermediate_size": 96,
    "shared_expert_intermediate_size": 48, "shared_intermediate_size": 48,
    "moe_shared_expert_intermediate_size": 48, "shared_experts_intermediate_size": 48,
    "max_position_embeddings": 256, "model_max_length": 256,
    "sliding_window": 4, "sliding_window_size": 4, "rel_extent": 16,
    "index_topk": 8, "index_block_size": 4, "index_topk_blocks": 2,
    "index_num_local_tokens": 2, "index_num_sink_tokens": 1, "index_compression": 2,
    "index_pool_size": 8, "log_scaling_n_floor": 4,
    "mamba_d_state": 16, "ssm_state_size": 16, "mamba_dt_rank": 8,
    "mamba_chunk_size": 16, "chunk_size": 16, "block_size": 16,
    "router_hidden_size": 32, "hidden_size_per_layer_input": 16, "ple_embed_dim": 32,
    "hc_lowrank": 16, "loop_gate_rank": 8, "gated_norm_rank": 8,
    "ngram_vocab_size_base": VOCAB, "zero_expert_num": 2,
}
EXPERT_WIDTH = {"moe_intermediate_size": 32, "expert_ffn_hidden_size": 32}
EXPERT_COUNT = {"num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"}
EXPERTS = 8
TOP_K = {"num_experts_per_tok", "num_experts_per_token", "moe_topk", "moe_k", "top_k_experts"}
TOPK = 2
# Shared experts: a family that leaves the count unset (dots1) needs one.
SHARED_COUNT = {"n_shared_experts", "num_shared_experts", "moe_num_shared_experts"}
GROUPS = {"n_group", "num_expert_group"}  # routing groups: 2 where the family groups at all
ROUTING = TOP_K | GROUPS | {"topk_group"}  # what a class's validation may send back to default
FULL_ATTENTION = "full_attention"
ATTENTION_LISTS = ("layer_types", "layers_block_type")
# Head dimensions and low ranks all shrink by one power-of-two factor, so the relations between
# them (head_dim = nope + rope, rope = partial factor * head_dim, ranks) survive.
HEAD_DIMS = {
    "head_dim", "swa_head_dim", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
    "qk_head_dim", "linear_key_head_dim", "linear_value_head_dim", "linear_head_dim",
    "index_head_dim", "rotary_dim", "kv_lora_rank", "q_lora_rank", "o_lora_rank",
    "mamba_d_head", "mamba_head_dim", "global_head_dim",
}
# Head counts: attention heads become HEADS, the others keep their ratio to them.
ATTN_HEADS = {"num_attention_heads", "swa_num_attention_heads"}
KV_HEADS = {"num_key_value_heads": "num_attention_heads",
            "swa_num_key_value_heads": "swa_num_attention_heads",
            "num_global_key_value_heads": "num_attention_heads"}
OTHER_HEADS = {"linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_num_heads": 4,
               "index_n_heads": 2, "index_num_heads": 2, "heads_per_ngram": 2,
               "o_groups": 2}
# An indexer that the defaults leave unset while layers are "indexed_attention" (qwen4_exp):
# switched on tiny; None stands for the shrunk head dimension.
INDEXER_UNSET = {"indexer_n_heads": 2, "indexer_kv_heads": 1, "indexer_head_dim": None,
                 "indexer_budget": 8, "indexer_compress_ratio": 2}
# The one family whose defaults leave its layer types unset although its model indexes them:
# LFM2 interleaves short-convolution layers with attention layers.
UNSET_LAYER_TYPES = {"lfm2_moe": ["conv", FULL_ATTENTION]}
LAYER_COUNT = ("num_hidden_layers", "num_layers")
# Leading-layer counts ("the first k layers are dense"): remapped to the layers kept.
LEADING = {"first_k_dense_replace", "num_dense_layers", "num_dense_blocks", "max_window_layers",
           "moe_layer_start_index"}
TRAILING = {"num_kv_shared_layers"}
# Layer boundaries (the first layer at or after it), remapped to the layers kept; and last
# layers (inclusive).
BOUNDARY = {"loop_layer_index_start", "loop_layer_index_end"}
LAST_INDEX = {"moe_layer_end_index"}
# Layers per block (inkling2: a block boundary every n layers, loop bounds on block
# boundaries): one layer per block, so any cut keeps the bounds on boundaries.
BLOCK = {"n_layers_per_attn_res_block": 1}
# Every n-th layer is sparse: kept as every layer or every other one.
STEP = {"decoder_sparse_step", "moe_layer_interval"}
ENABLE_MOE = ("enable_moe_block", "use_moe")

def _fields(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _head_factor(d: dict[str, Any]) -> int:
    """The power of two that brings the largest head dimension down to HEAD_DIM_TARGET."""
    dims = [v for k, v in d.items() if k in HEAD_DIMS - {"kv_lora_rank", "q_lora_rank",
                                                          "o_lora_rank"} and _is_int(v)]
    top = max(dims, default=HEAD_DIM_TARGET)
    return 2 ** max(0, math.ceil(math.log2(top / HEAD_DIM_TARGET)))


def _scaled(name: str, v: int, factor: int) -> int:
    if name in ("kv_lora_rank", "q_lora_rank", "o_lora_rank"):
        return max(8, min(v // factor, 64))  # a rank, not a head: keep it below hidden
    return max(2, v // factor)


class _Ids:
    """Special token ids moved into the tiny vocabulary: one id keeps one new id across a
    composite config; bos/eos/pad prefer 1/2/0, the others count down from the top."""

    PREFERRED = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}

    def __init__(self) -> None:
        self.map: dict[int, int] = {}
        self.top = VOCAB - 1

    def __call__(self, name: str, v: int) -> int:
        if v in self.map:
            return self.map[v]
        if v < VOCAB and v not in self.map.values():  # already inside, and not taken
            return v
        want = self.PREFERRED.get(name)
        if want is None or want in self.map.values():
            while self.top in self.map.values():
                self.top -= 1
            want = self.top
        self.map[v] = want
        return want


def _layer_count(d: dict[str, Any]) -> tuple[str | None, int]:
    """The field holding the number of layers, and that number."""
    for name in LAYER_COUNT:
        if _is_int(d.get(name)):
            return name, d[name]
    for name in ("layers_block_type", "layer_types"):  # nemotron_h counts its block list
        if isinstance(d.get(name), list):
            return None, len(d[name])
    return None, 0


def _per_layer_lists(d: dict[str, Any], fields: set[str], n: int) -> list[str]:
    """Lists with one entry per layer (``layer_types``, ``mlp_layer_types``, ...)."""
    return [k for k in fields if isinstance(d.get(k), list) and len(d[k]) == n and n > 1
            and not k.endswith("_token_id")]


def _index_lists(d: dict[str, Any], fields: set[str], per_layer: list[str]) -> list[str]:
    """Lists of layer indices (``mlp_only_layers``, ``index_layers`` ...)."""
    return [k for k in fields if k not in per_layer and isinstance(d.get(k), list)
            and (k.endswith("_layers") or k.endswith("_layer_ids"))
            and all(_is_int(x) for x in d[k])]


def _select_layers(d: dict[str, Any], fields: set[str], n: int) -> list[int]:
    """The original layers to keep: the first of each distinct kind, where a layer's kind is
    what every per-layer list, index list and leading/trailing count says about it."""
    per_layer = _per_layer_lists(d, fields, n)
    index_lists = _index_lists(d, fields, per_layer)
    per_layer_cfg = {int(k): repr(sorted(v.items())) for k, v in
                     (d.get("per_layer_config") or {}).items()}

    def kind(i: int) -> tuple:
        sig: list[Any] = []
        for k in sorted(per_layer):
            v = d[k][i]
            sig.append(v == i if k.endswith("_layers") and _is_int(v) else v)  # kv sources
        sig += [i in d[k] for k in sorted(index_lists)]
        sig += [i < d[k] for k in sorted(LEADING) if _is_int(d.get(k))]
        sig += [i >= n - d[k] for k in sorted(TRAILING) if _is_int(d.get(k))]
        sig += [i < d[k] for k in sorted(BOUNDARY) if _is_int(d.get(k))]
        sig += [i <= d[k] for k in sorted(LAST_INDEX) if _is_int(d.get(k))]
        sig += [(i + 1) % d[k] == 0 for k in sorted(STEP) if _is_int(d.get(k)) and d[k] > 0]
        sig.append(per_layer_cfg.get(i))
        return tuple(sig)

    first: dict[tuple, int] = {}
    for i in range(n):
        first.setdefault(kind(i), i)
    keep = sorted(first.values())[:MAX_LAYERS]
    # A family of one kind keeps its first two layers, so that a layer reads another's output
    # and the cache holds more than one layer (layer 0 always starts the first kind).
    return keep if len(keep) > 1 or n < 2 else [0, 1]


def _ensure_full_attention(types: list[Any]) -> list[Any]:
    """A hybrid family whose defaults are all linear attention (granitemoehybrid) gets its last
    kept layer as full attention, so the attention path and its cache are exercised too."""
    if "linear_attention" in types and FULL_ATTENTION not in types:
        return types[:-1] + [FULL_ATTENTION]
    return types


_DEFAULT = object()  # a field left at the class's default


def _shrink_field(name: str, v: Any, d: dict[str, Any], fields: set[str], ids: _Ids,
                  factor: int) -> Any:
    """The tiny value of one field by its name, or _DEFAULT."""
    if isinstance(v, bool):
        return True if name in ENABLE_MOE else _DEFAULT
    if name in EXPERT_COUNT:
        return EXPERTS
    if name in TOP_K:
        return TOPK
    if name in EXPERT_WIDTH:
        return EXPERT_WIDTH[name]
    if v is None:
        if name in SHARED_COUNT:
            return 1
        if name == "head_dim" and "num_attention_heads" in fields:
            return HIDDEN // HEADS  # what hidden / heads gives; hunyuan reads it unguarded
        return _DEFAULT
    if name.endswith(("_token_id", "_token_index")):
        if isinstance(v, list):
            return [ids(name, x) for x in v]
        return ids(name, v) if _is_int(v) else _DEFAULT
    if not _is_int(v):
        return _DEFAULT
    if name in SIZES:
        return min(v, SIZES[name]) if v > 0 else v
    if name in HEAD_DIMS:
        return _scaled(name, v, factor)
    if name in ATTN_HEADS:
        return HEADS
    if name in KV_HEADS:  # multi-head, multi-query and grouped-query attention stay so
        return HEADS if v == d.get(KV_HEADS[name]) else 1 if v == 1 else 2
    if name in OTHER_HEADS:
        return min(v, OTHER_HEADS[name])
    if name in GROUPS:
        return 2 if v > 1 else v
    if name == "topk_group":
        return 1
    return _DEFAULT


def _shrink(cls: type, d: dict[str, Any], ids: _Ids) -> dict[str, Any]:
    """Constructor arguments for a tiny ``cls`` from the default config's ``to_dict`` ``d``."""
    fields = _fields(cls)
    # A field may be stored under its attribute_map alias (bailing_hybrid: n_group is
    # num_expert_group); read the defaults under the field names.
    d = dict(d)
    for field, alias in getattr(cls, "attribute_map", {}).items():
        if field in fields and field not in d and alias in d:
            d[field] = d[alias]
    factor = _head_factor(d)
    kw: dict[str, Any] = {}
    for name in fields:
        value = _shrink_field(name, d.get(name), d, fields, ids, factor)
        if value is not _DEFAULT:
            kw[name] = value
    # Mamba heads follow from the inner width: expand * hidden = heads * head dim.
    for heads, dim, expand in (("mamba_n_heads", "mamba_d_head", "mamba_expand"),
                               ("mamba_num_heads", "mamba_head_dim", "expand")):
        if heads in fields and _is_int(d.get(heads)) and dim in kw:
            kw[heads] = max(1, d.get(expand, 2) * HIDDEN // kw[dim])
    # Token compression rates (deepseek_v4: 4 and 128 tokens per compressed entry) low enough
    # that a short prompt compresses.
    if isinstance(d.get("compress_rates"), dict) and "compress_rates" in fields:
        kw["compress_rates"] = {k: min(v, 8) for k, v in d["compress_rates"].items()}
    if isinstance(d.get("rope_parameters"), dict) and "rope_parameters" in fields:
        kw["rope_parameters"] = _tiny_rope(d["rope_parameters"])
    types = d.get("layer_types") or []
    if "indexed_attention" in types and all(d.get(k) is None for k in INDEXER_UNSET):
        head = kw.get("head_dim", HEAD_DIM_TARGET)
        kw.update({k: head if v is None else v for k, v in INDEXER_UNSET.items() if k in fields})
    _cut_layers(d, fields, kw, factor)
    return kw


def _tiny_rope(rope: dict[str, Any]) -> dict[str, Any]:
    """RoPE scaling keeps its factor against the tiny context: the pre-scaling length becomes
    max positions / factor (YaRN checks the two agree). Nested per-layer-type dicts too."""
    out = {k: _tiny_rope(v) if isinstance(v, dict) else v for k, v in rope.items()}
    if _is_int(out.get("original_max_position_embeddings")) and out.get("factor"):
        out["original_max_position_embeddings"] = max(
            1, int(SIZES["max_position_embeddings"] // out["factor"]))
    return out


def _cut_layers(d: dict[str, Any], fields: set[str], kw: dict[str, Any], factor: int) -> None:
    """Cut the layers to those :func:`_select_layers` keeps: the count, every per-layer list,
    index list, leading/trailing count and boundary remapped to them (into ``kw``)."""
    count_name, n = _layer_count(d)
    if n == 0:
        return
    keep = _select_layers(d, fields, n)
    new = {old: j for j, old in enumerate(keep)}
    if count_name is not None and count_name in fields:
        kw[count_name] = len(keep)
    per_layer = _per_layer_lists(d, fields, n)
    for k in per_layer:
        vals = [d[k][i] for i in keep]
        if k.endswith("_layers"):  # values are layer indices (kv_source_layers)
            vals = [new.get(v, j) for j, v in enumerate(vals)]
        base = max((b for b in kw if k.startswith(b + "_") and _is_int(d.get(b))),
                   key=len, default=None)
        if base is not None and all(_is_int(v) for v in vals):
            # A per-layer copy of a shrunk field (laguna's num_attention_heads_per_layer).
            vals = [max(1, round(kw[base] * v / d[base])) for v in vals]
        kw[k] = _ensure_full_attention(vals) if k in ATTENTION_LISTS else vals
    for k in _index_lists(d, fields, per_layer):
        kw[k] = [new[i] for i in d[k] if i in new]
    for k in LEADING & fields:
        if _is_int(d.get(k)):
            kw[k] = sum(1 for i in keep if i < d[k])
    for k in TRAILING & fields:
        if _is_int(d.get(k)):
            kw[k] = sum(1 for i in keep if i >= n - d[k])
    for k in BOUNDARY & fields:
        if _is_int(d.get(k)):
            kw[k] = sum(1 for i in keep if i < d[k])
    for k in LAST_INDEX & fields:
        if _is_int(d.get(k)):
            kw[k] = max(0, sum(1 for i in keep if i <= d[k]) - 1)
    for k in BLOCK.keys() & fields:
        if _is_int(d.get(k)):
            kw[k] = BLOCK[k]
    for k in STEP & fields:
        if _is_int(d.get(k)) and d[k] > 0:
            kw[k] = min(d[k], 2)
    # Period/offset pairs (jamba): every other layer.
    for k in fields:
        off = k.replace("_period", "_offset")
        if k.endswith("_period") and _is_int(d.get(k)) and _is_int(d.get(off)):
            kw[k], kw[off] = 2, d[off] % 2
    unset = UNSET_LAYER_TYPES.get(d.get("model_type", ""))
    if unset and d.get("layer_types") is None:
        kw["layer_types"] = [unset[j % len(unset)] for j in range(len(keep))]
    plc = d.get("per_layer_config")
    if plc:
        kw["per_layer_config"] = {
            new[int(i)]: _shrink_override(ov, d, kw, factor)
            for i, ov in plc.items() if int(i) in new}


def _shrink_override(ov: dict[str, Any], d: dict[str, Any], kw: dict[str, Any],
                     factor: int) -> dict[str, Any]:
    """A per-layer override shrunk like the global field it overrides: dimensions by the same
    factor, counts in the same ratio to the global value."""
    out = {}
    for k, v in ov.items():
        if not _is_int(v):
            out[k] = v
        elif k in HEAD_DIMS:
            out[k] = _scaled(k, v, factor)
        elif _is_int(d.get(k)) and _is_int(kw.get(k)) and d[k]:
            out[k] = max(1, round(kw[k] * v / d[k]))
        else:
            out[k] = v
    return out


def _tiny(cfg: Any, ids: _Ids) -> Any:
    cls = type(cfg)
    d = cfg.to_dict()
    kw = _shrink(cls, d, ids)
    for name in getattr(cls, "sub_configs", {}) or {}:  # text, vision and audio configs
        sub = getattr(cfg, name, None)
        if sub is not None and hasattr(sub, "to_dict"):
            kw[name] = _tiny(sub, ids)
    return _construct(cls, d, kw)


def _construct(cls: type, d: dict[str, Any], kw: dict[str, Any]) -> Any:
    """``cls(**kw)``; where the class's validation rejects a routing choice by name (zaya's
    router supports top-1 only), that field goes back to its default. Sizes never do: a config
    that rejects them is unavailable tiny."""
    while True:
        try:
            return cls(**kw)
        except (ValueError, StrictDataclassError) as e:
            named = {k for k in ROUTING & kw.keys() if re.search(rf"\b{k}\b", str(e))
                     and k in d and kw[k] != d[k]}
            if not named:
                raise
            kw.update({k: d[k] for k in named})


def tiny_config(model_type: str) -> Any:
    """A tiny config of ``model_type`` derived from its config class's defaults; raises
    :class:`TinyUnavailable` where the class will not take a tiny configuration."""
    from transformers import CONFIG_MAPPING

    try:
        default = CONFIG_MAPPING[model_type]()
    except (ValueError, TypeError, StrictDataclassError) as e:
        raise TinyUnavailable(f"{model_type}: no default config: {_line(e)}") from e
    try:
        return _tiny(default, _Ids())
    except (ValueError, TypeError, StrictDataclassError) as e:
        raise TinyUnavailable(f"{model_type}: its config rejects tiny sizes: {_line(e)}") from e


def _line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


def is_experts(module: torch.nn.Module) -> bool:
    """An instance of a ``@use_experts_implementation`` class (the attributes it sets)."""
    return all(hasattr(module, a) for a in ("has_gate", "is_transposed", "is_concatenated"))


def spread_routers(model: torch.nn.Module, std: float = 1.0) -> list[str]:
    """Redraw every router weight from N(0, std) so that routing varies from token to token
    (the default init's small std sends every token to nearly the same experts). A router is
    the weight beside an experts module with one row per expert, plus the few extra slots
    some routers score (zero experts, a skip slot): [experts (+ extras), hidden], or the output
    layer of an MLP router. Returns the names of the weights redrawn."""
    done = []
    for pname, parent in model.named_modules():
        for experts in [m for m in parent.children() if is_experts(m)]:
            n = getattr(experts, "num_experts", None) or next(experts.parameters()).shape[0]
            for cname, child in parent.named_children():
                if child is experts:
                    continue
                for name, p in child.named_parameters():
                    if name.endswith("weight") and p.dim() == 2 and n <= p.shape[0] <= n + 2:
                        with torch.no_grad():
                            p.normal_(0.0, std)
                        done.append(f"{pname}.{cname}.{name}")
                for name, b in child.named_buffers():
                    # A hash router's token -> experts table (deepseek_v4's tid2eid), zeros
                    # until a checkpoint fills it: distinct random experts per token.
                    if b.dim() == 2 and not b.is_floating_point() and b.shape[1] <= n:
                        rows = torch.rand(b.shape[0], n).argsort(dim=1)[:, :b.shape[1]]
                        b.copy_(rows.to(b.dtype))
                        done.append(f"{pname}.{cname}.{name}")
    return done


def tiny_model(model_type: str, seed: int = 0) -> Any:
    """A random fp32 tiny model of ``model_type`` with spread routers."""
    from transformers import AutoModelForCausalLM

    cfg = tiny_config(model_type)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    spread_routers(model)
    return model.eval()


def tiny_checkpoint(model_type: str, out_dir: str | Path, seed: int = 0) -> Path:
    """``save_pretrained`` of :func:`tiny_model` with a greedy ``generation_config.json``."""
    from transformers import GenerationConfig

    out = Path(out_dir)
    model = tiny_model(model_type, seed)
    model.generation_config = GenerationConfig.from_model_config(model.config)
    model.generation_config.do_sample = False
    model.save_pretrained(out)
    return out
