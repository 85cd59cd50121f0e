"""The ``tierstore`` command line.

Commands that act on a store take it as their first argument; commands whose subject is
something else (an import source, a benchmark) name the store with ``--store``.
"""

from __future__ import annotations

import json
import os
from typing import Any

import click

from .cli_options import SIZE
from .cli_options import run_command as _run
from .errors import StoreError
from .sizes import format_size, parse_size

DEFAULT_DEMO_STORE = "demo-store"


def _bar(total: int, desc: str) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024,
                disable=None, dynamic_ncols=True)


def _open(path: str, **kw: Any) -> Any:
    from . import open as open_store

    return open_store(path, **kw)


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(package_name="tierstore")
def main() -> None:
    """tierstore: keep Mixture-of-Experts parameter states (weights, gradients, optimizer
    states) on NVMe or persistent memory, behind an LMDB catalog with copy-on-write,
    checksum-verified entries.

    Start with `tierstore demo`, or `tierstore init STORE` and the Python API
    (`tierstore.open(STORE)`).
    """


@main.command()
@click.argument("store", type=click.Path(file_okay=False))
@click.option("--backing", type=click.Choice(["nvme", "pmem"]), default="nvme", show_default=True,
              help="Backing tier: slab files under STORE, or a persistent-memory pool file.")
@click.option("--slab-size", type=SIZE, default="1GiB", show_default=True,
              help="Size of each preallocated NVMe slab file.")
@click.option("--pmem-path", type=click.Path(dir_okay=False),
              help="Pool file for --backing pmem (on a DAX mount in production).")
@click.option("--pmem-size", type=SIZE, help="Initial pool size for --backing pmem, e.g. 16GiB.")
def init(store: str, backing: str, slab_size: int, pmem_path: str | None,
         pmem_size: int | None) -> None:
    """Create an empty store at STORE."""

    def go() -> None:
        if os.path.exists(os.path.join(store, "TIERSTORE")):
            raise StoreError(f"{store} is already a store")
        with _open(store, create=True, backing=backing, slab_size=slab_size,
                   pmem_path=pmem_path, pmem_size=pmem_size) as st:
            click.echo(f"created {st.path} ({st.describe()})")

    _run(go)


