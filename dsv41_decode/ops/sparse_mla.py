"""Sparse MLA decode (spec section 3 step 8): the contract of `reference.attention.sparse_attention`,
for N rows at once, reading the cache records natively.

Per row r and head h: o[r, h] = sum_j softmax_j(q[r, h] . K[j] * scale, sink[h]) K[j] (V = K), over
the row's joined key list: its window keys (the valid suffix of window_table[r]: ring slots into a
uint8 [S_w, 528] MXFP8 pool, oldest first) followed by its compressed entries comp_table[r] (slots
into a uint8 [S_c, 288] NVFP4 pool); -1 entries contribute nothing; a row without a valid key gives
zeros.

The contract's online softmax runs over blocks of 64 keys of the joined list (a block may hold
window and compressed keys together), with P rounded to BF16 against the running max at each
block; the kernel keeps those blocks. One program per (row, head group, key split) holds BLOCK_H
(>= 16) heads of the row and walks its share of the blocks: each key is gathered and dequantized
once into registers (window: E4M3 code * 2^(e - 127) per 32; compressed: E2M1 * E4M3 scale per 16;
exact in BF16) and used by every head of the group, the 512 dims as four chunks of 128. Per block:
s = sum over the chunks in order of q_c @ k_c^T, new max, P = bf16(exp(s - max)) (exp the CUDA math
library's expf, as torch's; rounded to nearest even on the bits), acc_c = acc_c * alpha + P @ k_c
in FP32. Both dots have exact products
(BF16-valued operands) and FP32 accumulators: BF16 operands on the GPU's tensor cores by default
(whose MMA truncates while it adds the products, so the sums are not FP32 round-to-nearest ones),
FP32 operands with IEEE dots with `plan.bf16_dot` False (CUDA-core FMAs, every add rounded to
nearest: the exact step's, `SparseMlaPlan.for_step(fp32_dots=True)`) and always in the interpreter
(its BF16 dot is wrong). FP32 operands on the GPU take dots of `plan.dot_dims` < 128 dims
(`_streamed_scores`, `_streamed_pv`): an FMA dot's operands are replicated per thread over its
depth, so the four 128-dim chunks held in FP32 would spill.

Key splits (`plan.split`, the GPU's): one program per (row, head group, 64-key block). A block's P
must be rounded against the running max the sequential loop has there, max(-1e30, the maxima of
the blocks before it), so each program publishes its block's score max (workspace + a flag) and
waits for the flags of the blocks before it (decoupled look-back: programs take their (row, head
group, block) from an atomic ticket in the order they start, blocks in ascending order, so a
program only waits for programs that already run). The blocks' (max, sum, acc) are then combined
in block order (by the last program to arrive through an atomic counter, or with
`separate_combine` by a second launch, `_sparse_mla_combine_kernel`, to the same bits). Without the
split one program per (row, head group) runs the sequential loop. Either way P is the contract's
for the kernel's scores; the scores' FP32 summation order (four 128-dim dots), exp's last bit and
the accumulation order are the implementation's (tests/ops/test_sparse_mla.py derives the
tolerance). Every row count combines the same blocks in the same order, so a row's bits never
depend on the other rows of the launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from ..records import COMPRESSED_KV_BYTES, WINDOW_KV_BYTES
from . import pdl
from .checks import interpreting, require_ndim, require_records, require_tensor
from .fp4 import bf16_round, e2m1_value, e4m3_value
from .rounding import bf16_rne_bits, to_f32, ue8m0_to_fp32
from .sparse_mla_plan import (BLOCK_KEYS, FP32_STEP_TILING, HEAD_DIM, STEP_TILINGS, SUPPORTED_HEADS,
                              SparseMlaPlan)

__all__ = ["BLOCK_KEYS", "FP32_STEP_TILING", "HEAD_DIM", "STEP_TILINGS", "SUPPORTED_HEADS", "SparseMlaPlan",
           "sparse_mla", "sparse_mla_"]

_WREC: tl.constexpr = tl.constexpr(WINDOW_KV_BYTES)
_CREC: tl.constexpr = tl.constexpr(COMPRESSED_KV_BYTES)
_KEYS: tl.constexpr = tl.constexpr(BLOCK_KEYS)
_COMPILED: tl.constexpr = tl.constexpr(not interpreting())


@triton.jit
def _e4m3(c, NATIVE: tl.constexpr):
    """FP32 value of uint8 E4M3 (fn) codes: the hardware conversion, or `fp4.e4m3_value`."""
    if NATIVE:
        v = c.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    else:
        v = e4m3_value(c)
    return v


@triton.jit
def _exp(x):
    """exp as torch computes it on the GPU (the CUDA math library's expf); numpy's in the
    interpreter, which has no libdevice."""
    if _COMPILED:
        return libdevice.exp(x)
    else:
        return tl.exp(x)


@triton.jit
def _key_chunk(pool_ptr, base, ok, C: tl.constexpr, WINDOW: tl.constexpr, BF16_DOT: tl.constexpr,
               NATIVE_FP8: tl.constexpr, DC: tl.constexpr = 128):
    """Dims [DC C, DC C + DC) of a block of records (byte offsets `base` [_KEYS], int64; keys
    with ok False give 0), dequantized exactly: BF16 operands or FP32 ones (BF16_DOT)."""
    rc = C * DC + tl.arange(0, DC)
    rows = pool_ptr + base[:, None]
    if WINDOW:      # 512 E4M3 codes, then 16 UE8M0 scales (one per 32)
        codes = tl.load(rows + rc[None, :], mask=ok[:, None], other=0)
        sc = tl.load(rows + 512 + (rc // 32)[None, :], mask=ok[:, None], other=127)
        k = _e4m3(codes, NATIVE_FP8) * ue8m0_to_fp32(sc)
    else:           # 256 bytes of E2M1 pairs (low nibble first), then 32 E4M3 scales (one per 16)
        byte = tl.load(rows + (rc // 2)[None, :], mask=ok[:, None], other=0).to(tl.int32)
        code = (byte >> ((rc % 2) * 4)[None, :]) & 15
        sc = tl.load(rows + 256 + (rc // 16)[None, :], mask=ok[:, None], other=0)
        k = e2m1_value(code) * _e4m3(sc, NATIVE_FP8)
    k = tl.where(ok[:, None], k, 0.0)
    if BF16_DOT:
        k = k.to(tl.bfloat16)
    return k


@triton.jit
def _joined_chunk(wpool_ptr, cpool_ptr, wbase, w_ok, cbase, c_ok, kind, C: tl.constexpr,
                  BF16_DOT: tl.constexpr, NATIVE_FP8: tl.constexpr, DC: tl.constexpr = 128):
    """Dims [DC C, DC C + DC) of a block of the joined list, decoded; kind 0: window keys only,
    1: compressed entries only, 2: both (the block where the window ends)."""
    if kind == 0:
        k = _key_chunk(wpool_ptr, wbase, w_ok, C, True, BF16_DOT, NATIVE_FP8, DC)
    elif kind == 1:
        k = _key_chunk(cpool_ptr, cbase, c_ok, C, False, BF16_DOT, NATIVE_FP8, DC)
    else:   # each decode is 0 where its keys are not: the sum is exact
        k = (_key_chunk(wpool_ptr, wbase, w_ok, C, True, BF16_DOT, NATIVE_FP8, DC)
             + _key_chunk(cpool_ptr, cbase, c_ok, C, False, BF16_DOT, NATIVE_FP8, DC))
    return k


@triton.jit
def _qk(q, k, s, BF16_DOT: tl.constexpr):
    if BF16_DOT:
        s = tl.dot(q, tl.trans(k), s)
    else:
        s = tl.dot(q, tl.trans(k), s, input_precision="ieee")
    return s


@triton.jit
def _pv(p, k, acc, BF16_DOT: tl.constexpr):
    if BF16_DOT:
        acc = tl.dot(p.to(tl.bfloat16), k, acc)
    else:
        acc = tl.dot(p, k, acc, input_precision="ieee")
    return acc


@triton.jit
def _block_keys(wtab_row, ctab_row, b, nw, W: tl.constexpr, KC: tl.constexpr):
    """Block b of the row's joined key list (window keys j < nw: window_table[W - nw + j]; then
    comp_table[j - nw]): the keys' record offsets and validity in either pool, and the block's
    kind (`_joined_chunk`)."""
    j = b * _KEYS + tl.arange(0, _KEYS)
    ws = tl.load(wtab_row + (W - nw) + j, mask=j < nw, other=-1)
    jc = j - nw
    cs = tl.load(ctab_row + jc, mask=(jc >= 0) & (jc < KC), other=-1)
    w_ok = ws >= 0
    c_ok = cs >= 0
    wbase = tl.where(w_ok, ws, 0).to(tl.int64) * _WREC
    cbase = tl.where(c_ok, cs, 0).to(tl.int64) * _CREC
    start = b * _KEYS
    kind = tl.where(start + _KEYS <= nw, 0, tl.where(start >= nw, 1, 2))
    return wbase, w_ok, cbase, c_ok, kind


@triton.jit
def _block(wpool_ptr, cpool_ptr, wtab_row, ctab_row, b, nw, q0, q1, q2, q3, scale,
           W: tl.constexpr, KC: tl.constexpr, BF16_DOT: tl.constexpr, NATIVE_FP8: tl.constexpr):
    """Block b of the row's joined key list (`_block_keys`): its keys decoded (four 128-dim
    chunks), their validity, and the scores s = (sum over the chunks in order of q_c . k_c) * scale,
    -inf where a key is invalid."""
    wbase, w_ok, cbase, c_ok, kind = _block_keys(wtab_row, ctab_row, b, nw, W, KC)
    k0 = _joined_chunk(wpool_ptr, cpool_ptr, wbase, w_ok, cbase, c_ok, kind, 0, BF16_DOT, NATIVE_FP8)
    k1 = _joined_chunk(wpool_ptr, cpool_ptr, wbase, w_ok, cbase, c_ok, kind, 1, BF16_DOT, NATIVE_FP8)
    k2 = _joined_chunk(wpool_ptr, cpool_ptr, wbase, w_ok, cbase, c_ok, kind, 2, BF16_DOT, NATIVE_FP8)
    k3 = _joined_chunk(wpool_ptr, cpool_ptr, wbase, w_ok, cbase, c_ok, kind, 3, BF16_DOT, NATIVE_FP8)
    ok = w_ok | c_ok
    s = tl.zeros((q0.shape[0], _KEYS), dtype=tl.float32)
    s = _qk(q0, k0, s, BF16_DOT)
    s = _qk(q1, k1, s, BF16_DOT)
    s = _qk(q2, k2, s, BF16_DOT)
    s = _qk(q3, k3, s, BF16_DOT)
    s = tl.where(ok[None, :], s * scale, float("-inf"))
    return k0, k1, k2, k3, ok, s


@triton.jit
def _streamed_scores(q_rows, h_ok, wpool_ptr, cpool_ptr, wtab_row, ctab_row, b, nw, scale,
                     W: tl.constexpr, KC: tl.constexpr, NATIVE_FP8: tl.constexpr, DOT_DIMS: tl.constexpr,
                     BLOCK_H: tl.constexpr):
    """Block b's scores with FP32 operands in dots of DOT_DIMS dims (`SparseMlaPlan.dot_dims` <
    128): s = (sum over the chunks in order of q_c . k_c) * scale, -inf where a key is invalid, each
    chunk's q loaded and its keys decoded just before its dot (q [BLOCK_H, 512] rows at q_rows).
    Nothing is held across the dots: an FMA dot's operands are replicated per thread over the dot's
    depth, so a chunk's fit in registers where the 512 dims do not. Returns (the block's
    `_block_keys`, the keys' validity, s)."""
    wbase, w_ok, cbase, c_ok, kind = _block_keys(wtab_row, ctab_row, b, nw, W, KC)
    rd = tl.arange(0, DOT_DIMS)
    s = tl.zeros((BLOCK_H, _KEYS), dtype=tl.float32)
    for c in tl.static_range(512 // DOT_DIMS):
        q_c = to_f32(tl.load(q_rows + c * DOT_DIMS + rd[None, :], mask=h_ok[:, None], other=0.0))
        k_c = _joined_chunk(wpool_ptr, cpool_ptr, wbase, w_ok, cbase, c_ok, kind, c, False, NATIVE_FP8, DOT_DIMS)
        s = tl.dot(q_c, tl.trans(k_c), s, input_precision="ieee")
    ok = w_ok | c_ok
    s = tl.where(ok[None, :], s * scale, float("-inf"))
    return wbase, w_ok, cbase, c_ok, kind, ok, s


@triton.jit
def _streamed_pv(p, wpool_ptr, cpool_ptr, wbase, w_ok, cbase, c_ok, kind, acc_rows,
                 NATIVE_FP8: tl.constexpr, DOT_DIMS: tl.constexpr):
    """The block's P @ V with FP32 operands, DOT_DIMS dims a dot, the keys decoded again per chunk;
    each chunk of acc = P @ k_c (from zero: this tiling runs one block per program) stored at
    acc_rows ([BLOCK_H, 512] FP32 pointers) as soon as it is summed."""
    rd = tl.arange(0, DOT_DIMS)
    for c in tl.static_range(512 // DOT_DIMS):
        k_c = _joined_chunk(wpool_ptr, cpool_ptr, wbase, w_ok, cbase, c_ok, kind, c, False, NATIVE_FP8, DOT_DIMS)
        a_c = tl.dot(p, k_c, tl.zeros((p.shape[0], DOT_DIMS), dtype=tl.float32), input_precision="ieee")
        tl.store(acc_rows + c * DOT_DIMS + rd[None, :], a_c)


@triton.jit
def _row_setup(q_ptr, wtab_ptr, ctab_ptr, r, g, H, stride_qn, stride_qh, stride_wt, stride_ct,
               W: tl.constexpr, W_P2: tl.constexpr, BLOCK_H: tl.constexpr, BF16_DOT: tl.constexpr):
    """The program's heads (indices, in range), q as four [BLOCK_H, 128] chunks, the row's table
    rows and its window key count nw (the valid suffix of its window table)."""
    rh = g * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = rh < H
    rc = tl.arange(0, 128)
    q_rows = q_ptr + r * stride_qn + rh[:, None] * stride_qh + rc[None, :]
    q0 = tl.load(q_rows, mask=h_ok[:, None], other=0.0)
    q1 = tl.load(q_rows + 128, mask=h_ok[:, None], other=0.0)
    q2 = tl.load(q_rows + 256, mask=h_ok[:, None], other=0.0)
    q3 = tl.load(q_rows + 384, mask=h_ok[:, None], other=0.0)
    if not BF16_DOT:
        q0, q1, q2, q3 = to_f32(q0), to_f32(q1), to_f32(q2), to_f32(q3)
    wtab_row = wtab_ptr + r * stride_wt
    rw = tl.arange(0, W_P2)
    nw = tl.sum((tl.load(wtab_row + rw, mask=rw < W, other=-1) >= 0).to(tl.int32), axis=0)
    return rh, h_ok, q0, q1, q2, q3, wtab_row, ctab_ptr + r * stride_ct, nw


@triton.jit
def _sparse_mla_kernel(
    q_ptr, wpool_ptr, cpool_ptr, wtab_ptr, ctab_ptr, sink_ptr, out_ptr,
    part_acc_ptr, part_ml_ptr, block_max_ptr, flag_ptr, count_ptr, ticket_ptr,
    N, H, scale, stride_qn, stride_qh, stride_wt, stride_ct, stride_on, stride_oh,
    W: tl.constexpr, W_P2: tl.constexpr, KC: tl.constexpr, HG: tl.constexpr, SPLIT: tl.constexpr,
    NB_P2: tl.constexpr, BLOCK_H: tl.constexpr, BF16_DOT: tl.constexpr, NATIVE_FP8: tl.constexpr,
    SEPARATE: tl.constexpr = False, PDL: tl.constexpr = False, DOT_DIMS: tl.constexpr = 128,
):
    pdl.enter(PDL, RELEASE=False)
    D: tl.constexpr = 512
    DC: tl.constexpr = 128
    STREAMED: tl.constexpr = DOT_DIMS < DC    # `_streamed_scores`: FP32 operands, split only
    tl.static_assert(not STREAMED or (SPLIT and not BF16_DOT))
    NB: tl.constexpr = (W + KC + _KEYS - 1) // _KEYS
    if SPLIT:
        # One program per (row, head group, block). Tickets, taken in the order the programs start,
        # give the blocks in ascending order, so a program only waits for programs already running.
        ticket = tl.atomic_add(ticket_ptr, 1, sem="relaxed", scope="gpu")
        if ticket == N * HG * NB - 1:
            tl.store(ticket_ptr, 0)      # every program has its ticket: ready for the next launch
        b_lo = ticket // (N * HG)
        r = (ticket // HG) % N
        g = ticket % HG
        b_hi = b_lo + 1
    else:
        r = tl.program_id(0)
        g = tl.program_id(1)
        b_lo = 0
        b_hi = NB
    tile = r * HG + g
    rh, h_ok, q0, q1, q2, q3, wtab_row, ctab_row, nw = _row_setup(
        q_ptr, wtab_ptr, ctab_ptr, r, g, H, stride_qn, stride_qh, stride_wt, stride_ct, W, W_P2, BLOCK_H, BF16_DOT)
    rc = tl.arange(0, DC)
    lh = tl.arange(0, BLOCK_H)
    if SPLIT:   # Workspace: acc [N, HG, NB, BLOCK_H, D]; ml [N, HG, NB, 3, BLOCK_H] (max, sum, count).
        acc_base = part_acc_ptr + tile.to(tl.int64) * (NB * BLOCK_H * D)
        ml_base = part_ml_ptr + tile.to(tl.int64) * (NB * 3 * BLOCK_H)
        mine_h = acc_base + b_lo * (BLOCK_H * D) + lh[:, None] * D   # this block's partial [BLOCK_H, 1]
        acc_rows = acc_base + lh[:, None] * D + rc[None, :]
        mine = mine_h + rc[None, :]

    m_i = tl.full((BLOCK_H,), -1e30, dtype=tl.float32)
    l_i = tl.zeros((BLOCK_H,), dtype=tl.float32)
    a0 = tl.zeros((BLOCK_H, DC), dtype=tl.float32)
    a1 = tl.zeros((BLOCK_H, DC), dtype=tl.float32)
    a2 = tl.zeros((BLOCK_H, DC), dtype=tl.float32)
    a3 = tl.zeros((BLOCK_H, DC), dtype=tl.float32)
    nvalid = tl.zeros((_KEYS,), dtype=tl.int32)
    for b in range(b_lo, b_hi):
        if STREAMED:
            q_rows = q_ptr + r * stride_qn + rh[:, None] * stride_qh
            wbase, w_ok, cbase, c_ok, kind, ok, s = _streamed_scores(
                q_rows, h_ok, wpool_ptr, cpool_ptr, wtab_row, ctab_row, b, nw, scale, W, KC, NATIVE_FP8,
                DOT_DIMS, BLOCK_H)
        else:
            k0, k1, k2, k3, ok, s = _block(wpool_ptr, cpool_ptr, wtab_row, ctab_row, b, nw, q0, q1, q2, q3,
                                           scale, W, KC, BF16_DOT, NATIVE_FP8)
        nvalid += ok.to(tl.int32)
        s_max = tl.max(s, axis=1)
        if SPLIT:
            # publish this block's max; the running max of the sequential loop before this block is
            # the max over the blocks before it, each published by its own program
            mx = block_max_ptr + tile.to(tl.int64) * (NB * BLOCK_H) + lh
            tl.store(mx + b * BLOCK_H, s_max)
            tl.debug_barrier()
            flags = flag_ptr + tile * NB
            tl.atomic_xchg(flags + b, 1, sem="release", scope="gpu")
            for bb in range(0, b):
                while tl.atomic_add(flags + bb, 0, sem="acquire", scope="gpu") == 0:
                    pass
                m_i = tl.maximum(m_i, tl.load(mx + bb * BLOCK_H, cache_modifier=".cg"))
        new_max = tl.maximum(m_i, s_max)
        alpha = _exp(m_i - new_max)
        p = _exp(s - new_max[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        p = bf16_round(p)
        if STREAMED:    # one block per program: acc is P @ V, its chunks stored as they are summed
            _streamed_pv(p, wpool_ptr, cpool_ptr, wbase, w_ok, cbase, c_ok, kind, mine_h, NATIVE_FP8, DOT_DIMS)
        else:
            a0 = _pv(p, k0, a0 * alpha[:, None], BF16_DOT)
            a1 = _pv(p, k1, a1 * alpha[:, None], BF16_DOT)
            a2 = _pv(p, k2, a2 * alpha[:, None], BF16_DOT)
            a3 = _pv(p, k3, a3 * alpha[:, None], BF16_DOT)
        m_i = new_max

    nv = tl.sum(nvalid, axis=0)
    pdl.release(PDL)   # the successor (the combination, or the next op) may launch
    out_rows = out_ptr + r * stride_on + rh[:, None] * stride_oh + rc[None, :]
    sink = tl.load(sink_ptr + rh, mask=h_ok, other=0.0)
    if not SPLIT:
        _store_o(out_rows, a0, a1, a2, a3, l_i + _exp(sink - m_i), nv > 0, h_ok, DC)
    else:
        if not STREAMED:
            tl.store(mine, a0)
            tl.store(mine + DC, a1)
            tl.store(mine + 2 * DC, a2)
            tl.store(mine + 3 * DC, a3)
        ml_ptrs = ml_base + b_lo * (3 * BLOCK_H) + lh
        tl.store(ml_ptrs, m_i)
        tl.store(ml_ptrs + BLOCK_H, l_i)
        tl.store(ml_ptrs + 2 * BLOCK_H, tl.zeros((BLOCK_H,), dtype=tl.float32) + nv.to(tl.float32))
        if SEPARATE:     # `_sparse_mla_combine_kernel` combines (and clears the flags), launched next
            return
        tl.debug_barrier()
        arrived = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == NB - 1:
            # the last program of (row, head group) to arrive: every block's program has read the
            # flags it waited for; clear them and the counter, and combine the blocks in order
            tl.store(count_ptr + tile, 0)
            tl.store(flag_ptr + tile * NB + tl.arange(0, NB_P2), tl.zeros((NB_P2,), dtype=tl.int32),
                     mask=tl.arange(0, NB_P2) < NB)
            ml = ml_base + lh[:, None]
            m_all, n_all = _split_totals(ml, NB, BLOCK_H)
            a0, l_all = _combine_chunk(acc_rows, ml, m_all, NB, BLOCK_H)
            a1, _ = _combine_chunk(acc_rows + DC, ml, m_all, NB, BLOCK_H)
            a2, _ = _combine_chunk(acc_rows + 2 * DC, ml, m_all, NB, BLOCK_H)
            a3, _ = _combine_chunk(acc_rows + 3 * DC, ml, m_all, NB, BLOCK_H)
            m_all = tl.reshape(m_all, (BLOCK_H,))
            _store_o(out_rows, a0, a1, a2, a3, tl.reshape(l_all, (BLOCK_H,)) + _exp(sink - m_all),
                     tl.reshape(n_all, (BLOCK_H,)) > 0, h_ok, DC)


@triton.jit
def _split_totals(ml, SPLIT: tl.constexpr, BLOCK_H: tl.constexpr):
    """(max, valid-key count) over the splits of one (row, head group), from the workspace's
    per-split statistics; ml: split 0's max of each head, as [BLOCK_H, 1] column pointers (the
    values come out in the layout of the accumulators they scale). Unrolled: every split's loads
    are independent and go out together (`.cg`: from L2, never a stale L1 line of this SM)."""
    m_all = tl.full(ml.shape, -1e30, dtype=tl.float32)
    n_all = tl.zeros(ml.shape, dtype=tl.float32)
    for s in tl.static_range(SPLIT):
        m_all = tl.maximum(m_all, tl.load(ml + s * (3 * BLOCK_H), cache_modifier=".cg"))
        n_all += tl.load(ml + s * (3 * BLOCK_H) + 2 * BLOCK_H, cache_modifier=".cg")
    return m_all, n_all


@triton.jit
def _combine_chunk(part, ml, m_all, SPLIT: tl.constexpr, BLOCK_H: tl.constexpr):
    """A slice of the splits' accumulators, each rescaled by exp(m_s - m_all) and added in split
    order (part: split 0's [BLOCK_H, C] pointers; ml, m_all as in `_split_totals`), and the sums
    rescaled alike: (acc [BLOCK_H, C], sum [BLOCK_H, 1])."""
    D: tl.constexpr = 512
    l_all = tl.zeros(ml.shape, dtype=tl.float32)
    a = tl.zeros(part.shape, dtype=tl.float32)
    for s in tl.static_range(SPLIT):
        f = _exp(tl.load(ml + s * (3 * BLOCK_H), cache_modifier=".cg") - m_all)
        l_all += tl.load(ml + s * (3 * BLOCK_H) + BLOCK_H, cache_modifier=".cg") * f
        a += tl.load(part + s * (BLOCK_H * D), cache_modifier=".cg") * f
    return a, l_all


@triton.jit
def _sparse_mla_combine_kernel(
    part_acc_ptr, part_ml_ptr, flag_ptr, sink_ptr, out_ptr, H, HG, stride_on, stride_oh,
    SPLIT: tl.constexpr, SPLIT_P2: tl.constexpr, BLOCK_H: tl.constexpr, CHUNK: tl.constexpr,
    SUB_H: tl.constexpr = 0, PDL: tl.constexpr = False,
):
    """The blocks' combination of `_sparse_mla_kernel` with SEPARATE, spread over programs: one per
    (CHUNK-dim slice of the 512, row, head group, SUB_H heads of the group's BLOCK_H; 0: all), the
    slice the fastest, so that neighbouring programs read neighbouring bytes of each partial (a
    head's 512 dims are 2 KB in a row); the inline combination's arithmetic in its block order (the
    same bits, element for element, whatever the tiling). The program of the first slice and head
    share clears the (row, head group)'s flags. The split loops are unrolled (SPLIT is a constexpr) and every per-head
    value is a [SUB_H, 1] column of the accumulator's own layout, so the loads of all splits are
    independent and in flight together, with no layout exchange through shared memory between
    them (the first version looped over 128-dim chunks and the splits, one dependent L2 round trip
    and two barriers per split: 6.8 us for 20 splits at 1 row on an H200). Launch it with
    `combine_partials_`."""
    pdl.enter(PDL)
    D: tl.constexpr = 512
    PH: tl.constexpr = BLOCK_H if SUB_H == 0 else SUB_H
    NSUB: tl.constexpr = BLOCK_H // PH
    c = tl.program_id(0)
    tile = tl.program_id(1) // NSUB
    sub = tl.program_id(1) % NSUB
    r = tile // HG
    g = tile % HG
    hd = sub * PH + tl.arange(0, PH)[:, None]                                  # [PH, 1]
    rh = g * BLOCK_H + hd
    h_ok = rh < H
    dd = c * CHUNK + tl.arange(0, CHUNK)[None, :]                              # [1, CHUNK]
    if (c == 0) & (sub == 0):
        fl = tl.arange(0, SPLIT_P2)
        tl.store(flag_ptr + tile * SPLIT + fl, tl.zeros((SPLIT_P2,), dtype=tl.int32), mask=fl < SPLIT)
    # Workspace: acc [N, HG, SPLIT, BLOCK_H, D]; ml [N, HG, SPLIT, 3, BLOCK_H] (max, sum, count).
    ml = part_ml_ptr + tile.to(tl.int64) * (SPLIT * 3 * BLOCK_H) + hd
    acc = part_acc_ptr + tile.to(tl.int64) * (SPLIT * BLOCK_H * D) + hd * D + dd
    m_all, n_all = _split_totals(ml, SPLIT, BLOCK_H)
    a, l_all = _combine_chunk(acc, ml, m_all, SPLIT, BLOCK_H)
    sink = tl.load(sink_ptr + rh, mask=h_ok, other=0.0)
    d = tl.where(n_all > 0, l_all + _exp(sink - m_all), float("inf"))     # no valid key: o is 0
    tl.store(out_ptr + r * stride_on + rh * stride_oh + dd, bf16_rne_bits(a / d), mask=h_ok)


def combine_tiling(split: int, block_h: int) -> tuple[int, int]:
    """(CHUNK, SUB_H) of the separate combination: 512-byte slices of each head's partial (128
    dims) where every split's [SUB_H, CHUNK] FP32 slice in flight at once stays within 8K values (64
    registers a thread at 4 warps), SUB_H the heads that leaves (at least one; fewer dims past 64
    splits, at least 16)."""
    p2 = triton.next_power_of_2(split)
    chunk = max(16, min(128, 8192 // p2))
    return chunk, max(1, min(block_h, 8192 // (p2 * chunk)))


def combine_partials_(part_acc, part_ml, flags, sink, o16, heads: int, head_groups: int, rows: int, split: int,
                      block_h: int) -> None:
    """`_sparse_mla_combine_kernel` over `rows` rows of `head_groups` groups of `block_h` heads and
    `split` block partials each (the workspace of `SparseMlaPlan` with SEPARATE, or of the Gluon
    kernel), into o16 (the output's int16 view), in the tiling of `combine_tiling`."""
    chunk, sub_h = combine_tiling(split, block_h)
    _sparse_mla_combine_kernel[(HEAD_DIM // chunk, rows * head_groups * (block_h // sub_h))](
        part_acc, part_ml, flags, sink, o16, heads, head_groups, o16.stride(0), o16.stride(1),
        SPLIT=split, SPLIT_P2=triton.next_power_of_2(split), BLOCK_H=block_h, CHUNK=chunk, SUB_H=sub_h,
        PDL=False, num_warps=4,
    )


@triton.jit
def _store_o(out_rows, a0, a1, a2, a3, l_f, valid, h_ok, DC: tl.constexpr):
    """o = acc / sum as BF16 bits (RNE), chunk by chunk; zeros where the row had no valid key."""
    _store_chunk(out_rows, a0, l_f, valid, h_ok)
    _store_chunk(out_rows + DC, a1, l_f, valid, h_ok)
    _store_chunk(out_rows + 2 * DC, a2, l_f, valid, h_ok)
    _store_chunk(out_rows + 3 * DC, a3, l_f, valid, h_ok)


@triton.jit
def _store_chunk(out_rows, a, l_f, valid, h_ok):
    """One chunk of o = acc / sum as BF16 bits (RNE); zeros where the row had no valid key."""
    d = tl.where(valid, l_f, float("inf"))[:, None]     # no valid key: acc is 0, o is 0
    tl.store(out_rows, bf16_rne_bits(a / d), mask=h_ok[:, None])


def check_sparse_mla_args(plan: SparseMlaPlan, q, window_pool, comp_pool, window_table, comp_table, sink, scale,
                          out) -> int:
    """The row count N of a `sparse_mla_` launch (or of another kernel's with the same arguments,
    `ops.gluon_sparse_mla`), after checking every argument against `plan` (errors name the
    argument)."""
    n = require_ndim(q, "q", "[N, H, 512]")[0]
    if n > plan.max_rows:
        raise ValueError(f"q has {n} rows, more than the plan's max_rows={plan.max_rows}")
    dev = plan.device
    h = plan.heads
    require_tensor(q, "q", torch.bfloat16, (n, h, HEAD_DIM), dev)
    require_records(window_pool, "window_pool", WINDOW_KV_BYTES, dev)
    require_records(comp_pool, "comp_pool", COMPRESSED_KV_BYTES, dev)
    require_tensor(window_table, "window_table", torch.int32, (n, plan.window), dev)
    require_tensor(comp_table, "comp_table", torch.int32, (n, plan.topk), dev)
    require_tensor(sink, "sink", torch.float32, (h,), dev)
    require_tensor(out, "out", torch.bfloat16, (n, h, HEAD_DIM), dev)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a float, got {type(scale).__name__}")
    if n and (q.stride(1) == 0 or out.stride(1) == 0):
        raise ValueError("q and out must not broadcast over heads")
    return n


def sparse_mla_(plan: SparseMlaPlan, q: torch.Tensor, window_pool: torch.Tensor, comp_pool: torch.Tensor,
                window_table: torch.Tensor, comp_table: torch.Tensor, sink: torch.Tensor, scale: float,
                out: torch.Tensor) -> None:
    """Write out[r, h] = sparse_attention(q[r, h], keys of row r, sink[h], scale) (see module doc).

    plan: `SparseMlaPlan.build(max_rows, H, W, K, device)`.
    q: [N, H, 512] bfloat16 (already rotated), unit stride in the last dim, 1 <= N <= max_rows.
    window_pool: [S_w, 528] uint8 window records; comp_pool: [S_c, 288] uint8 compressed records
      (both contiguous rows; S_c may be 0 when comp_table holds only -1).
    window_table: [N, W] int32 ring slots, oldest first, -1 only before the first valid one (a window
      not yet full: `sparse_tables.window_table_`); comp_table: [N, K] int32 slots (-1 = none). The
      joined key list of a row is its valid window slots, then its K compressed entries. Neither the
      slots' range nor the window table's -1 prefix is checked.
    sink: [H] float32; scale: the softmax scale; out: [N, H, 512] bfloat16, unit stride in the last dim.
    """
    if not isinstance(plan, SparseMlaPlan):
        raise TypeError(f"plan must be a SparseMlaPlan, got {type(plan).__name__}")
    n = check_sparse_mla_args(plan, q, window_pool, comp_pool, window_table, comp_table, sink, scale, out)
    if n == 0:
        return
    nb = plan.n_blocks
    h = plan.heads
    hg = plan.head_groups
    separate = plan.separate_combine and plan.split
    o16 = out.view(torch.int16)
    _sparse_mla_kernel[(n, hg, nb) if plan.split else (n, hg)](
        q, window_pool, comp_pool, window_table, comp_table, sink, o16,
        plan.part_acc, plan.part_ml, plan.block_max, plan.flags, plan.counters, plan.ticket,
        n, h, float(scale), q.stride(0), q.stride(1), window_table.stride(0), max(comp_table.stride(0), 1),
        o16.stride(0), o16.stride(1),
        W=plan.window, W_P2=triton.next_power_of_2(plan.window), KC=plan.topk, HG=hg, SPLIT=plan.split,
        NB_P2=triton.next_power_of_2(nb), BLOCK_H=plan.block_h, BF16_DOT=plan.bf16_dot,
        NATIVE_FP8=plan.native_fp8, SEPARATE=separate, PDL=False, DOT_DIMS=plan.dot_dims,
        num_warps=plan.num_warps,
    )
    if separate:
        combine_partials_(plan.part_acc, plan.part_ml, plan.flags, sink, o16, h, hg, n, nb, plan.block_h)


def sparse_mla(q: torch.Tensor, window_pool: torch.Tensor, comp_pool: torch.Tensor, window_table: torch.Tensor,
               comp_table: torch.Tensor, sink: torch.Tensor, scale: float, **plan_options) -> torch.Tensor:
    """Convenience: build a plan for these shapes, allocate out, launch; returns [N, H, 512] bfloat16."""
    n = require_ndim(q, "q", "[N, H, 512]")[0]
    for t, name in ((window_table, "window_table"), (comp_table, "comp_table")):
        require_ndim(t, name, "[N, width]")
    out = torch.empty(n, q.shape[1], HEAD_DIM, dtype=torch.bfloat16, device=q.device)
    if n == 0:
        return out
    plan = SparseMlaPlan.build(n, q.shape[1], window_table.shape[1], comp_table.shape[1], q.device, **plan_options)
    sparse_mla_(plan, q, window_pool, comp_pool, window_table, comp_table, sink, scale, out)
    return out
