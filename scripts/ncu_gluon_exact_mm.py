"""One `GluonExactMM` configuration at one V4.1-Flash shape and row count, called a few times, for
Nsight Compute to profile on a GPU (sm_90): what holds a configuration back (warp stalls, issue
slots, pipes, occupancy) where timing alone cannot say.

    ncu --clock-control none --kernel-name regex:_gluon_exact_mm --launch-skip 3 --launch-count 1 \\
        --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section Occupancy \\
        --section ComputeWorkloadAnalysis --section LaunchStats \\
        python scripts/ncu_gluon_exact_mm.py --shape=wq_b --rows=64 --config=f16d:64:32:2:32:4:1

--shape: fused_wqa_wkv, wq_b, idx_wq_b or wo_b (TP1); --rows: 1-64; --config: a GluonExactConfig
spec (`GluonExactConfig.from_spec`); --calls: calls made (default 5). Prints the configuration, the
bits against `ExactMM` (`=` or the count of differing outputs) and nothing else: the times are
ncu's.
"""

from __future__ import annotations

import torch

from dsv41_decode.bench.gemm import flash_shapes
from dsv41_decode.ops.exact_mm import ExactMM
from dsv41_decode.ops.gluon_exact_mm import GluonExactConfig, GluonExactMM
from dsv41_decode.formats import fp8_block_quantize, mxfp8_quantize

from _args import arg   # scripts/ is on sys.path when run as python scripts/<probe>.py

SHAPES = {s.name: (s.n, s.k) for s in flash_shapes(tps=(1,)) if s.kind == "fp8"}


def main() -> None:
    name = arg("shape", "wq_b")
    if name not in SHAPES:
        raise SystemExit(f"--shape must be one of {sorted(SHAPES)}, got {name!r}")
    n, k = SHAPES[name]
    rows = int(arg("rows", "8"))
    spec = arg("config", "f16d:128:8:1:32:4:1:80")
    config = GluonExactConfig.from_spec(spec)
    g = torch.Generator(device="cuda").manual_seed(n + k + rows)
    weight, w_scale = fp8_block_quantize(torch.randn(n, k, generator=g, device="cuda") * k ** -0.5)
    codes, x_scale = mxfp8_quantize(torch.randn(rows, k, generator=g, device="cuda").to(torch.bfloat16))
    op = GluonExactMM(weight, w_scale, 64, config=config)
    for _ in range(int(arg("calls", "5"))):
        y = op(codes, x_scale)
    want = ExactMM(weight, w_scale, 64)(codes, x_scale)
    torch.cuda.synchronize()
    diff = int((y.view(torch.int16) != want.view(torch.int16)).sum())
    print(f"{name} N={n} K={k} rows={rows} {spec}: bits {'=' if diff == 0 else f'{diff} differ'}", flush=True)


if __name__ == "__main__":
    main()
