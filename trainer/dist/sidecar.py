"""One store daemon per node, shared by the node's ranks.

How the daemon starts: each node has a run directory (``--run-dir``, default the store's
path with ``.run`` appended) holding the daemon's socket ``daemon.sock``, its log
``daemon.log`` and the checkpoint manifests. Local rank 0 makes the run directory and the
store's (0700), or refuses ones that another user owns or that others may write to (whoever
made them first would hold the run), and checks who answers on the socket
(``tierstore.probe_daemon``): the process must run as this user or root, and serve this
node's store (its resolved path and store id). A daemon that passes is used (one the user
started as a sidecar, or one an earlier run left) unless another training run is using it;
where nothing listens, local rank 0 starts ``tierstore serve --create --for-run`` on the
node's store with the run's store options, in a session of its own so that it outlives a
crash of the ranks, and waits until it answers. Whatever it finds wrong is one line on every
rank of the node. The ranks then connect, claiming the store for this run
(``tierstore.connect(..., run=ID)``): a second run is refused while this one is connected.

At a clean finish local rank 0 stops the daemon, once every rank of the node has let go of
it, if a training run started it (``--for-run``), whichever run that was: this one, or an
earlier one that crashed. A daemon the user started, and one named by ``--connect SOCKET``,
is never stopped.
"""

from __future__ import annotations

import contextlib
import os
import select
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

import tierstore

from .world import DistributedError, World, close_world

START_TIMEOUT_S = 120.0
PAGE = 4096  # the host cache's and the store's unit: sizes are rounded to it


def default_run_dir(store: str | os.PathLike[str]) -> Path:
    return Path(f"{os.fspath(store).rstrip('/')}.run")


@dataclass(frozen=True)
class DaemonSettings:
    """What the run asks of its node's daemon and store; None where the option was not
    given (a new daemon then takes ``tierstore serve``'s default, and one already running
    is not checked for it)."""

    host_cache: int | None = None
    backing: str | None = None
    pmem_path: str | None = None
    pmem_size: int | None = None
    slab_size: int | None = None

    def serve_args(self) -> list[str]:
        given = {"--host-cache": self.host_cache, "--backing": self.backing,
                 "--pmem-path": self.pmem_path, "--pmem-size": self.pmem_size,
                 "--slab-size": self.slab_size}
        return [a for k, v in given.items() if v is not None for a in (k, str(v))]

    def mismatch(self, info: dict[str, Any], store: str | os.PathLike[str]) -> str | None:
        """What the daemon ``info`` describes differently from what was asked, or None."""
        conf, where = info["store_backing"] or {}, f"store {os.fspath(store)}"
        kind = conf.get("kind")
        arena = int(info["arena_bytes"] or 0)
        if self.host_cache is not None and arena != self.host_cache - self.host_cache % PAGE:
            return (f"the daemon at {info['socket']} has a host cache of "
                    f"{tierstore.format_size(arena)}, not the "
                    f"{tierstore.format_size(self.host_cache)} --host-cache asks: stop that "
                    f"daemon (process {info['pid']}) or drop --host-cache")
        if self.backing is not None and kind != self.backing:
            return f"{where} is backed by {kind}, not the {self.backing} --backing asks"
        if self.slab_size is not None:
            if kind != "nvme":
                return f"--slab-size applies to NVMe stores; {where} is backed by {kind}"
            if conf["slab_bytes"] != _align(self.slab_size):
                return (f"{where} has slabs of {tierstore.format_size(conf['slab_bytes'])}, "
                        f"not the {tierstore.format_size(self.slab_size)} --slab-size asks "
                        "(a store keeps the slab size it was made with)")
        if (self.pmem_path is not None or self.pmem_size is not None) and kind != "pmem":
            return f"--pmem-path and --pmem-size apply to PMem stores; {where} is backed by {kind}"
        if self.pmem_path is not None and (os.path.realpath(conf["pool"])
                                           != os.path.realpath(self.pmem_path)):
            return f"{where}'s PMem pool is {conf['pool']}, not the {self.pmem_path} --pmem-path asks"
        if self.pmem_size is not None and conf["pool_bytes"] != _align(self.pmem_size):
            return (f"{where}'s PMem pool is {tierstore.format_size(conf['pool_bytes'])}, not "
                    f"the {tierstore.format_size(self.pmem_size)} --pmem-size asks")
        return None


