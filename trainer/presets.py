"""The trainer's model shapes: :class:`MoEConfig`, its presets and their sizes.

A :class:`MoEConfig` names a model the way the trainer thinks of it (``d_model``, one expert
hidden size, an MoE layer every ``moe_every`` layers) and is what training checkpoints
record; :meth:`MoEConfig.model_config` turns it into the :class:`trainer.model.ModelConfig`
the model is built from (family ``tierstore``: full multi-head attention, Mixtral-style
renormalised routing, untied head, byte-level vocabulary).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch

from .model import ModelConfig

TRAIN_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class MoEConfig:
    """Architecture of a trained model.

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
        if self.dtype not in TRAIN_DTYPES:
            raise ValueError(f"dtype must be one of {sorted(TRAIN_DTYPES)}, got {self.dtype!r}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def dense_ff(self) -> int:
        return self.d_ff if self.d_ff_dense is None else self.d_ff_dense

    @property
    def torch_dtype(self) -> torch.dtype:
        return TRAIN_DTYPES[self.dtype]

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

    def model_config(self) -> ModelConfig:
        """The model's :class:`ModelConfig` (family ``tierstore``)."""
        return ModelConfig(
            family="tierstore", vocab_size=self.vocab_size, hidden_size=self.d_model,
            n_layers=self.n_layers, n_heads=self.n_heads, n_kv_heads=self.n_heads,
            head_dim=self.head_dim, n_experts=self.n_experts, top_k=self.top_k,
            moe_ffn=self.d_ff, moe_layers=tuple(self.moe_layers), dense_ffn=self.dense_ff,
            rope_theta=self.rope_theta, norm_eps=self.norm_eps,
            max_position=self.max_seq_len, dtype=self.dtype,
            router_aux_coef=self.router_aux_coef, router_z_coef=self.router_z_coef,
            init_std=self.init_std)

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


# What a trainer builds its model from: a preset's shape. (An imported Hugging Face model
# is fine-tuned as its own transformers class: trainer.train.hf_finetune.)
TrainModel = MoEConfig


def with_dtype(cfg: TrainModel, dtype: str | None) -> TrainModel:
    """``cfg`` with its compute dtype replaced (unchanged for ``None``)."""
    return cfg if dtype is None else replace(cfg, dtype=dtype)


def config_from_dict(d: Mapping[str, Any]) -> TrainModel:
    """The model config a preset run's record holds."""
    return MoEConfig.from_dict(d)


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
