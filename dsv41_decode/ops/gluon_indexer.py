"""Indexer logits over 68-byte MXFP4 index keys in Gluon for Hopper (sm_90): the scores of
`ops.indexer.index_scores_mxfp4_`'s FP8 path (`fp8_dot=True`, the decode step's) with the same
arguments, on tensor cores at the keys' read speed (spec section 3, step 7; spec decision 5).

score[n, j] = bf16(sum_h bf16(w[n, h] * relu(bf16(iq[n, h] . key[j])))) for the visible entries
j < n_vis[n] of request slot req_slot[n]; -inf past n_vis and (with a candidate mask) outside it.

How the kernel runs (one warpgroup a program; grid (rows, programs per row), each program looping
over its row's tiles of BLOCK_E = 64 entries: tile p, p + P, ...):

- **Records by cp.async.** A tile's records (entry j -> pool record block_table[slot, j // page] *
  page + j % page: any page, 4-byte aligned records; with a page a multiple of 64 a tile lies in
  one page: one block-table load and a uniform base) are copied as 16 code words [64, 16] and the
  scale word into a ring of STAGES shared-memory slots with the asynchronous copy (4-byte copies,
  each thread four consecutive words of a record, a warp's lanes on eight records' code words).
  STAGES - 1 tiles are in flight while a program scores one; masked entries (past n_vis, outside
  the candidate mask) are not read. A tile's page (with a page a multiple of 64) is loaded an
  iteration before its copies are issued, so the issue does not wait a global load's latency for
  it.
- **E2M1 -> E4M3 by integer ops, into shared memory.** Each code word (8 nibbles: key dims 8w ..
  8w + 7) becomes two words of E4M3 bytes: `ops.indexer`'s byte trick (E4M3 byte
  ((c & 7) << 2) | ((c & 8) << 4) is exactly E2M1(c) * 2^-6), four bytes an operation; two byte
  permutes (prmt) interleave the low and high nibbles' bytes into dim order, or (`kperm`) they stay
  apart and each block's 32 key dims are stored in that order, the query's permuted to match (a
  block's 32 products are exact, so their sum does not depend on the order). The [64, 128] E4M3
  key tile is stored 128-byte swizzled for the wgmma.
- **Four FP8 wgmmas, one per scale block.** The keys are the wgmma's M (64), the row's heads its
  N (BLOCK_H: the heads padded to a power of two >= 16, as `ops.indexer`), K = 32: a block's exact
  partial (products of E2M1 values times 2^-12, a 32-term sum of 13 bits: exact in the tensor
  core's accumulator) from a zero accumulator; all four in flight, or (`mma_pairs`) two at a time
  (two partials live instead of four: fewer registers). The query is `ops.indexer._q_block_e4m3`'s
  per block, computed once per program into shared memory: E4M3 q' and the per-head power of two f.
- **The epilogue as `ops.indexer`'s FP8 path**: acc = (d_0 f_0) k_0, then acc += (d_b f_b) k_b for
  blocks 1, 2, 3 in order (k_b the key's block scale 2^(byte - 127)); bf16, relu, times w, bf16,
  the FP32 sum over heads (`gl.sum` in the wgmma's accumulator layout: the same layout as the
  Triton path's dot result at BLOCK_H heads, so the same reduction order), bf16. Each scale is a
  power of two and each block partial is exact, so every product above is exact (barring
  overflow or subnormals) and the adds are the Triton path's adds in the Triton path's order. The
  per-(entry, head) BF16 roundings use the packed conversion (`_bf16_pair`), or (`packed_terms`)
  the relu and the weight run in BF16x2 too (`_weighted_terms_bf16x2`).
- **The optional query fold** (`fold_q`): where every block of every head of the row allows it
  (`query_fold_rows`), the query's operand is 64 q itself, exact in E4M3, instead of each block
  normalized by its own power of two; each key block's wgmma then returns (d_b f_b) itself, and the
  epilogue skips those four multiplications a term (two uniform branches a tile, over each pair of
  blocks' multiplications: `_block_terms`). The same values, so the same bits; rows that do not fold
  take the epilogue above.
- **The optional histogram** (`hist`, a top-k workspace): each program counts the high byte of its
  visible scores' 16-bit order-preserving keys (`ops.topk._keys`, group 1: -0.0 keyed as +0.0;
  -inf, NaN and entries past n_vis not counted) into 256 counters of its own in global memory (a
  scratch: `hist_scratch`, or one the launch allocates; zeroed by the program first and again
  after it reads them, so a scratch that is zero between launches stays so): per tile, the lanes
  of a warp whose scores share a bin vote (match.any) and one of them adds their count
  (`_key_votes`), with no barrier and no contention with other programs. At its end the program adds its nonzero bins
  into hist[row, 0:256], one relaxed atomic each (integer sums: the totals do not depend on the
  order they land in).

Past the visible tiles, each program writes -inf to its share of the tiles up to max_entries.

With `qf_smem` the query's four powers of two and the head weights (in the accumulator's column
layout: eight values of each a thread at 32 heads) stay in shared memory and are read for each tile's
epilogue, and each tile's page is loaded two iterations ahead: at <= 32 heads with `mma_pairs` the
kernel then fits a cap of 96 registers without spills (128 without it), five programs an SM instead
of four (the scorer is bound by latency at four: ~1000 cycles a tile an SM against ~440 issue
slots), for 20 shared-memory loads more a tile. The same operations on the same values: the same bits.

With `row_group` (GROUP > 1), a request's consecutive rows (its decode and draft rows: one request
slot, n_vis > 0) are scored GROUP at a time: the group's programs (GROUP x a row's share) take its
tiles in turn up to its rows' largest n_vis, and each copies and widens a tile once and runs every
row's wgmmas and epilogue on it (`_score_tile`), with the rows' queries, powers of two and head
weights in shared memory, a histogram's counters per row, and each row's entries past its own
n_vis -inf.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

from .checks import require_int
from .common import is_sm90, one_wave_programs
from .fp4 import bf16_round
from .indexer import index_scores_args

BLOCK_E = 64          # entries per tile: the wgmma's M (one warpgroup)
HIST_BINS = 256       # the high byte of a score's 16-bit key
MAX_STAGES = 12
ROW_GROUPS = (1, 2, 4)      # gluon_index_scores_mxfp4_'s row_group
QF_SMEM_MAXNREG = 96        # qf_smem's register cap with mma_pairs at <= 32 heads: five 4-warp programs an SM
# The query fold's exponent bytes (`fold_q`): a query block of the contract's MXFP4 values whose
# largest |q| is 0 or has its exponent byte in [FOLD_Q_EXP_MIN, FOLD_Q_EXP_MAX] holds 64 q exactly in E4M3
FOLD_Q_EXP_MIN = 115
FOLD_Q_EXP_MAX = 129
_BLOCK_E = gl.constexpr(BLOCK_E)
_FOLD_Q_EXP_MIN = gl.constexpr(FOLD_Q_EXP_MIN)
_FOLD_Q_EXP_MAX = gl.constexpr(FOLD_Q_EXP_MAX)
_HIST_BINS = gl.constexpr(HIST_BINS)
_WORDS = gl.constexpr(17)      # int32 words per 68-byte record: 16 code words, then the 4 scale bytes


@gluon.jit
def _widen(words):
    """(lo, hi) int32: the E4M3 bytes of the 8 E2M1 nibbles of each code word (key dims 8w .. 8w+7,
    low nibble first) in dim order: lo holds dims 8w .. 8w+3, hi dims 8w+4 .. 8w+7. The per-byte
    maps are `ops.indexer._e4m3_of_nibbles`'s, four bytes an operation; prmt interleaves them."""
    return gl.inline_asm_elementwise(
        "{\n\t.reg .b32 l, h, t;\n\t"
        "and.b32 l, $2, 0x07070707;\n\tshl.b32 l, l, 2;\n\t"
        "and.b32 t, $2, 0x08080808;\n\tshl.b32 t, t, 4;\n\tor.b32 l, l, t;\n\t"
        "shr.b32 h, $2, 2;\n\tand.b32 h, h, 0x1C1C1C1C;\n\t"
        "and.b32 t, $2, 0x80808080;\n\tor.b32 h, h, t;\n\t"
        "prmt.b32 $0, l, h, 0x5140;\n\tprmt.b32 $1, l, h, 0x7362;\n\t}",
        "=r,=r,r", [words], dtype=(gl.int32, gl.int32), is_pure=True, pack=1)


