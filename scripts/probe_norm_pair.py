"""The step's q/kv norm pair (`rms_norm_pair_` with the window insert, V4.1-Flash: q 1024 wide with
its MXFP8, kv 512 with its window record) at 1, 2 and 4 warps a program: us per call (graph replay,
median) at each row count, and how many output values differ from the 4-warp launch's (the sum of
squares is summed in the layout's order, so a row's bits are those of its warp count).

    PYTHONPATH=. python scripts/probe_norm_pair.py [--rows=1,2,8,64] [--warps=4,2,1]

(GPU, a few seconds.) Inputs: the fused GEMM's output as N(0, 1) BF16 rows, the checkpoint's norm
weights as 1 + N(0, 0.1), every row's window slot its own.
"""
import torch

from _args import arg
from dsv41_decode.bench.timing import graph_time_us
from dsv41_decode.ops.rms_norm import rms_norm_pair_
from dsv41_decode.records import WINDOW_KV_BYTES


def main() -> None:
    rows = [int(v) for v in arg("rows", "1,2,8,64").split(",")]
    warps = [int(v) for v in arg("warps", "4,2,1").split(",")]
    dev, ql, kvd = "cuda", 1024, 512
    g = torch.Generator(device=dev).manual_seed(0)
    n = max(rows)
    x = torch.randn(n, ql + kvd, generator=g, device=dev).to(torch.bfloat16)
    wa = (1 + 0.1 * torch.randn(ql, generator=g, device=dev)).to(torch.bfloat16)
    wb = (1 + 0.1 * torch.randn(kvd, generator=g, device=dev)).to(torch.bfloat16)
    ang = torch.rand(n, 32, generator=g, device=dev) * 6.283
    cos, sin = ang.cos(), ang.sin()
    slots = torch.arange(n, device=dev, dtype=torch.int64)

    def outputs(m: int):
        return (torch.empty(m, ql, dtype=torch.bfloat16, device=dev),
                torch.empty(m, ql, dtype=torch.uint8, device=dev),
                torch.empty(m, ql // 32, dtype=torch.uint8, device=dev),
                torch.empty(m, kvd, dtype=torch.bfloat16, device=dev),
                torch.zeros(n, WINDOW_KV_BYTES, dtype=torch.uint8, device=dev))

    for m in rows:
        ref = None
        line = [f"rows {m:3d}:"]
        for w in warps:
            oa, ca, sa, ob, win = outputs(m)

            def call():
                rms_norm_pair_(x[:m, :ql], wa, oa, ca, sa, x[:m, ql:], wb, ob, 1e-6,
                               window=win, slots=slots[:m], cos=cos[:m], sin=sin[:m], num_warps=w)
            call()
            torch.cuda.synchronize()
            got = [oa.view(torch.int16), ca, sa, ob.view(torch.int16), win]
            ref = ref or got
            diff = sum(int((a != b).sum()) for a, b in zip(got, ref))
            line.append(f"{w} warps {graph_time_us(call, replays=100):6.2f} us (values differing from "
                        f"{warps[0]} warps: {diff})")
        print("  ".join(line), flush=True)


if __name__ == "__main__":
    main()
