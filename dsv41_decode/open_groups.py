"""The ratio-2 compressors' open groups of a `DecodeState`: their buffers, the compressor's recent
input rows, and what restores a group from those rows (spec section 3, step 4; spec decision 12).

A ratio-2 compressor completes an entry every two positions; between two entries it holds the open
group, the FP32 `kv | score` rows of positions p with p % 2 as their row. When the state takes
drafts (`history` > 0) every call that runs the source also keeps its rows' inputs, the last
`history = max_drafts + 2` of them per request, so that after rejected or abandoned rows the group
of a request's kept length - positions length - 1 and length - 2 - can be copied back. `OpenGroups`
owns those buffers and that copy; the `DecodeState` decides which slots and positions (it owns
the lengths, the calls and the pages) and where the copy waits (`leave`, `sync`).
"""

from __future__ import annotations

from typing import Iterable

import torch

from .upload import HostUpload

GroupRow = tuple[int, int, int, int]
"""(slot, p % 2, source slot, source row): where a restore copies a row of a group from."""


class OpenGroups:
    """The open group of every ratio-2 KV source for every request slot, and the source rows it is
    restored from.

    layers: the ratio-2 KV sources, in layer order; max_requests: request slots; head_dim: a row's
    channels; history: input rows kept per request (0: none, the state takes no drafts); device.

    Buffers (never reallocated):
      kv[L], score[L]: float32 [max_requests, 2, head_dim] (zeros and -inf for a fresh group), row
        p % 2: views of one buffer [slot, p % 2, source, kv | score, channel], so that a restore
        copies every source's rows in one indexed copy.
      rows[L] (history > 0 only): float32 [max_requests, history, 2 * head_dim]: the `kv | score`
        inputs of position p at row p % history; views of one buffer with one more slot row (index
        max_requests) holding a fresh group's values.
    stale: the slots whose groups a deferred accept left to restore (`leave`); until `sync`,
    `settle` or `reset`, `kv` / `score` hold what the slot's last call left there, `read` what a
    later call reads.
    """

    def __init__(self, layers: Iterable[int], max_requests: int, head_dim: int, history: int,
                 device: torch.device) -> None:
        layers = tuple(layers)
        self.history = history
        self.max_requests = max_requests
        self._source = {L: k for k, L in enumerate(layers)}
        self._comp = torch.zeros(max_requests, 2, len(layers), 2, head_dim, dtype=torch.float32, device=device)
        self._comp[:, :, :, 1] = float("-inf")
        self._rows = torch.zeros(max_requests + 1, history, len(layers), 2, head_dim, dtype=torch.float32,
                                 device=device)
        self._rows[max_requests, :, :, 1] = float("-inf")
        self.kv = {L: self._comp[:, :, k, 0] for L, k in self._source.items()}
        self.score = {L: self._comp[:, :, k, 1] for L, k in self._source.items()}
        self.rows = {L: self._rows[:max_requests, :, k].flatten(2) for L, k in self._source.items()} if history else {}
        self.stale: set[int] = set()

    def reset(self, s: int) -> None:
        """Slot s holds a fresh group and no input rows (a request admitted there), nothing left to
        restore: the step's compressor kernel, which reads a call's groups from `rows`, sees no
        earlier occupant's."""
        self._comp[s, :, :, 0] = 0.0
        self._comp[s, :, :, 1] = float("-inf")
        if self.history:
            self._rows[s].copy_(self._rows[self.max_requests])
        self.stale.discard(s)

    def row(self, s: int, p: int) -> GroupRow:
        """Where a restore copies position p's row of slot s's group from: its input row p % history
        (history > 0), or a fresh group's values for p < 0."""
        return (s, p % 2) + ((s, p % self.history) if p >= 0 else (self.max_requests, 0))

    def at_length(self, s: int, n: int) -> list[GroupRow]:
        """The rows of slot s's group at length n: positions n - 1 and n - 2."""
        return [self.row(s, p) for p in (n - 1, n - 2)]

    def restore(self, restore: list[GroupRow], upload: HostUpload) -> None:
        """Copy the rows in `restore` back into the groups: one upload, one gather and one indexed
        copy over every source, both on the buffers' leading two dimensions flattened
        (`index_select` / `index_copy_`: less host work than advanced indexing). The caller lists
        each (slot, p % 2) at most once (`index_copy_` with a destination twice is not
        deterministic on CUDA): a slot's rows at one length are of two parities. Nothing without
        sources or history."""
        if restore and self.rows:
            H = self._rows.shape[1]
            idx = upload.tensor([[s * 2 + half for s, half, _, _ in restore],
                                 [src * H + r for _, _, src, r in restore]], torch.int64)
            rows = self._rows.view(-1, *self._rows.shape[2:]).index_select(0, idx[1])
            self._comp.view(-1, *self._comp.shape[2:]).index_copy_(0, idx[0], rows)

    def leave(self, s: int) -> None:
        """Slot s's group is left for its next call (or `sync`) to restore."""
        self.stale.add(s)

    def settle(self, slots: Iterable[int]) -> None:
        """These slots' groups need no restore (a call that ran them rewrote them, or the slot went
        back)."""
        if self.stale:
            self.stale.difference_update(slots)

    def sync(self, lengths: list[int], upload: HostUpload) -> None:
        """Restore every group left to restore, at its slot's length in `lengths`."""
        if self.stale:
            restore = [r for s in sorted(self.stale) for r in self.at_length(s, lengths[s])]
            self.stale.clear()
            self.restore(restore, upload)

    def read(self, layer: int, s: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(kv, score) copies, float32 [2, head_dim] each: source `layer`'s group of slot s at length
        n as a later call reads it - `kv` / `score`, or the rows a restore would copy there where
        the slot's group is stale."""
        kv, score = self.kv[layer][s].clone(), self.score[layer][s].clone()
        if s in self.stale:
            for _, half, src, r in self.at_length(s, n):
                kept = self._rows[src, r, self._source[layer]]
                kv[half], score[half] = kept[0], kept[1]
        return kv, score

    def keep_rows(self, layer: int, s: int, positions: list[int], rows: torch.Tensor) -> None:
        """Store source `layer`'s input rows of slot s at `positions` (at most `history`, distinct
        modulo it): rows float32 [len(positions), 2 * head_dim] (`kv | score`) on the buffers'
        device. A no-op without history."""
        if self.history and positions:
            idx = torch.tensor([p % self.history for p in positions], dtype=torch.int64, device=rows.device)
            self.rows[layer][s].index_copy_(0, idx, rows)

    def nbytes(self) -> int:
        """Device bytes of the groups and the rows."""
        return sum(t.numel() * t.element_size() for t in (self._comp, self._rows))
