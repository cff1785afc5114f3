"""The step's streams: the main stream and three auxiliary lanes, and the events between them.

Every cross-lane handoff is one event, recorded where the protected tensor is written and waited on
where it is first read. On the CPU, or with overlap off, every lane is the current stream and the
events are None (waiting on None is a no-op), so the same schedule runs serially.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

AUX_COMPRESSOR = 0   # compressor kv_score, state update, latent, index key
AUX_INDEX_W = 1      # indexer weights_proj; the next site's mHC mixer; candidate expansion
AUX_INDEX_Q = 2      # indexer query; sparse-index table builds

Event = torch.cuda.Event


class Lanes:
    """Lanes of one DecodeStep, shared by all its layers.

    device: the step's device; side lanes exist only on CUDA.
    overlap: side work (the side projections, the prepare work, the candidate expansion, the next
        site's mixer) on lanes 0-2; off (and always on the CPU) everything runs on the main stream.
    """

    def __init__(self, device: torch.device, overlap: bool):
        cuda = device.type == "cuda"
        self.device = device
        self.overlap = cuda and bool(overlap)
        self._aux = [torch.cuda.Stream(device) for _ in range(3)] if cuda else []

    def side(self, lane: int):
        """Context running the enclosed ops on aux lane `lane` (or inline when overlap is off)."""
        return torch.cuda.stream(self._aux[lane]) if self.overlap else contextlib.nullcontext()

    def mark(self) -> Event | None:
        """An event recorded on the current stream (None when nothing runs concurrently)."""
        if not self.overlap:
            return None
        ev = torch.cuda.Event()
        ev.record()
        return ev

    @staticmethod
    def wait(*events: Event | None) -> None:
        """Make the current stream wait for every given event (None: already ordered)."""
        for ev in events:
            if ev is not None:
                torch.cuda.current_stream().wait_event(ev)


@dataclass
class StepEvents:
    """The events one step carries from layer to layer (a new one per step or captured bucket).

    candidates: the candidate expansion in flight on a side lane (it still reads the indexer's
        scores, which the next indexer overwrites; None when none is pending).
    tables: per index source layer, the event that marks its sparse-index table built (read by
        the layers that use its selection).
    """

    candidates: Event | None = None
    tables: dict[int, Event | None] = field(default_factory=dict)

    def join(self, lanes: Lanes) -> None:
        """The main stream waits for every side lane's pending work (the end of a step)."""
        lanes.wait(self.candidates, *self.tables.values())
