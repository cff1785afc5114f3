"""Tensor-parallel shards of one attention layer's checkpoint tensors.

Rank r of `tp` holds: `wq_b` rows and `attn_sink` entries of its heads (H/tp consecutive heads),
`wo_a` rows of its groups (o_groups/tp consecutive groups, whose heads are exactly the rank's
heads), `wo_b` input columns of those groups' outputs; everything else (`wq_a`, `wkv`, norms, the
compressor, the indexer, the mHC tensors) is replicated. FP8 scales are sliced with their 32x32
blocks; every cut falls on a block boundary. Under TP the rank's `wo_b` output is a partial sum,
reduced across ranks in FP32 (rank order) before the BF16 rounding (spec section 3, step 9).
"""

from __future__ import annotations

from typing import Mapping

import torch

from .config import ModelConfig

_BLOCK = 32


def shard_ranges(cfg: ModelConfig, tp: int, rank: int) -> dict[str, tuple[int, int, int]]:
    """name (without `layers.N.`) -> (axis, start, stop) of the part rank `rank` of `tp` holds, for
    every sharded tensor (`attn.wo_a.scale` included; absent from a BF16-wo_a checkpoint).

    Raises ConfigError (via `cfg.check_tp`) when heads or groups do not split (every cut then falls
    on a 32x32 scale block's boundary: the configuration's o_lora_rank and head_dim are multiples of
    32), and ValueError for a rank out of range.
    """
    cfg.check_tp(tp)
    if not 0 <= rank < tp:
        raise ValueError(f"rank must lie in [0, {tp}), got {rank}")
    heads, groups = cfg.n_heads // tp, cfg.o_groups // tp
    q_rows = heads * cfg.head_dim                     # wq_b rows of the rank's heads
    a_rows = groups * cfg.o_lora_rank                 # wo_a rows of the rank's groups (= wo_b columns)
    q0, a0 = rank * q_rows, rank * a_rows
    return {
        "attn.wq_b.weight": (0, q0, q0 + q_rows),
        "attn.wq_b.scale": (0, q0 // _BLOCK, (q0 + q_rows) // _BLOCK),
        "attn.attn_sink": (0, rank * heads, (rank + 1) * heads),
        "attn.wo_a.weight": (0, a0, a0 + a_rows),
        "attn.wo_a.scale": (0, a0 // _BLOCK, (a0 + a_rows) // _BLOCK),
        "attn.wo_b.weight": (1, a0, a0 + a_rows),
        "attn.wo_b.scale": (1, a0 // _BLOCK, (a0 + a_rows) // _BLOCK),
    }


def take(t: torch.Tensor, axis: int, start: int, stop: int) -> torch.Tensor:
    """t[start:stop] along `axis` (0 or 1), contiguous."""
    return (t[start:stop] if axis == 0 else t[:, start:stop]).contiguous()


def shard_layer(cfg: ModelConfig, tensors: Mapping[str, torch.Tensor], tp: int, rank: int) -> dict[str, torch.Tensor]:
    """The tensors rank `rank` of `tp` holds for one layer (names as in `Checkpoint.layer`); see
    `shard_ranges` for the cuts and the errors."""
    out = dict(tensors)
    for name, (axis, start, stop) in shard_ranges(cfg, tp, rank).items():
        if name in tensors:
            out[name] = take(tensors[name], axis, start, stop)
    return out
