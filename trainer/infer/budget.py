"""What generation holds besides the experts, and the part of the device budget left to them.

A process's memory under a budget (docs/inference.md, "Memory budget"): the interpreter
with torch, the dense weights, the host cache (``--host-cache``), the device budget
(``--device-budget``) and a fixed overhead. The device budget bounds everything the
device side holds: the KV cache, the activations of a pass and the experts of the source
(the ring's slots, expert mode's cache and transfers, on-demand's routed experts). The KV
cache's size is known before generating and the activations are bounded from the batch
and the prompt length, so both come off the budget first, and what is left goes to the
source. Too little left for what the mode needs is a :class:`BudgetError` naming the
number to raise the budget to.
"""

from __future__ import annotations

import resource
from dataclasses import dataclass
from typing import Any

import torch

import tierstore

DEVICE_BUDGET = "--device-budget"
# What a process holds besides the interpreter with torch, the dense weights and the two
# budgets, at most: the store's idle read buffers (IDLE_READ_BUFFER_BYTES, 64 MiB) and up to
# as much again of thread stacks, allocator slack, catalog pages and Python objects.
FIXED_OVERHEAD_BYTES = 128 << 20


class BudgetError(tierstore.StoreError):
    """A memory budget too small for what a step or token needs: ``option`` is the
    option that sets it, ``need`` the bytes it must be at least to hold ``what``."""

    def __init__(self, message: str, option: str = DEVICE_BUDGET, need: int = 0,
                 what: str = "") -> None:
        super().__init__(message)
        self.option, self.need, self.what = option, need, what


def too_small(what: str, need: int, budget: int, option: str = DEVICE_BUDGET) -> BudgetError:
    """The one-line error: ``option``'s ``budget`` cannot hold ``what`` (``need`` bytes)."""
    fmt = tierstore.format_size
    return BudgetError(f"{option} {fmt(budget)} is below {what} ({fmt(need)}); raise it to at "
                       f"least {fmt(need)}", option, need, what)


