"""A distributed run and its node daemon: whose it is, what it was asked, how long it lives.

- Another user (a real one, made for the test) who made ``STORE.run/`` first in a shared
  folder and serves their own store on its socket receives nothing: the run refuses in one
  line on every rank, and their daemon and socket are left as they were. So does a run
  pointed at their daemon with ``--connect``, where only the kernel's word (SO_PEERCRED)
  tells it apart.
- ``--store A --run-dir R`` where R's socket serves store B is refused; so is a socket where
  something answers that is no daemon, which stays where it is.
- The store options reach the node's daemon: a PMem store is PMem with the pool asked for,
  an NVMe store has the slab size asked for; options that differ from the store or daemon
  there are refused, and so are the options the distributed trainer cannot honour.
- The run that finishes stops a daemon a crashed run started, never one the user started;
  a second run on a store a live run is using is refused at once, with or without
  ``--resume``.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from test_dist_train import CHILD
from tierstore.trainer.dist.sidecar import DaemonSettings

import tierstore
from tierstore.cli import main

pytestmark = pytest.mark.timeout(600)
TINY = ["--model", "tiny", "--batch-size", "2", "--seq-len", "32", "--corpus-max-bytes",
        "64KiB", "--eval-every", "0"]


@pytest.fixture(autouse=True)
def _no_daemon_left(tmp_path: Path) -> Any:
    """A daemon a failed test leaves (a failed run keeps its own up) is stopped."""
    yield
    for sock in tmp_path.glob("**/daemon.sock"):
        with contextlib.suppress(tierstore.StoreError, OSError):
            tierstore.stop_daemon(sock)


def alone(*args: str, steps: int = 1) -> subprocess.CompletedProcess[str]:
    """``tierstore train --distributed`` as a world of one rank, torchrun's environment set
    by hand (no agent: the process's own output and exit status)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RANK": "0", "WORLD_SIZE": "1",
           "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "GROUP_RANK": "0",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "0"}  # a world of one: any free port
    return subprocess.run([sys.executable, "-m", "tierstore", "train", "--distributed",
                           "--steps", str(steps), *TINY, *args], env=env,
                          capture_output=True, text=True, timeout=300)


def ranks(tmp: Path, name: str, per_node: int, *args: str) -> list[list[str]]:
    """``torchrun -m tierstore train --distributed`` on one node of ``per_node`` ranks, each
    rank's stderr in a file of its own; returns every rank's stderr lines."""
    logs = tmp / f"{name}.logs"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                    "--nproc-per-node", str(per_node), "--log-dir", str(logs),
                    "--redirects", "2", "-m", "tierstore", "train", "--distributed",
                    "--steps", "1", *TINY, *args], env=env, capture_output=True, timeout=300)
    return [p.read_text().splitlines() for p in sorted(logs.glob("*/attempt_0/*/stderr.log"))]


def child(tmp: Path, name: str, **spec: Any) -> subprocess.Popen[bytes]:
    """tests/dist_child.py under ``torchrun --standalone`` (one node, one rank, a free port
    of its own), training the tiny preset on ``tmp/node0``; its output in ``tmp/NAME.log``."""
    spec = {"model": "tiny", "seed": 0, "corpus_bytes": 64 * 1024, "paradigm": "token",
            "train": {"seq_len": 32, "batch_size": 2, "eval_every": 0},
            "store": str(tmp / "node{node}"), "host_cache": 16 << 20, **spec}
    (tmp / f"{name}.json").write_text(json.dumps(spec))
    with open(tmp / f"{name}.log", "wb") as log:
        return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                 "--nproc-per-node", "1", str(CHILD), str(tmp / f"{name}.json")],
                                env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=log,
                                stderr=subprocess.STDOUT)


def tail(path: Path) -> str:
    return path.read_text(errors="replace")[-3000:] if path.exists() else f"no {path}"


def one_line(done: subprocess.CompletedProcess[str], says: str) -> None:
    assert done.returncode == 2, done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tierstore: ") and says in lines[0], lines


def backing_of(store: Path) -> dict[str, Any]:
    return dict(json.loads((store / "TIERSTORE").read_text())["backing"])


