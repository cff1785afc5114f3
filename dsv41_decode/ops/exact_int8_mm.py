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

Each program owns BLOCK_M rows of x (the MMA's M side: their digits, decoded in registers, are its
register operand) and BLOCK_N weight rows (its shared-memory operand: by default the weight's three
digit planes, decoded once by the plan, `weight_digits`), and walks K one 32-wide block at a time,
adding each block's term partial * sx * sw (a `mul.rn` for the last factor, so that it is never
fused into the add) to its FP32 accumulator in K order from 0: the reference's sequential sum.
Every configuration and row count gives the same bits (`exact_mm.reduction_order`). The walk over
K is serial per program (~0.6 us a block on an H200), so the op pays over `ExactMM` only from a
number of rows on, per shape (`_INT8_PLAN`); the step does not run it: `ops.gluon_exact_mm`'s FP64
MMA measured faster at every shape and row count (docs/gemm.md, "Exactness"), and
`ops.exact_linear.ExactLinear` takes that one.

An `ExactInt8MM` plan binds one weight and its launch configuration once; calling it only launches.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .checks import (config_for_rows, interpreting, mxfp8_linear_args, mxfp8_weight_args, require_bool,
                     require_is_tensor, require_int, require_num_warps, row_configs)
from .exact_mm import _mul_rn, reduction_order
from .rounding import bf16_rne_bits, ue8m0_to_fp32

MAX_ROWS = 64


def weight_digits(weight: torch.Tensor) -> torch.Tensor:
    """The three int8 digit planes [3, N, K] of an E4M3 weight [N, K] (`_digits`, in torch): for a
    plan that reads them instead of decoding the codes in the kernel (three times the bytes)."""
    require_is_tensor(weight, "weight")
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
    """RN_fp32(sum_k a_k b_k) for one 32-wide block from the int8 digits of a [P, 32] (w0, w1, w2)
    and b [32, Q] (x0, x1, x2): [P, Q] FP32, exact before its one rounding (module docstring)."""
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


@triton.jit
def _term(xc, sxb, swb, w0, w1, w2, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ASM: tl.constexpr):
    """One block's term RN(partial) * sx * sw [BM, BN] (the reference's order; `mul.rn` for the
    last factor) from x's codes [BM, 32], the scale bytes and the weight's digits [32, BN]."""
    x0, x1, x2 = _digits(xc)
    part = _block_partial(x0, x1, x2, w0, w1, w2)
    sw = ue8m0_to_fp32(swb.to(tl.int32))
    sx = ue8m0_to_fp32(sxb.to(tl.int32))
    return _mul_rn(part * sx[:, None], tl.broadcast_to(sw[None, :], [BLOCK_M, BLOCK_N]), ASM)


@triton.jit(do_not_specialize=["M", "stride_sxm", "stride_swn"])
def _exact_int8_mm_kernel(
    x_ptr, sx_ptr, w_ptr, sw_ptr, y_ptr,
    M, N, K, stride_xm, stride_sxm, stride_wn, stride_swn, stride_ym,
    BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, OUT_F32: tl.constexpr, STAGES: tl.constexpr,
    ASM: tl.constexpr, DIGITS: tl.constexpr, PAIRS: tl.constexpr = False,
):
    # Grid: (N tiles, M tiles). Program (t, u) covers W rows [t*BLOCK_N, +BLOCK_N) and x rows
    # [u*BLOCK_M, +BLOCK_M) over all of K, one 32-wide block per step. Rows past N or M read the
    # last valid row (no masks in the loop) and are masked at the store. The x rows are the MMA's
    # M side: their digits, decoded in registers, its register operand; the weight's digits (DIGITS:
    # w_ptr holds the three planes [3, N, K] int8, `plane` apart) its shared-memory operand.
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
    plane = N * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    KB = K // 32
    if PAIRS:
        # Two blocks a step (K / 32 even, digit planes): their loads and MMAs are independent of
        # each other, so the second block's overlap the first's; the terms are still added one by
        # one in K order. x's codes and the scales of the next pair are loaded a step ahead.
        xa = tl.load(x_ptrs)
        xb = tl.load(x_ptrs + 32)
        sxa = tl.load(sx_ptrs)
        sxb2 = tl.load(sx_ptrs + 1)
        swa = tl.load(sw_ptrs)
        swb2 = tl.load(sw_ptrs + 1)
        for kb in tl.range(0, KB, 2, num_stages=STAGES):
            nk = tl.minimum(kb + 2, KB - 2)
            xa_next = tl.load(x_ptrs + nk * 32)
            xb_next = tl.load(x_ptrs + nk * 32 + 32)
            sxa_next = tl.load(sx_ptrs + nk)
            sxb_next = tl.load(sx_ptrs + nk + 1)
            swa_next = tl.load(sw_ptrs + nk)
            swb_next = tl.load(sw_ptrs + nk + 1)
            ta = _term(xa, sxa, swa, tl.load(w_ptrs + kb * 32), tl.load(w_ptrs + plane + kb * 32),
                       tl.load(w_ptrs + 2 * plane + kb * 32), BLOCK_M, BLOCK_N, ASM)
            tb = _term(xb, sxb2, swb2, tl.load(w_ptrs + kb * 32 + 32), tl.load(w_ptrs + plane + kb * 32 + 32),
                       tl.load(w_ptrs + 2 * plane + kb * 32 + 32), BLOCK_M, BLOCK_N, ASM)
            acc += ta
            acc += tb
            xa, xb, sxa, sxb2, swa, swb2 = xa_next, xb_next, sxa_next, sxb_next, swa_next, swb_next
    else:
        acc = _walk(acc, x_ptrs, sx_ptrs, sw_ptrs, w_ptrs, plane, KB, BLOCK_M, BLOCK_N, STAGES, ASM, DIGITS)
    mask = (rn[None, :] < N) & (rm[:, None] < M)
    y_ptrs = y_ptr + rm[:, None] * stride_ym + rn[None, :]
    if OUT_F32:
        tl.store(y_ptrs, acc, mask=mask)
    else:
        tl.store(y_ptrs, bf16_rne_bits(acc), mask=mask)


