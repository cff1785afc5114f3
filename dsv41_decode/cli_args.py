"""The command line of `dsv41-decode` (`cli.main` runs it): `build_parser`, its option types (each
bad value a one-line usage error naming it) and `UsageError`, which the commands raise too."""

from __future__ import annotations

import argparse
from pathlib import Path

from . import __version__
from .config import PRESETS

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


def build_parser() -> argparse.ArgumentParser:
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
                    "index_row_group4, fuse_scales, pair_slots, comp_tail, no_pdl, no_wq_b_pdl, no_wo_b_pdl, no_qkv_pdl, "
                    "no_norm_pdl, no_boundary_pdl, no_mla_pdl, no_prefetch_records, same (the default built again: the "
                    "spread to read a variant's ratio against; "
                    "bench.step.VARIANTS; default: "
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
