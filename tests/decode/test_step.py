"""The specialized decode step (`dsv41_decode.decode.DecodeStep`) against the generic path.

CPU (Triton interpreter, ~0.1 s per program): a reduced configuration that keeps every layer kind -
SWA, ratio-2 Full + Reuse, ratio-1 Full as the candidate source, a Reindex candidate consumer and a
Reuse of it - with a window of 8, top-k 8 and a candidate pool of 3 blocks of 4, so that window
wraps, group completions, top-k saturation and candidate pruning all happen within a few steps.

- Teacher forcing, one layer at a time: just before each layer of a step runs, the state is
  snapshotted; the generic layer forward then runs on the snapshot with the input the step gave
  that layer. So each comparison sees the same caches (including what the step's earlier layers
  wrote in this step) and measures that layer alone: its output, its attention output, its top-k
  and the records it wrote. The mHC boundaries are checked the same way (reference mixer and
  post-mix on the step's streams and layer outputs).
- Bookkeeping: lengths advance by the row counts; a freed slot taken by a new request (stale ring,
  pages and compressor state) works without rebuilding the step.
- Errors: StepError / KeyError / ValueError, raised before anything is planned.

GPU tests of the same step: test_step_gpu.py; the shared helpers (configuration, teacher forcing) are
in tests/helpers.py.
"""

from __future__ import annotations

import contextlib
import copy
import os

import numpy as np
import pytest
import torch

from dsv41_decode.config import ModelConfig
from dsv41_decode.decode import StepError
from dsv41_decode.decode.lanes import AUX_INDEX_Q, AUX_INDEX_W
from dsv41_decode.decode.step import PDL_OPTIONS
from dsv41_decode.stack import AttentionStack
from dsv41_decode.state import DecodeState
from dsv41_decode.weights import load_checkpoint, write_synthetic_checkpoint
from helpers import CPU_TOL, Recorder, reduced_config, rel, streams, teacher_forced

pytestmark = pytest.mark.slow        # among the longest files on the CPU: it runs first (conftest.py)

# The CPU tests need Triton's interpreter (conftest sets it when there is no GPU); on a GPU machine
# run `pytest -m gpu`.
interpreter = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="CPU tensors need TRITON_INTERPRET=1")


# ----------------------------------------------------------------------------------- CPU fixtures
PREFILL = {"a": 21, "b": 14, "c": 6}     # prompt lengths; slot 3 stays free (padding must not write)


@pytest.fixture(scope="module")
def cpu_setup(tmp_path_factory):
    cfg = reduced_config()
    d = write_synthetic_checkpoint(cfg, tmp_path_factory.mktemp("decode_ckpt"), seed=5)
    ckpt = load_checkpoint(d)
    stack = AttentionStack(ckpt)
    state = DecodeState(cfg, max_requests=4, max_context=64, page_size=4, stage_rows=4)
    for r in PREFILL:
        state.admit(r)
    g = torch.Generator().manual_seed(0)
    n = sum(PREFILL.values())
    stack.forward(streams(n, cfg, g), state.plan(list(PREFILL.items())), state)
    return cfg, stack, state, ckpt


# Steps of the teacher-forced test (bucket 4; the second has a padding row), with what they cross:
#   1: b p=14..16 - three rows whose ring slots 6..8 the window of the earlier rows still reads
#      (staging), a ratio-2 group completed at p=15, ratio-2 visible entries 7 -> 8 (= top-k);
#      c p=6 - ratio-1 top-k not yet full (7 entries < 8), candidate pool covers everything.
#   2: a p=21 (ratio-2 group, ratio-1 pruning by the candidate pool: 22 entries, 12 candidates);
#      c p=7, 8 via the (req, count, first_position) form - the window wraps (p=8 takes p=0's
#      slot while p=7 still reads it), ratio-1 entries 8 -> 9 (top-k saturates), a new ratio-1 page.
TF_STEPS = [[("b", 3), ("c", 1)], [("a", 1), ("c", 2, 7)]]


@interpreter
def test_teacher_forced_layers(cpu_setup, monkeypatch):
    """Every layer's output, top-k, records and every boundary vs the generic path, per step."""
    cfg, stack, base, _ = cpu_setup
    state = copy.deepcopy(base)
    step = stack.decode_step(state, max_rows=4)
    assert step.buckets == (1, 2, 4)
    rec = Recorder(stack, monkeypatch)
    free_before = {L: state.window[L][3 * cfg.window_size:4 * cfg.window_size].clone() for L in state.window}
    m = teacher_forced(stack, state, step, rec, TF_STEPS, torch.Generator().manual_seed(1), CPU_TOL)
    assert m["kinds"] == {"swa", "full", "full+cand", "reindex", "reuse"}
    for r, total in (("a", 22), ("b", 17), ("c", 9)):
        assert state.length(r) == total
    for L in state.window:                            # padding rows wrote nothing to the free slot
        assert torch.equal(state.window[L][3 * cfg.window_size:4 * cfg.window_size], free_before[L])
    for L in state.comp_kv:
        assert torch.isfinite(state.comp_score[L][:3]).any()
        assert not state.comp_kv[L][3].any() and torch.isinf(state.comp_score[L][3]).all()


