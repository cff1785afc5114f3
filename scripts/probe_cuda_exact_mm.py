"""Probe `CudaExactMM` on a GPU (sm_90): the contract-exact linear on FP16 digits in CUDA C++ (one
accumulating warp a CTA, no CTA barrier in the main loop), in every configuration the source
instantiates (each with one CTA a tile and on stream-K grids of 1, 2 and 3 CTAs an SM: `k1`-`k3`;
`m2`: tiles of 32 weight rows), against `ExactLinear` (the step's exact linear: GluonExactFMA / ExactMM /
GluonExactMM by row count) and the tensor-core tier `GluonMM` (not exact), at the four V4.1-Flash
shapes of the step's FP8 linears (TP1), rows 1, 2, 4, 8, 16: us per call from CUDA-graph replay
over weight copies rotated beyond L2 (as `bench gemm`; median of the replays), % of the streaming
read measured in the same run (the bytes `bench gemm` counts), and per line whether every
configuration's output is bitwise ExactLinear's on model-like operands (`bits =`) and the
reference's on heavy-tailed codes with random scale bytes (`heavy =`). Each kernel's registers and
local bytes are printed once.

    PYTHONPATH=. python scripts/probe_cuda_exact_mm.py [--rows=1,2,4,8,16] [--only=wo_b,wq_b]
"""

from __future__ import annotations

import time

import torch

from dsv41_decode.bench.floor import read_bandwidth_gbps
from dsv41_decode.bench.gemm import Shape
from dsv41_decode.bench.timing import graph_time_us, l2_rotation
from dsv41_decode.formats import fp8_block_quantize, mxfp8_quantize
from dsv41_decode.ops.cuda_exact_mm import ROWS_PER_TILE, CudaExactConfig, CudaExactMM, compiled_kernels
from dsv41_decode.ops.exact_linear import ExactLinear
from dsv41_decode.ops.gluon_mm import GluonMM
from dsv41_decode.reference.linear import mxfp8_mm
from dsv41_decode.testing.synthetic import heavy_e4m3

from _args import arg   # scripts/ is on sys.path when run as python scripts/<probe>.py

SHAPES = {"wo_b": Shape("wo_b", 5120, 8192), "wq_b": Shape("wq_b", 32768, 1280),
          "fused_wqa_wkv": Shape("fused_wqa_wkv", 1792, 5120), "idx_wq_b": Shape("idx_wq_b", 4096, 1280)}


def configs_for(rows: int) -> list[CudaExactConfig]:
    """Every instantiated kernel for `rows`, with one CTA a tile and on stream-K grids of 1, 2 and 3 CTAs an SM."""
    tiles = -(-rows // ROWS_PER_TILE)
    return [CudaExactConfig(p, s, g, ctas, mt) for nt, p, s, g, mt in sorted(compiled_kernels()) if nt == tiles
            for ctas in (0, 1, 2, 3)]


def plan_config(rows: int, c: CudaExactConfig) -> dict[int, CudaExactConfig]:
    """A 16-row plan whose calls of `rows` rows take `c` (the other bucket the default's)."""
    return {8: c, 16: CudaExactConfig(4, 4)} if rows <= ROWS_PER_TILE else {8: CudaExactConfig(4, 4), 16: c}


def main() -> None:
    t0 = time.time()
    rows = [int(r) for r in arg("rows", "1,2,4,8,16").split(",")]
    names = arg("only", ",".join(SHAPES)).split(",")
    floor = read_bandwidth_gbps()
    print(f"streaming read {floor:.0f} GB/s on {torch.cuda.get_device_name()}", flush=True)
    gen = torch.Generator("cuda").manual_seed(0)
    shown = set()
    for name in names:
        shape = SHAPES[name]
        copies = l2_rotation(shape.weight_bytes())
        ws = [fp8_block_quantize(torch.randn(shape.n, shape.k, generator=gen, device="cuda") * shape.k ** -0.5)
              for _ in range(copies)]
        exact = [ExactLinear(w, s, 16) for w, s in ws]
        tc = [GluonMM(w, s, 16) for w, s in ws]
        hw = heavy_e4m3((shape.n, shape.k), gen)
        hws = torch.randint(110, 140, (-(-shape.n // 32), shape.k // 32), generator=gen, device="cuda",
                            dtype=torch.uint8)
        for m in rows:
            x, xs = mxfp8_quantize(torch.randn(m, shape.k, generator=gen, device="cuda").bfloat16())
            out = torch.empty(m, shape.n, dtype=torch.bfloat16, device="cuda")
            hx = heavy_e4m3((m, shape.k), gen)
            hxs = torch.randint(100, 150, (m, shape.k // 32), generator=gen, device="cuda", dtype=torch.uint8)
            want_heavy = mxfp8_mm(hx, hxs, hw, hws)
            base = exact[0](x, xs).clone()
            pct = lambda us: 100 * (shape.weight_bytes() + shape.io_bytes(m)) / (us * 1e3) / floor  # noqa: E731
            cells = []
            for c in configs_for(m):
                try:
                    plans = [CudaExactMM(w, s, 16, plan_config(m, c)) for w, s in ws]
                except ValueError as e:                 # an SM holds fewer CTAs than the grid asks
                    cells.append(f"{c.spec} -- ({e})")
                    continue
                fn, _ = plans[0].function_for(m)
                if fn.name not in shown:
                    shown.add(fn.name)
                    print(f"  {fn.name}: {fn.registers} registers, {fn.local_bytes} local bytes, {fn.smem} B smem",
                          flush=True)
                bits = torch.equal(plans[0](x, xs, out).view(torch.int16), base.view(torch.int16))
                heavy = torch.equal(CudaExactMM(hw, hws, 16, plan_config(m, c))(hx, hxs).view(torch.int16),
                                    want_heavy.view(torch.int16))
                us = graph_time_us(lambda: [p(x, xs, out) for p in plans], calls_per_graph=copies)
                cells.append(f"{c.spec} {us:6.2f} ({pct(us):3.0f}%) bits {'=' if bits else 'X'} "
                             f"heavy {'=' if heavy else 'X'}")
            ex = graph_time_us(lambda: [p(x, xs, out) for p in exact], calls_per_graph=copies)
            tcu = graph_time_us(lambda: [p(x, xs, out) for p in tc], calls_per_graph=copies)
            print(f"{name:14s} rows {m:2d} | " + " | ".join(cells)
                  + f" | exact_linear {ex:6.2f} ({pct(ex):3.0f}%) | tc {tcu:6.2f} ({pct(tcu):3.0f}%)", flush=True)
    print(f"total {time.time() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
