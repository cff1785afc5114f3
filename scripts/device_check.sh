#!/usr/bin/env bash
# One device run (H200): the GPU tests, then `bench gemm`; logs and results under $OUT.
# Usage on the device machine, from the repo root: DSV41_COMMIT=<sha> bash scripts/device_check.sh [bench args]
set -u
export PYTHONPATH=.
out=${OUT:-/tmp/out}
mkdir -p "$out/results"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
python -m pytest -q -m gpu tests > "$out/gpu_tests.log" 2>&1
echo "gpu tests: $(tail -1 "$out/gpu_tests.log")"
grep -E "^(FAILED|ERROR)" "$out/gpu_tests.log" | head -20
python -m dsv41_decode bench gemm --out "$out/results" "$@" > "$out/bench_gemm.log" 2>&1
echo "bench gemm exit $?"
tail -150 "$out/bench_gemm.log"
