"""Tiny random models of every Mixture-of-Experts causal-LM family of the installed
``transformers`` (tests/hf_tiny.py). Every family's tiny config builds under 2M parameters with
at least one MoE layer (and one full-attention layer where the family mixes in linear attention
or convolutions), special token ids inside the tiny vocabulary, a left-padded forward with
finite logits and routing that varies from token to token. A few families also go through
``tiny_checkpoint``: greedy ``generate`` with the KV cache, then ``from_pretrained`` of the
saved checkpoint gives the same logits; ``TIERSTORE_HF_TINY_ALL=1`` runs that for all of them.
Families that cannot be built tiny are skipped with their reason."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

import hf_tiny  # noqa: E402

FAMILIES = hf_tiny.moe_families()
# MLA with dense layers first, a hash router, a linear-attention hybrid, a composite config.
ROUND_TRIP = FAMILIES if os.environ.get("TIERSTORE_HF_TINY_ALL") else [
    "deepseek_v3", "deepseek_v4", "qwen3_next", "gemma4"]
MIXED_IN = ("linear_attention", "conv")  # layer kinds that need an attention layer beside them


pytestmark = pytest.mark.usefixtures("one_thread")


def _config_or_skip(family: str):
    try:
        return hf_tiny.tiny_config(family)
    except hf_tiny.TinyUnavailable as e:
        pytest.skip(str(e))


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    """A [2, 7] batch of ordinary tokens (clear of the remapped special ids at the top of the
    vocabulary), the first row left-padded by three."""
    ids = torch.randint(3, 100, (2, 7), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[0, :3] = 0
    return ids, mask


def _routed(model: torch.nn.Module) -> list[torch.Tensor]:
    """Each experts module's expert indices during the next forward: the integer tensor among
    its arguments, one row per token."""
    seen: list[torch.Tensor] = []

    def grab(_mod, args, kwargs):
        for a in (*args, *kwargs.values()):
            if isinstance(a, torch.Tensor) and not a.is_floating_point():
                seen.append(a.detach().reshape(a.shape[0], -1))
                return

    for m in model.modules():
        if hf_tiny.is_experts(m):
            m.register_forward_pre_hook(grab, with_kwargs=True)
    return seen


@pytest.mark.parametrize("family", FAMILIES)
def test_tiny_family_builds_and_runs(family: str) -> None:
    cfg = _config_or_skip(family)
    text = cfg.get_text_config(decoder=True)
    vocab = text.vocab_size
    assert vocab == hf_tiny.VOCAB
    for name in dir(text):
        if name.endswith("_token_id") and isinstance(getattr(text, name, None), int):
            assert 0 <= getattr(text, name) < vocab, name
    types = getattr(text, "layer_types", None) or getattr(text, "layers_block_type", None) or []
    if any(t in MIXED_IN for t in types):
        assert any("attention" in t and t != "linear_attention" for t in types), types

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    assert sum(p.numel() for p in model.parameters()) < 2_000_000
    experts = [name for name, m in model.named_modules() if hf_tiny.is_experts(m)]
    assert experts
    # One router redrawn beside each experts module, with the spread that makes routing
    # depend on the token rather than on rounding.
    routers = [r for r in hf_tiny.spread_routers(model) if r.endswith("weight")]
    assert len(routers) == len(experts)
    for e in experts:
        assert sum(r.startswith(e.rpartition(".")[0] + ".") for r in routers) == 1, e
    assert all(model.get_parameter(r).std() > 0.5 for r in routers)
    routed = _routed(model)
    ids, mask = _batch()
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits
    assert logits.shape == (2, 7, vocab)
    assert torch.isfinite(logits[mask.bool()]).all()
    assert routed, "no experts module ran"
    for idx in routed:  # spread routers: the tokens do not all pick the same experts
        assert len({tuple(row.tolist()) for row in idx}) > 1


@pytest.mark.parametrize("family", ROUND_TRIP)
def test_tiny_checkpoint_generates_and_reloads(family: str, tmp_path: Path) -> None:
    _config_or_skip(family)
    out = hf_tiny.tiny_checkpoint(family, tmp_path / family, seed=3)
    assert json.loads((out / "generation_config.json").read_text())["do_sample"] is False
    model = hf_tiny.tiny_model(family, seed=3)
    ids, mask = _batch()
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask).logits
    gen = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False,
                         use_cache=True, pad_token_id=0)
    assert gen.shape == (2, 11) and torch.equal(gen[:, :7], ids)

    loaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        got = loaded(input_ids=ids, attention_mask=mask).logits
    keep = mask.bool()
    assert (got[keep] - want[keep]).abs().max().item() <= 1e-5


def test_tiny_families_summary(capsys: pytest.CaptureFixture[str]) -> None:
    """The matrix follows the library: 62 families in transformers 5.25, and at most a few of
    them unavailable tiny, each with a one-line reason."""
    unavailable = {}
    for family in FAMILIES:
        try:
            hf_tiny.tiny_config(family)
        except hf_tiny.TinyUnavailable as e:
            unavailable[family] = str(e)
    with capsys.disabled():
        print(f"\n{len(FAMILIES) - len(unavailable)} of {len(FAMILIES)} MoE families build tiny; "
              f"unavailable: {unavailable or 'none'}")
    assert len(FAMILIES) >= 60
    assert len(FAMILIES) - len(unavailable) >= 55
    assert all(reason and "\n" not in reason for reason in unavailable.values())
