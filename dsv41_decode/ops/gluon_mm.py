"""The low-batch MXFP8 linear in Gluon for Hopper (sm_90): y[M, N] BF16 = MXFP8 activation x FP8
weight with 32x32 UE8M0 block scales, FP32 accumulation, 1 <= M <= 64 rows. Same contract and
arguments as `ops.low_latency_mm` (the Triton tier, the portable path) and
`reference.linear.mxfp8_mm`.

What Gluon gives here that `tl.dot` does not (docs/notes-low-latency-mm.md, "What the sweep shows"):

- **Swap AB.** A program computes y^T[BLOCK_N = 64, BLOCK_T] = W[64 rows, K range] @ x^T: the
  weight rows are the wgmma's M (one warpgroup, m64), the rows of x (padded to BLOCK_T = 8, 16, 32
  or 64; TMA fills the rows past M with zeros) its N. One program reads its weight bytes once.
  (`GluonMMConfig.warpgroups=2`: 128 weight rows per program, two consumer warpgroups of 64.)
- **A TMA producer warp.** `warp_specialize` splits the program into a 1-warp producer that
  streams 64 x 128 FP8 weight tiles (8 KB) and the matching [BLOCK_T, 128] activation tiles
  through a ring of STAGES >= 3 shared-memory slots, each completed on its `ready` mbarrier (TMA
  transaction bytes) and handed back on its `empty` mbarrier (`gluon_ring.ring`, `gluon_ring.producer`),
  and a 4-warp consumer warpgroup. (`GluonMMConfig.block_k=256`: 256-deep slots, eight K blocks each.)
- **Per-32-block FP8 wgmma with FP32 promotion, two groups in flight.** A 128-deep step holds
  four 32-wide K blocks. For each block kb the consumer issues one asynchronous wgmma
  m64 n{BLOCK_T} k32 over the 32-column slice of the slot (`use_acc=False`: the block's partial
  alone, from zero), then retires the previous block's group (`warpgroup_mma_wait(1)`: at most one
  group left in flight) and promotes it: `acc += (part * sx[m, kb]) * sw[n // 32, kb]` in FP32,
  the reference's order. So block kb+1's MMA runs while block kb is scaled, and the FP32
  accumulator only ever receives scaled block partials, in K order. `GluonMMConfig.mma` keeps
  more groups in flight with the same partials and the same adds: "slot" issues a slot's blocks
  back to back into separate zero-started partials and then retires and promotes them in K order;
  "ahead" does so for two slots at once. Where a mode's partials do not fit the registers of the
  launch's residency, the next shallower mode runs (`launch_mode`).

  Why per block and not per 128 (DeepGEMM's promotion interval): the contract scales each 32-wide
  block's partial by that block's two scales before it joins the sum (spec-decisions, decision 1),
  and the scales differ per block, so the partial cannot be longer than one block. Within one
  block the wgmma k32 adds the 32 products in the tensor core. The exact sum needs up to 41 bits
  (products of E4M3 codes are multiples of 2^-18 below 2^18; the reference forms it in FP64 and
  rounds once to FP32), so no FP32 result is exact in general: at best the correctly rounded sum,
  and Hopper's FP8 MMA does not promise even that (it aligns the products to the largest with a
  limited number of bits). The block partial is therefore the hardware's - the same instruction,
  from a zero accumulator (SASS: QGMMA.64xNx32.F32.E4M3.E4M3 ... RZ), that `low_latency_mm`'s
  32-deep `tl.dot` compiles to - and it is the only step that is not exactly the reference's. The
  scaling by two powers of two is exact (outside FP32's subnormal range) and the K-ordered FP32
  adds are the reference's adds.
- **The scales** of a step (four UE8M0 bytes per weight-row block and per activation row, per 128
  of K) are loaded as one 32-bit word per row, one step ahead of their use (loop-carried
  registers), and split with shifts; the plan requires K % 128 == 0 and word-aligned scale rows.
- **Split-K with a deterministic reduction**, as `low_latency_mm`: grid (N tiles, K splits); each
  split stores its FP32 partial of the M real rows to the plan's workspace, then one acq_rel
  atomic on the tile's counter; the last split to arrive adds the partials in split order (from
  zero), rounds to BF16 (round to nearest even), stores y and resets the counter (replayable in a
  CUDA graph with no memset). (`GluonMMConfig.persistent`: one program per resident CTA takes the
  (tile, split) items in turn through one ring, the epilogue in the consumer partition;
  `GluonMMConfig.retile`: the plan streams a tile-contiguous copy of the weight.)

- **The query RoPE epilogue** (`GluonMM.__call__(rope=(cos, sin))`, the step's wq_b): y read as [M,
  N / 512, 512] queries, the program that stores a tile (with split-K the last arriver) rotates the
  pairs of every head's channels 448..511 on the BF16-rounded tile before its store, exactly as
  `kv_write.query_rope_` would afterwards (`gluon_epilogues.rope_tile`: explicitly rounded FP32
  products and sums, then BF16), so the separate RoPE launch leaves the step's chain with the same
  bits. Tiles without rotary channels skip it (with 128-row tiles, one in four holds a head's
  channels 384..511, half of them rotated).
- **The index query epilogue** (`GluonMM.__call__(index_query=(cos, sin))`, the indexer's wq_b): y
  read as [M, N / 128, 128] index queries, the storing program applies `index_query_`'s iq half to
  the BF16-rounded tile: RoPE on each head's channels 64..127 (`gluon_epilogues.rope_pairs`, as
  above), then MXFP4 quantize-dequantize per 32-channel block (`gluon_epilogues.mxfp4_fake_pairs`:
  `fp4.mx_quant_pairs`'s and `mx_dequant_pairs`' bit rules, power-of-two products, nothing to
  contract), so the separate `index_query_` launch leaves the indexer's chain (its w half:
  `ll_bf16_(..., scale=)`) with the same bits. A tile of 64 weight rows is half a head (two MX
  blocks; channels 0..63 pass the rotation unchanged, 64..127 are rotated), of 128 one head.

With the same K split bounds the kernel adds the same FP32 values in the same order as
`low_latency_mm`'s FP8 loop, whatever the config's MMA mode, warpgroups, slot depth, ring and
register cap, so the two give the same bits (tests/ops/test_gluon_mm.py checks it on the GPU);
`GluonMM.reduction_order` names the bounds.

A `GluonMM` plan binds one weight (its TMA descriptor, the split, the workspace and counters)
once; calling it validates and launches. With no config it takes the measured one for its shape
(`default_config`: `_TUNED`, one per weight whatever the rows, else the default rule). `gluon_mm` is the allocating convenience form. The
decode step builds its FP8 linears with it on sm_90 (`decode.attention.fp8_linear_plan`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma, warpgroup_mma_wait

from .checks import (UE8M0_DTYPES, index_query_epilogue_args, mxfp8_linear_args, require_ndim, require_tensor,
                     rope_epilogue_args)
from .common import num_sms, plan_workspace
from .gluon_epilogues import bf16_out
from .gluon_ring import (SHARED_LIMIT, activation_operands, fp8_desc, producer, require_maxnreg, require_sm90_weight,
                         ring, scale_byte, scale_words, slot_words)
from .low_latency_mm import _Operands   # the plan cache's key: same memory, same view

MAX_ROWS = 64
BLOCK_N = 64           # weight rows per program: the wgmma's M, one warpgroup
BLOCK_K = 128          # K per ring slot: four 32-wide scale blocks, one 32-bit scale word per row
ROW_BUCKETS = (8, 16, 32, 64)   # BLOCK_T: the wgmma's N


@gluon.jit
def _producer_persistent(w_desc, x_desc, w_smem, x_smem, ready, empty, N, steps_per_split, n_steps_total,
                         n_split, STAGES: gl.constexpr, RETILED: gl.constexpr):
    """The producer of a persistent program: the steps of its work items (`_item`) one after the
    other through the same ring."""
    BN: gl.constexpr = w_desc.block_type.shape[0]
    c0 = 0
    for item in range(gl.program_id(0), (N + BN - 1) // BN * n_split, gl.num_programs(0)):
        pid_n, step_lo, n_steps = _item(item, n_split, steps_per_split, n_steps_total)
        producer(w_desc, x_desc, w_smem, x_smem, ready, empty, pid_n * BN, 0, 0, step_lo, n_steps, c0,
                 n_steps_total, STAGES, RETILED)
        c0 += n_steps


@gluon.jit
def _item(item, n_split, steps_per_split, n_steps_total):
    """Work item `item` of a persistent grid: (N tile, first K step, K steps); the splits of a tile
    are consecutive items."""
    pid_n = item // n_split
    step_lo = (item % n_split) * steps_per_split
    return pid_n, step_lo, gl.minimum(steps_per_split, n_steps_total - step_lo)


@gluon.jit
def _issue(w_tile, x_tile, zero, j: gl.constexpr):
    """The asynchronous wgmma m{BN} n{BT} k32 of the slot's K block j, from a zero accumulator (the
    block's partial alone)."""
    return warpgroup_mma(w_tile.slice(32 * j, 32, dim=1), x_tile.slice(32 * j, 32, dim=1).permute((1, 0)), zero,
                         use_acc=False, is_async=True)


