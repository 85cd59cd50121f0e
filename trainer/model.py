"""A decoder-only Mixture-of-Experts transformer in one file: the model of the trainer's
presets.

Pre-norm blocks: RMSNorm -> causal rotary attention (grouped-query where ``n_kv_heads`` is
below ``n_heads``) -> RMSNorm -> FFN, where the FFN of an MoE layer is a top-k routed bank
of SwiGLU experts with Mixtral's renormalised routing and that of the other layers one dense
SwiGLU. The trainer's presets (:mod:`trainer.presets`) produce its :class:`ModelConfig`.
Hugging Face checkpoints run (and fine-tune) as their own ``transformers`` classes through
the :mod:`tierstore.hf` experts backend, not through this model.

Expert weights never have to be module parameters. An MoE layer routes its tokens, asks an
:class:`ExpertSource` for exactly the experts it routed to, and :func:`moe_combine` runs the
tokens through whatever weights come back (``expert_id -> (w1, w2, w3)``). Training, the
source is the resident banks (:class:`ExpertBank`, parameters named like the store's entries,
``layers.{i}.experts.{e}.w1|w2|w3``), a store-backed trainer's provider, or an expert-parallel
source. Every path runs the same code, so they agree bit for bit.

:meth:`MoEModel.forward` trains: causal attention over whole sequences, the Switch
load-balancing loss and the ST-MoE router z-loss, fp32 master weights computing in ``dtype``
through autocast (rotary tables and router logits in the weights' dtype, so fp32). Serving a
trained model is ``transformers``': a run loads as the Mixtral or Qwen2-MoE that computes
what this model does (:mod:`tierstore.hf.trainer_runs`).

Weight layouts follow ``nn.Linear`` (and Mixtral): ``w1``/``w3`` are ``[ffn, hidden]``
(gate and up projections), ``w2`` is ``[hidden, ffn]`` (down projection).
"""

# Over 600 lines: the presets' one model and its training pass, read best whole.
from __future__ import annotations

import abc
import hashlib
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

if TYPE_CHECKING:
    from .presets import MoEConfig

EXPERT_WEIGHTS = ("w1", "w2", "w3")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# One expert's tensors: (w1 gate, w2 down, w3 up) in this model; an experts module's entries,
# in the order its ExpertLayer names them, under tierstore.hf.
ExpertWeights = tuple[Tensor, ...]
# provider(layer_index, sorted expert ids) -> {expert_id: (w1, w2, w3)}
ExpertProvider = Callable[[int, list[int]], Mapping[int, ExpertWeights]]
CountReducer = Callable[[Tensor], Tensor]  # sums per-expert counts over data-parallel ranks


def dtype_of(name: str | torch.dtype | None) -> torch.dtype | None:
    """``"bfloat16"``, ``torch.bfloat16`` or ``None`` -> a torch dtype (or ``None``)."""
    if name is None or isinstance(name, torch.dtype):
        return name
    try:
        return DTYPES[str(name).removeprefix("torch.")]
    except KeyError:
        raise ValueError(f"unsupported dtype {name!r}; use one of {sorted(DTYPES)}") from None


def expert_name(layer: int, expert: int, weight: str) -> str:
    """The store name of one expert weight: ``layers.{layer}.experts.{expert}.{weight}``."""
    if weight not in EXPERT_WEIGHTS:
        raise ValueError(f"expert weight must be one of {EXPERT_WEIGHTS}, got {weight!r}")
    return f"layers.{layer}.experts.{expert}.{weight}"


def expert_names(layer: int, expert: int) -> tuple[str, str, str]:
    """Store names of one expert's ``(w1, w2, w3)``."""
    base = f"layers.{layer}.experts.{expert}"
    return f"{base}.w1", f"{base}.w2", f"{base}.w3"


