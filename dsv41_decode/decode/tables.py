"""Per-step metadata and window tables of the specialized decode step (design section 2.4-2.5).

`StepMeta` owns every per-row quantity of a step in persistent device buffers sized for the largest
row bucket. The host fills one small int64 record per row before a replay (`load`: built with numpy
from the plan's host fields, one copy from pinned memory that does not wait for the device);
everything else - window tables, ring and staging slots, RoPE rotations, visible-entry counts,
compressed-entry slots - is derived on the device inside the captured step (`derive`), once per
step, and shared by every layer.

Row layout of the host record (`FIELDS`): the request slot (-1 for a padding row of the bucket),
the position (-1 for padding), the request's first position in this step (its `start`), the index
of the request's first row in the step, and the request's last position in this step.

Window records of the step's own rows are staged (`DecodeState.stage_base + row`) and copied into
their ring slots after the layer's attention has read the ring (`ring_dst`/`stage_src`): a
request's later rows would otherwise overwrite ring slots its earlier rows still see.

The sparse-index tables are not built here: each indexer layer builds its own into its
`IndexSelection` (`ops.sparse_tables.topk_slots_`, or `ops.topk.topk_ascending_(table=)` with
`DecodeStep(fold_index_chain=True)`).
"""

from __future__ import annotations

import numpy as np
import torch

from ..config import ModelConfig
from ..reference.rope import rope_cis, rope_freqs
from ..ops.sparse_tables import step_rows_
from ..rows import StepRows
from ..state import DecodeState
from ..upload import HostUpload

FIELDS = ("req_slot", "position", "start", "first_row", "last_position")


def padding_record(rows: int) -> torch.Tensor:
    """The int64 [len(FIELDS), rows] record of `rows` padding rows (CPU): slot -1, position -1,
    start 0, each its own first row, last position -1. A run over them writes no cache or state."""
    return torch.from_numpy(_padding(rows))


def _padding(rows: int) -> np.ndarray:
    rec = np.full((len(FIELDS), rows), -1, dtype=np.int64)
    rec[2] = 0
    rec[3] = np.arange(rows)
    return rec


def host_record(step: StepRows, bucket: int) -> np.ndarray:
    """The int64 [len(FIELDS), bucket] record of a planned step padded to `bucket` rows, as a numpy
    array built from the step's host fields (slots, starts, counts, row_start): nothing is read
    from the device. ValueError for more rows than `bucket`, or a step without host slots."""
    n = step.n_rows
    if n > bucket:
        raise ValueError(f"the step has {n} rows, more than its bucket {bucket}")
    if len(step.slots) != step.n_requests:
        raise ValueError("the step carries no host slots: plan it with DecodeState.plan")
    rec = _padding(bucket)
    counts = np.asarray(step.counts, dtype=np.int64)
    starts = np.asarray(step.starts, dtype=np.int64)
    first = np.asarray(step.row_start, dtype=np.int64)
    rec[0, :n] = np.repeat(np.asarray(step.slots, dtype=np.int64), counts)
    rec[1, :n] = np.repeat(starts - first, counts) + np.arange(n)     # start + (row - first row)
    rec[2, :n] = np.repeat(starts, counts)
    rec[3, :n] = np.repeat(first, counts)
    rec[4, :n] = np.repeat(starts + counts - 1, counts)
    return rec


