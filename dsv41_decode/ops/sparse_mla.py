"""Sparse MLA decode (issue 4 item 5; spec section 3 step 8): the contract of
`reference.attention.sparse_attention`, for N rows at once, reading the cache records natively.

Per row r and head h: o[r, h] = sum_j softmax_j(q[r, h] . K[j] * scale, sink[h]) K[j] (V = K), over
the window records of window_table[r] (ring slots into a uint8 [S_w, 528] MXFP8 pool) then the
compressed records of comp_table[r] (slots into a uint8 [S_c, 288] NVFP4 pool); -1 entries
contribute nothing; a row without a valid key gives zeros.

Kernel: one program per (row, head group, key split). A program holds BLOCK_H (>= 16) heads of the
row and walks its share of the key blocks (BLOCK_KEYS keys each; window blocks, then compressed
blocks): each key is gathered and dequantized once in registers (window: E4M3 code * 2^(e - 127)
per 32; compressed: E2M1 * E4M3 scale per 16; the values are exact in BF16) and used by every head
of the group. The 512 dims are handled as four chunks of 128 (q, the decoded keys and the
accumulator each as four tiles: no decode temporary spans the whole record, which kept the first
version at 255 registers with spills): scores = sum over the chunks in order of q_c @ k_c^T, online
softmax in FP32 (max from -1e30), P rounded to BF16 (round-to-nearest-even on the bits), then
acc_c = acc_c * alpha + P @ k_c, FP32 accumulators. Both dots have exact
products (BF16-valued operands) and FP32 sums: BF16 operands on the GPU, FP32 in the interpreter
(its BF16 dot is wrong). With more than one split, each program writes (max, sum, valid count,
acc) to the plan's workspace and the last program of the (row, head group) to arrive (an atomic
counter, reset by it) combines the splits in split order - combined max, rescaled sums and
accumulators, then the sink - and stores o = acc / sum as BF16 (RNE bits). One launch,
deterministic. With `separate_combine` the splits only store, and a second launch
(`_sparse_mla_combine_kernel`, one program per row, head group and slice of 16-128 dims, every
split's loads in flight together) combines them the same way, to the same bits: many short splits no longer funnel every partial through one program.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..records import COMPRESSED_KV_BYTES, WINDOW_KV_BYTES
from . import pdl
from .checks import require_tensor
from .rounding import bf16_rne_bits, ue8m0_to_fp32
from .sparse_mla_plan import HEAD_DIM, STEP_TILINGS, SUPPORTED_HEADS, SparseMlaPlan

__all__ = ["HEAD_DIM", "STEP_TILINGS", "SUPPORTED_HEADS", "SparseMlaPlan", "sparse_mla", "sparse_mla_"]


@triton.jit
def _e4m3_to_fp32(c, NATIVE: tl.constexpr):
    """FP32 value of uint8 E4M3 (fn) codes; 0x7F / 0xFF are NaN."""
    if NATIVE:
        v = c.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    else:
        ci = c.to(tl.int32)
        e = (ci >> 3) & 15
        m = ci & 7
        normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
        mag = tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal)
        v = tl.where((ci & 0x80) != 0, -mag, mag)
        v = tl.where((ci & 0x7F) == 0x7F, float("nan"), v)
    return v


@triton.jit
def _e2m1_to_fp32(c):
    """FP32 value of E2M1 codes 0..15 (int32): bit 3 sign, bits 2..1 exponent, bit 0 mantissa."""
    e = (c >> 1) & 3
    m = c & 1
    normal = (((e + 126) << 23) | (m << 22)).to(tl.float32, bitcast=True)
    mag = tl.where(e == 0, m.to(tl.float32) * 0.5, normal)
    return tl.where((c & 8) != 0, -mag, mag)


@triton.jit
def _round_bf16_f32(x):
    """x rounded to BF16 (nearest even), kept as FP32 (same bits on the GPU and the interpreter)."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _key_chunk(pool_ptr, base, ok, C: tl.constexpr, DC: tl.constexpr, WINDOW: tl.constexpr,
               BF16_DOT: tl.constexpr, NATIVE_FP8: tl.constexpr):
    """Dims [C*DC, (C+1)*DC) of a block of records (byte offsets `base` [BLOCK_KEYS], int64; rows
    with ok False give 0), dequantized exactly: BF16 on the GPU, FP32 in the interpreter."""
    rc = C * DC + tl.arange(0, DC)
    rows = pool_ptr + base[:, None]
    if WINDOW:      # 512 E4M3 codes, then 16 UE8M0 scales (one per 32)
        codes = tl.load(rows + rc[None, :], mask=ok[:, None], other=0)
        sc = tl.load(rows + 512 + (rc // 32)[None, :], mask=ok[:, None], other=127)
        k = _e4m3_to_fp32(codes, NATIVE_FP8) * ue8m0_to_fp32(sc)
    else:           # 256 bytes of E2M1 pairs (low nibble first), then 32 E4M3 scales (one per 16)
        byte = tl.load(rows + (rc // 2)[None, :], mask=ok[:, None], other=0).to(tl.int32)
        code = (byte >> ((rc % 2) * 4)[None, :]) & 15
        sc = tl.load(rows + 256 + (rc // 16)[None, :], mask=ok[:, None], other=0)
        k = _e2m1_to_fp32(code) * _e4m3_to_fp32(sc, NATIVE_FP8)
    k = tl.where(ok[:, None], k, 0.0)
    if BF16_DOT:
        k = k.to(tl.bfloat16)
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
def _attend_block(pool_ptr, base, ok, q0, q1, q2, q3, m_i, l_i, a0, a1, a2, a3, scale,
                  WINDOW: tl.constexpr, BF16_DOT: tl.constexpr, NATIVE_FP8: tl.constexpr):
    """One online-softmax step over a block of keys (V = K), the 512 dims in four chunks of 128:
    scores = sum over chunks in order of q_c . k_c, then acc_c = acc_c * alpha + P @ k_c."""
    DC: tl.constexpr = 128
    k0 = _key_chunk(pool_ptr, base, ok, 0, DC, WINDOW, BF16_DOT, NATIVE_FP8)
    k1 = _key_chunk(pool_ptr, base, ok, 1, DC, WINDOW, BF16_DOT, NATIVE_FP8)
    k2 = _key_chunk(pool_ptr, base, ok, 2, DC, WINDOW, BF16_DOT, NATIVE_FP8)
    k3 = _key_chunk(pool_ptr, base, ok, 3, DC, WINDOW, BF16_DOT, NATIVE_FP8)
    s = tl.zeros((q0.shape[0], base.shape[0]), dtype=tl.float32)
    s = _qk(q0, k0, s, BF16_DOT)
    s = _qk(q1, k1, s, BF16_DOT)
    s = _qk(q2, k2, s, BF16_DOT)
    s = _qk(q3, k3, s, BF16_DOT)
    s = s * scale
    s = tl.where(ok[None, :], s, float("-inf"))
    new_max = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp(m_i - new_max)
    p = tl.exp(s - new_max[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    p = _round_bf16_f32(p)
    a0 = _pv(p, k0, a0 * alpha[:, None], BF16_DOT)
    a1 = _pv(p, k1, a1 * alpha[:, None], BF16_DOT)
    a2 = _pv(p, k2, a2 * alpha[:, None], BF16_DOT)
    a3 = _pv(p, k3, a3 * alpha[:, None], BF16_DOT)
    return new_max, l_i, a0, a1, a2, a3


@triton.jit
def _slots(tab_ptr, kk, n_keys, REC: tl.constexpr):
    """Record byte offsets (int64) and validity of table entries kk (< n_keys)."""
    slot = tl.load(tab_ptr + kk, mask=kk < n_keys, other=-1)
    ok = slot >= 0
    return tl.where(ok, slot, 0).to(tl.int64) * REC, ok


@triton.jit
def _sparse_mla_kernel(
    q_ptr, wpool_ptr, cpool_ptr, wtab_ptr, ctab_ptr, sink_ptr, out_ptr,
    part_acc_ptr, part_ml_ptr, count_ptr,
    H, scale, stride_qn, stride_qh, stride_wt, stride_ct, stride_on, stride_oh,
    W: tl.constexpr, KC: tl.constexpr, SPLIT: tl.constexpr, BLOCKS_PER_SPLIT: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_KEYS: tl.constexpr, BF16_DOT: tl.constexpr, NATIVE_FP8: tl.constexpr,
    SEPARATE: tl.constexpr = False, PDL: tl.constexpr = False,
):
    pdl.enter(PDL, RELEASE=False)
    D: tl.constexpr = 512
    DC: tl.constexpr = 128
    NB_W: tl.constexpr = (W + BLOCK_KEYS - 1) // BLOCK_KEYS
    NB_C: tl.constexpr = (KC + BLOCK_KEYS - 1) // BLOCK_KEYS
    HG = tl.num_programs(1)
    r = tl.program_id(0)
    g = tl.program_id(1)
    sp = tl.program_id(2)

    rh = g * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = rh < H
    rc = tl.arange(0, DC)
    rk = tl.arange(0, BLOCK_KEYS)
    q_rows = q_ptr + r * stride_qn + rh[:, None] * stride_qh + rc[None, :]
    q0 = tl.load(q_rows, mask=h_ok[:, None], other=0.0)
    q1 = tl.load(q_rows + DC, mask=h_ok[:, None], other=0.0)
    q2 = tl.load(q_rows + 2 * DC, mask=h_ok[:, None], other=0.0)
    q3 = tl.load(q_rows + 3 * DC, mask=h_ok[:, None], other=0.0)
    if not BF16_DOT:
        q0, q1, q2, q3 = q0.to(tl.float32), q1.to(tl.float32), q2.to(tl.float32), q3.to(tl.float32)

    m_i = tl.full((BLOCK_H,), -1e30, dtype=tl.float32)
    l_i = tl.zeros((BLOCK_H,), dtype=tl.float32)
    a0 = tl.zeros((BLOCK_H, DC), dtype=tl.float32)
    a1 = tl.zeros((BLOCK_H, DC), dtype=tl.float32)
    a2 = tl.zeros((BLOCK_H, DC), dtype=tl.float32)
    a3 = tl.zeros((BLOCK_H, DC), dtype=tl.float32)
    nvalid = tl.zeros((BLOCK_KEYS,), dtype=tl.int32)

    b_lo = sp * BLOCKS_PER_SPLIT
    b_hi = tl.minimum(b_lo + BLOCKS_PER_SPLIT, NB_W + NB_C)
    for b in range(b_lo, tl.minimum(b_hi, NB_W)):           # window blocks
        base, ok = _slots(wtab_ptr + r * stride_wt, b * BLOCK_KEYS + rk, W, 528)
        nvalid += ok.to(tl.int32)
        m_i, l_i, a0, a1, a2, a3 = _attend_block(wpool_ptr, base, ok, q0, q1, q2, q3, m_i, l_i, a0, a1, a2, a3,
                                                 scale, True, BF16_DOT, NATIVE_FP8)
    for b in range(tl.maximum(b_lo, NB_W), b_hi):           # compressed blocks
        base, ok = _slots(ctab_ptr + r * stride_ct, (b - NB_W) * BLOCK_KEYS + rk, KC, 288)
        nvalid += ok.to(tl.int32)
        m_i, l_i, a0, a1, a2, a3 = _attend_block(cpool_ptr, base, ok, q0, q1, q2, q3, m_i, l_i, a0, a1, a2, a3,
                                                 scale, False, BF16_DOT, NATIVE_FP8)

    nv = tl.sum(nvalid, axis=0)
    pdl.release(PDL)   # the successor (the combination, or the next op) may launch
    lh = tl.arange(0, BLOCK_H)
    out_rows = out_ptr + r * stride_on + rh[:, None] * stride_oh + rc[None, :]
    sink = tl.load(sink_ptr + rh, mask=h_ok, other=0.0)
    if SPLIT == 1:
        _store_o(out_rows, a0, a1, a2, a3, l_i + tl.exp(sink - m_i), nv > 0, h_ok, DC)
    else:
        # Workspace: acc [N, HG, SPLIT, BLOCK_H, D]; ml [N, HG, SPLIT, 3, BLOCK_H] (max, sum, count).
        tile = r * HG + g
        acc_base = part_acc_ptr + tile.to(tl.int64) * (SPLIT * BLOCK_H * D)
        ml_base = part_ml_ptr + tile.to(tl.int64) * (SPLIT * 3 * BLOCK_H)
        acc_rows = acc_base + lh[:, None] * D + rc[None, :]
        mine = acc_rows + sp * (BLOCK_H * D)
        tl.store(mine, a0)
        tl.store(mine + DC, a1)
        tl.store(mine + 2 * DC, a2)
        tl.store(mine + 3 * DC, a3)
        ml_ptrs = ml_base + sp * (3 * BLOCK_H) + lh
        tl.store(ml_ptrs, m_i)
        tl.store(ml_ptrs + BLOCK_H, l_i)
        tl.store(ml_ptrs + 2 * BLOCK_H, tl.zeros((BLOCK_H,), dtype=tl.float32) + nv.to(tl.float32))
        if SEPARATE:     # `_sparse_mla_combine_kernel` combines, launched next
            return
        tl.debug_barrier()
        arrived = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT - 1:
            # the last program of (row, head group) to arrive combines the splits in split order
            tl.store(count_ptr + tile, 0)
            ml = ml_base + lh[:, None]
            m_all, n_all = _split_totals(ml, SPLIT, BLOCK_H)
            a0, l_all = _combine_chunk(acc_rows, ml, m_all, SPLIT, BLOCK_H)
            a1, _ = _combine_chunk(acc_rows + DC, ml, m_all, SPLIT, BLOCK_H)
            a2, _ = _combine_chunk(acc_rows + 2 * DC, ml, m_all, SPLIT, BLOCK_H)
            a3, _ = _combine_chunk(acc_rows + 3 * DC, ml, m_all, SPLIT, BLOCK_H)
            m_all = tl.reshape(m_all, (BLOCK_H,))
            _store_o(out_rows, a0, a1, a2, a3, tl.reshape(l_all, (BLOCK_H,)) + tl.exp(sink - m_all),
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
        f = tl.exp(tl.load(ml + s * (3 * BLOCK_H), cache_modifier=".cg") - m_all)
        l_all += tl.load(ml + s * (3 * BLOCK_H) + BLOCK_H, cache_modifier=".cg") * f
        a += tl.load(part + s * (BLOCK_H * D), cache_modifier=".cg") * f
    return a, l_all


@triton.jit
def _sparse_mla_combine_kernel(
    part_acc_ptr, part_ml_ptr, sink_ptr, out_ptr, H, HG, stride_on, stride_oh,
    SPLIT: tl.constexpr, BLOCK_H: tl.constexpr, CHUNK: tl.constexpr, PDL: tl.constexpr = False,
):
    """The splits' combination of `_sparse_mla_kernel` with SEPARATE, spread over programs: one per
    (row, head group, CHUNK-dim slice of the 512); the inline combination's arithmetic in its split
    order (the same bits). The split loops are unrolled (SPLIT is a constexpr) and every per-head
    value is a [BLOCK_H, 1] column of the accumulator's own layout, so the loads of all splits are
    independent and in flight together, with no layout exchange through shared memory between
    them (the first version looped over 128-dim chunks and the splits, one dependent L2 round trip
    and two barriers per split: 6.8 us for 20 splits at 1 row on an H200)."""
    pdl.enter(PDL)
    D: tl.constexpr = 512
    tile = tl.program_id(0)
    c = tl.program_id(1)
    r = tile // HG
    g = tile % HG
    hd = tl.arange(0, BLOCK_H)[:, None]                                       # [BLOCK_H, 1]
    rh = g * BLOCK_H + hd
    h_ok = rh < H
    dd = c * CHUNK + tl.arange(0, CHUNK)[None, :]                              # [1, CHUNK]
    # Workspace: acc [N, HG, SPLIT, BLOCK_H, D]; ml [N, HG, SPLIT, 3, BLOCK_H] (max, sum, count).
    ml = part_ml_ptr + tile.to(tl.int64) * (SPLIT * 3 * BLOCK_H) + hd
    acc = part_acc_ptr + tile.to(tl.int64) * (SPLIT * BLOCK_H * D) + hd * D + dd
    m_all, n_all = _split_totals(ml, SPLIT, BLOCK_H)
    a, l_all = _combine_chunk(acc, ml, m_all, SPLIT, BLOCK_H)
    sink = tl.load(sink_ptr + rh, mask=h_ok, other=0.0)
    d = tl.where(n_all > 0, l_all + tl.exp(sink - m_all), float("inf"))     # no valid key: o is 0
    tl.store(out_ptr + r * stride_on + rh * stride_oh + dd, bf16_rne_bits(a / d), mask=h_ok)


def combine_chunk(split: int, block_h: int) -> int:
    """Dims per program of the separate combination: every split's [block_h, chunk] FP32 slice in
    flight at once, at most 8K values (64 registers a thread at 4 warps), between 16 and 128."""
    return max(16, min(128, 8192 // (triton.next_power_of_2(split) * block_h)))


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


def sparse_mla_(plan: SparseMlaPlan, q: torch.Tensor, window_pool: torch.Tensor, comp_pool: torch.Tensor,
                window_table: torch.Tensor, comp_table: torch.Tensor, sink: torch.Tensor, scale: float,
                out: torch.Tensor) -> None:
    """Write out[r, h] = sparse_attention(q[r, h], keys of row r, sink[h], scale) (see module doc).

    plan: `SparseMlaPlan.build(max_rows, H, W, K, device)`.
    q: [N, H, 512] bfloat16 (already rotated), unit stride in the last dim, 1 <= N <= max_rows.
    window_pool: [S_w, 528] uint8 window records; comp_pool: [S_c, 288] uint8 compressed records
      (both contiguous rows; S_c may be 0 when comp_table holds only -1).
    window_table: [N, W] int32 ring slots (-1 = none); comp_table: [N, K] int32 slots (-1 = none).
      Slots are not range-checked.
    sink: [H] float32; scale: the softmax scale; out: [N, H, 512] bfloat16, unit stride in the last dim.
    """
    if not isinstance(plan, SparseMlaPlan):
        raise TypeError(f"plan must be a SparseMlaPlan, got {type(plan).__name__}")
    if not isinstance(q, torch.Tensor) or q.dim() != 3:
        raise ValueError(f"q must be a 3-D tensor [N, H, 512], got {getattr(q, 'shape', type(q).__name__)}")
    n = q.shape[0]
    if n > plan.max_rows:
        raise ValueError(f"q has {n} rows, more than the plan's max_rows={plan.max_rows}")
    dev = plan.device
    h = plan.heads
    require_tensor(q, "q", torch.bfloat16, (n, h, HEAD_DIM), dev)
    for t, name, rec in ((window_pool, "window_pool", WINDOW_KV_BYTES), (comp_pool, "comp_pool", COMPRESSED_KV_BYTES)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2:
            raise ValueError(f"{name} must be a 2-D tensor [S, {rec}], got {getattr(t, 'shape', type(t).__name__)}")
        require_tensor(t, name, torch.uint8, (t.shape[0], rec), dev)
        if t.shape[0] > 1 and t.stride(0) != rec:
            raise ValueError(f"{name} must have contiguous records (row stride {rec}), got strides {t.stride()}")
    require_tensor(window_table, "window_table", torch.int32, (n, plan.window), dev)
    require_tensor(comp_table, "comp_table", torch.int32, (n, plan.topk), dev)
    require_tensor(sink, "sink", torch.float32, (h,), dev)
    require_tensor(out, "out", torch.bfloat16, (n, h, HEAD_DIM), dev)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a float, got {type(scale).__name__}")
    if n == 0:
        return
    if q.stride(1) == 0 or out.stride(1) == 0:
        raise ValueError("q and out must not broadcast over heads")
    split = plan.split(n)
    bps = triton.cdiv(plan.n_blocks, split)
    separate = plan.separate_combine and split > 1
    o16 = out.view(torch.int16)
    _sparse_mla_kernel[(n, plan.head_groups, split)](
        q, window_pool, comp_pool, window_table, comp_table, sink, o16,
        plan.part_acc, plan.part_ml, plan.counters,
        h, float(scale), q.stride(0), q.stride(1), window_table.stride(0), max(comp_table.stride(0), 1),
        o16.stride(0), o16.stride(1),
        W=plan.window, KC=plan.topk, SPLIT=split, BLOCKS_PER_SPLIT=bps, BLOCK_H=plan.block_h,
        BLOCK_KEYS=plan.block_keys, BF16_DOT=plan.bf16_dot, NATIVE_FP8=plan.native_fp8,
        SEPARATE=separate, PDL=pdl.active(), num_warps=plan.num_warps, **pdl.launch_options(),
    )
    if separate:
        chunk = combine_chunk(split, plan.block_h)
        _sparse_mla_combine_kernel[(n * plan.head_groups, HEAD_DIM // chunk)](
            plan.part_acc, plan.part_ml, sink, o16, h, plan.head_groups, o16.stride(0), o16.stride(1),
            SPLIT=split, BLOCK_H=plan.block_h, CHUNK=chunk, PDL=pdl.active(), num_warps=4,
            **pdl.launch_options(),
        )


def sparse_mla(q: torch.Tensor, window_pool: torch.Tensor, comp_pool: torch.Tensor, window_table: torch.Tensor,
               comp_table: torch.Tensor, sink: torch.Tensor, scale: float, **plan_options) -> torch.Tensor:
    """Convenience: build a plan for these shapes, allocate out, launch; returns [N, H, 512] bfloat16."""
    if not isinstance(q, torch.Tensor) or q.dim() != 3:
        raise ValueError(f"q must be a 3-D tensor [N, H, 512], got {getattr(q, 'shape', type(q).__name__)}")
    for t, name in ((window_table, "window_table"), (comp_table, "comp_table")):
        if not isinstance(t, torch.Tensor) or t.dim() != 2:
            raise ValueError(f"{name} must be a 2-D tensor [N, width], got {getattr(t, 'shape', type(t).__name__)}")
    n = q.shape[0]
    out = torch.empty(n, q.shape[1], HEAD_DIM, dtype=torch.bfloat16, device=q.device)
    if n == 0:
        return out
    plan = SparseMlaPlan.build(n, q.shape[1], window_table.shape[1], comp_table.shape[1], q.device, **plan_options)
    sparse_mla_(plan, q, window_pool, comp_pool, window_table, comp_table, sink, scale, out)
    return out
