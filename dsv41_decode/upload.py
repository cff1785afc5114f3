"""Uploads of small host tables to the device that never wait for the device's other work.

A blocking host-to-device `copy_` from ordinary (pageable) memory synchronizes its stream: the host
waits until everything enqueued before the copy has run (PyTorch's `memcpy_and_sync`). A decode step
that uploads its rows' tables that way waits for the previous step's graph to finish before it can
enqueue the next one. `HostUpload` writes the values into pinned host memory it owns and copies them
with `non_blocking=True` instead, ordered on the device's current stream like any kernel.
"""

from __future__ import annotations

import numpy as np
import torch

_NUMPY = {torch.int64: np.int64, torch.int32: np.int32, torch.int16: np.int16, torch.uint8: np.uint8,
          torch.float32: np.float32, torch.float64: np.float64, torch.bool: np.bool_}
_ALIGN = 64


class HostUpload:
    """`dst.copy_(values)` for host values (lists, numpy arrays) into device tensors, ordered on the
    destination device's current stream; the host does not wait for the device.

    device: where the destinations live. On CUDA, `slots` pinned buffers of `slot_bytes` each take
        the uploads in turn: the values are written into the next slot, copied with
        `non_blocking=True` and followed by the slot's event. A slot is overwritten only once its
        event has completed: the host waits, at most, for the copy made `slots` uploads earlier (and
        what the stream ran before it), not for the work enqueued since, and does not wait at all
        when the device has got that far. A value larger than a slot goes through a pinned buffer of
        PyTorch's caching host allocator, which keeps the buffer until its copy has run (its first
        allocation may wait for the device). Elsewhere (the CPU) values are copied directly.
    slot_bytes: the largest upload a slot takes (rounded up to a multiple of 64 bytes).
    slots: how many uploads may be in flight before a slot's event is waited for.

    A deep copy gets its own pinned buffers and events (nothing in flight is shared).
    """

    def __init__(self, device: str | torch.device, slot_bytes: int = 1 << 16, slots: int = 8):
        if slot_bytes < 1 or slots < 1:
            raise ValueError(f"HostUpload: slot_bytes and slots must be >= 1, got {slot_bytes}, {slots}")
        self.device = torch.device(device)
        self.slot_bytes = -(-slot_bytes // _ALIGN) * _ALIGN
        self.slots = slots
        self.pinned = self.device.type == "cuda"
        self._next = 0
        if self.pinned:
            self._buf = torch.empty(slots, self.slot_bytes, dtype=torch.uint8, pin_memory=True)
            self._host = self._buf.numpy()
            # the event after each slot's last copy: the slot is free once it has completed
            self._done = [torch.cuda.Event() for _ in range(slots)]

    def __deepcopy__(self, memo) -> "HostUpload":
        return HostUpload(self.device, self.slot_bytes, self.slots)

    def copy_(self, dst: torch.Tensor, values) -> torch.Tensor:
        """Copy `values` (array-like of dst's shape, converted to dst's dtype) into `dst`; returns
        dst. ValueError for another shape, TypeError for a dtype without a numpy twin."""
        a = np.ascontiguousarray(values, dtype=_numpy_dtype(dst.dtype))
        if a.shape != tuple(dst.shape):
            raise ValueError(f"HostUpload: values of shape {a.shape} for a destination of shape {tuple(dst.shape)}")
        if a.size == 0:
            return dst
        src = torch.from_numpy(a)
        if dst.device.type != "cuda":
            return dst.copy_(src)
        if a.nbytes > self.slot_bytes or not self.pinned:
            return dst.copy_(src.pin_memory(), non_blocking=True)
        k = self._next
        self._next = (k + 1) % self.slots
        done = self._done[k]
        if not done.query():                   # the slot's previous copy has not run yet
            done.synchronize()
        self._host[k, :a.nbytes] = a.reshape(-1).view(np.uint8)
        dst.copy_(self._buf[k, :a.nbytes].view(dst.dtype).view(dst.shape), non_blocking=True)
        done.record(torch.cuda.current_stream(dst.device))
        return dst

    def tensor(self, values, dtype: torch.dtype) -> torch.Tensor:
        """A new tensor on `device` holding `values` (array-like), uploaded as `copy_` does."""
        a = np.asarray(values, dtype=_numpy_dtype(dtype))
        return self.copy_(torch.empty(a.shape, dtype=dtype, device=self.device), a)


def _numpy_dtype(dtype: torch.dtype):
    try:
        return _NUMPY[dtype]
    except KeyError:
        raise TypeError(f"HostUpload: no numpy dtype for {dtype}; upload one of "
                        f"{', '.join(str(d) for d in _NUMPY)}") from None
