"""Cache-record writers of one decode step (spec section 3 steps 2-6, section 5 RoPE, section 6 records).

- `qkv_rope_insert_`: query RoPE in place and window-KV RoPE + MXFP8 + insert of the 528-byte
  record into the window ring, one launch (`query_rope_`: the query half alone; `window_insert`:
  the window half as a jit function, which `ops.rms_norm.rms_norm_pair_` also runs on the kv row it
  has just normalized; `rope_tile`: the query half on a GEMM's output tile, the epilogue of
  `ops.low_latency_mm`);
- `compressed_kv_store_` / `index_key_store_` / `compressed_entry_store_`: RoPE at each group's
  first position + NVFP4 (288-byte record) and k_norm + RoPE + MXFP4 (68-byte index key), each
  alone or both in one launch (`compressed_record` / `index_key_record`: each record as a jit
  function, which `ops.compressor_tail` also runs after the latent's norm and wk projection).

Bit-exact, by default (requant=False: the values quantized once, what `DecodeState` stores and
what the spec's "real codes" are), with `records.pack_window_kv(rope_tail(kv))`,
`reference.rope.rope_tail` (queries), `records.pack_compressed_kv(rope_tail(lat))` and
`records.pack_index_key(compressor.index_key_rotated(...))`; requant=True packs the fake-quantized
values again (the same decoded values for MXFP8/MXFP4, not always for NVFP4), kept for comparison.
On the GPU and in Triton's interpreter (see the note on k_norm in `index_key_store_`). RoPE rotates the adjacent pairs (2i, 2i+1) of the 64-dim tail like torch's
complex multiply: real = a*c - b*s, imag = a*s + b*c, every product and sum rounded to FP32 (the
kernels are compiled with `enable_fp_fusion=False`, so no FMA contraction), then rounded to BF16.

Every kernel keeps a vector's even and odd elements apart ([blocks, block/2] each): RoPE works on
the pairs, a scale block is the maximum over both halves, and E2M1 nibbles pack as even | odd << 4.

Slots: `slots[r]` is the record row to write; a slot outside [0, S) (e.g. -1 for a padding row, or
for a row whose ring slot a later row of the same request overwrites in the same call) writes
nothing. Two rows given the same valid slot race: the caller must not do that.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..records import COMPRESSED_KV_BYTES, INDEX_KEY_BYTES, WINDOW_KV_BYTES
from . import pdl
from .checks import require_is_tensor, require_ndim, require_tensor
from .fp4 import bf16_round, mx_dequant_pairs, mx_quant_pairs, nvfp4_dequant_pairs, nvfp4_quant_pairs
from .rounding import bf16_rne_bits, bf16_widen, to_f32

DIM = 512          # head_dim (window and compressed KV, queries)
ROPE_DIM = 64      # the rotated tail
INDEX_DIM = 128    # index_head_dim
_HALF_ROPE = ROPE_DIM // 2


@triton.jit
def rope_rotate(xe, xo, c, s, ASM: tl.constexpr = False):
    """The rotation of spec section 5 in FP32, before the BF16 rounding: (re, im) = (xe c - xo s,
    xe s + xo c), each product and sum rounded to FP32 as torch's complex multiply does. ASM=False:
    plain operations, for launches with enable_fp_fusion=False (no FMA contraction) and the
    interpreter (which never contracts); ASM=True (GPU only): inline PTX mul.rn / sub.rn / add.rn,
    which ptxas never contracts, for kernels compiled with fp fusion on (the GEMM epilogue of
    `ops.low_latency_mm`). The one Triton home of the formula; the Gluon GEMM's epilogue
    (`ops.gluon_epilogues.rope_tile`) writes the same roundings with libdevice's _rn operations (launched
    without reflect-FTZ, so that they keep subnormals as these do)."""
    if ASM:
        re = tl.inline_asm_elementwise(
            "{ .reg .f32 a, b; mul.rn.f32 a, $1, $3; mul.rn.f32 b, $2, $4; sub.rn.f32 $0, a, b; }",
            "=f,f,f,f,f", [xe, xo, c, s], dtype=tl.float32, is_pure=True, pack=1)
        im = tl.inline_asm_elementwise(
            "{ .reg .f32 a, b; mul.rn.f32 a, $1, $4; mul.rn.f32 b, $2, $3; add.rn.f32 $0, a, b; }",
            "=f,f,f,f,f", [xe, xo, c, s], dtype=tl.float32, is_pure=True, pack=1)
        return re, im
    else:
        return xe * c - xo * s, xe * s + xo * c


@triton.jit
def rope_tile(yb, off_n, rm, M, cos_ptr, sin_ptr, stride_cm, stride_sm, BLOCK_N: tl.constexpr,
              BLOCK_M: tl.constexpr, ASM: tl.constexpr):
    """The query RoPE of a GEMM's output tile: yb [BLOCK_N, BLOCK_M] FP32 holding the BF16 outputs
    of columns off_n + n and rows rm; for every column c with c % 512 >= 448 (a head's channels
    448..511) the pair (c, c + 1) = (2i, 2i + 1) of the tail is rotated by row m's cos/sin[m, i]
    (`rope_rotate`, then BF16), as `query_rope_` does on the stored tile. Other columns and rows
    at or past M pass unchanged. Returns the tile [BLOCK_N, BLOCK_M], FP32 holding BF16 values."""
    e, o = tl.split(tl.reshape(tl.trans(yb), (BLOCK_M, BLOCK_N // 2, 2)))
    col = (off_n + 2 * tl.arange(0, BLOCK_N // 2)) % 512
    re, im = rope_rows(e, o, col, rm, M, cos_ptr, sin_ptr, stride_cm, stride_sm, 448, ASM)
    return tl.trans(tl.reshape(tl.join(re, im), (BLOCK_M, BLOCK_N)))


@triton.jit
def rope_rows(e, o, col, rm, M, cos_ptr, sin_ptr, stride_cm, stride_sm, FIRST: tl.constexpr, ASM: tl.constexpr):
    """The pairs (e, o) [rows, P] (FP32 holding BF16 values) of head channels (col, col + 1) (col
    [P], even, the channel within the head) of rows rm rotated where col >= FIRST by row m's
    cos/sin[m, (col - FIRST) / 2] (`rope_rotate`, then BF16); other pairs, and rows at or past M,
    pass unchanged. The tile RoPE of the GEMM epilogues (`rope_tile`, the index query's
    `index_query.index_query_tile`)."""
    rot = (col >= FIRST)[None, :] & (rm < M)[:, None]
    i = tl.maximum(col - FIRST, 0) // 2
    c = tl.load(cos_ptr + rm[:, None] * stride_cm + i[None, :], mask=rot, other=1.0)
    s = tl.load(sin_ptr + rm[:, None] * stride_sm + i[None, :], mask=rot, other=0.0)
    re, im = rope_rotate(e, o, c, s, ASM)
    return tl.where(rot, bf16_round(re), e), tl.where(rot, bf16_round(im), o)


@triton.jit
def rope_pairs(xe, xo, cs_ptr_row, sn_ptr_row, j, FIRST: tl.constexpr):
    """(even, odd) of pairs j rotated by cos/sin[j - FIRST] where j >= FIRST, rounded to BF16 (as
    FP32); other pairs unchanged. xe, xo: FP32 holding BF16 values."""
    rot = j >= FIRST
    c = tl.load(cs_ptr_row + (j - FIRST), mask=rot, other=1.0)
    s = tl.load(sn_ptr_row + (j - FIRST), mask=rot, other=0.0)
    re, im = rope_rotate(xe, xo, c, s)
    return tl.where(rot, bf16_round(re), xe), tl.where(rot, bf16_round(im), xo)


@triton.jit
def window_insert(xe, xo, cs_row, sn_row, slots_ptr, n, pool_ptr, S, stride_pool, REQUANT: tl.constexpr):
    """Window KV of row n: RoPE on pairs 224..255 of (xe, xo) [16 blocks, 16 pairs] (FP32 holding
    the BF16 kv after kv_norm, pair j = 16 * block + lane), MXFP8 blocks of 32 = 16 pairs, the
    528-byte record stored at row slots[n] of the pool when that slot is in [0, S)."""
    j = tl.arange(0, 16)[:, None] * 16 + tl.arange(0, 16)[None, :]
    xe, xo = rope_pairs(xe, xo, cs_row, sn_row, j, 224)
    slot = tl.load(slots_ptr + n)
    ok = (slot >= 0) & (slot < S)
    rec = pool_ptr + tl.where(ok, slot, 0) * stride_pool
    _window_record(xe, xo, rec, ok, REQUANT)


@triton.jit
def _window_record(xe, xo, rec_ptr, ok, REQUANT: tl.constexpr):
    """Store the MXFP8 window record of the pairs (xe, xo) [16 blocks, 16 pairs] (FP32 holding BF16
    values) at rec_ptr where `ok`: codes at bytes 2j, 2j+1, scales at 512 + block. REQUANT:
    quantize the dequantized values once more (`pack_window_kv(mxfp8_fake(x))`, as the reference
    stores them)."""
    ce, co, sb = mx_quant_pairs(xe, xo, True)
    if REQUANT:
        ye, yo = mx_dequant_pairs(ce, co, sb, True)
        ce, co, sb = mx_quant_pairs(ye, yo, True)
    j = tl.arange(0, 16)[:, None] * 16 + tl.arange(0, 16)[None, :]
    tl.store(rec_ptr + 2 * j, ce, mask=ok)
    tl.store(rec_ptr + 2 * j + 1, co, mask=ok)
    tl.store(rec_ptr + 512 + tl.arange(0, 16), sb.to(tl.uint8), mask=ok)


@triton.jit
def _query_rope(q_ptr, cs_row, sn_row, n, hb0, H, stride_qn, stride_qh, HB: tl.constexpr):
    """Queries of row n: heads hb0*HB .. +HB, dims 448..511 rotated in place (int16 bits of BF16)."""
    h = hb0 * HB + tl.arange(0, HB)
    i = tl.arange(0, 32)
    ptr = q_ptr + n * stride_qn + h[:, None].to(tl.int64) * stride_qh + 448 + 2 * i[None, :]
    m = h[:, None] < H
    qe = bf16_widen(tl.load(ptr, mask=m, other=0))
    qo = bf16_widen(tl.load(ptr + 1, mask=m, other=0))
    c = tl.load(cs_row + i)[None, :]
    s = tl.load(sn_row + i)[None, :]
    re, im = rope_rotate(qe, qo, c, s)
    tl.store(ptr, bf16_rne_bits(re), mask=m)
    tl.store(ptr + 1, bf16_rne_bits(im), mask=m)


@triton.jit
def _qkv_rope_insert_kernel(
    q_ptr, kv_ptr, cos_ptr, sin_ptr, slots_ptr, pool_ptr,
    H, S, stride_qn, stride_qh, stride_kvn, stride_cn, stride_sn, stride_pool,
    HB: tl.constexpr, REQUANT: tl.constexpr, PDL: tl.constexpr = False, WINDOW: tl.constexpr = True,
):
    # Grid (rows, 1 + head blocks): program (n, 0) the window record of row n, (n, b) for b >= 1
    # its queries' head block b - 1; WINDOW=False: (rows, head blocks), queries only.
    pdl.enter(PDL)
    n = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1)
    cs_row = cos_ptr + n * stride_cn
    sn_row = sin_ptr + n * stride_sn
    if WINDOW:
        if b == 0:
            # Window KV: RoPE on pairs 224..255, MXFP8 blocks of 32 = 16 pairs, insert at the slot.
            j = tl.arange(0, 16)[:, None] * 16 + tl.arange(0, 16)[None, :]  # [16 blocks, 16 pairs]
            row = kv_ptr + n * stride_kvn                                   # int16 bits of BF16
            xe = bf16_widen(tl.load(row + 2 * j))
            xo = bf16_widen(tl.load(row + 2 * j + 1))
            window_insert(xe, xo, cs_row, sn_row, slots_ptr, n, pool_ptr, S, stride_pool, REQUANT)
        else:
            _query_rope(q_ptr, cs_row, sn_row, n, b - 1, H, stride_qn, stride_qh, HB)
    else:
        _query_rope(q_ptr, cs_row, sn_row, n, b, H, stride_qn, stride_qh, HB)


@triton.jit
def _compressed_entry_kernel(
    lat_ptr, wk_ptr, knw_ptr, cos_ptr, sin_ptr, slots_ptr, ckv_ptr, ik_ptr,
    S_CKV, S_IK, eps, stride_lat, stride_wk, stride_cn, stride_sn, stride_ckv, stride_ik,
    DO_CKV: tl.constexpr, DO_IK: tl.constexpr, IK_PID: tl.constexpr, REQUANT: tl.constexpr,
):
    g = tl.program_id(0).to(tl.int64)
    cs_row = cos_ptr + g * stride_cn
    sn_row = sin_ptr + g * stride_sn
    slot = tl.load(slots_ptr + g)
    pid1 = tl.program_id(1)
    if DO_CKV:
        if pid1 == 0:
            j = tl.arange(0, 32)[:, None] * 8 + tl.arange(0, 8)[None, :]  # [32 groups, 8 pairs]
            row = lat_ptr + g * stride_lat                                  # int16 bits of BF16
            xe = bf16_widen(tl.load(row + 2 * j))
            xo = bf16_widen(tl.load(row + 2 * j + 1))
            compressed_record(xe, xo, cs_row, sn_row, slot, ckv_ptr, S_CKV, stride_ckv, REQUANT)
    if DO_IK:
        if pid1 == IK_PID:
            index_key_record(wk_ptr + g * stride_wk, knw_ptr, cs_row, sn_row, slot, ik_ptr, S_IK, stride_ik, eps,
                             REQUANT, "")


@triton.jit
def compressed_record(xe, xo, cs_row, sn_row, slot, ckv_ptr, S_CKV, stride_ckv, REQUANT: tl.constexpr):
    """The 288-byte compressed-KV record of one latent, the pairs (xe, xo) [32 groups, 8 pairs] (FP32
    holding its BF16 values, pair j = 8 * group + lane): RoPE on pairs 224..255, NVFP4 groups of 16
    = 8 pairs, stored at row `slot` of the pool when that slot is in [0, S_CKV). Elementwise and
    max reductions only: the bits do not depend on the tensors' layout."""
    j = tl.arange(0, 32)[:, None] * 8 + tl.arange(0, 8)[None, :]
    xe, xo = rope_pairs(xe, xo, cs_row, sn_row, j, 224)
    ce, co, code = nvfp4_quant_pairs(xe, xo)
    if REQUANT:
        ye, yo = nvfp4_dequant_pairs(ce, co, code)
        ce, co, code = nvfp4_quant_pairs(ye, yo)
    ok = (slot >= 0) & (slot < S_CKV)
    rec = ckv_ptr + tl.where(ok, slot, 0) * stride_ckv
    tl.store(rec + j, (ce | (co << 4)).to(tl.uint8), mask=ok)
    tl.store(rec + 256 + tl.arange(0, 32), code, mask=ok)


