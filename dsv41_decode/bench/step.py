"""`dsv41-decode bench step`: the 40-layer decode step of V4.1-Flash on one GPU, by CUDA-graph replay.

Random weights (`testing.synthetic`), synthetic state at each context (random valid records, no
prefill; built with `max_drafts=3`, as a speculative server would: rings of W + 3 slots, the ratio-2
compressors' row history), one row per request (and, where the largest `--rows` is at least 16,
4 requests x (1 + 3 draft rows), whose acceptance - `DecodeStep.accept` of the patterns 1..4 rows
kept - is timed per step as `step_accept` rows: host wall time from the call to its device work
done (the device synchronized before and after), against the whole step call, `step_call`, as its
baseline); and the public call in a loop:
`step_call` rows, the median wall time per call of `step(x, rows)` called back to back (the device
synchronized before the first call and after the last only), against `graph_replay`, the same rows'
graph replay alone timed just before on the same state. Variants, in the same run:
`full` (the specialized step), `no_overlap` (the same kernels, every lane on the main stream) and
`generic` (the stack's own forward, eager: serial reference ops, tables rebuilt per layer), and at
the generic contexts the options in `VARIANTS` picked by `--variants` (e.g. `wo_a_fp8`: `wo_a`
quantized to FP8 once at build, which changes the numbers).
Each row reports the step time, GB/s and percent of the step floor (design section 5: the bytes a
step must read once over the streaming-read bandwidth measured in the same run); the per-layer-kind
rows time one layer's schedule alone (graph of repeated calls); the memory rows give the device
bytes of weights, caches per request and the step's own buffers.
"""

from __future__ import annotations

import statistics
import time

import torch

from ..config import FULL, REINDEX, SWA, ModelConfig
from ..decode.step import PDL_OPTIONS
from ..ops import LOW_BATCH_MAX_ROWS
from ..stack import AttentionStack
from ..state import DecodeState
from ..testing.synthetic import fill_state, random_checkpoint
from .attn import eager_time_us
from .floor import read_bandwidth_gbps
from .results import format_table, record, run_info, write_jsonl
from .timing import graph_time_us

ROWS = (1, 2, 4, 8, 16, 32, 64)
CONTEXTS = (4096, 32768, 131072)
_SKIP = ("hc_ffn", "ffn_norm")   # the FFN site's tensors: not read by an attention step


def layer_weight_bytes(layer) -> int:
    """Bytes of every tensor of one layer an attention step reads (FFN-site tensors excluded)."""
    return sum(t.numel() * t.element_size() for name, t in layer.w.items() if not name.startswith(_SKIP))


def weight_bytes(stack: AttentionStack) -> int:
    """`layer_weight_bytes` over every layer of the stack."""
    return sum(layer_weight_bytes(layer) for layer in stack.layers.values())


def step_weight_bytes(step, stack: AttentionStack) -> int:
    """`weight_bytes` with each layer's `wo_a` as the step reads it (a step with `wo_a_fp8=True` reads
    its FP8 copy and scales, the bytes a checkpoint that ships `wo_a` in FP8 holds)."""
    total = 0
    for i, layer in stack.layers.items():
        a = step.layers[i]
        wo_a = [t for t in (a.wo_a_w, a.wo_a_s) if t is not None]
        shipped = [t for name, t in layer.w.items() if name.startswith("attn.wo_a.")]
        total += layer_weight_bytes(layer) + sum(t.numel() * t.element_size() for t in wo_a) \
            - sum(t.numel() * t.element_size() for t in shipped)
    return total


def kv_bytes(cfg: ModelConfig, context: int, rows: int) -> int:
    """Cache bytes a step must read for `rows` rows at `context`: window records, selected compressed
    entries, and index keys over the visible entries (Full) or the candidate pool (Reindex)."""
    return sum(kv_bytes_layer(cfg, L, context, rows) for L in range(cfg.n_layers))


def _replay_us(step, bucket: int, replays: int = 20) -> float:
    """Median device time of `step.replay(bucket)` (a prepared step's CUDA graph) over `replays`."""
    step.replay(bucket)
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        step.replay(bucket)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return statistics.median(times)


def _arm(step, rows: list[tuple], gen: torch.Generator) -> int:
    """Prepare a step of `rows` with random streams (`DecodeStep.prepare`: the state is not
    advanced); returns the bucket to replay."""
    n, cfg = sum(c for _, c in rows), step.cfg
    x = torch.randn(n, cfg.hc_mult, cfg.dim, generator=gen, device=step.device).to(torch.bfloat16)
    return step.prepare(rows, x)


