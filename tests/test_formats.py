"""dsv41_decode.formats against spec section 6, bit for bit.

The expected codes come from an independent oracle (tests/helpers.py): the scale exponent from an exact
float64 product and frexp, and round-to-nearest-even by searching the sorted table of every
representable value (ties to the even code), instead of the module's bit tricks and comparisons.
"""

from __future__ import annotations

import math

import pytest
import torch

from dsv41_decode import formats as fm
from dsv41_decode.records import pack_window_kv
from helpers import (
    E4M3_GRID,
    E2M1_GRID,
    finite_e4m3_bytes,
    ref_e4m3_bytes,
    ref_e2m1_codes,
    ref_ceil_log2_scale,
    ref_mx,
    ref_nvfp4,
    unpack_nibbles,
    raw_bits,
    varied,
)


# --- torch's E4M3 cast ----------------------------------------------------------------------------


def _e4m3_midpoints() -> torch.Tensor:
    """Midpoints between adjacent non-negative E4M3 values (exact in FP32)."""
    return ((E4M3_GRID[:-1] + E4M3_GRID[1:]) / 2).float()


def test_torch_e4m3_cast_rounds_midpoints_to_even():
    mid = _e4m3_midpoints()
    mid = torch.cat((mid, -mid))
    got = mid.to(torch.float8_e4m3fn).view(torch.uint8)
    assert torch.equal(got, ref_e4m3_bytes(mid))
    # Sanity of the oracle: every midpoint lands on an even byte (the grid index is the byte).
    assert torch.all(got & 1 == 0)


def test_torch_e4m3_cast_rounds_near_midpoints_to_nearest():
    mid = _e4m3_midpoints()
    for toward in (0.0, math.inf):
        v = torch.nextafter(mid, torch.full_like(mid, toward))
        v = torch.cat((v, -v))
        assert torch.equal(v.to(torch.float8_e4m3fn).view(torch.uint8), ref_e4m3_bytes(v))


# --- UE8M0 and the scale rule ---------------------------------------------------------------------


def test_ue8m0_every_byte():
    b = torch.arange(256, dtype=torch.uint8)
    got = fm.ue8m0_decode(b)
    expected = torch.tensor([math.ldexp(1.0, i - 127) for i in range(255)], dtype=torch.float32)
    assert torch.equal(raw_bits(got[:255]), raw_bits(expected))
    assert torch.isnan(got[255])
    assert torch.equal(raw_bits(fm.ue8m0_decode(b.view(torch.float8_e8m0fnu))), raw_bits(got))
    # Byte 0 decodes to the FP32 subnormal 2^-127: the bit rule reads it back through its subnormal path.
    k = fm.pow2_ceil_scale(got[:255], 1.0)
    assert torch.equal(k, torch.arange(-127, 128, dtype=torch.int32))
    assert torch.equal(fm.ue8m0_encode_exponent(k), b[:255])


def test_ue8m0_encode_exponent_rejects_out_of_range():
    with pytest.raises(ValueError, match=r"e must lie in \[-127, 127\].*128"):
        fm.ue8m0_encode_exponent(torch.tensor([0, 128]))
    with pytest.raises(ValueError, match=r"-128"):
        fm.ue8m0_encode_exponent(torch.tensor([-128, 3]))
    with pytest.raises(TypeError, match="e must be an integer tensor"):
        fm.ue8m0_encode_exponent(torch.tensor([1.0]))


@pytest.mark.parametrize("qmax", [448.0, 6.0])
def test_scale_rule_at_and_just_above_powers_of_two(qmax):
    k = torch.arange(-20, 21, dtype=torch.float64)
    at = (qmax * 2.0**k).float()
    above = torch.nextafter(at, torch.full_like(at, math.inf))
    below = torch.nextafter(at, torch.zeros_like(at))
    ks = k.to(torch.int32)
    assert torch.equal(fm.pow2_ceil_scale(at, 1.0 / qmax), ks)
    assert torch.equal(fm.pow2_ceil_scale(above, 1.0 / qmax), ks + 1)
    assert torch.equal(fm.pow2_ceil_scale(below, 1.0 / qmax), ks)


