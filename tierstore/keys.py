"""Entry keys: what a name, a kind and a snapshot tag may be, and the forms the store's
calls take keys in. One copy of these rules serves every store, the daemon and the import
tools, so they all refuse the same things with the same errors."""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence

import torch

from .errors import SnapshotError, StoreError
from .tensors import dtype_name, element_size

Key = tuple[str, str]
KINDS = ("param", "grad", "exp_avg", "exp_avg_sq", "master")
_KIND = re.compile(r"^[a-z][a-z0-9_]{0,31}$")
_TAG = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
MAX_NAME_BYTES = 400  # LMDB keys are at most 511 bytes; snapshot keys add the tag

# What put_many takes: a mapping of names to tensors, or (name, tensor) / (name, kind, tensor).
PutItems = (Mapping[str, torch.Tensor]
            | Iterable[tuple[str, torch.Tensor] | tuple[str, str, torch.Tensor]])
Device = str | torch.device | None


def check_name(name: str) -> None:
    if not isinstance(name, str) or not name:
        raise StoreError(f"entry names are non-empty strings, got {name!r}")
    try:
        size = len(name.encode())
    except UnicodeEncodeError:
        raise StoreError(f"entry name {name[:60]!r} is not valid UTF-8") from None
    if "\0" in name or size > MAX_NAME_BYTES:
        raise StoreError(f"invalid entry name {name[:60]!r}: no NUL, at most {MAX_NAME_BYTES} bytes")


def check_kind(kind: str) -> None:
    if not isinstance(kind, str) or not _KIND.match(kind):
        raise StoreError(
            f"invalid state kind {kind!r}: lowercase identifier such as {', '.join(KINDS)}"
        )


@functools.lru_cache(maxsize=1 << 16)
def _checked_key(name: str, kind: str) -> None:
    check_name(name)
    check_kind(kind)


def check_key(name: str, kind: str) -> None:
    """``check_name`` and ``check_kind``, remembered for keys that passed: the readers that
    ask for the same keys every pass (a ring, a trainer) pay for the checks once."""
    if type(name) is str and type(kind) is str:
        _checked_key(name, kind)  # an invalid key raises, and raising is not cached
    else:
        check_name(name)
        check_kind(kind)


def check_tag(tag: str) -> None:
    if not isinstance(tag, str) or not _TAG.match(tag):
        raise SnapshotError(f"invalid snapshot tag {tag!r}: letters, digits, '.', '_', '-'")


def as_key(key: str | Key) -> Key:
    """A name (of kind ``param``) or a ``(name, kind)`` pair as a pair, as ``in`` takes."""
    return (key, "param") if isinstance(key, str) else key


def _iterable(what: str, items: object, expected: str) -> Iterable[object]:
    if isinstance(items, (str, bytes)) or not isinstance(items, Iterable):
        raise StoreError(f"{what} takes {expected}, got {type(items).__name__} {items!r:.60}")
    return items


def read_keys(names: str | Iterable[str | Key], kind: str
              ) -> tuple[list[str | Key], list[Key]]:
    """The keys as asked (for the caller's dict) and as validated ``(name, kind)`` pairs;
    one name alone is one key."""
    asked = [names] if isinstance(names, str) else list(
        _iterable("reading several entries", names, "names or (name, kind) pairs"))
    keys: list[Key] = []
    for i, a in enumerate(asked):
        if isinstance(a, str):
            keys.append((a, kind))
        elif isinstance(a, (tuple, list)) and len(a) == 2:
            keys.append((a[0], a[1]))
            asked[i] = keys[-1]  # a list pair keys the caller's dict as a tuple
        else:
            raise StoreError(f"expected a name or a (name, kind) pair, got {a!r:.60}")
        check_key(*keys[-1])
    return asked, keys


def put_items(items: PutItems, kind: str) -> Iterator[tuple[str, str, torch.Tensor]]:
    """``put_many``'s items as validated ``(name, kind, tensor)``."""
    if isinstance(items, Mapping):
        items = items.items()
    for item in _iterable("put_many", items, "a mapping of names to tensors, or "
                          "(name, tensor) or (name, kind, tensor) items"):
        if isinstance(item, (tuple, list)) and len(item) == 3:
            name, k, tensor = item
        elif isinstance(item, (tuple, list)) and len(item) == 2:
            (name, tensor), k = item, kind
        else:
            raise StoreError(f"put_many takes (name, tensor) or (name, kind, tensor) items, "
                             f"got {item!r:.60}")
        check_key(name, k)
        yield name, k, tensor


def prefetch_keys(names: str | Iterable[str | Key], kind: str) -> list[Key]:
    """Validated ``(name, kind)`` keys from a name, or names and ``(name, kind)`` pairs."""
    keys = []
    for item in [names] if isinstance(names, str) else names:
        if isinstance(item, str):
            name, k = item, kind
        elif isinstance(item, (tuple, list)) and len(item) == 2:
            name, k = item
        else:
            raise StoreError(f"expected a name or a (name, kind) pair, got {item!r}")
        check_name(name)
        check_kind(k)
        keys.append((name, k))
    return keys


StageEntry = tuple[Key, torch.dtype, tuple[int, ...], int]


def stage_entries(items: Iterable[tuple[str, str, torch.dtype, Sequence[int]]]
                  ) -> list[StageEntry]:
    """``stage_many``'s items checked: ``((name, kind), dtype, shape, nbytes)`` each."""
    entries = []
    for name, k, dtype, shape in items:
        check_name(name)
        check_kind(k)
        dtype_name(dtype)  # refuses what the store cannot hold
        shape = tuple(int(d) for d in shape)
        if any(d < 0 for d in shape):
            raise ValueError(f"negative dimension in shape {shape} of {name!r}")
        nbytes = element_size(dtype) * math.prod(shape)
        entries.append(((name, k), dtype, shape, nbytes))
    return entries
