"""The expert sources under ``transformers``' models: tiny random models imported into a
store whose host cache is far smaller than the experts, run with the ring (K below the
number of MoE layers, the budget holding exactly K layers) and in expert mode; logits match
``transformers``' forward to 1e-4 and greedy generation, stopping rows at an end-of-sequence
token, yields exactly the tokens of its ``generate``. Then what each source holds, reads,
pins and gives back, the ring-size chooser and the budgets. (Every family in every mode:
``test_hf_backend.py``.)"""

# Over 600 lines: every inference mode against transformers over one set of tiny models.

from __future__ import annotations

import shutil
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from concurrent.futures import wait as futures_wait
from pathlib import Path
from typing import Any

import pytest
import torch
from tierstore.hf.strategies import make_source
from tierstore.trainer.infer.expert_mode import ExpertModeSource
from tierstore.trainer.infer.generate import pad_left, responsive_interpreter
from tierstore.trainer.infer.ring import RingSource, choose_slots, max_slots

import tierstore

transformers = pytest.importorskip("transformers")
from hf_models import generate_with, imported_path, load_bound, logits  # noqa: E402
from test_store_corruption import flip_byte  # noqa: E402

ATOL = 1e-4
HOST_CACHE = "16KiB"  # far smaller than one expert layer: reads go to the backing tier
# Qwen3-MoE's tiny config has MoE layers every second layer: 4 layers give 2 of them.
OVERRIDES: dict[str, dict[str, Any]] = {"qwen3_moe": {"num_hidden_layers": 4}}


@pytest.fixture(scope="module", params=["mixtral", "qwen3_moe"])
def family_model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
                 ) -> Iterator[tuple[str, Any, Path]]:
    family = request.param
    root = tmp_path_factory.mktemp(family)
    hf, store = imported_path(family, root, **OVERRIDES.get(family, {}))
    yield family, hf, store
    shutil.rmtree(root, ignore_errors=True)  # slab files are preallocated


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    root = tmp_path_factory.mktemp("mixtral-alone")
    yield imported_path("mixtral", root)[1]
    shutil.rmtree(root, ignore_errors=True)  # slab files are preallocated


def layer_bytes(store: tierstore.Store, model: Any, layer: int) -> int:
    served = model.tierstore.served
    return sum(store.info(n).nbytes for e in range(served.n_experts)
               for n in served.expert_names(layer, e))


def names(model: Any, layer: int, e: int) -> tuple[str, ...]:
    return model.tierstore.served.expert_names(layer, e)


def served(model: Any) -> Any:
    return model.tierstore.served


def vocab(model: Any) -> int:
    return int(model.config.vocab_size)


def open_offloaded(path: Path, budget: int | None = None) -> tierstore.Store:
    return tierstore.open(path, host_cache=HOST_CACHE, device_budget=budget)


def in_use_settles_to_zero(store: tierstore.Store) -> bool:
    """Whether the CPU queue's credits all come back: a cancelled transfer that was in
    flight returns its credits once its bytes have landed, so allow it a moment."""
    deadline = time.monotonic() + 10
    while store.stats()["prefetch"]["cpu"]["in_use_bytes"]:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def ring_k(n_moe: int) -> int:
    return max(1, n_moe - 1)


def batch(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (11, 6)]
    return pad_left(prompts, 0)


def sources(store: tierstore.Store, model: Any) -> dict[str, Any]:
    cfg = served(model)
    k = ring_k(len(cfg.moe_layers))
    one = layer_bytes(store, model, cfg.moe_layers[0])
    expert = one // cfg.n_experts
    # Expert mode: room for one layer's experts plus two more, so the cache is tiny and
    # evicts, and predictions compete with it for the budget.
    dev = model.device
    return {"ring": RingSource(store, dev, slots=k, budget=k * one),
            "expert": ExpertModeSource(store, dev, budget=one + 2 * expert)}


def test_offloaded_logits_match_transformers(family_model: tuple[str, Any, Path]) -> None:
    family, hf, path = family_model
    with open_offloaded(path) as store:
        model = load_bound(store, "cpu", torch.float32)
        assert ring_k(len(served(model).moe_layers)) < len(served(model).moe_layers)
        ids, mask = batch(vocab(model))
        with torch.no_grad():
            ref = hf(input_ids=ids, attention_mask=mask).logits
        real = mask.bool()
        for name, src in sources(store, model).items():
            for _ in range(2):  # a second pass runs on what the first left in the ring/cache
                ours = logits(model, src, ids, mask)
                err = (ours[real] - ref[real]).abs().max().item()
                assert err < ATOL, f"{family} {name}: max |diff| {err}"
            stats = src.stats()
            assert stats["bytes_moved"] > 0
            src.close()
        assert in_use_settles_to_zero(store)