# --------------------------------------------------------------------------- configuration


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a :class:`MoEModel`; JSON-serialisable through :meth:`to_dict`.

    ``dtype`` is the compute dtype: inference holds the weights in it (by default: the
    stored dtype), training holds fp32 master weights and computes in it through autocast.
    """

    family: str  # "tierstore"
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
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    max_position: int = 4096
    dtype: str = "float32"
    router_aux_coef: float = 0.01  # training: Switch load-balancing loss weight
    router_z_coef: float = 0.001  # training: ST-MoE router z-loss weight
    init_std: float = 0.02  # training: std of the initial weights

    def __post_init__(self) -> None:
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads {self.n_heads} is not a multiple of n_kv_heads "
                             f"{self.n_kv_heads}")
        if self.head_dim % 2:
            raise ValueError("rotary embeddings need an even head dimension")
        if not 1 <= self.top_k <= self.n_experts:
            raise ValueError(f"top_k must be in 1..n_experts, got {self.top_k}")
        if any(not 0 <= i < self.n_layers for i in self.moe_layers):
            raise ValueError(f"moe_layers {self.moe_layers} outside 0..{self.n_layers - 1}")
        dtype_of(self.dtype)

    def is_moe(self, layer: int) -> bool:
        return layer in self.moe_layers

    def expert_shapes(self) -> dict[str, tuple[int, int]]:
        return {"w1": (self.moe_ffn, self.hidden_size), "w2": (self.hidden_size, self.moe_ffn),
                "w3": (self.moe_ffn, self.hidden_size)}

    def to_dict(self) -> dict[str, Any]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ModelConfig:
        known = {f.name for f in fields(cls)}
        return cls(**{k: tuple(v) if isinstance(v, list) else v
                      for k, v in d.items() if k in known})


def model_config(cfg: ModelConfig | MoEConfig) -> ModelConfig:
    """``cfg`` itself, or the :class:`ModelConfig` a trainer preset stands for."""
    return cfg if isinstance(cfg, ModelConfig) else cfg.model_config()


# --------------------------------------------------------------------------- initialisation


def _seed_for(*parts: object) -> int:
    """A 63-bit seed from a tuple, so every expert has its own reproducible stream and can
    be created alone (a store-backed trainer initialises experts one at a time)."""
    digest = hashlib.sha256("/".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def init_expert(cfg: ModelConfig | MoEConfig, seed: int, layer: int, expert: int
                ) -> ExpertWeights:
    """The initial fp32 ``(w1, w2, w3)`` of one expert; identical however the model is held."""
    g = torch.Generator().manual_seed(_seed_for("expert", seed, layer, expert))
    shapes = cfg.expert_shapes()
    out_std = cfg.init_std / math.sqrt(2 * cfg.n_layers)  # residual projection (GPT-2)
    w1 = torch.empty(shapes["w1"]).normal_(0.0, cfg.init_std, generator=g)
    w2 = torch.empty(shapes["w2"]).normal_(0.0, out_std, generator=g)
    w3 = torch.empty(shapes["w3"]).normal_(0.0, cfg.init_std, generator=g)
    return w1, w2, w3


def _init_dense_(model: nn.Module, cfg: ModelConfig, seed: int) -> None:
    g = torch.Generator().manual_seed(_seed_for("dense", seed))
    out_std = cfg.init_std / math.sqrt(2 * cfg.n_layers)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".experts." in name:
                continue
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(("attn.wo.weight", "mlp.w2")):
                p.normal_(0.0, out_std, generator=g)
            else:
                p.normal_(0.0, cfg.init_std, generator=g)


# --------------------------------------------------------------------------- attention


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        # Normalise in fp32 whatever the compute dtype: the mean of squares loses precision.
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * self.weight).to(x.dtype)


def rope_cos_sin(positions: Tensor, head_dim: int, theta: float) -> tuple[Tensor, Tensor]:
    """cos/sin ``[B, T, head_dim]`` fp32 for integer ``positions`` ``[B, T]``, in the
    rotate-half layout (Llama, Mixtral: their weights need no permutation), computed the
    way ``transformers``' default rotary embedding does."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device,
                                             dtype=torch.int64).float() / head_dim))
    freqs = positions[..., None].float() * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``x`` ``[B, H, T, hd]`` by position (``cos``/``sin`` ``[B, 1, T, hd]``), in
    the wider of the two dtypes; the result has ``x``'s."""
    x1, x2 = x.chunk(2, dim=-1)
    return (x * cos + torch.cat((-x2, x1), dim=-1) * sin).to(x.dtype)


