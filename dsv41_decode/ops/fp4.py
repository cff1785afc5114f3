"""E2M1 / MXFP4 / NVFP4 (and the MXFP8 block scale) as `@triton.jit` helpers, bit-exact with formats.py.

Every rounding is integer arithmetic on FP32 bits or an IEEE (`tl.div_rn`) operation, so the GPU
and Triton's interpreter give the same bits (architecture.md section 5). The helpers work on
blocks laid out as [..., block] tensors whose last axis is one scale block; callers that keep the
even and odd elements of a vector apart (RoPE pairs, nibble packing) pass both halves, each
[NB, block/2], and take the block maximum over both.
"""

from __future__ import annotations

import numpy as np
import triton
import triton.language as tl

from ..formats import E2M1_MAX, E4M3_MAX, MXFP4_AMAX_FLOOR, MXFP8_AMAX_FLOOR, NVFP4_AMAX_FLOOR
from .rounding import bf16_rne_bits, bf16_widen, e4m3_rne_code, ue8m0_to_fp32

# fp32(1/6) and fp32(1/448), the constants of the spec's power-of-two bit rule; exact as Python
# floats, so Triton's own FP32 conversion of the literals cannot change them.
INV_E2M1_MAX = tl.constexpr(float(np.float32(1.0 / E2M1_MAX)))
INV_E4M3_MAX = tl.constexpr(float(np.float32(1.0 / E4M3_MAX)))

__all__ = [
    "E2M1_MAX", "E4M3_MAX", "INV_E2M1_MAX", "INV_E4M3_MAX", "MXFP4_AMAX_FLOOR", "MXFP8_AMAX_FLOOR",
    "NVFP4_AMAX_FLOOR", "abs_nan_inf", "bf16_round", "e2m1_rne_code", "e4m3_code_to_fp32",
    "pow2_ceil_exponent", "pow2_inv", "nvfp4_scale_code", "e4m3_value", "e2m1_value",
    "mx_quant_pairs", "mx_dequant_pairs", "nvfp4_quant_pairs", "nvfp4_dequant_pairs",
]


@triton.jit
def bf16_round(x):
    """x rounded to BF16 (nearest even, `rounding.bf16_rne_bits`) and widened back to FP32 (exact)."""
    return bf16_widen(bf16_rne_bits(x))


@triton.jit
def abs_nan_inf(x):
    """|x| with NaN mapped to +inf: max's NaN handling differs between back ends, so a block holding
    a NaN is made to reach the same non-finite scale through inf."""
    ax = tl.abs(x)
    return tl.where(ax == ax, ax, float("inf"))


@triton.jit
def pow2_ceil_exponent(amax, INV_QMAX: tl.constexpr):
    """int32 k = ceil(log2(amax * fp32(INV_QMAX))) by the spec's bit rule (`formats.pow2_ceil_scale`).

    amax: positive FP32, floored so that the product is a normal FP32 (both MX floors ensure it).
    A product of inf gives 128 (scale byte 255, UE8M0's NaN).
    """
    p_bits = (amax * INV_QMAX).to(tl.int32, bitcast=True)
    return (p_bits >> 23) - 127 + ((p_bits & 0x7FFFFF) != 0).to(tl.int32)


@triton.jit
def pow2_inv(k):
    """FP32 2^-k for int32 k in [-126, 126] (larger k are clamped: their blocks are non-finite)."""
    return ((127 - tl.minimum(k, 126)) << 23).to(tl.float32, bitcast=True)


@triton.jit
def e2m1_rne_code(v):
    """uint8 E2M1 code (0..15) of FP32 v, as `formats.e2m1_encode`: nearest even on the grid
    {0, .5, 1, 1.5, 2, 3, 4, 6}, saturating past 6, sign bit kept (-0.0 and small negatives give 8),
    NaN gives 0."""
    a = tl.abs(v)
    mag = ((a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32)
           + (a >= 1.75).to(tl.int32) + (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32)
           + (a > 5.0).to(tl.int32))
    sign = (v.to(tl.uint32, bitcast=True) >> 28) & 8
    code = mag | sign.to(tl.int32)
    return tl.where(v == v, code, 0).to(tl.uint8)


@triton.jit
def e4m3_code_to_fp32(c):
    """FP32 value of non-negative E4M3 (fn) codes c (uint8 or int32, 0..127); 0x7F gives NaN."""
    c = c.to(tl.int32)
    e = c >> 3
    m = c & 7
    normal = ((e + 120) << 23 | (m << 20)).to(tl.float32, bitcast=True)
    sub = m.to(tl.float32) * 0.001953125  # m * 2^-9, exact
    value = tl.where(e == 0, sub, normal)
    return tl.where(c == 0x7F, float("nan"), value)


@triton.jit
def nvfp4_scale_code(amax, has_nan):
    """uint8 E4M3 code of the NVFP4 scale e4m3(max(amax, 6 * 2^-9) / 6), the division IEEE FP32.

    amax: FP32 block maximum of |x| (may be inf); has_nan: the block holds a NaN (code 0x7F, as
    formats.py's canonical NaN). Saturates at 448 (code 0x7E) like formats._e4m3.
    """
    s = tl.div_rn(tl.maximum(amax, 0.01171875), tl.full(amax.shape, 6.0, tl.float32))
    s = tl.minimum(s, 448.0)
    return tl.where(has_nan, 0x7F, e4m3_rne_code(s)).to(tl.uint8)


