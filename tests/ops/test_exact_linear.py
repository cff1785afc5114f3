"""ops.exact_linear.ExactLinear (the step's exact FP8 linear): the op it picks per row count, its
plan table, the argument errors; on the GPU at the V4.1-Flash shapes every row count bitwise equal
to `reference.linear.mxfp8_mm` and to the same row in a call of 64 rows, whichever op ran.

No tolerance anywhere: both ops compute the contract's arithmetic exactly, so any difference from
the reference, or between a row alone and among others, is a bug.
"""

import dataclasses

import pytest
import torch
from helpers import (FLASH_LINEAR_SHAPES, boundary_operands, check_mxfp8_plan_errors, linear_operands, raises,
                     rope_operands)
from _gluon_linear_support import spill_free
from test_exact_mm import _bits, _exact_operands, _gen, check_boundary, check_rope

from dsv41_decode.ops.exact_linear import _FMA_PLAN, _GLUON_PLAN, ExactLinear, takes_pair_slots
from dsv41_decode.ops.exact_mm_plan import ExactConfig
from dsv41_decode.ops.gluon_exact_fma import GluonExactFMAConfig
from dsv41_decode.ops import gluon_exact_mm as E
from dsv41_decode.ops.gluon_exact_mm import GluonExactConfig
from dsv41_decode.reference.linear import mxfp8_mm
from dsv41_decode.testing.sm90 import compile_exact_mm, resources

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
STEP_SHAPES = [("fused_wqa_wkv", 1792, 5120), ("wq_b", 32768, 1280), ("idx_wq_b", 4096, 1280),
               ("wo_b", 5120, 8192)]


def test_plan_covers_the_step_shapes():
    # Every TP1 shape of the step's FP8 linears has a measured entry: a threshold below 64 rows and
    # GluonExactMM configurations covering 64 rows.
    assert {(n, k) for _, n, k in STEP_SHAPES} == set(_GLUON_PLAN)
    assert {(n, k) for name, n, k in FLASH_LINEAR_SHAPES if "_tp" not in name} <= set(_GLUON_PLAN)
    for shape, (above, configs) in _GLUON_PLAN.items():
        assert 0 <= above < 64 and max(configs) >= 64, shape
        assert all(isinstance(c, GluonExactConfig) for c in configs.values()), shape
    # GluonExactFMA's entries: step shapes, 1-4 rows, one configuration each.
    assert set(_FMA_PLAN) <= set(_GLUON_PLAN)
    for shape, (first, last, config) in _FMA_PLAN.items():
        assert 1 <= first <= last <= 4 and isinstance(config, GluonExactFMAConfig), shape


def _plan_launches() -> list[tuple[str, GluonExactConfig, int, int]]:
    """Each distinct (shape, configuration, row bucket, K splits) GluonExactMM launches for the
    step's shapes at 1-64 rows under `_GLUON_PLAN` (the rows above its threshold)."""
    launches = {}
    for name, n, k in STEP_SHAPES:
        above, configs = _GLUON_PLAN[(n, k)]
        for rows in range(above + 1, 65):
            cfg = next(c for r, c in sorted(configs.items()) if rows <= r)
            split = E.split_bounds(cfg.split, k, cfg.block_k)[1] if rows <= E.split_rows(cfg) else 1
            launches[(name, cfg, E.block_t(rows, cfg), split)] = None
    return list(launches)


def _option_launches() -> list[tuple[str, GluonExactConfig, int, int]]:
    """`_plan_launches` as `ExactLinear(fuse_scales=True)` and `ExactLinear(pair_slots=True)` make
    them: every launch fused, and the launches whose configuration takes pair_slots paired."""
    k_of = {name: k for name, _, k in STEP_SHAPES}
    return ([(n, dataclasses.replace(c, fuse_scales=True), bt, s) for n, c, bt, s in _plan_launches()]
            + [(n, dataclasses.replace(c, pair_slots=True), bt, s) for n, c, bt, s in _plan_launches()
               if takes_pair_slots(c, k_of[n])])


PLAN_LAUNCHES = _plan_launches()
OPTION_LAUNCHES = _option_launches()
# the fused scaling's one launch with spills: `wq_b`'s 64 x 32 on wgmma at its cap of 80 (docs/gemm.md)
FUSED_STACK = {"f16w:64:32:1:32:4:1:80:1:128:1:0": 40}


