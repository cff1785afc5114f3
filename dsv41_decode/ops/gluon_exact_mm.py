"""The contract-exact MXFP8 linear on FP64 tensor cores (DMMA), or on FP16 tensor cores on the codes'
exact digits, in Gluon for Hopper (sm_90): y[M, N]
= MXFP8 activation x FP8 weight with 32x32 UE8M0 block scales, for 1 <= M <= 64 rows, bitwise equal
to `reference.linear.mxfp8_mm`. The same contract, arguments and reduction order as
`ops.exact_f64_mm.ExactF64MM` (the Triton form), whose module docstring argues the exactness:

- an E4M3 value and a product of two are exact in FP64; every partial sum of a 32-wide block's
  products is a multiple of 2^-18 below 32 * 448^2 < 2^23 in magnitude, at most 41 significant
  bits, so every add of the FP64 MMA is exact whatever its order: its result is the exact block
  sum, and one `cvt.rn.f32.f64` rounds it once to nearest even (the block partial);
- the partial is scaled by sx[m, kb], then by sw[n // 32, kb] in a separate `mul.rn` (never fused
  into the add), and added in K order into an FP32 accumulator that starts at 0; the sum is
  rounded to BF16 (nearest even) or left FP32. With `GluonExactConfig.fuse_scales` a program whose
  x scale bytes all lie in the weight's `gluon_exact_common.fused_scale_range` adds each partial in
  one FMA with the scales' product instead, fma(part, sx * sw, acc): there both products are exact
  (no rounding, no underflow below FP32's least subnormal, no overflow), so the FMA's one rounding is
  the add's (that module's argument above FUSED_X_BYTES; the same bits); the program checks the
  bytes once before its first slot and runs the unfused loop otherwise.

What the Gluon form does differently (the layout of `ops.gluon_mm`, the Gluon FP8 tier):

- **Swap AB.** A program computes y^T[BN, BT] = W[BN weight rows, K range] @ x^T: the weight rows
  are the MMA's M side, x's rows (padded to BT = 8, 16, 32 or 64, at most `block_m`; TMA fills the
  rows past M with zeros; calls of more rows take several programs per weight tile) its N side.
  The MMA is `mma_v2` on FP64 operands (DMMA m16n8k16), in an
  `NVMMADistributedLayout(version=[2, 0], instr_shape=[16, 8])` of the 4 consumer warps
  (`GluonExactConfig.warps_n`: how they split x's rows; the rest split the weight rows).
- **A TMA producer warp** (`gluon_ring.producer`, the Gluon tier's ring) streams [BN, 128] FP8
  weight tiles and the matching [BT, 128] activation tiles through a ring of `stages`
  shared-memory slots (mbarriers `ready` / `empty`); the consumer warps load each 32-wide K block
  of both tiles straight from shared memory into the MMA's operand layouts
  (`DotOperandLayout(k_width=1)`, bytes), convert the codes to FP64 in registers, run the block's
  MMA from a zero accumulator, round, scale and add (above). Each warp converts its own x operand
  once per K block (the warps that share x's columns each convert them).
- **The weight's conversion E4M3 -> FP64** (`GluonExactConfig.convert`) and **the k order within
  a block**: `ops.gluon_exact_fp64` (the FP64 forms' operands and block partials, their exactness).
- **Scales** as in `gluon_mm`: one int32 word (four UE8M0 bytes) per weight-row block and per
  activation row per 128-deep slot, loaded one slot ahead; hence K % 128 == 0 and word-aligned
  scale rows. The weight's word is loaded per 16-row MMA tile in the packed and FP16 digit forms
  (`_tile_weight_scales`); with the warps along K and in "f16w" / "f16wp" x's bytes are decoded
  to FP32 once a slot by the consumer warps into shared memory (`gluon_exact_digits.store_x_scales`,
  one or two a thread) instead of by every thread for each of its x columns.
- **256-deep slots** (`GluonExactConfig.block_k=256`, K % 256 == 0): eight K blocks a slot, two
  scale words a row, the TMA boxes [rows, 256]; one wait, one release (and with the warps along K
  one round of the terms through shared memory) per 256 of K instead of two; with warps_k=4 each
  warp takes blocks w and w + 4 of the batched MMA: two independent MMA chains a slot. The
  terms join the sum in the same K order.
- **Two slots a wait** (`GluonExactConfig.pair_slots`, the mma.sync consumers; K % (2 x block_k) ==
  0, no K split): the producer fills two ring slots on the first one's ready barrier and waits for
  their release on its empty barrier (`_ring_producer`), and the consumer warps take the two slots
  as one unit (`_consumer_slots` / `gluon_exact_k._consumer_k_slots` with SLOTS=2: both slots'
  blocks in K order; along K both slots' MMA chains, their terms in two buffers, one barrier, the
  terms added slot by slot in K order). Triton 3.6 puts a CTA barrier before every mbarrier wait and
  arrive of the consumer warpgroup, so a unit holds the barriers of one slot (two, three along K
  with the terms' barrier) for two slots' work; the same bits.
- **Optional K split** (`GluonExactConfig.split`, calls of at most `split_rows` rows): several
  programs share a weight tile's K; each stores its block terms (the M real rows) in a plan-owned
  workspace, and the tile's last program to arrive (an acq_rel atomic counter, reset for the next
  call and a CUDA graph's replay) adds all K / 32 of them in K order from 0: `exact_mm`'s scheme,
  never partial sums added together (`gluon_exact_common.split_k_sum`, which `gluon_exact_fma` runs too: the terms
  loaded up to 64 registers' worth at a time, independent loads ahead of their adds, so one L2
  round trip per chunk rather than per term).
- **Warps along K** (`GluonExactConfig.warps_k` = 2 or 4; 1, the default, is the layout above): the
  consumer warps split each slot's four 32-deep K blocks instead of the weight rows. The MMA is
  batched, [4, BN, KC] x [4, KC, BT] in an `NVMMADistributedLayout(instr_shape=[1, 16, 8])` of warps
  [warps_k, 4 / warps_k, 1] (batch j: K block j, `gluon_exact_fp64._operands_k` loading both tiles'
  four blocks at once, the k permutation as above); each warp forms its blocks' exact partials,
  rounds and scales them (the block terms, the same values as above) and stores them to a [4, BN,
  BT] FP32 buffer in shared memory; after a barrier each thread reads its outputs' four terms and
  adds them in K order to its accumulator (`gluon_exact_k.consumer_k`). So the terms join the sum in
  the same order, one at a time, and nothing leaves the program: block_n can drop to 16 or 32 (each
  warp's MMA still m16n8k16), N / 16 programs for the shapes with few 64-row tiles, without the
  split's global workspace (which still combines with it). Each x code is converted by 4 / warps_k
  warps (with warps_k=1 by every warp).
- **The query RoPE epilogue** (`rope=(cos, sin)`, the step's wq_b): the program that stores a tile
  (with the K split the last arriver; each row tile with its own rows of cos/sin) rotates each
  head's channels 448..511 on the BF16-rounded tile (`gluon_epilogues.bf16_out`), the bits of the
  call followed by `kv_write.query_rope_`. The accumulator's layouts hold a RoPE pair's two
  columns in two threads, so a tile with rotary channels goes through a layout that keeps each
  pair in one thread and back (`gluon_exact_common.store_tile`); the others skip it. Without it
  (ROPE a constexpr, its arguments None) the kernel is the same code.

Cost (an estimate from the instruction rates; `scripts/probe_gluon_exact_mm.py` measures it): the
FP64 MMA does max(8, rows) multiply-adds per weight byte (its N side is at least 8) at about 128
per clock per SM on an H100 / H200 (a DMMA m16n8k16 about 64 clocks of its sub-partition's unit),
so from 16 rows on it, not the weight's read, bounds the time (about 2x the read's time at 16
rows, 9x at 64); at 1-8 rows the MMA and the conversions (sm_90 compiles: 3-4 integer instructions
per weight code in "int" / "raw", 2 in the packed forms, or a quarter-rate F2F) both come near the
read's time. With warps_k=4 a warp's slot is one 32-deep block of each of the tile's rows: at 8 x
rows and 16 weight rows 167 instructions ("raw"; 2 DMMA) for 512 weight bytes, 0.33 a byte
against 0.22 with warps_k=1 (896 for 128 rows x 128; the terms' stores, barrier and reads, x's
conversion and the scales spread over fewer rows), in 4x the programs (N / 16). The H200 runs at
1-16 rows (wq_b 128 x 8 "raw" 23.3 us, 128 x 16 "int+cvt" 35.1, wo_b 16 x 8 along K 36.0) come
closer to the sum of each sub-partition's DMMA time (64 clocks each) and its consumer warps' issued
instructions than to the larger of the two: the instructions per DMMA (56 at 128 x 8 "raw", 42.5 in
"rawp"; 84 at 16 x 8 along K, 69.5 in "rawp", 61 with 256-deep slots and 16-deep steps) are worth
about as much as the DMMA's own 64 clocks.

**The FP16 digits** (`GluonExactConfig.convert` "f16d", "f16w", "f16wp"): the same block partials
on FP16 tensor cores from each code's two exact FP16 digits, in this kernel's ring, scales, K
order, K split and epilogue: `ops.gluon_exact_digits` (the forms and their exactness argument).

Every configuration, split and row count gives the same bits (`exact_mm.reduction_order`). A
`GluonExactMM` plan binds one weight (its TMA descriptor, workspace, counters) once; calling it
validates and launches. `ops.exact_linear.ExactLinear` runs it above a few rows per shape.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma

from .checks import require_int, row_configs
from .gluon_exact_common import (GluonExactPlan, block_term, fused_scale, fused_scales_ok, fused_take,
                                 ring_weight_args, split_k_sum, store_tile, sum_chunk, take_term, unit_words, wait_unit,
                                 ws_tile)
from .gluon_exact_digits import consumer_wg, digit_partial, x_scales_layout
from .gluon_exact_fp64 import form, fp64_partial, is_packed
from .gluon_exact_k import consumer_k, sum_layout
from .gluon_mm import _tile_scales, split_bounds
from .gluon_ring import SHARED_LIMIT, activation_operands, require_maxnreg, ring, ring_prefill, ring_producer
from .pdl import gluon_wait

MAX_ROWS = 64
BLOCK_K = 128                   # K per ring slot: four 32-wide blocks, one 32-bit scale word per row
BLOCK_KS = (128, 256)           # GluonExactConfig.block_k: 256, two scale words a row per slot
ROW_BUCKETS = (8, 16, 32, 64)   # BT: the MMA's N side
CONSUMER_WARPS = 4
CONVERTS = ("cvt", "int", "raw", "int+cvt", "raw+cvt", "intp", "rawp", "intp+cvt", "rawp+cvt", "f16d", "f16w", "f16wp")
# GluonExactConfig.block_n per warps_k: with warps_k > 1, 16 to 64 weight rows a warp
BLOCK_NS = {1: (64, 128), 2: (32, 64, 128), 4: (16, 32, 64)}


@gluon.jit
def _block_partial(w_tile, x_tile, j: gl.constexpr, zero, CONVERT: gl.constexpr, KC: gl.constexpr,
                   mma_layout: gl.constexpr):
    """The exact dot of K block j (columns 32j..32j+31) of the slot's weight tile [BN, 128 or 256]
    and activation tile [BT, ...] in shared memory, rounded once to FP32, [BN, BT]: on FP16 tensor
    cores for "f16d" (`gluon_exact_digits.digit_partial`), else on the FP64 MMA
    (`gluon_exact_fp64.fp64_partial`, from `zero`)."""
    if CONVERT == "f16d":
        part = digit_partial(w_tile, x_tile, j, mma_layout)
    else:
        part = fp64_partial(w_tile, x_tile, j, zero, CONVERT, KC, mma_layout)
    return part


@gluon.jit
def _consumer(w_smem, x_smem, ready, empty, sw_words, sx_words, ws_ptr, step_lo, n_steps, M,
              sx_ptr, stride_sxm, fuse_lo, fuse_hi,
              STAGES: gl.constexpr, BN: gl.constexpr, BT: gl.constexpr, CONVERT: gl.constexpr, KC: gl.constexpr,
              SPLIT_K: gl.constexpr, mma_layout: gl.constexpr, FUSE: gl.constexpr, SLOTS: gl.constexpr):
    """The consumer warps: `_consumer_slots`, with FUSE and x's scale bytes in [fuse_lo, fuse_hi]
    (`fused_scales_ok` over the program's rows and K steps, x's scales at sx_ptr, row stride
    stride_sxm words) in its fused form. Returns (acc, )."""
    if FUSE:
        if fused_scales_ok(sx_ptr, stride_sxm, M, step_lo, n_steps, fuse_lo, fuse_hi, BT, w_smem.shape[2] // 128):
            acc = _consumer_slots(w_smem, x_smem, ready, empty, sw_words, sx_words, ws_ptr, step_lo, n_steps, M,
                                  STAGES, BN, BT, CONVERT, KC, SPLIT_K, mma_layout, True, SLOTS)
        else:
            acc = _consumer_slots(w_smem, x_smem, ready, empty, sw_words, sx_words, ws_ptr, step_lo, n_steps, M,
                                  STAGES, BN, BT, CONVERT, KC, SPLIT_K, mma_layout, False, SLOTS)
    else:
        acc = _consumer_slots(w_smem, x_smem, ready, empty, sw_words, sx_words, ws_ptr, step_lo, n_steps, M,
                              STAGES, BN, BT, CONVERT, KC, SPLIT_K, mma_layout, False, SLOTS)
    return (acc, )


@gluon.jit
def _consumer_slots(w_smem, x_smem, ready, empty, sw_words, sx_words, ws_ptr, step_lo, n_steps, M,
                    STAGES: gl.constexpr, BN: gl.constexpr, BT: gl.constexpr, CONVERT: gl.constexpr,
                    KC: gl.constexpr, SPLIT_K: gl.constexpr, mma_layout: gl.constexpr, FUSED: gl.constexpr,
                    SLOTS: gl.constexpr):
    """The consumer warps' slots, a unit of SLOTS ring slots (1, or 2 with
    `GluonExactConfig.pair_slots`: `_ring_producer` fills both on one ready barrier) per wait: per
    slot, its NB K blocks' exact partials (`_block_partial`; NB = block_k / 32, 4 or 8) and terms
    (`block_term`), added to the FP32 accumulator in K order, or, SPLIT_K, stored to the workspace
    (`ws_ptr`: this tile's terms, block kb at ws_ptr + kb * BN * M, [BN, M] n-major, the M real
    rows); FUSED: each term and its add in one FMA with the scales' product (`fused_scale`,
    `fused_take`: the same bits for the bytes `fused_scales_ok` checked). The unit goes back to the
    producer once every consumer thread has loaded its last block. Returns the accumulator (zeros
    with SPLIT_K)."""
    acc = gl.zeros([BN, BT], gl.float32, mma_layout)
    zero = gl.zeros([BN, BT], gl.float64, mma_layout)
    NB: gl.constexpr = w_smem.shape[2] // 32
    ws_offs, ws_mask = ws_tile(BN, BT, M, mma_layout)
    unit_next = unit_words(sw_words, sx_words, step_lo, NB // 4, SLOTS)
    for u in range(n_steps // SLOTS):
        i = u * SLOTS
        unit, unit_next, s = wait_unit(u, unit_next, sw_words, sx_words, ready, step_lo, n_steps, STAGES, NB, SLOTS)
        for t in gl.static_range(SLOTS):
            w_tile = w_smem.index(s + t)
            x_tile = x_smem.index(s + t)
            for j in gl.static_range(NB):
                part = _block_partial(w_tile, x_tile, j, zero, CONVERT, KC, mma_layout)
                if t == SLOTS - 1 and j == NB - 1:
                    # Every consumer thread's loads of the unit are done (their values were used
                    # by the MMA) before one thread hands the unit back.
                    gl.thread_barrier()
                    mbarrier.arrive(empty.index(s), count=1)
                acc = _take_block(acc, part, unit[t], j, (step_lo + i + t) * NB + j, ws_ptr, ws_offs, ws_mask, BN,
                                  M, SPLIT_K, FUSED)
    return acc


@gluon.jit
def _take_block(acc, part, words, j: gl.constexpr, block, ws_ptr, ws_offs, ws_mask, BN: gl.constexpr, M,
                SPLIT_K: gl.constexpr, FUSED: gl.constexpr):
    """K block `block` (the slot's block j, its scales in the slot's words) added to the accumulator
    in K order: `take_term` of `block_term`'s term, or with FUSED `fused_take` with the scales'
    product (`fused_scale`). Returns the accumulator."""
    if FUSED:
        if j < 4:
            sw, _, sx, _ = words
        else:
            _, sw, _, sx = words
        acc = fused_take(acc, part, fused_scale(sx[None, :], sw[:, None], j % 4), block, ws_ptr, ws_offs, ws_mask,
                         BN, M, SPLIT_K)
    else:
        acc = take_term(acc, block_term(part, words, j), block, ws_ptr, ws_offs, ws_mask, BN, M, SPLIT_K)
    return acc


@gluon.jit
def _tile_weight_scales(sw_ptr, off_n, N, stride_swn, BN: gl.constexpr, layout: gl.constexpr):
    """Per weight row of the tile at off_n ([BN] in `layout`), the pointer to its first scale word as
    `gluon_mm._tile_scales` gives it, from the first row of the row's 16-row MMA tile: the rows of a
    tile share their 32-row scale block, so each thread loads and decodes one scale per tile and
    block instead of one per row (the packed forms and the FP16 digits; sm_90: 680 instead of 736
    instructions a slot at 128 x 8 "rawp", 139 instead of 147 at 16 x 8 along K, 619 instead of 647
    at 32 x 16 "f16d" along K). Rows past N read a valid row's scales and are masked at the store."""
    rn16 = off_n + gl.arange(0, BN, layout=layout) // 16 * 16
    return sw_ptr + (gl.minimum(rn16, N - 1) // 32) * stride_swn


@gluon.jit
def _ring_producer(w_desc, x_desc, w_smem, x_smem, ready, empty, off_n, x_row, step_lo, n_steps,
                   STAGES: gl.constexpr, PAIRS: gl.constexpr, PREFILLED: gl.constexpr = False):
    """The kernel's 1-warp TMA producer: `gluon_ring.producer`'s ring slot by slot, or with PAIRS
    (`GluonExactConfig.pair_slots`) two slots at a time: steps 2p and 2p + 1's weight tiles [BN,
    BLOCK_K] at (off_n, k) and activation tiles [BT, BLOCK_K] at (x_row, k), k = (step_lo + 2p + t) x
    BLOCK_K, into ring slots 2q and 2q + 1 (q = p % (STAGES / 2)), all four copies on the even
    slot's ready barrier, once the consumer has released the pair on the even slot's empty barrier
    (the odd slots' barriers unused); n_steps even. PREFILLED: after the PDL launch's
    `gluon_ring.ring_prefill` (in units of two slots with PAIRS), which requested the first units'
    weight tiles: the producer waits for the predecessor itself, copies those units' activation
    tiles and goes on from the first unit past them (slot by slot: `gluon_ring.producer_prefilled`)."""
    if PAIRS:
        UNITS: gl.constexpr = STAGES // 2
        BK: gl.constexpr = w_desc.block_type.shape[1]
        p0 = 0
        if PREFILLED:
            gluon_wait()
            for u in gl.static_range(UNITS):
                if 2 * u < n_steps:
                    for t in gl.static_range(2):
                        tma.async_copy_global_to_shared(x_desc, [x_row, (step_lo + 2 * u + t) * BK], ready.index(2 * u),
                                                        x_smem.index(2 * u + t))
            p0 = gl.minimum(n_steps // 2, UNITS)
        for p in range(p0, n_steps // 2):
            s = p % UNITS * 2
            # a fresh barrier counts as having completed the phase before its first: the first pass
            # over the ring does not wait
            mbarrier.wait(empty.index(s), ((p // UNITS) & 1) ^ 1)
            mbarrier.expect(ready.index(s), 2 * (w_desc.block_type.nbytes + x_desc.block_type.nbytes))
            for t in gl.static_range(2):
                k = (step_lo + 2 * p + t) * BK
                tma.async_copy_global_to_shared(w_desc, [off_n, k], ready.index(s), w_smem.index(s + t))
                tma.async_copy_global_to_shared(x_desc, [x_row, k], ready.index(s), x_smem.index(s + t))
    else:
        ring_producer(w_desc, x_desc, w_smem, x_smem, ready, empty, off_n, x_row, 0, step_lo, n_steps, STAGES,
                      PREFILLED)


@gluon.jit(do_not_specialize=["M", "stride_sxm", "stride_swn", "steps_per_split", "n_steps_total", "n_split",
                             "fuse_lo", "fuse_hi", "stride_cm", "stride_sm"])
def _gluon_exact_mm_kernel(
    w_desc, x_desc, sx_ptr, sw_ptr, y_ptr, ws_ptr, cnt_ptr,
    M, N, stride_sxm, stride_swn, stride_ym, steps_per_split, n_steps_total, n_split, fuse_lo, fuse_hi,
    BT: gl.constexpr, STAGES: gl.constexpr, CONVERT: gl.constexpr, KC: gl.constexpr, WARPS_N: gl.constexpr,
    SPLIT_K: gl.constexpr, OUT_F32: gl.constexpr, WARPS_K: gl.constexpr = 1, FUSE: gl.constexpr = False,
    PAIRS: gl.constexpr = False,
    cos_ptr=None, sin_ptr=None, stride_cm=None, stride_sm=None, ROPE: gl.constexpr = False,
    PDL: gl.constexpr = False,
):
    # Grid (N tiles, M tiles, n_split K splits): program (t, u, s) covers weight rows [t*BN, +BN), x
    # rows [u*BT, +BT) and the K steps (32 NB deep, the descriptors' box) [s*steps_per_split,
    # +steps_per_split); sx_ptr and sw_ptr point at the scales as int32 words (four UE8M0 bytes),
    # strides in words. Rows past N or M read the last valid row's scales and are masked at the
    # stores. SPLIT_K: n_split > 1 (one M tile), the block terms through ws_ptr ([N tiles, K / 32,
    # BN, M] FP32) and the last arriver's K-ordered sum (module doc). WARPS_K > 1: the consumer
    # warps split each slot's K blocks (`gluon_exact_k.consumer_k`), the block terms through shared
    # memory. FUSE: the block terms and their adds in one FMA where x's scale bytes lie in [fuse_lo,
    # fuse_hi] (`GluonExactConfig.fuse_scales`; with WARPS_K > 1 for tiles of one weight scale
    # block). PAIRS (the mma.sync consumers, no split, an even number of steps a program): the
    # ring's slots filled, waited for and released two at a time (`_ring_producer`, the consumers'
    # units of two slots). ROPE: the query RoPE epilogue (`store_tile`) with cos/sin [M, 32] FP32 at
    # cos_ptr / sin_ptr (row strides stride_cm / stride_sm; all four None without it, so that they
    # take no kernel parameter). PDL: launched by programmatic dependent launch: the ring's first
    # weight tiles (with PAIRS its first units') requested before the wait for the kernel before it
    # (`gluon_ring.ring_prefill`), the x tiles after.
    BN: gl.constexpr = w_desc.block_type.shape[0]
    NB: gl.constexpr = w_desc.block_type.shape[1] // 32      # K blocks a slot: 4, or 8 (block_k 256)
    SLOTS: gl.constexpr = 2 if PAIRS else 1                   # ring slots a consumer's wait
    if CONVERT == "f16w" or CONVERT == "f16wp":
        mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                             instr_shape=[16, BT, 16])
        out_layout: gl.constexpr = mma_layout
    elif WARPS_K == 1:
        mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[4 // WARPS_N, WARPS_N],
                                                             instr_shape=[16, 8])
        out_layout: gl.constexpr = mma_layout
    else:
        mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[WARPS_K, 4 // WARPS_K, 1],
                                                             instr_shape=[1, 16, 8])
        out_layout: gl.constexpr = sum_layout(BN, BT)
    w_smem, x_smem, ready, empty = ring(w_desc, x_desc, STAGES)

    pid_n = gl.program_id(0)
    off_m = gl.program_id(1) * BT
    pid_s = gl.program_id(2)
    # this program's rows of x: from off_m on, M of them (at most BT count)
    M = M - off_m
    sx_ptr += off_m * stride_sxm
    y_ptr += off_m * stride_ym
    if ROPE:
        cos_ptr += off_m * stride_cm
        sin_ptr += off_m * stride_sm
    step_lo = pid_s * steps_per_split
    n_steps = gl.minimum(steps_per_split, n_steps_total - step_lo)
    if PDL:
        ring_prefill(w_desc, x_desc, w_smem, ready, pid_n * BN, step_lo, n_steps, STAGES, SLOTS)
    if WARPS_K == 1:
        scale_layout: gl.constexpr = mma_layout
    else:
        # the scale words in the batched layout's [BN] / [BT] slices (dims 0 and 2 / 0 and 1)
        scale_layout: gl.constexpr = gl.SliceLayout(0, mma_layout)
    sw_words, sx_words = _tile_scales(sw_ptr, sx_ptr, pid_n * BN, M, N, stride_swn, stride_sxm, BN, BT,
                                      scale_layout)
    if is_packed(form(CONVERT, 0)) or CONVERT == "f16d" or CONVERT == "f16w" or CONVERT == "f16wp":
        sw_words = _tile_weight_scales(sw_ptr, pid_n * BN, N, stride_swn, BN, gl.SliceLayout(1, scale_layout))
    ws_tile = ws_ptr + pid_n * (n_steps_total * NB * BN) * M
    if CONVERT == "f16w" or CONVERT == "f16wp" or WARPS_K > 1:
        # x's scales of a slot decoded once by the consumer warps ([NB, BT] FP32 in shared memory,
        # one buffer per slot parity), from each x row's words (every row of the [NB, BT] pointers
        # the same: `gluon_exact_digits.store_x_scales`)
        xs = gl.allocate_shared_memory(gl.float32, [2, NB, BT], gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0]))
        xs_l: gl.constexpr = x_scales_layout(NB, BT)
        rm = gl.arange(0, BT, layout=gl.SliceLayout(0, xs_l))
        sx_words = (sx_ptr + gl.minimum(rm, M - 1) * stride_sxm)[None, :] + gl.zeros([NB, 1], gl.int32, xs_l)
    if CONVERT == "f16w" or CONVERT == "f16wp":
        # x's digit tiles of one slot: per K block the integer digits and the remainders, [BT, 32] FP16
        xd = gl.allocate_shared_memory(gl.float16, [2 * NB * BT, 32], gl.NVMMASharedLayout.get_default_for(
            [BT, 32], gl.float16))
        cvt_l: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[8, 4],
                                               warps_per_cta=[4, 1], order=[1, 0])
        acc, = gl.warp_specialize([
            (consumer_wg, (w_smem, x_smem, xd, xs, ready, empty, sw_words, sx_words, ws_tile, step_lo, n_steps, M,
                           sx_ptr, stride_sxm, fuse_lo, fuse_hi, STAGES, BN, BT, SPLIT_K, mma_layout, cvt_l,
                           CONVERT == "f16wp", FUSE)),
            (_ring_producer, (w_desc, x_desc, w_smem, x_smem, ready, empty, pid_n * BN, off_m, step_lo, n_steps,
                              STAGES, False, PDL)),
        ], [1], [24])
    elif WARPS_K == 1:
        acc, = gl.warp_specialize([
            (_consumer, (w_smem, x_smem, ready, empty, sw_words, sx_words, ws_tile, step_lo, n_steps, M,
                         sx_ptr, stride_sxm, fuse_lo, fuse_hi, STAGES, BN, BT, CONVERT, KC, SPLIT_K, mma_layout,
                         FUSE, SLOTS)),
            (_ring_producer, (w_desc, x_desc, w_smem, x_smem, ready, empty, pid_n * BN, off_m, step_lo, n_steps,
                              STAGES, PAIRS, PDL)),
        ], [1], [24])
    else:
        # per slot of a unit (`_consumer_k_slots`) its terms' and x scales' buffers, separate
        # allocations
        terms_sl: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[2, 1, 0])
        terms = gl.allocate_shared_memory(gl.float32, [NB, BN, BT], terms_sl)
        if PAIRS:
            xs_u = (xs, gl.allocate_shared_memory(gl.float32, [2, NB, BT], xs.layout))
            terms_u = (terms, gl.allocate_shared_memory(gl.float32, [NB, BN, BT], terms_sl))
        else:
            xs_u = (xs, )
            terms_u = (terms, )
        # the fused scaling along K: the tile's one weight scale row of words, in x's scales' layout
        sw_row_words = sw_ptr + (gl.minimum(pid_n * BN, N - 1) // 32) * stride_swn + gl.zeros([NB, BT], gl.int32, xs_l)
        acc, = gl.warp_specialize([
            (consumer_k, (w_smem, x_smem, ready, empty, terms_u, xs_u, sw_words, sx_words, ws_tile, step_lo, n_steps,
                           M, sw_row_words, sx_ptr, stride_sxm, fuse_lo, fuse_hi, STAGES, BN, BT, CONVERT, KC,
                           SPLIT_K, mma_layout, out_layout, FUSE and BN <= 32, SLOTS)),
            (_ring_producer, (w_desc, x_desc, w_smem, x_smem, ready, empty, pid_n * BN, off_m, step_lo, n_steps,
                              STAGES, PAIRS, PDL)),
        ], [1], [24])
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(i))
        mbarrier.invalidate(empty.index(i))

    rn = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, out_layout))
    rm = gl.arange(0, BT, layout=gl.SliceLayout(0, out_layout))
    mask = (rn[:, None] < N) & (rm[None, :] < M)
    y_ptrs = y_ptr + rm[None, :] * stride_ym + rn[:, None]
    if SPLIT_K:
        # the tile's K / 32 block terms [BN, M] in K order from 0, by the last program to arrive
        rl = gl.arange(0, BN, layout=gl.SliceLayout(1, out_layout))
        ws_mask = (rm[None, :] < M) & (rl[:, None] < BN)
        last, total = split_k_sum(gl.zeros([BN, BT], gl.float32, out_layout), ws_tile + rl[:, None] * M + rm[None, :],
                                   ws_mask, BN * M, n_steps_total * NB, cnt_ptr + pid_n, n_split,
                                   sum_chunk(BN * BT // 128))
        if last:
            store_tile(y_ptrs, total, mask, OUT_F32, pid_n * BN, M, cos_ptr, sin_ptr, stride_cm, stride_sm, ROPE)
    else:
        store_tile(y_ptrs, acc, mask, OUT_F32, pid_n * BN, M, cos_ptr, sin_ptr, stride_cm, stride_sm, ROPE)


@dataclass(frozen=True)
class GluonExactConfig:
    """One launch configuration; every configuration gives the same bits.

    convert: how the consumer makes FP64 operands of the weight's E4M3 codes: "cvt" (through FP32),
        "int" (integer operations and one FP64 multiply), "raw" (the integer pattern alone, x
        scaled by 2^1000; relies on the FP64 MMA's subnormal operands), or "int+cvt" / "raw+cvt"
        (even K blocks the first, odd blocks "cvt"): `gluon_exact_fp64`; "intp", "rawp",
        "intp+cvt", "rawp+cvt": the same with the pattern built four codes at a time and the weight
        scales loaded once per 16-row MMA tile (`gluon_exact_fp64`). "f16d", "f16w", "f16wp": no FP64
        operands - the codes' FP16 digits on FP16 MMAs (mma.sync; wgmma; wgmma with the next
        block's cross dots in flight), "f16w" / "f16wp" with warps_k=1 and warps_n=1 only (module
        doc).
    block_n: weight rows per program (the MMA's M side, the weight's TMA box [block_n, 128]): 64 or
        128 with warps_k=1 (at 8 x rows all 4 warps split the weight rows, 16 or 32 each); with
        warps_k > 1, 16, 32 or 64 (warps_k=4) or 32, 64 or 128 (warps_k=2): 16 to 64 rows a warp.
    block_m: the most x rows per program (8, 16, 32 or 64): a call's rows padded to the row bucket
        (8, 16, 32, 64) up to block_m, and calls of more rows take several programs per weight
        tile (the later ones read the weight tile from L2). At maxnreg=128, 64 weight rows take up
        to 32 x rows and 128 weight rows up to 16 without spilling (sm_90 compiles); more spill,
        and 64 x rows spilled in every form compiled ("cvt", "int", "raw", "int+cvt"; 1-4 warps
        along x) even without the cap (maxnreg=None: 255 registers and a stack). With warps_k=4
        and 16 weight rows, up to 64 x rows do not spill at maxnreg=128, and 16 at 64.
    stages: ring slots, 2..8.
    mma_k: the K depth of one operand load and MMA call, 16 (one DMMA m16n8k16 per 16 weight
        rows; the operands' loads are ldmatrix) or 32 (two chained; 8-byte loads, more registers).
    warps_n: of the 4 consumer warps, how many split x's rows (1, 2 or 4; the others split the
        weight rows); at a row bucket with fewer than 8 x rows per warp the launch uses fewer
        (`launch_warps_n`). 1 with warps_k > 1.
    warps_k: of the 4 consumer warps, how many split each slot's four K blocks (the others split
        the weight rows): 1 (every warp all four blocks of its rows, in K order, in registers), 2
        or 4 (warp w the blocks w, w + warps_k, ...: each block's exact partial and term formed by
        one warp, the slot's terms through shared memory and added in K order after a barrier,
        `consumer_k`; 4 x block_n x block_m FP32 of shared memory more). More, smaller
        programs for the shapes with few weight tiles (block_n 16: N / 16 programs) without the
        split's global workspace. The conversions "raw+cvt" / "rawp+cvt" (per K block) and
        "intp+cvt" are not offered with warps_k > 1, "int+cvt" alternates per 16-deep half of each
        block (mma_k=16).
    split: K splits (programs per weight tile) for calls of at most min(split_rows, block_m) rows,
        their block terms through a plan-owned workspace of N / block_n * K / 32 * block_n *
        min(split_rows, block_m) FP32, the tile's last program adding them in K order (the plan may
        use fewer splits so that none is empty; calls of more rows take one split).
    split_rows: the most rows a call may bring to run split (1..16: past 16 x rows a program, the
        split's per-element workspace offsets outgrow the registers at maxnreg=128).
    maxnreg: the launch's register cap per thread: the CTA holds 8 warps x 32 x cap registers (the
        consumer's 4 warps and the producer's, padded to a warpgroup), the producer warp drops to
        24 and the consumer warps rise to 2 x cap - 24; 128 keeps 2 CTAs per SM resident, and the
        default and the compile test's configurations do not spill there (a few wider ones with the
        K split spill a few registers: the probe prints registers and spills per configuration);
        None: Triton's (256, one CTA per SM).
    block_k: K per ring slot, 128 (four 32-deep blocks, one scale word a row) or 256 (eight, two
        words; K a multiple of 256): one ready / empty barrier pair, one wait, one release and,
        with warps_k > 1, one round of the terms through shared memory per 256 of K instead of two;
        with warps_k=4 each warp two independent MMA chains a slot (blocks w and w + 4), with
        warps_k=1 eight blocks' chains in one stretch of code (without spills at 8 x rows and a cap
        of 128, 128 x 8 "rawp" or 64 x 8 at 64; at 16 x rows and more they spill). The ring's bytes:
        stages x (block_n + block_m) x block_k.
    fuse_scales: each block's term and its K-ordered add (or the split's stored term) in one FMA
        with the two scales' product, fma(part, sx * sw, acc), instead of two rounded products and an
        add: the same bits wherever x's scale bytes and the weight's allow it (FP32 values exact
        throughout: `gluon_exact_common.fused_scale_range`), which the consumer checks once per
        program over the scales it reads, running the unfused loop otherwise. With warps_k > 1 for
        block_n <= 32 (a tile of one weight scale block; wider tiles run unfused).
    pair_slots: the ring's slots filled, waited for and released two at a time (one ready / empty
        barrier pair, one wait, one release and, with warps_k > 1, one round of the terms through
        shared memory per 2 x block_k of K; each warp's MMA chains of both slots in one stretch):
        Triton 3.6 puts a CTA barrier before every mbarrier wait and arrive of the consumer
        warpgroup, so this halves the barriers a K step. The mma.sync consumers (not "f16w" /
        "f16wp"), an even number of stages, no K split (split=1), K a multiple of 2 x block_k;
        with warps_k > 1 twice the terms' and x scales' shared memory.
    """

    convert: str = "int"
    block_n: int = 64
    block_m: int = 32
    stages: int = 4
    mma_k: int = 32
    warps_n: int = 1
    warps_k: int = 1
    split: int = 1
    split_rows: int = 16
    maxnreg: int | None = 128
    block_k: int = 128
    fuse_scales: bool = False
    pair_slots: bool = False

    @classmethod
    def from_spec(cls, spec: str) -> "GluonExactConfig":
        """The configuration a spec string names, convert:block_n:block_m:warps_n:mma_k:stages:split
        [:maxnreg[:warps_k[:block_k[:fuse_scales[:pair_slots]]]]] (maxnreg 0: None; absent: 128;
        warps_k absent: 1; block_k absent: 128; fuse_scales and pair_slots 0 or 1, absent: 0), the
        form the probe (scripts/probe_gluon_exact_mm.py) prints and `ops.exact_linear`'s plan is
        written in."""
        try:
            convert, bn, bm, wn, mk, stages, split, *rest = spec.split(":")
            if len(rest) > 5 or any(flag not in ("0", "1") for flag in rest[3:]):
                raise ValueError
            ints = [int(v) for v in (bn, bm, wn, mk, stages, split, *rest)]
        except ValueError:
            raise ValueError(f"a GluonExactConfig spec is convert:block_n:block_m:warps_n:mma_k:stages:split"
                             f"[:maxnreg[:warps_k[:block_k[:fuse_scales[:pair_slots]]]]] with integers after the "
                             f"conversion (fuse_scales and pair_slots 0 or 1), got {spec!r}") from None
        bn, bm, wn, mk, stages, split, *rest = ints
        maxnreg = rest[0] if rest else 128
        return cls(convert=convert, block_n=bn, block_m=bm, warps_n=wn, mma_k=mk, stages=stages, split=split,
                   maxnreg=maxnreg or None, warps_k=rest[1] if len(rest) > 1 else 1,
                   block_k=rest[2] if len(rest) > 2 else 128, fuse_scales=bool(rest[3]) if len(rest) > 3 else False,
                   pair_slots=bool(rest[4]) if len(rest) > 4 else False)

    @property
    def spec(self) -> str:
        """The spec string `from_spec` reads back as this configuration, every field written (maxnreg
        None as 0, fuse_scales and pair_slots as 0 or 1)."""
        return (f"{self.convert}:{self.block_n}:{self.block_m}:{self.warps_n}:{self.mma_k}:{self.stages}:{self.split}:"
                f"{self.maxnreg or 0}:{self.warps_k}:{self.block_k}:{int(self.fuse_scales)}:{int(self.pair_slots)}")

    def __post_init__(self):
        def is_int(v):
            return isinstance(v, int) and not isinstance(v, bool)
        if self.convert not in CONVERTS:
            raise ValueError(f"GluonExactConfig.convert must be one of {CONVERTS}, got {self.convert!r}")
        if self.mma_k not in (16, 32) or not is_int(self.mma_k):
            raise ValueError(f"GluonExactConfig.mma_k must be 16 or 32, got {self.mma_k!r}")
        if self.warps_n not in (1, 2, 4) or not is_int(self.warps_n):
            raise ValueError(f"GluonExactConfig.warps_n must be 1, 2 or 4, got {self.warps_n!r}")
        if self.warps_k not in (1, 2, 4) or not is_int(self.warps_k):
            raise ValueError(f"GluonExactConfig.warps_k must be 1, 2 or 4, got {self.warps_k!r}")
        block_ns = BLOCK_NS[self.warps_k]
        if self.block_n not in block_ns or not is_int(self.block_n):
            raise ValueError(f"GluonExactConfig.block_n must be one of {block_ns} with warps_k={self.warps_k}, "
                             f"got {self.block_n!r}")
        if self.convert in ("f16w", "f16wp") and self.warps_k != 1:
            raise ValueError(f"GluonExactConfig.convert {self.convert!r} (the FP16 digits) runs with warps_k=1 "
                             f"only, got warps_k={self.warps_k!r}")
        if self.convert in ("f16w", "f16wp") and self.warps_n != 1:
            raise ValueError(f"GluonExactConfig.convert 'f16w' (one warpgroup's wgmma) runs with warps_n=1 only, "
                             f"got warps_n={self.warps_n!r}")
        if self.warps_k > 1:
            if self.warps_n != 1:
                raise ValueError(f"GluonExactConfig.warps_n must be 1 with warps_k={self.warps_k} (the warps "
                                 f"split the K blocks and the weight rows), got {self.warps_n!r}")
            if self.convert in ("raw+cvt", "rawp+cvt"):
                raise ValueError(f"GluonExactConfig.convert {self.convert!r} is not offered with "
                                 f"warps_k={self.warps_k} (a warp's blocks share one MMA call): use 'raw', 'int', "
                                 f"'cvt' or 'int+cvt'")
            if self.convert == "intp+cvt":
                raise ValueError(f"GluonExactConfig.convert 'intp+cvt' is not offered with warps_k={self.warps_k} (its "
                                 f"packed halves are not whole loaded words): use 'int+cvt', 'intp' or 'rawp'")
            if self.convert == "int+cvt" and self.mma_k != 16:
                raise ValueError(f"GluonExactConfig.convert 'int+cvt' with warps_k={self.warps_k} alternates per "
                                 f"16-deep half of each K block: mma_k must be 16, got {self.mma_k!r}")
        if not isinstance(self.fuse_scales, bool):
            raise ValueError(f"GluonExactConfig.fuse_scales must be a bool, got {self.fuse_scales!r}")
        if not isinstance(self.pair_slots, bool):
            raise ValueError(f"GluonExactConfig.pair_slots must be a bool, got {self.pair_slots!r}")
        if self.pair_slots and (self.convert in ("f16w", "f16wp") or self.split != 1 or self.stages % 2):
            raise ValueError(f"GluonExactConfig.pair_slots takes the mma.sync consumers (not 'f16w' / 'f16wp'), "
                             f"split=1 and an even number of stages, got convert={self.convert!r}, "
                             f"split={self.split!r}, stages={self.stages!r}")
        if self.block_k not in BLOCK_KS or not is_int(self.block_k):
            raise ValueError(f"GluonExactConfig.block_k must be one of {BLOCK_KS}, got {self.block_k!r}")
        if self.block_m not in ROW_BUCKETS or not is_int(self.block_m):
            raise ValueError(f"GluonExactConfig.block_m must be one of {ROW_BUCKETS}, got {self.block_m!r}")
        if not is_int(self.stages) or not 2 <= self.stages <= 8:
            raise ValueError(f"GluonExactConfig.stages must be an int in [2, 8], got {self.stages!r}")
        require_int(self.split, "GluonExactConfig.split")
        if not is_int(self.split_rows) or not 1 <= self.split_rows <= 16:
            raise ValueError(f"GluonExactConfig.split_rows must be an int in [1, 16], got {self.split_rows!r}")
        require_maxnreg(self)
        if shared_bytes(self, self.block_m) > SHARED_LIMIT:
            raise ValueError(f"GluonExactConfig: stages={self.stages} x (block_n={self.block_n} + block_m="
                             f"{self.block_m}) x block_k={self.block_k} bytes of ring and, with warps_k > 1, "
                             f"block_k / 8 x block_n x block_m bytes of block terms exceed sm_90's {SHARED_LIMIT} "
                             f"bytes of shared memory "
                             f"({shared_bytes(self, self.block_m)}): fewer stages or a smaller block_m")


def block_t(rows: int, config: GluonExactConfig) -> int:
    """The x rows per program (the MMA's N side) of a call of `rows` rows in `config`: the row
    bucket, at most config.block_m."""
    return min(next(b for b in ROW_BUCKETS if b >= rows), config.block_m)


def split_rows(config: GluonExactConfig) -> int:
    """The most rows a call in `config` may bring to run split (one M tile)."""
    return min(config.split_rows, config.block_m)


def launch_warps_n(config: GluonExactConfig, bt: int) -> int:
    """The consumer warps along x's rows at row bucket `bt`: config.warps_n, at most bt / 8 (each
    warp's share of x's rows is a whole MMA N of 8)."""
    return min(config.warps_n, bt // 8)


def shared_bytes(config: GluonExactConfig, bt: int) -> int:
    """The ring's weight and activation tiles at row bucket `bt`, 1 KB for the mbarriers and what the
    compiler adds, with warps_k > 1 the slot's block terms (block_k / 32 x block_n x bt FP32; twice
    with pair_slots), in "f16w" / "f16wp" x's digit tiles (2 x block_k x bt FP16), and in both two
    slots' decoded x scales (2 x block_k / 32 x bt FP32; twice with pair_slots): with warps_k=1 and
    block_k=128 at most 8 x (128 + 64) x 128 + 1024 = 197632 bytes, within sm_90's
    `gluon_ring.SHARED_LIMIT` (GluonExactConfig checks the others at block_m)."""
    slots = 2 if config.pair_slots else 1
    terms = slots * config.block_k // 32 * config.block_n * bt * 4 if config.warps_k > 1 else 0
    wg = config.convert in ("f16w", "f16wp")
    digits = 2 * config.block_k * bt * 2 if wg else 0
    scales = 2 * slots * config.block_k // 32 * bt * 4 if wg or config.warps_k > 1 else 0
    return config.stages * (config.block_n + bt) * config.block_k + 1024 + terms + digits + scales


def launch_options(config: GluonExactConfig, bt: int, split: int) -> dict:
    """The kernel's constexpr arguments and launch options for `config` at row bucket `bt` and
    `split` K splits (the plan's launch and the sm_90 compile test share them). The launch runs the
    consumer's 4 warps and the producer's warp, padded to 8 warps; enable_reflect_ftz=False keeps
    the FP32 subnormals of the scaling's `mul.rn` (libdevice; Triton's default flushes them)."""
    opts = {"BT": bt, "STAGES": config.stages, "CONVERT": config.convert, "KC": config.mma_k,
            "WARPS_N": launch_warps_n(config, bt),
            "SPLIT_K": split > 1, "WARPS_K": config.warps_k, "FUSE": config.fuse_scales, "PAIRS": config.pair_slots,
            "num_warps": CONSUMER_WARPS,
            "enable_reflect_ftz": False}
    if config.maxnreg is not None:
        opts["maxnreg"] = config.maxnreg
    return opts


def check_depth(config: GluonExactConfig, n: int, k: int) -> None:
    """ValueError unless `config` runs a weight of (n, k): K a multiple of block_k (the ring's
    slots), and of 2 x block_k with pair_slots (its slots two at a time)."""
    if k % config.block_k:
        raise ValueError(f"GluonExactConfig.block_k={config.block_k} must divide K (the ring's slots), got "
                         f"weight {(n, k)}")
    if config.pair_slots and k % (2 * config.block_k):
        raise ValueError(f"GluonExactConfig.pair_slots takes K a multiple of 2 x block_k={2 * config.block_k} "
                         f"(its slots two at a time), got weight {(n, k)}")


class GluonExactMM(GluonExactPlan):
    """y[M, N] = bf16(sum over 32-wide K blocks kb, in K order, of RN(codes[:, kb] . weight[:, kb])
    * sx * sw) for 1 <= M <= max_rows <= 64, with the weight bound once: bitwise the contract of
    `reference.linear.mxfp8_mm`, on the FP64 MMA or on FP16 MMAs over the codes' digits
    (`GluonExactConfig.convert` "f16d", "f16w", "f16wp") from a TMA ring (module docstring); sm_90
    only.
    Reduction order: `exact_mm.reduction_order`, the same for every row count.

    weight: [N, K] float8_e4m3fn, unit stride along K, 16-byte aligned rows (TMA); K a positive
        multiple of 128 (the ring's 128-deep slots, one scale word per row per slot: the Gluon
        tier's condition; ExactF64MM takes any multiple of 32).
    w_scale: [ceil(N/32), K/32] UE8M0 (float8_e8m0fnu or uint8), unit stride along K, rows on
        4-byte boundaries.
    max_rows: the most rows a call may bring (1..64).
    config: the launch configuration: one GluonExactConfig for every call (default
        `GluonExactConfig()`), or `{most rows: GluonExactConfig}` for calls of up to that many rows
        (smallest key first; the largest key >= max_rows). Every configuration gives the same bits.
    workspace: None (the plan allocates its split-K workspace and counters) or a shared pool, as
        `ops.common.plan_workspace` says (FP32 slot 0, int32 slot 0).

    A call's codes must have 16-byte aligned rows (TMA) and its x_scale rows 4-byte boundaries. A
    plan whose launches split K owns (or takes) a workspace and one int32 counter per weight tile,
    zero between calls; its calls must not overlap in time (one stream, or ordered streams).
    """

    def __init__(self, weight: torch.Tensor, w_scale: torch.Tensor, max_rows: int = MAX_ROWS,
                 config: GluonExactConfig | dict[int, GluonExactConfig] | None = None, workspace=None):
        n, k = ring_weight_args(weight, w_scale, max_rows, MAX_ROWS, "ops.exact_f64_mm")
        self._configs = row_configs(GluonExactConfig() if config is None else config, GluonExactConfig,
                                    "a GluonExactConfig", max_rows)
        for _, c in self._configs:
            check_depth(c, n, k)
        self._bind(weight, w_scale, max_rows, [(c.block_n, c.block_k) for _, c in self._configs])
        # The split launches' workspace: each weight tile's [K/32, block_n, rows] block terms.
        self._bind_split(workspace, [(c.block_n, k // 32 * c.block_n * min(split_rows(c), most, max_rows))
                                     for most, c in self._configs if self.split_of(c) > 1])

    def split_of(self, config: GluonExactConfig) -> int:
        """The K splits of a launch in `config` of at most `split_rows(config)` rows: none empty."""
        return split_bounds(config.split, self.k, config.block_k)[1]

    def _launch(self, codes: torch.Tensor, x_scale: torch.Tensor, out: torch.Tensor, m: int,
                cfg: GluonExactConfig, epilogue: dict) -> None:
        """The kernel's launch for a call of m rows in `cfg`, its arguments checked (`__call__`);
        epilogue: `exact_mm.rope_kwargs`' keyword arguments."""
        bt = block_t(m, cfg)
        x_desc, sx_words = activation_operands(codes, x_scale, bt, cfg.block_k)
        steps = self.k // cfg.block_k
        per, split = split_bounds(cfg.split, self.k, cfg.block_k) if m <= split_rows(cfg) else (self.k, 1)
        per //= cfg.block_k
        _gluon_exact_mm_kernel[(-(-self.n // cfg.block_n), -(-m // bt), split)](
            self._w_descs[(cfg.block_n, cfg.block_k)], x_desc, sx_words, self._sw_words, out, self._workspace,
            self._counters,
            m, self.n, sx_words.stride(0), self._sw_words.stride(0), out.stride(0), per, steps, split,
            *self.fused_range, OUT_F32=out.dtype == torch.float32, **launch_options(cfg, bt, split), **epilogue,
        )
