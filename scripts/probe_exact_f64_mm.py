"""Probe `exact_f64_mm` on a GPU (sm_90): `ExactF64MM` in a few configurations against the other
exact linears - `ExactMM` (CUDA cores, its tuned table) and `ExactInt8MM` (integer MMA, in the
shape's `_INT8_PLAN` configurations, else `Int8Config()`) - and the step's tensor-core FP8 plan
`GluonMM` (not exact), at the four V4.1-Flash shapes of the step's GEMMs (TP1): us per call from
CUDA-graph replay over weight copies rotated beyond L2 (as `bench gemm`; median of the replays),
and per line the bits of every exact op against ExactMM's (must be 0 differing outputs, on
model-like operands; the heavy-tailed check below adds subnormals and 448). First, per ExactF64MM
configuration, its registers and spills as compiled on this GPU (after a first call).

    PYTHONPATH=. python scripts/probe_exact_f64_mm.py --rows=1,2,4,8,16,32,64 --only=wq_b --alt=64:16:4:3:1,32:8:2:3:4

--alt: ExactF64MM configurations block_n:block_m:num_warps:num_stages:split (split: K splits for
calls of at most block_m rows).
"""

from __future__ import annotations

import torch

from dsv41_decode.bench.timing import graph_time_us, l2_rotation
from dsv41_decode.formats import fp8_block_quantize, mxfp8_quantize
from dsv41_decode.ops.exact_f64_mm import ExactF64MM, F64Config, _exact_f64_mm_kernel
from dsv41_decode.ops.exact_int8_mm import _INT8_PLAN, ExactInt8MM, Int8Config
from dsv41_decode.ops.exact_mm import ExactMM
from dsv41_decode.ops.gluon_mm import GluonMM
from dsv41_decode.reference.linear import mxfp8_mm
from dsv41_decode.testing.synthetic import heavy_e4m3

from _args import arg   # scripts/ is on sys.path when run as python scripts/<probe>.py

SHAPES = {"fused_wqa_wkv": (1792, 5120), "wq_b": (32768, 1280), "idx_wq_b": (4096, 1280), "wo_b": (5120, 8192)}
# the plans' defaults (`_DEFAULT_CONFIGS`) first, then wider / narrower tiles and K splits
CANDIDATES = ["32:8:2:3:1", "64:16:4:3:1", "64:32:4:3:1", "64:64:8:3:1", "16:8:1:3:1", "128:16:4:3:1", "32:8:2:4:1",
              "32:8:2:3:4", "16:8:1:3:8", "64:16:4:3:2"]


def _config(spec: str) -> F64Config:
    bn, bm, warps, stages, split = (int(v) for v in spec.split(":"))
    return F64Config(block_n=bn, block_m=bm, num_warps=warps, num_stages=stages, split=split)


def _time(fn, copies: int, replays: int) -> float:
    """Median us per call of `fn`, which makes `copies` calls (one per weight copy)."""
    return graph_time_us(fn, calls_per_graph=copies, replays=replays)


def _resources(specs: list[str]) -> None:
    """Registers and spills of the kernel per configuration, as compiled here (a first call each)."""
    g = torch.Generator(device="cuda").manual_seed(1)
    weight, w_scale = fp8_block_quantize(torch.randn(256, 256, generator=g, device="cuda") * 0.02)
    codes, x_scale = mxfp8_quantize(torch.randn(4, 256, generator=g, device="cuda").to(torch.bfloat16))
    cache = _exact_f64_mm_kernel.device_caches[torch.cuda.current_device()][0]
    for spec in specs:
        before = set(cache.keys())
        try:
            ExactF64MM(weight, w_scale, 64, config=_config(spec))(codes, x_scale)
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 - report, keep probing (the timing loop reports it again)
            print(f"ExactF64MM {spec}: {type(e).__name__} {str(e)[:100]}", flush=True)
            continue
        new = [cache[key] for key in cache.keys() if key not in before]
        if new:
            k = new[0]
            print(f"ExactF64MM {spec}: registers {k.n_regs}, spills {k.n_spills}, shared {k.metadata.shared} B",
                  flush=True)


