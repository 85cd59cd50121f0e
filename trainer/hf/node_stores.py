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
"""

from __future__ import annotations

import re
from collections.abc import Sequence

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
