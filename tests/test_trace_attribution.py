"""The batch attribution of the trace verifier (testing/attribution.py): what it explains, what it
must not, and the official batch-2 case it exists for."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dsv41_decode.formats import mxfp8_quantize
from dsv41_decode.reference.linear import fp8_linear
from dsv41_decode.reference.attention import output_projection
from dsv41_decode.reference.rope import rope_cis, rope_freqs
from dsv41_decode.testing.attribution import bf16_steps, explain_o_row, explain_wo_b_row
from dsv41_decode.testing.compare import ulp_distance
from dsv41_decode.testing.trace import MAX_ULP, verify_trace
from dsv41_decode.weights import load_checkpoint

DATA = Path(__file__).parent / "data"
BATCH2 = DATA / "official-batch2"


@pytest.fixture(scope="module")
def wo_b():
    w = load_checkpoint(DATA / "official-tiny", layers=[3]).layer(3)
    return w["attn.wo_b.weight"], w["attn.wo_b.scale"]


def _z(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(128, generator=g).to(torch.bfloat16)


def _flipping_moves(z: torch.Tensor, W, S, ulps: int):
    """(column, moved z, wo_b(moved z)) for every single-element move by `ulps` that changes the
    MXFP8 codes and moves wo_b's output past MAX_ULP."""
    y0 = fp8_linear(z[None], W, S)[0]
    codes = mxfp8_quantize(z[None])[0].view(torch.uint8)
    moved = bf16_steps(z, torch.tensor([ulps]))[0]
    out = []
    for c in range(z.numel()):
        if torch.equal(mxfp8_quantize(moved[c][None])[0].view(torch.uint8), codes):
            continue
        y = fp8_linear(moved[c][None], W, S)[0]
        if ulp_distance(y, y0) > MAX_ULP:
            out.append((c, moved[c], y))
    return out


def test_bf16_steps_walk_the_real_line():
    z = torch.tensor([1.0, -1.0, 0.0], dtype=torch.bfloat16)
    up = bf16_steps(z, torch.tensor([1]))[0]
    assert up[0, 0] == 1.0 + 2 ** -7 and up[1, 1] == -1.0 + 2 ** -8 and up[2, 2] > 0
    down = bf16_steps(z, torch.tensor([-1]))[0]
    assert down[0, 0] == 1.0 - 2 ** -8 and down[2, 2] < 0
    assert torch.equal(up[0, 1:], z[1:])                   # one element moved per row


def test_one_code_flip_is_explained(wo_b):
    W, S = wo_b
    z = _z(0)
    cases = _flipping_moves(z, W, S, 1)
    assert cases, "no one-ulp move of this z flips a code visibly"
    for c, _, y in cases[:4]:
        flip = explain_wo_b_row(z, y, W, S, MAX_ULP, row=3)
        assert flip is not None and flip.row == 3 and flip.residual_ulp <= MAX_ULP
        assert abs(flip.ulps) <= 2


def test_wrong_outputs_are_not_explained(wo_b):
    W, S = wo_b
    z = _z(1)
    y = fp8_linear(z[None], W, S)[0]
    neg = y.clone()
    neg[3] = -neg[3]                                       # one corrupted element
    assert explain_wo_b_row(z, neg, W, S, MAX_ULP) is None
    far = z.clone()
    far[int(z.abs().argmax())] *= 1.25                     # a code moved by two steps and more
    assert explain_wo_b_row(z, fp8_linear(far[None], W, S)[0], W, S, MAX_ULP) is None
    other = fp8_linear(_z(2)[None], W, S)[0]               # another row's output
    assert explain_wo_b_row(z, other, W, S, MAX_ULP) is None
    scaled = (y.float() * 1.02).to(torch.bfloat16)          # every element ~4 ulps off
    assert explain_wo_b_row(z, scaled, W, S, MAX_ULP) is None
    # two visible code flips at once are not one
    (c1, m1, y1), (c2, m2, _) = _flipping_moves(z, W, S, 1)[:2]
    both = m1.clone()
    both[c2] = m2[c2]
    y2 = fp8_linear(both[None], W, S)[0]
    assert ulp_distance(y2, y1) > MAX_ULP
    assert explain_wo_b_row(z, y2, W, S, MAX_ULP) is None


