"""Text generation with a :class:`trainer.model.MoEDecoder` whose experts live in a store.

A batch of prompts is left-padded into one ``[B, T]`` tensor with an attention mask, run
through the model once (prefill) to fill the KV cache, then extended one token per step.
Like ``transformers``' ``generate``: a sequence that produced one of the model's
end-of-sequence tokens is finished (its later positions get the pad token and are not
returned), and generation stops when every sequence has finished or after
``max_new_tokens``. Greedy decoding takes the arg-max; sampling divides the logits by the
temperature, keeps the smallest set of tokens whose probability reaches ``top_p`` and
draws from a generator seeded with ``seed``, so a seed reproduces its tokens.

Which expert source the model uses (resident, on demand, ring, expert mode) is the
caller's choice; :func:`make_source` builds one by name.
"""

from __future__ import annotations

import contextlib
import math
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

import tierstore

from ..model import ExpertSource, ExpertWeights, MoEModel, expert_names
from .budget import (
    BudgetError,
    check_budget_fits,
    generation_budget,
    peak_rss_bytes,
    pooled_host_cache,
)
from .device_queue import DeviceClock, host_cache_bytes, queue_budget
from .loading import stop_tokens
from .sources import OnDemandSource, ResidentSource

MODES = ("ring", "expert", "resident", "on-demand")

# While a source streams experts, its read threads and the compute thread share the
# interpreter. The compute thread lets go of it inside every torch op and needs it back to
# issue the next; at CPython's default 5 ms switch interval a read thread busy in Python
# (checksums' bookkeeping, catalog lookups) keeps it that long, and a CPU prefill of a few
# hundred ops per layer waits on it op after op. At 0.5 ms a transfer-bound ring prefill
# from NVMe ran 8 % faster (trained `medium`, K=4), and a compute-bound one at 0.89 of
# resident instead of 0.83 (docs/performance.md, "Switching threads sooner").
STREAMING_SWITCH_INTERVAL_S = 5e-4
_switch_lock = threading.Lock()
_switch_users = 0
_switch_saved = 0.0


@contextlib.contextmanager
def responsive_interpreter(interval: float = STREAMING_SWITCH_INTERVAL_S) -> Iterator[None]:
    """Run the block with the interpreter's thread switch interval at most ``interval``
    seconds, then put it back (nested and concurrent blocks keep it until the last ends)."""
    global _switch_users, _switch_saved
    with _switch_lock:
        if _switch_users == 0:
            _switch_saved = sys.getswitchinterval()
            sys.setswitchinterval(min(_switch_saved, interval))
        _switch_users += 1
    try:
        yield
    finally:
        with _switch_lock:
            _switch_users -= 1
            if _switch_users == 0:
                sys.setswitchinterval(_switch_saved)


@dataclass
class GenerationResult:
    """Generated tokens per prompt (prompt excluded, up to and including an end-of-sequence
    token) and what the run measured."""

    tokens: list[list[int]]
    seconds: float  # prefill and decode, wall clock
    prefill_s: float
    decode_s: float
    new_tokens: int  # generated tokens over all sequences
    stall_s: float  # blocked waiting for experts
    source: dict[str, Any] = field(default_factory=dict)  # the source's own statistics
    peak_rss_bytes: int = 0  # the process's peak resident memory when generation ended
    # Before the clock: the source taking the memory its first pass reads into (see
    # ExpertSource.prepare), reported apart so that it shows and neither timed phase hides it.
    prepare_s: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def stall_frac(self) -> float:
        return self.stall_s / self.seconds if self.seconds > 0 else 0.0

    def summary(self) -> dict[str, Any]:
        """The ``tierstore generate --json`` object."""
        return {"tokens": self.tokens, "tokens_per_s": self.tokens_per_s,
                "stall_frac": self.stall_frac, "hit_rate": self.source.get("hit_rate"),
                "spec_accuracy": self.source.get("spec_accuracy"),
                # the phases apart, for benchmarks that run `tierstore generate` per process
                "prefill_s": self.prefill_s, "decode_s": self.decode_s,
                "prepare_s": self.prepare_s, "bytes_read": self.source.get("bytes_read"),
                "peak_rss_bytes": self.peak_rss_bytes}


