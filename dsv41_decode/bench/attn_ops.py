"""The ops `bench attn` times: each method builds plans and buffers once and returns launch-only
callables (what a CUDA graph captures), or runs a family's whole sweep."""

from __future__ import annotations

import torch

from ..ops.sparse_mla import SparseMlaPlan, sparse_mla_


class AttnOps:
    """Our sparse-attention kernels behind the bench's interface."""

    def sparse_mla(self, q, win, wtab, comp, ctab, sink, scale):
        """The decode step's plan for this row count (`decode.attention.sparse_mla_plans`: the Gluon
        kernel on sm_90, else the Triton STEP_TILINGS)."""
        from ..decode.attention import sparse_mla_launch, sparse_mla_plans
        rows, heads = q.shape[0], q.shape[1]
        plan = next(p for p in sparse_mla_plans(rows, heads, wtab.shape[1], ctab.shape[1], q.device)
                    if p.max_rows >= rows)
        out = torch.empty_like(q)
        return lambda: sparse_mla_launch(plan, q, win, comp, wtab, ctab, sink, scale, out)

    def sparse_mla_triton(self, q, win, wtab, comp, ctab, sink, scale):
        """The Triton kernel's step tiling (`SparseMlaPlan.for_step`: the step's plan off sm_90), the
        baseline column `triton_step` of the records (on sm_90 the step runs the Gluon kernel)."""
        rows, heads = q.shape[0], q.shape[1]
        out = torch.empty_like(q)
        plan = next(p for p in SparseMlaPlan.for_step(rows, heads, wtab.shape[1], ctab.shape[1], q.device)
                    if p.max_rows >= rows)
        return lambda: sparse_mla_(plan, q, win, comp, wtab, ctab, sink, scale, out)

    def bench_indexer(self, rows, contexts, floor, info, gen, progress):
        from .attn_indexer import bench_indexer
        return bench_indexer(rows, contexts, floor, info, gen, progress)

    def bench_kv_write(self, rows, floor, info, gen, progress):
        from .attn_kv_write import bench_kv_write
        return bench_kv_write(rows, floor, info, gen, progress)
