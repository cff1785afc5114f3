"""What the exact Gluon linears (`gluon_exact_mm.GluonExactMM` on the FP64 MMA or on FP16 MMAs over
the codes' digits, `GluonExactConfig.convert` "f16d" / "f16w" / "f16wp"; `gluon_exact_fma.GluonExactFMA`
on the FP64 CUDA cores) share: the exact power-of-two scaling of
FP64 values (`pow2`), the consumers' start of a ring slot (`wait_slot`) or of a unit of them
(`unit_words`, `wait_unit`), a block's term and its
K-ordered add or workspace store (`block_term`, `scaled_term`, `take_term`, `ws_tile`), the same in one
FMA where the scales allow it (`fused_scale_range`, `fused_scales_ok`, `fused_scale`, `fused_take`),
the tile's store with the query-RoPE epilogue (`store_tile`), the K split's last step that continues
the sum in K order (`split_k_sum`, `sum_chunk`), the weight's checks
(`ring_weight_args`) and the plan side (`GluonExactPlan`: the weight bound once on sm_90, the split's
workspace, the configuration per row count, the call's checks). `gluon_exact_mm`'s module docstring
argues the exactness these pieces keep.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.extra import libdevice
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

from .checks import config_for_rows, mxfp8_linear_args, mxfp8_weight_args
from .common import plan_workspace
from .exact_mm import reduction_order, rope_kwargs
from .gluon_epilogues import bf16_out, max_combine
from .gluon_mm import BLOCK_K as RING_K
from .gluon_ring import fp8_desc, require_sm90_weight, scale_byte, scale_words, slot_words
from .pdl import launch_options as pdl_launch_options, require_supported as require_pdl


@gluon.jit
def pow2(x, e: gl.constexpr):
    """x * 2^e (FP64, e in -1022..1023: one exact multiply unless the product leaves the range)."""
    return x * gl.full(x.shape, (1023 + e) << 52, gl.int64, x.type.layout).to(gl.float64, bitcast=True)


@gluon.jit
def block_term(part, words, j: gl.constexpr):
    """RN(RN(part * sx[m, block j]) * sw[n // 32, block j]): the reference's scaling of the slot's K
    block j (words: `gluon_ring.slot_words` of the slot, word 1 for blocks 4..7 of a 256-deep one);
    `scaled_term` of the two scales decoded from their bytes."""
    if j < 4:
        sw, _, sx, _ = words
    else:
        _, sw, _, sx = words
    return scaled_term(part, scale_byte(sx, j % 4)[None, :], scale_byte(sw, j % 4)[:, None])


@gluon.jit
def scaled_term(part, sx, sw):
    """RN(RN(part * sx) * sw) of a [BN, BT] block partial and its decoded scales (FP32 powers of
    two, broadcast against it: sx [1, BT] per x row, sw [BN, 1] per weight row); the last product
    `mul.rn`, never contracted into the accumulator's add."""
    scaled, sw_b = gl.broadcast(part * sx, sw)
    return libdevice.mul_rn(scaled, sw_b)


# The fused scaling (`fused_take`): acc + RN(RN(p * sx) * sw) in one FMA, fma(p, sx * sw, acc). A
# block partial p is the FP32 rounding of a sum of 32 products of E4M3 values (multiples of 2^-18,
# |sum| <= 32 * 448^2 < 2^23), so p is a multiple of 2^-18 with |p| < 2^23. With sx = 2^a, sw = 2^b
# (UE8M0 bytes bx = a + 127, bw = b + 127, both decoded as powers of two: bytes 1..254), p * 2^a is
# exact when its lowest bit stays at or above FP32's least subnormal 2^-149 (-18 + a >= -149: every
# a >= -126) and |p * 2^a| < 2^127 (a <= 104); the same for p * 2^(a + b) (-131 <= a + b <= 104).
# Then RN(RN(p * sx) * sw) = p * 2^(a + b) exactly, and fma(p, s, acc) = RN(acc + p * s) is the
# reference's RN(acc + term) bit for bit (a zero p gives a zero of p's sign either way, which the
# add treats alike). s = 2^(a + b) is built from the bytes as an FP32 normal (a + b >= -126). So the
# x bytes 1..231 with bx + bw in 128..358 qualify: FUSED_X_BYTES, FUSED_SUM_BYTES.
FUSED_X_BYTES = (1, 231)
FUSED_SUM_BYTES = (128, 358)


def fused_scale_range(w_scale: torch.Tensor) -> tuple[int, int]:
    """The x scale bytes [lo, hi] with which `fused_take` gives `block_term`'s bits against every
    scale of this weight (w_scale: its UE8M0 bytes, any shape): FUSED_X_BYTES narrowed so that bx +
    bw stays in FUSED_SUM_BYTES for the weight's smallest and largest byte; (1, 0), no byte, when a
    weight byte is 0 or 255 (decoded as 0 and NaN, not powers of two). One reduction over the
    weight's scales, when a plan binds it."""
    b = w_scale.view(torch.uint8)
    lo_w, hi_w = int(b.min()), int(b.max())
    if lo_w < 1 or hi_w > 254:
        return 1, 0
    return max(FUSED_X_BYTES[0], FUSED_SUM_BYTES[0] - lo_w), min(FUSED_X_BYTES[1], FUSED_SUM_BYTES[1] - hi_w)


@gluon.jit
def fused_scales_ok(sx_ptr, stride_sxm, M, step_lo, n_steps, lo, hi, BT: gl.constexpr, WORDS: gl.constexpr):
    """Whether every UE8M0 byte of x's scale words a program reads lies in [lo, hi]
    (`fused_scale_range`): rows 0 .. min(M, BT) - 1 from sx_ptr (row stride stride_sxm words), the
    WORDS words a ring slot of each of its slots step_lo .. step_lo + n_steps - 1. A scalar, the same for every thread of the 4 warps
    that run it: the consumer's choice between `fused_take` and `block_term`'s order for the whole
    program (one check before its first slot, while the producer fills the ring): [BT, 1024 / BT]
    words at a time, 8 loads a thread, all independent (one pass for `wo_b`'s 64 words a row up to
    16 rows)."""
    CW: gl.constexpr = 1024 // BT
    word_lo = step_lo * WORDS
    n_words = n_steps * WORDS
    layout: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 1], threads_per_warp=[2, 16], warps_per_cta=[4, 1],
                                            order=[1, 0])
    rm = gl.arange(0, BT, layout=gl.SliceLayout(1, layout))[:, None]
    rw = gl.arange(0, CW, layout=gl.SliceLayout(0, layout))[None, :]
    bad = gl.zeros([BT, CW], gl.int32, layout)
    for c in range(0, n_words, CW):
        valid = (rm < M) & (c + rw < n_words)
        w = gl.load(sx_ptr + rm * stride_sxm + (word_lo + c) + rw, mask=valid, other=0)
        for j in gl.static_range(4):
            b = (w >> (8 * j)) & 255
            bad = bad | (valid & ((b < lo) | (b > hi))).to(gl.int32)
    return gl.reduce(gl.reduce(bad, 1, max_combine), 0, max_combine) == 0


