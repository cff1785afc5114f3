"""The buffers of the specialized decode step, built once and shared by its layers.

`Scratch` holds the per-layer intermediates (layers run one after another on the main stream and
join their side work before the next layer writes them); `IndexSelection` what an index source
leaves for the layers after it; `StepIO` the streams entering and leaving the step and the
attention output handed to the boundary. All are sized for the step's largest row bucket and read
as views `[:rows]`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import ModelConfig
from ..state import DecodeState


def storage_bytes(tensors, exclude: frozenset[int] | set[int] = frozenset()) -> int:
    """Bytes of the distinct storages behind `tensors` (views count once), skipping the storages
    whose data pointers are in `exclude`."""
    found = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(n for ptr, n in found.items() if ptr not in exclude)


class Scratch:
    """Per-step buffers shared by all layers (layers run one after another on the main stream and
    join their side work before the next layer writes these). Sized for `max_rows` rows; `cfg` is
    the rank-local view of the configuration (its heads and wo_a groups under TP)."""

    def __init__(self, cfg: ModelConfig, state: DecodeState, max_rows: int):
        dev, B = state.device, max_rows
        H, D, ql = cfg.n_heads, cfg.head_dim, cfg.q_lora_rank
        self.qkv_a = torch.zeros(B, ql + D, dtype=torch.bfloat16, device=dev)
        self.qr = torch.zeros(B, ql, dtype=torch.bfloat16, device=dev)
        self.kv = torch.zeros(B, D, dtype=torch.bfloat16, device=dev)
        self.lat = torch.zeros(B, D, dtype=torch.bfloat16, device=dev)
        self.qr_codes = torch.zeros(B, ql, dtype=torch.float8_e4m3fn, device=dev)
        self.qr_scales = torch.zeros(B, ql // 32, dtype=torch.uint8, device=dev)
        self.q = torch.zeros(B, H, D, dtype=torch.bfloat16, device=dev)
        self.o = torch.zeros(B, H, D, dtype=torch.bfloat16, device=dev)
        rank = cfg.o_groups * cfg.o_lora_rank
        self.z = torch.zeros(B, rank, dtype=torch.bfloat16, device=dev)
        self.z_codes = torch.zeros(B, rank, dtype=torch.float8_e4m3fn, device=dev)
        self.z_scales = torch.zeros(B, rank // 32, dtype=torch.uint8, device=dev)
        self.y_partial = torch.zeros(B, cfg.dim, dtype=torch.float32, device=dev)   # wo_b's, under TP
        self.kv_score = torch.zeros(B, 2 * D, dtype=torch.float32, device=dev)
        self.c = torch.zeros(B, D, dtype=torch.float32, device=dev)
        self.done = torch.zeros(B, dtype=torch.int32, device=dev)
        self.wk_out = torch.zeros(B, cfg.index_head_dim, dtype=torch.float32, device=dev)
        self.iq_raw = torch.zeros(B, cfg.index_n_heads * cfg.index_head_dim, dtype=torch.bfloat16, device=dev)
        self.iq = torch.zeros(B, cfg.index_n_heads, cfg.index_head_dim, dtype=torch.bfloat16, device=dev)
        self.wproj = torch.zeros(B, cfg.index_n_heads, dtype=torch.float32, device=dev)
        self.iw = torch.zeros(B, cfg.index_n_heads, dtype=torch.bfloat16, device=dev)
        # the one buffer that grows with the context: the indexer's scores over the visible entries
        width = max([-(-state.max_context // r) for r in state.ratios], default=0)
        self.scores = torch.zeros(B, width, dtype=torch.float32, device=dev)
        self.empty_comp = torch.zeros(0, 288, dtype=torch.uint8, device=dev)
        self.empty_table = torch.zeros(B, 0, dtype=torch.int32, device=dev)


@dataclass
class IndexSelection:
    """What an index source leaves for the layers after it: its top-k, its sparse-index table (global
    compressed slots) with per-row lengths; the event that marks the table built in a step travels
    in that step's `StepEvents`."""

    topk: torch.Tensor
    table: torch.Tensor
    lengths: torch.Tensor

    @classmethod
    def empty(cls, max_rows: int, topk: int, device: torch.device) -> "IndexSelection":
        """Buffers for `max_rows` rows of `topk` entries: top-k and table -1 (none), lengths 0."""
        def blank():
            return torch.full((max_rows, topk), -1, dtype=torch.int32, device=device)
        return cls(blank(), blank(), torch.zeros(max_rows, dtype=torch.int32, device=device))


class StepIO:
    """The step's inputs and outputs for `max_rows` rows: streams x_in/x_out [max_rows, hc, dim]
    BF16, the carried pre_in [max_rows, hc] FP32, and y [max_rows, dim] BF16 (each layer's output,
    this rank's partial under TP before the boundary reduces it)."""

    def __init__(self, cfg: ModelConfig, max_rows: int, device: torch.device):
        B, hc, d = max_rows, cfg.hc_mult, cfg.dim
        self.x_in = torch.zeros(B, hc, d, dtype=torch.bfloat16, device=device)
        self.pre_in = torch.zeros(B, hc, dtype=torch.float32, device=device)
        self.x_out = torch.zeros(B, hc, d, dtype=torch.bfloat16, device=device)
        self.y = torch.zeros(B, d, dtype=torch.bfloat16, device=device)

    def memory_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.x_in, self.pre_in, self.x_out, self.y))
