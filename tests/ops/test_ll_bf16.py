"""ops/ll_bf16.py against float64 products (interpreter on the CPU; GPU at the real shapes).

Bounds: each product x*w is exact in FP32 for a BF16 weight and one FP32 rounding for an FP32
weight, and K of them are added in FP32 in some order (split-K partials included), so
|y - y64| <= gamma_(K+1) * (|x| @ |w|^T) with gamma_n = n 2^-24 / (1 - n 2^-24) (Higham), whatever
the order. On top, rel RMS < 1e-5: against float64 for FP32 weights and against
`x.float() @ w.float().T` for BF16 weights. The expected figure: with random-sign terms the k-th
partial sum is about sqrt(k) terms large, and its rounding errors (mean-independent, each within
u = 2^-24 of it) add in quadrature to sqrt(K^2 / 2) u terms against a result of sqrt(K) terms:
a relative RMS of sqrt(K / 2) u, 3.0e-6 at K = 5120 (the largest K here), 4.3e-6 when both sides
err (the BF16 case), and the RMS over thousands of outputs stays near its expectation; 1e-5
leaves 2.3x. A TF32 product (u = 2^-11, 10 mantissa bits) errs by ~2^-11 / sqrt(3) = 3e-4 a
term, 30x the bound.
"""

import pytest
import torch

from dsv41_decode.ops.index_query import index_query
from dsv41_decode.ops.ll_bf16 import MODE_IEEE, MODE_TF32, LlBf16Plan, ll_bf16, ll_bf16_
from dsv41_decode.testing.compare import rel_rms

_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
U = 2.0 ** -24


