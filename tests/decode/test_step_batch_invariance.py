"""Batch invariance of the specialized step: a request's rows give the same bits alone and among
other requests' rows, whatever row bucket the step runs (docs/step.md, "Batch invariance").

Twin states (one a deep copy of the other) advance the watched request by the same rows; on one
the request runs alone, on the other among other requests' rows (before and after it, so its rows
also sit at another index of the bucket). Every layer's attention output and output, and every
boundary's mixer, streams and next input, must hold the same bits for the watched rows; so must
the step's outputs and, through the next steps, the cache records the rows wrote.

CPU (Triton interpreter, four layers of the reduced configuration of test_step.py): buckets 1
and 4 (one step each: ~10 s on 2 idle cores; each bucket-8 step would add ~12 s). Off
the GPU the step's GEMM plans use one split and one tile for every bucket (`decode.attention`), so
the per-bucket tables are tested as plans in tests/ops/test_batch_invariance.py; what varies here
per bucket is the mixer's and the side projections' tiles, the sparse attention's and the indexer's
grids, and the tables. GPU (marked `gpu`): V4.1-Flash, CUDA-graph replay, a row alone against the
same row among 1-63 others, at contexts below and above 16K entries (where the candidate source
starts choosing among more blocks than it keeps).
"""

from __future__ import annotations

import copy
import inspect
import os

import pytest
import torch

from dsv41_decode.decode import AttentionStep
from dsv41_decode.decode.boundary import Boundary
from dsv41_decode.stack import AttentionStack
from dsv41_decode.state import DecodeState
from dsv41_decode.weights import load_checkpoint, write_synthetic_checkpoint
from helpers import reduced_config, streams

interpreter = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="CPU tensors need TRITON_INTERPRET=1")


class LayerLog:
    """Records, in order, what each layer and boundary of a step leaves for rows [0, rows):
    the attention output o, the layer output y, the mixer's post/comb/pre, the new streams and the
    next layer's input (BF16 and MXFP8). Installed by patching `AttentionStep.run` and
    `Boundary.exit` (arguments bound by name); a boundary that runs in wo_b's epilogue
    (`DecodeStep.boundary_folded`) is recorded from the layer's `boundary` operands."""

    def __init__(self, monkeypatch):
        self.entries: list[tuple[str, torch.Tensor]] = []
        log = self
        run, exit_ = AttentionStep.run, Boundary.exit
        run_sig, exit_sig = inspect.signature(run), inspect.signature(exit_)

        def run_(self, *args, **kw):
            a = run_sig.bind(self, *args, **kw).arguments
            run(self, *args, **kw)
            n, L = a["rows"], self.spec.layer
            log.entries.append((f"layer {L} o", self.s.o[:n].clone()))
            log.entries.append((f"layer {L} y", a["y"][:n].clone()))
            b = a.get("boundary")
            if b is not None:
                log.boundary(L, n, b.post, b.comb, b.pre, b.x_out, b.u_out, b.codes_out, b.scales_out)

        def exit__(self, *args, **kw):
            a = exit_sig.bind(self, *args, **kw).arguments
            exit_(self, *args, **kw)
            n, L, slot = a["rows"], a["layer"], a["slot"]
            log.boundary(L, n, self.post[slot], self.comb[slot], self.pre[slot], a["x_new"], self.u, self.codes,
                         self.scales)

        monkeypatch.setattr(AttentionStep, "run", run_)
        monkeypatch.setattr(Boundary, "exit", exit__)

    def boundary(self, L: int, n: int, *tensors: torch.Tensor) -> None:
        for name, t in zip(("post", "comb", "pre", "streams", "u", "codes", "scales"), tensors):
            self.entries.append((f"boundary after layer {L}: {name}", t[:n].clone()))

    def take(self) -> list[tuple[str, torch.Tensor]]:
        out, self.entries = self.entries, []
        return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _rows_of(rows: list[tuple[str, int]], req: str) -> slice:
    """The row range of `req` in a step's rows [(req, count), ...]."""
    start = 0
    for r, c in rows:
        if r == req:
            return slice(start, start + c)
        start += c
    raise KeyError(req)


def _assert_same_rows(alone, among, rows_alone, rows_among, req: str, what: str) -> None:
    ra, rb = _rows_of(rows_alone, req), _rows_of(rows_among, req)
    assert [name for name, _ in alone] == [name for name, _ in among]
    for (name, a), (_, b) in zip(alone, among):
        assert torch.equal(_bits(a[ra]), _bits(b[rb])), f"{what}: {name} differs for {req!r}'s rows"


# --------------------------------------------------------------------------------------------- CPU


