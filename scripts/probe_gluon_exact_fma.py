"""Probe `gluon_exact_fma` on a GPU (sm_90): `GluonExactFMA` (the contract-exact linear on the FP64
CUDA cores in Gluon, 1-4 rows) in candidate configurations against `ExactMM` (CUDA cores, FP32),
`GluonExactMM` in `ExactLinear`'s plan (`ExactLinear(mma_above=0, fma_rows=0)`: GluonExactMM in
its measured configurations at every row count), `ExactLinear` as it is (the step's exact
linear) and the
step's tensor-core FP8 plan `GluonMM` (not exact), at the four V4.1-Flash shapes of the step's
GEMMs (TP1), rows 1, 2, 3, 4: us per call from CUDA-graph replay over weight copies rotated beyond
L2 (`probe_gluon_exact_mm._time`, as `bench gemm`; median of the replays), % of the streaming read
measured in the same run, and per line the bits against ExactMM's (must be `=`, 0 differing
outputs, on model-like operands). Then, per shape, heavy-tailed codes (448 down to the
subnormals) against `reference.linear.mxfp8_mm` per configuration; the best configuration per
(shape, rows) against the others, and per shape the per-row table a plan would take
(`GluonExactFMA(config={rows: config})`); each compiled kernel's registers and spills.

    PYTHONPATH=. python scripts/probe_gluon_exact_fma.py
    PYTHONPATH=. python scripts/probe_gluon_exact_fma.py --rows=1,4 --only=wo_b --alt=1:4:2:8:80,4:4:1:4:128:6

--alt: configurations rows_per_thread:warps_k:lanes_k:stages[:maxnreg[:split]]
(`GluonExactFMAConfig.from_spec`; maxnreg 0: None, default 128; split: programs per weight tile
that share its K, default 1), for every shape; without it each shape takes CANDIDATES and its
SPLIT_CANDIDATES. `--budget=` s (default 480) stops the timing; the summary still prints.
`PROBE_DRY=1` runs the script on the CPU at small shapes with the reference in place of every
kernel (checks the script only, no timing worth reading).
"""

from __future__ import annotations

import os
import time

from dsv41_decode.ops import gluon_exact_fma as F
from dsv41_decode.ops.gluon_exact_fma import GluonExactFMAConfig

from _args import arg   # scripts/ is on sys.path when run as python scripts/<probe>.py
from probe_gluon_exact_mm import SHAPES, _DryPlan, _kernels, probe, summarize

DRY = os.environ.get("PROBE_DRY") == "1"
ROWS = (1, 2, 3, 4)
# rows_per_thread:warps_k:lanes_k:stages[:maxnreg]. block_n = 32 x rows_per_thread x 4 / warps_k /
# lanes_k weight rows a program: wq_b (32768 rows) 256 programs of 128 or 128 of 256; the indexer's
# wq_b (4096) 128 of 32, 256 of 16; fused wq_a|wkv (1792) 56 of 32, 112 of 16, 224 of 8; wo_b
# (5120) 160 of 32, 320 of 16. sm_90 compiles, the consumer's loop (one 128-deep slot) in SASS
# instructions per weight code a thread at 1 / 2 / 4 x rows: 4:4:1 4.7 / 6.1 / 9.2, 4:2:1 4.7 /
# 6.0 / 9.1, 2:4:1 5.2 / 6.9 / 10.2, 1:4:1 6.9 / 8.6 / 13.0, 4:4:2 5.5 / 7.6 / 11.5, 2:4:2 6.6 /
# 8.8 / 13.3, 1:4:2 8.6 / 11.2 / 17.3, 2:4:4 9.4 / 13.0 / 20.1, 1:4:4 15.0 / 17.0 / 26.8 (the
# slot's fixed work - x's conversion, the barriers, the scales, the terms - over fewer codes); no
# spills at a cap of 128 or 80 (3 CTAs per SM where the shared memory allows). The plan's
# default (`default_config`): 4:4:1:4 for wq_b, 1:4:2:8:80 for the indexer's wq_b and wo_b,
# 1:4:4:8:80 for fused wq_a|wkv.
CANDIDATES = ["4:4:1:4", "4:2:1:3", "2:4:1:4", "2:4:1:6:80", "1:4:1:8:80", "4:4:2:4", "2:4:2:6:80", "1:4:2:8:80",
              "2:4:4:8:80", "1:4:4:8:80", "1:2:2:8:80", "2:2:1:4"]
