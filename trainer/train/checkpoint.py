"""The store trainer's on-store format: every entry name, kind and snapshot tag it uses, and
the reading and writing of run records and checkpoints. Nothing else builds these names.

Layout
- every expert entry the model's :class:`~.layout.ExpertLayout` names (a preset's
  ``layers.{l}.experts.{e}.{w1,w2,w3}``, :func:`trainer.model.expert_name`), kinds ``param``
  and :data:`MOMENTS` (``exp_avg``, ``exp_avg_sq``): every expert weight's fp32 master copy
  and its two AdamW moments.
- each MoE layer's prefix (a preset's ``layers.{l}.experts``, :func:`step_counts_name`),
  kind :data:`STEP_KIND`: the layer's per-expert AdamW step counts, one int64
  ``[n_experts]`` entry.
- :data:`HISTORY` (``trainer.dense_rule``, kind ``steps``), under the dense update rule
  only: the global step and the hyperparameters of each step since the last checkpoint,
  float64 (:mod:`trainer.train.dense_rule`); an expert's step count is then the global step
  its states are caught up to. An expert-parallel rank's is ``trainer.dense_rule.owned{lo}-{hi}``
  beside its own step counts (``{prefix}.owned{lo}-{hi}``).
- :data:`RUN_ENTRY` (``trainer.run``, kind ``meta``): the model and training configs and the
  seed, as JSON.
- :data:`DENSE_ENTRY` (``trainer.dense``, kind ``checkpoint``): the dense part of the latest
  checkpoint, ``torch.save`` bytes.
- snapshots ``step-{n}`` (:func:`checkpoint_tag`): the checkpoints.

Fine-tuning an imported model
A store that ``tierstore import-hf`` filled keeps the import's layout (``model.json``,
``dense.{name}``, ``{module}.{e}.{param}``, ``tokenizer.{file}``: :mod:`tierstore.hf.layout`),
and a fine-tune (:mod:`trainer.train.hf_finetune`; its run record's ``model_config`` is
``{"finetune": family, "hf_config": config.json}``) makes its entries the trained model's:

- every expert entry (``model.layers.3.mlp.experts.5.gate_up_proj``, kind ``param``)
  becomes its expert's fp32 master weight when the run starts (:func:`initialise_imported`:
  bf16 or fp16 imports are cast up, exactly), with ``exp_avg``/``exp_avg_sq`` beside it and
  the layer's step counts under the experts module's name (kind ``step``); every step
  updates them in place, as in a run of a preset.
- ``dense.{name}`` kind ``param``, the model's own parameter names, hold the dense weights
  as fp32 masters, rewritten at every checkpoint right before its snapshot. The dense
  entry (:data:`DENSE_ENTRY`) then holds the optimizer state, sampler and RNG states but no
  weights (``"dense": "entries"`` in it says so).
- ``model.json`` and the tokenizer are left as imported: the config's ``dtype`` is still
  the checkpoint's (what inference computes in and an export writes by default).
- Before the first step the run takes checkpoint ``step-0``, the imported weights as fp32
  masters, so that resuming a run that never reached a checkpoint of its own starts over
  from the imported weights, not from experts a lost step already updated.

So the trained model is always: every expert and ``dense.*`` entry of kind ``param`` (fp32;
the ``exp_avg``/``exp_avg_sq`` and ``step`` kinds beside them are optimizer state). A run
that finished leaves the live entries equal to its last checkpoint (the last step always
takes one). After an interruption the live expert entries may be some steps ahead of the
live dense ones (those of the latest checkpoint); restoring that checkpoint's snapshot
(``tierstore restore STORE step-{n}``) or resuming the run to its end makes them one model
again.

Checkpoints
A checkpoint is one store snapshot, ``step-{n}``. The dense part (model and optimizer state,
sampler position, RNG states, configs) is serialised into :data:`DENSE_ENTRY` right before
the snapshot is taken, so the snapshot's single catalog transaction records it together with
every expert entry: there is no moment at which a checkpoint exists whose dense and expert
parts come from different steps. A crash before that transaction commits leaves the previous
checkpoints as they were (the live entries may hold newer, partly flushed versions; resuming
restores the snapshot over them); a crash after it leaves a complete new checkpoint. The
latest :data:`KEEP_CHECKPOINTS` snapshots are kept; older ones are dropped after each new one
commits (a crash in between only leaves an extra snapshot, dropped by the next checkpoint).
Resuming restores the latest snapshot and loads the dense state from it.

Reusing a store
The first run writes :data:`RUN_ENTRY` and initialises every expert (a preset's from
:func:`trainer.model.init_expert`, an import's from its imported weights). A store that already holds a run is only used again to
resume it, with the same configs and seed; otherwise :class:`TrainerError` says so and
nothing is touched. Resuming a run that never reached a checkpoint starts it over from the
initial weights.
"""

