"""``tierstore import-hf`` of hostile or damaged model directories: every number of
``config.json`` in range and held against the checkpoint's headers, every tensor's dtype
against the model's, the tokenizer loaded, before anything is allocated or a store is made;
each failure one line naming the file, exit status 2, no store left behind."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file
from test_import_hostile import cli_error, cli_ok, new_store

import tierstore

ROOT = Path(__file__).resolve().parent.parent

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from hf_models import make_hf_model

    root = tmp_path_factory.mktemp("hf")
    make_hf_model("mixtral", root / "single")
    make_hf_model("mixtral", root / "sharded", max_shard_size="40KB")
    return {"single": root / "single", "sharded": root / "sharded"}


def hf_copy(hf_dirs: dict[str, Path], tmp_path: Path, which: str = "single") -> Path:
    dst = tmp_path / which
    shutil.copytree(hf_dirs[which], dst)
    return dst


def edit_config(model: Path, **change: Any) -> None:
    cfg = json.loads((model / "config.json").read_text())
    for k, v in change.items():
        if v is ...:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (model / "config.json").write_text(json.dumps(cfg))


def hf_error(model: Path, tmp_path: Path) -> str:
    line = cli_error("import-hf", str(model), "--store", str(tmp_path / "st"))
    assert not (tmp_path / "st").exists()  # checked before the store was created
    return line


@pytest.mark.parametrize("change,expect", [
    ({"hidden_size": -32}, "hidden_size is -32"),
    ({"hidden_size": "32"}, "hidden_size is '32'"),
    ({"hidden_size": 32.5}, "hidden_size is 32.5"),
    ({"hidden_size": True}, "hidden_size is True"),
    ({"num_hidden_layers": 0}, "num_hidden_layers is 0"),
    ({"num_local_experts": -1}, "num_local_experts is -1"),
    ({"num_experts_per_tok": 7}, "num_experts_per_tok is 7"),
    ({"num_attention_heads": 1 << 40}, "num_attention_heads"),
    ({"vocab_size": None}, "vocab_size is None"),
    ({"rms_norm_eps": -1e-5}, "rms_norm_eps is -1e-05"),
    ({"rms_norm_eps": "tiny"}, "rms_norm_eps is 'tiny'"),
    ({"rope_scaling": "linear"}, "rope_scaling is 'linear'"),
    ({"rope_parameters": {"rope_theta": -1}}, "rope_theta is -1"),
    ({"eos_token_id": [2, "x"]}, "eos_token_id is [2, 'x']"),
    ({"eos_token_id": 10 ** 6}, "eos_token_id is 1000000"),
    ({"sliding_window": -4}, "sliding_window is -4"),
    ({"architectures": 5}, "architectures is 5"),
    ({"dtype": "int32"}, "dtype is 'int32', not a dtype a model is imported in"),
    ({"torch_dtype": "float99"}, "torch_dtype is 'float99'"),
    ({"dtype": 16}, "dtype is 16"),
    # within the sane ranges, but not what the weights hold: the tensor is named
    ({"num_hidden_layers": 4000}, "the checkpoint lacks model.layers.10.input_layernorm"),
    ({"num_local_experts": 60000}, "gate.weight makes model.layers.0.mlp.gate.weight of shape"),
    ({"hidden_size": 1 << 20}, "the config implies [160, 1048576]"),
    ({"vocab_size": 1 << 25}, "the config implies [33554432, 32]"),
    ({"intermediate_size": 1 << 21}, "the config implies [4194304, 32]"),
    ({"intermediate_size": ...}, "the config implies [28672, 32]"),  # the class's default
    ({"num_attention_heads": 8}, "the config implies"),
])
def test_import_hf_bad_config_values(hf_dirs: dict[str, Path], tmp_path: Path,
                                     change: dict[str, Any], expect: str) -> None:
    model = hf_copy(hf_dirs, tmp_path)
    edit_config(model, **change)
    line = hf_error(model, tmp_path)
    assert expect in line and "config.json" in line, line


EXPERT = "model.layers.0.block_sparse_moe.experts.1.w1.weight"
NORM = "model.norm.weight"


def retype(model: Path, name: str, dtype: torch.dtype) -> None:
    """Save the checkpoint again with tensor ``name`` cast to ``dtype``."""
    from safetensors.torch import load_file

    tensors = load_file(str(model / "model.safetensors"))
    tensors[name] = tensors[name].to(dtype)
    save_file(tensors, str(model / "model.safetensors"), metadata={"format": "pt"})


@pytest.mark.parametrize("name,dtype,config,expect", [
    # an integer tensor is no weight: transformers would cast it into the float model
    (EXPERT, torch.int32, {}, f"tensor {EXPERT!r} is int32, the model is float32: an integer"),
    (EXPERT, torch.int8, {}, "is int8, the model is float32"),
    (NORM, torch.bool, {}, f"tensor {NORM!r} is bool, the model is float32"),
    (EXPERT, torch.float8_e4m3fn, {}, "is float8_e4m3fn, the model is float32: an fp8 tensor"),
    # a cast transformers would make that rounds
    (NORM, torch.float64, {}, "is float64, the model is float32: casting it to float32 "
                              "would lose precision"),
    (EXPERT, None, {"dtype": "bfloat16"}, "is float32, the model is bfloat16: casting it"),
    (EXPERT, None, {"dtype": ..., "torch_dtype": "float16"}, "the model is float16"),
])
def test_import_hf_refuses_dtypes_the_model_cannot_take(
        hf_dirs: dict[str, Path], tmp_path: Path, name: str, dtype: torch.dtype | None,
        config: dict[str, Any], expect: str) -> None:
    """Checked against the model's dtype (config.json's, as transformers builds the model
    in it) from the headers, before a store exists; one line naming the file and tensor."""
    model = hf_copy(hf_dirs, tmp_path)
    if dtype is not None:
        retype(model, name, dtype)
    edit_config(model, **config)
    line = hf_error(model, tmp_path)
    assert "model.safetensors" in line and expect in line, line


def test_import_hf_casts_what_widens_exactly(hf_dirs: dict[str, Path], tmp_path: Path) -> None:
    """A bf16 tensor in an fp32 model is stored as fp32, as transformers loads it; with no
    dtype in config.json the model takes the checkpoint's own."""
    from safetensors.torch import load_file

    model = hf_copy(hf_dirs, tmp_path)
    retype(model, EXPERT, torch.bfloat16)
    want = load_file(str(model / "model.safetensors"))[EXPERT].float()
    new_store(tmp_path / "st").close()
    cli_ok("import-hf", str(model), "--store", str(tmp_path / "st"))
    with tierstore.open(tmp_path / "st") as st:
        got = st.get("model.layers.0.mlp.experts.1.gate_up_proj")
        assert got.dtype == torch.float32 and torch.equal(got[:want.shape[0]], want)
    model = hf_copy(hf_dirs, tmp_path / "half")
    tensors = load_file(str(model / "model.safetensors"))
    save_file({k: t.half() for k, t in tensors.items()}, str(model / "model.safetensors"),
              metadata={"format": "pt"})
    edit_config(model, dtype=...)
    new_store(tmp_path / "st16").close()
    cli_ok("import-hf", str(model), "--store", str(tmp_path / "st16"))
    with tierstore.open(tmp_path / "st16") as st:
        assert st.info("model.layers.0.mlp.experts.1.gate_up_proj").dtype == torch.float16


