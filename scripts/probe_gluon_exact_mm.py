"""Probe `gluon_exact_mm` on a GPU (sm_90): `GluonExactMM` (the contract-exact linear on the FP64 MMA
or on FP16 MMAs over the codes' digits, in Gluon) in candidate configurations against the other
exact linears - `ExactF64MM` (the FP64 MMA in Triton, its default configurations), `ExactLinear`
(the step's exact linear) and `ExactMM` (CUDA cores, its tuned table) - and
the step's tensor-core FP8 plan `GluonMM` (not exact), at the four V4.1-Flash shapes of the step's
GEMMs (TP1), rows 1, 2, 4, 8, 16, 32, 64: us per call from CUDA-graph replay over weight copies
rotated beyond L2 (as `bench gemm`; median of the replays), % of the streaming read measured in
the same run (the bytes `bench gemm` counts: weight, scales, activations, output), and per line the
bits of every exact op against ExactMM's (must be `=`, 0 differing outputs, on model-like
operands). Then, per shape, heavy-tailed codes (448 down to the subnormals) against
`reference.linear.mxfp8_mm` per configuration; the best GluonExactMM configuration per (shape,
rows) against the three others; per shape the per-row table a plan would take
(`GluonExactMM(config={rows: config})`); each compiled kernel's registers and spills.

Kernels compile first in parallel worker processes (each configuration at each row bucket and
with and without the K split), so the timing loop loads them from Triton's cache; `--budget=` s
(default 480) stops the timing, the summary still prints.

    PYTHONPATH=. python scripts/probe_gluon_exact_mm.py
    PYTHONPATH=. python scripts/probe_gluon_exact_mm.py --rows=1,8,64 --only=wq_b --alt=int:128:32:1:32:4:1

--alt: GluonExactMM configurations convert:block_n:block_m:warps_n:mma_k:stages:split[:maxnreg[:warps_k
[:block_k[:fuse_scales[:pair_slots]]]]] (`GluonExactConfig`; split: K splits for calls of at most min(16,
block_m) rows; maxnreg 0: None, default 128; warps_k default 1; block_k default 128; fuse_scales and
pair_slots 0 or 1, default 0; a configuration the shape cannot take, e.g. pair_slots where K is not a
multiple of 2 x block_k, is reported and skipped).
--fused=1: each configuration also with its fused scaling (`GluonExactConfig.fuse_scales`), e.g. the
step's plan and its fused twin:

    PYTHONPATH=. python scripts/probe_gluon_exact_mm.py --rows=4,8,16,32,64 --fused=1 \
        --alt=f16d:16:8:1:32:4:1:80:4:256,f16d:16:16:1:32:4:1:80:4:256,f16d:128:16:1:32:4:1,f16w:64:32:1:32:4:1:80
`PROBE_DRY=1` runs the script on the CPU at small shapes with the reference in place of every
kernel (checks the script only, no timing worth reading).
"""

from __future__ import annotations

import dataclasses
import math
import multiprocessing as mp
import os
import statistics
import time
from concurrent.futures import ProcessPoolExecutor, wait

import torch

from dsv41_decode.bench.gemm import Shape
from dsv41_decode.formats import fp8_block_quantize, mxfp8_quantize
from dsv41_decode.ops import gluon_exact_mm as E
from dsv41_decode.ops.gluon_exact_mm import GluonExactConfig
from dsv41_decode.reference.linear import mxfp8_mm
from dsv41_decode.testing.synthetic import heavy_e4m3

from _args import arg   # scripts/ is on sys.path when run as python scripts/<probe>.py

DRY = os.environ.get("PROBE_DRY") == "1"
DEV = "cpu" if DRY else "cuda"
SHAPES = {"fused_wqa_wkv": Shape("fused_wqa_wkv", 1792, 5120), "wq_b": Shape("wq_b", 32768, 1280),
          "idx_wq_b": Shape("idx_wq_b", 4096, 1280), "wo_b": Shape("wo_b", 5120, 8192)}
if DRY:
    SHAPES = {name: Shape(name, 256, s.k) for name, s in SHAPES.items()}