from __future__ import annotations

import io
import json
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

import tierstore
from tierstore import StoreError

from ..model import init_expert
from ..presets import MoEConfig
from .data import BatchSampler
from .layout import ExpertLayout
from .resident import Metrics, TrainConfig, rng_state, set_rng_state

if TYPE_CHECKING:
    from .nets import TrainNet

MOMENTS = ("exp_avg", "exp_avg_sq")
STEP_KIND = "step"
# The dense update rule's global step and per-step hyperparameters (trainer.train.dense_rule).
HISTORY = ("trainer.dense_rule", "steps")
RUN_ENTRY = ("trainer.run", "meta")
DENSE_ENTRY = ("trainer.dense", "checkpoint")
CHECKPOINT_VERSION = 1
KEEP_CHECKPOINTS = 2
STEP_SERIES = "step"  # `tierstore train`'s checkpoints: step-{n}

PathLike = str | os.PathLike[str]


class TrainerError(StoreError):
    """The store cannot be trained on as asked (it holds another run, the device budget
    cannot hold a step's experts, ...). A :class:`tierstore.StoreError`, so the CLI reports
    it as one line."""


def step_counts_name(layer: int) -> str:
    """The store name of MoE layer ``layer``'s per-expert AdamW step counts."""
    return f"layers.{layer}.experts"


def checkpoint_tag(step: int, series: str = STEP_SERIES) -> str:
    return f"{series}-{step}"


def checkpoint_steps(store: tierstore.Store, series: str = STEP_SERIES) -> list[int]:
    """Steps of the checkpoints (``step-{n}`` snapshots, or those of another ``series``:
    ``loop-{n}``, a user's loop's) the store holds, ascending."""
    tag = re.compile(rf"^{re.escape(series)}-(\d+)$")
    found = (tag.match(s.tag) for s in store.snapshots())
    return sorted(int(m.group(1)) for m in found if m)


def commit_checkpoint(store: tierstore.Store, step: int, entry: tuple[str, str],
                      payload: dict[str, Any], series: str = STEP_SERIES,
                      keep: int = KEEP_CHECKPOINTS) -> str:
    """The commit of every checkpoint: ``payload`` (``torch.save`` bytes) into ``entry``,
    then the snapshot ``{series}-{step}``, whose single catalog transaction records it with
    every other entry (whatever the caller put before), then the older snapshots of the
    series beyond the latest ``keep`` dropped. A crash before the snapshot commits leaves
    the previous checkpoints current; after it, this one. Returns the tag."""
    tag = checkpoint_tag(step, series)
    store.put(entry[0], pack(payload), kind=entry[1])
    if step in checkpoint_steps(store, series):
        # Training only moves past the checkpoint it resumed from, so this is a snapshot
        # someone named by hand, or one a run resumed from an earlier checkpoint has gone
        # past again: the checkpoint of this step replaces it.
        store.drop_snapshot(tag)
    store.snapshot(tag)
    for old in checkpoint_steps(store, series)[:-keep]:
        store.drop_snapshot(checkpoint_tag(old, series))
    return tag


