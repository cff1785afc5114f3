"""ops/mhc.py and ops/hc_mix.py against reference/mhc.py, reference/linear.rms_norm and formats.mxfp8_quantize
(interpreter on the CPU at small dims; GPU at dim 5120).

Bounds: the new streams and the collapse are bitwise (the kernel adds in the reference's order,
without FMA); random inputs rarely tell orders apart after the BF16 rounding, so a cancelling case
(`_cancelling_case`) makes the outputs pure FP32 rounding errors, where they do. u may differ by
one BF16 ulp: the RMSNorm's mean of squares is summed in another order (and torch's vectorized
CPU rsqrt differs from an IEEE 1/sqrt by up to 2 FP32 ulps), which moves an FP32 value next to a
BF16 rounding midpoint across it; no such case showed in ~1e5 values here. Codes and scales are
bitwise formats.mxfp8_quantize of the u the kernel wrote. The mixer sums in another order than
the reference (split-K partials, a tree sum), so its outputs are compared within the bound
`attribution.mix_bounds` derives for that and within 1e-5 absolute (_MIX_TOL says which is the
tighter where); measured at most 4.8e-7 at dims 64-5120.
"""

import dataclasses
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl

from dsv41_decode.formats import mxfp8_quantize
from dsv41_decode.ops.hc_mix import HcMixPlan, hc_mix, hc_mix_
from dsv41_decode.ops.mhc import (MhcBoundaryPlan, _boundary_chunk, chunk_sumsq, coresident_capacity, mhc_boundary,
                                  mhc_boundary_, mhc_enter_)
from dsv41_decode.ops.common import butterfly_sum
from dsv41_decode.ops.rounding import bf16_rne_bits
from dsv41_decode.reference.linear import rms_norm
from dsv41_decode.reference.mhc import hc_mixes, hc_post, hc_pre, sinkhorn
from dsv41_decode.testing.attribution import mix_bounds
from helpers import compile_script

_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
_EPS = 1e-20      # the model's norm_eps
_HC_EPS = 1e-6
_ITERS = 20
# The mixer's coefficients: elementwise within attribution.mix_bounds (the bound `trace verify`
# derives for two FP32 evaluation orders of the same mix; measured at most 0.3 % of it), and
# within 1e-5 absolute: that bound is 4e-5..1.2e-2 on pre and post at these dims (many BF16
# streams of spread weights: its 512-5120-term dots), so the figure stays where it is the tighter
# one (measured at most 2.4e-7).
_MIX_TOL = 1e-5


def _boundary_case(n: int, dim: int, seed: int, w_dtype=torch.bfloat16):
    """(y, x, post, comb, pre, norm_weight) on the CPU: streams and y ~ N(0, 1) BF16, post and pre as
    the mixer's sigmoids, comb from the reference Sinkhorn of logits of spread 2."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randn(n, dim, generator=g).bfloat16()
    x = torch.randn(n, 4, dim, generator=g).bfloat16()
    post = 2 * torch.sigmoid(torch.randn(n, 4, generator=g))
    comb = sinkhorn(2 * torch.randn(n, 4, 4, generator=g), _ITERS, _HC_EPS)
    pre = torch.sigmoid(torch.randn(n, 4, generator=g)) + _HC_EPS
    w = (1 + 0.2 * torch.randn(dim, generator=g)).to(w_dtype)
    return y, x, post, comb, pre, w


def _mix_case(n: int, dim: int, seed: int):
    """(x, fn, scale, base) on the CPU as the synthetic checkpoints draw them (weights.py)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, dim, generator=g).bfloat16()
    fn = torch.randn(24, 4 * dim, generator=g) * dim ** -0.5
    scale = (0.5 + 0.5 * torch.rand(3, generator=g)).bfloat16().float()
    base = 0.5 * torch.randn(24, generator=g)
    return x, fn, scale, base


def _dev(*ts):
    return [t.to(_DEVICE) for t in ts]


def _ulps_bf16(a: torch.Tensor, b: torch.Tensor) -> int:
    """Largest distance in BF16 steps between same-signed finite BF16 tensors (0 when bitwise equal)."""
    ia, ib = a.view(torch.int16).int(), b.view(torch.int16).int()
    return int((ia - ib).abs().max()) if a.numel() else 0


def _check_boundary(y, x, post, comb, pre, w, out) -> None:
    """out = (x_out, u, codes, scales) of the kernel, against the reference run on the CPU."""
    x_out, u, codes, scales = (t.cpu() for t in out)
    want_x = hc_post(y, x, post, comb)
    assert torch.equal(x_out.view(torch.int16), want_x.view(torch.int16)), "x_out differs from hc_post"
    want_u = rms_norm(hc_pre(want_x, pre), w, _EPS)
    assert _ulps_bf16(u, want_u) <= 1, f"u is {_ulps_bf16(u, want_u)} BF16 ulps from rms_norm(hc_pre(...))"
    want_codes, want_scales = mxfp8_quantize(u)
    assert torch.equal(codes.view(torch.uint8), want_codes.view(torch.uint8)), "codes differ from mxfp8_quantize(u)"
    assert torch.equal(scales.view(torch.uint8), want_scales), "scales differ from mxfp8_quantize(u)"


