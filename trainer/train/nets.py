"""The models the store trainer trains, as it sees them.

:func:`~.store_trainer.train_store` runs one loop whatever the model: a :class:`TrainNet`
gives it the dense module (its parameters are what ``torch.optim.AdamW`` trains), the
:class:`~.layout.ExpertLayout` of its experts in the store, the loss of a micro-batch with
the experts served by :class:`~.expert_states.ExpertStates`, and what a checkpoint keeps of
it. Two kinds exist:

- :class:`PresetNet`: a trainer preset, :class:`trainer.model.MoEModel`, its experts
  initialised from the seed, its dense state kept in the checkpoint;
- :class:`trainer.train.hf_finetune.HFNet`: a model imported with ``tierstore import-hf``,
  as its own ``transformers`` class through the :mod:`tierstore.hf` backend.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch
from torch import Tensor, nn

import tierstore

from ..model import MoEModel
from ..presets import MoEConfig
from .budget import TrainShape
from .checkpoint import initialise_experts
from .expert_states import ExpertStates
from .layout import ExpertLayout, preset_layout


class TrainNet(ABC):
    """A model over the store, as the trainer drives it (see the module docstring)."""

    module: nn.Module  # the dense part on the device; every parameter of it trains
    layout: ExpertLayout
    shape: TrainShape  # what its activations are bounded by (trainer.train.budget)
    record: dict[str, Any]  # the run record's model_config: what identifies the model
    finetune: bool = False  # the weights come from the store, not from a seed

    def attach(self, experts: ExpertStates) -> None:  # noqa: B027  (a hook)
        """Serve the model's experts from ``experts`` from now on."""

    @abstractmethod
    def losses(self, x: Tensor, y: Tensor, experts: ExpertStates
               ) -> tuple[Tensor, dict[str, Tensor]]:
        """One micro-batch: the loss to backpropagate and its detached parts ``ce``,
        ``aux_loss`` and ``z_loss``."""

    @abstractmethod
    def initialise(self, store: tierstore.Store, seed: int) -> None:
        """Write the run's initial expert states (and bring the dense weights to them)."""

    @abstractmethod
    def dense_payload(self, store: tierstore.Store) -> dict[str, Any]:
        """What a checkpoint's dense entry keeps of the dense weights (written to the store
        here where they live in entries of their own)."""

    @abstractmethod
    def load_dense(self, store: tierstore.Store, payload: dict[str, Any]) -> None:
        """The dense weights of the checkpoint whose dense entry is ``payload``."""


class PresetNet(TrainNet):
    """A trainer preset (:class:`trainer.model.MoEModel`, ``resident_experts=False``)."""

    def __init__(self, cfg: MoEConfig, seed: int, device: torch.device) -> None:
        self.cfg = cfg
        self.module = MoEModel(cfg, seed=seed, resident_experts=False).to(device)
        self.layout = preset_layout(cfg)
        self.shape = TrainShape.of_preset(cfg)
        self.record = cfg.to_dict()

    def losses(self, x: Tensor, y: Tensor, experts: ExpertStates
               ) -> tuple[Tensor, dict[str, Tensor]]:
        _, loss, info = self.module(x, y, experts=experts)
        assert loss is not None
        return loss, {k: info[k] for k in ("ce", "aux_loss", "z_loss")}

    def initialise(self, store: tierstore.Store, seed: int) -> None:
        initialise_experts(store, self.layout, self.cfg, seed)

    def dense_payload(self, store: tierstore.Store) -> dict[str, Any]:
        return {"model": self.module.state_dict()}

    def load_dense(self, store: tierstore.Store, payload: dict[str, Any]) -> None:
        self.module.load_state_dict(payload["model"])