@gluon.jit
def _widen_split(words):
    """(lo, hi) int32: the E4M3 bytes of each code word's low nibbles (key dims 8w, 8w+2, 8w+4,
    8w+6) and of its high nibbles (8w+1, +3, +5, +7), `ops.indexer._e4m3_of_nibbles`'s maps four
    bytes an operation, not interleaved (KPERM: the key tile's columns in that order)."""
    lo = ((words & 0x07070707) << 2) | ((words & 0x08080808) << 4)
    hi = ((words >> 2) & 0x1C1C1C1C) | (words & -2139062144)       # 0x80808080
    return lo, hi


@gluon.jit
def _q_load(iq_ptr, n, iq_sn, iq_sh, heads, blk: gl.constexpr, BLOCK_H: gl.constexpr, q_l: gl.constexpr,
            KPERM: gl.constexpr = False):
    """(q, amax): query block blk (dims 32 blk ..) of row n as FP32 [BLOCK_H, 32] (0 past `heads`)
    and each head's largest |q| of it. KPERM: column p of the block holds dim 8 ((p % 16) // 4) +
    2 (p % 4) + p // 16, the key tile's order (`_widen_split`): a block's 32 products are exact, so
    their sum does not depend on the order."""
    rh = gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, q_l))
    rk = gl.arange(0, 32, layout=gl.SliceLayout(0, q_l))
    if KPERM:
        rk = 8 * ((rk % 16) // 4) + 2 * (rk % 4) + rk // 16
    q = gl.load(iq_ptr + n.to(gl.int64) * iq_sn + rh[:, None] * iq_sh + (blk * 32 + rk)[None, :],
                mask=(rh < heads)[:, None] & (rk < 32)[None, :], other=0.0).to(gl.float32)
    return q, gl.max(gl.abs(q), axis=1)


@gluon.jit
def _exp_byte(x):
    """The biased exponent byte of FP32 x (0 for zeros and subnormals, 255 for inf and NaN)."""
    return (x.to(gl.int32, bitcast=True) >> 23) & 0xFF


@gluon.jit
def _q_foldable(amax):
    """Per head: whether 64 q is exact in E4M3 for every value q of a block of the contract's MXFP4
    values (E2M1 x 2^s) whose largest |q| is amax (`query_fold_rows`' rule)."""
    e = _exp_byte(amax)
    return (amax == 0.0) | ((e >= _FOLD_Q_EXP_MIN) & (e <= _FOLD_Q_EXP_MAX))


@gluon.jit
def _q_store(q, amax, q_smem, blk: gl.constexpr, col_l: gl.constexpr, folded):
    """Query block blk as `ops.indexer._q_block_e4m3` makes it: E4M3 q' (q' = q down, down a power
    of two per head that puts amax in [2^-4, 2^-3)) stored into q_smem's columns 32 blk ..
    32 blk + 31, and the per-head power of two f (q = q' f / 2^6 exactly) returned in `col_l`.
    folded: False (a constant), or the row's fold flag (every block of the row `_q_foldable`): where
    set, q' = 64 q instead: a key block's wgmma then returns (d f) itself, the epilogue's product
    (`_block_terms`); f as without."""
    e = gl.minimum(gl.maximum(_exp_byte(amax), 1), 244)
    down_e = 250 - e
    if folded:
        down_e = gl.full_like(down_e, 133)          # 2^6
    down = (down_e << 23).to(gl.float32, bitcast=True)
    up = ((e + 10) << 23).to(gl.float32, bitcast=True)
    q_smem.slice(blk * 32, 32, dim=1).store((q * down[:, None]).to(gl.float8e4nv))
    return gl.convert_layout(up, col_l)


@gluon.jit
def _q_block(iq_ptr, n, iq_sn, iq_sh, heads, q_smem, blk: gl.constexpr, BLOCK_H: gl.constexpr,
             q_l: gl.constexpr, col_l: gl.constexpr, KPERM: gl.constexpr = False):
    """Query block blk of row n stored as E4M3 q' into q_smem, its per-head power of two f returned
    (`_q_load`, then `_q_store` without the fold)."""
    q, amax = _q_load(iq_ptr, n, iq_sn, iq_sh, heads, blk, BLOCK_H, q_l, KPERM)
    return _q_store(q, amax, q_smem, blk, col_l, False)


@gluon.jit
def _tile_block(bt_ptr, slot, bt_stride, n_vis, tile, PAGE: gl.constexpr):
    """With PAGE a multiple of 64, tile `tile`'s page: block_table[slot, tile * 64 // PAGE] (0 for a
    tile past n_vis), loaded an iteration (QF_SMEM: two) ahead of the tile's copies (`_issue`), which
    would otherwise wait a global load's latency for it; else 0 (unused: `_records` loads each entry's)."""
    if PAGE % _BLOCK_E == 0:
        return gl.load(bt_ptr + slot * bt_stride + (tile * _BLOCK_E) // PAGE, mask=tile * _BLOCK_E < n_vis, other=0)
    else:
        return 0


@gluon.jit
def _records(pool_ptr, bt_ptr, slot, bt_stride, n_vis, cand_row, tile, blk, e, PAGE: gl.constexpr,
             HAS_CAND: gl.constexpr):
    """(pointers to the first word of each record, read flags) of tile `tile`'s entries
    j = tile * 64 + e (e: any layout): entry j is pool record block_table[slot, j // PAGE] * PAGE +
    j % PAGE, read where j < n_vis (and in the candidate mask). With PAGE a multiple of 64 a tile
    lies in one page, blk (`_tile_block`): a uniform base and each record at 17 words past the one
    before it."""
    offs = tile * _BLOCK_E + e
    vis = offs < n_vis
    if HAS_CAND:
        vis = vis & (gl.load(cand_row + offs, mask=vis, other=0) != 0)
    # The record offsets go through an opaque move: Triton's alignment analysis would take every
    # blk * PAGE + j % PAGE (or 17 e) for a multiple of a large power of two and copy 16 bytes at a
    # time from records that are 4-byte aligned (as `ops.indexer` avoids by not specializing the
    # page).
    if PAGE % _BLOCK_E == 0:
        base = pool_ptr + (blk.to(gl.int64) * PAGE + (tile * _BLOCK_E) % PAGE) * _WORDS
        words = gl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [e * _WORDS], dtype=gl.int32, is_pure=True,
                                          pack=1)
        return base + words, vis
    else:
        blk = gl.load(bt_ptr + slot * bt_stride + offs // PAGE, mask=vis, other=0)
        rec = gl.inline_asm_elementwise("mov.b64 $0, $1;", "=l,l", [blk.to(gl.int64) * PAGE + offs % PAGE],
                                        dtype=gl.int64, is_pure=True, pack=1)
        return pool_ptr + rec * _WORDS, vis


@gluon.jit
def _issue(raw_s, scl_s, pool_ptr, bt_ptr, slot, bt_stride, n_vis, cand_row, tile, blk, PAGE: gl.constexpr,
           HAS_CAND: gl.constexpr, copy_l: gl.constexpr, scl_l: gl.constexpr):
    """Start the asynchronous copies of tile `tile`'s records into a ring slot (raw_s [64, 16] code
    words; scl_s [2, 64]: row 0 the scale words, row 1 unused, so that each of the 128 threads
    copies one element or none), one commit group; entries past n_vis (or outside the candidate
    mask) are not read (a tile past the row's last is an empty group). blk: the tile's
    `_tile_block`. Each layout computes its own record pointers (cached block-table loads where
    PAGE is not a multiple of 64) rather than converting them through shared memory."""
    e = gl.arange(0, _BLOCK_E, layout=gl.SliceLayout(1, copy_l))
    rec, vis = _records(pool_ptr, bt_ptr, slot, bt_stride, n_vis, cand_row, tile, blk, e, PAGE, HAS_CAND)
    rw = gl.arange(0, 16, layout=gl.SliceLayout(0, copy_l))
    async_copy.async_copy_global_to_shared(raw_s, rec[:, None] + rw[None, :], mask=vis[:, None] & (rw < 16)[None, :])
    e_s = gl.arange(0, _BLOCK_E, layout=gl.SliceLayout(0, scl_l))
    rec_s, vis_s = _records(pool_ptr, bt_ptr, slot, bt_stride, n_vis, cand_row, tile, blk, e_s, PAGE, HAS_CAND)
    rr = gl.arange(0, 2, layout=gl.SliceLayout(1, scl_l))
    async_copy.async_copy_global_to_shared(scl_s, rec_s[None, :] + 16 + rr[:, None],
                                           mask=vis_s[None, :] & (rr == 0)[:, None])
    async_copy.commit_group()


@gluon.jit
def _bf16_pair(x):
    """x rounded to BF16 and widened back to FP32, two elements a conversion (cvt.rn.bf16x2.f32):
    round to nearest even, as `fp4.bf16_round`, but for a NaN's payload (the canonical 0x7FFF
    here, 0x7FC0 there). Used where that cannot show: the relu drops a NaN, and a NaN term makes
    the FP32 head sum the canonical NaN either way."""
    return gl.inline_asm_elementwise(
        "{\n\t.reg .b32 p;\n\tcvt.rn.bf16x2.f32 p, $3, $2;\n\t"
        "shl.b32 $0, p, 16;\n\tand.b32 $1, p, 0xFFFF0000;\n\t}",
        "=r,=r,r,r", [x.to(gl.int32, bitcast=True)], dtype=gl.int32, is_pure=True,
        pack=2).to(gl.float32, bitcast=True)


@gluon.jit
def _weighted_terms_bf16x2(acc, wb):
    """bf16(relu(bf16(acc)) * w) as FP32, two elements an instruction in BF16x2 (`packed_terms`):
    acc FP32; wb int32 holding each element's head weight's BF16 bits in its low half. The product
    of two BF16 values is exact in FP32, so fma.rn.bf16x2(relu, w, -0.0) rounds the same exact
    product once, as `_bf16_pair` of the FP32 product does, for every product that is not an FP32
    subnormal (|term| < 2^-126)."""
    return gl.inline_asm_elementwise(
        "{\n\t.reg .b32 a, b, z, n;\n\tcvt.rn.bf16x2.f32 a, $3, $2;\n\tprmt.b32 b, $4, $5, 0x5410;\n\t"
        "mov.b32 z, 0;\n\tmax.bf16x2 a, a, z;\n\tmov.b32 n, 0x80008000;\n\tfma.rn.bf16x2 a, a, b, n;\n\t"
        "shl.b32 $0, a, 16;\n\tand.b32 $1, a, 0xFFFF0000;\n\t}",
        "=r,=r,r,r,r,r", [acc.to(gl.int32, bitcast=True), wb], dtype=gl.int32, is_pure=True,
        pack=2).to(gl.float32, bitcast=True)


@gluon.jit
def _block_mma(a8, q_smem, zero, blk: gl.constexpr):
    """Scale block blk's partial [64, BLOCK_H]: the K = 32 FP8 wgmma of the key tile's columns
    32 blk .. and the query's, from a zero accumulator (started, not waited for)."""
    return warpgroup_mma(a8.slice(blk * 32, 32, dim=1), q_smem.slice(blk * 32, 32, dim=1).permute((1, 0)), zero,
                         use_acc=False, is_async=True)


@gluon.jit
def _block_scale(sw, blk: gl.constexpr):
    """2^(byte - 127) of scale byte blk of the scale words sw, as `ops.indexer` reads it."""
    return (((sw >> (8 * blk)) & 0xFF) << 23).to(gl.float32, bitcast=True)


@gluon.jit
def _terms_of(acc, xa, xb, ka, kb, FIRST: gl.constexpr):
    """acc + xa ka + xb kb, each product and add one rounding (FMA), in that order; FIRST: xa ka
    + xb kb (acc not read)."""
    if FIRST:
        acc = xa * ka
    else:
        acc = gl.fma(xa, ka, acc)
    return gl.fma(xb, kb, acc)


@gluon.jit
def _times(d, f):
    """d f rounded once (mul.rn.f32: f broadcast to d's shape), opaque to the compiler, which would
    otherwise merge `_block_terms`' two branches back into one multiplication by a selected f."""
    return gl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=r,r,r",
                                     [d.to(gl.int32, bitcast=True), f.to(gl.int32, bitcast=True)],
                                     dtype=gl.int32, is_pure=True, pack=1).to(gl.float32, bitcast=True)


@gluon.jit
def _block_terms(acc, da, db, fa, fb, sw, blk: gl.constexpr, FIRST: gl.constexpr, folded):
    """`_terms_of` for scale blocks blk and blk + 1: acc + (da fa) k_blk + (db fb) k_blk+1, the partials
    da, db times the query's powers of two fa, fb (exact) and the keys' k (the FMA's product exact
    but for subnormals). folded: False (a constant: always the multiplications by f), or the row's
    query fold flag (`_q_store`; a uniform branch): where set, the partials already are (d f), the
    same values, and the multiplications are skipped."""
    xa = da
    xb = db
    if not folded:
        xa = _times(da, fa[None, :])
        xb = _times(db, fb[None, :])
    return _terms_of(acc, xa, xb, _block_scale(sw, blk)[:, None], _block_scale(sw, blk + 1)[:, None], FIRST)


@gluon.jit
def _key_votes(score):
    """(count, bin) per element of `score` (FP32, BF16-representable) in the wgmma accumulator's
    entry layout, where the four lanes of a quad hold the same entries: bin is the high byte of
    `ops.topk._keys`'s order-preserving 16-bit key (group 1: -0.0 keyed as +0.0), and count, on
    the lowest lane of each group of quad-leading lanes (lane % 4 == 0) whose selectable scores
    share a bin, is how many they are (match.any); 0 elsewhere and for scores that are not
    selectable (-inf, NaN). The key's high byte: the bits with the sign's complement flipped in
    (x ^ (x >> 31 | 0x80000000)), the top byte of the result."""
    return gl.inline_asm_elementwise(
        "{\n\t.reg .b32 b, s, k, ln, t, sel, m, lt;\n\t.reg .pred v, z, p, q;\n\t"
        "setp.gt.f32 v, $2, 0fFF800000;\n\t"
        "setp.eq.u32 z, $2, 0x80000000;\n\tselp.b32 b, 0, $2, z;\n\t"
        "shr.s32 s, b, 31;\n\tor.b32 s, s, 0x80000000;\n\txor.b32 k, b, s;\n\tshr.u32 k, k, 24;\n\t"
        "mov.u32 ln, %laneid;\n\tand.b32 t, ln, 3;\n\tsetp.eq.u32 p, t, 0;\n\tand.pred p, p, v;\n\t"
        "add.u32 t, ln, 256;\n\tselp.b32 sel, k, t, p;\n\t"
        "match.any.sync.b32 m, sel, 0xffffffff;\n\t"
        "mov.u32 lt, %lanemask_lt;\n\tand.b32 lt, m, lt;\n\tsetp.eq.u32 q, lt, 0;\n\tand.pred q, q, p;\n\t"
        "popc.b32 t, m;\n\tselp.b32 $0, t, 0, q;\n\tmov.b32 $1, k;\n\t}",
        "=r,=r,r", [score.to(gl.int32, bitcast=True)], dtype=(gl.int32, gl.int32), is_pure=True, pack=1)


@gluon.jit
def _score_tile(a8, q_smem, sw, f0, f1, f2, f3, wv, wb, zero, offs, vis, out_row, max_entries, priv,
                BLOCK_H: gl.constexpr, HIST: gl.constexpr, PACKED: gl.constexpr, MMA_PAIRS: gl.constexpr,
                mma_l: gl.constexpr, folded=False):
    """One row's scores of the key tile in a8 (E4M3 [64, 128], its scale words sw): the four block
    wgmmas against the row's query q_smem (E4M3 [BLOCK_H, 128]; its per-head powers of two f0..f3,
    its head weights wv and their BF16 bits wb, all in the accumulator's column layout), `ops.indexer`'s
    FP8 epilogue, the scores stored at out_row + offs (-inf where not vis, offs < max_entries) and,
    with HIST, their high-byte votes added into the 256 counters at priv. folded: the row's query
    fold flag (`_q_store`), a uniform branch around each pair of blocks' terms, or False (none)."""
    # `ops.indexer`'s FP8 path: each block's partial times the query's then the key's power of
    # two, the four blocks added in order
    if MMA_PAIRS:
        # two blocks' wgmmas at a time: two partials live instead of four (fewer registers)
        d0 = _block_mma(a8, q_smem, zero, 0)
        d1 = _block_mma(a8, q_smem, zero, 1)
        d0, d1 = warpgroup_mma_wait(num_outstanding=0, deps=(d0, d1))
        acc = _block_terms(zero, d0, d1, f0, f1, sw, 0, True, folded)
        d2 = _block_mma(a8, q_smem, zero, 2)
        d3 = _block_mma(a8, q_smem, zero, 3)
        d2, d3 = warpgroup_mma_wait(num_outstanding=0, deps=(d2, d3))
    else:
        d0 = _block_mma(a8, q_smem, zero, 0)
        d1 = _block_mma(a8, q_smem, zero, 1)
        d2 = _block_mma(a8, q_smem, zero, 2)
        d3 = _block_mma(a8, q_smem, zero, 3)
        d0, d1, d2, d3 = warpgroup_mma_wait(num_outstanding=0, deps=(d0, d1, d2, d3))
        acc = _block_terms(zero, d0, d1, f0, f1, sw, 0, True, folded)
    acc = _block_terms(acc, d2, d3, f2, f3, sw, 2, False, folded)
    # the per-(entry, head) bf16 round trips by the packed hardware conversion (`_bf16_pair`),
    # or the relu and the weight too in BF16x2 (PACKED); the score's rounding is `bf16_round`
    # itself (its NaN bits)
    if PACKED:
        term = _weighted_terms_bf16x2(acc, wb[None, :] + gl.zeros([_BLOCK_E, BLOCK_H], gl.int32, mma_l))
    else:
        term = _bf16_pair(gl.maximum(_bf16_pair(acc), 0.0) * wv[None, :])
    score = gl.where(vis, bf16_round(gl.sum(term, axis=1)), float("-inf"))
    gl.store(out_row + offs, score, mask=offs < max_entries)
    if HIST:
        # one relaxed add per distinct bin per warp and entry register into the program's own
        # counters (no contention with other programs, no barrier)
        cnt, b = _key_votes(score)
        gl.atomic_add(priv + b, cnt, mask=cnt > 0, sem="relaxed")


@gluon.jit
def _score_tile_smem(a8, q_smem, sw, f_rows, w_rows, g, zero, offs, vis, out_row, max_entries, priv,
                     BLOCK_H: gl.constexpr, HIST: gl.constexpr, PACKED: gl.constexpr, MMA_PAIRS: gl.constexpr,
                     mma_l: gl.constexpr):
    """`_score_tile` for row g of the rows whose query scales and head weights sit in shared memory
    (f_rows [4 x rows, BLOCK_H]: row g's four powers of two at 4g..4g+3; w_rows [rows, BLOCK_H]),
    read here for this tile (a row group's, or one row's with QF_SMEM)."""
    col_l: gl.constexpr = gl.SliceLayout(0, mma_l)
    wv = w_rows.index(g).load(col_l)
    wb = (wv.to(gl.int32, bitcast=True) >> 16) & 0xFFFF      # its BF16 bits (exact in FP32)
    _score_tile(a8, q_smem, sw, f_rows.index(4 * g).load(col_l), f_rows.index(4 * g + 1).load(col_l),
                f_rows.index(4 * g + 2).load(col_l), f_rows.index(4 * g + 3).load(col_l), wv, wb, zero, offs, vis,
                out_row, max_entries, priv, BLOCK_H, HIST, PACKED, MMA_PAIRS, mma_l)


@triton.jit
def row_group(slot_ptr, nvis_ptr, n, n_rows, GROUP: tl.constexpr):
    """(lead, size, rank) of row n's group: the rows of a run of consecutive rows with row n's
    request slot and entries to score (n_vis > 0: a request's decode and draft rows; a row without
    entries, such as the step's padding rows, is a group of its own) taken GROUP at a time from the
    run's first row; lead the group's first row, size its rows (1..GROUP), rank row n's place in
    it. Every row of a group computes the same group. A Triton function (scalar loads only), so the
    interpreter tests the scorer's grouping on the CPU (tests/ops/test_gluon_indexer.py)."""
    slot_n = tl.load(slot_ptr + n)
    first = n
    if tl.load(nvis_ptr + n) > 0:
        # the GROUP - 1 rows before row n in one round of independent loads (a request's rows: its
        # decode row and its drafts), then one row at a time where the run is longer
        go = n >= 0
        for j in tl.static_range(1, GROUP):
            ok = n - j >= 0
            same = (tl.load(slot_ptr + n - j, mask=ok, other=0) == slot_n) & (tl.load(nvis_ptr + n - j, mask=ok,
                                                                                       other=0) > 0)
            go = go & ok & same
            first -= go.to(tl.int32)
        go = go & (first > 0)
        go = go & (tl.load(slot_ptr + first - 1, mask=go, other=0) == slot_n)
        go = go & (tl.load(nvis_ptr + first - 1, mask=go, other=0) > 0)
        while go:
            first -= 1
            go = (first > 0) & (tl.load(slot_ptr + first - 1, mask=first > 0, other=0) == slot_n)
            go = go & (tl.load(nvis_ptr + first - 1, mask=first > 0, other=0) > 0)
    lead = first + (n - first) // GROUP * GROUP
    size = n * 0 + 1
    grow = tl.load(nvis_ptr + n) > 0
    for j in tl.static_range(1, GROUP):
        ok = lead + j < n_rows
        nxt = tl.load(slot_ptr + lead + j, mask=ok, other=0)
        more = tl.load(nvis_ptr + lead + j, mask=ok, other=0) > 0
        size += (grow & (nxt == slot_n) & ok & more & (size == j)).to(tl.int32)
    return lead, size, n - lead


@gluon.jit(do_not_specialize=["heads", "max_entries", "bt_stride", "iq_sn", "iq_sh", "w_sn", "cand_sn", "out_sn",
                              "hist_sn"])
def _gluon_index_scores_kernel(iq_ptr, w_ptr, pool_ptr, bt_ptr, slot_ptr, nvis_ptr, cand_ptr, out_ptr, hist_ptr,
                               scratch_ptr, heads, max_entries, bt_stride, iq_sn, iq_sh, w_sn, cand_sn, out_sn, hist_sn,
                               PAGE: gl.constexpr, BLOCK_H: gl.constexpr, STAGES: gl.constexpr,
                               HAS_CAND: gl.constexpr, HIST: gl.constexpr, PACKED: gl.constexpr = False,
                               MMA_PAIRS: gl.constexpr = False, KPERM: gl.constexpr = False,
                               GROUP: gl.constexpr = 1, QF_SMEM: gl.constexpr = False,
                               FOLD_Q: gl.constexpr = False):
    n = gl.program_id(0)
    pid = gl.program_id(1)
    nprog = gl.num_programs(1)
    gl.static_assert(GROUP == 1 or not HAS_CAND, "row groups are scored without a candidate mask")
    gl.static_assert(not FOLD_Q or (GROUP == 1 and not QF_SMEM), "the query fold is one row's, held in registers")

    # the records' copy: four words of one record a thread, a warp's lanes along 8 records' code
    # words (512 contiguous bytes but for the scale words between records); two records a thread
    copy_l: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 4], threads_per_warp=[8, 4],
                                            warps_per_cta=[4, 1], order=[1, 0])
    # the scale words' copy: [2, 64] (row 1 unused), one element a thread
    scl_l: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 1], threads_per_warp=[1, 32],
                                           warps_per_cta=[2, 2], order=[1, 0])
    q_l: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[8, 4],
                                         warps_per_cta=[4, 1], order=[1, 0])
    mma_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                    instr_shape=[16, BLOCK_H, 32])
    row_l: gl.constexpr = gl.SliceLayout(1, mma_l)     # per entry
    col_l: gl.constexpr = gl.SliceLayout(0, mma_l)     # per head
    hist_l: gl.constexpr = gl.BlockedLayout(size_per_thread=[2], threads_per_warp=[32], warps_per_cta=[4],
                                            order=[0])

    plain: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])
    plain1: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
    raw = gl.allocate_shared_memory(gl.int32, [STAGES, _BLOCK_E, 16], plain)
    scl = gl.allocate_shared_memory(gl.int32, [STAGES, 2, _BLOCK_E], plain)
    # the E4M3 key tile, written as int32 words (4 bytes each) and read by the wgmma as bytes: the
    # same 128-byte swizzle of 16-byte chunks either way
    a_words = gl.allocate_shared_memory(gl.int32, [_BLOCK_E, 32],
                                        gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2))
    a8 = a_words._reinterpret(gl.float8e4nv, [_BLOCK_E, 128],
                              gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2))
    q_l8: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)
    if GROUP == 1:
        q_smem = gl.allocate_shared_memory(gl.float8e4nv, [BLOCK_H, 128], q_l8)
        if QF_SMEM:
            # the query's powers of two and head weights, read back for each tile instead of held
            f_rows = gl.allocate_shared_memory(gl.float32, [4, BLOCK_H], plain1)
            w_rows = gl.allocate_shared_memory(gl.float32, [1, BLOCK_H], plain1)
        n_vis = gl.minimum(gl.load(nvis_ptr + n), max_entries)
        lead = n
        size = 1
        first_tile = pid
        stride = nprog
    else:
        # the group's rows share its key tiles: its size x nprog programs take them in turn, each
        # scoring every row of the group on its tiles (the rows' queries, powers of two and head
        # weights in shared memory); the records are read up to the group's largest n_vis
        lead, size, rank = row_group(slot_ptr, nvis_ptr, n, gl.num_programs(0), GROUP)
        q_rows = gl.allocate_shared_memory(gl.float8e4nv, [GROUP, BLOCK_H, 128], q_l8)
        f_rows = gl.allocate_shared_memory(gl.float32, [4 * GROUP, BLOCK_H], plain1)
        w_rows = gl.allocate_shared_memory(gl.float32, [GROUP, BLOCK_H], plain1)
        n_vis = gl.minimum(gl.load(nvis_ptr + lead), max_entries)
        for j in gl.static_range(1, GROUP):
            v = gl.load(nvis_ptr + lead + j, mask=j < size, other=0)
            n_vis = gl.maximum(n_vis, gl.minimum(v, max_entries))
        first_tile = rank * nprog + pid
        stride = size * nprog
    slot = gl.load(slot_ptr + n).to(gl.int64)
    out_row = out_ptr + n.to(gl.int64) * out_sn
    cand_row = cand_ptr + n.to(gl.int64) * cand_sn
    n_tiles = gl.cdiv(n_vis, _BLOCK_E)

    # the first STAGES - 1 tiles in flight before the query is prepared
    for s in gl.static_range(STAGES - 1):
        blk = _tile_block(bt_ptr, slot, bt_stride, n_vis, first_tile + s * stride, PAGE)
        _issue(raw.index(s), scl.index(s), pool_ptr, bt_ptr, slot, bt_stride, n_vis, cand_row, first_tile + s * stride,
               blk, PAGE, HAS_CAND, copy_l, scl_l)
    # the page of the tile the loop's first iteration issues (each iteration loads the next one's)
    blk_n = _tile_block(bt_ptr, slot, bt_stride, n_vis, first_tile + (STAGES - 1) * stride, PAGE)
    if QF_SMEM:
        # (at 96 registers ptxas reads a page loaded one iteration ahead early in the next: two ahead)
        blk_nn = _tile_block(bt_ptr, slot, bt_stride, n_vis, first_tile + STAGES * stride, PAGE)

    rh = gl.arange(0, BLOCK_H, layout=col_l)
    folded = False
    if GROUP == 1:
        # the row's four query blocks first: with FOLD_Q the fold holds where every block of every head allows it
        q0, a0 = _q_load(iq_ptr, n, iq_sn, iq_sh, heads, 0, BLOCK_H, q_l, KPERM)
        q1, a1 = _q_load(iq_ptr, n, iq_sn, iq_sh, heads, 1, BLOCK_H, q_l, KPERM)
        q2, a2 = _q_load(iq_ptr, n, iq_sn, iq_sh, heads, 2, BLOCK_H, q_l, KPERM)
        q3, a3 = _q_load(iq_ptr, n, iq_sn, iq_sh, heads, 3, BLOCK_H, q_l, KPERM)
        if FOLD_Q:
            ok = _q_foldable(a0) & _q_foldable(a1) & _q_foldable(a2) & _q_foldable(a3)
            folded = gl.min(ok.to(gl.int32), axis=0) == 1
        f0 = _q_store(q0, a0, q_smem, 0, col_l, folded)
        f1 = _q_store(q1, a1, q_smem, 1, col_l, folded)
        f2 = _q_store(q2, a2, q_smem, 2, col_l, folded)
        f3 = _q_store(q3, a3, q_smem, 3, col_l, folded)
        wraw = gl.load(w_ptr + n.to(gl.int64) * w_sn + rh, mask=rh < heads, other=0.0)
        wv = wraw.to(gl.float32)
        wb = wraw.to(gl.int16, bitcast=True).to(gl.int32) & 0xFFFF
        if QF_SMEM:
            # the loop's first barrier orders these stores before its reads
            f_rows.index(0).store(f0)
            f_rows.index(1).store(f1)
            f_rows.index(2).store(f2)
            f_rows.index(3).store(f3)
            w_rows.index(0).store(wv)
    else:
        # the group's rows' slots (a program without tiles skips them); the loop's first barrier
        # orders these stores before its reads
        for j in gl.static_range(GROUP):
            if (j < size) & (first_tile < n_tiles):
                row = lead + j
                for b in gl.static_range(4):
                    f_rows.index(4 * j + b).store(_q_block(iq_ptr, row, iq_sn, iq_sh, heads, q_rows.index(j), b,
                                                           BLOCK_H, q_l, col_l, KPERM))
                w_rows.index(j).store(gl.load(w_ptr + row.to(gl.int64) * w_sn + rh, mask=rh < heads,
                                              other=0.0).to(gl.float32))
    zero = gl.zeros([_BLOCK_E, BLOCK_H], gl.float32, mma_l)
    bins = gl.arange(0, _HIST_BINS, layout=hist_l)
    # the program's own histograms, one per row it scores (GROUP): 256 counters each in global
    # memory (L2) that only this program adds to
    priv = scratch_ptr + (n * nprog + pid).to(gl.int64) * (GROUP * _HIST_BINS)
    if HIST:
        for j in gl.static_range(GROUP):      # before the loop's first barrier
            gl.store(priv + j * _HIST_BINS + bins, gl.zeros([_HIST_BINS], gl.int32, hist_l))

    i = 0
    for t in range(first_tile, n_tiles, stride):
        # tile t's copies (this thread's) have landed; the barrier makes every thread's visible and
        # says that every thread is done with the slot refilled next (read one iteration ago)
        async_copy.wait_group(STAGES - 2)
        gl.thread_barrier()
        # the copies of tile t + STAGES - 1 into the slot read one iteration ago (its page loaded an
        # iteration ago), the page of the tile after that, then this tile's words out of its slot
        cur = i % STAGES
        nxt = (i + STAGES - 1) % STAGES
        _issue(raw.index(nxt), scl.index(nxt), pool_ptr, bt_ptr, slot, bt_stride, n_vis, cand_row,
               t + (STAGES - 1) * stride, blk_n, PAGE, HAS_CAND, copy_l, scl_l)
        if QF_SMEM:
            blk_n = blk_nn
            blk_nn = _tile_block(bt_ptr, slot, bt_stride, n_vis, t + (STAGES + 1) * stride, PAGE)
        else:
            blk_n = _tile_block(bt_ptr, slot, bt_stride, n_vis, t + STAGES * stride, PAGE)
        words = raw.index(cur).load(copy_l)
        sw = scl.index(cur)._reinterpret(gl.int32, [2 * _BLOCK_E], plain1).slice(0, _BLOCK_E).load(row_l)
        if KPERM:
            # block b's 8 words: its 4 code words' low-nibble bytes, then their high-nibble bytes (a
            # thread holds one block's 4 words: no byte permutes)
            lo, hi = _widen_split(words)
            a4 = gl.permute(gl.join(gl.reshape(lo, [_BLOCK_E, 4, 4]), gl.reshape(hi, [_BLOCK_E, 4, 4])), [0, 1, 3, 2])
            a_words.store(gl.reshape(a4, [_BLOCK_E, 32]))
        else:
            lo, hi = _widen(words)
            a_words.store(gl.reshape(gl.join(lo, hi), [_BLOCK_E, 32]))
        # the generic-proxy stores before the wgmma's (async proxy) reads, from every thread
        fence_async_shared()
        gl.thread_barrier()
        offs = t * _BLOCK_E + gl.arange(0, _BLOCK_E, layout=row_l)
        if GROUP == 1:
            vis = offs < n_vis
            if HAS_CAND:
                vis = vis & (gl.load(cand_row + offs, mask=vis, other=0) != 0)
            if QF_SMEM:
                _score_tile_smem(a8, q_smem, sw, f_rows, w_rows, 0, zero, offs, vis, out_row, max_entries, priv,
                                 BLOCK_H, HIST, PACKED, MMA_PAIRS, mma_l)
            else:
                _score_tile(a8, q_smem, sw, f0, f1, f2, f3, wv, wb, zero, offs, vis, out_row, max_entries, priv,
                            BLOCK_H, HIST, PACKED, MMA_PAIRS, mma_l, folded)
        else:
            for g in range(size):
                row = lead + g
                _score_tile_smem(a8, q_rows.index(g), sw, f_rows, w_rows, g, zero, offs,
                                 offs < gl.minimum(gl.load(nvis_ptr + row), max_entries),
                                 out_ptr + row.to(gl.int64) * out_sn, max_entries, priv + g * _HIST_BINS, BLOCK_H,
                                 HIST, PACKED, MMA_PAIRS, mma_l)
        i += 1
    async_copy.wait_group(0)

    if HIST:
        # every thread's adds are done (the barrier orders them before these reads, from L2)
        gl.thread_barrier()
        for g in range(size):                # each row the program scored (its group's)
            h = gl.load(priv + g * _HIST_BINS + bins, cache_modifier=".cg")
            gl.store(priv + g * _HIST_BINS + bins, gl.zeros([_HIST_BINS], gl.int32, hist_l))   # each thread its own
            gl.atomic_add(hist_ptr + (lead + g).to(gl.int64) * hist_sn + bins, h, mask=h > 0, sem="relaxed")

    neg = gl.full([_BLOCK_E], float("-inf"), gl.float32, row_l)
    for g in range(size):
        row_g = out_ptr + (lead + g).to(gl.int64) * out_sn
        for t in range(n_tiles + first_tile, gl.cdiv(max_entries, _BLOCK_E), stride):
            offs = t * _BLOCK_E + gl.arange(0, _BLOCK_E, layout=row_l)
            gl.store(row_g + offs, neg, mask=offs < max_entries)


