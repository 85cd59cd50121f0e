"""Imports and exports of hostile or damaged input: every failure is one line on stderr naming
the file or entry, exit status 2, nothing half written; every (name, kind) round-trips
exactly through both formats, whatever characters the name holds."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import zarr
from click.testing import CliRunner
from safetensors.torch import save_file

import tierstore
from tierstore import interchange
from tierstore.cli import main
from tierstore.interchange import export_safetensors, export_zarr, import_into, open_source
from tierstore.tensors import DTYPES


def cli_error(*args: str) -> str:
    """Run the CLI, expecting one ``tierstore: ...`` line on stderr and exit status 2."""
    r = CliRunner().invoke(main, list(args), catch_exceptions=False)
    assert r.exit_code == 2, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tierstore: "), r.stderr
    return lines[0]


def cli_ok(*args: str) -> str:
    r = CliRunner().invoke(main, list(args), catch_exceptions=False)
    assert r.exit_code == 0, (r.stdout, r.stderr)
    return r.stdout


def new_store(path: Path) -> tierstore.Store:
    return tierstore.open(path, create=True, backing="nvme", slab_size="8MiB")


def contents(path: Path) -> dict[tuple[str, str], torch.Tensor]:
    with tierstore.open(path) as st:
        return {k: st.get(*k) for k in st.keys()}  # noqa: SIM118  (Store.keys is not a dict view)


def assert_exact(got: dict, ref: dict) -> None:
    assert got.keys() == ref.keys(), set(got) ^ set(ref)
    for key, t in ref.items():
        g = got[key]
        assert g.dtype == t.dtype and g.shape == t.shape, key
        assert torch.equal(g.reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)), key


# --------------------------------------------------------------------------- item 7: names

HOSTILE_NAMES = [
    "w#exp_avg", "w", "#", "##", "x#param", "x#", "#exp_avg", "%", "%23", "%2F", "%25%",
    "a/b", "a", "a/b/c", "/lead", "trail/", "a//b", "a\\b", ".", "..", "...", ".hidden",
    "zarr.json", "__reserved", "c", "ü€ naïve 名前", "n" * 400, "n" * 399 + "/",
    "x.experts.1.y", "x.experts.y",  # a family and a single that would share an array
    "q.experts.experts.1.y", "q.experts.1.experts.y",  # two families that would
    "b{}.experts.0.c{", "b{}.experts.1.c{",  # braces in a family's pattern
    "layers.0.experts.0.w1", "layers.0.experts.2.w1",
]


def hostile_store(path: Path) -> dict[tuple[str, str], torch.Tensor]:
    ref = {}
    for i, name in enumerate(HOSTILE_NAMES):
        for j, kind in enumerate(("param", "exp_avg", "grad")):
            ref[(name, kind)] = torch.full((2, 3), float(3 * i + j))
    with new_store(path) as st:
        st.put_many([(n, k, t) for (n, k), t in ref.items()])
    return ref


@pytest.mark.parametrize("out", ["z", "one.safetensors", "shards"])
def test_every_name_round_trips_exactly(tmp_path: Path, out: str) -> None:
    ref = hostile_store(tmp_path / "s")
    dst = str(tmp_path / out)
    with tierstore.open(tmp_path / "s") as st:
        if out == "z":
            export_zarr(st, dst)
        else:
            export_safetensors(st, dst, shard_size=1000 if out == "shards" else "4GiB")
    assert_exact({(n, k): t for n, k, t in open_source(dst).tensors()}, ref)
    with new_store(tmp_path / "back") as st:
        assert import_into(st, dst) == len(ref)
    assert_exact(contents(tmp_path / "back"), ref)


@pytest.mark.parametrize("fmt,out", [("safetensors", "m.safetensors"), ("zarr", "z")])
def test_cli_param_named_like_a_kind_key(tmp_path: Path, fmt: str, out: str) -> None:
    """The issue's example: param 'w#exp_avg' = 1.0 beside exp_avg of 'w' = 2.0."""
    with new_store(tmp_path / "s") as st:
        st.put("w#exp_avg", torch.tensor(1.0))
        st.put("w", torch.tensor(2.0), kind="exp_avg")
    cli_ok("export", str(tmp_path / "s"), str(tmp_path / out), "--format", fmt)
    cli_ok("init", str(tmp_path / "back"), "--slab-size", "8MiB")
    assert "imported 2 tensors" in cli_ok("import", str(tmp_path / out), "--store",
                                          str(tmp_path / "back"))
    got = contents(tmp_path / "back")
    assert got == {("w#exp_avg", "param"): torch.tensor(1.0),
                   ("w", "exp_avg"): torch.tensor(2.0)}