@interpreter
def test_bookkeeping_free_and_admit(cpu_setup):
    """Lengths advance by the rows; a freed slot taken by a new request (stale ring records, pages
    and compressor state) works without rebuilding the step. Layers 1, 3, 4 only (both ratios, the
    candidate source and its consumer), to keep the interpreter time down."""
    cfg, _, base, ckpt = cpu_setup
    stack = AttentionStack(ckpt, [1, 3, 4])
    st, twin = copy.deepcopy(base), copy.deepcopy(base)
    step = stack.decode_step(st, max_rows=4)
    g = torch.Generator().manual_seed(2)

    x1 = streams(3, cfg, g)
    step(x1, [("a", 1), ("b", 2)])
    stack.forward(x1, twin.plan([("a", 1), ("b", 2)]), twin)
    assert (st.length("a"), st.length("b"), st.length("c")) == (22, 16, 6)
    assert st.seq_lens.tolist() == [22, 16, 6, 0]
    for r in (1, 2):
        assert st.pages_of("b", r) == twin.pages_of("b", r)

    # the same next step with "d" in a never-used slot (3), on a copy with its own DecodeStep
    fresh = copy.deepcopy(st)
    assert fresh.admit("d") == 3
    slot_a = st.slot("a")
    for s in (st, twin):
        s.free("a")
        assert s.admit("d") == slot_a                  # a's slot: a's stale records and pages
    assert st.seq_lens.tolist() == [0, 16, 6, 0]
    rows, x2 = [("d", 3), ("b", 1)], streams(4, cfg, g)
    out, pre = step(x2, rows)
    out_fresh, pre_fresh = stack.decode_step(fresh, max_rows=4)(x2, rows)
    ref, _ = stack.forward(x2, twin.plan(rows), twin)
    # nothing of a's is read: bit for bit the run in the clean slot
    assert torch.equal(out, out_fresh) and torch.equal(pre, pre_fresh)
    # and the generic path's bits: d's 3-token context holds fewer entries than top-k and the
    # candidate pool, so no selection can differ, and on the CPU every layer's o, records, u and
    # streams give the reference's bits (test_teacher_forced_layers). The one difference the
    # contract admits is an FP8 code flip of wo_b's input where a z element sits at an E4M3
    # rounding boundary (teacher_forced's attribution accepts it); none does on these rows, so
    # bit for bit (measured; a stale record would be O(1) off)
    e = rel(out[:3], ref[:3])
    assert torch.equal(out[:3], ref[:3]), f"new request in a freed slot: rel RMS {e:.2e} vs the generic path"
    assert (st.length("d"), st.length("b")) == (3, 17)
    assert st.seq_lens.tolist() == [3, 17, 6, 0]
    for r in (1, 2):
        assert st.pages_of("d", r) == twin.pages_of("d", r)
        assert len(st.pages_of("d", r)) == 1
    with pytest.raises(KeyError, match="'a'"):
        step(streams(1, cfg, g), [("a", 1)])
    assert st.seq_lens.tolist() == [3, 17, 6, 0]


_CACHES = ("window", "compressed", "index_keys")


def _twin_steps(steps, cfg, seed: int, rows_lists=([("a", 1), ("b", 2)], [("c", 1), ("a", 1), ("b", 1)])):
    """Run both steps on the same streams for each list of (request, rows) in turn, asserting the
    same outputs and carried pre bit for bit; yields each list's row count after its call."""
    g = torch.Generator().manual_seed(seed)
    for rows in rows_lists:
        x = streams(sum(c for _, c in rows), cfg, g)
        (out0, pre0), (out1, pre1) = (step(x, rows) for step in steps)
        assert torch.equal(out0, out1) and torch.equal(pre0, pre1), rows
        yield sum(c for _, c in rows)


def _assert_same_caches(states, caches=_CACHES) -> None:
    """The two states' caches of these names equal bit for bit, layer by layer."""
    for cache in caches:
        for L, t in getattr(states[0], cache).items():
            assert torch.equal(t, getattr(states[1], cache)[L]), (cache, L)


@interpreter
def test_fold_index_chain_gives_the_same_bits(cpu_setup):
    """fold_index_chain (the index query in the indexer wq_b's epilogue, the head weights in
    weights_proj's, the sparse-index table in the top-k's last launch): two steps give the unfolded
    step's outputs, selections, sparse-index tables and caches bit for bit. Layers 1, 3, 4 (both
    ratios, the candidate source and its Reindex consumer)."""
    cfg, _, base, ckpt = cpu_setup
    stack = AttentionStack(ckpt, [1, 3, 4])
    states = [copy.deepcopy(base) for _ in range(2)]
    # the folds are the tensor-core tier's epilogues (the exact linears keep index_query_)
    steps = [stack.decode_step(st, max_rows=4, fold_index_chain=fold, exact_linears=False)
             for st, fold in zip(states, (False, True))]
    indexers = [i for i in stack.ids if steps[1].layers[i].spec.runs_indexer]
    assert indexers and all(steps[1].layers[i].index_query_in_gemm for i in indexers)
    assert not any(steps[0].layers[i].index_query_in_gemm for i in indexers)
    for n in _twin_steps(steps, cfg, 3):
        for i in indexers:
            a, b = steps[0].layers[i].selection, steps[1].layers[i].selection
            for name in ("topk", "table", "lengths"):
                assert torch.equal(getattr(a, name)[:n], getattr(b, name)[:n]), (i, name)
    _assert_same_caches(states)


