"""Bit-exact roundings (and their inverses) as `@triton.jit` helpers: the same bits on the GPU and in
Triton's interpreter. The E2M1 / MX / NVFP4 block helpers, built on these, are in `fp4.py`.

The interpreter truncates FP32 -> BF16 and mis-rounds FP32 -> E4M3 (architecture.md section 5), so
every rounding that must match `formats.py` or torch's casts is done here with integer arithmetic
on the FP32 bits, which both back ends evaluate identically.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def bf16_rne_bits(x):
    """int16 bits of bf16(x), rounded to nearest even, as torch's `.to(torch.bfloat16)` gives them.

    x: FP32 tensor. +-inf stay +-inf; values past the largest BF16 round to +-inf; a NaN becomes the
    quiet NaN 0x7FC0 (torch's own casts disagree on NaN bits: 0xFFFF on the CPU, 0x7FFF on CUDA). Store the result into a BF16 tensor passed as `t.view(torch.int16)`.
    """
    bits = x.to(tl.uint32, bitcast=True)
    # Adding 0x7FFF plus the lowest kept bit carries into the kept bits exactly when the dropped
    # half is above the midpoint, or at it with an odd kept part: round half to even. No overflow:
    # the largest non-NaN pattern, 0xFF800000 (-inf), stays below 2^32.
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    is_nan = (bits & 0x7FFFFFFF) > 0x7F800000
    rounded = tl.where(is_nan, 0x7FC0, rounded)
    return rounded.to(tl.uint16).to(tl.int16, bitcast=True)


@triton.jit
def bf16_widen(bits):
    """FP32 value of BF16 bits held as int16 (exact): the inverse of `bf16_rne_bits`."""
    return (bits.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)


@triton.jit
def to_f32(x):
    """x as FP32, exactly: a BF16 tensor widened from its bits (`bf16_widen`), any other dtype by
    `.to(tl.float32)`. Triton 3.6's interpreter widens BF16 subnormals wrongly in its own conversion
    (5.877e-39 -> 0.0, 1.01e-39 -> 4.41e-39); the GPU's is exact, and both agree on this form."""
    if x.dtype == tl.bfloat16:
        return bf16_widen(x.to(tl.int16, bitcast=True))
    else:
        return x.to(tl.float32)


@triton.jit
def e4m3_rne_code(x):
    """uint8 E4M3 (fn) code of x, rounded to nearest even, as torch's `.to(torch.float8_e4m3fn)`.

    x: FP32 tensor already clamped to [-448, 448] (unchecked: larger magnitudes give wrong codes).
    Subnormals (|x| < 2^-6) are rounded exactly; the sign bit is kept, also for -0.0 and for values
    that round to zero; a NaN gives the canonical NaN code 0x7F (as `formats.mxfp8_quantize`).
    """
    bits = x.to(tl.uint32, bitcast=True)
    sign = ((bits >> 24) & 0x80).to(tl.uint8)
    mag_bits = bits & 0x7FFFFFFF
    a = mag_bits.to(tl.float32, bitcast=True)
    # Normal range: keep 3 of the 23 mantissa bits, half to even, then rebias the exponent from
    # 127 to 7 (a carry out of the mantissa correctly bumps the exponent).
    rounded = (mag_bits + 0x7FFFF + ((mag_bits >> 20) & 1)) >> 20
    normal = rounded.to(tl.int32) - ((127 - 7) << 3)
    # Subnormal range: the code is |x| / 2^-9 rounded to an integer (0..8; 8 is 2^-6, the first
    # normal code). |x| * 2^9 is exact; adding and subtracting 2^23 rounds it half to even in FP32.
    q = a * 512.0
    q = (q + 8388608.0) - 8388608.0
    subnormal = q.to(tl.int32)
    mag = tl.where(a < 0.015625, subnormal, normal)
    code = mag.to(tl.uint8) | sign
    return tl.where(mag_bits > 0x7F800000, 0x7F, code).to(tl.uint8)


@triton.jit
def ue8m0_to_fp32(b):
    """2^(b - 127) as FP32 for UE8M0 bytes b in 1..254; byte 255 (UE8M0's NaN) gives NaN.

    b: uint8 or int32 tensor of bytes 0..255. Byte 0 gives 0.0, not 2^-127 (the MX scale rule never produces it). Built from
    the FP32 bits because Triton 3.6 decodes bytes 0 and 255 wrongly through tl.float8e8m0.
    """
    value = (b.to(tl.int32) << 23).to(tl.float32, bitcast=True)
    return tl.where(b == 255, float("nan"), value)
