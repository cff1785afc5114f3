"""Warm L2 with the first bytes of a weight before the GEMM that streams it (Hopper, sm_90+).

At small batch the decode step alternates kernels that stream weights (the GEMMs, at 40-60 % of
the H200's read bandwidth) with kernels that barely touch DRAM (norms, RoPE, the sparse MLA over
~0.5 MB of KV, the boundary). During the latter the memory system idles. `L2Prefetch` issues, on a
side stream, bulk L2 prefetches (`cp.async.bulk.prefetch.L2.global`, one per CHUNK bytes) of the
head of every program's stream of the next GEMM's weight, so that part of it is served from L2.

Contract: the kernel reads nothing back and writes nothing; it changes no value anywhere, only
where the bytes are cached. Its programs exit as soon as the prefetches are issued (the copy
engine completes them). A prefetch larger than L2 (50 MB on an H200, shared with everything else)
evicts its own head; the plan caps its total at `max_fraction` of the L2.

Never under the interpreter or off CUDA (inline PTX): `L2Prefetch.__call__` is then a no-op, which
is exact because the op has no results.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .checks import interpreting

LANES = 32               # one warp per program, one bulk prefetch per lane per iteration
ITERS = 8                # iterations per program: 256 prefetches per program
MAX_PREFETCH = 65520     # bytes per instruction (the size travels as a 16-bit count of 16 B units)


@triton.jit
def bulk_prefetch_l2(addr, size):
    """Ask L2 for `size` bytes (int32, a multiple of 16; none when <= 0) at each 16-byte aligned
    int64 address `addr` (`cp.async.bulk.prefetch.L2`, sm_90; inline PTX, so never in the
    interpreter). Reads nothing back, writes nothing."""
    tl.inline_asm_elementwise("{\n\t.reg .pred p;\n\tsetp.gt.s32 p, $2, 0;\n\t"
                              "@p cp.async.bulk.prefetch.L2.global [$1], $2;\n\tmov.u32 $0, 0;\n\t}",
                              "=r,l,r", [addr, size], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _l2_prefetch_kernel(base_ptr, n_items, segs, row_bytes, seg_bytes, pf_bytes,
                        ITERS: tl.constexpr, LANES: tl.constexpr):
    """Item i = (row i // segs, segment i % segs): ask L2 for the first pf_bytes of the segment
    (fewer at the row's end). Program p handles items [p * ITERS * LANES, +ITERS * LANES)."""
    pid = tl.program_id(0)
    lane = tl.arange(0, LANES)
    base = base_ptr.to(tl.pointer_type(tl.uint8))
    for j in tl.static_range(ITERS):
        item = (pid * ITERS + j) * LANES + lane          # int32: the plan keeps items < 2**31
        row = item // segs
        start = (item - row * segs).to(tl.int64) * seg_bytes
        size = tl.minimum(pf_bytes, row_bytes - start)
        size = tl.where(item < n_items, size, 0).to(tl.int32)
        bulk_prefetch_l2((base + row.to(tl.int64) * row_bytes + start).to(tl.int64), size)


def l2_bytes(device: torch.device) -> int:
    """The device's L2 size in bytes (50 MB when not on CUDA, an H200's, for planning)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).L2_cache_size
    return 50 * 2**20


class L2Prefetch:
    """Prefetch the head of every K segment of every row of a weight into L2; build once, call per step.

    A low-latency GEMM program streams a tile of rows over one K segment (its split), head first,
    all programs at once: prefetching `fraction` of each (row, segment) serves the first `fraction`
    of every program's stream from L2 (prefetching the weight's first bytes instead would speed up
    only the first tiles, and the kernel lasts as long as its slowest program).

    weight: a contiguous 2-D CUDA tensor [rows, cols] (any dtype; 16-byte aligned rows);
    seg_cols: columns per segment (None: the whole row; the last segment may be shorter);
    fraction: in (0, 1], the part of each segment prefetched (rounded up to 16 bytes, at most
    65,520 bytes per segment); max_fraction: the total is capped at this part of the L2 size by
    shrinking the per-segment bytes. Calling it enqueues one launch on the current stream; off
    sm_90+ CUDA or under the interpreter it does nothing (the op has no results).
    """

    def __init__(self, weight: torch.Tensor, seg_cols: int | None = None, fraction: float = 1.0,
                 max_fraction: float = 0.8):
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
            raise ValueError(f"weight must be a 2-D tensor, got "
                             f"{tuple(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__}")
        if not weight.is_contiguous():
            raise ValueError("weight must be contiguous")
        rows, cols = weight.shape
        es = weight.element_size()
        seg_cols = cols if seg_cols is None else seg_cols
        if not isinstance(seg_cols, int) or not 1 <= seg_cols <= cols:
            raise ValueError(f"seg_cols must be an int in [1, {cols}], got {seg_cols!r}")
        if not (isinstance(fraction, (int, float)) and 0.0 < fraction <= 1.0):
            raise ValueError(f"fraction must lie in (0, 1], got {fraction!r}")
        if not 0.0 < max_fraction <= 1.0:
            raise ValueError(f"max_fraction must lie in (0, 1], got {max_fraction!r}")
        row_bytes, seg_bytes = cols * es, seg_cols * es
        if weight.data_ptr() % 16 or row_bytes % 16 or seg_bytes % 16:
            raise ValueError(f"the weight's rows and segments must be 16-byte aligned "
                             f"(row {row_bytes} B, segment {seg_bytes} B)")
        self.weight, self.rows, self.segs = weight, rows, -(-cols // seg_cols)
        self.row_bytes, self.seg_bytes = row_bytes, seg_bytes
        pf = min(-(-int(fraction * seg_bytes) // 16) * 16, seg_bytes, MAX_PREFETCH)
        cap = int(max_fraction * l2_bytes(weight.device)) // (rows * self.segs) // 16 * 16
        self.pf_bytes = min(pf, cap)
        self.nbytes = rows * (row_bytes if self.pf_bytes >= seg_bytes else
                              (self.segs - 1) * self.pf_bytes + min(self.pf_bytes, row_bytes - (self.segs - 1) * seg_bytes))
        self.items = rows * self.segs
        self.active = (weight.device.type == "cuda" and not interpreting()
                       and torch.cuda.get_device_capability(weight.device) >= (9, 0))
        self.grid = (triton.cdiv(self.items, ITERS * LANES),)

    def __call__(self) -> None:
        if self.active and self.pf_bytes > 0:
            _l2_prefetch_kernel[self.grid](self.weight, self.items, self.segs, self.row_bytes, self.seg_bytes,
                                           self.pf_bytes, ITERS=ITERS, LANES=LANES, num_warps=1)
