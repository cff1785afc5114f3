"""ops.gluon_mm, the Gluon tier of the low-batch MXFP8 linear (sm_90 only).

On the CPU: the kernel compiles for sm_90 (Triton's own ptxas) in the configurations the plans for
the real shapes use, with no spills, and its SASS holds the FP8 wgmma (QGMMA), the TMA loads
(UTMALDG) and a wait that leaves one wgmma group in flight; the plan's bad arguments raise errors
that name them. On the GPU (`-m gpu`): every real shape at every row count 1..64 against the
reference, against the Triton tier `low_latency_mm`, against itself run to run and across row
counts. The real shapes are `low_latency_mm`'s: the V4.1-Flash FP8 linears and their TP shards
(wq_b 32768 x 1280 and its 16384 / 8192 / 4096 shards, the last also the indexer's wq_b; wo_b
5120 x 8192 / 4096 / 2048 / 1024; fused wq_a|wkv 1792 x 5120).

Thresholds against `reference.linear.mxfp8_mm` (the same operands):
- the kernel scales and adds the block partials in the reference's K order, so if each block
  partial were the exactly rounded FP32 of its 32 products, it would differ from the reference only
  through split-K's regrouping of the FP32 sum (a few FP32 ulps of the row's largest terms), which
  can tip one BF16 rounding of an output: 1 BF16 ulp of the row's largest output;
- but the block partial is the tensor core's: Hopper's FP8 MMA keeps fewer than 24 bits while
  aligning the 32 products, so a partial can be a few FP32 ulps of its largest product off the
  rounded exact sum, which can tip one more BF16 rounding. Hence 2 BF16 ulps of the row's largest
  output, the bound `low_latency_mm`'s GPU test uses for the same instruction (tests/ops/
  test_low_latency_mm.py), and a relative RMS below 1e-3 (measured error is FP32-sized, ~1e-6).
Against `low_latency_mm` the bound is bitwise: with the same K split bounds (`reduction_order`)
both run the same instruction (wgmma m64 k32 e4m3 with a zero accumulator) on the same 32-block,
scale its partial by the same two powers of two in the same order, add in the same K order and the
splits in the same order, and round with round-to-nearest-even. The wgmma's N (the row bucket: 8
here, 16 there at 1 row) changes how many columns one instruction computes, not the arithmetic of
one output element; the GPU test is what confirms it.
"""

import dataclasses
import re

import pytest
import torch

from dsv41_decode.ops import gluon_mm as G
from dsv41_decode.ops.index_query import index_query_
from dsv41_decode.ops.kv_write import qkv_rope_insert_
from dsv41_decode.ops.low_latency_mm import LowLatencyConfig, LowLatencyMM
from dsv41_decode.reference.linear import mxfp8_mm
from dsv41_decode.testing import sm90
from dsv41_decode.testing.sm90 import compile_linear
from dsv41_decode.testing.compare import bits_differ, rel_rms, row_ulp_distance
from _gluon_linear_support import spill_free
from helpers import FLASH_LINEAR_SHAPES, linear_operands, rope_operands

# The real shapes (the V4.1-Flash linears and their TP shards; the indexer's wq_b is wq_b_tp8's
# 4096 x 1280), and the H200's SM count for the default split.
REAL_SHAPES = FLASH_LINEAR_SHAPES
H200_SMS = 132
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _poisoned(m: int, n: int) -> torch.Tensor:
    return torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=DEVICE)


def _compile_cases() -> list[tuple[str, G.GluonMMConfig, int, int]]:
    """(shape, config, split, row bucket): the configs the real shapes' plans use on an H200
    (`default_config`, the default split rule), each compiled at its tightest bucket (the default
    config: 8 and 64 rows, its two register caps), the split-K epilogue and the single-split one
    taken in turn among the splits its shapes use (~0.7 s each)."""
    used: dict[G.GluonMMConfig, list] = {}
    for name, n, k in REAL_SHAPES:
        config = G.default_config(n, k)
        split = G.split_bounds(config.split or G._default_split(n, k, H200_SMS, config.block_n, config.block_k),
                               k, config.block_k)[1]
        used.setdefault(dataclasses.replace(config, split=None), []).append((name, split))
    cases = []
    for config, shapes in used.items():
        flags = {split > 1: (name, split) for name, split in shapes}      # one shape per split flag
        picks = list(flags.values())
        buckets = (8, 64) if config == G.GluonMMConfig() else [_deepest_bucket(config)]
        for i, bt in enumerate(buckets):
            name, split = picks[i % len(picks)]
            cases.append((name, config, split, bt))
    return cases


def _compile(split: int, bt: int, out_f32: bool = False, config: G.GluonMMConfig = G.GluonMMConfig(),
             rope: bool = False, index_query: bool = False):
    return compile_linear(G._gluon_mxfp8_mm_kernel, G.launch_options(config, bt, split),
                          [config.block_n, config.block_k], [bt, config.block_k], out_f32,
                          types={"cos_ptr": "*fp32", "sin_ptr": "*fp32"}, consts={"ROPE": rope, "INDEX_Q": index_query})


