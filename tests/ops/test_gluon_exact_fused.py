"""The fused scaling of `ops.gluon_exact_mm.GluonExactMM` (`GluonExactConfig.fuse_scales`: each K
block's term and its K-ordered add in one FMA with the two scales' product where the scale bytes
keep every value exact, `ops.gluon_exact_common.fused_scale_range`; sm_90 only).

On the CPU: the exactness the fused form rests on (both orders modelled in FP32 over every byte
pair of the range against extreme block partials, and how they part outside it), the range's
narrowing to a weight's bytes, and the kernel compiled for sm_90 in each consumer form with the
option, without spills: the fused loop beside the unfused one, one FFMA a block and output, one
FADD fewer, fewer instructions. On the GPU (`-m gpu`): bitwise `reference.linear.mxfp8_mm` in
each form on model-like scales, with every x scale byte at an end of the range, with one byte past
it (the unfused loop) and with every term an FP32 subnormal; the step's plan configurations with it
at the V4.1-Flash TP1 shapes. No tolerance: the option keeps the contract's bits.
"""

import dataclasses
import re

import pytest
import torch
from _gluon_linear_support import check_window, kind_operands, spill_free
from test_gluon_exact_mm import TP1_SHAPES, _case_id, _flash_shape_matches_the_reference

from dsv41_decode.ops import gluon_exact_mm as E
from dsv41_decode.ops.exact_linear import _GLUON_PLAN
from dsv41_decode.reference.linear import mxfp8_mm
from dsv41_decode.testing import sm90
from dsv41_decode.testing.sm90 import compile_exact_mm, loop_with
from dsv41_decode.testing.synthetic import heavy_e4m3

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
C = E.GluonExactConfig


def _pow2(e: torch.Tensor) -> torch.Tensor:
    """2^e exactly, FP64 (e int64, -1000..1000)."""
    return torch.ldexp(torch.ones_like(e, dtype=torch.float64), e)


def _block_partials() -> torch.Tensor:
    """FP32 values a block partial can take, the extremes first: multiples of 2^-18 below 2^23 in
    magnitude (the rounded sum of 32 E4M3 products) - the smallest, 24 significant bits from 2^-18
    up, the largest sum (32 x 448^2), and random ones of every binade - with both signs and zero."""
    gen = torch.Generator().manual_seed(7)
    mant = torch.randint(1 << 23, 1 << 24, (256,), generator=gen, dtype=torch.int64)
    shift = torch.randint(-18, 0, (256,), generator=gen, dtype=torch.int64)     # lowest bit 2^shift
    rand = mant.double() * _pow2(shift)
    rand = torch.where(rand < 32 * 448.0 ** 2, rand, rand / 8)
    extremes = torch.tensor([2.0 ** -18, (2 ** 24 - 1) * 2.0 ** -18, 32 * 448.0 ** 2, 0.0], dtype=torch.float64)
    p = torch.cat([extremes, rand]).float()
    assert torch.equal(p.double(), torch.cat([extremes, rand]))                  # exact FP32 values
    return torch.cat([p, -p])


def test_fused_scaling_is_the_references_order_in_its_range():
    # `fused_take`'s claim (gluon_exact_common, above FUSED_X_BYTES): for x scale bytes 1..231 and
    # bx + bw in 128..358 (weight bytes 1..254), RN(RN(p * sx) * sw) - the reference's term, FP32
    # on the CPU (subnormals kept) - is p * 2^(bx + bw - 254) exactly, and `fused_scale`'s bit
    # pattern (bx + bw - 127) << 23 is that power of two: so fma(p, s, acc) = RN(acc + term). Every
    # byte pair of the range against every partial of `_block_partials`.
    from dsv41_decode.ops.gluon_exact_common import FUSED_SUM_BYTES, FUSED_X_BYTES
    p = _block_partials()
    bx, bw = torch.meshgrid(torch.arange(FUSED_X_BYTES[0], FUSED_X_BYTES[1] + 1), torch.arange(1, 255), indexing="ij")
    keep = (bx + bw >= FUSED_SUM_BYTES[0]) & (bx + bw <= FUSED_SUM_BYTES[1])
    bx, bw = bx[keep], bw[keep]
    sx, sw = _pow2(bx - 127).float(), _pow2(bw - 127).float()
    s = ((bx + bw - 127) << 23).to(torch.int32).view(torch.float32)
    assert torch.equal(s.double(), _pow2(bx + bw - 254))
    for chunk in p.split(64):
        term = (chunk[:, None] * sx[None, :]) * sw[None, :]
        assert torch.equal(term.double(), chunk.double()[:, None] * s.double()[None, :])
    # outside it the two orders part: the term of a 24-bit partial loses its low bits below
    # 2^-149 at bx + bw = 122, and p * sx overflows at bx = 255 - 15 while p * sx * sw would not
    wide = torch.tensor([(2 ** 24 - 1) * 2.0 ** -18])
    assert (wide * 2.0 ** -126) * 2.0 ** -6 != wide.double() * 2.0 ** -132
    assert torch.isinf((torch.tensor([32 * 448.0 ** 2]) * 2.0 ** 113) * 2.0 ** -20)


