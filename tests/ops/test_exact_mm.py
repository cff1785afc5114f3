"""ops.exact_mm against reference.linear.mxfp8_mm: bitwise (BF16 and FP32 outputs), in the interpreter
at small shapes and on the GPU at the V4.1-Flash shapes; plus batch invariance, configuration
invariance, the argument errors, and (in a subprocess without the interpreter) the sm_90 build.

No tolerance anywhere: the op computes the contract's arithmetic exactly (each 32-block's dot exact,
rounded once to FP32; the block terms scaled and added in K order; one rounding to BF16), so any
difference from the reference is a bug. The data includes operands on which a plain FP32 sum of a
block's 32 products is not the exactly rounded one (heavy-tailed values and uniformly random E4M3
codes, whose products span 2^-18 .. 2^17.6), and the tests check that it is not, so that an inexact
block sum cannot pass them.
"""

import dataclasses
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import FLASH_LINEAR_SHAPES as FLASH_SHAPES
from helpers import (boundary_operands, check_mxfp8_plan_errors, compile_script, linear_operands, raises, rope_operands,
                     run_b32_ptx)

from dsv41_decode.ops.common import fp64_rate_ratio, full_rate_fp64, num_sms
from dsv41_decode.ops.exact_mm import HI_WORDS_PTX, ExactMM, _chain_asm
from dsv41_decode.ops.exact_mm_plan import _TUNED, _TUNED_FP32, ExactConfig, planned_config
from dsv41_decode.ops.kv_write import query_rope_
from dsv41_decode.ops.mhc import MhcBoundaryPlan, mhc_boundary
from dsv41_decode.reference.linear import mxfp8_mm

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _codes(gen: torch.Generator, shape, kind: str) -> torch.Tensor:
    """E4M3 codes: "uniform" = every byte but the two NaNs equally likely; "heavy" = randn^3 with
    each row's largest magnitude at 448 (values from 448 down to the subnormals)."""
    if kind == "uniform":
        b = torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen)
        b[(b & 0x7F) == 0x7F] ^= 0x01          # 0x7F / 0xFF (NaN) -> 0x7E / 0xFE (+-448)
        return b.view(torch.float8_e4m3fn)
    v = torch.randn(shape, generator=gen) ** 3
    return (v * (448 / v.abs().amax(-1, keepdim=True))).to(torch.float8_e4m3fn)


