"""Triton kernels, one family per file: the `@triton.jit` kernel(s), a launcher that validates
shapes, strides and dtypes and writes into caller-owned buffers, then a public function that
allocates. Each op's reference lives in `dsv41_decode/reference/` and its test in `tests/ops/`.
"""

# Rows up to which the MXFP8 linears take `low_latency_mm` instead of the regular `fp8_mm`: the
# crossover measured on an H200 (docs/gemm.md, docs/results/gemm-h200.jsonl): low_latency_mm is
# 1.3-13.9x faster at every M <= 32 on every V4.1-Flash shape and TP shard; at M = 64 it is
# 1.0-3.9x faster on 9 of the 10 shapes and 9 % slower on wo_b's TP8 shard.
LOW_BATCH_MAX_ROWS = 64