# The K split (field 6; `GluonExactFMAConfig.split`) for the shapes with few weight rows for their K:
# large tiles, N / block_n x split programs near 1, 2 or 3 an SM (132 SMs; 2 CTAs an SM resident at
# a cap of 128 registers, 3 at 80 where the shared memory allows). sm_90 compiles of the split
# kernel, the consumer's loop in instructions per weight code at 1 / 2 / 4 x rows (split=1 in
# brackets): 4:4:1:4 4.82 / 6.21 / 9.37 (4.73 / 6.14 / 9.24), 4:4:1:4:80 4.93 / 6.42 / 9.66,
# 2:2:1:4 4.98 / 6.57 / 9.63, 4:2:1:3 4.59 / 5.97 / 9.20, 2:4:1:6:80 5.59 / 7.17 / 10.89 (5.41 / 6.98
# / 10.67), 2:4:1:4 5.44 / 6.95 / 10.38, 1:2:1:6:80 6.28 / 7.91 / 12.02, 1:4:1:8:80 7.03 / 8.91 /
# 13.28, 2:4:2:6:80 6.81 / 9.28 / 14.06 (the publish of each slot's terms: one 16-byte store a
# thread per 512 terms, a branch); no spills. The last arriver then adds 4 (steps - per) + 1 terms
# an output (per: steps a split), 64 / (outputs a thread) loads at a time. Estimates in us at 1 / 2
# / 4 rows (3 us of launch, fill and drain + the busiest SM's slots x loop x its programs / an issue
# rate fitted to the measured unsplit runs, 0.5-0.6 an SP a cycle + the last arriver's chunks at
# ~600 cycles of L2 latency each and 64 bytes a cycle; ExactMM / GluonExactMM for comparison):
# wo_b (64 steps; ExactMM 17.0 / 30.4 / 54.1, GluonExactMM 29.7)
#   4:4:1:4:128:6  240 programs of 11 steps  18.5 / 24.4 / 37.3
#   4:4:1:4:80:6   as above, 3 CTAs an SM     18.8 / 24.9 / 38.1
#   2:2:1:4:128:6  (wq_b's best form)         19.0 / 25.3 / 38.0
#   4:2:1:3:128:13 260 of 256 rows x 5 steps  19.3 / 27.3 / 48.9 (the tail: 237 terms x 256 rows)
#   4:4:1:4:80:8   320, 3 an SM               20.1 / 27.0 / 41.1
#   4:4:1:4:128:3  120, one an SM             20.3 / 26.7 / 40.0
#   2:4:1:4:128:3  240 of 64 rows             21.1 / 26.1 / 38.3
#   2:4:1:6:80:3   240 of 64 rows, 3 an SM    21.6 / 26.7 / 39.9
#   2:4:1:6:80:4   320 of 64 rows             23.6 / 29.2 / 43.5
#   4:4:1:4:128:4  160 (two an SM on 28 SMs)  24.4 / 32.0 / 48.2
# fused wq_a|wkv (40 steps; ExactMM 6.45 / 11.1 / 15.9, GluonExactMM 12.6)
#   2:4:1:6:80:14  392 of 64 rows x 3 steps   8.0 / 9.2 / 12.9
#   4:4:1:4:128:8  112 of 128 rows x 5        8.2 / 10.6 / 15.5
#   4:4:1:4:128:14 196 x 3                    8.3 / 10.7 / 16.1
#   4:4:1:4:80:20  280 x 2, 3 an SM           8.4 / 10.9 / 16.4
#   2:4:1:6:80:8   224 x 5                    8.4 / 9.7 / 13.6
#   2:4:1:6:80:4   112 x 10                   8.5 / 10.0 / 14.2
#   1:2:1:6:80:8   224 x 5 (2 warps along K)  8.8 / 10.2 / 14.4
#   2:4:1:6:80:10  280 x 4                    9.1 / 10.7 / 15.1
#   2:4:2:6:80:7   392 of 32 rows x 6         9.4 / 11.2 / 14.8
#   1:4:1:8:80:7   392 of 32 rows x 6         9.6 / 10.9 / 14.3
# the indexer's wq_b (10 steps; ExactMM 4.7 / 6.4 / 8.7, GluonExactMM 6.6)
#   4:4:1:4:128:10 320 of 128 rows x 1 step   5.3 / 6.3 / 8.2
#   4:4:1:4:80:10  as above, 3 an SM          5.4 / 6.4 / 8.3
#   4:4:1:4:128:4  128 x 3 (3 + 3 + 3 + 1)    5.6 / 6.3 / 8.3
#   2:4:1:6:80:2   128 of 64 rows x 5         5.7 / 6.4 / 7.9
#   2:4:1:6:80:4   256 x 3                    5.8 / 6.5 / 8.1
#   2:4:1:6:80:5   320 x 2                    5.8 / 6.5 / 8.5
#   4:4:1:4:128:5  160 x 2                    5.9 / 7.1 / 9.3
#   1:2:1:6:80:2   128 of 64 rows x 5         6.0 / 6.7 / 8.4
#   2:4:2:6:80:2   256 of 32 rows x 5         6.2 / 7.2 / 9.1
#   1:4:1:8:80:2   256 of 32 rows x 5         6.4 / 7.1 / 8.8
# Without --alt a shape's run takes CANDIDATES and its SPLIT_CANDIDATES.
SPLIT_CANDIDATES = {
    "wo_b": ["4:4:1:4:128:6", "4:4:1:4:80:6", "2:2:1:4:128:6", "4:2:1:3:128:13", "4:4:1:4:80:8", "4:4:1:4:128:3",
             "2:4:1:4:128:3", "2:4:1:6:80:3", "2:4:1:6:80:4", "4:4:1:4:128:4"],
    "fused_wqa_wkv": ["2:4:1:6:80:14", "4:4:1:4:128:8", "4:4:1:4:128:14", "4:4:1:4:80:20", "2:4:1:6:80:8",
                      "2:4:1:6:80:4", "1:2:1:6:80:8", "2:4:1:6:80:10", "2:4:2:6:80:7", "1:4:1:8:80:7"],
    "idx_wq_b": ["4:4:1:4:128:10", "4:4:1:4:80:10", "4:4:1:4:128:4", "2:4:1:6:80:2", "2:4:1:6:80:4", "2:4:1:6:80:5",
                 "4:4:1:4:128:5", "1:2:1:6:80:2", "2:4:2:6:80:2", "1:4:1:8:80:2"],
}


