"""The daemon's now-and-then log: a flood of refusals (connection limit, out of file
descriptors) is one line a minute that counts them, from the accept loop and connection
threads alike. A real Server on a real store, its clock injected."""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import pytest
from test_daemon_clients import _store

from tierstore.daemon.server import LOG_EVERY_S, Server


class Logged(NamedTuple):
    srv: Server
    logs: list[str]  # what it logged
    now: list[float]  # its clock, set by the test


@pytest.fixture
def logged(tmp_path: Path) -> Iterator[Logged]:
    """A daemon on a real store whose log lines are kept and whose clock the test sets."""
    _store(tmp_path / "store")
    logs: list[str] = []
    srv = Server(str(tmp_path / "store"), str(tmp_path / "s.sock"), host_cache="4MiB",
                 log=logs.append)
    now = [1000.0]
    srv._clock = lambda: now[0]
    try:
        yield Logged(srv, logs, now)
    finally:
        srv.shutdown()


def test_limit_and_descriptor_messages_are_logged_now_and_then(logged: Logged) -> None:
    srv, logs, now = logged
    for t in (0, 1, 2, LOG_EVERY_S - 1):  # the first at once, then quiet for a while
        now[0] = 1000.0 + t
        srv._log_now_and_then("limit", "at the limit")
    srv._log_now_and_then("accept", "out of descriptors")  # its own clock
    now[0] = 1000.0 + LOG_EVERY_S
    srv._log_now_and_then("limit", "at the limit")
    now[0] = 1000.0 + 10 * LOG_EVERY_S  # a day later, say: full again
    srv._log_now_and_then("limit", "at the limit")
    assert logs == ["at the limit", "out of descriptors",
                    "at the limit (4 times since the last report)", "at the limit"]


def test_refusals_from_many_threads_are_all_counted(logged: Logged) -> None:
    """The accept loop and connection threads refuse at once: one line, no count lost."""
    srv, logs, now = logged
    start = threading.Barrier(4)

    def refuse_many() -> None:
        start.wait()
        for _ in range(2000):
            srv._log_now_and_then("limit", "at the limit")

    threads = [threading.Thread(target=refuse_many) for _ in range(4)]
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads taking turns often, as on a busy daemon
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(switch)
    now[0] += LOG_EVERY_S
    srv._log_now_and_then("limit", "at the limit")
    assert logs == ["at the limit", "at the limit (8000 times since the last report)"]
