"""The tiling plan of `ops.sparse_mla`: heads per program, keys per block, key splits per row bucket,
the split workspace, and the per-row-count tilings the decode step uses (`STEP_TILINGS`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from .checks import interpreting
from .ll_bf16 import num_sms

HEAD_DIM = 512
SUPPORTED_HEADS = (8, 16, 32, 64)


# Per row-count tiling of the decode step's plans, from the plan sweep on an H200 (64 heads,
# 128 + 512 keys; scripts/probe_sparse_mla.py, docs/results/sparse-mla-probe-h200.txt, commit
# a9527c9): the split programs store partials and a second launch combines them up to 16 rows
# (1 row: 32-key blocks, 18.3 us vs 33.5 inline; 4 rows 29.0 vs 36.0; 8 rows 39.6 vs 66.0; 16 rows
# with 32-head programs 57.6 vs 96.1); above, the last split combines, 32-head programs at 4 warps
# (64 rows 206 us vs 237). 17-32 rows: 4 key splits, one wave of two programs per SM (32 rows x 2
# head groups x 4 = 256 programs; 109 us vs 131 with the default 3 splits, which leave a second
# wave; scripts/probe_sparse_mla.py at commit ba1d831, docs/results/sparse-mla-probe32-h200.txt).
# Forced split counts were measured at 64 heads only: with fewer heads (tensor-parallel shards)
# `for_step` leaves the splits to `build`'s rule.
STEP_TILINGS = ((2, dict(block_h=16, block_keys=32, num_warps=4, separate_combine=True)),
                (8, dict(block_h=16, num_warps=4, separate_combine=True)),
                (16, dict(block_h=32, num_warps=4, separate_combine=True)),
                (32, dict(block_h=32, num_warps=4, splits=4)),
                (256, dict(block_h=32, num_warps=4)))


@dataclass(frozen=True, eq=False)
class SparseMlaPlan:
    """Tiling, per-row-bucket splits and the workspace of `sparse_mla_` for one shape.

    Build once with `SparseMlaPlan.build`; launches reuse it. Not for concurrent launches on two
    streams (they share the workspace and counters).

    max_rows: the most rows a launch may pass (1..256); heads: H (8, 16, 32 or 64);
    window: W (window_table's width); topk: the compressed table's width.
    block_h: heads per program (>= 16; H is padded up to it); block_keys: keys per block (>= 16);
    splits: per row bucket 1, 2, 4, ... next_pow2(max_rows), the key splits (`split(n)`);
    num_warps; bf16_dot: BF16 dot operands (the GPU), else FP32 (the interpreter);
    native_fp8: decode E4M3 with Triton's FP8 cast (the GPU's default) instead of integer arithmetic.
    separate_combine: split programs only store their partials and a second launch combines them,
    one program per (row, head group, slice of 16-128 dims); else the last split to arrive combines.
    part_acc / part_ml: the FP32 split workspace; counters: int32 per (row, head group), 0 between launches.
    """
    max_rows: int
    heads: int
    window: int
    topk: int
    block_h: int
    block_keys: int
    splits: tuple[int, ...]
    num_warps: int
    bf16_dot: bool
    native_fp8: bool
    separate_combine: bool
    part_acc: torch.Tensor
    part_ml: torch.Tensor
    counters: torch.Tensor

    @property
    def device(self) -> torch.device:
        return self.counters.device

    @property
    def head_groups(self) -> int:
        return triton.cdiv(self.heads, self.block_h)

    @property
    def n_blocks(self) -> int:
        return triton.cdiv(self.window, self.block_keys) + triton.cdiv(self.topk, self.block_keys)

    def split(self, rows: int) -> int:
        """Key splits of a launch with `rows` rows (1 <= rows <= max_rows)."""
        return self.splits[(rows - 1).bit_length()]

    @classmethod
    def for_step(cls, max_rows: int, heads: int, window: int, topk: int, device) -> list["SparseMlaPlan"]:
        """Plans covering rows 1..max_rows with the tiling of STEP_TILINGS (ascending max_rows; use
        the first plan whose max_rows holds the launch's rows)."""
        plans, lo = [], 0
        for hi, opts in STEP_TILINGS:
            if lo >= max_rows:
                break
            opts = dict(opts, block_h=min(opts["block_h"], max(16, heads)))
            if heads != 64:
                opts.pop("splits", None)
            plans.append(cls.build(min(hi, max_rows), heads, window, topk, device, **opts))
            lo = hi
        return plans

    @classmethod
    def build(cls, max_rows: int, heads: int, window: int, topk: int,
              device: torch.device | str = "cuda", *, block_h: int | None = None,
              block_keys: int | None = None, splits: int | None = None, max_splits: int = 16,
              num_warps: int | None = None, bf16_dot: bool | None = None,
              native_fp8: bool | None = None, separate_combine: bool = False) -> "SparseMlaPlan":
        """Choose the tiling and, per row bucket, splits for about one program per SM.

        splits: force one split count for every bucket (clipped to the number of key blocks);
        default: ceil(SMs / (rows * head_groups)), at most max_splits and the number of key blocks;
        with separate_combine, ceil(2 * SMs / (rows * head_groups)) up to one block per split (the
        combination no longer runs in one program per (row, head group), so more, shorter splits pay).
        """
        for name, v in (("max_rows", max_rows), ("window", window), ("max_splits", max_splits)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if isinstance(topk, bool) or not isinstance(topk, int) or topk < 0:
            raise ValueError(f"topk must be a non-negative int, got {topk!r}")
        if max_rows > 256:
            raise ValueError(f"max_rows must be at most 256, got {max_rows}")
        if heads not in SUPPORTED_HEADS:
            raise ValueError(f"heads must be one of {SUPPORTED_HEADS}, got {heads!r}")
        device = torch.device(device)
        if block_h is None:
            # 16 heads x 512 FP32 accumulators are 64 registers per thread at 4 warps; wider head
            # groups read each key fewer times but hold more (measured in docs/attn.md).
            block_h = 16
        if block_h < 16 or block_h & (block_h - 1):
            raise ValueError(f"block_h must be a power of two >= 16, got {block_h!r}")
        if block_keys is None:
            block_keys = 16   # a [16, 512] FP32 key block is 64 registers per thread at 4 warps
        if block_keys < 16 or block_keys & (block_keys - 1):
            raise ValueError(f"block_keys must be a power of two >= 16, got {block_keys!r}")
        if num_warps is None:
            num_warps = 8 if block_h >= 32 else 4
        if bf16_dot is None:
            bf16_dot = device.type == "cuda" and not interpreting()
        if native_fp8 is None:   # the hardware's exact E4M3 -> FP32 conversion (same bits, 5-12 % faster)
            native_fp8 = device.type == "cuda" and not interpreting()
        hg = triton.cdiv(heads, block_h)
        nb = triton.cdiv(window, block_keys) + triton.cdiv(topk, block_keys)
        buckets = [1 << i for i in range((max_rows - 1).bit_length() + 1)]
        if splits is None and separate_combine:
            sms = num_sms(device)
            chosen = tuple(max(1, min(triton.cdiv(2 * sms, b * hg), nb)) for b in buckets)
        elif splits is None:
            sms = num_sms(device)
            chosen = tuple(max(1, min(triton.cdiv(sms, b * hg), max_splits, nb)) for b in buckets)
        else:
            if isinstance(splits, bool) or not isinstance(splits, int) or splits < 1:
                raise ValueError(f"splits must be a positive int, got {splits!r}")
            chosen = tuple(min(splits, nb) for _ in buckets)
        # Equalize: each split gets ceil(nb / s) blocks; drop splits left empty.
        chosen = tuple(triton.cdiv(nb, triton.cdiv(nb, s)) for s in chosen)
        ws = max(min(b, max_rows) * s for b, s in zip(buckets, chosen) if s > 1) if max(chosen) > 1 else 0
        part_acc = torch.empty(ws * hg * block_h * HEAD_DIM, dtype=torch.float32, device=device)
        part_ml = torch.empty(ws * hg * 3 * block_h, dtype=torch.float32, device=device)
        counters = torch.zeros(max_rows * hg, dtype=torch.int32, device=device)
        return cls(max_rows, heads, window, topk, block_h, block_keys, chosen, num_warps, bf16_dot,
                   native_fp8, bool(separate_combine), part_acc, part_ml, counters)
