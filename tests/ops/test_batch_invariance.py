"""Batch invariance of the decode step's GEMM and glue kernels: a row's outputs are bitwise the same
alone and among other rows, whatever row bucket (tile, plan entry) the row count selects.

What makes a kernel's per-row result depend on the row count is a summation order chosen per
bucket: a split-K count or K step depth, another loop (FP8 dots vs dequantize), another MMA
(mma.sync vs wgmma, which Triton picks from the tile's M), or a `tl.sum` whose tree follows a
layout chosen from the tile's shape. The plan tests below check that no such choice follows the
rows (they hold on the CPU for the GPU's tables); the interpreter tests run each op on a row alone
and among 3-40 others (several buckets) and compare the row's bits; the GPU tests do the same at
the V4.1-Flash shapes at every row count 1-64 (docs/step.md, "Batch invariance").
"""

from __future__ import annotations

import pytest
import torch

from dsv41_decode.formats import fp8_block_quantize, mxfp8_quantize
from dsv41_decode.ops import hc_mix as hc_mix_mod
from dsv41_decode.ops.hc_mix import HcMixPlan, hc_mix_
from dsv41_decode.ops.ll_bf16 import LlBf16Plan, ll_bf16_
from dsv41_decode.ops.low_latency_mm import _TUNED, LowLatencyConfig, LowLatencyMM, _default_config, reduction_order
from dsv41_decode.ops.rms_norm import rms_norm_
from dsv41_decode.ops.wo_a import WoAPlan, wo_a_

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ON_GPU = DEVICE == "cuda"


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits (NaN payloads and signed zeros compared as bits)."""
    return t.contiguous().view(torch.uint8)


def _others(rows: int, at: int, row: torch.Tensor, gen: torch.Generator, make) -> torch.Tensor:
    """`rows` rows drawn by make(n, gen), with row `at` replaced by `row` (a [1, ...] tensor)."""
    x = make(rows, gen)
    x[at] = row[0]
    return x


# --- plans: the order a shape's buckets choose ------------------------------------------------------


def test_tuned_low_latency_table_has_one_reduction_order_per_shape():
    """Every (N, K) of the measured table: the same loop and K split bounds in the 16-, 32- and
    64-row buckets (the plan keys on the bucket, so this is what a row alone vs among 63 others
    runs); the fallback rule too."""
    shapes = {(n, k) for n, k, _ in _TUNED}
    for n, k in sorted(shapes):
        orders = {bm: reduction_order(_TUNED[(n, k, bm)], k) for bm in (16, 32, 64)}
        assert len(set(orders.values())) == 1, f"(N, K) = {(n, k)}: {orders}"
    for n, k in ((1024, 4096), (7168, 2048), (96, 320)):
        assert len({reduction_order(_default_config(n, k, bm, 132), k) for bm in (16, 32, 64)}) == 1


def test_reduction_order_is_what_the_plan_launches():
    """`reduction_order` is the plan's K split (one definition), and it can tell configurations apart."""
    w, s = fp8_block_quantize(torch.randn(64, 512))
    cfgs = {16: LowLatencyConfig(block_n=64, block_k=128, split=2), 32: LowLatencyConfig(block_n=32, block_k=64, split=2),
            64: LowLatencyConfig(block_n=16, block_k=32, split=3)}
    plan = LowLatencyMM(w.to(DEVICE), s.to(DEVICE), 64, cfgs)
    assert [plan.reduction_order(m) for m in (1, 17, 33)] == [(False, 256, 32), (False, 256, 32), (False, 192, 32)]
    assert [plan.launch_for(m).k_per_split for m in (1, 17, 33)] == [256, 256, 192]