class _Instrumented(ExpertSource):
    """Wraps a source: times its ``experts`` calls (the stall, for sources that do not
    measure their own) and records the routing trace."""

    def __init__(self, inner: ExpertSource, recorder: Any = None, nbytes: int = 0) -> None:
        self.inner, self.recorder, self.nbytes = inner, recorder, nbytes
        self.step = 0
        self.waited = 0.0
        self.last = False  # the coming pass is the generation's last

    def prepare(self, model: MoEModel) -> None:
        self.inner.prepare(model)

    def begin_pass(self, model: MoEModel, n_tokens: int) -> None:
        if self.last:
            self.inner.final_pass()  # a ring reads nothing for a pass that will not run
        self.inner.begin_pass(model, n_tokens)

    def experts(self, layer: int, ids: list[int], x: Tensor) -> Mapping[int, ExpertWeights]:
        if self.recorder is not None:
            self.recorder.record(self.step, layer, ids, self.nbytes)
        t0 = time.perf_counter()
        try:
            return self.inner.experts(layer, ids, x)
        finally:
            self.waited += time.perf_counter() - t0

    def layer_done(self, layer: int) -> None:
        self.inner.layer_done(layer)

    def end_pass(self) -> None:
        self.inner.end_pass()


def make_source(mode: str, store: tierstore.Store, model: MoEModel, *,
                ring_slots: int | str = "auto", budget: int | None = None,
                policy_args: Mapping[str, Any] | None = None,
                host_pool: bool = False) -> ExpertSource:
    """An expert source by name: ``ring`` (``ring_slots`` K or ``"auto"``), ``expert``
    (routed experts, speculative prefetch, device expert cache), ``resident`` (every expert
    loaded first) or ``on-demand`` (synchronous reads of the routed experts). ``budget``:
    bytes of experts the source may hold (resident mode holds them all). ``host_pool``
    (expert mode): the store's host cache is the expert cache (see
    :class:`~trainer.infer.expert_mode.ExpertModeSource`)."""
    if mode == "ring":
        from .ring import RingSource

        return RingSource(store, model.device, slots=ring_slots, budget=budget,
                          dtype=model.dtype)
    if mode == "expert":
        from .expert_mode import ExpertModeSource

        return ExpertModeSource(store, model.device, budget=budget, policy_args=policy_args,
                                dtype=model.dtype, host_pool=host_pool)
    if mode == "resident":
        return ResidentSource(store, model)
    if mode == "on-demand":
        return OnDemandSource(store, model, budget=budget)
    raise tierstore.StoreError(f"unknown mode {mode!r}; choose one of {', '.join(MODES)}")


def pad_left(prompts: Sequence[Sequence[int]], pad_id: int,
             device: torch.device | str | None = None) -> tuple[Tensor, Tensor]:
    """``(ids [B, T], attention_mask [B, T])`` with the prompts right-aligned."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise tierstore.StoreError("every prompt needs at least one token")
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(list(p), dtype=torch.long)
        mask[i, width - len(p):] = 1
    return ids.to(device), mask.to(device)


class NonFiniteLogitsError(tierstore.StoreError):
    """The model computed NaN or infinite logits: no token can be chosen from them."""


def check_logits(logits: Tensor, step: int) -> None:
    """Refuse logits ``[B, V]`` that are not all finite, naming the first such row: they
    come from weights holding NaN or infinite values (or a computation they overflow), and
    a token chosen from them would be noise, or a sampler's failure, never an answer."""
    finite = torch.isfinite(logits).all(dim=-1)
    if bool(finite.all()):
        return
    row = int((~finite).nonzero()[0, 0])
    what = "NaN" if bool(logits[row].isnan().any()) else "infinite"
    at = "the prompt" if step == 0 else f"generated token {step}"
    raise NonFiniteLogitsError(
        f"the model computed {what} logits for prompt {row} after {at}: its weights hold "
        "NaN or infinite values (a diverged training run, or a damaged import); generate "
        "from a sound checkpoint")


