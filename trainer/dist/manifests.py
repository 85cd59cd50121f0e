"""Checkpoint manifests, ``RUN_DIR/manifests/ckpt-{n:06d}.json``: what one holds, writing it,
and reading and validating a node's manifests, each as a whole.

A manifest is written atomically (:func:`write`), so a crash never leaves a torn one: one that
does not validate was damaged or edited by hand. It is refused with one line naming it and
what is wrong, never skipped, since skipping it would resume from an older checkpoint without
a word. (:func:`~.checkpoint.choose_checkpoint` checks the manifests against each other and
against the stores, and says when it falls back to an older checkpoint, and why.)
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import time
from pathlib import Path
from typing import Any

from tierstore.durable import replace_file

FORMAT = 1
MAX_BYTES = 16 << 20  # far beyond the manifest of any world size
_NAME = re.compile(r"^ckpt-(\d{6})\.json$")
_NODE_ID = re.compile(r"^[0-9a-f]{32}$")
_SAMPLER = {"seed": -(1 << 63), "batches_drawn": 0, "batch_size": 1, "seq_len": 1, "n_tokens": 0}
FIELDS = ("format", "number", "step", "tag", "world_size", "nodes", "node_ids", "ownership",
          "n_experts", "sampler", "time")


def tag_of(n: int) -> str:
    """The store snapshot of checkpoint ``n``."""
    return f"dist-{n:06d}"


def path_of(run_dir: Path, n: int) -> Path:
    return run_dir / "manifests" / f"ckpt-{n:06d}.json"


def numbers(run_dir: Path) -> list[int]:
    """The checkpoint numbers a node's run directory has a manifest file of (unread)."""
    folder = run_dir / "manifests"
    if not folder.is_dir():
        return []
    return sorted(int(m.group(1)) for p in folder.iterdir() if (m := _NAME.match(p.name)))


def make(number: int, step: int, nodes: list[list[int]], node_ids: list[str],
         n_experts: int, sampler: dict[str, Any]) -> dict[str, Any]:
    return {"format": FORMAT, "number": number, "step": step, "tag": tag_of(number),
            "world_size": sum(len(r) for r in nodes), "nodes": nodes, "node_ids": node_ids,
            "ownership": "consecutive", "n_experts": n_experts, "sampler": dict(sampler),
            "time": time.time()}


def write(run_dir: Path, manifest: dict[str, Any]) -> None:
    """Write ``manifest`` atomically: a temporary file, fsync, rename, fsync of the folder;
    temporary files that a crash left are removed."""
    folder = run_dir / "manifests"
    folder.mkdir(parents=True, exist_ok=True)
    path = path_of(run_dir, manifest["number"])
    tmp = folder / f".{path.name}.{os.getpid()}.tmp"
    for stale in folder.glob(".ckpt-*.tmp"):
        stale.unlink(missing_ok=True)
    replace_file(path, json.dumps(manifest, indent=1).encode(), tmp=tmp)