def _check_mix(got, x, fn, scale, base, iters: int = _ITERS) -> None:
    want = hc_mixes(x, fn, scale, base, _EPS, _HC_EPS, iters)
    bound = mix_bounds(x, fn, scale, base, _EPS, iters, _HC_EPS)
    for name, a, b in zip(("pre", "post", "comb"), got, want):
        assert a.shape == b.shape and a.dtype == torch.float32
        err = float((a.cpu() - b).abs().max())
        assert err <= _MIX_TOL, f"{name}: max abs error {err:.3g} > {_MIX_TOL}"
        ratio = float(((a.cpu().double() - b.double()).abs() / getattr(bound, name)).max())
        assert ratio <= 1.0, f"{name}: {ratio:.3g} x its derived bound (attribution.mix_bounds)"


# --- boundary --------------------------------------------------------------------------------------


def test_reference_adds_the_streams_sequentially():
    """The kernel's order, ((t0 + t1) + t2) + t3, is what torch's CPU .sum(1) over 4 streams gives
    (and a pairwise order is not, on these inputs: the check discriminates)."""
    y, x, post, comb, pre, _ = _boundary_case(5, 256, seed=1)
    t = comb.unsqueeze(-1) * x.float().unsqueeze(2)              # [n, i, j, dim]
    assert torch.equal(t.sum(1), ((t[:, 0] + t[:, 1]) + t[:, 2]) + t[:, 3])
    assert not torch.equal(t.sum(1), (t[:, 0] + t[:, 1]) + (t[:, 2] + t[:, 3]))
    p = pre.unsqueeze(-1) * hc_post(y, x, post, comb).float()     # [n, i, dim]
    assert torch.equal(p.sum(1), ((p[:, 0] + p[:, 1]) + p[:, 2]) + p[:, 3])


def _cancelling_case(n: int, dim: int, seed: int):
    """Inputs whose outputs are FP32 rounding errors, so that any other order of the sums (or an FMA)
    changes them: x2 = -x0, x3 = -x1 and comb rows 2, 3 = rows 0, 1, so each sum over the streams
    is ((t0 + t1) - t0) - t1, the rounding error of t0 + t1 in the reference's order and exactly 0
    in a pairwise one; y = 0 in every other column, where that error is the new stream. Comb
    columns 2, 3 and post[2:] are the negatives of columns 0, 1 and post[:2] (new streams 2, 3 =
    -streams 0, 1) and pre = (p, q, p, q), so the collapse is such an error too. Not a mixer's output
    (negative weights), just a probe of the order."""
    g = torch.Generator().manual_seed(seed)
    x01 = torch.randn(n, 2, dim, generator=g) * torch.exp2(torch.randint(-6, 7, (n, 2, dim), generator=g).float())
    x = torch.cat([x01, -x01], 1).bfloat16()
    ab = 0.1 + torch.rand(n, 2, 2, generator=g)                    # [n, i in (0, 1), j in (0, 1)]
    rows = torch.cat([ab, -ab], 2)                                  # columns 2, 3 = -columns 0, 1
    comb = torch.cat([rows, rows], 1)                               # rows 2, 3 = rows 0, 1
    p01 = 2 * torch.sigmoid(torch.randn(n, 2, generator=g))
    post = torch.cat([p01, -p01], 1)
    q = torch.sigmoid(torch.randn(n, 2, generator=g))
    pre = torch.cat([q, q], 1)
    y = torch.randn(n, dim, generator=g).bfloat16()
    y[:, ::2] = 0
    w = (1 + 0.2 * torch.randn(dim, generator=g)).bfloat16()
    return y, x, post, comb, pre, w


def test_cancelling_case_discriminates():
    """The reference's order leaves nonzero rounding errors where a pairwise order gives exact zeros."""
    y, x, post, comb, pre, w = _cancelling_case(3, 256, seed=3)
    x_new = hc_post(y, x, post, comb)
    assert bool((x_new[:, :, ::2] != 0).any()) and torch.equal(x_new[:, 2:], -x_new[:, :2])
    t = comb.unsqueeze(-1) * x.float().unsqueeze(2)
    assert bool(((t[:, 0] + t[:, 1]) + (t[:, 2] + t[:, 3]) == 0).all())
    assert bool((hc_pre(x_new, pre) != 0).any())


@pytest.mark.parametrize("n, dim", [(1, 64), (3, 256)])
def test_boundary_matches_reference_in_the_cancelling_case(n, dim):
    case = _cancelling_case(n, dim, seed=10 * n + dim)
    _check_boundary(*case, mhc_boundary(*_dev(*case), _EPS))


@pytest.mark.parametrize("dim", [64, 96, 256])
@pytest.mark.parametrize("n", [1, 3, 5])
def test_boundary_matches_reference(n, dim):
    case = _boundary_case(n, dim, seed=100 * n + dim)
    _check_boundary(*case, mhc_boundary(*_dev(*case), _EPS))


@pytest.mark.parametrize("dim, block_d", [(64, 32), (256, 64), (320, 128), (2560, 512)])
@pytest.mark.parametrize("n", [1, 3])
def test_split_boundary_matches_reference(n, dim, block_d):
    # a row spread over chunks; the last chunk to arrive normalizes (at dim 2560 in three 1024-wide
    # slices, the last one partial, each slice's loads issued before the previous one's stores);
    # two launches (counters reset)
    plan = MhcBoundaryPlan.build(dim, 4, _DEVICE, block_d=block_d)
    for seed in (1, 2):
        case = _boundary_case(n, dim, seed=seed * 1000 + 10 * n + dim)
        _check_boundary(*case, mhc_boundary(*_dev(*case), _EPS, plan=plan))
    assert int(plan.counters.abs().sum()) == 0
    case = _cancelling_case(n, dim, seed=5 + n)
    _check_boundary(*case, mhc_boundary(*_dev(*case), _EPS, plan=plan))


