"""One rank of a ``tierstore bench dist`` configuration, started by torchrun.

``python -m torch.distributed.run --nnodes N --node-rank I --nproc-per-node M ...
-m tierstore.bench.dist_rank SPEC.json``. SPEC holds ``model`` (a preset name), ``steps``,
``seed``, ``hierarchical``, ``train`` (:class:`tierstore.trainer.TrainConfig` fields; ``batch_size`` is the
per-rank batch), ``store`` (a path with ``{node}`` for this node's index), ``paradigm``,
``host_cache`` and ``metrics`` (the per-rank JSON lines go to ``{metrics}.rank{r}``).

Each node's local rank 0 also records the peak resident set of the node's daemon (its
``VmHWM``, read after every step, since the daemon exits with the run) in
``{metrics}.daemon{node}``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from tierstore.trainer import TrainConfig
from tierstore.trainer.dist import train_distributed

import tierstore


def _vm_hwm(pid: int) -> int | None:
    """The peak resident set of process ``pid`` in bytes, or ``None`` where unreadable."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m tierstore.bench.dist_rank SPEC.json (under torchrun)",
              file=sys.stderr)
        return 2
    spec: dict[str, Any] = json.loads(Path(argv[0]).read_text())
    node = int(os.environ.get("GROUP_RANK", "0"))
    leader = int(os.environ.get("LOCAL_RANK", "0")) == 0
    store = spec["store"].format(node=node)
    # The trainer's default run directory: the daemon's socket is there.
    sock = f"{store.rstrip('/')}.run/daemon.sock"
    daemon: dict[str, Any] = {"node": node, "pid": None, "peak_rss_bytes": None}

    def on_step(_: dict[str, Any]) -> None:
        if not leader:
            return
        if daemon["pid"] is None:
            daemon["pid"] = int(tierstore.daemon_status(sock)["pid"])
        hwm = _vm_hwm(daemon["pid"])
        if hwm is not None:
            daemon["peak_rss_bytes"] = max(hwm, daemon["peak_rss_bytes"] or 0)

    train_distributed(spec["model"], int(spec["steps"]), int(spec.get("seed", 0)),
                      TrainConfig(**spec["train"]), store_path=store,
                      paradigm=spec["paradigm"], host_cache=int(spec["host_cache"]),
                      hierarchical=bool(spec.get("hierarchical", False)),
                      metrics_path=spec["metrics"], on_step=on_step,
                      pipeline=spec.get("pipeline"))
    if leader:
        Path(f"{spec['metrics']}.daemon{node}").write_text(json.dumps(daemon))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
