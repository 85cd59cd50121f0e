"""A training run sets its long-lived objects aside from the cycle collector after its
first step and gives them back when it ends, however it ends; it leaves alone objects that
something else has set aside."""

from __future__ import annotations

import gc

import pytest
from tierstore.trainer.train.data import load_corpus
from tierstore.trainer.train.heap import SteadyHeap
from tierstore.trainer.train.metrics import run_steps
from tierstore.trainer.train.resident import TrainConfig, train_resident


def test_set_aside_after_the_first_step_and_back_at_the_end() -> None:
    assert gc.get_freeze_count() == 0
    frozen: list[int] = []

    def step(s: int) -> dict:
        frozen.append(gc.get_freeze_count())
        return {"step": s + 1}

    assert [m["step"] for m in run_steps(range(3), step, None, None)] == [1, 2, 3]
    # Set aside after the first step and still so at the third: threads left by earlier
    # tests may free a few frozen objects meanwhile, so the count may fall by a few.
    assert frozen[0] == 0 and frozen[1] > 0 and frozen[2] > frozen[1] // 2
    assert gc.get_freeze_count() == 0


def test_a_run_that_fails_gives_its_objects_back() -> None:
    def step(s: int) -> dict:
        if s == 2:
            raise RuntimeError("step failed")
        return {"step": s + 1}

    with pytest.raises(RuntimeError, match="step failed"):
        run_steps(range(5), step, None, None)
    assert gc.get_freeze_count() == 0


def test_what_something_else_set_aside_stays_so() -> None:
    gc.freeze()
    try:
        before = gc.get_freeze_count()
        # Objects a wrong freeze would set aside too. Threads left by earlier tests may free
        # frozen objects meanwhile, so the count may fall by a few, never rise or empty.
        fresh = [[] for _ in range(1000)]
        with SteadyHeap() as heap:
            heap.step_done()
            assert before // 2 < gc.get_freeze_count() <= before
        assert before // 2 < gc.get_freeze_count() <= before
        del fresh
    finally:
        gc.unfreeze()


def test_the_resident_trainer_too() -> None:
    seen: list[int] = []
    tc = TrainConfig(batch_size=2, seq_len=16, eval_every=0)
    train_resident("tiny", 3, seed=0, train=tc, corpus=load_corpus(max_bytes=1 << 16),
                   on_step=lambda m: seen.append(gc.get_freeze_count()))
    assert seen[0] > 0 and gc.get_freeze_count() == 0
