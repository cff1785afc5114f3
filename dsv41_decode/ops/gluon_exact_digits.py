"""The FP16 digit forms of `ops.gluon_exact_mm.GluonExactMM` (`GluonExactConfig.convert` "f16d",
"f16w", "f16wp"): a 32-deep block of the contract-exact MXFP8 linear on FP16 tensor cores, bitwise
the FP64 forms' block partials, in that kernel's ring, scales, K order, K split and epilogue.

Each E4M3 value v splits exactly into two FP16 digits (`digits`: vh = v rounded to an integer,
|vh| <= 448; vl = v - vh, a multiple of 2^-9 with |vl| <= 1/2), and a block's dot is hh + mid + ll
(`digit_partial`): hh = wh . xh sums integers below 448^2 (the sum below 2^23), mid = wh . xl + wl .
xh multiples of 2^-9 (below 2^14), ll = wl . xl multiples of 2^-18 (at most 2^3), each at most 24
significant bits, so an FP16 MMA (products exact) forms each exactly when its adds keep 24 bits
below their largest term - a property of the hardware, not of IEEE arithmetic, which
scripts/probe_digit_mma.py measures (every dot of its data sets exact on the H200, wgmma and
mma.sync) and the GPU tests check bitwise; hh + mid + ll is then rounded once (`chained_dot`: mid
first, split into an integer mi and a remainder by the 1.5 x 2^23 trick, then hh's and ll's MMAs
accumulate onto mi and mid - mi - two exact partial sums - and one add rounds their sum: four FP32
adds a block and output, where adding the three dots' results would take six).

- "f16d": four mma.sync m16n8k16 a block in `gluon_exact_mm`'s MMA layout, the operands loaded by
  `operand16` in a k permutation that makes each thread's bytes one 8-byte load (`digit_partial`);
  with warps_k > 1 batched over the slot's blocks (`digit_slot_partials`).
- "f16w": the same as asynchronous wgmmas of one consumer warpgroup (`consumer_wg`: x's digits
  written once a slot to shared memory in that permutation and x's scales decoded once a slot
  beside them, the weight's digits the register A operand; `_issue_mid`, `_issue_parts`); "f16wp"
  with the next block's cross dots issued before the current block's rounding.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                                warpgroup_mma_wait)

from .gluon_exact_common import fused_scale, fused_scales_ok, fused_take, scaled_term, take_term, wait_slot, ws_tile
from .gluon_ring import scale_byte, slot_words


@gluon.jit
def digits(codes):
    """(h, l) of E4M3 codes (float8e4nv, any layout) as FP16: h = the value rounded to an integer
    (|h| <= 448; v + 1536 lies in [1088, 1984], where FP16's spacing is 1, so the add rounds v to an
    integer and the subtraction is exact), l = v - h (exact: a multiple of 2^-9 with |l| <= 1/2).
    Both are exact FP16 values: the digits of `digit_partial`."""
    v = codes.to(gl.float16)
    h = (v + 1536.0) - 1536.0
    return h, v - h


@gluon.jit
def operand16(view, layout: gl.constexpr, OPERAND: gl.constexpr):
    """An MMA operand of one 32-deep K block from shared memory in the FP16 MMA's operand layout
    `layout` (k_width 2), its k in a fixed permutation (the same for both operands; a block's exact
    sum does not depend on it): the weight [BN, 32] (OPERAND 0) or x [32, BT] (OPERAND 1, `view` the
    tile's columns transposed). A thread of the m16n8k16 layout holds k = 16 s + 8 u + 2 t + v
    (s, u, v in {0, 1}, t its lane's index mod 4) of each of its rows; they are loaded from
    columns 8 t + 4 s + 2 u + v, eight consecutive bytes (one wide load), and renamed into the
    operand layout without moving data (`assert_trivial`)."""
    if OPERAND == 0:
        BN: gl.constexpr = view.shape[0]
        like = gl.zeros([BN, 32], gl.int8, layout)
        phys: gl.constexpr = gl.reshape(gl.permute(gl.reshape(like, [BN, 2, 2, 4, 2]), (0, 3, 1, 2, 4)),
                                        [BN, 32]).type.layout
        v = gl.reshape(gl.permute(gl.reshape(view.load(phys), [BN, 4, 2, 2, 2]), (0, 2, 3, 1, 4)), [BN, 32])
    else:
        BT: gl.constexpr = view.shape[1]
        like = gl.zeros([32, BT], gl.int8, layout)
        phys: gl.constexpr = gl.reshape(gl.permute(gl.reshape(like, [2, 2, 4, 2, BT]), (2, 0, 1, 3, 4)),
                                        [32, BT]).type.layout
        v = gl.reshape(gl.permute(gl.reshape(view.load(phys), [4, 2, 2, 2, BT]), (1, 2, 0, 3, 4)), [32, BT])
    return gl.convert_layout(v, layout, assert_trivial=True)


@gluon.jit
def round_mid(mid):
    """The cross dots' exact sum (FP32, any layout; |mid| < 2^14) rounded to an integer by the 1.5 x
    2^23 trick: mi, with mid - mi exact and at most 1/2 - the two accumulators `chained_dot`'s other
    MMAs start from."""
    return (mid + 12582912.0) - 12582912.0


@gluon.jit
def chained_dot(wh, wl, xh, xl, zero):
    """RN(hh + mid + ll) of the digits' three exact dots on mma.sync (FP16 operands in the MMA's
    operand layouts, `zero` its FP32 accumulator): mid = wh . xl + wl . xh first, mi = mid rounded
    to an integer (the 1.5 x 2^23 trick), then H = hh + mi and L = ll + (mid - mi) as the MMAs of
    hh and ll accumulating onto mi and mid - mi, and one rounding in H + L. H sums integers below
    2^24 and L multiples of 2^-18 below 2^4, each at most 24 significant bits: exact under the same
    property of the MMA's adds as the three dots themselves (`digit_partial`), so H + L rounds the
    block's exact dot once (`consumer_wg` runs the same on wgmma)."""
    mid = mma_v2(wl, xh, mma_v2(wh, xl, zero))
    mi = round_mid(mid)
    return mma_v2(wh, xh, mi) + mma_v2(wl, xl, mid - mi)


@gluon.jit
def digit_partial(w_tile, x_tile, j: gl.constexpr, mma_layout: gl.constexpr):
    """The exact dot of K block j of the slot's weight tile [BN, 128 or 256] and activation tile
    [BT, ...] in shared memory, rounded once to FP32, on FP16 tensor cores ("f16d"): each code's
    value split into two FP16 digits (`digits`: w = wh + wl, x = xh + xl), the block's dot is
    hh + mid + ll with hh = wh . xh (a sum of integers below 448^2, itself below 2^23), mid = wh .
    xl + wl . xh (multiples of 2^-9 of at most 448 / 2 each, the sum below 2^14) and ll = wl . xl
    (multiples of 2^-18 of at most 1/4, the sum at most 2^3): each of the three is a sum of at most 24
    significant bits, formed exactly by the MMA (mid's second MMA accumulating onto its first), as
    long as the MMA's adds keep 24 bits below their largest term (scripts/probe_digit_mma.py
    measures that; the GPU tests check the kernel bitwise). Then with S = 1.5 x 2^23: mi = (mid +
    S) - S, mid rounded to an integer, mf = mid - mi (exact, |mf| <= 1/2); H = hh + mi (an integer
    below 2^24: exact), L = mf + ll (a multiple of 2^-18 below 2^4: exact), and RN(H + L) is the
    block's exact sum hh + mid + ll rounded once, as in `ExactMM`'s split (`chained_dot`: H and L
    formed by hh's and ll's MMAs from mi and mf)."""
    la: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_layout, k_width=2)
    lb: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma_layout, k_width=2)
    BN: gl.constexpr = w_tile.shape[0]
    BT: gl.constexpr = x_tile.shape[0]
    wh, wl = digits(operand16(w_tile.slice(32 * j, 32, dim=1), la, 0))
    xh, xl = digits(operand16(x_tile.slice(32 * j, 32, dim=1).permute((1, 0)), lb, 1))
    return chained_dot(wh, wl, xh, xl, gl.zeros([BN, BT], gl.float32, mma_layout))


