"""Expert access traces: a CSV format, a recorder, and synthetic generators.

File format (UTF-8 CSV, one access per line, in access order):

    step,layer,expert[,nbytes]
    0,0,17,4194304
    0,0,42,4194304
    0,1,3,4194304

- The header is exactly ``step,layer,expert`` or ``step,layer,expert,nbytes``; all values
  are non-negative integers. ``step`` is the training step (or decode step) and must not
  decrease; ``layer`` is the MoE layer; ``expert`` the expert index in that layer.
- The cache key of an access is ``(layer, expert)``. ``nbytes`` is the size fetched for that
  access (e.g. all of the expert's state kinds); without the column, readers supply a
  default size.
- Lines starting with ``#`` and blank lines are ignored, so a generator can note its spec.
- One line per expert that a (step, layer) uses, not per token: a routed expert is fetched
  once however many tokens it serves.
"""

from __future__ import annotations

import dataclasses
import math
import os
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, fields
from typing import Any

import numpy as np

__all__ = [
    "Trace",
    "TraceRecorder",
    "TraceSpec",
    "generate_trace",
    "parse_spec",
    "read_trace",
    "spec_dict",
    "write_trace",
]

HEADER = ("step", "layer", "expert")
HEADER_NBYTES = (*HEADER, "nbytes")


@dataclass(frozen=True, eq=False)
class Trace:
    """Accesses as parallel int64 arrays (``nbytes`` always filled, see ``has_nbytes``)."""

    step: np.ndarray
    layer: np.ndarray
    expert: np.ndarray
    nbytes: np.ndarray
    has_nbytes: bool = True

    def __post_init__(self) -> None:
        n = len(self.step)
        for name in ("layer", "expert", "nbytes"):
            if len(getattr(self, name)) != n:
                raise ValueError(
                    f"trace column {name} has {len(getattr(self, name))} rows, not {n}"
                )
        if n and (min(int(a.min()) for a in (self.step, self.layer, self.expert, self.nbytes)) < 0):
            raise ValueError("trace values must be non-negative")
        if n > 1 and bool((np.diff(self.step) < 0).any()):
            raise ValueError("trace steps must not decrease")

    def __len__(self) -> int:
        return len(self.step)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Trace):
            return NotImplemented
        return self.has_nbytes == other.has_nbytes and all(
            np.array_equal(getattr(self, f), getattr(other, f))
            for f in ("step", "layer", "expert", "nbytes")
        )

    __hash__ = None  # type: ignore[assignment]

    def keys(self) -> list[tuple[int, int]]:
        """The cache key of every access, ``(layer, expert)``, in order."""
        return list(zip(self.layer.tolist(), self.expert.tolist(), strict=True))

    def accesses(self) -> Iterator[tuple[int, tuple[int, int], int]]:
        """``(step, key, nbytes)`` for every access, in order."""
        return zip(self.step.tolist(), self.keys(), self.nbytes.tolist(), strict=True)

    def distinct_bytes(self) -> int:
        """Bytes needed to hold every key at once (each key at its largest size)."""
        if not len(self):
            return 0
        sizes: dict[tuple[int, int], int] = {}
        for key, n in zip(self.keys(), self.nbytes.tolist(), strict=True):
            if n > sizes.get(key, -1):
                sizes[key] = n
        return sum(sizes.values())

    @classmethod
    def from_rows(cls, rows: Iterable[tuple[int, int, int, int]], has_nbytes: bool = True) -> Trace:
        """Build a trace from ``(step, layer, expert, nbytes)`` tuples."""
        arr = np.asarray(list(rows), dtype=np.int64).reshape(-1, 4)
        return cls(arr[:, 0], arr[:, 1], arr[:, 2], arr[:, 3], has_nbytes)


def write_trace(path: str | os.PathLike[str], trace: Trace, comment: str | None = None) -> None:
    """Write ``trace`` in the CSV format above (``comment`` becomes a leading ``#`` line)."""
    cols = [trace.step, trace.layer, trace.expert]
    header = HEADER
    if trace.has_nbytes:
        cols.append(trace.nbytes)
        header = HEADER_NBYTES
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        if comment:
            for line in comment.splitlines():
                f.write(f"# {line}\n")
        f.write(",".join(header) + "\n")
        if len(trace):
            np.savetxt(f, np.stack(cols, axis=1), fmt="%d", delimiter=",")


