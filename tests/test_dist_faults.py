"""A distributed run whose rank fails: every rank ends within a bounded time with one line on
its stderr naming the rank or node that failed and saying to rerun with --resume, never
gloo's traceback; checkpoint manifests validated as a whole.

Each run is `torchrun -m tierstore train --distributed` as a user runs it, one torchrun agent
per "node" on this machine, with torchrun's `--log-dir ... --redirects 3` keeping every
rank's stderr in a file of its own:

- a rank stopped (SIGSTOP), silent past ``--failure-timeout``;
- a rank SIGKILLed mid-run by the test (the re-shard campaign in test_dist_train.py kills
  others, rank 0 among them);
- node 1's store running out of space mid-run (a PMem store whose pool file cannot grow);
- an incomplete latest checkpoint (falling back is said, and the result equals the run that
  went on), and a manifest naming a snapshot its node's store does not hold.

The manifest checks themselves are table-driven over many malformed manifests
(:func:`tierstore.trainer.dist.manifests.validate`), without processes.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from test_dist_train import _port, rank_stderr, stop_daemons  # noqa: E402 (shared harness)
from tierstore.trainer.dist import manifests

import tierstore

pytestmark = pytest.mark.timeout(900)
BOUND_S = 90.0  # every rank ends this soon after the failure (gloo alone: its 10 min timeout)
ARGS = ["--model", "tiny", "--seq-len", "32", "--corpus-max-bytes", "256KiB", "--eval-every",
        "0", "--seed", "3", "--lr", "3e-3"]


class Run:
    """One `torchrun ... -m tierstore train --distributed` run: ``nodes`` agents of
    ``per_node`` ranks, node ``i``'s store ``tmp/node{i}``."""

    def __init__(self, tmp: Path, name: str, nodes: int, per_node: int, *args: str,
                 file_limits: dict[int, int] | None = None) -> None:
        self.tmp, self.name, self.nodes, self.per_node = tmp, name, nodes, per_node
        port = _port()
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        self.agents = []
        for i in range(nodes):
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nodes),
                   "--node-rank", str(i), "--nproc-per-node", str(per_node), "--master-addr",
                   "127.0.0.1", "--master-port", str(port), "--log-dir",
                   str(tmp / f"{name}.logs" / f"node{i}"), "--redirects", "3",
                   "-m", "tierstore", "train", "--distributed", "--store", str(tmp / f"node{i}"),
                   "--metrics", str(tmp / f"{name}.jsonl"),
                   "--batch-size", str(4 // (nodes * per_node)), *ARGS, *args]
            limit = (file_limits or {}).get(i)
            with open(tmp / f"{name}.agent{i}.log", "w") as log:
                self.agents.append(subprocess.Popen(
                    cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                    preexec_fn=None if limit is None else lambda n=limit: _limit_files(n)))

    def wait(self, timeout: float = 600) -> list[int]:
        return [a.wait(timeout=timeout) for a in self.agents]

    def wait_for_step(self, rank: int, step: int = 1, timeout: float = 300) -> None:
        path = self.tmp / f"{self.name}.jsonl.rank{rank}"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if path.exists() and len(path.read_text().splitlines()) >= step:
                return
            assert all(a.poll() is None for a in self.agents), self.agent_log(0)
            time.sleep(0.2)
        raise AssertionError(f"rank {rank} did not reach step {step}")

    def pid_of(self, rank: int) -> int:
        """The process of global rank ``rank`` (a child of its node's agent)."""
        agent = self.agents[rank // self.per_node].pid
        for task in Path(f"/proc/{agent}/task").iterdir():
            for child in (task / "children").read_text().split():
                env = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
                if f"RANK={rank}".encode() in env:
                    return int(child)
        raise AssertionError(f"no process of rank {rank}")

    def stderr(self, rank: int) -> list[str]:
        return rank_stderr(self.tmp, self.name, rank, self.per_node)

    def agent_log(self, node: int) -> str:
        return (self.tmp / f"{self.name}.agent{node}.log").read_text()[-3000:]

    def one_line_each(self, *needles: str) -> dict[int, str]:
        """Every rank's stderr is one `tierstore:` line holding ``needles``: no traceback."""
        lines = {}
        for r in range(self.nodes * self.per_node):
            got = self.stderr(r)
            assert len(got) == 1 and got[0].startswith("tierstore: "), (r, got[:8])
            for n in needles:
                assert n in got[0], (r, n, got[0])
            lines[r] = got[0]
        return lines


def _limit_files(nbytes: int) -> None:
    """No file of this process tree (the node's ranks and the daemon they start) may grow
    past ``nbytes``: writes beyond fail with EFBIG, as on a full disk (Python ignores
    SIGXFSZ)."""
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, nbytes))


