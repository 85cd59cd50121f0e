"""Which store holds each expert of an expert-parallel fine-tune, for ``export-hf``.

After ``tierstore train --distributed`` of an imported model each node's store holds the
trained states of the experts its ranks own, and the imported originals of the others.
A store says which it owns: each rank keeps its step counts of every MoE layer in an entry
``{prefix}.owned{lo}-{hi}`` of kind ``step`` (:func:`tierstore.trainer.train.layout.
owned_suffix`), for experts ``lo..hi``. The export reads every expert from the store that
owns it: the store exported (node 0's, whose dense weights every node shares) and the other
nodes' stores, named with ``--node-store`` wherever they are reachable from the machine
exporting (a shared path, or a copy of the store directory). A store that owns some experts
but not all, with the others' stores not named, is refused in one line rather than exported
with the imported originals in their place.

A trainable load by one process (``tierstore.hf.load(store, trainable=True)`` without a
process group) reads the store-wide counts and history. A node store that holds every
expert (its run had one node, or was scaled in to one) becomes that first
(:func:`merge_rank_entries`); one that holds some is refused in one line naming the others,
rather than having them made trainable again from their imported originals.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import torch
from tierstore.trainer.train.layout import owned_suffix

import tierstore

from .layout import StoredModel, stored_model
from .outdir import HFExportError

_OWNED = re.compile(r"\.owned(\d+)-(\d+)$")


def owned_ranges(store: tierstore.Store, prefix: str) -> list[range]:
    """The experts of one experts module whose trained states ``store`` holds, as ranges."""
    out = []
    for name in store.names(prefix + ".owned", kind="step"):
        m = _OWNED.search(name)
        if m and name == prefix + m.group(0):
            out.append(range(int(m.group(1)), int(m.group(2)) + 1))
    return out


def expert_owners(store: tierstore.Store, others: Sequence[tierstore.Store], sm: StoredModel
                  ) -> dict[tuple[str, int], tierstore.Store]:
    """``{(prefix, expert): the store to read it from}`` for every expert of ``sm``; empty
    where ``store`` is no node's store of an expert-parallel fine-tune (read it all there)."""
    stores = [store, *others]
    owners: dict[tuple[str, int], tierstore.Store] = {}
    mine = any(owned_ranges(store, m.prefix) for m in sm.experts)
    if not mine:
        if others:
            raise HFExportError(f"store {store.path} holds no expert-parallel fine-tune: "
                                "--node-store goes with one")
        return owners
    for st in others:
        if _identity(st) != _identity(store) or stored_model(st).hf_config != sm.hf_config:
            raise HFExportError(f"--node-store {st.path} is not a node store of the run in "
                                f"store {store.path}")
    for m in sm.experts:
        for st in stores:
            for ids in owned_ranges(st, m.prefix):
                for e in ids:
                    if (m.prefix, e) in owners and owners[(m.prefix, e)] is not st:
                        raise HFExportError(
                            f"expert {e} of {m.module} is trained in both {st.path} and "
                            f"{owners[(m.prefix, e)].path}: name each node's store once, from "
                            "the same run and checkpoint")
                    owners[(m.prefix, e)] = st
        lacking = [e for e in range(m.num_experts) if (m.prefix, e) not in owners]
        if lacking:
            raise HFExportError(
                f"store {store.path} is one node's store of an expert-parallel fine-tune: "
                f"experts {_ranges(lacking)} of {m.module} were trained in other nodes' "
                "stores; name each with --node-store PATH (a shared path, or a copy of it)")
    return owners


def _identity(store: tierstore.Store) -> bytes | None:
    """The training run's record (``tierstore train --distributed`` writes one in every node
    store; a loop of one's own, none)."""
    from tierstore.trainer.train.checkpoint import RUN_ENTRY

    return store.get(*RUN_ENTRY).numpy().tobytes() if RUN_ENTRY in store else None


def _ranges(ids: list[int]) -> str:
    spans: list[list[int]] = []
    for e in ids:
        if spans and spans[-1][1] == e - 1:
            spans[-1][1] = e
        else:
            spans.append([e, e])
    return ", ".join(f"{a}-{b}" if a != b else str(a) for a, b in spans)


