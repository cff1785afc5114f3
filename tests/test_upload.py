"""HostUpload: host tables into device tensors without waiting for the device.

CPU: values, shapes and dtypes, the errors, deep copies. GPU (marked `gpu`): pinned slots reused
while the stream is still busy - each copy must read the values written for it, so a slot may not
be overwritten before its copy has run - and uploads larger than a slot.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from dsv41_decode.upload import HostUpload


def test_copy_and_tensor_cpu():
    up = HostUpload("cpu", slot_bytes=64, slots=2)
    dst = torch.full((2, 3), -1, dtype=torch.int32)
    assert up.copy_(dst, [[1, 2, 3], [4, 5, 6]]) is dst
    assert dst.tolist() == [[1, 2, 3], [4, 5, 6]]
    t = up.tensor([[7, 8], [9, 10]], torch.int64)
    assert t.dtype == torch.int64 and t.tolist() == [[7, 8], [9, 10]]
    big = np.arange(1000, dtype=np.int64)                # larger than a slot: still copied
    assert torch.equal(up.tensor(big, torch.int64), torch.from_numpy(big))
    assert up.tensor([], torch.int64).shape == (0,)
    with pytest.raises(ValueError, match=r"values of shape \(3,\) for a destination of shape \(2, 3\)"):
        up.copy_(dst, [1, 2, 3])
    with pytest.raises(TypeError, match="no numpy dtype for torch.bfloat16"):
        up.tensor([1.0], torch.bfloat16)
    twin = copy.deepcopy(up)
    assert twin is not up and (twin.device, twin.slot_bytes, twin.slots) == (up.device, 64, 2)


@pytest.mark.gpu
def test_gpu_slots_reused_while_the_stream_is_busy():
    up = HostUpload("cuda", slot_bytes=256, slots=3)
    assert up.pinned and up._buf.is_pinned()
    n = 4 * up.slots                                   # every slot taken four times
    outs = [torch.empty(8, dtype=torch.int64, device="cuda") for _ in range(n)]
    torch.cuda._sleep(200_000_000)                     # keep the stream busy: the copies queue behind it
    for k, out in enumerate(outs):
        up.copy_(out, np.arange(8) + 100 * k)
    big = up.tensor(np.arange(1000), torch.int64)      # past a slot: a pinned buffer of its own
    torch.cuda.synchronize()
    for k, out in enumerate(outs):
        assert out.tolist() == list(range(100 * k, 100 * k + 8)), k
    assert big.tolist() == list(range(1000))
