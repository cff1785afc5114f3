"""Which of the step's kernel families moves an official trace off on the GPU: `trace verify --path step`
of the first decode call(s) of a case, once per variant - the step as built (its exact linears), the
FP8 linears on tensor cores (`exact_linears=False`), `fp32_dots=True`, and each Gluon family swapped
for its Triton tier (the tensor-core FP8 linears, the sparse MLA, `wo_a`), then all three - printing per layer the attn_out distance (BF16 ulps), its relative RMS and
the quantized values (window, compressed and index-key records) that differ bitwise.

    PYTHONPATH=. python scripts/probe_trace_families.py [case folder] [decode calls]

(GPU; ~100 s for official-tiny with one decode call on an H200. Defaults: tests/data/official-tiny,
1.) `DEV=cpu` with TRITON_INTERPRET=1 runs it in the interpreter, where no Gluon kernel runs.
"""
import os
import sys
import time

import dsv41_decode.decode.attention as att
from dsv41_decode.ops.sparse_mla_plan import SparseMlaPlan
from dsv41_decode.testing.trace import verify_trace

ORIG = {k: getattr(att, k) for k in ("GluonMM", "sparse_mla_plans", "GluonWoAPlan")}


class NoGluonMM(ORIG["GluonMM"]):
    """fp8_linear_plan falls back to the Triton tier when the Gluon plan refuses the shape."""

    def __init__(self, *a, **k):
        raise ValueError("off")


class NoGluonWoA:
    """wo_a_plan falls back to the Triton plan when the Gluon plan refuses the shape."""

    @staticmethod
    def build(*a, **k):
        raise ValueError("off")


def triton_mla(max_rows, heads, window, topk, device, *, workspace=None, fp32_dots=False):
    """sparse_mla_plans with the Triton plans in place of the Gluon ones."""
    return SparseMlaPlan.for_step(max_rows, heads, window, topk, device, workspace=workspace, fp32_dots=fp32_dots)


# name: (DecodeStep options, attention-module names replaced)
TC = {"exact_linears": False}
VARIANTS = [("default", {}, {}), ("tc_linears", TC, {}), ("fp32_dots", {"fp32_dots": True}, {}),
            ("triton_mm", TC, {"GluonMM": NoGluonMM}), ("triton_mla", {}, {"sparse_mla_plans": triton_mla}),
            ("triton_wo_a", {}, {"GluonWoAPlan": NoGluonWoA}),
            ("all_triton", TC, {"GluonMM": NoGluonMM, "sparse_mla_plans": triton_mla, "GluonWoAPlan": NoGluonWoA})]


def main() -> None:
    case = sys.argv[1] if len(sys.argv) > 1 else "tests/data/official-tiny"
    calls = int(sys.argv[2]) if len(sys.argv) > 2 else 1
    for name, opts, patch in VARIANTS:
        t0 = time.time()
        try:
            for k, v in ORIG.items():
                setattr(att, k, patch.get(k, v))
            res = verify_trace(case, path="step", device=os.environ.get("DEV", "cuda"), calls=calls, **opts)
        except Exception as e:
            print(f"{name}: {type(e).__name__}: {e}", flush=True)
            continue
        finally:
            for k, v in ORIG.items():
                setattr(att, k, v)
        dec = [r for r in res if r.call != "prefill"]
        print(f"{name:13s} ({time.time() - t0:.0f} s) failing {sum(1 for r in dec if r.failures)}/{len(dec)} | "
              + " ".join(f"L{r.layer}:{r.attn_out_ulp:.0f}u/{r.attn_out_rel_rms:.1e}/q{sum(r.quant_bits.values())}"
                         for r in dec), flush=True)


if __name__ == "__main__":
    main()
