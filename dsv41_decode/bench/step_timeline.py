"""A timeline of one decode step: a profiler trace of one CUDA-graph replay, a PNG of the kernels
per stream around one Full layer (the side lanes overlapping the main stream), and where each
layer's time goes (`layer_groups`: per kernel its median start and end from the layer's boundary,
the layers with the indexer apart)."""

from __future__ import annotations

import collections
import json
import statistics
import tempfile
from pathlib import Path

import torch

from .results import gpu_slug


def trace_kernels(trace: dict) -> list[dict]:
    """The kernel events of a chrome trace (the dict `json.load` gives of a profiler's export), by
    start time."""
    return sorted((e for e in trace.get("traceEvents", []) if e.get("cat") == "kernel" and "dur" in e),
                  key=lambda e: e["ts"])


def kernel_key(event: dict, by_grid: bool = False) -> str:
    """A profiler kernel event's short name (templates, arguments and namespaces dropped, 48
    characters at most), with its launch grid appended (" [x,y,z]") when by_grid."""
    name = event["name"].replace("void ", "").replace("(anonymous namespace)::", "")
    name = name.split("(")[0].split("<")[0][:48]
    grid = event.get("args", {}).get("grid")
    return f"{name} [{','.join(str(g) for g in grid)}]" if by_grid and grid else name


def layer_groups(kernels: list[dict]) -> dict[str, dict]:
    """Per group of layers ("without the indexer", "with the indexer"): the layers' count, their
    median span (us, from the layer's mHC boundary - the entry boundary for the first - to the next
    layer's) and per kernel key (`kernel_key` with the grid, then "#k" for its k-th launch in the
    layer) the medians of its start, end and duration relative to the layer's boundary, over the
    layers where it runs, and in how many it does; the keys in order of their median start. The
    kernels before the first boundary (the step's head) and from the last one on (the step's last
    boundary, to its last kernel's end) go to groups "head" and "tail" of one. Empty when the trace
    has no mhc_boundary kernel, or when its boundaries do not delimit the layers (one `wo_a`
    between two boundaries, none after the last: not so with the boundary in `wo_b`'s epilogue)."""
    ks = sorted(kernels, key=lambda e: e["ts"])
    cuts = [i for i, e in enumerate(ks) if "mhc_boundary" in e["name"]]
    if not cuts:
        return {}
    spans = [(0, cuts[0], "head")] if cuts[0] else []
    for c, end in zip(cuts, cuts[1:]):
        if sum("wo_a" in e["name"] for e in ks[c:end]) != 1:
            return {}
        group = "with the indexer" if any("index_scores" in e["name"] for e in ks[c:end]) else "without the indexer"
        spans.append((c, end, group))
    if any("wo_a" in e["name"] for e in ks[cuts[-1]:]):
        return {}
    spans.append((cuts[-1], len(ks), "tail"))
    out = {}
    for a, b, group in spans:
        t0 = ks[a]["ts"]
        stop = ks[b]["ts"] if b < len(ks) else max(e["ts"] + e["dur"] for e in ks[a:b])
        g = out.setdefault(group, {"spans": [], "kernels": {}})
        g["spans"].append(stop - t0)
        seen = collections.Counter()
        for e in ks[a:b]:
            key = kernel_key(e, True)
            seen[key] += 1
            key = f"{key} #{seen[key]}" if seen[key] > 1 else key
            g["kernels"].setdefault(key, []).append((e["ts"] - t0, e["ts"] + e["dur"] - t0, e["dur"]))
    table = {}
    for group, g in out.items():
        rows = {k: (statistics.median(v[0] for v in vs), statistics.median(v[1] for v in vs),
                    statistics.median(v[2] for v in vs), len(vs)) for k, vs in g["kernels"].items()}
        table[group] = {"layers": len(g["spans"]), "span": statistics.median(g["spans"]),
                        "kernels": dict(sorted(rows.items(), key=lambda kv: kv[1][0]))}
    return table


def format_layer_groups(table: dict[str, dict], width: int = 52) -> list[str]:
    """`layer_groups` as text lines: per group its layers and median span, then per kernel its
    median start, end and duration (us from the layer's boundary) and the layers it runs in."""
    lines = []
    for group, g in table.items():
        lines.append(f"{group}: {g['layers']} layer(s), median span {g['span']:.1f} us")
        lines.append(f"  {'kernel':{width}s} {'start':>7s} {'end':>7s} {'dur':>6s} layers")
        lines += [f"  {k:{width}s} {t0:7.1f} {t1:7.1f} {d:6.1f} {n:6d}" for k, (t0, t1, d, n) in g["kernels"].items()]
    return lines


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
    and `step-timeline-<gpu>.png` (kernels per stream during the first Full layer); print (through
    `progress`) where each layer's time goes (`layer_groups`)."""
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
    groups = layer_groups(kernels)
    if groups:
        progress("timeline, per layer from its mHC boundary (us, medians over the group):\n"
                 + "\n".join(format_layer_groups(groups)))


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
