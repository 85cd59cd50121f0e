"""One store daemon per node, shared by the node's ranks.

How the daemon starts: each node has a run directory (``--run-dir``, default the store's
path with ``.run`` appended) holding the daemon's socket ``daemon.sock``, its log
``daemon.log`` and the checkpoint manifests. Local rank 0 checks the socket: a daemon that
answers is used as it is (one the user started as a sidecar, or one left by an earlier run);
otherwise it starts ``tierstore serve --create`` on the node's store, in a session of its
own so that it outlives a crash of the ranks, and waits until it answers. The node's other
ranks wait at a node barrier and then connect. At the end local rank 0 stops the daemon it
started (SIGTERM: it flushes and exits) once every rank of the node has let go of it.
``--connect SOCKET`` names a daemon the user runs instead; it is never stopped.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import tierstore

from .world import DistributedError, World, node_barrier

START_TIMEOUT_S = 120.0


def default_run_dir(store: str | os.PathLike[str]) -> Path:
    return Path(f"{os.fspath(store).rstrip('/')}.run")


class NodeDaemon:
    """The node's daemon as this rank sees it: :attr:`socket`, and :meth:`stop`."""

    def __init__(self, socket: Path, proc: subprocess.Popen[bytes] | None) -> None:
        self.socket, self.proc = socket, proc

    def stop(self) -> None:
        """Stop the daemon if this rank started it."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _answers(socket: Path) -> bool:
    try:
        tierstore.daemon_status(str(socket))
    except (OSError, tierstore.StoreError):
        return False
    return True


def start_node_daemon(world: World, store: str | os.PathLike[str], run_dir: Path,
                      host_cache: int, connect: str | None = None) -> NodeDaemon:
    """The node's daemon, started by local rank 0 if none answers; every rank returns once
    it answers."""
    if connect is not None:
        daemon = NodeDaemon(Path(connect), None)
    else:
        daemon = NodeDaemon(run_dir / "daemon.sock", None)
        if world.is_node_leader:
            run_dir.mkdir(parents=True, exist_ok=True)
            if not _answers(daemon.socket):
                daemon.proc = _spawn(store, daemon.socket, run_dir / "daemon.log", host_cache)
    node_barrier(world)
    if not _answers(daemon.socket):
        raise DistributedError(f"no store daemon answers on {daemon.socket}")
    return daemon


def _spawn(store: str | os.PathLike[str], socket: Path, log: Path,
           host_cache: int) -> subprocess.Popen[bytes]:
    with contextlib.suppress(FileNotFoundError):
        socket.unlink()  # a dead daemon's
    cmd = [sys.executable, "-m", "tierstore", "serve", "--create", "--store", os.fspath(store),
           "--socket", str(socket), "--host-cache", str(host_cache)]
    with open(log, "ab") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log.read_text(errors="replace").strip().splitlines()[-1:] or ["no output"]
            raise DistributedError(f"the node's store daemon exited ({proc.returncode}): "
                                   f"{tail[0]} (log: {log})")
        if _answers(socket):
            return proc
        time.sleep(0.1)
    proc.kill()
    raise DistributedError(f"the node's store daemon did not answer on {socket} within "
                           f"{START_TIMEOUT_S:.0f} s (log: {log})")


def stop_daemon_at(socket: str | os.PathLike[str], timeout_s: float = 60.0) -> bool:
    """SIGTERM the daemon answering on ``socket`` (one a failed run left up, say) and wait
    for it to exit; False where none answers."""
    try:
        pid = int(tierstore.daemon_status(os.fspath(socket))["pid"])
    except (OSError, tierstore.StoreError):
        return False
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    return True