@interpreter
def test_comp_tail_in_one_launch_gives_the_same_bits(cpu_setup):
    """comp_tail (the compressor's latent norm, the indexer's wk and the compressed record + index
    key in one launch, `ops.compressor_tail`; off by default) against the three launches: two steps
    give the same outputs and caches bit for bit. Layers 1, 3, 4 (both ratios' compressors)."""
    cfg, _, base, ckpt = cpu_setup
    stack = AttentionStack(ckpt, [1, 3, 4])
    states = [copy.deepcopy(base) for _ in range(2)]
    steps = [stack.decode_step(st, max_rows=4, comp_tail=fused) for st, fused in zip(states, (False, True))]
    owners = [i for i in stack.ids if steps[1].layers[i].spec.owns_compressor]
    assert {steps[1].layers[i].spec.ratio for i in owners} == {1, 2}
    assert all(steps[1].layers[i].comp_tail_fused for i in owners)
    assert not any(steps[0].layers[i].comp_tail_fused for i in stack.ids)
    for _ in _twin_steps(steps, cfg, 4):
        pass
    _assert_same_caches(states, _CACHES + ("comp_kv", "comp_score"))
    assert any(t.any() for t in states[1].index_keys.values())


class _LaneLog:
    """Lanes stand-in that runs everything inline and records the schedule's events: which side
    lanes were entered, each mark's lane, and which marks were waited for."""

    overlap = True

    def __init__(self):
        self.lane, self.entered, self.marks, self.waited = None, set(), [], set()

    @contextlib.contextmanager
    def side(self, lane: int):
        held, self.lane = self.lane, lane
        self.entered.add(lane)
        try:
            yield
        finally:
            self.lane = held

    def mark(self):
        self.marks.append((self.lane, len(self.marks)))
        return self.marks[-1]

    def wait(self, *events):
        self.waited.update(e for e in events if e is not None)


@interpreter
@pytest.mark.parametrize("weights_lane", [True, False])
@pytest.mark.parametrize("own", [slice(0, 2), slice(2, 2)], ids=["rows", "no_rows"])
@pytest.mark.parametrize("lane_rows", [2, 1])
def test_side_lanes_are_joined(cpu_setup, weights_lane, own, lane_rows, monkeypatch):
    """An indexer layer's input projections and prepare phase (`_inputs`, `_prepare`), with the
    indexer's rows `own` (all of them, or none: a row-sharded rank without a share): every side
    lane they enter ends with a mark that is waited for (lane 2's, the index query's, is returned
    to the caller, which waits for it), so each fork joins the main stream again, as a CUDA graph's
    capture requires. The head weights' lane is entered only with weights_lane and at most
    WEIGHTS_LANE_MAX_ROWS rows (patched to 2 and 1 around the call's 2 rows)."""
    from dsv41_decode.decode import attention as attention_mod
    monkeypatch.setattr(attention_mod, "WEIGHTS_LANE_MAX_ROWS", lane_rows)
    cfg, _, base, ckpt = cpu_setup
    stack = AttentionStack(ckpt, [1])
    step = stack.decode_step(copy.deepcopy(base), max_rows=2, weights_lane=weights_lane)
    g = torch.Generator().manual_seed(4)
    step(streams(2, cfg, g), [("a", 1), ("b", 1)])       # meta and caches as a step leaves them
    layer, bd = step.layers[1], step.boundary
    assert layer.spec.runs_indexer and layer.proj_own_lane is weights_lane
    log = layer.lanes = _LaneLog()
    kv_score, qr_ready, proj_ready = layer._inputs(2, bd.u[:2], bd.codes[:2], bd.scales[:2], own)
    iq_ready = layer._prepare(2, kv_score, qr_ready, proj_ready, own)
    assert iq_ready is not None and iq_ready[0] == AUX_INDEX_Q
    log.wait(iq_ready)
    for lane in log.entered:
        last = [e for e in log.marks if e[0] == lane]
        assert last and last[-1] in log.waited, f"lane {lane} left unjoined (marks {last})"
    assert (AUX_INDEX_W in log.entered) is (weights_lane and lane_rows >= 2)