ROWS = (1, 2, 4, 8, 16, 32, 64)
# The default ("int", 64 weight rows, up to 32 x rows), then each option moved from it: the "cvt"
# and "raw" conversions, 128 weight rows (up to 16 x rows: more spill at the register cap of 128),
# x's rows across two warps, 16-deep MMA steps, a deeper ring, K splits (the shapes with few weight
# tiles: fused_wqa_wkv 28 of 64 rows, idx_wq_b 64, wo_b 80), 64 x rows a program without a register
# cap, 8 x rows a program at a cap of 80 (3 CTAs per SM, no spills), the weight's conversion
# alternating per K block between the integer forms and "cvt", and combinations of the likely
# winners (sm_90 compiles: per 128-deep slot at 8 x rows and 128 weight rows the consumer's loop
# holds 778 instructions with "cvt", of them 192 quarter-rate F2F, 1037 with "int", 907 with
# "raw").
CANDIDATES = ["int:64:32:1:32:4:1", "cvt:64:32:1:32:4:1", "raw:64:32:1:32:4:1", "cvt:128:16:1:32:4:1",
              "int:128:16:1:32:4:1", "raw:128:16:1:32:4:1", "raw:64:32:2:32:4:1", "int:64:32:2:32:4:1",
              "raw:128:16:1:16:4:1", "int:64:32:1:16:4:1", "raw:128:16:1:32:6:1", "int:64:32:1:32:4:4",
              "raw:64:32:1:32:4:4", "raw:128:16:2:32:3:8", "int:128:16:1:32:4:2", "raw:64:64:2:32:4:1:0",
              "int:64:8:1:32:4:1:80", "raw:64:8:1:32:4:1:80", "raw:128:8:1:32:4:1:80", "int:64:32:1:32:4:8",
              "raw:64:32:1:32:4:8", "raw:64:8:1:32:4:4:80", "int+cvt:64:32:1:32:4:1", "raw+cvt:64:32:1:32:4:1",
              "int+cvt:128:16:1:32:4:1", "raw+cvt:128:8:1:32:4:1:80"]
# The warps along K (`GluonExactConfig.warps_k`: each slot's four K blocks split between the warps,
# their terms added in K order through shared memory), for the shapes with few 64-row tiles (wo_b,
# fused_wqa_wkv, idx_wq_b): 16-row tiles (N / 16 programs; 8 x rows at a cap of 80, 3 CTAs per SM;
# an 8-deep ring of 3 KB slots), 32- and 64-row tiles, 2 x 2 warps, and a K split on top for
# fused_wqa_wkv's 112 tiles of 16, a cap of 64 (4 CTAs per SM), 32 and 64 x rows a program (no
# spills at a cap of 128 with 16-row tiles). sm_90 compiles, the consumer's loop per slot and warp
# (each warp one 32-deep block of every weight row of the tile): 16 rows x 8 x rows "raw" 167
# instructions, 2 DMMA; 32 x 8 265, 4 DMMA; 64 x 8 (mma_k=16) 473, 8 DMMA; 16 x 16 "raw" 234,
# "int+cvt" 204; no spills.
WARPS_K_CANDIDATES = ["raw:16:8:1:32:8:1:80:4", "int:16:8:1:32:8:1:80:4", "int+cvt:16:8:1:16:8:1:80:4",
                      "raw:16:16:1:32:8:1:80:4", "int+cvt:16:16:1:16:8:1:80:4", "raw:32:8:1:32:6:1:128:4",
                      "raw:32:16:1:32:6:1:128:4", "int+cvt:32:16:1:16:6:1:128:4", "raw:64:16:1:16:4:1:128:4",
                      "int:64:16:1:32:4:1:128:2", "raw:16:8:1:32:8:2:80:4", "raw:16:8:1:32:8:1:64:4",
                      "raw:16:32:1:32:6:1:128:4", "int:16:64:1:32:4:1:128:4"]