def next_tokens(logits: Tensor, *, greedy: bool, temperature: float, top_p: float,
                generator: torch.Generator | None) -> Tensor:
    """One token per row of ``logits`` ``[B, V]`` (finite: see :func:`check_logits`)."""
    if greedy:
        return logits.argmax(dim=-1)
    if not 0 < temperature < math.inf:
        raise tierstore.StoreError(f"temperature must be a finite number above 0, "
                                   f"got {temperature}")
    if not 0 < top_p <= 1:
        raise tierstore.StoreError(f"top_p must be in (0, 1], got {top_p}")
    # Shifted so that the largest score is 0 before the division, and divided by no less
    # than fp32's smallest normal number (a smaller temperature is 0 in fp32, and 0/0 is
    # NaN): a temperature so small that the scores overflow leaves the most likely tokens
    # at 0 and the rest at -inf, which is what sampling at it is, greedy.
    scores = logits.float()
    tiny = torch.finfo(scores.dtype).tiny
    scores = (scores - scores.amax(dim=-1, keepdim=True)) / max(temperature, tiny)
    if top_p < 1.0:
        # transformers' top-p: drop the least likely tokens whose total probability is at
        # most 1 - top_p, always keeping the most likely one.
        sorted_scores, order = scores.sort(dim=-1)
        cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
        remove = cumulative <= 1 - top_p
        remove[..., -1] = False
        scores = scores.masked_fill(remove.scatter(-1, order, remove), float("-inf"))
    probs = scores.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


# The experts a warm-up pass computes with: the model's shapes but this wide (see warm_up).
WARM_UP_FFN = 64


class _NarrowExperts(ExpertSource):
    """Zero experts ``WARM_UP_FFN`` wide for every id: a pass through every kernel a real
    one runs, at a fraction of its compute, reading nothing from any store."""

    def __init__(self, model: MoEModel) -> None:
        cfg = model.cfg
        f, h = min(WARM_UP_FFN, cfg.moe_ffn), cfg.hidden_size
        kw = {"dtype": model.dtype, "device": model.device}
        self.weights = (torch.zeros(f, h, **kw), torch.zeros(h, f, **kw),
                        torch.zeros(f, h, **kw))

    def experts(self, layer: int, ids: list[int], x: Tensor) -> Mapping[int, ExpertWeights]:
        return {e: self.weights for e in ids}


def warm_up(model: MoEModel, ids: Tensor, mask: Tensor) -> None:
    """Run the prompt through the model once with narrow zero experts, as part of loading
    (llama.cpp warms up the same way). A process's first pass otherwise pages in the code
    of every operation it runs, and with a cold page cache each page is a read queued
    behind the experts' 8 MiB requests: on the development VM, 31 such faults held a
    ring's first MoE layer 140 ms behind its reads, its slots filled, and the disk sat idle
    35 ms. Warmed up (45 ms here, before the clock), the layer's experts were asked for 5
    ms into the pass and the reads never stopped. The faults are paid either way; taken
    here they do not stall a pass that streams (docs/inference.md)."""
    b, t = ids.shape
    model.decode(ids, _NarrowExperts(model), model.new_cache(b, t), mask, last_only=True)