def test_fused_scale_range_narrows_to_the_weights_bytes():
    from dsv41_decode.ops.gluon_exact_common import fused_scale_range
    b = torch.arange(100, 141, dtype=torch.uint8).view(1, -1)
    assert fused_scale_range(b) == (28, 218)                 # 128 - 100, 358 - 140
    assert fused_scale_range(torch.full((2, 4), 127, dtype=torch.uint8)) == (1, 231)
    assert fused_scale_range(torch.tensor([[0, 127]], dtype=torch.uint8)) == (1, 0)       # byte 0: no range
    assert fused_scale_range(torch.tensor([[255, 127]], dtype=torch.uint8)) == (1, 0)     # byte 255 (NaN)
    assert fused_scale_range(torch.tensor([[127]], dtype=torch.uint8).view(torch.float8_e8m0fnu)) == (1, 231)


# The fused scaling's forms (`GluonExactConfig.fuse_scales`): on mma.sync (`_consumer`: the FP16
# digits at 128 x 16, an FP64 form at 128 x 8, the K split's stored terms), along K (16- and 32-row
# tiles, 256- and 128-deep slots; 64-row tiles, two weight scale blocks, run unfused), on wgmma
# ("f16w" 64 x 32 at a cap of 128: at the plan's 80 it spills 40 bytes).
FUSED_COMPILE_CASES = [
    (C(convert="f16d", block_n=128, block_m=16), 16, 1),
    (C(convert="rawp", block_n=128, block_m=8, maxnreg=80), 8, 1),
    (C(convert="f16d", block_m=16, split=4), 16, 4),
    (C(convert="f16d", warps_k=4, block_n=16, block_m=8, maxnreg=80, block_k=256), 8, 1),
    (C(convert="f16d", warps_k=4, block_n=32, block_m=16, maxnreg=80), 16, 1),
    (C(convert="f16d", warps_k=4, block_n=16, block_m=8, split=2), 8, 2),
    (C(convert="f16d", warps_k=2, block_n=64, block_m=16), 16, 1),
    (C(convert="f16w", block_m=32), 32, 1),
]


@pytest.mark.parametrize("config,bt,split", FUSED_COMPILE_CASES,
                         ids=[_case_id((c, bt, split, False)) for c, bt, split in FUSED_COMPILE_CASES])
def test_fused_scaling_compiles_for_sm90_without_spills(config, bt, split):
    fused = dataclasses.replace(config, fuse_scales=True)
    kernel = compile_exact_mm(fused, bt, split)
    spill_free(kernel, fused.maxnreg or 255, E.shared_bytes(fused, bt))
    mma = {"f16d": "HMMA", "f16w": "HGMMA"}.get(config.convert, "DMMA")
    plain = loop_with(compile_exact_mm(config, bt, split), mma)
    loops = sm90.loops_with(kernel, mma)
    if config.warps_k > 1 and config.block_n > 32:
        # a tile of two weight scale blocks along K: the unfused loop alone
        assert len(loops) == 1 and sm90.opcode_counts(loops[0]) == sm90.opcode_counts(plain)
        return
    # two copies of the slot loop, the fused one first (the check's outcome picks one per program)
    # and the other with the plain loop's work (its MMAs and FP32 ops; the allocator's moves aside)
    assert len(loops) == 2, [len(lp) for lp in loops]
    fused_loop, other = (sm90.opcode_counts(lp) for lp in loops)
    base = sm90.opcode_counts(plain)
    for op in (mma, "FADD", "FMUL", "HADD2", "DADD"):
        assert other.get(op, 0) == base.get(op, 0), (op, other, base)
    # the fused loop: one FFMA a block and output (the K split: one FMUL, the stored term), no FMUL
    # a term (the scales' products: one a thread's distinct pair, built from the bytes by integer
    # operations, or one FMUL of the decoded scales per x column on wgmma), one FADD a block and
    # output less (the accumulator's add, now in the FFMA)
    outputs = config.block_n * bt * config.block_k // 32 // 128
    assert fused_loop.get(mma, 0) == base[mma]
    assert fused_loop.get("FFMA", 0) == (0 if split > 1 else outputs), fused_loop
    assert fused_loop.get("FADD", 0) == base.get("FADD", 0) - (0 if split > 1 else outputs), (fused_loop, base)
    assert fused_loop.get("FMUL", 0) <= base.get("FMUL", 0) - (outputs if split > 1 else 2 * outputs - outputs // 2), (
        fused_loop, base)
    assert len(loops[0]) < len(plain), (len(loops[0]), len(plain))
    assert re.search(r"\.ftz\.f32\b", kernel.asm["ptx"]) is None


# ---------------------------------------------------------------------------------------------- GPU

