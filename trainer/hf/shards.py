"""Sharded safetensors files written in place: every tensor's name, shape and dtype is known
before a byte is read, so each shard's header is written first and every tensor, or one
expert's slice of a tensor over every expert, is written at its own offset as the export
produces it. Nothing is held beyond the tensor being written."""

from __future__ import annotations

import json
import math
import os
import struct
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from .checkpoint import INDEX_FILE, ST_DTYPES

ST_CODES = {dt: code for code, dt in ST_DTYPES.items()}
MAX_OPEN = 8  # shard files kept open at once (writes go through them nearly in order)


@dataclass
class _Place:
    shard: int
    offset: int  # in the file
    nbytes: int
    written: int = 0


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


def shard_name(i: int, n: int) -> str:
    return f"model-{i + 1:05d}-of-{n:05d}.safetensors"


class Shards:
    """The shard files of ``tensors`` (``(name, shape, dtype)``, in file order) in
    ``directory``, at most ``limit`` bytes of tensors each (a larger tensor alone)."""

    def __init__(self, directory: str, tensors: list[tuple[str, tuple[int, ...], torch.dtype]],
                 limit: int) -> None:
        self.directory = directory
        groups: list[list[tuple[str, tuple[int, ...], torch.dtype]]] = [[]]
        size = 0
        for t in tensors:
            n = _nbytes(t[1], t[2])
            if groups[-1] and size + n > limit:
                groups.append([])
                size = 0
            groups[-1].append(t)
            size += n
        self.files = [shard_name(i, len(groups)) for i in range(len(groups))]
        self.places: dict[str, _Place] = {}
        self._headers: list[bytes] = []
        self._sizes: list[int] = []
        self.total = 0
        self.parameters = 0
        for i, group in enumerate(groups):
            header: dict[str, Any] = {}
            offset = 0
            for name, shape, dtype in group:
                n = _nbytes(shape, dtype)
                header[name] = {"dtype": ST_CODES[dtype], "shape": list(shape),
                                "data_offsets": [offset, offset + n]}
                self.places[name] = _Place(i, offset, n)
                offset += n
                self.parameters += math.prod(shape)
            header["__metadata__"] = {"format": "pt"}
            raw = json.dumps(header, separators=(",", ":")).encode()
            raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors writes
            start = 8 + len(raw)
            for name, _, _ in group:
                self.places[name].offset += start
            self._headers.append(struct.pack("<Q", len(raw)) + raw)
            self._sizes.append(start + offset)
            self.total += offset
        self._open: OrderedDict[int, int] = OrderedDict()

    def create(self) -> None:
        """Every file with its header, at its final size (the data written later)."""
        for i in range(len(self.files)):
            fd = self._fd(i)
            _pwrite_all(fd, self._headers[i], 0)
            os.ftruncate(fd, self._sizes[i])

    def _fd(self, i: int) -> int:
        fd = self._open.get(i)
        if fd is not None:
            self._open.move_to_end(i)
            return fd
        while len(self._open) >= MAX_OPEN:
            _, old = self._open.popitem(last=False)
            os.close(old)
        fd = os.open(os.path.join(self.directory, self.files[i]), os.O_RDWR | os.O_CREAT, 0o644)
        self._open[i] = fd
        return fd

    def write(self, name: str, t: Tensor, part: int = 0, parts: int = 1) -> int:
        """Write ``t`` as tensor ``name`` (``parts`` > 1: as its slice ``part`` of that many
        equal ones along the first dimension); returns the bytes written."""
        place = self.places[name]
        size = place.nbytes // parts
        data = t.contiguous().reshape(-1).view(torch.uint8)
        if data.numel() != size:
            raise ValueError(f"{name}: {data.numel()} bytes where its shape needs {size}")
        _pwrite_all(self._fd(place.shard), memoryview(data.numpy()), place.offset + part * size)
        place.written += size
        return size

    def finish(self) -> dict[str, Any]:
        """Check that every byte was written, make the files durable and close them;
        returns the index (``model.safetensors.index.json``)."""
        short = [n for n, p in self.places.items() if p.written != p.nbytes]
        if short:
            p = self.places[short[0]]
            raise ValueError(f"{short[0]}: {p.written} bytes written of {p.nbytes}")
        self.close(sync=True)
        return {"metadata": {"total_size": self.total, "total_parameters": self.parameters},
                "weight_map": {n: self.files[p.shard] for n, p in sorted(self.places.items())}}

    def close(self, sync: bool = False) -> None:
        for i in range(len(self.files)):
            if sync:
                os.fsync(self._fd(i))
            fd = self._open.pop(i, None)
            if fd is not None:
                os.close(fd)


def _pwrite_all(fd: int, data: bytes | memoryview, offset: int) -> None:
    view = memoryview(data).cast("B")
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


__all__ = ["INDEX_FILE", "ST_CODES", "Shards", "shard_name"]