def generate(model: MoEModel, source: ExpertSource, prompts: Sequence[Sequence[int]],
             max_new_tokens: int, *, greedy: bool = True, temperature: float = 1.0,
             top_p: float = 1.0, seed: int | None = None,
             eos_token_ids: Sequence[int] | None = None, pad_token_id: int | None = None,
             trace: Any = None, trace_nbytes: int | None = None,
             decode_threads: int | None = None, warm: bool = True) -> GenerationResult:
    """Generate up to ``max_new_tokens`` tokens after each prompt (lists of token ids).
    Sampling (``greedy=False``) with a ``seed`` repeats its tokens; without one it does not.

    ``eos_token_ids`` default to the model's; ``pad_token_id`` to the model's, else its
    first end-of-sequence id, else 0. ``trace``: a ``tierstore.lab.TraceRecorder`` that
    receives every MoE layer's routed experts per step (step 0 is the prefill, step n the
    n-th decode step), each access ``trace_nbytes`` long (default: one expert's bytes).
    ``decode_threads``: torch's thread count from the first decode step on (default: as
    it is). ``warm``: run the prompts through the model once before the clock starts
    (:func:`warm_up`), counted in ``prepare_s``.
    """
    if max_new_tokens < 0:
        raise tierstore.StoreError("max_new_tokens must be >= 0")
    cfg = model.cfg
    eos = tuple(stop_tokens(cfg) if eos_token_ids is None else eos_token_ids)
    pad = pad_token_id if pad_token_id is not None else cfg.pad_token_id
    if pad is None:
        pad = eos[0] if eos else 0
    for p in prompts:
        bad = [t for t in p if not 0 <= int(t) < cfg.vocab_size]
        if bad:
            raise tierstore.StoreError(f"token ids {bad[:5]} outside the vocabulary "
                                       f"(0..{cfg.vocab_size - 1})")
    dev = model.device
    ids, mask = pad_left(prompts, pad, dev)
    b, t = ids.shape
    wrapped = _Instrumented(source, trace, trace_nbytes if trace_nbytes is not None
                            else cfg.expert_bytes(model.dtype))
    generator = None
    if not greedy:
        generator = torch.Generator(device=dev)
        if seed is None:
            generator.seed()  # a fresh, unrepeatable draw
        else:
            generator.manual_seed(int(seed))
    out = torch.full((b, max_new_tokens), pad, dtype=torch.long, device=dev)
    done = torch.zeros(b, dtype=torch.bool, device=dev)
    eos_t = torch.tensor(eos, dtype=torch.long, device=dev)
    n = 0
    t_prepare = time.perf_counter()
    wrapped.prepare(model)
    if warm and max_new_tokens:
        warm_up(model, ids, mask)
    prepare_s = time.perf_counter() - t_prepare
    clock = DeviceClock(torch.device(dev))  # device time: CUDA kernels are only queued
    start = time.perf_counter()
    first = clock.mark()
    prefill_s = 0.0
    with responsive_interpreter():
        if max_new_tokens:
            cache = model.new_cache(b, t + max_new_tokens)
            wrapped.last = max_new_tokens == 1
            logits = model.decode(ids, wrapped, cache, mask, last_only=True)[:, -1]
            prefill_s = clock.seconds(first, clock.mark())
            if decode_threads is not None:
                torch.set_num_threads(decode_threads)
            while True:
                check_logits(logits, n)
                tok = next_tokens(logits, greedy=greedy, temperature=temperature, top_p=top_p,
                                  generator=generator)
                tok = torch.where(done, torch.full_like(tok, pad), tok)
                out[:, n] = tok
                n += 1
                if eos:
                    done |= torch.isin(tok, eos_t)
                if n == max_new_tokens or bool(done.all()):
                    break
                # transformers extends every row's mask, finished or not.
                mask = torch.cat([mask, torch.ones((b, 1), dtype=mask.dtype, device=dev)], dim=1)
                wrapped.step += 1
                wrapped.last = n + 1 == max_new_tokens
                logits = model.decode(tok[:, None], wrapped, cache, mask, last_only=True)[:, -1]
    seconds = time.perf_counter() - start
    tokens = _trim(out[:, :n].tolist(), set(eos))
    stats = dict(source.stats())
    stall = float(stats.get("stall_s", wrapped.waited))
    return GenerationResult(tokens=tokens, seconds=seconds, prefill_s=prefill_s,
                            decode_s=seconds - prefill_s,
                            new_tokens=sum(len(s) for s in tokens), stall_s=stall,
                            source=stats, peak_rss_bytes=peak_rss_bytes(),
                            prepare_s=prepare_s)


def _trim(rows: list[list[int]], eos: set[int]) -> list[list[int]]:
    """Each row up to and including its first end-of-sequence token."""
    trimmed = []
    for row in rows:
        end = next((i for i, tok in enumerate(row) if tok in eos), len(row) - 1)
        trimmed.append(row[:end + 1])
    return trimmed


