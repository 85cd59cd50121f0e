"""Tensors as stored bytes: dtype names that survive a round trip, and byte views."""

from __future__ import annotations

import ctypes
import functools
import math
import operator

import numpy as np
import torch

from tierstore.nvme import ALIGNMENT
from tierstore.nvme.buffers import small_huge_empty

from .errors import UnsupportedTensorError

# Every dtype a dense tensor can hold as plain bytes, by its stable name.
DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d
    for d in (getattr(torch, n) for n in dir(torch))
    if isinstance(d, torch.dtype)
}
for _q in ("qint8", "quint8", "qint32", "quint4x2", "quint2x4"):
    DTYPES.pop(_q, None)


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return _NAMES[dtype]
    except KeyError:
        raise UnsupportedTensorError(f"dtype {dtype} cannot be stored as raw bytes") from None


# By dtype, not through str(dtype): that cost 2-3 us, asked twice for every entry a put writes.
_NAMES: dict[torch.dtype, str] = {d: name for name, d in DTYPES.items()}


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise UnsupportedTensorError(f"unknown dtype {name!r} in the catalog") from None


@functools.cache
def element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def as_bytes(tensor: torch.Tensor) -> np.ndarray:
    """The tensor's bytes as a flat uint8 numpy array; a view where the tensor allows it.

    Moves device tensors to the host and makes non-contiguous ones contiguous (a copy).
    """
    if not isinstance(tensor, torch.Tensor):
        raise UnsupportedTensorError(f"expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.is_quantized:
        raise UnsupportedTensorError("cannot store a quantized tensor; dequantize it first")
    if tensor.is_sparse or tensor.layout != torch.strided:
        raise UnsupportedTensorError(f"cannot store a {tensor.layout} tensor; densify it first")
    if tensor.is_meta or tensor.is_nested:
        raise UnsupportedTensorError("cannot store a meta or nested tensor: it has no flat bytes")
    dtype_name(tensor.dtype)
    # Each step only where it does something: asked unconditionally, they were a quarter
    # of a small put's per-entry cost.
    t = tensor.detach() if tensor.requires_grad else tensor
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    if not t.is_cpu:
        t = t.cpu()
    try:
        t = t.contiguous()
    except NotImplementedError as e:  # placeholder dtypes (int1..int7, bits*) have no kernels
        raise UnsupportedTensorError(
            f"a non-contiguous {tensor.dtype} tensor cannot be copied by torch; "
            "store a contiguous one"
        ) from e
    if t.numel() == 0:
        return np.empty(0, dtype=np.uint8)
    return raw_bytes(t, t.numel() * t.element_size())


def raw_bytes(tensor: torch.Tensor, nbytes: int) -> np.ndarray:
    """``nbytes`` of host memory from ``tensor``'s first byte (they may run past the tensor,
    into its storage or a cache slot), as a uint8 numpy array over them that keeps the
    tensor alive: no copy, whatever the dtype.

    A view through ctypes: 0.7 us, where ``Tensor.numpy()`` and a byte view took 1.9 us a
    tensor (3.1 for dtypes numpy lacks, through torch's own view), and a torch view of the
    storage six times as much: a put or a read of 4,096 entries asks once an entry."""
    raw = (ctypes.c_uint8 * nbytes).from_address(tensor.data_ptr())
    raw.tensor = tensor  # type: ignore[attr-defined]
    return np.frombuffer(raw, np.uint8)


def from_bytes(buf: np.ndarray | torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor of ``dtype`` and ``shape`` over the first bytes of ``buf`` (no copy)."""
    u8 = torch.from_numpy(buf) if isinstance(buf, np.ndarray) else buf
    nbytes = element_size(dtype) * math.prod(shape)  # exact ints (np.prod costs ~20 us)
    flat = u8[:nbytes]
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    return flat.view(dtype).view(shape)


def read_buffer(shape: int | tuple[int, ...], dtype: torch.dtype = torch.uint8) -> torch.Tensor:
    """An uninitialised CPU tensor that a store reads into with no copy, for ``out=``.

    Page-aligned, with its memory running on to the next page boundary (O_DIRECT reads
    whole pages), and on 2 MiB pages where the kernel allows: on the machine the
    benchmarks ran on, reads into memory on 4 KiB pages ran at 0.6-0.9 of the rate into
    2 MiB pages. Buffers of up to 1 MiB are cut from a 2 MiB page shared with the buffers
    made before and after them (a buffer keeps its page's memory until the last of them
    is dropped), so a buffer per entry reads as fast as slices of one buffer: 1 GiB of
    256 KiB entries, 3.05 against 2.03 GB/s into a buffer each on 4 KiB pages. Allocate
    once and reuse it: fresh memory costs a page fault per page on every read."""
    bad = UnsupportedTensorError(f"read_buffer's shape is sizes of 0 or more, got {shape!r}")
    try:
        dims = tuple(operator.index(d) for d in ((shape,) if isinstance(shape, int) else shape))
    except TypeError:
        raise bad from None
    if any(d < 0 for d in dims):
        raise bad
    nbytes = math.prod(dims) * element_size(dtype)
    raw = torch.from_numpy(small_huge_empty(max(-(-nbytes // ALIGNMENT) * ALIGNMENT, ALIGNMENT)))
    return raw[:nbytes].view(dtype).view(dims)