def test_greedy_generation_matches_transformers(family_model: tuple[str, Any, Path]) -> None:
    family, hf, path = family_model
    with open_offloaded(path) as store:
        model = load_bound(store, "cpu", torch.float32)
        ids, mask = batch(vocab(model))
        prompts = [row[m.bool()].tolist() for row, m in zip(ids, mask)]
        n_new = 8

        def hf_generate(eos: list[int]) -> list[list[int]]:
            out = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n_new,
                              do_sample=False, eos_token_id=eos or None, pad_token_id=0)
            return out[:, ids.shape[1]:].tolist()

        free = hf_generate([])
        # An end-of-sequence id that the first prompt produces at its third token: that row
        # must stop there (EOS included) while the other one runs on.
        eos = free[0][2]
        if eos in free[0][:2]:
            eos = next(t for t in free[0] if free[0].count(t) == 1)
        expected = hf_generate([eos])
        want = []
        for row in expected:
            stop = row.index(eos) if eos in row else len(row) - 1
            want.append(row[:stop + 1])
        assert len(want[0]) < n_new
        for name, src in sources(store, model).items():
            res = generate_with(model, src, prompts, n_new, eos=[eos])
            src.close()
            assert res.tokens == want, f"{family} {name}"
            # Without the stop token every row runs to max_new_tokens.
        src = sources(store, model)["ring"]
        res = generate_with(model, src, prompts, n_new, eos=[])
        src.close()
        assert res.tokens == free


def test_sampling_repeats_with_a_seed(mixtral: Path) -> None:
    with open_offloaded(mixtral) as store:
        model = load_bound(store, "cpu", torch.float32)
        prompts = [[5, 6, 7, 8], [9, 10]]

        def sample(seed: int, mode: str) -> list[list[int]]:
            src = make_source(mode, store, served(model), ring_slots=1)
            try:
                return generate_with(model, src, prompts, 10, greedy=False, temperature=1.5,
                                top_p=0.95, seed=seed, eos=[]).tokens
            finally:
                src.close()

        a = sample(7, "ring")
        assert sample(7, "ring") == a
        assert sample(7, "expert") == a  # the source never changes the numbers
        assert sample(8, "ring") != a
        assert all(len(row) == 10 for row in a)


def test_generation_switches_threads_quickly_and_puts_the_interval_back(mixtral: Path) -> None:
    """While a source streams, the interpreter switches threads every 0.5 ms at most (the
    compute thread gets it back from the read threads); afterwards, and after nested or
    overlapping blocks, the caller's interval is back."""
    import sys
    import threading

    before = sys.getswitchinterval()
    seen: list[float] = []
    with open_offloaded(mixtral) as store:
        model = load_bound(store, "cpu", torch.float32)
        src = make_source("ring", store, served(model), ring_slots=1)
        inner = src.experts

        def experts(*args: Any) -> Any:
            seen.append(sys.getswitchinterval())
            return inner(*args)

        src.experts = experts  # type: ignore[method-assign]
        try:
            generate_with(model, src, [[5, 6, 7]], 2, eos=[])
        finally:
            src.close()
    assert seen and max(seen) <= 5e-4 < before
    assert sys.getswitchinterval() == before
    entered, release = threading.Event(), threading.Event()

    def other() -> None:
        with responsive_interpreter():
            entered.set()
            release.wait(10)

    t = threading.Thread(target=other)
    t.start()
    assert entered.wait(30)
    with responsive_interpreter(1e-3), responsive_interpreter():
        assert sys.getswitchinterval() <= 5e-4
    assert sys.getswitchinterval() <= 5e-4  # the other block is still running
    release.set()
    t.join()
    assert sys.getswitchinterval() == before


