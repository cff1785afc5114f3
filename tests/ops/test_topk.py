"""ops/topk.py against reference.indexer.topk_ascending / candidate_mask (interpreter on the CPU;
GPU at 8K-4M entries). The tie rule (spec 3.7: at equal scores the higher index wins, for entries
and blocks) makes both selections unique, so the kernels must equal the reference exactly, on
tie-heavy inputs too (scores drawn from a handful of BF16 values), and repeat bitwise."""

import pytest
import torch

from dsv41_decode.ops.common import num_sms
from dsv41_decode.ops.topk import (TopKPlan, candidate_mask, candidate_mask_, key_high_histogram, topk_ascending,
                                   topk_ascending_)
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


_FEW = (2.0, 1.0, 0.5, 0.0, -0.0, -1.5)   # BF16 values; -0.0 ties with 0.0


def _few_values(rows, entries, seed, values=_FEW, neg_inf_frac=0.0, device=_DEVICE):
    """[rows, entries] FP32 scores drawn from a handful of BF16 values, so hundreds to millions of
    entries tie at any threshold (and whole blocks tie at their maxima); a fraction -inf."""
    g = torch.Generator().manual_seed(seed)
    s = torch.tensor(values)[torch.randint(0, len(values), (rows, entries), generator=g)]
    if neg_inf_frac:
        s[torch.rand(rows, entries, generator=g) < neg_inf_frac] = float("-inf")
    return s.to(device)


def _ref_topk(s, nv, k):
    """The reference's top-k of each row over its visible entries, -1 padded to k: int32 [N, k]."""
    out = torch.full((s.shape[0], k), -1, dtype=torch.int32, device=s.device)
    for i, m in enumerate(nv.tolist()):
        r = ref.topk_ascending(s[i, :m], min(k, m))
        out[i, :r.numel()] = r.int()
    return out


def _ref_mask(s, nv, block_size, topk_blocks):
    """The reference's candidate mask of each row over its visible entries: uint8 [N, width]."""
    out = torch.zeros(s.shape, dtype=torch.uint8, device=s.device)
    for i, m in enumerate(nv.tolist()):
        if m:
            out[i, :m] = ref.candidate_mask(s[i, :m], block_size, topk_blocks).to(torch.uint8)
    return out


def _check_row(idx, s, k):
    """A kernel row against the contract: the invariants, and bitwise the reference's indices."""
    check_topk_invariants(idx, s, min(k, int(torch.isfinite(s).sum())))
    r = ref.topk_ascending(s, min(k, s.numel()))
    assert idx.tolist() == r.tolist() + [-1] * (k - r.numel())


@pytest.mark.parametrize("rows,entries,k", [(1, 1, 512), (1, 7, 512), (3, 40, 16), (3, 300, 64),
                                            (1, 2000, 512), (3, 2000, 512), (1, 300, 300)])
def test_topk_distinct(rows, entries, k):
    s = _scores(rows, entries, seed=entries + rows).to(_DEVICE)
    nv = torch.tensor([entries - 3 * i if entries > 3 * i else entries for i in range(rows)], dtype=torch.int32, device=_DEVICE)
    out = topk_ascending(s, nv, k).cpu()
    assert out.shape == (rows, k) and out.dtype == torch.int32
    for i in range(rows):
        m = int(nv[i])
        _check_row(out[i], s[i, :m].cpu(), k)


def test_topk_many_ties_and_neg_inf():
    s = _scores(3, 2000, seed=5, distinct=False, neg_inf_frac=0.3).to(_DEVICE)
    s[2, 10:] = float("-inf")          # fewer finite scores than k
    nv = torch.tensor([2000, 1500, 2000], dtype=torch.int32, device=_DEVICE)
    out = topk_ascending(s, nv, 512).cpu()
    for i in range(3):
        _check_row(out[i], s[i, :int(nv[i])].cpu(), 512)


def test_topk_empty_rows_and_plan_reuse():
    s = _scores(3, 40, seed=9).to(_DEVICE)
    plan = TopKPlan.build(4, 16, device=_DEVICE, chunk=16)
    out = torch.empty(3, 16, dtype=torch.int32, device=_DEVICE)
    for nv in ([0, 0, 0], [40, 0, 1], [5, 40, 17]):
        nvt = torch.tensor(nv, dtype=torch.int32, device=_DEVICE)
        topk_ascending_(s, nvt, out, plan)
        for i in range(3):
            _check_row(out[i].cpu(), s[i, :nv[i]].cpu(), 16)
    assert bool((topk_ascending(s, torch.zeros(3, dtype=torch.int32, device=_DEVICE), 16) == -1).all())


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
            assert torch.equal(out[i, :m].bool(), r)
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
    assert torch.equal(out, _ref_mask(s, nv, 8, 10).cpu())


def test_bad_inputs_named():
    s = _scores(2, 40, seed=1).to(_DEVICE)
    nv = torch.full((2,), 40, dtype=torch.int32, device=_DEVICE)
    plan = TopKPlan.build(2, 16, device=_DEVICE)
    out = torch.empty(2, 16, dtype=torch.int32, device=_DEVICE)
    with pytest.raises(ValueError, match="scores"):
        topk_ascending_(s.double(), nv, out, plan)
    with pytest.raises(ValueError, match="n_vis"):
        topk_ascending_(s, nv.long(), out, plan)
    with pytest.raises(ValueError, match=r"n_vis must be a contiguous \[N=2\].*strides \(2,\)"):
        topk_ascending_(s, nv.repeat_interleave(2)[::2], out, plan)
    with pytest.raises(ValueError, match=r"n_vis must be a contiguous"):
        candidate_mask_(s, nv.repeat_interleave(2)[::2], torch.empty(2, 40, dtype=torch.uint8, device=_DEVICE),
                        TopKPlan.build(2, 16, 8, device=_DEVICE))
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


