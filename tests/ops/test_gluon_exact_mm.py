"""ops.gluon_exact_mm, the Gluon form of the contract-exact MXFP8 linear on the FP64 MMA (sm_90 only).

On the CPU (Gluon kernels do not run in Triton's interpreter): the kernel compiles for sm_90
(Triton's own ptxas) in every form its configuration offers - the weight's conversions (the packed
ones with one byte permute a code, on the words as loaded), 16- and 32-deep MMA steps, 16 to 128
weight rows, x's rows split across warps, the warps along K, 128- and 256-deep ring slots, 8 to 32
x rows a program, with and without the K split, BF16 and FP32 out - with no spills, the FP64 MMA (DMMA) once per 16
weight rows, 8 x rows and 16 of K, wide shared-memory loads of the operands, the block terms' last
product kept apart from the add (`mul.rn`, no FFMA), no FP32 op that flushes subnormals; and the
plan's bad arguments raise errors that name them. On the GPU (`-m gpu`): bitwise
`reference.linear.mxfp8_mm` on small shapes (model-like, heavy-tailed, uniform and subnormal
codes; row tiles, partial tiles, K splits; rows and columns past the call untouched), bitwise
`ExactMM` at the V4.1-Flash TP1 shapes at 1, 8, 16, 32 and 64 rows, run to run, across row counts,
bitwise `mxfp8_mm` there at 1, 5, 8, 16, 33 and 64 rows (model-like and heavy-tailed codes) with
the warps along K, the packed conversions and 256-deep slots, and the call's argument errors. The
small-shape bitwise test covers the FP16 digit forms too; their own tests (CPU model, sm_90
compiles, TP1 shapes) are in tests/ops/test_gluon_exact_digits.py, the fused scaling's
(`GluonExactConfig.fuse_scales`) in tests/ops/test_gluon_exact_fused.py.

No tolerance anywhere: the op computes the contract's arithmetic exactly (each 32-block's dot an
exact FP64 MMA, rounded once to FP32; the block terms scaled and added in K order; one rounding to
BF16), so any difference from the reference is a bug. The heavy-tailed and uniform operands are
tests/ops/test_exact_mm.py's, on which a plain FP32 block sum is not the exactly rounded one
(checked there, `test_data_defeats_a_plain_fp32_block_sum`).
"""

import dataclasses
import re

import pytest
import torch
from _gluon_linear_support import (check_exact_plan_errors, check_rope_compile, check_tma_alignment_errors,
                                   check_window, kind_operands, spill_free)
from helpers import FLASH_LINEAR_SHAPES as FLASH_SHAPES
from helpers import check_mxfp8_plan_errors, linear_operands, raises, rope_operands
from test_exact_mm import _bits, _gen, _poisoned, check_rope

from dsv41_decode.ops import gluon_exact_mm as E
from dsv41_decode.ops.exact_linear import _GLUON_PLAN
from dsv41_decode.ops.exact_mm import ExactMM
from dsv41_decode.ops.gluon_ring import SHARED_LIMIT
from dsv41_decode.reference.linear import mxfp8_mm
from dsv41_decode.testing.sm90 import compile_exact_mm, loop_with, loops_with, sass
from dsv41_decode.testing.synthetic import heavy_e4m3

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
C = E.GluonExactConfig


# (config, row bucket, K splits, FP32 out): each form of the kernel at least once in few compiles
# (~1 s each): the five conversions, both MMA depths, 64 / 128 weight rows, warps along x's rows,
# 8 to 32 x rows a program (64 spill, with or without the register cap: the GPU tests run them),
# the split-K epilogue, FP32 out.
COMPILE_CASES = [
    (C(convert="cvt"), 8, 1, False),
    (C(), 32, 1, True),
    (C(block_n=128, block_m=16), 16, 4, False),
    (C(mma_k=16, warps_n=2), 16, 3, False),
    (C(convert="int", warps_n=4, block_m=16, stages=3), 16, 2, True),
    (C(convert="raw", block_n=128, block_m=16), 8, 1, False),
    (C(convert="raw", mma_k=16, warps_n=2), 16, 2, True),
    (C(convert="raw+cvt"), 8, 1, False),
    (C(convert="int+cvt", block_n=128, block_m=16), 16, 2, False),
    # the warps along K (the slot's K blocks split between the warps, their terms through shared
    # memory): 16 weight rows at 8 x rows ("raw"), 32 at 16 with 16-deep steps ("int+cvt", FP32 out),
    # 64 over 2 x 2 warps with the K split ("int")
    (C(convert="raw", warps_k=4, block_n=16, block_m=8, maxnreg=80), 8, 1, False),
    (C(convert="int+cvt", warps_k=4, block_n=32, block_m=16, mma_k=16), 16, 1, True),
    (C(convert="int", warps_k=2, block_n=64, block_m=16), 16, 2, False),
    # the weight's pattern four codes at a time (byte permutes on the loaded words): 128 x 8 "rawp",
    # 16 x 8 along K "intp" with 16-deep steps (ldmatrix words)
    (C(convert="rawp", block_n=128, block_m=8, maxnreg=80), 8, 1, False),
    (C(convert="intp", warps_k=4, block_n=16, block_m=8, mma_k=16, maxnreg=80), 8, 1, False),
    # 256-deep slots (eight K blocks, two scale words a row, one barrier round): along K on 16-row
    # tiles (each warp two blocks' MMA chains), and 128 x 8 in "intp+cvt" with the K split
    (C(convert="rawp", warps_k=4, block_n=16, block_m=8, maxnreg=80, block_k=256), 8, 1, False),
    (C(convert="intp+cvt", block_n=128, block_m=8, stages=2, block_k=256), 8, 2, False),
]