@gluon.jit
def fused_scale(sx, sw, j: gl.constexpr):
    """sx * sw of byte j of the x and weight scale words (int32, broadcast against each other: [1,
    BT] and [BN, 1], or any pair) as FP32 2^(bx + bw - 254), built from the bytes' sum: exact for
    bytes in `fused_scale_range` (a normal power of two). A pair of words shared by several outputs
    of a thread yields one value for them (the compiler merges the same operations)."""
    bx, bw = gl.broadcast((sx >> (8 * j)) & 255, (sw >> (8 * j)) & 255)
    return ((bx + bw - 127) << 23).to(gl.float32, bitcast=True)


@gluon.jit
def fused_take(acc, part, s, block, ws_ptr, ws_offs, ws_mask, BN: gl.constexpr, M, SPLIT_K: gl.constexpr):
    """`take_term` of `block_term`'s term in one FMA: acc = fma(part, s, acc) with s = sx * sw
    (`fused_scale`, or the decoded scales' product), or with SPLIT_K part * s stored to the
    workspace; bitwise `take_term(acc, scaled_term(part, sx, sw), ...)` for scale bytes in
    `fused_scale_range` (the module's argument above FUSED_X_BYTES). Returns the accumulator."""
    if SPLIT_K:
        gl.store(ws_ptr + block * (BN * M) + ws_offs, part * s, mask=ws_mask)
    else:
        acc = gl.fma(part, s, acc)
    return acc


