"""`dsv41-decode`: demo | trace verify | trace record | plan | plot | bench.

Errors: a failure prints one line on stderr, `dsv41-decode <command>: error: <what>`, naming the
option, value, file or tensor at fault, and exits 2 for a usage error (an option or value that
cannot work, a missing input file) or 1 for a failure while running (a checkpoint that does not
match its config, a capacity exceeded, a trace past the tolerances). `--debug` shows the traceback
instead. CPU work runs on `runtime.cpu_threads()` threads (`--threads`, `OMP_NUM_THREADS`).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table

from . import __version__
from .config import PRESETS, ConfigError, ModelConfig


class UsageError(Exception):
    """A command line that cannot work as given (exit 2); the message names the option or value."""


class _Parser(argparse.ArgumentParser):
    """argparse with one-line usage errors (raised, so `main` prints them and returns 2)."""

    def error(self, message: str):
        raise UsageError(f"{message} (see {self.prog} --help)")


def _int_at_least(lo: int):
    def parse(s: str) -> int:
        try:
            v = int(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= {lo}, got {s!r}") from None
        if v < lo:
            raise argparse.ArgumentTypeError(f"expected an integer >= {lo}, got {v}")
        return v
    parse.__name__ = f"integer >= {lo}"
    return parse


def _int_list(lo: int):
    """Comma-separated integers, each >= lo (at least one)."""
    def parse(s: str) -> tuple[int, ...]:
        try:
            vals = tuple(int(v) for v in s.split(",") if v.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {s!r}") from None
        if not vals:
            raise argparse.ArgumentTypeError(f"expected at least one integer, got {s!r}")
        bad = [v for v in vals if v < lo]
        if bad:
            raise argparse.ArgumentTypeError(f"expected integers >= {lo}, got {bad[0]} in {s!r}")
        return vals
    parse.__name__ = "list"
    return parse


def _name_list(known, allow_empty: bool = False):
    """Comma-separated names out of `known`."""
    def parse(s: str) -> tuple[str, ...]:
        vals = tuple(v.strip() for v in s.split(",") if v.strip())
        if not vals and not allow_empty:
            raise argparse.ArgumentTypeError(f"expected at least one of {', '.join(known)}")
        bad = [v for v in vals if v not in known]
        if bad:
            raise argparse.ArgumentTypeError(f"unknown name {bad[0]!r}; choose from {', '.join(known)}")
        return vals
    parse.__name__ = "list"
    return parse


def _device(s: str) -> str:
    head, _, idx = s.partition(":")
    if head not in ("cpu", "cuda") or (idx and not (head == "cuda" and idx.isdigit())):
        raise argparse.ArgumentTypeError(f"expected cpu, cuda or cuda:N, got {s!r}")
    return s


def _common(p: argparse.ArgumentParser, threads: bool = False) -> None:
    """Options every command takes: --debug, and --threads for the commands that run CPU work."""
    p.add_argument("--debug", action="store_true", help="on an error, show the Python traceback")
    if threads:
        p.add_argument("--threads", type=_int_at_least(1), default=None,
                       help="torch CPU threads (default: OMP_NUM_THREADS if set, else min(4, physical "
                            "cores, idle cores))")


def _config_arg(p: argparse.ArgumentParser, default: str | None, extra: str = "") -> None:
    p.add_argument("--config", default=default,
                   help=f"a preset ({', '.join(sorted(PRESETS))}) or a config.json (official or Hugging Face "
                        f"keys) or a folder holding one (default: {default or extra})")


PLAN_LEGEND = """\
legend:
  kind      swa: sliding window only; full: a KV source (runs the compressor, owns compressed KV and index keys,
            runs the indexer); full+cand: the KV source that also picks the candidate pool; reindex: its own
            indexer over a source's entries (over the candidates when the source picks them); reuse: a source's
            top-k as is
  r=        compress ratio: tokens per compressed entry (0: no compressed attention)
  kv_src=   the layer whose compressed KV and index keys this layer reads (None: window only)
  idx_src=  the layer whose top-k selection this layer attends to (itself when it runs the indexer)"""


def _parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="dsv41-decode", description="DeepSeek-V4.1 attention decode: reference, "
                 "golden traces and the CPU demo. Errors print one line on stderr (exit 2: usage, "
                 "1: failure); --debug shows the traceback.")
    ap.add_argument("--version", action="version", version=f"dsv41-decode {__version__}")
    sub = ap.add_subparsers(dest="cmd", required=True, metavar="COMMAND")

    d = sub.add_parser("demo", help="serve several requests (prefill, then decode steps with draft rows) "
                       "through the reference stack and check decode against prefill",
                       description="Writes a synthetic checkpoint to a temporary folder (or loads --checkpoint), "
                       "admits several requests of different lengths, prefills them, decodes with draft rows on "
                       "some requests, then prefills each whole sequence at once and prints, per layer kind, how "
                       "the decoded rows agree with the prefill and the time per step. Exit 1 when they differ.")
    _config_arg(d, None, "small; with --checkpoint: its config.json")
    d.add_argument("--checkpoint", type=Path, help="a checkpoint folder (config.json and model.safetensors or "
                   "shards with model.safetensors.index.json; README 'Checkpoints') instead of synthetic weights")
    d.add_argument("--device", type=_device, default="cpu", help="cpu, cuda or cuda:N (default: cpu)")
    d.add_argument("--prompts", type=_int_list(1), default=(37, 64, 5, 90),
                   help="prompt length per request, comma-separated, each >= 1 (default: 37,64,5,90)")
    d.add_argument("--drafts", type=_int_list(0), default=None, help="draft rows per decode step per request, "
                   "comma-separated, one per prompt (default: 2,0,3,0 with the default prompts, else 0 each)")
    d.add_argument("--steps", type=_int_at_least(1), default=6, help="decode steps (default: 6)")
    d.add_argument("--seed", type=int, default=0, help="seed of the synthetic weights and inputs (default: 0)")
    d.add_argument("--tp", type=_int_at_least(1), default=1, help="tensor-parallel ranks: N > 1 runs N gloo "
                   "processes on the CPU, each with its shard of the heads (default: 1)")
    _common(d, threads=True)

    t = sub.add_parser("trace", help="golden traces: verify one, or record one from our own stack")
    tsub = t.add_subparsers(dest="trace_cmd", required=True, metavar="ACTION")
    v = tsub.add_parser("verify", help="replay a trace folder teacher-forced, layer by layer; exit 1 past the "
                        "spec's tolerances", description="DIR holds config.json, model.safetensors and "
                        "trace.safetensors (the format of the README). Prints per call and layer: attn_out error "
                        "(BF16 ulps, relative RMS), quantized values not bit-exact, top-k agreement (equal / "
                        "equal up to tied scores / different), candidate rows that differ and the mHC boundary error.")
    v.add_argument("dir", type=Path, help="the trace folder")
    v.add_argument("--quiet", action="store_true", help="print only the summary line (PASS, or FAIL with the "
                   "count of failures and the first one)")
    v.add_argument("--path", choices=("reference", "step", "both"), default="reference",
                   help="what replays the decode calls: the generic reference layers, the specialized step "
                   "(DecodeStep, one layer at a time; the prefill through the reference unless --prefill kernels; "
                   "a head count the step does not run is padded with zero heads), or both, one after the other "
                   "(default: reference)")
    v.add_argument("--device", type=_device, default="cpu", help="cpu, cuda or cuda:N; on the CPU the step's "
                   "kernels run in Triton's interpreter, selected by the command (TRITON_INTERPRET=1, ~10 s per decode call) (default: cpu)")
    v.add_argument("--calls", type=_int_at_least(0), default=None,
                   help="replay only the first call and the N calls after it (default: all)")
    v.add_argument("--prefill", choices=("reference", "kernels"), default="reference",
                   help="with --path step: what replays the prefill call: the reference layers, or the step's "
                   "kernels as the kernel prefill runs it (stack.prefill; at most 64 rows) (default: reference)")
    v.add_argument("--tc-linears", action="store_true",
                   help="with --path step: build the step with exact_linears=False (the FP8 linears on FP8 tensor "
                   "cores, whose block sums truncate: outside the contract, spec decision 38)")
    v.add_argument("--fp32-dots", action="store_true",
                   help="with --path step: build the step with fp32_dots=True (the sparse MLA and wo_a with FP32 "
                   "IEEE dots instead of tensor-core ones)")
    _common(v, threads=True)
    r = tsub.add_parser("record", help="record a trace folder from our own stack (same format)",
                        description="Records into a temporary folder beside OUT and renames it to OUT at the end, "
                        "so a failure leaves nothing behind. OUT must not exist or be empty, unless --force "
                        "(which replaces it whole).")
    r.add_argument("out", type=Path, help="output folder (created; refused if it holds files, unless --force)")
    r.add_argument("--force", action="store_true", help="replace OUT even if it holds files (it is removed whole)")
    _config_arg(r, None, "tiny; with --checkpoint: its config.json")
    r.add_argument("--checkpoint", type=Path, help="a checkpoint folder to use instead of synthetic weights")
    r.add_argument("--prefill", type=_int_at_least(1), default=40, help="prefill length (default: 40)")
    r.add_argument("--decode", type=_int_at_least(0), default=14,
                   help="single-token decode calls after it (default: 14)")
    r.add_argument("--batch", type=_int_at_least(1), default=1,
                   help="requests, all at the same positions (default: 1)")
    r.add_argument("--seed", type=int, default=0, help="seed of the weights, inputs and FFN stand-in (default: 0)")
    _common(r, threads=True)

    b = sub.add_parser("bench", help="GPU benchmarks (results under out/, or --out docs/results for the canonical set)")
    bsub = b.add_subparsers(dest="bench_cmd", required=True, metavar="BENCH")
    rows = _int_list(1)
    g = bsub.add_parser("gemm", help="every V4.1-Flash attention linear (and TP2/4/8 shards) at 1-64 rows: ours vs "
                        "the regular path, cuBLAS BF16 and torch._scaled_mm FP8, against the measured read floor",
                        description="Times by CUDA-graph replay with the weights rotated beyond L2 (median of 50), "
                        "prints a table, writes <out>/gemm-<gpu>.jsonl and a PNG of GB/s vs rows.")
    g.add_argument("--rows", type=rows, default=(1, 2, 4, 8, 16, 32, 64),
                   help="row counts (default: 1,2,4,8,16,32,64)")
    g.add_argument("--ops", default="", help="only these ops, comma-separated (e.g. wq_b,wo_b; default: all)")
    g.add_argument("--tp", type=_int_list(1), default=(1, 2, 4, 8),
                   help="tensor-parallel shards to include (default: 1,2,4,8)")
    g.add_argument("--out", type=Path, default=Path("out"), help="results folder (default: out/, git-ignored; --out docs/results for the canonical set)")
    _common(g)

    at = bsub.add_parser("attn", help="the sparse-attention kernels (sparse MLA, indexer + top-k, record writes) "
                         "on synthetic state, against the reference on the GPU and FlashMLA's Hopper sparse decode",
                         description="Times by CUDA-graph replay (median of 50); writes <out>/attn-<gpu>.jsonl. "
                         "FlashMLA is timed when the `flash_mla` package (sgl-flash-mla 1.0.0) imports.")
    at.add_argument("--rows", type=rows, default=(1, 4, 16, 64), help="rows (default: 1,4,16,64)")
    at.add_argument("--heads", type=rows, default=(8, 16, 32, 64),
                    help="local heads of sparse MLA (default: 8,16,32,64)")
    at.add_argument("--contexts", type=rows, default=(4096, 32768, 131072, 1048576),
                    help="contexts of the indexer (default: 4096,32768,131072,1048576)")
    at.add_argument("--families", type=_name_list(("sparse_mla", "indexer", "kv_write")),
                    default=("sparse_mla", "indexer", "kv_write"),
                    help="kernel families to run (default: sparse_mla,indexer,kv_write)")
    at.add_argument("--name", default="attn", help="results file stem: <out>/<name>-<gpu>.jsonl (default: attn)")
    at.add_argument("--out", type=Path, default=Path("out"), help="results folder (default: out/, git-ignored; --out docs/results for the canonical set)")
    _common(at)

    st = bsub.add_parser("step", help="the 40-layer V4.1-Flash decode step (random weights, synthetic state): "
                         "specialized step vs no overlap vs the generic path, per-layer-kind breakdown, timeline",
                         description="Times by CUDA-graph replay (median of 20), and the public call step(x, rows) in a "
                         "loop against its replay (step_call rows); writes <out>/step-<gpu>.jsonl, "
                         "step-timeline-<gpu>.json (profiler trace) and step-timeline-<gpu>.png.")
    st.add_argument("--rows", type=rows, default=(1, 2, 4, 8, 16, 32, 64),
                    help="row buckets (default: 1,2,4,8,16,32,64)")
    st.add_argument("--contexts", type=rows, default=None,
                    help="contexts (default: 4096,32768,131072; with --tp: 32768)")
    st.add_argument("--generic-rows", type=rows, default=(1, 8),
                    help="rows at which the generic path is timed (default: 1,8)")
    st.add_argument("--generic-contexts", type=rows, default=(32768,), help="contexts of the generic path, the "
                    "layer breakdown and the timeline (default: 32768)")
    st.add_argument("--tp", type=_int_at_least(1), default=1, help="tensor-parallel GPUs: N > 1 runs the TP step "
                    "(collective vs fused boundary) at --rows x --contexts and the boundary alone; launch with "
                    "torchrun --nproc-per-node N (default: 1)")
    st.add_argument("--name", default="step", help="results file stem (default: step)")
    st.add_argument("--variants", default=None, help="step variants timed next to the default one at the "
                    "--generic-contexts (no_overlap at every context), comma-separated "
                    "of no_overlap, wo_a_fp8, tc_linears, fp32_dots, fold_index_chain, weights_in_index_lane, mix_early, "
                    "index_row_group4, fuse_scales, pair_slots "
                    "(bench.step.VARIANTS; default: "
                    "no_overlap,wo_a_fp8,tc_linears)")
    st.add_argument("--out", type=Path, default=Path("out"), help="results folder (default: out/, git-ignored; --out docs/results for the canonical set)")
    _common(st)

    pf = bsub.add_parser("prefill", help="one request's prompt (4K / 32K / 128K tokens) through the 40-layer "
                         "V4.1-Flash stack by the kernel prefill (random weights): tokens per second, time per "
                         "layer kind, floors",
                         description="Wall time of each prefill (CUDA graphs of the step's kernels over chunks), the "
                         "bytes and compute floors, one layer of each kind alone per chunk; writes "
                         "<out>/prefill-<gpu>.jsonl.")
    pf.add_argument("--prompts", type=rows, default=(4096, 32768, 131072),
                    help="prompt lengths (default: 4096,32768,131072)")
    pf.add_argument("--chunk", type=_int_at_least(1), default=64, help="rows per call, 1..64 (default: 64)")
    pf.add_argument("--reference-tokens", type=_int_at_least(0), default=32, help="prompt length on which the "
                    "reference path's time per token is measured for the baseline; 0 skips it (default: 32)")
    pf.add_argument("--name", default="prefill", help="results file stem (default: prefill)")
    pf.add_argument("--tc-linears", action="store_true", help="build the prefill's step with exact_linears=False "
                    "(the FP8 linears on FP8 tensor cores: faster per chunk, but their block sums truncate, so the "
                    "records a layer writes are no longer the reference's for its input; docs/prefill.md)")
    pf.add_argument("--fp32-dots", action="store_true", help="build the prefill's step with fp32_dots=True too "
                    "(the sparse MLA and wo_a with FP32 IEEE dots; much slower per chunk)")
    pf.add_argument("--out", type=Path, default=Path("out"), help="results folder (default: out/, git-ignored; --out docs/results for the canonical set)")
    _common(pf)

    pt = sub.add_parser("plot", help="plot committed bench results (JSON lines of bench gemm, attn or step) as a "
                        "PNG; no GPU needed", description="Redraws the PNG that the bench wrote, from its JSON "
                        "lines: bench gemm (GB/s vs rows per op and TP shard), bench attn (sparse MLA time, indexer "
                        "GB/s, top-k time), bench step (step time vs rows per context; with --tp N the boundary too). "
                        "The bench is read from each line's `bench` field.")
    pt.add_argument("jsonl", type=Path, help="a results file, e.g. docs/results/step-h200.jsonl")
    pt.add_argument("--out", type=Path, help="the PNG (default: the results file with .png)")
    _common(pt)

    pl = sub.add_parser("plan", help="print a configuration's layer plan (kind and sources per layer)",
                        description="One line per layer: index, kind, r=, kv_src=, idx_src= (legend printed below).")
    _config_arg(pl, "v41-flash")
    _common(pl)
    return ap


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
    """--checkpoint, checked to be a folder with a config.json (or --config given)."""
    ck = args.checkpoint
    if ck is None:
        return None
    if not ck.is_dir():
        raise UsageError(f"--checkpoint {ck}: no such folder")
    if args.config is None and not (ck / "config.json").is_file():
        raise UsageError(f"--checkpoint {ck}: no config.json in it (or give --config)")
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
        from .bench.step import DEFAULT_VARIANTS, VARIANTS
        variants = DEFAULT_VARIANTS if args.variants is None else tuple(v for v in args.variants.split(",") if v)
        bad = [v for v in variants if v not in VARIANTS]
        if bad:
            raise UsageError(f"--variants: unknown variant {bad[0]!r}; choose from {', '.join(VARIANTS)}")
        if args.tp > 1:
            # the TP bench times the default step (collective and fused boundary) at --rows x
            # --contexts: the single-GPU run's other options would be dropped silently
            defaults = _parser().parse_args(["bench", "step"])
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
    stats = run_demo(cfg, plan, args.device, console, checkpoint=ck)
    return 0 if all(s.bitwise == s.rows for s in stats.values()) else 1


def _plot(args, console: Console) -> int:
    from .bench.results import plot_results
    from .bench.step_plot import load_jsonl
    if not args.jsonl.is_file():
        raise UsageError(f"{args.jsonl}: no such results file")
    try:
        out = plot_results(load_jsonl(args.jsonl), args.out or args.jsonl.with_suffix(".png"))
    except ValueError as e:
        raise UsageError(f"{args.jsonl}: {e}") from None
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
    from .state import CapacityError
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
        args = _parser().parse_args(argv)
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