def read_trace(path: str | os.PathLike[str], default_nbytes: int = 1 << 20) -> Trace:
    """Read a CSV trace; rows without an ``nbytes`` column get ``default_nbytes``."""
    header: tuple[str, ...] | None = None
    rows: list[str] = []
    with open(path, encoding="utf-8") as f:
        for lineno, raw in enumerate(f, 1):
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            if header is None:
                header = tuple(c.strip() for c in line.split(","))
                if header not in (HEADER, HEADER_NBYTES):
                    raise ValueError(
                        f"{path}:{lineno}: header must be {','.join(HEADER)}[,nbytes], got {line!r}"
                    )
                continue
            rows.append(line)
    if header is None:
        raise ValueError(f"{path}: no header line")
    width = len(header)
    if rows:
        try:
            data = np.array([[int(v) for v in r.split(",")] for r in rows], dtype=np.int64)
        except ValueError as exc:
            raise ValueError(f"{path}: non-integer value in trace ({exc})") from None
        if data.ndim != 2 or data.shape[1] != width:
            raise ValueError(f"{path}: every row needs {width} values")
    else:
        data = np.zeros((0, width), dtype=np.int64)
    has_nbytes = width == 4
    nbytes = data[:, 3] if has_nbytes else np.full(len(data), int(default_nbytes), np.int64)
    return Trace(data[:, 0], data[:, 1], data[:, 2], nbytes, has_nbytes)


