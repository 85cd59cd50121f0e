"""zarr v3 and safetensors export/import round trips."""

from __future__ import annotations

import json
import os

import pytest
import torch
import zarr

import tierstore
from tierstore.interchange import (
    export_safetensors,
    export_zarr,
    import_into,
    read_safetensors,
    read_zarr,
)


def raw(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def fill(st: tierstore.Store) -> dict[tuple[str, str], torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ref: dict[tuple[str, str], torch.Tensor] = {}
    for layer in range(2):
        for e in (0, 1, 3):  # a gap in the expert ids
            for w, shape in (("w1", (8, 4)), ("w2", (4, 8))):
                name = f"layers.{layer}.experts.{e}.{w}"
                ref[(name, "param")] = torch.randn(shape, generator=g).to(torch.bfloat16)
                ref[(name, "exp_avg")] = torch.randn(shape, generator=g)
    # a family whose experts disagree on shape: each stored as an array of its own
    ref[("odd.experts.0.w", "param")] = torch.randn(3, generator=g)
    ref[("odd.experts.1.w", "param")] = torch.randn(5, generator=g)
    ref[("embed", "param")] = torch.randn(10, 4, generator=g)
    ref[("scalar", "param")] = torch.tensor(2.5)
    ref[("empty", "param")] = torch.empty(0, 3)
    ref[("f8", "param")] = torch.randn(6, generator=g).to(torch.float8_e4m3fn)
    ref[("flags", "param")] = torch.tensor([True, False, True])
    ref[("bf16.scalar", "param")] = torch.tensor(1.5, dtype=torch.bfloat16)
    st.put_many([(n, k, t) for (n, k), t in ref.items()])
    return ref


def assert_same(got: dict, ref: dict) -> None:
    assert got.keys() == ref.keys()
    for key, t in ref.items():
        assert got[key].dtype == t.dtype and got[key].shape == t.shape, key
        assert torch.equal(raw(got[key]), raw(t)), key


def test_zarr_round_trip_one_chunk_per_expert(make_store, tmp_path) -> None:
    st = make_store()
    ref = fill(st)
    assert export_zarr(st, str(tmp_path / "z")) == sum(t.nbytes for t in ref.values())
    assert_same({(n, k): t for n, k, t in read_zarr(str(tmp_path / "z"))}, ref)
    arr = zarr.open_group(str(tmp_path / "z"), mode="r")["param/layers.0.experts.w1"]
    assert arr.shape == (3, 8, 4) and arr.chunks == (1, 8, 4)  # one chunk per expert
    assert arr.attrs["tierstore"]["experts"] == [0, 1, 3]
    assert arr.attrs["tierstore"]["dtype"] == "bfloat16" and str(arr.dtype) == "uint16"
    fresh = make_store(str(tmp_path / "fresh"))
    import_into(fresh, str(tmp_path / "z"))
    assert_same({k: fresh.get(*k) for k in fresh.keys("")}, ref)


def test_foreign_zarr_group_imports_by_path(make_store, tmp_path) -> None:
    root = zarr.open_group(str(tmp_path / "f"), mode="w", zarr_format=3)
    arr = root.require_group("model").create_array("w", shape=(2, 3), dtype="float32")
    arr[...] = [[1, 2, 3], [4, 5, 6]]
    st = make_store()
    assert import_into(st, str(tmp_path / "f")) == 1
    assert torch.equal(st.get("model.w"), torch.tensor([[1.0, 2, 3], [4, 5, 6]]))


@pytest.mark.parametrize("sharded", [False, True])
def test_safetensors_round_trip(make_store, tmp_path, sharded: bool) -> None:
    st = make_store()
    ref = fill(st)
    out = str(tmp_path / ("shards" if sharded else "model.safetensors"))
    export_safetensors(st, out, shard_size=400 if sharded else "4GiB")
    if sharded:
        with open(os.path.join(out, "model.safetensors.index.json")) as f:
            index = json.load(f)
        assert len(set(index["weight_map"].values())) > 1
        assert "layers.0.experts.0.w1#exp_avg" in index["weight_map"]
    for src in [out] + ([os.path.join(out, "model.safetensors.index.json")] if sharded else []):
        assert_same({(n, k): t for n, k, t in read_safetensors(src)}, ref)
    fresh = make_store(str(tmp_path / "fresh"))
    import_into(fresh, out, batch_bytes=1000)  # several commits
    assert_same({k: fresh.get(*k) for k in fresh.keys("")}, ref)


def test_export_refusals(make_store, tmp_path) -> None:
    st = make_store()
    st.put("a", torch.zeros(1024))
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "x").write_text("x")
    with pytest.raises(tierstore.StoreError, match="not empty"):
        export_zarr(st, str(tmp_path / "busy"))
    st.put("b", torch.zeros(1024))
    with pytest.raises(tierstore.StoreError, match="shard_size"):
        export_safetensors(st, str(tmp_path / "one.safetensors"), shard_size=5000)
    with pytest.raises(tierstore.StoreError, match="neither"):
        import_into(st, str(tmp_path / "busy" / "x"))