def _case_id(case) -> str:
    c, bt, split, f32 = case
    return (f"{c.convert}-n{c.block_n}-k{c.mma_k}-wn{c.warps_n}" + (f"-wk{c.warps_k}" if c.warps_k > 1 else "")
            + (f"-bk{c.block_k}" if c.block_k != 128 else "") + f"-bt{bt}-split{split}" + ("-f32" if f32 else ""))


@pytest.mark.parametrize("config,bt,split,out_f32", COMPILE_CASES, ids=[_case_id(c) for c in COMPILE_CASES])
def test_compiles_for_sm90_without_spills(config, bt, split, out_f32):
    kernel = compile_exact_mm(config, bt, split, out_f32)
    _, ins, ops = spill_free(kernel, config.maxnreg, E.shared_bytes(config, bt))
    # The FP64 MMA, m16n8k16: a program's (block_n / 16) x (bt / 8) of them per 16 of K, block_k K per
    # slot, a quarter per warp (warps_k=1: per warp along the weight rows and x's rows; warps_k > 1:
    # per warp its K blocks and its weight rows); the loop body holds one slot.
    wn = E.launch_warps_n(config, bt)
    dmma = [t for t in ins if t.startswith("DMMA")]
    assert all(t.startswith("DMMA.16x8x16 ") for t in dmma), dmma[:4]
    assert len(dmma) == (config.block_n // 16) * (bt // 8) * (config.block_k // 16) // 4, len(dmma)
    # The operands' shared-memory loads in the consumer's loop are wide (8-byte loads for 32-deep
    # steps, ldmatrix for 16-deep ones): the permuted k puts each thread's bytes side by side; no
    # load of single bytes or halves (LDS.U8 / .U16: one a byte without the permutation).
    loop = loop_with(kernel, "DMMA")
    assert sum(t.startswith("DMMA") for t in loop) == len(dmma)
    loads = {t.split()[0] for t in loop if t.startswith("LDS")}
    assert loads <= {"LDS", "LDS.64", "LDS.128", "LDSM.16.M88", "LDSM.16.M88.2", "LDSM.16.M88.4"}, loads
    assert ("LDS.64" in loads) if config.mma_k == 32 else any(op.startswith("LDSM") for op in loads), loads
    # The conversion: "int" multiplies every weight code's pattern by 2^1016 (DMUL), "raw" only x's
    # values (by 2^1000), "cvt" none (F2F); each block's FP64 sum is rounded once to FP32
    # (cvt.rn.f32.f64) and its last scale is a lone mul.rn (no FFMA: nothing contracted into the
    # accumulator's add); no FP32 op flushes subnormals.
    ptx = kernel.asm["ptx"]
    # codes a thread converts per slot: x's [bt / wn, 128 / warps_k] and the weight's
    # [block_n / (4 / wn / warps_k), 128 / warps_k] over the warp's 32 threads
    wk = config.warps_k
    bk = config.block_k
    x_codes, w_codes = bt // wn * bk // wk // 32, config.block_n * wn * wk // 4 * bk // wk // 32
    assert ops.get("DMUL", 0) == {"cvt": 0, "int": w_codes, "raw": x_codes, "int+cvt": w_codes // 2,
                                  "raw+cvt": x_codes // 2, "intp": w_codes, "rawp": x_codes,
                                  "intp+cvt": w_codes // 2, "rawp+cvt": x_codes // 2}[config.convert], ops
    # The packed forms: one byte permute a weight code (`_PATTERN4_ASM`'s four selectors), on the
    # words as loaded (no permutes regrouping bytes of two loads: PRMT only with those selectors
    # or on scale bytes, with RZ).
    packed = {"intp": w_codes, "rawp": w_codes, "intp+cvt": w_codes // 2,
              "rawp+cvt": w_codes // 2}.get(config.convert, 0)
    prmt = [t for t in loop if t.startswith("PRMT")]
    selectors = [t for t in prmt if re.search(r", 0x(544|1644|2744|3455), ", t)]
    assert len(selectors) == packed, (len(selectors), packed)
    if packed:
        assert all(t in selectors or t.endswith("RZ") for t in prmt), [t for t in prmt if t not in selectors]
    # The scale words a thread loads per slot (one word per 128 of K): the weight's, two rows per
    # 16-row MMA tile, or in the packed forms one (the tile's rows share their 32-row scale block:
    # `_tile_weight_scales`); x's, two columns per 8-column MMA tile, or with the warps along K the
    # thread's share of the slot's [K blocks, x rows] (decoded once by the warps,
    # `gluon_exact_digits.store_x_scales`: one entry a thread up to 128 of them).
    tiles = config.block_n // 16 // (4 // (wn * wk))
    sw_loads = tiles * (1 if packed else 2)
    sx_loads = max(1, bk // 32 * bt // 128) if wk > 1 else bt // wn // 8 * 2
    assert sum(t.startswith("LDG") for t in loop) == bk // 128 * (sw_loads + sx_loads), loop
    assert "cvt.rn.f32.f64" in ptx and "mul.rn.f32" in ptx
    assert ops.get("FFMA", 0) == 0, ops
    assert re.search(r"\.ftz\.f32\b", ptx) is None
    # The TMA ring (weight and x boxes, mbarriers; a 256-deep box in two of the 128-byte swizzle's
    # width), the producer's registers handed over, and the last-arriver counter iff the K is split.
    assert ops.get("UTMALDG", 0) == 2 * bk // 128 and ops.get("SYNCS", 0) > 0, ops
    assert any(t.startswith("USETMAXREG.DEALLOC") for t in ins)
    assert (split > 1) == (ops.get("ATOMG", 0) > 0), (split, ops)
    # Barriers a slot: the ring's two (before the slot's release, after it), and with warps_k > 1
    # the terms' (stored before they are read; the release's serves between the reads and the
    # next slot's stores).
    assert sum(t.startswith("BAR.SYNC") for t in loop) == (2 if wk == 1 else 3), loop


# The ring's slots two at a time (`pair_slots`): along K the FP16 digits' 16 x 16 tiles in 256-deep
# slots (`wo_b`'s plan entry at 3-32 rows), unfused and with the fused scaling's two loops, and an
# FP64 form's 16 x 8; along the weight rows the digits' 128 x 8 in 256-deep slots: no spills; a
# unit's loop holds two slots' MMAs behind one slot's barriers (one wait, one release and the CTA
# barriers Triton 3.6 puts before each of them, and along K one that publishes the terms), and the
# producer issues twice the TMA copies a wait.
@pytest.mark.parametrize("spec,bt", [("f16d:16:16:1:32:4:1:80:4:256:0", 16), ("f16d:16:16:1:32:4:1:80:4:256:1", 16),
                                     ("rawp:16:8:1:32:4:1:80:4:256:0", 8), ("f16d:128:8:1:32:4:1:128:1:256:0", 8)])
def test_pair_slots_run_two_slots_behind_one_slots_barriers(spec, bt):
    single = C.from_spec(spec)
    configs = single, dataclasses.replace(single, pair_slots=True)
    kernels = tuple(compile_exact_mm(c, bt) for c in configs)
    mma = "HMMA" if single.convert == "f16d" else "DMMA"
    for c, k in zip(configs, kernels):      # within the shared memory `shared_bytes` counts (the pairs' second buffers)
        spill_free(k, c.maxnreg or 255, E.shared_bytes(c, bt))
    if single.warps_k > 1:
        assert kernels[1].metadata.shared > E.shared_bytes(single, bt), kernels[1].metadata.shared

    def count(texts, op):
        return sum(op in t.split()[0] or (t.startswith("@") and op in t.split()[1]) for t in texts)
    one, two = (loops_with(k, mma) for k in kernels)
    assert len(one) == len(two) == (2 if single.fuse_scales else 1)
    for a, b in zip(one, two):
        assert count(b, mma) == 2 * count(a, mma) > 0, (count(a, mma), count(b, mma))
        assert count(a, "BAR.SYNC") == count(b, "BAR.SYNC") == (3 if single.warps_k > 1 else 2)
        assert count(a, "SYNCS") == count(b, "SYNCS") == 2
    copies = [count([t for _, t in sass(k)], "UTMALDG") for k in kernels]
    assert copies[1] == 2 * copies[0], copies


# The query-RoPE epilogue (wq_b): configurations of its plan's FP16 digits on mma.sync (128 x 8 at
# a cap of 80, 128 x 16, 64 x 32 on two warps along x; `exact_linear._GLUON_PLAN` runs 128 x 16 up
# to 16 rows) and on wgmma ("f16wp" 64 x 32, the plan's above), the FP64
# forms ("rawp" 128 x 8, "intp+cvt" 128 x 16) in the MMA's accumulator layout, and the warps along K
# (the K-ordered sums' layout) with the K split's last arriver; no more registers than without it.
ROPE_COMPILE_CASES = [(C.from_spec("f16d:128:8:1:32:4:1:80"), 8, 1), (C.from_spec("f16d:128:16:1:32:4:1"), 16, 1),
                      (C.from_spec("f16d:64:32:2:32:4:1"), 32, 1), (C.from_spec("f16wp:64:32:1:32:4:1"), 32, 1),
                      (C.from_spec("rawp:128:8:1:32:4:1:80"), 8, 1), (C.from_spec("intp+cvt:128:16:1:32:4:1"), 16, 1),
                      (C(convert="int", warps_k=2, block_n=64, block_m=16), 16, 2)]


@pytest.mark.parametrize("config,bt,split", ROPE_COMPILE_CASES,
                         ids=[_case_id((c, bt, split, False)) for c, bt, split in ROPE_COMPILE_CASES])
def test_rope_epilogue_compiles_for_sm90_without_spills(config, bt, split):
    # With the epilogue (the storing program rotates the BF16 tile: `gluon_exact_common.store_tile`):
    # no spills, the registers and the consumer's loop of the plain kernel, the rotation's roundings
    # each on their own, subnormals kept (`check_rope_compile`).
    kernel = compile_exact_mm(config, bt, split, False, rope=True)
    regs = check_rope_compile(kernel, compile_exact_mm(config, bt, split, False), config.maxnreg,
                              E.shared_bytes(config, bt), {"f16d": "HMMA", "f16w": "HGMMA", "f16wp": "HGMMA"}.get(config.convert, "DMMA"))
    assert regs <= config.maxnreg


def test_launch_geometry():
    # Rows per program: the bucket, at most block_m; warps along x's rows: at most one per 8 rows;
    # the split only for calls of at most min(split_rows, block_m) rows.
    assert [E.block_t(m, C()) for m in (1, 8, 9, 17, 33, 64)] == [8, 8, 16, 32, 32, 32]
    assert [E.block_t(m, C(block_m=64)) for m in (33, 64)] == [64, 64]
    assert [E.launch_warps_n(C(warps_n=4), bt) for bt in (8, 16, 32)] == [1, 2, 4]
    assert E.split_rows(C(split_rows=16, block_m=8)) == 8
    assert E.shared_bytes(C(stages=4), 32) == 4 * (64 + 32) * 128 + 1024
    assert E.shared_bytes(C(stages=8, block_n=128, block_m=64), 64) <= SHARED_LIMIT     # the largest ring
    assert E.shared_bytes(C(warps_k=4, block_n=16, stages=4), 8) == (4 * (16 + 8) * 128 + 1024 + 4 * 16 * 8 * 4
                                                                     + 2 * 4 * 8 * 4)
    assert [E.launch_warps_n(C(warps_k=4, block_n=32), bt) for bt in (8, 32)] == [1, 1]
    assert E.shared_bytes(C(warps_k=4, block_n=16, block_k=256), 8) == (4 * (16 + 8) * 256 + 1024 + 8 * 16 * 8 * 4
                                                                        + 2 * 8 * 8 * 4)


def test_bad_plan_arguments_name_the_argument():
    w, s = check_exact_plan_errors(E.GluonExactMM, "GluonExactConfig")
    raises(r"block_k=256 must divide K.*\(64, 384\)", lambda: E.GluonExactMM(
        torch.zeros(64, 384, dtype=torch.float8_e4m3fn), torch.zeros(2, 12, dtype=torch.uint8),
        config={8: C(), 64: C(block_k=256)}))
    raises("max_rows", lambda: E.GluonExactMM(w, s, max_rows=65))
    # the probe's spec strings (the form ops.exact_linear's plan is written in)
    assert E.GluonExactConfig.from_spec("int+cvt:16:8:1:16:8:2:80:4") == E.GluonExactConfig(
        convert="int+cvt", block_n=16, block_m=8, mma_k=16, stages=8, split=2, maxnreg=80, warps_k=4)
    assert E.GluonExactConfig.from_spec("raw:64:64:2:32:4:1:0").maxnreg is None
    assert E.GluonExactConfig.from_spec("cvt:64:32:1:32:4:1") == E.GluonExactConfig(convert="cvt")
    # and back: `spec` writes every field, which from_spec reads as the same configuration
    assert E.GluonExactConfig.from_spec("raw:64:64:2:32:4:1:0").spec == "raw:64:64:2:32:4:1:0:1:128:0:0"
    assert E.GluonExactConfig.from_spec("f16d:16:8:1:32:4:1:80:4:256:1") == C(
        convert="f16d", block_n=16, block_m=8, maxnreg=80, warps_k=4, block_k=256, fuse_scales=True)
    assert C(fuse_scales=True).spec.endswith(":128:1:0")
    assert E.GluonExactConfig.from_spec("f16d:16:16:1:32:4:1:80:4:256:0:1") == C(
        convert="f16d", block_n=16, block_m=16, maxnreg=80, warps_k=4, block_k=256, pair_slots=True)
    for c in [C(), C(convert="f16w", maxnreg=None), *(c for _, cs in _GLUON_PLAN.values() for c in cs.values())]:
        assert E.GluonExactConfig.from_spec(c.spec) == c, c
    for bad in ("int:64:32", "int:64:32:1:32:4:1:128:4:256:9", "int:64:x:1:32:4:1", "int:64:32:1:32:4:1:128:4:256:1:2",
                "int:64:32:1:32:4:1:128:4:256:1:0:0"):
        raises("a GluonExactConfig spec is convert:block_n", lambda: E.GluonExactConfig.from_spec(bad))
    raises("block_n must be", lambda: E.GluonExactConfig.from_spec("int:48:32:1:32:4:1"))
    raises(r"config must cover max_rows=64 rows, got keys \[16\]", lambda: E.GluonExactMM(w, s, config={16: C()}))
    raises("convert must be one of", lambda: C(convert="f16"))
    raises(r"block_n must be one of \(64, 128\) with warps_k=1", lambda: C(block_n=32))
    raises(r"block_n must be one of \(16, 32, 64\) with warps_k=4", lambda: C(warps_k=4, block_n=128))
    raises(r"block_n must be one of \(32, 64, 128\) with warps_k=2", lambda: C(warps_k=2, block_n=16))
    raises("warps_k must be 1, 2 or 4", lambda: C(warps_k=3))
    raises("'f16w' .*warps_k=1 only, got warps_k=4", lambda: C(warps_k=4, block_n=16, convert="f16w"))
    raises("'f16w' .*warps_n=1 only, got warps_n=2", lambda: C(warps_n=2, convert="f16w"))
    raises("warps_n must be 1 with warps_k=4", lambda: C(warps_k=4, warps_n=2))
    raises("'raw\\+cvt' is not offered with warps_k=2", lambda: C(warps_k=2, convert="raw+cvt"))
    raises("'rawp\\+cvt' is not offered with warps_k=4", lambda: C(warps_k=4, block_n=16, convert="rawp+cvt"))
    raises("'intp\\+cvt' is not offered with warps_k=2", lambda: C(warps_k=2, mma_k=16, convert="intp+cvt"))
    assert E.GluonExactConfig.from_spec("rawp:128:8:1:32:4:1:80") == C(convert="rawp", block_n=128, block_m=8,
                                                                       maxnreg=80)
    assert E.GluonExactConfig.from_spec("rawp:16:8:1:32:4:1:80:4:256") == C(
        convert="rawp", block_n=16, block_m=8, maxnreg=80, warps_k=4, block_k=256)
    raises("block_k must be one of", lambda: C(block_k=64))
    raises("mma_k must be 16, got 32", lambda: C(warps_k=4, block_n=32, convert="int+cvt"))
    raises(r"stages=8 x \(block_n=128 \+ block_m=64\).*exceed", lambda: C(warps_k=2, block_n=128, block_m=64, stages=8))
    raises("block_m must be one of", lambda: C(block_m=24))
    raises("stages must be an int in", lambda: C(stages=1))
    raises("mma_k must be 16 or 32", lambda: C(mma_k=8))
    raises("warps_n must be 1, 2 or 4", lambda: C(warps_n=3))
    raises("split must be a positive int", lambda: C(split=0))
    raises("split_rows must be an int in", lambda: C(split_rows=17))
    raises("maxnreg must be None or a multiple of 8", lambda: C(maxnreg=100))
    raises("fuse_scales must be a bool, got 1", lambda: C(fuse_scales=1))
    raises("pair_slots must be a bool, got 1", lambda: C(pair_slots=1))
    for bad in (dict(convert="f16w"), dict(warps_k=4, block_n=16, split=2), dict(stages=3)):
        raises(r"pair_slots takes the mma.sync consumers \(not 'f16w' / 'f16wp'\), split=1 and an even number",
               lambda: C(pair_slots=True, **bad))
    raises(r"pair_slots takes K a multiple of 2 x block_k=512.*\(64, 768\)", lambda: E.GluonExactMM(
        torch.zeros(64, 768, dtype=torch.float8_e4m3fn), torch.zeros(2, 24, dtype=torch.uint8),
        config=C(convert="f16d", warps_k=4, block_n=16, block_k=256, pair_slots=True)))


# ---------------------------------------------------------------------------------------------- GPU

@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k,config,kind", [
    (1, 96, 512, C(), "quantized"),
    (5, 160, 384, C(convert="cvt"), "heavy"),
    (20, 96, 256, C(block_m=8, warps_n=2), "uniform"),                             # 3 row tiles, 2 partial
    (40, 130, 512, C(convert="cvt", mma_k=16, block_n=128, block_m=16), "subnormal"),   # N past a tile
    (3, 96, 640, C(split=2, block_n=128), "heavy"),                                # splits of 3 + 2 steps
    (8, 64, 1024, C(split=3, mma_k=16), "subnormal"),                              # 3 + 3 + 2
    (64, 64, 256, C(convert="cvt", block_m=64, maxnreg=None), "uniform"),
    (17, 96, 384, C(warps_n=4, block_m=32), "quantized"),
    # "raw": the weight's subnormal codes enter the FP64 MMA as FP64 subnormals
    (9, 96, 512, C(convert="raw"), "subnormal"),
    (2, 130, 384, C(convert="raw", block_n=128, block_m=16, split=2, mma_k=16), "subnormal"),
    (33, 64, 256, C(convert="raw", warps_n=2), "heavy"),
    (4, 64, 256, C(convert="raw"), "uniform"),
    # a K block in each form, alternating
    (6, 96, 512, C(convert="int+cvt"), "subnormal"),
    (7, 64, 384, C(convert="raw+cvt", block_n=128, block_m=8), "heavy"),
    # the warps along K: 16-row tiles (N past a tile), row tiles, the K split, 2 x 2 warps, 64 x rows
    (5, 130, 512, C(convert="raw", warps_k=4, block_n=16, block_m=8, maxnreg=80), "subnormal"),
    (20, 96, 384, C(convert="int", warps_k=4, block_n=32, block_m=8), "heavy"),
    (3, 96, 640, C(convert="int+cvt", warps_k=4, block_n=16, mma_k=16, split=2), "subnormal"),
    (16, 64, 256, C(convert="cvt", warps_k=2, block_n=64, block_m=16), "uniform"),
    (64, 48, 384, C(convert="raw", warps_k=4, block_n=16, block_m=64, maxnreg=None), "quantized"),
    # the pattern four codes at a time: subnormal codes (FP64 subnormals into the MMA), both MMA
    # depths, the K split, a block in each form, the warps along K
    (9, 96, 512, C(convert="rawp"), "subnormal"),
    (2, 130, 384, C(convert="intp", block_n=128, block_m=16, split=2, mma_k=16), "subnormal"),
    (7, 64, 384, C(convert="rawp+cvt", block_n=128, block_m=8), "heavy"),
    (6, 96, 512, C(convert="intp+cvt"), "subnormal"),
    (5, 130, 512, C(convert="rawp", warps_k=4, block_n=16, block_m=8, maxnreg=80), "subnormal"),
    (3, 96, 640, C(convert="intp", warps_k=4, block_n=16, mma_k=16, split=2), "subnormal"),
    (20, 96, 384, C(convert="intp", warps_k=2, block_n=32, block_m=16, mma_k=16), "heavy"),
    (33, 130, 256, C(convert="rawp", warps_n=2, block_m=16), "heavy"),                 # x's rows on 2 warps
    # 256-deep slots: both layouts, both MMA depths, the K split (uneven: 3 + 2 slots), row tiles
    (5, 130, 1280, C(convert="rawp", warps_k=4, block_n=16, block_m=8, maxnreg=80, block_k=256, split=2), "subnormal"),
    (17, 96, 512, C(convert="int+cvt", warps_k=4, block_n=32, block_m=16, mma_k=16, block_k=256), "heavy"),
    (40, 96, 768, C(convert="cvt", warps_k=2, block_n=64, block_m=16, block_k=256, stages=2), "uniform"),
    (8, 130, 1280, C(convert="intp+cvt", block_n=128, block_m=8, stages=2, block_k=256, split=2), "subnormal"),
    (33, 64, 512, C(convert="raw", mma_k=16, warps_n=2, block_k=256, stages=2), "heavy"),
    # the FP16 digits: every kind of codes (subnormals: digits of 2^-9), row tiles, partial tiles,
    # the K split, 256-deep slots, x's rows on two warps, 64 x rows
    (1, 96, 512, C(convert="f16d"), "quantized"),
    (5, 160, 384, C(convert="f16d", block_n=128, block_m=8, maxnreg=80), "heavy"),
    (9, 130, 512, C(convert="f16d", block_n=128, block_m=16), "subnormal"),
    (20, 96, 256, C(convert="f16d", block_m=8), "uniform"),
    (3, 96, 640, C(convert="f16d", split=2, block_n=128), "heavy"),
    (33, 130, 1280, C(convert="f16d", block_m=32, warps_n=2, block_k=256, stages=2), "subnormal"),
    (64, 64, 256, C(convert="f16d", block_m=64, maxnreg=None), "uniform"),
    # the digits with the warps along K: 16-row tiles (N past a tile), row tiles, the K split, 2 x 2
    # warps, 256-deep slots
    (5, 130, 512, C(convert="f16d", warps_k=4, block_n=16, block_m=8, maxnreg=80), "subnormal"),
    (20, 96, 384, C(convert="f16d", warps_k=4, block_n=32, block_m=8), "heavy"),
    (3, 96, 640, C(convert="f16d", warps_k=4, block_n=16, split=2), "subnormal"),
    (16, 64, 256, C(convert="f16d", warps_k=2, block_n=64, block_m=16), "uniform"),
    (17, 96, 512, C(convert="f16d", warps_k=4, block_n=32, block_m=16, block_k=256), "heavy"),
    # on wgmma: the same kinds and tilings, x's digit tiles rewritten every slot
    (1, 96, 512, C(convert="f16w"), "quantized"),
    (5, 160, 384, C(convert="f16w", block_m=8), "heavy"),
    (9, 130, 512, C(convert="f16w", block_n=128, block_m=16), "subnormal"),
    (20, 96, 256, C(convert="f16w", block_m=8), "uniform"),
    (3, 96, 640, C(convert="f16w", split=2, block_n=128), "heavy"),
    (33, 130, 1280, C(convert="f16w", block_m=32, block_k=256, stages=2), "subnormal"),
    (64, 64, 256, C(convert="f16w", block_m=64), "uniform"),
    (7, 130, 1280, C(convert="f16wp", block_m=8, block_k=256, stages=3, split=2), "subnormal"),
    (20, 96, 512, C(convert="f16wp", block_n=128, block_m=16, maxnreg=None), "heavy"),
])
def test_bitwise_equal_to_the_reference_on_gpu(m, n, k, config, kind):
    _check_bitwise(m, n, k, config, kind)


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k,config,kind", [
    # the ring's slots two at a time (pair_slots) along K: 256-deep and 128-deep slots, an FP64 form,
    # a program's even steps over several ring passes, N past a tile, row tiles
    (5, 130, 2560, C(convert="f16d", warps_k=4, block_n=16, block_m=8, maxnreg=80, block_k=256,
                     pair_slots=True), "subnormal"),
    (20, 96, 1024, C(convert="f16d", warps_k=4, block_n=32, block_m=16, stages=4, pair_slots=True), "heavy"),
    (9, 64, 1536, C(convert="rawp", warps_k=4, block_n=16, block_m=16, block_k=256, stages=2, pair_slots=True),
     "uniform"),
    # along the weight rows: the digits in 256-deep slots, an FP64 form in 128-deep ones
    (7, 160, 1536, C(convert="f16d", block_n=128, block_m=8, block_k=256, pair_slots=True), "heavy"),
    (12, 96, 1024, C(convert="int", block_m=16, stages=2, pair_slots=True), "subnormal"),
])
def test_pair_slots_bitwise_equal_to_the_reference_on_gpu(m, n, k, config, kind):
    _check_bitwise(m, n, k, config, kind)