def _request_records(state: DecodeState, req: str) -> list[tuple[str, torch.Tensor]]:
    """Every cache record of `req`: its window ring, compressed-KV and index-key entries, and its
    ratio-2 compressor state."""
    s, n, cfg = state.slot(req), state.length(req), state.cfg
    keep = min(n, state.window_size)
    ring = state.window_slots(torch.full((keep,), s), torch.arange(n - keep, n)).to(state.device)
    out = [(f"window {L}", pool[ring]) for L, pool in state.window.items()]
    for L in state.kv_sources:
        r = cfg.ratio(L)
        entries = state.entry_slots(r, s, torch.arange(n // r, device=state.device))
        out += [(f"compressed {L}", state.compressed[L][entries]), (f"index keys {L}", state.index_keys[L][entries])]
    out += [(f"compressor {L}", torch.stack([state.comp_kv[L][s], state.comp_score[L][s]])) for L in state.comp_kv]
    return out


@interpreter
@pytest.mark.parametrize("fold_boundary", [False, True], ids=["boundary_launch", "fold_boundary"])
def test_rows_alone_and_among_others_give_the_same_bits(tmp_path_factory, monkeypatch, fold_boundary):
    """Request a's row alone (bucket 1) and second among 4 rows (bucket 4, where the mixer's tile,
    the indexer's grid and the tables differ): every layer's and boundary's outputs and the cache
    records it wrote hold the same bits, with the boundary in its own launch and in wo_b's epilogue
    (fold_boundary: every layer in both buckets in the interpreter). Four layers: SWA; Full at
    ratio 2 (FP32 compressor weights); Full at ratio 1, the candidate source; Reindex (the Reuse
    layers of test_step.py run no kernel these do not)."""
    cfg = reduced_config().replace(n_layers=4, compress_ratios=(0, 2, 1, 1), kv_source_layers=(1, 2),
                                   index_source_layers=(1, 2, 3), candidate_source_layer=2)
    stack = AttentionStack(load_checkpoint(write_synthetic_checkpoint(cfg, tmp_path_factory.mktemp("bi_ckpt"), seed=5)))
    base = DecodeState(cfg, max_requests=4, max_context=64, page_size=4, stage_rows=8)
    prompts = {"a": 21, "b": 14, "c": 6}
    for r in prompts:
        base.admit(r)
    g = torch.Generator().manual_seed(0)
    stack.forward(streams(sum(prompts.values()), cfg, g), base.plan(list(prompts.items())), base)
    twin = copy.deepcopy(base)
    alone = stack.decode_step(base, max_rows=8, graphs=False, fold_boundary=fold_boundary)
    among = stack.decode_step(twin, max_rows=8, graphs=False, fold_boundary=fold_boundary)
    assert all(step.boundary_folded(i, b) == fold_boundary for step, b in ((alone, 1), (among, 4)) for i in stack.ids)
    log = LayerLog(monkeypatch)
    rows_alone, rows_among = [("a", 1)], [("b", 1), ("a", 1), ("c", 2)]
    xa, xb, xc = streams(1, cfg, g), streams(1, cfg, g), streams(2, cfg, g)
    out_alone = alone(xa, rows_alone)
    rec_alone = log.take()
    out_among = among(torch.cat([xb, xa, xc]), rows_among)
    rec_among = log.take()
    assert (alone.bucket_for(1), among.bucket_for(4)) == (1, 4)
    assert len(rec_alone) == (2 + 7) * len(stack.ids)
    what = "a's row alone vs among 3 other rows"
    _assert_same_rows(rec_alone, rec_among, rows_alone, rows_among, "a", what)
    _assert_same_rows([("streams", out_alone[0]), ("pre", out_alone[1])],
                      [("streams", out_among[0]), ("pre", out_among[1])], rows_alone, rows_among, "a", what)
    for (name, x), (_, y) in zip(_request_records(base, "a"), _request_records(twin, "a")):
        assert torch.equal(_bits(x), _bits(y)), f"{what}: a's {name} records differ"


# --------------------------------------------------------------------------------------------- GPU


@pytest.fixture(scope="module")
def flash_stack():
    from dsv41_decode.config import ModelConfig
    from dsv41_decode.testing.synthetic import random_checkpoint
    cfg = ModelConfig.preset("v41-flash")
    return cfg, AttentionStack(random_checkpoint(cfg, "cuda", seed=0, progress=False))


@pytest.mark.gpu
@pytest.mark.parametrize("context", [4096, 20480], ids=["4K", "20K"])
def test_gpu_flash_row_alone_and_among_1_to_63_others(flash_stack, context):
    """V4.1-Flash, graph replay: request 0's row (and, once, its 3 rows with 2 drafts) alone on one
    state and among 1..63 other requests' rows on its twin, in every bucket 2..64, the watched rows
    at the start, in the middle and at the end of the bucket: the step's output streams and pre
    for those rows bitwise equal, step after step (so the cache records they wrote are too)."""
    from dsv41_decode.testing.synthetic import fill_state
    cfg, stack = flash_stack
    states = []
    for _ in range(2):
        st = DecodeState(cfg, max_requests=64, max_context=context + 256, page_size=64, device="cuda", stage_rows=64)
        fill_state(st, {i: context for i in range(64)}, seed=1)
        states.append(st)
    alone, among = (stack.decode_step(st, max_rows=64) for st in states)
    g = torch.Generator().manual_seed(2)
    cases = [(1, 1, 0), (1, 3, 1), (1, 7, 3), (1, 14, 14), (1, 15, 0), (1, 16, 8), (1, 31, 31), (1, 40, 5),
             (1, 63, 32), (3, 13, 6), (3, 61, 0), (1, 63, 63)]
    for count, others, before in cases:
        ids = [i for i in range(1, 64)][:others]
        rows_alone = [(0, count)]
        rows_among = [(i, 1) for i in ids[:before]] + [(0, count)] + [(i, 1) for i in ids[before:]]
        xa = streams(count, cfg, g, "cuda")
        x = streams(others, cfg, g, "cuda")
        got_alone = alone(xa, rows_alone)
        got_among = among(torch.cat([x[:before], xa, x[before:]]), rows_among)
        what = f"{count} row(s) alone vs among {others} others (bucket {among.bucket_for(count + others)})"
        _assert_same_rows([("streams", got_alone[0]), ("pre", got_alone[1])],
                          [("streams", got_among[0]), ("pre", got_among[1])], rows_alone, rows_among, 0, what)
