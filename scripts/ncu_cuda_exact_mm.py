"""One `CudaExactMM` configuration at one V4.1-Flash shape and row count, called a few times, for
Nsight Compute to profile on a GPU (sm_90): what holds the kernel back (warp stalls by reason and
by instruction, memory throughput, occupancy) where timing alone cannot say.

    ncu --clock-control none --kernel-name regex:exact_digits_mm --launch-skip 3 --launch-count 1 \\
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \\
        --section SchedulerStats --section Occupancy --section LaunchStats --section SourceCounters \\
        python scripts/ncu_cuda_exact_mm.py --shape=wo_b --rows=8 --config=p4s4g4

--shape: fused_wqa_wkv, wq_b, idx_wq_b or wo_b (TP1); --rows: 1-16; --config:
p<warps>s<stages>g<blocks>[m<m_tiles>][k<ctas_per_sm>] (`CudaExactConfig.from_spec`; one the source
instantiates); --calls: calls made (default 5). Prints the configuration and the bits against the
reference's `mxfp8_mm` (`=` or the count of differing outputs) and nothing else: the times are ncu's.
"""

from __future__ import annotations

from dsv41_decode.ops.cuda_exact_mm import CudaExactConfig, CudaExactMM
from dsv41_decode.reference.linear import mxfp8_mm

from _args import arg   # scripts/ is on sys.path when run as python scripts/<probe>.py
from _linear_case import call_and_compare, linear_case


def main() -> None:
    name, n, k, rows, weight, w_scale, codes, x_scale = linear_case("wo_b", 8)
    spec = arg("config", "p4s4g4")
    try:
        config = CudaExactConfig.from_spec(spec)
    except ValueError as e:
        raise SystemExit(f"--config: {e}")
    op = CudaExactMM(weight, w_scale, rows, config=config)     # the kernels of this row count only
    call_and_compare(op, codes, x_scale, lambda c, s: mxfp8_mm(c, s, weight, w_scale),
                     f"{name} N={n} K={k} rows={rows} {spec}")


if __name__ == "__main__":
    main()
