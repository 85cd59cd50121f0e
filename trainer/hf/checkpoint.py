"""A Hugging Face safetensors checkpoint as an import reads it: its tensors' headers (from
one ``*.safetensors`` file, or a sharded set with its ``model.safetensors.index.json``) before
anything is allocated, then the tensors themselves with at most two shard files open, a fused
tensor one expert's slice at a time."""

from __future__ import annotations

import json
import os
import stat
from collections import OrderedDict
from typing import Any

import torch
from tierstore.trainer.train.data import file_kind

import tierstore
from tierstore.interchange import safetensors_dtypes

INDEX_FILE = "model.safetensors.index.json"

# safetensors' dtype codes torch reads, as torch dtypes
ST_DTYPES = safetensors_dtypes()


class HFImportError(tierstore.StoreError):
    """The directory cannot be imported (reported by the CLI as one line)."""


class TensorHeader:
    """One checkpoint tensor as its safetensors header describes it."""

    __slots__ = ("dtype", "path", "shape")

    def __init__(self, path: str, dtype: str, shape: list[int]) -> None:
        self.path, self.dtype, self.shape = path, dtype, shape


def _read_headers(path: str, names: list[str] | None = None) -> dict[str, TensorHeader]:
    """The headers of one safetensors file (of ``names`` only, if given: each must be
    there); reads no tensor data."""
    from safetensors import SafetensorError, safe_open

    try:
        mode = os.stat(path).st_mode
    except OSError as e:
        raise HFImportError(f"{path}: unreadable ({e.strerror})") from e
    if not stat.S_ISREG(mode):  # opening a FIFO would wait for a writer for ever
        raise HFImportError(f"{path}: {file_kind(mode)}, not a safetensors file; put the "
                            "checkpoint's file there")
    try:
        with safe_open(path, framework="pt") as st:
            keys = list(st.keys())
            if names is not None:
                lacking = sorted(set(names) - set(keys))
                if lacking:
                    raise HFImportError(f"{path}: lacks tensor {lacking[0]!r}, which "
                                        f"{INDEX_FILE} puts there; fix the index or "
                                        "re-download the shard")
                keys = names
            out = {}
            for k in keys:
                sl = st.get_slice(k)
                out[k] = TensorHeader(path, sl.get_dtype(), list(sl.get_shape()))
            return out
    except (SafetensorError, OSError, ValueError, TypeError) as e:
        raise HFImportError(f"{path}: unreadable safetensors file: {e}; re-download or "
                            "re-save it") from e


def weight_files(model_dir: str) -> dict[str, TensorHeader]:
    """Tensor name -> its header, from the index of a sharded checkpoint or every
    ``*.safetensors`` file of the directory."""
    index = os.path.join(model_dir, INDEX_FILE)
    if os.path.isfile(index):
        try:
            with open(index, encoding="utf-8") as f:
                wmap = json.load(f)["weight_map"]
            if not isinstance(wmap, dict) or not all(
                    isinstance(k, str) and isinstance(v, str) for k, v in wmap.items()):
                raise TypeError("weight_map is not a map of tensor names to file names")
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise HFImportError(f"{index}: unreadable index: {e}; re-download it, or delete it to "
                                "import every *.safetensors file of the directory") from e
        by_file: dict[str, list[str]] = {}
        for k, v in wmap.items():
            if os.path.isabs(v) or os.path.normpath(v).startswith(".."):
                raise HFImportError(f"{index}: shard {v!r} of {k!r} lies outside the model "
                                    "directory; fix the index")
            by_file.setdefault(v, []).append(k)
        missing = sorted(f for f in by_file if not os.path.isfile(os.path.join(model_dir, f)))
        if missing:
            raise HFImportError(f"{model_dir}: shards named in {INDEX_FILE} are missing: "
                                f"{', '.join(missing[:3])}; download them into the directory")
        out: dict[str, TensorHeader] = {}
        for f in sorted(by_file):
            out.update(_read_headers(os.path.join(model_dir, f), by_file[f]))
        return out
    files = sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors"))
    if not files:
        raise HFImportError(f"{model_dir}: no *.safetensors weights (only safetensors checkpoints "
                            "are imported)")
    out = {}
    for f in files:
        heads = _read_headers(os.path.join(model_dir, f))
        twice = sorted(set(heads) & set(out))
        if twice:
            raise HFImportError(f"{model_dir}: tensor {twice[0]!r} is in both {f} and "
                                f"{os.path.basename(out[twice[0]].path)}; remove the stale file")
        out.update(heads)
    return out


class CheckpointReader:
    """Tensors out of the checkpoint's files, at most ``max_open`` files open at a time
    (the least recently used one is closed first, unmapping it)."""

    def __init__(self, heads: dict[str, TensorHeader], max_open: int = 2,
                 dtypes: dict[str, torch.dtype] | None = None) -> None:
        self.heads, self.max_open = heads, max_open
        # The dtype each tensor is cast to as it is read (the model's for it: the import has
        # found every such cast lossless); absent: as the file has it.
        self.dtypes = dtypes or {}
        self._open: OrderedDict[str, Any] = OrderedDict()

    def _handle(self, name: str) -> Any:
        from safetensors import safe_open

        path = self.heads[name].path
        if path in self._open:
            self._open.move_to_end(path)
            return self._open[path]
        while len(self._open) >= self.max_open:
            self._open.popitem(last=False)[1].__exit__(None, None, None)
        try:
            self._open[path] = safe_open(path, framework="pt").__enter__()
        except Exception as e:  # noqa: BLE001  (safetensors raises its own error types)
            raise HFImportError(f"{path}: unreadable safetensors file: {e}") from e
        return self._open[path]

    def close(self) -> None:
        while self._open:
            self._open.popitem()[1].__exit__(None, None, None)

    def _read(self, name: str, at: slice | None = None) -> torch.Tensor:
        from safetensors import SafetensorError

        f = self._handle(name)
        try:
            t = f.get_tensor(name) if at is None else f.get_slice(name)[at]
        except (SafetensorError, OSError, ValueError, TypeError, RuntimeError) as e:
            raise HFImportError(f"{self.heads[name].path}: tensor {name!r} is unreadable: {e}; "
                                "re-download or re-save the file") from e
        target = self.dtypes.get(name)
        return t if target is None or t.dtype == target else t.to(target)

    def get(self, name: str) -> torch.Tensor:
        return self._read(name)

    def shape(self, name: str) -> list[int]:
        return list(self.heads[name].shape)

    def dtype(self, name: str) -> torch.dtype | None:
        return ST_DTYPES.get(self.heads[name].dtype)

    def expert_slice(self, name: str, e: int) -> torch.Tensor:
        """Expert ``e``'s slice of a tensor over every expert, keeping the leading
        dimension (``[1, ...]``), as a checkpoint of one expert would stack."""
        return self._read(name, slice(e, e + 1))

    def rank(self, name: str) -> str:
        """Sort key: the file ``name`` is in (reading in this order reads shard by shard)."""
        return self.heads[name].path
