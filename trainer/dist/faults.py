"""When one rank fails, every rank ends within seconds with one line that names it.

gloo reports another rank's death as an exception in whichever collective touches it first
(``Connection reset by peer``, under a 55-line traceback), and ranks that are waiting on a
live rank stay blocked until that rank ends too. torchrun stops the failed node's other ranks
with SIGTERM, silently, and nothing else. So a run keeps a small side channel of its own
(:class:`FaultWatch`): rank 0 is the hub, every other rank holds one TCP connection to it
(authenticated by a token sent over the process group), and a thread on each rank watches it.

- A rank whose process dies has its connection closed by the kernel, even on SIGKILL: the
  hub sees that at once. A host that goes silent for :data:`SILENT_AFTER_S` (or the run's
  ``failure_timeout_s``, ``--failure-timeout``) counts as gone
  (both sides send a beat every :data:`BEAT_S`).
- A rank failing with an error of its own sends it to the hub before it raises.
- The hub turns the first such event into a verdict ("rank 3 (node 1) ended without a word
  ...") and sends it to every rank; each prints it as one line on stderr and ends its process
  (status 1), wherever its main thread is (blocked in a collective, say). A rank whose
  connection to the hub ends without a verdict knows that rank 0 is gone.
- A rank's node store daemon that ends (:meth:`FaultWatch.watch_daemon`: a pidfd, readable
  once the process is gone, looked at every tick) is this rank's failure, told as its own
  error would be, even while the main thread is blocked in a collective or computing.
- SIGTERM and SIGINT (torchrun stopping a node's ranks, Ctrl-C) wake the thread through the
  signal wakeup fd, so they are seen even while the main thread is blocked in a collective:
  a verdict arriving within :data:`SIGNAL_GRACE_S` is the cause; otherwise the rank reports
  that it was stopped, and the others end naming it.
- Errors every rank raises together (:class:`~.world.AgreedError`, such as a refused
  checkpoint) end each rank with that error's own line: the ranks say BYE, and the hub QUIT,
  so nobody reads the others' exits as failures. A clean finish closes the channel the same
  way (:meth:`FaultWatch.close`).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import select
import selectors
import signal
import socket
import sys
import threading
import time
import torch.distributed as dist

import tierstore

from .world import AgreedError, DistributedError, World

BEAT_S = 1.0
SILENT_AFTER_S = 60.0  # far beyond any pause of a live process's watcher thread
SIGNAL_GRACE_S = 5.0  # a signalled rank waits this long for the verdict that explains it
VERDICT_WAIT_S = 15.0  # a rank whose collective failed waits this long for the verdict
CLOSE_WAIT_S = 60.0
LINGER_S = 3.0
HELLO_WITHIN_S = 10.0
RESUME = "rerun with --resume to continue from the last complete checkpoint"
_DIED = "ended without a word (killed, or out of memory: its node's torchrun output says which)"


def _line(text: str) -> str:
    return " ".join(str(text).split())


def _say(line: str) -> None:
    """This rank's last word, on its stderr (which may be gone: the rank ends anyway)."""
    with contextlib.suppress(OSError, ValueError):
        print(f"tierstore: {line}", file=sys.stderr, flush=True)


def _hub_address() -> tuple[int, str]:
    """This host's address on the route to the rendezvous host, where the other ranks can
    reach it (the rendezvous itself is reached there)."""
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    for family, _, _, _, addr in socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM):
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            try:
                s.connect(addr)
            except OSError:
                continue
            return family, str(s.getsockname()[0])
    raise DistributedError(f"cannot find this host's address on the way to MASTER_ADDR {host}")