def test_side_projection_mixer_and_wo_a_plans_fix_their_order():
    """ll_bf16: one mode and K depth per weight dtype, at most 32 rows per program; hc_mix: the same
    K lanes at every row count, at most 8 rows per program, a split that is not a function of
    max_rows; wo_a: the swap is the plan's, not the launch's."""
    for dt in (torch.bfloat16, torch.float32):
        plan = LlBf16Plan.build(1024, 5120, 64, dt, DEVICE)
        assert len({(t.mode, t.block_k) for t in plan.tiles}) == 1 and max(t.block_m for t in plan.tiles) == 32
    mixes = [HcMixPlan.build(5120, r, DEVICE) for r in (1, 16, 64)]
    assert {t.block_k for p in mixes for t in p.tiles} == {32} and max(t.block_m for t in mixes[-1].tiles) == 8
    assert len({(p.split, p.k_per_split) for p in mixes}) == 1


@pytest.mark.parametrize("swap_ab", [None, False, True])
def test_wo_a_swap_is_the_plans_at_every_row_count(swap_ab, monkeypatch):
    """wo_a_: every launch runs the plan's swap (`WoAPlan.swapped`), whatever the rows (the launch
    recorded, not run: in the interpreter both orientations give the same bits, so no row test can
    see it); an unswapped plan launches at most MAX_UNSWAPPED_ROWS rows at a time."""
    from dsv41_decode.ops import wo_a as wo_a_mod
    seen = []

    class Spy:
        def __getitem__(self, grid):
            return lambda *args, **kw: seen.append((kw["SWAP_AB"], kw["BLOCK_M"], args[13]))   # 13: the rows
    monkeypatch.setattr(wo_a_mod, "_wo_a_kernel", Spy())
    heads, groups, rank = 2, 1, 64
    w = torch.randn(groups * rank, heads // groups * 512, generator=torch.Generator().manual_seed(6)) / 45
    for fp8 in (False, True):
        weight, scale = fp8_block_quantize(w) if fp8 else (w.bfloat16(), None)
        weight, scale = weight.to(DEVICE), None if scale is None else scale.to(DEVICE)
        dt = weight.dtype
        plan = WoAPlan.build(heads, groups, rank, 64, weight.dtype, DEVICE, swap_ab=swap_ab)
        for m in (1, 16, 17, 33, 64):
            seen.clear()
            o = torch.zeros(m, heads, 512, dtype=torch.bfloat16, device=DEVICE)
            cos = torch.ones(m, 32, device=DEVICE)
            z = torch.empty(m, groups * rank, dtype=torch.bfloat16, device=DEVICE)
            wo_a_(plan, o, cos, torch.zeros_like(cos), weight, scale, z)
            assert seen and {swap for swap, _, _ in seen} == {plan.swapped}, (dt, m, seen)
            assert sum(rows for _, _, rows in seen) == m, (dt, m, seen)
            if not plan.swapped:
                assert all(rows <= wo_a_mod.MAX_UNSWAPPED_ROWS and block_m <= 32 for _, block_m, rows in seen), seen


# --- the ops: a row alone and among others (interpreter: small shapes) --------------------------------

# rows of the calls that carry the watched row (at index `at`): buckets 1, 8, 32, 64
_COUNTS = [(1, 0), (7, 2), (21, 11), (40, 39)]


def _mxfp8_rows(k: int):
    def make(n: int, gen: torch.Generator):
        return (torch.randn(n, k, generator=gen) * 10.0 ** torch.empty(n, 1).uniform_(-2, 2, generator=gen)).bfloat16()
    return make


def _row_results(run, make, gen_seed: int, counts=_COUNTS):
    """run(x) -> tuple of per-row outputs for every (rows, at) of counts, the watched row the same."""
    gen = torch.Generator().manual_seed(gen_seed)
    row = make(1, gen)
    outs = []
    for rows, at in counts:
        x = _others(rows, at, row, gen, make)
        outs.append([_bits(o[at]) for o in run(x)])
    return outs


def _assert_same_row(outs, counts=_COUNTS):
    for (rows, at), got in zip(counts[1:], outs[1:]):
        for i, (a, b) in enumerate(zip(outs[0], got)):
            assert torch.equal(a, b), f"output {i}: the row alone differs from the row among {rows - 1} others"


@pytest.mark.parametrize("dequant", [False, True], ids=["f8", "dq"])
def test_low_latency_mm_row_bits(dequant):
    """Per bucket a different tile (block_n; block_k for the FP8 loop) with the same reduction order:
    the row's bits agree; a different split does change them (so the comparison can fail)."""
    n, k = 64, 512
    w, s = (t.to(DEVICE) for t in fp8_block_quantize(torch.randn(n, k, generator=torch.Generator().manual_seed(1))))
    bk = (128, 128, 128) if dequant else (128, 64, 32)   # 2 splits of 256 in every bucket
    same = {16: LowLatencyConfig(block_n=64, block_k=bk[0], split=2, dequant=dequant),
            32: LowLatencyConfig(block_n=32, block_k=bk[1], split=2, dequant=dequant, num_stages=2),
            64: LowLatencyConfig(block_n=16, block_k=bk[2], split=2, dequant=dequant)}
    plan = LowLatencyMM(w, s, 64, same)

    def run(x, plan=plan):
        codes, scales = mxfp8_quantize(x)
        bf16 = plan(codes.to(DEVICE), scales.to(DEVICE))
        f32 = plan(codes.to(DEVICE), scales.to(DEVICE), torch.empty(x.shape[0], n, device=DEVICE))   # unrounded
        return bf16.cpu(), f32.cpu()

    _assert_same_row(_row_results(run, _mxfp8_rows(k), 5))
    other = LowLatencyMM(w, s, 64, {**same, 16: LowLatencyConfig(block_n=64, block_k=128, split=4, dequant=dequant)})
    x = _mxfp8_rows(k)(21, torch.Generator().manual_seed(5))
    alone, among = run(x[:16], other)[1], run(x, other)[1][:16]   # buckets 16 and 32
    assert not torch.equal(alone, among), "a different split must change some FP32 bits of 16 x 64 sums"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_ll_bf16_row_bits(dtype):
    n, k = 96, 640
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(2)).to(dtype).to(DEVICE)
    plan = LlBf16Plan.build(n, k, 64, dtype, DEVICE, split=2)

    def run(x):
        out = torch.empty(x.shape[0], n, device=DEVICE)
        ll_bf16_(plan, x.to(DEVICE), w, out)
        return (out.cpu(),)

    _assert_same_row(_row_results(run, _mxfp8_rows(k), 6))