class Attention(nn.Module):
    """Grouped-query rotary attention."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        h, hd = cfg.hidden_size, cfg.head_dim
        self.wq = nn.Linear(h, cfg.n_heads * hd, bias=False)
        self.wk = nn.Linear(h, cfg.n_kv_heads * hd, bias=False)
        self.wv = nn.Linear(h, cfg.n_kv_heads * hd, bias=False)
        self.wo = nn.Linear(cfg.n_heads * hd, h, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """Causal attention over ``x``."""
        cfg = self.cfg
        b, t, _ = x.shape
        q, k, v = self.wq(x), self.wk(x), self.wv(x)
        q = q.view(b, t, cfg.n_heads, cfg.head_dim)
        k = k.view(b, t, cfg.n_kv_heads, cfg.head_dim)
        v = v.view(b, t, cfg.n_kv_heads, cfg.head_dim).transpose(1, 2)
        q = apply_rope(q.transpose(1, 2), cos, sin)
        k = apply_rope(k.transpose(1, 2), cos, sin)
        rep = cfg.n_heads // cfg.n_kv_heads
        if rep > 1:
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, cfg.n_heads * cfg.head_dim))


# --------------------------------------------------------------------------- experts


def expert_forward(x: Tensor, w1: Tensor, w2: Tensor, w3: Tensor) -> Tensor:
    """One SwiGLU FFN with explicit weights: ``w2 · (silu(w1 · x) * (w3 · x))``."""
    return F.linear(F.silu(F.linear(x, w1)) * F.linear(x, w3), w2)


class SwiGLU(nn.Module):
    """The dense FFN of non-MoE layers (an expert's function)."""

    def __init__(self, d_model: int, d_ff: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(d_ff, d_model))
        self.w2 = nn.Parameter(torch.empty(d_model, d_ff))
        self.w3 = nn.Parameter(torch.empty(d_ff, d_model))

    def forward(self, x: Tensor) -> Tensor:
        return expert_forward(x, self.w1, self.w2, self.w3)


class Expert(nn.Module):
    def __init__(self, weights: ExpertWeights) -> None:
        super().__init__()
        self.w1, self.w2, self.w3 = (nn.Parameter(w) for w in weights)


class ExpertBank(nn.ModuleList):
    """Every expert of one layer as parameters (the resident mode).

    A list of one module per expert, so parameter names are ``{e}.w1`` and so on under the
    block's ``experts`` (``layers.{i}.experts.{e}.w1``, the store's names), and an expert
    that received no token has ``grad is None``: ``torch.optim.AdamW`` then skips it, which is
    the same lazy semantics the store-backed trainer implements.
    """

    def __init__(self, cfg: ModelConfig, seed: int | None, layer: int) -> None:
        def weights(e: int) -> ExpertWeights:
            if seed is not None:
                return init_expert(cfg, seed, layer, e)
            w1, w2, w3 = (torch.empty(s) for s in cfg.expert_shapes().values())  # to be loaded
            return w1, w2, w3

        super().__init__(Expert(weights(e)) for e in range(cfg.n_experts))

    def weights(self, ids: Sequence[int]) -> dict[int, ExpertWeights]:
        """``{e: (w1, w2, w3)}`` for the given expert ids, as :func:`moe_combine` takes."""
        out: dict[int, ExpertWeights] = {}
        for e in ids:
            ex = self[e]
            out[e] = (ex.w1, ex.w2, ex.w3)
        return out


class Routing(NamedTuple):
    topk_idx: Tensor  # [T, k] int64 expert ids
    topk_weight: Tensor  # [T, k] fp32 mixing weights (rows sum to 1 when renormalised)
    aux_loss: Tensor | None  # Switch load-balancing loss (1.0 when perfectly balanced)
    z_loss: Tensor | None  # mean squared log-sum-exp of the router logits


def route(x: Tensor, router_weight: Tensor, top_k: int, losses: bool = True,
          reduce: CountReducer | None = None) -> Routing:
    """Top-k softmax routing of tokens ``x`` ``[T, D]``; ``losses=False`` leaves the
    router losses out (``None``). ``reduce`` sums the expert assignment counts over every
    data-parallel rank (see :attr:`ExpertSource.count_reducer`).

    Logits are computed in the router weight's dtype outside autocast (fp32 for a trainer's
    master weights: small logit differences decide which experts a token gets, and bf16
    would turn ties into noise), the softmax over all experts in fp32. The top-k weights
    are renormalised over the chosen k (Mixtral), i.e. a softmax over the top-k logits.
    """
    n_experts = router_weight.shape[0]
    dev = x.device.type
    with (torch.autocast(device_type=dev, enabled=False) if torch.is_autocast_enabled(dev)
          else nullcontext()):
        logits = F.linear(x.to(router_weight.dtype), router_weight).float()
        probs = logits.softmax(dim=-1)
        topk_weight, topk_idx = probs.topk(top_k, dim=-1)
        topk_weight = topk_weight / topk_weight.sum(dim=-1, keepdim=True)
        if not losses:
            return Routing(topk_idx, topk_weight, None, None)
        # Switch loss: n_experts * sum_e f_e * P_e, with f_e the share of the T*k assignments
        # that went to expert e (no gradient) and P_e the mean router probability of e.
        counts = torch.zeros(n_experts, device=x.device, dtype=torch.float32)
        counts.scatter_add_(0, topk_idx.reshape(-1),
                            torch.ones(topk_idx.numel(), device=x.device))
        if reduce is None:
            frac = counts / topk_idx.numel()
        else:  # the global batch's shares: each rank's P_e is its own tokens' mean
            counts = reduce(counts)
            frac = counts / counts.sum()
        aux = n_experts * torch.sum(frac * probs.mean(dim=0))
        z = torch.logsumexp(logits, dim=-1).pow(2).mean()
    return Routing(topk_idx, topk_weight, aux, z)


def moe_combine(x: Tensor, topk_idx: Tensor, topk_weight: Tensor,
                weights: Mapping[int, ExpertWeights]) -> Tensor:
    """Mix the routed experts' outputs: ``y_t = sum_j topk_weight[t, j] * E_{idx[t, j]}(x_t)``.

    ``x`` is ``[T, D]``; ``weights`` maps at least every routed expert id to its
    ``(w1, w2, w3)`` (extra entries are ignored). Experts run in ascending id order on their
    gathered tokens, each looked up just before it runs (a source may still be loading the
    later ones), and outputs go back to their slots by a gather with unique indices, so
    the result does not depend on the mapping's order and is deterministic on every device.
    """
    n_tok, k = topk_idx.shape
    flat = topk_idx.reshape(-1)
    order = torch.argsort(flat, stable=True)  # slots grouped by expert, ascending ids
    ids, counts = torch.unique_consecutive(flat[order], return_counts=True)
    token_of = order // k
    pieces = []
    start = 0
    for e, c in zip(ids.tolist(), counts.tolist()):
        if e not in weights:  # not a lookup's KeyError: a source's own errors pass through
            raise KeyError(f"expert {e} was routed to but its weights were not supplied")
        w1, w2, w3 = weights[e]
        rows = token_of[start:start + c]
        pieces.append(expert_forward(x[rows], w1, w2, w3))
        start += c
    y_sorted = torch.cat(pieces)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    y = y_sorted[inverse].view(n_tok, k, -1)
    return (y.float() * topk_weight.unsqueeze(-1)).sum(dim=1).to(x.dtype)


class RoutedExperts(Mapping[int, ExpertWeights]):
    """A layer's routed experts, ``ids``, whose weights a source finds as the model looks
    each one up (in ascending id order): a subclass gives :meth:`__getitem__`; membership,
    order and length are the ids'."""

    def __init__(self, ids: Sequence[int]) -> None:
        self._ids = list(ids)
        self._wanted = frozenset(self._ids)

    def __contains__(self, e: object) -> bool:
        return e in self._wanted

    def __iter__(self) -> Iterator[int]:
        return iter(self._ids)

    def __len__(self) -> int:
        return len(self._ids)


class ExpertSource(abc.ABC):
    """Where a model gets expert weights from, one MoE layer at a time. A source implements
    :meth:`experts`; the other hooks do nothing unless it needs them to.

    An expert-parallel source also overrides :meth:`moe` (tokens go to the experts' owners
    instead of weights coming here) and sets :attr:`count_reducer`."""

    #: Sums a tensor of per-expert assignment counts over every data-parallel rank (no
    #: gradient), so the load-balancing loss sees the global batch's routing; ``None``:
    #: this process holds the whole batch.
    count_reducer: CountReducer | None = None

    def prepare(self, model: MoEModel) -> None:  # noqa: B027 (a hook; most sources need nothing here)
        """Called once before the first pass, outside any pass's time (``generate`` calls
        it before its clock starts): take what the source holds for its whole life, such as
        memory of its own. It must read no expert, or the first pass's reads would be
        timed short."""

    def begin_pass(self, model: MoEModel, n_tokens: int) -> None:  # noqa: B027 (a hook; most sources need nothing here)
        """A forward pass over ``n_tokens`` tokens (batch x new positions) starts."""

    @abc.abstractmethod
    def experts(self, layer: int, ids: list[int], x: Tensor) -> Mapping[int, ExpertWeights]:
        """The experts in ``ids`` (sorted, unique) of MoE layer ``layer``, on the model's
        device. Looking one up blocks until it is there; the model looks them up in
        ascending id order as it applies them, so a source may return while the later ones
        are still being loaded. ``x`` ``[N, hidden]`` is the normalised hidden state
        those experts will be applied to (a source may apply the NEXT MoE layer's router to
        it to predict and prefetch that layer's experts: ``model.router_topk(next_layer,
        x)``)."""

    def moe(self, layer: int, x: Tensor, routing: Routing) -> Tensor:
        """MoE layer ``layer``'s routed experts applied to ``x`` ``[N, hidden]`` and mixed
        by ``routing``'s weights (:func:`moe_combine` over :meth:`experts`' weights)."""
        ids = torch.unique(routing.topk_idx).tolist()
        return moe_combine(x, routing.topk_idx, routing.topk_weight,
                           self.experts(layer, ids, x))

    def layer_done(self, layer: int) -> None:  # noqa: B027 (a hook; most sources need nothing here)
        """``layer``'s experts are no longer needed in this pass."""

    def end_pass(self) -> None:  # noqa: B027 (a hook; most sources need nothing here)
        """The forward pass is over."""

    def final_pass(self) -> None:  # noqa: B027 (a hook; most sources need nothing here)
        """The next pass is the last one (nothing needs loading beyond it)."""

    def stats(self) -> dict[str, Any]:
        """What the source measured (``stall_s``, ``hit_rate``, ...; empty: nothing)."""
        return {}

    def close(self) -> None:  # noqa: B027 (a hook; most sources need nothing here)
        """Give back whatever the source holds."""


class _TrainingExperts(ExpertSource):
    """The trainer's experts: a provider's (a store-backed trainer) or the resident banks."""

    def __init__(self, model: MoEModel, provider: ExpertProvider | None) -> None:
        self.model, self.provider = model, provider

    def experts(self, layer: int, ids: list[int], x: Tensor) -> Mapping[int, ExpertWeights]:
        if self.provider is not None:
            return self.provider(layer, ids)
        bank = self.model.layers[layer].experts
        if bank is None:
            raise RuntimeError(
                f"layer {layer} holds no experts: pass experts=provider to forward()")
        return bank.weights(ids)


# --------------------------------------------------------------------------- the model


class Block(nn.Module):
    """One transformer layer. MoE layers carry ``router`` and (when resident) ``experts``;
    dense layers carry ``mlp``."""

    def __init__(self, cfg: ModelConfig, layer: int, seed: int | None = None,
                 resident_experts: bool = False) -> None:
        super().__init__()
        self.cfg, self.layer = cfg, layer
        self.is_moe = cfg.is_moe(layer)
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.router: nn.Linear | None = None
        self.experts: ExpertBank | None = None
        self.mlp: SwiGLU | None = None
        if self.is_moe:
            self.router = nn.Linear(cfg.hidden_size, cfg.n_experts, bias=False)
            if resident_experts:
                self.experts = ExpertBank(cfg, seed, layer)
        else:
            self.mlp = SwiGLU(cfg.hidden_size, cfg.dense_ffn)

    def route(self, x: Tensor, losses: bool = True, reduce: CountReducer | None = None
              ) -> Routing:
        """Routing of tokens ``x`` ``[T, D]`` (already normalised by ``ffn_norm``)."""
        if self.router is None:
            raise RuntimeError(f"layer {self.layer} is a dense layer and has no router")
        return route(x, self.router.weight, self.cfg.top_k, losses, reduce)

    def moe(self, h: Tensor, experts: ExpertSource, losses: bool = True
            ) -> tuple[Tensor, Routing]:
        """The MoE FFN of normalised ``h``, with the routed experts ``experts`` supplies."""
        flat = h.reshape(-1, h.shape[-1])
        r = self.route(flat, losses, experts.count_reducer)
        y = experts.moe(self.layer, flat, r)
        experts.layer_done(self.layer)
        return y.view_as(h), r

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, experts: ExpertSource,
                losses: bool = True) -> tuple[Tensor, Routing | None]:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        h = self.ffn_norm(x)
        if self.mlp is not None:
            return x + self.mlp(h), None
        y, r = self.moe(h, experts, losses)
        return x + y, r


