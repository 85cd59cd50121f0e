"""Where a read's bytes land when the caller hands the store a tensor (``out=``).

O_DIRECT moves whole 4 KiB pages of a slab between the disk and memory aligned as the
device's DMA needs (the medium's ``memory_alignment``, as the kernel reports it: 512 bytes
on the development VM's virtio disk, 4 on NVMe, a page where the kernel does not say); a
caller's tensor is often not: torch's allocator places large tensors 64 bytes into a page, a
slice of a buffer starts wherever the caller cut it, a buffer sized to its entry ends before
the entry's last page does, and a CUDA tensor is not host memory at all. A read into such a
tensor goes like this (:class:`Target`):

- the longest run from the tensor's first byte that O_DIRECT can fill (whole pages of the
  entry, into aligned host memory that the tensor's storage covers) is read straight into it;
- the rest (all of it, for an unaligned or device tensor, or one on 4 KiB pages; the last
  partial page, for an aligned one whose storage ends early) is read into a reused aligned bounce buffer, and
  :func:`land` copies each chunk out of it and checksums the copy as its request completes,
  while the requests after it are in flight: one copy, overlapped with the I/O, and the
  crc32c taken on the same cache-hot bytes as the copy, not in a pass of its own.
"""

from __future__ import annotations

import bisect
import functools
from typing import NamedTuple

import crc32c
import numpy as np
import torch

from tierstore.nvme import ALIGNMENT
from tierstore.nvme.pages import small_pages
from tierstore.pmem.libpmem import load as load_libpmem

from .tensors import raw_bytes

# Memory on 4 KiB pages is moved through the store's buffers on 2 MiB pages (one copy), not
# by O_DIRECT itself, at every size (see tierstore.nvme.pages): a request into it reaches the
# disk as many small segments. On the development VM (1 GiB, 5 rounds, one entry per
# anonymous mapping against slices of one read buffer, in the same run): at 1 MiB reads went
# from 0.67 to 0.98 of the slices' rate and writes from 0.67 to 0.99, at 4 MiB from 0.59 to
# 0.96 and 0.59 to 0.99 (docs/tiers.md). Before the copies were overlapped with the I/O
# (two windows staged ahead), this paid only from 8 MiB on.

# Bytes an AIO read keeps in flight and made ahead once that many of its bytes in flight are
# bound for bounce buffers (memory O_DIRECT cannot take), instead of the engine's window:
# one chunk's request. The disk lands bytes faster in memory it landed bytes in a moment ago
# than in a window's worth of buffers taken in turn, and the copy out then reads them from
# the cache. 1 GiB in 256 MiB calls, 5-7 alternated rounds in one process on the
# development VM (Intel Xeon): torch.empty tensors +8.5 % (256 KiB entries), +15 % (1 MiB),
# +19 % (16 MiB), +14 % (64 MiB), pinned memory and slices at +100 alike, now 1.03-1.26 of
# DeepNVMe against 0.94-1.00. Memory read in place is no faster with less in flight
# (0.96-0.99 at 8 MiB); a put's staged bytes held the same way, their copies left in the
# cache, moved -4 to +14 % from process to process: not taken (docs/tiers.md, "Bytes
# through the store's buffers").
COPIED_WINDOW = 8 << 20


class CopiedInFlight:
    """A read's bytes bound for bounce buffers in requests made and not landed, and the
    window the engine keeps from them (:data:`COPIED_WINDOW`; for the engine's
    ``window``). Counted on the engine's thread alone (its generator and callbacks)."""

    def __init__(self) -> None:
        self.moving = 0
        self._of: dict[int, int] = {}

    def made(self, m: int, copied: int) -> None:
        """Request ``m`` is made, ``copied`` of its bytes bound for a bounce buffer."""
        if copied:
            self._of[m] = copied
            self.moving += copied

    def landed(self, m: int) -> None:
        self.moving -= self._of.pop(m, 0)

    def window(self, own: int) -> int:
        """From the engine's window ``own``, the bytes to keep in flight now."""
        return min(own, COPIED_WINDOW) if self.moving >= COPIED_WINDOW else own


