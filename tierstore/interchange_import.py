"""Reading zarr groups and safetensors files back: a source is checked from its headers
(:func:`open_source`) before :func:`import_into` puts its tensors into a store."""

from __future__ import annotations

import json
import math
import os
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from .errors import ImportFormatError, StoreError
from .interchange_formats import (
    _FROM_NUMPY,
    _KIND,
    INDEX_NAME,
    ST_NAMES_META,
    ST_RAW_META,
    ZARR_FORMAT,
    Progress,
    _NoProgress,
    _pattern_ok,
    _st_split,
    _tensor_of,
    safetensors_dtypes,
)
from .sizes import parse_size
from .tensors import DTYPES, dtype_from_name, element_size, from_bytes

if TYPE_CHECKING:
    from .interface import Store

__all__ = [
    "ImportSource",
    "detect_format",
    "import_into",
    "open_source",
    "read_safetensors",
    "read_zarr",
    "safetensors_files",
]


# --------------------------------------------------------------------------- import plan


@dataclass(frozen=True)
class _Item:
    name: str
    kind: str
    nbytes: int
    origin: str  # where it comes from, for messages: "FILE: tensor 'KEY'"
    group: str  # items of one group are read together (one safetensors shard, one array)
    load: Callable[[Any], torch.Tensor]  # given the group's open handle


class ImportSource:
    """A checked import source: every tensor it holds, named, sized and ready to read. Built
    by :func:`open_source`, which reads headers only."""

    def __init__(self, src: str, fmt: str, items: list[_Item],
                 opener: Callable[[str], Any]) -> None:
        self.src, self.fmt, self.items, self._opener = src, fmt, items, opener

    @property
    def nbytes(self) -> int:
        return sum(i.nbytes for i in self.items)

    def keys(self) -> list[tuple[str, str]]:
        return [(i.name, i.kind) for i in self.items]

    def tensors(self) -> Iterator[tuple[str, str, torch.Tensor]]:
        """(name, kind, tensor), one group (safetensors shard) open at a time."""
        handle, group = None, None
        try:
            for item in self.items:
                if item.group != group:
                    _close(handle)
                    handle, group = None, item.group
                    handle = self._opener(item.group)
                yield item.name, item.kind, item.load(handle)
        finally:
            _close(handle)


def _close(handle: Any) -> None:
    if handle is not None and hasattr(handle, "__exit__"):
        handle.__exit__(None, None, None)


def _checked(items: list[_Item]) -> list[_Item]:
    """Refuse names a store cannot hold and sources where two tensors decode to one entry
    (the second would silently replace the first)."""
    from .keys import check_key

    seen: dict[tuple[str, str], str] = {}
    for item in items:
        try:
            check_key(item.name, item.kind)
        except StoreError as e:
            raise ImportFormatError(f"{item.origin}: {e}; rename it in the source") from None
        was = seen.setdefault((item.name, item.kind), item.origin)
        if was != item.origin:
            here = item.origin.partition(": ")[0]
            if was.startswith(here + ": "):  # both in one file: name it once
                was = was[len(here) + 2:]
            raise ImportFormatError(
                f"{item.origin} and {was} are both entry {item.name!r} (kind {item.kind!r}); "
                "remove or rename one of them")
    return items


def safetensors_files(src: str) -> list[str]:
    """The shard files of a safetensors source: a file, an index file or a directory."""
    return list(_safetensors_layout(src)[0])


