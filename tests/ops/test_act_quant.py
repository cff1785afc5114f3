"""ops/act_quant.py against formats.mxfp8_quantize, bit for bit (interpreter on the CPU; GPU at the
real shapes)."""

import pytest
import torch

from dsv41_decode.formats import mxfp8_quantize
from dsv41_decode.ops.act_quant import act_quant_mxfp8, act_quant_mxfp8_

_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _mixed(m: int, k: int, seed: int) -> torch.Tensor:
    """BF16 [m, k] whose 32-blocks cover the cases of the scale rule and the E4M3 rounding.

    Per block, one of: normal data at a random magnitude 2^-40..2^40; data under the 1e-4 amax
    floor; signed exact powers of two; a block whose amax is exactly 448 * 2^e (zero mantissa: no
    +1 in the exponent) filled with E4M3 midpoints times 2^e (ties to even); BF16 subnormals and
    signed zeros.
    """
    g = torch.Generator().manual_seed(seed)
    kb = k // 32
    x = torch.randn(m, kb, 32, generator=g) * torch.exp2(torch.randint(-40, 41, (m, kb, 1), generator=g).float())
    kind = torch.randint(0, 5, (m, kb), generator=g)
    tiny = torch.randn(m, kb, 32, generator=g) * 1e-6
    sign = torch.where(torch.rand(m, kb, 32, generator=g) < 0.5, -1.0, 1.0)
    pow2 = sign * torch.exp2(torch.randint(-20, 20, (m, kb, 32), generator=g).float())
    grid = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
    grid = grid[grid.isfinite() & (grid >= 0)].unique().sort().values
    mids = (grid[1:] + grid[:-1]) / 2  # 4 significant bits: exact in BF16
    pick = mids[torch.randint(0, mids.numel(), (m, kb, 32), generator=g)] * sign
    pick[..., 0] = 448.0
    mid = pick * torch.exp2(torch.randint(-20, 20, (m, kb, 1), generator=g).float())
    sub = sign * torch.randint(0, 128, (m, kb, 32), generator=g).float() * 2.0**-133
    for i, alt in enumerate((tiny, pow2, mid, sub), start=1):
        x = torch.where((kind == i)[..., None], alt, x)
    return x.reshape(m, k).bfloat16()


def _check(x: torch.Tensor) -> None:
    codes, scales = act_quant_mxfp8(x.to(_DEVICE))
    want_codes, want_scales = mxfp8_quantize(x)
    assert torch.equal(scales.cpu(), want_scales)
    bad = (codes.cpu().view(torch.uint8) != want_codes.view(torch.uint8)).nonzero()
    assert bad.numel() == 0, f"{bad.shape[0]} code mismatches, first at {bad[:3].tolist()}"


@pytest.mark.parametrize("m", [1, 3, 37])
@pytest.mark.parametrize("k", [64, 96, 1280])
def test_bit_exact_vs_formats(m, k):
    _check(_mixed(m, k, seed=1000 * m + k))


def test_non_finite_blocks_and_strided_rows():
    x = _mixed(5, 128, seed=7)
    x[1, 3] = float("nan")
    x[2, 40] = -float("inf")
    x[3, 100] = float("inf")
    _check(x)
    # A row-strided view (unit stride in K) is read in place; the result equals the contiguous one.
    wide = _mixed(5, 192, seed=8).to(_DEVICE)
    codes, scales = act_quant_mxfp8(wide[:, 32:160])
    want_codes, want_scales = mxfp8_quantize(wide[:, 32:160].cpu())
    assert torch.equal(codes.cpu().view(torch.uint8), want_codes.view(torch.uint8))
    assert torch.equal(scales.cpu(), want_scales)


def test_writes_into_caller_buffers():
    x = _mixed(3, 96, seed=9).to(_DEVICE)
    codes = torch.empty(3, 96, dtype=torch.uint8, device=_DEVICE)
    scales = torch.empty(3, 3, dtype=torch.uint8, device=_DEVICE)
    act_quant_mxfp8_(x, codes, scales)
    want_codes, want_scales = mxfp8_quantize(x.cpu())
    assert torch.equal(codes.cpu(), want_codes.view(torch.uint8))
    assert torch.equal(scales.cpu(), want_scales)


def _bufs(m=3, k=64):
    x = torch.randn(m, k).bfloat16()
    return x, torch.empty(m, k, dtype=torch.float8_e4m3fn), torch.empty(m, k // 32, dtype=torch.uint8)


@pytest.mark.parametrize("case, match", [
    (lambda x, c, s: (x.float(), c, s), "x must have dtype"),
    (lambda x, c, s: (x[:, :48], c[:, :48], s[:, :1]), "multiple of 32"),
    (lambda x, c, s: (torch.randn(64, 3).bfloat16().t(), c, s), "x must have unit stride"),
    (lambda x, c, s: (x[None], c, s), "x must be a 2-D"),
    (lambda x, c, s: (x, c.float(), s), "codes_out must have dtype"),
    (lambda x, c, s: (x, c[:2], s), "codes_out must have shape"),
    (lambda x, c, s: (x, c, s[:, :1]), "scales_out must have shape"),
    (lambda x, c, s: (x, c, s.to(torch.int32)), "scales_out must have dtype"),
    (lambda x, c, s: (x, torch.empty(64, 3, dtype=torch.uint8).t(), s), "codes_out must have unit stride"),
    (lambda x, c, s: (x, torch.empty(c.shape, dtype=c.dtype, device="meta"), s), "codes_out must be on"),
    (lambda x, c, s: (x, c, torch.empty(s.shape, dtype=s.dtype, device="meta")), "scales_out must be on"),
])
def test_bad_inputs_raise_naming_the_argument(case, match):
    with pytest.raises((TypeError, ValueError), match=match):
        act_quant_mxfp8_(*case(*_bufs()))


@pytest.mark.gpu
@pytest.mark.parametrize("k", [5120, 1280, 8192])
def test_gpu_real_shapes(k):
    for m in (1, 2, 3, 4, 8, 16, 33, 64, 4096):
        _check(_mixed(m, k, seed=m + k))