def same_checkpoint(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether two nodes' manifests describe one checkpoint (each node writes its own
    copy, at its own time)."""
    return {k: v for k, v in a.items() if k != "time"} == \
        {k: v for k, v in b.items() if k != "time"}


# --------------------------------------------------------------------------- validation


def _show(value: Any) -> str:
    text = json.dumps(value) if not isinstance(value, float) or math.isfinite(value) else \
        str(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _int(m: dict[str, Any], key: str, low: int) -> int:
    v = m[key]
    if type(v) is not int:  # bool is an int to Python, not to a manifest
        raise ValueError(f"{key!r} is {_show(v)}, not an integer")
    if v < low:
        raise ValueError(f"{key!r} is {v}, less than {low}")
    return v


def validate(m: Any, number: int, n_experts: int | None = None) -> dict[str, Any]:
    """``m`` (parsed JSON) as the manifest of checkpoint ``number``, checked as a whole:
    every field present with its type and range, and the fields consistent with each other
    (and with the run's ``n_experts`` where given). Raises ``ValueError`` saying what is
    wrong."""
    if not isinstance(m, dict):
        raise ValueError(f"it holds a JSON {type(m).__name__}, not an object")
    missing = [k for k in FIELDS if k not in m]
    if missing:
        raise ValueError("it has no " + ", ".join(repr(k) for k in missing))
    extra = sorted(set(m) - set(FIELDS))
    if extra:
        raise ValueError("it has fields no manifest has: " + ", ".join(map(repr, extra)))
    if m["format"] != FORMAT or type(m["format"]) is not int:
        raise ValueError(f"its format is {_show(m['format'])}, not {FORMAT}")
    if _int(m, "number", 1) != number:
        raise ValueError(f"it says it is checkpoint {m['number']}, its name {number}")
    _int(m, "step", 0)
    if m["tag"] != tag_of(number):
        raise ValueError(f"'tag' is {_show(m['tag'])}, not {tag_of(number)!r}")
    size = _int(m, "world_size", 1)
    nodes = m["nodes"]
    if not isinstance(nodes, list) or not nodes or not all(
            isinstance(r, list) and r and all(type(x) is int for x in r) for r in nodes):
        raise ValueError(f"'nodes' is {_show(nodes)}, not a list of each node's ranks")
    if [x for r in nodes for x in r] != list(range(size)):
        raise ValueError(f"'nodes' {_show(nodes)} does not number the {size} ranks of "
                         "'world_size' node by node")
    ids = m["node_ids"]
    if not isinstance(ids, list) or not all(isinstance(i, str) and _NODE_ID.match(i)
                                            for i in ids):
        raise ValueError(f"'node_ids' is {_show(ids)}, not a list of node store ids")
    if len(ids) != len(nodes) or len(set(ids)) != len(ids):
        raise ValueError(f"'node_ids' has {len(ids)} ids ({len(set(ids))} different) for "
                         f"{len(nodes)} nodes")
    if m["ownership"] != "consecutive":
        raise ValueError(f"'ownership' is {_show(m['ownership'])}, not 'consecutive'")
    experts = _int(m, "n_experts", 1)
    if experts % size:
        raise ValueError(f"{experts} experts do not split over 'world_size' {size}")
    if n_experts is not None and experts != n_experts:
        raise ValueError(f"it is of a model with {experts} experts per layer, this run's "
                         f"has {n_experts}")
    sampler = m["sampler"]
    if not isinstance(sampler, dict) or set(sampler) != set(_SAMPLER):
        raise ValueError(f"'sampler' is {_show(sampler)}, not a sampler position")
    for key, low in _SAMPLER.items():
        _int(sampler, key, low)
    t = m["time"]
    if type(t) not in (int, float) or not math.isfinite(t):
        raise ValueError(f"'time' is {_show(t)}, not a time")
    return m


def read(run_dir: Path, n_experts: int | None = None
         ) -> tuple[dict[int, dict[str, Any]], list[str]]:
    """The valid manifests of a node's run directory by checkpoint number, and one line for
    each manifest file that is not valid."""
    found: dict[int, dict[str, Any]] = {}
    errors: list[str] = []
    for n in numbers(run_dir):
        p = path_of(run_dir, n)
        try:
            if not p.is_file():
                raise ValueError("it is not a regular file")
            if p.stat().st_size > MAX_BYTES:
                raise ValueError(f"it is {p.stat().st_size} bytes, more than any manifest")
            try:
                parsed = json.loads(p.read_bytes())
            except (ValueError, RecursionError) as e:
                raise ValueError(f"it is not JSON ({str(e)[:80]})") from None
            found[n] = validate(parsed, n, n_experts)
        except OSError as e:
            errors.append(f"checkpoint manifest {p} cannot be read: {e.strerror or e}")
        except ValueError as e:
            errors.append(f"checkpoint manifest {p} is invalid: {e}; put the original back, or "
                          "move it away to resume from an earlier checkpoint")
    return found, errors


def remove(run_dir: Path, n: int) -> None:
    with contextlib.suppress(FileNotFoundError):
        path_of(run_dir, n).unlink()
