"""ops.gluon_exact_fma, the contract-exact MXFP8 linear for 1-4 rows on the FP64 CUDA cores in Gluon
(sm_90 only).

On the CPU (Gluon kernels do not run in Triton's interpreter): the kernel compiles for sm_90
(Triton's own ptxas) in a few of its forms - 1, 2 and 4 weight rows a thread, 1, 2 and 4 warps
along K, 1, 2 and 4 x rows, BF16 and FP32 out - with no spills, one DFMA per (weight code, x row)
and no FP64 MMA, the weight's conversion by integer operations (one prmt a code, no FP64 multiply
of the weight: only x's values are scaled by 2^1000, one DMUL per x code a thread converts), the
weight tile read by 16-byte shared loads, each block's FP64 sum rounded once (cvt.rn.f32.f64) and
its last scale a lone mul.rn (no FFMA), no FP32 op that flushes subnormals; with the K split, the
slot's terms published by 16-byte stores, the tile's counter and the last arriver's loads issued
a chunk at a time ahead of their adds; the configuration's and the plan's bad arguments raise
errors that name them. On the GPU (`-m gpu`): bitwise `reference.linear.mxfp8_mm` at the
V4.1-Flash TP1 shapes at 1-4 rows, BF16 and FP32 out, on model-like, heavy-tailed (448 down to the
subnormals) and subnormal codes, in several configurations (rows and columns past the call
untouched), on small shapes with a partial weight tile; the K split at wo_b, fused wq_a|wkv and
the indexer's wq_b (bitwise the reference and the unsplit kernel, calls repeated, a CUDA graph
replayed twice: the counters reset); and the call's argument errors.

No tolerance anywhere: the op computes the contract's arithmetic exactly (each 32-block's dot exact
in FP64, rounded once to FP32; the block terms scaled and added in K order; one rounding to BF16),
so any difference from the reference is a bug.
"""

import dataclasses
import re

import pytest
import torch
from _gluon_linear_support import (check_exact_plan_errors, check_rope_compile, check_tma_alignment_errors,
                                   check_window, kind_operands, spill_free, subnormal_operands)
from helpers import FLASH_LINEAR_SHAPES as FLASH_SHAPES
from helpers import linear_operands, raises, rope_operands
from test_exact_mm import _bits, _gen, _poisoned, check_rope

from dsv41_decode.ops import gluon_exact_fma as F
from dsv41_decode.ops.exact_linear import _FMA_PLAN
from dsv41_decode.ops.exact_mm import ExactMM
from dsv41_decode.ops.gluon_ring import SHARED_LIMIT
from dsv41_decode.reference.linear import mxfp8_mm
from dsv41_decode.testing import sm90
from dsv41_decode.testing.sm90 import compile_linear, loop_with, loops, rope_epilogue
from dsv41_decode.testing.synthetic import heavy_e4m3

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
C = F.GluonExactFMAConfig


def _compile(config: F.GluonExactFMAConfig, bt: int, out_f32: bool, split: int = 1, rope: bool = False):
    return compile_linear(F._gluon_exact_fma_kernel, F.launch_options(config, split), [config.block_n, F.BLOCK_K],
                          [bt, F.BLOCK_K], out_f32, **rope_epilogue(rope))


# wq_b's configuration in the step (`exact_linear._FMA_PLAN`: 2 weight rows a thread over 2 x 2
# warps, 128-row tiles, at its register cap)
WQ_B = _FMA_PLAN[(32768, 1280)][2]

# (config, row bucket, FP32 out): the default (4 weight rows a thread, the 4 warps along K) at 1
# and 4 rows, wq_b's at the 1-2 rows the step runs it, 1 row a thread with every warp all four
# blocks, 2 and 4 lanes a block; the K split (compiled as a plan with config.split > 1 launches it)
# at 128-row tiles and 1 row, and at 32-row tiles, 4 rows and a cap of 80 registers (~1 s each)
COMPILE_CASES = [
    (C(), 1, False),
    (C(), 4, True),
    (WQ_B, 1, False),
    (WQ_B, 2, False),
    (C(rows_per_thread=1, warps_k=1, stages=6), 2, True),
    (C(rows_per_thread=1, lanes_k=2, stages=8, maxnreg=80), 1, False),
    (C(rows_per_thread=2, lanes_k=4, maxnreg=80), 2, True),
    (C(split=4), 1, False),
    (C(rows_per_thread=1, stages=8, maxnreg=80, split=2), 4, True),
]


