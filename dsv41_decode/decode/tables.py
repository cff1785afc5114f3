"""Per-step metadata and sparse-index tables of the specialized decode step (design section 2.4-2.5).

`StepMeta` owns every per-row quantity of a step in persistent device buffers sized for the largest
row bucket. The host fills one small int64 record per row before a replay (`load`, one copy);
everything else - window tables, ring and staging slots, RoPE rotations, visible-entry counts,
compressed-entry slots - is derived on the device inside the captured step (`derive`), once per
step, and shared by every layer.

Row layout of the host record (`FIELDS`): the request slot (-1 for a padding row of the bucket),
the position (-1 for padding), the request's first position in this step (its `start`), the index
of the request's first row in the step, and the request's last position in this step.

Window records of the step's own rows are staged (`DecodeState.stage_base + row`) and copied into
their ring slots after the layer's attention has read the ring (`ring_dst`/`stage_src`): a
request's later rows would otherwise overwrite ring slots its earlier rows still see.
"""

from __future__ import annotations

import torch

from ..config import ModelConfig
from ..reference.rope import rope_cis, rope_freqs
from ..state import DecodeState, StepRows

FIELDS = ("req_slot", "position", "start", "first_row", "last_position")


def host_record(step: StepRows, bucket: int) -> torch.Tensor:
    """The int64 [len(FIELDS), bucket] record of a planned step padded to `bucket` rows (CPU)."""
    n = step.n_rows
    if n > bucket:
        raise ValueError(f"the step has {n} rows, more than its bucket {bucket}")
    rec = torch.empty(len(FIELDS), bucket, dtype=torch.int64)
    rec[0].fill_(-1)
    rec[1].fill_(-1)
    rec[2].zero_()
    rec[3] = torch.arange(bucket)
    rec[4].fill_(-1)
    rec[0, :n] = step.req_slot.cpu()
    rec[1, :n] = step.positions.cpu()
    for i, (start, count) in enumerate(zip(step.starts, step.counts)):
        rows = step.request_rows(i)
        rec[2, rows] = start
        rec[3, rows] = rows.start
        rec[4, rows] = start + count - 1
    return rec


class StepMeta:
    """Persistent per-row buffers of a step, on the state's device; views `[:bucket]` per bucket.

    record: int64 [5, max_rows] (FIELDS), loaded by the host before each replay.
    Derived on the device by `derive(rows)`:
      window_table int32 [max_rows, W]: the ring or staging slot of each position p-W+1..p, -1 none;
      stage_slot int64 [max_rows]: where `qkv_rope_insert_` writes the row's window record (-1: pad);
      stage_src / ring_dst int64 [max_rows]: the post-attention copy (padding and rows whose ring
        slot a later row of the same request takes copy onto themselves);
      kernel_slot int64 [max_rows]: the request slot, 0 for padding (for kernels that index tables);
      cis[ratio] complex64, cos/sin[ratio] FP32 [max_rows, rope/2]: RoPE at the row's position, for
        each ratio in the stack (padding rows at position 0);
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
        self.record = torch.zeros(len(FIELDS), max_rows, dtype=torch.int64, device=dev)
        self.record[0].fill_(-1)
        self.record[1].fill_(-1)
        self.record[3] = torch.arange(max_rows, device=dev)
        self.window_table = torch.full((max_rows, W), -1, dtype=torch.int32, device=dev)
        self.stage_slot = torch.full((max_rows,), -1, dtype=torch.int64, device=dev)
        self.stage_src = torch.arange(max_rows, device=dev) + state.stage_base
        self.ring_dst = self.stage_src.clone()
        self.kernel_slot = torch.zeros(max_rows, dtype=torch.int64, device=dev)
        ratios = sorted({s.ratio for s in cfg.plan})
        self.freqs = {r: rope_freqs(cfg, r).to(dev) for r in ratios}
        half = cfg.rope_head_dim // 2
        self.cos = {r: torch.zeros(max_rows, half, device=dev) for r in ratios}
        self.sin = {r: torch.zeros(max_rows, half, device=dev) for r in ratios}
        self.cis = {r: torch.zeros(max_rows, half, dtype=torch.complex64, device=dev) for r in ratios}
        self.n_vis = {r: torch.zeros(max_rows, dtype=torch.int32, device=dev) for r in state.ratios}
        self.entry_slot = {r: torch.full((max_rows,), -1, dtype=torch.int64, device=dev) for r in state.ratios}
        self.group_cos = {r: torch.zeros(max_rows, half, device=dev) for r in state.ratios}
        self.group_sin = {r: torch.zeros(max_rows, half, device=dev) for r in state.ratios}
        self._offsets = torch.arange(W, device=dev) - (W - 1)

    def load(self, step: StepRows, bucket: int) -> None:
        """Copy the step's host record into `record[:, :bucket]`, ordered on the current stream."""
        self.record[:, :bucket].copy_(host_record(step, bucket))

    def derive(self, rows: int) -> None:
        """Fill the derived buffers of the first `rows` rows from `record` (device ops only)."""
        st, W = self.state, self.cfg.window_size
        slot, pos, start, first, last = (self.record[i, :rows] for i in range(len(FIELDS)))
        live = slot >= 0
        row = torch.arange(rows, device=slot.device)
        q = pos[:, None] + self._offsets[None, :]                                 # [rows, W]
        ring = slot[:, None] * W + torch.remainder(q, W)
        stage = st.stage_base + first[:, None] + (q - start[:, None])
        table = torch.where(q >= start[:, None], stage, ring)
        self.window_table[:rows] = torch.where(q >= 0, table, -1).to(torch.int32)
        self.stage_slot[:rows] = torch.where(live, st.stage_base + row, -1)
        keep = live & (pos > last - W)          # a later row of the request does not take the slot
        self.ring_dst[:rows] = torch.where(keep, slot * W + torch.remainder(pos, W), self.stage_src[:rows])
        self.kernel_slot[:rows] = slot.clamp(min=0)
        p0 = pos.clamp(min=0)
        for r, f in self.freqs.items():
            cis = rope_cis(f, p0)
            self.cis[r][:rows] = cis
            self.cos[r][:rows] = cis.real
            self.sin[r][:rows] = cis.imag
        page = st.page_size
        for r in st.ratios:
            self.n_vis[r][:rows] = torch.div(pos + 1, r, rounding_mode="floor").clamp(min=0).to(torch.int32)
            e = torch.div(pos + 1, r, rounding_mode="floor") - 1
            done = live & (torch.remainder(pos + 1, r) == 0)
            table_r = st.block_table[r]
            col = (e.clamp(min=0) // page).clamp(max=table_r.shape[1] - 1)
            pg = table_r[self.kernel_slot[:rows], col].to(torch.int64)
            self.entry_slot[r][:rows] = torch.where(done & (pg >= 0), pg * page + e.clamp(min=0) % page, -1)
            g = rope_cis(self.freqs[r], (pos + 1 - r).clamp(min=0))
            self.group_cos[r][:rows] = g.real
            self.group_sin[r][:rows] = g.imag

    def copy_staged(self, window: torch.Tensor, rows: int) -> None:
        """Move the step's staged window records of one layer's pool into their ring slots."""
        window.index_copy_(0, self.ring_dst[:rows], window.index_select(0, self.stage_src[:rows]))