def _safetensors_layout(src: str) -> tuple[list[str], dict[str, set[str]] | None, str | None]:
    """(shard files, {file: keys the index puts there} or None without an index, index)."""
    if os.path.isdir(src):
        index = os.path.join(src, INDEX_NAME)
        if not os.path.exists(index):
            found = sorted(f for f in os.listdir(src) if f.endswith(".safetensors"))
            if not found:
                raise ImportFormatError(f"{src}: no .safetensors files")
            return [os.path.join(src, f) for f in found], None, None
        src = index
    if not src.endswith(".json"):
        return [src], None, None
    hint = "re-export it, or import the .safetensors files' directory without the index"
    try:
        with open(src, encoding="utf-8") as f:
            index_doc = json.load(f)
    except (OSError, ValueError) as e:
        raise ImportFormatError(f"{src}: not a readable safetensors index ({e}); {hint}") \
            from None
    wmap = index_doc.get("weight_map") if isinstance(index_doc, dict) else None
    if not isinstance(wmap, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in wmap.items()):
        raise ImportFormatError(f"{src}: no weight_map of tensor names to shard files; {hint}")
    base = os.path.dirname(src)
    by_file: dict[str, set[str]] = defaultdict(set)
    for key, shard in wmap.items():
        if os.path.isabs(shard) or os.path.normpath(shard).startswith(".."):
            raise ImportFormatError(f"{src}: shard {shard!r} of tensor {key!r} lies outside "
                                    f"the index's directory; {hint}")
        by_file[os.path.join(base, shard)].add(key)
    missing = sorted(os.path.basename(p) for p in by_file if not os.path.isfile(p))
    if missing:
        raise ImportFormatError(f"{src}: names shards that are missing: "
                                f"{', '.join(missing[:3])}" + (" ..." if len(missing) > 3 else "")
                                + "; copy them beside the index")
    files = sorted(by_file)
    return files, dict(by_file), src


def _open_st(path: str) -> Any:
    from safetensors import SafetensorError, safe_open

    try:
        return safe_open(path, framework="pt").__enter__()
    except (SafetensorError, OSError, ValueError) as e:
        raise ImportFormatError(f"{path}: not a readable safetensors file ({e}); "
                                "re-export or re-download it") from None


def _plan_safetensors(src: str) -> list[_Item]:
    from safetensors import SafetensorError

    files, by_file, index = _safetensors_layout(src)
    readable = safetensors_dtypes()
    items: list[_Item] = []
    for path in files:
        f = _open_st(path)
        try:
            try:
                meta = f.metadata() or {}
                keys = list(f.keys())
                heads = {k: (f.get_slice(k).get_dtype(), list(f.get_slice(k).get_shape()))
                         for k in keys}
            except (SafetensorError, OSError, ValueError, TypeError) as e:
                raise ImportFormatError(f"{path}: unreadable safetensors header ({e}); "
                                        "re-export or re-download it") from None
        finally:
            _close(f)
        if by_file is not None:
            lacking = sorted(by_file[path] - set(keys))
            stray = sorted(set(keys) - by_file[path])
            if lacking:
                raise ImportFormatError(f"{index}: puts tensor {lacking[0]!r} in {path}, which "
                                        "lacks it; fix the index or the shard")
            if stray:
                raise ImportFormatError(f"{path}: holds tensor {stray[0]!r}, which {index} does "
                                        "not list there; fix the index or the shard")
        escaped = meta.get(ST_NAMES_META) == "escaped"
        raw = _raw_dtypes(path, meta)
        for key in keys:
            items.append(_st_item(path, key, heads[key], escaped, raw.get(key), readable))
    return items


def _raw_dtypes(path: str, meta: dict[str, str]) -> dict[str, str]:
    if ST_RAW_META not in meta:
        return {}
    try:
        raw = json.loads(meta[ST_RAW_META])
    except ValueError:
        raw = None
    if not isinstance(raw, dict) or not all(isinstance(v, str) and v in DTYPES
                                            for v in raw.values()):
        raise ImportFormatError(f"{path}: metadata {ST_RAW_META!r} is not a map of tensor "
                                "names to dtype names; re-export the file")
    return raw


def _st_item(path: str, key: str, head: tuple[str, list[int]], escaped: bool,
             raw: str | None, readable: dict[str, torch.dtype]) -> _Item:
    origin = f"{path}: tensor {key!r}"
    split = _st_split(key, escaped)
    if split is None:
        raise ImportFormatError(f"{origin} is no name#kind key tierstore writes; "
                                "re-export the file")
    code, shape = head
    if code not in readable:
        raise ImportFormatError(f"{origin} has dtype {code}, which tierstore cannot import; "
                                "convert it to a supported dtype")
    if raw is None:
        nbytes = math.prod(shape) * element_size(readable[code])

        def load(f: Any) -> torch.Tensor:
            return _st_get(f, key, origin)
    else:
        dtype, width = dtype_from_name(raw), element_size(dtype_from_name(raw))
        if code != "U8" or not shape or shape[-1] != width:
            raise ImportFormatError(f"{origin}: raw {raw} bytes should be U8 [..., {width}], "
                                    f"the file has {code} {shape}; re-export the file")
        nbytes, value_shape = math.prod(shape), tuple(shape[:-1])

        def load(f: Any) -> torch.Tensor:
            b = _st_get(f, key, origin).contiguous().reshape(-1)
            return from_bytes(b, dtype, value_shape)
    return _Item(split[0], split[1], nbytes, origin, path, load)