@main.command()
@click.argument("store", type=click.Path(exists=True, file_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def info(store: str, as_json: bool) -> None:
    """Entries, bytes per tier, snapshots and the backend in use."""

    def go() -> None:
        with _open(store) as st:
            stats = st.stats()
            snaps = [vars(s) for s in st.snapshots()]
            if as_json:
                click.echo(json.dumps({"path": st.path, "backend": st.describe(), **stats,
                                       "snapshot_list": snaps}))
                return
            click.echo(f"store     {st.path}")
            click.echo(f"backend   {st.describe()}")
            click.echo(f"entries   {stats['entries']} ({format_size(stats['bytes_stored'])})")
            click.echo(f"capacity  {format_size(stats['capacity_bytes'])} "
                       f"({format_size(stats['free_bytes'])} free)")
            for s in snaps:
                click.echo(f"snapshot  {s['tag']}: {s['entries']} entries, "
                           f"{format_size(s['nbytes'])}")

    _run(go)


@main.command(name="ls")
@click.argument("store", type=click.Path(exists=True, file_okay=False))
@click.argument("prefix", default="")
@click.option("-l", "--long", "long_", is_flag=True, help="Kind, dtype, shape, size, version.")
def ls(store: str, prefix: str, long_: bool) -> None:
    """List entries whose name starts with PREFIX."""

    def go() -> None:
        with _open(store) as st:
            for name, kind in st.keys(prefix):
                if not long_:
                    click.echo(name if kind == "param" else f"{name}  [{kind}]")
                    continue
                e = st.info(name, kind)
                dt = str(e.dtype).removeprefix("torch.")
                click.echo(f"{name}\t{kind}\t{dt}\t{list(e.shape)}\t{e.nbytes}\tv{e.version}")

    _run(go)


@main.command()
@click.argument("store", type=click.Path(exists=True, file_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.option("--repair", is_flag=True,
              help="For a store whose catalog is lost or damaged: move the damaged catalog "
                   "aside, bring the store back to its latest snapshot from the catalog copy "
                   "that snapshot saved, and verify every entry.")
def fsck(store: str, as_json: bool, repair: bool) -> None:
    """Verify every checksum (live and snapshot versions), the reference counts, the free
    map and the slab files. Exits 1 if anything is wrong; a damaged catalog is reported
    too, and `--repair` recovers from it."""
    from .errors import CatalogError
    from .store import FsckReport

    def go() -> int:
        with _bar(0, "repair" if repair else "fsck") as bar:
            seen = [0]

            def progress(done: int) -> None:
                bar.total = max(bar.total, done)
                bar.update(done - seen[0])
                seen[0] = done

            if repair:
                from .repair import repair_store

                done = repair_store(store, progress)
                report = done.check
                if done.damaged_catalog:
                    report.notes.append(f"damaged catalog kept at {done.damaged_catalog}")
                report.notes += [f"set aside {p} (written after the snapshot)"
                                 for p in done.set_aside]
                report.notes.append(f"restored snapshot {done.snapshot!r}")
            else:
                try:
                    with _open(store, host_cache=0) as st:
                        bar.total = st.stats()["bytes_stored"]
                        report = st.fsck(progress)
                except CatalogError as e:
                    report = FsckReport(problems=[str(e)])
        if as_json:
            click.echo(json.dumps(vars(report)))
        else:
            for p in report.problems:
                click.echo(f"PROBLEM  {p}")
            for n in report.notes:
                click.echo(f"note     {n}")
            verdict = "clean" if report.ok else f"{len(report.problems)} problem(s)"
            click.echo(f"{report.entries} stored versions, {format_size(report.nbytes)} "
                       f"verified: {verdict}")
        return 0 if report.ok else 1

    _run(go)


@main.command()
@click.argument("store", type=click.Path(exists=True, file_okay=False))
@click.argument("out", type=click.Path())
@click.option("--format", "fmt", type=click.Choice(["zarr", "safetensors"]), required=True,
              help="zarr: a v3 group, one array per tensor family, one chunk per expert. "
                   "safetensors: OUT.safetensors, or a directory of shards with an index.")
@click.option("--shard-size", type=SIZE, default="4GiB", show_default=True,
              help="safetensors shard size.")
def export(store: str, out: str, fmt: str, shard_size: int) -> None:
    """Export every live entry of STORE to OUT."""
    from .interchange import export_safetensors, export_zarr

    def go() -> None:
        with _open(store) as st, _bar(st.stats()["bytes_stored"], "export") as bar:
            if fmt == "zarr":
                n = export_zarr(st, out, progress=bar)
            else:
                n = export_safetensors(st, out, shard_size=shard_size, progress=bar)
        click.echo(f"exported {format_size(n)} to {out}")

    _run(go)


@main.command(name="import")
@click.argument("source", type=click.Path(exists=True))
@click.option("--store", "store", required=True, type=click.Path(file_okay=False),
              help="Store to import into (created if missing).")
@click.option("--format", "fmt", type=click.Choice(["zarr", "safetensors"]),
              help="Source format (default: detected).")
def import_(source: str, store: str, fmt: str | None) -> None:
    """Import SOURCE: a zarr v3 group, a .safetensors file, or a sharded directory
    (or its *.safetensors.index.json)."""
    from .interchange import import_into, open_source

    def go() -> None:
        # Checked from its headers before the store is opened (or created): a source that
        # cannot be imported leaves no store and no half import behind.
        src = open_source(source, fmt)
        with _open(store, create=True) as st, _bar(src.nbytes, "import") as bar:
            n = import_into(st, src, progress=bar)
        click.echo(f"imported {n} tensors from {source} ({src.fmt})")

    _run(go)


@main.command(name="import-hf")
@click.argument("model_dir", type=click.Path())
@click.option("--store", "store", required=True, type=click.Path(file_okay=False),
              help="Store to import into (created if missing; must not hold a model yet).")
@click.option("--resume", is_flag=True,
              help="Continue an interrupted import of the same checkpoint into STORE: experts "
                   "and tensors already stored as the checkpoint has them are kept.")
def import_hf_(model_dir: str, store: str, resume: bool) -> None:
    """Import the Hugging Face MoE model in MODEL_DIR (config.json, single or sharded
    safetensors, tokenizer files) for `tierstore generate`: each expert becomes one entry
    group (layers.{i}.experts.{e}.w1|w2|w3), the dense weights, config and tokenizer are
    kept beside them. Supported: Mixtral, Qwen2-MoE, OLMoE, Qwen3-MoE.

    \b
    tierstore import-hf ./Mixtral-8x7B-v0.1 --store mixtral
    tierstore import-hf ./Mixtral-8x7B-v0.1 --store mixtral --resume   # after an interruption
    """
    from tierstore.trainer.hf_import import import_hf

    def go() -> None:
        info = import_hf(model_dir, store, progress=True, resume=resume)
        cfg = info["config"]
        click.echo(f"imported {info['family']}: {cfg['n_layers']} layers, "
                   f"{len(cfg['moe_layers'])}x{cfg['n_experts']} experts, "
                   f"tokenizer {'yes' if 'tokenizer.json' in info['tokenizer'] else 'no'}"
                   f" -> {store}")

    _run(go)


@main.command()
@click.argument("store", type=click.Path(exists=True, file_okay=False))
@click.argument("tag", required=False)
def snapshot(store: str, tag: str | None) -> None:
    """Take snapshot TAG of every entry's current version (no TAG: list snapshots)."""

    def go() -> None:
        with _open(store) as st:
            if tag is None:
                for s in st.snapshots():
                    click.echo(f"{s.tag}\t{s.entries} entries\t{format_size(s.nbytes)}")
                return
            s = st.snapshot(tag)
            click.echo(f"snapshot {s.tag}: {s.entries} entries, {format_size(s.nbytes)}")

    _run(go)


@main.command()
@click.argument("store", type=click.Path(exists=True, file_okay=False))
@click.argument("tag")
def restore(store: str, tag: str) -> None:
    """Make STORE's entries exactly those of snapshot TAG."""

    def go() -> None:
        with _open(store) as st:
            s = st.restore(tag)
            click.echo(f"restored {s.tag}: {s.entries} entries")

    _run(go)


@main.command(name="drop-snapshot")
@click.argument("store", type=click.Path(exists=True, file_okay=False))
@click.argument("tag")
def drop_snapshot(store: str, tag: str) -> None:
    """Forget snapshot TAG; space only it held is reused."""

    def go() -> None:
        with _open(store) as st:
            st.drop_snapshot(tag)
            click.echo(f"dropped {tag}")

    _run(go)


@main.command()
@click.option("--store", "store", default=DEFAULT_DEMO_STORE, show_default=True,
              type=click.Path(file_okay=False),
              help="Store directory for the tier walk-through (created if missing); the "
                   "training run uses STORE-model next to it.")
@click.option("--layers", default=8, show_default=True, help="MoE layers (tier walk-through).")
@click.option("--experts", default=16, show_default=True, help="Experts per layer.")
@click.option("--hidden", default=512, show_default=True, help="Model width.")
@click.option("--ffn", default=1024, show_default=True, help="Expert hidden width.")
@click.option("--seed", default=0, show_default=True)
@click.option("--fresh", is_flag=True, help="Delete the demo store first.")
@click.option("--model", default="small", show_default=True,
              help="Preset trained in the second part (tierstore train --list-models).")
@click.option("--train-steps", default=60, show_default=True, type=click.IntRange(min=0),
              help="Optimizer steps of the training part (0: skip training and generation).")
@click.option("--new-tokens", default=48, show_default=True, type=click.IntRange(min=1),
              help="Tokens generated from the trained model.")
def demo(store: str, layers: int, experts: int, hidden: int, ffn: int, seed: int,
         fresh: bool, model: str, train_steps: int, new_tokens: int) -> None:
    """The whole path in about a minute on a CPU. First a synthetic MoE model's expert
    states are written through the host cache to the backing tier, read back, snapshotted
    and verified. Then a small MoE model is trained with its experts and AdamW moments in a
    store (host cache smaller than the states), checked with fsck, and made to generate
    text through the ring-memory inferencer and the expert-granular mode."""
    from .demo import run_demo

    def go() -> int:
        code = run_demo(store, layers=layers, experts=experts, hidden=hidden, ffn=ffn,
                        seed=seed, fresh=fresh, echo=click.echo)
        if train_steps:
            from tierstore.trainer.demo import run_demo_training

            code = max(code, run_demo_training(
                store.rstrip("/") + "-model", model=model, steps=train_steps, seed=seed,
                new_tokens=new_tokens, echo=click.echo))
        return code

    _run(go)


def _list_models(ctx: click.Context, _param: Any, value: bool) -> None:
    if not value or ctx.resilient_parsing:
        return
    from tierstore.trainer.model import presets_table

    click.echo(presets_table())
    ctx.exit()


@main.command()
@click.option("--store", "store", type=click.Path(file_okay=False),
              help="Store directory holding the experts (created if missing). With --resident: "
                   "the checkpoint directory (optional).")
@click.option("--connect", "connect", type=click.Path(dir_okay=False),
              help="Instead of --store: train over the store a `tierstore serve` daemon owns, "
                   "through its socket (the daemon's host cache and backing are used; "
                   "--host-cache, --backing, --pmem-* and --slab-size do not apply).")
@click.option("--resident", is_flag=True,
              help="Train the same model with everything in memory as plain torch modules "
                   "(the reference and the performance baseline).")
@click.option("--model",
              help="Model preset: tiny, small, medium, large, xl (see --list-models) [tiny].")
@click.option("--list-models", is_flag=True, is_eager=True, expose_value=False,
              callback=_list_models, help="Print the presets' sizes and exit.")
@click.option("--steps", type=click.IntRange(min=0), required=True,
              help="Total optimizer steps; --resume continues up to this count.")
@click.option("--seed", type=int, help="Initial weights and batch order [0].")
@click.option("--device", default="auto", show_default=True,
              help="Where dense parameters and compute live: cpu, cuda, cuda:N (auto: cuda if "
                   "available).")
@click.option("--device-budget", type=SIZE,
              help="Bytes of expert weights the device may hold at once: the prefetch queue's "
                   "budget (default: the store's, 1GiB on the CPU, half of a GPU); with "
                   "get_many fetching, unbounded unless given.")
@click.option("--host-cache", type=SIZE, default="1GiB", show_default=True,
              help="Host-memory cache in front of the backing tier (0: none).")
@click.option("--backing", type=click.Choice(["nvme", "pmem"]),
              help="Backing tier of a new store (default nvme); checked against an existing one.")
@click.option("--pmem-path", type=click.Path(dir_okay=False), help="Pool file for --backing pmem.")
@click.option("--pmem-size", type=SIZE, help="Pool size for --backing pmem, e.g. 16GiB.")
@click.option("--slab-size", type=SIZE, default="1GiB", show_default=True,
              help="NVMe slab file size of a new store.")
@click.option("--fetch", type=click.Choice(["auto", "queue", "direct"]), default="auto",
              show_default=True,
              help="How experts reach the device: the prefetch queue (next layer predicted from "
                   "routing history), get_many, or auto (queue on a GPU, get_many on the CPU).")
@click.option("--checkpoint-every", type=click.IntRange(min=0), default=0, show_default=True,
              help="Checkpoint every N steps (and always after the last).")
@click.option("--resume", is_flag=True,
              help="Continue from the latest checkpoint, with the model, hyperparameters and "
                   "seed the run started with (options given must agree with them).")
@click.option("--metrics", type=click.Path(dir_okay=False),
              help="Write one JSON object per step (step, loss, tokens_per_s, hit_rate, "
                   "stall_frac, ...).")
@click.option("--trace", type=click.Path(dir_okay=False),
              help="Record the routing trace (CSV step,layer,expert,nbytes: `tierstore bench "
                   "cache --trace`).")
@click.option("--corpus", multiple=True, type=click.Path(exists=True),
              help="Text files or directories to train on (repeatable; default: the Python "
                   "standard library's sources).")
@click.option("--batch-size", type=click.IntRange(min=1), help="Sequences per micro-batch [8].")
@click.option("--seq-len", type=click.IntRange(min=1), help="Tokens per sequence [128].")
@click.option("--lr", type=float, help="Peak learning rate [3e-3].")
@click.option("--grad-accum", type=click.IntRange(min=1), help="Micro-batches per step [1].")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16"]),
              help="Compute dtype (master weights and optimizer states stay fp32) [float32].")
@click.option("--eval-every", type=click.IntRange(min=0),
              help="Validation loss every N steps and at the last (0: never) [50].")
def train(store: str | None, connect: str | None, resident: bool, model: str | None, steps: int,
          seed: int | None,
          device: str,
          device_budget: int | None, host_cache: int, backing: str | None,
          pmem_path: str | None, pmem_size: int | None, slab_size: int, fetch: str,
          checkpoint_every: int, resume: bool, metrics: str | None, trace: str | None,
          corpus: tuple[str, ...], batch_size: int | None, seq_len: int | None,
          lr: float | None, grad_accum: int | None, dtype: str | None,
          eval_every: int | None) -> None:
    """Train an MoE model whose experts live in a store: dense parameters on the device,
    expert weights and AdamW moments in STORE, fetched per step for the experts the routers
    picked and written back through the host cache. With --resident, the same model held in
    memory.

    \b
    tierstore train --store run --model tiny --steps 200 --metrics m.jsonl
    tierstore train --store run --model tiny --steps 400 --resume
    tierstore train --resident --model tiny --steps 200
    """
    if connect is not None and (store is not None or resident):
        raise click.UsageError("--connect replaces --store and cannot go with --resident")
    if not resident and store is None and connect is None:
        raise click.UsageError("--store or --connect is required (or pass --resident)")
    if resident and trace is not None:
        raise click.UsageError("--trace records the store trainer's routing; drop --resident")
    if resident and store is None and (resume or checkpoint_every):
        raise click.UsageError("--resume and --checkpoint-every with --resident need --store")
    from tierstore.trainer.cli_train import run_train

    given = {"batch_size": batch_size, "seq_len": seq_len, "lr": lr, "grad_accum": grad_accum,
             "dtype": dtype, "eval_every": eval_every}

    def go() -> int:
        try:
            run_train(store=store, resident=resident, model=model, steps=steps, seed=seed,
                      device_budget=device_budget, host_cache=host_cache, backing=backing,
                      pmem_path=pmem_path, pmem_size=pmem_size, slab_size=slab_size,
                      checkpoint_every=checkpoint_every, resume=resume, metrics=metrics,
                      trace=trace, corpus=corpus, device=device, fetch=fetch,
                      overrides={k: v for k, v in given.items() if v is not None},
                      echo=click.echo, connect=connect)
        except ValueError as e:  # bad configuration or corpus: one line, like store errors
            click.echo(f"tierstore train: {e}", err=True)
            return 2
        return 0

    _run(go)


@main.command()
@click.option("--store", "store", type=click.Path(exists=True, file_okay=False),
              help="A store holding a model (`tierstore import-hf`, or a `tierstore train` run).")
@click.option("--connect", "connect", type=click.Path(dir_okay=False),
              help="Instead of --store: the socket of a `tierstore serve` daemon that owns the "
                   "store (its host cache is shared with the daemon's other clients).")
@click.option("--prompt", "prompts", multiple=True,
              help="A text prompt, encoded with the model's tokenizer (repeatable: one batch).")
@click.option("--prompt-ids", "prompt_ids", multiple=True, metavar="1,2,3",
              help="A prompt as comma-separated token ids (repeatable: one batch).")
@click.option("--max-new-tokens", type=click.IntRange(min=0), required=True,
              help="Tokens to generate per prompt at most (fewer once a prompt reaches an "
                   "end-of-sequence token).")
@click.option("--greedy", is_flag=True, help="Take the most likely token (default: sample).")
@click.option("--temperature", type=click.FloatRange(min=0, min_open=True), default=1.0,
              show_default=True, help="Sampling temperature.")
@click.option("--top-p", type=click.FloatRange(0, 1, min_open=True), default=1.0,
              show_default=True, help="Sample from the smallest set of tokens whose probability "
                                      "reaches this.")
@click.option("--seed", type=int, help="Sampling seed (the same seed gives the same tokens).")
@click.option("--device-budget", type=SIZE,
              help="Bytes of experts the device may hold (the prefetch queue's budget; default "
                   "1GiB on the CPU, half of a GPU).")
@click.option("--ring-slots", default="auto", show_default=True,
              help="Ring mode: K layers of experts on the device, or auto (from the budget and "
                   "the measured transfer and compute times).")
@click.option("--mode", type=click.Choice(["ring", "expert", "resident", "on-demand"]),
              default="ring", show_default=True,
              help="ring: K slots of whole layers refilled behind the compute; expert: routed "
                   "experts only, predicted one layer ahead, with a device expert cache; "
                   "resident: every expert loaded first; on-demand: routed experts read when "
                   "needed, nothing kept.")
@click.option("--device", default="auto", show_default=True,
              help="cpu, cuda, cuda:N (auto: cuda if available).")
@click.option("--host-cache", type=SIZE,
              help="Host-memory cache in front of the backing tier (default: the store's, 1GiB).")
@click.option("--threads", type=click.IntRange(min=1),
              help="CPU compute threads (default: torch's; on a CPU device, ring and expert "
                   "modes use one fewer, leaving a core to the prefetch queue's copy thread).")
@click.option("--trace", type=click.Path(dir_okay=False),
              help="Record the routing trace (CSV step,layer,expert,nbytes: `tierstore bench "
                   "cache --trace`).")
@click.option("--json", "as_json", is_flag=True,
              help='Print one line: {"tokens": [[...]] per prompt, "tokens_per_s", "stall_frac", '
                   '"hit_rate", "spec_accuracy"}.')
def generate(store: str | None, connect: str | None, prompts: tuple[str, ...],
             prompt_ids: tuple[str, ...],
             max_new_tokens: int, greedy: bool, temperature: float, top_p: float,
             seed: int | None, device_budget: int | None, ring_slots: str, mode: str,
             device: str, host_cache: int | None, threads: int | None, trace: str | None,
             as_json: bool) -> None:
    """Generate text from the model in STORE with its experts offloaded: a batch of prompts
    (left-padded), a KV cache, one token per step until max-new-tokens or every prompt's
    end-of-sequence token.

    \b
    tierstore generate --store mixtral --prompt "The store" --max-new-tokens 32 --greedy
    tierstore generate --store run --prompt-ids 1,2,3 --prompt-ids 4,5 --max-new-tokens 8 \\
        --mode expert --device-budget 2GiB --json
    """
    if bool(prompts) == bool(prompt_ids):
        raise click.UsageError("give prompts with --prompt or with --prompt-ids (one of them)")
    if (store is None) == (connect is None):
        raise click.UsageError("give the model's store with --store or a daemon's socket with "
                               "--connect (one of them)")
    from tierstore.trainer.generate import run_generate

    _run(lambda: run_generate(
        store=store, prompts=prompts, prompt_ids=prompt_ids, max_new_tokens=max_new_tokens,
        greedy=greedy, temperature=temperature, top_p=top_p, seed=seed,
        device_budget=device_budget, ring_slots=ring_slots, mode=mode, device=device,
        host_cache=host_cache, trace=trace, as_json=as_json, threads=threads,
        echo=click.echo, connect=connect))


@main.group()
def bench() -> None:
    """Benchmarks; each reports ratios against a ceiling measured in the same run."""


@bench.command(name="tiers")
@click.option("--store", "store", type=click.Path(file_okay=False),
              help="Scratch directory (default: a temporary directory in the current directory, "
                   "removed afterwards; put it on the drive you want to measure).")
@click.option("--quick", is_flag=True,
              help="4 and 64 MiB entries, 8 threads, O_DIRECT only, 256 MiB per figure: about "
                   "a minute.")
@click.option("--blocks", default="64KiB,1MiB,4MiB,16MiB,64MiB", show_default=True,
              help="Comma-separated entry sizes.")
@click.option("--threads", default="1,8", show_default=True,
              help="Comma-separated I/O thread counts (NVMe and PMem tiers).")
@click.option("--total", type=SIZE, default="1GiB", show_default=True,
              help="Bytes moved per measurement.")
@click.option("--tiers", "tiers", default="nvme,pmem,host,gpu", show_default=True,
              help="Comma-separated tiers: nvme, pmem, host (cache hits), gpu (if CUDA).")
@click.option("--engines", default="posix-direct,posix-buffered", show_default=True,
              help="NVMe I/O engines. Add kvikio where CUDA and kvikio are present (reads "
                   "into host memory with its threads and direct I/O set from the store's; "
                   "the store's `auto` never picks it, as it is unmeasured).")
@click.option("--pmem-dir", type=click.Path(file_okay=False),
              help="Directory for the PMem pool (a DAX mount such as /mnt/pmem0 in production; "
                   "default: the scratch directory).")
@click.option("--repeat", "repeats", default=3, show_default=True,
              help="NVMe: store and fio measured in turn this many times; medians reported.")
@click.option("--json", "json_out", type=click.Path(dir_okay=False), help="Write results here.")
@click.option("--plot", "plot_out", type=click.Path(dir_okay=False),
              help="Write a PNG: GB/s against entry size per tier, ceilings dashed.")
def bench_tiers(store: str | None, quick: bool, blocks: str, threads: str, total: int,
                tiers: str, engines: str, pmem_dir: str | None, repeats: int,
                json_out: str | None, plot_out: str | None) -> None:
    """Tier bandwidth (GB/s) and latency (p50/p99), each beside its ceiling from the same
    run: NVMe through the store's engines against fio on the same file with the same request
    size, threads and O_DIRECT flag; PMem against pmem_memcpy_persist and memcpy; host cache
    hits against memcpy; host<->device against plain pinned copies."""
    from tierstore.bench.tiers import run_tiers

    sizes = [parse_size(b) for b in blocks.split(",")]
    counts = [int(t) for t in threads.split(",")]
    engine_list = tuple(engines.split(","))
    if quick:
        sizes, counts, total, repeats = [4 << 20, 64 << 20], [8], min(total, 256 << 20), 1
        engine_list = tuple(e for e in engine_list if e != "posix-buffered")
    _run(lambda: run_tiers(store, sizes, counts, total, json_out, engines=engine_list,
                           tiers=tuple(tiers.split(",")), pmem_dir=pmem_dir,
                           plot_out=plot_out, repeats=repeats, echo=click.echo))


@bench.command(name="cache")
@click.option("--trace", "trace_file", type=click.Path(exists=True, dir_okay=False),
              help="A routing trace: CSV with header step,layer,expert[,nbytes].")
@click.option("--synthetic", metavar="SPEC",
              help="Generate a trace, e.g. 'zipf:a=1.1,layers=8,experts=64,steps=200,topk=2,"
                   "drift=0.05,burst=0.1,seed=0' (tokens=1 gives a decode-like trace).")
@click.option("--capacity", "capacities", default="0.1,0.25,0.5", show_default=True,
              help="Capacities: fractions of the trace's distinct bytes, or sizes (64MiB).")
@click.option("--policies", default="all", show_default=True,
              help="Comma-separated policies (lfu-decay, semoe, lru, lfu, arc, belady) or all.")
@click.option("--write-fraction", default=0.0, show_default=True,
              help="Share of accesses that update the entry (1.0 for training traces).")
@click.option("--policy-arg", "policy_args", multiple=True, metavar="POLICY:K=V,...",
              help="Policy parameters, e.g. lfu-decay:beta=0.5,period=512,theta=4.")
@click.option("--overhead", "overhead_entries", default=0, show_default=True,
              help="Also time each policy's per-access cost with this many resident entries.")
@click.option("--json", "json_out", type=click.Path(dir_okay=False), help="Write results here.")
@click.option("--plot", "plot_out", type=click.Path(dir_okay=False),
              help="Write a PNG of hit rate against capacity, every policy, belady on top.")
def bench_cache(trace_file: str | None, synthetic: str | None, capacities: str, policies: str,
                write_fraction: float, policy_args: tuple[str, ...], overhead_entries: int,
                json_out: str | None, plot_out: str | None) -> None:
    """Replay a routing trace against every eviction policy at each capacity, beside
    Belady's offline optimum on the same trace."""
    from tierstore.bench.cache_lab import parse_policy_args, run_cache_lab

    _run(lambda: run_cache_lab(
        trace_file=trace_file, synthetic=synthetic, capacities=capacities, policies=policies,
        write_fraction=write_fraction, policy_args=parse_policy_args(policy_args),
        json_out=json_out, plot_out=plot_out, overhead_entries=overhead_entries,
        echo=click.echo))


@bench.command(name="prefetch")
@click.option("--store", "store", type=click.Path(file_okay=False),
              help="Scratch directory (default: a temporary directory here, removed after).")
@click.option("--layers", default=8, show_default=True, help="MoE layers.")
@click.option("--experts", default=8, show_default=True, help="Experts per layer.")
@click.option("--expert-bytes", type=SIZE, default="4MiB", show_default=True,
              help="Size of one expert (a multiple of 4 x hidden).")
@click.option("--hidden", default=1024, show_default=True, help="Matmul width.")
@click.option("--tokens", default=256, show_default=True, help="Tokens per layer's matmuls.")
@click.option("--repeat", type=int, default=None,
              help="Matmul repeats per expert (default: calibrated so a layer computes for "
                   "about 1.5x its transfer time).")
@click.option("--steps", default=5, show_default=True, help="Measured steps per mode.")
@click.option("--device-budget", type=SIZE, default=None,
              help="Prefetch budget (default: three layers).")
@click.option("--host-cache", type=SIZE, default=None,
              help="Host cache (default: half a layer, so reads hit the backing tier).")
@click.option("--device", default=None, help="Compute device (default: cpu).")
@click.option("--json", "json_out", type=click.Path(dir_okay=False), help="Write results here.")
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
              help="A store holding a model (default: a synthetic Mixtral-shaped model written "
                   "to a temporary store here).")
@click.option("--model-dir", type=click.Path(exists=True, file_okay=False),
              help="A Hugging Face model directory, imported into a temporary store first.")
@click.option("--layers", default=8, show_default=True, help="Synthetic model: MoE layers.")
@click.option("--experts", default=8, show_default=True, help="Synthetic model: experts/layer.")
@click.option("--hidden", default=512, show_default=True, help="Synthetic model: width.")
@click.option("--ffn", default=1024, show_default=True, help="Synthetic model: expert width.")
@click.option("--prefill-batch", default=4, show_default=True, help="Prompts in the prefill run.")
@click.option("--prefill-len", default=128, show_default=True, help="Tokens per prefill prompt.")
@click.option("--decode-batch", default=1, show_default=True, help="Prompts in the decode run.")
@click.option("--decode-tokens", default=8, show_default=True, help="Tokens generated per prompt.")
@click.option("--ring-slots", default="2,4", show_default=True,
              help="Comma-separated ring sizes K to measure (besides auto).")
@click.option("--tier", type=click.Choice(["backing", "nvme", "host"]), default="backing",
              show_default=True,
              help="Where the experts come from: the store's backing tier with no host cache, "
                   "so every transfer reads it ('nvme' also checks that it is NVMe), or host "
                   "memory (a host cache holding every expert).")
@click.option("--host-cache", type=SIZE, help="Host cache size (overrides --tier).")
@click.option("--expert-budget", default=0.6, show_default=True,
              help="Expert mode's device budget as a fraction of all experts' bytes.")
@click.option("--repeats", type=click.IntRange(min=1), default=5, show_default=True,
              help="Rounds over every mode (interleaved); each mode reports its median.")
@click.option("--device", default=None, help="Compute device (default: cuda if available).")
@click.option("--json", "json_out", type=click.Path(dir_okay=False), help="Write results here.")
def bench_infer(store: str | None, model_dir: str | None, layers: int, experts: int, hidden: int,
                ffn: int, prefill_batch: int, prefill_len: int, decode_batch: int,
                decode_tokens: int, ring_slots: str, tier: str, host_cache: int | None,
                expert_budget: float, repeats: int, device: str | None,
                json_out: str | None) -> None:
    """Tokens/s of one model and one set of prompts with every expert source: fully
    resident, ring at several K and auto, expert mode, synchronous on-demand loading; ratios
    against resident, against on-demand, and for ring decoding against the limit set by the
    bytes moved per token over the tier bandwidth measured in the same run."""
    if store and model_dir:
        raise click.UsageError("--store and --model-dir exclude each other")
    try:
        ks = [int(k) for k in ring_slots.split(",") if k]
    except ValueError:
        raise click.UsageError(f"--ring-slots takes integers, got {ring_slots!r}") from None
    from tierstore.bench.infer import run_infer

    def go() -> None:
        run_infer(store, model_dir, json_out=json_out, layers=layers, experts=experts,
                  hidden=hidden, ffn=ffn, prefill_batch=prefill_batch, prefill_len=prefill_len,
                  decode_batch=decode_batch, decode_tokens=decode_tokens, ring_slots=ks,
                  host_cache=host_cache, expert_budget=expert_budget, device=device,
                  repeats=repeats, tier=tier, echo=click.echo)

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
@click.option("--host-cache", type=SIZE, default="2GiB", show_default=True,
              help="The store's host cache (the target applies when it holds a step's "
                   "working set).")
@click.option("--batch-size", type=click.IntRange(min=1), help="Sequences per step [8].")
@click.option("--seq-len", type=click.IntRange(min=1), help="Tokens per sequence [128].")
@click.option("--device", default="cpu", show_default=True, help="cpu, cuda or cuda:N.")
@click.option("--store", "store", type=click.Path(file_okay=False),
              help="Scratch directory (default: a temporary directory here, removed after).")
@click.option("--json", "json_out", type=click.Path(dir_okay=False), help="Write results here.")
def bench_train(model: str, steps: int, warmup: int, rounds: int, host_cache: int,
                batch_size: int | None, seq_len: int | None, device: str, store: str | None,
                json_out: str | None) -> None:
    """Step time of the store trainer against the resident trainer (same model, data and
    seed): median step times, their ratio (target <= 1.15), stall fraction, hit rate."""
    from tierstore.bench.train import run_train_bench

    given = {"batch_size": batch_size, "seq_len": seq_len}

    def go() -> int:
        try:
            run_train_bench(model=model, steps=steps, warmup=warmup, rounds=rounds,
                            host_cache=host_cache, store=store, device=device,
                            overrides={k: v for k, v in given.items() if v is not None},
                            json_out=json_out, echo=click.echo)
        except ValueError as e:
            click.echo(f"tierstore bench train: {e}", err=True)
            return 2
        return 0

    _run(go)


from .cli_daemon import bench_daemon, serve, status  # noqa: E402 (the daemon's commands)

main.add_command(serve)
main.add_command(status)
bench.add_command(bench_daemon)

if __name__ == "__main__":
    main()
