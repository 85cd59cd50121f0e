"""``tierstore generate``: the --json line, text prompts through the stored tokenizer, the
routing trace, a trainer checkpoint generating through the same path, and clear errors."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from tierstore.hf.strategies import make_source

import tierstore
from tierstore.cli import main
from tierstore.lab import read_trace

transformers = pytest.importorskip("transformers")
from hf_models import generate_with, imported_path, load_bound, logits  # noqa: E402

KEYS = {"tokens", "tokens_per_s", "stall_frac", "hit_rate", "spec_accuracy", "prefill_s",
        "decode_s", "prepare_s", "bytes_read", "peak_rss_bytes", "mode", "dequantized_cache"}


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    root = tmp_path_factory.mktemp("gen")
    yield imported_path("mixtral", root)[1]
    shutil.rmtree(root, ignore_errors=True)  # slab files are preallocated


def run(*args: str) -> tuple[int, str]:
    argv = list(args)
    if argv[0] == "generate" and "--device" not in argv:
        # These are CPU tests: on a GPU machine `auto` would pick CUDA (its paths are
        # tested where marked gpu), and the tokens compared here are the CPU's.
        argv += ["--device", "cpu"]
    res = CliRunner().invoke(main, argv)
    return res.exit_code, res.output


def json_line(out: str) -> dict:
    lines = [line for line in out.splitlines() if line.strip()]
    assert len(lines) == 1, out
    return json.loads(lines[0])


def test_json_line_with_text_and_id_prompts(mixtral: Path, tmp_path: Path) -> None:
    code, out = run("generate", "--store", str(mixtral), "--prompt", "the store keeps experts",
                    "--prompt", "a ring of slots", "--max-new-tokens", "5", "--greedy",
                    "--mode", "ring", "--ring-slots", "1", "--json")
    assert code == 0, out
    got = json_line(out)
    assert set(got) == KEYS
    assert len(got["tokens"]) == 2 and all(1 <= len(t) <= 5 for t in got["tokens"])
    assert got["tokens_per_s"] > 0 and 0 <= got["stall_frac"] <= 1
    assert got["spec_accuracy"] is None  # the ring predicts nothing
    # The same prompts as ids, in expert mode, give the same tokens (and cache figures).
    with tierstore.open(mixtral) as store:
        from tierstore.hf.tokenizer import load_tokenizer

        tok = load_tokenizer(store)
        assert tok is not None
        ids = [tok.encode(t).ids for t in ("the store keeps experts", "a ring of slots")]
    trace = tmp_path / "trace.csv"
    args = ["generate", "--store", str(mixtral), "--max-new-tokens", "5", "--greedy",
            "--mode", "expert", "--json", "--trace", str(trace), "--no-warm-up"]
    for p in ids:
        args += ["--prompt-ids", ",".join(map(str, p))]
    code, out = run(*args)
    assert code == 0, out
    again = json_line(out)  # without the warm-up: the same tokens
    assert again["tokens"] == got["tokens"]
    assert 0 <= again["hit_rate"] <= 1 and 0 <= again["spec_accuracy"] <= 1
    tr = read_trace(trace)
    steps = max(len(t) for t in got["tokens"])
    assert tr.has_nbytes and set(tr.step.tolist()) == set(range(steps))
    assert set(tr.layer.tolist()) <= {0, 1, 2} and (tr.nbytes > 0).all()


def test_text_output_and_sampling_seed(mixtral: Path) -> None:
    common = ["generate", "--store", str(mixtral), "--prompt", "tokens route to",
              "--max-new-tokens", "6", "--seed", "3", "--temperature", "1.3"]
    code, out = run(*common)
    assert code == 0, out
    assert out.startswith("mode auto: ") and "\n[0] " in out and "tokens/s" in out
    a = json_line(run(*common, "--json")[1])["tokens"]
    b = json_line(run(*common, "--json", "--mode", "expert")[1])["tokens"]
    assert a == b


def test_errors_are_one_line(mixtral: Path, tmp_path: Path) -> None:
    code, out = run("generate", "--store", str(mixtral), "--prompt", "x", "--prompt-ids", "1",
                    "--max-new-tokens", "2")
    assert code == 2 and "--prompt" in out
    code, out = run("generate", "--store", str(mixtral), "--prompt-ids", "1,a",
                    "--max-new-tokens", "2")
    assert code == 2 and "comma-separated integers" in out
    code, out = run("generate", "--store", str(mixtral), "--prompt-ids", "1,99999",
                    "--max-new-tokens", "2")
    assert code == 2 and "outside the vocabulary" in out
    code, out = run("generate", "--store", str(mixtral), "--prompt-ids", "1,2",
                    "--max-new-tokens", "2", "--device-budget", "1KiB")
    assert code == 2 and "--device-budget" in out and "raise it to at least" in out
    assert len(out.strip().splitlines()) == 1
    empty = tmp_path / "empty"
    tierstore.open(empty, create=True).close()
    code, out = run("generate", "--store", str(empty), "--prompt-ids", "1", "--max-new-tokens",
                    "2")
    assert code == 2 and "holds no model" in out


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Mixtral imported into a store of 8 MiB slabs: cheap to copy and damage."""
    from hf_models import make_hf_model
    from tierstore.hf import import_hf

    root = tmp_path_factory.mktemp("small")
    make_hf_model("mixtral", root / "hf")
    tierstore.open(root / "store", create=True, slab_size="8MiB").close()
    import_hf(root / "hf", root / "store", progress=False)
    return root / "store"


