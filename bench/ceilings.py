"""The ceilings ``bench tiers`` holds the NVMe tier against, measured beside the store in
the same run: fio ``psync`` with a job per I/O thread, fio ``io_uring`` (``libaio`` where
io_uring is unavailable) at queue depth 32, DeepSpeed's DeepNVMe ``aio_handle`` where
deepspeed is installed (:mod:`bench.deepnvme`), and, for the kvikio engine, gdsio
(GPUDirect Storage) on a file of its own. Each is a function ``(path, op, offset, span)``
giving GB/s (see :func:`nvme_ceilings`)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from typing import Any

import torch

import tierstore


def _fio(path: str, op: str, bs: int, threads: int, offset: int, span: int, direct: bool,
         ioengine: str = "psync") -> float:
    """fio bandwidth in GB/s over ``span`` bytes of ``path`` from ``offset``. With ``psync``:
    ``threads`` jobs, each reading (or writing) its own contiguous share in ``bs`` requests,
    as many in flight as the store's I/O threads issue. With ``libaio`` or ``io_uring``: one
    job at queue depth 32. fio's bandwidth counts from its first request to the last job's
    last one; its buffers are allocated (and faulted in) before that."""
    jobs = threads if ioengine == "psync" else 1
    per_job = max(bs, span // jobs // bs * bs)
    depth = [] if ioengine == "psync" else ["--iodepth=32", "--iodepth_batch_submit=8",
                                              "--iodepth_batch_complete_min=1"]
    cmd = [
        "fio", "--name=ceiling", f"--filename={path}", f"--rw={op}", f"--bs={bs}",
        f"--direct={int(direct)}", f"--ioengine={ioengine}", f"--numjobs={jobs}", *depth,
        f"--offset={offset}", f"--size={per_job}", f"--offset_increment={per_job}",
        "--group_reporting", "--output-format=json", "--allow_file_create=0",
        # Buffered reads start cold on both sides: the store's are preceded by
        # drop_page_cache, fio's by this (fio's default, stated so it cannot drift).
        "--invalidate=1",
    ]
    if op == "write":
        cmd.append("--end_fsync=1")
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    job = json.loads(out[out.index("{"):])["jobs"][0][op]
    return job["bw_bytes"] / 1e9


def _gdsio(path: str, op: str, bs: int, threads: int, span: int) -> float:
    """gdsio (GPUDirect Storage, device memory as the target: ``-x 0``) bandwidth in GB/s
    over the first ``span`` bytes of ``path`` with ``threads`` workers and ``bs`` requests."""
    gdsio = _gdsio_path()
    assert gdsio is not None
    cmd = [gdsio, "-f", path, "-d", "0", "-w", str(threads), "-s", str(span), "-i", str(bs),
           "-x", "0", "-I", "0" if op == "read" else "1"]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    m = re.search(r"Throughput:\s*([0-9.]+)\s*GiB/sec", out)
    if m is None:
        raise tierstore.StoreError(f"gdsio printed no throughput: {out.strip()[-200:]}")
    return float(m.group(1)) * 2**30 / 1e9


class GdsioCeiling:
    """The gdsio ceiling on a file of its own beside the store's slab, never the slab: gdsio
    has no option this bench trusts to keep it inside a region (its ``-s`` starts at the
    file's first byte), and a write there would overwrite live entries. The file is
    written in full before its first use, so reads move real data (reading a hole costs
    the disk nothing), and removed by :meth:`close`."""

    def __init__(self, bs: int, threads: int) -> None:
        self.bs, self.threads = bs, threads
        self.path: str | None = None

    def file_for(self, slab: str, span: int) -> str:
        """The ceiling's file in ``slab``'s directory, at least ``span`` bytes of data."""
        path = os.path.join(os.path.dirname(os.path.abspath(slab)), "gdsio-ceiling.bin")
        if self.path != path or os.path.getsize(path) < span:
            chunk = os.urandom(8 << 20)
            with open(path, "wb") as f:
                for done in range(0, span, len(chunk)):
                    f.write(chunk[: min(len(chunk), span - done)])
                f.flush()
                os.fsync(f.fileno())
            self.path = path
        return path

    def __call__(self, slab: str, op: str, offset: int, span: int) -> float:
        return _gdsio(self.file_for(slab, span), op, self.bs, self.threads, span)

    def close(self) -> None:
        if self.path is not None:
            with contextlib.suppress(FileNotFoundError):
                os.remove(self.path)
            self.path = None


def _gdsio_path() -> str | None:
    return shutil.which("gdsio") or next(
        (p for p in ("/usr/local/cuda/gds/tools/gdsio",) if os.access(p, os.X_OK)), None)


def gds_unavailable() -> str | None:
    """Why the GDS rows cannot run here, or None when they can."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    try:
        import kvikio  # noqa: F401
    except ImportError:
        return "kvikio is not installed"
    if _gdsio_path() is None:
        return "gdsio is not on PATH (it ships with the CUDA toolkit's GDS tools)"
    return None


def _fio_queue_engine() -> str:
    """fio's deep-queue engine here: io_uring where fio has it and the kernel allows it,
    else libaio."""
    global _FIO_QUEUE
    if _FIO_QUEUE is None:
        _FIO_QUEUE = "libaio"
        with tempfile.NamedTemporaryFile(dir=os.getcwd()) as f:
            f.truncate(1 << 20)
            try:
                _fio(f.name, "read", 4096, 1, 0, 1 << 20, False, "io_uring")
                _FIO_QUEUE = "io_uring"
            except (subprocess.CalledProcessError, ValueError, KeyError):
                pass
    return _FIO_QUEUE


_FIO_QUEUE: str | None = None


def nvme_ceilings(ceiling: str, bs: int, threads: int, direct: bool, span: int,
                  read_call: int | None = None, write_call: int | None = None
                  ) -> tuple[dict[str, Callable[[str, str, int, int], float]], list[Any]]:
    """The ceilings measured beside the store, by name: ``fn(path, op, offset, span)`` gives
    GB/s. For ``fio``: fio psync with a job per thread, fio io_uring (or libaio) at queue
    depth 32, and DeepNVMe's ``aio_handle`` where deepspeed is installed, reading
    ``read_call`` bytes a call and writing ``write_call`` (each with an fsync) where given.
    Also returns what must be closed afterwards."""
    if ceiling == "gdsio":
        gds = GdsioCeiling(bs, threads)
        return {"gdsio GDS": gds}, [gds]
    queue = _fio_queue_engine()
    out: dict[str, Callable[[str, str, int, int], float]] = {
        "fio psync": lambda path, op, off, n: _fio(path, op, bs, threads, off, n, direct),
        f"fio {queue} qd32": lambda path, op, off, n: _fio(path, op, bs, threads, off, n,
                                                           direct, queue),
    }
    closers: list[Any] = []
    from . import deepnvme

    if direct and deepnvme.unavailable() is None:
        peer = deepnvme.DeepNVMe(span, read_piece=read_call, write_piece=write_call)
        closers.append(peer)
        out["DeepNVMe aio_handle"] = peer.gbps
    return out, closers
