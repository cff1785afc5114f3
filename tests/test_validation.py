"""Every public call of the state, layer and stack checks before it mutates: a rejected call leaves
every cache buffer and every piece of bookkeeping exactly as it was, and the next call computes
what it would have computed had the rejected call never been made."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from dsv41_decode.config import ModelConfig
from dsv41_decode.layer import CallContext
from dsv41_decode.open_groups import OpenGroups
from dsv41_decode.stack import AttentionStack
from dsv41_decode.rows import CapacityError, StepRows
from dsv41_decode.state import DecodeState, free_bytes
from dsv41_decode.upload import HostUpload
from dsv41_decode.weights import load_checkpoint, write_synthetic_checkpoint


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    cfg = ModelConfig.preset("tiny")
    return AttentionStack(load_checkpoint(write_synthetic_checkpoint(cfg, tmp_path_factory.mktemp("ck"), seed=3)))


def _copy(v):
    if isinstance(v, torch.Tensor):
        return v.clone()
    if isinstance(v, np.ndarray):
        return v.copy()
    if isinstance(v, dict):
        return {k: _copy(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return type(v)(_copy(x) for x in v)
    if isinstance(v, (StepRows, ModelConfig, HostUpload)) or hasattr(v, "layers"):
        return v                      # compared by identity (HostUpload: machinery, not state)
    if isinstance(v, OpenGroups):
        return {k: _copy(x) for k, x in vars(v).items()}    # its buffers and host sets, as the state's
    return copy.deepcopy(v)


def _same(a, b, where="state") -> None:
    if isinstance(b, OpenGroups):                     # snapshotted as the dict of its attributes
        _same(a, vars(b), where)
    elif isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a, b), f"{where} changed"   # the state holds no NaN (-inf compares equal)
    elif isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b), f"{where} changed"
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), f"{where}: keys changed"
        for k in a:
            _same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{where}: length changed"
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{where}[{i}]")
    elif isinstance(a, (StepRows, HostUpload)) or hasattr(a, "layers"):
        assert a is b, f"{where} changed"
    else:
        assert a == b, f"{where}: {a!r} -> {b!r}"


def snapshot(state: DecodeState) -> dict:
    """Every attribute of the state: buffers cloned, bookkeeping copied."""
    return {k: _copy(v) for k, v in vars(state).items()}


def unchanged(state: DecodeState, snap: dict) -> None:
    now = vars(state)
    assert now.keys() == snap.keys()
    for k in snap:
        _same(snap[k], now[k], k)


def streams(n: int, cfg: ModelConfig, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, cfg.hc_mult, cfg.dim, generator=g).to(torch.bfloat16)


def served(stack, reqs=(("a", 9), ("b", 5))) -> DecodeState:
    """A state with `reqs` admitted and prefilled (deterministic inputs)."""
    st = DecodeState(stack.cfg, max_requests=3, max_context=32, page_size=4)
    for r, _ in reqs:
        st.admit(r)
    stack.forward(streams(sum(n for _, n in reqs), stack.cfg, 0), st.plan(list(reqs)), st)
    return st


def test_stale_step_is_rejected_before_any_cache_is_written(stack):
    st, clean = served(stack), served(stack)
    step = st.plan([("a", 1), ("b", 2)])
    x = streams(3, stack.cfg, 1)
    stack.forward(x, step, st)
    clean_step = clean.plan([("a", 1), ("b", 2)])
    stack.forward(x, clean_step, clean)
    snap = snapshot(st)
    with pytest.raises(ValueError, match=r"forward: stale step: request 'a' holds 10 tokens but the step starts at 9"):
        stack.forward(x, step, st)
    unchanged(st, snap)
    with pytest.raises(ValueError, match="layer 0: stale step"):
        stack.layers[0].forward(x[:, 0], step, st, CallContext())
    unchanged(st, snap)
    with pytest.raises(ValueError, match="advance: stale step"):
        st.advance(step)
    unchanged(st, snap)
    # the next call computes exactly what a state that never saw the rejected calls computes
    y = stack.forward(streams(1, stack.cfg, 2), st.plan([("b", 1)]), st)[0]
    y_clean = stack.forward(streams(1, stack.cfg, 2), clean.plan([("b", 1)]), clean)[0]
    assert torch.equal(y, y_clean)


def rejected(stack, st, step, rows: int, exc, match: str, advance: bool = True) -> None:
    """stack.forward of `rows` rows under `step` (and, with advance, st.advance(step)) raise exc
    matching `match`, and leave every buffer and bookkeeping entry of st as it was."""
    snap = snapshot(st)
    with pytest.raises(exc, match=match):
        stack.forward(streams(rows, stack.cfg, 1), step, st)
    if advance:
        with pytest.raises(exc, match=match):
            st.advance(step)
    unchanged(st, snap)


def test_foreign_and_replaced_steps_are_rejected(stack):
    st, other = served(stack), served(stack)
    foreign = other.plan([("a", 1)])             # same ids and lengths, another state
    mine = st.plan([("a", 1)])
    rejected(stack, st, foreign, 1, ValueError, "not this state's current plan", advance=False)
    newer = st.plan([("a", 2)])                  # replaces `mine`
    rejected(stack, st, mine, 1, ValueError, "not this state's current plan")
    stack.forward(streams(2, stack.cfg, 1), newer, st)
    assert st.length("a") == 11


def test_freed_and_readmitted_requests_are_rejected(stack):
    st = served(stack)
    step = st.plan([("a", 1), ("b", 1)])
    st.free("b")
    rejected(stack, st, step, 2, KeyError, "'b' is not live")
    st.admit("b")                                # same id, a fresh request at length 0
    step = st.plan([("b", 2)])
    st.free("b")
    st.admit("b")
    rejected(stack, st, step, 2, ValueError, "'b' was freed or re-admitted", advance=False)


def test_bad_inputs_to_forward_change_nothing(stack):
    st = served(stack)
    step = st.plan([("a", 2)])
    snap = snapshot(st)
    for x, pre, msg in ((streams(3, stack.cfg, 1), None, r"forward: streams x must be \[2, 4, 128\]"),
                        (streams(2, stack.cfg, 1).float(), None, "bfloat16"),
                        (streams(2, stack.cfg, 1), torch.ones(4), r"pre_in must be \[2, 4\] float32")):
        with pytest.raises(ValueError, match=msg):
            stack.forward(x, step, st, pre_in=pre)
        unchanged(st, snap)
    small = DecodeState(ModelConfig.preset("small"), max_requests=1, max_context=8)
    small.admit("a")
    other = small.plan([("a", 2)])
    snap_small = snapshot(small)
    with pytest.raises(ValueError, match="another configuration"):
        stack.forward(streams(2, stack.cfg, 1), other, small)
    unchanged(small, snap_small)
    stack.forward(streams(2, stack.cfg, 1), step, st)      # the planned step still runs
    assert st.length("a") == 11


def test_rejected_plans_admits_and_frees_change_nothing(stack):
    st = served(stack)
    st.admit("c")
    snap = snapshot(st)
    calls = [
        (CapacityError, "requests: all 3", lambda: st.admit("d")),
        (ValueError, "already live", lambda: st.admit("a")),
        (KeyError, "'zz' is not live", lambda: st.free("zz")),
        (CapacityError, "context: request 'a' would hold 33", lambda: st.plan([("b", 1), ("a", 24)])),
        (KeyError, "'zz'", lambda: st.plan([("a", 1), ("zz", 1)])),
        (ValueError, "listed twice", lambda: st.plan([("a", 1), ("a", 1)])),
        (ValueError, "count 0", lambda: st.plan([("a", 1), ("b", 0)])),
        (ValueError, "no rows", lambda: st.plan([])),
        (ValueError, r"rows must be a list of \(req_id, count\) pairs, got a dict \(list\(rows.items\(\)\)",
         lambda: st.plan({"a": 1})),
        (ValueError, r"rows entries must be \(req_id, count\) pairs, got 'ab'", lambda: st.plan(["ab"])),
        (ValueError, r"rows entries must be \(req_id, count\) pairs, got \('a', 1, 9\)",
         lambda: st.plan([("a", 1, 9)])),
        (ValueError, "has count '1'", lambda: st.plan([("a", "1")])),
        (ValueError, "has count 1.0", lambda: st.plan([("a", 1.0)])),
        (ValueError, "has count tensor", lambda: st.plan([("a", torch.tensor(1))])),   # its value: a device read
        (ValueError, "rows must be a list of .* got a NoneType", lambda: st.plan(None)),
        (ValueError, "rows must be a list of .* got a set", lambda: st.plan({("a", 1)})),   # no call order
        (ValueError, "None is not a request id", lambda: st.admit(None)),
        (TypeError, "request ids must be hashable, got a list", lambda: st.admit(["c2"])),
        (TypeError, r"request ids must be hashable, got a list: \['a'\]", lambda: st.plan([(["a"], 1)])),
        (TypeError, "request ids must be hashable, got a dict", lambda: st.length({})),
    ]
    for exc, msg, call in calls:
        with pytest.raises(exc, match=msg):
            call()
        unchanged(st, snap)


def test_page_capacity_is_checked_before_any_page_is_taken(stack):
    cfg = stack.cfg
    st = DecodeState(cfg, max_requests=2, max_context=32, max_tokens=8, page_size=4)
    st.admit("a"), st.admit("b")
    stack.forward(streams(8, cfg, 0), st.plan([("a", 8)]), st)
    snap = snapshot(st)
    with pytest.raises(CapacityError, match="pages of ratio"):
        st.plan([("b", 4), ("a", 12)])           # b's pages would fit, a's do not: neither is taken
    unchanged(st, snap)


def test_stack_layer_ids_are_checked(stack, tmp_path):
    ckpt = load_checkpoint(write_synthetic_checkpoint(stack.cfg, tmp_path / "ck", seed=3))
    with pytest.raises(ValueError, match="layer_ids: layer 1 is listed twice"):
        AttentionStack(ckpt, layer_ids=[0, 1, 1, 2])
    assert AttentionStack(ckpt, layer_ids=iter([1, 0])).ids == [0, 1]        # any iterable
    for bad in ([99], [-1], [1.0]):
        with pytest.raises(ValueError, match=r"layer_ids: .* is not a layer id of this configuration \(0..6\)"):
            AttentionStack(ckpt, layer_ids=bad)


def test_a_state_of_another_configuration_is_refused_before_any_cache_is_written(stack):
    """Another window size (the layer plan alike): refused by forward and prefill before a chunk
    is written, as decode_step refuses it."""
    from dsv41_decode.prefill import prefill
    st = DecodeState(stack.cfg.replace(window_size=8), max_requests=1, max_context=32)
    st.admit("a")
    snap = snapshot(st)
    with pytest.raises(ValueError, match="built for another configuration than the stack"):
        prefill(stack, st, "a", streams(20, stack.cfg, 0), chunk=10, path="reference")
    unchanged(st, snap)
    step = st.plan([("a", 2)])
    snap = snapshot(st)
    with pytest.raises(ValueError, match="built for another configuration than the stack"):
        stack.forward(streams(2, stack.cfg, 0), step, st)
    unchanged(st, snap)


def test_layer_input_dtype_and_the_ffn_hooks_output_are_checked(stack):
    st = served(stack)
    step = st.plan([("a", 2)])
    snap = snapshot(st)
    x = streams(2, stack.cfg, 1)
    with pytest.raises(ValueError, match=r"layer 0: x must be \[2, 128\] bfloat16, got \(2, 128\) torch.float32"):
        stack.layers[0].forward(x[:, 0].float(), step, st, CallContext())
    unchanged(st, snap)
    for hook, got in ((lambda i, h: h[:1], r"\(1, 128\) torch.bfloat16"), (lambda i, h: h.float(), "float32"),
                      (lambda i, h: None, "NoneType")):
        with pytest.raises(ValueError, match=r"ffn\(layer=0, h\) must return a \[2, 128\] bfloat16 tensor like h, "
                                             r"got .*" + got):
            stack.forward(x, step, st, ffn=hook)
        assert st.length("a") == 9                             # not advanced: the call is abandoned
        with pytest.raises(ValueError, match="not this state's current plan"):
            stack.forward(x, step, st)
        st = served(stack)
        step = st.plan([("a", 2)])
    stack.forward(x, st.plan([("a", 2)]), st, ffn=lambda i, h: h)   # a well-formed hook runs


def test_prefill_past_the_capacity_writes_nothing(stack):
    """A prompt that would pass max_context (or the pages) raises before its first chunk."""
    from dsv41_decode.prefill import prefill
    st = DecodeState(stack.cfg, max_requests=2, max_context=40, page_size=4)
    st.admit("a")
    snap = snapshot(st)
    with pytest.raises(CapacityError, match="context: request 'a' would hold 41 tokens"):
        prefill(stack, st, "a", streams(41, stack.cfg, 0), chunk=16, path="reference")
    unchanged(st, snap)
    small = DecodeState(stack.cfg, max_requests=2, max_context=40, max_tokens=8, page_size=4)
    small.admit("a")
    with pytest.raises(CapacityError, match="pages of ratio 1"):
        prefill(stack, small, "a", streams(20, stack.cfg, 0), chunk=8, path="reference")
    assert small.length("a") == 0 and small.free_pages(1) == small.n_pages[1]


def test_wrong_argument_types_to_forward_are_named_and_change_nothing(stack):
    st = served(stack)
    step = st.plan([("a", 2)])
    snap = snapshot(st)
    x = streams(2, stack.cfg, 1)
    for call, exc, msg in (
            (lambda: stack.forward(x, st, step), TypeError, r"state must be a DecodeState, got a StepRows"),
            (lambda: stack.forward(x.tolist(), step, st), TypeError, "x must be a torch.Tensor, got a list"),
            (lambda: stack.forward(x, step, st, pre_in=np.ones((2, 4), np.float32)), TypeError,
             "pre_in must be a torch.Tensor, got a ndarray"),
            (lambda: stack.forward(x.to("meta"), step, st), ValueError, "x is on meta, the state on cpu"),
            (lambda: stack.forward(x, step, st, pre_in=torch.ones(2, 4, device="meta")), ValueError,
             "pre_in is on meta")):
        with pytest.raises(exc, match=msg):
            call()
        unchanged(st, snap)
    stack.forward(x, step, st)                              # the planned step still runs
    assert st.length("a") == 11


def test_counts_may_be_numpy_integers(stack):
    """A sampler's counts (numpy integers) plan and accept as Python ints do, with the same result."""
    cfg = stack.cfg
    runs = []
    for as_int in (int, np.int64):
        st = DecodeState(cfg, max_requests=2, max_context=32, page_size=4, max_drafts=2)
        st.admit("a")
        out, _ = stack.forward(streams(3, cfg, 4), st.plan([("a", as_int(3))]), st)
        st.accept({"a": as_int(2)})
        runs.append((out, st.length("a"), st.seq_lens.clone()))
    assert runs[0][1] == runs[1][1] == 2 and type(runs[1][1]) is int
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][2], runs[1][2])


