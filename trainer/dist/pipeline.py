"""MPMoE's pipelining of a token-centric block: chunk i+1's dispatch in flight while chunk i
computes, and chunk i's combine in flight while chunk i+1 computes.

The chunks are groups of experts, not of tokens: chunk ``j`` carries the routed slots whose
expert's index on its owner (``e mod E/W``) falls in the j-th of ``n`` equal groups, from every
rank to every owner. Each expert's rows then travel in one chunk, in the order the unchunked
exchange gives them (rank 0's first, each rank's in its own order), so the owner runs each
expert on exactly the rows of ``n = 1``, in one matrix product: the outputs, the weights'
gradients and the rows' gradients are bit for bit those of ``n = 1``. The slots are gathered
from the tokens once, in the unchunked order, and only permuted into chunk order (a
permutation's backward adds nothing), so the tokens' gradients are summed over their k slots
in the same order too.

The exchanges are ``all_to_all_single(..., async_op=True)`` (gloo runs them on its own
threads): every chunk's dispatch is started before the first chunk computes, and each
chunk's combine as soon as it has computed; the block waits for a chunk's rows just before
computing it and for the combines at the end. The backward pass exchanges synchronously.

The owner's experts of a chunk are fetched from the store the same way: chunk 0's as soon
as its expert ids have arrived (while its rows may still be in flight), chunk j+1's on the
fetch thread while chunk j computes. The ids are a separate, tiny exchange started with the
rows, so the owner knows a chunk's exact experts before computing the one before it; the
fetches run in chunk order on one thread, each only after the last, so the store sees the
calls of ``n = 1``, in the same order, and the results stay bit for bit.

:class:`Overlap` counts, per step and block, the compute time during which another chunk's
exchange was in flight (started and, when the compute ended, not yet complete): the time
pipelining hid; the fetch time and the part of it that ran under compute; and the
communication and compute times the performance model (:func:`best_chunks`) reads, MPMoE's:
``T(n) = (n - 1) * max(c/n, m(n)) + c/n + 2 * m(n)`` with ``m(n) = alpha + beta * bytes / n``
per exchange and ``c`` the block's compute time.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future
from concurrent.futures import wait as wait_all
from dataclasses import dataclass, field, fields
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from .collectives import Traffic, comm_device, inverse_permutation
from .world import World


@dataclass
class Overlap:
    """Per-step counters of a token-centric block (or, merged, of several). A block run
    unchunked counts its compute, exchange and fetch times, no chunks."""

    calls: int = 0  # the block's forward passes
    chunks: int = 0
    compute_s: float = 0.0
    comm_s: float = 0.0  # waiting for exchanges
    # Compute while another chunk's exchange was started and not yet waited for (what the
    # schedule overlaps), and the part of it during which one was still incomplete when
    # the compute ended (what the network actually hid; timing, not asserted anywhere).
    overlapped_s: float = 0.0
    hidden_s: float = 0.0
    comm_bytes: int = 0
    rows: int = 0
    count_s: float = 0.0  # the chunk counts' exchange: a message of a few bytes (alpha)
    # The owner's experts from the store: the fetches' own time, the compute's wait for
    # them, the part of their time that did not hold the compute up (timing, not asserted),
    # and how many were started before the compute of the chunk before theirs.
    fetch_s: float = 0.0
    fetch_wait_s: float = 0.0
    fetch_hidden_s: float = 0.0
    fetches: int = 0
    fetches_ahead: int = 0
    n: int = 0  # the chunks of the block's last call (1: unchunked); not summed
    samples: list[tuple[float, int]] = field(default_factory=list)  # (seconds, bytes) waits

    def merge(self, other: Overlap) -> None:
        for f in fields(self):
            if f.name not in ("n", "samples"):
                setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))
        self.samples += other.samples
        self.n = other.n or self.n

    def figures(self) -> dict[str, Any]:
        """The step's metrics of the merged blocks."""
        return {"pipeline_chunks": self.chunks, "pipeline_compute_s": self.compute_s,
                "pipeline_wait_s": self.comm_s, "pipeline_overlapped_s": self.overlapped_s,
                "pipeline_hidden_s": self.hidden_s, "pipeline_fetch_s": self.fetch_s,
                "pipeline_fetch_wait_s": self.fetch_wait_s,
                "pipeline_fetch_hidden_s": self.fetch_hidden_s,
                "pipeline_fetches_ahead": self.fetches_ahead}

    def block_figures(self) -> dict[str, Any]:
        """One block's entry of the step's ``pipeline_blocks``."""
        return {"n": self.n, "calls": self.calls, "chunks": self.chunks,
                "compute_s": self.compute_s, "comm_s": self.comm_s,
                "overlapped_s": self.overlapped_s, "hidden_s": self.hidden_s,
                "fetch_s": self.fetch_s, "fetch_wait_s": self.fetch_wait_s,
                "fetch_hidden_s": self.fetch_hidden_s, "fetches": self.fetches,
                "fetches_ahead": self.fetches_ahead, "rows": self.rows}


