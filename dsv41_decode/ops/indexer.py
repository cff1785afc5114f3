"""Indexer logits over 68-byte MXFP4 index keys (spec section 3, step 7), dense or candidate-restricted.

score[n, j] = bf16(sum_h bf16(w[n, h] * relu(bf16(iq[n, h] . key[j])))) for the visible entries
j < n_vis[n] of request slot req_slot[n]; -inf past n_vis and (with a candidate mask) outside it.
Entry j of slot s is pool record block_table[s, j // page] * page + j % page.

Grid: (rows, programs per row: one wave at programs_per_sm an SM where the rows allow); each
program loops over its row's entry blocks. A block loads BLOCK_E records as 17 int32 words each (16 words of E2M1
pairs, one of the four UE8M0 scales), decodes them with 2-D ops only (nibble j of the [E, 16]
words is key dims w * 8 + j) and scores them for every head with eight [E, 16] x [16, H] dots. Operands are exact in BF16 (E2M1 codes
times powers of two; iq is MXFP4 fake-quantized), so the GPU uses a BF16 dot with FP32
accumulation; the interpreter (whose BF16 dots are wrong) uses an FP32 dot. Products are exact
either way; only the FP32 summation order over the 128 terms and over the heads may differ from
the reference (torch sums in its own order), so a score may rarely be one BF16 ulp off.
"""

from __future__ import annotations


import torch
import triton
import triton.language as tl

from ..records import INDEX_KEY_BYTES
from .checks import interpreting, require_bool, require_int, require_is_tensor, require_num_warps
from .common import one_wave_programs
from .fp4 import bf16_round
from .rounding import to_f32

_HEAD_DIM = 128


@triton.jit
def _e2m1_times_scale(words, j: tl.constexpr, scale):
    """Nibble j of every int32 word as FP32 E2M1 value times `scale` (2-D, same shape as words)."""
    nib = words >> (4 * j)
    mag = nib & 7
    bits = tl.where(mag >= 2, (mag << 22) + (126 << 23), tl.where(mag == 1, 126 << 23, 0))
    bits = bits | ((words << (28 - 4 * j)) & (-2147483648))                  # the nibble's sign bit
    return bits.to(tl.float32, bitcast=True) * scale


@triton.jit
def _q_slice(iq_ptr, n, iq_sn, iq_sh, heads, j: tl.constexpr, BLOCK_H: tl.constexpr, DOT_BF16: tl.constexpr):
    """q[n, h, w * 8 + j] as [16 (w), BLOCK_H]: the dims that nibble j of the 16 key words feeds."""
    offs_h = tl.arange(0, BLOCK_H)
    q = tl.load(iq_ptr + n.to(tl.int64) * iq_sn + offs_h[None, :] * iq_sh + (tl.arange(0, 16) * 8 + j)[:, None],
                mask=(offs_h < heads)[None, :], other=0.0)
    return q


@triton.jit
def _dot_acc(key, q, acc, DOT_BF16: tl.constexpr):
    if DOT_BF16:
        return tl.dot(key.to(tl.bfloat16), q, acc)
    return tl.dot(key, q.to(tl.float32), acc, input_precision="ieee")


# --- the FP8 path (`fp8_dot=True`): E2M1 nibbles as E4M3 bytes, one K=32 FP8 dot per scale block ---
#
# The byte ((c & 7) << 2) | ((c & 8) << 4) is, read as E4M3, exactly E2M1(c) * 2^-6 (subnormal for
# c's exponent 0, normal above), so a record's 64 code bytes become 128 E4M3 operands with a few
# bit operations per four bytes and no float arithmetic. The index query is MXFP4 too: each of its
# 32-dim blocks, times 2^-(s + 6) for s = floor(log2 max|block|) - 2, is E4M3-exact (E2M1 values
# times a power of two, at most 2^-3, none below 2^-7). Per block the dot of the two is then a
# K = 32 FP8 tensor-core product (exact products, FP32 sum of 32 terms), scaled back by the two
# powers of two; the four blocks add in order.


