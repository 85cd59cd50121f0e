"""LMDB itself as the judge of a catalog file: a helper process that, for each file path it
reads on stdin, forks a child that maps the file with LMDB and touches everything LMDB
would (every key and value of the main database and of each named one, a compact copy,
then write transactions that take up every free page the file lists) and answers with the
child's fate: ``ok``, ``signal N`` (SIGBUS: LMDB touched a page the file lacks) or
``error TEXT`` (LMDB reported damage). Forked from a process that runs no threads, so each
judgement costs a millisecond or two, not an interpreter's start."""

from __future__ import annotations

import os
import sys

import lmdb


def touch_everything(path: str) -> None:
    size = os.path.getsize(path)
    env = lmdb.open(path, subdir=False, lock=False, sync=False, metasync=False, max_dbs=1024,
                    map_size=max(1 << 30, 8 * size))
    with env.begin(write=True) as txn:
        names = [k for k, _ in txn.cursor()]
        for name in names:
            try:
                db = env.open_db(name, txn=txn, create=False)
            except lmdb.Error:
                continue  # a plain key of the main database
            for _k, v in txn.cursor(db=db):
                bytes(v)
    with open(os.devnull, "wb") as null:
        env.copyfd(null.fileno(), compact=True)
    # A value larger than the file needs more free pages than the file lists, so LMDB reads
    # every free-list record older than the oldest snapshot it keeps; the third transaction
    # has read those of the last commit before this process opened the file too.
    for _ in range(3):
        with env.begin(write=True) as txn:
            txn.put(b"\xff-oracle", b"x" * (size + (1 << 16)))
    env.close()


def main() -> None:
    for line in sys.stdin:
        pid = os.fork()
        if pid == 0:
            try:
                touch_everything(line.rstrip("\n"))
            except lmdb.Error as e:
                sys.stdout.write(f"error {type(e).__name__}\n")
                sys.stdout.flush()
                os._exit(3)
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        if os.WIFSIGNALED(status):
            sys.stdout.write(f"signal {os.WTERMSIG(status)}\n")
        elif os.WEXITSTATUS(status) == 0:
            sys.stdout.write("ok\n")
        elif os.WEXITSTATUS(status) != 3:
            sys.stdout.write(f"exit {os.WEXITSTATUS(status)}\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
