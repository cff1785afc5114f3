"""The mHC mixer (`ops.hc_mix`) alone at the V4.1-Flash dim, rows 1-64, by CUDA-graph replay: what
the side lane's `hc_mix` costs without the step's kernels beside it (the step's profile shows it
longer, e.g. 61 us at 64 rows, because it shares the SMs). Prints; writes nothing.

    PYTHONPATH=. python scripts/probe_hc_mix.py
"""
import torch
from dsv41_decode.bench.timing import graph_time_us
from dsv41_decode.config import ModelConfig
from dsv41_decode.ops.hc_mix import HcMixPlan, hc_mix_
cfg = ModelConfig.preset("v41-flash")
d = cfg.dim
plan = HcMixPlan.build(d, 64, "cuda")
print("dim", d, "split", plan.split, "k_per_split", plan.k_per_split, plan.tiles)
fn = torch.randn(24, 4 * d, device="cuda") * 0.01
scale = torch.ones(3, device="cuda"); base = torch.zeros(24, device="cuda")
for m in (1, 2, 4, 8, 16, 32, 64):
    x = torch.randn(m, 4, d, device="cuda").bfloat16()
    pre = torch.empty(m, 4, device="cuda"); post = torch.empty(m, 4, device="cuda"); comb = torch.empty(m, 4, 4, device="cuda")
    us = graph_time_us(lambda: hc_mix_(x, fn, scale, base, 1e-6, 1e-6, cfg.hc_sinkhorn_iters, pre, post, comb, plan), replays=20)
    print(f"hc_mix rows {m:2d}: {us:6.2f} us  ({(x.numel()*2 + fn.numel()*4)/us/1e3:.0f} GB/s)")
