"""Probe `ops.gluon_mm.GluonMM`'s configurations on a GPU (sm_90), in one run of about two minutes:
the MMA pipelines ("pairs", "slot", "ahead"), one or two consumer warpgroups, 128- or 256-deep
ring slots and ring depths (`GluonMMConfig`), each at the K splits worth trying per shape, on the
four TP1 linears of the step (wq_b, wo_b, the indexer's wq_b, the fused wq_a|wkv) at rows 1, 4, 8,
16, 32, 64, next to today's default plan and `torch._scaled_mm` (one scale per tensor: a speed
reference). CUDA-graph replay over weight copies rotated beyond L2 (as `bench gemm`), median; us
and % of the streaming read measured in the same run (the bytes `bench gemm` counts: weights,
scales, activation, output).

Every candidate's output is compared bit for bit with the "pairs" plan of the same split bounds
(slot depth and split: the bits depend on nothing else; "bits" in the lines, must be "=").

First the kernels are compiled in parallel worker processes (Triton's disk cache then serves the
main process), then each shape is timed; the run stops timing when `--budget=` seconds (default
120) have passed and prints what it has. Prints the lines per (shape, rows), the best
configuration per (shape, rows), and the best single configuration per shape over every row count
(the split may not depend on the rows: batch invariance). `--only=wq_b_tp2,wo_b_tp8,...` times the
TP shards instead. Writes nothing. `PROBE_DRY=1` runs the
script on the CPU with small shapes, the reference in place of the kernel and wall-clock times:
it checks the script, not the kernel. Options: `--only=wq_b,wo_b`,
`--rows=1,16`, `--budget=120`, `--workers=14`, `--replays=20`, `--compile_timeout=60` (seconds for all
the workers' compiles and runs; a configuration not done by then is not timed), `--match=/T,/P`
(only the configurations whose label holds one of these, besides the "pairs" references; labels:
mode/wg/k/s[/P persistent[N programs per SM]][/rN register cap][/T retiled]/split).
"""

from __future__ import annotations

import dataclasses
import dataclasses
import math
import multiprocessing as mp
import os
import statistics
import time
from concurrent.futures import ProcessPoolExecutor, wait

import torch

from dsv41_decode.bench.floor import read_bandwidth_gbps
from dsv41_decode.bench.gemm import Shape
from dsv41_decode.bench.timing import graph_time_us, l2_rotation
from dsv41_decode.formats import fp8_block_quantize
from dsv41_decode.formats import mxfp8_quantize
from dsv41_decode.ops import gluon_mm as G
from dsv41_decode.ops.gluon_mm import ROW_BUCKETS, GluonMM, GluonMMConfig
from dsv41_decode.reference.linear import mxfp8_mm

from _args import arg   # scripts/ is on sys.path when run as python scripts/<probe>.py

DRY = os.environ.get("PROBE_DRY") == "1"
DEV = "cpu" if DRY else "cuda"
SHAPES = {"wq_b": Shape("wq_b", 32768, 1280), "wo_b": Shape("wo_b", 5120, 8192),
          "idx_wq_b": Shape("idx_wq_b", 4096, 1280), "fused_wqa_wkv": Shape("fused_wqa_wkv", 1792, 5120),
          # the TP shards (wq_b's TP8 shard is the indexer's shape): only with --only=
          "wq_b_tp2": Shape("wq_b", 16384, 1280, tp=2), "wq_b_tp4": Shape("wq_b", 8192, 1280, tp=4),
          "wo_b_tp2": Shape("wo_b", 5120, 4096, tp=2), "wo_b_tp4": Shape("wo_b", 5120, 2048, tp=4),
          "wo_b_tp8": Shape("wo_b", 5120, 1024, tp=8)}
TP1 = ("wq_b", "wo_b", "idx_wq_b", "fused_wqa_wkv")
if DRY:
    SHAPES = {name: Shape(name, 256, s.k) for name, s in SHAPES.items()}
# K splits requested per shape (the same counts for every variant: with two warpgroups a split
# count makes half as many programs). wq_b: 512 (256) tiles already fill the GPU; the others need
# splits, around the default rule's (wo_b 3, idx 4, fused 9 for 64-row tiles).
# wq_b's 5 and wo_b's 16 splits: two- and four-step items, for the persistent grid's balance.
SPLITS = {"wq_b": (1, 2, 5), "wo_b": (2, 3, 4, 8, 16), "idx_wq_b": (2, 4, 5), "fused_wqa_wkv": (4, 8, 16),
          "wq_b_tp2": (1, 2, 5), "wq_b_tp4": (1, 2, 5), "wo_b_tp2": (2, 4, 8), "wo_b_tp4": (2, 4, 8),
          "wo_b_tp8": (2, 4, 8)}
