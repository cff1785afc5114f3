"""A timeline of one decode step: a profiler trace of one CUDA-graph replay and a PNG of the kernels
per stream around one Full layer (the side lanes overlapping the main stream)."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch

from .results import gpu_slug


def trace_kernels(trace: dict) -> list[dict]:
    """The kernel events of a chrome trace (the dict `json.load` gives of a profiler's export), by
    start time."""
    return sorted((e for e in trace.get("traceEvents", []) if e.get("cat") == "kernel" and "dur" in e),
                  key=lambda e: e["ts"])


def replay_kernels(graph: torch.cuda.CUDAGraph, path: str | Path | None = None) -> list[dict]:
    """The kernels of one profiled replay of `graph` (after one unprofiled replay), as chrome-trace
    events ("name", "ts" and "dur" in us, "args" with the stream) by start time; the whole trace is
    written to `path` when given. The profiler's overhead stays on later replays in the process."""
    graph.replay()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(path) if path is not None else Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(trace))
        return trace_kernels(json.loads(trace.read_text()))


def write_timeline(step, bucket: int, out_dir: str, info: dict, progress=print) -> None:
    """Profile one replay of `step.graphs[bucket]`; write `step-timeline-<gpu>.json` (chrome trace)
    and `step-timeline-<gpu>.png` (kernels per stream during the first Full layer)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    slug = gpu_slug(info["gpu"])
    path = out / f"step-timeline-{slug}.json"
    kernels = replay_kernels(step.graphs[bucket], path)
    if not kernels:
        progress("timeline: the profiler saw no kernels of the graph replay")
        return
    cfg = step.stack.cfg
    L, streams = plot_timeline(kernels, [(i, cfg.plan[i].kind, cfg.plan[i].label) for i in step.stack.ids], info,
                               out / f"step-timeline-{slug}.png")
    progress(f"timeline: {len(kernels)} kernels, {streams} streams in layer {L}; wrote {path} and the PNG")


def _layer_ends(kernels: list[dict]) -> list[dict]:
    """The kernel that ends each layer, in order (kernels sorted by start): per `wo_a` kernel (one a
    layer), the first mhc_boundary kernel after it and before the next layer's `wo_a`, else the
    first kernel to start after it ends on its stream (its `wo_b`, with the boundary in the
    epilogue; any kernel when the trace names no streams)."""
    def stream(e):
        return e.get("args", {}).get("stream", e.get("tid"))
    woa = [e for e in kernels if "wo_a" in e["name"]]
    ends = []
    for i, w in enumerate(woa):
        stop = woa[i + 1]["ts"] if i + 1 < len(woa) else float("inf")
        after = [e for e in kernels if e["ts"] >= w["ts"] + w["dur"] and e["ts"] < stop]
        same = [e for e in after if stream(e) == stream(w)]
        if after:
            ends.append(next((e for e in after if "mhc_boundary" in e["name"]), (same or after)[0]))
    return ends


def plot_timeline(kernels: list[dict], layers: list[tuple[int, str, str]], info: dict, path) -> tuple[int, int]:
    """The PNG of a step's kernels per stream during its first Full layer (from the end of the
    layer before it to the end of its own: a layer ends with its boundary, the first mhc_boundary
    kernel after its `wo_a`, or where the boundary runs in `wo_b`'s epilogue, with the kernel that
    starts first after its `wo_a` on the same stream; `_layer_ends`). kernels: the trace's kernel
    events; layers: (layer, kind, label) per step layer in order; info: gpu, commit, date. Returns
    (layer, streams drawn).
    Also redraws a committed trace: `plot_timeline(trace_kernels(json.load(f)), ...)`."""
    kernels = sorted(kernels, key=lambda e: e["ts"])
    ends = _layer_ends(kernels)
    full = [i for i, (_, kind, _) in enumerate(layers) if kind == "full"]
    k = full[0] if full else 0
    t0 = ends[k - 1]["ts"] + ends[k - 1]["dur"] if 1 <= k <= len(ends) else kernels[0]["ts"]
    t1 = ends[k]["ts"] + ends[k]["dur"] if len(ends) > k else kernels[-1]["ts"]
    window = [e for e in kernels if t0 - 2 <= e["ts"] <= t1]
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    streams = sorted({e.get("args", {}).get("stream", e.get("tid")) for e in window})
    fig, ax = plt.subplots(figsize=(14, 1.2 + 0.8 * len(streams)))
    for y, s in enumerate(streams):
        for e in window:
            if e.get("args", {}).get("stream", e.get("tid")) != s:
                continue
            ax.broken_barh([(e["ts"] - t0, e["dur"])], (y - 0.4, 0.8), color=f"C{hash(e['name']) % 10}")
            if e["dur"] > (t1 - t0) / 40:
                ax.text(e["ts"] - t0 + e["dur"] / 2, y, e["name"].strip("_")[:18], ha="center", va="center",
                        fontsize=6)
    ax.set_yticks(range(len(streams)), [f"stream {s}" for s in streams])
    ax.set_xlabel("us from the end of the previous layer")
    L, _, label = layers[k]
    ax.set_title(f"layer {L} ({label}), 1 row, one CUDA-graph replay on {info['gpu']} "
                 f"(commit {info['commit']}, {info['date']}); total step {kernels[-1]['ts'] + kernels[-1]['dur'] - kernels[0]['ts']:.0f} us")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return L, len(streams)