Fetch = Callable[[Tensor], Any]


def _timed(fetch: Fetch, ids: Tensor) -> tuple[Any, float]:
    t0 = time.perf_counter()
    got = fetch(ids)
    return got, time.perf_counter() - t0


def fetch_now(fetch: Fetch, ids: Tensor, overlap: Overlap) -> Any:
    """``fetch(ids)`` on this thread, counted: nothing of it is hidden."""
    got, took = _timed(fetch, ids)
    overlap.fetches += 1
    overlap.fetch_s += took
    overlap.fetch_wait_s += took
    return got


def _fetched(pending: Future[tuple[Any, float]], overlap: Overlap) -> Any:
    """A fetch started earlier: its result, counting the wait for it."""
    t0 = time.perf_counter()
    got, took = pending.result()
    waited = time.perf_counter() - t0
    overlap.fetches += 1
    overlap.fetch_s += took
    overlap.fetch_wait_s += waited
    overlap.fetch_hidden_s += max(0.0, took - waited)
    return got


class _Handle:
    def __init__(self) -> None:
        self.work: Any = None
        self.nbytes = 0

    def done(self) -> bool:
        return self.work is None or bool(self.work.is_completed())

    def wait(self) -> None:
        if self.work is not None:
            self.work.wait()
            self.work = None


def _launch(x: Tensor, send: list[int], recv: list[int], handle: _Handle) -> Tensor:
    out = x.new_empty((sum(recv), *x.shape[1:]))
    handle.work = dist.all_to_all_single(out, x.contiguous(), list(recv), list(send),
                                         async_op=True)
    handle.nbytes = x.numel() * x.element_size()
    return out


