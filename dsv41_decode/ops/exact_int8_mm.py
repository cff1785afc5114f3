"""The contract-exact MXFP8 linear on integer tensor cores: y[M, N] = MXFP8 activation x FP8 weight
with 32x32 UE8M0 block scales, for 1 <= M <= 64 rows, bitwise equal to `reference.linear.mxfp8_mm`.

The contract (docs/spec-decisions.md decision 1): each 32-wide K block's dot product of E4M3 codes
is computed exactly and rounded once to FP32 (round to nearest even), scaled by sx[m, kb] then
sw[n // 32, kb], and added in K order into an FP32 accumulator that starts at 0; the sum is rounded
to BF16 (or left FP32). Hopper's FP8 tensor-core MMA truncates while it adds (decision 38), and
`ops.exact_mm` forms the exact sum on CUDA cores at ~4 FP32 instructions per product. This op forms
it on the integer MMA, which adds exactly:

- an E4M3 value v with exponent field e and mantissa field m is X * 2^-9 with the integer
  X = (8 + m) * 2^(e - 1) (e >= 1) or X = m (e = 0): |X| <= 15 * 2^14 < 2^18;
- X splits into three base-2^7 digits, X = X0 + 2^7 X1 + 2^14 X2, each carrying X's sign, so
  |Xi| <= 127: int8 operands (`_digits`);
- a block's exact dot sum_k X_k Y_k * 2^-18 is then sum over digit pairs (i, j) of
  2^(7 (i + j)) D_ij with D_ij = sum_k Xi_k Yj_k, each an int8 x int8 MMA with an int32 sum, exact
  (|D_ij| <= 32 * 127^2 < 2^19): nine MMAs per block into five accumulators by the shift
  i + j = 0 .. 4 (still exact: at most three products per accumulator);
- low = D0 + 2^7 D1 and mid = D2 + 2^7 (D3 + 2^7 D4) are exact in int32 (< 2^28, the digits of
  X2 being at most 15), and S = low + 2^14 mid (< 2^42) is exact in FP64; one conversion to FP32
  rounds it once to nearest even, and the power-of-two factor 2^-18 is exact: the block partial.

Each program owns BLOCK_N weight rows and BLOCK_M rows of x (the weight rows on the MMA's M side,
the tokens as its N: swap-AB) and walks K one 32-wide block at a time (`num_stages` pipelined
loads), adding each block's term partial * sx * sw (a `mul.rn` for the last factor, so that it is
never fused into the add) to its FP32 accumulator in K order from 0: the reference's sequential
sum. Every configuration and row count gives the same bits (`exact_mm.reduction_order`).

An `ExactInt8MM` plan binds one weight and its launch configurations once; calling it only launches.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .checks import interpreting, mxfp8_linear_args, mxfp8_weight_args
from .common import plan_workspace
from .exact_mm import _mul_rn, reduction_order
from .rounding import bf16_rne_bits, ue8m0_to_fp32

MAX_ROWS = 64


def weight_digits(weight: torch.Tensor) -> torch.Tensor:
    """The three int8 digit planes [3, N, K] of an E4M3 weight [N, K] (`_digits`, in torch): for a
    plan that reads them instead of decoding the codes in the kernel (three times the bytes)."""
    c = weight.view(torch.uint8).to(torch.int32)
    e, m = (c >> 3) & 15, c & 7
    a = torch.where(e == 0, m, (m | 8) << (e - 1).clamp(min=0))
    sign = torch.where(c >= 128, -1, 1)
    return torch.stack([sign * (a & 127), sign * ((a >> 7) & 127), sign * (a >> 14)]).to(torch.int8).contiguous()


@triton.jit
def _digits(c):
    """(X0, X1, X2) int8 of E4M3 codes c (uint8): 2^9 * value = X0 + 2^7 X1 + 2^14 X2, each digit
    with the value's sign and magnitude <= 127 (X2 <= 15)."""
    c = c.to(tl.int32)
    e = (c >> 3) & 15
    m = c & 7
    a = tl.where(e == 0, m, (m | 8) << tl.maximum(e - 1, 0))
    neg = c >= 128
    d0 = a & 127
    d1 = (a >> 7) & 127
    d2 = a >> 14
    d0 = tl.where(neg, -d0, d0).to(tl.int8)
    d1 = tl.where(neg, -d1, d1).to(tl.int8)
    d2 = tl.where(neg, -d2, d2).to(tl.int8)
    return d0, d1, d2