def _operands(m: int, n: int, k: int, dtype: torch.dtype, seed: int):
    """x BF16 [m, k] with a per-row magnitude, w [n, k] of `dtype` with a per-row magnitude."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.exp2(torch.randint(-4, 5, (m, 1), generator=g).float())
    w = torch.randn(n, k, generator=g) * torch.exp2(torch.randint(-8, 0, (n, 1), generator=g).float())
    return x.bfloat16().to(_DEVICE), w.to(dtype).to(_DEVICE)


def _check(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    k = x.shape[1]
    exact = x.double() @ w.double().T
    gamma = (k + 1) * U / (1 - (k + 1) * U)
    bound = gamma * (x.double().abs() @ w.double().abs().T)
    err = (y.double() - exact).abs()
    assert y.dtype == torch.float32 and y.shape == exact.shape
    assert bool((err <= bound).all()), f"worst error / bound {float((err / bound.clamp(min=1e-300)).max()):.3g}"
    if w.dtype == torch.float32:
        assert rel_rms(y, exact) < 1e-5
    else:
        assert rel_rms(y, x.float() @ w.float().T) < 1e-5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n, k", [(32, 64), (96, 512), (160, 512), (40, 200)])
@pytest.mark.parametrize("m", [1, 3, 37, 64])
def test_matches_float64(m, n, k, dtype):
    x, w = _operands(m, n, k, dtype, seed=m * 1000 + n + k)
    plan = LlBf16Plan.build(n, k, 64, dtype, _DEVICE, split=4)   # K=512: 4 programs along K
    _check(ll_bf16(x, w, plan=plan), x, w)
    assert not plan.counters.any(), "the last program of every tile resets its counter"


def test_bf16_subnormal_inputs_are_read_exactly():
    # Subnormal x against large w, then large x against subnormal w: each product is a normal FP32
    # number, so a wrong widening of a subnormal operand (Triton 3.6's interpreter's own
    # bf16 -> fp32 conversion: 5.877e-39 -> 0.0, 1.01e-39 -> 4.41e-39) breaks the bound.
    g = torch.Generator().manual_seed(9)
    m, n, k = 2, 32, 64
    tiny = torch.randint(-127, 128, (n, k), generator=g).float() * 2.0**-133
    big = torch.randn(n, k, generator=g) * 2.0**60
    plan = LlBf16Plan.build(n, k, 64, torch.bfloat16, _DEVICE)
    for x, w in ((tiny[:m], big), (big[:m], tiny)):
        x, w = x.bfloat16().to(_DEVICE), w.bfloat16().to(_DEVICE)
        _check(ll_bf16(x, w, plan=plan), x, w)


def test_plan_modes_and_split():
    bf, fp = (LlBf16Plan.build(96, 512, 64, dt, "cpu") for dt in (torch.bfloat16, torch.float32))
    assert [bf.tile(m).mode for m in (1, 16, 64)] == [MODE_TF32] * 3
    # one arithmetic per weight dtype at every row count (batch invariance), at most 32 rows per
    # program (mma.sync; BLOCK_M 64 would be wgmma)
    assert [fp.tile(m).mode for m in (1, 8, 9, 64)] == [MODE_IEEE] * 4
    assert {t.block_k for t in bf.tiles} == {128} and {t.block_k for t in fp.tiles} == {32}
    assert [bf.tile(m).block_m for m in (1, 16, 17, 37, 64)] == [16, 16, 32, 32, 32]
    assert fp.tile(3).block_m == 16 and fp.tile(37).block_m == 32
    assert bf.counters.numel() == 2 * bf.n_tiles   # per row tile and N tile
    assert (bf.n_tiles, bf.split, bf.k_per_split) == (3, 1, 512)
    # The real shapes: about two programs per SM of an H200, but at least 4 K steps per program.
    shapes = {(1024, 5120, torch.float32): (32, 8), (512, 5120, torch.bfloat16): (16, 10),
              (32, 5120, torch.bfloat16): (1, 10), (128, 512, torch.bfloat16): (4, 1)}
    for (n, k, dt), want in shapes.items():
        p = LlBf16Plan.build(n, k, 64, dt, "cpu")
        assert (p.n_tiles, p.split) == want
        assert p.partials.shape == ((p.split, 64, n) if p.split > 1 else (0, 64, n))
        assert p.k_per_split * (p.split - 1) < k <= p.k_per_split * p.split


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("m", [5, 37])
def test_any_split_is_right(m, dtype):
    x, w = _operands(m, 64, 640, dtype, seed=m)
    for split in (1, 2, 5):
        plan = LlBf16Plan.build(64, 640, 64, dtype, _DEVICE, split=split)
        assert plan.split == split
        _check(ll_bf16(x, w, plan=plan), x, w)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("m", [3, 37])
def test_grouped_splits_give_the_same_bits(m, dtype):
    """A plan whose programs run `group` consecutive K ranges each (split / group programs along K)
    publishes the same partials and sums them in the same order as one program a range: the same
    bits, and every counter back at 0 (the last program counts split / group arrivals)."""
    x, w = _operands(m, 96, 1024, dtype, seed=m + 7)
    want = ll_bf16(x, w, plan=LlBf16Plan.build(96, 1024, 64, dtype, _DEVICE, split=4))
    for group in (2, 4):
        plan = LlBf16Plan.build(96, 1024, 64, dtype, _DEVICE, split=4, group=group)
        assert (plan.split, plan.group) == (4, group)
        assert torch.equal(ll_bf16(x, w, plan=plan), want), f"group {group}"
        assert not plan.counters.any()


def test_replaying_a_plan_is_deterministic():
    plan = LlBf16Plan.build(96, 512, 16, torch.bfloat16, _DEVICE, split=4)
    (x1, w), (x2, _) = _operands(7, 96, 512, torch.bfloat16, 1), _operands(7, 96, 512, torch.bfloat16, 2)
    out = torch.empty(7, 96, device=_DEVICE)
    ll_bf16_(plan, x1, w, out)
    first = out.clone()
    ll_bf16_(plan, x2, w, out)
    _check(out, x2, w)
    ll_bf16_(plan, x1, w, out)
    assert torch.equal(out, first)
    assert not plan.counters.any()


def test_strided_rows_in_and_out():
    x, w = _operands(3, 32, 256, torch.bfloat16, seed=9)
    xs = torch.zeros(3, 300, dtype=torch.bfloat16, device=_DEVICE)[:, 20:276]
    xs.copy_(x)
    out = torch.full((3, 50), float("nan"), device=_DEVICE)
    ll_bf16(xs, w, out=out[:, 10:42])
    _check(out[:, 10:42], x, w)
    assert out[:, :10].isnan().all() and out[:, 42:].isnan().all()


def _meta(t):
    return torch.empty(t.shape, dtype=t.dtype, device="meta")


@pytest.mark.parametrize("case, match", [
    (lambda x, w, o: (x.float(), w, o), "x must have dtype"),
    (lambda x, w, o: (x[:, :32], w, o), "x must have shape"),
    (lambda x, w, o: (x[0], w, o), "x must be a 2-D"),
    (lambda x, w, o: (torch.zeros(9, 64, dtype=torch.bfloat16), w, torch.zeros(9, 32)), "x has 9 rows"),
    (lambda x, w, o: (torch.zeros(64, 3, dtype=torch.bfloat16).t(), w, o), "x must have unit stride"),
    (lambda x, w, o: (x, w.bfloat16(), o), "w must have dtype"),
    (lambda x, w, o: (x, w[:16], o), "w must have shape"),
    (lambda x, w, o: (x, _meta(w), o), "w must be on"),
    (lambda x, w, o: (x, w, o.double()), "out must have dtype"),
    (lambda x, w, o: (x, w, o[:, :8]), "out must have shape"),
    (lambda x, w, o: (x, w, torch.zeros(32, 3).t()), "out must have unit stride"),
])
def test_bad_inputs_raise_naming_the_argument(case, match):
    plan = LlBf16Plan.build(32, 64, 8, torch.float32, "cpu")
    x, w = _operands(3, 32, 64, torch.float32, seed=0)
    with pytest.raises((TypeError, ValueError), match=match):
        ll_bf16_(plan, *case(x.cpu(), w.cpu(), torch.empty(3, 32)))


@pytest.mark.parametrize("kw, match", [
    (dict(weight_dtype=torch.float16), "weight_dtype must be"),
    (dict(max_rows=65), "max_rows must be at most 64"),
    (dict(n=0), "n must be a positive int"),
    (dict(block_n=24), "block_n must be a power of two"),
    (dict(split=0), "split must be a positive int"),
    (dict(split=True), "split must be a positive int, got True"),
    (dict(max_rows=True), "max_rows must be a positive int, got True"),
    (dict(k=512, split=4, group=3), r"group must divide the plan's split \(4 K ranges\), got 3"),
    (dict(group=0), "group must be a positive int, got 0"),
    (dict(n=True), "n must be a positive int, got True"),
])
def test_bad_plans_raise_naming_the_field(kw, match):
    args = dict(n=32, k=64, max_rows=8, weight_dtype=torch.bfloat16, device="cpu") | kw
    with pytest.raises((TypeError, ValueError), match=match):
        LlBf16Plan.build(**args)


def test_convenience_rejects_what_no_plan_serves():
    x = torch.zeros(3, 64, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="w must have dtype"):
        ll_bf16(x, torch.zeros(32, 64, dtype=torch.float16))
    with pytest.raises(ValueError, match="x has 65 rows"):
        ll_bf16(torch.zeros(65, 64, dtype=torch.bfloat16), torch.zeros(32, 64))



# ------------------------------------------------------------------ the head weights in the epilogue

_SCALE = 128 ** -0.5 * 32 ** -0.5     # the indexer's: head_dim^-0.5 * Hi^-0.5 (V4.1-Flash, Hi = 32)


def _index_weights(y: torch.Tensor, scale: float) -> torch.Tensor:
    """`index_query_`'s w_out for wproj = y (its query half fed zeros): BF16 [M, N]."""
    m, n = y.shape
    z = torch.zeros(m, 32, device=y.device)
    return index_query(torch.zeros(m, n * 128, dtype=torch.bfloat16, device=y.device), y, z, z, scale)[1]


