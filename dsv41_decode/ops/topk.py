"""Top-k of indexer scores (indices ascending, -1 padded) and the candidate-block mask (spec section 3,
step 7), by a two-pass radix select on the scores' BF16 bits; no buffer grows with the context.

Ranking. Scores are FP32 holding BF16-representable values (unchecked: only the top 16 bits are
ranked, so other values tie with their BF16 truncation), or BF16 (the same keys for the same
numbers, half the bytes read per pass). Each element gets an order-preserving
16-bit key (-0.0 keyed as +0.0: equal numbers tie); -inf, NaN and everything past n_vis are never
selected, so a row selects k_eff = min(k, n_elem, selectable elements) of its n_elem elements.

Ties (the contract's rule: at equal scores the higher index wins). With T the k_eff-th largest key,
every key > T is taken and, of the n_tie keys == T (the low-byte histogram's count at T), the
need = k_eff - #(> T) with the highest indices: the tie of rank r in index order (0-based) is taken
iff r >= skip = n_tie - need. A program knows r from the number of ties in the chunks before its
own, a per-chunk count in the workspace summed in index order, so the selection is a function of
the scores alone: the only atomics are integer histogram increments, whose totals do not depend on
the order they land in, and the linked path's counters, which decide which program finds T or
writes which chunk, never what is written.

Launches. A top-k row of <= _SMALL_MAX columns takes one program (`_row_topk_kernel`: two histogram
loops, then an in-order compaction that is ascending without a sort). A longer top-k row takes the
linked path (by default; the four-launch one below at <= _FOUR_MAX_ROWS rows of > _FOUR_MIN_COLS
columns without hist_ready, where it measured faster), three launches over (row, chunk), two when
the caller's scorer has already added the high-byte histogram into the workspace (`hist_ready`,
`key_high_histogram` says what it holds):
  1. `_hist_hi_kernel` (left out with hist_ready), as below;
  2. `_lo_select_kernel`: the low-byte histogram under b1, as `_hist_lo_kernel`; the row's last
     program to arrive (an acq_rel counter per row) finds T, need and skip, so no launch of its own;
  3. `_write_linked_kernel`: each program takes the next chunk of its row by ticket, counts its
     keys > T and == T, publishes the counts, sums those of the chunks before its own as they
     arrive (a look-back that cannot deadlock: see the kernel), and writes its selected indices at
     that offset. The scores are read once per launch: three (two) passes instead of four.
With `one_launch=True` (opt-in; the decode step's at 1-4 rows with the histogram ready, see `topk_ascending_`)
`_one_launch_kernel` does all of it in one launch whose grid fits the SMs: each program
reads its chunk once and waits, within the launch, for its row's histograms and the earlier chunks'
counts; every wait is bounded and falls back to reading the scores itself, so the output never
depends on which programs run together.
The four-launch path below stays as `separate_count=True` (the same output) and is the candidate
mask's. Four launches over (row, chunk):
  1. `_hist_hi_kernel`: histogram of the keys' high bytes (atomics into the workspace); the
     candidate mask also keeps each block's 16-bit key in the first two of its entries' bytes in
     the mask row, so the next passes read 2 bytes a block instead of its 8 scores (32
     bytes); the last pass overwrites them with the mask;
  2. `_hist_lo_kernel`: each program finds the high byte b1 holding the k_eff-th largest key and
     histograms the low bytes of the keys whose high byte is b1;
  3. `_count_kernel`: each program finds T, need and skip and counts its chunk's keys > T and == T
     into the workspace; program (row, 0) saves (k_eff, skip, T). The candidate mask needs no
     > T counts, and no == T counts when every tie is taken (skip == 0): its programs then return
     without reading the keys;
  4. `_write_kernel`: the top-k writes each chunk's selected indices at the offset given by the
     counts of the chunks before it (ascending: no sort); the candidate mask writes its chunk's
     entries (1 in a kept block, else 0). Program (row, 0) pads the top-k with -1 and zeroes the
     histograms, so a call needs no memset (the workspace is zero at build).
A row of more than _MAX_CHUNKS chunks takes chunks of the next power of two that fits.
Candidate mode ranks blocks of GROUP entries by their max, the newest visible entry's block forced
to +inf. Against the previous kernels (ties claimed through an atomic counter, in no fixed order):
the top-k has the same launches and passes over the scores; the candidate mask has one launch more
(the count, which reads only 2 bytes a block, and only when a tie is split) and no memset, and
reads the scores once instead of three times.

Workspace per row (int32, `_WS` words): the two histograms, the row's saved selection and the
linked and one-launch paths' counters, then the per-chunk counts (offsets `_WS_*` below): the
four-launch path's, which the linked path's reuse with a flag bit (cleared by its low-byte pass
for the write pass), and the one-launch path's own (flagged, left zero by its last program).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import pdl as _pdl
from .checks import require_int, require_is_tensor, require_ndim, require_num_warps
from .common import num_sms
from .sparse_tables import entry_slots, require_slot_table

_MAX_CHUNKS = 1024     # per-chunk count slots per row; wider rows take larger chunks
MAX_K = 4096           # the most entries (top-k) or blocks (candidate mask) a plan selects
WIDE_ENTRIES = 1 << 17  # the four-launch top-k's rows of more elements take TopKPlan.wide_chunk
_WS_HI = tl.constexpr(0)                      # [256] histogram of the keys' high bytes
_WS_LO = tl.constexpr(256)                    # [256] histogram of the low bytes under high byte b1
_WS_K_EFF = tl.constexpr(512)                 # elements selected: min(k, n_elem, selectable)
_WS_SKIP = tl.constexpr(513)                  # ties (keys == T) not taken: the lowest-indexed `skip`
_WS_THR = tl.constexpr(514)                   # the threshold key T
_WS_ARRIVED = tl.constexpr(515)               # linked top-k: programs of the row done with the low-byte pass
_WS_TICKET = tl.constexpr(516)                # linked top-k: chunks handed out in the write pass
_WS_ARRIVED_HI = tl.constexpr(517)            # one-launch top-k: programs done with the high-byte histogram
_WS_ARRIVED_LO = tl.constexpr(518)            # one-launch top-k: programs done with the low-byte histogram
_WS_DEPARTED = tl.constexpr(519)              # one-launch top-k: programs done
_WS_CHUNK_GT = tl.constexpr(520)              # [_MAX_CHUNKS] per chunk: keys > T (linked: | _LINKED)
_WS_CHUNK_EQ = tl.constexpr(520 + _MAX_CHUNKS)   # [_MAX_CHUNKS] per chunk: keys == T (linked: | _LINKED)
_LINKED = tl.constexpr(1 << 30)   # a linked write program's published count carries this bit (counts < 2**30)
_WS_ONE_GT = tl.constexpr(520 + 2 * _MAX_CHUNKS)   # [_MAX_CHUNKS] one-launch: keys > T | _LINKED (0 between calls)
_WS_ONE_EQ = tl.constexpr(520 + 3 * _MAX_CHUNKS)   # [_MAX_CHUNKS] one-launch: keys == T | _LINKED
_WS = 520 + 4 * _MAX_CHUNKS
_WS_C = tl.constexpr(_WS)
_MAXC = tl.constexpr(_MAX_CHUNKS)
_KEY_INF = tl.constexpr(0xFF80)   # the key of +inf (BF16 0x7F80); key 0 (a NaN's) is never selectable
_SMALL_MAX = 4096      # top-k rows of at most this many columns take the one-launch row kernel (its
                       # per-block cost, ~9 us per 4096 on the H200, loses to the multi-program path past 4K)
_SMALL_BLOCK = 4096
_CHUNK_SHIFT = 0       # a test hook, 0 in use: the linked write guesses chunk (program id + this), the
                       # one-launch programs take that chunk (tests: 1, every guess wrong, waits out of order)
_FOUR_MAX_ROWS = 4     # the default path's choice (`topk_ascending_`'s separate_count=None): the
_FOUR_MIN_COLS = 1 << 18   # four-launch path for at most this many rows of more than this many columns
_SPIN_LIMIT = 1 << 20  # polls of a wait before the waiting program computes what it waited for itself
                       # (never by design: a fallback that costs time, not a hang; tests: 0 and 1)
_SMALL_WARPS = 16


@triton.jit
def _keys(s_ptr, row_off, offs, n_vis, GROUP: tl.constexpr):
    """(16-bit order-preserving keys, selectable flags) of elements `offs` of a row (FP32 scores:
    their top 16 bits; BF16 scores: their bits, the same key for the same number)."""
    if GROUP == 1:
        x = tl.load(s_ptr + row_off + offs, mask=offs < n_vis, other=float("-inf"))
    else:
        e = offs[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
        x = tl.max(tl.load(s_ptr + row_off + e, mask=e < n_vis, other=float("-inf")), 1)
        x = tl.where((offs == (n_vis - 1) // GROUP) & (n_vis > 0), float("inf"), x)
    if x.dtype == tl.bfloat16:
        b = x.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    else:
        b = (x.to(tl.int32, bitcast=True) >> 16) & 0xFFFF
    b = tl.where(b == 0x8000, 0, b)                  # -0.0 ties with +0.0
    key = tl.where(b >= 0x8000, 0xFFFF - b, b | 0x8000)
    return key, x > float("-inf")


@triton.jit
def _stored_keys(k_row, offs, n_vis, width, GROUP: tl.constexpr):
    """(keys, selectable flags) of blocks `offs` from the keys `_hist_hi_kernel` kept in the mask
    row k_row (block b's key in bytes GROUP*b, GROUP*b + 1; 0 where not selectable). The newest
    visible block's key is +inf's, without a load (it may be the one block with no room for a key:
    a last block with one column)."""
    kb = offs * GROUP
    forced = (offs == (n_vis - 1) // GROUP) & (n_vis > 0)
    m = (kb < n_vis) & (kb + 1 < width) & ~forced
    lo = tl.load(k_row + kb, mask=m, other=0).to(tl.int32)
    hi = tl.load(k_row + kb + 1, mask=m, other=0).to(tl.int32)
    key = tl.where(forced, _KEY_INF, hi * 256 + lo)
    return key, key != 0


@triton.jit
def _chunk_keys(s_ptr, out_ptr, n, s_sn, out_sn, width, offs, n_vis, GROUP: tl.constexpr, SCRATCH: tl.constexpr):
    """Keys of elements `offs` of row n: from the scores, or (SCRATCH) from the mask row."""
    if SCRATCH:
        key, ok = _stored_keys(out_ptr + n.to(tl.int64) * out_sn, offs, n_vis, width, GROUP)
    else:
        key, ok = _keys(s_ptr, n.to(tl.int64) * s_sn, offs, n_vis, GROUP)
    return key, ok


@triton.jit
def _level(h, need):
    """(bin b holding the need-th largest element of histogram h [256], count in bins above b)."""
    r = tl.arange(0, 256)
    desc = tl.sum(h, 0) - tl.cumsum(h, 0) + h
    b = tl.max(tl.where(desc >= need, r, 0), 0)
    return b, tl.sum(tl.where(r > b, h, 0), 0)


@triton.jit
def _k_eff(ws_row, n_vis, K: tl.constexpr, GROUP: tl.constexpr):
    h1 = tl.load(ws_row + _WS_HI + tl.arange(0, 256))
    n_elem = (n_vis + GROUP - 1) // GROUP
    return tl.minimum(tl.minimum(n_elem, K), tl.sum(h1, 0)), h1


@triton.jit
def _threshold(h1, h2, k_eff):
    """(T, skip) from the two histograms: of the n_tie keys == T, the highest-indexed
    need = k_eff - #(> T) are taken, so the lowest-indexed skip = n_tie - need are left out."""
    b1, above1 = _level(h1, k_eff)
    b2, above2 = _level(h2, k_eff - above1)
    need = k_eff - above1 - above2
    n_tie = tl.sum(tl.where(tl.arange(0, 256) == b2, h2, 0), 0)
    return b1 * 256 + b2, tl.where(k_eff > 0, n_tie - need, 0)


@triton.jit
def _hist_hi_kernel(s_ptr, nvis_ptr, ws_ptr, out_ptr, s_sn, out_sn, width,
                    GROUP: tl.constexpr, CHUNK: tl.constexpr, SCRATCH: tl.constexpr, PDL: tl.constexpr = False):
    """Histogram of the keys' high bytes; with SCRATCH each block's key is also kept in the first
    two bytes of its entries in the mask row, for the later passes to read instead of the scores."""
    _pdl.enter(PDL)
    n = tl.program_id(0)
    n_vis = tl.load(nvis_ptr + n)
    start = tl.program_id(1) * CHUNK
    if start * GROUP < n_vis:
        offs = start + tl.arange(0, CHUNK)
        key, ok = _keys(s_ptr, n.to(tl.int64) * s_sn, offs, n_vis, GROUP)
        h = tl.histogram(key >> 8, 256, mask=ok)
        tl.atomic_add(ws_ptr + n * _WS_C + _WS_HI + tl.arange(0, 256), h, sem="relaxed")
        if SCRATCH:
            k_row = out_ptr + n.to(tl.int64) * out_sn
            kb = offs * GROUP
            kept = tl.where(ok, key, 0)
            m = (kb < n_vis) & (kb + 1 < width)
            tl.store(k_row + kb, (kept & 0xFF).to(tl.uint8), mask=m)
            tl.store(k_row + kb + 1, (kept >> 8).to(tl.uint8), mask=m)


@triton.jit
def _hist_lo_kernel(s_ptr, nvis_ptr, ws_ptr, out_ptr, s_sn, out_sn, width,
                    K: tl.constexpr, GROUP: tl.constexpr, CHUNK: tl.constexpr, SCRATCH: tl.constexpr):
    n = tl.program_id(0)
    n_vis = tl.load(nvis_ptr + n)
    start = tl.program_id(1) * CHUNK
    ws_row = ws_ptr + n * _WS_C
    k_eff, h1 = _k_eff(ws_row, n_vis, K, GROUP)
    if (start * GROUP < n_vis) & (k_eff > 0):
        b1, _ = _level(h1, k_eff)
        key, ok = _chunk_keys(s_ptr, out_ptr, n, s_sn, out_sn, width, start + tl.arange(0, CHUNK), n_vis,
                              GROUP, SCRATCH)
        h = tl.histogram(key & 0xFF, 256, mask=ok & ((key >> 8) == b1))
        tl.atomic_add(ws_row + _WS_LO + tl.arange(0, 256), h, sem="relaxed")


@triton.jit
def _row_topk_kernel(s_ptr, nvis_ptr, ws_ptr, out_ptr, s_sn, out_sn, width,
                     slot_ptr, bt_ptr, bt_sn, tab_ptr, tab_sn, len_ptr,
                     K: tl.constexpr, BLOCK: tl.constexpr, BLOCK_K: tl.constexpr, HIST_READY: tl.constexpr,
                     PAGE: tl.constexpr, TABLE: tl.constexpr):
    """One program per row does the whole top-k: two histogram passes (the first read from the
    workspace with HIST_READY, which it then zeroes), then an in-order compaction that writes the
    selected indices ascending (no sort), then the -1 padding; with TABLE the same for their slots
    (`_table_rows`) and the row's length."""
    n = tl.program_id(0)
    n_vis = tl.load(nvis_ptr + n)
    row_off = n.to(tl.int64) * s_sn
    r = tl.arange(0, BLOCK)
    if HIST_READY:
        h1 = tl.load(ws_ptr + n * _WS_C + _WS_HI + tl.arange(0, 256))
        tl.store(ws_ptr + n * _WS_C + _WS_HI + tl.arange(0, 256), tl.zeros([256], dtype=tl.int32))
    else:
        h1 = tl.zeros([256], dtype=tl.int32)
        for start in range(0, n_vis, BLOCK):
            key, ok = _keys(s_ptr, row_off, start + r, n_vis, 1)
            h1 += tl.histogram(key >> 8, 256, mask=ok)
    k_eff = tl.minimum(tl.minimum(n_vis, K), tl.sum(h1, 0))
    b1, _ = _level(h1, k_eff)
    h2 = tl.zeros([256], dtype=tl.int32)
    if k_eff > 0:
        for start in range(0, n_vis, BLOCK):
            key, ok = _keys(s_ptr, row_off, start + r, n_vis, 1)
            h2 += tl.histogram(key & 0xFF, 256, mask=ok & ((key >> 8) == b1))
    thr, skip = _threshold(h1, h2, k_eff)
    out_row = out_ptr + n.to(tl.int64) * out_sn
    bt_row, tab_row = _table_rows(n, out_row, slot_ptr, bt_ptr, bt_sn, tab_ptr, tab_sn, TABLE)
    n_sel = 0
    n_eq = 0
    if k_eff > 0:
        for start in range(0, n_vis, BLOCK):
            key, ok = _keys(s_ptr, row_off, start + r, n_vis, 1)
            eq = ok & (key == thr)
            eqi = eq.to(tl.int32)
            sel = (ok & (key > thr)) | (eq & (n_eq + tl.cumsum(eqi, 0) - 1 >= skip))
            seli = sel.to(tl.int32)
            pos = n_sel + tl.cumsum(seli, 0) - 1
            tl.store(out_row + pos, start + r, mask=sel)
            if TABLE:
                tl.store(tab_row + pos, entry_slots(bt_row, start + r, sel, PAGE), mask=sel)
            n_sel += tl.sum(seli, 0)
            n_eq += tl.sum(eqi, 0)
    _pad(out_row, width, k_eff, BLOCK_K)
    _table_tail(n, tab_row, len_ptr, width, k_eff, BLOCK_K, TABLE)


@triton.jit
def _count_kernel(s_ptr, nvis_ptr, ws_ptr, out_ptr, s_sn, out_sn, width, K: tl.constexpr, GROUP: tl.constexpr,
                  CHUNK: tl.constexpr, MASK_OUT: tl.constexpr, SCRATCH: tl.constexpr):
    """Per (row, chunk): counts of keys > T and == T into the workspace (the mask: only == T, and
    only when some tie is skipped); program (row, 0) also saves the row's selection for
    `_write_kernel`."""
    n = tl.program_id(0)
    c = tl.program_id(1)
    n_vis = tl.load(nvis_ptr + n)
    ws_row = ws_ptr + n * _WS_C
    k_eff, h1 = _k_eff(ws_row, n_vis, K, GROUP)
    h2 = tl.load(ws_row + _WS_LO + tl.arange(0, 256))
    thr, skip = _threshold(h1, h2, k_eff)
    if c == 0:
        tl.store(ws_row + _WS_K_EFF, k_eff)
        tl.store(ws_row + _WS_SKIP, skip)
        tl.store(ws_row + _WS_THR, thr)
    if MASK_OUT:
        if skip > 0:
            key, ok = _chunk_keys(s_ptr, out_ptr, n, s_sn, out_sn, width, c * CHUNK + tl.arange(0, CHUNK), n_vis,
                                  GROUP, SCRATCH)
            tl.store(ws_row + _WS_CHUNK_EQ + c, tl.sum((ok & (key == thr)).to(tl.int32), 0))
    else:
        key, ok = _keys(s_ptr, n.to(tl.int64) * s_sn, c * CHUNK + tl.arange(0, CHUNK), n_vis, GROUP)
        tl.store(ws_row + _WS_CHUNK_GT + c, tl.sum((ok & (key > thr)).to(tl.int32), 0))
        tl.store(ws_row + _WS_CHUNK_EQ + c, tl.sum((ok & (key == thr)).to(tl.int32), 0))


@triton.jit
def _write_kernel(s_ptr, nvis_ptr, ws_ptr, out_ptr, s_sn, out_sn, width,
                  slot_ptr, bt_ptr, bt_sn, tab_ptr, tab_sn, len_ptr, GROUP: tl.constexpr,
                  CHUNK: tl.constexpr, BLOCK_K: tl.constexpr, MASK_OUT: tl.constexpr, SCRATCH: tl.constexpr,
                  PAGE: tl.constexpr, TABLE: tl.constexpr):
    """Per (row, chunk): the chunk's selection, its ties ranked by the counts of the chunks before
    it. Top-k: the selected indices ascending, at offsets from those counts, and with TABLE their
    slots at the same offsets; program (row, 0) pads with -1 (and writes the row's length). Mask:
    every entry of the chunk's blocks < width (1 if kept and < n_vis). Program (row, 0) zeroes the
    histograms for the next call."""
    n = tl.program_id(0)
    c = tl.program_id(1)
    n_vis = tl.load(nvis_ptr + n)
    ws_row = ws_ptr + n * _WS_C
    k_eff = tl.load(ws_row + _WS_K_EFF)
    skip = tl.load(ws_row + _WS_SKIP)
    thr = tl.load(ws_row + _WS_THR)
    rc = tl.arange(0, _MAXC)
    before = rc < c
    offs = c * CHUNK + tl.arange(0, CHUNK)
    out_row = out_ptr + n.to(tl.int64) * out_sn
    if MASK_OUT:   # the tie counts exist only where skip > 0 (else every tie is kept: rank unused)
        base_eq = tl.sum(tl.load(ws_row + _WS_CHUNK_EQ + rc, mask=before & (skip > 0), other=0), 0)
        # the stores below overwrite the kept keys of this chunk's blocks only, each after its key
        # was read: a block's mask bytes depend on its own key (a data dependence orders them)
        key, ok = _chunk_keys(s_ptr, out_ptr, n, s_sn, out_sn, width, offs, n_vis, GROUP, SCRATCH)
        eq = ok & (key == thr) & (k_eff > 0)
        sel = (ok & (key > thr) & (k_eff > 0)) | (eq & (base_eq + tl.cumsum(eq.to(tl.int32), 0) - 1 >= skip))
        e = offs[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
        tl.store(out_row + e, (sel[:, None] & (e < n_vis)).to(tl.uint8), mask=e < width)
    else:
        if (k_eff > 0) & (c * CHUNK < n_vis):
            base_gt = tl.sum(tl.load(ws_row + _WS_CHUNK_GT + rc, mask=before, other=0), 0)
            base_eq = tl.sum(tl.load(ws_row + _WS_CHUNK_EQ + rc, mask=before, other=0), 0)
            key, ok = _keys(s_ptr, n.to(tl.int64) * s_sn, offs, n_vis, 1)
            eq = ok & (key == thr)
            sel = (ok & (key > thr)) | (eq & (base_eq + tl.cumsum(eq.to(tl.int32), 0) - 1 >= skip))
            pos = base_gt + tl.maximum(base_eq - skip, 0) + tl.cumsum(sel.to(tl.int32), 0) - 1
            tl.store(out_row + pos, offs, mask=sel)
            if TABLE:
                bt_row, tab_row = _table_rows(n, out_row, slot_ptr, bt_ptr, bt_sn, tab_ptr, tab_sn, TABLE)
                tl.store(tab_row + pos, entry_slots(bt_row, offs, sel, PAGE), mask=sel)
        if c == 0:
            _pad(out_row, width, k_eff, BLOCK_K)
            _, tab_row = _table_rows(n, out_row, slot_ptr, bt_ptr, bt_sn, tab_ptr, tab_sn, TABLE)
            _table_tail(n, tab_row, len_ptr, width, k_eff, BLOCK_K, TABLE)
    if c == 0:
        tl.store(ws_row + _WS_HI + tl.arange(0, 512), tl.zeros([512], dtype=tl.int32))


@triton.jit
def _look_back(s_ptr, row_off, gt_slots, eq_slots, c, n_vis, thr, CHUNK: tl.constexpr, SPIN: tl.constexpr):
    """(keys > thr, keys == thr) in chunks 0..c-1 of a row: the sums of the counts their programs
    publish in gt_slots / eq_slots (each | _LINKED once published), polled until all are there; after
    SPIN polls without them all (never by design), counted from those chunks' scores instead: the
    same numbers, so a wait that went wrong costs time and never a wrong index or a hang."""
    rc = tl.arange(0, _MAXC)
    before = rc < c
    g = tl.load(gt_slots + rc, mask=before, other=_LINKED, volatile=True)
    e = tl.load(eq_slots + rc, mask=before, other=_LINKED, volatile=True)
    polls = 0
    while (tl.min(g & e, 0) < _LINKED) & (polls < SPIN):   # both counts of every earlier chunk carry the bit
        g = tl.load(gt_slots + rc, mask=before, other=_LINKED, volatile=True)
        e = tl.load(eq_slots + rc, mask=before, other=_LINKED, volatile=True)
        polls += 1
    base_gt = tl.sum(g & (_LINKED - 1), 0)
    base_eq = tl.sum(e & (_LINKED - 1), 0)
    if tl.min(g & e, 0) < _LINKED:
        base_gt = 0
        base_eq = 0
        for cc in range(0, c):
            key, ok = _keys(s_ptr, row_off, cc * CHUNK + tl.arange(0, CHUNK), n_vis, 1)
            base_gt += tl.sum((ok & (key > thr)).to(tl.int32), 0)
            base_eq += tl.sum((ok & (key == thr)).to(tl.int32), 0)
    return base_gt, base_eq


@triton.jit
def _publish_and_write(s_ptr, row_off, gt_slots, eq_slots, c, n_vis, thr, skip, gt, eq, offs, out_row,
                       bt_row, tab_row, CHUNK: tl.constexpr, SPIN: tl.constexpr, PAGE: tl.constexpr,
                       TABLE: tl.constexpr):
    """Chunk c of a row (gt, eq: its keys > T and == T at the entries offs): publish both counts
    (with the _LINKED bit) in gt_slots[c] / eq_slots[c]; if the chunk holds any, take the counts of
    chunks 0..c-1 (`_look_back`) and write its selected indices at the offset they give (ascending;
    the ties of rank >= skip in index order), and with TABLE their slots through bt_row at the same
    offsets of tab_row (`_table_rows`). A chunk with none publishes and is done."""
    n_gt = tl.sum(gt.to(tl.int32), 0)
    n_eq = tl.sum(eq.to(tl.int32), 0)
    tl.atomic_xchg(gt_slots + c, n_gt | _LINKED, sem="relaxed", scope="gpu")
    tl.atomic_xchg(eq_slots + c, n_eq | _LINKED, sem="relaxed", scope="gpu")
    if n_gt + n_eq > 0:
        base_gt, base_eq = _look_back(s_ptr, row_off, gt_slots, eq_slots, c, n_vis, thr, CHUNK, SPIN)
        if skip == 0:                          # every tie taken: no rank among them needed
            sel = gt | eq
        else:
            sel = gt | (eq & (base_eq + tl.cumsum(eq.to(tl.int32), 0) - 1 >= skip))
        pos = base_gt + tl.maximum(base_eq - skip, 0) + tl.cumsum(sel.to(tl.int32), 0) - 1
        tl.store(out_row + pos, offs, mask=sel)
        if TABLE:
            tl.store(tab_row + pos, entry_slots(bt_row, offs, sel, PAGE), mask=sel)


@triton.jit
def _pad(out_row, width, k_eff, BLOCK_K: tl.constexpr):
    """-1 in out_row[k_eff:width] (a top-k row past its selected entries)."""
    rk = tl.arange(0, BLOCK_K)
    for p in range(0, width, BLOCK_K):
        tl.store(out_row + p + rk, tl.full([BLOCK_K], -1, tl.int32), mask=(p + rk >= k_eff) & (p + rk < width))


@triton.jit
def _table_rows(n, out_row, slot_ptr, bt_ptr, bt_sn, tab_ptr, tab_sn, TABLE: tl.constexpr):
    """(block-table row of row n's request, row n of the slot table): with TABLE, the rows the
    write pass translates its indices through and into (`topk_ascending_`'s table); else out_row
    twice, never read or written."""
    bt_row = out_row
    tab_row = out_row
    if TABLE:
        bt_row = bt_ptr + tl.load(slot_ptr + n) * bt_sn
        tab_row = tab_ptr + n.to(tl.int64) * tab_sn
    return bt_row, tab_row


@triton.jit
def _table_tail(n, tab_row, len_ptr, width, k_eff, BLOCK_K: tl.constexpr, TABLE: tl.constexpr):
    """With TABLE, what one program of row n writes of its table: -1 past the k_eff selected slots
    (where the top-k pads) and the row's length k_eff (`topk_slots_`'s count of valid entries)."""
    if TABLE:
        _pad(tab_row, width, k_eff, BLOCK_K)
        tl.store(len_ptr + n, k_eff)


@triton.jit
def _all_arrived(count_ptr, n_programs, SPIN: tl.constexpr):
    """Whether all n_programs programs have added 1 at count_ptr, polled (acquire) at most SPIN
    times; then every thread's loads after it see what they released before their arrival."""
    seen = tl.atomic_add(count_ptr, 0, sem="acquire", scope="gpu")
    polls = 0
    while (seen < n_programs) & (polls < SPIN):
        seen = tl.atomic_add(count_ptr, 0, sem="acquire", scope="gpu")
        polls += 1
    tl.debug_barrier()
    return seen >= n_programs


@triton.jit
def _lo_add(ws_row, key, under, CHUNK: tl.constexpr):
    """Add the low bytes of the keys flagged `under` into the row's low-byte histogram: one atomic
    per key when they are few (the usual case: b1 is the top-k's binade), else the chunk's
    histogram (ties); the same integer sums either way."""
    if tl.sum(under.to(tl.int32), 0) <= CHUNK // 16:
        tl.atomic_add(ws_row + _WS_LO + (key & 0xFF), 1, mask=under, sem="relaxed")
    else:
        h = tl.histogram(key & 0xFF, 256, mask=under)
        tl.atomic_add(ws_row + _WS_LO + tl.arange(0, 256), h, mask=h > 0, sem="relaxed")


@triton.jit
def _lo_select_kernel(s_ptr, nvis_ptr, ws_ptr, s_sn, K: tl.constexpr, CHUNK: tl.constexpr, PDL: tl.constexpr):
    """Linked top-k, pass 2 of 3 (after the high-byte histogram): per (row, chunk) the low-byte
    histogram under b1 (as `_hist_lo_kernel`); the row's last program to arrive finds T, need and
    skip from the two complete histograms and saves them for `_write_linked_kernel`. Each program
    also clears its chunk's two count slots and the last one the row's ticket counter, for the
    write pass that follows. Every thread's histogram atomics are ordered before thread 0's
    acq_rel arrival by the barrier (the CUTLASS semaphore pattern, as `common.splitk_reduce`); the
    last program reads the low histogram from L2 (`.cg`). The scores are loaded before the
    histogram's level is known (both loads in flight at once)."""
    _pdl.enter(PDL)
    n = tl.program_id(0)
    c = tl.program_id(1)
    n_vis = tl.load(nvis_ptr + n)
    ws_row = ws_ptr + n * _WS_C
    key, ok = _keys(s_ptr, n.to(tl.int64) * s_sn, c * CHUNK + tl.arange(0, CHUNK), n_vis, 1)
    k_eff, h1 = _k_eff(ws_row, n_vis, K, 1)
    tl.store(ws_row + _WS_CHUNK_GT + c, 0)
    tl.store(ws_row + _WS_CHUNK_EQ + c, 0)
    if (c * CHUNK < n_vis) & (k_eff > 0):
        b1, _ = _level(h1, k_eff)
        _lo_add(ws_row, key, ok & ((key >> 8) == b1), CHUNK)
    tl.debug_barrier()
    arrived = tl.atomic_add(ws_row + _WS_ARRIVED, 1, sem="acq_rel", scope="gpu")
    if arrived == tl.num_programs(1) - 1:
        tl.debug_barrier()
        h2 = tl.load(ws_row + _WS_LO + tl.arange(0, 256), cache_modifier=".cg")
        thr, skip = _threshold(h1, h2, k_eff)
        tl.store(ws_row + _WS_K_EFF, k_eff)
        tl.store(ws_row + _WS_SKIP, skip)
        tl.store(ws_row + _WS_THR, thr)
        tl.store(ws_row + _WS_ARRIVED, 0)
        tl.store(ws_row + _WS_TICKET, 0)


@triton.jit
def _write_linked_kernel(s_ptr, nvis_ptr, ws_ptr, out_ptr, s_sn, out_sn, width,
                         slot_ptr, bt_ptr, bt_sn, tab_ptr, tab_sn, len_ptr,
                         CHUNK: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr, GUESS_SHIFT: tl.constexpr,
                         SPIN: tl.constexpr, PAGE: tl.constexpr, TABLE: tl.constexpr):
    """Linked top-k, pass 3 of 3: each program takes the row's next chunk c (a ticket: chunks are
    handed out in the order programs start), counts its keys > T and == T, publishes both counts
    (with the _LINKED bit) in the chunk's slots, then waits until chunks 0..c-1 have published
    theirs, and writes its chunk's selected indices at the offset their sums give (ascending, ties
    ranked in index order as in `_write_kernel`). It cannot deadlock: a program waits only on
    chunks whose tickets were taken before its own, by programs that were already running, and a
    program publishes before it waits, so each awaited count arrives whatever the scheduler does
    (no reliance on program-id order or on the whole grid being resident); a chunk with no key
    >= T publishes and is done, without waiting. With TABLE each program also writes the slots of
    the indices it writes (`_table_rows`), at the same offsets. The ticket-0 program
    pads with -1 (with TABLE also the table, and writes the row's length k_eff) and zeroes the
    histograms for the next call. The scores of the chunk the program
    id names are loaded while the ticket is in flight (programs start about in id order, so the
    ticket usually names the same chunk); a program whose ticket names another reloads
    (GUESS_SHIFT: 0; tests shift the guess to take that path)."""
    _pdl.enter(PDL)
    n = tl.program_id(0)
    n_vis = tl.load(nvis_ptr + n)
    ws_row = ws_ptr + n * _WS_C
    c = tl.atomic_add(ws_row + _WS_TICKET, 1, sem="relaxed", scope="gpu")
    guess = (tl.program_id(1) + GUESS_SHIFT) % tl.num_programs(1)
    offs = guess * CHUNK + tl.arange(0, CHUNK)
    key, ok = _keys(s_ptr, n.to(tl.int64) * s_sn, offs, n_vis, 1)
    k_eff = tl.load(ws_row + _WS_K_EFF)
    skip = tl.load(ws_row + _WS_SKIP)
    thr = tl.load(ws_row + _WS_THR)
    out_row = out_ptr + n.to(tl.int64) * out_sn
    bt_row, tab_row = _table_rows(n, out_row, slot_ptr, bt_ptr, bt_sn, tab_ptr, tab_sn, TABLE)
    if k_eff > 0:
        if c != guess:
            offs = c * CHUNK + tl.arange(0, CHUNK)
            key, ok = _keys(s_ptr, n.to(tl.int64) * s_sn, offs, n_vis, 1)
        gt = ok & (key > thr)
        eq = ok & (key == thr)
        _publish_and_write(s_ptr, n.to(tl.int64) * s_sn, ws_row + _WS_CHUNK_GT, ws_row + _WS_CHUNK_EQ, c, n_vis,
                           thr, skip, gt, eq, offs, out_row, bt_row, tab_row, CHUNK, SPIN, PAGE, TABLE)
    if c == 0:
        _pad(out_row, width, k_eff, BLOCK_K)
        _table_tail(n, tab_row, len_ptr, width, k_eff, BLOCK_K, TABLE)
        tl.store(ws_row + _WS_HI + tl.arange(0, 512), tl.zeros([512], dtype=tl.int32))


@triton.jit
def _row_histogram(ws_row, ARRIVED: tl.constexpr, HIST: tl.constexpr, s_ptr, row_off, n_chunks, n_vis, b1,
                   LOW: tl.constexpr, CHUNK: tl.constexpr, SPIN: tl.constexpr):
    """The one-launch kernel's arrival at a histogram of the row (the program's own share already
    added): the high bytes of its keys, or (LOW) the low bytes of those whose high byte is b1. Once
    all the row's programs have arrived at ws_row[ARRIVED] (bounded wait), the row's sums from L2;
    else the program's own pass over the whole row (the same integer sums)."""
    tl.debug_barrier()
    tl.atomic_add(ws_row + ARRIVED, 1, sem="acq_rel", scope="gpu")
    if _all_arrived(ws_row + ARRIVED, n_chunks, SPIN):
        h = tl.load(ws_row + HIST + tl.arange(0, 256), cache_modifier=".cg")
    else:
        h = tl.zeros([256], dtype=tl.int32)
        for cc in range(0, n_chunks):
            k2, ok2 = _keys(s_ptr, row_off, cc * CHUNK + tl.arange(0, CHUNK), n_vis, 1)
            if LOW:
                h += tl.histogram(k2 & 0xFF, 256, mask=ok2 & ((k2 >> 8) == b1))
            else:
                h += tl.histogram(k2 >> 8, 256, mask=ok2)
    return h


@triton.jit
def _one_launch_kernel(s_ptr, nvis_ptr, ws_ptr, out_ptr, s_sn, out_sn, width, K: tl.constexpr,
                       CHUNK: tl.constexpr, BLOCK_K: tl.constexpr, HIST_READY: tl.constexpr, SPIN: tl.constexpr,
                       SHIFT: tl.constexpr):
    """The whole top-k in one launch over (row, chunk), each program's chunk of scores read once and
    kept in registers: (unless HIST_READY) the high-byte histogram, wait for the row's programs;
    the low-byte histogram under b1, wait; T and skip (every program finds the same); its counts
    published, the look-back, its indices written. The last program to finish clears the
    histograms, count slots and counters for the next call.

    The waits are bounded (SPIN polls): a program whose row's other programs have not all arrived
    by then (they were not resident: the grid should fit the GPU at once, which the launcher sees to)
    reads the whole row itself for the histogram it waited for (the same integer sums), and the
    look-back counts the earlier chunks itself (`_look_back`). So the output never depends on
    scheduling, only the time does. Arrivals follow the semaphore pattern of `_lo_select_kernel`
    (barrier, acq_rel); the histograms are read from L2 (`.cg`) after an acquire. Program p takes
    chunk (p + SHIFT) % chunks (SHIFT: a test hook, 0 in use)."""
    n = tl.program_id(0)
    n_chunks = tl.num_programs(1)
    c = (tl.program_id(1) + SHIFT) % n_chunks
    n_vis = tl.load(nvis_ptr + n)
    ws_row = ws_ptr + n * _WS_C
    row_off = n.to(tl.int64) * s_sn
    r256 = tl.arange(0, 256)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    key, ok = _keys(s_ptr, row_off, offs, n_vis, 1)
    if HIST_READY:
        h1 = tl.load(ws_row + _WS_HI + r256)
    else:
        h = tl.histogram(key >> 8, 256, mask=ok)
        tl.atomic_add(ws_row + _WS_HI + r256, h, mask=h > 0, sem="relaxed")
        h1 = _row_histogram(ws_row, _WS_ARRIVED_HI, _WS_HI, s_ptr, row_off, n_chunks, n_vis, 0, False, CHUNK,
                            SPIN)
    k_eff = tl.minimum(tl.minimum(n_vis, K), tl.sum(h1, 0))
    b1, _ = _level(h1, k_eff)
    _lo_add(ws_row, key, ok & ((key >> 8) == b1) & (k_eff > 0), CHUNK)
    h2 = _row_histogram(ws_row, _WS_ARRIVED_LO, _WS_LO, s_ptr, row_off, n_chunks, n_vis, b1, True, CHUNK, SPIN)
    thr, skip = _threshold(h1, h2, k_eff)
    out_row = out_ptr + n.to(tl.int64) * out_sn
    if k_eff > 0:
        gt = ok & (key > thr)
        eq = ok & (key == thr)
        _publish_and_write(s_ptr, row_off, ws_row + _WS_ONE_GT, ws_row + _WS_ONE_EQ, c, n_vis, thr, skip, gt, eq,
                           offs, out_row, out_row, out_row, CHUNK, SPIN, 1, False)
    if c == 0:
        _pad(out_row, width, k_eff, BLOCK_K)
    tl.debug_barrier()
    departed = tl.atomic_add(ws_row + _WS_DEPARTED, 1, sem="acq_rel", scope="gpu")
    if departed == n_chunks - 1:      # every program of the row is past its last read of the workspace
        tl.store(ws_row + _WS_HI + tl.arange(0, 512), tl.zeros([512], dtype=tl.int32))
        rc = tl.arange(0, _MAXC)
        tl.store(ws_row + _WS_ONE_GT + rc, tl.zeros([_MAXC], dtype=tl.int32), mask=rc < n_chunks)
        tl.store(ws_row + _WS_ONE_EQ + rc, tl.zeros([_MAXC], dtype=tl.int32), mask=rc < n_chunks)
        tl.store(ws_row + _WS_ARRIVED_HI, 0)
        tl.store(ws_row + _WS_ARRIVED_LO, 0)
        tl.store(ws_row + _WS_DEPARTED, 0)


@dataclass(frozen=True)
class TopKPlan:
    """Radix-select settings and the workspace they own.

    max_rows: the most rows a launch may pass; k: 512 for the top-k, 2048 for candidate blocks;
    group: 1 (top-k over entries) or 8 (candidate blocks of 8 entries); chunk: elements per program
    (more where a row would need more than _MAX_CHUNKS chunks); warps: per program at `chunk`
    (proportionally more at larger chunks, at most 16). The default chunk, 1024 with 4 warps, is the
    linked path's fastest with the histogram ready at 1-16 rows x 16K-128K entries on an H200
    (`scripts/probe_topk.py --chunks=512,1024,2048,4096 --warps=4,8`: 1 x 32K 7.7 us against 11.6 at
    4096, 1 x 128K 10.1 against 14.3, 16 x 32K 10.5 against 13.8; at 64 rows within 1.5 us of 2048's,
    the fastest there: docs/results/gpu-tests-h200.txt as of bd33dff, run R). The top-k's
    four-launch path (the default at <= 4 rows of more than 2^18 entries) takes wide_chunk elements with
    wide_warps instead for rows of more than WIDE_ENTRIES = 2^17 elements, where wide_chunk is the
    larger: over 1M entries it took 60.6 / 49.4 / 79.3 us at 1 / 2 / 4 rows in 1024-entry chunks
    (`bench attn` at 48b2e1b) against 32.7 / 40.6 / 67.3 in 4096-entry chunks at 4 warps (at
    093cb80), while the linked path (8-64 rows there) was faster in 1024-entry chunks (107 / 193 /
    369 / 713 us at 8 / 16 / 32 / 64 rows against 124 / 223 / 420 / 823), so it keeps `chunk`;
    so does `candidate_mask_` (not measured wider; its programs read `group` scores a key).
    ws: [max_rows, _WS] int32; its histograms and counters are zero between calls (zeroed at build,
    left zero by every call). Not for concurrent launches on two streams.
    """
    max_rows: int
    k: int
    group: int
    chunk: int
    ws: torch.Tensor
    warps: int = 4
    wide_chunk: int = 4096
    wide_warps: int = 4

    @staticmethod
    def build(max_rows: int, k: int = 512, group: int = 1, device="cuda", chunk: int = 1024,
              warps: int = 4, wide_chunk: int = 4096, wide_warps: int = 4) -> "TopKPlan":
        require_int(max_rows, "max_rows")
        require_int(k, "k", 1, MAX_K)
        require_int(group, "group", power_of_two=True)
        require_int(chunk, "chunk", 16, power_of_two=True)
        require_int(wide_chunk, "wide_chunk", 16, power_of_two=True)
        require_num_warps(warps, "warps")
        require_num_warps(wide_warps, "wide_warps")
        return TopKPlan(max_rows, k, group, chunk, torch.zeros(max_rows, _WS, dtype=torch.int32, device=device), warps,
                        wide_chunk, wide_warps)

    @property
    def hist_hi(self) -> torch.Tensor:
        """[max_rows, 256] int32 view of the workspace's high-byte histograms (row stride _WS): where
        a scorer adds `key_high_histogram`'s counts for `topk_ascending_(..., hist_ready=True)`."""
        return self.ws[:, _WS_HI:_WS_HI + 256]

    def launch_shape(self, n_elem: int, four_launch: bool = False) -> tuple[int, int]:
        """(elements per program, warps per program) for rows of n_elem elements: `chunk` at `warps`
        (four_launch: the top-k's four-launch path, where past WIDE_ENTRIES elements `wide_chunk` at
        `wide_warps` if that is the larger chunk; `candidate_mask_` keeps `chunk`), or
        the smallest power of two that covers the row in _MAX_CHUNKS chunks, with proportionally
        more warps (the registers per thread stay as at the base chunk: sm_90, 4 warps, 128
        registers for the write kernel at 4096; 229 at 8192, 164 with 8 warps), at most 16."""
        base, warps = self.chunk, self.warps
        if four_launch and n_elem > WIDE_ENTRIES and self.wide_chunk > self.chunk:
            base, warps = self.wide_chunk, self.wide_warps
        chunk = covering_chunk(base, n_elem)
        return chunk, min(16, warps * (chunk // base))


def covering_chunk(chunk: int, n_elem: int) -> int:
    """chunk, or the smallest power of two that covers n_elem elements in _MAX_CHUNKS chunks."""
    return max(chunk, triton.next_power_of_2(triton.cdiv(n_elem, _MAX_CHUNKS)))


def key_high_histogram(scores: torch.Tensor, n_vis: torch.Tensor) -> torch.Tensor:
    """[N, 256] int32: per row, how many of scores[n, :n_vis[n]] have each high byte of `_keys`' key
    (-0.0 as +0.0; -inf and NaN not counted), in torch: what a scorer adds into `TopKPlan.hist_hi`
    for `topk_ascending_(..., hist_ready=True)`. scores: [N, max_entries] FP32 (BF16-representable)
    or BF16; n_vis: [N] int32."""
    require_ndim(scores, "scores", "[N, max_entries]")
    require_ndim(n_vis, "n_vis", "[N]")
    if scores.dtype == torch.bfloat16:
        b = scores.view(torch.int16).to(torch.int32) & 0xFFFF
    else:                                   # the top 16 bits, as the kernels read them
        b = (scores.view(torch.int32) >> 16) & 0xFFFF
    b = torch.where(b == 0x8000, 0, b)
    key = torch.where(b >= 0x8000, 0xFFFF - b, b | 0x8000)
    cols = torch.arange(scores.shape[1], device=scores.device)
    ok = (scores > float("-inf")) & (cols[None, :] < n_vis[:, None].to(cols.dtype))
    hist = torch.zeros(scores.shape[0], 256, dtype=torch.int32, device=scores.device)
    return hist.scatter_add_(1, (key >> 8).long(), ok.to(torch.int32))


def _validate(scores, n_vis, out, plan, out_dtype, out_name):
    if not isinstance(plan, TopKPlan):
        raise TypeError(f"plan must be a TopKPlan, got {type(plan).__name__}")
    for name, t in (("scores", scores), ("n_vis", n_vis), (out_name, out)):
        require_is_tensor(t, name)
    if scores.dim() != 2 or scores.dtype not in (torch.float32, torch.bfloat16) or scores.stride(1) != 1:
        raise ValueError(f"scores must be [N, max_entries] FP32 or BF16 with a contiguous last dim, got "
                         f"{tuple(scores.shape)} {scores.dtype}")
    n_rows = scores.shape[0]
    if n_rows > plan.max_rows:
        raise ValueError(f"scores: {n_rows} rows exceed plan.max_rows={plan.max_rows}")
    if n_vis.shape != (n_rows,) or n_vis.dtype != torch.int32 or (n_rows > 1 and n_vis.stride(0) != 1):
        raise ValueError(f"n_vis must be a contiguous [N={n_rows}] int32, got {tuple(n_vis.shape)} {n_vis.dtype} "
                         f"strides {n_vis.stride()}")
    if out.dim() != 2 or out.shape[0] != n_rows or out.dtype != out_dtype or out.stride(1) != 1:
        raise ValueError(f"{out_name} must be [N={n_rows}, ...] {out_dtype}, got {tuple(out.shape)} {out.dtype}")
    for name, dev in (("n_vis", n_vis.device), (out_name, out.device), ("plan", plan.ws.device)):
        if dev != scores.device:
            raise ValueError(f"{name} is on {dev}, scores on {scores.device}")


def _table_args(table, out, n_vis):
    """The write kernels' table arguments (slot_ptr, bt_ptr, bt_sn, tab_ptr, tab_sn, len_ptr) and
    (PAGE, TABLE) for `topk_ascending_`'s table (checked), or placeholders the kernels never touch."""
    if table is None:
        return (n_vis, out, 0, out, 0, n_vis), dict(PAGE=1, TABLE=False)
    req_slot, block_table, page_size, table_out, lengths_out = table
    return ((req_slot, block_table, block_table.stride(0), table_out, table_out.stride(0), lengths_out),
            dict(PAGE=page_size, TABLE=True))


def _select(scores, n_vis, out, plan, mask_out, hist_ready=False, table=None):
    """Launches 1-4 of the module docstring over the plan's group (the top-k: group 1); the first
    left out when the high-byte histogram is ready."""
    g = 1 if not mask_out else plan.group
    n_elem = triton.cdiv(scores.shape[1], g)
    # the wide chunk is the top-k's (measured there); a mask's program reads group scores a key, so
    # its chunk stays the plan's (at group 8 a 4096-key chunk is 32K scores a program)
    chunk, warps = plan.launch_shape(n_elem, four_launch=not mask_out)
    grid = (scores.shape[0], triton.cdiv(n_elem, chunk))
    scratch = mask_out and g >= 2      # block keys kept in the mask row between the passes
    args = (scores, n_vis, plan.ws, out, scores.stride(0), out.stride(0), out.shape[1])
    if not hist_ready:
        _hist_hi_kernel[grid](*args, GROUP=g, CHUNK=chunk, SCRATCH=scratch, num_warps=warps)
    _hist_lo_kernel[grid](*args, K=plan.k, GROUP=g, CHUNK=chunk, SCRATCH=scratch, num_warps=warps)
    _count_kernel[grid](*args, K=plan.k, GROUP=g, CHUNK=chunk, MASK_OUT=mask_out, SCRATCH=scratch,
                        num_warps=warps)
    targs, tkw = _table_args(table, out, n_vis)
    _write_kernel[grid](*args, *targs, GROUP=g, CHUNK=chunk, BLOCK_K=1024, MASK_OUT=mask_out, SCRATCH=scratch,
                        num_warps=warps, **tkw)


def _select_linked(scores, n_vis, out, plan, hist_ready, pdl, table=None):
    """The linked top-k: the high-byte histogram (unless ready), `_lo_select_kernel`,
    `_write_linked_kernel`; each launched with PDL when asked (it waits for its predecessor before
    its first access)."""
    n_elem = scores.shape[1]
    chunk, warps = plan.launch_shape(n_elem)
    grid = (scores.shape[0], triton.cdiv(n_elem, chunk))
    opt = _pdl.launch_options(pdl)
    if not hist_ready:
        _hist_hi_kernel[grid](scores, n_vis, plan.ws, out, scores.stride(0), out.stride(0), out.shape[1],
                              GROUP=1, CHUNK=chunk, SCRATCH=False, PDL=pdl, num_warps=warps, **opt)
    _lo_select_kernel[grid](scores, n_vis, plan.ws, scores.stride(0), K=plan.k, CHUNK=chunk, PDL=pdl,
                            num_warps=warps, **opt)
    targs, tkw = _table_args(table, out, n_vis)
    _write_linked_kernel[grid](scores, n_vis, plan.ws, out, scores.stride(0), out.stride(0), out.shape[1], *targs,
                               CHUNK=chunk, BLOCK_K=1024, PDL=pdl, GUESS_SHIFT=_CHUNK_SHIFT, SPIN=_SPIN_LIMIT,
                               num_warps=warps, **tkw, **opt)


def _select_one_launch(scores, n_vis, out, plan, hist_ready):
    """`_one_launch_kernel` over chunks of the plan's size or larger (doubled until the grid fits
    the device's SMs, one program each, so that every program of a row is resident together); the
    linked path where that takes chunks over 4 x the plan's (registers: 4 x the warps at most)."""
    n_rows, n_elem = scores.shape
    chunk = covering_chunk(plan.chunk, n_elem)
    while n_rows * triton.cdiv(n_elem, chunk) > num_sms(scores.device):
        chunk *= 2
    if chunk > 4 * plan.chunk:
        _select_linked(scores, n_vis, out, plan, hist_ready, False)
        return
    warps = min(16, plan.warps * (chunk // plan.chunk))
    _one_launch_kernel[(n_rows, triton.cdiv(n_elem, chunk))](
        scores, n_vis, plan.ws, out, scores.stride(0), out.stride(0), out.shape[1], K=plan.k, CHUNK=chunk,
        BLOCK_K=1024, HIST_READY=hist_ready, SPIN=_SPIN_LIMIT, SHIFT=_CHUNK_SHIFT, num_warps=warps)


def topk_ascending_(scores: torch.Tensor, n_vis: torch.Tensor, out: torch.Tensor, plan: TopKPlan, *,
                    hist_ready: bool = False, separate_count: bool | None = None, pdl: bool = False,
                    one_launch: bool = False, table: tuple | None = None) -> torch.Tensor:
    """out[n] = indices of the min(k, n_vis[n]) largest scores[n, :n_vis[n]], ascending; entries scored
    -inf become -1; -1 padded to out's width. At equal scores the higher index wins (of the entries
    tied at the threshold, the highest-indexed are taken), as `reference.indexer.topk_ascending`.

    scores: [N, max_entries] FP32 (BF16-representable, unchecked) or BF16 (the same selection for the
    same numbers, half the bytes read); n_vis: [N] int32 (<= max_entries, unchecked); out: [N, k]
    int32 (k = plan.k); plan: TopKPlan with group 1 and max_rows >= N.
    hist_ready: the caller has already added each row's histogram of its keys' high bytes into
    plan.ws[n, _WS_HI:_WS_HI + 256] (the key of `_keys`: -0.0 counted as +0.0; -inf, NaN and
    entries at or past n_vis[n] not counted), in a launch before this call on the same stream; the
    histogram pass is then left out (the call zeroes the histogram as usual).
    separate_count: True: the four-launch path (count and write as separate launches, the module
    docstring's launches 1-4); False: the linked one; the same output. None (default): the
    four-launch path for at most _FOUR_MAX_ROWS rows of more than _FOUR_MIN_COLS columns without
    hist_ready, else the linked one (measured on the H200, 1-64 rows x 32K-1M: the linked path
    3-11 % faster at 16-64 rows, within 0.6 us at 1-4 rows up to 128K, slower at 1-4 rows x 1M:
    44.3 / 71.5 us against 32.7 / 67.3).
    pdl: launch the linked path's kernels with programmatic dependent launch (`ops.pdl`; sm_90 and
    not the interpreter, else an error), so each one's launch overlaps its predecessor's tail.
    one_launch: True: the whole top-k in one launch (`_one_launch_kernel`: its programs wait for
    each other within the launch) where the grid fits the SMs with chunks of at most 4 x plan.chunk
    (few rows), else the linked path; the same output. Not with separate_count or pdl; sm_90 outside
    the interpreter (which runs the programs one after another: each wait would run out). Off by
    default here; alone it is faster (H200, FP32 scores, hist_ready: 12.28 against the linked path's
    14.24 us at 1 row x 128K, 13.07 / 14.53 at 4 x 128K, 29.89 / 33.77 at 1 x 1M), and programs that
    wait for each other lose where other kernels hold SMs: the decode step takes it at 1-4 rows
    with hist_ready (`decode.attention.topk_launch`, measured there), where its programs find the
    SMs free.
    table: None, or (req_slot, block_table, page_size, table_out, lengths_out) as
    `sparse_tables.topk_slots_` takes them (req_slot [N] int64, block_table [R, P] int32,
    page_size >= 1, table_out [N, k] int32, lengths_out [N] int32): the write pass also writes
    table_out and lengths_out, bit for bit what `topk_slots_(out, req_slot, block_table, page_size,
    table_out, lengths_out)` writes after it (each written index's slot through its request's
    block-table row, -1 where out pads, each row's length = its selected count), so the sparse-index
    table costs no launch of its own. Every path but one_launch (an error with it).
    Returns out.
    """
    _validate(scores, n_vis, out, plan, torch.int32, "out")
    if plan.group != 1:
        raise ValueError(f"plan: top-k needs group 1, got {plan.group}")
    if out.shape[1] != plan.k:
        raise ValueError(f"out: width {out.shape[1]} must equal plan.k={plan.k}")
    if separate_count is None:
        separate_count = (not hist_ready and not one_launch and not pdl and scores.shape[0] <= _FOUR_MAX_ROWS
                          and scores.shape[1] > _FOUR_MIN_COLS)
    if one_launch and (separate_count or pdl):
        raise ValueError("one_launch: not with separate_count or pdl")
    if pdl and not _pdl.supported(scores.device):
        raise ValueError(f"pdl: programmatic dependent launch needs sm_90 or later outside the interpreter "
                         f"(scores on {scores.device})")
    if table is not None:
        if not isinstance(table, tuple) or len(table) != 5:
            raise TypeError("table must be None or a tuple (req_slot, block_table, page_size, table_out, "
                            f"lengths_out), got {type(table).__name__}"
                            + (f" of {len(table)}" if isinstance(table, tuple) else ""))
        if one_launch:
            raise ValueError("table: not with one_launch (its write pass has no table)")
        require_slot_table(out.shape[0], out.shape[1], out.device, *table, prefix="table: ")
    if scores.shape[0] == 0:
        return out
    n_rows, n_cols = scores.shape
    if n_cols == 0:
        out.fill_(-1)
        if table is not None:
            table[3].fill_(-1)
            table[4].zero_()
    elif n_cols <= _SMALL_MAX:
        targs, tkw = _table_args(table, out, n_vis)
        _row_topk_kernel[(n_rows,)](scores, n_vis, plan.ws, out, scores.stride(0), out.stride(0), out.shape[1],
                                    *targs, K=plan.k, BLOCK=_SMALL_BLOCK, BLOCK_K=1024, HIST_READY=hist_ready,
                                    num_warps=_SMALL_WARPS, **tkw)
    elif separate_count:
        _select(scores, n_vis, out, plan, False, hist_ready, table)
    elif one_launch:
        _select_one_launch(scores, n_vis, out, plan, hist_ready)
    else:
        _select_linked(scores, n_vis, out, plan, hist_ready, pdl, table)
    return out


def topk_ascending(scores: torch.Tensor, n_vis: torch.Tensor, k: int = 512) -> torch.Tensor:
    """Allocating form of `topk_ascending_`: int32 [N, k]."""
    require_ndim(scores, "scores", "[N, max_entries]")
    plan = TopKPlan.build(max(1, scores.shape[0]), k, 1, scores.device)
    out = torch.empty(scores.shape[0], k, dtype=torch.int32, device=scores.device)
    return topk_ascending_(scores, n_vis, out, plan)


def candidate_mask_(scores: torch.Tensor, n_vis: torch.Tensor, out: torch.Tensor, plan: TopKPlan) -> torch.Tensor:
    """out[n, j] = 1 where entry j < n_vis[n] lies in one of the top min(plan.k, blocks) blocks of
    plan.group (>= 2) entries by block max (the newest entry's block forced in, -inf blocks never kept),
    else 0. At equal block maxima the higher block wins, as `reference.indexer.candidate_mask`.

    scores: [N, max_entries] FP32 (BF16-representable, unchecked); n_vis: [N] int32 (<= max_entries,
    unchecked); out: [N, max_entries] uint8 (a bool tensor viewed as uint8 works; between the
    launches it holds the blocks' keys, so nothing may read it before the last one); plan: TopKPlan
    with group 8 and k 2048 in V4.1. Returns out.
    """
    _validate(scores, n_vis, out, plan, torch.uint8, "out")
    if plan.group < 2:
        raise ValueError(f"plan: candidate_mask_ ranks blocks of >= 2 entries, got a plan of group {plan.group} "
                         f"(the top-k's)")
    if out.shape[1] != scores.shape[1]:
        raise ValueError(f"out: width {out.shape[1]} must equal scores' {scores.shape[1]}")
    if scores.shape[0] and scores.shape[1]:
        _select(scores, n_vis, out, plan, True)
    return out


def candidate_mask(scores: torch.Tensor, n_vis: torch.Tensor, block_size: int = 8, topk_blocks: int = 2048) -> torch.Tensor:
    """Allocating form of `candidate_mask_`: uint8 [N, max_entries]; block_size: a power of two >= 2,
    topk_blocks: 1..MAX_K (the plan's group and k)."""
    require_ndim(scores, "scores", "[N, max_entries]")
    require_int(block_size, "block_size", 2, power_of_two=True)
    require_int(topk_blocks, "topk_blocks", 1, MAX_K)
    plan = TopKPlan.build(max(1, scores.shape[0]), topk_blocks, block_size, scores.device, chunk=512)
    out = torch.empty(scores.shape, dtype=torch.uint8, device=scores.device)
    return candidate_mask_(scores, n_vis, out, plan)
