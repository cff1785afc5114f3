"""Where the time of `DecodeState.accept` goes (what `DecodeStep.accept` runs after a speculative
step): the V4.1-Flash state with 4 requests at `--context` cached tokens, each step 4 x (1 + 3
drafts) rows planned and advanced (the state's bookkeeping, no attention), then each request keeping
1, 2, 3 or 4 rows in turn, as `bench step`'s `step_accept` row does.

    PYTHONPATH=. python scripts/probe_accept.py [--context=32768] [--steps=40] [--device=cuda]
    PYTHONPATH=. python scripts/probe_accept.py --context=4096 --steps=8 --device=cpu    # checks the script
    PYTHONPATH=. python scripts/probe_accept.py --step=64,64 [--buckets=1,16,64]         # bench step's case (GPU)

Prints the median host time of the call alone (it enqueues its device work and returns), the same
with the device synchronized after it (what `bench step` reports), the same with the open groups
deferred (`defer=True`, what `DecodeStep.accept` passes), the plan + advance beside them,
then a torch profiler table of one pass of `--steps` accepts: the ops by host time, with the
device time of each (the device's kernels and copies).

With `--step=R,F` (CUDA only) the state is bench step's instead (`max_requests` R, F requests
filled at `--context`) and a captured V4.1-Flash `DecodeStep` (random weights, `--buckets`) runs
each 4 x (1 + 3) call: per step the call's time and the accept's (host alone, and with the device
synchronized after it), against the state's own plan + advance + accept on the same state, the
first again, then with Python's garbage collector off; then a profiler table of the ops run inside
`--steps` accepts that follow step calls (host time inclusive per accept)."""

from __future__ import annotations

import gc
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from _args import arg
from dsv41_decode.config import ModelConfig
from dsv41_decode.state import DecodeState
from dsv41_decode.testing.synthetic import fill_state

ROWS = [(i, 4) for i in range(4)]


def kept(k: int) -> dict[int, int]:
    """Step k's acceptance: request i keeps 1 + (i + k) % 4 of its 4 rows."""
    return {i: 1 + (i + k) % 4 for i in range(4)}


def state_only(context: int, steps: int, device: str) -> None:
    cfg = ModelConfig.preset("v41-flash")
    state = DecodeState(cfg, max_requests=16, max_context=context + 4 * steps + 1024, page_size=64, device=device,
                        max_drafts=3)
    fill_state(state, {i: context for i in range(4)})

    def sync() -> None:
        if device != "cpu":
            torch.cuda.synchronize()

    def one(k: int, wait: bool, defer: bool = False) -> tuple[float, float]:
        """(plan + advance, accept) host us of step k; wait: the device synchronized after accept;
        defer: the open groups left to the next call (`DecodeStep.accept`'s form)."""
        sync()
        t0 = time.perf_counter()
        state.advance(state.plan(ROWS))
        t1 = time.perf_counter()
        state.accept(kept(k), defer=defer)
        if wait:
            sync()
        return (t1 - t0) * 1e6, (time.perf_counter() - t1) * 1e6

    for k in range(4):                                      # first calls: allocations, lazy inits
        one(k, True)
    alone = [one(k, False) for k in range(steps)]
    waited = [one(k, True) for k in range(steps)]
    deferred = [one(k, True, True) for k in range(steps)]
    print(f"V4.1-Flash state, 4 x (1 + 3) rows at {context} cached tokens, {steps} steps on {device}: median us")
    print(f"  plan + advance {statistics.median(a for a, _ in alone):8.1f}")
    print(f"  accept         {statistics.median(b for _, b in alone):8.1f}   (host, not waiting for the device)")
    print(f"  accept + sync  {statistics.median(b for _, b in waited):8.1f}   (as bench step's step_accept)")
    print(f"  deferred + sync {statistics.median(b for _, b in deferred):7.1f}   (defer=True: DecodeStep.accept's form)")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device != "cpu" else [])
    with profile(activities=activities) as prof:
        for k in range(steps):
            one(k, True)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


