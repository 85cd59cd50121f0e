"""Export to and import from zarr v3 and safetensors.

zarr layout: one group per state kind (``param``, ``exp_avg``, ...). Tensors named
``<prefix>.experts.<N>.<suffix>`` with one dtype and shape form a *family*: one array of shape
``[n_experts, *shape]`` chunked ``[1, *shape]``, so each expert is one chunk and can be read
alone. Its attributes name the pattern and the expert ids. Any other tensor is an array of
its own. Dtypes numpy lacks (bfloat16, the float8s, ...) are kept as raw unsigned integers of
the same width with a ``tierstore.dtype`` attribute, so they round-trip bit for bit.

safetensors: tensors keep their names; a state kind other than ``param`` is written as
``name#kind``. Large exports are sharded with a Hugging Face style
``model.safetensors.index.json``; imports read single files, sharded directories and index
files.
"""

from __future__ import annotations

import json
import os
import re
from collections import defaultdict
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

from .errors import StoreError
from .sizes import parse_size
from .tensors import as_bytes, dtype_from_name, dtype_name, element_size

if TYPE_CHECKING:
    from .store import Store

_EXPERT = re.compile(r"^(?P<pre>.*\.experts)\.(?P<idx>\d+)\.(?P<post>.+)$")
_NATIVE = {
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
    torch.uint16, torch.uint32, torch.uint64, torch.float16, torch.float32, torch.float64,
    torch.complex64, torch.complex128,
}
KIND_SEP = "#"
INDEX_NAME = "model.safetensors.index.json"


class Progress(Protocol):
    def update(self, n: int) -> Any: ...


class _NoProgress:
    def update(self, n: int) -> None:
        pass


def _numpy_of(t: torch.Tensor) -> tuple[np.ndarray, str | None]:
    """(numpy array, stored dtype name when the array holds raw bits instead)."""
    if t.dtype in _NATIVE:
        return t.contiguous().numpy(), None
    width = element_size(t.dtype)
    raw = as_bytes(t).view(f"<u{width}") if width in (1, 2, 4, 8) else as_bytes(t)
    return raw.reshape(t.shape) if width in (1, 2, 4, 8) else raw, dtype_name(t.dtype)


def _tensor_of(a: np.ndarray, stored: str | None) -> torch.Tensor:
    a = np.array(a, copy=True, order="C")  # ascontiguousarray would make a 0-d array 1-d
    if stored is None:
        return torch.from_numpy(a)
    return torch.from_numpy(a.reshape(-1)).view(dtype_from_name(stored)).reshape(a.shape)


def _families(store: Store) -> dict[str, list[tuple[str, str, int, str]]]:
    """Group entries into zarr arrays: {array path: [(name, kind, expert id, pattern)]}."""
    groups: dict[tuple[str, str, str, tuple[int, ...]], list[tuple[str, int]]] = defaultdict(list)
    singles: list[tuple[str, str]] = []
    for name, kind in store.keys():  # noqa: SIM118  (Store.keys is not a dict view)
        m = _EXPERT.match(name)
        if m:
            info = store.info(name, kind)
            pattern = f"{m['pre']}.{{}}.{m['post']}"
            key = (kind, pattern, str(info.dtype), info.shape)
            groups[key].append((name, int(m["idx"])))
        else:
            singles.append((name, kind))
    out: dict[str, list[tuple[str, str, int, str]]] = {}
    by_pattern: dict[tuple[str, str], int] = defaultdict(int)
    for kind, pattern, _, _ in groups:
        by_pattern[(kind, pattern)] += 1
    for (kind, pattern, _, _), members in groups.items():
        if by_pattern[(kind, pattern)] > 1:  # experts disagree on dtype/shape: store each alone
            singles.extend((n, kind) for n, _ in members)
            continue
        path = f"{kind}/{pattern.replace('.{}.', '.')}"
        out[path] = [(n, kind, idx, pattern) for n, idx in sorted(members, key=lambda x: x[1])]
    for name, kind in singles:
        out[f"{kind}/{name}"] = [(name, kind, -1, "")]
    return out


def export_zarr(store: Store, out: str, progress: Progress | None = None) -> int:
    """Write every live entry to a new zarr v3 group at ``out``; returns bytes exported."""
    import zarr

    progress = progress or _NoProgress()
    if os.path.exists(out) and os.listdir(out):
        raise StoreError(f"{out} exists and is not empty")
    root = zarr.open_group(out, mode="w", zarr_format=3)
    root.attrs["tierstore"] = {"format": 1, "layout": "one array per tensor family"}
    total = 0
    for path, members in _families(store).items():
        kind = members[0][1]
        first = store.get(members[0][0], kind)
        arr_np, stored = _numpy_of(first)
        family = members[0][2] >= 0
        shape = ((len(members),) if family else ()) + arr_np.shape
        chunks = tuple(max(1, s) for s in (((1,) if family else ()) + arr_np.shape))
        group_path, _, arr_name = path.rpartition("/")
        group = root.require_group(group_path)
        arr = group.create_array(
            arr_name, shape=shape, chunks=chunks, dtype=arr_np.dtype, compressors=None,
            fill_value=0,
        )
        attrs: dict[str, Any] = {"dtype": stored or str(first.dtype).removeprefix("torch."),
                                 "raw_bits": stored is not None}
        if family:
            attrs.update(pattern=members[0][3], experts=[m[2] for m in members])
        else:
            attrs["name"] = members[0][0]
        arr.attrs["tierstore"] = attrs
        for i, (name, _, _, _) in enumerate(members):
            t = first if i == 0 else store.get(name, kind)
            a, _ = _numpy_of(t)
            if family:
                arr[i] = a
            else:
                arr[...] = a
            total += t.nbytes
            progress.update(t.nbytes)
    return total


