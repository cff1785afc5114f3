"""The contract-exact low-batch MXFP8 linear on CUDA cores: y[M, N] = MXFP8 activation x FP8 weight
with 32x32 UE8M0 block scales, for 1 <= M <= 64 rows, bitwise equal to `reference.linear.mxfp8_mm`.

The contract (docs/contract.md, docs/spec-decisions.md decision 1): each 32-wide K block's dot
product of E4M3 codes is computed exactly and rounded once to FP32 (round to nearest even), scaled
by sx[m, kb] then sw[n // 32, kb], and added in K order into an FP32 accumulator that starts at 0;
the sum is rounded to BF16 (or left FP32). Hopper's FP8 tensor-core MMA truncates while it adds a
block's products, so `ops.low_latency_mm` misses that bit pattern on a few percent of its outputs;
this op gets it on CUDA cores:

- a product p of two E4M3 values is exact in FP32 (4 + 4 significant bits), a multiple of 2^-18
  with |p| <= 448^2 < 2^18;
- with S = 1.5 * 2^23, h = (p + S) - S is p rounded to an integer (p + S lies in [2^23, 2^24), where
  the FP32 spacing is 1) and l = p - h is exact (a multiple of 2^-18, |l| <= 1/2);
- the h of a block sum exactly in FP32 in any order (integers, |sum| <= 32 * 448^2 < 2^23), and so
  do the l (multiples of 2^-18 of magnitude <= 16: 22 bits); RN(H + L) is then the exact block sum
  rounded once, the contract's block partial.

The kernel chains the split over 16 consecutive products (`_chain_asm`): q starts at S and takes
q' = RN(q + p), one FMA, which is S plus an integer as long as the 16 rounded products stay below
2^22 in magnitude; the residue p - (q' - q) is exact, one more FMA, so H = q - S and L = the sum
of the residues are exact: 4 FP32 instructions per product (FMA, subtract, FMA, add) against 5 for
the split above. On the GPU it is inline PTX with explicit rounding (nothing contracts into or out
of it); the interpreter runs the plain split by default (the same block sums, fewer operations)
and the chain's steps as Triton operations when asked (the tests), which round as the FMAs do
because each product is exact.

With `ExactConfig.f64` each block's dot runs on the FP64 cores instead (`_block_sums_f64`): one
DFMA per product, the weight's codes made FP64 operands (value x 2^-1016) by integer operations
(`HI_WORDS_PTX`; the interpreter converts through FP32) and x's through FP32; every partial sum of
a block is exact in FP64, and one conversion of the block's sum (times 2^1016) to FP32 rounds it
once: the same partial. On the GPU the weight's two NaN codes read as +-480 there (as in
`gluon_exact_fma`), so a block holding one gives a finite term unless its scale byte is 255 (the
reference's term is NaN). The plans take it only where FP64 runs at full rate
(`exact_mm_plan.planned_config`, `common.full_rate_fp64`).

Layout: each program owns BLOCK_N weight rows and every row of x, and streams K in steps of
BLOCK_K bytes per weight row (16-byte cp.async loads, `num_stages` pipelining). On sm_90 Triton
gives each thread 32 consecutive K of a weight row (one whole block, two chains) for
BLOCK_N * BLOCK_K / (1024 * num_warps) weight rows, which share the thread's converted activation;
the threads of a program split a step's K among them. Each block's partial is scaled where it was
computed (by sx, then by sw in a separate `mul.rn`, so that it is never fused into the
accumulator's add), then the step's BLOCK_K / 32 block terms of a weight row are gathered (one
trip through shared memory) and added to the accumulator one by one in K order: the FP32 sum is
the reference's sequential one. Optionally (ExactConfig.split, calls of at most 4 rows) several
programs share a tile's K: each stores its block terms in a plan-owned workspace and the tile's
last program to arrive (an atomic counter, reset for the next call) adds all of them in K order
from 0, the same sequential sum (never partial sums added together). The rows of x go
through in passes of ROWS (1, 2 or 4) that share each converted weight tile; with more rows than
a pass the program streams its weight rows once per pass (the repeats come from L2). Every
configuration and every row count gives the same bits (`reduction_order`).

The query RoPE epilogue (`rope=(cos, sin)`, the step's wq_b): the program that stores a row of a
tile (with a K split the last arriver) rounds it to BF16 and, where the tile holds a head's
channels 448..511, rotates their pairs (`kv_write.rope_tile` on a one-row tile; inline PTX
mul.rn / sub.rn / add.rn on the GPU, since the kernel compiles with fp fusion on): the bits of the
call followed by `kv_write.query_rope_`.

The mHC boundary epilogue (`boundary=mhc.BoundaryOperands(...)`; the step's wo_b at TP1 where
ExactMM runs it, with `DecodeStep(fold_boundary=True)`): after storing a row of a tile, the same
program post-mixes the rounded row into the new streams and parks its collapse
(`mhc.tile_boundary`); the last tile of each chunk of the boundary's plan to arrive sums the
chunk's squares, the last chunk of the row normalizes and quantizes the row (per-row and
per-chunk counters, reset by their last arrivers): the bits of the call followed by
`mhc.mhc_boundary_` with that plan. Such a launch compiles without fp fusion (the boundary rounds
each product and sum; the K loop is inline PTX either way) and, for the configurations in
`exact_mm_plan._BOUNDARY_MAXNREG`, under the plain kernel's register count.

An `ExactMM` plan binds one weight and its launch configurations once (`ops.exact_mm_plan`: the
configurations and the measured plans); calling it only launches.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .checks import interpreting, mxfp8_linear_args, mxfp8_weight_args, rope_epilogue_args
from .common import column, full_rate_fp64, num_sms, plan_workspace
from .exact_mm_plan import _BOUNDARY_MAXNREG, _ROW_BUCKETS, ExactConfig, planned_config
from .fp4 import bf16_round
from .kv_write import rope_tile
from .mhc import BoundaryOperands, MhcBoundaryPlan, _boundary_block_d, tile_boundary
from .pdl import enter as pdl_enter, launch_options as pdl_launch_options, prefetch_rows_l2
from .pdl import require_supported as require_pdl
from .rounding import bf16_rne_bits, to_f32, ue8m0_to_fp32

MAX_ROWS = 64


def _chain_asm(n: int) -> str:
    """Inline PTX summing n products exactly, chained: operands $2 .. $(n+1) the weights and
    $(n+2) .. $(2n+1) the activations (FP32 E4M3 values); results $0 = H, an integer, and $1 = L, a
    multiple of 2^-18, with H + L the exact sum. q runs from S = 1.5 * 2^23 through q' = RN(q + p),
    an integer in [2^23, 2^24): each step moves q by at most |p| + 1/2, so |q - S| <= n * (448^2 +
    1/2) < 2^22 for n <= 16; each step's residue p - (q' - q) is exact (a multiple of 2^-18, at
    most 1/2 in magnitude, by one FMA); H = q - S, L = the residues' sum (at most 8 in magnitude:
    21 bits, exact). 4 FP32 instructions per product (3 for the first), 1 more for H."""
    s = "0f4B400000"
    lines = ["{", ".reg .f32 q, t, d, r;", f"fma.rn.f32 q, $2, ${n + 2}, {s};", f"sub.rn.f32 d, {s}, q;",
             f"fma.rn.f32 $1, $2, ${n + 2}, d;"]
    for i in range(1, n):
        lines += [f"fma.rn.f32 t, ${2 + i}, ${n + 2 + i}, q;", "sub.rn.f32 d, q, t;",
                  f"fma.rn.f32 r, ${2 + i}, ${n + 2 + i}, d;", "add.rn.f32 $1, $1, r;", "mov.f32 q, t;"]
    return "\n\t".join(lines + [f"sub.rn.f32 $0, q, {s};", "}"])


_CHAIN16_ASM: tl.constexpr = tl.constexpr(_chain_asm(16))
_CHAIN16_CONSTRAINTS: tl.constexpr = tl.constexpr("=f,=f," + ",".join(["f"] * 32))

@triton.jit
def _split16(t):
    """The 16 tensors t[..., 16 i + c] for c = 0 .. 15 (in a fixed order), of t [..., 16 I]: each thread
    holds 16 consecutive K of the loaded tile, so the splits move no data."""
    t = tl.reshape(t, t.shape[:-1] + [t.shape[-1] // 16, 2, 2, 2, 2])
    a, b = tl.split(t)
    a0, a1 = tl.split(a)
    b0, b1 = tl.split(b)
    a00, a01 = tl.split(a0)
    a10, a11 = tl.split(a1)
    b00, b01 = tl.split(b0)
    b10, b11 = tl.split(b1)
    c0, c1 = tl.split(a00)
    c2, c3 = tl.split(a01)
    c4, c5 = tl.split(a10)
    c6, c7 = tl.split(a11)
    c8, c9 = tl.split(b00)
    c10, c11 = tl.split(b01)
    c12, c13 = tl.split(b10)
    c14, c15 = tl.split(b11)
    return c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15


@triton.jit
def _chain16(ws, xs):
    """(H, L) of `_chain_asm(16)` from Triton operations (the interpreter's path, which runs no
    inline PTX): the same values, since each product w * x is exact in FP32, so rounding it and then
    adding rounds exactly like the FMA."""
    S: tl.constexpr = 12582912.0          # 1.5 * 2^23
    q = ws[0] * xs[0] + S
    lo = ws[0] * xs[0] + (S - q)
    for i in tl.static_range(1, 16):
        t = ws[i] * xs[i] + q
        lo += ws[i] * xs[i] + (q - t)
        q = t
    return q - S, lo


@triton.jit
def _block_sums(w, x, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, CHAIN: tl.constexpr, ASM: tl.constexpr):
    """part[n, j] = RN(sum over the 32 k of block j of w[n, k] * x[k]), exact before its one rounding.

    w: [BLOCK_N, BLOCK_K] FP32 E4M3 values; x: [BLOCK_K] FP32 E4M3 values. CHAIN: each 16
    consecutive k of a weight row go through the chained split (`_chain_asm`: inline PTX with ASM,
    else the same steps as Triton operations); a block's two H (integers below 2^22) and two L
    (multiples of 2^-18 below 8) add exactly. Else (the interpreter's default: fewer, larger
    operations) the plain split of every product. Either way H + L is the exact block sum, rounded
    once: the same part."""
    SUB: tl.constexpr = BLOCK_K // 32
    if CHAIN:
        ws = _split16(w)
        xs = _split16(tl.broadcast_to(x[None, :], [BLOCK_N, BLOCK_K]))
        if ASM:
            h, lo = tl.inline_asm_elementwise(_CHAIN16_ASM, _CHAIN16_CONSTRAINTS, ws + xs,
                                              dtype=(tl.float32, tl.float32), is_pure=True, pack=1)
        else:
            h, lo = _chain16(ws, xs)
        h = tl.reshape(h, [BLOCK_N, SUB, 2])
        lo = tl.reshape(lo, [BLOCK_N, SUB, 2])
    else:
        S: tl.constexpr = 12582912.0      # 1.5 * 2^23
        p = w * x[None, :]                # exact
        h = (p + S) - S                   # p rounded to an integer
        lo = p - h                        # exact: a multiple of 2^-18, |lo| <= 1/2
        h = tl.reshape(h, [BLOCK_N, SUB, 32])
        lo = tl.reshape(lo, [BLOCK_N, SUB, 32])
    return tl.sum(h, axis=2) + tl.sum(lo, axis=2)


# The high 32-bit words of the FP64 patterns value * 2^-1016 of four E4M3 codes ($4, one 32-bit word):
# with A = W << 1, per code j one prmt (byte 3: W's byte j, the sign at bit 31; byte 2: A's byte j,
# eeee.mmm at bits 23..17) and one `and` with 0x80FE0000 (the bits between, bytes 1..0 cleared). With
# a zero low word that is the code's sign at bit 63 and eeee.mmm at bits 55..49: the E4M3 value times
# 2^-1016, exactly (an E4M3 subnormal 0.mmm x 2^-6 lands on the FP64 subnormal 0.mmm x 2^-1022; the
# NaN codes 0x7F / 0xFF read as +-480). `gluon_exact_fma` builds its weight operands with it too.
HI_WORDS_PTX = """{
        .reg .b32 a;
        shl.b32 a, $4, 1;
        prmt.b32 $0, $4, a, 0x0400;
        and.b32 $0, $0, 0x80FE0000;
        prmt.b32 $1, $4, a, 0x1500;
        and.b32 $1, $1, 0x80FE0000;
        prmt.b32 $2, $4, a, 0x2600;
        and.b32 $2, $2, 0x80FE0000;
        prmt.b32 $3, $4, a, 0x3700;
        and.b32 $3, $3, 0x80FE0000;
        }"""
_HI_WORDS_PTX: tl.constexpr = tl.constexpr(HI_WORDS_PTX)


@triton.jit
def _f64_codes(codes, ASM: tl.constexpr):
    """E4M3 codes (float8e4nv, each thread's codes in runs of 4 consecutive elements) as FP64 values
    times 2^-1016, exactly: with ASM the patterns' high words by integer operations (`HI_WORDS_PTX`,
    2.25 instructions a code) beside a zero low word; else (the interpreter) through FP32 and one
    exact FP64 product (an FP64 subnormal for |value| < 2^-6, whose spacing 2^-1074 divides
    2^-1025, the E4M3 values' 2^-9 times 2^-1016)."""
    if ASM:
        hi = tl.inline_asm_elementwise(_HI_WORDS_PTX, "=r,=r,=r,=r,r", [codes.to(tl.int8, bitcast=True)],
                                       dtype=tl.int32, is_pure=True, pack=4)
        return (hi.to(tl.int64) << 32).to(tl.float64, bitcast=True)
    else:
        return codes.to(tl.float32).to(tl.float64) * tl.full(codes.shape, 2.0 ** -1016, tl.float64)


@triton.jit
def _block_sums_f64(w, x0, x1, x2, x3, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """part_r[n, j] = RN(sum over the 32 k of block j of w[n, k] * x_r[k]) for the pass's ROWS rows
    of x (1, 2 or 4; the unused x_r are ignored), exact before its one rounding, on the FP64 cores.

    w: [BLOCK_N, BLOCK_K] FP64, the weight's E4M3 values times 2^-1016 (`_f64_codes`); x_r:
    [BLOCK_K] FP64, row r's E4M3 values. A product is the true one times 2^-1016, a multiple of
    2^-1034 below 2^-998 in magnitude: every partial sum of a block's products is such a multiple
    below 2^-993 (32 * 448^2 < 2^23 times 2^-1016), whose FP64 spacing is at most 2^-1046, so every
    FMA and add of the block is exact, in any order. Each 16 consecutive k of a weight row chain one
    FMA each (the rows' chains interleaved, so that each weight operand is built once and used
    ROWS times at once); the two chains of a block add exactly; times 2^1016 (exact) the block's
    true sum, which one conversion to FP32 rounds once (to nearest even): `_block_sums`' part."""
    SUB: tl.constexpr = BLOCK_K // 32
    ws = _split16(w)
    xs0 = _split16(tl.broadcast_to(x0[None, :], [BLOCK_N, BLOCK_K]))
    s0 = ws[0] * xs0[0]
    if ROWS >= 2:
        xs1 = _split16(tl.broadcast_to(x1[None, :], [BLOCK_N, BLOCK_K]))
        s1 = ws[0] * xs1[0]
    if ROWS >= 4:
        xs2 = _split16(tl.broadcast_to(x2[None, :], [BLOCK_N, BLOCK_K]))
        xs3 = _split16(tl.broadcast_to(x3[None, :], [BLOCK_N, BLOCK_K]))
        s2 = ws[0] * xs2[0]
        s3 = ws[0] * xs3[0]
    for i in tl.static_range(1, 16):
        s0 = tl.fma(ws[i], xs0[i], s0)
        if ROWS >= 2:
            s1 = tl.fma(ws[i], xs1[i], s1)
        if ROWS >= 4:
            s2 = tl.fma(ws[i], xs2[i], s2)
            s3 = tl.fma(ws[i], xs3[i], s3)
    p0 = _f64_part(s0, BLOCK_N, SUB)
    p1 = p0
    p2 = p0
    p3 = p0
    if ROWS >= 2:
        p1 = _f64_part(s1, BLOCK_N, SUB)
    if ROWS >= 4:
        p2 = _f64_part(s2, BLOCK_N, SUB)
        p3 = _f64_part(s3, BLOCK_N, SUB)
    return p0, p1, p2, p3


@triton.jit
def _f64_part(s, BLOCK_N: tl.constexpr, SUB: tl.constexpr):
    """[BLOCK_N, SUB] FP32 block partials from the FP64 chains s ([BLOCK_N, 2 SUB], a block's two
    consecutive): their exact sum, times 2^1016, rounded once to FP32."""
    s = tl.sum(tl.reshape(s, [BLOCK_N, SUB, 2]), axis=2)
    return (s * tl.full(s.shape, 2.0 ** 1016, tl.float64)).to(tl.float32)


@triton.jit
def _x_f64(x_row, k0, BLOCK_K: tl.constexpr):
    """Row x_row's codes k0 .. k0 + BLOCK_K as FP64 values, through FP32 (exact; a NaN code stays NaN)."""
    return to_f32(tl.load(x_row + k0 + tl.arange(0, BLOCK_K))).to(tl.float64)


@triton.jit
def _mul_rn(a, b, ASM: tl.constexpr):
    """a * b rounded to FP32, never fused into a following add (inline PTX `mul.rn`, which ptxas
    does not contract; the interpreter never contracts)."""
    if ASM:
        return tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=f,f,f", [a, b], dtype=tl.float32,
                                         is_pure=True, pack=1)
    else:
        return a * b


@triton.jit
def _row_step(acc, w, x_row, sx_row, sw, k0, ws_row, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
              SPLIT: tl.constexpr, CHAIN: tl.constexpr, ASM: tl.constexpr):
    """acc + the step's block terms of one row of x, added in K order: acc [BLOCK_N] FP32; w the
    step's [BLOCK_N, BLOCK_K] weight tile in FP32, sw its [BLOCK_N, BLOCK_K / 32] scales in FP32;
    x_row / sx_row this row's codes and scale bytes. With SPLIT > 1 the terms are stored instead,
    at ws_row[kb * BLOCK_N + n], for the tile's last program to add (`_sum_terms`)."""
    x = to_f32(tl.load(x_row + k0 + tl.arange(0, BLOCK_K)))
    part = _block_sums(w, x, BLOCK_N, BLOCK_K, CHAIN, ASM)                                  # [BN, SUB]
    return _row_terms(acc, part, sx_row, sw, k0, ws_row, BLOCK_N, BLOCK_K, SPLIT, ASM)


@triton.jit
def _row_terms(acc, part, sx_row, sw, k0, ws_row, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               SPLIT: tl.constexpr, ASM: tl.constexpr):
    """acc + the step's block terms of one row of x from its block partials part [BLOCK_N,
    BLOCK_K / 32] (FP32): each scaled by sx then sw, added in K order, or with SPLIT > 1 stored at
    ws_row[kb * BLOCK_N + n] (`_row_step`)."""
    SUB: tl.constexpr = BLOCK_K // 32
    # The block scales in the layout of the partials: loaded per (row, block, half) like the split's
    # outputs and reduced over the two halves (equal bytes), which moves no data between layouts.
    r2 = tl.arange(0, 2)
    sx_ptrs = sx_row + k0 // 32 + (tl.arange(0, SUB)[:, None] + 0 * r2[None, :])[None, :, :] \
        + 0 * tl.arange(0, BLOCK_N)[:, None, None]
    sx = ue8m0_to_fp32(tl.max(tl.load(sx_ptrs), axis=2).to(tl.int32))                   # [BN, SUB]
    # The reference's order: partial * sx * sw, then the K-ordered FP32 sum.
    term = _mul_rn(part * sx, sw, ASM)
    if SPLIT > 1:
        tl.store(ws_row + (k0 // 32 + tl.arange(0, SUB))[None, :] * BLOCK_N + tl.arange(0, BLOCK_N)[:, None], term)
    else:
        for j in tl.static_range(SUB):
            acc += column(term, j, SUB)
    return acc


@triton.jit
def _sum_terms(ws_row, KB, BLOCK_N: tl.constexpr, SUB: tl.constexpr):
    """The K-ordered FP32 sum from 0 of the KB block terms of one row of x, ws_row[kb * BLOCK_N + n],
    [BLOCK_N]: SUB of them per load (from L2, .cg: written by the tile's other programs)."""
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    offs = tl.arange(0, SUB)[None, :] * BLOCK_N + tl.arange(0, BLOCK_N)[:, None]
    for kb0 in range(0, KB, SUB):
        t = tl.load(ws_row + kb0 * BLOCK_N + offs, cache_modifier=".cg")
        for j in tl.static_range(SUB):
            acc += column(t, j, SUB)
    return acc


@triton.jit
def _store_row(y_ptr, acc, off_n, rn, row, M, N, stride_ym, OUT_F32: tl.constexpr, cos_ptr, sin_ptr, stride_cm,
               stride_sm, ROPE: tl.constexpr, ASM: tl.constexpr):
    """y[row, rn] = bf16(acc) (y_ptr at int16: the BF16 bits), or acc itself with OUT_F32, where
    row < M and rn < N; rn: the tile's BLOCK_N columns from off_n (even). ROPE: the query RoPE on
    the rounded row first where the tile holds a head's channels 448..511 (`kv_write.rope_tile` on
    a one-row tile, cos/sin row `row`; explicitly rounded operations with ASM): the bits of
    `kv_write.query_rope_` on the stored row."""
    mask = (rn < N) & (row < M)
    if OUT_F32:
        tl.store(y_ptr + row * stride_ym + rn, acc, mask=mask)
    elif ROPE:
        BLOCK_N: tl.constexpr = acc.shape[0]
        yb = bf16_round(acc)
        if off_n % 512 + BLOCK_N > 448:
            yb = tl.reshape(rope_tile(tl.reshape(yb, [BLOCK_N, 1]), off_n, row + tl.arange(0, 1), M, cos_ptr, sin_ptr,
                                      stride_cm, stride_sm, BLOCK_N, 1, ASM), [BLOCK_N])
        tl.store(y_ptr + row * stride_ym + rn, bf16_rne_bits(yb), mask=mask)
    else:
        tl.store(y_ptr + row * stride_ym + rn, bf16_rne_bits(acc), mask=mask)


@triton.jit
def _store_rows(y_ptr, acc0, acc1, acc2, acc3, off_n, rn, m0, M, N, stride_ym, ROWS: tl.constexpr,
                OUT_F32: tl.constexpr, cos_ptr, sin_ptr, stride_cm, stride_sm, ROPE: tl.constexpr, ASM: tl.constexpr):
    """`_store_row` of the pass's ROWS rows m0, m0 + 1, ... (acc0 .. acc3)."""
    _store_row(y_ptr, acc0, off_n, rn, m0, M, N, stride_ym, OUT_F32, cos_ptr, sin_ptr, stride_cm, stride_sm, ROPE, ASM)
    if ROWS >= 2:
        _store_row(y_ptr, acc1, off_n, rn, m0 + 1, M, N, stride_ym, OUT_F32, cos_ptr, sin_ptr, stride_cm, stride_sm,
                   ROPE, ASM)
    if ROWS >= 4:
        _store_row(y_ptr, acc2, off_n, rn, m0 + 2, M, N, stride_ym, OUT_F32, cos_ptr, sin_ptr, stride_cm, stride_sm,
                   ROPE, ASM)
        _store_row(y_ptr, acc3, off_n, rn, m0 + 3, M, N, stride_ym, OUT_F32, cos_ptr, sin_ptr, stride_cm, stride_sm,
                   ROPE, ASM)


@triton.jit
def _boundary_row(acc, off_n, row, M, bx_ptr, post_ptr, comb_ptr, pre_ptr, nw_ptr, xo_ptr, u_ptr, codes_ptr,
                  scales_ptr, bws_ptr, bcnt_ptr, ccnt_ptr, eps, stride_bxn, stride_bxh, stride_post, stride_cn,
                  stride_ci, stride_pre, stride_xon, stride_xoh, stride_u, stride_codes, stride_scales, stride_bws,
                  stride_ccnt, DIM: tl.constexpr, BD: tl.constexpr, NCH: tl.constexpr, NCH_P2: tl.constexpr,
                  TAIL: tl.constexpr):
    """`mhc.tile_boundary` of output row `row` (where row < M) on its BF16-rounded sums acc, the
    tile's columns from off_n: the site output's post-mix into the new streams, and the row's last
    tile to arrive finishing the next input (norm, MXFP8) as `mhc_boundary_` does."""
    if row < M:
        tile_boundary(bf16_round(acc), row, off_n, bx_ptr, post_ptr, comb_ptr, pre_ptr, nw_ptr, xo_ptr, u_ptr,
                      codes_ptr, scales_ptr, bws_ptr, bcnt_ptr, ccnt_ptr, eps, stride_bxn, stride_bxh, stride_post,
                      stride_cn, stride_ci, stride_pre, stride_xon, stride_xoh, stride_u, stride_codes,
                      stride_scales, stride_bws, stride_ccnt, DIM, BD, NCH, NCH_P2, TAIL)


@triton.jit
def _boundary_rows(acc0, acc1, acc2, acc3, off_n, m0, M, ROWS: tl.constexpr, bx_ptr, post_ptr, comb_ptr, pre_ptr,
                   nw_ptr, xo_ptr, u_ptr, codes_ptr, scales_ptr, bws_ptr, bcnt_ptr, ccnt_ptr, eps, stride_bxn,
                   stride_bxh, stride_post, stride_cn, stride_ci, stride_pre, stride_xon, stride_xoh, stride_u,
                   stride_codes, stride_scales, stride_bws, stride_ccnt, DIM: tl.constexpr, BD: tl.constexpr,
                   NCH: tl.constexpr, NCH_P2: tl.constexpr, TAIL: tl.constexpr):
    """`_boundary_row` of the pass's ROWS rows m0, m0 + 1, ... (acc0 .. acc3)."""
    _boundary_row(acc0, off_n, m0, M, bx_ptr, post_ptr, comb_ptr, pre_ptr, nw_ptr, xo_ptr, u_ptr, codes_ptr,
                  scales_ptr, bws_ptr, bcnt_ptr, ccnt_ptr, eps, stride_bxn, stride_bxh, stride_post, stride_cn,
                  stride_ci, stride_pre, stride_xon, stride_xoh, stride_u, stride_codes, stride_scales, stride_bws,
                  stride_ccnt, DIM, BD, NCH, NCH_P2, TAIL)
    if ROWS >= 2:
        _boundary_row(acc1, off_n, m0 + 1, M, bx_ptr, post_ptr, comb_ptr, pre_ptr, nw_ptr, xo_ptr, u_ptr, codes_ptr,
                      scales_ptr, bws_ptr, bcnt_ptr, ccnt_ptr, eps, stride_bxn, stride_bxh, stride_post, stride_cn,
                      stride_ci, stride_pre, stride_xon, stride_xoh, stride_u, stride_codes, stride_scales,
                      stride_bws, stride_ccnt, DIM, BD, NCH, NCH_P2, TAIL)
    if ROWS >= 4:
        _boundary_row(acc2, off_n, m0 + 2, M, bx_ptr, post_ptr, comb_ptr, pre_ptr, nw_ptr, xo_ptr, u_ptr, codes_ptr,
                      scales_ptr, bws_ptr, bcnt_ptr, ccnt_ptr, eps, stride_bxn, stride_bxh, stride_post, stride_cn,
                      stride_ci, stride_pre, stride_xon, stride_xoh, stride_u, stride_codes, stride_scales,
                      stride_bws, stride_ccnt, DIM, BD, NCH, NCH_P2, TAIL)
        _boundary_row(acc3, off_n, m0 + 3, M, bx_ptr, post_ptr, comb_ptr, pre_ptr, nw_ptr, xo_ptr, u_ptr, codes_ptr,
                      scales_ptr, bws_ptr, bcnt_ptr, ccnt_ptr, eps, stride_bxn, stride_bxh, stride_post, stride_cn,
                      stride_ci, stride_pre, stride_xon, stride_xoh, stride_u, stride_codes, stride_scales,
                      stride_bws, stride_ccnt, DIM, BD, NCH, NCH_P2, TAIL)


# The row count, the scale and cos/sin strides and the split size take no part in vectorization:
# leaving them unspecialized keeps one compiled kernel per configuration for every row count.
@triton.jit(do_not_specialize=["M", "stride_sxm", "stride_swn", "steps_per_split", "stride_cm", "stride_sm"])
def _exact_mm_kernel(
    x_ptr, sx_ptr, w_ptr, sw_ptr, y_ptr, ws_ptr, cnt_ptr,
    M, N, K, stride_xm, stride_sxm, stride_wn, stride_swn, stride_ym, steps_per_split,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ROWS: tl.constexpr, OUT_F32: tl.constexpr,
    SPLIT: tl.constexpr = 1, STAGES: tl.constexpr = 3, CHAIN: tl.constexpr = True, ASM: tl.constexpr = True,
    F64: tl.constexpr = False,
    cos_ptr=None, sin_ptr=None, stride_cm=None, stride_sm=None, ROPE: tl.constexpr = False,
    bx_ptr=None, post_ptr=None, comb_ptr=None, pre_ptr=None, nw_ptr=None, xo_ptr=None, u_ptr=None, codes_ptr=None,
    scales_ptr=None, bws_ptr=None, bcnt_ptr=None, ccnt_ptr=None, eps=None, stride_bxn=None, stride_bxh=None,
    stride_post=None, stride_cn=None, stride_ci=None, stride_pre=None, stride_xon=None, stride_xoh=None,
    stride_u=None, stride_codes=None, stride_scales=None, stride_bws=None, stride_ccnt=None,
    BOUNDARY: tl.constexpr = False, DIM: tl.constexpr = None, BD: tl.constexpr = None, NCH: tl.constexpr = None,
    NCH_P2: tl.constexpr = None, TAIL: tl.constexpr = None, PDL: tl.constexpr = False,
):
    # Grid: (N tiles, K splits). Program (t, s) covers W rows [t*BLOCK_N, +BLOCK_N) over the K steps
    # [s*steps_per_split, +steps_per_split) and every row of x, ROWS at a time. With one split it
    # adds its block terms in K order itself; with more (one pass: M <= ROWS) every program stores
    # its terms and the tile's last program to arrive adds all of them in K order. ROPE: the query
    # RoPE epilogue (`_store_row`) with cos/sin [M, 32] FP32 at cos_ptr/sin_ptr (row strides
    # stride_cm/stride_sm; all four None without it, so that they take no kernel parameter).
    # BOUNDARY: the mHC boundary epilogue (`_boundary_rows`, after the rows' stores) with the
    # operands of `mhc.BoundaryOperands` (streams bx_ptr, mixer post/comb/pre, norm weight nw_ptr,
    # outputs xo/u/codes/scales, the plan's workspace bws_ptr, row counters bcnt_ptr and chunk
    # counters ccnt_ptr, DIM = N columns in NCH chunks of BD, the row's tail TAIL columns a slice; None
    # without it). PDL: launched by programmatic dependent launch: the program's first weight bytes
    # asked of L2 (constant data), then the wait for the kernel before it, before anything else.
    pid = tl.program_id(0)
    pid_s = tl.program_id(1)
    SUB: tl.constexpr = BLOCK_K // 32
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    rs = tl.arange(0, SUB)
    # Rows past N or M read the last valid row and are masked at the store, so the K loop's loads
    # need no masks and stay 16-byte vectors.
    w_rows = w_ptr + tl.minimum(rn, N - 1) * stride_wn                 # [BN]
    sw_rows = sw_ptr + (tl.minimum(rn, N - 1) // 32) * stride_swn      # [BN]
    # [BN, SUB, 2]: the scale byte of each (row, block, block half), in the layout of `_block_sums`
    sw_ptrs = sw_rows[:, None, None] + rs[None, :, None] + 0 * tl.arange(0, 2)[None, None, :]
    if SPLIT > 1:
        k_lo = pid_s * steps_per_split * BLOCK_K
        k_hi = tl.minimum(k_lo + steps_per_split * BLOCK_K, K)
    else:
        k_lo = 0
        k_hi = K
    prefetch_rows_l2(w_rows + k_lo, k_hi - k_lo, PDL)
    pdl_enter(PDL, RELEASE=False)
    KB = K // 32
    ws_tile = ws_ptr + pid * (ROWS * KB * BLOCK_N)                     # [ROWS, KB, BN] terms
    for m0 in range(0, M, ROWS):
        r0 = tl.minimum(m0, M - 1)
        r1 = tl.minimum(m0 + 1, M - 1)
        r2 = tl.minimum(m0 + 2, M - 1)
        r3 = tl.minimum(m0 + 3, M - 1)
        acc0 = tl.zeros([BLOCK_N], dtype=tl.float32)
        acc1 = tl.zeros([BLOCK_N], dtype=tl.float32)
        acc2 = tl.zeros([BLOCK_N], dtype=tl.float32)
        acc3 = tl.zeros([BLOCK_N], dtype=tl.float32)
        for k0 in tl.range(k_lo, k_hi, BLOCK_K, num_stages=STAGES):
            # (each branch's two loads in the order its measured plans compiled with: the registers)
            if F64:
                sw = ue8m0_to_fp32(tl.max(tl.load(sw_ptrs + k0 // 32), axis=2).to(tl.int32))   # [BN, SUB]
                w = _f64_codes(tl.load(w_rows[:, None] + k0 + rk[None, :]), ASM)           # [BN, BK]
                x0 = _x_f64(x_ptr + r0 * stride_xm, k0, BLOCK_K)
                x1 = x0
                x2 = x0
                x3 = x0
                if ROWS >= 2:
                    x1 = _x_f64(x_ptr + r1 * stride_xm, k0, BLOCK_K)
                if ROWS >= 4:
                    x2 = _x_f64(x_ptr + r2 * stride_xm, k0, BLOCK_K)
                    x3 = _x_f64(x_ptr + r3 * stride_xm, k0, BLOCK_K)
                p0, p1, p2, p3 = _block_sums_f64(w, x0, x1, x2, x3, ROWS, BLOCK_N, BLOCK_K)
                acc0 = _row_terms(acc0, p0, sx_ptr + r0 * stride_sxm, sw, k0, ws_tile, BLOCK_N, BLOCK_K, SPLIT, ASM)
                if ROWS >= 2:
                    acc1 = _row_terms(acc1, p1, sx_ptr + r1 * stride_sxm, sw, k0, ws_tile + KB * BLOCK_N, BLOCK_N,
                                      BLOCK_K, SPLIT, ASM)
                if ROWS >= 4:
                    acc2 = _row_terms(acc2, p2, sx_ptr + r2 * stride_sxm, sw, k0, ws_tile + 2 * KB * BLOCK_N,
                                      BLOCK_N, BLOCK_K, SPLIT, ASM)
                    acc3 = _row_terms(acc3, p3, sx_ptr + r3 * stride_sxm, sw, k0, ws_tile + 3 * KB * BLOCK_N,
                                      BLOCK_N, BLOCK_K, SPLIT, ASM)
            else:
                w = to_f32(tl.load(w_rows[:, None] + k0 + rk[None, :]))           # [BN, BK]
                sw = ue8m0_to_fp32(tl.max(tl.load(sw_ptrs + k0 // 32), axis=2).to(tl.int32))   # [BN, SUB]
                acc0 = _row_step(acc0, w, x_ptr + r0 * stride_xm, sx_ptr + r0 * stride_sxm, sw, k0, ws_tile,
                                 BLOCK_N, BLOCK_K, SPLIT, CHAIN, ASM)
                if ROWS >= 2:
                    acc1 = _row_step(acc1, w, x_ptr + r1 * stride_xm, sx_ptr + r1 * stride_sxm, sw, k0,
                                     ws_tile + KB * BLOCK_N, BLOCK_N, BLOCK_K, SPLIT, CHAIN, ASM)
                if ROWS >= 4:
                    acc2 = _row_step(acc2, w, x_ptr + r2 * stride_xm, sx_ptr + r2 * stride_sxm, sw, k0,
                                     ws_tile + 2 * KB * BLOCK_N, BLOCK_N, BLOCK_K, SPLIT, CHAIN, ASM)
                    acc3 = _row_step(acc3, w, x_ptr + r3 * stride_xm, sx_ptr + r3 * stride_sxm, sw, k0,
                                     ws_tile + 3 * KB * BLOCK_N, BLOCK_N, BLOCK_K, SPLIT, CHAIN, ASM)
        if SPLIT > 1:
            # Every thread's terms are written before one thread's release of the counter.
            tl.debug_barrier()
            arrived = tl.atomic_add(cnt_ptr + pid, 1, sem="acq_rel", scope="gpu")
            if arrived == SPLIT - 1:
                tl.debug_barrier()
                acc0 = _sum_terms(ws_tile, KB, BLOCK_N, SUB)
                if ROWS >= 2:
                    acc1 = _sum_terms(ws_tile + KB * BLOCK_N, KB, BLOCK_N, SUB)
                if ROWS >= 4:
                    acc2 = _sum_terms(ws_tile + 2 * KB * BLOCK_N, KB, BLOCK_N, SUB)
                    acc3 = _sum_terms(ws_tile + 3 * KB * BLOCK_N, KB, BLOCK_N, SUB)
                _store_rows(y_ptr, acc0, acc1, acc2, acc3, pid * BLOCK_N, rn, m0, M, N, stride_ym, ROWS, OUT_F32,
                            cos_ptr, sin_ptr, stride_cm, stride_sm, ROPE, ASM)
                # Zero again for the next call (and a CUDA graph's replay).
                tl.atomic_xchg(cnt_ptr + pid, 0, sem="relaxed", scope="gpu")
                if BOUNDARY:
                    _boundary_rows(acc0, acc1, acc2, acc3, pid * BLOCK_N, m0, M, ROWS, bx_ptr, post_ptr, comb_ptr,
                                   pre_ptr, nw_ptr, xo_ptr, u_ptr, codes_ptr, scales_ptr, bws_ptr, bcnt_ptr, ccnt_ptr,
                                   eps, stride_bxn, stride_bxh, stride_post, stride_cn, stride_ci, stride_pre,
                                   stride_xon, stride_xoh, stride_u, stride_codes, stride_scales, stride_bws,
                                   stride_ccnt, DIM, BD, NCH, NCH_P2, TAIL)
        else:
            _store_rows(y_ptr, acc0, acc1, acc2, acc3, pid * BLOCK_N, rn, m0, M, N, stride_ym, ROWS, OUT_F32,
                        cos_ptr, sin_ptr, stride_cm, stride_sm, ROPE, ASM)
            if BOUNDARY:
                _boundary_rows(acc0, acc1, acc2, acc3, pid * BLOCK_N, m0, M, ROWS, bx_ptr, post_ptr, comb_ptr,
                               pre_ptr, nw_ptr, xo_ptr, u_ptr, codes_ptr, scales_ptr, bws_ptr, bcnt_ptr, ccnt_ptr,
                               eps, stride_bxn, stride_bxh, stride_post, stride_cn, stride_ci, stride_pre, stride_xon,
                               stride_xoh, stride_u, stride_codes, stride_scales, stride_bws, stride_ccnt, DIM, BD,
                               NCH, NCH_P2, TAIL)


def reduction_order(k: int) -> tuple[str, int, int]:
    """What fixes the FP32 summation of every output element: ("exact", K, 32): each 32-wide block's
    exact dot rounded once, the K / 32 block terms added one by one in K order from 0 by one
    program (the tile's; with a K split, the tile's last to arrive). The same for every
    configuration, split and row count: a row's bits depend on nothing but its own operands (and
    equal `reference.linear.mxfp8_mm`'s)."""
    return ("exact", k, 32)


def rope_kwargs(rope, out: torch.Tensor, n: int, m: int, device: torch.device) -> dict:
    """The launch's keyword arguments of the exact linears' query-RoPE epilogue (`ExactMM`,
    `gluon_exact_mm.GluonExactMM`, `gluon_exact_fma.GluonExactFMA`, whose kernels take the same
    names): {} without `rope`; else cos_ptr, sin_ptr, their row strides and ROPE=True, after
    `checks.rope_epilogue_args`' checks of rope = (cos, sin) (errors naming the argument)."""
    if rope is None:
        return {}
    cos, sin = rope_epilogue_args(rope, out, n, m, device)
    return {"cos_ptr": cos, "sin_ptr": sin, "stride_cm": cos.stride(0), "stride_sm": sin.stride(0), "ROPE": True}


def boundary_kwargs(boundary, out: torch.Tensor, block_n: int, num_warps: int) -> dict:
    """The launch's keyword arguments of `ExactMM`'s mHC boundary epilogue: {} without `boundary`;
    else the operands' pointers and strides and `boundary_constexprs`, after the checks (errors
    naming the argument): boundary an `mhc.BoundaryOperands` that suits a boundary on out
    (`BoundaryOperands.check`), out BF16, and the launch's block_n dividing the plan's block_d (a
    tile within one chunk)."""
    if boundary is None:
        return {}
    if not isinstance(boundary, BoundaryOperands):
        raise TypeError(f"boundary must be an mhc.BoundaryOperands, got {type(boundary).__name__}")
    if out.dtype != torch.bfloat16:
        raise ValueError(f"boundary: out must be bfloat16 (the boundary post-mixes the rounded output), "
                         f"got {out.dtype}")
    boundary.check(out)
    plan = boundary.plan
    if plan.block_d % block_n:
        raise ValueError(f"boundary.plan: block_d={plan.block_d} must be a multiple of the launch's "
                         f"block_n={block_n} (a tile within one chunk)")
    b = boundary
    xo, u = b.x_out.view(torch.int16), b.u_out.view(torch.int16)
    codes, scales = b.codes_out.view(torch.uint8), b.scales_out.view(torch.uint8)
    return dict(bx_ptr=b.x, post_ptr=b.post, comb_ptr=b.comb, pre_ptr=b.pre, nw_ptr=b.norm_weight, xo_ptr=xo,
                u_ptr=u, codes_ptr=codes, scales_ptr=scales, bws_ptr=plan.ws, bcnt_ptr=plan.counters,
                ccnt_ptr=plan.chunk_counters, eps=float(b.eps), stride_bxn=b.x.stride(0), stride_bxh=b.x.stride(1),
                stride_post=b.post.stride(0), stride_cn=b.comb.stride(0), stride_ci=b.comb.stride(1),
                stride_pre=b.pre.stride(0), stride_xon=xo.stride(0), stride_xoh=xo.stride(1), stride_u=u.stride(0),
                stride_codes=codes.stride(0), stride_scales=scales.stride(0), stride_bws=plan.ws.stride(0),
                stride_ccnt=plan.chunk_counters.stride(0), **boundary_constexprs(plan, num_warps))


def boundary_constexprs(plan: MhcBoundaryPlan, num_warps: int) -> dict:
    """The boundary epilogue's constexprs for `plan` in a launch of `num_warps` warps: BOUNDARY, the
    plan's chunking (DIM, BD, NCH, NCH_P2) and the tail's slice (`_boundary_tail`)."""
    return dict(BOUNDARY=True, DIM=plan.dim, BD=plan.block_d, NCH=plan.chunks,
                NCH_P2=triton.next_power_of_2(plan.chunks), TAIL=_boundary_tail(plan.dim, num_warps))


def _boundary_tail(dim: int, num_warps: int) -> int:
    """Columns a slice of the boundary's serial tail (the row's last chunk normalizing the row): the
    split launch's slice (`mhc._boundary_block_d`), at most 256 a warp (8 a thread)."""
    return min(256 * num_warps, _boundary_block_d(dim))


@dataclass(frozen=True)
class _Launch:
    config: ExactConfig          # with the launch's rows per pass and its split
    steps_per_split: int
    grid: tuple[int, int]

    @property
    def split(self) -> int:
        return self.config.split


class ExactMM:
    """y[M, N] = bf16(sum over 32-wide K blocks kb, in K order, of RN(codes[:, kb] . weight[:, kb])
    * sx * sw) for 1 <= M <= max_rows <= 64, with the weight bound once: bitwise the contract of
    `reference.linear.mxfp8_mm` (module docstring) for weights without the E4M3 NaN codes (0x7F,
    0xFF; the checkpoint loader refuses them), which the GPU's FP64 block sums read as +-480.
    Reduction order: see `reduction_order`.

    weight: [N, K] float8_e4m3fn, unit stride along K; K a multiple of 32.
    w_scale: [ceil(N/32), K/32] UE8M0 (float8_e8m0fnu or uint8), unit stride along K.
    max_rows: the most rows a call may bring (1..64).
    config: an ExactConfig for every row bucket, or a dict {1|2|4|64: ExactConfig} (64: calls of
        more than 4 rows), instead of the measured / default choice (the probe and the tests use
        it); a bucket takes min(rows, bucket) rows per pass (the bucket with a split).
    workspace: None (the plan allocates its split-K workspace and counters) or a shared pool, as
        `ops.common.plan_workspace` says (FP32 slot 0, int32 slot 0).

    A plan whose launches split K owns (or takes) an FP32 workspace for the block terms and one
    int32 counter per N tile, zero between calls; its calls must not overlap in time (one stream,
    or ordered streams). Without splits it owns nothing that calls share.
    """

    def __init__(self, weight: torch.Tensor, w_scale: torch.Tensor, max_rows: int = MAX_ROWS,
                 config: ExactConfig | dict[int, ExactConfig] | None = None, workspace=None):
        n, k = mxfp8_weight_args(weight, w_scale, max_rows, MAX_ROWS)
        self.weight, self.w_scale = weight, w_scale.view(torch.uint8)
        self.n, self.k, self.max_rows = n, k, max_rows
        self.device = weight.device

        self._launches: dict[int, _Launch] = {}
        # off the GPU the plans are an H200's (as `CPU_SMS`), whose FP64 runs at full rate
        fp64 = self.device.type != "cuda" or full_rate_fp64(self.device)
        for bucket in _ROW_BUCKETS:
            if not (bucket == 1 or (bucket <= 4 and bucket // 2 < max_rows) or (bucket == 64 and max_rows > 4)):
                continue
            if isinstance(config, dict):
                cfg = config.get(bucket)
                if cfg is None:
                    raise ValueError(f"config has no entry for the row bucket {bucket}")
            elif config is not None:
                cfg = config
            else:
                cfg = planned_config(n, k, bucket, num_sms(self.device), fp64=fp64)
            if not isinstance(cfg, ExactConfig):
                raise TypeError(f"config must be an ExactConfig, got {type(cfg).__name__}")
            if k % cfg.block_k:
                raise ValueError(f"config.block_k={cfg.block_k} must divide K={k}")
            steps = k // cfg.block_k
            split = 1 if bucket > 4 else min(cfg.split, steps)
            # A split launch takes its rows in one pass (the bucket's), so that the workspace holds
            # one pass's terms; more rows than a bucket of 4 pass 4 at a time with one split.
            rows = bucket if split > 1 else min(cfg.rows, bucket)
            per_split = -(-steps // split)
            split = -(-steps // per_split)    # no empty split
            cfg = dataclasses.replace(cfg, rows=rows, split=split)
            self._launches[bucket] = _Launch(cfg, per_split, (-(-n // cfg.block_n), split))
        split = [l for l in self._launches.values() if l.split > 1]
        ws = max((l.grid[0] * l.config.block_n * l.config.rows * (k // 32) for l in split), default=1)
        self._workspace = plan_workspace(workspace, 0, ws, torch.float32, self.device)
        self._counters = plan_workspace(workspace, 0, max((l.grid[0] for l in split), default=1),
                                        torch.int32, self.device)
        # On the GPU the chained split in inline PTX; the interpreter runs the plain split (the same
        # values, fewer operations), or with `_chain` (tests) the chained split's steps.
        self._asm = not interpreting()
        self._chain = self._asm

    def launch_for(self, rows: int) -> _Launch:
        """The launch (configuration, split, grid) used for `rows` rows."""
        return self._launches[1 << (rows - 1).bit_length() if rows <= 4 else 64]

    def reduction_order(self, rows: int) -> tuple[str, int, int]:
        """`reduction_order(K)`: the same for every row count (batch invariance)."""
        return reduction_order(self.k)

    def __call__(self, codes: torch.Tensor, x_scale: torch.Tensor, out: torch.Tensor | None = None,
                 rope: tuple[torch.Tensor, torch.Tensor] | None = None,
                 boundary: BoundaryOperands | None = None, *, pdl: bool = False) -> torch.Tensor:
        """y = codes x weight^T with both block scales, into out: the arguments and the result of
        `LowLatencyMM.__call__` (a float32 out receives the unrounded FP32 sums).

        rope: None, or (cos, sin) [M, 32] float32 of each row's position: y read as [M, N / 512,
            512] queries (N a multiple of 512, BF16 out) gets the query RoPE of
            `kv_write.query_rope_` (dims 448..511 of every head) in the epilogue, by the program
            that stores each tile (with a K split the last arriver) on the BF16-rounded sums: the
            same bits as the call without it followed by that op.
        boundary: None, or an `mhc.BoundaryOperands` (with its plan): y is a site output (BF16 out,
            N = dim) and the mHC boundary after it runs in the epilogue (`mhc.tile_boundary`: the
            program that stores a tile post-mixes it into boundary.x_out, the last tile of each
            chunk, then of each row, to arrive finishes u_out, codes_out and scales_out; the plan's
            counters reset by them): the bits of the call without it followed by
            `mhc_boundary_(out, ...)` with those operands, y stored as well. Not with rope; the
            launch's block_n must divide plan.block_d. Its operands as `mhc_boundary_` checks them.
        pdl: launch by programmatic dependent launch (`ops.pdl`): where the kernel before it on the
            stream lets it (a release), its programs ask L2 for their first weight bytes while that
            kernel runs, then wait for it before anything else; after no such predecessor it runs
            as without pdl. The same values either way. ValueError where PDL is not available
            (`ops.pdl.supported`).
        Returns out.
        """
        if pdl:
            require_pdl(self.device)
        out = mxfp8_linear_args(codes, x_scale, out, self.n, self.k, self.max_rows, self.device)
        if rope is not None and boundary is not None:
            raise ValueError("boundary: the call has a rope epilogue already (one epilogue a call)")
        epilogue = rope_kwargs(rope, out, self.n, codes.shape[0], self.device)
        launch = self.launch_for(codes.shape[0])
        cfg = launch.config
        epilogue.update(boundary_kwargs(boundary, out, cfg.block_n, cfg.num_warps))
        if boundary is not None:
            epilogue["enable_fp_fusion"] = False     # the boundary's products and sums rounded one by one
            if cfg in _BOUNDARY_MAXNREG:
                epilogue["maxnreg"] = _BOUNDARY_MAXNREG[cfg]
        if pdl:
            epilogue.update(PDL=True, **pdl_launch_options(pdl))
        _exact_mm_kernel[launch.grid](
            codes, x_scale.view(torch.uint8), self.weight, self.w_scale,
            out if out.dtype == torch.float32 else out.view(torch.int16), self._workspace, self._counters,
            codes.shape[0], self.n, self.k, codes.stride(0), x_scale.stride(0), self.weight.stride(0),
            self.w_scale.stride(0), out.stride(0), launch.steps_per_split,
            BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, ROWS=cfg.rows, OUT_F32=out.dtype == torch.float32,
            SPLIT=cfg.split, STAGES=cfg.num_stages, CHAIN=self._chain, ASM=self._asm, F64=cfg.f64,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages, **epilogue,
        )
        return out
