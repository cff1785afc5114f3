"""The 40-layer V4.1-Flash step (32K, graph replay, rows 1/8/16/64) under CUDA stream priorities:
per variant the priority of the capture stream (the replay's main stream) and of the three side
lanes (compressor, mixer, index query), recaptured on the same step; us per replay (median of 30)
and whether the 8-row output is bitwise the first variant's (priorities change the schedule, never
the math). A captured kernel keeps its stream's priority: torch instantiates graphs with
cudaGraphInstantiateFlagUseNodePriority.

    PYTHONPATH=. python scripts/probe_step_priorities.py [--variants=default,flat,...] [--rows=1,8,16,64]

(GPU; ~70 s on an H200.)
"""
from __future__ import annotations

import torch

from _args import arg
from dsv41_decode.bench.step import _arm, _replay_us
from dsv41_decode.config import ModelConfig
from dsv41_decode.decode.lanes import PRIORITY_CRITICAL, PRIORITY_SLACK
from dsv41_decode.stack import AttentionStack
from dsv41_decode.state import DecodeState
from dsv41_decode.testing.synthetic import fill_state, random_checkpoint

# name: (capture stream, (compressor, mixer, index-query) lanes); lower is more urgent, 0 the default
VARIANTS = {
    "default": (PRIORITY_CRITICAL, (PRIORITY_CRITICAL, PRIORITY_SLACK, PRIORITY_CRITICAL)),   # the step's
    "flat": (0, (0, 0, 0)),                                                                     # every stream at 0
    "deeper": (-2, (-2, 0, -2)),
    "index_first": (-1, (-2, 0, -2)),
}


def main() -> None:
    names = arg("variants", ",".join(VARIANTS)).split(",")
    rows = tuple(int(r) for r in arg("rows", "1,8,16,64").split(","))
    print("stream priority range (least, greatest):", torch.cuda.Stream.priority_range(), flush=True)
    cfg = ModelConfig.preset("v41-flash")
    stack = AttentionStack(random_checkpoint(cfg, "cuda"))
    n = max(max(rows), 8)
    state = DecodeState(cfg, max_requests=n, max_context=32768 + 1024, page_size=64, device="cuda", max_drafts=3)
    fill_state(state, {i: 32768 for i in range(n)})
    step = stack.decode_step(state, max_rows=n, buckets=tuple(sorted(set(rows) | {8})))
    first = None
    for name in names:
        cap, aux = VARIANTS[name]
        step.lanes._aux = [torch.cuda.Stream("cuda", priority=p) for p in aux]
        step.lanes.capture = torch.cuda.Stream("cuda", priority=cap)
        step.graphs = {}
        step._capture()
        b = _arm(step, [(i, 1) for i in range(8)], torch.Generator(device="cuda").manual_seed(7))
        step.replay(b)
        torch.cuda.synchronize()
        out = step.io.x_out[:8].clone()
        same = "-" if first is None else str(torch.equal(out, first))
        first = out if first is None else first
        gen = torch.Generator(device="cuda").manual_seed(1)
        t = {r: _replay_us(step, _arm(step, [(i, 1) for i in range(r)], gen), replays=30) for r in rows}
        print(f"{name:12s} capture {cap:2d} lanes {aux} | " + "  ".join(f"{r}: {t[r]:8.1f}" for r in rows)
              + f" us | 8-row output == first variant's: {same}", flush=True)


if __name__ == "__main__":
    main()
