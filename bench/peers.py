"""tierstore's inference against a peer system: Hugging Face accelerate's disk offload, or
llama.cpp.

One Hugging Face checkpoint, run by the peer and, imported into a store, by every tierstore
mode (``tierstore generate --mode resident|ring|expert|on-demand``). accelerate:
``from_pretrained`` with a ``device_map`` that puts every MoE layer's experts on ``"disk"``
and the rest on the CPU, then greedy ``generate``. llama.cpp: the checkpoint converted to
GGUF F32 once, before the runs, and memory-mapped (:mod:`tierstore.bench.llamacpp`); its
runs and every other run then compute on one thread unless ``threads`` says otherwise.

Every run is a fresh process, started after the page cache was dropped (where permitted),
and optionally in a memory cgroup whose limit counts the page cache
(:mod:`tierstore.bench.memlimit`). Each reports its tokens, its
prefill (the prompt up to the first token's logits) and decode (every later token) times
and its peak RSS. Rounds alternate the order of the runs; each system reports its median
and its ratio to the peer per round, and its cold start: the runner's wall clock of the
process, start to exit, less its prefill and decode (imports, opening, loading, warm-up,
tear-down). Tokens are held against the resident mode's (transformers' own model code, every
expert in memory), or the peer's where resident did not complete.

The ring's prefill is also held against its physical limit: a cold first pass reads every
MoE layer's experts from the backing tier, so it can take no less than the longer of the
compute (the resident mode's prefill) and those bytes over the tier's bandwidth, measured
by a fresh process before and after every round's runs (the fastest of ``get_many`` of
whole layers, two layers at once, and the prefetch queue; the faster of the two moments).
A synchronous loader such as accelerate's pays the sum of the two. Decoding, a ring that
reads every layer for every token is held against that bandwidth over its bytes per token.

A quantized checkpoint (``quantized``: gpt-oss's MXFP4, DeepSeek-V3's block FP8;
:mod:`tierstore.bench.quant_models`) is imported compact and, beside it, its bf16 twin
(the same values) as it is: the tierstore modes run over both, the peer over the bf16 twin
(llama.cpp over the shipped checkpoint as Q8_0, gpt-oss's MXFP4 experts kept MXFP4), and
each compact mode is held against 0.8 x the byte ratio x its bf16 twin's rate.

The modules' command line, one run per call, prints one line of JSON::

    python -m tierstore.bench.peers accelerate --model-dir D --offload-dir O \\
        --prompt-ids 1,2,3 --max-new-tokens 16
    python -m tierstore.bench.peers bandwidth --store S

(llama.cpp's runs have a file of their own, ``llamacpp_run.py``, that does not import tierstore.)
"""

# Over 600 lines: one study driver for both peers (accelerate, llama.cpp), sharing fresh
# processes and memory limits; to split per peer next.

from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import types
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import tierstore

from .memlimit import LimitedRun, drop_page_cache, run_limited
from .report import write_json

PEERS = ("accelerate", "llamacpp")
TIERSTORE_MODES = ("resident", "ring", "expert", "on-demand")
MiB = 1 << 20


# --- the store's bandwidth (in its own process) -----------------------------------------

def run_bandwidth(store_path: str) -> dict[str, Any]:
    """Bytes per second of whole MoE layers' experts read from the store's backing tier
    (no host cache): by ``get_many`` one layer at a time (the median layer), two layers at a
    time on two threads, and through the prefetch queue (four layers requested at once)."""
    import torch
    from tierstore.hf.loader import build

    from .infer import layer_names, measure_bandwidth, measure_queue_bandwidth

    dev = torch.device("cpu")
    with tierstore.open(store_path, host_cache=0, device_budget="1TiB") as store:
        model, loaded = build(store, False, device=dev, dtype=None)
        served = loaded.served
        got = measure_bandwidth(store, served, dev, repeats=1)

        def read(layer: int) -> int:
            names = layer_names(served, layer)
            return sum(t.numel() * t.element_size() for t in store.get_many(names).values())

        # Two layers in flight at once, as the ring's two borrowing threads keep them.
        t0 = time.perf_counter()
        with ThreadPoolExecutor(2) as pool:
            nbytes = sum(pool.map(read, served.moe_layers))
        two = nbytes / (time.perf_counter() - t0)
        store.prefetch_views(dev)
        queue, _ = measure_queue_bandwidth(store, served, dev)
        loaded.close()
    # The fastest way found sets the limit (the conservative choice: the higher the
    # bandwidth, the lower a run's ratio to it).
    return {"get_many_bytes_per_s": got["bytes_per_s"], "two_streams_bytes_per_s": two,
            "queue_bytes_per_s": queue, "bytes_per_s": max(got["bytes_per_s"], two, queue),
            "layer_bytes": got["layer_bytes"]}


