"""ops.gluon_sparse_mla_plan, the Gluon sparse MLA's step configurations and plans (sm_90 only).

On the CPU: `GluonSparseMlaPlan.for_step` builds one plan per `STEP_CONFIGS` bucket of the heads'
block_h with its configuration, the plans share the step's pool, and the decode step takes the
Triton plans off sm_90. On the GPU (`-m gpu`): the step's plan of every row and head count against
the reference (the tolerances of tests/ops/test_sparse_mla.py, derived in its module doc) and run to
run, the Gluon plans on sm_90 giving the default configuration's bits at every bucket, the step's
configurations giving the separate kernel's bits.
"""

import pytest
import torch

from dsv41_decode.ops import gluon_sparse_mla as G
from dsv41_decode.ops.sparse_mla import SparseMlaPlan
from test_gluon_sparse_mla import (PV64RING3K2T, PVRING4K2T, SPLIT2SVLC, SPLIT4SVL, SPREADVLC, run, step_plan,
                                   workspace_is_clear)
from test_sparse_mla import GPU_POOLS, check_repeatable_on_gpu, gpu_tables, make_case, ulps


@pytest.mark.gpu
@pytest.mark.parametrize("h", [8, 16, 32, 64])
@pytest.mark.parametrize("n", [1, 2, 4, 16, 32, 64])
def test_gpu_step_plans_against_the_reference(h, n):
    # the step's plan for n rows (STEP_CONFIGS: split4svl at 1-2, split2svlc at 3-4, spreadvlc at
    # 5-16 and at 8-16 heads above, at 32 and 64 heads the ring's pv at 32 (its first launch with
    # two key buffers) and 64), window
    # + compressed keys (V4.1-Flash: 128 + 512, 5 % of the top-k entries -1; windows full, ending
    # inside a block, a single key): exact-score bits, the random-input bound, two launches give the
    # same bits, the workspace is clear after each
    check_repeatable_on_gpu(step_plan(n, h), n, h, h * 1000 + n, run, workspace_is_clear)


def test_the_steps_plan_choice_off_sm90(monkeypatch):
    # the decode step's sparse MLA plans (decode.attention.sparse_mla_plans): in the interpreter one
    # unsplit Triton plan; on another GPU the Triton step tilings (here the CPU standing in for one);
    # sparse_mla_launch runs the Triton launcher for them and the Gluon launcher for a Gluon plan
    from dsv41_decode.decode import attention
    (plan,) = attention.sparse_mla_plans(4, 64, 128, 512, torch.device("cpu"))
    assert type(plan) is SparseMlaPlan and not plan.split
    monkeypatch.setattr(attention, "_few_programs", lambda device: False)
    plans = attention.sparse_mla_plans(64, 64, 128, 512, torch.device("cpu"))
    assert [p.max_rows for p in plans] == [p.max_rows for p in SparseMlaPlan.for_step(64, 64, 128, 512, "cpu")]
    assert all(type(p) is SparseMlaPlan for p in plans)
    calls = []
    monkeypatch.setattr(attention, "sparse_mla_", lambda plan, *a: calls.append(("triton", plan)))
    monkeypatch.setattr(attention, "gluon_sparse_mla_", lambda plan, *a: calls.append(("gluon", plan)))
    gplan = G.GluonSparseMlaPlan.build(4, 64, 128, 512, "cpu")
    attention.sparse_mla_launch(plans[0], 1, 2)
    attention.sparse_mla_launch(gplan, 1, 2)
    assert calls == [("triton", plans[0]), ("gluon", gplan)]


