"""The benchmarks' results format (architecture.md section 4), checked without a GPU."""

import json

from dsv41_decode.bench.gemm import flash_shapes, plot_gemm
from dsv41_decode.bench.results import format_table, record, write_jsonl
from dsv41_decode.bench.timing import l2_rotation

INFO = {"gpu": "NVIDIA H200", "commit": "abc1234", "date": "2026-11-30"}


def test_record_fields_and_arithmetic():
    r = record("gemm", {"op": "wq_b", "rows": 1}, us=20.0, nbytes=42e6, floor_gbps=4200.0,
               baselines={"cublas_bf16": 40.0}, info=INFO)
    assert set(r) >= {"bench", "case", "us", "gbps", "floor_us", "pct_floor", "baselines", "gpu", "commit", "date"}
    assert r["gbps"] == 2100.0                   # 42 MB in 20 us
    assert r["floor_us"] == 10.0 and r["pct_floor"] == 50.0
    assert "2.00" in format_table([r], ["op", "rows"])   # 2x faster than the baseline


def test_jsonl_and_plot(tmp_path):
    rows = [record("gemm", {"op": "wo_b", "tp": 1, "rows": m, "weight_mb": 42.0}, 10.0 + m, 42e6, 4200.0,
                   {"cublas_bf16": 30.0}, INFO) for m in (1, 2, 4)]
    path = write_jsonl(rows, tmp_path, "gemm")
    assert path.name == "gemm-h200.jsonl"
    assert [json.loads(l)["case"]["rows"] for l in path.read_text().splitlines()] == [1, 2, 4]
    plot_gemm(rows, path.with_suffix(".png"), 4200.0)
    assert path.with_suffix(".png").stat().st_size > 1000


def test_flash_shapes_bytes():
    shapes = {(s.label, s.tp): s for s in flash_shapes()}
    assert shapes[("wq_b", 1)].weight_bytes() == 32768 * 1280 + 1024 * 40
    assert shapes[("wo_a", 8)].groups == 1 and shapes[("wo_a_bf16", 1)].weight_bytes() == 8 * 1024 * 4096 * 2
    assert shapes[("wk", 1)].weight_bytes() == 128 * 512 * 2 and shapes[("compressor_r2", 1)].weight_bytes() == 1024 * 5120 * 4
    assert l2_rotation(42_000_000, l2_bytes=50_000_000) == 4


def test_attn_plot_from_committed_records(tmp_path):
    """The committed `bench attn` records hold every family the PNG draws, and it renders them."""
    from pathlib import Path

    from dsv41_decode.bench.attn_plot import plot_attn
    lines = (Path(__file__).parent.parent / "docs/results/attn-h200.jsonl").read_text().splitlines()
    rows = [json.loads(l) for l in lines]
    assert {r["case"]["op"] for r in rows} >= {"sparse_mla", "indexer_logits", "topk512"}
    assert all("bf16_path" in r["baselines"] for r in rows if r["case"]["op"] == "indexer_logits")
    plot_attn(rows, tmp_path / "attn.png")
    assert (tmp_path / "attn.png").stat().st_size > 1000


def test_step_weight_bytes_counts_the_fp8_wo_a_a_step_reads(tmp_path):
    """The FP8-wo_a headline's floor: the stack's bytes with each layer's BF16 wo_a replaced by the
    step's FP8 copy and its UE8M0 scales (one byte per 32 x 32 block)."""
    import torch
    from helpers import reduced_config
    from dsv41_decode.bench.step import step_weight_bytes, weight_bytes
    from dsv41_decode.stack import AttentionStack
    from dsv41_decode.state import DecodeState
    from dsv41_decode.weights import load_checkpoint, write_synthetic_checkpoint
    cfg = reduced_config()
    stack = AttentionStack(load_checkpoint(write_synthetic_checkpoint(cfg, tmp_path, seed=1)))
    state = DecodeState(cfg, max_requests=1, max_context=16, page_size=4, stage_rows=1)
    plain = stack.decode_step(state, max_rows=1, graphs=False)
    fp8 = stack.decode_step(state, max_rows=1, graphs=False, wo_a_fp8=True)
    assert step_weight_bytes(plain, stack) == weight_bytes(stack)
    wo_a = [layer.w["attn.wo_a.weight"] for layer in stack.layers.values()]
    assert all(w.dtype == torch.bfloat16 for w in wo_a)
    saved = sum(w.numel() * 2 - w.numel() - (w.shape[0] // 32) * (w.shape[1] // 32) for w in wo_a)
    assert weight_bytes(stack) - step_weight_bytes(fp8, stack) == saved


def test_timeline_layer_ends_with_the_boundary_or_a_folded_wo_b():
    # A layer ends with the first mhc_boundary kernel after its wo_a, or, where the boundary runs in
    # wo_b's epilogue, with the first kernel to start after its wo_a (the side lanes' kernels that
    # start during wo_a do not count).
    from dsv41_decode.bench.step_timeline import _layer_ends

    def k(name, ts, dur=1.0):
        return {"name": name, "ts": ts, "dur": dur}
    apart = [k("mhc_enter", 0), k("wo_a", 10, 5), k("mix", 12, 9), k("wo_b", 16), k("mhc_boundary_split", 18),
             k("wo_a", 30, 5), k("wo_b", 36), k("mhc_boundary_split", 38)]
    assert [e["ts"] for e in _layer_ends(apart)] == [18, 38]
    folded = [k("mhc_enter", 0), k("wo_a", 10, 5), k("mix", 12, 9), k("wo_b", 16), k("wo_a", 30, 5), k("wo_b", 36)]
    assert [e["ts"] for e in _layer_ends(folded)] == [16, 36]
    # with streams: a side lane's kernel starting between wo_a and wo_b is not the layer's end
    on = [dict(e, args={"stream": 7 if e["name"] in ("wo_a", "wo_b") else 9}) for e in folded]
    on.insert(3, {"name": "topk", "ts": 15.5, "dur": 1.0, "args": {"stream": 9}})
    assert [e["ts"] for e in _layer_ends(on)] == [16, 36]
