"""ops.gluon_wo_a, the Gluon grouped `wo_a` for BF16 and FP8 weights (sm_90 only).

On the CPU: the kernel compiles for sm_90 (Triton's own ptxas) at the real shapes' splits (TP1, 2,
4, 8: 2, 4, 8, 16) and every row bucket, with the fused MXFP8 of z and the window copy, without
spills, and its SASS holds the BF16 wgmma, the two TMA loads, a wait that leaves one wgmma group in
flight and no fused multiply-add (the rotation's products and sums round separately, as torch's);
bad arguments raise errors that name them. On the GPU (`-m gpu`): the real shapes at 1, 2, 4, 16, 33
and 64 rows against the reference, bitwise run to run, a row alone equal to the same row among
others, the window copy and the MXFP8 of z equal to `ops.wo_a`'s, the rotation bit-exact through
an identity weight, and the z of the Triton kernel within the same tolerance.

Tolerance against `reference.attention.grouped_wo_a`: the Triton kernel's (tests/ops/test_wo_a.py,
`_check`): rel RMS < 1e-3 and at most 1 BF16 ulp of the row's largest |z|. Derivation: the rotated
input is the reference's bit for bit (the same FP32 operations without contraction, the same
rounding to BF16) and every product of two BF16 values is exact, so z differs from the reference
only through the summation of the (H/G)*512 products in FP32: the wgmma's adds (which truncate, as
the Triton kernel's tensor-core dots do) and split-K's regrouping, a few FP32 ulps of the terms'
magnitude (~1e-7 relative); that can tip the BF16 rounding of an output by one ulp of its value, at
most one ulp of the row's largest |z|, and rarely (a one-ulp flip needs the dot within ~1e-7
relative of a BF16 rounding midpoint), hence the rel RMS bound (1e-3 allows up to 1.6 % of the
elements one ulp off). An FP8 weight is held to the same against the reference fed its
dequantized weight (`ops.wo_a`'s FP8 test): each 32-deep block's partial is the BF16 wgmma's sum
of exact products (E4M3 codes are exact in BF16), scaled exactly by its power-of-two block scale,
then added in K order: the same FP32 summation argument. The folded FP8 consumer
(`GluonWoAConfig(fold_scales=True)`) is held to the same bound, and more: its weight in BF16 is
the dequantized weight bit for bit (e4m3 x 2^(b - 127) is exact in BF16 for scale bytes in
`FOLD_SCALE_BYTES`, the module doc's "Numerics"), and it runs the BF16 weight's k16 wgmma sequence
in the same K order at the same split, so its z equals the BF16-weight Gluon plan's z on the
dequantized weight bitwise (asserted on the GPU: a difference means an inexact conversion or a
register-A wgmma that sums otherwise than the shared-memory one); so with its bit conversion
(`fold_bits`), whose PTX the CPU test interprets on every E4M3 code and scale byte.
"""

import re
from pathlib import Path

import numpy as np
import pytest
import torch

from dsv41_decode.ops import gluon_wo_a as W
from dsv41_decode.formats import fp8_block_dequantize
from dsv41_decode.ops.wo_a import WoAPlan, quantize_wo_a, wo_a_
from dsv41_decode.reference.attention import grouped_wo_a
from _gluon_wo_a_sm90 import CASES
from test_wo_a import _check, _inputs
from helpers import compile_script, run_b32_ptx

RANK = 1024        # o_lora_rank of V4.1; 8 heads per group: group width 4096
REAL_HEADS = (64, 32, 16, 8)   # this rank's heads under TP1, 2, 4, 8 (heads // 8 groups)


@pytest.fixture(scope="module")
def sm90_builds() -> dict:
    """tests/ops/_gluon_wo_a_sm90.py's compiles of its CASES, by case tuple, run in a
    subprocess without the interpreter (the kernel calls a Triton JIT function, which the interpreter
    replaces): ~1 s a compile."""
    _, rows = compile_script(Path(__file__).with_name("_gluon_wo_a_sm90.py"))
    return {tuple(r["case"]): r for r in rows}


def _case_id(case) -> str:
    heads, bt, wg, split, fp8, *pdl = case
    pdl, release, prefill, gate = (list(pdl) + [0, 0, 0, 0])[:4]
    return (f"{('bf16', 'fp8', 'fp8fold', 'fp8foldbits', 'fp8foldbits-ring')[fp8]}-h{heads}-bt{bt}-wg{wg}"
            + (f"-split{split}" if split else "") + ("-pdl" if pdl else "") + ("-release" if release else "")
            + (f"-prefill{prefill}" if prefill else "") + ("-gate" if gate else ""))


