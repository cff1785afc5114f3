"""ops.exact_int8_mm against reference.linear.mxfp8_mm: bitwise (BF16 and FP32 outputs), in the
interpreter at small shapes and on the GPU at the V4.1-Flash shapes, with and without the weight's
digit planes; the digit decomposition itself over every E4M3 code; per-row configurations; the
argument errors; the sm_90 build.

No tolerance anywhere: the op computes the contract's arithmetic exactly (each 32-block's dot as
integer MMAs, rounded once to FP32; the block terms scaled and added in K order; one rounding to
BF16), so any difference from the reference is a bug. The operands are the ones of
tests/ops/test_exact_mm.py, on which a plain FP32 block sum is not the exactly rounded one (checked
there, `test_data_defeats_a_plain_fp32_block_sum`).
"""

from pathlib import Path

import pytest
import torch
from helpers import FLASH_LINEAR_SHAPES as FLASH_SHAPES
from helpers import check_mxfp8_plan_errors, compile_script, linear_operands, raises
from test_exact_mm import _bits, _exact_operands, _gen, _poisoned

from dsv41_decode.ops.exact_int8_mm import _INT8_PLAN, ExactInt8MM, Int8Config, weight_digits
from dsv41_decode.reference.linear import mxfp8_mm

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_digits_rebuild_every_code():
    # 2^9 * value = X0 + 2^7 X1 + 2^14 X2 for each of the 254 finite E4M3 codes, |Xi| <= 127.
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F].view(torch.float8_e4m3fn)
    d = weight_digits(codes[:, None]).long()[..., 0]                      # [3, 254]
    assert int(d.abs().max()) <= 127
    assert torch.equal(d[0] + 128 * d[1] + 16384 * d[2], (codes.double() * 512).long())


@pytest.mark.parametrize("m,n,k,cfg,digits,kind", [
    (1, 40, 256, Int8Config(block_n=16, block_m=16), False, "heavy"),
    (3, 70, 384, Int8Config(block_n=32, block_m=16), True, "uniform"),
    (20, 40, 128, Int8Config(block_n=16, block_m=16), False, "uniform"),        # two row tiles
    (5, 40, 256, Int8Config(block_n=16, block_m=32), True, "heavy"),
    (6, 64, 256, None, True, "quantized"),
    (3, 40, 256, Int8Config(block_n=16, block_m=16, pairs=True), True, "heavy"),       # two blocks a step
    (20, 24, 128, Int8Config(block_n=16, block_m=16, pairs=True), True, "uniform"),
])
def test_bitwise_equal_to_the_reference(m, n, k, cfg, digits, kind):
    if kind == "quantized":   # MXFP8 activations and a block-quantized weight, as the model has them
        _, _, codes, x_scale, weight, w_scale = linear_operands(_gen(m + n + k), m, n, k)
    else:
        codes, x_scale, weight, w_scale = _exact_operands(_gen(m + n + k), m, n, k, kind)
    plan = ExactInt8MM(weight, w_scale, max_rows=32, config=cfg, digits=digits)
    for dtype in (torch.bfloat16, torch.float32):
        y = plan(codes, x_scale, _poisoned(m, n, dtype))
        ref = mxfp8_mm(codes, x_scale, weight, w_scale, dtype)
        assert torch.equal(_bits(y), _bits(ref)), (m, n, k, cfg, digits, kind, dtype)


def test_per_row_configurations_give_the_same_bits():
    # Per row count configurations (`{most rows: Int8Config}`): each call launches its own, same bits.
    m, n, k = 6, 40, 128
    codes, x_scale, weight, w_scale = _exact_operands(_gen(5), m, n, k, "uniform")
    together = mxfp8_mm(codes, x_scale, weight, w_scale)
    per_rows = ExactInt8MM(weight, w_scale, max_rows=8, config={2: Int8Config(block_n=16, pairs=True),
                                                                8: Int8Config(block_n=32)})
    assert [per_rows.config_for(m).block_n for m in (1, 2, 3, 8)] == [16, 16, 32, 32]
    assert torch.equal(_bits(per_rows(codes, x_scale)), _bits(together))
    assert torch.equal(_bits(per_rows(codes[:2], x_scale[:2])), _bits(together[:2]))
    assert per_rows.reduction_order(1) == per_rows.reduction_order(6)


