"""Where a row bucket's step time goes: profile one CUDA-graph replay of the 40-layer V4.1-Flash step
per bucket and print the kernel time per kernel name (summed over the step) side by side.

    PYTHONPATH=. python scripts/probe_step_kernels.py --rows=16,32,64 --context=4096

Found the 32-row cliff of `bench step` (13.1 ms at 32 rows against 7.3 at 16 and 17.3 at 64).
"""

from __future__ import annotations

import argparse
import collections

import torch

from dsv41_decode.bench.step import _arm, _replay_us
from dsv41_decode.bench.step_timeline import replay_kernels
from dsv41_decode.config import ModelConfig
from dsv41_decode.stack import AttentionStack
from dsv41_decode.state import DecodeState
from dsv41_decode.testing.synthetic import fill_state, random_checkpoint


def kernel_times(graph: torch.cuda.CUDAGraph) -> tuple[dict[str, float], dict[str, int], dict[str, float]]:
    """Per kernel name: summed duration (us) and count; per stream: summed duration."""
    kernels = replay_kernels(graph)
    dur, cnt, per_stream = collections.Counter(), collections.Counter(), collections.Counter()
    for e in kernels:
        name = e["name"].replace("void ", "").replace("(anonymous namespace)::", "")
        name = name.split("(")[0].split("<")[0][:48]
        dur[name] += e["dur"]
        cnt[name] += 1
        per_stream[e.get("args", {}).get("stream", e.get("tid"))] += e["dur"]
    return dur, cnt, per_stream


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="16,32,64")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--top", type=int, default=24)
    args = ap.parse_args()
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
        dur, cnt, streams = kernel_times(step.graphs[bucket])
        table[n] = (dur, cnt)
        print(f"rows {n}: replay {wall:.0f} us; kernel us per stream "
              f"{ {s: round(v) for s, v in sorted(streams.items(), key=lambda kv: -kv[1])} }")
    names = sorted({k for d, _ in table.values() for k in d}, key=lambda k: -max(d.get(k, 0) for d, _ in table.values()))
    print(f"{'kernel':48s} " + " ".join(f"{f'{n} rows us (count)':>20s}" for n in rows))
    for k in names[:args.top]:
        print(f"{k:48s} " + " ".join(f"{table[n][0].get(k, 0):12.0f} ({table[n][1].get(k, 0):4d})" for n in rows))


if __name__ == "__main__":
    main()