def test_boundary_plan_rejects_a_chunk_outside_chunk_sumsq_range():
    with pytest.raises(ValueError, match="block_d=2048 a power of two in 32..1024"):
        MhcBoundaryPlan.build(4096, 2, "cpu", block_d=2048)
    with pytest.raises(ValueError, match="block_d=96"):
        MhcBoundaryPlan.build(4096, 2, "cpu", block_d=96)


def test_split_boundary_rejects_a_plan_of_another_shape():
    case = _dev(*_boundary_case(3, 64, seed=1))
    with pytest.raises(ValueError, match="plan is for dim=128"):
        mhc_boundary(*case, _EPS, plan=MhcBoundaryPlan.build(128, 4, _DEVICE))
    with pytest.raises(ValueError, match="2 rows"):
        mhc_boundary(*case, _EPS, plan=MhcBoundaryPlan.build(64, 2, _DEVICE))


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 16, 64])
def test_gpu_split_boundary_real_dim(n):
    # the split form itself (on CUDA the plan's default is the co-resident one where it fits:
    # test_gpu_coresident_boundary_is_the_split_kernel_bitwise)
    plan = MhcBoundaryPlan.build(5120, 64, "cuda", coresident=False)
    assert not plan.coresident
    case = _boundary_case(n, 5120, seed=n)
    _check_boundary(*case, mhc_boundary(*_dev(*case), _EPS, plan=plan))
    _check_boundary(*case, mhc_boundary(*_dev(*case), _EPS, plan=plan))


def test_boundary_plan_form():
    """`MhcBoundaryPlan.build` picks the co-resident form only on CUDA outside the interpreter (the
    interpreter runs a launch's programs one after another, so a wait could never see a later one);
    the form and the poll bound as asked, arguments checked naming the culprit."""
    plan = MhcBoundaryPlan.build(256, 4, "cpu", block_d=64)
    assert plan.coresident is False and plan.spin_limit == 1 << 22
    forced = MhcBoundaryPlan.build(256, 4, "cpu", block_d=64, coresident=True, spin_limit=3)
    assert forced.coresident is True and forced.spin_limit == 3
    assert dataclasses.replace(forced, coresident=False).counters is forced.counters   # the same workspace
    with pytest.raises(TypeError, match="coresident"):
        MhcBoundaryPlan.build(256, 4, "cpu", coresident=1)
    with pytest.raises(ValueError, match="spin_limit"):
        MhcBoundaryPlan.build(256, 4, "cpu", spin_limit=0)
    with pytest.raises(ValueError, match="spin_limit=2147483648"):
        MhcBoundaryPlan.build(256, 4, "cpu", spin_limit=1 << 31)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")   # the interpreter's NaN math