@triton.jit
def _block_partial(w0, w1, w2, x0, x1, x2):
    """RN_fp32(sum_k w_k x_k) for one 32-wide block: w digits [BN, 32], x digits [32, BM] (int8);
    [BN, BM] FP32, exact before its one rounding (module docstring)."""
    z = tl.zeros([w0.shape[0], x0.shape[1]], dtype=tl.int32)
    s0 = tl.dot(w0, x0, z, out_dtype=tl.int32)
    s1 = tl.dot(w1, x0, tl.dot(w0, x1, z, out_dtype=tl.int32), out_dtype=tl.int32)
    s2 = tl.dot(w2, x0, tl.dot(w1, x1, tl.dot(w0, x2, z, out_dtype=tl.int32), out_dtype=tl.int32),
                out_dtype=tl.int32)
    s3 = tl.dot(w2, x1, tl.dot(w1, x2, z, out_dtype=tl.int32), out_dtype=tl.int32)
    s4 = tl.dot(w2, x2, z, out_dtype=tl.int32)
    low = s0 + (s1 << 7)
    mid = s2 + ((s3 + (s4 << 7)) << 7)
    s = low.to(tl.float64) + mid.to(tl.float64) * 16384.0
    return s.to(tl.float32) * 3.814697265625e-06          # 2^-18: exact