def test_ring_holds_k_layers_within_the_budget(mixtral: Path) -> None:
    path = mixtral
    with tierstore.open(path, host_cache=HOST_CACHE) as probe:
        model = load_bound(probe, "cpu")
        cfg = served(model)
        one = layer_bytes(probe, model, cfg.moe_layers[0])
    with open_offloaded(path, budget=2 * one) as store:
        model = load_bound(store, "cpu")
        src = RingSource(store, "cpu", slots="auto")
        ids, mask = batch(vocab(model))
        generate_with(model, src, [ids[0].tolist()], 4, eos=())  # 4 passes
        st = src.stats()
        src.close()
        queue = store.stats()["prefetch"]["cpu"]
        # The first pass takes every slot the budget holds; later ones the smallest K
        # that hides the measured transfer, never more than the budget holds.
        assert st["slot_history"][0] == 2 and set(st["slot_history"]) <= {1, 2}
        assert st["t_transfer_s"] > 0  # timed during the first pass, not before it
        # On the CPU the ring borrows whole layers: it never holds more than K of them.
        assert 0 < st["peak_bytes"] <= 2 * one and queue["peak_in_use_bytes"] <= 2 * one
        assert in_use_settles_to_zero(store)
        # Layers are refilled pass after pass (K < MoE layers), not loaded once: at least
        # three passes' worth moved (transfers cancelled in flight are not counted).
        assert st["bytes_moved"] >= 3 * len(cfg.moe_layers) * one
        # A budget below a layer streams it in parts through slots of the ring's own; one
        # below an expert is a clear error naming the option and the bytes it needs.
        expert = one // cfg.n_experts
        with pytest.raises(tierstore.StoreError, match="--device-budget .* raise it to at least"):
            RingSource(store, "cpu", budget=expert - 1).begin_pass(served(model), 1)


def test_ring_reads_nothing_past_the_last_pass(mixtral: Path) -> None:
    with open_offloaded(mixtral) as store:
        model = load_bound(store, "cpu")
        n = len(served(model).moe_layers)
        one = layer_bytes(store, model, served(model).moe_layers[0])
        k = ring_k(n)
        ids, _ = batch(vocab(model))
        for new, passes in ((1, 1), (3, 3)):
            src = RingSource(store, "cpu", slots=k, budget=k * one)
            generate_with(model, src, [ids[0].tolist()], new, eos=())
            st = src.stats()
            src.close()
            # every layer moved once per pass, and no layer of a pass that never runs
            assert st["bytes_moved"] == passes * n * one, (new, st["bytes_moved"])
            assert 0 < st["bytes_read"] <= st["bytes_moved"]


def test_cpu_ring_computes_on_pinned_cache_slots_and_gives_them_back(mixtral: Path) -> None:
    """On the CPU the ring's slots are views of pinned host-cache slots (no copies): while a
    layer computes its experts share the cache's memory and cannot be evicted; once the
    layer is done (K < layers) or the ring is closed, nothing stays pinned."""
    with tierstore.open(mixtral, host_cache="64MiB") as store:
        model = load_bound(store, "cpu")
        cfg = served(model)
        one = layer_bytes(store, model, cfg.moe_layers[0])
        arena = store._cache.arena  # type: ignore[union-attr]
        lo, hi = arena.data_ptr(), arena.data_ptr() + arena.numel()
        src = RingSource(store, "cpu", slots=1, budget=one)
        seen: list[bool] = []
        inner = src.experts

        def spy(layer: int, ids: Any, x: torch.Tensor) -> Any:
            out = inner(layer, ids, x)
            w = next(iter(out.values()))[0]
            seen.append(lo <= w.data_ptr() < hi)
            cache = store._cache  # type: ignore[union-attr]
            key = (names(model, layer, next(iter(out)))[0], "param")
            seen.append(cache._entries[key].pins > 0)
            return out

        src.experts = spy  # type: ignore[method-assign]
        ids, _ = batch(vocab(model))
        generate_with(model, src, [ids[0].tolist()], 3, eos=())
        assert seen and all(seen)
        src.close()
        assert src.stats()["peak_bytes"] == one
        # A part of experts no token was routed to may still be landing: it is given back
        # by the thread reading it, so look once those threads have ended.
        assert _ring_threads_end()
        pins = [e.pins for e in store._cache._entries.values()]  # type: ignore[union-attr]
        assert pins and not any(pins)
        # Its borrowing threads end with it; a closed ring that is used again starts anew.
        generate_with(model, src, [ids[0].tolist()], 2, eos=())
        src.close()
        assert _ring_threads_end()


