"""CPU: the error of `ops.hc_mix`'s tensor-core dot under a model of the MMA's truncation, at the
tests' inputs (dim 5120, x ~ N(0, 1) BF16, w ~ N(0, 1/dim) FP32). The kernel's arithmetic: w split
into three BF16 planes by truncation (`ops.hc_mix._bf16_planes`), per 64-deep block a zero-started
chain of 12 k16 MMAs (w2, w1, w0 planes, K order), the block added in FP32 to its program's
accumulator (8 blocks a program), the programs' partials added in FP32 in split order. One MMA:
its accumulator and 16 exact products aligned to the largest exponent E among them, each truncated
below 2^(E - 23) (`--extra=`: more alignment bits), summed exactly, the sum truncated to FP32
toward zero. Two truncations of the aligned terms: toward zero (sign-magnitude) and floor (two's
complement). Prints, per model, the max |error| of m = (x . w) * rsqrt(mean x^2) against the exact
value, its mean (a bias), and torch's FP32 matmul for comparison. `--rows=4`. Seconds."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _args import arg  # noqa: E402

DIM = 5120
K = 4 * DIM


def truncated_to_bf16(v: torch.Tensor) -> torch.Tensor:
    """FP32 v with the low 16 bits of its encoding cleared (BF16-valued)."""
    return (v.view(torch.int32) & -65536).view(torch.float32)


def to_fp32_toward_zero(v: np.ndarray) -> np.ndarray:
    f = v.astype(np.float32)
    return np.where(np.abs(f.astype(np.float64)) > np.abs(v), np.nextafter(f, np.float32(0)), f).astype(np.float64)


def mma(c: np.ndarray, p: np.ndarray, floor: bool, extra: int) -> np.ndarray:
    """One instruction: c [...] FP32 accumulator, p [..., 16] exact products -> its result."""
    t = np.concatenate([c[..., None], p], -1)
    top = np.abs(t).max(-1)
    unit = np.exp2(np.floor(np.log2(np.where(top > 0, top, 1.0))) - 23 - extra)[..., None]
    q = np.floor(t / unit) if floor else np.trunc(t / unit)
    return to_fp32_toward_zero((q * unit).sum(-1))


def kernel_dot(x: np.ndarray, planes: list[np.ndarray], floor: bool, extra: int, blocks_per_program: int = 8):
    n, total, acc = x.shape[0], np.zeros((x.shape[0], 24), np.float32), np.zeros((x.shape[0], 24), np.float32)
    for b in range(K // 64):
        xs, c = x[:, b * 64:(b + 1) * 64], np.zeros((n, 24))
        for pl in planes:                                            # w2, w1, w0
            ws = pl[:, b * 64:(b + 1) * 64]
            for k in range(0, 64, 16):
                c = mma(c, xs[:, None, k:k + 16] * ws[None, :, k:k + 16], floor, extra)
        acc = acc + c.astype(np.float32)
        if (b + 1) % blocks_per_program == 0:
            total, acc = total + acc, np.zeros_like(acc)
    return total.astype(np.float64)


def main() -> None:
    rows, extra = int(arg("rows", "4")), int(arg("extra", "0"))
    g = torch.Generator().manual_seed(31)
    x = torch.randn(rows, K, generator=g).bfloat16().double().numpy()
    w = torch.randn(24, K, generator=g) * DIM ** -0.5
    w0 = truncated_to_bf16(w)                               # as `ops.hc_mix._bf16_planes`
    w1 = truncated_to_bf16(w - w0)
    w2 = w - w0 - w1
    planes = [p.double().numpy() for p in (w2, w1, w0)]
    assert all(torch.equal(p, p.bfloat16().float()) for p in (w0, w1, w2)), "a plane is not BF16-valued"
    assert np.array_equal(planes[0] + planes[1] + planes[2], w.double().numpy()), "the planes are not exact"
    exact = x @ w.double().numpy().T
    r = 1 / np.sqrt((x ** 2).mean(-1, keepdims=True))
    for name, floor in (("toward zero", False), ("floor", True)):
        dm = (kernel_dot(x, planes, floor, extra) - exact) * r
        print(f"{name:12s}: max |dm| {np.abs(dm).max():.2e}, mean dm {dm.mean():+.2e}")
    f32 = (torch.from_numpy(x).float() @ w.T).double().numpy()
    print(f"torch FP32 matmul: max |dm| {(np.abs(f32 - exact) * r).max():.2e}  (|m| ~ {np.abs(exact * r).mean():.2f})")


if __name__ == "__main__":
    main()
