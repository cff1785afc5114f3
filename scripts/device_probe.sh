#!/usr/bin/env bash
# On any H200 machine: the sparse MLA probe, then ncu on one launch of the default plan (1 row, 64 heads).
export PYTHONPATH=.
OUT=${OUT:-/tmp/out}
python scripts/probe_sparse_mla.py 2>&1 | tee "$OUT/probe_sparse_mla.txt" | tail -100
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
if [ -n "$NCU" ]; then
  timeout 240 "$NCU" --clock-control none -k regex:_sparse_mla_kernel -c 1 \
    --section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats \
    --section SchedulerStats --section MemoryWorkloadAnalysis \
    python scripts/probe_sparse_mla.py --once > "$OUT/ncu_sparse_mla.txt" 2>&1
  grep "Duration\|Registers Per\|Spilling Requests \|_sparse_mla_kernel (\|Warp Cycles Per Issued" "$OUT/ncu_sparse_mla.txt"
fi
