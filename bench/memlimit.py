"""Run a command as a fresh process under a memory limit, and account for what it used.

The limit is a new memory cgroup made inside this process's own (cgroup v1's ``memory``
controller, or cgroup v2 where the memory controller is enabled), so it nests under whatever
limits already apply. In both versions the page cache a process fills is charged to its
cgroup: a process that reads a file through the page cache pays for the pages it keeps, as
on a machine with that much memory. The kernel reclaims clean pages first and kills the
process when it cannot (an OOM kill, reported as such). Where no cgroup can be made (no
root, no memory controller), :func:`run_limited` runs the command without a limit and says
why in ``limit_skipped``.

Peak RSS comes from the child's own resource usage (``os.wait4``), with or without a limit;
with a cgroup, the cgroup's peak charge (page cache included) is reported too.

``python -m tierstore.bench.memlimit --limit 1GiB -- CMD ...`` runs one command so and prints
the accounting as JSON.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

NO_CGROUP = "skipped: no writable cgroup"


@dataclass
class LimitedRun:
    """What a command did under :func:`run_limited`."""

    returncode: int  # negative: killed by that signal
    stdout: str
    stderr: str
    wall_s: float
    peak_rss_bytes: int  # the child's maximum resident set size
    limit_bytes: int | None  # the limit asked for
    limit_applied: bool
    limit_skipped: str | None  # why no limit applied, when one was asked for
    cgroup_peak_bytes: int | None  # the cgroup's peak charge, page cache included
    oom_killed: bool  # the kernel killed it for memory (within the cgroup, or SIGKILL'd)
    failcnt: int | None  # times the cgroup hit its limit (cgroup v1)
    timed_out: bool

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.oom_killed and not self.timed_out

    def outcome(self) -> str:
        """One phrase: "ok", "killed by the kernel for memory (limit 1.4 GB)", ..."""
        if self.timed_out:
            return f"timed out after {self.wall_s:.0f} s"
        if self.oom_killed:
            where = f" (limit {self.limit_bytes / 1e9:.2f} GB)" if self.limit_applied else ""
            return f"killed by the kernel for memory{where}"
        if self.returncode < 0:
            return f"killed by signal {signal.Signals(-self.returncode).name}"
        if self.returncode:
            return f"exit status {self.returncode}"
        return "ok"

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("stdout")
        d["stderr_tail"] = d.pop("stderr")[-2000:]
        d["outcome"] = self.outcome()
        return d


def _mounts() -> tuple[str | None, str | None]:
    """(cgroup v1 memory mount, cgroup v2 mount) from this process's mount table."""
    v1 = v2 = None
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                left, _, right = line.partition(" - ")
                fields, kind = left.split(), right.split()
                if not kind:
                    continue
                if kind[0] == "cgroup" and "memory" in kind[-1].split(","):
                    v1 = fields[4]
                elif kind[0] == "cgroup2":
                    v2 = fields[4]
    except OSError:
        pass
    return v1, v2


def _own_cgroup(version: int) -> str | None:
    """This process's cgroup path (v1: of the memory controller)."""
    try:
        with open("/proc/self/cgroup") as f:
            for line in f:
                _, controllers, path = line.rstrip("\n").split(":", 2)
                if version == 1 and "memory" in controllers.split(","):
                    return path
                if version == 2 and controllers == "":
                    return path
    except (OSError, ValueError):
        pass
    return None