@pytest.mark.parametrize("fname,data,expect", [
    ("tokenizer.json", b"\xff\xfe\x00 not text", "tokenizer.json does not load as a tokenizer"),
    ("tokenizer.json", b'{"version": "1.0"}', "tokenizer.json does not load as a tokenizer"),
    ("tokenizer.json", b"", "tokenizer.json does not load as a tokenizer"),
    ("tokenizer_config.json", b"{", "tokenizer_config.json: not JSON"),
    ("special_tokens_map.json", b"\xff", "special_tokens_map.json: not JSON"),
])
def test_import_hf_refuses_a_tokenizer_that_does_not_load(
        hf_dirs: dict[str, Path], tmp_path: Path, fname: str, data: bytes, expect: str) -> None:
    """The tokenizer is loaded (and encodes a line) at import, before a store exists."""
    model = hf_copy(hf_dirs, tmp_path)
    (model / fname).write_bytes(data)
    line = hf_error(model, tmp_path)
    assert str(model / fname) in line and expect in line, line


@pytest.mark.parametrize("fname,make,expect", [
    ("model.safetensors", "fifo", "a FIFO (named pipe), not a safetensors file"),
    ("config.json", "fifo", "a FIFO (named pipe), not a config file"),
    ("config.json", "dangling", "a symbolic link to nothing, not a config file"),
])
def test_import_hf_names_what_a_special_file_is(hf_dirs: dict[str, Path], tmp_path: Path,
                                                fname: str, make: str, expect: str) -> None:
    """A FIFO where a weight file or the config should be is refused by what it is
    (opening it would wait for a writer for ever)."""
    model = hf_copy(hf_dirs, tmp_path)
    (model / fname).unlink()
    if make == "fifo":
        os.mkfifo(model / fname)
    else:
        (model / fname).symlink_to(tmp_path / "nowhere")
    line = hf_error(model, tmp_path)
    assert str(model / fname) in line and expect in line, line


