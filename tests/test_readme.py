"""The README's two commands, the CI script and the CPU pins cannot drift apart."""

from __future__ import annotations

import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _command(heading: str) -> str:
    """The single line of the first code block after the bold heading `heading` in the README."""
    text = (ROOT / "README.md").read_text()
    m = re.search(rf"\*\*{re.escape(heading)}\*\*\s*```[a-z]*\n(.*?)```", text, re.S)
    assert m, f"README.md has no code block under **{heading}**"
    lines = [ln for ln in m.group(1).splitlines() if ln.strip()]
    assert len(lines) == 1, f"README.md: the {heading!r} block must hold one command line, got {lines}"
    return lines[0]


def test_ci_runs_the_readme_test_command_verbatim():
    cmd = _command("Run the tests")
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert cmd in ci, f".ci/run does not contain the README's test command line:\n{cmd}"


def test_ci_script_is_executable_bash_with_strict_mode():
    ci = ROOT / ".ci" / "run"
    assert os.access(ci, os.X_OK), ".ci/run is not executable"
    text = ci.read_text()
    assert text.startswith("#!/usr/bin/env bash\n")
    assert "set -euo pipefail" in text


def test_both_commands_install_the_cpu_pins():
    for heading, tail in (("Run the demo", "dsv41-decode demo"), ("Run the tests", "python -m pytest -q")):
        cmd = _command(heading)
        assert "pip install -r requirements-cpu.txt -e ." in cmd, heading
        assert cmd.endswith(tail), heading


def test_cpu_pins():
    pins = {}
    for ln in (ROOT / "requirements-cpu.txt").read_text().splitlines():
        ln = ln.split("#")[0].strip()
        if ln:
            name, _, version = ln.partition("==")
            assert version, f"requirements-cpu.txt: {ln!r} is not an exact pin"
            pins[name] = version
    assert pins["torch"] == "2.13.0"  # the CPU build on local disk; anything else downloads CUDA
    assert pins["triton"] == "3.6.0"
    major, minor = (int(x) for x in pins["numpy"].split(".")[:2])
    assert (major, minor) < (2, 4), "numpy 2.4 breaks the Triton 3.6 interpreter"
    assert {"safetensors", "rich", "matplotlib", "pytest"} <= set(pins)


def test_readme_keeps_the_trace_format_marker_and_the_knobs_table():
    text = (ROOT / "README.md").read_text()
    assert "## Golden trace format" in text
    assert "## Environment knobs" in text and "`TRITON_INTERPRET`" in text
    assert "`<what>_<dtype>[_<variant>]`" in text


def test_python_api_example_runs(tmp_path, monkeypatch):
    # the README's Python API block, as a user would paste it (on a GPU it runs the specialized step)
    text = (ROOT / "README.md").read_text()
    m = re.search(r"## Python API\n.*?```python\n(.*?)```", text, re.S)
    assert m, "README.md has no python block under ## Python API"
    monkeypatch.chdir(tmp_path)
    exec(compile(m.group(1), "README.md (Python API)", "exec"), {"__name__": "readme_example"})
    assert (tmp_path / "ckpt-small" / "config.json").is_file()


def test_public_api_is_lazy_and_complete():
    import subprocess
    import sys

    import dsv41_decode as dd
    code = "import sys, dsv41_decode; assert 'torch' not in sys.modules, 'import dsv41_decode imported torch'"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert all(getattr(dd, n) is not None for n in dd.__all__) and len(dd.__all__) >= 17
    assert dd.DecodeState.__module__ == "dsv41_decode.state" and "load_checkpoint" in dir(dd)