# Bytes copied and checksummed at a time: the copy leaves them in the CPU's cache and the
# checksum reads them from there. 256 KiB sits in the L2 cache of current x86 cores.
STEP = 256 << 10


class Target(NamedTuple):
    """A caller's tensor as a read destination: ``direct`` bytes from its first land in it
    by O_DIRECT (whole pages, :data:`ALIGNMENT`, up to the extent's length), the rest are
    bounced and copied into ``dst`` (its bytes: a numpy array over host memory, or a flat
    uint8 tensor on a device)."""

    direct: int
    dst: np.ndarray | torch.Tensor


def accepts(out: torch.Tensor | None) -> bool:
    """Whether a read may land in ``out`` itself (directly or through :func:`land`): memory
    the caller owns, contiguous, on the CPU or a CUDA device, not part of an autograd graph.
    Other tensors get the bytes by a copy once they are read."""
    return (out is not None and (out.is_cpu or out.is_cuda) and out.is_contiguous()
            and not out.requires_grad and out.numel() > 0)


def targets(outs: list[torch.Tensor], nbytes: list[int], lengths: list[int],
            align: int = ALIGNMENT) -> list[Target]:
    """How each entry of ``nbytes[i]`` (an extent of ``lengths[i]``, whole pages) lands in
    ``outs[i]``, O_DIRECT taking memory aligned to ``align``: memory on 4 KiB pages is
    bounced whole (see the note on them above), asked of the kernel for all of them at
    once."""
    directs = []
    for out, n, length in zip(outs, nbytes, lengths):
        direct = 0
        if out.is_cpu and out.data_ptr() % align == 0:
            if n >= length:  # whole pages of its own (asking its storage costs 1 us)
                room = length
            else:  # the storage may run past the tensor
                room = out.untyped_storage().nbytes() - out.storage_offset() * out.element_size()
            direct = min(length, room // ALIGNMENT * ALIGNMENT)
        directs.append(direct)
    small = [False] * len(outs) if align == 1 else small_pages(
        [out.data_ptr() for out in outs], directs)  # a CPU copy: pages do not matter
    return [Target(0 if s else d, raw_bytes(out, max(n, d))) if out.is_cpu
            else Target(0, out.reshape(-1).view(torch.uint8))
            for out, n, d, s in zip(outs, nbytes, directs, small)]


class Deferred:
    """:func:`targets` of a read's ``out=`` tensors, worked out a group at a time as its
    requests are made rather than all before its first: 1,024 of them took 1.6 ms (3 for
    memory on 4 KiB pages, one ``PAGEMAP_SCAN`` each) of the 5.5 a 256 MiB call of 256 KiB
    entries spent before its first request. Only on the AIO batch (see
    :func:`on_workers`). ``at``: the read's positions of the tensors, ascending;
    :meth:`get` of a position works out the group it starts, or returns ``default`` for a
    position with no tensor."""

    def __init__(self, at: list[int], outs: list[torch.Tensor], nbytes: list[int],
                 lengths: list[int], align: int = ALIGNMENT) -> None:
        self._at, self._outs, self._nbytes, self._lengths = at, outs, nbytes, lengths
        self._align = align
        self._index = {p: k for k, p in enumerate(at)}
        self._got: dict[int, Target] = {}
        self._next = 0  # the first of ``at`` not worked out yet

    def get(self, i: int, default: Target | None = None) -> Target | None:
        k = self._index.get(i)
        if k is None:
            return default
        while k >= self._next:
            lo = hi = self._next
            room = DEFERRED_GROUP_BYTES
            while hi < len(self._at) and (room > 0 or hi == lo):
                room -= self._lengths[hi]
                hi += 1
            got = targets(self._outs[lo:hi], self._nbytes[lo:hi], self._lengths[lo:hi],
                          self._align)
            self._got.update(zip(self._at[lo:hi], got))
            self._next = hi
        return self._got[i]

    def reach(self, i: int) -> None:
        """Work out every group up to position ``i``'s (``done``, while the requests
        before it are in flight: work out as the engine asks for requests, a group's cost
        sat between the disk completing a window and the next being submitted)."""
        k = bisect.bisect_right(self._at, i) - 1
        if k >= self._next:
            self.get(self._at[k])

    def __getitem__(self, i: int) -> Target:
        t = self.get(i)
        if t is None:
            raise KeyError(i)
        return t


# Bytes of a read's out= tensors whose targets are worked out at a time (Deferred): about
# the engine's window, so a group's are in hand before its requests are made.
DEFERRED_GROUP_BYTES = 32 << 20


def staged(addrs: list[int], nbytes: list[int], align: int = ALIGNMENT) -> list[bool]:
    """Whether each write from the ``nbytes[i]`` at ``addrs[i]`` is staged (copied into the
    store's aligned buffers) rather than written from the memory itself: memory O_DIRECT
    cannot take (aligned less than ``align``), or on 4 KiB pages (asked of the kernel for
    all of them at once)."""
    if align == 1:  # a CPU copy (PMem, buffered files): any memory, any pages
        return [False] * len(addrs)
    unaligned = [bool(a % align) for a in addrs]
    small = small_pages(addrs, [0 if u else n for u, n in zip(unaligned, nbytes)])
    return [u or s for u, s in zip(unaligned, small)]


# "batch" or "workers" sends every batch of this process that way instead: for measuring
# the two paths side by side (``tierstore bench tiers --peer deepnvme --paths``).
ROUTE: str | None = None


def on_workers() -> bool:
    """Whether a read or write goes to the chunk workers rather than one AIO batch: never,
    unless the benchmark sends it there (:data:`ROUTE`). Measured on the development VM
    (``tierstore bench tiers --peer deepnvme --paths batch,workers``, 1 GiB, 5 rounds,
    docs/tiers.md), GB/s batch against workers:

    - reads, since the engine makes the next window's requests while the last is in
      flight: as fast or faster at every size and kind, on 25-40 % less CPU where the
      memory needs a copy (4 MiB `torch.empty` 3.19 against 3.08, 16 MiB pinned memory
      3.21 against 3.01, 64 MiB 3.37 against 3.23; aligned memory within 0.05);
    - writes, since the batch stages its requests in order (:mod:`tierstore.ordered`) and
      sends an idle disk its first request alone: as fast or faster from 2 to 8 MiB
      (2 MiB `torch.empty` 5.48 against 4.40, 4 MiB a slice at +100 5.41 against 5.20,
      8 MiB `torch.empty` 5.75 against 5.53), even at 16 and 64 MiB (two runs at 16 MiB
      with `torch.empty` 5.26 against 5.77 and 5.29 against 5.09; 64 MiB within 0.1), on
      20-40 % less CPU for memory needing a copy. Those sizes went to the workers before.
    """
    return ROUTE == "workers"


def direct_end(copied: bool, nbytes: int, start: int, end: int) -> int:
    """Where a write of the chunk ``[start, end)`` of a source of ``nbytes`` stops coming
    from the source itself (O_DIRECT takes whole pages, of memory aligned as it needs) and
    its staged rest begins: ``start`` for a source that is :func:`staged` (``copied``, asked
    once per entry), ``end`` where the chunk is whole pages."""
    if copied:
        return start
    return max(start, min(end, nbytes - nbytes % ALIGNMENT))


def copy_checked(dst: np.ndarray, src: np.ndarray, crc: int = 0) -> int:
    """Copy ``src`` into ``dst`` (host memory, as long), returning ``crc`` continued over
    the bytes. A step at a time, each checksummed from the cache the copy left it in, so
    the bytes cross the memory bus once for both.

    Where libpmem is loaded the copy's stores are non-temporal (``pmem_memcpy``, which
    works on any memory): the destination is neither read into the cache before it is
    written nor left there, and the checksum is of the source's step, which the copy's
    loads brought into the cache. A read's destination is the caller's and a write's
    staging buffer goes to the disk, so neither is worth caching. Against numpy's copy
    (the fallback, which checksums the copy), alternated in one process, 1 GiB of
    ``torch.empty`` or pinned entries on the development VM (Intel Xeon, 2 cores): reads
    took 10 % less CPU time at 256 KiB, 17 % at 1 MiB and 19-20 % at 4 MiB, puts 7-15 %,
    18-19 % and 21-22 %; GB/s even within 1 % (the disk's limit). A source changed while
    it is put may leave a chunk whose checksum is not of the bytes written, as an aligned
    source's may (its checksum is taken beside its write).

    The copy first, not the checksum: the copy streams from memory faster than crc32c's
    dependent chain does. 1,024 torch.empty tensors of 256 KiB into 8 MiB buffers, on the
    development VM (AMD EPYC, 2 cores): 21 us an entry against 35 the other way round."""
    lib = load_libpmem()
    if lib is not None and dst.flags.c_contiguous and src.flags.c_contiguous:
        to, at, n = dst.ctypes.data, src.ctypes.data, src.nbytes
        for k in range(0, n, STEP):
            m = min(STEP, n - k)
            lib.memcpy_streaming(to + k, at + k, m)
            crc = crc32c.crc32c(src[k : k + m], crc)
        return crc
    for k in range(0, src.nbytes, STEP):
        part = dst[k : min(k + STEP, src.nbytes)]
        np.copyto(part, src[k : k + STEP])
        crc = crc32c.crc32c(part, crc)
    return crc


def land(t: Target, start: int, piece: np.ndarray, crc: int) -> int:
    """Copy ``piece`` (the entry's bytes from ``start`` on, read into a bounce buffer) into
    ``t``'s destination; returns ``crc`` continued over ``piece``."""
    dst = t.dst
    if isinstance(dst, np.ndarray):
        return copy_checked(dst[start : start + piece.nbytes], piece, crc)
    crc = crc32c.crc32c(piece, crc)
    # Synchronous, so the bounce buffer may be reused once this returns.
    dst[start : start + piece.nbytes].copy_(torch.from_numpy(piece))
    return crc


# crc32c's polynomial (Castagnoli), bit-reflected as the checksum's register holds it.
_POLY = 0x82F63B78


def _times(mat: tuple[int, ...], vec: int) -> int:
    out, row = 0, 0
    while vec:
        if vec & 1:
            out ^= mat[row]
        vec >>= 1
        row += 1
    return out


@functools.cache
def _zeros(k: int) -> tuple[int, ...]:
    """The map, on a crc32c, of appending ``2**k`` zero bytes to the message."""
    if k:
        mat, squarings = _zeros(k - 1), 1
    else:  # one zero bit, squared three times: one byte
        mat, squarings = (_POLY, *(1 << n for n in range(31))), 3
    for _ in range(squarings):
        mat = tuple(_times(mat, col) for col in mat)
    return mat


def crc_join(crc_a: int, crc_b: int, len_b: int) -> int:
    """The crc32c of ``a + b`` from ``crc32c(a)``, ``crc32c(b)`` and ``len(b)``, as zlib's
    ``crc32_combine`` joins its own: appending bytes to a message is a linear map of its
    checksum over GF(2), so ``a``'s is carried past ``len(b)`` zero bytes (a 32x32 bit
    matrix per set bit of the length, squared out once and kept) and xored with ``b``'s.
    A few microseconds, whatever the lengths: a chunk staged in parts by different
    workers gets its checksum without a second pass over its bytes."""
    k = 0
    while len_b:
        if len_b & 1:
            crc_a = _times(_zeros(k), crc_a)
        len_b >>= 1
        k += 1
    return crc_a ^ crc_b
