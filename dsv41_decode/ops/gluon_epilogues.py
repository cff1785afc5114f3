"""The epilogues of the Gluon GEMM tier (`ops.gluon_mm`), applied to an output tile by the program
that stores it: the query RoPE of `wq_b` (`rope_tile`, the bits of `kv_write.query_rope_`), the
indexer's query of its `wq_b` (`index_query_tile`: RoPE, then MXFP4 quantize-dequantize, the bits of
`index_query.index_query_`'s iq), and the BF16 rounding that chooses between them (`bf16_out`).
Each is the Gluon port of a Triton-tier helper (`kv_write.rope_tile`, `index_query.index_query_tile`,
`fp4.mx_quant_pairs` / `mx_dequant_pairs`): the Triton helpers cannot be called from a Gluon kernel
(in the processes that compile it for sm_90 under the interpreter they are interpreted functions).
For the same reason every Gluon kernel's reductions take their combine functions from here
(`add_combine`, `max_combine`).
The kernels that call them launch without reflect-FTZ, so libdevice's _rn operations keep FP32
subnormals as the Triton helpers do.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.extra import libdevice

from .fp4 import INV_E2M1_MAX, MXFP4_FLOOR


@gluon.jit
def rope_tile(yb, off_n, M, cos_ptr, sin_ptr, stride_cm, stride_sm, BN: gl.constexpr, BT: gl.constexpr,
               out_l: gl.constexpr):
    """The query RoPE of spec section 5 on a BF16 output tile yb [BN, BT] (dim 0: output columns
    off_n + n, dim 1: rows m; in a layout that gives each thread both columns of its pairs, as
    GluonMM's `out_l` does with 8 consecutive columns): for every column c with c % 512 >= 448 (a
    head's rotary channels 448..511), the pair (c, c + 1) = (2i, 2i + 1) of the tail is rotated by
    row m's cos/sin[m, i] exactly as `ops.kv_write`'s query RoPE does on the stored BF16 values:
    widened to FP32, re = e c - o s and im = e s + o c with each product and sum rounded to nearest
    in FP32 (libdevice mul_rn / add_rn / sub_rn: never contracted into an FMA, whatever the
    launch's fp-fusion; subnormals kept: `gluon_mm.launch_options`), then rounded to BF16 (nearest
    even).
    The pairs are split in registers. Other columns, and rows past M, pass unchanged; returns the
    tile in out_l."""
    e, o = gl.split(gl.reshape(gl.permute(yb.to(gl.float32), [1, 0]), [BT, BN // 2, 2]))
    re, im = rope_pairs(e, o, off_n, M, cos_ptr, sin_ptr, stride_cm, stride_sm, BN, BT, 512, 448)
    y = gl.permute(gl.reshape(gl.join(re, im), [BT, BN]), [1, 0])
    return gl.convert_layout(y, out_l).to(gl.bfloat16)


@gluon.jit
def rope_pairs(e, o, off_n, M, cos_ptr, sin_ptr, stride_cm, stride_sm, BN: gl.constexpr, BT: gl.constexpr,
                HEAD: gl.constexpr, FIRST: gl.constexpr):
    """The pairs (e, o) [BT, BN / 2] (rows m, pair p = output columns off_n + 2p, off_n + 2p + 1;
    FP32 holding BF16 values) rotated where the column's channel in its head of HEAD, c, is at
    least FIRST, by row m's cos/sin[m, (c - FIRST) / 2]: re = e c - o s and im = e s + o c, each
    product and sum rounded to nearest in FP32 (libdevice mul_rn / add_rn / sub_rn: never
    contracted into an FMA, whatever the launch's fp-fusion; subnormals kept, the launch's
    `enable_reflect_ftz=False`), then to BF16 (nearest even); other pairs, and rows past M, pass
    unchanged. The RoPE of both epilogues (`rope_tile`: queries,
    heads of 512 rotated from 448; `index_query_tile`: index queries, heads of 128 from 64)."""
    pair_l: gl.constexpr = e.type.layout
    p = gl.arange(0, BN // 2, layout=gl.SliceLayout(0, pair_l))
    rm = gl.arange(0, BT, layout=gl.SliceLayout(1, pair_l))
    col = (off_n + 2 * p) % HEAD
    rot = (col >= FIRST)[None, :] & (rm < M)[:, None]
    i = gl.maximum(col - FIRST, 0) // 2
    c = gl.load(cos_ptr + rm[:, None] * stride_cm + i[None, :], mask=rot, other=1.0)
    sn = gl.load(sin_ptr + rm[:, None] * stride_sm + i[None, :], mask=rot, other=0.0)
    re = libdevice.sub_rn(libdevice.mul_rn(e, c), libdevice.mul_rn(o, sn))
    im = libdevice.add_rn(libdevice.mul_rn(e, sn), libdevice.mul_rn(o, c))
    re = gl.where(rot, re.to(gl.bfloat16).to(gl.float32), e)
    im = gl.where(rot, im.to(gl.bfloat16).to(gl.float32), o)
    return re, im


@gluon.jit
def index_query_tile(yb, off_n, M, cos_ptr, sin_ptr, stride_cm, stride_sm, BN: gl.constexpr, BT: gl.constexpr,
                      out_l: gl.constexpr):
    """`index_query_`'s iq on a BF16 output tile yb [BN, BT] (dim 0: output columns off_n + n =
    head * 128 + channel, dim 1: rows m; in `out_l`), as `index_query.index_query_tile` does in
    the Triton tier: each head's tail pairs (channels 64..127) of rows m < M rotated by cos/sin[m,
    channel / 2 - 32] (`rope_pairs`), then each row's 32-column MX blocks MXFP4 quantized and
    dequantized (`mxfp4_fake_pairs`), then BF16. BN a multiple of 32 (whole blocks). Returns the
    tile in out_l."""
    e, o = gl.split(gl.reshape(gl.permute(yb.to(gl.float32), [1, 0]), [BT, BN // 2, 2]))
    e, o = rope_pairs(e, o, off_n, M, cos_ptr, sin_ptr, stride_cm, stride_sm, BN, BT, 128, 64)
    # [BT, BN / 2] pairs as [blocks, 16]: a row's 16 consecutive pairs are one MX block
    NB: gl.constexpr = BT * BN // 32
    ye, yo = mxfp4_fake_pairs(gl.reshape(e, [NB, 16]), gl.reshape(o, [NB, 16]))
    y = gl.join(gl.reshape(ye, [BT, BN // 2]), gl.reshape(yo, [BT, BN // 2]))
    y = gl.permute(gl.reshape(y, [BT, BN]), [1, 0])
    # The values are BF16's (E2M1 times a power of two) but for a non-finite block's NaNs: rounded
    # as `rounding.bf16_rne_bits`, whose NaN is index_query_'s 0x7FC0 (the cast's is 0x7FFF).
    bits = y.to(gl.uint32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    rounded = gl.where((bits & 0x7FFFFFFF) > 0x7F800000, 0x7FC0, rounded)
    return gl.convert_layout(rounded.to(gl.uint16).to(gl.bfloat16, bitcast=True), out_l)


@gluon.jit
def _e2m1_fake(v, inv, s):
    """e2m1_value(e2m1_rne_code(v * inv)) * s of `ops.fp4` (the same comparisons and bits): v * inv
    (a power of two, exact) rounded to nearest even on E2M1's grid {0, .5, 1, 1.5, 2, 3, 4, 6},
    saturating, the sign kept (-0.0 for small negatives), NaN to code 0; then its value times s."""
    x = v * inv
    a = gl.abs(x)
    mag = ((a > 0.25).to(gl.int32) + (a >= 0.75).to(gl.int32) + (a > 1.25).to(gl.int32)
           + (a >= 1.75).to(gl.int32) + (a > 2.5).to(gl.int32) + (a >= 3.5).to(gl.int32)
           + (a > 5.0).to(gl.int32))
    c = gl.where(x == x, mag | ((x.to(gl.uint32, bitcast=True) >> 28) & 8).to(gl.int32), 0)
    e = (c >> 1) & 3
    m = c & 1
    normal = ((e + 126) << 23 | (m << 22)).to(gl.float32, bitcast=True)
    val = gl.where(e == 0, m.to(gl.float32) * 0.5, normal).to(gl.uint32, bitcast=True)
    return (val | ((c & 8).to(gl.uint32) << 28)).to(gl.float32, bitcast=True) * s


@gluon.jit
def add_combine(a, b):
    """a + b: the combine function of a Gluon sum, `gl.reduce(x, axis, add_combine)` (gl.sum's is a
    Triton JIT function, which the interpreter wraps in the processes that compile Gluon kernels
    for sm_90 beside interpreted tests); the sum's order is the layout's, as gl.sum's."""
    return a + b