@interpreter
def test_boundary_in_wo_b_gives_the_same_bits(cpu_setup, monkeypatch):
    """fold_boundary (the mHC boundary in wo_b's epilogue: `ExactMM` runs wo_b in every bucket in the
    interpreter) against the boundary's own launch (`Boundary.exit`, not called when folded): steps
    of 1 and 2 rows give the same streams, carried pre, layer output, next input (BF16 and MXFP8)
    and caches bit for bit. Layers 0, 1 (SWA, Full at ratio 2): a boundary with a next layer and
    the last one."""
    from dsv41_decode.decode.boundary import Boundary
    cfg, _, base, ckpt = cpu_setup
    stack = AttentionStack(ckpt, [0, 1])
    states = [copy.deepcopy(base) for _ in range(2)]
    steps = [stack.decode_step(st, max_rows=2, fold_boundary=fold) for st, fold in zip(states, (False, True))]
    assert not any(steps[0].boundary_folded(i, b) for i in stack.ids for b in (1, 2))
    assert all(steps[1].boundary_folded(i, b) for i in stack.ids for b in (1, 2))
    exits, exit_ = [], Boundary.exit
    monkeypatch.setattr(Boundary, "exit", lambda self, *a, **kw: exits.append(self) or exit_(self, *a, **kw))
    for n in _twin_steps(steps, cfg, 4, ([("a", 1)], [("b", 1), ("c", 1)])):
        a, b = steps[0].boundary, steps[1].boundary
        for name in ("u", "codes", "scales", "streams"):
            for t0, t1 in zip(*(t if name == "streams" else [t] for t in (getattr(a, name), getattr(b, name)))):
                assert torch.equal(t0[:n].view(torch.uint8), t1[:n].view(torch.uint8)), (n, name)
        assert torch.equal(steps[0].y[:n], steps[1].y[:n]), n
    assert [bd is steps[0].boundary for bd in exits] == [True] * 4
    _assert_same_caches(states)


@interpreter
def test_late_mixer_gives_the_same_bits(cpu_setup, monkeypatch):
    """mix_late_rows: in the buckets of at least that many rows each site's mixer is enqueued after
    its layer's input projections (`AttentionStep._inputs`), else right after the boundary before
    the layer (the first site's before the first layer): the order of the enqueued work, checked
    per bucket against the patched `Boundary.mix` and `_inputs`, and the same outputs, carried pre
    and caches bit for bit as the early mixer's. Layers 0, 1 (SWA, Full at ratio 2)."""
    from dsv41_decode.decode import attention as attention_mod
    from dsv41_decode.decode.boundary import Boundary
    cfg, _, base, ckpt = cpu_setup
    stack = AttentionStack(ckpt, [0, 1])
    states = [copy.deepcopy(base) for _ in range(2)]
    steps = [stack.decode_step(st, max_rows=2, mix_late_rows=late) for st, late in zip(states, (65, 2))]
    log, mix, inputs = [], Boundary.mix, attention_mod.AttentionStep._inputs
    monkeypatch.setattr(Boundary, "mix", lambda self, layer, *a, **kw: log.append(("mix", layer))
                        or mix(self, layer, *a, **kw))
    monkeypatch.setattr(attention_mod.AttentionStep, "_inputs", lambda self, *a, **kw: log.append(
        ("inputs", self.spec.layer)) or inputs(self, *a, **kw))
    orders = []
    for n in _twin_steps(steps, cfg, 6, ([("a", 1)], [("b", 1), ("c", 1)])):
        half = len(log) // 2            # the early step's calls, then the late step's
        orders.append((n, log[:half], log[half:]))
        log.clear()
    early, late = [("mix", 0), ("inputs", 0), ("mix", 1), ("inputs", 1)], [("inputs", 0), ("mix", 0), ("inputs", 1),
                                                                            ("mix", 1)]
    # 1 row: both early (1 < 2); 2 rows: the second step's mixer late
    assert orders == [(1, early, early), (2, early, late)], orders
    _assert_same_caches(states)
    with pytest.raises(StepError, match="mix_late_rows must be an int >= 1, got 0"):
        stack.decode_step(copy.deepcopy(base), max_rows=2, mix_late_rows=0)


def test_index_row_group_reaches_the_dense_scorers(cpu_setup, monkeypatch):
    """index_row_group (sm_90: the Gluon scorer's row_group; its bits are the GPU tests') is each
    dense indexer's: a step's scores launches take it, and on sm_90 (the device check forced, the
    scorer recorded) `index_scores_launch` hands it to the Gluon scorer; off sm_90 it changes
    nothing. A value the scorer does not take is a StepError naming it."""
    from dsv41_decode.decode import attention
    cfg, _, base, ckpt = cpu_setup
    stack = AttentionStack(ckpt, [1, 3])
    step = stack.decode_step(copy.deepcopy(base), max_rows=4, index_row_group=4)
    indexers = [i for i in stack.ids if step.layers[i].spec.runs_indexer]
    assert indexers and all(step.layers[i].index_row_group == 4 for i in indexers)
    launched, real = [], attention.index_scores_launch
    monkeypatch.setattr(attention, "index_scores_launch",
                        lambda *a, **kw: launched.append(kw.get("row_group")) or real(*a, **kw))
    step(streams(3, cfg, torch.Generator().manual_seed(1)), [("b", 2), ("c", 1)])
    assert launched and set(launched) == {4}, launched
    handed = []
    monkeypatch.setattr(attention, "is_sm90", lambda device: True)
    monkeypatch.setattr(attention, "gluon_index_scores_mxfp4_", lambda *a, **kw: handed.append(kw.get("row_group")))
    attention.index_scores_launch(torch.empty(2, 1), *(None,) * 6, torch.empty(2, 8), row_group=4)
    assert handed == [4]
    for bad in (3, True):
        with pytest.raises(StepError, match="index_row_group must be one of"):
            stack.decode_step(copy.deepcopy(base), max_rows=2, index_row_group=bad)


