"""The sweep that chose ops.low_latency_mm's tuned table (docs/notes-low-latency-mm.md): compile+check every variant in parallel workers, measure
the streaming-read ceiling, then time variants x splits at the V4.1-Flash shapes by CUDA-graph
replay over rotated weight copies (> 3x L2). Writes $OUT/sweep1.jsonl and prints a summary."""
import json
import math
import os
import sys
import time
import traceback
from concurrent.futures import ProcessPoolExecutor
import multiprocessing as mp

if os.environ.get("SWEEP_DRY") == "1":
    os.environ["TRITON_INTERPRET"] = "1"

import torch
import triton
import triton.language as tl

T0 = time.time()
DRY = os.environ.get("SWEEP_DRY") == "1"     # CPU + interpreter, tiny shapes: checks the script only
DEV = "cpu" if DRY else "cuda"
WN, WK = (96, 256) if DRY else (512, 2048)    # the workers' check problem
OUT = os.environ.get("OUT", "/tmp/out")
os.makedirs(OUT, exist_ok=True)

SHAPES = [
    ("wqa_wkv", 1792, 5120),
    ("wq_b", 32768, 1280), ("wq_b_tp2", 16384, 1280), ("wq_b_tp4", 8192, 1280), ("wq_b_tp8", 4096, 1280),
    ("wo_b", 5120, 8192), ("wo_b_tp2", 5120, 4096), ("wo_b_tp4", 5120, 2048), ("wo_b_tp8", 5120, 1024),
]
# (bn, bk, warps, stages, dequant)
V16 = [
    (32, 128, 4, 4, 0), (32, 256, 4, 4, 0),
    (64, 32, 4, 8, 0), (64, 64, 4, 4, 0), (64, 64, 4, 8, 0), (64, 128, 4, 3, 0), (64, 128, 4, 4, 0),
    (64, 128, 4, 6, 0), (64, 256, 4, 2, 0), (64, 256, 4, 3, 0), (64, 256, 4, 4, 0),
    (128, 32, 4, 8, 0), (128, 64, 4, 4, 0), (128, 64, 4, 6, 0), (128, 128, 4, 2, 0), (128, 128, 4, 3, 0),
    (128, 128, 4, 4, 0), (128, 128, 8, 3, 0), (128, 128, 8, 4, 0), (128, 256, 4, 2, 0), (128, 256, 4, 3, 0),
    (128, 256, 8, 3, 0), (256, 128, 8, 3, 0), (256, 128, 8, 4, 0),
    (64, 128, 4, 4, 1), (64, 128, 4, 6, 1), (64, 256, 4, 3, 1), (128, 128, 4, 4, 1), (128, 128, 8, 4, 1),
    (128, 256, 8, 3, 1),
]
VBIG = [
    (32, 128, 4, 4, 0), (64, 64, 4, 6, 0), (64, 128, 4, 3, 0), (64, 128, 4, 4, 0), (64, 256, 4, 3, 0),
    (128, 64, 8, 4, 0), (128, 128, 4, 3, 0), (128, 128, 8, 3, 0), (128, 128, 8, 4, 0), (256, 128, 8, 3, 0),
    (64, 128, 4, 4, 1), (128, 128, 8, 4, 1),
]
SWEEP_END_S = float(os.environ.get("SWEEP_END_S", "125"))   # leave the rest for the final phase
FINAL_END_S = float(os.environ.get("FINAL_END_S", "195"))   # leave the rest for pytest


def elapsed():
    return time.time() - T0


def log(*a):
    print(f"[{elapsed():6.1f}s]", *a, flush=True)


def cfg_of(v, split):
    from dsv41_decode.ops.low_latency_mm import LowLatencyConfig
    bn, bk, w, s, dq = v
    return LowLatencyConfig(block_n=bn, block_k=bk, split=split, num_warps=w, num_stages=s, dequant=bool(dq))


def vname(v):
    bn, bk, w, s, dq = v
    return f"{'dq' if dq else 'f8'}-n{bn}k{bk}w{w}s{s}"