def _exact_operands(gen, m: int, n: int, k: int, kind: str):
    """(codes, x_scale, weight, w_scale) of `kind` codes and UE8M0 scales 2^-8 .. 2^7."""
    codes, weight = _codes(gen, (m, k), kind), _codes(gen, (n, k), kind)
    x_scale = torch.randint(119, 135, (m, k // 32), dtype=torch.uint8, generator=gen)
    w_scale = torch.randint(119, 135, (-(-n // 32), k // 32), dtype=torch.uint8, generator=gen)
    return [t.to(DEVICE) for t in (codes, x_scale, weight, w_scale)]


def _naive_fp32(codes, x_scale, weight, w_scale) -> torch.Tensor:
    """The contract's FP32 output but with each block's 32 products added one by one in FP32 (what
    an FP32 CUDA-core dot does): the inexact sum the tests must tell apart from the exact one."""
    m, k = codes.shape
    n = weight.shape[0]
    p = codes.float().cpu().reshape(m, 1, k // 32, 32) * weight.float().cpu().reshape(1, n, k // 32, 32)
    part = torch.zeros(m, n, k // 32)
    for c in range(32):
        part = part + p[..., c]
    sx = (x_scale.cpu().view(torch.uint8).int() << 23).view(torch.float32)
    sw = (w_scale.cpu().view(torch.uint8).int() << 23).view(torch.float32).repeat_interleave(32, 0)[:n]
    acc = torch.zeros(m, n)
    for b in range(k // 32):
        acc = acc + part[:, :, b] * sx[:, b:b + 1] * sw[None, :, b]
    return acc


def _bits(y: torch.Tensor) -> torch.Tensor:
    return y.view(torch.int16) if y.dtype == torch.bfloat16 else y.view(torch.int32)


def _poisoned(m: int, n: int, dtype=torch.bfloat16) -> torch.Tensor:
    return torch.full((m, n), float("nan"), dtype=dtype, device=DEVICE)


def check_rope(plan, codes, x_scale, cos, sin, plain: torch.Tensor, what) -> None:
    """`plan(codes, x_scale, out, rope=(cos, sin))` into a poisoned out gives the bits of `plain` (the
    call without the epilogue, [M, N] BF16) followed by `kv_write.query_rope_`: the columns outside
    each head's channels 448..511 are plain's, the rotary ones moved (the unfused path the exact
    linears' query-RoPE epilogue replaces; test_gluon_exact_fma, _mm and test_exact_linear use it)."""
    m, n = plain.shape
    want = plain.clone()
    query_rope_(want.view(m, -1, 512), cos, sin)
    got = plan(codes, x_scale, _poisoned(m, n), rope=(cos, sin))
    assert torch.equal(_bits(got), _bits(want)), (what, int((_bits(got) != _bits(want)).sum()))
    tail = (torch.arange(n, device=plain.device) % 512) >= 448
    assert torch.equal(_bits(got[:, ~tail]), _bits(plain[:, ~tail])), what
    assert not torch.equal(_bits(got[:, tail]), _bits(plain[:, tail])), what


def check_boundary(plan, codes, x_scale, ops, plain: torch.Tensor, what) -> None:
    """`plan(codes, x_scale, out, boundary=ops)` (ops: `helpers.boundary_operands`, outputs poisoned)
    into a poisoned out gives plain's bits in out (the call without the epilogue, [M, N] BF16) and,
    in ops' outputs, those of `mhc_boundary_(plain, ...)` with a plan of the same chunks (the
    separate launch that the step's wo_b epilogue stands for under fold_boundary); the plan's
    counters end at zero (test_exact_linear uses it too)."""
    m, n = plain.shape
    want = mhc_boundary(plain, ops.x, ops.post, ops.comb, ops.pre, ops.norm_weight, ops.eps,
                        plan=MhcBoundaryPlan.build(n, m, plain.device, ops.plan.block_d))
    got = plan(codes, x_scale, _poisoned(m, n), boundary=ops)
    assert torch.equal(_bits(got), _bits(plain)), what
    for name, a, b in zip(("x_out", "u_out", "codes_out", "scales_out"),
                          (ops.x_out, ops.u_out, ops.codes_out, ops.scales_out), want):
        a, b = a.view(torch.uint8), b.view(torch.uint8)
        assert torch.equal(a, b), (what, name, int((a != b).sum()))
    assert not ops.plan.counters.any() and not ops.plan.chunk_counters.any(), what


# Small tiles so that the tiny shapes have several programs (a partial last one) and K steps.
_CONFIGS = {
    "bn16-bk64-r4": ExactConfig(block_n=16, block_k=64, rows=4, num_warps=1, num_stages=2),
    "bn32-bk128-r2": ExactConfig(block_n=32, block_k=128, rows=2, num_warps=2, num_stages=3),
    "bn8-bk256-r4": ExactConfig(block_n=8, block_k=256, rows=4, num_warps=2, num_stages=2),
    # K split over programs (calls of at most 4 rows): the tile's last program adds the terms
    "bn16-bk64-split3": ExactConfig(block_n=16, block_k=64, rows=1, num_warps=1, num_stages=2, split=3),
    # the block sums on the FP64 cores (ExactConfig.f64), one to four rows a pass, and split
    "bn16-bk64-r4-f64": ExactConfig(block_n=16, block_k=64, rows=4, num_warps=1, num_stages=2, f64=True),
    "bn32-bk128-r2-f64": ExactConfig(block_n=32, block_k=128, rows=2, num_warps=2, num_stages=3, f64=True),
    "bn16-bk64-split3-f64": ExactConfig(block_n=16, block_k=64, rows=1, num_warps=1, num_stages=2, split=3, f64=True),
}


@pytest.mark.parametrize("kind", ["heavy", "uniform"])
def test_data_defeats_a_plain_fp32_block_sum(kind):
    # The exactness tests below can fail: on their data, adding a block's products in FP32 gives
    # other FP32 outputs than the contract's.
    codes, x_scale, weight, w_scale = _exact_operands(_gen(1), 3, 40, 256, kind)
    ref = mxfp8_mm(codes, x_scale, weight, w_scale, torch.float32).cpu()
    assert (_naive_fp32(codes, x_scale, weight, w_scale) != ref).any()


@pytest.mark.parametrize("m,n,k,config,kind", [
    (1, 40, 256, "bn16-bk64-r4", "heavy"), (1, 40, 256, "bn32-bk128-r2", "uniform"),
    (3, 40, 384, "bn32-bk128-r2", "heavy"), (6, 24, 256, "bn8-bk256-r4", "uniform"),
    (5, 24, 256, None, "quantized"), (2, 40, 384, None, "heavy"),
    (3, 40, 256, "bn16-bk64-split3", "uniform"), (1, 24, 384, "bn16-bk64-split3", "heavy"),
    (1, 40, 256, "bn32-bk128-r2-f64", "heavy"), (6, 40, 256, "bn16-bk64-r4-f64", "uniform"),
    (3, 24, 384, "bn32-bk128-r2-f64", "uniform"), (2, 40, 256, "bn16-bk64-split3-f64", "heavy"),
])
def test_bitwise_equal_to_the_reference(m, n, k, config, kind):
    if kind == "quantized":   # MXFP8 activations and a block-quantized weight, as the model has them
        _, _, codes, x_scale, weight, w_scale = linear_operands(_gen(m + n + k), m, n, k)
    else:
        codes, x_scale, weight, w_scale = _exact_operands(_gen(m + n + k), m, n, k, kind)
    plan = ExactMM(weight, w_scale, config=_CONFIGS.get(config))
    for dtype in (torch.bfloat16, torch.float32):
        y = plan(codes, x_scale, _poisoned(m, n, dtype))
        ref = mxfp8_mm(codes, x_scale, weight, w_scale, dtype)
        assert torch.equal(_bits(y), _bits(ref)), (m, n, k, config, kind, dtype)
    assert int(plan._counters.abs().sum()) == 0     # split launches leave their counters at zero
    if DEVICE == "cpu":
        # The GPU's block sums: the chained split over 16-element slices of the thread's block (its
        # steps as Triton operations here, its PTX text in test_chained_split_ptx_is_exact).
        plan._chain = True
        y = plan(codes, x_scale, _poisoned(m, n, torch.float32))
        assert torch.equal(_bits(y), _bits(ref)), (m, n, k, config, kind, "chain")


def _run_ptx(asm: str, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Evaluate the straight-line FP32 PTX of `_chain_asm` on tensors: fma / add / sub with .rn, mov,
    registers, $n operands and 0f immediates. An FMA is computed in FP64 and rounded once to FP32,
    which is its exact rounding here: its product of two E4M3 values and its addend (an integer below
    2^24 or a multiple of 2^-18 below 2^18) add exactly within FP64's 53 bits."""
    regs = {f"${i + 2}": t for i, t in enumerate(inputs)}

    def val(tok):
        if tok.startswith("0f"):
            return torch.tensor(int(tok[2:], 16), dtype=torch.int32).view(torch.float32)
        return regs[tok]

    for line in asm.replace("\n", " ").replace("\t", " ").split(";"):
        line = line.strip(" {}")
        if not line or line.startswith(".reg"):
            continue
        op, args = line.split(None, 1)
        dst, *src = [a.strip() for a in args.split(",")]
        a = [val(t) for t in src]
        if op == "fma.rn.f32":
            regs[dst] = (a[0].double() * a[1].double() + a[2].double()).float()
        elif op == "add.rn.f32":
            regs[dst] = a[0] + a[1]
        elif op == "sub.rn.f32":
            regs[dst] = a[0] - a[1]
        elif op == "mov.f32":
            regs[dst] = a[0]
        else:
            raise AssertionError(f"unexpected PTX instruction {op}")
    return [regs["$0"], regs["$1"]]


@pytest.mark.parametrize("kind", ["uniform", "heavy", "largest"])
def test_chained_split_ptx_is_exact(kind):
    # The GPU's block sums come from the inline PTX of `_chain_asm` (the interpreter runs the plain
    # split instead): evaluated here instruction by instruction, H is an integer and H + L is the
    # exact sum of the 16 products, also at the largest magnitudes (the chain's bound) and with
    # every sign pattern that uniform codes give.
    gen = _gen(11)
    if kind == "largest":   # +-448 * 448 sixteen times: the chain's largest excursion from S
        w = torch.full((4, 16), 448.0) * torch.tensor([1.0, -1.0, 1.0, -1.0])[:, None]
        x = torch.full((4, 16), 448.0)
        w[2:, 8:] *= -1
    else:
        w, x = (_codes(gen, (20000, 16), kind).float() for _ in range(2))
    h, lo = _run_ptx(_chain_asm(16), [w[:, i] for i in range(16)] + [x[:, i] for i in range(16)])
    exact = (w.double() * x.double()).sum(1)
    assert torch.equal(h, h.round()) and torch.equal(h.double() + lo.double(), exact)


def test_fp64_code_words_are_the_values_times_2_to_the_minus_1016():
    # The GPU's FP64 weight operands (ExactConfig.f64, GluonExactFMA) come from the inline PTX of
    # `HI_WORDS_PTX` (the interpreter converts through FP32 instead): interpreted instruction by
    # instruction on every code in each of the four bytes of a word, the high word beside a zero
    # low word is the E4M3 value times 2^-1016 exactly (subnormals and both zeros included); the
    # two NaN codes read as +-480 (where the reference's term is NaN: ExactMM's contract excludes
    # them, and the checkpoint loader refuses them).
    codes = np.arange(256, dtype=np.uint32)
    rng = np.random.default_rng(5)
    others = rng.integers(0, 256, (3, 256), dtype=np.uint32)
    value = torch.from_numpy(codes.astype(np.uint8)).view(torch.float8_e4m3fn).double().numpy()
    value = np.where(np.isnan(value), np.where(codes & 0x80, -480.0, 480.0), value)
    for j in range(4):
        bytes_ = [others[i] for i in range(3)]
        bytes_.insert(j, codes)
        word = bytes_[0] | (bytes_[1] << 8) | (bytes_[2] << 16) | (bytes_[3] << 24)
        hi = run_b32_ptx(HI_WORDS_PTX, {"$4": word.astype(np.uint32)})[f"${j}"]
        got = (hi.astype(np.uint64) << np.uint64(32)).view(np.float64)
        want = value * 2.0 ** -1016
        assert np.array_equal(got, want) and np.array_equal(np.signbit(got), np.signbit(want)), j


def test_batch_and_configuration_invariance():
    # A row's bits do not depend on the rows beside it, on the row bucket, or on the configuration.
    m, n, k = 6, 24, 256
    codes, x_scale, weight, w_scale = _exact_operands(_gen(3), m, n, k, "uniform")
    plans = [ExactMM(weight, w_scale, config=c) for c in _CONFIGS.values()]
    together = plans[0](codes, x_scale)     # 6 rows: two passes
    for plan in plans[1:3]:
        assert torch.equal(_bits(plan(codes, x_scale)), _bits(together))
    for i in (0, 5):
        alone = plans[1](codes[i:i + 1], x_scale[i:i + 1])
        assert torch.equal(_bits(alone), _bits(together[i:i + 1])), i
    pair = plans[2](codes[4:6], x_scale[4:6])
    assert torch.equal(_bits(pair), _bits(together[4:6]))
    split = plans[3]                        # K split in 2 at up to 4 rows, one program per tile above
    assert split.launch_for(3).split == 2 and split.launch_for(6).split == 1
    assert torch.equal(_bits(split(codes[1:4], x_scale[1:4])), _bits(together[1:4]))
    assert plans[0].reduction_order(1) == plans[0].reduction_order(64) == plans[1].reduction_order(3)


# The query-RoPE epilogue in the interpreter on one head (N = 512): 128-row tiles over 4 x rows a
# pass (the tile of channels 384..511 rotates half its columns; 5 rows take two passes), and 64-row
# tiles with the K split (two programs a tile up to 4 rows, the last arriver rotating; 5 rows one
# split, 2 x rows a pass), and 64-row tiles with FP64 block sums.
_ROPE_CONFIGS = {"bn128-r4": ExactConfig(block_n=128, block_k=128, rows=4, num_warps=1, num_stages=2),
                 "bn64-r2-split2": ExactConfig(block_n=64, block_k=64, rows=2, num_warps=1, num_stages=2, split=2),
                 "bn64-r2-f64": ExactConfig(block_n=64, block_k=128, rows=2, num_warps=1, num_stages=2, f64=True)}


@pytest.mark.parametrize("config", list(_ROPE_CONFIGS))
def test_rope_epilogue_is_the_call_then_query_rope(config):
    # rope=(cos, sin) gives the bits of the call without it followed by `query_rope_`, at 1-5 rows;
    # a row's plain bits do not depend on the rows beside it, so one plain call of 5 rows serves.
    m, n, k = 5, 512, 128
    _, _, codes, x_scale, weight, w_scale = linear_operands(_gen(12), m, n, k)
    cos, sin = rope_operands(_gen(13), m)
    plan = ExactMM(weight, w_scale, config=_ROPE_CONFIGS[config])
    plain = plan(codes, x_scale)
    for r in range(1, m + 1):
        check_rope(plan, codes[:r], x_scale[:r], cos[:r], sin[:r], plain[:r], (config, r))
    assert int(plan._counters.abs().sum()) == 0


def test_rope_epilogue_bad_arguments_name_the_argument():
    # One-line errors naming the argument (checks.rope_epilogue_args), before any launch.
    m, n, k = 2, 512, 128
    _, _, codes, x_scale, weight, w_scale = linear_operands(_gen(14), m, n, k)
    cos, sin = rope_operands(_gen(15), m)
    plan = ExactMM(weight, w_scale, config=_ROPE_CONFIGS["bn128-r4"])
    odd = ExactMM(*linear_operands(_gen(16), m, 384, k)[4:])
    for call, word in ((lambda: plan(codes, x_scale, rope=cos), r"rope must be None or a \(cos, sin\) tuple"),
                       (lambda: plan(codes, x_scale, rope=(cos[:1], sin)), "cos must have shape"),
                       (lambda: plan(codes, x_scale, rope=(cos, sin.double())), "sin must have dtype"),
                       (lambda: plan(codes, x_scale, rope=(cos, sin[:, :16])), "sin must have shape"),
                       (lambda: plan(codes, x_scale, torch.empty(m, n, device=DEVICE), rope=(cos, sin)),
                        "rope: out must be bfloat16"),
                       (lambda: odd(codes, x_scale, rope=(cos, sin)),
                        "rope: the weight's N = 384 is not a multiple of 512")):
        with pytest.raises((TypeError, ValueError), match=word) as err:
            call()
        assert "\n" not in str(err.value), str(err.value)


# The mHC boundary epilogue in the interpreter: (dim, the plan's block_d, the configuration). Tiles of
# 16 columns, 4 to a chunk, 2 rows a pass (3 rows take two passes), with FP32 or FP64 block sums; dim
# 96 with a short last chunk (2 tiles) and the K split over 2 programs (the last arriver runs the
# epilogue); dim 5120 in the step's chunks of 512 columns, 4 tiles a chunk.
_BOUNDARY_CASES = {
    "dim256-bn16-r2": (256, 64, ExactConfig(block_n=16, block_k=64, rows=2, num_warps=1, num_stages=2)),
    "dim96-bn16-split2": (96, 64, ExactConfig(block_n=16, block_k=64, rows=1, num_warps=1, num_stages=2, split=2)),
    # the FP64 block sums (wo_b's 1-2-row plans on the H200 run the boundary with them)
    "dim256-bn16-r2-f64": (256, 64, ExactConfig(block_n=16, block_k=64, rows=2, num_warps=1, num_stages=2, f64=True)),
    "dim5120-bn128": (5120, 512, ExactConfig(block_n=128, block_k=128, rows=4, num_warps=2, num_stages=2)),
}


@pytest.mark.parametrize("case", list(_BOUNDARY_CASES))
def test_boundary_epilogue_is_the_call_then_mhc_boundary(case):
    # boundary=BoundaryOperands(...) gives the bits of the call without it followed by mhc_boundary_
    # (y, new streams, u, codes, scales) at 1-3 rows (dim 5120: 1), into poisoned outputs; then a
    # call of 2 rows on the last plan (its counters reset by the last arrivers) with new operands.
    dim, block_d, config = _BOUNDARY_CASES[case]
    _, _, codes, x_scale, weight, w_scale = linear_operands(_gen(dim + 21), 3, dim, 128)
    plan = ExactMM(weight, w_scale, config=config)
    plain = plan(codes, x_scale)
    gen = _gen(22)
    for m in ((1,) if dim > 1024 else (1, 2, 3)):
        ops = boundary_operands(gen, m, dim, block_d)
        check_boundary(plan, codes[:m], x_scale[:m], ops, plain[:m], (case, m))
    again = dataclasses.replace(boundary_operands(gen, 2, dim, block_d), plan=ops.plan)
    check_boundary(plan, codes[1:], x_scale[1:], again, plain[1:], (case, "again"))
    assert int(plan._counters.abs().sum()) == 0


def test_boundary_epilogue_bad_arguments_name_the_argument():
    # One-line errors naming the argument, before any launch.
    m, n, k = 2, 64, 128
    _, _, codes, x_scale, weight, w_scale = linear_operands(_gen(23), m, n, k)
    plan = ExactMM(weight, w_scale, config=ExactConfig(block_n=64, block_k=64, rows=2, num_warps=1, num_stages=2))
    ops = boundary_operands(_gen(24), m, n, 64)
    cos, sin = rope_operands(_gen(25), m)
    y = torch.empty(m, n, dtype=torch.bfloat16, device=DEVICE)
    fine, other_dim = MhcBoundaryPlan.build(n, m, DEVICE, 32), MhcBoundaryPlan.build(128, m, DEVICE)
    for call, word in (
            (lambda: plan(codes, x_scale, boundary=(ops.x, ops.post)), "boundary must be an mhc.BoundaryOperands"),
            (lambda: plan(codes, x_scale, torch.empty(m, n, device=DEVICE), boundary=ops),
             "boundary: out must be bfloat16"),
            (lambda: plan(codes, x_scale, rope=(cos, sin), boundary=ops), "boundary: the call has a rope epilogue"),
            (lambda: plan(codes, x_scale, boundary=dataclasses.replace(ops, plan=None)), "boundary.plan must be"),
            (lambda: plan(codes, x_scale, boundary=dataclasses.replace(ops, plan=fine)),
             "boundary.plan: block_d=32 must be a multiple of the launch's block_n=64"),
            (lambda: plan(codes, x_scale, boundary=dataclasses.replace(ops, plan=other_dim)),
             "plan is for dim=128"),
            (lambda: plan(codes, x_scale, boundary=dataclasses.replace(ops, x=ops.x[:, :3])), "x must have shape"),
            (lambda: plan(codes, x_scale, boundary=dataclasses.replace(ops, comb=ops.comb.double())),
             "comb must have dtype"),
            (lambda: plan(codes, x_scale, boundary=dataclasses.replace(ops, eps=None)), "eps must be a float"),
            (lambda: plan(codes, x_scale, y, boundary=dataclasses.replace(ops, u_out=y)), "u_out must not overlap y")):
        with pytest.raises((TypeError, ValueError), match=word) as err:
            call()
        assert "\n" not in str(err.value), str(err.value)


def test_planned_configs_keep_fp32_sums_where_fp64_is_slow():
    # A GPU whose FP64 runs at 1/32-1/64 of its FP32 rate (`common.full_rate_fp64` False: the H20,
    # the H800, the consumer parts) takes each measured FP64 configuration's tiles with FP32 sums;
    # off the GPU (the interpreter stands in for an H200) and on full-rate parts, the measured ones.
    assert any(c.f64 for c in _TUNED.values())
    for (n, k, bucket), cfg in _TUNED.items():
        slow = planned_config(n, k, bucket, fp64=False)
        assert not slow.f64, (n, k, bucket)
        assert slow == (_TUNED_FP32[(n, k, bucket)] if cfg.f64 else cfg), (n, k, bucket)
        assert planned_config(n, k, bucket, fp64=True) == cfg
    assert all(_TUNED[key].f64 and not c.f64 for key, c in _TUNED_FP32.items())
    assert full_rate_fp64("cpu") is False and fp64_rate_ratio("cpu") is None
    weight = torch.zeros(5120, 8192, dtype=torch.float8_e4m3fn, device=DEVICE)
    plan = ExactMM(weight, torch.full((160, 256), 127, dtype=torch.uint8, device=DEVICE), max_rows=2)
    want = DEVICE == "cpu" or full_rate_fp64(DEVICE)
    assert plan.launch_for(1).config.f64 == want and plan.launch_for(2).config.f64 == want


@pytest.mark.gpu
def test_fp64_rate_comes_from_the_driver_on_gpu():
    # The driver's FP32 : FP64 ratio: 2 on the data-center parts with full FP64 units (the H100 and
    # H200 this project measures on), so the exact linears' FP64 forms run there.
    ratio = fp64_rate_ratio(DEVICE)
    assert isinstance(ratio, int) and ratio >= 1
    assert full_rate_fp64(DEVICE) == (ratio <= 2)
    name = torch.cuda.get_device_name()
    if re.search(r"\bH(100|200)\b", name):
        assert ratio == 2, name


def test_launches_cover_the_row_buckets():
    weight = torch.zeros(100, 1280, dtype=torch.float8_e4m3fn, device=DEVICE)
    w_scale = torch.full((4, 40), 127, dtype=torch.uint8, device=DEVICE)
    plan = ExactMM(weight, w_scale)
    assert [plan.launch_for(m).config.rows for m in (1, 2, 3, 4, 37, 64)] == [1, 2, 4, 4, 4, 4]
    assert plan.launch_for(1).grid == (-(-100 // plan.launch_for(1).config.block_n), 1)
    assert plan.launch_for(37) is plan.launch_for(64) is not plan.launch_for(4)
    small = ExactMM(weight, w_scale, max_rows=2, config=ExactConfig(rows=4))
    assert small.launch_for(2).config.rows == 2 and set(small._launches) == {1, 2}
    # A split launch takes its bucket's rows in one pass; calls of more than 4 rows take one split.
    split = ExactMM(weight, w_scale, config=ExactConfig(block_k=128, rows=1, split=4))
    assert [(split.launch_for(m).split, split.launch_for(m).config.rows) for m in (1, 2, 4, 5)] == \
        [(4, 1), (4, 2), (4, 4), (1, 1)]
    assert split.launch_for(1).steps_per_split == 3 and split.launch_for(1).grid[1] == 4   # 10 steps: 3 3 3 1
    assert split._workspace.numel() >= split.launch_for(4).grid[0] * 16 * 4 * 40


def test_bad_inputs_name_the_argument():
    m, n, k = 2, 64, 128
    _, _, codes, x_scale, weight, w_scale = linear_operands(_gen(8), m, n, k)
    check_mxfp8_plan_errors(ExactMM, codes, x_scale, weight, w_scale)
    raises("block_k=256 must divide K=128", lambda: ExactMM(weight, w_scale, config=ExactConfig(block_k=256)))
    raises("config has no entry for the row bucket 2",
           lambda: ExactMM(weight, w_scale, config={1: ExactConfig(block_k=128)}))
    raises("config must be an ExactConfig", lambda: ExactMM(weight, w_scale, config="fast"))
    raises("block_n must be a power of two", lambda: ExactConfig(block_n=24))
    raises("block_k must be 32 times a power of two up to 1024", lambda: ExactConfig(block_k=2048))
    raises("rows must be 1, 2 or 4", lambda: ExactConfig(rows=3))
    raises("num_stages must be a positive int", lambda: ExactConfig(num_stages=0))
    raises("split must be a positive int", lambda: ExactConfig(split=0))
    raises("f64 must be a bool", lambda: ExactConfig(f64=1))


def test_bad_num_warps_name_the_field():
    # Triton takes a power of two: any other count would reach the compiler
    for bad in (3, 6, 32, 64):
        raises(rf"ExactConfig.num_warps must be a power of two in 1..16, got {bad}", lambda: ExactConfig(num_warps=bad))


def test_config_spec_round_trips():
    # The spec form the probe takes and the sm_90 script prints: split 1 and f64 off unless given.
    for cfg in (*_CONFIGS.values(), *_TUNED.values(), *_TUNED_FP32.values()):
        assert ExactConfig.from_spec(cfg.spec) == cfg
    assert ExactConfig.from_spec("8:1024:4:4:3") == ExactConfig(8, 1024, 4, 4, 3)
    raises("an ExactConfig spec is", lambda: ExactConfig.from_spec("8:1024:4"))
    raises("an ExactConfig spec is", lambda: ExactConfig.from_spec("8:1024:4:4:x"))


def test_compiles_for_sm90_without_spills():
    """The plans' configurations for fused wq_a|wkv at 1 row, wo_b at 4 rows (the most registers)
    and its FP32 plan at 1 (where FP64 runs slowly), a K-split one, and wq_b's at 1 and 4 rows with
    the query-RoPE epilogue (sm_90: 128
    and 255 registers, 119 and 247 without it) (`python tests/ops/_exact_mm_sm90.py --all` for
    every shape, shard and bucket, `--rope` with the epilogue),
    compiled for sm_90 by Triton's own ptxas in a subprocess without the interpreter
    (tests/ops/_exact_mm_sm90.py): no local memory and no spill stores or loads; the K loop's
    weight loads pipelined through shared memory (cp.async); the block terms' last multiply kept
    apart from the accumulator's add (mul.rn in the PTX: an FMA there would round once instead of
    twice); at one row at most 7 FP32-pipe instructions per weight element in the main loop
    (measured 5.5-6.2 on the real shapes: 4 for the chained exact split, 1 for the weight's E4M3
    -> FP32 conversion, the rest for the activation's, the block sums and the block terms), and
    with the FP64 block sums (`ExactConfig.f64`, the 1-row plans of the fused wq_a|wkv and wo_b)
    one DFMA per weight element and row (0.94: the chains' first products are DMULs) and 0.56
    FP32-pipe instructions (the terms); the
    epilogue's rotation as explicitly rounded PTX (`kv_write.rope_rotate`), no FP32 op that flushes
    subnormals. wo_b's 1-row plans (FP64 and FP32 sums) with the mHC boundary epilogue
    (`--boundary`) under their register caps (`exact_mm_plan._BOUNDARY_MAXNREG`): no spills, the plain
    kernel's registers as allocated (88 a thread against 84, and 96 against 96: the same 8-register
    allocation unit, so the same programs an SM), the K loop's FP32 instructions as without it."""
    out, rows = compile_script(Path(__file__).with_name("_exact_mm_sm90.py"), "--json")
    assert rows, out
    assert len(rows) == 8 and sum(r["rope"] for r in rows) == 2 and sum(r["boundary"] for r in rows) == 2, out
    for r in rows:
        assert r["LOCAL"] == 0 and r["spills"] == 0, r
        assert r["LDGSTS"] > 0 and r["mul_rn"], r
        assert r["rotation"] == r["rope"] and not r["ftz"], r
        if r["rows"] == 1 and not r["boundary"]:
            assert r["fp32_per_elem_row"] <= 7, r
        if r["config"].count(":") == 6 and not r["boundary"]:    # f64: the block sums on DFMAs
            assert 0.9 <= r["dfma_per_elem_row"] <= 1.0 and r["fp32_per_elem_row"] < 1, r
    # wo_b's 1-row plans (FP64 sums: rows[0]'s configuration, the fused wq_a|wkv's; FP32: rows[1])
    # with the boundary epilogue, under the launch's register cap: the plain kernel's registers as
    # allocated (8 a thread at a time: its occupancy), the K loop's FP32 instructions unchanged and
    # its length within 3 %
    for fused in rows[-2:]:
        plain = next(r for r in rows[:2] if r["config"] == fused["config"])
        assert fused["boundary"] and not plain["boundary"], (plain, fused)
        assert -(-fused["REG"] // 8) == -(-plain["REG"] // 8), (plain, fused)
        assert fused["k_loop_fp32"] == plain["k_loop_fp32"], (plain, fused)
        assert abs(fused["k_loop"] - plain["k_loop"]) <= 0.03 * plain["k_loop"], (plain, fused)


@pytest.mark.gpu
@pytest.mark.parametrize("name,n,k", [s for s in FLASH_SHAPES if s[0] in ("fused_wqa_wkv", "wq_b", "wq_b_tp8", "wo_b")],
                         ids=["fused_wqa_wkv", "wq_b", "idx_wq_b", "wo_b"])
def test_flash_shapes_on_gpu(name, n, k):
    _, _, codes_all, sx_all, weight, w_scale = linear_operands(_gen(n + k), 64, n, k)
    plan = ExactMM(weight, w_scale)
    rows = (1, 2, 3, 4, 16, 64)
    # every row bucket of the tuned plan runs (FP64 block sums at 1-2 rows on an H200)
    assert {plan.launch_for(m).config for m in rows} == {plan.launch_for(m).config for m in range(1, 65)}, name
    for m in rows:
        codes, x_scale = codes_all[:m], sx_all[:m]
        for dtype in (torch.bfloat16, torch.float32):
            y = plan(codes, x_scale, _poisoned(m, n, dtype))
            ref = mxfp8_mm(codes, x_scale, weight, w_scale, dtype)
            assert torch.equal(_bits(y), _bits(ref)), (name, m, dtype, int((_bits(y) != _bits(ref)).sum()))
    # K split over programs (the tile's last one adds the terms): the same bits, counters back at 0.
    split = ExactMM(weight, w_scale, config=ExactConfig(block_n=8, block_k=256, rows=4, num_warps=2, split=3))
    for m in (1, 3):
        for _ in range(2):
            y = split(codes_all[:m], sx_all[:m], _poisoned(m, n))
            assert torch.equal(_bits(y), _bits(mxfp8_mm(codes_all[:m], sx_all[:m], weight, w_scale))), (name, m)
        assert int(split._counters.abs().sum()) == 0
    # Heavy-tailed codes, where an inexact block sum shows, at 1, 2 and 4 rows (the buckets of their
    # own plans) and 16.
    codes, x_scale, weight, w_scale = _exact_operands(_gen(n), 16, n, k, "heavy")
    heavy, ref = ExactMM(weight, w_scale), mxfp8_mm(codes, x_scale, weight, w_scale)
    for m in (1, 2, 4, 16):
        assert torch.equal(_bits(heavy(codes[:m], x_scale[:m])), _bits(ref[:m])), (name, m)


WQ_B_SHAPES = [s for s in FLASH_SHAPES if s[0].startswith("wq_b")]


@pytest.mark.gpu
@pytest.mark.parametrize("name,n,k", WQ_B_SHAPES, ids=[s[0] for s in WQ_B_SHAPES])
def test_rope_epilogue_on_gpu(name, n, k):
    # At wq_b and its TP shards, the planned configurations (every row bucket) and a K split: the
    # epilogue's inline-PTX rotation (the kernel compiles with fp fusion on) gives the bits of the
    # call without it followed by `query_rope_`, at 1-5, 16 and 64 rows; the split's counters reset.
    _, _, codes, x_scale, weight, w_scale = linear_operands(_gen(n + k + 2), 64, n, k)
    cos, sin = rope_operands(_gen(17), 64)
    split = ExactConfig(block_n=8, block_k=256, rows=4, num_warps=2, split=3)
    for plan in (ExactMM(weight, w_scale), ExactMM(weight, w_scale, config=split)):
        plain = plan(codes, x_scale)
        for m in (1, 2, 3, 4, 5, 16, 64):
            check_rope(plan, codes[:m], x_scale[:m], cos[:m], sin[:m], plain[:m], (name, plan.launch_for(m), m))
        assert int(plan._counters.abs().sum()) == 0


@pytest.mark.gpu
def test_boundary_epilogue_at_wo_b_on_gpu():
    # wo_b (5120 x 8192) at dim 5120 with the step's plan (chunks of 512 columns): the planned
    # configurations at 1-4 rows (on a GPU with full-rate FP64 its FP64 block sums at 1-2 rows, else
    # `_TUNED_FP32`'s: at 1 row 4-column tiles, 128 a chunk, under the register cap; both run here)
    # and a K split over 3 programs, each twice with new operands on one plan (the counters reset):
    # bitwise the call without the epilogue followed by mhc_boundary_.
    n, k = 5120, 8192
    _, _, codes, x_scale, weight, w_scale = linear_operands(_gen(n + k + 3), 4, n, k)
    split = ExactConfig(block_n=8, block_k=256, rows=4, num_warps=2, split=3)
    fp32 = {b: planned_config(n, k, b, num_sms(weight.device), fp64=False) for b in (1, 2, 4, 64)}
    assert not fp32[1].f64 and fp32[1].block_n == 4, fp32[1]
    for plan in (ExactMM(weight, w_scale), ExactMM(weight, w_scale, config=fp32), ExactMM(weight, w_scale, config=split)):
        plain = plan(codes, x_scale)
        for m in (1, 2, 3, 4):
            ops = boundary_operands(_gen(30 + m), m, n)
            for seed in (0, 1):
                again = dataclasses.replace(boundary_operands(_gen(40 + seed), m, n), plan=ops.plan)
                check_boundary(plan, codes[:m], x_scale[:m], again, plain[:m], (plan.launch_for(m), m, seed))
        assert int(plan._counters.abs().sum()) == 0
