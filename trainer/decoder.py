"""Inference-side decoder for Mixture-of-Experts checkpoints whose experts live in a store.

:class:`MoEDecoder` holds the dense weights only (embeddings, attention, norms, routers,
dense and shared FFNs, output head). Expert weights come, one MoE layer at a time, from an
:class:`ExpertSource`: every expert resident on the device (:class:`ResidentSource`), each
routed expert read from the store when a layer asks for it (:class:`OnDemandSource`), or a
prefetching ring or expert cache built on the same protocol (``trainer.ring``,
``trainer.expert_mode``).

One implementation covers several families (:data:`SUPPORTED_FAMILIES`): Mixtral, Qwen2-MoE,
OLMoE, Qwen3-MoE as ``transformers`` defines them, and this project's own trainer model
(family ``tierstore``). Their differences are all fields of :class:`DecoderConfig` (router
renormalisation, q/k norms, biases, shared expert, dense layers, tied embeddings), built
from an HF ``config.json`` by :func:`build_from_hf` or from a trainer ``MoEConfig`` by
:func:`config_from_trainer`.

Store layout of a model (written by :mod:`trainer.hf_import`; a trainer run keeps its
experts under the same names and its dense state in its latest checkpoint):

* ``model.json`` (kind ``meta``): UTF-8 JSON as a uint8 tensor, ``{"format": 1, "family",
  "config": DecoderConfig fields, "hf_config", "dense_prefix": "dense.", "tokenizer":
  [file names]}``;
* ``layers.{i}.experts.{e}.w1|w2|w3`` (kind ``param``): gate ``[ffn, hidden]``, down
  ``[hidden, ffn]``, up ``[ffn, hidden]``, in the checkpoint's dtype;
* ``dense.{name}`` (kind ``param``): the decoder's own state-dict names;
* ``tokenizer.{file}`` (kind ``meta``): tokenizer files as uint8 tensors.

Positions follow ``transformers``' generation: with an ``attention_mask`` (left padding), a
token's position is the number of real tokens before it, so a padded prompt computes exactly
what it computes alone.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import tierstore

from .model import RMSNorm, SwiGLU, moe_combine

if TYPE_CHECKING:
    import tokenizers

    from .model import MoEConfig

ExpertWeights = tuple[Tensor, Tensor, Tensor]  # (w1 gate, w2 down, w3 up)

MODEL_ENTRY = ("model.json", "meta")
DENSE_PREFIX = "dense."
TOKENIZER_PREFIX = "tokenizer."
TOKENIZER_KIND = "meta"
MODEL_FORMAT = 1

SUPPORTED_FAMILIES: dict[str, str] = {
    # family (= HF model_type) -> HF architecture
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "olmoe": "OlmoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "tierstore": "checkpoints of tierstore train",
}
HF_FAMILIES = ("mixtral", "qwen2_moe", "olmoe", "qwen3_moe")
_ARCHITECTURES = {SUPPORTED_FAMILIES[f]: f for f in HF_FAMILIES}
QK_NORMS = ("none", "full", "head")  # OLMoE: over the whole projection; Qwen3: per head
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def supported_text() -> str:
    """One line naming what can be loaded, for error messages."""
    return ", ".join(f"{k} ({v})" for k, v in SUPPORTED_FAMILIES.items())


def expert_names(layer: int, e: int) -> tuple[str, str, str]:
    """Store names of one expert's ``(w1, w2, w3)`` (as ``trainer.model.expert_name``)."""
    base = f"layers.{layer}.experts.{e}"
    return f"{base}.w1", f"{base}.w2", f"{base}.w3"


def dtype_of(name: str | torch.dtype | None) -> torch.dtype | None:
    """``"bfloat16"``, ``torch.bfloat16`` or ``None`` -> a torch dtype (or ``None``)."""
    if name is None or isinstance(name, torch.dtype):
        return name
    try:
        return _DTYPES[str(name).removeprefix("torch.")]
    except KeyError:
        raise ValueError(f"unsupported dtype {name!r}; use one of {sorted(_DTYPES)}") from None


# --------------------------------------------------------------------------- configuration