def encode_prompts(store: tierstore.Store, family: str, texts: Sequence[str]) -> tuple[
        list[list[int]], Any]:
    """Token ids of text prompts through the store's tokenizer (a trainer model, which has
    none, reads UTF-8 bytes), and the tokenizer (None for bytes)."""
    from .loading import load_tokenizer

    tok = load_tokenizer(store)
    if tok is not None:
        return [tok.encode(t).ids for t in texts], tok
    if family == "tierstore":
        return [list(t.encode("utf-8")) for t in texts], None
    raise tierstore.StoreError(f"store {store.path} holds no tokenizer: pass token ids with "
                               "--prompt-ids")


def decode_tokens(tok: Any, ids: Sequence[int]) -> str:
    if tok is not None:
        return str(tok.decode(list(ids), skip_special_tokens=False))
    return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


def compute_threads(mode: str, device: torch.device, default: int, host_cache: int,
                    expert_bytes: int, *, pooled: bool = False) -> tuple[int, int]:
    """Compute threads for ``mode`` when the user gives none, for the prefill and for the
    decode steps after it: torch's ``default``, or one fewer for the ring and expert mode
    on a CPU while they stream experts from the backing tier. Their read threads then need
    a core of their own: compute threads spinning on every core starve them while a step
    waits for experts. A host cache of ``host_cache`` bytes smaller than the model's
    ``expert_bytes`` streams on every pass. One that holds every expert streams only on
    the first, the prefill; after it the core is better spent computing. On the issue's
    model (2 vCPUs, host cache 2 GiB, quiet machine) two threads decoded at 26.4 tokens/s
    against one thread's 16.4 for the ring, and at 22.8–25.7 against 15.5–16.5 for expert
    mode; the ring's cold prefill reached 0.75 of its physical limit on two threads, and
    0.90 on one. Expert mode with the host cache ``pooled`` reads on the calling thread
    (see :mod:`trainer.infer.expert_mode`): no read thread to leave a core to."""
    if device.type != "cpu" or mode not in ("ring", "expert") or pooled:
        return default, default
    fewer = max(1, default - 1)
    return fewer, (default if host_cache >= expert_bytes else fewer)


def _least(mode: str, model: MoEModel, resident_bounded: bool) -> tuple[str, int]:
    """What ``mode`` must hold at the least, and its bytes: the ring streams a layer one
    expert at a time at the least, expert mode needs the experts one token routes to, on
    demand one expert at a time; resident mode holds every expert (under a budget only
    where one was given)."""
    cfg = model.cfg
    one = cfg.expert_bytes(model.dtype)
    if mode == "expert":
        return f"the {cfg.top_k} experts one token routes to", cfg.top_k * one
    if mode == "resident":
        every = len(cfg.moe_layers) * cfg.layer_expert_bytes(model.dtype)
        return "every expert (resident mode)", every if resident_bounded else 0
    return f"one expert ({mode} mode)", one


