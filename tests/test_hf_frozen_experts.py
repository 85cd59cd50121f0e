"""Adapters trained over frozen experts: a model loaded for inference (any mode) computes
gradients for the dense weights the user trains, equal to the same ``transformers`` model in
memory, and the store is only read.

The inference sources lend their experts (host-cache slots, the ring's slots) and reuse them
after each layer; autograd keeps an expert's weight for the input's gradient, so the backend
computes with a copy whenever a backward will follow. Without it the gradients come from
slots that already hold other experts."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import tierstore.hf
import torch
from hf_models import imported_path, prompt_ids

import tierstore

STEPS = 2


def versions(store: tierstore.Store) -> dict[tuple[str, str], int]:
    keys = store.keys()
    return {k: store.info(*k).version for k in keys}


def adapters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The attention weights train (as adapters on them would); everything else is frozen."""
    chosen = []
    for name, p in model.named_parameters():
        p.requires_grad_("self_attn" in name)
        if p.requires_grad:
            chosen.append(p)
    assert chosen
    return chosen


def train(model: torch.nn.Module, ids: torch.Tensor) -> list[float]:
    model.train()
    opt = torch.optim.AdamW(adapters(model), lr=1e-2)
    losses = []
    for step in range(STEPS):
        batch = ids[step::STEPS]
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("family", ["mixtral", "deepseek_v3"])
def test_adapters_over_frozen_experts_train_as_in_memory(tmp_path: Path, family: str) -> None:
    hf, store = imported_path(family, tmp_path)
    ids = prompt_ids(2 * STEPS, 12, hf.config.vocab_size)
    ref = copy.deepcopy(hf)
    want = train(ref, ids)
    with tierstore.open(store) as st:
        before = versions(st)
    for mode in ("on-demand", "expert", "ring", "resident"):
        model = tierstore.hf.load(store, mode=mode, host_cache="64KiB", device_budget="2MiB")
        try:
            got = train(model, ids)
            tiers = model.tierstore.store.stats()["tiers"].values()
        finally:
            model.tierstore.close()
        assert got == pytest.approx(want, abs=1e-5), mode
        trained = dict(model.named_parameters())
        for name, p in ref.named_parameters():
            if "self_attn" in name:
                torch.testing.assert_close(trained[name], p, atol=1e-5, rtol=0, msg=name)
        assert sum(t["writes"] for t in tiers) == 0, mode  # the store is only read
    with tierstore.open(store) as st:
        assert versions(st) == before
        assert st.fsck().ok
