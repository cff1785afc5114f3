#!/usr/bin/env bash
# On the 2-GPU machine (nvidia-h200-x2): the TP GPU tests, then `bench step --tp 2` (results under $OUT).
set -x
export PYTHONPATH=. TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT/results"
nvidia-smi topo -m 2>&1 | head -8
timeout ${TEST_S:-300} python -m pytest -v -s -rfE --durations=8 -m gpu tests/decode/test_step_tp_gpu.py ${TESTS:-} \
  > "$OUT/tp_tests.txt" 2>&1; grep -v "^\s*$" "$OUT/tp_tests.txt" | tail -30
if [ -n "${BENCH:-}" ]; then
  timeout ${BENCH_S:-420} torchrun --nproc-per-node 2 -m dsv41_decode bench step --tp 2 --out "$OUT/results" $BENCH \
    > "$OUT/tp_bench.txt" 2>&1; grep -v "^\s*$" "$OUT/tp_bench.txt" | tail -60
fi
