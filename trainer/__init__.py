"""tierstore's bundled MoE applications: a trainer and an inferencer over the store.

- :mod:`trainer.model`: the MoE transformer both run, in one file, and its config.
- :mod:`trainer.presets`: the trainer's model shapes (:class:`MoEConfig`), presets and sizes.
- :mod:`trainer.train`: training, in memory or with the experts' states in a store.
- :mod:`trainer.infer`: inference with the experts in a store: Hugging Face import, expert
  sources and generation.
- :mod:`trainer.commands`: the ``tierstore`` commands they add.
"""

from .model import ModelConfig, MoEModel
from .presets import PRESETS, MoEConfig, model_size, presets_table
from .train.checkpoint import TrainerError, checkpoint_steps, saved_run
from .train.data import BatchSampler, Corpus, CorpusError, load_corpus
from .train.expert_states import ExpertStates
from .train.optim import adamw_step
from .train.resident import TrainConfig, train_resident
from .train.store_trainer import train_store

__all__ = [
    "PRESETS",
    "BatchSampler",
    "Corpus",
    "CorpusError",
    "ExpertStates",
    "ModelConfig",
    "MoEConfig",
    "MoEModel",
    "TrainConfig",
    "TrainerError",
    "adamw_step",
    "checkpoint_steps",
    "load_corpus",
    "model_size",
    "presets_table",
    "saved_run",
    "train_resident",
    "train_store",
]
