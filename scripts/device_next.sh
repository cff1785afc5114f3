#!/usr/bin/env bash
# On the H200 (one GPU), in stages picked by STAGES (default "tests probe"); results under $OUT:
#   tests  the GPU tests of the sparse MLA (separate combine, step tilings), the step (PDL == plain
#          launches, graph == eager, teacher forcing, the 256-step run) and the TP-free ops
#          (GEMMs, wo_a with both dot paths, mhc, the indexer with both paths); TEST_S=540 for all
#   probe  the sparse-MLA plan sweep (scripts/probe_sparse_mla.py: inline vs separate combine)
#   qprobe the step's sparse-MLA tilings next to the separate-combine variants (short)
#   wprobe the grouped wo_a's plan variants (scripts/probe_wo_a.py)
#   iprobe the indexer logits' launch knobs (scripts/probe_indexer.py)
#   l2probe what an L2 prefetch during idle time buys the big GEMMs (scripts/probe_l2.py)
#   llprobe low_latency_mm with byte- vs word-loaded scales, both loops (scripts/probe_ll_mm.py)
#   gemm   `bench gemm` at every shape and row count (results under $OUT/results)
#   ncu    ncu on one launch of the sparse MLA's step plan (NCU_CASES, default 1x64: rows x heads):
#          registers, spills, stalls
#   bench  `bench step` (BENCH: its options; default every row count and context, default variants)
#   kprobe kernel time per name over one step replay per row bucket (scripts/probe_step_kernels.py;
#          PROBE_ARGS, default --rows=1,8,32,64 --context=32768)
# The seventh session ran: TESTS=... STAGES=tests, STAGES=bench (the whole matrix), kprobe, a
# sparse-MLA probe at 32 rows and STAGES=gemm (docs/step.md, "Seventh session").
export PYTHONPATH=.
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT/results"
STAGES=${STAGES:-"tests probe"}
for stage in $STAGES; do
  case $stage in
    tests)
      timeout ${TEST_S:-300} python -m pytest -v -rfE --durations=12 -m gpu ${TESTS:-tests/ops/test_sparse_mla.py \
        tests/decode/test_step_gpu.py tests/ops/test_low_latency_mm.py tests/ops/test_wo_a.py tests/ops/test_mhc.py \
        tests/ops/test_indexer.py} \
        > "$OUT/tests.txt" 2>&1; tail -25 "$OUT/tests.txt" ;;
    qprobe)   # the step's tilings next to the separate-combine variants (PROBE_ARGS to pick)
      timeout ${PROBE_S:-120} python scripts/probe_sparse_mla.py ${PROBE_ARGS:-"--only=step,sep,sep_k32,sep_k32_s10,sep_k32_w8,sep_k64,sep_bh32_k32,sep_bh32_w4" "--cases=1x64,1x8,2x64,4x64,8x64,16x64,64x64"} \
        2>&1 | tee "$OUT/qprobe_sparse_mla.txt" | tail -60 ;;
    probe)
      timeout ${PROBE_S:-300} python scripts/probe_sparse_mla.py 2>&1 | tee "$OUT/probe_sparse_mla.txt" | tail -90 ;;
    wprobe)   # the grouped wo_a's plan variants (BF16 tensor-core operands, splits, stages)
      timeout ${PROBE_S:-180} python scripts/probe_wo_a.py ${PROBE_ARGS:-} 2>&1 | tee "$OUT/probe_wo_a.txt" | tail -70 ;;
    llprobe)
      timeout ${PROBE_S:-120} python scripts/probe_ll_mm.py ${PROBE_ARGS:-} 2>&1 | tee "$OUT/probe_ll_mm.txt" | tail -30 ;;
    gemm)
      timeout ${GEMM_S:-240} python -m dsv41_decode bench gemm --out "$OUT/results" ${GEMM:-} > "$OUT/gemm.txt" 2>&1
      grep -v "^\s*$" "$OUT/gemm.txt" | tail -40 ;;
    kprobe)
      timeout ${PROBE_S:-120} python scripts/probe_step_kernels.py ${PROBE_ARGS:-"--rows=1,8,32,64" "--context=32768"} \
        2>&1 | grep -v -i warn | tee "$OUT/probe_step_kernels.txt" | tail -40 ;;
    l2probe)
      timeout ${PROBE_S:-120} python scripts/probe_l2.py ${PROBE_ARGS:-} 2>&1 | tee "$OUT/probe_l2.txt" | tail -60 ;;
    iprobe)
      timeout ${PROBE_S:-300} python scripts/probe_indexer.py 2>&1 | tee "$OUT/probe_indexer.txt" | tail -100 ;;
    ncu)
      NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
      timeout 240 "$NCU" --clock-control none -k regex:_sparse_mla_kernel -c 1 \
        --section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats \
        --section SchedulerStats --section MemoryWorkloadAnalysis \
        python scripts/probe_sparse_mla.py --once --cases=${NCU_CASES:-1x64} > "$OUT/ncu_sparse_mla.txt" 2>&1
      grep "Duration\|Registers Per\|Spilling Requests \|_sparse_mla_kernel (\|Warp Cycles Per Issued" \
        "$OUT/ncu_sparse_mla.txt" ;;
    bench)
      timeout ${BENCH_S:-560} python -m dsv41_decode bench step --out "$OUT/results" ${BENCH:-} 2>&1 \
        > "$OUT/bench.txt" 2>&1; grep -v "^\s*$" "$OUT/bench.txt" | tail -70 ;;
  esac
done
