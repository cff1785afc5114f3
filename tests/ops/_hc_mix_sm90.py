"""Run by tests/ops/test_mhc.py in a subprocess without the Triton interpreter (the kernel must be a
real JIT function to compile), and by hand: compiles `ops.hc_mix`'s tensor-core kernel for sm_90 at
the V4.1-Flash shape (dim 5120, the default split) with 16 and with 64 of the call's rows a program
(and as many in the epilogue), and prints per variant its registers, stack, local memory, spill
instructions, MMA instructions (HGMMA: wgmma; HMMA: mma.sync) and their forms (shape, accumulate
flags; registers blanked). `--json`: one JSON object per line.
"""

from __future__ import annotations

import json
import re
import sys

from dsv41_decode.ops import hc_mix as H
from dsv41_decode.testing.sm90 import compile_sm90, opcode_counts, resources, sass

TYPES = {"x_ptr": "*bf16", "fn_ptr": "*fp32", "scale_ptr": "*fp32", "base_ptr": "*fp32", "pre_ptr": "*fp32",
         "post_ptr": "*fp32", "comb_ptr": "*fp32", "part_ptr": "*fp32", "count_ptr": "*i32",
         "norm_eps": "fp32", "hc_eps": "fp32"}


def measure(rows: int, dim: int = 5120) -> dict:
    """rows: the call's rows a program takes (16, 32 or 64), which is also its epilogue's rows."""
    plan = H.HcMixPlan.build(dim, 64, "cpu", kernel="mma")
    t = plan.tile(64)
    fn = H._hc_mix_mma_kernel
    kernel = compile_sm90(fn, TYPES, dict(K=plan.k, ITERS=20, K_PER_SPLIT=plan.k_per_split, SPLIT=plan.split,
                                          ROWS=rows, EPI_M=rows, BF16_DOT=True, NUM_STAGES=t.num_stages),
                          num_warps=t.num_warps, num_stages=t.num_stages)
    texts = [text for _, text in sass(kernel)]
    ops = opcode_counts(texts)
    # the MMA instructions with their operands' registers and descriptors blanked: their shapes and
    # accumulate flags, which must not depend on the rows
    forms = sorted({re.sub(r"\bU?R\d+\b|gdesc\[[^\]]*\]", "_", t) for t in texts if "MMA" in t.split()[0]})
    return dict(rows=rows, split=plan.split, **resources(kernel), spills=ops.get("STL", 0) + ops.get("LDL", 0),
                hgmma=ops.get("HGMMA", 0), hmma=ops.get("HMMA", 0), mma_forms=forms)


def main() -> None:
    for rows in (16, 64):
        r = measure(rows)
        if "--json" in sys.argv:
            print(json.dumps(r), flush=True)
        else:
            print(f"rows={r['rows']} split={r['split']}: REG {r['REG']} STACK {r['STACK']} SHARED {r['SHARED']} "
                  f"LOCAL {r['LOCAL']} STL/LDL {r['spills']} HGMMA {r['hgmma']} HMMA {r['hmma']} {r['mma_forms']}",
                  flush=True)


if __name__ == "__main__":
    main()
