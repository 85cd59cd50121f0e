"""Export to and import from zarr v3 and safetensors.

zarr layout: one group per state kind (``param``, ``exp_avg``, ...). Tensors named
``<prefix>.experts.<N>.<suffix>`` with one dtype and shape form a *family*: one array of shape
``[n_experts, *shape]`` chunked ``[1, *shape]``, so each expert is one chunk and can be read
alone. Its attributes name the pattern and the expert ids. Any other tensor is an array of
its own, whose attributes hold its name. Array names are the entry names with ``%``, ``/``
and ``\\`` percent-escaped (plus the few names zarr or the file system reserve), so every
entry is one array directly under its kind's group; the attributes, not the array names, say
which entries an array holds. Dtypes numpy lacks (bfloat16, the float8s, ...) are kept as raw
unsigned integers of the same width with a ``tierstore.dtype`` attribute, so they round-trip
bit for bit.

safetensors: a ``param`` is stored under its name and any other state kind as
``name#kind``, with ``%`` and ``#`` in names percent-escaped (``%25``, ``%23``) so that no two
entries share a key; the file's metadata says so (``tierstore.names``), and files without it
(older exports, other tools) are read with their keys as they are. Dtypes safetensors lacks
(complex128, ...) are stored as ``uint8 [*shape, element size]`` with their dtype named in the
metadata (``tierstore.raw_dtypes``). Large exports are sharded with a Hugging Face style
``model.safetensors.index.json``; imports read single files, sharded directories and index
files.

Both exporters take every dtype a store holds, and the importers take back everything the
exporters write, plus foreign numeric arrays and tensors. An import reads and checks every
header (names, dtypes, shapes, duplicates) before it stores anything, and reads one
safetensors shard at a time. An export checks, once written, that it holds one tensor per
entry and removes what it wrote when it fails.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
import string
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

from .errors import CorruptEntryError, ImportFormatError, StoreError
from .sizes import parse_size
from .tensors import DTYPES, as_bytes, dtype_from_name, dtype_name, element_size, from_bytes

if TYPE_CHECKING:
    from .store import Store

_EXPERT = re.compile(r"^(?P<pre>.*\.experts)\.(?P<idx>\d+)\.(?P<post>.+)$")
_NATIVE = {
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
    torch.uint16, torch.uint32, torch.uint64, torch.float16, torch.float32, torch.float64,
    torch.complex64, torch.complex128,
}
# numpy dtypes a foreign zarr array may have (in native byte order), as torch dtypes
_FROM_NUMPY = {np.dtype(str(t).removeprefix("torch.")): t for t in _NATIVE}
_KIND = re.compile(r"^[a-z][a-z0-9_]{0,31}$")
_PCT = re.compile(r"%([0-9A-F]{2})")
KIND_SEP = "#"
INDEX_NAME = "model.safetensors.index.json"
ST_NAMES_META = "tierstore.names"  # "escaped": keys are _st_key's encoding
ST_RAW_META = "tierstore.raw_dtypes"  # JSON {key: dtype name} of tensors kept as raw bytes
ZARR_FORMAT = 1
_MAX_NODE_BYTES = 200  # file names are at most 255 bytes on common file systems


class Progress(Protocol):
    def update(self, n: int) -> Any: ...


class _NoProgress:
    def update(self, n: int) -> None:
        pass


# --------------------------------------------------------------------------- name encoding


def _escape(s: str, chars: str) -> str:
    return "".join(f"%{ord(c):02X}" if c == "%" or c in chars else c for c in s)


def _unescape(s: str) -> str:
    return _PCT.sub(lambda m: chr(int(m[1], 16)), s)


def _st_key(name: str, kind: str) -> str:
    esc = _escape(name, KIND_SEP)
    return esc if kind == "param" else f"{esc}{KIND_SEP}{kind}"


def _st_split(key: str, escaped: bool) -> tuple[str, str] | None:
    """(name, kind) of a safetensors key; ``None`` for a key that ``_st_key`` cannot have
    written (in a file whose metadata says it was)."""
    if not escaped:  # an older export or another tool's file: keys are names as they are
        name, sep, kind = key.rpartition(KIND_SEP)
        if sep and _KIND.match(kind):
            return name, kind
        return key, "param"
    esc, sep, kind = key.rpartition(KIND_SEP)
    if not sep:
        esc, kind = key, "param"
    name = _unescape(esc)
    if (sep and not _KIND.match(kind)) or _st_key(name, kind) != key:
        return None
    return name, kind


def zarr_node(name: str) -> str:
    """The array name ``name`` gets under its kind's group: one path segment that is a valid
    zarr node and file name. Names without ``%``, ``/`` or ``\\`` keep their spelling;
    different names never share a node (but for a hash collision of very long names, which
    the export refuses)."""
    esc = _escape(name, "/\\")  # zarr reads both as path separators
    if not esc.strip("."):  # "." and ".." are no node names
        esc = esc.replace(".", "%2E")
    elif esc == "zarr.json":  # the group's own metadata file
        esc = "zarr%2Ejson"
    if esc.startswith("__"):  # reserved by the zarr v3 spec
        esc = "%5F" + esc[1:]
    if len(esc.encode()) > _MAX_NODE_BYTES:
        digest = hashlib.sha256(name.encode()).hexdigest()[:24]
        head = esc.encode()[: _MAX_NODE_BYTES - 40].decode(errors="ignore")
        esc = f"{head}%~{digest}"  # '%~' is no escape: no short name looks like this
    return esc


def _format_pattern(pre: str, post: str) -> str:
    """``pre.{}.post`` as a ``str.format`` template (braces in the names doubled)."""
    def q(s: str) -> str:
        return s.replace("{", "{{").replace("}", "}}")
    return f"{q(pre)}.{{}}.{q(post)}"


def _pattern_ok(pattern: Any) -> bool:
    """Whether ``pattern`` is a template with exactly one plain ``{}`` field."""
    if not isinstance(pattern, str):
        return False
    try:
        fields = [(f, spec, conv) for _, f, spec, conv in string.Formatter().parse(pattern)
                  if f is not None]
    except ValueError:
        return False
    return fields == [("", "", None)]


# --------------------------------------------------------------------------- dtypes


def _numpy_of(t: torch.Tensor) -> tuple[np.ndarray, str | None]:
    """(numpy array, stored dtype name when the array holds raw bits instead)."""
    if t.dtype in _NATIVE:
        return t.contiguous().numpy(), None
    width = element_size(t.dtype)
    if width not in (1, 2, 4, 8):  # every dtype the store holds is native or one of these
        raise StoreError(f"dtype {t.dtype} has no raw zarr form")
    return as_bytes(t).view(f"<u{width}").reshape(t.shape), dtype_name(t.dtype)


def _tensor_of(a: np.ndarray, stored: str | None) -> torch.Tensor:
    a = np.asarray(a)
    if a.dtype.byteorder not in ("=", "|"):
        a = a.astype(a.dtype.newbyteorder("="))
    a = np.array(a, copy=True, order="C")  # ascontiguousarray would make a 0-d array 1-d
    if stored is None:
        return torch.from_numpy(a)
    return torch.from_numpy(a.reshape(-1)).view(dtype_from_name(stored)).reshape(a.shape)


def _st_native() -> set[torch.dtype]:
    """torch dtypes safetensors writes as themselves (the rest go as raw bytes)."""
    import safetensors.torch

    types = getattr(safetensors.torch, "_TYPES", None)
    if isinstance(types, dict) and types:
        return set(types.values())
    return {torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64,
            torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
            torch.float8_e4m3fn, torch.float8_e5m2}


def safetensors_dtypes() -> dict[str, torch.dtype]:
    """safetensors dtype codes that load as torch tensors."""
    import safetensors.torch

    types = getattr(safetensors.torch, "_TYPES", None)
    if isinstance(types, dict) and types:
        return dict(types)
    return {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
            "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32,
            "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
            "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


def _st_raw(t: torch.Tensor) -> torch.Tensor:
    """A tensor of a dtype safetensors lacks as ``uint8 [*shape, element size]``."""
    return torch.from_numpy(as_bytes(t)).reshape(*t.shape, element_size(t.dtype))


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
    from .store import check_key

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


# --------------------------------------------------------------------------- export


def _read_entry(store: Store, name: str, kind: str) -> torch.Tensor:
    """An entry for export; a damaged one is a CorruptEntryError naming it."""
    fix = "the export was removed; check the store with `tierstore fsck`"
    try:
        return store.get(name, kind)
    except CorruptEntryError as e:
        detail = str(e).split(" is corrupt: ", 1)[-1]
        raise CorruptEntryError(name, kind, f"{detail}; {fix}") from None
    except OSError as e:
        raise CorruptEntryError(name, kind, f"its bytes cannot be read ({e}); {fix}") from None


def _check_written(store_keys: list[tuple[str, str]], written: list[tuple[str, str]],
                   out: str) -> None:
    """An export must hold exactly one tensor per entry, under that entry's name and kind."""
    if sorted(written) != sorted(store_keys):
        lost = sorted(set(store_keys) - set(written))
        raise StoreError(f"{out}: the export holds {len(written)} tensors for "
                         f"{len(store_keys)} entries (first lost: {lost[:1]}); it was removed")


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        os.unlink(path)


