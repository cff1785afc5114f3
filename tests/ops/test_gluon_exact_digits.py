"""ops.gluon_exact_digits, GluonExactMM's forms on FP16 tensor cores from each code's two exact FP16
digits ("f16d" on mma.sync, also with the warps along K; "f16w" / "f16wp" on wgmma; sm_90 only).

On the CPU: the digits' arithmetic modelled in torch gives the rounded block sum (every E4M3 code's
digits exact; the three digit dots and `chained_dot`'s two partial sums exact in FP32; one rounding,
on data where a plain FP32 sum is not the rounded one), and every form compiles for sm_90 without
spills, with its MMA count, its FP32 adds, 8-byte operand loads, nothing contracted and no FP32 op
that flushes subnormals. On the GPU
(`-m gpu`): bitwise `reference.linear.mxfp8_mm` at the TP1 shapes at 1, 5, 8, 16, 33 and 64 rows
(the small shapes' cases are in tests/ops/test_gluon_exact_mm.py's bitwise test).

No tolerance: the forms compute the contract's arithmetic exactly, so any difference from the
reference is a bug.
"""

import re

import pytest
import torch
from _gluon_linear_support import spill_free
from helpers import FLASH_LINEAR_SHAPES as FLASH_SHAPES
from test_gluon_exact_mm import _case_id, _flash_shape_matches_the_reference

from dsv41_decode.ops import gluon_exact_mm as E
from dsv41_decode.testing.sm90 import compile_exact_mm, loop_with
from dsv41_decode.testing.synthetic import heavy_e4m3

C = E.GluonExactConfig
TP1_SHAPES = [s for s in FLASH_SHAPES if s[0] in ("fused_wqa_wkv", "wq_b", "wq_b_tp8", "wo_b")]


# The FP16 digits ("f16d": each code split into an integer digit and a 2^-9 remainder, a block's
# exact dot from four FP16 MMAs): 128 x 8 at a cap of 80, 128 x 16, 64 x 32 with x's rows on two
# warps and FP32 out, the K split, 256-deep slots.
DIGIT_COMPILE_CASES = [
    (C(convert="f16d", block_n=128, block_m=8, maxnreg=80), 8, 1, False),
    (C(convert="f16d", block_n=128, block_m=16), 16, 1, False),
    (C(convert="f16d", block_m=32, warps_n=2), 32, 1, True),
    (C(convert="f16d", block_m=16, split=4), 16, 4, False),
    (C(convert="f16d", block_n=128, block_m=8, block_k=256, stages=3), 8, 1, False),
    # with the warps along K (batched MMAs, a warp's blocks): 16 x 8 at a cap of 80 (and 256-deep
    # slots), 64 x 16 over 2 x 2 warps with the K split and FP32 out
    (C(convert="f16d", warps_k=4, block_n=16, block_m=8, maxnreg=80), 8, 1, False),
    (C(convert="f16d", warps_k=4, block_n=16, block_m=8, maxnreg=80, block_k=256), 8, 1, False),
    (C(convert="f16d", warps_k=2, block_n=64, block_m=16), 16, 2, True),
    # on wgmma ("f16w"): 64 x 8, 128 x 16, 64 x 32 with FP32 out, the K split, 256-deep slots
    (C(convert="f16w", block_m=8), 8, 1, False),
    (C(convert="f16w", block_n=128, block_m=16), 16, 1, False),
    (C(convert="f16w", block_m=32), 32, 1, True),
    (C(convert="f16w", block_m=16, split=4), 16, 4, False),
    (C(convert="f16w", block_m=8, block_k=256, stages=3), 8, 1, False),
    # the next block's wgmmas issued before this block's sums ("f16wp"): 64 x 8, 128 x 8 with the split
    (C(convert="f16wp", block_m=8), 8, 1, False),
    (C(convert="f16wp", block_n=128, block_m=8, split=2), 8, 2, True),
]


@pytest.mark.parametrize("config,bt,split,out_f32", DIGIT_COMPILE_CASES,
                         ids=[_case_id(c) for c in DIGIT_COMPILE_CASES])