def _nan(st: tierstore.Store, name: str) -> None:
    t = st.get(name)
    t.view(-1)[:: 7] = float("nan")
    st.put(name, t)


def _garbage_tokenizer(st: tierstore.Store) -> None:
    # What an import before the tokenizer was checked could store.
    raw = bytearray(b"\xff\xfe not a tokenizer")
    st.put("tokenizer.tokenizer.json", torch.frombuffer(raw, dtype=torch.uint8), kind="meta")


DAMAGED = [
    ("nan-dense-greedy", lambda st: _nan(st, "dense.model.norm.weight"), ("--greedy",),
     "computed NaN logits for prompt 0 after the prompt: its weights hold NaN"),
    ("nan-expert-sampled", lambda st: [_nan(st, n) for n in st.names("model.layers.")
                                       if n.endswith("down_proj")],
     ("--seed", "1"), "computed NaN logits for prompt 0"),
    ("nan-expert-text", lambda st: [_nan(st, n) for n in st.names("model.layers.")
                                    if n.endswith("down_proj")],
     ("--temperature", "0.7", "--top-p", "0.9"), "NaN logits"),
    ("garbage-tokenizer", _garbage_tokenizer, ("--prompt", "the store"),
     "its tokenizer.json does not load as a tokenizer"),
]


@pytest.mark.parametrize(("damage", "args", "says"), [d[1:] for d in DAMAGED],
                         ids=[d[0] for d in DAMAGED])
def test_a_damaged_model_is_one_line(small: Path, tmp_path: Path, damage: Any,
                                     args: tuple[str, ...], says: str) -> None:
    """Weights holding NaN (sampling or greedy: either would choose from noise) and a
    stored tokenizer that does not load fail with one line that names the cause."""
    store = tmp_path / "store"
    shutil.copytree(small, store)
    with tierstore.open(store, host_cache=0) as st:
        damage(st)
    if "--prompt" not in args:
        args = (*args, "--prompt-ids", "1,2,3", "--prompt-ids", "4")
    res = CliRunner().invoke(main, ["generate", "--store", str(store), "--max-new-tokens",
                                    "3", "--device", "cpu", *args], catch_exceptions=False)
    assert res.exit_code == 2, res.output
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and says in lines[0], res.output


def test_a_tiny_temperature_samples_the_most_likely_token(small: Path) -> None:
    """A temperature fp32 cannot even hold (0 in fp32, so logits / it were NaN) samples
    what greedy takes."""
    common = ["generate", "--store", str(small), "--prompt-ids", "1,2,3", "--max-new-tokens",
              "4", "--json"]
    code, out = run(*common, "--greedy")
    assert code == 0, out
    for t in ("1e-300", "1e-40"):
        got = run(*common, "--temperature", t, "--seed", "5")
        assert got[0] == 0 and json_line(got[1])["tokens"] == json_line(out)["tokens"], got


def test_trainer_checkpoint_generates(tmp_path: Path) -> None:
    store = tmp_path / "run"
    code, out = run("train", "--store", str(store), "--model", "tiny", "--steps", "2",
                    "--batch-size", "2", "--seq-len", "16", "--eval-every", "0",
                    "--device", "cpu")
    assert code == 0, out
    code, out = run("generate", "--store", str(store), "--prompt", "def ", "--prompt",
                    "import os", "--max-new-tokens", "6", "--greedy", "--ring-slots", "1",
                    "--json")
    assert code == 0, out
    got = json_line(out)["tokens"]
    assert [len(t) for t in got] == [6, 6]  # a byte-level model has no end-of-sequence id
    with tierstore.open(store) as st:
        model = load_bound(st, "cpu")
        src = make_source("resident", st, model.tierstore.served)
        prompts = [list(b"def "), list(b"import os")]
        assert generate_with(model, src, prompts, 6, eos=None).tokens == got


