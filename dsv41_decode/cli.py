"""`dsv41-decode`: demo | trace verify | trace record | plan."""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table

from .config import PRESETS, ConfigError, ModelConfig


def _config_arg(p: argparse.ArgumentParser, default: str) -> None:
    p.add_argument("--config", default=default,
                   help=f"a preset ({', '.join(sorted(PRESETS))}) or a config.json (official or Hugging Face "
                        f"keys) or a folder holding one (default: {default})")


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="dsv41-decode", description="DeepSeek-V4.1 attention decode: reference, "
                                 "golden traces and the CPU demo.")
    sub = ap.add_subparsers(dest="cmd", required=True)

    d = sub.add_parser("demo", help="serve several requests (prefill, then decode steps with draft rows) "
                       "through the reference stack on a synthetic checkpoint and check decode against prefill",
                       description="Writes a synthetic checkpoint to a temporary folder, loads it, admits several "
                       "requests of different lengths, prefills them, decodes with draft rows on some requests, "
                       "then prefills each whole sequence at once and prints, per layer kind, how the decoded "
                       "rows agree with the prefill and the time per step.")
    _config_arg(d, "small")
    d.add_argument("--device", default="cpu", help="torch device to run on, e.g. cpu or cuda (default: cpu)")
    d.add_argument("--prompts", default="37,64,5,90", help="prompt length per request, comma-separated "
                   "(default: 37,64,5,90)")
    d.add_argument("--drafts", default="2,0,3,0", help="draft rows per decode step per request, comma-separated, "
                   "one per prompt (default: 2,0,3,0)")
    d.add_argument("--steps", type=int, default=6, help="decode steps (default: 6)")
    d.add_argument("--seed", type=int, default=0, help="seed of the synthetic weights and inputs (default: 0)")
    d.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks: N > 1 runs N gloo processes on "
                   "the CPU, each with its shard of the heads (default: 1)")

    t = sub.add_parser("trace", help="golden traces: verify one, or record one from our own stack")
    tsub = t.add_subparsers(dest="trace_cmd", required=True)
    v = tsub.add_parser("verify", help="replay a trace folder teacher-forced, layer by layer; exit 1 past the "
                        "spec's tolerances", description="DIR holds config.json, model.safetensors and "
                        "trace.safetensors (the format of the README). Prints per call and layer: attn_out error "
                        "(BF16 ulps, relative RMS), quantized values not bit-exact, top-k agreement (equal / "
                        "equal up to tied scores / different), candidate rows that differ and the mHC boundary error.")
    v.add_argument("dir", type=Path)
    v.add_argument("--quiet", action="store_true", help="print only the summary line")
    r = tsub.add_parser("record", help="record a trace folder from our own stack (same format)")
    r.add_argument("out", type=Path, help="output folder (created)")
    _config_arg(r, "tiny")
    r.add_argument("--checkpoint", type=Path, help="a checkpoint folder to use instead of synthetic weights")
    r.add_argument("--prefill", type=int, default=40, help="prefill length (default: 40)")
    r.add_argument("--decode", type=int, default=14, help="single-token decode calls after it (default: 14)")
    r.add_argument("--batch", type=int, default=1, help="requests, all at the same positions (default: 1)")
    r.add_argument("--seed", type=int, default=0, help="seed of the weights, inputs and FFN stand-in (default: 0)")

    b = sub.add_parser("bench", help="GPU benchmarks (results under out/ unless --out says otherwise)")
    bsub = b.add_subparsers(dest="bench_cmd", required=True)
    g = bsub.add_parser("gemm", help="every V4.1-Flash attention linear (and TP2/4/8 shards) at 1-64 rows: ours vs "
                        "the regular path, cuBLAS BF16 and torch._scaled_mm FP8, against the measured read floor",
                        description="Times by CUDA-graph replay with the weights rotated beyond L2 (median of 50), "
                        "prints a table, writes <out>/gemm-<gpu>.jsonl and a PNG of GB/s vs rows.")
    g.add_argument("--rows", default="1,2,4,8,16,32,64", help="row counts (default: 1,2,4,8,16,32,64)")
    g.add_argument("--ops", default="", help="only these ops, comma-separated (e.g. wq_b,wo_b; default: all)")
    g.add_argument("--tp", default="1,2,4,8", help="tensor-parallel shards to include (default: 1,2,4,8)")
    g.add_argument("--out", type=Path, default=Path("out"),
                   help="results folder (default: out, git-ignored; canonical runs: docs/results)")

    at = bsub.add_parser("attn", help="the sparse-attention kernels (sparse MLA, indexer + top-k, record writes) "
                         "on synthetic state, against the reference on the GPU and FlashMLA's Hopper sparse decode",
                         description="Times by CUDA-graph replay (median of 50); writes <out>/attn-<gpu>.jsonl. "
                         "FlashMLA is timed when the `flash_mla` package (sgl-flash-mla 1.0.0) imports.")
    at.add_argument("--rows", default="1,4,16,64", help="rows (default: 1,4,16,64)")
    at.add_argument("--heads", default="8,16,32,64", help="local heads of sparse MLA (default: 8,16,32,64)")
    at.add_argument("--contexts", default="4096,32768,131072,1048576", help="contexts of the indexer "
                    "(default: 4096,32768,131072,1048576)")
    at.add_argument("--families", default="sparse_mla,indexer,kv_write",
                    help="kernel families to run (default: sparse_mla,indexer,kv_write)")
    at.add_argument("--name", default="attn", help="results file stem: <out>/<name>-<gpu>.jsonl (default: attn)")
    at.add_argument("--out", type=Path, default=Path("out"),
                    help="results folder (default: out, git-ignored; canonical runs: docs/results)")

    st = bsub.add_parser("step", help="the 40-layer V4.1-Flash decode step (random weights, synthetic state): "
                         "specialized step vs no overlap vs the generic path, per-layer-kind breakdown, timeline",
                         description="Times by CUDA-graph replay (median of 20); writes <out>/step-<gpu>.jsonl, "
                         "step-timeline-<gpu>.json (profiler trace) and step-timeline-<gpu>.png.")
    st.add_argument("--rows", default="1,2,4,8,16,32,64", help="row buckets (default: 1,2,4,8,16,32,64)")
    st.add_argument("--contexts", default="4096,32768,131072", help="contexts (default: 4096,32768,131072)")
    st.add_argument("--generic-rows", default="1,8", help="rows at which the generic path is timed (default: 1,8)")
    st.add_argument("--generic-contexts", default="32768", help="contexts of the generic path, the layer "
                    "breakdown and the timeline (default: 32768)")
    st.add_argument("--tp", type=int, default=1, help="tensor-parallel GPUs: N > 1 runs the TP step (collective "
                    "vs fused boundary) and the boundary alone; launch with torchrun --nproc-per-node N (default: 1)")
    st.add_argument("--name", default="step", help="results file stem (default: step)")
    st.add_argument("--variants", default=None, help="step variants timed next to the default one, comma-separated "
                    "of no_overlap, pdl, wo_a_fp8, wo_a_tf32, indexer_bf16, l2pf_25, l2pf_50, window_copy_torch, "
                    "indexer_first "
                    "(bench.step.VARIANTS; default: no_overlap,wo_a_fp8,window_copy_torch)")
    st.add_argument("--out", type=Path, default=Path("out"),
                    help="results folder (default: out, git-ignored; canonical runs: docs/results)")

    pt = sub.add_parser("plot", help="plot committed `bench step` results (JSON lines) as a PNG; no GPU needed")
    pt.add_argument("jsonl", type=Path, help="a results file, e.g. docs/results/step-h200.jsonl")
    pt.add_argument("--out", type=Path, help="the PNG (default: the results file with .png)")

    pl = sub.add_parser("plan", help="print a configuration's layer plan (kind and sources per layer)")
    _config_arg(pl, "v41-flash")
    return ap


