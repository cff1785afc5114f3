"""ops.exact_f64_mm against reference.linear.mxfp8_mm: bitwise (BF16 and FP32 outputs), in the
interpreter at small shapes (row tiles, partial tiles, K splits) and on the GPU at the V4.1-Flash
shapes against `ExactMM`; the codes' conversion to FP64 over every finite E4M3 code; the argument
errors; the sm_90 build (DMMA, no spills).

No tolerance anywhere: the op computes the contract's arithmetic exactly (each 32-block's dot an
exact FP64 MMA, rounded once to FP32; the block terms scaled and added in K order; one rounding to
BF16), so any difference from the reference is a bug. The operands are the ones of
tests/ops/test_exact_mm.py, on which a plain FP32 block sum is not the exactly rounded one (checked
there, `test_data_defeats_a_plain_fp32_block_sum`): model-like (MXFP8 activations, block-quantized
weight), heavy-tailed (448 down to the subnormals) and uniform over every byte (-0 and the
subnormals included; the NaN codes replaced).
"""

from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl
from helpers import FLASH_LINEAR_SHAPES as FLASH_SHAPES
from helpers import check_mxfp8_plan_errors, compile_script, linear_operands, raises
from test_exact_mm import _bits, _exact_operands, _gen, _poisoned

from dsv41_decode.formats import mxfp8_quantize
from dsv41_decode.ops.exact_f64_mm import _DEFAULT_CONFIGS, ExactF64MM, F64Config, _e4m3_f64
from dsv41_decode.ops.exact_mm import ExactMM
from dsv41_decode.reference.linear import mxfp8_mm

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@triton.jit
def _convert_kernel(w_ptr, y_ptr):
    # y[8 i + j] = the FP64 value of byte j of word i (32 words)
    r = tl.arange(0, 32)
    words = tl.load(w_ptr + r)
    for j in tl.static_range(8):
        tl.store(y_ptr + 8 * r + j, _e4m3_f64(words, j))


def test_conversion_of_every_code():
    # The FP64 value of each of the 254 finite E4M3 codes (-0 and the subnormals included), bitwise
    # torch's; the codes in every byte position of a word (each code at 8 positions).
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F]
    for roll in range(8):
        bytes_ = torch.cat([codes, codes[:2]]).roll(roll).to(DEVICE)            # 256: 32 words
        y = torch.empty(256, dtype=torch.float64, device=DEVICE)
        _convert_kernel[(1,)](bytes_.view(torch.int64), y)
        want = bytes_.view(torch.float8_e4m3fn).double()
        assert torch.equal(y.view(torch.int64), want.view(torch.int64)), roll


@pytest.mark.parametrize("m,n,k,cfg,kind", [
    (1, 40, 256, F64Config(block_n=16, block_m=8, num_warps=1), "heavy"),
    (3, 70, 128, F64Config(block_n=32, block_m=8, num_warps=1), "uniform"),
    (37, 24, 64, F64Config(block_n=16, block_m=16, num_warps=1), "uniform"),      # three row tiles
    (37, 24, 64, F64Config(block_n=16, block_m=32, num_warps=1), "heavy"),        # x's bytes joined
    (6, 64, 128, None, "quantized"),
    (3, 40, 192, F64Config(block_n=16, block_m=8, num_warps=1, split=4), "heavy"),  # K split: 2+2+2
    (1, 24, 160, F64Config(block_n=16, block_m=8, num_warps=1, split=3), "uniform"),  # 2+2+1
])
def test_bitwise_equal_to_the_reference(m, n, k, cfg, kind):
    if kind == "quantized":   # MXFP8 activations and a block-quantized weight, as the model has them
        _, _, codes, x_scale, weight, w_scale = linear_operands(_gen(m + n + k), m, n, k)
    else:
        codes, x_scale, weight, w_scale = _exact_operands(_gen(m + n + k), m, n, k, kind)
    plan = ExactF64MM(weight, w_scale, max_rows=64, config=cfg)
    for dtype in (torch.bfloat16, torch.float32):
        # out: a window of a larger poisoned buffer, whose rows past M and columns past N (a
        # partial tile's padding) must stay untouched
        buf = _poisoned(m + 8, n + 8, dtype)
        y = plan(codes, x_scale, buf[:m, :n])
        ref = mxfp8_mm(codes, x_scale, weight, w_scale, dtype)
        assert torch.equal(_bits(y), _bits(ref)), (m, n, k, cfg, kind, dtype)
        assert buf[m:].isnan().all() and buf[:, n:].isnan().all(), (m, n, k, cfg, kind, dtype)
    assert int(plan._counters.abs().sum()) == 0     # split launches leave their counters at zero


