"""The ``tierstore bench`` group: every benchmark reports its figures beside a ceiling or a
peer measured in the same run.

It reaches the ``tierstore`` command line through the ``tierstore.commands`` entry-point
group (pyproject.toml). Only click is imported here; each benchmark imports what it runs when
it runs."""

# Over 600 lines: every benchmark's click options in one module that imports nothing heavy;
# to split by benchmark next.

from __future__ import annotations

from typing import Any

import click

from tierstore.cli_options import (
    CACHE_SIZE,
    OUTPUT_FILE,
    SIZE,
    SLAB_SIZE,
    CommaList,
    DeviceType,
    FiniteFloat,
)
from tierstore.cli_options import run_command as _run

# Benchmarks take a device or none (their default), not "auto".
DEVICE = DeviceType(auto=False)
COUNTS = CommaList(click.IntRange(min=1), name="count")
NAMES = CommaList(click.STRING, name="name")
TIERS = ("nvme", "pmem", "host", "gpu")


def _engines(ctx: click.Context, _param: Any, value: list[str]) -> list[str]:
    # An unknown engine would fail only when its turn comes, after the others' figures.
    from tierstore.nvme.engines import ENGINES

    unknown = [e for e in value if e not in ENGINES]
    if unknown and not ctx.resilient_parsing:
        raise click.BadParameter(f"unknown I/O engine {unknown[0]!r}; choose from "
                                 f"{', '.join(ENGINES)}")
    return value


class _Capacity(click.ParamType):
    """One ``bench cache`` capacity: a fraction of the trace's distinct bytes in (0, 1], or
    a size; read as the benchmark reads it, and kept as text for it."""

    name = "capacity"

    def convert(self, value: Any, param: Any, ctx: Any) -> str:
        from tierstore.bench.cache_lab import parse_capacities

        import tierstore

        text = str(value).strip()
        try:
            [got] = parse_capacities(text, 1)
        except (ValueError, tierstore.StoreError) as e:
            self.fail(str(e), param, ctx)
        if got <= 0:
            self.fail(f"capacity {text} is not above 0", param, ctx)
        return text


def _policies(ctx: click.Context, _param: Any, value: list[str]) -> list[str]:
    from tierstore import lab

    unknown = sorted(set(value) - {"all", *lab.POLICIES})
    if unknown and not ctx.resilient_parsing:
        raise click.BadParameter(f"unknown policies {unknown}; choose from "
                                 f"{', '.join(lab.POLICIES)}, or all")
    return value


def _trace_spec(ctx: click.Context, _param: Any, value: str | None) -> str | None:
    if value is None or ctx.resilient_parsing:
        return value
    from tierstore import lab

    try:
        lab.parse_spec(value)
    except ValueError as e:  # a bad field, or a value not a number
        raise click.BadParameter(f"{value!r}: {e}") from None
    return value


def _memory_limit(ctx: click.Context, _param: Any, value: str | None) -> str | None:
    # Read as the peer study reads it (against a 1 TiB model, so that any fraction it would
    # take is bytes here), which it does only after building the checkpoint.
    if value is None or ctx.resilient_parsing:
        return value
    from tierstore.bench.peers import resolve_limit

    from tierstore import StoreError

    try:
        limit = resolve_limit(value, 1 << 40)
    except StoreError:
        limit = None
    if not limit:
        raise click.BadParameter(f"{value!r} is neither a size above 0 (1.4GiB) nor a "
                                 "fraction of the model's size (0.75)")
    return value