# Today's pipeline, the deeper MMA modes, two consumer warpgroups, 256-deep slots, a deeper ring,
# the persistent grid (also at 2 programs per SM), 4 CTAs per SM (64 registers, up to 32 rows), the
# tile-contiguous weight copy. The split is set per shape (SPLITS).
C = GluonMMConfig
VARIANTS = [C(), C(mma="slot"), C(mma="ahead"), C(mma="ahead", stages=6), C(warpgroups=2),
            C(warpgroups=2, mma="slot"), C(block_k=256, stages=3), C(block_k=256, stages=3, mma="slot"),
            C(persistent=True), C(mma="ahead", persistent=True), C(mma="ahead", stages=6, persistent=True),
            C(warpgroups=2, persistent=True), C(warpgroups=2, mma="slot", persistent=True),
            C(maxnreg=64), C(mma="slot", maxnreg=64), C(retile=True), C(block_k=256, stages=3, retile=True),
            C(warpgroups=2, persistent=True, retile=True), C(persistent=True, programs_per_sm=2),
            C(persistent=True, programs_per_sm=1, stages=8)]
# The "pairs" plans every other configuration's bits are compared with (same split bounds).
REFS = {128: C(), 256: C(block_k=256, stages=3)}
ROWS = (1, 4, 8, 16, 32, 64)
CONFIGS: dict[str, GluonMMConfig] = {}    # label -> config, of what was timed


def label(config: GluonMMConfig) -> str:
    return (f"{config.mma}/wg{config.warpgroups}/k{config.block_k}/s{config.stages}"
            f"{'/P' if config.persistent else ''}{f'{config.programs_per_sm}' if config.programs_per_sm else ''}"
            f"{f'/r{config.maxnreg}' if config.maxnreg else ''}{'/T' if config.retile else ''}/split{config.split}")


