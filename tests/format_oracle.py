"""The independent oracle of the number-format and cache-record tests (tests/test_formats.py,
tests/test_records.py): codes by searching the sorted table of every representable value (ties
to the even code), scale exponents from an exact float64 product and frexp - never the module's
bit tricks - and the varied test data.
"""

from __future__ import annotations

import torch

from dsv41_decode import formats as fm

E4M3_BYTES = torch.arange(127, dtype=torch.uint8)  # 0x00..0x7E: every non-negative finite code
E4M3_GRID = E4M3_BYTES.view(torch.float8_e4m3fn).double()  # ascending, index == byte
E2M1_GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)


def finite_e4m3_bytes() -> torch.Tensor:
    """All 254 bytes of finite E4M3 values (both signs, +0 and -0; not 0x7F / 0xFF)."""
    return torch.cat((E4M3_BYTES, E4M3_BYTES | 0x80))


def nearest_even_index(v: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
    """Index into the ascending grid of the nearest grid value to |v| (ties to the even index)."""
    a = v.double().abs().clamp(max=float(grid[-1]))
    hi = torch.searchsorted(grid, a).clamp(1, len(grid) - 1)
    lo = hi - 1
    d_lo, d_hi = a - grid[lo], grid[hi] - a
    return torch.where((d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0)), hi, lo)


def ref_e4m3_bytes(v: torch.Tensor) -> torch.Tensor:
    sign = torch.signbit(v).to(torch.uint8) << 7
    return nearest_even_index(v, E4M3_GRID).to(torch.uint8) | sign


def ref_e2m1_codes(v: torch.Tensor) -> torch.Tensor:
    sign = torch.signbit(v).to(torch.uint8) << 3
    return nearest_even_index(v, E2M1_GRID).to(torch.uint8) | sign


def ref_ceil_log2_scale(amax: torch.Tensor, inv_qmax: float) -> torch.Tensor:
    """ceil(log2(fp32(amax * fp32(inv_qmax)))): exact float64 product, one rounding to FP32."""
    p = (amax.double() * float(torch.tensor(inv_qmax, dtype=torch.float32))).float().double()
    mantissa, exponent = torch.frexp(p)  # p = mantissa * 2^exponent, mantissa in [0.5, 1)
    return (exponent - (mantissa == 0.5).to(exponent.dtype)).to(torch.int32)


def ref_mx(x: torch.Tensor, block: int, floor: float, qmax: float, ref_codes):
    """(codes, UE8M0 bytes) of an MX format, from the oracle."""
    xb = x.float().reshape(*x.shape[:-1], -1, block)
    amax = xb.abs().amax(-1).clamp(min=floor)
    k = ref_ceil_log2_scale(amax, 1.0 / qmax)
    s = torch.tensor(2.0, dtype=torch.float64) ** k.double()
    codes = ref_codes((xb.double() / s.unsqueeze(-1)).float())
    return codes.reshape(x.shape), (k + 127).to(torch.uint8)


def ref_nvfp4(x: torch.Tensor, group: int = 16):
    """(E2M1 codes, E4M3 scale bytes) of NVFP4, from the oracle."""
    xg = x.float().reshape(*x.shape[:-1], -1, group)
    amax = xg.abs().amax(-1).clamp(min=fm.NVFP4_AMAX_FLOOR)
    # The FP32 quotient amax / 6: a float64 quotient rounded once to FP32 is the correctly rounded
    # FP32 quotient (53 >= 2 * 24 + 2 bits), then RNE to E4M3.
    scale_bytes = ref_e4m3_bytes((amax.double() / 6.0).float())
    s = scale_bytes.view(torch.float8_e4m3fn).double()
    codes = ref_e2m1_codes((xg.double() / s.unsqueeze(-1)).float())
    return codes.reshape(x.shape), scale_bytes


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).reshape(*packed.shape[:-1], -1)


def raw_bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of t, so that equality is bit equality (NaN, -0.0 included)."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def varied(shape, seed: int, dtype=torch.float32, decades: int = 30) -> torch.Tensor:
    """Random values whose blocks of 16 span 1e-decades .. 1e+decades, some mixing tiny and huge."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g, dtype=torch.float64)
    blocks = x.reshape(-1, 16)
    magnitude = 10.0 ** torch.randint(-decades, decades + 1, (blocks.shape[0], 1), generator=g).double()
    mixed = torch.rand(blocks.shape, generator=g) < 0.1
    spread = 10.0 ** torch.randint(-decades, decades + 1, blocks.shape, generator=g).double()
    blocks = torch.where(mixed, blocks * spread, blocks * magnitude)
    blocks[::7, 3] = 0.0
    blocks[::5, 4] = -0.0
    return blocks.reshape(shape).to(dtype)