@pytest.mark.parametrize("name,config,bt,split", PLAN_LAUNCHES + OPTION_LAUNCHES,
                         ids=[f"{n}-{c.convert}-n{c.block_n}-m{c.block_m}-wk{c.warps_k}-bk{c.block_k}-bt{bt}-s{s}"
                              + ("-fused" if c.fuse_scales else "") + ("-pairs" if c.pair_slots else "")
                              for n, c, bt, s in PLAN_LAUNCHES + OPTION_LAUNCHES])
def test_plan_compiles_for_sm90_without_spills(name, config, bt, split):
    # Every launch the plan makes at the step's shapes, and with each of ExactLinear's options,
    # compiles for sm_90 (on the CPU) within its register cap and shared memory, with no local
    # memory (`spill_free`): the plan names only configurations the hardware runs as measured.
    kernel = compile_exact_mm(config, bt, split)
    if config.spec in FUSED_STACK:
        res = resources(kernel)
        assert 0 < res["STACK"] <= FUSED_STACK[config.spec] and res["REG"] <= config.maxnreg, res
        return
    spill_free(kernel, config.maxnreg or 255, E.shared_bytes(config, bt))


def _as_on_sm90(monkeypatch, full_fp64: bool) -> None:
    """ExactLinear's plan built as on an sm_90 GPU whose FP64 runs at full rate or not (the device
    checks forced: construction only, nothing may run)."""
    from dsv41_decode.ops import exact_linear, gluon_ring
    monkeypatch.setattr(exact_linear, "is_sm90", lambda device: True)
    monkeypatch.setattr(gluon_ring, "is_sm90", lambda device: True)
    monkeypatch.setattr(exact_linear, "full_rate_fp64", lambda device: full_fp64)


def test_options_reach_a_listed_shapes_configurations(monkeypatch):
    # ExactLinear's options on a shape the plan lists (here one patched in, the device checks
    # forced: construction only, nothing runs): fuse_scales on every GluonExactMM configuration,
    # pair_slots on those `takes_pair_slots` takes (along K, K a multiple of two slots), neither
    # without the option; the ops and thresholds unchanged.
    _as_on_sm90(monkeypatch, full_fp64=True)
    n, k = 256, 1024
    plan = {8: GluonExactConfig.from_spec("f16d:16:8:1:32:4:1:80:4:256"),
            16: GluonExactConfig.from_spec("f16d:16:16:1:32:4:1:80:4:256"), 64: GluonExactConfig.from_spec("f16d:128:16:1:32:4:1")}
    monkeypatch.setitem(_GLUON_PLAN, (n, k), (2, plan))
    _, _, _, _, weight, w_scale = linear_operands(_gen(29), 1, n, k)
    for options in ({}, {"fuse_scales": True}, {"pair_slots": True}):
        linear = ExactLinear(weight, w_scale, **options)
        assert linear.mma is not None and linear.mma_above == 2, options
        configs = [c for _, c in linear.mma._configs]
        assert [dataclasses.replace(c, fuse_scales=False, pair_slots=False) for c in configs] == list(plan.values())
        assert [c.fuse_scales for c in configs] == [bool(options.get("fuse_scales"))] * 3, options
        assert [c.pair_slots for c in configs] == ([True, True, False] if options.get("pair_slots") else [False] * 3)


def test_pair_slots_take_the_plans_entries_along_k_that_fit():
    # `takes_pair_slots`: the plan's entries with the warps along K whose K holds whole pairs of slots
    # (wo_b's and the fused wq_a|wkv's 256-deep ones, the 128-deep ones), not the indexer's 256-deep
    # ones at K 1280, not the entries along the weight rows (wq_b, which spills with it, and the
    # 33-64-row ones of the fused wq_a|wkv and the indexer's wq_b), not a K split
    taken = {(name, rows): takes_pair_slots(c, k) for name, n, k in STEP_SHAPES
             for rows, c in _GLUON_PLAN[(n, k)][1].items()}
    assert taken == {("fused_wqa_wkv", 16): True, ("fused_wqa_wkv", 32): True, ("fused_wqa_wkv", 64): False,
                     ("wq_b", 16): False, ("wq_b", 64): False,
                     ("idx_wq_b", 16): False, ("idx_wq_b", 32): True, ("idx_wq_b", 64): False,
                     ("wo_b", 8): True, ("wo_b", 32): True, ("wo_b", 64): True}, taken
    assert not takes_pair_slots(GluonExactConfig(convert="f16d", warps_k=4, block_n=16, split=2), 8192)
    assert not takes_pair_slots(GluonExactConfig(convert="f16d", warps_k=4, block_n=16, stages=3), 8192)