def _check_bitwise(m, n, k, config, kind):
    """`GluonExactMM` in `config` against `mxfp8_mm` on `kind` operands of m x n x k, BF16 and FP32
    out, bitwise, into poisoned windows, twice (the split's counters replayed)."""
    codes, x_scale, weight, w_scale = kind_operands(kind, m, n, k)
    plan = E.GluonExactMM(weight, w_scale, config=config)
    for dtype in (torch.bfloat16, torch.float32):
        # out: a window of a larger poisoned buffer, whose rows past M (a row tile's padding) and
        # columns past N (a weight tile's) must stay untouched
        y = check_window(plan, codes, x_scale, mxfp8_mm(codes, x_scale, weight, w_scale, dtype), 8,
                         (m, n, k, config, kind, dtype))
        again = plan(codes, x_scale, _poisoned(m, n, dtype))       # replays the split-K counters
        assert torch.equal(_bits(again), _bits(y)), (m, n, k, config, kind, dtype)
    assert int(plan._counters.abs().sum()) == 0


TP1_SHAPES = [s for s in FLASH_SHAPES if s[0] in ("fused_wqa_wkv", "wq_b", "wq_b_tp8", "wo_b")]


@pytest.mark.gpu
@pytest.mark.parametrize("name,n,k", TP1_SHAPES, ids=["fused_wqa_wkv", "wq_b", "idx_wq_b", "wo_b"])
def test_flash_shapes_match_exact_mm_on_gpu(name, n, k):
    # Bitwise ExactMM (the reference's bits, tested there) at 1, 8, 16, 32 and 64 rows (the indexer's
    # wq_b is wq_b_tp8's 4096 x 1280), every conversion, per-row configurations (a K split up to 8
    # rows), 128 weight rows and 16-deep steps; a row's bits do not depend on the rows beside it.
    _, _, codes_all, sx_all, weight, w_scale = linear_operands(_gen(n + k), 64, n, k)
    exact = ExactMM(weight, w_scale)
    configs = (None, {8: C(convert="cvt", split=4), 64: C(convert="cvt", warps_n=2)},
               C(block_n=128, mma_k=16, block_m=16),
               {16: C(convert="raw", block_n=128, block_m=16), 64: C(convert="raw")},
               {8: C(convert="raw+cvt", block_m=8), 64: C(convert="int+cvt", warps_n=2)})
    for cfg in configs:
        plan = E.GluonExactMM(weight, w_scale, config=cfg)
        together = plan(codes_all, sx_all)
        for m in (1, 8, 16, 32, 64):
            for dtype in (torch.bfloat16, torch.float32):
                y = plan(codes_all[:m], sx_all[:m], _poisoned(m, n, dtype))
                ref = exact(codes_all[:m], sx_all[:m], _poisoned(m, n, dtype))
                assert torch.equal(_bits(y), _bits(ref)), (name, cfg, m, dtype)
            assert torch.equal(_bits(y.to(torch.bfloat16)), _bits(together[:m])), (name, cfg, m)
        assert int(plan._counters.abs().sum()) == 0