@triton.jit
def index_key_record(wk_row, knw_ptr, cs_row, sn_row, slot, ik_ptr, S_IK, stride_ik, eps, REQUANT: tl.constexpr,
                     CACHE: tl.constexpr):
    """The 68-byte index key of one group from its FP32 wk outputs [128] at wk_row: bf16(wk out),
    k_norm, RoPE on pairs 32..63, MXFP4 blocks of 32 = 16 pairs, stored at row `slot` of the pool
    when that slot is in [0, S_IK). The values are loaded here, as [4 blocks, 16 pairs]: the sum of
    squares follows that load's layout, so every caller reads them from memory the same way.
    CACHE: the wk loads' cache modifier ("", or ".cg" for outputs other programs of the launch
    stored, read after an acquire)."""
    j = tl.arange(0, 4)[:, None] * 16 + tl.arange(0, 16)[None, :]  # [4 blocks, 16 pairs]
    xe = bf16_round(tl.load(wk_row + 2 * j, cache_modifier=CACHE))
    xo = bf16_round(tl.load(wk_row + 2 * j + 1, cache_modifier=CACHE))
    ss = tl.sum(tl.sum(xe * xe, axis=1), axis=0) + tl.sum(tl.sum(xo * xo, axis=1), axis=0)
    ms = ss * 0.0078125  # mean over 128: exact
    root = tl.sqrt_rn(ms + eps)
    r = tl.div_rn(tl.where(root == root, 1.0, 1.0), root)  # 1 / sqrt, both IEEE (as torch CPU rsqrt)
    we = to_f32(tl.load(knw_ptr + 2 * j))
    wo = to_f32(tl.load(knw_ptr + 2 * j + 1))
    ye = bf16_round(we * (xe * r))
    yo = bf16_round(wo * (xo * r))
    ye, yo = rope_pairs(ye, yo, cs_row, sn_row, j, 32)
    ce, co, scale_byte = mx_quant_pairs(ye, yo, False)
    if REQUANT:
        ye, yo = mx_dequant_pairs(ce, co, scale_byte, False)
        ce, co, scale_byte = mx_quant_pairs(ye, yo, False)
    ok = (slot >= 0) & (slot < S_IK)
    rec = ik_ptr + tl.where(ok, slot, 0) * stride_ik
    tl.store(rec + j, (ce | (co << 4)).to(tl.uint8), mask=ok)
    tl.store(rec + 64 + tl.arange(0, 4), scale_byte.to(tl.uint8), mask=ok)


