"""One results format for every benchmark: JSON lines + an aligned table + plots."""

from __future__ import annotations

import datetime
import json
import os
import subprocess
from pathlib import Path

import torch


def run_info() -> dict:
    """GPU name, commit (DSV41_COMMIT, else `git rev-parse`), and today's date."""
    commit = os.environ.get("DSV41_COMMIT")
    if not commit:
        try:
            commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                    check=True).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            commit = "unknown"
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return {"gpu": gpu, "commit": commit, "date": datetime.date.today().isoformat()}


def gpu_slug(gpu: str) -> str:
    return gpu.replace("NVIDIA ", "").replace(" ", "-").lower()


def record(bench: str, case: dict, us: float, nbytes: float, floor_gbps: float, baselines: dict[str, float],
           info: dict) -> dict:
    """A result row: time, GB/s from the bytes the op must move, and percent of the measured floor."""
    floor_us = nbytes / (floor_gbps * 1e9) * 1e6
    return {"bench": bench, "case": case, "us": round(us, 3), "gbps": round(nbytes / (us * 1e-6) / 1e9, 1),
            "floor_us": round(floor_us, 3), "pct_floor": round(100 * floor_us / us, 1),
            "baselines": {k: round(v, 3) for k, v in baselines.items()}, **info}


def runs_label(rows: list[dict]) -> str:
    """The runs `rows` come from, for a plot's title: "commit date, commit date, ..." in the order
    they first appear (a committed results file may hold several runs' rows)."""
    runs = dict.fromkeys((r["commit"], r["date"]) for r in rows)
    return ", ".join(f"{c} {d}" for c, d in runs)


def write_jsonl(rows: list[dict], out_dir: str | Path, bench: str) -> Path:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{bench}-{gpu_slug(rows[0]['gpu'])}.jsonl"
    with path.open("w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return path


def format_table(rows: list[dict], case_keys: list[str]) -> str:
    """`case | us | GB/s | % of floor | vs baseline` lines, aligned."""
    base_names = sorted({k for r in rows for k in r["baselines"]})
    head = case_keys + ["us", "GB/s", "%floor"] + [f"x vs {b}" for b in base_names]
    lines = [[str(r["case"].get(k, "")) for k in case_keys] + [f"{r['us']:.2f}", f"{r['gbps']:.0f}",
             f"{r['pct_floor']:.0f}"] + [f"{r['baselines'][b] / r['us']:.2f}" if b in r["baselines"] else "-"
                                         for b in base_names] for r in rows]
    widths = [max(len(h), *(len(l[i]) for l in lines)) for i, h in enumerate(head)]
    fmt = "  ".join(f"{{:>{w}}}" for w in widths)
    return "\n".join([fmt.format(*head)] + [fmt.format(*l) for l in lines])


PLOTTED = {"gemm": "bench gemm: GB/s vs rows, one panel per op and TP shard, with its baselines and the read floor",
           "attn": "bench attn: sparse MLA time vs rows per head count, indexer-logits GB/s vs context, top-k time",
           "step": "bench step: step time vs rows per context, with its variants and the step floor",
           "step_tp": "bench step --tp N: the TP step per context and the fused vs collective boundary"}
_STEP_BENCHES = ("step", "step_tp", "boundary")


def plot_results(rows: list[dict], path: str | Path) -> Path:
    """Redraw the PNG of one bench's result rows (the JSON lines it wrote), chosen by their `bench`
    field (`PLOTTED` says what each plot shows); returns the path written (`path`, with ".png" added
    where it has no suffix, as matplotlib adds it). ValueError when the rows hold no bench this can
    plot, rows of several benches, or rows that lack a field the plot reads."""
    benches = {r.get("bench") for r in rows if isinstance(r, dict)}
    if not benches:
        raise ValueError("no result rows to plot")
    if None in benches:
        raise ValueError("a line carries no 'bench' field: not the results of dsv41-decode bench")
    kinds = {"step" if b in _STEP_BENCHES else b for b in benches}
    if len(kinds) > 1:
        raise ValueError(f"rows of several benches ({', '.join(sorted(map(str, benches)))}); plot one bench's file")
    kind = kinds.pop()
    if kind not in ("gemm", "attn", "step"):
        raise ValueError(f"bench {kind!r} has no plot; plotted: {', '.join(sorted(PLOTTED))}")
    path = Path(path)
    if not path.suffix:
        path = path.with_suffix(".png")
    try:
        if kind == "gemm":
            from .gemm import plot_gemm
            plot_gemm(rows, path, rows[0].get("read_gbps", 0.0))
        elif kind == "attn":
            from .attn_plot import plot_attn
            plot_attn(rows, path)
        else:
            from .step_plot import plot_step
            plot_step(rows, path)
    except (KeyError, TypeError, AttributeError) as e:     # a row without the fields its bench writes
        what = f"no field {e.args[0]!r}" if isinstance(e, KeyError) else f"a field of another form ({e})"
        raise ValueError(f"a {kind} row with {what}: not the rows dsv41-decode bench {kind} writes") from e
    return path
