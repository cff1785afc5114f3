"""ops.pdl: off unless a launch asks for it, and the contract of the PDL-aware Triton kernels checked in
their sm_90 PTX, compiled on the CPU with Triton's own ptxas (no GPU): before `griddepcontrol.wait` a
kernel may only prefetch (`cp.async.bulk.prefetch.L2`); every global load, store and atomic comes after
it, and `griddepcontrol.launch_dependents` follows the wait. (The Gluon ring kernels launched by PDL -
`wo_a`, the exact linears - request their ring's first weight tiles before their wait: their own
compile tests check that and nothing else global comes first, `testing.sm90.pdl_prologue`; the
kernels that release them at their start are checked in test_gluon_sparse_mla*.py.)"""

from __future__ import annotations

from pathlib import Path

import torch

from dsv41_decode.ops import pdl, sparse_mla
from helpers import compile_script


def test_off_unless_asked_per_launch():
    assert pdl.launch_options() == {}
    assert pdl.launch_options(pdl=True) == {"launch_pdl": True}
    assert not pdl.supported("cpu")      # never on the CPU or in the interpreter


def test_kernels_wait_before_dependent_accesses():
    """The sm_90 PTX of every PDL-aware kernel: low_latency_mm (both variants), ExactMM, wo_a,
    sparse_mla and its combine, the norms, act_quant, the query/window-KV insert, the mHC boundary and
    the sparse-index table (tests/ops/_pdl_ptx_check.py, in a subprocess without the interpreter)."""
    out, _ = compile_script(Path(__file__).with_name("_pdl_ptx_check.py"))
    assert out.count("waits before") == 11


def test_default_launches_carry_no_pdl(monkeypatch):
    """A launcher passes PDL=False and no launch attribute (no global switch turns it on)."""
    seen = {}

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                seen.update(kwargs)
            return launch

    monkeypatch.setattr(sparse_mla, "_sparse_mla_kernel", Spy())
    plan = sparse_mla.SparseMlaPlan.build(1, 16, 16, 0, "cpu", split=False)
    q = torch.zeros(1, 16, 512, dtype=torch.bfloat16)
    sparse_mla.sparse_mla_(plan, q, torch.zeros(4, 528, dtype=torch.uint8), torch.zeros(0, 288, dtype=torch.uint8),
                           torch.zeros(1, 16, dtype=torch.int32), torch.zeros(1, 0, dtype=torch.int32),
                           torch.zeros(16), 0.1, torch.zeros_like(q))
    assert seen["PDL"] is False and "launch_pdl" not in seen