@dataclass(frozen=True)
class DecoderConfig:
    """Everything the forward pass needs; JSON-serialisable through :meth:`to_dict`."""

    family: str
    vocab_size: int
    hidden_size: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    n_experts: int
    top_k: int
    moe_ffn: int  # hidden size of one routed expert
    moe_layers: tuple[int, ...]
    dense_ffn: int  # hidden size of the dense FFN of non-MoE layers
    shared_ffn: int = 0  # 0: no shared expert (Qwen2-MoE has one, gated by a sigmoid)
    rope_theta: float = 10000.0
    rope_scale: float = 1.0  # linear position scaling ("linear" rope type)
    norm_eps: float = 1e-5
    qk_norm: str = "none"  # "none" | "full" (OLMoE) | "head" (Qwen3-MoE)
    qkv_bias: bool = False
    o_bias: bool = False
    clip_qkv: float | None = None  # OLMoE's optional clamp of q, k, v
    norm_topk_prob: bool = True  # renormalise the top-k softmax weights to sum to 1
    tie_embeddings: bool = False
    sliding_windows: tuple[int, ...] = ()  # per layer, 0: full attention; empty: all full
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    max_position: int = 4096
    dtype: str = "float32"  # dtype of the stored weights (the default compute dtype)

    def __post_init__(self) -> None:
        if self.qk_norm not in QK_NORMS:
            raise ValueError(f"qk_norm must be one of {QK_NORMS}, got {self.qk_norm!r}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads {self.n_heads} is not a multiple of n_kv_heads "
                             f"{self.n_kv_heads}")
        if self.head_dim % 2:
            raise ValueError("rotary embeddings need an even head dimension")
        if not 1 <= self.top_k <= self.n_experts:
            raise ValueError(f"top_k must be in 1..n_experts, got {self.top_k}")
        if any(not 0 <= i < self.n_layers for i in self.moe_layers):
            raise ValueError(f"moe_layers {self.moe_layers} outside 0..{self.n_layers - 1}")
        if self.sliding_windows and len(self.sliding_windows) != self.n_layers:
            raise ValueError("sliding_windows needs one entry per layer")
        dtype_of(self.dtype)

    def is_moe(self, layer: int) -> bool:
        return layer in self.moe_layers

    def window(self, layer: int) -> int:
        return self.sliding_windows[layer] if self.sliding_windows else 0

    def expert_bytes(self, dtype: torch.dtype | str | None = None) -> int:
        """Bytes of one expert's three tensors in ``dtype`` (default: the stored dtype)."""
        dt = dtype_of(dtype) or dtype_of(self.dtype)
        assert dt is not None
        return 3 * self.hidden_size * self.moe_ffn * torch.empty((), dtype=dt).element_size()

    def layer_expert_bytes(self, dtype: torch.dtype | str | None = None) -> int:
        """Bytes of every expert of one MoE layer."""
        return self.n_experts * self.expert_bytes(dtype)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for k, v in d.items():
            if isinstance(v, tuple):
                d[k] = list(v)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> DecoderConfig:
        known = {f.name for f in fields(cls)}
        kw = {k: tuple(v) if isinstance(v, list) else v for k, v in d.items() if k in known}
        return cls(**kw)


def _ids(v: Any) -> tuple[int, ...]:
    if v is None:
        return ()
    return tuple(int(x) for x in (v if isinstance(v, list | tuple) else [v]))


def _rope(hf: Mapping[str, Any]) -> tuple[float, float]:
    """(theta, linear scale) from ``rope_parameters`` (transformers 5) or ``rope_theta`` +
    ``rope_scaling`` (older configs); other rope types are refused rather than run wrong."""
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    kind = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if kind == "default":
        return theta, 1.0
    if kind == "linear":
        return theta, float(params.get("factor", scaling.get("factor", 1.0)))
    raise ValueError(f"rope type {kind!r} is not supported (default and linear are)")


