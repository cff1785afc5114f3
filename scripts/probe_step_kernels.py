"""Where a row bucket's step time goes: profile one CUDA-graph replay of the 40-layer V4.1-Flash step
per bucket and print the kernel time per kernel name (summed over the step) side by side.

    PYTHONPATH=. python scripts/probe_step_kernels.py --rows=16,32,64 --context=4096
    PYTHONPATH=. python scripts/probe_step_kernels.py --rows=32,64 --context=32768 --by-grid
    python scripts/probe_step_kernels.py --timeline=docs/results/step-timeline-h200.json --by-grid

`--by-grid` keys each kernel by its name and launch grid, which tells apart the launches of one
kernel at different shapes (the exact linears' `wq_b`, `wo_b`, fused `wq_a|wkv` and indexer `wq_b`
all run `_gluon_exact_mm_kernel` from 3 rows), with each key's mean time a launch. `--timeline`
reads a saved profiler trace (`bench step`'s `step-timeline-<gpu>.json`) instead of profiling: no
GPU needed. `--layers` (with `--timeline`) prints instead where each layer's time goes: the layers
cut at their mHC boundary kernels, grouped into those that run the indexer (an index-scores
kernel) and the others, and per kernel (name, grid and its order in the layer) the medians over
the group of its start, end and duration in us from the layer's boundary:

    python scripts/probe_step_kernels.py --timeline=docs/results/step-timeline-h200.json --layers

Found the 32-row cliff of `bench step` (13.1 ms at 32 rows against 7.3 at 16 and 17.3 at 64).
"""

from __future__ import annotations

import argparse
import collections
import json

from dsv41_decode.bench.step_timeline import format_layer_groups, kernel_key, layer_groups, trace_kernels


def kernel_times(kernels: list[dict], by_grid: bool = False) -> tuple[dict[str, float], dict[str, int],
                                                                        dict[str, float]]:
    """Over profiler kernel events (`bench.step_timeline.replay_kernels`' or a saved trace's): per
    key (`kernel_key`) the summed duration (us) and the count; per stream the summed duration."""
    dur, cnt, per_stream = collections.Counter(), collections.Counter(), collections.Counter()
    for e in kernels:
        key = kernel_key(e, by_grid)
        dur[key] += e["dur"]
        cnt[key] += 1
        per_stream[e.get("args", {}).get("stream", e.get("tid"))] += e["dur"]
    return dur, cnt, per_stream


def print_table(table: dict[str, tuple[dict[str, float], dict[str, int]]], top: int, width: int) -> None:
    """Per key (the largest first) its summed us, count and mean us a launch per column of `table`
    ({column: (dur, cnt)})."""
    cols = list(table)
    names = sorted({k for d, _ in table.values() for k in d}, key=lambda k: -max(d.get(k, 0) for d, _ in table.values()))
    print(f"{'kernel':{width}s} " + " ".join(f"{f'{c} us (count) mean':>28s}" for c in cols))
    for k in names[:top]:
        cells = []
        for c in cols:
            d, n = table[c][0].get(k, 0), table[c][1].get(k, 0)
            cells.append(f"{d:10.0f} ({n:4d}) {d / n if n else 0:7.1f}")
        print(f"{k:{width}s} " + " ".join(f"{cell:>28s}" for cell in cells))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="16,32,64")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--top", type=int, default=24)
    ap.add_argument("--by-grid", action="store_true", help="key kernels by name and launch grid")
    ap.add_argument("--timeline", help="a saved profiler trace to read instead of profiling (no GPU)")
    ap.add_argument("--layers", action="store_true", help="with --timeline: where each layer's time goes")
    args = ap.parse_args()
    width = 64 if args.by_grid else 48
    if args.layers and not args.timeline:
        ap.error("--layers reads a saved trace: give --timeline=FILE")
    if args.timeline:              # a saved Chrome trace (`bench step --out`'s timeline)
        with open(args.timeline) as f:
            kernels = trace_kernels(json.load(f))
        if args.layers:
            table = layer_groups(kernels)
            if not table:
                raise SystemExit(f"{args.timeline}: no mhc_boundary kernels that delimit the layers (none, or the "
                                 f"boundary in wo_b's epilogue)")
            print("\n".join(format_layer_groups(table)))
            return
        dur, cnt, _ = kernel_times(kernels, args.by_grid)
        print_table({args.timeline.rsplit("/", 1)[-1]: (dur, cnt)}, args.top, width)
        return
    import torch

    from dsv41_decode.bench.step import _arm, _replay_us
    from dsv41_decode.bench.step_timeline import replay_kernels
    from dsv41_decode.config import ModelConfig
    from dsv41_decode.stack import AttentionStack
    from dsv41_decode.state import DecodeState
    from dsv41_decode.testing.synthetic import fill_state, random_checkpoint

    rows = [int(r) for r in args.rows.split(",")]
    cfg = ModelConfig.preset("v41-flash")
    stack = AttentionStack(random_checkpoint(cfg, "cuda"))
    state = DecodeState(cfg, max_requests=max(rows), max_context=args.context + 1024, page_size=64, device="cuda")
    fill_state(state, {i: args.context for i in range(max(rows))})
    step = stack.decode_step(state, max_rows=max(rows), buckets=tuple(rows))
    gen = torch.Generator(device="cuda").manual_seed(1)
    table = {}
    for n in rows:
        bucket = _arm(step, [(i, 1) for i in range(n)], gen)
        wall = _replay_us(step, bucket)
        dur, cnt, streams = kernel_times(replay_kernels(step.graphs[bucket]), args.by_grid)
        table[f"{n} rows"] = (dur, cnt)
        print(f"rows {n}: replay {wall:.0f} us; kernel us per stream "
              f"{ {s: round(v) for s, v in sorted(streams.items(), key=lambda kv: -kv[1])} }")
    print_table(table, args.top, width)


if __name__ == "__main__":
    main()
