"""The decode step's `wo_a` on sm_90: the Gluon kernel (`decode.attention.wo_a_plan`) gives the step
the bits it has with the Triton plan (GPU only)."""

import sys
from pathlib import Path

import pytest
import torch

from dsv41_decode.ops.common import is_sm90


@pytest.mark.gpu
@pytest.mark.parametrize("preset,layers", [("small", None), ("v41-flash", [0, 2, 3])], ids=("small", "flash"))
def test_gpu_step_with_the_gluon_wo_a_has_the_triton_plans_bits(monkeypatch, preset, layers):
    """scripts/step_digest.py's run (five steps of 1-8 rows with drafts and accepts, the outputs and
    every cache after them) gives the same digest with each layer's `wo_a` on the Gluon kernel as on
    the Triton plan, at the small preset's shape (2 heads a group, rank 128) and V4.1-Flash's."""
    if not is_sm90(torch.device("cuda")):
        pytest.skip("the Gluon wo_a is sm_90 code")
    from dsv41_decode.decode import attention
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
    import step_digest

    kinds = []
    chosen = attention.wo_a_plan

    def recording(*args, **kwargs):
        plan = chosen(*args, **kwargs)
        kinds.append(type(plan).__name__)
        return plan
    monkeypatch.setattr(attention, "wo_a_plan", recording)
    gluon = step_digest.digest("cuda", preset, layers)
    assert kinds and set(kinds) == {"GluonWoAPlan"}, kinds

    def refuse(*args, **kwargs):
        raise ValueError("this run takes the Triton plan")
    monkeypatch.setattr(attention.GluonWoAPlan, "build", refuse)
    kinds.clear()
    triton = step_digest.digest("cuda", preset, layers)
    assert kinds and set(kinds) == {"WoAPlan"}, kinds
    assert gluon == triton