def _flushes_subnormals(kernel) -> bool:
    """Whether the compiled kernel's PTX has an FP32 multiply, add or subtract that flushes
    subnormals to zero (libdevice's _rn operations under Triton's default reflect-FTZ)."""
    return re.search(r"\b(mul|add|sub|fma)\.rn\.ftz\.f32\b", kernel.asm["ptx"]) is not None


def _check_sm90(kernel, config: G.GluonMMConfig, bt: int, split: int):
    """What an sm_90 compile of `config` at row bucket `bt` must show: no spills, the registers of
    its residency, its shared memory, its wgmmas and their depth in flight, its TMA loads, the
    mbarrier ring, the split-K counter iff split > 1, 16-byte stores."""
    mode = G.launch_mode(config, bt)[0]
    res, ins, ops = spill_free(kernel, G.maxnreg(bt, config), G.shared_bytes(config, bt))
    # The launch's registers set the residency: (4 x warpgroups + 4) warps x REG per CTA of 64K.
    assert 65536 // (32 * (4 * config.warpgroups + 4) * res["REG"]) >= G.resident_ctas(config, bt), res
    sub = config.block_k // 32
    # One wgmma m64 n{bt} k32 per consumer warpgroup and 32-wide block, from a zero accumulator
    # (RZ): a "pairs" or "slot" step issues its sub blocks once, "ahead" a pair of slots and an odd
    # last one (3 x sub).
    gmma = [t for t in ins if t.startswith("QGMMA")]
    assert len(gmma) == (3 * sub if mode == "ahead" else sub), gmma
    assert all(f"QGMMA.64x{bt}x32.F32.E4M3.E4M3" in t and " RZ," in t for t in gmma), gmma
    # The groups in flight: the deepest wait leaves all but one of the step's (or the pair's)
    # blocks outstanding, the drain none; ptxas did not serialize the wgmmas (it would wait for 0
    # after each: its C7514 warning).
    depth = {"pairs": 2, "slot": sub, "ahead": 2 * sub}[mode]
    waits = {int(t.split(",")[-1], 16) for t in ins if t.startswith("WARPGROUP.DEPBAR.LE gsb0")}
    assert max(waits) == depth - 1 and 0 in waits, sorted(waits)
    # Two TMA boxes per 128 of K (the 128-byte swizzle's width): weight and activation.
    assert ops.get("UTMALDG", 0) == 2 * config.block_k // 128, ops
    assert ops.get("SYNCS", 0) > 0, ops           # the mbarrier ring
    # The producer warp gives its registers to the consumer warpgroup(s).
    assert any(t.startswith("USETMAXREG.DEALLOC") for t in ins)
    assert (split > 1) == (ops.get("ATOMG", 0) > 0), (split, ops)   # the last-arriver counter
    # The epilogue stores y (and the split partials) as 16-byte vectors.
    stores = {t.split()[1] if t.startswith("@") else t.split()[0] for t in ins if "STG" in t}
    assert stores == {"STG.E.128"}, stores


def _deepest_bucket(config: G.GluonMMConfig) -> int:
    """The largest row bucket at which `config` runs its own MMA mode: its tightest registers."""
    return max(b for b in G.ROW_BUCKETS if G.launch_mode(config, b)[0] == config.mma)


@pytest.mark.parametrize("name,config,split,bt", _compile_cases(), ids=[f"{c[0]}-{c[3]}" for c in _compile_cases()])
def test_compiles_for_sm90_without_spills(name, config, split, bt):
    _check_sm90(_compile(split, bt, config=config), config, bt, split)


# The MMA pipelines and program shapes `GluonMMConfig` offers besides the default and the measured
# ones (the real shapes' tests cover those), combined so that each code path runs at least once in
# few compiles: every mode with one and two warpgroups and 128- and 256-deep slots, the persistent
# grid in every mode (one program per SM: several items each), the retiled weight, odd and deep
# rings, forced register caps. The GPU test below checks each bitwise against the Triton tier.
C = G.GluonMMConfig
VARIANTS = [
    C(mma="slot", retile=True), C(mma="ahead", stages=3), C(mma="ahead", maxnreg=128),
    C(warpgroups=2, mma="slot", stages=6), C(warpgroups=2, mma="ahead", persistent=True, retile=True),
    C(block_k=256, mma="slot", stages=3, retile=True), C(warpgroups=2, block_k=256, mma="slot", stages=3),
    C(mma="ahead", stages=6, persistent=True), C(mma="slot", maxnreg=64, persistent=True),
    C(persistent=True, programs_per_sm=1, stages=8),
]


