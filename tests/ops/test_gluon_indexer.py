"""ops.gluon_indexer, the Gluon indexer scorer (sm_90 only).

On the CPU: the kernel compiles for sm_90 (Triton's own ptxas) for the step's dense call with and
without the fused histogram, the candidate-restricted call, 64 heads and a deep ring, without
spills, and its SASS holds four FP8 wgmmas (m64 n{BLOCK_H} k32, each from a zero accumulator) and
the asynchronous record copies (LDGSTS); bad arguments raise errors that name them; the grouping of
a request's rows (`row_group`, a Triton function the kernel calls) in the interpreter.

On the GPU (`-m gpu`): the scores against `ops.indexer.index_scores_mxfp4_(fp8_dot=True)` (the
Triton FP8 path, the step's), bit for bit, at 1, 4, 16 and 64 rows, contexts 0..4103 (partial
pages, n_vis not a multiple of the 64-entry tile, n_vis 0), pages of 16 and 64, dense and
candidate-restricted, and at the scale extremes; against the reference at `test_indexer`'s
tolerance; bitwise run to run; a row alone equal to the same row among others; the fused histogram
equal to torch's histogram of the scores' key high bytes.

Why bitwise against the Triton FP8 path: both compute each scale block's partial as one K = 32 FP8
tensor-core product of the same E4M3 operands (exact: products of E2M1 values times 2^-12, a
32-term sum of 13 bits), scale it by the same two powers of two in the same order (exact barring
overflow or subnormals), add the four blocks in the same order, round, relu, weight and round with
the same operations, and sum over the heads with `sum` on the same wgmma accumulator layout (the
heads' order within a thread, then the quad's shuffles). Nothing in the arithmetic of one score
depends on the tile (64 here, 128 there) or on the program that computes it; the GPU test is what
confirms it. Against the reference the tolerance is `test_indexer._check`'s (the FP32 head sum's
order: at most one BF16 ulp of the row's largest score, >= 99 % of scores equal).
"""

import random
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl

from dsv41_decode.ops import gluon_indexer as GI
from dsv41_decode.ops.indexer import index_scores_mxfp4_
from dsv41_decode.ops.topk import key_high_histogram
from dsv41_decode.testing.compare import bits_differ
from _gluon_indexer_sm90 import CASES
import test_indexer as TI
from helpers import compile_script

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module")
def sm90_builds() -> dict:
    """tests/ops/_gluon_indexer_sm90.py's compiles of its CASES, by case tuple, run in a subprocess
    without the interpreter (the kernel calls `fp4.bf16_round`, a Triton JIT function): ~1 s each."""
    _, rows = compile_script(Path(__file__).with_name("_gluon_indexer_sm90.py"))
    return {tuple(r["case"]): r for r in rows}


@pytest.mark.parametrize("case", CASES, ids=[f"h{c[0]}-p{c[1]}-s{c[2]}" + ("-cand" if c[3] else "") + ("-hist" if c[4] else "")
                                             + (f"-r{c[5]}" if len(c) > 5 and c[5] else "")
                                             + ("-packed" if len(c) > 6 and c[6] else "")
                                             + ("-pairs" if len(c) > 7 and c[7] else "")
                                             + ("-kperm" if len(c) > 8 and c[8] else "")
                                             + (f"-group{c[9]}" if len(c) > 9 and c[9] != 1 else "")
                                             + ("-qf" if len(c) > 10 and c[10] else "")
                                             + ("-fold" if len(c) > 11 and c[11] else "") for c in CASES])
