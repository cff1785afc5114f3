"""The records of the sparse MLA's key list, gathered and decoded exactly to BF16 in Gluon (sm_90):
the helpers that `ops.gluon_sparse_mla` (the blocks' scores and, in one pass, P.V) and
`ops.gluon_sparse_mla_pv` (P.V and the combination in a second launch) share, so that both decode
the same values from the same bytes; and the Gluon reductions' combines and the BF16 rounding they
both use.

Record layouts (`records.py`): a window record is 512 E4M3 codes then 16 UE8M0 scales (one per 32
dims, 528 bytes); a compressed record 256 bytes of E2M1 pairs (low nibble first) then 32 E4M3
scales (one per 16 dims, 288 bytes). A block's keys are 64 consecutive entries of the row's joined
key list (its window keys, then its compressed entries), decoded 128 dims (a chunk) at a time by
the launch's `NUM_WARPS` warps.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from ..records import COMPRESSED_KV_BYTES, WINDOW_KV_BYTES
from .sparse_mla_plan import BLOCK_KEYS

# The reductions go through `gl.reduce` with the Gluon combines below, not gl.sum / gl.max: those wrap
# `triton.language.standard`'s, whose combine functions are interpreted functions under
# TRITON_INTERPRET=1 (the CPU tests' setting), which the Gluon compiler rejects; the compile tests
# run there.

# Two warpgroups: the scores' 64 keys and each P.V chunk's 128 dims split between them (the wgmma's
# M is 64, one warpgroup's; 8 warps also spread the gather and decode of 64 x 512 values).
NUM_WARPS = 8
_WARPS: gl.constexpr = gl.constexpr(NUM_WARPS)
_KEYS: gl.constexpr = gl.constexpr(BLOCK_KEYS)
_M: gl.constexpr = gl.constexpr(64)          # the wgmma's M: the heads, padded
_DC: gl.constexpr = gl.constexpr(128)        # dims per chunk of the keys in shared memory and of each P.V MMA
_WREC: gl.constexpr = gl.constexpr(WINDOW_KV_BYTES)
_CREC: gl.constexpr = gl.constexpr(COMPRESSED_KV_BYTES)


@gluon.jit
def _e2m1(c):
    """FP32 value of E2M1 codes 0..15 (int32; bit 3 sign; magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6), as
    `fp4.e2m1_value`."""
    e = (c >> 1) & 3
    m = c & 1
    normal = ((e + 126) << 23 | (m << 22)).to(gl.float32, bitcast=True)
    mag = gl.where(e == 0, m.to(gl.float32) * 0.5, normal).to(gl.uint32, bitcast=True)
    return (mag | ((c & 8).to(gl.uint32) << 28)).to(gl.float32, bitcast=True)


@gluon.jit
def _load_chunk(pool_ptr, base, ok, C, WINDOW: gl.constexpr, FP4_PACKED: gl.constexpr,
                layout: gl.constexpr, DW: gl.constexpr = 128, SCALE_ONCE: gl.constexpr = True):
    """The bytes of dims [DW C, DW C + DW) of 64 records (byte offsets `base` [64] int64 in the
    rows' slice of `layout`, a [64, DW] layout of DW / 8 consecutive dims per thread; keys with ok
    False load nothing): (codes, scales) for `_decode_loaded`. Window: 512 E4M3 codes, then 16
    UE8M0 scales (one per 32 dims). Compressed: 256 bytes of E2M1 pairs (low nibble first), then 32
    E4M3 scales (one per 16 dims); FP4_PACKED: the chunk's DW / 2 code bytes a key, DW / 16 to a
    thread (and a scale per byte: at DW 128 with SCALE_ONCE one load of the byte a thread's 8 code
    bytes share, broadcast over them; else a load per code byte, which ptxas does not merge), else
    a code byte and a scale per dim."""
    rc = C * DW + gl.arange(0, DW, layout=gl.SliceLayout(0, layout))
    rows = pool_ptr + base[:, None]
    okb = ok[:, None]
    if WINDOW:
        codes = gl.load(rows + rc[None, :], mask=okb, other=0)
        sc = gl.load(rows + 512 + (rc // 32)[None, :], mask=okb, other=127)
    elif FP4_PACKED:
        lb: gl.constexpr = gl.BlockedLayout([1, DW // 16], [4, 8], [_WARPS, 1], [1, 0])
        rb = C * (DW // 2) + gl.arange(0, DW // 2, layout=gl.SliceLayout(0, lb))
        ok_b = gl.convert_layout(ok, gl.SliceLayout(1, lb), assert_trivial=True)[:, None]
        rows_b = pool_ptr + gl.convert_layout(base, gl.SliceLayout(1, lb), assert_trivial=True)[:, None]
        codes = gl.load(rows_b + rb[None, :], mask=ok_b, other=0)
        if SCALE_ONCE and DW == 128:
            # one scale byte a thread and 8 code bytes (16 dims), broadcast over them: [64, DW / 16]
            # loaded, then [64, DW / 16, 8] reshaped into the codes' layout (no data moved)
            ls: gl.constexpr = gl.BlockedLayout([1, 1, 8], [4, 8, 1], [_WARPS, 1, 1], [2, 1, 0])
            l2: gl.constexpr = gl.SliceLayout(2, ls)
            rs = C * (DW // 16) + gl.arange(0, DW // 16, layout=gl.SliceLayout(0, l2))
            ok_s = gl.convert_layout(ok, gl.SliceLayout(1, l2), assert_trivial=True)[:, None]
            rows_s = pool_ptr + gl.convert_layout(base, gl.SliceLayout(1, l2), assert_trivial=True)[:, None]
            sc1 = gl.load(rows_s + 256 + rs[None, :], mask=ok_s, other=0)
            sc3 = gl.broadcast(gl.expand_dims(sc1, 2), gl.zeros([_KEYS, DW // 16, 8], gl.uint8, ls))[0]
            sc = gl.convert_layout(gl.reshape(sc3, [_KEYS, DW // 2]), lb, assert_trivial=True)
        else:
            sc = gl.load(rows_b + 256 + (rb // 8)[None, :], mask=ok_b, other=0)
    else:
        codes = gl.load(rows + (rc // 2)[None, :], mask=okb, other=0)
        sc = gl.load(rows + 256 + (rc // 16)[None, :], mask=okb, other=0)
    return codes, sc


# E2M1 x E4M3 scale to BF16 for 4 code bytes (8 values) at once, `GluonSparseMlaConfig.fp4_lut`:
# the magnitudes' BF16 bytes looked up with PRMT (E2M1 magnitude m = 0..7 is 0, .5, 1, 1.5, 2, 3,
# 4, 6: high bytes 00 3F 3F 3F 40 40 40 40, low bytes 00 00 80 C0 00 40 80 C0), the bytes
# interleaved into BF16 pairs, the sign bits ORed in, times the scale as a BF16 pair (E4M3 ->
# f16x2 -> f32 -> bf16, exact). The product of a 2-bit and a 4-bit significand is exact in BF16
# and in its normal range (>= 0.5 * 2^-9), so every value is `fp4.e2m1_value * e4m3_value`
# exactly, as the FP32 path's. $0, $1: the low nibbles' values of bytes (0, 1), (2, 3); $2, $3:
# the high nibbles'; $4: the 4 code bytes; $5: their scale bytes (all the same one).
_FP4_LUT_ASM: gl.constexpr = gl.constexpr("""{
.reg .b32 m, m2, hA, hB, lA, lB, s4, sL, sH, sg, f2, w;
.reg .b16 sc16, hlo, hhi;
.reg .f32 sf;
and.b32 m, $4, 0x77777777;
shr.b32 m2, m, 16;
prmt.b32 hA, 0x3F3F3F00, 0x40404040, m;
prmt.b32 hB, 0x3F3F3F00, 0x40404040, m2;
prmt.b32 lA, 0xC0800000, 0xC0804000, m;
prmt.b32 lB, 0xC0800000, 0xC0804000, m2;
shl.b32 s4, $4, 4;
and.b32 sL, s4, 0x80808080;
and.b32 sH, $4, 0x80808080;
mov.b32 {sc16, hhi}, $5;
cvt.rn.f16x2.e4m3x2 f2, sc16;
mov.b32 {hlo, hhi}, f2;
cvt.f32.f16 sf, hlo;
cvt.rn.bf16x2.f32 f2, sf, sf;
prmt.b32 w, lA, hA, 0x6240;
prmt.b32 sg, sL, 0, 0x1404;
or.b32 w, w, sg;
mul.rn.bf16x2 $0, w, f2;
prmt.b32 w, lB, hB, 0x6240;
prmt.b32 sg, sL, 0, 0x3424;
or.b32 w, w, sg;
mul.rn.bf16x2 $1, w, f2;
prmt.b32 w, lA, hA, 0x7351;
prmt.b32 sg, sH, 0, 0x1404;
or.b32 w, w, sg;
mul.rn.bf16x2 $2, w, f2;
prmt.b32 w, lB, hB, 0x7351;
prmt.b32 sg, sH, 0, 0x3424;
or.b32 w, w, sg;
mul.rn.bf16x2 $3, w, f2;
}""")


@gluon.jit
def _ue8m0_value(sc):
    """FP32 2^(e - 127) of UE8M0 bytes from the FP32 bits, byte 255 (UE8M0's NaN) NaN, as
    `rounding.ue8m0_to_fp32`."""
    return gl.where(sc == 255, float("nan"), (sc.to(gl.int32) << 23).to(gl.float32, bitcast=True))


@gluon.jit
def _fp4_lut(codes, sc):
    """`_FP4_LUT_ASM` over E2M1 code bytes and their E4M3 scale bytes (the same shape and layout,
    4 consecutive bytes a thread sharing one scale): BF16 (lo, hi), the low and the high nibbles'
    values, each in the codes' shape."""
    return gl.inline_asm_elementwise(_FP4_LUT_ASM, "=r,=r,=r,=r,r,r", [codes, sc],
                                     dtype=(gl.bfloat16, gl.bfloat16), is_pure=True, pack=4)


@gluon.jit
def _decode_loaded(codes, sc, ok, C, WINDOW: gl.constexpr, FP4_PACKED: gl.constexpr,
                   layout: gl.constexpr, DW: gl.constexpr = 128, FP4_LUT: gl.constexpr = False):
    """`_load_chunk`'s bytes decoded exactly: FP32 [64, DW] in `layout` (window: E4M3 code *
    2^(e - 127); compressed: E2M1 * E4M3 scale; with FP4_PACKED the nibbles split and interleaved
    in registers, low nibble first: `gl.join` then `gl.reshape`). The keys `_load_chunk` did not
    load (ok False) decode to +0 through their bytes, its `other` values (code 0, window scale 127 =
    2^0, compressed scale 0: +0 * 1 and +0 * +0 are +0), with no select of their own, except in the
    unpacked compressed form (FP4_PACKED False), where ptxas holds four prefetched chunks' bytes in
    fewer registers with it (128 against 179 at 32 heads without a cap, sm_90)."""
    if WINDOW:
        k = codes.to(gl.float8e4nv, bitcast=True).to(gl.float32) * _ue8m0_value(sc)
    elif FP4_LUT:       # FP4_PACKED's bytes, decoded 8 values at a time in BF16 (_FP4_LUT_ASM)
        lo, hi = _fp4_lut(codes, sc)
        k = gl.convert_layout(gl.reshape(gl.join(lo, hi), [_KEYS, DW]), layout, assert_trivial=True)
    elif FP4_PACKED:
        byte = codes.to(gl.int32)
        sv = sc.to(gl.float8e4nv, bitcast=True).to(gl.float32)
        lo = _e2m1(byte & 15) * sv
        hi = _e2m1(byte >> 4) * sv
        k = gl.convert_layout(gl.reshape(gl.join(lo, hi), [_KEYS, DW]), layout, assert_trivial=True)
    else:
        rc = C * DW + gl.arange(0, DW, layout=gl.SliceLayout(0, layout))
        code = (codes.to(gl.int32) >> ((rc % 2) * 4)[None, :]) & 15
        k = gl.where(ok[:, None], _e2m1(code) * sc.to(gl.float8e4nv, bitcast=True).to(gl.float32), 0.0)
    return k


@gluon.jit
def _decode_chunk(pool_ptr, base, ok, C, WINDOW: gl.constexpr, FP4_PACKED: gl.constexpr,
                  layout: gl.constexpr, DW: gl.constexpr = 128, FP4_LUT: gl.constexpr = False):
    """Dims [DW C, DW C + DW) of 64 records loaded and decoded (`_load_chunk`, `_decode_loaded`)."""
    codes, sc = _load_chunk(pool_ptr, base, ok, C, WINDOW, FP4_PACKED, layout, DW)
    return _decode_loaded(codes, sc, ok, C, WINDOW, FP4_PACKED, layout, DW, FP4_LUT)


@gluon.jit
def _decode_mixed_chunk(wpool_ptr, wbase, w_ok, cpool_ptr, cbase, c_ok, C, FP4_PACKED: gl.constexpr,
                        layout: gl.constexpr, FP4_LUT: gl.constexpr = False):
    """Dims [128 C, 128 C + 128) of the block where the window ends: its window keys' and its
    compressed entries' values added (`_decode_chunk` of each pool; each is +0 off its own keys, so
    the sum is exact), BF16 [64, 128] in `layout`."""
    return (_decode_chunk(wpool_ptr, wbase, w_ok, C, True, FP4_PACKED, layout)
            + _decode_chunk(cpool_ptr, cbase, c_ok, C, False, FP4_PACKED, layout, 128, FP4_LUT)).to(gl.bfloat16)


@gluon.jit
def _block_slots(wtab_row, ctab_row, b, nw, W: gl.constexpr, KC: gl.constexpr, layout: gl.constexpr):
    """Block b of the row's joined key list (window keys j < nw: window_table[W - nw + j]; then
    comp_table[j - nw]) in the 1-D `layout`: the keys' window and compressed slots (-1: none)."""
    j = b * _KEYS + gl.arange(0, _KEYS, layout=layout)
    ws = gl.load(wtab_row + (W - nw) + j, mask=j < nw, other=-1)
    jc = j - nw
    cs = gl.load(ctab_row + jc, mask=(jc >= 0) & (jc < KC), other=-1)
    return ws, cs


@gluon.jit
def _bf16_rne_bits(x):
    """`rounding.bf16_rne_bits` in Gluon: int16 bits of bf16(x), round to nearest even, NaN as 0x7FC0."""
    bits = x.to(gl.uint32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    rounded = gl.where((bits & 0x7FFFFFFF) > 0x7F800000, 0x7FC0, rounded)
    return rounded.to(gl.uint16).to(gl.int16, bitcast=True)