def family_of(hf: Mapping[str, Any]) -> str:
    """The family of an HF config dict, or a ValueError naming the supported ones."""
    mt = hf.get("model_type")
    if mt in HF_FAMILIES:
        return str(mt)
    if mt is None:  # some hand-written configs name only the architecture
        for arch in hf.get("architectures") or []:
            fam = _ARCHITECTURES.get(arch)
            if fam:
                return fam
    arch = ", ".join(hf.get("architectures") or []) or "none given"
    raise ValueError(f"unsupported architecture (model_type {mt!r}, architectures {arch}); "
                     f"supported: {supported_text()}")


def build_from_hf(hf_config: Mapping[str, Any]) -> DecoderConfig:
    """A :class:`DecoderConfig` from a ``config.json`` dict of a supported family (raises
    ``ValueError`` naming the supported families for anything else)."""
    hf = hf_config
    family = family_of(hf)
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {hf.get('hidden_act')!r} is not supported (silu is)")
    hidden, n_layers = int(hf["hidden_size"]), int(hf["num_hidden_layers"])
    n_heads = int(hf["num_attention_heads"])
    n_kv = int(hf.get("num_key_value_heads") or n_heads)
    head_dim = int(hf.get("head_dim") or hidden // n_heads)
    theta, scale = _rope(hf)
    windows: tuple[int, ...] = ()
    kw: dict[str, Any] = {}
    if family == "mixtral":
        n_experts, ffn = int(hf["num_local_experts"]), int(hf["intermediate_size"])
        moe_layers = tuple(range(n_layers))
        if hf.get("sliding_window"):
            windows = (int(hf["sliding_window"]),) * n_layers
        kw.update(norm_topk_prob=True)
    else:
        n_experts = int(hf.get("num_experts") or hf.get("num_local_experts"))
        ffn = int(hf.get("moe_intermediate_size") or hf["intermediate_size"])
        if family == "olmoe":
            moe_layers = tuple(range(n_layers))
            kw.update(qk_norm="full", qkv_bias=bool(hf.get("attention_bias", False)),
                      o_bias=bool(hf.get("attention_bias", False)), clip_qkv=hf.get("clip_qkv"))
        else:
            only = set(hf.get("mlp_only_layers") or [])
            step = int(hf.get("decoder_sparse_step", 1) or 1)
            moe_layers = tuple(i for i in range(n_layers)
                               if i not in only and n_experts > 0 and (i + 1) % step == 0)
            if family == "qwen2_moe":
                kw.update(qkv_bias=bool(hf.get("qkv_bias", True)),
                          shared_ffn=int(hf.get("shared_expert_intermediate_size") or 0))
                types = hf.get("layer_types")
                if hf.get("use_sliding_window") and types:
                    w = int(hf.get("sliding_window") or 0)
                    windows = tuple(w if t == "sliding_attention" else 0 for t in types)
            else:  # qwen3_moe
                bias = bool(hf.get("attention_bias", False))
                kw.update(qk_norm="head", qkv_bias=bias, o_bias=bias)
                if hf.get("use_sliding_window") and hf.get("sliding_window"):
                    windows = (int(hf["sliding_window"]),) * n_layers
        kw.setdefault("norm_topk_prob", bool(hf.get("norm_topk_prob", False)))
    if family == "qwen2_moe" and not kw.get("shared_ffn"):
        raise ValueError("qwen2_moe config without shared_expert_intermediate_size")
    if not any(windows):
        windows = ()
    dtype = str(hf.get("dtype") or hf.get("torch_dtype") or "float32")
    return DecoderConfig(
        family=family, vocab_size=int(hf["vocab_size"]), hidden_size=hidden, n_layers=n_layers,
        n_heads=n_heads, n_kv_heads=n_kv, head_dim=head_dim, n_experts=n_experts,
        top_k=int(hf["num_experts_per_tok"]), moe_ffn=ffn, moe_layers=moe_layers,
        dense_ffn=int(hf.get("intermediate_size") or ffn), rope_theta=theta, rope_scale=scale,
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)), sliding_windows=windows,
        eos_token_ids=_ids(hf.get("eos_token_id")), pad_token_id=hf.get("pad_token_id"),
        bos_token_id=hf.get("bos_token_id"),
        max_position=int(hf.get("max_position_embeddings") or 4096),
        dtype=dtype if dtype in _DTYPES else "float32", **kw)


