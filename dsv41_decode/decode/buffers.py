"""The buffers of the specialized decode step, built once and shared by its layers.

`Scratch` holds the per-layer intermediates (layers run one after another on the main stream and
join their side work before the next layer writes them) and `Workspaces`, the main-stream kernels'
workspaces that every layer takes views of; `IndexSelection` what an index source
leaves for the layers after it; `StepIO` the streams entering and leaving the step and the
attention output handed to the boundary. All are sized for the step's largest row bucket and read
as views `[:rows]`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..config import ModelConfig
from ..state import DecodeState


def storage_bytes(tensors, exclude: frozenset[int] | set[int] = frozenset()) -> int:
    """Bytes of the distinct storages behind `tensors` (views count once), skipping the storages
    whose data pointers are in `exclude`."""
    found = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(n for ptr, n in found.items() if ptr not in exclude)


class Workspaces:
    """Kernel workspaces shared by the layers of one step: one buffer per (dtype, slot), sized for its
    largest taker, of which every taker gets a view of the start (`take`).

    The contract of a taker (a kernel plan built with `workspace=` this pool): its kernels run on
    the step's main stream only, so stream order serialises every launch that reads or writes a
    view (a layer's main-stream kernels run one after another, and the layers in order); within a
    launch a floating-point view is scratch, written before it is read (split partials, block
    maxima); an integer view (flags, counters, tickets) is zero between launches: the kernel that
    sets it clears it before it ends. A plan that needs several workspaces at once takes them from
    distinct slots. Kernels on the side lanes keep their own workspaces (they overlap the main
    stream). Taking happens while the step is built: a buffer that must grow is reallocated (zeros)
    and the views already handed out are re-seated on it (`Tensor.set_`), so every taker ends on the
    final buffer; `seal` (before graph capture) forbids further takes.
    """

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self._buffers: dict[tuple[torch.dtype, int], torch.Tensor] = {}
        self._views: dict[tuple[torch.dtype, int], list[torch.Tensor]] = {}
        self.sealed = False

    def take(self, slot: int, shape: int | tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A contiguous view of `shape` (an int: 1-D) over the start of the buffer (`dtype`, `slot`),
        zero at build."""
        if self.sealed:
            raise RuntimeError("Workspaces.take after seal: the step's graphs hold the buffers' addresses")
        shape = (shape,) if isinstance(shape, int) and not isinstance(shape, bool) else tuple(shape)
        if any(isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in shape):
            raise ValueError(f"shape must hold non-negative ints, got {shape!r}")
        numel = math.prod(shape)
        key = (dtype, slot)
        buf = self._buffers.get(key)
        if buf is None or buf.numel() < numel:
            buf = torch.zeros(max(numel, 1), dtype=dtype, device=self.device)
            for v in self._views.get(key, ()):
                v.set_(buf.untyped_storage(), 0, v.shape)
            self._buffers[key] = buf
        view = buf[:numel].view(shape)
        self._views.setdefault(key, []).append(view)
        return view

    def seal(self) -> None:
        """No more takes (the step calls it once its layers are built, before it captures)."""
        self.sealed = True

    def storages(self) -> set[int]:
        """The data pointers of the pool's buffers (the storages behind every view it handed out)."""
        return {b.untyped_storage().data_ptr() for b in self._buffers.values()}

    def memory_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())


class Scratch:
    """Per-step buffers shared by all layers (layers run one after another on the main stream and
    join their side work before the next layer writes these). Sized for `max_rows` rows; `cfg` is
    the rank-local view of the configuration (its heads and wo_a groups under TP). `workspaces`:
    the pool of the main-stream kernels' workspaces, filled by the layers' plans."""

    def __init__(self, cfg: ModelConfig, state: DecodeState, max_rows: int):
        dev, B = state.device, max_rows
        self.workspaces = Workspaces(dev)
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
    this rank's partial under TP before the boundary reduces it); pre_first [max_rows, hc] FP32, the
    carried pre entering the first block (`AttentionStack.initial_pre(max_rows)`, given), kept so
    that a call without its own pre loads pre_in with one copy."""

    def __init__(self, cfg: ModelConfig, max_rows: int, device: torch.device, pre_first: torch.Tensor):
        B, hc, d = max_rows, cfg.hc_mult, cfg.dim
        self.x_in = torch.zeros(B, hc, d, dtype=torch.bfloat16, device=device)
        self.pre_in = torch.zeros(B, hc, dtype=torch.float32, device=device)
        self.pre_first = pre_first
        self.x_out = torch.zeros(B, hc, d, dtype=torch.bfloat16, device=device)
        self.y = torch.zeros(B, d, dtype=torch.bfloat16, device=device)

    def memory_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.x_in, self.pre_in, self.pre_first, self.x_out, self.y))
