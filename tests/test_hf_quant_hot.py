"""Quantized experts kept dequantized beside the packed host cache
(tierstore.hf.hot_experts): a held expert is neither read nor dequantized again, the
logits are the same bits, the bytes held stay within the cache's share, and what it holds
is its own (never a buffer the next dequantization overwrites)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from hf_models import prompt_ids
from hf_quant import deepseek_fp8, gpt_oss_mxfp4
from tierstore.hf import load
from tierstore.hf.hot_experts import PACKED_FLOOR, split_budget
from tierstore.hf.quant import Dequantizer

from tierstore.cli import main

pytest.importorskip("transformers")

MAKERS = {"gpt_oss": gpt_oss_mxfp4, "deepseek_v3": deepseek_fp8}


@pytest.fixture(scope="module", params=sorted(MAKERS))
def store(request: Any, tmp_path_factory: Any) -> Path:
    root = tmp_path_factory.mktemp(request.param)
    ckpt = MAKERS[request.param](root / "hf")
    r = CliRunner().invoke(main, ["import-hf", str(ckpt), "--store", str(root / "st")])
    assert r.exit_code == 0, r.output
    return root / "st"


class CountingDequantizer(Dequantizer):
    """The real dequantizer, counting the packed weights it dequantizes."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __call__(self, *args: Any, **kw: Any) -> torch.Tensor:
        self.calls += 1
        return super().__call__(*args, **kw)


def _counting(model: Any) -> CountingDequantizer:
    deq = CountingDequantizer()
    for layer in model.tierstore.served.layers.values():
        layer.dequantizer = deq
    return deq


def _expert_bytes(model: Any) -> int:
    """One expert dequantized, in the compute dtype."""
    layer = next(iter(model.tierstore.served.layers.values()))
    st = model.tierstore.store
    got = st.get_many(list(layer.entry_names(0)))
    return layer.dequantized_bytes([got[n] for n in layer.entry_names(0)])


def test_held_experts_are_neither_read_nor_dequantized_and_logits_are_the_same(
        store: Path) -> None:
    model = load(store, mode="on-demand", device="cpu", dtype=torch.float32, host_cache="32MiB")
    try:
        loaded = model.tierstore
        deq = _counting(model)
        ids = prompt_ids(1, 1, model.config.vocab_size)
        with torch.no_grad():
            want = model(ids).logits
        plain_calls = deq.calls
        assert plain_calls > 0
        loaded.keep_dequantized(1 << 30)  # room for every expert
        moved = []
        for _ in range(3):
            before = deq.calls, loaded.source.stats()["bytes_moved"]
            with torch.no_grad():
                got = model(ids).logits
            assert torch.equal(got, want)
            moved.append((deq.calls - before[0], loaded.source.stats()["bytes_moved"] - before[1]))
        hot = loaded.hot.stats()
        routed = hot["misses"]  # the first pass: every routed expert, admitted
        assert routed > 0 and hot["admitted"] == routed and hot["experts"] == routed
        # The first pass dequantizes and reads as without the cache; the same token again
        # is served from it: no dequantization, no read, one hit per routed expert.
        assert moved[0][0] == plain_calls and moved[0][1] > 0
        assert moved[1] == moved[2] == (0, 0)
        assert hot["hits"] == 2 * routed and hot["dequantized"] == routed
        assert hot["held_bytes"] == routed * _expert_bytes(model) <= hot["capacity_bytes"]
    finally:
        model.tierstore.close()


