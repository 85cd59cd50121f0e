"""``tierstore export-hf``: a stored model as a directory ``transformers`` loads.

:func:`export_hf` writes ``config.json`` (the stored one, its ``dtype`` set to the
export's), ``generation_config.json`` and the tokenizer files where the store holds them,
and the weights as sharded safetensors with ``model.safetensors.index.json``, in the layout
``save_pretrained`` writes for the family: the model's state dict (less what
``save_pretrained`` leaves out: ``_keys_to_ignore_on_save`` and tied weights, by
``transformers``' own ``remove_tied_weights_from_state_dict``) through ``transformers``'
reverse conversion mapping (:mod:`tierstore.hf.reverse`), so ``from_pretrained`` loads it
through the forward mapping it came from. A model imported from any layout is written in
that one; ``import-hf`` of the export gives the same entries.

* An import (format 2, :mod:`tierstore.hf.layout`): its expert entries and ``dense.``
  entries, the values a fine-tune leaves there.
* An expert-parallel fine-tune of an import (``tierstore train --distributed``): node 0's
  store with the other nodes' stores named (``node_stores``), each expert read from the
  store that trained it (:mod:`tierstore.hf.node_stores`).
* A ``tierstore train`` run, read as the ``transformers`` model that computes what it does
  (:mod:`tierstore.hf.trainer_runs`: Mixtral, or Qwen2-MoE with a shared expert of zeros):
  its experts' live entries, the dense state of its latest checkpoint, and a byte-level
  tokenizer (token id = byte value). A run interrupted after its latest checkpoint may hold
  experts some steps ahead of its dense weights: export a finished run, or restore its
  latest checkpoint first.

Every float tensor is written in one dtype: the one asked for, else the stored model's (the
checkpoint's for an import; fp32 for a run, whose weights are fp32 masters). Each shard's
header is written first and each tensor at its offset as it is made (:mod:`tierstore.hf.shards`):
an experts module's parameters are read and converted one expert at a time (its own tensors,
or its slice of a fused checkpoint tensor), a dense parameter whole, so the export's memory
is a few entries, at worst one fused parameter of one layer, never the model.

The files are written into a locked hidden directory beside ``OUT`` and moved into place at
the end (:mod:`tierstore.hf.outdir`), so nothing partial is ever under ``OUT``; a later
export removes what a killed one left.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from typing import Any

import torch
from torch import Tensor, nn

import tierstore
from tierstore.durable import replace_file

from . import quant_logits
from .config import FLOAT_DTYPES as DTYPES
from .config import hf_config, meta_model
from .convert import expert_params
from .families import UnservedFamilyError, check_served
from .layout import ExpertsModule, StoredModel, stored_model
from .node_stores import expert_owners
from .outdir import HFExportError, WorkDir, check_out_dir, remove_leftovers
from .quant import Dequantizer, as_module_holds
from .quant_export import PackedValues, expand
from .quant_train import RoundTrip
from .reverse import Group, ReverseError, ReversePlan, reverse_plan, run
from .shards import INDEX_FILE, Shards
from .tokenizer import byte_tokenizer_files, tokenizer_files

DEFAULT_SHARD_SIZE = "5GB"  # the Hub's advice per file
EXPORT_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
GENERATION_CONFIG = "generation_config.json"

Progress = Callable[[int], Any]

__all__ = ["DEFAULT_SHARD_SIZE", "EXPORT_DTYPES", "HFExportError", "export_hf", "plan_export"]


def export_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    """``bf16``/``fp16``/``fp32`` (or a torch float dtype, or its name) as a torch dtype."""
    if dtype is None:
        return None
    if isinstance(dtype, torch.dtype):
        if dtype not in EXPORT_DTYPES.values():
            raise HFExportError(f"cannot export in {dtype}; use bf16, fp16 or fp32")
        return dtype
    name = str(dtype).removeprefix("torch.")
    got = EXPORT_DTYPES.get(name) or DTYPES.get(name)
    if got is None:
        raise HFExportError(f"cannot export in {dtype!r}; use bf16, fp16 or fp32")
    return got


def dtype_name(dt: torch.dtype) -> str:
    return str(dt).removeprefix("torch.")


class _Values:
    """The model's state-dict tensors out of the store: dense ones by name, fused expert
    parameters by expert (cast: floats to the export's dtype, the rest to the model's)."""

    def __init__(self, store: tierstore.Store, sm: StoredModel, model: nn.Module,
                 modules: dict[str, nn.Module], dt: torch.dtype,
                 owners: dict[tuple[str, int], tierstore.Store] | None = None) -> None:
        self.store, self.sm, self.dt = store, sm, dt
        self.owners = owners or {}  # an expert-parallel fine-tune's: (prefix, e) -> store
        self.want = {k: (tuple(v.shape), v.dtype) for k, v in model.state_dict().items()}
        # fused parameter -> (its experts module as stored, its entry parts, output dim)
        self.experts: dict[str, tuple[ExpertsModule, list[str], int]] = {}
        # Parameters quantized at import (--expert-format), exported dequantized: the
        # checkpoint had no quantization_config to write them back in.
        self.formats: dict[str, str] = {}
        self.dequantizer = Dequantizer()
        self.round_trip = RoundTrip()  # a fine-tuned quantized model's, packed again
        for m in sm.experts:
            out_dim = -1 if getattr(modules.get(m.module), "is_transposed", False) else 0
            for attr, parts in m.params:
                name = f"{m.module}.{attr}" if m.module else attr
                self.experts[name] = (m, parts, out_dim)
                if sm.quantized_at_import and attr in m.formats:
                    self.formats[name] = m.formats[attr]

    def check(self, names: list[str]) -> None:
        """Every name the export writes has a value in the store's model."""
        dense = set(self.sm.dense_state or {}) | set(self.sm.dense) | set(self.sm.zeros)
        lacking = [n for n in names if n not in self.experts and n not in dense]
        if lacking:
            more = f" and {len(lacking) - 1} more" if len(lacking) > 1 else ""
            raise HFExportError(f"store {self.store.path}: its {self.sm.family} model lacks "
                                f"{lacking[0]}{more}; import the checkpoint again")

    def _cast(self, name: str, t: Tensor, shape: tuple[int, ...]) -> Tensor:
        if tuple(t.shape) != shape:
            raise HFExportError(f"store {self.store.path}: {name} is {list(t.shape)}, the "
                                f"{self.sm.family} config implies {list(shape)}")
        return t.to(self.dt if t.is_floating_point() else self.want[name][1])

    def dense(self, name: str) -> Tensor:
        shape = self.want[name][0]
        if self.sm.dense_state is not None and name in self.sm.dense_state:
            t = self.sm.dense_state[name]
        elif name in self.sm.zeros:
            t = torch.zeros(self.sm.zeros[name])
        else:
            t = self._get([self.sm.dense[name]])[self.sm.dense[name]]
        return self._cast(name, t, shape)

    def expert(self, names: list[str], e: int) -> dict[str, Tensor]:
        """Expert ``e``'s slice ``[1, ...]`` of each fused parameter in ``names``, read
        together."""
        entries = {n: [f"{self.experts[n][0].prefix}.{e}.{p}" for p in self.experts[n][1]]
                   for n in names}
        got: dict[str, Tensor] = {}
        for n, xs in entries.items():
            got.update(self._get(xs, self.owners.get((self.experts[n][0].prefix, e))))
        out = {}
        for n, xs in entries.items():
            parts = [got[x] for x in xs]
            fmt = self.formats.get(n)
            if fmt is not None:  # quantized at import: the values it computes with
                w = self.dequantizer(fmt, parts[0], parts[1], torch.float32, reuse=False)
                parts = [as_module_holds(w, fmt, self.experts[n][2] == -1)]
            t = parts[0] if len(parts) == 1 else torch.cat(parts, dim=self.experts[n][2])
            out[n] = self._cast(n, t, self.want[n][0][1:]).unsqueeze(0)
        return out

    def value(self, name: str) -> Tensor:
        """A dense tensor, or a fused expert parameter over every expert (a whole layer's)."""
        if name not in self.experts:
            return self.dense(name)
        n = self.experts[name][0].num_experts
        return torch.cat([self.expert([name], e)[name] for e in range(n)])

    def _get(self, names: list[str], store: tierstore.Store | None = None
             ) -> dict[str, Tensor]:
        store = store or self.store
        try:
            return store.get_many(names)
        except tierstore.EntryNotFoundError:
            lacking = next(n for n in names if n not in store)
            raise HFExportError(f"store {store.path}: the model's entry {lacking} is "
                                "missing; the import or training run did not finish") from None


