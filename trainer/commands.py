"""The bundled applications' commands: ``train``, ``generate``, ``import-hf`` and ``demo``.

They reach the ``tierstore`` command line through the ``tierstore.commands`` entry-point group
(pyproject.toml), so the core never imports the applications. Only click is imported here;
each command imports what it runs when it runs, so ``tierstore --help`` stays quick."""

from __future__ import annotations

from typing import Any

import click

from tierstore.cli_options import (
    CACHE_SIZE,
    DEVICE,
    OUTPUT_FILE,
    POSITIVE_SIZE,
    SIZE,
    FiniteFloat,
    new_store_options,
)
from tierstore.cli_options import run_command as _run

DEFAULT_DEMO_STORE = "demo-store"


class ShareOrSize(click.ParamType):
    """``auto``; a fraction in [0, 1] written with its point (``0.5``); or bytes or a size
    (``256MiB``, ``0``)."""

    name = "auto|fraction|size"

    def convert(self, value: Any, param: Any, ctx: Any) -> str | int:
        text = str(value).strip()
        if text == "auto":
            return text
        if "." in text and text.replace(".", "", 1).isdigit():
            if float(text) > 1:
                self.fail(f"{value!r}: a fraction is at most 1.0 (or give a size: 256MiB)",
                          param, ctx)
            return text
        return SIZE.convert(value, param, ctx)


def _preset(ctx: click.Context, _param: Any, value: str | None) -> str | None:
    # Checked while parsing: demo reaches its training part only after the tier
    # walk-through, and an unknown name there is a ValueError (a traceback).
    if value is None or ctx.resilient_parsing:
        return value
    from tierstore.trainer.presets import PRESETS

    if value not in PRESETS:
        raise click.BadParameter(f"unknown model preset {value!r}; "
                                 f"choose from {', '.join(PRESETS)}")
    return value


@click.command(name="import-hf")
@click.argument("model_dir", type=click.Path())
@click.option("--store", "store", required=True, type=click.Path(file_okay=False),
              help="Store to import into (created if missing; must not hold a model yet).")
@click.option("--resume", is_flag=True,
              help="Continue an interrupted import of the same checkpoint into STORE: experts "
                   "and tensors already stored as the checkpoint has them are kept.")
@click.option("--list", "list_", is_flag=True, is_eager=True, expose_value=False,
              callback=lambda ctx, _p, v: _list_families(ctx, v),
              help="List the families the installed transformers serves through the backend "
                   "and exit.")
@click.option("--expert-format", "expert_format", type=click.Choice(["fp8", "mxfp4"]),
              default=None,
              help="Store the experts of a bf16/fp32 checkpoint quantized: fp8 in 128x128 "
                   "blocks of e4m3, as DeepSeek ships them (half the bytes of bf16), or mxfp4, "
                   "as gpt-oss ships them (about a quarter); lossy, see docs/inference.md. "
                   "Default: as the checkpoint has them.")
def import_hf_(model_dir: str, store: str, resume: bool, expert_format: str | None) -> None:
    """Import the Hugging Face MoE model in MODEL_DIR (config.json, single or sharded
    safetensors, tokenizer files) for `tierstore generate` and `tierstore.hf.load`: each
    expert's slice of each fused expert parameter becomes one entry
    ({module}.{expert}.{param}), mapped with transformers' own conversion mapping; the dense
    weights, config, generation config and tokenizer are kept beside them. Any family whose
    experts transformers computes through its experts interface is served; `tierstore
    import-hf --list` names those of the installed transformers. Experts shipped in MXFP4
    (gpt-oss) or 128x128 block FP8 (DeepSeek-V3) stay packed, dequantized only after each
    fetch; other quantization methods are refused.

    \b
    tierstore import-hf ./DeepSeek-V3-tiny --store dsv3
    tierstore import-hf ./DeepSeek-V3-tiny --store dsv3 --resume   # after an interruption
    """
    from tierstore.hf import import_hf

    def go() -> None:
        info = import_hf(model_dir, store, progress=True, resume=resume,
                         expert_format=expert_format)
        experts = info["experts"]
        n = experts[0]["num_experts"] if experts else 0
        packed = f" ({info['quant']}, kept packed)" if info.get("quant") else ""
        click.echo(f"imported {info['family']}: {len(experts)}x{n} experts{packed}, "
                   f"{len(info['dense'])} dense tensors, "
                   f"tokenizer {'yes' if 'tokenizer.json' in info['tokenizer'] else 'no'}"
                   f" -> {store}")

    _run(go)


