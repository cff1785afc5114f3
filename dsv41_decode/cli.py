"""`dsv41-decode`: demo | trace verify | trace record | plan | plot | bench.

Errors: a failure prints one line on stderr, `dsv41-decode <command>: error: <what>`, naming the
option, value, file or tensor at fault, and exits 2 for a usage error (an option or value that
cannot work, a missing input file) or 1 for a failure while running (a checkpoint that does not
match its config, a capacity exceeded, a trace past the tolerances). `--debug` shows the traceback
instead. CPU work runs on `runtime.cpu_threads()` threads (`--threads`, `OMP_NUM_THREADS`).
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table

from .cli_args import UsageError, build_parser
from .config import ConfigError, ModelConfig


PLAN_LEGEND = """\
legend:
  kind      swa: sliding window only; full: a KV source (runs the compressor, owns compressed KV and index keys,
            runs the indexer); full+cand: the KV source that also picks the candidate pool; reindex: its own
            indexer over a source's entries (over the candidates when the source picks them); reuse: a source's
            top-k as is
  r=        compress ratio: tokens per compressed entry (0: no compressed attention)
  kv_src=   the layer whose compressed KV and index keys this layer reads (None: window only)
  idx_src=  the layer whose top-k selection this layer attends to (itself when it runs the indexer)"""


def _verify(args, console: Console) -> int:
    for f in ("config.json", "model.safetensors", "trace.safetensors"):
        if not (args.dir / f).exists():
            raise UsageError(f"{args.dir}: not a trace folder: missing {f}")
    if args.device != "cpu":
        import torch
        if not torch.cuda.is_available():
            raise UsageError(f"--device {args.device}: CUDA is not available")
    paths = ("reference", "step") if args.path == "both" else (args.path,)
    if "step" in paths and args.device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        # The interpreter is chosen when a kernel module is imported: possible only before that.
        if any(m.startswith("dsv41_decode.ops") for m in sys.modules):
            raise UsageError("--path step on the CPU runs the step's Triton kernels in the interpreter: "
                             "set TRITON_INTERPRET=1 (or use --device cuda)")
        os.environ["TRITON_INTERPRET"] = "1"
    if args.calls is not None:      # (imports the kernels: after the interpreter's choice above)
        from .testing.trace import calls_after_first, read_case
        if args.calls > (held := calls_after_first(read_case(args.dir / "trace.safetensors"))):
            raise UsageError(f"--calls {args.calls}: the trace holds {held} calls after the first")
    return max(_verify_path(args, p, console) for p in paths)


def exactness_hint(path: str, device: str, tc_linears: bool) -> str | None:
    """The line `trace verify` adds under a failing run whose failures may be the step's FP8 linears
    on tensor cores (the step on a GPU with --tc-linears: they truncate each 32-deep block sum,
    spec decision 38), else None."""
    if path != "step" or device == "cpu" or not tc_linears:
        return None
    return ("--tc-linears runs the step's FP8 linears on tensor cores, which truncate each 32-deep block sum "
            "(docs/gemm.md, \"Exactness\"): without it they have the contract's bits")


def _verify_path(args, path: str, console: Console) -> int:
    from .testing.trace import verify_trace
    notes: list[str] = []
    if args.prefill == "kernels" and args.path != "step":
        raise UsageError(f"--prefill kernels runs the prefill through the step: use it with --path step, "
                         f"not --path {args.path}")
    for flag, on in (("--tc-linears", args.tc_linears), ("--fp32-dots", args.fp32_dots)):
        if on and args.path == "reference":
            raise UsageError(f"{flag} builds the step's kernels: use it with --path step or both")
    results = verify_trace(args.dir, progress=not args.quiet, path=path, device=args.device, calls=args.calls,
                           log=notes.append, prefill=args.prefill,
                           exact_linears=not (args.tc_linears and path == "step"),
                           fp32_dots=args.fp32_dots and path == "step")
    if args.tc_linears and path == "step":
        notes.append("the step's FP8 linears on tensor cores (exact_linears=False: truncated block sums)")
    if args.fp32_dots and path == "step":
        notes.append("the step's sparse MLA and wo_a with FP32 IEEE dots (fp32_dots=True)")
    # the notes (the head padding): in full before the table, their first clause in the summary
    what = f"--path {path}" + "".join(f", {n.split(' (')[0]}" for n in notes)
    if not args.quiet:
        for n in notes:
            console.print(n, soft_wrap=True)
    table = Table(title=f"trace verify {args.dir} --path {path}", caption="path: what ran the call (the prefill "
                  f"through {'the step' if args.prefill == 'kernels' else 'the reference'}); out: "
                  "attn_out (BF16 ulps, relative RMS); flip: rows past 2 ulps explained "
                  "by one FP8 code flip of wo_b's input (ulps left after it); quant!=: quantized values (window, "
                  "compressed KV, index keys) not bit-exact; top-k: rows with equal sets (+ rows equal only up to "
                  "tied scores, x rows that differ); cand!=: candidate rows that differ; bnd: mHC streams (ulps); "
                  "mix: mHC coefficients (abs, and / the derived bound)")
    for col in ("call", "L", "kind", "path", "out ulp", "out rRMS", "flip", "quant!=", "top-k", "cand!=", "bnd",
                "mix"):
        table.add_column(col, justify="right")
    for res in results:
        n_rows = sum(res.topk.values())
        topk = "-" if not n_rows else f"{res.topk.get('equal', 0)}/{n_rows}" + \
            (f" +{res.topk['tie']}" if res.topk.get("tie") else "") + \
            (f" x{res.topk['differ']}" if res.topk.get("differ") else "")
        quant = " ".join(f"{k}={v}" for k, v in res.quant_bits.items() if v) or "0"
        flip = f"{len(res.flips)} ({res.attn_out_unexplained_ulp:g})" if res.flips else "-"
        table.add_row(res.call, str(res.layer), res.kind, res.path, f"{res.attn_out_ulp:g}",
                      f"{res.attn_out_rel_rms:.1e}", flip, quant, topk, str(res.candidate_rows_differ),
                      f"{res.boundary_ulp:.2g}", f"{res.mix_abs:.0e} {res.mix_ratio:.2g}",
                      style="red" if res.failures else None)
    if not args.quiet:
        console.print(table)
    bad = [(r.call, r.layer, f) for r in results for f in r.failures]
    ties = sum(r.topk.get("tie", 0) for r in results)
    flips = sum(len(r.flips) for r in results)
    calls = len({r.call for r in results})
    shape = f"{calls} calls x {len({r.layer for r in results})} layers"
    if bad:
        if not args.quiet:
            for call, layer, f in bad:
                console.print(f"[red]FAIL {call} layer {layer}: {f}[/red]")
        call, layer, f = bad[0]
        console.print(f"[red]FAIL[/red] {what}: {len(bad)} failure(s) in {len({(c, L) for c, L, _ in bad})} "
                      f"of {len(results)} call-layers ({shape}); first: {call} layer {layer}: {f}", soft_wrap=True)
        hint = exactness_hint(path, args.device, args.tc_linears)
        if hint and not args.quiet:
            console.print(hint, soft_wrap=True)
        return 1
    console.print(f"[green]PASS[/green] {what}: {shape}; "
                  f"max attn_out error {max(r.attn_out_ulp for r in results):g} ulp"
                  + (f" ({flips} rows explained by one FP8 code flip of wo_b's input, then "
                     f"<= {max(r.attn_out_unexplained_ulp for r in results):g} ulp)" if flips else "")
                  + f"; mHC coefficients <= {max(r.mix_ratio for r in results):.2g} of their bound; "
                  f"{ties} top-k rows equal only up to tied scores", soft_wrap=True)
    return 0


def _config(args, default: str) -> ModelConfig:
    """The configuration of --config, else of --checkpoint's config.json, else the preset `default`."""
    if args.config is not None:
        return ModelConfig.load(args.config)
    if args.checkpoint is not None:
        return ModelConfig.from_json(args.checkpoint)
    return ModelConfig.preset(default)