@gluon.jit
def max_combine(a, b):
    """max(a, b): the combine function of a Gluon maximum (`add_combine`'s reason)."""
    return gl.maximum(a, b)


@gluon.jit
def mxfp4_fake_pairs(xe, xo):
    """MXFP4 quantize-dequantize of blocks = rows of the halves xe, xo [NB, 16] (FP32): the values
    of `fp4.mx_dequant_pairs(*fp4.mx_quant_pairs(xe, xo, False), False)` by the same bit rules
    (the Triton helpers cannot be called here: under the interpreter, in the processes that compile
    this kernel for sm_90, they are interpreted functions). The block's scale byte from its
    maximum |x| (NaN as inf) floored at MXFP4_FLOOR by the spec's power-of-two rule, 255 (a NaN
    block, all NaN out) when not finite; each element's E2M1 code of x / scale (`_e2m1_fake`)."""
    ae = gl.abs(xe)
    ao = gl.abs(xo)
    ae = gl.where(ae == ae, ae, float("inf"))
    ao = gl.where(ao == ao, ao, float("inf"))
    amax = gl.maximum(gl.reduce(ae, 1, max_combine), gl.reduce(ao, 1, max_combine))
    p_bits = (gl.maximum(amax, MXFP4_FLOOR) * INV_E2M1_MAX).to(gl.int32, bitcast=True)
    k = (p_bits >> 23) - 127 + ((p_bits & 0x7FFFFF) != 0).to(gl.int32)
    byte = gl.minimum(k + 127, 255)
    inv = ((127 - gl.minimum(k, 126)) << 23).to(gl.float32, bitcast=True)[:, None]
    # ue8m0_to_fp32: byte 255 is NaN (the codes of such a block are 0, so all its values are NaN)
    s = gl.where(byte == 255, float("nan"), (byte << 23).to(gl.float32, bitcast=True))[:, None]
    return _e2m1_fake(xe, inv, s), _e2m1_fake(xo, inv, s)