def _families(store: Store) -> dict[str, list[tuple[str, str, int, str]]]:
    """Group entries into zarr arrays: {array path: [(name, kind, expert id, pattern)]}.

    Every path is ``kind/node``. A family whose node another array would have too (an entry
    named like the family, or another family) is stored as single arrays instead."""
    groups: dict[tuple[str, str, str, str, tuple[int, ...]], list[tuple[str, int]]] = \
        defaultdict(list)
    singles: list[tuple[str, str]] = []
    for name, kind in store.keys():  # noqa: SIM118  (Store.keys is not a dict view)
        m = _EXPERT.match(name)
        if m:
            info = store.info(name, kind)
            key = (kind, m["pre"], m["post"], str(info.dtype), info.shape)
            groups[key].append((name, int(m["idx"])))
        else:
            singles.append((name, kind))
    by_path: dict[str, list[tuple[str, str, str, list[tuple[str, int]]]]] = defaultdict(list)
    for (kind, pre, post, _, _), members in groups.items():
        by_path[f"{kind}/{zarr_node(f'{pre}.{post}')}"].append((kind, pre, post, members))
    families: dict[str, tuple[str, str, str, list[tuple[str, int]]]] = {}
    for path, fams in by_path.items():
        if len(fams) == 1:
            families[path] = fams[0]
        else:  # experts that disagree on dtype/shape, or patterns that read alike
            singles.extend((n, f[0]) for f in fams for n, _ in f[3])
    taken: dict[str, tuple[str, str]] = {}

    def take(name: str, kind: str) -> None:
        node = f"{kind}/{zarr_node(name)}"
        if node in taken:  # only where zarr_node hashed two long names alike
            raise StoreError(f"entries {taken[node][0]!r} and {name!r} (kind {kind!r}) would "
                             "share a zarr array; shorten one of the names")
        taken[node] = (name, kind)

    for name, kind in singles:
        take(name, kind)
    while clash := [p for p in families if p in taken]:
        for path in clash:  # its members may in turn take another family's node
            kind, _, _, members = families.pop(path)
            for name, _ in members:
                take(name, kind)
    out: dict[str, list[tuple[str, str, int, str]]] = {}
    for path, (kind, pre, post, members) in families.items():
        pattern = _format_pattern(pre, post)
        out[path] = [(n, kind, idx, pattern) for n, idx in sorted(members, key=lambda x: x[1])]
    for path, (name, kind) in taken.items():
        out[path] = [(name, kind, -1, "")]
    return out


