"""`GluonExactMM`'s consumer warps along K (`GluonExactConfig.warps_k` = 2 or 4): each slot's K
blocks split over the warps (a batched MMA: `slot_partials`), each block's exact partial and term
formed by one warp and stored to shared memory, and after a barrier every thread adding its
outputs' terms in K order (`consumer_k`, `gluon_exact_mm`'s module docstring: "Warps along K");
x's scales decoded once a slot into shared memory; the fused scaling for tiles of one weight scale
block; a unit of one ring slot or, with `GluonExactConfig.pair_slots`, two per wait. The same bits
as the kernel's other consumers."""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

from .gluon_exact_common import fused_scales_ok, fused_take, scaled_term, unit_words, wait_unit, ws_tile
from .gluon_exact_digits import digit_slot_partials, store_fused_scales, store_x_scales
from .gluon_exact_fp64 import fp64_slot_partials
from .gluon_ring import scale_byte


@gluon.jit
def slot_partials(w_tile, x_tile, zero, CONVERT: gl.constexpr, KC: gl.constexpr, mma_layout: gl.constexpr):
    """`_block_partial` of the slot's NB K blocks at once (`warps_k` > 1): [NB, BN, BT] FP32, batch j
    block j's (`digit_slot_partials`, `fp64_slot_partials`)."""
    if CONVERT == "f16d":
        part = digit_slot_partials(w_tile, x_tile, mma_layout)
    else:
        part = fp64_slot_partials(w_tile, x_tile, zero, CONVERT, KC, mma_layout)
    return part