def _settled_releases(src: RingSource) -> None:
    """Have the ring release a layer only once every part of its borrow has landed. Whether
    a part whose experts the routing did not pick has landed by the time its layer is done
    is up to the scheduler, and a loan released with a part in flight is not renewed but
    borrowed again: waiting here takes that race out of a test about renewals."""
    inner = src.layer_done

    def layer_done(layer: int) -> None:
        loan = src._lent.get(layer)
        if loan is not None:
            pending = [p for p in loan.parts if isinstance(p, Future)]
            assert not futures_wait(pending, timeout=30).not_done, "a part never landed"
        inner(layer)

    src.layer_done = layer_done  # type: ignore[method-assign]


def _borrowed_once_whole(borrows: list[list[str]], layer: int, whole: list[str]) -> None:
    """``borrows`` (one layer's, in call order) are one borrow of the whole layer, or parts
    that together cover it once, each a run of consecutive experts, and then the whole."""
    *parts, last = borrows
    assert last == whole, f"layer {layer}: {[len(b) for b in borrows]}"
    for part in parts:
        assert 0 < len(part) < len(whole), f"layer {layer}: {[len(b) for b in borrows]}"
        start = whole.index(part[0])
        assert part == whole[start:start + len(part)], f"layer {layer}: {part}"
    assert sorted(n for part in parts for n in part) == (sorted(whole) if parts else [])


def test_cpu_ring_renews_unchanged_layers_and_sees_rewritten_experts(mixtral: Path) -> None:
    """Decoding from host memory, a ring borrows each layer whole once and afterwards
    renews the released borrow every turn; an expert rewritten between generations is not
    renewed but borrowed anew, so the ring computes with the new weights.

    Whether a layer that the first pass reads from the backing tier is borrowed whole
    already in that pass (in line, after a borrow that was cheap) or in parts there and
    whole in the next depends on how long the borrows before it took, so the sequence of
    borrows is not fixed; what holds on every schedule is that each layer is borrowed whole
    exactly once, and in parts at most once before that."""
    with tierstore.open(mixtral, host_cache="64MiB") as store:
        model = load_bound(store, "cpu")
        cfg = served(model)
        one = layer_bytes(store, model, cfg.moe_layers[0])
        whole = {layer: [n for e in range(cfg.n_experts) for n in names(model, layer, e)]
                 for layer in cfg.moe_layers}
        owner = {n: layer for layer, names in whole.items() for n in names}
        borrows: list[list[str]] = []
        lock = threading.Lock()  # parts are borrowed on the ring's threads
        inner_borrow = store.borrow_many

        def counting(names: Any, *args: Any, **kw: Any) -> Any:
            with lock:
                borrows.append(list(names))
            return inner_borrow(names, *args, **kw)

        def by_layer() -> dict[int, list[list[str]]]:
            with lock:
                got: dict[int, list[list[str]]] = {}
                for b in borrows:
                    layers = {owner[n] for n in b}
                    assert len(layers) == 1, f"a borrow spans layers {layers}"
                    got.setdefault(layers.pop(), []).append(b)
                return got

        store.borrow_many = counting  # type: ignore[method-assign]
        src = RingSource(store, "cpu", slots=1, budget=one)
        _settled_releases(src)
        used: dict[tuple[int, int], torch.Tensor] = {}
        inner = src.experts

        def spy(layer: int, ids: Any, x: torch.Tensor) -> Any:
            out = inner(layer, ids, x)
            used.update({(layer, e): w[0].clone() for e, w in out.items()})
            return out

        src.experts = spy  # type: ignore[method-assign]
        ids, _ = batch(vocab(model))
        prompt = [ids[0].tolist()]
        # 4 passes, each over every layer with one slot: without renewals every layer would
        # be borrowed 4 times.
        generate_with(model, src, prompt, 4, eos=())
        first = by_layer()
        assert set(first) == set(cfg.moe_layers)
        for layer, got in first.items():
            _borrowed_once_whole(got, layer, whole[layer])
        # Nothing is cached before the first layer: the ring streams it from the backing
        # tier in parts.
        assert len(first[cfg.moe_layers[0]]) > 1
        layer, e = next(iter(used))
        w1 = names(model, layer, e)[0]
        store.put(w1, store.get(w1) * -2.0)
        with lock:
            borrows.clear()
        used.clear()
        second = generate_with(model, src, prompt, 4, eos=()).tokens
        src.close()
        # Only the rewritten expert's layer is borrowed again (the others are renewed),
        # once whole after at most one round of parts, so the ring computes with the new
        # weights.
        again = by_layer()
        assert set(again) == {layer}
        _borrowed_once_whole(again[layer], layer, whole[layer])
        assert torch.equal(used[(layer, e)], store.get(w1))
        resident = make_source("resident", store, served(model))
        assert second == generate_with(model, resident, prompt, 4, eos=()).tokens