class _Peer:
    """One connection, its read buffer and when it was last heard."""

    def __init__(self, sock: socket.socket, rank: int | None) -> None:
        self.sock, self.rank, self.buf = sock, rank, b""
        self.heard = time.monotonic()
        self.left = False  # said BYE (or QUIT): its end is no failure
        self.send_lock = threading.Lock()

    def send(self, line: str) -> None:
        with self.send_lock, contextlib.suppress(OSError):
            self.sock.sendall((_line(line) + "\n").encode())

    def lines(self) -> list[str] | None:
        """The complete lines that arrived; ``None`` once the other end is gone."""
        try:
            data = self.sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return []
        except OSError:
            data = b""
        if not data:
            return None
        self.heard = time.monotonic()
        self.buf += data
        *done, self.buf = self.buf.split(b"\n")
        return [d.decode(errors="replace") for d in done]


class FaultWatch:
    """This rank's end of the run's failure channel (see the module docstring)."""

    def __init__(self, world: World, silent_after_s: float = SILENT_AFTER_S) -> None:
        self.world = world
        self.silent_after_s = silent_after_s
        self.lock = threading.Lock()
        self.verdict: str | None = None
        self.got_verdict = threading.Event()
        self.ending = False  # one of the two threads is ending the rank
        self.watcher_ends = False  # ... and it is the watcher thread, with a verdict
        self.stopping = False  # close(): the end is expected
        self.hub_left = False
        # Until the run is past its start, a ValueError is the configuration's, which every
        # rank finds alike; the trainer sets this once training begins.
        self.training = False
        self.beat = 0.0
        self.signalled: tuple[int, float] | None = None
        self.peers: dict[int, _Peer] = {}
        self.joined = threading.Condition(self.lock)
        self.sel = selectors.DefaultSelector()
        self.listener: socket.socket | None = None
        self.hub: _Peer | None = None
        self.thread: threading.Thread | None = None
        self.token = ""
        self._wake: tuple[int, int] | None = None
        self._saved: tuple[int, dict[int, object]] | None = None
        self._daemon: tuple[int, str] | None = None  # (its pidfd, what its end means)

    # ------------------------------------------------------------------ starting

    @classmethod
    def start(cls, world: World, silent_after_s: float = SILENT_AFTER_S) -> FaultWatch:
        """Every rank calls it once, after the process group is up."""
        watch = cls(world, silent_after_s)
        if world.size > 1:
            watch._connect()
            watch._catch_signals()
            watch.thread = threading.Thread(target=watch._run, name="tierstore-faults",
                                            daemon=True)
            watch.thread.start()
            if world.rank == 0:
                try:
                    watch._wait_for_ranks()
                except BaseException:
                    watch.close()
                    raise
        return watch

    def _connect(self) -> None:
        world = self.world
        box: list[object] = [None]
        if world.rank == 0:
            family, host = _hub_address()
            self.listener = socket.socket(family, socket.SOCK_STREAM)
            self.listener.bind((host, 0))
            self.listener.listen(min(world.size, 4096))
            self.listener.setblocking(False)
            self.sel.register(self.listener, selectors.EVENT_READ)
            self.token = secrets.token_hex(16)
            box = [(host, self.listener.getsockname()[1], self.token)]
        dist.broadcast_object_list(box, src=0)
        if world.rank != 0:
            host, port, self.token = box[0]  # type: ignore[misc]
            sock = socket.create_connection((host, port), timeout=60)
            sock.settimeout(5.0)  # a send never blocks the rank for long
            self.hub = _Peer(sock, 0)
            self.hub.send(f"HELLO {self.token} {world.rank}")
            self.sel.register(sock, selectors.EVENT_READ, self.hub)

    def _wait_for_ranks(self) -> None:
        deadline = time.monotonic() + 60
        with self.joined:
            while len(self.peers) < self.world.size - 1:
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = sorted(set(range(1, self.world.size)) - set(self.peers))
                    raise DistributedError(f"ranks {missing} did not join the run's failure "
                                           "channel within 60 s")
                self.joined.wait(left)

    def _catch_signals(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signals are the main thread's; a rank run from another thread does without
        r, w = os.pipe()
        os.set_blocking(r, False)
        os.set_blocking(w, False)
        self._wake = (r, w)
        old_fd = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        # The handlers do nothing themselves: the main thread may be blocked in a collective
        # for good. The byte the wakeup fd gets wakes this rank's watcher thread instead.
        old = {s: signal.signal(s, lambda *_: None) for s in (signal.SIGTERM, signal.SIGINT)}
        self._saved = (old_fd, old)
        self.sel.register(r, selectors.EVENT_READ, "signal")

    def watch_daemon(self, pidfd: int | None, lost: str) -> None:
        """End this rank with its own failure ``lost`` once the process behind ``pidfd``
        (the node's store daemon) has ended."""
        with self.lock:
            self._daemon = None if pidfd is None else (pidfd, lost)

    # ------------------------------------------------------------------ the thread

    def _run(self) -> None:
        while True:
            with self.lock:
                if self.stopping and (self.world.rank != 0 or self._all_left()):
                    return
            for key, _ in self.sel.select(timeout=BEAT_S / 2):
                if key.fileobj is self.listener:
                    self._accept()
                elif key.data == "signal":
                    self._on_signal_bytes()
                elif isinstance(key.data, _Peer):
                    self._read(key.data)
            self._tick()

    def _accept(self) -> None:
        assert self.listener is not None
        with contextlib.suppress(BlockingIOError, InterruptedError):
            sock, _ = self.listener.accept()
            sock.settimeout(5.0)
            self.sel.register(sock, selectors.EVENT_READ, _Peer(sock, None))

    def _read(self, peer: _Peer) -> None:
        lines = peer.lines()
        if lines is None:
            self._gone(peer)
            return
        for line in lines:
            word, _, rest = line.partition(" ")
            if peer.rank is None:  # the first line must be the run's HELLO
                if word != "HELLO" or not self._hello(peer, rest.split()):
                    self._drop(peer)
                    return
            elif word in ("BYE", "QUIT"):
                self._left(peer, quit_=word == "QUIT")
            elif word == "ERR" and self.world.rank == 0:
                self._finish(self._stopped_line(self._broadcast(rest)))
            elif word == "STOP" and self.world.rank != 0:
                self._finish(self._stopped_line(self._set_verdict(rest)))

    def _hello(self, peer: _Peer, parts: list[str]) -> bool:
        if len(parts) != 2 or parts[0] != self.token or not parts[1].isdigit():
            return False
        rank = int(parts[1])
        with self.joined:
            if not 0 < rank < self.world.size or rank in self.peers:
                return False
            peer.rank = rank
            self.peers[rank] = peer
            self.joined.notify_all()
        return True

    def _left(self, peer: _Peer, quit_: bool = False) -> None:
        with self.joined:
            peer.left = True
            self.hub_left = self.hub_left or quit_
            self.joined.notify_all()

    def _drop(self, peer: _Peer) -> None:
        with contextlib.suppress(KeyError, ValueError):
            self.sel.unregister(peer.sock)
        peer.sock.close()

    def _gone(self, peer: _Peer, why: str | None = None) -> None:
        """``peer``'s connection ended (or went silent, ``why``)."""
        self._drop(peer)
        if peer.rank is None or peer.left:
            return
        self._left(peer)
        with self.lock:
            expected = self.hub_left or self.stopping
        if expected and self.world.rank != 0:
            return
        verdict = f"{self.who(peer.rank)} {why or _DIED}; {RESUME}"
        if self.world.rank == 0:
            self._finish(self._stopped_line(self._broadcast(verdict)))
        else:
            self._finish(self._stopped_line(self._set_verdict(verdict)))

    def _tick(self) -> None:
        now = time.monotonic()
        if now - self.beat >= BEAT_S:
            self.beat = now
            for peer in self._live():
                peer.send("BEAT")
        for peer in self._live():
            if now - peer.heard > self.silent_after_s:
                self._gone(peer, f"has not been heard from for {self.silent_after_s:.0f} s (its "
                                 "host is down or cut off)")
        for key in list(self.sel.get_map().values()):  # connected, but never said HELLO
            if isinstance(key.data, _Peer) and key.data.rank is None and \
                    now - key.data.heard > HELLO_WITHIN_S:
                self._drop(key.data)
        with self.lock:
            daemon = self._daemon
        if daemon is not None and select.select([daemon[0]], [], [], 0)[0]:
            with self.lock:
                self._daemon = None  # acted on once
            self._fail_here(f"{self.who(self.world.rank)} failed: {daemon[1]}; once that is "
                            f"fixed, {RESUME}")
        with self.lock:
            signalled = self.signalled
            if signalled is not None and now - signalled[1] > SIGNAL_GRACE_S:
                self.signalled = None  # acted on once
            else:
                signalled = None
        if signalled is not None:
            self._fail_here(f"{self.who(self.world.rank)} was stopped by "
                            f"{signal.Signals(signalled[0]).name}; {RESUME}")

    def _fail_here(self, verdict: str) -> None:
        """(The watcher thread.) This rank fails, for a reason the thread found: the verdict
        goes to the hub (or out from it), and is this rank's line."""
        if self.world.rank == 0:
            self._finish(self._broadcast(verdict))
        else:
            assert self.hub is not None
            self.hub.send(f"ERR {verdict}")
            self._finish(verdict)

    def _live(self) -> list[_Peer]:
        peers = list(self.peers.values()) if self.world.rank == 0 else [self.hub]
        return [p for p in peers if p is not None and not p.left]

    def _on_signal_bytes(self) -> None:
        assert self._wake is not None
        try:
            data = os.read(self._wake[0], 64)
        except (BlockingIOError, InterruptedError):
            return
        with self.lock:
            for signum in data:
                if signum in (signal.SIGTERM, signal.SIGINT) and self.signalled is None:
                    self.signalled = (signum, time.monotonic())

    # ------------------------------------------------------------------ verdicts

    def who(self, rank: int) -> str:
        return f"rank {rank} (node {self.world.node_of(rank)})"

    def _set_verdict(self, verdict: str) -> str:
        """The run's verdict: the first one set stays."""
        with self.lock:
            if self.verdict is None:
                self.verdict = _line(verdict)
            verdict = self.verdict
        self.got_verdict.set()
        return verdict

    def _broadcast(self, verdict: str) -> str:
        """The hub: the first failure it learns of becomes the verdict, sent to every rank."""
        with self.lock:
            first = self.verdict is None
        verdict = self._set_verdict(verdict)
        if first:
            for peer in self._live():
                peer.send(f"STOP {verdict}")
        return verdict

    def _stopped_line(self, verdict: str) -> str:
        return f"rank {self.world.rank}: stopped because {verdict}"

    def _claim(self) -> bool:
        """Whether this caller ends the rank (only one does)."""
        with self.lock:
            if self.ending or self.stopping:
                return False
            self.ending = True
            return True

    def _finish(self, line: str) -> None:
        """(The watcher thread.) Print ``line`` and end the process, unless the main thread
        is ending the rank itself."""
        with self.lock:
            if self.ending or self.stopping:
                return
            self.ending = self.watcher_ends = True
        _say(line)
        if self.world.rank == 0:
            self._linger()
        elif self.hub is not None:
            self.hub.send("BYE")
        os._exit(1)

    def _linger(self) -> None:
        """(The hub's watcher thread.) Stay until every rank has its verdict and has gone,
        or a few seconds: ending first could cut a verdict short on its way."""
        deadline = time.monotonic() + LINGER_S
        while time.monotonic() < deadline and not self._all_left():
            for key, _ in self.sel.select(timeout=0.1):
                if isinstance(key.data, _Peer) and key.data.rank is not None:
                    lines = key.data.lines()
                    if lines is None:
                        self._drop(key.data)
                    if lines is None or any(x.startswith(("BYE", "ERR")) for x in lines):
                        self._left(key.data)

    def _let_go(self) -> None:
        """(The main thread, ending the rank.) The hub waits, as in :meth:`_linger`, while its
        watcher thread marks the ranks that leave; any other rank says BYE."""
        if self.world.rank != 0:
            if self.hub is not None:
                self.hub.send("BYE")
            return
        deadline = time.monotonic() + LINGER_S
        with self.joined:
            while not self._all_left() and time.monotonic() < deadline:
                self.joined.wait(max(0.0, deadline - time.monotonic()))

    def _all_left(self) -> bool:
        return all(p.left for p in self.peers.values())

    # ------------------------------------------------------------------ the main thread

    def failed(self, error: BaseException) -> BaseException:
        """What the main thread raises for ``error``, having told the other ranks. Another
        rank's failure, seen here as a failed collective, ends the process instead with the
        verdict's line."""
        if self.world.size == 1:
            return error
        if isinstance(error, AgreedError) or (isinstance(error, ValueError)
                                             and not self.training):
            self._take_over()
            self._leave()  # every rank raises it: each says it
            return error
        if isinstance(error, RuntimeError) and self.got_verdict.wait(VERDICT_WAIT_S):
            # Another rank's end, met here first: its verdict says whose.
            if self._claim():
                assert self.verdict is not None
                _say(self._stopped_line(self.verdict))
                self._let_go()
                os._exit(1)
            threading.Event().wait()  # the watcher thread is ending the process
        self._take_over()
        first = _line(str(error).splitlines()[0] if str(error).strip() else "")
        if isinstance(error, (tierstore.StoreError, OSError, ValueError)):
            verdict = f"{self.who(self.world.rank)} failed: {first}; once that is fixed, " \
                      f"{RESUME}"
            self._tell(verdict)
            return DistributedError(verdict)
        if isinstance(error, RuntimeError) and ("gloo" in str(error)
                                                or isinstance(error, dist.DistError)):
            verdict = f"{self.who(self.world.rank)}: a collective failed and no rank says " \
                      f"why ({first}); {RESUME}"
            self._tell(verdict)
            return DistributedError(verdict)
        self._tell(f"{self.who(self.world.rank)} failed: {type(error).__name__}: {first}")
        return error  # a fault of the program: its traceback is what helps

    def _take_over(self) -> None:
        """(The main thread.) End the rank itself, unless the watcher thread is already
        ending it with another rank's verdict: then that verdict is this rank's one line, and
        the main thread waits for the process to end rather than say a second."""
        with self.lock:
            waits = self.watcher_ends
            self.ending = True
        if waits:
            threading.Event().wait()

    def _tell(self, verdict: str) -> None:
        """(The main thread, ending the rank for its own error.) Tell the other ranks."""
        if self.world.rank != 0:
            if self.hub is not None:
                self.hub.send(f"ERR {_line(verdict)}")
            return
        self._broadcast(verdict)
        self._let_go()

    def _leave(self) -> None:
        """Leave without a failure: every rank raises the same error."""
        with self.lock:
            self.ending = True
        if self.world.rank == 0:
            for peer in self._live():
                peer.send("QUIT")
        elif self.hub is not None:
            self.hub.send("BYE")

    def close(self) -> None:
        """The run is done on this rank: say so, wait (the hub) until every rank has, and
        let go of the channel and the signals."""
        if self.thread is None:
            return
        with self.lock:
            self.stopping = True
        if self.world.rank != 0 and self.hub is not None:
            self.hub.send("BYE")
        self.thread.join(CLOSE_WAIT_S)
        for key in list(self.sel.get_map().values()):
            if isinstance(key.fileobj, socket.socket):
                key.fileobj.close()
        self.sel.close()
        if self._saved is not None:
            old_fd, old = self._saved
            signal.set_wakeup_fd(old_fd)
            for s, h in old.items():
                signal.signal(s, h)  # type: ignore[arg-type]
        if self._wake is not None:
            for fd in self._wake:
                os.close(fd)
        self.thread = None
