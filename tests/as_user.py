"""Run ``tierstore ARGS`` as another user: ``python tests/as_user.py UID GID ARGS...``.

The interpreter and the modules a daemon needs are loaded first, as the caller (root), and
only then are the process's user, group and supplementary groups dropped to UID and GID
for good: the interpreter may live where that user cannot read (under /root, say), while
the daemon that then runs, and every file it makes, is the other user's, as the kernel
sees it (SO_PEERCRED, file owners)."""

from __future__ import annotations

import os
import sys

import tierstore.nvme  # noqa: F401
import tierstore.pmem  # noqa: F401

import tierstore.cli
import tierstore.daemon.server  # noqa: F401  (loaded before the user is dropped)


def main() -> None:
    uid, gid = int(sys.argv[1]), int(sys.argv[2])
    os.setgroups([])
    os.setgid(gid)
    os.setuid(uid)
    sys.argv = ["tierstore", *sys.argv[3:]]
    tierstore.cli.main()


if __name__ == "__main__":
    main()
