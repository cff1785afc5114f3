"""Speculative decoding on the generic path: a run with draft rows and `DecodeState.accept` equals,
bit for bit, the run that only ever saw the accepted tokens (spec decision 12).

The tiny preset cut to a window of 6 (ring of 6 + 3 slots): the runs wrap the window several times
and cross many ratio-2 group boundaries; every request goes through every acceptance pattern of
1-3 drafts, then random ones. Rejected rows get junk inputs the accepted-only run never sees, so a
trace of them in any later output or in the state fails the comparison.
"""

from __future__ import annotations

import copy

import pytest
import torch

from dsv41_decode.config import ModelConfig
from dsv41_decode.stack import AttentionStack
from dsv41_decode.state import DecodeState
from dsv41_decode.testing import speculative as sp
from dsv41_decode.weights import load_checkpoint, write_synthetic_checkpoint

PREFILL = {"a": 5, "b": 2, "c": 0}     # odd: a ratio-2 group left open; "c" starts from nothing
STEPS = 12


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    cfg = ModelConfig.preset("tiny").replace(window_size=6)
    d = tmp_path_factory.mktemp("spec_ckpt")
    write_synthetic_checkpoint(cfg, d, seed=3)
    stack = AttentionStack(load_checkpoint(d))
    plan = sp.acceptance_plan(list(PREFILL), STEPS, max_drafts=3, seed=0)
    truth = sp.true_inputs(cfg, sp.needed_tokens(plan), seed=1)
    return cfg, stack, plan, truth


def _state(cfg, stack, max_drafts: int) -> DecodeState:
    st = DecodeState(cfg, max_requests=4, max_context=64, page_size=4, max_drafts=max_drafts)
    for r in PREFILL:
        st.admit(r)
    g = torch.Generator().manual_seed(9)
    rows = [(r, n) for r, n in PREFILL.items() if n]
    x = torch.randn(sum(n for _, n in rows), cfg.hc_mult, cfg.dim, generator=g).to(torch.bfloat16)
    stack.forward(x, st.plan(rows), st)
    return st


def _run(stack, st: DecodeState):
    return lambda x, rows: stack.forward(x, st.plan(rows), st)


def _serve(stack, st, truth, plan, drafted: bool, accept=True, defer=False):
    """Serve `plan`; returns (kept rows' outputs, held state after every call). defer: accept leaves
    the open groups to the next call (`forward` restores them before its layers)."""
    held = []

    def after(_):
        # besides what a later call reads, the pages held: nothing beyond the kept entries
        held.append({r: {**sp.held_state(st, r), **{f"pages.{ratio}": len(st.pages_of(r, ratio))
                                                    for ratio in st.ratios}} for r in PREFILL})
    out = sp.serve(_run(stack, st), truth, plan, junk_seed=2 if drafted else None,
                   accept=(lambda kept: st.accept(kept, defer=defer)) if accept else None, after=after)
    return out, held


