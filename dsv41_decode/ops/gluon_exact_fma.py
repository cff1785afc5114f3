"""The contract-exact MXFP8 linear for 1-4 rows on the FP64 CUDA cores (DFMA) in Gluon for Hopper
(sm_90): y[M, N] = MXFP8 activation x FP8 weight with 32x32 UE8M0 block scales, 1 <= M <= 4,
bitwise equal to `reference.linear.mxfp8_mm` - the contract, arguments and reduction order of
`ops.gluon_exact_mm.GluonExactMM` (whose module docstring argues the exactness at length):

- each 32-deep K block's dot of E4M3 codes is exact in FP64: a product of two E4M3 values has at
  most 8 significant bits, every partial sum of a block's 32 products is a multiple of 2^-18 below
  32 * 448^2 < 2^23 in magnitude (at most 41 significant bits), so every FP64 add or FMA of the
  block is exact, in any order; one `cvt.rn.f32.f64` rounds the block sum once to FP32;
- the block partial is scaled by sx[m, kb], then by sw[n // 32, kb] in a separate `mul.rn` (never
  fused into the add), and added in K order into an FP32 accumulator that starts at 0 (never
  partial sums added together); the sum is rounded to BF16 (nearest even) or left FP32.

**The weight's codes become FP64 operands by integer operations only** (`_hi_words`, inline PTX,
four codes a 32-bit word): the pattern of `gluon_exact_mm`'s "raw" conversion - the code's sign at
bit 63 and its eeee.mmm at bits 55..49, the value times 2^-1016 (an FP64 subnormal for a subnormal
code, -0 for 0x80) - has a zero low word, so only its high word is built: per word W of four codes,
A = W << 1 once, then per code j one `prmt` (byte 3 = W's byte j: the sign at bit 31; byte 2 = A's
byte j: eeee.mmm at bits 23..17) and one `and` with 0x80FE0000 (the bits between, and bytes 1..0,
cleared): 2.25 integer instructions a code (the shift an IMAD in sm_90's SASS), paired with a zero
low word. The weight's two NaN codes 0x7F / 0xFF read as +-480 (as "raw"'s: a block holding one
gives a finite term where the reference's is NaN unless its scale byte is 255; the checkpoint
loader refuses them). x's codes are converted once per ring slot by the
whole CTA, through FP32, to value * 2^1000 (exact) in a shared FP64 buffer, so each product is the
true one times 2^-16, a normal FP64 number (at least 2^-34: the DFMA takes the weight's subnormal
operands exactly, as an IEEE FMA does), the block sum the true one times 2^-16, exactly; RN to
FP32 and times 2^16 is exact (the scaled sum lies between 2^-34 and 2^7: no FP32 underflow or
overflow). Then one DFMA per (weight code, row).

**Layout.** A TMA producer warp (`gluon_ring.producer`, the Gluon tier's ring: `ring`) streams
[BN, 128] FP8 weight tiles (NVMMA 128-byte swizzle) and the call's activation tile ([R, 128], R =
1, 2 or 4: a call of 3 rows computes 4, TMA's zero rows past M) through `stages` shared-memory
slots. Four consumer warps: `warps_k` of them split each slot's four 32-deep K blocks (warp w the
blocks w, w + warps_k, ...), the rest (4 / warps_k) the weight rows; in a warp, `lanes_k` lanes
share a (weight row, block), each 32 / lanes_k of its k, and 32 / lanes_k consecutive weight rows
fill the warp; a thread owns `rows_per_thread` weight rows, 32 / lanes_k x 4 / warps_k apart (a
quarter-warp's 16-byte loads then hit 8 distinct bank groups of the swizzle: a static_assert on
`gl.bank_conflicts` in `_group_sums`). Per block a thread loads its rows' codes (16-byte
`ld.shared`) and walks its k sequentially, 4 at a time (one word of codes, `_word`), a DFMA chain
per (weight row, x row) from 0 (two chains, even and odd words, when a thread has one weight row
and one x row: two FMAs in flight); with lanes_k > 1 the parts' exact sums meet by lane shuffles
(FP64 adds, exact). x's FP64 values come from the shared buffer by broadcast loads (every lane of
a part the same address; one load per k for up to two x rows), shared by the thread's weight
rows. Each block's sum is rounded and scaled (a term) in registers, then stored to a [4, BN, R]
FP32 buffer in shared memory; after the next slot's first barrier each output's thread reads its
four terms and adds them to its accumulator in K order, 0, 1, 2, 3 (`gluon_exact_mm`'s warps_k
scheme: without the K split nothing leaves the CTA, no global workspace). BN = 32 x rows_per_thread x 4 / warps_k /
lanes_k (8 to 256). Two barriers a slot of the kernel's own (`_consumer`: after x's values are
stored; after every read of the slot's tiles, x's values and the previous terms, when the slot
goes back to the producer and the terms are stored), so x's buffer and the terms need one copy
each; the compiler adds two around the ring's mbarrier operations.

**K split** (`GluonExactFMAConfig.split` > 1, for the shapes whose N makes few large tiles for
their K: wo_b 5120x8192 has 40 of 128 rows): `split` programs share each weight tile, each a
contiguous run of its 128-deep steps (`gluon_mm.split_bounds`), so that large tiles (64-128 rows,
the fewest instructions a code) fill the SMs. The sum stays the contract's: one FP32 accumulator
from 0, the block terms added in K order, never partial sums added together
(`exact_mm.reduction_order`). Split 0 adds its own blocks' terms from 0 as the unsplit kernel does
and leaves that sum in the workspace, in the slab of its last block; each other split copies every
slot's four terms, when its threads have added them, from shared memory to their blocks' slabs (a
16-byte store a thread per 512 terms); the tile's last program to arrive (an acq_rel counter per
tile, which it resets for the next call and a CUDA graph's replay) continues split 0's sum with
the other splits' terms in K order and stores y: `gluon_exact_common.split_k_sum`, GluonExactMM's
scheme, the terms loaded 64 registers' worth at a time (independent loads ahead of their adds:
an L2 round trip per chunk), the tile's BN x R outputs spread over the 128 threads (x rows across
the lanes first). The workspace: [K / 32, BN, R] FP32 per tile (all R rows), and an int32
counter per tile; a plan takes them from a shared pool as GluonExactMM does (FP32 and int32 slot
0) or allocates its own.

**Cost** (sm_90 compiles: the consumer's loop, one slot, in SASS instructions per weight code a
thread; `scripts/probe_gluon_exact_fma.py` measures the time). 4 weight rows a thread and the 4
warps along K (128-row tiles): 4.7 / 6.1 / 9.2 instructions a code at 1 / 2 / 4 x rows, of them
2.2 ALU (one prmt and one and a code; loop and address work), 0.9 / 1.0 / 1.4 IMAD (the shift a
word; the zero low words of the FP64 operands, re-made as registers rotate), 1 / 2 / 4 DFMA, 0.32
/ 0.36 / 0.62 shared loads (the weight's: 1/16; x's values: one per k and block per two x rows,
shared by the thread's 4 weight rows). The rest (x's conversion, the barriers, the scales, the
terms) is fixed per slot, so smaller tiles cost more a code: 64 rows (2 a thread) 5.2 / 6.9 /
10.2, 32 rows (1 a thread) 6.9 / 8.6 / 13.0, 16 rows (2 lanes a block) 8.6 / 11.2 / 17.3, 8 rows
(4 lanes) 15.0 / 17.0 / 26.8; 256 rows (4 a thread, 2 warps along K) 4.7 / 6.0 / 9.1. An SM
sub-partition issues one instruction a cycle (ALU and DFMA: 16 lanes, 2 cycles a warp instruction
each, on separate pipes). Over 132 SMs x 4 sub-partitions at ~1.75 GHz: wq_b 32768x1280 (42 M
codes, 256 programs of 128 rows, two an SM) issues in ~6.7 / 8.7 / 13.1 us at 1 / 2 / 4 rows (the
DFMA pipe alone ~11.3 us at 4), against the weight's read of ~9.7 us: about the read at 1-2 rows,
DFMA-bound at 4. The indexer's wq_b (4096x1280, 5 M codes, 256 programs of 16 rows) ~1.5 / 2 / 3
us of issue, fused wq_a|wkv (1792x5120, 9 M codes, 224 of 8) ~5 / 6 / 9 us: the ring's fill and
the few programs' latency dominate, a few us. wo_b 5120x8192 (42 M codes) has few rows for its
K: 320 programs of 16 rows (8.6 instructions a code), unevenly over 132 SMs (the busiest 1.24x
the mean): ~15 / 19.5 / 30 us at 1 / 2 / 4 rows of issue without the K split. The H200 runs of the
unsplit kernel took about 3 us (launch, fill, drain) plus 1.7-2.3 times each sub-partition's
issued instructions in cycles (2 programs an SM at 128 rows, one or two at 16 to 64), so the
issue rate, not the read, is what a configuration buys.

With the K split the consumer's loop gains 0.05-0.5 instructions a code (the copy of each slot's
terms and its branch; sm_90, split / unsplit at 1 / 2 / 4 x rows: 128 rows 4.82 / 6.21 / 9.37
against 4.73 / 6.14 / 9.24, 64 rows 5.59 / 7.17 / 10.89 against 5.41 / 6.98 / 10.67 at a cap of 80,
32 rows 7.03 / 8.91 / 13.28 against 6.91 / 8.59 / 12.97; no spills at a cap of 128 or 80), and the
tile's last arriver adds 4 (steps - steps a split) + 1 terms an output in chunks of 64 / (its
outputs a thread), each chunk an L2 round trip (~600 cycles) plus its serial adds, while reading
the tile's terms at ~64 bytes a cycle: ~1.5-2.3 us at 1 row, up to ~9 us with 128-row tiles at 4
rows (the terms of 4 rows, 2 KB per block a tile: smaller tiles and fewer splits there). The
estimates (the model above with the tail; the probe's SPLIT_CANDIDATES list the others), at 1 / 2
/ 4 rows: wo_b 128-row tiles x 6 splits (240 programs of 11 steps) ~18.5 / 24.4 / 37 us, 64-row
tiles x 3 ~21 / 26 / 38 (ExactMM with FP32 sums 17.0 / 30.4 / 54.1, GluonExactMM 29.7: a gain at 2
rows against those; ExactMM with FP64 block sums measured faster there, 24.5-25.0 against the
6-split kernel's 25.2-25.3, so ExactMM runs it: `exact_linear._FMA_PLAN`); fused
wq_a|wkv 64-row tiles x 14 splits (392 programs of 3 steps) ~8.0 / 9.2 / 12.9 (ExactMM 6.45 /
11.1 / 15.9, GluonExactMM 12.6: at 2 rows); the indexer's wq_b 128-row tiles x 10 (320 programs of
one step) ~5.3 / 6.3 / 8.2, 64-row tiles x 2 ~5.7 / 6.4 / 7.9 (ExactMM 4.7 / 6.4 / 8.7,
GluonExactMM 6.6: none).

**The query RoPE epilogue** (`rope=(cos, sin)`, the step's wq_b: GluonExactFMA runs its 1-2 rows)
is `gluon_exact_mm`'s: the program that stores a tile (with the K split the last arriver) rotates
each head's channels 448..511 on the BF16-rounded tile (`gluon_exact_common.store_tile`), the bits of the
call followed by `kv_write.query_rope_`; the consumer's loop and registers stay those of the
kernel without it (sm_90 compiles).

Every configuration, split and row count gives the same bits (`exact_mm.reduction_order`). A
`GluonExactFMA` plan binds one weight (its TMA descriptor, and with a split configuration its
workspace and counters) once, in `default_config`'s tile for its N unless given one; calling it
validates and launches. `ops.exact_linear.ExactLinear` runs it at the rows and shapes its
`_FMA_PLAN` lists.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.extra import libdevice
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

from .checks import row_configs
from .common import num_sms
from .exact_mm import HI_WORDS_PTX
from .gluon_epilogues import add_combine
from .gluon_exact_common import GluonExactPlan, pow2, ring_weight_args, split_k_sum, store_tile, sum_chunk
from .gluon_mm import split_bounds
from .gluon_ring import (SHARED_LIMIT, activation_operands, require_maxnreg, ring, ring_prefill, ring_producer,
                         scale_byte)

MAX_ROWS = 4
BLOCK_K = 128                   # K per ring slot: four 32-deep blocks, one 32-bit scale word per row
CONSUMER_WARPS = 4
MAX_SPLIT = 64                  # GluonExactFMAConfig.split


_HI_WORDS_PTX: gl.constexpr = gl.constexpr(HI_WORDS_PTX)   # `exact_mm.HI_WORDS_PTX` (the codes' FP64 high words)


@gluon.jit
def _hi_words(codes):
    """The high 32-bit words of the FP64 patterns value * 2^-1016 of E4M3 codes (int8, any layout
    whose threads hold runs of 4 consecutive codes): per word W of four codes, A = W << 1, then per
    code j prmt(W, A) (byte 3: W's byte j, the sign at bit 31; byte 2: A's byte j, eeee.mmm at bits
    23..17) masked with 0x80FE0000. The low words are zero."""
    return gl.inline_asm_elementwise(
        asm=_HI_WORDS_PTX, constraints="=r,=r,=r,=r,r", args=[codes], dtype=gl.int32, is_pure=True, pack=4)


@gluon.jit
def _f64(hi):
    """The FP64 number whose high word is `hi` (int32) and low word zero."""
    return (hi.to(gl.int64) << 32).to(gl.float64, bitcast=True)


@gluon.jit
def _word(acc0, acc1, codes, xf, q: gl.constexpr, g: gl.constexpr, WK: gl.constexpr, LK: gl.constexpr,
          R: gl.constexpr, TWO: gl.constexpr, L: gl.constexpr):
    """The DFMAs of the thread's word q of each weight row's part of its block (`codes`: [BN, WK,
    LK, 4] bytes t, column 32 block + 32 / LK part + 4 q + t of the tile): the codes' FP64 high
    words (`_hi_words`), and per code t one DFMA per x row into acc0 (with TWO, words of odd q into
    acc1); x's value of the same k from `xf` (row (32 / LK x 4 block + ... ): `_x_rows`)."""
    BN: gl.constexpr = codes.shape[0]
    xl: gl.constexpr = gl.SliceLayout(0, L)
    phys: gl.constexpr = gl.reshape(gl.zeros([WK, LK, R], gl.float64, xl), [WK * LK, R]).type.layout
    h0, h1 = gl.split(gl.reshape(_hi_words(codes), [BN, WK, LK, 2, 2]))                   # t = 2 t1 + t0
    for t0 in gl.static_range(2):
        h00, h01 = gl.split((h0, h1)[t0])
        for t1 in gl.static_range(2):
            w = gl.convert_layout((h00, h01)[t1], gl.SliceLayout(3, L), assert_trivial=True)   # [BN, WK, LK]
            # x at k = 32 / LK part + c (c = 4 q + t) of block WK g + w: xf rows c 4 LK + block LK + part
            xs = xf.slice((4 * q + 2 * t1 + t0) * 4 * LK + WK * g * LK, WK * LK, dim=0).load(phys)
            x = gl.convert_layout(gl.reshape(xs, [WK, LK, R]), xl, assert_trivial=True)        # [WK, LK, R]
            a, b = gl.broadcast(gl.expand_dims(_f64(w), 3), gl.expand_dims(x, 0))
            if TWO and q % 2 == 1:
                acc1 = gl.fma(a, b, acc1)
            else:
                acc0 = gl.fma(a, b, acc0)
    return acc0, acc1


