"""Probe the Gluon sparse MLA (`ops.gluon_sparse_mla`) on an H200 against the Triton kernel's step
tiling (`SparseMlaPlan.for_step`) and FlashMLA's Hopper sparse decode on the V4 record (when
`flash_mla` imports; `bench.attn`'s baseline): 128 window + 512 compressed keys, CUDA-graph replay.
Per (heads, rows) cell: the time of the Gluon kernel in each configuration of `--configs` (names
in CONFIGS, a `t` suffix with q copied by TMA, `tp` with the second launch by PDL as well; default:
default,lut,spreadv,split4sv,split4svl; the step's: `ops.gluon_sparse_mla.STEP_CONFIGS`, here
split4svl, split2svlc, spreadvlc and at 64 heads pv1d64s3k2t and pv1s4k2t), of the Triton step
tiling and of FlashMLA; the largest error of each Gluon configuration's and of the Triton kernel's
outputs from the reference on the GPU, in BF16 ulps at each head's largest |output| (`ulp_max`; on the
first and last rows: rows are independent, and the reference runs row by row); whether the Gluon
configurations give the same bits as each other on every row (`cfg==`: they must, no configuration
changes a bit) and the first one the Triton kernel's (`==triton`; `--triton=0` leaves the Triton
kernel out, three compilations fewer: its columns then repeat the first configuration's).
`--heads=64,16`, `--rows=1,2,4,8,16,32,64`, `--replays=10`; `--warm=8`: worker processes that
compile and launch every (head count, configuration) at every row count first, in parallel, so that
the timing loop loads its kernels from Triton's cache (`--warm=0`: none; each kernel then compiles
when the timing loop first launches it).

`--phases`: then, for each configuration of `--configs` with the debug phase log
(`GluonSparseMlaConfig.phases`) at each row count of `--phase-rows` (1,64) and the first head count,
one launch's per-program phase durations (median, 90th percentile and max over the programs, us;
each phase from the barrier ending the one before to its own: `ops.gluon_sparse_mla.PHASE_NAMES`),
the programs' start offsets from the first program's start, and the launch's span (first start to
last end, globaltimer; the stamps' barriers make it a little slower than the timed kernel).
Prints; writes nothing. About 100-130 s on an H200 with the defaults compiling in the timing loop
(`--warm=0`; a spread configuration compiles a second kernel for the row counts past the resident
grid); `--warm` compiles them in parallel first."""

from __future__ import annotations

import multiprocessing as mp
import sys
import time
from concurrent.futures import ProcessPoolExecutor, wait
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _args import arg  # noqa: E402

from dsv41_decode.bench.attn import TOPK as K, WINDOW as W, _flash_mla_v4, sparse_mla_inputs  # noqa: E402
from dsv41_decode.bench.timing import graph_time_us  # noqa: E402
from dsv41_decode.ops import gluon_sparse_mla as G  # noqa: E402
from dsv41_decode.ops.sparse_mla import HEAD_DIM, SparseMlaPlan, sparse_mla_  # noqa: E402
from dsv41_decode.reference.attention import sparse_attention_records  # noqa: E402

