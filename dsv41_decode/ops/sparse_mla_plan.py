"""The tiling plan of `ops.sparse_mla`: heads per program, the key splits, the split workspace, and
the per-row-count tilings the decode step uses (`STEP_TILINGS`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from .checks import interpreting, require_bool, require_int, require_num_warps
from .common import plan_workspace

HEAD_DIM = 512
SUPPORTED_HEADS = (8, 16, 32, 64)
# The contract's online-softmax block (spec section 3 step 8): P is rounded against the running max
# at each block of 64 keys of the joined key list, so the kernel's blocks are these.
BLOCK_KEYS = 64

# Per row-count tiling of the decode step's plans (H200, 64 heads, 128 + 512 keys, graph replay:
# 16-head programs 25.5 us at 1-2 rows against 27.6 with 32; 32-head programs 28.6 / 40.6 / 66.1 /
# 132 / 262 us at 4 / 8 / 16 / 32 / 64 rows, the separate combination 1-9 us faster than the last
# block combining; docs/results/sparse-mla-probe-h200.txt). Every plan splits the keys into their
# 64-key blocks (`split`), so every row count combines the blocks' partials in the same order and a
# row's outputs do not depend on the other rows of the step; only what leaves the bits unchanged
# varies with the row count (heads per program, warps, where the blocks are combined).
STEP_TILINGS = ((2, dict(block_h=16, num_warps=8, separate_combine=True)),
                (256, dict(block_h=32, num_warps=8, separate_combine=True)))
# The tiling of the step's plans with FP32 dots (`for_step(fp32_dots=True)`: the exact step), the
# same at every row count: FP32 operands, 64 dims a dot (`dot_dims`), 16 heads and 8 warps a
# program. Compiled for sm_90 (scripts/sm90_resources.py fp32): 195 registers, no spills; 32 dims a
# dot 170; the BF16 tiling's four 128-dim chunks held in FP32 10 KB of stack (spills), 32 heads a
# program at 64 dims 264 bytes. One tiling for every row count: a row's bits never depend on it.
FP32_DOT_DIMS = 64
FP32_STEP_TILING = dict(block_h=16, num_warps=8, separate_combine=True, bf16_dot=False, dot_dims=FP32_DOT_DIMS)
DOT_DIMS = (16, 32, 64, 128)


@dataclass(frozen=True, eq=False)
class SparseMlaPlan:
    """Tiling, key split and the workspace of `sparse_mla_` for one shape.

    Build once with `SparseMlaPlan.build`; launches reuse it. Not for concurrent launches on two
    streams (they share the workspace, flags and counters).

    max_rows: the most rows a launch may pass (1..256); heads: H (8, 16, 32 or 64);
    window: W (window_table's width); topk: the compressed table's width.
    block_h: heads per program (>= 16; H is padded up to it);
    split: one program per 64-key block of the joined list (each block's P rounded against the
    running max the sequential loop has there, published by the earlier blocks' programs; the
    blocks' partials combined in block order), else one program per (row, head group) running the
    sequential loop; num_warps;
    bf16_dot: BF16 dot operands (the GPU's default: tensor cores), else FP32 operands with IEEE dots
    (on the GPU CUDA-core FMAs: exact products, FP32 round-to-nearest sums, where a tensor-core MMA
    truncates while it adds; the interpreter's only path);
    dot_dims: the dims of each score and P.V dot: 128, the four 128-dim chunks of the block decoded
    once and held; or 16-64 with FP32 operands and the split (the GPU's FP32 tiling: each chunk's
    keys decoded before its score dot and again before its P.V dot, q loaded per chunk, each chunk
    of the block's P.V stored as it is summed; an FMA dot's operands are replicated per thread over
    its depth, so only a short chunk fits the registers). Only the score's FP32 summation order
    depends on it;
    native_fp8: decode E4M3 with Triton's FP8 cast (the GPU's default) instead of integer arithmetic.
    separate_combine: block programs only store their partials and a second launch combines them,
    one program per (row, head group, slice of 16-128 dims); else the last block to arrive combines.
    part_acc / part_ml: the FP32 per-block partials; block_max: FP32 per (row, head group, block,
    head) the block's score max; flags: int32 per (row, head group, block), set when its max is
    published; counters: int32 per (row, head group); ticket: int32 [1]; flags, counters and ticket
    are 0 between launches (the launch that sets them clears them: the last program to take a
    ticket zeroes the ticket; the combination, or the last block to arrive, zeroes its flags and
    counter), and the FP32 workspaces are written before they are read within a launch, so plans
    whose launches never overlap may share them (`build(workspace=)`).
    """
    max_rows: int
    heads: int
    window: int
    topk: int
    block_h: int
    split: bool
    num_warps: int
    bf16_dot: bool
    native_fp8: bool
    separate_combine: bool
    part_acc: torch.Tensor
    part_ml: torch.Tensor
    block_max: torch.Tensor
    flags: torch.Tensor
    counters: torch.Tensor
    ticket: torch.Tensor
    dot_dims: int = 128

    @property
    def device(self) -> torch.device:
        return self.counters.device

    @property
    def head_groups(self) -> int:
        return triton.cdiv(self.heads, self.block_h)

    @property
    def n_blocks(self) -> int:
        """64-key blocks of the joined key list (window + topk keys)."""
        return triton.cdiv(self.window + self.topk, BLOCK_KEYS)

    @classmethod
    def for_step(cls, max_rows: int, heads: int, window: int, topk: int, device,
                 workspace=None, fp32_dots: bool = False) -> list["SparseMlaPlan"]:
        """Plans covering rows 1..max_rows with the tiling of STEP_TILINGS (ascending max_rows; use
        the first plan whose max_rows holds the launch's rows); all split into 64-key blocks.
        workspace: as for `build` (the plans then share it with each other too).
        fp32_dots: one plan with FP32_STEP_TILING instead (FP32 operands, IEEE dots: the exact
        step's), for every row count."""
        if not isinstance(fp32_dots, bool):
            raise TypeError(f"fp32_dots must be a bool, got {type(fp32_dots).__name__}")
        if fp32_dots:
            opts = dict(FP32_STEP_TILING, block_h=max(16, min(FP32_STEP_TILING["block_h"], heads)))
            return [cls.build(max_rows, heads, window, topk, device, split=True, workspace=workspace, **opts)]
        plans, lo = [], 0
        for hi, opts in STEP_TILINGS:
            if lo >= max_rows:
                break
            opts = dict(opts, block_h=min(opts["block_h"], max(16, heads)))
            plans.append(cls.build(min(hi, max_rows), heads, window, topk, device, split=True,
                                   workspace=workspace, **opts))
            lo = hi
        return plans

    @classmethod
    def build(cls, max_rows: int, heads: int, window: int, topk: int,
              device: torch.device | str = "cuda", *, block_h: int = 16, split: bool = True,
              num_warps: int = 8, bf16_dot: bool | None = None, native_fp8: bool | None = None,
              separate_combine: bool = False, workspace=None, dot_dims: int | None = None) -> "SparseMlaPlan":
        """A plan for launches of up to max_rows rows (see the class doc for the options; 8 warps:
        64 decoded keys x 512 dims in BF16 are 128 registers a thread at 4 warps). bf16_dot None:
        on for a CUDA device outside the interpreter. dot_dims None: FP32_DOT_DIMS for FP32
        operands on the GPU with the split, else 128 (the interpreter keeps its one tiling).

        workspace: None - the plan allocates its own workspaces; else a pool on `device` with
        `take(slot, numel, dtype) -> 1-D tensor` (`decode.buffers.Workspaces`) from which the plan
        takes part_acc, part_ml, block_max (FP32 slots 0-2) and flags, counters, ticket (int32 slots
        0-2; zero when taken). The pool's other takers may hold the same memory, so the caller
        guarantees that no two launches using it overlap in time (one stream, in order)."""
        require_int(max_rows, "max_rows")
        require_int(window, "window")
        require_num_warps(num_warps)
        require_int(topk, "topk", 0)
        if max_rows > 256:
            raise ValueError(f"max_rows must be at most 256, got {max_rows}")
        if isinstance(heads, bool) or not isinstance(heads, int) or heads not in SUPPORTED_HEADS:
            raise ValueError(f"heads must be one of {SUPPORTED_HEADS}, got {heads!r}")
        if isinstance(block_h, bool) or not isinstance(block_h, int) or block_h < 16 or block_h & (block_h - 1):
            raise ValueError(f"block_h must be a power of two >= 16, got {block_h!r}")
        if not isinstance(split, bool):
            raise TypeError(f"split must be a bool, got {type(split).__name__}")
        for name, v in (("bf16_dot", bf16_dot), ("native_fp8", native_fp8)):
            require_bool(v, name, optional=True)
        require_bool(separate_combine, "separate_combine")
        device = torch.device(device)
        gpu = device.type == "cuda" and not interpreting()
        if bf16_dot is None:
            bf16_dot = gpu
        if dot_dims is None:
            dot_dims = FP32_DOT_DIMS if gpu and split and not bf16_dot else 128
        if isinstance(dot_dims, bool) or not isinstance(dot_dims, int) or dot_dims not in DOT_DIMS:
            raise ValueError(f"dot_dims must be one of {DOT_DIMS}, got {dot_dims!r}")
        if dot_dims < 128 and (bf16_dot or not split):
            raise ValueError(f"dot_dims={dot_dims} needs FP32 operands (bf16_dot=False) and the split "
                             f"(split=True): the chunked tiling runs one block per program")
        if bf16_dot and not gpu:
            raise ValueError("bf16_dot=True needs a CUDA device outside Triton's interpreter, whose dots on BF16 "
                             "operands are wrong (the FP32 dots are its path: leave bf16_dot None or False)")
        if native_fp8 is None:   # the hardware's exact E4M3 -> FP32 conversion (same bits)
            native_fp8 = device.type == "cuda" and not interpreting()
        hg = triton.cdiv(heads, block_h)
        nb = triton.cdiv(window + topk, BLOCK_KEYS)
        ws = max_rows * hg * nb if split else 0
        f32, i32 = torch.float32, torch.int32
        part_acc = plan_workspace(workspace, 0, ws * block_h * HEAD_DIM, f32, device)
        part_ml = plan_workspace(workspace, 1, ws * 3 * block_h, f32, device)
        block_max = plan_workspace(workspace, 2, ws * block_h, f32, device)
        flags = plan_workspace(workspace, 0, ws, i32, device)
        counters = plan_workspace(workspace, 1, max_rows * hg, i32, device)
        ticket = plan_workspace(workspace, 2, 1, i32, device)
        return cls(max_rows, heads, window, topk, block_h, split, num_warps, bool(bf16_dot), native_fp8,
                   bool(separate_combine), part_acc, part_ml, block_max, flags, counters, ticket, dot_dims)
