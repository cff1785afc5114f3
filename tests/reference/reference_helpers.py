"""Shared by the reference tests (tests/reference/test_*.py): seeded inputs, the one-BF16-rounding
check, the tolerance constants, and the float64 RoPE and the FP8 weights both files use.

Every expected value is computed in these tests from the spec's formulas, in float64 unless a
rounding the spec names is the point (then the rounding is applied explicitly), never by calling
the function under test. Inputs are fresh seeded random tensors per check. Tolerances:

- one BF16 rounding of a value computed in FP32: |err| <= 2^-8 |ref| (half an ulp of a number in
  [2^e, 2^(e+1)) is 2^(e-8)), plus the FP32 accumulation error, bounded by
  (terms + blocks) * 2^-24 * sum|terms| where a sum may cancel;
- FP32 results: a few 2^-24 relative to the magnitude of the terms;
- sparse attention: the project's kernel tolerances (max abs <= 2e-2 max|ref|, rel RMS <= 5e-3),
  plus a tighter rel RMS for the reference, which only rounds P and the output to BF16."""

from __future__ import annotations

import math

import torch

from dsv41_decode.formats import fp8_block_quantize

F64 = torch.float64
BF16 = torch.bfloat16
U = 2.0 ** -24          # FP32 unit roundoff
HALF_ULP = 2.0 ** -8    # largest relative error of one BF16 rounding


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(gen: torch.Generator, *shape: int, scale: float = 1.0, dtype=torch.float32) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen) * scale).to(dtype)


def _assert_bf16_of(y: torch.Tensor, ref: torch.Tensor, fp32_err: torch.Tensor | float = 0.0) -> None:
    """y is a BF16 rounding of ref (float64) computed with at most `fp32_err` absolute error."""
    assert y.dtype == BF16 and y.shape == ref.shape, (y.dtype, tuple(y.shape), tuple(ref.shape))
    err = (y.double() - ref).abs()
    bound = HALF_ULP * ref.abs() + fp32_err
    bad = err > bound
    assert not bool(bad.any()), (
        f"{int(bad.sum())} of {bad.numel()} elements off by more than one BF16 rounding; worst "
        f"excess {float((err - bound).max()):.3g} at {tuple(int(i) for i in torch.nonzero(bad)[0])}")


def _base_freqs64(base: float) -> torch.Tensor:
    """f_i = base^(-2i/64), i = 0..31, float64."""
    return torch.tensor([base ** (-2.0 * i / 64) for i in range(32)], dtype=F64)


def _yarn_freqs64(base: float, low: int, high: int, factor: float) -> torch.Tensor:
    f = _base_freqs64(base)
    out = f.clone()
    for i in range(32):
        ramp = min(max((i - low) / (high - low), 0.0), 1.0)
        out[i] = f[i] / factor * ramp + f[i] * (1 - ramp)
    return out


def _rotate64(x: torch.Tensor, positions: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """Adjacent-pair rotation, element by element: x [n, ..., 64] float64, positions [n]."""
    out = x.clone().double()
    for r, p in enumerate(positions.tolist()):
        for i in range(32):
            th = p * float(freqs[i])
            c, s = math.cos(th), math.sin(th)
            a, b = x[r, ..., 2 * i].double(), x[r, ..., 2 * i + 1].double()
            out[r, ..., 2 * i] = a * c - b * s
            out[r, ..., 2 * i + 1] = a * s + b * c
    return out


def _fp8_weight(gen: torch.Generator, n_out: int, n_in: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A random FP8 weight whose 32x32 tiles have different magnitudes (so every scale matters)."""
    w = _randn(gen, n_out, n_in, scale=n_in ** -0.5)
    tiles = 2.0 ** torch.randint(-3, 4, (-(-n_out // 32), -(-n_in // 32)), generator=gen).float()
    w = w * tiles.repeat_interleave(32, 0).repeat_interleave(32, 1)[:n_out, :n_in]
    return fp8_block_quantize(w)
