"""Probe the indexer logits kernel on a GPU: its launch knobs (block_e, num_warps, programs per SM)
and its two paths (`fp8_dot`: one E4M3 dot per scale block; else eight BF16 dots) timed side by
side at rows 1 / 4 / 16 and contexts 32K / 128K / 1M (ratio 1, 32 heads), graph replay with >= 32
calls per graph, GB/s of the key bytes; every variant's scores compared with the first's.
Prints; writes nothing."""

from __future__ import annotations

import itertools

import torch

from dsv41_decode.bench.attn_indexer import PAGE, indexer_inputs
from dsv41_decode.bench.timing import graph_time_us
from dsv41_decode.ops.indexer import index_scores_mxfp4_


def main() -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    for rows, context in ((1, 32768), (1, 131072), (1, 1 << 20), (4, 131072), (16, 32768)):
        pool, table, iq, w, req, n_vis, scores = indexer_inputs(rows, context, gen)
        ref = None
        for fp8, block_e, warps, per_sm in itertools.product((False, True), (64, 128, 256), (4, 8), (2, 4, 8)):
            def run(b=block_e, nw=warps, p=per_sm, f=fp8):
                index_scores_mxfp4_(iq, w, pool, table, PAGE, req, n_vis, scores, block_e=b, num_warps=nw,
                                    programs_per_sm=p, fp8_dot=f)
            try:
                us = graph_time_us(run, replays=20)
            except Exception as e:  # report, keep probing
                print(f"rows {rows} ctx {context} fp8 {fp8} block_e {block_e} warps {warps} per_sm {per_sm}: "
                      f"{type(e).__name__}: {str(e)[:120]}", flush=True)
                continue
            ref = scores.clone() if ref is None else ref
            fin = torch.isfinite(ref)
            same = torch.equal(scores, ref)
            near = same or float((scores[fin] == ref[fin]).float().mean()) >= 0.99
            gbps = rows * context * 68 / us / 1e3
            print(f"rows {rows:2d} ctx {context:8d} fp8 {fp8:d} block_e {block_e:3d} warps {warps} per_sm {per_sm}: "
                  f"{us:8.2f} us {gbps:7.0f} GB/s {'same' if same else '>=99% same' if near else 'DIFFERENT'}",
                  flush=True)
        del pool, scores


if __name__ == "__main__":
    main()
