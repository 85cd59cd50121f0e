"""A full fine-tune of a quantized checkpoint (tierstore.hf.quant_train): the tiny gpt-oss in
MXFP4 and DeepSeek-V3 in block FP8 (tests/hf_quant.py), imported compact, fine-tuned over the
store under both update rules of ``ExpertAdamW`` exactly as ``transformers`` and
``torch.optim.AdamW`` train the dequantized fp32 model in memory; ``export-hf`` packs the
fp32 masters again in the checkpoint's own format, within the error it states, and
``from_pretrained`` loads it; a SIGKILL while the packed weights become masters, or in a
step, leaves the store fsck-clean and trainable."""

from __future__ import annotations

import json
import multiprocessing
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

import quant_train_child  # noqa: E402
import tierstore.hf  # noqa: E402
from hf_quant import deepseek_fp8, gpt_oss_mxfp4, reference  # noqa: E402
from safetensors import safe_open  # noqa: E402
from test_hf_finetune_families import ATOL, batches, over_the_store  # noqa: E402
from test_hf_finetune_families import reference as train_in_memory  # noqa: E402
from tierstore.hf.layout import stored_model  # noqa: E402
from tierstore.hf.quant import Dequantizer, as_module_holds, quantize  # noqa: E402
from tierstore.hf.quant_logits import PROMPTS, TOKENS, prompt_ids  # noqa: E402

import tierstore  # noqa: E402

MAKERS = {"gpt_oss": gpt_oss_mxfp4, "deepseek_v3": deepseek_fp8}
pytestmark = pytest.mark.usefixtures("one_thread")


def _masters(path: Path) -> dict[str, torch.Tensor]:
    """The store's fp32 masters by the model's names: fused expert parameters stacked."""
    with tierstore.open(path) as st:
        sm = stored_model(st)
        out = {}
        for m in sm.experts:
            for a, parts in m.params:
                out[f"{m.module}.{a}"] = torch.stack(
                    [st.get(f"{m.prefix}.{e}.{parts[0]}").clone() for e in range(m.num_experts)])
        for name, entry in sm.dense.items():
            out[name] = st.get(entry).clone()
        return out


