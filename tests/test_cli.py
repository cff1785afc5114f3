"""The command line: the demo runs and prints its table; help and errors are usable."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from dsv41_decode.cli import main
from helpers import one_line_error


def test_demo_exits_0_and_prints_table(capsys):
    assert main(["demo"]) == 0
    out, err = capsys.readouterr()
    assert "decode vs prefill" in out
    # piped (captured) output: a progress line per call on stderr
    assert "demo: call 1/11: prefill, 4 request(s), 196 rows" in err and "demo: call 11/11" in err
    for kind in ("swa", "full", "full+cand", "reindex", "reuse"):
        assert kind in out
    assert "decode equals prefill at every decoded position" in out


def test_demo_tp2_runs_gloo_processes():
    # the rank processes print to their own stdout: run the CLI as a subprocess and read it
    r = subprocess.run([sys.executable, "-m", "dsv41_decode", "demo", "--tp", "2", "--config", "tiny",
                        "--prompts", "9,20", "--drafts", "1,0", "--steps", "3"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "tp=2 (gloo processes)" in r.stdout
    assert "decode equals prefill at every decoded position" in r.stdout
    assert "all 2 ranks hold the same outputs" in r.stdout


def test_demo_tp_that_does_not_split_is_rejected(capsys):
    assert main(["demo", "--tp", "3"]) == 2
    assert "8 heads do not split over tp=3 ranks" in one_line_error(capsys)


def test_python_dash_m_help_lists_commands():
    out = subprocess.run([sys.executable, "-m", "dsv41_decode", "--help"], capture_output=True, text=True,
                         check=True).stdout
    for cmd in ("demo", "trace", "plan"):
        assert cmd in out


@pytest.mark.parametrize("sub", [["demo"], ["trace", "verify"], ["trace", "record"], ["plan"]])
def test_every_subcommand_has_help(sub, capsys):
    with pytest.raises(SystemExit) as e:
        main(sub + ["--help"])
    assert e.value.code == 0
    assert "--" in capsys.readouterr().out


def test_plan_prints_flash_layers(capsys):
    assert main(["plan", "--config", "v41-flash"]) == 0
    out = capsys.readouterr().out
    assert " 20 full+cand r=1" in out and " 24 reindex" in out and " 39 reuse" in out


def test_bad_config_is_named(capsys):
    assert main(["plan", "--config", "no-such-preset-or-file"]) == 2
    assert "no-such-preset-or-file" in one_line_error(capsys)


def test_plot_committed_step_results(tmp_path, capsys):
    # re-plot committed `bench step` results on the CPU: a PNG per file, a clear error without one
    results = Path(__file__).resolve().parents[1] / "docs" / "results"
    for name in ("step-h200.jsonl", "step-tp2-h200.jsonl"):
        out = tmp_path / name.replace(".jsonl", ".png")
        assert main(["plot", str(results / name), "--out", str(out)]) == 0
        assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    capsys.readouterr()
    assert main(["plot", str(tmp_path / "missing.jsonl")]) == 2
    assert "missing.jsonl: no such results file" in one_line_error(capsys)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"case": {"op": "other"}}\n')
    assert main(["plot", str(bad)]) == 2
    assert "bad.jsonl: a line carries no 'bench' field" in one_line_error(capsys)


def test_bench_step_help_names_every_variant(capsys):
    from dsv41_decode.bench.step import DEFAULT_VARIANTS, VARIANTS
    with pytest.raises(SystemExit):
        main(["bench", "step", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert all(name in text for name in VARIANTS)
    assert f"default: {','.join(DEFAULT_VARIANTS)}" in text


def test_the_demos_verdict_counts_the_ranks():
    """The demo's exit status (`DemoResult.ok`) needs decode == prefill and, under TP, ranks that
    agree."""
    from dsv41_decode.demo import DemoResult, KindStats
    good = {"swa": KindStats(rows=3, bitwise=3)}
    assert DemoResult(good).ok and not DemoResult(good, ranks_same=False).ok
    assert not DemoResult({"swa": KindStats(rows=3, bitwise=2)}).ok