def test_bad_accepts_are_named_and_change_nothing(stack):
    cfg = stack.cfg
    st = DecodeState(cfg, max_requests=2, max_context=32, page_size=4, max_drafts=2)
    st.admit("a")
    stack.forward(streams(3, cfg, 4), st.plan([("a", 3)]), st)
    snap = snapshot(st)
    for kept, exc, msg in (([("a", 2)], TypeError, r"kept must be a mapping \{req_id: rows kept\}, got a list"),
                           ({"a": 2.0}, ValueError, r"keeps 2.0 rows; need an integer .* in 1..3"),
                           ({"a": torch.tensor(2)}, ValueError, r"keeps tensor\(2\) rows; need an integer")):
        with pytest.raises(exc, match=msg):
            st.accept(kept)
        unchanged(st, snap)
    st.accept({"a": 2})
    assert st.length("a") == 2


def test_an_empty_layer_list_is_refused(stack, tmp_path):
    ckpt = load_checkpoint(write_synthetic_checkpoint(stack.cfg, tmp_path, seed=3))
    with pytest.raises(ValueError, match="layer_ids: empty"):
        AttentionStack(ckpt, layer_ids=[])


def test_a_state_needs_a_model_config_and_a_device_that_is_there():
    with pytest.raises(TypeError, match="cfg must be a ModelConfig .* got a str"):
        DecodeState("tiny", max_requests=1, max_context=8)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="device cuda: CUDA is not available"):
            DecodeState(ModelConfig.preset("tiny"), max_requests=1, max_context=8, device="cuda")
    with pytest.raises(ValueError, match="device must name a torch device .* got 'tpu'"):
        DecodeState(ModelConfig.preset("tiny"), max_requests=1, max_context=8, device="tpu")
    with pytest.raises(TypeError, match="device must be a str or torch.device, got a bool"):
        DecodeState(ModelConfig.preset("tiny"), max_requests=1, max_context=8, device=True)