def test_plain_names_encode_as_before(tmp_path: Path) -> None:
    with new_store(tmp_path / "s") as st:
        for e in range(2):
            st.put(f"layers.0.experts.{e}.w1", torch.ones(2))
            st.put(f"layers.0.experts.{e}.w1", torch.ones(2), kind="exp_avg")
        st.put("embed", torch.ones(3))
        export_safetensors(st, str(tmp_path / "m.safetensors"))
        export_zarr(st, str(tmp_path / "z"))
    from safetensors import safe_open

    with safe_open(str(tmp_path / "m.safetensors"), framework="pt") as f:
        assert set(f.keys()) == {"layers.0.experts.0.w1", "layers.0.experts.1.w1", "embed",
                                 "layers.0.experts.0.w1#exp_avg",
                                 "layers.0.experts.1.w1#exp_avg"}
    root = zarr.open_group(str(tmp_path / "z"), mode="r")
    assert root["param/layers.0.experts.w1"].attrs["tierstore"]["experts"] == [0, 1]
    assert root["exp_avg/layers.0.experts.w1"].shape == (2, 2)
    assert root["param/embed"].attrs["tierstore"]["name"] == "embed"


def test_files_without_the_name_marker_read_as_before(tmp_path: Path) -> None:
    """Older exports and other tools' files: keys are names (``name#kind`` for other kinds);
    two keys that decode to one entry are refused rather than one silently kept."""
    path = tmp_path / "old.safetensors"
    save_file({"a": torch.ones(1), "a#exp_avg": torch.zeros(1), "b%23c": torch.ones(1)},
              str(path), metadata={"format": "pt", "producer": "tierstore"})
    assert sorted(open_source(str(path)).keys()) == [("a", "exp_avg"), ("a", "param"),
                                                     ("b%23c", "param")]
    save_file({"w": torch.ones(1), "w#param": torch.zeros(1)}, str(path))
    line = cli_error("import", str(path), "--store", str(tmp_path / "st"))
    assert line.count(str(path)) == 1 and "tensor 'w#param' and tensor 'w' are both entry 'w'" \
        in line
    assert not (tmp_path / "st").exists()


def test_export_checks_one_tensor_per_entry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                            ) -> None:
    """Were the encoding ever to merge two entries again, the export fails and is removed."""
    with new_store(tmp_path / "s") as st:
        st.put("w#exp_avg", torch.tensor(1.0))
        st.put("w", torch.tensor(2.0), kind="exp_avg")
        st.put("other", torch.tensor(3.0))
    monkeypatch.setattr(interchange, "_st_key",
                        lambda n, k: n if k == "param" else f"{n}#{k}")
    line = cli_error("export", str(tmp_path / "s"), str(tmp_path / "m.safetensors"),
                     "--format", "safetensors")
    assert "2 tensors for 3 entries" in line
    assert not (tmp_path / "m.safetensors").exists()
    monkeypatch.setattr(interchange, "zarr_node", lambda n: "same")
    line = cli_error("export", str(tmp_path / "s"), str(tmp_path / "z"), "--format", "zarr")
    assert "would share a zarr array" in line
    assert not (tmp_path / "z").exists()


# --------------------------------------------------------------------------- dtypes


