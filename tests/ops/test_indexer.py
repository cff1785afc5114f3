"""ops/indexer.py against reference.indexer.index_scores on the same decoded keys (interpreter on
the CPU; GPU at 32K-1M entries).

Tolerance: every product in the kernel is exact (E2M1 codes times powers of two, BF16 weights), so
the only difference from the reference is the FP32 summation order over the 128 dims and over the
heads; such sums of few-bit terms are almost always exact, so scores are bit-exact in practice
(asserted on >= 99% of entries) and everywhere within one BF16 ulp of the row's largest |score|.
Where a head sum does round, the two orders' FP32 scores differ by a few FP32 ulps (~2^-21
relative), and the BF16 scores differ only where that straddles a BF16 rounding midpoint (spacing
2^-8..2^-7 relative): a chance of about 2^-13 per score. So a correct kernel leaves ~1e-4 of the
scores unequal, 100x under the 1 % allowed, while a wrong head, weight, key or scale moves most of
them.
"""

import pytest
import torch

from dsv41_decode.formats import mxfp4_fake
from dsv41_decode.records import pack_index_key, unpack_index_key
from dsv41_decode.ops.indexer import index_scores_mxfp4, index_scores_mxfp4_
from dsv41_decode.reference.indexer import index_scores
from dsv41_decode.testing.compare import row_ulp_distance

_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
_PAGE = 16