def _ints(s: str, what: str) -> tuple[int, ...]:
    try:
        vals = tuple(int(v) for v in s.split(",") if v.strip())
    except ValueError:
        raise SystemExit(f"--{what}: expected comma-separated integers, got {s!r}") from None
    if not vals or min(vals) < 0:
        raise SystemExit(f"--{what}: expected non-negative integers, got {s!r}")
    return vals


def _verify(args, console: Console) -> int:
    from .testing.trace import verify_trace
    for f in ("config.json", "model.safetensors", "trace.safetensors"):
        if not (args.dir / f).exists():
            console.print(f"[red]{args.dir}: missing {f}[/red]")
            return 2
    results = verify_trace(args.dir, progress=console.is_terminal)
    table = Table(title=f"trace verify {args.dir}", caption="out: attn_out (BF16 ulps, relative RMS); quant!=: "
                  "quantized values (window, compressed KV, index keys) not bit-exact; top-k: rows with equal sets "
                  "(+ rows equal only up to tied scores, x rows that differ); cand!=: candidate rows that differ; "
                  "bnd: mHC streams (ulps); mix: mHC coefficients (abs)")
    for col in ("call", "L", "kind", "out ulp", "out rRMS", "quant!=", "top-k", "cand!=", "bnd", "mix"):
        table.add_column(col, justify="right")
    for res in results:
        n_rows = sum(res.topk.values())
        topk = "-" if not n_rows else f"{res.topk.get('equal', 0)}/{n_rows}" + \
            (f" +{res.topk['tie']}" if res.topk.get("tie") else "") + \
            (f" x{res.topk['differ']}" if res.topk.get("differ") else "")
        quant = " ".join(f"{k}={v}" for k, v in res.quant_bits.items() if v) or "0"
        table.add_row(res.call, str(res.layer), res.kind, f"{res.attn_out_ulp:g}", f"{res.attn_out_rel_rms:.1e}",
                      quant, topk, str(res.candidate_rows_differ), f"{res.boundary_ulp:.2g}",
                      f"{res.mix_abs:.0e}", style="red" if res.failures else None)
    if not args.quiet:
        console.print(table)
    bad = [(r.call, r.layer, f) for r in results for f in r.failures]
    ties = sum(r.topk.get("tie", 0) for r in results)
    calls = len({r.call for r in results})
    if bad:
        for call, layer, f in bad:
            console.print(f"[red]FAIL {call} layer {layer}: {f}[/red]")
        return 1
    console.print(f"[green]PASS[/green] {calls} calls x {len({r.layer for r in results})} layers; "
                  f"max attn_out error {max(r.attn_out_ulp for r in results):g} ulp; "
                  f"{ties} top-k rows equal only up to tied scores (compared on the recorded selection)")
    return 0