@pytest.fixture(scope="module")
def projection():
    """official-tiny layer 3's output projection and a random attention output o at position 40."""
    ck = load_checkpoint(DATA / "official-tiny", layers=[3])
    cfg, w = ck.config, ck.layer(3)
    cis = rope_cis(rope_freqs(cfg, cfg.plan[3].ratio), torch.tensor([40]))[0]
    o = torch.randn(cfg.n_heads, cfg.head_dim, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    args = (w["attn.wo_a.weight"], w["attn.wo_b.weight"], w["attn.wo_b.scale"], cfg.o_groups, cfg.rope_head_dim)

    def y_of(o_row):
        return output_projection(o_row[None], cis[None], *args)[0]
    return o, cis, y_of, cfg, w


def test_one_o_move_is_explained(projection):
    """An attention output one ulp off at one element: wo_a spreads it over z, MXFP8 flips codes
    of z elements that cancel, and attn_out moves past 2 ulp - explained at o."""
    o, cis, y_of, cfg, w = projection
    y0 = y_of(o)
    found = None
    for e in range(0, o.numel(), 37):
        moved = o.clone()
        moved.view(-1)[e] = bf16_steps(o.view(-1)[e:e + 1], torch.tensor([1]))[0][0][0]
        y = y_of(moved)
        if ulp_distance(y, y0) > MAX_ULP:
            found = (e, y)
            break
    assert found is not None, "no one-ulp move of this o is visible past 2 ulp"
    e, y = found
    args = (w["attn.wo_a.weight"], cfg.o_groups, cfg.rope_head_dim)
    flip = explain_o_row(o, cis, *args, y, w["attn.wo_b.weight"], w["attn.wo_b.scale"], MAX_ULP, row=4)
    assert flip is not None and flip.where == "o" and flip.row == 4 and flip.residual_ulp <= MAX_ULP
    neg = y0.clone()
    neg[5] = -neg[5] if neg[5] != 0 else 1.0
    assert explain_o_row(o, cis, *args, neg, w["attn.wo_b.weight"], w["attn.wo_b.scale"], MAX_ULP) is None
    other = y_of(o.roll(1, 0))                                # the heads swapped round
    assert explain_o_row(o, cis, *args, other, w["attn.wo_b.weight"], w["attn.wo_b.scale"], MAX_ULP) is None


@pytest.fixture(scope="module")
def batch2_results():
    if not BATCH2.is_dir():
        pytest.skip("tests/data/official-batch2 not found")
    return verify_trace(BATCH2)


def test_batch2_passes_by_attribution_only(batch2_results):
    """The official batch-2 case: every difference past the spec's tolerances is one FP8 flip of
    wo_b's input; the mixers well inside their bounds."""
    assert not [(r.call, r.layer, f) for r in batch2_results for f in r.failures]
    flipped = {(r.call, r.layer) for r in batch2_results if r.flips}
    past = {(r.call, r.layer) for r in batch2_results if r.attn_out_ulp > MAX_ULP}
    assert flipped == past == {("prefill", 2), ("prefill", 6), ("decode13", 3)}
    assert max(r.attn_out_unexplained_ulp for r in batch2_results) <= 1.0
    assert max(r.mix_ratio for r in batch2_results) <= 0.05
    assert all(v == 0 for r in batch2_results for v in r.quant_bits.values())


def test_batch2_without_the_flip_fails(tmp_path, batch2_results):
    """The row the flip explains (prefill, layer 2, row 12: 11 ulp at element 10), with that element
    moved 4 more ulps, is no longer explained by any single flip."""
    import shutil
    from safetensors import safe_open
    from safetensors.torch import save_file
    shutil.copytree(BATCH2, tmp_path / "bad")
    with safe_open(str(BATCH2 / "trace.safetensors"), "pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    key = "prefill.layers.2.attn_out"
    rows = tensors[key].clone().view(-1, tensors[key].shape[-1])
    rows[12, 10] = bf16_steps(rows[12], torch.tensor([4]))[0][10][10]
    tensors[key] = rows.view(tensors[key].shape)
    save_file(tensors, str(tmp_path / "bad" / "trace.safetensors"), metadata=meta)
    res = verify_trace(tmp_path / "bad", calls=0)
    assert {(r.call, r.layer) for r in res if r.failures} == {("prefill", 2)}
    assert [f.row for r in res if r.layer == 2 for f in r.flips] == []     # row 12 unexplained now


def test_a_few_ulps_on_the_reference_path_are_not_explained_by_an_o_move(tmp_path):
    """decode05 layer 3, batch row 1, element 5 moved 3 ulps: on the reference path (whose o is the
    contract's) no move of o explains it, though a 2-ulp move of one o element lands within 2 ulp of
    the corrupted row."""
    import shutil
    from safetensors import safe_open
    from safetensors.torch import save_file
    shutil.copytree(BATCH2, tmp_path / "bad")
    with safe_open(str(BATCH2 / "trace.safetensors"), "pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    key = "decode05.layers.3.attn_out"
    rows = tensors[key].clone().view(-1, tensors[key].shape[-1])
    rows[1, 5] = bf16_steps(rows[1], torch.tensor([-3]))[0][5][5]      # -0.3652 -> -0.3711
    tensors[key] = rows.view(tensors[key].shape)
    save_file(tensors, str(tmp_path / "bad" / "trace.safetensors"), metadata=meta)
    names = ["prefill"] + [f"decode{i:02d}" for i in range(6)]
    res = verify_trace(tmp_path / "bad", calls=len(names) - 1)
    assert {(r.call, r.layer) for r in res if r.failures} == {("decode05", 3)}
