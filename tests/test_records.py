"""dsv41_decode.records against spec section 6 and the number formats, bit for bit: each record
is the format's codes then its scales, in the byte layout documented in records.py, and unpacks to
the format's fake-quantized values.
"""

from __future__ import annotations

import pytest
import torch

from dsv41_decode import formats as fm
from dsv41_decode import records as rc
from helpers import (
    raw_bits,
    varied,
)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_window_kv_record(dtype):
    x = varied((3, 5, 512), seed=12, dtype=dtype)
    rec = rc.pack_window_kv(x)
    assert rec.dtype == torch.uint8 and rec.shape == (3, 5, rc.WINDOW_KV_BYTES) == (3, 5, 528)
    codes, scales = fm.mxfp8_quantize(x)
    assert torch.equal(rec[..., :512], codes.view(torch.uint8))
    assert torch.equal(rec[..., 512:], scales)
    out = rc.unpack_window_kv(rec)
    assert out.dtype == torch.bfloat16 and out.shape == x.shape
    assert torch.equal(raw_bits(out), raw_bits(fm.mxfp8_fake(x).bfloat16()))
    assert torch.equal(raw_bits(out.float()), raw_bits(fm.mxfp8_dequantize(codes, scales)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compressed_kv_record(dtype):
    x = varied((2, 7, 512), seed=13, dtype=dtype).float()
    x = (x / x.abs().amax(-1, keepdim=True) * 100.0).to(dtype)
    rec = rc.pack_compressed_kv(x)
    assert rec.dtype == torch.uint8 and rec.shape == (2, 7, rc.COMPRESSED_KV_BYTES) == (2, 7, 288)
    packed, scales = fm.nvfp4_quantize(x)
    assert torch.equal(rec[..., :256], packed)
    assert torch.equal(rec[..., 256:], scales.view(torch.uint8))
    out = rc.unpack_compressed_kv(rec)
    assert out.dtype == torch.bfloat16 and out.shape == x.shape
    assert torch.equal(raw_bits(out), raw_bits(fm.nvfp4_fake(x).bfloat16()))
    assert torch.equal(raw_bits(out.float()), raw_bits(fm.nvfp4_dequantize(packed, scales)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_index_key_record(dtype):
    x = varied((4, 3, 128), seed=14, dtype=dtype)
    rec = rc.pack_index_key(x)
    assert rec.dtype == torch.uint8 and rec.shape == (4, 3, rc.INDEX_KEY_BYTES) == (4, 3, 68)
    packed, scales = fm.mxfp4_quantize(x)
    assert torch.equal(rec[..., :64], packed)
    assert torch.equal(rec[..., 64:], scales)
    out = rc.unpack_index_key(rec)
    assert out.dtype == torch.bfloat16 and out.shape == x.shape
    assert torch.equal(raw_bits(out), raw_bits(fm.mxfp4_fake(x).bfloat16()))
    assert torch.equal(raw_bits(out.float()), raw_bits(fm.mxfp4_dequantize(packed, scales)))


def test_fp4_records_put_the_even_element_in_the_low_nibble():
    g = torch.Generator().manual_seed(15)
    x = torch.randn(128, generator=g)
    x[0], x[1] = 6.0, -0.5  # with amax in [3, 6]: scale 1, codes 0x7 and 0x9
    x[2:32] = x[2:32].clamp(-6.0, 6.0)
    rec = rc.pack_index_key(x)
    assert rec[64] == 127 and rec[0] == 0x97
    y = torch.randn(512, generator=g).clamp(-5.0, 5.0)
    y[0], y[1] = 1.0, 6.0  # group amax 6: E4M3 scale 1.0 (byte 0x38), codes 0x2 and 0x7
    rec = rc.pack_compressed_kv(y)
    assert rec[256] == 0x38 and rec[0] == 0x72


def test_records_of_empty_batches():
    assert rc.pack_window_kv(torch.randn(0, 512)).shape == (0, 528)
    assert rc.unpack_compressed_kv(torch.zeros(0, 288, dtype=torch.uint8)).shape == (0, 512)


def test_record_errors_name_the_argument():
    with pytest.raises(ValueError, match=r"x must have last dimension 512, got shape \(2, 511\)"):
        rc.pack_window_kv(torch.randn(2, 511))
    with pytest.raises(ValueError, match="x must have last dimension 128"):
        rc.pack_index_key(torch.randn(2, 512))
    with pytest.raises(TypeError, match="x must be a floating-point tensor, got dtype torch.int64"):
        rc.pack_compressed_kv(torch.ones(2, 512, dtype=torch.int64))
    with pytest.raises(ValueError, match="rec must have last dimension 288"):
        rc.unpack_compressed_kv(torch.zeros(3, 528, dtype=torch.uint8))
    with pytest.raises(TypeError, match="rec must have dtype torch.uint8, got torch.int32"):
        rc.unpack_window_kv(torch.zeros(3, 528, dtype=torch.int32))
