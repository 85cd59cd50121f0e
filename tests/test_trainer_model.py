"""The MoE model: shapes, causality, routing, the explicit-weights path, preset sizes."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from tierstore.trainer.model import (
    EXPERT_WEIGHTS,
    ExpertWeights,
    MoEModel,
    expert_forward,
    expert_name,
    init_expert,
    moe_combine,
    route,
)
from tierstore.trainer.presets import PRESETS, MoEConfig, model_size, presets_table

TINY = PRESETS["tiny"]
MIXED = MoEConfig(d_model=32, n_layers=4, n_heads=2, d_ff=48, d_ff_dense=40, n_experts=6,
                  top_k=2, moe_every=2, max_seq_len=32)


def tokens(b: int, t: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (b, t), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("cfg", [TINY, MIXED], ids=["tiny", "mixed"])
def test_forward_shapes_and_losses(cfg: MoEConfig) -> None:
    model = MoEModel(cfg, seed=1)
    idx = tokens(2, 16)
    logits, loss, info = model(idx, idx)
    assert logits.shape == (2, 16, cfg.vocab_size) and logits.dtype == torch.float32
    assert loss is not None and loss.ndim == 0 and torch.isfinite(loss)
    expected = (info["ce"] + cfg.router_aux_coef * info["aux_loss"]
                + cfg.router_z_coef * info["z_loss"])
    assert torch.allclose(loss.detach(), expected)
    # An untrained byte model is close to uniform over 256 tokens.
    assert abs(float(info["ce"]) - math.log(256)) < 0.5
    assert sorted(info["routing"]) == cfg.moe_layers
    for r in info["routing"].values():
        assert r.shape == (2 * 16, cfg.top_k)
    _, no_loss, no_info = model(idx)
    assert no_loss is None and no_info["ce"] is None


def test_moe_every_places_dense_and_moe_layers() -> None:
    model = MoEModel(MIXED)
    assert MIXED.moe_layers == [1, 3]
    for i, block in enumerate(model.layers):
        assert block.is_moe == (i in (1, 3))
        assert (block.mlp is None) == block.is_moe
        assert (block.experts is not None) == block.is_moe


@pytest.mark.parametrize("cfg", [TINY, MIXED], ids=["tiny", "mixed"])
def test_causal_future_tokens_do_not_change_past_logits(cfg: MoEConfig) -> None:
    model = MoEModel(cfg, seed=2).eval()
    idx = tokens(2, 24, seed=3)
    changed = idx.clone()
    cut = 13
    changed[:, cut:] = (changed[:, cut:] + 1 + torch.arange(24 - cut)) % 256
    with torch.no_grad():
        a, _, ia = model(idx)
        b, _, ib = model(changed)
    torch.testing.assert_close(a[:, :cut], b[:, :cut], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(a[:, cut:], b[:, cut:])
    for layer, ra in ia["routing"].items():
        rb = ib["routing"][layer]
        past = ra.view(2, 24, -1)[:, :cut]
        assert torch.equal(past, rb.view(2, 24, -1)[:, :cut])


def test_route_weights_and_losses() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 32, generator=g)
    w = torch.randn(8, 32, generator=g)
    r = route(x, w, top_k=3)
    assert r.topk_idx.shape == (64, 3) and r.topk_idx.dtype == torch.int64
    assert r.topk_weight.dtype == torch.float32
    torch.testing.assert_close(r.topk_weight.sum(-1), torch.ones(64))
    assert (r.topk_weight > 0).all()
    # distinct experts per token, picked by descending probability
    assert all(len(set(row)) == 3 for row in r.topk_idx.tolist())
    assert (r.topk_weight[:, :-1] >= r.topk_weight[:, 1:]).all()
    for loss in (r.aux_loss, r.z_loss):
        assert loss.ndim == 0 and torch.isfinite(loss) and loss > 0
    # the renormalised top-k weights are a softmax over the chosen logits
    logits = x @ w.T
    torch.testing.assert_close(r.topk_weight, logits.gather(1, r.topk_idx).softmax(-1))


def test_switch_loss_is_one_when_balanced() -> None:
    # A zero router gives every expert probability 1/E; the loss is then sum_e f_e = 1
    # whatever the (tie-broken) assignment, and log-sum-exp is log E.
    x = torch.randn(40, 16)
    r = route(x, torch.zeros(4, 16), top_k=2)
    torch.testing.assert_close(r.aux_loss, torch.tensor(1.0))
    torch.testing.assert_close(r.z_loss, torch.tensor(math.log(4) ** 2))


def test_route_gradient_reaches_router_through_losses() -> None:
    x = torch.randn(20, 16)
    w = torch.randn(4, 16, requires_grad=True)
    r = route(x, w, top_k=2)
    (r.aux_loss + r.z_loss + r.topk_weight.sum()).backward()
    assert w.grad is not None and torch.isfinite(w.grad).all() and w.grad.abs().sum() > 0


def test_moe_combine_matches_naive_loop() -> None:
    g = torch.Generator().manual_seed(5)
    n_exp, d, f, k, n_tok = 5, 12, 20, 2, 30
    x = torch.randn(n_tok, d, generator=g)
    weights = {e: tuple(torch.randn(s, generator=g) * 0.2
                        for s in ((f, d), (d, f), (f, d))) for e in range(n_exp)}
    r = route(x, torch.randn(n_exp, d, generator=g), top_k=k)
    y = moe_combine(x, r.topk_idx, r.topk_weight, weights)
    ref = torch.zeros_like(x)
    for t in range(n_tok):
        for j in range(k):
            e = int(r.topk_idx[t, j])
            ref[t] += r.topk_weight[t, j] * expert_forward(x[t:t + 1], *weights[e])[0]
    torch.testing.assert_close(y, ref, atol=1e-6, rtol=1e-5)
    # the mapping's order and extra entries do not matter
    shuffled = {e: weights[e] for e in reversed(range(n_exp))}
    assert torch.equal(moe_combine(x, r.topk_idx, r.topk_weight, shuffled), y)


def test_moe_combine_names_a_missing_expert() -> None:
    x = torch.randn(4, 8)
    idx = torch.tensor([[0, 1], [1, 2], [0, 2], [2, 1]])
    w = torch.full((4, 2), 0.5)
    weights = {e: (torch.randn(16, 8), torch.randn(8, 16), torch.randn(16, 8)) for e in (0, 1)}
    with pytest.raises(KeyError, match="expert 2"):
        moe_combine(x, idx, w, weights)


def test_expert_parameter_names_follow_store_convention() -> None:
    model = MoEModel(MIXED)
    names = {n for n, _ in model.expert_parameters()}
    expected = {expert_name(layer, e, w) for layer in MIXED.moe_layers
                for e in range(MIXED.n_experts) for w in EXPERT_WEIGHTS}
    assert names == expected
    assert names <= set(model.state_dict())
    dense = {n for n, _ in model.dense_parameters()}
    assert not dense & names
    assert len(dense) + len(names) == len(list(model.parameters()))
    with pytest.raises(ValueError):
        expert_name(0, 0, "w4")


def test_experts_initialise_the_same_however_held() -> None:
    resident = MoEModel(MIXED, seed=7)
    bare = MoEModel(MIXED, seed=7, resident_experts=False)
    assert not bare.expert_parameters()
    sd = resident.state_dict()
    for name, t in bare.state_dict().items():
        assert torch.equal(t, sd[name]), name
    layer = MIXED.moe_layers[0]
    w1, w2, w3 = init_expert(MIXED, 7, layer, 3)
    bank = resident.layers[layer].experts
    assert bank is not None
    assert torch.equal(w1, bank[3].w1) and torch.equal(w2, bank[3].w2)
    assert torch.equal(w3, bank[3].w3)
    assert not torch.equal(init_expert(MIXED, 8, layer, 3)[0], w1)
    assert not torch.equal(init_expert(MIXED, 7, layer, 4)[0], w1)


def test_bare_model_without_provider_is_an_error() -> None:
    bare = MoEModel(TINY, resident_experts=False)
    with pytest.raises(RuntimeError, match="experts=provider"):
        bare(tokens(1, 8))


@pytest.mark.parametrize("cfg", [TINY, MIXED], ids=["tiny", "mixed"])
def test_explicit_weights_path_equals_resident_exactly(cfg: MoEConfig) -> None:
    resident = MoEModel(cfg, seed=3)
    bare = MoEModel(cfg, seed=3, resident_experts=False)
    # Fewer routed slots than experts, so some experts get no token.
    idx = tokens(1, 3, seed=4)
    leaves: dict[tuple[int, int], ExpertWeights] = {}
    calls: list[tuple[int, list[int]]] = []

    def provider(layer: int, ids: list[int]) -> dict[int, ExpertWeights]:
        calls.append((layer, list(ids)))
        out = {}
        for e in ids:
            key = (layer, e)
            if key not in leaves:
                bank = resident.layers[layer].experts
                leaves[key] = tuple(  # type: ignore[assignment]
                    getattr(bank[e], w).detach().clone().requires_grad_(True)
                    for w in EXPERT_WEIGHTS)
            out[e] = leaves[key]
        return out

    la, loss_a, ia = resident(idx, idx)
    lb, loss_b, ib = bare(idx, idx, experts=provider)
    assert torch.equal(la, lb) and torch.equal(loss_a, loss_b)
    assert [layer for layer, _ in calls] == cfg.moe_layers
    for layer, ids in calls:
        assert ids == sorted(ids)
        assert ids == torch.unique(ib["routing"][layer]).tolist()
        assert torch.equal(ia["routing"][layer], ib["routing"][layer])

    loss_a.backward()
    loss_b.backward()
    bare_params = dict(bare.named_parameters())
    for name, p in resident.dense_parameters():
        assert torch.equal(p.grad, bare_params[name].grad), name
    routed = {(layer, e) for layer, ids in calls for e in ids}
    unrouted = 0
    for layer in cfg.moe_layers:
        bank = resident.layers[layer].experts
        for e in range(cfg.n_experts):
            for j, w in enumerate(EXPERT_WEIGHTS):
                g_res = getattr(bank[e], w).grad
                if (layer, e) in routed:
                    assert g_res is not None
                    assert torch.equal(g_res, leaves[(layer, e)][j].grad), (layer, e, w)
                else:
                    assert g_res is None  # lazy: no token, no gradient
                    unrouted += 1
    assert unrouted > 0


def test_bfloat16_compute() -> None:
    cfg = replace(TINY, dtype="bfloat16")
    model = MoEModel(cfg, seed=0)
    idx = tokens(2, 16)
    logits, loss, _ = model(idx, idx)
    assert logits.dtype == torch.float32 and loss is not None and torch.isfinite(loss)
    loss.backward()
    assert all(p.dtype == torch.float32 for p in model.parameters())
    with torch.no_grad():
        fp32_loss = MoEModel(TINY, seed=0)(idx, idx)[1]
    assert fp32_loss is not None and abs(loss.item() - fp32_loss.item()) < 0.05


def test_config_validation() -> None:
    with pytest.raises(ValueError):
        MoEConfig(d_model=30, n_heads=4)
    with pytest.raises(ValueError):
        MoEConfig(top_k=9, n_experts=8)
    with pytest.raises(ValueError):
        MoEConfig(dtype="float16")
    with pytest.raises(ValueError):
        MoEModel(TINY)(tokens(1, TINY.max_seq_len + 1))
    assert MoEConfig.from_dict(MIXED.to_dict()) == MIXED


@pytest.mark.parametrize("cfg", [TINY, MIXED, PRESETS["small"]], ids=["tiny", "mixed", "small"])
def test_model_size_matches_instantiated_model(cfg: MoEConfig) -> None:
    model = MoEModel(cfg)
    size = model_size(cfg)
    n_expert = sum(p.numel() for _, p in model.expert_parameters())
    n_dense = sum(p.numel() for _, p in model.dense_parameters())
    assert size.expert_params == n_expert and size.dense_params == n_dense
    assert size.total_params == sum(p.numel() for p in model.parameters())
    assert size.expert_state_bytes == 12 * n_expert
    assert size.dense_state_bytes == 16 * n_dense
    assert size.params_per_expert * cfg.n_experts * len(cfg.moe_layers) == n_expert


def test_presets_span_tiny_to_tens_of_gigabytes() -> None:
    sizes = {name: model_size(cfg) for name, cfg in PRESETS.items()}
    states = [s.expert_state_bytes for s in sizes.values()]
    assert states == sorted(states)
    assert sizes["tiny"].expert_state_bytes < 16 * 2**20
    assert sizes["xl"].expert_state_bytes >= 20 * 2**30
    # xl by hand: 12 MoE layers x 64 experts x 3 * 768 * 2048 params x 12 bytes
    assert sizes["xl"].expert_state_bytes == 12 * 64 * 3 * 768 * 2048 * 12
    assert sizes["xl"].layer_expert_state_bytes * 12 == sizes["xl"].expert_state_bytes
    table = presets_table()
    assert all(name in table for name in PRESETS)