class _AsyncAllToAll(torch.autograd.Function):
    """Rows to their ranks, started asynchronously: the result is readable after
    ``handle.wait()``. The backward sends the gradients back, synchronously."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, send: list[int], recv: list[int], handle: _Handle,
                traffic: Traffic | None) -> Tensor:
        ctx.send, ctx.recv, ctx.traffic = send, recv, traffic
        return _launch(x, send, recv, handle)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        if ctx.traffic is not None:
            ctx.traffic.add("tokens", ctx.recv, grad.shape[1:].numel() * grad.element_size())
        out = grad.new_empty((sum(ctx.send), *grad.shape[1:]))
        dist.all_to_all_single(out, grad.contiguous(), list(ctx.send), list(ctx.recv))
        return out, None, None, None, None


def _start(x: Tensor, send: list[int], recv: list[int], traffic: Traffic | None
           ) -> tuple[Tensor, _Handle]:
    """Start sending ``x``'s rows (``send[r]`` to rank ``r``); the received rows and the
    handle to wait on."""
    handle = _Handle()
    if traffic is not None:
        traffic.add("tokens", send, x.shape[1:].numel() * x.element_size())
    if x.requires_grad and torch.is_grad_enabled():
        return _AsyncAllToAll.apply(x, send, recv, handle, traffic), handle  # type: ignore[no-any-return]
    return _launch(x, send, recv, handle), handle


def chunk_counts(send: Sequence[Sequence[int]], world: World) -> list[list[int]]:
    """``send[j][r]`` rows of chunk ``j`` go to rank ``r``: returns ``recv[j][r]``, the rows
    of chunk ``j`` rank ``r`` sends here (one exchange for every chunk)."""
    n = len(send)
    mine = torch.tensor([send[j][r] for r in range(world.size) for j in range(n)],
                        dtype=torch.int64, device=comm_device(world))
    got = torch.empty_like(mine)
    dist.all_to_all_single(got, mine)
    flat = got.tolist()
    return [[flat[r * n + j] for r in range(world.size)] for j in range(n)]


def pipelined_block(x: Tensor, top_k_index: Tensor, top_k_weights: Tensor, n: int,
                    n_experts: int, world: World, fetch: Fetch,
                    compute: Callable[[Tensor, Tensor, Any], Tensor],
                    overlap: Overlap, traffic: Traffic | None = None,
                    fetcher: Executor | None = None) -> Tensor:
    """A token-centric block in ``n`` chunks (module docstring). ``fetch(ids)`` gets the
    owner's experts of a chunk's received expert ids, ``compute(rows, ids, fetched)`` is
    the owner's work on them (``[N, H]`` -> ``[N, H]``). ``fetcher``: the one thread the
    fetches run on, ahead of the compute (without one, each runs just before its chunk)."""
    w = world.size
    per_rank = n_experts // w
    if n < 1 or per_rank % n:
        raise ValueError(f"{n} chunks do not split the {per_rank} experts each rank owns")
    n_tok, k = top_k_index.shape
    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True)  # the unchunked order: by expert
    sorted_ids = flat[order]
    rows_all = x[order // k]  # gathered as n = 1 gathers them
    chunk_of = (sorted_ids % per_rank) * n // per_rank
    # Chunk-major, the unchunked (expert) order inside each chunk: a stable sort of a
    # sorted sequence by chunk keeps each chunk's experts, hence owners, ascending.
    perm = torch.argsort(chunk_of, stable=True)
    dest = sorted_ids[perm] * w // n_experts
    chunk_sorted = chunk_of[perm]
    send = [torch.bincount(dest[chunk_sorted == j], minlength=w).tolist() for j in range(n)]
    t0 = time.perf_counter()
    recv = chunk_counts(send, world)
    overlap.count_s += time.perf_counter() - t0
    overlap.comm_s += time.perf_counter() - t0
    bounds = [0]
    for j in range(n):
        bounds.append(bounds[-1] + sum(send[j]))
    rows_chunked = rows_all[perm]
    ids_chunked = sorted_ids[perm]
    # Every dispatch starts now, in chunk order (the ranks start them in the same order).
    flights = []
    for j in range(n):
        piece = rows_chunked[bounds[j]:bounds[j + 1]]
        ids_piece = ids_chunked[bounds[j]:bounds[j + 1]][:, None]
        got, h = _start(piece, send[j], recv[j], traffic)
        got_ids, h_ids = _start(ids_piece, send[j], recv[j], None)
        flights.append((got, h, got_ids, h_ids))
    pending: list[Future[tuple[Any, float]]] = []
    ids_wait = [0.0] * n

    def fetch_ahead(j: int) -> None:
        """Start chunk ``j``'s fetch as soon as its ids are in (a wait, if any, is comm)."""
        t0 = time.perf_counter()
        flights[j][3].wait()
        ids_wait[j] = time.perf_counter() - t0
        assert fetcher is not None
        pending.append(fetcher.submit(_timed, fetch, flights[j][2][:, 0]))

    backs = []
    try:
        if fetcher is not None:
            fetch_ahead(0)  # while chunk 0's rows are in flight
        for j in range(n):
            got, h, got_ids, h_ids = flights[j]
            t0 = time.perf_counter()
            h.wait()
            h_ids.wait()
            waited = time.perf_counter() - t0 + ids_wait[j]
            overlap.comm_s += waited
            overlap.samples.append((waited, h.nbytes))
            if fetcher is None:
                fetched = fetch_now(fetch, got_ids[:, 0], overlap)
            else:
                if j + 1 < n:  # chunk j+1's experts come while chunk j computes
                    fetch_ahead(j + 1)
                    overlap.fetches_ahead += 1
                fetched = _fetched(pending[j], overlap)
            t0 = time.perf_counter()
            out = compute(got, got_ids[:, 0], fetched)
            took = time.perf_counter() - t0
            overlap.compute_s += took
            overlap.rows += int(got.shape[0])
            others = [f[1] for f in flights[j + 1:]] + [b[1] for b in backs]
            if others:
                overlap.overlapped_s += took
            if any(not o.done() for o in others):
                overlap.hidden_s += took
            backs.append(_start(out, recv[j], send[j], traffic))
    finally:
        # A failed chunk must not leave a fetch running beside the caller's next use of
        # the store's states (they are one thread's at a time).
        wait_all(pending)
    pieces = []
    for y, h in backs:
        t0 = time.perf_counter()
        h.wait()
        overlap.comm_s += time.perf_counter() - t0
        pieces.append(y)
    overlap.chunks += n
    overlap.calls += 1
    overlap.n = n
    y_chunked = torch.cat(pieces)
    y_sorted = y_chunked[inverse_permutation(perm)]  # back to the unchunked order
    y = y_sorted[inverse_permutation(order)].view(n_tok, k, -1)
    return (y * top_k_weights.unsqueeze(-1)).sum(dim=1).to(x.dtype)