def test_scale_rule_matches_exact_ceil_log2_on_random_bits():
    g = torch.Generator().manual_seed(1)
    # Random positive finite FP32 bit patterns, normal and subnormal, plus subnormal edges.
    bits = torch.randint(1, 0x7F000000, (50000,), generator=g, dtype=torch.int64)
    sub = torch.randint(1, 1 << 23, (5000,), generator=g, dtype=torch.int64)
    edges = torch.tensor([1, 2, 3, 4, 5, (1 << 22) - 1, 1 << 22, (1 << 22) + 1, (1 << 23) - 1, 1 << 23])
    amax = torch.cat((bits, sub, edges)).to(torch.int32).view(torch.float32)
    for inv_qmax in (1.0, 1.0 / 448, 1.0 / 6):
        got = fm.pow2_ceil_scale(amax, inv_qmax)
        live = amax.double() * float(torch.tensor(inv_qmax, dtype=torch.float32)) >= 2.0**-149
        assert torch.equal(got[live], ref_ceil_log2_scale(amax, inv_qmax)[live])
    # ceil(log2(m * 2^-149)) for subnormal p = m * 2^-149, checked with integer arithmetic.
    m = torch.cat((sub, edges[:-1]))
    expected = torch.tensor([(int(v) - 1).bit_length() - 149 for v in m], dtype=torch.int32)
    assert torch.equal(fm.pow2_ceil_scale(m.to(torch.int32).view(torch.float32), 1.0), expected)


# --- E2M1 -----------------------------------------------------------------------------------------


def test_e2m1_every_code():
    codes = torch.arange(16, dtype=torch.uint8)
    values = fm.e2m1_decode(codes)
    grid = E2M1_GRID.float()
    assert torch.equal(values, torch.cat((grid, -grid)))
    assert torch.equal(torch.signbit(values), codes >= 8)  # code 8 is -0.0
    assert torch.equal(fm.e2m1_encode(values), codes)
    assert fm.e2m1_decode(fm.e2m1_encode(torch.tensor(-2.9))) == -3.0  # 0-d tensors work too


def test_e2m1_rounds_midpoints_to_even():
    mid = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    expected = torch.tensor([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0])  # spec section 6
    for sign in (1.0, -1.0):
        assert torch.equal(fm.e2m1_decode(fm.e2m1_encode(sign * mid)), sign * expected)
    for toward in (0.0, math.inf):
        v = torch.nextafter(mid, torch.full_like(mid, toward))
        v = torch.cat((v, -v))
        assert torch.equal(fm.e2m1_encode(v), ref_e2m1_codes(v))


def test_e2m1_encode_matches_oracle_and_saturates():
    g = torch.Generator().manual_seed(2)
    v = torch.cat((torch.randn(20000, generator=g) * 3, torch.tensor([6.0, 7.0, 1e30, -6.5, -math.inf])))
    assert torch.equal(fm.e2m1_encode(v), ref_e2m1_codes(v))
    assert torch.equal(fm.e2m1_encode(torch.tensor([7.0, -1e30])), torch.tensor([7, 15], dtype=torch.uint8))
    nan = torch.tensor([math.nan, -math.nan])
    assert torch.equal(fm.e2m1_encode(nan), torch.zeros(2, dtype=torch.uint8))


def test_e2m1_decode_rejects_bad_codes():
    with pytest.raises(ValueError, match="codes must lie in 0..15.*16"):
        fm.e2m1_decode(torch.tensor([3, 16], dtype=torch.uint8))
    with pytest.raises(TypeError, match="codes must have dtype torch.uint8"):
        fm.e2m1_decode(torch.tensor([3, 4]))


# --- MXFP8 ----------------------------------------------------------------------------------------


