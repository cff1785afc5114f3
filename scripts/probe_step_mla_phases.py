"""The Gluon sparse MLA's phase log inside the decode step (GPU, sm_90): where a 1-2-row launch's time
goes when it runs in the 40-layer step (beside `wo_a`'s launch by PDL and the next site's mixer)
against the same configuration alone. `scripts/probe_step_schedule.py`'s step (V4.1-Flash, random
weights, 32K contexts), every layer's sparse-MLA plan for `--rows` rows rebuilt with
`GluonSparseMlaConfig.phases` (the debug log: clock64 at each program's phase boundaries, globaltimer
at its start and end; the same bits, slower by its stamps' barriers), captured and replayed
(`bench.step.output_and_times`, the median of 30 replays printed beside the step's time without the
log); then, per layer kind (the Reuse, SWA and indexer layers), `probe_gluon_sparse_mla.phase_table`
over the last replay's programs of every layer of that kind pooled, and the median over layers of
each launch's start stagger (the last program's start after the first's: programs that waited for an
SM) and span; last, the same configuration alone (`probe_gluon_sparse_mla.phases`, random inputs of
the same shape), its records in L2 (the launch before left them there) and then from DRAM (L2 flushed
before the launch).

    PYTHONPATH=. python scripts/probe_step_mla_phases.py [--rows=1] [--variant=mla_after_mix]

`--rows` (1 or 2: the buckets of the spread configuration split4svl, whose programs stamp every
phase). `--variant=`: one of `probe_step_schedule.py`'s patches applied to the step before it is
captured with the log, e.g. `mla_after_mix` (the MLA after the next site's mixer: do its programs
start sooner?) or, on branch mla-pdl-room, `mla_pdl_room` (the MLA by PDL after wq_b: are its
records decoded before wq_b ends, and what does its part after q take?). Prints; writes nothing.
(GPU; about a minute.)
"""
from __future__ import annotations

import dataclasses
import statistics

import torch

from _args import arg
from probe_gluon_sparse_mla import CONFIGS, phase_table, phases
from dsv41_decode.bench.step import output_and_times
from dsv41_decode.config import ModelConfig
from dsv41_decode.decode.attention import SWA
from dsv41_decode.ops.gluon_sparse_mla_plan import PHASE_COLS, STEP_CONFIGS, GluonSparseMlaPlan
from dsv41_decode.stack import AttentionStack
from dsv41_decode.state import DecodeState
from dsv41_decode.testing.synthetic import fill_state, random_checkpoint


def logged(plan: GluonSparseMlaPlan) -> GluonSparseMlaPlan:
    """`plan` with the phase log on: the same workspace, counters and board (the step's pool), its
    own log."""
    config = dataclasses.replace(plan.config, phases=True)
    n = plan.max_rows * plan.base.n_blocks * config.dim_split
    log = torch.zeros(n, PHASE_COLS, dtype=torch.int64, device=plan.base.device)
    return dataclasses.replace(plan, config=config, phase_log=log, resident={}, q_descs={})


def kind_of(layer) -> str:
    spec = layer.spec
    if spec.kind == SWA:
        return "SWA"
    return "indexer" if spec.runs_indexer else "Reuse"          # Full (with the compressor) or Reindex


def main() -> None:
    rows = int(arg("rows", "1"))
    if rows not in (1, 2):
        raise SystemExit(f"--rows must be 1 or 2 (the split4svl buckets), got {rows}")
    cfg = ModelConfig.preset("v41-flash")
    stack = AttentionStack(random_checkpoint(cfg, "cuda"))
    state = DecodeState(cfg, max_requests=8, max_context=32768 + 1024, page_size=64, device="cuda", max_drafts=3)
    fill_state(state, {i: 32768 for i in range(8)})
    step = stack.decode_step(state, max_rows=8, buckets=(rows, 8))
    _, plain = output_and_times(step, (rows,))
    patched = {}
    for lid, layer in step.layers.items():
        plans = list(layer.mla_plans)
        i = next(j for j, p in enumerate(plans) if rows <= p.max_rows)
        if not isinstance(plans[i], GluonSparseMlaPlan):
            raise SystemExit(f"layer {lid}: the {rows}-row sparse MLA is not the Gluon kernel (sm_90 only)")
        plans[i] = logged(plans[i])
        patched[lid] = plans[i]
        layer.mla_plans = type(layer.mla_plans)(plans)
    variant = arg("variant", "")
    if variant:
        from probe_step_schedule import PATCHES
        if variant not in PATCHES:
            raise SystemExit(f"unknown variant {variant!r}; known: {list(PATCHES)}")
        PATCHES[variant](step)               # kept for the captures below (no undo)
        print(f"variant {variant}", flush=True)
    step.graphs = {}
    step._capture()
    _, with_log = output_and_times(step, (rows,))
    print(f"step at {rows} row(s): {plain[rows]:.1f} us as built, without the log; {with_log[rows]:.1f} with it"
          + (f" and {variant}" if variant else ""), flush=True)
    torch.cuda.synchronize()
    by_kind: dict[str, list[torch.Tensor]] = {}
    stagger: dict[str, list[float]] = {}
    span: dict[str, list[float]] = {}
    for lid, plan in patched.items():
        log = plan.phase_log[:rows * plan.base.n_blocks * plan.config.dim_split].cpu()
        log = log[log[:, 10] > 0]                  # the programs that ran (stamped a start)
        kind = kind_of(step.layers[lid])
        by_kind.setdefault(kind, []).append(log)
        starts, ends = log[:, 10].double(), log[:, 11].double()
        stagger.setdefault(kind, []).append(float(starts.max() - starts.min()) / 1e3)
        span.setdefault(kind, []).append(float(ends.max() - starts.min()) / 1e3)
    for kind, logs in by_kind.items():
        print(f"in the step, {kind} layers ({len(logs)}): launch span median {statistics.median(span[kind]):.2f} us, "
              f"start stagger median {statistics.median(stagger[kind]):.2f} max {max(stagger[kind]):.2f} us; "
              f"the programs of every such layer pooled:", flush=True)
        print("\n".join(phase_table(torch.cat(logs))), flush=True)
    name = next(n for n, c in CONFIGS.items() if c == STEP_CONFIGS[64][0][1])
    print(f"alone ({name}, the step's {rows}-row configuration), its records in L2 and then from DRAM:", flush=True)
    phases(cfg.n_heads, [rows], [name])
    phases(cfg.n_heads, [rows], [name], cold=True)


if __name__ == "__main__":
    main()