CONFIGS = {
    "default": G.GluonSparseMlaConfig(),
    "plain": G.GluonSparseMlaConfig(q_buffers=4, fp4_packed=False, prefetch=False),
    "q4": G.GluonSparseMlaConfig(q_buffers=4),
    "noprefetch": G.GluonSparseMlaConfig(prefetch=False),
    "bytes": G.GluonSparseMlaConfig(fp4_packed=False),
    "split2": G.GluonSparseMlaConfig(dim_split=2),
    "split4": G.GluonSparseMlaConfig(dim_split=4),
    "spread": G.GluonSparseMlaConfig(combine="spread"),
    "split2s": G.GluonSparseMlaConfig(dim_split=2, combine="spread"),
    "split4s": G.GluonSparseMlaConfig(dim_split=4, combine="spread"),
    "spreadv": G.GluonSparseMlaConfig(combine="spread", lookback="values"),
    "split2sv": G.GluonSparseMlaConfig(dim_split=2, combine="spread", lookback="values"),
    "split4sv": G.GluonSparseMlaConfig(dim_split=4, combine="spread", lookback="values"),
    "pvp": G.GluonSparseMlaConfig(pv_pipeline=True),
    "spreadvp": G.GluonSparseMlaConfig(combine="spread", lookback="values", pv_pipeline=True),
    "lut": G.GluonSparseMlaConfig(fp4_lut=True),
    "spreadvl": G.GluonSparseMlaConfig(combine="spread", lookback="values", fp4_lut=True),
    "split4svl": G.GluonSparseMlaConfig(dim_split=4, combine="spread", lookback="values", fp4_lut=True),
    "spreadvlc": G.GluonSparseMlaConfig(combine="spread", lookback="values", fp4_lut=True, maxnreg=128),
    "split2svl": G.GluonSparseMlaConfig(dim_split=2, combine="spread", lookback="values", fp4_lut=True),
    "split2svlc": G.GluonSparseMlaConfig(dim_split=2, combine="spread", lookback="values", fp4_lut=True, maxnreg=128),
    "split4svlc": G.GluonSparseMlaConfig(dim_split=4, combine="spread", lookback="values", fp4_lut=True, maxnreg=128),
    # the step's 3-4-row and 5-12-row configurations with their P.V chunks issued asynchronously
    "split2svlcp": G.GluonSparseMlaConfig(dim_split=2, combine="spread", lookback="values", fp4_lut=True, maxnreg=128,
                                          pv_pipeline=True),
    "spreadvlcp": G.GluonSparseMlaConfig(combine="spread", lookback="values", fp4_lut=True, maxnreg=128,
                                         pv_pipeline=True),
    "pv1": G.GluonSparseMlaConfig(combine="pv", fp4_lut=True, maxnreg=128),
    "pv2": G.GluonSparseMlaConfig(combine="pv", fp4_lut=True, maxnreg=128, pv_chunks=2),
    "pv4": G.GluonSparseMlaConfig(combine="pv", fp4_lut=True, maxnreg=128, pv_chunks=4),
    "pv1d64": G.GluonSparseMlaConfig(combine="pv", fp4_lut=True, maxnreg=128, pv_dims=64),
    "pv1d64r80": G.GluonSparseMlaConfig(combine="pv", fp4_lut=True, maxnreg=128, pv_dims=64, pv_maxnreg=80),
    "pv1s3": G.GluonSparseMlaConfig(combine="pv", fp4_lut=True, maxnreg=128, pv_stages=3),
    "pv1d64s3": G.GluonSparseMlaConfig(combine="pv", fp4_lut=True, maxnreg=128, pv_dims=64, pv_stages=3),
    "pv1d64s3r80": G.GluonSparseMlaConfig(combine="pv", fp4_lut=True, maxnreg=128, pv_dims=64, pv_maxnreg=80,
                                          pv_stages=3),
    "pv1s4": G.GluonSparseMlaConfig(combine="pv", fp4_lut=True, maxnreg=128, pv_stages=4),
    # the first launch with two key buffers (64 KB): at a cap of 80 three programs an SM, at 128 two
    "pv1s4k2": G.GluonSparseMlaConfig(combine="pv", fp4_lut=True, maxnreg=80, pv_stages=4, k_buffers=2),
    "pv1s4k2r128": G.GluonSparseMlaConfig(combine="pv", fp4_lut=True, maxnreg=128, pv_stages=4, k_buffers=2),
    "pv1s4k2t": G.GluonSparseMlaConfig(combine="pv", fp4_lut=True, maxnreg=80, pv_stages=4, k_buffers=2, q_tma=True),
    "pv1s4k2tp": G.GluonSparseMlaConfig(combine="pv", fp4_lut=True, maxnreg=80, pv_stages=4, k_buffers=2, q_tma=True,
                                        pv_pdl=True),
    "pv1s4t": G.GluonSparseMlaConfig(combine="pv", fp4_lut=True, maxnreg=128, pv_stages=4, q_tma=True),
    "spreadvlct": G.GluonSparseMlaConfig(combine="spread", lookback="values", fp4_lut=True, maxnreg=128, q_tma=True),
    "split4svlt": G.GluonSparseMlaConfig(dim_split=4, combine="spread", lookback="values", fp4_lut=True, q_tma=True),
    "pv1d64s4r80": G.GluonSparseMlaConfig(combine="pv", fp4_lut=True, maxnreg=128, pv_dims=64, pv_maxnreg=80,
                                          pv_stages=4),
    "pv2d64": G.GluonSparseMlaConfig(combine="pv", fp4_lut=True, maxnreg=128, pv_chunks=2, pv_dims=64),
    # the step's 17-64-row first launch with 64-dim slices in the second launch (eight programs a row,
    # a three-slot ring at a cap of 80: three an SM), without and with PDL: for 16-24 rows, where the
    # 128-dim second launch has four programs a row
    "pv1d64s3k2t": G.GluonSparseMlaConfig(combine="pv", fp4_lut=True, maxnreg=80, k_buffers=2, q_tma=True, pv_dims=64,
                                          pv_maxnreg=80, pv_stages=3),
    "pv1d64s3k2tp": G.GluonSparseMlaConfig(combine="pv", fp4_lut=True, maxnreg=80, k_buffers=2, q_tma=True,
                                           pv_dims=64, pv_maxnreg=80, pv_stages=3, pv_pdl=True),
}