def _zarr_arrays(group: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    for name, arr in group.arrays():
        yield prefix + name, arr
    for name, sub in group.groups():
        yield from _zarr_arrays(sub, prefix + name + "/")


def read_zarr(src: str) -> Iterator[tuple[str, str, torch.Tensor]]:
    """(name, kind, tensor) for every tensor in a zarr group, one expert chunk at a time.

    Arrays this module wrote come back under their original names and kinds; arrays of
    other zarr groups are named by their path with '/' turned into '.', kind ``param``.
    """
    import zarr

    root = zarr.open_group(src, mode="r")
    for path, arr in _zarr_arrays(root):
        attrs = arr.attrs.get("tierstore")
        if attrs is None:
            yield path.replace("/", "."), "param", torch.from_numpy(np.asarray(arr[...]).copy())
            continue
        kind = path.split("/", 1)[0]
        stored = attrs["dtype"] if attrs.get("raw_bits") else None
        if "pattern" in attrs:
            for i, idx in enumerate(attrs["experts"]):
                yield attrs["pattern"].format(idx), kind, _tensor_of(arr[i], stored)
        else:
            yield attrs["name"], kind, _tensor_of(np.asarray(arr[...]), stored)


def _st_key(name: str, kind: str) -> str:
    return name if kind == "param" else f"{name}{KIND_SEP}{kind}"


def _st_split(key: str) -> tuple[str, str]:
    name, sep, kind = key.rpartition(KIND_SEP)
    if sep and re.match(r"^[a-z][a-z0-9_]{0,31}$", kind):
        return name, kind
    return key, "param"


def export_safetensors(
    store: Store, out: str, *, shard_size: int | str = "4GiB", progress: Progress | None = None
) -> int:
    """Write live entries to ``out``: a single ``.safetensors`` file if ``out`` ends so and
    everything fits one shard, else a directory of shards with an index."""
    from safetensors.torch import save_file

    progress = progress or _NoProgress()
    limit = parse_size(shard_size)
    keys = store.keys()
    single = out.endswith(".safetensors")
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
    if not single:
        os.makedirs(out, exist_ok=True)
    total, weight_map = 0, {}
    for i, shard in enumerate(shards):
        fname = out if single else os.path.join(
            out, f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        )
        tensors = {}
        for name, kind in shard:
            t = store.get(name, kind)
            tensors[_st_key(name, kind)] = t
            weight_map[_st_key(name, kind)] = os.path.basename(fname)
            total += t.nbytes
            progress.update(t.nbytes)
        save_file(tensors, fname, metadata={"format": "pt", "producer": "tierstore"})
    if not single:
        with open(os.path.join(out, INDEX_NAME), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
    return total


def safetensors_files(src: str) -> list[str]:
    """The shard files of a safetensors source: a file, an index file or a directory."""
    if os.path.isdir(src):
        index = os.path.join(src, INDEX_NAME)
        if not os.path.exists(index):
            found = sorted(f for f in os.listdir(src) if f.endswith(".safetensors"))
            if not found:
                raise StoreError(f"{src}: no .safetensors files")
            return [os.path.join(src, f) for f in found]
        src = index
    if src.endswith(".json"):
        with open(src) as f:
            weight_map = json.load(f)["weight_map"]
        base = os.path.dirname(src)
        return [os.path.join(base, f) for f in sorted(set(weight_map.values()))]
    return [src]


def read_safetensors(src: str) -> Iterator[tuple[str, str, torch.Tensor]]:
    from safetensors import safe_open

    for path in safetensors_files(src):
        with safe_open(path, framework="pt") as f:
            for key in f.keys():  # noqa: SIM118  (safe_open is not a Mapping)
                name, kind = _st_split(key)
                yield name, kind, f.get_tensor(key)


def detect_format(src: str) -> str:
    """'zarr' or 'safetensors', from what is at ``src``."""
    if os.path.isdir(src) and (
        os.path.exists(os.path.join(src, "zarr.json")) or os.path.exists(os.path.join(src, ".zgroup"))
    ):
        return "zarr"
    if src.endswith((".safetensors", ".json")) or os.path.isdir(src):
        return "safetensors"
    raise StoreError(f"{src}: neither a zarr group nor safetensors (file, index or directory)")


def import_into(
    store: Store,
    src: str,
    *,
    fmt: str | None = None,
    batch_bytes: int | str = "256MiB",
    progress: Progress | None = None,
) -> int:
    """Put every tensor of ``src`` into ``store`` in batches of about ``batch_bytes``
    (each batch one commit); returns the number of tensors imported."""
    progress = progress or _NoProgress()
    fmt = fmt or detect_format(src)
    reader = read_zarr(src) if fmt == "zarr" else read_safetensors(src)
    limit, batch, size, n = parse_size(batch_bytes), [], 0, 0
    for name, kind, tensor in reader:
        batch.append((name, kind, tensor))
        size += tensor.nbytes
        if size >= limit:
            store.put_many(batch)
            progress.update(size)
            n, batch, size = n + len(batch), [], 0
    if batch:
        store.put_many(batch)
        progress.update(size)
        n += len(batch)
    return n
