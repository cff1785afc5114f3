"""The first launch of the sparse MLA's combination "pv" with one program per row
(`GluonSparseMlaConfig(combine="pv", scores="rows")`), in Gluon for Hopper (sm_90): each program
walks its row's 64-key blocks in order and stores, per block, what a block program of
`ops.gluon_sparse_mla`'s first launch stores (its P, BF16 [heads, 64], and its (max, sum, valid-key
count)), for the same second launch (`ops.gluon_sparse_mla_pv`).

A block program learns the running max of the sequential loop at its block from the maxima the
earlier blocks' programs publish (the look-back); a row program has it in registers: the max of
-1e30 and the blocks' maxima so far, the same value in any order (max is exact). Everything else is
the block program's, operand for operand: q [64, 512] (heads past H zeros) in shared memory as four
[64, 128] chunks, loaded once per row instead of once per block; the block's 64 records gathered and
decoded exactly to BF16 into four [64, 128] chunks (`gluon_mla_records`: the same bytes, the same
values); S as the same four chained `warpgroup_mma` (the two warpgroups 32 keys each) in the same
accumulator layout, scaled, -inf where a key is invalid; P = bf16(exp(s - max)) with the CUDA math
library's expf and the block's sum of the unrounded exp by the same reduction in the same layout.
So P and the statistics are bitwise the block programs', and the second launch's output too.

A block's codes (all 512 dims of the pools it holds keys of) are copied asynchronously (cp.async,
`gluon_sparse_mla_pv._ring_codes`) into one shared-memory slot as soon as the block before it is
decoded, and its scales loaded into registers, so they are in flight during that block's MMAs, exp
and stores (the decode from the slot is the second launch's ring's, `_ring_decode`). The program
needs no ticket and no look-back words and holds 181 KB of shared memory (q, the decoded keys, the
slot: one program an SM): rows programs in all, each a row's blocks in series, against rows x
blocks block programs that wait on each other's maxima and each load q.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.extra import libdevice
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma

from .gluon_mla_records import _DC, _KEYS, _M, _WARPS, NUM_WARPS, _add, _block_slots, _max
from .gluon_sparse_mla_pv import _ring_codes, _ring_decode, _ring_scales


@gluon.jit
def _block_issue(wcode_r, ccode_r, b, nw, w_slots, c_slots, wpool_ptr, cpool_ptr, l3w: gl.constexpr,
                 l3c: gl.constexpr):
    """Block b's codes, all four 128-dim chunks, copied asynchronously into the ring slot (one
    cp.async group), and its scales loaded into registers (`gluon_sparse_mla_pv._ring_codes` /
    `_ring_scales`: the bytes the second launch's ring copies)."""
    for c in gl.static_range(4):
        _ring_codes(wcode_r.index(c), ccode_r.index(c), b, c, nw, w_slots, c_slots, wpool_ptr, cpool_ptr, _DC,
                    l3w, l3c)
    async_copy.commit_group()


@gluon.jit
def _block_scales(b, w_slots, c_slots, wpool_ptr, cpool_ptr, l3w: gl.constexpr, l3c: gl.constexpr):
    """Block b's scale bytes of the four chunks (`_ring_scales`), into registers."""
    w0, c0 = _ring_scales(b, 0, w_slots, c_slots, wpool_ptr, cpool_ptr, _DC, l3w, l3c)
    w1, c1 = _ring_scales(b, 1, w_slots, c_slots, wpool_ptr, cpool_ptr, _DC, l3w, l3c)
    w2, c2 = _ring_scales(b, 2, w_slots, c_slots, wpool_ptr, cpool_ptr, _DC, l3w, l3c)
    w3, c3 = _ring_scales(b, 3, w_slots, c_slots, wpool_ptr, cpool_ptr, _DC, l3w, l3c)
    return w0, c0, w1, c1, w2, c2, w3, c3


@gluon.jit
def _gluon_mla_row_scores_kernel(
    q_ptr, wpool_ptr, cpool_ptr, wtab_ptr, ctab_ptr, p_ptr, part_ml_ptr,
    H, scale, stride_qn, stride_qh, stride_wt, stride_ct,
    W: gl.constexpr, W_P2: gl.constexpr, KC: gl.constexpr, NB: gl.constexpr, PH: gl.constexpr,
):
    # Grid: one program per row. p_ptr: BF16 [N, NB, PH, 64], the blocks' P; part_ml_ptr: FP32
    # [N, NB, 3, PH] (max, sum, valid-key count): the block programs' P_OUT stores.
    NC: gl.constexpr = 512 // _DC
    r = gl.program_id(0)
    ld: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [_WARPS, 1], [1, 0])
    s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, 32, 16])
    chunk_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([_M, _DC], gl.bfloat16)
    q_smem = gl.allocate_shared_memory(gl.bfloat16, [NC, _M, _DC], chunk_sl)
    k_smem = gl.allocate_shared_memory(gl.bfloat16, [NC, _KEYS, _DC], chunk_sl)
    w_slots = gl.allocate_shared_memory(gl.int32, [NB, _KEYS], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
    c_slots = gl.allocate_shared_memory(gl.int32, [NB, _KEYS], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
    # the ring slot of a block's codes: window [64, 4, 32] and compressed [64, 8, 8] bytes a chunk
    # (`gluon_sparse_mla_pv._ring_slice`'s layouts at 128 dims)
    l3w: gl.constexpr = gl.BlockedLayout([1, 1, 16], [4, 4, 2], [_WARPS, 1, 1], [2, 1, 0])
    l3c: gl.constexpr = gl.BlockedLayout([1, 1, 8], [4, 8, 1], [_WARPS, 1, 1], [2, 1, 0])
    plain: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[2, 1, 0])
    wcode_r = gl.allocate_shared_memory(gl.uint8, [NC, _KEYS, _DC // 32, 32], plain)
    ccode_r = gl.allocate_shared_memory(gl.uint8, [NC, _KEYS, _DC // 16, 8], plain)

    # The row's window key count (the valid suffix of its window table) and every block's slots.
    wtab_row = wtab_ptr + r * stride_wt
    ctab_row = ctab_ptr + r * stride_ct
    rw = gl.arange(0, W_P2, layout=gl.SliceLayout(0, ld))
    nw = gl.reduce((gl.load(wtab_row + rw, mask=rw < W, other=-1) >= 0).to(gl.int32), 0, _add)
    for b in gl.static_range(NB):
        ws, cs = _block_slots(wtab_row, ctab_row, b, nw, W, KC, gl.SliceLayout(1, ld))
        w_slots.index(b).store(ws)
        c_slots.index(b).store(cs)
    gl.thread_barrier()
    _block_issue(wcode_r, ccode_r, 0, nw, w_slots, c_slots, wpool_ptr, cpool_ptr, l3w, l3c)
    w0, c0, w1, c1, w2, c2, w3, c3 = _block_scales(0, w_slots, c_slots, wpool_ptr, cpool_ptr, l3w, l3c)

    # q [64, 512] of the row (heads past H: zeros), once
    rh = gl.arange(0, _M, layout=gl.SliceLayout(1, ld))
    rd = gl.arange(0, _DC, layout=gl.SliceLayout(0, ld))
    q_rows = q_ptr + r * stride_qn + rh[:, None] * stride_qh + rd[None, :]
    h_in = (rh < H)[:, None]
    for c in gl.static_range(NC):
        q_smem.index(c).store(gl.load(q_rows + c * _DC, mask=h_in, other=0.0))

    hs = gl.arange(0, _M, layout=gl.SliceLayout(1, s_l))
    h_st = hs < PH
    ks = gl.arange(0, _KEYS, layout=gl.SliceLayout(0, s_l))
    tile = r.to(gl.int64) * NB
    run_max = gl.full([_M], -1e30, gl.float32, gl.SliceLayout(1, s_l))
    for b in range(NB):
        # block b's copies have landed (this thread's; after the barrier every thread's), and every
        # warp's MMAs of the block before have read k_smem
        async_copy.wait_group(0)
        gl.thread_barrier()
        k_smem.index(0).store(_ring_decode(wcode_r.index(0), ccode_r.index(0), w0, c0, b, nw, _DC, ld, l3w, l3c))
        k_smem.index(1).store(_ring_decode(wcode_r.index(1), ccode_r.index(1), w1, c1, b, nw, _DC, ld, l3w, l3c))
        k_smem.index(2).store(_ring_decode(wcode_r.index(2), ccode_r.index(2), w2, c2, b, nw, _DC, ld, l3w, l3c))
        k_smem.index(3).store(_ring_decode(wcode_r.index(3), ccode_r.index(3), w3, c3, b, nw, _DC, ld, l3w, l3c))
        fence_async_shared()
        gl.thread_barrier()
        # the next block's codes into the ring (every thread has read it: the barrier above) and its
        # scales, in flight during this block's MMAs (no copy where the row has one block: sm_90's
        # LLVM lowering fails on the dead branch's slot-table read there)
        if (NB > 1) and (b + 1 < NB):
            _block_issue(wcode_r, ccode_r, b + 1, nw, w_slots, c_slots, wpool_ptr, cpool_ptr, l3w, l3c)
        w0, c0, w1, c1, w2, c2, w3, c3 = _block_scales(gl.minimum(b + 1, NB - 1), w_slots, c_slots, wpool_ptr,
                                                       cpool_ptr, l3w, l3c)
        s = gl.zeros([_M, _KEYS], gl.float32, s_l)
        for c in gl.static_range(NC):
            s = warpgroup_mma(q_smem.index(c), k_smem.index(c).permute((1, 0)), s)
        ok = (w_slots.index(b).load(gl.SliceLayout(0, s_l)) >= 0) | (c_slots.index(b).load(gl.SliceLayout(0, s_l)) >= 0)
        s = gl.where(ok[None, :], s * scale, float("-inf"))
        new_max = gl.maximum(run_max, gl.reduce(s, 1, _max))
        p = libdevice.exp(s - new_max[:, None])
        l_i = gl.reduce(p, 1, _add)
        nv = gl.reduce(ok.to(gl.int32), 0, _add)
        gl.store(p_ptr + ((tile + b) * PH + hs[:, None]) * _KEYS + ks[None, :], p.to(gl.bfloat16),
                 mask=h_st[:, None])
        ml = part_ml_ptr + (tile + b) * (3 * PH) + hs
        gl.store(ml, new_max, mask=h_st)
        gl.store(ml + PH, l_i, mask=h_st)
        gl.store(ml + 2 * PH, gl.zeros([_M], gl.float32, gl.SliceLayout(1, s_l)) + nv.to(gl.float32), mask=h_st)
        run_max = new_max
    async_copy.wait_group(0)


def mla_row_scores_(base, q: torch.Tensor, window_pool: torch.Tensor, comp_pool: torch.Tensor,
                    window_table: torch.Tensor, comp_table: torch.Tensor, p: torch.Tensor, scale: float,
                    rows: int) -> None:
    """`_gluon_mla_row_scores_kernel` over `rows` rows (arguments checked by the caller,
    `gluon_sparse_mla_`): base the plan's `SparseMlaPlan` (its shape and statistics), p where the
    blocks' P go (BF16 [rows, blocks, block_h, 64])."""
    _gluon_mla_row_scores_kernel[(rows, )](
        q, window_pool, comp_pool, window_table, comp_table, p, base.part_ml,
        base.heads, float(scale), q.stride(0), q.stride(1), window_table.stride(0), max(comp_table.stride(0), 1),
        W=base.window, W_P2=triton.next_power_of_2(base.window), KC=base.topk, NB=base.n_blocks, PH=base.block_h,
        num_warps=NUM_WARPS)