@gluon.jit
def bf16_out(y, off_n, M, cos_ptr, sin_ptr, stride_cm, stride_sm, BN: gl.constexpr, BT: gl.constexpr,
              ROPE: gl.constexpr, out_l: gl.constexpr, INDEX_Q: gl.constexpr = False, PAIRS: gl.constexpr = None):
    """The tile's FP32 sums y [BN, BT] rounded to BF16 (nearest even), and with ROPE the query
    RoPE on the tiles that hold rotary channels (`rope_tile`; the others skip it), with INDEX_Q
    the index query on every tile (`index_query_tile`). y in out_l, the result too. PAIRS: None
    where out_l gives each thread both columns of its RoPE pairs (GluonMM's epilogue), else a
    layout that does, into which a rotated tile is converted first (the exact linears', whose
    accumulators spread a pair over two threads); the tiles without rotary channels stay in out_l."""
    yb = y.to(gl.bfloat16)
    if INDEX_Q:
        yb = index_query_tile(yb, off_n, M, cos_ptr, sin_ptr, stride_cm, stride_sm, BN, BT, out_l)
    elif ROPE:
        if off_n % 512 + BN > 448:
            if PAIRS is not None:
                yb = gl.convert_layout(yb, PAIRS)
            yb = rope_tile(yb, off_n, M, cos_ptr, sin_ptr, stride_cm, stride_sm, BN, BT, out_l)
    return yb