def test_coresident_boundary_in_the_interpreter_shows_a_wait_that_polls_out():
    """The co-resident kernel forced in the interpreter, where a row's chunks run one after another:
    each chunk but the last to run polls spin_limit times without seeing the row complete and
    writes its chunk as the documented failure (u NaN, codes 0x7F, scales 0xFF); the last one, which
    saw every partial, writes the split kernel's bits (the same r), the new streams are the split
    kernel's everywhere, and the counters are left 0 (a second launch finds them so)."""
    n, dim, block_d = 3, 256, 64
    plan = MhcBoundaryPlan.build(dim, 4, _DEVICE, block_d=block_d, coresident=True, spin_limit=2)
    split = MhcBoundaryPlan.build(dim, 4, _DEVICE, block_d=block_d, coresident=False)
    for seed in (1, 2):
        case = _dev(*_boundary_case(n, dim, seed=40 + seed))
        x_out, u, codes, scales = (t.cpu() for t in mhc_boundary(*case, _EPS, plan=plan))
        want = [t.cpu() for t in mhc_boundary(*case, _EPS, plan=split)]
        assert torch.equal(x_out.view(torch.int16), want[0].view(torch.int16))
        assert not plan.counters.any()
        for r in range(n):
            whole = []
            for ch in range(dim // block_d):
                cols, blocks = slice(ch * block_d, (ch + 1) * block_d), slice(ch * block_d // 32, (ch + 1) * block_d // 32)
                if bool(u[r, cols].isnan().all()):
                    assert bool((codes[r, cols].view(torch.uint8) == 0x7F).all()) and bool((scales[r, blocks] == 255).all())
                else:
                    assert torch.equal(u[r, cols].view(torch.int16), want[1][r, cols].view(torch.int16))
                    assert torch.equal(codes[r, cols].view(torch.uint8), want[2][r, cols].view(torch.uint8))
                    assert torch.equal(scales[r, blocks], want[3][r, blocks])
                    whole.append(ch)
            assert whole == [dim // block_d - 1], f"row {r}: chunks {whole} saw the whole row"


def test_coresident_boundary_compiles_for_sm90_without_spills():
    """The co-resident kernel at dim 5120 with the step's plan (10 chunks of 512 columns, 4 warps),
    compiled for sm_90 (tests/ops/_mhc_sm90.py, in a subprocess without the interpreter): no local
    memory, stack or spill instructions, and every program of a 64-row launch (640) fits on an
    H200's 132 SMs at once by registers, threads and shared memory (what its wait needs)."""
    rows = {r["name"]: r for r in compile_script(Path(__file__).with_name("_mhc_sm90.py"))[1]}
    assert set(rows) == {"coresident", "split"}, rows
    for r in rows.values():
        assert r["LOCAL"] == 0 and r["STACK"] == 0 and r["spills"] == 0, r
    # coresident_capacity's bound at block_d 512 (CPU_SMS: an H200's 132 SMs) holds and takes 64 rows
    assert 132 * rows["coresident"]["per_sm"] >= coresident_capacity(512, "cpu") >= 64 * 10, rows["coresident"]


@pytest.mark.gpu
def test_gpu_boundary_plan_coresident_only_where_it_fits():
    """On CUDA the plan is co-resident where its rows x chunks fit the device at once
    (`coresident_capacity`), the split form past that; asked for co-resident past it, a ValueError
    naming max_rows."""
    cap = coresident_capacity(512, "cuda")
    assert MhcBoundaryPlan.build(5120, cap // 10, "cuda").coresident
    assert not MhcBoundaryPlan.build(5120, cap // 10 + 1, "cuda").coresident
    with pytest.raises(ValueError, match="max_rows"):
        MhcBoundaryPlan.build(5120, cap // 10 + 1, "cuda", coresident=True)


def _coresident_case(n: int, seed: int, cancelling: bool = False):
    """(case on the CPU, its device copy) at dim 5120."""
    case = _cancelling_case(n, 5120, seed=seed) if cancelling else _boundary_case(n, 5120, seed=seed)
    return case, _dev(*case)


def _assert_same_bits(got, want, what: str) -> None:
    for name, a, b in zip(("x_out", "u", "codes", "scales"), got, want):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), f"{what}: {name} differs from the split kernel's"


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 2, 3, 8, 16, 64])
def test_gpu_coresident_boundary_is_the_split_kernel_bitwise(n):
    """At dim 5120 (the step's plan: 10 chunks of 512): the co-resident launch (the plan CUDA builds)
    gives x_out, u, codes and scales bitwise the split kernel's (the same plan forced to the split
    form) on the same inputs, twice in a row (its counters left 0), and the reference's bits."""
    plan = MhcBoundaryPlan.build(5120, 64, "cuda")
    assert plan.coresident
    split = dataclasses.replace(plan, coresident=False)
    for seed, cancelling in ((n, False), (100 + n, False), (n, True)):
        case, dev = _coresident_case(n, seed, cancelling)
        want = mhc_boundary(*dev, _EPS, plan=split)
        for launch in range(2):
            got = mhc_boundary(*dev, _EPS, plan=plan)
            torch.cuda.synchronize()
            _assert_same_bits(got, want, f"seed {seed}, launch {launch}")
            assert not plan.counters.any() and not plan.chunk_counters.any()
        _check_boundary(*case, got)


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 2, 3, 8, 16, 64])
def test_gpu_coresident_boundary_cuda_graph_replay(n):
    """The co-resident launch captured once in a CUDA graph and replayed 3 times on new inputs copied
    into the captured buffers: each replay bitwise the split kernel's on those inputs, counters 0."""
    dim = 5120
    args = _boundary_args(n, dim)
    args["plan"] = plan = MhcBoundaryPlan.build(dim, 64, "cuda")
    split = MhcBoundaryPlan.build(dim, 64, "cuda", coresident=False)
    assert plan.coresident
    mhc_boundary_(**args)                      # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        mhc_boundary_(**args)
    for replay in range(3):
        case, dev = _coresident_case(n, seed=700 + replay, cancelling=replay == 2)
        for key, t in zip(("y", "x", "post", "comb", "pre", "norm_weight"), dev):
            args[key].copy_(t)
        graph.replay()
        torch.cuda.synchronize()
        got = (args["x_out"], args["u_out"], args["codes_out"], args["scales_out"])
        _assert_same_bits(got, mhc_boundary(*dev, _EPS, plan=split), f"replay {replay}")
        assert not plan.counters.any()
        _check_boundary(*case, got)


def _butterfly(t: torch.Tensor) -> torch.Tensor:
    """[R, L] -> [R] FP32 in `common.butterfly_sum`'s order: t[:, i] + t[:, i + L/2] first."""
    while t.shape[1] > 1:
        t = t[:, :t.shape[1] // 2] + t[:, t.shape[1] // 2:]
    return t[:, 0]


def _chunk_sumsq_order(c: torch.Tensor) -> torch.Tensor:
    """`mhc.chunk_sumsq` of each row of c [R, B] FP32, its order spelled out in torch FP32 (each add
    one rounding): each thread's B / 128 consecutive squares in order, then the 32 lanes of a warp,
    then the 4 warps, as butterflies (below 128 columns one square a thread, B / 32 warps)."""
    r, b = c.shape
    spt, warps = (b // 128, 4) if b >= 128 else (1, b // 32)
    sq = (c * c).view(r, warps * 32, spt)
    acc = sq[:, :, 0]
    for j in range(1, spt):
        acc = acc + sq[:, :, j]
    return _butterfly(_butterfly(acc.reshape(r * warps, 32)).view(r, warps))


@triton.jit
def _sumsq_kernel(c_ptr, tree_ptr, sum_ptr, parts_ptr, BLOCK_D: tl.constexpr, PARTS: tl.constexpr):
    # per row: chunk_sumsq of a BF16 chunk, tl.sum of its squares (in a 4-warp program the layout of
    # the split kernel's chunks, BLOCK_D / 128 consecutive values a thread), and the butterfly and
    # tl.sum over the row's first PARTS squares (the chunks' sums of a row)
    n = tl.program_id(0)
    c = tl.load(c_ptr + n * BLOCK_D + tl.arange(0, BLOCK_D)).to(tl.float32)
    tl.store(tree_ptr + n, chunk_sumsq(c))
    tl.store(sum_ptr + n, tl.sum(c * c, axis=0))
    k = tl.arange(0, PARTS)
    p = tl.load(c_ptr + n * BLOCK_D + k).to(tl.float32)
    tl.store(parts_ptr + 2 * n, tl.sum(butterfly_sum(tl.reshape(p * p, [1, PARTS])), axis=0))
    tl.store(parts_ptr + 2 * n + 1, tl.sum(p * p, axis=0))


def _sumsq_case(rows: int, block_d: int, parts: int):
    g = torch.Generator().manual_seed(block_d + rows)
    spread = torch.exp2(torch.randint(-8, 9, (rows, block_d), generator=g).float())
    c = (torch.randn(rows, block_d, generator=g) * spread).bfloat16()
    tree, plain = torch.empty(rows, device=_DEVICE), torch.empty(rows, device=_DEVICE)
    pair = torch.empty(rows, 2, device=_DEVICE)
    _sumsq_kernel[(rows,)](c.to(_DEVICE), tree, plain, pair, BLOCK_D=block_d, PARTS=parts, num_warps=4,
                           enable_fp_fusion=False)
    return c.float(), tree.cpu(), plain.cpu(), pair.cpu()


@pytest.mark.parametrize("block_d", [32, 64, 512, 1024])
def test_chunk_sumsq_order(block_d):
    """chunk_sumsq adds in the order it documents (bitwise its torch spelling), at 512 columns one
    that differs from numpy's pairwise sum (the interpreter's tl.sum) on these inputs; the butterfly
    of 16 values too."""
    c, tree, plain, pair = _sumsq_case(3, block_d, 16)
    assert torch.equal(tree, _chunk_sumsq_order(c))
    assert torch.equal(pair[:, 0], _butterfly(c[:, :16] * c[:, :16]))
    if block_d == 512:
        assert not torch.equal(tree, plain)


@pytest.mark.gpu
@pytest.mark.parametrize("block_d", [512, 1024])
def test_gpu_chunk_sumsq_is_the_4_warp_sum(block_d):
    """On sm_90, chunk_sumsq and the butterfly over 16 values give the bits of tl.sum in a 4-warp
    program of the split kernel's layout (so `mhc_boundary_`'s chunk sums on the GPU are tl.sum's),
    on 4096 rows of wide-ranging values."""
    c, tree, plain, pair = _sumsq_case(4096, block_d, 16)
    assert torch.equal(tree, _chunk_sumsq_order(c))
    assert torch.equal(tree, plain), f"{int((tree != plain).sum())} of 4096 rows differ"
    assert torch.equal(pair[:, 0], pair[:, 1])


@triton.jit
def _collapse_kernel(y_ptr, x_ptr, post_ptr, comb_ptr, pre_ptr, c_ptr, D: tl.constexpr, BLOCK_D: tl.constexpr):
    n = tl.program_id(0)
    d = tl.arange(0, BLOCK_D)
    mask = d < D
    _, _, _, _, c = _boundary_chunk(y_ptr + n * D, x_ptr + n * 4 * D, D, post_ptr + n * 4, comb_ptr + n * 16, 4,
                                    pre_ptr + n * 4, d, mask)
    tl.store(c_ptr + n * D + d, bf16_rne_bits(c), mask=mask)  # c is BF16-valued: exact


def _check_collapse(y, x, post, comb, pre):
    n, dim = y.shape
    c = torch.empty(n, dim, dtype=torch.bfloat16, device=_DEVICE)
    _collapse_kernel[(n,)](*_dev(y, x, post, comb, pre), c.view(torch.int16), D=dim,
                           BLOCK_D=triton.next_power_of_2(dim), enable_fp_fusion=False)
    want = hc_pre(hc_post(y, x, post, comb), pre)
    assert torch.equal(c.cpu().view(torch.int16), want.view(torch.int16))


@pytest.mark.parametrize("n, dim", [(1, 64), (3, 96), (5, 256)])
def test_collapse_is_bitwise_hc_pre(n, dim):
    """The collapse the kernel normalizes is bitwise hc_pre(hc_post(...), pre) (the chunk helper the
    boundary kernel runs, applied to one chunk that covers the row)."""
    for y, x, post, comb, pre, _ in (_boundary_case(n, dim, seed=7 * n + dim), _cancelling_case(n, dim, seed=n)):
        _check_collapse(y, x, post, comb, pre)


@pytest.mark.parametrize("n, dim", [(1, 64), (3, 256), (2, 2560)])
def test_enter_matches_reference(n, dim):
    """The first site's input (no post-mix): the collapse bitwise hc_pre, u within one BF16 ulp of
    rms_norm(hc_pre(x, pre)) (its sum of squares in the kernel's order, as `mhc_boundary_`), the
    MXFP8 bitwise mxfp8_quantize(u); strided streams (a slice of a wider buffer)."""
    _, x, _, _, pre, w = _boundary_case(n, dim, seed=31 * n + dim)
    wide = torch.zeros(n, 6, dim, dtype=torch.bfloat16)
    wide[:, 1:5] = x
    xs, pre_d, w_d = _dev(wide[:, 1:5], pre, w)
    u = torch.empty(n, dim, dtype=torch.bfloat16, device=_DEVICE)
    codes = torch.empty(n, dim, dtype=torch.float8_e4m3fn, device=_DEVICE)
    scales = torch.empty(n, dim // 32, dtype=torch.uint8, device=_DEVICE)
    mhc_enter_(xs, pre_d, w_d, _EPS, u, codes, scales)
    want_u = rms_norm(hc_pre(x, pre), w, _EPS)
    assert _ulps_bf16(u.cpu(), want_u) <= 1, f"u is {_ulps_bf16(u.cpu(), want_u)} BF16 ulps from rms_norm(hc_pre(x))"
    want_codes, want_scales = mxfp8_quantize(u.cpu())
    assert torch.equal(codes.cpu().view(torch.uint8), want_codes.view(torch.uint8))
    assert torch.equal(scales.cpu(), want_scales)


def test_enter_rejects_bad_arguments():
    x = torch.zeros(2, 4, 64, dtype=torch.bfloat16)
    pre, w = torch.zeros(2, 4), torch.ones(64, dtype=torch.bfloat16)
    u, codes, scales = torch.empty(2, 64, dtype=torch.bfloat16), torch.empty(2, 64, dtype=torch.uint8), \
        torch.empty(2, 2, dtype=torch.uint8)
    with pytest.raises(ValueError, match="pre must"):
        mhc_enter_(x, torch.zeros(2, 3), w, _EPS, u, codes, scales)
    with pytest.raises(ValueError, match="x: dim=48"):
        mhc_enter_(torch.zeros(2, 4, 48, dtype=torch.bfloat16), pre, w, _EPS, u, codes, scales)
    with pytest.raises(ValueError, match="x: dim=0 must be a positive multiple of 32"):
        mhc_enter_(x[..., :0], pre, w[:0], _EPS, u[:, :0], codes[:, :0], scales[:, :0])
    with pytest.raises(ValueError, match="u_out must not overlap x"):
        mhc_enter_(x, pre, w, _EPS, x[:, 0], codes, scales)
    with pytest.raises(TypeError, match="eps must be a float"):
        mhc_enter_(x, pre, w, None, u, codes, scales)


def test_boundary_real_dim_one_row():
    case = _boundary_case(1, 5120, seed=5120)   # 5 chunks of 1024, as on the GPU
    _check_boundary(*case, mhc_boundary(*_dev(*case), _EPS))


def test_boundary_writes_into_strided_buffers():
    """Strided views of y, x, post, comb (unit stride in the last dim) and x_out, FP32 norm weight,
    uint8 codes and float8_e8m0fnu scales: the same bits as the reference."""
    n, dim = 3, 128
    y, x, post, comb, pre, w = _boundary_case(n, dim, seed=11, w_dtype=torch.float32)
    y_wide = torch.zeros(n, dim + 64, dtype=torch.bfloat16)
    y_wide[:, 32:32 + dim] = y
    x_wide = torch.zeros(n, 4, dim + 32, dtype=torch.bfloat16)
    x_wide[:, :, :dim] = x
    comb_wide = torch.zeros(n, 4, 8)
    comb_wide[:, :, 2:6] = comb                                   # comb[n, i] rows 8 apart
    post_wide = torch.zeros(n, 8)
    post_wide[:, 4:] = post
    yd, xd, postd, combd, pred, wd = _dev(y_wide, x_wide, post_wide, comb_wide, pre, w)
    yd, xd, postd, combd = yd[:, 32:32 + dim], xd[:, :, :dim], postd[:, 4:], combd[:, :, 2:6]
    x_out = torch.empty(n, 4, dim + 32, dtype=torch.bfloat16, device=_DEVICE)[:, :, 16:16 + dim]
    u = torch.empty(n, dim, dtype=torch.bfloat16, device=_DEVICE)
    codes = torch.empty(n, dim, dtype=torch.uint8, device=_DEVICE)
    scales = torch.empty(n, dim // 32, dtype=torch.float8_e8m0fnu, device=_DEVICE)
    mhc_boundary_(yd, xd, postd, combd, pred, wd, _EPS, x_out, u, codes, scales)
    _check_boundary(y, x, post, comb, pre, w, (x_out, u, codes, scales))


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")   # the interpreter's NaN math
def test_boundary_non_finite_output_as_reference():
    """An inf in the site's output: the new streams carry it bitwise; u is NaN where the collapse is
    inf and 0 elsewhere (rsqrt(inf) = 0), as rms_norm gives; its block gets scale 255, codes 0x7F."""
    y, x, post, comb, pre, w = _boundary_case(2, 64, seed=13)
    y[1, 5] = float("inf")
    x_out, u, codes, scales = (t.cpu() for t in mhc_boundary(*_dev(y, x, post, comb, pre, w), _EPS))
    want_x = hc_post(y, x, post, comb)
    assert torch.equal(x_out.view(torch.int16), want_x.view(torch.int16))
    want_u = rms_norm(hc_pre(want_x, pre), w, _EPS)
    assert torch.equal(u.isnan(), want_u.isnan()) and bool(u[1].isnan().any())
    assert torch.equal(torch.nan_to_num(u), torch.nan_to_num(want_u))
    want_codes, want_scales = mxfp8_quantize(u)
    assert torch.equal(codes.view(torch.uint8), want_codes.view(torch.uint8)) and torch.equal(scales, want_scales)
    assert int(scales[1, 0]) == 255


def _boundary_args(n=3, dim=64):
    y, x, post, comb, pre, w = _dev(*_boundary_case(n, dim, seed=17))
    outs = (torch.empty(n, 4, dim, dtype=torch.bfloat16, device=_DEVICE),
            torch.empty(n, dim, dtype=torch.bfloat16, device=_DEVICE),
            torch.empty(n, dim, dtype=torch.float8_e4m3fn, device=_DEVICE),
            torch.empty(n, dim // 32, dtype=torch.uint8, device=_DEVICE))
    return dict(y=y, x=x, post=post, comb=comb, pre=pre, norm_weight=w, eps=_EPS, x_out=outs[0], u_out=outs[1],
                codes_out=outs[2], scales_out=outs[3])


@pytest.mark.parametrize("name, bad, exc", [
    ("x", lambda a: a["x"].float(), TypeError),
    ("x", lambda a: a["x"][:, :3], ValueError),
    ("post", lambda a: a["post"].double(), TypeError),
    ("comb", lambda a: a["comb"][:, :, :2], ValueError),
    ("pre", lambda a: a["pre"][:2], ValueError),
    ("norm_weight", lambda a: a["norm_weight"].half(), TypeError),
    ("norm_weight", lambda a: a["norm_weight"][:32], ValueError),
    ("x_out", lambda a: a["x_out"].float(), TypeError),
    ("u_out", lambda a: a["u_out"][:, :32], ValueError),
    ("codes_out", lambda a: a["codes_out"].view(torch.int8), TypeError),
    ("scales_out", lambda a: a["scales_out"][:, :1], ValueError),
    ("y", lambda a: a["y"].float(), TypeError),
])
def test_boundary_rejects_bad_arguments(name, bad, exc):
    args = _boundary_args()
    args[name] = bad(args)
    with pytest.raises(exc, match=name):
        mhc_boundary_(**args)


def test_boundary_by_pdl_needs_a_plan_and_sm90():
    args = _boundary_args()
    with pytest.raises(ValueError, match="pdl: a launch by PDL needs a plan"):
        mhc_boundary_(**args, pdl=True)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="pdl: programmatic dependent launch needs sm_90"):
            mhc_boundary_(**args, plan=MhcBoundaryPlan.build(64, 3, _DEVICE), pdl=True)


def test_boundary_rejects_aliasing_and_bad_dim():
    args = _boundary_args()
    args["x_out"] = args["x"]
    with pytest.raises(ValueError, match="x_out must not overlap x"):
        mhc_boundary_(**args)
    args = _boundary_args()
    args["u_out"] = args["y"]
    with pytest.raises(ValueError, match="u_out must not overlap y"):
        mhc_boundary_(**args)
    with pytest.raises(ValueError, match="multiple of 32"):
        mhc_boundary(*_dev(*_boundary_case(1, 48, seed=1)), _EPS)
    y, x, post, comb, pre, nw = _dev(*_boundary_case(2, 64, seed=1))
    with pytest.raises(ValueError, match="y: dim=0 must be a positive multiple of 32"):
        mhc_boundary(y[:, :0], x[..., :0], post, comb, pre, nw[:0], _EPS)


# --- mixer -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("split", [None, 3])
@pytest.mark.parametrize("dim", [64, 256])
@pytest.mark.parametrize("n", [1, 3, 5])
def test_mix_matches_reference(n, dim, split):
    x, fn, scale, base = _mix_case(n, dim, seed=1000 * n + dim)
    plan = HcMixPlan.build(dim, 8, _DEVICE, split=split)
    _check_mix(hc_mix(*_dev(x, fn, scale, base), _EPS, _HC_EPS, _ITERS, plan=plan), x, fn, scale, base)
    assert not plan.counters.any(), "the last program of every row tile resets its counter"


@pytest.mark.parametrize("iters", [1, 2, 3])
def test_mix_few_sinkhorn_rounds(iters):
    """Few rounds, where each round still moves comb by far more than the tolerance (at 20 the
    last round moves it by less than 1e-5): the kernel runs exactly `sinkhorn_iters` rounds."""
    x, fn, scale, base = _mix_case(5, 64, seed=50 + iters)
    plan = HcMixPlan.build(64, 8, _DEVICE, split=2)
    got = hc_mix(*_dev(x, fn, scale, base), _EPS, _HC_EPS, iters, plan=plan)
    _check_mix(got, x, fn, scale, base, iters)


def test_mix_row_tiles_and_determinism():
    """16 rows (two row tiles of 8) and 70 rows (nine row tiles, nine counters); a second launch on
    the same plan (counters reset by the last arrivers) gives the same bits. Batch invariance (a
    row's bits at every row count): tests/ops/test_batch_invariance.py."""
    dim = 64
    plan = HcMixPlan.build(dim, 70, _DEVICE, split=2)
    assert plan.split == 2 and plan.counters.numel() == 9
    x, fn, scale, base = _mix_case(70, dim, seed=21)
    xd, fnd, scd, bd = _dev(x, fn, scale, base)
    for n in (16, 70):
        first = hc_mix(xd[:n], fnd, scd, bd, _EPS, _HC_EPS, _ITERS, plan=plan)
        _check_mix(first, x[:n], fn, scale, base)
        again = hc_mix(xd[:n], fnd, scd, bd, _EPS, _HC_EPS, _ITERS, plan=plan)
        assert all(torch.equal(a, b) for a, b in zip(first, again))
        assert not plan.counters.any()


def test_mix_real_dim():
    """dim 5120 with the default plan (80 programs of 256 columns), 3 rows."""
    x, fn, scale, base = _mix_case(3, 5120, seed=31)
    plan = HcMixPlan.build(5120, 64, _DEVICE)
    _check_mix(hc_mix(*_dev(x, fn, scale, base), _EPS, _HC_EPS, _ITERS, plan=plan), x, fn, scale, base)


def test_mix_plan():
    plan = HcMixPlan.build(5120, 64, "cpu")
    assert (plan.k, plan.split, plan.k_per_split) == (20480, 80, 256)
    assert tuple(plan.partials.shape) == (80, 64, 32) and plan.counters.tolist() == [0] * 8   # per row tile of 8
    # the K lanes (the summation order) the same at every row count, at most 8 rows per program
    assert {t.block_k for t in plan.tiles} == {32}
    assert [plan.tile(m).block_m for m in (1, 3, 9, 64)] == [1, 4, 8, 8]
    one = HcMixPlan.build(64, 4, "cpu")     # K = 256: two grains, one program
    assert (one.split, one.k_per_split, one.partials.numel()) == (1, 256, 0)
    with pytest.raises(ValueError, match="dim"):
        HcMixPlan.build(40, 4, "cpu")
    with pytest.raises(ValueError, match="split"):
        HcMixPlan.build(64, 4, "cpu", split=0)


def _mix_args(n=3, dim=64):
    x, fn, scale, base = _dev(*_mix_case(n, dim, seed=41))
    return dict(x=x, fn=fn, scale=scale, base=base, norm_eps=_EPS, hc_eps=_HC_EPS, sinkhorn_iters=_ITERS,
                pre_out=torch.empty(n, 4, device=_DEVICE), post_out=torch.empty(n, 4, device=_DEVICE),
                comb_out=torch.empty(n, 4, 4, device=_DEVICE), plan=HcMixPlan.build(dim, 4, _DEVICE))


@pytest.mark.parametrize("name, bad, exc", [
    ("x", lambda a: a["x"].float(), TypeError),
    ("x", lambda a: a["x"][:, :, :32], ValueError),
    ("fn", lambda a: a["fn"].bfloat16(), TypeError),
    ("fn", lambda a: a["fn"][:8], ValueError),
    ("scale", lambda a: a["scale"][:2], ValueError),
    ("base", lambda a: a["base"].double(), TypeError),
    ("pre_out", lambda a: a["pre_out"][:2], ValueError),
    ("post_out", lambda a: a["post_out"].half(), TypeError),
    ("comb_out", lambda a: a["comb_out"][:, :2], ValueError),
    ("sinkhorn_iters", lambda a: 0, ValueError),
    ("plan", lambda a: None, TypeError),
])
def test_mix_rejects_bad_arguments(name, bad, exc):
    args = _mix_args()
    args[name] = bad(args)
    with pytest.raises(exc, match=name):
        hc_mix_(**args)


def test_mix_rejects_rows_past_the_plan():
    args = _mix_args(n=3)
    args["plan"] = HcMixPlan.build(64, 2, _DEVICE)
    with pytest.raises(ValueError, match="max_rows=2"):
        hc_mix_(**args)


# --- GPU at dim 5120 ---------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 16, 64])
def test_gpu_real_dim(n):
    case = _boundary_case(n, 5120, seed=9000 + n)
    _check_boundary(*case, mhc_boundary(*_dev(*case), _EPS))
    x, fn, scale, base = _mix_case(n, 5120, seed=9100 + n)
    plan = HcMixPlan.build(5120, 64, _DEVICE)
    _check_mix(hc_mix(*_dev(x, fn, scale, base), _EPS, _HC_EPS, _ITERS, plan=plan), x, fn, scale, base)
    assert not plan.counters.any()


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 2, 8, 64])
def test_gpu_boundary_by_pdl_is_the_plain_launch(n):
    """At dim 5120 with the step's plan (co-resident), the launch by PDL right after the copy that
    writes y (its programs wait for it, then read) gives the plain launch's bits, eagerly and
    replayed from a CUDA graph (the step's form: a programmatic edge after the copy's node)."""
    dim = 5120
    args = _boundary_args(n, dim)
    args["plan"] = plan = MhcBoundaryPlan.build(dim, 64, "cuda")
    assert plan.coresident
    y_src = args["y"].clone()
    mhc_boundary_(**args)
    want = [args[k].clone() for k in ("x_out", "u_out", "codes_out", "scales_out")]
    graph = torch.cuda.CUDAGraph()
    for form in ("eager", "graph"):
        for k in ("x_out", "u_out", "codes_out", "scales_out"):
            args[k].zero_()
        args["y"].zero_()
        torch.cuda.synchronize()
        if form == "eager":
            args["y"].copy_(y_src)
            mhc_boundary_(**args, pdl=True)
        else:
            with torch.cuda.graph(graph):
                args["y"].copy_(y_src)
                mhc_boundary_(**args, pdl=True)
            graph.replay()
        torch.cuda.synchronize()
        for k, w in zip(("x_out", "u_out", "codes_out", "scales_out"), want):
            assert torch.equal(args[k].view(torch.uint8), w.view(torch.uint8)), (form, k, n)
        assert not plan.counters.any() and not plan.chunk_counters.any()


@pytest.mark.gpu
def test_gpu_cuda_graph_replay():
    """Both launchers captured once and replayed on new inputs copied into the captured buffers."""
    n, dim = 16, 5120
    args = _boundary_args(n, dim)
    margs = _mix_args(n, dim)
    margs["plan"] = HcMixPlan.build(dim, 64, _DEVICE)
    mhc_boundary_(**args)                      # compile outside the capture
    hc_mix_(**margs)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        mhc_boundary_(**args)
        hc_mix_(**margs)
    for seed in (1, 2):
        case = _boundary_case(n, dim, seed=seed)
        for key, t in zip(("y", "x", "post", "comb", "pre", "norm_weight"), case):
            args[key].copy_(t)
        mix_case = _mix_case(n, dim, seed=seed)
        for key, t in zip(("x", "fn", "scale", "base"), mix_case):
            margs[key].copy_(t)
        graph.replay()
        torch.cuda.synchronize()
        _check_boundary(*case, (args["x_out"], args["u_out"], args["codes_out"], args["scales_out"]))
        _check_mix((margs["pre_out"], margs["post_out"], margs["comb_out"]), *mix_case)
        assert not margs["plan"].counters.any()