def test_non_tensor_arguments_name_the_argument():
    s = _scores(2, 40, seed=1)
    nv = torch.full((2,), 40, dtype=torch.int32)
    out = torch.empty(2, 16, dtype=torch.int32)
    mask = torch.empty(2, 40, dtype=torch.uint8)
    plan, blocks = TopKPlan.build(2, 16, device="cpu"), TopKPlan.build(2, 16, 8, device="cpu")
    for bad in (None, [1.0, 2.0]):
        with pytest.raises(TypeError, match="scores must be a torch.Tensor"):
            topk_ascending_(bad, nv, out, plan)
        with pytest.raises(TypeError, match="n_vis must be a torch.Tensor"):
            candidate_mask_(s, bad, mask, blocks)
        with pytest.raises(TypeError, match="out must be a torch.Tensor"):
            topk_ascending_(s, nv, bad, plan)
        with pytest.raises(TypeError, match="plan must be a TopKPlan"):
            candidate_mask_(s, nv, mask, bad)
        with pytest.raises(ValueError, match="scores must be a 2-D tensor"):
            topk_ascending(bad, nv, 16)
        with pytest.raises(ValueError, match="scores must be a 2-D tensor"):
            candidate_mask(bad, nv)
        with pytest.raises(ValueError, match="n_vis must be a 1-D tensor"):
            key_high_histogram(s, bad)


@pytest.mark.parametrize("build, match", [
    (lambda: TopKPlan.build(None, device="cpu"), "max_rows must be a positive int, got None"),
    (lambda: TopKPlan.build(2.5, device="cpu"), "max_rows must be a positive int, got 2.5"),
    (lambda: TopKPlan.build(2, None, device="cpu"), r"k must be an int in 1..4096, got None"),
    (lambda: TopKPlan.build(2, 512.0, device="cpu"), r"k must be an int in 1..4096, got 512.0"),
    (lambda: TopKPlan.build(2, 16, 2.0, device="cpu"), "group must be a power of two >= 1, got 2.0"),
    (lambda: TopKPlan.build(2, 16, True, device="cpu"), "group must be a power of two >= 1, got True"),
    (lambda: TopKPlan.build(2, device="cpu", chunk=1024.0), "chunk must be a power of two >= 16, got 1024.0"),
    (lambda: TopKPlan.build(2, device="cpu", wide_chunk=None), "wide_chunk must be a power of two >= 16, got None"),
    (lambda: TopKPlan.build(2, device="cpu", warps=4.0), r"warps must be a power of two in 1..16, got 4.0"),
    (lambda: TopKPlan.build(2, device="cpu", wide_warps=True), r"wide_warps must be a power of two in 1..16, got True"),
    (lambda: topk_ascending(torch.zeros(2, 40), torch.zeros(2, dtype=torch.int32), None), "k must be an int"),
    (lambda: candidate_mask(torch.zeros(2, 40), torch.zeros(2, dtype=torch.int32), block_size=3),
     "block_size must be a power of two >= 2, got 3"),
    (lambda: candidate_mask(torch.zeros(2, 40), torch.zeros(2, dtype=torch.int32), block_size=None),
     "block_size must be a power of two >= 2, got None"),
    (lambda: candidate_mask(torch.zeros(2, 40), torch.zeros(2, dtype=torch.int32), topk_blocks=0),
     r"topk_blocks must be an int in 1..4096, got 0"),
    (lambda: candidate_mask(torch.zeros(2, 40), torch.zeros(2, dtype=torch.int32), topk_blocks=2.0),
     r"topk_blocks must be an int in 1..4096, got 2.0"),
])
def test_bad_plan_arguments_name_the_argument(build, match):
    with pytest.raises(ValueError, match=match):
        build()


@pytest.mark.parametrize("small_max,max_chunks,four_min_cols", [(0, 1024, 1 << 18), (0, 1, 1 << 18), (0, 1024, 0)])
def test_topk_multi_program_paths(monkeypatch, small_max, max_chunks, four_min_cols):
    """The multi-program paths (larger chunks past the chunk cap), forced at CPU sizes, with plan
    reuse (they rely on the histograms being left zero): the default's linked path, and (columns
    past _FOUR_MIN_COLS at <= 4 rows) its four-launch one."""
    from dsv41_decode.ops import topk as topk_mod
    monkeypatch.setattr(topk_mod, "_SMALL_MAX", small_max)
    monkeypatch.setattr(topk_mod, "_FOUR_MIN_COLS", four_min_cols)
    monkeypatch.setattr(topk_mod, "_MAX_CHUNKS", max_chunks)
    plan = TopKPlan.build(3, 64, device=_DEVICE, chunk=64)
    out = torch.empty(3, 64, dtype=torch.int32, device=_DEVICE)
    for seed, distinct, nv in ((1, True, [300, 299, 9]), (2, False, [300, 0, 170]), (3, True, [64, 65, 1])):
        s = _scores(3, 300, seed=seed, distinct=distinct, neg_inf_frac=0.0 if distinct else 0.3).to(_DEVICE)
        topk_ascending_(s, torch.tensor(nv, dtype=torch.int32, device=_DEVICE), out, plan)
        for i in range(3):
            _check_row(out[i].cpu(), s[i, :nv[i]].cpu(), 64)
    cplan = TopKPlan.build(3, 5, 1, device=_DEVICE, chunk=64)   # a group-1 plan: the top-k's, not a mask's
    with pytest.raises(ValueError, match="candidate_mask_ ranks blocks of >= 2 entries, got a plan of group 1"):
        candidate_mask_(s, torch.tensor(nv, dtype=torch.int32, device=_DEVICE),
                        torch.empty(3, 300, dtype=torch.uint8, device=_DEVICE), cplan)
    out5 = torch.empty(3, 5, dtype=torch.int32, device=_DEVICE)
    topk_ascending_(s, torch.tensor(nv, dtype=torch.int32, device=_DEVICE), out5, cplan)
    for i in range(3):
        _check_row(out5[i].cpu(), s[i, :nv[i]].cpu(), 5)


