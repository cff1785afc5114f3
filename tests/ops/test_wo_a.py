"""ops/wo_a.py against reference.attention.grouped_wo_a (interpreter on the CPU; GPU at the real
shapes).

Tolerances: the kernel rounds the rotated input to BF16 exactly as the reference does (bit-exact,
checked through an identity weight) and forms exact products; only the FP32 summation order of the
(H/G)*512-term dots differs (~1e-7 of the terms' magnitude), so z may differ from the reference by a
rare one-ulp flip of the BF16 output rounding: rel RMS < 1e-3 and max |diff| <= 1 BF16 ulp of the
row's largest |z|. (The rel RMS says flips are rare: a share f of elements one ulp off, at most 2^-7
of the element, gives at most 2^-7 sqrt(f), so 1e-3 allows f up to 1.6 %; a flip needs the dot
within ~1e-7 relative of a BF16 rounding midpoint, about 2^-14 of the elements.) Per element the ulp
bound cannot hold where a dot cancels (a result of 6e-6 from terms summing to 13 in magnitude
carries FP32 noise of ~1e-6 in any order). The FP8 variant is held to the same against the reference
fed its dequantized weight; against the BF16 weight it was quantized from, rel RMS < 3e-2 (the loose
bound of architecture's two references; E4M3 keeps 3 mantissa bits, about 2.6% RMS here).
"""

import pytest
import torch

from dsv41_decode.formats import fp8_block_dequantize
from dsv41_decode.ops.checks import interpreting
from dsv41_decode.ops.wo_a import WoAPlan, quantize_wo_a, wo_a, wo_a_
from dsv41_decode.reference.attention import grouped_wo_a
from dsv41_decode.reference.rope import rope_cis, rope_tail
from dsv41_decode.testing.compare import rel_rms, row_ulp_distance

pytestmark = pytest.mark.slow        # among the longest files on the CPU: it runs first (conftest.py)

_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
_FREQS = 1.0 / (160000 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64))


