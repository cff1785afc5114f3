"""The generic path's reads and writes of a `DecodeState`'s caches, and the checks of the state's
arguments.

`CacheIO` is a base class of `state.DecodeState`: its methods read and write the state's buffers
(`window`, `compressed`, `index_keys`, `block_table`) and the state's bookkeeping of which positions
a request slot holds (its lengths, its planned rows, the highest window position written since
admission) through the state's own fields; they exist for the generic layer
(`AttentionLayer.forward`) and the tests, one request slot and one layer at a time, with every
argument checked (ValueError naming the method and the argument). The decode step's kernels write
and read the same buffers directly.
"""

from __future__ import annotations

import torch

from .records import (
    pack_compressed_kv,
    pack_index_key,
    pack_window_kv,
    unpack_compressed_kv,
    unpack_index_key,
    unpack_window_kv,
)
from .rows import same_device


class CacheIO:
    """The generic path's cache reads and writes of `state.DecodeState` (module doc), and the
    checks of a layer, KV source, ratio, request slot, positions and values that the state's own
    methods share."""

    # ----- window cache (generic path) -----
    def window_slots(self, req_slot: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Global ring slots `req_slot * M + positions % M` (M = ring_size), int64, shaped like the
        inputs.

        req_slot, positions: int64 tensors of one shape. Unchecked: slots live, positions >= 0.
        """
        return req_slot.to(torch.int64) * self.ring_size + positions.to(torch.int64) % self.ring_size

    def write_window(self, layer: int, req_slot: int, positions: torch.Tensor,
                     values: torch.Tensor) -> None:
        """Store `pack_window_kv(values)` at the ring slots of `positions` of `req_slot`.

        layer: any layer of the stack.
        req_slot: a live request slot.
        positions: int64 [n], strictly increasing, each below the slot's length plus its planned
            rows. When n > M (ring_size) only the last M positions are stored (the others would be
            overwritten).
        values: bf16 [n, 512], RoPE'd (the record's MXFP8 quantization happens here).
        A call of several rows overwrites ring slots its earlier rows still need: read the cached
        positions (below the call's start) before writing the call's rows.
        """
        self._check_layer(layer, "write_window")
        self._check_slot(req_slot, "write_window")
        pos = self._positions(positions, "write_window")
        n = len(pos)
        self._check_values(values, (n, self.head_dim), "write_window", "values")
        if n == 0:
            return
        if any(b <= a for a, b in zip(pos, pos[1:])):
            raise ValueError(f"write_window: positions must be strictly increasing, got {pos}")
        end = self._lengths[req_slot] + self._pending[req_slot]
        if pos[0] < 0 or pos[-1] >= end:
            raise ValueError(
                f"write_window: layer {layer}, slot {req_slot}: positions {pos[0]}..{pos[-1]} are "
                f"outside 0..{end - 1} (length {self._lengths[req_slot]} + "
                f"{self._pending[req_slot]} planned rows)")
        M = self.ring_size
        keep = [i for i, p in enumerate(pos) if p > pos[-1] - M]
        if len(keep) < n:
            values = values[keep[0]:]
            pos = pos[keep[0]:]
        idx = torch.tensor([req_slot * M + p % M for p in pos], dtype=torch.int64, device=self.device)
        self._written = True
        self.window[layer].index_copy_(0, idx, pack_window_kv(values))
        hi = self._window_hi[self._window_row[layer]]
        hi[req_slot] = max(int(hi[req_slot]), pos[-1] + 1)

    def read_window(self, layer: int, req_slot: int, positions: torch.Tensor) -> torch.Tensor:
        """`unpack_window_kv` of the ring records of `positions` of `req_slot`: bf16 [n, 512].

        A position is held when `top - W <= p < top`, with top the larger of the slot's length and
        1 + the highest position written through `write_window` since admission (a planned row is
        readable once written). ValueError naming the position otherwise: it has left the ring,
        or it was never written.
        """
        self._check_layer(layer, "read_window")
        self._check_slot(req_slot, "read_window")
        pos = self._positions(positions, "read_window")
        top = max(self._lengths[req_slot], int(self._window_hi[self._window_row[layer], req_slot]))
        lo = max(0, top - self.window_size)
        bad = [p for p in pos if not lo <= p < top]
        if bad:
            raise ValueError(
                f"read_window: layer {layer}, slot {req_slot}: position {bad[0]} is not held in "
                f"the window ring, which holds positions {lo}..{top - 1} (W={self.window_size})")
        idx = self.window_slots(torch.full((len(pos),), req_slot), torch.tensor(pos, dtype=torch.int64))
        return unpack_window_kv(self.window[layer][idx.to(self.device)])

    # ----- compressor rows (generic path) -----
    def write_compressor_rows(self, layer: int, req_slot: int, positions: torch.Tensor,
                              kv: torch.Tensor, score: torch.Tensor) -> None:
        """Keep the FP32 compressor inputs of a ratio-2 KV source's rows in `comp_rows[layer]`
        (row `p % (max_drafts + 2)`), where `accept` restores the open group from. A no-op when
        the state takes no drafts (max_drafts = 0).

        positions: int64 [n], consecutive, of the slot's current call; kv, score: float32 [n, 512]
        (x @ wkv^T, x @ wgate^T). Only the last max_drafts + 2 rows are stored (the others would be
        overwritten).
        """
        r = self._check_source(layer, "write_compressor_rows")
        if r != 2:
            raise ValueError(f"write_compressor_rows: layer {layer} has ratio {r}; only ratio-2 "
                             f"compressors keep an open group")
        self._check_slot(req_slot, "write_compressor_rows")
        H = self.comp_history
        if not H or positions.numel() == 0:
            return
        pos = self._positions(positions, "write_compressor_rows")[-H:]
        n = len(pos)
        rows = torch.cat([kv[-n:], score[-n:]], dim=1).to(torch.float32)
        self._written = True
        self._groups.keep_rows(layer, req_slot, pos, rows)

    # ----- compressed caches (generic path) -----
    def entry_slots(self, ratio: int, req_slot: int, entries: torch.Tensor) -> torch.Tensor:
        """Global slots `block_table[ratio][req_slot, e // page_size] * page_size + e % page_size`.

        entries: int64 [n] entry indices (entry j covers positions j*r .. j*r + r - 1).
        Returns int64 [n] on the state's device. ValueError naming the first entry whose page is
        not allocated (or lies past max_context).
        """
        self._check_ratio(ratio)
        if entries.dim() != 1:
            raise ValueError(f"entry_slots: entries must be 1-D, got shape {tuple(entries.shape)}")
        entries = entries.to(device=self.device, dtype=torch.int64)
        if entries.numel() == 0:
            return entries.clone()
        table = self.block_table[ratio]
        col = entries // self.page_size
        off_table = (entries < 0) | (col >= table.shape[1])
        if bool(off_table.any()):
            e = int(entries[off_table][0])
            raise ValueError(f"entry_slots: entry {e} of ratio {ratio} is outside 0.."
                             f"{table.shape[1] * self.page_size - 1} (max_context="
                             f"{self.max_context}, page_size={self.page_size})")
        pages = table[req_slot, col].to(torch.int64)
        if bool((pages < 0).any()):
            e = int(entries[pages < 0][0])
            raise ValueError(f"entry_slots: entry {e} of ratio {ratio}, slot {req_slot} has no "
                             f"page allocated (plan() allocates pages for completed entries only)")
        return pages * self.page_size + entries % self.page_size

    def write_entries(self, layer: int, req_slot: int, entries: torch.Tensor, kv: torch.Tensor,
                      index_key: torch.Tensor) -> None:
        """Store `pack_compressed_kv(kv)` and `pack_index_key(index_key)` at `entries` of KV source
        `layer`, request slot `req_slot`.

        entries: int64 [n], each completed by the slot's length plus its planned rows
            (`e < (length + planned) // r`), so its page is allocated.
        kv: bf16 [n, 512], RoPE'd at the group's first position (NVFP4 packing happens here).
        index_key: bf16 [n, 128], RoPE'd (MXFP4 packing happens here).
        """
        r = self._check_source(layer, "write_entries")
        self._check_slot(req_slot, "write_entries")
        if entries.dim() != 1:
            raise ValueError(f"write_entries: entries must be 1-D, got shape {tuple(entries.shape)}")
        n = entries.shape[0]
        self._check_values(kv, (n, self.head_dim), "write_entries", "kv")
        self._check_values(index_key, (n, self.cfg.index_head_dim), "write_entries", "index_key")
        if n == 0:
            return
        done = (self._lengths[req_slot] + self._pending[req_slot]) // r
        e_max = int(entries.max())
        if e_max >= done:
            raise ValueError(f"write_entries: layer {layer}, slot {req_slot}: entry {e_max} is not "
                             f"completed; entries 0..{done - 1} are (ratio {r})")
        self._written = True
        idx = self.entry_slots(r, req_slot, entries)
        self.compressed[layer].index_copy_(0, idx, pack_compressed_kv(kv))
        self.index_keys[layer].index_copy_(0, idx, pack_index_key(index_key))

    def read_entries(self, layer: int, req_slot: int,
                     n_entries: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Entries 0..n_entries-1 of KV source `layer`, request slot `req_slot`, dequantized:
        (kv bf16 [n, 512], index_key bf16 [n, 128]).

        n_entries must not exceed the entries completed by the slot's length plus its planned rows.
        """
        r = self._check_source(layer, "read_entries")
        self._check_slot(req_slot, "read_entries")
        done = (self._lengths[req_slot] + self._pending[req_slot]) // r
        if not isinstance(n_entries, int) or not 0 <= n_entries <= done:
            raise ValueError(f"read_entries: layer {layer}, slot {req_slot}: n_entries="
                             f"{n_entries!r}, but only {done} entries are completed (ratio {r})")
        idx = self.entry_slots(r, req_slot, torch.arange(n_entries, device=self.device))
        return (unpack_compressed_kv(self.compressed[layer][idx]),
                unpack_index_key(self.index_keys[layer][idx]))

    # ----- checks -----
    def _check_ratio(self, ratio: int) -> None:
        if ratio not in self.block_table:
            raise ValueError(f"ratio {ratio!r} has no compressed caches in this stack; "
                             f"ratios present: {list(self.ratios)}")

    def _check_layer(self, layer: int, what: str) -> None:
        if layer not in self.window:
            raise ValueError(f"{what}: layer {layer!r} is not in the stack (0..{len(self.window) - 1})")

    def _check_source(self, layer: int, what: str) -> int:
        self._check_layer(layer, what)
        if layer not in self.compressed:
            spec = self.layer_plan[layer]
            raise ValueError(f"{what}: layer {layer} ({spec.kind}) owns no compressed cache; "
                             f"its KV source is {spec.kv_source}")
        return self.cfg.ratio(layer)

    def _check_slot(self, req_slot: int, what: str) -> None:
        if (not isinstance(req_slot, int) or not 0 <= req_slot < self.max_requests
                or self._slot_req[req_slot] is None):
            raise ValueError(f"{what}: request slot {req_slot!r} is not a live slot")

    def _positions(self, positions: torch.Tensor, what: str) -> list[int]:
        if not isinstance(positions, torch.Tensor) or positions.dim() != 1:
            raise ValueError(f"{what}: positions must be a 1-D int64 tensor")
        if positions.dtype != torch.int64:
            raise ValueError(f"{what}: positions must be int64, got {positions.dtype}")
        return positions.tolist()

    def _check_values(self, t: torch.Tensor, shape: tuple[int, int], what: str, name: str) -> None:
        if t.dtype != torch.bfloat16:
            raise ValueError(f"{what}: {name} must be bfloat16, got {t.dtype}")
        if tuple(t.shape) != shape:
            raise ValueError(f"{what}: {name} must have shape {list(shape)}, got {list(t.shape)}")
        if not same_device(t.device, self.device):
            raise ValueError(f"{what}: {name} is on {t.device}, the state on {self.device}")