HC_DIM = 128


def _hc_mix_run(max_rows: int, split: int):
    """hc_mix_ at dim 128 with fixed random mixer weights: a function of the streams [m, 4, dim]
    returning (pre, post, comb) on the CPU."""
    gen = torch.Generator().manual_seed(3)
    fn = (torch.randn(24, 4 * HC_DIM, generator=gen) / HC_DIM ** 0.5).to(DEVICE)
    scale, base = (0.5 + torch.rand(3, generator=gen)).to(DEVICE), (0.5 * torch.randn(24, generator=gen)).to(DEVICE)
    plan = HcMixPlan.build(HC_DIM, max_rows, DEVICE, split=split)

    def run(x):
        m = x.shape[0]
        pre, post, comb = (torch.empty(m, *s, device=DEVICE) for s in ((4,), (4,), (4, 4)))
        hc_mix_(x.to(DEVICE), fn, scale, base, 1e-6, 1e-6, 20, pre, post, comb, plan)
        return pre.cpu(), post.cpu(), comb.cpu()

    return run


def _hc_streams(n, g):
    return torch.randn(n, 4, HC_DIM, generator=g).bfloat16()


def test_hc_mix_row_bits():
    _assert_same_row(_row_results(_hc_mix_run(64, 2), _hc_streams, 7))