def test_a_small_cache_stays_within_its_bytes_and_holds_its_own_tensors(store: Path) -> None:
    """Three experts' room, tokens routed to many more: evictions, never more bytes than
    the share; the held experts equal a fresh dequantization after other experts were
    dequantized through the reused buffers since; the tokens are those without the cache."""
    model = load(store, mode="expert", device="cpu", dtype=torch.float32, host_cache="32MiB")
    try:
        loaded = model.tierstore
        ids = prompt_ids(1, 6, model.config.vocab_size)
        want = model.generate(ids, max_new_tokens=6, do_sample=False)
        one = _expert_bytes(model)
        loaded.keep_dequantized(3 * one)
        for _ in range(2):
            got = model.generate(ids, max_new_tokens=6, do_sample=False)
            assert got.tolist() == want.tolist()
        hot = loaded.hot
        s = hot.stats()
        assert s["evicted"] > 0 and s["hits"] > 0
        assert s["peak_bytes"] <= s["capacity_bytes"] == 3 * one
        layers = loaded.served.layers
        reused = {b.data_ptr() for b in next(iter(layers.values())).dequantizer._buffers.values()}
        for (key, e), weights in hot._held.items():
            layer = layers[key]
            stored = loaded.store.get_many(list(layer.entry_names(e)))
            fresh = layer.dequantize([stored[n] for n in layer.entry_names(e)], reuse=False)
            assert fresh.keys() == weights.keys()
            for role in fresh:
                for a, b in zip(weights[role], fresh[role]):
                    assert torch.equal(a, b), (key, e, role)
                    assert a.untyped_storage().data_ptr() not in reused
        # A source attached after this one is served nothing held for it.
        loaded.detach()
        assert s["experts"] > 0 and hot.stats()["experts"] == 0
    finally:
        model.tierstore.close()


def test_generate_splits_the_budget_and_gives_the_same_tokens(store: Path) -> None:
    """`tierstore generate` on a CPU: 1.0 keeps the experts' share of the device budget
    beyond one layer's routed experts dequantized, 0.5 half of it, 0 none, auto at most
    all of it; the tokens are the same."""
    runs = {}
    for setting in ("0", "auto", "1.0", "0.5"):
        r = CliRunner().invoke(main, [
            "generate", "--store", str(store), "--prompt-ids", "1,2,3,4", "--max-new-tokens", "4",
            "--greedy", "--device", "cpu", "--mode", "expert", "--host-cache", "1MiB",
            "--device-budget", "64MiB", "--dequantized-cache", setting, "--json"])
        assert r.exit_code == 0, r.output
        runs[setting] = json.loads(r.output.strip().splitlines()[-1])
    assert runs["0"]["dequantized_cache"] is None
    auto, whole, half = (runs[s]["dequantized_cache"] for s in ("auto", "1.0", "0.5"))
    assert 0 < whole["capacity_bytes"] < 64 << 20
    assert 0 < auto["capacity_bytes"] <= whole["capacity_bytes"]
    assert half["capacity_bytes"] == pytest.approx(whole["capacity_bytes"] / 2, abs=1)
    for s in (auto, whole, half):
        assert s["peak_bytes"] <= s["capacity_bytes"] and s["hits"] > 0
    assert all(r["tokens"] == runs["0"]["tokens"] for r in runs.values())


def test_the_split_rule() -> None:
    # auto: the packed experts held made up to PACKED_FLOOR of them all first
    assert PACKED_FLOOR == 0.5
    assert split_budget(1000, None, "cpu", packed_held=600, every_packed=1000) == 1000
    assert split_budget(1000, None, "cpu", packed_held=200, every_packed=1000) == 700
    assert split_budget(1000, None, "cpu", packed_held=0, every_packed=4000) == 0
    assert split_budget(1000, "1.0", "cpu", packed_held=0, every_packed=4000) == 1000
    # auto keeps nothing dequantized where one token's routed experts would not fit: each
    # token would evict what the next needs; a share asked for is kept
    assert split_budget(1000, None, "cpu", packed_held=600, every_packed=1000,
                        one_token=1001) == 0
    assert split_budget(1000, None, "cpu", packed_held=600, every_packed=1000,
                        one_token=1000) == 1000
    assert split_budget(1000, "1.0", "cpu", one_token=5000) == 1000
    assert split_budget(1000, "auto", "cuda") == 0
    assert split_budget(1000, "0.25", "cuda") == 250
    assert split_budget(1000, 4000, "cpu") == 1000
    assert split_budget(-5, None, "cpu") == 0


def test_a_fraction_above_one_is_refused_in_one_line(store: Path) -> None:
    r = CliRunner().invoke(main, ["generate", "--store", str(store), "--prompt-ids", "1",
                                  "--max-new-tokens", "1", "--dequantized-cache", "1.5"])
    assert r.exit_code == 2 and "at most 1.0" in r.output