@gluon.jit
def _group_sums(w_tile, xf, g: gl.constexpr, BN: gl.constexpr, WK: gl.constexpr, LK: gl.constexpr,
                R: gl.constexpr, L: gl.constexpr, CODES: gl.constexpr):
    """The exact block sums times 2^-16 [BN, WK, R] (FP64, SliceLayout(2, L)) of the slot's block group
    g (blocks WK g .. WK g + WK - 1, block WK g + w by warp w along K): the weight codes from the
    tile in shared memory (`w_tile` [BN, 128]), x's values times 2^1000 from `xf` (`_x_rows`),
    per k one DFMA per (weight row, x row) from 0 (`_word`), the LK parts of a block added across
    their lanes (exact: the parts are exact partial sums of the block)."""
    # the lanes' loads (16 or 8 bytes a row, the rows 32 / LK apart in a thread, consecutive across
    # the lanes) hit distinct bank groups of the 128-byte swizzle (checked on the whole tile: the
    # count of a slice is not implemented; each load instruction reads the same rows and columns)
    gl.static_assert(gl.bank_conflicts(gl.distributed_type(gl.float8e4nv, [BN, 128], CODES),
                                       w_tile.type) == 0)
    codes = w_tile.slice(32 * WK * g, 32 * WK, dim=1).load(CODES)                           # [BN, 32 WK]
    NW: gl.constexpr = 8 // LK          # 4-byte words a thread's part of a block
    # [BN, WK, LK, NW words, 4 bytes] -> [BN, WK, LK, 4, NW] and the word index split in bits
    w = gl.permute(gl.reshape(codes, [BN, WK, LK, NW, 4]), (0, 1, 2, 4, 3))
    # With one weight row a thread and one x row, two DFMA chains, the even and the odd words, for
    # two independent FMAs in flight (their sum is exact: both are exact partial sums of the
    # block); else one chain per (weight row, x row), RW x R of them
    TWO: gl.constexpr = BN * WK * LK // 128 * R == 1
    acc0 = gl.zeros([BN, WK, LK, R], gl.float64, L)
    acc1 = gl.zeros([BN, WK, LK, R], gl.float64, L)
    if NW == 8:
        # word q = 4 q2 + 2 q1 + q0: the last dimension's bits split off q0, then q1, then q2
        ws0, ws1 = gl.split(gl.reshape(w, [BN, WK, LK, 4, 2, 2, 2]))
        for q0 in gl.static_range(2):
            ws00, ws01 = gl.split((ws0, ws1)[q0])
            for q1 in gl.static_range(2):
                ws000, ws001 = gl.split((ws00, ws01)[q1])
                for q2 in gl.static_range(2):
                    acc0, acc1 = _word(acc0, acc1, (ws000, ws001)[q2], xf, 4 * q2 + 2 * q1 + q0, g, WK, LK, R, TWO, L)
    elif NW == 4:
        ws0, ws1 = gl.split(gl.reshape(w, [BN, WK, LK, 4, 2, 2]))
        for q0 in gl.static_range(2):
            ws00, ws01 = gl.split((ws0, ws1)[q0])
            for q1 in gl.static_range(2):
                acc0, acc1 = _word(acc0, acc1, (ws00, ws01)[q1], xf, 2 * q1 + q0, g, WK, LK, R, TWO, L)
    else:
        ws0, ws1 = gl.split(w)
        for q0 in gl.static_range(2):
            acc0, acc1 = _word(acc0, acc1, (ws0, ws1)[q0], xf, q0, g, WK, LK, R, TWO, L)
    if TWO:
        acc0 = acc0 + acc1
    return gl.reduce(acc0, 2, add_combine)