def test_another_users_run_directory_and_daemon_receive_nothing(other_user: Any) -> None:
    shared = other_user.shared
    run = shared / "s.run"
    run.mkdir()
    other_user.own(run, 0o777)  # made first, open to all, as the reporter's
    sock = run / "daemon.sock"
    theirs = other_user.serve(shared / "theirs", sock)
    try:
        os.chmod(sock, 0o777)
        said = f"run directory {run} is owned by {other_user.name} (uid {other_user.uid})"
        logs = ranks(shared, "root", 2, "--store", str(shared / "s"))
        assert len(logs) == 2 and all(len(lines) == 1 and said in lines[0] for lines in logs), \
            "\n".join(map(repr, logs))
        # Pointed at their daemon through a socket file that looks like root's own: only
        # the kernel tells who listens.
        os.chown(sock, 0, 0)
        os.chmod(sock, 0o600)
        one_line(alone("--store", str(shared / "s"), "--run-dir", str(shared / "mine.run"),
                       "--connect", str(sock)),
                 f"runs as {other_user.name} (uid {other_user.uid}), not as root")
        assert sock.exists() and theirs.poll() is None
        assert not (shared / "s").exists() or not list((shared / "s").iterdir())
        with pytest.raises(tierstore.DaemonIdentityError):
            tierstore.connect(sock)
    finally:
        theirs.send_signal(signal.SIGTERM)
        assert theirs.wait(timeout=60) == 0
    with tierstore.open(shared / "theirs", host_cache=0) as st:  # nothing reached it
        assert st.keys() == []


def test_a_run_directory_whose_daemon_serves_another_store_is_refused(tmp_path: Path) -> None:
    run = tmp_path / "r"
    tierstore.private_dir(run)
    sock = run / "daemon.sock"
    log = open(tmp_path / "b.log", "wb")  # noqa: SIM115 (closed below)
    b = subprocess.Popen([sys.executable, "-m", "tierstore", "serve", "--create", "--store",
                          str(tmp_path / "b"), "--socket", str(sock), "--host-cache", "16MiB"],
                         stdout=log, stderr=subprocess.STDOUT)
    try:
        while tierstore.probe_daemon(sock) is None:
            assert b.poll() is None
            time.sleep(0.05)
        one_line(alone("--store", str(tmp_path / "a"), "--run-dir", str(run)),
                 f"the daemon at {sock} serves the store {tmp_path / 'b'}, not {tmp_path / 'a'}")
        assert b.poll() is None  # not stopped: the user's
        with tierstore.connect(sock) as st:
            assert st.keys() == []
    finally:
        b.send_signal(signal.SIGTERM)
        b.wait(timeout=60)
        log.close()
    # Something that answers but is no daemon: an error, and its socket is not unlinked.
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(sock))
    listener.listen(8)

    def hang_up() -> None:
        with contextlib.suppress(OSError):
            while True:
                listener.accept()[0].close()

    threading.Thread(target=hang_up, daemon=True).start()
    try:
        one_line(alone("--store", str(tmp_path / "a"), "--run-dir", str(run)),
                 f"lost the connection to the daemon at {sock}")
        assert sock.exists()
    finally:
        listener.shutdown(socket.SHUT_RDWR)
        listener.close()