@triton.jit
def _e4m3_of_nibbles(b, ASM: tl.constexpr):
    """(lo, hi): for uint8 code bytes b, the E4M3 bytes of their low and high E2M1 nibbles (times
    2^-6, exact). ASM: four bytes per 32-bit operation in inline PTX (the GPU); else per byte."""
    if ASM:
        return tl.inline_asm_elementwise(
            "{\n\t.reg .b32 t0, t1;\n\t"
            "and.b32 t0, $2, 0x07070707;\n\tshl.b32 t0, t0, 2;\n\t"
            "and.b32 t1, $2, 0x08080808;\n\tshl.b32 t1, t1, 4;\n\tor.b32 $0, t0, t1;\n\t"
            "shr.b32 t0, $2, 2;\n\tand.b32 t0, t0, 0x1C1C1C1C;\n\t"
            "and.b32 t1, $2, 0x80808080;\n\tor.b32 $1, t0, t1;\n\t}",
            "=r,=r,r", [b], dtype=(tl.uint8, tl.uint8), is_pure=True, pack=4)
    lo = ((b & 7) << 2) | ((b & 8) << 4)
    hi = ((b >> 2) & 0x1C) | (b & 0x80)
    return lo.to(tl.uint8), hi.to(tl.uint8)


@triton.jit
def _q_block_e4m3(iq_ptr, n, iq_sn, iq_sh, heads, blk: tl.constexpr, BLOCK_H: tl.constexpr):
    """(q', f): query dims 32 blk .. 32 blk + 31 of row n as [32, BLOCK_H] E4M3 values q' and the
    per-head power of two f with q = q' * f / 2^6 exactly (the 2^6 undoes the keys' 2^-6; see
    above; an all-zero block gives q' = 0)."""
    offs_h = tl.arange(0, BLOCK_H)
    q = to_f32(tl.load(iq_ptr + n.to(tl.int64) * iq_sn + offs_h[None, :] * iq_sh + (blk * 32 + tl.arange(0, 32))[:, None],
                mask=(offs_h < heads)[None, :], other=0.0))
    amax = tl.max(tl.abs(q), axis=0)
    e = (amax.to(tl.int32, bitcast=True) >> 23) & 0xFF          # biased exponent of max|q|
    e = tl.minimum(tl.maximum(e, 1), 244)                        # zero (or subnormal) blocks: any s
    # s = e - 129: q' = q * 2^-(s + 6) = q * 2^(123 - e); q = q' * 2^(e - 123), and f also carries
    # the keys' 2^6 (their E4M3 operands are E2M1 * 2^-6): f = 2^(e - 117). Both factors are
    # normal FP32 powers of two for 1 <= e <= 244.
    down = ((250 - e) << 23).to(tl.float32, bitcast=True)
    up = ((e + 10) << 23).to(tl.float32, bitcast=True)
    return (q * down[None, :]).to(tl.float8e4nv), up


@triton.jit
def _block_scores_fp8(pool8_ptr, rec, vis, blk: tl.constexpr, kscale, qb, qf, DOT_FP8: tl.constexpr,
                      ASM: tl.constexpr, BLOCK_E: tl.constexpr):
    """[E, H] FP32: key block blk (dims 32 blk ..) of the records rec dotted with the query block
    (qb, qf), exact per block; kscale [E]: the keys' block scales 2^(byte - 127)."""
    b = tl.load(pool8_ptr + rec[:, None] * 68 + blk * 16 + tl.arange(0, 16)[None, :],
                mask=vis[:, None], other=0)                                   # [E, 16] code bytes
    lo, hi = _e4m3_of_nibbles(b, ASM)
    k = tl.reshape(tl.join(lo, hi), (BLOCK_E, 32)).to(tl.float8e4nv, bitcast=True)   # dims in order
    if DOT_FP8:
        d = tl.dot(k, qb)
    else:    # the interpreter: the same exact products through FP32
        d = tl.dot(k.to(tl.float32), qb.to(tl.float32), input_precision="ieee")
    return (d * qf[None, :]) * kscale[:, None]