def test_the_step_configs_per_row_count():
    # GluonSparseMlaPlan.for_step: one plan per STEP_CONFIGS bucket of the heads' block_h holding
    # some of the rows, ascending, the last one's max_rows the step's: at every head count 1-2 rows
    # dim_split 4 + spread, 3-4 dim_split 2 + spread with maxnreg 128; at 8-16 heads spread with
    # maxnreg 128 above; at 64 heads that at 5-12 rows, above P.V and the combination in a second
    # launch after a first launch of two key buffers at a cap of 80 with q copied by TMA, at 13-16
    # rows on 64-dim slices through a 3-slot ring at a cap of 80, above on 128-dim slices through a
    # 4-slot ring; at 32 heads spread at 5-26 and 33-52 rows, the 128-dim ring at 27-32 and 53-64;
    # with a pool the plans share its views (each workspace the largest plan's, not
    # their sum)
    from dsv41_decode.decode.buffers import Workspaces
    split4svl = G.GluonSparseMlaConfig(dim_split=4, combine="spread", lookback="values", fp4_lut=True)
    split2svlc = G.GluonSparseMlaConfig(dim_split=2, combine="spread", lookback="values", fp4_lut=True, maxnreg=128)
    spreadvlc = G.GluonSparseMlaConfig(combine="spread", lookback="values", fp4_lut=True, maxnreg=128)
    pv_ring_k2_tma = G.GluonSparseMlaConfig(combine="pv", fp4_lut=True, maxnreg=80, pv_stages=4, k_buffers=2,
                                            q_tma=True)
    pv64_ring3_k2_tma = G.GluonSparseMlaConfig(combine="pv", fp4_lut=True, maxnreg=80, k_buffers=2, q_tma=True,
                                               pv_dims=64, pv_maxnreg=80, pv_stages=3)
    assert (SPLIT4SVL, SPLIT2SVLC, SPREADVLC) == (split4svl, split2svlc, spreadvlc)
    low = ((1, [1]), (2, [2]), (3, [2, 3]), (4, [2, 4]))
    cases = {
        64: (low + ((8, [2, 4, 8]), (12, [2, 4, 12]), (13, [2, 4, 12, 13]), (16, [2, 4, 12, 16]),
                     (17, [2, 4, 12, 16, 17]), (32, [2, 4, 12, 16, 32]), (64, [2, 4, 12, 16, 64])),
             [split4svl, split2svlc, spreadvlc, pv64_ring3_k2_tma, pv_ring_k2_tma]),
        32: (low + ((16, [2, 4, 16]), (26, [2, 4, 26]), (27, [2, 4, 26, 27]), (32, [2, 4, 26, 32]),
                     (33, [2, 4, 26, 32, 33]), (52, [2, 4, 26, 32, 52]), (53, [2, 4, 26, 32, 52, 53]),
                     (64, [2, 4, 26, 32, 52, 64])),
             [split4svl, split2svlc, spreadvlc, pv_ring_k2_tma, spreadvlc, pv_ring_k2_tma]),
        16: (low + ((16, [2, 4, 16]), (64, [2, 4, 64])), [split4svl, split2svlc, spreadvlc]),
        8: (low + ((64, [2, 4, 64]), ), [split4svl, split2svlc, spreadvlc]),
    }
    for heads, (rows, configs) in cases.items():
        for max_rows, buckets in rows:
            plans = G.GluonSparseMlaPlan.for_step(max_rows, heads, 128, 512, "cpu")
            assert [p.max_rows for p in plans] == buckets, (heads, max_rows)
            assert [p.config for p in plans] == configs[:len(buckets)], (heads, max_rows)
    with pytest.raises(ValueError, match="heads must be one of"):
        G.GluonSparseMlaPlan.for_step(4, 12, 128, 512, "cpu")
    pool = Workspaces("cpu")
    plans = G.GluonSparseMlaPlan.for_step(64, 64, 128, 512, "cpu", workspace=pool)
    for name in ("part_acc", "flags", "ticket"):
        assert len({getattr(p.base, name).untyped_storage().data_ptr() for p in plans}) == 1, name
    assert len({p.counters.untyped_storage().data_ptr() for p in plans}) == 1
    views = [lambda p, n=n: getattr(p.base, n) for n in ("part_acc", "part_ml", "block_max", "flags", "counters",
                                                          "ticket")] + [lambda p: p.counters, lambda p: p.board]
    assert pool.memory_bytes() == sum(max(v(p).nbytes for p in plans) for v in views)