class StepMeta:
    """Persistent per-row buffers of a step, on the state's device; views `[:bucket]` per bucket.

    record: int64 [5, max_rows] (FIELDS), loaded by the host before each replay (rows past the
      step's: padding) from pinned memory the StepMeta owns, without waiting for the device.
    Derived on the device by `derive(rows)`:
      window_table int32 [max_rows, W]: the ring or staging slot of each position p-W+1..p, -1 none
        (ring slot `s * M + q % M`, M = `state.ring_size`);
      stage_slot int64 [max_rows]: where the window insert (`rms_norm_pair_`) writes the row's record (-1: pad);
      stage_src / ring_dst int64 [max_rows]: the post-attention copy (padding and rows whose ring
        slot a later row of the same request takes copy onto themselves);
      kernel_slot int64 [max_rows]: the request slot, 0 for padding (for kernels that index tables);
      cos/sin[ratio] FP32 [max_rows, rope/2]: RoPE at the row's position, for each ratio in the
        stack (padding rows at position 0);
      n_vis[r] int32 [max_rows]: visible compressed entries (p + 1) // r, 0 for padding;
      entry_slot[r] int64 [max_rows]: global slot of the entry the row completes, else -1;
      group_cos/group_sin[r]: RoPE at the completed group's first position p + 1 - r.
    """

    def __init__(self, cfg: ModelConfig, state: DecodeState, max_rows: int):
        if max_rows > state.stage_rows:
            raise ValueError(f"max_rows={max_rows} exceeds the state's stage_rows={state.stage_rows}; "
                             f"build the DecodeState with stage_rows >= {max_rows}")
        self.cfg, self.state, self.max_rows = cfg, state, max_rows
        dev = state.device
        W = cfg.window_size
        self.record = padding_record(max_rows).to(dev)
        self._upload = HostUpload(dev, slot_bytes=self.record.numel() * 8, slots=4)
        self.window_table = torch.full((max_rows, W), -1, dtype=torch.int32, device=dev)
        self.stage_slot = torch.full((max_rows,), -1, dtype=torch.int64, device=dev)
        self.stage_src = torch.arange(max_rows, device=dev) + state.stage_base
        self.ring_dst = self.stage_src.clone()
        self.kernel_slot = torch.zeros(max_rows, dtype=torch.int64, device=dev)
        # RoPE rotations: one (frequencies, position offset) combination per use - each ratio at the
        # row's position, and each compressed ratio at its group's first position p + 1 - r -
        # stacked so that one polar() serves them all; cos/sin[...] are views of `_cs`.
        half = cfg.rope_head_dim // 2
        uses = [("pos", r, 0) for r in sorted({s.ratio for s in cfg.plan})]
        uses += [("group", r, 1 - r) for r in state.ratios]
        self._use_freqs = torch.stack([rope_freqs(cfg, r) for _, r, _ in uses]).to(dev)      # [K, half]
        self._use_offset = torch.tensor([off for _, _, off in uses], dtype=torch.int64, device=dev)
        self._cs = torch.zeros(2, len(uses), max_rows, half, device=dev)
        self._angles = torch.zeros(len(uses), max_rows, half, device=dev)      # written by the table kernel
        self._ones = torch.ones(len(uses), max_rows, half, device=dev)         # polar()'s magnitudes
        self.cos, self.sin, self.group_cos, self.group_sin = {}, {}, {}, {}
        for k, (what, r, _) in enumerate(uses):
            cos, sin = (self.cos, self.sin) if what == "pos" else (self.group_cos, self.group_sin)
            cos[r], sin[r] = self._cs[0, k], self._cs[1, k]
        self._ratios = state.ratios
        self._nvis = torch.zeros(len(state.ratios), max_rows, dtype=torch.int32, device=dev)
        self._entry = torch.full((len(state.ratios), max_rows), -1, dtype=torch.int64, device=dev)
        self.n_vis = {r: self._nvis[k] for k, r in enumerate(state.ratios)}
        self.entry_slot = {r: self._entry[k] for k, r in enumerate(state.ratios)}

    def pad(self, rows: int) -> None:
        """Make the first `rows` rows padding (warm-up and capture runs write nothing)."""
        self.record[:, :rows].copy_(padding_record(rows))

    def load(self, step: StepRows, bucket: int) -> None:
        """Load the step's host record into `record` (its rows past the step's: padding), ordered on
        the current stream; the host does not wait for the device (`HostUpload`). ValueError when
        the step has more rows than `bucket`."""
        if step.n_rows > bucket:
            raise ValueError(f"the step has {step.n_rows} rows, more than its bucket {bucket}")
        self._upload.copy_(self.record, host_record(step, self.max_rows))

    def derive(self, rows: int) -> None:
        """Fill the derived buffers of the first `rows` rows from `record`: one table kernel (with
        the RoPE angles) and one batched polar() and its copy into the cos/sin planes (device ops
        only; `derive_reference` is the readable form)."""
        st = self.state
        # the table kernel writes the angles with the same FP32 cast and products as
        # reference.rope.rope_cis; the same polar() then, for every use at once
        step_rows_(self.record[:, :rows], self.cfg.window_size, st.stage_base,
                   [(r, st.block_table[r]) for r in self._ratios], st.page_size, self.window_table[:rows],
                   self.stage_slot[:rows], self.ring_dst[:rows], self.kernel_slot[:rows], self._nvis,
                   self._entry, ring=st.ring_size, rope=(self._use_offset, self._use_freqs, self._angles))
        cis = torch.polar(self._ones[:, :rows], self._angles[:, :rows])
        self._cs[:, :, :rows] = torch.view_as_real(cis).permute(3, 0, 1, 2)

    def derive_reference(self, rows: int) -> dict[str, torch.Tensor]:
        """What `derive` writes for the first `rows` rows, in plain torch (tests compare the two)."""
        st, W, M = self.state, self.cfg.window_size, self.state.ring_size
        slot, pos, start, first, last = (self.record[i, :rows] for i in range(len(FIELDS)))
        live = slot >= 0
        row = torch.arange(rows, device=slot.device)
        q = pos[:, None] + torch.arange(W, device=slot.device)[None, :] - (W - 1)        # [rows, W]
        ring = slot[:, None] * M + torch.remainder(q, M)
        stage = st.stage_base + first[:, None] + (q - start[:, None])
        table = torch.where(q >= start[:, None], stage, ring)
        out = {"window_table": torch.where(q >= 0, table, -1).to(torch.int32),
               "stage_slot": torch.where(live, st.stage_base + row, -1),
               "ring_dst": torch.where(live & (pos > last - M), slot * M + torch.remainder(pos, M),
                                       st.stage_base + row),
               "kernel_slot": slot.clamp(min=0)}
        page = st.page_size
        for r in st.ratios:
            out[f"n_vis{r}"] = torch.div(pos + 1, r, rounding_mode="floor").clamp(min=0).to(torch.int32)
            e = torch.div(pos + 1, r, rounding_mode="floor") - 1
            done = live & (torch.remainder(pos + 1, r) == 0)
            table_r = st.block_table[r]
            col = (e.clamp(min=0) // page).clamp(max=table_r.shape[1] - 1)
            pg = table_r[slot.clamp(min=0), col].to(torch.int64)
            out[f"entry_slot{r}"] = torch.where(done & (pg >= 0), pg * page + e.clamp(min=0) % page, -1)
            g = rope_cis(rope_freqs(self.cfg, r).to(slot.device), (pos + 1 - r).clamp(min=0))
            out[f"group_cos{r}"], out[f"group_sin{r}"] = g.real, g.imag
        for r in self.cos:
            c = rope_cis(rope_freqs(self.cfg, r).to(slot.device), pos.clamp(min=0))
            out[f"cos{r}"], out[f"sin{r}"] = c.real, c.imag
        return out

    def copy_staged(self, window: torch.Tensor, rows: int) -> None:
        """Move the step's staged window records of one layer's pool into their ring slots."""
        window.index_copy_(0, self.ring_dst[:rows], window.index_select(0, self.stage_src[:rows]))