# The warps along K at the TP1 shapes, per row count: 16-, 32- and 64-row tiles, each conversion,
# the K split, 2 x 2 warps, 64 x rows a program (16-row tiles: no spills at maxnreg=128).
WARPS_K_CONFIGS = (
    {8: C(convert="raw", warps_k=4, block_n=16, block_m=8, maxnreg=80),
     16: C(convert="int+cvt", warps_k=4, block_n=32, block_m=16, mma_k=16),
     64: C(convert="int", warps_k=2, block_n=64, block_m=32)},
    {8: C(convert="cvt", warps_k=4, block_n=32, split=4),
     16: C(convert="raw", warps_k=4, block_n=64, block_m=16, mma_k=16),
     64: C(convert="cvt", warps_k=4, block_n=16, block_m=64, mma_k=16)},
)
# The pattern four codes at a time at the TP1 shapes, per row count: 128 x 8 "rawp" (wq_b's
# layout), "intp+cvt" per block, the warps along K on 16-row tiles ("rawp"; "intp" with 16-deep
# steps), the K split, 64 x rows.
PACKED_CONFIGS = (
    {8: C(convert="rawp", block_n=128, block_m=8, maxnreg=80),
     16: C(convert="intp+cvt", block_n=128, block_m=16),
     64: C(convert="intp", block_m=32)},
    {8: C(convert="rawp", warps_k=4, block_n=16, block_m=8, maxnreg=80, split=2),
     16: C(convert="intp", warps_k=4, block_n=16, block_m=16, mma_k=16, maxnreg=80),
     64: C(convert="rawp", warps_k=4, block_n=16, block_m=64)},
)
# 256-deep slots at the TP1 shapes (K a multiple of 256 at all four), per row count: along K on
# 16-row tiles (two MMA chains a warp; the K split), 128 x 8 and 16 with 8 blocks a slot.
BLOCK_K_CONFIGS = (
    {8: C(convert="rawp", warps_k=4, block_n=16, block_m=8, maxnreg=80, block_k=256),
     16: C(convert="intp+cvt", block_n=128, block_m=16, stages=2, block_k=256),
     64: C(convert="int+cvt", warps_k=4, block_n=16, block_m=16, mma_k=16, block_k=256, stages=6)},
    {8: C(convert="rawp", block_n=128, block_m=8, stages=2, block_k=256, split=2),
     16: C(convert="rawp", warps_k=4, block_n=16, block_m=16, block_k=256, stages=6),
     64: C(convert="cvt", block_m=32, block_k=256, stages=2)},
)