# The pattern four codes at a time ("rawp", "intp", "intp+cvt": one byte permute a weight code, the
# weight scales once per 16-row MMA tile) and 256-deep ring slots (block_k=256: one barrier round
# per 256 of K; along K each warp two MMA chains), each without spills at its row buckets (sm_90
# compiles; the consumer's loop per 128 of K and warp, instructions per DMMA): warps_k=1 for wq_b -
# 128 x 8 "rawp" 680 (42.5; "raw" 896, 56.0), the same 256-deep at a cap of 128 705 (44.1, half the
# barriers), 64 x 8 at a cap of 64 (4 CTAs per SM: 512 programs in one wave) 432 (54.0), "intp+cvt"
# 128 x 8 797 (49.8), 128 x 16 "rawp" 1071 (33.5) and "intp+cvt" 1055 (33.0; "int+cvt" 1174, 36.7),
# 64 x 16 at a cap of 80 671 (41.9), 64 x 32 "intp+cvt" 976 (30.5); along K for wo_b,
# fused_wqa_wkv, idx_wq_b - 16 x 8 "rawp" 139 (69.5; "raw" 167, 83.5), 256-deep 130 (65.2) at 4 / 6
# stages, a cap of 64 and a K split, with 16-deep steps 122 (61.2), 32 x 8 256-deep with 16-deep
# steps 204 (51.1: four MMA chains a warp, N / 32 programs), 16 x 16 "rawp" 209 (52.2) and
# 256-deep 199 (49.9; with 16-deep steps 195, 48.9), "int+cvt" 256-deep 196 (49.1), 32 x 16
# 256-deep 299 (37.4), 16 x 32 256-deep 341 (42.7), 64 x 16 "rawp" 539 (33.7).
NEW_CANDIDATES = ["rawp:128:8:1:32:4:1:80", "rawp:128:8:1:32:2:1:128:1:256", "rawp:64:8:1:32:4:1:64",
                  "rawp:64:8:1:32:2:1:64:1:256", "intp+cvt:128:8:1:32:4:1:80", "rawp:128:16:1:32:4:1",
                  "intp+cvt:128:16:1:32:4:1", "rawp:64:16:1:32:4:1:80", "intp+cvt:64:32:1:32:4:1",
                  "rawp:16:8:1:32:8:1:80:4", "rawp:16:8:1:32:4:1:80:4:256", "rawp:16:8:1:32:6:1:80:4:256",
                  "rawp:16:8:1:16:4:1:80:4:256", "rawp:16:8:1:32:4:1:64:4:256", "rawp:16:8:1:32:4:2:80:4:256",
                  "rawp:16:16:1:32:8:1:80:4", "rawp:16:16:1:32:4:1:80:4:256", "int+cvt:16:16:1:16:4:1:80:4:256",
                  "rawp:16:16:1:16:4:1:80:4:256", "rawp:32:8:1:16:4:1:80:4:256",
                  "rawp:32:16:1:16:4:1:128:4:256", "rawp:16:32:1:32:4:1:128:4:256", "rawp:64:16:1:16:4:1:128:4"]
# The FP16 digits ("f16d": four FP16 MMAs a block on the codes' two exact digits, mma.sync; "f16w" /
# "f16wp": the same on wgmma): 128-row tiles up to 16 x rows, 64 x 32 above, a K split, 256-deep
# slots, the warps along K on 16- and 32-row tiles for the shapes with few weight rows; the best of
# runs C, E and G of docs/results/gpu-tests-h200.txt as of 55c49a1 and of its runs D-I (docs/gemm.md,
# "Exactness") among them.
DIGIT_CANDIDATES = ["f16d:128:8:1:32:4:1:80", "f16d:128:16:1:32:4:1", "f16d:64:32:2:32:4:1",
                    "f16d:64:8:1:32:4:4:80", "f16d:128:8:1:32:3:1:128:1:256", "f16d:16:8:1:32:4:1:80:4:256",
                    "f16d:16:16:1:32:4:1:80:4:256", "f16d:32:8:1:32:4:1:80:4:256", "f16d:32:16:1:32:4:1:128:4",
                    "f16w:64:32:1:32:4:1", "f16wp:64:32:1:32:4:1", "f16wp:64:8:1:32:4:1", "f16d:64:8:1:32:4:1:80:1:256"]


