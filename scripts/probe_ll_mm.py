"""Probe `low_latency_mm` on a GPU: the tuned configs with byte-loaded scales ("tuned",
scale_words=False) against the same configs with `scale_words=True` (each step's scale bytes loaded
as one word per row, one step ahead; the default for the FP8-dot loop, forced here for the
dequantize loop too), at the V4.1-Flash shapes of the
step's GEMMs, rows 1, 8, 16: CUDA-graph replay over weight copies rotated beyond L2 (32+ calls per
graph), median; outputs compared bit for bit. `--rows=1,16` and `--only=wq_b,wo_b` narrow it.
`--alt=bn:bk:split:warps:stages:dequant:words,...` also times these configs (every block_m) against
the tuned one, with the largest |difference| to its output (another split sums in another order).
Prints; writes nothing.
"""

from __future__ import annotations

import dataclasses

import torch

from dsv41_decode.bench.floor import read_bandwidth_gbps
from dsv41_decode.bench.timing import graph_time_us, l2_rotation
from dsv41_decode.ops.low_latency_mm import LowLatencyConfig, LowLatencyMM

from _args import arg   # scripts/ is on sys.path when run as python scripts/<probe>.py

SHAPES = {"fused_wqa_wkv": (1792, 5120), "wq_b": (32768, 1280), "idx_wq_b": (4096, 1280),
          "wo_b": (5120, 8192), "wo_b_tp2": (5120, 4096), "wq_b_tp2": (16384, 1280)}



def main() -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = [int(r) for r in arg("rows", "1,8,16").split(",")]
    names = arg("only", ",".join(SHAPES)).split(",")
    print(f"streaming read: {read_bandwidth_gbps():.0f} GB/s on {torch.cuda.get_device_name()}", flush=True)
    for name in names:
        n, k = SHAPES[name]
        w = (torch.randn(n, k, generator=g, device="cuda") * 0.5).to(torch.float8_e4m3fn)
        s = torch.randint(118, 125, (n // 32, k // 32), generator=g, device="cuda", dtype=torch.uint8)
        nbytes = n * k + s.numel()
        copies = l2_rotation(nbytes)
        ws = [(w.clone(), s.clone()) for _ in range(copies)]
        tuned = LowLatencyMM(w, s, 64)
        words, base = ([LowLatencyMM(wc, sc, 64, {b: dataclasses.replace(tuned.launch_for(b).config, scale_words=on)
                                                  for b in (16, 32, 64)}) for wc, sc in ws] for on in (True, False))
        for m in rows:
            codes = torch.randn(m, k, generator=g, device="cuda").to(torch.float8_e4m3fn)
            xs = torch.randint(120, 130, (m, k // 32), generator=g, device="cuda", dtype=torch.uint8)
            out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
            res = {}
            for label, plans in (("tuned", base), ("scale_words", words)):
                us = graph_time_us(lambda plans=plans: [p(codes, xs, out) for p in plans],
                                   calls_per_graph=copies, replays=30)
                res[label] = (us, plans[0](codes, xs, out).clone())
            for spec in filter(None, arg("alt", "").split(",")):
                bn, bk, split, warps, stages, deq, sw = (int(v) for v in spec.split(":"))
                cfg = LowLatencyConfig(block_n=bn, block_k=bk, split=split, num_warps=warps, num_stages=stages,
                                       dequant=bool(deq), scale_words=bool(sw))
                try:
                    alt = [LowLatencyMM(wc, sc, 64, {b: cfg for b in (16, 32, 64)}) for wc, sc in ws]
                    us = graph_time_us(lambda plans=alt: [p(codes, xs, out) for p in plans],
                                       calls_per_graph=copies, replays=30)
                    d = float((alt[0](codes, xs, out).float() - res["tuned"][1].float()).abs().max())
                    print(f"{name:14s} M={m:2d}  alt {spec:22s} {us:7.2f} us ({nbytes / us / 1e3:5.0f} GB/s)  "
                          f"x{res['tuned'][0] / us:.2f} vs tuned  |d| {d:.1e}", flush=True)
                except Exception as e:  # report, keep probing
                    print(f"{name} M={m} alt {spec}: {type(e).__name__}: {str(e)[:160]}", flush=True)
            same = torch.equal(res["tuned"][1], res["scale_words"][1])
            t0, t1 = res["tuned"][0], res["scale_words"][0]
            print(f"{name:14s} M={m:2d}  tuned {t0:7.2f} us ({nbytes / t0 / 1e3:5.0f} GB/s)  scale_words {t1:7.2f} us "
                  f"({nbytes / t1 / 1e3:5.0f} GB/s)  x{t0 / t1:.2f}  same bits {same}  "
                  f"[{base[0].launch_for(m).config}]", flush=True)


if __name__ == "__main__":
    main()