def ulp_max(a: torch.Tensor, ref: torch.Tensor) -> float:
    """The largest error of `a` against `ref` in BF16 ulps at each (row, head)'s largest |ref| (the
    outputs are weighted means of random keys: elements near zero, where a count of ulps in the
    bits' ordering jumps by thousands across the sign, say nothing about the error)."""
    a, ref = a.float(), ref.float()
    top = ref.abs().amax(-1, keepdim=True).clamp_min(2.0 ** -126)
    ulp = torch.exp2(torch.floor(torch.log2(top)) - 7)
    return float(((a - ref).abs() / ulp).amax())


def row_inputs(inputs, rows: int):
    """The first `rows` rows of `sparse_mla_inputs(max_rows, ...)` (pools and sink shared)."""
    q, win, comp, wtab, ctab, sink = inputs
    return q[:rows], win, comp, wtab[:rows], ctab[:rows], sink


def warm_task(heads: int, name: str, rows_list: list[int]) -> tuple[str, int, float, str | None]:
    """In a worker process: configuration `name` launched once at every row count (its kernels
    compiled into Triton's cache, which the timing process then loads); (name, heads, seconds,
    error or None)."""
    t = time.time()
    try:
        gen = torch.Generator(device="cuda").manual_seed(0)
        plan = G.GluonSparseMlaPlan.build(max(rows_list), heads, W, K, "cuda", config=CONFIGS[name])
        inputs = sparse_mla_inputs(max(rows_list), heads, gen)
        for rows in rows_list:
            q, win, comp, wtab, ctab, sink = row_inputs(inputs, rows)
            G.gluon_sparse_mla_(plan, q, win, comp, wtab, ctab, sink, HEAD_DIM ** -0.5, torch.empty_like(q))
        torch.cuda.synchronize()
        return name, heads, time.time() - t, None
    except Exception as e:  # noqa: BLE001 - report; the timing compiles it again (and the check reports it)
        return name, heads, time.time() - t, f"{type(e).__name__}: {str(e)[:300]}"


def warm(heads_list, rows_list, names, workers: int, timeout: float = 300.0) -> None:
    """Every (head count, configuration) compiled and launched once at every row count in `workers`
    worker processes at once (spawned, one CUDA context each), so that the timing loop finds its
    kernels in Triton's cache instead of compiling them one after another; a worker still running
    after `timeout` s is left to the timing loop (terminated)."""
    t0 = time.time()
    ex = ProcessPoolExecutor(max_workers=workers, mp_context=mp.get_context("spawn"))
    futs = [ex.submit(warm_task, h, n, rows_list) for h in heads_list for n in names]
    done, _ = wait(futs, timeout=timeout)
    for f in done:
        name, heads, secs, err = f.result()
        if err:
            print(f"warm: {name} at {heads} heads failed: {err}", flush=True)
    hung = len(done) < len(futs)
    for proc in list(getattr(ex, "_processes", {}).values()) if hung else []:
        proc.terminate()
    ex.shutdown(wait=not hung, cancel_futures=True)
    print(f"warm: {len(futs)} (heads, configuration) in {workers} workers, {time.time() - t0:.1f} s"
          + (f", {len(futs) - len(done)} not finished" if hung else ""), flush=True)