def _variant_id(c: G.GluonMMConfig) -> str:
    return (f"{c.mma}-wg{c.warpgroups}-k{c.block_k}-s{c.stages}" + (f"-r{c.maxnreg}" if c.maxnreg else "")
            + ("-persistent" if c.persistent else "") + (f"{c.programs_per_sm}" if c.programs_per_sm else "")
            + ("-retile" if c.retile else ""))


@pytest.mark.parametrize("i,config", list(enumerate(VARIANTS)), ids=[_variant_id(c) for c in VARIANTS])
def test_variants_compile_for_sm90_without_spills(i, config):
    bt, split = _deepest_bucket(config), 1 + i % 2          # the split-K epilogue every other one
    _check_sm90(_compile(split, bt, config=config), config, bt, split)


WQ_B_SHAPES = [shape for shape in REAL_SHAPES if shape[0].startswith("wq_b")]


def _rope_compile_cases() -> list[tuple[str, G.GluonMMConfig, int, int]]:
    """(shape, config, split, bucket) of the query-RoPE epilogue: the configs wq_b and its TP shards
    use on an H200, each once (its deepest bucket; wq_b's measured config, which runs the epilogue
    in its persistent consumer, also at 8 rows): the persistent, the one-program single-split and
    the split-K epilogue (~1.7 s each)."""
    cases, seen = [], set()
    for name, n, k in WQ_B_SHAPES:
        config = G.default_config(n, k)
        split = G.split_bounds(config.split or G._default_split(n, k, H200_SMS, config.block_n, config.block_k),
                               k, config.block_k)[1]
        if config in seen:
            continue
        seen.add(config)
        buckets = (8, 64) if name == "wq_b" else (_deepest_bucket(config), )
        cases += [(name, config, split, bt) for bt in buckets]
    return cases


def _check_epilogue(kernel, config: G.GluonMMConfig, bt: int, split: int, against_plain: bool):
    """What an epilogue's sm_90 compile must show: `_check_sm90`'s, no FP32 op that flushes
    subnormals (the launches it replaces keep them); with against_plain, no FFMA beyond the plain
    compile's (every product and sum of the epilogue rounded on its own) and the opcode counts of
    both (kernel, plain) for the caller's own checks, else None."""
    _check_sm90(kernel, config, bt, split)
    assert not _flushes_subnormals(kernel), "the epilogue flushes FP32 subnormals"
    if not against_plain:
        return None
    ops = sm90.opcode_counts([t for _, t in sm90.sass(kernel)])
    plain = sm90.opcode_counts([t for _, t in sm90.sass(_compile(split, bt, config=config))])
    assert ops.get("FFMA", 0) == plain.get("FFMA", 0), (ops.get("FFMA"), plain.get("FFMA"))
    return ops, plain


# The indexer's wq_b at 32 and 64 index heads (the indexer is replicated under TP: no shards).
INDEXER_WQ_B_SHAPES = [("indexer_wq_b", 4096, 1280), ("indexer_wq_b_64heads", 8192, 1280)]


def _index_query_compile_cases() -> list[tuple[str, G.GluonMMConfig, int, int]]:
    """(shape, config, split, bucket) of the index-query epilogue: the configs the indexer's wq_b
    plans use on an H200 (split-K at both head counts), 32 heads' ("slot") at 8 rows, 64 heads'
    ("pairs", as 32 heads' at 64 rows) at 64, and a persistent two-warpgroup one at its deepest
    bucket (a tile is one head; the epilogue in the persistent consumer) (~1.5 s each)."""
    cases = []
    for (name, n, k), bt in zip(INDEXER_WQ_B_SHAPES, (8, 64)):
        config = G.default_config(n, k)
        split = G.split_bounds(config.split or G._default_split(n, k, H200_SMS, config.block_n, config.block_k),
                               k, config.block_k)[1]
        cases.append((name, config, split, bt))
    wg2 = C(warpgroups=2, persistent=True)
    return cases + [("indexer_wq_b", wg2, 2, _deepest_bucket(wg2))]


# (epilogue, shape, config, split, bucket); per epilogue the shape and bucket compared with the plain
# compile, and the opcodes it must add there: the rotation's FMULs and the cos/sin loads, and for the
# index query the MX block maximum (FMNMX) across the 4 threads that hold a 32-column block (SHFL)
_EPILOGUE_CASES = ([("rope", *c) for c in _rope_compile_cases()]
                   + [("index_query", *c) for c in _index_query_compile_cases()])
_EPILOGUE_AGAINST_PLAIN = {"rope": (("wq_b", 8), (("FMUL", 4), ("LDG", 1))),
                           "index_query": (("indexer_wq_b", 8), (("FMUL", 4), ("LDG", 1), ("FMNMX", 1), ("SHFL", 1)))}