class _Cgroup:
    """A fresh memory cgroup under this process's own, removed by :meth:`remove`."""

    def __init__(self, path: str, version: int) -> None:
        self.path, self.version = path, version

    def _write(self, name: str, value: str) -> None:
        with open(os.path.join(self.path, name), "w") as f:
            f.write(value)

    def _read(self, name: str) -> str | None:
        try:
            with open(os.path.join(self.path, name)) as f:
                return f.read()
        except OSError:
            return None

    def set_limit(self, nbytes: int) -> None:
        if self.version == 1:
            self._write("memory.limit_in_bytes", str(nbytes))
            # With swap accounting, limit memory and swap together: swapping out would
            # only hide what the process needs.
            with contextlib.suppress(OSError):
                self._write("memory.memsw.limit_in_bytes", str(nbytes))
        else:
            self._write("memory.max", str(nbytes))
            with contextlib.suppress(OSError):
                self._write("memory.swap.max", "0")

    def peak(self) -> int | None:
        raw = self._read("memory.max_usage_in_bytes" if self.version == 1 else "memory.peak")
        return int(raw) if raw and raw.strip().isdigit() else None

    def failcnt(self) -> int | None:
        raw = self._read("memory.failcnt") if self.version == 1 else None
        return int(raw) if raw and raw.strip().isdigit() else None

    def oom_kills(self) -> int:
        raw = self._read("memory.oom_control" if self.version == 1 else "memory.events") or ""
        for line in raw.splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill" and value.strip().isdigit():
                return int(value)
        return 0

    def remove(self) -> None:
        # The child has exited; its page cache charge moves to the parent (v1) or is
        # dropped with the group. A few tries, as the kernel may still be tearing it down.
        for _ in range(50):
            try:
                os.rmdir(self.path)
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.02)


def make_cgroup() -> tuple[_Cgroup | None, str | None]:
    """A fresh memory cgroup under this process's own, or (None, why not)."""
    v1, v2 = _mounts()
    name = f"tierstore-limit-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    reasons = []
    for version, mount in ((1, v1), (2, v2)):
        if mount is None:
            continue
        own = _own_cgroup(version)
        if own is None:
            continue
        parent = os.path.join(mount, own.lstrip("/"))
        if version == 2:
            try:
                with open(os.path.join(parent, "cgroup.controllers")) as f:
                    if "memory" not in f.read().split():
                        reasons.append("cgroup v2 without the memory controller")
                        continue
            except OSError:
                continue
        path = os.path.join(parent, name)
        try:
            os.mkdir(path)
        except OSError as e:
            reasons.append(f"cgroup v{version}: {e.strerror}")
            continue
        cg = _Cgroup(path, version)
        if version == 2 and not os.path.exists(os.path.join(path, "memory.max")):
            cg.remove()
            reasons.append("cgroup v2: memory controller not delegated")
            continue
        return cg, None
    detail = "; ".join(reasons) if reasons else "no memory cgroup mounted"
    return None, f"{NO_CGROUP} ({detail})"


def cgroup_available() -> str | None:
    """None where :func:`run_limited` can apply a limit, else the reason it cannot."""
    cg, why = make_cgroup()
    if cg is not None:
        cg.remove()
    return why


def drop_page_cache() -> str | None:
    """Write back dirty pages and drop the page cache; None if done, else why not."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    except OSError as e:
        return f"page cache not dropped ({e.strerror}): warm"
    return None


# The command's parent: a bare interpreter (about 8 MB) that joins the cgroup, forks, execs
# the command in the child and reports the child's rusage. A child's peak RSS includes what
# it had before exec, so a command forked straight from a large process (a benchmark with
# torch loaded) would report that process's size when it is itself smaller.
_LAUNCHER = """
import json, os, sys
procs, report, cmd = sys.argv[1], sys.argv[2], sys.argv[3:]
if procs:
    with open(procs, "w") as f:
        f.write(str(os.getpid()))
try:
    pid = os.fork()
except OSError as e:
    sys.stderr.write(f"{cmd[0]}: {e.strerror}\\n")
    sys.exit(127)
if pid == 0:
    try:
        os.execvp(cmd[0], cmd)
    except OSError as e:
        sys.stderr.write(f"{cmd[0]}: {e.strerror}\\n")
    os._exit(127)
_, status, usage = os.wait4(pid, 0)
with open(report, "w") as f:
    json.dump({"status": status, "maxrss_kib": usage.ru_maxrss}, f)