def config_of(spec: str) -> GluonExactConfig:
    return GluonExactConfig.from_spec(spec)


class _DryPlan:
    """PROBE_DRY's stand-in for every plan on the CPU: the reference's output, after GluonExactMM's
    checks of K against the configurations (so that a dry run refuses what the GPU run would)."""

    def __init__(self, weight, w_scale, max_rows=64, config=None):
        self.weight, self.w_scale = weight, w_scale
        for c in (config.values() if isinstance(config, dict) else [config]):
            if isinstance(c, GluonExactConfig):
                E.check_depth(c, *weight.shape)

    def __call__(self, codes, x_scale, out=None):
        y = mxfp8_mm(codes, x_scale, self.weight, self.w_scale)
        return y if out is None else out.copy_(y)


if DRY:
    GluonExactMM = ExactF64MM = ExactMM = ExactLinear = GluonMM = _DryPlan
else:
    from dsv41_decode.ops.exact_f64_mm import ExactF64MM
    from dsv41_decode.ops.exact_linear import ExactLinear
    from dsv41_decode.ops.exact_mm import ExactMM
    from dsv41_decode.ops.gluon_exact_mm import GluonExactMM
    from dsv41_decode.ops.gluon_mm import GluonMM


def _time(fn, copies: int, replays: int) -> float:
    """Median us per call of `fn` (which makes `copies` calls): CUDA-graph replay, or (PROBE_DRY)
    the wall clock."""
    if not DRY:
        from dsv41_decode.bench.timing import graph_time_us
        return graph_time_us(fn, calls_per_graph=copies, replays=replays)
    times = []
    for _ in range(3):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e6 / copies)
    return statistics.median(times)


def _kernels(fn=E._gluon_exact_mm_kernel) -> dict:
    """The kernels of the Gluon function `fn` compiled in this process so far: key -> CompiledKernel."""
    caches = getattr(fn, "device_caches", {})
    return dict(caches[torch.cuda.current_device()][0]) if caches else {}


def compile_task(spec: str, rows: int, split_k: bool):
    """Compile and run one (configuration, row bucket, split or not) on a small problem (the
    launcher's specializations are the real shapes': N a multiple of 16); returns (spec, rows,
    split_k, seconds, [(registers, spills) of the kernels it compiled], error or None)."""
    try:
        t = time.time()
        g = torch.Generator(device=DEV).manual_seed(1)
        # K = 1536: a multiple of every configuration's unit (block_k, twice it with pair_slots)
        weight, w_scale = fp8_block_quantize(torch.randn(256, 1536, generator=g, device=DEV) * 0.03)
        codes, x_scale = mxfp8_quantize(torch.randn(rows, 1536, generator=g, device=DEV).to(torch.bfloat16))
        cfg = config_of(spec)
        if not split_k:
            cfg = dataclasses.replace(cfg, split=1)
        elif cfg.split == 1 or rows > E.split_rows(cfg):
            return spec, rows, split_k, 0.0, [], None          # never launched so
        before = set(_kernels()) if not DRY else set()
        GluonExactMM(weight, w_scale, 64, config=cfg)(codes, x_scale)
        if DRY:
            return spec, rows, split_k, time.time() - t, [], None
        torch.cuda.synchronize()
        try:
            regs = [(k.n_regs, k.n_spills) for key, k in _kernels().items() if key not in before]
        except Exception as e:  # noqa: BLE001 - the bookkeeping, not the kernel: report, keep it
            regs = [f"registers unknown: {type(e).__name__}"]
        return spec, rows, split_k, time.time() - t, regs, None
    except Exception as e:  # noqa: BLE001 - report, keep probing
        return spec, rows, split_k, 0.0, [], f"{type(e).__name__}: {str(e)[:300]}"


