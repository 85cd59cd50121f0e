"""Expert-parallel fine-tuning of every Mixture-of-Experts family the installed
``transformers`` serves (:func:`tierstore.hf.causal_lm_families`, built tiny by
:mod:`hf_tiny`), each on two nodes of one rank with a store each, in a loop of the user's
own over ``tierstore.hf.load(..., process_group=...)`` (tests/dist_hf_loop.py, both
choices ``auto``), against the single process's fine-tune of the same import on the same
global batch: per-step losses and every weight within 1e-5, and the pipelining probe's 2
and 4 chunks bit-identical to one. A family whose training forward draws random numbers
(phimoe's router samples) is skipped, saying so: its ranks draw for their own rows.

Each family is a torchrun launch (about 30 s here), so the module is ``slow``: it runs the
single-process matrix's :data:`CI_FAMILIES` less the two that tests/test_dist_finetune_hf.py
runs in CI, and every family with ``TIERSTORE_FINETUNE_FAMILIES=all``.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import hf_tiny
import pytest
import test_finetune_hf
import tierstore.hf
import torch
import transformers
from test_dist_finetune_hf import (
    CORPUS_BYTES,
    LOOP,
    STEPS,
    TRAIN,
    check_weights,
    single_process,
)
from test_dist_train import launch, stop_daemons
from test_finetune_hf import VOCAB
from test_hf_finetune_families import CI_FAMILIES
from tierstore.trainer.train.data import Corpus

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
corpus = test_finetune_hf.corpus
tokenizer_file = test_finetune_hf.tokenizer_file
ALL = tierstore.hf.causal_lm_families()
FAMILIES = list(ALL) if os.environ.get("TIERSTORE_FINETUNE_FAMILIES") == "all" else [
    f for f in CI_FAMILIES if f in ALL and f not in ("mixtral", "deepseek_v3")]


@pytest.fixture(autouse=True)
def _cleanup(tmp_path: Path) -> Iterator[None]:
    yield
    stop_daemons(tmp_path)
    shutil.rmtree(tmp_path, ignore_errors=True)


def checkpoint(family: str, out: Path, tokenizer_file: Path) -> Any:
    """:func:`hf_tiny.tiny_model`'s checkpoint with the corpus tokenizer's vocabulary;
    returns the model."""
    cfg = hf_tiny.tiny_config(family)
    text = cfg.get_text_config()
    for field in ("vocab_size", "vocab_size_per_layer_input", "unpadded_vocab_size"):
        if getattr(text, field, None) == hf_tiny.VOCAB:
            setattr(text, field, VOCAB)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    hf_tiny.spread_routers(model)
    model.save_pretrained(out)
    shutil.copy(tokenizer_file, out / "tokenizer.json")
    return model


def draws_in_training(model: Any) -> bool:
    """Whether the model's training forward depends on torch's generator (a router that
    samples, as phimoe's sparsemixer does, or dropout): two seeds, two results. Then no
    run at W = 2 can equal one process's: each rank draws for its own rows."""
    ids = torch.randint(3, VOCAB, (1, 8), generator=torch.Generator().manual_seed(0))
    model.train()
    got = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        with torch.no_grad():
            got.append(model(input_ids=ids).logits)
    return not torch.equal(*got)


@pytest.mark.parametrize("family", FAMILIES)
def test_two_nodes_equal_one_process(family: str, corpus: Corpus, tokenizer_file: Path,
                                     tmp_path: Path) -> None:
    try:
        model = checkpoint(family, tmp_path / "hf", tokenizer_file)
    except hf_tiny.TinyUnavailable as e:
        pytest.skip(str(e))
    if draws_in_training(model):
        pytest.skip(f"{family}'s training forward draws random numbers (two seeds, two "
                    "results): each rank draws for its own rows, so W = 2 cannot equal one "
                    "process")
    nodes = 2
    for path in ("node0", "node1", "single", "start"):
        tierstore.hf.import_hf(tmp_path / "hf", tmp_path / path, progress=False)
    spec = {"train": {**TRAIN, "batch_size": 1}, "corpus_bytes": CORPUS_BYTES,
            "out": str(tmp_path / "losses.json"), "paradigm": "auto", "pipeline": "auto"}
    codes = launch(tmp_path, "loop", nodes, 1, steps=STEPS, spec=spec, child=LOOP)
    assert codes == [0] * nodes, (tmp_path / "loop.node0.log").read_text()[-3000:]
    out = json.loads((tmp_path / "losses.json").read_text())
    ref = single_process(tmp_path, nodes, corpus)
    assert len(out["losses"]) == STEPS
    for a, b in zip(ref, out["losses"]):
        assert abs(a["loss"] - b) < 1e-5, (family, a["loss"], b)
    for setting in ("2", "4", "auto1", "auto2"):
        assert out["probe"][setting]["same"], (family, setting)
    check_weights(tmp_path, nodes, 1)
