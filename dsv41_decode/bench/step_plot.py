"""Plots of `bench step` results (from their JSON lines, so committed results can be re-plotted on
any machine: `dsv41-decode plot docs/results/step-h200.jsonl`).

One panel per context: the 40-layer step time against the rows (one row per request), the
specialized step and each baseline variant the file holds (no_overlap, wo_a_fp8, and, for a
TP file, the collective boundary and the TP1 step), with the step floor (weights and cache bytes
over the measured read bandwidth) as a dotted line, and the FP8-`wo_a` layout's own floor where the
file holds its headline rows (`"wo_a": "fp8"`). A TP file adds a panel of the boundary alone.
"""

from __future__ import annotations

import json
from pathlib import Path

from .results import runs_label


def load_jsonl(path: str | Path) -> list[dict]:
    """The result rows of a JSON-lines file (results format of architecture.md section 4)."""
    rows = []
    with open(path) as f:
        for i, line in enumerate(f, 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{i}: not a JSON line ({e})") from None
    return rows


def plot_step(rows: list[dict], path: str | Path) -> Path:
    """Write the PNG of `bench step` (or `bench step --tp N`) result rows to `path`; returns it."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    steps = [r for r in rows if r["case"].get("op") == "step_40_layers" and "+" not in r["case"].get("requests", "")
             and "wo_a" not in r["case"]]
    fp8 = [r for r in rows if r["case"].get("op") == "step_40_layers" and r["case"].get("wo_a") == "fp8"]
    bounds = [r for r in rows if r["case"].get("op") == "boundary"]
    if not steps and not bounds:
        raise ValueError("no step_40_layers or boundary rows to plot")
    contexts = sorted({r["case"]["context"] for r in steps})
    panels = len(contexts) + (1 if bounds else 0)
    fig, axes = plt.subplots(1, panels, figsize=(5 * panels, 3.8), squeeze=False)
    for ax, ctx in zip(axes[0], contexts):
        sel = [r for r in steps if r["case"]["context"] == ctx]
        for tp in sorted({r["case"].get("tp", 1) for r in sel}):
            cur = sorted((r for r in sel if r["case"].get("tp", 1) == tp), key=lambda r: r["case"]["rows"])
            xs = [r["case"]["rows"] for r in cur]
            name = "specialized step" if tp == 1 and len({r["case"].get("tp", 1) for r in sel}) == 1 \
                else f"TP{tp}" + (" fused boundary" if tp > 1 else "")
            ax.plot(xs, [r["us"] / 1e3 for r in cur], "o-", label=name)
            for b in sorted({b for r in cur for b in r["baselines"] if b != "generic"}):
                pts = [(r["case"]["rows"], r["baselines"][b] / 1e3) for r in cur if b in r["baselines"]]
                ax.plot(*zip(*pts), ".--", label=f"TP{tp} {b}" if tp > 1 else b)
            ax.plot(xs, [r["floor_us"] / 1e3 for r in cur], ":", color="gray",
                    label="step floor" if tp == 1 else f"TP{tp} floor (per GPU)")
        own = sorted((r for r in fp8 if r["case"]["context"] == ctx), key=lambda r: r["case"]["rows"])
        if own:      # the FP8-wo_a layout's own floor (its step is the wo_a_fp8 line)
            ax.plot([r["case"]["rows"] for r in own], [r["floor_us"] / 1e3 for r in own], ":", color="silver",
                    label="floor, FP8 wo_a")
        _style(ax, "rows (one per request)", "ms per step", f"context {ctx // 1024}K")
    if bounds:
        ax = axes[0][-1]
        cur = sorted(bounds, key=lambda r: r["case"]["rows"])
        xs = [r["case"]["rows"] for r in cur]
        ax.plot(xs, [r["us"] for r in cur], "o-", label="fused one-shot boundary")
        for b in sorted({b for r in cur for b in r["baselines"]}):
            ax.plot(xs, [r["baselines"][b] for r in cur], ".--", label=f"{b} + separate boundary")
        _style(ax, "rows", "us per boundary", f"TP{cur[0]['case'].get('tp', '?')} boundary")
    first = (steps or bounds)[0]
    fig.suptitle(f"{first['bench']} on {first['gpu']}\n({runs_label(steps + bounds)}; "
                 f"read {first.get('read_gbps', '?')} GB/s)", fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.92))
    path = Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _style(ax, xlabel: str, ylabel: str, title: str) -> None:
    """Rows on a log2 axis, times from zero, the labels and a small legend."""
    ax.set_xscale("log", base=2)
    ax.set_ylim(bottom=0)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7)
