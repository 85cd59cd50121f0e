"""What an LMDB data file references, read before LMDB maps it.

LMDB maps the file and trusts it: touching a page past the end of the file kills the process
with SIGBUS. The meta page's last page number (``mm_last_pg``) is no bound on the file's
length, though: pages a transaction allocated and freed again before its commit are never
written, so a sound file may end before that page. What LMDB touches is what the tree of the
meta page it uses references, so that is what is checked: from the roots of the free and
main databases, through branch pages, to leaf pages and the named (and sorted-duplicate)
sub-databases and overflow pages their nodes point at. Every page reached must lie wholly
inside the file and carry its own number in its header, which LMDB writes on every page it
writes (a page of garbage, or of another file, fails that).

The layout is that of LMDB 0.9 on a 64-bit build (``mdb.c``): a 16-byte page header
(``mp_pgno`` u64, ``mp_pad`` u16, ``mp_flags`` u16, then ``mp_lower``/``mp_upper`` u16 or an
overflow page's count ``mp_pages`` u32), the node offsets (u16) after it; a node is
``mn_lo``, ``mn_hi``, ``mn_flags``, ``mn_ksize`` (u16 each), then key and data; a branch
node's child page number is ``mn_lo | mn_hi << 16 | mn_flags << 32``. ``MDB_meta`` follows
the header of pages 0 and 1: magic, version, address, map size, then two 48-byte ``MDB_db``
records (free, main; ``md_root`` at 40 in each), ``mm_last_pg`` and ``mm_txnid``.
"""

from __future__ import annotations

import os
import struct
from typing import NamedTuple

MAGIC = 0xBEEFC0DE
DATA_VERSION = 1
PAGE_HEADER = 16
NO_PAGE = (1 << 64) - 1  # P_INVALID: an empty tree's root
_BRANCH, _LEAF, _OVERFLOW, _LEAF2 = 0x01, 0x02, 0x04, 0x20
_BIGDATA, _SUBDATA = 0x01, 0x02
_U16 = struct.Struct("<H")
_U64 = struct.Struct("<Q")
_HEADER = struct.Struct("<QHHHH")  # pgno, pad, flags, lower, upper
_NODE = struct.Struct("<HHHH")  # lo, hi, flags, ksize
_DB_ROOT = 40  # md_root inside an MDB_db record
_DB_SIZE = 48


class Meta(NamedTuple):
    """One meta page: the page size, the last page number, the transaction id and the
    roots of the free and main databases."""

    psize: int
    last_pg: int
    txnid: int
    roots: tuple[int, int]


def read_meta(raw: bytes) -> Meta | None:
    """The meta page at the start of ``raw``, or None if it is not one. The page size is
    kept in the free database's ``md_pad``."""
    if len(raw) < PAGE_HEADER + 136:
        return None
    magic, version = struct.unpack_from("<II", raw, PAGE_HEADER)
    psize = struct.unpack_from("<I", raw, PAGE_HEADER + 24)[0]
    free_root = _U64.unpack_from(raw, PAGE_HEADER + 24 + _DB_ROOT)[0]
    main_root = _U64.unpack_from(raw, PAGE_HEADER + 72 + _DB_ROOT)[0]
    last, txnid = struct.unpack_from("<QQ", raw, PAGE_HEADER + 120)
    if magic != MAGIC or version != DATA_VERSION or psize < 512 or psize & (psize - 1):
        return None
    return Meta(psize, last, txnid, (free_root, main_root))


def read_metas(f: int) -> list[Meta]:
    """The meta pages of the file open at descriptor ``f``; empty unless both are valid,
    as LMDB refuses a file with either one damaged."""
    first = read_meta(os.pread(f, 4096, 0))
    second = None if first is None else read_meta(os.pread(f, 4096, first.psize))
    return [] if first is None or second is None else [first, second]


def current(metas: list[Meta]) -> Meta:
    """The meta page LMDB uses: the one of the later transaction, page 0 on a tie."""
    return metas[1] if metas[1].txnid > metas[0].txnid else metas[0]


def unreachable(f: int, size: int, meta: Meta) -> str | None:
    """What is wrong with the tree of ``meta`` in the file open at ``f`` (``size`` bytes),
    as a phrase ("is truncated: ...", "is damaged: ..."): a referenced page past the end of
    the file, or one that is not the page referenced. None when every page is there."""
    psize = meta.psize
    pages = size // psize
    todo = [(root, "tree") for root in meta.roots if root != NO_PAGE]
    seen: set[int] = set()
    while todo:
        pgno, role = todo.pop()
        if pgno in seen:
            return f"is damaged: page {pgno} is referenced twice"
        seen.add(pgno)
        if pgno < 2 or pgno >= pages:
            return f"is truncated: it ends at page {pages}, and its tree references page {pgno}"
        raw = os.pread(f, psize if role == "tree" else PAGE_HEADER, pgno * psize)
        own, _, flags, lower, upper = _HEADER.unpack_from(raw)
        if own != pgno:
            return f"is damaged: page {pgno} holds something else (its header names page {own})"
        if role == "overflow":
            count = lower | upper << 16
            if not flags & _OVERFLOW or count < 1:
                return f"is damaged: page {pgno} is not the overflow page its tree references"
            if pgno + count > pages:
                return (f"is truncated: it ends at page {pages}, and its tree references "
                        f"the overflow pages {pgno}..{pgno + count - 1}")
            continue
        if flags & _LEAF2:
            continue  # sorted fixed-size duplicates: keys only, no references
        if not flags & (_BRANCH | _LEAF) or not PAGE_HEADER <= lower <= upper <= psize:
            return f"is damaged: page {pgno} is not a tree page"
        problem = _children(raw, pgno, lower, bool(flags & _BRANCH), todo)
        if problem:
            return problem
    return None


def _children(raw: bytes, pgno: int, lower: int, branch: bool,
              todo: list[tuple[int, str]]) -> str | None:
    """Queue what the nodes of one branch or leaf page reference."""
    psize = len(raw)
    for i in range((lower - PAGE_HEADER) >> 1):
        at = _U16.unpack_from(raw, PAGE_HEADER + 2 * i)[0]
        if at + _NODE.size > psize:
            return f"is damaged: node {i} of page {pgno} lies outside the page"
        lo, hi, nflags, ksize = _NODE.unpack_from(raw, at)
        data = at + _NODE.size + ksize
        if branch:
            if data > psize:
                return f"is damaged: node {i} of page {pgno} lies outside the page"
            todo.append((lo | hi << 16 | nflags << 32, "tree"))
            continue
        if nflags & _BIGDATA:
            if data + 8 > psize:
                return f"is damaged: node {i} of page {pgno} lies outside the page"
            todo.append((_U64.unpack_from(raw, data)[0], "overflow"))
        elif nflags & _SUBDATA:
            if data + _DB_SIZE > psize:
                return f"is damaged: node {i} of page {pgno} lies outside the page"
            root = _U64.unpack_from(raw, data + _DB_ROOT)[0]
            if root != NO_PAGE:
                todo.append((root, "tree"))
        elif data + (lo | hi << 16) > psize:
            return f"is damaged: node {i} of page {pgno} lies outside the page"
    return None