def _gated_borrows(store: tierstore.Store, gated: str, gate: threading.Event,
                   waited: list[bool]) -> None:
    """Hold any borrow that includes ``gated`` until ``gate`` is set (at most 30 s; whether
    it had to give up is appended to ``waited``)."""
    inner = store.borrow_many

    def borrow(names: Any, *args: Any, **kw: Any) -> Any:
        names = list(names)
        if gated in names:
            waited.append(not gate.wait(30))
        return inner(names, *args, **kw)

    store.borrow_many = borrow  # type: ignore[method-assign]


def test_ring_streams_a_layer_read_from_the_backing_tier(mixtral: Path) -> None:
    """A layer read from the backing tier is lent in parts: its first experts can be used
    while a later part is still being read, and each expert is the stored one."""
    with tierstore.open(mixtral, host_cache="64MiB") as store:
        model = load_bound(store, "cpu")
        cfg = served(model)
        layer, last = cfg.moe_layers[0], cfg.n_experts - 1
        gate, waited = threading.Event(), []
        _gated_borrows(store, names(model, layer, last)[0], gate, waited)
        src = RingSource(store, "cpu", slots=1,
                         budget=layer_bytes(store, model, layer))
        src.begin_pass(served(model), 1)
        ids = list(range(cfg.n_experts))
        got = src.experts(layer, ids, torch.zeros(1, model.config.hidden_size))
        first = got[0]  # lands while the last part is held back
        assert not gate.is_set() and not waited
        assert torch.equal(first[0], store.get(names(model, layer, 0)[0]))
        gate.set()
        for e in ids:
            assert all(torch.equal(t, store.get(n)) for t, n in zip(got[e], names(model, layer, e)))
        assert waited == [False]
        src.layer_done(layer)
        src.close()
        pins = [e.pins for e in store._cache._entries.values()]  # type: ignore[union-attr]
        assert not any(pins)


def test_ring_raises_a_parts_read_error_where_its_expert_is_used(mixtral: Path) -> None:
    """A corrupt entry in a later part fails the lookup of its own expert with the store's
    error (not a routing KeyError); the parts that were read are still given back."""
    with tierstore.open(mixtral, host_cache="64MiB") as store:
        model = load_bound(store, "cpu")
        cfg = served(model)
        layer, last = cfg.moe_layers[0], cfg.n_experts - 1
        bad = names(model, layer, last)[-1]
        flip_byte(store.info(bad), 0)
        try:
            src = RingSource(store, "cpu", slots=1,
                             budget=layer_bytes(store, model, layer))
            src.begin_pass(served(model), 1)
            got = src.experts(layer, list(range(cfg.n_experts)),
                              torch.zeros(1, model.config.hidden_size))
            assert torch.equal(got[0][0], store.get(names(model, layer, 0)[0]))
            with pytest.raises(tierstore.CorruptEntryError, match=bad):
                got[last]
            src.end_pass()
            src.close()
        finally:
            flip_byte(store.info(bad), 0)  # the module's other tests share this model
        # The parts between the two looked up may still be landing when the ring closes:
        # their reading threads give them back.
        assert _ring_threads_end()
        pins = [e.pins for e in store._cache._entries.values()]  # type: ignore[union-attr]
        assert pins and not any(pins)


def _ring_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("tierstore-ring")]


def _ring_threads_end(timeout: float = 30) -> bool:
    """Whether every ring's borrowing threads (closed rings' only, by then) end in time;
    what they were still reading has been given back once they have."""
    deadline = time.monotonic() + timeout
    for t in _ring_threads():
        t.join(max(0.0, deadline - time.monotonic()))
    return not _ring_threads()