def _list_families(ctx: click.Context, value: bool) -> None:
    if not value or ctx.resilient_parsing:
        return
    from tierstore.hf.families import causal_lm_families

    fams = causal_lm_families()
    click.echo(f"{len(fams)} causal-LM families whose experts transformers dispatches through "
               "its experts interface:")
    click.echo(" ".join(fams))
    ctx.exit(0)


@click.command(name="export-hf")
@click.argument("out_dir", type=click.Path(file_okay=False))
@click.option("--store", "store", required=True, type=click.Path(file_okay=False),
              help="Store holding the model (`tierstore import-hf`, or a `tierstore train` run).")
@click.option("--dtype", type=click.Choice(["bf16", "fp16", "fp32"]),
              help="dtype of the written weights (default: the checkpoint's own; fp32 for a "
                   "trainer run, whose weights are fp32 masters).")
@click.option("--shard-size", type=POSITIVE_SIZE, default="5GB", show_default=True,
              help="Most bytes per safetensors shard (a larger tensor gets a shard of its own).")
@click.option("--force", is_flag=True,
              help="Write into a non-empty OUT_DIR, replacing the weight files in it.")
@click.option("--node-store", "node_stores", multiple=True, type=click.Path(file_okay=False),
              help="After `tierstore train --distributed` (STORE: node 0's store): another "
                   "node's store, as reachable here (a shared path, or a copy of its store "
                   "directory; repeatable). Each expert is read from the store that trained "
                   "it; a node's store alone is refused.")
@click.option("--logit-error/--no-logit-error", default=True, show_default=True,
              help="For a fine-tuned quantized checkpoint packed again in its own format: "
                   "also state the round trip's logit error on fixed token ids (loads the "
                   "export in fp32 on the CPU; skipped by itself beyond half the memory).")
def export_hf(out_dir: str, store: str, dtype: str | None, shard_size: int, force: bool,
              node_stores: tuple[str, ...], logit_error: bool) -> None:
    """Write the model in STORE to OUT_DIR as a Hugging Face checkpoint that
    transformers' AutoModelForCausalLM.from_pretrained loads: config.json, sharded
    safetensors with model.safetensors.index.json, generation config and tokenizer files.
    The weights are in the family's own checkpoint layout, the one save_pretrained writes,
    made with transformers' reverse conversion mapping one expert at a time; an imported
    model keeps its original config (dtype set to --dtype); a `tierstore train` run becomes
    Mixtral (every layer MoE) or Qwen2-MoE (dense layers in between) with a byte-level
    tokenizer. Leftovers of killed exports to OUT_DIR are removed first.

    \b
    tierstore export-hf ./mixtral-tuned --store mixtral
    tierstore export-hf ./run-hf --store run --dtype bf16 --shard-size 2GB
    """
    from tierstore.hf.exporter import export_hf as export

    from tierstore import format_size

    def go() -> None:
        s = export(store, out_dir, dtype=dtype, shard_size=shard_size, force=force,
                   progress=True, node_stores=node_stores, logit_error=logit_error)
        for path in s["removed"]:
            click.echo(f"removed {path}, left by an export that was killed")
        click.echo(f"exported {s['source']} as {s['family']}: {s['tensors']} tensors in "
                   f"{s['shards']} shard{'s' if s['shards'] != 1 else ''}, {s['dtype']}, "
                   f"{format_size(s['bytes'])} -> {out_dir}")
        rt = s.get("requantized")
        if rt:  # a fine-tuned quantized checkpoint, packed again in its own format
            click.echo(f"re-quantized the fine-tuned fp32 masters: largest weight error "
                       f"{rt['max_abs_weight_error']:.3g} against a largest master of "
                       f"{rt['max_abs_master']:.3g} ({rt['relative']:.2%})")
            if "skipped" in rt:
                click.echo(f"  logit error not measured: {rt['skipped']}")
            else:
                click.echo(f"  logit error on {rt['positions']} fixed positions: max "
                           f"{rt['max_abs_logit_error']:.3g}, mean {rt['mean_abs_logit_error']:.3g}"
                           f" (largest logit {rt['max_abs_logit']:.3g}); greedy choice kept at "
                           f"{rt['greedy_same']} of {rt['positions']}")

    _run(go)