def test_bad_inputs_name_the_argument():
    m, n, k = 2, 64, 128
    _, _, codes, x_scale, weight, w_scale = linear_operands(_gen(8), m, n, k)
    check_mxfp8_plan_errors(ExactInt8MM, codes, x_scale, weight, w_scale)
    raises("config must be an Int8Config", lambda: ExactInt8MM(weight, w_scale, config="fast"))
    raises("config must be an Int8Config or a dict", lambda: ExactInt8MM(weight, w_scale, config={64: "fast"}))
    raises(r"config must cover max_rows=64 rows, got keys \[16\]", lambda: ExactInt8MM(weight, w_scale,
                                                                                  config={16: Int8Config()}))
    raises("block_n must be 16, 32, 64 or 128", lambda: Int8Config(block_n=24))
    raises("block_m must be 16, 32 or 64", lambda: Int8Config(block_m=8))
    raises("num_warps must be a positive int", lambda: Int8Config(num_warps=0))
    raises("pairs must be a bool", lambda: Int8Config(pairs=1))
    raises(r"pairs=True\) needs K / 32 even and digits=True", lambda: ExactInt8MM(weight[:, :96], w_scale[:, :3],
                                                                              config=Int8Config(pairs=True)))
    raises(r"pairs=True\) needs K / 32 even and digits=True", lambda: ExactInt8MM(weight, w_scale, digits=False,
                                                                              config=Int8Config(pairs=True)))


def test_non_tensor_weight_and_non_bool_digits_name_the_argument():
    _, _, _, _, weight, w_scale = linear_operands(_gen(8), 2, 64, 128)
    raises("weight must be a torch.Tensor, got NoneType", lambda: weight_digits(None))
    raises("weight must be a torch.Tensor, got list", lambda: weight_digits([1, 2]))
    raises("digits must be a bool, got 'no'", lambda: ExactInt8MM(weight, w_scale, digits="no"))
    raises("digits must be a bool, got 0", lambda: ExactInt8MM(weight, w_scale, digits=0))


def test_bad_num_warps_name_the_field():
    # Triton takes a power of two: any other count would reach the compiler
    for bad in (3, 6, 32, 64):
        raises(rf"Int8Config.num_warps must be a power of two in 1..16, got {bad}", lambda: Int8Config(num_warps=bad))


def test_compiles_for_sm90_without_spills():
    """The plans' configurations (`_INT8_PLAN`, `Int8Config()`) with digit planes, the default with
    codes decoded in the kernel, and a wgmma one (64 x rows), compiled for sm_90 by Triton's own ptxas in a subprocess without the
    interpreter (tests/ops/_exact_int8_mm_sm90.py): no local memory, no spill stores or loads, the
    integer MMA in the SASS (IMMA: mma.sync s8; IGMMA: wgmma s8), and the block terms' last multiply
    kept apart from the accumulator's add (mul.rn)."""
    out, rows = compile_script(Path(__file__).with_name("_exact_int8_mm_sm90.py"), "--json")
    assert len(rows) == 2 + len({c for _, t in _INT8_PLAN.values() for c in t.values()} | {Int8Config()}), out
    for r in rows:
        assert r["LOCAL"] == 0 and r["spills"] == 0, r
        assert r["int_mma"] > 0 and r["mul_rn"], r


@pytest.mark.gpu
@pytest.mark.parametrize("name,n,k", [s for s in FLASH_SHAPES if s[0] in ("fused_wqa_wkv", "wq_b", "wq_b_tp8", "wo_b")],
                         ids=["fused_wqa_wkv", "wq_b", "idx_wq_b", "wo_b"])
def test_flash_shapes_on_gpu(name, n, k):
    _, _, codes_all, sx_all, weight, w_scale = linear_operands(_gen(n + k), 64, n, k)
    for cfg in (None, Int8Config(pairs=True), Int8Config(block_n=32, block_m=64)):   # mma.sync, wgmma
        for digits in (False, True) if cfg is None or not cfg.pairs else (True,):
            plan = ExactInt8MM(weight, w_scale, config=cfg, digits=digits)
            for m in (1, 5, 16, 33, 64):
                for dtype in (torch.bfloat16, torch.float32):
                    y = plan(codes_all[:m], sx_all[:m], _poisoned(m, n, dtype))
                    ref = mxfp8_mm(codes_all[:m], sx_all[:m], weight, w_scale, dtype)
                    assert torch.equal(_bits(y), _bits(ref)), (name, cfg, digits, m, dtype)
    for cfg in {c for c in _INT8_PLAN[(n, k)][1].values()}:     # the op's measured best per shape
        y = ExactInt8MM(weight, w_scale, config=cfg)(codes_all, sx_all)
        assert torch.equal(_bits(y), _bits(mxfp8_mm(codes_all, sx_all, weight, w_scale))), (name, cfg)
    # Heavy-tailed codes, where an inexact block sum shows.
    codes, x_scale, weight, w_scale = _exact_operands(_gen(n), 40, n, k, "heavy")
    y = ExactInt8MM(weight, w_scale)(codes, x_scale)
    assert torch.equal(_bits(y), _bits(mxfp8_mm(codes, x_scale, weight, w_scale))), name
