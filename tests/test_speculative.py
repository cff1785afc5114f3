"""Speculative decoding on the generic path: a run with draft rows and `DecodeState.accept` equals,
bit for bit, the run that only ever saw the accepted tokens (spec decision 12).

The tiny preset cut to a window of 6 (ring of 6 + 3 slots): the runs wrap the window several times
and cross many ratio-2 group boundaries; every request goes through every acceptance pattern of
1-3 drafts, then random ones. Rejected rows get junk inputs the accepted-only run never sees, so a
trace of them in any later output or in the state fails the comparison.
"""

from __future__ import annotations

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


def _serve(stack, st, truth, plan, drafted: bool, accept=True):
    """Serve `plan`; returns (kept rows' outputs, held state after every call)."""
    held = []

    def after(_):
        # besides what a later call reads, the pages held: nothing beyond the kept entries
        held.append({r: {**sp.held_state(st, r), **{f"pages.{ratio}": len(st.pages_of(r, ratio))
                                                    for ratio in st.ratios}} for r in PREFILL})
    out = sp.serve(_run(stack, st), truth, plan, junk_seed=2 if drafted else None,
                   accept=st.accept if accept else None, after=after)
    return out, held


def test_plan_covers_patterns_wraps_and_groups(setup):
    cfg, _, plan, _ = setup
    for r in PREFILL:
        assert {call[r] for call in plan} >= set(sp.acceptance_patterns(3)), r
    # from the prefill to the end: at least two wraps of the 9-slot ring and 10 ratio-2 groups
    end = {r: PREFILL[r] + n for r, n in sp.needed_tokens(plan).items()}
    assert min(end[r] - PREFILL[r] for r in PREFILL) >= 2 * (cfg.window_size + 3)
    assert min(end[r] // 2 - PREFILL[r] // 2 for r in PREFILL) >= 10


def test_drafted_run_equals_accepted_only_run(setup):
    cfg, stack, plan, truth = setup
    st_d, st_o = _state(cfg, stack, max_drafts=3), _state(cfg, stack, max_drafts=0)
    out_d, held_d = _serve(stack, st_d, truth, plan, drafted=True)
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