def test_compiles_for_sm90_without_spills(sm90_builds, case):
    r = sm90_builds[case]
    assert r["LOCAL"] == 0 and r["STACK"] == 0, r
    ops = r["ops"]
    assert ops.get("STL", 0) == 0 and ops.get("LDL", 0) == 0, ops
    # one FP8 wgmma per scale block, each from a zero accumulator (RZ): the block partials
    gmma, bh = r["gmma"], r["block_h"]
    assert len(gmma) == 4 and all(t.startswith(f"QGMMA.64x{bh}x32.F32.E4M3.E4M3") and ", RZ" in t for t in gmma), gmma
    assert "WARPGROUP.DEPBAR.LE gsb0, 0x0" in r["waits"], r["waits"]
    # two waits a tile with the wgmmas two at a time, else one
    pairs = len(case) > 7 and case[7]
    assert r["loop_ops"].get("WARPGROUP", 0) == (6 if pairs else 5), r["loop_ops"]
    # the records arrive by asynchronous copies, waited on with tiles still in flight
    loop = r["loop_ops"]
    assert loop.get("QGMMA", 0) == 4, loop
    # 4-byte copies only (records are 4-byte aligned): 8 code words and the scale word a thread
    assert r["ldgsts"] and not any(".64" in t or ".128" in t for t in r["ldgsts"]), r["ldgsts"]
    assert loop.get("LDGSTS", 0) == 9, loop
    assert f"DEPBAR.LE SB0, {hex(case[2] - 2)}" in r["waits"], r["waits"]
    # the widening's byte permutes (none with the permuted key order; with the BF16x2 terms, one per
    # pair of weights)
    kperm = len(case) > 8 and case[8]
    assert (loop.get("PRMT", 0) >= 16) == (not kperm), loop
    # the weighted terms two at a time in BF16x2 when asked for, else the FP32 relu and product
    packed = len(case) > 6 and case[6]
    assert (loop.get("HMNMX2", 0) > 0 and loop.get("HMUL2", 0) + loop.get("HFMA2", 0) > 0) == bool(packed), loop
    assert r["shared"] <= r["shared_limit"], r
    # with pages of 64 and no candidate mask, the loop's one plain global load is the page of the tile
    # issued next iteration: read (moved to a uniform register) in the loop's second half, not right
    # after its load, where the issue waited a global load's latency every tile (uncapped: at the cap
    # of 112 ptxas moves it 120 instructions in)
    # (with row groups also each row's n_vis, read where the row's scores are masked)
    # (qf_smem: loaded two iterations ahead; compiled at 96 registers with the wgmmas two at a time, where
    # ptxas moves the page into a uniform register 200 instructions after its load, 250 before the loop's end)
    # (the query fold: ptxas reads it before the second pair's branch, ~180 instructions after its load)
    group = case[9] if len(case) > 9 else 1
    qf = len(case) > 10 and case[10]
    fold = len(case) > 11 and case[11]
    if case[1] % 64 == 0 and not case[3]:
        assert len(r["loop_loads"]) == (1 if group == 1 else 2), r["loop_loads"]
        if not r["maxnreg"] and group == 1:
            least = 150 if qf or fold else r["loop_len"] // 2
            assert all(d is None or d > least for _, d in r["loop_loads"]), (r["loop_len"], r["loop_loads"])
    # the histogram: per tile, two warp votes (one per entry register) and a relaxed add each to the
    # program's own counters, no barrier; only when asked for
    assert (loop.get("MATCH", 0), loop.get("REDG", 0)) == ((2, 2) if case[4] else (0, 0)), loop
    assert loop.get("BAR", 0) == 3, loop
    # at the step's 32 heads, a register budget that keeps three programs resident per SM (the four
    # block partials hold BLOCK_H / 2 registers each: 64 heads need more, without spilling); with the
    # wgmmas two at a time four, by shared memory too (a row group's queries included)
    # (the query's scales and weights in shared memory, qf_smem, with the wgmmas two at a time: 96
    # registers, five programs an SM)
    if r["block_h"] <= 32:
        assert r["REG"] <= (r["maxnreg"] or (96 if pairs and qf else 128 if pairs else 168)), r
        assert (5 if pairs and qf else 4 if pairs else 3) * (r["shared"] + 1024) <= 228 * 1024, r
    # qf_smem: the four powers of two and the weights are loaded again from shared memory every tile
    assert (loop.get("LDS", 0) >= 20) == bool(qf or group > 1), loop
    # the query fold: two uniform branches a tile, each over one pair of blocks' multiplications by the
    # query's powers of two (2 x 64 x BLOCK_H / 128 a thread), which a folded row skips; none without it
    per_pair = {"FMUL": 2 * GI.BLOCK_E * bh // 128}
    assert sum(run == per_pair for run in r["skips"]) == (2 if fold else 0), r["skips"]


def test_query_fold_rule_holds_64q_exactly_in_e4m3():
    """`query_fold_rows`' rule (the kernel's `_q_foldable` on the same bounds) against every MXFP4
    block it can meet: E2M1 codes up to each largest code, both signs, times 2^s for s in [-40, 11].
    Where the rule folds, 64 q is exact in E4M3 (torch's float8_e4m3fn round trip); just outside
    its bounds (amax exponent bytes 114 and 130) some block is not, so neither bound can widen; a
    row folds only where every block of every head does (a zero block always does)."""
    e2m1 = torch.tensor([0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    inexact_at = set()
    for s in range(-40, 12):
        for top in range(len(e2m1)):
            vals = torch.cat([e2m1[:top + 1], -e2m1[:top + 1]]) * 2.0 ** s
            block = torch.zeros(32)
            block[:vals.numel()] = vals
            iq = block.repeat(4).view(1, 1, 128).bfloat16()
            assert torch.equal(iq.float().view(4, 32)[0], block)
            exact = bool(((64 * block).to(torch.float8_e4m3fn).float() == 64 * block).all())
            if bool(GI.query_fold_rows(iq)[0]):
                assert exact, (s, top)
            elif not exact:
                inexact_at.add(int((vals.abs().max().view(torch.int32) >> 23) & 0xFF))
    assert {GI.FOLD_Q_EXP_MIN - 1, GI.FOLD_Q_EXP_MAX + 1} <= inexact_at, sorted(inexact_at)
    rows = torch.full((3, 2, 128), 0.5).bfloat16()
    rows[1, 1, 32:64] = 0.0
    rows[2, 1, 96] = 64.0
    assert GI.query_fold_rows(rows).tolist() == [True, True, False]


def test_load_use_distances_reads_sass_registers():
    # sm90.load_use_distances on hand-written loops: the first read of a load's register (a guarded
    # load, a 64-bit operand, a move to a uniform register), none where the register is rewritten
    # first or never read in the pass
    from dsv41_decode.testing import sm90
    loop = ["@!P1 LDG.E R24, desc[UR30][R26.64]", "IADD3 R5, R6, R7, RZ", "IMAD.WIDE R24, R24, 0x1100, RZ",
            "LDG.E R40, desc[UR30][R2.64]", "MOV R40, R3", "IADD3 R1, R40, R1, RZ",
            "LDG.E R25, desc[UR30][R8.64]", "LDG.E.64 R10, desc[UR30][R24.64]", "@P0 R2UR UR5, R11", "BRA 0x0"]
    assert sm90.load_use_distances(loop) == [("@!P1 LDG.E R24, desc[UR30][R26.64]", 2),
                                             ("LDG.E R40, desc[UR30][R2.64]", None),
                                             ("LDG.E R25, desc[UR30][R8.64]", 1),
                                             ("LDG.E.64 R10, desc[UR30][R24.64]", 1)]
    assert sm90.load_use_distances(["LDGSTS.E [R35], desc[UR26][R24.64]", "IADD3 R1, R24, R1, RZ"]) == []


def test_default_options_by_call_size():
    """The launch's defaults: three programs an SM, four wgmmas in flight, up to SMALL_CALL_MAX rows x
    entries; above, the wgmmas two at a time and the permuted key order at four an SM; the programs a
    row fit one wave (`programs_per_row`) and the scratch size follows the programs the default launches."""
    small = {"programs_per_sm": 3, "mma_pairs": False, "kperm": False}
    large = {"programs_per_sm": 4, "mma_pairs": True, "kperm": True}
    assert GI.default_options(1, GI.SMALL_CALL_MAX) == small and GI.default_options(4, 8192) == small
    assert GI.default_options(1, GI.SMALL_CALL_MAX + 1) == large and GI.default_options(16, 8192) == large
    # 1 x 128K: 4 x 132 programs (one per 64-entry tile at most); 1 x 32K: 3 x 132
    assert GI.hist_scratch_numel(1, 131072, "cpu") == 4 * 132 * GI.HIST_BINS
    assert GI.hist_scratch_numel(1, 32768, "cpu") == 3 * 132 * GI.HIST_BINS
    assert GI.hist_scratch_numel(1, 32768, "cpu", 4) == 512 * GI.HIST_BINS
    assert GI.hist_scratch_numel(16, 32768, "cpu", 4, row_group=4) == 16 * 33 * 4 * GI.HIST_BINS
    # rows that divide the SMs' programs unevenly: one wave (64 x 8 = 512 of 528, not 64 x 9 = 576)
    assert GI.programs_per_row(64, 32768, "cpu", 4) == 8 and GI.programs_per_row(32, 131072, "cpu", 4) == 16
    assert GI.programs_per_row(5, 1 << 20, "cpu", 4) == 105 and GI.programs_per_row(64, 32768, "cpu", 3) == 6
    assert GI.programs_per_row(600, 32768, "cpu", 4) == 1 and GI.programs_per_row(1, 640, "cpu", 4) == 10
    assert GI.hist_scratch_numel(64, 32768, "cpu") == 64 * 8 * GI.HIST_BINS


def test_bad_inputs_raise_naming_the_argument():
    iq, w, pool, bt, slot, nv = TI.make_inputs(2, 8, [10, 20], seed=1)
    iq, w, pool, bt, slot, nv = (t.cpu() for t in (iq, w, pool, bt, slot, nv))
    out = torch.empty(2, 32)
    run = GI.gluon_index_scores_mxfp4_
    for args, kw, match in (
            ((iq.float(), w, pool, bt, 16, slot, nv, out), {}, "iq must be"),
            ((iq, w[:, :2], pool, bt, 16, slot, nv, out), {}, "w must be"),
            ((iq, w, pool[:, :64], bt, 16, slot, nv, out), {}, "pool must be"),
            ((iq, w, pool, bt, 0, slot, nv, out), {}, "page must be"),
            ((iq, w, pool, bt, 16, slot, nv.long(), out), {}, "n_vis must be"),
            ((iq, w, pool, bt, 16, slot, nv, out), {"cand_mask": torch.ones(2, 3, dtype=torch.bool)}, "cand_mask"),
            ((iq, w, pool, bt, 16, slot, nv, out), {"hist": torch.zeros(2, 100, dtype=torch.int32)}, "hist must be"),
            ((iq, w, pool, bt, 16, slot, nv, out), {"hist": torch.zeros(2, 256)}, "hist must be"),
            ((iq, w, pool, bt, 16, slot, nv, out), {"stages": 1}, "stages must be"),
            ((iq, w, pool, bt, 16, slot, nv, out), {"stages": 13}, "stages must be"),
            ((iq, w, pool, bt, 16, slot, nv, out), {"programs_per_sm": 0}, "programs_per_sm must be"),
            ((iq, w, pool, bt, 16, slot, nv, out), {"maxnreg": 100}, "maxnreg must be"),
            ((iq, w, pool, bt, 16, slot, nv, out), {"hist_scratch": torch.zeros(4096)}, "hist_scratch must be"),
            ((iq, w, pool, bt, 16, slot, nv, out), {"row_group": 3}, "row_group must be"),
            ((iq, w, pool, bt, 16, slot, nv, out), {"row_group": True}, "row_group must be"),
            ((iq, w, pool, bt, 16, slot, nv, out), {"qf_smem": 1}, "qf_smem must be"),
            ((iq, w, pool, bt, 16, slot, nv, out), {"fold_q": 1}, "fold_q must be"),
            ((iq, w, pool, bt, 16, slot, nv, out), {}, "compute capability 9.0")):
        with pytest.raises(ValueError, match=match):
            run(*args, **kw)


@triton.jit
def _row_groups_kernel(slot_ptr, nvis_ptr, out_ptr, n_rows, GROUP: tl.constexpr):
    n = tl.program_id(0)
    lead, size, rank = GI.row_group(slot_ptr, nvis_ptr, n, n_rows, GROUP)
    tl.store(out_ptr + 3 * n, lead)
    tl.store(out_ptr + 3 * n + 1, size)
    tl.store(out_ptr + 3 * n + 2, rank)


def _row_groups_wanted(slots: list[int], n_vis: list[int], group: int) -> list[tuple[int, int, int]]:
    """(lead, size, rank) of every row by the definition: runs of consecutive rows with one slot and
    n_vis > 0, each split into groups of `group` rows from its first; any other row alone."""
    out, i, n = [], 0, len(slots)
    while i < n:
        j = i + 1
        if n_vis[i] > 0:
            while j < n and n_vis[j] > 0 and slots[j] == slots[i]:
                j += 1
        for a in range(i, j, group):
            b = min(a + group, j)
            out += [(a, b - a, r - a) for r in range(a, b)]
        i = j
    return out


def test_row_group_finds_each_rows_group():
    """`gluon_indexer.row_group` (the scorer's grouping of a request's rows, a Triton function the
    Gluon kernel calls), run by the interpreter: every row's (lead, size, rank) as defined, at
    row_group 2 and 4, on the step's layouts (requests of 1-9 rows, padding rows of slot 0 and n_vis
    0 after a real slot-0 request, a slot again after another's rows, n_vis 0 inside a request, one
    row, int32 and int64 slots) and random ones."""
    layouts = [([0], [5]), ([0] * 9, [7] * 9), ([3, 3, 3, 3, 3, 1, 1, 0, 0, 0], [9, 9, 9, 9, 9, 4, 4, 2, 0, 0]),
               ([2, 2, 5, 2, 2, 2], [1, 0, 3, 3, 3, 3]), ([0, 0, 0, 1, 1, 1, 1, 1], [5, 6, 0, 1, 2, 3, 4, 5])]
    rng = random.Random(3)
    for _ in range(12):
        n = rng.randint(1, 40)
        slots = [rng.choice((0, 1, 2)) for _ in range(n)]
        layouts.append((slots, [rng.choice((0, 1, 64, 4000)) for _ in range(n)]))
    for slots, n_vis in layouts:
        for group in (2, 4):
            for dtype in (torch.int32, torch.int64):
                out = torch.full((len(slots), 3), -7, dtype=torch.int32)
                _row_groups_kernel[(len(slots),)](torch.tensor(slots, dtype=dtype),
                                                  torch.tensor(n_vis, dtype=torch.int32), out, len(slots), group)
                got = [tuple(r) for r in out.tolist()]
                assert got == _row_groups_wanted(slots, n_vis, group), (slots, n_vis, group, dtype)


# --- GPU ---------------------------------------------------------------------------------------

def _inputs(rows: int, n_vis: list[int], seed: int, page: int = 16, heads: int = 32, slots: int | None = None):
    """test_indexer's operands at `page` entries a page (the module's page is rebound for the call);
    slots: the request slots with pages (default: one a row)."""
    old = TI._PAGE
    TI._PAGE = page
    try:
        return TI.make_inputs(rows, heads, n_vis, seed, slots)
    finally:
        TI._PAGE = old


def _pair(args, page: int, max_entries: int, cand=None, hist=None, **kw):
    """(Gluon scores, Triton FP8-path scores) of the same call."""
    rows = args[0].shape[0]
    got = torch.full((rows, max_entries), float("nan"), device=DEVICE)
    ref = torch.full((rows, max_entries), float("nan"), device=DEVICE)
    GI.gluon_index_scores_mxfp4_(*args[:4], page, *args[4:], got, cand_mask=cand, hist=hist, **kw)
    index_scores_mxfp4_(*args[:4], page, *args[4:], ref, cand_mask=cand, fp8_dot=True)
    return got, ref


def _assert_bits_equal(got, ref, what: str):
    n = bits_differ(got, ref)
    assert n == 0, f"{what}: {n} of {got.numel()} scores differ from the Triton FP8 path's bits"


def _contexts(rows: int, seed: int) -> list[int]:
    """Row contexts 0..4103 covering n_vis 0, 1, a partial page, tile edges and a few K."""
    edge = [0, 1, 15, 16, 17, 63, 64, 65, 127, 129, 1000, 4103]
    g = torch.Generator().manual_seed(seed)
    return [edge[i] if i < len(edge) else int(torch.randint(1, 4104, (1,), generator=g)) for i in range(rows)]


@pytest.mark.gpu
@pytest.mark.parametrize("page", [16, 64])
@pytest.mark.parametrize("rows", [1, 4, 16, 64])
def test_gpu_bits_equal_triton_fp8_path(rows, page):
    n_vis = _contexts(rows, seed=rows) if rows > 1 else [4103]
    args = _inputs(rows, n_vis, seed=rows + page, page=page)
    got, ref = _pair(args, page, 4160)
    _assert_bits_equal(got, ref, f"rows={rows} page={page}")
    # and within test_indexer's tolerance of the reference (a few rows: the reference is slow)
    pick = list(range(min(rows, 4)))
    sub = tuple(t[pick] if i in (0, 1, 4, 5) else t for i, t in enumerate(args))
    TI._PAGE, old = page, TI._PAGE
    try:
        TI._check(got[pick], TI.reference_scores(*sub, 4160))
    finally:
        TI._PAGE = old


@pytest.mark.gpu
@pytest.mark.parametrize("stages, programs_per_sm, maxnreg, packed, pairs", [
    (2, 1, None, False, False), (4, 4, None, False, False), (8, 2, None, False, False), (12, 8, None, False, False),
    (6, 4, 128, False, False), (4, 4, None, True, False), (4, 4, None, False, True), (6, 5, 96, True, True)])
@pytest.mark.parametrize("kperm", [False, True])
def test_gpu_configurations_give_the_same_bits(stages, programs_per_sm, maxnreg, packed, pairs, kperm):
    kw = dict(stages=stages, programs_per_sm=programs_per_sm, maxnreg=maxnreg, packed_terms=packed, mma_pairs=pairs,
              kperm=kperm)
    for page in (16, 64):
        got, ref = _pair(_inputs(4, [4103, 777, 0, 64], seed=5, page=page), page, 4200, **kw)
        _assert_bits_equal(got, ref, f"page={page} {kw}")


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [16, 64])
def test_gpu_packed_terms_bits_equal_triton_fp8_path(rows):
    # the BF16x2 terms: the same bits wherever no weighted term is an FP32 subnormal (none here)
    args = _inputs(rows, _contexts(rows, seed=rows + 50), seed=rows + 50, page=64)
    for kw in ({"packed_terms": True}, {"packed_terms": True, "mma_pairs": True, "kperm": True}):
        got, ref = _pair(args, 64, 4160, **kw)
        _assert_bits_equal(got, ref, f"rows={rows} {kw}")


@pytest.mark.gpu
def test_gpu_candidate_restricted():
    args = _inputs(3, [4000, 333, 64], seed=7)
    g = torch.Generator(device=DEVICE).manual_seed(7)
    cand = torch.rand(3, 4096, generator=g, device=DEVICE) < 0.3
    for kw in ({}, {"mma_pairs": True, "kperm": True}):
        got, ref = _pair(args, 16, 4096, cand=cand, **kw)
        _assert_bits_equal(got, ref, f"candidate mask {kw}")
    assert bool(torch.isneginf(got[~cand]).all())


def _scale_extremes() -> tuple:
    """Two rows of 8 heads, row 0's first query block scaled by 2^-40 and its second zero, row 1's
    third scaled by 2^40, every key's first scale byte in 90..160 (operands for `_pair`)."""
    iq, w, pool, bt, slot, nv = TI.make_inputs(2, 8, [64, 50], seed=11)
    iq = iq.float().cpu()
    iq[0, :, :32] *= 2.0 ** -40
    iq[0, :, 32:64] = 0.0
    iq[1, :, 64:96] *= 2.0 ** 40
    pool = pool.cpu().clone()
    pool[:, 64] = torch.randint(90, 160, (pool.shape[0],), dtype=torch.uint8)
    return iq.bfloat16().to(DEVICE), w, pool.to(DEVICE), bt, slot, nv


@pytest.mark.gpu
def test_gpu_scale_extremes():
    args = _scale_extremes()
    for kw in ({}, {"kperm": True, "packed_terms": True}):
        got, ref = _pair(args, TI._PAGE, 64, **kw)
        _assert_bits_equal(got, ref, f"scale extremes (8 heads) {kw}")
    TI._check(got, TI.reference_scores(*args, 64))


@pytest.mark.gpu
def test_gpu_qf_smem_gives_the_same_bits():
    """qf_smem (the query's powers of two and head weights read from shared memory each tile, pages
    two iterations ahead; at a cap of 96 registers with the wgmmas two at a time): the Triton FP8
    path's bits with the wgmmas two at a time at five programs an SM and with four in flight at four,
    at pages of 16 and 64, with a candidate mask, with the histogram (a caller's zeroed scratch, left
    zero), and at the scale extremes of test_gpu_scale_extremes."""
    rows = 16
    n_vis = _contexts(rows, seed=91)
    g = torch.Generator(device=DEVICE).manual_seed(91)
    cand = torch.rand(rows, 4160, generator=g, device=DEVICE) < 0.3
    for kw in ({"qf_smem": True, "programs_per_sm": 5, "mma_pairs": True, "kperm": True},
               {"qf_smem": True, "programs_per_sm": 4, "mma_pairs": False, "kperm": False}):
        for page in (16, 64):
            args = _inputs(rows, n_vis, seed=91 + page, page=page)
            got, ref = _pair(args, page, 4160, **kw)
            _assert_bits_equal(got, ref, f"page={page} {kw}")
        got, ref = _pair(args, 64, 4160, cand=cand, **kw)
        _assert_bits_equal(got, ref, f"candidate mask {kw}")
        _check_hist_with_scratch(args, 4160, kw)
    got, ref = _pair(_scale_extremes(), TI._PAGE, 64, qf_smem=True, mma_pairs=True, kperm=True)
    _assert_bits_equal(got, ref, "scale extremes (8 heads), qf_smem")


@pytest.mark.gpu
def test_gpu_fold_q_gives_the_same_bits():
    """fold_q (a row whose query blocks allow it holds 64 q as its E4M3 operand and skips the
    epilogue's multiplications by the query's powers of two): the Triton FP8 path's bits on rows
    that fold (test_indexer's queries: checked) in both default configurations, at pages of 16 and
    64, with a candidate mask and with the histogram; on rows that do not (the scale extremes); and
    in one call where two rows of 16 do not (one block scaled by 2^20, one head's block by 2^-30)
    and two fold at the rule's edges (blocks of scale 2^-14 and 2^0 holding E2M1's smallest and
    largest values: 64 q from E4M3's smallest subnormal to 384); the kernel's per-row decision (a row
    outside the contract whose fold shows in its bits); 8 heads with a zero and a -0.0 block."""
    rows = 16
    n_vis = _contexts(rows, seed=93)
    g = torch.Generator(device=DEVICE).manual_seed(93)
    cand = torch.rand(rows, 4160, generator=g, device=DEVICE) < 0.3
    for kw in ({"fold_q": True}, {"fold_q": True, "programs_per_sm": 3, "mma_pairs": False, "kperm": False}):
        for page in (16, 64):
            args = _inputs(rows, n_vis, seed=93 + page, page=page)
            assert bool(GI.query_fold_rows(args[0]).all())
            got, ref = _pair(args, page, 4160, **kw)
            _assert_bits_equal(got, ref, f"page={page} {kw}")
        got, ref = _pair(args, 64, 4160, cand=cand, **kw)
        _assert_bits_equal(got, ref, f"candidate mask {kw}")
        _check_hist_with_scratch(args, 4160, kw)
    extremes = _scale_extremes()
    assert not bool(GI.query_fold_rows(extremes[0]).any())
    got, ref = _pair(extremes, TI._PAGE, 64, fold_q=True)
    _assert_bits_equal(got, ref, "scale extremes (8 heads), fold_q")
    args = _inputs(rows, n_vis, seed=95, page=64)
    iq = args[0].clone()
    iq[3, :, :32] *= 2.0 ** 20
    iq[9, 5, 96:] *= 2.0 ** -30
    edge = torch.tensor([0.5, -1.5, 6.0, 3.0] * 8, device=DEVICE)
    for r in (6, 7):
        iq[r, :, :32] = (edge * 2.0 ** -14).bfloat16()
        iq[r, :, 96:] = (edge.flip(0) * (1.0 if r == 6 else -1.0)).bfloat16()
    assert GI.query_fold_rows(iq).tolist() == [i not in (3, 9) for i in range(rows)]
    got, ref = _pair((iq, *args[1:]), 64, 4160, fold_q=True)
    _assert_bits_equal(got, ref, "rows that fold beside rows that do not")
    # the kernel's decision per row: a block outside the contract's values whose largest |q| is 7.5 (exponent
    # byte 129, so the row folds) has 64 q = 480 saturate to E4M3's 448 in the fold's operand only, so the
    # row's scores differ with fold_q, and no other row's do
    iq[12, 0, 5] = 7.5
    assert bool(GI.query_fold_rows(iq)[12])
    folded, plain = _pair((iq, *args[1:]), 64, 4160, fold_q=True)[0], _pair((iq, *args[1:]), 64, 4160)[0]
    assert bits_differ(folded[12], plain[12]) > 0
    keep = [i for i in range(rows) if i != 12]
    assert bits_differ(folded[keep], plain[keep]) == 0
    # 8 heads (the wgmma's N padded to 16: masked heads), a zero block and a -0.0 block in rows that fold
    small = _inputs(4, [4103, 777, 64, 1000], seed=97, page=64, heads=8)
    iq8 = small[0].clone()
    iq8[1, 2, 32:64] = 0.0
    iq8[2, :, 64:96] = -0.0
    assert bool(GI.query_fold_rows(iq8).all())
    got, ref = _pair((iq8, *small[1:]), 64, 4160, fold_q=True)
    _assert_bits_equal(got, ref, "8 heads with zero and -0.0 blocks, fold_q")


@pytest.mark.gpu
def test_gpu_repeatable_and_batch_invariant():
    rows = 16
    n_vis = _contexts(rows, seed=3)
    args = _inputs(rows, n_vis, seed=3, page=64)
    a, _ = _pair(args, 64, 4160)
    b, _ = _pair(args, 64, 4160)
    assert bits_differ(a, b) == 0
    for i in (0, 7, rows - 1):
        one = tuple(t[i:i + 1] if k in (0, 1, 4, 5) else t for k, t in enumerate(args))
        alone, _ = _pair(one, 64, 4160)
        assert bits_differ(alone[0], a[i]) == 0, f"row {i} alone differs from the same row among {rows}"


# the two configurations the default takes by the call's size (`default_options`: three programs an
# SM with the four wgmmas in flight at small calls; the wgmmas two at a time with the permuted key
# order, four an SM, above) and the BF16x2 terms on the latter (not a default)
CONFIGS = ({"programs_per_sm": 3, "mma_pairs": False, "kperm": False}, {}, {"packed_terms": True})


@pytest.mark.gpu
def test_gpu_default_configurations():
    """The default's two configurations and the BF16x2 terms in one test (few compiles): edge
    contexts at 16 rows (a large call: the default is mma_pairs + kperm), pages of 64 (and 16),
    dense, candidate-restricted and with the histogram into a caller's zeroed scratch; then 2 rows
    (a small call: the other configuration) with the histogram."""
    rows = 16
    n_vis = _contexts(rows, seed=77)
    g = torch.Generator(device=DEVICE).manual_seed(77)
    cand = torch.rand(rows, 4160, generator=g, device=DEVICE) < 0.3
    assert GI.default_options(rows, 4160) == {"programs_per_sm": 4, "mma_pairs": True, "kperm": True}
    assert GI.default_options(2, 4160) == CONFIGS[0]
    for i, kw in enumerate(CONFIGS):
        for page in ((16, 64) if i == 1 else (64, )):
            args = _inputs(rows, n_vis, seed=77 + page, page=page)
            got, ref = _pair(args, page, 4160, **kw)
            _assert_bits_equal(got, ref, f"page={page} {kw}")
        if i == 1:
            got, ref = _pair(args, 64, 4160, cand=cand, **kw)
            _assert_bits_equal(got, ref, f"candidate mask {kw}")
        if i < 2:
            _check_hist_with_scratch(args, 4160, kw)
    _check_hist_with_scratch(_inputs(2, [4103, 1000], seed=78, page=64), 4160, {})


def _check_hist_with_scratch(args, max_entries: int, kw: dict, page: int = 64) -> None:
    """The scores' bits and the fused histogram with a caller's zeroed scratch (left zero; sized
    for kw's programs_per_sm and row_group)."""
    rows = args[0].shape[0]
    hist = torch.zeros(rows, 2568, dtype=torch.int32, device=DEVICE)
    numel = GI.hist_scratch_numel(rows, max_entries, DEVICE, kw.get("programs_per_sm"), kw.get("row_group", 1))
    scratch = torch.zeros(numel, dtype=torch.int32, device=DEVICE)
    got, ref = _pair(args, page, max_entries, hist=hist, hist_scratch=scratch, **kw)
    _assert_bits_equal(got, ref, f"{rows} rows with the histogram {kw}")
    assert torch.equal(hist[:, :256].cpu(), key_high_histogram(ref, args[5]).cpu()), kw
    assert not bool(hist[:, 256:].any()) and not bool(scratch.any()), kw


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 16, 64])
def test_gpu_histogram_of_the_key_high_bytes(rows):
    n_vis = _contexts(rows, seed=rows + 100) if rows > 1 else [4103]
    args = _inputs(rows, n_vis, seed=rows + 100, page=64)
    # -0.0 scores (row 0's weights -0.0: every term -0.0) and NaN scores (key scale byte 255: an
    # infinite block scale, NaN where a block partial is 0 or infinite terms of both signs meet),
    # which ops.topk keys as +0.0 and leaves out
    args[1][0, :] = -0.0
    args[2][::97, 64] = 255
    want = key_high_histogram(_pair(args, 64, 4160)[1], args[5]).cpu()
    for kw in ({}, {"mma_pairs": True, "packed_terms": True, "kperm": True}, {"programs_per_sm": 1, "stages": 2}):
        hist = torch.zeros(rows, 2568, dtype=torch.int32, device=DEVICE)
        hist[:, 256:] = 7                      # the rest of the workspace is left alone
        got, ref = _pair(args, 64, 4160, hist=hist, **kw)
        _assert_bits_equal(got, ref, f"with the histogram {kw}")
        assert torch.equal(hist[:, :256].cpu(), want), kw
        assert bool((hist[:, 256:] == 7).all())
    # added to what is there: a second call doubles it; a zeroed scratch of the caller's is left zero
    scratch = torch.zeros(GI.hist_scratch_numel(rows, 4160, DEVICE) + 5, dtype=torch.int32, device=DEVICE)
    got, _ = _pair(args, 64, 4160, hist=hist, hist_scratch=scratch)
    assert torch.equal(hist[:, :256].cpu(), 2 * want)
    assert not bool(scratch.any())


