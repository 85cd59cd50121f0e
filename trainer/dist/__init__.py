"""Distributed training on torch.distributed: expert parallelism over one store per node
(:func:`train_distributed`, run under torchrun)."""

from .exchange import PARADIGMS, janus_ratio
from .sidecar import stop_daemon_at
from .trainer import train_distributed
from .world import DistributedError

__all__ = ["PARADIGMS", "DistributedError", "janus_ratio", "stop_daemon_at", "train_distributed"]