def test_plan_covers_patterns_wraps_and_groups(setup):
    cfg, _, plan, _ = setup
    for r in PREFILL:
        assert {call[r] for call in plan} >= set(sp.acceptance_patterns(3)), r
    # from the prefill to the end: at least two wraps of the 9-slot ring and 10 ratio-2 groups
    end = {r: PREFILL[r] + n for r, n in sp.needed_tokens(plan).items()}
    assert min(end[r] - PREFILL[r] for r in PREFILL) >= 2 * (cfg.window_size + 3)
    assert min(end[r] // 2 - PREFILL[r] // 2 for r in PREFILL) >= 10


@pytest.mark.parametrize("defer", [False, True], ids=["accept_restores", "forward_restores"])
def test_drafted_run_equals_accepted_only_run(setup, defer):
    cfg, stack, plan, truth = setup
    st_d, st_o = _state(cfg, stack, max_drafts=3), _state(cfg, stack, max_drafts=0)
    out_d, held_d = _serve(stack, st_d, truth, plan, drafted=True, defer=defer)
    out_o, held_o = _serve(stack, st_o, truth, plan, drafted=False)
    assert sp.first_difference(out_d, out_o) is None, sp.first_difference(out_d, out_o)
    for k, (a, b) in enumerate(zip(held_d, held_o)):
        for r in PREFILL:
            for key, v in a[r].items():
                same = v == b[r][key] if isinstance(v, int) else torch.equal(v, b[r][key])
                assert same, f"after call {k}: request {r!r}: {key} differs"
    assert sp.state_difference(st_d, st_o, list(PREFILL)) is None


def test_without_accept_the_drafts_leave_a_trace(setup):
    """The comparison can fail: the same drafted run, every row committed, differs at once."""
    cfg, stack, plan, truth = setup
    st_d, st_o = _state(cfg, stack, 3), _state(cfg, stack, 0)
    short = plan[:3]
    out_d, _ = _serve(stack, st_d, truth, short, drafted=True, accept=False)
    out_o, _ = _serve(stack, st_o, truth, short, drafted=False)
    assert sp.first_difference(out_d, out_o) is not None


def test_readme_speculative_example_runs(tmp_path, monkeypatch):
    import re
    from pathlib import Path
    text = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    m = re.search(r"## Speculative decoding\n.*?```python\n(.*?)```", text, re.S)
    assert m, "README.md has no python block under ## Speculative decoding"
    monkeypatch.chdir(tmp_path)
    scope: dict = {"__name__": "readme_speculative"}
    exec(compile(m.group(1), "README.md (Speculative decoding)", "exec"), scope)
    assert scope["state"].length("a") == 2 and scope["state"].max_drafts == 3


class _Stop(Exception):
    pass


def _stopping_hook(layer: int):
    """An FFN hook that passes h through, but raises once at `layer` (then passes again)."""
    armed = [True]

    def ffn(i, h):
        if i == layer and armed[0]:
            armed[0] = False
            raise _Stop(f"stopped at layer {i}")
        return h
    return ffn


def _rows_input(cfg, rows, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(sum(n for _, n in rows), cfg.hc_mult, cfg.dim, generator=g).to(torch.bfloat16)


@pytest.mark.parametrize("where", ["first", "middle", "observe_last"])
def test_a_call_that_stops_midway_is_retried_exactly(setup, where):
    """A forward that raises after some layers wrote their caches (an FFN hook at the first or a
    middle layer, an `observe` after the last) abandons its call: the same rows planned again give
    the bits of a run that never stopped, and so does the call after them. Rows per request up to
    max_drafts + 1 = 4 (a's start 5 is odd: its ratio-2 group is open, and 4 rows overwrite it)."""
    cfg, stack, _, _ = setup
    ids = list(stack.ids)
    st = _state(cfg, stack, max_drafts=3)
    ref = copy.deepcopy(st)
    rows = [("a", 4), ("b", 3), ("c", 1)]
    x = _rows_input(cfg, rows, seed=11)
    ffn = (lambda i, h: h)
    if where == "observe_last":
        def observe(i, rec):
            if i == ids[-1]:
                raise _Stop("observer")
        with pytest.raises(_Stop):
            stack.forward(x, st.plan(rows), st, ffn=ffn, observe=observe)
    else:
        with pytest.raises(_Stop):
            stack.forward(x, st.plan(rows), st, ffn=_stopping_hook(ids[0] if where == "first" else ids[len(ids) // 2]))
    assert {r: st.length(r) for r in PREFILL} == PREFILL            # nothing advanced
    outs = [stack.forward(x, s.plan(rows), s, ffn=ffn) for s in (st, ref)]
    assert all(torch.equal(a, b) for a, b in zip(*outs))
    rows2 = [("a", 1), ("b", 2), ("c", 3)]
    x2 = _rows_input(cfg, rows2, seed=12)
    outs = [stack.forward(x2, s.plan(rows2), s, ffn=ffn) for s in (st, ref)]
    assert all(torch.equal(a, b) for a, b in zip(*outs))
    assert sp.state_difference(st, ref, list(PREFILL)) is None


def test_an_abandoned_call_longer_than_the_ring_spare_loses_the_request(setup):
    """A call can overwrite what its retry would read (here a's 5 rows at start 5: the ring slot of
    position 0 and the open group's row in `comp_rows`): the request is refused by name until it
    is freed; the call's other requests go on; pages go back."""
    cfg, stack, _, _ = setup
    st = _state(cfg, stack, max_drafts=3)
    free = {r: st.free_pages(r) for r in st.ratios}
    rows = [("a", 5), ("b", 1)]
    with pytest.raises(_Stop):
        stack.forward(_rows_input(cfg, rows, 13), st.plan(rows), st, ffn=_stopping_hook(list(stack.ids)[-1]))
    assert {r: st.free_pages(r) for r in st.ratios} == free               # the call's pages are back
    with pytest.raises(ValueError, match=r"plan: request 'a' lost cached rows in an abandoned call of 5 rows "
                                         r"\(they overwrote window records or the open compressor group that its "
                                         r"next rows read; max_drafts=3\): free it and prefill it again"):
        st.plan([("b", 1), ("a", 1)])
    stack.forward(_rows_input(cfg, [("b", 1)], 14), st.plan([("b", 1)]), st)
    assert st.length("b") == PREFILL["b"] + 1
    st.free("a")
    st.admit("a")
    stack.forward(_rows_input(cfg, [("a", 2)], 15), st.plan([("a", 2)]), st)
    assert st.length("a") == 2
    stale = st.plan([("a", 1)])
    st.plan([("b", 1)])
    with pytest.raises(ValueError, match="not this state's current plan"):
        st.abandon(stale)


@pytest.mark.parametrize("max_drafts, start, count, lost", [
    (0, 0, 8, False),    # a fresh request: nothing cached to lose, whatever the call's length
    (0, 2, 3, False),    # even start: no open group; the ring (W = 6 slots) keeps positions 0, 1
    (0, 5, 1, False),    # one row leaves the open group's first row in its slot
    (0, 5, 2, True),     # the second row overwrites it, and no comp_rows keep it
    (3, 2, 5, False),    # more than max_drafts + 1 rows, all within the ring's spare and history
    (3, 5, 4, False),    # max_drafts + 1 rows: comp_rows still hold position 4
    (3, 9, 5, True),     # position 13 takes the ring slot of position 4, which the retry reads
])
def test_what_an_abandoned_call_loses(setup, max_drafts, start, count, lost):
    """`abandon` tells exactly when a request survives its abandoned call: where it does, the retry
    and the next call equal a run that never stopped; where it does not, `plan` refuses it."""
    cfg, stack, _, _ = setup
    st = DecodeState(cfg, max_requests=1, max_context=64, page_size=4, max_drafts=max_drafts)
    st.admit("a")
    if start:
        stack.forward(_rows_input(cfg, [("a", start)], 20), st.plan([("a", start)]), st)
    ref = copy.deepcopy(st)
    rows = [("a", count)]
    x = _rows_input(cfg, rows, 21)
    with pytest.raises(_Stop):
        stack.forward(x, st.plan(rows), st, ffn=_stopping_hook(list(stack.ids)[-1]))
    if lost:
        with pytest.raises(ValueError, match="lost cached rows"):
            st.plan(rows)
        return
    ffn = (lambda i, h: h)
    for call in (rows, [("a", 1)]):
        x = _rows_input(cfg, call, 22)
        outs = [stack.forward(x, s.plan(call), s, ffn=ffn) for s in (st, ref)]
        assert all(torch.equal(a, b) for a, b in zip(*outs))
    assert sp.state_difference(st, ref, ["a"]) is None


def test_a_forward_whose_hooks_change_the_state_keeps_its_own_error(setup):
    """An FFN hook that plans another call is refused (the call's caches are written): its error
    propagates and the call is abandoned, exactly; one that frees a request of the call leaves
    the others abandoned exactly; one that advances the call itself leaves nothing to abandon,
    and the hook's own exception propagates with the reason as a note."""
    cfg, stack, _, _ = setup
    st = _state(cfg, stack, max_drafts=3)
    ref = copy.deepcopy(st)
    rows = [("a", 2), ("b", 1)]
    x = _rows_input(cfg, rows, 30)
    mid = list(stack.ids)[len(stack.ids) // 2]

    def replan(i, h):
        if i == mid:
            st.plan([("c", 1)])
        return h
    with pytest.raises(ValueError, match="plan: the current plan's layers have written the caches"):
        stack.forward(x, st.plan(rows), st, ffn=replan)
    ffn = (lambda i, h: h)
    outs = [stack.forward(x, s.plan(rows), s, ffn=ffn) for s in (st, ref)]
    assert all(torch.equal(a, b) for a, b in zip(*outs))
    assert sp.state_difference(st, ref, list(PREFILL)) is None

    def free_b(i, h):
        if i == mid:
            st.free("b")
            raise _Stop("freed b")
        return h
    with pytest.raises(_Stop, match="freed b"):
        stack.forward(x, st.plan(rows), st, ffn=free_b)
    ref.free("b")
    outs = [stack.forward(x[:2], s.plan([("a", 2)]), s, ffn=ffn) for s in (st, ref)]
    assert all(torch.equal(a, b) for a, b in zip(*outs))
    assert sp.state_difference(st, ref, ["a", "c"]) is None

    step = st.plan([("a", 1)])

    def advance(i, h):
        if i == mid:
            st.advance(step)
            raise _Stop("advanced")
        return h
    with pytest.raises(_Stop, match="advanced") as info:
        stack.forward(x[:1], step, st, ffn=advance)
    notes = getattr(info.value, "__notes__", None)
    if notes is not None:
        assert any("could not be abandoned: abandon: the step is not this state's current plan" in n for n in notes)
