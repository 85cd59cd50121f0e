"""Export to and import from zarr v3 and safetensors.

zarr layout: one group per state kind (``param``, ``exp_avg``, ...). Tensors named
``<prefix>.experts.<N>.<suffix>`` with one dtype and shape form a *family*: one array of shape
``[n_experts, *shape]`` chunked ``[1, *shape]``, so each expert is one chunk and can be read
alone. Its attributes name the pattern and the expert ids. Any other tensor is an array of
its own, whose attributes hold its name. Array names are the entry names with ``%``, ``/``
and ``\\`` percent-escaped (plus the few names zarr or the file system reserve), so every
entry is one array directly under its kind's group; the attributes, not the array names, say
which entries an array holds. Dtypes numpy lacks (bfloat16, the float8s, ...) are kept as raw
unsigned integers of the same width with a ``tierstore.dtype`` attribute, so they round-trip
bit for bit.

safetensors: a ``param`` is stored under its name and any other state kind as
``name#kind``, with ``%`` and ``#`` in names percent-escaped (``%25``, ``%23``) so that no two
entries share a key; the file's metadata says so (``tierstore.names``), and files without it
(older exports, other tools) are read with their keys as they are. Dtypes safetensors lacks
(complex128, ...) are stored as ``uint8 [*shape, element size]`` with their dtype named in the
metadata (``tierstore.raw_dtypes``). Large exports are sharded with a Hugging Face style
``model.safetensors.index.json``; imports read single files, sharded directories and index
files.

Both exporters take every dtype a store holds, and the importers take back everything the
exporters write, plus foreign numeric arrays and tensors. An import reads and checks every
header (names, dtypes, shapes, duplicates) before it stores anything, and reads one
safetensors shard at a time. An export checks, once written, that it holds one tensor per
entry and removes what it wrote when it fails.

The import side lives in ``interchange_import`` and what both sides share (format constants,
name encodings, dtype forms) in ``interchange_formats``; this module writes the exports and
is the one to import from.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections import defaultdict
from typing import TYPE_CHECKING, Any

import torch

from .errors import CorruptEntryError, StoreError
from .interchange_formats import (
    INDEX_NAME,
    KIND_SEP,
    ST_NAMES_META,
    ST_RAW_META,
    ZARR_FORMAT,
    Progress,
    _format_pattern,
    _NoProgress,
    _numpy_of,
    _st_key,
    _st_native,
    _st_raw,
    safetensors_dtypes,
    zarr_node,
)
from .interchange_import import (
    ImportSource,
    detect_format,
    import_into,
    open_source,
    read_safetensors,
    read_zarr,
    safetensors_files,
)
from .sizes import parse_size
from .tensors import dtype_name

if TYPE_CHECKING:
    from .interface import Store

__all__ = [
    "INDEX_NAME",
    "KIND_SEP",
    "ST_NAMES_META",
    "ST_RAW_META",
    "ZARR_FORMAT",
    "ImportSource",
    "Progress",
    "detect_format",
    "export_safetensors",
    "export_zarr",
    "import_into",
    "open_source",
    "read_safetensors",
    "read_zarr",
    "safetensors_dtypes",
    "safetensors_files",
    "zarr_node",
]

_EXPERT = re.compile(r"^(?P<pre>.*\.experts)\.(?P<idx>\d+)\.(?P<post>.+)$")


def _read_entry(store: Store, name: str, kind: str) -> torch.Tensor:
    """An entry for export; a damaged one is a CorruptEntryError naming it."""
    fix = "the export was removed; check the store with `tierstore fsck`"
    try:
        return store.get(name, kind)
    except CorruptEntryError as e:
        detail = str(e).split(" is corrupt: ", 1)[-1]
        raise CorruptEntryError(name, kind, f"{detail}; {fix}") from None
    except OSError as e:
        raise CorruptEntryError(name, kind, f"its bytes cannot be read ({e}); {fix}") from None


def _check_written(store_keys: list[tuple[str, str]], written: list[tuple[str, str]],
                   out: str) -> None:
    """An export must hold exactly one tensor per entry, under that entry's name and kind."""
    if sorted(written) != sorted(store_keys):
        lost = sorted(set(store_keys) - set(written))
        raise StoreError(f"{out}: the export holds {len(written)} tensors for "
                         f"{len(store_keys)} entries (first lost: {lost[:1]}); it was removed")


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        os.unlink(path)


