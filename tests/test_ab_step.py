"""scripts/ab_step.py's pieces that run without a GPU: the probe's command line per process, the
summary of the processes' times and bits, its refusals (a directory that is not a source tree, a
malformed --env), and the probe's refusal of its one-process outputs with --processes=1."""

import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import ab_step  # noqa: E402


def test_probe_command_names_the_tree_the_process_and_its_outputs(tmp_path):
    cmd = ab_step.probe_command(Path("/t/b"), "B2", "1,8", tmp_path, "")
    assert cmd[1] == "/t/b/scripts/probe_step_schedule.py"
    assert "--variants=default" in cmd and "--rows=1,8" in cmd
    assert f"--out-bits={tmp_path / 'B2.safetensors'}" in cmd and f"--out-times={tmp_path / 'B2.json'}" in cmd
    assert not any(a.startswith("--timeline") for a in cmd)
    assert ab_step.probe_command(Path("/t/a"), "A1", "1", tmp_path, "/tl")[-1] == "--timeline=/tl/A1"


def test_summary_takes_medians_per_row_count_in_process_order():
    times = {"A1": {"1": [100.0], "8": [200.0]}, "B1": {"1": [98.0], "8": [202.0]},
             "A2": {"1": [102.0], "8": [204.0]}, "B2": {"1": [99.0], "8": [206.0]},
             "A3": {"1": [101.0], "8": [203.0]}, "B3": {"1": [97.0], "8": [201.0]}}
    lines, record = ab_step.summarize(times, {t: True for t in times})
    one = record["rows"]["1"]
    assert one["A"] == [100.0, 102.0, 101.0] and one["B"] == [98.0, 99.0, 97.0]
    assert one["median_A"] == 101.0 and one["median_B"] == 98.0
    assert one["B_vs_A_percent"] == pytest.approx(100 * (98 / 101 - 1), abs=1e-3)
    assert record["rows"]["8"]["median_A"] == 203.0 and record["rows"]["8"]["median_B"] == 202.0
    assert lines[0].startswith("  1 rows: A 100.0 / 102.0 / 101.0  B 98.0 / 99.0 / 97.0")
    assert "-2.97 %" in lines[0] and lines[-1] == "every output A1's bits"


def test_summary_names_the_processes_whose_bits_differ():
    times = {"A1": {"1": [1.0]}, "B1": {"1": [1.0]}}
    lines, record = ab_step.summarize(times, {"A1": True, "B1": False})
    assert lines[-1] == "outputs differing from A1's: B1"
    assert record["bitwise_equal_to_A1"] == {"A1": True, "B1": False}


def test_a_directory_without_the_probe_is_refused(tmp_path, monkeypatch):
    (tmp_path / "dsv41_decode").mkdir()
    monkeypatch.setattr(sys, "argv", ["ab_step.py", str(tmp_path), str(tmp_path)])
    with pytest.raises(SystemExit, match="not a source tree"):
        ab_step.main()
    monkeypatch.setattr(sys, "argv", ["ab_step.py", str(tmp_path)])
    with pytest.raises(SystemExit, match="A_DIR B_DIR"):
        ab_step.main()


def test_env_options_parse_and_refuse_entries_without_a_key():
    assert ab_step.env_option("CUDA_DEVICE_MAX_CONNECTIONS=32,X=", "env-b") == {"CUDA_DEVICE_MAX_CONNECTIONS": "32", "X": ""}
    assert ab_step.env_option("", "env-a") == {}
    with pytest.raises(SystemExit, match="--env-b: expected KEY=VALUE"):
        ab_step.env_option("CUDA_DEVICE_MAX_CONNECTIONS", "env-b")
    with pytest.raises(SystemExit, match="--env-a"):
        ab_step.env_option("=3", "env-a")


def test_the_probe_refuses_its_one_process_outputs_with_processes():
    """What ab_step reads (--out-times, --out-bits) is one process's: the probe refuses them with
    --processes=1 before it builds anything (so on the CPU too)."""
    probe = Path(__file__).resolve().parents[1] / "scripts" / "probe_step_schedule.py"
    done = subprocess.run([sys.executable, str(probe), "--variants=default", "--processes=1", "--out-times=t.json"],
                          capture_output=True, text=True, cwd=probe.parents[1])
    assert done.returncode != 0 and "--out-times / --out-bits write one process's results" in done.stderr


def test_times_from_the_printed_line_of_an_older_probe():
    """An older tree's probe ignores --out-times: its default line gives the times (run FO's line)."""
    text = ("stream priority range (least, greatest): (0, -3)\n"
            "default        capture -1 lanes (-1, 0, -1) | 1:   3744.9  2:   4373.8  8:   4958.9 us | 8-row output "
            "== first variant's: - | 1980 MHz, 41 C, 261 W\n")
    assert ab_step.times_from_line(text) == {"1": [3744.9], "2": [4373.8], "8": [4958.9]}
    assert ab_step.times_from_line(text.replace("default  ", "flat     ")) is None
    assert ab_step.times_from_line("default | no times here | x") is None
    assert ab_step.times_from_line("") is None
