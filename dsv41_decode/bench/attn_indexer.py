"""`bench attn`, indexer family: logits over MXFP4 index keys (68-byte records) and top-512, per row
count and context (ratio 1: one entry per token), on random valid records. The logits are the
decode step's scorer (`decode.attention.index_scores_launch`: on sm_90 the Gluon scorer
`ops.gluon_indexer`, with the Triton FP8 path as the baseline column `triton_fp8`; elsewhere the
Triton FP8 path), with the BF16 path as the baseline column `bf16_path`. "indexer+topk" is the
step's pair (`index_scores_launch`, then `topk_launch`): on sm_90 the scorer also builds the
top-k's high-byte histogram where that pays (`hist_ready`), and with it ready at <= 4 rows the
top-k runs in one launch (`decode.attention.TOPK_ONE_LAUNCH_MAX_ROWS`)."""

from __future__ import annotations

import torch

from ..decode.attention import index_scores_launch, topk_launch
from ..formats import mxfp4_fake
from ..ops.common import is_sm90
from ..ops.gluon_indexer import gluon_index_scores_mxfp4_
from ..ops.indexer import index_scores_mxfp4_
from ..ops.topk import TopKPlan, topk_ascending_
from .results import record
from .timing import graph_time_us

HEADS, PAGE = 32, 64


def _state(rows: int, context: int, gen: torch.Generator):
    """A pool of random records (E2M1 nibbles, UE8M0 scales 120..130), each row's own pages."""
    pages = -(-context // PAGE)
    pool = torch.randint(0, 256, (rows * pages * PAGE, 68), generator=gen, device="cuda", dtype=torch.uint8)
    pool[:, 64:] = torch.randint(120, 131, (rows * pages * PAGE, 4), generator=gen, device="cuda",
                                 dtype=torch.uint8)
    table = torch.arange(rows * pages, device="cuda", dtype=torch.int32).view(rows, pages)
    return pool, table


def indexer_inputs(rows: int, context: int, gen: torch.Generator):
    """Synthetic indexer operands on the GPU, every row seeing `context` entries of its own pages:
    (pool, block table, MXFP4 query [rows, 32, 128], head weights, request slots, n_vis, scores)."""
    pool, table = _state(rows, context, gen)
    iq = mxfp4_fake(torch.randn(rows, HEADS, 128, generator=gen, device="cuda")).to(torch.bfloat16)
    w = (torch.randn(rows, HEADS, generator=gen, device="cuda") * 0.02).to(torch.bfloat16)
    req = torch.arange(rows, device="cuda", dtype=torch.int64)
    n_vis = torch.full((rows,), context, device="cuda", dtype=torch.int32)
    scores = torch.empty(rows, context, device="cuda")
    return pool, table, iq, w, req, n_vis, scores


def bench_indexer(rows_list, contexts, floor, info, gen, progress) -> list[dict]:
    out = []
    for context in contexts:
        for rows in rows_list:
            if rows * context > (64 << 20):      # 64M entries (4.4 GB of keys) at most
                continue
            pool, table, iq, w, req, n_vis, scores = indexer_inputs(rows, context, gen)
            plan = TopKPlan.build(rows, 512, 1, "cuda")
            idx = torch.empty(rows, 512, device="cuda", dtype=torch.int32)

            gluon = is_sm90(iq.device)

            def logits_triton():     # the Triton FP8 path (the step's scorer off sm_90)
                index_scores_mxfp4_(iq, w, pool, table, PAGE, req, n_vis, scores, fp8_dot=True)

            def logits():            # the decode step's scorer
                if gluon:
                    gluon_index_scores_mxfp4_(iq, w, pool, table, PAGE, req, n_vis, scores)
                else:
                    logits_triton()

            def logits_bf16():
                index_scores_mxfp4_(iq, w, pool, table, PAGE, req, n_vis, scores)

            def topk():
                topk_ascending_(scores, n_vis, idx, plan)

            def both():              # the step's pair: on sm_90 the histogram built while scoring where
                # that pays (FUSED_HISTOGRAM_MAX), and then the step's top-k with it ready
                ready = index_scores_launch(iq, w, pool, table, PAGE, req, n_vis, scores, hist=plan.hist_hi[:rows])
                topk_launch(scores, n_vis, idx, plan, ready)

            t_logits, t_topk, t_both, t_bf16 = (graph_time_us(f, replays=30) for f in (logits, topk, both, logits_bf16))
            base = {"bf16_path": t_bf16}
            if gluon:
                base["triton_fp8"] = graph_time_us(logits_triton, replays=30)
            case = {"rows": rows, "context": context, "heads": HEADS, "ratio": 1}
            key_bytes = rows * context * 68
            score_bytes = rows * context * 4
            out.append(record("attn", {"op": "indexer_logits", **case}, t_logits, key_bytes + score_bytes, floor,
                              base, info))
            out.append(record("attn", {"op": "topk512", **case}, t_topk, score_bytes, floor, {}, info))
            out.append(record("attn", {"op": "indexer+topk", **case}, t_both, key_bytes + 2 * score_bytes, floor,
                              {}, info))
            tri = f", Triton FP8 path {base['triton_fp8']:.2f}" if gluon else ""
            progress(f"indexer rows={rows} ctx={context}: logits {t_logits:.2f} us (BF16 path {t_bf16:.2f}{tri}), "
                     f"top-k {t_topk:.2f} us, both {t_both:.2f} us")
            del pool, scores
    return out