"""


def run_limited(cmd: Sequence[str], limit_bytes: int | None = None, *,
                timeout: float | None = None, env: dict[str, str] | None = None,
                cwd: str | None = None) -> LimitedRun:
    """Run ``cmd`` as a fresh process, in a fresh memory cgroup (limited to ``limit_bytes``
    if given, else only accounted), and wait for it. Never raises for what the command
    does (a command that cannot be started exits with status 127)."""
    cg, why = make_cgroup()
    if cg is not None and limit_bytes is not None:
        try:
            cg.set_limit(int(limit_bytes))
        except OSError as e:
            cg.remove()
            cg, why = None, f"{NO_CGROUP} (setting the limit: {e.strerror})"
    procs = os.path.join(cg.path, "cgroup.procs") if cg is not None else ""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err, \
            tempfile.NamedTemporaryFile(suffix=".json") as report:
        t0 = time.perf_counter()
        proc = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", _LAUNCHER, procs, report.name, *cmd],
            stdout=out, stderr=err, env=env, cwd=cwd, start_new_session=True)
        timed_out = False
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            os.killpg(proc.pid, signal.SIGKILL)  # the launcher and the command
            proc.wait()
        wall = time.perf_counter() - t0
        out.seek(0)
        err.seek(0)
        stdout = out.read().decode(errors="replace")
        stderr = err.read().decode(errors="replace")
        try:
            with open(report.name) as f:
                got = json.load(f)
            returncode = os.waitstatus_to_exitcode(got["status"])
            peak_rss = int(got["maxrss_kib"]) * 1024
        except (OSError, ValueError, KeyError):  # the launcher itself was killed
            returncode, peak_rss = proc.returncode, 0
    limited = cg is not None and limit_bytes is not None
    try:
        oom = cg.oom_kills() > 0 if cg is not None else False
        # Without a cgroup's count, a SIGKILL nobody here sent is the kernel's OOM killer.
        if not oom and not timed_out and cg is None and returncode == -signal.SIGKILL:
            oom = True
        peak = cg.peak() if cg is not None else None
        fails = cg.failcnt() if cg is not None else None
    finally:
        if cg is not None:
            cg.remove()
    return LimitedRun(
        returncode=returncode, stdout=stdout, stderr=stderr, wall_s=wall,
        peak_rss_bytes=peak_rss, limit_bytes=limit_bytes, limit_applied=limited,
        limit_skipped=None if limited or limit_bytes is None else why,
        cgroup_peak_bytes=peak, oom_killed=oom, failcnt=fails, timed_out=timed_out)


def main(argv: Sequence[str] | None = None) -> int:
    import argparse

    from tierstore.sizes import parse_size

    p = argparse.ArgumentParser(
        prog="python -m tierstore.bench.memlimit",
        description="Run a command in a fresh memory cgroup (page cache included) and print "
                    "its peak RSS, the cgroup's peak and whether it was killed for memory.")
    p.add_argument("--limit", help="Memory limit (bytes or a size such as 1GiB); none: "
                                   "account only.")
    p.add_argument("--cold", action="store_true", help="Drop the page cache first.")
    p.add_argument("--timeout", type=float, help="Kill the command after this many seconds.")
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="-- the command and its arguments")
    a = p.parse_args(argv)
    cmd = a.cmd[1:] if a.cmd[:1] == ["--"] else a.cmd
    if not cmd:
        p.error("give the command after --")
    try:
        limit = parse_size(a.limit) if a.limit else None
    except ValueError as e:
        p.error(str(e))
    cold = drop_page_cache() if a.cold else None
    run = run_limited(cmd, limit, timeout=a.timeout)
    sys.stdout.write(run.stdout)
    sys.stderr.write(run.stderr)
    print(json.dumps({**run.to_dict(), "cache": cold or ("dropped" if a.cold else "warm")}))
    return 0 if run.ok else 1


if __name__ == "__main__":
    sys.exit(main())
