"""dsv41_decode.reference against independent re-derivations of spec sections 3-5.

Every expected value is computed here from the spec's formulas, in float64 unless a rounding the
spec names is the point (then the rounding is applied explicitly), never by calling the function
under test. Inputs are fresh seeded random tensors per check. Tolerances:

- one BF16 rounding of a value computed in FP32: |err| <= 2^-8 |ref| (half an ulp of a number in
  [2^e, 2^(e+1)) is 2^(e-8)), plus the FP32 accumulation error, bounded by
  (terms + blocks) * 2^-24 * sum|terms| where a sum may cancel;
- FP32 results: a few 2^-24 relative to the magnitude of the terms;
- sparse attention: the project's kernel tolerances (max abs <= 2e-2 max|ref|, rel RMS <= 5e-3),
  plus a tighter rel RMS for the reference, which only rounds P and the output to BF16.
"""

from __future__ import annotations

import math

import pytest
import torch

from dsv41_decode.config import ModelConfig
from dsv41_decode.formats import (
    fp8_block_dequantize, fp8_block_quantize, mxfp4_fake, mxfp8_dequantize, mxfp8_quantize,
)
from dsv41_decode.reference.attention import output_projection, sparse_attention
from dsv41_decode.reference.compressor import compress_ratio2
from dsv41_decode.reference.indexer import candidate_mask, index_scores, topk_ascending
from dsv41_decode.reference.linear import bf16_linear, fp8_linear, rms_norm
from dsv41_decode.reference.mhc import hc_mixes, hc_post, hc_pre, sinkhorn
from dsv41_decode.reference.rope import apply_rope, rope_cis, rope_freqs, rope_tail
from dsv41_decode.testing.compare import (
    bits_differ, check_topk_invariants, rel_rms, row_ulp_distance, ulp_distance,
)

F64 = torch.float64
BF16 = torch.bfloat16
U = 2.0 ** -24          # FP32 unit roundoff
HALF_ULP = 2.0 ** -8    # largest relative error of one BF16 rounding


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(gen: torch.Generator, *shape: int, scale: float = 1.0, dtype=torch.float32) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen) * scale).to(dtype)


def _assert_bf16_of(y: torch.Tensor, ref: torch.Tensor, fp32_err: torch.Tensor | float = 0.0) -> None:
    """y is a BF16 rounding of ref (float64) computed with at most `fp32_err` absolute error."""
    assert y.dtype == BF16 and y.shape == ref.shape, (y.dtype, tuple(y.shape), tuple(ref.shape))
    err = (y.double() - ref).abs()
    bound = HALF_ULP * ref.abs() + fp32_err
    bad = err > bound
    assert not bool(bad.any()), (
        f"{int(bad.sum())} of {bad.numel()} elements off by more than one BF16 rounding; worst "
        f"excess {float((err - bound).max()):.3g} at {tuple(int(i) for i in torch.nonzero(bad)[0])}")


@pytest.fixture(scope="module")
def flash() -> ModelConfig:
    return ModelConfig.preset("v41-flash")


# ================================================================================ RoPE (section 5)


def _base_freqs64(base: float) -> torch.Tensor:
    """f_i = base^(-2i/64), i = 0..31, float64."""
    return torch.tensor([base ** (-2.0 * i / 64) for i in range(32)], dtype=F64)


def _yarn_freqs64(base: float, low: int, high: int, factor: float) -> torch.Tensor:
    f = _base_freqs64(base)
    out = f.clone()
    for i in range(32):
        ramp = min(max((i - low) / (high - low), 0.0), 1.0)
        out[i] = f[i] / factor * ramp + f[i] * (1 - ramp)
    return out


