"""One V4.1-Flash FP8 linear (TP1) for the scripts that profile one kernel launch
(`ncu_gluon_exact_mm.py`, `ncu_cuda_exact_mm.py`): its operands (`--shape=`, `--rows=`, drawn
model-like from a seed of the shape and rows), and an op's calls (`--calls=`) with its bits
against a reference printed."""

from __future__ import annotations

import torch

from dsv41_decode.bench.gemm import flash_shapes
from dsv41_decode.formats import fp8_block_quantize, mxfp8_quantize

from _args import arg

SHAPES = {s.name: (s.n, s.k) for s in flash_shapes(tps=(1,)) if s.kind == "fp8"}


def linear_case(default_shape: str, default_rows: int):
    """(name, N, K, rows, weight, w_scale, codes, x_scale) of `--shape=` (one of SHAPES) at `--rows=`,
    on the current CUDA device; SystemExit naming the option on an unknown shape."""
    name = arg("shape", default_shape)
    if name not in SHAPES:
        raise SystemExit(f"--shape must be one of {sorted(SHAPES)}, got {name!r}")
    n, k = SHAPES[name]
    rows = int(arg("rows", str(default_rows)))
    g = torch.Generator(device="cuda").manual_seed(n + k + rows)
    weight, w_scale = fp8_block_quantize(torch.randn(n, k, generator=g, device="cuda") * k ** -0.5)
    codes, x_scale = mxfp8_quantize(torch.randn(rows, k, generator=g, device="cuda").to(torch.bfloat16))
    return name, n, k, rows, weight, w_scale, codes, x_scale


def call_and_compare(op, codes: torch.Tensor, x_scale: torch.Tensor, reference, label: str) -> None:
    """Call `op(codes, x_scale)` `--calls=` times (default 5) and print `label` with the last output's
    bits against `reference(codes, x_scale)`: `=` or the count of differing outputs."""
    for _ in range(int(arg("calls", "5"))):
        y = op(codes, x_scale)
    want = reference(codes, x_scale)
    torch.cuda.synchronize()
    diff = int((y.view(torch.int16) != want.view(torch.int16)).sum())
    print(f"{label}: bits {'=' if diff == 0 else f'{diff} differ'}", flush=True)