def output_and_times(step, rows, replays: int = 30) -> tuple[torch.Tensor, dict[int, float]]:
    """A captured step's x_out for 8 one-token rows of a fixed random input (seed 7), and its us per
    replay (`_replay_us`, median of `replays`) at each row count in `rows`, one-token rows of fresh
    random inputs (seed 1): what the schedule probes compare across variants recaptured on one step.
    The state is not advanced."""
    bucket = _arm(step, [(i, 1) for i in range(8)], torch.Generator(device=step.device).manual_seed(7))
    step.replay(bucket)
    torch.cuda.synchronize()
    out = step.io.x_out[:8].clone()
    gen = torch.Generator(device=step.device).manual_seed(1)
    return out, {r: _replay_us(step, _arm(step, [(i, 1) for i in range(r)], gen), replays=replays) for r in rows}


def _layer_kinds(cfg: ModelConfig) -> dict[str, int]:
    """One representative layer per kind label and ratio (first occurrence)."""
    out: dict[str, int] = {}
    for spec in cfg.plan:
        if spec.layer < cfg.n_layers:
            out.setdefault(f"{spec.label}/r{spec.ratio}", spec.layer)
    return out


# Step variants timed next to the default ("full") one; no_overlap at every context, the others
# only at the generic contexts. wo_a_fp8 changes the numbers (FP8 wo_a quantized at build);
# tc_linears runs the FP8 linears on FP8 tensor cores (outside the contract: truncated block sums,
# spec decision 38), the price of the default's exact linears; fp32_dots the sparse MLA and wo_a
# with FP32 IEEE dots; mix_early every site's mixer right after the boundary in every bucket (the
# step's default enqueues it after the next layer's input projections from MIX_LATE_ROWS rows);
# index_row_group4 the dense indexers' Gluon scorer scoring a request's rows four at a time on each
# key tile it reads (sm_90; the draft rows of the `4x(1+3)` rows); fuse_scales the exact linears'
# GluonExactMM with each block term and its add in one FMA (sm_90, the same bits); pair_slots its
# configurations with the warps along K taking the ring's slots two at a time (sm_90, the same bits);
# no_pdl every kernel launched plainly (the step's default launches each layer's Gluon wo_a by PDL
# after the sparse MLA, at 1-8 rows its exact wq_b after the norm pair, its exact wo_b after wo_a's
# main loops, at 1-2 rows its exact fused wq_a|wkv after the boundary, its norm pair after the fused
# GEMM, its boundary's own launch after wo_b and, where the layer runs its indexer, its sparse MLA after
# the sparse-index table), no_wq_b_pdl, no_wo_b_pdl, no_qkv_pdl, no_norm_pdl, no_boundary_pdl and
# no_mla_pdl one of those plainly (sm_90, the same bits); no_prefetch_records without the
# step's default prefetch of each layer's sparse MLA records into L2 at the layer's start (sm_90, 1
# row, the same bits); same the default step built and
# captured again beside the first (its ratio: the spread a variant's is to be read against).
VARIANTS = {
    "same": {},
    "no_overlap": dict(overlap=False),
    "wo_a_fp8": dict(wo_a_fp8=True),
    "tc_linears": dict(exact_linears=False),
    "fp32_dots": dict(fp32_dots=True),
    "fold_index_chain": dict(fold_index_chain=True),
    "weights_in_index_lane": dict(weights_lane=False),
    "mix_early": dict(mix_late_rows=LOW_BATCH_MAX_ROWS + 1),
    "index_row_group4": dict(index_row_group=4),
    "fuse_scales": dict(fuse_scales=True),
    "pair_slots": dict(pair_slots=True),
    "comp_tail": dict(comp_tail=True),
    "no_pdl": dict.fromkeys(PDL_OPTIONS, False),
    "no_wq_b_pdl": dict(wq_b_pdl=False),
    "no_wo_b_pdl": dict(wo_b_pdl=False),
    "no_qkv_pdl": dict(qkv_pdl=False),
    "no_norm_pdl": dict(norm_pdl=False),
    "no_boundary_pdl": dict(boundary_pdl=False),
    "no_mla_pdl": dict(mla_pdl=False),
    "no_prefetch_records": dict(prefetch_records=False),
}
DEFAULT_VARIANTS = ("no_overlap", "wo_a_fp8", "tc_linears")