def test_expert_mode_guesses_while_guessing_pays(mixtral: Path) -> None:
    """Expert mode reads a guessed expert ahead only while such reads keep being used: with
    guesses that are always right it guesses on every layer; with guesses that are always
    wrong it stops after the first and only probes now and then. Either way the tokens are
    the resident model's. The guesses come from the routing a resident run recorded."""
    from tierstore.trainer.infer import expert_mode

    with open_offloaded(mixtral) as store:
        model = load_bound(store, "cpu")
        cfg = served(model)
        prompt = [batch(vocab(model))[0][0].tolist()]
        new = 16
        resident = make_source("resident", store, served(model))
        routed: list[tuple[int, list[int]]] = []
        inner_resident = resident.experts

        def record(layer: int, ids: Any, x: torch.Tensor) -> Any:
            routed.append((layer, list(ids)))
            return inner_resident(layer, ids, x)

        resident.experts = record  # type: ignore[method-assign]
        want = generate_with(model, resident, prompt, new, eos=()).tokens
        one = layer_bytes(store, model, cfg.moe_layers[0])
        expert = one // cfg.n_experts

        def run(oracle: bool) -> dict[str, Any]:
            src = ExpertModeSource(store, "cpu", budget=one + 2 * expert)
            call = [-1]
            inner = src.experts

            def counted(layer: int, ids: Any, x: torch.Tensor) -> Any:
                call[0] += 1
                return inner(layer, ids, x)

            def predict(layer: int, x: torch.Tensor) -> set[int]:
                nxt_layer, nxt = routed[call[0] + 1]
                assert nxt_layer == layer
                if oracle:
                    return set(nxt)
                return set([e for e in range(cfg.n_experts) if e not in nxt][:cfg.top_k])

            src.experts = counted  # type: ignore[method-assign]
            src.predict = predict  # type: ignore[method-assign]
            got = generate_with(model, src, prompt, new, eos=())
            src.close()
            assert got.tokens == want
            return src.stats()

        turns = (new + 1) * (len(cfg.moe_layers) - 1)  # passes x layers with a next layer
        right = run(oracle=True)
        assert right["spec_skipped"] == 0 and right["spec_accuracy"] == 1.0
        assert right["spec_requested"] > 0
        assert right["spec_useful"] == right["spec_requested"]
        assert right["spec_precision"] > expert_mode.SPEC_MIN_PRECISION
        wrong = run(oracle=False)
        assert wrong["spec_useful"] == 0 and wrong["spec_accuracy"] == 0.0
        probes = turns // expert_mode.SPEC_PROBE_EVERY
        # A guess the cache already holds reads nothing and moves no precision: until the
        # first read guess the source keeps guessing, after it only probes.
        assert wrong["spec_skipped"] >= turns // 2
        assert wrong["spec_requested"] <= cfg.top_k * (1 + probes)
        assert wrong["spec_precision"] < expert_mode.SPEC_MIN_PRECISION
        assert in_use_settles_to_zero(store)


def test_choose_slots() -> None:
    mib = 1 << 20
    # (K-1) * t_compute >= t_transfer: 10 ms transfer behind 4 ms layers needs K = 4.
    k = choose_slots(0.010, 0.004, 100 * mib, 10_000 * mib, 32)
    assert k == 4 and (k - 1) * 0.004 >= 0.010 and (k - 2) * 0.004 < 0.010
    # Exact ratios do not round up a slot: 2 * 5 ms covers 10 ms.
    assert choose_slots(0.010, 0.005, mib, 100 * mib, 32) == 3
    # Compute longer than the transfer: two slots suffice.
    assert choose_slots(0.002, 0.030, mib, 100 * mib, 32) == 2
    # The budget caps K (the rest shows up as stall) ...
    assert choose_slots(0.100, 0.001, 100 * mib, 350 * mib, 32) == 3
    # ... and so does the number of MoE layers (K = L keeps everything resident).
    assert choose_slots(0.100, 0.001, mib, 100 * mib, 6) == 6
    assert max_slots(mib, 100 * mib, 6) == 6
    for t_transfer, t_compute in [(0.05, 0.011), (0.2, 0.07), (1e-3, 1e-3), (0.3, 0.01)]:
        k = choose_slots(t_transfer, t_compute, mib, 1000 * mib, 64)
        assert (k - 1) * t_compute >= t_transfer
        assert k == 1 or (k - 2) * t_compute < t_transfer
    with pytest.raises(tierstore.StoreError, match="cannot hold one MoE layer"):
        choose_slots(0.1, 0.1, 2 * mib, mib, 8)


