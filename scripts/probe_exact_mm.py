"""Probe `exact_mm` on a GPU: `ExactMM` in a few configurations against `LowLatencyMM` (its tuned
table) at the four V4.1-Flash shapes of the step's GEMMs (TP1), rows 1, 2, 4, 8, 16: time per call
from CUDA-graph replay (20 calls per graph, median of 10 replays; one weight copy, so a weight that
fits in L2 is read from it; with `--copies=N`, N weight copies called in turn, so that a weight
smaller than L2 comes from DRAM as in the step), and the bits of each against
`reference.linear.mxfp8_mm` (every ExactMM configuration must be bitwise; low_latency_mm's
differing BF16 outputs are counted).
One line per (shape, rows, configuration), then per shape and row bucket the fastest bitwise
configuration as an `ops.exact_mm_plan._TUNED` entry (least time summed over the bucket's rows).
`--rows=1,2` and `--only=wq_b,wo_b` narrow it; `--alt=bn:bk:rows:warps:stages[:split[:f64]],...` (or
`default`; f64 1: the block sums on the FP64 cores) replaces the built-in candidates (every shape), or
`--alt_<shape>=...` those of one shape; `--copies=N` (default 1) the weight
copies rotated through each timed graph (N x the weight beyond twice the L2 reads it from DRAM),
`--copies=l2` as many as `bench.timing.l2_rotation` takes for the shape. Prints; writes nothing.
"""

from __future__ import annotations

import torch

from dsv41_decode.bench.timing import graph_time_us, l2_rotation
from dsv41_decode.formats import fp8_block_quantize, mxfp8_quantize
from dsv41_decode.ops.exact_linear import ExactLinear
from dsv41_decode.ops.exact_mm import ExactMM
from dsv41_decode.ops.exact_mm_plan import ExactConfig
from dsv41_decode.ops.low_latency_mm import LowLatencyMM
from dsv41_decode.reference.linear import mxfp8_mm

from _args import arg   # scripts/ is on sys.path when run as python scripts/<probe>.py

SHAPES = {"fused_wqa_wkv": (1792, 5120), "wq_b": (32768, 1280), "idx_wq_b": (4096, 1280), "wo_b": (5120, 8192)}

# (block_n, block_k, rows, num_warps, num_stages[, split]), "default" = the plan's own choice (the
# measured table, else the rule), first. On sm_90 each thread holds 32 consecutive K (one block) of
# block_n * block_k / (1024 * num_warps) weight rows (R); programs = N / block_n (x split at up to
# 4 rows: the tile's last program adds the block terms in K order from a workspace).
CANDIDATES = {
    "fused_wqa_wkv": ["default", "8:1024:4:4:3", "4:1024:4:4:3", "2:1024:4:2:3", "8:512:4:2:4", "4:512:4:1:4",
                      "8:1024:4:4:3:2", "4:1024:4:2:3:2", "8:512:4:2:4:2", "8:1024:4:4:3:5"],
    "wq_b": ["default", "32:256:4:4:3", "64:256:2:4:3", "16:256:4:2:3", "32:256:4:2:3", "16:256:4:4:3"],
    "idx_wq_b": ["default", "16:256:4:2:3", "8:256:4:2:3", "4:256:4:1:3", "16:256:4:4:3", "16:256:4:2:3:2",
                 "32:256:4:4:3:5"],
    "wo_b": ["default", "8:1024:4:4:4", "4:1024:4:2:3", "8:512:4:2:4", "16:512:4:4:4", "16:1024:4:4:3:2"],
}


def _config(spec: str) -> ExactConfig | None:
    return None if spec == "default" else ExactConfig.from_spec(spec)


def _time(fn, copies: int = 1) -> float:
    """Median us per call of `fn`, which makes `copies` calls (one per weight copy)."""
    return graph_time_us(fn, calls_per_graph=copies, replays=10, min_calls=20)


