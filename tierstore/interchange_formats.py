"""What the zarr and safetensors interchange files share in both directions: the format
constants, how entry names become safetensors keys and zarr nodes, and the form each dtype
takes in either format (``interchange`` describes the layouts)."""

from __future__ import annotations

import hashlib
import re
import string
from typing import Any, Protocol

import numpy as np
import torch

from .errors import StoreError
from .tensors import as_bytes, dtype_from_name, dtype_name, element_size

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
