"""Sparse MLA decode against `reference.attention.sparse_attention` fed the same (decoded) keys."""

import math

import pytest
import torch

from dsv41_decode.records import pack_compressed_kv, pack_window_kv, unpack_compressed_kv, unpack_window_kv
from dsv41_decode.ops.sparse_mla import SparseMlaPlan, sparse_mla, sparse_mla_
from dsv41_decode.reference.attention import sparse_attention

D = 512
SCALE = 1.0 / math.sqrt(576)


def make_case(n, h, w, k, *, device="cpu", seed=0, req_slot=None, window_fill=None, comp_valid=0.8,
              sink_inf=False, s_w=None, s_c=None):
    g = torch.Generator().manual_seed(seed)
    s_w = s_w or max(2 * w, 8)
    s_c = s_c or max(2 * k, 8)
    wpool = pack_window_kv(torch.randn(s_w, D, generator=g) * 2.0)
    cpool = pack_compressed_kv(torch.randn(s_c, D, generator=g))
    q = (torch.randn(n, h, D, generator=g) * 0.5).to(torch.bfloat16)
    wt = torch.randint(0, s_w, (n, w), generator=g).to(torch.int32)
    if window_fill is not None:                  # per row: the number of filled (trailing) entries
        for r, f in enumerate(window_fill):
            wt[r, : w - f] = -1
    ct = torch.randint(0, s_c, (n, k), generator=g).to(torch.int32)
    ct[torch.rand(n, k, generator=g) >= comp_valid] = -1
    sink = torch.randn(h, generator=g)
    if sink_inf:
        sink[:] = float("-inf")
    t = (q, wpool, cpool, wt, ct, sink)
    return tuple(x.to(device) for x in t)


def reference(q, wpool, cpool, wt, ct, sink, scale=SCALE):
    """On q's device (the GPU tests' reference runs on the GPU); returned on the CPU."""
    wkeys = unpack_window_kv(wpool)
    ckeys = unpack_compressed_kv(cpool)
    outs = []
    for r in range(q.shape[0]):
        widx, cidx = wt[r].long(), ct[r].long()
        keys = torch.cat((wkeys[widx.clamp(min=0)], ckeys[cidx.clamp(min=0)]))
        valid = torch.cat((widx >= 0, cidx >= 0))
        outs.append(sparse_attention(q[r], keys, valid, sink.float(), scale))
    return torch.stack(outs).cpu()