def query_fold_rows(iq: torch.Tensor) -> torch.Tensor:
    """Bool [N]: the rows of iq [N, Hi, 128] (the contract's MXFP4 values) that `fold_q` folds: every
    32-dim block of every head has its largest |q| zero or with an exponent byte in [FOLD_Q_EXP_MIN,
    FOLD_Q_EXP_MAX] = [115, 129] (the kernel's `_q_foldable`). Why that holds 64 q exactly in E4M3: q =
    m 2^s with m in E2M1's {0.5, 1, 1.5, 2, 3, 4, 6}, so 64 q = 1 x 2^p or 1.5 x 2^p, exact in E4M3
    for p in [-9, 8] and [-8, 8]; amax < 8 (byte <= 129) gives amax <= 6 (the values of that form
    below 8), so 64 q <= 384; amax >= 2^-12 (byte >= 115) and amax <= 6 x 2^s give s >= -14, so the
    smallest value 0.5 x 2^s gives p >= -9 and 1.5 x 2^s p >= -8. For other values (outside the
    contract) a row may fold and 64 q not be exact."""
    amax = iq.float().abs().unflatten(-1, (-1, 32)).amax(-1)
    e = (amax.view(torch.int32) >> 23) & 0xFF
    ok = (amax == 0) | ((e >= FOLD_Q_EXP_MIN) & (e <= FOLD_Q_EXP_MAX))
    return ok.flatten(1).all(1)


