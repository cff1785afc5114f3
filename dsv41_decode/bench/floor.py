"""The bandwidth floor, measured in the same run as the benchmark: a streaming read of >= 1 GB."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .timing import graph_time_us


@triton.jit
def _read_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    # Each program reads ITERS blocks of int32 words (16-byte vector loads) and writes one word, so
    # the traffic is the read alone.
    pid = tl.program_id(0)
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    base = pid.to(tl.int64) * BLOCK * ITERS
    for i in range(ITERS):
        offs = base + i * BLOCK + tl.arange(0, BLOCK)
        acc ^= tl.load(x_ptr + offs, mask=offs < n, other=0, cache_modifier=".cg")
    tl.store(out_ptr + pid, tl.reduce(acc, 0, _xor))


@triton.jit
def _xor(a, b):
    return a ^ b


def read_bandwidth_gbps(nbytes: int = 2 << 30) -> float:
    """Streaming-read bandwidth in GB/s (1e9 bytes/s): a read-only kernel over `nbytes` of memory."""
    n = nbytes // 4
    x = torch.randint(-2 ** 31, 2 ** 31 - 1, (n,), dtype=torch.int32, device="cuda")
    block, iters = 4096, 16
    grid = triton.cdiv(n, block * iters)
    out = torch.empty(grid, dtype=torch.int32, device="cuda")

    def run():
        _read_kernel[(grid,)](x, out, n, BLOCK=block, ITERS=iters, num_warps=8)

    us = graph_time_us(run, replays=20)
    del x
    return nbytes / (us * 1e-6) / 1e9
