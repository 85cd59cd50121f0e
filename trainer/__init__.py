"""tierstore's bundled MoE trainer.

- :mod:`trainer.model`: the decoder-only MoE transformer, its presets and size arithmetic.
- :mod:`trainer.data`: a byte-level text corpus and a resumable batch sampler.
- :mod:`trainer.optim`: AdamW, clipping and learning-rate arithmetic shared by the trainers.
- :mod:`trainer.resident`: the reference trainer with everything held in memory.
"""

from .data import BatchSampler, Corpus, CorpusError, load_corpus
from .model import PRESETS, MoEConfig, MoEModel, model_size, presets_table
from .optim import adamw_step
from .resident import TrainConfig, train_resident

__all__ = [
    "PRESETS",
    "BatchSampler",
    "Corpus",
    "CorpusError",
    "MoEConfig",
    "MoEModel",
    "TrainConfig",
    "adamw_step",
    "load_corpus",
    "model_size",
    "presets_table",
    "train_resident",
]
