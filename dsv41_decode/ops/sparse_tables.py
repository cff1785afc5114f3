"""Sparse-index tables (issue 4 item 4): the per-row key slots that sparse MLA reads.

* `window_table_`: for each row (request slot s, position p) the global window-ring slots of
  positions p-W+1 .. p in ascending position order (ring slot s * W + q % W, `state.py`), -1 for
  positions < 0 (a window not yet full).
* `topk_slots_`: top-k compressed entry ids of each row (-1 = none) -> global compressed-cache slots
  through the request's block table: entry j -> block_table[s, j // page] * page + j % page; -1
  stays -1; lengths_out = the number of valid entries of the row.

Integer maps, bit-exact with the torch expressions in the docstrings. Everything is written into
caller-owned buffers; one launch each.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .checks import require_tensor


@triton.jit
def _window_table_kernel(slot_ptr, pos_ptr, out_ptr, stride_o, W: tl.constexpr, BLOCK_W: tl.constexpr):
    r = tl.program_id(0)
    s = tl.load(slot_ptr + r)
    p = tl.load(pos_ptr + r)
    i = tl.arange(0, BLOCK_W)
    q = p - (W - 1) + i                       # ascending positions p-W+1 .. p
    ring = s * W + q % W                      # q >= 0 where used: % is exact
    val = tl.where(q >= 0, ring, -1).to(tl.int32)
    tl.store(out_ptr + r * stride_o + i, val, mask=i < W)


@triton.jit
def _topk_slots_kernel(topk_ptr, slot_ptr, bt_ptr, out_ptr, len_ptr, stride_t, stride_bt, stride_o,
                       K, PAGE: tl.constexpr, BLOCK_K: tl.constexpr):
    r = tl.program_id(0)
    s = tl.load(slot_ptr + r)
    count = tl.zeros((BLOCK_K,), dtype=tl.int32)
    for k0 in range(0, K, BLOCK_K):
        i = k0 + tl.arange(0, BLOCK_K)
        in_k = i < K
        j = tl.load(topk_ptr + r * stride_t + i, mask=in_k, other=-1)
        ok = j >= 0
        jj = tl.where(ok, j, 0)
        page = tl.load(bt_ptr + s * stride_bt + jj // PAGE, mask=in_k & ok, other=0)
        val = tl.where(ok, page * PAGE + jj % PAGE, -1)
        tl.store(out_ptr + r * stride_o + i, val.to(tl.int32), mask=in_k)
        count += (ok & in_k).to(tl.int32)
    tl.store(len_ptr + r, tl.sum(count, axis=0))


def _require_int(v, name: str) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"{name} must be a positive int, got {v!r}")


def window_table_(req_slot: torch.Tensor, positions: torch.Tensor, window: int, out: torch.Tensor) -> None:
    """out[r, i] = req_slot[r] * window + q % window for q = positions[r] - window + 1 + i, -1 if q < 0.

    req_slot, positions: [N] int64 (positions >= 0, unchecked); window: W >= 1;
    out: [N, W] int32, unit stride in W. All on one device.
    """
    if not isinstance(req_slot, torch.Tensor) or req_slot.dim() != 1:
        raise ValueError(f"req_slot must be a 1-D tensor [N], got {getattr(req_slot, 'shape', type(req_slot).__name__)}")
    n = req_slot.shape[0]
    _require_int(window, "window")
    dev = req_slot.device
    require_tensor(req_slot, "req_slot", torch.int64, (n,))
    require_tensor(positions, "positions", torch.int64, (n,), dev)
    require_tensor(out, "out", torch.int32, (n, window), dev)
    if n == 0:
        return
    _window_table_kernel[(n,)](req_slot, positions, out, out.stride(0), W=window,
                               BLOCK_W=triton.next_power_of_2(window))


def topk_slots_(topk: torch.Tensor, req_slot: torch.Tensor, block_table: torch.Tensor, page_size: int,
                out: torch.Tensor, lengths_out: torch.Tensor) -> None:
    """out[r, k] = block_table[req_slot[r], j // page] * page + j % page for j = topk[r, k] >= 0, else -1.

    topk: [N, K] int32 entry ids (-1 = none; valid ids < P * page_size, unchecked);
    req_slot: [N] int64; block_table: [R, P] int32 (any row stride); page_size >= 1;
    out: [N, K] int32; lengths_out: [N] int32 = the number of valid entries per row.
    """
    if not isinstance(topk, torch.Tensor) or topk.dim() != 2:
        raise ValueError(f"topk must be a 2-D tensor [N, K], got {getattr(topk, 'shape', type(topk).__name__)}")
    n, k = topk.shape
    dev = topk.device
    _require_int(page_size, "page_size")
    require_tensor(topk, "topk", torch.int32, (n, k))
    require_tensor(req_slot, "req_slot", torch.int64, (n,), dev)
    if not isinstance(block_table, torch.Tensor) or block_table.dim() != 2:
        raise ValueError(f"block_table must be a 2-D tensor [R, P], got "
                         f"{getattr(block_table, 'shape', type(block_table).__name__)}")
    require_tensor(block_table, "block_table", torch.int32, tuple(block_table.shape), dev)
    require_tensor(out, "out", torch.int32, (n, k), dev)
    require_tensor(lengths_out, "lengths_out", torch.int32, (n,), dev)
    if n == 0:
        return
    if k == 0:
        lengths_out.zero_()
        return
    block_k = min(1024, triton.next_power_of_2(k))
    _topk_slots_kernel[(n,)](topk, req_slot, block_table, out, lengths_out, topk.stride(0),
                             block_table.stride(0), out.stride(0), k, PAGE=page_size, BLOCK_K=block_k)
