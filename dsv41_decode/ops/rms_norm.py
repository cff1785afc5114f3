"""RMSNorm of rows up to 8192 wide (q_norm, kv_norm, the compressor norm, the decode step's first
`attn_norm`), optionally with the MXFP8 quantization of its output, one launch: the contract of
`reference.linear.rms_norm` (and of `formats.mxfp8_quantize` of its output).

One program per row; the row (D <= 8192; 96 registers per thread at D = 5120, no spills on
sm_90) stays in registers, so a row's result does not depend on the other rows (torch's CUDA
reduction spreads a row over more or fewer threads as the rows are fewer or more). The mean of squares is summed in
another order than torch's and 1/sqrt is an IEEE sqrt then an IEEE division (torch's CUDA rsqrt
is approximate), so an output may differ from the reference by one BF16 ulp; the codes and
scales are bitwise those of the output the kernel wrote. `rms_row` (a row's norm factor) and
`normed` are the one home of that arithmetic, also run by `ops.compressor_tail`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import pdl
from .pdl import kernel_options as pdl_kernel_options
from .checks import require_ndim, require_num_warps, require_tensor
from .act_quant import mxfp8_blocks
from .fp4 import bf16_round
from .kv_write import DIM as KV_DIM, ROPE_DIM, window_insert
from ..records import WINDOW_KV_BYTES
from .rounding import bf16_rne_bits, bf16_widen, to_f32

MAX_DIM = 8192


@triton.jit
def inv_rms(total, eps, D: tl.constexpr):
    """1 / sqrt(total / D + eps) for a row's FP32 sum of squares `total` over D columns, as torch's
    CPU rms_norm takes it: the mean an IEEE division, then an IEEE sqrt and an IEEE division (no
    approximate rsqrt)."""
    ms = tl.div_rn(total, tl.where(total == total, D * 1.0, D * 1.0))
    root = tl.sqrt_rn(ms + eps)
    return tl.div_rn(tl.where(root == root, 1.0, 1.0), root)


@triton.jit
def rms_row(x_row, eps, D: tl.constexpr, BLOCK: tl.constexpr, ROUND_IN: tl.constexpr):
    """(x, r): the row at x_row as FP32 [BLOCK] (0 past D; ROUND_IN: an FP32 input rounded to BF16
    first, `latent`: rms_norm(c.to(bf16))) and its norm factor r = 1/sqrt(mean(x^2) + eps), the sum
    of squares one `tl.sum` over the [BLOCK] vector (its order is the layout's: every kernel that
    must reproduce a row's r - `ops.compressor_tail` - calls this with the same BLOCK and warps)."""
    d = tl.arange(0, BLOCK)
    x = to_f32(tl.load(x_row + d, mask=d < D, other=0.0))
    if ROUND_IN:
        x = bf16_round(x)
    return x, inv_rms(tl.sum(x * x, axis=0), eps, D)


@triton.jit
def normed(x, w, r):
    """w * (x * r) in FP32, before its BF16 rounding: two products, no FMA to contract."""
    return w * (x * r)


@triton.jit
def _rms_norm_row(x_row, w_ptr, o_row, c_row, s_row, eps, D: tl.constexpr, BLOCK: tl.constexpr,
                  ROUND_IN: tl.constexpr, QUANT: tl.constexpr):
    """One row: o = bf16(w * (x * 1/sqrt(mean(x^2) + eps))), optionally its MXFP8 codes and scales.
    Returns o's int16 bits [BLOCK]."""
    d = tl.arange(0, BLOCK)
    mask = d < D
    x, r = rms_row(x_row, eps, D, BLOCK, ROUND_IN)
    w = to_f32(tl.load(w_ptr + d, mask=mask, other=0.0))
    bits = bf16_rne_bits(normed(x, w, r))
    tl.store(o_row + d, bits, mask=mask)
    if QUANT:
        NB: tl.constexpr = BLOCK // 32
        codes, scale_byte = mxfp8_blocks(tl.reshape(bf16_widen(bits), (NB, 32)))
        tl.store(c_row + d, tl.reshape(codes, (BLOCK,)), mask=mask)
        kb = tl.arange(0, NB)
        tl.store(s_row + kb, scale_byte.to(tl.uint8), mask=kb < D // 32)
    return bits


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, codes_ptr, scales_ptr, eps, stride_x, stride_o, stride_c, stride_s,
                     D: tl.constexpr, BLOCK: tl.constexpr, ROUND_IN: tl.constexpr, QUANT: tl.constexpr,
                     PDL: tl.constexpr = False):
    pdl.enter(PDL)
    n = tl.program_id(0).to(tl.int64)
    _rms_norm_row(x_ptr + n * stride_x, w_ptr, out_ptr + n * stride_o, codes_ptr + n * stride_c,
                  scales_ptr + n * stride_s, eps, D, BLOCK, ROUND_IN, QUANT)


@triton.jit
def _rms_norm_pair_kernel(xa_ptr, wa_ptr, oa_ptr, ca_ptr, sa_ptr, xb_ptr, wb_ptr, ob_ptr, eps,
                          stride_xa, stride_oa, stride_ca, stride_sa, stride_xb, stride_ob,
                          cos_ptr, sin_ptr, slots_ptr, pool_ptr, S, stride_cn, stride_sn, stride_pool,
                          D_A: tl.constexpr, BLOCK_A: tl.constexpr, D_B: tl.constexpr, BLOCK_B: tl.constexpr,
                          PDL: tl.constexpr = False, WINDOW: tl.constexpr = False):
    # Program (row n, 0): row n of a with its MXFP8; program (row n, 1): row n of b, and with
    # WINDOW its window record (`kv_write.window_insert`) from the BF16 values it just rounded.
    pdl.enter(PDL)
    n = tl.program_id(0).to(tl.int64)
    if tl.program_id(1) == 0:
        _rms_norm_row(xa_ptr + n * stride_xa, wa_ptr, oa_ptr + n * stride_oa, ca_ptr + n * stride_ca,
                      sa_ptr + n * stride_sa, eps, D_A, BLOCK_A, False, True)
    else:
        bits = _rms_norm_row(xb_ptr + n * stride_xb, wb_ptr, ob_ptr + n * stride_ob, ob_ptr, ob_ptr, eps,
                             D_B, BLOCK_B, False, False)
        if WINDOW:   # D_B = BLOCK_B = 512: the pairs (2j, 2j+1) as [16 blocks, 16 pairs] each
            xe, xo = tl.split(tl.reshape(bf16_widen(bits), (16, 16, 2)))
            window_insert(xe, xo, cos_ptr + n * stride_cn, sin_ptr + n * stride_sn, slots_ptr, n, pool_ptr, S,
                          stride_pool, False)


def _check_norm(x, weight, out, codes, scales, quant: bool, eps, x_dtypes, names, device=None) -> tuple[int, int]:
    """The argument checks of one normed tensor (names: x, weight, out, codes, scales as the caller
    calls them); returns (N, D)."""
    nx, nw, no, nc, ns = names
    n, dim = require_ndim(x, nx, "[N, D]")
    dev = x.device if device is None else device
    if dim > MAX_DIM:
        raise ValueError(f"{nx}: D={dim} exceeds {MAX_DIM} (a row is held in registers)")
    require_tensor(x, nx, x_dtypes, (n, dim), dev)
    require_tensor(weight, nw, (torch.bfloat16, torch.float32), (dim,), dev)
    require_tensor(out, no, (torch.bfloat16,), (n, dim), dev)
    if quant:
        if dim % 32:
            raise ValueError(f"{nx}: D={dim} must be a multiple of 32 to quantize")
        require_tensor(codes, nc, (torch.float8_e4m3fn, torch.uint8), (n, dim), dev)
        require_tensor(scales, ns, (torch.uint8, torch.float8_e8m0fnu), (n, dim // 32), dev)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        raise TypeError(f"eps must be a float, got {type(eps).__name__}")
    return n, dim


def rms_norm_(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor,
              codes_out: torch.Tensor | None = None, scales_out: torch.Tensor | None = None) -> None:
    """out = rms_norm(x, weight, eps) (BF16); with codes_out/scales_out also its MXFP8 quantization.

    x: [N, D] bfloat16, or float32 (rounded to BF16 first, as `reference.compressor.latent`), unit
       stride in D, any row stride; D <= 8192 (a multiple of 32 when quantizing).
    weight: [D] bfloat16 or float32; eps: a float.
    out: [N, D] bfloat16; codes_out: [N, D] float8_e4m3fn or uint8; scales_out: [N, D/32] uint8 or
       float8_e8m0fnu. All on x's device.
    """
    quant = codes_out is not None or scales_out is not None
    n, dim = _check_norm(x, weight, out, codes_out, scales_out, quant, eps, (torch.bfloat16, torch.float32),
                         ("x", "weight", "out", "codes_out", "scales_out"))
    if n == 0:
        return
    o = out.view(torch.int16)
    c = codes_out.view(torch.uint8) if quant else o
    s = scales_out.view(torch.uint8) if quant else o
    _rms_norm_kernel[(n,)](x, weight, o, c, s, float(eps), x.stride(0), o.stride(0), c.stride(0), s.stride(0),
                           D=dim, BLOCK=max(32, triton.next_power_of_2(dim)), ROUND_IN=x.dtype == torch.float32,
                           QUANT=quant, PDL=False, num_warps=4, enable_fp_fusion=False)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Allocating form of `rms_norm_`: [N, D] bfloat16."""
    out = torch.empty(require_ndim(x, "x", "[N, D]"), dtype=torch.bfloat16, device=x.device)
    rms_norm_(x, weight, eps, out)
    return out


def rms_norm_pair_(x_a: torch.Tensor, w_a: torch.Tensor, out_a: torch.Tensor, codes_a: torch.Tensor,
                   scales_a: torch.Tensor, x_b: torch.Tensor, w_b: torch.Tensor, out_b: torch.Tensor,
                   eps: float, *, window: torch.Tensor | None = None, slots: torch.Tensor | None = None,
                   cos: torch.Tensor | None = None, sin: torch.Tensor | None = None, num_warps: int = 4,
                   release: bool = False, pdl: bool = False) -> None:
    """`rms_norm_(x_a, w_a, eps, out_a, codes_a, scales_a)` and `rms_norm_(x_b, w_b, eps, out_b)` in
    one launch (the step's q_norm with the MXFP8 of qr, and kv_norm), bit for bit the same.
    x_a, x_b: [N, D_a], [N, D_b] bfloat16 (same N; D_a a multiple of 32); shapes and dtypes of the
    others as in `rms_norm_`.

    With `window` (then slots, cos, sin too; D_b = 512): also the window-KV insert of
    `kv_write.qkv_rope_insert_(q, out_b, cos, sin, slots, window)` (requant=False), the same bytes,
    from the normalized rows in registers: window [S, 528] uint8 pool, slots [N] int64 (a slot
    outside [0, S) writes nothing), cos, sin [N, 32] float32.

    num_warps: the warps of a program (a power of two in 1..16); a row's sum of squares is summed in
    its layout's order, so the bits of a row are those of the launch's warp count (`rms_row`).

    release (sm_90 outside the interpreter, `ops.pdl.supported`; ignored elsewhere): the programs let
    the next kernel on the stream start at their own start, where that kernel is launched by
    programmatic dependent launch (the step's `wq_b`, `ExactLinear(..., pdl=True)`, which waits for
    this one before it reads qr).

    pdl: launch by programmatic dependent launch (`ops.pdl`): the programs may start while the
    kernel before them on the stream runs and wait for it at their start, before they read
    anything; the same bits. ValueError where PDL is not available (`ops.pdl.supported`)."""
    n, da = _check_norm(x_a, w_a, out_a, codes_a, scales_a, True, eps, (torch.bfloat16,),
                        ("x_a", "w_a", "out_a", "codes_a", "scales_a"))
    nb, db = _check_norm(x_b, w_b, out_b, None, None, False, eps, (torch.bfloat16,),
                         ("x_b", "w_b", "out_b", "", ""), device=x_a.device)
    if nb != n:
        raise ValueError(f"x_a and x_b must have the same rows, got {n} and {nb}")
    require_num_warps(num_warps)
    launch = pdl_kernel_options(x_a.device, pdl, release)
    insert = window is not None
    if insert:
        if db != KV_DIM:
            raise ValueError(f"x_b: D={db} must be {KV_DIM} (head_dim) for the window insert")
        dev = x_a.device
        require_tensor(window, "window", (torch.uint8,), (None, WINDOW_KV_BYTES), dev)
        require_tensor(slots, "slots", (torch.int64,), (n,), dev)
        require_tensor(cos, "cos", (torch.float32,), (n, ROPE_DIM // 2), dev)
        require_tensor(sin, "sin", (torch.float32,), (n, ROPE_DIM // 2), dev)
    elif slots is not None or cos is not None or sin is not None:
        raise ValueError("slots, cos and sin come with window (the window insert); window is None")
    if n == 0:
        return
    oa, ob = out_a.view(torch.int16), out_b.view(torch.int16)
    ca, sa = codes_a.view(torch.uint8), scales_a.view(torch.uint8)
    win = (cos, sin, slots, window, window.shape[0], cos.stride(0), sin.stride(0), window.stride(0)) if insert \
        else (oa, oa, oa, oa, 0, 0, 0, 0)
    _rms_norm_pair_kernel[(n, 2)](
        x_a, w_a, oa, ca, sa, x_b, w_b, ob, float(eps), x_a.stride(0), oa.stride(0), ca.stride(0), sa.stride(0),
        x_b.stride(0), ob.stride(0), *win, D_A=da, BLOCK_A=max(32, triton.next_power_of_2(da)), D_B=db,
        BLOCK_B=max(32, triton.next_power_of_2(db)), WINDOW=insert, num_warps=num_warps, enable_fp_fusion=False,
        **launch)