@pytest.fixture(autouse=True)
def _no_daemon_left(tmp_path: Path) -> Any:
    yield
    stop_daemons(tmp_path)


def ended_in_bound(run: Run, since: float) -> list[int]:
    codes = run.wait(timeout=BOUND_S + 60)
    took = time.monotonic() - since
    assert took < BOUND_S, f"the ranks took {took:.0f} s to end"
    return codes


def test_a_killed_rank_ends_every_rank_with_one_line(tmp_path: Path) -> None:
    """Two nodes of two ranks; rank 3 (node 1) SIGKILLed mid-run. Ranks 0 and 1 learn it
    through the run's failure channel, rank 2 also from torchrun's SIGTERM. (The re-shard
    campaign in test_dist_train.py kills rank 0, the channel's hub, and rank 1 of two nodes
    of one rank, and checks the same line.)"""
    run = Run(tmp_path, "a", 2, 2, "--steps", "400", "--checkpoint-every", "1")
    run.wait_for_step(3)
    killed_at = time.monotonic()
    os.kill(run.pid_of(3), signal.SIGKILL)
    codes = ended_in_bound(run, killed_at)
    assert all(c != 0 for c in codes)
    assert run.stderr(3) == []  # SIGKILLed: it said nothing
    for r in range(3):
        assert run.stderr(r) == [
            f"tierstore: rank {r}: stopped because rank 3 (node 1) ended without a word "
            "(killed, or out of memory: its node's torchrun output says which); rerun with "
            "--resume to continue from the last complete checkpoint"], r


def test_a_silent_rank_ends_the_others_after_the_failure_timeout(tmp_path: Path) -> None:
    """Two nodes of one rank; rank 1 stopped (SIGSTOP: alive, its connections open, saying
    nothing) mid-run. Rank 0, blocked in a collective with it, ends after
    ``--failure-timeout 5`` with one line naming it, long before gloo's own timeout."""
    run = Run(tmp_path, "a", 2, 1, "--steps", "400", "--failure-timeout", "5")
    try:
        run.wait_for_step(1, 2)
        stopped_at = time.monotonic()
        os.kill(run.pid_of(1), signal.SIGSTOP)
        assert run.agents[0].wait(timeout=BOUND_S + 60) != 0
        took = time.monotonic() - stopped_at
    finally:
        with contextlib.suppress(AssertionError, ProcessLookupError):
            os.kill(run.pid_of(1), signal.SIGKILL)
        for a in run.agents:
            a.kill()
            a.wait()
    assert took < BOUND_S, f"rank 0 took {took:.0f} s to end"
    assert run.stderr(0) == [
        "tierstore: rank 0: stopped because rank 1 (node 1) has not been heard from for 5 s "
        "(its host is down or cut off); rerun with --resume to continue from the last "
        "complete checkpoint"]


def test_a_full_store_on_one_node_ends_every_rank_with_one_line(tmp_path: Path) -> None:
    # Node 1's store is PMem: one pool file, which grows as the store fills. Node 1's
    # files may not grow past 8 MiB, which holds its experts and two versions of them; with
    # a checkpoint every step pinning the last ones, the pool fills after a few steps.
    tierstore.open(tmp_path / "node1", create=True, backing="pmem",
                   pmem_path=tmp_path / "pool1", pmem_size="4MiB").close()
    run = Run(tmp_path, "a", 2, 1, "--steps", "400", "--checkpoint-every", "1",
              "--host-cache", "2MiB", file_limits={1: 8 << 20})
    codes = run.wait(timeout=600)
    assert all(c != 0 for c in codes), run.agent_log(1)
    lines = run.one_line_each("rank 1 (node 1) failed: no space to write to ",
                              "once that is fixed, rerun with --resume")
    assert lines[0].startswith("tierstore: rank 0: stopped because rank 1 (node 1) failed: ")
    done = len((tmp_path / "a.jsonl.rank0").read_text().splitlines())
    assert 1 <= done < 400  # it filled mid-run
    # The last checkpoint is whole on both nodes, and every store is sound.
    stop_daemons(tmp_path)
    for i in range(2):
        assert manifests.numbers(tmp_path / f"node{i}.run")[-1] == done
        with tierstore.open(tmp_path / f"node{i}", host_cache=0) as st:
            assert st.fsck().ok
            assert f"dist-{done:06d}" in {s.tag for s in st.snapshots()}


