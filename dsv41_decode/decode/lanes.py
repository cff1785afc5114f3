"""The step's streams: the main stream, three auxiliary lanes and an L2-prefetch lane, and the events
between them.

Every cross-lane handoff is one event, recorded where the protected tensor is written and waited on
where it is first read. On the CPU, or with overlap off, every lane is the current stream and the
events are None (waiting on None is a no-op), so the same schedule runs serially.
"""

from __future__ import annotations

import contextlib

import torch

AUX_COMPRESSOR = 0   # compressor kv_score, state update, latent, index key
AUX_INDEX_W = 1      # indexer weights_proj; the next site's mHC mixer; candidate expansion
AUX_INDEX_Q = 2      # indexer query; sparse-index table builds; the torch window copy (window_copy_in_wo_a=False)


class Lanes:
    """Lanes of one DecodeStep, shared by all its layers.

    device: the step's device; side lanes exist only on CUDA.
    overlap_inputs: side projections and prepare work on lanes 0-2 (else on the main stream).
    overlap_candidates: the candidate expansion on lane 1 (else inline on the main stream).
    l2_prefetch: a fifth stream for `ops.l2_prefetch` launches (CUDA only; see `prefetch`).
    """

    def __init__(self, device: torch.device, overlap_inputs: bool, overlap_candidates: bool,
                 l2_prefetch: bool = False):
        cuda = device.type == "cuda"
        self.device = device
        self.overlap_inputs = cuda and overlap_inputs
        self.overlap_candidates = cuda and overlap_candidates
        self._aux = [torch.cuda.Stream(device) for _ in range(3)] if cuda else []
        self._prefetch = torch.cuda.Stream(device) if cuda and l2_prefetch else None

    def prefetch(self, *launches) -> torch.cuda.Event | None:
        """Run the given L2 prefetches on the prefetch lane, after everything enqueued so far on the
        current stream (so they start no earlier than this point of the schedule). Nothing waits for
        them (they change no value); the returned event is joined at the end of the step. None and
        nothing launched without the lane."""
        if self._prefetch is None or not launches:
            return None
        fork = torch.cuda.Event()
        fork.record()
        with torch.cuda.stream(self._prefetch):
            torch.cuda.current_stream().wait_event(fork)
            for launch in launches:
                launch()
            done = torch.cuda.Event()
            done.record()
        return done

    def side(self, lane: int, candidates: bool = False):
        """Context running the enclosed ops on aux lane `lane` (or inline when that overlap is off)."""
        on = self.overlap_candidates if candidates else self.overlap_inputs
        return torch.cuda.stream(self._aux[lane]) if on else contextlib.nullcontext()

    def mark(self) -> torch.cuda.Event | None:
        """An event recorded on the current stream (None when nothing runs concurrently)."""
        if not (self.overlap_inputs or self.overlap_candidates):
            return None
        ev = torch.cuda.Event()
        ev.record()
        return ev

    @staticmethod
    def wait(*events: torch.cuda.Event | None) -> None:
        """Make the current stream wait for every given event (None: already ordered)."""
        for ev in events:
            if ev is not None:
                torch.cuda.current_stream().wait_event(ev)
