"""ops/compressor_tail.py against the three launches it fuses (rms_norm_, ll_bf16_ with the wk plan,
compressed_entry_store_), bit for bit: lat, wk_out and both pools (interpreter on the CPU; GPU at
the step's shapes and plans). Tolerance: none - the op's contract is the three launches' bits."""

from pathlib import Path

import pytest
import torch

from dsv41_decode.ops.compressor_tail import CompressorTailPlan, compressor_tail_
from dsv41_decode.ops.kv_write import compressed_entry_store_
from dsv41_decode.ops.ll_bf16 import LlBf16Plan, ll_bf16_
from dsv41_decode.ops.rms_norm import rms_norm_
from dsv41_decode.records import COMPRESSED_KV_BYTES, INDEX_KEY_BYTES
from helpers import compile_script

_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
_EPS = 1e-6


def _freqs() -> torch.Tensor:
    return 1.0 / (160000 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64))


def _operands(g: int, ratio: int, seed: int, device=_DEVICE, pool: int = 80) -> dict:
    """The step's operands of G groups: c as the ratio gives it (ratio 2: compress_ratio2_'s [G, 512]
    FP32 rows; ratio 1: the compressor projection's first 512 of 1024 FP32 columns, a strided view),
    the compressor norm and k_norm weights, wk, the group's RoPE, distinct slots with one skipped."""
    gen = torch.Generator().manual_seed(seed)
    if ratio == 2:
        c = torch.randn(g, 512, generator=gen) * 3
    else:
        c = (torch.randn(g, 1024, generator=gen) * 0.5)[:, :512]
    pos = torch.randint(0, 100000, (g,), generator=gen).float()
    ang = pos[:, None] * _freqs()[None, :]
    slots = torch.randperm(pool, generator=gen)[:g].to(torch.int64)
    if g > 2:
        slots[1] = -1                      # skipped by both pools
    return dict(
        c=c.to(device), norm_w=(1 + 0.2 * torch.randn(512, generator=gen)).to(torch.bfloat16).to(device),
        w_wk=(torch.randn(128, 512, generator=gen) / 22).to(torch.bfloat16).to(device),
        k_norm=(1 + 0.2 * torch.randn(128, generator=gen)).to(torch.bfloat16).to(device),
        cos=ang.cos().to(device), sin=ang.sin().to(device), slots=slots.to(device), pool=pool)


def _apart(o: dict, plan: LlBf16Plan):
    """The three launches: (lat, wk_out, compressed pool, index-key pool)."""
    g, dev = o["c"].shape[0], o["c"].device
    lat = torch.empty(g, 512, dtype=torch.bfloat16, device=dev)
    wk = torch.empty(g, 128, dtype=torch.float32, device=dev)
    ckv = torch.full((o["pool"], COMPRESSED_KV_BYTES), 7, dtype=torch.uint8, device=dev)
    ik = torch.full((o["pool"], INDEX_KEY_BYTES), 7, dtype=torch.uint8, device=dev)
    rms_norm_(o["c"], o["norm_w"], _EPS, lat)
    ll_bf16_(plan, lat, o["w_wk"], wk)
    compressed_entry_store_(lat, wk, o["k_norm"], o["cos"], o["sin"], o["slots"], ckv, ik, _EPS)
    return lat, wk, ckv, ik


def _fused(o: dict, plan: CompressorTailPlan):
    g, dev = o["c"].shape[0], o["c"].device
    lat = torch.full((g, 512), 5.0, dtype=torch.bfloat16, device=dev)
    wk = torch.full((g, 128), 5.0, dtype=torch.float32, device=dev)
    ckv = torch.full((o["pool"], COMPRESSED_KV_BYTES), 7, dtype=torch.uint8, device=dev)
    ik = torch.full((o["pool"], INDEX_KEY_BYTES), 7, dtype=torch.uint8, device=dev)
    compressor_tail_(o["c"], o["norm_w"], _EPS, lat, plan, o["w_wk"], wk, o["k_norm"], o["cos"], o["sin"],
                     o["slots"], ckv, ik)
    return lat, wk, ckv, ik


def _assert_same_bits(a, b) -> None:
    for name, x, y in zip(("lat", "wk_out", "compressed", "index_keys"), a, b):
        xb = x.view(torch.int16) if x.dtype == torch.bfloat16 else x.view(torch.int32) if x.dtype == torch.float32 else x
        yb = y.view(xb.dtype)
        bad = (xb != yb).nonzero()
        assert bad.numel() == 0, f"{name}: {bad.shape[0]} elements differ, first at {bad[0].tolist()}"


def _step_plan(max_rows: int, device=_DEVICE) -> LlBf16Plan:
    """The wk plan the step builds (decode.attention: one split, wide tiles in the interpreter)."""
    wide = {"split": 1, "block_n": 256} if torch.device(device).type != "cuda" else {}
    return LlBf16Plan.build(128, 512, max_rows, torch.bfloat16, device, **wide)