def _tensors(out: Path) -> dict[str, torch.Tensor]:
    got: dict[str, torch.Tensor] = {}
    for f in sorted(out.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            got.update({k: h.get_tensor(k) for k in h.keys()})  # noqa: SIM118
    return got


@pytest.mark.parametrize("family", sorted(MAKERS))
def test_full_finetune_of_a_quantized_checkpoint(family: str, tmp_path: Path) -> None:
    ckpt = MAKERS[family](tmp_path / "hf")
    tierstore.hf.import_hf(ckpt, tmp_path / "packed", progress=False)
    hf = reference(ckpt)  # transformers' model, dequantized on the CPU, fp32
    data = batches(hf.config.vocab_size)
    fmt = "mxfp4" if family == "gpt_oss" else "fp8"
    for rule in ("dense", "lazy"):
        store = tmp_path / rule
        shutil.copytree(tmp_path / "packed", store)
        want_hist, want = train_in_memory(hf, rule, data)
        model, got_hist, _ = over_the_store(store, rule, data)
        for step, (a, b) in enumerate(zip(want_hist, got_hist, strict=True), 1):
            assert abs(a[0] - b[0]) <= ATOL, (family, rule, step, a, b)
            assert abs(a[1] - b[1]) <= ATOL * a[1], (family, rule, step, a, b)
        tierstore.hf.save(model)
        model.tierstore.close()
        masters = _masters(store)
        moved = 0.0
        start = dict(hf.named_parameters())
        for name, t in want.items():
            torch.testing.assert_close(masters[name], t, atol=ATOL, rtol=0, msg=name)
            moved = max(moved, float((t - start[name].detach()).abs().max()))
        assert moved > 10 * ATOL
        with tierstore.open(store) as st:
            assert st.fsck().ok
            sm = stored_model(st)
            assert sm.quant == fmt and not sm.dense_scales and all(not m.formats
                                                                   for m in sm.experts)
            # the packed entries are gone: masters only
            assert not [n for n in st.names() if n.endswith(("_blocks", "_scales",
                                                              "_scale_inv"))]

        # Export: every master packed again as the checkpoint ships it.
        summary = tierstore.hf.export_hf(store, tmp_path / f"out-{rule}", progress=False)
        rt = summary["requantized"]
        shipped, got = _tensors(ckpt), _tensors(tmp_path / f"out-{rule}")
        assert set(got) == set(shipped)
        assert json.loads((tmp_path / f"out-{rule}" / "config.json").read_text())[
            "quantization_config"] == json.loads((ckpt / "config.json").read_text())[
            "quantization_config"]
        experts = {n: hf.get_submodule(n.rsplit(".", 1)[0]) for n in masters if ".experts." in n}
        worst = 0.0
        for name, t in masters.items():
            if name not in sm.requantize:
                continue
            transposed = bool(getattr(experts.get(name), "is_transposed", False))
            parts = ("_blocks", "_scales") if fmt == "mxfp4" else ("", "_scale_inv")
            if name in experts and fmt == "fp8":
                continue  # per-expert tensors in the checkpoint: checked through the model
            q = [quantize(fmt, w, transposed) for w in (t if t.dim() == 3 else [t])]
            for i, suffix in enumerate(parts):
                want_q = torch.stack([x[i] for x in q]) if t.dim() == 3 else q[0][i]
                have = got[name + suffix]
                assert torch.equal(have.view(torch.uint8), want_q.view(torch.uint8)), name
        back = reference(tmp_path / f"out-{rule}")
        for name, p in back.named_parameters():
            if name in sm.requantize:
                worst = max(worst, float((p.detach() - masters[name]).abs().max()))
            else:  # in the checkpoint's dtype, bf16
                torch.testing.assert_close(p.detach(), masters[name].to(torch.bfloat16).to(
                    p.dtype), atol=0, rtol=0, msg=name)
        # The stated error is the round trip's, and it is the format's: MXFP4 a step of its
        # largest group's e2m1 grid, FP8 e4m3's three mantissa bits.
        assert worst == pytest.approx(rt["max_abs_weight_error"], rel=1e-6), (worst, rt)
        assert 0 < rt["relative"] < (0.2 if fmt == "mxfp4" else 0.07), rt
        # The stated logit error: the export as loaded against the same model holding the
        # masters, on the fixed ids; recorded in the index's metadata too.
        ids = prompt_ids(hf.config.vocab_size)
        with torch.no_grad():
            packed = back(ids).logits
            for name in sm.requantize:
                back.get_parameter(name).copy_(masters[name])
            err = (back(ids).logits - packed).abs()
        assert rt["max_abs_logit_error"] == pytest.approx(float(err.max()), rel=1e-5), rt
        assert rt["mean_abs_logit_error"] == pytest.approx(float(err.mean()), rel=1e-5), rt
        assert 0 < rt["mean_abs_logit_error"] < rt["max_abs_logit_error"], rt
        index = json.loads((tmp_path / f"out-{rule}" / "model.safetensors.index.json")
                           .read_text())
        assert index["metadata"]["tierstore_requantized"] == rt


def test_export_states_zero_logit_error_for_untouched_masters(tmp_path: Path) -> None:
    """Masters made by a trainable load and never stepped pack back to the shipped bytes:
    ``export-hf`` prints a weight and a logit error of 0; ``--no-logit-error`` says it
    skipped the logit error, in one line."""
    ckpt = gpt_oss_mxfp4(tmp_path / "hf")
    tierstore.hf.import_hf(ckpt, tmp_path / "st", progress=False)
    tierstore.hf.load(tmp_path / "st", trainable=True, device="cpu").tierstore.close()
    done = subprocess.run([sys.executable, "-m", "tierstore", "export-hf", str(tmp_path / "out"),
                           "--store", str(tmp_path / "st")], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "largest weight error 0 against" in done.stdout, done.stdout
    assert (f"logit error on {PROMPTS * TOKENS} fixed positions: max 0, mean 0 "
            in done.stdout), done.stdout
    assert _tensors(tmp_path / "out").keys() == _tensors(ckpt).keys()
    for name, t in _tensors(ckpt).items():
        assert torch.equal(_tensors(tmp_path / "out")[name].view(torch.uint8),
                           t.view(torch.uint8)), name
    rt = tierstore.hf.export_hf(tmp_path / "st", tmp_path / "out2", progress=False,
                                logit_error=False)["requantized"]
    assert rt["max_abs_weight_error"] == 0 and "max_abs_logit_error" not in rt
    assert "--no-logit-error" in rt["skipped"]


@pytest.fixture(scope="module")
def server() -> Any:
    """Processes forked from one that has imported torch, transformers and tierstore."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["quant_train_child",
                                "transformers.models.gpt_oss.modeling_gpt_oss"])
    return ctx


def _child(ctx: Any, store: Path, kill_at: int, count: Path) -> int:
    p = ctx.Process(target=quant_train_child.run, args=(str(store), kill_at, str(count)))
    p.start()
    p.join(300)
    assert p.exitcode is not None, f"kill at {kill_at} hung"
    return int(p.exitcode)


def test_a_kill_while_unpacking_or_stepping_leaves_the_store_sound(server: Any,
                                                                   tmp_path: Path) -> None:
    """SIGKILL at the Nth write (``put_many``, ``delete``) of a trainable load, two steps
    and a save: while the packed weights become masters (before the model's commit: the
    store is still the import, its packed experts intact), while the packed entries are
    dropped after it, and inside a step. Every time the store is fsck-clean and its model
    loads; killed before any step, a second run finishes and leaves masters only (a kill
    inside a step is resumed from a checkpoint, as for any store: test_hf_loop_resume.py)."""
    ckpt = gpt_oss_mxfp4(tmp_path / "hf")
    tierstore.hf.import_hf(ckpt, tmp_path / "packed", progress=False)
    shutil.copytree(tmp_path / "packed", tmp_path / "whole")
    assert _child(server, tmp_path / "whole", 0, tmp_path / "n") == 0
    total, first_delete = map(int, (tmp_path / "n").read_text().split())
    ref = reference(ckpt)
    deq = Dequantizer()
    for kill_at, stage in ((2, "unpack"), (first_delete + 1, "drop"), (total - 1, "step")):
        store = tmp_path / f"k{kill_at}"
        shutil.copytree(tmp_path / "packed", store)
        assert _child(server, store, kill_at, tmp_path / "c") == -signal.SIGKILL, kill_at
        with tierstore.open(store) as st:
            assert st.fsck().ok, stage
            sm = stored_model(st)
            assert any(m.formats for m in sm.experts) == (stage == "unpack"), stage
            if stage == "unpack":  # the import, as it was
                for m in sm.experts:
                    for a, parts in m.params:
                        if a in m.formats:
                            w = deq("mxfp4", *(st.get(f"{m.prefix}.0.{p}") for p in parts),
                                    torch.float32, reuse=False)
                            assert torch.equal(as_module_holds(w, "mxfp4", True), getattr(
                                ref.get_submodule(m.module), a)[0].detach())
        tierstore.hf.load(store, device="cpu").tierstore.close()
        if stage == "step":
            continue
        assert _child(server, store, 0, tmp_path / "c") == 0, stage
        with tierstore.open(store) as st:
            assert st.fsck().ok
            assert not [n for n in st.names() if n.endswith(("_blocks", "_scales"))]


def stored_model_of(path: Path) -> Any:
    with tierstore.open(path) as st:
        return stored_model(st)