@pytest.mark.parametrize("m", [1, 3, 16, 64])
def test_head_weights_equal_index_query_bitwise(m):
    """scale: the last split's program writes bf16(bf16(y) * scale) of the FP32 sums y, at 1, 3, 16
    and 64 rows (1 and 2 row tiles), split 1 and split 4 (partials summed first), two scales through
    one compile: bit for bit the reference's `y.bfloat16() * scale` on every row and `index_query_`'s
    w from the same plan's FP32 output on the first rows (per row: its query half, run here on zeros,
    is the slow part in the interpreter). Row 0 is a one-hot x: y = a column of w, exact in BF16."""
    x, w = _operands(m, 32, 512, torch.bfloat16, seed=70 + m)
    x[0] = 0.0
    x[0, 5] = 1.0
    for split in (1, 4):
        plan = LlBf16Plan.build(32, 512, 64, torch.bfloat16, _DEVICE, split=split)
        y = ll_bf16(x, w, plan=plan)
        for scale in (_SCALE, 3.0):
            out = torch.full((m, 32), float("nan"), dtype=torch.bfloat16, device=_DEVICE)
            ll_bf16_(plan, x, w, out, scale=scale)
            want = (y.bfloat16() * scale).view(torch.int16)
            assert torch.equal(out.view(torch.int16), want), f"split {split}, scale {scale}"
        head = min(m, 3)
        assert torch.equal(out[:head].view(torch.int16), _index_weights(y[:head], 3.0).view(torch.int16))
        assert not plan.counters.any()
    assert torch.equal(ll_bf16(x, w, scale=_SCALE), y.bfloat16() * _SCALE)    # the allocating form