# The fused scaling (`GluonExactConfig.fuse_scales`) on the GPU, in each consumer form: the FP16
# digits on mma.sync (128 x 16, the K split), an FP64 form ("rawp" 128 x 8), along K on 16- and
# 32-row tiles (256- and 128-deep slots, the K split) and on 64-row ones (run unfused), on wgmma,
# and along K with the ring's slots two at a time (`pair_slots`; K of 1536 only, the others not
# multiples of 512).
FUSED_GPU_CONFIGS = [
    C(convert="f16d", block_n=128, block_m=16, fuse_scales=True),
    C(convert="f16d", block_n=128, block_m=16, split=2, fuse_scales=True),
    C(convert="rawp", block_n=128, block_m=8, maxnreg=80, fuse_scales=True),
    C(convert="f16d", warps_k=4, block_n=16, block_m=8, maxnreg=80, block_k=256, fuse_scales=True),
    C(convert="f16d", warps_k=4, block_n=32, block_m=16, maxnreg=80, fuse_scales=True),
    C(convert="f16d", warps_k=4, block_n=16, block_m=8, split=2, fuse_scales=True),
    C(convert="f16d", warps_k=2, block_n=64, block_m=16, fuse_scales=True),
    C(convert="f16w", block_m=32, fuse_scales=True),
    C(convert="f16d", warps_k=4, block_n=16, block_m=16, maxnreg=80, block_k=256, fuse_scales=True, pair_slots=True),
]


@pytest.mark.gpu
@pytest.mark.parametrize("config", FUSED_GPU_CONFIGS, ids=lambda c: c.spec)
def test_fused_scaling_bitwise_on_gpu(config):
    # Bitwise `mxfp8_mm`, BF16 and FP32 out, at 1-40 rows (row tiles, partial weight tiles, K of
    # 640, 1280 and 1536: 3-12 ring slots): on model-like operands (x's scale bytes in the plan's
    # fused range: the fused loop), on heavy-tailed codes with every x scale byte at an end of that
    # range (terms up to ~2^112 and down to FP32's subnormals: the exactness at the range's bounds),
    # with one byte a row just past its top (each program's check fails there: the unfused loop),
    # and, on codes of the E4M3 subnormals and smallest normals with one weight scale byte, every x
    # byte at the range's bottom (every term, sum and output an FP32 subnormal or zero: none
    # flushed).
    for m, n, k in ((1, 130, 1280), (9, 96, 640), (40, 160, 1280), (16, 96, 1536)):
        if k % (config.block_k * (2 if config.pair_slots else 1)):
            continue
        codes, x_scale, weight, w_scale = kind_operands("quantized", m, n, k)
        gen = torch.Generator(device=DEVICE).manual_seed(m + n + k)
        plan = E.GluonExactMM(weight, w_scale, config=config)
        lo, hi = plan.fused_range
        assert lo < hi, plan.fused_range
        assert lo <= int(x_scale.view(torch.uint8).min()) and int(x_scale.view(torch.uint8).max()) <= hi
        heavy = heavy_e4m3((m, k), gen)
        ends = torch.where(torch.rand((m, k // 32), generator=gen, device=DEVICE) < 0.5, lo, hi).to(torch.uint8)
        past = ends.clone()
        past[:, m % (k // 32)] = hi + 1
        tiny, _, tiny_w, tiny_sw = kind_operands("subnormal", m, n, k)
        tiny_sw = torch.full_like(tiny_sw.view(torch.uint8), 120)
        tiny_plan = E.GluonExactMM(tiny_w, tiny_sw, config=config)
        assert tiny_plan.fused_range[0] == 8                    # 2^(8 - 127) x 2^(120 - 127) = 2^-126
        low = torch.full_like(ends, 8)
        for what, p, c, sx in (("model", plan, codes, x_scale), ("ends", plan, heavy, ends),
                               ("past", plan, heavy, past), ("low", tiny_plan, tiny, low)):
            for dtype in (torch.bfloat16, torch.float32):
                ref = mxfp8_mm(c, sx, p.weight, p.w_scale, dtype)
                check_window(p, c, sx, ref, 8, (config.spec, m, n, k, what, dtype))
        assert int(plan._counters.abs().sum()) == 0 and int(tiny_plan._counters.abs().sum()) == 0


@pytest.mark.gpu
@pytest.mark.parametrize("name,n,k", TP1_SHAPES, ids=["fused_wqa_wkv", "wq_b", "idx_wq_b", "wo_b"])
def test_fused_plan_flash_shapes_match_the_reference_on_gpu(name, n, k):
    # `exact_linear._GLUON_PLAN`'s configurations of the shape with the fused scaling, at 1-64 rows,
    # each configuration at the first and last row count it takes (`_flash_shape_matches_the_reference`:
    # model-like and heavy-tailed codes, x's scale bytes 120..133, in the fused range of both weights).
    plan = {rows: dataclasses.replace(c, fuse_scales=True) for rows, c in _GLUON_PLAN[(n, k)][1].items()}
    bounds = sorted(plan)
    rows = sorted({1, *bounds, *(b + 1 for b in bounds[:-1])})
    _flash_shape_matches_the_reference(name, n, k, (plan, ), rows)
