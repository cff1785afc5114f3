"""The rounding helpers of ops/rounding.py against torch's CPU casts, bit for bit.

Runs in the interpreter without a GPU and compiled on the GPU when there is one, so the same test
checks both back ends.
"""

import torch
import triton
import triton.language as tl

from dsv41_decode.ops.rounding import bf16_rne_bits, e4m3_rne_code, ue8m0_to_fp32

_BLOCK = 1024
_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@triton.jit
def _apply_kernel(x_ptr, xc_ptr, bf16_ptr, e4m3_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(bf16_ptr + offs, bf16_rne_bits(tl.load(x_ptr + offs, mask=mask)), mask=mask)
    tl.store(e4m3_ptr + offs, e4m3_rne_code(tl.load(xc_ptr + offs, mask=mask)), mask=mask)


@triton.jit
def _ue8m0_kernel(b_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(out_ptr + offs, ue8m0_to_fp32(tl.load(b_ptr + offs, mask=mask, other=127)), mask=mask)


def _apply(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(bf16 of x, e4m3 code of x clamped to +-448) by the helpers, returned on the CPU."""
    x = x.float().to(_DEVICE)
    bf16 = torch.empty(x.shape, dtype=torch.bfloat16, device=_DEVICE)
    e4m3 = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=_DEVICE)
    _apply_kernel[(triton.cdiv(x.numel(), _BLOCK),)](
        x, x.clamp(-448, 448), bf16.view(torch.int16), e4m3.view(torch.uint8), x.numel(), BLOCK=_BLOCK)
    return bf16.cpu(), e4m3.cpu()


def _bits_equal(got: torch.Tensor, want: torch.Tensor, x: torch.Tensor, what: str) -> None:
    bits = torch.uint8 if got.element_size() == 1 else torch.int16
    g, w = got.view(bits), want.view(bits)
    bad = (g != w).nonzero().flatten()
    assert bad.numel() == 0, (
        f"{what}: {bad.numel()} mismatches, first x={x[bad[:5]].tolist()} got={g[bad[:5]].tolist()} want={w[bad[:5]].tolist()}"
    )


def test_bf16_rne_bits_matches_torch():
    g = torch.Generator().manual_seed(0)
    # Random FP32 bit patterns over the whole range, then each one's BF16 midpoints (low 16 bits
    # 0x8000) with even and odd kept parts, one ulp either side, and the special values.
    raw = torch.randint(-(2**31), 2**31, (20000,), generator=g, dtype=torch.int64).to(torch.int32)
    mid = (raw & ~0xFFFF) | 0x8000
    specials = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 3.3895e38, -3.3895e38,
                             3.4028234e38, 1e-45, -1e-45, 1.1754942e-38])
    x = torch.cat([raw.view(torch.float32), mid.view(torch.float32), (mid + 1).view(torch.float32),
                   (mid - 1).view(torch.float32), specials])
    got, _ = _apply(x)
    # NaN bits differ between torch's CPU (0xFFFF) and CUDA (0x7FFF) casts: only NaN-ness counts.
    nan = x.isnan()
    assert torch.equal(got.isnan(), nan)
    _bits_equal(got[~nan], x[~nan].to(torch.bfloat16), x[~nan], "bf16_rne_bits")


def _e4m3_grid() -> torch.Tensor:
    """Every finite E4M3 value, their midpoints, and one FP32 ulp either side of each midpoint."""
    values = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
    pos = values[(values >= 0) & values.isfinite()].unique().sort().values  # 0 .. 448
    mids = (pos[1:] + pos[:-1]) / 2  # exact in FP32
    up = mids.view(torch.int32) + 1
    down = mids.view(torch.int32) - 1
    mag = torch.cat([pos, mids, up.view(torch.float32), down.view(torch.float32),
                     torch.tensor([2.0**-10, 2.0**-11, 1e-30, 1e-45, 464.0, 460.0])])
    return torch.cat([mag, -mag, torch.tensor([float("nan")])])


def test_e4m3_rne_code_matches_torch():
    g = torch.Generator().manual_seed(1)
    # The grid, plus random values spread over E4M3's whole range (normals and subnormals).
    rand = torch.randn(20000, generator=g) * torch.exp2(torch.randint(-14, 9, (20000,), generator=g).float())
    x = torch.cat([_e4m3_grid(), rand])
    _, got = _apply(x)
    # NaN -> the canonical code 0x7F, as formats.mxfp8_quantize writes it.
    want = torch.where(x.isnan(), torch.tensor(float("nan")), x.clamp(-448, 448)).to(torch.float8_e4m3fn)
    _bits_equal(got, want, x, "e4m3_rne_code")


def test_ue8m0_to_fp32():
    # every byte: 2^(b - 127) for 1..254, NaN for 255, and 0.0 for 0 (the documented departure
    # from 2^-127: the MX scale rule never produces byte 0)
    b = torch.arange(0, 256, dtype=torch.int32).to(torch.uint8)
    out = torch.empty(b.shape, dtype=torch.float32, device=_DEVICE)
    _ue8m0_kernel[(1,)](b.to(_DEVICE), out, b.numel(), BLOCK=256)
    out = out.cpu()
    want = torch.where(b == 255, torch.nan, torch.exp2(b.double() - 127).float())
    want[0] = 0.0
    assert torch.equal(out.isnan(), want.isnan())
    assert torch.equal(out[:-1], want[:-1])