def test_import_hf_unreadable_files(hf_dirs: dict[str, Path], tmp_path: Path) -> None:
    model = hf_copy(hf_dirs, tmp_path)
    (model / "config.json").write_text("[1, 2]")
    assert "config is not a JSON object" in hf_error(model, tmp_path)
    (model / "config.json").write_text("{")
    assert "unreadable config" in hf_error(model, tmp_path)
    shutil.copy(hf_dirs["single"] / "config.json", model / "config.json")
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": "2"}))
    line = hf_error(model, tmp_path)
    assert "generation_config.json" in line and "eos_token_id" in line
    (model / "generation_config.json").write_text("{")
    assert "generation_config.json" in hf_error(model, tmp_path)
    (model / "generation_config.json").unlink()
    (model / "model.safetensors").write_bytes(b"\0" * 64)
    line = hf_error(model, tmp_path)
    assert "model.safetensors" in line and "unreadable safetensors" in line


def test_import_hf_bad_index(hf_dirs: dict[str, Path], tmp_path: Path) -> None:
    model = hf_copy(hf_dirs, tmp_path, "sharded")
    index = model / "model.safetensors.index.json"
    good = json.loads(index.read_text())
    index.write_text("{not json")
    assert "unreadable index" in hf_error(model, tmp_path)
    index.write_text(json.dumps({"weight_map": {"x": 1}}))
    assert "unreadable index" in hf_error(model, tmp_path)
    shard = sorted(set(good["weight_map"].values()))[-1]
    index.write_text(json.dumps(good))
    (model / shard).unlink()
    line = hf_error(model, tmp_path)
    assert shard in line and "missing" in line
    shutil.copy(hf_dirs["sharded"] / shard, model / shard)
    wm = dict(good["weight_map"])
    wm["model.norm.weight"] = next(f for f in sorted(set(wm.values()))
                                   if f != good["weight_map"]["model.norm.weight"])
    index.write_text(json.dumps({"weight_map": wm}))
    line = hf_error(model, tmp_path)
    assert wm["model.norm.weight"] in line and "lacks tensor 'model.norm.weight'" in line


HUGE = r"""
import json, resource, sys
from click.testing import CliRunner
from tierstore.cli import main
import tierstore.hf  # what the command imports, loaded before the baseline

def vm_kib():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmSize:"))

# A guard, should the check ever be lost: fail with MemoryError instead of taking the machine.
limit = (vm_kib() + 3 * 1024 * 1024) * 1024
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
r = CliRunner().invoke(main, ["import-hf", sys.argv[1], "--store", sys.argv[2]])
grew = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
print(json.dumps({"code": r.exit_code, "stderr": r.stderr, "grew_kib": grew,
                  "exception": repr(r.exception)}))
"""


@pytest.mark.parametrize("key", ["num_hidden_layers", "num_local_experts", "vocab_size"])
def test_import_hf_huge_config_allocates_nothing(hf_dirs: dict[str, Path], tmp_path: Path,
                                                 key: str) -> None:
    """The issue's example: num_hidden_layers 1e9 (and its siblings) fail at once with a
    clear error, peak memory unchanged, under an address-space limit."""
    model = hf_copy(hf_dirs, tmp_path)
    edit_config(model, **{key: 1_000_000_000})
    p = subprocess.run([sys.executable, "-c", HUGE, str(model), str(tmp_path / "st")],
                       cwd=ROOT, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(ROOT / "tests")})
    assert p.returncode == 0, p.stderr
    res = json.loads(p.stdout.strip().splitlines()[-1])
    assert res["code"] == 2, res
    lines = res["stderr"].strip().splitlines()
    assert len(lines) == 1 and f"{key} is 1000000000" in lines[0], res
    assert "config.json" in lines[0]
    assert res["grew_kib"] < 256 * 1024, res
    assert not (tmp_path / "st").exists()


def test_import_hf_still_imports_sharded(hf_dirs: dict[str, Path], tmp_path: Path) -> None:
    """The checks pass real checkpoints (read shard by shard)."""
    model = hf_copy(hf_dirs, tmp_path, "sharded")
    assert "imported mixtral" in cli_ok("import-hf", str(model), "--store", str(tmp_path / "st"))
    with tierstore.open(tmp_path / "st") as st:
        assert len(st.names("model.layers.")) == 3 * 6 * 2
