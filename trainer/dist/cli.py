"""What ``tierstore train --distributed`` runs on each rank: the distributed trainer, with
the progress bar and the closing summary on rank 0 only."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from ..train.cli_train import resolve_device, summarise
from ..train.resident import Metrics
from .trainer import train_distributed


def _postfix(m: Metrics) -> str:
    moved = m["moved_bytes_total"] / 1e6
    return (f"loss {m['loss']:.3f} {m['tokens_per_s']:,.0f} tok/s moved {moved:,.1f} MB "
            f"stall {m.get('stall_frac', 0.0):.0%}")


def run_distributed(*, store: str | None, connect: str | None, run_dir: str | None,
                    model: str | None, steps: int, seed: int | None, daemon: dict[str, Any],
                    paradigm: str, credits: int | None, hierarchical: bool,
                    pipeline: str | None, failure_timeout: float | None = None,
                    checkpoint_every: int, resume: bool,
                    metrics: str | None, corpus: Sequence[str], overrides: dict[str, Any],
                    device: str, echo: Callable[[str], Any] = print,
                    node_stores: Sequence[str] = ()) -> list[Metrics]:
    """``tierstore train --distributed`` on this rank (see :func:`train_distributed`);
    ``daemon`` holds its ``host_cache``, ``backing``, ``pmem_path``, ``pmem_size`` and
    ``slab_size`` (None where not given)."""
    import os

    from tqdm import tqdm

    if store is None:
        raise ValueError("--distributed needs --store: this node's store directory")
    rank = int(os.environ.get("RANK", "0"))
    # No --model: the node stores' import, the run --resume continues, or the tiny preset
    # (train_distributed decides, from what the stores hold).
    with tqdm(total=steps, desc=f"train x{os.environ.get('WORLD_SIZE', '?')}", unit="step",
              disable=None if rank == 0 else True, dynamic_ncols=True) as bar:

        def on_step(m: Metrics) -> None:
            bar.update(m["step"] - bar.n)
            bar.set_postfix_str(_postfix(m), refresh=False)

        history = train_distributed(
            model, steps, seed if seed is not None or resume else 0,
            store_path=store, connect=connect, run_dir=run_dir, **daemon,
            paradigm=paradigm, credits=credits, hierarchical=hierarchical, pipeline=pipeline,
            **({} if failure_timeout is None else {"failure_timeout_s": failure_timeout}),
            checkpoint_every=checkpoint_every,
            resume=resume, metrics_path=metrics, corpus_paths=list(corpus) or None,
            device=resolve_device(device), overrides=overrides, on_step=on_step,
            node_stores=node_stores)
    if rank == 0:
        for line in summarise(history, "distributed"):
            echo(line)
        if history:
            moved = sum(m["moved_bytes_total"] for m in history) / len(history)
            echo(f"bytes moved between ranks per step (all ranks): {moved / 1e6:,.2f} MB")
    return history
