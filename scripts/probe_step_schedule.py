"""Schedule variants of the 40-layer V4.1-Flash step (32K, graph replay, rows 1/8/16/64), recaptured on
one step: us per replay (median of 30) and whether the 8-row output is bitwise the first variant's
(a schedule or a stream priority changes the order of work, never the math). A captured kernel
keeps its stream's priority: torch instantiates graphs with cudaGraphInstantiateFlagUseNodePriority.

    default         the step as built (`decode.lanes`: capture stream and the compressor's and index
                    query's lanes at PRIORITY_CRITICAL, the mixer's lane at PRIORITY_SLACK)
    flat            every stream at priority 0
    deeper          capture stream and the critical lanes at -2
    index_first     the compressor's and index query's lanes at -2, above the main stream's -1
    mix_critical    the mixer's lane at the critical priority too
    comp_slack      the compressor's lane at the least priority, with the mixer's (in the layers
                    that own a compressor its projection's grid, 256 programs of the ratio-2 FP32
                    weights, is resident before the norm pair and the head weights' projection and
                    holds them back; its chain has slack there: its latent and index key are done
                    before the index query)
    comp_slack_deep the same with the capture stream and the index query's lane at -2
    rope_apart      the query RoPE in a launch of its own after wq_b in every layer (`query_rope_`),
                    where wq_b's op has it in its epilogue (`rope_in_wq_b`)
    boundary_folded the mHC boundary in wo_b's epilogue where wo_b's op is ExactMM (at 1-2 rows on
                    the H200; `DecodeStep(fold_boundary=True)`) instead of its own launch after wo_b
    boundary_split  the mHC boundary's own launch in the split form (the last chunk of a row to
                    arrive normalizes and quantizes the whole row) instead of the co-resident one
                    (every chunk normalizes itself: `MhcBoundaryPlan.coresident`, the step's plan)
    mla_after_mix   the sparse MLA waits for the next site's mixer (at 1-16 rows the sparse MLA's
                    configurations need all their programs resident; the mixer, at the least
                    priority, can still hold SMs when it starts)
    mix_late        every site's mixer enqueued at the end of the next layer's input projections
                    (after its norm pair and side projections) instead of right after the boundary,
                    in every bucket (`DecodeStep.mix_late_rows` = 1; the step's default from
                    `MIX_LATE_ROWS` rows): in the ratio-2 Full layers at 1 row the norm pair and the
                    head weights' projection start only when the mixer ends, though the SMs have
                    room for them
    mix_early       every site's mixer right after the boundary, in every bucket (`mix_late_rows`
                    past the largest bucket)
    wproj_lane      the indexer's head weights (weights_proj) on a lane of their own beside the
                    index query's GEMM (`AttentionStep.proj_own_lane`; the lane at the index
                    query's priority): the step's default (`DecodeStep(weights_lane=True)`), so
                    the same schedule as `default` (both at most WEIGHTS_LANE_MAX_ROWS rows)
    wproj_in_index  the head weights ahead of the index query's GEMM on the index query's lane
                    (`proj_own_lane` off: `DecodeStep(weights_lane=False)`)
    wproj_split     the head weights' plan at split 32 (one 128-deep K range a program: 32
                    programs instead of 10; other FP32 sums, so other bits possible); measured
                    no faster on an H200 at bd33dff (docs/step.md)
    comp_r2_split2  the ratio-2 compressor's FP32 projection at 2 / 4 programs along K (64 / 128 programs
    comp_r2_split4  instead of 256): in the three ratio-2 Full layers its grid, launched just before the
                    q/kv norm pair, precedes a 9-11 us wait of the pair and of the head weights'
                    projection (the probe's norm-pair lines); other FP32 sums, so other bits
    comp_r2_group2  the same projection's 8 K ranges two / four at a time a program (`LlBf16Plan.group`:
    comp_r2_group4  128 / 64 programs, the plan's partials and sums): the same bits
    comp_tail       the compressor's tail (latent norm, indexer wk, compressed record + index key)
                    in one launch (`ops.compressor_tail`: `DecodeStep(comp_tail=True)`) instead of
                    the step's three (`rms_norm_`, `ll_bf16_`, `compressed_entry_store_`); the
                    same bits; measured slower on an H200 (docs/step.md)
    topk_chunk      the indexer's top-k plans with chunks of --topk-chunk entries (default 1024,
                    as the step's plan: `TopKPlan.build`'s default; set it to compare another)
    boundary_bd256  the mHC boundary's plan in chunks of 256 / 1024 columns instead of 512 (20 / 5
    boundary_bd1024 co-resident programs a row at dim 5120; the sum of squares in other chunks, so
                    other bits for u: the 8-row comparison says False)
    prefetch_wo_a   the first --prefetch-mb MB (default 40) of every layer's wo_a weight asked of L2
                    (`pdl.bulk_prefetch_l2`, 16 KB an instruction, 32 a program) on the weights lane, issued once
                    wq_b is done, beside the sparse MLA (which reads little of DRAM), joined at
                    the step's end; the same bits
    no_prefetch     without the step's prefetch of each layer's sparse MLA records into L2 at the
                    layer's start at 1 row (`DecodeStep(prefetch_records=False)`); the same bits
    prefetch_plain  that prefetch at L2's normal priority instead of evict_last; the same bits
    prefetch_2      that prefetch in the buckets of up to 2 / 8 rows instead of 1; the same bits
    prefetch_8
    topk_one        the top-k in one launch at calls of up to 8 rows (`attention.TOPK_ONE_LAUNCH_MAX_ROWS`,
                    4 by default; the linked path's two launches above); the same bits
    topk_linked     the top-k on the linked path's two launches at every row count; the same bits
    wo_a_pre1       each layer's Gluon wo_a, launched by PDL during the sparse MLA, requesting one / two
    wo_a_pre2       of its ring's slots' weight tiles before its wait instead of all of them
                    (`GluonWoAConfig.prefill`, `attention.WO_A_PREFILL`): less DRAM traffic beside
                    the MLA's record gathers; the same bits
    gate_dec1       in every bucket, each layer's Gluon wo_a requesting one / two / three / four ring
    gate_dec2       slots before a gate, the rest once every program of the sparse MLA has decoded its
    gate_dec3       records into shared memory (gate_st1: one slot, the rest once every program has
    gate_dec4       stored its partial), then its PDL wait (`attention.WO_A_GATE`, `gluon_wo_a_(gate=)`;
    gate_st1        the step's default gates at 5-8 rows with two slots, `WO_A_GATE_ROWS`): its weight
                    stream beside the MLA, not ahead of its gathers; the same bits
    no_gate         no gate in any bucket (`AttentionStep.wo_a_gate` None); the same bits
    carveout_all    every kernel loaded asking for the largest shared-memory carve-out (100 %; by
                    default only kernels of more than 48 KB prefer shared memory); with --processes=1
    carveout_index  the same for the indexer chain's kernels only (index query, scores, top-k, table),
                    which run on the SMs just before an indexer layer's sparse MLA
    no_index_fold   the Gluon scorer without its query fold in every indexer layer (`attention.INDEX_FOLD_Q`
                    off, `gluon_index_scores_mxfp4_(fold_q=False)`); the same bits
    no_pdl          every kernel launched plainly: not each layer's Gluon wo_a by programmatic
                    dependent launch after the Gluon sparse MLA (released at the start of the MLA's
                    last launch's programs: its rings' first weight tiles read while the MLA runs),
                    nor at 1-8 rows its exact wq_b after the q/kv norm pair, nor its exact wo_b after
                    wo_a's main loops, nor at 1-2 rows its fused wq_a|wkv after the boundary, nor its
                    norm pair after the fused GEMM, nor its boundary's own launch after wo_b, nor
                    in the indexer layers its sparse MLA after the sparse-index table, the step's
                    default (`DecodeStep(wo_a_pdl=, wq_b_pdl=, wo_b_pdl=, qkv_pdl=, norm_pdl=,
                    boundary_pdl=, mla_pdl=)`); the same bits
    no_wq_b_pdl     wq_b launched plainly, the others by PDL
    no_wo_b_pdl     wo_b launched plainly, the others by PDL
    no_qkv_pdl      the fused wq_a|wkv launched plainly, the others by PDL
    wq_b_pdl_no_idx wq_b launched plainly in the layers that run an indexer (whose index-query GEMM,
                    on its own lane after the norm pair, then finds the SMs that wq_b's early
                    programs otherwise hold), by PDL in the others; the same bits
    qkv_pdl_all     the exact fused wq_a|wkv launched by PDL after the mHC boundary's launch in every
                    bucket (`attention.QKV_PDL_MAX_ROWS` = 64, not 2); the same bits
    topk_pdl        the indexer layers' top-k (its linked path's kernels after the scorer) launched by
                    PDL (`topk_ascending_(pdl=True)`, the index lane's chain); the same bits
    wq_b_cap128     the exact wq_b's GluonExactFMA configurations (1-2 rows) at a register cap of 128,
    wq_b_cap112     112, 104, 88 or 80 instead of the plan's 96 (`GluonExactFMAConfig.maxnreg`; no
    wq_b_cap104     spills): two of its programs an SM at 88-128, three at 80, the rest of the SM's
    wq_b_cap88      registers left to the kernels beside them; the same bits
    wq_b_cap80
    wq_b_mm_cap104  the exact wq_b's GluonExactMM configurations of at most 16 rows (3-16 rows) at a
    wq_b_mm_cap96   register cap of 104 or 96 instead of 128 (sm_90: no spills at 104; at 96 a
                    few at 16 rows without the RoPE epilogue, none with it): two programs an SM,
                    the rest of the SM's registers left to the kernels beside them; the same bits
    no_norm_pdl     the q/kv norm pair launched plainly, not by PDL after the fused wq_a|wkv GEMM
                    (`DecodeStep(norm_pdl=False)`); the same bits
    no_boundary_pdl the mHC boundary's own launch plainly, not by PDL after wo_b
                    (`DecodeStep(boundary_pdl=False)`); the same bits
    skip_pair       knock-outs (not the step: outputs differ; the 8-row output's comparison says so):
    skip_boundary   the q/kv norm pair, the mHC boundary's launch, every site's mixer or the sparse
    skip_mixer      MLA left out of the captured step, each alone: what that launch costs the
    skip_mla        step's critical path at most (what folding it elsewhere could gain)
    wq_b_slack      in the layers that run the indexer, wq_b on a stream of its own at the least
                    priority, joined before the sparse MLA (there the main stream's scores wait
                    for wq_b by stream order and the index query for its SMs, while the sparse MLA
                    needs q only after the top-k; wq_b's plan takes no split workspace at TP1)
    wq_b_slack_cap80 wq_b_slack with wq_b_cap80: the indexer chain's kernels on the main stream
                    find room beside wq_b's programs instead of waiting for them to exit (1-2 rows);
                    the same bits
    idx_gemm_first  in the layers that run the indexer, wq_b launched plainly after the index query's
    idx_gemm_first_cap80  GEMM (an event): the GEMM alone first (4-5 us alone, ~17 beside wq_b's
                    programs), its chain then beside wq_b, with wq_b_cap80 more room for it; the
                    same bits

    PYTHONPATH=. python scripts/probe_step_schedule.py [--variants=default,flat,...] [--rows=1,8,16,64]
        [--timeline=DIR] [--passes=1] [--processes=1] [--out-bits=FILE] [--out-times=FILE] [--advance=0]

`--passes=N` runs the list of variants N times over (each recaptured every time): a variant's
time depends on where it runs in the process (on an H200 later recaptures have measured up to 3-7 %
slower than their own one-replay timeline; on an H100 every variant after a process's first 3-5 %
slower, runs EV and EX in docs/results/gpu-tests-h200.txt), so compare a variant with its neighbours
in several passes, or in both orders. `--processes=1` runs each (pass, variant) instead in a fresh
process of its own, the variants alternated pass by pass, each timed as its process's first step
(on an H100 the same step in alternated processes repeated within 0.1-0.4 %, runs EW, EY and EZ);
each child writes its 8-row output (safetensors) for the parent's bitwise comparison, its timeline
to DIR/p<pass> with --timeline=DIR.

`--out-bits=FILE` saves the (last) variant's 8-row output (safetensors, key "out"), `--out-times=FILE`
every variant's times as JSON, {variant: {rows: [us per pass]}} (both in one process, not with
--processes=1): what `scripts/ab_step.py` reads from each tree's process.

`--advance=N` then runs N public 1-row calls back to back on a request of the variant's own (32768
tokens at its start), each advancing it by one token (its window moving, new records and index keys
written, the selections following: what a decode loop does, where the timed replays recompute one
step), and prints the time per call on the device's timeline (CUDA events between the calls: host
gaps would show) as medians of blocks of N / 5 calls, first to last: whether
a variant's lead holds over a run, e.g. the records' L2 prefetch at evict_last, whose lines are
never lowered again, against the normal priority (`prefetch_plain`) and none (`no_prefetch`).

With `--timeline=DIR` each variant also writes the chrome trace of one 1-row replay to
DIR/<variant>.json and prints, per layer whose q/kv norm pair starts more than 1 us after the
kernel before it on its stream, that gap and the kernels running on other streams meanwhile.

(GPU; ~70-100 s on an H200.) The variants patch the built step's objects in this process only.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import triton
import triton.language as tl

from _args import arg
from safetensors.torch import load_file, save_file
from dsv41_decode.bench.step import output_and_times
from dsv41_decode.bench.step_timeline import replay_kernels
from dsv41_decode.config import ModelConfig
from dsv41_decode.decode import attention as attention_mod, boundary as boundary_mod
from dsv41_decode.decode.lanes import AUX_INDEX_W, PRIORITY_CRITICAL, PRIORITY_SLACK, StepEvents
from dsv41_decode.decode.step import PDL_OPTIONS
from dsv41_decode.ops import LOW_BATCH_MAX_ROWS, topk
from dsv41_decode.ops.gluon_wo_a import GluonWoAPlan
from dsv41_decode.ops.ll_bf16 import LlBf16Plan
from dsv41_decode.ops.mhc import BoundaryOperands, MhcBoundaryPlan
from dsv41_decode.ops.pdl import bulk_prefetch_l2
from dsv41_decode.stack import AttentionStack
from dsv41_decode.state import DecodeState
from dsv41_decode.testing.synthetic import fill_state, random_checkpoint

C, S = PRIORITY_CRITICAL, PRIORITY_SLACK
DEFAULT_PRIORITIES = (C, (C, S, C))
# The priority variants, name: (capture stream, (compressor, mixer, index-query) lane priorities);
# lower is more urgent. The schedule variants (`PATCHES`, below) run at the default's.
PRIORITIES = {
    "default": DEFAULT_PRIORITIES,
    "flat": (0, (0, 0, 0)),
    "deeper": (-2, (-2, 0, -2)),
    "index_first": (-1, (-2, 0, -2)),
    "mix_critical": (C, (C, C, C)),
    "comp_slack": (C, (S, S, C)),
    "comp_slack_deep": (-2, (S, S, -2)),
}


def _swap(changes):
    """Set each (obj, name, value) of changes and return the undo that restores what they held. The
    undo holds the new values too (`undo.kept`): a graph captured under the patch reads their
    tensors (a plan's workspace and counters), so the caller keeps the undo while it replays."""
    held = [(obj, name, getattr(obj, name)) for obj, name, _ in changes]
    for obj, name, value in changes:
        setattr(obj, name, value)

    def undo():
        for obj, name, value in held:
            setattr(obj, name, value)
    undo.kept = [value for _, _, value in changes]
    return undo


def _mla_after_mix(step):
    """Patch the step's boundary and layers: the last mixer event is kept and the sparse MLA waits
    for it (a dependency more for its launch, by PDL after the table in the indexer layers);
    returns the undo."""
    held = {}
    mix, attend = step.boundary.mix, attention_mod.AttentionStep._attend

    def mix_kept(*a, **k):
        held["ev"] = ev = mix(*a, **k)
        return ev

    def attend_after(self, B):
        self.lanes.wait(held.get("ev"))
        return attend(self, B)

    return _swap([(step.boundary, "mix", mix_kept), (attention_mod.AttentionStep, "_attend", attend_after)])


def _wq_b_slack(step):
    """Patch the step's indexer layers: wq_b enqueued on a least-priority stream of its own (forked
    from the main stream where it stood), the sparse MLA waiting for it (a dependency more for its
    launch by PDL after the table); returns the undo."""
    slack = torch.cuda.Stream("cuda", priority=S)
    done, changes = {}, []
    for i, layer in step.layers.items():
        if not layer.spec.runs_indexer:
            continue

        def on_slack(*a, _plan=layer.mm_wq_b, _layer=i, **k):
            forked = torch.cuda.Event()
            forked.record()
            with torch.cuda.stream(slack):
                slack.wait_event(forked)
                out = _plan(*a, **k)
                done[_layer] = torch.cuda.Event()
                done[_layer].record()
            return out
        changes.append((layer, "mm_wq_b", on_slack))
    attend = attention_mod.AttentionStep._attend

    def attend_after(self, B):
        if self.spec.layer in done:
            torch.cuda.current_stream().wait_event(done[self.spec.layer])
        return attend(self, B)

    return _swap(changes + [(attention_mod.AttentionStep, "_attend", attend_after)])


def _idx_gemm_first(step):
    """Patch the step's indexer layers: wq_b waits for the index query's GEMM (an event recorded
    after it on its lane) and launches plainly, so that the GEMM runs first, alone, and the chain
    after it beside wq_b; returns the undo."""
    done, changes = {}, []
    for i, layer in step.layers.items():
        if not layer.spec.runs_indexer:
            continue

        def idx_then_mark(*a, _plan=layer.mm_idx_wq_b, _layer=i, **k):
            out = _plan(*a, **k)
            done[_layer] = torch.cuda.Event()
            done[_layer].record()
            return out

        def wq_b_after(*a, _plan=layer.mm_wq_b, _layer=i, **k):
            k.pop("pdl", None)
            if _layer in done:
                torch.cuda.current_stream().wait_event(done[_layer])
            return _plan(*a, **k)
        changes += [(layer, "mm_idx_wq_b", idx_then_mark), (layer, "mm_wq_b", wq_b_after)]
    return _swap(changes)


def _together(*patches):
    """A patch applying each of `patches` in order (a register cap first, while the layers' plans
    are their own; a patch that wraps a plan after it); its undo undoes them in reverse."""
    def patch(step):
        undos = [p(step) for p in patches]

        def undo():
            for u in reversed(undos):
                u()
        return undo
    return patch


def _mix_rows(rows: int):
    """A patch setting the step's `mix_late_rows` (the buckets with the late mixer) to rows."""
    return lambda step: _swap([(step, "mix_late_rows", rows)])


def _norm_gaps(kernels: list[dict]) -> list[str]:
    """Per q/kv norm pair that starts > 1 us after the kernel before it on its stream: that gap and
    the kernels running on other streams in it (names cut to 20 characters)."""
    for e in kernels:
        e["end"] = e["ts"] + e["dur"]
    t0, lines = kernels[0]["ts"], []
    norms = [e for e in kernels if "rms_norm_pair" in e["name"]]
    for i, n in enumerate(norms):
        s = n["args"]["stream"]
        before = [e for e in kernels if e["args"]["stream"] == s and e["end"] <= n["ts"] + 0.01]
        if not before or n["ts"] - before[-1]["end"] <= 1.0:
            continue
        p = before[-1]
        meanwhile = sorted({e["name"][:20] for e in kernels if e["args"]["stream"] != s
                            and e["ts"] < n["ts"] and e["end"] > p["end"]})
        lines.append(f"  norm pair {i} at {n['ts'] - t0:7.1f} us: {n['ts'] - p['end']:4.1f} us after "
                     f"{p['name'][:20]}; meanwhile {meanwhile}")
    return lines


def _wproj_split(step):
    """Patch the step's indexer layers: the head weights' plan at split 32; returns the undo."""
    return _swap([(layer, "proj_plan", LlBf16Plan.build(p.n, p.k, p.max_rows, p.weight_dtype, p.device, split=32,
                                                        block_n=p.block_n))
                  for layer in step.layers.values() if layer.spec.runs_indexer for p in [layer.proj_plan]])


def _comp_r2_plan(split: int | None = None, group: int = 1):
    """A patch giving the ratio-2 compressor's FP32 projection (`comp_plan` of the layers whose
    compressor has ratio 2) `split` K ranges instead of its plan's (8 at TP1 on 132 SMs: 256 programs;
    None: the plan's) run `group` at a time a program (`LlBf16Plan.group`: split / group programs,
    the same bits as that split); the undo restores the plans."""
    def patch(step):
        return _swap([(layer, "comp_plan", LlBf16Plan.build(p.n, p.k, p.max_rows, p.weight_dtype, p.device,
                                                            split=split or p.split, block_n=p.block_n, group=group))
                      for layer in step.layers.values()
                      if layer.spec.owns_compressor and layer.spec.ratio == 2 for p in [layer.comp_plan]])
    return patch


def _topk_chunk(step):
    """Patch the step's indexer layers: top-k plans with chunks of --topk-chunk entries; returns the undo."""
    chunk = int(arg("topk-chunk", "1024"))
    return _swap([(layer, "topk_plan", topk.TopKPlan.build(p.max_rows, p.k, p.group, p.ws.device, chunk=chunk,
                                                           warps=p.warps, wide_chunk=p.wide_chunk,
                                                           wide_warps=p.wide_warps))
                  for layer in step.layers.values() if layer.spec.runs_indexer for p in [layer.topk_plan]])


def _topk_pdl(step):
    """Patch the step's top-k calls: the linked path launched by PDL; returns the undo."""
    return _swap([(attention_mod, "topk_ascending_", functools.partial(topk.topk_ascending_, pdl=True))])


def _wq_b_cap(cap: int, op: str = "fma", most_rows: int = 4):
    """A patch giving every layer's exact wq_b the configurations of its op `op` ("fma": GluonExactFMA,
    1-2 rows; "mma": GluonExactMM) for calls of at most `most_rows` rows at a register cap of `cap`
    (`maxnreg`; the same bits: no configuration changes one): two programs an SM at 88-128, the
    rest of the SM's registers left to the kernels beside them (the FMA plan's 96 a quarter). The
    undo restores them."""
    def patch(step):
        plans = [getattr(layer.mm_wq_b, op) for layer in step.layers.values()
                 if getattr(getattr(layer.mm_wq_b, op, None), "_configs", None)]
        if not plans:
            raise SystemExit(f"a wq_b cap of {cap}: no layer's wq_b runs its {op} op (the exact linears), or a "
                             f"patch applied before it wrapped wq_b's plan")
        return _swap([(p, "_configs", [(most, dataclasses.replace(c, maxnreg=cap) if most <= most_rows else c)
                                       for most, c in p._configs]) for p in plans])
    return patch


def _layer_flag(attr: str, value):
    """A patch setting every layer's `attr` (an `AttentionStep` schedule setting) to value; the undo
    restores each layer's setting as the step was built."""
    return lambda step: _swap([(layer, attr, value) for layer in step.layers.values()])


def _wo_a_prefill(slots: int):
    """A patch giving every layer's Gluon wo_a plan `GluonWoAConfig.prefill` = slots (the same
    workspace and counters); the undo restores the plans as the step was built."""
    def patch(step):
        return _swap([(layer, "wo_a_plan", layer.wo_a_plan.with_prefill(slots))
                      for layer in step.layers.values() if isinstance(layer.wo_a_plan, GluonWoAPlan)])
    return patch


def _wo_a_gate(point: str, slots: int):
    """A patch giving every layer that can take it (`AttentionStep.gate_capable`) the gate at `point`
    (`AttentionStep.wo_a_gate`, "decoded" or "stored") after `slots` ring slots (its gated plan's
    `GluonWoAConfig.prefill`) in every bucket; the undo restores the step as built."""
    def patch(step):
        layers = [a for a in step.layers.values() if a.gate_capable]
        if not layers:
            raise SystemExit("a wo_a gate: no layer pairs a Gluon sparse MLA with a Gluon wo_a by PDL")
        return _swap([change for a in layers for change in (
            (a, "wo_a_gate", point), (a, "wo_a_gate_rows", (1, LOW_BATCH_MAX_ROWS)),
            (a, "wo_a_gated_plan", a.wo_a_plan.with_prefill(slots)))])
    return patch


def _boundary_folded(step):
    """Patch the step: the mHC boundary in wo_b's epilogue where wo_b's op takes it; returns the undo."""
    return _swap([(step, "fold_boundary", True)])


def _boundary_split(step):
    """Patch the step: its boundary plan switched to the split form (the same workspace); returns the undo."""
    b = step.boundary
    return _swap([(b, "exit_plan", dataclasses.replace(b.exit_plan, coresident=False))])


def _boundary_chunks(block_d: int):
    """A patch giving the step's boundary a plan of block_d-column chunks (its own workspace, the form
    `MhcBoundaryPlan.build` picks); the undo restores the step's plan. The patch holds the new plan
    (its workspace and counters, which the captured graph uses) for as long as it is referenced."""
    held = []

    def patch(step):
        b = step.boundary
        p = b.exit_plan
        held.append(MhcBoundaryPlan.build(p.dim, p.max_rows, p.ws.device, block_d))
        return _swap([(b, "exit_plan", held[-1])])
    return patch


def _comp_tail(step):
    """Patch the step: the compressor's tail in one launch in every layer that has its plan (the
    layers whose wk plan fits `ops.compressor_tail`); returns the undo."""
    return _swap([(layer, "comp_tail_fused", layer.comp_tail_plan is not None) for layer in step.layers.values()])


@triton.jit
def _prefetch_kernel(base_ptr, n_bytes, CHUNK: tl.constexpr, LANES: tl.constexpr):
    # lane i of program p asks L2 for bytes [(p * LANES + i) * CHUNK, +CHUNK) of the n_bytes at base_ptr
    i = tl.program_id(0) * LANES + tl.arange(0, LANES)
    start = i.to(tl.int64) * CHUNK
    size = tl.maximum(tl.minimum(n_bytes - start, CHUNK), 0).to(tl.int32)
    bulk_prefetch_l2((base_ptr.to(tl.pointer_type(tl.uint8)) + start).to(tl.int64), size)


def _prefetch_wo_a(step):
    """Patch every layer's `_attend`: before the sparse MLA, the weights lane waits for the main
    stream (wq_b done) and asks L2 for the head of the layer's wo_a weight; the main stream joins
    that lane only at the end of the step (`StepEvents.join`: the kernel only issues prefetches and
    writes nothing). Returns the undo."""
    nbytes = int(float(arg("prefetch-mb", "40")) * 2**20)
    attend, join = attention_mod.AttentionStep._attend, StepEvents.join
    last = [None]

    def attend_prefetching(self, B):
        w = self.wo_a_w
        n = min(nbytes, w.numel() * w.element_size())
        ready = self.lanes.mark()
        with self.lanes.side(AUX_INDEX_W):
            self.lanes.wait(ready)
            # 16 KB an instruction, 32 a one-warp program: the prefetches spread over many SMs' copy
            # engines (64 KB ones from 5 programs took 44 us for 40 MB, overlapping wo_a and wo_b)
            chunk, lanes = 16384, 32
            _prefetch_kernel[(triton.cdiv(triton.cdiv(n, chunk), lanes),)](w, n, CHUNK=chunk, LANES=lanes, num_warps=1)
            last[0] = self.lanes.mark()
        return attend(self, B)

    def join_prefetch(self, lanes):
        join(self, lanes)
        lanes.wait(last[0])
    return _swap([(attention_mod.AttentionStep, "_attend", attend_prefetching), (StepEvents, "join", join_prefetch)])


# CUfunction attribute: the shared-memory share of the L1 / shared carve-out the kernel prefers, in %
_CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT = 9
# the kernels of the indexer chain that run on the SMs just before a layer's sparse MLA
_INDEX_CHAIN = ("index_query", "index_scores", "hist_hi", "hist_lo", "lo_select", "count", "write", "topk_slots")


def _carveout(chain_only: bool):
    """A patch asking the driver for the largest shared-memory carve-out (100 %) on each kernel the
    process has loaded (every compiled kernel of every JITFunction, Triton's and Gluon's) or loads
    from now on (Triton's `kernel_load_end_hook`): every kernel, or (chain_only) the indexer
    chain's; by default only kernels of more than 48 KB prefer shared memory, so the SMs that ran
    the small ones may need a reconfiguration before the sparse MLA's 104 KB programs fit. The
    attribute stays on the loaded kernels (the undo only removes the hook): run it with
    --processes=1."""
    import ctypes
    import gc
    from triton import knobs
    from triton.runtime.jit import JITFunction

    def patch(step):
        cuda = ctypes.CDLL("libcuda.so.1")
        cuda.cuFuncSetAttribute.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
        touched = []

        def hook(module, function, name, *_):
            if not chain_only or any(k in name for k in _INDEX_CHAIN):
                touched.append(name)
                rc = cuda.cuFuncSetAttribute(ctypes.c_void_p(function),
                                             _CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT, 100)
                if rc != 0:
                    raise RuntimeError(f"cuFuncSetAttribute(carveout) on {name}: CUresult {rc}")
        knobs.runtime.kernel_load_end_hook.add(hook)
        for fn in [o for o in gc.get_objects() if isinstance(o, JITFunction)]:
            for caches in fn.device_caches.values():
                for kernel in list(caches[0].values()):
                    if getattr(kernel, "module", None) is not None:
                        hook(kernel.module, kernel.function, kernel.name)

        def undo():
            knobs.runtime.kernel_load_end_hook.remove(hook)
            print(f"  carve-out 100 % on {len(touched)} kernels loaded: {', '.join(sorted(set(touched)))[:300]}")
        return undo
    return patch


def _skip(obj, name: str):
    """A patch replacing obj.name (a launcher the step calls) by a no-op; the undo restores it."""
    return lambda step: _swap([(obj, name, lambda *a, **k: None)])


# The schedule variants, name: a patch of the built step (its undo returned), applied for the capture.
PATCHES = {
    "rope_apart": _layer_flag("rope_in_wq_b", False), "boundary_folded": _boundary_folded,
    "boundary_split": _boundary_split, "mla_after_mix": _mla_after_mix, "wq_b_slack": _wq_b_slack,
    "mix_late": _mix_rows(1), "mix_early": _mix_rows(LOW_BATCH_MAX_ROWS + 1), "topk_chunk": _topk_chunk,
    "wproj_lane": _layer_flag("proj_own_lane", True), "wproj_in_index": _layer_flag("proj_own_lane", False),
    "wproj_split": _wproj_split, "comp_r2_split2": _comp_r2_plan(split=2), "comp_r2_split4": _comp_r2_plan(split=4),
    "comp_r2_group2": _comp_r2_plan(group=2), "comp_r2_group4": _comp_r2_plan(group=4),
    "comp_tail": _comp_tail, "boundary_bd256": _boundary_chunks(256),
    "boundary_bd1024": _boundary_chunks(1024), "prefetch_wo_a": _prefetch_wo_a,
    "no_prefetch": _layer_flag("prefetch_records", False),
    "prefetch_plain": lambda step: _swap([(attention_mod, "records_prefetch_l2_",
                                           functools.partial(attention_mod.records_prefetch_l2_, evict_last=False))]),
    "prefetch_2": lambda step: _swap([(attention_mod, "PREFETCH_RECORDS_MAX_ROWS", 2)]),
    "prefetch_8": lambda step: _swap([(attention_mod, "PREFETCH_RECORDS_MAX_ROWS", 8)]),
    "topk_one": lambda step: _swap([(attention_mod, "TOPK_ONE_LAUNCH_MAX_ROWS", 8)]),
    "topk_linked": lambda step: _swap([(attention_mod, "TOPK_ONE_LAUNCH_MAX_ROWS", 0)]),
    "wo_a_pre1": _wo_a_prefill(1), "wo_a_pre2": _wo_a_prefill(2),
    "gate_dec1": _wo_a_gate("decoded", 1), "gate_dec2": _wo_a_gate("decoded", 2), "gate_dec3": _wo_a_gate("decoded", 3),
    "gate_dec4": _wo_a_gate("decoded", 4), "gate_st1": _wo_a_gate("stored", 1),
    "no_gate": _layer_flag("wo_a_gate", None),
    "no_index_fold": lambda step: _swap([(attention_mod, "INDEX_FOLD_Q", False)]),
    "carveout_all": _carveout(False), "carveout_index": _carveout(True),
    "no_pdl": lambda step: _swap([(owner, flag, False) for flag in PDL_OPTIONS
                                  for owner in ([step] if hasattr(step, flag) else step.layers.values())]),
    "no_wq_b_pdl": _layer_flag("wq_b_pdl", False), "no_wo_b_pdl": _layer_flag("wo_b_pdl", False),
    "wq_b_pdl_no_idx": lambda step: _swap([(layer, "wq_b_pdl", False) for layer in step.layers.values()
                                           if layer.spec.runs_indexer]),
    "no_qkv_pdl": _layer_flag("qkv_pdl", False),
    "qkv_pdl_all": lambda step: _swap([(attention_mod, "QKV_PDL_MAX_ROWS", 64)]), "topk_pdl": _topk_pdl,
    "wq_b_cap128": _wq_b_cap(128), "wq_b_cap112": _wq_b_cap(112), "wq_b_cap104": _wq_b_cap(104),
    "wq_b_cap88": _wq_b_cap(88), "wq_b_cap80": _wq_b_cap(80),
    "wq_b_mm_cap104": _wq_b_cap(104, "mma", 16), "wq_b_mm_cap96": _wq_b_cap(96, "mma", 16),
    "wq_b_slack_cap80": _together(_wq_b_cap(80), _wq_b_slack),
    "idx_gemm_first": _idx_gemm_first, "idx_gemm_first_cap80": _together(_wq_b_cap(80), _idx_gemm_first),
    "no_norm_pdl": _layer_flag("norm_pdl", False), "no_boundary_pdl": lambda step: _swap([(step, "boundary_pdl", False)]),
    "skip_pair": _skip(attention_mod, "rms_norm_pair_"), "skip_boundary": _skip(BoundaryOperands, "launch"),
    "skip_mixer": _skip(boundary_mod, "hc_mix_"), "skip_mla": _skip(attention_mod, "sparse_mla_launch"),
}


def _advance_times(step, req, calls: int, blocks: int = 5) -> list[float]:
    """us per public call `step(x, [(req, 1)])`, `calls` calls back to back, each advancing request
    `req` by one token: the time between CUDA events recorded after each call on the device's
    timeline (the step's work, and any gap where the host's part of a call falls behind it); the
    medians of `blocks` equal runs of calls, in order."""
    cfg = step.cfg
    x = torch.randn(1, cfg.hc_mult, cfg.dim, generator=torch.Generator(device="cuda").manual_seed(3),
                    device="cuda").to(torch.bfloat16)
    marks = [torch.cuda.Event(enable_timing=True) for _ in range(calls + 1)]
    torch.cuda.synchronize()
    marks[0].record()
    for k in range(calls):
        step(x, [(req, 1)])
        marks[k + 1].record()
    torch.cuda.synchronize()
    us = [marks[k].elapsed_time(marks[k + 1]) * 1e3 for k in range(calls)]
    size = max(1, calls // blocks)
    return [statistics.median(us[i:i + size]) for i in range(0, size * blocks, size) if us[i:i + size]]


def _gpu_state() -> str:
    """' | SM clock, temperature, power' as NVML samples them just after a variant's timing (the
    drift of later recaptures: clocks or not), or '' where NVML is not available."""
    try:
        return (f" | {torch.cuda.clock_rate()} MHz, {torch.cuda.temperature()} C, "
                f"{torch.cuda.power_draw() / 1000:.0f} W")
    except Exception:       # no pynvml (or no NVML): the line without it
        return ""


def _against_first(first, out):
    """(the first output, whether `out` is bitwise it: "-" for the first itself)."""
    return (out, "-") if first is None else (first, str(torch.equal(out, first)))


def _in_processes(names: list[str], passes: int) -> None:
    """`--processes=1`: each (pass, variant) in a fresh process of this script (the other options
    passed on; --timeline=DIR as DIR/p<pass>), its output printed as it comes, its 8-row output
    compared bitwise with the first child's."""
    rest = [a for a in sys.argv[1:] if not a.startswith(("--variants=", "--passes=", "--processes=", "--timeline="))]
    timeline = arg("timeline", "")
    first = None
    with tempfile.TemporaryDirectory() as tmp:
        for p in range(passes):
            for name in names:
                bits = Path(tmp) / f"{p}-{name}.safetensors"
                extra = [f"--timeline={Path(timeline) / f'p{p}'}"] if timeline else []
                done = subprocess.run([sys.executable, __file__, f"--variants={name}", f"--out-bits={bits}", *rest,
                                       *extra], check=False)
                if done.returncode:
                    raise SystemExit(f"variant {name} (pass {p}): its process exited with {done.returncode}")
                first, same = _against_first(first, load_file(str(bits))["out"])
                print(f"  {name} (pass {p}, own process): 8-row output == the first process's: {same}", flush=True)


def main() -> None:
    names = arg("variants", ",".join([*PRIORITIES, *PATCHES])).split(",")
    unknown = [v for v in names if v not in PRIORITIES and v not in PATCHES]
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; known: {[*PRIORITIES, *PATCHES]}")
    processes, out_bits, out_times = arg("processes", "0"), arg("out-bits", ""), arg("out-times", "")
    if processes not in ("0", "1"):
        raise SystemExit(f"--processes must be 0 or 1, got {processes!r}")
    if processes == "1":
        if out_times or out_bits:
            raise SystemExit("--out-times / --out-bits write one process's results: drop them with --processes=1 "
                             "(it compares its children's outputs itself), or run with --processes=0")
        _in_processes(names, int(arg("passes", "1")))
        return
    rows = tuple(int(r) for r in arg("rows", "1,8,16,64").split(","))
    timeline = arg("timeline", "")
    advance = int(arg("advance", "0"))
    if advance < 0:
        raise SystemExit(f"--advance must be >= 0, got {advance}")
    print("stream priority range (least, greatest):", torch.cuda.Stream.priority_range(), flush=True)
    cfg = ModelConfig.preset("v41-flash")
    stack = AttentionStack(random_checkpoint(cfg, "cuda"))
    n = max(max(rows), 8)
    # with --advance, each (pass, variant) advances a request of its own ("adv<k>", 32768 tokens when its turn
    # comes), so the timed requests 0..n-1 stay where they are for every variant
    runs = len(names) * int(arg("passes", "1")) if advance else 0
    state = DecodeState(cfg, max_requests=n + runs, max_context=32768 + 1024 + advance, page_size=64, device="cuda",
                        max_drafts=3)
    fill_state(state, {i: 32768 for i in range(n)})
    step = stack.decode_step(state, max_rows=n, buckets=tuple(sorted(set(rows) | {8})))
    first, times = None, {}
    for k, name in enumerate(names * int(arg("passes", "1"))):
        cap, aux = PRIORITIES.get(name, DEFAULT_PRIORITIES)
        step.lanes._aux = [torch.cuda.Stream("cuda", priority=p) for p in aux + (aux[2],)]   # weights: index's
        step.lanes.capture = torch.cuda.Stream("cuda", priority=cap)
        patch = PATCHES.get(name)
        undo = patch(step) if patch else (lambda: None)
        step.graphs = {}
        step._capture()
        undo()
        out, t = output_and_times(step, rows)
        if out_bits:
            save_file({"out": out.cpu().contiguous()}, out_bits)
        for r in rows:
            times.setdefault(name, {}).setdefault(str(r), []).append(round(t[r], 2))
        if out_times:
            Path(out_times).write_text(json.dumps(times, indent=1) + "\n")
        first, same = _against_first(first, out)
        print(f"{name:14s} capture {cap:2d} lanes {aux} | " + "  ".join(f"{r}: {t[r]:8.1f}" for r in rows)
              + f" us | 8-row output == first variant's: {same}{_gpu_state()}", flush=True)
        if advance:
            fill_state(state, {f"adv{k}": 32768}, seed=k + 1)
            print(f"  {advance} advancing 1-row calls, us per call by fifths: "
                  + " / ".join(f"{t:.1f}" for t in _advance_times(step, f"adv{k}", advance)) + _gpu_state(),
                  flush=True)
        if timeline:
            bucket = step.prepare([(0, 1)], torch.randn(1, cfg.hc_mult, cfg.dim, device="cuda").bfloat16())
            Path(timeline).mkdir(parents=True, exist_ok=True)
            kernels = replay_kernels(step.graphs[bucket], Path(timeline) / f"{name}.json")
            print(f"  {len(kernels)} kernels in {(kernels[-1]['ts'] + kernels[-1]['dur'] - kernels[0]['ts']):.1f} us",
                  flush=True)
            print("\n".join(_norm_gaps(kernels)), flush=True)


if __name__ == "__main__":
    main()