def saved_names(model: nn.Module) -> list[str]:
    """The state-dict names ``save_pretrained`` writes (before its reverse mapping)."""
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    state = model.state_dict()
    for key in getattr(model, "_keys_to_ignore_on_save", None) or ():
        state.pop(key, None)
    return list(remove_tied_weights_from_state_dict(state, model))


def config_json(sm: StoredModel, dt: torch.dtype) -> dict[str, Any]:
    hf = dict(sm.hf_config)
    if "torch_dtype" in hf:
        hf["torch_dtype"] = dtype_name(dt)
    if "dtype" in hf or "torch_dtype" not in hf:
        hf["dtype"] = dtype_name(dt)
    return hf


def side_files(store: tierstore.Store, sm: StoredModel) -> dict[str, bytes]:
    """The files beside the weights: tokenizer files and ``generation_config.json``."""
    if sm.step is not None:  # a trainer run: its vocabulary is the byte values
        vocab = int(sm.hf_config.get("vocab_size", 0))
        return byte_tokenizer_files(int(sm.hf_config["max_position_embeddings"])) \
            if vocab >= 256 else {}
    files = {os.path.basename(k): v for k, v in tokenizer_files(store).items()}
    if sm.generation_config and GENERATION_CONFIG not in files:
        files[GENERATION_CONFIG] = json.dumps(sm.generation_config, indent=2,
                                              sort_keys=True).encode() + b"\n"
    return files


