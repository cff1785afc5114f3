"""The FP64 MMA forms of `ops.gluon_exact_mm.GluonExactMM` (`GluonExactConfig.convert` "cvt",
"int", "raw", their packed forms "intp", "rawp" and the mixes "int+cvt", "raw+cvt", "intp+cvt",
"rawp+cvt"): a 32-deep K block's exact dot on the FP64 MMA (DMMA m16n8k16) from the slot's E4M3
tiles in shared memory, rounded once to FP32 (`fp64_partial`; with the warps along K the slot's
blocks at once, `fp64_slot_partials`), in that kernel's ring, scales, K order, K split and
epilogue; `gluon_exact_mm`'s module docstring argues why a block's FP64 sum is exact.

- **The weight's conversion E4M3 -> FP64** (`GluonExactConfig.convert`, `_e4m3_f64`; x, a few
  codes per weight code, always through FP32), exact for every E4M3 value in each form (subnormals
  and -0 included): "cvt" through FP32 (`cvt` FP8 -> F16x2, then F2F to FP64: a quarter-rate
  instruction per code); "int", `exact_f64_mm._e4m3_f64`'s integer construction (the code's sign
  at bit 63 and eeee.mmm at bits 55..49 of an FP64 pattern: value * 2^-1016, an FP64 subnormal
  for a subnormal code; times 2^1016, exact), ported to Gluon (a Triton helper cannot be called
  from a Gluon kernel); "raw", the same pattern without the multiply: the weight enters the MMA
  as value * 2^-1016 (FP64 subnormals for the subnormal codes: this form relies on the FP64 MMA
  taking subnormal operands exactly, as IEEE FMAs do; the GPU tests check it on subnormal codes),
  x as value * 2^1000, every product is the true one times 2^-16 (a normal FP64 value, at least
  2^-34), the MMA's sum the block sum times 2^-16, exactly, rounded to FP32 and scaled back by
  2^16 (exact: no FP32 underflow or overflow between 2^-34 and 2^7). The two NaN codes 0x7F /
  0xFF are not values: "cvt" reads them as NaN, "int" and "raw" as +-480 (the weight's only; x's
  codes always go through FP32). The package's quantizers (`formats.mxfp8_quantize`,
  `fp8_block_quantize`, `act_quant.mxfp8_quantize_tile`) write them only into a non-finite block,
  whose scale byte 255 (NaN) makes each of its terms NaN either way. "int+cvt" and "raw+cvt"
  alternate per K block (even blocks the first form, odd blocks "cvt"), sharing the work between
  the integer pipes and the conversion pipe; every block's partial is exact either way. "intp",
  "rawp", "intp+cvt" and "rawp+cvt" are "int", "raw", "int+cvt" and "raw+cvt" with the pattern
  built four codes at a time (`_PATTERN4_ASM`: per loaded 32-bit word two masks and two shifts,
  then one byte permute per code, 2 instructions a code instead of 3 and the register moves), from
  each thread's words as loaded (`_load_pattern4`), and each 16-row MMA tile's weight scales loaded
  and decoded once (`gluon_exact_mm._tile_weight_scales`): the same bits, fewer instructions (sm_90: the
  consumer's loop 680 instead of 896 a slot at 128 x 8 "rawp", 139 instead of 167 at 16 x 8 along
  K).
- **The k order within a block.** Each operand is loaded in the layout where a thread's bytes are
  consecutive in shared memory (one 8-byte load, or ldmatrix with `mma_k=16`, instead of one load
  per byte) and renamed into the MMA's operand layout, which takes the block's 32 k in a fixed
  permutation, the same for both operands: the block sum is exact in any order, so the
  permutation changes nothing (`_operand_a`).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from .gluon_exact_common import pow2


@gluon.jit
def _e4m3_pattern(codes):
    """The FP64 pattern of value * 2^-1016 of E4M3 codes (float8e4nv, any layout): the code
    sign-extended to 32 bits and shifted left by 17 puts its sign at bit 31 and eeee.mmm at bits
    23..17 of the high word; the bits between masked off, the low word zero. An FP64 subnormal for
    a subnormal code (eeee = 0), -0 for 0x80."""
    hi = (codes.to(gl.int8, bitcast=True).to(gl.int32) << 17) & -0x7F020000   # 0x80FE0000: bits 31, 23..17
    return (hi.to(gl.int64) << 32).to(gl.float64, bitcast=True)


# `_e4m3_pattern`'s high words of four E4M3 codes at once (pack=4: the codes' bytes c3 c2 c1 c0 in
# $4, c0 the lowest, each thread's consecutive codes; $0..$3 the four words): a = the four signs in
# place (s0000000 each byte), m = the magnitudes (0eeeemmm), b = m << 9 puts c0..c2's eeeemmm at
# bits 7..1 of bytes 1..3 (byte 0 zero), e = m >> 23 c3's at bits 7..1 of byte 0 (bytes 1..3 zero);
# one byte permute per code then builds [sign byte][eeeemmm0][0][0] (prmt: a's bytes 0-3, b's / e's
# 4-7; selector nibble i: the source byte of result byte i): the same bits as
# (sext(code) << 17) & 0x80FE0000, 2 instructions a code instead of 3 and the register moves.
_PATTERN4_ASM: gl.constexpr = gl.constexpr("""{
.reg .b32 a, m, b, e;
and.b32 a, $4, 0x80808080;
and.b32 m, $4, 0x7F7F7F7F;
shl.b32 b, m, 9;
shr.b32 e, m, 23;
prmt.b32 $0, a, b, 0x0544;
prmt.b32 $1, a, b, 0x1644;
prmt.b32 $2, a, b, 0x2744;
prmt.b32 $3, a, e, 0x3455;
}""")


@gluon.jit
def _e4m3_pattern4(codes):
    """`_e4m3_pattern` of E4M3 codes (float8e4nv, any layout whose thread holds a multiple of 4
    codes), the high words built four codes at a time (`_PATTERN4_ASM`): the same FP64 values."""
    hi = gl.inline_asm_elementwise(_PATTERN4_ASM, "=r,=r,=r,=r,r", [codes.to(gl.int8, bitcast=True)],
                                   dtype=gl.int32, is_pure=True, pack=4)
    return (hi.to(gl.int64) << 32).to(gl.float64, bitcast=True)


@gluon.jit
def _pattern4(codes):
    """`_e4m3_pattern4` of E4M3 codes, or `codes` itself where it is that pattern already (FP64: the
    operand loads form it from the loaded words, `_load_pattern4`)."""
    if codes.dtype == gl.float64:
        return codes
    else:
        return _e4m3_pattern4(codes)


@gluon.jit
def _load_pattern4(view, phys: gl.constexpr):
    """`_e4m3_pattern4` of the weight's codes `view` loaded in the layout `phys` (each thread's bytes
    consecutive in shared memory), in `phys`: each thread's registers are first ordered along k
    (`_k_first`: four consecutive codes a loaded word), converted, then renamed back, before the
    operand's own renaming into the MMA's layout (an elementwise function commutes with it), so
    that no bytes are regrouped."""
    words: gl.constexpr = _k_first(gl.to_linear_layout(phys, view.shape))
    return gl.convert_layout(_e4m3_pattern4(view.load(words)), phys, assert_trivial=True)


@gluon.jit
def _e4m3_f64(codes, CONVERT: gl.constexpr, OPERAND: gl.constexpr):
    """The MMA operand `OPERAND` (0: the weight, 1: x) of E4M3 codes (float8e4nv, any layout) as FP64,
    exactly. x (a few codes per weight code: the conversion's pipe keeps up) always through FP32;
    the weight as CONVERT says: "cvt" through FP32, "int" `_e4m3_pattern` times 2^1016, "raw" the
    pattern alone (value * 2^-1016: an FP64 subnormal for a subnormal code, which the MMA takes as
    it is) with x's value times 2^1000, so that every product is the true one times 2^-16, a normal
    FP64 value (at least 2^-18 * 2^-16): the block sum times 2^-16, exact (the module doc), which
    `fp64_partial` scales back."""
    if OPERAND == 1:
        x = codes.to(gl.float32).to(gl.float64)
        return pow2(x, 1000) if is_raw(CONVERT) else x
    elif CONVERT == "raw":
        return _e4m3_pattern(codes)
    elif CONVERT == "rawp":
        return _pattern4(codes)
    elif CONVERT == "int":
        return pow2(_e4m3_pattern(codes), 1016)
    elif CONVERT == "intp":
        return pow2(_pattern4(codes), 1016)
    else:
        return codes.to(gl.float32).to(gl.float64)


@gluon.constexpr_function
def form(convert, i):
    """The conversion of a mixed form's part i ("int+cvt", "raw+cvt", "intp+cvt", "rawp+cvt": the
    first form in even parts, "cvt" in odd ones; a K block, or with warps_k > 1 a 16-deep half of
    one); any other form is its own."""
    first, _, second = str(convert).partition("+")
    return second if second and i % 2 else first


@gluon.constexpr_function
def _k_first(linear):
    """The distributed linear layout `linear` with each thread's registers reordered: the bases
    along the last dimension (k, consecutive in shared memory) first, by stride (registers 0..3:
    four consecutive codes), the others after in their order. The same elements in every thread:
    converting between the two moves no data."""
    regs = sorted(linear.reg_bases, key=lambda basis: (basis[-1] == 0, basis[-1]))
    return gl.DistributedLinearLayout(reg_bases=regs, lane_bases=linear.lane_bases, warp_bases=linear.warp_bases,
                                      block_bases=linear.block_bases, shape=linear.shape)


@gluon.constexpr_function
def is_packed(form):
    """Whether the weight's form `form` (whole: not a mixed one) is built four codes at a time at
    the operand's load (`_load_pattern4`)."""
    return str(form) in ("rawp", "intp")


