"""Probe the sparse MLA kernel on a GPU: plan variants timed side by side (graph replay, 32+ calls
per graph), at the shapes of the decode step. `--once` launches the step's plan (STEP_TILINGS) a few
times only (for `ncu`; 1 row x 64 heads unless `--cases` says otherwise). `--only=a,b` picks
variants, `--cases=1x64,4x16` picks rows x heads. Prints; writes nothing."""

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
        # the plan's options that leave the bits unchanged (heads per program, warps, where the blocks
        # are combined, the E4M3 decode), and the sequential loop without key splits
        variants = {"step": "STEP_TILINGS"} if once else {
            "default": {}, "nosplit": dict(split=False), "warps4": dict(num_warps=4),
            "bh32": dict(block_h=32), "bh32_w4": dict(block_h=32, num_warps=4),
            "intdecode": dict(native_fp8=False), "sep": dict(separate_combine=True),
            "sep_bh32": dict(separate_combine=True, block_h=32), "step": "STEP_TILINGS"}
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
                print(f"rows {rows:3d} heads {heads:2d} {name:10s} {us:8.2f} us  split {plan.split!s:5s} "
                      f"block_h {plan.block_h} warps {plan.num_warps} sep {plan.separate_combine}  |d| {err:.1e}",
                      flush=True)
            except Exception as e:  # report, keep probing
                print(f"rows {rows} heads {heads} {name}: {type(e).__name__}: {str(e)[:160]}", flush=True)


if __name__ == "__main__":
    main()
