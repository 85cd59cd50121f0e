"""The same MoE trained by DeepSpeed with its states on NVMe, beside tierstore's store trainer.

DeepSpeed offloads to NVMe in two places: ZeRO-3 (ZeRO-Infinity) swaps parameters
(``offload_param``) and optimizer states (``offload_optimizer``) to an ``nvme_path`` through
its ``async_io`` op; ZeRO-1/2 accept ``offload_optimizer.device: nvme`` in the config but only
the ``cpu`` device offloads there. Its own MoE layer (``deepspeed.moe.layer.MoE``) is refused
under ZeRO-3. So a preset is tried three ways, each in a fresh single-process world (gloo,
``WORLD_SIZE=1``, ``DS_ACCELERATOR=cpu``), and each refusal is recorded with its exception and
the DeepSpeed source line that raised it:

- ``native-moe-zero3``: the preset's shape with ``deepspeed.moe.layer.MoE`` (SwiGLU experts,
  top-k gate, no token dropping) under ZeRO-3 with parameters and optimizer on NVMe.
- ``native-moe-zero2``: the same model under ZeRO-2 with ``offload_optimizer.device: nvme``.
- ``torch-moe-zero3``: tierstore's own model (:class:`tierstore.trainer.MoEModel`, every
  expert a plain parameter) under ZeRO-3 with parameters and optimizer on NVMe; each
  transformer block is a ZeRO-3 leaf module, so all of a block's parameters (its experts
  included) are gathered when the block runs, as DeepSpeed advises for MoE blocks.

Each run reports its median step time (forward, backward and optimizer step, after the first
step), the bytes the process wrote per step (``/proc/self/io`` ``write_bytes``: DeepSpeed's
``O_DIRECT`` swap writes count there when issued), the bytes in the swap folder and its peak
RSS. :func:`run_tierstore` measures tierstore's store trainer the same way.

Command line (one JSON document to ``--json`` and stdout)::

    python -m tierstore.bench.peer_deepspeed_moe --model tiny --steps 5 --json out.json \\
        [--ours] [--nvme-dir DIR] [--variants torch-moe-zero3,native-moe-zero3]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Sequence
from typing import Any

VARIANTS = ("native-moe-zero3", "native-moe-zero2", "torch-moe-zero3")
MODULE = "tierstore.bench.peer_deepspeed_moe"
# What a step does in both systems: the store trainer's defaults (TrainConfig).
LR, BETAS, EPS, WEIGHT_DECAY, CLIP = 3e-3, (0.9, 0.95), 1e-8, 0.1, 1.0


def deepspeed_available() -> str | None:
    """``None`` when DeepSpeed can be imported, else why not (checked without importing it)."""
    if importlib.util.find_spec("deepspeed") is None:
        return "deepspeed is not installed"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _io_bytes(field: str) -> int:
    """``read_bytes`` or ``write_bytes`` of this process (all its threads): the bytes it
    caused to be read from or written to storage; -1 where ``/proc/self/io`` is absent."""
    try:
        with open("/proc/self/io") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return -1


def _write_bytes() -> int:
    return _io_bytes("write_bytes")


def _dir_bytes(path: str) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):  # a file removed while walking
                total += os.path.getsize(os.path.join(root, name))
    return total


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def _refusal(exc: BaseException, stage: str) -> dict[str, Any]:
    """The exception and the innermost DeepSpeed frame that raised it."""
    frames = traceback.extract_tb(exc.__traceback__)
    ds = [f for f in frames if f"{os.sep}deepspeed{os.sep}" in f.filename]
    where = None
    if ds:
        f = ds[-1]
        rel = f.filename[f.filename.rindex(f"{os.sep}deepspeed{os.sep}") + 1:]
        where = f"{rel}:{f.lineno} in {f.name}"
    return {"stage": stage, "type": type(exc).__name__,
            "message": str(exc).strip().splitlines()[0] if str(exc).strip() else "",
            "raised_at": where}


# --- the runs (each in its own process) --------------------------------------------------

def _ds_config(stage: int, nvme: str, batch: int, offload_param: bool) -> dict[str, Any]:
    aio = {"block_size": 1 << 20, "queue_depth": 8, "intra_op_parallelism": 1,
           "single_submit": False, "overlap_events": True}
    zero: dict[str, Any] = {
        "stage": stage,
        "offload_optimizer": {"device": "nvme", "nvme_path": nvme, "pin_memory": False},
    }
    if offload_param:
        zero["offload_param"] = {"device": "nvme", "nvme_path": nvme, "pin_memory": False,
                                 "buffer_count": 5, "buffer_size": 1 << 24,
                                 "max_in_cpu": 0}
    if stage == 3:
        # Everything goes through NVMe: no parameter stays resident between uses.
        zero.update({"stage3_param_persistence_threshold": 0,
                     "stage3_max_live_parameters": 1 << 24,
                     "stage3_prefetch_bucket_size": 1 << 22})
    return {
        "train_micro_batch_size_per_gpu": batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": CLIP,
        "optimizer": {"type": "AdamW", "params": {
            "lr": LR, "betas": list(BETAS), "eps": EPS, "weight_decay": WEIGHT_DECAY}},
        "zero_optimization": zero,
        "aio": aio,
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }


def _native_model(cfg: Any) -> Any:
    """The preset's shape with DeepSpeed's MoE layer as every MoE FFN."""
    import torch
    import torch.nn.functional as F
    from deepspeed.moe.layer import MoE
    from torch import nn

    class SwiGLU(nn.Module):
        def __init__(self, d: int, ff: int) -> None:
            super().__init__()
            self.w1 = nn.Linear(d, ff, bias=False)
            self.w2 = nn.Linear(ff, d, bias=False)
            self.w3 = nn.Linear(d, ff, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.w2(F.silu(self.w1(x)) * self.w3(x))

    def rope(x: torch.Tensor) -> torch.Tensor:
        t, hd = x.shape[-2], x.shape[-1]
        inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2).float() / hd))
        ang = torch.arange(t).float()[:, None] * inv
        cos, sin = torch.cat((ang, ang), -1).cos(), torch.cat((ang, ang), -1).sin()
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat((-x2, x1), -1) * sin

    class Block(nn.Module):
        def __init__(self, layer: int) -> None:
            super().__init__()
            d = cfg.d_model
            self.attn_norm, self.ffn_norm = nn.RMSNorm(d, cfg.norm_eps), nn.RMSNorm(d, cfg.norm_eps)
            self.qkv, self.wo = nn.Linear(d, 3 * d, bias=False), nn.Linear(d, d, bias=False)
            self.moe = MoE(d, SwiGLU(d, cfg.d_ff), num_experts=cfg.n_experts, ep_size=1,
                           k=cfg.top_k, drop_tokens=False, use_rts=False,
                           top2_2nd_expert_sampling=False) if cfg.is_moe(layer) else None
            self.mlp = None if self.moe is not None else SwiGLU(d, cfg.dense_ff)

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            b, t, d = x.shape
            q, k, v = self.qkv(self.attn_norm(x)).view(b, t, 3, cfg.n_heads, -1).unbind(2)
            q, k, v = (z.transpose(1, 2) for z in (q, k, v))
            y = F.scaled_dot_product_attention(rope(q), rope(k), v, is_causal=True)
            x = x + self.wo(y.transpose(1, 2).reshape(b, t, d))
            h = self.ffn_norm(x)
            if self.moe is None:
                return x + self.mlp(h), x.new_zeros(())
            out, l_aux, _ = self.moe(h)
            return x + out, l_aux

    class NativeMoE(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
            self.layers = nn.ModuleList(Block(i) for i in range(cfg.n_layers))
            self.norm = nn.RMSNorm(cfg.d_model, cfg.norm_eps)
            self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

        def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            x = self.tok_emb(idx)
            aux = []
            for blk in self.layers:
                x, a = blk(x)
                aux.append(a)
            logits = self.lm_head(self.norm(x)).float()
            ce = F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))
            return ce + cfg.router_aux_coef * torch.stack(aux).mean()

    return NativeMoE()


def _torch_model(cfg: Any) -> Any:
    """tierstore's model, resident experts, made fit for ZeRO-3 parameter partitioning."""
    import deepspeed
    from tierstore.trainer import MoEModel

    model = MoEModel(cfg, seed=0, resident_experts=True)
    # Experts are used through their parameters, never their forward: gather a whole block
    # when it runs. The head is read by the model's own forward, not the Linear's.
    deepspeed.utils.set_z3_leaf_modules(model, [type(model.layers[0])])
    if model.lm_head is not None:
        deepspeed.zero.register_external_parameter(model, model.lm_head.weight)
    return model