def run_generate(*, store: str | None, prompts: Sequence[str], prompt_ids: Sequence[str],
                 max_new_tokens: int, greedy: bool, temperature: float, top_p: float,
                 seed: int | None, device_budget: int | None, ring_slots: str, mode: str,
                 device: str, host_cache: int | None, trace: str | None, as_json: bool,
                 threads: int | None = None, echo: Any = print,
                 connect: str | None = None, warm: bool = True) -> None:
    """What ``tierstore generate`` runs (see its --help)."""
    import json

    from tierstore.lab import TraceRecorder

    from .loading import load_model, model_info

    if bool(prompts) == bool(prompt_ids):
        raise tierstore.StoreError("give prompts with --prompt or with --prompt-ids (not both)")
    slots: int | str = ring_slots
    if ring_slots != "auto":
        try:
            slots = int(ring_slots)
        except ValueError:
            raise tierstore.StoreError(f"--ring-slots must be auto or a positive integer, "
                                       f"got {ring_slots!r}") from None
    dev = device if device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    cpu = torch.device(dev).type == "cpu"
    check_budget_fits(device_budget, torch.device(dev))
    before = torch.get_num_threads()

    def open_store(host: int | None) -> tierstore.Store:
        if connect is not None:  # the daemon's store and host cache
            return tierstore.connect(connect, device_budget=device_budget)
        kw: dict[str, Any] = {}
        if host is not None:
            kw["host_cache"] = host
        if device_budget is not None:
            kw["device_budget"] = device_budget
        return tierstore.open(store, **kw)

    st = open_store(host_cache)
    try:
        family = model_info(st)["family"]
        if prompt_ids:
            try:
                ids = [[int(x) for x in p.replace(" ", "").split(",") if x] for p in prompt_ids]
            except ValueError:
                raise tierstore.StoreError("--prompt-ids takes comma-separated integers, e.g. "
                                           "1,2,3") from None
            tok = None
            if not as_json:
                from .loading import load_tokenizer

                tok = load_tokenizer(st)
        else:
            ids, tok = encode_prompts(st, family, prompts)
        model = load_model(st, dev)
        plan = generation_budget(
            model.cfg, device_budget if device_budget is not None
            else queue_budget(st, torch.device(dev)), len(ids),
            max((len(p) for p in ids), default=0), max_new_tokens, model.dtype)
        plan.check(*_least(mode, model, device_budget is not None))
        experts_budget = plan.experts
        cfg = model.cfg
        every_expert = len(cfg.moe_layers) * cfg.layer_expert_bytes(model.dtype)
        pooled = (mode in ("expert", "on-demand") and cpu and connect is None
                  and 0 < host_cache_bytes(st) < every_expert)
        if pooled:
            # One cache instead of two overlapping ones (budget.pooled_host_cache): the
            # store is opened again with the experts' share of the device budget, less one
            # layer's routed experts, added to its host cache. The dense weights are the
            # model's own tensors, read already. (On demand borrows from the host cache
            # and keeps nothing across layers: its share beyond a layer held nothing.)
            one = sum(st.info(n).nbytes for n in expert_names(cfg.moe_layers[0], 0))
            arena, experts_budget = pooled_host_cache(
                plan, host_cache_bytes(st), one, min(cfg.n_experts, cfg.top_k * len(ids)))
            st.close()
            st = open_store(arena)
        decode_threads = threads
        if threads is None:
            threads, decode_threads = compute_threads(
                mode, torch.device(dev), before, host_cache_bytes(st), every_expert,
                pooled=pooled)
        torch.set_num_threads(threads)
        # What the queue holds (transfers cancelled in flight included) is the experts'.
        st.prefetch_budget(torch.device(dev), experts_budget)
        source = make_source(mode, st, model, ring_slots=slots, budget=experts_budget,
                             host_pool=pooled and mode == "expert")
        recorder = None
        if trace is not None:
            recorder = TraceRecorder(trace, comment=f"tierstore generate --mode {mode}: "
                                     "step 0 is the prefill, then one step per token")
        try:
            res = generate(model, source, ids, max_new_tokens, greedy=greedy,
                           temperature=temperature, top_p=top_p, seed=seed, trace=recorder,
                           decode_threads=decode_threads, warm=warm)
        except BudgetError as e:  # the source's share was too small: name the whole
            plan.check(e.what, e.need)
            raise
        finally:
            if recorder is not None:
                recorder.close()
            source.close()
    finally:
        st.close()
        torch.set_num_threads(before)
    if as_json:
        echo(json.dumps(res.summary()))
        return
    for i, toks in enumerate(res.tokens):
        shown = decode_tokens(tok, toks) if tok is not None or family == "tierstore" else toks
        echo(f"[{i}] {shown}")
    s = res.summary()
    rate = f"{s['tokens_per_s']:.1f} tokens/s"
    parts = [f"{res.new_tokens} tokens in {res.seconds:.2f} s ({rate})", f"mode {mode}",
             f"stall {s['stall_frac']:.1%}"]
    if res.source.get("own_slots"):
        parts.append(f"ring slots {res.source['part_slots']} parts of "
                     f"{res.source['experts_per_part']} experts")
    elif res.source.get("slots") is not None:
        parts.append(f"ring slots {res.source['slots']}")
    if s["hit_rate"] is not None:
        parts.append(f"hit rate {s['hit_rate']:.1%}")
    if s["spec_accuracy"] is not None:
        parts.append(f"prediction accuracy {s['spec_accuracy']:.1%}")
    echo(", ".join(parts))
