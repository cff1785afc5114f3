"""`dsv41-decode bench gemm`: every V4.1-Flash attention linear at 1-64 rows, against the floor and
off-the-shelf baselines, timed by CUDA-graph replay with the weights rotated beyond L2."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ..formats import fp8_block_quantize
from .floor import read_bandwidth_gbps
from .results import format_table, record, run_info, runs_label, write_jsonl
from .timing import graph_time_us, l2_rotation

ROWS = (1, 2, 4, 8, 16, 32, 64)


@dataclass(frozen=True)
class Shape:
    """One linear: `kind` fp8 (MXFP8 x FP8 32x32), wo_a (grouped, BF16 in), side (BF16/FP32 weights, FP32 out)."""

    name: str
    n: int
    k: int
    kind: str = "fp8"
    tp: int = 1
    groups: int = 1            # wo_a: groups on this rank (each k -> n)
    w_dtype: torch.dtype = torch.float8_e4m3fn   # side: BF16/FP32; wo_a: FP8 (+ scales) or BF16

    @property
    def label(self) -> str:
        return f"{self.name}_bf16" if self.kind == "wo_a" and self.w_dtype == torch.bfloat16 else self.name

    def weight_bytes(self) -> int:
        if self.w_dtype != torch.float8_e4m3fn:
            return self.groups * self.n * self.k * torch.empty(0, dtype=self.w_dtype).element_size()
        per = self.n * self.k + (-(-self.n // 32)) * (self.k // 32)      # E4M3 + UE8M0 scales
        return self.groups * per

    def io_bytes(self, m: int) -> int:
        if self.kind == "side":
            return m * self.k * 2 + m * self.n * 4
        if self.kind == "wo_a":
            return self.groups * m * (self.k * 2 + self.n * 2) + m * 64 * 4
        return m * self.k + m * self.k // 32 + m * self.n * 2


def flash_shapes(tps=(1, 2, 4, 8)) -> list[Shape]:
    """The V4.1-Flash attention linears and their tensor-parallel shards."""
    out = [Shape("fused_wqa_wkv", 1792, 5120), Shape("idx_wq_b", 4096, 1280)]
    for tp in tps:
        out += [Shape("wq_b", 32768 // tp, 1280, tp=tp), Shape("wo_b", 5120, 8192 // tp, tp=tp),
                Shape("wo_a", 1024, 4096, kind="wo_a", tp=tp, groups=8 // tp),
                Shape("wo_a", 1024, 4096, kind="wo_a", tp=tp, groups=8 // tp, w_dtype=torch.bfloat16)]
    bf16 = torch.bfloat16
    out += [Shape("compressor_r2", 1024, 5120, kind="side", w_dtype=torch.float32),
            Shape("compressor_r1", 512, 5120, kind="side", w_dtype=bf16),
            Shape("weights_proj", 32, 5120, kind="side", w_dtype=bf16), Shape("wk", 128, 512, kind="side", w_dtype=bf16)]
    return out


def _fp8_weights(shape: Shape, copies: int, gen: torch.Generator):
    """`copies` random FP8 weights with 32x32 UE8M0 scales (and their BF16 dequantized values)."""
    out = []
    for _ in range(copies):
        w = torch.randn(shape.groups * shape.n, shape.k, generator=gen, device="cuda") * shape.k ** -0.5
        q, s = fp8_block_quantize(w)
        out.append((q, s))
    return out


def bench_shape(shape: Shape, m: int, ops, gen: torch.Generator) -> tuple[float, dict[str, float]]:
    """(our median us per call, {baseline: us}) for one shape and row count. `ops` builds our callables."""
    copies = l2_rotation(shape.weight_bytes())
    runs: dict[str, Callable[[], None]] = {}
    if shape.kind == "side":
        ws = [torch.randn(shape.n, shape.k, generator=gen, device="cuda").to(shape.w_dtype) for _ in range(copies)]
        x = torch.randn(m, shape.k, generator=gen, device="cuda").to(torch.bfloat16)
        ours = [ops.side(x, w) for w in ws]
        runs["ours"] = lambda: [f() for f in ours]
        wb = [w.to(torch.bfloat16) for w in ws]
        runs["cublas_bf16"] = lambda: [torch.nn.functional.linear(x, w) for w in wb]
    else:
        ws = _fp8_weights(shape, copies, gen)
        deq = [ops.dequant(q, s).to(torch.bfloat16) for q, s in ws]
        if shape.kind == "wo_a":
            o = torch.randn(m, shape.groups, shape.k, generator=gen, device="cuda").to(torch.bfloat16)
            if shape.w_dtype == torch.bfloat16:
                ws = [(d, None) for d in deq]
            ours = [ops.wo_a(o, q, s, shape.groups, shape.n) for q, s in ws]
            runs["ours"] = lambda: [f() for f in ours]
            triton_tier = [ops.wo_a_triton(o, q, s, shape.groups, shape.n) for q, s in ws]
            runs["triton"] = lambda: [f() for f in triton_tier]
            dg = [d.view(shape.groups, shape.n, shape.k) for d in deq]
            og = o.transpose(0, 1)
            runs["cublas_bf16"] = lambda: [torch.bmm(og, d.transpose(1, 2)) for d in dg]
        else:
            x = torch.randn(m, shape.k, generator=gen, device="cuda").to(torch.bfloat16)
            ours = [ops.fp8(x, q, s) for q, s in ws]
            runs["ours"] = lambda: [f() for f in ours]
            regular = [ops.regular(x, q, s) for q, s in ws]
            runs["regular"] = lambda: [f() for f in regular]
            triton_tier = [ops.triton(x, q, s) for q, s in ws]
            runs["triton"] = lambda: [f() for f in triton_tier]
            exact = [ops.exact(x, q, s) for q, s in ws]
            runs["exact"] = lambda: [f() for f in exact]
            runs["cublas_bf16"] = lambda: [torch.nn.functional.linear(x, d) for d in deq]
            # _scaled_mm needs rows in multiples of 16; per-tensor scales of one
            xs = torch.randn(max(16, m), shape.k, generator=gen, device="cuda").to(torch.float8_e4m3fn)
            one = torch.ones((), device="cuda")
            runs["scaled_mm_fp8"] = lambda: [torch._scaled_mm(xs, q.t(), scale_a=one, scale_b=one,
                                                              out_dtype=torch.bfloat16) for q, _ in ws]
    times = {name: graph_time_us(fn, calls_per_graph=copies) for name, fn in runs.items()}
    return times.pop("ours"), times


def run_gemm_bench(ops, rows=ROWS, shapes: list[Shape] | None = None, out_dir="out",
                   progress=print) -> list[dict]:
    """Benchmark every shape at every row count; write JSON lines and a PNG; return the rows."""
    info = run_info()
    floor = read_bandwidth_gbps()
    progress(f"streaming read: {floor:.0f} GB/s on {info['gpu']}")
    gen = torch.Generator(device="cuda").manual_seed(0)
    results = []
    for shape in shapes or flash_shapes():
        for m in rows:
            us, base = bench_shape(shape, m, ops, gen)
            case = {"op": shape.label, "kind": shape.kind, "tp": shape.tp, "rows": m, "n": shape.n, "k": shape.k,
                    "groups": shape.groups, "weight_mb": round(shape.weight_bytes() / 1e6, 2)}
            results.append(record("gemm", case, us, shape.weight_bytes() + shape.io_bytes(m), floor, base, info))
            progress(f"{shape.label} tp{shape.tp} M={m}: {us:.2f} us")
    for r in results:
        r["read_gbps"] = round(floor, 1)
    path = write_jsonl(results, out_dir, "gemm")
    plot_gemm(results, path.with_suffix(".png"), floor)
    print(format_table(results, ["op", "tp", "rows", "weight_mb"]))
    cross = crossover(results)
    if cross:
        print("the step's FP8 linear beats the regular path up to rows: " + ", ".join(f"{k}: {v}" for k, v in cross.items()))
    return results


def plot_gemm(rows: list[dict], path, floor_gbps: float) -> None:
    """GB/s vs rows, one panel per (op, tp), ours against the baselines and the measured floor (each
    panel's rows' own `read_gbps` where they carry one, else floor_gbps); each baseline in one colour
    in every panel, each panel titled with its run's commit."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    keys = sorted({(r["case"]["op"], r["case"]["tp"]) for r in rows}, key=lambda k: (k[0], k[1]))
    names = sorted({b for r in rows for b in r["baselines"]})
    cycle = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    colour = {"ours": cycle[0], **{b: cycle[(1 + i) % len(cycle)] for i, b in enumerate(names)}}
    cols = 4
    fig, axes = plt.subplots(-(-len(keys) // cols), cols, figsize=(4 * cols, 3 * -(-len(keys) // cols)),
                             squeeze=False)
    for ax, key in zip(axes.flat, keys):
        sel = [r for r in rows if (r["case"]["op"], r["case"]["tp"]) == key]
        ms = [r["case"]["rows"] for r in sel]
        nbytes = [r["gbps"] * r["us"] for r in sel]   # GB/s * us = bytes / 1e3
        ax.plot(ms, [r["gbps"] for r in sel], "o-", color=colour["ours"], label="ours")
        for b in sorted({b for r in sel for b in r["baselines"]}):
            ax.plot(ms, [nb / r["baselines"][b] for nb, r in zip(nbytes, sel)], ".--", color=colour[b], label=b)
        ax.axhline(sel[0].get("read_gbps", floor_gbps), color="gray", lw=0.8, label="streaming read")
        ax.set_xscale("log", base=2)
        ax.set_title(f"{key[0]} tp{key[1]} ({sel[0]['case']['weight_mb']} MB; {runs_label(sel)})", fontsize=9)
        ax.set_xlabel("rows")
        ax.set_ylabel("GB/s")
    for ax in list(axes.flat)[len(keys):]:
        ax.axis("off")
    handles = {}
    for ax in axes.flat:
        for h, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, h)
    fig.legend(handles.values(), handles.keys(), loc="lower right", fontsize=9)
    fig.suptitle(f"bench gemm on {rows[0]['gpu']} ({runs_label(rows)}): GB/s counts the bytes our op moves "
                 f"(its weights as stored), for every line")
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    fig.savefig(path, dpi=90)
    plt.close(fig)


def crossover(rows: list[dict]) -> dict[str, int]:
    """Per FP8 shape, the largest row count up to which the step's FP8 linear beats the regular path at
    every row count (0 when it never does)."""
    out = {}
    for key in sorted({(r["case"]["op"], r["case"]["tp"]) for r in rows if "regular" in r["baselines"]}):
        sel = sorted((r for r in rows if (r["case"]["op"], r["case"]["tp"]) == key), key=lambda r: r["case"]["rows"])
        best = 0
        for r in sel:
            if r["us"] > r["baselines"]["regular"]:
                break
            best = r["case"]["rows"]
        out[f"{key[0]} tp{key[1]}"] = best
    return out
