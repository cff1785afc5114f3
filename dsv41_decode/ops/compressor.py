"""The ratio-2 compressor step of a KV-source layer for many requests in one launch (spec section 3).

Contract: `reference.compressor.compress_ratio2`, run on each request's rows in order, with the two
FP32 projections already computed (`kv_score` = [x @ wkv^T | x @ wgate^T]). Row p of a request
writes its kv and score into the open-group state at row p % 2; a row with (p + 1) % 2 == 0
completes the group and emits c = sum_j kv_j * softmax_j(score_j) per channel.

One program owns one request (the program of the request's first row; the others idle) and one
block of channels, so the state of a request is read and written by one program only and channel
blocks run in parallel. The state is carried in registers and written back once: a bit copy.
The softmax of two values is the reference's (max, exp of the differences, divide by their sum),
products then sum in its order, no FMA (`enable_fp_fusion=False`). Nothing is allocated or read
back to the host in `compress_ratio2_`, so it can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from .checks import interpreting, require_ndim, require_tensor

_BLOCK_C = 128


@triton.jit
def _compress_ratio2_kernel(kvs_ptr, slot_ptr, pos_ptr, skv_ptr, ssc_ptr, out_ptr, done_ptr, hist_ptr, N,
                            stride_x, stride_kv0, stride_kv1, stride_sc0, stride_sc1, stride_o,
                            stride_h0, stride_h1, H,
                            D: tl.constexpr, BLOCK_C: tl.constexpr, LIBDEVICE_EXP: tl.constexpr,
                            HISTORY: tl.constexpr, RESTORE: tl.constexpr):
    r = tl.program_id(0)
    cb = tl.program_id(1)
    c = cb * BLOCK_C + tl.arange(0, BLOCK_C)
    in_c = c < D
    s = tl.load(slot_ptr + r)
    prev = tl.load(slot_ptr + r - 1, mask=r > 0, other=-1)
    # A padding row is nobody's: it writes its own zeros.
    pad = s < 0
    tl.store(out_ptr + r.to(tl.int64) * stride_o + c, tl.zeros((BLOCK_C,), tl.float32), mask=in_c & pad)
    tl.store(done_ptr + r, 0, mask=pad & (cb == 0))

    kv_base = skv_ptr + s * stride_kv0 + c
    sc_base = ssc_ptr + s * stride_sc0 + c
    go = (s >= 0) & (prev != s)           # the first row of its request owns the request
    ld = in_c & go
    if RESTORE:
        # the open group from the history rows of the request's last two positions p0 - 1 (row a)
        # and p0 - 2 (row b), a fresh group's zeros and -inf below position 0
        p0 = tl.load(pos_ptr + r, mask=go, other=0)
        h_s = hist_ptr + s.to(tl.int64) * stride_h0 + c
        a_ok = ld & (p0 >= 1)
        b_ok = ld & (p0 >= 2)
        kva = tl.load(h_s + ((p0 + H - 1) % H) * stride_h1, mask=a_ok, other=0.0)
        sca = tl.load(h_s + ((p0 + H - 1) % H) * stride_h1 + D, mask=a_ok, other=float("-inf"))
        kvb = tl.load(h_s + ((p0 + H - 2) % H) * stride_h1, mask=b_ok, other=0.0)
        scb = tl.load(h_s + ((p0 + H - 2) % H) * stride_h1 + D, mask=b_ok, other=float("-inf"))
        a_row0 = (p0 % 2) == 1                # p0 - 1 sits in row 0 when p0 is odd
        kv0 = tl.where(a_row0, kva, kvb)
        kv1 = tl.where(a_row0, kvb, kva)
        sc0 = tl.where(a_row0, sca, scb)
        sc1 = tl.where(a_row0, scb, sca)
    else:
        kv0 = tl.load(kv_base, mask=ld, other=0.0)
        kv1 = tl.load(kv_base + stride_kv1, mask=ld, other=0.0)
        sc0 = tl.load(sc_base, mask=ld, other=0.0)
        sc1 = tl.load(sc_base + stride_sc1, mask=ld, other=0.0)
    i = r.to(tl.int64)
    while go:
        p = tl.load(pos_ptr + i)
        kv = tl.load(kvs_ptr + i * stride_x + c, mask=in_c, other=0.0)
        sc = tl.load(kvs_ptr + i * stride_x + D + c, mask=in_c, other=0.0)
        odd = (p % 2) == 1
        if HISTORY:                       # the row's inputs, bit for bit, at its ring row p % H
            h_row = hist_ptr + s.to(tl.int64) * stride_h0 + (p % H) * stride_h1 + c
            tl.store(h_row, kv, mask=in_c)
            tl.store(h_row + D, sc, mask=in_c)
        kv0 = tl.where(odd, kv0, kv)
        sc0 = tl.where(odd, sc0, sc)
        kv1 = tl.where(odd, kv, kv1)
        sc1 = tl.where(odd, sc, sc1)
        # A group completes at odd p, after row 1 is written; row 0 is the group's first row
        # (or the state's, when the request starts mid-group).
        m = tl.maximum(sc0, sc1, propagate_nan=tl.PropagateNan.ALL)
        if LIBDEVICE_EXP:
            # expf as torch's CUDA softmax evaluates it; tl.exp would be ex2.approx(x * log2 e).
            e0 = libdevice.exp(sc0 - m)
            e1 = libdevice.exp(sc1 - m)
        else:
            e0 = tl.exp(sc0 - m)
            e1 = tl.exp(sc1 - m)
        den = e0 + e1
        cval = kv0 * (e0 / den) + kv1 * (e1 / den)
        tl.store(out_ptr + i * stride_o + c, tl.where(odd, cval, 0.0), mask=in_c)
        tl.store(done_ptr + i, odd.to(tl.int32), mask=cb == 0)
        i += 1
        nxt = tl.load(slot_ptr + i, mask=i < N, other=-1)
        go = (i < N) & (nxt == s)
    tl.store(kv_base, kv0, mask=ld)
    tl.store(kv_base + stride_kv1, kv1, mask=ld)
    tl.store(sc_base, sc0, mask=ld)
    tl.store(sc_base + stride_sc1, sc1, mask=ld)


def _require_ranks(kv_score, state_kv) -> None:
    require_ndim(state_kv, "state_kv", "[R, 2, D]")
    require_ndim(kv_score, "kv_score", "[N, 2D]")


def compress_ratio2_(kv_score: torch.Tensor, req_slot: torch.Tensor, positions: torch.Tensor,
                     state_kv: torch.Tensor, state_score: torch.Tensor, out: torch.Tensor,
                     done: torch.Tensor, history: torch.Tensor | None = None, restore: bool = False) -> None:
    """out[r] = sum_j state_kv[s, j] * softmax_j(state_score[s, j]) once row r (slot s, position p,
    odd) has written state[s, p % 2] = kv_score[r, :D], kv_score[r, D:]; out[r] = 0 at even p.
    With `history` [R, H, 2D] FP32 (`DecodeState.comp_rows`), row r also stores its kv_score row
    there at [s, p % H] (what `DecodeState.accept` restores an open group from).
    restore=True (with a history of H >= 2 rows): each request's open group is read from history
    instead of from the state - row (p0 - 1) % 2 from history[s, (p0 - 1) % H] and row (p0 - 2) % 2
    from history[s, (p0 - 2) % H], p0 the request's first position, a fresh group's zeros and -inf
    for positions below 0 - and written to the state as without it. Wherever the state is current
    (every call keeps both) that is the state's own group, bit for bit; after a deferred accept
    (`DecodeState.accept(defer=True)`) it is the kept rows' group that accept left to restore.

    kv_score: [N, 2D] FP32, x @ wkv^T then x @ wgate^T (D = 512 in the model; any row stride);
    req_slot: [N] int64 request slot per row, -1 = padding (ignored: out 0, done 0);
    positions: [N] int64; state_kv, state_score: [R, 2, D] FP32 (fresh: zeros and -inf), the open
    group of each slot, updated in place as the reference does row by row (any strides but the last);
    out: [N, D] FP32 (any row stride); done: [N] int32, 1 where the row completes a group.
    Unchecked: rows of one request are consecutive and in position order, at consecutive positions
    >= 0; a slot appears in one run of rows only; 0 <= slot < R; out and done alias nothing else.
    """
    _require_ranks(kv_score, state_kv)
    n_req, _, d = state_kv.shape
    n = kv_score.shape[0]
    dev = kv_score.device
    require_tensor(kv_score, "kv_score", torch.float32, (n, 2 * d))
    require_tensor(req_slot, "req_slot", torch.int64, (n,), dev)
    require_tensor(positions, "positions", torch.int64, (n,), dev)
    require_tensor(state_kv, "state_kv", torch.float32, (n_req, 2, d), dev)
    require_tensor(state_score, "state_score", torch.float32, (n_req, 2, d), dev)
    require_tensor(out, "out", torch.float32, (n, d), dev)
    require_tensor(done, "done", torch.int32, (n,), dev)
    if history is not None:
        if require_ndim(history, "history", "[R, H >= 1, 2D]")[1] < 1:
            raise ValueError(f"history must be a 3-D tensor [R, H >= 1, 2D], got {history.shape}")
        require_tensor(history, "history", torch.float32, (n_req, history.shape[1], 2 * d), dev)
    if restore and (history is None or history.shape[1] < 2):
        raise ValueError("restore=True reads the open group from history: pass a history of H >= 2 rows "
                         f"(got {None if history is None else tuple(history.shape)})")
    if n == 0 or d == 0:
        return
    grid = (n, triton.cdiv(d, _BLOCK_C))
    # the interpreter has no libdevice: there tl.exp is NumPy's FP32 exp
    _compress_ratio2_kernel[grid](
        kv_score, req_slot, positions, state_kv, state_score, out, done,
        out if history is None else history, n,
        kv_score.stride(0), state_kv.stride(0), state_kv.stride(1), state_score.stride(0),
        state_score.stride(1), out.stride(0),
        0 if history is None else history.stride(0), 0 if history is None else history.stride(1),
        1 if history is None else history.shape[1],
        D=d, BLOCK_C=_BLOCK_C, LIBDEVICE_EXP=not interpreting(), HISTORY=history is not None, RESTORE=bool(restore),
        num_warps=1, enable_fp_fusion=False)


def compress_ratio2(kv_score: torch.Tensor, req_slot: torch.Tensor, positions: torch.Tensor,
                    state_kv: torch.Tensor, state_score: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`compress_ratio2_` into new buffers: (out [N, D] FP32, done [N] int32); the state in place."""
    _require_ranks(kv_score, state_kv)
    n, d = kv_score.shape[0], state_kv.shape[2]
    out = torch.empty((n, d), dtype=torch.float32, device=kv_score.device)
    done = torch.empty((n,), dtype=torch.int32, device=kv_score.device)
    compress_ratio2_(kv_score, req_slot, positions, state_kv, state_score, out, done)
    return out, done
