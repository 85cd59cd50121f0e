"""DeepSpeed's DeepNVMe (``aio_handle``, the libaio engine behind ZeRO-Infinity) as a
ceiling for the NVMe tier, driven as a user comparing the two would.

The handle moves bytes between a file and page-locked buffers it allocates itself, in
``block_size`` requests with ``queue_depth`` in flight on ``intra_op_parallelism``
threads. Reads and writes go through it ``PIECE`` bytes per call (the store's benchmark
reads 256 MiB per ``get_many``); writes end with an fsync, as the store's end with an
fdatasync. Its op compiles on first use against ``libaio-dev`` (``DS_ACCELERATOR=cpu``
where there is no GPU); install deepspeed with the ``peers`` extra.

Its buffer is on 4 KiB pages, and each request reaches the disk as one segment per run of
physically adjacent pages: how fragmented the machine's free memory was when the buffer was
allocated sets its rate. On the development VM, fresh processes with the same code: 29-41
segments per 1 MiB block read at 1.66-1.90 GB/s, 166 at 1.51 (docs/tiers.md, "A second
nine rounds, and DeepNVMe's rate and its buffer's pages"). Each handle records the figure
(:attr:`DeepNVMe.segments`).
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import numpy as np

BLOCK = 1 << 20
PAGE = 4096
_PFN = (1 << 55) - 1  # bits 0-54 of a pagemap entry
QUEUE_DEPTH = 32
PARALLELISM = 2
PIECE = 256 << 20

_op: Any = None
_why: str | None = None


def _load() -> Any:
    """The compiled async_io op, or None (the reason is kept for :func:`unavailable`)."""
    global _op, _why
    if _op is not None or _why is not None:
        return _op
    try:
        import torch

        if not torch.cuda.is_available():
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
        from deepspeed.ops.op_builder import AsyncIOBuilder

        builder = AsyncIOBuilder()
        if not builder.is_compatible(verbose=False):
            _why = "deepspeed's async_io op cannot build here (is libaio-dev installed?)"
            return None
        _op = builder.load(verbose=False)
        # Its first write logs a warning about consumer SSDs' write endurance, which would
        # land in the middle of the benchmark's table; every other message still shows.
        logging.getLogger("DeepSpeed").addFilter(_no_endurance_warning)
    except ImportError:
        _why = "deepspeed is not installed (pip install 'tierstore[peers]')"
    except Exception as e:  # noqa: BLE001 (a failed JIT build: report it, skip the ceiling)
        _why = f"deepspeed's async_io op failed to load: {str(e).splitlines()[0][:160]}"
    return _op


def _no_endurance_warning(record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith("Offloading to NVMe can generate heavy write")


def unavailable() -> str | None:
    """Why the DeepNVMe ceiling cannot run here, or None when it can."""
    _load()
    return _why


class DeepNVMe:
    """One ``aio_handle`` and a page-locked buffer for its calls: reads move
    ``read_piece`` bytes a call, writes ``write_piece`` (``min(span, PIECE)`` where not
    given), each write call then followed by an fsync (durable per call, as a ``put_many``
    is; else one fsync at the end)."""

    def __init__(self, span: int, threads: int = PARALLELISM,
                 read_piece: int | None = None, write_piece: int | None = None) -> None:
        import torch

        op = _load()
        if op is None:
            raise RuntimeError(_why)
        self.handle = op.aio_handle(BLOCK, QUEUE_DEPTH, False, True, threads)
        self.read_piece = min(span, read_piece or PIECE)
        self.write_piece = min(span, write_piece or PIECE)
        self.sync_each = write_piece is not None
        self.buf = self.handle.new_cpu_locked_tensor(
            max(self.read_piece, self.write_piece), torch.empty(0, dtype=torch.uint8))
        self.buf.random_(0, 255)
        self.segments = segments_per_block(self.buf.data_ptr(), self.buf.nbytes)

    def close(self) -> None:
        self.handle.free_cpu_locked_tensor(self.buf)

    def gbps(self, path: str, op: str, offset: int, span: int) -> float:
        """GB/s of reading (or writing, then fsync) ``span`` bytes of ``path`` from
        ``offset``."""
        t0 = time.perf_counter()
        done = 0
        piece = self.read_piece if op == "read" else self.write_piece
        fd = os.open(path, os.O_RDWR) if op == "write" else -1
        try:
            while done < span:
                n = min(piece, span - done)
                view = self.buf[:n]
                if op == "read":
                    self.handle.async_pread(view, path, offset + done)
                else:
                    self.handle.async_pwrite(view, path, offset + done)
                if self.handle.wait() < 0:
                    raise OSError(f"DeepNVMe {op} of {path} failed")
                done += n
                if fd >= 0 and (self.sync_each or done == span):
                    os.fsync(fd)
        finally:
            if fd >= 0:
                os.close(fd)
        return span / (time.perf_counter() - t0) / 1e9


def segments_per_block(addr: int, nbytes: int) -> float | None:
    """Runs of physically adjacent 4 KiB pages per :data:`BLOCK` of the (present) memory at
    ``addr``, on average: the segments each of the handle's requests reaches the disk as.
    None where the kernel shows no page frames (to a process without CAP_SYS_ADMIN)."""
    try:
        fd = os.open("/proc/self/pagemap", os.O_RDONLY)
    except OSError:
        return None
    try:
        raw = os.pread(fd, nbytes // PAGE * 8, addr // PAGE * 8)
    finally:
        os.close(fd)
    return mean_runs(np.frombuffer(raw, dtype=np.uint64) & np.uint64(_PFN), BLOCK // PAGE)


def mean_runs(frames: np.ndarray, per: int) -> float | None:
    """Runs of consecutive numbers per ``per`` of ``frames`` (page frame numbers), on
    average over each ``per`` in turn; None where every frame reads 0 (hidden)."""
    if not frames.any():
        return None
    f = frames.astype(np.int64)
    runs = [int(np.count_nonzero(np.diff(f[i : i + per]) != 1)) + 1
            for i in range(0, len(f), per)]
    return sum(runs) / len(runs)
