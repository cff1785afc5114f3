"""Probe the Gluon grouped `wo_a` (`ops.gluon_wo_a`; the step's on sm_90, `decode.attention.wo_a_plan`:
for a BF16 weight the "default" variant, for FP8 the folded consumer of `--fp8fold`) on an H200
against the Triton plan (`ops.wo_a.WoAPlan`, the step's off sm_90; its default: for a BF16 weight
swapped BF16 wgmma at split 2, for FP8 TF32 dots at split 4) and, for BF16, cuBLAS (`torch.bmm`
per group, no rotation: a speed reference), at the step's shape (64 heads, 8 groups of 1024
outputs, K = 4096 per group: 67 MB of BF16 weight, 34 MB of FP8 with its scales). CUDA-graph replay
over weight copies rotated beyond L2 (`bench.timing`, as `bench gemm`), the streaming read of the
same run (`bench.floor.read_bandwidth_gbps`) as the floor. Per row count: us and % of the read for each,
the Gluon plan's variants (`--variants=`, names below), the max BF16 ulp (of the row's largest |z|)
of the Gluon and Triton z from the reference, and how many of the Gluon z's elements differ
bitwise from the Triton kernel's. "+quant" also writes the MXFP8 of z (the step's call; fused in
both kernels).
`--rows=1,2,4,8,16,32,64`, `--variants=default,s4,s8,wg2`, `--dtypes=bf16,fp8`. Prints; writes
nothing. About 60-90 s.

`--fp8fold` instead compares the FP8 consumers (`python scripts/probe_gluon_wo_a.py --fp8fold`,
about 45 s): per row count (`--rows=`) the folded FP8 consumer (`GluonWoAConfig(fold_scales=True)`),
the folded consumer with its bit conversion ("fold bits": `fold_bits=True`, 6 ring slots; also with
`--fold_variants=` of VARIANTS' other fields, e.g. s8 or wg2: "fold bits:s8", 8 slots, is the step's
on sm_90, `decode.attention.FP8_WO_A_STAGES`), the block-partial FP8 consumer (the default config),
the FP8 Triton plan (the step's off sm_90) and the BF16-weight Gluon plan (the BF16 copy of
the same weight, twice the bytes), each with us, GB/s (the bytes it reads: weight and scales),
% of the streaming read measured in the same run, and max |z - reference| (the reference on the
weight that path reads: for FP8 the dequantized weight, which the folded consumer's z should
match bitwise against the BF16 plan on that weight: "= bf16" when it does).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _args import arg  # noqa: E402
from probe_wo_a import GROUPS, HEADS, RANK, rotated_inputs, step_weight, weight_copies  # noqa: E402

from dsv41_decode.bench.floor import read_bandwidth_gbps  # noqa: E402
from dsv41_decode.bench.timing import graph_time_us, l2_rotation  # noqa: E402
from dsv41_decode.formats import fp8_block_dequantize  # noqa: E402
from dsv41_decode.ops import gluon_wo_a as G  # noqa: E402
from dsv41_decode.ops.wo_a import WoAPlan, wo_a_  # noqa: E402
from dsv41_decode.reference.attention import grouped_wo_a  # noqa: E402
from dsv41_decode.testing.compare import bits_differ, row_ulp_distance  # noqa: E402

VARIANTS = {
    "default": G.GluonWoAConfig(),
    "s4": G.GluonWoAConfig(stages=4), "s8": G.GluonWoAConfig(stages=8), "s10": G.GluonWoAConfig(stages=10),
    "wg2": G.GluonWoAConfig(warpgroups=2, stages=4), "wg2s6": G.GluonWoAConfig(warpgroups=2, stages=6),
    "split4": G.GluonWoAConfig(split=4), "r128": G.GluonWoAConfig(maxnreg=128),
    # one program per output tile (no split-K reduction), deeper rings to keep the bytes in flight
    "split1": G.GluonWoAConfig(split=1), "split1s12": G.GluonWoAConfig(split=1, stages=12),
    "s12": G.GluonWoAConfig(stages=12),
    # 128 weight rows a program (o read half as often), one program per SM
    "wg2split2": G.GluonWoAConfig(warpgroups=2, split=2), "wg2split2s8": G.GluonWoAConfig(warpgroups=2, split=2,
                                                                                          stages=8),
}


def _time(fn, copies: int) -> float | str:
    try:
        return graph_time_us(fn, calls_per_graph=copies)
    except Exception as e:  # report, keep probing
        return f"{type(e).__name__}: {str(e)[:200]}"


def fp8fold() -> None:
    """The `--fp8fold` comparison (module doc)."""
    t0 = time.time()
    rows_list = [int(v) for v in arg("rows", "1,2,4,8,16,32,64").split(",")]
    extra = [v for v in arg("fold_variants", "").split(",") if v]
    gen = torch.Generator(device="cuda").manual_seed(0)
    read = read_bandwidth_gbps()
    print(f"streaming read {read:.0f} GB/s", flush=True)
    w32 = step_weight(gen)
    wq, scale, nq = weight_copies(w32, True)
    G.check_folded_scale(scale)
    w_deq = fp8_block_dequantize(wq[0], scale).bfloat16()
    nb = w_deq.numel() * 2
    wb = [w_deq.clone() for _ in range(l2_rotation(nb))]      # the BF16 path on the same values
    print(f"fp8 weight + scales {nq / 1e6:.1f} MB ({len(wq)} copies), bf16 {nb / 1e6:.1f} MB ({len(wb)} copies)",
          flush=True)
    fp8 = torch.float8_e4m3fn
    plans = {"fold": G.GluonWoAPlan.build(HEADS, GROUPS, RANK, 64, fp8, "cuda",
                                          config=G.GluonWoAConfig(fold_scales=True)),
             "fold bits": G.GluonWoAPlan.build(HEADS, GROUPS, RANK, 64, fp8, "cuda",
                                               config=G.GluonWoAConfig(fold_scales=True, fold_bits=True))}
    for v in extra:
        cfg = VARIANTS[v]
        plans[f"fold bits:{v}"] = G.GluonWoAPlan.build(
            HEADS, GROUPS, RANK, 64, fp8, "cuda",
            config=G.GluonWoAConfig(**{**cfg.__dict__, "fold_scales": True, "fold_bits": True}))
    plans["partials"] = G.GluonWoAPlan.build(HEADS, GROUPS, RANK, 64, fp8, "cuda")
    tri = WoAPlan.build(HEADS, GROUPS, RANK, 64, fp8, "cuda")
    bf16 = G.GluonWoAPlan.build(HEADS, GROUPS, RANK, 64, torch.bfloat16, "cuda")
    print(f"{'rows':>4} | {'case':14s} | {'us':>7} | {'GB/s':>6} | {'% read':>6} | max |z - ref|", flush=True)
    for m in rows_list:
        o, cos, sin = rotated_inputs(m, gen)
        ref = grouped_wo_a(o, torch.complex(cos, sin), w_deq, GROUPS, 64).float()
        z = torch.empty(m, GROUPS * RANK, dtype=torch.bfloat16, device="cuda")
        z_b = torch.empty_like(z)
        cases = {name: (lambda p=p: [G.gluon_wo_a_(p, o, cos, sin, w, scale, z) for w in wq], nq, len(wq))
                 for name, p in plans.items()}
        cases["triton fp8"] = (lambda: [wo_a_(tri, o, cos, sin, w, scale, z) for w in wq], nq, len(wq))
        cases["gluon bf16"] = (lambda: [G.gluon_wo_a_(bf16, o, cos, sin, w, None, z) for w in wb], nb, len(wb))
        G.gluon_wo_a_(bf16, o, cos, sin, wb[0], None, z_b)
        for name, (fn, nbytes, copies) in cases.items():
            us = _time(fn, copies)
            if isinstance(us, str):
                print(f"{m:4d} | {name:14s} | {us}", flush=True)
                continue
            # one call on the first copy for the error (the timed calls ran over every copy)
            if name == "gluon bf16":
                G.gluon_wo_a_(bf16, o, cos, sin, wb[0], None, z)
            elif name == "triton fp8":
                wo_a_(tri, o, cos, sin, wq[0], scale, z)
            else:
                G.gluon_wo_a_(plans[name], o, cos, sin, wq[0], scale, z)
            err = float((z.float() - ref).abs().max())
            same = " (= bf16)" if name.startswith("fold") and torch.equal(z, z_b) else ""
            gbps = nbytes / (us * 1e3)
            print(f"{m:4d} | {name:14s} | {us:7.2f} | {gbps:6.0f} | {100 * gbps / read:5.0f}% | {err:.3e}{same}",
                  flush=True)
    print(f"done in {time.time() - t0:.0f} s")


def main() -> None:
    if "--fp8fold" in sys.argv:
        fp8fold()
        return
    t0 = time.time()
    rows_list = [int(v) for v in arg("rows", "1,2,4,8,16,32,64").split(",")]
    names = arg("variants", "default,s4,s8,wg2").split(",")
    dtypes = arg("dtypes", "bf16,fp8").split(",")
    gen = torch.Generator(device="cuda").manual_seed(0)
    read = read_bandwidth_gbps()
    w32 = step_weight(gen)
    print(f"streaming read {read:.0f} GB/s", flush=True)
    for dname in dtypes:
        fp8 = dname == "fp8"
        dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
        ws, scale, nbytes = weight_copies(w32, fp8)
        w_ref = fp8_block_dequantize(ws[0], scale).bfloat16() if fp8 else ws[0]
        floor_us = nbytes / (read * 1e3)
        print(f"{dname}: weight {nbytes / 1e6:.1f} MB, {len(ws)} copies; floor {floor_us:.2f} us", flush=True)
        tri = WoAPlan.build(HEADS, GROUPS, RANK, 64, dtype, "cuda")
        plans = {n: G.GluonWoAPlan.build(HEADS, GROUPS, RANK, 64, dtype, "cuda", config=VARIANTS[n]) for n in names}
        dg = [w.view(GROUPS, RANK, -1) for w in ws] if not fp8 else []
        for m in rows_list:
            o, cos, sin = rotated_inputs(m, gen)
            ref = grouped_wo_a(o, torch.complex(cos, sin), w_ref, GROUPS, 64)
            n = GROUPS * RANK
            z_t = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
            z_g = torch.empty_like(z_t)
            codes = torch.empty(m, n, dtype=torch.uint8, device="cuda")
            sbytes = torch.empty(m, n // 32, dtype=torch.uint8, device="cuda")
            og = o.view(m, GROUPS, -1).transpose(0, 1)
            runs = {"triton": lambda: [wo_a_(tri, o, cos, sin, w, scale, z_t) for w in ws],
                    "triton+quant": lambda: [wo_a_(tri, o, cos, sin, w, scale, z_t, codes, sbytes) for w in ws]}
            if not fp8:
                runs["cublas_bmm"] = lambda: [torch.bmm(og, d.transpose(1, 2)) for d in dg]
            for name, plan in plans.items():
                runs[f"gluon:{name}"] = lambda plan=plan: [G.gluon_wo_a_(plan, o, cos, sin, w, scale, z_g) for w in ws]
            runs[f"gluon:{names[0]}+quant"] = lambda: [G.gluon_wo_a_(plans[names[0]], o, cos, sin, w, scale, z_g,
                                                                     codes, sbytes) for w in ws]
            line = []
            for name, fn in runs.items():
                try:
                    us = graph_time_us(fn, calls_per_graph=len(ws))
                    line.append(f"{name} {us:6.2f} us ({100 * floor_us / us:3.0f} %)")
                except Exception as e:  # report, keep probing
                    line.append(f"{name}: {type(e).__name__}: {str(e)[:200]}")
            wo_a_(tri, o, cos, sin, ws[0], scale, z_t)
            acc = []
            for name, plan in plans.items():
                try:
                    G.gluon_wo_a_(plan, o, cos, sin, ws[0], scale, z_g)
                    acc.append(f"{name}: ulp {row_ulp_distance(z_g, ref):.0f}, "
                               f"{bits_differ(z_g, z_t)} differ from triton")
                except Exception as e:
                    acc.append(f"{name}: {type(e).__name__}: {str(e)[:200]}")
            print(f"{dname} rows {m:2d}: " + "; ".join(line), flush=True)
            print(f"         triton ulp {row_ulp_distance(z_t, ref):.0f}; " + "; ".join(acc), flush=True)
    print(f"done in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
