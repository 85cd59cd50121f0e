"""The run's small records in a node's store: JSON entries of kind ``meta``.

- :data:`NODE_ENTRY` (``trainer.node``): the node store's id, made once; manifests list
  every node's, so a checkpoint is only ever restored on the store it was taken with.
- :data:`JOIN_ENTRY` (``trainer.join``): on a node that joined the run at a re-shard, the
  run it joined (node 0's store id), written before any expert arrives.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import torch

import tierstore

NODE_ENTRY = ("trainer.node", "meta")
JOIN_ENTRY = ("trainer.join", "meta")


def as_tensor(obj: Any) -> torch.Tensor:
    return torch.frombuffer(bytearray(json.dumps(obj, sort_keys=True).encode()),
                            dtype=torch.uint8)


def read(store: tierstore.Store, key: tuple[str, str]) -> Any:
    """The record ``key`` holds, or ``None``: absent, or not JSON (not this trainer's)."""
    if key not in store:
        return None
    try:
        return json.loads(store.get(*key).numpy().tobytes())
    except ValueError:
        return None


def node_id(store: tierstore.Store, create: bool = True) -> str | None:
    """The node store's id (made and written the first time, where ``create``)."""
    saved = read(store, NODE_ENTRY)
    if isinstance(saved, dict) and isinstance(saved.get("id"), str):
        return saved["id"]
    if not create:
        return None
    saved = {"id": uuid.uuid4().hex}
    store.put(NODE_ENTRY[0], as_tensor(saved), kind=NODE_ENTRY[1])
    return saved["id"]