class _DryPlan:
    """PROBE_DRY's stand-in for GluonMM on the CPU: the plan's split, grid and config as an H200's
    (132 SMs), the reference's output."""

    def __init__(self, weight, w_scale, config=None):
        self.weight, self.w_scale = weight, w_scale
        self.config = config or G.default_config(*weight.shape)
        n, k = weight.shape
        bn, bk = self.config.block_n, self.config.block_k
        want = self.config.split or G._default_split(n, k, 132, bn, bk)
        self.k_per_split, self.split = G.split_bounds(want, k, bk)
        self.grid = (-(-n // bn), self.split)

    def launch_grid(self, block_t):
        items = self.grid[0] * self.grid[1]
        per_sm = min(self.config.programs_per_sm or 64, G.resident_ctas(self.config, block_t))
        return (min(items, 132 * per_sm), 1) if self.config.persistent else self.grid

    def block_t(self, rows):
        return next(b for b in ROW_BUCKETS if b >= rows)

    def __call__(self, codes, x_scale, out=None):
        y = mxfp8_mm(codes, x_scale, self.weight, self.w_scale)
        return y if out is None else out.copy_(y)


Plan = _DryPlan if DRY else GluonMM


def _act(m: int, k: int, g: torch.Generator):
    """MXFP8 codes and scales of a random [m, k] activation."""
    return mxfp8_quantize(torch.randn(m, k, generator=g, device=DEV).to(torch.bfloat16))


def _weights(shape: Shape, copies: int, g: torch.Generator):
    """`copies` random FP8 weights with 32x32 UE8M0 scales (as `bench gemm`)."""
    return [fp8_block_quantize(torch.randn(shape.n, shape.k, generator=g, device=DEV) * shape.k ** -0.5)
            for _ in range(copies)]


def _time(fn, copies: int, replays: int) -> float:
    """Median us per call of `fn` (which makes `copies` calls): CUDA-graph replay, or (PROBE_DRY)
    the wall clock."""
    if not DRY:
        return graph_time_us(fn, calls_per_graph=copies, replays=replays)
    times = []
    for _ in range(3):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e6 / copies)
    return statistics.median(times)


def _operands(m: int, n: int, k: int, seed: int):
    g = torch.Generator(device=DEV).manual_seed(seed)
    q, s = _weights(Shape("task", n, k), 1, g)[0]
    codes, sx = _act(m, k, g)
    return codes, sx, q, s


def compile_task(variant: GluonMMConfig, bt: int, split_k: bool):
    """Compile one (configuration, row bucket, split-K or not) by launching it on a small problem (the
    launcher's specialization is the real shapes': N a multiple of 16, the rest not specialized); a
    persistent one on wq_b's shape, so that its programs take several items each."""
    try:
        t = time.time()
        codes, sx, q, s = _operands(bt, 32768 if variant.persistent else 256, 1280, 1)
        plan = Plan(q, s, config=dataclasses.replace(variant, split=2 if split_k else 1))
        assert (plan.split > 1) == split_k and plan.block_t(bt) == bt
        plan(codes, sx)
        if not DRY:
            torch.cuda.synchronize()
        return variant, bt, split_k, time.time() - t, None
    except Exception as e:  # noqa: BLE001 - report, keep probing
        return variant, bt, split_k, 0.0, f"{type(e).__name__}: {str(e)[:300]}"


def precompile(variants, splits_used: set[bool], workers: int, timeout: float) -> set[tuple]:
    """Compile and run every (variant, bucket, split flag) in parallel workers; the ones that failed
    or did not finish within `timeout` seconds (a ring that deadlocks: never timed afterwards)."""
    tasks = [(v, bt, f) for v in variants for bt in ROW_BUCKETS for f in sorted(splits_used)]
    failed = set(tasks)
    ex = ProcessPoolExecutor(max_workers=workers, mp_context=mp.get_context("spawn"))
    futs = [ex.submit(compile_task, *t) for t in tasks]
    done, _ = wait(futs, timeout=timeout)
    for f in done:
        v, bt, flag, secs, err = f.result()
        if err:
            print(f"compile FAIL {v} BT={bt} split_k={flag}: {err}", flush=True)
        else:
            failed.discard((v, bt, flag))
    for t, f in zip(tasks, futs):
        if f not in done:
            print(f"compile+run of {t} did not finish in {timeout:.0f} s: skipped", flush=True)
    hung = len(done) < len(futs)
    for proc in list(getattr(ex, "_processes", {}).values()) if hung else []:
        proc.terminate()         # a worker stuck in a kernel: its context goes with it
    ex.shutdown(wait=not hung, cancel_futures=True)
    print(f"compiled {len(tasks)} kernels in {workers} workers, {len(failed)} failed", flush=True)
    return failed


def main() -> None:
    t0 = time.time()
    names = arg("only", ",".join(TP1)).split(",")
    rows = [int(r) for r in arg("rows", ",".join(map(str, ROWS))).split(",")]
    budget = float(arg("budget", "120"))
    match = [m for m in arg("match", "").split(",") if m]
    variants = [v for v in VARIANTS if not match or any(m in label(v) for m in match) or v in REFS.values()]
    replays = int(arg("replays", "20"))
    failed = precompile(variants, {s > 1 for name in names for s in SPLITS[name]} | {True},
                        int(arg("workers", "2" if DRY else "14")), float(arg("compile_timeout", "60")))
    floor = 4400.0 if DRY else read_bandwidth_gbps()
    print(f"streaming read: {floor:.0f} GB/s on {'the CPU (dry run)' if DRY else torch.cuda.get_device_name()} "
          f"({time.time() - t0:.0f} s in)", flush=True)
    gen = torch.Generator(device=DEV).manual_seed(0)
    results: dict[tuple[str, int], dict[str, float]] = {}     # (shape, rows) -> {label: us}
    base: dict[tuple[str, int], tuple[float, float, str]] = {}   # today's us, _scaled_mm us, today's label
    out_of_time = False
    for name in names:
        shape = SHAPES[name]
        copies = 2 if DRY else l2_rotation(shape.weight_bytes())
        ws = _weights(shape, copies, gen)
        for m in rows:
            if time.time() - t0 > budget:
                out_of_time = True
                break
            nbytes = shape.weight_bytes() + shape.io_bytes(m)
            pct = lambda us: 100 * nbytes / (us * 1e3) / floor   # noqa: E731 - GB/s over the floor
            codes, sx = _act(m, shape.k, gen)
            out = torch.empty(m, shape.n, dtype=torch.bfloat16, device=DEV)

            def timed(plans):
                return _time(lambda: [p(codes, sx, out) for p in plans], copies, replays)

            today = [Plan(q, s) for q, s in ws]
            t_today = timed(today)
            xs = torch.randn(max(16, m), shape.k, generator=gen, device=DEV).to(torch.float8_e4m3fn)
            one = torch.ones((), device=DEV)
            if DRY:     # no FP8 GEMM on the CPU: a BF16 one of the same shape
                t_cublas = _time(lambda: [xs.to(torch.bfloat16) @ q.to(torch.bfloat16).t() for q, _ in ws],
                                 copies, replays)
            else:
                t_cublas = _time(lambda: [torch._scaled_mm(xs, q.t(), scale_a=one, scale_b=one,
                                                           out_dtype=torch.bfloat16) for q, _ in ws],
                                 copies, replays)
            today_label = label(dataclasses.replace(today[0].config, split=today[0].split))
            base[(name, m)] = (t_today, t_cublas, today_label)
            print(f"{name:14s} M={m:2d}  today {today_label:34s} {t_today:7.2f} us ({pct(t_today):4.1f} %)  "
                  f"_scaled_mm {t_cublas:7.2f} us ({pct(t_cublas):4.1f} %)", flush=True)
            del today
            refs: dict[tuple[int, int], torch.Tensor] = {}    # (k_per_split, splits) -> pairs bits
            res = results.setdefault((name, m), {})
            for variant in variants:
                bt = next(b for b in ROW_BUCKETS if b >= m)
                for split in SPLITS[name]:
                    config = dataclasses.replace(variant, split=split)
                    if (variant, bt, split > 1) in failed:
                        continue
                    try:
                        plans = [Plan(q, s, config=config) for q, s in ws]
                        us = timed(plans)
                        y = plans[0](codes, sx).clone()
                        key = (plans[0].k_per_split, plans[0].split)
                        if key not in refs:
                            ref_plan = Plan(*ws[0], config=dataclasses.replace(REFS[config.block_k], split=split))
                            assert (ref_plan.k_per_split, ref_plan.split) == key
                            refs[key] = ref_plan(codes, sx).clone()
                        same = "=" if torch.equal(y.view(torch.int16), refs[key].view(torch.int16)) else "DIFFER"
                        res[label(config)] = us
                        CONFIGS[label(config)] = config
                        print(f"{name:14s} M={m:2d}  {label(config):34s} {us:7.2f} us ({pct(us):4.1f} %)  "
                              f"x{t_today / us:4.2f} today  x{t_cublas / us:4.2f} _scaled_mm  "
                              f"[{plans[0].split} splits, grid {plans[0].launch_grid(bt)}]  "
                              f"bits {same}", flush=True)
                        del plans
                    except Exception as e:  # noqa: BLE001 - report, keep probing
                        print(f"{name} M={m} {label(config)}: {type(e).__name__}: {str(e)[:200]}", flush=True)
        del ws
        if not DRY:
            torch.cuda.empty_cache()
        if out_of_time:
            print(f"(out of time budget {budget:.0f} s: stopped timing at {name})", flush=True)
            break
    summarize(results, base, floor)
    print(f"total {time.time() - t0:.0f} s", flush=True)


def summarize(results, base, floor) -> None:
    print("\nbest per (shape, rows):")
    print(f"{'shape':14s} {'rows':>4s}  {'today us':>8s}  {'best':34s} {'us':>7s} {'% read':>6s} {'x today':>7s} "
          f"{'x _scaled_mm':>12s}")
    for (name, m), res in results.items():
        if not res:
            continue
        best = min(res, key=res.get)
        t_today, t_cublas, _ = base[(name, m)]
        shape = SHAPES[name]
        pct = 100 * (shape.weight_bytes() + shape.io_bytes(m)) / (res[best] * 1e3) / floor
        print(f"{name:14s} {m:4d}  {t_today:8.2f}  {best:34s} {res[best]:7.2f} {pct:6.1f} {t_today / res[best]:7.2f} "
              f"{t_cublas / res[best]:12.2f}")
    print("\nbest single configuration per shape, every row count (geometric mean of us over the rows "
          "measured for every candidate; then the 1-16-row mean):")
    for name in dict.fromkeys(n for n, _ in results):
        per = [(m, res) for (n, m), res in results.items() if n == name and res]
        if not per:
            continue
        common = set.intersection(*(set(res) for _, res in per))
        def gmean(lbl, ms=None):
            xs = [res[lbl] for m, res in per if ms is None or m in ms]
            return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else float("nan")
        ranked = sorted(common, key=gmean)
        today = math.exp(sum(math.log(base[(name, m)][0]) for m, _ in per) / len(per))
        def pct(m, us):
            return 100 * (SHAPES[name].weight_bytes() + SHAPES[name].io_bytes(m)) / (us * 1e3) / floor
        for lbl in ranked[:4]:
            times = "  ".join(f"{m}:{res[lbl]:.2f} ({pct(m, res[lbl]):.0f} %)" for m, res in per)
            print(f"  {name:14s} {lbl:34s} gmean {gmean(lbl):6.2f} us (today {today:6.2f}, x{today / gmean(lbl):4.2f})"
                  f"  1-16 rows {gmean(lbl, (1, 4, 8, 16)):6.2f}  [{times}]")
        print(f"  DEFAULT {name} {SHAPES[name].n}x{SHAPES[name].k}: {CONFIGS[ranked[0]]}")
        print(f"  today   {name}: " + "  ".join(f"{m}:{base[(name, m)][0]:.2f} ({pct(m, base[(name, m)][0]):.0f} %)"
                                             for m, _ in per)
              + "   _scaled_mm: " + "  ".join(f"{m}:{base[(name, m)][1]:.2f}" for m, _ in per))


if __name__ == "__main__":
    main()