@pytest.mark.parametrize("option", ["fuse_scales", "pair_slots"])
def test_exact_linear_options_reach_the_exact_linears(cpu_setup, option):
    """fuse_scales and pair_slots (sm_90: GluonExactMM's fused scaling, its ring two slots a wait;
    their bits are the GPU tests') are each exact linear's, the four of every layer, and change
    nothing off sm_90; a value that is not a bool is a StepError naming it."""
    _, _, base, ckpt = cpu_setup
    stack = AttentionStack(ckpt, [1, 3])
    step = stack.decode_step(copy.deepcopy(base), max_rows=2, **{option: True})
    plans = [getattr(step.layers[i], name, None) for i in stack.ids
             for name in ("mm_qkv", "mm_wq_b", "mm_wo_b", "mm_idx_wq_b")]
    assert all(getattr(p, option) for p in plans if p is not None) and sum(p is not None for p in plans) > 4
    with pytest.raises(StepError, match=f"{option} must be a bool, got 1"):
        stack.decode_step(copy.deepcopy(base), max_rows=2, **{option: 1})


@pytest.mark.parametrize("option", PDL_OPTIONS)
def test_pdl_options_are_off_without_pdl_and_checked(cpu_setup, monkeypatch, option):
    """The PDL options (sm_90: the Gluon wo_a after the sparse MLA, the exact wq_b after the norm
    pair, the fused wq_a|wkv after the boundary, wo_b after wo_a, the norm pair after the fused
    GEMM, the boundary after wo_b, the sparse MLA after the sparse-index table, launched by PDL;
    their bits are the GPU tests') change nothing
    where PDL is not available (here, the CPU); a value that is not a bool is a StepError naming
    it; where PDL is available every layer takes it (the fused GEMM's launch at most
    `attention.QKV_PDL_MAX_ROWS` rows a call; the boundary's launch is the step's)."""
    from dsv41_decode.decode import attention, step as step_mod
    _, _, base, ckpt = cpu_setup
    stack = AttentionStack(ckpt, [1, 3])

    def owners(step):
        return [step] if option == "boundary_pdl" else list(step.layers.values())
    step = stack.decode_step(copy.deepcopy(base), max_rows=2, **{option: True})
    assert not any(getattr(owner, option) for owner in owners(step))
    with pytest.raises(StepError, match=f"{option} must be a bool, got 1"):
        stack.decode_step(copy.deepcopy(base), max_rows=2, **{option: 1})
    monkeypatch.setattr(attention, "pdl_supported", lambda device: True)
    monkeypatch.setattr(step_mod, "pdl_supported", lambda device: True)
    step = stack.decode_step(copy.deepcopy(base), max_rows=2, **{option: True})
    assert all(getattr(owner, option) for owner in owners(step))
    if option == "qkv_pdl":
        rows = attention.QKV_PDL_MAX_ROWS
        assert all(layer.takes_qkv_pdl(rows) and not layer.takes_qkv_pdl(rows + 1) for layer in step.layers.values())
        step = stack.decode_step(copy.deepcopy(base), max_rows=2, qkv_pdl=False)
        assert not any(layer.takes_qkv_pdl(1) for layer in step.layers.values())


def test_prefetch_records_is_off_without_the_lanes_and_checked(cpu_setup, monkeypatch):
    """prefetch_records (sm_90 with overlapping lanes: each layer's sparse MLA records asked into L2
    at its start; its bits are the GPU tests') changes nothing on the CPU, also where PDL would be
    supported (the lanes do not overlap there); a value that is not a bool is a StepError naming
    it; where on, a layer takes it in the buckets of at most `attention.PREFETCH_RECORDS_MAX_ROWS`
    rows, and asks for the pools and tables its sparse MLA reads: its own window pool and the
    step's window table, and in a layer that reads an earlier layer's selection (no indexer of its
    own, not SWA) its KV source's compressed pool and that selection's table."""
    from dsv41_decode.decode import attention
    from dsv41_decode.decode.lanes import StepEvents
    cfg, stack, base, _ = cpu_setup
    monkeypatch.setattr(attention, "pdl_supported", lambda device: True)
    step = stack.decode_step(copy.deepcopy(base), max_rows=4, prefetch_records=True)
    assert not any(layer.prefetch_records or layer.takes_prefetch(1) for layer in step.layers.values())
    with pytest.raises(StepError, match="prefetch_records must be a bool, got 1"):
        stack.decode_step(copy.deepcopy(base), max_rows=2, prefetch_records=1)
    calls = []
    monkeypatch.setattr(attention, "records_prefetch_l2_", lambda *a: calls.append(a))
    rows, st, kinds = attention.PREFETCH_RECORDS_MAX_ROWS, step.state, set()
    for i, layer in step.layers.items():
        layer.prefetch_records = True
        assert layer.takes_prefetch(rows) and not layer.takes_prefetch(rows + 1)
        calls.clear()
        layer._prefetch(rows, StepEvents())
        (args,) = calls
        spec = layer.spec
        assert args[0] is st.window[i] and torch.equal(args[1], step.meta.window_table[:rows])
        reads_source = spec.kind != attention.SWA and not spec.runs_indexer
        kinds.add((spec.kind, reads_source))
        if reads_source:
            assert spec.index_source != i and len(args) == 4
            assert args[2] is st.compressed[spec.kv_source]
            assert args[3].data_ptr() == step.layers[spec.index_source].selection.table.data_ptr()
        else:
            assert len(args) == 2
    assert {r for _, r in kinds} == {False, True}, kinds      # both forms met in this configuration


