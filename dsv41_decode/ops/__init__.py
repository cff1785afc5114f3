"""Triton kernels, one family per file: the `@triton.jit` kernel(s), a launcher that validates
shapes, strides and dtypes and writes into caller-owned buffers, then a public function that
allocates. Each op's reference lives in `dsv41_decode/reference/` and its test in `tests/ops/`.
"""
