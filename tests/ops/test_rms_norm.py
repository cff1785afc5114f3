"""ops.rms_norm against reference.linear.rms_norm (+ formats.mxfp8_quantize of its output)."""

import pytest
import torch

from dsv41_decode.formats import mxfp8_quantize
from dsv41_decode.ops.rms_norm import rms_norm, rms_norm_, rms_norm_pair_
from dsv41_decode.reference.compressor import latent
from dsv41_decode.reference.linear import rms_norm as ref_rms_norm

_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


# One BF16 ulp: the kernel sums the squares in another order than the reference (a few FP32 ulps
# of the mean, ~2^-21 relative), and torch's vectorized CPU rsqrt differs from an IEEE 1/sqrt by up
# to 2 FP32 ulps; so the FP32 x * r * w of the two sides differ by a few parts in 2^21, far under
# a BF16 ulp (2^-8..2^-7 relative): the BF16 roundings can differ only by the one step where that
# straddles a rounding midpoint.
def _ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    return int((a.view(torch.int16).int() - b.view(torch.int16).int()).abs().max())


@pytest.mark.parametrize("n,d", [(1, 128), (3, 512), (5, 1280), (2, 96)])
def test_matches_reference_within_one_ulp(n, d):
    g = torch.Generator().manual_seed(n * d)
    x = (3 * torch.randn(n, 2 * d, generator=g)).to(torch.bfloat16)[:, :d]   # a strided view
    w = (1 + 0.1 * torch.randn(d, generator=g)).to(torch.bfloat16)
    out = torch.full((n, d), float("nan"), dtype=torch.bfloat16, device=_DEVICE)
    codes = torch.zeros(n, d, dtype=torch.float8_e4m3fn, device=_DEVICE)
    scales = torch.zeros(n, d // 32, dtype=torch.uint8, device=_DEVICE)
    rms_norm_(x.to(_DEVICE), w.to(_DEVICE), 1e-20, out, codes, scales)
    out, codes, scales = out.cpu(), codes.cpu(), scales.cpu()
    assert _ulps(out, ref_rms_norm(x, w, 1e-20)) <= 1
    rc, rs = mxfp8_quantize(out)
    assert torch.equal(codes.view(torch.uint8), rc.view(torch.uint8)) and torch.equal(scales, rs)


def test_fp32_input_is_the_compressor_latent():
    g = torch.Generator().manual_seed(1)
    c = torch.randn(4, 512, generator=g)
    w = (1 + 0.1 * torch.randn(512, generator=g)).to(torch.bfloat16)
    assert _ulps(rms_norm(c.to(_DEVICE), w.to(_DEVICE), 1e-20).cpu(), latent(c, w, 1e-20)) <= 1


@pytest.mark.parametrize("n", [1, 3])
def test_pair_equals_two_launches(n):
    # the step's q_norm (with MXFP8) and kv_norm in one launch, from one strided qkv buffer
    g = torch.Generator().manual_seed(7 + n)
    qkv = (3 * torch.randn(n, 1024 + 512, generator=g)).to(torch.bfloat16).to(_DEVICE)
    wq = (1 + 0.1 * torch.randn(1024, generator=g)).to(torch.bfloat16).to(_DEVICE)
    wkv = (1 + 0.1 * torch.randn(512, generator=g)).to(torch.bfloat16).to(_DEVICE)
    outs = []
    for pair in (False, True):
        qr = torch.empty(n, 1024, dtype=torch.bfloat16, device=_DEVICE)
        codes = torch.empty(n, 1024, dtype=torch.uint8, device=_DEVICE)
        scales = torch.empty(n, 32, dtype=torch.uint8, device=_DEVICE)
        kv = torch.empty(n, 512, dtype=torch.bfloat16, device=_DEVICE)
        if pair:
            rms_norm_pair_(qkv[:, :1024], wq, qr, codes, scales, qkv[:, 1024:], wkv, kv, 1e-6)
        else:
            rms_norm_(qkv[:, :1024], wq, 1e-6, qr, codes, scales)
            rms_norm_(qkv[:, 1024:], wkv, 1e-6, kv)
        outs.append((qr, codes, scales, kv))
    for a, b in zip(*outs):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="same rows"):
        rms_norm_pair_(qkv[:, :1024], wq, qr, codes, scales, qkv.new_zeros(n + 1, 512), wkv,
                       kv.new_zeros(n + 1, 512), 1e-6)


def test_bad_arguments_name_the_argument():
    x = torch.randn(2, 64).to(torch.bfloat16)
    with pytest.raises(TypeError, match="out"):
        rms_norm_(x, torch.ones(64), 1e-6, torch.empty(2, 64))
    with pytest.raises(ValueError, match="weight"):
        rms_norm_(x, torch.ones(32), 1e-6, torch.empty(2, 64, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="8192"):
        rms_norm(torch.zeros(1, 8224, dtype=torch.bfloat16), torch.ones(8224), 1e-6)
