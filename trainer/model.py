"""A decoder-only Mixture-of-Experts transformer in one file.

Pre-norm blocks: RMSNorm -> causal rotary attention -> RMSNorm -> FFN, where the FFN of every
``moe_every``-th layer is a top-k routed bank of SwiGLU experts and the others are one dense
SwiGLU. The router computes in fp32 and adds the Switch Transformer load-balancing loss and
the ST-MoE router z-loss.

The expert FFN is written so that expert weights never have to be module parameters:

* :func:`expert_forward` takes an expert's ``w1, w2, w3`` as explicit tensors;
* :meth:`Block.route` picks experts for each token;
* :func:`moe_combine` runs the routed tokens through whichever weights the caller hands it
  (a mapping ``expert_id -> (w1, w2, w3)``) and mixes the outputs.

A resident model keeps every expert in an :class:`ExpertBank` (plain ``nn.Parameter`` s named
``layers.{i}.experts.{e}.w1|w2|w3``, the store's naming convention). A store-backed trainer
builds the model with ``resident_experts=False`` and passes ``experts=provider`` to
:meth:`MoEModel.forward`; the provider is called once per MoE layer, right after that layer's
router has run, with the exact set of experts it needs. Both paths run the same
:func:`moe_combine`, so they agree bit for bit.

Weight layouts follow ``nn.Linear`` (and Mixtral): ``w1``/``w3`` are ``[d_ff, d_model]``
(gate and up projections), ``w2`` is ``[d_model, d_ff]`` (down projection).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Mapping, Sequence
from contextlib import nullcontext
from dataclasses import asdict, dataclass, replace
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

EXPERT_WEIGHTS = ("w1", "w2", "w3")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}

ExpertWeights = tuple[Tensor, Tensor, Tensor]
# provider(layer_index, sorted expert ids) -> {expert_id: (w1, w2, w3)}
ExpertProvider = Callable[[int, list[int]], Mapping[int, ExpertWeights]]


@dataclass(frozen=True)
class MoEConfig:
    """Architecture of an :class:`MoEModel`.

    ``dtype`` is the compute dtype (``float32`` or ``bfloat16``, the latter through autocast);
    parameters are always fp32 master copies, which is what the store keeps for experts.
    """

    vocab_size: int = 256  # byte-level tokens
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    d_ff: int = 128  # hidden size of one expert
    d_ff_dense: int | None = None  # hidden size of the dense FFN layers; None: d_ff
    n_experts: int = 8
    top_k: int = 2
    moe_every: int = 1  # layer i is MoE when (i + 1) % moe_every == 0
    max_seq_len: int = 256
    rope_theta: float = 10000.0
    router_aux_coef: float = 0.01  # Switch load-balancing loss weight
    router_z_coef: float = 0.001  # ST-MoE router z-loss weight
    norm_eps: float = 1e-5
    init_std: float = 0.02
    dtype: str = "float32"

    def __post_init__(self) -> None:
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model {self.d_model} is not a multiple of n_heads {self.n_heads}")
        if (self.d_model // self.n_heads) % 2:
            raise ValueError("rotary embeddings need an even head dimension")
        if not 1 <= self.top_k <= self.n_experts:
            raise ValueError(f"top_k must be in 1..n_experts, got {self.top_k}")
        if self.moe_every < 1:
            raise ValueError(f"moe_every must be >= 1, got {self.moe_every}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def dense_ff(self) -> int:
        return self.d_ff if self.d_ff_dense is None else self.d_ff_dense

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def is_moe(self, layer: int) -> bool:
        return (layer + 1) % self.moe_every == 0

    @property
    def moe_layers(self) -> list[int]:
        return [i for i in range(self.n_layers) if self.is_moe(i)]

    def expert_shapes(self) -> dict[str, tuple[int, int]]:
        return {
            "w1": (self.d_ff, self.d_model),
            "w2": (self.d_model, self.d_ff),
            "w3": (self.d_ff, self.d_model),
        }

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> MoEConfig:
        return cls(**d)


PRESETS: dict[str, MoEConfig] = {
    # Trains in seconds on a laptop CPU.
    "tiny": MoEConfig(d_model=64, n_layers=2, n_heads=4, d_ff=128, n_experts=8, top_k=2,
                      max_seq_len=256),
    "small": MoEConfig(d_model=128, n_layers=4, n_heads=4, d_ff=256, n_experts=16, top_k=2,
                       max_seq_len=512),
    "medium": MoEConfig(d_model=256, n_layers=6, n_heads=8, d_ff=512, n_experts=32, top_k=2,
                        max_seq_len=512),
    # Many experts keep the per-token compute small while the expert states grow large.
    "large": MoEConfig(d_model=512, n_layers=8, n_heads=8, d_ff=1024, n_experts=64, top_k=2,
                       max_seq_len=1024),
    "xl": MoEConfig(d_model=768, n_layers=12, n_heads=12, d_ff=2048, n_experts=64, top_k=2,
                    max_seq_len=1024),
}


def expert_name(layer: int, expert: int, weight: str) -> str:
    """The store name of one expert weight: ``layers.{layer}.experts.{expert}.{weight}``."""
    if weight not in EXPERT_WEIGHTS:
        raise ValueError(f"expert weight must be one of {EXPERT_WEIGHTS}, got {weight!r}")
    return f"layers.{layer}.experts.{expert}.{weight}"


# --------------------------------------------------------------------------- sizes


@dataclass(frozen=True)
class ModelSize:
    """Parameter counts and state sizes of a configuration, computed without building it.

    ``expert_state_bytes`` is 12 bytes per expert parameter (fp32 master + ``exp_avg`` +
    ``exp_avg_sq``: the papers' 12·S on the backing tier); ``dense_state_bytes`` is 16 bytes
    per dense parameter (param, grad, and the two fp32 moments: the papers' 16·D).
    """

    dense_params: int
    expert_params: int
    params_per_expert: int
    n_moe_layers: int
    active_params: int  # parameters one token touches (top_k experts per MoE layer)

    @property
    def total_params(self) -> int:
        return self.dense_params + self.expert_params

    @property
    def expert_state_bytes(self) -> int:
        return 12 * self.expert_params

    @property
    def dense_state_bytes(self) -> int:
        return 16 * self.dense_params

    @property
    def layer_expert_state_bytes(self) -> int:
        """Expert states of one MoE layer: the unit a layer-wise prefetch moves."""
        return 0 if not self.n_moe_layers else self.expert_state_bytes // self.n_moe_layers


def model_size(cfg: MoEConfig) -> ModelSize:
    d, v = cfg.d_model, cfg.vocab_size
    per_expert = 3 * d * cfg.d_ff
    n_moe = len(cfg.moe_layers)
    n_dense = cfg.n_layers - n_moe
    per_layer_common = 2 * d + 4 * d * d  # two norms + attention
    dense = (
        2 * v * d  # embedding + untied output head
        + d  # final norm
        + cfg.n_layers * per_layer_common
        + n_dense * 3 * d * cfg.dense_ff
        + n_moe * cfg.n_experts * d  # routers
    )
    experts = n_moe * cfg.n_experts * per_expert
    return ModelSize(
        dense_params=dense,
        expert_params=experts,
        params_per_expert=per_expert,
        n_moe_layers=n_moe,
        active_params=dense + n_moe * cfg.top_k * per_expert,
    )


def _human(n: float, unit: str = "") -> str:
    """``460.1 K`` for counts, ``4.5 MiB`` for bytes (``unit="B"``)."""
    base, prefixes = (1024.0, ("Ki", "Mi", "Gi", "Ti")) if unit == "B" else (
        1000.0, ("K", "M", "B", "T"))
    if abs(n) < base:
        return f"{n:.0f} {unit}".rstrip()
    for prefix in prefixes:
        n /= base
        if abs(n) < base or prefix == prefixes[-1]:
            break
    return f"{n:.1f} {prefix}{unit}"


def presets_table(presets: Mapping[str, MoEConfig] | None = None) -> str:
    """A plain-text table of the presets' sizes (for ``--help`` texts and the README)."""
    rows = [("preset", "layers", "experts", "total params", "active", "expert states",
             "dense states")]
    for name, cfg in (presets or PRESETS).items():
        s = model_size(cfg)
        rows.append((name, str(cfg.n_layers), f"{len(cfg.moe_layers)}x{cfg.n_experts}",
                     _human(s.total_params), _human(s.active_params),
                     _human(s.expert_state_bytes, "B"), _human(s.dense_state_bytes, "B")))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


# --------------------------------------------------------------------------- initialisation


def _seed_for(*parts: object) -> int:
    """A 63-bit seed from a tuple, so every expert has its own reproducible stream and can
    be created alone (a store-backed trainer initialises experts one at a time)."""
    digest = hashlib.sha256("/".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def init_expert(cfg: MoEConfig, seed: int, layer: int, expert: int) -> ExpertWeights:
    """The initial fp32 ``(w1, w2, w3)`` of one expert; identical however the model is held."""
    g = torch.Generator().manual_seed(_seed_for("expert", seed, layer, expert))
    shapes = cfg.expert_shapes()
    out_std = cfg.init_std / math.sqrt(2 * cfg.n_layers)  # residual projection (GPT-2)
    w1 = torch.empty(shapes["w1"]).normal_(0.0, cfg.init_std, generator=g)
    w2 = torch.empty(shapes["w2"]).normal_(0.0, out_std, generator=g)
    w3 = torch.empty(shapes["w3"]).normal_(0.0, cfg.init_std, generator=g)
    return w1, w2, w3


def _init_dense_(model: nn.Module, cfg: MoEConfig, seed: int) -> None:
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


# --------------------------------------------------------------------------- building blocks


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


def rope_tables(cfg: MoEConfig, device: torch.device | None = None) -> tuple[Tensor, Tensor]:
    """cos/sin tables ``[max_seq_len, head_dim]`` in the rotate-half layout (as in Llama and
    Mixtral, so weights map onto those implementations without permutation)."""
    half = cfg.head_dim // 2
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, half, device=device).float() / half))
    t = torch.arange(cfg.max_seq_len, device=device).float()
    freqs = torch.outer(t, inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``x`` ``[B, H, T, hd]`` by position; ``cos``/``sin`` are ``[T, hd]``."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.n_heads, self.head_dim = cfg.n_heads, cfg.head_dim
        self.wq = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.wk = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.wv = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.wo = nn.Linear(cfg.d_model, cfg.d_model, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        b, t, d = x.shape

        def heads(y: Tensor) -> Tensor:
            return y.view(b, t, self.n_heads, self.head_dim).transpose(1, 2)

        q, k, v = heads(self.wq(x)), heads(self.wk(x)), heads(self.wv(x))
        q = apply_rope(q, cos[:t], sin[:t]).to(v.dtype)
        k = apply_rope(k, cos[:t], sin[:t]).to(v.dtype)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, d))