def model_time(n: int, alpha: float, beta: float, nbytes: float, compute_s: float) -> float:
    """MPMoE's time of a block in ``n`` chunks (module docstring)."""
    m = alpha + beta * nbytes / n
    c = compute_s / n
    return (n - 1) * max(c, m) + c + 2 * m


def best_chunks(choices: Sequence[int], alpha: float, beta: float, nbytes: float,
                compute_s: float) -> int:
    """The ``n`` of ``choices`` the model gives the least time (the smaller on a tie)."""
    return min(choices, key=lambda n: (model_time(n, alpha, beta, nbytes, compute_s), n))


CHUNK_CHOICES = (1, 2, 4, 8)


def check_pipeline(pipeline: int | str, per_rank: int) -> int | str:
    """``auto``, or a number of chunks that splits the experts each rank owns."""
    if pipeline == "auto":
        return pipeline
    try:
        n = int(pipeline)
    except (TypeError, ValueError):
        raise ValueError(f"--pipeline is auto or a number of chunks, not {pipeline!r}") from None
    if n < 1 or per_rank % n:
        raise ValueError(f"--pipeline {n} does not split the {per_rank} experts each rank owns "
                         "into equal chunks: use a divisor of it, or auto")
    return n


def agree_model(measured: Overlap, world: World) -> tuple[float, float, float, float]:
    """``(alpha, beta, bytes, compute)`` of one unchunked call, the slowest rank's: alpha
    the chunk counts' exchange (a few bytes), beta the dispatch's wait beyond alpha per
    byte, bytes the dispatch's, compute the experts' time."""
    wait, nbytes = measured.samples[0] if measured.samples else (0.0, 0)
    t = torch.tensor([measured.count_s, wait, float(nbytes), measured.compute_s],
                     dtype=torch.float64)
    t = t.to(comm_device(world))
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    alpha, wait, nbytes_f, compute = (float(v) for v in t.cpu())
    beta = max(0.0, wait - alpha) / nbytes_f if nbytes_f > 0 else 0.0
    return alpha, beta, nbytes_f, compute