def precompile(specs: list[str], rows: list[int], workers: int, timeout: float) -> set[tuple[str, int]]:
    """Compile and run every (configuration, row bucket used, split flag) in parallel workers;
    prints each kernel's registers and spills; returns the (spec, bucket) that failed or did not
    finish within `timeout` s (never timed afterwards)."""
    tasks = [(s, bt, f) for s in specs for bt in sorted({E.block_t(m, config_of(s)) for m in rows})
             for f in (False, True)]
    ex = ProcessPoolExecutor(max_workers=workers, mp_context=mp.get_context("spawn"))
    futs = [ex.submit(compile_task, *t) for t in tasks]
    done, _ = wait(futs, timeout=timeout)
    bad = set()
    for f in done:
        spec, bt, flag, secs, regs, err = f.result()
        if err:
            bad.add((spec, bt))
            print(f"compile FAIL {spec} rows={bt} split={flag}: {err}", flush=True)
        elif regs:
            print(f"compiled {spec} rows={bt} split={flag}: {secs:.1f} s, registers/spills {regs}", flush=True)
    for t, f in zip(tasks, futs):
        if f not in done:
            bad.add((t[0], t[1]))
            print(f"compile+run of {t} did not finish in {timeout:.0f} s: skipped", flush=True)
    hung = len(done) < len(futs)
    for proc in list(getattr(ex, "_processes", {}).values()) if hung else []:
        proc.terminate()         # a worker stuck in a kernel (a ring that deadlocks): its context goes with it
    ex.shutdown(wait=not hung, cancel_futures=True)
    print(f"compiled {len(tasks)} (configuration, rows, split) in {workers} workers, "
          f"{len({s for s, _ in bad})} configuration(s) with a failure", flush=True)
    return bad


def pct_of_floor(shape: Shape, m: int, us: float, floor: float) -> float:
    """% of the streaming read (`floor` GB/s) a call of m rows at `shape` in `us` reaches, by the
    bytes `bench gemm` counts (weight, scales, activations, output)."""
    return 100 * (shape.weight_bytes() + shape.io_bytes(m)) / (us * 1e3) / floor


