"""The rows of one call (a prefill chunk or a decode step) as `DecodeState.plan` lays them out, the
error a state raises where a capacity would be exceeded (`plan`, `admit`), and the small host-side
checks that the state, the stack and the step share (`as_count`, `same_device`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import cached_property

import numpy as np
import torch

from .upload import HostUpload


class CapacityError(RuntimeError):
    """A request, context or page capacity of a `DecodeState` would be exceeded.

    The message names the capacity ("requests", "context", "pages of ratio r") and the numbers.
    """


@dataclass(frozen=True, eq=False)
class StepRows:
    """The rows of one call (a prefill chunk or a decode step), grouped by request, in order.

    req_ids: one id per request in the call, in call order.
    counts: rows per request (1 + draft tokens in decode; the chunk length in prefill).
    starts: each request's first position (= its cached length before the call).
    req_slot: int64 [N] on the state's device: each row's request slot.
    positions: int64 [N] on the state's device: each row's absolute position (p, p+1, ... within a
        request).
    (Both uploaded from the host fields at their first read, one copy for the two, through `upload`,
    on the stream and device current then: the specialized step, which builds its own record from
    the host fields, never reads them. They need `slots`.)
    row_start: the index of each request's first row among the N rows.
    plan_key: which plan of which state made these rows (`DecodeState.check_step` compares it; a
        deep copy of the state keeps the pending plan's key, so a snapshot accepts the rows planned
        before it, and numbers its later plans under an id of its own).
    slots: each request's slot, on the host (what a caller builds host tables from without reading
        `req_slot` back from the device).
    """

    req_ids: tuple
    counts: tuple[int, ...]
    starts: tuple[int, ...]
    row_start: tuple[int, ...]
    plan_key: tuple = ()
    slots: tuple[int, ...] = ()
    upload: HostUpload | None = field(default=None, repr=False)   # the state's (None: the CPU)

    def __deepcopy__(self, memo) -> "StepRows":
        """The same rows (the fields are immutable), sharing the state's `upload`."""
        return replace(self)

    @cached_property
    def _slot_pos(self) -> torch.Tensor:
        """int64 [2, N]: req_slot, positions (one upload)."""
        if len(self.slots) != len(self.counts):
            raise ValueError("StepRows: req_slot and positions need the rows' host slots (plan them with "
                             "DecodeState.plan)")
        rows = [[s for s, c in zip(self.slots, self.counts) for _ in range(c)],
                [p for a, c in zip(self.starts, self.counts) for p in range(a, a + c)]]
        if self.upload is None:
            return torch.tensor(rows, dtype=torch.int64)
        return self.upload.tensor(rows, torch.int64)

    @property
    def req_slot(self) -> torch.Tensor:
        return self._slot_pos[0]

    @property
    def positions(self) -> torch.Tensor:
        return self._slot_pos[1]

    @property
    def n_rows(self) -> int:
        """N, the rows of the call over all its requests."""
        return sum(self.counts)

    @property
    def n_requests(self) -> int:
        return len(self.req_ids)

    def request_rows(self, i: int) -> slice:
        """The rows of the call's i-th request: `slice(row_start[i], row_start[i] + counts[i])`."""
        return slice(self.row_start[i], self.row_start[i] + self.counts[i])


def as_count(value) -> int | None:
    """`value` as a Python int when it is an integer: a Python int or a numpy integer (what a
    sampler's arrays hold), not a bool; None for anything else (a float, a string, a tensor, whose
    value a GPU would have to be waited for)."""
    if type(value) is int:                                # the common case first: a call's rows go through here
        return value
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        return int(value)
    return None


def same_device(a: torch.device, b: torch.device) -> bool:
    """True when `a` is `b`, taking a device without an index ("cuda") as the current one."""
    if a.type != b.type:
        return False
    if a.index is None or b.index is None:
        cur = torch.cuda.current_device() if a.type == "cuda" else None
        return (a.index if a.index is not None else cur) == (b.index if b.index is not None else cur)
    return a.index == b.index
