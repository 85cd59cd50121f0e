"""Quantized checkpoints kept as shipped: gpt-oss's MXFP4 experts and DeepSeek-V3's 128x128
block FP8 (also Qwen3-FP8, GLM-4.5-FP8, Kimi-K2).

A checkpoint's ``quantization_config`` names its method (:func:`quant_method`); the two
above are imported compact, any other is refused in one line naming it. For the import's
plan (``transformers``' conversion mapping, :mod:`tierstore.hf.convert`) each quantized
tensor stands in as the weight it dequantizes to (:func:`fold`): its packed tensor and its
scales are then converted one expert at a time through the same converter, each on its
own, and stored as entries of their own beside each other (:data:`SUFFIXES`).

Dequantization is thin torch code that runs on whatever device the packed bytes are on,
into a buffer reused from call to call (:class:`Dequantizer`), and gives exactly what
``transformers`` gives:

* MXFP4: ``transformers.integrations.mxfp4.convert_moe_packed_tensors`` (its e2m1 table,
  ``ldexp`` by the E8M0 exponent, the transpose to ``[in, out]``), mirrored one expert at
  a time, both nibbles of a byte looked up at once in a 256-entry table of pairs of its
  values;
* FP8: ``Fp8Dequantize._dequantize_one`` of ``transformers.integrations.finegrained_fp8``
  (fp32 product of the e4m3 weight and its block's ``weight_scale_inv``, then the cast),
  mirrored, since it is a private method.

``tests/test_hf_quant.py`` checks both against ``transformers``' own, bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from .checkpoint import HFImportError, TensorHeader

MXFP4 = "mxfp4"
FP8 = "fp8"
FP8_BLOCK = 128
# Entry-name suffixes of a quantized parameter's two tensors: (packed, scales).
SUFFIXES = {MXFP4: ("_blocks", "_scales"), FP8: ("", "_scale_inv")}
PACKED_DTYPES = {MXFP4: torch.uint8, FP8: torch.float8_e4m3fn}
SCALE_DTYPES = {MXFP4: torch.uint8, FP8: torch.float32}
E2M1 = (+0.0, +0.5, +1.0, +1.5, +2.0, +3.0, +4.0, +6.0,
        -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def quant_method(hf: dict[str, Any], where: str) -> str | None:
    """The quantization a ``config.json`` declares, if any: :data:`MXFP4` or :data:`FP8`
    (128x128 blocks, e4m3); :class:`HFImportError` naming any other."""
    quant = hf.get("quantization_config")
    if quant is None:
        return None
    family = hf.get("model_type", "model")
    if not isinstance(quant, dict):
        raise HFImportError(f"{where}: quantization_config is not an object; use the model's "
                            "original config.json")
    method = quant.get("quant_method")
    if method == MXFP4:
        return MXFP4
    if method == FP8:
        block = quant.get("weight_block_size")
        fmt = quant.get("fmt", "e4m3")
        if block != [FP8_BLOCK, FP8_BLOCK] or fmt != "e4m3":
            raise HFImportError(f"{where}: a {family} checkpoint in fp8 with blocks {block!r} "
                                f"and format {fmt!r}: tierstore imports fp8 in 128x128 blocks of "
                                "e4m3 (as DeepSeek ships it); import the bf16 weights")
        return FP8
    raise HFImportError(f"{where}: a {family} checkpoint quantized with {method or 'an unnamed method'}: "
                        "tierstore imports mxfp4 (gpt-oss) and 128x128 block fp8 (DeepSeek-V3) "
                        "checkpoints; import the checkpoint's bf16 or fp32 weights")


@dataclass
class QuantSource:
    """A checkpoint weight held quantized: its packed tensor and its scales."""

    packed: str
    scales: str
    format: str


def _st_code(dtype: torch.dtype) -> str:
    from .shards import ST_CODES

    return ST_CODES[dtype]


def fold(heads: dict[str, TensorHeader], method: str, dtype: torch.dtype
         ) -> tuple[dict[str, TensorHeader], dict[str, QuantSource]]:
    """The checkpoint's headers as the plan sees them (each quantized weight as the
    ``dtype`` tensor it dequantizes to, its scales gone), and those weights' sources.
    Every packed tensor's scales must be there with the shape its blocks imply; each misfit
    is one line naming the tensor."""
    fix = "re-download the checkpoint or save it again"
    out = dict(heads)
    quant: dict[str, QuantSource] = {}
    if method == MXFP4:
        for key, h in heads.items():
            if not key.endswith("_blocks"):
                continue
            base = key[: -len("_blocks")]
            s = heads.get(base + "_scales")
            if s is None:
                raise HFImportError(f"{h.path}: {key} has no {base}_scales beside it; {fix}")
            if h.dtype != "U8" or s.dtype != "U8" or len(h.shape) != 4 or h.shape[-1] != 16 \
                    or list(s.shape) != list(h.shape[:-1]):
                raise HFImportError(f"{h.path}: {key} {h.dtype} {h.shape} and its scales "
                                    f"{s.dtype} {s.shape} are not MXFP4 blocks [E, rows, groups, "
                                    f"16] with uint8 scales [E, rows, groups]; {fix}")
            e, rows, groups, _ = h.shape
            # transformers dequantizes [E, rows, groups * 32] and transposes the last two.
            out[base] = TensorHeader(h.path, _st_code(dtype), [e, groups * 32, rows])
            del out[key], out[base + "_scales"]
            quant[base] = QuantSource(key, base + "_scales", MXFP4)
    else:
        for key, h in heads.items():
            if h.dtype != "F8_E4M3":
                continue
            s = heads.get(key + "_scale_inv")
            if s is None:
                raise HFImportError(f"{h.path}: fp8 tensor {key} has no {key}_scale_inv beside "
                                    f"it; {fix}")
            ok = len(h.shape) == 2 and all(d % FP8_BLOCK == 0 for d in h.shape)
            want = [d // FP8_BLOCK for d in h.shape] if ok else None
            if not ok or s.dtype != "F32" or list(s.shape) != want:
                raise HFImportError(f"{h.path}: fp8 tensor {key} {h.shape} with scales "
                                    f"{s.dtype} {s.shape}: tierstore reads 2-D weights of "
                                    f"whole 128x128 blocks, one fp32 scale each; {fix}")
            out[key] = TensorHeader(h.path, _st_code(dtype), list(h.shape))
            del out[key + "_scale_inv"]
            quant[key] = QuantSource(key, key + "_scale_inv", FP8)
    return out, quant


# Operations a quantized expert parameter may be converted with, packed and scales alike:
# stacking experts and joining projections along a side of whole blocks keep each scale
# over its own block.
QUANT_OPS = {FP8: ("MergeModulelist", "Concatenate"), MXFP4: ()}


def check_ops(family: str, target: str, transform: Any, fmt: str) -> None:
    for op in getattr(transform, "operations", []):
        if type(op).__name__ not in QUANT_OPS[fmt]:
            raise HFImportError(f"{family}: transformers builds {target} with "
                                f"{type(op).__name__}, which tierstore cannot apply to {fmt} "
                                "weights kept packed; import the checkpoint's bf16 weights")


def parts(attr: str, fmt: str) -> list[str]:
    """The entry suffixes of quantized parameter ``attr``: packed, then scales."""
    return [attr + s for s in SUFFIXES[fmt]]


def packed_shapes(fmt: str, logical: list[int], transposed: bool = True
                  ) -> tuple[list[int], list[int]]:
    """One expert's packed and scales shapes for a parameter of ``logical`` shape (as
    ``transformers`` holds it dequantized; ``transposed``: ``[in, out]``, as gpt-oss)."""
    if fmt == MXFP4:
        # The blocks run along the input: [out, in / 32, 16] whichever way the module holds it.
        inner, rows = logical if transposed else logical[::-1]
        return [rows, inner // 32, 16], [rows, inner // 32]
    return list(logical), [logical[0] // FP8_BLOCK, logical[1] // FP8_BLOCK]


FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)


def quantize_fp8(w: Tensor) -> tuple[Tensor, Tensor]:
    """``w [R, C]`` (sides multiples of 128) as e4m3 and one fp32 ``weight_scale_inv`` per
    128x128 block: ``Fp8Quantize._quantize_one`` of ``transformers`` (a private method,
    mirrored), what ``from_pretrained`` with ``FineGrainedFP8Config`` makes of a bf16 or
    fp32 weight."""
    rows, cols = w.shape
    blocks = w.to(torch.float32).reshape(rows // FP8_BLOCK, FP8_BLOCK, cols // FP8_BLOCK,
                                         FP8_BLOCK)
    max_abs = blocks.abs().amax(dim=(-3, -1))
    scales = FP8_MAX / torch.where(max_abs > 0, max_abs, torch.ones_like(max_abs))
    scales = torch.where(max_abs > 0, scales, torch.ones_like(scales))  # zeros stay zeros
    inv = (1.0 / scales).to(torch.float32)
    q = torch.clamp(blocks * scales.unsqueeze(-1).unsqueeze(-3), min=-FP8_MAX, max=FP8_MAX)
    return q.to(torch.float8_e4m3fn).reshape(rows, cols), inv


MXFP4_GROUP = 32


def quantize_mxfp4(w: Tensor, transposed: bool = True) -> tuple[Tensor, Tensor]:
    """One expert weight as gpt-oss ships it: ``blocks [out, in/32, 16]`` uint8 (two e2m1
    codes a byte, the even input in the low nibble) and E8M0 ``scales [out, in/32]`` (bias
    127), from ``w`` held ``[in, out]`` (``transposed``, as gpt-oss) or ``[out, in]``.

    What ``transformers``' ``quantize_to_mxfp4`` makes of a weight: the weight cast to
    bf16, then ``triton_kernels``' ``downcast_to_mxfp_torch`` (``numerics_details/mxfp.py``,
    rounding mode ``ROUND_UP``), re-derived here since neither is importable without the
    kernels hub: each group of 32 inputs takes the scale ``2^e``, the smallest power of two
    not below ``amax / 6`` as fp32 rounds it (6 is e2m1's largest, so nothing clips), and
    each value ``x * 2^-e`` rounds to the nearest e2m1 value, ties to the even code, beyond
    6 to 6, a negative value that rounds to zero to -0."""
    m = (w.t() if transposed else w).to(torch.bfloat16).to(torch.float32)
    rows, cols = m.shape
    g = m.reshape(rows, cols // MXFP4_GROUP, MXFP4_GROUP)
    d = g.abs().amax(-1) / 6.0
    # Round the fp32 scale up to a power of two on its bits: the exponent field is E8M0.
    bits = ((d.view(torch.int32) + 0x007FFFFF) & 0x7F800000)
    scale = bits.view(torch.float32)
    inv = torch.where(scale == 0, torch.zeros_like(scale), 1.0 / scale)
    x = g * inv.unsqueeze(-1)
    a = x.abs()
    # Code = how many of e2m1's midpoints |x| passes; at a tie (=) the even code wins:
    # 0.25 -> 0, 0.75 -> 1.0 (code 2), 1.25 -> 1.0, 1.75 -> 2.0 (4), 2.5 -> 2.0, 3.5 -> 4.0
    # (6), 5 -> 4.0.
    code = ((a > 0.25).to(torch.uint8) + (a >= 0.75) + (a > 1.25) + (a >= 1.75) + (a > 2.5)
            + (a >= 3.5) + (a > 5.0))
    code = code | (torch.signbit(x).to(torch.uint8) << 3)
    code = code.reshape(rows, cols // MXFP4_GROUP, MXFP4_GROUP // 2, 2)
    blocks = code[..., 0] | (code[..., 1] << 4)
    return blocks.contiguous(), (bits >> 23).to(torch.uint8)


def quantize(fmt: str, w: Tensor, transposed: bool = False) -> tuple[Tensor, Tensor]:
    """One expert weight (or a dense fp8 one) packed in ``fmt``: (packed, scales)."""
    if fmt == MXFP4:
        return quantize_mxfp4(w, transposed)
    return quantize_fp8(w)


def as_module_holds(w: Tensor, fmt: str, transposed: bool) -> Tensor:
    """A weight the :class:`Dequantizer` gave, as its module holds it: MXFP4 dequantizes
    to ``[in, out]`` (gpt-oss's, ``transformers``' function); a module that holds
    ``[out, in]`` takes its transpose, a view (``F.linear`` reads it as it is)."""
    return w.t() if fmt == MXFP4 and not transposed else w


# The integer type that holds a pair of values of each dtype's size: a pair table gathered
# through it moves both nibbles' values in one element.
_PAIR_INTS = {2: torch.int32, 4: torch.int64}


class Dequantizer:
    """Dequantizes one expert's packed weight into a buffer kept for the next call of the
    same shape, dtype and device (the experts function uses it before the next expert).

    Both formats are table lookups on the packed bytes, one gather each. The tables are
    made on the device with ``transformers``' own operations over every code (and every
    E8M0 exponent), so each value is the one ``transformers`` computes for that code:

    * MXFP4: for every exponent ``s`` and byte ``b``, the pair (low nibble, high nibble)
      that ``convert_moe_packed_tensors`` gives (``lut[nibble]`` in the dtype, then
      ``torch.ldexp`` by ``s - 127``); the index is ``s * 256 + b``, so the ``ldexp`` pass
      over the weights goes. 256 x 256 pairs: 256 KiB in bf16.
    * FP8: e4m3's 256 codes as fp32 (``.to(float32)`` of each code; that cast is slow
      elementwise on a CPU), times the block's scale in fp32, then cast to the dtype.
    """

    def __init__(self) -> None:
        self._buffers: dict[tuple[Any, ...], Tensor] = {}
        self._luts: dict[tuple[Any, ...], Tensor] = {}

    def _buffer(self, tag: str, shape: tuple[int, ...], dtype: torch.dtype,
                device: torch.device, reuse: bool) -> Tensor:
        if not reuse:
            return torch.empty(shape, dtype=dtype, device=device)
        key = (tag, shape, dtype, device)
        buf = self._buffers.get(key)
        if buf is None:
            buf = self._buffers[key] = torch.empty(shape, dtype=dtype, device=device)
        return buf

    def _scratch(self, tag: str, shape: tuple[int, ...], dtype: torch.dtype,
                 device: torch.device, reuse: bool) -> Tensor:
        """A buffer for what is dead once the call returns: one per tag, grown to the
        largest call, so the projections of an expert share it."""
        n = 1
        for d in shape:
            n *= d
        if not reuse:
            return torch.empty(shape, dtype=dtype, device=device)
        key = (tag, dtype, device)
        buf = self._buffers.get(key)
        if buf is None or buf.numel() < n:
            buf = self._buffers[key] = torch.empty(n, dtype=dtype, device=device)
        return buf[:n].view(shape)

    def __call__(self, fmt: str, packed: Tensor, scales: Tensor, dtype: torch.dtype, *,
                 reuse: bool = True) -> Tensor:
        if fmt == MXFP4:
            return self.mxfp4(packed, scales, dtype, reuse=reuse)
        return self.fp8(packed, scales, dtype, reuse=reuse)

    def _mxfp4_pairs(self, dtype: torch.dtype, dev: torch.device) -> Tensor:
        """``[256 * 256, 2]``: row ``s * 256 + b`` holds byte ``b``'s two values (the low
        nibble first) under E8M0 exponent ``s``, as ``convert_moe_packed_tensors`` makes
        them."""
        pairs = self._luts.get(("mxfp4", dtype, dev))
        if pairs is None:
            lut = torch.tensor(E2M1, dtype=dtype, device=dev)
            exp = torch.arange(256, dtype=torch.int32, device=dev).view(256, 1) - 127
            values = lut.expand(256, 16).contiguous()
            torch.ldexp(values, exp, out=values)  # [exponent, nibble]
            byte = torch.arange(256, device=dev)
            pairs = torch.stack([values[:, byte & 15], values[:, byte >> 4]], dim=-1)
            pairs = self._luts[("mxfp4", dtype, dev)] = pairs.reshape(256 * 256, 2)
        return pairs

    def mxfp4(self, blocks: Tensor, scales: Tensor, dtype: torch.dtype, *,
              reuse: bool = True) -> Tensor:
        """``blocks [rows, G, 16]`` uint8 and E8M0 ``scales [rows, G]`` as ``[G * 32, rows]``
        in ``dtype``: ``convert_moe_packed_tensors`` of one expert."""
        rows, groups, width = blocks.shape
        dev = blocks.device
        pairs = self._mxfp4_pairs(dtype, dev)
        n = rows * groups * width
        index = self._scratch("mxfp4-index", (rows, groups, width), torch.int32, dev, reuse)
        index.copy_(blocks)
        index.add_(scales.to(torch.int32).mul_(256).unsqueeze(-1))  # s * 256 + b
        work = self._scratch("mxfp4", (rows, groups * width * 2), dtype, dev, reuse)
        pair_int = _PAIR_INTS.get(pairs.element_size())
        if pair_int is not None:  # one element a pair: the fastest gather torch has
            torch.index_select(pairs.view(pair_int).view(-1), 0, index.view(n),
                               out=work.view(pair_int).view(n))
        else:
            torch.index_select(pairs, 0, index.view(n), out=work.view(n, 2))
        out = self._buffer("mxfp4-t", (groups * width * 2, rows), dtype, dev, reuse)
        out.copy_(work.t())
        return out

    def fp8(self, weight: Tensor, scale_inv: Tensor, dtype: torch.dtype, *,
            reuse: bool = True) -> Tensor:
        """e4m3 ``weight [R, C]`` times its blocks' fp32 ``scale_inv [R/b, C/b]``, in fp32,
        cast to ``dtype``: ``Fp8Dequantize._dequantize_one``."""
        rows, cols = weight.shape
        sr, sc = scale_inv.shape
        dev = weight.device
        lut = self._luts.get(("fp8", dev))
        if lut is None:
            codes = torch.arange(256, dtype=torch.int32, device=dev).to(torch.uint8)
            lut = self._luts[("fp8", dev)] = codes.view(torch.float8_e4m3fn).to(torch.float32)
        index = self._scratch("fp8-index", (rows * cols,), torch.int32, dev, reuse)
        index.copy_(weight.view(torch.uint8).reshape(rows * cols))
        # fp32 is returned as it is (kept per shape); for another dtype it is scratch
        work = (self._buffer if dtype == torch.float32 else self._scratch)(
            "fp8", (rows, cols), torch.float32, dev, reuse)
        torch.index_select(lut, 0, index, out=work.view(rows * cols))
        q = work.view(sr, rows // sr, sc, cols // sc)
        torch.mul(q, scale_inv.to(torch.float32).view(sr, 1, sc, 1), out=q)
        if dtype == torch.float32:
            return work
        # A separate cast: a product written straight into bf16 rounds the same but runs
        # an order of magnitude slower on a CPU.
        out = self._buffer("fp8-out", (rows, cols), dtype, dev, reuse)
        out.copy_(work)
        return out

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())
