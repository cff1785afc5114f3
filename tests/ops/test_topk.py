"""ops/topk.py against reference.indexer.topk_ascending / candidate_mask (interpreter on the CPU;
GPU at 32K-1M entries). Top-k is checked with `check_topk_invariants` (ties make index sets
ambiguous) and as a set equal to the reference's where the scores are distinct."""

import pytest
import torch

from dsv41_decode.ops.topk import TopKPlan, candidate_mask, candidate_mask_, topk_ascending, topk_ascending_
from dsv41_decode.reference import indexer as ref
from dsv41_decode.testing.compare import check_topk_invariants

_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _scores(rows, entries, seed, distinct=True, neg_inf_frac=0.0):
    """[rows, entries] FP32 BF16-representable scores; distinct ones are a shuffled BF16 ladder."""
    g = torch.Generator().manual_seed(seed)
    if distinct:   # distinct: a permutation of small integers times a random power of two (exact in BF16)
        base = torch.stack([(torch.randperm(entries, generator=g).float() - entries // 2) for _ in range(rows)])
        base = base.clamp(-256, 256) * torch.exp2(torch.randint(-20, 20, (rows, entries), generator=g).float())
    else:
        base = torch.randint(-3, 4, (rows, entries), generator=g).float()
    if neg_inf_frac:
        base[torch.rand(rows, entries, generator=g) < neg_inf_frac] = float("-inf")
    return base


def _check_row(idx, s, k, exact):
    exact = exact and torch.unique(s).numel() == s.numel()
    fin = int(torch.isfinite(s).sum())
    k_valid = min(k, fin)
    check_topk_invariants(idx, s, k_valid)
    if exact:
        r = ref.topk_ascending(s, min(k, s.numel()))
        assert set(idx[idx >= 0].tolist()) == set(r[r >= 0].tolist())


@pytest.mark.parametrize("rows,entries,k", [(1, 1, 512), (1, 7, 512), (3, 40, 16), (3, 300, 64),
                                            (1, 2000, 512), (3, 2000, 512), (1, 300, 300)])
def test_topk_distinct(rows, entries, k):
    s = _scores(rows, entries, seed=entries + rows).to(_DEVICE)
    nv = torch.tensor([entries - 3 * i if entries > 3 * i else entries for i in range(rows)], dtype=torch.int32, device=_DEVICE)
    out = topk_ascending(s, nv, k).cpu()
    assert out.shape == (rows, k) and out.dtype == torch.int32
    for i in range(rows):
        m = int(nv[i])
        _check_row(out[i], s[i, :m].cpu(), k, exact=True)


def test_topk_many_ties_and_neg_inf():
    s = _scores(3, 2000, seed=5, distinct=False, neg_inf_frac=0.3).to(_DEVICE)
    s[2, 10:] = float("-inf")          # fewer finite scores than k
    nv = torch.tensor([2000, 1500, 2000], dtype=torch.int32, device=_DEVICE)
    out = topk_ascending(s, nv, 512).cpu()
    for i in range(3):
        _check_row(out[i], s[i, :int(nv[i])].cpu(), 512, exact=False)


def test_topk_empty_rows_and_plan_reuse():
    s = _scores(3, 40, seed=9).to(_DEVICE)
    plan = TopKPlan.build(4, 16, device=_DEVICE, chunk=16)
    out = torch.empty(3, 16, dtype=torch.int32, device=_DEVICE)
    for nv in ([0, 0, 0], [40, 0, 1], [5, 40, 17]):
        nvt = torch.tensor(nv, dtype=torch.int32, device=_DEVICE)
        topk_ascending_(s, nvt, out, plan)
        for i in range(3):
            _check_row(out[i].cpu(), s[i, :nv[i]].cpu(), 16, exact=True)
    assert bool((topk_ascending(s, torch.zeros(3, dtype=torch.int32, device=_DEVICE), 16) == -1).all())


def _ref_mask(s, m):
    return ref.candidate_mask(s[:m], 8, 2048) if m else torch.zeros(0, dtype=torch.bool)


@pytest.mark.parametrize("rows,entries,nvis", [(1, 1, [1]), (1, 7, [7]), (3, 40, [40, 0, 33]), (3, 300, [300, 299, 9]),
                                               (1, 2000, [2000])])
def test_candidate_mask_distinct(rows, entries, nvis):
    s = _scores(rows, entries, seed=entries).to(_DEVICE)
    nv = torch.tensor(nvis, dtype=torch.int32, device=_DEVICE)
    for topk_blocks in (2048, 5):
        plan = TopKPlan.build(rows, topk_blocks, 8, device=_DEVICE, chunk=64)
        out = torch.full((rows, entries), 7, dtype=torch.uint8, device=_DEVICE)
        candidate_mask_(s, nv, out, plan)
        out = out.cpu()
        for i in range(rows):
            m = nvis[i]
            r = ref.candidate_mask(s[i, :m].cpu(), 8, topk_blocks) if m else torch.zeros(0, dtype=torch.bool)
            bm = torch.nn.functional.pad(s[i, :m].cpu(), (0, (-m) % 8), value=float("-inf")).view(-1, 8).amax(-1)
            if torch.unique(bm[:-1]).numel() == bm.numel() - 1:   # distinct block maxima
                assert torch.equal(out[i, :m].bool(), r)
            assert int(out[i, :m].sum()) == int(r.sum())
            assert bool((out[i, m:] == 0).all())


def test_candidate_mask_ties_and_neg_inf():
    s = _scores(2, 300, seed=3, distinct=False, neg_inf_frac=0.5).to(_DEVICE)
    s[1, :] = float("-inf")
    nv = torch.tensor([300, 300], dtype=torch.int32, device=_DEVICE)
    plan = TopKPlan.build(2, 10, 8, device=_DEVICE, chunk=64)
    out = candidate_mask_(s, nv, torch.empty(2, 300, dtype=torch.uint8, device=_DEVICE), plan).cpu()
    bm = torch.nn.functional.pad(s.cpu(), (0, 4), value=float("-inf")).view(2, -1, 8).amax(-1)
    bm[:, -1] = float("inf")
    kept = out.view(torch.uint8)
    kept_blocks = torch.nn.functional.pad(kept, (0, 4)).view(2, -1, 8).amax(-1).bool()
    for i in range(2):
        n_ok = int((bm[i] > float("-inf")).sum())
        assert int(kept_blocks[i].sum()) == min(10, n_ok)
        if bool((~kept_blocks[i]).any()) and bool(kept_blocks[i].any()):
            assert float(bm[i][kept_blocks[i]].min()) >= float(bm[i][~kept_blocks[i]].max())
        assert bool(kept_blocks[i, -1])
    # within kept blocks, every entry < n_vis is set
    assert bool((kept[:, :296].view(2, -1, 8).amin(-1) == kept[:, :296].view(2, -1, 8).amax(-1)).all())


def test_bad_inputs_named():
    s = _scores(2, 40, seed=1).to(_DEVICE)
    nv = torch.full((2,), 40, dtype=torch.int32, device=_DEVICE)
    plan = TopKPlan.build(2, 16, device=_DEVICE)
    out = torch.empty(2, 16, dtype=torch.int32, device=_DEVICE)
    with pytest.raises(ValueError, match="scores"):
        topk_ascending_(s.double(), nv, out, plan)
    with pytest.raises(ValueError, match="n_vis"):
        topk_ascending_(s, nv.long(), out, plan)
    with pytest.raises(ValueError, match="out"):
        topk_ascending_(s, nv, out.long(), plan)
    with pytest.raises(ValueError, match="out"):
        topk_ascending_(s, nv, out[:, :8], plan)
    with pytest.raises(ValueError, match="max_rows"):
        topk_ascending_(s, nv, out, TopKPlan.build(1, 16, device=_DEVICE))
    with pytest.raises(ValueError, match="plan"):
        topk_ascending_(s, nv, out, TopKPlan.build(2, 16, 8, device=_DEVICE))
    with pytest.raises(ValueError, match="k must"):
        TopKPlan.build(2, 0)
    with pytest.raises(ValueError, match="out"):
        candidate_mask_(s, nv, torch.empty(2, 39, dtype=torch.uint8, device=_DEVICE), TopKPlan.build(2, 16, 8, device=_DEVICE))


@pytest.mark.gpu
@pytest.mark.parametrize("rows,entries", [(1, 131072), (1, 1 << 20), (1, 32768), (4, 32768), (16, 32768), (64, 32768)])
def test_gpu_large(rows, entries):
    s = torch.randn(rows, entries, device=_DEVICE).bfloat16().float()
    nv = torch.tensor([entries - 7 * i for i in range(rows)], dtype=torch.int32, device=_DEVICE)
    out = topk_ascending(s, nv, 512)
    mask = candidate_mask(s, nv)
    for i in range(rows):
        m = int(nv[i])
        check_topk_invariants(out[i].cpu(), s[i, :m].cpu(), 512)
        r = ref.candidate_mask(s[i, :m], 8, 2048)
        bm = torch.nn.functional.pad(s[i, :m], (0, (-m) % 8), value=float("-inf")).view(-1, 8).amax(-1)
        if torch.unique(bm).numel() == bm.numel():
            assert torch.equal(mask[i, :m].bool(), r)
        assert int(mask[i, :m].sum()) == int(r.sum())


@pytest.mark.parametrize("small_max,max_chunks", [(0, 1024), (0, 1)])
def test_topk_multi_program_paths(monkeypatch, small_max, max_chunks):
    """The multi-program paths (ordered compaction; radix + sort past the chunk cap), forced at CPU
    sizes, with plan reuse (the ordered path relies on its histograms being left zero)."""
    from dsv41_decode.ops import topk as topk_mod
    monkeypatch.setattr(topk_mod, "_SMALL_MAX", small_max)
    monkeypatch.setattr(topk_mod, "_MAX_CHUNKS", max_chunks)
    plan = TopKPlan.build(3, 64, device=_DEVICE, chunk=64)
    out = torch.empty(3, 64, dtype=torch.int32, device=_DEVICE)
    for seed, distinct, nv in ((1, True, [300, 299, 9]), (2, False, [300, 0, 170]), (3, True, [64, 65, 1])):
        s = _scores(3, 300, seed=seed, distinct=distinct, neg_inf_frac=0.0 if distinct else 0.3).to(_DEVICE)
        topk_ascending_(s, torch.tensor(nv, dtype=torch.int32, device=_DEVICE), out, plan)
        for i in range(3):
            _check_row(out[i].cpu(), s[i, :nv[i]].cpu(), 64, exact=distinct)
    cplan = TopKPlan.build(3, 5, 1, device=_DEVICE, chunk=64)   # a group-1 plan used for a mask, then top-k
    candidate_mask_(s, torch.tensor(nv, dtype=torch.int32, device=_DEVICE), torch.empty(3, 300, dtype=torch.uint8, device=_DEVICE), cplan)
    out5 = torch.empty(3, 5, dtype=torch.int32, device=_DEVICE)
    topk_ascending_(s, torch.tensor(nv, dtype=torch.int32, device=_DEVICE), out5, cplan)
    for i in range(3):
        _check_row(out5[i].cpu(), s[i, :nv[i]].cpu(), 5, exact=True)


def test_topk_row_kernel_many_blocks(monkeypatch):
    """The one-program row kernel looping over several blocks (carried counts across blocks)."""
    from dsv41_decode.ops import topk as topk_mod
    monkeypatch.setattr(topk_mod, "_SMALL_BLOCK", 64)
    for seed, distinct, nv in ((4, True, [300, 299, 9]), (5, False, [300, 0, 170])):
        s = _scores(3, 300, seed=seed, distinct=distinct, neg_inf_frac=0.0 if distinct else 0.3).to(_DEVICE)
        out = topk_ascending(s, torch.tensor(nv, dtype=torch.int32, device=_DEVICE), 64).cpu()
        for i in range(3):
            _check_row(out[i], s[i, :nv[i]].cpu(), 64, exact=distinct)