@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_compiles_for_sm90_without_spills(sm90_builds, case):
    """Each TP shard's split (TP1..8: 2..16, twice that with two warpgroups), each row bucket, one
    launch without split-K and both FP8 consumers (the folded one at every bucket, with both of its
    conversions, and in the step's ring of 8 slots), with the fused
    MXFP8 of z and the window copy: no local memory or spills within the register cap
    (`register_cap`), the BF16 wgmma, the TMA loads, two slots in flight, no FMA; the folded
    consumer's wgmmas take the weight from registers, and nothing writes those registers while a
    wgmma that reads them is in flight."""
    r = sm90_builds[case]
    assert r["n_tiles"] * r["split"] == (256 if case[3] == 0 else r["n_tiles"]), r
    assert r["LOCAL"] == 0 and r["STACK"] == 0 and r["REG"] <= r["maxnreg"], r
    ops = r["ops"]
    assert ops.get("STL", 0) == 0 and ops.get("LDL", 0) == 0, ops
    # One 64-deep slot: four BF16 wgmmas m64 n{bt} k16, FP32 accumulation (each warpgroup runs the
    # same code on its 64 rows; ptxas may copy the slot's issue into both arms of the rotation's branch);
    # with an FP8 weight two 32-deep block partials, each started from zero (RZ).
    gmma, bt = r["gmma"], r["bt"]
    assert gmma and len(gmma) % 4 == 0 and all(t.startswith(f"HGMMA.64x{bt}x16.F32.BF16") for t in gmma), gmma
    if case[4] == 1:
        assert sum(", RZ" in t for t in gmma) == len(gmma) // 2, gmma
    # the folded consumer: register A operands (`HGMMA ... Rd, Ra, gdesc`), every wgmma accumulating
    # (one chain, no partial from zero), two slots an iteration (8 wgmmas, 4 more for an odd tail)
    folded = case[4] >= 2
    assert all(re.search(r"\.BF16 R\d+, R\d+, gdesc", t) for t in gmma) == folded, gmma
    if folded:
        assert not any(", RZ" in t for t in gmma) and len(gmma) >= 8, gmma
    # fold_bits: the conversion by BF16 multiplies (HMUL2), no F16 -> FP32 conversion (HADD2.F32)
    assert (ops.get("HMUL2", 0) > 0) == (case[4] >= 3) and (ops.get("HADD2", 0) > 0) == (case[4] == 2), ops
    assert r["a_hazards"] == [], r["a_hazards"]
    # the producer's weight and o tiles (its loop unrolled where the program's K range is short); by
    # PDL first the weight tiles of the ring's first slots and nothing else global (the whole program,
    # before the producer forks; `GluonWoAConfig.prefill` of them where set), then griddepcontrol.wait
    # (SASS ACQBULK; the producer warp waits again), their o tiles, the ring's loop. With the gate
    # (`gluon_wo_a_(gate=)`): the prefill's slots, then the gate's polls of its word (volatile loads,
    # the only global access), the rest of the ring's slots, the wait; the producer then requests
    # every slot's o tile.
    pre = min(r["prefill"] or r["stages"], r["steps"])
    if r["gate"]:
        slots = min(r["stages"], r["steps"])
        assert r["before_gate"] == pre < slots, r
        assert r["pdl_prologue"] == [slots, ["ld.volatile.global.b32"] * 2], r["pdl_prologue"]
        assert ops.get("UTMALDG", 0) in (2 * slots + 2, 2 * r["steps"]) and ops.get("ACQBULK", 0) == 2, ops
        assert ops.get("NANOSLEEP", 0) == 1, ops
    elif len(case) > 5:
        assert r["pdl_prologue"] == [pre, []], r["pdl_prologue"]
        assert ops.get("UTMALDG", 0) in (2 * pre + 2, 2 * r["steps"]) and ops.get("ACQBULK", 0) == 2, ops
    else:
        assert r["pdl_prologue"] is None and ops.get("ACQBULK", 0) == 0, r["pdl_prologue"]
        assert ops.get("UTMALDG", 0) in (2, 2 * r["steps"]), ops
    assert ops.get("SYNCS", 0) > 0, ops           # the mbarrier ring
    # More than one slot in flight: a wait that leaves the newest slot's wgmma group(s) outstanding
    # (one group a slot; the folded consumer's slot is two groups, one per 32-deep K block),
    # besides the drain.
    keep = 2 if folded else 1
    assert {f"WARPGROUP.DEPBAR.LE gsb0, 0x{keep}", "WARPGROUP.DEPBAR.LE gsb0, 0x0"} <= set(r["waits"]), r["waits"]
    assert ops.get("USETMAXREG", 0) > 0, ops      # the producer warp gives its registers away
    # The rotation rounds each product and each sum (enable_fp_fusion=False): no FFMA anywhere.
    assert ops.get("FFMA", 0) == 0 and ops.get("FMUL", 0) > 0, ops
    assert r["shared"] <= r["shared_limit"], r
    assert (r["split"] > 1) == (ops.get("ATOMG", 0) > 0), ops   # the last-arriver counter
    # the release of a PDL successor (`release=True`, the step's wo_b_pdl): once, after the main loop
    released = len(case) > 6 and case[6] == 1
    assert r["releases"] == int(released) and r["released_after_loop"] == released, r