def _flash_shape_matches_the_reference(name, n, k, configs, rows=(1, 5, 8, 16, 33, 64)):
    # Bitwise `reference.linear.mxfp8_mm` at each of `rows`, on model-like operands and on
    # heavy-tailed codes (448 down to the subnormals, both operands; scales of 2^-7..2^6), BF16 and
    # FP32 out. The reference's rows do not depend on each other: one call of 64 rows serves.
    gen = torch.Generator(device=DEVICE).manual_seed(n + k)
    _, _, codes, x_scale, weight, w_scale = linear_operands(_gen(n + k), 64, n, k)
    heavy = (heavy_e4m3((64, k), gen), torch.randint(120, 134, (64, k // 32), dtype=torch.uint8, device=DEVICE),
             heavy_e4m3((n, k), gen), w_scale)
    for kind, (c, sx, w, sw) in (("quantized", (codes, x_scale, weight, w_scale)), ("heavy", heavy)):
        ref = {dtype: mxfp8_mm(c, sx, w, sw, dtype) for dtype in (torch.bfloat16, torch.float32)}
        for cfg in configs:
            plan = E.GluonExactMM(w, sw, config=cfg)
            for m in rows:
                for dtype in (torch.bfloat16, torch.float32):
                    y = plan(c[:m], sx[:m], _poisoned(m, n, dtype))
                    assert torch.equal(_bits(y), _bits(ref[dtype][:m])), (name, kind, cfg, m, dtype)
            assert int(plan._counters.abs().sum()) == 0


@pytest.mark.gpu
@pytest.mark.parametrize("name,n,k", TP1_SHAPES, ids=["fused_wqa_wkv", "wq_b", "idx_wq_b", "wo_b"])
def test_warps_k_flash_shapes_match_the_reference_on_gpu(name, n, k):
    _flash_shape_matches_the_reference(name, n, k, WARPS_K_CONFIGS)


@pytest.mark.gpu
@pytest.mark.parametrize("name,n,k", TP1_SHAPES, ids=["fused_wqa_wkv", "wq_b", "idx_wq_b", "wo_b"])
def test_packed_flash_shapes_match_the_reference_on_gpu(name, n, k):
    _flash_shape_matches_the_reference(name, n, k, PACKED_CONFIGS)


@pytest.mark.gpu
@pytest.mark.parametrize("name,n,k", TP1_SHAPES, ids=["fused_wqa_wkv", "wq_b", "idx_wq_b", "wo_b"])
def test_block_k_256_flash_shapes_match_the_reference_on_gpu(name, n, k):
    _flash_shape_matches_the_reference(name, n, k, BLOCK_K_CONFIGS)


@pytest.mark.gpu
def test_bad_call_arguments_name_the_argument_on_gpu():
    m, n, k = 2, 64, 128
    _, _, codes, x_scale, weight, w_scale = linear_operands(_gen(8), m, n, k)
    check_mxfp8_plan_errors(E.GluonExactMM, codes, x_scale, weight, w_scale)
    plan = E.GluonExactMM(weight, w_scale, max_rows=8)
    check_tma_alignment_errors(E.GluonExactMM, plan, codes, x_scale, weight, w_scale)


# wq_b with the K split (128 x 8 "rawp" in 2 splits up to 8 rows; 32-row tiles with the warps along K
# in 2 splits up to 16) and the warps along K without (64 x 32: 2 row tiles at 64 rows).
ROPE_SPLIT_CONFIG = {8: C(convert="rawp", block_n=128, block_m=8, maxnreg=80, split=2),
                     16: C(convert="int+cvt", warps_k=4, block_n=32, block_m=16, mma_k=16, split=2),
                     64: C(convert="int", warps_k=2, block_n=64, block_m=32)}


@pytest.mark.gpu
def test_rope_epilogue_at_wq_b_on_gpu():
    # The query-RoPE epilogue at wq_b's shape, where the step's exact path runs GluonExactMM above 2
    # rows: the plan's configurations (`exact_linear._GLUON_PLAN`; 64 rows in 4 row tiles of 16,
    # each with its own rows of cos/sin) at every row count 1-64, and `ROPE_SPLIT_CONFIG` (the
    # last arriver rotates) at 1, 3, 8, 9, 16, 17, 33 and 64: bitwise ExactMM's call followed by
    # `query_rope_`.
    n, k = 32768, 1280
    _, _, codes, x_scale, weight, w_scale = linear_operands(_gen(n + k + 4), 64, n, k)
    cos, sin = rope_operands(_gen(19), 64)
    plain = ExactMM(weight, w_scale)(codes, x_scale)
    for cfg, rows in ((_GLUON_PLAN[(n, k)][1], range(1, 65)), (ROPE_SPLIT_CONFIG, (1, 3, 8, 9, 16, 17, 33, 64))):
        plan = E.GluonExactMM(weight, w_scale, config=cfg)
        for m in rows:
            check_rope(plan, codes[:m], x_scale[:m], cos[:m], sin[:m], plain[:m], (m, plan.config_for(m)))
        assert int(plan._counters.abs().sum()) == 0