def _families(store: Store) -> dict[str, list[tuple[str, str, int, str]]]:
    """Group entries into zarr arrays: {array path: [(name, kind, expert id, pattern)]}.

    Every path is ``kind/node``. A family whose node another array would have too (an entry
    named like the family, or another family) is stored as single arrays instead."""
    groups: dict[tuple[str, str, str, str, tuple[int, ...]], list[tuple[str, int]]] = \
        defaultdict(list)
    singles: list[tuple[str, str]] = []
    for name, kind in store.keys():  # noqa: SIM118  (Store.keys is not a dict view)
        m = _EXPERT.match(name)
        if m:
            info = store.info(name, kind)
            key = (kind, m["pre"], m["post"], str(info.dtype), info.shape)
            groups[key].append((name, int(m["idx"])))
        else:
            singles.append((name, kind))
    by_path: dict[str, list[tuple[str, str, str, list[tuple[str, int]]]]] = defaultdict(list)
    for (kind, pre, post, _, _), members in groups.items():
        by_path[f"{kind}/{zarr_node(f'{pre}.{post}')}"].append((kind, pre, post, members))
    families: dict[str, tuple[str, str, str, list[tuple[str, int]]]] = {}
    for path, fams in by_path.items():
        if len(fams) == 1:
            families[path] = fams[0]
        else:  # experts that disagree on dtype/shape, or patterns that read alike
            singles.extend((n, f[0]) for f in fams for n, _ in f[3])
    taken: dict[str, tuple[str, str]] = {}

    def take(name: str, kind: str) -> None:
        node = f"{kind}/{zarr_node(name)}"
        if node in taken:  # only where zarr_node hashed two long names alike
            raise StoreError(f"entries {taken[node][0]!r} and {name!r} (kind {kind!r}) would "
                             "share a zarr array; shorten one of the names")
        taken[node] = (name, kind)

    for name, kind in singles:
        take(name, kind)
    while clash := [p for p in families if p in taken]:
        for path in clash:  # its members may in turn take another family's node
            kind, _, _, members = families.pop(path)
            for name, _ in members:
                take(name, kind)
    out: dict[str, list[tuple[str, str, int, str]]] = {}
    for path, (kind, pre, post, members) in families.items():
        pattern = _format_pattern(pre, post)
        out[path] = [(n, kind, idx, pattern) for n, idx in sorted(members, key=lambda x: x[1])]
    for path, (name, kind) in taken.items():
        out[path] = [(name, kind, -1, "")]
    return out