class TraceRecorder:
    """Collect routing decisions as they happen and write them in the trace format.

    ``record(step, layer, experts, nbytes)`` takes the expert ids a layer routed to in one
    step (ints, a list, a numpy array or a torch tensor, duplicates allowed: they are
    de-duplicated and sorted, since each expert is fetched once). ``nbytes`` is one size for
    all of them or one per expert; with ``with_nbytes=False`` the column is omitted. Rows
    are buffered and appended to ``path`` on ``flush``/``close``; thread-safe.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        with_nbytes: bool = True,
        comment: str | None = None,
        buffer_rows: int = 65536,
    ) -> None:
        self.path = os.fspath(path)
        self.with_nbytes = bool(with_nbytes)
        self._buffer_rows = int(buffer_rows)
        self._rows: list[str] = []
        self._lock = threading.Lock()
        self._last_step = -1
        self._closed = False
        self.rows_written = 0
        with open(self.path, "w", encoding="utf-8", newline="\n") as f:
            if comment:
                for line in comment.splitlines():
                    f.write(f"# {line}\n")
            f.write(",".join(HEADER_NBYTES if self.with_nbytes else HEADER) + "\n")

    def record(self, step: int, layer: int, experts: Any, nbytes: Any = None) -> None:
        ids = np.asarray(_as_numpy(experts), dtype=np.int64).reshape(-1)
        if self.with_nbytes:
            if nbytes is None:
                raise ValueError("this recorder writes nbytes: pass nbytes")
            sizes = np.asarray(_as_numpy(nbytes), dtype=np.int64).reshape(-1)
            if sizes.size == 1:
                sizes = np.full(ids.size, int(sizes[0]), np.int64)
            elif sizes.size != ids.size:
                raise ValueError(f"{sizes.size} sizes for {ids.size} experts")
        uniq, first = np.unique(ids, return_index=True)
        step, layer = int(step), int(layer)
        if min(step, layer, int(uniq.min()) if uniq.size else 0) < 0:
            raise ValueError("step, layer and expert ids must be non-negative")
        if self.with_nbytes:
            lines = [
                f"{step},{layer},{e},{n}"
                for e, n in zip(uniq.tolist(), sizes[first].tolist(), strict=True)
            ]
        else:
            lines = [f"{step},{layer},{e}" for e in uniq.tolist()]
        with self._lock:
            if self._closed:
                raise ValueError("recorder is closed")
            if step < self._last_step:
                raise ValueError(f"step {step} after step {self._last_step}")
            self._last_step = step
            self._rows.extend(lines)
            if len(self._rows) >= self._buffer_rows:
                self._flush_locked()

    def flush(self) -> None:
        with self._lock:
            self._flush_locked()

    def _flush_locked(self) -> None:
        if self._rows:
            with open(self.path, "a", encoding="utf-8", newline="\n") as f:
                f.write("\n".join(self._rows) + "\n")
            self.rows_written += len(self._rows)
            self._rows.clear()

    def close(self) -> None:
        with self._lock:
            self._flush_locked()
            self._closed = True

    def __enter__(self) -> TraceRecorder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _as_numpy(values: Any) -> Any:
    """Tensors (any device) become numpy arrays; everything else passes through."""
    if hasattr(values, "detach") and hasattr(values, "cpu"):
        return values.detach().cpu().numpy()
    return values


@dataclass(frozen=True)
class TraceSpec:
    """Parameters of a synthetic routing trace (see ``generate_trace``)."""

    kind: str = "zipf"
    a: float = 1.1  # Zipf exponent of expert popularity (0: uniform)
    layers: int = 8
    experts: int = 64
    steps: int = 200
    topk: int = 2
    tokens: int = 16  # tokens routed per layer per step (1 is decode-like)
    drift: float = 0.05  # per step, chance that an expert swaps popularity with another
    burst: float = 0.1  # per step and layer, chance that a burst starts
    burst_len: int = 5  # steps a burst lasts
    layer_skew: float = 0.25  # each layer's exponent is a * (1 + layer_skew * U(-1, 1))
    nbytes: int = 1 << 20  # bytes per access
    seed: int = 0

    def __post_init__(self) -> None:
        if self.kind != "zipf":
            raise ValueError(f"unknown trace kind {self.kind!r} (known: zipf)")
        if min(self.layers, self.experts, self.steps, self.tokens, self.topk) < 1:
            raise ValueError("layers, experts, steps, tokens and topk must be >= 1")
        if self.topk > self.experts:
            raise ValueError(f"topk {self.topk} > experts {self.experts}")
        if not (0 <= self.drift <= 1 and 0 <= self.burst <= 1):
            raise ValueError("drift and burst are probabilities")
        if (not 0 <= self.a < math.inf or not 0 <= self.layer_skew < math.inf
                or self.burst_len < 1 or self.nbytes < 0):  # (comparisons false for nan)
            raise ValueError("a, layer_skew must be finite and >= 0, nbytes >= 0 and "
                             "burst_len >= 1")

    def __str__(self) -> str:
        defaults = TraceSpec()
        parts = [
            f"{f.name}={getattr(self, f.name)}"
            for f in fields(self)
            if f.name != "kind" and getattr(self, f.name) != getattr(defaults, f.name)
        ]
        return f"{self.kind}:" + ",".join(parts)


def parse_spec(text: str) -> TraceSpec:
    """Parse ``"zipf:a=1.1,layers=8,experts=64,steps=200,topk=2,drift=0.05,seed=0"``.

    Omitted fields keep their defaults; ``"zipf"`` alone is the default spec.
    """
    kind, _, rest = text.strip().partition(":")
    types = {f.name: f.type for f in fields(TraceSpec)}
    values: dict[str, Any] = {"kind": kind.strip()}
    for item in filter(None, (p.strip() for p in rest.split(","))):
        name, eq, value = item.partition("=")
        name = name.strip()
        if not eq or name not in types or name == "kind":
            raise ValueError(f"bad trace spec item {item!r}; fields: {', '.join(types)}")
        values[name] = float(value) if types[name] in ("float", float) else int(value)
    return TraceSpec(**values)


def generate_trace(spec: TraceSpec | str) -> Trace:
    """A synthetic MoE routing trace, deterministic for a given spec (seed included).

    Per layer, expert popularity is Zipf: the expert at rank r has weight 1 / (r + 1)**a_l,
    with ranks a random permutation and a_l the layer's own exponent (``layer_skew``).
    Every step, each expert swaps its rank with a random expert with probability ``drift``
    (popularity drifts). With probability ``burst`` a layer starts a burst: one random expert
    gets as much weight as all the others together for ``burst_len`` steps. Each of
    ``tokens`` tokens picks ``topk`` distinct experts with probability proportional to the
    weights (Gumbel top-k sampling); the accesses of a (step, layer) are the distinct experts
    picked, in ascending order, and layers run in order within a step (forward order).
    """
    if isinstance(spec, str):
        spec = parse_spec(spec)
    rng = np.random.default_rng(spec.seed)
    n_exp = spec.experts
    exponents = spec.a * (1.0 + spec.layer_skew * rng.uniform(-1.0, 1.0, spec.layers))
    exponents = np.maximum(exponents, 0.0)
    ranks = [rng.permutation(n_exp) for _ in range(spec.layers)]  # expert -> rank
    burst_expert = np.full(spec.layers, -1)
    burst_left = np.zeros(spec.layers, dtype=np.int64)
    steps, layers, experts = [], [], []
    for step in range(spec.steps):
        for layer in range(spec.layers):
            rank = ranks[layer]
            swap = np.flatnonzero(rng.random(n_exp) < spec.drift)
            for e in swap.tolist():
                j = int(rng.integers(n_exp))
                rank[e], rank[j] = rank[j], rank[e]
            weights = 1.0 / (rank + 1.0) ** exponents[layer]
            if burst_left[layer] == 0 and rng.random() < spec.burst:
                burst_expert[layer] = int(rng.integers(n_exp))
                burst_left[layer] = spec.burst_len
            if burst_left[layer] > 0:
                b = burst_expert[layer]
                weights[b] += weights.sum() - weights[b]
                burst_left[layer] -= 1
            scores = np.log(weights) + rng.gumbel(size=(spec.tokens, n_exp))
            picked = np.argpartition(-scores, spec.topk - 1, axis=1)[:, : spec.topk]
            used = np.unique(picked)
            steps.append(np.full(used.size, step, np.int64))
            layers.append(np.full(used.size, layer, np.int64))
            experts.append(used.astype(np.int64))
    step_arr = np.concatenate(steps)
    return Trace(
        step_arr,
        np.concatenate(layers),
        np.concatenate(experts),
        np.full(step_arr.size, spec.nbytes, np.int64),
        True,
    )


def spec_dict(spec: TraceSpec) -> dict[str, Any]:
    """The spec as a plain dict (for JSON reports)."""
    return dataclasses.asdict(spec)