assert NVFP4_AMAX_FLOOR == 0.01171875  # the literal in nvfp4_scale_code


@triton.jit
def e4m3_value(code):
    """FP32 value of E4M3 (fn) codes 0..255 (sign bit 0x80); 0x7F and 0xFF give NaN."""
    c = code.to(tl.int32)
    mag = e4m3_code_to_fp32(c & 0x7F).to(tl.uint32, bitcast=True)
    # the sign through the bits: Triton's unary minus is 0 - x, which loses -0.0
    return (mag | ((c & 0x80).to(tl.uint32) << 24)).to(tl.float32, bitcast=True)


@triton.jit
def e2m1_value(code):
    """FP32 value of E2M1 codes 0..15 (bit 3 sign; magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6)."""
    c = code.to(tl.int32)
    e = (c >> 1) & 3
    m = c & 1
    normal = ((e + 126) << 23 | (m << 22)).to(tl.float32, bitcast=True)
    mag = tl.where(e == 0, m.to(tl.float32) * 0.5, normal).to(tl.uint32, bitcast=True)
    return (mag | ((c & 8).to(tl.uint32) << 28)).to(tl.float32, bitcast=True)


@triton.jit
def mx_quant_pairs(xe, xo, IS_FP8: tl.constexpr):
    """MX quantization (blocks = rows of the [NB, block/2] halves xe, xo, FP32) as formats.py's
    mxfp8_quantize (IS_FP8) or mxfp4_quantize: (even codes, odd codes, int32 scale bytes [NB]).
    A non-finite block gets scale byte 255 and codes 0x7F (MXFP8) or 0 (MXFP4), as formats.py."""
    amax = tl.maximum(tl.max(abs_nan_inf(xe), axis=1), tl.max(abs_nan_inf(xo), axis=1))
    if IS_FP8:
        k = pow2_ceil_exponent(tl.maximum(amax, MXFP8_FLOOR), INV_E4M3_MAX)
    else:
        k = pow2_ceil_exponent(tl.maximum(amax, MXFP4_FLOOR), INV_E2M1_MAX)
    scale_byte = tl.minimum(k + 127, 255)  # a finite amax gives at most 254
    inv = pow2_inv(k)[:, None]
    bad = scale_byte[:, None] == 255
    if IS_FP8:
        ce = e4m3_rne_code(tl.minimum(tl.maximum(xe * inv, -448.0), 448.0))
        co = e4m3_rne_code(tl.minimum(tl.maximum(xo * inv, -448.0), 448.0))
        ce = tl.where(bad, 0x7F, ce).to(tl.uint8)
        co = tl.where(bad, 0x7F, co).to(tl.uint8)
    else:
        ce = tl.where(bad, 0, e2m1_rne_code(xe * inv)).to(tl.uint8)
        co = tl.where(bad, 0, e2m1_rne_code(xo * inv)).to(tl.uint8)
    return ce, co, scale_byte


@triton.jit
def mx_dequant_pairs(ce, co, scale_byte, IS_FP8: tl.constexpr):
    """(even, odd) FP32 values of `mx_quant_pairs`' output (exact; NaN for scale byte 255)."""
    s = ue8m0_to_fp32(scale_byte)[:, None]
    if IS_FP8:
        return e4m3_value(ce) * s, e4m3_value(co) * s
    else:
        return e2m1_value(ce) * s, e2m1_value(co) * s


@triton.jit
def nvfp4_quant_pairs(xe, xo):
    """NVFP4 quantization (groups = rows of the [NG, 8] halves xe, xo, FP32) as formats.py's
    nvfp4_quantize: (even E2M1 codes, odd codes, uint8 E4M3 scale codes [NG])."""
    amax = tl.maximum(tl.max(abs_nan_inf(xe), axis=1), tl.max(abs_nan_inf(xo), axis=1))
    has_nan = (tl.sum((xe != xe).to(tl.int32), axis=1) + tl.sum((xo != xo).to(tl.int32), axis=1)) > 0
    code = nvfp4_scale_code(amax, has_nan)
    # div_rn does not broadcast (on the GPU): give it the full shape
    s = tl.broadcast_to(e4m3_code_to_fp32(code)[:, None], xe.shape)
    return e2m1_rne_code(tl.div_rn(xe, s)), e2m1_rne_code(tl.div_rn(xo, s)), code


@triton.jit
def nvfp4_dequant_pairs(ce, co, code):
    """(even, odd) FP32 values of `nvfp4_quant_pairs`' output (exact)."""
    s = e4m3_code_to_fp32(code)[:, None]
    return e2m1_value(ce) * s, e2m1_value(co) * s


MXFP8_FLOOR = tl.constexpr(MXFP8_AMAX_FLOOR)
MXFP4_FLOOR = tl.constexpr(MXFP4_AMAX_FLOOR)
