"""dsv41_decode.reference against independent re-derivations of spec sections 3-5: the indexer
(3.7), sparse attention and the output projection (3.8), mHC (4). RoPE, the linears and the
compressor are in test_rope_linear_compressor.py.

How the expected values are derived and the tolerances: reference_helpers.py.
"""

from __future__ import annotations

import math

import pytest
import torch

from dsv41_decode.formats import fp8_block_dequantize, mxfp4_fake, mxfp8_dequantize, mxfp8_quantize
from dsv41_decode.reference.attention import output_projection, sparse_attention
from dsv41_decode.reference.indexer import candidate_mask, index_scores, topk_ascending
from dsv41_decode.reference.mhc import hc_mixes, hc_post, hc_pre, sinkhorn
from dsv41_decode.reference.rope import rope_cis, rope_freqs
from dsv41_decode.testing.compare import (
    bits_differ, check_topk_invariants, rel_rms, row_ulp_distance, ulp_distance,
)

from reference_helpers import BF16, F64, U, _assert_bf16_of, _fp8_weight, _gen, _randn, _rotate64, _yarn_freqs64


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


# The tie rule (spec 3.7, "Ties"): at equal scores the higher index wins, for entries and blocks alike.

def _ranks_brute(values: torch.Tensor) -> torch.Tensor:
    """rank[i] = how many entries rank above i: a larger value, or an equal one at a higher index."""
    v = values.double()
    i = torch.arange(v.numel())
    above = (v[None, :] > v[:, None]) | ((v[None, :] == v[:, None]) & (i[None, :] > i[:, None]))
    return above.sum(1)


def _topk_brute(scores: torch.Tensor, k: int) -> list[int]:
    """The spec's top-k by definition: entries of rank < k, ascending, -inf ones as -1 at the end."""
    sel = torch.nonzero(_ranks_brute(scores) < k).flatten()
    finite = [int(j) for j in sel if float(scores[j]) != float("-inf")]
    return finite + [-1] * (k - len(finite))


def _candidates_brute(scores: torch.Tensor, bs: int, t: int) -> list[bool]:
    m = scores.shape[0]
    nb = -(-m // bs)
    bmax = torch.tensor([max(float(scores[i]) for i in range(b * bs, min(m, (b + 1) * bs))) for b in range(nb)])
    bmax[-1] = float("inf")
    keep = (_ranks_brute(bmax) < t) & (bmax != float("-inf"))
    return [bool(keep[j // bs]) for j in range(m)]


def _few_values(gen: torch.Generator, m: int, values: list[float], neg_inf: float = 0.0) -> torch.Tensor:
    """[m] BF16 scores drawn from `values` (hundreds of equal scores at any threshold), a fraction
    `neg_inf` of them -inf."""
    s = torch.tensor(values)[torch.randint(0, len(values), (m,), generator=gen)]
    s[torch.rand(m, generator=gen) < neg_inf] = float("-inf")
    return s.to(BF16)


def test_topk_ascending_ties_go_to_the_higher_index():
    s = torch.tensor([1.0, 3.0, 2.0, 3.0, 2.0, 2.0, 0.5], dtype=BF16)
    assert topk_ascending(s, 3).tolist() == [1, 3, 5]              # 2.0 at 2, 4, 5: index 5 wins
    assert topk_ascending(s, 4).tolist() == [1, 3, 4, 5]
    z = torch.tensor([0.0, -0.0, 0.0, -0.0, -1.0], dtype=BF16)      # -0.0 == +0.0: a tie
    assert topk_ascending(z, 2).tolist() == [2, 3]


@pytest.mark.parametrize("m,k,neg_inf", [(600, 512, 0.0), (1000, 512, 0.3), (700, 40, 0.0), (300, 300, 0.5),
                                         (50, 50, 0.9), (1, 1, 0.0)])
def test_topk_ascending_against_brute_force(m, k, neg_inf):
    g = _gen(46 + m + k)
    for values in ([1.0, 0.5, -2.0], [3.0, 0.0, -0.0, 0.25, 1.0, -1.0, 2.0], [7.0]):
        scores = _few_values(g, m, values, neg_inf)
        idx = topk_ascending(scores, k)
        assert idx.tolist() == _topk_brute(scores, k)
        check_topk_invariants(idx, scores, min(k, int(torch.isfinite(scores.float()).sum())))


def test_candidate_mask_ties_go_to_the_higher_block():
    # blocks of 4: maxima 2, 2, 1, 2, [newest] -> with 3 kept: the newest, then blocks 3 and 1
    s = torch.tensor([2.0, 0, 0, 0, 0, 2.0, 0, 0, 1.0, 0, 0, 0, 0, 0, 0, 2.0, 0, 0], dtype=BF16)
    assert candidate_mask(s, 4, 3).tolist() == [False] * 4 + [True] * 4 + [False] * 4 + [True] * 6


@pytest.mark.parametrize("m,bs,t,neg_inf", [(2000, 8, 60, 0.0), (2000, 8, 60, 0.8), (37, 4, 5, 0.3),
                                            (64, 8, 8, 0.0), (63, 8, 100, 0.5), (1, 8, 3, 0.0)])
def test_candidate_mask_against_brute_force(m, bs, t, neg_inf):
    g = _gen(47 + m + t)
    for values in ([1.0, 0.5, -2.0], [3.0, 0.0, -0.0, 0.25, 1.0, -1.0, 2.0]):
        scores = _few_values(g, m, values, neg_inf)
        mask = candidate_mask(scores, bs, t)
        assert mask.tolist() == _candidates_brute(scores, bs, t)
        _check_candidates(mask, scores, bs, t)


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
