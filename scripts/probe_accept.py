"""Where the time of `DecodeState.accept` goes (what `DecodeStep.accept` runs after a speculative
step): the V4.1-Flash state with 4 requests at `--context` cached tokens, each step 4 x (1 + 3
drafts) rows planned and advanced (the state's bookkeeping, no attention), then each request keeping
1, 2, 3 or 4 rows in turn, as `bench step`'s `step_accept` row does.

    PYTHONPATH=. python scripts/probe_accept.py [--context=32768] [--steps=40] [--device=cuda]
    PYTHONPATH=. python scripts/probe_accept.py --context=4096 --steps=8 --device=cpu    # checks the script

Prints the median host time of the call alone (it enqueues its device work and returns), the same
with the device synchronized after it (what `bench step` reports), the plan + advance beside them,
then a torch profiler table of one pass of `--steps` accepts: the ops by host time, with the
device time of each (the device's kernels and copies)."""

from __future__ import annotations

import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from _args import arg
from dsv41_decode.config import ModelConfig
from dsv41_decode.state import DecodeState
from dsv41_decode.testing.synthetic import fill_state


def main() -> None:
    context, steps, device = int(arg("context", "32768")), int(arg("steps", "40")), arg("device", "cuda")
    cfg = ModelConfig.preset("v41-flash")
    state = DecodeState(cfg, max_requests=16, max_context=context + 4 * steps + 1024, page_size=64, device=device,
                        max_drafts=3)
    fill_state(state, {i: context for i in range(4)})
    rows = [(i, 4) for i in range(4)]

    def sync() -> None:
        if device != "cpu":
            torch.cuda.synchronize()

    def one(k: int, wait: bool) -> tuple[float, float]:
        """(plan + advance, accept) host us of step k; wait: the device synchronized after accept."""
        sync()
        t0 = time.perf_counter()
        state.advance(state.plan(rows))
        t1 = time.perf_counter()
        state.accept({i: 1 + (i + k) % 4 for i in range(4)})
        if wait:
            sync()
        return (t1 - t0) * 1e6, (time.perf_counter() - t1) * 1e6

    for k in range(4):                                      # first calls: allocations, lazy inits
        one(k, True)
    alone = [one(k, False) for k in range(steps)]
    waited = [one(k, True) for k in range(steps)]
    print(f"V4.1-Flash state, 4 x (1 + 3) rows at {context} cached tokens, {steps} steps on {device}: median us")
    print(f"  plan + advance {statistics.median(a for a, _ in alone):8.1f}")
    print(f"  accept         {statistics.median(b for _, b in alone):8.1f}   (host, not waiting for the device)")
    print(f"  accept + sync  {statistics.median(b for _, b in waited):8.1f}   (as bench step's step_accept)")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device != "cpu" else [])
    with profile(activities=activities) as prof:
        for k in range(steps):
            one(k, True)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


if __name__ == "__main__":
    main()
