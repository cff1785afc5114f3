"""Grouped `wo_a` in Gluon for Hopper (sm_90), BF16 or FP8 weight: inverse RoPE and the 8-group
output projection in one launch. Same contract and arguments as `ops.wo_a.wo_a_` (the Triton kernel, the
portable path; `reference.attention.grouped_wo_a`, spec section 3 step 9):

z[m, g*R:(g+1)*R] = bf16(o'_g[m] @ wo_a_g^T), o' = o with the conjugate rotation at row m's position
applied to the last rope_dim = 64 channels of every head (FP32 math, rounded to BF16), o'_g the H/G
consecutive heads of group g flattened ((H/G)*512 wide), R = o_lora_rank.

How the kernel runs (one program per 64 x warpgroups weight rows and K split):

- **Swap AB.** A program computes z^T[BN, BT] = W[BN rows of one group, K range] @ o'^T: the weight
  rows are the wgmma's M (64 per consumer warpgroup), the rows of o (padded to BT = 8, 16, 32 or
  64; TMA fills the rows past M with zeros) its N.
- **A TMA producer warp** (`warp_specialize`) streams [BN, 64] weight tiles and the matching
  [BT, 64] tiles of o (o viewed as [M, H*512]: a group's K range is contiguous in it) through a
  ring of STAGES >= 3 shared-memory slots, each completed on its `ready` mbarrier and handed back
  on its `empty` mbarrier.
- **The inverse RoPE in shared memory, once per program and chunk.** With 64-deep slots and
  rope_dim = 64, the last slot of every head (the head's channels 448..511) is exactly its rotary
  part: the consumer loads that o tile from the slot, rotates each adjacent pair (2i, 2i+1) by the
  conjugate of cis_i = cos_i + j sin_i in FP32 as `ops.wo_a`'s `_inverse_rope_bf16` does
  (fl(fl(a c) + fl(b s)) and fl(fl(b c) - fl(a s)), the launch turning off FMA contraction),
  rounds to BF16 (round to nearest even) and stores it back into the slot before the wgmma reads
  it (a shared-memory fence and a barrier of the consumer warps). cos and sin are loaded once per
  program. The other seven slots of a head go to the MMA as TMA wrote them.
- **BF16 wgmma with FP32 accumulation, two groups in flight**: slot i's wgmma (m64 n{BT} k16 x 4
  into the one FP32 accumulator, K order) is issued before slot i-1's is retired; slot i-1 then
  goes back to the producer.
- **Launched by programmatic dependent launch** (`gluon_wo_a_(pdl=True)`, the step's on sm_90, after
  the sparse MLA that releases it): the program requests its ring's first weight tiles (all its
  slots', or `GluonWoAConfig.prefill` of them), then waits for the MLA (`gluon_ring.ring_prefill`),
  and its producer continues from there (`producer_prefilled`); the same values.
- **An FP8 weight** (E4M3 with 32x32 UE8M0 scales, as `ops.wo_a`): the consumer converts the
  slot's E4M3 tile to BF16 (exact) into a staging tile in shared memory, then runs the slot's two
  32-deep K blocks as two wgmmas from zero (both in flight) and adds each block's partial, scaled
  by its power-of-two block scale, to the FP32 accumulator in K order: `ops.wo_a`'s
  acc += dot(w_kb, o'_kb) * scale[n // 32, kb] (the scale bytes loaded one slot ahead). On an H200
  (`scripts/probe_gluon_wo_a.py --dtypes=fp8`) it takes 22.5-23.8 us at 1-16 rows, 34 % of the
  read, against 20.5-21.7 us for the Triton plan: the conversion, not the bytes, bounds it. The
  step runs the folded consumer below for an FP8 `wo_a` (`decode.attention.wo_a_plan`).
- **The folded FP8 consumer** (`GluonWoAConfig(fold_scales=True)`, `_consumer_fp8_folded`): the
  block scale goes into the conversion instead of the partials. Per slot the consumer loads each
  32-deep K block of the E4M3 tile from the ring straight into the wgmma's register A operand
  layout (swap-AB: the weight rows are the MMA's M), converts it in registers to
  bf16(fp32(e4m3) x 2^(b - 127)) (per pair of codes on sm_90: one e4m3x2 -> f16x2 unpack, two
  f16 -> f32, two FP32 multiplies, one bf16x2 pack: 3 instructions an element, besides a 16-bit
  shared load per pair; the direct E4M3 -> BF16 conversion with a BF16 multiply is 2.5, but its
  two F2F.BF16.F16 per pair run on the quarter-rate conversion unit), and runs the slot's two
  wgmmas (register A, the o tile from shared memory) into the one FP32 accumulator in K order, as
  the BF16-weight consumer does, with the slot's two groups issued before the previous slot's are
  retired. No staging tile, no block partials, no barrier per slot (only the rotary slot's). The
  loop runs two slots per iteration so that consecutive slots' operands live in different
  registers (a wgmma reads its register operand until a wait retires it; the sm_90 compile test
  checks the SASS for writes to an in-flight operand). Its scale bytes must lie in
  FOLD_SCALE_BYTES = [10, 246] (`check_folded_scale`, once per weight). With
  `GluonWoAConfig(fold_bits=True)` the conversion is integer and BF16 work on the 32-bit register
  of a pair of codes instead (`_FOLD_BITS_ASM`: a sign-extending byte permute, a shift and a mask
  make each half the BF16 sign << 15 | (code & 0x7F) << 4 = e4m3 x 2^-120, the E4M3 subnormals
  landing on BF16 subnormals; two BF16 multiplies, by 2^120 and by 2^(b - 127), finish it: 2.5
  instructions an element), the same bits.
- **Split-K with a deterministic reduction** (grid: N tiles x split; the split is the plan's, the
  same for every row count): each split stores its FP32 partial of the M real rows to the plan's
  workspace, one acq_rel atomic on the tile's counter; the last split to arrive adds the partials
  in split order (from zero), rounds to BF16, stores z and resets the counter (replayable in a
  CUDA graph with no memset).
- **The staged window copy** (`window_copy`, as `ops.wo_a.wo_a_`): the programs of split 0 move
  rows pid_n, pid_n + N tiles, ... after their K loop.
- **The MXFP8 of z** (`codes_out`, `scales_out`, for `wo_b`) in the epilogue that stores z: the
  program that rounds a tile (the last split to arrive) quantizes it with
  `act_quant.mxfp8_quantize_tile` (the quantizer of `act_quant_mxfp8_`, also fused in `ops.wo_a`)
  from the BF16 values it just rounded, 32 outputs of a row per block (a tile holds whole blocks).

Numerics: the products are exact (BF16 x BF16 in FP32; E4M3 values are exact in BF16) and a BF16
wgmma adds them as the Triton kernel's tensor-core dots do, truncating while it adds (`ops.wo_a`'s
module doc); the FP32 accumulator runs over the program's K range in K order, k16 instruction by
k16 instruction (FP8: block partials, each scaled exactly, in K order). For a BF16 weight, with the
same split as the Triton plan (the default rule is the same) and the same K order, the instruction
sequence per output matches the Triton swapped kernel's (its 32-deep dots lower to two k16 wgmmas
each); whether the bits match is the GPU test's to say, and not part of the contract. (The Triton
plan of an FP8 weight runs TF32 dots, unswapped, at split 4: other sums, within the same bound.)
The folded FP8 consumer: w = e4m3 x 2^(b - 127) is a BF16 value, exactly, whenever it is zero or a
BF16 normal: an E4M3 value has at most 4 significant bits (BF16 holds 8) and BF16 has FP32's
exponent range. The nonzero |e4m3| lie in [2^-9 (the smallest subnormal, 0.001b x 2^-6), 448 =
1.75 x 2^8], so every nonzero w is a normal when 2^(b - 136) >= 2^-126 and 1.75 x 2^(b - 119) <=
BF16's largest finite (2 - 2^-7) x 2^127, i.e. 10 <= b <= 246 (FOLD_SCALE_BYTES); zero stays zero
and the E4M3 NaN stays NaN. Each step of the conversion is exact there: E4M3 -> F16 -> FP32 (the
E4M3 subnormals are F16 normals), the product by 2^(b - 127) (an FP32 normal for every such b;
the product is an FP32 normal), the rounding to BF16 (the value is representable). The bit
conversion (fold_bits) likewise: sign << 15 | (code & 0x7F) << 4 is e4m3 x 2^-120 as a BF16 (a
subnormal m x 2^-129 for the E4M3 subnormal m x 2^-9, a signed zero for zero), its product by 2^120
is the E4M3 value and the next product by 2^(b - 127) the folded weight, each a BF16 value, so
neither mul.rn.bf16x2 rounds (both keep subnormal inputs and signed zeros; the CPU test interprets
the PTX on every code and scale byte). So the folded
weight is the reference's dequantized weight (`fp8_block_dequantize(weight, scale)` rounded to
BF16) bit for bit, and the kernel is the BF16-weight kernel run on it: the same k16 instruction
sequence per output in the same K order at the same split (the split rule does not look at the
dtype), so z equals the BF16-weight plan's z on the dequantized weight (the GPU test asserts it)
and is held to the BF16 weight's bound: only the FP32 summation inside the MMA and split-K's
regrouping differ from the reference. Against `_consumer_fp8`, the block partials are gone: the
scaled products are summed by the MMA in one chain rather than per 32-deep block then scaled, a
different order of the same exact products (decision 27 allows it for `wo_a`).
Batch invariance: the split, the slot depth and the instruction do not depend on the row count;
the row bucket BT changes the wgmma's N (how many columns one instruction computes), not the
arithmetic of an output element.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                                warpgroup_mma_wait)

from ..formats import E4M3_MAX, MXFP8_AMAX_FLOOR
from .act_quant import INV_E4M3_MAX, mxfp8_quantize_tile
from .checks import require_int
from .common import is_sm90, num_sms, plan_workspace
from .gluon_ring import ring, ring_prefill, ring_producer, tma_desc
from .pdl import gluon_launch_dependents, launch_options as pdl_launch_options, require_supported as require_pdl
from .rounding import ue8m0_to_fp32
from .wo_a import GroupedShape, wo_a_args

MAX_ROWS = 64
BLOCK_K = 64                     # K per ring slot: 128 bytes of BF16 (the 128-byte swizzle); = rope_dim
ROPE_DIM = 64                    # the rotary channels per head the kernel rotates: one slot
ROW_BUCKETS = (8, 16, 32, 64)    # BT: the wgmma's N
SHARED_LIMIT = 227 * 1024        # sm_90's dynamic shared memory per block
# the UE8M0 scale bytes b for which every e4m3 x 2^(b - 127) is zero or a BF16 normal (exact): the
# folded FP8 consumer's range (module doc, "Numerics"; `check_folded_scale`)
FOLD_SCALE_BYTES = (10, 246)
# the MXFP8 constants of the fused output quantization (kernels may read only constexpr globals)
_AMAX_FLOOR = gl.constexpr(MXFP8_AMAX_FLOOR)
_INV_QMAX = gl.constexpr(INV_E4M3_MAX)
_QMAX = gl.constexpr(E4M3_MAX)


@gluon.jit
def _rotate_slot(x_tile, cos, sin, BT: gl.constexpr, rot_l: gl.constexpr):
    """x_tile [BT, 64] BF16 in shared memory <- bf16(conj rotation of its 32 adjacent pairs) with
    cos, sin [BT, 32] FP32 (`rot_l`'s pair slice): (a + jb)(c - js) = (a c + b s) + j (b c - a s),
    each product and sum rounded to FP32 (no contraction: the launch's enable_fp_fusion=False), then
    to BF16 with round to nearest even, as `ops.wo_a._inverse_rope_bf16`."""
    x = x_tile.load(rot_l).to(gl.float32)
    a, b = gl.split(gl.reshape(x, [BT, 32, 2]))
    a = gl.convert_layout(a, cos.type.layout)
    b = gl.convert_layout(b, cos.type.layout)
    re = a * cos + b * sin
    im = b * cos - a * sin
    rot = gl.convert_layout(gl.reshape(gl.join(re, im), [BT, 64]), rot_l)
    x_tile.store(rot.to(gl.bfloat16))


@gluon.jit
def _load_cis(cos_ptr, sin_ptr, M, stride_cm, stride_sm, BT: gl.constexpr, pair_l: gl.constexpr):
    """cos, sin [BT, 32] FP32 of the launch's rows in `pair_l` (0 for the rows past M)."""
    rm = gl.arange(0, BT, layout=gl.SliceLayout(1, pair_l))
    rp = gl.arange(0, 32, layout=gl.SliceLayout(0, pair_l))
    ok = (rm < M)[:, None] & (rp < 32)[None, :]
    cos = gl.load(cos_ptr + rm[:, None] * stride_cm + rp[None, :], mask=ok, other=0.0)
    sin = gl.load(sin_ptr + rm[:, None] * stride_sm + rp[None, :], mask=ok, other=0.0)
    return cos, sin


@gluon.jit
def _consumer(w_smem, x_smem, ready, empty, cos_ptr, sin_ptr, M, stride_cm, stride_sm, step_lo, n_steps,
              STAGES: gl.constexpr, BN: gl.constexpr, BT: gl.constexpr, HEAD_STEPS: gl.constexpr,
              mma_layout: gl.constexpr, rot_l: gl.constexpr, pair_l: gl.constexpr):
    """The consumer warpgroup(s) for a BF16 weight: per slot, the o tile rotated in place when it is
    a head's rotary chunk, then the slot's wgmma issued before the previous slot's is retired (two
    groups in flight). Returns (acc, ): [BN, BT] FP32 over the program's K range, in K order."""
    cos, sin = _load_cis(cos_ptr, sin_ptr, M, stride_cm, stride_sm, BT, pair_l)
    acc = gl.zeros([BN, BT], gl.float32, mma_layout)
    for i in range(n_steps):
        s = i % STAGES
        mbarrier.wait(ready.index(s), (i // STAGES) & 1)
        x_tile = x_smem.index(s)
        if (step_lo + i) % HEAD_STEPS == HEAD_STEPS - 1:
            _rotate_slot(x_tile, cos, sin, BT, rot_l)
            # the generic-proxy stores before the wgmma's (async proxy) reads, from every thread
            fence_async_shared()
            gl.thread_barrier()
        acc = warpgroup_mma(w_smem.index(s), x_tile.permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
        if i > 0:
            # slot i-1's wgmma has retired: hand it back to the producer
            mbarrier.arrive(empty.index((i - 1) % STAGES), count=1)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
    return (acc, )


@gluon.jit
def _block_scales(s_rows, step):
    """The FP32 scales 2^(b - 127) of K blocks 2 step and 2 step + 1 (one 64-deep slot) for the
    weight rows whose scale rows `s_rows` points at ([BN] pointers to UE8M0 bytes)."""
    return ue8m0_to_fp32(gl.load(s_rows + 2 * step)), ue8m0_to_fp32(gl.load(s_rows + 2 * step + 1))


@gluon.jit
def _consumer_fp8(w_smem, wb_smem, x_smem, ready, empty, cos_ptr, sin_ptr, s_ptr, M, stride_cm, stride_sm,
                  stride_sn, off_n, step_lo, n_steps, STAGES: gl.constexpr, BN: gl.constexpr, BT: gl.constexpr,
                  HEAD_STEPS: gl.constexpr, mma_layout: gl.constexpr, rot_l: gl.constexpr,
                  pair_l: gl.constexpr, cvt_l: gl.constexpr):
    """The consumer warpgroup(s) for an FP8 weight: per slot, the E4M3 tile converted to BF16
    (exact) into the staging tile wb_smem and the o tile rotated when it is a rotary chunk; then the
    slot's two 32-deep K blocks as two wgmmas from zero (both in flight), each block's partial
    scaled by its weight block's power-of-two scale as it joins the FP32 accumulator, in K order:
    `ops.wo_a`'s acc += dot(w_kb, o'_kb) * scale[n // 32, kb]. Returns (acc, )."""
    cos, sin = _load_cis(cos_ptr, sin_ptr, M, stride_cm, stride_sm, BT, pair_l)
    rn = off_n + gl.arange(0, BN, layout=gl.SliceLayout(1, mma_layout))
    s_rows = s_ptr + (rn // 32) * stride_sn
    acc = gl.zeros([BN, BT], gl.float32, mma_layout)
    zero = gl.zeros([BN, BT], gl.float32, mma_layout)
    next_scales = _block_scales(s_rows, step_lo)
    for i in range(n_steps):
        sc0, sc1 = next_scales
        next_scales = _block_scales(s_rows, step_lo + gl.minimum(i + 1, n_steps - 1))
        s = i % STAGES
        mbarrier.wait(ready.index(s), (i // STAGES) & 1)
        x_tile = x_smem.index(s)
        wb_smem.store(w_smem.index(s).load(cvt_l).to(gl.bfloat16))
        if (step_lo + i) % HEAD_STEPS == HEAD_STEPS - 1:
            _rotate_slot(x_tile, cos, sin, BT, rot_l)
        # the generic-proxy stores before the wgmma's (async proxy) reads, from every thread
        fence_async_shared()
        gl.thread_barrier()
        p0 = warpgroup_mma(wb_smem.slice(0, 32, dim=1), x_tile.slice(0, 32, dim=1).permute((1, 0)), zero,
                           use_acc=False, is_async=True)
        p1 = warpgroup_mma(wb_smem.slice(32, 32, dim=1), x_tile.slice(32, 32, dim=1).permute((1, 0)), zero,
                           use_acc=False, is_async=True)
        part = warpgroup_mma_wait(num_outstanding=1, deps=(p0, ))
        acc = acc + part * sc0[:, None]
        part = warpgroup_mma_wait(num_outstanding=0, deps=(p1, ))
        # every warp's wgmmas of the slot have retired before the staging tile is rewritten and
        # before the slot goes back to the producer
        gl.thread_barrier()
        mbarrier.arrive(empty.index(s), count=1)
        acc = acc + part * sc1[:, None]
    return (acc, )


@gluon.jit
def _folded_block(w_blk, sc, a_l: gl.constexpr):
    """One 32-deep K block of the weight as the wgmma's register A operand ([BN, 32] BF16 in `a_l`):
    bf16(fp32(e4m3) x 2^(b - 127)), from w_blk ([BN, 32] E4M3 in shared memory) and sc ([BN] FP32
    block scales, `_block_scales`). Each step is exact for scale bytes in FOLD_SCALE_BYTES (the
    module doc's "Numerics"): E4M3 -> FP32 is exact, the product by a power of two is exact while it
    stays an FP32 normal, and a value of at most 4 significant bits within BF16's normal range is a
    BF16 value."""
    return (w_blk.load(a_l).to(gl.float32) * sc[:, None]).to(gl.bfloat16)


# The bit conversion (`_folded_block_bits`), per 32-bit register holding two E4M3 codes c0 (byte 0)
# and c1 (byte 1), and the bf16x2 scale pair ($2: 2^(b - 127) in both halves):
#   prmt: halves = sign-extended codes (byte 1 <- sign of byte 0, byte 2 <- byte 1, byte 3 <- sign
#         of byte 1)
#   shl 4, and 0x87F087F0: each half = sign << 15 | (code & 0x7F) << 4, the BF16 whose exponent
#         field is the E4M3 one and whose mantissa starts with the E4M3 one: e4m3 x 2^-120, the
#         E4M3 subnormals landing on BF16 subnormals (m x 2^-129) and zero on zero
#   mul.rn.bf16x2 by 2^120 (0x7B80 a half): the E4M3 value, exactly (a BF16 normal or zero)
#   mul.rn.bf16x2 by the scale pair: the folded weight, exactly for b in FOLD_SCALE_BYTES
# (`tests/ops/test_gluon_wo_a.py` models these steps on every code and scale byte.)
_FOLD_BITS_ASM = gl.constexpr("""{
.reg .b32 p, x, k;
prmt.b32 p, $1, 0, 0x9180;
shl.b32 x, p, 4;
and.b32 x, x, 0x87F087F0;
mov.b32 k, 0x7B807B80;
mul.rn.bf16x2 x, x, k;
mul.rn.bf16x2 $0, x, $2;
}""")


@gluon.jit
def _block_scale_pairs(s_rows, step):
    """The scale pairs of K blocks 2 step and 2 step + 1 for `_folded_block_bits`: int32 [BN] with
    2^(b - 127) as BF16 (bits b << 7) in both 16-bit halves, from the UE8M0 bytes b (in
    FOLD_SCALE_BYTES, so b - 127 is within BF16's normal exponents)."""
    b0 = gl.load(s_rows + 2 * step).to(gl.int32)
    b1 = gl.load(s_rows + 2 * step + 1).to(gl.int32)
    return b0 * 0x00800080, b1 * 0x00800080


@gluon.jit
def _folded_block_bits(w_blk, sc, a_l: gl.constexpr):
    """`_folded_block` by integer and BF16 operations on pairs of codes (`_FOLD_BITS_ASM`: one prmt,
    one shl, one and, two mul.rn.bf16x2 a pair), the same bits: sc are `_block_scale_pairs`' pairs.
    Exact for scale bytes in FOLD_SCALE_BYTES: the shifted code is e4m3 x 2^-120 in BF16 (E4M3
    subnormals as BF16 subnormals, signs and zeros kept), and both products are BF16 values (a value
    of at most 4 significant bits within BF16's normal range, or a signed zero), so neither rounds."""
    codes = w_blk.load(a_l).to(gl.uint8, bitcast=True)
    pairs = gl.broadcast(sc[:, None], codes)[0]
    return gl.inline_asm_elementwise(_FOLD_BITS_ASM, "=r,r,r,r", [codes, pairs], dtype=gl.bfloat16,
                                     is_pure=True, pack=2)


@gluon.jit
def _folded_scales(s_rows, step, BITS: gl.constexpr):
    """The scales of slot `step` in the form the folded conversion takes: `_block_scale_pairs` with
    BITS, else `_block_scales`."""
    if BITS:
        return _block_scale_pairs(s_rows, step)
    else:
        return _block_scales(s_rows, step)


@gluon.jit
def _folded_operand(w_blk, sc, a_l: gl.constexpr, BITS: gl.constexpr):
    """One 32-deep K block as the wgmma's register A operand: `_folded_block_bits` with BITS, else
    `_folded_block` (the same bits)."""
    if BITS:
        return _folded_block_bits(w_blk, sc, a_l)
    else:
        return _folded_block(w_blk, sc, a_l)


@gluon.jit
def _folded_step(acc, i, scales, w_smem, x_smem, ready, empty, s_rows, cos, sin, step_lo, n_steps,
                 STAGES: gl.constexpr, BT: gl.constexpr, HEAD_STEPS: gl.constexpr, a_l: gl.constexpr,
                 rot_l: gl.constexpr, BITS: gl.constexpr):
    """Slot i of `_consumer_fp8_folded`: the next slot's scales loaded, the slot's two K blocks
    converted in registers (`_folded_block`, or `_folded_block_bits` with BITS), the o tile rotated
    when it is a rotary chunk, the two wgmmas (register A, o tile from shared memory) added to acc,
    then a wait that leaves this slot's two groups in flight and retires slot i-1's, which goes back
    to the producer. Returns (acc, the scales of slot i + 1)."""
    sc0, sc1 = scales
    s = i % STAGES
    x_tile = x_smem.index(s)
    w_tile = w_smem.index(s)
    scales = _folded_scales(s_rows, step_lo + gl.minimum(i + 1, n_steps - 1), BITS)
    mbarrier.wait(ready.index(s), (i // STAGES) & 1)
    a0 = _folded_operand(w_tile.slice(0, 32, dim=1), sc0, a_l, BITS)
    a1 = _folded_operand(w_tile.slice(32, 32, dim=1), sc1, a_l, BITS)
    if (step_lo + i) % HEAD_STEPS == HEAD_STEPS - 1:
        _rotate_slot(x_tile, cos, sin, BT, rot_l)
        # the generic-proxy stores before the wgmma's (async proxy) reads, from every thread
        fence_async_shared()
        gl.thread_barrier()
    acc = warpgroup_mma(a0, x_tile.slice(0, 32, dim=1).permute((1, 0)), acc, is_async=True)
    acc = warpgroup_mma(a1, x_tile.slice(32, 32, dim=1).permute((1, 0)), acc, is_async=True)
    acc = warpgroup_mma_wait(num_outstanding=2, deps=(acc, ))
    if i > 0:
        # slot i-1's wgmmas have retired: hand it back to the producer
        mbarrier.arrive(empty.index((i - 1) % STAGES), count=1)
    return acc, scales


@gluon.jit
def _consumer_fp8_folded(w_smem, x_smem, ready, empty, cos_ptr, sin_ptr, s_ptr, M, stride_cm, stride_sm,
                         stride_sn, off_n, step_lo, N_STEPS: gl.constexpr, STAGES: gl.constexpr,
                         BN: gl.constexpr, BT: gl.constexpr, HEAD_STEPS: gl.constexpr,
                         mma_layout: gl.constexpr, rot_l: gl.constexpr, pair_l: gl.constexpr,
                         BITS: gl.constexpr):
    """The consumer warpgroup(s) for an FP8 weight with the block scales folded into the weight
    (GluonWoAConfig.fold_scales): per slot its two 32-deep K blocks converted in registers to BF16
    already scaled (`_folded_block`, exact) and fed to the wgmma as its A operand from registers, one
    accumulating chain into the FP32 accumulator in K order as `_consumer` runs for a BF16 weight,
    the slot's wgmmas issued before the previous slot's are retired (`_folded_step`). The loop runs
    two slots per iteration: a wgmma reads its register operand until a wait retires it, so
    consecutive slots convert into different registers (one loop iteration's values would be
    rewritten by the next while still in flight). Returns (acc, )."""
    a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_layout, k_width=2)
    cos, sin = _load_cis(cos_ptr, sin_ptr, M, stride_cm, stride_sm, BT, pair_l)
    rn = off_n + gl.arange(0, BN, layout=gl.SliceLayout(1, a_l))
    s_rows = s_ptr + (rn // 32) * stride_sn
    acc = gl.zeros([BN, BT], gl.float32, mma_layout)
    scales = _folded_scales(s_rows, step_lo, BITS)
    for j in range(N_STEPS // 2):
        acc, scales = _folded_step(acc, 2 * j, scales, w_smem, x_smem, ready, empty, s_rows, cos, sin, step_lo,
                                   N_STEPS, STAGES, BT, HEAD_STEPS, a_l, rot_l, BITS)
        acc, scales = _folded_step(acc, 2 * j + 1, scales, w_smem, x_smem, ready, empty, s_rows, cos, sin,
                                   step_lo, N_STEPS, STAGES, BT, HEAD_STEPS, a_l, rot_l, BITS)
    if N_STEPS % 2 == 1:
        acc, scales = _folded_step(acc, N_STEPS - 1, scales, w_smem, x_smem, ready, empty, s_rows, cos, sin,
                                   step_lo, N_STEPS, STAGES, BT, HEAD_STEPS, a_l, rot_l, BITS)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
    return (acc, )


@gluon.jit
def _store_z(total, z_ptrs, mask, codes_ptr, scales_ptr, off_n, M, stride_codes, stride_scales,
             QUANT: gl.constexpr, BN: gl.constexpr, BT: gl.constexpr, WG: gl.constexpr):
    """Store bf16(total) ([BN, BT] FP32: outputs n x rows m) into z; with QUANT also its MXFP8
    (blocks of 32 outputs of a row) through `act_quant.mxfp8_quantize_tile`, the quantizer of
    `act_quant_mxfp8_` and of `ops.wo_a`'s fused form, on the BF16 values just rounded."""
    zb = total.to(gl.bfloat16)
    gl.store(z_ptrs, zb, mask=mask)
    if QUANT:
        codes, sbytes = mxfp8_quantize_tile(gl.permute(zb.to(gl.float32), [1, 0]), _AMAX_FLOOR, _INV_QMAX, _QMAX)
        codes_l: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 16], threads_per_warp=[8, 4],
                                                 warps_per_cta=[4, WG], order=[1, 0])
        scales_l: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 1], threads_per_warp=[32, 1],
                                                  warps_per_cta=[4 * WG, 1], order=[1, 0])
        codes = gl.convert_layout(codes, codes_l)
        sbytes = gl.convert_layout(sbytes, scales_l)
        rm = gl.arange(0, BT, layout=gl.SliceLayout(1, codes_l))
        rn = gl.arange(0, BN, layout=gl.SliceLayout(0, codes_l))
        c_ok = (rm < M)[:, None] & (rn < BN)[None, :]
        gl.store(codes_ptr + rm[:, None] * stride_codes + (off_n + rn)[None, :], codes, mask=c_ok)
        rs = gl.arange(0, BT, layout=gl.SliceLayout(1, scales_l))
        rb = gl.arange(0, BN // 32, layout=gl.SliceLayout(0, scales_l))
        s_ok = (rs < M)[:, None] & (rb < BN // 32)[None, :]
        gl.store(scales_ptr + rs[:, None] * stride_scales + (off_n // 32 + rb)[None, :], sbytes.to(gl.uint8),
                 mask=s_ok)


@gluon.jit(do_not_specialize=["M", "stride_cm", "stride_sm", "gate_count"])
def _gluon_wo_a_kernel(
    w_desc, x_desc, cos_ptr, sin_ptr, s_ptr, z_ptr, ws_ptr, cnt_ptr, codes_ptr, scales_ptr, cp_pool_ptr,
    cp_src_ptr, cp_dst_ptr, gate_ptr, gate_count, M, stride_cm, stride_sm, stride_sn, stride_zm, stride_codes,
    stride_scales,
    R: gl.constexpr, GW: gl.constexpr, HEAD_STEPS: gl.constexpr, STEPS_PER_SPLIT: gl.constexpr,
    SPLIT: gl.constexpr, BT: gl.constexpr, STAGES: gl.constexpr, FP8: gl.constexpr = False,
    FOLD: gl.constexpr = False, FOLD_BITS: gl.constexpr = False, QUANT: gl.constexpr = False,
    COPY_WORDS: gl.constexpr = 0, COPY_BLOCK: gl.constexpr = 1, N_TILES: gl.constexpr = 1,
    PDL: gl.constexpr = False, RELEASE: gl.constexpr = False, PREFILL: gl.constexpr = 0,
    GATE: gl.constexpr = False,
):
    # Grid (G*R / BN tiles, SPLIT): program (t, s) covers weight rows [t*BN, +BN) (all in group
    # g = t*BN // R) and the group's K steps [s*STEPS_PER_SPLIT, +STEPS_PER_SPLIT) of 64 channels;
    # the o tile's columns are g*GW + k in o viewed as [M, H*512]. FP8: the weight is E4M3 with
    # UE8M0 scales at s_ptr ([G*R/32, GW/32] bytes, row stride stride_sn); FOLD: the folded consumer.
    BN: gl.constexpr = w_desc.block_type.shape[0]
    WG: gl.constexpr = BN // 64
    pid_n = gl.program_id(0)
    pid_s = gl.program_id(1)
    off_n = pid_n * BN
    x_col = (off_n // R) * GW
    step_lo = pid_s * STEPS_PER_SPLIT

    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4 * WG, 1],
                                                         instr_shape=[16, BT, 16])
    # the rotation's layouts: each thread two adjacent channels (one pair) of a row
    rot_l: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 2], threads_per_warp=[1, 32],
                                           warps_per_cta=[4 * WG, 1], order=[1, 0])
    pair_l: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 1], threads_per_warp=[1, 32],
                                            warps_per_cta=[4 * WG, 1], order=[1, 0])

    w_smem, x_smem, ready, empty = ring(w_desc, x_desc, STAGES)
    # the slots the PDL prologue leaves to the producer (GATE: none; it requests the rest after the gate)
    FILLED: gl.constexpr = 0 if GATE else PREFILL
    if PDL:
        # launched by PDL: the ring's first weight tiles (PREFILL slots, 0: all; with GATE the rest
        # once the sparse MLA's programs have signalled gate_count times) while the sparse MLA still
        # runs, then its wait
        ring_prefill(w_desc, x_desc, w_smem, ready, off_n, step_lo, STEPS_PER_SPLIT, STAGES, 1, PREFILL, gate_ptr,
                     gate_count, GATE)

    if FP8 and FOLD:
        acc, = gl.warp_specialize([
            (_consumer_fp8_folded, (w_smem, x_smem, ready, empty, cos_ptr, sin_ptr, s_ptr, M, stride_cm, stride_sm,
                                    stride_sn, off_n, step_lo, STEPS_PER_SPLIT, STAGES, BN, BT, HEAD_STEPS,
                                    mma_layout, rot_l, pair_l, FOLD_BITS)),
            (ring_producer, (w_desc, x_desc, w_smem, x_smem, ready, empty, off_n, 0, x_col, step_lo, STEPS_PER_SPLIT,
                             STAGES, PDL, FILLED)),
        ], [1], [24])
    elif FP8:
        # the BF16 staging tile of the converted weight (the o tile's 128-byte swizzle)
        wb_smem = gl.allocate_shared_memory(gl.bfloat16, [BN, 64], x_desc.layout)
        cvt_l: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 16], threads_per_warp=[16, 2],
                                               warps_per_cta=[4 * WG, 1], order=[1, 0])
        acc, = gl.warp_specialize([
            (_consumer_fp8, (w_smem, wb_smem, x_smem, ready, empty, cos_ptr, sin_ptr, s_ptr, M, stride_cm,
                             stride_sm, stride_sn, off_n, step_lo, STEPS_PER_SPLIT, STAGES, BN, BT, HEAD_STEPS,
                             mma_layout, rot_l, pair_l, cvt_l)),
            (ring_producer, (w_desc, x_desc, w_smem, x_smem, ready, empty, off_n, 0, x_col, step_lo, STEPS_PER_SPLIT,
                             STAGES, PDL, FILLED)),
        ], [1], [24])
    else:
        acc, = gl.warp_specialize([
            (_consumer, (w_smem, x_smem, ready, empty, cos_ptr, sin_ptr, M, stride_cm, stride_sm, step_lo,
                         STEPS_PER_SPLIT, STAGES, BN, BT, HEAD_STEPS, mma_layout, rot_l, pair_l)),
            (ring_producer, (w_desc, x_desc, w_smem, x_smem, ready, empty, off_n, 0, x_col, step_lo, STEPS_PER_SPLIT,
                             STAGES, PDL, FILLED)),
        ], [1], [24])

    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(i))
        mbarrier.invalidate(empty.index(i))
    if RELEASE:
        # the main loop is done: the next kernel, where launched by PDL (the step's wo_b, `wo_b_pdl`),
        # may start once every program is here (its wait still orders it after this kernel's end)
        gluon_launch_dependents()

    # The epilogue in a layout where each thread holds 8 consecutive n of one row m (16-byte
    # stores of z and of the workspace, both n-contiguous) instead of the wgmma's scattered pairs.
    out_l: gl.constexpr = gl.BlockedLayout(size_per_thread=[8, 1], threads_per_warp=[8, 4],
                                           warps_per_cta=[WG, 4], order=[0, 1])
    acc = gl.convert_layout(acc, out_l)
    rn_l = gl.arange(0, BN, layout=gl.SliceLayout(1, out_l))
    rm = gl.arange(0, BT, layout=gl.SliceLayout(0, out_l))
    mask = (rm[None, :] < M) & (rn_l[:, None] < BN)
    z_ptrs = z_ptr + rm[None, :] * stride_zm + (off_n + rn_l)[:, None]
    if SPLIT > 1:
        # Partial s of tile t at ws[(t * SPLIT + s) * M * BN + m * BN + n]: the M real rows.
        tile_ws = ws_ptr + pid_n * SPLIT * M * BN + rm[None, :] * BN + rn_l[:, None]
        gl.store(tile_ws + pid_s * M * BN, acc, mask=mask)
        # Every thread's partial is written before one thread's release of the counter.
        gl.thread_barrier()
        arrived = gl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT - 1:
            gl.thread_barrier()
            total = gl.zeros([BN, BT], gl.float32, out_l)
            for s in range(SPLIT):
                # .cg: from L2, never from a line this SM's L1 kept from an earlier launch.
                total += gl.load(tile_ws + s * M * BN, mask=mask, other=0.0, cache_modifier=".cg")
            _store_z(total, z_ptrs, mask, codes_ptr, scales_ptr, off_n, M, stride_codes, stride_scales,
                     QUANT, BN, BT, WG)
            gl.atomic_xchg(cnt_ptr + pid_n, 0, sem="relaxed", scope="gpu")
    else:
        _store_z(acc, z_ptrs, mask, codes_ptr, scales_ptr, off_n, M, stride_codes, stride_scales, QUANT, BN, BT, WG)

    if COPY_WORDS > 0:
        # the staged window copy (`window_copy`): the programs of split 0 move rows pid_n,
        # pid_n + N_TILES, ... (after the kernel's predecessors, the readers of the destinations: by
        # stream order, or, launched by PDL, by `ring_prefill`'s wait)
        if pid_s == 0:
            copy_l: gl.constexpr = gl.BlockedLayout(size_per_thread=[1], threads_per_warp=[32],
                                                    warps_per_cta=[4 * WG], order=[0])
            rw = gl.arange(0, COPY_BLOCK, layout=copy_l)
            w_ok = rw < COPY_WORDS
            for r in range(pid_n, M, N_TILES):
                src = gl.load(cp_src_ptr + r)
                dst = gl.load(cp_dst_ptr + r)
                rec = gl.load(cp_pool_ptr + src * COPY_WORDS + rw, mask=w_ok)
                gl.store(cp_pool_ptr + dst * COPY_WORDS + rw, rec, mask=w_ok)


@dataclass(frozen=True)
class GluonWoAConfig:
    """How a plan runs (the bits depend on the split alone, not on these).

    split: programs along K per output tile; None = the default rule (the largest divisor of
        group_width / 64 at most 2 x SMs / output tiles, `ops.wo_a.WoAPlan.build`'s rule for a BF16
        weight).
    stages: ring slots, 3..12 (each a [64 x warpgroups, 64] weight tile, BF16 or E4M3, and a
        [BT, 64] BF16 o tile).
    warpgroups: consumer warpgroups per program, 1 or 2 (64 or 128 weight rows per program).
    maxnreg: the launch's register cap per thread; None = `register_cap`'s rule.
    fold_scales: for an FP8 weight, the folded consumer (`_consumer_fp8_folded`: each block scale
        folded into the weight's exact conversion to BF16 in registers, one accumulating wgmma
        chain with the weight as the register A operand; scale bytes in FOLD_SCALE_BYTES,
        `check_folded_scale`) instead of the block-partial consumer (`_consumer_fp8`). No effect on
        a BF16 weight.
    fold_bits: with fold_scales, the folded consumer's conversion by integer and BF16 operations
        (`_folded_block_bits`, `_FOLD_BITS_ASM`: per pair of codes one PRMT, one IMAD.SHL, one
        LOP3 and two HMUL2.BF16_V2) instead of E4M3 -> F16 -> FP32, two FP32 multiplies and a
        BF16 pack (one F2FP unpack, two HADD2.F32, two FMUL, one F2FP pack a pair); the same bits
        (exact over FOLD_SCALE_BYTES). In the sm_90 SASS of the consumer's main loop (two slots,
        64 codes a thread, every row bucket 8-64): 160 conversion instructions against 192, 2.5 an
        element against 3.0, besides the same 32 LDS.U16; the loop 1125 / 1221 / 1873 / 2335
        instructions against 1168 / 1265 / 1917 / 2353 at 8 / 16 / 32 / 64 rows; on the H200 14.5-15.6
        us at 1-16 rows against 15.3-15.9 (`scripts/probe_gluon_wo_a.py --fp8fold`), so the step's
        FP8 `wo_a` takes it (`decode.attention.wo_a_plan`). No effect without fold_scales.
    prefill: launched by PDL (`gluon_wo_a_(pdl=True)`), the ring slots whose weight tiles a program
        requests before its wait for the kernel before it (1..stages; None: all `stages`); the
        producer fills the rest after the wait. Fewer ask less of DRAM while that kernel (the step's
        sparse MLA, whose record gathers queue behind such traffic) still runs. The same values
        whatever it is; no effect without pdl. In the step at 1 row one or two slots measured 0.5-0.7 %
        slower than all six (the MLA faster, wo_a slower by more: H100, docs/step.md), so the step
        keeps all (`decode.attention.WO_A_PREFILL`), but for its gated launches (`gluon_wo_a_(gate=)`:
        two slots before the gate, `decode.attention.WO_A_GATE_PREFILL`).

    Measured on the H200 (BF16, docs/results/gluon-wo-a-probe-h200.txt): the default (6 stages, one
    warpgroup, the default split) against 4 and 8 stages and two warpgroups at split 4: the default
    within 1 % of the fastest at every row count 1-64 (8 stages 0.8 % faster at 16 rows, 14 %
    slower at 64; two warpgroups 3-23 % slower). Split 1 (with 6 or 12 stages; other bits than the
    Triton plan) and two warpgroups at split 2 (with 6 or 8 stages) are 0.3-1.5 us slower at 1-8
    rows (split 1 faster from 32 rows; `docs/gemm.md`, "What limits them", `wo_a`); the probe's
    register cap of 128 (`r128`) is built but not measured.
    """

    split: int | None = None
    stages: int = 6
    warpgroups: int = 1
    maxnreg: int | None = None
    fold_scales: bool = False
    fold_bits: bool = False
    prefill: int | None = None

    def __post_init__(self):
        def is_int(v):
            return isinstance(v, int) and not isinstance(v, bool)
        if self.split is not None and (not is_int(self.split) or self.split < 1):
            raise ValueError(f"GluonWoAConfig.split must be None or a positive int, got {self.split!r}")
        if not is_int(self.stages) or not 3 <= self.stages <= 12:
            raise ValueError(f"GluonWoAConfig.stages must be an int in [3, 12], got {self.stages!r}")
        if not is_int(self.warpgroups) or self.warpgroups not in (1, 2):
            raise ValueError(f"GluonWoAConfig.warpgroups must be 1 or 2, got {self.warpgroups!r}")
        if self.maxnreg is not None and (not is_int(self.maxnreg) or not 24 <= self.maxnreg <= 256
                                         or self.maxnreg % 8):
            raise ValueError(f"GluonWoAConfig.maxnreg must be None or a multiple of 8 in [24, 256], "
                             f"got {self.maxnreg!r}")
        if not isinstance(self.fold_scales, bool):
            raise ValueError(f"GluonWoAConfig.fold_scales must be a bool, got {self.fold_scales!r}")
        if not isinstance(self.fold_bits, bool):
            raise ValueError(f"GluonWoAConfig.fold_bits must be a bool, got {self.fold_bits!r}")
        if self.prefill is not None and (not is_int(self.prefill) or not 1 <= self.prefill <= self.stages):
            raise ValueError(f"GluonWoAConfig.prefill must be None or an int in [1, stages={self.stages}], "
                             f"got {self.prefill!r}")

    @property
    def block_n(self) -> int:
        """Weight rows (outputs) per program: 64 per consumer warpgroup."""
        return 64 * self.warpgroups


def register_cap(config: GluonWoAConfig, bt: int, fp8: bool) -> int:
    """The launch's register cap per thread at row bucket `bt`: config.maxnreg, else 80, and 128 for
    an FP8 weight at 64 rows with the block-partial consumer (not with config.fold_scales). A CTA runs the consumer warpgroup(s) and the producer's warp padded to
    a warpgroup, each thread holding the cap however `setmaxnreg` moves the registers (the producer
    drops to 24, the consumer rises): 80 keeps three CTAs of one warpgroup per SM resident (8 warps
    x 32 x 80 of 64K registers; Triton's default of 255 one). Every bucket compiles without spills
    at 80 (sm_90 compile test), except the FP8 consumer at 64 rows (the accumulator and two block
    partials, 32 registers each: 32 bytes of stack at 80), which needs 104 and runs at 128, the
    same residency (two CTAs). The folded FP8 consumer (the accumulator and two slots' register A
    operands, 16 registers each) compiles without spills at 80 at every bucket, with either
    conversion (config.fold_bits)."""
    if config.maxnreg is not None:
        return config.maxnreg
    return 128 if fp8 and bt == 64 and not config.fold_scales else 80


def block_t(rows: int) -> int:
    """The row bucket (the wgmma's N) of a launch of `rows` rows."""
    return next(b for b in ROW_BUCKETS if b >= rows)


def shared_bytes(config: GluonWoAConfig, bt: int, fp8: bool = False) -> int:
    """The shared memory of a launch at row bucket `bt`: the ring's weight and o tiles (with an FP8
    weight and the block-partial consumer, also the BF16 staging tile), and 1 KB for the mbarriers
    and what the compiler adds."""
    w_bytes = config.block_n * BLOCK_K * (1 if fp8 else 2)
    staging = config.block_n * BLOCK_K * 2 if fp8 and not config.fold_scales else 0
    return config.stages * (w_bytes + bt * BLOCK_K * 2) + staging + 1024


def default_split(group_width: int, n_tiles: int, sms: int) -> int:
    """About two programs per SM: the largest divisor of group_width / 128 (of group_width / 64 when
    128 does not divide it) at most round(2 x SMs / output tiles). For a group width that 128
    divides this is `ops.wo_a.WoAPlan.build`'s rule for a BF16 weight (its K grain is 128), so both
    plans take the same split and the same K ranges."""
    grain = 128 if group_width % 128 == 0 else BLOCK_K
    grains = group_width // grain
    target = max(1, round(2 * sms / n_tiles))
    return max(d for d in range(1, grains + 1) if grains % d == 0 and d <= target)


def launch_options(plan: "GluonWoAPlan", bt: int, pdl: bool = False, release: bool = False,
                   gate: bool = False) -> dict:
    """The kernel's constexpr arguments and launch options at row bucket `bt` (the launch and the
    sm_90 compile test share them); pdl, release: as `gluon_wo_a_`'s; gate: `gluon_wo_a_`'s gate > 0
    (with pdl)."""
    opts = {"R": plan.rank, "GW": plan.group_width, "HEAD_STEPS": plan.head_dim // BLOCK_K,
            "STEPS_PER_SPLIT": plan.k_per_split // BLOCK_K, "SPLIT": plan.split, "BT": bt,
            "STAGES": plan.config.stages, "FP8": plan.fp8, "FOLD": plan.folds_scales,
            "FOLD_BITS": plan.folds_scales and plan.config.fold_bits, "num_warps": 4 * plan.config.warpgroups,
            "maxnreg": register_cap(plan.config, bt, plan.fp8),
            # the rotation's products and sums rounded as torch rounds them (no FMA)
            "enable_fp_fusion": False, "PDL": pdl, "RELEASE": release, "PREFILL": plan.config.prefill or 0,
            "GATE": gate and pdl, **pdl_launch_options(pdl)}
    return opts


@dataclass(frozen=True, eq=False)
class GluonWoAPlan(GroupedShape):
    """Tiles and split of the Gluon `wo_a` for one rank's shape, and its split-K workspace (its own,
    or views of a shared pool: `build(workspace=)`). sm_90 launches only; builds anywhere (the split
    rule takes an H200's SM count off the GPU).

    heads, o_groups: this rank's H and G (H/G heads per group); rank: R = o_lora_rank (a multiple
    of config.block_n); head_dim: a multiple of 64; rope_dim: 64 (one ring slot); max_rows: 1..64;
    weight_dtype: bfloat16 or float8_e4m3fn (with 32x32 UE8M0 scales, as `ops.wo_a`).
    k_per_split: group channels per program; split: programs along K per output tile (the same at
    every row count: batch invariance). partials: FP32 [N tiles * split * max_rows * block_n];
    counters: [N tiles] int32, zero between launches. gate: int32 [2], zero between launch pairs:
    the count of the predecessor's signals and of this kernel's programs past their wait
    (`gluon_wo_a_(gate=)`, `ops.pdl.gluon_gate_await`), its own slot of a shared pool (int32 slot 5:
    the predecessor writes it while it runs). Not for concurrent launches on two streams.
    """
    heads: int
    o_groups: int
    rank: int
    head_dim: int
    rope_dim: int
    max_rows: int
    weight_dtype: torch.dtype
    config: GluonWoAConfig
    k_per_split: int
    split: int
    partials: torch.Tensor
    counters: torch.Tensor
    gate: torch.Tensor

    @property
    def device(self) -> torch.device:
        return self.counters.device

    def with_prefill(self, slots: int | None) -> "GluonWoAPlan":
        """This plan with `GluonWoAConfig.prefill` = slots: the same split, workspace, counters and
        gate (so not for launches that may overlap this plan's). ValueError as the config's."""
        return replace(self, config=replace(self.config, prefill=slots))

    @property
    def n_tiles(self) -> int:
        return self.n_out // self.config.block_n

    @property
    def fp8(self) -> bool:
        return self.weight_dtype == torch.float8_e4m3fn

    @property
    def folds_scales(self) -> bool:
        """An FP8 weight with the folded consumer (config.fold_scales): its scale bytes must lie in
        FOLD_SCALE_BYTES (`check_folded_scale`, once per weight; the launch does not read them)."""
        return self.fp8 and self.config.fold_scales

    @classmethod
    def build(cls, heads: int, o_groups: int, rank: int, max_rows: int, weight_dtype: torch.dtype = torch.bfloat16,
              device: torch.device | str = "cuda", *, head_dim: int = 512, rope_dim: int = 64,
              config: GluonWoAConfig | None = None, workspace=None) -> "GluonWoAPlan":
        """Choose the split and allocate the workspace (or take it from `workspace`: a pool as
        `ops.common.plan_workspace` says, FP32 slot 0 and int32 slot 0), with `WoAPlan.build`'s
        leading arguments."""
        for name, v in (("heads", heads), ("o_groups", o_groups), ("rank", rank), ("max_rows", max_rows),
                        ("head_dim", head_dim), ("rope_dim", rope_dim)):
            require_int(v, name)
        if weight_dtype not in (torch.bfloat16, torch.float8_e4m3fn):
            raise TypeError(f"weight_dtype must be torch.bfloat16 or torch.float8_e4m3fn, got {weight_dtype}")
        fp8 = weight_dtype == torch.float8_e4m3fn
        if config is not None and not isinstance(config, GluonWoAConfig):
            raise TypeError(f"config must be a GluonWoAConfig, got {type(config).__name__}")
        config = config or GluonWoAConfig()
        if heads % o_groups:
            raise ValueError(f"heads={heads} must be a multiple of o_groups={o_groups}")
        if rank % config.block_n:
            raise ValueError(f"rank={rank} must be a multiple of {config.block_n} (the weight rows of a "
                             f"program: 64 x config.warpgroups)")
        if head_dim % BLOCK_K:
            raise ValueError(f"head_dim={head_dim} must be a multiple of {BLOCK_K} (the ring's slot depth)")
        if rope_dim != ROPE_DIM:
            raise ValueError(f"rope_dim={rope_dim} must be {ROPE_DIM} (the kernel rotates one 64-deep slot "
                             f"per head; use ops.wo_a)")
        if max_rows > MAX_ROWS:
            raise ValueError(f"max_rows must be at most {MAX_ROWS} (the low-batch limit), got {max_rows}")
        need = shared_bytes(config, block_t(max_rows), fp8)
        if need > SHARED_LIMIT:
            raise ValueError(f"config.stages = {config.stages} needs {need} bytes of shared memory at "
                             f"max_rows = {max_rows}; sm_90 has {SHARED_LIMIT}")
        device = torch.device(device)
        n_tiles = o_groups * rank // config.block_n
        group_width = heads // o_groups * head_dim
        steps = group_width // BLOCK_K
        split = config.split
        if split is None:
            split = default_split(group_width, n_tiles, num_sms(device))
        elif steps % split:
            raise ValueError(f"config.split must divide group_width / {BLOCK_K} = {steps}, got {split}")
        partials = plan_workspace(workspace, 0, n_tiles * split * max_rows * config.block_n if split > 1 else 1,
                                  torch.float32, device)
        counters = plan_workspace(workspace, 0, n_tiles, torch.int32, device)
        gate = plan_workspace(workspace, 5, 2, torch.int32, device)
        return cls(heads, o_groups, rank, head_dim, rope_dim, max_rows, weight_dtype, config, group_width // split,
                   split, partials, counters, gate)


def check_folded_scale(scale: torch.Tensor) -> None:
    """Raise ValueError unless every UE8M0 byte of `scale` (an FP8 weight's block scales, float8_e8m0fnu
    or uint8) lies in FOLD_SCALE_BYTES, the range where the folded consumer's conversion is exact.
    Reads the tensor (a device sync on a GPU): call it once when a weight is bound to a plan with
    `folds_scales`, not per launch. `ops.wo_a.quantize_wo_a` gives bytes in range for any weight
    whose blocks' largest |w| lies in [1e-4, 448 x 2^119] (its amax floor is 1e-4)."""
    if not isinstance(scale, torch.Tensor) or scale.dtype not in (torch.float8_e8m0fnu, torch.uint8):
        raise TypeError(f"scale must be a float8_e8m0fnu or uint8 tensor, got "
                        f"{scale.dtype if isinstance(scale, torch.Tensor) else type(scale).__name__}")
    if scale.numel() == 0:
        return
    b = scale.view(torch.uint8)
    lo, hi = int(b.min()), int(b.max())
    if lo < FOLD_SCALE_BYTES[0] or hi > FOLD_SCALE_BYTES[1]:
        raise ValueError(f"scale bytes must lie in [{FOLD_SCALE_BYTES[0]}, {FOLD_SCALE_BYTES[1]}] for the folded FP8 "
                         f"wo_a (e4m3 x 2^(b - 127) exact in BF16), got bytes in [{lo}, {hi}]")


def foldable_scale(scale: torch.Tensor | None) -> bool:
    """Whether a plan may fold `scale` (an FP8 weight's block scales): every byte in
    FOLD_SCALE_BYTES (`check_folded_scale` passes); True for None (a BF16 weight, nothing to fold).
    What `decode.attention.wo_a_plan`'s callers pass as gluon_fp8."""
    if scale is None:
        return True
    try:
        check_folded_scale(scale)
    except ValueError:
        return False
    return True


def gluon_wo_a_(plan: GluonWoAPlan, o: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, weight: torch.Tensor,
                scale: torch.Tensor | None, out: torch.Tensor, codes_out: torch.Tensor | None = None,
                scales_out: torch.Tensor | None = None,
                window_copy: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None, *,
                pdl: bool = False, release: bool = False, gate: int = 0) -> None:
    """Write z = `reference.attention.grouped_wo_a(o, cos + j sin, weight, G, 64)` into out: the
    arguments of `ops.wo_a.wo_a_` (see there), with these limits:

    o: [M, H, head_dim] BF16 whose heads are contiguous within a row (head stride = head_dim, unit
       stride; rows 16-byte aligned: the kernel reads o as [M, H*head_dim] through TMA).
    weight: [G*R, (H/G)*head_dim] of plan.weight_dtype, rows 16-byte aligned (TMA); scale as
       `ops.wo_a.wo_a_` (None for BF16; [G*R/32, (H/G)*head_dim/32] UE8M0 bytes for FP8; with
       plan.folds_scales, bytes in FOLD_SCALE_BYTES: unchecked here, `check_folded_scale` checks
       them once per weight).
    codes_out, scales_out: optionally the MXFP8 of out in the same launch (`act_quant_mxfp8_(out,
       codes_out, scales_out)` bit for bit), as `ops.wo_a.wo_a_`.
    window_copy: optionally (pool, src, dst), as `ops.wo_a.wo_a_` (same checks, same guarantees).
    pdl: launch by programmatic dependent launch (`ops.pdl`): where the kernel before it on the stream
       lets it (`gluon_sparse_mla_(release=True)`), its programs start while that kernel runs and
       fill the ring's first slots with weight tiles, then wait for it before they read o or write
       anything; without such a predecessor it runs as without pdl. The same values either way.
       ValueError where PDL is not available (`ops.pdl.supported`).
    release: the programs let the next kernel on the stream start once each has finished its main
       loop, where that kernel is launched by PDL (the step's `wo_b`, `DecodeStep(wo_b_pdl=True)`;
       it waits for this one before it reads z); a no-op otherwise (and off sm_90 or in the
       interpreter, where PDL is not available: ValueError, as for pdl).
    gate: with pdl, the signals of the kernel before it (`gluon_sparse_mla_(signal=plan.gate)`, one a
       program: its launch's program count) that the programs wait for after requesting the ring's
       first `config.prefill` slots and before requesting the rest and waiting for that kernel
       (`gluon_ring.ring_prefill`'s GATE); 0: no gate. A schedule aid: the same values. The pairing
       is the caller's: a predecessor that signals fewer times costs each program a bounded wait
       (`ops.pdl.gluon_gate_await`). ValueError for a negative or non-int gate, or a gate without pdl.
    """
    m, scale, quant, codes_out, scales_out, (cp_pool, cp_src, cp_dst, copy_words) = wo_a_args(
        plan, GluonWoAPlan, o, cos, sin, weight, scale, out, codes_out, scales_out, window_copy)
    if isinstance(gate, bool) or not isinstance(gate, int) or gate < 0:
        raise ValueError(f"gate must be a non-negative int (the predecessor's signals), got {gate!r}")
    if gate and not pdl:
        raise ValueError(f"gate={gate} needs pdl=True (the gate orders requests made before the PDL wait)")
    dev = plan.device
    if plan.heads > 1 and o.stride(1) != plan.head_dim:
        raise ValueError(f"o must have contiguous heads within a row (strides (*, {plan.head_dim}, 1)), got "
                         f"strides {o.stride()}: the kernel reads each row's heads as one TMA row")
    if scale is None:
        scale = plan.counters     # an unused pointer
    if not is_sm90(dev):
        raise ValueError(f"the plan's device must be a CUDA device of compute capability 9.0 (the Gluon tier is "
                         f"sm_90 code: TMA, wgmma), got {dev}")
    if m == 0:
        return
    bt = block_t(m)
    bn = plan.config.block_n
    w_desc = tma_desc(weight, [bn, BLOCK_K], "weight")
    o2 = o.as_strided((m, plan.heads * plan.head_dim), (o.stride(0), 1))
    x_desc = tma_desc(o2, [bt, BLOCK_K], "o")
    if pdl or release:
        require_pdl(dev)
    opts = launch_options(plan, bt, pdl, release, gate > 0)
    _gluon_wo_a_kernel[(plan.n_tiles, plan.split)](
        w_desc, x_desc, cos, sin, scale, out, plan.partials, plan.counters, codes_out, scales_out, cp_pool, cp_src,
        cp_dst, plan.gate, gate, m, cos.stride(0), sin.stride(0), scale.stride(0), out.stride(0), codes_out.stride(0),
        scales_out.stride(0), QUANT=quant,
        COPY_WORDS=copy_words, COPY_BLOCK=max(32, 1 << (max(copy_words, 1) - 1).bit_length()),
        N_TILES=plan.n_tiles, **opts,
    )
