"""Probe the sparse MLA kernel on a GPU: plan variants timed side by side (graph replay, 32+ calls
per graph), at the shapes of the decode step. `--once` launches the step's plan (STEP_TILINGS) a few
times only (for `ncu`; 1 row x 64 heads unless `--cases` says otherwise). `--only=a,b` picks variants, `--cases=1x64,4x16` picks rows x heads. Prints; writes nothing."""

from __future__ import annotations

import sys

import torch

from dsv41_decode.bench.attn import TOPK as K, WINDOW as W, sparse_mla_inputs
from dsv41_decode.bench.timing import graph_time_us
from dsv41_decode.ops.sparse_mla import HEAD_DIM, SparseMlaPlan, sparse_mla_


def main() -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    once = "--once" in sys.argv
    cases = [(1, 64)] if once else [(1, 64), (1, 16), (4, 64), (8, 64), (16, 64), (64, 64)]
    for a in sys.argv:   # --cases=1x64,8x8: rows x heads
        if a.startswith("--cases="):
            cases = [tuple(int(v) for v in c.split("x")) for c in a.split("=", 1)[1].split(",")]
    for rows, heads in cases:
        q, win, comp, wtab, ctab, sink = sparse_mla_inputs(rows, heads, gen)
        out = torch.empty_like(q)
        variants = {"step": "STEP_TILINGS"} if once else {
            "default": {}, "splits1": dict(splits=1), "splits2": dict(splits=2), "splits4": dict(splits=4),
            "splits8": dict(splits=8), "splits16": dict(splits=16, max_splits=16), "keys32": dict(block_keys=32),
            "keys32_s4": dict(block_keys=32, splits=4), "bh32": dict(block_h=32), "bh32_w4": dict(block_h=32, num_warps=4),
            "bh64": dict(block_h=64), "warps2": dict(num_warps=2), "warps8": dict(num_warps=8),
            "intdecode": dict(native_fp8=False), "sep": dict(separate_combine=True),
            "sep_w8": dict(separate_combine=True, num_warps=8), "sep_k32": dict(separate_combine=True, block_keys=32),
            "sep_bh32_w8": dict(separate_combine=True, block_h=32, num_warps=8),
            "sep_bh32_w4": dict(separate_combine=True, block_h=32, num_warps=4),
            "sep_k32_s10": dict(separate_combine=True, block_keys=32, splits=10),
            "sep_k32_w8": dict(separate_combine=True, block_keys=32, num_warps=8),
            "sep_k64": dict(separate_combine=True, block_keys=64),
            "sep_bh32_k32": dict(separate_combine=True, block_h=32, block_keys=32, num_warps=4),
            "bh32_w4_s2": dict(block_h=32, num_warps=4, splits=2), "bh32_w4_s4": dict(block_h=32, num_warps=4, splits=4),
            "sep_bh32_w4_s4": dict(separate_combine=True, block_h=32, num_warps=4, splits=4),
            "sep_bh32_w4_s8": dict(separate_combine=True, block_h=32, num_warps=4, splits=8),
            "sep_s4": dict(separate_combine=True, splits=4), "sep_s8": dict(separate_combine=True, splits=8),
            "step": "STEP_TILINGS"}
        only = [a.split("=", 1)[1].split(",") for a in sys.argv if a.startswith("--only=")]
        if only:
            variants = {k: v for k, v in variants.items() if k in only[0]}
        ref = None
        for name, kw in variants.items():
            try:
                plan = (next(p for p in SparseMlaPlan.for_step(rows, heads, W, K, "cuda") if p.max_rows >= rows)
                        if kw == "STEP_TILINGS" else SparseMlaPlan.build(rows, heads, W, K, "cuda", **kw))
                fn = lambda p=plan: sparse_mla_(p, q, win, comp, wtab, ctab, sink, HEAD_DIM ** -0.5, out)
                if once:
                    for _ in range(3):
                        fn()
                    torch.cuda.synchronize()
                    continue
                us = graph_time_us(fn, replays=30)
                o = out.float()
                ref = o if ref is None else ref
                err = float((o - ref).abs().max())
                print(f"rows {rows:3d} heads {heads:2d} {name:10s} {us:8.2f} us  splits {plan.split(rows):2d} "
                      f"block_h {plan.block_h} keys {plan.block_keys} warps {plan.num_warps}  |d| {err:.1e}", flush=True)
            except Exception as e:  # report, keep probing
                print(f"rows {rows} heads {heads} {name}: {type(e).__name__}: {str(e)[:160]}", flush=True)


if __name__ == "__main__":
    main()