# --------------------------------------------------------------------------- manifests


def _good() -> dict[str, Any]:
    return manifests.make(3, 6, [[0, 1], [2, 3]], ["a" * 32, "b" * 32], 8,
                          {"seed": 3, "batches_drawn": 12, "batch_size": 4, "seq_len": 32,
                           "n_tokens": 9000})


def _with(**fields: Any) -> dict[str, Any]:
    m = _good()
    for k, v in fields.items():
        if v is _DROP:
            del m[k]
        else:
            m[k] = v
    return m


_DROP = object()
MALFORMED = [
    ("a list", [1, 2], "a JSON list"),
    ("a string", "ckpt", "a JSON str"),
    ("null", None, "a JSON NoneType"),
    ("nodes an int", _with(nodes=2), "'nodes' is 2"),
    ("nodes of ints", _with(nodes=[0, 1, 2, 3]), "'nodes'"),
    ("an empty node", _with(nodes=[[0, 1, 2, 3], []]), "'nodes'"),
    ("nodes out of order", _with(nodes=[[1, 0], [2, 3]]), "node by node"),
    ("nodes short of the world", _with(nodes=[[0, 1], [2]]), "node by node"),
    ("node ids missing", _with(node_ids=_DROP), "no 'node_ids'"),
    ("node ids a string", _with(node_ids="a" * 32), "'node_ids'"),
    ("node ids too few", _with(node_ids=["a" * 32]), "1 ids"),
    ("node ids repeated", _with(node_ids=["a" * 32, "a" * 32]), "1 different"),
    ("node id not hex", _with(node_ids=["a" * 32, "../../etc"]), "'node_ids'"),
    ("world size 0", _with(world_size=0), "'world_size' is 0"),
    ("world size negative", _with(world_size=-4), "'world_size' is -4"),
    ("world size a float", _with(world_size=4.0), "'world_size' is 4.0"),
    ("world size a bool", _with(world_size=True), "'world_size' is true"),
    ("world size a string", _with(world_size="4"), "'world_size' is \"4\""),
    ("world size beside nodes", _with(world_size=8), "node by node"),
    ("step negative", _with(step=-1), "'step' is -1"),
    ("step missing", _with(step=_DROP), "no 'step'"),
    ("step huge float", _with(step=1e300), "'step' is 1e+300"),
    ("number of another file", _with(number=4), "checkpoint 4"),
    ("tag of another", _with(tag="dist-000004"), "'tag'"),
    ("tag a path", _with(tag="../x"), "'tag'"),
    ("format 2", _with(format=2), "format is 2"),
    ("format a bool", _with(format=True), "format is true"),
    ("ownership other", _with(ownership="striped"), "'ownership'"),
    ("experts zero", _with(n_experts=0), "'n_experts' is 0"),
    ("experts not split", _with(n_experts=6), "6 experts do not split"),
    ("experts of another model", _with(n_experts=16), "16 experts per layer"),
    ("sampler a list", _with(sampler=[1, 2]), "'sampler'"),
    ("sampler short", _with(sampler={"seed": 1}), "'sampler'"),
    ("sampler negative", _with(sampler={**_good()["sampler"], "batches_drawn": -1}),
     "'batches_drawn' is -1"),
    ("time a string", _with(time="now"), "'time'"),
    ("an extra field", _with(resume_from="elsewhere"), "'resume_from'"),
    ("everything missing", {}, "no 'format'"),
]