def run_step_bench(rows=ROWS, contexts=CONTEXTS, out_dir="out", progress=print, generic_rows=(1, 8),
                   generic_contexts=(32768,), kinds_rows=(1, 8), timeline: bool = True,
                   bench_name: str = "step", extra_variants=DEFAULT_VARIANTS) -> list[dict]:
    """Every variant at every (context, rows); returns and writes the result rows.

    extra_variants: names in VARIANTS timed next to the default step ("full")."""
    unknown = [v for v in extra_variants if v not in VARIANTS]
    if unknown:
        raise ValueError(f"unknown step variants {unknown}; known: {sorted(VARIANTS)}")
    info = run_info()
    floor = read_bandwidth_gbps()
    progress(f"streaming read: {floor:.0f} GB/s on {info['gpu']}")
    cfg = ModelConfig.preset("v41-flash")
    torch.cuda.reset_peak_memory_stats()
    stack = AttentionStack(random_checkpoint(cfg, "cuda"))
    wbytes = weight_bytes(stack)
    progress(f"weights read per step: {wbytes / 1e9:.3f} GB ({wbytes / (floor * 1e9) * 1e6:.0f} us at the floor)")
    gen = torch.Generator(device="cuda").manual_seed(1)
    results: list[dict] = []
    max_rows = max(rows)
    cases = [(f"{n}x1", [(i, 1) for i in range(n)]) for n in rows]
    if max_rows >= 16:
        cases.append(("4x(1+3)", [(i, 4) for i in range(4)]))
    for ctx in contexts:
        state = DecodeState(cfg, max_requests=max_rows, max_context=ctx + 1024, page_size=64, device="cuda",
                            max_drafts=3)
        fill_state(state, {i: ctx for i in range(max_rows)})
        mem_state = sum(state.memory_bytes().values())
        steps = {}
        variants = [("full", {})] + [(v, VARIANTS[v]) for v in extra_variants
                                     if ctx in generic_contexts or v == "no_overlap"]
        for variant, opts in variants:
            progress(f"context {ctx}: building + capturing the {variant} step")
            steps[variant] = stack.decode_step(state, max_rows=max_rows, buckets=rows, **opts)
        times: dict[tuple[str, str], float] = {}
        for name, case_rows in cases:
            for variant, step in steps.items():
                bucket = _arm(step, case_rows, gen)
                times[(name, variant)] = _replay_us(step, bucket)
            n = sum(c for _, c in case_rows)
            base = {v: times[(name, v)] for v in steps if v != "full"}
            if ctx in generic_contexts and n in generic_rows and "+" not in name:
                x = torch.randn(n, cfg.hc_mult, cfg.dim, device="cuda").to(torch.bfloat16)

                def generic(x=x, state=state, case_rows=case_rows):
                    stack.forward(x, state.plan(case_rows), state)
                base["generic"] = eager_time_us(generic, reps=2)
            nbytes = wbytes + kv_bytes(cfg, ctx, n)
            step = steps["full"]
            rec = record(bench_name, {"op": "step_40_layers", "rows": n, "requests": name, "context": ctx,
                                      "tp": 1}, times[(name, "full")], nbytes, floor, base, info)
            rec["memory_mb"] = {"state": round(mem_state / 2**20, 1),     # MiB (the field's unit)
                                "state_per_request": round(mem_state / max_rows / 2**20, 2),
                                "step_buffers": round(sum(step.memory_bytes().values()) / 2**20, 1)}
            results.append(rec)
            progress(f"ctx {ctx} rows {name}: full {times[(name, 'full')]:.1f} us, {base}")
            if "wo_a_fp8" in steps and "+" not in name:
                # the FP8-wo_a layout's own headline: its time against its own (smaller) floor
                fp8_bytes = step_weight_bytes(steps["wo_a_fp8"], stack) + kv_bytes(cfg, ctx, n)
                results.append(record(bench_name, {"op": "step_40_layers", "rows": n, "requests": name,
                                                   "context": ctx, "tp": 1, "wo_a": "fp8"},
                                      times[(name, "wo_a_fp8")], fp8_bytes, floor, {}, info))
        if max_rows >= 16:
            results.append(_accept_cost(steps["full"], ctx, floor, info, gen, bench_name, progress))
        if ctx in generic_contexts:
            results += _kind_breakdown(steps, cfg, ctx, kinds_rows, floor, info, gen, bench_name, progress)
        if timeline and ctx == generic_contexts[0]:
            from .step_timeline import write_timeline
            first = steps["full"].buckets[0]          # 1 row unless --rows leaves it out
            _arm(steps["full"], [(i, 1) for i in range(first)], gen)
            write_timeline(steps["full"], first, out_dir, info, progress)
        # last: the calls advance the state, which the rows above time as filled
        for name, case_rows in cases:
            if "+" not in name:
                nbytes = wbytes + kv_bytes(cfg, ctx, sum(c for _, c in case_rows))
                results.append(_call_cost(steps["full"], case_rows, name, ctx, nbytes, floor, info, gen,
                                          bench_name, progress))
        del steps, state
        torch.cuda.empty_cache()
    peak = torch.cuda.max_memory_allocated() / 2**30
    progress(f"peak GPU memory: {peak:.1f} GiB")
    for r in results:
        r["read_gbps"] = round(floor, 1)
        r["peak_gib"] = round(peak, 1)
    path = write_jsonl(results, out_dir, bench_name)
    from .step_plot import plot_step
    plot_step(results, path.with_suffix(".png"))
    print(format_table(results, ["op", "rows", "requests", "context", "kind", "wo_a"]))
    return results