def timings(heads_list, rows_list, names, replays, with_triton=True):
    configs = [CONFIGS[n] for n in names]
    gen = torch.Generator(device="cuda").manual_seed(0)
    scale = HEAD_DIM ** -0.5
    print("us per call (graph replay), then the max error from the reference in BF16 ulps at each head's largest |ref|;"
          " flash_mla at max(64, heads) heads (FlashMLA's V4 record); cfg==: the timed configurations' bits equal"
          " (those the check left out are named after it)")
    print("heads rows | " + " ".join(f"{n:>10s}" for n in names) + "     triton  flash_mla | best/triton best/flash | "
          + " ".join(f"{'ulp ' + n:>14s}" for n in names) + "  ulp triton | cfg== ==triton", flush=True)
    for heads in heads_list:
        gplans = [G.GluonSparseMlaPlan.build(max(rows_list), heads, W, K, "cuda", config=c) for c in configs]
        tplans = SparseMlaPlan.for_step(max(rows_list), heads, W, K, "cuda")
        inputs = sparse_mla_inputs(max(rows_list), heads, gen)
        bad = precheck(gplans, names, inputs, rows_list, scale)
        for rows in rows_list:
            q, win, comp, wtab, ctab, sink = row_inputs(inputs, rows)
            tplan = next(p for p in tplans if rows <= p.max_rows)
            outs, times = [], []
            for name, gplan in zip(names, gplans):
                o = torch.empty_like(q)
                fn = lambda o=o, p=gplan: G.gluon_sparse_mla_(p, q, win, comp, wtab, ctab, sink, scale, o)  # noqa: E731
                if name in bad:            # failed the check: not timed (its column reads nan)
                    times.append(float("nan"))
                    o.copy_(outs[0]) if outs else fn()
                    outs.append(o)
                    continue
                times.append(graph_time_us(fn, replays=replays))
                fn()
                outs.append(o)
            ot = torch.empty_like(q)
            ft = lambda: sparse_mla_(tplan, q, win, comp, wtab, ctab, sink, scale, ot)  # noqa: E731
            us_t = graph_time_us(ft, replays=replays) if with_triton else float("nan")
            ft() if with_triton else ot.copy_(outs[0])
            fm = _flash_mla_v4(rows, heads, gen)
            us_f = graph_time_us(fm, replays=replays) if fm is not None else float("nan")
            picked = sorted({0, rows - 1})
            ref = sparse_attention_records(q[picked], win, comp, wtab[picked], ctab[picked], sink, scale)
            timed = [o for o, name in zip(outs, names) if name not in bad]
            same = bool(timed) and all(torch.equal(o, timed[0]) for o in timed)     # every row, the timed ones
            outs, ot = [o[picked] for o in outs], ot[picked]
            best = min(t for t in times if t == t) if any(t == t for t in times) else float("nan")
            print(f"{heads:5d} {rows:4d} | " + " ".join(f"{t:10.2f}" for t in times) + f" {us_t:10.2f} {us_f:10.2f} | "
                  f"{best / us_t:11.2f} {best / us_f:10.2f} | " + " ".join(f"{ulp_max(o, ref):14.1f}" for o in outs)
                  + f" {ulp_max(ot, ref):11.1f} | {same!s:5s} {bool(torch.equal(outs[0], ot))}"
                  + (f"  (left out: {', '.join(n for n in names if n in bad)})" if bad else ""), flush=True)


def precheck(gplans, names, inputs, rows_list, scale, wait_s: float = 10.0) -> set[str]:
    """Each configuration launched once at the first and the last row count before any timing, its
    output compared bitwise with the first configuration's: the names of those that differ or do not
    finish within wait_s (a look-back or a combination that never sees its flags spins until its
    poll limit, seconds, and returns NaN), printed, and left out of the timing."""
    bad = set()
    for rows in sorted({rows_list[0], rows_list[-1]}):
        q, win, comp, wtab, ctab, sink = row_inputs(inputs, rows)
        first = None
        for name, gplan in zip(names, gplans):
            o = torch.full_like(q, float("nan"))
            G.gluon_sparse_mla_(gplan, q, win, comp, wtab, ctab, sink, scale, o)
            done = torch.cuda.Event()
            done.record()
            t0 = time.time()
            while not done.query() and time.time() - t0 < wait_s:
                time.sleep(0.01)
            if not done.query():
                print(f"check: {name} at {rows} rows did not finish in {wait_s:.0f} s", flush=True)
                torch.cuda.synchronize()
                bad.add(name)
            if first is None:
                first = o
            elif not torch.equal(o, first):
                print(f"check: {name} at {rows} rows differs from {names[0]}: "
                      f"{int((o != first).sum())} of {o.numel()} elements (NaN: {int(o.isnan().sum())})", flush=True)
                bad.add(name)
    return bad