def probe(t0: float, op: str, make, shape_specs: dict[str, list[str]], others, rows: list[int], bits_op: str,
          versus: tuple[str, ...], spec_width: int, row_width: int, heavy_rows: tuple[int, ...],
          skip=lambda spec, m: False, after_rows=lambda: None):
    """The timing and bit checks of an exact op's configurations (this probe's and
    probe_gluon_exact_fma's): per shape of `shape_specs` (name -> spec strings), weight copies
    rotated beyond L2, the plans of `others(weights)` ({op name: a plan per copy}; "exact_mm" the
    bits every line is compared with), then per row count in `rows` (until --budget= s after t0)
    their us and `bits_op`'s bits, and per spec `make(weight, w_scale, spec)`'s plans: us, % of the
    read, x against each of `versus`, bits (not timed where `skip(spec, m)`); `after_rows()` after
    each row count; then per spec heavy-tailed codes at the row counts `heavy_rows` against
    `reference.linear.mxfp8_mm`. Lines print `op`'s spec in `spec_width` characters and the rows in
    `row_width`. --replays= graph replays a timing (default 20). Returns (results: (shape, rows) ->
    {spec: us} of the specs bitwise ExactMM, base: (shape, rows) -> {op: us}, the streaming read
    in GB/s)."""
    replays = int(arg("replays", "20"))
    budget = float(arg("budget", "480"))
    if DRY:
        floor = 4400.0
    else:
        from dsv41_decode.bench.floor import read_bandwidth_gbps
        from dsv41_decode.bench.timing import l2_rotation
        floor = read_bandwidth_gbps()
    print(f"streaming read: {floor:.0f} GB/s on {'the CPU (dry run)' if DRY else torch.cuda.get_device_name()} "
          f"({time.time() - t0:.0f} s in)", flush=True)
    g = torch.Generator(device=DEV).manual_seed(0)
    results: dict[tuple[str, int], dict[str, float]] = {}       # (shape, rows) -> {spec: us}
    base: dict[tuple[str, int], dict[str, float]] = {}          # (shape, rows) -> {op: us}
    out_of_time = False
    for name, specs in shape_specs.items():
        shape = SHAPES[name]
        n, k = shape.n, shape.k
        copies = 2 if DRY else l2_rotation(shape.weight_bytes())
        ws = [fp8_block_quantize(torch.randn(n, k, generator=g, device=DEV) * k ** -0.5) for _ in range(copies)]
        plans_of = others(ws)
        print(f"{name}: N={n} K={k}, {copies} weight copies", flush=True)
        for m in rows:
            if time.time() - t0 > budget:
                out_of_time = True
                break
            codes, x_scale = mxfp8_quantize(torch.randn(m, k, generator=g, device=DEV).to(torch.bfloat16))
            out = torch.empty(m, n, dtype=torch.bfloat16, device=DEV)
            ref = plans_of["exact_mm"][0](codes, x_scale).view(torch.int16).clone()

            def timed(plans):
                return _time(lambda: [p(codes, x_scale, out) for p in plans], copies, replays)

            def differ(plan) -> str:
                bad = int((plan(codes, x_scale).view(torch.int16) != ref).sum())
                return "=" if bad == 0 else f"{bad} DIFFER"

            b = base[(name, m)] = {o: timed(plans) for o, plans in plans_of.items()}
            line = "  ".join(f"{o} {us:7.2f} ({pct_of_floor(shape, m, us, floor):4.1f} %)" for o, us in b.items())
            print(f"{name:14s} M={m:{row_width}d}  {line}  {bits_op} bits {differ(plans_of[bits_op][0])}", flush=True)
            res = results.setdefault((name, m), {})
            for spec in specs:
                if skip(spec, m):
                    continue
                try:
                    plans = [make(w, s, spec) for w, s in ws]
                    bits = differ(plans[0])
                    us = timed(plans)
                    del plans
                except Exception as e:  # noqa: BLE001 - report, keep probing
                    print(f"{name} M={m} {spec}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                    continue
                if bits == "=":
                    res[spec] = us
                ratios = "  ".join(f"x{b[o] / us:4.2f} {o}" for o in versus)
                print(f"{name:14s} M={m:{row_width}d}  {spec:{spec_width}s} {us:7.2f} us "
                      f"({pct_of_floor(shape, m, us, floor):4.1f} %)  {ratios}  bits {bits}", flush=True)
            after_rows()
        # Heavy-tailed codes (448 down to the subnormals), where an inexact block sum shows.
        hc, hw = heavy_e4m3((heavy_rows[-1], k), g), heavy_e4m3((n, k), g)
        sx = torch.randint(120, 134, (heavy_rows[-1], k // 32), dtype=torch.uint8, device=DEV)
        href = mxfp8_mm(hc, sx, hw, ws[0][1]).view(torch.int16)
        which = f" (rows {heavy_rows[0]}-{heavy_rows[-1]})" if len(heavy_rows) > 1 else ""
        for spec in specs:
            try:
                plan = make(hw, ws[0][1], spec)
                bad = sum(int((plan(hc[:m], sx[:m]).view(torch.int16) != href[:m]).sum()) for m in heavy_rows)
                print(f"heavy {name} {spec}: {bad} outputs differ from the reference{which}", flush=True)
            except Exception as e:  # noqa: BLE001
                print(f"heavy {name} {spec}: {type(e).__name__}: {str(e)[:200]}", flush=True)
        del ws, plans_of
        if not DRY:
            torch.cuda.empty_cache()
        if out_of_time:
            print(f"(out of time budget {budget:.0f} s: stopped timing at {name})", flush=True)
            break
    return results, base, floor


def summarize(results, base, floor, op: str, columns, spec_width: int, covering: int,
              gmean_ops: tuple[str, ...] = ()) -> None:
    """`probe`'s summary: the best configuration of `op` per (shape, rows) with its us and % of the
    read, per entry of `columns` (op name, header, width, ratio header, ratio width) that op's us
    and its ratio to the best, ExactLinear's us and the tensor-core plan's (and the best's ratio to
    it); per shape the per-row table a plan would take (`op(config={rows: config})`, the largest
    key covering `covering` rows); with `gmean_ops`, per shape the best single configuration by the
    geometric mean over the rows every candidate ran, and those ops' means."""
    print(f"\nbest {op} configuration per (shape, rows), bitwise ExactMM's:")
    heads = "".join(f" {head:>{w}s} {xhead:>{xw}s}" for _, head, w, xhead, xw in columns)
    print(f"{'shape':14s} {'rows':>4s}  {'best':{spec_width}s} {'us':>7s} {'% read':>6s}{heads} {'linear':>7s} "
          f"{'gluon(TC)':>9s} {'/ TC':>6s}")
    table: dict[str, dict[int, str]] = {}
    for (name, m), res in results.items():
        if not res:
            continue
        best = min(res, key=res.get)
        b, us = base[(name, m)], res[best]
        pct = pct_of_floor(SHAPES[name], m, us, floor)
        cols = "".join(f" {b[o]:{w}.2f} {b[o] / us:{xw}.2f}" for o, _, w, _, xw in columns)
        print(f"{name:14s} {m:4d}  {best:{spec_width}s} {us:7.2f} {pct:6.1f}{cols} {b['exact_linear']:7.2f} "
              f"{b['gluon(TC)']:9.2f} {us / b['gluon(TC)']:6.2f}", flush=True)
        table.setdefault(name, {})[m] = best
    print(f"\nper shape, the best configuration per row count ({op}(config={{rows: config}}), the largest "
          f"key covering {covering}):")
    for name, per in table.items():
        print(f"  {name} {SHAPES[name].n}x{SHAPES[name].k}: " + ", ".join(f"{m}: {spec}" for m, spec in per.items()))
    if not gmean_ops:
        return
    print("\nbest single configuration per shape (geometric mean over the rows every candidate ran):")
    for name in table:
        per = [res for (nm, _), res in results.items() if nm == name and res]
        common = set.intersection(*(set(res) for res in per))
        if not common:
            continue
        gmean = {s: math.exp(sum(math.log(res[s]) for res in per) / len(per)) for s in common}
        best = min(gmean, key=gmean.get)
        others = {o: math.exp(sum(math.log(base[(nm, m)][o]) for (nm, m), res in results.items()
                                  if nm == name and res) / len(per)) for o in gmean_ops}
        print(f"  {name:14s} {best:{spec_width}s} gmean {gmean[best]:7.2f} us; "
              + ", ".join(f"{o} {others[o]:7.2f}" for o in gmean_ops), flush=True)


def main() -> None:
    t0 = time.time()
    rows = [int(r) for r in arg("rows", ",".join(map(str, ROWS))).split(",")]
    names = arg("only", ",".join(SHAPES)).split(",")
    specs = [s for s in arg("alt", ",".join(CANDIDATES + WARPS_K_CANDIDATES + NEW_CANDIDATES + DIGIT_CANDIDATES)
                            ).split(",") if s]
    for s in specs:
        config_of(s)                        # a bad spec fails here, before anything runs
    if arg("fused", "0") == "1":
        # each configuration also with its fused scaling, timed beside it in the same run
        specs += [t for t in (dataclasses.replace(config_of(s), fuse_scales=True).spec for s in specs) if t not in specs]
    failed = precompile(specs, rows, int(arg("workers", "2" if DRY else "14")), float(arg("compile_timeout", "120")))

    def others(ws):
        return {"f64": [ExactF64MM(w, s, 64) for w, s in ws], "exact_mm": [ExactMM(w, s, 64) for w, s in ws],
                "exact_linear": [ExactLinear(w, s, 64) for w, s in ws], "gluon(TC)": [GluonMM(w, s, 64) for w, s in ws]}

    results, base, floor = probe(
        t0, "GluonExactMM", lambda w, s, spec: GluonExactMM(w, s, 64, config=config_of(spec)),
        {name: specs for name in names}, others, rows, "f64", ("f64", "exact_mm", "gluon(TC)"), 24, 2, (16,),
        skip=lambda spec, m: (spec, E.block_t(m, config_of(spec))) in failed)
    summarize(results, base, floor, "GluonExactMM", (("f64", "f64 us", 7, "x f64", 6),
                                                      ("exact_mm", "exact_mm", 8, "x exact", 7)),
              24, 64, gmean_ops=("f64", "exact_mm", "gluon(TC)"))
    print(f"total {time.time() - t0:.0f} s", flush=True)

if __name__ == "__main__":
    main()
