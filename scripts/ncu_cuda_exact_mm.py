"""One `CudaExactMM` configuration at one V4.1-Flash shape and row count, called a few times, for
Nsight Compute to profile on a GPU (sm_90): what holds the kernel back (warp stalls by reason and
by instruction, memory throughput, occupancy) where timing alone cannot say.

    ncu --clock-control none --kernel-name regex:exact_digits_mm --launch-skip 3 --launch-count 1 \\
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \\
        --section SchedulerStats --section Occupancy --section LaunchStats --section SourceCounters \\
        python scripts/ncu_cuda_exact_mm.py --shape=wo_b --rows=8 --config=p4s4g4

--shape: fused_wqa_wkv, wq_b, idx_wq_b or wo_b (TP1); --rows: 1-16; --config: p<warps>s<stages>g<blocks>
(a configuration the source instantiates); --calls: calls made (default 5). Prints the
configuration and the bits against the reference's `mxfp8_mm` (`=` or the count of differing
outputs) and nothing else: the times are ncu's.
"""

from __future__ import annotations

import re

import torch

from dsv41_decode.bench.gemm import flash_shapes
from dsv41_decode.formats import fp8_block_quantize, mxfp8_quantize
from dsv41_decode.ops.cuda_exact_mm import CudaExactConfig, CudaExactMM
from dsv41_decode.reference.linear import mxfp8_mm

from _args import arg   # scripts/ is on sys.path when run as python scripts/<probe>.py

SHAPES = {s.name: (s.n, s.k) for s in flash_shapes(tps=(1,)) if s.kind == "fp8"}


def main() -> None:
    name = arg("shape", "wo_b")
    if name not in SHAPES:
        raise SystemExit(f"--shape must be one of {sorted(SHAPES)}, got {name!r}")
    n, k = SHAPES[name]
    rows = int(arg("rows", "8"))
    spec = arg("config", "p4s4g4")
    parsed = re.fullmatch(r"p(\d+)s(\d+)g(\d+)", spec)
    if parsed is None:
        raise SystemExit(f"--config must read p<warps>s<stages>g<blocks>, got {spec!r}")
    config = CudaExactConfig(*map(int, parsed.groups()))
    g = torch.Generator(device="cuda").manual_seed(n + k + rows)
    weight, w_scale = fp8_block_quantize(torch.randn(n, k, generator=g, device="cuda") * k ** -0.5)
    codes, x_scale = mxfp8_quantize(torch.randn(rows, k, generator=g, device="cuda").to(torch.bfloat16))
    op = CudaExactMM(weight, w_scale, 16, config=config)
    for _ in range(int(arg("calls", "5"))):
        y = op(codes, x_scale)
    want = mxfp8_mm(codes, x_scale, weight, w_scale)
    torch.cuda.synchronize()
    diff = int((y.view(torch.int16) != want.view(torch.int16)).sum())
    print(f"{name} N={n} K={k} rows={rows} {spec}: bits {'=' if diff == 0 else f'{diff} differ'}", flush=True)


if __name__ == "__main__":
    main()