@pytest.mark.parametrize("case, match, exc", [
    (dict(scale="0.1"), "scale must be a float", TypeError),
    (dict(scale=True), "scale must be a float", TypeError),
    (dict(out=torch.empty(3, 32)), "out must have dtype", TypeError),              # FP32 out with scale
    (dict(out=torch.empty(3, 16, dtype=torch.bfloat16)), "out must have shape", ValueError),
    (dict(scale=None, out=torch.empty(3, 32, dtype=torch.bfloat16)), "out must have dtype", TypeError),
])
def test_head_weights_bad_arguments_name_the_argument(case, match, exc):
    plan = LlBf16Plan.build(32, 64, 8, torch.bfloat16, "cpu")
    x, w = _operands(3, 32, 64, torch.bfloat16, seed=0)
    args = dict(out=torch.empty(3, 32, dtype=torch.bfloat16), scale=0.1) | case
    with pytest.raises(exc, match=match):
        ll_bf16_(plan, x.cpu(), w.cpu(), args["out"], scale=args["scale"])


# The side projections of V4.1-Flash (spec section 3 steps 4, 5, 7).
_REAL = [(1024, 5120, torch.float32), (512, 5120, torch.bfloat16), (32, 5120, torch.bfloat16),
         (128, 512, torch.bfloat16)]


@pytest.mark.gpu
@pytest.mark.parametrize("n, k, dtype", _REAL)
def test_gpu_real_shapes_every_row_count(n, k, dtype):
    plan = LlBf16Plan.build(n, k, 64, dtype, "cuda")
    x, w = _operands(64, n, k, dtype, seed=n + k)
    out = torch.empty(64, n, device="cuda")
    for m in range(1, 65):
        ll_bf16_(plan, x[:m], w, out[:m])
        _check(out[:m], x[:m], w)
    assert not plan.counters.any()


@pytest.mark.gpu
@pytest.mark.parametrize("group", [2, 4, 8])
def test_gpu_grouped_splits_give_the_same_bits(group):
    """The ratio-2 compressor's shape (1024 x 5120, FP32 weight, split 8) with `group` K ranges a
    program: the default plan's bits at every row count 1-64 (the same partials, summed in order)."""
    n, k = 1024, 5120
    x, w = _operands(64, n, k, torch.float32, seed=11)
    base = LlBf16Plan.build(n, k, 64, torch.float32, "cuda", split=8)
    plan = LlBf16Plan.build(n, k, 64, torch.float32, "cuda", split=8, group=group)
    want, out = torch.empty(64, n, device="cuda"), torch.empty(64, n, device="cuda")
    for m in range(1, 65):
        ll_bf16_(base, x[:m], w, want[:m])
        ll_bf16_(plan, x[:m], w, out[:m])
        assert torch.equal(out[:m], want[:m]), f"{m} rows"
    assert not plan.counters.any()


@pytest.mark.gpu
@pytest.mark.parametrize("n, k, dtype", _REAL)
def test_gpu_cuda_graph_replay(n, k, dtype):
    plan = LlBf16Plan.build(n, k, 16, dtype, "cuda")
    x, w = _operands(16, n, k, dtype, seed=3)
    out = torch.empty(16, n, device="cuda")
    ll_bf16_(plan, x, w, out)   # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ll_bf16_(plan, x, w, out)
    for seed in (4, 5):
        x.copy_(_operands(16, n, k, dtype, seed=seed)[0])
        graph.replay()
        torch.cuda.synchronize()
        _check(out, x, w)
    assert not plan.counters.any()



@pytest.mark.gpu
def test_gpu_head_weights_every_row_count():
    """weights_proj's real shape (32 x 5120, split 10): the head weights at every row count 1-64,
    bit for bit `index_query_`'s from the FP32 output, and under a CUDA graph replay."""
    plan = LlBf16Plan.build(32, 5120, 64, torch.bfloat16, "cuda")
    x, w = _operands(64, 32, 5120, torch.bfloat16, seed=77)
    y = torch.empty(64, 32, device="cuda")
    hw = torch.empty(64, 32, dtype=torch.bfloat16, device="cuda")
    for m in range(1, 65):
        ll_bf16_(plan, x[:m], w, y[:m])
        ll_bf16_(plan, x[:m], w, hw[:m], scale=_SCALE)
        assert torch.equal(hw[:m].view(torch.int16), _index_weights(y[:m], _SCALE).view(torch.int16)), f"{m} rows"
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ll_bf16_(plan, x[:16], w, hw[:16], scale=_SCALE)
    x.copy_(_operands(64, 32, 5120, torch.bfloat16, seed=78)[0])
    graph.replay()
    ll_bf16_(plan, x[:16], w, y[:16])
    torch.cuda.synchronize()
    assert torch.equal(hw[:16].view(torch.int16), _index_weights(y[:16], _SCALE).view(torch.int16))
    assert not plan.counters.any()