# --- argument checks ------------------------------------------------------------------------------


def _check_rope(cos, sin, n: int, device) -> None:
    require_tensor(cos, "cos", (torch.float32,), (n, _HALF_ROPE), device)
    require_tensor(sin, "sin", (torch.float32,), (n, _HALF_ROPE), device)


def _check_query(q) -> tuple[int, int]:
    """The checks of a query tensor [N, H, 512] bfloat16; returns (N, H)."""
    n, h, _ = require_ndim(q, "q", "[N, H, 512]")
    require_tensor(q, "q", (torch.bfloat16,), (n, h, DIM))
    return n, h


def _check_slots(slots, n: int, device) -> None:
    require_tensor(slots, "slots", (torch.int64,), (n,), device)


# --- launchers ------------------------------------------------------------------------------------


def qkv_rope_insert_(q: torch.Tensor, kv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     slots: torch.Tensor, window: torch.Tensor, requant: bool = False) -> None:
    """Query RoPE in place and window-KV insert, one launch.

    q: [N, H, 512] bfloat16, unit stride in the last dim; dims 448..511 of every head are rotated in
        place (`rope_tail(q, cis, 64)`).
    kv: [N, 512] bfloat16 (after kv_norm), unit stride in the last dim; not modified.
    cos, sin: [N, 32] float32: `cis.real`, `cis.imag` of `rope_cis(freqs, positions)`.
    slots: [N] int64 ring slot of each row (`req_slot * W + p % W`); outside [0, S): not written.
    window: [S, 528] uint8 pool; row slots[r] gets `pack_window_kv(rope_tail(kv, cis, 64))[r]`.
    """
    n, h = _check_query(q)
    dev = q.device
    require_tensor(kv, "kv", (torch.bfloat16,), (n, DIM), dev)
    _check_rope(cos, sin, n, dev)
    _check_slots(slots, n, dev)
    require_tensor(window, "window", (torch.uint8,), (None, WINDOW_KV_BYTES), dev)
    if n == 0:
        return
    hb = min(triton.next_power_of_2(max(h, 1)), 16)
    grid = (n, 1 + triton.cdiv(h, hb))
    _qkv_rope_insert_kernel[grid](
        q.view(torch.int16), kv.view(torch.int16), cos, sin, slots, window,
        h, window.shape[0], q.stride(0), q.stride(1), kv.stride(0), cos.stride(0), sin.stride(0),
        window.stride(0), HB=hb, REQUANT=bool(requant), PDL=False, num_warps=4, enable_fp_fusion=False,
    )


