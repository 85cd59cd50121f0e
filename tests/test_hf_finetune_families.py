"""The fine-tune family matrix: every Mixture-of-Experts family the installed ``transformers``
serves (:func:`tierstore.hf.causal_lm_families`), tiny and fp32 (:mod:`hf_tiny`), fine-tuned
over its store in a loop of the user's own under both update rules, each against the same
``transformers`` model trained in memory, then exported and loaded back.

- ``dense``: the reference is what a user writes: the model as ``from_pretrained`` gives it
  and one ``torch.optim.AdamW(model.parameters())``, so every fused ``[E, ...]`` expert
  parameter is updated every step (an unrouted expert with a zero gradient) and weight decay
  applies to every parameter. Over the store: ``torch.optim.AdamW(model.parameters())`` for
  the dense part and ``ExpertAdamW(rule="dense")``.
- ``lazy``: the reference splits each fused parameter into one parameter per expert, an
  unrouted expert's ``.grad`` None
  (:class:`tierstore.trainer.train.hf_resident.PerExpert`), weight decay on matrices only,
  on both sides.

Each step is two micro-batches of 4 tokens (so some experts get no token: the tests assert
it), one global-norm clip and a warm-up schedule (``LambdaLR``). Per-step losses, gradient
norms and every final weight (read back through ``export-hf`` and ``from_pretrained``, so in
the family's own checkpoint layout) agree to 1e-5, and the export's logits equal the
fine-tuned model's. One import per family serves both rules (the store directory copied).

CI runs :data:`CI_FAMILIES` (one of each expert layout and attention kind);
``TIERSTORE_FINETUNE_FAMILIES=all`` runs every family.
"""

from __future__ import annotations

import copy
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

import hf_tiny  # noqa: E402
import tierstore.hf  # noqa: E402
from tierstore.hf.layout import stored_model  # noqa: E402
from tierstore.trainer.train.checkpoint import STEP_KIND  # noqa: E402
from tierstore.trainer.train.hf_resident import PerExpert  # noqa: E402
from tierstore.trainer.train.resident import param_groups  # noqa: E402

import tierstore  # noqa: E402

ATOL = 1e-5
STEPS, MICRO, SEQ = 3, 2, 4
# A fine-tuning learning rate: two implementations sum in different orders, and AdamW moves
# a weight whose gradient is mostly rounding noise by up to the learning rate whichever sign
# the noise has (at 1e-3 a few weights of deepseek_v4 and gemma4 differed by 1.2-1.7e-5).
LR, WD, CLIP = 1e-4, 0.01, 0.5
# Fused experts with the default gate (mixtral), MLA with dense layers first and shared
# experts (deepseek_v3), transposed biased experts with their own gate (gpt_oss), a linear-
# attention hybrid (qwen3_next), experts without a gate (nemotron_h).
CI_FAMILIES = ["deepseek_v3", "gpt_oss", "mixtral", "nemotron_h", "qwen3_next"]
ALL = tierstore.hf.causal_lm_families()
FAMILIES = list(ALL) if os.environ.get("TIERSTORE_FINETUNE_FAMILIES") == "all" else [
    f for f in CI_FAMILIES if f in ALL]


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(autouse=True)
def _remove_stores(tmp_path: Path) -> Iterator[None]:
    yield
    shutil.rmtree(tmp_path, ignore_errors=True)


def batches(vocab: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, min(vocab, 100), (1, SEQ), generator=g)
            for _ in range(STEPS * MICRO)]


def warmup(step: int) -> float:
    return min(1.0, (step + 1) / STEPS)


def run(model: Any, opts: list[torch.optim.Optimizer], data: list[torch.Tensor],
        clip: Any, after_backward: Any = None, after_step: Any = None
        ) -> list[tuple[float, float]]:
    """The user's loop: ``MICRO`` micro-batches, the clip, every optimizer stepped, one
    warm-up schedule on each; returns each step's (mean loss, gradient norm)."""
    schedules = [torch.optim.lr_scheduler.LambdaLR(o, warmup) for o in opts]
    torch.manual_seed(0)  # a router that samples in training (phimoe's) draws the same
    out = []
    for step in range(STEPS):
        total = 0.0
        for x in data[step * MICRO:(step + 1) * MICRO]:
            loss = model(input_ids=x, labels=x, use_cache=False).loss
            (loss / MICRO).backward()
            total += float(loss.detach()) / MICRO
        if after_backward is not None:
            after_backward()
        norm = float(clip())
        for o in opts:
            o.step()
        for s in schedules:
            s.step()
        for o in opts:
            o.zero_grad()
        if after_step is not None:
            after_step(step + 1)
        out.append((total, norm))
    return out