@gluon.constexpr_function
def is_raw(form):
    """Whether the weight's form `form` enters the MMA as value * 2^-1016 (x as value * 2^1000)."""
    return str(form) in ("raw", "rawp")


@gluon.jit
def _operand_a(view, layout: gl.constexpr, KC: gl.constexpr, PACKED: gl.constexpr = False):
    """The weight operand [BN, KC] of one MMA from shared memory (`view`: the tile's KC columns) in
    the MMA's operand layout, its k taken in a fixed permutation (the module doc): loaded in the layout
    where each thread's bytes are consecutive (one wide load instead of one per byte), then
    renamed - no data moves (`assert_trivial`). PACKED: the codes' FP64 pattern instead
    (`_load_pattern4`)."""
    BN: gl.constexpr = view.shape[0]
    like = gl.zeros([BN, KC], gl.int8, layout)
    if KC == 32:
        # operand k = 16 h + 4 r + t at column 8 t + 4 h + r
        phys: gl.constexpr = gl.reshape(gl.permute(gl.reshape(like, [BN, 2, 4, 4]), (0, 3, 1, 2)), [BN, KC]).type.layout
        if PACKED:
            v = gl.reshape(gl.permute(gl.reshape(_load_pattern4(view, phys), [BN, 4, 2, 4]), (0, 2, 3, 1)), [BN, KC])
        else:
            v = gl.reshape(gl.permute(gl.reshape(view.load(phys), [BN, 4, 2, 4]), (0, 2, 3, 1)), [BN, KC])
    else:
        # operand k = 4 r + t at column 4 t + r
        phys: gl.constexpr = gl.reshape(gl.permute(gl.reshape(like, [BN, 4, 4]), (0, 2, 1)), [BN, KC]).type.layout
        if PACKED:
            v = gl.reshape(gl.permute(gl.reshape(_load_pattern4(view, phys), [BN, 4, 4]), (0, 2, 1)), [BN, KC])
        else:
            v = gl.reshape(gl.permute(gl.reshape(view.load(phys), [BN, 4, 4]), (0, 2, 1)), [BN, KC])
    return gl.convert_layout(v, layout, assert_trivial=True)


