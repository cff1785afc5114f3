"""The contract-exact MXFP8 linear on FP64 tensor cores (DMMA): y[M, N] = MXFP8 activation x FP8
weight with 32x32 UE8M0 block scales, for 1 <= M <= 64 rows, bitwise equal to
`reference.linear.mxfp8_mm`.

The contract (docs/spec-decisions.md decision 1): each 32-wide K block's dot product of E4M3 codes
is computed exactly and rounded once to FP32 (round to nearest even), scaled by sx[m, kb] then
sw[n // 32, kb], and added in K order into an FP32 accumulator that starts at 0; the sum is rounded
to BF16 (or left FP32). Hopper's FP8 tensor-core MMA truncates while it adds (decision 38); this op
forms the block sums on the FP64 MMA, where they are exact:

- an E4M3 value is exact in FP64 (4 significant bits); a product of two is a multiple of 2^-18 of
  magnitude at most 448^2 < 2^18, exact in FP64;
- every partial sum of a 32-wide block's products is a multiple of 2^-18 below 32 * 448^2 < 2^23
  in magnitude: 41 significant bits at most, fewer than FP64's 53, so every add of the MMA is
  exact whatever its order and its rounding: the FP64 result is the exact block sum;
- one conversion to FP32 (`cvt.rn.f32.f64`) rounds it once to nearest even: the block partial.

The codes become FP64 values in registers by integer operations (`_e4m3_f64`): an E4M3 code
s.eeee.mmm placed with its sign at bit 63 and eeee.mmm at bits 55..49 is the FP64 pattern of
value * 2^-1016 for every code, subnormals (eeee = 0: an FP64 subnormal) and -0 included; one FP64
multiply by 2^1016 (exact) makes it the value. The two NaN codes 0x7F / 0xFF, which are not
values, come out as +-480 (`ExactMM` reads them as NaN); the package's quantizers
(`formats.mxfp8_quantize`, `fp8_block_quantize`, `act_quant.mxfp8_quantize_tile`) write them only
into a non-finite block, whose scale byte 255 (NaN) makes each of its terms NaN either way. Both
operands are loaded as int64 words of 8 codes:
Triton 3.6 moves a conversion of 8-bit loads after the shared-memory load of the MMA operand, in an
8-bit operand layout (k_width 4) that its FP64 MMA lowering rejects ("Currently fp64 don't support
largeK MMA"); from 64-bit words the FP64 operands get the layout it takes (k_width 1) and the MMA
is DMMA (m16n8k16). The weight's words are converted once per byte and the bytes joined into the
block's 32 columns (`_block_f64`). x's block, at up to 16 x rows a program, is loaded as [32, BM]
words, each word once per code it holds, and converted elementwise (`_e4m3_f64` with a byte per
row), which spares the several shared-memory layout conversions (and barriers) per block that
joining its bytes costs at those tile shapes (sm_90 compile: 12 barriers fewer, main loop 323 ->
271 instructions at 64 x 16); from 32 x rows on its bytes are joined as the weight's (fewer
instructions there: 300 against 335 at 64 x 64). Code k of a block is byte k % 8 of its word k // 8
(little-endian words: K order); the block sum would be exact in any order anyway.

Cost (sm_90, what the compile shows): the weight's FP64 operand is staged through shared memory by
the compiler (8 bytes stored and loaded per weight element and block), and the MMA's N side is at
least 8 x rows: per 32-deep block a program of BLOCK_N weight rows runs BLOCK_N * max(8, BLOCK_M)
* 32 FP64 multiply-adds (~128 a cycle per SM on an H200), so the op reads its weight at a fraction
of the memory rate that falls with the rows above 8.

Layout (swap-AB): each program owns BLOCK_N weight rows (the MMA's M side) and BLOCK_M rows of x
(its N side, 8 or more; a call's rows are padded up to a multiple), and walks its K range one
32-wide block at a time: one FP64 MMA from a zero accumulator per block (FP64 accumulators hold one
block only), the partial rounded to FP32, scaled by sx, then by sw in a separate `mul.rn` (never
fused into the accumulator's add), and added to the FP32 accumulator in K order from 0: the
reference's sequential sum. Optionally (`F64Config.split`, calls of at most BLOCK_M rows) several
programs share a tile's K: each stores its block terms in a plan-owned workspace and the tile's
last program to arrive (an atomic counter, reset for the next call) adds all of them in K order
from 0 (`exact_mm`'s scheme: never partial sums added together). Every configuration, split and
row count gives the same bits (`exact_mm.reduction_order`).

An `ExactF64MM` plan binds one weight and its launch configuration once; calling it only launches.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .checks import (config_for_rows, interpreting, mxfp8_linear_args, mxfp8_weight_args, require_int,
                     require_num_warps, row_configs)
from .common import plan_workspace
from .exact_mm import _mul_rn, reduction_order
from .rounding import bf16_rne_bits, ue8m0_to_fp32

MAX_ROWS = 64


@triton.jit
def _e4m3_f64(words, J):
    """The FP64 values of byte J (0..7, the least significant first; a constant or a tensor of the
    words' shape) of int64 words of E4M3 codes, exactly: the byte shifted to the top (sign at bit
    63), shifted arithmetically right by 7 (eeee.mmm at bits 55..49), the bits between masked off:
    value * 2^-1016 as an FP64 pattern (an FP64 subnormal for a subnormal code), times 2^1016
    (exact)."""
    t = (words << (56 - 8 * J)) >> 7
    t = t & -0x7F02000000000000               # 0x80FE000000000000: bit 63 and bits 55..49
    two_1016 = tl.full([], 2039 << 52, tl.int64).to(tl.float64, bitcast=True)   # 2^1016
    return t.to(tl.float64, bitcast=True) * two_1016


@triton.jit
def _block_f64(words):
    """[R, 32] FP64 values of the 32 codes in the int64 words [R, 4] (8 codes each), column k the
    code of byte k % 8 of word k // 8: the codes in K order."""
    # Each join appends its index as the last dimension, which the reshape makes the least
    # significant: the outermost join picks byte bit 0, the innermost byte bit 2.
    t = tl.join(tl.join(tl.join(_e4m3_f64(words, 0), _e4m3_f64(words, 4)),
                        tl.join(_e4m3_f64(words, 2), _e4m3_f64(words, 6))),
                tl.join(tl.join(_e4m3_f64(words, 1), _e4m3_f64(words, 5)),
                        tl.join(_e4m3_f64(words, 3), _e4m3_f64(words, 7))))       # [R, 4, 2, 2, 2]
    return tl.reshape(t, [words.shape[0], 32])