def _st_get(f: Any, key: str, origin: str) -> torch.Tensor:
    from safetensors import SafetensorError

    try:
        return f.get_tensor(key)
    except (SafetensorError, OSError, ValueError, TypeError, RuntimeError) as e:
        raise ImportFormatError(f"{origin}: unreadable ({e}); re-export or re-download "
                                "the file") from None


def _zarr_arrays(group: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    for name, arr in group.arrays():
        yield prefix + name, arr
    for name, sub in group.groups():
        yield from _zarr_arrays(sub, prefix + name + "/")


def _plan_zarr(src: str) -> list[_Item]:
    import zarr

    try:
        root = zarr.open_group(src, mode="r")
        fmt = root.attrs.get("tierstore")
        arrays = sorted(_zarr_arrays(root))
    except Exception as e:  # noqa: BLE001  (zarr raises many types for damaged metadata)
        where = _damaged_metadata(src) or src
        raise ImportFormatError(f"{where}: not readable zarr metadata ({type(e).__name__}: "
                                f"{e}); re-export the group") from None
    if isinstance(fmt, dict) and isinstance(fmt.get("format"), int) \
            and fmt["format"] > ZARR_FORMAT:
        raise ImportFormatError(f"{src}: written in tierstore zarr format {fmt['format']}; "
                                "import it with a newer tierstore")
    items: list[_Item] = []
    for path, arr in arrays:
        items.extend(_zarr_items(src, path, arr))
    return items


def _damaged_metadata(src: str) -> str | None:
    """The first ``zarr.json`` under ``src`` that is no JSON object (zarr's own errors for
    one seldom name it)."""
    for top, dirs, files in os.walk(src):
        dirs.sort()
        if "zarr.json" in files:
            path = os.path.join(top, "zarr.json")
            try:
                with open(path, encoding="utf-8") as f:
                    ok = isinstance(json.load(f), dict)
            except (OSError, ValueError):
                ok = False
            if not ok:
                return path
    return None


def _zarr_items(src: str, path: str, arr: Any) -> list[_Item]:
    where = f"{src}: zarr array {path!r}"
    dt = arr.dtype
    native = None
    if isinstance(dt, np.dtype) and dt.kind in "biufc":
        native = _FROM_NUMPY.get(dt.newbyteorder("="))
    shape = tuple(arr.shape)
    attrs = arr.attrs.get("tierstore")
    if attrs is None:
        if native is None:
            raise ImportFormatError(f"{where} has dtype {dt}, which a store cannot hold; "
                                    "convert it to a numeric dtype or leave it out")
        nbytes = math.prod(shape) * element_size(native)
        return [_Item(path.replace("/", "."), "param", nbytes, where, path,
                      lambda _h: _zarr_read(arr, where, ..., None))]
    fix = "the attributes contradict the array; re-export it"
    if not isinstance(attrs, dict):
        raise ImportFormatError(f"{where}: tierstore attribute is not an object; {fix}")
    kind = path.split("/", 1)[0] if "/" in path else ""
    if not _KIND.match(kind):
        raise ImportFormatError(f"{where} is not in a state kind's group; {fix}")
    stored, raw = attrs.get("dtype"), attrs.get("raw_bits", False)
    if not isinstance(stored, str) or stored not in DTYPES or not isinstance(raw, bool):
        raise ImportFormatError(f"{where}: tierstore dtype {stored!r} (raw_bits {raw!r}) is "
                                f"no dtype a store holds; {fix}")
    dtype = DTYPES[stored]
    if raw:
        width = element_size(dtype)
        ok = isinstance(dt, np.dtype) and dt.kind == "u" and dt.itemsize == width
    else:
        ok = native == dtype
    if not ok:
        raise ImportFormatError(f"{where} has dtype {dt}, its tierstore attributes say "
                                f"{stored}" + (" as raw bits" if raw else "") + f"; {fix}")
    bits = stored if raw else None
    if attrs.get("chunks") == "all" and arr.nchunks_initialized != arr.nchunks:
        raise ImportFormatError(
            f"{where}: {arr.nchunks - arr.nchunks_initialized} of its {arr.nchunks} chunks "
            "are missing (the export was damaged); re-export it")
    if "pattern" in attrs:
        pattern, experts = attrs["pattern"], attrs.get("experts")
        if not _pattern_ok(pattern):
            raise ImportFormatError(f"{where}: pattern {pattern!r} is not a name with one "
                                    f"'{{}}' for the expert id; {fix}")
        if (not isinstance(experts, list) or not shape or len(experts) != shape[0]
                or not all(type(e) is int and e >= 0 for e in experts)
                or len(set(experts)) != len(experts)):
            raise ImportFormatError(f"{where}: experts {str(experts)[:60]} are not "
                                    f"{shape[0] if shape else 'its first dimension of'} "
                                    f"distinct ids for shape {list(shape)}; {fix}")
        nbytes = math.prod(shape[1:]) * element_size(dtype)
        return [_Item(pattern.format(idx), kind, nbytes, f"{where} expert {idx}", path,
                      lambda _h, i=i: _zarr_read(arr, where, i, bits))
                for i, idx in enumerate(experts)]
    name = attrs.get("name")
    if not isinstance(name, str):
        raise ImportFormatError(f"{where}: no entry name in its tierstore attributes; {fix}")
    return [_Item(name, kind, math.prod(shape) * element_size(dtype), where, path,
                  lambda _h: _zarr_read(arr, where, ..., bits))]


def _zarr_read(arr: Any, where: str, at: Any, stored: str | None) -> torch.Tensor:
    try:
        a = np.asarray(arr[at])
    except Exception as e:  # noqa: BLE001  (codecs and stores raise many types)
        raise ImportFormatError(f"{where}: unreadable ({type(e).__name__}: {e}); "
                                "re-export it") from None
    return _tensor_of(a, stored)


def open_source(src: str, fmt: str | None = None) -> ImportSource:
    """Check ``src`` (zarr group, safetensors file, directory or index) from its headers and
    return what it holds; raises :class:`ImportFormatError` naming the file or tensor."""
    fmt = fmt or detect_format(src)
    if fmt == "zarr":
        return ImportSource(src, fmt, _checked(_plan_zarr(src)), lambda _g: None)
    return ImportSource(src, fmt, _checked(_plan_safetensors(src)), _open_st)


def read_zarr(src: str) -> Iterator[tuple[str, str, torch.Tensor]]:
    """(name, kind, tensor) for every tensor in a zarr group, one expert chunk at a time.

    Arrays this module wrote come back under their original names and kinds; arrays of
    other zarr groups are named by their path with '/' turned into '.', kind ``param``.
    """
    yield from open_source(src, "zarr").tensors()


def read_safetensors(src: str) -> Iterator[tuple[str, str, torch.Tensor]]:
    yield from open_source(src, "safetensors").tensors()


def detect_format(src: str) -> str:
    """'zarr' or 'safetensors', from what is at ``src``."""
    if os.path.isdir(src) and (
        os.path.exists(os.path.join(src, "zarr.json")) or os.path.exists(os.path.join(src, ".zgroup"))
    ):
        return "zarr"
    if src.endswith((".safetensors", ".json")) or os.path.isdir(src):
        return "safetensors"
    raise ImportFormatError(f"{src}: neither a zarr group nor safetensors (file, index or "
                            "directory)")


def import_into(
    store: Store,
    src: str | ImportSource,
    *,
    fmt: str | None = None,
    batch_bytes: int | str = "256MiB",
    progress: Progress | None = None,
) -> int:
    """Put every tensor of ``src`` into ``store`` in batches of about ``batch_bytes``
    (each batch one commit); returns the number of tensors imported. The whole source is
    checked (:func:`open_source`) before the first batch is stored."""
    progress = progress or _NoProgress()
    source = src if isinstance(src, ImportSource) else open_source(src, fmt)
    limit, batch, size, n = parse_size(batch_bytes), [], 0, 0
    for name, kind, tensor in source.tensors():
        batch.append((name, kind, tensor))
        size += tensor.nbytes
        if size >= limit:
            store.put_many(batch)
            progress.update(size)
            n, batch, size = n + len(batch), [], 0
    if batch:
        store.put_many(batch)
        progress.update(size)
        n += len(batch)
    return n