@gluon.jit
def _operand_b(view, layout: gl.constexpr, KC: gl.constexpr):
    """The activation operand [KC, BT] (`view`: the tile's KC columns, transposed) as `_operand_a`,
    with the same permutation of k."""
    BT: gl.constexpr = view.shape[1]
    like = gl.zeros([KC, BT], gl.int8, layout)
    if KC == 32:
        phys: gl.constexpr = gl.reshape(gl.permute(gl.reshape(like, [2, 4, 4, BT]), (2, 0, 1, 3)), [KC, BT]).type.layout
        v = gl.reshape(gl.permute(gl.reshape(view.load(phys), [4, 2, 4, BT]), (1, 2, 0, 3)), [KC, BT])
    else:
        phys: gl.constexpr = gl.reshape(gl.permute(gl.reshape(like, [4, 4, BT]), (1, 0, 2)), [KC, BT]).type.layout
        v = gl.reshape(gl.permute(gl.reshape(view.load(phys), [4, 4, BT]), (1, 0, 2)), [KC, BT])
    return gl.convert_layout(v, layout, assert_trivial=True)


@gluon.jit
def fp64_partial(w_tile, x_tile, j: gl.constexpr, zero, CONVERT: gl.constexpr, KC: gl.constexpr,
                 mma_layout: gl.constexpr):
    """The exact dot of K block j (columns 32j..32j+31) of the slot's weight tile [BN, 128] and
    activation tile [BT, 128] in shared memory, as the FP64 MMA gives it [BN, BT], rounded once to
    FP32: per KC columns (16 or 32) both operands loaded into the MMA's operand layouts
    (`_operand_a`, `_operand_b`), converted (`_e4m3_f64` in the block's form: CONVERT, or for
    "int+cvt" / "raw+cvt" the first form in even blocks and "cvt" in odd ones) and multiplied, the
    block's MMAs chained through the FP64 accumulator from `zero` (exact: module doc)."""
    la: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_layout, k_width=1)
    lb: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma_layout, k_width=1)
    FORM: gl.constexpr = form(CONVERT, j)
    d = zero
    for h in gl.static_range(32 // KC):
        a = _operand_a(w_tile.slice(32 * j + KC * h, KC, dim=1), la, KC, is_packed(FORM))      # [BN, KC]
        b = _operand_b(x_tile.slice(32 * j + KC * h, KC, dim=1).permute((1, 0)), lb, KC)         # [KC, BT]
        d = mma_v2(_e4m3_f64(a, FORM, 0), _e4m3_f64(b, FORM, 1), d)
    if is_raw(FORM):
        # RN(sum * 2^-16) = RN(sum) * 2^-16: a nonzero block sum is at least 2^-18 in magnitude, so
        # the scaled one stays a normal FP32 (>= 2^-34) and below 2^7; times 2^16 is exact.
        return d.to(gl.float32) * 65536.0
    else:
        return d.to(gl.float32)


@gluon.jit
def _operands_k(w_tile, x_tile, la: gl.constexpr, lb: gl.constexpr, KC: gl.constexpr,
                PACKED: gl.constexpr = False):
    """The slot's NB K blocks (4 or 8: `GluonExactConfig.block_k` / 32) as batched MMA operands for
    `GluonExactConfig.warps_k` > 1: the weight [NB, BN, KC] and x [NB, KC, BT] (batch j: K block j,
    columns 32j..32j+31 of the slot's tiles in shared memory), in the operand layouts la / lb, each
    block's k in `_operand_a`'s fixed permutation (the same for both operands). KC = 32: one pair
    (the block's 32 k); KC = 16: two pairs (a0, b0, a1, b1), half h the block's k 16h..16h+15 of the
    permuted order, loaded together and split in registers (a block's two halves chain through one
    FP64 accumulator: exact). Each thread's bytes are consecutive in shared memory (wide loads),
    renamed into the operand layouts without moving data (`assert_trivial`). PACKED: the weight's
    FP64 pattern instead of its codes (`_load_pattern4`)."""
    BN: gl.constexpr = w_tile.shape[0]
    BT: gl.constexpr = x_tile.shape[0]
    NB: gl.constexpr = w_tile.shape[1] // 32
    xt = x_tile.permute((1, 0))                                                    # [32 NB, BT]
    if KC == 32:
        # operand k = 16 h + 4 r + t of block j at column 32 j + 8 t + 4 h + r
        like_a = gl.zeros([NB, BN, 32], gl.int8, la)
        phys_a: gl.constexpr = gl.reshape(gl.permute(gl.reshape(like_a, [NB, BN, 2, 4, 4]), (1, 0, 4, 2, 3)),
                                          [BN, 32 * NB]).type.layout
        if PACKED:
            a = gl.reshape(gl.permute(gl.reshape(_load_pattern4(w_tile, phys_a), [BN, NB, 4, 2, 4]), (1, 0, 3, 4, 2)),
                           [NB, BN, 32])
        else:
            a = gl.reshape(gl.permute(gl.reshape(w_tile.load(phys_a), [BN, NB, 4, 2, 4]), (1, 0, 3, 4, 2)),
                           [NB, BN, 32])
        like_b = gl.zeros([NB, 32, BT], gl.int8, lb)
        phys_b: gl.constexpr = gl.reshape(gl.permute(gl.reshape(like_b, [NB, 2, 4, 4, BT]), (0, 3, 1, 2, 4)),
                                          [32 * NB, BT]).type.layout
        b = gl.reshape(gl.permute(gl.reshape(xt.load(phys_b), [NB, 4, 2, 4, BT]), (0, 2, 3, 1, 4)), [NB, 32, BT])
        return (gl.convert_layout(a, la, assert_trivial=True), gl.convert_layout(b, lb, assert_trivial=True))
    else:
        # operand k = 4 r + t of half h of block j at column 32 j + 16 h + 4 t + r; h innermost in
        # registers (a join's layout), then split
        like_a = gl.join(gl.zeros([NB, BN, 16], gl.int8, la), gl.zeros([NB, BN, 16], gl.int8, la))  # [NB, BN, 16, 2]
        phys_a: gl.constexpr = gl.reshape(gl.permute(gl.reshape(like_a, [NB, BN, 4, 4, 2]), (1, 0, 4, 3, 2)),
                                          [BN, 32 * NB]).type.layout
        if PACKED:
            a = gl.reshape(gl.permute(gl.reshape(_load_pattern4(w_tile, phys_a), [BN, NB, 2, 4, 4]), (1, 0, 4, 3, 2)),
                           [NB, BN, 16, 2])
        else:
            a = gl.reshape(gl.permute(gl.reshape(w_tile.load(phys_a), [BN, NB, 2, 4, 4]), (1, 0, 4, 3, 2)),
                           [NB, BN, 16, 2])
        a0, a1 = gl.split(gl.convert_layout(a, like_a.type.layout, assert_trivial=True))
        like_b = gl.join(gl.zeros([NB, 16, BT], gl.int8, lb), gl.zeros([NB, 16, BT], gl.int8, lb))  # [NB, 16, BT, 2]
        phys_b: gl.constexpr = gl.reshape(gl.permute(gl.reshape(like_b, [NB, 4, 4, BT, 2]), (0, 4, 2, 1, 3)),
                                          [32 * NB, BT]).type.layout
        b = gl.reshape(gl.permute(gl.reshape(xt.load(phys_b), [NB, 2, 4, 4, BT]), (0, 3, 2, 4, 1)), [NB, 16, BT, 2])
        b0, b1 = gl.split(gl.convert_layout(b, like_b.type.layout, assert_trivial=True))
        return (gl.convert_layout(a0, la, assert_trivial=True), gl.convert_layout(b0, lb, assert_trivial=True),
                gl.convert_layout(a1, la, assert_trivial=True), gl.convert_layout(b1, lb, assert_trivial=True))


@gluon.jit
def fp64_slot_partials(w_tile, x_tile, zero, CONVERT: gl.constexpr, KC: gl.constexpr, mma_layout: gl.constexpr):
    """`fp64_partial` of the slot's NB K blocks at once (`warps_k` > 1): [NB, BN, BT] FP32, batch j
    block j's exact dot rounded once to FP32, from the batched FP64 MMA (each warp its share of the
    blocks; `_operands_k`). "int+cvt" converts the weight of each block's first 16-deep half as
    "int" and of its second as "cvt" (both the codes' values: they share the block's accumulator)."""
    la: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_layout, k_width=1)
    lb: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma_layout, k_width=1)
    if KC == 32:
        a, b = _operands_k(w_tile, x_tile, la, lb, KC, is_packed(CONVERT))
        d = mma_v2(_e4m3_f64(a, CONVERT, 0), _e4m3_f64(b, CONVERT, 1), zero)
    else:
        a0, b0, a1, b1 = _operands_k(w_tile, x_tile, la, lb, KC, is_packed(CONVERT))
        FORM0: gl.constexpr = form(CONVERT, 0)
        FORM1: gl.constexpr = form(CONVERT, 1)
        d = mma_v2(_e4m3_f64(a0, FORM0, 0), _e4m3_f64(b0, FORM0, 1), zero)
        d = mma_v2(_e4m3_f64(a1, FORM1, 0), _e4m3_f64(b1, FORM1, 1), d)
    if is_raw(CONVERT):
        return d.to(gl.float32) * 65536.0          # as `fp64_partial`'s "raw"
    else:
        return d.to(gl.float32)