def run_variant(variant: str, model: str, steps: int, nvme_dir: str, batch_size: int,
                seq_len: int, seed: int = 0) -> dict[str, Any]:
    """One DeepSpeed run in this process (the subprocess :func:`run_peer` starts)."""
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    for k, v in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                 "MASTER_ADDR": "127.0.0.1"}.items():
        os.environ.setdefault(k, v)
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    import deepspeed
    import torch
    from tierstore.trainer import PRESETS, BatchSampler, load_corpus, model_size

    torch.manual_seed(seed)
    cfg = PRESETS[model]
    stage = 2 if variant == "native-moe-zero2" else 3
    ds_cfg = _ds_config(stage, nvme_dir, batch_size, offload_param=stage == 3)
    size = model_size(cfg)
    out: dict[str, Any] = {
        "variant": variant, "model": model, "deepspeed": deepspeed.__version__,
        "torch": torch.__version__, "accelerator": os.environ["DS_ACCELERATOR"],
        "batch_size": batch_size, "seq_len": seq_len, "steps": steps,
        "expert_params": size.expert_params, "dense_params": size.dense_params,
        "ds_config": ds_cfg, "refused": [], "ran": False,
    }
    try:
        deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
    except Exception as exc:  # noqa: BLE001 (the refusal is the result)
        out["refused"].append(_refusal(exc, "init_distributed"))
        return out
    out["comm_backend"] = torch.distributed.get_backend()
    net = _native_model(cfg) if variant.startswith("native") else _torch_model(cfg)
    params: Any = net.parameters()
    if variant.startswith("native"):
        from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
        params = split_params_into_different_moe_groups_for_optimizer(
            {"params": list(net.parameters()), "name": "parameters"})
    out["model_params"] = sum(p.numel() for p in net.parameters())
    if stage == 3:
        # ZeRO-3 swaps a parameter partition to NVMe only from MIN_AIO_BYTES (and the aio
        # block size) up; smaller ones stay in host memory whatever offload_param says.
        from deepspeed.runtime.swap_tensor.utils import MIN_AIO_BYTES
        floor = max(MIN_AIO_BYTES, ds_cfg["aio"]["block_size"])
        big = [p.numel() for p in net.parameters() if p.numel() * p.element_size() >= floor]
        out["param_swap_floor_bytes"] = floor
        out["params_swappable"] = sum(big)
        out["param_tensors_swappable"] = len(big)
    w0 = _write_bytes()
    try:
        engine, *_ = deepspeed.initialize(model=net, model_parameters=params, config=ds_cfg)
    except Exception as exc:  # noqa: BLE001
        out["refused"].append(_refusal(exc, "deepspeed.initialize"))
        return out
    out["optimizer"] = type(engine.optimizer).__name__
    out["basic_optimizer"] = type(getattr(engine, "basic_optimizer", None)).__name__
    out["init_bytes_written"] = _write_bytes() - w0
    corpus = load_corpus(None, max_bytes=8 << 20, val_fraction=0.1)
    sampler = BatchSampler(corpus.train, batch_size, seq_len, seed)
    times, written, read, losses = [], [], [], []
    try:
        for _ in range(steps):
            x, y = sampler.next_batch()
            w, r, t = _write_bytes(), _io_bytes("read_bytes"), time.perf_counter()
            res = engine(x, y)
            loss = res if isinstance(res, torch.Tensor) else res[1]
            engine.backward(loss)
            engine.step()
            times.append(time.perf_counter() - t)
            written.append(_write_bytes() - w)
            read.append(_io_bytes("read_bytes") - r)
            losses.append(float(loss.detach()))
    except Exception as exc:  # noqa: BLE001
        out["refused"].append(_refusal(exc, f"training step {len(times) + 1}"))
        return out
    measured = slice(1, None) if steps > 1 else slice(None)
    out.update({
        "ran": True, "losses": losses, "step_times_s": times, "bytes_written_per_step": written,
        "step_time_s": statistics.median(times[measured]),
        "bytes_written_nvme": int(statistics.fmean(written[measured])),
        "bytes_read_per_step": read,
        "bytes_read_nvme": int(statistics.fmean(read[measured])),
        "swap_dir_bytes": _dir_bytes(nvme_dir),
        "swap_dir_bytes_by_folder": {
            name: _dir_bytes(os.path.join(nvme_dir, "zero_stage_3", name))
            for name in sorted(os.listdir(os.path.join(nvme_dir, "zero_stage_3")))
        } if os.path.isdir(os.path.join(nvme_dir, "zero_stage_3")) else {},
        "nvme_offload": _dir_bytes(nvme_dir) > 0,
        "peak_rss_bytes": _peak_rss(),
    })
    return out