def block_h(heads: int) -> int:
    """The wgmma's N for `heads` index heads: `ops.indexer`'s BLOCK_H (a power of two >= 16)."""
    return max(16, triton.next_power_of_2(heads))


def shared_bytes(stages: int, heads: int, group: int = 1, qf_smem: bool = False) -> int:
    """A program's shared memory: the ring (stages x 64 records: 16 code words and 2 scale-column
    words each), the E4M3 key tile, the E4M3 query (with row groups, `group` of them, each with its
    four FP32 powers of two and head weights a head; with qf_smem the one row's) and 1 KB for what
    the compiler adds."""
    rows = block_h(heads) * (128 + (5 * 4 if qf_smem else 0) if group == 1 else group * (128 + 5 * 4))
    return stages * BLOCK_E * 18 * 4 + BLOCK_E * 128 + rows + 1024


def launch_options(heads: int, page: int, stages: int, cand: bool, hist: bool, maxnreg: int | None = None,
                   packed_terms: bool = False, mma_pairs: bool = False, kperm: bool = False, group: int = 1,
                   qf_smem: bool = False, fold_q: bool = False) -> dict:
    """The kernel's constexpr arguments and launch options (the launch and the sm_90 compile test
    share them). The page is a constant of the kernel (a record's place without a division);
    maxnreg: a register cap per thread (None: the compiler's choice); packed_terms: the weighted
    terms in BF16x2 (`_weighted_terms_bf16x2`); mma_pairs: the four block wgmmas two at a time;
    kperm: each block's key dims in `_widen_split`'s order (no byte permutes), the query's to match;
    group: the rows a program scores on each key tile it reads (`gluon_index_scores_mxfp4_`'s
    row_group; 1 with a candidate mask, which the kernel refuses to group); qf_smem: the query's
    powers of two and head weights read from shared memory for each tile (a row group's always are),
    and each tile's page loaded two iterations ahead; with mma_pairs at <= 32 heads and no maxnreg, a
    cap of QF_SMEM_MAXNREG registers (five programs an SM: uncapped, ptxas takes ~121); fold_q: the
    query fold (`gluon_index_scores_mxfp4_`'s), where the launch scores one row a program with the
    query's powers of two in registers at <= 64 heads (group 1, no qf_smem; elsewhere off: at 128
    heads, where the kernel spills already, it spilled more in the sm_90 compile)."""
    qf = bool(qf_smem) and group == 1
    opts = {"PAGE": page, "BLOCK_H": block_h(heads), "STAGES": stages, "HAS_CAND": cand, "HIST": hist,
            "PACKED": bool(packed_terms), "MMA_PAIRS": bool(mma_pairs), "KPERM": bool(kperm),
            "GROUP": group, "QF_SMEM": qf, "FOLD_Q": bool(fold_q) and group == 1 and not qf and block_h(heads) <= 64,
            "num_warps": 4}
    if maxnreg is None and opts["QF_SMEM"] and mma_pairs and opts["BLOCK_H"] <= 32:
        maxnreg = QF_SMEM_MAXNREG
    if maxnreg is not None:
        opts["maxnreg"] = maxnreg
    return opts