def export_zarr(store: Store, out: str, progress: Progress | None = None) -> int:
    """Write every live entry to a new zarr v3 group at ``out``; returns bytes exported."""
    import zarr

    progress = progress or _NoProgress()
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        raise StoreError(f"{out} exists and is not empty")
    keys = store.keys()
    families = _families(store)
    created = not os.path.exists(out)

    def undo() -> None:  # out was missing or empty: all in it is this export's
        if created:
            _remove(out)
        elif os.path.isdir(out):
            for child in os.listdir(out):
                _remove(os.path.join(out, child))

    total = 0
    try:
        root = zarr.open_group(out, mode="w", zarr_format=3)
        root.attrs["tierstore"] = {"format": ZARR_FORMAT, "layout": "one array per tensor family"}
        for path, members in families.items():
            kind = members[0][1]
            first = _read_entry(store, members[0][0], kind)
            arr_np, stored = _numpy_of(first)
            family = members[0][2] >= 0
            shape = ((len(members),) if family else ()) + arr_np.shape
            chunks = tuple(max(1, s) for s in (((1,) if family else ()) + arr_np.shape))
            group_path, _, arr_name = path.rpartition("/")
            group = root.require_group(group_path)
            # Every chunk is written, zeros too, so a chunk file that goes missing is an
            # error on import rather than a tensor of zeros.
            arr = group.create_array(
                arr_name, shape=shape, chunks=chunks, dtype=arr_np.dtype, compressors=None,
                fill_value=0, config={"write_empty_chunks": True},
            )
            attrs: dict[str, Any] = {"dtype": stored or dtype_name(first.dtype),
                                     "raw_bits": stored is not None, "chunks": "all"}
            if family:
                attrs.update(pattern=members[0][3], experts=[m[2] for m in members])
            else:
                attrs["name"] = members[0][0]
            arr.attrs["tierstore"] = attrs
            for i, (name, _, _, _) in enumerate(members):
                t = first if i == 0 else _read_entry(store, name, kind)
                a, _ = _numpy_of(t)
                if family:
                    arr[i] = a
                else:
                    arr[...] = a
                total += t.nbytes
                progress.update(t.nbytes)
        _check_written(keys, open_source(out, "zarr").keys(), out)
    except OSError as e:
        undo()
        raise StoreError(f"{out}: cannot write the export ({e}); it was removed") from None
    except BaseException:
        undo()
        raise
    return total


