"""MXFP8 activation quantization: BF16 [M, K] -> E4M3 codes [M, K] + UE8M0 scales [M, K/32].

Bit-exact with `formats.mxfp8_quantize` (spec section 6) on the GPU and in Triton's interpreter:
the scale comes from the FP32 bits of amax * fp32(1/448), and the codes from `e4m3_rne_code`.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from ..formats import E4M3_MAX, MXFP8_AMAX_FLOOR
from . import pdl
from .checks import require_ndim, require_tensor
from .fp4 import abs_nan_inf, pow2_ceil_exponent, pow2_inv
from .rounding import e4m3_rne_code, to_f32

# fp32(1/448), the constant of the spec's bit rule; exact as a Python float, so Triton's own
# FP32 conversion of the literal cannot change it.
_INV_E4M3_MAX = float(np.float32(1.0 / E4M3_MAX))
INV_E4M3_MAX = _INV_E4M3_MAX   # for kernels that call mxfp8_quantize_tile


@triton.jit
def mxfp8_quantize_tile(x, AMAX_FLOOR: tl.constexpr, INV_QMAX: tl.constexpr, QMAX: tl.constexpr):
    """MXFP8 of a [BLOCK_M, BLOCK_K] FP32 tile of BF16 values (BLOCK_K a multiple of 32), blocks of
    32 along K, as `formats.mxfp8_quantize`: returns (codes [BLOCK_M, BLOCK_K] uint8, scale bytes
    [BLOCK_M, BLOCK_K / 32] int32); a non-finite block gets scale byte 255 and codes 0x7F. The one
    MXFP8 quantizer of the kernels that quantize their own output (ops.wo_a, ops.mhc, ops.rms_norm)."""
    BLOCK_M: tl.constexpr = x.shape[0]
    BLOCK_K: tl.constexpr = x.shape[1]
    NB: tl.constexpr = BLOCK_K // 32
    xb = tl.reshape(x, (BLOCK_M, NB, 32))
    # A NaN counts as inf in the max (abs_nan_inf), so a non-finite block gets amax = inf and the
    # NaN scale byte 255, as in formats.py.
    amax = tl.maximum(tl.max(abs_nan_inf(xb), axis=2), AMAX_FLOOR)  # [BLOCK_M, NB]
    exponent = pow2_ceil_exponent(amax, INV_QMAX)
    scale_byte = tl.minimum(exponent + 127, 255)  # finite amax gives at most 247
    # x * 2^-exponent is exactly x / 2^exponent (a power of two; the floor keeps exponent >= -22).
    # The clamp only guards non-finite blocks, whose codes are replaced below.
    v = xb * pow2_inv(exponent)[:, :, None]
    v = tl.minimum(tl.maximum(v, -QMAX), QMAX)
    codes = tl.where(scale_byte[:, :, None] == 255, 0x7F, e4m3_rne_code(v)).to(tl.uint8)
    return tl.reshape(codes, (BLOCK_M, BLOCK_K)), scale_byte


_MXFP8_FLOOR = tl.constexpr(MXFP8_AMAX_FLOOR)
_E4M3_MAX = tl.constexpr(E4M3_MAX)
_INV_E4M3 = tl.constexpr(_INV_E4M3_MAX)


@triton.jit
def mxfp8_blocks(v):
    """MXFP8 of FP32 blocks v [NB, 32], one block per row (`mxfp8_quantize_tile`): (uint8 E4M3
    codes [NB, 32], int32 UE8M0 scale bytes [NB])."""
    NB: tl.constexpr = v.shape[0]
    codes, scale_byte = mxfp8_quantize_tile(v, _MXFP8_FLOOR, _INV_E4M3, _E4M3_MAX)
    return codes, tl.reshape(scale_byte, (NB,))


@triton.jit
def _act_quant_mxfp8_kernel(
    x_ptr, codes_ptr, scales_ptr, M, K, stride_xm, stride_cm, stride_sm,
    AMAX_FLOOR: tl.constexpr, INV_QMAX: tl.constexpr, QMAX: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr = False,
):
    pdl.enter(PDL)
    NB: tl.constexpr = BLOCK_K // 32
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (rows[:, None] < M) & (cols[None, :] < K)
    x = to_f32(tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0))
    codes, scale_byte = mxfp8_quantize_tile(x, AMAX_FLOOR, INV_QMAX, QMAX)

    tl.store(codes_ptr + rows[:, None] * stride_cm + cols[None, :], codes, mask=mask)
    kb = tl.program_id(1) * NB + tl.arange(0, NB)
    s_mask = (rows[:, None] < M) & (kb[None, :] < K // 32)
    tl.store(scales_ptr + rows[:, None] * stride_sm + kb[None, :], scale_byte.to(tl.uint8), mask=s_mask)


def _act_quant_config(m: int) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_K): about 4096 elements per program (32 per thread at 4 warps), rows first,
    so that M = 1..64 runs in one wave of few programs and prefill rows in many full ones."""
    block_m = min(triton.next_power_of_2(m), 16)
    return block_m, min(max(4096 // block_m, 256), 1024)


def act_quant_mxfp8_(x: torch.Tensor, codes_out: torch.Tensor, scales_out: torch.Tensor) -> None:
    """Write the MXFP8 quantization of x (`formats.mxfp8_quantize`, blocks of 32) into the buffers.

    x: [M, K] bfloat16, K a multiple of 32, unit stride in K (any row stride).
    codes_out: [M, K] float8_e4m3fn (or uint8 holding its bytes), unit stride in K.
    scales_out: [M, K/32] uint8 UE8M0 bytes (or float8_e8m0fnu), unit stride in K/32.
    A block holding an inf or NaN gets scale byte 255 and NaN codes 0x7F, as in formats.py.
    """
    m, k = require_ndim(x, "x", "[M, K]")
    if k % 32:
        raise ValueError(f"x: K={k} must be a multiple of 32 (the MXFP8 block)")
    require_tensor(x, "x", (torch.bfloat16,), (m, k), None)
    require_tensor(codes_out, "codes_out", (torch.float8_e4m3fn, torch.uint8), (m, k), x.device)
    require_tensor(scales_out, "scales_out", (torch.uint8, torch.float8_e8m0fnu), (m, k // 32), x.device)
    if m == 0 or k == 0:
        return
    block_m, block_k = _act_quant_config(m)
    grid = (triton.cdiv(m, block_m), triton.cdiv(k, block_k))
    _act_quant_mxfp8_kernel[grid](
        x, codes_out.view(torch.uint8), scales_out.view(torch.uint8), m, k,
        x.stride(0), codes_out.stride(0), scales_out.stride(0),
        AMAX_FLOOR=MXFP8_AMAX_FLOOR, INV_QMAX=_INV_E4M3_MAX, QMAX=E4M3_MAX,
        BLOCK_M=block_m, BLOCK_K=block_k, PDL=False, num_warps=4,
    )


def act_quant_mxfp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP8 quantization of x, as `formats.mxfp8_quantize(x)` (blocks of 32).

    x: [M, K] bfloat16, K a multiple of 32, unit stride in K.
    Returns (codes float8_e4m3fn [M, K], scales uint8 [M, K/32] UE8M0 bytes).
    """
    m, k = require_ndim(x, "x", "[M, K]")
    codes = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty(m, k // 32, dtype=torch.uint8, device=x.device)
    act_quant_mxfp8_(x, codes, scales)
    return codes, scales