def _checkpoint_dir(args) -> Path | None:
    """--checkpoint, checked to be a folder with a config.json (or --config given) and weight files."""
    from .weights import NO_WEIGHT_FILES, has_weight_files
    ck = args.checkpoint
    if ck is None:
        return None
    if not ck.is_dir():
        raise UsageError(f"--checkpoint {ck}: no such folder")
    if args.config is None and not (ck / "config.json").is_file():
        raise UsageError(f"--checkpoint {ck}: no config.json in it (or give --config)")
    if not has_weight_files(ck):
        raise UsageError(f"--checkpoint {ck}: {NO_WEIGHT_FILES} in it")
    return ck


def _load(args, cfg: ModelConfig, tmp: str, device: str = "cpu", seed: int = 0):
    """The checkpoint of --checkpoint (with --config's configuration if given), or a synthetic one of
    `cfg` written to `tmp`."""
    from .weights import load_checkpoint, write_synthetic_checkpoint
    ck = _checkpoint_dir(args)
    if ck is None:
        write_synthetic_checkpoint(cfg, tmp, seed=seed)
        return load_checkpoint(tmp, device=device)
    return load_checkpoint(ck, device=device, config=cfg if args.config is not None else None)


def _record(args, console: Console) -> int:
    from .runtime import Steps
    from .testing.record import record_trace
    out = args.out
    if out.exists() and not out.is_dir():
        raise UsageError(f"{out}: exists and is not a folder")
    if out.is_dir() and any(out.iterdir()) and not args.force:
        held = sorted(p.name for p in out.iterdir())
        raise UsageError(f"{out}: folder is not empty ({len(held)} entries: {', '.join(held[:4])}"
                         f"{', ...' if len(held) > 4 else ''}); choose another OUT, or --force to replace it")
    if not out.parent.is_dir():
        raise UsageError(f"{out}: its parent folder {out.parent} does not exist")
    _checkpoint_dir(args)
    cfg = _config(args, "tiny")
    # record beside OUT, then rename: a failure or an interrupt leaves OUT as it was
    part = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        with tempfile.TemporaryDirectory() as tmp:
            ckpt = _load(args, cfg, tmp, seed=args.seed)
        n_layers = len(ckpt.layers)
        calls = ["prefill"] + [f"decode{i:02d}" for i in range(args.decode)]
        with Steps("trace record: call", len(calls), Console(stderr=True)) as steps:
            done = [0]

            def layer_done() -> None:
                done[0] += 1
                if done[0] % n_layers == 0:
                    steps.advance(calls[done[0] // n_layers - 1])
            record_trace(ckpt, part, args.prefill, args.decode, args.batch, args.seed, progress=layer_done)
        if out.exists():
            shutil.rmtree(out)
        part.rename(out)
    except BaseException:
        shutil.rmtree(part, ignore_errors=True)
        raise
    console.print(f"wrote {out}/config.json, model.safetensors, trace.safetensors "
                  f"(prefill {args.prefill}, {args.decode} decode calls, batch {args.batch})")
    return 0


def _bench(args, console: Console) -> int:
    import torch
    if args.bench_cmd == "step":
        # the variants' names before anything else (on any machine): a typo costs no GPU time
        from .bench.step import CONTEXTS, DEFAULT_VARIANTS, VARIANTS
        variants = DEFAULT_VARIANTS if args.variants is None else tuple(v for v in args.variants.split(",") if v)
        bad = [v for v in variants if v not in VARIANTS]
        if bad:
            raise UsageError(f"--variants: unknown variant {bad[0]!r}; choose from {', '.join(VARIANTS)}")
        # the variants other than no_overlap run at the generic contexts only: named where none of
        # those is benched, they would be dropped silently (the default ones are, as documented)
        contexts = args.contexts or CONTEXTS
        generic_only = [v for v in variants if v != "no_overlap"]
        benched = set(args.generic_contexts) & set(contexts)
        if args.tp == 1 and args.variants is not None and generic_only and not benched:
            raise UsageError(f"--variants: {generic_only[0]} runs at the --generic-contexts only "
                             f"({','.join(map(str, args.generic_contexts))}), none of which is among the contexts "
                             f"benched ({','.join(map(str, contexts))})")
        if args.tp > 1:
            # the TP bench times the default step (collective and fused boundary) at --rows x
            # --contexts: the single-GPU run's other options would be dropped silently
            defaults = build_parser().parse_args(["bench", "step"])
            given = [f"--{name.replace('_', '-')}" for name in ("variants", "generic_rows", "generic_contexts", "name")
                     if getattr(args, name) != getattr(defaults, name)]
            if given:
                raise UsageError(f"{given[0]}: not taken with --tp {args.tp} (the TP bench times the default step at "
                                 f"--rows x --contexts)")
    if not torch.cuda.is_available():
        raise UsageError(f"bench {args.bench_cmd} needs a CUDA GPU; none is visible (torch {torch.__version__})")
    if args.bench_cmd == "attn":
        from .bench.attn import run_attn_bench
        from .bench.attn_ops import AttnOps
        run_attn_bench(AttnOps(), args.rows, args.heads, args.contexts, args.out, progress=console.print,
                       families=args.families, bench_name=args.name)
        return 0
    if args.bench_cmd == "prefill":
        from .bench.prefill import run_prefill_bench
        if args.chunk > 64:
            raise UsageError(f"--chunk: the kernel prefill runs 1..64 rows per call, got {args.chunk}")
        run_prefill_bench(args.prompts, args.chunk, args.out, console.print, args.reference_tokens, args.name,
                          exact_linears=not args.tc_linears, fp32_dots=args.fp32_dots)
        return 0
    if args.bench_cmd == "step" and args.tp > 1:
        from .bench.step_tp import TP_CONTEXTS, run_step_bench_tp
        run_step_bench_tp(args.tp, args.rows, args.contexts or TP_CONTEXTS, args.out, console.print)
        return 0
    if args.bench_cmd == "step":
        from .bench.step import CONTEXTS, run_step_bench
        run_step_bench(args.rows, args.contexts or CONTEXTS, args.out, console.print, args.generic_rows,
                       args.generic_contexts, bench_name=args.name, extra_variants=variants)
        return 0
    from .bench.gemm import flash_shapes, run_gemm_bench
    from .bench.gemm_ops import GemmOps
    ops = {o for o in args.ops.split(",") if o}
    shapes = flash_shapes(args.tp)
    bad = sorted(ops - {s.name for s in shapes})
    if bad:
        raise UsageError(f"--ops: no shape named {bad[0]!r}; choose from "
                         f"{', '.join(sorted({s.name for s in shapes}))}")
    shapes = [s for s in shapes if not ops or s.name in ops]
    run_gemm_bench(GemmOps(), args.rows, shapes, args.out, progress=console.print)
    return 0


def _demo(args, console: Console) -> int:
    from .demo import DemoPlan, run_demo
    prompts = args.prompts
    drafts = args.drafts if args.drafts is not None else \
        ((2, 0, 3, 0) if prompts == (37, 64, 5, 90) else (0,) * len(prompts))
    if len(prompts) != len(drafts):
        raise UsageError(f"--drafts: needs one entry per --prompts entry ({len(prompts)}), got {len(drafts)}")
    if args.device != "cpu":
        import torch
        if not torch.cuda.is_available():
            why = "a CPU-only build" if torch.version.cuda is None else "no GPU is visible"
            raise UsageError(f"--device {args.device}: CUDA is not available (torch {torch.__version__}: {why})")
        idx = args.device.partition(":")[2]
        if idx and int(idx) >= torch.cuda.device_count():
            raise UsageError(f"--device {args.device}: only {torch.cuda.device_count()} GPU(s) visible")
    ck = _checkpoint_dir(args)
    cfg, plan = _config(args, "small"), DemoPlan(prompts, drafts, args.steps, args.seed)
    if args.tp > 1:
        from .demo import run_demo_tp
        if args.device != "cpu":
            raise UsageError("--tp: runs gloo processes on the CPU; drop --device")
        cfg.check_tp(args.tp)
        return 0 if run_demo_tp(cfg, plan, args.tp, console, checkpoint=ck) else 1
    return 0 if run_demo(cfg, plan, args.device, console, checkpoint=ck).ok else 1


def _plot(args, console: Console) -> int:
    from .bench.results import plot_results
    from .bench.step_plot import load_jsonl
    if not args.jsonl.is_file():
        raise UsageError(f"{args.jsonl}: no such results file")
    out = args.out or args.jsonl.with_suffix(".png")
    if not out.parent.is_dir():
        raise UsageError(f"--out {out}: no such folder {out.parent}")
    if out.is_dir():
        raise UsageError(f"--out {out}: a folder; give the image's file name (e.g. {out / 'step.png'})")
    try:
        out = plot_results(load_jsonl(args.jsonl), out)
    except ValueError as e:
        msg = str(e)
        raise UsageError(msg if msg.startswith(str(args.jsonl)) else f"{args.jsonl}: {msg}") from None
    console.print(f"wrote {out}")
    return 0


def _run(args, console: Console) -> int:
    if args.cmd == "demo":
        return _demo(args, console)
    if args.cmd == "trace":
        return _verify(args, console) if args.trace_cmd == "verify" else _record(args, console)
    if args.cmd == "bench":
        return _bench(args, console)
    if args.cmd == "plot":
        return _plot(args, console)
    cfg = ModelConfig.load(args.config)   # plan
    console.print(cfg.plan.summary())
    console.print(PLAN_LEGEND, highlight=False)
    return 0


# Errors whose message already says what is wrong: printed as they are (others get their type name).
def _domain_errors() -> tuple[type, ...]:
    from .rows import CapacityError
    from .weights import CheckpointError
    return (CheckpointError, CapacityError, ValueError, KeyError, OSError)


def _one_line(e: BaseException) -> str:
    msg = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
    msg = " ".join(str(msg).split())
    return msg or type(e).__name__


def main(argv: list[str] | None = None) -> int:
    """Run the command line `argv` (default: sys.argv[1:]); returns the exit status (0, 1 or 2)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        args = build_parser().parse_args(argv)
    except UsageError as e:
        print(f"dsv41-decode: error: {_one_line(e)}", file=sys.stderr)
        return 2
    prog = "dsv41-decode " + " ".join(a for a in (args.cmd, getattr(args, "trace_cmd", None),
                                                   getattr(args, "bench_cmd", None)) if a)
    # a pipe or a CI log gets a fixed width wide enough for the tables; a line of text stays one line
    console = Console(width=None if sys.stdout.isatty() else 140, soft_wrap=True)
    threads = None
    try:
        if hasattr(args, "threads"):
            import torch
            from .runtime import cpu_threads
            n, why = cpu_threads(args.threads)
            threads = torch.get_num_threads()
            torch.set_num_threads(n)
            if args.debug:
                print(f"{prog}: {n} CPU thread(s) ({why})", file=sys.stderr)
        return _run(args, console)
    except (UsageError, ConfigError) as e:
        if args.debug:
            raise
        print(f"{prog}: error: {_one_line(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        if args.debug:
            raise
        what = _one_line(e) if isinstance(e, _domain_errors()) else f"{type(e).__name__}: {_one_line(e)} (--debug shows the traceback)"
        print(f"{prog}: error: {what}", file=sys.stderr)
        return 1
    finally:
        if threads is not None:
            import torch
            torch.set_num_threads(threads)


if __name__ == "__main__":
    sys.exit(main())
