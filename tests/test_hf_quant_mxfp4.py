"""``import-hf --expert-format mxfp4`` (tierstore.hf.quant.quantize_mxfp4): each expert weight
of a bf16/fp32 checkpoint packed as gpt-oss ships it, rounded as ``transformers``'
``quantize_to_mxfp4`` (triton_kernels' ``downcast_to_mxfp_torch``, ``ROUND_UP`` scales)
rounds, for a family that holds its experts ``[out, in]`` (Mixtral) and one that holds them
``[in, out]`` (gpt-oss); served as ``transformers`` serves the dequantized weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from hf_models import ATOL, make_hf_model, prompt_ids
from hf_quant import export_fp32
from tierstore.hf import load
from tierstore.hf.quant import Dequantizer, as_module_holds, quantize_mxfp4

import tierstore
from tierstore.cli import main

pytest.importorskip("transformers")

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def _row(values: list[float]) -> list[float]:
    return values + [0.0] * (32 - len(values))


# (a group of 32 inputs, its E8M0 scale, each input's e2m1 code), worked by hand from the
# definition: scale 2^e, the least power of two >= amax / 6; code: the nearest e2m1 value
# of x / 2^e, a tie to the even code, past 6 to 6, the sign in bit 3 (-0 included).
CASES = [
    # amax 6: scale 1. Ties at each midpoint, either side of one, negatives, -0.
    (_row([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 0.0, -0.1, -0.25, 0.3, 4.9, 5.1,
           -5.0, -0.0, 0.74, 0.76]), 127,
     [0, 2, 2, 4, 4, 6, 6, 7, 0, 8, 8, 1, 6, 7, 14, 8, 1, 2]),
    # amax 7: 7/6 rounds up to 2; 7 -> 3.5 -> 4 (tie: even), 1.5 -> 0.75 -> 1, 0.5 -> 0.25 -> 0,
    # -3 -> -1.5.
    (_row([7.0, 1.5, 0.5, -3.0]), 128, [6, 2, 0, 11]),
    # amax 3: 3/6 = 0.5 exactly, kept; 3 -> 6, -0.375 -> -0.75 -> -1 (tie: even), 1 -> 2.
    (_row([3.0, -0.375, 1.0]), 126, [7, 10, 4]),
    # Nothing but zeros: scale byte 0, codes 0.
    (_row([]), 0, []),
]


def test_mxfp4_quantizer_rounds_as_transformers_and_round_trips_bit_for_bit() -> None:
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    w = torch.tensor([c[0] for c in CASES], dtype=torch.float32)  # [out 4, in 32]
    blocks, scales = quantize_mxfp4(w, transposed=False)
    assert blocks.shape == (4, 1, 16) and blocks.dtype == torch.uint8
    assert scales.tolist() == [[c[1]] for c in CASES]
    codes = torch.stack([blocks & 15, blocks >> 4], dim=-1).reshape(4, 32)
    for row, (_, _, want) in zip(codes.tolist(), CASES):
        assert row == want + [0] * (32 - len(want))
    # held [in, out] (gpt-oss) packs the same
    b2, s2 = quantize_mxfp4(w.t().contiguous(), transposed=True)
    assert torch.equal(b2, blocks) and torch.equal(s2, scales)

    # The round trip on a random tensor: our dequantization is transformers', bit for bit,
    # and packing what it gives again changes no value.
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 96, 64, generator=g) * torch.logspace(-3, 1, 64)  # [E, in, out]
    packed = [quantize_mxfp4(x[e], transposed=True) for e in range(2)]
    bl, sc = (torch.stack([p[i] for p in packed]) for i in (0, 1))
    assert bl.shape == (2, 64, 3, 16) and sc.shape == (2, 64, 3)
    for dt, bits in ((torch.float32, torch.int32), (torch.bfloat16, torch.int16)):
        want = convert_moe_packed_tensors(bl, sc, dtype=dt)
        deq = Dequantizer()
        for e in range(2):
            got = deq("mxfp4", bl[e], sc[e], dt)
            assert torch.equal(got.view(bits), want[e].contiguous().view(bits))
    again = quantize_mxfp4(want[0].float(), transposed=True)
    assert torch.equal(convert_moe_packed_tensors(again[0][None], again[1][None],
                                                  dtype=torch.float32)[0], want[0].float())
    assert float((want.float() - x).abs().max()) <= float(x.abs().max()) / 6


def _gpt_oss(out: Path) -> object:
    from hf_quant import _random_model, gpt_oss_config

    model = _random_model(gpt_oss_config(), "router.weight", 0).float().eval()
    model.save_pretrained(out)
    return model


@pytest.mark.parametrize("family", ["mixtral", "gpt_oss"])
def test_expert_format_mxfp4_serves_transformers_dequantized(family: str, tmp_path: Path) -> None:
    """Each expert weight stored as quantize_mxfp4 packs it (a quarter of bf16 and a byte
    per 32), biases as they are; every mode's logits and greedy tokens are transformers'
    model with those weights dequantized; export-hf writes the values it computes with."""
    hf = (make_hf_model(family, tmp_path / "hf", intermediate_size=64) if family == "mixtral"
          else _gpt_oss(tmp_path / "hf"))
    r = CliRunner().invoke(main, ["import-hf", str(tmp_path / "hf"), "--store",
                                  str(tmp_path / "st"), "--expert-format", "mxfp4"])
    assert r.exit_code == 0 and "mxfp4, kept packed" in r.output, r.output
    deq = Dequantizer()
    n = 0
    with tierstore.open(tmp_path / "st") as st:
        for name in st.names():
            if not name.endswith("_blocks"):
                continue
            base = name[: -len("_blocks")]
            module, e, attr = base.rsplit(".", 2)
            experts = hf.get_submodule(module)
            transposed = bool(experts.is_transposed)
            w = getattr(experts, attr)[int(e)].detach()
            blocks, scales = quantize_mxfp4(w, transposed)
            assert torch.equal(st.get(name), blocks) and torch.equal(st.get(base + "_scales"),
                                                                     scales)
            assert blocks.nbytes + scales.nbytes == w.numel() // 2 + w.numel() // 32
            with torch.no_grad():
                getattr(experts, attr)[int(e)] = as_module_holds(
                    deq("mxfp4", blocks, scales, torch.float32, reuse=False), "mxfp4",
                    transposed)
            n += 1
    assert n == 2 * hf.config.num_hidden_layers * hf.get_submodule(module).num_experts
    ids = prompt_ids(1, 8, hf.config.vocab_size)
    with torch.no_grad():
        want = hf(ids).logits
    tokens = hf.generate(ids, max_new_tokens=4, do_sample=False)
    for mode in ("resident", "expert", "ring"):
        model = load(tmp_path / "st", mode=mode, device="cpu", dtype=torch.float32)
        try:
            with torch.no_grad():
                torch.testing.assert_close(model(ids).logits, want, atol=ATOL, rtol=0)
            assert model.generate(ids, max_new_tokens=4, do_sample=False).tolist() == \
                tokens.tolist(), mode
        finally:
            model.tierstore.close()
    again = export_fp32(tmp_path / "st", tmp_path / "out")
    for name, p in hf.named_parameters():
        if ".experts." in name:
            assert torch.equal(again.get_parameter(name), p), name


def test_expert_format_mxfp4_refuses_inputs_not_in_groups_of_32(tmp_path: Path) -> None:
    make_hf_model("mixtral", tmp_path / "hf")  # intermediate 48: down_proj has 48 inputs
    r = CliRunner().invoke(main, ["import-hf", str(tmp_path / "hf"), "--store",
                                  str(tmp_path / "st"), "--expert-format", "mxfp4"])
    assert r.exit_code == 2 and len(r.output.strip().splitlines()) == 1, r.output
    assert "down_proj" in r.output and "32" in r.output
    assert not (tmp_path / "st").exists()