def restore_checkpoint(store: tierstore.Store, entry: tuple[str, str],
                       series: str = STEP_SERIES, step: int | None = None
                       ) -> dict[str, Any] | None:
    """Make the store's live entries its latest checkpoint of ``series`` (or that of
    ``step``) and return that checkpoint's payload (what :func:`commit_checkpoint` put in
    ``entry``); ``None`` when the store holds no such checkpoint, and then nothing is
    changed."""
    steps = checkpoint_steps(store, series)
    if step is None:
        step = steps[-1] if steps else None
    if step is None or step not in steps:
        return None
    tag = checkpoint_tag(step, series)
    store.restore(tag)
    raw = _read_entry(store, entry)
    if raw is None:
        raise TrainerError(f"store {store.path}: checkpoint {tag} has no {entry[0]} entry")
    payload = unpack(raw)
    if payload.get("step") != step:
        raise TrainerError(f"store {store.path}: checkpoint {tag} holds the state of step "
                           f"{payload.get('step')}")
    return payload


# --------------------------------------------------------------------------- serialisation


def pack(obj: Any) -> Tensor:
    """``torch.save`` bytes as a uint8 tensor, so a Python object can be a store entry."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)


def unpack(t: Tensor) -> Any:
    """The object :func:`pack` stored."""
    # The payload holds numpy and python RNG states besides tensors.
    return torch.load(io.BytesIO(t.numpy().tobytes()), map_location="cpu", weights_only=False)


def _json_entry(obj: Any) -> Tensor:
    return torch.frombuffer(bytearray(json.dumps(obj, sort_keys=True).encode()), dtype=torch.uint8)


def _read_entry(store: tierstore.Store, entry: tuple[str, str]) -> Tensor | None:
    try:
        return store.get(*entry)
    except tierstore.EntryNotFoundError:
        return None


# --------------------------------------------------------------------------- the run record


def is_finetune(record: dict[str, Any]) -> bool:
    """Whether a run record's ``model_config`` is a fine-tune of an imported model (not a
    preset's shape)."""
    return "finetune" in record


def _run_identity(record: dict[str, Any], tc: TrainConfig, seed: int) -> dict[str, Any]:
    return {"version": CHECKPOINT_VERSION, "model_config": record,
            "train_config": tc.to_dict(), "seed": seed}


def _differences(saved: dict[str, Any], mine: dict[str, Any]) -> list[str]:
    return [f"{k}={saved.get(k)!r} (now {mine.get(k)!r})"
            for k in sorted(set(saved) | set(mine)) if saved.get(k) != mine.get(k)]


def _as_json(obj: Any) -> Any:
    return json.loads(json.dumps(obj))


def _check_identity(saved: dict[str, Any], record: dict[str, Any], tc: TrainConfig, seed: int,
                    where: str) -> None:
    """Refuse to continue a run with another model, configs or seed than it started with."""
    if saved.get("version") != CHECKPOINT_VERSION:
        raise TrainerError(f"{where} holds a training run of format {saved.get('version')!r}, "
                           f"this trainer writes {CHECKPOINT_VERSION}")
    if _as_json(saved["model_config"]) != _as_json(record):
        if is_finetune(saved["model_config"]) != is_finetune(record):
            raise TrainerError(f"{where} holds a run of a different model")
        diff = _differences(saved["model_config"], record)
        raise TrainerError(f"{where} holds a run of a different model: {', '.join(diff)[:300]}")
    saved_tc = _as_json(saved["train_config"])
    saved_tc.setdefault("update_rule", "lazy")  # runs recorded before there were two
    mine_tc = _as_json(tc.to_dict())
    if saved_tc != mine_tc:
        diff = _differences(saved_tc, mine_tc)
        raise TrainerError(f"{where} holds a run with different training hyperparameters: "
                           f"{', '.join(diff)}")
    if saved["seed"] != seed:
        raise TrainerError(f"{where} holds a run with seed {saved['seed']}, not {seed}")