def check(out, ref):
    out, ref = out.cpu().float(), ref.float()
    assert torch.isfinite(out).all()
    amax = ref.abs().max()
    if amax == 0:
        assert torch.equal(out, ref)
        return
    err = (out - ref).abs().max()
    rms = ((out - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt())
    assert err <= 2e-2 * amax, (float(err), float(amax))
    assert rms <= 5e-3, float(rms)


@pytest.mark.parametrize("n,h,k,splits", [(1, 8, 8, None), (3, 16, 40, 1), (5, 8, 24, 2), (1, 16, 40, None)])
def test_matches_reference(n, h, k, splits):
    w = 16
    case = make_case(n, h, w, k, seed=n * 100 + h + k, window_fill=[w, 5, w, 1, w][:n])
    out = sparse_mla(*case, SCALE, splits=splits, block_keys=16)
    check(out, reference(*case))


def test_several_head_groups():
    # H = 32 in programs of 16 heads: two head groups per row, each with its own split counters.
    n, h, w, k = 2, 32, 16, 8
    case = make_case(n, h, w, k, seed=21)
    plan = SparseMlaPlan.build(n, h, w, k, "cpu", block_h=16, block_keys=16, splits=2)
    assert plan.head_groups == 2 and plan.split(n) == 2
    out = torch.empty(n, h, D, dtype=torch.bfloat16)
    sparse_mla_(plan, *case, SCALE, out)
    check(out, reference(*case))
    assert int(plan.counters.abs().sum()) == 0


def test_draft_rows_and_plan_reuse():
    # Two rows of one request (a draft row one position later: same keys plus one), odd row count,
    # one plan launched at two row counts.
    n, h, w, k = 3, 8, 16, 16
    q, wpool, cpool, wt, ct, sink = make_case(n, h, w, k, seed=7)
    wt[1] = torch.cat((wt[0, 1:], wt[0, -1:] + 1))
    ct[1] = ct[0]
    plan = SparseMlaPlan.build(4, h, w, k, "cpu", block_keys=16)
    out = torch.empty(n, h, D, dtype=torch.bfloat16)
    sparse_mla_(plan, q, wpool, cpool, wt, ct, sink, SCALE, out)
    check(out, reference(q, wpool, cpool, wt, ct, sink))
    out1 = torch.empty(1, h, D, dtype=torch.bfloat16)
    sparse_mla_(plan, q[2:], wpool, cpool, wt[2:], ct[2:], sink, SCALE, out1)
    check(out1, reference(q[2:], wpool, cpool, wt[2:], ct[2:], sink))
    assert int(plan.counters.abs().sum()) == 0


@pytest.mark.parametrize("splits", [1, 3])
def test_edge_cases(splits):
    n, h, w, k = 3, 8, 16, 16
    q, wpool, cpool, wt, ct, sink = make_case(n, h, w, k, seed=11, sink_inf=True)
    wt[0] = -1                       # row 0: nothing valid -> zeros
    ct[0] = -1
    ct[1] = -1                       # row 1: no compressed entries yet
    wt[2, :13] = -1                  # row 2: window not yet full (3 keys)
    out = sparse_mla(q, wpool, cpool, wt, ct, sink, SCALE, splits=splits, block_keys=16)
    assert torch.equal(out[0].float(), torch.zeros(h, D))
    check(out, reference(q, wpool, cpool, wt, ct, sink))


@pytest.mark.parametrize("splits", [2, 3])
def test_separate_combine_matches_reference_and_inline(splits):
    # the splits combined by a second launch (one program per row, head group, dim slice):
    # edge rows included, the same values as the last-arriver combination
    n, h, w, k = 3, 32, 16, 32
    q, wpool, cpool, wt, ct, sink = make_case(n, h, w, k, seed=13, sink_inf=True)
    wt[0] = -1
    ct[0] = -1
    wt[2, :13] = -1
    outs = []
    for sep in (False, True):
        plan = SparseMlaPlan.build(n, h, w, k, "cpu", block_h=16, block_keys=16, splits=splits,
                                   separate_combine=sep)
        assert plan.separate_combine is sep and plan.split(n) == splits
        out = torch.empty(n, h, D, dtype=torch.bfloat16)
        sparse_mla_(plan, q, wpool, cpool, wt, ct, sink, SCALE, out)
        outs.append(out)
        assert int(plan.counters.abs().sum()) == 0
    check(outs[1], reference(q, wpool, cpool, wt, ct, sink))
    assert torch.equal(outs[1][0].float(), torch.zeros(h, D))
    assert (outs[0].float() - outs[1].float()).abs().max() <= 2 ** -7 * outs[0].float().abs().max()
    assert torch.equal(outs[0], outs[1])     # the same arithmetic in the same split order


def test_step_tilings_cover_every_row_count():
    plans = SparseMlaPlan.for_step(64, 64, 16, 16, "cpu")
    assert [p.max_rows for p in plans] == [2, 8, 16, 32, 64]
    assert [p.block_h for p in plans] == [16, 16, 32, 32, 32]
    assert [p.separate_combine for p in plans] == [True, True, True, False, False]
    assert plans[0].block_keys == 32
    assert plans[3].split(32) == 2                     # 4 splits, clipped to the 2 key blocks here
    big = SparseMlaPlan.for_step(32, 64, 128, 512, "cpu")[-1]
    assert (big.max_rows, big.split(17), big.split(32)) == (32, 4, 4)
    shard = SparseMlaPlan.for_step(32, 16, 128, 512, "cpu")[-1]   # TP4: the build rule, 1 head group
    assert shard.split(32) == SparseMlaPlan.build(32, 16, 128, 512, "cpu", block_h=16, num_warps=4).split(32) == 5
    assert [p.max_rows for p in SparseMlaPlan.for_step(4, 8, 16, 16, "cpu")] == [2, 4]
    assert all(p.block_h == 16 for p in SparseMlaPlan.for_step(4, 8, 16, 16, "cpu"))   # 8 heads pad to 16


def test_all_invalid_gives_zeros_with_finite_sink():
    n, h, w, k = 1, 8, 16, 8
    q, wpool, cpool, wt, ct, sink = make_case(n, h, w, k, seed=3)
    wt[:] = -1
    ct[:] = -1
    out = sparse_mla(q, wpool, cpool, wt, ct, sink, SCALE, splits=2, block_keys=16)
    assert torch.equal(out.float(), torch.zeros(n, h, D))


def test_bad_inputs_name_the_argument():
    n, h, w, k = 2, 8, 16, 8
    q, wpool, cpool, wt, ct, sink = make_case(n, h, w, k, seed=1)
    plan = SparseMlaPlan.build(2, h, w, k, "cpu")
    out = torch.empty(n, h, D, dtype=torch.bfloat16)
    args = dict(q=q, window_pool=wpool, comp_pool=cpool, window_table=wt, comp_table=ct, sink=sink,
                scale=SCALE, out=out)
    bad = {
        "q": (q.float(), TypeError),
        "window_pool": (wpool[:, :512], ValueError),
        "comp_pool": (cpool.to(torch.int8), TypeError),
        "window_table": (wt.long(), TypeError),
        "comp_table": (ct[:, :4], ValueError),
        "sink": (sink[:4], ValueError),
        "out": (out.float(), TypeError),
    }
    for name, (value, exc) in bad.items():
        with pytest.raises(exc, match=name):
            sparse_mla_(plan, **{**args, name: value})
    with pytest.raises(ValueError, match="max_rows"):
        sparse_mla_(plan, **{**args, "q": torch.cat((q, q))})
    with pytest.raises(ValueError, match="heads"):
        SparseMlaPlan.build(2, 12, w, k, "cpu")
    with pytest.raises(ValueError, match="max_rows"):
        SparseMlaPlan.build(300, h, w, k, "cpu")
    with pytest.raises(TypeError, match="plan"):
        sparse_mla_(None, **args)


@pytest.mark.gpu
@pytest.mark.parametrize("h", [8, 16, 32, 64])
@pytest.mark.parametrize("n", [1, 16, 64, 256])
def test_gpu_shapes(h, n):
    w, k = 128, 512
    case = make_case(n, h, w, k, device="cuda", seed=h * 1000 + n, comp_valid=0.95, s_w=4096, s_c=8192)
    plan = SparseMlaPlan.build(n, h, w, k, "cuda")
    out = torch.empty(n, h, D, dtype=torch.bfloat16, device="cuda")
    sparse_mla_(plan, *case, SCALE, out)
    sparse_mla_(plan, *case, SCALE, out)   # counters reset: a second launch gives the same result
    torch.cuda.synchronize()
    check(out, reference(*case))
    assert int(plan.counters.abs().sum()) == 0


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 4, 8, 16, 32, 64])
def test_gpu_step_tilings_at_64_heads(n):
    # the decode step's plans (STEP_TILINGS) at 64 heads, each row count through its plan
    w, k = 128, 512
    case = make_case(n, 64, w, k, device="cuda", seed=77 + n, comp_valid=0.95, s_w=4096, s_c=8192)
    plan = next(p for p in SparseMlaPlan.for_step(64, 64, w, k, "cuda") if n <= p.max_rows)
    out = torch.empty(n, 64, D, dtype=torch.bfloat16, device="cuda")
    sparse_mla_(plan, *case, SCALE, out)
    torch.cuda.synchronize()
    check(out, reference(*case))
    assert int(plan.counters.abs().sum()) == 0