def test_store_options_reach_the_node_daemon(tmp_path: Path) -> None:
    """A PMem store is PMem, with the pool asked for (the NVMe slab size: in
    test_dist_train.py::test_the_command_line_under_torchrun); an option that differs from
    the store or daemon there is refused; a daemon the user started outlives the run."""
    pool = tmp_path / "pool"
    store = tmp_path / "p"
    done = alone("--store", str(store), "--backing", "pmem", "--pmem-path", str(pool),
                 "--pmem-size", "48MiB")
    assert done.returncode == 0, done.stderr[-2000:]
    conf = backing_of(store)
    assert conf["kind"] == "pmem" and conf["pool"] == str(pool)
    assert conf["pool_bytes"] == 48 << 20 and pool.stat().st_size >= 48 << 20
    sock = Path(f"{store}.run") / "daemon.sock"
    assert not sock.exists()  # the run stopped the daemon it started
    log = open(tmp_path / "user.log", "wb")  # noqa: SIM115 (closed below)
    user = subprocess.Popen([sys.executable, "-m", "tierstore", "serve", "--store", str(store),
                             "--socket", str(sock), "--host-cache", "24MiB"],
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        while (info := tierstore.probe_daemon(sock)) is None:
            assert user.poll() is None
            time.sleep(0.05)
        one_line(alone("--store", str(store), "--resume", "--host-cache", "32MiB", steps=2),
                 "has a host cache of 24.0 MiB, not the 32.0 MiB --host-cache asks")
        # The other options, against what this daemon says of itself.
        info["socket"] = sock
        for asked, says in (
                ({"backing": "nvme"}, f"store {store} is backed by pmem, not the nvme"),
                ({"slab_size": 8 << 20}, "--slab-size applies to NVMe stores"),
                ({"pmem_path": str(tmp_path / "other")}, "not the"),
                ({"pmem_size": 32 << 20}, "is 48.0 MiB, not the 32.0 MiB --pmem-size")):
            problem = DaemonSettings(**asked).mismatch(info, store)
            assert problem is not None and says in problem, problem
        assert DaemonSettings(24 << 20, "pmem", str(pool), 48 << 20).mismatch(info, store) is None
        done = alone("--store", str(store), "--resume", "--backing", "pmem", "--pmem-size",
                     "48MiB", "--host-cache", "24MiB", steps=2)
        assert done.returncode == 0, done.stderr[-2000:]
        assert "steps 2-2" in done.stdout
        # A daemon the user started outlives the runs that used it.
        assert user.poll() is None and tierstore.probe_daemon(sock) is not None
    finally:
        user.send_signal(signal.SIGTERM)
        assert user.wait(timeout=60) == 0
        log.close()
    # An existing store whose backing differs: the daemon started for it says so.
    one_line(alone("--store", str(store), "--resume", "--backing", "nvme", steps=2),
             f"store {store} is backed by pmem, not nvme")


def test_options_the_distributed_trainer_cannot_honour_are_refused(tmp_path: Path) -> None:
    for extra, says in (
            (["--device-budget", "1GiB"], "--device-budget and --fetch queue do not apply"),
            (["--fetch", "queue"], "--device-budget and --fetch queue do not apply"),
            (["--pmem-size", "1GiB"], "--pmem-path and --pmem-size go with --backing pmem"),
            (["--backing", "nvme", "--pmem-path", str(tmp_path / "pool")], "--backing pmem"),
            (["--backing", "pmem", "--slab-size", "8MiB"], "--slab-size goes with NVMe")):
        res = CliRunner().invoke(main, ["train", "--distributed", "--store",
                                        str(tmp_path / "s"), "--steps", "1", *extra])
        assert res.exit_code == 2 and says in res.output, res.output
    assert not (tmp_path / "s").exists()


def test_the_run_that_finishes_stops_the_daemon_a_crashed_run_left(tmp_path: Path) -> None:
    crashed = child(tmp_path, "a", steps=2, checkpoint_every=1, kill=["snapshot", 2, 0])
    assert crashed.wait(timeout=300) != 0
    run = tmp_path / "node0.run"
    why = f"{tail(tmp_path / 'a.log')}\n{tail(run / 'daemon.log')}"
    assert (run / "manifests" / "ckpt-000001.json").exists(), why  # killed at step 2
    sock = run / "daemon.sock"
    left = tierstore.probe_daemon(sock)
    assert left is not None and left["for_run"] and left["run"] is None, why
    resumed = child(tmp_path, "b", steps=2, resume=True)
    assert resumed.wait(timeout=300) == 0, tail(tmp_path / "b.log")
    assert tierstore.probe_daemon(sock) is None and not sock.exists()
    with tierstore.open(tmp_path / "node0", host_cache=0) as st:  # no daemon holds it
        assert st.fsck().ok


def test_a_second_run_on_a_store_in_use_is_refused_at_once(tmp_path: Path) -> None:
    first = child(tmp_path, "first", steps=2, checkpoint_every=1,
                  pause=["snapshot", 1, 0, str(tmp_path)])
    try:
        deadline = time.monotonic() + 300
        while not (tmp_path / "paused").exists():
            assert first.poll() is None, tail(tmp_path / "first.log")
            assert time.monotonic() < deadline
            time.sleep(0.05)
        said = f"store {tmp_path / 'node0'} is in use by another training run (process"
        logs = ranks(tmp_path, "second", 2, "--store", str(tmp_path / "node0"), "--resume")
        assert len(logs) == 2 and all(len(lines) == 1 and said in lines[0]
                                      for lines in logs), logs
        one_line(alone("--store", str(tmp_path / "node0")), said)
        (tmp_path / "go").touch()
        assert first.wait(timeout=300) == 0, tail(tmp_path / "first.log")
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    assert not (tmp_path / "node0.run" / "daemon.sock").exists()