@triton.jit(do_not_specialize=["M", "stride_sxm", "stride_swn"])
def _exact_int8_mm_kernel(
    x_ptr, sx_ptr, w_ptr, sw_ptr, y_ptr,
    M, N, K, stride_xm, stride_sxm, stride_wn, stride_swn, stride_ym,
    BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, OUT_F32: tl.constexpr, STAGES: tl.constexpr,
    ASM: tl.constexpr, DIGITS: tl.constexpr = False,
):
    # Grid: (N tiles, M tiles). Program (t, u) covers W rows [t*BLOCK_N, +BLOCK_N) and x rows
    # [u*BLOCK_M, +BLOCK_M) over all of K, one 32-wide block per step. Rows past N or M read the
    # last valid row (no masks in the loop) and are masked at the store.
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rk = tl.arange(0, 32)
    rn_c = tl.minimum(rn, N - 1)
    rm_c = tl.minimum(rm, M - 1)
    w_ptrs = w_ptr + rn_c[:, None] * stride_wn + rk[None, :]           # [BN, 32]
    x_ptrs = x_ptr + rm_c[None, :] * stride_xm + rk[:, None]           # [32, BM]
    sw_ptrs = sw_ptr + (rn_c // 32) * stride_swn                       # [BN]
    sx_ptrs = sx_ptr + rm_c * stride_sxm                               # [BM]
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    KB = K // 32
    # The loads that the MMAs do not take straight from memory (x's codes, both scales, the
    # weight's codes when decoded here) are issued one block ahead, into registers.
    xc = tl.load(x_ptrs)
    sxb = tl.load(sx_ptrs)
    swb = tl.load(sw_ptrs)
    if not DIGITS:
        wc = tl.load(w_ptrs)
    for kb in tl.range(0, KB, num_stages=STAGES):
        nk = tl.minimum(kb + 1, KB - 1)
        xc_next = tl.load(x_ptrs + nk * 32)
        sxb_next = tl.load(sx_ptrs + nk)
        swb_next = tl.load(sw_ptrs + nk)
        if DIGITS:      # w_ptr: the weight's three digit planes [3, N, K] int8, decoded once by the plan
            w0 = tl.load(w_ptrs + kb * 32)
            w1 = tl.load(w_ptrs + N * stride_wn + kb * 32)
            w2 = tl.load(w_ptrs + 2 * N * stride_wn + kb * 32)
        else:
            wc_next = tl.load(w_ptrs + nk * 32)
            w0, w1, w2 = _digits(wc)
            wc = wc_next
        x0, x1, x2 = _digits(xc)
        part = _block_partial(w0, w1, w2, x0, x1, x2)
        sw = ue8m0_to_fp32(swb.to(tl.int32))
        sx = ue8m0_to_fp32(sxb.to(tl.int32))
        # The reference's order: partial * sx * sw, then the K-ordered FP32 sum.
        acc += _mul_rn(part * sx[None, :], tl.broadcast_to(sw[:, None], [BLOCK_N, BLOCK_M]), ASM)
        xc, sxb, swb = xc_next, sxb_next, swb_next
    mask = (rn[:, None] < N) & (rm[None, :] < M)
    y_ptrs = y_ptr + rm[None, :] * stride_ym + rn[:, None]
    if OUT_F32:
        tl.store(y_ptrs, acc, mask=mask)
    else:
        tl.store(y_ptrs, bf16_rne_bits(acc), mask=mask)


@triton.jit(do_not_specialize=["M", "stride_sxm", "stride_swn"])
def _exact_int8_mm_tm_kernel(
    x_ptr, sx_ptr, w_ptr, sw_ptr, y_ptr,
    M, N, K, stride_xm, stride_sxm, stride_wn, stride_swn, stride_ym,
    BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, OUT_F32: tl.constexpr, STAGES: tl.constexpr,
    ASM: tl.constexpr, DIGITS: tl.constexpr = False,
):
    # `_exact_int8_mm_kernel` with the x rows on the MMA's M side: their digits, decoded in
    # registers, are the MMA's register operand (no trip through shared memory per MMA), the
    # weight's digits its shared-memory operand. The same bits.
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rk = tl.arange(0, 32)
    rn_c = tl.minimum(rn, N - 1)
    rm_c = tl.minimum(rm, M - 1)
    w_ptrs = w_ptr + rn_c[None, :] * stride_wn + rk[:, None]           # [32, BN]
    x_ptrs = x_ptr + rm_c[:, None] * stride_xm + rk[None, :]           # [BM, 32]
    sw_ptrs = sw_ptr + (rn_c // 32) * stride_swn                       # [BN]
    sx_ptrs = sx_ptr + rm_c * stride_sxm                               # [BM]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    KB = K // 32
    xc = tl.load(x_ptrs)
    sxb = tl.load(sx_ptrs)
    swb = tl.load(sw_ptrs)
    if not DIGITS:
        wc = tl.load(w_ptrs)
    for kb in tl.range(0, KB, num_stages=STAGES):
        nk = tl.minimum(kb + 1, KB - 1)
        xc_next = tl.load(x_ptrs + nk * 32)
        sxb_next = tl.load(sx_ptrs + nk)
        swb_next = tl.load(sw_ptrs + nk)
        if DIGITS:
            w0 = tl.load(w_ptrs + kb * 32)
            w1 = tl.load(w_ptrs + N * stride_wn + kb * 32)
            w2 = tl.load(w_ptrs + 2 * N * stride_wn + kb * 32)
        else:
            wc_next = tl.load(w_ptrs + nk * 32)
            w0, w1, w2 = _digits(wc)
            wc = wc_next
        x0, x1, x2 = _digits(xc)
        part = _block_partial(x0, x1, x2, w0, w1, w2)          # the digit products commute
        sw = ue8m0_to_fp32(swb.to(tl.int32))
        sx = ue8m0_to_fp32(sxb.to(tl.int32))
        acc += _mul_rn(part * sx[:, None], tl.broadcast_to(sw[None, :], [BLOCK_M, BLOCK_N]), ASM)
        xc, sxb, swb = xc_next, sxb_next, swb_next
    mask = (rn[None, :] < N) & (rm[:, None] < M)
    y_ptrs = y_ptr + rm[:, None] * stride_ym + rn[None, :]
    if OUT_F32:
        tl.store(y_ptrs, acc, mask=mask)
    else:
        tl.store(y_ptrs, bf16_rne_bits(acc), mask=mask)


@triton.jit
def _term(x_ptrs, sx_ptrs, w_ptrs, sw_ptrs, plane, kb, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
          ASM: tl.constexpr, DIGITS: tl.constexpr):
    """Block kb's term RN(partial) * sx * sw [BM, BN] (x rows on the MMA's M side); `plane` the
    offset between the weight's digit planes (DIGITS)."""
    if DIGITS:
        w0 = tl.load(w_ptrs + kb * 32)
        w1 = tl.load(w_ptrs + plane + kb * 32)
        w2 = tl.load(w_ptrs + 2 * plane + kb * 32)
    else:
        w0, w1, w2 = _digits(tl.load(w_ptrs + kb * 32))
    x0, x1, x2 = _digits(tl.load(x_ptrs + kb * 32))
    part = _block_partial(x0, x1, x2, w0, w1, w2)
    sw = ue8m0_to_fp32(tl.load(sw_ptrs + kb).to(tl.int32))
    sx = ue8m0_to_fp32(tl.load(sx_ptrs + kb).to(tl.int32))
    return _mul_rn(part * sx[:, None], tl.broadcast_to(sw[None, :], [BLOCK_M, BLOCK_N]), ASM)


@triton.jit
def _terms(x_ptrs, sx_ptrs, w_ptrs, sw_ptrs, plane, kb, LOG: tl.constexpr, BLOCK_M: tl.constexpr,
           BLOCK_N: tl.constexpr, ASM: tl.constexpr, DIGITS: tl.constexpr):
    """The terms of blocks kb .. kb + 2^LOG - 1, joined: [BM, BN, 2, ..., 2] (LOG trailing 2s, the
    last one splitting the range in halves); straight-line code, so every block's loads and MMAs
    are independent of the others'."""
    if LOG == 0:
        return _term(x_ptrs, sx_ptrs, w_ptrs, sw_ptrs, plane, kb, BLOCK_M, BLOCK_N, ASM, DIGITS)
    else:
        HALF: tl.constexpr = 1 << (LOG - 1)
        lo = _terms(x_ptrs, sx_ptrs, w_ptrs, sw_ptrs, plane, kb, LOG - 1, BLOCK_M, BLOCK_N, ASM, DIGITS)
        hi = _terms(x_ptrs, sx_ptrs, w_ptrs, sw_ptrs, plane, kb + HALF, LOG - 1, BLOCK_M, BLOCK_N, ASM, DIGITS)
        return tl.join(lo, hi)


@triton.jit
def _add_terms(acc, t, LOG: tl.constexpr):
    """acc + each term of `_terms`' t in block order, one FP32 add at a time."""
    if LOG == 0:
        return acc + t
    else:
        lo, hi = tl.split(t)
        return _add_terms(_add_terms(acc, lo, LOG - 1), hi, LOG - 1)


@triton.jit(do_not_specialize=["M", "stride_sxm", "stride_swn"])
def _exact_int8_mm_split_kernel(
    x_ptr, sx_ptr, w_ptr, sw_ptr, y_ptr, ws_ptr, cnt_ptr,
    M, N, K, stride_xm, stride_sxm, stride_wn, stride_swn, stride_ym,
    BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, LOG_BLOCKS: tl.constexpr, OUT_F32: tl.constexpr,
    ASM: tl.constexpr, DIGITS: tl.constexpr,
):
    # One program per (N tile, M tile, K split) of 2^LOG_BLOCKS consecutive 32-wide blocks (K / 32
    # a multiple of it). Each program forms its blocks' terms (unrolled: their loads and MMAs
    # overlap), then waits for the running sum of the splits before it, adds its terms to it in
    # block order and publishes the sum for the next split (ws, a flag per split), the last split
    # storing y: the sequential K-ordered FP32 sum from 0, whatever the split. Programs take their
    # (tile, split) from an atomic ticket in the order they start, splits in ascending order, so a
    # program only waits for programs already running. cnt_ptr: [ticket, flags per (tile, split)].
    B: tl.constexpr = 1 << LOG_BLOCKS
    S = (K // 32) // B
    m_tiles = tl.cdiv(M, BLOCK_M)
    total = tl.cdiv(N, BLOCK_N) * m_tiles * S
    ticket = tl.atomic_add(cnt_ptr, 1, sem="relaxed", scope="gpu")
    if ticket == total - 1:
        tl.store(cnt_ptr, 0)          # every program has its ticket: ready for the next launch
    tile = ticket // S
    split = ticket % S
    pid_n = tile // m_tiles
    pid_m = tile % m_tiles
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rk = tl.arange(0, 32)
    rn_c = tl.minimum(rn, N - 1)
    rm_c = tl.minimum(rm, M - 1)
    w_ptrs = w_ptr + rn_c[None, :] * stride_wn + rk[:, None]           # [32, BN]
    x_ptrs = x_ptr + rm_c[:, None] * stride_xm + rk[None, :]           # [BM, 32]
    sw_ptrs = sw_ptr + (rn_c // 32) * stride_swn                       # [BN]
    sx_ptrs = sx_ptr + rm_c * stride_sxm                               # [BM]
    t = _terms(x_ptrs, sx_ptrs, w_ptrs, sw_ptrs, N * stride_wn, split * B, LOG_BLOCKS, BLOCK_M, BLOCK_N,
               ASM, DIGITS)
    offs = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    flags = cnt_ptr + 1 + tile * S
    slots = ws_ptr + tile.to(tl.int64) * (S * BLOCK_M * BLOCK_N)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if split > 0:
        while tl.atomic_add(flags + split - 1, 0, sem="acquire", scope="gpu") == 0:
            pass
        acc = tl.load(slots + (split - 1) * (BLOCK_M * BLOCK_N) + offs, cache_modifier=".cg")
    acc = _add_terms(acc, t, LOG_BLOCKS)
    if split < S - 1:
        tl.store(slots + split * (BLOCK_M * BLOCK_N) + offs, acc)
        tl.debug_barrier()
        tl.atomic_xchg(flags + split, 1, sem="release", scope="gpu")
    else:
        # every split before this one has published and been read: clear their flags
        for j0 in range(0, S - 1, 64):
            j = j0 + tl.arange(0, 64)
            tl.store(flags + j, tl.zeros([64], dtype=tl.int32), mask=j < S - 1)
        mask = (rn[None, :] < N) & (rm[:, None] < M)
        y_ptrs = y_ptr + rm[:, None] * stride_ym + rn[None, :]
        if OUT_F32:
            tl.store(y_ptrs, acc, mask=mask)
        else:
            tl.store(y_ptrs, bf16_rne_bits(acc), mask=mask)


@dataclass(frozen=True)
class Int8Config:
    """One launch configuration; every configuration gives the same bits.

    block_n: weight rows per program (16, 32, 64 or 128: the MMA's M side); block_m: x rows per
    program (16, 32 or 64: the MMA's N side; a call's rows are padded up to a multiple of it).
    num_warps, num_stages: Triton's (the K loop's loads run num_stages - 1 blocks ahead).
    tokens_m: the x rows on the MMA's M side, as its register operand (`_exact_int8_mm_tm_kernel`).
    split_blocks: 0 (one program walks all of K), or 2^j consecutive 32-wide blocks per program, the
        K splits chained in order (`_exact_int8_mm_split_kernel`; x rows on the M side; 2^j must
        divide K / 32, else the plan halves it until it does).
    """

    block_n: int = 64
    block_m: int = 16
    num_warps: int = 4
    num_stages: int = 4
    tokens_m: bool = False
    split_blocks: int = 0

    def __post_init__(self):
        if not isinstance(self.tokens_m, bool):
            raise ValueError(f"Int8Config.tokens_m must be a bool, got {self.tokens_m!r}")
        sb = self.split_blocks
        if isinstance(sb, bool) or not isinstance(sb, int) or sb < 0 or sb & (sb - 1) or sb > 64:
            raise ValueError(f"Int8Config.split_blocks must be 0 or a power of two up to 64, got {sb!r}")
        for name in ("block_n", "block_m", "num_warps", "num_stages"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Int8Config.{name} must be a positive int, got {value!r}")
        if self.block_n not in (16, 32, 64, 128):
            raise ValueError(f"Int8Config.block_n must be 16, 32, 64 or 128, got {self.block_n}")
        if self.block_m not in (16, 32, 64):
            raise ValueError(f"Int8Config.block_m must be 16, 32 or 64, got {self.block_m}")


# Per (N, K): above how many rows the integer-MMA op beats `ExactMM` on an H200, and its fastest
# measured configuration per row tile (scripts/probe_exact_int8_mm.py --rows=1,4,16,32,64, commit
# 6bbf6f8; weight digit planes read, `digits=True`). Below the threshold (and for shapes without an
# entry) `ExactMM` is faster: this op's programs walk K one block at a time, so a call takes about
# 0.8 us per 32-deep block whatever the rows (wo_b: 210 us at 1-16 rows).
_TUNED: dict[tuple[int, int], tuple[int, dict[int, Int8Config]]] = {
    (1792, 5120): (32, {64: Int8Config(block_n=32, block_m=64, num_warps=4, num_stages=4)}),             # 145 vs 210 us at 64
    (32768, 1280): (4, {16: Int8Config(block_n=64, block_m=16, num_warps=4, num_stages=4),                # 68 vs 163 us at 16
                        32: Int8Config(block_n=128, block_m=32, num_warps=4, num_stages=4, tokens_m=True),  # 115 vs 322 at 32
                        64: Int8Config(block_n=64, block_m=64, num_warps=4, num_stages=4, tokens_m=True)}),  # 188 vs 640 at 64
    (4096, 1280): (16, {32: Int8Config(block_n=32, block_m=64, num_warps=4, num_stages=4, tokens_m=True),    # 48 vs 54 at 32
                        64: Int8Config(block_n=32, block_m=64, num_warps=4, num_stages=4)}),                # 38 vs 104 at 64
    (5120, 8192): (16, {32: Int8Config(block_n=64, block_m=32, num_warps=4, num_stages=4),                  # 310 vs 407 at 32
                        64: Int8Config(block_n=32, block_m=64, num_warps=4, num_stages=4)}),                # 381 vs 814 at 64
}


def int8_rows(n: int, k: int) -> int | None:
    """Above how many rows `ExactLinear` runs N x K on the integer MMA on an sm_90 GPU (None: never)."""
    entry = _TUNED.get((n, k))
    return None if entry is None else entry[0]


def planned_config(n: int, k: int, rows: int) -> Int8Config:
    """The configuration a plan without `config` uses for N x K and a call of `rows` rows: the
    measured one of the smallest row tile (16, 32, 64) that holds them (`_TUNED`), else the x rows
    in one tile and 64 weight rows per program (32 for N <= 4096, so that the grid fills the GPU)."""
    tile = 16 if rows <= 16 else (32 if rows <= 32 else 64)
    entry = _TUNED.get((n, k))
    if entry is not None:
        tiles = entry[1]
        fit = [t for t in sorted(tiles) if t >= tile]
        if fit:
            return tiles[fit[0]]
    return Int8Config(block_n=64 if n > 4096 else 32, block_m=tile)


class ExactInt8MM:
    """y[M, N] = bf16(sum over 32-wide K blocks kb, in K order, of RN(codes[:, kb] . weight[:, kb])
    * sx * sw) for 1 <= M <= max_rows <= 64, with the weight bound once: bitwise the contract of
    `reference.linear.mxfp8_mm`, on the integer MMA (module docstring). Reduction order:
    `exact_mm.reduction_order`, the same for every row count.

    weight: [N, K] float8_e4m3fn, unit stride along K; K a multiple of 32.
    w_scale: [ceil(N/32), K/32] UE8M0 (float8_e8m0fnu or uint8), unit stride along K.
    max_rows: the most rows a call may bring (1..64).
    config: an Int8Config for every call, or a callable rows -> Int8Config, instead of
        `planned_config` (the probe and the tests use it).
    digits: keep the weight as its three int8 digit planes (`weight_digits`, 3x the bytes) and read
        those instead of decoding the codes in the kernel.
    workspace: None (the plan allocates what its K-split configurations need: the splits' running
        sums and an int32 ticket and flags, zero between calls) or a shared pool, as
        `ops.common.plan_workspace` says (FP32 slot 0, int32 slot 0). A plan with K splits must not
        have calls overlapping in time (one stream, or ordered streams); without, it owns nothing
        that calls share.
    """

    def __init__(self, weight: torch.Tensor, w_scale: torch.Tensor, max_rows: int = MAX_ROWS,
                 config: Int8Config | None = None, digits: bool = False, workspace=None):
        n, k = mxfp8_weight_args(weight, w_scale, max_rows, MAX_ROWS)
        if config is not None and not isinstance(config, Int8Config) and not callable(config):
            raise TypeError(f"config must be an Int8Config or a callable rows -> Int8Config, got "
                            f"{type(config).__name__}")
        self.weight, self.w_scale = weight, w_scale.view(torch.uint8)
        self.n, self.k, self.max_rows = n, k, max_rows
        self._digits = weight_digits(weight) if digits else None
        self.device = weight.device
        self._configs = {}
        for rows in range(1, max_rows + 1):
            cfg = config(rows) if callable(config) else (config or planned_config(n, k, rows))
            if not isinstance(cfg, Int8Config):
                raise TypeError(f"config({rows}) must be an Int8Config, got {type(cfg).__name__}")
            if cfg.split_blocks:
                b = cfg.split_blocks
                while (k // 32) % b:
                    b //= 2
                cfg = dataclasses.replace(cfg, split_blocks=b, tokens_m=True)
            self._configs[rows] = cfg
        ws, cnt = 1, 1
        for rows, cfg in self._configs.items():
            if cfg.split_blocks:
                slots = triton.cdiv(n, cfg.block_n) * triton.cdiv(rows, cfg.block_m) * ((k // 32) // cfg.split_blocks)
                ws, cnt = max(ws, slots * cfg.block_m * cfg.block_n), max(cnt, 1 + slots)
        self._workspace = plan_workspace(workspace, 0, ws, torch.float32, self.device)
        self._counters = plan_workspace(workspace, 0, cnt, torch.int32, self.device)
        self._asm = not interpreting()

    def config_for(self, rows: int) -> Int8Config:
        """The launch configuration used for `rows` rows."""
        return self._configs[rows]

    def reduction_order(self, rows: int) -> tuple[str, int, int]:
        """`exact_mm.reduction_order(K)`: the same for every row count (batch invariance)."""
        return reduction_order(self.k)

    def __call__(self, codes: torch.Tensor, x_scale: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """y = codes x weight^T with both block scales, into out: the arguments and the result of
        `LowLatencyMM.__call__` (a float32 out receives the unrounded FP32 sums)."""
        out = mxfp8_linear_args(codes, x_scale, out, self.n, self.k, self.max_rows, self.device)
        m = codes.shape[0]
        cfg = self._configs[m]
        w = self.weight.view(torch.uint8) if self._digits is None else self._digits
        y = out if out.dtype == torch.float32 else out.view(torch.int16)
        if cfg.split_blocks:
            log = cfg.split_blocks.bit_length() - 1
            splits = (self.k // 32) // cfg.split_blocks
            grid = (triton.cdiv(self.n, cfg.block_n) * triton.cdiv(m, cfg.block_m) * splits,)
            _exact_int8_mm_split_kernel[grid](
                codes.view(torch.uint8), x_scale.view(torch.uint8), w, self.w_scale, y,
                self._workspace, self._counters,
                m, self.n, self.k, codes.stride(0), x_scale.stride(0), self.weight.stride(0),
                self.w_scale.stride(0), out.stride(0),
                BLOCK_N=cfg.block_n, BLOCK_M=cfg.block_m, LOG_BLOCKS=log, OUT_F32=out.dtype == torch.float32,
                ASM=self._asm, DIGITS=self._digits is not None, num_warps=cfg.num_warps, num_stages=1,
            )
            return out
        grid = (triton.cdiv(self.n, cfg.block_n), triton.cdiv(m, cfg.block_m))
        kernel = _exact_int8_mm_tm_kernel if cfg.tokens_m else _exact_int8_mm_kernel
        kernel[grid](
            codes.view(torch.uint8), x_scale.view(torch.uint8), w, self.w_scale, y,
            m, self.n, self.k, codes.stride(0), x_scale.stride(0), self.weight.stride(0),
            self.w_scale.stride(0), out.stride(0),
            BLOCK_N=cfg.block_n, BLOCK_M=cfg.block_m, OUT_F32=out.dtype == torch.float32,
            STAGES=cfg.num_stages, ASM=self._asm, DIGITS=self._digits is not None, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
        return out


class ExactLinear:
    """The contract-exact MXFP8 linear for 1..max_rows rows, whichever exact op is faster per call:
    `ExactMM` (CUDA cores) and, on an sm_90 GPU at the shapes and row counts `_TUNED` lists,
    `ExactInt8MM` (integer MMA, weight digit planes: three more bytes per weight element). Both
    give the reference's bits, so a row's result does not depend on which runs (batch
    invariance). Arguments, errors and the call: `ExactMM`'s; workspace goes to both (they never
    run at once).
    int8_from: override the row threshold (None: `int8_rows`, and only on sm_90; 0: always the
    integer MMA; a value >= max_rows: never), for tests and probes."""

    def __init__(self, weight: torch.Tensor, w_scale: torch.Tensor, max_rows: int = MAX_ROWS,
                 exact_config=None, workspace=None, int8_from: int | None = None):
        from .exact_mm import ExactMM
        self.cuda_cores = ExactMM(weight, w_scale, max_rows, exact_config, workspace)
        n, k = self.cuda_cores.n, self.cuda_cores.k
        self.n, self.k, self.max_rows, self.device = n, k, max_rows, weight.device
        if int8_from is None:
            sm90 = weight.device.type == "cuda" and torch.cuda.get_device_capability(weight.device) == (9, 0)
            int8_from = int8_rows(n, k) if sm90 else None
        self.int8_from = int8_from if int8_from is not None and int8_from < max_rows else None
        self.int8 = None if self.int8_from is None else ExactInt8MM(weight, w_scale, max_rows, digits=True,
                                                                    workspace=workspace)

    def reduction_order(self, rows: int) -> tuple[str, int, int]:
        """`exact_mm.reduction_order(K)`: the same for every row count and either op."""
        return reduction_order(self.k)

    def op_for(self, rows: int):
        """The op that runs a call of `rows` rows."""
        return self.int8 if self.int8_from is not None and rows > self.int8_from else self.cuda_cores

    def __call__(self, codes: torch.Tensor, x_scale: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """`ExactMM.__call__`'s arguments and result."""
        if not isinstance(codes, torch.Tensor) or codes.dim() != 2:
            return self.cuda_cores(codes, x_scale, out)     # its error names the argument
        return self.op_for(codes.shape[0])(codes, x_scale, out)