def test_off_sm90_only_the_cuda_core_op():
    # Where the Gluon tier cannot build (the CPU here; any GPU but sm_90) every call runs ExactMM,
    # even with the threshold forced to 0 and GluonExactFMA asked for, and gives the reference's
    # bits.
    m, n, k = 3, 40, 128
    codes, x_scale, weight, w_scale = _exact_operands(_gen(5), m, n, k, "heavy")
    if DEVICE == "cuda" and torch.cuda.get_device_capability() == (9, 0):
        pytest.skip("an sm_90 GPU builds the FP64 MMA op")
    plan = ExactLinear(weight, w_scale, max_rows=8, mma_above=0, fma_rows=2)
    assert plan.mma is None and plan.mma_above is None and plan.fma is None and plan.fma_rows == (1, 0)
    assert all(plan.op_for(r) is plan.cuda_cores for r in (1, 8))
    assert torch.equal(_bits(plan(codes, x_scale)), _bits(mxfp8_mm(codes, x_scale, weight, w_scale)))
    assert plan.reduction_order(1) == plan.reduction_order(8)


def test_bad_inputs_name_the_argument():
    m, n, k = 2, 64, 128
    _, _, codes, x_scale, weight, w_scale = linear_operands(_gen(8), m, n, k)
    check_mxfp8_plan_errors(ExactLinear, codes, x_scale, weight, w_scale)
    raises("codes must be a 2-D", lambda: ExactLinear(weight, w_scale, 8)("x", x_scale))


def test_bad_plan_options_name_the_option():
    _, _, _, _, weight, w_scale = linear_operands(_gen(8), 2, 64, 128)
    raises("mma_above must be a non-negative int, got 2.0", lambda: ExactLinear(weight, w_scale, 8, mma_above=2.0))
    raises("mma_above must be a non-negative int, got -1", lambda: ExactLinear(weight, w_scale, 8, mma_above=-1))
    raises("fma_rows must be a non-negative int, got '2'", lambda: ExactLinear(weight, w_scale, 8, fma_rows="2"))
    raises("fuse_scales must be a bool, got 'yes'", lambda: ExactLinear(weight, w_scale, 8, fuse_scales="yes"))
    raises("pair_slots must be a bool, got 1", lambda: ExactLinear(weight, w_scale, 8, pair_slots=1))


def test_rope_reaches_the_op():
    # rope=(cos, sin) goes to the op that runs (here ExactMM, one program): the call without it
    # followed by `query_rope_`; its argument errors name the argument.
    m, n, k = 3, 512, 128
    _, _, codes, x_scale, weight, w_scale = linear_operands(_gen(9), m, n, k)
    cos, sin = rope_operands(_gen(10), m)
    plan = ExactLinear(weight, w_scale, max_rows=4, exact_config=ExactConfig(block_n=512, block_k=128))
    check_rope(plan, codes, x_scale, cos, sin, plan(codes, x_scale), "ExactLinear")
    raises("cos must have shape", lambda: plan(codes, x_scale, rope=(cos[:1], sin)))


class _OtherOp:
    """Stands in for an op without the boundary epilogue (GluonExactFMA, GluonExactMM) on the CPU."""


def test_boundary_reaches_exact_mm_only():
    # boundary= goes to ExactMM (here one program a row pass): the call without it followed by
    # mhc_boundary_; a call whose op is another one raises, naming the argument, before any launch.
    m, n, k = 2, 256, 128
    _, _, codes, x_scale, weight, w_scale = linear_operands(_gen(11), m, n, k)
    plan = ExactLinear(weight, w_scale, max_rows=4, exact_config=ExactConfig(block_n=256, block_k=128))
    assert plan.takes_boundary(1) and plan.takes_boundary(2)
    check_boundary(plan, codes, x_scale, boundary_operands(_gen(12), m, n, 256), plan(codes, x_scale), "ExactLinear")
    plan.mma, plan.mma_above = _OtherOp(), 1
    assert plan.takes_boundary(1) and not plan.takes_boundary(2)
    raises("boundary: a call of 2 rows runs _OtherOp, which has no mHC boundary epilogue",
           lambda: plan(codes, x_scale, boundary=boundary_operands(_gen(12), m, n, 256)))


