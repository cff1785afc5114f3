"""Speculative decoding on the H200 (marked `gpu`): V4.1-Flash sizes (window 128, top-k 512, 64
heads), CUDA graphs, a stack of every layer kind and every ratio-2 source (so `DecodeStep.accept`
leaves the open groups to the next call's compressor kernels: `restores_groups`).

A drafted run (4 requests, every acceptance pattern of 1-3 drafts and then random ones, junk inputs
in the rejected rows, `DecodeStep.accept` after every step) against the run fed only the accepted
tokens, on a state built without drafts (a ring of exactly W). The step is batch-invariant (a
request's rows give the same bits whatever rows share the step and whatever bucket it replays:
docs/step.md, tests/decode/test_step_batch_invariance.py), so the kept rows' outputs and the held
state must agree bit for bit: once with both runs on one bucket (16 rows), once with the default
buckets (the drafted run's steps replay larger buckets than the accepted-only run's). 160 steps:
every request crosses two wraps of the 131-slot ring and 60+ ratio-2 groups.
"""

from __future__ import annotations

import pytest
import torch

from dsv41_decode.config import ModelConfig
from dsv41_decode.stack import AttentionStack
from dsv41_decode.state import DecodeState
from dsv41_decode.testing import speculative as sp
from dsv41_decode.testing.synthetic import fill_state, random_checkpoint

REQS = ("a", "b", "c", "d")
CACHED = {"a": 1, "b": 77, "c": 300, "d": 1000}
STEPS = 160


def _layers(cfg: ModelConfig, kinds=(0, 2, 3, 8, 14, 20, 21, 24, 25)) -> list[int]:
    """`kinds` and every KV / index source they need (SWA, the Full r2 layers + a Reuse, the ratio-1
    candidate source and its Reuse, a Reindex consumer and its Reuse)."""
    ids = set(kinds)
    for L in kinds:
        spec = cfg.plan[L]
        ids |= {s for s in (spec.kv_source, spec.index_source) if s is not None}
    return sorted(ids)


@pytest.fixture(scope="module")
def flash():
    cfg = ModelConfig.preset("v41-flash")
    ids = _layers(cfg)
    stack = AttentionStack(random_checkpoint(cfg, "cuda", seed=2, layers=ids, progress=False), ids)
    return cfg, stack


def _state(cfg, max_drafts):
    st = DecodeState(cfg, max_requests=4, max_context=2048, page_size=64, device="cuda", stage_rows=16,
                     max_drafts=max_drafts)
    fill_state(st, CACHED, seed=3)
    return st


@pytest.mark.gpu
@pytest.mark.parametrize("buckets", [(16,), None], ids=["one_bucket", "default_buckets"])
def test_gpu_drafted_run_equals_accepted_only(flash, buckets):
    cfg, stack = flash
    plan = sp.acceptance_plan(REQS, STEPS, max_drafts=3, seed=7)
    need = sp.needed_tokens(plan)
    assert min(need.values()) >= 2 * (cfg.window_size + 3) and min(need.values()) // 2 >= 60
    truth = sp.true_inputs(cfg, need, seed=1, device="cuda")
    outs, states = [], []
    for md, drafted in ((3, True), (0, False)):
        st = _state(cfg, md)
        step = stack.decode_step(st, max_rows=16, buckets=buckets)
        assert step.use_graphs and step.restores_groups == drafted
        outs.append(sp.serve(step, truth, plan, junk_seed=2 if drafted else None,
                             accept=step.accept if drafted else None))
        states.append(st)
    torch.cuda.synchronize()
    assert sp.first_difference(*outs) is None, sp.first_difference(*outs)
    # the stack's layers: the state holds every layer of V4.1-Flash, the others are never written
    # (their rings keep fill_state's records, aliased differently under W + 3 and W slots)
    diff = sp.state_difference(*states, REQS, layers=stack.ids)
    assert diff is None, diff

