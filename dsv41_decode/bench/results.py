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