@gluon.jit
def _digit_operands_k(w_tile, x_tile, la: gl.constexpr, lb: gl.constexpr):
    """The slot's NB K blocks as batched FP16-MMA operands for `digit_slot_partials`: the weight's
    codes [NB, BN, 32] and x's [NB, 32, BT] (batch j: K block j) in the operand layouts la / lb
    (k_width 2), each block's k in `operand16`'s permutation (k = 16 s + 8 u + 2 t + v at the
    block's column 8 t + 4 s + 2 u + v): each thread's bytes consecutive in shared memory, renamed
    into the operand layouts without moving data (`assert_trivial`)."""
    BN: gl.constexpr = w_tile.shape[0]
    BT: gl.constexpr = x_tile.shape[0]
    NB: gl.constexpr = w_tile.shape[1] // 32
    like_a = gl.zeros([NB, BN, 32], gl.int8, la)
    phys_a: gl.constexpr = gl.reshape(gl.permute(gl.reshape(like_a, [NB, BN, 2, 2, 4, 2]), (1, 0, 4, 2, 3, 5)),
                                      [BN, 32 * NB]).type.layout
    a = gl.reshape(gl.permute(gl.reshape(w_tile.load(phys_a), [BN, NB, 4, 2, 2, 2]), (1, 0, 3, 4, 2, 5)),
                   [NB, BN, 32])
    like_b = gl.zeros([NB, 32, BT], gl.int8, lb)
    phys_b: gl.constexpr = gl.reshape(gl.permute(gl.reshape(like_b, [NB, 2, 2, 4, 2, BT]), (0, 3, 1, 2, 4, 5)),
                                      [32 * NB, BT]).type.layout
    b = gl.reshape(gl.permute(gl.reshape(x_tile.permute((1, 0)).load(phys_b), [NB, 4, 2, 2, 2, BT]),
                              (0, 2, 3, 1, 4, 5)), [NB, 32, BT])
    return gl.convert_layout(a, la, assert_trivial=True), gl.convert_layout(b, lb, assert_trivial=True)