@pytest.mark.parametrize("epilogue,name,config,split,bt", _EPILOGUE_CASES,
                         ids=[f"{c[0]}-{c[1]}-wg{c[2].warpgroups}-split{c[3]}-{c[4]}" for c in _EPILOGUE_CASES])
def test_epilogues_compile_for_sm90_without_spills(epilogue, name, config, split, bt):
    # The query RoPE (wq_b) and the index query (the indexer's wq_b) in the epilogue keep what the
    # plain kernel shows (no spills, the residency's registers, its shared memory, 16-byte stores of
    # y) and FP32 subnormals; their rotations round every product and sum on their own (FMUL, FADD:
    # libdevice's _rn operations) and the MXFP4 scaling is a lone product, so against the plain
    # compile (once per epilogue) no FFMA is added to the kernel's (the promotions' exact
    # scale-and-add), and the epilogue's own opcodes are there.
    where, more = _EPILOGUE_AGAINST_PLAIN[epilogue]
    counts = _check_epilogue(_compile(split, bt, config=config, **{epilogue: True}), config, bt, split,
                             against_plain=(name, bt) == where)
    if counts:
        ops, plain = counts
        for op, n in more:
            assert ops.get(op, 0) >= plain.get(op, 0) + n, (op, ops.get(op), plain.get(op))


def test_launch_table():
    # Every (config, bucket) has a launch; the default is the one the plans have always used; a
    # deeper mode never costs residency unless its cap is forced.
    for config in [G.GluonMMConfig()] + VARIANTS:
        for bt in G.ROW_BUCKETS:
            mode, cap = G.launch_mode(config, bt)
            assert G.MMA_MODES.index(mode) <= G.MMA_MODES.index(config.mma)
            if config.maxnreg is None:
                pairs = G.launch_mode(G.GluonMMConfig(warpgroups=config.warpgroups, block_k=config.block_k,
                                                      persistent=config.persistent), bt)
                assert cap == pairs[1] and pairs[0] == "pairs", (config, bt)
    assert [G.launch_mode(G.GluonMMConfig(), b) for b in G.ROW_BUCKETS] == [("pairs", 80)] * 3 + [("pairs", 128)]
    assert [G.launch_mode(G.GluonMMConfig(mma="ahead"), b)[0] for b in G.ROW_BUCKETS] == ["ahead"] * 2 + ["slot", "pairs"]
    assert G.launch_mode(G.GluonMMConfig(mma="ahead", maxnreg=128), 32) == ("ahead", 128)
    # A forced cap below what "pairs" needs is raised; under it a deeper mode runs where it fits.
    assert [G.launch_mode(G.GluonMMConfig(mma="slot", maxnreg=64), b) for b in G.ROW_BUCKETS] == \
        [("slot", 64), ("slot", 64), ("pairs", 64), ("pairs", 128)]
    # CTAs per SM (what the persistent grid launches per SM): registers or shared memory bound.
    assert [G.resident_ctas(G.GluonMMConfig(), b) for b in G.ROW_BUCKETS] == [3, 3, 3, 2]
    assert [G.resident_ctas(G.GluonMMConfig(maxnreg=64), b) for b in G.ROW_BUCKETS] == [4, 4, 4, 2]
    assert [G.resident_ctas(G.GluonMMConfig(warpgroups=2), b) for b in G.ROW_BUCKETS] == [2, 2, 2, 1]
    assert G.resident_ctas(G.GluonMMConfig(block_k=256, stages=6), 64) == 1      # 197 KB of ring