def reference(hf: Any, rule: str, data: list[torch.Tensor]
              ) -> tuple[list[tuple[float, float]], dict[str, torch.Tensor]]:
    """``hf`` (a copy) trained in memory; returns the steps and its final weights by
    parameter name, fused as ``transformers`` has them."""
    model = copy.deepcopy(hf).train()
    if rule == "dense":
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
        hist = run(model, [opt], data,
                   lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP))
        return hist, {n: p.detach() for n, p in model.named_parameters()}
    split = PerExpert(model)
    named = list(model.named_parameters())
    opt = torch.optim.AdamW(param_groups(named, WD), lr=LR)
    hist = run(model, [opt], data,
               lambda: torch.nn.utils.clip_grad_norm_([p for _, p in named], CLIP),
               after_backward=split.drop_unrouted_grads, after_step=lambda _: split.clear())
    per_expert = tuple(f"{name}.{a}{PerExpert.SUFFIX}." for name, (_, _, attrs)
                       in split.split.items() for a in attrs)
    weights = {n: p.detach() for n, p in named if not n.startswith(per_expert)}
    for name, (module, _, attrs) in split.split.items():
        for a in attrs:
            weights[f"{name}.{a}"] = torch.stack(
                [p.detach() for p in getattr(module, a + PerExpert.SUFFIX)])
    return hist, weights


def counts(store: tierstore.Store) -> list[torch.Tensor]:
    return [store.get(m.prefix, STEP_KIND).clone() for m in stored_model(store).experts]


def over_the_store(path: Path, rule: str, data: list[torch.Tensor]
                   ) -> tuple[Any, list[tuple[float, float]], list[list[torch.Tensor]]]:
    """The same loop over the store; returns the model, the steps and each layer's step
    counts after every step."""
    model = tierstore.hf.load(path, trainable=True, device="cpu", host_cache="64KiB")
    experts = tierstore.hf.ExpertAdamW(model, lr=LR, weight_decay=WD, rule=rule)
    if rule == "dense":
        dense = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    else:
        dense = torch.optim.AdamW(param_groups(list(model.named_parameters()), WD), lr=LR)
    seen: list[list[torch.Tensor]] = []
    hist = run(model, [dense, experts], data, lambda: tierstore.hf.clip_grad_norm_(model, CLIP),
               after_step=lambda _: seen.append(counts(model.tierstore.store)))
    return model, hist, seen


def check_rule(family: str, rule: str, hf: Any, store: Path, out: Path,
               data: list[torch.Tensor], ids: torch.Tensor) -> float:
    """One rule of the matrix; returns the largest difference seen."""
    want_hist, want = reference(hf, rule, data)
    start = dict(hf.named_parameters())
    moved = max(float((t - start[n].detach()).abs().max()) for n, t in want.items())
    assert moved > 10 * ATOL  # the comparison is far finer than what training changed
    model, got_hist, seen = over_the_store(store, rule, data)
    worst = 0.0
    for step, (a, b) in enumerate(zip(want_hist, got_hist, strict=True), 1):
        worst = max(worst, abs(a[0] - b[0]))
        assert abs(a[0] - b[0]) <= ATOL, (family, rule, step, "loss", a[0], b[0])
        # A norm of several units summed in another order: relative.
        assert abs(a[1] - b[1]) <= ATOL * a[1], (family, rule, step, "grad norm", a[1], b[1])
    # Some expert got no token in some step (its count is behind the step), under both rules.
    assert any(int(c.min()) < step for step, cs in enumerate(seen, 1) for c in cs), seen
    if rule == "dense":
        # Every step: a routed expert is at the step, the others where they were.
        for step, cs in enumerate(seen, 1):
            assert all(int(c.max()) == step for c in cs), (step, cs)
    tierstore.hf.save(model)  # every expert caught up, the dense weights in the store
    model.eval()
    with torch.no_grad():
        tuned = model(input_ids=ids).logits
    store_ = model.tierstore.store
    if rule == "dense":
        assert all(bool((c == STEPS).all()) for c in counts(store_))
    model.tierstore.close()

    tierstore.hf.export_hf(store, out, progress=False)
    back = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    got = dict(back.named_parameters())
    assert sorted(got) == sorted(want), (family, set(got) ^ set(want))
    for name, t in want.items():
        diff = float((got[name].detach() - t).abs().max()) if t.numel() else 0.0
        worst = max(worst, diff)
        assert diff <= ATOL, (family, rule, name, diff)
    with torch.no_grad():
        exported = back(input_ids=ids).logits
    diff = float((exported - tuned).abs().max())
    assert diff <= ATOL, (family, rule, "logits", diff)
    return max(worst, diff)


@pytest.mark.parametrize("family", FAMILIES)
def test_family_fine_tunes_under_both_rules_and_exports(family: str, tmp_path: Path) -> None:
    ck = hf_tiny.tiny_checkpoint(family, tmp_path / "hf", seed=3)
    hf = transformers.AutoModelForCausalLM.from_pretrained(ck, dtype=torch.float32)
    tierstore.hf.import_hf(ck, tmp_path / "imported", progress=False)
    vocab = int(hf.config.get_text_config().vocab_size)
    data = batches(vocab)
    ids = torch.randint(3, min(vocab, 100), (2, SEQ), generator=torch.Generator().manual_seed(7))
    for rule in ("dense", "lazy"):
        shutil.copytree(tmp_path / "imported", tmp_path / rule)
        worst = check_rule(family, rule, hf, tmp_path / rule, tmp_path / f"out-{rule}", data,
                           ids)
        print(f"{family} {rule}: largest difference {worst:.2e}")  # shown with -s
