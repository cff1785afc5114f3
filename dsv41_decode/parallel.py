"""Tensor parallelism at the edges: the process group, this rank's place in it, and the collectives
the attention stack needs (the reduction of `wo_b`'s FP32 partial outputs; the exchange of a
row-sharded dense indexer's selections).

Every rank must hold bitwise the same result (spec section 3 step 9: the partials are reduced in
FP32 before the BF16 rounding), so the reduction here gathers the partials and adds them in rank
order on every rank, rather than trusting a collective's summation order. This is the portable
path (gloo on the CPU, NCCL on GPUs); the fused one-shot all-reduce over peer-to-peer memory of the
specialized step is a GPU kernel of its own.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TensorParallel:
    """Rank `rank` of `tp` ranks in `group` (None: the default group; unused when tp == 1)."""

    tp: int = 1
    rank: int = 0
    group: object | None = None

    def __post_init__(self) -> None:
        if isinstance(self.tp, bool) or not isinstance(self.tp, int) or self.tp < 1:
            raise ValueError(f"tp must be a positive int, got {self.tp!r}")
        if not 0 <= self.rank < self.tp:
            raise ValueError(f"rank must lie in [0, {self.tp}), got {self.rank}")

    def reduce_partials(self, partial: torch.Tensor) -> torch.Tensor:
        """sum over ranks r = 0, 1, ... of rank r's `partial` (FP32), added in rank order: the same
        bits on every rank. tp == 1 returns `partial` itself."""
        if partial.dtype != torch.float32:
            raise TypeError(f"partial must be float32 (reduced before the BF16 rounding), got {partial.dtype}")
        if self.tp == 1:
            return partial
        parts = [torch.empty_like(partial) for _ in range(self.tp)]
        dist.all_gather(parts, partial.contiguous(), group=self.group)
        total = parts[0].clone()
        for p in parts[1:]:
            total += p
        return total

    def exchange_rows(self, rows: list[torch.Tensor], pad: int) -> list[torch.Tensor]:
        """Row r of the result is row r of rank r % tp's `rows` (1-D int64 tensors of any lengths;
        `pad` must not occur in them): each rank computed only its own rows."""
        if self.tp == 1:
            return rows
        n = len(rows)
        dev = rows[0].device if rows else torch.device("cpu")
        # on the rows' device: NCCL gathers device tensors only (gloo, the CPU's)
        width = torch.tensor([max((t.numel() for t in rows), default=0)], device=dev)
        widths = [torch.zeros_like(width) for _ in range(self.tp)]
        dist.all_gather(widths, width, group=self.group)
        w = int(max(widths).item())
        packed = torch.full((n, w), pad, dtype=torch.int64, device=dev)
        for r, t in enumerate(rows):
            if r % self.tp == self.rank:
                packed[r, :t.numel()] = t
        parts = [torch.empty_like(packed) for _ in range(self.tp)]
        dist.all_gather(parts, packed, group=self.group)
        out = []
        for r in range(n):
            row = parts[r % self.tp][r]
            out.append(row[row != pad])
        return out

    def row_share(self, rows: int) -> tuple[int, int, int]:
        """This rank's share of `rows` rows in a row-sharded computation: (lo, hi, chunk), with
        chunk = ceil(rows / tp) and rank r owning rows [r * chunk, min((r + 1) * chunk, rows)), empty
        where r * chunk >= rows (rank 3 of 4 at 5 rows: 2 + 2 + 1 + 0). Contiguous
        shares keep every rank's rows a view of the step's buffers and let `gather_row_shares`
        place them with one collective."""
        if rows < 0:
            raise ValueError(f"rows must be >= 0, got {rows}")
        chunk = -(-rows // self.tp)
        lo = min(rows, self.rank * chunk)
        return lo, min(rows, lo + chunk), chunk

    def gather_row_shares(self, part: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """out[r * c:(r + 1) * c] = rank r's `part` for every rank r, c = part.shape[0]: each rank's
        rows of a row-sharded computation (`row_share`), gathered to every rank. A copy, so every
        rank holds the same bits whatever the collective's algorithm. part: [c, ...] contiguous,
        the same shape and dtype on every rank (a rank whose share is shorter pads it); out: at
        least tp * c rows of part's row shape, contiguous. Returns out[:tp * c]. Collective (NCCL
        or gloo; inside a CUDA graph under NCCL as `reduce_partials`). tp == 1 copies part into out."""
        c = part.shape[0]
        if out.shape[1:] != part.shape[1:] or out.dtype != part.dtype or out.shape[0] < self.tp * c:
            raise ValueError(f"out {tuple(out.shape)} {out.dtype} cannot hold {self.tp} shares of "
                             f"{tuple(part.shape)} {part.dtype}")
        dst = out[:self.tp * c]
        if not (part.is_contiguous() and dst.is_contiguous()):
            raise ValueError("gather_row_shares: part and out must be contiguous")
        if self.tp == 1:
            return dst.copy_(part)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor   # renamed in torch 2.13
        gather(dst, part, group=self.group)
        return dst

    def peer_access(self, device: torch.device) -> str | None:
        """None when every rank's GPU can read every other rank's memory directly (what the fused
        one-shot boundary needs), else a sentence saying which pair cannot or why not. Collective:
        every rank must call it; every rank gets the same answer."""
        device = torch.device(device)
        if self.tp == 1:
            return None
        if device.type != "cuda":
            return f"the ranks run on {device.type}, not CUDA"
        idx = torch.tensor([torch.cuda.current_device() if device.index is None else device.index],
                           dtype=torch.int64, device=device)
        parts = [torch.empty_like(idx) for _ in range(self.tp)]
        dist.all_gather(parts, idx, group=self.group)
        mine = int(idx.item())
        bad = [int(p.item()) for p in parts if int(p.item()) != mine
               and not torch.cuda.can_device_access_peer(mine, int(p.item()))]
        verdict = torch.tensor([len(bad)], dtype=torch.int64, device=device)
        dist.all_reduce(verdict, group=self.group)
        if bad:
            return f"GPU {mine} (rank {self.rank}) cannot access GPU(s) {bad} peer-to-peer"
        if int(verdict.item()):
            return "some rank's GPU cannot access another rank's GPU peer-to-peer"
        return None

    def same_on_all_ranks(self, t: torch.Tensor) -> bool:
        """True when every rank holds bitwise the same `t` (a check for tests and the demo)."""
        if self.tp == 1:
            return True
        parts = [torch.empty_like(t) for _ in range(self.tp)]
        dist.all_gather(parts, t.contiguous(), group=self.group)
        view = t.dtype.itemsize
        as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[view]
        return all(torch.equal(p.view(as_int), parts[0].view(as_int)) for p in parts)


def from_environment(backend: str | None = None) -> TensorParallel:
    """Join the process group a launcher (torchrun) describes in RANK / WORLD_SIZE / MASTER_ADDR;
    a single process (no WORLD_SIZE) gets TensorParallel(1, 0). backend: default NCCL with a GPU,
    gloo without."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return TensorParallel()
    if not dist.is_initialized():
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        dist.init_process_group(backend)
    return TensorParallel(dist.get_world_size(), dist.get_rank())
