#!/usr/bin/env bash
# One device run (H200) for the sparse-attention kernels: their GPU tests, then `bench attn`, with
# FlashMLA (sgl-flash-mla 1.0.0, carried as a wheel under .wheels/) as the baseline.
# Usage on the device machine, from the repo root: DSV41_COMMIT=<sha> bash scripts/device_attn.sh [bench args]
set -u
out=${OUT:-/tmp/out}
mkdir -p "$out/results"
if ls .wheels/sgl_flash_mla-*.whl >/dev/null 2>&1; then
    pip install -q --no-deps --target /tmp/fmla .wheels/sgl_flash_mla-*.whl > "$out/pip.log" 2>&1 || tail -3 "$out/pip.log"
fi
export PYTHONPATH=.:/tmp/fmla
python -c "import flash_mla; print('flash_mla', flash_mla.__version__, 'legacy', flash_mla.has_legacy())" 2>&1 | tail -1
python -m pytest -q -m gpu tests/ops/test_sparse_mla.py tests/ops/test_sparse_tables.py tests/ops/test_indexer.py \
    tests/ops/test_topk.py tests/ops/test_kv_write.py > "$out/gpu_tests_attn.log" 2>&1
echo "gpu tests: $(tail -1 "$out/gpu_tests_attn.log")"
grep -E "^(FAILED|ERROR)" "$out/gpu_tests_attn.log" | head -20
python -m dsv41_decode bench attn --out "$out/results" "$@" > "$out/bench_attn.log" 2>&1
echo "bench attn exit $?"
tail -120 "$out/bench_attn.log"