def test_decode_threads_take_over_after_the_prefill(mixtral: Path) -> None:
    """``generate(..., decode_threads=n)`` computes the prefill on the threads it was
    called with and every decode step on ``n``: the layers' expert calls see which."""
    with tierstore.open(mixtral) as st:
        model = load_bound(st, "cpu")
        src = make_source("resident", st, model.tierstore.served)
        threads: list[int] = []
        experts = src.experts

        def watched(layer: int, ids: list[int], x: torch.Tensor):  # noqa: ANN202
            threads.append(torch.get_num_threads())
            return experts(layer, ids, x)

        src.experts = watched  # type: ignore[method-assign]
        before = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            res = generate_with(model, src, [[1, 2, 3, 4]], 3, decode_threads=2)
            assert torch.get_num_threads() == 2
        finally:
            torch.set_num_threads(before)
    layers = len(model.tierstore.served.moe_layers)
    assert res.new_tokens == 3 and len(threads) == 3 * layers
    assert threads[:layers] == [1] * layers and threads[layers:] == [2] * (2 * layers)


@pytest.mark.parametrize("warm", [True, False])
def test_generate_warms_the_model_up_before_its_clock_without_the_source(
        mixtral: Path, warm: bool) -> None:
    """Before its clock, ``generate`` runs the prompt through the model once with narrow
    zero experts of its own (which pages in every operation's code), unless told not to:
    the source's first pass is the timed prefill, and the tokens are the ones a model that
    was never warmed up gives."""
    with tierstore.open(mixtral) as st:
        model = load_bound(st, "cpu")
        src = make_source("resident", st, model.tierstore.served)
        cold = logits(model, src, torch.tensor([[1, 2, 3, 4]]))
        calls: list[object] = []  # the source of each experts call of the first layer
        first = model.tierstore.served.moe_layers[0]
        begun: list[int] = []
        begin = src.begin_pass
        experts = src.experts

        def counted(m, n):  # noqa: ANN001, ANN202
            begun.append(len(calls))
            return begin(m, n)

        def seen(layer, ids, x):  # noqa: ANN001, ANN202
            if layer == first:
                calls.append(src)
            return experts(layer, ids, x)

        src.begin_pass = counted  # type: ignore[method-assign]
        src.experts = seen  # type: ignore[method-assign]
        narrow = model.tierstore.narrow
        narrow_experts = narrow.experts

        def seen_narrow(layer, ids, x):  # noqa: ANN001, ANN202
            if layer == first:
                calls.append(narrow)
            return narrow_experts(layer, ids, x)

        narrow.experts = seen_narrow
        res = generate_with(model, src, [[1, 2, 3, 4]], 2, warm=warm)
    # The warm-up through experts of its own, then the prefill and one decode step.
    if warm:
        assert calls == [narrow, src, src] and begun == [1, 2]
    else:
        assert calls == [src, src] and begun == [0, 1]
    assert res.tokens[0][0] == int(cold[0, -1].argmax())


def test_compute_threads_leave_a_core_only_while_experts_stream() -> None:
    """Without --threads, the ring and expert mode on a CPU leave a core to their read
    threads while experts stream from the backing tier: every pass where the host cache
    is smaller than the experts, the first pass (the prefill) where it holds them all.
    After it they compute on every core, as on-demand and resident mode always do, as
    expert mode does with the host cache pooled (it reads on the calling thread), and as
    any CUDA run does. (prefill, decode) threads:"""
    from tierstore.trainer.infer.generate import compute_threads

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    every = 1 << 30
    for mode in ("ring", "expert"):
        assert compute_threads(mode, cpu, 4, every // 4, every) == (3, 3)
        assert compute_threads(mode, cpu, 1, every // 4, every) == (1, 1)
        assert compute_threads(mode, cpu, 4, every, every) == (3, 4)
        assert compute_threads(mode, cuda, 4, 0, every) == (4, 4)
    assert compute_threads("expert", cpu, 4, every // 4, every, pooled=True) == (4, 4)
    for mode in ("on-demand", "resident"):
        assert compute_threads(mode, cpu, 4, 0, every) == (4, 4)
        assert compute_threads(mode, cpu, 4, every, every) == (4, 4)