def saved_run(store_path: PathLike | tierstore.Store) -> dict[str, Any] | None:
    """The model config, training config and seed (``model_config``, ``train_config``,
    ``seed``) of the run the store at ``store_path`` (or the open store given) holds;
    ``None`` if there is no store or no run in it."""
    if not isinstance(store_path, str | os.PathLike):
        raw = _read_entry(store_path, RUN_ENTRY)
    else:
        try:
            store = tierstore.open(store_path, host_cache=0)
        except tierstore.NotAStoreError:
            return None
        with store:
            raw = _read_entry(store, RUN_ENTRY)
    return None if raw is None else json.loads(raw.numpy().tobytes())


def initialise_experts(store: tierstore.Store, layout: ExpertLayout, cfg: MoEConfig,
                       seed: int) -> None:
    """Write every expert's initial weights (:func:`trainer.model.init_expert`), zero
    moments and zero step counts."""

    def states(layer: int, e: int) -> list[tuple[str, str, Tensor]]:
        items: list[tuple[str, str, Tensor]] = []
        for name, t in zip(layout.names(layer, e), init_expert(cfg, seed, layer, e)):
            zero = torch.zeros_like(t)
            items += [(name, "param", t), (name, MOMENTS[0], zero), (name, MOMENTS[1], zero)]
        return items

    _write_expert_states(store, layout, states)


def initialise_imported(store: tierstore.Store, layout: ExpertLayout,
                        experts: Sequence[int] | None = None) -> None:
    """Make an imported model's experts trainable: each weight as an fp32 master (cast up
    from the imported dtype; left alone when it is fp32 already), zero moments and zero
    step counts, and no dense-rule history. Done again after an interruption it changes
    nothing it had done (the cast is exact), so an interrupted start is simply started
    again. ``experts``: only these of every layer (a rank of an expert-parallel run makes
    its own trainable); all by default."""
    # (the layout's own history: an expert-parallel rank's is named like its counts)
    store.delete(HISTORY[0] + layout.counts_suffix, HISTORY[1], missing_ok=True)

    def states(layer: int, e: int) -> list[tuple[str, str, Tensor]]:
        names = layout.names(layer, e)
        got = store.get_many(list(names))
        items: list[tuple[str, str, Tensor]] = []
        for name in names:
            t = got[name]
            if t.dtype != torch.float32:
                items.append((name, "param", t.to(torch.float32)))
            zero = torch.zeros(t.shape, dtype=torch.float32)
            items += [(name, MOMENTS[0], zero), (name, MOMENTS[1], zero)]
        return items

    _write_expert_states(store, layout, states, experts)


def _write_expert_states(store: tierstore.Store, layout: ExpertLayout,
                         states: Callable[[int, int], list[tuple[str, str, Tensor]]],
                         experts: Sequence[int] | None = None) -> None:
    """Put ``states(layer, expert)`` for every expert, then zero step counts per layer.

    Writes are flushed whenever about half the host cache has been filled, so that making
    room evicts clean entries instead of writing dirty ones back one commit at a time.
    """
    cache = store.stats()["cache"]
    flush_every = cache["capacity_bytes"] // 2 if cache else 0
    pending = 0
    for layer in layout.keys:
        for e in range(layout.n_experts) if experts is None else experts:
            items = states(layer, e)
            store.put_many(items)
            pending += sum(t.numel() * t.element_size() for _, _, t in items)
            if flush_every and pending >= flush_every:
                store.flush()
                pending = 0
        store.put(layout.counts_name(layer), torch.zeros(layout.n_experts, dtype=torch.int64),
                  kind=STEP_KIND)
    store.flush()


# --------------------------------------------------------------------------- checkpoints