def _plan(store: tierstore.Store, sm: StoredModel, dt: torch.dtype,
          owners: dict[tuple[str, int], tierstore.Store] | None = None
          ) -> tuple[ReversePlan, _Values]:
    where = f"store {store.path}"
    config = hf_config(sm.hf_config, where)
    model = meta_model(config, sm.family)
    try:
        modules = dict(check_served(model, sm.family))
    except UnservedFamilyError as e:
        raise HFExportError(str(e)) from e
    if sorted(modules) != sorted(m.module for m in sm.experts):
        raise HFExportError(f"{where}: the stored experts ({len(sm.experts)} modules) do not "
                            f"match the {sm.family} model's ({len(modules)}); import the "
                            "checkpoint again")
    values = _Values(store, sm, model, modules, dt, owners)
    params = expert_params(model, modules.items())
    stray = sorted(set(params) - set(values.experts))
    if stray:
        raise HFExportError(f"{where}: the store holds no entries for {stray[0]}; import the "
                            "checkpoint again")
    names = saved_names(model)
    values.check(names)
    try:
        plan = reverse_plan(model, names, params)
    except ReverseError as e:
        raise HFExportError(f"{sm.family}: {e}") from e
    if sm.quant is not None and not sm.quantized_at_import:  # packed, as shipped
        expand(plan, values, store)
    return plan, values


def plan_export(store: tierstore.Store) -> ReversePlan:
    """How the store's model is written: the groups of state-dict names, each converted one
    expert at a time (``experts`` set) or whole, and what each writes."""
    sm = stored_model(store)
    return _plan(store, sm, DTYPES.get(sm.dtype) or torch.float32)[0]


def _write_group(group: Group, plan: ReversePlan, values: _Values, shards: Shards,
                 advance: Progress) -> None:
    """One group's outputs into the shards: one expert at a time where the group allows
    it, else whole."""
    if group.part is not None:
        values = PackedValues(values, group.part)  # type: ignore[assignment]
    if not group.experts:
        for name, t in run(group, plan, {n: values.value(n) for n in group.source_names()}
                           ).items():
            advance(shards.write(group.renamed.get(name, name), t))
        return
    slices = {o.name: o.experts for o in group.outputs}
    for e in range(group.experts):
        got = run(group, plan, values.expert(group.source_names(), e), one_expert=True,
                  rename=False)
        for raw, t in got.items():
            name = group.expert_names[e][raw]
            fused = slices[name]
            advance(shards.write(name, t, part=e if fused else 0, parts=fused or 1))