@triton.jit
def _walk(acc, x_ptrs, sx_ptrs, sw_ptrs, w_ptrs, plane, KB, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
          STAGES: tl.constexpr, ASM: tl.constexpr, DIGITS: tl.constexpr):
    """acc + the K blocks' terms in K order, one block a step."""
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
        if DIGITS:
            w0 = tl.load(w_ptrs + kb * 32)
            w1 = tl.load(w_ptrs + plane + kb * 32)
            w2 = tl.load(w_ptrs + 2 * plane + kb * 32)
        else:
            wc_next = tl.load(w_ptrs + nk * 32)
            w0, w1, w2 = _digits(wc)
            wc = wc_next
        acc += _term(xc, sxb, swb, w0, w1, w2, BLOCK_M, BLOCK_N, ASM)
        xc, sxb, swb = xc_next, sxb_next, swb_next
    return acc


@dataclass(frozen=True)
class Int8Config:
    """One launch configuration; every configuration gives the same bits.

    block_n: weight rows per program (16, 32, 64 or 128); block_m: x rows per program (16, 32 or 64:
    the MMA's M side, 16 on mma.sync, 64 on wgmma; a call's rows are padded up to a multiple of it).
    num_warps, num_stages: Triton's (the weight digit planes' loads run num_stages - 1 blocks ahead).
    pairs: two 32-wide blocks a step, their loads and MMAs independent (K / 32 even and the digit
        planes read; the terms still added one by one in K order).
    """

    block_n: int = 64
    block_m: int = 16
    num_warps: int = 4
    num_stages: int = 4
    pairs: bool = False

    def __post_init__(self):
        for name in ("block_n", "block_m", "num_warps", "num_stages"):
            require_int(getattr(self, name), f"Int8Config.{name}")
        require_num_warps(self.num_warps, "Int8Config.num_warps")
        if not isinstance(self.pairs, bool):
            raise ValueError(f"Int8Config.pairs must be a bool, got {self.pairs!r}")
        if self.block_n not in (16, 32, 64, 128):
            raise ValueError(f"Int8Config.block_n must be 16, 32, 64 or 128, got {self.block_n}")
        if self.block_m not in (16, 32, 64):
            raise ValueError(f"Int8Config.block_m must be 16, 32 or 64, got {self.block_m}")