@click.command()
@click.option("--store", "store", default=DEFAULT_DEMO_STORE, show_default=True,
              type=click.Path(file_okay=False),
              help="Store directory for the tier walk-through (created if missing); the "
                   "training run uses STORE-model next to it.")
@click.option("--layers", default=8, show_default=True, type=click.IntRange(min=1),
              help="MoE layers (tier walk-through).")
@click.option("--experts", default=16, show_default=True, type=click.IntRange(min=1),
              help="Experts per layer.")
@click.option("--hidden", default=512, show_default=True, type=click.IntRange(min=1),
              help="Model width.")
@click.option("--ffn", default=1024, show_default=True, type=click.IntRange(min=1),
              help="Expert hidden width.")
@click.option("--seed", default=0, show_default=True)
@click.option("--fresh", is_flag=True, help="Delete the demo store first.")
@click.option("--model", default="small", show_default=True, callback=_preset,
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
    from tierstore.demo import run_demo

    def go() -> int:
        code = run_demo(store, layers=layers, experts=experts, hidden=hidden, ffn=ffn,
                        seed=seed, fresh=fresh, echo=click.echo)
        if train_steps:
            from tierstore.trainer.train.demo import run_demo_training

            code = max(code, run_demo_training(
                store.rstrip("/") + "-model", model=model, steps=train_steps, seed=seed,
                new_tokens=new_tokens, echo=click.echo))
        return code

    _run(go)


def _list_models(ctx: click.Context, _param: Any, value: bool) -> None:
    if not value or ctx.resilient_parsing:
        return
    from tierstore.trainer.presets import presets_table

    click.echo(presets_table())
    ctx.exit()


@click.command()
@click.option("--store", "store", type=click.Path(file_okay=False),
              help="Store directory holding the experts (created if missing). A store filled "
                   "by `tierstore import-hf` is fine-tuned: its model is the one trained. With "
                   "--resident: the checkpoint directory (optional).")
@click.option("--connect", "connect", type=click.Path(dir_okay=False),
              help="Instead of --store: train over the store a `tierstore serve` daemon owns, "
                   "through its socket (the daemon's host cache and backing are used; "
                   "--host-cache, --backing, --pmem-* and --slab-size do not apply, and "
                   "under --distributed are checked against that daemon's).")
@click.option("--resident", is_flag=True,
              help="Train the same model with everything in memory as plain torch modules "
                   "(the reference and the performance baseline).")
@click.option("--model", callback=_preset,
              help="Model preset: tiny, small, medium, large, xl (see --list-models) [tiny; "
                   "none for an imported model].")
@click.option("--list-models", is_flag=True, is_eager=True, expose_value=False,
              callback=_list_models, help="Print the presets' sizes and exit.")
@click.option("--steps", type=click.IntRange(min=0), required=True,
              help="Total optimizer steps; --resume continues up to this count.")
@click.option("--seed", type=int, help="Initial weights and batch order [0].")
@click.option("--device", type=DEVICE, default="auto", show_default=True,
              help="Where dense parameters and compute live: cpu, cuda, cuda:N (auto: cuda if "
                   "available).")
@click.option("--device-budget", type=SIZE,
              help="Memory for a step's working set on the device (host memory on a CPU): "
                   "activations, one layer's AdamW moments, and the expert weights the step "
                   "touches with their gradients; too small is an error naming what it needs. "
                   "Peak RSS stays within the dense states + --host-cache + this + a fixed "
                   "overhead (docs/trainer.md). Default: unbounded on the CPU, the store's "
                   "share of a GPU.")
@click.option("--host-cache", type=CACHE_SIZE, default="1GiB", show_default=True,
              help="Host-memory cache in front of the backing tier (0: none).")
@new_store_options
@click.option("--fetch", type=click.Choice(["auto", "queue", "direct"]), default="auto",
              show_default=True,
              help="How experts reach the device: the prefetch queue (next layer predicted from "
                   "routing history), get_many, or auto (queue on a GPU, get_many on the CPU).")
@click.option("--update-rule", type=click.Choice(["dense", "lazy"]),
              help="How experts no token reached in a step are updated: dense, as "
                   "torch.optim.AdamW updates transformers' fused expert parameters (zero "
                   "gradient: moments decay, weights still move; missed steps are applied "
                   "when an expert is next fetched and at every checkpoint), or lazy (not at "
                   "all). [dense for an imported model, lazy for a preset; a resumed run "
                   "keeps its own]")
@click.option("--checkpoint-every", type=click.IntRange(min=0), default=0, show_default=True,
              help="Checkpoint every N steps (and always after the last).")
@click.option("--resume", is_flag=True,
              help="Continue from the latest checkpoint, with the model, hyperparameters and "
                   "seed the run started with (options given must agree with them).")
@click.option("--metrics", type=OUTPUT_FILE,
              help="Write one JSON object per step (step, loss, tokens_per_s, hit_rate, "
                   "stall_frac, ...).")
@click.option("--trace", type=OUTPUT_FILE,
              help="Record the routing trace (CSV step,layer,expert,nbytes: `tierstore bench "
                   "cache --trace`).")
@click.option("--corpus", multiple=True, type=click.Path(exists=True),
              help="Text files or directories to train on (repeatable; default: the Python "
                   "standard library's sources). Bytes for a preset; for an imported model, "
                   "text encoded by its tokenizer, each file followed by end-of-sequence.")
@click.option("--corpus-max-bytes", type=SIZE,
              help="Read at most this much of the corpus (0: all of it) [8MiB].")
@click.option("--batch-size", type=click.IntRange(min=1), help="Sequences per micro-batch [8].")
@click.option("--seq-len", type=click.IntRange(min=1), help="Tokens per sequence [128].")
@click.option("--lr", type=FiniteFloat(min=0),
              help="Peak learning rate [3e-3; fine-tunes want far less].")
@click.option("--grad-accum", type=click.IntRange(min=1), help="Micro-batches per step [1].")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16"]),
              help="Compute dtype (master weights and optimizer states stay fp32) [float32].")
