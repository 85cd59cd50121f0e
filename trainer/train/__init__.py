"""Training: the resident reference trainer and the trainer whose experts live in a store.

- :mod:`.data`: a byte-level text corpus and a resumable batch sampler.
- :mod:`.optim`: AdamW, clipping and learning-rate arithmetic shared by the trainers.
- :mod:`.resident`: the reference trainer with everything held in memory.
- :mod:`.store_trainer`: :func:`~.store_trainer.train_store`, the training loop over a store.
- :mod:`.expert_states`: the experts' states as the model's expert provider during training.
- :mod:`.fetch`: how expert states reach the device and go back (queue, direct, zero-copy).
- :mod:`.checkpoint`: the on-store format: entry names, run record, checkpoints, resume.
- :mod:`.layout`: where a model's experts live in the store (the trainer's only view of them).
- :mod:`.nets`: the models the store trainer trains: a preset, or (:mod:`.hf_finetune`) a
  model ``tierstore import-hf`` imported, as its own ``transformers`` class.
- :mod:`.hf_resident`: an imported model fine-tuned in memory (the reference).
- :mod:`.metrics`: per-step store figures and the JSON-lines metrics file.
- :mod:`.cli_train`: what ``tierstore train`` runs.
- :mod:`.demo`: the training half of ``tierstore demo``.
"""
