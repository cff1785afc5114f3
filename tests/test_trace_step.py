"""`trace verify --path step`: the specialized step (DecodeStep) teacher-forced on the official
traces, one layer at a time, at the verifier's tolerances.

CPU (Triton interpreter): official-tiny's prefill (reference layers) and its first three decode
calls through the step, the checkpoint's 4 heads padded to 8 (~7 s per decode call on 2 cores).
CPU, also with the step's exact linears and FP32 dots (`exact_linears=True, fp32_dots=True`): the
first decode call. GPU (marked gpu): every call of both public official cases through the step on
CUDA as built by default (its exact linears: FP8 tensor-core linears truncate their block sums, so a
record's code can differ, docs/gemm.md "Exactness").
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dsv41_decode.cli import main
from dsv41_decode.testing.trace import MAX_ULP, verify_trace

pytestmark = pytest.mark.slow        # among the longest files on the CPU: it runs first (conftest.py)

DATA = Path(__file__).parent / "data"
OFFICIAL = DATA / "official-tiny"
CASES = [DATA / "official-tiny", DATA / "official-batch2"]

interpreter = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="the step's kernels on CPU tensors need TRITON_INTERPRET=1")


@pytest.fixture(scope="module")
def step_results():
    notes = []
    # decode00 (position 40), decode01 (41: completes a ratio-2 group), decode02 (layer 1's top-k
    # ties with the recorded one: the step is re-run on the recorded selection)
    return verify_trace(OFFICIAL, path="step", calls=3, log=notes.append), notes


@interpreter
def test_step_replay_pads_and_routes_calls(step_results):
    res, notes = step_results
    assert len(notes) == 1 and "4 query heads padded to 8" in notes[0]
    assert {(r.call, r.path) for r in res} == {("prefill", "reference"), ("decode00", "step"),
                                               ("decode01", "step"), ("decode02", "step")}
    assert {r.kind for r in res if r.path == "step"} == {"swa", "full", "full+cand", "reuse", "reindex"}


@interpreter
def test_step_replay_state_is_exact(step_results):
    """What the step writes and selects: caches bit-exact, latents within the ulp limit, top-k and
    candidates as recorded (these do not involve the sparse MLA)."""
    res, _ = step_results
    step = [r for r in res if r.path == "step"]
    assert all(v == 0 for r in step for v in r.quant_bits.values())
    assert sum(r.topk.get("differ", 0) for r in step) == 0
    # one tie (decode02, layer 1); its Reuse layer 2 then reads the recorded selection
    assert [(r.call, r.layer) for r in step if r.topk.get("tie")] == [("decode02", 1)]
    assert sum(r.topk.get("equal", 0) for r in step if r.kind != "swa") == 3 * 6 - 1
    assert all(r.candidate_rows_differ == 0 for r in step)
    assert max(r.latent_ulp for r in step) <= MAX_ULP
    assert max(r.attn_out_ulp for r in step if r.kind == "swa") <= MAX_ULP


@interpreter
def test_step_replay_within_tolerances(step_results):
    """attn_out of every layer within the verifier's limits (the sparse MLA over 64-key blocks of
    the joined key list, spec section 3 step 8)."""
    res, _ = step_results
    failures = [(r.call, r.layer, f) for r in res for f in r.failures]
    assert not failures


def _replay(calls: int, **options):
    """verify_trace of the official case's prefill and first `calls` decode calls through the step
    built with `options`: (results, the step built)."""
    from dsv41_decode.testing import trace_step
    built = []
    real = trace_step.StepReplay.__init__

    def spy(self, *args, **kwargs):
        real(self, *args, **kwargs)
        built.append(self.step)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(trace_step.StepReplay, "__init__", spy)
        res = verify_trace(OFFICIAL, path="step", calls=calls, **options)
    return res, built[0]


@interpreter
def test_step_replay_with_fp32_dots():
    """The step built with fp32_dots=True (and the default exact linears) runs ExactLinear plans
    (ExactMM alone off sm_90), wo_a with IEEE dots and the sparse MLA with FP32 operands, and passes
    the verifier's checks."""
    from dsv41_decode.ops.exact_linear import ExactLinear
    res, step = _replay(1, exact_linears=True, fp32_dots=True)
    layer = next(iter(step.layers.values()))
    assert layer.wo_a_plan.ieee_dot and not any(p.bf16_dot for p in layer.mla_plans)
    assert all(isinstance(p, ExactLinear) and p.mma is None for p in (layer.mm_qkv, layer.mm_wq_b, layer.mm_wo_b))
    assert [r.call for r in res if r.path == "step"] == ["decode00"] * 7
    assert not [(r.call, r.layer, f) for r in res for f in r.failures]


@interpreter
def test_step_replay_with_tensor_core_linears():
    """The step built with exact_linears=False runs its FP8 linears on the tensor-core tier's plans
    (`LowLatencyMM` off sm_90; in the interpreter the FP8 dots sum exactly, so the contract's bits)
    with the query RoPE in wq_b's epilogue, and passes the verifier's checks over two calls (the
    second completes a ratio-2 group)."""
    from dsv41_decode.ops.low_latency_mm import LowLatencyMM
    res, step = _replay(2, exact_linears=False)
    layer = next(iter(step.layers.values()))
    assert all(isinstance(p, LowLatencyMM) for p in (layer.mm_qkv, layer.mm_wq_b, layer.mm_wo_b))
    assert [r.call for r in res if r.path == "step"] == ["decode00"] * 7 + ["decode01"] * 7
    assert not [(r.call, r.layer, f) for r in res for f in r.failures]


def test_step_options_need_the_step_path():
    for option, value in (("exact_linears", False), ("fp32_dots", True)):
        with pytest.raises(ValueError, match="exact_linears=False and fp32_dots=True build the step's kernels"):
            verify_trace(OFFICIAL, path="reference", **{option: value})


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=lambda p: p.name)
def test_step_path_cuda(case, capsys):
    # the step as built by default (exact linears): the official cases pass
    assert main(["trace", "verify", str(case), "--path", "step", "--device", "cuda", "--quiet"]) == 0
    out = capsys.readouterr().out
    lines = out.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("PASS --path step")
    res = verify_trace(case, path="step", device="cuda")
    assert {r.path for r in res if r.call != "prefill"} == {"step"}
    assert not [(r.call, r.layer, f) for r in res for f in r.failures]
