"""How exact is one 32-deep dot of E4M3 codes on this GPU? Block partials against the contract's
RN(exact) (FP64 sum rounded once to FP32), for Hopper's FP8 tensor-core dot (`tl.dot` on E4M3:
QGMMA k32 from a zero accumulator, as `low_latency_mm` and the Gluon tier run it), a BF16
tensor-core dot of the same codes, an FP32 dot, and the exact split on CUDA cores that
`ops.exact_mm` uses. Three data sets of 64 x 32 by 32 x 16 tiles: Gaussian MXFP8 blocks (each
32-block's amax at 448), heavy-tailed ones (Gaussian cubed) and uniform random codes.

    PYTHONPATH=. python scripts/probe_fp8_exactness.py [TILES]      # on a GPU (default 2048 tiles)

Prints per (data, dot): the share of partials that differ from RN(exact) and the share that lie
further from the exact sum than RN(exact) does.
"""
import sys

import torch
import triton
import triton.language as tl


@triton.jit
def _dot(w_ptr, x_ptr, y_ptr, MODE: tl.constexpr):
    t = tl.program_id(0)
    rn = tl.arange(0, 64)
    rk = tl.arange(0, 32)
    rm = tl.arange(0, 16)
    w = tl.load(w_ptr + t * 64 * 32 + rn[:, None] * 32 + rk[None, :])
    x = tl.load(x_ptr + t * 32 * 16 + rk[:, None] * 16 + rm[None, :])
    if MODE == 0:
        acc = tl.dot(w, x)
    elif MODE == 1:
        acc = tl.dot(w.to(tl.bfloat16), x.to(tl.bfloat16))
    elif MODE == 2:
        acc = tl.dot(w.to(tl.float32), x.to(tl.float32), input_precision="ieee")
    else:
        # products exact in FP32; h = p rounded to an integer (|p| < 2^22), l = p - h exact; both sums
        # exact in any order, so h + l is rounded once
        p = w.to(tl.float32)[:, :, None] * x.to(tl.float32)[None, :, :]
        S: tl.constexpr = 12582912.0
        h = (p + S) - S
        acc = tl.sum(h, axis=1) + tl.sum(p - h, axis=1)
    tl.store(y_ptr + t * 64 * 16 + rn[:, None] * 16 + rm[None, :], acc)


def _tiles(kind: str, n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    if kind == "uniform codes":
        w = torch.randint(0, 256, (n, 64, 32), dtype=torch.uint8, generator=gen)
        x = torch.randint(0, 256, (n, 32, 16), dtype=torch.uint8, generator=gen)
        w[(w & 0x7F) == 0x7F] = 0        # no NaN codes
        x[(x & 0x7F) == 0x7F] = 0
        return w.view(torch.float8_e4m3fn), x.view(torch.float8_e4m3fn)
    power = 1 if kind == "Gaussian MXFP8" else 3
    g = torch.randn(n, 64, 32, generator=gen) ** power
    gx = torch.randn(n, 32, 16, generator=gen) ** power
    return ((g * 448 / g.abs().amax(-1, keepdim=True)).to(torch.float8_e4m3fn),
            (gx * 448 / gx.abs().amax(1, keepdim=True)).to(torch.float8_e4m3fn))


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 2048
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(0)
    print(f"{n} tiles of 64 x 16 partials on {torch.cuda.get_device_name() if dev == 'cuda' else 'the CPU'}")
    for kind in ("Gaussian MXFP8", "heavy-tailed", "uniform codes"):
        w, x = _tiles(kind, n, gen)
        exact = torch.einsum("tnk,tkm->tnm", w.double(), x.double())
        rn = exact.float()
        for mode, name in ((0, "FP8 tensor core"), (1, "BF16 tensor core"), (2, "FP32 dot"), (3, "exact split")):
            y = torch.empty(n, 64, 16, device=dev)
            _dot[(n,)](w.to(dev), x.to(dev), y, MODE=mode)
            y = y.cpu()
            off = (y != rn).float().mean().item()
            worse = ((y.double() - exact).abs() > (rn.double() - exact).abs()).float().mean().item()
            print(f"{kind:15s} {name:17s} not RN(exact): {100 * off:7.3f} %   further from exact: {100 * worse:7.3f} %")


if __name__ == "__main__":
    main()