def expert_forward(x: Tensor, w1: Tensor, w2: Tensor, w3: Tensor) -> Tensor:
    """One SwiGLU FFN with explicit weights: ``w2 · (silu(w1 · x) * (w3 · x))``."""
    return F.linear(F.silu(F.linear(x, w1)) * F.linear(x, w3), w2)


class SwiGLU(nn.Module):
    """The dense FFN of non-MoE layers (same function as an expert)."""

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

    def __init__(self, cfg: MoEConfig, seed: int, layer: int) -> None:
        super().__init__(Expert(init_expert(cfg, seed, layer, e)) for e in range(cfg.n_experts))

    def weights(self, ids: Sequence[int]) -> dict[int, ExpertWeights]:
        """``{e: (w1, w2, w3)}`` for the given expert ids, as :func:`moe_combine` takes."""
        out: dict[int, ExpertWeights] = {}
        for e in ids:
            ex = self[e]
            out[e] = (ex.w1, ex.w2, ex.w3)
        return out


class Routing(NamedTuple):
    topk_idx: Tensor  # [T, k] int64 expert ids
    topk_weight: Tensor  # [T, k] fp32 mixing weights, each row sums to 1
    aux_loss: Tensor  # Switch load-balancing loss (1.0 when perfectly balanced)
    z_loss: Tensor  # mean squared log-sum-exp of the router logits


