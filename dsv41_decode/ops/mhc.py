"""The mHC boundary of a site (spec section 4): the post-mix after an attention sublayer fused with the
collapse, RMSNorm and MXFP8 quantization of the next input.

- `mhc_enter_`: the first site's input (the collapse, RMSNorm and MXFP8 without a post-mix), as
  `mhc_boundary_` computes them.
- `mhc_boundary_`: one launch, one program per row (or, with an `MhcBoundaryPlan`, each row over
  chunks: on CUDA every chunk waits for the row's sum of squares and normalizes itself, all the
  launch's programs resident at once - `MhcBoundaryPlan.coresident`; in the interpreter the last
  chunk to arrive normalizes the row). Contract: `reference.mhc.hc_post`, then
  `reference.linear.rms_norm(reference.mhc.hc_pre(x_out, pre), norm_weight, eps)`, then
  `formats.mxfp8_quantize` of that. The new streams and the collapse are bit-exact: every product
  and sum is one FP32 rounding in the reference's order (the kernel is compiled with
  `enable_fp_fusion=False`, so no FMA contraction; torch's CPU `.sum(1)` over the 4 streams adds
  them sequentially, ((t0 + t1) + t2) + t3, checked in the tests), and every BF16 rounding is
  `rounding.bf16_rne_bits`. The RMSNorm adds the squares in its own order and takes 1/sqrt as an
  IEEE sqrt then an IEEE division (torch's CPU rsqrt does that on short tensors, and differs by
  up to 2 FP32 ulps on its vectorized path, seen on an AVX-512 CPU), so `u` may differ from the reference by
  one BF16 ulp where the FP32 value lies next to a rounding midpoint. The codes and scales are
  bit-exact with `formats.mxfp8_quantize` of the `u` the kernel wrote.
- `tile_boundary`: the same boundary in the epilogue of a linear that computes the site output
  (`exact_mm.ExactMM(..., boundary=BoundaryOperands(...))`): each output tile is post-mixed and
  collapsed where it is computed, and the last tile of a chunk, then the last chunk of a row,
  finish as the split kernel's chunks do; the bits of `mhc_boundary_` with the same plan. Every
  sum of squares over a chunk is added in one fixed order (`chunk_sumsq`), whatever the calling
  kernel's register layout.
The site's mixer (pre, post, comb) is `ops.hc_mix`.

The op takes hc = 4 streams (the model's hc_mult; config.py rejects others).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import pdl
from .pdl import kernel_options as pdl_kernel_options
from .checks import interpreting, require_int, require_ndim, require_tensor
from .act_quant import mxfp8_blocks
from .common import butterfly_sum, in_order_sum, num_sms
from .rms_norm import inv_rms
from .rounding import bf16_rne_bits, bf16_widen, to_f32

HC = 4                     # streams
N_MIX = HC * (2 + HC)      # mixer outputs per row: pre (4) + post (4) + comb (16) = 24




# --- boundary: hc_post + hc_pre + rms_norm + MXFP8 ------------------------------------------------


@triton.jit
def _new_stream_bits(j: tl.constexpr, y, x0, x1, x2, x3, post_row, comb_row, stride_ci):
    """int16 BF16 bits of new stream j = bf16(post[j] * y + (((c0j x0 + c1j x1) + c2j x2) + c3j x3)),
    comb_row pointing at comb[n, 0, 0] (comb[n, i, j] at comb_row + i * stride_ci + j)."""
    mixed = tl.load(comb_row + j) * x0
    mixed = mixed + tl.load(comb_row + stride_ci + j) * x1
    mixed = mixed + tl.load(comb_row + 2 * stride_ci + j) * x2
    mixed = mixed + tl.load(comb_row + 3 * stride_ci + j) * x3
    return bf16_rne_bits(tl.load(post_row + j) * y + mixed)


@triton.jit
def _boundary_chunk(y_row, x_row, stride_xh, post_row, comb_row, stride_ci, pre_row, d, mask):
    """The new streams' bits (4 x [BLOCK_D] int16) and the collapse bf16(sum_i pre[i] * x_out[i])
    widened to FP32, at the columns d of one row."""
    y = to_f32(tl.load(y_row + d, mask=mask, other=0.0))
    return mix_chunk(y, x_row, stride_xh, post_row, comb_row, stride_ci, pre_row, d, mask)


@triton.jit
def mix_chunk(y, x_row, stride_xh, post_row, comb_row, stride_ci, pre_row, d, mask):
    """`_boundary_chunk` for a site output y (FP32 holding BF16 values) already in registers."""
    x0 = to_f32(tl.load(x_row + d, mask=mask, other=0.0))
    x1 = to_f32(tl.load(x_row + stride_xh + d, mask=mask, other=0.0))
    x2 = to_f32(tl.load(x_row + 2 * stride_xh + d, mask=mask, other=0.0))
    x3 = to_f32(tl.load(x_row + 3 * stride_xh + d, mask=mask, other=0.0))
    b0 = _new_stream_bits(0, y, x0, x1, x2, x3, post_row, comb_row, stride_ci)
    b1 = _new_stream_bits(1, y, x0, x1, x2, x3, post_row, comb_row, stride_ci)
    b2 = _new_stream_bits(2, y, x0, x1, x2, x3, post_row, comb_row, stride_ci)
    b3 = _new_stream_bits(3, y, x0, x1, x2, x3, post_row, comb_row, stride_ci)
    c = collapse(pre_row, bf16_widen(b0), bf16_widen(b1), bf16_widen(b2), bf16_widen(b3))
    return b0, b1, b2, b3, c


@triton.jit
def collapse(pre_row, s0, s1, s2, s3):
    """hc_pre of one chunk: bf16(((pre[0] s0 + pre[1] s1) + pre[2] s2) + pre[3] s3) widened to FP32
    (s_i: FP32 holding the streams' BF16 values; each product and sum one FP32 rounding when the
    kernel is compiled with enable_fp_fusion=False)."""
    c = tl.load(pre_row) * s0
    c = c + tl.load(pre_row + 1) * s1
    c = c + tl.load(pre_row + 2) * s2
    c = c + tl.load(pre_row + 3) * s3
    return bf16_widen(bf16_rne_bits(c))


@triton.jit
def _enter_chunk(x_row, stride_xh, pre_row, d, mask):
    """The collapse of the streams x (no post-mix) at the columns d of one row, FP32."""
    x0 = to_f32(tl.load(x_row + d, mask=mask, other=0.0))
    x1 = to_f32(tl.load(x_row + stride_xh + d, mask=mask, other=0.0))
    x2 = to_f32(tl.load(x_row + 2 * stride_xh + d, mask=mask, other=0.0))
    x3 = to_f32(tl.load(x_row + 3 * stride_xh + d, mask=mask, other=0.0))
    return collapse(pre_row, x0, x1, x2, x3)


@triton.jit
def _store_normed(c, r, w, u_row, codes_row, scales_row, d0, d, mask, D: tl.constexpr, BLOCK: tl.constexpr):
    """u = bf16(w * (c * r)) at the columns d = d0 + [0, BLOCK) of one row (w: the norm weight there,
    FP32), and its MXFP8 codes and scale bytes (blocks of 32 from d0)."""
    NB: tl.constexpr = BLOCK // 32
    bits = bf16_rne_bits(w * (c * r))
    tl.store(u_row + d, bits, mask=mask)
    codes, scale_byte = mxfp8_blocks(tl.reshape(bf16_widen(bits), (NB, 32)))
    tl.store(codes_row + d, tl.reshape(codes, (BLOCK,)), mask=mask)
    kb = d0 // 32 + tl.arange(0, NB)
    tl.store(scales_row + kb, scale_byte.to(tl.uint8), mask=kb < D // 32)


@triton.jit
def _mhc_boundary_kernel(
    y_ptr, x_ptr, post_ptr, comb_ptr, pre_ptr, w_ptr, xo_ptr, u_ptr, codes_ptr, scales_ptr, eps,
    stride_y, stride_xn, stride_xh, stride_post, stride_cn, stride_ci, stride_pre,
    stride_xon, stride_xoh, stride_u, stride_codes, stride_scales,
    D: tl.constexpr, BLOCK_D: tl.constexpr, POST: tl.constexpr = True,
):
    # POST False (`mhc_enter_`): no post-mix; the collapse of x itself, no new streams stored (y,
    # post, comb and x_out are not read).
    n = tl.program_id(0).to(tl.int64)
    y_row = y_ptr + n * stride_y
    x_row = x_ptr + n * stride_xn
    post_row = post_ptr + n * stride_post
    comb_row = comb_ptr + n * stride_cn
    pre_row = pre_ptr + n * stride_pre
    offs = tl.arange(0, BLOCK_D)

    # Pass 1: the sum of squares of the collapse. Pass 2 recomputes the chunks (the same bits; x and
    # y come back from L1/L2) rather than keeping the row in registers or a scratch buffer.
    ss = tl.zeros([BLOCK_D], dtype=tl.float32)
    for d0 in tl.range(0, D, BLOCK_D):
        d = d0 + offs
        mask = d < D
        if POST:
            _, _, _, _, c = _boundary_chunk(y_row, x_row, stride_xh, post_row, comb_row, stride_ci, pre_row, d,
                                            mask)
        else:
            c = _enter_chunk(x_row, stride_xh, pre_row, d, mask)
        ss += c * c
    r = inv_rms(tl.sum(ss, axis=0), eps, D)

    xo_row = xo_ptr + n * stride_xon
    u_row = u_ptr + n * stride_u
    for d0 in tl.range(0, D, BLOCK_D):
        d = d0 + offs
        mask = d < D
        if POST:
            b0, b1, b2, b3, c = _boundary_chunk(y_row, x_row, stride_xh, post_row, comb_row, stride_ci, pre_row,
                                                d, mask)
            store_streams(b0, b1, b2, b3, xo_row, stride_xoh, d, mask)
        else:
            c = _enter_chunk(x_row, stride_xh, pre_row, d, mask)
        w = to_f32(tl.load(w_ptr + d, mask=mask, other=0.0))
        _store_normed(c, r, w, u_row, codes_ptr + n * stride_codes, scales_ptr + n * stride_scales, d0, d, mask,
                      D, BLOCK_D)


@triton.jit
def _program_chunk(y_ptr, x_ptr, post_ptr, comb_ptr, pre_ptr, stride_y, stride_xn, stride_xh, stride_post, stride_cn,
                   stride_ci, stride_pre, D: tl.constexpr, BLOCK_D: tl.constexpr):
    """The chunk of program (row n, chunk ch) of a chunked boundary launch: (n, ch, its columns d,
    their mask, the four new streams' bits and the collapse c, as `_boundary_chunk`)."""
    n = tl.program_id(0).to(tl.int64)
    ch = tl.program_id(1)
    d = ch * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = d < D
    b0, b1, b2, b3, c = _boundary_chunk(y_ptr + n * stride_y, x_ptr + n * stride_xn, stride_xh,
                                        post_ptr + n * stride_post, comb_ptr + n * stride_cn, stride_ci,
                                        pre_ptr + n * stride_pre, d, mask)
    return n, ch, d, mask, b0, b1, b2, b3, c


@triton.jit
def _mhc_boundary_split_kernel(
    y_ptr, x_ptr, post_ptr, comb_ptr, pre_ptr, w_ptr, xo_ptr, u_ptr, codes_ptr, scales_ptr, ws_ptr, cnt_ptr, eps,
    stride_y, stride_xn, stride_xh, stride_post, stride_cn, stride_ci, stride_pre,
    stride_xon, stride_xoh, stride_u, stride_codes, stride_scales, stride_ws,
    D: tl.constexpr, BLOCK_D: tl.constexpr, NCH: tl.constexpr, NCH_P2: tl.constexpr, BLOCK_N: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl.enter(PDL)
    # Program (row n, chunk ch): the new streams and the collapse of one chunk; the collapse (BF16,
    # exact) parks in u_out and its sum of squares in the plan's workspace; the last chunk of the
    # row to arrive sums the NCH partials in chunk order and normalizes + quantizes the whole row.
    n, ch, d, mask, b0, b1, b2, b3, c = _program_chunk(y_ptr, x_ptr, post_ptr, comb_ptr, pre_ptr, stride_y, stride_xn,
                                                       stride_xh, stride_post, stride_cn, stride_ci, stride_pre, D,
                                                       BLOCK_D)
    split_finish(b0, b1, b2, b3, c, n, ch, d, mask, w_ptr, xo_ptr, u_ptr, codes_ptr, scales_ptr, ws_ptr, cnt_ptr,
                 eps, stride_xon, stride_xoh, stride_u, stride_codes, stride_scales, stride_ws,
                 D, NCH, NCH_P2, BLOCK_N)


@triton.jit
def _mhc_boundary_coresident_kernel(
    y_ptr, x_ptr, post_ptr, comb_ptr, pre_ptr, w_ptr, xo_ptr, u_ptr, codes_ptr, scales_ptr, ws_ptr, cnt_ptr, eps,
    spin_limit,
    stride_y, stride_xn, stride_xh, stride_post, stride_cn, stride_ci, stride_pre,
    stride_xon, stride_xoh, stride_u, stride_codes, stride_scales, stride_ws,
    D: tl.constexpr, BLOCK_D: tl.constexpr, NCH: tl.constexpr, NCH_P2: tl.constexpr, PDL: tl.constexpr = False,
):
    pdl.enter(PDL)
    # Program (row n, chunk ch), every program of the launch resident at once: the new streams and
    # the collapse c of one chunk (c stays in registers); its sum of squares goes to the workspace
    # and the program arrives on the row's counter, then waits until all NCH chunks of the row have
    # arrived, sums the NCH partials (`row_inv_rms`, as `finish_chunk`: the same r) and normalizes and
    # quantizes its own chunk (the MXFP8 blocks of 32 lie inside a chunk). The last to arrive sets
    # the counter back to 0 (release) at once; the others wait for NCH or 0 (the count reached, or
    # already reset), so none has to count its leaving. A program that polls spin_limit times
    # without seeing either normalizes with r = NaN (never by design: a launch whose programs are
    # not all resident shows as NaN in u and its blocks' scales 0xFF, not as a hang). The chunk's
    # norm weight (constant) is asked for first: its latency passes during the chunk and the
    # arrival instead of after the wait (loaded after the barrier and the atomics, it could not
    # move ahead of them).
    dw = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    w = tl.load(w_ptr + dw, mask=dw < D, other=0.0)
    n, ch, d, mask, b0, b1, b2, b3, c = _program_chunk(y_ptr, x_ptr, post_ptr, comb_ptr, pre_ptr, stride_y, stride_xn,
                                                       stride_xh, stride_post, stride_cn, stride_ci, stride_pre, D,
                                                       BLOCK_D)
    store_streams(b0, b1, b2, b3, xo_ptr + n * stride_xon, stride_xoh, d, mask)
    tl.store(ws_ptr + n * stride_ws + ch, chunk_sumsq(c))
    tl.debug_barrier()
    cnt = cnt_ptr + n
    seen = tl.atomic_add(cnt, 1, sem="acq_rel", scope="gpu") + 1
    if seen == NCH:
        tl.atomic_xchg(cnt, 0, sem="release", scope="gpu")
    else:
        polls = 0
        while (seen != 0) & (seen < NCH) & (polls < spin_limit):
            seen = tl.atomic_add(cnt, 0, sem="acquire", scope="gpu")
            polls += 1
    stuck = (seen != 0) & (seen < NCH)
    r = tl.where(stuck, float("nan"), row_inv_rms(ws_ptr + n * stride_ws, eps, D, NCH, NCH_P2))
    _store_normed(c, r, to_f32(w), u_ptr + n * stride_u, codes_ptr + n * stride_codes, scales_ptr + n * stride_scales,
                  ch * BLOCK_D, d, mask, D, BLOCK_D)


@triton.jit
def chunk_sumsq(c):
    """sum(c * c) of a chunk c [BLOCK_D] FP32 (BLOCK_D a power of two, 32 .. 1024) in one fixed order:
    the one `tl.sum(c * c)` takes on sm_90 in a 4-warp program whose threads hold BLOCK_D / 128
    consecutive values each (the layout of `mhc_boundary_`'s chunk programs): each thread's values
    in order, then each warp's 32 lanes as a shuffle-xor butterfly, then the 4 warps' sums likewise
    (below 128 values one value a thread, BLOCK_D / 32 warps). Any kernel that calls it gets these
    bits, whatever layout it gives c."""
    B: tl.constexpr = c.shape[0]
    SPT: tl.constexpr = B // 128 if B >= 128 else 1
    WARPS: tl.constexpr = 4 if B >= 128 else B // 32
    per_thread = in_order_sum(tl.reshape(c * c, [WARPS * 32, SPT]))
    per_warp = butterfly_sum(tl.reshape(per_thread, [WARPS, 32]))
    return tl.sum(butterfly_sum(tl.reshape(per_warp, [1, WARPS])), axis=0)     # one value: exact


@triton.jit
def store_streams(b0, b1, b2, b3, xo_row, stride_xoh, d, mask):
    """Store one row's four new streams (int16 BF16 bits, [BLOCK_D] each) at the columns d of its
    x_out row xo_row (streams stride_xoh apart)."""
    tl.store(xo_row + d, b0, mask=mask)
    tl.store(xo_row + stride_xoh + d, b1, mask=mask)
    tl.store(xo_row + 2 * stride_xoh + d, b2, mask=mask)
    tl.store(xo_row + 3 * stride_xoh + d, b3, mask=mask)


@triton.jit
def row_inv_rms(ws_row, eps, D: tl.constexpr, NCH: tl.constexpr, NCH_P2: tl.constexpr):
    """1 / rms of a row of D columns from its NCH chunk sums of squares in the workspace row ws_row
    (read through L2: other programs wrote them), added in a butterfly over NCH_P2 lanes (the
    order of `tl.sum` over them on sm_90, up to 32): the one r of every form that splits a row
    into chunks."""
    k = tl.arange(0, NCH_P2)
    parts = tl.load(ws_row + k, mask=k < NCH, other=0.0, cache_modifier=".cg")
    return inv_rms(tl.sum(butterfly_sum(tl.reshape(parts, [1, NCH_P2])), axis=0), eps, D)


@triton.jit
def park_chunk(b0, b1, b2, b3, c, n, d, mask, xo_ptr, u_ptr, stride_xon, stride_xoh, stride_u):
    """Store row n's new streams (int16 BF16 bits) at the columns d and park their collapse c (FP32
    holding BF16 values) in u, for the row's last chunk to normalize (`finish_chunk`)."""
    store_streams(b0, b1, b2, b3, xo_ptr + n * stride_xon, stride_xoh, d, mask)
    tl.store(u_ptr + n * stride_u + d, bf16_rne_bits(c), mask=mask)          # exact: c holds a BF16 value


@triton.jit
def finish_chunk(ss, n, ch, w_ptr, u_ptr, codes_ptr, scales_ptr, ws_ptr, cnt_ptr, eps, stride_u, stride_codes,
                 stride_scales, stride_ws, D: tl.constexpr, NCH: tl.constexpr, NCH_P2: tl.constexpr,
                 BLOCK_N: tl.constexpr):
    """Record chunk ch's sum of squares ss of row n in the workspace (its collapse parked in u
    already: by this program's threads, or in `tile_boundary` by the chunk's tiles, ordered before
    the chunk counter's last arrival); the row's last chunk to arrive (the row's counter,
    reset by it) adds the NCH sums in a butterfly over NCH_P2 lanes (the order of `tl.sum` over
    them on sm_90, up to 32) and normalizes and quantizes the whole row, BLOCK_N columns a slice."""
    u_row = u_ptr + n * stride_u
    tl.store(ws_ptr + n * stride_ws + ch, ss)
    tl.debug_barrier()
    arrived = tl.atomic_add(cnt_ptr + n, 1, sem="acq_rel", scope="gpu")
    if arrived == NCH - 1:
        tl.store(cnt_ptr + n, 0)
        r = row_inv_rms(ws_ptr + n * stride_ws, eps, D, NCH, NCH_P2)
        # The row's serial tail, unrolled with the next slice's loads (u and the norm weight) issued
        # before this slice's stores (a runtime loop paid one dependent L2 round trip per slice; u
        # is both read and written, so the compiler cannot hoist the loads itself).
        NS: tl.constexpr = (D + BLOCK_N - 1) // BLOCK_N
        scales_row = scales_ptr + n * stride_scales
        codes_row = codes_ptr + n * stride_codes
        dd = tl.arange(0, BLOCK_N)
        cc = bf16_widen(tl.load(u_row + dd, mask=dd < D, other=0, cache_modifier=".cg"))
        ww = to_f32(tl.load(w_ptr + dd, mask=dd < D, other=0.0))
        for i in tl.static_range(NS):
            d0 = i * BLOCK_N
            dd = d0 + tl.arange(0, BLOCK_N)
            if i + 1 < NS:
                dn = dd + BLOCK_N
                cc_next = bf16_widen(tl.load(u_row + dn, mask=dn < D, other=0, cache_modifier=".cg"))
                ww_next = to_f32(tl.load(w_ptr + dn, mask=dn < D, other=0.0))
            _store_normed(cc, r, ww, u_row, codes_row, scales_row, d0, dd, dd < D, D, BLOCK_N)
            if i + 1 < NS:
                cc = cc_next
                ww = ww_next


@triton.jit
def split_finish(b0, b1, b2, b3, c, n, ch, d, mask, w_ptr, xo_ptr, u_ptr, codes_ptr, scales_ptr, ws_ptr, cnt_ptr,
                 eps, stride_xon, stride_xoh, stride_u, stride_codes, stride_scales, stride_ws,
                 D: tl.constexpr, NCH: tl.constexpr, NCH_P2: tl.constexpr, BLOCK_N: tl.constexpr):
    """Store one chunk's new streams, park its collapse in u and its sum of squares (`chunk_sumsq`)
    in the workspace; the row's last chunk to arrive normalizes and quantizes the whole row
    (`finish_chunk`)."""
    park_chunk(b0, b1, b2, b3, c, n, d, mask, xo_ptr, u_ptr, stride_xon, stride_xoh, stride_u)
    finish_chunk(chunk_sumsq(c), n, ch, w_ptr, u_ptr, codes_ptr, scales_ptr, ws_ptr, cnt_ptr, eps, stride_u,
                 stride_codes, stride_scales, stride_ws, D, NCH, NCH_P2, BLOCK_N)


@triton.jit
def tile_boundary(y, n, off_n, x_ptr, post_ptr, comb_ptr, pre_ptr, w_ptr, xo_ptr, u_ptr, codes_ptr, scales_ptr,
                  ws_ptr, cnt_ptr, ccnt_ptr, eps, stride_xn, stride_xh, stride_post, stride_cn, stride_ci,
                  stride_pre, stride_xon, stride_xoh, stride_u, stride_codes, stride_scales, stride_ws,
                  stride_ccnt, D: tl.constexpr, BLOCK_D: tl.constexpr, NCH: tl.constexpr, NCH_P2: tl.constexpr,
                  BLOCK_N: tl.constexpr):
    """The boundary of row n in the epilogue of the linear that computes the site output: y [BT] FP32
    (BF16 values), the row's columns off_n .. off_n + BT - 1 (a tile; BT a power of two dividing
    BLOCK_D, off_n a multiple of BT). Post-mixes and collapses the tile (`mix_chunk`, `park_chunk`);
    the last tile of its BLOCK_D-column chunk to arrive (a counter per row and chunk at
    ccnt_ptr + n * stride_ccnt + chunk, reset by it) sums the chunk's squares from the parked
    collapse (`chunk_sumsq`) and goes on as a chunk of `mhc_boundary_`'s split kernel
    (`finish_chunk`): the bits of `mhc_boundary_` with a plan of BLOCK_D-column chunks. The other
    arguments as the split kernel's; every thread of the program calls it (it synchronizes them)."""
    BT: tl.constexpr = y.shape[0]
    d = off_n + tl.arange(0, BT)
    mask = d < D
    b0, b1, b2, b3, c = mix_chunk(y, x_ptr + n * stride_xn, stride_xh, post_ptr + n * stride_post,
                                  comb_ptr + n * stride_cn, stride_ci, pre_ptr + n * stride_pre, d, mask)
    park_chunk(b0, b1, b2, b3, c, n, d, mask, xo_ptr, u_ptr, stride_xon, stride_xoh, stride_u)
    ch = off_n // BLOCK_D
    lo = ch * BLOCK_D
    tiles = (tl.minimum(D - lo, BLOCK_D) + BT - 1) // BT          # the chunk's tiles (the last chunk may be short)
    cnt = ccnt_ptr + n * stride_ccnt + ch
    tl.debug_barrier()
    arrived = tl.atomic_add(cnt, 1, sem="acq_rel", scope="gpu")
    if arrived == tiles - 1:
        tl.store(cnt, 0)
        dc = lo + tl.arange(0, BLOCK_D)
        cc = bf16_widen(tl.load(u_ptr + n * stride_u + dc, mask=dc < D, other=0, cache_modifier=".cg"))
        finish_chunk(chunk_sumsq(cc), n, ch, w_ptr, u_ptr, codes_ptr, scales_ptr, ws_ptr, cnt_ptr, eps, stride_u,
                     stride_codes, stride_scales, stride_ws, D, NCH, NCH_P2, BLOCK_N)


@dataclass(frozen=True, eq=False)
class MhcBoundaryPlan:
    """The split of `mhc_boundary_` over chunks of each row, and its workspace (build once).

    dim: the model dim (a multiple of 32); max_rows: the most rows a launch may pass; block_d:
    columns per program, a power of two in 32..1024 (`chunk_sumsq`'s order is the sm_90 `tl.sum`'s there);
    ws: [max_rows, chunks] FP32 partial sums of squares; counters: [max_rows] int32, 0 between
    launches (the last program of a row resets its counter, so graph replays need no memset);
    chunk_counters: [max_rows, chunks] int32, the same for the tiles of each chunk when a linear's
    epilogue runs the boundary (`tile_boundary`). Not for concurrent launches on two streams.

    coresident: how `mhc_boundary_`'s own launch finishes a row (the same bits either way).
    False: the split form - every chunk program parks its collapse in u, the row's last chunk to
    arrive normalizes and quantizes the whole row. True: the co-resident form - every chunk program
    keeps its collapse in registers, waits on the row's counter until all chunks of the row have
    arrived and normalizes and quantizes its own chunk; it needs every program of the launch (rows
    x chunks, 4 warps each: 640 at 64 rows of 10 chunks, against an H200's 132 SMs x 10,
    `coresident_capacity`; `build` checks it) resident at once, and the programs not yet resident
    must get an SM while the others wait (nothing running beside it may wait on this launch). spin_limit bounds each program's polls: one that
    polls out normalizes its chunk with r = NaN (u NaN, codes 0x7F, scales 0xFF) and the launch
    ends; the counters are still left 0. Under the interpreter the programs run one after another,
    so in a co-resident launch every chunk of a row but the last to run polls out: `build` picks
    the co-resident form only on CUDA outside the interpreter. `tile_boundary` and
    `allreduce_boundary_` do not read these two fields (they always finish as the split form).
    `dataclasses.replace(plan, coresident=...)` gives the other form on the same workspace.
    """
    dim: int
    max_rows: int
    block_d: int
    ws: torch.Tensor
    counters: torch.Tensor
    chunk_counters: torch.Tensor
    coresident: bool
    spin_limit: int

    @property
    def chunks(self) -> int:
        return triton.cdiv(self.dim, self.block_d)

    @classmethod
    def build(cls, dim: int, max_rows: int, device: torch.device | str = "cuda", block_d: int = 512,
              coresident: bool | None = None, spin_limit: int = 1 << 22) -> "MhcBoundaryPlan":
        """coresident None: True on a CUDA device outside the interpreter where max_rows x chunks
        programs fit on it at once (`coresident_capacity`), else False (the class docstring says
        why); True on a CUDA device where they do not fit raises ValueError. spin_limit: polls of a
        co-resident program's wait (int32)."""
        for name, v in (("dim", dim), ("max_rows", max_rows), ("block_d", block_d), ("spin_limit", spin_limit)):
            require_int(v, name)
        if spin_limit >= 1 << 31:
            raise ValueError(f"spin_limit={spin_limit} must be below 2**31 (an int32 kernel argument)")
        if dim % 32 or block_d % 32 or block_d & (block_d - 1) or block_d > 1024:
            raise ValueError(f"dim={dim} must be a multiple of 32 and block_d={block_d} a power of two in "
                             f"32..1024 (`chunk_sumsq`'s range)")
        if coresident is not None and not isinstance(coresident, bool):
            raise TypeError(f"coresident must be a bool or None, got {type(coresident).__name__}")
        device = torch.device(device)
        chunks = triton.cdiv(dim, block_d)
        fits = device.type != "cuda" or max_rows * chunks <= coresident_capacity(block_d, device)
        if coresident is None:
            coresident = device.type == "cuda" and not interpreting() and fits
        elif coresident and not fits:
            raise ValueError(f"max_rows={max_rows}: a co-resident launch of {max_rows} rows x {chunks} chunks "
                             f"does not fit on {device} at once (at most {coresident_capacity(block_d, device)} "
                             f"programs at block_d={block_d}); pass coresident=False or fewer rows")
        return cls(dim, max_rows, block_d, torch.zeros(max_rows, chunks, dtype=torch.float32, device=device),
                   torch.zeros(max_rows, dtype=torch.int32, device=device),
                   torch.zeros(max_rows, chunks, dtype=torch.int32, device=device), coresident, spin_limit)


def coresident_capacity(block_d: int, device: torch.device | str) -> int:
    """Programs of `_mhc_boundary_coresident_kernel` (4 warps, chunks of block_d columns) that the
    device holds at once: its SMs x 6 at block_d 1024, 9 at 512, 16 below (compiled for sm_90 at
    dim 5120: 80 / 56 / 32 registers a thread at block_d 1024 / 512 / 256 and less, the SM's 64K
    registers the bound; tests/ops/_mhc_sm90.py checks 512)."""
    return num_sms(device) * (6 if block_d > 512 else 9 if block_d > 256 else 16)


def _require_disjoint(out: torch.Tensor, out_name: str, inp: torch.Tensor, in_name: str) -> None:
    """Raise ValueError unless the memory spans of out and inp do not overlap (no host sync)."""
    def span(t):
        lo = t.data_ptr() + t.element_size() * sum(s * (n - 1) for s, n in zip(t.stride(), t.shape) if s < 0)
        hi = t.data_ptr() + t.element_size() * (1 + sum(s * (n - 1) for s, n in zip(t.stride(), t.shape) if s > 0))
        return lo, hi
    if out.numel() == 0 or inp.numel() == 0:
        return
    (a0, a1), (b0, b1) = span(out), span(inp)
    if a0 < b1 and b0 < a1:
        raise ValueError(f"{out_name} must not overlap {in_name} in memory (the kernel reads {in_name} "
                         f"after writing parts of {out_name})")


def _boundary_block_d(dim: int) -> int:
    """Columns per chunk: 1024 (8 per thread at 4 warps; 5 chunks at dim 5120), less for small dims."""
    return min(1024, triton.next_power_of_2(dim))


def check_boundary_operands(n: int, dim: int, dev, x, post, comb, pre, norm_weight, x_out, u_out, codes_out,
                            scales_out) -> None:
    """The shapes, dtypes and device of a boundary's streams, mixer coefficients, norm weight and
    outputs for n rows of width dim (shared by `mhc_boundary_` and `ops.allreduce_boundary`)."""
    require_tensor(x, "x", (torch.bfloat16,), (n, HC, dim), dev)
    require_tensor(post, "post", (torch.float32,), (n, HC), dev)
    require_tensor(comb, "comb", (torch.float32,), (n, HC, HC), dev)
    require_tensor(pre, "pre", (torch.float32,), (n, HC), dev)
    require_tensor(norm_weight, "norm_weight", (torch.bfloat16, torch.float32), (dim,), dev)
    require_tensor(x_out, "x_out", (torch.bfloat16,), (n, HC, dim), dev)
    require_tensor(u_out, "u_out", (torch.bfloat16,), (n, dim), dev)
    require_tensor(codes_out, "codes_out", (torch.float8_e4m3fn, torch.uint8), (n, dim), dev)
    require_tensor(scales_out, "scales_out", (torch.uint8, torch.float8_e8m0fnu), (n, dim // 32), dev)


def check_boundary_call(y, x, post, comb, pre, norm_weight, eps, x_out, u_out, codes_out, scales_out,
                        plan: MhcBoundaryPlan | None) -> tuple[int, int]:
    """`mhc_boundary_`'s checks of its arguments (TypeError / ValueError naming the one at fault);
    returns (N, dim)."""
    n, dim = require_ndim(y, "y", "[N, dim]")
    if dim % 32 or dim == 0:
        raise ValueError(f"y: dim={dim} must be a positive multiple of 32 (the MXFP8 block)")
    dev = y.device
    require_tensor(y, "y", (torch.bfloat16,), (n, dim), dev)
    check_boundary_operands(n, dim, dev, x, post, comb, pre, norm_weight, x_out, u_out, codes_out, scales_out)
    if not isinstance(eps, (int, float)) or isinstance(eps, bool):
        raise TypeError(f"eps must be a float, got {type(eps).__name__}")
    for out, out_name in ((x_out, "x_out"), (u_out, "u_out"), (codes_out, "codes_out"), (scales_out, "scales_out")):
        for inp, in_name in ((x, "x"), (y, "y")):
            _require_disjoint(out, out_name, inp, in_name)
    if plan is not None:
        if not isinstance(plan, MhcBoundaryPlan):
            raise TypeError(f"plan must be an MhcBoundaryPlan, got {type(plan).__name__}")
        if plan.dim != dim or n > plan.max_rows or plan.ws.device != dev:
            raise ValueError(f"plan is for dim={plan.dim}, {plan.max_rows} rows on {plan.ws.device}; "
                             f"the call has dim={dim}, {n} rows on {dev}")
    return n, dim


def mhc_boundary_(y: torch.Tensor, x: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, pre: torch.Tensor,
                  norm_weight: torch.Tensor, eps: float, x_out: torch.Tensor, u_out: torch.Tensor,
                  codes_out: torch.Tensor, scales_out: torch.Tensor, plan: MhcBoundaryPlan | None = None, *,
                  release: bool = False, pdl: bool = False) -> None:
    """x_out = hc_post(y, x, post, comb); u_out = rms_norm(hc_pre(x_out, pre), norm_weight, eps);
    (codes_out, scales_out) = mxfp8_quantize(u_out). One launch, nothing allocated, no host sync.

    plan: None runs one program per row; an `MhcBoundaryPlan` spreads each row over chunks of
    plan.block_d columns (plan.coresident: every chunk waits for the row's sum of squares and
    normalizes itself; else the last chunk to arrive normalizes the row): the same x_out bits, u
    within the same one-ulp contract (its sum of squares added per chunk in `chunk_sumsq`'s order,
    then over the chunks in a butterfly); both forms, and `tile_boundary` in a linear's epilogue,
    give the same bits.

    y: [N, dim] bfloat16, the site's output; dim a multiple of 32.
    x: [N, 4, dim] bfloat16, the streams that entered the site.
    post: [N, 4] float32; comb: [N, 4, 4] float32, comb[n, i, j] = weight of stream i in new stream j.
    pre: [N, 4] float32, the carried collapse weights of the next site.
    norm_weight: [dim] bfloat16 or float32, the next site's norm; eps: its epsilon (a float).
    x_out: [N, 4, dim] bfloat16, the new streams: bitwise hc_post.
    u_out: [N, dim] bfloat16, the next site's input: the collapse bitwise as hc_pre, the RMSNorm
        within one BF16 ulp of rms_norm (the mean of squares is summed in another order).
    codes_out: [N, dim] float8_e4m3fn (or uint8 holding its bytes); scales_out: [N, dim/32] uint8
        UE8M0 bytes (or float8_e8m0fnu): bitwise formats.mxfp8_quantize(u_out).
    Every tensor has unit stride in its last dimension (x, x_out and comb: any other strides).
    The outputs must not overlap y or x (checked).
    release (with a plan, on sm_90 outside the interpreter: `ops.pdl.supported`; ignored elsewhere):
    the programs let the next kernel on the stream start at their own start, where that kernel is
    launched by programmatic dependent launch (the step's next fused wq_a|wkv, `ExactLinear(...,
    pdl=True)`, which waits for this one before it reads u's codes).
    pdl (with a plan): launch by programmatic dependent launch (`ops.pdl`): the programs may start
    while the kernel before them on the stream runs and wait for it at their start, before they
    read anything; the same bits. ValueError without a plan or where PDL is not available
    (`ops.pdl.supported`).
    """
    n, dim = check_boundary_call(y, x, post, comb, pre, norm_weight, eps, x_out, u_out, codes_out, scales_out, plan)
    if pdl and plan is None:
        raise ValueError("pdl: a launch by PDL needs a plan (the one-program-per-row form has no wait)")
    launch = pdl_kernel_options(y.device, pdl, release)
    if n == 0:
        return
    xo, u = x_out.view(torch.int16), u_out.view(torch.int16)
    codes, scales = codes_out.view(torch.uint8), scales_out.view(torch.uint8)
    if plan is not None:         # the two chunked forms take the same operands
        args = (y, x, post, comb, pre, norm_weight, xo, u, codes, scales, plan.ws, plan.counters, float(eps))
        strides = (y.stride(0), x.stride(0), x.stride(1), post.stride(0), comb.stride(0), comb.stride(1),
                   pre.stride(0), xo.stride(0), xo.stride(1), u.stride(0), codes.stride(0), scales.stride(0),
                   plan.ws.stride(0))
        meta = dict(D=dim, BLOCK_D=plan.block_d, NCH=plan.chunks, NCH_P2=triton.next_power_of_2(plan.chunks),
                    num_warps=4, enable_fp_fusion=False, **launch)
        if plan.coresident:
            _mhc_boundary_coresident_kernel[(n, plan.chunks)](*args, int(plan.spin_limit), *strides, **meta)
        else:
            _mhc_boundary_split_kernel[(n, plan.chunks)](*args, *strides, BLOCK_N=_boundary_block_d(dim), **meta)
        return
    _mhc_boundary_kernel[(n,)](
        y, x, post, comb, pre, norm_weight, xo, u, codes, scales, float(eps),
        y.stride(0), x.stride(0), x.stride(1), post.stride(0), comb.stride(0), comb.stride(1), pre.stride(0),
        xo.stride(0), xo.stride(1), u.stride(0), codes.stride(0), scales.stride(0),
        D=dim, BLOCK_D=_boundary_block_d(dim), num_warps=4, enable_fp_fusion=False,
    )


@dataclass(frozen=True, eq=False)
class BoundaryOperands:
    """The operands of `mhc_boundary_` but the site output y, for the linear that computes y and runs
    the boundary in its epilogue (`exact_mm.ExactMM.__call__(boundary=)`): each field as the
    argument of that name, plan required (the epilogue takes its workspace and counters, and adds
    the squares in its chunks' order)."""
    x: torch.Tensor
    post: torch.Tensor
    comb: torch.Tensor
    pre: torch.Tensor
    norm_weight: torch.Tensor
    eps: float
    x_out: torch.Tensor
    u_out: torch.Tensor
    codes_out: torch.Tensor
    scales_out: torch.Tensor
    plan: MhcBoundaryPlan

    def check(self, y: torch.Tensor) -> None:
        """`mhc_boundary_`'s checks of a call on y with these operands (errors naming the argument),
        and a plan present."""
        if not isinstance(self.plan, MhcBoundaryPlan):
            raise TypeError(f"boundary.plan must be an MhcBoundaryPlan, got {type(self.plan).__name__}")
        check_boundary_call(y, self.x, self.post, self.comb, self.pre, self.norm_weight, self.eps, self.x_out,
                            self.u_out, self.codes_out, self.scales_out, self.plan)

    def launch(self, y: torch.Tensor, release: bool = False, pdl: bool = False) -> None:
        """The boundary on y as its own launch: `mhc_boundary_(y, ..., release=release, pdl=pdl)` with
        these operands."""
        mhc_boundary_(y, self.x, self.post, self.comb, self.pre, self.norm_weight, self.eps, self.x_out,
                      self.u_out, self.codes_out, self.scales_out, self.plan, release=release, pdl=pdl)


def mhc_enter_(x: torch.Tensor, pre: torch.Tensor, norm_weight: torch.Tensor, eps: float, u_out: torch.Tensor,
               codes_out: torch.Tensor, scales_out: torch.Tensor) -> None:
    """The first site's input, without a post-mix before it: u_out = rms_norm(hc_pre(x, pre),
    norm_weight, eps) and (codes_out, scales_out) = mxfp8_quantize(u_out). One launch, one program
    per row (a row's bits do not depend on the other rows), nothing allocated, no host sync.

    x: [N, 4, dim] bfloat16 streams (any strides but a unit last one); pre: [N, 4] float32;
    norm_weight: [dim] bfloat16 or float32; eps: a float; u_out: [N, dim] bfloat16, the collapse
    bitwise hc_pre, the RMSNorm within one BF16 ulp of rms_norm (as `mhc_boundary_`); codes_out:
    [N, dim] float8_e4m3fn (or uint8); scales_out: [N, dim/32] uint8 (or float8_e8m0fnu): bitwise
    formats.mxfp8_quantize(u_out). The outputs must not overlap x (checked).
    """
    n, _, dim = require_ndim(x, "x", "[N, 4, dim]")
    if dim % 32 or dim == 0:
        raise ValueError(f"x: dim={dim} must be a positive multiple of 32 (the MXFP8 block)")
    dev = x.device
    require_tensor(x, "x", (torch.bfloat16,), (n, HC, dim), dev)
    require_tensor(pre, "pre", (torch.float32,), (n, HC), dev)
    require_tensor(norm_weight, "norm_weight", (torch.bfloat16, torch.float32), (dim,), dev)
    require_tensor(u_out, "u_out", (torch.bfloat16,), (n, dim), dev)
    require_tensor(codes_out, "codes_out", (torch.float8_e4m3fn, torch.uint8), (n, dim), dev)
    require_tensor(scales_out, "scales_out", (torch.uint8, torch.float8_e8m0fnu), (n, dim // 32), dev)
    if not isinstance(eps, (int, float)) or isinstance(eps, bool):
        raise TypeError(f"eps must be a float, got {type(eps).__name__}")
    for out, out_name in ((u_out, "u_out"), (codes_out, "codes_out"), (scales_out, "scales_out")):
        _require_disjoint(out, out_name, x, "x")
    if n == 0:
        return
    u, codes, scales = u_out.view(torch.int16), codes_out.view(torch.uint8), scales_out.view(torch.uint8)
    _mhc_boundary_kernel[(n,)](     # POST=False: y, post, comb and x_out unread (x stands in for them)
        x, x, pre, pre, pre, norm_weight, x, u, codes, scales, float(eps),
        0, x.stride(0), x.stride(1), 0, 0, 0, pre.stride(0), 0, 0, u.stride(0), codes.stride(0),
        scales.stride(0), D=dim, BLOCK_D=_boundary_block_d(dim), POST=False, num_warps=4, enable_fp_fusion=False,
    )


def mhc_boundary(y: torch.Tensor, x: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, pre: torch.Tensor,
                 norm_weight: torch.Tensor, eps: float, plan: MhcBoundaryPlan | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x_out, u, codes, scales) of `mhc_boundary_`: new streams [N, 4, dim] bfloat16, the next input
    [N, dim] bfloat16, its MXFP8 codes [N, dim] float8_e4m3fn and scales [N, dim/32] uint8."""
    n, dim = require_ndim(y, "y", "[N, dim]")
    x_out = torch.empty(n, HC, dim, dtype=torch.bfloat16, device=y.device)
    u = torch.empty(n, dim, dtype=torch.bfloat16, device=y.device)
    codes = torch.empty(n, dim, dtype=torch.float8_e4m3fn, device=y.device)
    scales = torch.empty(n, dim // 32, dtype=torch.uint8, device=y.device)
    mhc_boundary_(y, x, post, comb, pre, norm_weight, eps, x_out, u, codes, scales, plan)
    return x_out, u, codes, scales