def config_of(spec: str) -> GluonExactFMAConfig:
    return GluonExactFMAConfig.from_spec(spec)


if DRY:
    GluonExactFMA = ExactMM = ExactLinear = GluonMM = _DryPlan
else:
    from dsv41_decode.ops.exact_linear import ExactLinear
    from dsv41_decode.ops.exact_mm import ExactMM
    from dsv41_decode.ops.gluon_exact_fma import GluonExactFMA
    from dsv41_decode.ops.gluon_mm import GluonMM


def main() -> None:
    t0 = time.time()
    rows = [int(r) for r in arg("rows", ",".join(map(str, ROWS))).split(",")]
    names = arg("only", ",".join(SHAPES)).split(",")
    alt = [s for s in arg("alt", "").split(",") if s]
    shape_specs = {name: alt or CANDIDATES + SPLIT_CANDIDATES.get(name, []) for name in names}
    for s in {s for specs in shape_specs.values() for s in specs}:
        config_of(s)                        # a bad spec fails here, before anything runs

    def others(ws):
        return {"exact_mm": [ExactMM(w, s, 64) for w, s in ws],
                "gluon_exact_mm": [ExactLinear(w, s, 64, mma_above=0, fma_rows=0) for w, s in ws] if not DRY
                else [_DryPlan(w, s) for w, s in ws],
                "exact_linear": [ExactLinear(w, s, 64) for w, s in ws],
                "gluon(TC)": [GluonMM(w, s, 64) for w, s in ws]}

    seen: set = set()

    def new_kernels():
        """Print the registers, spills and shared memory of each GluonExactFMA kernel compiled since."""
        for key, kernel in ({} if DRY else _kernels(F._gluon_exact_fma_kernel)).items():
            if key not in seen:
                seen.add(key)
                print(f"  compiled: registers {kernel.n_regs}, spills {kernel.n_spills}, "
                      f"shared {kernel.metadata.shared} B", flush=True)

    results, base, floor = probe(
        t0, "GluonExactFMA", lambda w, s, spec: GluonExactFMA(w, s, 4, config=config_of(spec)), shape_specs, others,
        rows, "gluon_exact_mm", ("exact_mm", "gluon_exact_mm", "gluon(TC)"), 14, 1, (1, 2, 3, 4),
        after_rows=new_kernels)
    summarize(results, base, floor, "GluonExactFMA", (("exact_mm", "exact_mm", 8, "x exact", 7),
                                                       ("gluon_exact_mm", "g_ex_mm", 7, "x g_ex", 6)), 14, 4)
    print(f"total {time.time() - t0:.0f} s", flush=True)

if __name__ == "__main__":
    main()