class MoEModel(nn.Module):
    """The whole model. ``resident_experts=False`` builds everything but the experts (what a
    store-backed trainer or an inferencer holds on the device). ``seed`` fixes every
    initial weight, the experts' coming from :func:`init_expert` either way; ``None``
    leaves them as torch makes them (for weights about to be loaded)."""

    def __init__(self, cfg: ModelConfig | MoEConfig, seed: int | None = 0,
                 resident_experts: bool = True) -> None:
        super().__init__()
        cfg = model_config(cfg)
        self.cfg = cfg
        self.moe_layers: list[int] = list(cfg.moe_layers)
        # Training's rotary tables, kept while the sequence length, device and dtype hold.
        self._causal_rope: tuple[Any, tuple[Tensor, Tensor]] | None = None
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            Block(cfg, i, seed, resident_experts) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if seed is not None:
            _init_dense_(self, cfg, seed)

    @property
    def device(self) -> torch.device:
        return self.tok_emb.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.tok_emb.weight.dtype

    def dense_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """Every parameter that is not an expert weight (the device-resident part)."""
        return [(n, p) for n, p in self.named_parameters() if ".experts." not in n]

    def expert_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """Resident expert weights, named as in the store."""
        return [(n, p) for n, p in self.named_parameters() if ".experts." in n]

    def dense_state(self) -> dict[str, Tensor]:
        """The state dict without resident experts (what a store keeps under ``dense.``)."""
        return {k: v for k, v in self.state_dict().items() if ".experts." not in k}

    def _rope(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        cos, sin = rope_cos_sin(positions, self.cfg.head_dim, self.cfg.rope_theta)
        return cos.unsqueeze(1).to(self.dtype), sin.unsqueeze(1).to(self.dtype)

    def _run(self, idx: Tensor, experts: ExpertSource, cos: Tensor, sin: Tensor,
             losses: bool) -> tuple[Tensor, dict[int, Routing]]:
        """Every layer over ``idx`` within a pass of ``experts`` (see :meth:`_pass`): the
        last hidden states, and the routing of each MoE layer."""
        routing: dict[int, Routing] = {}
        x = self.tok_emb(idx)
        for block in self.layers:
            x, r = block(x, cos, sin, experts, losses)
            if r is not None:
                routing[block.layer] = r
        return x, routing

    @contextmanager
    def _pass(self, experts: ExpertSource, n_tokens: int) -> Iterator[None]:
        """One pass of ``experts`` over ``n_tokens`` tokens."""
        experts.begin_pass(self, n_tokens)
        try:
            yield
        finally:
            experts.end_pass()

    def _head(self, x: Tensor) -> Tensor:
        return F.linear(self.norm(x), self.lm_head.weight).float()

    def forward(self, idx: Tensor, targets: Tensor | None = None,
                experts: ExpertProvider | ExpertSource | None = None
                ) -> tuple[Tensor, Tensor | None, dict[str, Any]]:
        """Training: ``idx`` ``[B, T]`` int64 -> ``(logits [B, T, V] fp32, loss, aux)``.

        ``loss`` (when ``targets`` is given) is cross-entropy + ``router_aux_coef`` x the
        mean load-balancing loss over MoE layers + ``router_z_coef`` x mean z-loss over MoE
        layers. ``aux`` holds
        the detached parts (``ce``, ``aux_loss``, ``z_loss``) and ``routing``: ``{layer:
        topk_idx [B*T, k]}``. ``experts``, when given, supplies expert weights for every MoE
        layer instead of the resident banks.
        """
        cfg = self.cfg
        t = idx.shape[1]
        if t > cfg.max_position:
            raise ValueError(f"sequence length {t} exceeds the {cfg.max_position} positions")
        source = experts if isinstance(experts, ExpertSource) else _TrainingExperts(self, experts)
        key = (t, idx.device, self.dtype)
        if self._causal_rope is None or self._causal_rope[0] != key:
            self._causal_rope = key, self._rope(torch.arange(t, device=idx.device)[None])
        cos, sin = self._causal_rope[1]
        ctx = (torch.autocast(device_type=idx.device.type, dtype=torch.bfloat16)
               if cfg.dtype == "bfloat16" else nullcontext())
        with ctx:
            with self._pass(source, idx.numel()):
                x, routed = self._run(idx, source, cos, sin, losses=True)
            logits = self._head(x)
        zero = logits.new_zeros(())
        aux_terms = [r.aux_loss for r in routed.values() if r.aux_loss is not None]
        z_terms = [r.z_loss for r in routed.values() if r.z_loss is not None]
        aux_loss = torch.stack(aux_terms).mean() if aux_terms else zero
        z_loss = torch.stack(z_terms).mean() if z_terms else zero
        info: dict[str, Any] = {"aux_loss": aux_loss.detach(), "z_loss": z_loss.detach(),
                                "routing": {i: r.topk_idx.detach() for i, r in routed.items()},
                                "ce": None}
        loss = None
        if targets is not None:
            ce = F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))
            loss = ce + cfg.router_aux_coef * aux_loss + cfg.router_z_coef * z_loss
            info["ce"] = ce.detach()
        return logits, loss, info