@gluon.jit
def _promote(acc, part, words, j: gl.constexpr):
    """acc + (part * sx[m, block j]) * sw[n // 32, block j]: the reference's scaling and add of the
    slot's K block j (words: `slot_words`)."""
    sw0, sw1, sx0, sx1 = words
    if j < 4:
        sw = sw0
        sx = sx0
    else:
        sw = sw1
        sx = sx1
    return acc + (part * scale_byte(sx, j % 4)[None, :]) * scale_byte(sw, j % 4)[:, None]


@gluon.jit
def _consumer_pairs(w_smem, x_smem, ready, empty, sw_words, sx_words, step_lo, n_steps, c0,
                    STAGES: gl.constexpr, BN: gl.constexpr, BT: gl.constexpr, SUB: gl.constexpr,
                    mma_layout: gl.constexpr):
    """The consumer warpgroup(s), MMA mode "pairs": per slot, the SUB = BLOCK_K / 32 block wgmmas,
    block j+1's issued before block j's is retired (at most two groups in flight) and the slot
    drained before the next; each block partial scaled by its two scales and added to the FP32
    accumulator in K order (see the module doc). Returns acc."""
    acc = gl.zeros([BN, BT], gl.float32, mma_layout)
    zero = gl.zeros([BN, BT], gl.float32, mma_layout)
    words_next = slot_words(sw_words, sx_words, step_lo, SUB // 4)
    for i in range(n_steps):
        words = words_next
        words_next = slot_words(sw_words, sx_words, step_lo + gl.minimum(i + 1, n_steps - 1), SUB // 4)
        s = (c0 + i) % STAGES
        mbarrier.wait(ready.index(s), ((c0 + i) // STAGES) & 1)
        w_tile = w_smem.index(s)
        x_tile = x_smem.index(s)
        prev = _issue(w_tile, x_tile, zero, 0)
        for j in gl.static_range(1, SUB):
            cur = _issue(w_tile, x_tile, zero, j)
            part = warpgroup_mma_wait(num_outstanding=1, deps=(prev, ))
            acc = _promote(acc, part, words, j - 1)
            prev = cur
        part = warpgroup_mma_wait(num_outstanding=0, deps=(prev, ))
        # Every wgmma reading slot s has retired: hand it back to the producer.
        mbarrier.arrive(empty.index(s), count=1)
        acc = _promote(acc, part, words, SUB - 1)
    return acc


@gluon.jit
def _issue_slot(w_smem, x_smem, ready, s, phase, zero, SUB: gl.constexpr):
    """Wait for slot s's tiles, then issue its SUB block wgmmas: their SUB tokens, in K order."""
    mbarrier.wait(ready.index(s), phase)
    w_tile = w_smem.index(s)
    x_tile = x_smem.index(s)
    toks = (_issue(w_tile, x_tile, zero, 0), )
    for j in gl.static_range(1, SUB):
        toks = toks + (_issue(w_tile, x_tile, zero, j), )
    return toks


@gluon.jit
def _retire_slot(acc, toks, words, empty, s, LATER: gl.constexpr, SUB: gl.constexpr):
    """Retire the slot's SUB block groups in K order, each promoted as soon as it is done, while
    LATER younger groups stay in flight; slot s goes back to the producer once its last MMA has
    retired, before that block's promotion."""
    for j in gl.static_range(SUB):
        part = warpgroup_mma_wait(num_outstanding=SUB - 1 - j + LATER, deps=(toks[j], ))
        if j == SUB - 1:
            mbarrier.arrive(empty.index(s), count=1)
        acc = _promote(acc, part, words, j)
    return acc


@gluon.jit
def _consumer_slot(w_smem, x_smem, ready, empty, sw_words, sx_words, step_lo, n_steps, c0,
                   STAGES: gl.constexpr, BN: gl.constexpr, BT: gl.constexpr, SUB: gl.constexpr,
                   mma_layout: gl.constexpr):
    """MMA mode "slot": all SUB block wgmmas of a slot issued back to back into SUB zero-started
    partials (SUB groups in flight), then retired and promoted in K order. Returns acc."""
    acc = gl.zeros([BN, BT], gl.float32, mma_layout)
    zero = gl.zeros([BN, BT], gl.float32, mma_layout)
    words_next = slot_words(sw_words, sx_words, step_lo, SUB // 4)
    for i in range(n_steps):
        words = words_next
        words_next = slot_words(sw_words, sx_words, step_lo + gl.minimum(i + 1, n_steps - 1), SUB // 4)
        s = (c0 + i) % STAGES
        toks = _issue_slot(w_smem, x_smem, ready, s, ((c0 + i) // STAGES) & 1, zero, SUB)
        acc = _retire_slot(acc, toks, words, empty, s, 0, SUB)
    return acc


@gluon.jit
def _consumer_ahead(w_smem, x_smem, ready, empty, sw_words, sx_words, step_lo, n_steps, c0,
                    STAGES: gl.constexpr, BN: gl.constexpr, BT: gl.constexpr, SUB: gl.constexpr,
                    mma_layout: gl.constexpr):
    """MMA mode "ahead": the slots in pairs, slot i+1's SUB block wgmmas issued right after slot i's
    and before any is retired (2 x SUB groups in flight, 2 x SUB partials live), then both retired
    and promoted in K order, slot i handed back as soon as its last MMA has retired; an odd last
    slot alone. Returns acc.

    The pipeline drains at the end of each pair: wgmma tokens carried in flight across the loop's
    back edge become register copies of in-flight accumulators in the PTX, and ptxas then
    serializes every wgmma of the kernel (its C7514 "wgmma.mma_async instructions are
    serialized")."""
    acc = gl.zeros([BN, BT], gl.float32, mma_layout)
    zero = gl.zeros([BN, BT], gl.float32, mma_layout)
    last = n_steps - 1
    next_a = slot_words(sw_words, sx_words, step_lo, SUB // 4)
    next_b = slot_words(sw_words, sx_words, step_lo + gl.minimum(1, last), SUB // 4)
    for i in range(0, last, 2):
        words_a = next_a
        words_b = next_b
        next_a = slot_words(sw_words, sx_words, step_lo + gl.minimum(i + 2, last), SUB // 4)
        next_b = slot_words(sw_words, sx_words, step_lo + gl.minimum(i + 3, last), SUB // 4)
        ca = c0 + i
        toks_a = _issue_slot(w_smem, x_smem, ready, ca % STAGES, (ca // STAGES) & 1, zero, SUB)
        toks_b = _issue_slot(w_smem, x_smem, ready, (ca + 1) % STAGES, ((ca + 1) // STAGES) & 1, zero, SUB)
        acc = _retire_slot(acc, toks_a, words_a, empty, ca % STAGES, SUB, SUB)
        acc = _retire_slot(acc, toks_b, words_b, empty, (ca + 1) % STAGES, 0, SUB)
    if n_steps % 2 == 1:
        cl = c0 + last
        toks = _issue_slot(w_smem, x_smem, ready, cl % STAGES, (cl // STAGES) & 1, zero, SUB)
        acc = _retire_slot(acc, toks, next_a, empty, cl % STAGES, 0, SUB)
    return acc


@gluon.jit
def _accumulate(w_smem, x_smem, ready, empty, sw_words, sx_words, step_lo, n_steps, c0,
                STAGES: gl.constexpr, BN: gl.constexpr, BT: gl.constexpr, SUB: gl.constexpr, MMA: gl.constexpr,
                mma_layout: gl.constexpr):
    """One work item's K range in MMA mode MMA (`GluonMMConfig.mma`), from ring slot c0 on: [BN, BT]
    FP32, the scaled block partials added in K order."""
    if MMA == "slot":
        acc = _consumer_slot(w_smem, x_smem, ready, empty, sw_words, sx_words, step_lo, n_steps, c0,
                             STAGES, BN, BT, SUB, mma_layout)
    elif MMA == "ahead":
        acc = _consumer_ahead(w_smem, x_smem, ready, empty, sw_words, sx_words, step_lo, n_steps, c0,
                              STAGES, BN, BT, SUB, mma_layout)
    else:
        acc = _consumer_pairs(w_smem, x_smem, ready, empty, sw_words, sx_words, step_lo, n_steps, c0,
                              STAGES, BN, BT, SUB, mma_layout)
    return acc


@gluon.jit
def _consumer(w_smem, x_smem, ready, empty, sw_words, sx_words, step_lo, n_steps,
              STAGES: gl.constexpr, BN: gl.constexpr, BT: gl.constexpr, SUB: gl.constexpr, MMA: gl.constexpr,
              mma_layout: gl.constexpr):
    """The consumer warpgroup(s) of a one-item program. Returns (acc, )."""
    return (_accumulate(w_smem, x_smem, ready, empty, sw_words, sx_words, step_lo, n_steps, 0,
                        STAGES, BN, BT, SUB, MMA, mma_layout), )


@gluon.jit
def _tile_scales(sw_ptr, sx_ptr, off_n, M, N, stride_swn, stride_sxm, BN: gl.constexpr, BT: gl.constexpr,
                 mma_layout: gl.constexpr):
    """Per weight row of the tile at off_n and per activation row, the pointer to its first scale
    word. Rows past N or M read the last valid row's scales and are masked at the store."""
    rn = off_n + gl.arange(0, BN, layout=gl.SliceLayout(1, mma_layout))
    rm = gl.arange(0, BT, layout=gl.SliceLayout(0, mma_layout))
    sw_words = sw_ptr + (gl.minimum(rn, N - 1) // 32) * stride_swn
    sx_words = sx_ptr + gl.minimum(rm, M - 1) * stride_sxm
    return sw_words, sx_words


@gluon.jit
def _epilogue(acc, y_ptr, ws_ptr, cnt_ptr, pid_n, pid_s, M, N, stride_ym, n_split,
              cos_ptr, sin_ptr, stride_cm, stride_sm,
              BN: gl.constexpr, BT: gl.constexpr, SPLIT_K: gl.constexpr, OUT_F32: gl.constexpr,
              ROPE: gl.constexpr, INDEX_Q: gl.constexpr = False):
    """Store the item's [BN, BT] FP32 sums as y rows (BF16, or FP32 when OUT_F32), or, with SPLIT_K,
    as split pid_s's partial, the last split of the tile to arrive adding the partials in split
    order (from zero) and storing y. ROPE / INDEX_Q (BF16 y): the query RoPE / the index query on
    the rounded tile before its store (`bf16_out`), by the program that stores it (with SPLIT_K
    the last arriver)."""
    # The epilogue in a layout where each thread holds 8 consecutive n of one row m (16-byte
    # stores of y and of the workspace, both n-contiguous) instead of the wgmma's scattered pairs.
    out_l: gl.constexpr = gl.BlockedLayout(size_per_thread=[8, 1], threads_per_warp=[8, 4],
                                           warps_per_cta=[BN // 64, 4], order=[0, 1])
    acc = gl.convert_layout(acc, out_l)
    rn = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, out_l))
    rm = gl.arange(0, BT, layout=gl.SliceLayout(0, out_l))
    mask = (rn[:, None] < N) & (rm[None, :] < M)
    y_ptrs = y_ptr + rm[None, :] * stride_ym + rn[:, None]
    if SPLIT_K:
        # Partial s of tile t at ws[(t * n_split + s) * M * BN + m * BN + n]: the M real rows.
        rn_l = gl.arange(0, BN, layout=gl.SliceLayout(1, out_l))
        m_ok = (rm[None, :] < M) & (rn_l[:, None] < BN)
        tile_ws = ws_ptr + pid_n * n_split * M * BN + rm[None, :] * BN + rn_l[:, None]
        gl.store(tile_ws + pid_s * M * BN, acc, mask=m_ok)
        # Every thread's partial is written before one thread's release of the counter.
        gl.thread_barrier()
        arrived = gl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if arrived == n_split - 1:
            gl.thread_barrier()
            total = gl.zeros([BN, BT], gl.float32, out_l)
            for s in range(n_split):
                # .cg: from L2, never from a line this SM's L1 kept from an earlier launch.
                total += gl.load(tile_ws + s * M * BN, mask=m_ok, other=0.0, cache_modifier=".cg")
            if OUT_F32:
                gl.store(y_ptrs, total, mask=mask)
            else:
                gl.store(y_ptrs, bf16_out(total, pid_n * BN, M, cos_ptr, sin_ptr, stride_cm, stride_sm, BN, BT,
                                           ROPE, out_l, INDEX_Q), mask=mask)
            gl.atomic_xchg(cnt_ptr + pid_n, 0, sem="relaxed", scope="gpu")
    else:
        if OUT_F32:
            gl.store(y_ptrs, acc, mask=mask)
        else:
            gl.store(y_ptrs, bf16_out(acc, pid_n * BN, M, cos_ptr, sin_ptr, stride_cm, stride_sm, BN, BT, ROPE,
                                       out_l, INDEX_Q), mask=mask)


@gluon.jit
def _consumer_persistent(w_smem, x_smem, ready, empty, sx_ptr, sw_ptr, y_ptr, ws_ptr, cnt_ptr,
                         M, N, stride_sxm, stride_swn, stride_ym, steps_per_split, n_steps_total, n_split,
                         cos_ptr, sin_ptr, stride_cm, stride_sm,
                         STAGES: gl.constexpr, BN: gl.constexpr, BT: gl.constexpr, SUB: gl.constexpr,
                         MMA: gl.constexpr, SPLIT_K: gl.constexpr, OUT_F32: gl.constexpr, ROPE: gl.constexpr,
                         mma_layout: gl.constexpr, INDEX_Q: gl.constexpr = False):
    """The consumer warpgroup(s) of a persistent program: its work items (`_item`) one after the
    other, each accumulated and stored (`_epilogue`) while the producer already streams the next
    item's tiles. Returns ()."""
    c0 = 0
    for item in range(gl.program_id(0), (N + BN - 1) // BN * n_split, gl.num_programs(0)):
        pid_n, step_lo, n_steps = _item(item, n_split, steps_per_split, n_steps_total)
        sw_words, sx_words = _tile_scales(sw_ptr, sx_ptr, pid_n * BN, M, N, stride_swn, stride_sxm, BN, BT,
                                          mma_layout)
        acc = _accumulate(w_smem, x_smem, ready, empty, sw_words, sx_words, step_lo, n_steps, c0,
                          STAGES, BN, BT, SUB, MMA, mma_layout)
        _epilogue(acc, y_ptr, ws_ptr, cnt_ptr, pid_n, item % n_split, M, N, stride_ym, n_split,
                  cos_ptr, sin_ptr, stride_cm, stride_sm, BN, BT, SPLIT_K, OUT_F32, ROPE, INDEX_Q)
        c0 += n_steps
    return ()


@gluon.jit(do_not_specialize=["M", "stride_sxm", "stride_swn", "steps_per_split", "n_steps_total", "n_split",
                             "stride_cm", "stride_sm"])
def _gluon_mxfp8_mm_kernel(
    w_desc, x_desc, sx_ptr, sw_ptr, y_ptr, ws_ptr, cnt_ptr,
    M, N, stride_sxm, stride_swn, stride_ym, steps_per_split, n_steps_total, n_split,
    cos_ptr, sin_ptr, stride_cm, stride_sm,
    SPLIT_K: gl.constexpr, BT: gl.constexpr, STAGES: gl.constexpr, MMA: gl.constexpr, OUT_F32: gl.constexpr,
    PERSISTENT: gl.constexpr = False, RETILED: gl.constexpr = False, ROPE: gl.constexpr = False,
    INDEX_Q: gl.constexpr = False,
):
    # Grid (N tiles, n_split K splits): program (t, s) covers weight rows [t*BN, +BN) and K steps
    # [s*steps_per_split, +steps_per_split) of BLOCK_K (the descriptor's box: BN = 64 per consumer
    # warpgroup, BLOCK_K = 128 or 256); sx_ptr and sw_ptr point at the scales as int32 words (four
    # UE8M0 bytes, 128 of K), strides in words. SPLIT_K: n_split > 1. PERSISTENT: grid (programs, )
    # instead, each program taking the work items (tile, split) p, p + programs, ... in turn
    # through one ring. ROPE: the query RoPE epilogue (`gluon_epilogues.rope_tile`) with cos/sin
    # [M, 32] FP32 at cos_ptr/sin_ptr (row strides stride_cm/stride_sm); unused without. INDEX_Q:
    # the index query epilogue (`gluon_epilogues.index_query_tile`) with the same cos/sin arguments.
    BN: gl.constexpr = w_desc.block_type.shape[0]
    SUB: gl.constexpr = w_desc.block_type.shape[1] // 32
    # One m64 wgmma per consumer warpgroup (warps [4 * WG, 1]: warpgroup g takes rows [64g, +64)).
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4 * (BN // 64), 1],
                                                         instr_shape=[16, BT, 32])

    w_smem, x_smem, ready, empty = ring(w_desc, x_desc, STAGES)

    if PERSISTENT:
        gl.warp_specialize([
            (_consumer_persistent, (w_smem, x_smem, ready, empty, sx_ptr, sw_ptr, y_ptr, ws_ptr, cnt_ptr,
                                    M, N, stride_sxm, stride_swn, stride_ym, steps_per_split, n_steps_total,
                                    n_split, cos_ptr, sin_ptr, stride_cm, stride_sm, STAGES, BN, BT, SUB, MMA,
                                    SPLIT_K, OUT_F32, ROPE, mma_layout, INDEX_Q)),
            (_producer_persistent, (w_desc, x_desc, w_smem, x_smem, ready, empty, N, steps_per_split,
                                    n_steps_total, n_split, STAGES, RETILED)),
        ], [1], [24])
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(ready.index(i))
            mbarrier.invalidate(empty.index(i))
    else:
        pid_n = gl.program_id(0)
        pid_s = gl.program_id(1)
        step_lo = pid_s * steps_per_split
        n_steps = gl.minimum(steps_per_split, n_steps_total - step_lo)
        sw_words, sx_words = _tile_scales(sw_ptr, sx_ptr, pid_n * BN, M, N, stride_swn, stride_sxm, BN, BT,
                                          mma_layout)
        acc, = gl.warp_specialize([
            (_consumer, (w_smem, x_smem, ready, empty, sw_words, sx_words, step_lo, n_steps,
                         STAGES, BN, BT, SUB, MMA, mma_layout)),
            (producer, (w_desc, x_desc, w_smem, x_smem, ready, empty, pid_n * BN, 0, 0, step_lo, n_steps, 0,
                         n_steps_total, STAGES, RETILED)),
        ], [1], [24])
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(ready.index(i))
            mbarrier.invalidate(empty.index(i))
        _epilogue(acc, y_ptr, ws_ptr, cnt_ptr, pid_n, pid_s, M, N, stride_ym, n_split, cos_ptr, sin_ptr,
                  stride_cm, stride_sm, BN, BT, SPLIT_K, OUT_F32, ROPE, INDEX_Q)


MMA_MODES = ("pairs", "slot", "ahead")


@dataclass(frozen=True)
class GluonMMConfig:
    """How a plan runs (the bits depend on the split bounds alone: `GluonMM.reduction_order`).

    split: K splits requested (the plan may use fewer so that none is empty); None = the default
        rule (`_default_split`).
    stages: ring slots, 3..8.
    mma: how many block wgmmas the consumer keeps in flight. "pairs": block j+1's issued before
        block j's retires, each slot drained before the next (two groups); "slot": a slot's
        block_k / 32 wgmmas issued back to back into separate zero-started partials, then retired
        and promoted in K order; "ahead": as "slot", and the next slot's issued before this slot's
        are promoted (twice as many groups and live partials).
    warpgroups: consumer warpgroups per program, 1 or 2 (64 or 128 weight rows per program and
        per TMA box, one producer warp feeding them).
    block_k: K depth of a ring slot, 128 or 256 (the weight box [64 x warpgroups, block_k]).
    maxnreg: the launch's register cap per thread (raised where even "pairs" would spill; 64 keeps
        4 CTAs of one warpgroup per SM); None = the table of `launch_mode`.
    persistent: one program per CTA the SMs hold at once (`resident_ctas`), each taking the work
        items (N tile, K split) in turn through one ring, so the producer streams the next item's
        tiles while the consumer finishes and stores the last (no wave tail, one ramp per program).
    retile: the plan keeps a copy of the weight laid out tile by tile ([N tiles, K steps, block_n,
        block_k], each ring slot's box one contiguous 8-16 KB run instead of block_n rows K bytes
        apart) and streams that; N x K more bytes of device memory per plan.
    programs_per_sm: with `persistent`, launch this many programs per SM (at most what one SM
        holds) instead of all it holds, so that the items divide evenly among the programs (e.g.
        wo_b's 1280 four-step items at 16 splits: 4.8 per program at 2 per SM, 3.2 at 3).
    """

    split: int | None = None
    stages: int = 4
    mma: str = "pairs"
    warpgroups: int = 1
    block_k: int = 128
    maxnreg: int | None = None
    persistent: bool = False
    retile: bool = False
    programs_per_sm: int | None = None

    def __post_init__(self):
        def is_int(v):
            return isinstance(v, int) and not isinstance(v, bool)
        if self.split is not None and (not is_int(self.split) or self.split < 1):
            raise ValueError(f"GluonMMConfig.split must be None or a positive int, got {self.split!r}")
        if not is_int(self.stages) or not 3 <= self.stages <= 8:
            raise ValueError(f"GluonMMConfig.stages must be an int in [3, 8], got {self.stages!r}")
        if self.mma not in MMA_MODES:
            raise ValueError(f"GluonMMConfig.mma must be one of {MMA_MODES}, got {self.mma!r}")
        if self.warpgroups not in (1, 2) or not is_int(self.warpgroups):
            raise ValueError(f"GluonMMConfig.warpgroups must be 1 or 2, got {self.warpgroups!r}")
        if self.block_k not in (128, 256) or not is_int(self.block_k):
            raise ValueError(f"GluonMMConfig.block_k must be 128 or 256, got {self.block_k!r}")
        if self.mma == "ahead" and self.block_k != 128:
            raise ValueError(f"GluonMMConfig.mma='ahead' needs block_k=128 (16 partials in flight do not fit "
                             f"the registers), got block_k={self.block_k}")
        if self.programs_per_sm is not None and (not is_int(self.programs_per_sm) or self.programs_per_sm < 1
                                                 or not self.persistent):
            raise ValueError(f"GluonMMConfig.programs_per_sm must be None or a positive int with persistent=True, "
                             f"got {self.programs_per_sm!r} (persistent={self.persistent!r})")
        for name in ("persistent", "retile"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"GluonMMConfig.{name} must be a bool, got {getattr(self, name)!r}")
        require_maxnreg(self)

    @property
    def block_n(self) -> int:
        """Weight rows per program: 64 per consumer warpgroup."""
        return BLOCK_N * self.warpgroups


# The register cap per thread of a launch, per (warpgroups, block_k) and row bucket (8, 16, 32, 64):
# the smallest at which "pairs" compiles for sm_90 without spills, raised to what keeps the same
# residency. A CTA holds (4 x warpgroups + 4) warps x the cap: with one warpgroup, 80 keeps 3 CTAs
# per SM resident, 128 two, more one; with two (12 warps), 80 keeps 2, more one.
_CAP = {(1, 128): (80, 80, 80, 128), (1, 256): (80, 80, 80, 128),
        (2, 128): (80, 80, 80, 168), (2, 256): (80, 80, 128, 168)}
# The smallest cap (multiples of 8; tried from 64, the 4-CTA cap of one warpgroup, for one
# warpgroup's 128-deep slots, else from 80) at which each MMA mode compiles without spills, per
# bucket; None: none does (the mode's live partials, [BN, BT] FP32 each, BT / 2 registers per
# thread, exceed what a thread can hold). tests/ops/test_gluon_mm.py compiles the variants at their
# tightest buckets.
_MIN_CAP = {
    (1, 128): {"pairs": (64, 64, 64, 128), "slot": (64, 64, 80, 168), "ahead": (64, 72, 128, None)},
    (1, 256): {"pairs": (80, 80, 80, 128), "slot": (80, 80, 128, None)},
    (2, 128): {"pairs": (64, 64, 80, 168), "slot": (64, 64, 128, 168), "ahead": (64, 128, 168, None)},
    (2, 256): {"pairs": (64, 64, 128, 168), "slot": (64, 128, 168, None)},
}


# Where the persistent loop (item pointers and counters live across the MMA loop) needs more than
# `_MIN_CAP`: (warpgroups, block_k, mode, row bucket) -> the smallest cap without spills.
_PERSISTENT_MIN_CAP = {(1, 128, "pairs", 32): 72, (1, 128, "slot", 32): 88, (1, 128, "ahead", 16): 80,
                       (2, 128, "pairs", 32): 88, (2, 128, "slot", 64): 200}


def launch_mode(config: GluonMMConfig, block_t: int) -> tuple[str, int]:
    """(MMA mode run, register cap per thread) for `config` at row bucket `block_t`: the cap is
    `config.maxnreg`, else the table's, raised where "pairs" needs more; the mode is the requested
    one where it compiles without spills under that cap, else the next shallower that does ("pairs"
    at worst). So a deeper mode never costs residency unless the cap is forced, nothing spills, and
    the bits do not depend on the mode."""
    key, b = (config.warpgroups, config.block_k), ROW_BUCKETS.index(block_t)

    def need(mode):
        if config.persistent and (*key, mode, block_t) in _PERSISTENT_MIN_CAP:
            return _PERSISTENT_MIN_CAP[(*key, mode, block_t)]
        return _MIN_CAP[key][mode][b]
    cap = max(config.maxnreg or _CAP[key][b], need("pairs"))
    for mode in MMA_MODES[MMA_MODES.index(config.mma)::-1]:     # requested, then shallower
        if mode == "pairs" or (need(mode) is not None and need(mode) <= cap):
            return mode, cap
    raise AssertionError("unreachable: pairs always runs")


def maxnreg(block_t: int, config: GluonMMConfig = GluonMMConfig()) -> int:
    """The launch's register cap per thread for row bucket `block_t` under `config`. With the
    default config: the kernel runs 8 warps (the consumer warpgroup and the producer's, padded to a
    warpgroup), and a CTA holds 256 x this many registers however `setmaxnreg` moves them between
    the two (the producer drops to 24, the consumer rises to 2 x cap - 24): 80 keeps 3 CTAs per SM
    resident (128 would keep 2, and Triton's default of 256 one), and the 64-row bucket, whose FP32
    tiles need more, spills below 128 (sm_90 compile: 200 bytes of stack at 80). Other configs:
    `launch_mode`."""
    return launch_mode(config, block_t)[1]


def launch_options(config: GluonMMConfig, block_t: int, split: int) -> dict:
    """The kernel's constexpr arguments and launch options for `config` at row bucket `block_t` and
    `split` K splits (the plan's launch and the sm_90 compile test share them)."""
    mode, cap = launch_mode(config, block_t)
    # enable_reflect_ftz=False: libdevice's mul_rn / add_rn / sub_rn (the epilogues' rotation) keep
    # FP32 subnormals, as index_query_ and query_rope_ do (Triton's default flushes them to zero)
    return {"SPLIT_K": split > 1, "BT": block_t, "STAGES": config.stages, "MMA": mode,
            "PERSISTENT": config.persistent, "RETILED": config.retile, "num_warps": 4 * config.warpgroups,
            "maxnreg": cap, "enable_reflect_ftz": False}


def resident_ctas(config: GluonMMConfig, block_t: int) -> int:
    """CTAs of a launch of `config` at row bucket `block_t` that one SM holds at once: 64K registers
    over (4 x warpgroups + 4) warps x the cap, 228 KB of shared memory over `shared_bytes` (each
    CTA also reserves 1 KB)."""
    regs = 65536 // (32 * (4 * config.warpgroups + 4) * launch_mode(config, block_t)[1])
    return max(1, min(regs, (228 * 1024) // (shared_bytes(config, block_t) + 1024)))


# Measured configurations per weight shape (N, K) on an H200 (`scripts/probe_gluon_mm.py`, the best
# geometric mean over rows 1, 4, 8, 16, 32, 64; docs/notes-gluon-mm.md): one per weight, whatever
# the rows (the split fixes the bits: batch invariance). Other shapes (the TP shards but wq_b's
# TP8, which is the indexer's shape): the default config with `_default_split`.
_TUNED: dict[tuple[int, int], GluonMMConfig] = {
    # wq_b: 256 programs of 128 rows fit the SMs in one wave (512 of 64 took 1.3); 13.5 vs 16.1 us
    (32768, 1280): GluonMMConfig(split=1, stages=4, mma="pairs", warpgroups=2, persistent=True),
    # wo_b: the default's split (same bits), 256-deep slots; 14.3 vs 14.6 us
    (5120, 8192): GluonMMConfig(split=3, stages=3, mma="pairs", block_k=256),
    # the indexer's wq_b (and wq_b's TP8 shard): 2 splits instead of 4; 5.95 vs 6.05 us, 9.1 vs 11.3 at 64 rows
    (4096, 1280): GluonMMConfig(split=2, stages=4, mma="slot"),
    # fused wq_a|wkv: 4 splits of 1280 instead of 8 of 640, 256-deep slots; 6.84 vs 7.06 us, 12.4 vs 15.1 at 64
    (1792, 5120): GluonMMConfig(split=4, stages=3, mma="slot", block_k=256),
}


def default_config(n: int, k: int) -> GluonMMConfig:
    """The config a plan for an [n, k] weight uses when given none: the measured one, else
    `GluonMMConfig()` (the default split rule)."""
    return _TUNED.get((n, k), GluonMMConfig())


def _default_split(n: int, k: int, sms: int, block_n: int = BLOCK_N, block_k: int = BLOCK_K) -> int:
    """About two programs per SM (all resident in one wave), as `low_latency_mm`'s default rule."""
    tiles = -(-n // block_n)
    return max(1, min(k // block_k, round(2 * sms / tiles)))


def split_bounds(split: int, k: int, block_k: int = BLOCK_K) -> tuple[int, int]:
    """(k_per_split, splits actually used) for `split` requested K splits of block_k-deep steps: the
    same rule as `low_latency_mm.reduction_order` with that block_k, so equal bounds give equal
    bits."""
    steps = k // block_k
    per = -(-steps // min(split, steps))
    return per * block_k, -(-steps // per)


def shared_bytes(config: GluonMMConfig, block_t: int) -> int:
    """The shared memory of a launch of `config` at row bucket `block_t`: the ring's weight and
    activation tiles, 1 KB for the mbarriers and what the compiler adds (sm_90 compiles: 116-180
    bytes), and, persistent, the epilogue's layout conversion of the FP32 tile (the ring is live
    then)."""
    scratch = config.block_n * block_t * 4 if config.persistent else 0
    return config.stages * (config.block_n + block_t) * config.block_k + 1024 + scratch


def _retiled(weight: torch.Tensor, block_n: int, block_k: int) -> torch.Tensor:
    """The weight [N, K] laid out tile by tile for `GluonMMConfig.retile`: [N tiles x K steps x
    block_n, block_k], tile t's K step s at rows (t x K steps + s) x block_n (rows past N zero)."""
    n, k = weight.shape
    tiles, steps = -(-n // block_n), k // block_k
    padded = weight.new_zeros(tiles * block_n, k)
    padded[:n] = weight
    return padded.view(tiles, block_n, steps, block_k).permute(0, 2, 1, 3).contiguous().view(-1, block_k)


class GluonMM:
    """y[M, N] = bf16(sum over 32-wide K blocks kb of (codes[:, kb] . weight[:, kb]) * sx * sw) for
    1 <= M <= max_rows <= 64, with the weight bound once; sm_90 only.

    weight: [N, K] float8_e4m3fn, unit stride along K, 16-byte aligned rows (TMA); K a multiple of
        128 (of the config's block_k).
    w_scale: [ceil(N/32), K/32] UE8M0 (float8_e8m0fnu or uint8), unit stride along K, rows on
        4-byte boundaries.
    max_rows: the most rows a call may bring (1..64).
    config: a GluonMMConfig (the K split, the ring, the MMA pipeline, the program's shape), else
        `default_config(N, K)`.
    workspace: None (the plan allocates its split-K workspace and counters) or a shared pool, as
        `ops.common.plan_workspace` says (FP32 slot 0, int32 slot 0).

    The plan owns (or takes) an FP32 workspace and one int32 counter per N tile (zero between
    calls). Calls must not overlap in time (one stream, or ordered streams).
    """

    def __init__(self, weight: torch.Tensor, w_scale: torch.Tensor, max_rows: int = MAX_ROWS,
                 config: GluonMMConfig | None = None, workspace=None):
        n, k = require_ndim(weight, "weight", "[N, K]")
        if k % BLOCK_K or k == 0 or n == 0:
            raise ValueError(f"weight must be [N, K] with N >= 1 and K a positive multiple of {BLOCK_K}, "
                             f"got {(n, k)} (use ops.low_latency_mm)")
        require_tensor(weight, "weight", (torch.float8_e4m3fn,), (n, k))
        require_tensor(w_scale, "w_scale", UE8M0_DTYPES, (-(-n // 32), k // 32))
        if w_scale.device != weight.device:
            raise ValueError(f"w_scale is on {w_scale.device} but weight is on {weight.device}")
        if config is not None and not isinstance(config, GluonMMConfig):
            raise TypeError(f"config must be a GluonMMConfig, got {type(config).__name__}")
        config = config or default_config(n, k)
        if k % config.block_k:
            raise ValueError(f"weight's K = {k} is not a multiple of config.block_k = {config.block_k}")
        require_sm90_weight(weight, "TMA, wgmma")
        if isinstance(max_rows, bool) or not isinstance(max_rows, int) or not 1 <= max_rows <= MAX_ROWS:
            raise ValueError(f"max_rows must be an int in [1, {MAX_ROWS}], got {max_rows!r}")
        need = shared_bytes(config, self.block_t(max_rows))
        if need > SHARED_LIMIT:
            raise ValueError(f"config.stages = {config.stages} needs {need} bytes of shared memory at "
                             f"max_rows = {max_rows} (block_n {config.block_n}, block_k {config.block_k}); "
                             f"sm_90 has {SHARED_LIMIT}")
        self.config = config
        self.weight, self.w_scale = weight, w_scale.view(torch.uint8)
        self._sw_words = scale_words(self.w_scale, "w_scale")
        self.n, self.k, self.max_rows, self.device = n, k, max_rows, weight.device
        bn, bk = config.block_n, config.block_k
        self._sms = num_sms(self.device)
        want = config.split or _default_split(n, k, self._sms, bn, bk)
        self.k_per_split, self.split = split_bounds(want, k, bk)
        self.grid = (-(-n // bn), self.split)
        self._w_tiles = _retiled(weight, bn, bk) if config.retile else None
        self._w_desc = fp8_desc(weight if self._w_tiles is None else self._w_tiles, [bn, bk])
        ws_elems = self.grid[0] * self.split * max_rows * bn if self.split > 1 else 1
        self._workspace = plan_workspace(workspace, 0, ws_elems, torch.float32, self.device)
        self._counters = plan_workspace(workspace, 0, self.grid[0], torch.int32, self.device)

    def block_t(self, rows: int) -> int:
        """The row bucket (the wgmma's N) used for `rows` rows."""
        return next(b for b in ROW_BUCKETS if b >= rows)

    def launch_grid(self, block_t: int) -> tuple[int, int]:
        """The launch's grid at row bucket `block_t`: (N tiles, K splits), or, persistent, (as many
        programs as the SMs hold at once or `programs_per_sm` per SM, up to the work items, 1)."""
        if not self.config.persistent:
            return self.grid
        items = self.grid[0] * self.grid[1]
        per_sm = min(self.config.programs_per_sm or 64, resident_ctas(self.config, block_t))
        return (min(items, self._sms * per_sm), 1)

    def reduction_order(self) -> tuple[bool, int, int]:
        """As `low_latency_mm.LowLatencyMM.reduction_order`: (dequantize loop, K per split, K per
        dot). Equal tuples mean equal bits."""
        return (False, self.k_per_split, 32)

    def __call__(self, codes: torch.Tensor, x_scale: torch.Tensor, out: torch.Tensor | None = None,
                 rope: tuple[torch.Tensor, torch.Tensor] | None = None,
                 index_query: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """y = codes x weight^T with both block scales, into out.

        codes: [M, K] float8_e4m3fn, unit stride along K, 16-byte aligned rows; 1 <= M <= max_rows.
        x_scale: [M, K/32] UE8M0 (uint8 or float8_e8m0fnu), unit stride along K, rows on 4-byte
            boundaries.
        out: [M, N] BF16, unit stride along N; allocated when None. A float32 out receives the
            unrounded FP32 sums (a tensor-parallel partial).
        rope: None, or (cos, sin) [M, 32] float32 of each row's position: y read as [M, N / 512,
            512] queries (N a multiple of 512, BF16 out) gets the query RoPE of
            `kv_write.query_rope_` (dims 448..511 of every head) in the epilogue, the same bits as
            the GEMM followed by that op.
        index_query: None, or (cos, sin) [M, 32] float32 of each row's position (the indexer's wq_b,
            not with rope): y read as [M, N / 128, 128] index queries (N a multiple of 128, BF16
            out) gets `index_query.index_query_`'s iq in the epilogue (RoPE on each head's channels
            64..127, then MXFP4 quantize-dequantize per 32-channel block), the same bits as the GEMM
            followed by that op.
        Returns out.
        """
        out = mxfp8_linear_args(codes, x_scale, out, self.n, self.k, self.max_rows, self.device)
        m = codes.shape[0]
        if index_query is not None:
            cos, sin = index_query_epilogue_args(index_query, rope, out, self.n, m, self.device,
                                                 self.config.block_n)
            stride_c, stride_s = cos.stride(0), sin.stride(0)
        elif rope is None:
            cos = sin = self._workspace
            stride_c = stride_s = 0
        else:
            cos, sin = rope_epilogue_args(rope, out, self.n, m, self.device)
            stride_c, stride_s = cos.stride(0), sin.stride(0)
        bt = self.block_t(m)
        bk = self.config.block_k
        x_desc, sx_words = activation_operands(codes, x_scale, bt, bk)
        _gluon_mxfp8_mm_kernel[self.launch_grid(bt)](
            self._w_desc, x_desc, sx_words, self._sw_words, out, self._workspace, self._counters,
            m, self.n, sx_words.stride(0), self._sw_words.stride(0), out.stride(0),
            self.k_per_split // bk, self.k // bk, self.split, cos, sin, stride_c, stride_s,
            OUT_F32=out.dtype == torch.float32, ROPE=rope is not None, INDEX_Q=index_query is not None,
            **launch_options(self.config, bt, self.split),
        )
        return out


@functools.lru_cache(maxsize=64)
def _plan_for(operands: _Operands) -> GluonMM:
    return GluonMM(operands.weight, operands.w_scale)


def gluon_mm(codes: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, w_scale: torch.Tensor,
             out: torch.Tensor | None = None) -> torch.Tensor:
    """y[M, N] BF16 = MXFP8 codes [M, K] (+ x_scale [M, K/32]) x FP8 weight [N, K] (+ w_scale
    [ceil(N/32), K/32]); see `GluonMM`. Builds a plan on first use for these weight tensors and
    keeps it (up to 64 weights); code that captures CUDA graphs should build its plans itself."""
    for name, t in (("weight", weight), ("w_scale", w_scale)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    return _plan_for(_Operands(weight, w_scale))(codes, x_scale, out)