def start_run(store: tierstore.Store, net: TrainNet, tc: TrainConfig, seed: int,
              resume: bool, opt: torch.optim.Optimizer,
              sampler: BatchSampler) -> tuple[int, Metrics | None]:
    """Bring the store, ``net``, ``opt``, ``sampler`` and the RNGs to the state training
    starts from: the latest checkpoint when resuming a run that has one, else the initial
    weights (written to the store here; for a fine-tune, the imported ones, made trainable
    and checkpointed as ``step-0``). Returns the first step to run and, when resuming, the
    checkpoint step's own metrics."""
    where = f"store {store.path}"
    raw = _read_entry(store, RUN_ENTRY)
    saved = None if raw is None else json.loads(raw.numpy().tobytes())
    if saved is None:
        if checkpoint_steps(store) or (not net.finetune and store.names("layers.")):
            raise TrainerError(f"{where} holds expert entries or checkpoints that no training "
                               "run of this trainer wrote; train in a new store")
    else:
        if not resume:
            ckpts = checkpoint_steps(store)
            last = f"its latest checkpoint is step {ckpts[-1]}" if ckpts else "no checkpoint yet"
            raise TrainerError(f"{where} already holds a training run ({last}); pass --resume "
                               "to continue it, or train in a new store")
        _check_identity(saved, net.record, tc, seed, where)
        payload = restore_checkpoint(store, DENSE_ENTRY)
        if payload is not None:
            net.load_dense(store, payload)
            opt.load_state_dict(payload["optimizer"])
            sampler.load_state_dict(payload["sampler"])
            set_rng_state(payload["rng"])
            step = int(payload["step"])
            return step, (payload.get("metrics") if step else None)
    # A new run, or one that crashed before its first checkpoint: start from scratch. The
    # run record goes first, so an interrupted initialisation is recognised as this run.
    store.put(RUN_ENTRY[0], _json_entry(_run_identity(net.record, tc, seed)), kind=RUN_ENTRY[1])
    net.initialise(store, seed)
    if net.finetune:
        write_checkpoint(store, 0, seed=seed, net=net, tc=tc, opt=opt, sampler=sampler,
                         metrics={"step": 0})
    return 0, None


def write_checkpoint(store: tierstore.Store, step: int, *, seed: int, net: TrainNet,
                     tc: TrainConfig, opt: torch.optim.Optimizer, sampler: BatchSampler,
                     metrics: Metrics) -> str:
    """Checkpoint the run after ``step`` steps: the dense entry (and for a fine-tune the
    ``dense.`` weights), then the snapshot that makes the checkpoint (see the module
    docstring), then drop what is no longer among the latest :data:`KEEP_CHECKPOINTS`.
    ``metrics`` are the step's own, kept with the checkpoint; the snapshot's tag is added
    to them as ``checkpoint`` first (if the snapshot never commits, neither does that
    claim) and returned."""
    tag = checkpoint_tag(step)
    metrics["checkpoint"] = tag
    payload = {
        "version": CHECKPOINT_VERSION, "kind": "store", "step": step, "seed": seed,
        "model_config": net.record, "train_config": asdict(tc),
        "optimizer": opt.state_dict(),
        "sampler": sampler.state_dict(), "rng": rng_state(), "metrics": dict(metrics),
        **net.dense_payload(store),
    }
    return commit_checkpoint(store, step, DENSE_ENTRY, payload)


def latest_dense_state(store: tierstore.Store) -> dict[str, Any] | None:
    """The dense state of the store's latest checkpoint (``step``, ``model_config``,
    ``model``, ...), for reading a trained model back; ``None`` if the store holds none.
    A fine-tune's has no ``model`` (``"dense": "entries"``: the weights are the ``dense.``
    entries).

    The live dense entry is the latest checkpoint's: it is written right before the
    snapshot, and training only moves forward from there.
    """
    if DENSE_ENTRY not in store:
        return None
    payload = unpack(store.get(*DENSE_ENTRY))
    steps = checkpoint_steps(store)
    if steps and payload.get("step") != steps[-1]:
        raise TrainerError(f"store {store.path}: dense state of step {payload.get('step')} "
                           f"but latest checkpoint is {steps[-1]}")
    return payload
