"""Sparse-index tables: the per-row key slots that sparse MLA reads.

* `window_table_`: for each row (request slot s, position p) the global window-ring slots of
  positions p-W+1 .. p in ascending position order (ring slot s * M + q % M with the ring's
  M = W + max_drafts slots per request, `state.py`), -1 for positions < 0 (a window not yet full).
* `topk_slots_`: top-k compressed entry ids of each row (-1 = none) -> global compressed-cache slots
  through the request's block table: entry j -> block_table[s, j // page] * page + j % page; -1
  stays -1; lengths_out = the number of valid entries of the row.
* `records_prefetch_l2_`: the records a sparse MLA launch with a window table and a slot table will
  gather (`sparse_mla.sparse_mla_`'s arguments) asked into L2 ahead of it (sm_90); its byte spans
  are `record_spans`'s. It writes nothing.

The tables are integer maps, bit-exact with the torch expressions in the docstrings, written into
caller-owned buffers; one launch each.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..records import COMPRESSED_KV_BYTES, WINDOW_KV_BYTES
from . import pdl
from .checks import require_bool, require_int, require_ndim, require_records, require_tensor


@triton.jit
def _window_table_kernel(slot_ptr, pos_ptr, out_ptr, stride_o, M, W: tl.constexpr, BLOCK_W: tl.constexpr):
    r = tl.program_id(0)
    s = tl.load(slot_ptr + r)
    p = tl.load(pos_ptr + r)
    i = tl.arange(0, BLOCK_W)
    q = p - (W - 1) + i                       # ascending positions p-W+1 .. p
    ring = s * M + q % M                      # q >= 0 where used: % is exact
    val = tl.where(q >= 0, ring, -1).to(tl.int32)
    tl.store(out_ptr + r * stride_o + i, val, mask=i < W)


@triton.jit
def entry_slots(bt_row, j, ok, PAGE: tl.constexpr):
    """int32 global compressed-cache slots of entry ids j where ok (j >= 0 there), -1 elsewhere:
    bt_row[j // PAGE] * PAGE + j % PAGE, bt_row pointing at the request's block-table row. The map
    of `topk_slots_`, also run by the top-k's write pass (`topk.topk_ascending_`'s table)."""
    jj = tl.where(ok, j, 0)
    page = tl.load(bt_row + jj // PAGE, mask=ok, other=0)
    return tl.where(ok, page * PAGE + jj % PAGE, -1).to(tl.int32)


@triton.jit
def _topk_slots_kernel(topk_ptr, slot_ptr, bt_ptr, out_ptr, len_ptr, stride_t, stride_bt, stride_o,
                       K, PAGE: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr = False):
    pdl.enter(PDL)
    r = tl.program_id(0)
    s = tl.load(slot_ptr + r)
    count = tl.zeros((BLOCK_K,), dtype=tl.int32)
    for k0 in range(0, K, BLOCK_K):
        i = k0 + tl.arange(0, BLOCK_K)
        in_k = i < K
        j = tl.load(topk_ptr + r * stride_t + i, mask=in_k, other=-1)
        ok = j >= 0
        val = entry_slots(bt_ptr + s * stride_bt, j, in_k & ok, PAGE)
        tl.store(out_ptr + r * stride_o + i, val, mask=in_k)
        count += (ok & in_k).to(tl.int32)
    tl.store(len_ptr + r, tl.sum(count, axis=0))


def _require_ring(ring, window: int) -> None:
    if isinstance(ring, bool) or not isinstance(ring, int) or ring < window:
        raise ValueError(f"ring must be an int >= window={window} (slots per request), got {ring!r}")


def window_table_(req_slot: torch.Tensor, positions: torch.Tensor, window: int, out: torch.Tensor,
                  ring: int | None = None) -> None:
    """out[r, i] = req_slot[r] * M + q % M for q = positions[r] - window + 1 + i, -1 if q < 0.

    req_slot, positions: [N] int64 (positions >= 0, unchecked); window: W >= 1; ring: the ring's
    slots per request M >= W (`DecodeState.ring_size`; default W); out: [N, W] int32, unit stride
    in W. All on one device.
    """
    n = require_ndim(req_slot, "req_slot", "[N]")[0]
    require_int(window, "window")
    ring = window if ring is None else ring
    _require_ring(ring, window)
    dev = req_slot.device
    require_tensor(req_slot, "req_slot", torch.int64, (n,))
    require_tensor(positions, "positions", torch.int64, (n,), dev)
    require_tensor(out, "out", torch.int32, (n, window), dev)
    if n == 0:
        return
    _window_table_kernel[(n,)](req_slot, positions, out, out.stride(0), ring, W=window,
                               BLOCK_W=triton.next_power_of_2(window))


def require_slot_table(n: int, k: int, device: torch.device, req_slot, block_table, page_size, out, lengths_out,
                       prefix: str = "") -> None:
    """Check `topk_slots_`'s table arguments for N rows of K entries on `device` (errors name each
    argument, after `prefix`): req_slot [N] int64, block_table [R, P] int32, page_size >= 1,
    out [N, K] int32, lengths_out [N] int32."""
    require_int(page_size, prefix + "page_size")
    require_tensor(req_slot, prefix + "req_slot", torch.int64, (n,), device)
    require_ndim(block_table, prefix + "block_table", "[R, P]")
    require_tensor(block_table, prefix + "block_table", torch.int32, tuple(block_table.shape), device)
    require_tensor(out, prefix + "out", torch.int32, (n, k), device)
    require_tensor(lengths_out, prefix + "lengths_out", torch.int32, (n,), device)


def topk_slots_(topk: torch.Tensor, req_slot: torch.Tensor, block_table: torch.Tensor, page_size: int,
                out: torch.Tensor, lengths_out: torch.Tensor, *, release: bool = False) -> None:
    """out[r, k] = block_table[req_slot[r], j // page] * page + j % page for j = topk[r, k] >= 0, else -1.

    topk: [N, K] int32 entry ids (-1 = none; valid ids < P * page_size, unchecked);
    req_slot: [N] int64; block_table: [R, P] int32 (any row stride); page_size >= 1;
    out: [N, K] int32; lengths_out: [N] int32 = the number of valid entries per row.
    release: the kernel after this one on the stream, where launched by programmatic dependent
    launch (`gluon_sparse_mla_(pdl=True)`, which waits for this one before it reads anything), may
    launch at the programs' start; a no-op where PDL is not available. The same values.
    """
    n, k = require_ndim(topk, "topk", "[N, K]")
    require_tensor(topk, "topk", torch.int32, (n, k))
    require_slot_table(n, k, topk.device, req_slot, block_table, page_size, out, lengths_out)
    if not isinstance(release, bool):
        raise ValueError(f"release must be a bool, got {release!r}")
    if n == 0:
        return
    if k == 0:
        lengths_out.zero_()
        return
    block_k = min(1024, triton.next_power_of_2(k))
    _topk_slots_kernel[(n,)](topk, req_slot, block_table, out, lengths_out, topk.stride(0),
                             block_table.stride(0), out.stride(0), k, PAGE=page_size, BLOCK_K=block_k,
                             **pdl.kernel_options(topk.device, release=release))


@triton.jit
def record_spans(win_table, comp_table, r, j, stride_w, stride_c, W: tl.constexpr, KC: tl.constexpr,
                 WREC: tl.constexpr, CREC: tl.constexpr):
    """(in_window, byte offset, bytes) of row r's joined-list entries j (the window's W slots, then
    the KC compressed slots): entry j < W is window_pool's record win_table[r, j] (offset slot *
    WREC), W <= j < W + KC comp_pool's comp_table[r, j - W] (slot * CREC); bytes 0 for a -1 slot or
    past the list. The spans a sparse MLA launch with these tables reads (`records_prefetch_l2_`)."""
    in_w = j < W
    slot = tl.load(win_table + r * stride_w + j, mask=in_w, other=-1)
    off = slot.to(tl.int64) * WREC
    size = tl.where(slot >= 0, WREC, 0)
    if KC > 0:
        in_c = (j >= W) & (j < W + KC)
        cslot = tl.load(comp_table + r * stride_c + (j - W), mask=in_c, other=-1)
        off = tl.where(in_w, off, cslot.to(tl.int64) * CREC)
        size = tl.where(in_w, size, tl.where(cslot >= 0, CREC, 0))
    return in_w, off, size


@triton.jit
def _records_prefetch_kernel(win_pool, win_table, comp_pool, comp_table, stride_w, stride_c,
                             W: tl.constexpr, KC: tl.constexpr, WREC: tl.constexpr, CREC: tl.constexpr,
                             LANES: tl.constexpr, LAST: tl.constexpr):
    # program (r, c): lane i asks L2 for the record of row r's joined-list entry c * LANES + i, one
    # bulk prefetch a record, none for a -1 slot
    r = tl.program_id(0)
    j = tl.program_id(1) * LANES + tl.arange(0, LANES)
    in_w, off, size = record_spans(win_table, comp_table, r, j, stride_w, stride_c, W, KC, WREC, CREC)
    base = tl.where(in_w, win_pool.to(tl.pointer_type(tl.uint8)).to(tl.int64),
                    comp_pool.to(tl.pointer_type(tl.uint8)).to(tl.int64))
    addr = base + off
    pdl.bulk_prefetch_l2(addr, size.to(tl.int32), LAST)


RECORDS_PREFETCH_LANES = 32     # records a one-warp program asks for


def records_prefetch_l2_(window_pool: torch.Tensor, window_table: torch.Tensor,
                         comp_pool: torch.Tensor | None = None, comp_table: torch.Tensor | None = None, *,
                         evict_last: bool = True) -> None:
    """Ask L2 for the records that `sparse_mla.sparse_mla_` (or the Gluon kernel) with these pools
    and tables will gather: row r's window records window_pool[window_table[r, i]] and, given,
    its compressed records comp_pool[comp_table[r, k]] (-1 slots: none), one bulk prefetch a
    record (`cp.async.bulk.prefetch.L2`, 528 and 288 bytes; `record_spans`) at L2's evict_last
    priority (`pdl.bulk_prefetch_l2(EVICT_LAST=True)`: meant to keep them while a weight streamed
    through L2 in between is evicted first; the step at 1 row 1.2-1.6 % faster than at the normal
    priority, H100, docs/step.md), with evict_last=False at the normal one (`pdl.bulk_prefetch_l2`).
    Reads the tables, writes nothing; the MLA's values do not depend on it (a schedule aid:
    `DecodeStep(prefetch_records=)`).

    window_pool: [S_w, 528] uint8, contiguous records; window_table: [N, W] int32; comp_pool:
    [S_c, 288] uint8 and comp_table: [N, K] int32, both or neither; the slots' range is not checked
    (as the MLA's). On one CUDA device of compute capability 9.0 or later, outside the interpreter
    (inline PTX), else ValueError naming `window_pool`.
    """
    require_records(window_pool, "window_pool", WINDOW_KV_BYTES)
    dev = window_pool.device
    n, w = require_ndim(window_table, "window_table", "[N, W]")
    if (comp_pool is None) != (comp_table is None):
        raise ValueError("comp_pool and comp_table must be given together")
    if comp_pool is not None:
        require_records(comp_pool, "comp_pool", COMPRESSED_KV_BYTES, dev)
    require_tensor(window_table, "window_table", torch.int32, (n, w), dev)
    require_bool(evict_last, "evict_last")
    k = 0
    if comp_table is not None:
        k = require_ndim(comp_table, "comp_table", "[N, K]")[1]
        require_tensor(comp_table, "comp_table", torch.int32, (n, k), dev)
    if not pdl.supported(dev):
        raise ValueError(f"window_pool: the records' bulk prefetch needs a CUDA device of compute capability 9.0 "
                         f"or later outside the interpreter, got {dev}")
    if n == 0 or w + k == 0:
        return
    ct = window_table if comp_table is None else comp_table
    cp = window_pool if comp_pool is None else comp_pool
    lanes = RECORDS_PREFETCH_LANES
    _records_prefetch_kernel[(n, triton.cdiv(w + k, lanes))](
        window_pool, window_table, cp, ct, window_table.stride(0), ct.stride(0), W=w, KC=k, WREC=WINDOW_KV_BYTES,
        CREC=COMPRESSED_KV_BYTES, LANES=lanes, LAST=evict_last,
        num_warps=1)


@triton.jit
def _ratio_rows(pos, slot, live, r, bt_ptr, stride_bt, cols, nvis_ptr, entry_ptr, PAGE: tl.constexpr):
    q = pos + 1
    tl.store(nvis_ptr, tl.maximum(q // r, 0).to(tl.int32))
    e = tl.maximum(q // r - 1, 0)
    col = tl.minimum(e // PAGE, cols - 1)
    pg = tl.load(bt_ptr + tl.maximum(slot, 0) * stride_bt + col).to(tl.int64)
    done = live & (q > 0) & (q % r == 0) & (pg >= 0)
    tl.store(entry_ptr, tl.where(done, pg * PAGE + e % PAGE, -1))


@triton.jit
def _step_rows_kernel(rec_ptr, stride_rec, wt_ptr, stride_wt, stage_ptr, ring_ptr, kslot_ptr,
                      bt1_ptr, stride_bt1, cols1, r1, bt2_ptr, stride_bt2, cols2, r2, nvis_ptr, entry_ptr, stride_nr,
                      stage_base, M, W: tl.constexpr, BLOCK_W: tl.constexpr, PAGE: tl.constexpr, NR: tl.constexpr,
                      off_ptr=None, freq_ptr=None, ang_ptr=None, stride_ak=None, K: tl.constexpr = 0,
                      HALF: tl.constexpr = 1):
    i = tl.program_id(0)
    slot = tl.load(rec_ptr + i)
    pos = tl.load(rec_ptr + stride_rec + i)
    start = tl.load(rec_ptr + 2 * stride_rec + i)
    first = tl.load(rec_ptr + 3 * stride_rec + i)
    last = tl.load(rec_ptr + 4 * stride_rec + i)
    live = slot >= 0
    k = tl.arange(0, BLOCK_W)
    q = pos - (W - 1) + k                                   # ascending positions p-W+1 .. p
    ring = slot * M + (q % M + M) % M                        # floor modulo (q < 0 is masked below)
    stage = stage_base + first + (q - start)
    val = tl.where(q >= start, stage, ring)
    tl.store(wt_ptr + i * stride_wt + k, tl.where(q >= 0, val, -1).to(tl.int32), mask=k < W)
    tl.store(stage_ptr + i, tl.where(live, stage_base + i, -1))
    keep = live & (pos > last - M)                          # no later row of the request takes the slot
    tl.store(ring_ptr + i, tl.where(keep, slot * M + (pos % M + M) % M, stage_base + i))
    tl.store(kslot_ptr + i, tl.maximum(slot, 0))
    if NR >= 1:
        _ratio_rows(pos, slot, live, r1, bt1_ptr, stride_bt1, cols1, nvis_ptr + i, entry_ptr + i, PAGE)
    if NR >= 2:
        _ratio_rows(pos, slot, live, r2, bt2_ptr, stride_bt2, cols2, nvis_ptr + stride_nr + i,
                    entry_ptr + stride_nr + i, PAGE)
    if K > 0:
        # the RoPE angles of the row's K uses: FP32(max(pos + offset, 0)) * freqs (the conversion
        # rounds to nearest, the product once: torch's cast and multiply)
        h = tl.arange(0, HALF)
        for u in tl.static_range(K):
            p = tl.maximum(pos + tl.load(off_ptr + u), 0).to(tl.float32)
            tl.store(ang_ptr + u * stride_ak + i * HALF + h, p * tl.load(freq_ptr + u * HALF + h))


def step_rows_(record: torch.Tensor, window: int, stage_base: int, block_tables: list[tuple[int, torch.Tensor]],
               page_size: int, window_table: torch.Tensor, stage_slot: torch.Tensor, ring_dst: torch.Tensor,
               kernel_slot: torch.Tensor, n_vis: torch.Tensor, entry_slot: torch.Tensor,
               ring: int | None = None,
               rope: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> None:
    """A decode step's per-row tables from its rows' record, one launch (`decode.tables.StepMeta`).

    record: int64 [5, N] rows (request slot or -1 for padding, position or -1, the request's first
      position in the step, its first row, its last position), any row stride.
    window: W; stage_base: the first staging row of the window pools; ring: M, the ring slots per
      request (`DecodeState.ring_size`, >= W; default W); stage_base >= 0.
    block_tables: a list or tuple of up to two (ratio, int32 [R, P] block table); page_size: entries
      per page.
    Writes, for the N rows: window_table [N, W] int32 (positions p-W+1..p: staged rows
      `stage_base + first + (q - start)` for q >= start, ring slots `slot*M + q % M` below, -1 for
      q < 0); stage_slot [N] int64 (`stage_base + row`, -1 for padding); ring_dst [N] int64 (the
      row's ring slot, or its own staging row for padding and for rows a later row of the request
      replaces: p <= last - M); kernel_slot [N] int64 (slot, 0 for padding); per ratio k: n_vis[k] int32
      ((p + 1) // r, 0 for padding) and entry_slot[k] int64 (the global slot of the entry the row
      completes, -1 if none or its page is unallocated). n_vis, entry_slot: [len(block_tables), >= N].
    rope: optionally (offsets int64 [K], freqs FP32 [K, half], angles FP32 [K, >= N, half] with unit
      strides but along K): angles[u, i] = FP32(max(position_i + offsets[u], 0)) * freqs[u] for the N
      rows (padding rows: position -1), torch's cast and product (the RoPE rotations' angles,
      `decode.tables.StepMeta`; half a power of two).
    """
    if require_ndim(record, "record", "[5, N]")[0] != 5:
        raise ValueError(f"record must be a [5, N] tensor, got {record.shape}")
    n, dev = record.shape[1], record.device
    require_int(window, "window")
    require_int(page_size, "page_size")
    ring = window if ring is None else ring
    _require_ring(ring, window)
    require_int(stage_base, "stage_base", 0)
    if not isinstance(block_tables, (list, tuple)):
        raise TypeError(f"block_tables must be a list of (ratio, block table) pairs, got "
                        f"{type(block_tables).__name__}")
    if len(block_tables) > 2:
        raise ValueError(f"block_tables: at most two ratios, got {len(block_tables)}")
    for entry in block_tables:
        if not isinstance(entry, (list, tuple)) or len(entry) != 2:
            size = f" of {len(entry)}" if isinstance(entry, (list, tuple)) else ""
            raise ValueError(f"block_tables: each entry must be a (ratio, block table) pair, got a "
                             f"{type(entry).__name__}{size}")
    require_tensor(record, "record", torch.int64, (5, n), dev)
    require_tensor(window_table, "window_table", torch.int32, (n, window), dev)
    for t, name in ((stage_slot, "stage_slot"), (ring_dst, "ring_dst"), (kernel_slot, "kernel_slot")):
        require_tensor(t, name, torch.int64, (n,), dev)
    nr = len(block_tables)
    require_tensor(n_vis, "n_vis", torch.int32, (nr, None), dev)
    require_tensor(entry_slot, "entry_slot", torch.int64, (nr, None), dev)
    if nr and (n_vis.shape[1] < n or entry_slot.shape[1] < n or n_vis.stride(0) != entry_slot.stride(0)):
        raise ValueError("n_vis and entry_slot must hold N rows per ratio with the same row stride")
    for r, bt in block_tables:
        require_int(r, "ratio")
        if not isinstance(bt, torch.Tensor) or bt.dim() != 2 or bt.shape[1] == 0:
            raise ValueError(f"block table of ratio {r} must be a 2-D int32 tensor with at least one column")
        require_tensor(bt, f"block table of ratio {r}", torch.int32, tuple(bt.shape), dev)
    angles = {}
    if rope is not None:
        offsets, freqs, ang = rope
        k = require_ndim(offsets, "rope offsets", "[K]")[0]
        require_tensor(offsets, "rope offsets", torch.int64, (k,), dev)
        half = require_ndim(freqs, "rope freqs", "[K, half]")[1]
        require_tensor(freqs, "rope freqs", torch.float32, (k, half), dev)
        require_tensor(ang, "rope angles", torch.float32, (k, None, half), dev)
        if half & (half - 1) or ang.shape[1] < n or freqs.stride(1) != 1 or freqs.stride(0) != half \
                or ang.stride(2) != 1 or ang.stride(1) != half:
            raise ValueError(f"rope: freqs [K, half] and angles [K, >= {n}, half] need half a power of two and unit "
                             f"strides but along K")
        angles = dict(off_ptr=offsets, freq_ptr=freqs, ang_ptr=ang, stride_ak=ang.stride(0), K=k, HALF=half)
    if n == 0:
        return
    bts = list(block_tables) + [(1, window_table)] * (2 - nr)    # unused slots: any int32 tensor
    (r1, bt1), (r2, bt2) = bts
    _step_rows_kernel[(n,)](
        record, record.stride(0), window_table, window_table.stride(0), stage_slot, ring_dst, kernel_slot,
        bt1, bt1.stride(0), bt1.shape[1], r1, bt2, bt2.stride(0), bt2.shape[1], r2,
        n_vis, entry_slot, n_vis.stride(0) if nr else 0, stage_base, ring,
        W=window, BLOCK_W=triton.next_power_of_2(window), PAGE=page_size, NR=nr, **angles)
