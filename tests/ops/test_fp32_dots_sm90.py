"""The exact step's FP32 dots compiled for sm_90 (no GPU: Triton's own ptxas, in subprocesses without
the interpreter, tests/ops/_fp32_dots_sm90.py): the sparse MLA with `FP32_STEP_TILING` and the
grouped wo_a with `ieee_dot` at its launch tiles."""

import json
import subprocess
import sys
from pathlib import Path
from helpers import compile_env


def test_fp32_dots_compile_for_sm90_without_spills():
    """No local memory, no stack and no spill stores or loads; the dots are FMAs, no MMA of any kind
    (what makes their sums FP32 round-to-nearest ones). The two kernels compile in parallel
    subprocesses (~20 s for the sparse MLA, ~10 s for the six wo_a tiles)."""
    env = compile_env()
    script = str(Path(__file__).with_name("_fp32_dots_sm90.py"))
    procs = [subprocess.Popen([sys.executable, script, which], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=env) for which in ("sparse_mla", "wo_a")]
    rows = []
    for p in procs:
        out, err = p.communicate(timeout=600)
        assert p.returncode == 0, out + err[-3000:]
        rows += [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    names = [r["name"] for r in rows]
    assert len(rows) == 7 and sum(n.startswith("wo_a") for n in names) == 6, names
    for r in rows:
        assert r["LOCAL"] == 0 and r["STACK"] == 0 and r["spills"] == 0, r
        assert r["mma"] == 0 and r["ffma"] > 0, r