def export_hf(store_path: str | os.PathLike[str], out_dir: str | os.PathLike[str], *,
              dtype: str | torch.dtype | None = None, shard_size: int | str = DEFAULT_SHARD_SIZE,
              force: bool = False, progress: bool | Progress = True,
              node_stores: Sequence[str | os.PathLike[str]] = (),
              logit_error: bool = True) -> dict[str, Any]:
    """Export the model in the store at ``store_path`` to ``out_dir`` (see the module
    docstring) and return a summary: ``family`` (the architecture written), ``source``
    (``tierstore`` for a trainer run, else the family), ``dtype``, ``files``, ``shards``,
    ``tensors``, ``bytes`` and ``removed`` (leftovers of killed exports removed).

    ``dtype``: ``"bf16"``, ``"fp16"``, ``"fp32"`` or a torch float dtype (default: the
    stored model's). ``shard_size``: the most bytes per shard (a larger tensor gets a shard
    of its own). ``force``: write into a non-empty ``out_dir``, replacing its weight files.
    ``progress``: ``True`` for a tqdm bar over the bytes written, or a callable that
    receives byte counts. ``node_stores``: after an expert-parallel fine-tune
    (``tierstore train --distributed``), the other nodes' stores, as reachable here (a
    shared path, or a copy of the store directory): each expert is read from the store that
    trained it (:mod:`tierstore.hf.node_stores`). ``logit_error``: for a fine-tuned quantized
    checkpoint, packed again, also measure the logit error of the round trip
    (:mod:`tierstore.hf.quant_logits`; ``requantized`` in the summary and in the index's
    metadata holds both errors)."""
    store_path, out_dir = os.fspath(store_path), os.fspath(out_dir)
    asked = export_dtype(dtype)
    limit = tierstore.parse_size(shard_size)
    if limit <= 0:
        raise HFExportError(f"shard size must be above 0, got {shard_size!r}")
    if not os.path.isdir(store_path):
        raise HFExportError(f"{store_path}: no such store")
    check_out_dir(out_dir, force)
    with tierstore.open(store_path, host_cache=0) as store, ExitStack() as others:
        sm = stored_model(store)  # a StoreError naming the ways to get a model if none
        from tierstore.trainer.dist.hf_reshard import open_node_store

        owners = expert_owners(store, [others.enter_context(open_node_store(p))
                                       for p in node_stores], sm)
        # A fine-tune under the dense update rule: experts behind its last step take the
        # updates they missed first (what save() and every checkpoint also do), in every
        # store read, each expert from the history of the rank that trained it.
        from tierstore.trainer.train.dense_rule import catch_up_import

        for st in {id(s): s for s in [store, *owners.values()]}.values():
            catch_up_import(st, sm.experts)
        dt = asked or DTYPES.get(sm.dtype) or torch.float32
        plan, values = _plan(store, sm, dt, owners)
        outputs = list(plan.outputs())
        tensors = [(o.name, o.shape,
                    dt if o.dtype.is_floating_point and not o.packed else o.dtype)
                   for o in outputs]
        side = side_files(store, sm)
        removed = remove_leftovers(out_dir)
        bar: Any = None
        with WorkDir(out_dir) as work:
            shards = Shards(work.path, tensors, limit)
            if progress is True:
                from tqdm import tqdm

                bar = tqdm(total=shards.total, desc="export-hf", unit="B", unit_scale=True,
                           unit_divisor=1024, disable=None, dynamic_ncols=True)
                advance: Progress = bar.update
            elif callable(progress):
                advance = progress
            else:
                def advance(n: int) -> None:
                    return None
            try:
                shards.create()
                for group in plan.groups:
                    _write_group(group, plan, values, shards, advance)
                index = shards.finish()
            except (ValueError, RuntimeError) as e:  # a conversion's, or a size that is off
                raise HFExportError(f"{sm.family}: the export failed: {e}") from e
            finally:
                shards.close()
                if bar is not None:
                    bar.close()
            replace_file(os.path.join(work.path, INDEX_FILE), json.dumps(index, indent=2).encode())
            for fname, data in sorted(side.items()):
                replace_file(os.path.join(work.path, fname), data)
            replace_file(os.path.join(work.path, "config.json"),
                       json.dumps(config_json(sm, dt), indent=2, sort_keys=True).encode() + b"\n")
            requantized = None
            if sm.requantize:
                requantized = values.round_trip.to_json()
                requantized.update(quant_logits.logit_error(work.path, values) if logit_error
                                   else {"skipped": "not asked for (--no-logit-error)"})
                index["metadata"]["tierstore_requantized"] = requantized
                replace_file(os.path.join(work.path, INDEX_FILE),
                             json.dumps(index, indent=2).encode())
            files = sorted(os.listdir(work.path))
            work.move_into_place(force)
    return {"family": sm.family, "source": "tierstore" if sm.step is not None else sm.family,
            "dtype": dtype_name(dt), "files": files, "shards": len(shards.files),
            "tensors": len(outputs), "bytes": shards.total, "removed": removed,
            "requantized": requantized}
