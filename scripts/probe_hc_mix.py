"""Probe the mHC mixer's two kernels (`ops.hc_mix`: "fma", the step's default, and "mma", the tensor
cores) on an H200 at the V4.1-Flash shape (dim 5120: a [rows, 20480] x [24, 20480] product, the sum
of squares, sigmoids and 20 Sinkhorn rounds): per row count the time per call (CUDA-graph replay,
cycling through `--copies` weight copies so that the 2 MB weight comes from DRAM as in the 40-layer
step, not from L2), the max abs error of pre, post and comb against `reference.mhc.hc_mixes`,
whether the variants of the first MMA split give its bits, and whether its row 0 has the bits it
has alone; then the MMA kernel's fixed cost (at dim 32: launch, split-K arrival, sum and epilogue)
at 1, 16 and the most rows.

`--rows=1,2,4,8,16,32,64`; `--splits=40,20,80` (the MMA kernel's K splits; the first is the plan
default's); `--stages=2,3` (the first split's plan at other pipeline depths than its 4; none by
default); `--row-groups=16,32` (the first split's plan with programs of that many of the call's
rows instead of 64, timed at more rows); `--copies=40`. Prints; writes nothing. About 50 s, most of
it compiling (21 kernels: one "fma" kernel per row bucket, three "mma" ones per split, one per
row-group variant, three for the fixed cost)."""

from __future__ import annotations

import sys
import time
from dataclasses import replace
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
    rows_list = [int(v) for v in arg("rows", "1,2,4,8,16,32,64").split(",")]
    splits = [int(v) for v in arg("splits", "40,20,80").split(",")]
    copies = int(arg("copies", "40"))
    stages = [int(v) for v in arg("stages", "").split(",") if v]
    row_groups = [int(v) for v in arg("row-groups", "16,32").split(",") if v]
    max_rows = max(rows_list)
    gen = torch.Generator().manual_seed(0)
    x_all = torch.randn(max_rows, 4, DIM, generator=gen).bfloat16()
    fn = torch.randn(24, 4 * DIM, generator=gen) * DIM ** -0.5
    scale = (0.5 + 0.5 * torch.rand(3, generator=gen)).bfloat16().float()
    base = 0.5 * torch.randn(24, generator=gen)
    want = hc_mixes(x_all, fn, scale, base, NORM_EPS, HC_EPS, ITERS)
    xd, scd, bd = x_all.cuda(), scale.cuda(), base.cuda()
    fns = [fn.cuda() for _ in range(copies)]
    plans = {"fma": HcMixPlan.build(DIM, max_rows, "cuda")}
    plans |= {f"mma/{s}": HcMixPlan.build(DIM, max_rows, "cuda", kernel="mma", split=s) for s in splits}
    ref_name = f"mma/{splits[0]}"
    first = plans[ref_name]

    def variant(**tile):    # the first split's plan, every bucket's tile changed, its own workspace
        return replace(first, tiles=tuple(t._replace(**tile) for t in first.tiles),
                       counters=torch.zeros_like(first.counters), partials=torch.empty_like(first.partials))

    for st in stages:        # other pipeline depths
        if st != first.tile(1).num_stages:
            plans[f"{ref_name}/s{st}"] = variant(num_stages=st)
    for rp in row_groups:    # fewer of the call's rows a program (timed where the rows exceed them)
        plans[f"{ref_name}/r{rp}"] = variant(block_m=rp)
    outs = [torch.empty(max_rows, *s, device="cuda") for s in ((4,), (4,), (4, 4))]
    print(f"dim {DIM}, {copies} weight copies; split x K columns: " +
          ", ".join(f"{k} {p.split} x {p.k_per_split}" for k, p in plans.items()))
    print(f"rows | us: " + "  ".join(f"{k:>9}" for k in plans) + " | best mma / fma | max abs err: " +
          "  ".join(f"{k:>9}" for k in plans) + f" | {ref_name} variants same bits | row 0 alone == among")
    for rows in rows_list:
        o = [t[:rows] for t in outs]
        us, err, bits = {}, {}, {}
        for name, plan in plans.items():
            if "/r" in name and rows <= plan.tile(rows).block_m:
                continue
            def call(plan=plan):
                for f in fns:
                    hc_mix_(xd[:rows], f, scd, bd, NORM_EPS, HC_EPS, ITERS, *o, plan)
            us[name] = graph_time_us(call, calls_per_graph=copies, replays=20)
            hc_mix_(xd[:rows], fns[0], scd, bd, NORM_EPS, HC_EPS, ITERS, *o, plan)
            bits[name] = [t.clone() for t in o]
            err[name] = max(float((a.cpu() - b[:rows]).abs().max()) for a, b in zip(o, want))
            assert not plan.counters.any(), f"{name}: counters left nonzero"
        same = all(torch.equal(a, b) for k, v in bits.items() if k.startswith(ref_name + "/")
                   for a, b in zip(v, bits[ref_name]))
        hc_mix_(xd[:1], fns[0], scd, bd, NORM_EPS, HC_EPS, ITERS, *(t[:1] for t in o), first)
        alone = all(torch.equal(a[0], b[0]) for a, b in zip(o, bits[ref_name]))
        best = min(v for k, v in us.items() if k != "fma")
        print(f"{rows:4d} | us: " + "  ".join(f"{us[k]:9.2f}" if k in us else f"{'-':>9}" for k in plans)
              + f" | {best / us['fma']:14.2f} | max abs err: "
              + "  ".join(f"{err[k]:9.2e}" if k in err else f"{'-':>9}" for k in plans)
              + f" | {same} | {alone}", flush=True)
    # The MMA kernel's fixed cost: at dim 32 (K = 128: one program, two K blocks) what remains is
    # the launch, the split-K arrival, the partials' sum and the epilogue (sigmoids, Sinkhorn).
    small = HcMixPlan.build(32, max_rows, "cuda", kernel="mma")
    xs = torch.randn(max_rows, 4, 32, generator=gen).bfloat16().cuda()
    fs = (torch.randn(24, 128, generator=gen) * 32 ** -0.5).cuda()
    fixed = {r: graph_time_us(lambda r=r: hc_mix_(xs[:r], fs, scd, bd, NORM_EPS, HC_EPS, ITERS,
                                                  *(t[:r] for t in outs), small), replays=20)
             for r in sorted({1, 16, max_rows})}
    print("mma fixed cost (dim 32, one program): " + ", ".join(f"{r} rows {v:.2f} us" for r, v in fixed.items()))
    print(f"done in {time.time() - t0:.1f} s")


if __name__ == "__main__":
    main()