def test_retiled_weight_puts_each_slot_box_in_one_run():
    # Tile t's K step s is rows (t x steps + s) x block_n of the copy: the box the producer loads.
    w = torch.randn(130, 512, generator=_gen(5)).to(torch.float8_e4m3fn)
    for bn, bk in ((64, 128), (128, 256)):
        padded = torch.zeros(-(-130 // bn) * bn, 512, dtype=torch.uint8)      # rows past N: zero
        padded[:130] = w.view(torch.uint8)
        tiles = G._retiled(w, bn, bk).view(torch.uint8)
        steps = 512 // bk
        assert tiles.shape == (-(-130 // bn) * steps * bn, bk) and tiles.is_contiguous()
        for t in range(-(-130 // bn)):
            for st in range(steps):
                box = tiles[(t * steps + st) * bn:(t * steps + st + 1) * bn]
                assert torch.equal(box, padded[t * bn:(t + 1) * bn, st * bk:(st + 1) * bk]), (bn, t, st)


def test_tuned_configs_fit_their_shapes():
    # A measured entry names a real shape, a split (fixed per weight: batch invariance), a slot
    # depth dividing K and a ring that fits shared memory at the largest row bucket.
    real = {(n, k) for _, n, k in REAL_SHAPES}
    for (n, k), config in G._TUNED.items():
        assert (n, k) in real and config.split is not None and k % config.block_k == 0, ((n, k), config)
        assert G.shared_bytes(config, G.ROW_BUCKETS[-1]) <= G.SHARED_LIMIT, ((n, k), config)
        assert G.default_config(n, k) is config
    assert G.default_config(96, 128) == G.GluonMMConfig()


def test_split_bounds_match_the_triton_tier():
    # Same rule as low_latency_mm.reduction_order at block_k 128: equal bounds give equal bits.
    from dsv41_decode.ops.low_latency_mm import reduction_order
    for _, n, k in REAL_SHAPES:
        assert k % G.BLOCK_K == 0      # every real shape takes the Gluon tier
        for split in (1, 2, 3, 4, 8, 9, 64, 100):
            per, used = G.split_bounds(split, k)
            assert reduction_order(LowLatencyConfig(block_n=64, block_k=128, split=split), k)[1] == per
            assert (used - 1) * per < k <= used * per and per % G.BLOCK_K == 0


def test_bad_plan_arguments_name_the_argument():
    fp8 = torch.float8_e4m3fn
    w = torch.zeros(64, 256, dtype=fp8)
    s = torch.zeros(2, 8, dtype=torch.uint8)
    cases = [
        (lambda: G.GluonMM(w[0], s), "weight"),
        (lambda: G.GluonMM(torch.zeros(64, 96, dtype=fp8), torch.zeros(2, 3, dtype=torch.uint8)), "weight"),
        (lambda: G.GluonMM(w.to(torch.bfloat16), s), "weight"),
        (lambda: G.GluonMM(w, torch.zeros(2, 7, dtype=torch.uint8)), "w_scale"),
        (lambda: G.GluonMM(w, s.float()), "w_scale"),
        (lambda: G.GluonMM(w, s), "CUDA"),               # the CPU copy: the tier runs on sm_90 only
        (lambda: G.GluonMMConfig(split=0), "split"),
        (lambda: G.GluonMMConfig(stages=2), "stages"),
        (lambda: G.GluonMMConfig(mma="deep"), "mma"),
        (lambda: G.GluonMMConfig(warpgroups=3), "warpgroups"),
        (lambda: G.GluonMMConfig(block_k=64), "block_k"),
        (lambda: G.GluonMMConfig(mma="ahead", block_k=256), "block_k"),
        (lambda: G.GluonMMConfig(maxnreg=100), "maxnreg"),
        (lambda: G.GluonMMConfig(retile=1), "retile"),
        (lambda: G.GluonMMConfig(programs_per_sm=2), "programs_per_sm"),      # without persistent
        (lambda: G.GluonMM(torch.zeros(64, 384, dtype=fp8), torch.zeros(2, 12, dtype=torch.uint8),
                           config=G.GluonMMConfig(block_k=256)), "block_k"),
    ]
    for make, word in cases:
        with pytest.raises((ValueError, TypeError), match=word):
            make()


def _gpu_plans(n, k, seed):
    x_all, _, codes_all, sx_all, weight, w_scale = linear_operands(_gen(seed), 64, n, k)
    plan = G.GluonMM(weight, w_scale)
    # The Triton tier with the same K split bounds (its FP8 loop): the same reduction order.
    cfg = LowLatencyConfig(block_n=64, block_k=plan.config.block_k, split=plan.split, num_warps=4, num_stages=3,
                           dequant=False)
    triton_plan = LowLatencyMM(weight, w_scale, config={b: cfg for b in (16, 32, 64)})
    assert triton_plan.reduction_order(1) == plan.reduction_order()
    return codes_all, sx_all, weight, w_scale, plan, triton_plan


@pytest.mark.gpu
@pytest.mark.parametrize("name,n,k", REAL_SHAPES, ids=[s[0] for s in REAL_SHAPES])
def test_real_shapes_on_gpu(name, n, k):
    codes_all, sx_all, weight, w_scale, plan, triton_plan = _gpu_plans(n, k, n + k)
    ref_all = mxfp8_mm(codes_all, sx_all, weight, w_scale)   # row by row: any row count's rows
    for m in range(1, 65):
        codes, x_scale, ref = codes_all[:m], sx_all[:m], ref_all[:m]
        y = plan(codes, x_scale, _poisoned(m, n))
        assert not torch.isnan(y).any(), f"{name} M={m}: unwritten output elements"
        assert rel_rms(y, ref) < 1e-3, (name, m)
        assert row_ulp_distance(y, ref) <= 2, (name, m, row_ulp_distance(y, ref))   # module doc
        again = plan(codes, x_scale, _poisoned(m, n))       # replays the split-K counters
        assert bits_differ(again, y) == 0, f"{name} M={m}: not bitwise run to run"
        tri = triton_plan(codes, x_scale, _poisoned(m, n))
        assert bits_differ(y, tri) == 0, f"{name} M={m}: {bits_differ(y, tri)} outputs differ from low_latency_mm"
        # Batch invariance: a row's bits do not depend on the rows beside it.
        assert bits_differ(y, plan(codes_all, sx_all)[:m]) == 0, f"{name} M={m}: depends on the row count"
    assert int(plan._counters.abs().sum()) == 0


@pytest.mark.gpu
def test_fp32_out_is_the_unrounded_partial_on_gpu():
    n, k = 5120, 8192     # wo_b: split-K
    codes_all, sx_all, weight, w_scale, plan, triton_plan = _gpu_plans(n, k, 7)
    for m in (1, 17, 64):
        y = plan(codes_all[:m], sx_all[:m], torch.full((m, n), float("nan"), device="cuda"))
        tri = triton_plan(codes_all[:m], sx_all[:m], torch.full((m, n), float("nan"), device="cuda"))
        assert bits_differ(y, tri) == 0, m
        assert bits_differ(y.to(torch.bfloat16), plan(codes_all[:m], sx_all[:m])) == 0, m


@pytest.mark.gpu
def test_bad_call_arguments_name_the_argument_on_gpu():
    n, k = 128, 256
    _, _, codes, sx, weight, w_scale = linear_operands(_gen(3), 8, n, k)
    plan = G.GluonMM(weight, w_scale, max_rows=8)
    raw = torch.zeros(8 * k + 16, dtype=torch.uint8, device="cuda")
    misaligned = raw[1:1 + 8 * k].view(torch.float8_e4m3fn).view(8, k)
    sraw = torch.zeros(8 * (k // 32) + 4, dtype=torch.uint8, device="cuda")
    sx_misaligned = sraw[1:1 + 8 * (k // 32)].view(8, k // 32)
    cases = [
        (lambda: plan(codes[0], sx), "codes"),
        (lambda: plan(torch.cat([codes, codes]), torch.cat([sx, sx])), "codes"),      # 16 > max_rows
        (lambda: plan(codes.view(torch.uint8), sx), "codes"),
        (lambda: plan(misaligned, sx), "codes"),
        (lambda: plan(codes, sx[:, :-1]), "x_scale"),
        (lambda: plan(codes, sx_misaligned), "x_scale"),
        (lambda: plan(codes, sx, torch.empty(8, n, dtype=torch.float16, device="cuda")), "out"),
        (lambda: plan(codes, sx, torch.empty(8, n + 1, dtype=torch.bfloat16, device="cuda")), "out"),
        (lambda: plan(codes.cpu(), sx), "codes"),
    ]
    for make, word in cases:
        with pytest.raises((ValueError, TypeError), match=word):
            make()
    assert torch.isfinite(plan(codes, sx)).all()


@pytest.fixture(scope="module")
def real_operands():
    """name -> (codes, x_scale, weight, w_scale) of each real shape at 64 rows, built on first use
    and shared by the variants' GPU tests (the CPU-side generation of wq_b's takes ~0.5 s)."""
    made = {}

    def get(name, n, k):
        if name not in made:
            made[name] = linear_operands(_gen(n + k + 1), 64, n, k)[2:]
        return made[name]
    return get


@pytest.mark.gpu
@pytest.mark.parametrize("config", VARIANTS, ids=[_variant_id(c) for c in VARIANTS])
def test_variants_match_the_triton_tier_on_gpu(config, real_operands):
    # Same split bounds, same bits: the MMA mode, the warpgroups, the slot depth, the ring and the
    # register cap change when a block partial is computed and promoted, not its value or the order
    # of the adds (module doc), so each variant gives low_latency_mm's FP8 loop's bits at the same
    # bounds (block_k = the slot depth), as the default config does (test_real_shapes_on_gpu). Each
    # variant at its default split and at one split, every real shape, rows across every bucket and
    # its edges.
    rows = (1, 5, 8, 9, 16, 17, 32, 33, 64)
    for name, n, k in REAL_SHAPES:
        codes_all, sx_all, weight, w_scale = real_operands(name, n, k)
        splits = []
        for split in (None, 1):
            plan = G.GluonMM(weight, w_scale, config=dataclasses.replace(config, split=split))
            if plan.split in splits:        # the default split is already one: the same plan again
                continue
            splits.append(plan.split)
            cfg = LowLatencyConfig(block_n=64, block_k=config.block_k, split=plan.split, num_warps=4, num_stages=3,
                                   dequant=False)
            triton_plan = LowLatencyMM(weight, w_scale, config={b: cfg for b in (16, 32, 64)})
            assert triton_plan.reduction_order(1) == plan.reduction_order(), (name, split)
            for m in rows:
                y = plan(codes_all[:m], sx_all[:m], _poisoned(m, n))
                assert not torch.isnan(y).any(), f"{name} split {plan.split} M={m}: unwritten outputs"
                tri = triton_plan(codes_all[:m], sx_all[:m], _poisoned(m, n))
                assert bits_differ(y, tri) == 0, f"{name} split {plan.split} M={m}: {bits_differ(y, tri)} differ"
                again = plan(codes_all[:m], sx_all[:m], _poisoned(m, n))
                assert bits_differ(again, y) == 0, f"{name} split {plan.split} M={m}: not bitwise run to run"
            assert int(plan._counters.abs().sum()) == 0


def _gemm_then_rope(plan: G.GluonMM, codes, sx, cos, sin) -> torch.Tensor:
    """The unfused path: the plain GEMM, then `qkv_rope_insert_`'s query RoPE (no window record)."""
    m = codes.shape[0]
    y = plan(codes, sx, _poisoned(m, plan.n))
    pool = torch.zeros(1, 528, dtype=torch.uint8, device=DEVICE)
    qkv_rope_insert_(y.view(m, -1, 512), torch.zeros(m, 512, dtype=torch.bfloat16, device=DEVICE), cos, sin,
                     torch.full((m,), -1, dtype=torch.int64, device=DEVICE), pool)
    return y


@pytest.mark.gpu
@pytest.mark.parametrize("name,n,k", WQ_B_SHAPES, ids=[s[0] for s in WQ_B_SHAPES])
def test_rope_epilogue_matches_gemm_then_rope_on_gpu(name, n, k, real_operands):
    # The epilogue's query RoPE gives the bits of the GEMM followed by qkv_rope_insert_'s query
    # RoPE, at every row count, with each shape's plan (wq_b: persistent, one split; the shards:
    # one or two splits, the last arriver rotating); the plain call's bits do not change.
    codes_all, sx_all, weight, w_scale = real_operands(name, n, k)
    cos_all, sin_all = rope_operands(_gen(n), 64)
    plan = G.GluonMM(weight, w_scale)
    tail = (torch.arange(n, device=DEVICE) % 512) >= 448
    for m in range(1, 65):
        codes, sx, cos, sin = codes_all[:m], sx_all[:m], cos_all[:m], sin_all[:m]
        plain = plan(codes, sx, _poisoned(m, n))
        want = _gemm_then_rope(plan, codes, sx, cos, sin)
        got = plan(codes, sx, _poisoned(m, n), rope=(cos, sin))
        assert not torch.isnan(got).any(), f"{name} M={m}: unwritten outputs"
        assert bits_differ(got, want) == 0, f"{name} M={m}: {bits_differ(got, want)} outputs differ from GEMM + RoPE"
        assert bits_differ(got[:, ~tail], plain[:, ~tail]) == 0, f"{name} M={m}: non-rotary columns changed"
        assert bits_differ(got[:, tail], plain[:, tail]) > 0, f"{name} M={m}: nothing rotated"
        assert bits_differ(plan(codes, sx, _poisoned(m, n)), plain) == 0, f"{name} M={m}: plain bits moved"
    assert int(plan._counters.abs().sum()) == 0


@pytest.mark.gpu
@pytest.mark.parametrize("config", [C(split=3), C(warpgroups=2, persistent=True, split=2), C(mma="slot", split=4),
                                    C(block_k=256, split=2, mma="slot", stages=3)],
                         ids=["split3", "persistent-wg2-split2", "slot-split4", "k256-split2"])
def test_rope_epilogue_in_split_k_variants_on_gpu(config, real_operands):
    # The split-K reduction's last arriver rotates, persistent or not, at wq_b's TP1 shape.
    name, n, k = WQ_B_SHAPES[0]
    codes_all, sx_all, weight, w_scale = real_operands(name, n, k)
    cos_all, sin_all = rope_operands(_gen(3), 64)
    plan = G.GluonMM(weight, w_scale, config=config)
    assert plan.split > 1
    for m in (1, 5, 8, 9, 16, 33, 64):
        codes, sx, cos, sin = codes_all[:m], sx_all[:m], cos_all[:m], sin_all[:m]
        want = _gemm_then_rope(plan, codes, sx, cos, sin)
        got = plan(codes, sx, _poisoned(m, n), rope=(cos, sin))
        assert bits_differ(got, want) == 0, f"split {plan.split} M={m}: {bits_differ(got, want)} outputs differ"
    assert int(plan._counters.abs().sum()) == 0


@pytest.mark.gpu
@pytest.mark.parametrize("epilogue", ["rope", "index_query"])
def test_epilogue_bad_arguments_on_gpu(epilogue):
    # per epilogue: N, an N it refuses (not whole heads) and its error, the operands' seeds
    n, odd_n, odd_word, seeds = {"rope": (512, 384, "512", (4, 5)),
                                 "index_query": (256, 192, "index_query.*128", (6, 7))}[epilogue]
    _, _, codes, sx, weight, w_scale = linear_operands(_gen(seeds[0]), 8, n, 256)
    plan = G.GluonMM(weight, w_scale, max_rows=8)
    cos, sin = rope_operands(_gen(1), 8)
    odd = G.GluonMM(*linear_operands(_gen(seeds[1]), 8, odd_n, 256)[4:], max_rows=8)
    cases = [
        (lambda: plan(codes, sx, **{epilogue: cos}), epilogue),
        (lambda: plan(codes, sx, **{epilogue: (cos[:4], sin)}), "cos"),
        (lambda: plan(codes, sx, **{epilogue: (cos, sin.double())}), "sin"),
        (lambda: plan(codes, sx, torch.empty(8, n, device=DEVICE), **{epilogue: (cos, sin)}), "bfloat16"),
        (lambda: odd(codes, sx, **{epilogue: (cos, sin)}), odd_word),
    ]
    if epilogue == "index_query":
        cases.append((lambda: plan(codes, sx, index_query=(cos, sin), rope=(cos, sin)), "index_query and rope"))
    for make, word in cases:
        with pytest.raises((ValueError, TypeError), match=word):
            make()


def _gemm_then_index_query(plan: G.GluonMM, codes, sx, cos, sin) -> torch.Tensor:
    """The unfused path: the plain GEMM, then `index_query_`'s iq (its head weights discarded), [M, N]."""
    m, n = codes.shape[0], plan.n
    y = plan(codes, sx, _poisoned(m, n))
    iq = torch.empty(m, n // 128, 128, dtype=torch.bfloat16, device=DEVICE)
    index_query_(y, torch.zeros(m, n // 128, device=DEVICE), cos, sin, 1.0, iq,
                 torch.empty(m, n // 128, dtype=torch.bfloat16, device=DEVICE))
    return iq.view(m, n)


def _check_index_query_rows(plan: G.GluonMM, codes_all, sx_all, cos_all, sin_all, rows, what) -> None:
    n = plan.n
    tail = (torch.arange(n, device=DEVICE) % 128) >= 64
    for m in rows:
        codes, sx, cos, sin = codes_all[:m], sx_all[:m], cos_all[:m], sin_all[:m]
        plain = plan(codes, sx, _poisoned(m, n))
        want = _gemm_then_index_query(plan, codes, sx, cos, sin)
        got = plan(codes, sx, _poisoned(m, n), index_query=(cos, sin))
        assert not torch.isnan(got).any(), f"{what} M={m}: unwritten outputs"
        assert bits_differ(got, want) == 0, f"{what} M={m}: {bits_differ(got, want)} differ from GEMM + index_query_"
        assert bits_differ(got[:, tail], plain[:, tail]) > 0 and bits_differ(got[:, ~tail], plain[:, ~tail]) > 0, \
            f"{what} M={m}: a half of the heads unchanged"
        assert bits_differ(plan(codes, sx, _poisoned(m, n)), plain) == 0, f"{what} M={m}: plain bits moved"
    assert int(plan._counters.abs().sum()) == 0, what


@pytest.mark.gpu
@pytest.mark.parametrize("name,n,k", INDEXER_WQ_B_SHAPES, ids=[s[0] for s in INDEXER_WQ_B_SHAPES])
def test_index_query_epilogue_matches_gemm_then_index_query_on_gpu(name, n, k):
    # The step's plan for the indexer's wq_b (default_config: 2 splits at both head counts, the last
    # arriver applying the epilogue), every row count 1..64: the bits of the GEMM followed by
    # index_query_'s iq.
    codes_all, sx_all, weight, w_scale = linear_operands(_gen(n + k + 3), 64, n, k)[2:]
    cos_all, sin_all = rope_operands(_gen(n + 1), 64)
    plan = G.GluonMM(weight, w_scale)
    assert plan.config == G.default_config(n, k) and plan.split == 2, (plan.config, plan.split)
    _check_index_query_rows(plan, codes_all, sx_all, cos_all, sin_all, range(1, 65), name)


@pytest.mark.gpu
@pytest.mark.parametrize("config", [C(split=1), C(mma="slot", split=4), C(warpgroups=2, persistent=True, split=2),
                                    C(block_k=256, split=2, mma="slot", stages=3)],
                         ids=["one-split", "slot-split4", "persistent-wg2-split2", "k256-split2"])
def test_index_query_epilogue_in_variants_on_gpu(config):
    # One split (the epilogue without the reduction), more splits, one head per tile in the
    # persistent consumer, 256-deep slots: the same bits as GEMM + index_query_ at 32 heads, in the
    # smallest and the largest row bucket (their edges; two compiles a bucket).
    name, n, k = INDEXER_WQ_B_SHAPES[0]
    codes_all, sx_all, weight, w_scale = linear_operands(_gen(n + k + 3), 64, n, k)[2:]
    cos_all, sin_all = rope_operands(_gen(5), 64)
    plan = G.GluonMM(weight, w_scale, config=config)
    _check_index_query_rows(plan, codes_all, sx_all, cos_all, sin_all, (1, 5, 8, 33, 64), str(config))