def run_ours(model: str, steps: int, store_dir: str, batch_size: int, seq_len: int,
             host_cache: str, seed: int = 0) -> dict[str, Any]:
    """tierstore's store trainer on the same preset and batch, measured as the peer is."""
    from tierstore.trainer import TrainConfig, train_store

    tc = TrainConfig(batch_size=batch_size, seq_len=seq_len, eval_every=0, lr=LR,
                     betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY, clip=CLIP)
    marks: list[tuple[int, int]] = [(_write_bytes(), _io_bytes("read_bytes"))]
    w0 = marks[0][0]
    hist = train_store(model, steps, seed, tc, store_path=store_dir, host_cache=host_cache,
                       on_step=lambda m: marks.append((_write_bytes(), _io_bytes("read_bytes"))))
    written = [b[0] - a[0] for a, b in zip(marks, marks[1:])]
    read = [b[1] - a[1] for a, b in zip(marks, marks[1:])]
    measured = slice(1, None) if steps > 1 else slice(None)
    times = [m["step_time_s"] for m in hist]
    return {
        "system": "tierstore", "model": model, "batch_size": batch_size, "seq_len": seq_len,
        "steps": steps, "host_cache": host_cache, "ran": True,
        "losses": [float(m["loss"]) for m in hist], "step_times_s": times,
        "step_time_s": statistics.median(times[measured]),
        # on_step runs once per step, so the first step's delta holds the store's creation
        "bytes_written_per_step": written,
        "bytes_written_nvme": int(statistics.fmean(written[measured])) if written else -1,
        "bytes_read_per_step": read,
        "bytes_read_nvme": int(statistics.fmean(read[measured])) if read else -1,
        "store_bytes_written_per_step": int(statistics.fmean(
            m["bytes_written"] for m in hist[measured])),
        "store_bytes_read_per_step": int(statistics.fmean(
            m["bytes_read"] for m in hist[measured])),
        "process_bytes_written": _write_bytes() - w0,
        "store_dir_bytes": _dir_bytes(store_dir),
        "peak_rss_bytes": _peak_rss(),
    }


