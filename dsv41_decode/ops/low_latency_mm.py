"""The low-batch MXFP8 linear: y[M, N] BF16 = MXFP8 activation x FP8 weight with 32x32 UE8M0 block
scales, FP32 accumulation, for 1 <= M <= 64 rows (the contract of `reference.linear.mxfp8_mm`).

At these row counts the op is bound by streaming the weight once, so the kernel is laid out for
that (docs/notes-low-latency-mm.md has the reasoning and the measurements):

- swap AB: each program computes a y^T tile [BLOCK_N, BLOCK_M] = W[BLOCK_N, K] @ x^T, so the large
  N is the MMA's M dimension (64 per warpgroup) and the few rows, padded to 16, 32 or 64, are its
  N dimension; one M tile covers every row, so the weight is read exactly once;
- the scales are applied in registers per 32-wide K block, either to the FP32 result of one
  32-deep FP8 `tl.dot` (`dequant=False`: the block partial is scaled by sx * sw and added in K
  order, as the reference does) or by dequantizing both operands to BF16 with their scales folded
  in, which is exact, and running one BLOCK_K-deep BF16 dot (`dequant=True`);
- split-K where N / BLOCK_N tiles are too few to keep the GPU's memory system busy: each split
  writes its FP32 partial to a plan-owned workspace; the last split of a tile to arrive (an atomic
  counter per tile) sums the partials in split order, so the result does not depend on which split
  finished last, writes y and resets its counter, so the op replays inside a CUDA graph with no
  memset.

- the query RoPE epilogue (`rope=(cos, sin)`, the step's wq_b): the program that stores a tile
  rotates every head's channels 448..511 on the BF16-rounded tile first (`kv_write.rope_tile`), the
  bits of the GEMM followed by `kv_write.query_rope_`;
- the index query epilogue (`index_query=(cos, sin)`, the indexer's wq_b): the storing program
  applies `index_query_`'s iq half to the BF16-rounded tile (`index_query.index_query_tile`: RoPE
  on every 128-channel head's channels 64..127, then MXFP4 fake-quant per 32-channel block), the
  bits of the GEMM followed by `index_query.index_query_`.

A `LowLatencyMM` plan binds one weight, chooses the launch configuration per row bucket and owns
the workspace, once; calling it only launches. `low_latency_mm` is the allocating convenience form.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import pdl
from .checks import (index_query_epilogue_args, interpreting, mxfp8_linear_args, mxfp8_weight_args,
                     require_int, require_num_warps, rope_epilogue_args)
from .common import num_sms, plan_workspace
from .fp4 import bf16_round
from .index_query import index_query_tile
from .kv_write import rope_tile
from .rounding import bf16_rne_bits, ue8m0_to_fp32

MAX_ROWS = 64
_ROW_BUCKETS = (16, 32, 64)   # BLOCK_M: the MMA's N dimension, at least 16 for tl.dot


@triton.jit
def _store_y(y_ptr, acc, rn, rm, M, N, stride_ym, off_n, cos_ptr, sin_ptr, stride_cm, stride_sm,
             OUT_F32: tl.constexpr, ROPE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
             ASM: tl.constexpr, INDEX_Q: tl.constexpr = False):
    """y[m, n] = bf16(acc[n, m]) (y_ptr at int16: the BF16 bits), or acc itself with OUT_F32 (a
    tensor-parallel partial, reduced before its rounding), for m < M, n < N. ROPE: the query RoPE
    on the rounded tile first where it holds a head's channels 448..511 (`kv_write.rope_tile`,
    explicitly rounded operations with ASM). INDEX_Q: the index query on the rounded tile first
    (`index_query.index_query_tile`, every tile)."""
    mask = (rn[:, None] < N) & (rm[None, :] < M)
    if OUT_F32:
        tl.store(y_ptr + rm[None, :] * stride_ym + rn[:, None], acc, mask=mask)
    elif ROPE:
        yb = bf16_round(acc)
        if off_n % 512 + BLOCK_N > 448:
            yb = rope_tile(yb, off_n, rm, M, cos_ptr, sin_ptr, stride_cm, stride_sm, BLOCK_N, BLOCK_M, ASM)
        tl.store(y_ptr + rm[None, :] * stride_ym + rn[:, None], bf16_rne_bits(yb), mask=mask)
    elif INDEX_Q:
        yb = index_query_tile(bf16_round(acc), off_n, rm, M, cos_ptr, sin_ptr, stride_cm, stride_sm, BLOCK_N,
                              BLOCK_M, ASM)
        tl.store(y_ptr + rm[None, :] * stride_ym + rn[:, None], bf16_rne_bits(yb), mask=mask)
    else:
        tl.store(y_ptr + rm[None, :] * stride_ym + rn[:, None], bf16_rne_bits(acc), mask=mask)


# The row count, split sizes and scale strides take no part in vectorization: leaving them
# unspecialized keeps one compiled kernel per configuration for every shape and row count.
@triton.jit(do_not_specialize=["M", "stride_sxm", "stride_swn", "steps_per_split", "stride_cm", "stride_sm"])
def _mxfp8_ll_mm_kernel(
    x_ptr, sx_ptr, w_ptr, sw_ptr, y_ptr, ws_ptr, cnt_ptr,
    M, N, K, stride_xm, stride_sxm, stride_wn, stride_swn, stride_ym, steps_per_split,
    N_SPLIT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr, DEQUANT: tl.constexpr, DOT_F32: tl.constexpr, OUT_F32: tl.constexpr,
    PDL: tl.constexpr = False, SCALE_WORDS: tl.constexpr = False,
    cos_ptr=None, sin_ptr=None, stride_cm=0, stride_sm=0, ROPE: tl.constexpr = False, ROPE_ASM: tl.constexpr = False,
    INDEX_Q: tl.constexpr = False,
):
    # Grid: (N tiles, K splits). Program (t, s) covers rows [t*BLOCK_N, +BLOCK_N) of W and the K
    # range [s*steps_per_split*BLOCK_K, +steps_per_split*BLOCK_K); every row of x is in its one
    # BLOCK_M tile. ROPE: the query RoPE epilogue (`_store_y`) with cos/sin [M, 32] FP32 at
    # cos_ptr/sin_ptr (ROPE_ASM: its operations as inline PTX, on the GPU); INDEX_Q: the index
    # query epilogue with the same cos/sin arguments.
    SUB: tl.constexpr = BLOCK_K // 32
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    # Rows past N or M read the last valid row and are masked at the store, so the K loop's loads
    # need no masks and stay 16-byte vectors.
    w_rows = w_ptr + tl.minimum(rn, N - 1) * stride_wn                 # [BN]
    sw_rows = sw_ptr + (tl.minimum(rn, N - 1) // 32) * stride_swn      # [BN]
    x_rows = x_ptr + tl.minimum(rm, M - 1) * stride_xm                 # [BM]
    sx_rows = sx_ptr + tl.minimum(rm, M - 1) * stride_sxm              # [BM]

    step_lo = pid_s * steps_per_split
    step_hi = tl.minimum(step_lo + steps_per_split, K // BLOCK_K)
    # With PDL: the program's weight bytes start towards L2 while the predecessor still runs.
    pdl.prefetch_rows_l2(w_rows + step_lo * BLOCK_K, (step_hi - step_lo) * BLOCK_K, PDL)
    pdl.enter(PDL, RELEASE=False)
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    if SCALE_WORDS:
        # The SUB scale bytes of one step are one aligned word per row (the launcher checked the
        # alignment), loaded one step ahead: single-byte loads cannot go through cp.async, so
        # Triton issues them in the step that uses them, which exposes their latency every step.
        WORD: tl.constexpr = tl.int32 if SUB == 4 else tl.int64
        sw_words = sw_rows.to(tl.pointer_type(WORD))
        sx_words = sx_rows.to(tl.pointer_type(WORD))
        sw_next = tl.load(sw_words + step_lo)                                          # [BN]
        sx_next = tl.load(sx_words + step_lo)                                          # [BM]
    for step in range(step_lo, step_hi):
        # A multiple of BLOCK_K by construction: the compiler can prove the loads 16-byte aligned.
        k0 = step * BLOCK_K
        if SCALE_WORDS:
            sw_word, sx_word = sw_next, sx_next
            nxt = tl.minimum(step + 1, step_hi - 1)
            sw_next = tl.load(sw_words + nxt)
            sx_next = tl.load(sx_words + nxt)
        if DEQUANT:
            rk = k0 + tl.arange(0, BLOCK_K)
            rkb = k0 // 32 + tl.arange(0, SUB)
            w = tl.load(w_rows[:, None] + rk[None, :])                                  # [BN, BK]
            if SCALE_WORDS:                                                             # bytes 0..SUB-1
                shifts = 8 * tl.arange(0, SUB)
                sw = ue8m0_to_fp32(((sw_word[:, None] >> shifts[None, :]) & 255).to(tl.int32))
            else:
                sw = ue8m0_to_fp32(tl.load(sw_rows[:, None] + rkb[None, :]))            # [BN, SUB]
            wd = tl.reshape(tl.reshape(w.to(tl.float32), [BLOCK_N, SUB, 32]) * sw[:, :, None],
                            [BLOCK_N, BLOCK_K])
            xt = tl.load(x_rows[None, :] + rk[:, None])                                 # [BK, BM]
            if SCALE_WORDS:
                sx = ue8m0_to_fp32(((sx_word[None, :] >> shifts[:, None]) & 255).to(tl.int32))
            else:
                sx = ue8m0_to_fp32(tl.load(sx_rows[None, :] + rkb[:, None]))            # [SUB, BM]
            xd = tl.reshape(tl.reshape(xt.to(tl.float32), [SUB, 32, BLOCK_M]) * sx[:, None, :],
                            [BLOCK_K, BLOCK_M])
            # Codes times power-of-two scales are exact in BF16, and BF16 products are exact in
            # FP32; the interpreter's BF16 dot is wrong, so there the same values go through FP32.
            if DOT_F32:
                acc = tl.dot(wd, xd, acc, input_precision="ieee")
            else:
                acc = tl.dot(wd.to(tl.bfloat16), xd.to(tl.bfloat16), acc)
        else:
            for j in tl.static_range(SUB):
                rk = k0 + j * 32 + tl.arange(0, 32)
                kb = k0 // 32 + j
                w = tl.load(w_rows[:, None] + rk[None, :])                              # [BN, 32]
                xt = tl.load(x_rows[None, :] + rk[:, None])                             # [32, BM]
                if SCALE_WORDS:                                                         # byte j (little-endian)
                    sw = ue8m0_to_fp32(((sw_word >> (8 * j)) & 255).to(tl.int32))       # [BN]
                    sx = ue8m0_to_fp32(((sx_word >> (8 * j)) & 255).to(tl.int32))       # [BM]
                else:
                    sw = ue8m0_to_fp32(tl.load(sw_rows + kb))                           # [BN]
                    sx = ue8m0_to_fp32(tl.load(sx_rows + kb))                           # [BM]
                part = tl.dot(w, xt)                                                    # [BN, BM]
                # The reference's order: partial * sx * sw, then the K-ordered FP32 sum.
                acc += (part * sx[None, :]) * sw[:, None]
    pdl.release(PDL)   # the successor may launch once every program is past its K loop

    if SPLIT_K:
        # Partial s of tile t lives at ws[(t * N_SPLIT + s) * M * BN + m * BN + n]: only the M real
        # rows, n contiguous.
        rn_l = tl.arange(0, BLOCK_N)
        m_ok = rm[None, :] < M
        tile_ws = ws_ptr + pid_n * N_SPLIT * M * BLOCK_N + rm[None, :] * BLOCK_N + rn_l[:, None]
        tl.store(tile_ws + pid_s * M * BLOCK_N, acc, mask=m_ok)
        # Every thread's partial is written before one thread's release of the counter.
        tl.debug_barrier()
        arrived = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if arrived == N_SPLIT - 1:
            tl.debug_barrier()
            total = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
            # Unrolled (N_SPLIT is a constexpr): the loads are independent straight-line code that
            # goes out together, one L2 round trip instead of one per split on the serial tail.
            for s in tl.static_range(N_SPLIT):
                # .cg: from L2, never from a line this SM's L1 kept from an earlier launch.
                total += tl.load(tile_ws + s * M * BLOCK_N, mask=m_ok, other=0.0, cache_modifier=".cg")
            _store_y(y_ptr, total, rn, rm, M, N, stride_ym, pid_n * BLOCK_N, cos_ptr, sin_ptr, stride_cm, stride_sm,
                     OUT_F32, ROPE, BLOCK_N, BLOCK_M, ROPE_ASM, INDEX_Q)
            tl.atomic_xchg(cnt_ptr + pid_n, 0, sem="relaxed", scope="gpu")
    else:
        _store_y(y_ptr, acc, rn, rm, M, N, stride_ym, pid_n * BLOCK_N, cos_ptr, sin_ptr, stride_cm, stride_sm,
                 OUT_F32, ROPE, BLOCK_N, BLOCK_M, ROPE_ASM, INDEX_Q)


@dataclass(frozen=True)
class LowLatencyConfig:
    """One launch configuration of the kernel.

    block_n: W rows per program, a power of two: the MMA's M (wgmma from 64 up; 32 and below fall
    back to mma.sync). block_k: K per loop iteration, 32 times a power of two, dividing K. split:
    K splits requested (the plan may use fewer so that none is empty). num_warps, num_stages:
    Triton's. dequant: the BF16-dequantize variant instead of the per-block FP8 dots.
    scale_words: (block_k 128 or 256) load each step's scale bytes as one word per row, one step
    ahead, where both scale tensors' rows are word-aligned (else byte loads, issued in the step
    that uses them); same values, same bits. None (the default) = the measured choice: on for the
    FP8-dot loop (on an H200 1.11-1.24x faster on fused_wqa_wkv, 1.02-1.13x on wq_b and its TP2
    shard, never slower: docs/results/ll-mm-scale-words-h200.txt), off for the dequantize loop
    until measured there (sm_90 SASS: 368 instead of 414 instructions per step, no same-step
    scale loads); True / False force it.
    """

    block_n: int = 128
    block_k: int = 128
    split: int = 1
    num_warps: int = 4
    num_stages: int = 4
    dequant: bool = False
    scale_words: bool | None = None

    def __post_init__(self):
        for name in ("block_n", "block_k", "split", "num_warps", "num_stages"):
            require_int(getattr(self, name), f"LowLatencyConfig.{name}")
        require_num_warps(self.num_warps, "LowLatencyConfig.num_warps")
        if self.scale_words is not None and not isinstance(self.scale_words, bool):
            raise ValueError(f"LowLatencyConfig.scale_words must be None, True or False, got {self.scale_words!r}")
        if self.block_n < 16 or self.block_n & (self.block_n - 1):
            raise ValueError(f"LowLatencyConfig.block_n must be a power of two >= 16, got {self.block_n}")
        if self.block_k % 32 or (self.block_k // 32) & (self.block_k // 32 - 1):
            raise ValueError(f"LowLatencyConfig.block_k must be 32 times a power of two, got {self.block_k}")


# Measured on an H200 (scripts/sweep_low_latency_mm.py, docs/results/ll-mm-sweep-h200.txt): per (N, K, BLOCK_M) the
# configuration with the least time summed over the bucket's measured rows (1 and 16; 32; 64), over
# 30 kernel variants x 2-4 split counts, CUDA-graph replay over weights rotated beyond L2; then made
# batch-invariant: every bucket of one (N, K) has the same `reduction_order` (the loop, FP8 dots or
# dequantize, and the K split boundaries), so a row's bits do not depend on how many rows share the
# call (docs/step.md, "Batch invariance"). Where the buckets disagreed, the 1-16-row bucket's order
# was kept and the others take the nearest measured configuration with that order (marked "bi:";
# the sweep's figures for the change are in docs/step.md).
_TUNED: dict[tuple[int, int, int], LowLatencyConfig] = {
    # fused wq_a|wkv: FP8 loop, 8 splits of 640
    (1792, 5120, 16): LowLatencyConfig(block_n=64, block_k=128, split=8, num_warps=4, num_stages=3),
    (1792, 5120, 32): LowLatencyConfig(block_n=64, block_k=128, split=8, num_warps=4, num_stages=3),
    # bi: 8 splits of 640 (was 9 of 576: 224 instead of 252 programs)
    (1792, 5120, 64): LowLatencyConfig(block_n=64, block_k=64, split=8, num_warps=4, num_stages=6),
    # indexer wq_b (and wq_b under TP8): FP8 loop, 4 splits of 320
    (4096, 1280, 16): LowLatencyConfig(block_n=64, block_k=64, split=4, num_warps=4, num_stages=4),
    # bi: the 16-row configuration (was 4 splits of 384 and 2 of 640; the sweep's best with
    # 64-deep steps 8.92 vs 8.89 us at 32 rows, 11.17 vs 10.99 at 64)
    (4096, 1280, 32): LowLatencyConfig(block_n=64, block_k=64, split=4, num_warps=4, num_stages=4),
    (4096, 1280, 64): LowLatencyConfig(block_n=64, block_k=64, split=4, num_warps=4, num_stages=4),
    # wo_b under TP8: FP8 loop, 3 splits of 384
    (5120, 1024, 16): LowLatencyConfig(block_n=64, block_k=128, split=3, num_warps=4, num_stages=3),
    # bi: the FP8 loop (was the dequantize loop, 4 splits of 256 and 3 of 384; the sweep's best FP8
    # 128-deep loop 9.39 vs 9.00 us at 32 rows, 12.15 vs 11.49 at 64)
    (5120, 1024, 32): LowLatencyConfig(block_n=64, block_k=128, split=3, num_warps=4, num_stages=3),
    (5120, 1024, 64): LowLatencyConfig(block_n=64, block_k=128, split=3, num_warps=4, num_stages=3),
    # wo_b under TP4: FP8 loop, 4 splits of 512
    (5120, 2048, 16): LowLatencyConfig(block_n=64, block_k=128, split=4, num_warps=4, num_stages=3),
    # bi: the FP8 loop (was the dequantize loop, 4 splits of 512 and 3 of 768; the sweep's best FP8
    # 128-deep loop 14.04 vs 12.04 us at 32 rows, 19.11 vs 16.70 at 64)
    (5120, 2048, 32): LowLatencyConfig(block_n=64, block_k=128, split=4, num_warps=4, num_stages=3),
    (5120, 2048, 64): LowLatencyConfig(block_n=64, block_k=128, split=4, num_warps=4, num_stages=3),
    # wo_b under TP2: dequantize loop, 3 splits of 1408
    # bi: 128-deep steps (was 256: 3 splits of 1536; the dequantize loop's step depth changes no
    # bit, docs/results/ll-mm-alt-h200.txt, but its split bounds do; 256 was the sweep's best at 16
    # rows, 15.60 us, 128 not timed there)
    (5120, 4096, 16): LowLatencyConfig(block_n=64, block_k=128, split=3, num_warps=4, num_stages=4, dequant=True),
    (5120, 4096, 32): LowLatencyConfig(block_n=64, block_k=128, split=3, num_warps=4, num_stages=4, dequant=True),
    (5120, 4096, 64): LowLatencyConfig(block_n=64, block_k=128, split=3, num_warps=4, num_stages=4, dequant=True),
    # wo_b: FP8 loop with word-loaded scales, 8 splits of 1024, 3 stages (scripts/probe_ll_mm.py --alt: 20.07 vs 22.69 us at 1 row, 23.56 vs 24.43 at 16; the dequantize
    # loop's entry was the sweep's pick before scale_words; docs/results/ll-mm-alt-h200.txt)
    (5120, 8192, 16): LowLatencyConfig(block_n=64, block_k=128, split=8, num_warps=4, num_stages=3),
    # bi: the 16-row configuration (was the dequantize loop, 3 splits of 2816: the sweep's 31.21 us
    # vs 36.88 for the FP8 loop before word-loaded scales, which made that loop 1.04x faster at 16 rows)
    (5120, 8192, 32): LowLatencyConfig(block_n=64, block_k=128, split=8, num_warps=4, num_stages=3),
    # bi: 8 splits of 1024 (was 7 of 1280: 320 instead of 280 programs; the sweep's 45.38 us)
    (5120, 8192, 64): LowLatencyConfig(block_n=128, block_k=128, split=8, num_warps=4, num_stages=3),
    # wq_b under TP4: FP8 loop, one split
    # bi: one split (was 4 of 384: the table's 8.64 / 10.39 us at 1 / 16 rows; the sweep's one-split
    # best 8.54 at 1 row, 10.71 for this loop at 16)
    (8192, 1280, 16): LowLatencyConfig(block_n=64, block_k=128, split=1, num_warps=4, num_stages=4),
    (8192, 1280, 32): LowLatencyConfig(block_n=64, block_k=128, split=1, num_warps=4, num_stages=4),
    (8192, 1280, 64): LowLatencyConfig(block_n=64, block_k=64, split=1, num_warps=4, num_stages=6),
    # wq_b under TP2: FP8 loop, one split
    (16384, 1280, 16): LowLatencyConfig(block_n=64, block_k=128, split=1, num_warps=4, num_stages=3),
    (16384, 1280, 32): LowLatencyConfig(block_n=128, block_k=64, split=1, num_warps=8, num_stages=4),
    # bi: the FP8 loop (was the dequantize loop: the sweep's 19.85 vs 19.14 us at 64 rows)
    (16384, 1280, 64): LowLatencyConfig(block_n=64, block_k=128, split=1, num_warps=4, num_stages=3),
    # wq_b: FP8 loop, one split
    (32768, 1280, 16): LowLatencyConfig(block_n=64, block_k=128, split=1, num_warps=4, num_stages=3),
    (32768, 1280, 32): LowLatencyConfig(block_n=128, block_k=64, split=1, num_warps=8, num_stages=4),
    (32768, 1280, 64): LowLatencyConfig(block_n=128, block_k=128, split=1, num_warps=4, num_stages=3),
}


def reduction_order(config: LowLatencyConfig, k: int) -> tuple[bool, int, int]:
    """What fixes the FP32 summation of every output element under `config` for K = k: (dequant,
    K per split, depth of one dot). Two configurations with the same triple give the same bits for
    a row whatever else differs (block_n, warps, stages, scale words, the row bucket): the FP8 loop
    adds each 32-deep block's FP32 partial in K order within a split (its dots are 32 deep at any
    block_k), the dequantize loop adds one block_k-deep BF16 dot per step (on the GPU a chain of
    16-deep MMAs in K order, the same at any block_k; the interpreter sums each dot whole, so
    block_k counts there), and the splits' partials are added in split order. Measured on an H200
    at one row count: block_n, block_k and scale_words change no bit, the split and the loop do
    (docs/results/ll-mm-alt-h200.txt); across row buckets the MMA is always wgmma m64nBMk32 (FP8)
    or k16 (BF16), N = the bucket (sm_90 PTX; the GPU batch-invariance test checks the bits)."""
    steps = k // config.block_k
    return (config.dequant, -(-steps // min(config.split, steps)) * config.block_k,
            config.block_k if config.dequant else 32)


def _default_config(n: int, k: int, block_m: int, sms: int) -> LowLatencyConfig:
    """A configuration for shapes without a measured entry, following what won the sweep: 64-row
    tiles, 128-deep K steps, 3 stages, and enough K splits for about two programs per SM (all of
    them resident in one wave)."""
    block_n = 64
    block_k = next(b for b in (128, 64, 32) if k % b == 0)
    tiles = -(-n // block_n)
    split = max(1, min(k // block_k, round(2 * sms / tiles)))
    return LowLatencyConfig(block_n=block_n, block_k=block_k, split=split, num_warps=4, num_stages=3)





@dataclass(frozen=True)
class _Launch:
    block_m: int
    config: LowLatencyConfig
    split: int
    k_per_split: int
    grid: tuple[int, int]
    scale_word: int = 0      # bytes per scale word when the config and the weight allow words, else 0


class LowLatencyMM:
    """y[M, N] = bf16(sum over 32-wide K blocks kb of (codes[:, kb] . weight[:, kb]) * sx * sw) for
    1 <= M <= max_rows <= 64, with the weight bound once.

    weight: [N, K] float8_e4m3fn, unit stride along K; K a multiple of 32.
    w_scale: [ceil(N/32), K/32] UE8M0 (float8_e8m0fnu or uint8), unit stride along K.
    max_rows: the most rows a call may bring (1..64).
    config: a LowLatencyConfig for every row bucket, or a dict {16|32|64: LowLatencyConfig}, instead
        of the measured choice (the sweep and the tests use it).
    workspace: None (the plan allocates its split-K workspace and counters) or a shared pool, as
        `ops.common.plan_workspace` says (FP32 slot 0, int32 slot 0).

    The plan owns (or takes) an FP32 workspace and one int32 counter per N tile; the counters are
    zero between calls. Calls must not overlap in time (one stream, or ordered streams): two
    concurrent calls of one plan would share the counters.
    """

    def __init__(self, weight: torch.Tensor, w_scale: torch.Tensor, max_rows: int = MAX_ROWS,
                 config: LowLatencyConfig | dict[int, LowLatencyConfig] | None = None, workspace=None):
        n, k = mxfp8_weight_args(weight, w_scale, max_rows, MAX_ROWS)
        self.weight, self.w_scale = weight, w_scale.view(torch.uint8)
        self.n, self.k, self.max_rows = n, k, max_rows
        self.device = weight.device
        sms = num_sms(self.device)

        self._launches: dict[int, _Launch] = {}
        for block_m in _ROW_BUCKETS:
            if block_m // 2 >= max_rows and block_m > _ROW_BUCKETS[0]:
                break
            if isinstance(config, dict):
                cfg = config.get(block_m)
                if cfg is None:
                    raise ValueError(f"config has no entry for the row bucket {block_m}")
            else:
                cfg = config or _TUNED.get((n, k, block_m)) or _default_config(n, k, block_m, sms)
            if not isinstance(cfg, LowLatencyConfig):
                raise TypeError(f"config must be a LowLatencyConfig, got {type(cfg).__name__}")
            if k % cfg.block_k:
                raise ValueError(f"config.block_k={cfg.block_k} must divide K={k}")
            k_per_split = reduction_order(cfg, k)[1]
            split = -(-k // k_per_split)          # no empty split
            grid = (-(-n // cfg.block_n), split)
            word = cfg.block_k // 32
            wanted = (not cfg.dequant) if cfg.scale_words is None else cfg.scale_words
            word_ok = wanted and word in (4, 8) and self.w_scale.stride(0) % word == 0 \
                and self.w_scale.data_ptr() % word == 0
            self._launches[block_m] = _Launch(block_m, cfg, split, k_per_split, grid, word if word_ok else 0)

        ws_elems = max((l.grid[0] * l.split * min(l.block_m, max_rows) * l.config.block_n
                        for l in self._launches.values() if l.split > 1), default=1)
        self._workspace = plan_workspace(workspace, 0, ws_elems, torch.float32, self.device)
        self._counters = plan_workspace(workspace, 0, max(l.grid[0] for l in self._launches.values()),
                                        torch.int32, self.device)
        self._dot_f32 = interpreting()

    def launch_for(self, rows: int) -> _Launch:
        """The launch (row bucket, configuration, split, grid) used for `rows` rows."""
        return self._launches[max(16, 1 << (rows - 1).bit_length())]

    def reduction_order(self, rows: int) -> tuple[bool, int, int]:
        """`reduction_order` of the launch for `rows` rows: equal for every row count (the measured
        table's and the default rule's plans) means a row's outputs do not depend on the others."""
        return reduction_order(self.launch_for(rows).config, self.k)

    def __call__(self, codes: torch.Tensor, x_scale: torch.Tensor, out: torch.Tensor | None = None,
                 rope: tuple[torch.Tensor, torch.Tensor] | None = None,
                 index_query: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """y = codes x weight^T with both block scales, into out.

        codes: [M, K] float8_e4m3fn, unit stride along K; 1 <= M <= max_rows.
        x_scale: [M, K/32] UE8M0 (uint8 or float8_e8m0fnu), unit stride along K.
        out: [M, N] BF16, unit stride along N; allocated when None. A float32 out receives the
            unrounded FP32 sums (a tensor-parallel partial).
        rope: None, or (cos, sin) [M, 32] float32: y read as [M, N / 512, 512] queries (N a
            multiple of 512, BF16 out) gets `kv_write.query_rope_`'s RoPE in the epilogue, the
            same bits as the GEMM followed by that op (as `GluonMM`'s).
        index_query: None, or (cos, sin) [M, 32] float32 (the indexer's wq_b, not with rope): y read
            as [M, N / 128, 128] index queries (N a multiple of 128, BF16 out) gets
            `index_query.index_query_`'s iq in the epilogue (RoPE on each head's channels 64..127,
            MXFP4 fake-quant per 32-channel block), the same bits as the GEMM followed by that op
            (as `GluonMM`'s). The launch's block_n must hold whole MX blocks (>= 32).
        Returns out.
        """
        out = mxfp8_linear_args(codes, x_scale, out, self.n, self.k, self.max_rows, self.device)
        m = codes.shape[0]
        extra = {}
        if index_query is not None:
            cos, sin = index_query_epilogue_args(index_query, rope, out, self.n, m, self.device,
                                                 self.launch_for(m).config.block_n)
            extra = dict(cos_ptr=cos, sin_ptr=sin, stride_cm=cos.stride(0), stride_sm=sin.stride(0), INDEX_Q=True,
                         ROPE_ASM=not self._dot_f32)
        elif rope is not None:
            cos, sin = rope_epilogue_args(rope, out, self.n, m, self.device)
            extra = dict(cos_ptr=cos, sin_ptr=sin, stride_cm=cos.stride(0), stride_sm=sin.stride(0), ROPE=True,
                         ROPE_ASM=not self._dot_f32)
        launch = self.launch_for(m)
        cfg = launch.config
        word = launch.scale_word      # the weight side was checked at build; here the activation's
        scale_words = word > 0 and x_scale.stride(0) % word == 0 and x_scale.data_ptr() % word == 0
        _mxfp8_ll_mm_kernel[launch.grid](
            codes, x_scale.view(torch.uint8), self.weight, self.w_scale,
            out if out.dtype == torch.float32 else out.view(torch.int16),
            self._workspace, self._counters,
            m, self.n, self.k, codes.stride(0), x_scale.stride(0), self.weight.stride(0),
            self.w_scale.stride(0), out.stride(0), launch.k_per_split // cfg.block_k,
            N_SPLIT=launch.split, BLOCK_N=cfg.block_n, BLOCK_M=launch.block_m, BLOCK_K=cfg.block_k,
            SPLIT_K=launch.split > 1, DEQUANT=cfg.dequant, DOT_F32=self._dot_f32, OUT_F32=out.dtype == torch.float32,
            PDL=False, SCALE_WORDS=scale_words, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **extra,
        )
        return out


class _Operands:
    """A weight and its scale, equal to another when both are the same memory viewed the same way."""

    __slots__ = ("weight", "w_scale", "key")

    def __init__(self, weight: torch.Tensor, w_scale: torch.Tensor):
        self.weight, self.w_scale = weight, w_scale
        self.key = tuple((t.data_ptr(), tuple(t.shape), t.stride(), t.dtype, str(t.device)) for t in (weight, w_scale))

    def __hash__(self):
        return hash(self.key)

    def __eq__(self, other):
        return isinstance(other, _Operands) and self.key == other.key


@functools.lru_cache(maxsize=64)
def _plan_for(operands: _Operands) -> LowLatencyMM:
    # The cached plan holds the tensors, so their memory cannot be reused under the same key.
    return LowLatencyMM(operands.weight, operands.w_scale)


def low_latency_mm(codes: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, w_scale: torch.Tensor,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """y[M, N] BF16 = MXFP8 codes [M, K] (+ x_scale [M, K/32]) x FP8 weight [N, K] (+ w_scale
    [ceil(N/32), K/32]) with FP32 accumulation; see `LowLatencyMM` for the arguments.

    Builds a plan on first use for these weight tensors and keeps it (up to 64 weights); code that
    captures CUDA graphs should build its `LowLatencyMM` plans itself.
    """
    for name, t in (("weight", weight), ("w_scale", w_scale)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    return _plan_for(_Operands(weight, w_scale))(codes, x_scale, out)