@pytest.mark.skipif(free_bytes(torch.device("cpu")) is None, reason="the host's free memory is not known here")
def test_a_state_larger_than_the_free_memory_is_refused_before_it_is_allocated():
    cfg = ModelConfig.preset("tiny")
    with pytest.raises(CapacityError, match=r"DecodeState: its caches take [\d.]+ GiB \(max_requests=1000000, "
                                            r"max_context=1000000, .*\), more than the [\d.]+ GiB free on cpu"):
        DecodeState(cfg, max_requests=10**6, max_context=10**6)
    with pytest.raises(CapacityError, match="page_size=1000000000"):
        DecodeState(cfg, max_requests=1, max_context=64, page_size=10**9)


def test_checkpoint_arguments_are_checked_before_anything_is_read_or_made(stack, tmp_path):
    path = write_synthetic_checkpoint(stack.cfg, tmp_path / "ckpt", seed=3, layers=[0])
    calls = [
        (ValueError, "device must name a torch device .* got 'tpu'", lambda: load_checkpoint(path, device="tpu")),
        (TypeError, "config must be a ModelConfig .* got a str: 'tiny'", lambda: load_checkpoint(path, config="tiny")),
        (ValueError, r"layers: expected layer ids \(integers\), got 3", lambda: load_checkpoint(path, layers=3)),
        (TypeError, "cfg must be a ModelConfig .* got a str",
         lambda: write_synthetic_checkpoint("tiny", tmp_path / "a")),
        (ValueError, "shards: must be an int >= 1, got '2'",
         lambda: write_synthetic_checkpoint(stack.cfg, tmp_path / "b", shards="2")),
        (ValueError, r"layers: \[99\] out of range", lambda: write_synthetic_checkpoint(stack.cfg, tmp_path / "c",
                                                                                        layers=[99])),
    ]
    if not torch.cuda.is_available():
        calls.append((ValueError, "device cuda: CUDA is not available", lambda: load_checkpoint(path, device="cuda")))
    for exc, msg, call in calls:
        with pytest.raises(exc, match=msg):
            call()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]      # no folder left by a refusal


