"""The logit error of ``export-hf`` re-quantizing a fine-tuned quantized checkpoint
(:mod:`tierstore.hf.quant_train`): what packing the fp32 masters again changes in what the
model computes, beside the weight error (:class:`~tierstore.hf.quant_train.RoundTrip`).

The export is loaded as ``from_pretrained`` loads it, dequantized on the CPU in fp32
(``Mxfp4Config`` / ``FineGrainedFP8Config`` with ``dequantize=True``), and run once over
fixed token ids (:data:`PROMPTS` rows of :data:`TOKENS`, drawn from a seeded generator over
the vocabulary); then every re-quantized parameter is set to its fp32 master and the same
ids run again. The two models differ in the re-quantized weights only (the rest is the
export's, in its dtype), so the figures are the round trip's alone: zero where the masters
pack exactly (a store made trainable and never stepped).

This is the one part of an export that holds the whole model (fp32), where the export
itself holds a few entries: it is skipped, with the reason, where that model would take
more than half the memory this process may use (:func:`tierstore.memory_limit`), where
``transformers`` cannot load the export, or when asked (``export-hf --no-logit-error``).
"""

from __future__ import annotations

import math
import os
from typing import Any

import torch
from torch import Tensor

import tierstore

from .quant import FP8

PROMPTS, TOKENS = 2, 8  # a handful of positions: one cheap forward pass each way
SEED = 0


def model_bytes(want: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> int:
    """The fp32 model's bytes from its state dict's shapes."""
    return sum(4 * math.prod(shape) for shape, _ in want.values())


def prompt_ids(vocab: int) -> Tensor:
    return torch.randint(0, vocab, (PROMPTS, TOKENS),
                         generator=torch.Generator().manual_seed(SEED))


def _dequantizing(fmt: str) -> Any:
    from transformers import FineGrainedFP8Config, Mxfp4Config

    if fmt == FP8:
        return FineGrainedFP8Config(weight_block_size=(128, 128), dequantize=True)
    return Mxfp4Config(dequantize=True)


def logit_error(model_dir: str | os.PathLike[str], values: Any) -> dict[str, Any]:
    """Max and mean absolute logit error of the re-quantized export in ``model_dir`` against
    its fp32 masters (module docstring), and how many positions keep their greedy choice;
    or ``{"skipped": reason}``. ``values``: the exporter's, which reads the masters (each
    expert from the store that trained it)."""
    need, limit = model_bytes(values.want), tierstore.memory_limit()
    if 2 * need > limit:
        return {"skipped": f"the fp32 model ({tierstore.format_size(need)}) is more than half "
                           f"the memory this process may use ({tierstore.format_size(limit)})"}
    from transformers import AutoModelForCausalLM

    sm = values.sm
    try:
        model = AutoModelForCausalLM.from_pretrained(
            os.fspath(model_dir), dtype=torch.float32,
            quantization_config=_dequantizing(next(iter(sm.requantize.values())))).eval()
    except (ValueError, RuntimeError, OSError, ImportError) as e:
        # the export is written; a measurement transformers cannot make does not undo it
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return {"skipped": f"transformers did not load the export to measure it: {first}"}
    ids = prompt_ids(int(model.config.get_text_config().vocab_size))
    with torch.no_grad():
        packed = model(input_ids=ids, use_cache=False).logits
        for name in sm.requantize:
            model.get_parameter(name).copy_(_master(values, name))
        masters = model(input_ids=ids, use_cache=False).logits
    err = (packed - masters).abs()
    same = int((packed.argmax(-1) == masters.argmax(-1)).sum())
    return {"max_abs_logit_error": float(err.max()), "mean_abs_logit_error": float(err.mean()),
            "max_abs_logit": float(masters.abs().max()), "greedy_same": same,
            "positions": PROMPTS * TOKENS}


def _master(values: Any, name: str) -> Tensor:
    """Parameter ``name``'s fp32 master as the model holds it (a fused expert parameter
    stacked over its experts)."""
    if name not in values.experts:
        entry = values.sm.dense[name]
        return values._get([entry])[entry]
    m, parts, _ = values.experts[name]
    got = []
    for e in range(m.num_experts):
        entry = f"{m.prefix}.{e}.{parts[0]}"
        got.append(values._get([entry], values.owners.get((m.prefix, e)))[entry])
    return torch.stack(got)