def make_inputs(rows: int, heads: int, n_vis: list[int], seed: int, slots: int | None = None):
    """(iq, w, pool, block_table, req_slot, n_vis) with shuffled pages; row i reads slot i % slots."""
    g = torch.Generator().manual_seed(seed)
    slots = slots or rows
    req_slot = torch.arange(rows) % slots
    pages = max(1, -(-max(n_vis + [1]) // _PAGE))
    perm = torch.randperm(slots * pages + 3, generator=g)[:slots * pages]
    block_table = perm.view(slots, pages).int()
    keys = torch.randn(slots * pages + 3, _PAGE, 128, generator=g)
    keys = keys * torch.exp2(torch.randint(-2, 3, (slots * pages + 3, _PAGE, 1), generator=g).float())
    pool = pack_index_key(keys.view(-1, 128))
    iq = mxfp4_fake(torch.randn(rows, heads, 128, generator=g)).bfloat16()
    w = (torch.randn(rows, heads, generator=g) * 0.1).bfloat16()
    dev = lambda t: t.to(_DEVICE)
    return (dev(iq), dev(w), dev(pool), dev(block_table), dev(req_slot.int()),
            dev(torch.tensor(n_vis, dtype=torch.int32)))


def reference_scores(iq, w, pool, block_table, req_slot, n_vis, max_entries, cand=None):
    out = torch.full((iq.shape[0], max_entries), float("-inf"))
    for i in range(iq.shape[0]):
        m = int(n_vis[i])
        if m == 0:
            continue
        j = torch.arange(m)
        rec = block_table[int(req_slot[i])].cpu().long()[j // _PAGE] * _PAGE + j % _PAGE
        keys = unpack_index_key(pool.cpu()[rec])
        s = index_scores(iq[i].cpu(), w[i].cpu(), keys).float()
        if cand is not None:
            s = torch.where(cand[i, :m].cpu().bool(), s, torch.tensor(float("-inf")))
        out[i, :m] = s
    return out


def _check(got, ref):
    got = got.cpu()
    assert torch.equal(torch.isinf(got) & (got < 0), torch.isinf(ref) & (ref < 0)), "-inf positions differ"
    fin = torch.isfinite(ref)
    assert torch.equal(got[fin].bfloat16().float(), got[fin]), "scores must be BF16-representable"
    for i in range(ref.shape[0]):
        f = fin[i]
        if f.any():
            assert row_ulp_distance(got[i, f], ref[i, f]) <= 1.0
    if fin.any():
        assert float((got[fin] == ref[fin]).float().mean()) >= 0.99


def _scores(args, max_entries, cand_mask=None, fp8_dot=False):
    out = torch.empty(args[0].shape[0], max_entries, dtype=torch.float32, device=args[0].device)
    return index_scores_mxfp4_(*args[:4], _PAGE, *args[4:], out, cand_mask=cand_mask, fp8_dot=fp8_dot)


@pytest.mark.parametrize("fp8_dot", [False, True])
@pytest.mark.parametrize("rows,heads,n_vis,max_entries", [
    (1, 4, [1], 1), (1, 32, [7], 7), (3, 16, [40, 0, 33], 40), (3, 8, [300, 299, 1], 320), (1, 32, [2000], 2000),
])
def test_dense_matches_reference(rows, heads, n_vis, max_entries, fp8_dot):
    args = make_inputs(rows, heads, n_vis, seed=rows * 1000 + max_entries)
    got = _scores(args, max_entries, fp8_dot=fp8_dot)
    _check(got, reference_scores(*args, max_entries))


@pytest.mark.parametrize("fp8_dot", [False, True])
def test_candidate_restricted(fp8_dot):
    args = make_inputs(3, 16, [300, 120, 5], seed=7)
    g = torch.Generator().manual_seed(3)
    cand = (torch.rand(3, 320, generator=g) < 0.3).to(_DEVICE)
    got = _scores(args, 320, cand_mask=cand, fp8_dot=fp8_dot)
    _check(got, reference_scores(*args, 320, cand=cand))


def test_fp8_path_exact_at_the_scale_extremes():
    # query blocks of very different magnitudes (one all zero), key scales far from 1: the E4M3
    # operands and the powers of two that restore them stay exact
    _scale_extremes_case()


def _scale_extremes_case():
    iq, w, pool, bt, slot, nv = make_inputs(2, 8, [64, 50], seed=11)
    iq = iq.float().cpu()
    iq[0, :, :32] *= 2.0 ** -40
    iq[0, :, 32:64] = 0.0
    iq[1, :, 64:96] *= 2.0 ** 40
    iq = iq.bfloat16().to(_DEVICE)
    pool = pool.cpu().clone()
    pool[:, 64] = torch.randint(90, 160, (pool.shape[0],), dtype=torch.uint8)    # block 0's scale byte
    pool = pool.to(_DEVICE)
    args = (iq, w, pool, bt, slot, nv)
    _check(_scores(args, 64, fp8_dot=True), reference_scores(*args, 64))


def test_bad_inputs_named():
    iq, w, pool, bt, slot, nv = make_inputs(1, 4, [10], seed=1)
    out = torch.empty(1, 16, device=_DEVICE)
    with pytest.raises(ValueError, match="iq"):
        index_scores_mxfp4_(iq.float(), w, pool, bt, _PAGE, slot, nv, out)
    with pytest.raises(ValueError, match="w "):
        index_scores_mxfp4_(iq, w[:, :2], pool, bt, _PAGE, slot, nv, out)
    with pytest.raises(ValueError, match="pool"):
        index_scores_mxfp4_(iq, w, pool[:, :64], bt, _PAGE, slot, nv, out)
    with pytest.raises(ValueError, match="block_table"):
        index_scores_mxfp4_(iq, w, pool, bt.long(), _PAGE, slot, nv, out)
    with pytest.raises(ValueError, match="page"):
        index_scores_mxfp4_(iq, w, pool, bt, 0, slot, nv, out)
    with pytest.raises(ValueError, match="n_vis"):
        index_scores_mxfp4_(iq, w, pool, bt, _PAGE, slot, nv.long(), out)
    with pytest.raises(ValueError, match="req_slot"):
        index_scores_mxfp4_(iq, w, pool, bt, _PAGE, slot[:0], nv, out)
    # the kernel reads req_slot[n] and n_vis[n] at unit stride: a strided view is refused, not misread
    iq2, w2, pool2, bt2, slot2, nv2 = make_inputs(2, 4, [10, 20], seed=2)
    out2 = torch.empty(2, 32, device=_DEVICE)
    with pytest.raises(ValueError, match=r"req_slot must be a contiguous \[N=2\].*strides \(2,\)"):
        index_scores_mxfp4_(iq2, w2, pool2, bt2, _PAGE, slot2.repeat_interleave(2)[::2], nv2, out2)
    with pytest.raises(ValueError, match=r"n_vis must be a contiguous \[N=2\].*strides \(2,\)"):
        index_scores_mxfp4_(iq2, w2, pool2, bt2, _PAGE, slot2, nv2.repeat_interleave(2)[::2], out2)
    with pytest.raises(ValueError, match="out"):
        index_scores_mxfp4_(iq, w, pool, bt, _PAGE, slot, nv, out.double())
    with pytest.raises(ValueError, match="cand_mask"):
        index_scores_mxfp4_(iq, w, pool, bt, _PAGE, slot, nv, out, cand_mask=torch.ones(1, 3, dtype=torch.bool))


def test_non_tensor_and_bad_launch_arguments_name_the_argument():
    iq, w, pool, bt, slot, nv = make_inputs(1, 4, [10], seed=1)
    args = dict(iq=iq, w=w, pool=pool, block_table=bt, page=_PAGE, req_slot=slot, n_vis=nv,
                out=torch.empty(1, 16, device=_DEVICE))
    for name in ("iq", "w", "pool", "block_table", "req_slot", "n_vis", "out", "cand_mask"):
        for bad in ([1.0, 2.0], 3) if name == "cand_mask" else (None, [1.0, 2.0]):
            with pytest.raises(TypeError, match=f"{name} must be a torch.Tensor"):
                index_scores_mxfp4_(**{**args, name: bad})
    with pytest.raises(TypeError, match="iq must be a torch.Tensor"):
        index_scores_mxfp4(None, w, pool, bt, _PAGE, slot, nv, 16)
    with pytest.raises(ValueError, match="max_entries must be a non-negative int, got None"):
        index_scores_mxfp4(iq, w, pool, bt, _PAGE, slot, nv, None)
    for kw, match in ((dict(page=True), "page must be a positive int, got True"),
                      (dict(block_e=16.0), "block_e must be a power of two >= 16, got 16.0"),
                      (dict(block_e=None), "block_e must be a power of two >= 16, got None"),
                      (dict(num_warps=3), "num_warps must be a power of two in 1..16, got 3"),
                      (dict(num_warps=4.0), "num_warps must be a power of two in 1..16, got 4.0"),
                      (dict(programs_per_sm=0), "programs_per_sm must be a positive int, got 0"),
                      (dict(programs_per_sm=None), "programs_per_sm must be a positive int, got None"),
                      (dict(fp8_dot="no"), "fp8_dot must be a bool, got 'no'")):
        with pytest.raises((TypeError, ValueError), match=match):
            index_scores_mxfp4_(**{**args, **kw})


@pytest.mark.gpu
@pytest.mark.parametrize("rows,entries", [(1, 131072), (1, 1 << 20), (1, 32768), (4, 32768), (16, 32768), (64, 32768)])
@pytest.mark.parametrize("fp8_dot", [False, True])
def test_gpu_large(rows, entries, fp8_dot):
    args = make_inputs(rows, 32, [entries - i for i in range(rows)], seed=entries + rows)
    got = _scores(args, entries, fp8_dot=fp8_dot)
    iq, w, pool, bt, slot, nv = args
    j = torch.randint(0, entries - rows, (4096,), device=_DEVICE)   # a sample: the reference is slow
    for i in range(rows):
        rec = bt[int(slot[i])].long()[j // _PAGE] * _PAGE + j % _PAGE
        s = index_scores(iq[i], w[i], unpack_index_key(pool[rec])).float()
        assert row_ulp_distance(got[i, j].cpu(), s.cpu()) <= 1.0
        assert float((got[i, j] == s).float().mean()) >= 0.99
        assert bool(torch.isneginf(got[i, int(nv[i]):]).all())


@pytest.mark.gpu
@pytest.mark.parametrize("fp8_dot", [False, True])
@pytest.mark.parametrize("heads", [32, 64])
def test_gpu_candidate_masks_and_64_heads(heads, fp8_dot):
    # The Triton path is the Gluon scorer's expected result in its GPU tests, at 64 heads (the FP8
    # path's launch of 8 warps) and with candidate masks: against the reference here, dense and
    # masked, over pages of several requests and rows ending inside a page.
    args = make_inputs(4, heads, [2048, 1500, 333, 7], seed=heads + 9)
    g = torch.Generator().manual_seed(heads)
    cand = (torch.rand(4, 2048, generator=g) < 0.3).to(_DEVICE)
    _check(_scores(args, 2048, fp8_dot=fp8_dot), reference_scores(*args, 2048))
    _check(_scores(args, 2048, cand_mask=cand, fp8_dot=fp8_dot), reference_scores(*args, 2048, cand=cand))


@pytest.mark.gpu
def test_gpu_fp8_path_against_bf16_path_and_extremes():
    # On the GPU the FP8 path's per-block sums come from FP8 tensor cores, whose accumulator keeps
    # a limited number of bits; a block's 32 exact products need 13. Any loss shows as scores that
    # differ from the BF16 path's (exact per product, FP32 sums): require agreement on >= 99.9 %
    # of 128K entries and at most one BF16 ulp anywhere, and the scale extremes as on the CPU.
    args = make_inputs(2, 32, [131072, 131000], seed=21)
    a, b = _scores(args, 131072, fp8_dot=True), _scores(args, 131072, fp8_dot=False)
    assert torch.equal(torch.isneginf(a), torch.isneginf(b))
    for i in range(2):
        f = torch.isfinite(b[i])
        assert row_ulp_distance(a[i, f].cpu(), b[i, f].cpu()) <= 1.0
        assert float((a[i, f] == b[i, f]).float().mean()) >= 0.999
    _scale_extremes_case()