def test_plan_split_is_the_triton_plans_and_fits_shared_memory():
    # The default split rule is WoAPlan's for a BF16 weight (about two programs per SM), the same at
    # every row count; the ring at 64 rows fits twice in an SM's shared memory at the default stages.
    for heads in REAL_HEADS:
        plan = W.GluonWoAPlan.build(heads, heads // 8, RANK, 64, torch.bfloat16, "cpu")
        tri = WoAPlan.build(heads, heads // 8, RANK, 64, torch.bfloat16, "cpu")
        assert (plan.split, plan.k_per_split) == (tri.split, tri.k_per_split)
        assert plan.n_tiles * plan.split == 256
        assert 2 * W.shared_bytes(plan.config, 64) <= 228 * 1024
    # the small and tiny presets' shapes (2 heads a group, rank 128 / 64): the same split too
    for heads, groups, rank in ((8, 4, 128), (4, 2, 64)):
        plan = W.GluonWoAPlan.build(heads, groups, rank, 8, torch.bfloat16, "cpu")
        tri = WoAPlan.build(heads, groups, rank, 8, torch.bfloat16, "cpu")
        assert (plan.split, plan.k_per_split) == (tri.split, tri.k_per_split) == (8, 128)
    wide = W.GluonWoAPlan.build(64, 8, RANK, 64, torch.bfloat16, "cpu",
                                config=W.GluonWoAConfig(warpgroups=2, split=4))
    assert (wide.n_tiles, wide.split, wide.k_per_split) == (64, 4, 1024)


def test_bad_plans_name_the_field():
    for kw, match in ((dict(heads=5), "heads=5 must be a multiple of o_groups"), (dict(rank=96), "rank=96"),
                      (dict(rope_dim=32), "rope_dim=32"), (dict(head_dim=96), "head_dim=96"),
                      (dict(max_rows=65), "max_rows must be at most 64"), (dict(max_rows=0), "max_rows must be"),
                      (dict(config=W.GluonWoAConfig(split=3)), "config.split must divide"),
                      (dict(config=W.GluonWoAConfig(stages=12, warpgroups=2)), "shared memory"),
                      (dict(config="fast"), "config must be a GluonWoAConfig"),
                      (dict(weight_dtype=torch.float16), "weight_dtype must be")):
        args = dict(heads=16, o_groups=2, rank=128, max_rows=64, weight_dtype=torch.bfloat16, device="cpu") | kw
        with pytest.raises((TypeError, ValueError), match=match):
            W.GluonWoAPlan.build(**args)
    for kw, match in ((dict(stages=2), "stages"), (dict(warpgroups=3), "warpgroups"),
                      (dict(split=0), "split"), (dict(maxnreg=100), "maxnreg"),
                      (dict(prefill=7), r"prefill .*\[1, stages=6\], got 7"), (dict(prefill=0), "prefill .*got 0"),
                      (dict(stages=3, prefill=4), r"prefill .*\[1, stages=3\], got 4")):
        with pytest.raises(ValueError, match=f"GluonWoAConfig.{match}"):
            W.GluonWoAConfig(**kw)


def test_with_prefill_shares_the_plan_but_its_prefill():
    """`GluonWoAPlan.with_prefill` (the step's gated `wo_a` launches): the split and the very
    workspace, counters and gate tensors, only the prefill changed; the config's checks hold."""
    plan = W.GluonWoAPlan.build(16, 2, 128, 64, torch.bfloat16, "cpu")
    gated = plan.with_prefill(2)
    assert (gated.config.prefill, plan.config.prefill) == (2, None)
    assert gated.config == W.GluonWoAConfig(prefill=2)
    assert (gated.split, gated.k_per_split) == (plan.split, plan.k_per_split)
    assert gated.partials is plan.partials and gated.counters is plan.counters and gated.gate is plan.gate
    with pytest.raises(ValueError, match=r"GluonWoAConfig.prefill .*\[1, stages=6\], got 7"):
        plan.with_prefill(7)


def _meta(t):
    return torch.empty(t.shape, dtype=t.dtype, device="meta")


@pytest.mark.parametrize("case, match", [
    (lambda o, c, s, w, z: (o.float(), c, s, w, None, z), "o must have dtype"),
    (lambda o, c, s, w, z: (o[:, :2], c, s, w, None, z), "o must have shape"),
    (lambda o, c, s, w, z: (o[0], c, s, w, None, z), "o must be a 3-D"),
    (lambda o, c, s, w, z: (torch.zeros(9, 4, 512, dtype=torch.bfloat16), c, s, w, None, z), "o has 9 rows"),
    (lambda o, c, s, w, z: (o.transpose(0, 1).contiguous().transpose(0, 1), c, s, w, None, z),
     "o must have contiguous heads"),
    (lambda o, c, s, w, z: (o, c.double(), s, w, None, z), "cos must have dtype"),
    (lambda o, c, s, w, z: (o, c, s[:, :16], w, None, z), "sin must have shape"),
    (lambda o, c, s, w, z: (o, c, s, w.float(), None, z), "weight must have dtype"),
    (lambda o, c, s, w, z: (o, c, s, w.to(torch.float8_e4m3fn), None, z), "weight must have dtype"),
    (lambda o, c, s, w, z: (o, c, s, w[:64], None, z), "weight must have shape"),
    (lambda o, c, s, w, z: (o, c, s, _meta(w), None, z), "weight must be on"),
    (lambda o, c, s, w, z: (o, c, s, w, torch.zeros(4, 32, dtype=torch.uint8), z), "scale must be None"),
    (lambda o, c, s, w, z: (o, c, s, w, None, z.float()), "out must have dtype"),
    (lambda o, c, s, w, z: (o, c, s, w, None, z[:, :64]), "out must have shape"),
    (lambda o, c, s, w, z: (o, c, s, w, None, z), "compute capability 9.0"),
])
def test_bad_inputs_raise_naming_the_argument(case, match):
    plan = W.GluonWoAPlan.build(4, 2, 64, 8, torch.bfloat16, "cpu")
    o, _, cos, sin, w = (t.cpu() for t in _inputs(3, 4, 2, 64, seed=0))
    with pytest.raises((TypeError, ValueError), match=match):
        W.gluon_wo_a_(plan, *case(o, cos, sin, w, torch.empty(3, 128, dtype=torch.bfloat16)))
    z = torch.empty(3, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="go together"):
        W.gluon_wo_a_(plan, o, cos, sin, w, None, z, codes_out=torch.empty(3, 128, dtype=torch.uint8))
    with pytest.raises(ValueError, match="window_copy must be a tuple"):
        W.gluon_wo_a_(plan, o, cos, sin, w, None, z, window_copy=(z, ))
    with pytest.raises(TypeError, match="plan must be of type GluonWoAPlan"):
        W.gluon_wo_a_(WoAPlan.build(4, 2, 64, 8, torch.bfloat16, "cpu"), o, cos, sin, w, None, z)
    for gate in (-1, True, 2.0):
        with pytest.raises(ValueError, match="gate must be a non-negative int"):
            W.gluon_wo_a_(plan, o, cos, sin, w, None, z, gate=gate)
    with pytest.raises(ValueError, match="gate=4 needs pdl=True"):
        W.gluon_wo_a_(plan, o, cos, sin, w, None, z, gate=4)


def test_fp8_plan_needs_the_scale():
    plan = W.GluonWoAPlan.build(4, 2, 64, 8, torch.float8_e4m3fn, "cpu")
    o, _, cos, sin, w = (t.cpu() for t in _inputs(3, 4, 2, 64, seed=0))
    weight, scale = quantize_wo_a(w)
    z = torch.empty(3, 128, dtype=torch.bfloat16)
    for bad, match in ((None, "scale is required"), (scale[:, :8], "scale must have shape"),
                       (scale.float(), "scale must have dtype")):
        with pytest.raises((TypeError, ValueError), match=match):
            W.gluon_wo_a_(plan, o, cos, sin, weight, bad, z)
    with pytest.raises(TypeError, match="weight must have dtype torch.float8_e4m3fn"):
        W.gluon_wo_a_(plan, o, cos, sin, w, scale, z)
    assert W.shared_bytes(plan.config, 64, True) < W.shared_bytes(plan.config, 64, False)


def test_folded_scale_range_is_exact_and_checked():
    # The range argument of the module doc, checked on every E4M3 code and every scale byte: in
    # FOLD_SCALE_BYTES each e4m3 x 2^(b - 127) (FP32, exact) survives the round trip through BF16
    # and is zero, NaN or a BF16 normal; just outside, some code does not (subnormal or overflow).
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    lo, hi = W.FOLD_SCALE_BYTES
    tiny = torch.finfo(torch.bfloat16).tiny
    for b in range(1, 255):
        w = codes * 2.0 ** (b - 127)
        exact = torch.equal(w.bfloat16().float()[~w.isnan()], w[~w.isnan()])
        normal = bool(((w == 0) | w.isnan() | ((w.abs() >= tiny) & w.isfinite())).all())
        assert (exact and normal) == (lo <= b <= hi), b
    # the host check: a quantized weight passes; a byte outside the range raises, naming scale
    _, scale = quantize_wo_a(torch.randn(128, 256))
    W.check_folded_scale(scale)
    W.check_folded_scale(scale.view(torch.uint8))
    for bad in (lo - 1, hi + 1, 0, 255):
        s = scale.view(torch.uint8).clone()
        s[1, 2] = bad
        with pytest.raises(ValueError, match=r"^scale bytes must lie in \[10, 246\].*got bytes in") as e:
            W.check_folded_scale(s.view(torch.float8_e8m0fnu))
        assert "\n" not in str(e.value)
    with pytest.raises(TypeError, match="scale must be a float8_e8m0fnu or uint8"):
        W.check_folded_scale(scale.float())
    # the step's choice: a weight whose bytes leave the range keeps the Triton plan, not an error
    assert W.foldable_scale(None) and W.foldable_scale(scale)
    s = scale.view(torch.uint8).clone()
    s[0, 0] = 0
    assert not W.foldable_scale(s.view(torch.float8_e8m0fnu))


def _bf16_bits_to_f64(h):
    """float64 values of BF16 bit patterns h (uint32 0..0xFFFF): subnormals, zeros, infinities and
    NaN as IEEE says."""
    sign = np.where(h & 0x8000, -1.0, 1.0)
    e = ((h >> 7) & 0xFF).astype(np.int64)
    m = (h & 0x7F).astype(np.float64)
    with np.errstate(over="ignore"):
        v = np.where(e == 0, m * 2.0 ** -133, (128 + m) * np.exp2(e.astype(np.float64) - 134))
    v = np.where(e == 255, np.where(m == 0, np.inf, np.nan), v)
    return sign * v


def _f64_to_bf16_bits(v):
    """The BF16 bit patterns of float64 values v rounded to nearest even (subnormals kept, overflow
    to infinity, zeros keep their sign): what mul.rn.bf16x2 writes for the exact product v."""
    a = np.abs(v)
    _, ex = np.frexp(np.where(a > 0, a, 1.0))
    q = np.exp2(np.maximum(ex - 1, -126) - 7.0)          # the BF16 quantum at |v|
    with np.errstate(invalid="ignore", over="ignore"):
        r = np.rint(a / q) * q                            # rint: halves to even
        r = np.where(r >= 2.0 ** 128, np.inf, r)
    bits = (r.astype(np.float32).view(np.uint32) >> 16) | np.where(np.signbit(v), 0x8000, 0).astype(np.uint32)
    return np.where(np.isnan(v), 0x7FC0, bits).astype(np.uint32)


def _run_fold_bits_asm(asm: str, regs: dict) -> np.ndarray:
    """Interpret `asm` (W._FOLD_BITS_ASM's PTX: prmt.b32 in its default mode, shl.b32, and.b32,
    mov.b32, mul.rn.bf16x2) on uint32 arrays, one lane per element pair; regs holds the operands
    ("$1": the codes register, "$2": the scale pair). Returns "$0"."""
    def mul_bf16x2(a, b):
        a, b = (np.asarray(v, dtype=np.uint32) for v in (a, b))
        halves = [_f64_to_bf16_bits(_bf16_bits_to_f64((a >> s) & 0xFFFF) * _bf16_bits_to_f64((b >> s) & 0xFFFF))
                  for s in (0, 16)]
        return (halves[0] | (halves[1] << 16)).astype(np.uint32)

    return run_b32_ptx(asm, regs, {"mul.rn.bf16x2": mul_bf16x2})["$0"]


def _fold_bits_errors(asm: str) -> int:
    """Elements where `asm` (on the codes as Triton packs them: code 0 in byte 0, code 1 in byte 1,
    the register's upper bytes arbitrary) differs from the dequantized weight's BF16 bits, over every
    non-NaN E4M3 code in either half of the pair times every scale byte in FOLD_SCALE_BYTES."""
    codes = np.arange(256, dtype=np.uint32)
    codes = codes[(codes & 0x7F) != 0x7F]                  # the E4M3 NaNs excluded
    c0, c1 = codes, codes[::-1].copy()
    junk = np.random.default_rng(7).integers(0, 1 << 16, codes.size, dtype=np.uint32) << 16
    lo, hi = W.FOLD_SCALE_BYTES
    errors = 0
    for b in range(lo, hi + 1):
        # the scale pair as `_block_scale_pairs` builds it: b * 0x00800080 (int32 arithmetic)
        pair = int((torch.tensor([b], dtype=torch.int32) * 0x00800080).item()) & 0xFFFFFFFF
        out = _run_fold_bits_asm(asm, {"$1": c0 | (c1 << 8) | junk, "$2": np.uint32(pair)})
        for half, c in ((out & 0xFFFF, c0), (out >> 16, c1)):
            weight = torch.from_numpy(c.astype(np.uint8))[None, :].view(torch.float8_e4m3fn)
            ref = fp8_block_dequantize(weight, torch.full((1, -(-c.size // 32)), b, dtype=torch.uint8))
            ref_bits = ref.bfloat16().view(torch.int16).numpy()[0].astype(np.uint32) & 0xFFFF
            errors += int((half != ref_bits).sum())
    return errors


def test_fold_bits_conversion_is_exact_on_every_code_and_scale():
    # `GluonWoAConfig.fold_bits`' conversion, its PTX (W._FOLD_BITS_ASM) interpreted instruction by
    # instruction with PTX's integer and BF16 semantics, against fp8_block_dequantize rounded to
    # BF16, bit for bit (signed zeros included): every non-NaN E4M3 code (zeros, subnormals, both
    # signs, 448) in both halves of a pair times every scale byte in FOLD_SCALE_BYTES.
    ref = fp8_block_dequantize(torch.tensor([[0x80]], dtype=torch.uint8), torch.tensor([[127]], dtype=torch.uint8))
    assert ref.bfloat16().view(torch.int16).item() == -0x8000, "the reference keeps -0"
    assert _fold_bits_errors(W._FOLD_BITS_ASM.value) == 0
    # the check sees a wrong sequence: codes zero-extended (signs lost), the sign bits masked off,
    # the 2^120 step skipped
    asm = W._FOLD_BITS_ASM.value
    for wrong in (asm.replace("0x9180", "0x0100"), asm.replace("0x87F087F0", "0x07F007F0"),
                  asm.replace("mul.rn.bf16x2 x, x, k;", "")):
        assert wrong != asm and _fold_bits_errors(wrong) > 0


def test_folded_plan_needs_no_staging_and_no_wider_cap():
    fold = W.GluonWoAConfig(fold_scales=True)
    plan = W.GluonWoAPlan.build(64, 8, RANK, 64, torch.float8_e4m3fn, "cpu", config=fold)
    assert plan.folds_scales and not W.GluonWoAPlan.build(64, 8, RANK, 64, torch.float8_e4m3fn, "cpu").folds_scales
    assert not W.GluonWoAPlan.build(64, 8, RANK, 64, torch.bfloat16, "cpu", config=fold).folds_scales
    # the same split as the other consumers (the folded z is the BF16 plan's on the dequantized weight)
    assert plan.split == W.GluonWoAPlan.build(64, 8, RANK, 64, torch.bfloat16, "cpu").split
    assert W.launch_options(plan, 8)["FOLD"] is True
    for bt in W.ROW_BUCKETS:
        assert W.register_cap(fold, bt, True) == 80
        assert W.shared_bytes(fold, bt, True) + 64 * 64 * 2 == W.shared_bytes(W.GluonWoAConfig(), bt, True)
    with pytest.raises(ValueError, match="GluonWoAConfig.fold_scales must be a bool"):
        W.GluonWoAConfig(fold_scales=1)
    # fold_bits: the bit conversion's constexpr only with the folded consumer; its cap is the same
    bits = W.GluonWoAConfig(fold_scales=True, fold_bits=True)
    assert W.launch_options(W.GluonWoAPlan.build(64, 8, RANK, 64, torch.float8_e4m3fn, "cpu", config=bits),
                            8)["FOLD_BITS"] is True
    assert W.launch_options(plan, 8)["FOLD_BITS"] is False
    assert W.launch_options(W.GluonWoAPlan.build(64, 8, RANK, 64, torch.float8_e4m3fn, "cpu",
                                                 config=W.GluonWoAConfig(fold_bits=True)), 8)["FOLD_BITS"] is False
    assert all(W.register_cap(bits, bt, True) == 80 for bt in W.ROW_BUCKETS)
    with pytest.raises(ValueError, match="GluonWoAConfig.fold_bits must be a bool"):
        W.GluonWoAConfig(fold_bits=1)


def test_register_hazard_check_sees_a_rewritten_operand():
    # sm90.wgmma_register_hazards on a loop whose next iteration rewrites the A registers of a slot
    # still in flight (a wait leaving 2 groups: this slot's), and on the same loop with a drain.
    from dsv41_decode.testing import sm90

    class Fake:
        def __init__(self, texts):
            lines = [f"        /*{16 * i:04x}*/                   {t} ;" for i, t in enumerate(texts)]
            self.asm = {"cuobjdump -sass": "\n".join(lines)}

    loop = ["LDS.U16 R28, [R16+UR6]", "F2FP.BF16.F32.PACK_AB R29, R30, R29", "WARPGROUP.ARRIVE",
            "HGMMA.64x8x16.F32.BF16 R24, R28, gdesc[UR4], R24",
            "HGMMA.64x8x16.F32.BF16 R24, R32, gdesc[UR4], R24, gsb0",
            "F2FP.BF16.F32.PACK_AB R36, R37, R44", "HGMMA.64x8x16.F32.BF16 R24, R36, gdesc[UR4], R24",
            "HGMMA.64x8x16.F32.BF16 R24, R40, gdesc[UR4], R24, gsb0"]
    bad = Fake(loop + ["WARPGROUP.DEPBAR.LE gsb0, 0x2", "@P0 BRA 0x0", "EXIT"])
    assert sm90.wgmma_register_hazards(bad) == ["LDS.U16 R28, [R16+UR6]", "F2FP.BF16.F32.PACK_AB R29, R30, R29",
                                                "F2FP.BF16.F32.PACK_AB R36, R37, R44"]
    good = Fake(loop + ["WARPGROUP.DEPBAR.LE gsb0, 0x0", "@P0 BRA 0x0", "EXIT"])
    assert sm90.wgmma_register_hazards(good) == []
    # writes to the first wgmma's operand R28..R31 while it is in flight, in forms whose written
    # register is not simply the first operand: after a predicate destination, the pair of CS2R, an
    # atomic's returned value, a warp reduction
    for write in ("SHFL.IDX PT, R29, R5, 0x1, 0x1f", "CS2R R27, SRZ", "ATOMS.ADD R30, [R2], R3", "REDUX.SUM R31, R4"):
        hazard = Fake(loop[:4] + [write] + loop[4:] + ["WARPGROUP.DEPBAR.LE gsb0, 0x0", "@P0 BRA 0x0", "EXIT"])
        assert set(sm90.wgmma_register_hazards(hazard)) == {write}, write
    for harmless in ("ISETP.GE.AND P0, PT, R29, R3, PT", "RED.E.ADD.STRONG.GPU [R2.64], R29", "CS2R.32 R27, SR_CLOCKLO"):
        clean = Fake(loop[:4] + [harmless] + loop[4:] + ["WARPGROUP.DEPBAR.LE gsb0, 0x0", "@P0 BRA 0x0", "EXIT"])
        assert sm90.wgmma_register_hazards(clean) == [], harmless


# ---------------------------------------------------------------------------------------------- GPU

GPU_ROWS = (1, 2, 4, 16, 33, 64)
DTYPES = (torch.bfloat16, torch.float8_e4m3fn)


def _real(heads: int, seed: int, dtype=torch.bfloat16, config=None):
    """(plan, o, cis, cos, sin, weight, scale, the weight the reference takes, out [64, G*R]) at the
    real shape of `heads` heads (TP1..8), the weight BF16 or quantized to FP8; config: the plan's."""
    groups = heads // 8
    o, cis, cos, sin, w = _inputs(64, heads, groups, RANK, seed=seed)
    if dtype == torch.float8_e4m3fn:
        weight, scale = quantize_wo_a(w)
        w_ref = fp8_block_dequantize(weight, scale).bfloat16()
    else:
        weight, scale, w_ref = w, None, w
    plan = W.GluonWoAPlan.build(heads, groups, RANK, 64, dtype, "cuda", config=config)
    out = torch.empty(64, groups * RANK, dtype=torch.bfloat16, device="cuda")
    return plan, o, cis, cos, sin, weight, scale, w_ref, out


FOLD = W.GluonWoAConfig(fold_scales=True)
FOLD_BITS = W.GluonWoAConfig(fold_scales=True, fold_bits=True)   # the folded consumer's bit conversion
FOLD_BITS_S8 = W.GluonWoAConfig(fold_scales=True, fold_bits=True, stages=8)   # the step's (its ring)


@pytest.mark.gpu
@pytest.mark.parametrize("config", (FOLD, FOLD_BITS), ids=("fp8_folded", "fp8_folded_bits"))
def test_gpu_folded_fp8_extreme_codes_and_scales(config):
    # Every E4M3 code (zero, both signs, the subnormals, 448) under scale bytes at both ends of
    # FOLD_SCALE_BYTES and in between, at TP8 and 1 and 16 rows: bitwise the BF16 plan's z on the
    # dequantized weight (the conversion exact over its whole range), with either conversion.
    heads, groups = 8, 1
    plan, o, cis, cos, sin, _, _, _, out = _real(heads, seed=600, dtype=torch.bfloat16)
    plan = W.GluonWoAPlan.build(heads, groups, RANK, 64, torch.float8_e4m3fn, "cuda", config=config)
    g = torch.Generator(device="cuda").manual_seed(600)
    codes = torch.randint(0, 256, (RANK, heads * 512), dtype=torch.uint8, device="cuda", generator=g)
    codes[(codes & 0x7F) == 0x7F] = 0x38        # no NaN codes (1.0 instead)
    lo, hi = W.FOLD_SCALE_BYTES
    sb = torch.tensor([lo, lo + 1, 100, 127, 150, hi - 1, hi], dtype=torch.uint8, device="cuda")
    scale = sb[torch.randint(0, len(sb), (RANK // 32, heads * 16), device="cuda", generator=g)]
    weight = codes.view(torch.float8_e4m3fn)
    w_ref = fp8_block_dequantize(weight, scale).bfloat16()
    assert torch.equal(w_ref.float(), fp8_block_dequantize(weight, scale).float()), "exact in BF16"
    bf16 = W.GluonWoAPlan.build(heads, groups, RANK, 64, torch.bfloat16, "cuda")
    z_b = torch.empty_like(out)
    # |w| up to 448 x 2^119 ~ 2^128: o scaled by 2^-20 keeps every product and sum finite
    o = (o.float() * 2.0 ** -20).bfloat16()
    for m in (1, 16):
        W.gluon_wo_a_(plan, o[:m], cos[:m], sin[:m], weight, scale.view(torch.float8_e8m0fnu), out[:m])
        W.gluon_wo_a_(bf16, o[:m], cos[:m], sin[:m], w_ref, None, z_b[:m])
        assert out[:m].isfinite().all()
        assert torch.equal(out[:m], z_b[:m]), m


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, config", [(DTYPES[0], None), (DTYPES[1], None), (torch.float8_e4m3fn, FOLD),
                                           (torch.float8_e4m3fn, FOLD_BITS), (torch.float8_e4m3fn, FOLD_BITS_S8)],
                         ids=("bf16", "fp8", "fp8_folded", "fp8_folded_bits", "fp8_folded_bits_s8"))
@pytest.mark.parametrize("heads", REAL_HEADS, ids=[f"tp{64 // h}" for h in REAL_HEADS])
def test_gpu_real_shapes_match_reference(heads, dtype, config):
    # Every row count at the real shapes: within the module's tolerance of the reference (on the
    # dequantized weight for FP8), rows past M untouched, counters reset. The folded consumer also
    # bitwise the BF16-weight Gluon plan's z on that weight (module doc: the folded weight is that
    # weight exactly, and the instruction sequence is the BF16 one), with either conversion.
    folded = config is not None and config.fold_scales
    seed = (400 if folded else 0) + heads
    plan, o, cis, cos, sin, weight, scale, w_ref, out = _real(heads, seed=seed, dtype=dtype, config=config)
    groups = heads // 8
    if folded:
        W.check_folded_scale(scale)
        bf16 = W.GluonWoAPlan.build(heads, groups, RANK, 64, torch.bfloat16, "cuda")
        z_b = torch.empty_like(out)
    for m in GPU_ROWS:
        out.fill_(float("nan"))
        W.gluon_wo_a_(plan, o[:m], cos[:m], sin[:m], weight, scale, out[:m])
        _check(out[:m], grouped_wo_a(o[:m], cis[:m], w_ref, groups, 64))
        assert out[m:].isnan().all(), "rows past M untouched"
        assert not plan.counters.any(), "the last program of every tile resets its counter"
        if folded:
            W.gluon_wo_a_(bf16, o[:m], cos[:m], sin[:m], w_ref, None, z_b[:m])
            assert torch.equal(out[:m], z_b[:m]), m


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, config", [(DTYPES[0], None), (DTYPES[1], None), (torch.float8_e4m3fn, FOLD),
                                           (torch.float8_e4m3fn, FOLD_BITS), (torch.float8_e4m3fn, FOLD_BITS_S8)],
                         ids=("bf16", "fp8", "fp8_folded", "fp8_folded_bits", "fp8_folded_bits_s8"))
@pytest.mark.parametrize("heads", (64, 8), ids=("tp1", "tp8"))
def test_gpu_bitwise_run_to_run_and_batch_invariant(heads, dtype, config):
    seed = (500 if config is not None and config.fold_scales else 100) + heads
    plan, o, cis, cos, sin, weight, scale, _, out = _real(heads, seed=seed, dtype=dtype, config=config)
    W.gluon_wo_a_(plan, o, cos, sin, weight, scale, out)
    full = out.clone()
    for _ in range(3):
        W.gluon_wo_a_(plan, o, cos, sin, weight, scale, out)
        assert torch.equal(out, full)
    # a row's bits do not depend on the other rows of the call (every row bucket, and rows at
    # several places in the call)
    for m in GPU_ROWS:
        W.gluon_wo_a_(plan, o[:m], cos[:m], sin[:m], weight, scale, out[:m])
        assert torch.equal(out[:m], full[:m]), m
    for r in (0, 5, 63):
        W.gluon_wo_a_(plan, o[r:r + 1], cos[r:r + 1], sin[r:r + 1], weight, scale, out[:1])
        assert torch.equal(out[0], full[r]), r


@pytest.mark.gpu
@pytest.mark.parametrize("m", (1, 16, 64))
def test_gpu_window_copy_and_mxfp8_equal_the_triton_kernels(m):
    # The step's call: the MXFP8 of z and the staged window copy (528-byte records) in the same
    # call; both equal ops.wo_a's (codes and scales bit for bit given z's bits: compared on the
    # Triton kernel's quantization of the Gluon z), rows past M and other slots untouched.
    from dsv41_decode.ops.act_quant import act_quant_mxfp8_
    heads, groups = 64, 8
    plan, o, cis, cos, sin, w, _, _, out = _real(heads, seed=7 + m)
    codes = torch.full((64, groups * RANK), 0xAA, dtype=torch.uint8, device="cuda")
    scales = torch.full((64, groups * RANK // 32), 0xAA, dtype=torch.uint8, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(m)
    pool0 = torch.randint(0, 256, (200, 528), dtype=torch.uint8, device="cuda", generator=g)
    src = torch.randperm(100, device="cuda", generator=g)[:64] + 100      # staged slots 100..199
    dst = torch.randperm(100, device="cuda", generator=g)[:64]            # ring slots 0..99
    want_pool = pool0.clone()
    want_pool.index_copy_(0, dst[:m], want_pool.index_select(0, src[:m]))
    pool = pool0.clone()
    W.gluon_wo_a_(plan, o[:m], cos[:m], sin[:m], w, None, out[:m], codes[:m], scales[:m],
                  window_copy=(pool, src, dst))
    assert torch.equal(pool, want_pool)
    _check(out[:m], grouped_wo_a(o[:m], cis[:m], w, groups, 64))
    want_c = torch.empty(m, groups * RANK, dtype=torch.uint8, device="cuda")
    want_s = torch.empty(m, groups * RANK // 32, dtype=torch.uint8, device="cuda")
    act_quant_mxfp8_(out[:m], want_c, want_s)
    assert torch.equal(codes[:m], want_c) and torch.equal(scales[:m], want_s)
    assert (codes[m:] == 0xAA).all() and (scales[m:] == 0xAA).all()
    # the Triton kernel's copy leaves the same pool
    tri_pool = pool0.clone()
    tri = WoAPlan.build(heads, groups, RANK, 64, torch.bfloat16, "cuda")
    z_tri = torch.empty(m, groups * RANK, dtype=torch.bfloat16, device="cuda")
    wo_a_(tri, o[:m], cos[:m], sin[:m], w, None, z_tri, window_copy=(tri_pool, src, dst))
    assert torch.equal(tri_pool, pool)


@pytest.mark.gpu
@pytest.mark.parametrize("split", (1, None), ids=("split1", "default"))
def test_gpu_rotation_is_bit_exact_through_an_identity_weight(split):
    # One head per group and weight = I: z is the rotated, BF16-rounded input itself (one exact
    # product per output), so any difference is in the rotation or its rounding (as test_wo_a's).
    from dsv41_decode.reference.rope import rope_tail
    m, heads = 5, 2
    o, cis, cos, sin, _ = _inputs(m, heads, heads, 512, seed=3)
    w = torch.eye(512, dtype=torch.bfloat16, device="cuda").repeat(heads, 1)
    plan = W.GluonWoAPlan.build(heads, heads, 512, m, torch.bfloat16, "cuda", config=W.GluonWoAConfig(split=split))
    z = torch.empty(m, heads * 512, dtype=torch.bfloat16, device="cuda")
    W.gluon_wo_a_(plan, o, cos, sin, w, None, z)
    want = rope_tail(o.cpu(), cis.cpu(), 64, inverse=True).reshape(m, -1)
    assert torch.equal(z.cpu(), want)
    assert not torch.equal(z.cpu(), o.cpu().reshape(m, -1)), "the rotation must change the tail"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=("bf16", "fp8"))
@pytest.mark.parametrize("heads", REAL_HEADS, ids=[f"tp{64 // h}" for h in REAL_HEADS])
def test_gpu_against_the_triton_kernel(heads, dtype):
    # Within the reference's tolerance of the step's Triton plan (both are that close to the
    # reference); prints how many outputs are bitwise equal (BF16: the same split and K order as the
    # swapped Triton kernel, possibly all; FP8: the Triton plan runs TF32 dots at split 4; not required).
    from dsv41_decode.testing.compare import bits_differ
    plan, o, cis, cos, sin, weight, scale, _, out = _real(heads, seed=200 + heads, dtype=dtype)
    tri = WoAPlan.build(heads, heads // 8, RANK, 64, dtype, "cuda")
    z_t = torch.empty_like(out)
    for m in GPU_ROWS:
        W.gluon_wo_a_(plan, o[:m], cos[:m], sin[:m], weight, scale, out[:m])
        wo_a_(tri, o[:m], cos[:m], sin[:m], weight, scale, z_t[:m])
        _check(out[:m], z_t[:m])
        print(f"gluon vs triton wo_a, {str(dtype)[6:]}, {heads} heads, {m} rows: {bits_differ(out[:m], z_t[:m])} "
              f"of {out[:m].numel()} outputs differ bitwise")


def test_step_plan_off_sm90_is_the_triton_plan():
    # decode.attention.wo_a_plan: off sm_90 (here the CPU's interpreter) the Triton plan, one split
    from dsv41_decode.decode.attention import wo_a_plan
    for dtype in DTYPES:
        plan = wo_a_plan(64, 8, RANK, 64, dtype, torch.device("cpu"))
        assert isinstance(plan, WoAPlan) and plan.split == 1 and plan.weight_dtype == dtype


@pytest.mark.gpu
def test_gpu_step_plan_is_gluon_for_a_bf16_weight():
    # On sm_90 the step's BF16 wo_a runs the Gluon kernel (the Triton plan's bits) and its FP8 wo_a
    # the folded consumer; FP8 with gluon_fp8=False, fp32_dots and shapes the Gluon kernel does not
    # take keep the Triton plan; wo_a_launch runs either.
    from dsv41_decode.decode.attention import FP8_WO_A_STAGES, wo_a_launch, wo_a_plan
    from dsv41_decode.ops.common import is_sm90
    dev = torch.device("cuda")
    plan = wo_a_plan(64, 8, RANK, 64, torch.bfloat16, dev)
    assert isinstance(plan, W.GluonWoAPlan) is is_sm90(dev)
    assert isinstance(wo_a_plan(64, 8, RANK, 64, torch.bfloat16, dev, fp32_dots=True), WoAPlan)
    assert isinstance(wo_a_plan(64, 8, RANK, 64, torch.float8_e4m3fn, dev, gluon_fp8=False), WoAPlan)
    folded = wo_a_plan(64, 8, RANK, 64, torch.float8_e4m3fn, dev)   # the step's FP8 default
    assert isinstance(folded, W.GluonWoAPlan) is is_sm90(dev) and getattr(folded, "folds_scales", True)
    assert not is_sm90(dev) or folded.config.fold_bits            # its bit conversion (measured faster)
    assert not is_sm90(dev) or folded.config.stages == FP8_WO_A_STAGES != plan.config.stages   # its ring
    assert isinstance(wo_a_plan(8, 4, 96, 64, torch.bfloat16, dev), WoAPlan)     # rank 96: not 64 rows a tile
    _, o, _, cos, sin, w, _, _, out = _real(64, seed=300)
    tri = WoAPlan.build(64, 8, RANK, 64, torch.bfloat16, "cuda")
    z_t = torch.empty_like(out)
    for m in (1, 16, 64):
        wo_a_launch(plan, o[:m], cos[:m], sin[:m], w, None, out[:m])
        wo_a_launch(tri, o[:m], cos[:m], sin[:m], w, None, z_t[:m])
        _check(out[:m], z_t[:m])
