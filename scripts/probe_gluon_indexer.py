"""Probe the Gluon indexer scorer (`ops.gluon_indexer`) on an H200 against the step's Triton FP8 path
(`ops.indexer.index_scores_mxfp4_(fp8_dot=True)`), on `bench attn`'s indexer operands
(`bench.attn_indexer.indexer_inputs`: ratio-1 keys, 32 index heads, pages of 64, each row its own
pages). CUDA-graph replay (`bench.timing.graph_time_us`); the streaming read
(`bench.floor.read_bandwidth_gbps`) as the floor. Per rows x context: us of the Triton path and of
each Gluon variant (`--variants=stages:programs_per_sm[:h][:t][:p][:m][:k][:q][:rN][:gN]`, h = with the
fused histogram, t = the pair: the scorer then the top-k (`ops.topk.topk_ascending_`, the
histogram ready with h: the linked path), p = the BF16x2 terms (`packed_terms`), m = the wgmmas two
at a time (`mma_pairs`), k = the permuted key order (`kperm`), q = the query's powers of two and head
weights read from shared memory each tile (`qf_smem`: 96 registers with m), f = the query fold (`fold_q`:
64 q as the query's operand where its blocks allow, the epilogue's multiplications by the query's
powers of two skipped; `d:f` the defaults with it), rN = a register cap of N, gN = a
request's rows scored N at a time on each key tile read (`row_group`); `d`,
`d:h`, `d:t`, `d:h:t`: the launch's defaults, `default_options` by the call's size), GB/s and %
of the read (68 key bytes read and 4 score bytes written per entry), and how many of the Gluon
scores differ bitwise from the Triton path's (0 expected). `--rows=1,4,16,64`,
`--contexts=8192,32768,131072,1048576`, or `--cells=rows:context,...` (those cells only).
`--draft=R` (default 1): the rows as requests of R rows each (a decode row and R - 1 draft rows:
one request slot, its rows seeing context - R + 1 .. context entries), the keys' bytes counted once
a request. Prints; writes nothing. About 30-60 s.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _args import arg  # noqa: E402

from dsv41_decode.bench.attn_indexer import PAGE, indexer_inputs  # noqa: E402
from dsv41_decode.bench.floor import read_bandwidth_gbps  # noqa: E402
from dsv41_decode.bench.timing import graph_time_us  # noqa: E402
from dsv41_decode.ops.gluon_indexer import HIST_BINS, gluon_index_scores_mxfp4_, query_fold_rows  # noqa: E402
from dsv41_decode.ops.indexer import index_scores_mxfp4_  # noqa: E402
from dsv41_decode.ops.topk import TopKPlan, topk_ascending_  # noqa: E402
from dsv41_decode.testing.compare import bits_differ  # noqa: E402


def main() -> None:
    t0 = time.time()
    rows_list = [int(v) for v in arg("rows", "1,4,16,64").split(",")]
    contexts = [int(v) for v in arg("contexts", "8192,32768,131072,1048576").split(",")]
    variants = [v.split(":") for v in arg("variants", "4:3,4:4:m,6:4:m:k,4:4:m:p:k,4:5:m:k:q,4:4:q,4:3:h,4:4:m:k:h,4:5:m:k:q:h").split(",")]
    draft = int(arg("draft", "1"))
    gen = torch.Generator(device="cuda").manual_seed(0)
    read = read_bandwidth_gbps()
    print(f"streaming read {read:.0f} GB/s on {torch.cuda.get_device_name()}", flush=True)
    names = [":".join(v) for v in variants]
    print(f"{'rows':>4} {'context':>8} {'triton':>9} " + " ".join(f"{n:>16}" for n in names) + "  (us, % of read, dN: N scores differ)",
          flush=True)
    cells = [(r, c) for c in contexts for r in rows_list if r * c <= (64 << 20)]
    if arg("cells", ""):
        cells = [tuple(int(x) for x in cell.split(":")) for cell in arg("cells", "").split(",")]
    for rows, context in cells:
        pool, table, iq, w, req, n_vis, scores = indexer_inputs(rows, context, gen)
        if any("f" in v for v in variants):
            print(f"  {rows} x {context}: {int(query_fold_rows(iq).sum())} of {rows} rows fold (fold_q)", flush=True)
        nbytes = rows * context * (68 + 4)
        if draft > 1:        # request r // draft's slot; its rows see context - draft + 1 .. context entries
            rank = torch.arange(rows, device="cuda") % draft
            req = req - rank
            n_vis = (n_vis - (draft - 1 - rank)).clamp(min=0).to(torch.int32)
            nbytes = -(-rows // draft) * context * 68 + rows * context * 4
        ref = torch.empty_like(scores)
        small = rows * context < (4 << 20)
        kw = dict(replays=20 if small else 10, min_calls=32 if small else 4)

        def triton():
            index_scores_mxfp4_(iq, w, pool, table, PAGE, req, n_vis, ref, fp8_dot=True)

        t_tri = graph_time_us(triton, **kw)
        row_out = []
        for v in variants:
            dflt = v[0] == "d"
            flags = v[1:] if dflt else v[2:]
            stages, pps = (4, None) if dflt else (int(v[0]), int(v[1]))
            plan = TopKPlan.build(rows, 512, 1, "cuda") if "t" in flags else None
            hist = None
            if "h" in flags:      # with the pair, the top-k plan's histogram (the top-k zeroes it)
                hist = plan.hist_hi[:rows] if plan else torch.zeros(rows, HIST_BINS, dtype=torch.int32, device="cuda")
            cap = next((int(x[1:]) for x in flags if x.startswith("r")), None)
            group = next((int(x[1:]) for x in flags if x.startswith("g")), 1)
            opts = {} if dflt else {"mma_pairs": "m" in flags, "kperm": "k" in flags}
            sel = torch.empty(rows, 512, dtype=torch.int32, device="cuda")

            def gluon():
                gluon_index_scores_mxfp4_(iq, w, pool, table, PAGE, req, n_vis, scores, hist=hist, stages=stages,
                                          programs_per_sm=pps, maxnreg=cap, packed_terms="p" in flags,
                                          row_group=group, qf_smem="q" in flags, fold_q="f" in flags, **opts)
                if plan is not None:
                    topk_ascending_(scores, n_vis, sel, plan, hist_ready=hist is not None)

            try:          # a variant that fails (compile, launch) prints its error and the cell goes on
                t = graph_time_us(gluon, **kw)
                scores.fill_(float("nan"))
                gluon()
                triton()
                torch.cuda.synchronize()
            except Exception as e:      # noqa: BLE001 - the probe reports any failure and moves on
                print(f"  {rows} x {context} {v}: {type(e).__name__}: {str(e)[:160]}", flush=True)
                row_out.append("failed")
                continue
            diff = bits_differ(scores, ref)
            pct = 100 * nbytes / (read * 1e9) / (t * 1e-6)
            row_out.append(f"{t:7.2f} {pct:3.0f}% d{diff}")
        pct_tri = 100 * nbytes / (read * 1e9) / (t_tri * 1e-6)
        print(f"{rows:>4} {context:>8} {t_tri:6.2f} {pct_tri:2.0f}% " + " ".join(f"{c:>16}" for c in row_out),
              flush=True)
        del pool, scores, ref
        torch.cuda.empty_cache()
    print(f"done in {time.time() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