def _accept_cost(step, ctx, floor, info, gen, bench_name, progress, reps: int = 20) -> dict:
    """`step_accept`: the cost per step of `DecodeStep.accept` after a 4 x (1 + 3 drafts) step
    (each request keeps 1, 2, 3 or 4 rows, rotating): host wall time from the call until its device
    work is done (synchronized before and after), median of `reps`; baseline `step_call`: the whole
    step call (plan, record load, graph replay, advance) timed the same way."""
    rows = [(i, 4) for i in range(4)]
    n, cfg = 16, step.cfg
    call_us, accept_us = [], []
    for k in range(reps):
        x = torch.randn(n, cfg.hc_mult, cfg.dim, generator=gen, device=step.device).to(torch.bfloat16)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step(x, rows)
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        step.accept({i: 1 + (i + k) % 4 for i in range(4)})
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        call_us.append((t1 - t0) * 1e6)
        accept_us.append((t2 - t1) * 1e6)
    us, base = statistics.median(accept_us), statistics.median(call_us)
    progress(f"ctx {ctx} 4x(1+3): accept {us:.1f} us per step (the step call {base:.1f} us)")
    return record(bench_name, {"op": "step_accept", "rows": n, "requests": "4x(1+3)", "context": ctx, "tp": 1},
                  us, 0, floor, {"step_call": base}, info)


def _call_cost(step, rows, name, ctx, nbytes, floor, info, gen, bench_name, progress, calls: int = 10,
               repeats: int = 5) -> dict:
    """`step_call`: the public call's wall time per step, `step(x, rows)` called `calls` times back
    to back (the device synchronized before the first call and after the last only: what the host
    adds that does not overlap the device shows), median over `repeats`; baseline `graph_replay`:
    the same rows' CUDA graph replayed alone (`_replay_us`), on the same state just before. Each
    call advances the state by its rows (1 + calls * repeats steps in all)."""
    n, cfg = sum(c for _, c in rows), step.cfg
    replay = _replay_us(step, _arm(step, rows, gen))
    x = torch.randn(n, cfg.hc_mult, cfg.dim, generator=gen, device=step.device).to(torch.bfloat16)
    step(x, rows)                                   # the outputs' first allocation
    per_call = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            step(x, rows)
        torch.cuda.synchronize()
        per_call.append((time.perf_counter() - t0) / calls * 1e6)
    us = statistics.median(per_call)
    progress(f"ctx {ctx} rows {name}: step call {us:.1f} us per step in a loop, graph replay {replay:.1f} us")
    return record(bench_name, {"op": "step_call", "rows": n, "requests": name, "context": ctx, "tp": 1},
                  us, nbytes, floor, {"graph_replay": replay}, info)


def _kind_breakdown(steps, cfg, ctx, kinds_rows, floor, info, gen, bench_name, progress) -> list[dict]:
    """One layer of each kind alone, full vs the no_overlap variant where it was built (graphs of
    repeated calls). A row count that is not one of the steps' buckets runs in the smallest bucket
    that holds it (its kernels launched at the bucket's rows): the record's case then names the
    bucket ("bucket"), and so does the progress line."""
    out = []
    variants = [v for v in ("full", "no_overlap") if v in steps]
    for n in kinds_rows:
        for label, L in _layer_kinds(cfg).items():
            us = {}
            for variant in variants:
                step = steps[variant]
                bucket = _arm(step, [(i, 1) for i in range(n)], gen)
                us[variant] = graph_time_us(step.layer_call(L, bucket), replays=20, min_calls=8)
            nbytes = layer_weight_bytes(steps["full"].layers[L]) + kv_bytes_layer(cfg, L, ctx, n)
            base = {v: us[v] for v in variants if v != "full"}
            case = {"op": "layer", "kind": label, "layer": L, "rows": n, "context": ctx, "tp": 1}
            if bucket != n:
                case["bucket"] = bucket
            out.append(record(bench_name, case, us["full"], nbytes, floor, base, info))
            where = "" if bucket == n else f" (in the {bucket}-row bucket)"
            progress(f"  layer {L} {label} rows {n}{where}: full {us['full']:.1f} us"
                     + "".join(f", {v} {us[v]:.1f} us" for v in base))
    return out


def kv_bytes_layer(cfg: ModelConfig, layer: int, context: int, rows: int) -> int:
    """`kv_bytes` of one layer."""
    spec = cfg.plan[layer]
    total = min(cfg.window_size, context) * 528
    if spec.kind != SWA:
        n_vis = context // spec.ratio
        total += min(cfg.index_topk, n_vis) * 288
        if spec.kind == FULL:
            total += n_vis * 68
        elif spec.kind == REINDEX:
            total += min(n_vis, cfg.candidate_topk_blocks * cfg.candidate_block_size) * 68
    return total * rows