@gluon.jit
def digit_slot_partials(w_tile, x_tile, mma_layout: gl.constexpr):
    """`digit_partial` of the slot's NB K blocks at once (the FP16 digits with `warps_k` > 1): [NB,
    BN, BT] FP32, batch j block j's exact dot rounded once, from batched FP16 MMAs (each warp its
    share of the blocks)."""
    la: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_layout, k_width=2)
    lb: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma_layout, k_width=2)
    a, b = _digit_operands_k(w_tile, x_tile, la, lb)
    wh, wl = digits(a)
    xh, xl = digits(b)
    zero = gl.zeros([a.shape[0], a.shape[1], b.shape[2]], gl.float32, mma_layout)
    return chained_dot(wh, wl, xh, xl, zero)


@gluon.jit
def _x_digit_tiles(x_tile, xd, cvt_l: gl.constexpr):
    """The slot's x codes ([BT, 32 NB] E4M3 in shared memory) as FP16 digit tiles for the wgmma's B
    operand: tile 2 j of xd (rows 2 j BT..) the integer digits (`digits`), tile 2 j + 1 the
    remainders of K block j ([BT, 32] each, all written in one store), the block's columns in
    `operand16`'s permutation (column 8 t + 4 s + 2 u + v at k = 16 s + 8 u + 2 t + v), the order
    the weight's register operand takes them in."""
    BT: gl.constexpr = x_tile.shape[0]
    NB: gl.constexpr = x_tile.shape[1] // 32
    c = gl.reshape(x_tile.load(cvt_l), [BT, NB, 4, 2, 2, 2])
    c = gl.reshape(gl.permute(c, (0, 1, 3, 4, 2, 5)), [BT, NB, 32])
    h, lo = digits(c)
    # one store of all 2 NB tiles ([NB, 2, BT, 32] as rows: block j's digits at tile 2 j, its
    # remainders at 2 j + 1)
    xd.store(gl.reshape(gl.permute(gl.join(h, lo), (1, 3, 0, 2)), [2 * NB * BT, 32]))


