"""Training over the store: the expert states' fetch strategies, the training loop, its
checkpoints and metrics."""
