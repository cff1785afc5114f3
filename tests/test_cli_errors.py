"""The command line's failures: one line on stderr naming the culprit, exit 2 for usage errors and 1
for failures while running, no traceback unless --debug; trace record never overwrites or leaves
half-written folders; trace verify --quiet prints its summary. All in-process and fast."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from dsv41_decode import __version__
from dsv41_decode.cli import exactness_hint, main
from helpers import one_line_error
from dsv41_decode.config import ModelConfig
from dsv41_decode.runtime import MAX_THREADS, cpu_threads
from dsv41_decode.weights import CheckpointError, write_synthetic_checkpoint

CUDA = torch.cuda.is_available()
STEP_RESULTS = str(Path(__file__).resolve().parents[1] / "docs" / "results" / "step-h200.jsonl")


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"dsv41-decode {__version__}"


USAGE = [
    (["demo", "--steps", "0"], "argument --steps: expected an integer >= 1, got 0"),
    (["demo", "--tp", "0"], "argument --tp: expected an integer >= 1, got 0"),
    (["demo", "--prompts", "0,3", "--drafts", "0,0"], "argument --prompts: expected integers >= 1, got 0"),
    (["demo", "--prompts", "x"], "argument --prompts: expected comma-separated integers, got 'x'"),
    (["demo", "--prompts", "3,4", "--drafts", "1"], "--drafts: needs one entry per --prompts entry (2), got 1"),
    (["demo", "--device", "tpu"], "argument --device: expected cpu, cuda or cuda:N, got 'tpu'"),
    (["demo", "--tp", "2", "--device", "cuda"], "--device cuda" if not CUDA else "--tp: runs gloo processes"),
    (["demo", "--checkpoint", "/no/such/folder"], "--checkpoint /no/such/folder: no such folder"),
    (["demo", "--config", "nope"], "no config file at nope/config.json" if Path("nope").is_dir() else "nope"),
    (["nonsense"], "invalid choice: 'nonsense'"),
    (["demo", "--frobnicate"], "unrecognized arguments: --frobnicate"),
    (["trace", "verify", "/no/such/trace"], "/no/such/trace: not a trace folder: missing config.json"),
    (["trace", "record", "x", "--prefill", "0"], "argument --prefill: expected an integer >= 1, got 0"),
    (["trace", "record", "/no/such/parent/out"], "its parent folder /no/such/parent does not exist"),
    (["plan", "--config", "no-such-preset"],
     "config 'no-such-preset': not a preset (v41-flash, tiny, small) and no such file or folder"),
    (["plan", "--config", str(Path(__file__).resolve().parent / "data")],
     "config.json"),
    (["plan", "--config", ""], "config: empty; give a preset (v41-flash, tiny, small)"),
    (["plot", "/no/such.jsonl"], "/no/such.jsonl: no such results file"),
    (["plot", STEP_RESULTS, "--out", "/no/such/dir/x.png"], "--out /no/such/dir/x.png: no such folder /no/such/dir"),
    (["plot", STEP_RESULTS, "--out", "/tmp"], "--out /tmp: a folder; give the image's file name"),
    (["bench", "attn", "--families", "sparse_mla,bogus"], "unknown name 'bogus'; choose from sparse_mla"),
    (["bench", "gemm", "--rows", "1,0"], "argument --rows: expected integers >= 1, got 0"),
    (["bench", "step", "--variants", "fuse_scales,pair_slotz"], "--variants: unknown variant 'pair_slotz'; choose from"),
    (["bench", "step", "--tp", "2", "--variants", "tc_linears"], "--variants: not taken with --tp 2"),
    (["bench", "step", "--tp", "2", "--generic-contexts", "4096"], "--generic-contexts: not taken with --tp 2"),
    (["bench", "step", "--contexts", "32768", "--generic-contexts", "4096", "--variants", "no_overlap,same"],
     "--variants: same runs at the --generic-contexts only (4096), none of which is among the contexts "
     "benched (32768)"),
]
if not CUDA:
    USAGE += [(["demo", "--device", "cuda"], "--device cuda: CUDA is not available"),
              (["bench", "gemm"], "bench gemm needs a CUDA GPU; none is visible"),
              # the default variants outside the generic contexts: dropped, no refusal
              (["bench", "step", "--contexts", "4096"], "bench step needs a CUDA GPU; none is visible")]


@pytest.mark.parametrize("argv,msg", USAGE, ids=[" ".join(a) for a, _ in USAGE])
def test_usage_errors_exit_2_with_one_line(argv, msg, capsys):
    assert main(argv) == 2
    line = one_line_error(capsys)
    assert line.startswith("dsv41-decode") and msg in line, line


@pytest.fixture(scope="module")
def trace_dir(tmp_path_factory) -> Path:
    """A short recorded trace of the tiny preset (2 calls)."""
    out = tmp_path_factory.mktemp("rec") / "trace"
    assert main(["trace", "record", str(out), "--prefill", "5", "--decode", "1"]) == 0
    return out


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _rewrite_trace(folder: Path, edit) -> None:
    path = folder / "trace.safetensors"
    with safe_open(str(path), framework="pt") as f:
        meta, t = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    edit(t)
    save_file(t, str(path), metadata=meta)


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])


def test_record_progress_and_files(trace_dir, capsys):
    assert sorted(p.name for p in trace_dir.iterdir()) == ["config.json", "model.safetensors", "trace.safetensors"]
    assert not [p for p in trace_dir.parent.iterdir() if p.name.startswith(".")]   # no partial folder left


def test_record_refuses_a_non_empty_folder_and_force_replaces_it(trace_dir, tmp_path, capsys):
    out = _copy(trace_dir, tmp_path / "golden")
    (out / "README.md").write_text("a golden case")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert main(["trace", "record", str(out), "--prefill", "4", "--decode", "0"]) == 2
    assert "golden: folder is not empty (4 entries: README.md, config.json" in one_line_error(capsys)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before            # untouched
    assert main(["trace", "record", str(out), "--prefill", "4", "--decode", "1", "--force"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "trace.safetensors"]
    out_, err = capsys.readouterr()
    assert "trace record: call 1/2: prefill" in err and "trace record: call 2/2: decode00" in err
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["trace", "record", str(empty), "--prefill", "4", "--decode", "0"]) == 0   # an empty OUT is fine


def test_record_failure_leaves_nothing_behind(tmp_path, monkeypatch, capsys):
    import dsv41_decode.testing.record as record

    def fail(ckpt, out, *a, **k):
        (Path(out) / "trace.safetensors").write_bytes(b"half")
        raise RuntimeError("disk full")
    monkeypatch.setattr(record, "record_trace", fail)
    out = tmp_path / "new"
    assert main(["trace", "record", str(out)]) == 1
    assert "RuntimeError: disk full (--debug shows the traceback)" in one_line_error(capsys)
    assert list(tmp_path.iterdir()) == []                                       # neither OUT nor a partial folder
    old = tmp_path / "old"
    old.mkdir()
    (old / "keep.txt").write_text("x")
    assert main(["trace", "record", str(old), "--force"]) == 1
    capsys.readouterr()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old"] and (old / "keep.txt").read_text() == "x"


def test_verify_quiet_prints_only_its_summary(trace_dir, tmp_path, capsys):
    assert main(["trace", "verify", str(trace_dir), "--quiet"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("PASS") and "2 calls x 7 layers" in out and len(out.strip().splitlines()) == 1, out
    assert not err
    bad = _copy(trace_dir, tmp_path / "bad")

    def perturb(t):
        for L in (1, 3):
            t[f"decode00.layers.{L}.attn_out"] = t[f"decode00.layers.{L}.attn_out"] * 1.5
    _rewrite_trace(bad, perturb)
    assert main(["trace", "verify", str(bad), "--quiet"]) == 1
    out, err = capsys.readouterr()
    lines = out.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("FAIL") and "failure(s) in 2 of 14 call-layers" in lines[0] \
        and "first: decode00 layer 1: attn_out" in lines[0], out
    assert main(["trace", "verify", str(bad)]) == 1
    out, err = capsys.readouterr()
    assert "FAIL decode00 layer 3: attn_out" in out and "failure(s) in 2 of 14" in out.strip().splitlines()[-1]
    assert "trace verify: layer 14/14" in err                                    # progress when piped


def test_verify_refuses_more_calls_than_the_trace_holds(trace_dir, capsys):
    assert main(["trace", "verify", str(trace_dir), "--calls", "1", "--quiet"]) == 0      # all it holds
    capsys.readouterr()
    assert main(["trace", "verify", str(trace_dir), "--calls", "2", "--quiet"]) == 2      # a usage error
    assert "--calls 2: the trace holds 1 calls after the first" in one_line_error(capsys)


def test_plot_names_a_bad_results_line_once(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json\n")
    assert main(["plot", str(bad)]) == 2
    line = one_line_error(capsys)
    assert line.count("bad.jsonl") == 1, line


@pytest.mark.parametrize("line,field", [('{"bench": "step"}', "no field 'case'"),
                                        ('{"bench": "step", "case": "x"}', "a field of another form")])
def test_plot_names_a_row_without_its_bench_fields(tmp_path, capsys, line, field):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(line + "\n")
    assert main(["plot", str(bad)]) == 2
    msg = one_line_error(capsys)
    assert f"bad.jsonl: a step row with {field}" in msg and "not the rows dsv41-decode bench step writes" in msg, msg


def test_plot_says_the_file_it_wrote(tmp_path, capsys):
    # the committed step results' 1-row lines (matplotlib adds ".png" to a name without a suffix)
    lines = [ln for ln in Path(STEP_RESULTS).read_text().splitlines() if '"rows": 1,' in ln]
    results = tmp_path / "step.jsonl"
    results.write_text("\n".join(lines) + "\n")
    assert main(["plot", str(results), "--out", str(tmp_path / "x")]) == 0
    assert f"wrote {tmp_path / 'x.png'}" in capsys.readouterr().out
    assert (tmp_path / "x.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_verify_hints_at_the_tc_linears_only_for_the_step_on_a_gpu():
    # a failing step run on a GPU with --tc-linears gets one line naming the option (the tensor
    # cores' truncated block sums, spec decision 38); the reference path, the CPU (whose
    # interpreter dots are exact) and the default exact linears get none
    for device in ("cuda", "cuda:1"):
        hint = exactness_hint("step", device, True)
        assert "--tc-linears" in hint and "truncate" in hint and "\n" not in hint
    assert exactness_hint("reference", "cuda", True) is None
    assert exactness_hint("step", "cpu", True) is None
    assert exactness_hint("step", "cuda", False) is None


def test_verify_names_a_truncated_or_incomplete_file(trace_dir, tmp_path, capsys):
    trunc = _copy(trace_dir, tmp_path / "trunc")
    _truncate(trunc / "trace.safetensors")
    assert main(["trace", "verify", str(trunc)]) == 1
    assert "trunc/trace.safetensors: not a readable safetensors file (truncated or corrupt?)" in one_line_error(capsys)
    missing = _copy(trace_dir, tmp_path / "missing")
    _rewrite_trace(missing, lambda t: t.pop("decode00.layers.2.window_kv"))
    assert main(["trace", "verify", str(missing)]) == 1
    assert "missing/trace.safetensors: missing tensor decode00.layers.2.window_kv;" in one_line_error(capsys)
    ck = _copy(trace_dir, tmp_path / "ck")
    _truncate(ck / "model.safetensors")
    assert main(["trace", "verify", str(ck)]) == 1
    assert "ck/model.safetensors: not a readable safetensors file" in one_line_error(capsys)


def test_demo_checkpoint_errors_and_debug(tmp_path, capsys):
    ck = write_synthetic_checkpoint(ModelConfig.preset("tiny"), tmp_path / "ck")
    _truncate(ck / "model.safetensors")
    assert main(["demo", "--checkpoint", str(ck)]) == 1
    assert "ck/model.safetensors: not a readable safetensors file" in one_line_error(capsys)
    with pytest.raises(CheckpointError):
        main(["demo", "--checkpoint", str(ck), "--debug"])
    capsys.readouterr()
    (ck / "config.json").unlink()
    assert main(["demo", "--checkpoint", str(ck)]) == 2
    assert "no config.json in it (or give --config)" in one_line_error(capsys)
    # a missing weight file is a missing input file too (usage, 2), like the missing config
    (ck / "model.safetensors").unlink()
    for argv in (["demo", "--checkpoint", str(ck), "--config", "tiny"],
                 ["trace", "record", str(tmp_path / "rec"), "--checkpoint", str(ck), "--config", "tiny"]):
        assert main(argv) == 2
        assert "no model.safetensors, model.safetensors.index.json or *.safetensors shard in it" in \
            one_line_error(capsys)


def test_demo_with_a_checkpoint_folder(tmp_path, capsys):
    ck = write_synthetic_checkpoint(ModelConfig.preset("tiny"), tmp_path / "ck", seed=4, shards=2)
    assert main(["demo", "--checkpoint", str(ck), "--prompts", "9,4", "--drafts", "1,0", "--steps", "2"]) == 0
    out, _ = capsys.readouterr()
    assert "7 layers, 2 requests, 2 steps" in out and "decode equals prefill at every decoded position" in out


def test_thread_count(monkeypatch):
    assert cpu_threads(3) == (3, "--threads")
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert cpu_threads() == (2, "OMP_NUM_THREADS")
    monkeypatch.delenv("OMP_NUM_THREADS")
    n, why = cpu_threads()
    assert 1 <= n <= MAX_THREADS and why.startswith(f"min({MAX_THREADS}, ")
    before = torch.get_num_threads()
    assert main(["trace", "verify", "/no/such/trace", "--threads", str(before + 1)]) == 2
    assert torch.get_num_threads() == before                                    # main restores it


def test_plan_prints_a_legend(capsys):
    assert main(["plan", "--config", "small"]) == 0
    out = capsys.readouterr().out
    for key in ("r=", "kv_src=", "idx_src="):
        assert f"\n  {key}" in out, key


@pytest.mark.parametrize("name", ["gemm-h200", "attn-h200"])
def test_plot_gemm_and_attn_results(name, tmp_path):
    # the committed results' first ops only (a plot of all 28 gemm panels takes seconds)
    lines = (Path(__file__).resolve().parents[1] / "docs" / "results" / f"{name}.jsonl").read_text().splitlines()
    ops = list(dict.fromkeys(json.loads(ln)["case"]["op"] for ln in lines))[:3]
    results = tmp_path / f"{name}.jsonl"
    results.write_text("\n".join(ln for ln in lines if json.loads(ln)["case"]["op"] in ops))
    out = tmp_path / f"{name}.png"
    assert main(["plot", str(results), "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_every_argument_has_help():
    import argparse

    from dsv41_decode.cli_args import build_parser as _parser

    def walk(p, path):
        for a in p._actions:
            if isinstance(a, argparse._SubParsersAction):
                for name, sub in a.choices.items():
                    yield from walk(sub, path + [name])
            elif not isinstance(a, (argparse._HelpAction, argparse._VersionAction)):
                yield " ".join(path), a
    missing = [f"{cmd}: {a.dest}" for cmd, a in walk(_parser(), []) if not a.help]
    assert not missing, missing
