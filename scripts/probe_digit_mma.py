"""Is a 32-deep block of E4M3 products summed exactly by FP16 tensor cores once each code is split
into two digits? Each E4M3 value v splits exactly into vh = v rounded to an integer (|vh| <= 448) and
vl = v - vh (a multiple of 2^-9, |vl| <= 1/2), both exact FP16 values. A block's dot of x and w is
then hh + (hl + lh) + ll: hh = xh . wh sums 32 integers below 448^2 < 2^18 (the sum below 2^23), the
cross terms multiples of 2^-9 of at most 224 (each cross dot below 2^13), ll multiples of 2^-18 of
at most 1/4 (the dot at most 2^3): every one of the four dots is a sum of at most 24 significant bits, exact in FP32,
so it is exact from an FP16 MMA whose adds keep at least 24 bits below the largest term's leading
bit (products are exact in any FP16 MMA). This probe asks whether Hopper's FP16 MMAs (wgmma through
`tl.dot` on a 64-row tile, mma.sync on a 16-row one) keep that many: every dot against its FP64
value, and the block's partial formed from them against the contract's RN(exact):

    mid = hl + lh (exact: a multiple of 2^-9 below 2^14), mi = RN-to-integer(mid) by the
    1.5 x 2^23 trick, mf = mid - mi (exact, |mf| <= 1/2), H = hh + mi (an integer below 2^24:
    exact), L = mf + ll (a multiple of 2^-18 below 2^4: exact), partial = RN(H + L): rounded once.

"chained" forms the cross dots as one accumulator (lh's MMA added onto hl's): the same sum if the
MMA's accumulator add is exact there too.

    PYTHONPATH=. python scripts/probe_digit_mma.py [TILES]      # on a GPU (default 2048 tiles)
"""
import sys

import torch
import triton
import triton.language as tl

from probe_fp8_exactness import _tiles


@triton.jit
def _digits(v):
    """(vh, vl) of E4M3 values v as FP16: vh = v rounded to an integer, vl = v - vh (both exact)."""
    f = v.to(tl.float32)
    S: tl.constexpr = 12582912.0
    h = (f + S) - S
    return h.to(tl.float16), (f - h).to(tl.float16)


@triton.jit
def _digit_dot(w_ptr, x_ptr, y_ptr, parts_ptr, BN: tl.constexpr, CHAINED: tl.constexpr):
    t = tl.program_id(0)
    rn = tl.arange(0, BN)
    rk = tl.arange(0, 32)
    rm = tl.arange(0, 16)
    w = tl.load(w_ptr + t * BN * 32 + rn[:, None] * 32 + rk[None, :])
    x = tl.load(x_ptr + t * 32 * 16 + rk[:, None] * 16 + rm[None, :])
    wh, wl = _digits(w)
    xh, xl = _digits(x)
    hh = tl.dot(wh, xh)
    if CHAINED:
        mid = tl.dot(wl, xh, tl.dot(wh, xl))
    else:
        mid = tl.dot(wh, xl) + tl.dot(wl, xh)
    ll = tl.dot(wl, xl)
    S: tl.constexpr = 12582912.0
    mi = (mid + S) - S
    part = (hh + mi) + ((mid - mi) + ll)
    offs = t * BN * 16 + rn[:, None] * 16 + rm[None, :]
    tl.store(y_ptr + offs, part)
    n = tl.num_programs(0) * BN * 16
    tl.store(parts_ptr + offs, hh)
    tl.store(parts_ptr + n + offs, mid)
    tl.store(parts_ptr + 2 * n + offs, ll)


def _split(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    f = v.double()
    h = torch.round(f)
    return h, f - h


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 2048
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(0)
    print(f"{n} tiles of partials on {torch.cuda.get_device_name() if dev == 'cuda' else 'the CPU'}")
    for kind in ("Gaussian MXFP8", "heavy-tailed", "uniform codes"):
        w64, x = _tiles(kind, n, gen)
        for bn, warps, mma in ((64, 4, "wgmma"), (16, 1, "mma.sync")):
            w = w64[:, :bn].contiguous()
            exact = torch.einsum("tnk,tkm->tnm", w.double(), x.double())
            wh, wl = _split(w)
            xh, xl = _split(x)
            want = [torch.einsum("tnk,tkm->tnm", wh, xh),
                    torch.einsum("tnk,tkm->tnm", wh, xl) + torch.einsum("tnk,tkm->tnm", wl, xh),
                    torch.einsum("tnk,tkm->tnm", wl, xl)]
            for chained in (False, True):
                y = torch.empty(n, bn, 16, device=dev)
                parts = torch.empty(3, n, bn, 16, device=dev)
                _digit_dot[(n,)](w.to(dev), x.to(dev), y, parts, BN=bn, CHAINED=chained, num_warps=warps)
                y, parts = y.cpu(), parts.cpu().double()
                off = (y != exact.float()).sum().item()
                bad = [(parts[i] != want[i]).sum().item() for i in range(3)]
                print(f"{kind:15s} {mma:8s} {'chained' if chained else 'apart  '} partials not RN(exact): "
                      f"{off} of {y.numel()}; inexact dots hh / mid / ll: {bad[0]} / {bad[1]} / {bad[2]}")


if __name__ == "__main__":
    main()