@click.option("--eval-every", type=click.IntRange(min=0),
              help="Validation loss every N steps and at the last (0: never) [50].")
@click.option("--distributed", is_flag=True,
              help="Train with expert parallelism across the ranks torchrun started (torchrun "
                   "--nproc-per-node R -m tierstore train --distributed ...): --store is this "
                   "node's store, served to the node's ranks by one daemon that local rank 0 "
                   "starts with --host-cache and the store options; --batch-size is per "
                   "rank; --device-budget and --fetch queue do not apply. See the README's "
                   "'Training on several machines'.")
@click.option("--paradigm", type=click.Choice(["auto", "token", "data"]), default="auto",
              show_default=True,
              help="--distributed: send tokens to the experts' owners (token), pull experts to "
                   "the tokens (data, Janus), or choose per MoE block by Janus's ratio (auto).")
@click.option("--failure-timeout", type=FiniteFloat(min=1.0), metavar="SECONDS",
              help="--distributed: a rank, or its host, silent this long counts as gone, and "
                   "every rank ends naming it (a rank or daemon that dies is seen at once) "
                   "[60].")
@click.option("--pipeline",
              help="--distributed, an imported model's token-centric blocks: split each into "
                   "N chunks, one chunk's all-to-all in flight while another computes (MPMoE; "
                   "bit-identical to 1), or auto: per block, by MPMoE's model of the times its "
                   "first call measures [auto].")