def _inputs(m: int, heads: int, groups: int, rank: int, seed: int):
    """(o BF16 [m, H, 512], cis [m, 32] complex64 at positions < 2^20, cos, sin, w BF16
    [G*R, (H/G)*512]) on _DEVICE."""
    g = torch.Generator().manual_seed(seed)
    o = torch.randn(m, heads, 512, generator=g) * torch.exp2(torch.randint(-3, 4, (m, heads, 1), generator=g).float())
    cis = rope_cis(_FREQS, torch.randint(0, 1 << 20, (m,), generator=g))
    w = torch.randn(groups * rank, heads // groups * 512, generator=g) * (heads // groups * 512) ** -0.5
    dev = [t.to(_DEVICE) for t in (o.bfloat16(), cis, cis.real.contiguous(), cis.imag.contiguous(), w.bfloat16())]
    return tuple(dev)


def _check(z: torch.Tensor, ref: torch.Tensor) -> None:
    assert z.dtype == torch.bfloat16 and z.shape == ref.shape
    assert rel_rms(z, ref) < 1e-3
    assert row_ulp_distance(z, ref) <= 1


@pytest.mark.parametrize("heads, groups", [(4, 2), (8, 4)])
@pytest.mark.parametrize("m", [1, 3, 37])
def test_bf16_weight_matches_reference(m, heads, groups):
    o, cis, cos, sin, w = _inputs(m, heads, groups, 64, seed=m * 10 + heads)
    plan = WoAPlan.build(heads, groups, 64, 64, torch.bfloat16, _DEVICE)
    _check(wo_a(o, cos, sin, w, groups, plan=plan), grouped_wo_a(o, cis, w, groups, 64))
    assert not plan.counters.any(), "the last program of every tile resets its counter"


@pytest.mark.parametrize("heads, groups", [(4, 2), (8, 4)])
@pytest.mark.parametrize("m", [1, 3, 37])
def test_fp8_weight_matches_reference_on_dequantized_weight(m, heads, groups):
    o, cis, cos, sin, w = _inputs(m, heads, groups, 64, seed=m * 10 + heads + 1)
    weight, scale = quantize_wo_a(w)
    z = wo_a(o, cos, sin, weight, groups, scale=scale)
    _check(z, grouped_wo_a(o, cis, fp8_block_dequantize(weight, scale).bfloat16(), groups, 64))
    assert rel_rms(z, grouped_wo_a(o, cis, w, groups, 64)) < 3e-2


def test_rotation_is_bit_exact_through_an_identity_weight():
    # One head per group and weight = I: z is the rotated, BF16-rounded input itself (one exact
    # product per output), so any difference is in the rotation or its rounding.
    m, heads = 5, 2
    o, cis, cos, sin, _ = _inputs(m, heads, heads, 512, seed=3)
    w = torch.eye(512, dtype=torch.bfloat16, device=_DEVICE).repeat(heads, 1)
    z = wo_a(o, cos, sin, w, heads, plan=WoAPlan.build(heads, heads, 512, m, torch.bfloat16, _DEVICE, split=1))
    want = rope_tail(o.cpu(), cis.cpu(), 64, inverse=True).reshape(m, -1)
    assert torch.equal(z.cpu(), want)
    assert not torch.equal(z.cpu(), o.cpu().reshape(m, -1)), "the rotation must change the tail"


def test_any_split_and_strided_input():
    m, heads, groups = 3, 4, 2
    o, cis, cos, sin, w = _inputs(m, heads, groups, 32, seed=11)
    ref = grouped_wo_a(o, cis, w, groups, 64)
    big = torch.zeros(m, heads, 640, dtype=torch.bfloat16, device=_DEVICE)
    big[:, :, 64:576] = o
    for split in (1, 2, 8):
        plan = WoAPlan.build(heads, groups, 32, 4, torch.bfloat16, _DEVICE, split=split)
        assert (plan.split, plan.block_n) == (split, 32)
        _check(wo_a(big[:, :, 64:576], cos, sin, w, groups, plan=plan), ref)


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("split, m", [(1, 3), (2, 37)])
def test_swap_ab_matches_reference_and_quantizes_the_same(split, m, fp8):
    """swap_ab (z^T = W o'^T, transposed back for the epilogue): the reference's values, and its
    fused MXFP8 output equals act_quant of its own z."""
    from dsv41_decode.ops.act_quant import act_quant_mxfp8_
    heads, groups, rank = 8, 4, 64
    o, cis, cos, sin, w = _inputs(m, heads, groups, rank, seed=41 + split)
    weight, scale = quantize_wo_a(w) if fp8 else (w, None)
    w_ref = fp8_block_dequantize(weight, scale).bfloat16() if fp8 else w
    plan = WoAPlan.build(heads, groups, rank, 64, weight.dtype, _DEVICE, split=split, swap_ab=True)
    assert plan.swap_ab
    n = groups * rank
    z = torch.empty(m, n, dtype=torch.bfloat16, device=_DEVICE)
    codes = torch.empty(m, n, dtype=torch.uint8, device=_DEVICE)
    sbytes = torch.empty(m, n // 32, dtype=torch.uint8, device=_DEVICE)
    wo_a_(plan, o, cos, sin, weight, scale, z, codes, sbytes)
    _check(z, grouped_wo_a(o, cis, w_ref, groups, 64))
    want_codes = torch.empty_like(codes)
    want_scales = torch.empty_like(sbytes)
    act_quant_mxfp8_(z, want_codes, want_scales)
    assert torch.equal(codes, want_codes) and torch.equal(sbytes, want_scales)
    assert not plan.counters.any()


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("split, rank, m", [(1, 64, 3), (2, 32, 5), (4, 64, 1)])
def test_fused_mxfp8_output_equals_act_quant(split, rank, m, fp8):
    # codes_out / scales_out: the MXFP8 of z from the same launch, bit for bit act_quant_mxfp8_(z);
    # rows past M untouched
    from dsv41_decode.ops.act_quant import act_quant_mxfp8_
    heads, groups = 4, 2
    o, _, cos, sin, w = _inputs(m, heads, groups, rank, seed=31 + split)
    weight, scale = quantize_wo_a(w) if fp8 else (w, None)
    plan = WoAPlan.build(heads, groups, rank, 8, weight.dtype, _DEVICE, split=split)
    n = groups * rank
    z = torch.empty(m, n, dtype=torch.bfloat16, device=_DEVICE)
    codes = torch.full((m + 1, n), 0xAA, dtype=torch.uint8, device=_DEVICE)
    scales = torch.full((m + 1, n // 32), 0xAA, dtype=torch.uint8, device=_DEVICE)
    wo_a_(plan, o, cos, sin, weight, scale, z, codes[:m], scales[:m])
    want_c = torch.empty(m, n, dtype=torch.uint8, device=_DEVICE)
    want_s = torch.empty(m, n // 32, dtype=torch.uint8, device=_DEVICE)
    act_quant_mxfp8_(z, want_c, want_s)
    assert torch.equal(codes[:m], want_c) and torch.equal(scales[:m], want_s)
    assert (codes[m] == 0xAA).all() and (scales[m] == 0xAA).all()
    z2 = torch.empty_like(z)
    wo_a_(plan, o, cos, sin, weight, scale, z2)
    assert torch.equal(z, z2), "the fused quantization does not change z"
    with pytest.raises(ValueError, match="go together"):
        wo_a_(plan, o, cos, sin, weight, scale, z, codes[:m])


def test_replaying_a_plan_is_deterministic():
    plan = WoAPlan.build(4, 2, 64, 8, torch.float8_e4m3fn, _DEVICE)
    o1, _, cos1, sin1, w = _inputs(4, 4, 2, 64, seed=21)
    o2, cis2, cos2, sin2, _ = _inputs(4, 4, 2, 64, seed=22)
    weight, scale = quantize_wo_a(w)
    out = torch.empty(4, 128, dtype=torch.bfloat16, device=_DEVICE)
    wo_a_(plan, o1, cos1, sin1, weight, scale, out)
    first = out.clone()
    wo_a_(plan, o2, cos2, sin2, weight, scale, out)
    _check(out, grouped_wo_a(o2, cis2, fp8_block_dequantize(weight, scale).bfloat16(), 2, 64))
    wo_a_(plan, o1, cos1, sin1, weight, scale, out)
    assert torch.equal(out, first)
    assert not plan.counters.any()


def test_plans_sharing_a_workspace_give_their_own_bits():
    # the decode step's layers (decode.buffers.Workspaces): two shapes' split plans take their
    # partials (3-D views) and counters from one pool, the second growing it (re-seating the
    # first's views), and run in turn: each gives its own plan's bits, the counters left at zero
    from dsv41_decode.decode.buffers import Workspaces
    pool = Workspaces(_DEVICE)
    shapes = [(4, 2, 32), (8, 4, 64)]
    cases = [_inputs(3, h, g, r, seed=30 + r) for h, g, r in shapes]
    shared = [WoAPlan.build(h, g, r, 4, torch.bfloat16, _DEVICE, split=2, workspace=pool) for h, g, r in shapes]
    assert shared[0].partials.untyped_storage().data_ptr() == shared[1].partials.untyped_storage().data_ptr()
    expected = [wo_a(o, cos, sin, w, g, plan=WoAPlan.build(h, g, r, 4, torch.bfloat16, _DEVICE, split=2))
                for (h, g, r), (o, _, cos, sin, w) in zip(shapes, cases)]
    for i in (1, 0, 1):
        o, _, cos, sin, w = cases[i]
        assert torch.equal(wo_a(o, cos, sin, w, shapes[i][1], plan=shared[i]), expected[i])
        assert not shared[0].counters.any() and not shared[1].counters.any()


def test_plan_split_for_each_tp_degree():
    # The real shapes (R = 1024, 8 heads per group): about two programs per SM of an H200 for a
    # BF16 weight, four for an FP8 one (the measured defaults); BF16 dots by default for BF16 only.
    for dtype, per_sm in ((torch.bfloat16, 2), (torch.float8_e4m3fn, 4)):
        for heads in (64, 32, 16, 8):
            p = WoAPlan.build(heads, heads // 8, 1024, 64, dtype, "cpu")
            split = per_sm * 128 // (heads * 2)
            assert (p.split, p.k_per_split, p.group_width) == (split, 4096 // split, 4096)
            assert p.n_out // p.block_n * p.split == 128 * per_sm
            assert not p.bf16_dot                       # never on the CPU / under the interpreter


def _meta(t):
    return torch.empty(t.shape, dtype=t.dtype, device="meta")


@pytest.mark.parametrize("case, match", [
    (lambda o, c, s, w, sc, z: (o.float(), c, s, w, sc, z), "o must have dtype"),
    (lambda o, c, s, w, sc, z: (o[:, :2], c, s, w, sc, z), "o must have shape"),
    (lambda o, c, s, w, sc, z: (o[0], c, s, w, sc, z), "o must be a 3-D"),
    (lambda o, c, s, w, sc, z: (o.transpose(1, 2).contiguous().transpose(1, 2), c, s, w, sc, z),
     "o must have unit stride"),
    (lambda o, c, s, w, sc, z: (torch.zeros(9, 4, 512, dtype=torch.bfloat16), c, s, w, sc, z), "o has 9 rows"),
    (lambda o, c, s, w, sc, z: (o, c.double(), s, w, sc, z), "cos must have dtype"),
    (lambda o, c, s, w, sc, z: (o, c, s[:, :16], w, sc, z), "sin must have shape"),
    (lambda o, c, s, w, sc, z: (o, c, s, w.bfloat16(), sc, z), "weight must have dtype"),
    (lambda o, c, s, w, sc, z: (o, c, s, w[:64], sc, z), "weight must have shape"),
    (lambda o, c, s, w, sc, z: (o, c, s, _meta(w), sc, z), "weight must be on"),
    (lambda o, c, s, w, sc, z: (o, c, s, w, None, z), "scale is required"),
    (lambda o, c, s, w, sc, z: (o, c, s, w, sc[:, :8], z), "scale must have shape"),
    (lambda o, c, s, w, sc, z: (o, c, s, w, sc.float(), z), "scale must have dtype"),
    (lambda o, c, s, w, sc, z: (o, c, s, w, sc, z.float()), "out must have dtype"),
    (lambda o, c, s, w, sc, z: (o, c, s, w, sc, z[:, :64]), "out must have shape"),
])
def test_bad_inputs_raise_naming_the_argument(case, match):
    plan = WoAPlan.build(4, 2, 64, 8, torch.float8_e4m3fn, "cpu")
    o, _, cos, sin, w = (t.cpu() for t in _inputs(3, 4, 2, 64, seed=0))
    weight, scale = quantize_wo_a(w)
    with pytest.raises((TypeError, ValueError), match=match):
        wo_a_(plan, *case(o, cos, sin, weight, scale, torch.empty(3, 128, dtype=torch.bfloat16)))


@pytest.mark.parametrize("kw, exc, match", [
    (dict(split=True), ValueError, r"split must be a positive divisor of group_width / \d+ = \d+, got True"),
    (dict(heads=True, o_groups=True), ValueError, "heads must be a positive int, got True"),
    (dict(num_warps=3), ValueError, "num_warps must be a power of two in 1..16, got 3"),
    (dict(num_warps=0), ValueError, "num_warps must be a power of two in 1..16, got 0"),
    (dict(num_warps="4"), ValueError, "num_warps must be a power of two in 1..16, got '4'"),
    (dict(num_stages=0), ValueError, "num_stages must be a positive int, got 0"),
    (dict(num_stages=2.0), ValueError, "num_stages must be a positive int, got 2.0"),
    (dict(bf16_dot="yes"), TypeError, "bf16_dot must be None, True or False, got 'yes'"),
    (dict(swap_ab=1), TypeError, "swap_ab must be None, True or False, got 1"),
])
def test_bad_launch_options_name_the_option(kw, exc, match):
    args = dict(heads=4, o_groups=2, rank=64, max_rows=8, weight_dtype=torch.bfloat16, device="cpu") | kw
    with pytest.raises(exc, match=match):
        WoAPlan.build(**args)


def test_bf16_plan_rejects_a_scale_and_bad_plans_name_the_field():
    plan = WoAPlan.build(4, 2, 64, 8, torch.bfloat16, "cpu")
    o, _, cos, sin, w = (t.cpu() for t in _inputs(3, 4, 2, 64, seed=0))
    with pytest.raises(ValueError, match="scale must be None"):
        wo_a_(plan, o, cos, sin, w, torch.zeros(4, 32, dtype=torch.uint8), torch.empty(3, 128, dtype=torch.bfloat16))
    for kw, match in ((dict(heads=5), "heads=5 must be a multiple of o_groups"), (dict(rank=48), "rank=48"),
                      (dict(max_rows=65), "max_rows must be at most 64"), (dict(split=3), "split must be"),
                      (dict(weight_dtype=torch.float16), "weight_dtype must be")):
        args = dict(heads=4, o_groups=2, rank=64, max_rows=8, weight_dtype=torch.bfloat16, device="cpu") | kw
        with pytest.raises((TypeError, ValueError), match=match):
            WoAPlan.build(**args)
    with pytest.raises(ValueError, match="o_groups=3"):
        wo_a(o, cos, sin, w, 3)
    with pytest.raises(ValueError, match="o has 65 rows"):
        wo_a(torch.zeros(65, 4, 512, dtype=torch.bfloat16), cos, sin, w, 2)


@pytest.mark.gpu
@pytest.mark.parametrize("swap_ab", [False, True], ids=["mma", "swap"])
@pytest.mark.parametrize("bf16_dot", [False, True])
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("heads", [64, 32, 16, 8])
def test_gpu_real_shapes(heads, fp8, bf16_dot, swap_ab):
    groups = heads // 8   # this rank's share of the 8 groups under TP1/2/4/8
    o, cis, cos, sin, w = _inputs(64, heads, groups, 1024, seed=heads)
    weight, scale = quantize_wo_a(w) if fp8 else (w, None)
    w_ref = fp8_block_dequantize(weight, scale).bfloat16() if fp8 else w
    plan = WoAPlan.build(heads, groups, 1024, 64, weight.dtype, "cuda", bf16_dot=bf16_dot, swap_ab=swap_ab)
    assert plan.bf16_dot is bf16_dot and plan.swap_ab is swap_ab
    out = torch.empty(64, groups * 1024, dtype=torch.bfloat16, device="cuda")
    for m in (1, 2, 3, 4, 8, 16, 37, 64):
        wo_a_(plan, o[:m], cos[:m], sin[:m], weight, scale, out[:m])
        _check(out[:m], grouped_wo_a(o[:m], cis[:m], w_ref, groups, 64))
    assert not plan.counters.any()


@pytest.mark.gpu
def test_gpu_rotation_bit_exact_and_graph_replay():
    m, heads = 16, 8
    o, cis, cos, sin, _ = _inputs(m, heads, heads, 512, seed=5)
    w = torch.eye(512, dtype=torch.bfloat16, device="cuda").repeat(heads, 1)
    plan = WoAPlan.build(heads, heads, 512, m, torch.bfloat16, "cuda")
    out = torch.empty(m, heads * 512, dtype=torch.bfloat16, device="cuda")
    wo_a_(plan, o, cos, sin, w, None, out)   # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        wo_a_(plan, o, cos, sin, w, None, out)
    for seed in (6, 7):
        o2, cis2, cos2, sin2, _ = _inputs(m, heads, heads, 512, seed=seed)
        for dst, src in ((o, o2), (cos, cos2), (sin, sin2)):
            dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        # The reference's rotation on the CPU (torch's CUDA complex product may contract to FMA).
        assert torch.equal(out.cpu(), rope_tail(o.cpu(), cis2.cpu(), 64, inverse=True).reshape(m, -1))
    assert not plan.counters.any()


def test_bf16_dot_is_a_gpu_option():
    # the interpreter's BF16 dots are wrong: off the GPU the plan keeps TF32 on FP32 operands
    plan = WoAPlan.build(8, 4, 64, 4, torch.bfloat16, "cpu", bf16_dot=True)
    assert plan.bf16_dot is False


def test_stages_per_launch():
    """num_stages=None: 2 stages for an FP8 weight up to 16 rows, 3 above and for BF16; a given
    num_stages holds for every launch."""
    fp8 = WoAPlan.build(8, 4, 64, 64, torch.float8_e4m3fn, _DEVICE)
    bf16 = WoAPlan.build(8, 4, 64, 64, torch.bfloat16, _DEVICE)
    assert [fp8.stages(m) for m in (1, 16, 17, 64)] == [2, 2, 3, 3]
    assert [bf16.stages(m) for m in (1, 16, 64)] == [3, 3, 3]
    assert WoAPlan.build(8, 4, 64, 64, torch.float8_e4m3fn, _DEVICE, num_stages=4).stages(1) == 4


def test_swap_per_plan():
    """swap_ab=None: the plan picks, the same for every row count (batch invariance; on a GPU: BF16
    with BF16 dots swapped, FP8 not; off elsewhere); a given swap_ab holds on any device."""
    plan = WoAPlan.build(8, 4, 64, 64, torch.float8_e4m3fn, _DEVICE)
    assert plan.swap_ab is None and plan.swapped is False
    on_gpu = _DEVICE == "cuda" and not interpreting()
    assert WoAPlan.build(8, 4, 64, 64, torch.bfloat16, _DEVICE).swapped is on_gpu
    assert WoAPlan.build(8, 4, 64, 64, torch.bfloat16, _DEVICE, bf16_dot=False).swapped is False
    assert WoAPlan.build(8, 4, 64, 64, torch.bfloat16, _DEVICE, swap_ab=False).swapped is False
    assert WoAPlan.build(8, 4, 64, 64, torch.float8_e4m3fn, _DEVICE, swap_ab=True).swapped is True


def _copy_case(m: int, slots: int, seed: int):
    """A window pool of `slots` random 528-byte records and the step's kind of copy: rows' staged
    records (the last m+1 slots) into distinct ring slots below them; returns (pool, src, dst, ref)."""
    g = torch.Generator().manual_seed(seed)
    pool = torch.randint(0, 256, (slots, 528), generator=g, dtype=torch.uint8)
    src = torch.arange(slots - m - 1, slots)
    dst = torch.randperm(slots - m - 1, generator=g)[: m + 1]
    ref = pool.clone()
    ref.index_copy_(0, dst[:m], ref.index_select(0, src[:m]))
    return tuple(t.to(_DEVICE) for t in (pool, src, dst, ref))


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("groups, rank, m", [(4, 64, 3), (2, 64, 5), (2, 32, 37)])
def test_window_copy_rides_along(groups, rank, m, fp8):
    """window_copy: the pool afterwards equals index_copy_ of the rows' records (also with fewer
    output tiles than rows: programs loop over rows), z and its MXFP8 unchanged."""
    heads = 2 * groups
    o, cis, cos, sin, w = _inputs(m, heads, groups, rank, seed=m + groups)
    weight, scale = quantize_wo_a(w) if fp8 else (w, None)
    plan = WoAPlan.build(heads, groups, rank, 64, weight.dtype, _DEVICE, split=2)
    pool, src, dst, ref = _copy_case(m, 3 * m + 8, seed=m)
    outs = []
    for copy in (None, (pool, src, dst)):
        z = torch.empty(m, groups * rank, dtype=torch.bfloat16, device=_DEVICE)
        codes = torch.empty(m, groups * rank, dtype=torch.uint8, device=_DEVICE)
        sc = torch.empty(m, groups * rank // 32, dtype=torch.uint8, device=_DEVICE)
        wo_a_(plan, o, cos, sin, weight, scale, z, codes, sc, window_copy=copy)
        outs.append((z, codes, sc))
    assert all(torch.equal(a, b) for a, b in zip(*outs))
    assert torch.equal(pool, ref)


@pytest.mark.parametrize("case, exc, match", [
    (lambda p, s, d: (p.view(torch.int8), s, d), TypeError, "pool must be a uint8"),
    (lambda p, s, d: (p[0], s, d), ValueError, "pool must be 2-D"),
    (lambda p, s, d: (p[:, :526], s, d), ValueError, "contiguous"),
    (lambda p, s, d: (p, s.int(), d), TypeError, "src must be an int64"),
    (lambda p, s, d: (p, s, d[:1]), ValueError, "dst must be a contiguous vector of at least 3 entries"),
    (lambda p, s, d: (p, s), ValueError, "tuple"),
])
def test_window_copy_rejects_bad_input(case, exc, match):
    o, cis, cos, sin, w = _inputs(3, 8, 4, 64, seed=1)
    plan = WoAPlan.build(8, 4, 64, 64, torch.bfloat16, _DEVICE)
    pool, src, dst, _ = _copy_case(3, 17, seed=2)
    out = torch.empty(3, 256, dtype=torch.bfloat16, device=_DEVICE)
    with pytest.raises(exc, match=match):
        wo_a_(plan, o, cos, sin, w, None, out, window_copy=case(pool, src, dst))


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True])
def test_gpu_window_copy_at_step_shape(fp8):
    """64 heads, 8 groups of 1024 (the step's shape), every row count's defaults: the copy lands,
    z is unchanged."""
    o, cis, cos, sin, w = _inputs(64, 64, 8, 1024, seed=9)
    weight, scale = quantize_wo_a(w) if fp8 else (w, None)
    plan = WoAPlan.build(64, 8, 1024, 64, weight.dtype, "cuda")
    for m in (1, 5, 16, 33, 64):
        pool, src, dst, ref = _copy_case(m, 2 * m + 200, seed=m)
        z0, z1 = (torch.empty(m, 8192, dtype=torch.bfloat16, device="cuda") for _ in range(2))
        wo_a_(plan, o[:m], cos[:m], sin[:m], weight, scale, z0)
        wo_a_(plan, o[:m], cos[:m], sin[:m], weight, scale, z1, window_copy=(pool, src, dst))
        assert torch.equal(z0, z1) and torch.equal(pool, ref), m


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_ieee_dot_in_the_interpreter_gives_the_default_bits(fp8):
    """ieee_dot (FP32 operands, IEEE dots: the exact step's) in the interpreter: its dots are NumPy's
    FP32 products and sums whatever the precision asked for, and the launch's tile (`ieee_tile`)
    does not change a row's sums (each output is one dot along K), so the bits are the default
    plan's; and the reference's within the module's tolerance. Rows 3 and 37 (tiles of 8 rows,
    and 37 as 32 + 5)."""
    if _DEVICE == "cuda":
        pytest.skip("the interpreter's check; the GPU's is test_gpu_ieee_dot_real_shapes")
    heads, groups, rank = 4, 2, 64
    o, cis, cos, sin, w = _inputs(37, heads, groups, rank, seed=41 + fp8)
    weight, scale = quantize_wo_a(w) if fp8 else (w, None)
    w_ref = fp8_block_dequantize(weight, scale).bfloat16() if fp8 else w
    ieee = WoAPlan.build(heads, groups, rank, 64, weight.dtype, "cpu", ieee_dot=True)
    default = WoAPlan.build(heads, groups, rank, 64, weight.dtype, "cpu")
    assert ieee.ieee_dot and not ieee.bf16_dot and not ieee.swapped
    for m in (3, 37):
        z = wo_a(o[:m], cos[:m], sin[:m], weight, groups, scale=scale, plan=ieee)
        assert torch.equal(z, wo_a(o[:m], cos[:m], sin[:m], weight, groups, scale=scale, plan=default))
        _check(z, grouped_wo_a(o[:m], cis[:m], w_ref, groups, rank))
    assert not ieee.counters.any()


def test_ieee_dot_plan_and_tiles():
    """ieee_dot excludes BF16 dots and must be a bool; its launches take BLOCK_M = the rows' power
    of two (at least 8) and four outputs a thread (`ieee_tile`, the no-spill tiles of sm_90:
    tests/ops/test_fp32_dots_sm90.py)."""
    with pytest.raises(ValueError, match="ieee_dot and bf16_dot"):
        WoAPlan.build(8, 4, 64, 4, torch.bfloat16, "cpu", ieee_dot=True, bf16_dot=True)
    with pytest.raises(TypeError, match="ieee_dot must be a bool"):
        WoAPlan.build(8, 4, 64, 4, torch.bfloat16, "cpu", ieee_dot=1)
    plan = WoAPlan.build(64, 8, 1024, 64, torch.bfloat16, "cpu", ieee_dot=True)
    assert plan.block_n == 64 and not plan.bf16_dot
    assert [plan.ieee_tile(m) for m in (1, 8, 9, 16, 17, 32)] == [(8, 4), (8, 4), (16, 8), (16, 8), (32, 16),
                                                                   (32, 16)]
    assert WoAPlan.build(8, 4, 32, 4, torch.bfloat16, "cpu", ieee_dot=True).ieee_tile(16) == (16, 4)


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("heads", [64, 8])
def test_gpu_ieee_dot_real_shapes(heads, fp8):
    """The exact step's wo_a (ieee_dot: CUDA-core FMAs) at the V4.1-Flash shapes (64 heads, and a
    TP8 rank's 8): the reference's within the module's tolerance at 1-64 rows, a second launch's
    bits the same, and a row's bits the same at every row count (each output one FMA chain along K,
    whatever the launch's tile)."""
    groups = heads // 8
    o, cis, cos, sin, w = _inputs(64, heads, groups, 1024, seed=heads + 7)
    weight, scale = quantize_wo_a(w) if fp8 else (w, None)
    w_ref = fp8_block_dequantize(weight, scale).bfloat16() if fp8 else w
    plan = WoAPlan.build(heads, groups, 1024, 64, weight.dtype, "cuda", ieee_dot=True)
    assert plan.ieee_dot and not plan.bf16_dot and not plan.swapped
    out = torch.empty(64, groups * 1024, dtype=torch.bfloat16, device="cuda")
    again = torch.empty_like(out)
    full = None
    for m in (64, 1, 2, 3, 8, 16, 17, 37):
        wo_a_(plan, o[:m], cos[:m], sin[:m], weight, scale, out[:m])
        wo_a_(plan, o[:m], cos[:m], sin[:m], weight, scale, again[:m])
        assert torch.equal(out[:m], again[:m]), m
        _check(out[:m], grouped_wo_a(o[:m], cis[:m], w_ref, groups, 64))
        if full is None:
            full = out.clone()
        assert torch.equal(out[:m], full[:m]), m
    assert not plan.counters.any()
