"""The public call `step(x, rows)` (and `accept`) does not synchronize with the device.

- CPU: the call's host path - plan, the rows' record, the uploads, the state's advance, accept -
  turns no tensor into host values (`.item()`, `.tolist()`, `.cpu()`, `.numpy()`, `bool()`,
  `int()`, ...: each a device synchronization on a GPU); the replay is stubbed, what it would run
  is captured in the graph on a GPU. The record it loads is the plan's.
- GPU (marked `gpu`): `torch.cuda.set_sync_debug_mode("error")` around graph-replayed calls and
  accepts after a warm-up: any stream or device synchronization, blocking copy or synchronizing op
  raises. The state's tables it uploaded are the host's.
"""

from __future__ import annotations

import contextlib
import os

import numpy as np
import pytest
import torch

from dsv41_decode.config import ModelConfig
from dsv41_decode.decode.tables import host_record
from dsv41_decode.stack import AttentionStack
from dsv41_decode.state import DecodeState
from dsv41_decode.testing.synthetic import fill_state, random_checkpoint
from helpers import reduced_config, streams

# tensor -> host value: each of these waits for the device when the tensor lives on a GPU; the
# torch functions (also Tensor methods) give a result whose size or value depends on the data
_TORCH_READS = ("nonzero", "unique", "masked_select", "equal")
_READS = ("item", "tolist", "cpu", "numpy", "__array__", "__bool__", "__int__", "__float__", "__index__",
          *_TORCH_READS)


@contextlib.contextmanager
def no_host_reads(monkeypatch):
    """Every tensor -> host-value conversion raises inside the block (and synchronizing calls), as
    do indexing with a boolean mask (its result's size is the data's)."""
    def refuse(name):
        def read(*args, **kwargs):
            raise AssertionError(f"the step's call path called {name}")
        return read

    def no_masks(method):
        def index(self, key, *rest):
            keys = key if isinstance(key, tuple) else (key,)
            if any(isinstance(k, torch.Tensor) and k.dtype == torch.bool for k in keys):
                raise AssertionError(f"the step's call path indexed with a boolean mask (Tensor.{method.__name__})")
            return method(self, key, *rest)
        return index
    with monkeypatch.context() as m:
        for name in _READS:
            m.setattr(torch.Tensor, name, refuse(f"Tensor.{name}"))
        for name in _TORCH_READS:
            m.setattr(torch, name, refuse(f"torch.{name}"))
        for name in ("__getitem__", "__setitem__"):
            m.setattr(torch.Tensor, name, no_masks(getattr(torch.Tensor, name)))
        m.setattr(torch.cuda, "synchronize", refuse("torch.cuda.synchronize"))
        yield


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="a step on CPU tensors needs TRITON_INTERPRET=1")
def test_call_reads_nothing_back(monkeypatch):
    cfg = reduced_config()
    stack = AttentionStack(random_checkpoint(cfg, "cpu", progress=False), [1, 3])
    state = DecodeState(cfg, max_requests=4, max_context=64, page_size=4, stage_rows=4, max_drafts=3)
    for req in ("a", "b", "c"):
        state.admit(req)
    step = stack.decode_step(state, max_rows=4)
    monkeypatch.setattr(step, "replay", lambda bucket: None)
    g = torch.Generator().manual_seed(0)
    calls = [([("a", 1), ("b", 3)], {"b": 2}), ([("c", 4)], {"c": 1}), ([("b", 1), ("a", 2, 1), ("c", 1)], {})]
    for rows, kept in calls:
        x = streams(sum(r[1] for r in rows), cfg, g)
        with no_host_reads(monkeypatch):
            with pytest.raises(AssertionError, match="Tensor.item"):
                torch.zeros(1).item()                     # the guard is on
            with pytest.raises(AssertionError, match="boolean mask"):
                torch.zeros(2)[torch.ones(2, dtype=torch.bool)]
            out, pre = step(x, rows)
            if kept:
                step.accept(kept)
        assert out.shape == x.shape and pre.shape == (x.shape[0], cfg.hc_mult)
    # what the calls loaded and advanced: the host's values
    assert (state.length("a"), state.length("b"), state.length("c")) == (3, 3, 2)
    assert state.seq_lens.tolist() == [3, 3, 2, 0]
    # the last call: b at 2, a at 1 and 2, c at 1 (FIELDS x rows)
    want = [[1, 0, 0, 2], [2, 1, 2, 1], [2, 1, 1, 1], [0, 1, 1, 3], [2, 2, 2, 1]]
    assert step.meta.record.tolist() == want