def test_plan_launch_shape_takes_the_wide_chunk_past_wide_entries():
    """The plan's chunk and warps per row width: the base chunk, on the four-launch path the wide
    chunk past WIDE_ENTRIES (where the larger), more warps when the row needs more than
    _MAX_CHUNKS chunks."""
    from dsv41_decode.ops.topk import WIDE_ENTRIES
    plan = TopKPlan.build(1, 512, device="cpu")
    assert plan.launch_shape(WIDE_ENTRIES, four_launch=True) == (1024, 4)
    assert plan.launch_shape(WIDE_ENTRIES + 1, four_launch=True) == (4096, 4)
    assert plan.launch_shape(1 << 20, four_launch=True) == (4096, 4)
    assert plan.launch_shape(1 << 20) == (1024, 4)              # the linked path keeps the base chunk
    assert plan.launch_shape(1 << 23, four_launch=True) == (8192, 8)     # 1024 chunks of 8192
    assert plan.launch_shape(1 << 23) == (8192, 32 // 2)        # 8x the base chunk: 4 x 8 warps, at most 16
    assert TopKPlan.build(1, 512, device="cpu", chunk=8192).launch_shape(1 << 20, four_launch=True) == (8192, 4)
    assert TopKPlan.build(1, 512, device="cpu", wide_chunk=1024).launch_shape(1 << 20, four_launch=True) == (1024, 4)
    with pytest.raises(ValueError, match="wide_chunk must be a power of two"):
        TopKPlan.build(1, 512, device="cpu", wide_chunk=3000)
    with pytest.raises(ValueError, match="wide_warps must be a power of two"):
        TopKPlan.build(1, 512, device="cpu", wide_warps=3)


def test_topk_wide_rows_take_the_wide_chunk(monkeypatch):
    """Rows past WIDE_ENTRIES (forced at a CPU size): the four-launch path in the plan's wide
    chunks, the linked path in its base chunks; the same selection as the reference on both."""
    from dsv41_decode.ops import topk as topk_mod
    monkeypatch.setattr(topk_mod, "WIDE_ENTRIES", 128)
    monkeypatch.setattr(topk_mod, "_SMALL_MAX", 0)
    plan = TopKPlan.build(3, 64, device=_DEVICE, chunk=16, wide_chunk=128)
    assert plan.launch_shape(300, four_launch=True) == (128, 4) and plan.launch_shape(300) == (16, 4)
    out = torch.empty(3, 64, dtype=torch.int32, device=_DEVICE)
    for four_min_cols in (1 << 18, 0):
        monkeypatch.setattr(topk_mod, "_FOUR_MIN_COLS", four_min_cols)
        for seed, distinct, nv in ((6, True, [300, 299, 9]), (7, False, [300, 0, 170])):
            s = _scores(3, 300, seed=seed, distinct=distinct, neg_inf_frac=0.0 if distinct else 0.3).to(_DEVICE)
            topk_ascending_(s, torch.tensor(nv, dtype=torch.int32, device=_DEVICE), out, plan)
            for i in range(3):
                _check_row(out[i].cpu(), s[i, :nv[i]].cpu(), 64)


def test_topk_names_the_tensor_on_another_device():
    """A tensor or plan on another device than scores: a ValueError naming it (the meta device
    stands in for another one; nothing is launched)."""
    s = torch.zeros(2, 64)
    nv, out = torch.zeros(2, dtype=torch.int32), torch.zeros(2, 8, dtype=torch.int32)
    plan = TopKPlan.build(2, 8, device="cpu")
    meta = {"n_vis": nv.to("meta"), "out": out.to("meta"), "plan": TopKPlan.build(2, 8, device="meta")}
    for name in meta:
        args = dict(n_vis=nv, out=out, plan=plan) | {name: meta[name]}
        with pytest.raises(ValueError, match=f"^{name} is on meta, scores on cpu"):
            topk_ascending_(s, args["n_vis"], args["out"], args["plan"])


def test_candidate_mask_keeps_the_plan_chunk_past_wide_entries(monkeypatch):
    """`candidate_mask_` on rows of more than WIDE_ENTRIES blocks (forced at a CPU size) asks the
    plan for its base chunk, not the top-k's wide one (its programs read `group` scores a key), and
    gives the reference's mask."""
    from dsv41_decode.ops import topk as topk_mod
    monkeypatch.setattr(topk_mod, "WIDE_ENTRIES", 16)
    asked = []
    shape = TopKPlan.launch_shape
    monkeypatch.setattr(TopKPlan, "launch_shape", lambda self, n, four_launch=False: (
        asked.append(four_launch), shape(self, n, four_launch))[1])
    plan = TopKPlan.build(2, 5, 8, device=_DEVICE, chunk=16, wide_chunk=64)
    assert plan.launch_shape(40, four_launch=True) == (64, 4)
    asked.clear()
    s = _scores(2, 300, seed=9, distinct=True, neg_inf_frac=0.0).to(_DEVICE)
    nv = torch.tensor([300, 171], dtype=torch.int32, device=_DEVICE)
    out = candidate_mask_(s, nv, torch.empty(2, 300, dtype=torch.uint8, device=_DEVICE), plan)
    assert asked == [False]
    assert torch.equal(out.cpu(), _ref_mask(s, nv, 8, 5).cpu())


def test_topk_row_kernel_many_blocks(monkeypatch):
    """The one-program row kernel looping over several blocks (carried counts across blocks)."""
    from dsv41_decode.ops import topk as topk_mod
    monkeypatch.setattr(topk_mod, "_SMALL_BLOCK", 64)
    for seed, distinct, nv in ((4, True, [300, 299, 9]), (5, False, [300, 0, 170])):
        s = _scores(3, 300, seed=seed, distinct=distinct, neg_inf_frac=0.0 if distinct else 0.3).to(_DEVICE)
        out = topk_ascending(s, torch.tensor(nv, dtype=torch.int32, device=_DEVICE), 64).cpu()
        for i in range(3):
            _check_row(out[i], s[i, :nv[i]].cpu(), 64)


# ------------------------------------------------------------------ the tie rule on tie-heavy inputs

def _rows_of(entries, cases):
    """[len(cases), entries] scores, row i drawn by `_few_values` from cases[i] = (values, -inf fraction)."""
    return torch.cat([_few_values(1, entries, 11 + i, v, f) for i, (v, f) in enumerate(cases)])


_TOPK_ROWS = [(_FEW, 0.0), ((1.0, 0.5), 0.0), (_FEW, 0.85), ((3.0,), 0.3)]


@pytest.mark.parametrize("small_max,max_chunks,separate", [(4096, 1024, False), (0, 1024, False), (0, 1024, True),
                                                             (0, 2, False), (0, 2, True)])
def test_topk_ties_equal_the_reference(monkeypatch, small_max, max_chunks, separate):
    """Hundreds of scores equal at the threshold (the highest-indexed taken), spread over chunks,
    on each path: the row kernel, the linked path and the four-launch count + write
    (`separate_count=True`) over chunks of 256, both with larger chunks past the chunk cap. Four
    rows (-inf entries, fewer visible or finite entries than k, an empty row), then one row alone
    through the same plan."""
    from dsv41_decode.ops import topk as topk_mod
    monkeypatch.setattr(topk_mod, "_SMALL_MAX", small_max)
    monkeypatch.setattr(topk_mod, "_MAX_CHUNKS", max_chunks)
    k, entries = 128, 700
    plan = TopKPlan.build(4, k, device=_DEVICE, chunk=256)
    s = _rows_of(entries, _TOPK_ROWS)
    for rows, nv in ((4, [entries, 100, 699, 0]), (1, [entries])):
        nv = torch.tensor(nv, dtype=torch.int32, device=_DEVICE)
        out = topk_ascending_(s[:rows], nv, torch.empty(rows, k, dtype=torch.int32, device=_DEVICE), plan,
                              separate_count=separate)
        assert torch.equal(out, _ref_topk(s[:rows], nv, k)), f"{rows} rows"
        for i in range(rows):
            m = int(nv[i])
            check_topk_invariants(out[i].cpu(), s[i, :m].cpu(), min(k, int(torch.isfinite(s[i, :m]).sum())))


_MASK_ROWS = [(_FEW, 0.0), ((0.0, -0.0, -1.0), 0.0), ((1.0, -1.0), 0.97),
              ((1.0, 0.5, 0.25, 0.125, 0.0625) + (-2.0,) * 20, 0.0)]


@pytest.mark.parametrize("max_chunks", [1024, 2])
def test_candidate_mask_block_ties_equal_the_reference(monkeypatch, max_chunks):
    """Equal block maxima (the higher block wins) across chunks of 32 blocks and past the chunk cap:
    every tie kept (skip 0), a part kept, -inf blocks, fewer finite blocks than kept ones, an empty
    row; four rows, then one row alone through the same plan."""
    from dsv41_decode.ops import topk as topk_mod
    monkeypatch.setattr(topk_mod, "_MAX_CHUNKS", max_chunks)
    entries = 601                                   # 76 blocks of 8, the last of one column (no room for a kept key)
    plan = TopKPlan.build(4, 20, 8, device=_DEVICE, chunk=32)
    s = _rows_of(entries, _MASK_ROWS)
    for rows, nv in ((4, [entries, 161, 598, 0]), (1, [entries])):
        nv = torch.tensor(nv, dtype=torch.int32, device=_DEVICE)
        out = torch.full((rows, entries), 7, dtype=torch.uint8, device=_DEVICE)
        candidate_mask_(s[:rows], nv, out, plan)
        assert torch.equal(out, _ref_mask(s[:rows], nv, 8, 20)), f"{rows} rows"


_GPU_CASES = [(1, 8192), (64, 8192), (1, 32768), (64, 32768), (16, 131072), (1, 1 << 20), (8, 1 << 20),
              (1, (4 << 20) + 4099)]   # the last: more than _MAX_CHUNKS chunks of the plans' chunk


def _gpu_case(rows: int, entries: int, dist: str, seed: int, extra: tuple):
    """(scores [rows, entries] on the GPU, n_vis): "few" - a handful of BF16 values and `extra`
    (-inf, NaN) drawn at random, ties by the thousands; else BF16 randn. n_vis mostly near
    `entries`, some rows far shorter, row 2 (past 2 rows) fewer than k."""
    g = torch.Generator(device=_DEVICE).manual_seed(seed)
    if dist == "few":
        vals = torch.tensor(_FEW + extra, device=_DEVICE)
        s = vals[torch.randint(0, len(vals), (rows, entries), generator=g, device=_DEVICE)]
    else:
        s = torch.randn(rows, entries, generator=g, device=_DEVICE).bfloat16().float()
    nv = torch.tensor([entries - 7 * i if i % 5 else max(1, entries // (i + 1)) for i in range(rows)],
                      dtype=torch.int32, device=_DEVICE)
    if rows > 2:
        nv[2] = 300                                  # fewer visible entries than k
    return s, nv


@pytest.mark.gpu
@pytest.mark.parametrize("dist", ["few", "randn"])
@pytest.mark.parametrize("rows,entries", _GPU_CASES)
def test_gpu_ties_equal_the_reference_and_repeat(rows, entries, dist):
    """1-64 rows, 8K-4M entries, tie-heavy scores (a handful of BF16 values; or BF16 randn, whose
    values also tie by thousands): the top-512 and the candidate mask (the decode step's plans)
    equal the reference bitwise, and 10 runs on the same scores give the same bits."""
    s, nv = _gpu_case(rows, entries, dist, rows * 7 + entries, (float("-inf"),))
    tplan = TopKPlan.build(rows, 512, 1, _DEVICE)
    cplan = TopKPlan.build(rows, 2048, 8, _DEVICE, chunk=512)
    runs_t, runs_c = [], []
    for _ in range(10):
        runs_t.append(topk_ascending_(s, nv, torch.empty(rows, 512, dtype=torch.int32, device=_DEVICE), tplan))
        runs_c.append(candidate_mask_(s, nv, torch.empty(rows, entries, dtype=torch.uint8, device=_DEVICE), cplan))
    assert torch.equal(runs_t[0], _ref_topk(s, nv, 512))
    assert torch.equal(runs_c[0], _ref_mask(s, nv, 8, 2048))
    for r in range(1, 10):
        assert torch.equal(runs_t[r], runs_t[0]), f"top-k run {r} differs from run 0"
        assert torch.equal(runs_c[r], runs_c[0]), f"candidate mask run {r} differs from run 0"


# ------------------------------------------------------------------ the linked top-k: hist_ready, BF16 scores

def _edge_rows(entries, seed):
    """Tie-heavy rows covering the key's edge cases: all equal; a handful of values; +0.0 and -0.0
    tied at the threshold; NaN and -inf (never selected); BF16 values that differ only in the low
    byte of the key (ties and near-ties within one high-byte bin); distinct values."""
    nan = float("nan")
    rows = [_few_values(1, entries, seed, (3.0,)),
            _few_values(1, entries, seed + 1, _FEW),
            _few_values(1, entries, seed + 2, (0.0, -0.0, 0.0, -1.0, 2.0), 0.1),
            _few_values(1, entries, seed + 3, (1.0, 0.5, nan), 0.3),
            _few_values(1, entries, seed + 4, (1.0, 1.0078125, 1.015625, 0.9921875)),
            _scores(1, entries, seed + 5).to(_DEVICE)]
    return torch.cat(rows)


def _ref_topk_nan(s, nv, k):
    """`_ref_topk` with NaN read as -inf (the kernels never select either; the reference takes no NaN)."""
    return _ref_topk(torch.where(torch.isnan(s), float("-inf"), s), nv, k)


def _add_hist(plan, s, nv):
    """What a scorer does before `hist_ready=True`: add the rows' high-byte histograms into the plan."""
    plan.hist_hi[:s.shape[0]] += key_high_histogram(s, nv)


def test_key_high_histogram_equals_the_kernels():
    """The torch histogram a scorer must add equals the high-byte pass's own, on -0.0, NaN, -inf
    and entries past n_vis; BF16 scores give the FP32 ones' histogram."""
    from dsv41_decode.ops import topk as topk_mod
    s = _edge_rows(300, 21)
    nv = torch.tensor([300, 0, 1, 299, 170, 64], dtype=torch.int32, device=_DEVICE)
    plan = TopKPlan.build(6, 64, device=_DEVICE, chunk=64)
    topk_mod._hist_hi_kernel[(6, 5)](s, nv, plan.ws, s, s.stride(0), 0, 0, GROUP=1, CHUNK=64, SCRATCH=False)
    assert torch.equal(plan.hist_hi.clone(), key_high_histogram(s, nv))
    assert torch.equal(key_high_histogram(s.bfloat16(), nv), key_high_histogram(s, nv))
    assert int(key_high_histogram(s, nv)[1].sum()) == 0 and int(key_high_histogram(s, nv)[2].sum()) == 1


@pytest.mark.parametrize("dtype,max_chunks,guess_shift", [(torch.float32, 1024, 0), (torch.bfloat16, 2, 1)])
def test_topk_linked_equals_separate_and_reference(monkeypatch, dtype, max_chunks, guess_shift):
    """The linked path (count folded into the write, the threshold found by the last program of the
    low-byte pass), with and without hist_ready, gives the four-launch path's and the reference's
    selections: ties at the threshold spread over chunks (and over larger chunks past the chunk
    cap), -0.0 vs +0.0, NaN, -inf, n_vis 0 / 1 / < k / not a multiple of the chunk; six rows, then
    one row alone through the same plans (their workspaces left clean). guess_shift 1: every write
    program's ticket names another chunk than the one it loaded first (the reload path)."""
    from dsv41_decode.ops import topk as topk_mod
    monkeypatch.setattr(topk_mod, "_SMALL_MAX", 0)
    monkeypatch.setattr(topk_mod, "_CHUNK_SHIFT", guess_shift)
    monkeypatch.setattr(topk_mod, "_MAX_CHUNKS", max_chunks)
    k, entries = 64, 300
    s = _edge_rows(entries, 31).to(dtype)
    plans = {mode: TopKPlan.build(6, k, device=_DEVICE, chunk=64) for mode in ("sep", "linked", "ready")}
    for rows, nv in ((6, [entries, 0, 1, 40, 65, 299]), (1, [entries])):
        nv = torch.tensor(nv, dtype=torch.int32, device=_DEVICE)
        x = s[:rows]
        outs = {mode: torch.full((rows, k), 5, dtype=torch.int32, device=_DEVICE) for mode in plans}
        topk_ascending_(x, nv, outs["sep"], plans["sep"], separate_count=True)
        topk_ascending_(x, nv, outs["linked"], plans["linked"], separate_count=False)
        _add_hist(plans["ready"], x, nv)
        topk_ascending_(x, nv, outs["ready"], plans["ready"], hist_ready=True, separate_count=False)
        want = _ref_topk_nan(x.float(), nv, k)
        for mode, out in outs.items():
            assert torch.equal(out, want), f"{mode}, {rows} rows, n_vis {nv.tolist()}"
    for plan in plans.values():
        assert int(plan.ws[:, :512].abs().sum()) == 0, "histograms left non-zero"


def test_topk_linked_64_rows_and_row_kernel_hist_ready(monkeypatch):
    """64 rows through the one-program row kernel with hist_ready (it takes the workspace's
    histogram and zeroes it), then through the linked path (hist_ready, BF16 scores, two chunks a
    row): the reference's selections, and the histograms left zero."""
    from dsv41_decode.ops import topk as topk_mod
    k, entries = 32, 200
    s = torch.cat([_edge_rows(entries, 41 + 6 * i) for i in range(11)])[:64]
    nv = torch.tensor([entries - (i * 13) % entries for i in range(64)], dtype=torch.int32, device=_DEVICE)
    want = _ref_topk_nan(s, nv, k)
    plan = TopKPlan.build(64, k, device=_DEVICE, chunk=128)
    monkeypatch.setattr(topk_mod, "_SMALL_BLOCK", 256)
    for small_max, x in ((4096, s), (0, s.bfloat16())):      # the row kernel, then the linked path
        monkeypatch.setattr(topk_mod, "_SMALL_MAX", small_max)
        _add_hist(plan, x, nv)
        out = topk_ascending_(x, nv, torch.empty(64, k, dtype=torch.int32, device=_DEVICE), plan, hist_ready=True)
        assert torch.equal(out, want), f"small_max {small_max}, {x.dtype}"
        assert int(plan.ws[:, :512].abs().sum()) == 0


# ------------------------------------------------------------------ the sparse-index table in the write pass

def _table_case(rows, entries, k, page, seed, device=_DEVICE):
    """(req_slot [rows] int64, block_table [5, P] int32 of shuffled pages (P covers `entries`),
    table_out [rows, k], lengths_out [rows], both int32 and full of 7777): `topk_ascending_`'s
    table; rows share requests, not in order."""
    g = torch.Generator().manual_seed(seed)
    p = -(-entries // page)
    bt = torch.randperm(5 * p, generator=g).to(torch.int32).reshape(5, p)
    req = torch.tensor([(3 * i + 2) % 5 for i in range(rows)], dtype=torch.int64)
    return (req.to(device), bt.to(device), page, torch.full((rows, k), 7777, dtype=torch.int32, device=device),
            torch.full((rows,), 7777, dtype=torch.int32, device=device))


def _check_table(out, table):
    """table_out and lengths_out equal `topk_slots_` run on the top-k's out after it."""
    from dsv41_decode.ops.sparse_tables import topk_slots_
    req, bt, page, tab, lens = table
    want, want_len = torch.empty_like(tab), torch.empty_like(lens)
    topk_slots_(out, req, bt, page, want, want_len)
    assert torch.equal(tab, want) and torch.equal(lens, want_len)


@pytest.mark.parametrize("path,page", [("row", 16), ("four", 5), ("linked", 16), ("ready", 7)])
def test_topk_table_equals_topk_slots(monkeypatch, path, page):
    """table=: on the row kernel, the four-launch path, the linked path (two-chunk cap, every write
    program's ticket naming another chunk than its first guess) and the linked path with hist_ready
    and BF16 scores: the same indices as without the table (the reference's), and table_out /
    lengths_out bit for bit `topk_slots_`'s on them: ties at the threshold across chunks, NaN, -inf,
    n_vis 0 / 1 / < k, pages of 5-16 entries in shuffled block tables; six rows, then one alone."""
    from dsv41_decode.ops import topk as topk_mod
    monkeypatch.setattr(topk_mod, "_SMALL_MAX", 4096 if path == "row" else 0)
    monkeypatch.setattr(topk_mod, "_SMALL_BLOCK", 128)
    monkeypatch.setattr(topk_mod, "_CHUNK_SHIFT", 1)
    monkeypatch.setattr(topk_mod, "_MAX_CHUNKS", 2 if path == "linked" else 1024)
    k, entries = 64, 300
    s = _edge_rows(entries, 51)
    plan = TopKPlan.build(6, k, device=_DEVICE, chunk=64)
    for rows, nv in ((6, [entries, 0, 1, 40, 65, 299]), (1, [entries])):
        nv = torch.tensor(nv, dtype=torch.int32, device=_DEVICE)
        x = s[:rows].bfloat16() if path == "ready" else s[:rows]
        if path == "ready":
            _add_hist(plan, x, nv)
        table = _table_case(rows, entries, k, page, rows + page)
        out = torch.full((rows, k), 5, dtype=torch.int32, device=_DEVICE)
        topk_ascending_(x, nv, out, plan, hist_ready=path == "ready", separate_count=path == "four", table=table)
        assert torch.equal(out, _ref_topk_nan(s[:rows], nv, k)), f"{rows} rows"
        _check_table(out, table)
        assert table[4].tolist() == [int((out[i] >= 0).sum()) for i in range(rows)]
    assert int(plan.ws[:, :512].abs().sum()) == 0, "histograms left non-zero"


def test_topk_table_zero_columns_and_bad_arguments():
    """table= with no columns: all -1 and lengths 0; bad table arguments name the argument
    (prefixed "table: "), and one_launch refuses it."""
    plan = TopKPlan.build(3, 8, device="cpu")
    s, nv, out = torch.empty(3, 0), torch.zeros(3, dtype=torch.int32), torch.empty(3, 8, dtype=torch.int32)
    table = _table_case(3, 40, 8, 4, 0, "cpu")
    topk_ascending_(s, nv, out, plan, table=table)
    assert (table[3] == -1).all() and (table[4] == 0).all() and (out == -1).all()
    s = torch.zeros(3, 40)
    req, bt, page, tab, lens = table
    for bad, exc, match in [((req.int(), bt, page, tab, lens), TypeError, "table: req_slot"),
                            ((req, bt.long(), page, tab, lens), TypeError, "table: block_table"),
                            ((req, bt[0], page, tab, lens), ValueError, "table: block_table must be a 2-D"),
                            ((req, bt, 0, tab, lens), ValueError, "table: page_size"),
                            ((req, bt, page, tab[:, :4], lens), ValueError, "table: out"),
                            ((req, bt, page, tab, lens[:2]), ValueError, "table: lengths_out"),
                            ((req, bt, page, tab), TypeError, "table must be None or a tuple")]:
        with pytest.raises(exc, match=match):
            topk_ascending_(s, nv, out, plan, table=bad)
    with pytest.raises(ValueError, match="table: not with one_launch"):
        topk_ascending_(s, nv, out, plan, table=table, one_launch=True)


_GPU_TABLE_CASES = [(1, 32768), (4, 32768), (64, 32768), (1, 131072), (16, 131072), (1, 1 << 20), (4, 1 << 20),
                    (64, 1 << 20)]


@pytest.mark.gpu
@pytest.mark.parametrize("rows,entries", _GPU_TABLE_CASES)
def test_gpu_table_equals_topk_slots(rows, entries):
    """table= at 1-64 rows x 32K-1M entries (tie-heavy scores with -inf and NaN, n_vis short and
    < k on some rows, pages of 64 entries): on the linked path with and without hist_ready (FP32
    and BF16 scores), with PDL, and on the four-launch path, three calls a plan: the indices
    equal the top-k's without the table, and table_out / lengths_out equal `topk_slots_` after it,
    bitwise (the linked write's chunks arrive in any order; each translates its own indices)."""
    s, nv = _gpu_case(rows, entries, "few", rows * 13 + entries, (float("-inf"), float("nan")))
    want = topk_ascending_(s, nv, torch.empty(rows, 512, dtype=torch.int32, device=_DEVICE),
                           TopKPlan.build(rows, 512, 1, _DEVICE), separate_count=False)
    configs = [(torch.float32, True, {}), (torch.bfloat16, True, {}), (torch.float32, False, {"separate_count": False}),
               (torch.float32, True, {"pdl": True}), (torch.float32, False, {"separate_count": True})]
    for dtype, ready, opts in configs:
        plan = TopKPlan.build(rows, 512, 1, _DEVICE)
        x = s.to(dtype)
        for rep in range(3):
            if ready:
                plan.hist_hi[:rows] += key_high_histogram(x, nv)
            table = _table_case(rows, entries, 512, 64, rep)
            out = topk_ascending_(x, nv, torch.full_like(want, 5), plan, hist_ready=ready, table=table, **opts)
            assert torch.equal(out, want), f"{dtype} hist_ready={ready} {opts}"
            _check_table(out, table)
        assert int(plan.ws[:, :512].abs().sum()) == 0, "histograms left non-zero"


_GPU_LINKED_CASES = [(1, 32768), (4, 32768), (64, 32768), (1, 131072), (16, 131072), (64, 131072), (1, 1 << 20),
                     (16, 1 << 20), (64, 1 << 20), (2, (4 << 20) + 4099)]


@pytest.mark.gpu
@pytest.mark.parametrize("dist", ["few", "randn"])
@pytest.mark.parametrize("rows,entries", _GPU_LINKED_CASES)
def test_gpu_linked_equals_four_launch_and_repeats(rows, entries, dist):
    """The linked top-k at 1-64 rows and 32K-4M entries, FP32 and BF16 scores, with and without
    hist_ready, with PDL, at chunks of 1024 / 4096 / 8192 (8 warps), and the one-launch top-k
    (where its grid fits the SMs; else it runs the linked path): the four-launch path's output
    (itself checked against the reference above), bitwise, and 10 runs of the default give the same
    bits (the look-back's arrival order varies, the output must not)."""
    s, nv = _gpu_case(rows, entries, dist, rows * 11 + entries, (float("-inf"), float("nan")))
    want = topk_ascending_(s, nv, torch.empty(rows, 512, dtype=torch.int32, device=_DEVICE),
                           TopKPlan.build(rows, 512, 1, _DEVICE), separate_count=True)
    if dist == "randn":
        assert torch.equal(want, _ref_topk(s, nv, 512))
    plan = TopKPlan.build(rows, 512, 1, _DEVICE)
    runs = [topk_ascending_(s, nv, torch.empty_like(want), plan, separate_count=False) for _ in range(10)]
    for r in range(10):
        assert torch.equal(runs[r], want), f"linked run {r} differs from the four-launch path"
    pdl, one, lk = {"pdl": True}, {"one_launch": True}, {"separate_count": False}
    configs = [(torch.float32, True, lk, 4096, 4), (torch.bfloat16, False, lk, 4096, 4),
               (torch.bfloat16, True, lk, 4096, 4), (torch.float32, False, pdl, 4096, 4),
               (torch.float32, True, pdl, 1024, 4), (torch.bfloat16, True, lk, 8192, 8),
               (torch.float32, True, one, 4096, 4), (torch.float32, False, one, 1024, 4),
               (torch.bfloat16, True, one, 1024, 2)]
    for dtype, ready, opts, chunk, warps in configs:
        plan = TopKPlan.build(rows, 512, 1, _DEVICE, chunk=chunk, warps=warps)
        x = s.to(dtype)
        for _ in range(3):
            if ready:
                plan.hist_hi[:rows] += key_high_histogram(x, nv)
            out = topk_ascending_(x, nv, torch.empty_like(want), plan, hist_ready=ready, **opts)
            assert torch.equal(out, want), f"{dtype} hist_ready={ready} {opts} chunk={chunk} warps={warps}"
        assert int(plan.ws[:, :512].abs().sum()) == 0, "histograms left non-zero"


# the one-launch top-k at 1-4 rows with hist_ready, on a plan of 4096-entry chunks: one launch where the
# grid fits the SMs (chunks of 4096 / 8192 / 16384, at most 4 x the plan's: 1 x 32K ... 2 x 1M on an
# H200's 132 SMs), the linked path past that (3 x 1M). (With the default plan's 1024-entry chunks every
# 1M case would run the linked path.)
_GPU_ONE_CASES = [(1, 32768), (4, 32768), (1, 131072), (4, 131072), (1, 1 << 20), (2, 1 << 20), (3, 1 << 20)]


@pytest.mark.gpu
@pytest.mark.parametrize("dist", ["few", "randn"])
@pytest.mark.parametrize("rows,entries", _GPU_ONE_CASES)
def test_gpu_one_launch_equals_four_launch_and_repeats(monkeypatch, rows, entries, dist):
    """one_launch with hist_ready at 1-4 rows: it takes the one-launch path (its kernel where the
    grid fits the SMs with chunks of at most 4 x the plan's, else the linked path), and 10 runs on
    one plan, each after a linked call of 8 rows on the same plan (the step's plan serves every row
    bucket), give the four-launch path's bits, ties included; the histograms and the one-launch
    counters and count slots are left zero."""
    from dsv41_decode.ops import topk as topk_mod
    taken, fell_back = [], []
    one, linked = topk_mod._select_one_launch, topk_mod._select_linked
    monkeypatch.setattr(topk_mod, "_select_one_launch", lambda *a: (taken.append(1), one(*a)))
    # the one-launch calls have `rows` <= 4 rows, the linked calls between them 8
    monkeypatch.setattr(topk_mod, "_select_linked",
                        lambda s, *a: (fell_back.append(1) if s.shape[0] == rows else None, linked(s, *a)))
    s, nv = _gpu_case(8, entries, dist, rows * 13 + entries, (float("-inf"), float("nan")))
    four = TopKPlan.build(8, 512, 1, _DEVICE)
    want = topk_ascending_(s, nv, torch.empty(8, 512, dtype=torch.int32, device=_DEVICE), four, separate_count=True)
    plan = TopKPlan.build(8, 512, 1, _DEVICE, chunk=4096)
    # the launcher's rule: the smallest power-of-two chunk from the plan's whose grid fits the SMs
    chunk = topk_mod.covering_chunk(plan.chunk, entries)
    while rows * -(-entries // chunk) > num_sms(torch.device(_DEVICE)):
        chunk *= 2
    fits = chunk <= 4 * plan.chunk
    for r in range(10):
        plan.hist_hi[:rows] += key_high_histogram(s[:rows], nv[:rows])
        out = topk_ascending_(s[:rows], nv[:rows], torch.empty(rows, 512, dtype=torch.int32, device=_DEVICE), plan,
                              hist_ready=True, one_launch=True)
        assert torch.equal(out, want[:rows]), f"run {r}: one launch differs from the four-launch path"
        plan.hist_hi[:8] += key_high_histogram(s, nv)
        other = topk_ascending_(s, nv, torch.empty_like(want), plan, hist_ready=True)
        assert torch.equal(other, want), f"run {r}: the linked call of 8 rows after it differs"
    assert len(taken) == 10, "one_launch=True did not take the one-launch path"
    assert len(fell_back) == (0 if fits else 10), f"one launch {'expected' if fits else 'not expected'}: {fell_back}"
    if num_sms(torch.device(_DEVICE)) >= 128:      # an H200 (132 SMs): only 3 x 1M past the one launch
        assert fits != ((rows, entries) == (3, 1 << 20)), (rows, entries, chunk)
    ws = plan.ws
    assert int(ws[:, :512].abs().sum()) == 0, "histograms left non-zero"
    assert int(ws[:, topk_mod._WS_ARRIVED_HI:topk_mod._WS_DEPARTED + 1].abs().sum()) == 0, "counters left non-zero"
    assert int(ws[:, topk_mod._WS_ONE_GT:].abs().sum()) == 0, "one-launch count slots left non-zero"


@pytest.mark.parametrize("spin,shift", [(0, 1), (2, 0)])
def test_topk_one_launch_equals_the_reference(monkeypatch, spin, shift):
    """The one-launch top-k (its programs wait for each other), with and without hist_ready, FP32
    and BF16: the reference's selections and a clean workspace after each call. The interpreter
    runs programs one after another, so with spin 0 and chunks taken out of order every wait but
    the row's last program's gives up at once: the fallbacks (the histograms and the earlier
    chunks' counts read from the scores) are what is checked; with (2, 0) the look-backs find every
    earlier count published. The GPU test below checks the waits that succeed."""
    from dsv41_decode.ops import topk as topk_mod
    monkeypatch.setattr(topk_mod, "_SMALL_MAX", 0)
    monkeypatch.setattr(topk_mod, "_SPIN_LIMIT", spin)
    monkeypatch.setattr(topk_mod, "_CHUNK_SHIFT", shift)
    k, entries = 64, 300
    s = _edge_rows(entries, 51)[[1, 3, 4, 5]]
    nv = torch.tensor([entries, 1, 299, 130], dtype=torch.int32, device=_DEVICE)
    want = _ref_topk_nan(s, nv, k)
    plan = TopKPlan.build(4, k, device=_DEVICE, chunk=64)
    for x, ready in ((s, False), (s.bfloat16(), True), (s, True)):
        if ready:
            _add_hist(plan, x, nv)
        out = topk_ascending_(x, nv, torch.full((4, k), 5, dtype=torch.int32, device=_DEVICE), plan,
                              hist_ready=ready, one_launch=True)
        assert torch.equal(out, want), f"{x.dtype} hist_ready={ready}"
        assert int(plan.ws.abs().sum()) == 0, "workspace left non-zero"


def test_topk_default_path_choice(monkeypatch):
    """The default's path per call (the launchers replaced by recorders, sm_90 outside the
    interpreter pretended): four launches at <= 4 rows of > 256K columns without hist_ready; the
    linked path elsewhere (with hist_ready too) and whenever separate_count=False or pdl is asked
    for; one launch only when asked for."""
    from dsv41_decode.ops import topk as topk_mod
    taken = []
    monkeypatch.setattr(topk_mod, "_select_one_launch", lambda *a: taken.append("one"))
    monkeypatch.setattr(topk_mod, "_select_linked", lambda *a: taken.append("linked"))
    monkeypatch.setattr(topk_mod, "_select", lambda *a: taken.append("four"))
    monkeypatch.setattr(topk_mod._pdl, "supported", lambda device: True)
    plan = TopKPlan.build(8, 512, device="cpu")

    def path(rows, cols, **kw):
        taken.clear()
        topk_ascending_(torch.empty(rows, cols), torch.zeros(rows, dtype=torch.int32),
                        torch.empty(rows, 512, dtype=torch.int32), plan, **kw)
        return taken

    assert path(1, 131072, hist_ready=True) == ["linked"]
    assert path(4, 1 << 20, hist_ready=True) == ["linked"]
    assert path(4, 1 << 20, hist_ready=True, one_launch=True) == ["one"]   # (which runs the linked path: grid too large)
    assert path(5, 131072, hist_ready=True) == ["linked"]
    assert path(1, 131072) == ["linked"]
    assert path(4, (1 << 18) + 1) == ["four"]
    assert path(1, 131072, hist_ready=True, separate_count=False) == ["linked"]
    assert path(1, 131072, hist_ready=True, pdl=True) == ["linked"]
    assert path(1, 131072, hist_ready=True, separate_count=True) == ["four"]
    assert path(2, 131072, one_launch=True) == ["one"]
