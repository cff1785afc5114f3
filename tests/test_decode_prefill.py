"""Decode equals prefill, layer by layer with the same layer inputs, for every layer kind.

A one-shot prefill of three requests' whole sequences records every layer's input and output per
(request, position). A second state then serves the same requests as an engine would: token by
token from position 0, odd-length prompt chunks, draft rows (1 + d rows at p, p+1, ... in one
call), several requests per call. Each layer of each call is fed the prefill's recorded inputs for
its rows (teacher forcing), so any difference is the layer's own. The reference is batch-invariant,
so outputs, top-k and cache records must agree bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from dsv41_decode.config import ModelConfig
from dsv41_decode.layer import CallContext
from dsv41_decode.stack import AttentionStack
from dsv41_decode.state import DecodeState
from dsv41_decode.weights import load_checkpoint, write_synthetic_checkpoint

# Per request: a list of chunk sizes served in order. Tiny preset: W = 16, ratio-2 and ratio-1
# sources, top-k 8, candidate pool of 3 blocks of 4, so windows wrap and pruning bites.
SCHEDULE = {
    "a": [1] * 20 + [4] * 10,            # p = 0, 1, W-2..W+1, group boundaries; then 1 + 3 drafts
    "b": [37] + [3] * 21,                # odd prompt (ratio-2 group left open), then 1 + 2 drafts
    "c": [64] + [1] * 13 + [2] * 6,      # long prompt, single tokens, then 1 + 1 draft
}


def _calls():
    """Steps of the served run: step k holds chunk k of every request that still has one."""
    starts = {r: 0 for r in SCHEDULE}
    for k in range(max(len(v) for v in SCHEDULE.values())):
        call = []
        for r, chunks in SCHEDULE.items():
            if k < len(chunks):
                call.append((r, starts[r], chunks[k]))
                starts[r] += chunks[k]
        yield call


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    cfg = ModelConfig.preset("tiny")
    d = tmp_path_factory.mktemp("ckpt")
    write_synthetic_checkpoint(cfg, d, seed=7)
    stack = AttentionStack(load_checkpoint(d))
    total = {r: sum(v) for r, v in SCHEDULE.items()}
    assert sum(total.values()) >= 240
    g = torch.Generator().manual_seed(11)
    embed = {r: torch.randn(n, cfg.dim, generator=g).to(torch.bfloat16) for r, n in total.items()}

    def new_state():
        st = DecodeState(cfg, max_requests=len(total), max_context=max(total.values()), page_size=8)
        for r in total:
            st.admit(r)
        return st

    # the prefill run: every request's whole sequence in one call
    ref_state, ctx = new_state(), CallContext()
    step = ref_state.plan([(r, n) for r, n in total.items()])
    keys = [(r, p) for r, n in total.items() for p in range(n)]
    x = torch.cat([embed[r] for r in total])[:, None].expand(-1, cfg.hc_mult, -1).contiguous()
    ref = {}

    def observe(i, rec):
        src = cfg.plan[i].index_source
        for k, key in enumerate(keys):
            ref[(i, *key)] = (rec.attn_in[k], rec.attn_out[k], ctx.topk[src][k] if src is not None else None)

    stack.forward(x, step, ref_state, ctx=ctx, observe=observe)
    return cfg, stack, ref, ref_state, new_state, total


def test_decode_equals_prefill_layer_by_layer(setup):
    cfg, stack, ref, ref_state, new_state, total = setup
    state = new_state()
    seen_kinds, checked = set(), 0
    for call in _calls():
        step = state.plan([(r, n) for r, _, n in call])
        keys = [(r, s + j) for r, s, n in call for j in range(n)]
        ctx = CallContext()
        for L in stack.ids:
            u = torch.stack([ref[(L, *k)][0] for k in keys])
            y = stack.layers[L].forward(u, step, state, ctx)
            src = cfg.plan[L].index_source
            for row, k in enumerate(keys):
                _, y_ref, sel_ref = ref[(L, *k)]
                assert torch.equal(y[row], y_ref), f"layer {L} ({cfg.plan[L].label}) {k}: attn_out differs"
                if src is not None:
                    assert torch.equal(ctx.topk[src][row], sel_ref), f"layer {L} {k}: top-k differs"
                checked += 1
            seen_kinds.add(cfg.plan[L].label)
        state.advance(step)
    assert seen_kinds == {"swa", "full", "full+cand", "reuse", "reindex"}
    assert checked == sum(total.values()) * len(stack.ids)
    _assert_same_caches(cfg, state, ref_state, total)


def _assert_same_caches(cfg, a: DecodeState, b: DecodeState, total) -> None:
    """Every request's window ring and compressed/index-key entries hold the same records."""
    for r, n in total.items():
        held = torch.arange(max(0, n - cfg.window_size), n)
        for L in range(cfg.n_layers):
            assert torch.equal(a.read_window(L, a.slot(r), held), b.read_window(L, b.slot(r), held)), (r, L)
            spec = cfg.plan[L]
            if spec.owns_compressor:
                ea, eb = a.read_entries(L, a.slot(r), n // spec.ratio), b.read_entries(L, b.slot(r), n // spec.ratio)
                assert torch.equal(ea[0], eb[0]) and torch.equal(ea[1], eb[1]), (r, L)
