"""The 4 KiB header at the start of a pool file.

Layout (little-endian)::

    0   magic           8s   b"TSPMPOOL"
    8   layout_version  u32
    12  header_size     u32  4096; data starts here
    16  alignment       u64  4096; segment bases and sizes are multiples of it
    24  pool_id         16s  random, tells pools apart
    40  created_ns      u64
    48  crc32           u32  of bytes 0..48
    64  pool_size       u64  bytes of file the pool has committed to (the file may be larger)
    72  assigned_end    u64  end of the space handed to segments so far

The fixed fields are checksummed; the two sizes change as the pool grows, so each lives in
its own aligned 8-byte word that is rewritten on its own (a single store on pmem), and the
checksum never covers a field that is written after creation: a crash between two header
writes cannot make a pool unreadable.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

__all__ = [
    "ALIGNMENT",
    "ASSIGNED_END_OFFSET",
    "HEADER_SIZE",
    "LAYOUT_VERSION",
    "MAGIC",
    "POOL_SIZE_OFFSET",
    "Header",
    "PoolFormatError",
    "decode",
    "encode_fixed",
    "encode_word",
]

MAGIC = b"TSPMPOOL"
LAYOUT_VERSION = 1
HEADER_SIZE = 4096
ALIGNMENT = 4096

_FIXED = struct.Struct("<8sIIQ16sQ")
_CRC = struct.Struct("<I")
_CRC_OFFSET = _FIXED.size  # 48
_WORD = struct.Struct("<Q")
POOL_SIZE_OFFSET = 64
ASSIGNED_END_OFFSET = 72


class PoolFormatError(ValueError):
    """The file is not a pool this code can open (bad magic, layout version or header)."""


@dataclass(frozen=True)
class Header:
    layout_version: int
    header_size: int
    alignment: int
    pool_id: bytes
    created_ns: int
    pool_size: int
    assigned_end: int


def encode_fixed(pool_id: bytes, created_ns: int) -> bytes:
    """Bytes 8..52 of a new header: everything fixed except the magic.

    The magic is written last, after the rest is durable, so a torn creation never looks
    like a pool.
    """
    body = _FIXED.pack(MAGIC, LAYOUT_VERSION, HEADER_SIZE, ALIGNMENT, pool_id, created_ns)
    crc = _CRC.pack(zlib.crc32(body))
    return body[len(MAGIC) :] + crc


def encode_word(value: int) -> bytes:
    """One of the mutable 8-byte header words."""
    return _WORD.pack(value)


def decode(raw: bytes, file_size: int, path: str) -> Header:
    """Parse and validate a header read from a file of ``file_size`` bytes."""
    if file_size < HEADER_SIZE or len(raw) < HEADER_SIZE:
        raise PoolFormatError(
            f"{path}: {file_size} bytes, too small to be a pmem pool ({HEADER_SIZE} minimum)"
        )
    magic, version, header_size, alignment, pool_id, created_ns = _FIXED.unpack_from(raw)
    if magic != MAGIC:
        raise PoolFormatError(f"{path}: not a tierstore pmem pool (bad magic {magic!r})")
    # Checked before the checksum: another layout may checksum different bytes.
    if version != LAYOUT_VERSION:
        raise PoolFormatError(
            f"{path}: pool layout version {version}, this build reads version {LAYOUT_VERSION}"
        )
    (crc,) = _CRC.unpack_from(raw, _CRC_OFFSET)
    if crc != zlib.crc32(raw[:_CRC_OFFSET]):
        raise PoolFormatError(f"{path}: pool header checksum mismatch (corrupt header)")
    if header_size != HEADER_SIZE or alignment != ALIGNMENT:
        raise PoolFormatError(
            f"{path}: unsupported header size {header_size} or alignment {alignment}"
        )
    (pool_size,) = _WORD.unpack_from(raw, POOL_SIZE_OFFSET)
    (assigned_end,) = _WORD.unpack_from(raw, ASSIGNED_END_OFFSET)
    if pool_size > file_size:
        raise PoolFormatError(
            f"{path}: pool file truncated: header records {pool_size} bytes, file has {file_size}"
        )
    if not (HEADER_SIZE <= assigned_end <= pool_size) or assigned_end % ALIGNMENT:
        raise PoolFormatError(
            f"{path}: corrupt pool header (assigned end {assigned_end}, pool size {pool_size})"
        )
    return Header(version, header_size, alignment, pool_id, created_ns, pool_size, assigned_end)
