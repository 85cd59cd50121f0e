"""Quantized checkpoints kept as shipped (tierstore.hf.quant): a tiny gpt-oss in MXFP4 and a
tiny DeepSeek-V3 in 128x128 block FP8, quantized here (tests/hf_quant.py), imported compact
and served in every mode exactly as ``transformers`` serves the same checkpoint dequantized
on the CPU; each expert dequantized bit for bit as ``transformers`` dequantizes it; compact
bytes in the store, across the tier and in the host cache; the formats not kept refused in
one line; the export writes the packed tensors back as shipped."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from hf_models import ATOL, daemon_serving, prompt_ids
from hf_quant import deepseek_fp8, export_fp32, gpt_oss_mxfp4, reference
from safetensors import safe_open
from tierstore.hf import load
from tierstore.hf.layout import MODEL_ENTRY, read_json_entry
from tierstore.hf.quant import Dequantizer

import tierstore
from tierstore.cli import main

pytest.importorskip("transformers")

MAKERS = {"gpt_oss": gpt_oss_mxfp4, "deepseek_v3": deepseek_fp8}
MODES = ("expert", "on-demand", "ring", "resident")
NEW = 6
# One intra-op thread (see conftest.one_thread): a trained weight's 1e-5 holds on every CPU.
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module", params=sorted(MAKERS))
def imported(request: Any, tmp_path_factory: Any) -> tuple[str, Path, Path, Any]:
    """(family, checkpoint, store, transformers' model dequantized on the CPU)."""
    family = request.param
    root = tmp_path_factory.mktemp(family)
    ckpt = MAKERS[family](root / "hf")
    r = CliRunner().invoke(main, ["import-hf", str(ckpt), "--store", str(root / "st")])
    assert r.exit_code == 0, r.output
    assert "kept packed" in r.output
    return family, ckpt, root / "st", reference(ckpt)


def _checkpoint(ckpt: Path) -> dict[str, torch.Tensor]:
    return _checkpoint_file(ckpt / "model.safetensors")


def test_every_mode_gives_transformers_logits_and_tokens(imported: Any) -> None:
    family, _, store, ref = imported
    ids = prompt_ids(1, 8, ref.config.vocab_size)
    with torch.no_grad():
        want = ref(ids).logits
    tokens = ref.generate(ids, max_new_tokens=NEW, do_sample=False)
    for mode in MODES:
        model = load(store, mode=mode, device="cpu", dtype=torch.float32)
        try:
            assert model.tierstore.mode == mode
            with torch.no_grad():
                got = model(ids).logits
            torch.testing.assert_close(got, want, atol=ATOL, rtol=0, msg=f"{family} {mode}")
            out = model.generate(ids, max_new_tokens=NEW, do_sample=False)
            assert out.tolist() == tokens.tolist(), (family, mode)
        finally:
            model.tierstore.close()


def _transformers_dequantized(family: str, sd: dict[str, torch.Tensor], module: str, e: int,
                              attr: str, dtype: torch.dtype) -> torch.Tensor:
    """Expert ``e`` of fused parameter ``attr`` as transformers' own functions make it."""
    if family == "gpt_oss":
        from transformers.integrations.mxfp4 import convert_moe_packed_tensors

        whole = convert_moe_packed_tensors(sd[f"{module}.{attr}_blocks"],
                                           sd[f"{module}.{attr}_scales"], dtype=dtype)
        return whole[e]
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    deq = Fp8Dequantize(None)._dequantize_one
    names = ["gate_proj", "up_proj"] if attr == "gate_up_proj" else ["down_proj"]
    return torch.cat([deq(sd[f"{module}.{e}.{n}.weight"], sd[f"{module}.{e}.{n}.weight_scale_inv"],
                          output_dtype=dtype) for n in names])


def test_each_expert_dequantizes_as_transformers_does_bit_for_bit(imported: Any) -> None:
    family, ckpt, store, ref = imported
    sd = _checkpoint(ckpt)
    params = dict(ref.named_parameters())
    deq = Dequantizer()
    with tierstore.open(store) as st:
        info = read_json_entry(st, *MODEL_ENTRY)
        assert info["quant"] == ("mxfp4" if family == "gpt_oss" else "fp8")
        for m in info["experts"]:
            for attr, fmt in m["formats"].items():
                parts = dict(m["params"])[attr]
                for e in range(m["num_experts"]):
                    packed, scales = (st.get(f"{m['prefix']}.{e}.{p}") for p in parts)
                    for dt in (torch.bfloat16, torch.float32):
                        want = _transformers_dequantized(family, sd, m["module"], e, attr, dt)
                        got = deq(fmt, packed, scales, dt)  # the reused buffer, every time
                        assert got.dtype == want.dtype and got.shape == want.shape
                        bits = torch.int16 if dt == torch.bfloat16 else torch.int32
                        assert torch.equal(got.view(bits), want.contiguous().view(bits)), \
                            (m["module"], e, attr, dt)
                    # transformers' model of the checkpoint holds the same values.
                    assert torch.equal(got, params[f"{m['module']}.{attr}"][e].detach())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_every_code_and_scale_dequantizes_as_transformers_does(dtype: torch.dtype) -> None:
    """The lookup tables give transformers' bits for every packed byte under every E8M0
    exponent (MXFP4) and every e4m3 code, NaN included, under scales from tiny to
    overflowing (FP8), not only for the codes a tiny checkpoint happens to hold."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    bits = {2: torch.int16, 4: torch.int32}[dtype.itemsize]
    deq = Dequantizer()
    # Row r: exponent r on every group; the 16 groups of 16 bytes hold all 256 bytes.
    blocks = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(16, 16)
    blocks = torch.stack([blocks.roll(r, 0) for r in range(256)])
    scales = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(256, 1).expand(256, 16)
    want = convert_moe_packed_tensors(blocks[None], scales[None].contiguous(), dtype=dtype)[0]
    got = deq.mxfp4(blocks, scales.contiguous(), dtype)
    assert torch.equal(got.view(bits), want.view(bits))
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    weight = torch.stack([codes.roll(r) for r in range(256)]).view(torch.float8_e4m3fn)
    scale_inv = torch.tensor([[1e-30, 3.1e-3], [0.7, 3e38]], dtype=torch.float32)
    want = Fp8Dequantize(None)._dequantize_one(weight, scale_inv, output_dtype=dtype)
    for _ in range(2):  # the second call reuses the first's buffers
        got = deq.fp8(weight, scale_inv, dtype)
        assert torch.equal(got.view(bits), want.view(bits))


def _logical_bytes(ref: Any, module: str, dtype: torch.dtype) -> int:
    experts = ref.get_submodule(module)
    return sum(p[0].numel() for p in experts.parameters()) * dtype.itemsize


def test_the_store_holds_compact_bytes(imported: Any) -> None:
    """An expert's entries take the packed size: MXFP4 4.25 bits a weight (with its scales),
    FP8 8 bits and a scale per 128x128 block, against 16 bits in bf16."""
    family, _, store, ref = imported
    with tierstore.open(store) as st:
        info = read_json_entry(st, *MODEL_ENTRY)
        m = info["experts"][0]
        names = [f"{m['prefix']}.0.{p}" for _, parts in m["params"] for p in parts]
        compact = sum(st.info(n).nbytes for n in names)
        weights = {a for a in m["formats"]}
        bias = sum(st.info(f"{m['prefix']}.0.{a}").nbytes for a, _ in m["params"]
                   if a not in weights)
    experts = ref.get_submodule(m["module"])
    n_weights = sum(getattr(experts, a)[0].numel() for a in weights)
    bf16 = _logical_bytes(ref, m["module"], torch.bfloat16)
    if family == "gpt_oss":
        assert compact - bias == n_weights // 2 + n_weights // 32  # 4 bits + a byte per 32
        assert compact / bf16 < 0.3
    else:
        assert compact == n_weights + 4 * math.ceil(n_weights / 128 ** 2)
        assert compact / bf16 == pytest.approx(0.5, abs=0.01)


def test_compact_bytes_cross_the_tier_and_fill_the_cache(imported: Any) -> None:
    """One token through the model: each MoE layer reads its two routed experts, packed,
    from the backing tier into the host cache, which counts them packed."""
    family, _, store, ref = imported
    model = load(store, mode="on-demand", device="cpu", host_cache="32MiB")
    try:
        st = model.tierstore.store
        layer = next(iter(model.tierstore.served.layers.values()))
        one = sum(st.info(n).nbytes for n in layer.entry_names(0))
        before = st.stats()
        tier = next(iter(before["tiers"]))
        with torch.no_grad():
            model(prompt_ids(1, 1, ref.config.vocab_size))
        after = st.stats()
        n_moe = len(model.tierstore.served.moe_layers)
        read = after["tiers"][tier]["bytes_read"] - before["tiers"][tier]["bytes_read"]
        cached = after["cache"]["bytes_resident"] - before["cache"]["bytes_resident"]
        assert read == cached == n_moe * 2 * one
        assert model.tierstore.stats()["bytes_moved"] == n_moe * 2 * one
        assert one < 0.55 * _logical_bytes(ref, layer.module_name, torch.bfloat16)
    finally:
        model.tierstore.close()


def _one_line_refusal(model_dir: Path, store: Path) -> str:
    r = CliRunner().invoke(main, ["import-hf", str(model_dir), "--store", str(store)])
    assert r.exit_code == 2, r.output
    assert len(r.output.strip().splitlines()) == 1 and "Traceback" not in r.output, r.output
    assert not store.exists()
    return r.output


@pytest.mark.parametrize("method", ["bitsandbytes", "gptq", "awq", "compressed-tensors"])
def test_other_quantizations_are_refused_naming_the_method(tmp_path: Path, method: str) -> None:
    (tmp_path / "hf").mkdir()
    cfg = {"model_type": "mixtral", "quantization_config": {"quant_method": method}}
    (tmp_path / "hf" / "config.json").write_text(json.dumps(cfg))
    assert method in _one_line_refusal(tmp_path / "hf", tmp_path / "st")


def test_malformed_packed_tensors_are_refused_naming_them(tmp_path: Path) -> None:
    """A truncated scales tensor, a block grid that does not fit the weight, scales that
    are missing, another block size: one line each, naming the tensor, nothing stored."""
    from safetensors.torch import save_file

    ckpt = deepseek_fp8(tmp_path / "hf")
    path = ckpt / "model.safetensors"
    good = _checkpoint(ckpt)
    w = "model.layers.1.mlp.experts.2.down_proj.weight"
    cases = {
        "truncated": {**good, w + "_scale_inv": good[w + "_scale_inv"][:, :1].contiguous()},
        "grid": {**good, w + "_scale_inv": good[w + "_scale_inv"].reshape(2, 1)},
        "missing": {k: v for k, v in good.items() if k != w + "_scale_inv"},
    }
    for what, sd in cases.items():
        save_file(sd, str(path), metadata={"format": "pt"})
        assert w in _one_line_refusal(ckpt, tmp_path / "st"), what
    save_file(good, str(path), metadata={"format": "pt"})
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["quantization_config"]["weight_block_size"] = [64, 64]
    (ckpt / "config.json").write_text(json.dumps(cfg))
    assert "fp8" in _one_line_refusal(ckpt, tmp_path / "st")

    gpt = gpt_oss_mxfp4(tmp_path / "gpt")
    sd = _checkpoint(gpt)
    b = "model.layers.0.mlp.experts.down_proj_blocks"
    s = "model.layers.0.mlp.experts.down_proj_scales"
    save_file({**sd, s: sd[s][:, :-1].contiguous()}, str(gpt / "model.safetensors"), metadata={"format": "pt"})
    assert b in _one_line_refusal(gpt, tmp_path / "st")


def test_export_writes_the_packed_tensors_back_byte_for_byte(imported: Any,
                                                             tmp_path: Path) -> None:
    """export-hf of the compact store: every packed tensor and scale, and the
    quantization_config, as the checkpoint has them; transformers loads the export to the
    same dequantized experts."""
    family, ckpt, store, ref = imported
    out = tmp_path / "out"
    r = CliRunner().invoke(main, ["export-hf", "--store", str(store), str(out)])
    assert r.exit_code == 0, r.output
    was = _checkpoint(ckpt)
    got: dict[str, torch.Tensor] = {}
    for f in sorted(out.glob("*.safetensors")):
        got.update(_checkpoint_file(f))
    assert set(got) == set(was)
    packed = [k for k in was if k.endswith(("_blocks", "_scales", "_scale_inv"))
              or was[k].dtype == torch.float8_e4m3fn]
    assert len(packed) > 0
    for k in packed:
        assert got[k].dtype == was[k].dtype and got[k].shape == was[k].shape, k
        assert torch.equal(got[k].view(torch.uint8), was[k].view(torch.uint8)), k
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization_config"] == json.loads((ckpt / "config.json").read_text())[
        "quantization_config"]
    again = dict(reference(out).named_parameters())
    for name, p in ref.named_parameters():
        if ".experts." in name:
            assert torch.equal(again[name], p), name


def _checkpoint_file(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118  (not a dict)


def test_served_compact_through_the_daemon(imported: Any, tmp_path: Path) -> None:
    """Over a daemon's socket the packed entries cross its shared memory as they are and
    the tokens are transformers'."""
    family, _, store, ref = imported
    if family != "gpt_oss":
        pytest.skip("one format over the daemon: it moves entries whatever their dtype")
    with daemon_serving(store, tmp_path / "d.sock", "16MiB"):
        ids = prompt_ids(1, 8, ref.config.vocab_size)
        tokens = ref.generate(ids, max_new_tokens=NEW, do_sample=False)
        for mode in ("expert",):  # the prefetch queue's credits, the daemon's cache
            model = load(str(tmp_path / "d.sock"), mode=mode, device="cpu", dtype=torch.float32)
            try:
                assert model.tierstore.store.capabilities.remote
                out = model.generate(ids, max_new_tokens=NEW, do_sample=False)
                assert out.tolist() == tokens.tolist(), mode
                layer = next(iter(model.tierstore.served.layers.values()))
                one = sum(model.tierstore.store.info(n).nbytes for n in layer.entry_names(0))
                st = model.tierstore.stats()
                # Every cached expert crossed whole; a guess for a layer not routed to may
                # still be landing entry by entry, so only bounds are exact. Dequantized
                # entries would be ~7x bigger and break the upper bound.
                lo = st["cached_experts"] * one
                hi = (st["misses"] + st["spec_requested"]) * one
                assert 0 < lo <= st["bytes_moved"] <= hi, (mode, st, one)
            finally:
                model.tierstore.close()


def test_adapters_over_frozen_quantized_experts_train_as_in_memory(imported: Any) -> None:
    """Adapters (the attention weights) trained over the frozen packed experts get
    transformers' losses and weights, and the store is only read. The ring reuses its slots
    after each layer; the experts function dequantizes into fresh tensors under a backward."""
    import copy

    from test_hf_frozen_experts import STEPS, train, versions

    family, _, store, ref = imported
    ids = prompt_ids(2 * STEPS, 8, ref.config.vocab_size)
    mem = copy.deepcopy(ref)
    want = train(mem, ids)
    with tierstore.open(store) as st:
        before = versions(st)
    model = load(store, mode="ring", device="cpu", dtype=torch.float32)
    try:
        got = train(model, ids)
        writes = sum(t["writes"] for t in model.tierstore.store.stats()["tiers"].values())
    finally:
        model.tierstore.close()
    assert got == pytest.approx(want, abs=1e-5)
    trained = dict(model.named_parameters())
    for name, p in mem.named_parameters():
        if "self_attn" in name:
            torch.testing.assert_close(trained[name], p, atol=1e-5, rtol=0, msg=name)
    assert writes == 0
    with tierstore.open(store) as st:
        assert versions(st) == before


def test_expert_format_fp8_quantizes_a_bf16_checkpoint_at_import(tmp_path: Path) -> None:
    """import-hf --expert-format fp8 of a bf16 checkpoint stores each expert's weights as
    transformers' Fp8Quantize makes them (half the bytes), serves transformers' model with
    those weights dequantized, and exports the values it computes with; quantizing an
    already quantized checkpoint is one line."""
    from types import SimpleNamespace

    from hf_quant import _random_model, deepseek_config
    from transformers import FineGrainedFP8Config
    from transformers.integrations.finegrained_fp8 import Fp8Quantize

    hf = _random_model(deepseek_config(), "mlp.gate.weight", 0).float()
    hf.save_pretrained(tmp_path / "hf")
    r = CliRunner().invoke(main, ["import-hf", str(tmp_path / "hf"), "--store",
                                  str(tmp_path / "st"), "--expert-format", "fp8"])
    assert r.exit_code == 0 and "fp8, kept packed" in r.output, r.output
    quantize = Fp8Quantize(SimpleNamespace(
        quantization_config=FineGrainedFP8Config(weight_block_size=(128, 128))))._quantize_one
    deq = Dequantizer()
    module = "model.layers.1.mlp.experts"
    experts = hf.get_submodule(module)
    with tierstore.open(tmp_path / "st") as st:
        info = read_json_entry(st, *MODEL_ENTRY)
        assert info["quant"] == "fp8" and info["quantized_at_import"]
        for attr in ("gate_up_proj", "down_proj"):
            for e in range(experts.num_experts):
                w = getattr(experts, attr)[e].detach()
                want = quantize("x.weight", w)
                q, s = st.get(f"{module}.{e}.{attr}"), st.get(f"{module}.{e}.{attr}_scale_inv")
                assert torch.equal(q.view(torch.uint8), want["x.weight"].view(torch.uint8))
                assert torch.equal(s, want["x.weight_scale_inv"])
                assert q.nbytes + s.nbytes < 0.26 * w.nbytes  # against fp32
                with torch.no_grad():
                    getattr(experts, attr)[e] = deq.fp8(q, s, torch.float32)
    ids = prompt_ids(1, 8, hf.config.vocab_size)
    model = load(tmp_path / "st", mode="resident", device="cpu", dtype=torch.float32)
    try:
        with torch.no_grad():
            torch.testing.assert_close(model(ids).logits, hf(ids).logits, atol=ATOL, rtol=0)
    finally:
        model.tierstore.close()
    again = export_fp32(tmp_path / "st", tmp_path / "out")
    for attr in ("gate_up_proj", "down_proj"):
        assert torch.equal(getattr(again.get_submodule(module), attr), getattr(experts, attr))
    ckpt = gpt_oss_mxfp4(tmp_path / "gpt")
    for fmt, words in (("fp8", "already quantized"), ("mxfp4", "already quantized")):
        r = CliRunner().invoke(main, ["import-hf", str(ckpt), "--store", str(tmp_path / "s2"),
                                      "--expert-format", fmt])
        assert r.exit_code == 2 and len(r.output.strip().splitlines()) == 1, r.output
        assert words in r.output