def storable_dtypes() -> list[torch.dtype]:
    out = []
    for dt in DTYPES.values():
        try:
            torch.arange(32, dtype=torch.uint8).view(dt).contiguous()
        except (RuntimeError, TypeError, NotImplementedError):
            continue
        out.append(dt)
    return out


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
@pytest.mark.parametrize("out", ["z", "m.safetensors"])
def test_exporters_take_every_dtype_the_store_holds(tmp_path: Path, out: str) -> None:
    """complex128 (which safetensors lacks) and every other storable dtype round-trip bit for
    bit through both formats."""
    ref = {(f"t.{dt}", "param"): torch.arange(32, dtype=torch.uint8).view(dt).reshape(2, -1)
           for dt in storable_dtypes()}
    ref[("c128", "exp_avg")] = torch.tensor([[1 + 2j, -3.5j]], dtype=torch.complex128)
    ref[("c128.empty", "param")] = torch.empty(0, 4, dtype=torch.complex128)
    ref[("c128.scalar", "param")] = torch.tensor(7 - 1j, dtype=torch.complex128)
    assert torch.complex128 in storable_dtypes() and torch.bfloat16 in storable_dtypes()
    with new_store(tmp_path / "s") as st:
        st.put_many([(n, k, t) for (n, k), t in ref.items()])
    cli_ok("export", str(tmp_path / "s"), str(tmp_path / out), "--format",
           "zarr" if out == "z" else "safetensors")
    cli_ok("init", str(tmp_path / "back"), "--slab-size", "8MiB")
    cli_ok("import", str(tmp_path / out), "--store", str(tmp_path / "back"))
    assert_exact(contents(tmp_path / "back"), ref)


def test_foreign_zarr_complex128_exports_to_safetensors(tmp_path: Path) -> None:
    """What the zarr import accepts, the safetensors export writes (and reads back)."""
    root = zarr.open_group(str(tmp_path / "f"), mode="w", zarr_format=3)
    arr = root.create_array("c", shape=(3,), dtype="complex128")
    arr[...] = np.array([1 + 1j, 2, -3j])
    be = root.create_array("be", shape=(2,), dtype=">f4")
    be[...] = [1.5, -2.0]
    cli_ok("init", str(tmp_path / "s"), "--slab-size", "8MiB")
    cli_ok("import", str(tmp_path / "f"), "--store", str(tmp_path / "s"))
    cli_ok("export", str(tmp_path / "s"), str(tmp_path / "m.safetensors"), "--format",
           "safetensors")
    got = {(n, k): t for n, k, t in open_source(str(tmp_path / "m.safetensors")).tensors()}
    assert torch.equal(got[("c", "param")],
                       torch.tensor([1 + 1j, 2, -3j], dtype=torch.complex128))
    assert torch.equal(got[("be", "param")], torch.tensor([1.5, -2.0]))


# --------------------------------------------------------------------------- item 6: import


def make_safetensors(tmp_path: Path) -> Path:
    path = tmp_path / "ok.safetensors"
    save_file({"a": torch.arange(10.0), "b": torch.zeros(3, dtype=torch.int64)}, str(path))
    return path


def test_malformed_safetensors_files(tmp_path: Path) -> None:
    raw = make_safetensors(tmp_path).read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    header["a"]["shape"] = [1000]
    bad_header = json.dumps(header).encode()
    cases = {
        "zeros": b"\0" * 64,
        "truncated": raw[:-8],
        "short": b"abc",
        "huge-header": struct.pack("<Q", 1 << 40) + raw[8:],
        "bad-shape": struct.pack("<Q", len(bad_header)) + bad_header + raw[8 + n:],
    }
    for name, data in cases.items():
        path = tmp_path / f"{name}.safetensors"
        path.write_bytes(data)
        line = cli_error("import", str(path), "--store", str(tmp_path / "st"))
        assert str(path) in line and "re-export" in line, name
    assert not (tmp_path / "st").exists()