@gluon.jit
def wait_slot(i, words_next, sw_words, sx_words, ready, step_lo, n_steps, STAGES: gl.constexpr, NB: gl.constexpr):
    """The consumers' start of ring slot i: its scale words (loaded one slot ahead: `words_next`)
    and the next slot's loads issued, then the wait for the slot's tiles. Returns (the slot's words,
    the next slot's, the ring index)."""
    words = words_next
    words_next = slot_words(sw_words, sx_words, step_lo + gl.minimum(i + 1, n_steps - 1), NB // 4)
    s = i % STAGES
    mbarrier.wait(ready.index(s), (i // STAGES) & 1)
    return words, words_next, s


@gluon.jit
def unit_words(sw_words, sx_words, step, WORDS: gl.constexpr, SLOTS: gl.constexpr):
    """The scale words (`slot_words`) of the SLOTS ring slots from `step` on, a tuple: one unit."""
    if SLOTS == 1:
        words = (slot_words(sw_words, sx_words, step, WORDS), )
    else:
        words = (slot_words(sw_words, sx_words, step, WORDS), slot_words(sw_words, sx_words, step + 1, WORDS))
    return words


@gluon.jit
def wait_unit(u, unit_next, sw_words, sx_words, ready, step_lo, n_steps, STAGES: gl.constexpr, NB: gl.constexpr,
               SLOTS: gl.constexpr):
    """The consumers' start of unit u of SLOTS ring slots (`wait_slot`, whose form one slot takes;
    two with `GluonExactConfig.pair_slots`): its scale words (loaded a unit ahead: `unit_next`) and
    the next unit's loads issued, then the wait for the unit's tiles on its first slot's ready
    barrier. Returns (the unit's words, the next unit's, its first slot)."""
    if SLOTS == 1:
        words, words_next, s = wait_slot(u, unit_next[0], sw_words, sx_words, ready, step_lo, n_steps, STAGES, NB)
        unit = (words, )
        unit_next = (words_next, )
    else:
        unit = unit_next
        unit_next = unit_words(sw_words, sx_words, step_lo + gl.minimum(2 * u + 2, n_steps - 2), NB // 4, 2)
        s = u % (STAGES // 2) * 2
        mbarrier.wait(ready.index(s), (u // (STAGES // 2)) & 1)
    return unit, unit_next, s


@gluon.jit
def ws_tile(BN: gl.constexpr, BT: gl.constexpr, M, layout: gl.constexpr):
    """The split-K workspace's offsets and mask of a [BN, BT] tile of block terms in `layout`
    ([BN, M] n-major, the M real rows): what `take_term` stores through."""
    rn = gl.arange(0, BN, layout=gl.SliceLayout(1, layout))
    rm = gl.arange(0, BT, layout=gl.SliceLayout(0, layout))
    return rn[:, None] * M + rm[None, :], (rm[None, :] < M) & (rn[:, None] < BN)


@gluon.jit
def take_term(acc, term, block, ws_ptr, ws_offs, ws_mask, BN: gl.constexpr, M, SPLIT_K: gl.constexpr):
    """K block `block`'s term of a [BN, BT] tile (`block_term`, `scaled_term`) added to the FP32
    accumulator in K order, or with SPLIT_K stored to the workspace at ws_ptr + block * BN * M
    (`ws_tile`'s offsets). Returns the accumulator."""
    if SPLIT_K:
        gl.store(ws_ptr + block * (BN * M) + ws_offs, term, mask=ws_mask)
    else:
        acc = acc + term
    return acc


@gluon.constexpr_function
def _pairs_layout(BN, BT):
    """A layout of a [BN, BT] output tile over the 4 consumer warps in which each thread holds both
    columns of a RoPE pair (2 consecutive n of one row m; lanes along n first): what
    `gluon_epilogues.rope_tile` splits in registers."""
    lanes_n = min(32, BN // 2)
    return gl.BlockedLayout(size_per_thread=[2, 1], threads_per_warp=[lanes_n, 32 // lanes_n], warps_per_cta=[4, 1],
                            order=[0, 1])


@gluon.jit
def store_tile(y_ptrs, acc, mask, OUT_F32: gl.constexpr, off_n=None, M=None, cos_ptr=None, sin_ptr=None, stride_cm=None,
           stride_sm=None, ROPE: gl.constexpr = False):
    """y = acc (FP32) or acc rounded to BF16 (nearest even). ROPE (BF16 y): acc [BN, BT] (dim 0 the
    output columns from off_n, dim 1 the rows, M of them real) gets the query RoPE on its rounded
    values first where it holds a head's channels 448..511 (`gluon_epilogues.bf16_out`: the bits
    of `kv_write.query_rope_` on the stored tile; cos/sin [M, 32] FP32 at cos_ptr / sin_ptr, row
    strides stride_cm / stride_sm), such a tile going through `_pairs_layout` and back."""
    if OUT_F32:
        gl.store(y_ptrs, acc, mask=mask)
    elif ROPE:
        BN: gl.constexpr = acc.shape[0]
        BT: gl.constexpr = acc.shape[1]
        out_l: gl.constexpr = acc.type.layout
        pairs: gl.constexpr = _pairs_layout(BN, BT)
        gl.store(y_ptrs, bf16_out(acc, off_n, M, cos_ptr, sin_ptr, stride_cm, stride_sm, BN, BT, True, out_l,
                                  PAIRS=pairs), mask=mask)
    else:
        gl.store(y_ptrs, acc.to(gl.bfloat16), mask=mask)


@gluon.jit
def _add_chunk(total, ptrs, mask, stride, n, CH: gl.constexpr):
    """total + t[0] + ... + t[n - 1], one add at a time in that order, t[c] at ptrs + c * stride
    (n <= CH; `split_k_sum`'s terms): the CH loads first, all independent, then the adds."""
    ts = ()
    for c in gl.static_range(CH):
        ok = c < n
        if mask is not None:
            ok = mask & ok
        ts = ts + (gl.load(ptrs + c * stride, mask=ok, other=-0.0, cache_modifier=".cg"), )
    for c in gl.static_range(CH):
        total = total + ts[c]
    return total


@gluon.jit
def split_k_sum(total, ptrs, mask, stride, n_terms, cnt_ptr, n_split, CH: gl.constexpr):
    """The K split's last step (`exact_mm`'s scheme; `GluonExactMM` and `gluon_exact_fma.GluonExactFMA`
    run it): once every thread's writes to the workspace are done, the program arrives on its
    tile's counter (`cnt_ptr`, int32, acq_rel); the last of the tile's n_split programs to arrive
    adds the n_terms terms to `total` one at a time in K order, term j at ptrs + j * stride (FP32,
    `total`'s shape and layout: each output's terms in its thread; `mask`: the elements to read,
    None for all; the others read -0.0, which adds nothing: x + -0.0 = x for every x), and resets
    the counter to 0 for the next launch (and a CUDA graph's replay). The terms are loaded CH at a
    time, independent loads issued together before their adds (`_add_chunk`): an L2 round trip per
    CH terms, not per term. `.cg`: from L2, never from a line this SM's L1 kept from an earlier
    launch. Returns (last, total): the sum in the last program, `total` as given in the others."""
    # Every thread's workspace writes are done before one thread's release of the counter.
    gl.thread_barrier()
    arrived = gl.atomic_add(cnt_ptr, 1, sem="acq_rel", scope="gpu")
    last = arrived == n_split - 1
    if last:
        gl.thread_barrier()
        n_full = n_terms - n_terms % CH
        for j0 in range(0, n_full, CH):
            total = _add_chunk(total, ptrs + j0 * stride, mask, stride, CH, CH)
        if n_full < n_terms:
            total = _add_chunk(total, ptrs + n_full * stride, mask, stride, n_terms - n_full, CH)
        gl.atomic_xchg(cnt_ptr, 0, sem="relaxed", scope="gpu")
    return last, total


@gluon.constexpr_function
def sum_chunk(per_thread):
    """`split_k_sum`'s CH for a total of `per_thread` FP32 values a thread: 64 registers of terms
    in flight (at least one term)."""
    return max(1, 64 // per_thread)


def ring_weight_args(weight, w_scale, max_rows, max_rows_limit: int, instead: str) -> tuple[int, int]:
    """(N, K) of an exact Gluon plan's weight: `checks.mxfp8_weight_args`'s checks, and K a multiple of
    the ring's 128-deep slots (ValueError naming the weight and `instead`, the op for other K)."""
    n, k = mxfp8_weight_args(weight, w_scale, max_rows, max_rows_limit)
    if k % RING_K:
        raise ValueError(f"weight must be [N, K] with K a positive multiple of {RING_K} (the ring's 128-deep "
                         f"slots), got {(n, k)} (use {instead})")
    return n, k


class GluonExactPlan:
    """The plan side of the exact Gluon linears (`GluonExactMM`, `gluon_exact_fma.GluonExactFMA`):
    the weight bound once on sm_90 (`_bind`), the K split's workspace (`_bind_split`), the
    configuration per row count (`_configs`, from `checks.row_configs`), the reduction order, and
    the call's checks, after which the subclass launches its kernel (`_launch(codes, x_scale, out,
    m, config, epilogue)`, epilogue the query RoPE's keyword arguments: `exact_mm.rope_kwargs`)."""

    def _bind(self, weight: torch.Tensor, w_scale: torch.Tensor, max_rows: int, boxes) -> None:
        """Check the weight's device and rows (`gluon_ring.require_sm90_weight`) and bind it: w_scale
        as bytes and int32 words, the x scale bytes of the fused scaling (`fused_range`:
        `fused_scale_range`), N, K, max_rows, the device, and a TMA descriptor of the weight per box
        (block_n, block_k) in `boxes` (`_w_descs[box]`)."""
        require_sm90_weight(weight, "TMA, warp specialization")
        self.weight, self.w_scale = weight, w_scale.view(torch.uint8)
        self._sw_words = scale_words(self.w_scale, "w_scale")
        self.fused_range = fused_scale_range(self.w_scale)
        (self.n, self.k), self.max_rows, self.device = weight.shape, max_rows, weight.device
        self._w_descs = {box: fp8_desc(weight, box) for box in set(boxes)}

    def _bind_split(self, workspace, tile_terms) -> None:
        """The K split's FP32 workspace and int32 counters, from the pool `workspace` (FP32 slot 0,
        int32 slot 0: `ops.common.plan_workspace`) or the plan's own: for the configurations that
        launch split, `tile_terms` [(block_n, FP32 terms a weight tile)], the most N / block_n x
        terms and the most N / block_n counters (one of each where none does)."""
        tiles = [(-(-self.n // block_n), terms) for block_n, terms in tile_terms]
        self._workspace = plan_workspace(workspace, 0, max((t * terms for t, terms in tiles), default=1),
                                         torch.float32, self.device)
        self._counters = plan_workspace(workspace, 0, max((t for t, _ in tiles), default=1), torch.int32, self.device)

    def config_for(self, rows: int):
        """The configuration a call of `rows` rows launches with."""
        return config_for_rows(self._configs, rows)

    def reduction_order(self, rows: int) -> tuple[str, int, int]:
        """`exact_mm.reduction_order(K)`: the same for every row count (batch invariance)."""
        return reduction_order(self.k)

    def __call__(self, codes: torch.Tensor, x_scale: torch.Tensor, out: torch.Tensor | None = None,
                 rope: tuple[torch.Tensor, torch.Tensor] | None = None, *, pdl: bool = False) -> torch.Tensor:
        """y = codes x weight^T with both block scales, into out: the arguments and the result of
        `exact_mm.ExactMM.__call__` (a float32 out receives the unrounded FP32 sums; rope=(cos, sin):
        the query RoPE of `kv_write.query_rope_` in the epilogue, by the program that stores each
        tile - with a K split the last arriver - on the BF16-rounded sums, the same bits as the
        call without it followed by that op). pdl: launch by programmatic dependent launch
        (`ops.pdl`): where the kernel before it on the stream lets it (a `release`), its programs
        start while that kernel runs and request their rings' first weight tiles
        (`gluon_ring.ring_prefill`), then wait for it before they read x or write anything; without
        such a predecessor it runs as without pdl. The same values either way. ValueError where PDL
        is not available (`ops.pdl.supported`). Returns out."""
        out = mxfp8_linear_args(codes, x_scale, out, self.n, self.k, self.max_rows, self.device)
        if pdl:
            require_pdl(self.device)
        m = codes.shape[0]
        epilogue = rope_kwargs(rope, out, self.n, m, self.device)
        if pdl:
            epilogue.update(PDL=True, **pdl_launch_options(pdl))
        self._launch(codes, x_scale, out, m, self.config_for(m), epilogue)
        return out