def config_from_trainer(cfg: MoEConfig) -> DecoderConfig:
    """The decoder configuration of a ``trainer.model.MoEConfig`` (family ``tierstore``):
    Mixtral-style routing, full multi-head attention, untied head, byte-level vocabulary."""
    return DecoderConfig(
        family="tierstore", vocab_size=cfg.vocab_size, hidden_size=cfg.d_model,
        n_layers=cfg.n_layers, n_heads=cfg.n_heads, n_kv_heads=cfg.n_heads,
        head_dim=cfg.head_dim, n_experts=cfg.n_experts, top_k=cfg.top_k, moe_ffn=cfg.d_ff,
        moe_layers=tuple(cfg.moe_layers), dense_ffn=cfg.dense_ff, rope_theta=cfg.rope_theta,
        norm_eps=cfg.norm_eps, norm_topk_prob=True, max_position=cfg.max_seq_len,
        dtype="float32")


# --------------------------------------------------------------------------- KV cache


class KVCache:
    """Keys and values of every layer, preallocated ``[batch, n_kv_heads, max_len,
    head_dim]``, plus which cached slots are real tokens (``mask``, from the attention
    masks the forward passes were given). ``length`` is the number of slots filled."""

    def __init__(self, cfg: DecoderConfig, batch: int, max_len: int,
                 device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        dt = dtype or torch.float32
        shape = (batch, cfg.n_kv_heads, max_len, cfg.head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dt) for _ in range(cfg.n_layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dt) for _ in range(cfg.n_layers)]
        self.mask = torch.zeros(batch, max_len, device=device, dtype=torch.bool)
        self.batch, self.max_len = batch, max_len
        self.length = 0

    def reset(self) -> None:
        self.length = 0
        self.mask.zero_()

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)


# --------------------------------------------------------------------------- expert sources


class ExpertSource(Protocol):
    """Where a :class:`MoEDecoder` gets expert weights from, one MoE layer at a time."""

    def begin_pass(self, model: MoEDecoder, n_tokens: int) -> None:
        """A forward pass over ``n_tokens`` tokens (batch x new positions) starts."""

    def experts(self, layer: int, ids: list[int], x: Tensor) -> Mapping[int, ExpertWeights]:
        """The experts in ``ids`` (sorted, unique) of MoE layer ``layer``, on the model's
        device. Looking one up blocks until it is there; the model looks them up in
        ascending id order as it applies them, so a source may return while the later ones
        are still being loaded. ``x`` ``[N, hidden]`` is the normalised hidden state
        those experts will be applied to (a source may apply the NEXT MoE layer's router to
        it to predict and prefetch that layer's experts: ``model.router_topk(next_layer,
        x)``)."""
        ...

    def layer_done(self, layer: int) -> None:
        """``layer``'s experts are no longer needed in this pass."""

    def end_pass(self) -> None:
        """The forward pass is over."""


def _expert_tensors(got: Mapping[Any, Tensor], layer: int, e: int, device: torch.device,
                    dtype: torch.dtype) -> ExpertWeights:
    w1, w2, w3 = (got[n].to(device=device, dtype=dtype) for n in expert_names(layer, e))
    return w1, w2, w3


class ResidentSource:
    """Every expert loaded once onto the model's device (the fully resident model)."""

    def __init__(self, store: tierstore.Store, model: MoEDecoder) -> None:
        self.weights: dict[int, dict[int, ExpertWeights]] = {}
        dev, dt = model.device, model.dtype
        for layer in model.moe_layers:
            names = [n for e in range(model.cfg.n_experts) for n in expert_names(layer, e)]
            got = store.get_many(names)
            self.weights[layer] = {e: _expert_tensors(got, layer, e, dev, dt)
                                   for e in range(model.cfg.n_experts)}

    def nbytes(self) -> int:
        return sum(w.numel() * w.element_size() for layer in self.weights.values()
                   for ws in layer.values() for w in ws)

    def begin_pass(self, model: MoEDecoder, n_tokens: int) -> None:
        pass

    def experts(self, layer: int, ids: list[int], x: Tensor) -> Mapping[int, ExpertWeights]:
        return self.weights[layer]

    def layer_done(self, layer: int) -> None:
        pass

    def end_pass(self) -> None:
        pass


