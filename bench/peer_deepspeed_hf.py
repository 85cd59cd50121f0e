"""A Hugging Face checkpoint fine-tuned by DeepSpeed ZeRO-3 with NVMe offload, the peer of
``tierstore bench train --model-dir DIR --peer deepspeed``.

The model is the checkpoint's own ``transformers`` class (``DeepseekV3ForCausalLM``, ...) with
its fused ``[E, ...]`` expert parameters, loaded by ``from_pretrained`` in fp32: not
DeepSpeed's MoE layer, which ZeRO-3 refuses (:mod:`.peer_deepspeed_moe`). It runs under
ZeRO-3 with ``offload_param`` and ``offload_optimizer`` on NVMe (a local folder), DeepSpeed's
CPU accelerator, a single-process gloo world, in a fresh process; each MoE block (the module
holding the ``experts``) is a ZeRO-3 leaf module, so a block's parameters are gathered when
it runs, as DeepSpeed advises for MoE blocks. It trains on the batches the store side
trained on (saved by the bench), with ``transformers``' own loss and the store trainer's
AdamW hyperparameters and clip, and reports what the store side reports: the median step
time over the measured steps, the peak RSS, the bytes written and read per step. Whatever
DeepSpeed raises instead is the result: its type, message and the DeepSpeed source line
(:func:`.peer_deepspeed_moe._refusal`).
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from typing import Any

from .peer_deepspeed_moe import (
    _dir_bytes,
    _ds_config,
    _io_bytes,
    _peak_rss,
    _refusal,
    _spawn,
    deepspeed_available,
)

MODULE = "tierstore.bench.peer_deepspeed_hf"


def _moe_blocks(model: Any) -> list[type]:
    """The classes of the modules that hold an ``experts`` child (a decoder layer's MoE
    block)."""
    from torch import nn

    return sorted({type(m) for m in model.modules()
                   if isinstance(getattr(m, "experts", None), nn.Module)},
                  key=lambda c: c.__name__)


def run_worker(model_dir: str, batches: str, nvme_dir: str, warmup: int) -> dict[str, Any]:
    """The DeepSpeed run, in this process (the one :func:`run_hf_peer` starts)."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    import torch
    from tierstore.trainer import TrainConfig
    from transformers import AutoModelForCausalLM

    data = torch.load(batches, weights_only=True)
    xs, ys, grad_accum = data["x"], data["y"], int(data["grad_accum"])
    tc = TrainConfig()
    cfg = _ds_config(3, nvme_dir, int(xs.shape[1]), offload_param=True)
    cfg["gradient_accumulation_steps"] = grad_accum
    cfg["gradient_clipping"] = tc.clip
    cfg["optimizer"]["params"].update(lr=float(data["lr"]), betas=list(tc.betas), eps=tc.eps,
                                      weight_decay=tc.weight_decay)
    out: dict[str, Any] = {"system": "deepspeed", "variant": "hf-zero3-nvme",
                           "deepspeed": deepspeed.__version__, "torch": torch.__version__,
                           "ds_config": cfg, "refused": [], "ran": False}
    try:
        deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
    except Exception as exc:  # noqa: BLE001 (the refusal is the result)
        out["refused"].append(_refusal(exc, "init_distributed"))
        return out
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    out["model_class"] = type(model).__name__
    blocks = _moe_blocks(model)
    out["leaf_modules"] = [c.__name__ for c in blocks]
    if blocks:
        deepspeed.utils.set_z3_leaf_modules(model, blocks)
    try:
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                          config=cfg)
    except Exception as exc:  # noqa: BLE001
        out["refused"].append(_refusal(exc, "deepspeed.initialize"))
        return out
    out["optimizer"] = type(engine.optimizer).__name__
    times: list[float] = []
    written: list[int] = []
    read: list[int] = []
    losses: list[float] = []
    steps = xs.shape[0] // grad_accum
    try:
        for step in range(steps):
            w, r, t = _io_bytes("write_bytes"), _io_bytes("read_bytes"), time.perf_counter()
            total = 0.0
            for i in range(step * grad_accum, (step + 1) * grad_accum):
                x, y = xs[i], ys[i]
                loss = engine(input_ids=x, labels=y, shift_labels=y, use_cache=False).loss
                engine.backward(loss)
                engine.step()  # DeepSpeed steps the optimizer at the accumulation boundary
                total += float(loss.detach()) / grad_accum
            times.append(time.perf_counter() - t)
            written.append(_io_bytes("write_bytes") - w)
            read.append(_io_bytes("read_bytes") - r)
            losses.append(total)
    except Exception as exc:  # noqa: BLE001
        out["refused"].append(_refusal(exc, f"training step {len(times) + 1}"))
        out["losses"] = losses
        return out
    measured = slice(warmup, None) if steps > warmup else slice(None)
    out.update({
        "ran": True, "losses": losses, "step_times_s": times,
        "step_time_s": statistics.median(times[measured]),
        "bytes_written_per_step": statistics.fmean(written[measured]),
        "bytes_read_per_step": statistics.fmean(read[measured]),
        "swap_dir_bytes": _dir_bytes(nvme_dir), "nvme_offload": _dir_bytes(nvme_dir) > 0,
        "peak_rss_bytes": _peak_rss(),
    })
    return out


def run_hf_peer(model_dir: str, batches: list[tuple[Any, Any]], grad_accum: int, lr: float,
                warmup: int, scratch: str, timeout: float = 1800.0) -> dict[str, Any]:
    """DeepSpeed ZeRO-3 with NVMe offload on ``model_dir``, trained on ``batches`` (every
    micro-batch of every step, in order) in a fresh process; ``{"cannot_run": why}`` without
    DeepSpeed."""
    missing = deepspeed_available()
    if missing:
        return {"system": "deepspeed", "ran": False, "cannot_run": missing, "refused": []}
    import torch

    os.makedirs(scratch, exist_ok=True)
    path = os.path.join(scratch, "batches.pt")
    torch.save({"x": torch.stack([x for x, _ in batches]),
                "y": torch.stack([y for _, y in batches]),
                "grad_accum": grad_accum, "lr": lr}, path)
    nvme = os.path.join(scratch, "nvme")
    os.makedirs(nvme, exist_ok=True)
    run = _spawn(["--worker", model_dir, path, nvme, str(warmup)], timeout, module=MODULE)
    if not run.get("ran"):
        run["cannot_run"] = "; ".join(
            f"{r['stage']}: {r['type']}: {r['message']}"
            + (f" ({r['raised_at']})" if r.get("raised_at") else "")
            for r in run.get("refused", [])) or "no result"
    return run


if __name__ == "__main__":  # the worker: --worker MODEL_DIR BATCHES NVME_DIR WARMUP
    import json

    if len(sys.argv) != 6 or sys.argv[1] != "--worker":
        sys.exit(f"usage: python -m {MODULE} --worker MODEL_DIR BATCHES NVME_DIR WARMUP")
    result = run_worker(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]))
    sys.stdout.write("\n" + json.dumps(result) + "\n")