@gluon.jit
def _x_rows(xv, LK: gl.constexpr):
    """x's values [R, 128] (column 32 block + k) as `xf`'s rows [128, R]: k = 32 / LK part + c at
    row c 4 LK + block LK + part (for each c the slot's blocks and parts side by side, a block
    group's contiguous: `_word`)."""
    R: gl.constexpr = xv.shape[0]
    return gl.reshape(gl.permute(gl.reshape(xv, [R, 4, LK, 32 // LK]), (3, 1, 2, 0)), [128, R])


@gluon.jit
def _add_terms(acc, terms, BN: gl.constexpr, R: gl.constexpr, TERMS: gl.constexpr):
    """acc + t0 + t1 + t2 + t3, one add at a time in K order: the four block terms of a slot
    (`terms`: [4, BN, R] FP32 in shared memory) of each output, read by its thread."""
    # [BN, R, 2, 2]: block j = 2 a + b at [..., a, b]
    t = gl.reshape(gl.permute(terms.reshape([4, BN, R]).load(TERMS), (1, 2, 0)), [BN, R, 2, 2])
    t02, t13 = gl.split(t)
    t0, t2 = gl.split(t02)
    t1, t3 = gl.split(t13)
    for j in gl.static_range(4):
        acc = acc + gl.convert_layout((t0, t1, t2, t3)[j], acc.type.layout, assert_trivial=True)
    return acc


@gluon.jit
def _publish_terms(terms, ws, BN: gl.constexpr, R: gl.constexpr):
    """The K split's copy of a slot's four block terms ([4 blocks x BN, R] FP32 in shared memory) to
    the workspace at `ws` (the same [4, BN, R] order: the tile's slabs [K / 32, BN, R], one per
    block, contiguous), every consumer thread 16 contiguous bytes at a time (coalesced)."""
    E: gl.constexpr = 4 * BN * R
    flat: gl.constexpr = gl.BlockedLayout(size_per_thread=[4], threads_per_warp=[32], warps_per_cta=[4],
                                          order=[0])
    gl.store(ws + gl.arange(0, E, layout=flat), terms.reshape([E]).load(flat))


@gluon.jit
def _slot_terms(w_tile, xf, sw, sx, jw, g: gl.constexpr, BN: gl.constexpr, WK: gl.constexpr, LK: gl.constexpr,
                R: gl.constexpr, LANES: gl.constexpr, CODES: gl.constexpr):
    """The terms [BN, WK, R] FP32 of the slot's block group g: the exact block sums times 2^-16
    (`_group_sums`) rounded once to FP32, times 2^16 (exact), times sx, then times sw (`mul.rn`);
    sw [BN, 1, 1] and sx [1, 1, R] the slot's scale words, jw [1, WK, 1] the warp's place in the
    group."""
    part = _group_sums(w_tile, xf, g, BN, WK, LK, R, LANES, CODES)                     # [BN, WK, R] FP64
    j = WK * g + jw
    # RN(sum * 2^-16) * 2^16 = RN(sum): a nonzero block sum is at least 2^-18 in magnitude, so the
    # scaled one stays a normal FP32 (>= 2^-34) and below 2^7 (module doc).
    scaled, sw_b = gl.broadcast(part.to(gl.float32) * 65536.0 * scale_byte(sx >> (8 * j), 0),
                                scale_byte(sw >> (8 * j), 0))
    return libdevice.mul_rn(scaled, sw_b)


@gluon.jit
def _consumer(w_smem, x_smem, ready, empty, xf, terms, sw_words, sx_words, n_steps,
              BN: gl.constexpr, WK: gl.constexpr, LK: gl.constexpr, R: gl.constexpr, STAGES: gl.constexpr,
              LANES: gl.constexpr, CODES: gl.constexpr, TERMS: gl.constexpr, SPLIT: gl.constexpr = False,
              ws=None, publish=None):
    """The consumer warps, per ring slot i: x's codes converted to FP64 value * 2^1000 into `xf`
    ([128, R] in shared memory, `_x_rows`' order); barrier 1; slot i - 1's terms added in K order
    from `terms` ([4 blocks x BN, R] FP32 in shared memory); slot i's terms (`_slot_terms`, every
    group of the thread's blocks, in registers); barrier 2 (every thread's reads of the slot's tiles,
    of xf and of the terms done); slot i handed back to the producer and its terms stored. The
    last slot's terms after a final barrier. Two barriers a slot order every reuse of xf and terms
    (no double buffers). SPLIT: the program's n_steps slots of the tile's K; where `publish`
    (runtime), slot i's terms also copied to the workspace at ws + i x 4 BN R (`_publish_terms`)
    when they are added. Returns (acc, ): [BN, R] FP32 in SliceLayout(0, TERMS)."""
    L: gl.constexpr = gl.SliceLayout(2, LANES)
    acc = gl.zeros([BN, R], gl.float32, gl.SliceLayout(0, TERMS))
    # x's codes: each of the 128 threads converts R of a slot's R x 128
    xl: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 1], threads_per_warp=[1, 32], warps_per_cta=[1, 4],
                                        order=[1, 0])
    # the K block of each thread's group-g terms: WK g + (its warp along K)
    jw = gl.expand_dims(gl.expand_dims(gl.arange(0, WK, layout=gl.SliceLayout(0, gl.SliceLayout(2, L))), 0), 2)
    # the scale words (four UE8M0 bytes a row and 128-deep step) loaded one slot ahead
    sw_next = gl.load(sw_words)
    sx_next = gl.load(sx_words)
    for i in range(n_steps):
        s = i % STAGES
        sw = gl.expand_dims(gl.expand_dims(sw_next, 1), 2)                                     # [BN, 1, 1]
        sx = gl.expand_dims(gl.expand_dims(sx_next, 0), 1)                                     # [1, 1, R]
        sw_next = gl.load(sw_words + gl.minimum(i + 1, n_steps - 1))
        sx_next = gl.load(sx_words + gl.minimum(i + 1, n_steps - 1))
        mbarrier.wait(ready.index(s), (i // STAGES) & 1)
        xv = pow2(x_smem.index(s).load(xl).to(gl.float32).to(gl.float64), 1000)             # [R, 128]
        xf.store(_x_rows(xv, LK))
        # x's values and the previous slot's terms stored by every thread
        gl.thread_barrier()
        if i > 0:
            acc = _add_terms(acc, terms, BN, R, TERMS)
            if SPLIT:
                if publish:
                    _publish_terms(terms, ws + (i - 1) * (4 * BN * R), BN, R)
        w_tile = w_smem.index(s)
        # the slot's terms [4 x BN, R], row j BN + n for block j = WK g + w
        if WK == 4:
            t = gl.permute(_slot_terms(w_tile, xf, sw, sx, jw, 0, BN, WK, LK, R, LANES, CODES), (1, 0, 2))
        elif WK == 2:
            t = gl.join(_slot_terms(w_tile, xf, sw, sx, jw, 0, BN, WK, LK, R, LANES, CODES),
                        _slot_terms(w_tile, xf, sw, sx, jw, 1, BN, WK, LK, R, LANES, CODES))    # [BN, 2, R, g]
            t = gl.permute(t, (3, 1, 0, 2))
        else:
            t01 = gl.join(_slot_terms(w_tile, xf, sw, sx, jw, 0, BN, WK, LK, R, LANES, CODES),
                          _slot_terms(w_tile, xf, sw, sx, jw, 1, BN, WK, LK, R, LANES, CODES))
            t23 = gl.join(_slot_terms(w_tile, xf, sw, sx, jw, 2, BN, WK, LK, R, LANES, CODES),
                          _slot_terms(w_tile, xf, sw, sx, jw, 3, BN, WK, LK, R, LANES, CODES))
            t = gl.permute(gl.join(t01, t23), (4, 3, 1, 0, 2))                # [BN, 1, R, b, a] -> g = 2 a + b
        # every thread's reads of the slot's tiles, of xf and of the previous terms done
        gl.thread_barrier()
        mbarrier.arrive(empty.index(s), count=1)
        terms.store(gl.reshape(t, [4 * BN, R]))
    gl.thread_barrier()
    acc = _add_terms(acc, terms, BN, R, TERMS)
    if SPLIT:
        if publish:
            _publish_terms(terms, ws + (n_steps - 1) * (4 * BN * R), BN, R)
    return (acc, )


@gluon.jit(do_not_specialize=["M", "stride_sxm", "stride_swn", "n_steps", "steps_per_split", "n_split", "stride_cm",
                             "stride_sm"])
def _gluon_exact_fma_kernel(
    w_desc, x_desc, sx_ptr, sw_ptr, y_ptr,
    M, N, stride_sxm, stride_swn, stride_ym, n_steps,
    ws_ptr, cnt_ptr, steps_per_split, n_split,
    WK: gl.constexpr, LK: gl.constexpr, STAGES: gl.constexpr, OUT_F32: gl.constexpr, SPLIT: gl.constexpr = False,
    cos_ptr=None, sin_ptr=None, stride_cm=None, stride_sm=None, ROPE: gl.constexpr = False, PDL: gl.constexpr = False,
):
    # Grid (N / BN, n_split): program (t, s) covers weight rows [t BN, +BN), all M rows of x and
    # the K steps [s steps_per_split, +steps_per_split) of the n_steps (every step without SPLIT);
    # sx_ptr and sw_ptr point at the scales as int32 words (four UE8M0 bytes a 128-deep step),
    # strides in words. Weight rows past N (TMA's zeros) read the last valid row's scales and x rows
    # past M (the row bucket's padding, TMA's zeros) the last valid x row's; both masked at the store.
    # SPLIT (n_split > 1): ws_ptr holds each tile's K / 32 block terms [K / 32, BN, R] (FP32, all R
    # rows), cnt_ptr its counter; split 0 adds its blocks' terms in K order from 0 as the whole
    # kernel does and leaves the sum in the slab of its last block, the other splits copy their
    # terms to their blocks' slabs, and the tile's last program to arrive continues split 0's sum
    # with the other splits' terms in K order (`gluon_exact_common.split_k_sum`): the same FP32 adds
    # in the same order as without the split. ROPE: the query RoPE epilogue (`gluon_exact_common.store_tile`)
    # with cos/sin [M, 32] FP32 at cos_ptr / sin_ptr (row strides stride_cm / stride_sm; all four
    # None without it, so that they take no kernel parameter). PDL: launched by programmatic
    # dependent launch, the ring's first weight tiles requested before the wait for the kernel
    # before it (`gluon_ring.ring_prefill`), its x tiles after (`gluon_ring.producer_prefilled`).
    BN: gl.constexpr = w_desc.block_type.shape[0]
    R: gl.constexpr = x_desc.block_type.shape[0]
    # LANES [BN, WK, LK, R]: the (weight row, K block, part of the block, x row) of each thread's
    # DFMA chains. A warp's 32 lanes: 32 / LK weight rows (the fastest) x the LK parts (32 / LK k
    # each) of one block; per thread BN / (32 / LK x 4 / WK) weight rows, 32 / LK x 4 / WK apart,
    # and the R x rows; the 4 / WK warps along the weight rows, the WK warps along the slot's K
    # blocks (warp w block w of each group of WK blocks). The block sums: SliceLayout(2, LANES).
    LANES: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 1, 1, R], threads_per_warp=[32 // LK, 1, LK, 1],
                                           warps_per_cta=[4 // WK, WK, 1, 1], order=[0, 2, 1, 3])
    # CODES [BN, 32 WK]: a group of WK blocks of the slot's weight tile, per thread its rows' 32 / LK
    # codes of its part of its warp's block (LANES' threads)
    CODES: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 32 // LK], threads_per_warp=[32 // LK, LK],
                                           warps_per_cta=[4 // WK, WK], order=[0, 1])
    # TERMS [4, BN, R]: the slot's four block terms of each output in one thread (the threads
    # along the weight rows, each all R x rows)
    TERMS: gl.constexpr = gl.BlockedLayout(size_per_thread=[4, 1, R], threads_per_warp=[1, 32, 1],
                                           warps_per_cta=[1, 4, 1], order=[0, 2, 1])
    L: gl.constexpr = gl.SliceLayout(2, LANES)
    w_smem, x_smem, ready, empty = ring(w_desc, x_desc, STAGES)
    xf = gl.allocate_shared_memory(gl.float64, [128, R], gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0]))
    terms = gl.allocate_shared_memory(gl.float32, [4 * BN, R], gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0]))
    pid_n = gl.program_id(0)
    rn = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, gl.SliceLayout(2, L)))
    rm = gl.arange(0, R, layout=gl.SliceLayout(0, gl.SliceLayout(1, L)))
    sw_words = sw_ptr + (gl.minimum(rn, N - 1) // 32) * stride_swn
    sx_words = sx_ptr + gl.minimum(rm, M - 1) * stride_sxm
    SLAB: gl.constexpr = BN * R          # a K block's terms of the tile in the workspace
    if SPLIT:
        pid_s = gl.program_id(1)
        step_lo = pid_s * steps_per_split
        n_here = gl.minimum(steps_per_split, n_steps - step_lo)
        if PDL:
            ring_prefill(w_desc, x_desc, w_smem, ready, pid_n * BN, step_lo, n_here, STAGES)
        ws_tile = ws_ptr + pid_n * (n_steps * 4 * SLAB)
        acc, = gl.warp_specialize([
            (_consumer, (w_smem, x_smem, ready, empty, xf, terms, sw_words + step_lo, sx_words + step_lo, n_here,
                         BN, WK, LK, R, STAGES, LANES, CODES, TERMS, True, ws_tile + step_lo * (4 * SLAB), pid_s > 0)),
            (ring_producer, (w_desc, x_desc, w_smem, x_smem, ready, empty, pid_n * BN, 0, 0, step_lo, n_here, STAGES,
                             PDL)),
        ], [1], [24])
    else:
        if PDL:
            ring_prefill(w_desc, x_desc, w_smem, ready, pid_n * BN, 0, n_steps, STAGES)
        acc, = gl.warp_specialize([
            (_consumer, (w_smem, x_smem, ready, empty, xf, terms, sw_words, sx_words, n_steps, BN, WK, LK, R, STAGES,
                         LANES, CODES, TERMS)),
            (ring_producer, (w_desc, x_desc, w_smem, x_smem, ready, empty, pid_n * BN, 0, 0, 0, n_steps, STAGES, PDL)),
        ], [1], [24])
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(i))
        mbarrier.invalidate(empty.index(i))
    out_layout: gl.constexpr = gl.SliceLayout(0, TERMS)
    ol = gl.arange(0, BN, layout=gl.SliceLayout(1, out_layout))
    on = pid_n * BN + ol
    om = gl.arange(0, R, layout=gl.SliceLayout(0, out_layout))
    y_ptrs = y_ptr + om[None, :] * stride_ym + on[:, None]
    mask = (on[:, None] < N) & (om[None, :] < M)
    if SPLIT:
        # split 0's sum of blocks [0, P) (P = 4 steps_per_split) in slab P - 1; the last arriver
        # adds it to -0.0 (exact: -0.0 + x = x) and then the terms of blocks P .. K / 32 - 1
        prefix = ws_tile + (4 * steps_per_split - 1) * SLAB
        if pid_s == 0:
            gl.store(prefix + ol[:, None] * R + om[None, :], acc)
        # the sum's layout: the tile's BN x R outputs over all 128 threads where there are as many
        # (x rows across the lanes first), so that each thread's chains are few and its loads in
        # flight many
        SUM: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 1], threads_per_warp=[32 // R, R],
                                             warps_per_cta=[4, 1], order=[1, 0])
        sn = gl.arange(0, BN, layout=gl.SliceLayout(1, SUM))
        sm = gl.arange(0, R, layout=gl.SliceLayout(0, SUM))
        last, total = split_k_sum(gl.full([BN, R], -0.0, gl.float32, SUM), prefix + sn[:, None] * R + sm[None, :],
                                   None, SLAB, 4 * (n_steps - steps_per_split) + 1, cnt_ptr + pid_n, n_split,
                                   sum_chunk(max(1, BN * R // 128)))
        if last:
            store_tile(y_ptr + sm[None, :] * stride_ym + pid_n * BN + sn[:, None], total,
                   (pid_n * BN + sn[:, None] < N) & (sm[None, :] < M), OUT_F32, pid_n * BN, M, cos_ptr, sin_ptr,
                   stride_cm, stride_sm, ROPE)
    else:
        store_tile(y_ptrs, acc, mask, OUT_F32, pid_n * BN, M, cos_ptr, sin_ptr, stride_cm, stride_sm, ROPE)


ROW_BUCKETS = (1, 2, 4)         # R: the x rows a program computes (TMA's box; rows past M are its zeros)


@dataclass(frozen=True)
class GluonExactFMAConfig:
    """One launch configuration; every configuration gives the same bits.

    rows_per_thread: weight rows a consumer thread owns (1, 2 or 4): they share each broadcast
        load of x's values; more rows, fewer programs.
    warps_k: of the 4 consumer warps, how many split each slot's four 32-deep K blocks (1, 2 or
        4; the others split the weight rows).
    lanes_k: lanes that share one (weight row, K block), each 32 / lanes_k of its k (1, 2 or 4);
        their exact FP64 partial sums meet by lane shuffles. More, smaller programs for the
        shapes with few weight rows (wo_b), at more instructions per code (the slot's fixed
        work spread over fewer codes a thread).
    stages: ring slots, 2..8.
    maxnreg: the launch's register cap per thread (the CTA holds 8 warps x 32 x cap registers: the
        consumer's 4 warps and the producer's, padded to 8; the producer drops to 24); 128 keeps
        two CTAs per SM resident, 80 three; no configuration the probe offers spills there
        (sm_90 compiles at 1, 2 and 4 rows); None: Triton's (256, one CTA per SM).
    split: programs per weight tile that share its K (1..64): each takes a contiguous run of the
        128-deep steps (`gluon_mm.split_bounds`: the plan uses fewer splits where K has too few
        steps, so that none is empty), and their block terms meet in a plan-owned workspace
        (module doc, "K split"); 1: one program walks the tile's whole K.

    block_n = 32 x rows_per_thread x 4 / warps_k / lanes_k weight rows a program (8 to 256: a TMA
    box's side), N / block_n x split programs.
    """

    rows_per_thread: int = 4
    warps_k: int = 4
    lanes_k: int = 1
    stages: int = 4
    maxnreg: int | None = 128
    split: int = 1

    @property
    def block_n(self) -> int:
        """Weight rows a program: 32 / lanes_k lanes x rows_per_thread x the 4 / warps_k warps."""
        return 32 * self.rows_per_thread * 4 // self.warps_k // self.lanes_k

    @classmethod
    def from_spec(cls, spec: str) -> "GluonExactFMAConfig":
        """The configuration a spec string names, rows_per_thread:warps_k:lanes_k:stages[:maxnreg[:split]]
        (maxnreg 0: None; absent: 128; split absent: 1), the form scripts/probe_gluon_exact_fma.py
        prints. A field that is not an integer, or too few or too many fields, raise a ValueError
        that names them; a bad value, the field's own error."""
        form = "rows_per_thread:warps_k:lanes_k:stages[:maxnreg[:split]]"
        names = form.replace("[", "").replace("]", "").split(":")
        fields = str(spec).split(":")
        if not 4 <= len(fields) <= len(names):
            raise ValueError(f"a GluonExactFMAConfig spec is {form}, integers, got {spec!r} ({len(fields)} fields)")
        values = {}
        for name, field in zip(names, fields):
            try:
                values[name] = int(field)
            except ValueError:
                raise ValueError(f"a GluonExactFMAConfig spec is {form}, integers, got {spec!r} ({name} "
                                 f"{field!r})") from None
        values["maxnreg"] = values.get("maxnreg", 128) or None
        return cls(**values)

    def __post_init__(self):
        def is_int(v):
            return isinstance(v, int) and not isinstance(v, bool)
        for name in ("rows_per_thread", "warps_k", "lanes_k"):
            v = getattr(self, name)
            if v not in (1, 2, 4) or not is_int(v):
                raise ValueError(f"GluonExactFMAConfig.{name} must be 1, 2 or 4, got {v!r}")
        if self.block_n > 256:
            raise ValueError(f"GluonExactFMAConfig: block_n = 32 x rows_per_thread={self.rows_per_thread} x 4 / "
                             f"warps_k={self.warps_k} / lanes_k={self.lanes_k} = {self.block_n} weight rows; at most "
                             f"256 (a TMA box's side)")
        if not is_int(self.stages) or not 2 <= self.stages <= 8:
            raise ValueError(f"GluonExactFMAConfig.stages must be an int in [2, 8], got {self.stages!r}")
        require_maxnreg(self)
        if not is_int(self.split) or not 1 <= self.split <= MAX_SPLIT:
            raise ValueError(f"GluonExactFMAConfig.split must be an int in [1, {MAX_SPLIT}], got {self.split!r}")
        if shared_bytes(self, ROW_BUCKETS[-1]) > SHARED_LIMIT:
            raise ValueError(f"GluonExactFMAConfig: stages={self.stages} x (block_n={self.block_n} + 4) x {BLOCK_K} "
                             f"bytes of ring, x's values and the block terms exceed sm_90's {SHARED_LIMIT} bytes of "
                             f"shared memory ({shared_bytes(self, ROW_BUCKETS[-1])}): fewer stages")


def block_t(rows: int) -> int:
    """The x rows a program computes (R) for a call of `rows` rows: 1, 2 or 4."""
    return next(b for b in ROW_BUCKETS if b >= rows)


def shared_bytes(config: GluonExactFMAConfig, bt: int) -> int:
    """The shared memory of a launch at row bucket `bt`: the ring's weight and activation tiles, x's
    FP64 values (128 x bt x 8 bytes) and the block terms (4 x block_n x bt x 4), 1 KB for the
    mbarriers and what the compiler adds."""
    return config.stages * (config.block_n + bt) * BLOCK_K + 128 * bt * 8 + 4 * config.block_n * bt * 4 + 1024


def launch_options(config: GluonExactFMAConfig, split: int = 1) -> dict:
    """The kernel's constexpr arguments and launch options for `config` with `split` K splits (the
    plan's `split_of`; the plan's launch and the sm_90 compile test share them): the consumer's 4
    warps and the producer's warp, padded to 8 warps; enable_reflect_ftz=False keeps the FP32
    subnormals of the scaling's `mul.rn` (libdevice; Triton's default flushes them)."""
    opts = {"WK": config.warps_k, "LK": config.lanes_k, "STAGES": config.stages, "SPLIT": split > 1,
            "num_warps": CONSUMER_WARPS, "enable_reflect_ftz": False}
    if config.maxnreg is not None:
        opts["maxnreg"] = config.maxnreg
    return opts


# default_config's tiles, largest first: (4 rows a thread, 128-row tiles, two CTAs an SM), then
# 64, 32, 16 (2 lanes a block) and 8 rows (4 lanes) at a cap of 80 registers (three CTAs an SM) with
# deeper rings (the tiles are small)
_TILES = (GluonExactFMAConfig(rows_per_thread=4, warps_k=4, lanes_k=1, stages=4, maxnreg=128),
          GluonExactFMAConfig(rows_per_thread=2, warps_k=4, lanes_k=1, stages=6, maxnreg=80),
          GluonExactFMAConfig(rows_per_thread=1, warps_k=4, lanes_k=1, stages=8, maxnreg=80),
          GluonExactFMAConfig(rows_per_thread=1, warps_k=4, lanes_k=2, stages=8, maxnreg=80),
          GluonExactFMAConfig(rows_per_thread=1, warps_k=4, lanes_k=4, stages=8, maxnreg=80))


def default_config(n: int, sms: int) -> GluonExactFMAConfig:
    """The configuration a plan of N weight rows takes without one (an estimate, not a measurement:
    scripts/probe_gluon_exact_fma.py measures the candidates): the largest tile (`_TILES`: fewest
    instructions a code) that still gives at least 1.5 programs per SM, else the smallest (8 rows).
    At 132 SMs: wq_b (32768 rows) 128-row tiles, the indexer's wq_b (4096) 16, wo_b (5120) 16,
    fused wq_a|wkv (1792) 8."""
    return next((c for c in _TILES if -(-n // c.block_n) * 2 >= 3 * sms), _TILES[-1])


class GluonExactFMA(GluonExactPlan):
    """y[M, N] = bf16(sum over 32-wide K blocks kb, in K order, of RN(codes[:, kb] . weight[:, kb])
    * sx * sw) for 1 <= M <= max_rows <= 4, with the weight bound once: bitwise the contract of
    `reference.linear.mxfp8_mm`, on the FP64 CUDA cores from a TMA ring (module docstring); sm_90
    only. Reduction order: `exact_mm.reduction_order`, the same for every row count.

    weight: [N, K] float8_e4m3fn, unit stride along K, 16-byte aligned rows (TMA); K a positive
        multiple of 128 (the ring's 128-deep slots, one scale word per row per slot).
    w_scale: [ceil(N/32), K/32] UE8M0 (float8_e8m0fnu or uint8), unit stride along K, rows on
        4-byte boundaries.
    max_rows: the most rows a call may bring (1..4); a call of 3 rows computes 4 (TMA's zero rows).
    config: the launch configuration: one GluonExactFMAConfig for every call (default
        `default_config(N, the device's SMs)`), or `{most rows: GluonExactFMAConfig}` for calls of up to that many
        rows (the largest key >= max_rows). Every configuration gives the same bits.
    workspace: None (the plan allocates the K split's workspace and counters) or a shared pool, as
        `ops.common.plan_workspace` says (FP32 slot 0, int32 slot 0: GluonExactMM's, so an
        `ExactLinear` may hand both ops its pool - they never run at once). A plan without a split
        configuration takes one FP32 word and one counter.

    A call's codes must have 16-byte aligned rows (TMA) and its x_scale rows 4-byte boundaries. A
    plan whose launches split K owns (or takes) a workspace of N / block_n x K / 32 x block_n x R
    FP32 (R: the row bucket of its most rows, 1, 2 or 4) and one int32 counter per weight tile, zero
    between calls; its calls must not overlap in time (one stream, or ordered streams).
    """

    def __init__(self, weight: torch.Tensor, w_scale: torch.Tensor, max_rows: int = MAX_ROWS,
                 config: GluonExactFMAConfig | dict[int, GluonExactFMAConfig] | None = None, workspace=None):
        n, k = ring_weight_args(weight, w_scale, max_rows, MAX_ROWS, "ops.exact_mm")
        if config is None:
            config = default_config(n, num_sms(weight.device))
        self._configs = row_configs(config, GluonExactFMAConfig, "a GluonExactFMAConfig", max_rows)
        self._bind(weight, w_scale, max_rows, [(c.block_n, BLOCK_K) for _, c in self._configs])
        # The split launches' workspace: each weight tile's [K / 32, block_n, R] block terms.
        self._bind_split(workspace, [(c.block_n, k // 32 * c.block_n * block_t(min(most, max_rows)))
                                     for most, c in self._configs if self.split_of(c) > 1])

    def split_of(self, config: GluonExactFMAConfig) -> int:
        """The K splits a launch in `config` runs: config.split, fewer where K has too few 128-deep
        steps for none to be empty (`gluon_mm.split_bounds`)."""
        return split_bounds(config.split, self.k, BLOCK_K)[1]

    def _launch(self, codes: torch.Tensor, x_scale: torch.Tensor, out: torch.Tensor, m: int,
                cfg: GluonExactFMAConfig, epilogue: dict) -> None:
        """The kernel's launch for a call of m rows in `cfg`, its arguments checked (`__call__`);
        epilogue: `exact_mm.rope_kwargs`' keyword arguments."""
        x_desc, sx_words = activation_operands(codes, x_scale, block_t(m), BLOCK_K)
        per, split = split_bounds(cfg.split, self.k, BLOCK_K)
        _gluon_exact_fma_kernel[(-(-self.n // cfg.block_n), split)](
            self._w_descs[(cfg.block_n, BLOCK_K)], x_desc, sx_words, self._sw_words, out,
            m, self.n, sx_words.stride(0), self._sw_words.stride(0), out.stride(0), self.k // BLOCK_K,
            self._workspace, self._counters, per // BLOCK_K, split,
            OUT_F32=out.dtype == torch.float32, **launch_options(cfg, split), **epilogue,
        )