@interpreter
def test_memory_bytes_counts_the_layers_copies_and_workspaces(cpu_setup):
    """DecodeStep.memory_bytes: every family; per layer at least the fused wq_a|wkv copy; the
    stack's weights are not counted (an FP8 wo_a quantized at build adds exactly its codes and
    scales to each layer: the BF16 default reads the stack's own wo_a, and wo_a's workspace is the
    step's shared one, `test_main_stream_workspaces_are_shared_once`)."""
    _, stack, base, _ = cpu_setup
    plain = stack.decode_step(copy.deepcopy(base), max_rows=4)
    fp8 = stack.decode_step(copy.deepcopy(base), max_rows=4, wo_a_fp8=True)
    mem = plain.memory_bytes()
    assert set(mem) == {"scratch", "scores", "workspaces", "selections", "streams", "tables", "layers"}
    assert all(v > 0 for v in mem.values()), mem
    assert mem["layers"] == sum(a.memory_bytes() for a in plain.layers.values())
    for L, a in plain.layers.items():
        assert a.wo_a_w.data_ptr() == a.w["attn.wo_a.weight"].data_ptr()   # the stack's BF16 weight
        assert a.memory_bytes() >= a.w_qkv.nbytes + a.s_qkv.nbytes, L
        b = fp8.layers[L]
        assert b.memory_bytes() - a.memory_bytes() == b.wo_a_w.nbytes + b.wo_a_s.nbytes, L


def _pooled_bytes(a, pool) -> int:
    """Bytes of the views layer step `a`'s plans hold in the pool's buffers."""
    plans = [*a.mla_plans, a.mm_qkv, a.mm_wq_b, a.wo_a_plan, a.mm_wo_b]
    return sum(t.nbytes for p in plans for t in vars(p).values()
               if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() in pool.storages())


@interpreter
def test_main_stream_workspaces_are_shared_once(cpu_setup, monkeypatch):
    """The sparse MLA's and the main-stream linears' (wq_a|wkv, wq_b, wo_a, wo_b) workspaces are
    views of the step's one pool (`Workspaces`), counted once in `memory_bytes`; the side lanes'
    plans keep their own. Built with the GPU's split plans (the step is only built here, not run):
    the tensor-core linears, then the default exact ones (their CUDA-core op's workspace)."""
    from dsv41_decode.decode import attention
    from dsv41_decode.decode.buffers import Workspaces
    _, stack, base, _ = cpu_setup
    monkeypatch.setattr(attention, "_few_programs", lambda device: False)
    shared = stack.decode_step(copy.deepcopy(base), max_rows=4, graphs=False, exact_linears=False)
    pool, mem, layers = shared.scratch.workspaces, shared.memory_bytes(), shared.layers
    assert mem["workspaces"] == pool.memory_bytes() > 0

    def ptr(t):
        return t.untyped_storage().data_ptr()
    swa, full, cand = layers[0].mla_plans[-1], layers[1].mla_plans[-1], layers[3].mla_plans[-1]
    assert full.split and full.n_blocks >= 1 and full.part_acc.numel() > 0
    for name in ("part_acc", "part_ml", "block_max", "flags", "counters", "ticket"):
        assert ptr(getattr(swa, name)) == ptr(getattr(full, name)) == ptr(getattr(cand, name)), name
    assert ptr(layers[2].mm_wo_b._workspace) == ptr(layers[5].mm_qkv._workspace) == ptr(full.part_acc)
    assert ptr(layers[4].mm_wq_b._counters) == ptr(layers[0].wo_a_plan.counters) == ptr(full.flags)
    assert ptr(layers[3].wo_a_plan.partials) == ptr(full.part_acc) and layers[3].wo_a_plan.split > 1
    # the side lanes' plans: their own, never the pool's or another layer's
    side = [t for L in (1, 3, 4) for t in (layers[L].mm_idx_wq_b._workspace, layers[L].mm_idx_wq_b._counters,
                                          layers[L].proj_plan.counters)]
    side += [layers[L].comp_plan.counters for L in (1, 3)] + [layers[3].cand_plan.ws]
    assert len({ptr(t) for t in side}) == len(side) and not {ptr(t) for t in side} & pool.storages()
    exact = stack.decode_step(copy.deepcopy(base), max_rows=4, graphs=False)
    main = [getattr(exact.layers[L], name).cuda_cores._workspace for L in (2, 5) for name in ("mm_qkv", "mm_wo_b")]
    assert {ptr(t) for t in main} == {ptr(exact.layers[1].mla_plans[-1].part_acc)} <= exact.scratch.workspaces.storages()
    with pytest.raises(RuntimeError, match="after seal"):
        pool.take(0, 1, torch.float32)

    # the same step with every plan owning its workspaces: the layers count their views, the pool
    # is gone, and the total exceeds the shared one by the views less the pool counted once
    monkeypatch.setattr(Workspaces, "take", lambda self, slot, shape, dtype:
                        torch.zeros(shape, dtype=dtype, device=self.device))
    alone = stack.decode_step(copy.deepcopy(base), max_rows=4, graphs=False, exact_linears=False)
    mem_alone = alone.memory_bytes()
    assert mem_alone["workspaces"] == 0
    views = {L: _pooled_bytes(a, pool) for L, a in layers.items()}
    for L, a in layers.items():
        assert alone.layers[L].memory_bytes() == a.memory_bytes() + views[L], L
    assert sum(mem_alone.values()) - sum(mem.values()) == sum(views.values()) - mem["workspaces"]
    assert mem["workspaces"] < sum(views.values()) / 2