def _check_synthetic(shape: str, layers: int, experts: int, hidden: int, ffn: int) -> None:
    # The synthetic model checks its shape only once the benchmark builds it, and names its
    # own fields (top_k, head dimension) rather than the options.
    from tierstore.bench.infer import check_synthetic

    try:
        check_synthetic(shape, layers, experts, hidden, ffn)
    except (ValueError, TypeError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise click.UsageError(f"--shape {shape} --layers {layers} --experts {experts} --hidden "
                               f"{hidden} --ffn {ffn} make no synthetic model: {first}") from None


@click.group()
def bench() -> None:
    """Benchmarks; each reports ratios against a ceiling measured in the same run."""


@bench.command(name="tiers")
@click.option("--store", "store", type=click.Path(file_okay=False),
              help="Scratch directory (default: a temporary directory in the current directory, "
                   "removed afterwards; put it on the drive you want to measure).")
@click.option("--quick", is_flag=True,
              help="4 and 64 MiB entries, 8 threads, O_DIRECT only, 256 MiB per figure: about "
                   "a minute.")
@click.option("--blocks", type=CommaList(SLAB_SIZE),
              default="256KiB,1MiB,4MiB,16MiB,64MiB", show_default=True,
              help="Comma-separated entry sizes.")
@click.option("--threads", type=COUNTS, default="1,8", show_default=True,
              help="Comma-separated I/O thread counts (NVMe and PMem tiers).")
@click.option("--total", type=SIZE, default="1GiB", show_default=True,
              help="Bytes moved per measurement.")
@click.option("--tiers", "tiers", type=CommaList(click.Choice(TIERS), name="tier"),
              default="nvme,pmem,host,gpu", show_default=True,
              help="Comma-separated tiers: nvme, pmem, host (cache hits), gpu (if CUDA).")
@click.option("--engines", type=CommaList(click.STRING, name="engine"), callback=_engines,
              default="auto,posix-direct", show_default=True,
              help="NVMe I/O engines (auto: Linux AIO where it runs; posix-direct: the "
                   "thread-pool fallback; posix-buffered). Add kvikio where CUDA and kvikio are present (reads "
                   "into host memory with its threads and direct I/O set from the store's; "
                   "the store's `auto` never picks it, as it is unmeasured).")
@click.option("--pmem-dir", type=click.Path(exists=True, file_okay=False),
              help="Directory for the PMem pool (a DAX mount such as /mnt/pmem0 in production; "
                   "default: the scratch directory).")
@click.option("--repeat", "repeats", type=click.IntRange(min=1), default=5, show_default=True,
              help="NVMe and PMem: store and ceilings measured in turn this many times; "
                   "medians reported.")
@click.option("--json", "json_out", type=OUTPUT_FILE, help="Write results here.")
@click.option("--plot", "plot_out", type=OUTPUT_FILE,
              help="Write a PNG: GB/s against entry size per tier, ceilings dashed.")
@click.option("--peer", type=click.Choice(["deepnvme"]),
              help="Only the NVMe reads into and writes from each kind of caller's memory, "
                   "beside DeepNVMe's aio_handle and fio (needs deepspeed: pip install "
                   "'.[peers]', and libaio-dev).")
@click.option("--paths", type=CommaList(click.Choice(["batch", "workers"]), name="path"),
              help="With --peer: each kind of memory once through each of these "
              "paths of the AIO engine, alternated with the rest (batch: one AIO batch; "
              "workers: the chunk workers' preadv/pwritev), every call sent that way instead "
              "of by the store's rule: how that rule was measured.")
@click.option("--read-call", type=SIZE, default="256MiB", show_default=True,
              help="The caller's-memory rows (--peer, and the nvme tier): bytes of entries "
                   "one get_many asks for, and DeepNVMe one read call; a layer's experts "
                   "are tens of MiB (e.g. 32MiB).")
@click.option("--write-call", type=SIZE,
              help="The caller's-memory rows: bytes of entries one put_many writes, each "
                   "durable, and DeepNVMe one write followed by an fsync (default: all of "
                   "--total in one put_many, DeepNVMe's pieces with one fsync at the end).")
@click.option("--kinds", type=CommaList(click.STRING, name="kind"),
              help="The caller's-memory rows: which kinds of memory, comma-separated "
                   "(default: torch.empty, read_buffer each, slices of one, slices at +100, "
                   "pinned, and cuda where CUDA is present). Also 'slices at +512': aligned "
                   "as O_DIRECT needs on a virtio disk, not to a page.")
def bench_tiers(store: str | None, quick: bool, blocks: list[int], threads: list[int],
                total: int, tiers: list[str], engines: list[str], pmem_dir: str | None,
                repeats: int, json_out: str | None, plot_out: str | None,
                peer: str | None, paths: list[str], read_call: int,
                write_call: int | None, kinds: list[str] | None) -> None:
    """Tier bandwidth (GB/s) and latency (p50/p99), each beside its ceiling from the same
    run: NVMe through the store's engines against fio (psync, and io_uring at queue depth 32)
    and DeepNVMe on the same file with the same request size and O_DIRECT flag (NVMe writes
    rewrite space each side wrote once before; their first writes into never-written space
    are listed after the table); PMem against the same durable copy without the store
    (pmem_memcpy_persist on DAX, memcpy + pmem_msync elsewhere) and memcpy; host cache
    hits against memcpy; host<->device against plain pinned copies."""
    from tierstore.bench.tiers import run_tiers

    sizes, counts, engine_list = blocks, threads, tuple(engines)
    if quick:
        sizes, counts, total, repeats = [4 << 20, 64 << 20], [8], min(total, 256 << 20), 1
        engine_list = tuple(e for e in engine_list if e != "posix-buffered")
    _run(lambda: run_tiers(store, sizes, counts, total, json_out, engines=engine_list,
                           tiers=tuple(tiers), pmem_dir=pmem_dir,
                           plot_out=plot_out, repeats=repeats, echo=click.echo,
                           peer=peer, paths=tuple(paths or ()), read_call=read_call,
                           write_call=write_call, kinds=kinds or None))


@bench.command(name="cache")
@click.option("--trace", "trace_file", type=click.Path(exists=True, dir_okay=False),
              help="A routing trace: CSV with header step,layer,expert[,nbytes].")
@click.option("--synthetic", metavar="SPEC", callback=_trace_spec,
              help="Generate a trace, e.g. 'zipf:a=1.1,layers=8,experts=64,steps=200,topk=2,"
                   "drift=0.05,burst=0.1,seed=0' (tokens=1 gives a decode-like trace).")
@click.option("--capacity", "capacities", type=CommaList(_Capacity()), default="0.1,0.25,0.5",
              show_default=True,
              help="Capacities: fractions of the trace's distinct bytes, or sizes (64MiB).")
@click.option("--policies", type=CommaList(click.STRING, name="policy"), callback=_policies,
              default="all", show_default=True,
              help="Comma-separated policies (lfu-decay, semoe, lru, lfu, arc, belady) or all.")
@click.option("--write-fraction", type=FiniteFloat(0, 1), default=0.0, show_default=True,
              help="Share of accesses that update the entry (1.0 for training traces).")
@click.option("--policy-arg", "policy_args", multiple=True, metavar="POLICY:K=V,...",
              help="Policy parameters, e.g. lfu-decay:beta=0.5,period=512,theta=4.")
@click.option("--overhead", "overhead_entries", type=click.IntRange(min=0), default=0,
              show_default=True,
              help="Also time each policy's per-access cost with this many resident entries.")
@click.option("--json", "json_out", type=OUTPUT_FILE, help="Write results here.")
@click.option("--plot", "plot_out", type=OUTPUT_FILE,
              help="Write a PNG of hit rate against capacity, every policy, belady on top.")
def bench_cache(trace_file: str | None, synthetic: str | None, capacities: list[str],
                policies: list[str], write_fraction: float, policy_args: tuple[str, ...],
                overhead_entries: int, json_out: str | None, plot_out: str | None) -> None:
    """Replay a routing trace against every eviction policy at each capacity, beside
    Belady's offline optimum on the same trace."""
    from tierstore.bench.cache_lab import parse_policy_args, run_cache_lab

    def go() -> int:
        try:
            return run_cache_lab(
                trace_file=trace_file, synthetic=synthetic, capacities=",".join(capacities),
                policies=",".join(policies), write_fraction=write_fraction,
                policy_args=parse_policy_args(policy_args), json_out=json_out,
                plot_out=plot_out, overhead_entries=overhead_entries, echo=click.echo)
        except ValueError as e:  # a malformed --trace file: one line that names it
            click.echo(f"tierstore bench cache: {e}", err=True)
            return 2

    _run(go)


@bench.command(name="prefetch")
@click.option("--store", "store", type=click.Path(file_okay=False),
              help="Scratch directory (default: a temporary directory here, removed after).")
@click.option("--layers", default=8, show_default=True, help="MoE layers.")
@click.option("--experts", default=8, show_default=True, help="Experts per layer.")
@click.option("--expert-bytes", type=SIZE, default="4MiB", show_default=True,
              help="Size of one expert (a multiple of 4 x hidden).")
@click.option("--hidden", default=1024, show_default=True, help="Matmul width.")
@click.option("--tokens", default=256, show_default=True, help="Tokens per layer's matmuls.")
@click.option("--repeat", type=click.IntRange(min=1), default=None,
              help="Matmul repeats per expert (default: calibrated so a layer computes for "
                   "about 1.5x its transfer time).")
@click.option("--steps", default=5, show_default=True, help="Measured steps per mode.")
@click.option("--device-budget", type=SIZE, default=None,
              help="Prefetch budget (default: three layers).")
@click.option("--host-cache", type=CACHE_SIZE, default=None,
              help="Host cache (default: half a layer, so reads hit the backing tier).")
@click.option("--device", type=DEVICE, default=None, help="Compute device (default: cpu).")
@click.option("--json", "json_out", type=OUTPUT_FILE, help="Write results here.")
def bench_prefetch(store: str | None, layers: int, experts: int, expert_bytes: int, hidden: int,
                   tokens: int, repeat: int | None, steps: int, device_budget: int | None,
                   host_cache: int | None, device: str | None, json_out: str | None) -> None:
    """A layered workload (real matmuls per layer, experts in the store) run with on-demand
    loading and with prefetch of the next layers; reports step time, stall fraction and bytes
    moved."""
    from tierstore.bench.prefetch import run_prefetch

    _run(lambda: run_prefetch(
        store, layers=layers, experts=experts, expert_bytes=expert_bytes, hidden=hidden,
        tokens=tokens, repeat=repeat, steps=steps, device_budget=device_budget,
        host_cache=host_cache, device=device, json_out=json_out, echo=click.echo))


@bench.command(name="infer")
@click.option("--store", "store", type=click.Path(exists=True, file_okay=False),
              help="A store holding a model (default: a synthetic model of --shape written "
                   "to a temporary store here).")
@click.option("--shape", type=click.Choice(["mixtral", "deepseek_v3", "gpt_oss"]),
              default="mixtral", show_default=True,
              help="Synthetic model's family and shape: Mixtral (8 wide experts, top-2), "
                   "DeepSeek-V3 (MLA, many small routed experts in groups, top-6, a shared "
                   "expert) or gpt-oss (biased, transposed experts, attention sinks).")
@click.option("--model-dir", type=click.Path(exists=True, file_okay=False),
              help="A Hugging Face model directory, imported into a temporary store first.")
@click.option("--layers", default=8, show_default=True, type=click.IntRange(min=1),
              help="Synthetic model: MoE layers.")
@click.option("--experts", default=8, show_default=True, type=click.IntRange(min=1),
              help="Synthetic model: experts/layer.")
@click.option("--hidden", default=512, show_default=True, type=click.IntRange(min=1),
              help="Synthetic model: width.")
@click.option("--ffn", default=1024, show_default=True, type=click.IntRange(min=1),
              help="Synthetic model: expert width.")
@click.option("--prefill-batch", default=4, show_default=True, type=click.IntRange(min=1),
              help="Prompts in the prefill run.")
@click.option("--prefill-len", default=128, show_default=True, type=click.IntRange(min=1),
              help="Tokens per prefill prompt.")
@click.option("--decode-batch", default=1, show_default=True, type=click.IntRange(min=1),
              help="Prompts in the decode run.")
@click.option("--decode-tokens", default=8, show_default=True, type=click.IntRange(min=1),
              help="Tokens generated per prompt.")
@click.option("--ring-slots", type=COUNTS, default="2,4", show_default=True,
              help="Comma-separated ring sizes K to measure (besides auto).")
@click.option("--tier", type=click.Choice(["backing", "nvme", "host"]), default="backing",
              show_default=True,
              help="Where the experts come from: the store's backing tier with no host cache, "
                   "so every transfer reads it ('nvme' also checks that it is NVMe), or host "
                   "memory (a host cache holding every expert).")
@click.option("--host-cache", type=CACHE_SIZE, help="Host cache size (overrides --tier).")
@click.option("--expert-budget", type=FiniteFloat(0, 1, min_open=True), default=0.6,
              show_default=True,
              help="Expert mode's device budget as a fraction of all experts' bytes.")
@click.option("--repeats", "--rounds", "repeats", type=click.IntRange(min=1), default=5,
              show_default=True,
              help="Rounds over every mode (interleaved, or alternated with --peer); each mode "
                   "reports its median.")
@click.option("--device", type=DEVICE, default=None,
              help="Compute device (default: cuda if available; with --peer tierstore's "
                   "runs take it only when named, and the peer runs on the CPU).")
@click.option("--vocab", type=click.IntRange(min=8),
              help="Synthetic model: vocabulary [512; 32000 with --peer].")
@click.option("--peer", type=click.Choice(["accelerate", "llamacpp"]),
              help="Also run the checkpoint (--model-dir, or a synthetic one of --shape "
                   "saved with transformers) through this system: accelerate's disk offload "
                   "(experts on \"disk\", the rest on the CPU; the `peers` extra), or "
                   "llama.cpp on the checkpoint converted to GGUF F32 once (cached in "
                   "MODEL_DIR/gguf), memory-mapped (the `llamacpp` extra, which builds "
                   "llama.cpp from source: 10 CPU-minutes, 37 minutes on a shared 2-core "
                   "machine). Every run is then a "
                   "fresh process (`tierstore generate` per mode: resident, ring auto, expert, "
                   "on-demand) with one prompt of --prefill-len tokens and --decode-tokens "
                   "greedy tokens; tokens are checked equal, and prefill and decode tokens/s, "
                   "the time outside them (the cold start), peak RSS and the ratios to the "
                   "peer reported.")
@click.option("--memory-limit", metavar="SIZE|FRACTION", callback=_memory_limit,
              help="With --peer: run every offloading mode and the peer in a memory cgroup "
                   "with this limit (page cache included), a size (1.4GiB) or a fraction of "
                   "the checkpoint's size (0.75). Resident runs without it (it holds every "
                   "expert: the compute reference). Without a writable cgroup the runs are "
                   "unlimited and the results say so.")
@click.option("--cold/--warm", default=True, show_default=True,
              help="With --peer: drop the page cache before every run (where permitted; the "
                   "results say when it was not).")
@click.option("--device-budget", type=SIZE,
              help="Bytes of experts the device may hold (with --peer: passed to `tierstore "
                   "generate`; default the store's, or a quarter of --memory-limit).")
@click.option("--threads", type=click.IntRange(min=1),
              help="With --peer: CPU compute threads of every run, the peer's included "
                   "(default: 1 with llamacpp; with accelerate each system's own: tierstore's "
                   "ring and expert modes leave a core to their reads while the host cache "
                   "cannot hold every expert).")
@click.option("--engine", type=click.Choice(["auto", "posix-direct"]), default="auto",
              show_default=True,
              help="The store's NVMe I/O engine (auto: Linux AIO where it runs; "
                   "posix-direct: the thread-pool fallback).")
@click.option("--quantized", type=click.Choice(["mxfp4", "fp8"]),
              help="With --peer: a synthetic checkpoint with its experts in mxfp4 (the "
                   "gpt_oss shape, as gpt-oss ships) or 128x128 block fp8 (the deepseek_v3 "
                   "shape, as DeepSeek-V3 ships), imported compact, against the same weights "
                   "in bf16 imported as they are (the peer runs those); --memory-limit's "
                   "fraction is of the bf16 checkpoint.")
@click.option("--json", "json_out", type=OUTPUT_FILE, help="Write results here.")
def bench_infer(store: str | None, model_dir: str | None, shape: str, layers: int, experts: int,
                hidden: int,
                ffn: int, prefill_batch: int, prefill_len: int, decode_batch: int,
                decode_tokens: int, ring_slots: list[int], tier: str, host_cache: int | None,
                expert_budget: float, repeats: int, device: str | None, vocab: int | None,
                peer: str | None, memory_limit: str | None, cold: bool,
                device_budget: int | None, threads: int | None, engine: str,
                quantized: str | None, json_out: str | None) -> None:
    """Tokens/s of one model and one set of prompts with every expert source: fully
    resident, ring at several K and auto, expert mode, synchronous on-demand loading; ratios
    against resident, against on-demand, and for ring decoding against the limit set by the
    bytes moved per token over the tier bandwidth measured in the same run.

    With --peer accelerate: the same Hugging Face checkpoint through accelerate's disk
    offload and every tierstore mode, each run a fresh process, cold, optionally under a
    memory limit; ratios to accelerate per phase, and the ring's prefill against its
    physical limit, max(compute, bytes read / the tier's bandwidth measured in every round).
    With --peer llamacpp the same against llama.cpp on the checkpoint as GGUF F32 (bytes it
    read from disk, from /proc/self/io, reported), one compute thread per run by default.
    Without --memory-limit the host cache holds every expert (as the page cache does for
    accelerate); under one it defaults to a sixth of the limit (--host-cache overrides).
    With --quantized mxfp4|fp8 the checkpoint ships its experts quantized; its store is
    held against the same weights imported in bf16 (resident and expert mode; the peer runs
    the bf16 weights, llama.cpp the shipped ones as Q8_0 with gpt-oss's MXFP4 experts kept).

    \b
    tierstore bench infer --peer accelerate --hidden 1024 --ffn 2048 --prefill-len 16 \\
        --decode-tokens 16 --rounds 3 --memory-limit 0.75 --host-cache 256MiB \\
        --device-budget 400MiB --json peer.json
    tierstore bench infer --peer llamacpp --layers 4 --hidden 1024 --ffn 2048 --vocab 2000 \\
        --prefill-len 16 --decode-tokens 16 --rounds 1 --memory-limit 0.75
    tierstore bench infer --peer accelerate --quantized mxfp4 --layers 8 --experts 24 \
        --hidden 1024 --ffn 2048 --prefill-len 16 --decode-tokens 8 --threads 1 \
        --rounds 1 --memory-limit 0.75"""
    if store and model_dir:
        raise click.UsageError("--store and --model-dir exclude each other")
    if peer and store:
        raise click.UsageError("--peer needs a Hugging Face checkpoint (--model-dir, or none "
                               "for a synthetic one), not --store")
    if memory_limit and not peer:
        raise click.UsageError("--memory-limit applies to the fresh processes of --peer")
    if quantized and not peer:
        raise click.UsageError("--quantized applies to the fresh processes of --peer")
    if quantized and (store or model_dir):
        raise click.UsageError("--quantized writes its own checkpoints: leave out --store and "
                               "--model-dir")
    if quantized:
        from tierstore.bench.quant_models import FORMATS, check_quant_shape

        shape = FORMATS[quantized]
        try:
            check_quant_shape(quantized, hidden, ffn)
        except ValueError as e:
            raise click.UsageError(str(e)) from None
    if peer and engine != "auto":
        raise click.UsageError("--engine applies to the in-process benchmark, not --peer")
    if store is None and model_dir is None:
        _check_synthetic(shape, layers, experts, hidden, ffn)
        if peer == "llamacpp" and vocab is not None:
            from tierstore.bench.llamacpp import check_vocab

            from tierstore import StoreError

            try:
                check_vocab(vocab)
            except StoreError as e:
                raise click.UsageError(str(e)) from None
    from tierstore.bench.infer import run_infer

    def go() -> None:
        run_infer(store, model_dir, json_out=json_out, layers=layers, experts=experts,
                  hidden=hidden, ffn=ffn, prefill_batch=prefill_batch, prefill_len=prefill_len,
                  decode_batch=decode_batch, decode_tokens=decode_tokens, ring_slots=ring_slots,
                  host_cache=host_cache, expert_budget=expert_budget, device=device,
                  repeats=repeats, tier=tier, vocab=vocab, peer=peer,
                  memory_limit=memory_limit, cold=cold, device_budget=device_budget,
                  threads=threads, engine=engine, shape=shape, quantized=quantized,
                  echo=click.echo)

    _run(go)


@bench.command(name="dequant")
@click.option("--repeats", type=click.IntRange(min=1), default=5, show_default=True,
              help="Timed runs of each (the median is reported).")
@click.option("--threads", type=click.IntRange(min=1), help="CPU threads (default: torch's).")
@click.option("--device", type=DEVICE, default="cpu", show_default=True,
              help="Where the expert is dequantized and read to: cpu, cuda or cuda:N.")
@click.option("--json", "json_out", type=OUTPUT_FILE, help="Write results here.")
def bench_dequant(repeats: int, threads: int | None, device: str, json_out: str | None) -> None:
    """Dequantizing one packed expert of gpt-oss-120b (MXFP4) and DeepSeek-V3 (block FP8)
    to bf16, by tierstore and by transformers' own function, beside reading its compact
    bytes from a store's backing tier.

    \b
    tierstore bench dequant --repeats 5 --json dequant.json"""
    from tierstore.bench.dequant import run_dequant

    def go() -> None:
        run_dequant(repeats=repeats, threads=threads, device=device, json_out=json_out,
                    echo=click.echo)

    _run(go)


@bench.command(name="train")
@click.option("--model", default="medium", show_default=True,
              help="Model preset (tierstore train --list-models).")
@click.option("--steps", default=10, show_default=True, type=click.IntRange(min=1),
              help="Measured optimizer steps per side and round.")
@click.option("--warmup", default=3, show_default=True, type=click.IntRange(min=0),
              help="Steps run before measuring (cold cache, first-call costs).")
@click.option("--rounds", default=2, show_default=True, type=click.IntRange(min=1),
              help="Resident/store pairs, alternating which goes first.")
@click.option("--host-cache", type=CACHE_SIZE, default="2GiB", show_default=True,
              help="The store's host cache (the target applies when it holds a step's "
                   "working set).")
@click.option("--batch-size", type=click.IntRange(min=1), help="Sequences per step [8].")
@click.option("--seq-len", type=click.IntRange(min=1), help="Tokens per sequence [128].")
@click.option("--device", type=DEVICE, default="cpu", show_default=True,
              help="cpu, cuda or cuda:N.")
@click.option("--store", "store", type=click.Path(file_okay=False),
              help="Scratch directory (default: a temporary directory here, removed after).")
@click.option("--model-dir", type=click.Path(exists=True, file_okay=False),
              help="Instead of --model: fine-tune this Hugging Face checkpoint (Mixtral, "
                   "Qwen2-MoE, OLMoE, Qwen3-MoE), imported afresh into the scratch directory "
                   "for every store run, against transformers-equivalent training in memory.")
@click.option("--engine", type=click.Choice(["auto", "posix-direct"]), default="auto",
              show_default=True,
              help="The store's NVMe I/O engine (auto: Linux AIO where it runs; "
                   "posix-direct: the thread-pool fallback).")
@click.option("--peer", type=click.Choice(["deepspeed"]),
              help="With --model-dir: also the checkpoint under DeepSpeed ZeRO-3 with "
                   "parameters and optimizer states offloaded to NVMe (a folder in the "
                   "scratch directory), same batches and steps, in a fresh process; needs "
                   "the peers extra.")
@click.option("--json", "json_out", type=OUTPUT_FILE, help="Write results here.")
def bench_train(model: str, steps: int, warmup: int, rounds: int, host_cache: int,
                batch_size: int | None, seq_len: int | None, device: str, store: str | None,
                model_dir: str | None, engine: str, peer: str | None,
                json_out: str | None) -> None:
    """Step time of the store trainer against the resident trainer (same model, data and
    seed): median step times, their ratio (target <= 1.15), stall fraction, hit rate.
    With --model-dir, of fine-tuning an imported checkpoint over the store against the same
    model trained in memory."""
    from tierstore.bench.train import run_train_bench

    given = {"batch_size": batch_size, "seq_len": seq_len}

    def go() -> int:
        try:
            run_train_bench(model=model, steps=steps, warmup=warmup, rounds=rounds,
                            host_cache=host_cache, store=store, device=device,
                            overrides={k: v for k, v in given.items() if v is not None},
                            json_out=json_out, echo=click.echo, model_dir=model_dir,
                            engine=engine, peer=peer)
        except ValueError as e:
            click.echo(f"tierstore bench train: {e}", err=True)
            return 2
        return 0

    _run(go)




@bench.command(name="daemon")
@click.option("--store", "store", type=click.Path(exists=True, file_okay=False),
              help="Scratch directory (default: a temporary directory here, removed after).")
@click.option("--entry-bytes", type=SIZE, default="4MiB", show_default=True,
              help="Size of each entry (an expert's tensor).")
@click.option("--entries", default=32, show_default=True, type=click.IntRange(min=1),
              help="Entries in the store.")
@click.option("--clients", type=COUNTS, default="1,2,4,8", show_default=True,
              help="Comma-separated client counts (threads in-process, processes via the daemon).")
@click.option("--gets", default=200, show_default=True, type=click.IntRange(min=1),
              help="Gets per client per measurement.")
@click.option("--repeat", default=3, show_default=True, type=click.IntRange(min=1),
              help="In-process and daemon measured in turn this many times; medians reported.")
@click.option("--json", "json_out", type=OUTPUT_FILE, help="Write results here.")
def bench_daemon(store: str | None, entry_bytes: int, entries: int, clients: list[int],
                 gets: int, repeat: int, json_out: str | None) -> None:
    """Get throughput of cached entries through the daemon (client processes copying out of
    the shared cache, and taking zero-copy views) against the same gets in-process (threads
    on one store), for each client count; the ratio is daemon / in-process."""
    from tierstore.bench.daemon import run_daemon_bench

    def go() -> None:
        run_daemon_bench(store, entry_bytes=entry_bytes, entries=entries, clients=clients,
                         gets=gets, repeat=repeat, json_out=json_out, echo=click.echo)

    _run(go)


@bench.command(name="dist")
@click.option("--model", "presets", type=NAMES, default="tiny", show_default=True,
              help="Comma-separated model presets (tiny, small, ...).")
@click.option("--batch-sizes", type=COUNTS, default="2,8,32", show_default=True,
              help="Comma-separated per-rank batch sizes (sequences per rank per step).")
@click.option("--seq-len", default=64, show_default=True, type=click.IntRange(min=1),
              help="Tokens per sequence.")
@click.option("--steps", default=4, show_default=True, type=click.IntRange(min=2),
              help="Steps per run; the first is not timed.")
@click.option("--worlds", type=NAMES, default="1,2,4", show_default=True,
              help="Comma-separated worlds: W (1: one rank; even W: two nodes of W/2 ranks) "
                   "or NODESxRANKS, e.g. 2x2.")
@click.option("--paradigms", type=NAMES, default="token,data", show_default=True,
              help="Comma-separated paradigms: token, data, and token-2stage (token-centric "
                   "with the two-stage all-to-all, --hierarchical-a2a; run on worlds of several "
                   "nodes of several ranks only).")
@click.option("--host-cache", type=CACHE_SIZE, default="128MiB", show_default=True,
              help="Each node daemon's host cache.")
@click.option("--threads", default=1, show_default=True, type=click.IntRange(min=1),
              help="Compute threads per rank (OMP_NUM_THREADS).")
@click.option("--peer", type=click.Choice(["deepspeed"]),
              help="Also train the same MoE in DeepSpeed (one process, states on NVMe) and "
                   "report it beside the W=1 rows, or why it cannot run.")
@click.option("--peer-batch", type=click.IntRange(min=1),
              help="The per-step batch of the --peer run [8 if among --batch-sizes, else the "
                   "first].")
@click.option("--store", "scratch", type=click.Path(file_okay=False),
              help="Scratch directory for the node stores (default: a temporary directory "
                   "here, removed afterwards).")
@click.option("--timeout", default=600.0, show_default=True,
              type=FiniteFloat(min=0, min_open=True),
              help="Seconds one configuration may run before it is stopped.")
@click.option("--model-dir", type=click.Path(exists=True, file_okay=False),
              help="Fine-tune this Hugging Face checkpoint instead of a preset (imported into "
                   "each node's store), token-centric, at each --pipeline setting.")
@click.option("--family", type=click.Choice(["mixtral", "deepseek_v3", "gpt_oss"]),
              help="As --model-dir, on a tiny checkpoint of this family written here.")
@click.option("--pipeline", "pipelines", type=NAMES, default="1,2,4,auto", show_default=True,
              help="With --model-dir/--family: comma-separated chunk counts N, or auto.")
@click.option("--json", "json_out", type=OUTPUT_FILE, help="Write results here.")
@click.pass_context
def bench_dist(ctx: click.Context, presets: list[str], batch_sizes: list[int], seq_len: int,
               steps: int, worlds: list[str], paradigms: list[str], host_cache: int,
               threads: int, peer: str | None, peer_batch: int | None, scratch: str | None,
               timeout: float, model_dir: str | None, family: str | None,
               pipelines: list[str], json_out: str | None) -> None:
    """Distributed training on this machine: bytes moved between ranks per step, token- and
    data-centric, split intra-node/cross-node and tokens/experts/gradients, beside Janus's
    formula (R, and its cross-node volumes, an upper bound for data-centric), and step time
    and peak RSS at each world size.

    Every configuration is a real run: one torchrun agent per "node" (127.0.0.1, gloo), each
    node with its own store and daemon. The byte counts are exact; the step times share this
    machine's cores between every rank and daemon, so they show overhead, not scaling.

    \b
    With --model-dir (or --family) it fine-tunes an imported checkpoint instead, every MoE
    block token-centric in N chunks (MPMoE), and reports per run the compute, communication
    and hidden time from the pipeline's counters, the bytes moved, and the performance
    model's T(N) from the auto run's logged alpha, beta and c. On 2 cores the times cannot
    rank the settings: trust the hidden fraction and the traffic.

    \b
    tierstore bench dist --model tiny,small --batch-sizes 2,8,32 --worlds 1,2,4 \\
        --paradigms token,data,token-2stage --steps 4 --peer deepspeed --json dist.json
    tierstore bench dist --family mixtral --pipeline 1,2,4,auto --worlds 2 \\
        --batch-sizes 4 --json dist_hf.json"""
    from tierstore.bench.dist import run_dist_bench
    from tierstore.bench.dist_hf import run_dist_hf_bench

    hf = model_dir is not None or family is not None
    given = {name for name in ("presets", "paradigms", "peer", "peer_batch", "pipelines")
             if ctx.get_parameter_source(name) is not click.core.ParameterSource.DEFAULT}

    def go() -> int:
        try:
            if model_dir is not None and family is not None:
                raise ValueError("--model-dir and --family both name the model; give one")
            if hf and given & {"presets", "paradigms", "peer", "peer_batch"}:
                raise ValueError("--model, --paradigms and --peer are the presets' options; an "
                                 "imported model runs token-centric at each --pipeline")
            if not hf and "pipelines" in given:
                raise ValueError("--pipeline chunks an imported model: give --model-dir or "
                                 "--family")
            if hf:
                result = run_dist_hf_bench(
                    model_dir, family, pipelines, batch_sizes, seq_len, steps, worlds,
                    host_cache=host_cache, threads=threads, scratch=scratch,
                    json_out=json_out, timeout=timeout, echo=click.echo)
                return 1 if any("error" in r for r in result["rows"]) else 0
            result = run_dist_bench(
                presets, batch_sizes, seq_len, steps, worlds, paradigms,
                host_cache=host_cache, threads=threads, scratch=scratch, peer=peer,
                peer_batch=peer_batch, json_out=json_out, timeout=timeout, echo=click.echo)
        except ValueError as e:
            click.echo(f"tierstore bench dist: {e}", err=True)
            return 2
        return 1 if any("error" in r for r in result["rows"]) else 0

    _run(go)
