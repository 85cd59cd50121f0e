"""Janus's choice per MoE block for an imported model (``--paradigm auto``): each block by
the ratio of its own experts' size, so one model can send tokens in one block and pull
experts in another."""

from __future__ import annotations

import pytest
import torch
from tierstore.trainer.dist.hf_parallel import choose
from tierstore.trainer.dist.world import World
from tierstore.trainer.train.layout import ExpertLayout, LayerEntries

# Two nodes of one rank; 8 experts (4 a rank), top-2, width 64, 256 tokens a rank: Janus's
# ratio 2 * 64 * 256 * 2 / (2 nodes * 4 experts * numel) is 2 for experts of 4096
# parameters and 0.5 for experts of 16384.
WORLD = World(rank=0, size=2, local_rank=0, node=0, nodes=[[0], [1]], backend="gloo",
              device=torch.device("cpu"))
LAYOUT = ExpertLayout((
    LayerEntries(1, "model.layers.1.mlp.experts", ("up", "down"), ((32, 64), (64, 32))),
    LayerEntries(2, "model.layers.2.mlp.experts", ("up", "down"), ((128, 64), (64, 128)))),
    n_experts=8, top_k=2)


def test_auto_chooses_each_block_by_its_own_experts() -> None:
    assert choose(LAYOUT, 64, "auto", 256, WORLD) == {1: "data", 2: "token"}
    # Fewer tokens favour moving them: both blocks send tokens at 64 a rank.
    assert choose(LAYOUT, 64, "auto", 64, WORLD) == {1: "token", 2: "token"}
    for forced in ("token", "data"):
        assert choose(LAYOUT, 64, forced, 256, WORLD) == {1: forced, 2: forced}


def test_an_unknown_paradigm_is_one_line() -> None:
    with pytest.raises(ValueError,
                       match=r"^paradigm must be one of token, data, auto, not 'pull'$"):
        choose(LAYOUT, 64, "pull", 256, WORLD)