# Written with the merged entries, deleted after the per-rank ones: while it exists the
# merged entries are the store's, and the per-rank ones left are deleted (a merge
# interrupted between its commits is finished, never redone from half-deleted entries).
MERGED = ("trainer.ranks_merged", "meta")


def merge_rank_entries(store: tierstore.Store, sm: StoredModel) -> bool:
    """Turn a node store of an expert-parallel fine-tune that holds every expert into a
    single process's: each rank's step counts of a layer into the layer's one entry, its
    dense-rule history (every expert first caught up with it, as ``export-hf`` does; each
    then at the same global step) into the store's one history; the per-rank entries are
    deleted. Past that catch-up the expert states are not touched. Returns whether there was
    anything to merge. A store that lacks some experts, or whose ranks' histories stop at
    different steps (not a checkpoint's state), raises :class:`tierstore.StoreError` with one
    line and is left as it was."""
    from tierstore.trainer.train.checkpoint import HISTORY, STEP_KIND
    from tierstore.trainer.train.dense_rule import StepHistory, catch_up_import

    rank_histories = [(name, kind) for name, kind in store.keys(HISTORY[0] + ".owned")
                      if kind == HISTORY[1]]
    ranges = {m.prefix: owned_ranges(store, m.prefix) for m in sm.experts}
    if MERGED not in store:
        if not any(ranges.values()):
            return False
        _check_whole(store, sm, ranges)
        catch_up_import(store, sm.experts)
        steps = {h.step for key in rank_histories
                 if (h := StepHistory.read(store, key)) is not None}
        ranks = len(ranges[sm.experts[0].prefix])
        if len(steps) > 1 or (steps and len(rank_histories) != ranks):
            raise tierstore.StoreError(
                f"store {store.path} holds an expert-parallel fine-tune whose {ranks} ranks' "
                f"dense-rule histories ({len(rank_histories)} of them) do not end at one "
                f"step ({', '.join(map(str, sorted(steps)))}), as no checkpoint leaves them: "
                "resume it with `tierstore train --distributed --resume` first")
        items: list[tuple[str, str, Any]] = []
        for m in sm.experts:
            counts = torch.zeros(m.num_experts, dtype=torch.int64)
            for ids in ranges[m.prefix]:
                own = store.get(m.prefix + owned_suffix(ids), STEP_KIND)
                counts[ids.start:ids.stop] = own[ids.start:ids.stop]
            items.append((m.prefix, STEP_KIND, counts))
        if steps:
            items.append((*HISTORY, torch.tensor([[float(steps.pop()), 0.0, 0.0, 0.0, 0.0]],
                                                 dtype=torch.float64)))
        store.put_many([*items, (*MERGED, torch.zeros(1, dtype=torch.uint8))])
        store.flush()  # durable before any delete commits
    for m in sm.experts:
        for ids in ranges[m.prefix]:
            store.delete(m.prefix + owned_suffix(ids), STEP_KIND, missing_ok=True)
    for name, kind in rank_histories:
        store.delete(name, kind, missing_ok=True)
    store.delete(*MERGED)
    store.flush()
    return True


def _check_whole(store: tierstore.Store, sm: StoredModel, ranges: dict[str, list[range]]
                 ) -> None:
    for m in sm.experts:
        held = sorted(e for ids in ranges[m.prefix] for e in ids)
        lacking = [e for e in range(m.num_experts) if e not in held]
        if lacking or len(held) != len(set(held)):
            why = (f"experts {_ranges(lacking)} of {m.module} were trained in other nodes' "
                   "stores" if lacking else f"its ranks' step counts of {m.module} overlap")
            raise tierstore.StoreError(
                f"store {store.path} is one node's store of an expert-parallel fine-tune: "
                f"{why}, which a load without a process group cannot reach; continue it with "
                "process_group= on its world, or `tierstore train --distributed --resume` "
                "on one node naming the others' stores with --node-store, or export it with "
                "`tierstore export-hf --node-store`")