def test_host_record_fields():
    """The record from the plan's host fields: slot, position, start, first row, last position;
    rows past the step's are padding."""
    cfg = reduced_config()
    st = DecodeState(cfg, max_requests=3, max_context=64, page_size=4, stage_rows=8)
    for req, n in (("a", 5), ("b", 0), ("c", 9)):
        st.admit(req)
        if n:
            st.advance(st.plan([(req, n)]))
    plan = st.plan([("c", 2), ("a", 1), ("b", 3)])
    rec = host_record(plan, 8)
    assert rec.dtype == np.int64 and rec.shape == (5, 8)
    assert rec.tolist() == [[2, 2, 0, 1, 1, 1, -1, -1],
                            [9, 10, 5, 0, 1, 2, -1, -1],
                            [9, 9, 5, 0, 0, 0, 0, 0],
                            [0, 0, 2, 3, 3, 3, 6, 7],
                            [10, 10, 5, 2, 2, 2, -1, -1]]
    assert rec[0, :6].tolist() == plan.req_slot.tolist() and rec[1, :6].tolist() == plan.positions.tolist()
    with pytest.raises(ValueError, match="more than its bucket 4"):
        host_record(plan, 4)


@pytest.mark.gpu
def test_gpu_call_does_not_synchronize():
    """Graph-replayed calls of 1-8 rows with drafts and accepts under sync debug mode "error". The
    device is idle when each call starts, so that the one wait the design allows - for an upload
    slot whose previous copy has not run (`HostUpload`) - does not arise."""
    cfg = ModelConfig.preset("small")
    dev = "cuda"
    stack = AttentionStack(random_checkpoint(cfg, dev, progress=False))
    state = DecodeState(cfg, max_requests=4, max_context=512, page_size=16, device=dev, stage_rows=8,
                        max_drafts=3)
    fill_state(state, {"a": 300, "b": 9, "c": 1})
    step = stack.decode_step(state, max_rows=8)
    g = torch.Generator().manual_seed(0)
    calls = [([("a", 1)], {}), ([("a", 1), ("b", 4)], {"b": 2}), ([("c", 4), ("b", 1), ("a", 3)], {"a": 1}),
             ([("a", 2), ("b", 2), ("c", 2)], {"c": 1, "b": 2})] * 3
    for k, (rows, kept) in enumerate(calls):
        x = streams(sum(c for _, c in rows), cfg, g, dev)
        torch.cuda.synchronize()
        warm = k < 4                                       # first use of each bucket's buffers
        if not warm:
            torch.cuda.set_sync_debug_mode("error")
        try:
            step(x, rows)
            if kept:
                step.accept(kept)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        state.sync()                                       # the mirror a deferred accept left to the next advance
        torch.cuda.synchronize()
        assert state.seq_lens.tolist() == [state.length(r) for r in "abc"] + [0], k
        n = sum(c for _, c in rows)
        assert step.meta.record[0, :n].tolist() == [state.slot(r) for r, c in rows for _ in range(c)], k
    for r in state.ratios:   # the block tables the calls extended: the host's pages
        for req in ("a", "b", "c"):
            pages = state.pages_of(req, r)
            assert state.block_table[r][state.slot(req), :len(pages)].tolist() == list(pages)
