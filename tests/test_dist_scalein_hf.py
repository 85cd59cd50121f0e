"""Resuming an imported model's expert-parallel fine-tune on fewer nodes and ranks
(``--node-store``), under torchrun with gloo, as tests/test_dist_finetune_hf.py runs it.

- 2 nodes of one rank -> 1 node of one rank: without the departing store named, one line
  says to name it; with it (a copy of its directory), every expert state the departing node
  trained lands in the remaining store bit for bit (weights, both moments, step counts), the
  remaining rank gets the dense rule's history of the old ranks (equal at the checkpoint)
  under its own name and the old ranks' are gone, the departing store is left as its
  checkpoint had it, and training continues under the dense rule equal to the single
  process's run (per-step losses and final weights within 1e-5), with 16 experts so that
  some miss a step after the move and are caught up from the moved history.
- A departing store with a damaged state: the move stops with one line naming the entry.
- Old ranks' histories that differ (stores of different checkpoints) are refused in one line.
- ``tierstore.hf.load(node_store, trainable=True)`` without a process group: refused in one
  line naming the missing experts while node 0's store holds half of them; after the
  scale-in, which gives it all, it loads, the ranks' counts and history merged under the
  store-wide names and every state as trained.
- RNG streams across the move (attention dropout on, so every step draws from torch's
  generator): the new rank continues old rank 0's streams (the checkpoint taken right after
  the move holds them), and the same resume run again gives the same losses. The data order
  after the move is the uninterrupted run's: the first case's losses equal the single
  process's on the same global batches.
- 2 nodes of two ranks -> 1 node of two ranks (``slow``): the same, the departing store
  read through a daemon started again on it, through a SIGKILL in the middle of the move
  and a rerun of the same command.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import test_finetune_hf
import torch
from test_dist_finetune_hf import (
    CORPUS_BYTES,
    STEPS,
    TRAIN,
    check_weights,
    prepare,
    single_process,
)
from test_dist_train import launch, metrics, rank_stderr, stop_daemons
from test_store_corruption import flip_byte
from tierstore.hf.layout import stored_model
from tierstore.hf.node_stores import owned_ranges
from tierstore.trainer.dist.hf_reshard import agreed_history
from tierstore.trainer.dist.world import AgreedError
from tierstore.trainer.train.checkpoint import DENSE_ENTRY, unpack
from tierstore.trainer.train.data import Corpus

import tierstore

pytestmark = pytest.mark.timeout(600)
corpus = test_finetune_hf.corpus
tokenizer_file = test_finetune_hf.tokenizer_file
KINDS = ("param", "exp_avg", "exp_avg_sq")


@pytest.fixture(autouse=True)
def _no_daemon_left(tmp_path: Path) -> Any:
    yield
    stop_daemons(tmp_path)


def trained_states(path: Path, tag: str | None = None) -> dict[Any, torch.Tensor]:
    """Every state of the experts a node store trained (its ranks' step-count entries say
    which): each part's master and moments, and each expert's step count. ``tag``: as that
    snapshot holds them (restored first)."""
    out: dict[Any, torch.Tensor] = {}
    with tierstore.open(path, host_cache=0) as st:
        if tag is not None:
            st.restore(tag)
        for m in stored_model(st).experts:
            # A node store loaded by one process keeps its counts under the store-wide name.
            spans = [(f"{m.prefix}.owned{ids.start}-{ids.stop - 1}", ids)
                     for ids in owned_ranges(st, m.prefix)] or [(m.prefix, range(m.num_experts))]
            for name, ids in spans:
                steps = st.get(name, "step")
                for e in ids:
                    out[(m.prefix, e, "step")] = steps[e].clone()
                    keys = [(f"{m.prefix}.{e}.{part}", k) for _, parts in m.params
                            for part in parts for k in KINDS]
                    out.update(st.get_many(keys))
        assert st.fsck().ok
    return out


def serve(tmp: Path, node: int) -> subprocess.Popen[bytes]:
    """A daemon started again on node ``node``'s store, where a run would have it."""
    sock = tmp / f"node{node}.run" / "daemon.sock"
    proc = subprocess.Popen([sys.executable, "-m", "tierstore", "serve", "--store",
                             str(tmp / f"node{node}"), "--socket", str(sock), "--host-cache",
                             "4MiB"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while tierstore.probe_daemon(sock) is None:
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.1)
    return proc


def scale_in(tmp: Path, corpus: Corpus, tokenizer_file: Path, before: tuple[int, int],
             after: tuple[int, int], reach: str, kill: list[Any] | None = None) -> None:
    """Fine-tune Mixtral for one step on ``before`` (nodes, ranks per node), resume on
    ``after`` (one node) with the departing stores named, and check the states landed
    unchanged and that training went on as the single process's. ``reach``: how the
    departing stores are named: ``copy`` (a copy of each store directory) or ``daemon``
    (each store's own path, served by a daemon started again)."""
    (nodes, per_node), (new_nodes, new_per_node) = before, after
    global_batch = nodes * per_node
    # 16 experts: with 8, this batch reaches every expert in every step (no catch-up).
    prepare("mixtral", tmp, nodes, tokenizer_file, num_local_experts=16)
    spec = {"model": None, "train": {**TRAIN, "batch_size": 1}, "corpus_bytes": CORPUS_BYTES,
            "host_cache": 4 << 20}
    assert launch(tmp, "a", nodes, per_node, steps=1, checkpoint_every=1,
                  spec=spec) == [0] * nodes, (tmp / "a.node0.log").read_text()[-3000:]
    trained = [trained_states(tmp / f"node{i}") for i in range(nodes)]
    old = {}  # every old rank's dense-rule history, cut at the checkpoint (global step 1)
    for i in range(nodes):
        old.update(histories(tmp / f"node{i}"))
    assert len(old) == nodes * per_node
    assert all(h.tolist() == [[1.0, 0.0, 0.0, 0.0, 0.0]] for h in old.values()), old
    assert len({k[1] for k in trained[1] if len(k) == 3}) > 0  # node 1 trained some
    # Node 0's store alone, loaded by one process: refused in one line naming the experts
    # other stores trained, and left as it was (not made trainable again from the import).
    with pytest.raises(tierstore.StoreError) as e:
        tierstore.hf.load(tmp / "node0", trainable=True, host_cache="4MiB")
    assert "\n" not in str(e.value), e.value
    assert "experts 8-15 of model.layers.0.mlp.experts were trained in other nodes' " in str(
        e.value) and "process_group=" in str(e.value), e.value
    assert_same(trained_states(tmp / "node0"), trained[0])
    departing = [tmp / f"node{i}" for i in range(new_nodes, nodes)]
    if reach == "copy":
        for i, path in enumerate(departing):
            shutil.copytree(path, tmp / f"copy{i}")
        departing = [tmp / f"copy{i}" for i in range(len(departing))]
    else:
        daemons = [serve(tmp, i) for i in range(new_nodes, nodes)]

    spec = {**spec, "train": {**TRAIN, "batch_size": global_batch // (new_nodes * new_per_node)}}
    if kill is None:
        # Not named: one line on every rank, naming what to pass; nothing changed.
        assert launch(tmp, "x", new_nodes, new_per_node, steps=STEPS, resume=True,
                      spec=spec) != [0]
        for r in range(new_per_node):
            (line,) = rank_stderr(tmp, "x", r, new_per_node)
            assert line.startswith("tierstore: checkpoint 1 (step 1) was taken on 2 nodes and "
                                   "node 1's store"), line
            assert line.endswith("name where that store is reachable with --node-store PATH "
                                 "(a shared path, or a copy of its directory)"), line
        if reach == "copy":
            # A departing state damaged on disk: the move stops at it with the store's one
            # line naming it, and the remaining store is still sound (the resume below
            # restores its checkpoint first, so nothing moved before the damage counts).
            bad = tmp / "bad"
            shutil.copytree(departing[0], bad)
            name, kind = max(k for k in trained[1] if len(k) == 2)
            with tierstore.open(bad, host_cache=0) as st:
                flip_byte(st.info(name, kind), 5)
            spec_bad = {**spec, "node_stores": [str(bad)]}
            assert launch(tmp, "y", new_nodes, new_per_node, steps=STEPS, resume=True,
                          spec=spec_bad) != [0]
            (line,) = rank_stderr(tmp, "y", 0, new_per_node)
            assert f"entry {name!r} (kind {kind!r}) is corrupt" in line, line
            stop_daemons(tmp)
            with tierstore.open(tmp / "node0", host_cache=0) as st:
                assert st.fsck().ok
    else:
        # Killed mid-move: the other rank ends with one line, and every store is fsck-clean.
        spec_k = {**spec, "node_stores": [str(p) for p in departing]}
        assert launch(tmp, "k", new_nodes, new_per_node, steps=STEPS, resume=True,
                      spec=spec_k, kill=kill) != [0]
        for r in range(new_per_node):
            if r != kill[2]:
                (line,) = rank_stderr(tmp, "k", r, new_per_node)
                assert f"rank {kill[2]} (node 0) ended without a word" in line, line
        stop_daemons(tmp)
        for i in range(nodes):
            with tierstore.open(tmp / f"node{i}", host_cache=0) as st:
                assert st.fsck().ok
        if reach == "daemon":
            daemons = [serve(tmp, i) for i in range(new_nodes, nodes)]
    spec["node_stores"] = [str(p) for p in departing]
    assert launch(tmp, "b", new_nodes, new_per_node, steps=STEPS, resume=True,
                  spec=spec) == [0] * new_nodes, (tmp / "b.node0.log").read_text()[-3000:]
    if reach == "daemon":
        stop_daemons(tmp)
        assert all(d.wait(timeout=60) == 0 for d in daemons)

    ref = single_process(tmp, global_batch, corpus)  # the dense rule's
    for r in range(nodes * per_node):
        assert [m["step"] for m in metrics(tmp, "a", r)] == [1]
    new_size = new_nodes * new_per_node
    with tierstore.open(tmp / "node0", host_cache=0) as st:
        owns = len(stored_model(st).experts) * 16 // new_size  # per rank, over the layers
    behind = False
    for r in range(new_size):
        got = metrics(tmp, "b", r)
        assert [m["step"] for m in got] == list(range(2, STEPS + 1))
        # Fewer experts updated than the rank owns: some missed a step after the move, and
        # were caught up (when next fetched, or before the final checkpoint) from the
        # history the move gave this rank.
        behind |= any(m["experts_touched"] < owns for m in got)
        for m in metrics(tmp, "a", 0) + got:
            a = ref[m["step"] - 1]
            for key in ("loss", "aux_loss", "grad_norm"):
                assert abs(a[key] - m[key]) < 1e-5, (m["step"], key, a[key], m[key])
    assert behind
    check_weights(tmp, new_nodes, new_per_node)
    # The departing stores are as their checkpoint left them: nothing lost there.
    for i, path in enumerate(departing):
        assert_same(trained_states(path), trained[new_nodes + i])
    # The checkpoint taken right after the move (number 2, kept beside the final one)
    # holds every node's trained states, bit for bit, under the new ranks' count entries.
    want = {k: v for states in trained for k, v in states.items()}
    assert_same(trained_states(tmp / "node0", "dist-000002"), want)
    # ... and each new rank's dense-rule history, the old ranks' one, under its own name.
    n = 16 // new_size
    assert_same(histories(tmp / "node0", "dist-000002"),
                {f"trainer.dense_rule.owned{r * n}-{r * n + n - 1}": old[min(old)]
                 for r in range(new_size)})
    # Now node 0's store holds every expert: loaded by one process it becomes a single
    # process's fine-tune of the states trained, its ranks' counts and (equal) histories
    # under the store-wide names.
    final, kept = trained_states(tmp / "node0"), histories(tmp / "node0")
    assert len(kept) == new_size and len({str(h.tolist()) for h in kept.values()}) == 1
    tierstore.hf.load(tmp / "node0", trainable=True, host_cache="4MiB").tierstore.close()
    assert_same(trained_states(tmp / "node0"), final)
    assert_same(histories(tmp / "node0"), {"trainer.dense_rule": next(iter(kept.values()))})


def test_scale_in_continues_the_rng_streams(corpus: Corpus, tokenizer_file: Path,
                                            tmp_path: Path) -> None:
    """2 nodes of one rank -> 1 node of one rank with dropout: the new rank resumes with
    old rank 0's RNG states, and the resume is the same run whenever it is made."""
    tmp = tmp_path
    prepare("mixtral", tmp, 2, tokenizer_file, attention_dropout=0.5)
    spec = {"model": None, "train": {**TRAIN, "batch_size": 1}, "corpus_bytes": CORPUS_BYTES,
            "host_cache": 4 << 20}
    assert launch(tmp, "a", 2, 1, steps=1, checkpoint_every=1, spec=spec) == [0, 0]
    stop_daemons(tmp)
    keep = tmp / "keep"  # node 0 as the checkpoint left it, to resume from twice
    for name in ("node0", "node0.run"):
        shutil.copytree(tmp / name, keep / name, ignore=shutil.ignore_patterns("*.sock"))
    shutil.copytree(tmp / "node1", tmp / "copy1")
    spec = {**spec, "train": {**TRAIN, "batch_size": 2}, "node_stores": [str(tmp / "copy1")]}
    runs = []
    for name in ("b", "c"):
        for d in ("node0", "node0.run"):
            shutil.rmtree(tmp / d)
            shutil.copytree(keep / d, tmp / d)
        assert launch(tmp, name, 1, 1, steps=STEPS, resume=True, spec=spec) == [0], (
            (tmp / f"{name}.node0.log").read_text()[-3000:])
        stop_daemons(tmp)
        runs.append([(m["step"], m["loss"], m["aux_loss"], m["grad_norm"])
                     for m in metrics(tmp, name, 0)])
        # The checkpoint taken right after the move holds the RNG states rank 0 began with.
        old, new = (dense(path, tag) for path, tag in ((keep / "node0", "dist-000001"),
                                                       (tmp / "node0", "dist-000002")))
        assert len(old["rng"]) == 2 and len(new["rng"]) == 1 and new["step"] == 1
        assert torch.equal(new["rng"][0]["torch"], old["rng"][0]["torch"])
        assert new["rng"][0]["python"] == old["rng"][0]["python"]
    assert [s for s, *_ in runs[0]] == list(range(2, STEPS + 1))
    assert runs[0] == runs[1]


def dense(path: Path, tag: str) -> dict[str, Any]:
    """The dense state (RNG states among it) that snapshot ``tag`` of a store holds."""
    with tierstore.open(path, host_cache=0) as st:
        st.restore(tag)
        return unpack(st.get(*DENSE_ENTRY))


def histories(path: Path, tag: str | None = None) -> dict[str, torch.Tensor]:
    """The dense rule's histories a store holds, by entry name (``tag``: that snapshot's)."""
    with tierstore.open(path, host_cache=0) as st:
        if tag is not None:
            st.restore(tag)
        return {name: st.get(name, "steps") for name in st.names("trainer.dense_rule")}


def assert_same(got: dict[Any, torch.Tensor], want: dict[Any, torch.Tensor]) -> None:
    assert sorted(map(str, got)) == sorted(map(str, want))
    for k, t in want.items():
        assert got[k].dtype == t.dtype and torch.equal(got[k], t), k


def test_two_nodes_resume_on_one(corpus: Corpus, tokenizer_file: Path,
                                 tmp_path: Path) -> None:
    """2 nodes of one rank -> 1 node of one rank, node 1's store named by a copy of its
    directory (module docstring)."""
    scale_in(tmp_path, corpus, tokenizer_file, (2, 1), (1, 1), "copy")


def test_old_ranks_histories_that_differ_are_refused() -> None:
    """The move's check of the old ranks' dense-rule histories (read from every store of
    the checkpoint): equal ones are the new ranks', a lazy run has none, and two that
    differ, or one missing, are one line."""
    cut = [[2.0, 0.0, 0.0, 0.0, 0.0]]
    assert agreed_history({0: cut, 1: cut, 2: cut}, "checkpoint 2") == cut
    assert agreed_history({0: None, 1: None}, "checkpoint 2") is None
    for other in ([[1.0, 0.0, 0.0, 0.0, 0.0]], [*cut, [1e-4, 0.9, 0.95, 1e-8, 0.0]], None):
        with pytest.raises(AgreedError) as e:
            agreed_history({0: cut, 1: other}, "checkpoint 2 (step 2)")
        assert "\n" not in str(e.value) and "rank 0 (at global step 2) and of rank 1" in str(e.value)


@pytest.mark.slow
def test_four_ranks_resume_on_two_through_a_kill(corpus: Corpus, tokenizer_file: Path,
                                                 tmp_path: Path) -> None:
    """2 nodes of two ranks -> 1 node of two ranks, node 1's store read through a daemon
    started again on it; rank 0 SIGKILLed after writing its second moved expert, then the
    same command again."""
    scale_in(tmp_path, corpus, tokenizer_file, (2, 2), (1, 2), "daemon",
             kill=["moved", 2, 0])