@pytest.mark.gpu
def test_gpu_edge_cases_and_fp32_path():
    n, h, w, k = 5, 64, 128, 512
    q, wpool, cpool, wt, ct, sink = make_case(n, h, w, k, device="cuda", seed=5, s_w=1024, s_c=2048)
    wt[0] = -1
    ct[0] = -1
    ct[1] = -1
    wt[2, :100] = -1
    sink[: h // 2] = float("-inf")
    ref = reference(q, wpool, cpool, wt, ct, sink)
    for opts in ({}, {"bf16_dot": False}, {"native_fp8": False}, {"splits": 1}, {"separate_combine": True},
                 {"separate_combine": True, "block_h": 32, "num_warps": 8}):
        out = sparse_mla(q, wpool, cpool, wt, ct, sink, SCALE, **opts)
        torch.cuda.synchronize()
        assert torch.equal(out[0].float().cpu(), torch.zeros(h, D)), opts
        check(out, ref)


@pytest.mark.gpu
@pytest.mark.parametrize("n, splits, block_keys", [(1, 20, 32), (4, 14, 16), (16, 5, 16)])
def test_gpu_separate_combine_gives_the_inline_bits(n, splits, block_keys):
    # the second launch does the inline combination's arithmetic in its split order (spec decision 26)
    h, w, k = 64, 128, 512
    case = make_case(n, h, w, k, device="cuda", seed=300 + n, comp_valid=0.95, s_w=4096, s_c=8192)
    outs = []
    for sep in (False, True):
        plan = SparseMlaPlan.build(n, h, w, k, "cuda", block_keys=block_keys, splits=splits, separate_combine=sep)
        out = torch.empty(n, h, D, dtype=torch.bfloat16, device="cuda")
        sparse_mla_(plan, *case, SCALE, out)
        outs.append(out)
    torch.cuda.synchronize()
    assert torch.equal(outs[0], outs[1])
