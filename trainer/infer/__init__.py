"""Inference with the experts in a store, on the model of :mod:`trainer.model`.

- :mod:`.hf_config`: Hugging Face ``config.json`` -> ``ModelConfig``, checked.
- :mod:`.hf_checkpoint`: reading and checking a safetensors checkpoint.
- :mod:`.hf_import`: ``tierstore import-hf``, a checkpoint into a store.
- :mod:`.loading`: a model's layout in a store, and loading its dense part.
- :mod:`.sources`: the resident and on-demand expert sources.
- :mod:`.device_queue`: the store's device prefetch queue as the sources use it.
- :mod:`.ring`: the ring-memory source (K MoE layers' experts on the device).
- :mod:`.expert_mode`: the expert-granular source (routed experts, prediction, a cache).
- :mod:`.generate`: text generation, and what ``tierstore generate`` runs.
"""
