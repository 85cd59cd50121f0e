"""Expert parallelism for a ``transformers`` model served by the :mod:`tierstore.hf` backend.

The family's own model code runs on every rank, unchanged: attention, routers and losses
are ``transformers``'. Its MoE blocks call the registered ``tierstore`` experts function
with this rank's tokens (``hidden_states``, ``top_k_index``, ``top_k_weights``); the binding
of every experts module points at an :class:`HFExpertParallel`, whose
:meth:`~HFExpertParallel.forward_layer` takes the call (see
:func:`tierstore.hf.backend.experts_forward`):

1. Each routed slot ``(token, j)``, sorted by expert id, goes to the owner of its expert by
   one all-to-all (ownership is consecutive, so sorted by expert is sorted by owner); the
   expert ids travel with the rows.
2. The owner runs each of its experts on its rows with the backend's own
   :func:`~tierstore.hf.backend.expert_output` (the module's gate, orientation, biases,
   post-expert norm), the experts' fp32 leaves fetched from its node's store by its
   :class:`~trainer.train.expert_states.ExpertStates` (on the fetch thread: a pipelined
   block's next chunk's while this chunk computes, see :mod:`.pipeline`). Rows arrive rank
   0's first, so a stable sort by expert gives every expert its rows in the global batch's
   order, as one process would see them.
3. A second all-to-all brings the outputs back, and they are weighted by ``top_k_weights``
   in fp32 and summed over the k slots, as the backend does in one process.

Both exchanges are autograd-aware (:func:`.collectives.exchange`): the backward pass sends
the outputs' gradients to the owners and the rows' gradients back, so each owned expert's
gradient is the sum over the global batch, and the router's gradient flows through
``top_k_weights`` on the rank that routed.

A data-centric layer (:mod:`.hf_pull`) pulls the experts to the tokens instead.

The router's load-balancing loss is a function of the whole batch's routing (the fraction
of tokens each expert got times its mean router probability). :func:`global_router_loss`
makes the family's own ``load_balancing_loss_func`` see the global batch: the router logits
of every rank are gathered (autograd-aware, the backward sums each rank's share back), so
every rank computes the single process's loss and its exact gradient.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from tierstore.hf.backend import ExpertLayer, expert_output
from torch import Tensor, nn

from .collectives import (
    Traffic,
    all_reduce_sum_,
    clip_global,
    exchange,
    exchange_counts,
    inverse_permutation,
)
from ..train.layout import ExpertLayout, owned_suffix
from .exchange import check_paradigm, ratio_of
from .hf_pull import Pulls
from .pipeline import (
    CHUNK_CHOICES,
    Overlap,
    agree_model,
    best_chunks,
    check_pipeline,
    fetch_now,
    model_time,
    pipelined_block,
)
from .world import World, init_world, owned

# The update rules the experts' AdamW knows (:mod:`trainer.train.dense_rule`).
RULES = ("dense", "lazy")


class HFExpertParallel:
    """The experts source of every experts module on this rank.

    ``states`` serves the experts this rank owns (an
    :class:`~trainer.train.expert_states.ExpertStates` over the node's store).
    ``paradigms``: ``token`` or ``data`` per MoE layer key (:func:`choose`), or one of
    :data:`.exchange.PARADIGMS` for every layer, ``auto`` choosing each by Janus's ratio at
    its first call (a user's loop, whose batch is known only then: :func:`paradigm_for`).
    ``pipeline``: the chunks a token-centric block is split into
    (:mod:`.pipeline`), or ``auto``: per block, by MPMoE's model of the times its first
    call measures (unchunked).

    The step's figures (:meth:`step_figures`) hold each token-centric block's counters
    (``pipeline_blocks``, by layer key: an :class:`~.pipeline.Overlap` and the bytes its
    exchanges sent, forward and backward) and their sums (``pipeline_*``)."""

    def __init__(self, world: World, states: Any, n_experts: int,
                 paradigms: Mapping[int, str] | str = "token", pipeline: int | str = 1) -> None:
        self.world, self.states, self.n_experts = world, states, n_experts
        self.ids = owned(world.rank, n_experts, world.size)
        self.paradigm = check_paradigm(paradigms) if isinstance(paradigms, str) else "token"
        self.paradigms = {} if isinstance(paradigms, str) else dict(paradigms)
        self.pipeline = check_pipeline(pipeline, n_experts // world.size)
        self.chunks: dict[int, int] = {}  # per layer, as auto chose
        self.traffic = Traffic(world)  # the data-centric blocks'
        self.pulls = Pulls(world, states, n_experts, self.traffic)
        # Per token-centric block: its counters, its exchanges' bytes, its module's name.
        self.blocks: dict[int, tuple[Overlap, Traffic, str]] = {}
        self.used: dict[int, str] = {}
        # The owner's fetches from the store, one at a time and in order (the states are
        # not shared between threads; the training thread waits before touching them).
        self.fetcher = ThreadPoolExecutor(1, thread_name_prefix="ep-fetch")

    def begin(self) -> None:
        self.traffic.reset()
        self.pulls.reset()
        self.blocks = {}
        self.pulls.comm_s = 0.0
        self.used = {}

    def _block(self, layer: ExpertLayer) -> tuple[Overlap, Traffic, str]:
        if layer.key not in self.blocks:
            self.blocks[layer.key] = (Overlap(), Traffic(self.world), layer.module_name)
        return self.blocks[layer.key]

    # The experts source protocol (experts() is for a source that computes locally).

    def experts(self, layer: int, ids: list[int], x: Tensor) -> Mapping[int, Sequence[Tensor]]:
        raise RuntimeError("expert-parallel layers are computed by forward_layer()")

    def layer_done(self, layer: int) -> None:
        """The leaves stay until the update: backward needs them."""

    def forward_layer(self, module: nn.Module, layer: ExpertLayer, x: Tensor,
                      top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        mode = self.paradigms.get(layer.key) or self._paradigm(layer, x, top_k_index)
        self.used[layer.key] = mode
        if mode == "data":
            return self.pulls.forward(module, layer, x, top_k_index, top_k_weights)
        n = self.pipeline if isinstance(self.pipeline, int) else self.chunks.get(layer.key)
        if n != 1:
            return self._pipelined(module, layer, x, top_k_index, top_k_weights, n)
        overlap, traffic, _ = self._block(layer)
        w, e_total = self.world.size, self.n_experts
        n_tok, k = top_k_index.shape
        flat = top_k_index.reshape(-1)
        if bool(((flat < 0) | (flat >= e_total)).any()):
            raise ValueError(f"{layer.module_name} routed to an expert id outside 0..{e_total - 1}")
        order = torch.argsort(flat, stable=True)  # slots by expert, hence by owner
        sorted_ids = flat[order]
        send = torch.bincount(sorted_ids * w // e_total, minlength=w).tolist()
        t0 = time.perf_counter()
        recv = exchange_counts(send, self.world)
        rows = exchange(x[order // k], send, recv, None, self.world, traffic)
        got_ids = exchange(sorted_ids[:, None], send, recv, None, self.world)[:, 0]
        overlap.comm_s += time.perf_counter() - t0
        weights = fetch_now(lambda ids: self._fetch(layer, ids), got_ids, overlap)
        t0 = time.perf_counter()
        out = self._compute(module, layer, rows, got_ids, weights)
        overlap.compute_s += time.perf_counter() - t0
        overlap.rows += int(rows.shape[0])
        t0 = time.perf_counter()
        y_sorted = exchange(out, recv, send, None, self.world, traffic)
        overlap.comm_s += time.perf_counter() - t0
        overlap.calls += 1
        overlap.n = 1
        y = y_sorted[inverse_permutation(order)].view(n_tok, k, -1)
        # As the backend in one process: the routing weights in fp32, summed over k.
        return (y * top_k_weights.unsqueeze(-1)).sum(dim=1).to(x.dtype)

    def _pipelined(self, module: nn.Module, layer: ExpertLayer, x: Tensor, top_k_index: Tensor,
                   top_k_weights: Tensor, n: int | None) -> Tensor:
        """The block in ``n`` chunks; ``None``: auto's first call, unchunked, measured."""
        block, traffic, _ = self._block(layer)
        overlap = block if n is not None else Overlap()
        y = pipelined_block(
            x, top_k_index, top_k_weights, n or 1, self.n_experts, self.world,
            lambda ids: self._fetch(layer, ids),
            lambda rows, ids, weights: self._compute(module, layer, rows, ids, weights),
            overlap, traffic, self.fetcher)
        if n is None:
            self.chunks[layer.key] = self._choose(layer, overlap)
            block.merge(overlap)
        return y

    def _paradigm(self, layer: ExpertLayer, x: Tensor, top_k_index: Tensor) -> str:
        """The paradigm of a layer no mapping named, from its first call on: ``auto``'s by
        the most tokens any rank routed (so that the ranks agree), said once."""
        mode = self.paradigm
        if mode == "auto":
            tokens = torch.tensor([top_k_index.shape[0]], dtype=torch.int64)
            dist.all_reduce(tokens, op=dist.ReduceOp.MAX)
            numel = self.states.layout.layer(layer.key).numel
            mode, r = paradigm_for(x.shape[-1], top_k_index.shape[1], numel, self.n_experts,
                                   int(tokens), self.world)
            if self.world.rank == 0:
                print(f"paradigm: {layer.module_name}: {mode} (Janus's ratio {r:.3g} for "
                      f"{int(tokens)} tokens a rank)", flush=True)
        self.paradigms[layer.key] = mode
        return mode

    def _choose(self, layer: ExpertLayer, measured: Overlap) -> int:
        """MPMoE's choice for ``layer`` from its first, unchunked call's times, agreed by
        the ranks (the slowest rank's), and said once."""
        alpha, beta, nbytes, compute = agree_model(measured, self.world)
        per_rank = self.n_experts // self.world.size
        n = best_chunks([c for c in CHUNK_CHOICES if per_rank % c == 0], alpha, beta, nbytes,
                        compute)
        if self.world.rank == 0:
            ms = [model_time(c, alpha, beta, nbytes, compute) * 1e3 for c in (n, 1)]
            print(f"pipeline: {layer.module_name}: {n} chunk(s) (alpha {alpha * 1e6:.0f} us, "
                  f"beta {beta * 1e9:.2f} ns/B, {nbytes / 1e3:.1f} kB, compute "
                  f"{compute * 1e3:.2f} ms; model {ms[0]:.2f} ms, unchunked {ms[1]:.2f} ms)",
                  flush=True)
        return n

    def _fetch(self, layer: ExpertLayer, got_ids: Tensor) -> Mapping[int, Sequence[Tensor]]:
        """The owned experts' leaves for the rows of experts ``got_ids`` (ascending ids, as
        the unchunked block asks)."""
        id_list = torch.unique(got_ids).tolist()
        if any(e not in self.ids for e in id_list):
            raise RuntimeError(f"rank {self.world.rank} received rows of experts it does not "
                               f"own ({id_list}): the ranks disagree on ownership")
        return self.states(layer.key, id_list) if id_list else {}

    def _compute(self, module: nn.Module, layer: ExpertLayer, rows: Tensor, got_ids: Tensor,
                 weights: Mapping[int, Sequence[Tensor]]) -> Tensor:
        """The owner's work: each owned expert on its rows, in the global batch's order."""
        by_expert = torch.argsort(got_ids, stable=True)
        ids, counts = torch.unique_consecutive(got_ids[by_expert], return_counts=True)
        id_list = ids.tolist()
        pieces, start = [], 0
        for e, c in zip(id_list, counts.tolist()):
            pieces.append(expert_output(module, rows[by_expert[start:start + c]],
                                        layer.split(weights[e])))
            start += c
        if not pieces:  # nothing routed here; still in the graph, so the backward runs
            return rows[:0]
        # In the rows' dtype: a rank that got no rows answers in it too (autocast).
        out_sorted = torch.cat(pieces).to(rows.dtype)
        return out_sorted[inverse_permutation(by_expert)]

    # -- the step's end ---------------------------------------------------------------

    @torch.no_grad()
    def reduce_gradients(self, dense: Sequence[Tensor]) -> list[Tensor]:
        """After the step's last backward, each rank's loss being its own batch's mean: the
        pulled experts' gradients go back to their owners, the dense gradients are averaged
        over the ranks, and the owned experts' (summed over the ranks by the exchanges'
        backward and the returned gradients) divided by the world size, so that every
        gradient is the global batch's mean loss's. A dense parameter no rank's loss
        reached keeps no gradient (AdamW skips it, as in one process); one that some rank's
        reached gets zeros where it has none. Returns the dense gradients."""
        self.pulls.return_grads()
        owned_grads = self.states.grads()
        has = torch.tensor([p.grad is not None for p in dense], dtype=torch.int64)
        dist.all_reduce(has)
        grads = []
        for p, n in zip(dense, has.tolist()):
            if n and p.grad is None:
                p.grad = torch.zeros_like(p)
            if n:
                grads.append(p.grad)
        all_reduce_sum_(grads)
        for g in [*grads, *owned_grads]:
            g.div_(self.world.size)
        return grads

    def clip(self, dense: Sequence[Tensor], owned_grads: Sequence[Tensor],
             max_norm: float | None) -> Tensor:
        """The global norm (dense gradients replicated, experts' held by their owners) and
        clipping by it; returns the norm before clipping."""
        return clip_global(dense, owned_grads, self.world, max_norm)

    def step_figures(self) -> dict[str, Any]:
        total, blocks = Overlap(), {}
        moved = self.traffic.figures()
        for key, (overlap, traffic, name) in sorted(self.blocks.items()):
            total.merge(overlap)
            sent = traffic.figures()
            for kind, nbytes in sent.items():
                moved[kind] += nbytes
            blocks[str(key)] = {"block": name, **overlap.block_figures(),
                                "bytes": sent["tokens_intra_bytes"] + sent["tokens_cross_bytes"]}
        return {**moved, "comm_s": self.pulls.comm_s + total.comm_s,
                "paradigm": {str(k): v for k, v in sorted(self.used.items())},
                **total.figures(), "pipeline_blocks": blocks}

    def close(self) -> None:
        """Stop the fetch thread (idle between blocks)."""
        self.fetcher.shutdown(wait=True)


def choose(layout: ExpertLayout, hidden: int, paradigm: str, tokens_per_rank: int,
           world: World) -> dict[int, str]:
    """The paradigm of every MoE layer: ``paradigm``, or with ``auto`` data-centric where
    Janus's ratio (:func:`.exchange.ratio_of`, for the layer's own expert size) exceeds 1."""
    check_paradigm(paradigm)
    if paradigm != "auto":
        return dict.fromkeys(layout.keys, paradigm)
    return {key: paradigm_for(hidden, layout.top_k, layout.layer(key).numel, layout.n_experts,
                              tokens_per_rank, world)[0] for key in layout.keys}


def paradigm_for(hidden: int, top_k: int, numel: int, n_experts: int, tokens_per_rank: int,
                 world: World) -> tuple[str, float]:
    """Janus's choice for one MoE layer of experts of ``numel`` parameters: data-centric
    where its ratio (:func:`.exchange.ratio_of`) exceeds 1; and the ratio."""
    r = ratio_of(hidden, top_k, numel, n_experts, tokens_per_rank, world)
    return ("data" if r > 1 else "token"), r


class _GatherRows(torch.autograd.Function):
    """Every rank's ``[T, ...]`` tensor (equal T), concatenated in rank order; the backward
    gives each rank the sum over ranks of its rows' gradients."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, world: World) -> Tensor:
        ctx.world, ctx.n = world, x.shape[0]
        parts = [torch.empty_like(x) for _ in range(world.size)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, None]:
        total = grad.contiguous().clone()
        dist.all_reduce(total)
        r, n = ctx.world.rank, ctx.n
        return total[r * n:(r + 1) * n], None


def gather_rows(x: Tensor, world: World) -> Tensor:
    return _GatherRows.apply(x, world)  # type: ignore[no-any-return]


def install_router_loss(model: nn.Module, world: World) -> Callable[[], None]:
    """Make the family's ``load_balancing_loss_func`` (where its modeling module has one)
    compute the global batch's router loss on every rank (module docstring); returns what
    puts the original back. Its gradient is every rank's: scaled like the rest of each
    rank's loss and summed over the ranks, it is the single process's."""
    modules = {sys.modules[type(m).__module__] for m in model.modules()}
    patched: list[tuple[Any, Callable[..., Any]]] = []
    for mod in modules:
        original = getattr(mod, "load_balancing_loss_func", None)
        if original is None or getattr(original, "_tierstore_global", False):
            continue
        patched.append((mod, original))
        mod.load_balancing_loss_func = _globally(original, world)

    def restore() -> None:
        for mod, original in patched:
            mod.load_balancing_loss_func = original

    return restore


@contextlib.contextmanager
def global_router_loss(model: nn.Module, world: World) -> Iterator[None]:
    """:func:`install_router_loss` while inside."""
    restore = install_router_loss(model, world)
    try:
        yield
    finally:
        restore()


def owned_layout(layout: ExpertLayout, world: World) -> tuple[ExpertLayout, range]:
    """``layout`` as rank ``world.rank`` trains it (its own step-count entry per layer and
    dense-rule history: the node's ranks share the store), and the experts it owns."""
    mine = owned(world.rank, layout.n_experts, world.size)
    return replace(layout, counts_suffix=owned_suffix(mine), owned=mine), mine


def any_rank(world: World) -> Callable[[bool], bool]:
    """Whether any rank says yes (the dense rule's question of :class:`ExpertStates`: did
    any rank's experts get a gradient this step, so that every rank takes the global
    step). One collective, which every rank asks at the same point of the step."""
    def agree(mine: bool) -> bool:
        if world.size == 1:
            return mine
        flag = torch.tensor([int(mine)], dtype=torch.int64)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    return agree


def join_world(process_group: Any, device: torch.device) -> World:
    """The :class:`~.world.World` of a user's loop under torchrun: the default process
    group (initialised here from torchrun's environment where the loop has not)."""
    if process_group is not True and not (dist.is_initialized()
                                          and process_group is dist.group.WORLD):
        raise ValueError("expert parallelism runs over the default process group: pass "
                         "process_group=torch.distributed.group.WORLD (or True)")
    return init_world(str(device))


def _globally(original: Callable[..., Any], world: World) -> Callable[..., Any]:
    def loss(gate_logits: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(gate_logits, tuple) and world.size > 1:
            mask = kwargs.get("attention_mask", args[2] if len(args) > 2 else None)
            if mask is not None:  # packed windows carry none; a padded batch is not split
                raise ValueError("the expert-parallel router loss takes no attention mask")
            gate_logits = tuple(gather_rows(g, world) for g in gate_logits)
        return original(gate_logits, *args, **kwargs)

    loss._tierstore_global = True  # type: ignore[attr-defined]
    return loss