def test_non_finite_blocks_give_nan():
    # The quantizers write the NaN code 0x7F only into a non-finite block, with scale byte 255: the
    # op reads the code as 480 (module docstring), and the NaN scale makes the output NaN, as the
    # reference's.
    m, n, k = 2, 24, 64
    _, _, weight, w_scale = _exact_operands(_gen(9), m, n, k, "uniform")
    x = torch.randn(m, k, generator=_gen(9)).to(torch.bfloat16)
    x[0, 3], x[1, 40] = float("nan"), float("inf")
    codes, x_scale = (t.to(weight.device) for t in mxfp8_quantize(x))
    assert int(codes.view(torch.uint8)[0, 0]) == 0x7F and int(x_scale[0, 0]) == 255
    y = ExactF64MM(weight, w_scale, config=F64Config(block_n=16, block_m=8, num_warps=1))(codes, x_scale)
    assert y.isnan().all() and mxfp8_mm(codes, x_scale, weight, w_scale).isnan().all()


def test_rows_and_configs_give_the_same_bits():
    # Per row count configurations (`{most rows: F64Config}`): each call launches its own; a row
    # gives the same bits alone (a K split) and among others (row tiles), from a row view whose
    # stride is not a multiple of 8 bytes.
    m, n, k = 5, 40, 128
    codes, x_scale, weight, w_scale = _exact_operands(_gen(5), m, n, k, "uniform")
    plan = ExactF64MM(weight, w_scale, max_rows=8, config={1: F64Config(block_n=16, block_m=8, num_warps=1, split=2),
                                                           8: F64Config(block_n=32, block_m=8, num_warps=1)})
    assert [plan.config_for(r).block_n for r in (1, 2, 8)] == [16, 32, 32]
    together = plan(codes, x_scale)
    assert torch.equal(_bits(together), _bits(mxfp8_mm(codes, x_scale, weight, w_scale)))
    for i in (0, 4):
        buf = torch.zeros(2 * k + 8, dtype=torch.uint8, device=codes.device)
        buf[8:8 + k] = codes[i].view(torch.uint8)
        row = buf.as_strided((1, k), (k + 3, 1), 8).view(torch.float8_e4m3fn)     # row stride k + 3
        assert torch.equal(_bits(plan(row, x_scale[i:i + 1])), _bits(together[i:i + 1])), i
    assert plan.reduction_order(1) == plan.reduction_order(5) == ("exact", k, 32)


def test_bad_inputs_name_the_argument():
    m, n, k = 2, 64, 128
    _, _, codes, x_scale, weight, w_scale = linear_operands(_gen(8), m, n, k)
    check_mxfp8_plan_errors(ExactF64MM, codes, x_scale, weight, w_scale)
    raises("config must be an F64Config", lambda: ExactF64MM(weight, w_scale, config="fast"))
    raises("config must be an F64Config or a dict", lambda: ExactF64MM(weight, w_scale, config={64: "fast"}))
    raises(r"config must cover max_rows=64 rows, got keys \[16\]",
           lambda: ExactF64MM(weight, w_scale, config={16: F64Config()}))
    raises("block_n must be 16, 32, 64 or 128", lambda: F64Config(block_n=24))
    raises("block_m must be 8, 16, 32 or 64", lambda: F64Config(block_m=4))
    raises("num_warps must be a positive int", lambda: F64Config(num_warps=0))
    raises("split must be a positive int", lambda: F64Config(split=True))
    # 8-byte words: the weight's and the codes' start and row stride
    flat = torch.zeros(n * k + 8, dtype=torch.uint8, device=weight.device)
    shifted = flat[4:4 + n * k].view(n, k).view(torch.float8_e4m3fn)
    raises("weight must start on an 8-byte boundary", lambda: ExactF64MM(shifted, w_scale))
    plan = ExactF64MM(weight, w_scale, max_rows=8)
    raises("codes must start on an 8-byte boundary", lambda: plan(shifted[:m], x_scale))
    strided = torch.zeros(m, k + 4, dtype=torch.uint8, device=codes.device)[:, :k].view(torch.float8_e4m3fn)
    raises("codes must start on an 8-byte boundary with a row stride a multiple of 8",
           lambda: plan(strided, x_scale))