# Per (N, K): the most rows at which `ExactMM` (CUDA cores) is still faster than this op, and this
# op's fastest configuration per row count above it (`{most rows: Int8Config}`, smallest first). Measured on an H200 (scripts/probe_exact_int8_mm.py --rows=1,4,8,16,32,64, commit c4f13aa,
# us; docs/gemm.md "Exactness"): this op's programs walk K one 32-deep block at a time (or two with
# `pairs`), so it pays only where ExactMM's per-row cost has grown past that walk; thresholds between
# measured row counts are where ExactMM's time, linear in the rows, crosses this op's. Shapes without
# an entry (the TP shards) keep ExactMM. Every configuration gives the same bits.
_PAIRS32 = Int8Config(block_n=32, pairs=True)
_INT8_PLAN: dict[tuple[int, int], tuple[int, dict[int, Int8Config]]] = {
    # fused wq_a|wkv: pairs at 32 weight rows 48.8 / 48.9 / 74.4 us at 16 / 32 / 64 rows (64 weight
    # rows: 77.8 / 79.6 / 83.7); ExactMM 27.8 at 8, 54.2 at 16
    (1792, 5120): (14, {64: _PAIRS32}),
    # wq_b: the default 53.5 / 96.4 / 190.4 at 16 / 32 / 64 (the others 0-35 % slower); ExactMM 43.4 at 4
    (32768, 1280): (4, {64: Int8Config()}),
    # the indexer's wq_b: pairs at 32 weight rows 13.7 / 13.6 / 20.4 at 8 / 16 / 32 (default 20.7 /
    # 20.4 / 20.7), the default 26.5 at 64 (pairs 34.6); ExactMM 8.3 at 4, 14.8 at 8
    (4096, 1280): (7, {32: _PAIRS32, 64: Int8Config()}),
    # wo_b: pairs at 32 weight rows 132.0 at 16 (default 155.2), the default 165.3 at 32, pairs at 64
    # weight rows and 3 stages 233.3 at 64 (default 241.3); ExactMM 103.2 at 8, 203.6 at 16
    (5120, 8192): (10, {16: _PAIRS32, 32: Int8Config(), 64: Int8Config(num_stages=3, pairs=True)}),
}


class ExactInt8MM:
    """y[M, N] = bf16(sum over 32-wide K blocks kb, in K order, of RN(codes[:, kb] . weight[:, kb])
    * sx * sw) for 1 <= M <= max_rows <= 64, with the weight bound once: bitwise the contract of
    `reference.linear.mxfp8_mm`, on the integer MMA (module docstring). Reduction order:
    `exact_mm.reduction_order`, the same for every row count.

    weight: [N, K] float8_e4m3fn, unit stride along K; K a multiple of 32.
    w_scale: [ceil(N/32), K/32] UE8M0 (float8_e8m0fnu or uint8), unit stride along K.
    max_rows: the most rows a call may bring (1..64).
    config: the launch configuration: one Int8Config for every call (default `Int8Config()`), or
        `{most rows: Int8Config}` for calls of up to that many rows (smallest key first; the largest
        key >= max_rows). Every configuration gives the same bits.
    digits: keep the weight's three int8 digit planes (`weight_digits`: three more bytes per weight
        element) and read those, instead of decoding the codes in the kernel (slower).
    The plan owns no memory that calls share: its calls may overlap in time.
    """

    def __init__(self, weight: torch.Tensor, w_scale: torch.Tensor, max_rows: int = MAX_ROWS,
                 config: Int8Config | dict[int, Int8Config] | None = None, digits: bool = True):
        n, k = mxfp8_weight_args(weight, w_scale, max_rows, MAX_ROWS)
        require_bool(digits, "digits")
        self._configs = row_configs(Int8Config() if config is None else config, Int8Config, "an Int8Config", max_rows)
        for _, c in self._configs:
            if c.pairs and ((k // 32) % 2 or not digits):
                raise ValueError(f"Int8Config(pairs=True) needs K / 32 even and digits=True, got K={k}, digits={digits}")
        self.weight, self.w_scale = weight, w_scale.view(torch.uint8)
        self.n, self.k, self.max_rows = n, k, max_rows
        self.device = weight.device
        self._digits = weight_digits(weight) if digits else None
        self._asm = not interpreting()

    def reduction_order(self, rows: int) -> tuple[str, int, int]:
        """`exact_mm.reduction_order(K)`: the same for every row count (batch invariance)."""
        return reduction_order(self.k)

    def config_for(self, rows: int) -> Int8Config:
        """The configuration a call of `rows` rows launches with."""
        return config_for_rows(self._configs, rows)

    def __call__(self, codes: torch.Tensor, x_scale: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """y = codes x weight^T with both block scales, into out: the arguments and the result of
        `LowLatencyMM.__call__` (a float32 out receives the unrounded FP32 sums)."""
        out = mxfp8_linear_args(codes, x_scale, out, self.n, self.k, self.max_rows, self.device)
        m = codes.shape[0]
        cfg = self.config_for(m)
        _exact_int8_mm_kernel[(triton.cdiv(self.n, cfg.block_n), triton.cdiv(m, cfg.block_m))](
            codes.view(torch.uint8), x_scale.view(torch.uint8),
            self.weight.view(torch.uint8) if self._digits is None else self._digits, self.w_scale,
            out if out.dtype == torch.float32 else out.view(torch.int16),
            m, self.n, self.k, codes.stride(0), x_scale.stride(0), self.weight.stride(0),
            self.w_scale.stride(0), out.stride(0),
            BLOCK_N=cfg.block_n, BLOCK_M=cfg.block_m, OUT_F32=out.dtype == torch.float32,
            STAGES=cfg.num_stages, ASM=self._asm, DIGITS=self._digits is not None, PAIRS=cfg.pairs,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
        return out