def test_digit_form_compiles_for_sm90_without_spills(config, bt, split, out_f32):
    kernel = compile_exact_mm(config, bt, split, out_f32)
    _, ins, ops = spill_free(kernel, config.maxnreg or 255, E.shared_bytes(config, bt))
    # Four FP16 MMAs a K block (hh, the two cross dots, ll), each two k16 steps with FP32
    # accumulation: "f16d" m16n8k16 (mma.sync) per 16 weight rows and 8 x rows, a quarter per warp;
    # "f16w" one wgmma m64 x bt per 64 weight rows (the warpgroup's); no FP64 MMA.
    blocks = config.block_k // 32
    if config.convert == "f16d":
        mma, shape = "HMMA", "HMMA.16816.F32 "
        count = 8 * (config.block_n // 16) * (bt // 8) * blocks // 4
    else:
        mma, shape = "HGMMA", f"HGMMA.64x{bt}x16.F32 "
        count = 8 * (config.block_n // 64) * blocks
    found = [t for t in ins if t.startswith(mma)]
    assert all(t.startswith(shape) for t in found), found[:4]
    assert len(found) == count, len(found)
    # `chained_dot` (on wgmma `consumer_wg`'s): four FP32 adds a block and output (mid's rounding
    # to an integer, mid - mi, H + L), one more for the K-ordered sum unless the K split stores the
    # term instead.
    outputs = config.block_n * bt * blocks // 128
    fadd = sum(t.startswith("FADD") for t in loop_with(kernel, mma))
    assert fadd == (4 + (split == 1)) * outputs, (fadd, outputs)
    assert ops.get("DMMA", 0) == 0, ops
    # The operands' shared-memory loads are 8 bytes wide (`gluon_exact_digits.operand16`'s permuted k, and the x
    # codes of "f16w"'s digit tiles; with the warps along K also the block terms' reads, by
    # ldmatrix); the codes become FP16 pairwise (one unpacking conversion per two codes).
    loop = loop_with(kernel, mma)
    loads = {t.split()[0] for t in loop if t.startswith("LDS")}
    terms = {"LDSM.16.M88", "LDSM.16.M88.2", "LDSM.16.M88.4", "LDS", "LDS.128"} if config.warps_k > 1 else set()
    assert "LDS.64" in loads and loads <= {"LDS.64"} | terms, loads
    assert any(t.startswith("F2FP.F16.E4M3.UNPACK_B") for t in loop)
    if config.convert != "f16d":
        # x's scales decoded once a slot by the warpgroup and read as FP32 from shared memory; the
        # weight's once per 16-row tile: the loop's UE8M0 decodes (each with a select of NaN for
        # the byte 255) are one per block and wgmma tile of 64 rows, not one per x column too.
        nan_selects = sum("QNAN" in t for t in loop)
        assert nan_selects == blocks * (config.block_n // 64), nan_selects
    # Nothing contracted: the digits' and the partial's adds and the scaling's products each
    # rounded on their own (no FFMA / HFMA2), no FP32 op that flushes subnormals.
    assert ops.get("FFMA", 0) == 0 and ops.get("HFMA2", 0) == 0, ops
    assert "mul.rn.f32" in kernel.asm["ptx"] and re.search(r"\.ftz\.f32\b", kernel.asm["ptx"]) is None
    assert (split > 1) == (ops.get("ATOMG", 0) > 0), (split, ops)


def _model_digits(codes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`gluon_exact_digits.digits` in torch's FP16 arithmetic (each add rounded to FP16, as the GPU's)."""
    v = codes.to(torch.float16)
    h = (v + 1536.0) - 1536.0
    return h, v - h


def test_digit_split_is_exact_for_every_code():
    # Every finite E4M3 code: the integer digit is an integer of at most 448, the remainder a
    # multiple of 2^-9 of at most 1/2, and the two add back to the code's value exactly (FP16
    # arithmetic, as `digits` runs it): what the FP16 digits' exactness argument assumes.
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)
    finite = codes.float().isfinite()
    h, lo = (t.double() for t in _model_digits(codes[finite]))
    v = codes[finite].double()
    assert torch.equal(h, h.round()) and h.abs().max() <= 448
    assert torch.equal(lo * 512, (lo * 512).round()) and lo.abs().max() <= 0.5
    assert torch.equal(h + lo, v)


@pytest.mark.parametrize("kind", ["heavy", "uniform"])
def test_digit_partial_model_is_the_rounded_block_sum(kind):
    # `gluon_exact_digits.digit_partial`'s arithmetic on the CPU: the three digit dots (hh, the cross dots, ll) are
    # sums of at most 24 significant bits - exact in FP32, as the FP16 MMA must give them (checked
    # here: each FP64 sum equals its FP32 rounding) - and FP32 adds that split mid into an integer
    # and a remainder round their sum once: every block partial equals RN(exact block dot), on data
    # where a plain FP32 sum is not.
    gen = torch.Generator().manual_seed(41)
    if kind == "heavy":
        w, x = heavy_e4m3((4096, 32), gen), heavy_e4m3((4096, 32), gen)
    else:
        w = torch.randint(0, 256, (4096, 32), dtype=torch.uint8, generator=gen)
        x = torch.randint(0, 256, (4096, 32), dtype=torch.uint8, generator=gen)
        w[(w & 0x7F) == 0x7F] = 0
        x[(x & 0x7F) == 0x7F] = 0
        w, x = w.view(torch.float8_e4m3fn), x.view(torch.float8_e4m3fn)
    wh, wl = (t.double() for t in _model_digits(w))
    xh, xl = (t.double() for t in _model_digits(x))
    dots = [(wh * xh).sum(-1), (wh * xl).sum(-1) + (wl * xh).sum(-1), (wl * xl).sum(-1)]
    for d in dots:
        assert torch.equal(d.float().double(), d)
    hh, mid, ll = (d.float() for d in dots)
    mi = (mid + 12582912.0) - 12582912.0
    part = (hh + mi) + ((mid - mi) + ll)
    exact = (w.double() * x.double()).sum(-1)
    assert torch.equal(part, exact.float())
    # `chained_dot` (mma.sync): hh's and ll's MMAs accumulate onto mi and mid - mi, sums the MMA must
    # form exactly too (each FP64 sum equal to its FP32 rounding), and one add rounds their sum.
    high = (wh * xh).sum(-1) + mi.double()
    low = (wl * xl).sum(-1) + (mid - mi).double()
    for d in (high, low):
        assert torch.equal(d.float().double(), d)
    assert torch.equal(high.float() + low.float(), exact.float())
    assert not torch.equal((w.float() * x.float()).sum(-1), exact.float())   # the data is not trivial


# The FP16 digits at the TP1 shapes, per row count: 128 x 8 and 128 x 16, 64 x 32 with x's rows on
# two warps, the K split, 256-deep slots, the warps along K; on mma.sync ("f16d") and on wgmma
# ("f16w", "f16wp").
DIGIT_CONFIGS = (
    {8: C(convert="f16d", block_n=128, block_m=8, maxnreg=80),
     16: C(convert="f16d", block_n=128, block_m=16),
     64: C(convert="f16d", block_m=32, warps_n=2)},
    {8: C(convert="f16d", block_m=8, split=4, maxnreg=80),
     16: C(convert="f16d", block_m=16, block_k=256, stages=3),
     64: C(convert="f16d", block_m=64, maxnreg=None)},
    {8: C(convert="f16d", warps_k=4, block_n=16, block_m=8, maxnreg=80, block_k=256),
     16: C(convert="f16d", warps_k=4, block_n=32, block_m=16),
     64: C(convert="f16d", warps_k=4, block_n=16, block_m=32)},
    {8: C(convert="f16wp", block_m=8, split=4),
     16: C(convert="f16w", block_n=128, block_m=16),
     64: C(convert="f16w", block_m=32, block_k=256, stages=3)},
)


@pytest.mark.gpu
@pytest.mark.parametrize("name,n,k", TP1_SHAPES, ids=["fused_wqa_wkv", "wq_b", "idx_wq_b", "wo_b"])
def test_digit_flash_shapes_match_the_reference_on_gpu(name, n, k):
    _flash_shape_matches_the_reference(name, n, k, DIGIT_CONFIGS)
