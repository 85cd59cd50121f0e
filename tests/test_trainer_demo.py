"""The training demo's ending says what can be checked: offloaded generation gives exactly
the in-memory model's tokens, and the trained model writes text, not blanks."""

from __future__ import annotations

from pathlib import Path

from tierstore.trainer.train.demo import PROMPT, demo_training, sparkline, zen_corpus


def test_demo_generation_is_identical_to_the_in_memory_model_and_not_blank(
        tmp_path: Path) -> None:
    lines: list[str] = []
    result = demo_training(str(tmp_path / "d"), model="tiny", steps=30, new_tokens=24,
                           echo=lines.append)
    assert result.ok and result.fsck_ok
    assert set(result.generated) == {"ring", "expert"}
    for tokens in result.generated.values():
        assert tokens == result.reference and len(tokens) == 24
    assert result.text.startswith(PROMPT) and result.continuation.strip()
    out = "\n".join(lines)
    assert out.count("identical to the in-memory model: yes") == 2
    assert repr(result.text) in out
    assert result.history[-1]["loss"] < result.history[0]["loss"] - 1.0  # it learned


def test_zen_corpus_holds_the_prompt() -> None:
    corpus = zen_corpus()
    text = bytes(corpus.train).decode()
    assert text.startswith("The Zen of Python") and PROMPT in text


def test_sparkline_spans_the_range() -> None:
    assert sparkline([3.0, 2.0, 1.0]) == "█▅▁"
    assert len(sparkline([float(i) for i in range(100)], width=40)) == 40
    assert sparkline([]) == "" and sparkline([1.0, 1.0]) == "▁▁"
