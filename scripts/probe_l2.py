"""Probe on a GPU: how much of a weight-streaming GEMM does an L2 prefetch during idle time buy?

For each of the step's big GEMMs at V4.1-Flash shapes (wq_b 1280 -> 32768 and wo_b 8192 -> 5120,
FP8 `low_latency_mm`; the grouped `wo_a`, BF16 weight), rows 1 and 8, a CUDA graph holds, per
rotated weight copy (beyond L2): a ~SLEEP_US spin kernel on the main stream (the stand-in for the
step's kernels that barely read DRAM: norms, RoPE, the sparse MLA), optionally a fork to a side
stream that prefetches part of the copy (`ops.l2_prefetch`), then the GEMM on that copy. Printed:
the GEMM's share (graph time minus the spin-only graph), for
  cold     no prefetch
  rows X   the first X of every (row, program K segment) prefetched (what the step does)
  head X   the same byte count, but the weight's first bytes (whole rows from the start)
  hot      no spin, no rotation: the same copy every call (L2-resident as far as it fits)
Writes nothing; `--rows=1,8` and `--sleep-us=20` pick the cases.
"""

from __future__ import annotations


import torch

from dsv41_decode.bench.timing import graph_time_us, l2_rotation
from dsv41_decode.ops.l2_prefetch import L2Prefetch
from dsv41_decode.ops.low_latency_mm import LowLatencyMM
from dsv41_decode.ops.wo_a import WoAPlan, wo_a_

from _args import arg   # scripts/ is on sys.path when run as python scripts/<probe>.py



def _fp8(n: int, k: int, g: torch.Generator):
    w = (torch.randn(n, k, generator=g, device="cuda") * 0.5).to(torch.float8_e4m3fn)
    s = torch.randint(118, 125, (n // 32, k // 32), generator=g, device="cuda", dtype=torch.uint8)
    return w, s


def main() -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    rows_list = [int(r) for r in arg("rows", "1,8").split(",")]
    sleep_us = float(arg("sleep-us", "20"))
    clock_khz = torch.cuda.get_device_properties(0).clock_rate if hasattr(
        torch.cuda.get_device_properties(0), "clock_rate") else 1_980_000
    cycles = int(sleep_us * clock_khz / 1e3)
    spin_us = graph_time_us(lambda: torch.cuda._sleep(cycles), replays=20)
    print(f"spin kernel: {spin_us:.2f} us ({cycles} cycles); L2 {torch.cuda.get_device_properties(0).L2_cache_size >> 20} MB")
    side = torch.cuda.Stream()

    cases = []
    for name, (n, k) in (("wq_b", (32768, 1280)), ("wo_b", (5120, 8192))):
        w, s = _fp8(n, k, g)
        cases.append((name, w, s, n, k))
    w_a = (torch.randn(8192, 4096, generator=g, device="cuda") * 0.02).bfloat16()
    cases.append(("wo_a", w_a, None, 8192, 4096))

    for name, w, s, n, k in cases:
        nbytes = w.numel() * w.element_size()
        copies = l2_rotation(nbytes)
        ws = [w.clone() for _ in range(copies)]
        for m in rows_list:
            if s is None:
                plan = WoAPlan.build(64, 8, 1024, 64, torch.bfloat16, "cuda")
                o = torch.randn(m, 64, 512, generator=g, device="cuda").bfloat16()
                cos, sin = torch.ones(m, 32, device="cuda"), torch.zeros(m, 32, device="cuda")
                out = torch.empty(m, 8192, dtype=torch.bfloat16, device="cuda")
                seg = plan.k_per_split

                def gemm(wc, plan=plan, o=o, cos=cos, sin=sin, out=out):
                    wo_a_(plan, o, cos, sin, wc, None, out)
            else:
                mm = LowLatencyMM(w, s, 64)
                codes = torch.randn(m, k, generator=g, device="cuda").to(torch.float8_e4m3fn)
                xs = torch.full((m, k // 32), 127, dtype=torch.uint8, device="cuda")
                out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
                seg = mm.launch_for(m).k_per_split
                mms = [LowLatencyMM(wc, s, 64) for wc in ws]

                def gemm(wc, mms=mms, ws=ws, codes=codes, xs=xs, out=out):
                    mms[next(i for i, x in enumerate(ws) if x is wc)](codes, xs, out)
            variants = {"cold": None}
            for f in (0.25, 0.5, 1.0):
                pfs = [L2Prefetch(wc, seg, f) for wc in ws]
                variants[f"rows {f:.2f}"] = pfs
                nb = pfs[0].nbytes
                head = nb // (16384) * 16384
                variants[f"head {f:.2f}"] = [L2Prefetch(wc.view(torch.uint8).view(-1)[:head].view(-1, 16384))
                                             for wc in ws] if head else None
            for label, pfs in variants.items():
                if label.startswith("head") and pfs is None:
                    continue

                def fn(pfs=pfs):
                    for i, wc in enumerate(ws):
                        torch.cuda._sleep(cycles)
                        if pfs is not None:
                            ev = torch.cuda.Event()
                            ev.record()
                            with torch.cuda.stream(side):
                                side.wait_event(ev)
                                pfs[i]()
                                done = torch.cuda.Event()
                                done.record()
                        gemm(wc)
                        if pfs is not None:
                            torch.cuda.current_stream().wait_event(done)
                us = graph_time_us(fn, calls_per_graph=copies, replays=20) - spin_us
                mb = 0 if pfs is None else pfs[0].nbytes / 1e6
                print(f"{name:5s} rows {m:2d} {label:10s} {us:7.2f} us  prefetched {mb:5.1f} of {nbytes / 1e6:.1f} MB")
            hot = graph_time_us(lambda: gemm(ws[0]), replays=20)
            print(f"{name:5s} rows {m:2d} {'hot':10s} {hot:7.2f} us  (same copy every call, no spin)")


if __name__ == "__main__":
    main()