@triton.jit
def _block_term(w_words, x_words, swb, sxb, ASM: tl.constexpr, X_JOIN: tl.constexpr):
    """One block's term RN32(w . x) * sx * sw [BN, BM] (the reference's order; `mul.rn` for the
    last factor) from the int64 words of the weight's codes [BN, 4], x's words (X_JOIN: [BM, 4];
    else [32, BM], row k word k // 8 of each x row, whose byte k % 8 is the code at k) and the
    scale bytes sw [BN], sx [BM]."""
    w = _block_f64(w_words)                                                 # [BN, 32]
    if X_JOIN:
        x = tl.trans(_block_f64(x_words))                                   # [32, BM]
    else:
        x = _e4m3_f64(x_words, (tl.arange(0, 32) % 8)[:, None])             # [32, BM]
    z = tl.zeros([w.shape[0], x.shape[1]], dtype=tl.float64)
    part = tl.dot(w, x, z, out_dtype=tl.float64).to(tl.float32)             # exact, rounded once
    sw = ue8m0_to_fp32(swb.to(tl.int32))
    sx = ue8m0_to_fp32(sxb.to(tl.int32))
    return _mul_rn(part * sx[None, :], tl.broadcast_to(sw[:, None], part.shape), ASM)


@triton.jit(do_not_specialize=["M", "stride_sxm", "stride_swn", "blocks_per_split"])
def _exact_f64_mm_kernel(
    x_ptr, sx_ptr, w_ptr, sw_ptr, y_ptr, ws_ptr, cnt_ptr,
    M, N, K, stride_xm, stride_sxm, stride_wn, stride_swn, stride_ym, blocks_per_split,
    BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, OUT_F32: tl.constexpr, STAGES: tl.constexpr,
    ASM: tl.constexpr, SPLIT: tl.constexpr = 1,
):
    # Grid: (N tiles, M tiles, K splits). Program (t, u, s) covers W rows [t*BLOCK_N, +BLOCK_N), x
    # rows [u*BLOCK_M, +BLOCK_M) and the K blocks [s*blocks_per_split, +blocks_per_split). Rows past
    # N or M read the last valid row (no masks in the loop) and are masked at the stores. x_ptr and
    # w_ptr are int64 words (8 codes); stride_xm and stride_wn count words; x's block is loaded as
    # [BM, 4] words from 32 rows a program on, else as [32, BM], row k the word holding code k
    # (module docstring).
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_s = tl.program_id(2)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rw = tl.arange(0, 4)
    rn_c = tl.minimum(rn, N - 1)
    rm_c = tl.minimum(rm, M - 1)
    w_ptrs = w_ptr + rn_c[:, None] * stride_wn + rw[None, :]          # [BN, 4] words of block 0
    X_JOIN: tl.constexpr = BLOCK_M >= 32
    if X_JOIN:
        x_ptrs = x_ptr + rm_c[:, None] * stride_xm + rw[None, :]                     # [BM, 4]
    else:
        x_ptrs = x_ptr + rm_c[None, :] * stride_xm + (tl.arange(0, 32) // 8)[:, None]   # [32, BM]
    sw_ptrs = sw_ptr + (rn_c // 32) * stride_swn                      # [BN]
    sx_ptrs = sx_ptr + rm_c * stride_sxm                              # [BM]
    KB = K // 32
    kb_lo = pid_s * blocks_per_split
    kb_hi = tl.minimum(kb_lo + blocks_per_split, KB)
    mask = (rn[:, None] < N) & (rm[None, :] < M)
    y_ptrs = y_ptr + rm[None, :] * stride_ym + rn[:, None]
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    if SPLIT > 1:
        # This program's block terms go to the tile's slice of the workspace, [KB, BN, BM] (the
        # call's M rows only: one row tile); the tile's last program to arrive adds all KB of them
        # in K order.
        ws_tile = ws_ptr + pid_n * (KB * BLOCK_N * BLOCK_M)
        offs = tl.arange(0, BLOCK_N)[:, None] * BLOCK_M + tl.arange(0, BLOCK_M)[None, :]
        real = tl.broadcast_to(rm[None, :] < M, [BLOCK_N, BLOCK_M])
        for kb in tl.range(kb_lo, kb_hi, num_stages=STAGES):
            t = _block_term(tl.load(w_ptrs + kb * 4), tl.load(x_ptrs + kb * 4), tl.load(sw_ptrs + kb),
                            tl.load(sx_ptrs + kb), ASM, X_JOIN)
            tl.store(ws_tile + kb * (BLOCK_N * BLOCK_M) + offs, t, mask=real)
        # Every thread's terms are written before one thread's release of the counter.
        tl.debug_barrier()
        arrived = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT - 1:
            tl.debug_barrier()
            for kb in tl.range(0, KB, num_stages=STAGES):
                acc += tl.load(ws_tile + kb * (BLOCK_N * BLOCK_M) + offs, mask=real, other=0.0, cache_modifier=".cg")
            _store(y_ptrs, acc, mask, OUT_F32)
            # Zero again for the next call (and a CUDA graph's replay).
            tl.atomic_xchg(cnt_ptr + pid_n, 0, sem="relaxed", scope="gpu")
    else:
        for kb in tl.range(kb_lo, kb_hi, num_stages=STAGES):
            acc += _block_term(tl.load(w_ptrs + kb * 4), tl.load(x_ptrs + kb * 4), tl.load(sw_ptrs + kb),
                               tl.load(sx_ptrs + kb), ASM, X_JOIN)
        _store(y_ptrs, acc, mask, OUT_F32)


@triton.jit
def _store(y_ptrs, acc, mask, OUT_F32: tl.constexpr):
    if OUT_F32:
        tl.store(y_ptrs, acc, mask=mask)
    else:
        tl.store(y_ptrs, bf16_rne_bits(acc), mask=mask)


@dataclass(frozen=True)
class F64Config:
    """One launch configuration; every configuration gives the same bits.

    block_n: weight rows per program (16, 32, 64 or 128: the MMA's M side); block_m: x rows per
    program (8, 16, 32 or 64: the MMA's N side; a call's rows are padded up to a multiple of it).
    num_warps, num_stages: Triton's (the K loop's loads are software-pipelined num_stages - 1 blocks
    ahead). split: K splits (programs per weight tile) for calls of at most block_m rows: their
    block terms go through a plan-owned workspace of N / block_n * K / 32 * block_n * block_m FP32
    and the tile's last program adds them in K order (the plan may use fewer splits so that none is
    empty; calls of more rows take one split).
    """

    block_n: int = 64
    block_m: int = 16
    num_warps: int = 4
    num_stages: int = 3
    split: int = 1

    def __post_init__(self):
        for name in ("block_n", "block_m", "num_warps", "num_stages", "split"):
            require_int(getattr(self, name), f"F64Config.{name}")
        require_num_warps(self.num_warps, "F64Config.num_warps")
        if self.block_n not in (16, 32, 64, 128):
            raise ValueError(f"F64Config.block_n must be 16, 32, 64 or 128, got {self.block_n}")
        if self.block_m not in (8, 16, 32, 64):
            raise ValueError(f"F64Config.block_m must be 8, 16, 32 or 64, got {self.block_m}")


# The configurations a plan without `config` launches, per most rows (timed on the H200 by
# scripts/probe_gluon_exact_mm.py, runs B1, C2, C3: 1.5-8.8x GluonExactMM's time, docs/gemm.md): the
# MMA's N side as narrow as the rows allow (8, 16, 32, 64 x rows), the weight rows and warps that
# compile for sm_90 without stack or spills (tests/ops/_exact_f64_mm_sm90.py).
_DEFAULT_CONFIGS = ((8, F64Config(block_n=32, block_m=8, num_warps=2)), (16, F64Config(block_n=64, block_m=16)),
                    (32, F64Config(block_n=64, block_m=32)), (64, F64Config(block_n=64, block_m=64, num_warps=8)))


def _words(t: torch.Tensor, name: str) -> tuple[torch.Tensor, int]:
    """t (uint8-sized codes [R, K], unit stride along K) as int64 words [R, K / 8] and its row stride
    in words: the kernel loads 8 codes a word. ValueError naming `name` unless its start and its
    row stride are 8-byte aligned."""
    if t.data_ptr() % 8 or (t.shape[0] > 1 and t.stride(0) % 8):
        raise ValueError(f"{name} must start on an 8-byte boundary with a row stride a multiple of 8 "
                         f"bytes (the kernel loads 8 codes a word), got address {t.data_ptr():#x}, "
                         f"strides {t.stride()}")
    if t.shape[0] == 1:       # any row stride: torch views a single row's bytes as words by itself
        return t.view(torch.uint8)[0].view(torch.int64)[None], 0
    return t.view(torch.uint8).view(torch.int64), t.stride(0) // 8


class ExactF64MM:
    """y[M, N] = bf16(sum over 32-wide K blocks kb, in K order, of RN(codes[:, kb] . weight[:, kb])
    * sx * sw) for 1 <= M <= max_rows <= 64, with the weight bound once: bitwise the contract of
    `reference.linear.mxfp8_mm`, on the FP64 MMA (module docstring). Reduction order:
    `exact_mm.reduction_order`, the same for every row count.

    weight: [N, K] float8_e4m3fn, unit stride along K; K a multiple of 32; its start and row stride
        8-byte aligned (the kernel reads int64 words of 8 codes).
    w_scale: [ceil(N/32), K/32] UE8M0 (float8_e8m0fnu or uint8), unit stride along K.
    max_rows: the most rows a call may bring (1..64).
    config: the launch configuration: one F64Config for every call, or `{most rows: F64Config}` for
        calls of up to that many rows (the largest key >= max_rows); default `_DEFAULT_CONFIGS`.
        Every configuration gives the same bits.
    workspace: None (the plan allocates its split-K workspace and counters) or a shared pool, as
        `ops.common.plan_workspace` says (FP32 slot 0, int32 slot 0).

    A call's codes must also start 8-byte aligned with a row stride a multiple of 8 bytes (a
    single row: any stride). A plan whose launches split K owns (or takes) a workspace and one
    int32 counter per weight tile, zero between calls; its calls must not overlap in time. Without
    splits it owns nothing that calls share.
    """

    def __init__(self, weight: torch.Tensor, w_scale: torch.Tensor, max_rows: int = MAX_ROWS,
                 config: F64Config | dict[int, F64Config] | None = None, workspace=None):
        n, k = mxfp8_weight_args(weight, w_scale, max_rows, MAX_ROWS)
        self._configs = row_configs(dict(_DEFAULT_CONFIGS) if config is None else config, F64Config, "an F64Config",
                                    max_rows)
        self.weight, self.w_scale = weight, w_scale.view(torch.uint8)
        self._w_words, self._w_stride = _words(weight, "weight")
        self.n, self.k, self.max_rows = n, k, max_rows
        self.device = weight.device
        kb = k // 32
        # The split launches' workspace: each weight tile's [K/32, block_n, block_m] block terms.
        split = [c for _, c in self._configs if self._split(c) > 1]
        ws = max((-(-n // c.block_n) * kb * c.block_n * c.block_m for c in split), default=1)
        self._workspace = plan_workspace(workspace, 0, ws, torch.float32, self.device)
        self._counters = plan_workspace(workspace, 0, max((-(-n // c.block_n) for c in split), default=1),
                                        torch.int32, self.device)
        self._asm = not interpreting()

    def _split(self, cfg: F64Config) -> int:
        """The K splits of a launch in `cfg` of at most block_m rows: none empty."""
        kb = self.k // 32
        per = -(-kb // min(cfg.split, kb))
        return -(-kb // per)

    def reduction_order(self, rows: int) -> tuple[str, int, int]:
        """`exact_mm.reduction_order(K)`: the same for every row count (batch invariance)."""
        return reduction_order(self.k)

    def config_for(self, rows: int) -> F64Config:
        """The configuration a call of `rows` rows launches with."""
        return config_for_rows(self._configs, rows)

    def __call__(self, codes: torch.Tensor, x_scale: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """y = codes x weight^T with both block scales, into out: the arguments and the result of
        `LowLatencyMM.__call__` (a float32 out receives the unrounded FP32 sums)."""
        out = mxfp8_linear_args(codes, x_scale, out, self.n, self.k, self.max_rows, self.device)
        x_words, x_stride = _words(codes, "codes")
        m = codes.shape[0]
        cfg = self.config_for(m)
        kb = self.k // 32
        split = self._split(cfg) if m <= cfg.block_m else 1
        per = -(-kb // split)
        _exact_f64_mm_kernel[(triton.cdiv(self.n, cfg.block_n), triton.cdiv(m, cfg.block_m), split)](
            x_words, x_scale.view(torch.uint8), self._w_words, self.w_scale,
            out if out.dtype == torch.float32 else out.view(torch.int16), self._workspace, self._counters,
            m, self.n, self.k, x_stride, x_scale.stride(0), self._w_stride, self.w_scale.stride(0),
            out.stride(0), per,
            BLOCK_N=cfg.block_n, BLOCK_M=cfg.block_m, OUT_F32=out.dtype == torch.float32,
            STAGES=cfg.num_stages, ASM=self._asm, SPLIT=split,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
        return out