def main() -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = [int(r) for r in arg("rows", "1,2,4,8,16,32,64").split(",")]
    names = arg("only", ",".join(SHAPES)).split(",")
    specs = [s for s in arg("alt", ",".join(CANDIDATES)).split(",") if s]
    replays = int(arg("replays", "20"))
    print(f"{torch.cuda.get_device_name()}", flush=True)
    _resources(specs)
    for name in names:
        n, k = SHAPES[name]
        copies = l2_rotation(n * k)
        ws = [fp8_block_quantize(torch.randn(n, k, generator=g, device="cuda") * 0.02) for _ in range(copies)]
        int8_cfg = _INT8_PLAN.get((n, k), (None, {64: Int8Config()}))[1]
        exact = [ExactMM(w, s, 64) for w, s in ws]
        int8 = [ExactInt8MM(w, s, 64, config=int8_cfg) for w, s in ws]
        gluon = [GluonMM(w, s, 64) for w, s in ws]
        print(f"{name}: N={n} K={k}, {copies} weight copies", flush=True)
        for m in rows:
            x = torch.randn(m, k, generator=g, device="cuda").to(torch.bfloat16)
            codes, x_scale = mxfp8_quantize(x)
            out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
            ref = exact[0](codes, x_scale).view(torch.int16).clone()

            def timed(plans):
                return _time(lambda: [p(codes, x_scale, out) for p in plans], copies, replays)

            t_gluon, t_exact = timed(gluon), timed(exact)
            bad_int8 = int((int8[0](codes, x_scale).view(torch.int16) != ref).sum())
            t_int8 = timed(int8)
            line = [f"{name:14s} M={m:2d}  gluon(TC) {t_gluon:7.2f}  exact_mm {t_exact:7.2f}  "
                    f"int8 {t_int8:7.2f}{'' if bad_int8 == 0 else f' ({bad_int8} DIFFER)'}"]
            best = None
            for spec in specs:
                try:
                    plans = [ExactF64MM(w, s, 64, config=_config(spec)) for w, s in ws]
                    bad = int((plans[0](codes, x_scale).view(torch.int16) != ref).sum())
                    t = timed(plans)
                    del plans
                except Exception as e:  # noqa: BLE001 - report, keep probing
                    line.append(f"{spec}: {type(e).__name__} {str(e)[:100]}")
                    continue
                line.append(f"f64 {spec} {t:7.2f}{'' if bad == 0 else f' ({bad} DIFFER)'}")
                if bad == 0 and (best is None or t < best[1]):
                    best = (spec, t)
            print("  ".join(line), flush=True)
            if best:
                print(f"BEST {name} M={m} f64 {best[0]} {best[1]:.2f} us  vs exact_mm {t_exact:.2f}, "
                      f"int8 {t_int8:.2f}, gluon {t_gluon:.2f} ({best[1] / t_gluon:.2f}x)", flush=True)
        # Heavy-tailed codes (448 down to the subnormals), where an inexact block sum shows.
        hc, hw = heavy_e4m3((16, k), g), heavy_e4m3((n, k), g)
        sx = torch.full((16, k // 32), 127, dtype=torch.uint8, device="cuda")
        href = mxfp8_mm(hc, sx, hw, ws[0][1]).view(torch.int16)
        for spec in specs:
            try:
                bad = int((ExactF64MM(hw, ws[0][1], 64, config=_config(spec))(hc, sx).view(torch.int16) != href).sum())
            except Exception as e:  # noqa: BLE001 - report, keep probing
                print(f"heavy {name} f64 {spec}: {type(e).__name__} {str(e)[:100]}", flush=True)
                continue
            print(f"heavy {name} f64 {spec}: {bad} outputs differ from the reference", flush=True)
        del ws, exact, int8, gluon


if __name__ == "__main__":
    main()