# --- the driver --------------------------------------------------------------------------

def _spawn(args: list[str], timeout: float, module: str = MODULE) -> dict[str, Any]:
    """``python -m module *args`` in a single-process DeepSpeed world; the last JSON line it
    prints, or its failure as a refusal."""
    env = dict(os.environ, DS_ACCELERATOR="cpu", RANK="0", LOCAL_RANK="0", WORLD_SIZE="1",
               LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    cmd = [sys.executable, "-m", module, *args]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"ran": False, "refused": [{"stage": "subprocess", "type": "TimeoutExpired",
                                           "message": f"no result within {timeout:.0f} s",
                                           "raised_at": None}]}
    for line in reversed(p.stdout.splitlines()):
        if line.startswith("{"):
            try:
                return dict(json.loads(line))
            except json.JSONDecodeError:
                break
    tail = (p.stderr or p.stdout).strip().splitlines()[-1:] or [""]
    return {"ran": False, "refused": [{"stage": "subprocess", "type": f"exit {p.returncode}",
                                       "message": tail[0], "raised_at": None}],
            "stderr_tail": (p.stderr or "")[-4000:]}


def run_peer(model: str = "tiny", steps: int = 3, *, variants: Sequence[str] = VARIANTS,
             nvme_dir: str | None = None, batch_size: int = 8, seq_len: int = 128,
             timeout: float = 900.0) -> dict[str, Any]:
    """Run DeepSpeed on preset ``model`` for ``steps`` steps, each variant in a fresh process.

    Returns ``{step_time_s, bytes_written_nvme, peak_rss_bytes, config, refused, runs}``
    for the first variant (in ``variants`` order) that trained with its states on NVMe;
    ``refused`` lists every refusal met on the way. When none did, ``step_time_s`` is
    ``None`` and ``cannot_run`` says why.
    """
    from tierstore.trainer import PRESETS

    if model not in PRESETS:
        raise ValueError(f"unknown model preset {model!r}; choose from {', '.join(PRESETS)}")
    if steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps}")
    bad = [v for v in variants if v not in VARIANTS]
    if bad or not variants:
        raise ValueError(f"variants must be among {VARIANTS}, got {list(variants)}")
    result: dict[str, Any] = {"system": "deepspeed", "model": model, "steps": steps,
                              "step_time_s": None, "bytes_written_nvme": None,
                              "peak_rss_bytes": None, "config": None, "refused": [],
                              "runs": [], "cannot_run": None}
    missing = deepspeed_available()
    if missing:
        result["cannot_run"] = missing
        return result
    scratch = nvme_dir or tempfile.mkdtemp(prefix="tierstore-ds-nvme-", dir=".")
    try:
        for v in variants:
            swap = os.path.join(scratch, v)
            shutil.rmtree(swap, ignore_errors=True)
            os.makedirs(swap)
            run = _spawn(["--worker", v, "--model", model, "--steps", str(steps),
                          "--nvme-dir", swap, "--batch-size", str(batch_size),
                          "--seq-len", str(seq_len)], timeout)
            run.setdefault("variant", v)
            result["runs"].append(run)
            result["refused"] += [dict(r, variant=v) for r in run.get("refused", [])]
            if run.get("ran") and not run.get("nvme_offload"):
                result["refused"].append({
                    "variant": v, "stage": "measurement", "type": "NoNVMeWrites",
                    "message": "trained, but nothing was written to the nvme_path: "
                               "offload_optimizer.device nvme is not honoured at this stage",
                    "raised_at": None})
            if run.get("ran") and run.get("nvme_offload") and result["config"] is None:
                result.update(step_time_s=run["step_time_s"],
                              bytes_written_nvme=run["bytes_written_nvme"],
                              peak_rss_bytes=run["peak_rss_bytes"],
                              config={"variant": v, "ds_config": run["ds_config"],
                                      "optimizer": run.get("optimizer")})
            shutil.rmtree(swap, ignore_errors=True)
    finally:
        if nvme_dir is None:
            shutil.rmtree(scratch, ignore_errors=True)
    if result["config"] is None:
        reasons = "; ".join(f"{r['variant']}: {r['type']}: {r['message']}"
                            + (f" ({r['raised_at']})" if r.get("raised_at") else "")
                            for r in result["refused"])
        result["cannot_run"] = f"no variant trained with NVMe offload: {reasons}"
    return result


