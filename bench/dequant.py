"""What a packed expert costs after its transfer: the time to dequantize one expert of a
shipped model's real shape (gpt-oss-120b in MXFP4, DeepSeek-V3 in 128x128 block FP8) into
the compute dtype with tierstore's :class:`~tierstore.hf.quant.Dequantizer` (reused
buffers, as the experts function calls it), beside ``transformers``' own function on the
same tensors and beside the time to read the expert's compact bytes from a store's backing
tier (no host cache: every read crosses the tier), measured in the same run.

Random codes: the time of a table lookup does not depend on the values.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

from .report import load_average, write_json

SHAPES = {  # name: (format, hidden, expert intermediate)
    "gpt-oss-120b": ("mxfp4", 2880, 2880),
    "deepseek-v3": ("fp8", 7168, 2048),
}


def packed_expert(fmt: str, hidden: int, inter: int, seed: int = 0) -> dict[str, Any]:
    """One expert's entries as a compact store holds them (packed weight and scales of each
    projection), random codes."""
    import torch

    g = torch.Generator().manual_seed(seed)
    out = {}
    if fmt == "mxfp4":
        for name, rows, fan_in in (("gate_up_proj", 2 * inter, hidden), ("down_proj", hidden, inter)):
            out[f"{name}_blocks"] = torch.randint(0, 256, (rows, fan_in // 32, 16), generator=g,
                                                  dtype=torch.int32).to(torch.uint8)
            out[f"{name}_scales"] = torch.randint(118, 124, (rows, fan_in // 32), generator=g,
                                                  dtype=torch.int32).to(torch.uint8)
    else:
        for name, rows, cols in (("gate_up_proj", 2 * inter, hidden), ("down_proj", hidden, inter)):
            out[name] = torch.randn(rows, cols, generator=g).to(torch.float8_e4m3fn)
            out[f"{name}_scale_inv"] = torch.rand(rows // 128, cols // 128, generator=g)
    return out


def _pairs(fmt: str, entries: dict[str, Any]) -> list[tuple[Any, Any]]:
    if fmt == "mxfp4":
        return [(entries[f"{p}_blocks"], entries[f"{p}_scales"]) for p in ("gate_up_proj", "down_proj")]
    return [(entries[p], entries[f"{p}_scale_inv"]) for p in ("gate_up_proj", "down_proj")]


def _timed(fn: Callable[[], Any], repeats: int, sync: Callable[[], Any] = lambda: None
           ) -> list[float]:
    out = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        out.append(time.perf_counter() - t0)
    return out


def _transfer(entries: dict[str, Any], workdir: str, repeats: int, device: str,
              sync: Callable[[], Any]) -> list[float]:
    """Seconds of ``get_many`` of the expert's entries from the backing tier, no cache."""
    import tierstore

    tmp = tempfile.mkdtemp(prefix="tierstore-dequant-", dir=workdir)
    try:
        path = os.path.join(tmp, "store")
        with tierstore.open(path, create=True, host_cache=0) as st:
            st.put_many({k: v.cpu() for k, v in entries.items()})
        with tierstore.open(path, host_cache=0) as st:
            st.get_many(list(entries), device=device)  # the first read opens the slab files
            return _timed(lambda: st.get_many(list(entries), device=device), repeats, sync)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def run_dequant(*, repeats: int = 5, threads: int | None = None, device: str = "cpu",
                workdir: str = ".", json_out: str | None = None,
                echo: Callable[[str], Any] = print) -> dict[str, Any]:
    """Per expert of each shape in :data:`SHAPES`: dequantization to bf16 by tierstore and by
    ``transformers`` on ``device``, and the transfer of its compact bytes there (medians and
    every run), with whether the two dequantizations are equal bit for bit."""
    import torch
    from tierstore.hf.quant import Dequantizer
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    if threads:
        torch.set_num_threads(threads)
    fp8_theirs = Fp8Dequantize(None)._dequantize_one
    dev = torch.device(device)
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    load = load_average()
    results: dict[str, Any] = {"device": str(dev), "threads": torch.get_num_threads(),
                               "repeats": repeats,
                               "dtype": "bfloat16", "loadavg_before": load, "shapes": {}}
    for name, (fmt, hidden, inter) in SHAPES.items():
        entries = {k: v.to(dev) for k, v in packed_expert(fmt, hidden, inter).items()}
        pairs = _pairs(fmt, entries)
        deq = Dequantizer()

        def ours(fmt: str = fmt, pairs: list[tuple[Any, Any]] = pairs,
                 deq: Dequantizer = deq) -> list[Any]:
            return [deq(fmt, packed, scales, torch.bfloat16) for packed, scales in pairs]

        def theirs(fmt: str = fmt, pairs: list[tuple[Any, Any]] = pairs) -> list[Any]:
            if fmt == "mxfp4":
                return [convert_moe_packed_tensors(p[None], s[None], dtype=torch.bfloat16)[0]
                        for p, s in pairs]
            return [fp8_theirs(p, s, output_dtype=torch.bfloat16) for p, s in pairs]

        # The buffers and tables are made once per model; the outputs are compared as raw
        # bits, so a NaN or a signed zero counts too.
        equal = all(torch.equal(a.reshape(-1).view(torch.int16), b.reshape(-1).view(torch.int16))
                    for a, b in zip(ours(), theirs(), strict=True))
        mine = _timed(ours, repeats, sync)
        ref = _timed(theirs, repeats, sync)
        moved = _transfer(entries, workdir, repeats, device, sync)
        compact = sum(t.numel() * t.element_size() for t in entries.values())
        bf16 = sum(p.numel() * (2 if fmt == "fp8" else 4) for p, _ in pairs)
        row = {"format": fmt, "hidden": hidden, "intermediate": inter, "compact_bytes": compact,
               "bf16_bytes": bf16, "bit_equal": equal,
               "dequant_s": statistics.median(mine), "dequant_runs": mine,
               "transformers_s": statistics.median(ref), "transformers_runs": ref,
               "transfer_s": statistics.median(moved), "transfer_runs": moved,
               "transfer_bytes_per_s": compact / statistics.median(moved)}
        results["shapes"][name] = row
        echo(f"{name} ({fmt}, {compact / 1e6:.1f} MB packed, {bf16 / 1e6:.1f} MB in bf16): "
             f"dequantize {row['dequant_s'] * 1e3:.0f} ms (transformers' "
             f"{row['transformers_s'] * 1e3:.0f} ms), read from the store "
             f"{row['transfer_s'] * 1e3:.1f} ms ({row['transfer_bytes_per_s'] / 1e9:.2f} GB/s)"
             f"{'' if equal else '; NOT EQUAL to transformers bit for bit'}")
    results["loadavg_after"] = load_average()
    echo(f"load average {' '.join(load)} before, {' '.join(results['loadavg_after'])} after; "
         f"{results['threads']} threads, on {dev}")
    write_json(json_out, results, echo)
    return results