@pytest.mark.parametrize("full_fp64", [True, False])
def test_an_unlisted_shape_takes_the_same_ops_with_the_options(monkeypatch, full_fp64):
    # The plan's choice of ops on sm_90 (the device checks forced: construction only, nothing runs)
    # for a shape `_GLUON_PLAN` does not list (a TP shard): GluonExactMM's default configuration from
    # 5 rows where FP64 runs at full rate, ExactMM throughout where it does not; fuse_scales and
    # pair_slots change GluonExactMM's configurations, never which op runs.
    _as_on_sm90(monkeypatch, full_fp64)
    _, _, _, _, weight, w_scale = linear_operands(_gen(23), 1, 256, 512)
    for options in ({}, {"fuse_scales": True}, {"pair_slots": True}, {"fuse_scales": True, "pair_slots": True}):
        linear = ExactLinear(weight, w_scale, max_rows=16, **options)
        assert linear.fma is None, options
        if full_fp64:
            assert linear.mma is not None and linear.mma_above == 4, options
            assert linear.mma.config_for(16).fuse_scales == bool(options.get("fuse_scales")), options
        else:
            assert linear.mma is None and linear.op_for(16) is linear.cuda_cores, options


@pytest.mark.gpu
def test_no_fp64_forms_where_fp64_is_slow_on_gpu(monkeypatch):
    # On a GPU whose FP64 runs at 1/32-1/64 of its FP32 rate (`common.full_rate_fp64` False, forced
    # here) the plans take no FP64 form: no GluonExactFMA at wq_b, ExactMM's measured FP32
    # configurations where it has FP64 ones, GluonExactMM on its measured FP16-digit plans only; the
    # bits stay the reference's.
    from dsv41_decode.ops import exact_linear, exact_mm
    monkeypatch.setattr(exact_linear, "full_rate_fp64", lambda device: False)
    monkeypatch.setattr(exact_mm, "full_rate_fp64", lambda device: False)
    for n, k in ((32768, 1280), (5120, 8192)):
        _, _, codes, x_scale, weight, w_scale = linear_operands(_gen(n + k + 9), 2, n, k)
        linear = ExactLinear(weight, w_scale)
        assert linear.fma is None and linear.fma_rows == (1, 0), (n, k)
        assert not any(linear.cuda_cores.launch_for(m).config.f64 for m in (1, 2)), (n, k)
        assert linear.mma is not None and linear.mma_above == _GLUON_PLAN[(n, k)][0], (n, k)   # FP16 digits
        for m in (1, 2):
            want = mxfp8_mm(codes[:m], x_scale[:m], weight, w_scale)
            assert torch.equal(_bits(linear(codes[:m], x_scale[:m])), _bits(want)), (n, k, m)
    # a TP shard (no measured plan: GluonExactMM's default is the FP64 MMA) keeps ExactMM throughout
    _, _, codes, x_scale, weight, w_scale = linear_operands(_gen(17), 8, 5120, 1024)
    linear = ExactLinear(weight, w_scale, max_rows=8)
    assert linear.mma is None and linear.op_for(8) is linear.cuda_cores
    assert torch.equal(_bits(linear(codes, x_scale)), _bits(mxfp8_mm(codes, x_scale, weight, w_scale)))


