"""Expert-parallel fine-tuning of imported Hugging Face checkpoints under torchrun (gloo,
this machine): the family's own ``transformers`` model on every rank, the routed rows sent
to their experts' owners inside the registered ``tierstore`` experts function.

- W = 2 equals the single-process fine-tune (``train_store`` over one store) on the same
  global batch under the dense update rule (the default): per-step losses within 1e-5,
  every weight (each node's owned experts, the dense weights) within 1e-5, experts missing
  steps and caught up by their owners, each rank from its own history. Mixtral (the
  global batch's router loss) in a loop of the user's own over ``tierstore.hf.load(...,
  process_group=...)`` (``paradigm="auto"``: token-centric, said per block), as two nodes
  of one rank with a store each; DeepSeek-V3 (a shared expert, group-limited routing) by
  the distributed trainer data-centric, as one node of two ranks sharing its store and
  daemon, and by ``tierstore train --distributed`` token-centric (``--paradigm auto``) on
  two nodes, resumed after its daemon's SIGKILL with ``--pipeline 2``. Two nodes
  (``slow``), both families: W = 4 in both paradigms under both rules, W = 2 under the
  lazy rule. Every other family: tests/test_dist_families_hf.py.
- DeepSeek-V3 shipped in block FP8, imported compact: the two ranks of one node unpack
  its packed weights into fp32 masters together, and the run equals the single process's
  fine-tune of the same compact store to 1e-5.
  Killed while they do (rank 1 writing its masters; the leader right after its commit),
  the store stays fsck-clean, the import or the model naming the masters, and the run
  that follows equals the one never killed.
- MPMoE's pipelining of the token-centric blocks: 2 and 4 chunks and ``auto`` give the
  loss, logits and every gradient of one chunk bit for bit, and the counters show chunks
  computed while another chunk's exchange was in flight.
- ``export-hf`` after the two-node run gathers both nodes' experts (``--node-store``),
  node 1's caught up from node 1's own history (only rank 0 saved): ``from_pretrained`` of
  it computes the single process's logits.
- A rank SIGKILLed mid-step: the other ends within the bound with one line naming
  it, the store stays fsck-clean, and ``--resume`` continues to the single process's
  result (each torchrun launch costs ~20 s here: the kill and the equality share one run).
- ``--credits`` and ``--hierarchical-a2a`` (a preset's exchanges) are refused in one line.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import test_finetune_hf
import tierstore.hf
import torch
import transformers
from test_dist_train import _port, launch, metrics, rank_stderr, stop_daemons
from test_finetune_hf import VOCAB, make_model, weights
from tierstore.hf.layout import MODEL_ENTRY, stored_model
from tierstore.trainer.train.data import Corpus
from tierstore.trainer.train.resident import TrainConfig
from tierstore.trainer.train.store_trainer import train_store

import tierstore

pytestmark = pytest.mark.timeout(600)
LOOP = Path(__file__).with_name("dist_hf_loop.py")
# test_finetune_hf's fixtures: its corpus, and a tokenizer trained on it.
corpus = test_finetune_hf.corpus
tokenizer_file = test_finetune_hf.tokenizer_file
CORPUS_BYTES = 96 * 1024  # test_finetune_hf's corpus fixture
# As test_finetune_hf: a clip that bites, two micro-batches, a fine-tuning learning rate.
TRAIN = {"seq_len": 8, "grad_accum": 2, "lr": 1e-4, "min_lr": 1e-5, "warmup_steps": 1,
         "decay_steps": 4, "clip": 0.5, "eval_every": 0}
STEPS, SEED = 3, 3
BOUND_S = 90.0  # the other ranks end this soon after a rank dies (as test_dist_faults)


@pytest.fixture(autouse=True)
def _no_daemon_left(tmp_path: Path) -> Any:
    yield
    stop_daemons(tmp_path)


def owned_weights(tmp: Path, nodes: int, per_node: int) -> dict[str, torch.Tensor]:
    """Every weight of the distributed run: each expert from its owner's node store, the
    dense entries from node 0's."""
    w = nodes * per_node
    out: dict[str, torch.Tensor] = {}
    for node in range(nodes):
        with tierstore.open(tmp / f"node{node}", host_cache=0) as st:
            sm = stored_model(st)
            n = sm.experts[0].num_experts
            mine = range(node * per_node * n // w, (node + 1) * per_node * n // w)
            names = [f"{m.prefix}.{e}.{part}" for m in sm.experts for e in mine
                     for _, parts in m.params for part in parts]
            if node == 0:
                names += list(sm.dense.values())
            out.update({str(k): v for k, v in st.get_many(names).items()})
    return out


def single_process(tmp: Path, global_batch: int, corpus: Corpus,
                   rule: str = "dense") -> list[dict[str, Any]]:
    tc = TrainConfig(batch_size=global_batch, update_rule=rule, **TRAIN)
    return train_store(None, STEPS, seed=SEED, train=tc, corpus=corpus,
                       store_path=tmp / "single", host_cache="4MiB")


def prepare(family: str, tmp: Path, nodes: int, tokenizer_file: Path, **over: Any) -> None:
    """The checkpoint (``over``: config fields), imported into every node's store, the
    single process's and one kept as it starts."""
    make_model(family, tmp / "hf", tokenizer_file, **over)
    for path in [*(f"node{i}" for i in range(nodes)), "single", "start"]:
        tierstore.hf.import_hf(tmp / "hf", tmp / path, progress=False)


def check_weights(tmp: Path, nodes: int, per_node: int) -> None:
    """Every weight of the distributed run within 1e-5 of the single process's, far finer
    than what training moved; every store fsck-clean."""
    want, got = weights(tmp / "single"), owned_weights(tmp, nodes, per_node)
    begin = weights(tmp / "start")
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        torch.testing.assert_close(got[name], t, atol=1e-5, rtol=0, msg=name)
    moved = max(float((want[n] - begin[n]).abs().max()) for n in want)
    assert moved > 20 * 1e-5
    for i in range(nodes):
        with tierstore.open(tmp / f"node{i}", host_cache=0) as st:
            assert st.fsck().ok


def test_own_loop_equals_one_process(corpus: Corpus, tokenizer_file: Path,
                                     tmp_path: Path) -> None:
    """Mixtral (a router loss, the global batch's) on two nodes of one rank, each with its
    own store, in a loop of the user's own over ``tierstore.hf.load(store, trainable=True,
    process_group=...)`` (tests/dist_hf_loop.py), its token-centric blocks pipelined in two
    chunks; before training, the pipelining probe (bit-identical in 1, 2, 4 chunks)."""
    nodes, per_node = 2, 1
    # 16 experts so that some miss steps (with 8, this batch reaches all in every step).
    prepare("mixtral", tmp_path, nodes, tokenizer_file, num_local_experts=16)
    # Only rank 0 saves (the dense weights are every rank's): node 1's experts stay behind
    # the last step until export-hf catches them up from node 1's own history.
    spec = {"train": {**TRAIN, "batch_size": 1}, "corpus_bytes": CORPUS_BYTES,
            "out": str(tmp_path / "losses.json"), "paradigm": "auto", "pipeline": 2,
            "save_ranks": [0]}
    codes = launch(tmp_path, "loop", nodes, per_node, steps=STEPS, spec=spec, child=LOOP)
    assert codes == [0] * nodes, (tmp_path / "loop.node0.log").read_text()[-3000:]
    ref = single_process(tmp_path, nodes * per_node, corpus)
    assert all(m["aux_loss"] > 0.5 for m in ref)  # the router loss is in play
    out = json.loads((tmp_path / "losses.json").read_text())
    got = out["losses"]
    assert len(got) == STEPS
    # Token-centric (Janus's ratio is far below 1 here): rows crossed to node 1's experts,
    # each block in two chunks.
    assert out["figures"]["paradigm"] == {"0": "token", "1": "token", "2": "token"}
    said = [line for line in (tmp_path / "loop.node0.log").read_text().splitlines()
            if "paradigm: " in line]  # auto's choice, once per block, by rank 0
    assert len(said) == 3 and all(": token (Janus's ratio" in line for line in said), said
    assert out["figures"]["tokens_cross_bytes"] > 0
    # (the loop never restarts the counters: every step's, 2 chunks x 3 blocks x 2 passes)
    assert out["figures"]["pipeline_chunks"] == 2 * 3 * TRAIN["grad_accum"] * STEPS
    # Each block's second chunk's experts were fetched from the store while its first
    # chunk computed; per block, the counters add up to the step's.
    assert out["figures"]["pipeline_fetches_ahead"] == 3 * TRAIN["grad_accum"] * STEPS
    blocks = out["figures"]["pipeline_blocks"]
    assert sorted(blocks) == ["0", "1", "2"] and all(b["n"] == 2 for b in blocks.values())
    assert sum(b["bytes"] for b in blocks.values()) == out["figures"]["tokens_cross_bytes"]
    assert sum(b["chunks"] for b in blocks.values()) == out["figures"]["pipeline_chunks"]
    # MPMoE's pipelining: 2 and 4 chunks, and auto's choice, bit-identical to one chunk,
    # forward and backward; a chunk computed while another's exchange was in flight.
    probe = out["probe"]
    for setting, chunks in (("1", 0), ("2", 6), ("4", 12)):
        assert probe[setting]["same"] and probe[setting]["pipeline_chunks"] == chunks, setting
        assert (probe[setting]["pipeline_overlapped_s"] > 0) == (chunks > 0), setting
        assert probe[setting]["tokens_cross_bytes"] == probe["1"]["tokens_cross_bytes"]
        # chunk j+1's experts fetched while chunk j computed: n - 1 per block, 3 blocks
        assert probe[setting]["pipeline_fetches_ahead"] == 3 * max(0, chunks // 3 - 1), setting
    assert probe["auto1"]["same"] and probe["auto2"]["same"]
    assert set(probe["chosen"]) == {"0", "1", "2"}
    assert set(probe["chosen"].values()) <= {1, 2, 4}
    for a, b in zip(ref, got):
        assert abs(a["loss"] - b) < 1e-5, (a["loss"], b)
    assert min(step_counts(tmp_path / "node1")) < STEPS  # some expert missed the last step
    check_export(tmp_path, nodes)
    assert min(step_counts(tmp_path / "node1")) == STEPS  # caught up by the export
    check_weights(tmp_path, nodes, per_node)


def step_counts(store: Path) -> list[int]:
    """Every step count of the experts a node store's ranks trained."""
    from tierstore.hf.node_stores import owned_ranges

    with tierstore.open(store, host_cache=0) as st:
        return [int(c) for m in stored_model(st).experts for ids in owned_ranges(st, m.prefix)
                for c in st.get(f"{m.prefix}.owned{ids.start}-{ids.stop - 1}", "step")[ids]]


def check_export(tmp: Path, nodes: int) -> None:
    """``tierstore export-hf`` of node 0's store gathers the other nodes' experts from the
    stores ``--node-store`` names: ``from_pretrained`` of it computes the single process's
    logits. Node 0's store alone is refused in one line (its other experts are stale)."""
    def export(out: str, store: str, *more: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "tierstore", "export-hf", str(tmp / out),
                               "--store", str(tmp / store), *more], capture_output=True,
                              text=True, timeout=300)

    alone = export("alone", "node0")
    assert alone.returncode == 2 and len(alone.stderr.splitlines()) == 1, alone.stderr
    assert "name each with --node-store PATH" in alone.stderr
    for out, store, more in (("out", "node0", [f"node{i}" for i in range(1, nodes)]),
                             ("ref", "single", [])):
        done = export(out, store, *(x for n in more for x in ("--node-store", str(tmp / n))))
        assert done.returncode == 0, done.stderr[-2000:]
    ids = torch.randint(3, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    logits = []
    for out in ("out", "ref"):
        model = transformers.AutoModelForCausalLM.from_pretrained(tmp / out,
                                                                  dtype=torch.float32).eval()
        with torch.no_grad():
            logits.append(model(ids).logits)
    torch.testing.assert_close(logits[0], logits[1], atol=1e-4, rtol=0)


def same_steps(ref: list[dict[str, Any]], got: list[dict[str, Any]]) -> None:
    for m in got:
        a = ref[m["step"] - 1]
        for key in ("loss", "aux_loss", "grad_norm"):
            assert abs(a[key] - m[key]) < 1e-5, (m["step"], key, a[key], m[key])
        assert m["grad_norm"] > 2 * TRAIN["clip"]  # the clip scaled every gradient
        # Data-centric: experts came from the other rank and gradients went back; no rows.
        assert m["paradigm"] == {"1": "data", "2": "data"}
        assert m["experts_intra_bytes"] > 0 and m["grads_intra_bytes"] > 0
        assert m["tokens_intra_bytes"] == 0


def test_train_distributed_equals_one_process_through_a_kill_and_resume(
        corpus: Corpus, tokenizer_file: Path, tmp_path: Path) -> None:
    """DeepSeek-V3 (a shared expert, group-limited routing) by ``train_distributed`` (what
    ``tierstore train --distributed --store NODE_STORE`` runs) on one node of two ranks
    that share its store through the node's daemon, data-centric (the ranks pull the
    experts their tokens need), under the dense update rule (the default), a checkpoint
    every second step. Experts miss steps, so each rank catches its own up from its own
    history in the shared store, on fetch and before the checkpoint. Rank 1 is SIGKILLed in
    step 3 between its backward pass and the update: rank 0, blocked in the gradients'
    all-reduce, ends within the bound with one line naming rank 1; the store is
    fsck-clean. Steps 1-2, and the step that ``--resume`` runs from the step-2 checkpoint,
    equal the single process's, and so do the final weights."""
    nodes, per_node = 1, 2
    # 16 routed experts: with 8, this batch reaches every expert in every step.
    prepare("deepseek_v3", tmp_path, nodes, tokenizer_file, n_routed_experts=16)
    spec = {"model": None, "train": {**TRAIN, "batch_size": 1}, "corpus_bytes": CORPUS_BYTES,
            "host_cache": 4 << 20}
    codes = launch(tmp_path, "a", nodes, per_node, steps=STEPS, checkpoint_every=2,
                   kill=["backward", 3, 1], spec=spec, paradigm="data")
    ended = time.time()
    assert codes != [0], (tmp_path / "a.node0.log").read_text()[-3000:]
    # Rank 1 died right after step 2's line: within the bound of that.
    assert ended - (tmp_path / "a.jsonl.rank1").stat().st_mtime < BOUND_S
    assert rank_stderr(tmp_path, "a", 0, per_node) == [
        "tierstore: rank 0: stopped because rank 1 (node 0) ended without a word (killed, or "
        "out of memory: its node's torchrun output says which); rerun with --resume to "
        "continue from the last complete checkpoint"]
    stop_daemons(tmp_path)
    with tierstore.open(tmp_path / "node0", host_cache=0) as st:
        assert st.fsck().ok
    assert launch(tmp_path, "b", nodes, per_node, steps=STEPS, resume=True, spec=spec,
                  paradigm="data") == [0]
    ref = single_process(tmp_path, nodes * per_node, corpus)
    with tierstore.open(tmp_path / "node0", host_cache=0) as st:
        sm = stored_model(st)
        n = sm.experts[0].num_experts
        owned = len(sm.experts) * n // (nodes * per_node)  # per rank, over the MoE layers
        # One history per rank, beside its step counts; none under the single process's name.
        assert sorted(st.names("trainer.dense_rule")) == [
            f"trainer.dense_rule.owned{lo}-{lo + n // 2 - 1}" for lo in (0, n // 2)]
    runs = []
    for r in range(nodes * per_node):
        first, resumed = metrics(tmp_path, "a", r), metrics(tmp_path, "b", r)
        assert [m["step"] for m in first] == [1, 2]
        assert [m["step"] for m in resumed] == [3]
        same_steps(ref, first + resumed)
        runs += first + resumed
    # Under the dense rule every fetched expert is updated: fewer than a rank owns means
    # some expert missed a step and was caught up later.
    assert any(m["experts_touched"] < owned for m in runs)
    check_weights(tmp_path, nodes, per_node)


# The command line's own settings for a fine-tune (the CLI has no clip or schedule options).
CLI_TRAIN = {"seq_len": 8, "grad_accum": 2, "lr": 1e-4, "eval_every": 0}


def cli_run(tmp: Path, name: str, nodes: int, *args: str) -> list[subprocess.Popen[bytes]]:
    """``torchrun ... -m tierstore train --distributed`` on ``nodes`` nodes of one rank,
    node ``i`` on store ``tmp/node{i}``, with ``CLI_TRAIN``."""
    port, procs = _port(), []
    for i in range(nodes):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nodes),
               "--node-rank", str(i), "--nproc-per-node", "1", "--master-addr", "127.0.0.1",
               "--master-port", str(port), "--log-dir", str(tmp / f"{name}.logs" / f"node{i}"),
               "--redirects", "3", "-m", "tierstore", "train", "--distributed", "--store",
               str(tmp / f"node{i}"), "--metrics", str(tmp / f"{name}.jsonl"), "--steps",
               str(STEPS), "--seed", str(SEED), "--batch-size", "1", "--seq-len", "8",
               "--grad-accum", "2", "--lr", "1e-4", "--eval-every", "0", "--corpus-max-bytes",
               str(CORPUS_BYTES), "--host-cache", "4MiB", "--checkpoint-every", "1", *args]
        with open(tmp / f"{name}.agent{i}.log", "w") as log:
            procs.append(subprocess.Popen(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"},
                                          stdout=log, stderr=subprocess.STDOUT))
    return procs


def test_a_killed_daemon_ends_every_rank_and_the_run_resumes(
        corpus: Corpus, tokenizer_file: Path, tmp_path: Path) -> None:
    """``tierstore train --distributed`` fine-tuning DeepSeek-V3 on two nodes of one rank
    (the dense rule, a checkpoint every step, ``--paradigm auto``: token-centric here).
    Node 1's store daemon is SIGKILLed once step 1 is done: both ranks end within the
    bound, each with one line naming node 1's daemon; every store is fsck-clean, and
    ``--resume`` (which starts node 1 a new daemon), its blocks in ``--pipeline 2``
    chunks, gives every step and weight of the single process."""
    nodes = 2
    prepare("deepseek_v3", tmp_path, nodes, tokenizer_file)
    agents = cli_run(tmp_path, "a", nodes, "--failure-timeout", "30")
    try:
        done = tmp_path / "a.jsonl.rank1"
        deadline = time.monotonic() + 300
        while not (done.exists() and done.read_text().count("\n") >= 1):
            assert all(p.poll() is None for p in agents), \
                (tmp_path / "a.agent1.log").read_text()[-3000:]
            assert time.monotonic() < deadline
            time.sleep(0.05)
        info = tierstore.probe_daemon(tmp_path / "node1.run" / "daemon.sock")
        assert info is not None
        os.kill(info["pid"], signal.SIGKILL)
        killed = time.monotonic()
        codes = [p.wait(timeout=BOUND_S + 60) for p in agents]
        ended = time.monotonic()
    finally:
        for p in agents:
            if p.poll() is None:
                p.kill()
    assert codes[0] != 0 and codes[1] != 0
    assert ended - killed < BOUND_S
    run1 = tmp_path / "node1.run"
    lost = (f"rank 1 (node 1) failed: node 1's store daemon (process {info['pid']}, "
            f"{run1 / 'daemon.sock'}) ended while the run used it (killed, or out of memory; "
            f"its log: {run1 / 'daemon.log'}); a resumed run starts a new one; once that is "
            "fixed, rerun with --resume to continue from the last complete checkpoint")
    assert rank_stderr(tmp_path, "a", 1, 1) == [f"tierstore: {lost}"]
    assert rank_stderr(tmp_path, "a", 0, 1) == [f"tierstore: rank 0: stopped because {lost}"]
    stop_daemons(tmp_path)
    for i in range(nodes):
        with tierstore.open(tmp_path / f"node{i}", host_cache=0) as st:
            assert st.fsck().ok
    resumed = cli_run(tmp_path, "b", nodes, "--resume", "--pipeline", "2")
    assert [p.wait(timeout=500) for p in resumed] == [0, 0], \
        (tmp_path / "b.agent0.log").read_text()[-3000:]
    ref = train_store(None, STEPS, seed=SEED, corpus=corpus, store_path=tmp_path / "single",
                      host_cache="4MiB", train=TrainConfig(batch_size=nodes, **CLI_TRAIN))
    for r in range(nodes):
        first, then = metrics(tmp_path, "a", r), metrics(tmp_path, "b", r)
        assert then and then[-1]["step"] == STEPS
        got = {m["step"]: m for m in first + then}  # a step run twice: the resumed one
        assert sorted(got) == list(range(1, STEPS + 1))
        for step, m in got.items():
            for key in ("loss", "aux_loss", "grad_norm"):
                assert abs(ref[step - 1][key] - m[key]) < 1e-5, (step, key)
            # Janus's ratio is far below 1 for these experts and batch: tokens travel.
            assert m["paradigm"] == {"1": "token", "2": "token"}
        for m in then:  # every token-centric block in two chunks
            assert {b["n"] for b in m["pipeline_blocks"].values()} == {2}
    check_weights(tmp_path, nodes, 1)


# Each family, every paradigm under every rule at W = 4; at W = 2 the lazy rule (the tests
# above run W = 2 under the dense one: Mixtral token-centric, DeepSeek-V3 both ways).
@pytest.mark.slow
@pytest.mark.parametrize("family", ["mixtral", "deepseek_v3"])
@pytest.mark.parametrize(("per_node", "paradigm", "rule"), [
    (2, "token", "dense"), (2, "token", "lazy"), (2, "data", "dense"), (2, "data", "lazy"),
    (1, "token", "lazy"), (1, "data", "lazy")])
def test_two_nodes_equal_one_process(per_node: int, paradigm: str, rule: str, family: str,
                                     corpus: Corpus, tokenizer_file: Path,
                                     tmp_path: Path) -> None:
    """Two nodes of ``per_node`` ranks (W = 2 or 4), each node its own store and daemon (by
    ``train_distributed``), in either paradigm, under either update rule."""
    nodes = 2
    prepare(family, tmp_path, nodes, tokenizer_file)
    spec = {"model": None, "train": {**TRAIN, "batch_size": 1, "update_rule": rule},
            "corpus_bytes": CORPUS_BYTES, "host_cache": 4 << 20}
    codes = launch(tmp_path, "run", nodes, per_node, steps=STEPS, spec=spec, paradigm=paradigm)
    assert codes == [0] * nodes, (tmp_path / "run.node0.log").read_text()[-3000:]
    ref = single_process(tmp_path, nodes * per_node, corpus, rule)
    runs = [metrics(tmp_path, "run", r) for r in range(nodes * per_node)]
    for got in runs:
        assert [m["step"] for m in got] == list(range(1, STEPS + 1))
        for m in got:
            a = ref[m["step"] - 1]
            for key in ("loss", "aux_loss", "grad_norm"):
                assert abs(a[key] - m[key]) < 1e-5, (m["step"], key, a[key], m[key])
            assert set(m["paradigm"].values()) == {paradigm}
    moved = "experts" if paradigm == "data" else "tokens"
    for step in range(STEPS):  # each step, something crossed between the nodes
        assert sum(got[step][f"{moved}_cross_bytes"] for got in runs) > 0
    check_weights(tmp_path, nodes, per_node)


# fp32 compute (a bf16 checkpoint's default is bf16 autocast, far coarser than 1e-5)
COMPACT_TRAIN = {**TRAIN, "dtype": "float32"}
COMPACT_SPEC = {"model": None, "train": {**COMPACT_TRAIN, "batch_size": 1},
                "corpus_bytes": CORPUS_BYTES, "host_cache": 4 << 20}


@pytest.fixture(scope="module")
def compact(tokenizer_file: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """DeepSeek-V3 shipped in block FP8 (experts and dense weights packed), imported compact
    (``packed``, kept as imported; ``single``; ``start``, made trainable by one process:
    the starting masters) and fine-tuned by ``train_distributed`` on one node of two ranks
    sharing ``node0`` (run ``a``, data-centric): the W = 2 run the tests below compare with."""
    from hf_quant import deepseek_fp8

    tmp = tmp_path_factory.mktemp("compact")
    ckpt = deepseek_fp8(tmp / "hf", spread=True, vocab_size=VOCAB)
    shutil.copy(tokenizer_file, ckpt / "tokenizer.json")
    tierstore.hf.import_hf(ckpt, tmp / "packed", progress=False)
    for path in ("node0", "single", "start"):
        shutil.copytree(tmp / "packed", tmp / path)
    tierstore.hf.load(tmp / "start", trainable=True, device="cpu").tierstore.close()
    try:
        codes = launch(tmp, "a", 1, 2, steps=STEPS, spec=COMPACT_SPEC, paradigm="data")
        assert codes == [0], (tmp / "a.node0.log").read_text()[-3000:]
        yield tmp
    finally:
        stop_daemons(tmp)
        shutil.rmtree(tmp, ignore_errors=True)


def test_ranks_unpack_a_quantized_store_and_train_as_one_process(compact: Path,
                                                                 corpus: Corpus) -> None:
    """The two ranks of ``compact``'s run turn the packed weights into fp32 masters at the
    first trainable load (each its own experts, the node leader the dense ones, one
    commit), and every step and weight equals the single process's fine-tune of the same
    compact store."""
    nodes, per_node = 1, 2
    ref = train_store(None, STEPS, seed=SEED, corpus=corpus, store_path=compact / "single",
                      host_cache="4MiB",
                      train=TrainConfig(batch_size=nodes * per_node, **COMPACT_TRAIN))
    for r in range(nodes * per_node):
        got = metrics(compact, "a", r)
        assert [m["step"] for m in got] == list(range(1, STEPS + 1))
        for m in got:
            a = ref[m["step"] - 1]
            for key in ("loss", "grad_norm"):
                assert abs(a[key] - m[key]) < 1e-5, (r, m["step"], key, a[key], m[key])
            assert m["grad_norm"] > 2 * TRAIN["clip"]  # the clip scaled every gradient
    with tierstore.open(compact / "node0", host_cache=0) as st:
        sm = stored_model(st)
        assert sm.quant == "fp8" and not sm.dense_scales and sm.requantize
        assert not [n for n in st.names() if n.endswith("_scale_inv")]
    check_weights(compact, nodes, per_node)


def test_a_kill_of_either_rank_while_unpacking_leaves_the_store_sound(compact: Path,
                                                                     tmp_path: Path) -> None:
    """The ranks' unpack of ``compact``'s packed import, SIGKILLed on either side of its
    commit. Rank 1 killed at its second write of masters (before the first barrier): rank
    0 ends within the bound with one line naming rank 1; the store is fsck-clean and still
    the packed import (``model.json`` as imported, the masters written so far named by
    nothing). Rerun with ``--resume``, as that line says, the node leader killed right
    after its commit (the packed entries not yet dropped): rank 1 ends naming rank 0; the
    store is fsck-clean and its model names the masters. Rerun again, the run completes:
    every step and weight equals ``compact``'s run, which was never killed, and no packed
    entry is left."""
    store = tmp_path / "node0"
    shutil.copytree(compact / "packed", store)
    imported = model_json(store)
    killed = [("a", ["masters", 2, 1], 0), ("b", ["named", 1, 0], 1)]
    for name, kill, survivor in killed:
        codes = launch(tmp_path, name, 1, 2, steps=STEPS, resume=name != "a",
                       spec=COMPACT_SPEC, kill=kill, paradigm="data")
        ended = time.time()
        assert codes != [0], (tmp_path / f"{name}.node0.log").read_text()[-3000:]
        assert ended - (tmp_path / f"{name}.jsonl.killed").stat().st_mtime < BOUND_S
        assert rank_stderr(tmp_path, name, survivor, 2) == [
            f"tierstore: rank {survivor}: stopped because rank {kill[2]} (node 0) ended "
            "without a word (killed, or out of memory: its node's torchrun output says "
            "which); rerun with --resume to continue from the last complete checkpoint"]
        stop_daemons(tmp_path)
        with tierstore.open(store, host_cache=0) as st:
            assert st.fsck().ok, name
            masters = [n for n in st.names() if n.endswith("_fp32")]
            packed = [n for n in st.names() if n.endswith("_scale_inv")]
        assert masters and packed, name  # killed with masters written, packed ones kept
        if name == "a":
            assert model_json(store) == imported
        else:
            sm = stored_model_of(store)
            assert not sm.dense_scales and not any(m.formats for m in sm.experts)
            assert set(sm.dense.values()) & set(masters)
    assert launch(tmp_path, "c", 1, 2, steps=STEPS, resume=True, spec=COMPACT_SPEC,
                  paradigm="data") == [0], (tmp_path / "c.node0.log").read_text()[-3000:]
    for r in range(2):
        got, want = metrics(tmp_path, "c", r), metrics(compact, "a", r)
        assert [m["step"] for m in got] == list(range(1, STEPS + 1))
        for a, m in zip(want, got):
            for key in ("loss", "grad_norm"):
                assert abs(a[key] - m[key]) < 1e-5, (r, m["step"], key, a[key], m[key])
    want, got = weights(compact / "node0"), weights(store)
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        torch.testing.assert_close(got[name], t, atol=1e-5, rtol=0, msg=name)
    with tierstore.open(store, host_cache=0) as st:
        assert st.fsck().ok
        names = set(st.names())
    # no packed entry left: neither scales nor a packed weight beside its master
    assert not [n for n in names if n.endswith("_scale_inv") or n + "_fp32" in names]


def model_json(store: Path) -> bytes:
    with tierstore.open(store, host_cache=0) as st:
        return bytes(st.get(*MODEL_ENTRY).numpy().tobytes())


def stored_model_of(store: Path) -> Any:
    with tierstore.open(store, host_cache=0) as st:
        return stored_model(st)


def test_a_presets_exchange_options_are_refused_for_an_imported_model(
        tokenizer_file: Path, tmp_path: Path) -> None:
    """``--credits`` and ``--hierarchical-a2a`` shape a preset's exchanges; given for an
    imported model they end the run with one line instead of being ignored."""
    prepare("mixtral", tmp_path, 1, tokenizer_file)
    (agent,) = cli_run(tmp_path, "r", 1, "--credits", "1", "--hierarchical-a2a")
    assert agent.wait(timeout=300) != 0
    assert rank_stderr(tmp_path, "r", 0, 1) == [
        "tierstore: --credits and --hierarchical-a2a shape a preset's exchanges; an imported "
        "model's blocks take neither"]