@gluon.jit
def _x_digits(xd, j: gl.constexpr, BT: gl.constexpr):
    """K block j's x digit tiles in the slot's `xd` (`_x_digit_tiles`) as wgmma B operands: (the
    integer digits, the remainders), each [32, BT]."""
    return (xd.slice(2 * j * BT, BT, dim=0).permute((1, 0)),
            xd.slice((2 * j + 1) * BT, BT, dim=0).permute((1, 0)))


@gluon.jit
def _issue_mid(w_tile, xd, j: gl.constexpr, zero, a_l: gl.constexpr):
    """K block j's cross dots as two chained asynchronous wgmmas from `zero` (`consumer_wg`): the
    weight's digits in registers (`operand16`, the A operand), x's from the slot's digit tiles in
    shared memory. Returns (mid, wh, wl): the in-flight accumulator and the register operands,
    which the block's other two wgmmas (`_issue_parts`) read too."""
    wh, wl = digits(operand16(w_tile.slice(32 * j, 32, dim=1), a_l, 0))
    xh, xl = _x_digits(xd, j, zero.shape[1])
    mid = warpgroup_mma(wh, xl, zero, is_async=True)
    mid = warpgroup_mma(wl, xh, mid, is_async=True)
    return mid, wh, wl


@gluon.jit
def _issue_parts(mid, wh, wl, xd, j: gl.constexpr):
    """`chained_dot`'s second half on wgmma for K block j: mid (retired) rounded to an integer mi
    (`round_mid`), then hh's wgmma accumulating onto mi and ll's onto mid - mi, both asynchronous. Returns the two
    in-flight accumulators (H, L), whose sum rounds the block once."""
    xh, xl = _x_digits(xd, j, mid.shape[1])
    mi = round_mid(mid)
    high = warpgroup_mma(wh, xh, mi, is_async=True)
    low = warpgroup_mma(wl, xl, mid - mi, is_async=True)
    return high, low