def programs_per_row(n_rows: int, max_entries: int, device, programs_per_sm: int) -> int:
    """The launch's programs per row: `one_wave_programs` over the row's 64-entry tiles."""
    return one_wave_programs(n_rows, triton.cdiv(max_entries, BLOCK_E), programs_per_sm, device)


# The launch's defaults by its size (rows x max_entries), measured on an H200
# (scripts/probe_gluon_indexer.py, 32 heads, pages of 64; us, every configuration the same bits):
#   rows x context       1 x 8K   1 x 32K   1 x 128K   1 x 1M   16 x 128K   64 x 128K
#   3 an SM              4.26     7.26      12.39      60.59    187.82      622.68
#   4 an SM, pairs+kperm 4.33     7.71      12.34      53.90    100.97      510.49
# so the wgmmas two at a time with the permuted key order at four programs an SM, except for the
# small calls, where three programs an SM with four wgmmas in flight measured faster (measured at 1 row;
# other calls of as many tiles, 4 rows x 8K, are assumed alike).
SMALL_CALL_MAX = 1 << 15   # rows x max_entries of a launch at or under which it takes the small calls' options


def default_options(n_rows: int, max_entries: int) -> dict:
    """The launch's defaults for N rows of max_entries: {"programs_per_sm", "mma_pairs", "kperm"}
    (3, False, False) at n_rows * max_entries <= SMALL_CALL_MAX, else (4, True, True)."""
    if n_rows * max_entries <= SMALL_CALL_MAX:
        return {"programs_per_sm": 3, "mma_pairs": False, "kperm": False}
    return {"programs_per_sm": 4, "mma_pairs": True, "kperm": True}


