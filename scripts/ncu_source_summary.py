"""Summarize Nsight Compute's per-SASS-line warp-state samples of one kernel (CPU): where a launch's
warps spend their time, by how often each line ran and by stretches of the SASS.

Input: the CSV of `ncu -i REPORT.ncu-rep --page source --csv --print-source sass` for a report taken
with `--section SourceCounters` (e.g. of `scripts/ncu_gluon_sparse_mla.py`, whose docstring has the
profiling command). Each line's "Instructions Executed" counts warp-level executions; the lines that
ran as often as the most common count ran once a warp (code outside the loops, where every warp
passes once), those that ran more often are the loops', those that never ran hold the samples of
warps waiting at exit (the stores' drain).

    python scripts/ncu_source_summary.py pv2nd64_sass.csv [--window=60] [--top=4]

Prints the warp count (the most common execution count), the warp-instructions executed, the
samples; the share of samples and the leading stall reasons (percent of all samples) for the lines
run once a warp, repeatedly and never; then every stretch of `--window` SASS lines holding at least
1 % of the samples: its first line, its lines' most common execution count, its share, its leading
stall reasons and opcodes (`--top` of each).
"""

from __future__ import annotations

import csv
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _args import arg  # noqa: E402

from dsv41_decode.testing.sm90 import unpredicated  # noqa: E402

_SAMPLES = "Warp Stall Sampling (All Samples)"
_EXECUTED = "Instructions Executed"


def read_lines(path: str) -> list[dict]:
    """The CSV's SASS lines (dicts by column name), from the header row that starts with "Address"."""
    rows = list(csv.reader(open(path, newline="")))
    start = next((i for i, r in enumerate(rows) if r and r[0] == "Address"), None)
    if start is None:
        raise SystemExit(f"{path}: no 'Address' header row; expected `ncu --page source --csv --print-source sass`")
    head = rows[start]
    if _SAMPLES not in head or _EXECUTED not in head:
        raise SystemExit(f"{path}: no '{_SAMPLES}' or '{_EXECUTED}' column; profile with --section SourceCounters")
    return [dict(zip(head, r)) for r in rows[start + 1:] if len(r) == len(head)]


def _int(x: str) -> int:
    return int(x.replace(",", "")) if x else 0


def _opcode(source: str) -> str:
    words = unpredicated(source.strip()).split()
    return words[0].split(".")[0] if words else ""


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1].startswith("--"):
        raise SystemExit(__doc__)
    lines = read_lines(sys.argv[1])
    window, top = int(arg("window", "60")), int(arg("top", "4"))
    stalls = [k for k in lines[0] if k.startswith("stall_") and "Not Issued" not in k]
    executed = [_int(x[_EXECUTED]) for x in lines]
    samples = [_int(x[_SAMPLES]) for x in lines]
    total = sum(samples)
    if total == 0:
        raise SystemExit(f"{sys.argv[1]}: no warp-state samples")
    warps = Counter(e for e in executed if e > 0).most_common(1)[0][0]
    print(f"warps {warps} (the most common execution count), warp-instructions {sum(executed)}, samples {total}")

    def reasons(idx) -> str:
        c = Counter()
        for i in idx:
            for k in stalls:
                c[k] += _int(lines[i][k])
        return ", ".join(f"{k[6:]} {v / total * 100:.1f}" for k, v in c.most_common(top))

    for name, pick in (("once a warp", lambda e: e == warps), ("repeatedly", lambda e: e > warps),
                       ("never (exit)", lambda e: e == 0), ("fewer than once a warp", lambda e: 0 < e < warps)):
        idx = [i for i, e in enumerate(executed) if pick(e)]
        share = sum(samples[i] for i in idx) / total * 100
        if idx and share >= 0.5:
            print(f"  {name}: {len(idx)} lines, {share:.1f} % of samples ({reasons(idx)})")
    print(f"stretches of {window} lines with >= 1 % of the samples (first line, executions, share, stalls | opcodes):")
    for s in range(0, len(lines), window):
        idx = range(s, min(s + window, len(lines)))
        share = sum(samples[i] for i in idx) / total * 100
        if share < 1:
            continue
        runs = Counter(executed[i] for i in idx).most_common(1)[0][0]
        ops = Counter(_opcode(lines[i]["Source"]) for i in idx)
        print(f"  {s:5d} x{runs:<7d} {share:5.1f} %  {reasons(idx)} | {' '.join(o for o, _ in ops.most_common(top))}")


if __name__ == "__main__":
    main()