def phase_table(log: torch.Tensor) -> list[str]:
    """Lines summarizing one launch's phase log (`GluonSparseMlaPlan.phase_log`, its programs' rows)."""
    log = log.double()
    clock, g_start, g_end, c_end = log[:, :10], log[:, 10], log[:, 11], log[:, 14]
    span_ns = g_end - g_start
    ok = span_ns > 1000
    rate = float(((c_end - clock[:, 0])[ok] / span_ns[ok]).median())      # cycles per ns
    lines = [f"  {len(log)} programs, clock {rate:.2f} GHz, launch span {float(g_end.max() - g_start.min()) / 1e3:.2f} us, "
             f"program span median {float(span_ns.median()) / 1e3:.2f} max {float(span_ns.max()) / 1e3:.2f} us, "
             f"start offsets median {float((g_start - g_start.min()).median()) / 1e3:.2f} "
             f"max {float((g_start - g_start.min()).max()) / 1e3:.2f} us, "
             f"{int(log[:, 12].unique().numel())} SMs"]
    lines.append(f"  {'phase':>10s} {'median':>8s} {'p90':>8s} {'max':>8s}  (us)")
    for k in range(1, 10):
        d = (clock[:, k] - clock[:, k - 1]) / rate / 1e3
        if k == 8:
            d = d[clock[:, 8] > 0]                 # the spread combination's arrival only
        if k == 9:
            d = d[clock[:, 9] > 0]                 # the programs that combined
        if d.numel() == 0:
            continue
        lines.append(f"  {G.PHASE_NAMES[k]:>10s} {float(d.median()):8.2f} {float(d.quantile(0.9)):8.2f} {float(d.max()):8.2f}")
    last = torch.where(clock[:, 8] > 0, clock[:, 8], clock[:, 7])
    tail = (c_end - torch.where(clock[:, 9] > 0, clock[:, 9], last)) / rate / 1e3
    lines.append(f"  {'to end':>10s} {float(tail.median()):8.2f} {float(tail.quantile(0.9)):8.2f} {float(tail.max()):8.2f}")
    return lines


def phases(heads: int, rows_list, names, cold: bool = False):
    """Print each configuration's phase table (the last of three launches; with `cold`, L2 flushed
    before it by reading a buffer of 4x its size, so that the records come from DRAM as in the step
    - and q, the tables and the sink too, colder than in the step, where q was just written)."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    l2_bytes = torch.cuda.get_device_properties(0).L2_cache_size
    flush = torch.empty(l2_bytes, dtype=torch.float32, device="cuda") if cold else None   # 4x L2's bytes
    scale = HEAD_DIM ** -0.5
    inputs = sparse_mla_inputs(max(rows_list), heads, gen)
    for name in names:
        plan = G.GluonSparseMlaPlan.build(max(rows_list), heads, W, K, "cuda", config=replace(CONFIGS[name], phases=True))
        for rows in rows_list:
            q, win, comp, wtab, ctab, sink = row_inputs(inputs, rows)
            o = torch.empty_like(q)
            for i in range(3):                     # compiled, warm; the last launch's log
                if flush is not None and i == 2:
                    flush.sum()
                G.gluon_sparse_mla_(plan, q, win, comp, wtab, ctab, sink, scale, o)
            torch.cuda.synchronize()
            n_prog = rows * plan.base.n_blocks * plan.config.dim_split
            print(f"phases: {name}, {heads} heads, {rows} rows" + (", L2 flushed before" if cold else ""), flush=True)
            print("\n".join(phase_table(plan.phase_log[:n_prog].cpu())), flush=True)


def main() -> None:
    t0 = time.time()
    heads_list = [int(v) for v in arg("heads", "64,16").split(",")]
    rows_list = [int(v) for v in arg("rows", "1,2,4,8,16,32,64").split(",")]
    names = arg("configs", "default,lut,spreadv,split4sv,split4svl").split(",")
    replays = int(arg("replays", "10"))
    workers = int(arg("warm", "8"))
    if workers > 0:
        warm(heads_list, rows_list, names, workers)
    timings(heads_list, rows_list, names, replays, arg("triton", "1") != "0")
    if "--phases" in sys.argv:
        phases(heads_list[0], [int(v) for v in arg("phase-rows", "1,64").split(",")], names)
    print(f"done in {time.time() - t0:.1f} s")


if __name__ == "__main__":
    main()