def make_operands(m, n, k, seed=0):
    from dsv41_decode.formats import fp8_block_quantize, mxfp8_quantize
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(m, k, device=DEV, generator=g)
    x = x * 10.0 ** torch.empty(m, k // 32, device=DEV).uniform_(-2, 2, generator=g).repeat_interleave(32, 1)
    codes, sx = mxfp8_quantize(x.to(torch.bfloat16))
    w = torch.randn(n, k, device=DEV, generator=g) * k ** -0.5
    weight, ws = fp8_block_quantize(w)
    return codes, sx, weight, ws


def check(y, ref):
    from dsv41_decode.testing.compare import rel_rms, row_ulp_distance
    nan = bool(torch.isnan(y).any())
    return (not nan) and rel_rms(y, ref) < 1e-3 and row_ulp_distance(y, ref) <= 2, \
        dict(nan=nan, rel=rel_rms(y, ref), ulp=row_ulp_distance(y, ref))


_WORKER = {}


def worker_task(v, bm, split_flag):
    """Compile one (variant, BLOCK_M, split?) on a small problem and check it against the reference."""
    try:
        from dsv41_decode.ops.low_latency_mm import LowLatencyMM, _mxfp8_ll_mm_kernel
        from dsv41_decode.reference.linear import mxfp8_mm
        key = "ops"
        if key not in _WORKER:
            _WORKER[key] = make_operands(64, WN, WK, seed=1)
        codes, sx, weight, ws = _WORKER[key]
        m = {16: 3, 32: 20, 64: 50}[bm]
        plan = LowLatencyMM(weight, ws, config=cfg_of(v, 4 if split_flag else 1))
        assert (plan.launch_for(m).split > 1) == split_flag and plan.launch_for(m).block_m == bm
        cache = {} if DRY else _mxfp8_ll_mm_kernel.device_caches[torch.cuda.current_device()][0]
        before = set(cache.keys())
        t = time.time()
        y = torch.full((m, WN), float("nan"), dtype=torch.bfloat16, device=DEV)
        plan(codes[:m], sx[:m], y)
        if not DRY:
            torch.cuda.synchronize()
        ct = time.time() - t
        ok, info = check(y, mxfp8_mm(codes[:m], sx[:m], weight, ws))
        y2 = plan(codes[:m], sx[:m])
        info["replay_equal"] = bool(torch.equal(y.view(torch.int16), y2.view(torch.int16)))
        new = [cache[k2] for k2 in cache.keys() if k2 not in before]
        if new:
            kk = new[0]
            info.update(regs=kk.n_regs, spills=kk.n_spills, smem=kk.metadata.shared)
        return (v, bm, split_flag, ok and info["replay_equal"], info, ct, None)
    except Exception as e:  # noqa: BLE001
        return (v, bm, split_flag, False, {}, 0.0, f"{type(e).__name__}: {str(e)[:300]}")


@triton.jit
def _read_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(x_ptr + offs, mask=offs < n, other=0.0)
    tl.store(out_ptr + pid, tl.sum(v, axis=0))


def graph_time_us(fns, reps=10):
    """Median microseconds per fn over graph replays of all fns in sequence."""
    if DRY:
        t = time.time()
        for f in fns:
            f()
        return (time.time() - t) * 1e6 / len(fns)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in fns:
            f()
    g.replay()
    g.replay()
    torch.cuda.synchronize()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for a, b in ev:
        a.record()
        g.replay()
        b.record()
    torch.cuda.synchronize()
    ts = sorted(a.elapsed_time(b) for a, b in ev)
    del g
    return ts[len(ts) // 2] * 1000.0 / len(fns)


def read_bandwidth():
    n_bytes = (1 << 20) if DRY else (2 << 30)
    buf = torch.randn(n_bytes // 4, device=DEV)
    res = {}
    for block, warps in ((2048, 4), (4096, 8), (8192, 8), (16384, 16)):
        out = torch.empty(triton.cdiv(buf.numel(), block), device=DEV)
        f = lambda: _read_kernel[(out.numel(),)](buf, out, buf.numel(), BLOCK=block, num_warps=warps)  # noqa: E731
        us = graph_time_us([f] * 5, reps=10)
        res[f"triton_b{block}w{warps}"] = n_bytes / us / 1e3
    us = graph_time_us([lambda: buf.sum()] * 5, reps=10)
    res["torch_sum"] = n_bytes / us / 1e3
    half = buf[: buf.numel() // 2]
    dst = torch.empty_like(half)
    us = graph_time_us([lambda: dst.copy_(half)] * 5, reps=10)
    res["copy_rw"] = 2 * half.numel() * 4 / us / 1e3
    del buf, dst
    if not DRY:
        torch.cuda.empty_cache()
    return res


def read_floor_us(nbytes, copies):
    """A plain streaming read of nbytes, rotated over copies buffers, in a graph: the floor at this size."""
    bufs = [torch.randn(nbytes // 4, device=DEV) for _ in range(copies)]
    out = torch.empty(triton.cdiv(nbytes // 4, 4096), device=DEV)
    fns = [(lambda b=b: _read_kernel[(out.numel(),)](b, out, b.numel(), BLOCK=4096, num_warps=8)) for b in bufs]
    us = graph_time_us(fns)
    del bufs
    return us


def splits_for(n, k, bn, bk):
    tiles = -(-n // bn)
    steps = k // bk
    seen, res = set(), []
    for target in (132, 264, 396, 528):
        s = max(1, min(steps, round(target / tiles)))
        kps = -(-steps // s)
        eff = -(-steps // kps)
        if eff not in seen:
            seen.add(eff)
            res.append(eff)
    return res


def main():
    from dsv41_decode.ops.low_latency_mm import LowLatencyMM
    from dsv41_decode.reference.linear import mxfp8_mm
    global SHAPES, V16, VBIG
    if DRY:
        SHAPES = [("tiny", 160, 256), ("tiny2", 96, 512)]
        V16, VBIG = V16[:3] + V16[-2:], VBIG[:2]
    else:
        props = torch.cuda.get_device_properties(0)
        log("gpu", props.name, "sms", props.multi_processor_count, "L2", props.L2_cache_size, "torch",
            torch.__version__, "triton", triton.__version__)
    jl = open(os.path.join(OUT, "sweep1.jsonl"), "w")

    # 1. compile + check in parallel workers
    tasks = [(v, 16, sf) for v in V16 for sf in (False, True)] + \
            [(v, bm, sf) for bm in (32, 64) for v in VBIG for sf in (False, True)]
    ok_set, fails = set(), []
    with ProcessPoolExecutor(max_workers=2 if DRY else 14, mp_context=mp.get_context("spawn")) as ex:
        futs = [ex.submit(worker_task, *t) for t in tasks]
        for f in futs:
            v, bm, sf, ok, info, ct, err = f.result()
            jl.write(json.dumps(dict(kind="compile", v=vname(v), bm=bm, split=sf, ok=ok, info=info, s=ct, err=err)) + "\n")
            if ok:
                ok_set.add((v, bm, sf))
            else:
                fails.append((vname(v), bm, sf, err or info))
    log(f"compiled+checked {len(tasks)}: {len(ok_set)} ok")
    for fl in fails:
        print("  FAIL", fl)
    jl.flush()

    # 2. read bandwidth
    bw = read_bandwidth()
    read_gbps = max(v for kk, v in bw.items() if kk != "copy_rw")
    log("read GB/s", {k2: round(v) for k2, v in bw.items()}, "-> ceiling", round(read_gbps))
    jl.write(json.dumps(dict(kind="read_bw", **bw, ceiling=read_gbps)) + "\n")

    # 3. sweep: every variant x split at M=1 and 16 (BLOCK_M 16), a subset at M=32 and 64
    results = []   # (shape, m, v, split, us, gbps, pct)
    floors = {}
    phases = [(16, V16, (1, 16)), (32, VBIG, (32,)), (64, VBIG, (64,))]
    for bm, vs, ms in phases:
        for name, n, k in SHAPES:
            if elapsed() > SWEEP_END_S:
                break
            wbytes = n * k
            copies = 2 if DRY else max(4, math.ceil(160e6 / wbytes))
            if name not in floors:
                floors[name] = read_floor_us(wbytes, copies)
            ws, ss = random_weights(n, k, copies)
            codes, sx, _, _ = make_operands(64, 32, k, seed=k)
            out = torch.empty(64, n, dtype=torch.bfloat16, device=DEV)
            for v in vs:
                for split in splits_for(n, k, v[0], v[1]):
                    if (v, bm, split > 1) not in ok_set or elapsed() > SWEEP_END_S:
                        continue
                    try:
                        plans = [LowLatencyMM(ws[i], ss[i], config=cfg_of(v, split)) for i in range(copies)]
                        for m in ms:
                            fns = [(lambda p=p, m=m: p(codes[:m], sx[:m], out[:m])) for p in plans]
                            us = graph_time_us(fns)
                            nb = op_bytes(m, n, k)
                            rec = dict(kind="time", shape=name, n=n, k=k, m=m, v=vname(v), split=split,
                                       grid=list(plans[0].launch_for(m).grid), us=us, gbps=nb / us / 1e3,
                                       pct=100 * nb / us / 1e3 / read_gbps, floor_us=floors[name])
                            jl.write(json.dumps(rec) + "\n")
                            results.append((name, m, v, split, us, rec["gbps"], rec["pct"]))
                        del plans
                    except Exception as e:  # noqa: BLE001
                        log("ERR", name, vname(v), split, type(e).__name__, str(e)[:200])
            jl.flush()
            del ws, ss
            if not DRY:
                torch.cuda.empty_cache()
        log(f"sweep bm={bm} done, {len(results)} timings")

    # 4. sweep summary: best overall and best per family
    print("\nsweep: floor = plain streaming read of the same bytes, rotated, in a graph")
    print(f"{'shape':9s} {'MB':>5s} {'m':>3s} {'floor':>6s} {'best':>6s} {'GB/s':>5s} {'%rd':>4s}  best config         | f8k32 f8k64 f8k128 f8k256 dq    | n32   n64   n128  n256")
    for name, n, k in SHAPES:
        for m in (1, 16, 32, 64):
            rs = [r for r in results if r[0] == name and r[1] == m]
            if not rs:
                continue
            b = min(rs, key=lambda r: r[4])
            fam = []
            for dq, bk in ((0, 32), (0, 64), (0, 128), (0, 256), (1, None)):
                f = [r[4] for r in rs if r[2][4] == dq and (bk is None or r[2][1] == bk)]
                fam.append(f"{min(f):5.2f}" if f else "  -  ")
            for bn in (32, 64, 128, 256):
                f = [r[4] for r in rs if r[2][0] == bn]
                fam.append(f"{min(f):5.2f}" if f else "  -  ")
            print(f"{name:9s} {n * k / 1e6:5.1f} {m:3d} {floors.get(name, 0):6.2f} {b[4]:6.2f} {b[5]:5.0f} {b[6]:4.1f}  "
                  f"{vname(b[2]):17s} x{b[3]:<2d}| {' '.join(fam[:5])} | {' '.join(fam[5:])}")

    # 5. the tuned table: per (N, K, BLOCK_M) the config with the least time summed over the bucket's rows
    tuned = {}
    for name, n, k in SHAPES:
        for bm, ms in ((16, (1, 16)), (32, (32,)), (64, (64,))):
            tot = {}
            for r in results:
                if r[0] == name and r[1] in ms:
                    tot.setdefault((r[2], r[3]), []).append(r[4])
            tot = {key: sum(t) for key, t in tot.items() if len(t) == len(ms)}
            if tot:
                (v, split) = min(tot, key=tot.get)
                tuned[(n, k, bm)] = cfg_of(v, split)
    table = "\n".join(f"    ({n}, {k}, {bm}): LowLatencyConfig(block_n={c.block_n}, block_k={c.block_k}, split={c.split}, "
                      f"num_warps={c.num_warps}, num_stages={c.num_stages}{', dequant=True' if c.dequant else ''}),"
                      for (n, k, bm), c in sorted(tuned.items()))
    open(os.path.join(OUT, "tuned.txt"), "w").write(table + "\n")
    print("\n_TUNED = {\n" + table + "\n}")

    # 6. final: the plans' own choice (tuned table installed) at every row count, checked at the real
    # shapes (poisoned outputs, two calls, counters back to zero) and timed against the baselines
    import dsv41_decode.ops.low_latency_mm as llm
    llm._TUNED.update(tuned)
    fj = open(os.path.join(OUT, "final.jsonl"), "w")
    print(f"\nfinal: {'shape':9s} {'m':>3s} {'us':>6s} {'GB/s':>5s} {'%read':>5s} {'%floor':>6s} {'cublas':>7s} {'scaled':>7s} {'xcub':>5s} {'xsc':>5s} ok")
    for name, n, k in SHAPES:
        if elapsed() > FINAL_END_S:
            log("final phase out of time at", name)
            break
        copies = 2 if DRY else max(4, math.ceil(160e6 / n / k))
        ws, ss = random_weights(n, k, copies)
        codes, sx, qw, qs = make_operands(64, n, k, seed=n + k)
        x_bf = mxfp8_dequant(codes, sx)
        bf_copies = [fp8_block_dequantize(ws[i], ss[i]).to(torch.bfloat16) for i in range(max(2, copies // 2))]
        plans = [LowLatencyMM(ws[i], ss[i]) for i in range(copies)]
        qplan = LowLatencyMM(qw, qs)
        out = torch.empty(64, n, dtype=torch.bfloat16, device=DEV)
        for m in (1, 2, 4, 8, 16, 32, 64):
            ref = mxfp8_mm(codes[:m], sx[:m], qw, qs)
            oks = []
            for _ in range(2):
                y = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=DEV)
                qplan(codes[:m], sx[:m], y)
                ok, info = check(y, ref)
                oks.append(ok)
            ok = all(oks) and int(qplan._counters.abs().sum()) == 0
            us = graph_time_us([(lambda p=p, m=m: p(codes[:m], sx[:m], out[:m])) for p in plans])
            cub = graph_time_us([(lambda w=w, m=m: torch.nn.functional.linear(x_bf[:m], w)) for w in bf_copies])
            try:
                one = torch.ones((), device=DEV)
                sc = graph_time_us([(lambda w=w, m=m: torch._scaled_mm(codes[:m], w.t(), scale_a=one, scale_b=one,
                                                                      out_dtype=torch.bfloat16)) for w in ws])
            except Exception as e:  # noqa: BLE001
                sc = float("nan")
                if m == 1:
                    log("scaled_mm", type(e).__name__, str(e)[:120])
            nb = op_bytes(m, n, k)
            launch = plans[0].launch_for(m)
            rec = dict(kind="final", shape=name, n=n, k=k, m=m, us=us, gbps=nb / us / 1e3, pct=100 * nb / us / 1e3 / read_gbps,
                       floor_us=floors.get(name), cublas_us=cub, scaled_mm_us=sc, ok=ok, info=info,
                       config=str(launch.config), split=launch.split, grid=list(launch.grid))
            fj.write(json.dumps(rec) + "\n")
            fl = floors.get(name) or float("nan")
            print(f"final: {name:9s} {m:3d} {us:6.2f} {rec['gbps']:5.0f} {rec['pct']:5.1f} {100 * fl / us:6.1f} {cub:7.2f} {sc:7.2f} "
                  f"{cub / us:5.2f} {sc / us:5.2f} {'ok' if ok else 'FAIL ' + str(info)}", flush=True)
        del ws, ss, plans, bf_copies
        if not DRY:
            torch.cuda.empty_cache()
    fj.close()
    jl.close()

    # 7. the GPU tests of the test file, with the tuned table installed
    import pytest
    log("pytest gpu")
    rc = pytest.main(["-q", "-p", "no:cacheprovider", "-m", "gpu", "--durations=3", "tests/ops/test_low_latency_mm.py"])
    log("pytest rc", int(rc))


def random_weights(n, k, copies):
    """copies of an [n, k] E4M3 weight of random finite codes with UE8M0 scales in 2^-9..2^-1."""
    g = torch.Generator(device=DEV).manual_seed(n + k)
    ws = [torch.randint(0, 256, (n, k), dtype=torch.uint8, device=DEV, generator=g) for _ in range(copies)]
    for w in ws:
        w[(w & 0x7F) == 0x7F] = 0
    ss = [torch.randint(118, 127, (-(-n // 32), k // 32), dtype=torch.uint8, device=DEV, generator=g)
          for _ in range(copies)]
    return [w.view(torch.float8_e4m3fn) for w in ws], ss


def op_bytes(m, n, k):
    """Bytes the op must move: the weight and its scales, the activation and its scales, the output."""
    return n * k + (-(-n // 32)) * (k // 32) + m * k * 33 // 32 + 2 * m * n


def mxfp8_dequant(codes, sx):
    from dsv41_decode.formats import mxfp8_dequantize
    return mxfp8_dequantize(codes, sx).to(torch.bfloat16)


def fp8_block_dequantize(w, s):
    from dsv41_decode.formats import fp8_block_dequantize as f
    return f(w, s)


if __name__ == "__main__":
    try:
        main()
    except Exception:
        traceback.print_exc()
        sys.exit(1)