def route(x: Tensor, router_weight: Tensor, top_k: int) -> Routing:
    """Top-k softmax routing of tokens ``x`` ``[T, D]``.

    The router runs in fp32 outside autocast: small logit differences decide which experts
    a token gets, and bf16 would turn ties into noise. Weights are the softmax over all
    experts renormalised over the chosen k (Mixtral), i.e. a softmax over the top-k logits.
    """
    n_experts = router_weight.shape[0]
    with torch.autocast(device_type=x.device.type, enabled=False):
        logits = F.linear(x.float(), router_weight.float())
        probs = logits.softmax(dim=-1)
        topk_weight, topk_idx = probs.topk(top_k, dim=-1)
        topk_weight = topk_weight / topk_weight.sum(dim=-1, keepdim=True)
        # Switch loss: n_experts * sum_e f_e * P_e, with f_e the share of the T*k assignments
        # that went to expert e (no gradient) and P_e the mean router probability of e.
        counts = torch.zeros(n_experts, device=x.device, dtype=torch.float32)
        counts.scatter_add_(0, topk_idx.reshape(-1),
                            torch.ones(topk_idx.numel(), device=x.device))
        frac = counts / topk_idx.numel()
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


class Block(nn.Module):
    """One transformer layer. MoE layers carry ``router`` and (when resident) ``experts``;
    dense layers carry ``mlp``."""

    def __init__(self, cfg: MoEConfig, layer: int, seed: int, resident_experts: bool) -> None:
        super().__init__()
        self.cfg, self.layer = cfg, layer
        self.is_moe = cfg.is_moe(layer)
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.router: nn.Linear | None = None
        self.experts: ExpertBank | None = None
        self.mlp: SwiGLU | None = None
        if self.is_moe:
            self.router = nn.Linear(cfg.d_model, cfg.n_experts, bias=False)
            if resident_experts:
                self.experts = ExpertBank(cfg, seed, layer)
        else:
            self.mlp = SwiGLU(cfg.d_model, cfg.dense_ff)

    def route(self, x: Tensor) -> Routing:
        """Routing of tokens ``x`` ``[T, D]`` (already normalised by ``ffn_norm``)."""
        if self.router is None:
            raise RuntimeError(f"layer {self.layer} is a dense layer and has no router")
        return route(x, self.router.weight, self.cfg.top_k)

    def combine(self, x: Tensor, routing: Routing,
                weights: Mapping[int, ExpertWeights]) -> Tensor:
        return moe_combine(x, routing.topk_idx, routing.topk_weight, weights)

    def moe(self, h: Tensor, provider: ExpertProvider | None) -> tuple[Tensor, Routing]:
        flat = h.reshape(-1, h.shape[-1])
        r = self.route(flat)
        ids = torch.unique(r.topk_idx).tolist()
        if provider is not None:
            weights = provider(self.layer, ids)
        elif self.experts is not None:
            weights = self.experts.weights(ids)
        else:
            raise RuntimeError(
                f"layer {self.layer} holds no experts: pass experts=provider to forward()")
        return self.combine(flat, r, weights).view_as(h), r

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor,
                provider: ExpertProvider | None = None) -> tuple[Tensor, Routing | None]:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        h = self.ffn_norm(x)
        if not self.is_moe:
            assert self.mlp is not None
            return x + self.mlp(h), None
        y, r = self.moe(h, provider)
        return x + y, r


