"""Run by tests/ops/test_mhc.py in a subprocess without the Triton interpreter (the kernel must be a
real JIT function to compile), and by hand: compiles `ops.hc_mix`'s tensor-core kernel for sm_90 at
the V4.1-Flash shape (dim 5120, the default split), 64 rows a program, with the epilogue of 16 and
of 64 rows, and prints per variant its registers, stack, local memory, spill instructions and MMA
instructions (HGMMA: wgmma; HMMA: mma.sync). `--json`: one JSON object per line.
"""

from __future__ import annotations

import json
import sys

from dsv41_decode.ops import hc_mix as H
from dsv41_decode.testing.sm90 import compile_sm90, opcode_counts, resources, sass

TYPES = {"x_ptr": "*bf16", "fn_ptr": "*fp32", "scale_ptr": "*fp32", "base_ptr": "*fp32", "pre_ptr": "*fp32",
         "post_ptr": "*fp32", "comb_ptr": "*fp32", "part_ptr": "*fp32", "count_ptr": "*i32",
         "norm_eps": "fp32", "hc_eps": "fp32"}


def measure(epi_m: int, dim: int = 5120) -> dict:
    plan = H.HcMixPlan.build(dim, 64, "cpu", kernel="mma")
    t = plan.tile(64)
    fn = H._hc_mix_mma_kernel
    kernel = compile_sm90(fn, TYPES, dict(K=plan.k, ITERS=20, K_PER_SPLIT=plan.k_per_split, SPLIT=plan.split,
                                          ROWS=64, EPI_M=epi_m, BF16_DOT=True, NUM_STAGES=t.num_stages),
                          num_warps=t.num_warps, num_stages=t.num_stages)
    ops = opcode_counts([text for _, text in sass(kernel)])
    return dict(epi_m=epi_m, split=plan.split, **resources(kernel), spills=ops.get("STL", 0) + ops.get("LDL", 0),
                hgmma=ops.get("HGMMA", 0), hmma=ops.get("HMMA", 0))


def main() -> None:
    for epi_m in (16, 64):
        r = measure(epi_m)
        if "--json" in sys.argv:
            print(json.dumps(r), flush=True)
        else:
            print(f"EPI_M={r['epi_m']} split={r['split']}: REG {r['REG']} STACK {r['STACK']} SHARED {r['SHARED']} "
                  f"LOCAL {r['LOCAL']} STL/LDL {r['spills']} HGMMA {r['hgmma']} HMMA {r['hmma']}", flush=True)


if __name__ == "__main__":
    main()