def _record(args, console: Console) -> int:
    from rich.progress import Progress
    from .testing.record import record_trace
    from .weights import load_checkpoint, write_synthetic_checkpoint
    with tempfile.TemporaryDirectory() as tmp:
        if args.checkpoint is None:
            write_synthetic_checkpoint(ModelConfig.load(args.config), tmp, seed=args.seed)
        ckpt = load_checkpoint(args.checkpoint or tmp)
    n = (1 + args.decode) * len(ckpt.layers)
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("recording", total=n)
        record_trace(ckpt, args.out, args.prefill, args.decode, args.batch, args.seed,
                     progress=lambda: progress.advance(task))
    console.print(f"wrote {args.out}/config.json, model.safetensors, trace.safetensors "
                  f"(prefill {args.prefill}, {args.decode} decode calls, batch {args.batch})")
    return 0


def _bench(args, console: Console) -> int:
    import torch
    if not torch.cuda.is_available():
        console.print("[red]bench needs a CUDA GPU; none is visible[/red]")
        return 2
    if args.bench_cmd == "attn":
        from .bench.attn import run_attn_bench
        from .bench.attn_ops import AttnOps
        run_attn_bench(AttnOps(), _ints(args.rows, "rows"), _ints(args.heads, "heads"),
                       _ints(args.contexts, "contexts"), args.out, progress=console.print,
                       families=tuple(args.families.split(",")), bench_name=args.name)
        return 0
    if args.bench_cmd == "step" and args.tp > 1:
        from .bench.step_tp import run_step_bench_tp
        run_step_bench_tp(args.tp, _ints(args.rows, "rows"), _ints(args.generic_contexts, "contexts"), args.out,
                          console.print)
        return 0
    if args.bench_cmd == "step":
        from .bench.step import DEFAULT_VARIANTS, run_step_bench
        variants = DEFAULT_VARIANTS if args.variants is None else tuple(v for v in args.variants.split(",") if v)
        run_step_bench(_ints(args.rows, "rows"), _ints(args.contexts, "contexts"), args.out, console.print,
                       _ints(args.generic_rows, "generic rows"), _ints(args.generic_contexts, "generic contexts"),
                       bench_name=args.name, extra_variants=variants)
        return 0
    from .bench.gemm import flash_shapes, run_gemm_bench
    from .bench.gemm_ops import GemmOps
    tps = _ints(args.tp, "tp")
    ops = {o for o in args.ops.split(",") if o}
    shapes = [s for s in flash_shapes(tps) if not ops or s.name in ops]
    if not shapes:
        raise SystemExit(f"--ops: no shape named {sorted(ops)}")
    run_gemm_bench(GemmOps(), _ints(args.rows, "rows"), shapes, args.out, progress=console.print)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    # a pipe or a CI log gets a fixed width wide enough for the tables
    console = Console(width=None if sys.stdout.isatty() else 140)
    try:
        if args.cmd == "demo":
            from .demo import DemoPlan, run_demo
            prompts, drafts = _ints(args.prompts, "prompts"), _ints(args.drafts, "drafts")
            if len(prompts) != len(drafts):
                raise SystemExit(f"--drafts needs one entry per prompt ({len(prompts)}), got {len(drafts)}")
            if min(prompts) < 1:
                raise SystemExit("--prompts: every prompt needs at least one token")
            cfg, plan = ModelConfig.load(args.config), DemoPlan(prompts, drafts, args.steps, args.seed)
            if args.tp > 1:
                from .demo import run_demo_tp
                if args.device != "cpu":
                    raise SystemExit("--tp runs gloo processes on the CPU; drop --device")
                cfg.check_tp(args.tp)
                return 0 if run_demo_tp(cfg, plan, args.tp, console) else 1
            stats = run_demo(cfg, plan, args.device, console)
            return 0 if all(s.bitwise == s.rows for s in stats.values()) else 1
        if args.cmd == "trace":
            return _verify(args, console) if args.trace_cmd == "verify" else _record(args, console)
        if args.cmd == "bench":
            return _bench(args, console)
        if args.cmd == "plot":
            from .bench.step_plot import load_jsonl, plot_step
            if not args.jsonl.is_file():
                raise SystemExit(f"plot: no results file {args.jsonl}")
            try:
                out = plot_step(load_jsonl(args.jsonl), args.out or args.jsonl.with_suffix(".png"))
            except ValueError as e:
                raise SystemExit(f"plot: {e}") from None
            console.print(f"wrote {out}")
            return 0
        if args.cmd == "plan":
            cfg = ModelConfig.load(args.config)
            console.print(cfg.plan.summary())
            return 0
    except ConfigError as e:
        console.print(f"[red]config error: {e}[/red]")
        return 2
    return 2


if __name__ == "__main__":
    sys.exit(main())