@pytest.mark.gpu
def test_boundary_epilogue_at_wo_b_on_gpu():
    # The step's wo_b call with the boundary (`DecodeStep(fold_boundary=True)`: 1-2 rows on sm_90,
    # ExactMM), the plan's chunks of 512 columns at dim 5120: bitwise the call without it followed
    # by mhc_boundary_, twice (the counters reset); at 3 rows and more GluonExactMM runs, which does
    # not take it.
    n, k = 5120, 8192
    _, _, codes, x_scale, weight, w_scale = linear_operands(_gen(n + k + 6), 2, n, k)
    linear = ExactLinear(weight, w_scale)
    for m in (1, 2):
        assert linear.takes_boundary(m)
        plain = linear(codes[:m], x_scale[:m])
        ops = boundary_operands(_gen(21), m, n)
        for seed in (21, 22):
            ops = dataclasses.replace(boundary_operands(_gen(seed), m, n), plan=ops.plan)
            check_boundary(linear, codes[:m], x_scale[:m], ops, plain, ("wo_b", m, seed))
    if torch.cuda.get_device_capability() == (9, 0):
        assert not any(linear.takes_boundary(m) for m in (3, 8, 64))


@pytest.mark.gpu
@pytest.mark.parametrize("name,n,k", STEP_SHAPES, ids=[s[0] for s in STEP_SHAPES])
def test_step_shapes_on_gpu(name, n, k):
    # On an sm_90 GPU: GluonExactFMA up to its plan's rows, ExactMM up to the plan's threshold,
    # GluonExactMM above, in the plans' configurations; each row count alone, launched plainly and
    # by PDL, gives the bits of the reference and of the same rows in a call of 64 (batch invariance
    # across both switches), on model-like and heavy-tailed codes.
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("GluonExactMM is sm_90 code")
    above, configs = _GLUON_PLAN[(n, k)]
    fma_lo, fma_hi, fma_config = _FMA_PLAN.get((n, k), (1, 0, None))
    for kind in ("quantized", "heavy"):
        if kind == "quantized":
            _, _, codes, x_scale, weight, w_scale = linear_operands(_gen(n + k), 64, n, k)
        else:
            codes, x_scale, weight, w_scale = _exact_operands(_gen(n), 64, n, k, "heavy")
        linear = ExactLinear(weight, w_scale)
        assert linear.mma is not None and linear.mma_above == above and linear.fma_rows == (fma_lo, fma_hi)
        for m in (1, 2, 3, 4, 5, 8, 64):
            want = (linear.fma if fma_lo <= m <= fma_hi else linear.mma if m > above else linear.cuda_cores)
            assert linear.op_for(m) is want, (name, m)
        for m in (max(above, fma_hi) + 1, 64):
            assert linear.mma.config_for(m) == next(c for r, c in sorted(configs.items()) if m <= r)
        rows = sorted({1, 2, 3, above, above + 1, 8, 16, 17, 32, 33})
        # every configuration of the plan runs alone at some row count below
        assert {linear.mma.config_for(m).spec for m in rows if m > above} == {c.spec for c in configs.values()}
        if fma_hi:
            assert linear.fma.config_for(fma_hi) == fma_config
        together = linear(codes, x_scale)
        assert torch.equal(_bits(together), _bits(mxfp8_mm(codes, x_scale, weight, w_scale))), (name, kind)
        for m in rows:
            alone = linear(codes[:m], x_scale[:m])
            assert torch.equal(_bits(alone), _bits(together[:m])), (name, kind, m)
            # the launch by programmatic dependent launch (the step's wq_b_pdl / qkv_pdl / wo_b_pdl):
            # its prefilled ring gives the same bits
            early = linear(codes[:m], x_scale[:m], pdl=True)
            assert torch.equal(_bits(early), _bits(together[:m])), (name, kind, m, "pdl")


WQ_B_SHAPES = [s for s in FLASH_LINEAR_SHAPES if s[0].startswith("wq_b")]


@pytest.mark.gpu
@pytest.mark.parametrize("name,n,k", WQ_B_SHAPES, ids=[s[0] for s in WQ_B_SHAPES])
def test_rope_epilogue_on_gpu(name, n, k):
    # The step's wq_b call (`decode.attention`: rope=(cos, sin) on every path) at wq_b and its TP
    # shards, every row count 1-64, whichever op the plan runs (on sm_90 at wq_b: GluonExactFMA at
    # 1-2 rows, GluonExactMM above; at the shards ExactMM up to 4 rows): bitwise the call without it
    # followed by `query_rope_`. One plain call of 64 rows serves (batch invariance:
    # test_step_shapes_on_gpu).
    _, _, codes, x_scale, weight, w_scale = linear_operands(_gen(n + k + 5), 64, n, k)
    cos, sin = rope_operands(_gen(20), 64)
    linear = ExactLinear(weight, w_scale)
    plain = linear(codes, x_scale)
    for m in range(1, 65):
        check_rope(linear, codes[:m], x_scale[:m], cos[:m], sin[:m], plain[:m],
                   (name, m, type(linear.op_for(m)).__name__))