def _align(n: int) -> int:
    return -(-n // PAGE) * PAGE


class NodeDaemon:
    """The node's daemon as this rank sees it: :attr:`socket`, :meth:`connect` and
    :meth:`stop`; once connected, :attr:`pidfd` (readable once the daemon's process has
    ended) and :meth:`explain`."""

    def __init__(self, socket: Path, store: str | os.PathLike[str], run: str,
                 users: bool, node: int = 0) -> None:
        self.socket, self.store, self.run, self.node = socket, store, run, node
        self.users = users  # named by --connect: never stopped
        self.proc: subprocess.Popen[bytes] | None = None  # the daemon this rank started
        self.info: dict[str, Any] | None = None  # who answered (local rank 0)
        self.pid: int | None = None
        self.pidfd: int | None = None

    def connect(self) -> tierstore.RemoteStore:
        """This rank's client, checked to reach this node's store, claiming it for the run.
        The daemon's process (the kernel's word, as the probe gives it) is pinned by a pidfd,
        so that its end is known at once, whatever the rank is doing."""
        store = tierstore.connect(self.socket, store=self.store, run=self.run)
        info = self.info or tierstore.probe_daemon(self.socket)
        if info is not None:
            self.pid = int(info["pid"])
            with contextlib.suppress(OSError):  # gone already: the first call says so
                self.pidfd = os.pidfd_open(self.pid)
        return store

    def ended(self, wait_s: float = 0.0) -> bool:
        """Whether the daemon this rank connected to has ended (within ``wait_s``)."""
        return self.pidfd is not None and bool(select.select([self.pidfd], [], [], wait_s)[0])

    def lost(self) -> str:
        """What to say when the daemon has ended under the run."""
        what = (f"node {self.node}'s store daemon (process {self.pid}, {self.socket}) ended "
                "while the run used it (killed, or out of memory")
        if self.users:  # --connect: the user's own daemon, which the run never starts
            return f"{what}); start it again"
        return f"{what}; its log: {self.socket.parent / 'daemon.log'}); a resumed run starts " \
               "a new one"

    def explain(self, error: BaseException) -> BaseException:
        """``error`` as the line :meth:`lost` says where the store failed because the daemon
        has ended; otherwise ``error`` itself."""
        # A dying process closes its sockets a moment before its pidfd turns readable. (The
        # run's own refusals, DistributedError, are never the daemon's.)
        if isinstance(error, (tierstore.StoreError, OSError)) and \
                not isinstance(error, DistributedError) and self.ended(1.0):
            return DistributedError(self.lost())
        return error

    def release(self) -> None:
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None

    def stop(self) -> None:
        """Stop the daemon if a training run started it (never one the user started)."""
        if self.users or self.info is None or not self.info["for_run"]:
            return
        tierstore.stop_daemon(self.socket, instance=self.info["instance"])
        if self.proc is not None:
            self.proc.wait()  # ended: stop_daemon waited for it

    def prepare(self, run_dir: Path, settings: DaemonSettings) -> None:
        """Local rank 0: find the daemon, or start one, and check it (see the module
        docstring); a one-line error otherwise."""
        # Both made by this user, or checked to be (owned by this user or root, and no one
        # else may write there): another user who made them first would hold the run.
        for folder, what in ((run_dir, "run directory"), (Path(self.store), "store directory")):
            try:
                tierstore.private_dir(folder, what)
            except OSError as e:
                raise DistributedError(f"cannot make the {what} {folder}: "
                                       f"{e.strerror or e}") from None
        info = tierstore.probe_daemon(self.socket, store=self.store)
        if info is None:
            if self.users:
                raise DistributedError(f"no store daemon answers on {self.socket}")
            self.proc, info = _spawn(self.store, self.socket, run_dir / "daemon.log",
                                     settings)
        info["socket"] = self.socket
        self.info = info
        if info["run"] is not None:
            raise DistributedError(f"store {self.store} is in use by another training run "
                                   f"(process {info['run']['pid']}); wait for it to finish, "
                                   "or stop it")
        problem = settings.mismatch(info, self.store)
        if problem is not None:
            raise DistributedError(problem)

    def abandon(self) -> None:
        """After a failed start: stop the daemon this rank started for nothing."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait()


def start_node_daemon(world: World, store: str | os.PathLike[str], run_dir: Path,
                      settings: DaemonSettings, connect: str | None = None) -> NodeDaemon:
    """The node's daemon, found or started by local rank 0 and checked; every rank returns
    once it answers, or raises the one line that says what is wrong."""
    box: list[Any] = [uuid.uuid4().hex if world.rank == 0 else None]
    dist.broadcast_object_list(box, src=0)  # the run's id, the same on every rank
    sock = Path(connect) if connect is not None else run_dir / "daemon.sock"
    daemon = NodeDaemon(sock, store, str(box[0]), users=connect is not None, node=world.node)
    problem = None
    if world.is_node_leader:
        try:
            daemon.prepare(run_dir, settings)
        except (DistributedError, tierstore.StoreError, OSError) as e:
            problem = str(e) if not isinstance(e, OSError) else (
                f"{e.filename}: {e.strerror or e}" if e.filename else str(e))
            daemon.abandon()
    if world.local_size > 1:  # the leader's word, to the node's ranks
        box = [problem]
        dist.broadcast_object_list(box, src=world.nodes[world.node][0],
                                   group=world.node_group)
        problem = box[0]
    if problem is not None:
        # Every rank of the node knows, so each lets go of the process group: left to the
        # interpreter's exit, gloo's threads may abort the process instead.
        close_world(world)
        raise DistributedError(problem)
    return daemon


def _spawn(store: str | os.PathLike[str], socket: Path, log: Path,
           settings: DaemonSettings) -> tuple[subprocess.Popen[bytes], dict[str, Any]]:
    """Start ``tierstore serve --for-run`` and wait until it answers. A socket a killed
    daemon left is the new daemon's to remove, which it does only where connecting to it is
    refused."""
    cmd = [sys.executable, "-m", "tierstore", "serve", "--create", "--for-run", "--store",
           os.fspath(store), "--socket", str(socket), *settings.serve_args()]
    with open(log, "ab") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        return proc, _wait_until_it_answers(proc, store, socket, log)
    except BaseException:
        if proc.poll() is None:
            proc.terminate()
            proc.wait()
        raise


def _wait_until_it_answers(proc: subprocess.Popen[bytes], store: str | os.PathLike[str],
                           socket: Path, log: Path) -> dict[str, Any]:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log.read_text(errors="replace").strip().splitlines()[-1:] or ["no output"]
            raise DistributedError(f"the node's store daemon exited ({proc.returncode}): "
                                   f"{tail[0]} (log: {log})")
        info = tierstore.probe_daemon(socket, store=store)
        if info is not None:
            if info["pid"] != proc.pid:  # nobody else can listen in a private run directory
                raise DistributedError(f"process {info['pid']}, not the daemon started "
                                       f"(process {proc.pid}), answers on {socket}")
            return info
        time.sleep(0.1)
    raise DistributedError(f"the node's store daemon did not answer on {socket} within "
                           f"{START_TIMEOUT_S:.0f} s (log: {log})")


def stop_daemon_at(socket: str | os.PathLike[str], timeout_s: float = 60.0) -> bool:
    """SIGTERM the daemon answering on ``socket`` (one a failed run left up, say) and wait
    for it to exit; False where none answers."""
    return tierstore.stop_daemon(socket, timeout_s=timeout_s)