def test_bad_safetensors_index(tmp_path: Path) -> None:
    shards = tmp_path / "shards"
    with new_store(tmp_path / "s") as st:
        for i in range(6):
            st.put(f"t{i}", torch.full((64,), float(i)))
        export_safetensors(st, str(shards), shard_size=600)
    index = shards / "model.safetensors.index.json"
    good = json.loads(index.read_text())
    files = sorted(set(good["weight_map"].values()))
    assert len(files) > 1
    store = str(tmp_path / "st")

    index.write_text("{not json")
    line = cli_error("import", str(shards), "--store", store)
    assert str(index) in line and "not a readable safetensors index" in line
    index.write_text(json.dumps({"weight_map": ["t0"]}))
    assert "no weight_map" in cli_error("import", str(index), "--store", store)
    index.write_text(json.dumps({"weight_map": {**good["weight_map"], "t0": "gone.safetensors"}}))
    line = cli_error("import", str(shards), "--store", store)
    assert "gone.safetensors" in line and "missing" in line
    index.write_text(json.dumps({"weight_map": {**good["weight_map"], "t9": files[0]}}))
    line = cli_error("import", str(shards), "--store", store)
    assert "'t9'" in line and files[0] in line
    index.write_text(json.dumps({"weight_map": {**good["weight_map"], "t0": "../x.safetensors"}}))
    assert "outside" in cli_error("import", str(shards), "--store", store)
    wm = dict(good["weight_map"])
    del wm["t0"]
    index.write_text(json.dumps({"weight_map": wm}))
    assert "does not list" in cli_error("import", str(shards), "--store", store)
    index.write_text(json.dumps(good))
    (shards / files[1]).write_bytes(b"\0" * 100)
    line = cli_error("import", str(shards), "--store", store)
    assert files[1] in line
    assert not (tmp_path / "st").exists()


def tierstore_zarr(tmp_path: Path) -> Path:
    with new_store(tmp_path / "s") as st:
        for e in range(3):
            st.put(f"layers.0.experts.{e}.w1", torch.full((2, 2), float(e)))
        st.put("embed", torch.ones(4))
        st.put("half", torch.ones(2, dtype=torch.bfloat16))
        export_zarr(st, str(tmp_path / "z"))
    return tmp_path / "z"


def _set_attrs(z: Path, path: str, **change: Any) -> None:
    arr = zarr.open_group(str(z), mode="r+")[path]
    attrs = dict(arr.attrs["tierstore"])
    attrs.update(change)
    arr.attrs["tierstore"] = attrs


@pytest.mark.filterwarnings("ignore:The data type")  # zarr: U3 has no v3 specification
@pytest.mark.parametrize("case,expect", [
    ("string", "StringDType"),
    ("datetime", "datetime64"),
    ("fixed-unicode", "<U3"),
    ("dtype-says-int", "its tierstore attributes say int32"),
    ("unknown-dtype", "tierstore dtype 'float99'"),
    ("raw-wrong-width", "its tierstore attributes say bfloat16 as raw bits"),
    ("experts-too-few", "experts [0, 1] are not 3"),
    ("experts-not-ints", "are not 3 distinct ids"),
    ("bad-pattern", "pattern 'layers.0.experts.{0}.{1}'"),
    ("no-name", "no entry name"),
    ("no-kind-group", "not in a state kind's group"),
])
def test_hostile_zarr(tmp_path: Path, case: str, expect: str) -> None:
    z = tierstore_zarr(tmp_path)
    root = zarr.open_group(str(z), mode="r+")
    if case == "string":
        root.create_array("names", shape=(2,), dtype=str)
        where = "names"
    elif case == "datetime":
        root.require_group("param").create_array("when", shape=(2,), dtype="datetime64[s]")
        where = "param/when"
    elif case == "fixed-unicode":
        root.create_array("u", shape=(2,), dtype="U3")
        where = "u"
    elif case == "dtype-says-int":
        _set_attrs(z, "param/embed", dtype="int32")
        where = "param/embed"
    elif case == "unknown-dtype":
        _set_attrs(z, "param/embed", dtype="float99")
        where = "param/embed"
    elif case == "raw-wrong-width":
        arr = root["param/half"]
        new = root["param"].create_array("half2", shape=(2,), dtype="uint8")
        new.attrs["tierstore"] = dict(arr.attrs["tierstore"], name="half2")
        where = "param/half2"
    elif case == "experts-too-few":
        _set_attrs(z, "param/layers.0.experts.w1", experts=[0, 1])
        where = "param/layers.0.experts.w1"
    elif case == "experts-not-ints":
        _set_attrs(z, "param/layers.0.experts.w1", experts=[0, "1", 1])
        where = "param/layers.0.experts.w1"
    elif case == "bad-pattern":
        _set_attrs(z, "param/layers.0.experts.w1", pattern="layers.0.experts.{0}.{1}")
        where = "param/layers.0.experts.w1"
    elif case == "no-name":
        arr = root["param/embed"]
        arr.attrs["tierstore"] = {k: v for k, v in arr.attrs["tierstore"].items()
                                  if k != "name"}
        where = "param/embed"
    else:
        new = root.create_array("stray", shape=(2,), dtype="float32")
        new.attrs["tierstore"] = {"dtype": "float32", "raw_bits": False, "name": "stray"}
        where = "stray"
    line = cli_error("import", str(z), "--store", str(tmp_path / "st"))
    assert f"zarr array {where!r}" in line and expect in line, line
    assert not (tmp_path / "st").exists()