# --- the study ----------------------------------------------------------------------------

def stored_shape(store_path: str) -> dict[str, Any]:
    """What the study needs to know of a stored model: its family, MoE layers, experts per
    layer, bytes of one layer's experts as stored, vocabulary."""
    from tierstore.hf.layout import stored_model
    from tierstore.hf.served import config_top_k

    with tierstore.open(store_path, host_cache=0) as store:
        sm = stored_model(store)
        m = sm.experts[0]
        one = sum(store.info(f"{m.prefix}.0.{p}").nbytes for _, parts in m.params for p in parts)
        text = sm.hf_config.get("text_config") or sm.hf_config
        top_k = config_top_k(types.SimpleNamespace(**text)) or 1
        return {"family": sm.family, "moe_layers": len(sm.experts), "experts": m.num_experts,
                "top_k": top_k, "expert_bytes": one, "layer_bytes": one * m.num_experts,
                "vocab_size": int(text["vocab_size"]), "hf_config": sm.hf_config}


def checkpoint_bytes(model_dir: str) -> int:
    """Bytes of the checkpoint's weight files."""
    return sum(os.path.getsize(os.path.join(model_dir, f)) for f in os.listdir(model_dir)
               if f.endswith(".safetensors"))


def resolve_limit(spec: str | float | int | None, model_bytes: int) -> int | None:
    """A limit given as a size (``1.4GiB``, bytes) or, as a number below 64, a fraction of
    the checkpoint's size (``0.75``)."""
    if spec is None or spec == "":
        return None
    text = str(spec).strip()
    try:
        value = float(text)
    except ValueError:
        value = None
    if value is not None and 0 < value < 64:
        return int(value * model_bytes)
    try:
        return tierstore.parse_size(text)
    except ValueError:
        raise tierstore.StoreError(f"--memory-limit takes a size (1.4GiB) or a fraction of "
                                   f"the model's size (0.75), got {spec!r}") from None


def _prompt(vocab: int, length: int, seed: int) -> list[int]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (length,), generator=g).tolist()