def test_hc_mix_old_per_bucket_lanes_would_differ(monkeypatch):
    """The kind of choice the mixer made before: K lanes per bucket (it had 128 at 1-2 rows and 32
    at 8; here 16 and 32, which its fixed trees take). With it the row alone and the row among 7
    others differ: the comparison above can fail."""
    def old_tile(rows: int) -> hc_mix_mod.HcMixTile:
        bm = min(1 << (rows - 1).bit_length(), 8)
        return hc_mix_mod.HcMixTile(bm, 16 if bm <= 2 else 32, 4, 3)

    monkeypatch.setattr(hc_mix_mod, "_mix_tile", old_tile)
    outs = _row_results(_hc_mix_run(8, 1), _hc_streams, 7, counts=[(1, 0), (8, 5)])
    assert any(not torch.equal(a, b) for a, b in zip(*outs))


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_wo_a_row_bits(fp8):
    heads, groups, rank = 2, 1, 64
    gen = torch.Generator().manual_seed(4)
    w = torch.randn(groups * rank, heads // groups * 512, generator=gen) / 45
    weight, scale = fp8_block_quantize(w) if fp8 else (w.bfloat16(), None)
    weight, scale = weight.to(DEVICE), None if scale is None else scale.to(DEVICE)
    plan = WoAPlan.build(heads, groups, rank, 64, weight.dtype, DEVICE, split=2)
    angles = torch.rand(64, 32, generator=gen) * 6.28

    def run(o):
        m = o.shape[0]
        z = torch.empty(m, groups * rank, dtype=torch.bfloat16, device=DEVICE)
        codes = torch.empty(m, groups * rank, dtype=torch.uint8, device=DEVICE)
        scales = torch.empty(m, groups * rank // 32, dtype=torch.uint8, device=DEVICE)
        # the same angle for the watched row in every call (row `at` is the watched row's)
        cos, sin = torch.cos(angles[:m]), torch.sin(angles[:m])
        wo_a_(plan, o.to(DEVICE), cos.to(DEVICE), sin.to(DEVICE), weight, scale, z, codes, scales)
        return z.cpu(), codes.cpu(), scales.cpu()

    counts = [(1, 0), (21, 0), (40, 0)]   # the watched row first (the angles follow the row index)
    outs = _row_results(run, lambda n, g: torch.randn(n, heads, 512, generator=g).bfloat16(), 8, counts)
    _assert_same_row(outs, counts)


def test_rms_norm_row_bits_at_the_model_dim():
    """The step's first attn_norm (dim 5120 > the old 4096 limit) runs one program per row."""
    d = 5120
    w = (1 + 0.1 * torch.randn(d, generator=torch.Generator().manual_seed(9))).bfloat16().to(DEVICE)

    def run(x):
        m = x.shape[0]
        out = torch.empty(m, d, dtype=torch.bfloat16, device=DEVICE)
        codes = torch.empty(m, d, dtype=torch.uint8, device=DEVICE)
        scales = torch.empty(m, d // 32, dtype=torch.uint8, device=DEVICE)
        rms_norm_(x.to(DEVICE), w, 1e-6, out, codes, scales)
        return out.cpu(), codes.cpu(), scales.cpu()

    counts = [(1, 0), (5, 2)]
    _assert_same_row(_row_results(run, _mxfp8_rows(d), 10, counts), counts)


# --- the GPU: the V4.1-Flash shapes at every row count -------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("n, k", sorted({(n, k) for n, k, _ in _TUNED}))
def test_gpu_low_latency_mm_every_row_count(n, k):
    """The measured table's plan for each shape: row 0's bits alone and at rows 2..64 (where the
    bucket, and with it the wgmma's N, changes)."""
    gen = torch.Generator().manual_seed(n + k)
    weight, w_scale = (t.cuda() for t in fp8_block_quantize(torch.randn(n, k, generator=gen) / k ** 0.5))
    plan = LowLatencyMM(weight, w_scale, 64)
    x = _mxfp8_rows(k)(64, gen)
    codes, scales = (t.cuda() for t in mxfp8_quantize(x))
    alone = plan(codes[:1], scales[:1]).clone()
    for m in range(2, 65):
        got = plan(codes[:m], scales[:m])
        assert torch.equal(_bits(got[0]), _bits(alone[0])), f"row 0 differs at {m} rows ({plan.launch_for(m).config})"


@pytest.mark.gpu
@pytest.mark.parametrize("n, k, dtype", [(1024, 5120, torch.float32), (512, 5120, torch.bfloat16),
                                         (32, 5120, torch.bfloat16), (128, 512, torch.bfloat16)])
def test_gpu_ll_bf16_every_row_count(n, k, dtype):
    gen = torch.Generator().manual_seed(n + k)
    w = (torch.randn(n, k, generator=gen) / k ** 0.5).to(dtype).cuda()
    plan = LlBf16Plan.build(n, k, 64, dtype, "cuda")
    x = _mxfp8_rows(k)(64, gen).cuda()
    out = torch.empty(64, n, device="cuda")
    ll_bf16_(plan, x[:1], w, out[:1])
    alone = out[0].clone()
    for m in range(2, 65):
        ll_bf16_(plan, x[:m], w, out[:m])
        assert torch.equal(_bits(out[0]), _bits(alone)), f"row 0 differs at {m} rows"


@pytest.mark.gpu
def test_gpu_hc_mix_every_row_count():
    dim = 5120
    gen = torch.Generator().manual_seed(11)
    fn = (torch.randn(24, 4 * dim, generator=gen) / dim ** 0.5).cuda()
    scale, base = (0.5 + torch.rand(3, generator=gen)).cuda(), (0.5 * torch.randn(24, generator=gen)).cuda()
    plan = HcMixPlan.build(dim, 64, "cuda")
    x = torch.randn(64, 4, dim, generator=gen).bfloat16().cuda()
    outs = [torch.empty(64, *s, device="cuda") for s in ((4,), (4,), (4, 4))]
    hc_mix_(x[:1], fn, scale, base, 1e-6, 1e-6, 20, *(o[:1] for o in outs), plan)
    alone = [o[0].clone() for o in outs]
    for m in range(2, 65):
        hc_mix_(x[:m], fn, scale, base, 1e-6, 1e-6, 20, *(o[:m] for o in outs), plan)
        assert all(torch.equal(_bits(o[0]), _bits(a)) for o, a in zip(outs, alone)), f"row 0 differs at {m} rows"


@pytest.mark.gpu
@pytest.mark.parametrize("fp8, bf16_dot", [(False, None), (False, False), (True, None)],
                         ids=["bf16-default", "bf16-tf32", "fp8"])
def test_gpu_wo_a_every_row_count(fp8, bf16_dot):
    heads, groups, rank = 64, 8, 1024
    gen = torch.Generator().manual_seed(12)
    w = torch.randn(groups * rank, heads // groups * 512, generator=gen) / 64
    weight, scale = fp8_block_quantize(w) if fp8 else (w.bfloat16(), None)
    weight, scale = weight.cuda(), None if scale is None else scale.cuda()
    plan = WoAPlan.build(heads, groups, rank, 64, weight.dtype, "cuda", bf16_dot=bf16_dot)
    o = torch.randn(64, heads, 512, generator=gen).bfloat16().cuda()
    angles = torch.rand(64, 32, generator=gen).cuda() * 6.28
    cos, sin = torch.cos(angles), torch.sin(angles)
    z = torch.empty(64, groups * rank, dtype=torch.bfloat16, device="cuda")
    codes = torch.empty(64, groups * rank, dtype=torch.uint8, device="cuda")
    scales = torch.empty(64, groups * rank // 32, dtype=torch.uint8, device="cuda")
    wo_a_(plan, o[:1], cos[:1], sin[:1], weight, scale, z[:1], codes[:1], scales[:1])
    alone = [t[0].clone() for t in (z, codes, scales)]
    for m in range(2, 65):
        wo_a_(plan, o[:m], cos[:m], sin[:m], weight, scale, z[:m], codes[:m], scales[:m])
        assert all(torch.equal(_bits(t[0]), _bits(a)) for t, a in zip((z, codes, scales), alone)), \
            f"row 0 differs at {m} rows (swapped {plan.swapped})"
