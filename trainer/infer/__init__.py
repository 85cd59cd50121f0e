"""Inference over the store: Hugging Face import, the ring-memory and expert-granular
sources, and generation."""
