"""The ops `bench gemm` times: each method builds its plan and buffers once and returns a callable
that only launches (what a CUDA graph captures)."""

from __future__ import annotations

import math
from typing import Callable

import torch

from ..formats import fp8_block_dequantize
from ..ops.act_quant import act_quant_mxfp8
from ..ops.fp8_mm import fp8_mm_, fp8_mm_config
from ..decode.attention import fp8_linear_plan, wo_a_launch, wo_a_plan
from ..ops.exact_linear import ExactLinear
from ..ops.gluon_wo_a import foldable_scale
from ..ops.ll_bf16 import LlBf16Plan, ll_bf16_
from ..ops.low_latency_mm import LowLatencyMM
from ..ops.wo_a import WoAPlan

Launch = Callable[[], None]


class GemmOps:
    """Our kernels behind the bench's shape-level interface."""

    def dequant(self, q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        return fp8_block_dequantize(q, s)

    def _launch(self, plan, x: torch.Tensor, n: int) -> Launch:
        """A launch of `plan` on x's MXFP8 (the boundary quantizes it in the step, so not timed)."""
        codes, sx = act_quant_mxfp8(x)
        out = torch.empty(x.shape[0], n, dtype=torch.bfloat16, device=x.device)
        return lambda: plan(codes, sx, out)

    def fp8(self, x: torch.Tensor, q: torch.Tensor, s: torch.Tensor) -> Launch:
        """The step's tensor-core FP8 linear (`exact_linears=False`; `decode.attention.fp8_linear_plan`:
        the Gluon tier on sm_90 where it builds, else the Triton tier)."""
        return self._launch(fp8_linear_plan(q, s, 64), x, q.shape[0])

    def triton(self, x: torch.Tensor, q: torch.Tensor, s: torch.Tensor) -> Launch:
        """The Triton tier (`ops.low_latency_mm`) on the same operands."""
        return self._launch(LowLatencyMM(q, s, max_rows=64), x, q.shape[0])

    def exact(self, x: torch.Tensor, q: torch.Tensor, s: torch.Tensor) -> Launch:
        """The exact linear as the step's `exact_linears=True` builds it (`ops.exact_linear.ExactLinear`:
        `ExactMM` or `GluonExactFMA` on CUDA cores at few rows, `GluonExactMM` above its row
        threshold, on FP16 MMAs over the codes' digits in the measured plans and on the FP64 MMA for
        unlisted shapes) on the same operands."""
        return self._launch(ExactLinear(q, s, max_rows=64), x, q.shape[0])

    def regular(self, x: torch.Tensor, q: torch.Tensor, s: torch.Tensor) -> Launch:
        """The regular path (fp8_mm) on the same operands, for the low-batch crossover."""
        codes, sx = act_quant_mxfp8(x)
        out = torch.empty(x.shape[0], q.shape[0], dtype=torch.bfloat16, device=x.device)
        cfg = fp8_mm_config(x.shape[0], q.shape[0], q.shape[1], x.device)
        return lambda: fp8_mm_(codes, sx, q, s, out, config=cfg)

    def side(self, x: torch.Tensor, w: torch.Tensor) -> Launch:
        plan = LlBf16Plan.build(w.shape[0], w.shape[1], 64, w.dtype, x.device)
        out = torch.empty(x.shape[0], w.shape[0], dtype=torch.float32, device=x.device)
        return lambda: ll_bf16_(plan, x, w, out)

    def _wo_a(self, o: torch.Tensor, q: torch.Tensor, s: torch.Tensor | None, groups: int, rank: int,
              triton_tier: bool) -> Launch:
        m = o.shape[0]
        heads = groups * o.shape[2] // 512
        g = torch.Generator(device=o.device).manual_seed(1)
        ang = torch.rand(m, 32, generator=g, device=o.device) * 2 * math.pi
        cos, sin = torch.cos(ang), torch.sin(ang)
        if triton_tier:
            plan = WoAPlan.build(heads, groups, rank, 64, q.dtype, o.device)
        else:
            plan = wo_a_plan(heads, groups, rank, 64, q.dtype, o.device, gluon_fp8=foldable_scale(s))
        out = torch.empty(m, groups * rank, dtype=torch.bfloat16, device=o.device)
        ov = o.view(m, heads, 512)
        return lambda: wo_a_launch(plan, ov, cos, sin, q, s, out)

    def wo_a(self, o: torch.Tensor, q: torch.Tensor, s: torch.Tensor | None, groups: int, rank: int) -> Launch:
        """o [M, groups, (H/G)*512] -> z [M, groups*rank]; weight FP8 (with s) or BF16 (s None): the
        step's plan (`decode.attention.wo_a_plan`: the Gluon kernel on sm_90, for an FP8 weight its
        folded consumer; else the Triton plan)."""
        return self._wo_a(o, q, s, groups, rank, triton_tier=False)

    def wo_a_triton(self, o: torch.Tensor, q: torch.Tensor, s: torch.Tensor | None, groups: int,
                    rank: int) -> Launch:
        """The Triton plan (`ops.wo_a.WoAPlan`) on the same operands."""
        return self._wo_a(o, q, s, groups, rank, triton_tier=True)