def _rotate64(x: torch.Tensor, positions: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """Adjacent-pair rotation, element by element: x [n, ..., 64] float64, positions [n]."""
    out = x.clone().double()
    for r, p in enumerate(positions.tolist()):
        for i in range(32):
            th = p * float(freqs[i])
            c, s = math.cos(th), math.sin(th)
            a, b = x[r, ..., 2 * i].double(), x[r, ..., 2 * i + 1].double()
            out[r, ..., 2 * i] = a * c - b * s
            out[r, ..., 2 * i + 1] = a * s + b * c
    return out


def test_rope_freqs_swa_is_plain_base_10000(flash):
    f = rope_freqs(flash, 0)
    assert f.dtype == torch.float32 and f.shape == (32,)
    ref = _base_freqs64(10000.0)
    assert float(((f.double() - ref).abs() / ref).max()) < 4 * U
    assert float(f[0]) == 1.0 and float(f[31]) < 1.4e-4  # 10000^(-62/64)


def test_rope_yarn_correction_range_is_15_25():
    # the spec's corr(n) = 64 ln(65536 / (2 pi n)) / (2 ln base) for base 160000
    def corr(n: float) -> float:
        return 64 * math.log(65536 / (2 * math.pi * n)) / (2 * math.log(160000.0))
    assert max(math.floor(corr(32)), 0) == 15
    assert min(math.ceil(corr(1)), 63) == 25


@pytest.mark.parametrize("ratio", [1, 2])
def test_rope_freqs_yarn(flash, ratio):
    f = rope_freqs(flash, ratio).double()
    plain = _base_freqs64(160000.0)
    ref = _yarn_freqs64(160000.0, low=15, high=25, factor=16.0)
    assert float(((f - ref).abs() / ref).max()) < 4 * U
    # the ramp: dims <= 15 keep their frequency, dims >= 25 are divided by the factor 16
    for i in range(32):
        if i <= 15:
            assert abs(float(f[i] / plain[i]) - 1) < 4 * U, i
        elif i >= 25:
            assert abs(float(f[i] / plain[i]) - 1 / 16) < 4 * U, i
        else:
            ramp = (i - 15) / 10
            assert abs(float(f[i] / plain[i]) - (1 - ramp + ramp / 16)) < 4 * U, i
    # strictly between the two regimes in the middle of the ramp
    assert 1 / 16 < float(f[20] / plain[20]) < 1


def test_rope_freqs_without_original_seq_len_has_no_yarn(flash):
    cfg = flash.replace(original_seq_len=0)
    ref = _base_freqs64(160000.0)
    assert float(((rope_freqs(cfg, 2).double() - ref).abs() / ref).max()) < 4 * U


@pytest.mark.parametrize("ratio", [0, 2])
def test_apply_rope_rotates_adjacent_pairs(flash, ratio):
    g = _gen(11 + ratio)
    positions = torch.tensor([0, 1, 37, 1000, 4093])
    freqs = rope_freqs(flash, ratio)
    freqs64 = _base_freqs64(10000.0) if ratio == 0 else _yarn_freqs64(160000.0, 15, 25, 16.0)
    x = _randn(g, 5, 3, 64)                                   # [n, heads, 64] FP32
    y = apply_rope(x, rope_cis(freqs, positions))
    assert y.dtype == torch.float32 and y.shape == x.shape
    ref = _rotate64(x, positions, freqs64)
    # the FP32 angle p * f_i is off by about (p + 1) * 2^-24 radians
    tol = (positions.double() + 1).view(-1, 1, 1) * 8 * U * x.abs().amax().double()
    assert bool(((y.double() - ref).abs() <= tol + 1e-6).all())
    # a unit vector on channel 0 turns into (cos, sin) on channels (0, 1), never channel 32
    e0 = torch.zeros(1, 64)
    e0[0, 0] = 1.0
    p = torch.tensor([3])
    r = apply_rope(e0, rope_cis(freqs, p))[0]
    th = 3 * float(freqs64[0])
    assert abs(float(r[0]) - math.cos(th)) < 1e-6 and abs(float(r[1]) - math.sin(th)) < 1e-6
    assert float(r[2:].abs().max()) == 0.0


def test_apply_rope_bf16_is_one_rounding_of_the_rotation(flash):
    g = _gen(12)
    positions = torch.tensor([5, 17, 300])
    x = _randn(g, 3, 4, 64, dtype=BF16)
    y = apply_rope(x, rope_cis(rope_freqs(flash, 2), positions))
    ref = _rotate64(x.double(), positions, _yarn_freqs64(160000.0, 15, 25, 16.0))
    _assert_bf16_of(y, ref, fp32_err=1e-5 * x.double().abs().amax())


def test_rope_at_position_zero_is_identity(flash):
    g = _gen(13)
    for ratio in (0, 2):
        cis = rope_cis(rope_freqs(flash, ratio), torch.zeros(4, dtype=torch.long))
        x = _randn(g, 4, 3, 512, dtype=BF16)
        assert bits_differ(rope_tail(x, cis, 64), x) == 0
        assert bits_differ(rope_tail(x, cis, 64, inverse=True), x) == 0


def test_rope_inverse_round_trip(flash):
    g = _gen(14)
    positions = torch.randint(0, 100_000, (6,), generator=g)
    positions[0] = 1
    for ratio in (0, 2):
        cis = rope_cis(rope_freqs(flash, ratio), positions)
        x = _randn(g, 6, 4, 512, dtype=BF16)
        y = rope_tail(x, cis, 64)
        assert bits_differ(y[..., :448], x[..., :448]) == 0                 # only the tail rotates
        assert float((y[..., 448:].float() - x[..., 448:].float()).abs().max()) > 0.1
        back = rope_tail(y, cis, 64, inverse=True)
        # two BF16 roundings: the first moves the pair by at most sqrt(2) 2^-8 of its length, the
        # rotation back keeps that length, the second moves each element by at most 2^-8 of itself
        pair = x[..., 448:].float().view(6, 4, 32, 2).norm(dim=-1).repeat_interleave(2, -1)
        err = (back[..., 448:].float() - x[..., 448:].float()).abs()
        assert bool((err <= (math.sqrt(2) + 1.01) * HALF_ULP * pair).all())
        assert float((err / pair).max()) > 0                   # (not trivially exact)
        assert bits_differ(back[..., :448], x[..., :448]) == 0
        # forward twice is not the identity (the inverse really is the conjugate)
        twice = rope_tail(y, cis, 64)
        assert float((twice[1:, :, 448:].float() - x[1:, :, 448:].float()).abs().max()) > 0.1


def test_rope_tail_does_not_modify_its_input(flash):
    g = _gen(15)
    x = _randn(g, 2, 3, 128, dtype=BF16)
    keep = x.clone()
    rope_tail(x, rope_cis(rope_freqs(flash, 2), torch.tensor([9, 10])), 64)
    assert bits_differ(x, keep) == 0


# ================================================================================ linears (section 3)


def _fp8_weight(gen: torch.Generator, n_out: int, n_in: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A random FP8 weight whose 32x32 tiles have different magnitudes (so every scale matters)."""
    w = _randn(gen, n_out, n_in, scale=n_in ** -0.5)
    tiles = 2.0 ** torch.randint(-3, 4, (-(-n_out // 32), -(-n_in // 32)), generator=gen).float()
    w = w * tiles.repeat_interleave(32, 0).repeat_interleave(32, 1)[:n_out, :n_in]
    return fp8_block_quantize(w)


def _activations(gen: torch.Generator, n: int, k: int) -> torch.Tensor:
    """BF16 [n, k] whose 32-blocks span several orders of magnitude (so every MXFP8 scale matters)."""
    x = _randn(gen, n, k)
    blocks = 10.0 ** torch.empty(n, k // 32).uniform_(-3, 3, generator=gen)
    return (x * blocks.repeat_interleave(32, 1)).to(BF16)


def test_fp8_linear_against_float64_of_the_dequantized_operands():
    g = _gen(21)
    n, k, n_out = 37, 160, 80                       # 5 K blocks; 80 outputs: a partial 32-row tile
    x = _activations(g, n, k)
    w, s = _fp8_weight(g, n_out, k)
    y = fp8_linear(x, w, s)
    assert y.dtype == BF16 and y.shape == (n, n_out)
    xd = mxfp8_dequantize(*mxfp8_quantize(x)).double()
    wd = fp8_block_dequantize(w, s).double()
    ref = xd @ wd.T
    # FP32: a 32-term partial per block, then the 5 partials in K order
    fp32_err = (32 + 5) * U * (xd.abs() @ wd.abs().T)
    _assert_bf16_of(y, ref, fp32_err)
    assert rel_rms(y, ref) < 2.0 ** -8
    # the test can tell: skipping the input quantization is far outside these bounds
    unquantized = x.double() @ wd.T
    assert rel_rms(unquantized, ref) > 4 * 2.0 ** -8
    # the scale may come as UE8M0 bytes
    assert bits_differ(fp8_linear(x, w, s.view(torch.uint8)), y) == 0


@pytest.mark.parametrize("n_out,k", [(80, 160), (1024, 1024)])   # a small and a large temporary
def test_fp8_linear_is_batch_invariant(n_out, k):
    g = _gen(22 + k)
    w, s = _fp8_weight(g, n_out, k)
    for n in (1, 3, 37):
        x = _activations(g, n, k)
        full = fp8_linear(x, w, s)
        for i in range(n):
            assert bits_differ(fp8_linear(x[i:i + 1], w, s), full[i:i + 1]) == 0, (n, i)


def test_bf16_linear_against_float64():
    g = _gen(23)
    x = _randn(g, 37, 96, dtype=BF16)
    w = _randn(g, 70, 96, scale=96 ** -0.5, dtype=BF16)
    y = bf16_linear(x, w)
    ref = x.double() @ w.double().T
    _assert_bf16_of(y, ref, 96 * U * (x.double().abs() @ w.double().abs().T))
    assert rel_rms(y, ref) < 2.0 ** -8


# rowwise_dot splits the rows into chunks of about 2^20..2^25 elements of [rows, N, K]: these shapes
# put a chunk boundary inside the 37 rows for either size
@pytest.mark.parametrize("n_out,k", [(70, 96), (128, 512), (1024, 1024)])
def test_bf16_linear_is_batch_invariant(n_out, k):
    g = _gen(24 + k)
    w = _randn(g, n_out, k, scale=k ** -0.5, dtype=BF16)
    for n in (1, 3, 37):
        x = _randn(g, n, k, dtype=BF16)
        full = bf16_linear(x, w)
        for i in range(n):
            assert bits_differ(bf16_linear(x[i:i + 1], w), full[i:i + 1]) == 0, (n, i)


@pytest.mark.parametrize("eps", [1e-20, 1e-6])
@pytest.mark.parametrize("wdtype", [BF16, torch.float32])
def test_rms_norm_against_float64(eps, wdtype):
    g = _gen(25)
    d = 96
    mags = torch.tensor([1e-4, 3e-3, 1.0, 7.0, 300.0, 1e-5, 1.0])
    x = (_randn(g, 7, d) * mags[:, None]).to(BF16)
    w = (1 + 0.1 * _randn(g, d)).to(wdtype)
    y = rms_norm(x, w, eps)
    xd = x.double()
    ref = w.double() * xd / torch.sqrt(xd.pow(2).mean(-1, keepdim=True) + eps)
    _assert_bf16_of(y, ref, 0.0)
    assert ulp_distance(y, ref) <= 0.5 + 1e-3           # correctly rounded up to FP32 noise
    if eps == 1e-6:   # eps dominates the row of magnitude 1e-5: its output stays small
        assert float(y[5].float().abs().max()) < 0.1 and float(y[2].float().abs().max()) > 1


# ============================================================================ compressor (section 3.4)


def _compressor_weights(gen: torch.Generator, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    wkv = _randn(gen, 512, dim, scale=dim ** -0.5)
    wgate = _randn(gen, 512, dim, scale=3 * dim ** -0.5)   # scores of spread ~3: uneven softmax weights
    return wkv, wgate


def _fresh_state() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.zeros(2, 512), torch.full((2, 512), float("-inf"))


def _compress64(x: torch.Tensor, p0: int, wkv: torch.Tensor, wgate: torch.Tensor) -> dict[int, torch.Tensor]:
    """{p: c} for each odd p among positions p0.. of rows x (x[0] at p0), with p0 even; float64."""
    assert p0 % 2 == 0
    kv = x.double() @ wkv.double().T
    sc = x.double() @ wgate.double().T
    out = {}
    for i in range(1, x.shape[0], 2):
        e0, e1 = torch.exp(sc[i - 1]), torch.exp(sc[i])
        out[p0 + i] = (e0 * kv[i - 1] + e1 * kv[i]) / (e0 + e1)
    return out


def _fp32_tol(x: torch.Tensor, wkv: torch.Tensor, wgate: torch.Tensor) -> float:
    """Bound of the FP32 error of c: the kv dot products plus the softmax weights' error."""
    kv_abs = (x.double().abs() @ wkv.double().abs().T).max()
    sc_abs = (x.double().abs() @ wgate.double().abs().T).max()
    kv_max = (x.double() @ wkv.double().T).abs().max()
    return float(x.shape[1] * U * kv_abs + 8 * x.shape[1] * U * sc_abs * kv_max + 16 * U * kv_max)


@pytest.mark.parametrize("p0", [0, 1, 6, 7])
def test_compress_ratio2_chunking_is_bitwise_invariant(p0):
    g = _gen(31 + p0)
    dim, n = 64, 13
    wkv, wgate = _compressor_weights(g, dim)
    first = p0 - (p0 % 2)                       # an odd start: the group's first row came earlier
    x = _randn(g, n + p0 - first, dim, dtype=BF16)
    earlier, x_call = x[: p0 - first], x[p0 - first:]
    positions = torch.arange(p0, p0 + n)
    states = []
    outs = []
    for split in ([n], [1] * n, [3, 1, 4, 5]):   # all at once, one by one, ragged chunks
        skv, ssc = _fresh_state()
        if earlier.shape[0]:
            c, rows = compress_ratio2(earlier, torch.tensor([first]), wkv, wgate, skv, ssc)
            assert c.shape == (0, 512) and rows.numel() == 0
        cs, done, at = [], [], 0
        for m in split:
            c, rows = compress_ratio2(x_call[at:at + m], positions[at:at + m], wkv, wgate, skv, ssc)
            assert c.dtype == torch.float32 and c.shape == (rows.numel(), 512)
            cs.append(c)
            done += [at + int(r) for r in rows]
            at += m
        # a group completes exactly at the rows with (p + 1) % 2 == 0
        assert done == [i for i, p in enumerate(positions.tolist()) if (p + 1) % 2 == 0]
        outs.append(torch.cat(cs))
        states.append((skv, ssc))
    for c, (skv, ssc) in zip(outs[1:], states[1:]):
        assert bits_differ(c, outs[0]) == 0
        assert bits_differ(skv, states[0][0]) == 0 and bits_differ(ssc, states[0][1]) == 0
    # and the values: float64 softmax-weighted sums over each group (the first row may be earlier)
    ref = _compress64(x, first, wkv, wgate)
    want = torch.stack([ref[p] for p in positions.tolist() if (p + 1) % 2 == 0])
    err = (outs[0].double() - want).abs().max()
    assert float(err) <= _fp32_tol(x, wkv, wgate), float(err)
    # the test can tell a BF16 rounding of c
    assert rel_rms(outs[0].to(BF16), want) > 1e2 * rel_rms(outs[0], want)


def test_compress_ratio2_softmax_weights_are_per_channel():
    g = _gen(32)
    dim = 48
    wkv, wgate = _compressor_weights(g, dim)
    x = _randn(g, 2, dim, dtype=BF16)
    skv, ssc = _fresh_state()
    c, rows = compress_ratio2(x, torch.tensor([0, 1]), wkv, wgate, skv, ssc)
    assert rows.tolist() == [1]
    ref = _compress64(x, 0, wkv, wgate)[1]
    assert float((c[0].double() - ref).abs().max()) <= _fp32_tol(x, wkv, wgate)
    kv = x.double() @ wkv.double().T
    sc = x.double() @ wgate.double().T
    w0 = torch.softmax(sc, dim=0)[0]
    assert float(w0.min()) < 0.1 and float(w0.max()) > 0.9          # the weights really differ
    plain_mean = kv.mean(0)
    assert float((c[0].double() - plain_mean).abs().max()) > 100 * _fp32_tol(x, wkv, wgate)


def test_compress_ratio2_fresh_state():
    g = _gen(33)
    dim = 32
    wkv, wgate = _compressor_weights(g, dim)
    x = _randn(g, 2, dim, dtype=BF16)
    kv = x.double() @ wkv.double().T
    sc = x.double() @ wgate.double().T
    tol = _fp32_tol(x, wkv, wgate)
    # p = 0 on a fresh state: nothing completes; slot 0 holds the row, slot 1 stays fresh
    skv, ssc = _fresh_state()
    c, rows = compress_ratio2(x[:1], torch.tensor([0]), wkv, wgate, skv, ssc)
    assert c.shape == (0, 512) and rows.tolist() == []
    assert float((skv[0].double() - kv[0]).abs().max()) <= tol
    assert float((ssc[0].double() - sc[0]).abs().max()) <= tol
    assert bool((skv[1] == 0).all()) and bool(torch.isneginf(ssc[1]).all())
    # p = 1 completes the first group
    c, rows = compress_ratio2(x[1:], torch.tensor([1]), wkv, wgate, skv, ssc)
    assert rows.tolist() == [0] and bool(torch.isfinite(c).all())
    assert float((c[0].double() - _compress64(x, 0, wkv, wgate)[1]).abs().max()) <= tol
    # a fresh state entered at p = 1: the -inf score gives the empty slot weight 0, not NaN
    skv, ssc = _fresh_state()
    c, rows = compress_ratio2(x[1:], torch.tensor([1]), wkv, wgate, skv, ssc)
    assert rows.tolist() == [0] and bool(torch.isfinite(c).all())
    assert bits_differ(c[0], skv[1]) == 0                         # exactly the row's own kv
    assert float((c[0].double() - kv[1]).abs().max()) <= tol


# ============================================================================ indexer (section 3.7)


def test_index_scores_with_the_official_bf16_roundings():
    g = _gen(41)
    n_heads, m = 32, 45
    iq = mxfp4_fake(_randn(g, n_heads, 128, dtype=BF16))
    keys = mxfp4_fake(_randn(g, m, 128, dtype=BF16))
    w = _randn(g, n_heads, scale=0.1, dtype=BF16)
    s = index_scores(iq, w, keys)
    assert s.dtype == BF16 and s.shape == (m,)
    # manual: logits rounded to BF16, relu, times w rounded to BF16, sum over heads, result BF16
    manual = torch.empty(m, dtype=F64)
    for j in range(m):
        total = 0.0
        for h in range(n_heads):
            logit = torch.tensor(float(iq[h].double() @ keys[j].double())).to(BF16).double()
            prod = torch.tensor(float(max(float(logit), 0.0) * float(w[h]))).to(BF16).double()
            total += float(prod)
        manual[j] = total
    manual_bf16 = manual.to(BF16)
    # the head sum runs in FP32: equal up to an occasional last-bit difference of the final rounding
    assert ulp_distance(s, manual_bf16) <= 1
    assert bits_differ(s, manual_bf16) <= m // 10
    # the test can tell: without the intermediate roundings the scores differ much more often
    exact = ((iq.double() @ keys.double().T).clamp(min=0) * w.double()[:, None]).sum(0).to(BF16)
    assert bits_differ(exact, manual_bf16) > bits_differ(s, manual_bf16) + 3


def test_compare_check_topk_invariants_helper():
    scores = torch.tensor([1.0, 3.0, 2.0, 3.0, 0.5], dtype=BF16)
    check_topk_invariants(torch.tensor([1, 2, 3, -1]), scores, 3)
    with pytest.raises(AssertionError):
        check_topk_invariants(torch.tensor([0, 1, 3, -1]), scores, 3)     # 2.0 left out for 1.0
    check_topk_invariants(torch.zeros(0, dtype=torch.long), scores, 0)


def _tied_scores(gen: torch.Generator, m: int) -> torch.Tensor:
    return (torch.randint(-4, 5, (m,), generator=gen).float() * 0.25).to(BF16)   # 9 values: many ties


@pytest.mark.parametrize("k", [0, 1, 5, 17, 39, 40])
def test_topk_ascending_invariants_with_ties(k):
    g = _gen(42 + k)
    m = 40
    for _ in range(5):
        scores = _tied_scores(g, m)
        idx = topk_ascending(scores, k)
        assert idx.dtype == torch.long and idx.shape == (k,)
        check_topk_invariants(idx, scores, k)
        # the chosen scores are the k largest as a multiset
        assert sorted(scores[idx].float().tolist()) == sorted(scores.float().tolist())[m - k:]
    if k == m:
        assert idx.tolist() == list(range(m))


def test_topk_ascending_puts_minus_inf_last_as_minus_one():
    g = _gen(43)
    m = 40
    for k in (20, 40):
        scores = _tied_scores(g, m)
        dead = torch.randperm(m, generator=g)[:25]
        scores[dead] = float("-inf")
        idx = topk_ascending(scores, k)
        assert idx.shape == (k,)
        check_topk_invariants(idx, scores, 15)            # the 15 finite scores, then -1 padding
        assert idx[:15].tolist() == sorted(set(range(m)) - set(dead.tolist()))
        assert idx[15:].tolist() == [-1] * (k - 15)
    # a smaller k never picks a -inf entry over a finite one
    scores = _tied_scores(g, m)
    scores[torch.randperm(m, generator=g)[:25]] = float("-inf")
    idx = topk_ascending(scores, 9)
    check_topk_invariants(idx, scores, 9)
    assert bool(torch.isfinite(scores[idx].float()).all())
    # all -inf: every index is -1
    assert topk_ascending(torch.full((6,), float("-inf"), dtype=BF16), 4).tolist() == [-1] * 4


def _check_candidates(mask: torch.Tensor, scores: torch.Tensor, bs: int, t: int) -> list[int]:
    """The invariants of spec 3.7's candidate pool; returns the kept blocks."""
    m = scores.shape[0]
    nb = -(-m // bs)
    assert mask.dtype == torch.bool and mask.shape == (m,)
    blocks = [list(range(b * bs, min(m, (b + 1) * bs))) for b in range(nb)]
    kept = []
    for b, ids in enumerate(blocks):
        v = mask[ids]
        assert bool(v.all()) or not bool(v.any()), f"block {b} partly kept"
        if bool(v.all()):
            kept.append(b)
    bmax = [max(float(scores[i]) for i in ids) for ids in blocks]
    assert nb - 1 in kept, "the newest block must be kept"
    assert len(kept) <= t
    others = [b for b in kept if b != nb - 1]
    assert all(bmax[b] != float("-inf") for b in others), "an all -inf block was kept"
    finite_rest = [b for b in range(nb - 1) if bmax[b] != float("-inf")]
    assert len(others) == min(t - 1, len(finite_rest))
    dropped = [b for b in finite_rest if b not in kept]
    if others and dropped:
        assert min(bmax[b] for b in others) >= max(bmax[b] for b in dropped)
    return kept


def _candidates_loop(scores: torch.Tensor, bs: int, t: int) -> list[int]:
    """Kept blocks by a plain loop (distinct block maxima): newest first, then by max, finite only."""
    m = scores.shape[0]
    nb = -(-m // bs)
    bmax = [max(float(scores[i]) for i in range(b * bs, min(m, (b + 1) * bs))) for b in range(nb)]
    order = [nb - 1] + sorted(range(nb - 1), key=lambda b: -bmax[b])
    return sorted(b for b in order[:t] if b == nb - 1 or bmax[b] != float("-inf"))


@pytest.mark.parametrize("m,bs,t", [(37, 8, 3), (40, 8, 3), (10, 4, 8), (1, 8, 3), (37, 8, 1),
                                    (2001, 8, 50), (9, 8, 2)])
def test_candidate_mask_distinct_scores(m, bs, t):
    g = _gen(44 + m)
    scores = torch.randperm(4 * m, generator=g)[:m].float() - 2 * m      # distinct, some negative
    if 4 * m <= 256:
        scores = scores.to(BF16)                                        # exact in BF16 up to 256
    mask = candidate_mask(scores, bs, t)
    kept = _check_candidates(mask, scores, bs, t)
    assert kept == _candidates_loop(scores, bs, t)
    assert len(kept) == min(t, -(-m // bs))


def test_candidate_mask_ties_and_dead_blocks():
    g = _gen(45)
    bs = 4
    for trial in range(20):
        m = int(torch.randint(1, 60, (1,), generator=g))
        t = int(torch.randint(1, 10, (1,), generator=g))
        scores = _tied_scores(g, m)
        nb = -(-m // bs)
        dead = torch.rand(nb, generator=g) < 0.4              # whole blocks of -inf
        for b in torch.nonzero(dead).flatten().tolist():
            scores[b * bs:(b + 1) * bs] = float("-inf")
        scores[torch.rand(m, generator=g) < 0.2] = float("-inf")   # and scattered -inf entries
        _check_candidates(candidate_mask(scores, bs, t), scores, bs, t)


def test_candidate_mask_keeps_an_all_minus_inf_newest_block_and_no_other():
    # blocks of 4: [1, 2, -inf, -inf], [-inf] * 4, [-inf, -inf] (the newest)
    scores = torch.tensor([1.0, 2.0] + [-math.inf] * 8, dtype=BF16)
    mask = candidate_mask(scores, 4, 8)
    assert mask.tolist() == [True] * 4 + [False] * 4 + [True] * 2


# =========================================================================== attention (section 3.8)


def _attention64(q: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor, sink: torch.Tensor,
                 scale: float) -> torch.Tensor:
    """o[h] = sum_j e^(s_hj) K_j / (sum_j e^(s_hj) + e^(sink_h)) over the valid keys, float64."""
    s = (q.double() @ keys.double().T) * scale                         # [H, m]
    s = s.masked_fill(~valid, float("-inf"))
    mx = torch.maximum(s.amax(-1), sink.double())
    mx = torch.where(torch.isfinite(mx), mx, s.amax(-1))
    p = torch.exp(s - mx[:, None])
    den = p.sum(-1) + torch.exp(sink.double() - mx)
    return (p @ keys.double()) / den[:, None]


def _attn_case(gen: torch.Generator, h: int, m: int, q_scale: float = 0.15):
    q = _randn(gen, h, 512, scale=q_scale, dtype=BF16)                 # logits of spread ~3
    keys = _randn(gen, m, 512, dtype=BF16)
    return q, keys


def _sink_near_lse(gen, q, keys, valid, scale):
    """Sinks around each head's log-sum-exp, so the sink takes a real share of the mass."""
    s = (q.double() @ keys.double().T * scale).masked_fill(~valid, float("-inf"))
    return (torch.logsumexp(s, -1) + torch.randn(q.shape[0], generator=gen, dtype=F64)).float()


def _check_attention(o: torch.Tensor, ref: torch.Tensor) -> None:
    assert o.dtype == BF16 and o.shape == ref.shape
    assert float((o.double() - ref).abs().max()) <= 2e-2 * float(ref.abs().max())   # kernel tolerance
    assert rel_rms(o, ref) < 5e-3


@pytest.mark.parametrize("m", [1, 5, 64, 65, 209])
def test_sparse_attention_against_float64(m):
    g = _gen(51 + m)
    h, scale = 6, 512 ** -0.5
    q, keys = _attn_case(g, h, m)
    valid = torch.rand(m, generator=g) < 0.6
    valid[m // 2] = True
    if m > 128:
        valid[:64] = False                       # a whole first block with no valid key
    sink = _sink_near_lse(g, q, keys, valid, scale)
    o = sparse_attention(q, keys, valid, sink, scale)
    ref = _attention64(q, keys, valid, sink, scale)
    _check_attention(o, ref)
    # the reference rounds only P and o to BF16: rounding o alone gives about 1.6e-3
    assert rel_rms(o, ref) < 3.5e-3
    # the test can tell: dropping the sink or the mask is far outside the tolerance
    no_sink = _attention64(q, keys, valid, torch.full((h,), float("-inf")), scale)
    assert rel_rms(no_sink, ref) > 0.05
    if not bool(valid.all()):
        unmasked = _attention64(q, keys, torch.ones(m, dtype=torch.bool), sink, scale)
        assert rel_rms(unmasked, ref) > 0.05


def test_sparse_attention_no_valid_key_gives_zeros():
    g = _gen(52)
    q, keys = _attn_case(g, 4, 70)
    sink = _randn(g, 4)
    o = sparse_attention(q, keys, torch.zeros(70, dtype=torch.bool), sink, 512 ** -0.5)
    assert o.dtype == BF16 and o.shape == (4, 512) and bool((o == 0).all())


def test_sparse_attention_sink_minus_inf_is_plain_softmax():
    g = _gen(53)
    h, m, scale = 5, 150, 512 ** -0.5
    q, keys = _attn_case(g, h, m)
    valid = torch.rand(m, generator=g) < 0.7
    o = sparse_attention(q, keys, valid, torch.full((h,), float("-inf")), scale)
    s = ((q.double() @ keys.double().T) * scale).masked_fill(~valid, float("-inf"))
    ref = torch.softmax(s, -1) @ keys.double()
    _check_attention(o, ref)
    assert rel_rms(o, ref) < 3.5e-3


def test_sparse_attention_one_valid_key():
    g = _gen(54)
    h, m, scale = 4, 130, 512 ** -0.5
    q, keys = _attn_case(g, h, m)
    valid = torch.zeros(m, dtype=torch.bool)
    valid[97] = True                                            # in the second block of 64
    # no sink: the output is that key, exactly (p = 1, sum = 1)
    o = sparse_attention(q, keys, valid, torch.full((h,), float("-inf")), scale)
    assert bits_differ(o, keys[97].expand(h, 512).contiguous()) == 0
    # with a sink: the key times 1 / (1 + e^(sink - s))
    sink = _randn(g, h)
    o = sparse_attention(q, keys, valid, sink, scale)
    s = (q.double() @ keys[97].double()) * scale
    ref = keys[97].double()[None, :] / (1 + torch.exp(sink.double() - s))[:, None]
    _assert_bf16_of(o, ref, 1e-5 * ref.abs().amax())


def test_sparse_attention_duplicate_keys_count_twice():
    # window tokens are not de-duplicated against compressed entries: the same key twice weighs double
    g = _gen(55)
    h, scale = 3, 512 ** -0.5
    q, keys = _attn_case(g, h, 10)
    dup = torch.cat([keys, keys[3:4]])
    valid = torch.ones(11, dtype=torch.bool)
    sink = _randn(g, h)
    o = sparse_attention(q, dup, valid, sink, scale)
    _check_attention(o, _attention64(q, dup, valid, sink, scale))
    assert rel_rms(o, _attention64(q, keys, valid[:10], sink, scale)) > 5e-3


def test_output_projection_inverse_rope_and_consecutive_head_groups(flash):
    g = _gen(56)
    n, h, groups, rank, dim = 3, 8, 4, 64, 96
    positions = torch.tensor([0, 5, 1234])
    cis = rope_cis(rope_freqs(flash, 2), positions)
    o = _randn(g, n, h, 512, dtype=BF16)
    wo_a = _randn(g, groups * rank, (h // groups) * 512, scale=((h // groups) * 512) ** -0.5, dtype=BF16)
    wo_b, wo_b_scale = _fp8_weight(g, dim, groups * rank)
    y = output_projection(o, cis, wo_a, wo_b, wo_b_scale, groups, 64)
    assert y.dtype == BF16 and y.shape == (n, dim)
    # float64: conjugate rotation of each head's tail, heads 2g, 2g+1 form group g
    freqs64 = _yarn_freqs64(160000.0, 15, 25, 16.0)
    orot = o.double().clone()
    orot[..., 448:] = _rotate64(o[..., 448:].double(), -positions, freqs64)
    orot = orot.to(BF16).double()                            # RoPE rounds back to BF16
    wa = wo_a.double().view(groups, rank, -1)
    z = torch.stack([orot.reshape(n, groups, -1)[:, gi] @ wa[gi].T for gi in range(groups)], 1)
    ref = mxfp8_dequantize(*mxfp8_quantize(z.reshape(n, -1).to(BF16))).double() \
        @ fp8_block_dequantize(wo_b, wo_b_scale).double().T
    # z's BF16 rounding (or an MXFP8 code) can land on the other side of a rounding point
    assert rel_rms(y, ref) < 2e-3
    # the test can tell strided head groups or a forward (not inverse) rotation
    strided = orot.view(n, h // groups, groups, 512).transpose(1, 2).reshape(n, groups, -1)
    z_bad = torch.stack([strided[:, gi] @ wa[gi].T for gi in range(groups)], 1)
    bad = z_bad.reshape(n, -1) @ fp8_block_dequantize(wo_b, wo_b_scale).double().T
    assert rel_rms(bad, ref) > 0.3


# ================================================================================ mHC (section 4)


def _sinkhorn64(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    c = torch.softmax(logits.double(), -1) + eps
    c = c / (c.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        c = c / (c.sum(-1, keepdim=True) + eps)
        c = c / (c.sum(-2, keepdim=True) + eps)
    return c


def test_sinkhorn_is_doubly_stochastic_after_20_iterations():
    g = _gen(61)
    # logits of spread 1: 20 rounds balance the rows to ~1e-6 (at spread 2 a few matrices in a
    # hundred still have rows off by 1e-2: Sinkhorn converges slowly there, the spec keeps 20)
    logits = _randn(g, 50, 4, 4, scale=1.0)
    c = sinkhorn(logits, 20, 1e-6)
    assert c.dtype == torch.float32 and c.shape == (50, 4, 4)
    assert bool((c > 0).all())
    assert float((c.sum(-2) - 1).abs().max()) < 1e-5          # the last step normalises columns
    assert float((c.sum(-1) - 1).abs().max()) < 1e-3
    # and the procedure itself, at a larger spread too
    for logits in (logits, _randn(g, 50, 4, 4, scale=3.0)):
        ref = _sinkhorn64(logits, 20, 1e-6)
        assert float((sinkhorn(logits, 20, 1e-6).double() - ref).abs().max()) < 1e-5
    # one round: row softmax + eps, then the column normalisation only (rows not yet balanced)
    one = sinkhorn(logits, 1, 1e-6)
    assert float((one.double() - _sinkhorn64(logits, 1, 1e-6)).abs().max()) < 1e-6
    assert float((one.sum(-1) - 1).abs().max()) > 1e-2


def _mix64(x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, norm_eps: float,
           hc_eps: float, iters: int):
    n, hc, _ = x.shape
    v = x.double().flatten(1)
    m = (v @ fn.double().T) / torch.sqrt(v.pow(2).mean(-1, keepdim=True) + norm_eps)
    sc, b = scale.double(), base.double()
    pre = torch.sigmoid(m[:, :hc] * sc[0] + b[:hc]) + hc_eps
    post = 2 * torch.sigmoid(m[:, hc:2 * hc] * sc[1] + b[hc:2 * hc])
    comb = _sinkhorn64((m[:, 2 * hc:] * sc[2] + b[2 * hc:]).view(n, hc, hc), iters, hc_eps)
    return pre, post, comb


def _mhc_case(gen: torch.Generator, n: int, dim: int = 64):
    hc = 4
    x = _randn(gen, n, hc, dim, dtype=BF16)
    fn = _randn(gen, hc * (2 + hc), hc * dim, scale=dim ** -0.5)
    scale = (0.5 + 0.5 * torch.rand(3, generator=gen)).to(BF16).float()
    base = _randn(gen, hc * (2 + hc), scale=0.5)
    return x, fn, scale, base


def test_hc_mixes_against_float64():
    g = _gen(62)
    x, fn, scale, base = _mhc_case(g, 7)
    mix = hc_mixes(x, fn, scale, base, 1e-20, 1e-6, 20)
    pre, post, comb = _mix64(x, fn, scale, base, 1e-20, 1e-6, 20)
    assert mix.pre.shape == (7, 4) and mix.post.shape == (7, 4) and mix.comb.shape == (7, 4, 4)
    assert float((mix.pre.double() - pre).abs().max()) < 1e-5
    assert float((mix.post.double() - post).abs().max()) < 1e-5
    assert float((mix.comb.double() - comb).abs().max()) < 1e-5
    assert float((mix.comb.double() - comb.transpose(-1, -2)).abs().max()) > 1e-2   # not symmetric


def test_hc_mixes_is_batch_invariant():
    g = _gen(63)
    x, fn, scale, base = _mhc_case(g, 5, dim=128)
    full = hc_mixes(x, fn, scale, base, 1e-20, 1e-6, 20)
    for i in range(5):
        one = hc_mixes(x[i:i + 1], fn, scale, base, 1e-20, 1e-6, 20)
        for a, b in zip(one, full):
            assert bits_differ(a, b[i:i + 1]) == 0, i


def test_hc_pre_against_float64():
    g = _gen(64)
    x = _randn(g, 6, 4, 96, dtype=BF16)
    pre = torch.sigmoid(_randn(g, 6, 4)) + 1e-6
    y = hc_pre(x, pre)
    ref = (pre.double()[:, :, None] * x.double()).sum(1)
    _assert_bf16_of(y, ref, 8 * U * (pre.double()[:, :, None] * x.double().abs()).sum(1))
    assert ulp_distance(y, ref) <= 1


def test_hc_post_against_float64():
    g = _gen(65)
    n, dim = 6, 96
    x = _randn(g, n, 4, dim, dtype=BF16)
    y = _randn(g, n, dim, dtype=BF16)
    post = 2 * torch.sigmoid(_randn(g, n, 4))
    comb = sinkhorn(_randn(g, n, 4, 4, scale=2.0), 20, 1e-6)
    out = hc_post(y, x, post, comb)
    assert out.dtype == BF16 and out.shape == (n, 4, dim)
    # new stream j = post[j] * y + sum_i comb[i, j] * x[i]
    ref = torch.empty(n, 4, dim, dtype=F64)
    absum = torch.empty(n, 4, dim, dtype=F64)
    for r in range(n):
        for j in range(4):
            terms = [post[r, j].double() * y[r].double()] + \
                    [comb[r, i, j].double() * x[r, i].double() for i in range(4)]
            ref[r, j] = sum(terms)
            absum[r, j] = sum(t.abs() for t in terms)
    _assert_bf16_of(out, ref, 8 * U * absum)
    assert row_ulp_distance(out, ref) <= 1
    # the test can tell comb transposed
    transposed = torch.einsum("rji,rid->rjd", comb.double(), x.double())
    bad = post.double()[:, :, None] * y.double()[:, None] + transposed
    assert rel_rms(bad, ref) > 0.05
