"""tierstore's bundled MoE trainer.

- :mod:`trainer.model`: the decoder-only MoE transformer, its presets and size arithmetic.
- :mod:`trainer.data`: a byte-level text corpus and a resumable batch sampler.
- :mod:`trainer.optim`: AdamW, clipping and learning-rate arithmetic shared by the trainers.
- :mod:`trainer.resident`: the reference trainer with everything held in memory.
- :mod:`trainer.store_trainer`: the trainer whose experts and their optimizer states live in a
  tierstore Store.
- :mod:`trainer.cli_train`: what ``tierstore train`` runs.
"""

from .data import BatchSampler, Corpus, CorpusError, load_corpus
from .model import PRESETS, MoEConfig, MoEModel, model_size, presets_table
from .optim import adamw_step
from .resident import TrainConfig, train_resident
from .store_trainer import ExpertStates, TrainerError, checkpoint_steps, saved_run, train_store

__all__ = [
    "PRESETS",
    "BatchSampler",
    "Corpus",
    "CorpusError",
    "ExpertStates",
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