def main() -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = [int(r) for r in arg("rows", "1,2,4,8,16").split(",")]
    names = arg("only", ",".join(SHAPES)).split(",")
    alt = [s for s in arg("alt", "").split(",") if s]
    copies_arg = arg("copies", "1")
    if copies_arg != "l2" and (not copies_arg.isdigit() or int(copies_arg) < 1):
        raise SystemExit(f"--copies must be an int >= 1 or l2, got {copies_arg!r}")
    print(f"{torch.cuda.get_device_name()}", flush=True)
    for name in names:
        n, k = SHAPES[name]
        copies = l2_rotation(n * k) if copies_arg == "l2" else int(copies_arg)
        weight, w_scale = fp8_block_quantize(torch.randn(n, k, generator=g, device="cuda") * 0.02)
        weights = [(weight, w_scale)] + [(weight.clone(), w_scale.clone()) for _ in range(copies - 1)]
        lls = [LowLatencyMM(w, s, 64) for w, s in weights]
        els = [ExactLinear(w, s, 64) for w, s in weights]
        ll = lls[0]
        rotations = {}            # per spec, a plan per weight copy; the first on `weight`
        own = [s for s in arg(f"alt_{name}", "").split(",") if s]
        for spec in own or alt or CANDIDATES[name]:
            try:
                rotations[spec] = [ExactMM(w, s, 64, config=_config(spec)) for w, s in weights]
            except Exception as e:  # report, keep probing
                print(f"{name} {spec}: {type(e).__name__}: {str(e)[:160]}", flush=True)
        plans = {spec: ps[0] for spec, ps in rotations.items()}
        if "default" in plans:
            print(f"{name:14s} default: " + ", ".join(f"rows {b}: {plans['default'].launch_for(b).config}"
                                                      for b in (1, 2, 4)), flush=True)
        times: dict[tuple[int, str], float] = {}
        for m in rows:
            x = torch.randn(m, k, generator=g, device="cuda").to(torch.bfloat16)
            codes, x_scale = mxfp8_quantize(x)
            ref = mxfp8_mm(codes, x_scale, weight, w_scale).view(torch.int16)
            out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
            t_ll = _time(lambda: [p(codes, x_scale, out) for p in lls], copies)
            diff = int((ll(codes, x_scale, out).view(torch.int16) != ref).sum())
            print(f"{name:14s} N={n:6d} K={k:5d} M={m:2d}  low_latency_mm {t_ll:7.2f} us  "
                  f"{diff} of {out.numel()} BF16 outputs differ from the contract", flush=True)
            t_el = _time(lambda: [p(codes, x_scale, out) for p in els], copies)
            print(f"{name:14s} N={n:6d} K={k:5d} M={m:2d}  ExactLinear ({type(els[0].op_for(m)).__name__}, the "
                  f"step's) {t_el:7.2f} us", flush=True)
            for spec, plan in plans.items():
                try:
                    t = _time(lambda ps=rotations[spec]: [p(codes, x_scale, out) for p in ps], copies)
                    out.fill_(float("nan"))
                    y = plan(codes, x_scale, out).view(torch.int16)
                    bad = int((y != ref).sum())
                    if bad == 0:
                        times[(m, spec)] = t
                    print(f"{name:14s} N={n:6d} K={k:5d} M={m:2d}  exact {spec:16s} {t:7.2f} us  "
                          f"x{t / t_ll:5.2f} of low_latency_mm  {'bitwise' if bad == 0 else f'DIFF {bad}'}",
                          flush=True)
                except Exception as e:  # report, keep probing
                    print(f"{name} M={m} {spec}: {type(e).__name__}: {str(e)[:160]}", flush=True)
        # Per row bucket, the bitwise configuration with the least time summed over the bucket's
        # measured rows (every configuration gives the same bits, so buckets may differ freely).
        for bucket in (1, 2, 4, 64):
            ms = [m for m in rows if (1 << (m - 1).bit_length() if m <= 4 else 64) == bucket]
            specs = [sp for sp in plans if all((m, sp) in times for m in ms)]
            if ms and specs:
                best = min(specs, key=lambda sp: sum(times[(m, sp)] for m in ms))
                cfg = plans[best].launch_for(ms[0]).config
                print(f"_TUNED ({n}, {k}, {bucket}): {cfg!r}  # {best}: "
                      + ", ".join(f"{times[(m, best)]:.2f} us at {m}" for m in ms), flush=True)


if __name__ == "__main__":
    main()