@interpreter
def test_replays_of_one_row_requests_repeat(cpu_setup):
    """A prepared step of one row a request replayed twice gives the same outputs and caches (what
    `bench step` times; `DecodeStep.prepare`), a ratio-2 group's second row among them (a at p=21)."""
    cfg, stack, base, _ = cpu_setup
    st = copy.deepcopy(base)
    step = stack.decode_step(st, max_rows=4)
    b = step.prepare([("a", 1), ("b", 1), ("c", 1)], streams(3, cfg, torch.Generator().manual_seed(9)))
    caches = lambda: [t.clone() for d in (st.window, st.compressed, st.index_keys, st.comp_kv, st.comp_score)  # noqa: E731
                      for t in d.values()]
    step.replay(b)
    first = step.io.x_out[:3].clone(), caches()
    step.replay(b)
    assert torch.equal(step.io.x_out[:3], first[0])
    assert all(torch.equal(a, b) for a, b in zip(caches(), first[1]))


@interpreter
def test_errors(cpu_setup):
    cfg, stack, base, _ = cpu_setup
    st = copy.deepcopy(base)
    step = stack.decode_step(st, max_rows=4)
    g = torch.Generator().manual_seed(3)
    lengths = {r: st.length(r) for r in PREFILL}
    pages = {(r, k): st.pages_of(r, k) for r in PREFILL for k in (1, 2)}

    with pytest.raises(StepError, match=r"largest captured bucket 4"):
        step(streams(5, cfg, g), [("a", 2), ("b", 3)])
    with pytest.raises(StepError, match=r"position 20"):          # goes backwards
        step(streams(1, cfg, g), [("a", 1, 20)])
    with pytest.raises(StepError, match=r"position 22"):          # skips one
        step(streams(2, cfg, g), [("b", 1), ("a", 1, 22)])
    with pytest.raises(KeyError, match="zz"):
        step(streams(1, cfg, g), [("zz", 1)])
    with pytest.raises(KeyError, match="zz"):
        step(streams(1, cfg, g), [("zz", 1, 0)])
    with pytest.raises(StepError, match=r"x must be \[2, 4, 256\]"):
        step(streams(3, cfg, g), [("a", 2)])
    with pytest.raises(StepError, match=r"bfloat16"):
        step(streams(1, cfg, g).float(), [("a", 1)])
    with pytest.raises(StepError, match="rows entries"):
        step(streams(1, cfg, g), [("a",)])
    with pytest.raises(StepError, match="rows entries"):
        step(streams(1, cfg, g), ["a1"])
    with pytest.raises(StepError, match=r"rows must be a list .* got a dict \(list\(rows.items\(\)\) makes one\)"):
        step(streams(1, cfg, g), {"a": 1})
    with pytest.raises(StepError,
                       match=r"request 'a': count must be an integer >= 1 \(a Python or numpy int\), got '1'"):
        step(streams(1, cfg, g), [("a", "1")])
    # a count below 1 is named before x's shape is checked against the rows' sum
    with pytest.raises(StepError, match=r"request 'a': count must be an integer >= 1 .* got -1"):
        step(streams(3, cfg, g), [("b", 2), ("a", -1)])
    with pytest.raises(StepError, match=r"rows: the call has no rows"):
        step(streams(0, cfg, g), [])
    first = float(st.length("a"))
    with pytest.raises(StepError, match=rf"request 'a': first_position must be an integer, got {first}"):
        step(streams(1, cfg, g), [("a", 1, float(st.length("a")))])
    with pytest.raises(StepError, match=r"pre must be \[1, 4\] float32"):   # would broadcast over rows
        step(streams(1, cfg, g), [("a", 1)], pre=torch.ones(4))
    with pytest.raises(StepError, match=r"x must be \[1, 4, 256\] bfloat16, got \(\) list"):
        step([[0.0]], [("a", 1)])
    with pytest.raises(StepError, match=r"x is on meta, the step on cpu"):
        step(streams(1, cfg, g).to("meta"), [("a", 1)])
    with pytest.raises(StepError, match=r"pre is on meta, the step on cpu"):
        step(streams(1, cfg, g), [("a", 1)], pre=torch.ones(1, 4, device="meta"))
    with pytest.raises(StepError, match=r"bucket_for: rows must be an int >= 1, got 0"):
        step.bucket_for(0)
    assert {r: st.length(r) for r in PREFILL} == lengths           # nothing planned or advanced
    assert {(r, k): st.pages_of(r, k) for r in PREFILL for k in (1, 2)} == pages
    assert step.prepare([("a", 1), ("b", 2)], streams(3, cfg, g)) == 4      # planned and loaded ...
    assert {r: st.length(r) for r in PREFILL} == lengths                      # ... not advanced
    with pytest.raises(StepError, match="bucket 3 is not one of the step's buckets"):
        step.replay(3)
    with pytest.raises(StepError, match="layer 99 is not one of the step's layers"):
        step.layer_call(99, 4)

    with pytest.raises(StepError, match=r"1\.\.64"):
        stack.decode_step(st, max_rows=128)
    with pytest.raises(StepError, match=r"1\.\.64"):
        stack.decode_step(st, buckets=(1, 65))
    with pytest.raises(StepError, match=r"1\.\.64"):
        stack.decode_step(st, buckets=(0, 2))
    with pytest.raises(StepError, match="tp_boundary"):
        stack.decode_step(st, max_rows=4, tp_boundary="nccl")
    for settled in ("pdl", "l2_prefetch", "indexer_first", "overlap_inputs"):   # not options
        with pytest.raises(TypeError, match=settled):
            stack.decode_step(st, **{settled: True})
    with pytest.raises(StepError, match="stage_rows"):             # 8 rows, 4 staging rows
        stack.decode_step(st, max_rows=8)
    tiny = DecodeState(ModelConfig.preset("tiny"), max_requests=1, max_context=8, stage_rows=4)
    with pytest.raises(StepError, match="another configuration"):
        stack.decode_step(tiny, max_rows=4)
    step = stack.decode_step(st, buckets=(3,))
    assert step.buckets == (3,) and step.bucket_for(1) == 3
    with pytest.raises(StepError, match=r"largest captured bucket 3"):
        step.bucket_for(4)


