"""The step's streams: the main stream and four auxiliary lanes, and the events between them.

Every cross-lane handoff is one event, recorded where the protected tensor is written and waited on
where it is first read. On the CPU, or with overlap off, every lane is the current stream and the
events are None (waiting on None is a no-op), so the same schedule runs serially.

Priorities: the step's graphs are captured on `Lanes.capture` and every lane but the mixer's runs at
`PRIORITY_CRITICAL`; the mixer's lane (the next site's mixer, the candidate expansion: work with a
whole layer of slack) at `PRIORITY_SLACK`, the lowest. A captured kernel keeps its stream's priority
(torch instantiates graphs with cudaGraphInstantiateFlagUseNodePriority), so when both are ready the
block scheduler gives the SMs to the critical chain first. On an H200 (32K, graph replay) the step
took 3.82 / 4.27 / 5.25 / 10.21 ms at 1 / 8 / 16 / 64 rows this way against 3.96 / 4.40 / 5.54 /
10.46 with every stream at the default priority, with the same bits.

An invariant the schedule keeps: no kernel on a side lane waits for other programs of its own
launch. On the main stream the sparse MLA's spread combination and the first launch of its "pv"
combination wherever their grid fits on the SMs at once (`TICKET` off in `ops.gluon_sparse_mla`;
`STEP_CONFIGS`: at 64 heads the spread combination at 1-12 rows and "pv" from 13, at 32 heads "pv"
at 27-32 and 53-64 rows and the spread combination at the others, at 8-16 heads the spread
combination at every row count) and the co-resident mHC boundary (`ops.mhc`,
`MhcBoundaryPlan.coresident`) do, and count on every program of the launch becoming resident;
beside side-lane kernels that finish on their own they are only delayed, beside another waiting
kernel both could stall until their bounded waits give up. The one-launch top-k
(`topk_ascending_(one_launch=True)`), which the step runs on the main stream at 1-4 rows where
the scorer built its histogram (`attention.topk_launch`), waits likewise, its waits bounded too.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

AUX_COMPRESSOR = 0   # compressor kv_score, state update, latent, index key
AUX_MIXER = 1        # the next site's mHC mixer; candidate expansion
AUX_INDEX_Q = 2      # indexer query (and weights_proj unless on its own lane)
AUX_INDEX_W = 3      # indexer weights_proj where it runs beside the index query's GEMM; the records prefetch

PRIORITY_CRITICAL = -1   # CUDA stream priorities: lower is more urgent; 0 is the default and the least
PRIORITY_SLACK = 0
_LANE_PRIORITY = (PRIORITY_CRITICAL, PRIORITY_SLACK, PRIORITY_CRITICAL, PRIORITY_CRITICAL)   # per aux lane

Event = torch.cuda.Event


class Lanes:
    """Lanes of one DecodeStep, shared by all its layers.

    device: the step's device; side lanes exist only on CUDA.
    overlap: side work (the side projections, the prepare work, the candidate expansion, the next
        site's mixer) on lanes 0-3; off (and always on the CPU) everything runs on the main stream.
    capture: on CUDA, the stream the step's graphs are captured on (the main stream of a replay),
        at `PRIORITY_CRITICAL`; None on the CPU.
    """

    def __init__(self, device: torch.device, overlap: bool):
        cuda = device.type == "cuda"
        self.device = device
        self.overlap = cuda and bool(overlap)
        self._aux = [torch.cuda.Stream(device, priority=p) for p in _LANE_PRIORITY] if cuda else []
        self.capture = torch.cuda.Stream(device, priority=PRIORITY_CRITICAL) if cuda else None

    def side(self, lane: int):
        """Context running the enclosed ops on aux lane `lane` (or inline when overlap is off)."""
        return torch.cuda.stream(self._aux[lane]) if self.overlap else contextlib.nullcontext()

    def mark(self, ev: Event | None = None) -> Event | None:
        """An event recorded on the current stream: `ev` (handed out before, by `event`) or a new
        one (None when nothing runs concurrently)."""
        if not self.overlap:
            return None
        ev = torch.cuda.Event() if ev is None else ev
        ev.record()
        return ev

    def event(self) -> Event | None:
        """A new event to record later with `mark(ev)` (None when nothing runs concurrently). A wait
        on it must be enqueued after its record, or it waits for nothing."""
        return torch.cuda.Event() if self.overlap else None

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
    prefetch: the last layer's records prefetch (`AttentionStep._prefetch`; a lane runs in order,
        so it follows the earlier layers' ones), None when none is pending.
    """

    candidates: Event | None = None
    prefetch: Event | None = None

    def join(self, lanes: Lanes) -> None:
        """The main stream waits for every side lane's pending work (the end of a step)."""
        lanes.wait(self.candidates, self.prefetch)