def _draft_rows(runs: list[tuple[int, int]], seed: int, page: int = 64):
    """Operands laid out as a step with draft rows lays them out: per (n_vis, rows) of `runs` one
    request slot read by that many consecutive rows, seeing n_vis - rows + 1 .. n_vis entries (at
    least 0), the rows' queries and weights their own; int64 slots (the step's)."""
    n_vis = [max(0, nv - (r - 1 - j)) for nv, r in runs for j in range(r)]
    iq, w, pool, bt, _, nv = _inputs(len(n_vis), n_vis, seed=seed, page=page, slots=len(runs))
    slot = torch.tensor([i for i, (_, r) in enumerate(runs) for _ in range(r)], dtype=torch.int64, device=DEVICE)
    return iq, w, pool, bt, slot, nv


def _check_row_groups(args, page: int, max_entries: int, kws: list[dict], groups=(2, 4)) -> None:
    """row_group in `groups` against row_group 1 (itself against the Triton path) in each
    configuration of `kws`: the scores bit for bit, the fused histogram (with a zeroed scratch of
    the caller's, left zero, and with the launch's own), and without the histogram."""
    rows = args[0].shape[0]
    want = key_high_histogram(_pair(args, page, max_entries)[1], args[5]).cpu()
    for kw in kws:
        plain, ref = _pair(args, page, max_entries, **kw)
        _assert_bits_equal(plain, ref, f"page={page} {kw}")
        for group in groups:
            _check_hist_with_scratch(args, max_entries, dict(kw, row_group=group), page)
            hist = torch.zeros(rows, 2568, dtype=torch.int32, device=DEVICE)
            got, _ = _pair(args, page, max_entries, hist=hist, row_group=group, **kw)     # the launch's scratch
            _assert_bits_equal(got, plain, f"row_group={group} page={page} {kw}, the launch's scratch")
            assert torch.equal(hist[:, :256].cpu(), want), (group, kw)
            got, _ = _pair(args, page, max_entries, row_group=group, **kw)
            _assert_bits_equal(got, plain, f"row_group={group} page={page} {kw} without the histogram")