def export_safetensors(
    store: Store, out: str, *, shard_size: int | str = "4GiB", progress: Progress | None = None
) -> int:
    """Write live entries to ``out``: a single ``.safetensors`` file if ``out`` ends so and
    everything fits one shard, else a directory of shards with an index."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    progress = progress or _NoProgress()
    limit = parse_size(shard_size)
    keys = store.keys()
    single = out.endswith(".safetensors")
    native = _st_native()
    shards: list[list[tuple[str, str]]] = [[]]
    size = 0
    for name, kind in keys:
        n = store.info(name, kind).nbytes
        if shards[-1] and size + n > limit:
            shards.append([])
            size = 0
        shards[-1].append((name, kind))
        size += n
    if single and len(shards) > 1:
        raise StoreError(f"{out}: the store is larger than shard_size; export to a directory")
    if not single and os.path.exists(out) and not os.path.isdir(out):
        raise StoreError(f"{out} exists and is not a directory")
    created = not single and not os.path.exists(out)
    written: list[str] = []

    def undo() -> None:
        if created:
            _remove(out)
        for path in written:
            _remove(path)

    total, weight_map = 0, {}
    fname = out
    try:
        if not single:
            os.makedirs(out, exist_ok=True)
        for i, shard in enumerate(shards):
            fname = out if single else os.path.join(
                out, f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            )
            tensors, raw = {}, {}
            for name, kind in shard:
                t = _read_entry(store, name, kind)
                key = _st_key(name, kind)
                if t.dtype not in native:
                    raw[key] = dtype_name(t.dtype)
                    tensors[key] = _st_raw(t)
                else:
                    tensors[key] = t
                weight_map[key] = os.path.basename(fname)
                total += t.nbytes
                progress.update(t.nbytes)
            meta = {"format": "pt", "producer": "tierstore", ST_NAMES_META: "escaped"}
            if raw:
                meta[ST_RAW_META] = json.dumps(raw)
            written.append(fname)
            save_file(tensors, fname, metadata=meta)
        if not single:
            fname = os.path.join(out, INDEX_NAME)
            written.append(fname)
            with open(fname, "w") as f:
                json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f,
                          indent=1)
        _check_written(keys, open_source(out, "safetensors").keys(), out)
    except (OSError, SafetensorError) as e:
        undo()
        raise StoreError(f"{fname}: cannot write the export ({e}); it was removed") from None
    except BaseException:
        undo()
        raise
    return total