@pytest.mark.parametrize("config,bt,out_f32", COMPILE_CASES,
                         ids=[f"rw{c.rows_per_thread}-wk{c.warps_k}-lk{c.lanes_k}-r{bt}" + ("-f32" if f else "")
                              + (f"-split{c.split}" if c.split > 1 else "") for c, bt, f in COMPILE_CASES])
def test_compiles_for_sm90_without_spills(config, bt, out_f32):
    kernel = _compile(config, bt, out_f32, config.split)
    _, ins, ops = spill_free(kernel, config.maxnreg, F.shared_bytes(config, bt))
    # Per slot a thread's rows_per_thread weight rows x (4 / warps_k) K blocks x 32 / lanes_k k: one
    # DFMA per code and x row, one prmt per code (its FP64 high word), no FP64 MMA; the loop body
    # holds one slot.
    codes = config.rows_per_thread * (4 // config.warps_k) * 32 // config.lanes_k
    loop = loop_with(kernel, "DFMA")
    lops = sm90.opcode_counts(loop)
    assert ops.get("DFMA", 0) == lops.get("DFMA", 0) == codes * bt, (codes, bt, lops)
    assert lops.get("PRMT", 0) >= codes and ops.get("DMMA", 0) == 0, lops
    # No FP64 multiply of the weight: the loop's only DMULs scale x's codes by 2^1000 (bt of them
    # a thread: the 128 consumer threads convert a slot's bt x 128 codes).
    assert lops.get("DMUL", 0) == bt, lops
    # The weight tile by 16-byte shared loads (32 / lanes_k bytes a weight row and block: 8-byte
    # loads with 4 lanes a block), x's values by broadcast 8- or 16-byte loads; no shared load of
    # single bytes but x's codes (bt a thread).
    loads = [t.split()[0] for t in loop if t.startswith("LDS")]
    wide = "LDS.64" if config.lanes_k == 4 else "LDS.128"
    per_row = max(1, 2 // config.lanes_k)
    assert loads.count(wide) >= config.rows_per_thread * (4 // config.warps_k) * per_row, loads
    assert loads.count("LDS.U8") <= bt, loads
    # Each block's FP64 sum rounded once to FP32, its last scale a lone mul.rn (no FFMA: nothing
    # contracted into the accumulator's add); no FP32 op flushes subnormals.
    ptx = kernel.asm["ptx"]
    assert "cvt.rn.f32.f64" in ptx and "mul.rn.f32" in ptx
    assert ops.get("FFMA", 0) == 0, ops
    assert re.search(r"\.ftz\.f32\b", ptx) is None
    # The TMA ring (weight and x boxes, mbarriers), the producer's registers handed over; a global
    # workspace only with the K split.
    assert ops.get("UTMALDG", 0) == 2 and ops.get("SYNCS", 0) > 0, ops
    assert any(t.startswith("USETMAXREG.DEALLOC") for t in ins)
    assert ops.get("RED", 0) == 0, ops
    if config.split == 1:
        assert lops.get("STG", 0) == 0 and ops.get("ATOMG", 0) == 0, (lops, ops)
    else:
        # the terms of a slot published by 16-byte stores in the loop (4 x block_n x bt FP32 over
        # the 128 consumer threads); the tile's counter (the arrival and the reset)
        assert lops.get("STG", 0) == max(1, 4 * config.block_n * bt // 512), lops
        assert ops.get("ATOMG", 0) == 2, ops
        # the last arriver's K-ordered sum: each chunk's loads (from L2) all issued before its adds
        chunks = [body for body in loops(kernel) if any("LDG.E.STRONG.GPU" in t for t in body)
                  and not any(t.startswith("DFMA") for t in body)]
        assert chunks, "no loop of the last arriver's loads"
        for body in chunks:
            kinds = [t for t in body if re.search(r"\bLDG\b|\bFADD\b", t)]
            n_loads = sum("LDG" in t for t in kinds)
            assert n_loads >= 16 and all("LDG" in t for t in kinds[:n_loads]), kinds


# The query-RoPE epilogue (wq_b): its plan's configuration (WQ_B, whose plain compile COMPILE_CASES
# shares) at 2 rows, and the K split's last arriver (4 splits, 1 row); sm_90: the registers of
# the kernel without it, within the cap.
ROPE_COMPILE_CASES = [(WQ_B, 2), (C(split=4), 1)]


@pytest.mark.parametrize("config,bt", ROPE_COMPILE_CASES,
                         ids=[f"rw{c.rows_per_thread}-wk{c.warps_k}-lk{c.lanes_k}-r{bt}-split{c.split}"
                              for c, bt in ROPE_COMPILE_CASES])
def test_rope_epilogue_compiles_for_sm90_without_spills(config, bt):
    # With the epilogue (the storing program rotates the BF16 tile: `gluon_exact_common.store_tile`):
    # no spills, the registers and the consumer's loop of the plain kernel, the rotation's roundings
    # each on their own, subnormals kept (`check_rope_compile`).
    kernel = _compile(config, bt, False, config.split, rope=True)
    regs = check_rope_compile(kernel, _compile(config, bt, False, config.split), config.maxnreg,
                              F.shared_bytes(config, bt), "DFMA")
    assert regs <= config.maxnreg


def test_launch_geometry():
    assert [F.block_t(m) for m in (1, 2, 3, 4)] == [1, 2, 4, 4]
    assert [C(rows_per_thread=r, warps_k=w, lanes_k=lk, stages=2).block_n
            for r, w, lk in ((1, 4, 1), (4, 4, 1), (2, 2, 1), (2, 1, 1), (4, 1, 2), (1, 4, 2), (1, 4, 4))] == [
        32, 128, 128, 256, 256, 16, 8]
    assert F.shared_bytes(C(stages=4), 1) == 4 * (128 + 1) * 128 + 128 * 8 + 4 * 128 * 4 + 1024
    assert F.shared_bytes(C(rows_per_thread=4, warps_k=2, stages=5), 4) <= SHARED_LIMIT
    assert F.shared_bytes(C(rows_per_thread=2, warps_k=1, stages=5), 4) <= SHARED_LIMIT


def test_default_config_per_shape():
    # the largest tile with at least 1.5 programs an SM (132 SMs), else 8-row tiles
    tiles = {n: F.default_config(n, 132).block_n for _, n, _ in FLASH_SHAPES}
    assert (tiles[32768], tiles[4096], tiles[5120], tiles[1792], tiles[16384]) == (128, 16, 16, 8, 64), tiles
    assert F.default_config(64, 132).block_n == 8 and F.default_config(8 * 32768, 132).block_n == 128


def test_bad_config_and_plan_arguments_name_the_argument():
    w, s = check_exact_plan_errors(F.GluonExactFMA, "GluonExactFMAConfig")
    raises(r"max_rows must be an int in \[1, 4\]", lambda: F.GluonExactFMA(w, s, max_rows=5))
    raises(r"config must cover max_rows=4 rows, got keys \[2\]", lambda: F.GluonExactFMA(w, s, config={2: C()}))
    assert C.from_spec("2:2:1:6") == C(rows_per_thread=2, warps_k=2, stages=6)
    assert C.from_spec("4:4:2:4:0") == C(lanes_k=2, maxnreg=None) and C.from_spec("1:4:1:8:80").maxnreg == 80
    assert C.from_spec("2:4:1:6:80:4") == C(rows_per_thread=2, stages=6, maxnreg=80, split=4)
    assert C.from_spec("4:4:1:4:0:2") == C(maxnreg=None, split=2) and C.from_spec("4:4:1:4:128").split == 1
    for bad, field in (("4:4:1", "3 fields"), ("4:4:1:4:128:1:1", "7 fields"), ("4:x:1:4", "warps_k 'x'"),
                       ("4:4:1:4:80:two", "split 'two'")):
        raises(f"a GluonExactFMAConfig spec is rows_per_thread:warps_k:lanes_k:stages.*{field}",
               lambda: C.from_spec(bad))
    raises(r"split must be an int in \[1, 64\], got 0", lambda: C.from_spec("4:4:1:4:128:0"))
    raises("split must be an int in", lambda: C(split=65))
    raises("rows_per_thread must be 1, 2 or 4", lambda: C(rows_per_thread=3))
    raises("warps_k must be 1, 2 or 4", lambda: C(warps_k=8))
    raises("lanes_k must be 1, 2 or 4", lambda: C(lanes_k=32))
    raises("stages must be an int in", lambda: C(stages=1))
    raises("maxnreg must be None or a multiple of 8", lambda: C(maxnreg=100))
    raises(r"stages=8 x \(block_n=256 \+ 4\).*exceed", lambda: C(rows_per_thread=2, warps_k=1, stages=8))
    raises("= 512 weight rows; at most 256", lambda: C(rows_per_thread=4, warps_k=1, stages=2))


# ---------------------------------------------------------------------------------------------- GPU

# Every form at the TP1 shapes: the default, one weight row a thread (32-row tiles: wo_b's 160
# programs), 2 x 2 warps, every warp all four blocks of its rows (no exchange between the warps),
# 2 and 4 lanes a block (16- and 8-row tiles, the parts' sums by lane shuffles).
CONFIGS = (None, {2: C(rows_per_thread=1, warps_k=4, stages=8), 4: C(rows_per_thread=2, warps_k=2, stages=3)},
           C(rows_per_thread=2, warps_k=1, stages=3),
           {1: C(rows_per_thread=1, lanes_k=4, stages=8, maxnreg=80), 4: C(rows_per_thread=1, lanes_k=2, maxnreg=80)})
TP1_SHAPES = [s for s in FLASH_SHAPES if s[0] in ("fused_wqa_wkv", "wq_b", "wq_b_tp8", "wo_b")]


@pytest.mark.gpu
@pytest.mark.parametrize("name,n,k", TP1_SHAPES, ids=["fused_wqa_wkv", "wq_b", "idx_wq_b", "wo_b"])
def test_flash_shapes_match_the_reference_on_gpu(name, n, k):
    # Bitwise `reference.linear.mxfp8_mm` at 1-4 rows on model-like operands, heavy-tailed codes
    # (448 down to the subnormals, both operands; scales of 2^-7..2^6) and subnormal codes, BF16
    # and FP32 out; out a window of a poisoned buffer whose rows and columns past the call stay
    # untouched. The reference's rows do not depend on each other: one call of 4 rows serves.
    gen = torch.Generator(device=DEVICE).manual_seed(n + k)
    _, _, codes, x_scale, weight, w_scale = linear_operands(_gen(n + k), 4, n, k)
    heavy = (heavy_e4m3((4, k), gen), torch.randint(120, 134, (4, k // 32), dtype=torch.uint8, device=DEVICE),
             heavy_e4m3((n, k), gen), w_scale)
    subnormal = subnormal_operands(_gen(n), 4, n, k)
    for kind, (c, sx, w, sw) in (("quantized", (codes, x_scale, weight, w_scale)), ("heavy", heavy),
                                 ("subnormal", subnormal)):
        ref = {dtype: mxfp8_mm(c, sx, w, sw, dtype) for dtype in (torch.bfloat16, torch.float32)}
        for cfg in CONFIGS:
            plan = F.GluonExactFMA(w, sw, config=cfg)
            for m in (1, 2, 3, 4):
                for dtype in (torch.bfloat16, torch.float32):
                    check_window(plan, c[:m], sx[:m], ref[dtype][:m], 2, (name, kind, cfg, m, dtype))
            again = plan(c[:3], sx[:3])
            assert torch.equal(_bits(again), _bits(ref[torch.bfloat16][:3])), (name, kind, cfg)


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k,config,kind", [
    (1, 96, 512, C(), "quantized"),                                     # one partial 128-row tile
    (3, 160, 384, C(rows_per_thread=1, warps_k=4), "heavy"),            # 5 tiles of 32, 3 slots
    (4, 130, 256, C(rows_per_thread=2, warps_k=2, stages=2), "subnormal"),   # N past a tile
    (2, 600, 128, C(rows_per_thread=2, warps_k=1, stages=2), "uniform"),    # one slot, a partial 256-row tile
    (4, 64, 1024, C(rows_per_thread=1, warps_k=2, stages=8, maxnreg=None), "heavy"),
    (3, 72, 512, C(rows_per_thread=1, lanes_k=4, stages=3), "subnormal"),     # 8-row tiles, N past one
    (1, 48, 384, C(rows_per_thread=2, warps_k=2, lanes_k=2), "heavy"),
])
def test_small_shapes_match_the_reference_on_gpu(m, n, k, config, kind):
    codes, x_scale, weight, w_scale = kind_operands(kind, m, n, k)
    plan = F.GluonExactFMA(weight, w_scale, config=config)
    for dtype in (torch.bfloat16, torch.float32):
        check_window(plan, codes, x_scale, mxfp8_mm(codes, x_scale, weight, w_scale, dtype), 4,
                     (m, n, k, config, dtype))


def _unsplit(config):
    """`config` (one configuration or a per-row dict) with every split 1."""
    if isinstance(config, dict):
        return {rows: dataclasses.replace(c, split=1) for rows, c in config.items()}
    return dataclasses.replace(config, split=1)


# The K split at the TP1 shapes with few weight rows for their K (wo_b 64 steps of 128, fused
# wq_a|wkv 40, the indexer's wq_b 10): 128-, 64- and 32-row tiles and 16-row ones (2 lanes a
# block), 2 to 8 splits, uneven where the splits do not divide the steps (wo_b 3: 22 + 22 + 20;
# fused 3: 14 + 14 + 12; the indexer's 3: 4 + 4 + 2), per-row configurations.
SPLIT_CONFIGS = {
    "wo_b": (C(split=4), {2: C(rows_per_thread=2, stages=6, maxnreg=80, split=8),
                          4: C(rows_per_thread=1, stages=8, maxnreg=80, split=3)}),
    "fused_wqa_wkv": (C(rows_per_thread=2, stages=6, maxnreg=80, split=5),
                      {1: C(rows_per_thread=1, stages=8, maxnreg=80, split=8),
                       4: C(rows_per_thread=1, lanes_k=2, stages=8, maxnreg=80, split=3)}),
    "wq_b_tp8": (C(rows_per_thread=1, stages=8, maxnreg=80, split=2), C(split=3)),
}
SPLIT_SHAPES = [s for s in FLASH_SHAPES if s[0] in SPLIT_CONFIGS]


@pytest.mark.gpu
@pytest.mark.parametrize("name,n,k", SPLIT_SHAPES, ids=[s[0].replace("wq_b_tp8", "idx_wq_b") for s in SPLIT_SHAPES])
def test_k_split_matches_the_reference_and_the_unsplit_kernel_on_gpu(name, n, k):
    # Bitwise `reference.linear.mxfp8_mm` and the same configuration without the split at 1-4
    # rows on heavy-tailed codes (448 down to the subnormals, both operands; scales of
    # 2^-7..2^6) and model-like ones, BF16 and FP32 out (out a window of a poisoned buffer:
    # rows and columns past the call untouched), each call twice (the counters reset by the
    # last arriver); then a CUDA graph of a split call replayed twice on new codes.
    gen = torch.Generator(device=DEVICE).manual_seed(n + k + 1)
    _, _, codes, x_scale, weight, w_scale = linear_operands(_gen(n + k + 1), 4, n, k)
    heavy = (heavy_e4m3((4, k), gen), torch.randint(120, 134, (4, k // 32), dtype=torch.uint8, device=DEVICE),
             heavy_e4m3((n, k), gen), w_scale)
    for kind, (c, sx, w, sw) in (("heavy", heavy), ("quantized", (codes, x_scale, weight, w_scale))):
        ref = {dtype: mxfp8_mm(c, sx, w, sw, dtype) for dtype in (torch.bfloat16, torch.float32)}
        for cfg in SPLIT_CONFIGS[name]:
            plan, unsplit = F.GluonExactFMA(w, sw, config=cfg), F.GluonExactFMA(w, sw, config=_unsplit(cfg))
            assert all(plan.split_of(plan.config_for(m)) > 1 for m in (1, 2, 3, 4)), cfg
            for m in (1, 2, 3, 4):
                for dtype in (torch.bfloat16, torch.float32):
                    y = check_window(plan, c[:m], sx[:m], ref[dtype][:m], 2, (name, kind, cfg, m, dtype))
                    assert torch.equal(_bits(y), _bits(unsplit(c[:m], sx[:m], _poisoned(m, n, dtype)))), (
                        name, kind, cfg, m, dtype)
                    again = plan(c[:m], sx[:m], _poisoned(m, n, dtype))
                    assert torch.equal(_bits(again), _bits(y)), (name, kind, cfg, m, dtype)
            assert int(plan._counters.abs().sum()) == 0, (name, kind, cfg)
    # A CUDA graph of a 3-row split call (the 4-row bucket), replayed twice on new codes and scales:
    # the counters are back at 0 after each replay, no memset between.
    cfg = SPLIT_CONFIGS[name][0]
    plan = F.GluonExactFMA(weight, w_scale, config=cfg)
    xc, xs = codes[:3].clone(), x_scale[:3].clone()
    out = torch.empty(3, n, dtype=torch.bfloat16, device=DEVICE)
    plan(xc, xs, out)                                       # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        plan(xc, xs, out)
    for seed in (5, 6):
        g = torch.Generator(device=DEVICE).manual_seed(seed)
        xc.copy_(heavy_e4m3((3, k), g))
        xs.copy_(torch.randint(120, 134, (3, k // 32), dtype=torch.uint8, device=DEVICE, generator=g))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(_bits(out), _bits(mxfp8_mm(xc, xs, weight, w_scale))), (name, cfg, seed)
        assert int(plan._counters.abs().sum()) == 0, (name, cfg, seed)


@pytest.mark.gpu
def test_bad_call_arguments_name_the_argument_on_gpu():
    m, n, k = 2, 64, 128
    _, _, codes, x_scale, weight, w_scale = linear_operands(_gen(8), m, n, k)
    plan = F.GluonExactFMA(weight, w_scale, max_rows=2)
    raises("codes has M=3 rows; this plan takes 1..2", lambda: plan(codes.repeat(2, 1)[:3], x_scale.repeat(2, 1)[:3]))
    raises("codes must have dtype", lambda: plan(codes.float(), x_scale))
    raises("x_scale must have shape", lambda: plan(codes, x_scale[:, :2]))
    raises("out must have dtype", lambda: plan(codes, x_scale, torch.empty(m, n, dtype=torch.float16, device=DEVICE)))
    check_tma_alignment_errors(F.GluonExactFMA, plan, codes, x_scale, weight, w_scale)


@pytest.mark.gpu
def test_rope_epilogue_at_wq_b_on_gpu():
    # The query-RoPE epilogue at wq_b's shape, where the step's exact path runs GluonExactFMA at 1-2
    # rows (`exact_linear._FMA_PLAN`): the plan's configuration and the same with the K split (3
    # programs a tile, 4 + 4 + 2 steps; the last arriver rotates) at 1-4 rows (every row bucket),
    # on model-like and heavy-tailed codes: bitwise ExactMM's call followed by `query_rope_`.
    n, k = 32768, 1280
    planned = _FMA_PLAN[(n, k)][2]
    gen = torch.Generator(device=DEVICE).manual_seed(n + k + 3)
    _, _, codes, x_scale, weight, w_scale = linear_operands(_gen(n + k + 3), 4, n, k)
    heavy = (heavy_e4m3((4, k), gen), torch.randint(120, 134, (4, k // 32), dtype=torch.uint8, device=DEVICE),
             heavy_e4m3((n, k), gen), w_scale)
    cos, sin = rope_operands(_gen(18), 4)
    for kind, (c, sx, w, sw) in (("quantized", (codes, x_scale, weight, w_scale)), ("heavy", heavy)):
        plain = ExactMM(w, sw)(c, sx)
        for cfg in (planned, dataclasses.replace(planned, split=3)):
            plan = F.GluonExactFMA(w, sw, config=cfg)
            assert plan.split_of(cfg) == cfg.split
            for m in (1, 2, 3, 4):
                check_rope(plan, c[:m], sx[:m], cos[:m], sin[:m], plain[:m], (kind, cfg, m))
            assert int(plan._counters.abs().sum()) == 0, (kind, cfg)