@gluon.constexpr_function
def x_scales_layout(NB, BT):
    """The layout in which the 128 consumer threads (`consumer_wg`'s, `gluon_exact_k.consumer_k`'s)
    decode a slot's x scales, [NB K blocks, BT x rows]: a warp's lanes along the rows (BT >= 8), the
    warps along the blocks (replicated where the tile has fewer than 128 entries)."""
    lanes = min(BT, 32)
    return gl.BlockedLayout(size_per_thread=[1, max(1, BT // 32)], threads_per_warp=[32 // lanes, lanes],
                            warps_per_cta=[4, 1], order=[1, 0])


@gluon.jit
def store_x_scales(sx0, sx1, dst):
    """The slot's x scales decoded once (`gluon_ring.scale_byte`) into `dst` ([NB, BT] FP32 in shared
    memory, row j K block j's): sx0 / sx1 the [NB, BT] scale words of the slot in
    `x_scales_layout` (every row of them the x row's word, word 1 for blocks 4..7 of a 256-deep
    slot), each thread one or two bytes."""
    NB: gl.constexpr = dst.shape[0]
    jj = gl.arange(0, NB, layout=gl.SliceLayout(1, sx0.type.layout))[:, None]
    if NB == 4:
        word = sx0
    else:
        word = gl.where(jj < 4, sx0, sx1)
    dst.store(scale_byte(word >> (8 * (jj % 4)), 0))


@gluon.jit
def store_fused_scales(sw0, sw1, sx0, sx1, dst):
    """`store_x_scales` of the scales' products for the fused scaling: dst[j, m] = sx[m, j] * sw[j]
    (`gluon_exact_common.fused_scale`), sw0 / sw1 the words of the tile's one weight scale block
    (its rows' common scales) in the same [NB, BT] layout as sx0 / sx1 (every entry that row's
    word)."""
    NB: gl.constexpr = dst.shape[0]
    jj = gl.arange(0, NB, layout=gl.SliceLayout(1, sx0.type.layout))[:, None]
    if NB == 4:
        wx = sx0
        ww = sw0
    else:
        wx = gl.where(jj < 4, sx0, sx1)
        ww = gl.where(jj < 4, sw0, sw1)
    dst.store(fused_scale(wx >> (8 * (jj % 4)), ww >> (8 * (jj % 4)), 0))


@gluon.jit
def consumer_wg(w_smem, x_smem, xd, xs, ready, empty, sw_words, sx_words, ws_ptr, step_lo, n_steps, M,
                sx_ptr, stride_sxm, fuse_lo, fuse_hi,
                STAGES: gl.constexpr, BN: gl.constexpr, BT: gl.constexpr, SPLIT_K: gl.constexpr,
                mma_layout: gl.constexpr, cvt_l: gl.constexpr, PIPE: gl.constexpr, FUSE: gl.constexpr):
    """The consumer warpgroup of the FP16 digits on wgmma: `consumer_wg_slots`, with FUSE and x's
    scale bytes in [fuse_lo, fuse_hi] (`gluon_exact_common.fused_scales_ok` over the program's rows
    and K steps) in its fused form. Returns (acc, )."""
    if FUSE:
        if fused_scales_ok(sx_ptr, stride_sxm, M, step_lo, n_steps, fuse_lo, fuse_hi, BT, w_smem.shape[2] // 128):
            acc = consumer_wg_slots(w_smem, x_smem, xd, xs, ready, empty, sw_words, sx_words, ws_ptr, step_lo,
                                    n_steps, M, STAGES, BN, BT, SPLIT_K, mma_layout, cvt_l, PIPE, True)
        else:
            acc = consumer_wg_slots(w_smem, x_smem, xd, xs, ready, empty, sw_words, sx_words, ws_ptr, step_lo,
                                    n_steps, M, STAGES, BN, BT, SPLIT_K, mma_layout, cvt_l, PIPE, False)
    else:
        acc = consumer_wg_slots(w_smem, x_smem, xd, xs, ready, empty, sw_words, sx_words, ws_ptr, step_lo, n_steps,
                                M, STAGES, BN, BT, SPLIT_K, mma_layout, cvt_l, PIPE, False)
    return (acc, )


@gluon.jit
def consumer_wg_slots(w_smem, x_smem, xd, xs, ready, empty, sw_words, sx_words, ws_ptr, step_lo, n_steps, M,
                      STAGES: gl.constexpr, BN: gl.constexpr, BT: gl.constexpr, SPLIT_K: gl.constexpr,
                      mma_layout: gl.constexpr, cvt_l: gl.constexpr, PIPE: gl.constexpr, FUSED: gl.constexpr):
    """`_consumer` for the FP16 digits on wgmma ("f16w"; one consumer warpgroup, mma_layout the
    wgmma's [BN, BT] accumulator layout): per ring slot, x's digits written once to shared memory
    (`_x_digit_tiles`) and x's scales decoded once (`store_x_scales`, one or two bytes a thread,
    into `xs`: [2, NB, BT] FP32, one half per slot parity, so that a warp still reading the last
    block's scales of a slot never sees the next slot's), then a fence for the async proxy and a
    barrier; per K block the weight's digits in registers (`operand16`: the A operand, k permuted as
    x's columns were) and `chained_dot` on asynchronous wgmmas - the two cross dots chained from
    zero (`_issue_mid`), then, once they retire, hh's and ll's accumulating onto mid's integer and
    remainder (`_issue_parts`), one add rounding the block; the term (`scaled_term`: the x row's
    decoded scale from `xs`, the weight's from its 16-row tile's word) joins the FP32 accumulator
    in K order, or with SPLIT_K the workspace, as in `_consumer`. sx_words: [NB, BT] pointers in
    `x_scales_layout` (each row the x rows' first scale words). PIPE ("f16wp"): block j + 1's cross
    dots are issued before block j's H and L are waited for (the wait leaves them in flight), so the
    MMAs overlap the adds within a slot. The slot goes back to the producer once every warp's MMAs
    of it have retired. FUSED: each term and its add in one FMA with the decoded scales' product
    (`gluon_exact_common.fused_take`: the same bits for the bytes `fused_scales_ok` checked).
    Returns the accumulator (zeros with SPLIT_K)."""
    a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_layout, k_width=2)
    acc = gl.zeros([BN, BT], gl.float32, mma_layout)
    zero = gl.zeros([BN, BT], gl.float32, mma_layout)
    NB: gl.constexpr = w_smem.shape[2] // 32
    ws_offs, ws_mask = ws_tile(BN, BT, M, mma_layout)
    words_next = slot_words(sw_words, sx_words, step_lo, NB // 4)
    for i in range(n_steps):
        words, words_next, s = wait_slot(i, words_next, sw_words, sx_words, ready, step_lo, n_steps, STAGES, NB)
        sw0, sw1, sx0, sx1 = words
        w_tile = w_smem.index(s)
        x_scales = xs.index(i % 2)
        _x_digit_tiles(x_smem.index(s), xd, cvt_l)
        store_x_scales(sx0, sx1, x_scales)
        # the generic-proxy stores before the wgmmas' (async proxy) reads and every thread's
        # scale loads, from every thread
        fence_async_shared()
        gl.thread_barrier()
        nxt = _issue_mid(w_tile, xd, 0, zero, a_l)
        for j in gl.static_range(NB):
            mid, wh, wl = warpgroup_mma_wait(num_outstanding=0, deps=nxt)
            high, low = _issue_parts(mid, wh, wl, xd, j)
            if PIPE and j + 1 < NB:
                nxt = _issue_mid(w_tile, xd, j + 1, zero, a_l)
                high, low, _, _ = warpgroup_mma_wait(num_outstanding=2, deps=(high, low, wh, wl))
            else:
                high, low, _, _ = warpgroup_mma_wait(num_outstanding=0, deps=(high, low, wh, wl))
                if j + 1 < NB:
                    nxt = _issue_mid(w_tile, xd, j + 1, zero, a_l)
            part = high + low
            if j == NB - 1:
                # every warp's MMAs of the slot retired (its weight loads and x's digits read)
                # before one thread hands the slot back and the next slot's digits overwrite xd
                gl.thread_barrier()
                mbarrier.arrive(empty.index(s), count=1)
            sx = x_scales.slice(j, 1, dim=0).load(mma_layout)                  # [1, BT]
            sw = scale_byte(sw0 if j < 4 else sw1, j % 4)[:, None]
            if FUSED:
                sx_b, sw_b = gl.broadcast(sx, sw)
                acc = fused_take(acc, part, sx_b * sw_b, (step_lo + i) * NB + j, ws_ptr, ws_offs, ws_mask, BN, M,
                                 SPLIT_K)
            else:
                acc = take_term(acc, scaled_term(part, sx, sw), (step_lo + i) * NB + j, ws_ptr, ws_offs, ws_mask, BN,
                                M, SPLIT_K)
    return acc
