"""Speculative decoding on the specialized step (CPU, Triton interpreter): a drafted run with
`accept` against the run fed only the accepted tokens (spec decision 12).

- The step's state writes, driven alone over many calls (fast): `StepMeta`'s table kernel (window
  tables, staging and ring slots for a ring of W + max_drafts), the staged window records moved
  into the ring as `wo_a`'s copy does, the ratio-2 compressor kernel with its row history
  (`comp_rows`) and the compressed entries stored at the step's entry slots. Every acceptance
  pattern of 1-3 drafts, several ring wraps, many group boundaries; after every call the state
  and the window records each kept row's table points at equal the accepted-only run's.
- The whole `DecodeStep`, a few calls: both runs replay the same single bucket, and the step is
  batch-invariant at a fixed bucket (one reduction order per shape, `ops.low_latency_mm`), so the
  kept rows' outputs and the state must agree bit for bit.

GPU, V4.1-Flash sizes and CUDA graphs: test_speculative_gpu.py.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch

from dsv41_decode.config import ModelConfig
from dsv41_decode.decode.tables import StepMeta
from dsv41_decode.layer import CallContext
from dsv41_decode.ops.compressor import compress_ratio2_
from dsv41_decode.records import pack_compressed_kv, pack_index_key, pack_window_kv
from dsv41_decode.stack import AttentionStack
from dsv41_decode.state import DecodeState
from dsv41_decode.testing import speculative as sp
from dsv41_decode.testing.synthetic import fill_state, random_checkpoint
from dsv41_decode.weights import load_checkpoint, write_synthetic_checkpoint
from helpers import reduced_config, streams

interpreter = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="CPU tensors need TRITON_INTERPRET=1")

REQS = ("a", "b")
PREFILL = {"a": 5, "b": 0}
BUCKET = 8


def mini_config() -> ModelConfig:
    """One ratio-2 Full layer (window, compressor, indexer, top-k 4); window 4. Every layer's ring
    and staging work alike, so one layer exercises them (the interpreter's cost is per layer)."""
    return ModelConfig.preset("tiny").replace(
        n_layers=1, compress_ratios=(2,), kv_source_layers=(0,), index_source_layers=(0,),
        candidate_source_layer=None, n_heads=8, window_size=4, index_topk=4, o_lora_rank=64)


# ------------------------------------------------------------------ the step's state writes alone
class StepWrites:
    """What a step writes into the state, through the step's own table kernel and compressor
    kernel: window records (staged, then moved into the ring), compressor state and rows, and the
    compressed-KV / index-key records of completed groups (from the compressor's output), for
    `layers` (the stack's; None: every layer of the state). restore: the compressor kernel reads
    each request's open group from `comp_rows` (the step's form with drafts), so that accept can
    leave it there (`accept(defer=True)`)."""

    def __init__(self, state: DecodeState, layers=None, restore: bool = False):
        self.state = state
        self.restore = restore
        self.layers = set(state.window) if layers is None else set(layers)
        self.pools = {L: p for L, p in state.window.items() if L in self.layers}
        self.meta = StepMeta(state.cfg, state, BUCKET)
        self.out = torch.zeros(BUCKET, 512)
        self.done = torch.zeros(BUCKET, dtype=torch.int32)
        self.seen: list[dict] = []     # per call, per kept row (req, position): the window it reads

    def __call__(self, values: torch.Tensor, rows: list) -> tuple[torch.Tensor, torch.Tensor]:
        """values: [n, 1024] FP32 per row: the compressor's kv | score, whose first 512 also give
        the row's window record."""
        st, m, n = self.state, self.meta, values.shape[0]
        step = st.plan(rows)
        m.load(step, BUCKET)
        m.derive(BUCKET)
        for pool in self.pools.values():
            pool[m.stage_slot[:n]] = pack_window_kv(values[:, :512].to(torch.bfloat16))
        reads = {}
        for row in range(n):   # what sparse MLA reads: the records at the row's window table
            t = m.window_table[row]
            reads[row] = {L: pool[t[t >= 0].long()].clone() for L, pool in self.pools.items()}
        for pool in self.pools.values():
            m.copy_staged(pool, BUCKET)
        kv_score = torch.zeros(BUCKET, 1024)
        kv_score[:n] = values
        for L in (L for L in st.comp_kv if L in self.layers):
            compress_ratio2_(kv_score, m.record[0], m.record[1], st.comp_kv[L], st.comp_score[L],
                             self.out, self.done, st.comp_rows.get(L), restore=self.restore and L in st.comp_rows)
            e = m.entry_slot[2][:BUCKET]
            ok = e >= 0
            lat = self.out[ok].to(torch.bfloat16)
            st.compressed[L][e[ok]] = pack_compressed_kv(lat)
            st.index_keys[L][e[ok]] = pack_index_key(lat[:, :128].contiguous())
        st.advance(step)
        positions = step.positions.tolist()
        self.seen.append({(step.req_ids[i], p): reads[r] for i in range(step.n_requests)
                          for r, p in zip(range(step.request_rows(i).start, step.request_rows(i).stop),
                                          positions[step.request_rows(i)])})
        return values[:, None, :4].to(torch.bfloat16), values[:, :4]     # stand-in outputs


def _writes_state(cfg, max_drafts):
    st = DecodeState(cfg, max_requests=3, max_context=128, page_size=4, stage_rows=BUCKET,
                     max_drafts=max_drafts)
    for r in REQS:
        st.admit(r)
    return st


@interpreter
@pytest.mark.parametrize("defer", [False, True], ids=["accept_restores", "kernel_restores"])
def test_step_state_writes_with_drafts_equal_accepted_only(defer):
    """defer: accept leaves the open groups to the next call's compressor kernel, which reads them
    from comp_rows (`DecodeStep.accept`'s form); the held state reads them as that call would."""
    cfg = mini_config()
    plan = sp.acceptance_plan(REQS, 12, max_drafts=3, seed=4)
    need = sp.needed_tokens(plan)
    g = torch.Generator().manual_seed(5)
    truth = {r: torch.randn(n, 1024, generator=g) for r, n in need.items()}
    # two wraps of the 7-slot ring and 10 groups for every request
    assert min(need.values()) >= max(2 * (cfg.window_size + 3), 20)
    runs = {}
    for md, drafted in ((3, True), (0, False)):
        st = _writes_state(cfg, md)
        w = StepWrites(st, restore=defer and drafted)
        held = []
        accept = (lambda kept: st.accept(kept, defer=defer)) if drafted else None
        sp.serve(w, truth, plan, junk_seed=6 if drafted else None, accept=accept,
                 after=lambda _: held.append({r: sp.held_state(st, r) for r in REQS}))
        runs[drafted] = st, w, held
    (_, w_d, held_d), (_, w_o, held_o) = runs[True], runs[False]
    for k, (a, b) in enumerate(zip(held_d, held_o)):
        for r in REQS:
            for key, v in a[r].items():
                same = v == b[r][key] if isinstance(v, int) else torch.equal(v, b[r][key])
                assert same, f"after call {k}: request {r!r}: {key} differs"
        # every kept row's window table points at the accepted-only run's records
        for key, reads in w_o.seen[k].items():
            for L, rec in reads.items():
                assert torch.equal(w_d.seen[k][key][L], rec), f"call {k}, row {key}, layer {L}"
    rejected = sum(d + 1 - kk for call in plan for d, kk in call.values())
    assert rejected >= 20


@interpreter
def test_held_state_is_the_stack_layers_on_a_filled_state():
    """The GPU test's shape: a state of every layer of the configuration, filled with a cached
    prefix of random records in every layer (`fill_state`), served by a stack of some layers
    (here layer 0; layer 1 an SWA layer and layer 2 a ratio-2 source outside it). The stack's
    layers agree bit for bit; the layers outside it do not - no call writes them, so their rings
    keep the prefix's records at the slots of `p % ring_size` (other positions under a ring of
    W + 3 than under one of W) and `accept` copies their open groups from rows no call wrote -
    and no call of the stack reads them, so `held_state(..., layers)` leaves them out."""
    cfg = mini_config().replace(n_layers=3, compress_ratios=(2, 0, 2), kv_source_layers=(0, 2),
                                index_source_layers=(0, 2))
    plan = sp.acceptance_plan(REQS, 12, max_drafts=3, seed=4)
    need = sp.needed_tokens(plan)
    g = torch.Generator().manual_seed(5)
    truth = {r: torch.randn(n, 1024, generator=g) for r, n in need.items()}
    states = []
    for md, drafted in ((3, True), (0, False)):
        st = DecodeState(cfg, max_requests=3, max_context=128, page_size=4, stage_rows=BUCKET,
                         max_drafts=md)
        fill_state(st, {"a": 1, "b": 3}, seed=3)
        sp.serve(StepWrites(st, layers=(0,)), truth, plan, junk_seed=6 if drafted else None,
                 accept=st.accept if drafted else None)
        states.append(st)
    diff = sp.state_difference(*states, REQS, layers=(0,))
    assert diff is None, diff
    # what the GPU test reported before its comparison named the stack's layers
    assert sp.state_difference(*states, REQS) == "request 'a': window.1 differs"


# ------------------------------------------------------------------ the whole DecodeStep
@pytest.fixture(scope="module")
def mini_stack(tmp_path_factory):
    cfg = mini_config()
    d = tmp_path_factory.mktemp("spec_step_ckpt")
    write_synthetic_checkpoint(cfg, d, seed=5)
    return cfg, AttentionStack(load_checkpoint(d))


def _step_state(cfg, stack, max_drafts):
    st = DecodeState(cfg, max_requests=2, max_context=64, page_size=4, stage_rows=4, max_drafts=max_drafts)
    st.admit("a")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(PREFILL["a"], cfg.hc_mult, cfg.dim, generator=g).to(torch.bfloat16)
    stack.forward(x, st.plan([("a", PREFILL["a"])]), st)
    return st


@interpreter
def test_decode_step_with_drafts_equals_accepted_only(mini_stack):
    """Request a at positions 5..8 keeps 5: it rejects a first half of a pair (6, then 8) and a
    completed group (7, publishing entry 3), and the 7-slot ring wraps; at 6..9 it keeps 6, so the
    ratio-2 group (6, 7) stays open while its rejected second row 7 completed it (`accept` restores
    the open group); the third call re-decodes 7..8 and keeps them. (Several requests per call,
    fresh groups and every pattern: the state-writes test above and the GPU test.)"""
    cfg, stack = mini_stack
    plan = [{"a": (3, 1)}, {"a": (3, 1)}, {"a": (1, 2)}]
    truth = sp.true_inputs(cfg, sp.needed_tokens(plan), seed=1)
    outs, states = [], []
    for md, drafted in ((3, True), (0, False)):
        st = _step_state(cfg, stack, md)
        step = stack.decode_step(st, max_rows=4, buckets=(4,), graphs=False)
        outs.append(sp.serve(step, truth, plan, junk_seed=2 if drafted else None,
                             accept=step.accept if drafted else None))
        states.append(st)
    assert sp.first_difference(*outs) is None, sp.first_difference(*outs)
    assert sp.state_difference(*states, ["a"]) is None, sp.state_difference(*states, ["a"])


def _call_failing_after_replay(step, x, rows) -> None:
    """step(x, rows) with its replay raising after the kernels ran (the call is abandoned)."""
    replay = step.replay

    def failing(bucket):
        replay(bucket)
        raise RuntimeError("replay failed")
    step.replay = failing
    try:
        with pytest.raises(RuntimeError, match="replay failed"):
            step(x, rows)
    finally:
        step.replay = replay


@interpreter
def test_a_step_call_that_fails_after_its_replay_is_retried_exactly(mini_stack):
    """An exception after the step's kernels wrote the state (here: its replay, once) abandons the
    call (`DecodeState.abandon`): the same 4 rows of a (max_drafts + 1; start 5 leaves its ratio-2
    group open) called again give the outputs and state of a step that never failed."""
    cfg, stack = mini_stack
    x = torch.randn(4, cfg.hc_mult, cfg.dim, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    outs, states = [], []
    for fail in (True, False):
        st = _step_state(cfg, stack, 3)
        step = stack.decode_step(st, max_rows=4, buckets=(4,), graphs=False)
        if fail:
            _call_failing_after_replay(step, x, [("a", 4)])
            assert st.length("a") == PREFILL["a"]
        outs.append(step(x, [("a", 4)]))
        states.append(st)
    assert all(torch.equal(a, b) for a, b in zip(*outs))
    assert sp.state_difference(*states, ["a"]) is None, sp.state_difference(*states, ["a"])


@interpreter
def test_deferred_accept_across_paths_equals_accepted_only(mini_stack):
    """`DecodeStep.accept` leaves the open groups to the next call (the stack runs the state's one
    ratio-2 source: `restores_groups`). Against the accepted-only run, bit for bit in the kept rows'
    outputs and the held state after every call. Each deferral keeps one of three rows from an even
    start, so the kept length is odd and the next row completes a group with the row of the kept
    length - 1, which a rejected row overwrote in comp_kv: read by the step's compressor kernel from
    comp_rows (request a, call 4, after a step call that left it out), restored by the generic
    layer first (b, call 6), restored by an abandoned step call that ran its layers (a, call 8,
    drafted run only; the generic layer reads what the abandon restored next); then b is freed and
    its slot re-admitted (c from a fresh group)."""
    cfg, stack = mini_stack
    plan = [("step", {"a": (0, 1), "b": (0, 1)}), ("step", {"a": (2, 1), "b": (0, 1)}), ("step", {"b": (0, 1)}),
            ("step", {"a": (0, 1), "b": (0, 1)}), ("step", {"b": (2, 1)}), ("forward", {"b": (0, 1)}),
            ("step", {"a": (2, 1)}), ("abandon", {"a": (1, 0)}), ("forward", {"a": (0, 1)}),
            ("free b, admit c", {}), ("step", {"c": (1, 1), "a": (0, 1)})]
    g = torch.Generator().manual_seed(8)
    truth = {r: torch.randn(8, cfg.hc_mult, cfg.dim, generator=g).to(torch.bfloat16) for r in "abc"}
    runs = []
    for drafted in (True, False):
        st = _step_state(cfg, stack, 3 if drafted else 0)
        st.admit("b")
        step = stack.decode_step(st, max_rows=4, buckets=(4,), graphs=False)
        assert step.restores_groups == drafted
        junk = torch.Generator().manual_seed(9)
        done = {r: 0 for r in truth}
        outs, held = [], []
        for kind, call in plan:
            if kind == "free b, admit c":
                st.free("b")
                st.admit("c")
                continue
            rows = [(r, d + 1 if drafted else k) for r, (d, k) in call.items()]
            xs = [torch.cat([truth[r][done[r]:done[r] + k],
                             torch.randn(n - k, cfg.hc_mult, cfg.dim, generator=junk).to(torch.bfloat16)])
                  for (r, (_, k)), (_, n) in zip(call.items(), rows)]
            if kind == "abandon":
                if drafted:
                    _call_failing_after_replay(step, torch.cat(xs), rows)
                continue
            y, pre = step(torch.cat(xs), rows) if kind == "step" else stack.forward(torch.cat(xs), st.plan(rows), st)
            at = 0
            for (r, (_, k)), (_, n) in zip(call.items(), rows):
                outs += [(r, y[at + i], pre[at + i]) for i in range(k)]
                at += n
                done[r] += k
            if drafted:
                step.accept({r: k for r, (_, k) in call.items()})
            held.append({r: sp.held_state(st, r) for r in st.live_requests})
        runs.append((outs, held))
    (out_d, held_d), (out_o, held_o) = runs
    for i, ((r, y1, p1), (_, y2, p2)) in enumerate(zip(out_d, out_o)):
        assert torch.equal(y1, y2) and torch.equal(p1, p2), f"kept row {i} of request {r!r} differs"
    for k, (a, b) in enumerate(zip(held_d, held_o)):
        for r in a:
            for key, v in a[r].items():
                same = v == b[r][key] if isinstance(v, int) else torch.equal(v, b[r][key])
                assert same, f"after call {k}: request {r!r}: {key} differs"


@pytest.fixture(scope="module")
def reduced_checkpoint():
    cfg = reduced_config()           # layer 0 SWA, layer 1 a ratio-2 Full layer
    return cfg, random_checkpoint(cfg, "cpu", progress=False)


def test_a_layer_alone_after_a_deferred_accept_reads_the_kept_group(reduced_checkpoint):
    """The generic layer restores the groups a deferred accept left before it reads them, also when
    it runs outside `AttentionStack.forward` (`AttentionStack.block`, as the trace recorder runs
    it): the kept length 5 is odd and its next row completes the group (4, 5) with position 4's row,
    which rejected row 6 overwrote; the compressed entry equals the eager accept's."""
    cfg, ck = reduced_checkpoint
    stack = AttentionStack(ck, [1])
    g = torch.Generator().manual_seed(3)
    st = DecodeState(cfg, max_requests=2, max_context=64, page_size=4, max_drafts=3)
    st.admit("a")
    stack.forward(streams(4, cfg, g), st.plan([("a", 4)]), st)
    stack.forward(streams(4, cfg, g), st.plan([("a", 4)]), st)            # positions 4..7
    eager, lazy = st, copy.deepcopy(st)
    eager.accept({"a": 1})
    lazy.accept({"a": 1}, defer=True)
    x = streams(1, cfg, g)
    outs = []
    for s in (eager, lazy):
        step = s.plan([("a", 1)])
        y, _, _ = stack.block(1, x, stack.initial_pre(1), step, s, CallContext(), None)
        s.advance(step)
        outs.append((y, s.compressed[1].clone()))
    assert torch.equal(outs[0][1], outs[1][1]) and torch.equal(outs[0][0], outs[1][0])


@interpreter
def test_a_readmitted_slot_starts_from_a_fresh_row_history(reduced_checkpoint):
    """`admit` resets a slot's `comp_rows` with its open group: a request advanced by a stack without
    the ratio-2 source (its group stays fresh), then stepped by one with it, reads a fresh group
    through the kernel's history, not the slot's previous request's rows - as the state without
    drafts reads its fresh comp_kv."""
    cfg, ck = reduced_checkpoint
    swa, full = AttentionStack(ck, [0]), AttentionStack(ck, [1])
    g = torch.Generator().manual_seed(4)
    xs = [streams(n, cfg, g) for n in (5, 5, 1)]
    outs = []
    for md in (3, 0):
        st = DecodeState(cfg, max_requests=1, max_context=64, page_size=4, stage_rows=8, max_drafts=md)
        st.admit("x")
        full.forward(xs[0], st.plan([("x", 5)]), st)                        # comp_rows rows 0..4
        st.free("x")
        st.admit("y")                                                       # the same slot
        swa.forward(xs[1], st.plan([("y", 5)]), st)                         # layer 1 not run at 0..4
        step = full.decode_step(st, max_rows=1, buckets=(1,), graphs=False)
        outs.append(step(xs[2], [("y", 1)])[0])                              # p0 = 5 reads rows 3, 4
    assert torch.equal(outs[0], outs[1])


def test_a_step_without_every_ratio2_source_restores_a_pending_group_first(reduced_checkpoint, monkeypatch):
    """A step whose stack leaves out a ratio-2 source (here layer 3's alone) runs `sync` before its
    plan: its advance ends the request's deferral, so the group of the source it does not run
    would otherwise stay unrestored for good (open_group and the generic layer would read the
    rejected rows); the state afterwards holds the eager accept's group."""
    cfg, ck = reduced_checkpoint
    st = DecodeState(cfg, max_requests=2, max_context=64, page_size=4, stage_rows=4, max_drafts=3)
    st.admit("a")
    g = torch.Generator().manual_seed(0)
    layer1 = AttentionStack(ck, [1])
    layer1.forward(streams(6, cfg, g), st.plan([("a", 6)]), st)
    layer1.forward(streams(3, cfg, g), st.plan([("a", 3)]), st)          # positions 6..8
    eager = copy.deepcopy(st)
    eager.accept({"a": 1})                                               # length 7: row 6 of group (6, 7)
    st.accept({"a": 1}, defer=True)
    step = AttentionStack(ck, [3]).decode_step(st, max_rows=4, graphs=False)
    assert not step.restores_groups
    monkeypatch.setattr(step, "replay", lambda bucket: None)             # the host path is what is tested
    step(streams(1, cfg, g), [("a", 1)])
    for got, want in zip(st.open_group(1, 0), (eager.comp_kv[1][0], eager.comp_score[1][0])):
        assert torch.equal(got, want)
