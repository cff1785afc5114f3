#!/usr/bin/env bash
# On the GPU machine: the decode step's GPU tests, a smoke run and `bench step` (results under $OUT).
set -x
export PYTHONPATH=.
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT/results"
python -m pytest -q -m gpu tests/ops/test_mhc.py tests/ops/test_compressor.py ${TESTS:-} 2>&1 | tail -15
timeout ${SMOKE_S:-200} python scripts/step_smoke.py 2>&1 | tail -45
if [ -n "${BENCH:-}" ]; then
  python -m dsv41_decode bench step --out "$OUT/results" $BENCH 2>&1 | tail -80
fi
