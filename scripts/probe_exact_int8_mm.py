"""Probe `exact_int8_mm` on a GPU: `ExactInt8MM` in a few configurations against `ExactMM` (the exact
linear on CUDA cores, its tuned table) and the step's tensor-core FP8 plan (`fp8_linear_plan` with
exact=False: the Gluon tier on sm_90, FP8 tensor cores, not exact) at the four V4.1-Flash shapes of
the step's GEMMs (TP1): time per call from CUDA-graph replay (median of 10 replays of 20 calls; one
weight copy), and the bits of every ExactInt8MM configuration against `reference.linear.mxfp8_mm`
(must be 0 differing outputs, on model-like and on heavy-tailed operands). One line per (shape,
rows), then per shape and row count the fastest configuration (`ops.exact_int8_mm._INT8_PLAN`
takes the row count from which it beats ExactMM and the configurations).

    PYTHONPATH=. python scripts/probe_exact_int8_mm.py --rows=1,4,16,64 --only=wq_b --alt=64:16:4:4,32:64:4:4
"""

from __future__ import annotations

import torch

from dsv41_decode.bench.timing import graph_time_us
from dsv41_decode.decode.attention import fp8_linear_plan
from dsv41_decode.formats import fp8_block_quantize, mxfp8_quantize
from dsv41_decode.ops.exact_int8_mm import ExactInt8MM, Int8Config
from dsv41_decode.ops.exact_mm import ExactMM
from dsv41_decode.reference.linear import mxfp8_mm
from dsv41_decode.testing.synthetic import heavy_e4m3

from _args import arg   # scripts/ is on sys.path when run as python scripts/<probe>.py

SHAPES = {"fused_wqa_wkv": (1792, 5120), "wq_b": (32768, 1280), "idx_wq_b": (4096, 1280), "wo_b": (5120, 8192)}
# block_n:block_m:num_warps:num_stages[:c|:p] (c: the weight's codes decoded in the kernel instead of
# its digit planes read, `ExactInt8MM(digits=False)`; p: two blocks a step, `Int8Config(pairs=True)`)
CANDIDATES = ["64:16:4:4", "64:16:4:4:p", "64:16:4:3:p", "32:16:4:4:p", "64:16:4:4:c", "32:16:4:4", "32:64:4:4"]


def _time(fn) -> float:
    return graph_time_us(fn, calls_per_graph=1, replays=10, min_calls=20)


def main() -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = [int(r) for r in arg("rows", "1,4,8,16,32,64").split(",")]
    names = arg("only", ",".join(SHAPES)).split(",")
    specs = [s for s in arg("alt", ",".join(CANDIDATES)).split(",") if s]
    print(f"{torch.cuda.get_device_name()}", flush=True)
    for name in names:
        n, k = SHAPES[name]
        weight, w_scale = fp8_block_quantize(torch.randn(n, k, generator=g, device="cuda") * 0.02)
        ex = ExactMM(weight, w_scale, 64)
        default = fp8_linear_plan(weight, w_scale, 64)
        for m in rows:
            x = torch.randn(m, k, generator=g, device="cuda").to(torch.bfloat16)
            codes, x_scale = mxfp8_quantize(x)
            ref = mxfp8_mm(codes, x_scale, weight, w_scale).view(torch.int16)
            hc, hw = heavy_e4m3((m, k), g), heavy_e4m3((n, k), g)
            href = mxfp8_mm(hc, x_scale, hw, w_scale).view(torch.int16)
            out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
            t_def = _time(lambda: default(codes, x_scale, out))
            t_ex = _time(lambda: ex(codes, x_scale, out))
            line = [f"{name:14s} M={m:2d}  default(TC) {t_def:7.2f}  exact_mm {t_ex:7.2f}"]
            best = None
            for spec in specs:
                bn, bm, warps, stages = (int(v) for v in spec.split(":")[:4])
                digits = not spec.endswith(":c")
                cfg = Int8Config(block_n=bn, block_m=bm, num_warps=warps, num_stages=stages, pairs=spec.endswith(":p"))
                try:
                    plan = ExactInt8MM(weight, w_scale, 64, config=cfg, digits=digits)
                    bad = int((plan(codes, x_scale, out).view(torch.int16) != ref).sum())
                    heavy = ExactInt8MM(hw, w_scale, 64, config=cfg, digits=digits)
                    bad += int((heavy(hc, x_scale).view(torch.int16) != href).sum())
                    del heavy
                    t = _time(lambda: plan(codes, x_scale, out))
                except Exception as e:  # report, keep probing
                    line.append(f"{spec}: {type(e).__name__} {str(e)[:100]}")
                    continue
                line.append(f"{spec} {t:7.2f}{'' if bad == 0 else f' ({bad} DIFFER)'}")
                if bad == 0 and (best is None or t < best[1]):
                    best = (spec, t)
            print("  ".join(line), flush=True)
            if best:
                print(f"BEST {name} M={m} int8 {best[0]} {best[1]:.2f} us  vs exact_mm {t_ex:.2f}, "
                      f"default {t_def:.2f}", flush=True)


if __name__ == "__main__":
    main()
