"""dsv41_decode.reference against independent re-derivations of spec sections 3-5: RoPE (5), the
linears and RMSNorm (3), the ratio-2 compressor (3.4). The indexer, attention and mHC are in
test_indexer_attention_mhc.py.

How the expected values are derived and the tolerances: reference_helpers.py.
"""

from __future__ import annotations

import math

import pytest
import torch

from dsv41_decode.formats import fp8_block_dequantize, mxfp8_dequantize, mxfp8_quantize
from dsv41_decode.reference.compressor import compress_ratio2
from dsv41_decode.reference.linear import bf16_linear, fp8_linear, rms_norm
from dsv41_decode.reference.rope import apply_rope, rope_cis, rope_freqs, rope_tail
from dsv41_decode.testing.compare import bits_differ, rel_rms, ulp_distance

from reference_helpers import (
    BF16, HALF_ULP, U, _assert_bf16_of, _base_freqs64, _fp8_weight, _gen, _randn, _rotate64, _yarn_freqs64,
)


# ================================================================================ RoPE (section 5)





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