@click.option("--credits", type=click.IntRange(min=1),
              help="--distributed, data-centric blocks: the most pulled experts a rank holds at "
                   "once; a block that would need more sends tokens instead [no bound].")
@click.option("--hierarchical-a2a", "hierarchical", is_flag=True,
              help="--distributed, token-centric blocks: all-to-all in two stages, inside each "
                   "node first, then between ranks of equal local rank (SE-MoE; the same "
                   "numbers, one message per node pair between nodes).")
@click.option("--run-dir", type=click.Path(file_okay=False),
              help="--distributed: this node's run directory (daemon socket and log, checkpoint "
                   "manifests) [STORE.run].")
@click.option("--node-store", "node_stores", multiple=True, type=click.Path(file_okay=False),
              help="--distributed --resume of an imported model's fine-tune on fewer nodes "
                   "than its checkpoint's: the store of a node that leaves, as reachable from "
                   "this node (a shared path, or a copy of its store directory; repeatable; "
                   "any remaining node may name it). Its experts' states move into the "
                   "remaining nodes' stores before training goes on.")
def train(store: str | None, connect: str | None, resident: bool, model: str | None, steps: int,
          seed: int | None,
          device: str,
          device_budget: int | None, host_cache: int, backing: str | None,
          pmem_path: str | None, pmem_size: int | None, slab_size: int, fetch: str,
          update_rule: str | None, checkpoint_every: int, resume: bool, metrics: str | None,
          trace: str | None, corpus: tuple[str, ...], corpus_max_bytes: int | None,
          batch_size: int | None,
          seq_len: int | None, lr: float | None, grad_accum: int | None, dtype: str | None,
          eval_every: int | None, distributed: bool, paradigm: str, credits: int | None,
          hierarchical: bool, run_dir: str | None, pipeline: str | None,
          failure_timeout: float | None, node_stores: tuple[str, ...]) -> None:
    """Train an MoE model whose experts live in a store: dense parameters on the device,
    expert weights and AdamW moments in STORE, fetched per step for the experts the routers
    picked and written back through the host cache. With --resident, the same model held in
    memory. A STORE filled by `tierstore import-hf` (any family `tierstore import-hf
    --list` names) is fine-tuned in full as its own transformers model: its experts become
    fp32 masters in the store and the loss is transformers' own.

    \b
    tierstore train --store run --model tiny --steps 200 --metrics m.jsonl
    tierstore train --store run --model tiny --steps 400 --resume
    tierstore train --resident --model tiny --steps 200
    tierstore train --store mixtral --steps 100 --corpus notes/ --lr 1e-5 --host-cache 4GiB
    torchrun --nproc-per-node 2 -m tierstore train --distributed --store node --steps 100
    """
    # As `tierstore init` has it: an option of the other backing is a mistake, never ignored.
    if (pmem_path is not None or pmem_size is not None) and backing != "pmem":
        raise click.UsageError("--pmem-path and --pmem-size go with --backing pmem")
    if backing == "pmem" and _given(click.get_current_context().get_parameter_source,
                                    "slab_size", slab_size) is not None:
        raise click.UsageError("--slab-size goes with NVMe stores, not --backing pmem")
    if distributed:
        if resident or trace is not None:
            raise click.UsageError("--distributed trains over the node stores: drop "
                                   "--resident and --trace")
        if store is None:
            raise click.UsageError("--distributed needs --store (this node's store; with "
                                   "--connect, the store that daemon serves)")
        if device_budget is not None or fetch == "queue":
            # The distributed trainer reads a step's experts with get_many (--fetch direct)
            # and sizes nothing by a budget: refused rather than ignored.
            raise click.UsageError("--device-budget and --fetch queue do not apply to "
                                   "--distributed, which reads the experts each step needs "
                                   "with get_many (--fetch direct) and has no step budget")
    elif (paradigm != "auto" or credits is not None or run_dir is not None or hierarchical
          or pipeline is not None or failure_timeout is not None or node_stores):
        raise click.UsageError("--paradigm, --credits, --hierarchical-a2a, --pipeline, "
                               "--failure-timeout, --node-store and --run-dir go with "
                               "--distributed")
    if update_rule is not None and resident:
        raise click.UsageError("--update-rule is the store trainer's: drop it with "
                               "--resident")
    if connect is not None and not distributed and (store is not None or resident):
        raise click.UsageError("--connect replaces --store and cannot go with --resident")
    if not resident and store is None and connect is None:
        raise click.UsageError("--store or --connect is required (or pass --resident)")
    if resident and trace is not None:
        raise click.UsageError("--trace records the store trainer's routing; drop --resident")
    if resident and store is None and (resume or checkpoint_every):
        raise click.UsageError("--resume and --checkpoint-every with --resident need --store")
    from tierstore.trainer.train.cli_train import run_train

    given = {"batch_size": batch_size, "seq_len": seq_len, "lr": lr, "grad_accum": grad_accum,
             "dtype": dtype, "eval_every": eval_every, "update_rule": update_rule}
    overrides = {k: v for k, v in given.items() if v is not None}
    if corpus_max_bytes is not None:
        overrides["corpus_max_bytes"] = corpus_max_bytes or None

    def go() -> int:
        try:
            if distributed:
                from tierstore.trainer.dist.cli import run_distributed

                given = click.get_current_context().get_parameter_source
                run_distributed(store=store, connect=connect, run_dir=run_dir, model=model,
                                steps=steps, seed=seed,
                                daemon={"host_cache": _given(given, "host_cache", host_cache),
                                        "backing": backing, "pmem_path": pmem_path,
                                        "pmem_size": pmem_size,
                                        "slab_size": _given(given, "slab_size", slab_size)},
                                paradigm=paradigm, credits=credits, pipeline=pipeline,
                                hierarchical=hierarchical, failure_timeout=failure_timeout,
                                checkpoint_every=checkpoint_every, resume=resume,
                                metrics=metrics, corpus=corpus, overrides=overrides,
                                device=device, echo=click.echo, node_stores=node_stores)
                return 0
            run_train(store=store, resident=resident, model=model, steps=steps, seed=seed,
                      device_budget=device_budget, host_cache=host_cache, backing=backing,
                      pmem_path=pmem_path, pmem_size=pmem_size, slab_size=slab_size,
                      checkpoint_every=checkpoint_every, resume=resume, metrics=metrics,
                      trace=trace, corpus=corpus, device=device, fetch=fetch,
                      overrides=overrides, echo=click.echo, connect=connect)
        except ValueError as e:  # bad configuration or corpus: one line, like store errors
            click.echo(f"tierstore train: {e}", err=True)
            return 2
        return 0

    _run(go)


