"""Top-k of indexer scores (indices ascending, -1 padded) and the candidate-block mask (spec section 3,
step 7), by a two-pass radix select on the scores' BF16 bits; no buffer grows with the context.

Scores are FP32 holding BF16-representable values (unchecked: only the top 16 bits are ranked, so
other values tie with their BF16 truncation). Each element gets an order-preserving 16-bit key;
-inf (and NaN, and everything past n_vis) is never selected, so a row selects
k_eff = min(k, n_elem, finite elements) of its n_elem elements. Launches, all over (row, chunk):
  1. histogram of the keys' high bytes into the plan's workspace (atomics);
  2. each program finds the high byte b1 holding the k_eff-th largest key, histograms the low
     bytes of the keys whose high byte is b1;
  3. each program finds the threshold key T and how many ties at T to take, and compacts: keys > T
     and the first `need` ties (claimed in chunk order of an atomic counter) are written;
  4. (top-k only) one program per row sorts its k_eff <= 1024 indices ascending and pads with -1.
Candidate mode ranks blocks of GROUP=8 entries by their max (the newest visible entry's block
forced to +inf) and writes the mask of the kept blocks' entries directly in step 3.
Top-k: rows of <= _SMALL_MAX columns take one launch (`_row_topk_kernel`, in-order compaction, no
sort); wider rows replace 3-4 by a count pass and an ordered write (no sort, no memset: the write
leaves the histograms zero). Candidate mode zeroes the workspace by one memset per launch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

_WS = 520 + 2 * 1024   # 256 high-byte bins, 256 low-byte bins, counters of > T and == T, padding,
                       # then (top-k, ordered path) per-chunk counts of > T and == T for up to 1024 chunks
_MAX_CHUNKS = 1024
_WS_C = tl.constexpr(_WS)
_MAXC = tl.constexpr(_MAX_CHUNKS)
_SMALL_MAX = 4096      # top-k rows of at most this many columns take the one-launch row kernel (its
                       # per-block cost, ~9 us per 4096 on the H200, loses to the multi-program path past 4K)
_SMALL_BLOCK = 4096
_SMALL_WARPS = 16


@triton.jit
def _keys(s_ptr, row_off, offs, n_vis, GROUP: tl.constexpr):
    """(16-bit order-preserving keys, selectable flags) of elements `offs` of a row."""
    if GROUP == 1:
        x = tl.load(s_ptr + row_off + offs, mask=offs < n_vis, other=float("-inf"))
    else:
        e = offs[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
        x = tl.max(tl.load(s_ptr + row_off + e, mask=e < n_vis, other=float("-inf")), 1)
        x = tl.where((offs == (n_vis - 1) // GROUP) & (n_vis > 0), float("inf"), x)
    b = (x.to(tl.int32, bitcast=True) >> 16) & 0xFFFF
    key = tl.where(b >= 0x8000, 0xFFFF - b, b | 0x8000)
    return key, x > float("-inf")


@triton.jit
def _level(h, need):
    """(bin b holding the need-th largest element of histogram h [256], count in bins above b)."""
    r = tl.arange(0, 256)
    desc = tl.sum(h, 0) - tl.cumsum(h, 0) + h
    b = tl.max(tl.where(desc >= need, r, 0), 0)
    return b, tl.sum(tl.where(r > b, h, 0), 0)


@triton.jit
def _k_eff(ws_row, n_vis, K: tl.constexpr, GROUP: tl.constexpr):
    h1 = tl.load(ws_row + tl.arange(0, 256))
    n_elem = (n_vis + GROUP - 1) // GROUP
    return tl.minimum(tl.minimum(n_elem, K), tl.sum(h1, 0)), h1


@triton.jit
def _hist_hi_kernel(s_ptr, nvis_ptr, ws_ptr, s_sn, GROUP: tl.constexpr, CHUNK: tl.constexpr):
    n = tl.program_id(0)
    n_vis = tl.load(nvis_ptr + n)
    start = tl.program_id(1) * CHUNK
    if start * GROUP < n_vis:
        key, ok = _keys(s_ptr, n.to(tl.int64) * s_sn, start + tl.arange(0, CHUNK), n_vis, GROUP)
        h = tl.histogram(key >> 8, 256, mask=ok)
        tl.atomic_add(ws_ptr + n * _WS_C + tl.arange(0, 256), h, sem="relaxed")


@triton.jit
def _hist_lo_kernel(s_ptr, nvis_ptr, ws_ptr, s_sn, K: tl.constexpr, GROUP: tl.constexpr, CHUNK: tl.constexpr):
    n = tl.program_id(0)
    n_vis = tl.load(nvis_ptr + n)
    start = tl.program_id(1) * CHUNK
    ws_row = ws_ptr + n * _WS_C
    k_eff, h1 = _k_eff(ws_row, n_vis, K, GROUP)
    if (start * GROUP < n_vis) & (k_eff > 0):
        b1, _ = _level(h1, k_eff)
        key, ok = _keys(s_ptr, n.to(tl.int64) * s_sn, start + tl.arange(0, CHUNK), n_vis, GROUP)
        h = tl.histogram(key & 0xFF, 256, mask=ok & ((key >> 8) == b1))
        tl.atomic_add(ws_row + 256 + tl.arange(0, 256), h, sem="relaxed")


@triton.jit
def _select_kernel(s_ptr, nvis_ptr, ws_ptr, out_ptr, s_sn, out_sn, max_entries,
                   K: tl.constexpr, GROUP: tl.constexpr, CHUNK: tl.constexpr, MASK_OUT: tl.constexpr):
    n = tl.program_id(0)
    n_vis = tl.load(nvis_ptr + n)
    offs = tl.program_id(1) * CHUNK + tl.arange(0, CHUNK)
    ws_row = ws_ptr + n * _WS_C
    k_eff, h1 = _k_eff(ws_row, n_vis, K, GROUP)
    b1, above1 = _level(h1, k_eff)
    h2 = tl.load(ws_row + 256 + tl.arange(0, 256))
    b2, above2 = _level(h2, k_eff - above1)
    above = above1 + above2
    need_eq = k_eff - above
    thr = b1 * 256 + b2
    key, ok = _keys(s_ptr, n.to(tl.int64) * s_sn, offs, n_vis, GROUP)
    gt = ok & (key > thr) & (k_eff > 0)
    eq = ok & (key == thr) & (k_eff > 0)
    n_gt = tl.sum(gt.to(tl.int32), 0)
    n_eq = tl.sum(eq.to(tl.int32), 0)
    base_gt = tl.atomic_add(ws_row + 512, n_gt, sem="relaxed")
    base_eq = tl.atomic_add(ws_row + 513, n_eq, sem="relaxed")
    pos_gt = base_gt + tl.cumsum(gt.to(tl.int32), 0) - 1
    pos_eq = base_eq + tl.cumsum(eq.to(tl.int32), 0) - 1
    take = eq & (pos_eq < need_eq)
    if MASK_OUT:
        sel = gt | take
        e = offs[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
        val = (sel[:, None] & (e < n_vis)).to(tl.uint8)
        tl.store(out_ptr + n.to(tl.int64) * out_sn + e, val, mask=e < max_entries)
    else:
        row = out_ptr + n.to(tl.int64) * out_sn
        tl.store(row + pos_gt, offs, mask=gt)
        tl.store(row + above + pos_eq, offs, mask=take)


@triton.jit
def _sort_kernel(nvis_ptr, ws_ptr, out_ptr, out_sn, width, K: tl.constexpr, BLOCK_K: tl.constexpr):
    n = tl.program_id(0)
    k_eff, _ = _k_eff(ws_ptr + n * _WS_C, tl.load(nvis_ptr + n), K, 1)
    r = tl.arange(0, BLOCK_K)
    row = out_ptr + n.to(tl.int64) * out_sn
    idx = tl.load(row + r, mask=r < k_eff, other=2147483647)
    idx = tl.sort(idx, 0)
    tl.store(row + r, tl.where(r < k_eff, idx, -1), mask=r < width)


@triton.jit
def _row_topk_kernel(s_ptr, nvis_ptr, out_ptr, s_sn, out_sn, width,
                     K: tl.constexpr, BLOCK: tl.constexpr, BLOCK_K: tl.constexpr):
    """One program per row does the whole top-k: two histogram passes, then an in-order compaction
    that writes the selected indices ascending (no sort), then the -1 padding."""
    n = tl.program_id(0)
    n_vis = tl.load(nvis_ptr + n)
    row_off = n.to(tl.int64) * s_sn
    r = tl.arange(0, BLOCK)
    h1 = tl.zeros([256], dtype=tl.int32)
    for start in range(0, n_vis, BLOCK):
        key, ok = _keys(s_ptr, row_off, start + r, n_vis, 1)
        h1 += tl.histogram(key >> 8, 256, mask=ok)
    k_eff = tl.minimum(tl.minimum(n_vis, K), tl.sum(h1, 0))
    b1, above1 = _level(h1, k_eff)
    h2 = tl.zeros([256], dtype=tl.int32)
    if k_eff > 0:
        for start in range(0, n_vis, BLOCK):
            key, ok = _keys(s_ptr, row_off, start + r, n_vis, 1)
            h2 += tl.histogram(key & 0xFF, 256, mask=ok & ((key >> 8) == b1))
    b2, above2 = _level(h2, k_eff - above1)
    need_eq = k_eff - above1 - above2
    thr = b1 * 256 + b2
    out_row = out_ptr + n.to(tl.int64) * out_sn
    n_sel = 0
    n_eq = 0
    if k_eff > 0:
        for start in range(0, n_vis, BLOCK):
            key, ok = _keys(s_ptr, row_off, start + r, n_vis, 1)
            eq = ok & (key == thr)
            eqi = eq.to(tl.int32)
            sel = (ok & (key > thr)) | (eq & (n_eq + tl.cumsum(eqi, 0) - 1 < need_eq))
            seli = sel.to(tl.int32)
            tl.store(out_row + n_sel + tl.cumsum(seli, 0) - 1, start + r, mask=sel)
            n_sel += tl.sum(seli, 0)
            n_eq += tl.sum(eqi, 0)
    rk = tl.arange(0, BLOCK_K)
    for p in range(0, width, BLOCK_K):
        tl.store(out_row + p + rk, tl.full([BLOCK_K], -1, tl.int32), mask=(p + rk >= k_eff) & (p + rk < width))


@triton.jit
def _count_kernel(s_ptr, nvis_ptr, ws_ptr, s_sn, K: tl.constexpr, CHUNK: tl.constexpr):
    """Per (row, chunk): counts of keys > T and == T into the workspace; program (row, 0) also
    saves (k_eff, > T total, ties to take, T) for `_write_kernel`."""
    n = tl.program_id(0)
    c = tl.program_id(1)
    n_vis = tl.load(nvis_ptr + n)
    ws_row = ws_ptr + n * _WS_C
    k_eff, h1 = _k_eff(ws_row, n_vis, K, 1)
    b1, above1 = _level(h1, k_eff)
    h2 = tl.load(ws_row + 256 + tl.arange(0, 256))
    b2, above2 = _level(h2, k_eff - above1)
    thr = b1 * 256 + b2
    key, ok = _keys(s_ptr, n.to(tl.int64) * s_sn, c * CHUNK + tl.arange(0, CHUNK), n_vis, 1)
    n_gt = tl.sum((ok & (key > thr)).to(tl.int32), 0)
    n_eq = tl.sum((ok & (key == thr)).to(tl.int32), 0)
    tl.store(ws_row + 520 + c, n_gt)
    tl.store(ws_row + 520 + _MAXC + c, n_eq)
    if c == 0:
        tl.store(ws_row + 514, k_eff)
        tl.store(ws_row + 515, above1 + above2)
        tl.store(ws_row + 516, k_eff - above1 - above2)
        tl.store(ws_row + 517, thr)


@triton.jit
def _write_kernel(s_ptr, nvis_ptr, ws_ptr, out_ptr, s_sn, out_sn, width,
                  CHUNK: tl.constexpr, BLOCK_K: tl.constexpr):
    """Per (row, chunk): writes the chunk's selected indices ascending at offsets from the counts of
    the chunks before it; program (row, 0) pads with -1 and zeroes the histograms for the next call."""
    n = tl.program_id(0)
    c = tl.program_id(1)
    n_vis = tl.load(nvis_ptr + n)
    ws_row = ws_ptr + n * _WS_C
    k_eff = tl.load(ws_row + 514)
    need_eq = tl.load(ws_row + 516)
    thr = tl.load(ws_row + 517)
    rc = tl.arange(0, _MAXC)
    before = rc < c
    base_gt = tl.sum(tl.load(ws_row + 520 + rc, mask=before, other=0), 0)
    base_eq = tl.sum(tl.load(ws_row + 520 + _MAXC + rc, mask=before, other=0), 0)
    out_row = out_ptr + n.to(tl.int64) * out_sn
    if (k_eff > 0) & (c * CHUNK < n_vis):
        offs = c * CHUNK + tl.arange(0, CHUNK)
        key, ok = _keys(s_ptr, n.to(tl.int64) * s_sn, offs, n_vis, 1)
        eq = ok & (key == thr)
        sel = (ok & (key > thr)) | (eq & (base_eq + tl.cumsum(eq.to(tl.int32), 0) - 1 < need_eq))
        pos = base_gt + tl.minimum(base_eq, need_eq) + tl.cumsum(sel.to(tl.int32), 0) - 1
        tl.store(out_row + pos, offs, mask=sel)
    if c == 0:
        rk = tl.arange(0, BLOCK_K)
        for p in range(0, width, BLOCK_K):
            tl.store(out_row + p + rk, tl.full([BLOCK_K], -1, tl.int32), mask=(p + rk >= k_eff) & (p + rk < width))
        r5 = tl.arange(0, 512)
        tl.store(ws_row + r5, tl.zeros([512], dtype=tl.int32))


@dataclass(frozen=True)
class TopKPlan:
    """Radix-select settings and the workspace they own.

    max_rows: the most rows a launch may pass; k: 512 for the top-k, 2048 for candidate blocks;
    group: 1 (top-k over entries) or 8 (candidate blocks of 8 entries); chunk: elements per program.
    ws: [max_rows, 520] int32, zeroed at each launch. Not for concurrent launches on two streams.
    """
    max_rows: int
    k: int
    group: int
    chunk: int
    ws: torch.Tensor

    @staticmethod
    def build(max_rows: int, k: int = 512, group: int = 1, device="cuda", chunk: int = 4096) -> "TopKPlan":
        if max_rows < 1:
            raise ValueError(f"max_rows must be >= 1, got {max_rows}")
        if not 1 <= k <= 4096:
            raise ValueError(f"k must lie in 1..4096, got {k}")
        if group < 1 or group & (group - 1):
            raise ValueError(f"group must be a power of two, got {group}")
        if chunk < 16 or chunk & (chunk - 1):
            raise ValueError(f"chunk must be a power of two >= 16, got {chunk}")
        return TopKPlan(max_rows, k, group, chunk, torch.zeros(max_rows, _WS, dtype=torch.int32, device=device))


def _validate(scores, n_vis, out, plan, out_dtype, out_name):
    if scores.dim() != 2 or scores.dtype != torch.float32 or scores.stride(1) != 1:
        raise ValueError(f"scores must be [N, max_entries] FP32 with a contiguous last dim, got "
                         f"{tuple(scores.shape)} {scores.dtype}")
    n_rows = scores.shape[0]
    if n_rows > plan.max_rows:
        raise ValueError(f"scores: {n_rows} rows exceed plan.max_rows={plan.max_rows}")
    if n_vis.shape != (n_rows,) or n_vis.dtype != torch.int32:
        raise ValueError(f"n_vis must be [N={n_rows}] int32, got {tuple(n_vis.shape)} {n_vis.dtype}")
    if out.dim() != 2 or out.shape[0] != n_rows or out.dtype != out_dtype or out.stride(1) != 1:
        raise ValueError(f"{out_name} must be [N={n_rows}, ...] {out_dtype}, got {tuple(out.shape)} {out.dtype}")
    if not (scores.device == n_vis.device == out.device == plan.ws.device):
        raise ValueError("scores, n_vis, out and plan.ws must share a device")


def _radix(scores, n_vis, out, plan, n_out_elems, mask_out):
    n_rows = scores.shape[0]
    plan.ws[:n_rows, :520].zero_()
    g = plan.group
    n_elem = triton.cdiv(scores.shape[1], g)
    grid = (n_rows, triton.cdiv(max(n_elem, n_out_elems), plan.chunk))
    _hist_hi_kernel[grid](scores, n_vis, plan.ws, scores.stride(0), GROUP=g, CHUNK=plan.chunk)
    _hist_lo_kernel[grid](scores, n_vis, plan.ws, scores.stride(0), K=plan.k, GROUP=g, CHUNK=plan.chunk)
    _select_kernel[grid](scores, n_vis, plan.ws, out, scores.stride(0), out.stride(0), out.shape[1],
                         K=plan.k, GROUP=g, CHUNK=plan.chunk, MASK_OUT=mask_out)


def topk_ascending_(scores: torch.Tensor, n_vis: torch.Tensor, out: torch.Tensor, plan: TopKPlan) -> torch.Tensor:
    """out[n] = indices of the min(k, n_vis[n]) largest scores[n, :n_vis[n]], ascending; entries scored
    -inf become -1; -1 padded to out's width.

    scores: [N, max_entries] FP32 (BF16-representable, unchecked); n_vis: [N] int32 (<= max_entries,
    unchecked); out: [N, k] int32 (k = plan.k); plan: TopKPlan with group 1 and max_rows >= N.
    Ties at the threshold are broken arbitrarily. Returns out.
    """
    _validate(scores, n_vis, out, plan, torch.int32, "out")
    if plan.group != 1:
        raise ValueError(f"plan: top-k needs group 1, got {plan.group}")
    if out.shape[1] != plan.k:
        raise ValueError(f"out: width {out.shape[1]} must equal plan.k={plan.k}")
    if scores.shape[0] == 0:
        return out
    n_rows, n_cols = scores.shape
    if n_cols == 0:
        out.fill_(-1)
    elif n_cols <= _SMALL_MAX:
        _row_topk_kernel[(n_rows,)](scores, n_vis, out, scores.stride(0), out.stride(0), out.shape[1],
                                    K=plan.k, BLOCK=_SMALL_BLOCK, BLOCK_K=1024, num_warps=_SMALL_WARPS)
    elif triton.cdiv(n_cols, plan.chunk) <= _MAX_CHUNKS:
        # the histograms are zero on entry (zeroed at build and by `_write_kernel`), so no memset
        grid = (n_rows, triton.cdiv(n_cols, plan.chunk))
        _hist_hi_kernel[grid](scores, n_vis, plan.ws, scores.stride(0), GROUP=1, CHUNK=plan.chunk)
        _hist_lo_kernel[grid](scores, n_vis, plan.ws, scores.stride(0), K=plan.k, GROUP=1, CHUNK=plan.chunk)
        _count_kernel[grid](scores, n_vis, plan.ws, scores.stride(0), K=plan.k, CHUNK=plan.chunk)
        _write_kernel[grid](scores, n_vis, plan.ws, out, scores.stride(0), out.stride(0), out.shape[1],
                            CHUNK=plan.chunk, BLOCK_K=1024)
    else:
        _radix(scores, n_vis, out, plan, 0, False)
        _sort_kernel[(n_rows,)](n_vis, plan.ws, out, out.stride(0), out.shape[1], K=plan.k,
                                BLOCK_K=triton.next_power_of_2(plan.k))
        plan.ws[:n_rows, :512].zero_()
    return out


def topk_ascending(scores: torch.Tensor, n_vis: torch.Tensor, k: int = 512) -> torch.Tensor:
    """Allocating form of `topk_ascending_`: int32 [N, k]."""
    plan = TopKPlan.build(max(1, scores.shape[0]), k, 1, scores.device)
    out = torch.empty(scores.shape[0], k, dtype=torch.int32, device=scores.device)
    return topk_ascending_(scores, n_vis, out, plan)


def candidate_mask_(scores: torch.Tensor, n_vis: torch.Tensor, out: torch.Tensor, plan: TopKPlan) -> torch.Tensor:
    """out[n, j] = 1 where entry j < n_vis[n] lies in one of the top min(plan.k, blocks) blocks of
    plan.group entries by block max (the newest entry's block forced in, -inf blocks never kept), else 0.

    scores: [N, max_entries] FP32 (BF16-representable, unchecked); n_vis: [N] int32 (<= max_entries,
    unchecked); out: [N, max_entries] uint8 (a bool tensor viewed as uint8 works); plan: TopKPlan
    with group 8 and k 2048 in V4.1. Returns out.
    """
    _validate(scores, n_vis, out, plan, torch.uint8, "out")
    if out.shape[1] != scores.shape[1]:
        raise ValueError(f"out: width {out.shape[1]} must equal scores' {scores.shape[1]}")
    if scores.shape[0] and scores.shape[1]:
        _radix(scores, n_vis, out, plan, 0, True)
        if plan.group == 1:   # a top-k plan: leave its histograms zero, as the top-k expects
            plan.ws[:scores.shape[0], :512].zero_()
    return out


def candidate_mask(scores: torch.Tensor, n_vis: torch.Tensor, block_size: int = 8, topk_blocks: int = 2048) -> torch.Tensor:
    """Allocating form of `candidate_mask_`: uint8 [N, max_entries]."""
    plan = TopKPlan.build(max(1, scores.shape[0]), topk_blocks, block_size, scores.device, chunk=512)
    out = torch.empty(scores.shape, dtype=torch.uint8, device=scores.device)
    return candidate_mask_(scores, n_vis, out, plan)