def _blocks_with_anchor(values: torch.Tensor, anchor: float, block: int) -> torch.Tensor:
    """values laid out block - 1 to a block after an anchor element that sets each block's amax."""
    per = block - 1
    n = -(-len(values) // per)
    body = torch.zeros(n * per, dtype=values.dtype)
    body[: len(values)] = values
    body = body.reshape(n, per)
    return torch.cat((torch.full((n, 1), anchor, dtype=values.dtype), body), dim=1)


@pytest.mark.parametrize("k", [-20, -1, 0, 7])
def test_mxfp8_every_code_round_trips_with_fixed_scale(k):
    codes = finite_e4m3_bytes()
    values = codes.view(torch.float8_e4m3fn).float() * 2.0**k
    x = _blocks_with_anchor(values, 448.0 * 2.0**k, 32)  # amax 448 * 2^k: scale 2^k exactly
    got_codes, scales = fm.mxfp8_quantize(x)
    assert torch.all(scales == 127 + k)
    assert torch.equal(got_codes[:, 1:].reshape(-1)[: len(codes)].view(torch.uint8), codes)
    assert torch.equal(raw_bits(fm.mxfp8_dequantize(got_codes, scales)), raw_bits(x))
    assert torch.equal(raw_bits(fm.mxfp8_fake(x.bfloat16())), raw_bits(x.bfloat16()))


def test_mxfp8_rounds_midpoints_to_even():
    mid = _e4m3_midpoints() * 2.0**-3
    mid = torch.cat((mid, -mid))
    x = _blocks_with_anchor(mid, 448.0 * 2.0**-3, 32)
    codes, scales = fm.mxfp8_quantize(x)
    assert torch.all(scales == 127 - 3)
    got = codes[:, 1:].reshape(-1)[: len(mid)].view(torch.uint8)
    assert torch.equal(got, ref_e4m3_bytes(mid * 8.0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_mxfp8_matches_oracle_on_varied_data(dtype):
    x = varied((6, 4, 256), seed=3, dtype=dtype, decades=4 if dtype == torch.float16 else 30)
    assert torch.isfinite(x).all()
    codes, scales = fm.mxfp8_quantize(x)
    ref_codes, ref_scales = ref_mx(x, 32, fm.MXFP8_AMAX_FLOOR, 448.0, ref_e4m3_bytes)
    assert codes.dtype == torch.float8_e4m3fn and codes.shape == x.shape
    assert scales.dtype == torch.uint8 and scales.shape == (6, 4, 8)
    assert torch.equal(scales, ref_scales)
    assert torch.equal(codes.view(torch.uint8), ref_codes)


def test_mxfp8_amax_floor():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(3, 96, generator=g)
    x[0, :32] = 0.0  # all zero
    x[1, 32:64] = torch.randn(32, generator=g) * 1e-7  # nonzero, below the 1e-4 floor
    codes, scales = fm.mxfp8_quantize(x)
    floor_byte = 127 + math.ceil(math.log2(1e-4 / 448))  # 2^-22 covers 1e-4 / 448
    assert scales[0, 0] == floor_byte and scales[1, 1] == floor_byte
    out = fm.mxfp8_dequantize(codes, scales)
    assert not torch.isnan(out).any()
    assert torch.equal(out[0, :32], torch.zeros(32))
    expected_tiny = ref_e4m3_bytes(x[1, 32:64] * 2.0**22).view(torch.float8_e4m3fn).float() * 2.0**-22
    assert torch.equal(out[1, 32:64], expected_tiny)


def test_mxfp8_nonfinite_block_decodes_to_nan():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 64, generator=g)
    x[0, 5] = math.inf
    x[1, 40] = math.nan
    x[1, 41] = -math.nan
    out = fm.mxfp8_fake(x)
    assert torch.isnan(out[0, :32]).all() and torch.isnan(out[1, 32:]).all()
    rec = pack_window_kv(torch.cat((x, x), dim=1).repeat(1, 4))
    assert torch.all(rec[1, 32:64] == 0x7F)  # one canonical NaN code, whatever the sign of the NaN
    assert torch.all(rec[0, 512::2] == 255) and torch.all(rec[1, 513::2] == 255)
    assert not torch.isnan(out[0, 32:]).any() and not torch.isnan(out[1, :32]).any()


# --- MXFP4 and NVFP4 ------------------------------------------------------------------------------


@pytest.mark.parametrize("k", [-126, -3, 0, 9])
def test_mxfp4_every_code_round_trips_with_fixed_scale(k):
    codes = torch.arange(16, dtype=torch.uint8).repeat(2)[1:]  # 31 codes after the anchor
    values = fm.e2m1_decode(codes) * 2.0**k
    x = _blocks_with_anchor(values, 6.0 * 2.0**k, 32)  # amax 6 * 2^k: scale 2^k exactly
    packed, scales = fm.mxfp4_quantize(x)
    assert torch.all(scales == 127 + k)
    assert torch.equal(unpack_nibbles(packed)[0, 1:], codes)
    assert torch.equal(raw_bits(fm.mxfp4_dequantize(packed, scales)), raw_bits(x))


def test_mxfp4_rounds_midpoints_to_even():
    mid = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    mid = torch.cat((mid, -mid)) * 2.0**5
    x = _blocks_with_anchor(mid, 6.0 * 2.0**5, 32)
    packed, scales = fm.mxfp4_quantize(x)
    assert torch.all(scales == 127 + 5)
    got = fm.e2m1_decode(unpack_nibbles(packed)[0, 1 : 1 + len(mid)])
    expected = torch.tensor([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0])
    assert torch.equal(got, torch.cat((expected, -expected)))


def test_mxfp4_matches_oracle_on_varied_data():
    x = varied((5, 3, 128), seed=6, dtype=torch.bfloat16)
    packed, scales = fm.mxfp4_quantize(x)
    ref_codes, ref_scales = ref_mx(x, 32, fm.MXFP4_AMAX_FLOOR, 6.0, ref_e2m1_codes)
    assert packed.shape == (5, 3, 64) and scales.shape == (5, 3, 4)
    assert torch.equal(scales, ref_scales)
    assert torch.equal(unpack_nibbles(packed), ref_codes)


def test_mxfp4_amax_floor_and_tiny_values():
    g = torch.Generator().manual_seed(7)
    x = torch.randn(2, 64, generator=g)
    x[0, :32] = 0.0
    x[1, :32] = torch.randn(32, generator=g) * 2.0**-126  # FP32 subnormals and tiny normals
    packed, scales = fm.mxfp4_quantize(x)
    assert scales[0, 0] == 1 and scales[1, 0] <= 2  # floor scale 2^-126
    out = fm.mxfp4_dequantize(packed, scales)
    assert not torch.isnan(out).any()
    assert torch.equal(out[0, :32].abs(), torch.zeros(32))
    # Codes times 2^-126 reach 2^-127, a BF16 subnormal: still exact in BF16.
    assert torch.equal(raw_bits(out.bfloat16().float()), raw_bits(out))
    assert torch.count_nonzero(out[1, :32]) > 0


def test_nvfp4_every_code_round_trips_with_fixed_scale():
    codes = torch.arange(16, dtype=torch.uint8)[1:]  # 15 codes after the anchor
    for scale_byte in (0x01, 0x08, 0x38, 0x3B, 0x7E):  # 2^-9, 2^-6, 1, 1.375, 448
        s = float(torch.tensor([scale_byte], dtype=torch.uint8).view(torch.float8_e4m3fn))
        x = _blocks_with_anchor(fm.e2m1_decode(codes) * s, 6.0 * s, 16)
        packed, scales = fm.nvfp4_quantize(x)
        assert torch.all(scales.view(torch.uint8) == scale_byte)
        assert torch.equal(unpack_nibbles(packed)[0, 1:], codes)
        assert torch.equal(raw_bits(fm.nvfp4_dequantize(packed, scales)), raw_bits(x))


def test_nvfp4_matches_oracle_on_varied_data():
    x = varied((4, 2, 512), seed=8, dtype=torch.float32)
    x = x / x.abs().amax(-1, keepdim=True) * 2000.0  # inside the E4M3 scale range (amax <= 2688)
    x[0, 0, :16] = 0.0
    x[1, 1, :16] *= 1e-9
    packed, scales = fm.nvfp4_quantize(x)
    ref_codes, ref_scales = ref_nvfp4(x)
    assert packed.shape == (4, 2, 256) and scales.shape == (4, 2, 32)
    assert scales.dtype == torch.float8_e4m3fn
    assert torch.equal(scales.view(torch.uint8), ref_scales)
    assert torch.equal(unpack_nibbles(packed), ref_codes)
    assert scales.view(torch.uint8)[0, 0, 0] == 0x01  # floor: 6 * 2^-9 / 6 = 2^-9, the least E4M3 subnormal


def test_fp4_nonfinite_block_decodes_to_nan():
    g = torch.Generator().manual_seed(9)
    x = torch.randn(64, generator=g)
    x[3] = math.nan
    for fake, size in ((fm.mxfp4_fake, 32), (fm.nvfp4_fake, 16)):
        out = fake(x)
        assert torch.isnan(out[:size]).all() and not torch.isnan(out[size:]).any()


# --- FP8 checkpoint weights -----------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(70, 45), (1, 1), (33, 100), (64, 32)])
def test_fp8_block_round_trip(shape):
    g = torch.Generator().manual_seed(10)
    w = torch.randn(*shape, generator=g) * 10.0 ** torch.randint(-6, 4, shape, generator=g)
    weight, scale = fm.fp8_block_quantize(w.bfloat16())
    rows, cols = -(-shape[0] // 32), -(-shape[1] // 32)
    assert weight.dtype == torch.float8_e4m3fn and weight.shape == shape
    assert scale.dtype == torch.float8_e8m0fnu and scale.shape == (rows, cols)
    out = fm.fp8_block_dequantize(weight, scale)
    r = torch.arange(shape[0])[:, None] // 32
    c = torch.arange(shape[1])[None, :] // 32
    s = fm.ue8m0_decode(scale)[r, c]
    assert torch.equal(out, weight.float() * s)
    assert torch.equal(fm.fp8_block_dequantize(weight, scale.view(torch.uint8)), out)
    # Each tile is MXFP8 of the tile with one scale: check against the oracle tile by tile.
    wf = w.bfloat16().float()
    for i in range(rows):
        for j in range(cols):
            tile = wf[32 * i : 32 * i + 32, 32 * j : 32 * j + 32]
            amax = tile.abs().amax().clamp(min=fm.MXFP8_AMAX_FLOOR)
            k = int(ref_ceil_log2_scale(amax, 1 / 448.0))
            assert int(scale.view(torch.uint8)[i, j]) == 127 + k
            ref = ref_e4m3_bytes(tile * 2.0**-k)
            assert torch.equal(weight[32 * i : 32 * i + 32, 32 * j : 32 * j + 32].view(torch.uint8), ref)
    assert torch.equal(raw_bits(out.bfloat16().float()), raw_bits(out))


def test_fp8_block_dequantize_rejects_bad_scale_shape():
    weight, scale = fm.fp8_block_quantize(torch.randn(40, 70, generator=torch.Generator().manual_seed(11)))
    with pytest.raises(ValueError, match=r"scale must have shape \(2, 3\).*\(2, 2\)"):
        fm.fp8_block_dequantize(weight, scale[:, :2])
    with pytest.raises(ValueError, match="w must be a 2-D"):
        fm.fp8_block_quantize(torch.randn(2, 3, 4))
    with pytest.raises(TypeError, match="weight must have dtype"):
        fm.fp8_block_dequantize(weight.float(), scale)


def test_quantizer_errors_name_the_argument():
    with pytest.raises(ValueError, match="x: last dimension K=48 must be a multiple of block=32"):
        fm.mxfp8_quantize(torch.randn(2, 48))
    with pytest.raises(ValueError, match="K=40 must be a multiple of group=16"):
        fm.nvfp4_quantize(torch.randn(40))
    with pytest.raises(TypeError, match="x must be a floating-point tensor"):
        fm.mxfp4_quantize(torch.ones(64, dtype=torch.int32))
    with pytest.raises(ValueError, match="block must be a positive int, got 0"):
        fm.mxfp8_quantize(torch.randn(64), block=0)
    codes, scales = fm.mxfp8_quantize(torch.randn(2, 64))
    with pytest.raises(ValueError, match=r"scales must have shape \(2, 2\).*got \(2, 1\)"):
        fm.mxfp8_dequantize(codes, scales[:, :1])
    with pytest.raises(TypeError, match="scales must have dtype"):
        fm.mxfp8_dequantize(codes, scales.float())
    with pytest.raises(TypeError, match="amax_fp32 must be a floating-point tensor"):
        fm.pow2_ceil_scale(torch.tensor([3]), 1 / 448)
