"""``tierstore generate``: text from a stored model, through ``transformers``' ``generate``.

The model is the checkpoint's own ``transformers`` class with its experts in the store
(:func:`tierstore.hf.load`); attention, caches, sampling and stopping are ``transformers``'.
What this module adds is what a run over a store needs around that call: the device budget
split between the KV cache, a pass's activations and the experts (:mod:`.budget`), the
mode's source (``auto`` picks one and says which), a warm-up pass before the clock, the
compute threads, and what the run measured (tokens/s, prefill and decode apart, the stall,
bytes read, peak RSS), with a routing trace on request.

Greedy decoding and sampling are ``transformers``' (``do_sample``, ``temperature``,
``top_p``; ``top_k`` off); a ``seed`` seeds torch's generator before the call, so a seed
repeats its tokens and equals ``transformers`` sampling the resident model with the same
seed.
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

from ..model import ExpertSource, ExpertWeights
from .budget import (
    BudgetError,
    GenerationBudget,
    PassShape,
    check_budget_fits,
    generation_budget,
    peak_rss_bytes,
    pooled_host_cache,
)
from .device_queue import DeviceClock, host_cache_bytes, queue_budget

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
    # ExpertSource.prepare) and the warm-up pass, reported apart so that neither timed
    # phase hides them.
    prepare_s: float = 0.0
    mode: str = ""

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
                "peak_rss_bytes": self.peak_rss_bytes, "mode": self.mode,
                "dequantized_cache": self.source.get("dequantized_cache")}


class Instrumented(ExpertSource):
    """Wraps a source for one generation: times its ``experts`` calls (the stall, for
    sources that do not measure their own), records the routing trace (step 0 the prefill,
    step n the n-th decode step), tells the source before the last pass, and notes when the
    first pass (the prefill) ends."""

    def __init__(self, inner: Any, passes: int, recorder: Any = None, nbytes: int = 0,
                 clock: DeviceClock | None = None, decode_threads: int | None = None) -> None:
        self.inner, self.recorder, self.nbytes = inner, recorder, nbytes
        self.passes = passes
        self.step = 0
        self.waited = 0.0
        self.clock = clock
        self.prefill_end: Any = None
        self.decode_threads = decode_threads

    def begin_pass(self, model: Any, n_tokens: int) -> None:
        if self.step == self.passes - 1:
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

    def routed_held(self, layer: int, ids: list[int]) -> None:
        """Routed experts the model held dequantized and did not ask for
        (:mod:`tierstore.hf.hot_experts`): in the trace as well."""
        if self.recorder is not None:
            self.recorder.record(self.step, layer, ids, self.nbytes)

    def layer_done(self, layer: int) -> None:
        self.inner.layer_done(layer)

    def end_pass(self) -> None:
        self.inner.end_pass()
        if self.step == 0 and self.clock is not None:
            self.prefill_end = self.clock.mark()
            if self.decode_threads is not None:
                torch.set_num_threads(self.decode_threads)
        self.step += 1

    def stats(self) -> dict[str, Any]:
        return self.inner.stats()


class NonFiniteLogitsError(tierstore.StoreError):
    """The model computed NaN or infinite logits: no token can be chosen from them."""


# Below this a temperature divides the logits into overflow (infinities, then NaN
# probabilities in fp32): what sampling at it is, is greedy.
GREEDY_BELOW_TEMPERATURE = 1e-20


def check_logits(logits: Tensor, step: int) -> None:
    """Refuse logits ``[B, V]`` holding NaN or +inf, or a row of nothing but -inf, naming
    the first such row: they come from weights holding NaN or infinite values (or a
    computation they overflow), and a token chosen from them would be noise, or a sampler's
    failure, never an answer. (-inf alone is a mask: a processor's suppressed tokens.)"""
    bad = (logits.isnan() | (logits == math.inf)).any(dim=-1) | (logits == -math.inf).all(dim=-1)
    if not bool(bad.any()):
        return
    row = int(bad.nonzero()[0, 0])
    what = "NaN" if bool(logits[row].isnan().any()) else "infinite"
    at = "the prompt" if step == 0 else f"generated token {step}"
    raise NonFiniteLogitsError(
        f"the model computed {what} logits for prompt {row} after {at}: its weights hold "
        "NaN or infinite values (a diverged training run, or a damaged import); generate "
        "from a sound checkpoint")


def _finite_logits() -> Any:
    """A ``transformers`` logits processor that checks each step's logits as they come out
    of the model (:func:`check_logits`), before anything chooses from them."""
    import transformers

    class FiniteLogits(transformers.LogitsProcessor):
        def __init__(self) -> None:
            self.step = 0

        def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
            check_logits(scores, self.step)
            self.step += 1
            return scores

    return FiniteLogits()


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


def _ids(v: Any) -> tuple[int, ...]:
    if v is None:
        return ()
    return tuple(int(x) for x in (v if isinstance(v, list | tuple) else [v]))


def stop_and_pad(model: Any) -> tuple[tuple[int, ...], int]:
    """The model's end-of-sequence ids (its generation config's, else its config's) and the
    pad id ``transformers`` fills finished sequences with (pad, else the first end id, else
    0)."""
    gen = getattr(model, "generation_config", None)
    cfg = model.config.get_text_config()
    eos = _ids(getattr(gen, "eos_token_id", None)) or _ids(getattr(cfg, "eos_token_id", None))
    pad = getattr(gen, "pad_token_id", None)
    if pad is None:
        pad = getattr(cfg, "pad_token_id", None)
    if isinstance(pad, list):
        pad = pad[0] if pad else None
    return eos, int(pad) if pad is not None else (eos[0] if eos else 0)


def generate(model: Any, prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
             greedy: bool = True, temperature: float = 1.0, top_p: float = 1.0,
             seed: int | None = None, trace: Any = None, trace_nbytes: int | None = None,
             decode_threads: int | None = None, warm: bool = True) -> GenerationResult:
    """Generate up to ``max_new_tokens`` tokens after each prompt (lists of token ids) with a
    model :func:`tierstore.hf.load` returned, through its own ``generate``.

    ``trace``: a ``tierstore.lab.TraceRecorder`` that receives every MoE layer's routed
    experts per step, each access ``trace_nbytes`` long (default: one expert's bytes).
    ``decode_threads``: torch's thread count from the first decode step on (default: as it
    is). ``warm``: run the prompts through the model once before the clock starts, with
    zero experts (:mod:`tierstore.hf.warmup`), counted in ``prepare_s``."""
    from tierstore.hf.warmup import warm_up

    if max_new_tokens < 0:
        raise tierstore.StoreError("max_new_tokens must be >= 0")
    loaded = model.tierstore
    served = loaded.served
    vocab = int(model.config.get_text_config().vocab_size)
    for p in prompts:
        bad = [t for t in p if not 0 <= int(t) < vocab]
        if bad:
            raise tierstore.StoreError(f"token ids {bad[:5]} outside the vocabulary "
                                       f"(0..{vocab - 1})")
    if not greedy:
        if not 0 < temperature < math.inf:
            raise tierstore.StoreError(f"temperature must be a finite number above 0, got "
                                       f"{temperature}")
        if not 0 < top_p <= 1:
            raise tierstore.StoreError(f"top_p must be in (0, 1], got {top_p}")
        greedy = temperature < GREEDY_BELOW_TEMPERATURE
    eos, pad = stop_and_pad(model)
    dev = served.device
    ids, mask = pad_left(prompts, pad, dev)
    clock = DeviceClock(torch.device(dev))
    wrapped = Instrumented(loaded.source, max_new_tokens, trace,
                           trace_nbytes if trace_nbytes is not None else served.expert_bytes(),
                           clock, decode_threads)
    t_prepare = time.perf_counter()
    if warm and max_new_tokens:
        warm_up(model, served, loaded.narrow, ids, mask)
    prepare_s = time.perf_counter() - t_prepare
    from transformers import LogitsProcessorList

    # The check comes first among the processors, as the model's logits come out.
    kw: dict[str, Any] = {"max_new_tokens": max_new_tokens, "do_sample": not greedy,
                          "pad_token_id": pad, "attention_mask": mask,
                          "logits_processor": LogitsProcessorList([_finite_logits()])}
    if eos:
        kw["eos_token_id"] = list(eos)
    if not greedy:
        kw.update(temperature=float(temperature), top_p=float(top_p), top_k=0)
    else:  # a generation config that samples would warn about its unused settings
        kw.update(temperature=None, top_p=None, top_k=None)
    if seed is not None:
        torch.manual_seed(int(seed))
    inner = loaded.source
    loaded.swap_source(wrapped)
    start = time.perf_counter()
    first = clock.mark()
    try:
        with responsive_interpreter():
            out = model.generate(ids, **kw) if max_new_tokens else ids
    finally:
        loaded.swap_source(inner)
    seconds = time.perf_counter() - start
    prefill_s = clock.seconds(first, wrapped.prefill_end) if wrapped.prefill_end else 0.0
    new = out[:, ids.shape[1]:].tolist()
    tokens = _trim(new, set(eos))
    stats = dict(inner.stats())
    if getattr(loaded, "hot", None) is not None:
        stats["dequantized_cache"] = loaded.hot.stats()
    stall = float(stats.get("stall_s", wrapped.waited))
    return GenerationResult(tokens=tokens, seconds=seconds, prefill_s=prefill_s,
                            decode_s=seconds - prefill_s,
                            new_tokens=sum(len(s) for s in tokens), stall_s=stall,
                            source=stats, peak_rss_bytes=peak_rss_bytes(),
                            prepare_s=prepare_s, mode=loaded.mode)


def _trim(rows: list[list[int]], eos: set[int]) -> list[list[int]]:
    """Each row up to and including its first end-of-sequence token."""
    trimmed = []
    for row in rows:
        end = next((i for i, tok in enumerate(row) if tok in eos), len(row) - 1)
        trimmed.append(row[:end + 1])
    return trimmed


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


def least(mode: str, served: Any, resident_bounded: bool) -> tuple[str, int]:
    """What ``mode`` must hold at the least, and its bytes: the ring streams a layer one
    expert at a time at the least, expert mode needs the experts one token routes to, on
    demand one expert at a time; resident mode holds every expert (under a budget only
    where one was given)."""
    one = served.expert_bytes()
    if mode == "expert":
        return f"the {served.top_k} experts one token routes to", served.top_k * one
    if mode == "resident":
        every = len(served.moe_layers) * served.n_experts * one
        return "every expert (resident mode)", every if resident_bounded else 0
    return f"one expert ({mode} mode)", one


def hot_share(mode: str, served: Any, plan: GenerationBudget, setting: str | int,
              device: torch.device, *, pooled: bool, working: int, bounded: bool,
              host_cache: int, one_token: int = 0) -> int:
    """The bytes of quantized experts kept dequantized (:mod:`tierstore.hf.hot_experts`):
    ``setting``'s share (:func:`~tierstore.hf.hot_experts.split_budget`) of what the
    experts' share of the device budget leaves beyond the mode's least (pooled: one
    layer's routed experts, ``working`` bytes, the host cache of ``host_cache`` bytes
    holding the packed ones; resident: every expert). 0 for a model whose experts are not
    quantized, and for the ring unless a share is given (its slots take the whole
    budget). ``one_token``: :func:`one_token_dequantized`, below which ``auto`` keeps
    none."""
    from tierstore.hf.hot_experts import split_budget

    if served.fetch_dtype is not None or (mode == "ring" and setting == "auto"):
        return 0
    every = len(served.moe_layers) * served.n_experts * served.expert_bytes()
    if pooled:
        need = min(plan.experts, working)
    elif mode == "resident":
        need = every
    else:
        need = least(mode, served, bounded)[1]
    auto = setting == "auto"
    return split_budget(plan.experts - need, None if auto else setting, device.type,
                        packed_held=every if mode == "resident" else host_cache,
                        every_packed=every, one_token=one_token)


def one_token_dequantized(store: Any, served: Any) -> int:
    """The bytes of the experts one decoded token routes to in every MoE layer, in the
    compute dtype (from the entries' shapes; nothing is read)."""
    total = 0
    for key in served.moe_layers:
        layer = served.layers[key]
        metas = [torch.empty(i.shape, dtype=i.dtype, device="meta")
                 for i in (store.info(n) for n in layer.entry_names(0))]
        total += served.top_k * layer.dequantized_bytes(metas)
    return total


def _parse_prompt_ids(prompt_ids: Sequence[str]) -> list[list[int]]:
    try:
        return [[int(x) for x in p.replace(" ", "").split(",") if x] for p in prompt_ids]
    except ValueError:
        raise tierstore.StoreError("--prompt-ids takes comma-separated integers, e.g. "
                                   "1,2,3") from None


def run_generate(*, store: str | None, prompts: Sequence[str], prompt_ids: Sequence[str],
                 max_new_tokens: int, greedy: bool, temperature: float, top_p: float,
                 seed: int | None, device_budget: int | None, ring_slots: str, mode: str,
                 device: str, host_cache: int | None, trace: str | None, as_json: bool,
                 threads: int | None = None, echo: Any = print,
                 connect: str | None = None, warm: bool = True,
                 dequantized_cache: str | int = "auto") -> None:
    """What ``tierstore generate`` runs (see its --help)."""
    import json

    from tierstore.hf.loader import build, open_store
    from tierstore.hf.strategies import every_expert_bytes, make_source, resolve_mode
    from tierstore.hf.tokenizer import encode_prompts, load_tokenizer
    from tierstore.hf.warmup import cache_bytes

    from tierstore.lab import TraceRecorder

    if bool(prompts) == bool(prompt_ids):
        raise tierstore.StoreError("give prompts with --prompt or with --prompt-ids (not both)")
    slots: int | str = ring_slots
    if ring_slots != "auto":
        try:
            slots = int(ring_slots)
        except ValueError:
            raise tierstore.StoreError(f"--ring-slots must be auto or a positive integer, "
                                       f"got {ring_slots!r}") from None
    dev = torch.device(device if device != "auto" else
                       ("cuda" if torch.cuda.is_available() else "cpu"))
    cpu = dev.type == "cpu"
    check_budget_fits(device_budget, dev)
    before = torch.get_num_threads()
    where = connect if connect is not None else store
    assert where is not None
    st, _ = open_store(where, host_cache=host_cache if connect is None else None,
                       device_budget=device_budget)
    model = None
    try:
        model, loaded = build(st, True, device=dev, dtype=None)
        served = loaded.served
        tok = None
        if prompt_ids:
            ids = _parse_prompt_ids(prompt_ids)
            if not as_json:
                tok = load_tokenizer(st)
        else:
            ids, tok = encode_prompts(st, loaded.stored, prompts)
        per_token, fixed = cache_bytes(model, served, loaded.narrow)
        budget = device_budget if device_budget is not None else queue_budget(st, dev)
        shape = PassShape.of(model.config, served.top_k)
        plan = generation_budget(shape, per_token, fixed, budget, len(ids),
                                 max((len(p) for p in ids), default=0), max_new_tokens,
                                 served.dtype)
        chosen, why = resolve_mode(mode, st, served, max(plan.experts, 0))
        plan.check(*least(chosen, served, device_budget is not None))
        experts_budget = plan.experts
        every = every_expert_bytes(served)
        pooled = (chosen in ("expert", "on-demand") and cpu and connect is None
                  and 0 < host_cache_bytes(st) < every)
        one = sum(st.info(n).nbytes for n in served.expert_names(served.moe_layers[0], 0))
        per_layer = min(served.n_experts, served.top_k * len(ids))
        hot = hot_share(chosen, served, plan, dequantized_cache, dev, pooled=pooled,
                        working=per_layer * one, bounded=device_budget is not None,
                        host_cache=host_cache_bytes(st) if connect is None else 0,
                        one_token=one_token_dequantized(st, served)
                        if served.fetch_dtype is None else 0)
        experts_budget -= hot
        if pooled:
            # One cache instead of two overlapping ones (budget.pooled_host_cache): the
            # store is opened again with the experts' share of the device budget, less one
            # layer's routed experts and the dequantized experts' share, added to its host
            # cache. The dense weights are the model's own tensors, read already.
            arena, experts_budget = pooled_host_cache(plan, host_cache_bytes(st), one, per_layer)
            arena -= hot
            st.close()
            st, _ = open_store(where, host_cache=arena, device_budget=device_budget)
            loaded.store = st
        decode_threads = threads
        if threads is None:
            threads, decode_threads = compute_threads(chosen, dev, before, host_cache_bytes(st),
                                                      every, pooled=pooled)
        torch.set_num_threads(threads)
        # What the queue holds (transfers cancelled in flight included) is the experts'.
        st.prefetch_budget(dev, experts_budget)
        loaded.attach(make_source(chosen, st, served, budget=experts_budget, ring_slots=slots,
                                  host_pool=pooled and chosen == "expert"), chosen)
        loaded.keep_dequantized(hot)
        recorder = None
        if trace is not None:
            recorder = TraceRecorder(trace, comment=f"tierstore generate --mode {chosen}: "
                                     "step 0 is the prefill, then one step per token")
        try:
            res = generate(model, ids, max_new_tokens, greedy=greedy, temperature=temperature,
                           top_p=top_p, seed=seed, trace=recorder,
                           decode_threads=decode_threads, warm=warm)
        except BudgetError as e:  # the source's share was too small: name the whole
            plan.check(e.what, e.need)
            raise
        finally:
            if recorder is not None:
                recorder.close()
    finally:
        if model is not None:
            model.tierstore.close()
        else:
            st.close()
        torch.set_num_threads(before)
    if as_json:
        echo(json.dumps(res.summary()))
        return
    if why:
        echo(f"mode auto: {chosen}, as {why}")
    byte_level = loaded.stored.step is not None
    for i, toks in enumerate(res.tokens):
        shown = decode_tokens(tok, toks) if tok is not None or byte_level else toks
        echo(f"[{i}] {shown}")
    s = res.summary()
    rate = f"{s['tokens_per_s']:.1f} tokens/s"
    parts = [f"{res.new_tokens} tokens in {res.seconds:.2f} s ({rate})", f"mode {chosen}",
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
