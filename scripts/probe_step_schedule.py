"""Schedule variants of the 40-layer V4.1-Flash step (32K, graph replay, rows 1/8/16/64), recaptured on
one step: us per replay (median of 30) and whether the 8-row output is bitwise the default's (a
schedule changes the order of launches, never the math).

    default         the step as built
    mla_after_mix   the sparse MLA waits for the next site's mixer (at 1-16 rows the sparse MLA's
                    configurations need all their programs resident; the mixer, at the least
                    priority, can still hold SMs when it starts)
    mix_critical    the mixer's lane at the critical priority (as the main stream)

    PYTHONPATH=. python scripts/probe_step_schedule.py [--variants=default,mla_after_mix,...] [--rows=1,8,16,64]

(GPU; ~70 s on an H200.) The variants patch the built step's objects in this process only.
"""
from __future__ import annotations

import torch

from _args import arg
from dsv41_decode.bench.step import _arm, _replay_us
from dsv41_decode.config import ModelConfig
from dsv41_decode.decode import attention as attention_mod
from dsv41_decode.decode.lanes import PRIORITY_CRITICAL
from dsv41_decode.stack import AttentionStack
from dsv41_decode.state import DecodeState
from dsv41_decode.testing.synthetic import fill_state, random_checkpoint


def _mla_after_mix(step):
    """Patch the step's boundary and layers: the last mixer event is kept and the sparse MLA waits
    for it (returns the undo)."""
    held = {}
    mix, attend = step.boundary.mix, attention_mod.AttentionStep._attend

    def mix_kept(*a, **k):
        held["ev"] = ev = mix(*a, **k)
        return ev

    def attend_after(self, B, events):
        self.lanes.wait(held.get("ev"))
        return attend(self, B, events)

    step.boundary.mix = mix_kept
    attention_mod.AttentionStep._attend = attend_after

    def undo():
        step.boundary.mix = mix
        attention_mod.AttentionStep._attend = attend
    return undo


def main() -> None:
    names = arg("variants", "default,mla_after_mix,mix_critical").split(",")
    rows = tuple(int(r) for r in arg("rows", "1,8,16,64").split(","))
    cfg = ModelConfig.preset("v41-flash")
    stack = AttentionStack(random_checkpoint(cfg, "cuda"))
    n = max(max(rows), 8)
    state = DecodeState(cfg, max_requests=n, max_context=32768 + 1024, page_size=64, device="cuda", max_drafts=3)
    fill_state(state, {i: 32768 for i in range(n)})
    step = stack.decode_step(state, max_rows=n, buckets=tuple(sorted(set(rows) | {8})))
    aux = list(step.lanes._aux)
    first = None
    for name in names:
        undo = lambda: None
        step.lanes._aux = list(aux)
        if name == "mla_after_mix":
            undo = _mla_after_mix(step)
        elif name == "mix_critical":
            step.lanes._aux[1] = torch.cuda.Stream("cuda", priority=PRIORITY_CRITICAL)
        elif name != "default":
            raise SystemExit(f"unknown variant {name!r}")
        step.graphs = {}
        step._capture()
        undo()
        b = _arm(step, [(i, 1) for i in range(8)], torch.Generator(device="cuda").manual_seed(7))
        step.replay(b)
        torch.cuda.synchronize()
        out = step.io.x_out[:8].clone()
        same = "-" if first is None else str(torch.equal(out, first))
        first = out if first is None else first
        gen = torch.Generator(device="cuda").manual_seed(1)
        t = {r: _replay_us(step, _arm(step, [(i, 1) for i in range(r)], gen), replays=30) for r in rows}
        print(f"{name:14s} | " + "  ".join(f"{r}: {t[r]:8.1f}" for r in rows)
              + f" us | 8-row output == default's: {same}", flush=True)


if __name__ == "__main__":
    main()