def _given(source: Any, name: str, value: Any) -> Any:
    """``value`` where the option was given, None where it is its default."""
    return None if source(name) == click.core.ParameterSource.DEFAULT else value


@click.command()
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
@click.option("--temperature", type=FiniteFloat(min=0, min_open=True), default=1.0,
              show_default=True, help="Sampling temperature.")
@click.option("--top-p", type=FiniteFloat(0, 1, min_open=True), default=1.0,
              show_default=True, help="Sample from the smallest set of tokens whose probability "
                                      "reaches this.")
@click.option("--seed", type=int, help="Sampling seed (the same seed gives the same tokens).")
@click.option("--device-budget", type=SIZE,
              help="Memory for the device side (host memory on a CPU): the KV cache, the "
                   "activations and the experts the mode holds; too small is an error naming "
                   "what it needs. Peak RSS stays within the dense weights + --host-cache + "
                   "this + a fixed overhead (docs/inference.md). Default 1GiB on the CPU, half "
                   "of a GPU.")
@click.option("--ring-slots", default="auto", show_default=True,
              help="Ring mode: K layers of experts on the device, or auto (from the budget and "
                   "the measured transfer and compute times).")
@click.option("--mode", type=click.Choice(["auto", "ring", "expert", "resident", "on-demand"]),
              default="auto", show_default=True,
              help="auto: resident where the budget holds every expert, else expert (it says "
                   "which and why); ring: K slots of whole layers refilled behind the compute; "
                   "expert: routed experts only, predicted one layer ahead, with a device "
                   "expert cache; resident: every expert loaded first; on-demand: routed "
                   "experts read when needed, nothing kept.")