def after_step(context: int, steps: int, max_requests: int, filled: int, buckets: tuple[int, ...]) -> None:
    from dsv41_decode.stack import AttentionStack
    from dsv41_decode.testing.synthetic import random_checkpoint
    t0 = time.time()
    cfg = ModelConfig.preset("v41-flash")
    stack = AttentionStack(random_checkpoint(cfg, "cuda"))
    state = DecodeState(cfg, max_requests=max_requests, max_context=context + 1024, page_size=64, device="cuda",
                        max_drafts=3)
    fill_state(state, {i: context for i in range(filled)})
    step = stack.decode_step(state, max_rows=max(buckets), buckets=buckets)
    gen = torch.Generator(device="cuda").manual_seed(1)
    print(f"V4.1-Flash DecodeStep, buckets {buckets}, max_requests {max_requests}, {filled} requests at {context} "
          f"cached tokens (built in {time.time() - t0:.0f} s); 4 x (1 + 3) rows, {steps} steps: median us")

    xs = [torch.randn(16, cfg.hc_mult, cfg.dim, generator=gen, device="cuda").to(torch.bfloat16) for _ in range(4)]

    def timed(call, accept):
        """Step k's (call, accept, accept + sync) host us: call(k), the device synchronized, then
        accept(kept(k)) alone and with the device synchronized after it."""
        def one(k: int) -> tuple[float, float, float]:
            torch.cuda.synchronize()
            a = time.perf_counter()
            call(k)
            torch.cuda.synchronize()
            b = time.perf_counter()
            accept(kept(k))
            c = time.perf_counter()
            torch.cuda.synchronize()
            return (b - a) * 1e6, (c - b) * 1e6, (time.perf_counter() - b) * 1e6
        return one

    via_step = timed(lambda k: step(xs[k % 4], ROWS), step.accept)
    via_state = timed(lambda k: state.advance(state.plan(ROWS)), state.accept)

    def report(name: str, f) -> None:
        for k in range(3):
            f(k)
        r = [f(k) for k in range(steps)]
        med = [statistics.median(v[i] for v in r) for i in range(3)]
        print(f"  {name:34s} call {med[0]:8.1f}  accept {med[1]:7.1f}  accept + sync {med[2]:7.1f}"
              f"  (min {min(v[2] for v in r):.1f}, max {max(v[2] for v in r):.1f})", flush=True)

    report("step call, then accept", via_step)
    report("state plan + advance, then accept", via_state)
    report("step call, then accept", via_step)
    gc.disable()
    try:
        report("step call, then accept (gc off)", via_step)
    finally:
        gc.enable()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for k in range(steps):
            step(xs[k % 4], ROWS)
            torch.cuda.synchronize()
            with record_function("probe_accept"):
                step.accept(kept(k))
                torch.cuda.synchronize()
    spans = [e.time_range for e in prof.events() if e.name == "probe_accept" and e.device_type.name == "CPU"]
    inside: dict[str, list] = {}
    for e in prof.events():
        if e.name != "probe_accept" and any(s.start <= e.time_range.start and e.time_range.end <= s.end for s in spans):
            entry = inside.setdefault(e.name, [0, 0.0])
            entry[0] += 1
            entry[1] += e.cpu_time_total
    print(f"ops inside {len(spans)} accepts after step calls (host us per accept, inclusive):")
    for name, (count, total) in sorted(inside.items(), key=lambda kv: -kv[1][1])[:25]:
        print(f"  {name[:64]:64s} {count:5d} calls {total / max(1, len(spans)):9.1f}")


def main() -> None:
    context, steps = int(arg("context", "32768")), int(arg("steps", "40"))
    step = arg("step", "")
    if step:
        if not torch.cuda.is_available():
            raise SystemExit("probe_accept: --step needs a CUDA device (the captured DecodeStep)")
        max_requests, filled = (int(v) for v in step.split(","))
        after_step(context, steps, max_requests, filled, tuple(int(v) for v in arg("buckets", "1,16,64").split(",")))
    else:
        state_only(context, steps, arg("device", "cuda"))


if __name__ == "__main__":
    main()
