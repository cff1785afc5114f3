"""Golden traces: the official case replays within the spec's tolerances; our recorder's format
round-trips; a corrupted trace is caught."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from dsv41_decode.cli import main
from dsv41_decode.testing.trace import TraceError, read_case, verify_trace

OFFICIAL = Path(__file__).parent / "data" / "official-tiny"


@pytest.fixture(scope="module")
def official_results():
    return verify_trace(OFFICIAL)


def test_official_trace_covers_every_kind_and_call(official_results):
    calls = {r.call for r in official_results}
    assert calls == {"prefill"} | {f"decode{i:02d}" for i in range(14)}
    assert {r.kind for r in official_results} == {"swa", "full", "full+cand", "reuse", "reindex"}


def test_official_trace_within_tolerances(official_results):
    failures = [(r.call, r.layer, f) for r in official_results for f in r.failures]
    assert not failures
    # quantized values bit-exact, no top-k row that differs beyond ties
    assert all(v == 0 for r in official_results for v in r.quant_bits.values())
    assert sum(r.topk.get("differ", 0) for r in official_results) == 0
    assert max(r.attn_out_ulp for r in official_results) <= 1.0
    # batch 1: nothing needs the batch attribution (no FP8 flip), every mixer coefficient far
    # inside its derived bound (measured 0.004 of it)
    assert not any(r.flips for r in official_results)
    assert max(r.mix_ratio for r in official_results) <= 0.05


def test_cli_trace_verify_official_passes(capsys):
    assert main(["trace", "verify", str(OFFICIAL)]) == 0
    out = capsys.readouterr().out
    assert "PASS" in out and "decode13" in out


def _corrupt(src: Path, dst: Path, key: str, fn) -> None:
    shutil.copytree(src, dst)
    with safe_open(str(src / "trace.safetensors"), "pt") as f:
        meta = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    tensors[key] = fn(tensors[key].clone())
    save_file(tensors, str(dst / "trace.safetensors"), metadata=meta)


def _flip_one(t: torch.Tensor) -> torch.Tensor:
    flat = t.view(-1)
    flat[3] = -flat[3] if flat[3] != 0 else 1.0
    return t


@pytest.mark.parametrize("key,expect,calls", [        # calls: replay up to the corrupted call
    ("decode05.layers.3.window_kv", "window_kv", 6),
    ("decode05.layers.1.compress_topk", "compress_topk", 6),   # an index source's: equal to its indexer_topk
    ("decode05.layers.3.compress_kv", "compress_kv", 6),
    ("prefill.layers.1.index_k", "index_k", 0),
    ("decode02.layers.6.attn_out", "attn_out", 3),
])
def test_corrupted_trace_fails(tmp_path, key, expect, calls, capsys):
    _corrupt(OFFICIAL, tmp_path / "bad", key, _flip_one)
    assert main(["trace", "verify", str(tmp_path / "bad"), "--quiet", "--calls", str(calls)]) == 1
    out = capsys.readouterr().out
    assert expect in out
    if expect == "attn_out":                       # the row is named (element 3 of the call's one row)
        assert "at row 0" in out


def test_wrong_topk_is_caught(tmp_path):
    def swap_to_worst(t):
        t[0, 0, 0] = (t[0, 0].max() + 1) % 41 if t[0, 0, 0] >= 0 else t[0, 0, 0]
        t[0, 0] = t[0, 0].sort().values
        return t
    _corrupt(OFFICIAL, tmp_path / "bad", "decode00.layers.3.indexer_topk", swap_to_worst)
    res = verify_trace(tmp_path / "bad", calls=1)
    assert any("top-k: 1 rows select different scores (rows 0)" in f for r in res for f in r.failures)


def test_missing_file_is_named(tmp_path, capsys):
    shutil.copytree(OFFICIAL, tmp_path / "t")
    (tmp_path / "t" / "trace.safetensors").unlink()
    assert main(["trace", "verify", str(tmp_path / "t")]) == 2
    captured = capsys.readouterr()
    assert "trace.safetensors" in captured.out + captured.err


def test_a_trace_tensor_of_the_wrong_size_is_named(tmp_path):
    _corrupt(OFFICIAL, tmp_path / "bad", "decode00.layers.2.attn_in", lambda t: t.reshape(-1)[:64].reshape(1, 1, 64))
    with pytest.raises(TraceError, match=r"trace.safetensors: decode00.layers.2.attn_in has shape \(1, 1, 64\); "
                                         r"the call's 1 x 1 rows of \d+ expected"):
        verify_trace(tmp_path / "bad", calls=1)


@pytest.mark.parametrize("calls", [-1, 1.5, True])
def test_calls_is_checked_before_the_trace_is_read(calls):
    with pytest.raises(ValueError, match=rf"calls must be a non-negative int, got {calls!r}"):
        verify_trace(OFFICIAL, calls=calls)


def test_record_then_verify_round_trip(tmp_path):
    out = tmp_path / "ours"
    assert main(["trace", "record", str(out), "--config", "tiny", "--prefill", "21", "--decode", "4",
                 "--batch", "2", "--seed", "5"]) == 0
    case = read_case(out / "trace.safetensors")
    assert case["calls"] == ["prefill", "decode00", "decode01", "decode02", "decode03"]
    assert case["batch"] == 2
    with safe_open(str(out / "trace.safetensors"), "pt") as f:
        keys = set(f.keys())
        # the official key set for every layer kind (ratio-2 latents only on group-completing calls)
        for name in ("block_in", "pre_mix_in", "attn_pre", "attn_post", "attn_comb", "attn_in", "attn_out",
                     "window_kv", "ffn_out", "block_out", "pre_mix_out"):
            assert f"decode03.layers.6.{name}" in keys
        assert "decode00.layers.1.compressor_latent" in keys      # position 21 completes a group
        assert "decode01.layers.1.compressor_latent" not in keys  # position 22 does not
        assert f.get_tensor("prefill.layers.3.candidates").shape == (2, 21, 21)
        assert f.get_tensor("prefill.layers.5.indexer_topk").shape == (2, 21, 8)
    res = verify_trace(out)
    assert not [f for r in res for f in r.failures]
    assert max(r.attn_out_ulp for r in res) == 0.0


def test_zero_head_padding_changes_no_output(official_results):
    """The step path pads official-tiny's 4 heads to 8; on the reference layers the padded
    checkpoint gives every attn_out of the prefill and the first decode call bit for bit."""
    notes = []
    padded = verify_trace(OFFICIAL, heads=8, calls=1, log=notes.append)
    assert len(notes) == 1 and "4 query heads padded to 8" in notes[0]
    plain = {(r.call, r.layer): r.attn_out for r in official_results}
    assert len(padded) == 2 * 7
    for r in padded:
        assert torch.equal(r.attn_out, plain[(r.call, r.layer)]), f"{r.call} layer {r.layer}"
        assert not r.failures


def test_quiet_prints_only_the_summary(tmp_path, capsys):
    def scale_all(t):   # layer 0's attn_out off by 1 %
        return (t.float() * 1.01).to(t.dtype)
    _corrupt(OFFICIAL, tmp_path / "bad", "decode00.layers.0.attn_out", scale_all)
    assert main(["trace", "verify", str(tmp_path / "bad"), "--quiet", "--calls", "1"]) == 1
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("FAIL") and "decode00 layer 0: attn_out" in lines[0]


def test_corrupted_mixer_coefficient_fails(tmp_path):
    """A coefficient 1e-4 off (the old fixed tolerance) is past its derived bound."""
    def nudge(t):
        t.view(-1)[5] += 1e-4
        return t
    _corrupt(OFFICIAL, tmp_path / "bad", "decode01.layers.2.attn_comb", nudge)
    res = verify_trace(tmp_path / "bad", calls=2)
    bad = [(r.call, r.layer) for r in res if any("mHC coefficients" in f for f in r.failures)]
    assert bad == [("decode01", 2)]


@pytest.mark.parametrize("key,value,expect", [
    ("decode01.layers.2.block_out", float("nan"), "boundary streams"),
    ("decode01.layers.2.block_out", float("inf"), "boundary streams"),
    ("decode01.layers.2.attn_comb", float("nan"), "mHC coefficients"),
    ("decode01.layers.2.attn_pre", float("nan"), "mHC coefficients"),
])
def test_a_non_finite_boundary_value_fails(tmp_path, key, value, expect):
    """A NaN or an infinity where the official run holds a number is past every tolerance (a
    maximum that let a NaN distance through would keep the old value and report 0 ulp)."""
    def poison(t):
        t.view(-1)[2] = value
        return t
    _corrupt(OFFICIAL, tmp_path / "bad", key, poison)
    res = verify_trace(tmp_path / "bad", calls=2)
    bad = [(r.call, r.layer) for r in res if any(expect in f for f in r.failures)]
    assert bad == [("decode01", 2)], [(r.call, r.layer, r.failures) for r in res if r.failures]


def test_ulp_distances_keep_non_finite_mismatches():
    from dsv41_decode.testing.compare import row_ulp_distance, ulp_distance
    big = torch.tensor([torch.finfo(torch.bfloat16).max], dtype=torch.bfloat16)
    inf, nan, one = (torch.tensor([v], dtype=torch.bfloat16) for v in (float("inf"), float("nan"), 1.0))
    assert ulp_distance(inf, big) == float("inf") and ulp_distance(-inf, inf) == float("inf")
    assert ulp_distance(nan, one) == float("inf") and ulp_distance(one, nan) == float("inf")
    assert ulp_distance(inf, inf) == 0 and ulp_distance(nan, nan) == 0
    assert ulp_distance(torch.tensor([1.0, 2.0]).bfloat16(), torch.tensor([1.0, 2.015625]).bfloat16()) == 1.0
    ref = torch.tensor([[1.0, 2.0, float("inf")]])
    assert row_ulp_distance(torch.tensor([[1.0, 2.0, float("inf")]]), ref) == 0.0
    assert row_ulp_distance(torch.tensor([[float("nan"), 2.0, float("inf")]]), ref) == float("inf")
    # the row's ulp comes from its finite values: an infinity does not make other errors vanish
    assert row_ulp_distance(torch.tensor([[1.0, 2.015625, float("inf")]]), ref) == 1.0


@pytest.mark.parametrize("collapse", ["zero", "coarse"])
def test_a_scorer_whose_scores_collapse_fails(monkeypatch, collapse):
    """Layer 1's index scores all 0, or rounded to their power of two: nearly every row then ties
    with the recorded selection, so the ties explain no longer a stray row and the layer fails."""
    import dsv41_decode.layer as layer_mod
    from dsv41_decode.testing.trace import TIE_SHARE
    ref_idx, orig_select = layer_mod.ref_idx, layer_mod.AttentionLayer._select
    good = ref_idx.index_scores

    def broken(iq, w, keys):
        f = good(iq, w, keys).float()
        if collapse == "zero":
            return torch.zeros_like(f)
        return (torch.sign(f) * torch.exp2(torch.floor(torch.log2(f.abs())))).nan_to_num(0.0)

    def select(self, *a, **k):
        if self.spec.layer == 1:
            monkeypatch.setattr(ref_idx, "index_scores", broken)
        try:
            return orig_select(self, *a, **k)
        finally:
            monkeypatch.setattr(ref_idx, "index_scores", good)
    monkeypatch.setattr(layer_mod.AttentionLayer, "_select", select)
    res = verify_trace(OFFICIAL)
    ties = sum(r.topk.get("tie", 0) for r in res if r.layer == 1)
    rows = sum(sum(r.topk.values()) for r in res if r.layer == 1)
    assert ties > rows // TIE_SHARE
    failed = [(r.call, r.layer) for r in res if any("differ by tied scores" in f for f in r.failures)]
    assert failed == [(res[-1].call, 1)], failed


def test_a_failure_names_its_row(tmp_path):
    """The prefill call's row 5 of layer 6 corrupted: the failure names row 5."""
    def flip_row5(t):
        rows = t.view(-1, t.shape[-1])
        rows[5, 3] = -rows[5, 3] if rows[5, 3] != 0 else 1.0
        return t
    _corrupt(OFFICIAL, tmp_path / "bad", "prefill.layers.6.attn_out", flip_row5)
    res = verify_trace(tmp_path / "bad", calls=0)
    assert [f for r in res for f in r.failures if r.layer == 6] and \
        all("at row 5" in f for r in res for f in r.failures if f.startswith("attn_out"))