@click.option("--device", type=DEVICE, default="auto", show_default=True,
              help="cpu, cuda, cuda:N (auto: cuda if available).")
@click.option("--host-cache", type=CACHE_SIZE,
              help="Host-memory cache in front of the backing tier (default: the store's, 1GiB).")
@click.option("--dequantized-cache", type=ShareOrSize(), default="auto", show_default=True,
              help="Quantized experts: how much of the experts' share of --device-budget, "
                   "beyond what the mode needs at the least, keeps the hottest experts "
                   "dequantized, so a hit is neither read nor dequantized again: a fraction "
                   "(0.5), a size (256MiB) or 0; auto: on a CPU, where the dequantization "
                   "costs far more than the read, what is left once the packed experts held "
                   "make up half of them all, and none where that would not hold one "
                   "token's routed experts; none on a GPU (auto gives the ring none). It "
                   "comes out of the budget, never on top of it (docs/inference.md).")
@click.option("--threads", type=click.IntRange(min=1),
              help="CPU compute threads (default: torch's; on a CPU device, ring and expert "
                   "modes use one fewer while they stream experts from the backing tier, "
                   "leaving a core to their read threads: every pass where the host cache "
                   "cannot hold every expert, else the prefill only. Expert mode with the "
                   "host cache pooled reads on the calling thread and uses every core).")
@click.option("--trace", type=OUTPUT_FILE,
              help="Record the routing trace (CSV step,layer,expert,nbytes: `tierstore bench "
                   "cache --trace`).")
@click.option("--warm-up/--no-warm-up", default=True, show_default=True,
              help="Before the clock starts, run the prompts once through the model with "
                   "zero experts (no store reads), so the first pass does not page in the code "
                   "of every operation it runs from a disk busy with experts; counted in "
                   "prepare_s.")
@click.option("--json", "as_json", is_flag=True,
              help='Print one line: {"tokens": [[...]] per prompt, "tokens_per_s", "stall_frac", '
                   '"hit_rate", "spec_accuracy", "prefill_s", "decode_s", "prepare_s", '
                   '"bytes_read", "peak_rss_bytes", "mode"}.')
def generate(store: str | None, connect: str | None, prompts: tuple[str, ...],
             prompt_ids: tuple[str, ...],
             max_new_tokens: int, greedy: bool, temperature: float, top_p: float,
             seed: int | None, device_budget: int | None, ring_slots: str, mode: str,
             device: str, host_cache: int | None, dequantized_cache: str | int,
             threads: int | None, trace: str | None, warm_up: bool, as_json: bool) -> None:
    """Generate text from the model in STORE with its experts offloaded, through the
    family's own transformers model and its generate: a batch of prompts (left-padded), a
    KV cache, one token per step until max-new-tokens or every prompt's end-of-sequence
    token.

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
    from tierstore.trainer.infer.generate import run_generate

    _run(lambda: run_generate(
        store=store, prompts=prompts, prompt_ids=prompt_ids, max_new_tokens=max_new_tokens,
        greedy=greedy, temperature=temperature, top_p=top_p, seed=seed,
        device_budget=device_budget, ring_slots=ring_slots, mode=mode, device=device,
        host_cache=host_cache, trace=trace, as_json=as_json, threads=threads,
        echo=click.echo, connect=connect, warm=warm_up, dequantized_cache=dequantized_cache))
