"""Where each layer's time goes (`bench.step_timeline.layer_groups`: `bench step`'s timeline and
scripts/probe_step_kernels.py --layers), on a synthetic profiler trace: the layers cut at their
boundary kernels, grouped by whether they score the indexer, each kernel's median start, end and
duration from its layer's boundary."""

import pytest

from dsv41_decode.bench.step_timeline import format_layer_groups, layer_groups


def _k(name, ts, dur, grid=(1, 1, 1)):
    return {"name": name, "ts": float(ts), "dur": float(dur), "args": {"grid": list(grid)}}


def _trace():
    return [
        _k("_step_rows_kernel", 0, 2),                                   # the step's head
        _k("_mhc_boundary_kernel", 10, 8),                               # layer 1 (entry boundary)
        _k("_exact_mm_kernel", 18, 6, (896, 1, 1)), _k("_rms_norm_pair_kernel", 24, 3, (1, 2, 1)),
        _k("_gluon_wo_a_kernel", 28, 2, (128, 2, 1)), _k("_exact_mm_kernel", 30, 10, (2560, 1, 1)),
        _k("_mhc_boundary_coresident_kernel", 100, 4, (1, 10, 1)),       # layer 2: the indexer
        _k("_exact_mm_kernel", 101, 9, (896, 1, 1)), _k("_gluon_index_scores_kernel", 120, 9, (1, 528, 1)),
        _k("_lo_select_kernel", 130, 5), _k("_lo_select_kernel", 136, 4), _k("_gluon_wo_a_kernel", 150, 5),
        _k("_mhc_boundary_coresident_kernel", 220, 4, (1, 10, 1)),       # layer 3
        _k("_exact_mm_kernel", 222, 8, (896, 1, 1)), _k("_rms_norm_pair_kernel", 232, 5, (1, 2, 1)),
        _k("_gluon_wo_a_kernel", 238, 1), _k("_exact_mm_kernel", 240, 20, (2560, 1, 1)),
        _k("_mhc_boundary_coresident_kernel", 270, 6, (1, 10, 1)),       # the step's last boundary
    ]


def test_layers_are_cut_at_the_boundaries_and_grouped_by_the_indexer():
    table = layer_groups(list(reversed(_trace())))           # any order: sorted by start
    assert set(table) == {"head", "without the indexer", "with the indexer", "tail"}
    plain, idx = table["without the indexer"], table["with the indexer"]
    assert plain["layers"] == 2 and idx["layers"] == 1 and table["head"]["layers"] == 1
    assert plain["span"] == pytest.approx((90 + 50) / 2)        # 10 -> 100 and 220 -> 270
    assert idx["span"] == 120 and table["head"]["span"] == 10
    assert table["tail"]["layers"] == 1 and table["tail"]["span"] == 6     # the last boundary alone
    qkv = plain["kernels"]["_exact_mm_kernel [896,1,1]"]
    assert qkv == pytest.approx((5.0, 12.0, 7.0, 2))            # starts 8 / 2, ends 14 / 10, lasts 6 / 8
    assert plain["kernels"]["_mhc_boundary_kernel [1,1,1]"][3] == 1
    assert list(idx["kernels"])[-2:] == ["_lo_select_kernel [1,1,1] #2", "_gluon_wo_a_kernel [1,1,1]"]   # by start
    assert idx["kernels"]["_lo_select_kernel [1,1,1] #2"] == pytest.approx((36.0, 40.0, 4.0, 1))


def test_the_text_names_each_group_and_kernel():
    lines = format_layer_groups(layer_groups(_trace()))
    assert "with the indexer: 1 layer(s), median span 120.0 us" in lines
    assert any(line.split()[:3] == ["_lo_select_kernel", "[1,1,1]", "#2"] and line.split()[-4:] == ["36.0", "40.0",
                                                                                                      "4.0", "1"]
               for line in lines)


def test_a_trace_without_boundaries_gives_no_table():
    assert layer_groups([_k("_step_rows_kernel", 0, 2), _k("_exact_mm_kernel", 3, 4)]) == {}


def test_boundaries_that_do_not_delimit_the_layers_give_no_table():
    """The boundary in wo_b's epilogue: only the entry boundary launches, so the span after it holds
    every layer's wo_a."""
    folded = [e for e in _trace() if "coresident" not in e["name"]]
    assert layer_groups(folded) == {}