def device_memory(device: torch.device) -> int:
    """The memory a run on ``device`` has: a GPU's, or on the CPU what this process may
    have resident (:func:`tierstore.memory_limit`)."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    return tierstore.memory_limit()


def check_budget_fits(device_budget: int | None, device: torch.device) -> None:
    """Refuse a device budget larger than the device's memory (on the CPU, the machine's):
    nothing it promises could hold, and what it admits would be swapped or OOM-killed."""
    if device_budget is None:
        return
    memory = device_memory(device)
    if device_budget > memory:
        fmt = tierstore.format_size
        place = "this machine" if device.type == "cpu" else str(device)
        raise BudgetError(f"{DEVICE_BUDGET} {fmt(device_budget)} is more than {place}'s "
                          f"{fmt(memory)} of memory; lower it", DEVICE_BUDGET)


@dataclass(frozen=True)
class PassShape:
    """The sizes one pass's activations are bounded by, read off a ``transformers`` config:
    hidden size, attention heads (query and key/value) and their width, the widest FFN,
    experts per token and vocabulary."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    top_k: int
    vocab: int

    @classmethod
    def of(cls, config: Any, top_k: int) -> PassShape:
        """A heterogeneous config (gemma4, dots3_note: sizes that vary by layer, which it
        refuses to give globally) is bounded by its widest layer's."""
        c = config.get_text_config() if hasattr(config, "get_text_config") else config
        layers = list(c.per_layer_config) if getattr(c, "is_heterogeneous", False) else []
        varying = (c.per_layer_attributes or set()) if layers else set()

        def first(*names: str, default: int = 0) -> int:
            for n in names:
                got = [getattr(x, n, None) for x in (layers if n in varying else [c])]
                got = [v for v in got if isinstance(v, int) and v > 0]
                if got:
                    return max(got)
            return default

        hidden = first("hidden_size", default=1)
        heads = first("num_attention_heads", default=1)
        head_dim = max(first("head_dim", default=hidden // heads), first("qk_head_dim"),
                       first("v_head_dim"))
        ffn = max(first("intermediate_size"), first("moe_intermediate_size"),
                  first("shared_expert_intermediate_size"), 1)
        return cls(hidden, heads, first("num_key_value_heads", default=heads), head_dim, ffn,
                   top_k, first("vocab_size", default=1))


def activation_bytes(shape: PassShape, batch: int, tokens: int, context: int,
                     dtype: torch.dtype) -> int:
    """A bound on the tensors one pass of ``tokens`` new tokens per sequence (over
    ``context`` positions in all) holds at once, besides weights and the KV cache: the
    residual stream, and the largest of a layer's attention (projections and their rotated
    copies, keys and values repeated over the query heads, and the scores with their
    softmax, as the math kernel keeps them), its MoE part (the gathered tokens, one
    expert's intermediates over every token, the routed outputs in fp32) and the head's
    fp32 logits, of each sequence's last position only (generation projects no other)."""
    per = torch.empty(0, dtype=dtype).element_size()
    n = batch * tokens
    h, k = shape.hidden, shape.top_k
    residual = 2 * n * h * per
    attention = (3 * n * (shape.heads + 2 * shape.kv_heads) * shape.head_dim * per
                 + 2 * batch * shape.heads * context * shape.head_dim * per
                 + 2 * batch * shape.heads * tokens * context * 4)
    moe = n * (3 * shape.ffn + 4 * k * h + h) * 4
    head = batch * (shape.vocab * 2 + h) * 4
    return residual + max(attention, moe, head)


@dataclass
class GenerationBudget:
    """The device budget of one generation, split: ``kv_cache`` and ``activations`` come
    off ``device`` first, ``experts`` is what the source may hold."""

    device: int
    kv_cache: int
    activations: int

    @property
    def reserved(self) -> int:
        return self.kv_cache + self.activations

    @property
    def experts(self) -> int:
        return self.device - self.reserved

    def check(self, what: str, need: int) -> None:
        """Raise :class:`BudgetError` unless the experts' share holds ``need`` bytes of
        ``what`` (and is not negative); the number named is the whole device budget that
        would."""
        if self.experts < need or self.experts < 0:
            fmt = tierstore.format_size
            total = need + self.reserved
            raise BudgetError(
                f"{DEVICE_BUDGET} {fmt(self.device)} is below what this generation needs: "
                f"{fmt(self.kv_cache)} of KV cache + {fmt(self.activations)} of activations "
                f"+ {fmt(need)} for {what}; raise it to at least {fmt(total)}",
                DEVICE_BUDGET, total, what)

    def as_dict(self) -> dict[str, int]:
        return {"device_budget_bytes": self.device, "kv_cache_bytes": self.kv_cache,
                "activation_bytes": self.activations, "expert_budget_bytes": self.experts}


def generation_budget(shape: PassShape, kv_per_token: int, kv_fixed: int, device_budget: int,
                      batch: int, prompt_len: int, max_new_tokens: int,
                      dtype: torch.dtype) -> GenerationBudget:
    """The split of ``device_budget`` for generating ``max_new_tokens`` after prompts
    padded to ``prompt_len`` (the prefill is the larger pass). ``kv_per_token`` and
    ``kv_fixed``: the model's cache bytes per sequence, per position and besides (measured
    on the model itself: :func:`tierstore.hf.warmup.cache_bytes`)."""
    context = prompt_len + max_new_tokens
    kv = batch * (kv_fixed + kv_per_token * context) + batch * context  # and the mask
    return GenerationBudget(
        device=int(device_budget), kv_cache=kv if max_new_tokens else 0,
        activations=activation_bytes(shape, batch, prompt_len, context, dtype))


def pooled_host_cache(plan: GenerationBudget, host_cache: int, expert_bytes: int,
                      per_layer: int) -> tuple[int, int]:
    """Expert mode or on demand on a CPU, streaming from the backing tier: ``(host cache
    bytes, the source's budget)`` that pool the host cache and the experts' share of the
    device budget into one cache.

    On a CPU the "device" is host memory and the prefetch queue lends views of host-cache
    slots, so a device-side expert cache would hold the same experts as the host cache:
    the two overlap instead of adding up (on demand borrows host-cache slots for one layer
    and keeps nothing, so the rest of its share held nothing). Pooled, the source (for
    expert mode, through its prefetch queue) keeps only the working set, one
    MoE layer's routed experts (``per_layer`` of ``expert_bytes``; a layer that routes to
    more is served in groups), and the host cache takes the rest of the experts' share.
    What the source holds is a pin of a host-cache slot or, where the cache refused the
    entry, a buffer of the store's within the source's budget; so the two together
    never hold more than ``host_cache + plan.experts``, the bound of the unpooled split."""
    working = min(plan.experts, per_layer * expert_bytes)
    return host_cache + plan.experts - working, working


def peak_rss_bytes() -> int:
    """The process's peak resident set so far: its memory's high-water mark (``VmHWM``).
    Not ``getrusage``: Linux counts there the peak of the process that forked this one
    too, so a command started by a large process would report that process's memory."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
