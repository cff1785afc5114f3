"""Probe the mHC mixer (`ops.hc_mix`) alone on an H200 at the V4.1-Flash shape (dim 5120: a
[rows, 20480] x [24, 20480] FP32 product, the sum of squares, sigmoids and 20 Sinkhorn rounds):
per row count and K split the time per call (CUDA-graph replay, cycling through `--copies` weight
copies so that the 2 MB weight comes from DRAM as in the 40-layer step, not from L2), the max abs
error of pre, post and comb against `reference.mhc.hc_mixes`, and whether row 0 has the bits it
has alone. `--rows=1,8,16,64`, `--splits=80,40` (the first is the plan default's),
`--copies=40`. Prints; writes nothing. About 20 s, most of it compiling (one kernel per row bucket
and split)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _args import arg  # noqa: E402

from dsv41_decode.bench.timing import graph_time_us  # noqa: E402
from dsv41_decode.ops.hc_mix import HcMixPlan, hc_mix_  # noqa: E402
from dsv41_decode.reference.mhc import hc_mixes  # noqa: E402

DIM, NORM_EPS, HC_EPS, ITERS = 5120, 1e-20, 1e-6, 20


def main() -> None:
    t0 = time.time()
    rows_list = [int(v) for v in arg("rows", "1,8,16,64").split(",")]
    splits = [int(v) for v in arg("splits", "80,40").split(",")]
    copies = int(arg("copies", "40"))
    max_rows = max(rows_list)
    gen = torch.Generator().manual_seed(0)
    x_all = torch.randn(max_rows, 4, DIM, generator=gen).bfloat16()
    fn = torch.randn(24, 4 * DIM, generator=gen) * DIM ** -0.5
    scale = (0.5 + 0.5 * torch.rand(3, generator=gen)).bfloat16().float()
    base = 0.5 * torch.randn(24, generator=gen)
    want = hc_mixes(x_all, fn, scale, base, NORM_EPS, HC_EPS, ITERS)
    xd, scd, bd = x_all.cuda(), scale.cuda(), base.cuda()
    fns = [fn.cuda() for _ in range(copies)]
    plans = {s: HcMixPlan.build(DIM, max_rows, "cuda", split=s) for s in splits}
    outs = [torch.empty(max_rows, *s, device="cuda") for s in ((4,), (4,), (4, 4))]
    print(f"dim {DIM}, {copies} weight copies; split x K columns: " +
          ", ".join(f"{p.split} x {p.k_per_split}" for p in plans.values()))
    print("rows | us at split " + "  ".join(f"{s:>7}" for s in plans) + " | max abs err " +
          "  ".join(f"{s:>8}" for s in plans) + " | row 0 alone == among (first split)")
    for rows in rows_list:
        o = [t[:rows] for t in outs]
        us, err = {}, {}
        for s, plan in plans.items():
            def call(plan=plan):
                for f in fns:
                    hc_mix_(xd[:rows], f, scd, bd, NORM_EPS, HC_EPS, ITERS, *o, plan)
            us[s] = graph_time_us(call, calls_per_graph=copies, replays=20)
            hc_mix_(xd[:rows], fns[0], scd, bd, NORM_EPS, HC_EPS, ITERS, *o, plan)
            err[s] = max(float((a.cpu() - b[:rows]).abs().max()) for a, b in zip(o, want))
            assert not plan.counters.any(), f"split {s}: counters left nonzero"
        first = plans[splits[0]]
        hc_mix_(xd[:rows], fns[0], scd, bd, NORM_EPS, HC_EPS, ITERS, *o, first)
        among = [t[0].clone() for t in o]
        hc_mix_(xd[:1], fns[0], scd, bd, NORM_EPS, HC_EPS, ITERS, *(t[:1] for t in o), first)
        same = all(torch.equal(a[0], b) for a, b in zip(o, among))
        print(f"{rows:4d} | us at split " + "  ".join(f"{v:7.2f}" for v in us.values()) + " | max abs err "
              + "  ".join(f"{v:8.2e}" for v in err.values()) + f" | {same}", flush=True)
    print(f"done in {time.time() - t0:.1f} s")


if __name__ == "__main__":
    main()