@pytest.mark.parametrize("case,manifest,says", MALFORMED, ids=[c[0] for c in MALFORMED])
def test_a_malformed_manifest_is_refused_saying_why(tmp_path: Path, case: str, manifest: Any,
                                                    says: str) -> None:
    with pytest.raises(ValueError, match=None) as e:
        manifests.validate(manifest, 3, n_experts=8)
    assert says in str(e.value), (case, str(e.value))
    # the same through the run directory: one line naming the file
    (tmp_path / "manifests").mkdir()
    path = manifests.path_of(tmp_path, 3)
    path.write_text(json.dumps(manifest))
    found, errors = manifests.read(tmp_path, 8)
    assert found == {} and len(errors) == 1
    assert errors[0].startswith(f"checkpoint manifest {path} is invalid: ") and says in errors[0]
    assert "\n" not in errors[0]


@pytest.mark.parametrize("content", [b"\x00\xff\xfe garbage \x80", b"", b"{\"format\": 1",
                                     b"[" * 100000, "{\"nodes\": \"\u00e9\"}".encode("latin-1")],
                         ids=["garbage", "empty", "torn", "deep", "not-utf8"])
def test_a_manifest_that_is_not_json_is_refused(tmp_path: Path, content: bytes) -> None:
    (tmp_path / "manifests").mkdir()
    manifests.path_of(tmp_path, 1).write_bytes(content)
    found, errors = manifests.read(tmp_path, 8)
    assert found == {} and len(errors) == 1 and "is invalid: " in errors[0], errors


def test_a_manifest_that_is_not_a_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "manifests").mkdir()
    os.mkfifo(manifests.path_of(tmp_path, 1))  # reading it would block forever
    manifests.path_of(tmp_path, 2).mkdir()
    found, errors = manifests.read(tmp_path, 8)
    assert found == {} and len(errors) == 2
    assert all("not a regular file" in e for e in errors)


def test_a_sound_manifest_round_trips(tmp_path: Path) -> None:
    manifests.write(tmp_path, _good())
    (tmp_path / "manifests" / ".ckpt-000009.json.1.tmp").write_text("left by a crash")
    manifests.write(tmp_path, manifests.make(4, 8, [[0]], ["c" * 32], 8, _good()["sampler"]))
    found, errors = manifests.read(tmp_path, 8)
    assert errors == [] and sorted(found) == [3, 4]
    assert manifests.same_checkpoint(found[3], _good())
    assert not list((tmp_path / "manifests").glob(".*.tmp"))


def test_resume_checks_the_manifests_against_the_stores_and_says_when_it_falls_back(
        tmp_path: Path) -> None:
    """Through `--resume` on two nodes: an incomplete latest checkpoint (falling back is said,
    and the result equals the run that went on), then a manifest naming a snapshot its
    node's store does not hold (one line on every rank)."""
    first = Run(tmp_path, "a", 2, 1, "--steps", "4", "--checkpoint-every", "2")
    assert first.wait() == [0, 0], first.agent_log(0)
    want = [json.loads(x)["loss"] for x in (tmp_path / "a.jsonl.rank0").read_text().splitlines()]
    stop_daemons(tmp_path)
    latest = manifests.path_of(tmp_path / "node1.run", 2)

    latest.unlink()  # as if the run had stopped while node 1 was about to write it
    back = Run(tmp_path, "b", 2, 1, "--steps", "4", "--resume")
    assert back.wait() == [0, 0], back.agent_log(0)
    assert back.stderr(0) == [
        f"tierstore train: checkpoint 2 (step 4) is incomplete: node 1's run directory "
        f"{tmp_path / 'node1.run'} has no manifest of it (the run stopped while taking it); "
        "resuming from checkpoint 1 (step 2), the one before"]
    redone = [json.loads(x)["loss"] for x in (tmp_path / "b.jsonl.rank0").read_text().splitlines()]
    assert redone == pytest.approx(want[2:], rel=1e-6)
    for i in range(2):  # checkpoint 2 taken again, whole this time
        assert json.loads(manifests.path_of(tmp_path / f"node{i}.run", 2).read_text())[
            "step"] == 4

    stop_daemons(tmp_path)
    with tierstore.open(tmp_path / "node1", host_cache=0) as st:
        st.drop_snapshot("dist-000002")
    missing = Run(tmp_path, "c", 2, 1, "--steps", "6", "--resume")
    assert missing.wait() == [1, 1]  # torchrun: a rank failed
    missing.one_line_each(f"the manifest {latest} of checkpoint 2 (step 4) names snapshot "
                          f"dist-000002, which node 1's store {tmp_path / 'node1'} does not "
                          "hold: move that manifest away")