class MoEModel(nn.Module):
    """The whole model. ``resident_experts=False`` builds everything but the experts (what a
    store-backed trainer holds on the device); ``seed`` fixes every initial weight, and the
    experts' initial values come from :func:`init_expert` either way."""

    def __init__(self, cfg: MoEConfig, seed: int = 0, resident_experts: bool = True) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleList(
            Block(cfg, i, seed, resident_experts) for i in range(cfg.n_layers)
        )
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        cos, sin = rope_tables(cfg)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        _init_dense_(self, cfg, seed)

    def dense_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """Every parameter that is not an expert weight (the device-resident part)."""
        return [(n, p) for n, p in self.named_parameters() if ".experts." not in n]

    def expert_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """Resident expert weights, named as in the store."""
        return [(n, p) for n, p in self.named_parameters() if ".experts." in n]

    def forward(self, idx: Tensor, targets: Tensor | None = None,
                experts: ExpertProvider | None = None
                ) -> tuple[Tensor, Tensor | None, dict[str, Any]]:
        """``idx`` ``[B, T]`` int64 -> ``(logits [B, T, V] fp32, loss, aux)``.

        ``loss`` (when ``targets`` is given) is cross-entropy + ``router_aux_coef`` x mean
        load-balancing loss + ``router_z_coef`` x mean z-loss over MoE layers. ``aux`` holds
        the detached parts (``ce``, ``aux_loss``, ``z_loss``) and ``routing``: ``{layer:
        topk_idx [B*T, k]}``. ``experts``, when given, supplies expert weights for every MoE
        layer instead of the resident banks.
        """
        cfg = self.cfg
        t = idx.shape[1]
        if t > cfg.max_seq_len:
            raise ValueError(f"sequence length {t} exceeds max_seq_len {cfg.max_seq_len}")
        ctx = (torch.autocast(device_type=idx.device.type, dtype=torch.bfloat16)
               if cfg.dtype == "bfloat16" else nullcontext())
        aux_terms: list[Tensor] = []
        z_terms: list[Tensor] = []
        routing: dict[int, Tensor] = {}
        with ctx:
            x = self.tok_emb(idx)
            for block in self.layers:
                x, r = block(x, self.rope_cos, self.rope_sin, experts)
                if r is not None:
                    aux_terms.append(r.aux_loss)
                    z_terms.append(r.z_loss)
                    routing[block.layer] = r.topk_idx.detach()
            logits = self.lm_head(self.norm(x)).float()
        zero = logits.new_zeros(())
        aux_loss = torch.stack(aux_terms).mean() if aux_terms else zero
        z_loss = torch.stack(z_terms).mean() if z_terms else zero
        info: dict[str, Any] = {"aux_loss": aux_loss.detach(), "z_loss": z_loss.detach(),
                                "routing": routing, "ce": None}
        loss = None
        if targets is not None:
            ce = F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))
            loss = ce + cfg.router_aux_coef * aux_loss + cfg.router_z_coef * z_loss
            info["ce"] = ce.detach()
        return logits, loss, info


def with_dtype(cfg: MoEConfig, dtype: str | None) -> MoEConfig:
    """``cfg`` with its compute dtype replaced (unchanged for ``None``)."""
    return cfg if dtype is None else replace(cfg, dtype=dtype)