def test_damaged_zarr_metadata(tmp_path: Path) -> None:
    z = tierstore_zarr(tmp_path)
    (z / "param" / "embed" / "zarr.json").write_text("{oops")
    line = cli_error("import", str(z), "--store", str(tmp_path / "st"))
    assert str(z / "param" / "embed" / "zarr.json") in line and "re-export" in line
    (z / "zarr.json").write_text("[]")
    assert str(z / "zarr.json") in cli_error("import", str(z), "--store", str(tmp_path / "st"))
    assert not (tmp_path / "st").exists()


# --------------------------------------------------------------------------- item 6: export


def flip_byte(info: tierstore.EntryInfo) -> None:
    assert info.path is not None and info.offset is not None
    with open(info.path, "r+b") as f:
        f.seek(info.offset + 5)
        b = f.read(1)
        f.seek(info.offset + 5)
        f.write(bytes([b[0] ^ 0x5A]))


@pytest.mark.parametrize("fmt,out", [("safetensors", "m.safetensors"), ("safetensors", "dir"),
                                     ("zarr", "z")])
def test_export_of_a_damaged_entry(tmp_path: Path, fmt: str, out: str) -> None:
    with tierstore.open(tmp_path / "s", create=True, slab_size="8MiB", host_cache=0) as st:
        for i in range(4):
            st.put(f"t{i}", torch.full((100,), float(i)))
        info = st.info("t2")
    flip_byte(info)
    line = cli_error("export", str(tmp_path / "s"), str(tmp_path / out), "--format", fmt)
    assert "entry 't2' (kind 'param') is corrupt" in line and "tierstore fsck" in line
    assert not (tmp_path / out).exists()


def test_store_side_oserror_in_export_is_one_line(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    with new_store(tmp_path / "s") as st:
        st.put("good", torch.ones(3))
        st.put("bad", torch.ones(3), kind="exp_avg")
    real_get = tierstore.Store.get

    def get(self: tierstore.Store, name: str, kind: str = "param", **kw: Any) -> torch.Tensor:
        if name == "bad":
            raise OSError(5, "Input/output error")
        return real_get(self, name, kind, **kw)

    monkeypatch.setattr(tierstore.Store, "get", get)
    for fmt, out in (("safetensors", "m.safetensors"), ("zarr", "z")):
        line = cli_error("export", str(tmp_path / "s"), str(tmp_path / out), "--format", fmt)
        assert "entry 'bad' (kind 'exp_avg')" in line and "Input/output error" in line
        assert not (tmp_path / out).exists()


def test_unwritable_export_target_is_one_line(tmp_path: Path) -> None:
    with new_store(tmp_path / "s") as st:
        st.put("a", torch.ones(3))
    (tmp_path / "file").write_text("x")
    line = cli_error("export", str(tmp_path / "s"), str(tmp_path / "file" / "m.safetensors"),
                     "--format", "safetensors")
    assert "m.safetensors" in line and "cannot write" in line


def test_a_missing_zarr_chunk_is_an_error_not_zeros(tmp_path: Path) -> None:
    z = tierstore_zarr(tmp_path)  # expert 0 is all zeros: its chunk is written all the same
    chunk_files = sorted(p for p in z.rglob("*") if p.is_file() and "/c/" in str(p))
    assert len(chunk_files) == 3 + 1 + 1, "every chunk, zeros too, is written"
    assert {n: float(t.sum()) for n, _, t in interchange.read_zarr(str(z))}[
        "layers.0.experts.0.w1"] == 0.0
    chunk_files[0].unlink()
    line = cli_error("import", str(z), "--store", str(tmp_path / "back"))
    assert "missing" in line and "re-export" in line
    assert not (tmp_path / "back").exists()