def test_plan_takes_an_ordered_iterable_of_pairs(stack):
    outs = []
    for rows in ([("a", 2), ("b", 1)], (r for r in (("a", 2), ("b", 1))), {"a": 2, "b": 1}.items()):
        st = served(stack)
        out, _ = stack.forward(streams(3, stack.cfg, 2), st.plan(rows), st)
        outs.append(out)
        assert (st.length("a"), st.length("b")) == (11, 6)
    assert all(torch.equal(outs[0], o) for o in outs[1:])


def test_abandon_of_a_plan_no_layer_ran(stack):
    """ran=False: the plan's pages go back and a request holding tokens loses nothing (with ran=True
    a call this long after cached tokens would have overwritten ring slots the request reads); once
    the generic path's layers have written, ran=False is refused and nothing changes."""
    st = served(stack)
    held = {r: (st.pages_of("a", r), st.free_pages(r)) for r in st.ratios}
    st.abandon(st.plan([("a", 20)]), ran=False)
    assert {r: (st.pages_of("a", r), st.free_pages(r)) for r in st.ratios} == held and st.length("a") == 9
    st.plan([("a", 1)])                                     # not refused as a lost request
    st = served(stack)
    step = st.plan([("a", 20)])
    st.abandon(step, ran=True)
    with pytest.raises(ValueError, match="'a' lost cached rows"):
        st.plan([("a", 1)])
    st = served(stack)
    step = st.plan([("a", 2)])
    stack.block(stack.ids[0], streams(2, stack.cfg, 1), stack.initial_pre(2), step, st, CallContext())
    snap = snapshot(st)
    with pytest.raises(ValueError, match="ran=False, but the call's layers have written the caches"):
        st.abandon(step, ran=False)
    unchanged(st, snap)
