"""``tierstore demo``: a synthetic MoE model's expert states through the store, end to end."""

from __future__ import annotations

import shutil
import time
import zlib
from collections.abc import Callable

import torch

from .opening import open_store
from .sizes import format_size

WEIGHTS = ("w1", "w2", "w3")  # SwiGLU expert: w1, w3 [ffn, hidden]; w2 [hidden, ffn]


def _expert_tensor(seed: int, name: str, kind: str, shape: tuple[int, ...]) -> torch.Tensor:
    """Deterministic contents per (name, kind), so reads can be checked without a copy."""
    g = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{name}:{kind}".encode()))
    t = torch.randn(shape, generator=g)
    return t.to(torch.bfloat16) if kind == "param" else t


def run_demo(
    store: str,
    *,
    layers: int = 8,
    experts: int = 16,
    hidden: int = 512,
    ffn: int = 1024,
    seed: int = 0,
    fresh: bool = False,
    echo: Callable[[str], object] = print,
) -> int:
    from tqdm import tqdm

    if fresh:
        shutil.rmtree(store, ignore_errors=True)
    shapes = {"w1": (ffn, hidden), "w2": (hidden, ffn), "w3": (ffn, hidden)}
    kinds = ("param", "exp_avg", "exp_avg_sq")
    per_layer = experts * sum(
        torch.Size(s).numel() * (2 + 4 + 4) for s in shapes.values()
    )
    with open_store(store, create=True, slab_size="256MiB") as st:
        echo(f"store {st.path} on {st.describe()}")
        echo(f"model: {layers} MoE layers x {experts} experts, hidden {hidden}, ffn {ffn}: "
             f"{format_size(per_layer * layers)} of expert states (bf16 params, fp32 Adam moments)")
        t_write = 0.0
        with tqdm(total=per_layer * layers, desc="write", unit="B", unit_scale=True,
                  unit_divisor=1024, disable=None) as bar:
            for layer in range(layers):
                batch = []
                for e in range(experts):
                    for w in WEIGHTS:
                        name = f"layers.{layer}.experts.{e}.{w}"
                        for kind in kinds:
                            batch.append((name, kind, _expert_tensor(seed, name, kind, shapes[w])))
                t0 = time.perf_counter()
                st.put_many(batch)
                t_write += time.perf_counter() - t0
                bar.update(per_layer)
        t0 = time.perf_counter()
        st.flush()
        t_write += time.perf_counter() - t0

        # Read back the way training touches experts: each step, each layer's router picks a
        # few experts (skewed towards low ids, as real routers are) and their states are read.
        g = torch.Generator().manual_seed(seed)
        popularity = 1.0 / torch.arange(1, experts + 1, dtype=torch.float64)
        steps, topk, read_bytes, mismatches, t_read = 4, max(1, experts // 4), 0, 0, 0.0
        for i in tqdm(range(steps * layers), desc="read", disable=None):
            layer = i % layers
            picked = torch.multinomial(popularity, topk, generator=g).tolist()
            keys = [(f"layers.{layer}.experts.{e}.{w}", k) for e in picked for w in WEIGHTS
                    for k in kinds]
            t0 = time.perf_counter()
            got = st.get_many(keys)
            t_read += time.perf_counter() - t0
            for (name, kind), t in got.items():
                read_bytes += t.nbytes
                if not torch.equal(t, _expert_tensor(seed, name, kind, shapes[name[-2:]])):
                    mismatches += 1

        tag = "demo"
        if any(s.tag == tag for s in st.snapshots()):
            st.drop_snapshot(tag)
        st.snapshot(tag)
        # One optimizer-style update after the snapshot: the snapshot keeps the old version.
        name = "layers.0.experts.0.w1"
        before = st.info(name, "exp_avg").version
        st.put(name, torch.zeros(shapes["w1"]), kind="exp_avg")
        after = st.info(name, "exp_avg").version
        report = st.fsck()
        stats = st.stats()

    echo("")
    echo(f"  entries        {stats['entries']} ({format_size(stats['bytes_stored'])})")
    echo(f"  write          {format_size(per_layer * layers)} in {t_write:.2f} s "
         f"({per_layer * layers / t_write / 1e9:.2f} GB/s: into the host cache, written back "
         "copy-on-write, fdatasync, one commit per flush)")
    echo(f"  read           {format_size(read_bytes)} of routed experts in {t_read:.2f} s "
         f"({read_bytes / t_read / 1e9:.2f} GB/s: host cache hits, or crc32c-verified reads "
         f"from the tier), {mismatches} mismatches")
    echo(f"  snapshot       '{tag}' holds v{before} of {name} [exp_avg]; live is now v{after}")
    echo(f"  fsck           {report.entries} stored versions verified: "
         f"{'clean' if report.ok else report.problems}")
    cache = stats["cache"]
    echo(f"  host cache     {cache['policy']}, {format_size(cache['capacity_bytes'])}: "
         f"hit rate {cache['hit_rate']:.2f}, {cache['evictions']} evictions, "
         f"{cache['writebacks']} write-backs")
    for tier, t in stats["tiers"].items():
        echo(f"  {tier} tier      {t['reads']} reads ({format_size(t['bytes_read'])}), "
             f"{t['writes']} writes ({format_size(t['bytes_written'])})")
    return 0 if report.ok and mismatches == 0 else 1
