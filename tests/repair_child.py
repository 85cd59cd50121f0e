"""A helper process for the repair kill campaign (tests/test_store_repair_kills.py).

It imports tierstore once, then for each request on stdin forks a child that runs
``tierstore.repair_store`` on a store, so each run costs a fork, not an interpreter's start.
A request is ``STORE STEP DELAY``:

- ``STEP`` > 0: the child SIGKILLs itself just before its STEP-th step, a step being each
  call that changes or syncs files (rename, replace, fsync, makedirs, rmtree, unlink,
  copyfile) and each catalog commit (before it, and again after it has committed);
- ``DELAY`` >= 0: the helper SIGKILLs the child that many seconds after forking it.

The answer is one line: ``ok STEPS SECONDS`` (the run finished: its step count and time),
``killed``, or ``error MESSAGE`` (the repair raised). With ``REPAIR_CHILD_LOG`` set, each
request and its answer are also written to stderr.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import time
from collections.abc import Callable
from typing import Any

import tierstore
from tierstore.catalog import Catalog


def instrument(kill_at: int) -> Callable[[], int]:
    """Count steps (see the module doc), dying at step ``kill_at``; returns the counter."""
    steps = [0]

    def step() -> None:
        steps[0] += 1
        if steps[0] == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)

    def counted(fn: Callable[..., Any]) -> Callable[..., Any]:
        def run(*a: Any, **k: Any) -> Any:
            step()
            return fn(*a, **k)
        return run

    for mod, name in [(os, "rename"), (os, "replace"), (os, "fsync"), (os, "makedirs"),
                      (os, "unlink"), (shutil, "rmtree"), (shutil, "copyfile")]:
        setattr(mod, name, counted(getattr(mod, name)))
    write = Catalog.write

    def committed(self: Catalog, *a: Any, **k: Any) -> Any:
        step()
        out = write(self, *a, **k)
        step()
        return out

    Catalog.write = committed  # type: ignore[method-assign]
    return lambda: steps[0]


def child(store: str, kill_at: int, out: int) -> None:
    steps = instrument(kill_at)
    t0 = time.perf_counter()
    try:
        tierstore.repair_store(store)
    except tierstore.StoreError as e:
        os.write(out, f"error {e}".encode())
        os._exit(1)
    os.write(out, f"ok {steps()} {time.perf_counter() - t0:.4f}".encode())
    os._exit(0)


def main() -> None:
    for line in sys.stdin:
        store, kill_at, delay = line.split()
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            child(store, int(kill_at), w)
        os.close(w)
        if float(delay) >= 0:
            time.sleep(float(delay))
            os.kill(pid, signal.SIGKILL)  # a child that finished already is a zombie: no-op
        _, status = os.waitpid(pid, 0)
        said = b""
        while chunk := os.read(r, 65536):
            said += chunk
        os.close(r)
        answer = said.decode() if said else "killed"
        if os.WIFSIGNALED(status) and not said.startswith(b"ok"):
            answer = "killed"
        if os.environ.get("REPAIR_CHILD_LOG"):
            print(store, kill_at, delay, answer, file=sys.stderr)
        sys.stdout.write(answer.replace("\n", " ") + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