def test_bad_num_warps_name_the_field():
    # Triton takes a power of two: any other count would reach the compiler
    for bad in (3, 6, 32, 64):
        raises(rf"F64Config.num_warps must be a power of two in 1..16, got {bad}", lambda: F64Config(num_warps=bad))


def test_compiles_for_sm90_without_spills():
    """The kernel in the plans' default configurations, a wider tile and a K split
    (tests/ops/_exact_f64_mm_sm90.py), compiled for sm_90 by Triton's own ptxas in a subprocess without the
    interpreter: no stack or local memory, no spill stores or loads, the FP64 MMA (DMMA) in the
    main loop, the block partial's one FP64 -> FP32 rounding (cvt.rn) and the block terms' last
    multiply kept apart from the accumulator's add (mul.rn)."""
    out, rows = compile_script(Path(__file__).with_name("_exact_f64_mm_sm90.py"), "--json")
    assert len(rows) == len(_DEFAULT_CONFIGS) + 2, out
    for r in rows:
        assert r["STACK"] == 0 and r["LOCAL"] == 0 and r["spills"] == 0, r
        assert r["loop_dmma"] > 0 and r["cvt_rn"] and r["mul_rn"], r


@pytest.mark.gpu
@pytest.mark.parametrize("name,n,k", [s for s in FLASH_SHAPES if s[0] in ("fused_wqa_wkv", "wq_b", "wq_b_tp8", "wo_b")],
                         ids=["fused_wqa_wkv", "wq_b", "idx_wq_b", "wo_b"])
def test_flash_shapes_on_gpu(name, n, k):
    # Bitwise ExactMM (the reference's bits, tested there) at 1, 8, 16, 32 and 64 rows, in each of
    # the default configurations (8, 16, 32, 64 rows a tile), a K split (calls of up to 8 rows) and
    # 128 weight rows a program.
    _, _, codes_all, sx_all, weight, w_scale = linear_operands(_gen(n + k), 64, n, k)
    exact = ExactMM(weight, w_scale)
    configs = (None, F64Config(block_n=32, block_m=8, num_warps=2, split=4), F64Config(block_n=128, block_m=16))
    for cfg in configs:
        plan = ExactF64MM(weight, w_scale, config=cfg)
        for m in (1, 8, 16, 32, 64):
            for dtype in (torch.bfloat16, torch.float32):
                y = plan(codes_all[:m], sx_all[:m], _poisoned(m, n, dtype))
                ref = exact(codes_all[:m], sx_all[:m], _poisoned(m, n, dtype))
                assert torch.equal(_bits(y), _bits(ref)), (name, cfg, m, dtype)
        assert int(plan._counters.abs().sum()) == 0
    # Heavy-tailed and uniform codes (subnormals, -0, 448), where an inexact block sum shows, in
    # each default configuration (8, 16, 32 and 64 rows a tile; the x conversion differs by tile).
    for kind in ("heavy", "uniform"):
        codes, x_scale, weight, w_scale = _exact_operands(_gen(n), 40, n, k, kind)
        plan, ref = ExactF64MM(weight, w_scale), mxfp8_mm(codes, x_scale, weight, w_scale)
        for m in (1, 8, 16, 32, 40):
            assert torch.equal(_bits(plan(codes[:m], x_scale[:m])), _bits(ref[:m])), (name, kind, m)