@interpreter
def test_constructor_arguments_are_checked(cpu_setup):
    """max_rows and buckets are ints, the options documented as bools are bools: a StepError naming
    the argument (a string "no" for graphs= would otherwise capture graphs)."""
    _, stack, base, _ = cpu_setup
    for kwargs, msg in ((dict(max_rows=2.5), "max_rows must be an int, got 2.5"),
                        (dict(max_rows=None), "max_rows must be an int, got None"),
                        (dict(max_rows=2, buckets=(True, 2)), r"buckets must be a sequence of ints, got \(True, 2\)"),
                        (dict(max_rows=2, buckets=4), "buckets must be a sequence of ints, got 4"),
                        (dict(max_rows=2, graphs="no"), "graphs must be a bool, got 'no'"),
                        (dict(max_rows=2, exact_linears=1), "exact_linears must be a bool, got 1")):
        with pytest.raises(StepError, match=msg):
            stack.decode_step(copy.deepcopy(base), **kwargs)
    assert stack.decode_step(copy.deepcopy(base), max_rows=np.int64(2)).buckets == (1, 2)
    assert stack.decode_step(copy.deepcopy(base), max_rows=2, buckets=(b for b in (2, 1))).buckets == (1, 2)
    with pytest.raises(StepError, match="state must be a DecodeState, got a str: 'state'"):
        stack.decode_step("state")
    with pytest.raises(TypeError, match="ckpt must be a Checkpoint .* got a str: '/path'"):
        AttentionStack("/path")


@interpreter
def test_numpy_counts_and_inputs_that_require_grad(cpu_setup, monkeypatch):
    """A sampler's numpy counts run as ints; an x that requires grad is copied detached: the step's
    input buffer stays out of autograd (a copy with history would chain every later call's x)."""
    cfg, stack, base, _ = cpu_setup
    step = stack.decode_step(copy.deepcopy(base), max_rows=2)
    monkeypatch.setattr(step, "replay", lambda bucket: None)
    x = streams(2, cfg, torch.Generator().manual_seed(5)).float().requires_grad_().to(torch.bfloat16)
    pre = torch.full((2, cfg.hc_mult), 0.25, requires_grad=True)
    step(x, [("a", np.int64(2))], pre)
    assert step.io.x_in.grad_fn is None and not step.io.x_in.requires_grad
    assert step.io.pre_in.grad_fn is None and not step.io.pre_in.requires_grad
    assert step.state.length("a") == base.length("a") + 2


@pytest.mark.parametrize("rows, hist_ready, sm90, one", [
    (1, True, True, True), (4, True, True, True), (5, True, True, False),
    (1, False, True, False), (1, True, False, False)])
def test_topk_in_one_launch_only_where_the_scorer_built_the_histogram(monkeypatch, rows, hist_ready, sm90, one):
    """`attention.topk_launch`: one launch at calls of at most TOPK_ONE_LAUNCH_MAX_ROWS rows on sm_90
    and only where the scorer built the high-byte histogram (without it, at 1 x 1M, the one launch
    measured 1.5x the linked path's pair: attention.py's note); the linked path elsewhere."""
    from dsv41_decode.decode import attention as attention_mod
    seen = {}
    monkeypatch.setattr(attention_mod, "is_sm90", lambda device: sm90)
    monkeypatch.setattr(attention_mod, "topk_ascending_",
                        lambda scores, n_vis, out, plan, hist_ready, one_launch: seen.update(one=one_launch) or out)
    out = torch.empty(rows, 8, dtype=torch.int32)
    assert attention_mod.topk_launch(torch.zeros(rows, 64), None, out, None, hist_ready) is out
    assert seen == {"one": one}