class OnDemandSource:
    """The synchronous baseline: each call reads exactly the routed experts from the store
    (``get_many``), moves them to the device and keeps nothing afterwards."""

    def __init__(self, store: tierstore.Store, model: MoEDecoder | None = None) -> None:
        self.store = store
        self.model = model
        self.loaded_bytes = 0  # bytes moved to the device, for the bandwidth arithmetic
        self.loads = 0  # experts loaded

    def begin_pass(self, model: MoEDecoder, n_tokens: int) -> None:
        self.model = model

    def experts(self, layer: int, ids: list[int], x: Tensor) -> Mapping[int, ExpertWeights]:
        assert self.model is not None, "begin_pass was not called"
        dev, dt = self.model.device, self.model.dtype
        names = [n for e in ids for n in expert_names(layer, e)]
        got = self.store.get_many(names)
        out = {e: _expert_tensors(got, layer, e, dev, dt) for e in ids}
        self.loads += len(ids)
        self.loaded_bytes += sum(t.numel() * t.element_size() for t in got.values())
        return out

    def layer_done(self, layer: int) -> None:
        pass

    def end_pass(self) -> None:
        pass


# --------------------------------------------------------------------------- the decoder


def rope_cos_sin(positions: Tensor, head_dim: int, theta: float, scale: float = 1.0
                 ) -> tuple[Tensor, Tensor]:
    """cos/sin ``[B, T, head_dim]`` (rotate-half layout) for integer ``positions`` ``[B,
    T]``, computed in fp32 the way ``transformers``' default rotary embedding does."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device,
                                             dtype=torch.int64).float() / head_dim))
    inv_freq = inv_freq / scale
    freqs = positions[..., None].float() * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``x`` ``[B, H, T, hd]``; ``cos``/``sin`` are ``[B, T, hd]``."""
    cos, sin = cos.unsqueeze(1).to(x.dtype), sin.unsqueeze(1).to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class Attention(nn.Module):
    """Grouped-query rotary attention with the families' optional q/k norms and biases.
    Projection names follow ``trainer.model.Attention`` so trainer checkpoints load as is."""

    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.cfg = cfg
        h, hd = cfg.hidden_size, cfg.head_dim
        self.wq = nn.Linear(h, cfg.n_heads * hd, bias=cfg.qkv_bias)
        self.wk = nn.Linear(h, cfg.n_kv_heads * hd, bias=cfg.qkv_bias)
        self.wv = nn.Linear(h, cfg.n_kv_heads * hd, bias=cfg.qkv_bias)
        self.wo = nn.Linear(cfg.n_heads * hd, h, bias=cfg.o_bias)
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if cfg.qk_norm == "full":
            self.q_norm = RMSNorm(cfg.n_heads * hd, cfg.norm_eps)
            self.k_norm = RMSNorm(cfg.n_kv_heads * hd, cfg.norm_eps)
        elif cfg.qk_norm == "head":
            self.q_norm = RMSNorm(hd, cfg.norm_eps)
            self.k_norm = RMSNorm(hd, cfg.norm_eps)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, allowed: Tensor,
                cache: KVCache | None, layer: int, start: int) -> Tensor:
        cfg = self.cfg
        b, t, _ = x.shape
        q, k, v = self.wq(x), self.wk(x), self.wv(x)
        if cfg.qk_norm == "full":
            assert self.q_norm is not None and self.k_norm is not None
            q, k = self.q_norm(q), self.k_norm(k)
        if cfg.clip_qkv is not None:
            c = float(cfg.clip_qkv)
            q, k, v = q.clamp(-c, c), k.clamp(-c, c), v.clamp(-c, c)
        q = q.view(b, t, cfg.n_heads, cfg.head_dim)
        k = k.view(b, t, cfg.n_kv_heads, cfg.head_dim)
        v = v.view(b, t, cfg.n_kv_heads, cfg.head_dim).transpose(1, 2)
        if cfg.qk_norm == "head":
            assert self.q_norm is not None and self.k_norm is not None
            q, k = self.q_norm(q), self.k_norm(k)
        q = _rotate(q.transpose(1, 2), cos, sin)
        k = _rotate(k.transpose(1, 2), cos, sin)
        if cache is not None:
            ck, cv = cache.k[layer], cache.v[layer]
            ck[:, :, start:start + t] = k.to(ck.dtype)
            cv[:, :, start:start + t] = v.to(cv.dtype)
            k, v = ck[:, :, :start + t].to(q.dtype), cv[:, :, :start + t].to(q.dtype)
        rep = cfg.n_heads // cfg.n_kv_heads
        if rep > 1:
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
        return self.wo(y.transpose(1, 2).reshape(b, t, cfg.n_heads * cfg.head_dim))