def query_rope_(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """The query half of `qkv_rope_insert_` alone (the step's path where the window insert ran in
    `rms_norm_pair_` and the GEMM had no RoPE epilogue): dims 448..511 of every head of q [N, H,
    512] bfloat16 rotated in place, the same bits."""
    n, h = _check_query(q)
    _check_rope(cos, sin, n, q.device)
    if n == 0:
        return
    hb = min(triton.next_power_of_2(max(h, 1)), 16)
    _qkv_rope_insert_kernel[(n, triton.cdiv(h, hb))](
        q.view(torch.int16), cos, cos, sin, cos, cos, h, 0, q.stride(0), q.stride(1), 0, cos.stride(0),
        sin.stride(0), 0, HB=hb, REQUANT=False, PDL=False, WINDOW=False, num_warps=4, enable_fp_fusion=False,
    )


def compressed_entry_store_(lat: torch.Tensor | None, wk_out: torch.Tensor | None,
                            k_norm: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                            slots: torch.Tensor, compressed: torch.Tensor | None,
                            index_keys: torch.Tensor | None, eps: float | None = None,
                            requant: bool = False) -> None:
    """Compressed-KV record and/or index key of G completed groups, one launch.

    lat: [G, 512] bfloat16 latent (compressor output, before RoPE); with `compressed`.
    wk_out: [G, 128] float32 = lat @ wk^T (FP32 accumulation); with `index_keys`.
    k_norm: [128] bfloat16 (or float32) k_norm weight; eps: its epsilon; with `index_keys`.
    cos, sin: [G, 32] float32 at each group's first position.
    slots: [G] int64 global entry slot (the same row of both pools); outside a pool's rows: skipped.
    compressed: [S, 288] uint8 pool or None; index_keys: [S', 68] uint8 pool or None.

    Index keys: k_norm's mean of squares is summed in a different order from torch's reduction and
    1/sqrt is taken as IEEE sqrt then IEEE division (as torch's CPU rsqrt; CUDA's rsqrtf is
    approximate), so a 1-ulp difference in the FP32 norm factor is possible; it changes a record
    only when it moves a BF16 rounding that then moves an E2M1 code or scale (not seen in tests).
    """
    do_ckv, do_ik = compressed is not None, index_keys is not None
    if not (do_ckv or do_ik):
        raise ValueError("compressed and index_keys are both None: nothing to store")
    require_tensor(slots, "slots", (torch.int64,), (None,))
    g, dev = slots.shape[0], slots.device
    _check_rope(cos, sin, g, dev)
    if do_ckv:
        require_tensor(lat, "lat", (torch.bfloat16,), (g, DIM), dev)
        require_tensor(compressed, "compressed", (torch.uint8,), (None, COMPRESSED_KV_BYTES), dev)
    if do_ik:
        require_tensor(wk_out, "wk_out", (torch.float32,), (g, INDEX_DIM), dev)
        require_tensor(k_norm, "k_norm", (torch.bfloat16, torch.float32), (INDEX_DIM,), dev)
        require_tensor(index_keys, "index_keys", (torch.uint8,), (None, INDEX_KEY_BYTES), dev)
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0:
            raise ValueError(f"eps must be a non-negative float, got {eps!r}")
    if g == 0:
        return
    _compressed_entry_kernel[(g, int(do_ckv) + int(do_ik))](
        lat.view(torch.int16) if do_ckv else cos, wk_out if do_ik else cos, k_norm if do_ik else cos, cos, sin, slots,
        compressed if do_ckv else slots, index_keys if do_ik else slots,
        compressed.shape[0] if do_ckv else 0, index_keys.shape[0] if do_ik else 0,
        float(eps) if do_ik else 0.0,
        lat.stride(0) if do_ckv else 0, wk_out.stride(0) if do_ik else 0, cos.stride(0), sin.stride(0),
        compressed.stride(0) if do_ckv else 0, index_keys.stride(0) if do_ik else 0,
        DO_CKV=do_ckv, DO_IK=do_ik, IK_PID=int(do_ckv), REQUANT=bool(requant), num_warps=4, enable_fp_fusion=False,
    )


def compressed_kv_store_(lat: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor,
                         compressed: torch.Tensor, requant: bool = False) -> None:
    """Write `pack_compressed_kv(compressor.compressed_kv(lat, cis, 64))[g]` at row slots[g] of
    `compressed` [S, 288] uint8; lat [G, 512] bfloat16, cos/sin [G, 32] float32, slots [G] int64."""
    compressed_entry_store_(lat, None, None, cos, sin, slots, compressed, None, requant=requant)


def index_key_store_(wk_out: torch.Tensor, k_norm: torch.Tensor, eps: float, cos: torch.Tensor,
                     sin: torch.Tensor, slots: torch.Tensor, index_keys: torch.Tensor,
                     requant: bool = False) -> None:
    """Write `pack_index_key(compressor.index_key(lat, wk, k_norm, cis, 64, eps))[g]` at row
    slots[g] of `index_keys` [S, 68] uint8, from wk_out = lat @ wk^T [G, 128] float32."""
    compressed_entry_store_(None, wk_out, k_norm, cos, sin, slots, None, index_keys, eps, requant)


# --- allocating conveniences (tests, one-off use) -------------------------------------------------


def rope_cos_sin(cis: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) [n, 32] float32, contiguous, of `rope_cis(...)` [n, 32] complex64."""
    require_is_tensor(cis, "cis")
    return cis.real.contiguous(), cis.imag.contiguous()


def qkv_rope_insert(q: torch.Tensor, kv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(rotated copy of q, window records [N, 528] uint8 of kv, row r at slot r)."""
    require_ndim(q, "q", "[N, H, 512]")
    require_ndim(kv, "kv", "[N, 512]")
    q2 = q.clone()
    rec = torch.zeros(kv.shape[0], WINDOW_KV_BYTES, dtype=torch.uint8, device=kv.device)
    slots = torch.arange(kv.shape[0], dtype=torch.int64, device=kv.device)
    qkv_rope_insert_(q2, kv, cos, sin, slots, rec)
    return q2, rec


def compressed_kv_records(lat: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """288-byte records [G, 288] uint8 of `compressed_kv_store_` at slots 0..G-1."""
    require_ndim(lat, "lat", "[G, 512]")
    rec = torch.zeros(lat.shape[0], COMPRESSED_KV_BYTES, dtype=torch.uint8, device=lat.device)
    slots = torch.arange(lat.shape[0], dtype=torch.int64, device=lat.device)
    compressed_kv_store_(lat, cos, sin, slots, rec)
    return rec


def index_key_records(wk_out: torch.Tensor, k_norm: torch.Tensor, eps: float, cos: torch.Tensor,
                      sin: torch.Tensor) -> torch.Tensor:
    """68-byte index keys [G, 68] uint8 of `index_key_store_` at slots 0..G-1."""
    require_ndim(wk_out, "wk_out", "[G, 128]")
    rec = torch.zeros(wk_out.shape[0], INDEX_KEY_BYTES, dtype=torch.uint8, device=wk_out.device)
    slots = torch.arange(wk_out.shape[0], dtype=torch.int64, device=wk_out.device)
    index_key_store_(wk_out, k_norm, eps, cos, sin, slots, rec)
    return rec