def _gpu_tiles_plan(max_rows: int, device=_DEVICE) -> LlBf16Plan:
    """ll_bf16's default tiles with one split (the step's wk plan on the H200): four N tiles of 32
    outputs, so four tile programs per row and the index key by the row's last arriver."""
    return LlBf16Plan.build(128, 512, max_rows, torch.bfloat16, device, split=1)


_PLANS = {"step": _step_plan, "gpu_tiles": _gpu_tiles_plan}


@pytest.mark.parametrize("plan_kind", sorted(_PLANS))
@pytest.mark.parametrize("ratio", [1, 2])
@pytest.mark.parametrize("g", [1, 2, 5, 16, 20])
def test_same_bits_as_the_three_launches(g, ratio, plan_kind):
    """Each plan against its own three launches (in the interpreter the dot is a numpy matmul,
    whose sums differ between N = 32 and N >= 128 tiles); 20 groups take the plan's BLOCK_M 32
    tile (the fused dot keeps row 0 of it). The counters are 0 again after each call."""
    o = _operands(g, ratio, seed=10 * g + ratio)
    assert o["c"].stride(0) == (1024 if ratio == 1 else 512)
    wk_plan = _PLANS[plan_kind](32)
    plan = CompressorTailPlan.build(wk_plan)
    assert plan.counters.shape == (32,) and plan.wk_plan is wk_plan
    fused, apart = _fused(o, plan), _apart(o, wk_plan)
    _assert_same_bits(fused, apart)
    assert not plan.counters.any()
    # something was written: the records of the stored slots, not of the skipped one
    ok = o["slots"] >= 0
    assert (fused[2][o["slots"][ok]] != 7).any() and (fused[3][o["slots"][ok]] != 7).any()


@pytest.mark.parametrize("plan_kind", sorted(_PLANS))
def test_two_calls_leave_the_counters_at_zero(plan_kind):
    """Two calls on one plan (5 groups, then 3 others): each gives the three launches' bits and
    leaves every counter 0, so the second call (a graph replay) finds them clean."""
    wk_plan = _PLANS[plan_kind](8)
    plan = CompressorTailPlan.build(wk_plan)
    for g, seed in ((5, 21), (3, 22)):
        o = _operands(g, 1, seed=seed)
        _assert_same_bits(_fused(o, plan), _apart(o, wk_plan))
        assert not plan.counters.any()


def test_bf16_input_and_zero_groups():
    o = _operands(3, 2, seed=4)
    o["c"] = o["c"].to(torch.bfloat16)
    wk_plan = _gpu_tiles_plan(4)
    plan = CompressorTailPlan.build(wk_plan)
    _assert_same_bits(_fused(o, plan), _apart(o, wk_plan))
    z = _operands(0, 2, seed=5)
    lat, wk, ckv, ik = _fused(z, plan)              # nothing to do, nothing written
    assert (ckv == 7).all() and (ik == 7).all() and not plan.counters.any()


@pytest.mark.parametrize("field, bad, exc, match", [
    ("c", lambda o: o["c"].double(), TypeError, "c must"),
    ("c", lambda o: o["c"][:, :256], ValueError, "c must"),
    ("norm_w", lambda o: o["norm_w"][:128], ValueError, "norm_w must"),
    ("lat", lambda o: torch.empty(3, 512), TypeError, "lat must"),
    ("w_wk", lambda o: o["w_wk"].float(), TypeError, "w_wk must"),
    ("wk_out", lambda o: torch.empty(3, 64), ValueError, "wk_out must"),
    ("k_norm", lambda o: o["k_norm"][:64], ValueError, "k_norm must"),
    ("cos", lambda o: o["cos"][:2], ValueError, "cos must"),
    ("sin", lambda o: o["sin"].double(), TypeError, "sin must"),
    ("slots", lambda o: o["slots"].int(), TypeError, "slots must"),
    ("compressed", lambda o: torch.empty(8, 68, dtype=torch.uint8), ValueError, "compressed must"),
    ("index_keys", lambda o: torch.empty(8, 288, dtype=torch.uint8), ValueError, "index_keys must"),
    ("eps", lambda o: -1.0, ValueError, "eps must"),
])
def test_bad_arguments_name_the_argument(field, bad, exc, match):
    o = _operands(3, 2, seed=6, device="cpu")
    args = dict(c=o["c"], norm_w=o["norm_w"], eps=_EPS, lat=torch.empty(3, 512, dtype=torch.bfloat16),
                plan=CompressorTailPlan.build(_step_plan(4, "cpu")), w_wk=o["w_wk"], wk_out=torch.empty(3, 128), k_norm=o["k_norm"],
                cos=o["cos"], sin=o["sin"], slots=o["slots"],
                compressed=torch.empty(8, 288, dtype=torch.uint8), index_keys=torch.empty(8, 68, dtype=torch.uint8))
    args[field] = bad(o)
    with pytest.raises(exc, match=match):
        compressor_tail_(**args)