@pytest.mark.parametrize("op,spec,bt", [("fma", "2:2:1:4", 1), ("mm", "f16d:128:16:1:32:4:1", 16),
                                        ("mm", "f16w:64:32:1:32:4:1:80", 64), ("mm", "f16d:16:8:1:32:4:1:80:4:256", 8),
                                        ("mm", "f16d:16:16:1:32:4:1:80:4:256:0:1", 8),
                                        ("mm", "f16d:32:16:1:32:4:1:80:4:128:1:1", 64)],
                         ids=["fma-1-2-rows", "f16d-3-16-rows", "f16w-17-64-rows", "fused-along-k-3-16-rows",
                              "wo_b-pairs-3-8-rows", "wo_b-pairs-33-64-rows"])
def test_pdl_launch_prefills_the_weight_before_its_wait(op, spec, bt):
    """`ExactLinear(..., pdl=True)` (the step's `wq_b_pdl`, `qkv_pdl` and `wo_b_pdl`), compiled for
    sm_90 in wq_b's plan configurations with the RoPE epilogue, in the fused wq_a|wkv's along K at
    3-16 rows and in wo_b's with two ring slots a wait (the kernel's three consumer branches, the
    pair producer, and GluonExactFMA): before the program's griddepcontrol.wait (SASS ACQBULK; the
    producer warp waits again) only the ring's first weight tiles (one predicated copy a slot) and
    no other global access (`testing.sm90.pdl_prologue`), no new local memory; without pdl no wait."""
    from dsv41_decode.ops import exact_linear as EL, gluon_exact_fma as F, gluon_exact_mm as E
    from dsv41_decode.testing import sm90
    kernels = {}
    for pdl in (False, True):
        rope = sm90.rope_epilogue(True)
        consts = {**rope["consts"], "PDL": pdl}
        if op == "fma":
            cfg = EL._fma_cfg(spec)
            kernels[pdl] = sm90.compile_linear(F._gluon_exact_fma_kernel, F.launch_options(cfg, 1), [cfg.block_n, F.BLOCK_K],
                                               [bt, F.BLOCK_K], False, rope["types"], consts)
        else:
            cfg = EL._cfg(spec)
            kernels[pdl] = sm90.compile_linear(E._gluon_exact_mm_kernel, E.launch_options(cfg, bt, 1),
                                               [cfg.block_n, cfg.block_k], [bt, cfg.block_k], False, rope["types"], consts)
    assert "griddepcontrol" not in kernels[False].asm["ptx"]
    copies, other = sm90.pdl_prologue(kernels[True].asm["ptx"])
    assert copies == cfg.stages and other == [], (copies, other)
    # the program's wait and the producer warp's own
    ops = sm90.opcode_counts([t for _, t in sm90.sass(kernels[True])])
    assert ops.get("ACQBULK", 0) == 2, ops
    plain, pdl = sm90.resources(kernels[False]), sm90.resources(kernels[True])
    assert pdl["LOCAL"] == plain["LOCAL"] == 0 and pdl["STACK"] <= plain["STACK"] + 16, (plain, pdl)


def test_pdl_prologue_sees_a_dependent_access_before_the_wait():
    """`testing.sm90.pdl_prologue`, the check of the PDL compile tests, names a global load before
    griddepcontrol.wait."""
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from dsv41_decode.ops.pdl import gluon_wait
    from dsv41_decode.testing import sm90

    @gluon.jit
    def early(x_ptr, y_ptr):
        lay: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
        v = gl.load(x_ptr + gl.arange(0, 128, layout=lay))
        gluon_wait()
        gl.store(y_ptr + gl.arange(0, 128, layout=lay), v)

    ptx = sm90.compile_sm90(early, {"x_ptr": "*fp32", "y_ptr": "*fp32"}, {}, num_warps=4).asm["ptx"]
    copies, other = sm90.pdl_prologue(ptx)
    assert copies == 0 and other and other[0].startswith("ld.global"), other