def test_zero_copy_sources_leave_the_cached_experts_untouched(mixtral: Path) -> None:
    # Every expert fits the host cache: on the CPU the ring and expert mode compute on views
    # of the pinned cache slots, converted (float64) or not (float32).
    with tierstore.open(mixtral, host_cache="64MiB") as store:
        model = load_bound(store, "cpu")
        cfg = served(model)
        every = [n for layer in cfg.moe_layers for e in range(cfg.n_experts)
                 for n in names(model, layer, e)]
        before = {n: store.get(n).clone() for n in every}
        for dtype in (torch.float32, torch.float64):
            model = load_bound(store, "cpu", dtype)
            ids, mask = batch(vocab(model))
            ref = logits(model, make_source("resident", store, served(model)), ids, mask)
            k = ring_k(len(cfg.moe_layers))
            one = layer_bytes(store, model, cfg.moe_layers[0])
            for name, src in {
                    "ring": RingSource(store, "cpu", slots=k, budget=k * one, dtype=dtype),
                    "expert": ExpertModeSource(store, "cpu", budget=one + 2 * one // 8,
                                               dtype=dtype)}.items():
                for _ in range(2):
                    ours = logits(model, src, ids, mask)
                    err = (ours - ref).abs().max().item()
                    assert err < ATOL, f"{name} {dtype}: max |diff| {err}"
                src.close()
        pf = store.stats()["prefetch"]["cpu"]
        assert pf["zero_copy"] and pf["bytes_moved"] > 0 and pf["bytes_copied"] == 0
        assert pf["bytes_read"] == 0  # all host-cache hits
        for n, t in before.items():
            assert torch.equal(store.get(n), t), n
        assert in_use_settles_to_zero(store)


def test_bench_infer_reports_every_mode_against_its_tier(tmp_path: Path) -> None:
    from tierstore.bench.infer import run_infer

    lines: list[str] = []
    for tier, engine in (("host", "auto"), ("nvme", "posix-direct")):
        res = run_infer(layers=2, experts=4, hidden=32, ffn=64, prefill_batch=2,
                        prefill_len=8, decode_tokens=3, ring_slots=(1,), repeats=3,
                        tier=tier, engine=engine, json_out=str(tmp_path / f"{tier}.json"),
                        echo=lines.append, device="cpu")
        assert res["tier"] == tier and (tmp_path / f"{tier}.json").exists()
        # the store ran on the engine named (auto names one)
        assert res["backend"].startswith("nvme: posix") == (engine == "posix-direct")
        for phase in ("prefill", "decode"):
            by = {r["mode"]: r for r in res[phase]["rows"]}
            assert set(by) == {"resident", "ring K=1", "ring auto", "expert", "on-demand"}
            for r in by.values():
                assert len(r["tokens_per_s_runs"]) == 3
                assert r["tokens_per_s"] == sorted(r["tokens_per_s_runs"])[1]  # the median
            ring = by["ring K=1"]
            assert "vs_ring_limit" in ring
            # each mode against the resident run of its own round, the median of those
            paired = sorted(a / b for a, b in zip(ring["tokens_per_s_runs"],
                                                  by["resident"]["tokens_per_s_runs"]))
            assert ring["vs_resident"] == pytest.approx(paired[1])
            # only a run that reads the backing tier, and is bound by those reads (moving
            # every layer's experts takes longer than computing), has a bandwidth limit
            bound = res[phase]["ring_move_limit_tokens_per_s"] < by["resident"]["tokens_per_s"]
            assert ("vs_bandwidth_limit" in ring) == (tier == "nvme" and bound)
            assert (ring["tier_bytes_per_pass"] > 0) == (tier == "nvme")
    with pytest.raises(tierstore.StoreError, match="unknown tier"):
        run_infer(tier="disk")


@pytest.mark.gpu
def test_ring_and_expert_mode_on_cuda(mixtral: Path) -> None:
    with open_offloaded(mixtral) as store:
        model = load_bound(store, "cuda", torch.float32)
        ids, mask = batch(vocab(model))
        ids, mask = ids.cuda(), mask.cuda()
        ref = logits(model, make_source("resident", store, served(model)), ids, mask)
        for name, src in sources(store, model).items():
            assert src.device.type == "cuda"
            for _ in range(2):
                ours = logits(model, src, ids, mask)
                err = (ours - ref).abs().max().item()
                assert err < ATOL, f"{name}: max |diff| {err}"
            src.close()
