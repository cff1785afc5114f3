"""The decode step of two source trees against each other (GPU): `scripts/probe_step_schedule.py`'s
default (the 40-layer step as built, 32K, graph replay) run in each tree, every timing in a fresh
process of its own, the trees alternated A B A B ... (`--pairs=`), and every process's 8-row output
compared bitwise with the first A process's. What a branch's change does to the step: within one
process later recaptures drift slower (docs/step.md), and the probe's variants patch one tree's
objects, not another tree's kernels.

    python scripts/ab_step.py A_DIR B_DIR [--rows=1,8] [--pairs=2] [--timeline=DIR] [--out=DIR]
        [--env-a=K=V,...] [--env-b=K=V,...]

A_DIR, B_DIR: source trees, each with `dsv41_decode/` and `scripts/` (a `git worktree`, or `git
archive REV | tar -x -C DIR`), each process run in its tree with PYTHONPATH=<tree>. Prints every
process's probe line, then per row count the A and B times, their medians and B/A, and whether every
output is A1's bits; writes DIR/ab.json (`--out=`, default a temporary directory, removed) and,
with `--timeline=DIR`, the first pair's 1-row traces as DIR/A1/default.json and DIR/B1/default.json.
`--env-a` / `--env-b` set environment variables for one side's processes only (A_DIR and B_DIR may
then be the same tree: e.g. `--env-b=CUDA_DEVICE_MAX_CONNECTIONS=32`; comma-separated, so a value
cannot hold a comma). A tree whose probe predates `--out-times` (it ignores the option) is timed from
the default's printed line (`times_from_line`). Exits 1 if a process fails or prints no times.
On an H100 the same step in alternated processes repeated within
0.1-0.4 % (`docs/results/gpu-tests-h200.txt` runs EW, EY, EZ, FA and FF).
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from _args import arg


def probe_command(tree: Path, tag: str, rows: str, out: Path, timeline: str) -> list[str]:
    """The probe's command line for process `tag` (A1, B1, ...) of `tree`: the default variant at
    `rows`, its 8-row output and times into out/<tag>.safetensors and out/<tag>.json, its 1-row
    trace under timeline/<tag> when `timeline` is given."""
    cmd = [sys.executable, str(tree / "scripts" / "probe_step_schedule.py"), "--variants=default", f"--rows={rows}",
           f"--out-bits={out / f'{tag}.safetensors'}", f"--out-times={out / f'{tag}.json'}"]
    return cmd + ([f"--timeline={Path(timeline) / tag}"] if timeline else [])


def times_from_line(text: str) -> dict[str, list[float]] | None:
    """The default variant's times from the probe's printed line (`default  capture ... | 1:
    3744.9  2:   4373.8 us | ...`: row count, then us), as `--out-times` writes them ({rows: [us]});
    None where no such line parses (the trees of older probes print it so; `--out-times` is the
    record where the probe has it)."""
    for line in text.splitlines():
        head, bar, rest = line.partition(" | ")
        if not bar or head.split()[:1] != ["default"]:
            continue
        fields = rest.partition(" | ")[0].removesuffix(" us").replace(":", " ").split()
        if len(fields) < 2 or len(fields) % 2:
            continue
        try:
            return {str(int(r)): [float(t)] for r, t in zip(fields[::2], fields[1::2])}
        except ValueError:
            continue
    return None


def env_option(value: str, name: str) -> dict[str, str]:
    """`K=V,K2=V2` as a dict (a value cannot hold a comma); SystemExit naming the option on an entry
    without "=" or a key."""
    out = {}
    for item in filter(None, value.split(",")):
        key, eq, val = item.partition("=")
        if not eq or not key:
            raise SystemExit(f"--{name}: expected KEY=VALUE[,KEY=VALUE...], got {item!r}")
        out[key] = val
    return out


def summarize(times: dict[str, dict[str, list[float]]], same: dict[str, bool]) -> tuple[list[str], dict]:
    """(lines, record) from each process's times (tag -> {rows: [us]}: the probe's --out-times of the
    default variant) and whether its output is A1's bits: per row count the A and B times in
    process order, their medians and B/A - 1 in percent."""
    lines, record = [], {"rows": {}, "bitwise_equal_to_A1": same}
    tags = sorted(times, key=lambda t: (int(t[1:]), t[0]))
    for r in sorted({r for t in times.values() for r in t}, key=int):
        a = [times[t][r][0] for t in tags if t[0] == "A" and r in times[t]]
        b = [times[t][r][0] for t in tags if t[0] == "B" and r in times[t]]
        ma, mb = statistics.median(a), statistics.median(b)
        change = 100.0 * (mb / ma - 1.0)
        lines.append(f"{r:>3} rows: A " + " / ".join(f"{x:.1f}" for x in a) + "  B " + " / ".join(f"{x:.1f}" for x in b)
                     + f" us  (medians {ma:.1f} / {mb:.1f}: B {change:+.2f} %)")
        record["rows"][r] = {"A": a, "B": b, "median_A": ma, "median_B": mb, "B_vs_A_percent": round(change, 3)}
    verdict = "every output A1's bits" if all(same.values()) else \
        "outputs differing from A1's: " + ", ".join(t for t, s in same.items() if not s)
    lines.append(verdict)
    return lines, record


def main() -> None:
    trees = [a for a in sys.argv[1:] if not a.startswith("--")]
    if len(trees) != 2:
        raise SystemExit(__doc__.split("\n\n")[1])
    trees = [Path(t).resolve() for t in trees]
    for t in trees:
        if not (t / "scripts" / "probe_step_schedule.py").is_file() or not (t / "dsv41_decode").is_dir():
            raise SystemExit(f"{t}: not a source tree (needs dsv41_decode/ and scripts/probe_step_schedule.py)")
    rows, pairs, timeline = arg("rows", "1,8"), int(arg("pairs", "2")), arg("timeline", "")
    timeline = str(Path(timeline).resolve()) if timeline else ""      # the children run in their trees
    envs = {"A": env_option(arg("env-a", ""), "env-a"), "B": env_option(arg("env-b", ""), "env-b")}
    if pairs < 1:
        raise SystemExit(f"--pairs must be at least 1, got {pairs}")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(arg("out", "") or tmp).resolve()
        out.mkdir(parents=True, exist_ok=True)
        times = {}
        for i in range(1, pairs + 1):
            for side, tree in zip("AB", trees):
                tag = f"{side}{i}"
                print(f"=== {tag}: {tree}" + "".join(f" {k}={v}" for k, v in envs[side].items()), flush=True)
                env = {**os.environ, "PYTHONPATH": str(tree), **envs[side]}
                for stale in (out / f"{tag}.json", out / f"{tag}.safetensors"):   # a reused --out's
                    stale.unlink(missing_ok=True)
                done = subprocess.run(probe_command(tree, tag, rows, out, timeline if i == 1 else ""), cwd=tree,
                                      env=env, check=False, stdout=subprocess.PIPE, text=True)
                print(done.stdout, end="", flush=True)
                if done.returncode:
                    print(f"{tag}: the probe exited with {done.returncode}", file=sys.stderr)
                    sys.exit(1)
                if (out / f"{tag}.json").is_file():
                    times[tag] = json.loads((out / f"{tag}.json").read_text())["default"]
                elif (parsed := times_from_line(done.stdout)) is not None:
                    times[tag] = parsed
                else:
                    print(f"{tag}: the probe wrote no times and printed no default line", file=sys.stderr)
                    sys.exit(1)
        import torch
        from safetensors.torch import load_file
        first = load_file(str(out / "A1.safetensors"))["out"]
        same = {t: bool(torch.equal(load_file(str(out / f"{t}.safetensors"))["out"], first)) for t in times}
        lines, record = summarize(times, same)
        record["trees"] = {"A": str(trees[0]), "B": str(trees[1])}
        record["env"] = envs
        (out / "ab.json").write_text(json.dumps(record, indent=1) + "\n")
        print("\n".join(lines), flush=True)


if __name__ == "__main__":
    main()
