"""One `GluonExactMM` configuration at one V4.1-Flash shape and row count, called a few times, for
Nsight Compute to profile on a GPU (sm_90): what holds a configuration back (warp stalls, issue
slots, pipes, occupancy) where timing alone cannot say.

    ncu --clock-control none --kernel-name regex:_gluon_exact_mm --launch-skip 3 --launch-count 1 \\
        --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section Occupancy \\
        --section ComputeWorkloadAnalysis --section LaunchStats \\
        python scripts/ncu_gluon_exact_mm.py --shape=wq_b --rows=64 --config=f16d:64:32:2:32:4:1

--shape: fused_wqa_wkv, wq_b, idx_wq_b or wo_b (TP1); --rows: 1-64; --config: a GluonExactConfig
spec (`GluonExactConfig.from_spec`); --calls: calls made (default 5). Prints the configuration, the
bits against `ExactMM` (`=` or the count of differing outputs) and nothing else: the times are
ncu's.
"""

from __future__ import annotations

from dsv41_decode.ops.exact_mm import ExactMM
from dsv41_decode.ops.gluon_exact_mm import GluonExactConfig, GluonExactMM

from _args import arg   # scripts/ is on sys.path when run as python scripts/<probe>.py
from _linear_case import call_and_compare, linear_case


def main() -> None:
    name, n, k, rows, weight, w_scale, codes, x_scale = linear_case("wq_b", 8)
    spec = arg("config", "f16d:128:8:1:32:4:1:80")
    config = GluonExactConfig.from_spec(spec)
    op = GluonExactMM(weight, w_scale, 64, config=config)
    call_and_compare(op, codes, x_scale, ExactMM(weight, w_scale, 64), f"{name} N={n} K={k} rows={rows} {spec}")


if __name__ == "__main__":
    main()