@pytest.mark.gpu
@pytest.mark.parametrize("page", [16, 64])
def test_gpu_row_groups_give_the_same_bits(page):
    """row_group 2 and 4 (a request's rows scored together on each key tile read): the scores of
    row_group 1 bit for bit (and so the Triton path's) and the fused histogram, in both default
    configurations, with the BF16x2 terms, and with one program a row and a two-slot ring (every
    program several tiles, the ring refilled under a multi-row group): runs of 1-9 rows of one slot
    (at row_group 4 a run of 5 or 9 is groups of 4 and 1), the first row in a run, n_vis 0, past
    max_entries (4100, not a multiple of the tile) and not a multiple of the tile, a slot read again
    after another's rows, and the step's padding after a run of slot 0 (rows of slot 0 and n_vis
    0: groups of their own); then with a candidate mask (rows scored one a program)."""
    runs = [(4103, 3), (777, 4), (130, 5), (2, 3), (1000, 2), (64, 1), (2048, 9), (65, 4), (0, 1)]
    args = _draft_rows(runs, seed=page, page=page)
    args[4][-5:-1] = 1                    # the last run reads the second run's slot again
    args[4][-1] = 0                       # then a padding row: slot 0, n_vis 0
    configs = [{}, {"programs_per_sm": 3, "mma_pairs": False, "kperm": False}, {"packed_terms": True},
               {"programs_per_sm": 1, "stages": 2}]
    _check_row_groups(args, page, 4100, configs)
    g = torch.Generator(device=DEVICE).manual_seed(page)
    cand = torch.rand(args[0].shape[0], 4100, generator=g, device=DEVICE) < 0.3
    got, ref = _pair(args, page, 4100, cand=cand, row_group=4)
    _assert_bits_equal(got, ref, f"row_group=4 page={page} with a candidate mask")


@pytest.mark.gpu
def test_gpu_row_groups_at_the_steps_shapes():
    """The step's layout at 16 rows: four requests of a decode row and three draft rows at 32K
    entries (ratio 1) and one at 1 row x 128K + padding rows (slot 0, n_vis 0), row_group 4 against
    1, at pages of 64 with the histogram."""
    args = _draft_rows([(32768, 4), (30000, 4), (32000, 4), (20000, 4)], seed=91, page=64)
    _check_row_groups(args, 64, 32768, [{}], groups=(4,))
    args = _draft_rows([(131072, 1), (0, 7)], seed=92, page=64)
    args[4][1:] = 0
    _check_row_groups(args, 64, 131072, [{}], groups=(4,))