# `page` is not specialized: with a page divisible by 16, Triton would take every record id
# `blk * page + e % page` for a multiple of 16 and vectorize the 17-word record loads past their
# 4-byte alignment (a misaligned-address fault on the H200).
@triton.jit(do_not_specialize=["page"])
def _index_scores_kernel(iq_ptr, w_ptr, pool_ptr, pool8_ptr, bt_ptr, slot_ptr, nvis_ptr, cand_ptr, out_ptr,
                         heads, max_entries, page, bt_stride, iq_sn, iq_sh, w_sn, cand_sn, out_sn,
                         BLOCK_H: tl.constexpr, BLOCK_E: tl.constexpr, HAS_CAND: tl.constexpr,
                         DOT_BF16: tl.constexpr, FP8: tl.constexpr = False, ASM: tl.constexpr = False):
    n = tl.program_id(0)
    pid = tl.program_id(1)
    nprog = tl.num_programs(1)
    n_vis = tl.minimum(tl.load(nvis_ptr + n), max_entries)
    slot = tl.load(slot_ptr + n).to(tl.int64)
    out_row = out_ptr + n.to(tl.int64) * out_sn
    offs_h = tl.arange(0, BLOCK_H)
    wv = to_f32(tl.load(w_ptr + n.to(tl.int64) * w_sn + offs_h, mask=offs_h < heads, other=0.0))
    if FP8:
        qa, fa = _q_block_e4m3(iq_ptr, n, iq_sn, iq_sh, heads, 0, BLOCK_H)
        qb, fb = _q_block_e4m3(iq_ptr, n, iq_sn, iq_sh, heads, 1, BLOCK_H)
        qc, fc = _q_block_e4m3(iq_ptr, n, iq_sn, iq_sh, heads, 2, BLOCK_H)
        qd, fd = _q_block_e4m3(iq_ptr, n, iq_sn, iq_sh, heads, 3, BLOCK_H)
    else:
        q0 = _q_slice(iq_ptr, n, iq_sn, iq_sh, heads, 0, BLOCK_H, DOT_BF16)
        q1 = _q_slice(iq_ptr, n, iq_sn, iq_sh, heads, 1, BLOCK_H, DOT_BF16)
        q2 = _q_slice(iq_ptr, n, iq_sn, iq_sh, heads, 2, BLOCK_H, DOT_BF16)
        q3 = _q_slice(iq_ptr, n, iq_sn, iq_sh, heads, 3, BLOCK_H, DOT_BF16)
        q4 = _q_slice(iq_ptr, n, iq_sn, iq_sh, heads, 4, BLOCK_H, DOT_BF16)
        q5 = _q_slice(iq_ptr, n, iq_sn, iq_sh, heads, 5, BLOCK_H, DOT_BF16)
        q6 = _q_slice(iq_ptr, n, iq_sn, iq_sh, heads, 6, BLOCK_H, DOT_BF16)
        q7 = _q_slice(iq_ptr, n, iq_sn, iq_sh, heads, 7, BLOCK_H, DOT_BF16)
    sshift = ((tl.arange(0, 16) // 4) * 8)[None, :]
    n_vis_blocks = tl.cdiv(n_vis, BLOCK_E)
    for b in tl.range(pid, n_vis_blocks, nprog):
        offs_e = b * BLOCK_E + tl.arange(0, BLOCK_E)
        vis = offs_e < n_vis
        if HAS_CAND:
            cand = tl.load(cand_ptr + n.to(tl.int64) * cand_sn + offs_e, mask=vis, other=0)
            vis = vis & (cand != 0)
        blk = tl.load(bt_ptr + slot * bt_stride + offs_e // page, mask=vis, other=0)
        rec = blk.to(tl.int64) * page + offs_e % page                       # [E]
        sw = tl.load(pool_ptr + rec * 17 + 16, mask=vis, other=0)           # [E] 4 scale bytes
        if FP8:
            # key block j's scale 2^(byte - 127), as the BF16 path reads it
            ka = ((sw & 0xFF) << 23).to(tl.float32, bitcast=True)
            kb = (((sw >> 8) & 0xFF) << 23).to(tl.float32, bitcast=True)
            kc = (((sw >> 16) & 0xFF) << 23).to(tl.float32, bitcast=True)
            kd = (((sw >> 24) & 0xFF) << 23).to(tl.float32, bitcast=True)
            acc = _block_scores_fp8(pool8_ptr, rec, vis, 0, ka, qa, fa, DOT_BF16, ASM, BLOCK_E)
            acc += _block_scores_fp8(pool8_ptr, rec, vis, 1, kb, qb, fb, DOT_BF16, ASM, BLOCK_E)
            acc += _block_scores_fp8(pool8_ptr, rec, vis, 2, kc, qc, fc, DOT_BF16, ASM, BLOCK_E)
            acc += _block_scores_fp8(pool8_ptr, rec, vis, 3, kd, qd, fd, DOT_BF16, ASM, BLOCK_E)
        else:
            words = tl.load(pool_ptr + rec[:, None] * 17 + tl.arange(0, 16)[None, :],
                            mask=vis[:, None], other=0)                     # [E, 16] int32
            scale = (((sw[:, None] >> sshift) & 0xFF) << 23).to(tl.float32, bitcast=True)  # [E, 16]
            # key dim w * 8 + j is nibble j of word w: 8 dots over K = 16 words, one per nibble
            acc = tl.zeros((BLOCK_E, BLOCK_H), tl.float32)
            acc = _dot_acc(_e2m1_times_scale(words, 0, scale), q0, acc, DOT_BF16)
            acc = _dot_acc(_e2m1_times_scale(words, 1, scale), q1, acc, DOT_BF16)
            acc = _dot_acc(_e2m1_times_scale(words, 2, scale), q2, acc, DOT_BF16)
            acc = _dot_acc(_e2m1_times_scale(words, 3, scale), q3, acc, DOT_BF16)
            acc = _dot_acc(_e2m1_times_scale(words, 4, scale), q4, acc, DOT_BF16)
            acc = _dot_acc(_e2m1_times_scale(words, 5, scale), q5, acc, DOT_BF16)
            acc = _dot_acc(_e2m1_times_scale(words, 6, scale), q6, acc, DOT_BF16)
            acc = _dot_acc(_e2m1_times_scale(words, 7, scale), q7, acc, DOT_BF16)   # [E, H]
        term = bf16_round(tl.maximum(bf16_round(acc), 0.0) * wv[None, :])
        score = tl.where(vis, bf16_round(tl.sum(term, 1)), float("-inf"))
        tl.store(out_row + offs_e, score, mask=offs_e < max_entries)
    for b in tl.range(n_vis_blocks + pid, tl.cdiv(max_entries, BLOCK_E), nprog):
        offs_e = b * BLOCK_E + tl.arange(0, BLOCK_E)
        tl.store(out_row + offs_e, tl.full((BLOCK_E,), float("-inf"), tl.float32), mask=offs_e < max_entries)


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def index_scores_args(iq: torch.Tensor, w: torch.Tensor, pool: torch.Tensor, block_table: torch.Tensor,
                      page: int, req_slot: torch.Tensor, n_vis: torch.Tensor, out: torch.Tensor,
                      cand_mask: torch.Tensor | None) -> tuple[int, int]:
    """The checks of `index_scores_mxfp4_`'s common arguments (its docstring), shared with the Gluon
    scorer (`ops.gluon_indexer`); a ValueError names the first argument that fails. Returns
    (N rows, Hi heads)."""
    for name, t in (("iq", iq), ("w", w), ("pool", pool), ("block_table", block_table), ("req_slot", req_slot),
                    ("n_vis", n_vis), ("out", out)):
        require_is_tensor(t, name)
    if cand_mask is not None:
        require_is_tensor(cand_mask, "cand_mask")
    _check(iq.dim() == 3 and iq.shape[2] == _HEAD_DIM and iq.dtype == torch.bfloat16 and iq.stride(2) == 1,
           f"iq must be [N, Hi, 128] BF16 with a contiguous last dim, got {tuple(iq.shape)} {iq.dtype}")
    n_rows, heads = iq.shape[0], iq.shape[1]
    _check(1 <= heads <= 128, f"iq: Hi={heads} must lie in 1..128")
    _check(w.shape == (n_rows, heads) and w.dtype == torch.bfloat16 and w.stride(1) == 1,
           f"w must be [N={n_rows}, Hi={heads}] BF16, got {tuple(w.shape)} {w.dtype}")
    _check(pool.dim() == 2 and pool.shape[1] == INDEX_KEY_BYTES and pool.dtype == torch.uint8 and pool.is_contiguous()
           and pool.storage_offset() % 4 == 0,
           f"pool must be a contiguous [S, 68] uint8 tensor starting 4-byte aligned, got {tuple(pool.shape)} {pool.dtype}")
    _check(block_table.dim() == 2 and block_table.dtype == torch.int32 and block_table.stride(1) == 1
           and block_table.shape[1] > 0,
           f"block_table must be [slots, pages>0] int32, got {tuple(block_table.shape)} {block_table.dtype}")
    require_int(page, "page")
    _check(req_slot.shape == (n_rows,) and req_slot.dtype in (torch.int32, torch.int64)
           and (n_rows < 2 or req_slot.stride(0) == 1),
           f"req_slot must be a contiguous [N={n_rows}] int32/int64, got {tuple(req_slot.shape)} {req_slot.dtype} "
           f"strides {req_slot.stride()}")
    _check(n_vis.shape == (n_rows,) and n_vis.dtype == torch.int32 and (n_rows < 2 or n_vis.stride(0) == 1),
           f"n_vis must be a contiguous [N={n_rows}] int32, got {tuple(n_vis.shape)} {n_vis.dtype} "
           f"strides {n_vis.stride()}")
    _check(out.dim() == 2 and out.shape[0] == n_rows and out.dtype == torch.float32 and out.stride(1) == 1,
           f"out must be [N={n_rows}, max_entries] FP32, got {tuple(out.shape)} {out.dtype}")
    if cand_mask is not None:
        _check(cand_mask.shape == out.shape and cand_mask.dtype in (torch.bool, torch.uint8) and cand_mask.stride(1) == 1,
               f"cand_mask must be [N, max_entries]={tuple(out.shape)} bool/uint8, got {tuple(cand_mask.shape)} {cand_mask.dtype}")
    tensors = [iq, w, pool, block_table, req_slot, n_vis, out] + ([cand_mask] if cand_mask is not None else [])
    _check(all(t.device == iq.device for t in tensors),
           "iq, w, pool, block_table, req_slot, n_vis, out, cand_mask must share a device")
    return n_rows, heads


def index_scores_mxfp4_(iq: torch.Tensor, w: torch.Tensor, pool: torch.Tensor, block_table: torch.Tensor,
                        page: int, req_slot: torch.Tensor, n_vis: torch.Tensor, out: torch.Tensor,
                        cand_mask: torch.Tensor | None = None, block_e: int = 128, num_warps: int | None = None,
                        programs_per_sm: int = 4, fp8_dot: bool = False) -> torch.Tensor:
    """Write the indexer scores of N decode rows into `out` (see the module docstring).

    iq: [N, Hi, 128] BF16, MXFP4 fake-quantized (unchecked: other values lose bits in the BF16 dot).
    w: [N, Hi] BF16 head weights (already scaled).
    pool: [S, 68] uint8 index-key records, contiguous, 4-byte aligned.
    block_table: [slots, pages] int32; page: entries per page (> 0).
    req_slot: [N] int32/int64 request slot of each row; n_vis: [N] int32 visible entries ((p+1)//r).
    out: [N, max_entries] FP32, last dim contiguous; receives BF16-representable values, -inf past n_vis.
    cand_mask: optional [N, max_entries] bool/uint8; entries where it is 0 score -inf.
    block_e: entries per loop step of a program (power of two >= 16); each row gets
    floor(programs_per_sm * SMs / N) programs (programs_per_sm >= 1; at least one, at most one per
    block: `common.one_wave_programs`), which loop over its entry blocks. num_warps: a power of
    two in 1..16; None: 4, or 8 for the FP8 path above 32 heads (at 64 heads and 4 warps it spills
    on sm_90).
    fp8_dot: the FP8 path (one K=32 E4M3 tensor-core dot per scale block, the codes turned into
    E4M3 bytes by bit operations; see above): per block exact, the four blocks added in order,
    so the FP32 dot sums 4 exact terms instead of 128 products. The decode step's path (measured
    faster on an H200, docs/attn.md); off here by default.
    Unchecked: ids in block_table and req_slot lie inside pool/block_table; n_vis <= pages * page.
    Returns out.
    """
    n_rows, heads = index_scores_args(iq, w, pool, block_table, page, req_slot, n_vis, out, cand_mask)
    require_int(block_e, "block_e", 16, power_of_two=True)
    if num_warps is not None:
        require_num_warps(num_warps)
    require_int(programs_per_sm, "programs_per_sm")
    require_bool(fp8_dot, "fp8_dot")
    max_entries = out.shape[1]
    if n_rows == 0 or max_entries == 0:
        return out
    cand = cand_mask.view(torch.uint8) if cand_mask is not None else out
    block_h = max(16, triton.next_power_of_2(heads))
    if num_warps is None:
        num_warps = 8 if fp8_dot and block_h > 32 else 4
    grid = (n_rows, one_wave_programs(n_rows, triton.cdiv(max_entries, block_e), programs_per_sm, iq.device))
    _index_scores_kernel[grid](
        iq, w, pool.view(torch.int32), pool, block_table, req_slot, n_vis, cand, out,
        heads, max_entries, page, block_table.stride(0), iq.stride(0), iq.stride(1), w.stride(0),
        cand.stride(0), out.stride(0),
        BLOCK_H=block_h, BLOCK_E=block_e, HAS_CAND=cand_mask is not None,
        DOT_BF16=not interpreting(), FP8=bool(fp8_dot), ASM=not interpreting(), num_warps=num_warps)
    return out


def index_scores_mxfp4(iq: torch.Tensor, w: torch.Tensor, pool: torch.Tensor, block_table: torch.Tensor,
                       page: int, req_slot: torch.Tensor, n_vis: torch.Tensor, max_entries: int,
                       cand_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Allocating form of `index_scores_mxfp4_`: returns scores [N, max_entries] FP32."""
    require_is_tensor(iq, "iq")
    require_int(max_entries, "max_entries", 0)
    out = torch.empty(iq.shape[0], max_entries, dtype=torch.float32, device=iq.device)
    return index_scores_mxfp4_(iq, w, pool, block_table, page, req_slot, n_vis, out, cand_mask)