def export_zarr(store: Store, out: str, progress: Progress | None = None) -> int:
    """Write every live entry to a new zarr v3 group at ``out``; returns bytes exported."""
    import zarr

    progress = progress or _NoProgress()
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        raise StoreError(f"{out} exists and is not empty")
    keys = store.keys()
    families = _families(store)
    created = not os.path.exists(out)

    def undo() -> None:  # out was missing or empty: all in it is this export's
        if created:
            _remove(out)
        elif os.path.isdir(out):
            for child in os.listdir(out):
                _remove(os.path.join(out, child))

    total = 0
    try:
        root = zarr.open_group(out, mode="w", zarr_format=3)
        root.attrs["tierstore"] = {"format": ZARR_FORMAT, "layout": "one array per tensor family"}
        for path, members in families.items():
            kind = members[0][1]
            first = _read_entry(store, members[0][0], kind)
            arr_np, stored = _numpy_of(first)
            family = members[0][2] >= 0
            shape = ((len(members),) if family else ()) + arr_np.shape
            chunks = tuple(max(1, s) for s in (((1,) if family else ()) + arr_np.shape))
            group_path, _, arr_name = path.rpartition("/")
            group = root.require_group(group_path)
            # Every chunk is written, zeros too, so a chunk file that goes missing is an
            # error on import rather than a tensor of zeros.
            arr = group.create_array(
                arr_name, shape=shape, chunks=chunks, dtype=arr_np.dtype, compressors=None,
                fill_value=0, config={"write_empty_chunks": True},
            )
            attrs: dict[str, Any] = {"dtype": stored or dtype_name(first.dtype),
                                     "raw_bits": stored is not None, "chunks": "all"}
            if family:
                attrs.update(pattern=members[0][3], experts=[m[2] for m in members])
            else:
                attrs["name"] = members[0][0]
            arr.attrs["tierstore"] = attrs
            for i, (name, _, _, _) in enumerate(members):
                t = first if i == 0 else _read_entry(store, name, kind)
                a, _ = _numpy_of(t)
                if family:
                    arr[i] = a
                else:
                    arr[...] = a
                total += t.nbytes
                progress.update(t.nbytes)
        _check_written(keys, open_source(out, "zarr").keys(), out)
    except OSError as e:
        undo()
        raise StoreError(f"{out}: cannot write the export ({e}); it was removed") from None
    except BaseException:
        undo()
        raise
    return total


def export_safetensors(
    store: Store, out: str, *, shard_size: int | str = "4GiB", progress: Progress | None = None
) -> int:
    """Write live entries to ``out``: a single ``.safetensors`` file if ``out`` ends so and
    everything fits one shard, else a directory of shards with an index."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    progress = progress or _NoProgress()
    limit = parse_size(shard_size)
    keys = store.keys()
    single = out.endswith(".safetensors")
    native = _st_native()
    shards: list[list[tuple[str, str]]] = [[]]
    size = 0
    for name, kind in keys:
        n = store.info(name, kind).nbytes
        if shards[-1] and size + n > limit:
            shards.append([])
            size = 0
        shards[-1].append((name, kind))
        size += n
    if single and len(shards) > 1:
        raise StoreError(f"{out}: the store is larger than shard_size; export to a directory")
    if not single and os.path.exists(out) and not os.path.isdir(out):
        raise StoreError(f"{out} exists and is not a directory")
    created = not single and not os.path.exists(out)
    written: list[str] = []

    def undo() -> None:
        if created:
            _remove(out)
        for path in written:
            _remove(path)

    total, weight_map = 0, {}
    fname = out
    try:
        if not single:
            os.makedirs(out, exist_ok=True)
        for i, shard in enumerate(shards):
            fname = out if single else os.path.join(
                out, f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            )
            tensors, raw = {}, {}
            for name, kind in shard:
                t = _read_entry(store, name, kind)
                key = _st_key(name, kind)
                if t.dtype not in native:
                    raw[key] = dtype_name(t.dtype)
                    tensors[key] = _st_raw(t)
                else:
                    tensors[key] = t
                weight_map[key] = os.path.basename(fname)
                total += t.nbytes
                progress.update(t.nbytes)
            meta = {"format": "pt", "producer": "tierstore", ST_NAMES_META: "escaped"}
            if raw:
                meta[ST_RAW_META] = json.dumps(raw)
            written.append(fname)
            save_file(tensors, fname, metadata=meta)
        if not single:
            fname = os.path.join(out, INDEX_NAME)
            written.append(fname)
            with open(fname, "w") as f:
                json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f,
                          indent=1)
        _check_written(keys, open_source(out, "safetensors").keys(), out)
    except (OSError, SafetensorError) as e:
        undo()
        raise StoreError(f"{fname}: cannot write the export ({e}); it was removed") from None
    except BaseException:
        undo()
        raise
    return total
