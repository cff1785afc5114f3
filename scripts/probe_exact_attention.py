"""The exact step's attention on a GPU, in one run: (1) the official trace through the step built with
`exact_linears=True, fp32_dots=True` (FP8 linears with the contract's bits, the sparse MLA and `wo_a` with FP32
operands and IEEE dots), its prefill call through the kernels as well: the failing call-layers, if
any; (2) what the FP32 dots cost: the sparse MLA's exact plan (`SparseMlaPlan.for_step(fp32_dots=
True)`; beside it two other FP32 tilings without spills, 32-dim dots and 32-head programs, and
whether they give its bits) and `wo_a` with `ieee_dot` (BF16 and FP8 weights) against the step's
default plans at the V4.1-Flash shape (64 heads, 128 window + 512 top-k keys; 8 groups of 1024
outputs), rows 1, 16, 64: CUDA-graph replay timed with CUDA events, the median of 50 replays
(`bench.timing.graph_time_us`; wo_a's weight rotated beyond L2). Each option's output is compared
with the default's (max |d|: the tensor cores' sums round differently).

    PYTHONPATH=. python scripts/probe_exact_attention.py [--case=tests/data/official-tiny]
        [--rows=1,16,64] [--only=trace|timing]

Prints; writes nothing. Exit status 1 when a call-layer of the trace fails.
"""

from __future__ import annotations

import sys
import time

import torch

from dsv41_decode.bench.attn import TOPK, WINDOW, sparse_mla_inputs
from dsv41_decode.bench.timing import graph_time_us
from dsv41_decode.ops.sparse_mla import HEAD_DIM, SparseMlaPlan, sparse_mla_
from dsv41_decode.ops.wo_a import WoAPlan, wo_a_

from _args import arg   # scripts/ is on sys.path when run as python scripts/<probe>.py
from probe_wo_a import GROUPS, HEADS, RANK, rotated_inputs, step_weight, weight_copies


def trace(case: str) -> bool:
    """verify_trace through the exact step, prefill through the kernels; True when every call-layer passes."""
    from dsv41_decode.testing.trace import MAX_ULP, verify_trace
    t0 = time.time()
    res = verify_trace(case, path="step", device="cuda", prefill="kernels", exact_linears=True, fp32_dots=True)
    bad = [r for r in res if r.failures]
    print(f"trace {case}: {len(res)} call-layers, path step, prefill kernels, exact_linears + fp32_dots, "
          f"{time.time() - t0:.0f} s", flush=True)
    worst = max(res, key=lambda r: r.attn_out_unexplained_ulp)
    print(f"  largest attn_out distance once flips are applied: {worst.attn_out_unexplained_ulp:.3g} ulp "
          f"({worst.call} layer {worst.layer}; limit {MAX_ULP})", flush=True)
    for r in bad:
        print(f"  FAIL {r.call} layer {r.layer} ({r.kind}, {r.path}): attn_out {r.attn_out_ulp:.3g} ulp, "
              f"unexplained {r.attn_out_unexplained_ulp:.3g}; " + "; ".join(r.failures), flush=True)
    print(f"trace: {'PASS' if not bad else f'FAIL ({len(bad)} call-layers)'}", flush=True)
    return not bad


def time_sparse_mla(rows_list: list[int], gen: torch.Generator) -> None:
    for rows in rows_list:
        q, win, comp, wtab, ctab, sink = sparse_mla_inputs(rows, HEADS, gen)
        plans = {"default": next(p for p in SparseMlaPlan.for_step(64, HEADS, WINDOW, TOPK, "cuda")
                                 if rows <= p.max_rows),
                 "fp32": SparseMlaPlan.for_step(64, HEADS, WINDOW, TOPK, "cuda", fp32_dots=True)[0],
                 # other FP32 tilings (no spills on sm_90): a candidate for some row counts only if
                 # it gives the step plan's bits (printed)
                 "fp32_d32": SparseMlaPlan.build(64, HEADS, WINDOW, TOPK, "cuda", bf16_dot=False, dot_dims=32,
                                                 block_h=16, num_warps=8, separate_combine=True),
                 "fp32_bh32_d32": SparseMlaPlan.build(64, HEADS, WINDOW, TOPK, "cuda", bf16_dot=False, dot_dims=32,
                                                      block_h=32, num_warps=8, separate_combine=True)}
        outs = {}
        for name, plan in plans.items():
            out = torch.empty_like(q)
            us = graph_time_us(lambda p=plan, o=out: sparse_mla_(p, q, win, comp, wtab, ctab, sink,
                                                                 HEAD_DIM ** -0.5, o), replays=50)
            outs[name] = out.float()
            d = float((outs[name] - outs["default"]).abs().max())
            same = "" if name in ("default", "fp32") else f"  bits of fp32: {torch.equal(outs[name], outs['fp32'])}"
            print(f"sparse_mla rows {rows:2d} {name:13s} {us:8.2f} us  block_h {plan.block_h} warps {plan.num_warps} "
                  f"bf16_dot {plan.bf16_dot} dot_dims {plan.dot_dims}  |d| vs default {d:.1e}{same}", flush=True)


def time_wo_a(rows_list: list[int], gen: torch.Generator) -> None:
    w = step_weight(gen)
    for fp8 in (False, True):
        ws, scale, nbytes = weight_copies(w, fp8)
        weight, copies = ws[0], len(ws)
        plans = {"default": WoAPlan.build(HEADS, GROUPS, RANK, 64, weight.dtype, "cuda"),
                 "ieee": WoAPlan.build(HEADS, GROUPS, RANK, 64, weight.dtype, "cuda", ieee_dot=True)}
        for m in rows_list:
            o, cos, sin = rotated_inputs(m, gen)
            outs = {}
            for name, plan in plans.items():
                out = torch.empty(m, GROUPS * RANK, dtype=torch.bfloat16, device="cuda")

                def fn(plan=plan, out=out):
                    for wc in ws:
                        wo_a_(plan, o, cos, sin, wc, scale, out)
                us = graph_time_us(fn, calls_per_graph=copies, replays=50)
                outs[name] = out.float()
                d = float((outs[name] - outs["default"]).abs().max())
                tile = plan.ieee_tile(min(m, 32)) if plan.ieee_dot else "-"
                print(f"wo_a {'fp8 ' if fp8 else 'bf16'} rows {m:2d} {name:8s} {us:8.2f} us "
                      f"{nbytes / us / 1e3:6.0f} GB/s  split {plan.split} bf16_dot {plan.bf16_dot} swap {plan.swapped} "
                      f"ieee tile {tile}  |d| vs default {d:.1e}", flush=True)


def main() -> int:
    case = arg("case", "tests/data/official-tiny")
    rows = [int(r) for r in arg("rows", "1,16,64").split(",")]
    only = arg("only", "")
    print(torch.cuda.get_device_name(), flush=True)
    ok = True
    if only in ("", "trace"):
        ok = trace(case)
    if only in ("", "timing"):
        gen = torch.Generator(device="cuda").manual_seed(0)
        time_sparse_mla(rows, gen)
        time_wo_a(rows, gen)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