def _json_line(text: str) -> dict[str, Any] | None:
    for line in reversed(text.strip().splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                return None
    return None


def _median_or_none(xs: Sequence[float]) -> float | None:
    return statistics.median(xs) if xs else None


def run_peer_study(*, peer: str = "accelerate", model_dir: str | None = None,
                   shape: str = "mixtral", layers: int = 8, experts: int = 8, hidden: int = 1024, ffn: int = 2048,
                   vocab: int = 32000, prompt_len: int = 16, new_tokens: int = 16,
                   rounds: int = 3, memory_limit: str | float | int | None = None,
                   cold: bool = True, host_cache: int | None = None,
                   device_budget: int | None = None, modes: Sequence[str] = TIERSTORE_MODES,
                   timeout_s: float = 1800.0, seed: int = 0, threads: int | None = None,
                   json_out: str | None = None, quantized: str | None = None,
                   device: str | None = None, workdir: str = ".",
                   echo: Callable[[str], Any] = print) -> dict[str, Any]:
    """Run the study (see the module docstring); returns (and writes) the results.

    ``device`` is tierstore's compute device (``cuda`` for its runs on a GPU; the CPU by
    default); the peer's runs stay on the CPU.

    ``quantized`` (``mxfp4`` or ``fp8``): the study of a quantized checkpoint
    (:mod:`.quant_models`, its shape set by the format), imported compact and, beside it,
    the same weights in bf16 imported as they are; the peer runs the bf16 checkpoint, and a
    limit's fraction is of the bf16 checkpoint's size (see :func:`_quant_summary`)."""
    if peer not in PEERS:
        raise tierstore.StoreError(f"unknown peer {peer!r}; choose one of {', '.join(PEERS)}")
    bad = [m for m in modes if m not in TIERSTORE_MODES]
    if bad:
        raise tierstore.StoreError(f"unknown modes {bad}; choose from "
                                   f"{', '.join(TIERSTORE_MODES)}")
    if rounds < 1 or prompt_len < 1 or new_tokens < 2:
        raise tierstore.StoreError("rounds and the prompt length must be at least 1, the new "
                                   "tokens at least 2 (a prefill and a decode step)")
    if peer == "llamacpp":
        from .llamacpp import check_vocab, missing

        why = missing()
        if why:
            raise tierstore.StoreError(why)
        if model_dir is None:
            check_vocab(vocab)
        # One thread each unless told otherwise: the figures llama.cpp is known by.
        threads = threads or 1
    else:
        try:
            import accelerate  # noqa: F401
            import transformers  # noqa: F401
        except ImportError as e:
            raise tierstore.StoreError(f"--peer accelerate needs accelerate and transformers "
                                       f"(pip install 'tierstore[peers]'): {e}") from None
    from tierstore.hf import import_hf

    from .hf_models import write_hf_checkpoint

    if quantized is not None and model_dir is not None:
        raise tierstore.StoreError("--quantized writes its own checkpoints; leave out "
                                   "--model-dir")
    tmp = tempfile.mkdtemp(prefix="tierstore-peer-", dir=workdir)
    try:
        quant = None
        if quantized is not None:
            quant = _quant_checkpoints(tmp, quantized, layers=layers, experts=experts,
                                       hidden=hidden, ffn=ffn, vocab=vocab, seed=seed,
                                       echo=echo)
            model_dir, store = quant["bf16_dir"], quant["store"]
            modes = [m for m in modes if m in ("resident", "expert")]
        else:
            if model_dir is None:
                model_dir = os.path.join(tmp, "hf")
                echo(f"writing a {shape}-shaped checkpoint: {layers} layers x {experts} "
                     f"experts, hidden {hidden}, FFN {ffn}, vocab {vocab}, fp32")
                write_hf_checkpoint(model_dir, shape, layers=layers, experts=experts,
                                    hidden=hidden, ffn=ffn, vocab=vocab, seed=seed)
            store = os.path.join(tmp, "store")
            echo("importing it into a store (tierstore import-hf)")
            import_hf(model_dir, store, progress=True)
        gguf = None
        if peer == "llamacpp":  # once per study, before the clock
            from .llamacpp import converted

            if quant is None:
                gguf = converted(model_dir, tmp, echo=echo)
            else:  # the shipped checkpoint: MXFP4 experts stay MXFP4, FP8 becomes Q8_0
                gguf = converted(quant["quant_dir"], tmp, outtype="q8_0", echo=echo)
        return _study(peer, model_dir, store, tmp, stored_shape(store), gguf, quant=quant,
                      prompt_len=prompt_len, new_tokens=new_tokens, rounds=rounds, memory_limit=memory_limit,
                      cold=cold, host_cache=host_cache, device_budget=device_budget,
                      modes=modes, timeout_s=timeout_s, seed=seed, threads=threads,
                      device=device or "cpu", json_out=json_out, echo=echo)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _quant_checkpoints(tmp: str, fmt: str, *, layers: int, experts: int, hidden: int,
                       ffn: int, vocab: int, seed: int, echo: Callable[[str], Any]
                       ) -> dict[str, Any]:
    """The quantized checkpoint and its bf16 twin, each imported into a store of its own;
    the compact store's experts' bytes against the bf16 store's."""
    from tierstore.hf import import_hf

    from .quant_models import FORMATS, write_quantized_checkpoints

    if fmt not in FORMATS:
        raise tierstore.StoreError(f"unknown --quantized {fmt!r}; choose one of "
                                   f"{', '.join(FORMATS)}")
    qdir, bdir = os.path.join(tmp, f"hf-{fmt}"), os.path.join(tmp, "hf-bf16")
    echo(f"writing a {FORMATS[fmt]}-shaped {fmt} checkpoint and its bf16 twin: {layers} "
         f"layers x {experts} experts, hidden {hidden}, FFN {ffn}, vocab {vocab}")
    sizes = write_quantized_checkpoints(qdir, bdir, fmt, layers=layers, experts=experts,
                                        hidden=hidden, ffn=ffn, vocab=vocab, seed=seed)
    out = {"format": fmt, "shape": FORMATS[fmt], "quant_dir": qdir, "bf16_dir": bdir,
           "store": os.path.join(tmp, "store"), "bf16_store": os.path.join(tmp, "store-bf16"),
           "checkpoint_bytes": sizes["quant_bytes"], "bf16_checkpoint_bytes": sizes["bf16_bytes"]}
    echo(f"importing both (tierstore import-hf): {sizes['quant_bytes'] / 1e9:.2f} GB as "
         f"shipped, {sizes['bf16_bytes'] / 1e9:.2f} GB in bf16")
    import_hf(qdir, out["store"], progress=False)
    import_hf(bdir, out["bf16_store"], progress=False)
    out["expert_bytes"] = stored_shape(out["store"])["expert_bytes"]
    out["bf16_expert_bytes"] = stored_shape(out["bf16_store"])["expert_bytes"]
    return out


def _peer_command(peer: str, model_dir: str, tmp: str, gguf: dict[str, Any] | None,
                  prompt: list[int], new_tokens: int, cold: bool, threads: int | None
                  ) -> list[str]:
    """The command of one run of the peer (it prints one line of JSON)."""
    if peer == "llamacpp":
        from .llamacpp import eos_ids, run_command

        assert gguf is not None
        return run_command(gguf["path"], prompt, new_tokens, threads or 1, eos_ids(model_dir))
    return [sys.executable, "-m", "tierstore.bench.peers", "accelerate", "--model-dir",
            model_dir, "--offload-dir", os.path.join(tmp, "offload"), "--prompt-ids",
            ",".join(map(str, prompt)), "--max-new-tokens", str(new_tokens)] + (
        ["--drop-cache-after-load"] if cold else []) + (
        ["--threads", str(threads)] if threads else [])


def _study(peer: str, model_dir: str, store: str, tmp: str, cfg: Any,
           gguf: dict[str, Any] | None, *, quant: dict[str, Any] | None = None,
           prompt_len: int,
           new_tokens: int, rounds: int, memory_limit: str | float | int | None, cold: bool,
           host_cache: int | None, device_budget: int | None, modes: Sequence[str],
           timeout_s: float, seed: int, threads: int | None, device: str,
           json_out: str | None, echo: Callable[[str], Any]) -> dict[str, Any]:
    model_bytes = checkpoint_bytes(model_dir)
    n_moe = cfg["moe_layers"]
    layer_bytes = cfg["layer_bytes"]
    limit = resolve_limit(memory_limit, model_bytes)
    caches = {"": host_cache}
    if quant is not None:  # the bf16 twin's cache: as large as the limit allows, or all of it
        twin = stored_shape(quant["bf16_store"])["layer_bytes"]
        caches[" bf16"] = host_cache or (limit // 6 if limit
                                         else int(n_moe * twin * 1.25) + 64 * MiB)
    if host_cache is None:
        # Under a limit the cache must fit in it; with memory to spare it holds every
        # expert, as the page cache does for accelerate's offload folder.
        host_cache = limit // 6 if limit else int(n_moe * layer_bytes * 1.25) + 64 * MiB
    if device_budget is None and limit:
        device_budget = limit // 4
    prompt = _prompt(cfg["vocab_size"], prompt_len, seed + 1)
    py = sys.executable
    runs_spec: list[tuple[str, list[str], bool]] = [
        (peer, _peer_command(peer, model_dir, tmp, gguf, prompt, new_tokens, cold, threads),
         True)]
    # The resident mode holds every expert by definition: it runs without the limit, with
    # a device budget for all of them (and room for the KV cache and activations), as the
    # compute reference.
    resident_budget = int(n_moe * layer_bytes * 1.25) + 256 * MiB
    stores = [("", store)]
    if quant is not None:  # the same modes over the bf16 twin, under the same limit
        stores.append((" bf16", quant["bf16_store"]))
    for (suffix, path), mode in ((st, m) for st in stores for m in modes):
        if suffix and mode == "resident":
            continue
        cmd = [py, "-m", "tierstore.cli", "generate", "--store", path, "--mode", mode,
               "--prompt-ids", ",".join(map(str, prompt)), "--max-new-tokens",
               str(new_tokens), "--greedy", "--device", device, "--json",
               "--host-cache", str(caches.get(suffix) or host_cache)]
        budget = resident_budget if mode == "resident" else device_budget
        if budget is not None:
            cmd += ["--device-budget", str(budget)]
        if threads:
            cmd += ["--threads", str(threads)]
        runs_spec.append((mode + suffix, cmd, mode != "resident"))
    results: dict[str, Any] = {
        "peer": peer, "model": {**cfg, "checkpoint_bytes": model_bytes,
                                "expert_bytes_total": n_moe * layer_bytes,
                                "layer_bytes": layer_bytes},
        "prompt": prompt, "prompt_tokens": prompt_len, "new_tokens": new_tokens,
        "rounds": rounds, "host_cache": host_cache, "device_budget": device_budget,
        "threads": threads or "each system's default",
        "device": {"tierstore": device, peer: "cpu"},
        "memory_limit_bytes": limit,
        # What a token must read from the store at the least (its routed experts in every
        # MoE layer), against what accelerate's hooks load: every expert of each fused layer.
        "bytes_per_token": {"routed_minimum": n_moe * cfg["top_k"] * cfg["expert_bytes"],
                            "accelerate_fused_layers": n_moe * layer_bytes},
        "memory_limit_fraction": limit / model_bytes if limit else None,
        "runs": [], "bandwidth_runs": []}
    if gguf is not None:
        results["gguf"] = gguf
    if quant is not None:
        results["quantized"] = {k: v for k, v in quant.items() if not k.endswith(("dir", "store"))}
    echo(f"checkpoint {model_bytes / 1e9:.2f} GB ({n_moe} MoE layers of "
         f"{layer_bytes / 1e6:.0f} MB of experts); prompt {prompt_len} tokens, "
         f"{new_tokens} greedy tokens; {rounds} rounds; host cache "
         f"{tierstore.format_size(host_cache)}, device budget "
         + (tierstore.format_size(device_budget) if device_budget else "the store's default")
         + (f"; memory limit {limit / 1e9:.2f} GB ({limit / model_bytes:.2f} of the model)"
            if limit else "; no memory limit")
         + (f"; tierstore computes on {device}, {peer} on the CPU" if device != "cpu" else ""))
    cache_notes: set[str] = set()
    skipped: set[str] = set()

    def probe(rnd: int, when: str) -> None:
        bw = _fresh(run_limited([py, "-m", "tierstore.bench.peers", "bandwidth", "--store",
                                 store], timeout=timeout_s))
        results["bandwidth_runs"].append({"round": rnd, "when": when, **bw})
        echo(f"round {rnd + 1}/{rounds}, {when}: backing tier "
             + (f"{bw['bytes_per_s'] / 1e9:.2f} GB/s" if "bytes_per_s" in bw
                else f"bandwidth not measured ({bw['outcome']})"))

    for r in range(rounds):
        # The tier's bandwidth wanders between moments on a shared machine: it is measured
        # before and after each round's runs, and the faster of the two counts.
        probe(r, "before")
        order = runs_spec if r % 2 == 0 else runs_spec[::-1]
        for name, cmd, limited in order:
            note = drop_page_cache() if cold else "warm (--warm)"
            if note:
                cache_notes.add(note)
            res = run_limited(cmd, limit if limited else None, timeout=timeout_s)
            if res.limit_skipped:
                skipped.add(res.limit_skipped)
            row = _run_row(name, r, res, prompt_len, cmd)
            results["runs"].append(row)
            echo(f"  {name:10s} " + (
                f"prefill {row['prefill_tokens_per_s']:8.1f} tok/s  decode "
                f"{row['decode_tokens_per_s']:6.2f} tok/s" if row["ok"] else
                f"{row['outcome']}".ljust(43))
                + (f"  cold start {row['cold_start_s']:5.2f} s" if row["ok"] else "")
                + f"  peak RSS {row['peak_rss_bytes'] / 1e9:.2f} GB"
                + (f", cgroup {row['cgroup_peak_bytes'] / 1e9:.2f} GB"
                   if row.get("cgroup_peak_bytes") else "")
                + ("" if not limit or limited else "  (no limit: compute reference)"))
        probe(r, "after")
    results["cold"] = cold and not cache_notes
    results["cache"] = sorted(cache_notes) or ["page cache dropped before every run"]
    results["limit_applied"] = bool(limit) and not skipped
    results["limit_skipped"] = sorted(skipped)[0] if skipped else None
    _summarise(results, [n for n, *_ in runs_spec], peer, n_moe, layer_bytes, echo)
    if quant is not None:
        _quant_summary(results, peer, echo)
    write_json(json_out, results, echo)
    return results


def _quant_summary(results: dict[str, Any], peer: str, echo: Callable[[str], Any]) -> None:
    """The compact store against its bf16 twin and the peer. The issue's target for a mode:
    decode at 0.8 x (bf16 expert bytes / compact expert bytes) x the bf16 store's rate in
    the same mode, close to the byte ratio where the decode is bound by reading experts;
    and 3 x the peer's (accelerate's) rate. Bytes read per token: the experts a run read
    from the store over its passes (the prompt's and one per decoded token)."""
    q = results["quantized"]
    ratio = q["bf16_expert_bytes"] / q["expert_bytes"]
    q["byte_ratio"] = ratio
    systems = results["systems"]
    passes = results["new_tokens"]  # a prefill, then new_tokens - 1 decode steps
    for name, s in systems.items():
        # tierstore: the experts it read from the store; a peer: what its process read
        # from storage after loading (/proc/self/io)
        read = [r.get("bytes_read_generating", r.get("bytes_read")) for r in results["runs"]
                if r["system"] == name and r["ok"]]
        read = [b for b in read if b is not None]
        s["bytes_read_per_token"] = statistics.median(read) / passes if read else None
    echo("bytes read per token: " + ", ".join(
        f"{n} {s['bytes_read_per_token'] / 1e6:.0f} MB" for n, s in systems.items()
        if s["bytes_read_per_token"] is not None))
    rows = {}
    for mode in ("expert", "on-demand", "ring"):
        mine, twin = systems.get(mode), systems.get(f"{mode} bf16")
        if not mine or not twin or not mine["completed"] or not twin["completed"]:
            continue
        target = 0.8 * ratio * twin["decode_tokens_per_s"]
        rows[mode] = {"decode_tokens_per_s": mine["decode_tokens_per_s"],
                      "bf16_decode_tokens_per_s": twin["decode_tokens_per_s"],
                      "vs_bf16": mine["decode_tokens_per_s"] / twin["decode_tokens_per_s"],
                      "target_tokens_per_s": target,
                      "vs_target": mine["decode_tokens_per_s"] / target,
                      f"vs_{peer}": mine.get(f"decode_vs_{peer}")}
        r = rows[mode]
        echo(f"{mode} {q['format']}: decode {r['decode_tokens_per_s']:.2f} tok/s, "
             f"{r['vs_bf16']:.2f} x the bf16 store's ({r['bf16_decode_tokens_per_s']:.2f}); "
             f"target 0.8 x {ratio:.2f} x bf16 = {target:.2f}: {r['vs_target']:.2f} of it"
             + (f"; {r[f'vs_{peer}']:.2f} x {peer}" if r[f"vs_{peer}"] is not None else ""))
    q["modes"] = rows


def _first_difference(a: Sequence[int], b: Sequence[int]) -> int:
    """The index of the first token where two runs' tokens differ."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _fresh(res: LimitedRun) -> dict[str, Any]:
    got = _json_line(res.stdout) if res.ok else None
    return {**(got or {}), "outcome": res.outcome()}


def _run_row(name: str, rnd: int, res: LimitedRun, prompt_len: int, cmd: list[str]
             ) -> dict[str, Any]:
    got = _json_line(res.stdout) if res.returncode == 0 else None
    row: dict[str, Any] = {"system": name, "round": rnd, **res.to_dict(),
                           "command": " ".join(cmd[1:])}
    row["ok"] = res.ok and got is not None
    if not row["ok"]:
        if res.ok:
            row["outcome"] = "no JSON in the output"
        return row
    tokens = got["tokens"][0]
    row.update(tokens=tokens, prefill_s=got["prefill_s"], decode_s=got["decode_s"],
               prefill_tokens_per_s=prompt_len / got["prefill_s"],
               decode_tokens_per_s=(len(tokens) - 1) / got["decode_s"]
               if got["decode_s"] > 0 else 0.0,
               # the cold start: the process's wall clock (start to exit) outside the two
               # timed phases
               cold_start_s=res.wall_s - got["prefill_s"] - got["decode_s"])
    for k in ("load_s", "prepare_s", "import_s", "bytes_read", "bytes_read_generating",
              "hit_rate", "spec_accuracy", "stall_frac", "accelerate", "transformers",
              "llama_cpp", "cache_after_load", "offloaded_modules", "threads",
              "dequantized_cache"):
        if got.get(k) is not None:
            row[k] = got[k]
    return row


def _summarise(results: dict[str, Any], names: list[str], peer: str, n_moe: int,
               layer_bytes: int, echo: Callable[[str], Any]) -> None:
    runs = results["runs"]
    done = [r for r in runs if r["ok"]]
    base = (next((r for r in done if r["system"] == "resident"), None)
            or next((r for r in done if r["system"] == peer), None)
            or (done[0] if done else None))
    ref = base["tokens"] if base else None
    mismatches = [f"{r['system']} round {r['round'] + 1} from token "
                  f"{_first_difference(r['tokens'], ref)}" for r in done if r["tokens"] != ref]
    results["reference_system"] = base["system"] if base else None
    results["reference_tokens"] = ref
    results["tokens_equal"] = bool(done) and not mismatches
    results["token_mismatches"] = mismatches
    peer_by_round = {r["round"]: r for r in done if r["system"] == peer}
    systems: dict[str, Any] = {}
    for name in names:
        mine = [r for r in runs if r["system"] == name]
        ok = [r for r in mine if r["ok"]]
        s: dict[str, Any] = {"completed": len(ok), "runs": len(mine),
                             "outcomes": sorted({r["outcome"] for r in mine}),
                             "limit_applied": any(r["limit_applied"] for r in mine),
                             "peak_rss_bytes": max((r["peak_rss_bytes"] for r in mine),
                                                   default=0),
                             "cgroup_peak_bytes": max((r["cgroup_peak_bytes"] or 0
                                                       for r in mine), default=0) or None}
        # Setup outside the timed phases: loading (accelerate, llama.cpp), the memory a
        # source takes before its first pass (tierstore, see ExpertSource.prepare), all of
        # it (the cold start). Bytes read: tierstore's from the store (its experts),
        # llama.cpp's from storage by the whole process (/proc/self/io: the file's pages).
        for k in ("load_s", "prepare_s", "cold_start_s", "bytes_read"):
            s[k] = _median_or_none([r[k] for r in ok if r.get(k) is not None])
        for phase in ("prefill", "decode"):
            key = f"{phase}_tokens_per_s"
            rates = [r[key] for r in ok]
            s[key] = _median_or_none(rates)
            s[f"{key}_runs"] = rates
            paired = [r[key] / peer_by_round[r["round"]][key] for r in ok
                      if r["round"] in peer_by_round and peer_by_round[r["round"]][key] > 0]
            s[f"{phase}_vs_{peer}"] = _median_or_none(paired)
            s[f"{phase}_vs_{peer}_runs"] = paired  # each run against the peer's in its round
            base = [r[key] for r in peer_by_round.values()]
            s[f"{phase}_vs_{peer}_of_medians"] = (s[key] / statistics.median(base)
                                                  if rates and base else None)
        systems[name] = s
    for s in systems.values():
        peer_out = systems[peer]["cold_start_s"] if peer in systems else None
        s[f"cold_start_vs_{peer}"] = (s["cold_start_s"] / peer_out if peer_out and
                                   s["cold_start_s"] is not None else None)
    results["systems"] = systems
    per_round: dict[int, float] = {}
    for b in results["bandwidth_runs"]:
        if "bytes_per_s" in b:
            per_round[b["round"]] = max(per_round.get(b["round"], 0.0), b["bytes_per_s"])
    bw = _median_or_none(list(per_round.values()))
    results["bandwidth_bytes_per_s"] = bw
    results["bandwidth_per_round_bytes_per_s"] = [per_round.get(r) for r in
                                                  range(results["rounds"])]
    # Decoding, a ring that reads every layer for every token is bound by those reads: its
    # limit is the round's bandwidth over the bytes it read per decode token.
    ring_dec = []
    for r in done:
        if r["system"] != "ring" or not r.get("bytes_read") or r["round"] not in per_round:
            continue
        steps = len(r["tokens"]) - 1
        per_token = (r["bytes_read"] - n_moe * layer_bytes) / steps if steps else 0
        if per_token > layer_bytes / 2:
            limit_tps = per_round[r["round"]] / per_token
            ring_dec.append({"round": r["round"], "bytes_per_token": per_token,
                             "limit_tokens_per_s": limit_tps,
                             "vs_limit": r["decode_tokens_per_s"] / limit_tps})
    if ring_dec:
        results["ring_decode"] = {"runs": ring_dec, "vs_limit": statistics.median(
            x["vs_limit"] for x in ring_dec)}
    res_pre = [r["prefill_s"] for r in done if r["system"] == "resident"]
    ring_pre = [r["prefill_s"] for r in done if r["system"] == "ring"]
    if bw and res_pre:
        # A cold first pass reads every MoE layer's experts once.
        compute = statistics.median(res_pre)
        transfer = n_moe * layer_bytes / bw
        limit_s = max(compute, transfer)
        rp: dict[str, Any] = {
            "compute_s": compute, "bytes": n_moe * layer_bytes, "bytes_per_s": bw,
            "transfer_s": transfer, "limit_s": limit_s, "sum_s": compute + transfer,
            "basis": "max(resident prefill, experts' bytes / the tier's bandwidth); a "
                     "synchronous loader pays the sum"}
        if ring_pre:
            rp["ring_prefill_s"] = statistics.median(ring_pre)
            rp["ring_vs_limit"] = limit_s / rp["ring_prefill_s"]
        peer_pre = [r["prefill_s"] for r in peer_by_round.values()]
        if peer_pre:
            rp[f"{peer}_prefill_s"] = statistics.median(peer_pre)
            rp[f"{peer}_vs_limit"] = limit_s / rp[f"{peer}_prefill_s"]
        results["ring_prefill"] = rp
    echo(f"tokens equal across every completed run: {results['tokens_equal']}"
         + (f" (differ: {', '.join(mismatches)})" if mismatches else ""))
    for name in names:
        s = systems[name]
        if not s["completed"]:
            echo(f"{name:10s} did not complete: {'; '.join(s['outcomes'])}")
            continue
        vs = "" if name == peer else (
            f"  ({s[f'prefill_vs_{peer}']:.2f} / {s[f'decode_vs_{peer}']:.2f} x {peer}"
            + (f"; decode per round {min(s[f'decode_vs_{peer}_runs']):.2f}-"
               f"{max(s[f'decode_vs_{peer}_runs']):.2f}"
               if len(s[f"decode_vs_{peer}_runs"]) > 1 else "") + ")"
            if s[f"prefill_vs_{peer}"] is not None and s[f"decode_vs_{peer}"] is not None
            else "")
        setup = "".join(f"; {k[:-2].replace('_', ' ')} {s[k]:.2f} s"
                        for k in ("load_s", "prepare_s", "cold_start_s") if s.get(k) is not None)
        if name != peer and s.get(f"cold_start_vs_{peer}") is not None:
            setup += f" ({s[f'cold_start_vs_{peer}']:.2f} x {peer}'s)"
        echo(f"{name:10s} prefill {s['prefill_tokens_per_s']:8.1f} tok/s, decode "
             f"{s['decode_tokens_per_s']:6.2f} tok/s{vs}; {s['completed']}/{s['runs']} "
             f"completed; peak RSS {s['peak_rss_bytes'] / 1e9:.2f} GB{setup}")
    rp = results.get("ring_prefill")
    if rp and "ring_vs_limit" in rp:
        echo(f"ring prefill {rp['ring_prefill_s']:.2f} s against its limit "
             f"{rp['limit_s']:.2f} s (compute {rp['compute_s']:.2f} s, reads "
             f"{rp['transfer_s']:.2f} s at {rp['bytes_per_s'] / 1e9:.2f} GB/s): "
             f"{rp['ring_vs_limit']:.2f} of the limit")
    rd = results.get("ring_decode")
    if rd:
        echo(f"ring decode read {rd['runs'][0]['bytes_per_token'] / 1e9:.2f} GB per token: "
             f"{rd['vs_limit']:.2f} of the bandwidth limit")


# --- command line of the per-process runs -----------------------------------------------

def main(argv: Sequence[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m tierstore.bench.peers",
                                description="One measured run of `tierstore bench infer "
                                            "--peer`, in this process; prints one JSON line.")
    sub = p.add_subparsers(dest="what", required=True)
    a = sub.add_parser("accelerate", help="Greedy generation through accelerate's disk "
                                          "offload (experts on disk, the rest on the CPU).")
    a.add_argument("--model-dir", required=True, help="A Hugging Face model directory.")
    a.add_argument("--offload-dir", required=True, help="accelerate's offload folder.")
    a.add_argument("--prompt-ids", required=True, metavar="1,2,3", help="The prompt.")
    a.add_argument("--max-new-tokens", type=int, required=True)
    a.add_argument("--drop-cache-after-load", action="store_true",
                   help="Drop the page cache once the model is loaded (a cold run).")
    a.add_argument("--threads", type=int, help="CPU compute threads (default: torch's).")
    b = sub.add_parser("bandwidth", help="The backing tier's bandwidth for whole layers.")
    b.add_argument("--store", required=True)
    args = p.parse_args(argv)
    try:
        if args.what == "accelerate":
            try:
                prompt = [int(x) for x in args.prompt_ids.split(",") if x]
            except ValueError:
                p.error("--prompt-ids takes comma-separated integers")
            from .accelerate_peer import run_accelerate

            out = run_accelerate(args.model_dir, args.offload_dir, prompt,
                                 args.max_new_tokens, drop_after_load=args.drop_cache_after_load,
                                 threads=args.threads)
        else:
            out = run_bandwidth(args.store)
    except (tierstore.StoreError, OSError) as e:
        print(f"tierstore.bench.peers: {e}", file=sys.stderr)
        return 2
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