def run_tierstore(model: str = "tiny", steps: int = 3, *, store_dir: str | None = None,
                  batch_size: int = 8, seq_len: int = 128, host_cache: str = "0",
                  timeout: float = 900.0) -> dict[str, Any]:
    """tierstore's store trainer on the same preset and batch, in a fresh process."""
    scratch = store_dir or tempfile.mkdtemp(prefix="tierstore-ds-ours-", dir=".")
    try:
        path = os.path.join(scratch, "store")
        shutil.rmtree(path, ignore_errors=True)
        return _spawn(["--worker", "ours", "--model", model, "--steps", str(steps),
                       "--nvme-dir", path, "--batch-size", str(batch_size),
                       "--seq-len", str(seq_len), "--host-cache", host_cache], timeout)
    finally:
        if store_dir is None:
            shutil.rmtree(scratch, ignore_errors=True)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny", help="tierstore preset name")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help=f"comma-separated, tried in order: {', '.join(VARIANTS)}")
    ap.add_argument("--nvme-dir", default=None, help="swap folder (default: a temporary one)")
    ap.add_argument("--ours", action="store_true",
                    help="also run tierstore's store trainer the same way")
    ap.add_argument("--host-cache", default="0", help="tierstore's host cache for --ours")
    ap.add_argument("--json", default=None, help="write the result here")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker is not None:  # one run, in the process run_peer started
        if a.worker == "ours":
            res = run_ours(a.model, a.steps, a.nvme_dir, a.batch_size, a.seq_len, a.host_cache)
        else:
            res = run_variant(a.worker, a.model, a.steps, a.nvme_dir, a.batch_size, a.seq_len)
        sys.stdout.write("\n" + json.dumps(res) + "\n")
        sys.stdout.flush()
        return 0
    try:
        res = run_peer(a.model, a.steps, variants=[v for v in a.variants.split(",") if v],
                       nvme_dir=a.nvme_dir, batch_size=a.batch_size, seq_len=a.seq_len)
        if a.ours:
            res["tierstore"] = run_tierstore(a.model, a.steps, batch_size=a.batch_size,
                                             seq_len=a.seq_len, host_cache=a.host_cache)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    text = json.dumps(res, indent=2)
    if a.json:
        with open(a.json, "w") as f:
            f.write(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
