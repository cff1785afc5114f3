"""Probe the grouped `wo_a` kernel on a GPU: plan variants side by side (graph replay over weight
copies rotated beyond L2, 32+ calls per graph) at the step's shape (64 heads, 8 groups of 1024
outputs, BF16 and FP8 weights), rows 1, 4, 16. Every variant's output is compared with the
default plan's (max abs difference). `--only=a,b` picks variants, `--rows=1,4` the rows.
Prints; writes nothing.
"""

from __future__ import annotations

import math

import torch

from dsv41_decode.bench.timing import graph_time_us, l2_rotation
from dsv41_decode.ops.wo_a import WoAPlan, quantize_wo_a, wo_a_

from _args import arg   # scripts/ is on sys.path when run as python scripts/<probe>.py

HEADS, GROUPS, RANK = 64, 8, 1024


def step_weight(gen: torch.Generator) -> torch.Tensor:
    """An FP32 wo_a weight of the step's shape [G*R, H/G*512], unit-variance outputs."""
    k = HEADS // GROUPS * 512
    return torch.randn(GROUPS * RANK, k, generator=gen, device="cuda") * k ** -0.5


def weight_copies(w: torch.Tensor, fp8: bool) -> tuple[list[torch.Tensor], torch.Tensor | None, int]:
    """(copies of w as BF16 or FP8 codes, enough to rotate beyond L2; the FP8 scale or None; the
    bytes one call reads)."""
    weight, scale = quantize_wo_a(w) if fp8 else (w.bfloat16(), None)
    nbytes = weight.numel() * weight.element_size() + (scale.numel() if fp8 else 0)
    return [weight.clone() for _ in range(l2_rotation(nbytes))], scale, nbytes


def rotated_inputs(m: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(o [m, H, 512] BF16, cos, sin [m, 32]) of random RoPE angles."""
    o = torch.randn(m, HEADS, 512, generator=gen, device="cuda").bfloat16()
    ang = torch.rand(m, 32, generator=gen, device="cuda") * 2 * math.pi
    return o, torch.cos(ang), torch.sin(ang)
# "+quant": the launch also writes the MXFP8 of z for wo_b (codes_out / scales_out), as the step does
VARIANTS = {
    "default": {}, "default+quant": {}, "bf16dot": dict(bf16_dot=True),
    "split1": dict(split=1), "split4": dict(split=4), "split8": dict(split=8),
    "stages2": dict(num_stages=2), "stages3": dict(num_stages=3), "stages4": dict(num_stages=4), "stages6": dict(num_stages=6),
    "warps8": dict(num_warps=8), "bf16dot_split4": dict(bf16_dot=True, split=4),
    "bf16dot_stages4": dict(bf16_dot=True, num_stages=4),
    "swap": dict(swap_ab=True), "swap+quant": dict(swap_ab=True), "swap_split4": dict(swap_ab=True, split=4),
    "swap_stages4": dict(swap_ab=True, num_stages=4),
}



def main() -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = [int(r) for r in arg("rows", "1,4,16").split(",")]
    names = arg("only", ",".join(VARIANTS)).split(",")
    w = step_weight(g)
    for fp8 in (False, True):
        ws, scale, nbytes = weight_copies(w, fp8)
        weight, copies = ws[0], len(ws)
        for m in rows:
            o, cos, sin = rotated_inputs(m, g)
            out = torch.empty(m, GROUPS * RANK, dtype=torch.bfloat16, device="cuda")
            codes = torch.empty(m, GROUPS * RANK, dtype=torch.float8_e4m3fn, device="cuda")
            sbytes = torch.empty(m, GROUPS * RANK // 32, dtype=torch.uint8, device="cuda")
            ref = None
            for name in names:
                try:
                    plan = WoAPlan.build(HEADS, GROUPS, RANK, 64, weight.dtype, "cuda", **VARIANTS[name])

                    quant = (codes, sbytes) if name.endswith("+quant") else (None, None)

                    def fn(plan=plan, quant=quant):
                        for wc in ws:
                            wo_a_(plan, o, cos, sin, wc, scale, out, *quant)
                    us = graph_time_us(fn, calls_per_graph=copies, replays=30)
                    ref = out.float().clone() if ref is None else ref
                    err = float((out.float() - ref).abs().max())
                    print(f"{'fp8 ' if fp8 else 'bf16'} rows {m:2d} {name:16s} {us:7.2f} us "
                          f"{nbytes / us / 1e3:6.0f} GB/s  split {plan.split} stages {plan.stages(m)} "
                          f"warps {plan.num_warps} bf16_dot {plan.bf16_dot} swap {plan.swapped}  |d| {err:.1e}", flush=True)
                except Exception as e:  # report, keep probing
                    print(f"{'fp8' if fp8 else 'bf16'} rows {m} {name}: {type(e).__name__}: {str(e)[:160]}",
                          flush=True)


if __name__ == "__main__":
    main()