def test_the_spread_residency_is_per_specialization():
    # the spread combination runs only where its compiled kernel's programs all fit the SMs at once,
    # and Triton compiles a kernel per specialization of the arguments (split4svl at 64 heads: 128
    # registers with the row count 1, 137 without, sm_90: two programs an SM against one), so the
    # plan's residency is keyed by specialization_key: row count 1, 2-15, 16, beyond int32 and
    # int64, a tensor's 16-byte alignment and dtype each give their own key, bools apart from ints
    x = torch.zeros(8, dtype=torch.int16)
    key = lambda n, t=x: G.specialization_key((t, n, 0.5))
    assert key(1) != key(2) == key(3) == key(15) != key(16) == key(32) != key(2**31) != key(2**63)
    assert key(2, x[1:]) != key(2) != key(2, x.view(torch.bfloat16))
    assert key(True) != key(1) and key(False) != key(0) and key(None) != key(0.5)


@pytest.mark.gpu
def test_gpu_the_steps_plan_choice_on_sm90():
    # on sm_90 the step takes the Gluon plans of STEP_CONFIGS (every configuration the same bits:
    # batch invariance holds across the buckets), their workspaces from the step's pool; a launch
    # of each bucket's rows gives the default's bits; with fp32_dots the Triton FP32 plan
    from dsv41_decode.decode import attention
    from dsv41_decode.decode.buffers import Workspaces
    from dsv41_decode.ops.common import is_sm90
    dev = torch.device("cuda")
    if not is_sm90(dev):
        pytest.skip("the Gluon sparse MLA is sm_90 code")
    pool = Workspaces(dev)
    plans = attention.sparse_mla_plans(64, 64, 128, 512, dev, workspace=pool)
    assert all(isinstance(p, G.GluonSparseMlaPlan) for p in plans)
    assert [(p.max_rows, p.config) for p in plans] == [(2, SPLIT4SVL), (4, SPLIT2SVLC), (12, SPREADVLC),
                                                       (16, PV64RING3K2T), (64, PVRING4K2T)]
    assert all(p.base.part_acc.untyped_storage().data_ptr() in pool.storages() for p in plans)
    ref = G.GluonSparseMlaPlan.build(64, 64, 128, 512, "cuda")
    for n in (1, 2, 3, 4, 5, 12, 13, 16, 17, 32, 33, 64):
        case = make_case(n, 64, 128, 512, seed=7000 + n, window_fill=gpu_tables(n), **GPU_POOLS)
        plan = next(p for p in plans if n <= p.max_rows)
        assert torch.equal(run(plan, case), run(ref, case)), n
    torch.cuda.synchronize()
    assert all(workspace_is_clear(p) for p in plans)
    (fp32,) = attention.sparse_mla_plans(64, 64, 128, 512, dev, fp32_dots=True)
    assert type(fp32) is SparseMlaPlan and not fp32.bf16_dot


@pytest.mark.gpu
@pytest.mark.parametrize("h", [8, 16, 32, 64])
def test_gpu_step_configs_give_the_separate_kernels_bits(h):
    # at every head count (the spread combination's [heads, dims] steps are per head count) and 1,
    # 2, 4, 16 and 64 rows: the step's configurations against the default's separate launch, bitwise
    w, k = 128, 512
    sep = G.GluonSparseMlaPlan.build(64, h, w, k, "cuda")
    plans = [G.GluonSparseMlaPlan.build(64, h, w, k, "cuda", config=c) for c in (SPLIT4SVL, SPREADVLC)]
    for n in (1, 2, 4, 16, 64):
        case = make_case(n, h, w, k, seed=5000 + h + n, window_fill=gpu_tables(n), **GPU_POOLS)
        a = run(sep, case)
        for plan in plans:
            b = run(plan, case)
            assert torch.equal(a, b), (n, plan.config, int((ulps(a, b) > 0).sum()), int(ulps(a, b).max()))