class Layer(nn.Module):
    """Pre-norm block: RMSNorm -> attention -> RMSNorm -> dense FFN or routed experts (plus
    Qwen2-MoE's sigmoid-gated shared expert). Names match ``trainer.model.Block``."""

    def __init__(self, cfg: DecoderConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.is_moe = cfg.is_moe(layer)
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.router: nn.Linear | None = None
        self.mlp: SwiGLU | None = None
        self.shared: SwiGLU | None = None
        self.shared_gate: nn.Linear | None = None
        if self.is_moe:
            self.router = nn.Linear(cfg.hidden_size, cfg.n_experts, bias=False)
            if cfg.shared_ffn:
                self.shared = SwiGLU(cfg.hidden_size, cfg.shared_ffn)
                self.shared_gate = nn.Linear(cfg.hidden_size, 1, bias=False)
        else:
            self.mlp = SwiGLU(cfg.hidden_size, cfg.dense_ffn)


class MoEDecoder(nn.Module):
    """The dense part of an MoE decoder; experts come from an :class:`ExpertSource`."""

    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.moe_layers: list[int] = list(cfg.moe_layers)
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Layer(cfg, i) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.lm_head: nn.Linear | None = None
        if not cfg.tie_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    @property
    def device(self) -> torch.device:
        return self.tok_emb.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.tok_emb.weight.dtype

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        """A KV cache on the model's device and in its dtype."""
        return KVCache(self.cfg, batch, max_len, self.device, self.dtype)

    def next_moe_layer(self, layer: int) -> int | None:
        """The first MoE layer after ``layer``, or ``None``."""
        return next((i for i in self.moe_layers if i > layer), None)

    @torch.no_grad()
    def router_topk(self, layer: int, x: Tensor) -> tuple[Tensor, Tensor]:
        """``(ids [N, k] int64, weights [N, k] fp32)`` of MoE layer ``layer`` for normalised
        hidden states ``x`` ``[N, hidden]``: softmax over all experts in fp32, top-k, then
        renormalised over the k when the family does (``norm_topk_prob``)."""
        router = self.layers[layer].router
        if router is None:
            raise ValueError(f"layer {layer} is not an MoE layer")
        logits = F.linear(x, router.weight)
        probs = logits.float().softmax(dim=-1)
        w, ids = probs.topk(self.cfg.top_k, dim=-1)
        if self.cfg.norm_topk_prob:
            w = w / w.sum(dim=-1, keepdim=True)
        return ids, w

    def _positions(self, mask: Tensor, t: int) -> Tensor:
        # transformers' generate: the number of real tokens before each one (0 for padding).
        pos = mask.long().cumsum(-1) - 1
        return pos.masked_fill(~mask, 0)[:, -t:]

    def _allowed(self, mask: Tensor, start: int, t: int, window: int) -> Tensor:
        """Boolean ``[B, 1, T, L]``: causal, real keys only, within the sliding window. A
        query may always see itself, so a padding row never becomes all -inf (NaN)."""
        total = mask.shape[1]
        q = torch.arange(start, start + t, device=mask.device)[:, None]
        kpos = torch.arange(total, device=mask.device)[None, :]
        ok = kpos <= q
        if window:
            ok = ok & (kpos > q - window)
        allowed = ok[None] & mask[:, None, :]
        allowed = allowed | (kpos == q)[None]
        return allowed[:, None]

    @torch.no_grad()
    def forward(self, ids: Tensor, experts: ExpertSource, cache: KVCache | None = None,
                attention_mask: Tensor | None = None) -> Tensor:
        """``ids`` ``[B, T]`` -> logits ``[B, T, V]`` fp32.

        ``attention_mask`` ``[B, cache.length + T]`` marks real tokens with 1 and left
        padding with 0 (``[B, T]`` is taken as the new tokens' part, the cached ones keeping
        theirs); positions and the attention pattern follow from it. Without it, every
        token is real, or, with a cache, the new tokens are real and the cached ones keep
        the mask they were given. With a cache, the new keys and values are appended and
        ``cache.length`` advances by T.
        """
        cfg = self.cfg
        b, t = ids.shape
        start = cache.length if cache is not None else 0
        dev = ids.device
        if cache is not None:
            if cache.batch != b:
                raise ValueError(f"cache holds batch {cache.batch}, ids have {b}")
            if start + t > cache.max_len:
                raise ValueError(f"cache of {cache.max_len} tokens cannot take {start + t}")
        if attention_mask is not None:
            am = attention_mask.to(device=dev).bool()
            if cache is not None and start and am.shape == (b, t):
                am = torch.cat([cache.mask[:, :start], am], dim=1)  # the new tokens' part only
            if am.shape != (b, start + t):
                raise ValueError(f"attention_mask must be [{b}, {start + t}], got "
                                 f"{list(am.shape)}")
        elif cache is not None:
            am = torch.cat([cache.mask[:, :start],
                            torch.ones(b, t, dtype=torch.bool, device=dev)], dim=1)
        else:
            am = torch.ones(b, t, dtype=torch.bool, device=dev)
        if cache is not None:
            cache.mask[:, :start + t] = am
        pos = self._positions(am, t)
        cos, sin = rope_cos_sin(pos, cfg.head_dim, cfg.rope_theta, cfg.rope_scale)
        masks: dict[int, Tensor] = {}
        experts.begin_pass(self, b * t)
        try:
            x = self.tok_emb(ids)
            for i, layer in enumerate(self.layers):
                w = cfg.window(i)
                if w not in masks:
                    masks[w] = self._allowed(am, start, t, w)
                x = x + layer.attn(layer.attn_norm(x), cos, sin, masks[w], cache, i, start)
                h = layer.ffn_norm(x)
                if layer.mlp is not None:
                    x = x + layer.mlp(h)
                else:
                    x = x + self._moe(layer, h, experts).view_as(x)
        finally:
            experts.end_pass()
        if cache is not None:
            cache.length = start + t
        x = self.norm(x)
        head = self.tok_emb.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(x, head).float()

    def _moe(self, layer: Layer, h: Tensor, experts: ExpertSource) -> Tensor:
        flat = h.reshape(-1, h.shape[-1])
        ids, w = self.router_topk(layer.layer, flat)
        wanted = torch.unique(ids).tolist()
        got = experts.experts(layer.layer, wanted, flat)
        y = moe_combine(flat, ids, w, got)
        experts.layer_done(layer.layer)
        if layer.shared is not None:
            assert layer.shared_gate is not None
            y = y + torch.sigmoid(layer.shared_gate(flat)) * layer.shared(flat)
        return y

    def dense_state(self) -> dict[str, Tensor]:
        """The state dict as stored under ``dense.`` (every weight: there are no experts)."""
        return dict(self.state_dict())


# --------------------------------------------------------------------------- loading


def read_json_entry(store: tierstore.Store, name: str, kind: str = "meta") -> Any:
    return json.loads(store.get(name, kind).numpy().tobytes())


def json_entry(obj: Any) -> Tensor:
    """A JSON-serialisable object as a uint8 tensor (how ``model.json`` is stored)."""
    raw = bytearray(json.dumps(obj, sort_keys=True).encode())
    return torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.zeros(0, dtype=torch.uint8)


def model_info(store: tierstore.Store) -> dict[str, Any]:
    """``model.json`` of the store, or for a trainer run the equivalent built from its
    latest checkpoint (family ``tierstore``); :class:`tierstore.StoreError` if neither."""
    if MODEL_ENTRY in store:
        return read_json_entry(store, *MODEL_ENTRY)
    payload = _trainer_payload(store)
    from .model import MoEConfig

    cfg = config_from_trainer(MoEConfig.from_dict(payload["model_config"]))
    return {"format": MODEL_FORMAT, "family": "tierstore", "config": cfg.to_dict(),
            "hf_config": None, "dense_prefix": DENSE_PREFIX, "tokenizer": [],
            "step": int(payload["step"])}


def _trainer_payload(store: tierstore.Store) -> dict[str, Any]:
    from .store_trainer import DENSE_ENTRY, _unpack, checkpoint_steps

    if DENSE_ENTRY not in store:
        raise tierstore.StoreError(
            f"store {store.path} holds no model: import one with `tierstore import-hf` or "
            f"train one with `tierstore train` (supported: {supported_text()})")
    # The live dense entry is the latest checkpoint's: it is written right before the
    # snapshot, and training only moves forward from there.
    payload = _unpack(store.get(*DENSE_ENTRY))
    steps = checkpoint_steps(store)
    if steps and payload.get("step") != steps[-1]:
        raise tierstore.StoreError(f"store {store.path}: dense state of step "
                                   f"{payload.get('step')} but latest checkpoint is {steps[-1]}")
    return payload


def load_config(store: tierstore.Store) -> DecoderConfig:
    return DecoderConfig.from_dict(model_info(store)["config"])


def load_model(store: tierstore.Store, device: torch.device | str = "cpu",
               dtype: torch.dtype | str | None = None) -> MoEDecoder:
    """The dense part of the store's model on ``device`` in ``dtype`` (default: the stored
    dtype), in eval mode. Experts stay in the store; pass an :class:`ExpertSource`."""
    info = model_info(store)
    cfg = DecoderConfig.from_dict(info["config"])
    dt = dtype_of(dtype) or dtype_of(cfg.dtype) or torch.float32
    with torch.device("meta"):
        model = MoEDecoder(cfg)
    if info["family"] == "tierstore":
        state = {k: v for k, v in _trainer_payload(store)["model"].items()
                 if ".experts." not in k and not k.startswith("rope_")}
    else:
        prefix = info.get("dense_prefix", DENSE_PREFIX)
        names = store.names(prefix, kind="param")
        state = {n[len(prefix):]: t for n, t in store.get_many(names).items()}
    expected = set(model.state_dict())
    missing, extra = expected - set(state), set(state) - expected
    if missing or extra:
        raise tierstore.StoreError(
            f"store {store.path}: dense weights do not fit the {cfg.family} config "
            f"(missing {sorted(missing)[:5]}, unexpected {sorted(extra)[:5]})")
    model.load_state_dict({k: v.to(dtype=dt) for k, v in state.items()}, assign=True)
    return model.to(device=device).eval()


def load_tokenizer(store: tierstore.Store) -> tokenizers.Tokenizer | None:
    """The store's ``tokenizer.json`` as a ``tokenizers.Tokenizer``; ``None`` when the model
    has no tokenizer (a trainer run is byte-level: token ids are bytes)."""
    name = TOKENIZER_PREFIX + "tokenizer.json"
    if (name, TOKENIZER_KIND) not in store:
        return None
    import tokenizers

    return tokenizers.Tokenizer.from_str(store.get(name, TOKENIZER_KIND).numpy().tobytes()
                                         .decode())


def tokenizer_files(store: tierstore.Store) -> dict[str, bytes]:
    """Every stored tokenizer file, by its original file name."""
    names = store.names(TOKENIZER_PREFIX, kind=TOKENIZER_KIND)
    return {n[len(TOKENIZER_PREFIX):]: store.get(n, TOKENIZER_KIND).numpy().tobytes()
            for n in names}


def stop_tokens(cfg: DecoderConfig, extra: Sequence[int] = ()) -> tuple[int, ...]:
    """End-of-sequence ids of the model plus ``extra``."""
    return tuple(dict.fromkeys((*cfg.eos_token_ids, *extra)))