@pytest.mark.parametrize("wk_plan, exc, match", [
    (lambda: "plan", TypeError, "wk_plan must be an LlBf16Plan"),
    (lambda: LlBf16Plan.build(64, 512, 4, torch.bfloat16, "cpu"), ValueError, "wk_plan must be a plan"),
    (lambda: LlBf16Plan.build(128, 512, 4, torch.float32, "cpu"), ValueError, "wk_plan must be a plan"),
    (lambda: LlBf16Plan.build(128, 512, 4, torch.bfloat16, "cpu", split=2), ValueError, "wk_plan splits K"),
])
def test_bad_wk_plans_name_the_wk_plan(wk_plan, exc, match):
    with pytest.raises(exc, match=match):
        CompressorTailPlan.build(wk_plan())


@pytest.mark.parametrize("plan, exc, match", [
    (lambda: _step_plan(4, "cpu"), TypeError, "plan must be a CompressorTailPlan"),
    (lambda: CompressorTailPlan.build(_step_plan(2, "cpu")), ValueError, "exceed plan.max_rows"),
])
def test_bad_plans_name_the_plan(plan, exc, match):
    o = _operands(3, 2, seed=7, device="cpu")
    with pytest.raises(exc, match=match):
        compressor_tail_(o["c"], o["norm_w"], _EPS, torch.empty(3, 512, dtype=torch.bfloat16), plan(), o["w_wk"],
                         torch.empty(3, 128), o["k_norm"], o["cos"], o["sin"], o["slots"],
                         torch.empty(8, 288, dtype=torch.uint8), torch.empty(8, 68, dtype=torch.uint8))


def test_compiles_for_sm90_without_spills_with_the_three_kernels_sums():
    """sm_90 compile on the CPU (tests/ops/_compressor_tail_sm90.py, ~15 s): no local memory, stack
    or spills; the last arriver's acq_rel counter and `.cg` reloads of wk_out; the GPU's bits rest on the same instructions in the same layouts as the three
    kernels: the dot's MMA (mma.sync m16n8k8 TF32, HMMA.1688.F32.TF32, in the same MMA layout) and
    every FP32 sum (the two 512-wide norms' and k_norm's, whose order a reduction's layout fixes)
    in a layout that the three kernels reduce the same shape in."""
    _, rows = compile_script(Path(__file__).with_name("_compressor_tail_sm90.py"))
    assert [r["name"] for r in rows] == [f"{k} c {c} BLOCK_M {m}" for c, m in
                                         (("*fp32", 16), ("*fp32", 32), ("*bf16", 16)) for k in ("fused", "apart")]
    for fused, apart in zip(rows[0::2], rows[1::2]):
        assert fused["LOCAL"] == 0 and fused["STACK"] == 0 and fused["spills"] == 0, fused
        # the row's counter: one acq_rel atomic, then the index key's wk loads from L2 (.cg)
        assert fused["atomics"] == ["atom.global.gpu.acq_rel.add.u32"] and fused["cg_loads"] >= 2, fused
        assert fused["mma"] == apart["mma"] == ["HMMA.1688.F32.TF32"], (fused, apart)
        assert fused["mma_layouts"] == apart["mma_layouts"] and len(fused["mma_layouts"]) == 1
        # the fused kernel's two programs each sum the 512-wide row (rms_norm_'s one), then k_norm's
        assert len(fused["adds"]) == 2 + 4 and sorted(map(tuple, fused["adds"][:1] + fused["adds"][2:])) \
            == sorted(map(tuple, apart["adds"])), (fused["adds"], apart["adds"])
        assert fused["adds"][0] == fused["adds"][1] and fused["adds"][0][0] == "512xf32"


@pytest.mark.gpu
@pytest.mark.parametrize("ratio", [1, 2])
@pytest.mark.parametrize("g", [1, 2, 8, 64])
def test_gpu_same_bits_as_the_three_launches(g, ratio):
    """The step's plan on the GPU (ll_bf16's default split and tiles: 32 outputs per program, four
    tile programs per row and the index key by the row's last arriver), called twice."""
    o = _operands(g, ratio, seed=100 + g + ratio, device="cuda", pool=200)
    wk_plan = _step_plan(64, "cuda")
    assert wk_plan.split == 1 and wk_plan.n_tiles == 4
    plan = CompressorTailPlan.build(wk_plan)
    for _ in range(2):                  # the second call finds the counters the first left at 0
        _assert_same_bits(_fused(o, plan), _apart(o, wk_plan))
        assert not plan.counters.any()