def hist_scratch_numel(n_rows: int, max_entries: int, device, programs_per_sm: int | None = None,
                       row_group: int = 1) -> int:
    """The int32 elements `gluon_index_scores_mxfp4_(..., hist=, hist_scratch=)` needs: 256 per program
    and row it may score (row_group; programs_per_sm None: the launch's default, `default_options`)."""
    if programs_per_sm is None:
        programs_per_sm = default_options(n_rows, max_entries)["programs_per_sm"]
    return n_rows * programs_per_row(n_rows, max_entries, device, programs_per_sm) * HIST_BINS * row_group


def gluon_index_scores_mxfp4_(iq: torch.Tensor, w: torch.Tensor, pool: torch.Tensor, block_table: torch.Tensor,
                              page: int, req_slot: torch.Tensor, n_vis: torch.Tensor, out: torch.Tensor,
                              cand_mask: torch.Tensor | None = None, hist: torch.Tensor | None = None,
                              stages: int = 4, programs_per_sm: int | None = None, maxnreg: int | None = None,
                              packed_terms: bool = False, mma_pairs: bool | None = None, kperm: bool | None = None,
                              hist_scratch: torch.Tensor | None = None, row_group: int = 1,
                              qf_smem: bool = False, fold_q: bool = False) -> torch.Tensor:
    """Write the indexer scores of N decode rows into `out`: `ops.indexer.index_scores_mxfp4_(...,
    fp8_dot=True)`'s arguments and scores (see the module docstring), on an sm_90 device.

    iq, w, pool, block_table, page, req_slot, n_vis, out, cand_mask: as `index_scores_mxfp4_`
    (the same checks; iq is additionally limited to Hi <= 128 heads, as there).
    hist: optional int32 [N, W] (W >= 256, last dim contiguous), a top-k workspace (`ops.topk`,
      `_WS_HI` at column 0): the launch adds to hist[n, 0:256] the histogram of the high bytes of
      row n's selectable scores' 16-bit keys (`ops.topk._keys`, group 1); the caller zeroes it.
    hist_scratch: with hist, optionally the programs' counters: int32, contiguous, at least
      `hist_scratch_numel(N, max_entries, device, programs_per_sm, row_group)` elements; left as it was found
      when that was zero (each program zeroes its counters before and after use). None: the launch
      allocates one (torch.empty).
    stages: ring slots of 64 records (2..MAX_STAGES); STAGES - 1 tiles are in flight per program.
    programs_per_sm, mma_pairs, kperm: None (each) takes `default_options(N, max_entries)`'s value
      (max_entries = out's width): the configuration measured fastest at that size.
    programs_per_sm: each row gets floor(programs_per_sm * SMs / N) programs, at least one and at most
      one per 64-entry tile (`programs_per_row`: one wave; 3: the programs an SM holds at 32 heads,
      ~150 registers a thread; 4 with mma_pairs, 128 registers, or maxnreg=128).
    maxnreg: the launch's register cap per thread (`launch_options`), None or a multiple of 8 in [64, 256].
    packed_terms: relu, weight and their BF16 roundings two terms an instruction (BF16x2): the same
      bits but where a weighted term is an FP32 subnormal (|term| < 2^-126), so off by default (on
      the H200 1-5 % faster than without it, with mma_pairs and kperm).
    mma_pairs: the four block wgmmas two at a time (two partials live instead of four: 128 registers
      a thread instead of ~150 at 32 heads, four programs an SM); the same bits.
    kperm: the key tile's columns in a block in the widening's natural order (low nibbles' bytes, then
      high nibbles'), the query's permuted to match (no byte permutes); the same bits (a block's
      products are exact).
    row_group: 1, 2 or 4. Above 1 (and without cand_mask; with it rows are scored one a program: the
      union of a group's masks took 156-176 registers with mma_pairs, three programs an SM, and
      spilled at a cap of 128, sm_90 compiles),
      consecutive rows of one request slot with n_vis > 0 (a request's decode and draft rows) are
      scored row_group at a time on each key tile read: a run of such rows splits into groups of
      row_group from its first row (a row with n_vis 0 is a group of its own; a call of one row
      runs without groups), and a group's programs (row_group x its rows' share) take its tiles in
      turn up to its rows' largest n_vis, each scoring every row of the group on them (the keys read
      and widened once a group instead of once a row; the same bits: each row's scores are the same
      MMAs and epilogue). Finding a row's group costs a few dependent loads before the first copy.
      With hist the scratch holds row_group counters a program (`hist_scratch_numel`).
    qf_smem: the query's four powers of two and the head weights kept in shared memory and read
      for each tile instead of held in registers across the loop (a row group's always are): the
      same bits; at <= 32 heads with mma_pairs compiled at a cap of QF_SMEM_MAXNREG = 96 registers
      a thread (128 without it; sm_90 compiles, no spills), so five programs an SM fit
      (`programs_per_sm=5`), for 20 more shared-memory loads a tile and each tile's page loaded two
      iterations ahead. Off by default (`default_options` holds the configurations measured fastest).
    fold_q: the query fold: a row whose every query block (of every head) has its largest |q| zero or
      with an exponent byte in [115, 129] (`query_fold_rows`: largest |q| <= 6 and >= 2^-12) holds 64 q
      itself as its E4M3 operand, exact there for the contract's MXFP4 values (iq as the step makes
      it; other values may fold and then give other bits), instead of each block
      normalized by a power of two of its own; a key block's wgmma then returns the partial times the
      query's power of two, and the epilogue skips that multiplication (4 of the 8 FP32 operations
      that sum an (entry, head) term's four blocks): the same values, so the same bits. The other
      rows take the epilogue as without it (two uniform branches a tile). Applies where rows are scored one a
      program without qf_smem at <= 64 heads (ignored with row groups, qf_smem or 128 heads). Off by
      default (the step's scorer takes it, `decode.attention.INDEX_FOLD_Q`: its queries are MXFP4);
      alone 0.5-3.7 % faster at 1-64 rows x 32K-128K (H100, docs/attn.md).
    Unchecked: as `index_scores_mxfp4_`. Returns out.
    """
    n_rows, heads = index_scores_args(iq, w, pool, block_table, page, req_slot, n_vis, out, cand_mask)
    if hist is not None and not (hist.dim() == 2 and hist.shape[0] == n_rows and hist.shape[1] >= HIST_BINS
                                 and hist.dtype == torch.int32 and hist.stride(1) == 1):
        raise ValueError(f"hist must be None or an int32 [N={n_rows}, >= {HIST_BINS}] tensor with a contiguous "
                         f"last dim, got {tuple(hist.shape)} {hist.dtype}")
    if hist is not None and hist.device != iq.device:
        raise ValueError(f"hist must be on iq's device {iq.device}, got {hist.device}")
    if hist_scratch is not None and not (hist_scratch.dtype == torch.int32 and hist_scratch.is_contiguous()
                                         and hist_scratch.device == iq.device):
        raise ValueError(f"hist_scratch must be None or a contiguous int32 tensor on {iq.device}, got "
                         f"{tuple(hist_scratch.shape)} {hist_scratch.dtype} on {hist_scratch.device}")
    if isinstance(row_group, bool) or not isinstance(row_group, int) or row_group not in ROW_GROUPS:
        raise ValueError(f"row_group must be one of {ROW_GROUPS}, got {row_group!r}")
    if not isinstance(qf_smem, bool):
        raise ValueError(f"qf_smem must be a bool, got {qf_smem!r}")
    if not isinstance(fold_q, bool):
        raise ValueError(f"fold_q must be a bool, got {fold_q!r}")
    if isinstance(stages, bool) or not isinstance(stages, int) or not 2 <= stages <= MAX_STAGES:
        raise ValueError(f"stages must be an int in [2, {MAX_STAGES}], got {stages!r}")
    defaults = default_options(n_rows, out.shape[1])
    programs_per_sm = defaults["programs_per_sm"] if programs_per_sm is None else programs_per_sm
    mma_pairs = defaults["mma_pairs"] if mma_pairs is None else mma_pairs
    kperm = defaults["kperm"] if kperm is None else kperm
    require_int(programs_per_sm, "programs_per_sm")
    if maxnreg is not None and (isinstance(maxnreg, bool) or not isinstance(maxnreg, int) or not 64 <= maxnreg <= 256
                                or maxnreg % 8):
        raise ValueError(f"maxnreg must be None or a multiple of 8 in [64, 256], got {maxnreg!r}")
    if not is_sm90(iq.device):
        raise ValueError(f"iq's device must be a CUDA device of compute capability 9.0 (the Gluon scorer is sm_90 "
                         f"code: wgmma), got {iq.device}; use ops.indexer.index_scores_mxfp4_")
    max_entries = out.shape[1]
    if n_rows == 0 or max_entries == 0:
        return out
    cand = cand_mask.view(torch.uint8) if cand_mask is not None else out
    hist_t = hist if hist is not None else n_vis
    grid = (n_rows, programs_per_row(n_rows, max_entries, iq.device, programs_per_sm))
    group = row_group if cand_mask is None and n_rows > 1 else 1      # one row: nothing to group
    scratch = n_vis
    if hist is not None:
        # each program's own 256 counters a row it scores, which it zeroes first: any contents will do
        need = grid[0] * grid[1] * HIST_BINS * group
        if hist_scratch is None:
            scratch = torch.empty(need, dtype=torch.int32, device=iq.device)
        elif hist_scratch.numel() < need:
            raise ValueError(f"hist_scratch must hold >= {need} elements (hist_scratch_numel), got {hist_scratch.numel()}")
        else:
            scratch = hist_scratch
    _gluon_index_scores_kernel[grid](
        iq, w, pool.view(torch.int32), block_table, req_slot, n_vis, cand, out, hist_t, scratch,
        heads, max_entries, block_table.stride(0), iq.stride(0), iq.stride(1), w.stride(0),
        cand.stride(0), out.stride(0), hist_t.stride(0),
        **launch_options(heads, page, stages, cand_mask is not None, hist is not None, maxnreg, packed_terms,
                         mma_pairs, kperm, group, qf_smem, fold_q))
    return out