@gluon.jit
def consumer_k(w_smem, x_smem, ready, empty, terms, xs, sw_words, sx_words, ws_ptr, step_lo, n_steps, M,
                sw_row_words, sx_ptr, stride_sxm, fuse_lo, fuse_hi,
                STAGES: gl.constexpr, BN: gl.constexpr, BT: gl.constexpr, CONVERT: gl.constexpr, KC: gl.constexpr,
                SPLIT_K: gl.constexpr, mma_layout: gl.constexpr, out_layout: gl.constexpr, FUSE: gl.constexpr,
                SLOTS: gl.constexpr):
    """The consumer warps along K: `_consumer_k_slots` (terms, xs: tuples of SLOTS buffers, one a slot
    of a unit), with FUSE (a tile of one 32-row weight scale block: block_n <= 32) and x's scale
    bytes in [fuse_lo, fuse_hi] (`fused_scales_ok`, as `_consumer`) in its fused form. Returns (acc, )
    in out_layout."""
    if FUSE:
        if fused_scales_ok(sx_ptr, stride_sxm, M, step_lo, n_steps, fuse_lo, fuse_hi, BT, w_smem.shape[2] // 128):
            acc = _consumer_k_slots(w_smem, x_smem, ready, empty, terms, xs, sw_row_words, sx_words, ws_ptr, step_lo,
                                    n_steps, M, STAGES, BN, BT, CONVERT, KC, SPLIT_K, mma_layout, out_layout, True,
                                    SLOTS)
        else:
            acc = _consumer_k_slots(w_smem, x_smem, ready, empty, terms, xs, sw_words, sx_words, ws_ptr, step_lo,
                                    n_steps, M, STAGES, BN, BT, CONVERT, KC, SPLIT_K, mma_layout, out_layout, False,
                                    SLOTS)
    else:
        acc = _consumer_k_slots(w_smem, x_smem, ready, empty, terms, xs, sw_words, sx_words, ws_ptr, step_lo,
                                n_steps, M, STAGES, BN, BT, CONVERT, KC, SPLIT_K, mma_layout, out_layout, False, SLOTS)
    return (acc, )


@gluon.jit
def _consumer_k_slots(w_smem, x_smem, ready, empty, terms, xs, sw_words, sx_words, ws_ptr, step_lo, n_steps, M,
                      STAGES: gl.constexpr, BN: gl.constexpr, BT: gl.constexpr, CONVERT: gl.constexpr,
                      KC: gl.constexpr, SPLIT_K: gl.constexpr, mma_layout: gl.constexpr, out_layout: gl.constexpr,
                      FUSED: gl.constexpr, SLOTS: gl.constexpr):
    """`_consumer_slots` with the consumer warps splitting each slot's NB K blocks (`warps_k` > 1; NB =
    block_k / 32, 4 or 8; mma_layout: the batched [NB, BN, BT] MMA layout, batch j = K block j, warp
    w the blocks w, w + warps_k, ...: with NB = 8 each warp two or more independent MMA chains), a
    unit of SLOTS ring slots (1, or 2 with `GluonExactConfig.pair_slots`: the producer fills both on
    one ready barrier, `_ring_producer`) per wait: per slot of the unit every warp forms its blocks'
    exact partials (`slot_partials`) and terms (`scaled_term`'s two roundings) and stores them to
    `terms[t]` ([NB, BN, BT] FP32 in shared memory, a tuple of SLOTS allocations: one buffer would
    take the compiler's barrier between two slots' stores); after a barrier every thread reads its
    outputs' terms, slot by slot, and adds them in K order, blocks 0, 1, ..., NB - 1 of each, to its
    FP32 accumulator, or, SPLIT_K, stores them to the workspace as `_consumer` does. x's scales come
    decoded from `xs[t]` ([2, NB, BT] FP32, one buffer per unit parity, a tuple of SLOTS allocations
    likewise): after the unit's barrier the warps decode the next unit's (`store_x_scales`, one or
    two bytes a thread, from sx_words: [NB, BT] pointers in `x_scales_layout`) into the other
    buffers, the first unit's before the loop. The barrier also precedes the unit's release (every
    thread's operand loads are done), and the compiler puts one between the reads of the terms and
    the next unit's scale loads and terms stores, which publishes the scales (three barriers a unit
    in the sm_90 SASS, as without the decode: Triton puts one before every mbarrier wait and
    arrive).

    FUSED (the tile's rows in one weight scale block; sw_words then the [NB, BT] pointers, in
    `x_scales_layout`, of that block's row of words): the terms are the partials themselves, `xs`
    holds the scales' products (`gluon_exact_digits.store_fused_scales`, the next unit's stored
    before the unit's barrier, which publishes them), and the reading thread adds each term in one
    FMA (`fused_take`'s form: the same bits for the bytes `fused_scales_ok` checked). Returns the
    accumulator in out_layout (zeros with SPLIT_K)."""
    acc = gl.zeros([BN, BT], gl.float32, out_layout)
    NB: gl.constexpr = w_smem.shape[2] // 32
    zero = gl.zeros([NB, BN, BT], gl.float64, mma_layout)
    terms_l: gl.constexpr = _terms_layout(BN, BT, NB)
    # K block j of batch element j: the byte j % 4 of each row's scale word j // 4
    j3 = gl.expand_dims(gl.expand_dims(gl.arange(0, NB, layout=gl.SliceLayout(1, gl.SliceLayout(2, mma_layout))), 1), 2)
    ws_offs, ws_mask = ws_tile(BN, BT, M, out_layout)
    unit_next = unit_words(sw_words, sx_words, step_lo, NB // 4, SLOTS)
    for t in gl.static_range(SLOTS):
        _store_slot_scales(unit_next[t], xs[t].index(0), FUSED)
    gl.thread_barrier()
    for u in range(n_steps // SLOTS):
        i = u * SLOTS
        unit, unit_next, s = wait_unit(u, unit_next, sw_words, sx_words, ready, step_lo, n_steps, STAGES, NB, SLOTS)
        for t in gl.static_range(SLOTS):
            _store_slot_terms(w_smem.index(s + t), x_smem.index(s + t), zero, unit[t], xs[t].index(u % 2), terms[t],
                              j3, CONVERT, KC, mma_layout, FUSED)
        if FUSED:
            # the next unit's scale products, published by the barrier below (this unit's were by the
            # last one)
            for t in gl.static_range(SLOTS):
                _store_slot_scales(unit_next[t], xs[t].index((u + 1) % 2), True)
        # every thread's terms stored (so its loads of the unit's operands and scales done) before
        # any reads
        gl.thread_barrier()
        if not FUSED:
            # the next unit's x scales (its words loaded at this unit's start) into the other
            # buffers; the barrier the compiler puts before the next unit's scale loads and terms
            # stores publishes them
            for t in gl.static_range(SLOTS):
                _store_slot_scales(unit_next[t], xs[t].index((u + 1) % 2), False)
        for t in gl.static_range(SLOTS):
            acc = _add_slot_terms(acc, terms[t], xs[t].index(u % 2), (step_lo + i + t) * NB, ws_ptr, ws_offs, ws_mask,
                                  BN, M, SPLIT_K, terms_l, out_layout, FUSED)
        # after the barrier: every consumer thread's operand loads of the unit are done
        mbarrier.arrive(empty.index(s), count=1)
    return acc


@gluon.jit
def _store_slot_scales(words, dst, FUSED: gl.constexpr):
    """A slot's x scales decoded into dst ([NB, BT] FP32 in shared memory, `store_x_scales`), or with
    FUSED the scales' products (`store_fused_scales`), from the slot's words (`slot_words`)."""
    sw0, sw1, sx0, sx1 = words
    if FUSED:
        store_fused_scales(sw0, sw1, sx0, sx1, dst)
    else:
        store_x_scales(sx0, sx1, dst)


@gluon.jit
def _store_slot_terms(w_tile, x_tile, zero, words, xs_slot, terms_slot, j3, CONVERT: gl.constexpr, KC: gl.constexpr,
                      mma_layout: gl.constexpr, FUSED: gl.constexpr):
    """One ring slot's NB block partials (`slot_partials`, [NB, BN, BT]) stored to terms_slot (FP32
    in shared memory): with FUSED the partials themselves, else `scaled_term`'s terms with x's
    decoded scales from xs_slot ([NB, BT]) and the weight's bytes of the slot's words (j3: the
    batch index, K block j's byte j % 4 of word j // 4)."""
    NB: gl.constexpr = w_tile.shape[1] // 32
    part = slot_partials(w_tile, x_tile, zero, CONVERT, KC, mma_layout)   # [NB, BN, BT]
    if FUSED:
        terms_slot.store(part)
    else:
        sw, sw1, _, _ = words
        if NB == 4:
            sw3 = gl.expand_dims(gl.expand_dims(sw, 1), 0) >> (8 * j3)             # [4, BN, 1]: byte j at 0
        else:
            sw3 = gl.where(j3 < 4, gl.expand_dims(gl.expand_dims(sw, 1), 0),
                           gl.expand_dims(gl.expand_dims(sw1, 1), 0)) >> (8 * (j3 % 4))   # [8, BN, 1]
        sx3 = gl.expand_dims(xs_slot.load(gl.SliceLayout(1, mma_layout)), 1)      # [NB, 1, BT]
        terms_slot.store(scaled_term(part, sx3, scale_byte(sw3, 0)))


@gluon.jit
def _add_slot_terms(acc, terms_slot, xs_slot, block0, ws_ptr, ws_offs, ws_mask, BN: gl.constexpr, M,
                    SPLIT_K: gl.constexpr, terms_l: gl.constexpr, out_layout: gl.constexpr, FUSED: gl.constexpr):
    """A slot's NB terms from terms_slot, each output's in its thread (terms_l), added to the FP32
    accumulator in K order as K blocks block0, block0 + 1, ... (`take_term`'s order; with FUSED each
    with its scales' product from xs_slot in one FMA, `fused_take`), or with SPLIT_K stored to the
    workspace. Returns the accumulator."""
    NB: gl.constexpr = terms_slot.shape[0]
    t = terms_slot.load(terms_l)
    ts = _block_split(t)
    if FUSED:
        # each term's scale product: xs [NB, BT] over the terms' [NB, BN, BT]
        ss = _block_split(gl.broadcast(gl.expand_dims(xs_slot.load(gl.SliceLayout(1, terms_l)), 1), t)[0])
    for j in gl.static_range(NB):
        term = gl.convert_layout(ts[j], out_layout, assert_trivial=True)
        if FUSED:
            acc = fused_take(acc, term, gl.convert_layout(ss[j], out_layout, assert_trivial=True), block0 + j, ws_ptr,
                             ws_offs, ws_mask, BN, M, SPLIT_K)
        elif SPLIT_K:
            gl.store(ws_ptr + (block0 + j) * (BN * M) + ws_offs, term, mask=ws_mask)
        else:
            acc = acc + term
    return acc


@gluon.jit
def _block_split(t):
    """The NB per-block [BN, BT] tensors of a slot's [NB, BN, BT] block values in `_terms_layout`
    (each output's NB values in its thread), as a tuple in K order: renamings, no data moves."""
    NB: gl.constexpr = t.shape[0]
    BN: gl.constexpr = t.shape[1]
    BT: gl.constexpr = t.shape[2]
    if NB == 4:
        # [BN, BT, 2, 2]: j = 2 a + b
        t = gl.reshape(gl.permute(t, (1, 2, 0)), [BN, BT, 2, 2])
        t02, t13 = gl.split(t)
        t0, t2 = gl.split(t02)
        t1, t3 = gl.split(t13)
        ts = (t0, t1, t2, t3)
    else:
        # [BN, BT, 2, 2, 2]: j = 4 a + 2 b + c
        t = gl.reshape(gl.permute(t, (1, 2, 0)), [BN, BT, 2, 2, 2])
        c0, c1 = gl.split(t)
        c00, c01 = gl.split(c0)
        c10, c11 = gl.split(c1)
        t0, t4 = gl.split(c00)
        t2, t6 = gl.split(c01)
        t1, t5 = gl.split(c10)
        t3, t7 = gl.split(c11)
        ts = (t0, t1, t2, t3, t4, t5, t6, t7)
    return ts


@gluon.constexpr_function
def _terms_layout(BN, BT, NB=4):
    """`sum_layout` with the slot's NB K blocks' terms of each output in its thread: [NB, BN, BT]."""
    return gl.BlockedLayout(size_per_thread=[NB, 1, 1], threads_per_warp=[1, 32 // min(BT, 32), min(BT, 32)],
                            warps_per_cta=[1, 4, 1], order=[0, 2, 1])


@gluon.constexpr_function
def sum_layout(BN, BT):
    """The layout of `consumer_k`'s K-ordered sums [BN, BT] over the 4 consumer warps: each output
    one thread's, a warp's threads along x's rows first (BT >= 8), then along the weight rows."""
    return gl.BlockedLayout(size_per_thread=[1, 1], threads_per_warp=[32 // min(BT, 32), min(BT, 32)],
                            warps_per_cta=[4, 1], order=[1, 0])
