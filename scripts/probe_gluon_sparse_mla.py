"""Probe the Gluon sparse MLA (`ops.gluon_sparse_mla`) on an H200 against the Triton kernel's step
tiling (`SparseMlaPlan.for_step`) and FlashMLA's Hopper sparse decode on the V4 record (when
`flash_mla` imports; `bench.attn`'s baseline): 128 window + 512 compressed keys, CUDA-graph replay,
per (heads, rows) cell the time of each (the Gluon kernel in its default configuration and in the plainest,
`plain`: q in four buffers, the compressed codes loaded per byte, no prefetch), the max BF16 ulp distance of each
from the reference on the GPU, and whether the Gluon and Triton kernels give the same bits.
`--heads=64,16`, `--rows=1,2,4,8,16,32,64`. Prints; writes nothing."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _args import arg  # noqa: E402

from dsv41_decode.bench.attn import TOPK as K, WINDOW as W, _flash_mla_v4, sparse_mla_inputs  # noqa: E402
from dsv41_decode.bench.timing import graph_time_us  # noqa: E402
from dsv41_decode.ops import gluon_sparse_mla as G  # noqa: E402
from dsv41_decode.ops.sparse_mla import HEAD_DIM, SparseMlaPlan, sparse_mla_  # noqa: E402
from dsv41_decode.reference.attention import sparse_attention_records  # noqa: E402


def ulp_max(a: torch.Tensor, b: torch.Tensor) -> int:
    """The largest distance in BF16 ulps (the order-preserving integer mapping of the bits)."""
    def key(x):
        x16 = x.contiguous().view(torch.int16).long()
        return torch.where(x16 < 0, -(x16 & 0x7FFF), x16)
    return int((key(a) - key(b)).abs().max())


def main() -> None:
    t0 = time.time()
    heads_list = [int(v) for v in arg("heads", "64,16").split(",")]
    rows_list = [int(v) for v in arg("rows", "1,2,4,8,16,32,64").split(",")]
    gen = torch.Generator(device="cuda").manual_seed(0)
    scale = HEAD_DIM ** -0.5
    alt = G.GluonSparseMlaConfig(q_buffers=4, fp4_packed=False, prefetch=False)
    print("heads rows | gluon us  plain us  triton us  flash_mla_v4 us | gluon/triton gluon/flash | ulp gluon  ulp plain  "
          "ulp triton | gluon == triton")
    for heads in heads_list:
        gplan = G.build_plan(max(rows_list), heads, W, K, "cuda")
        tplans = SparseMlaPlan.for_step(max(rows_list), heads, W, K, "cuda")
        for rows in rows_list:
            q, win, comp, wtab, ctab, sink = sparse_mla_inputs(rows, heads, gen)
            og, oa, ot = torch.empty_like(q), torch.empty_like(q), torch.empty_like(q)
            tplan = next(p for p in tplans if rows <= p.max_rows)
            fg = lambda: G.gluon_sparse_mla_(gplan, q, win, comp, wtab, ctab, sink, scale, og)  # noqa: E731
            fa = lambda: G.gluon_sparse_mla_(gplan, q, win, comp, wtab, ctab, sink, scale, oa, alt)  # noqa: E731
            ft = lambda: sparse_mla_(tplan, q, win, comp, wtab, ctab, sink, scale, ot)  # noqa: E731
            us_g = graph_time_us(fg, replays=30)
            us_a = graph_time_us(fa, replays=30)
            us_t = graph_time_us(ft, replays=30)
            fm = _flash_mla_v4(rows, heads, gen)
            us_f = graph_time_us(fm, replays=30) if fm is not None else float("nan")
            fg()
            fa()
            ft()
            ref = sparse_attention_records(q, win, comp, wtab, ctab, sink, scale)
            print(f"{heads:5d} {rows:4d} | {us_g:8.2f} {us_a:8.2f} {us_t:10.2f} {us_f:15.2f} | {us_g / us_t:12.2f} "
                  f"{us_g / us_f:11.2f} | {ulp_max(og, ref):9d} {ulp_max(oa, ref):9d} {ulp_max(ot, ref):10d} | "
                  f"{bool(torch.equal(og, ot))}", flush=True)
    print(f"done in {time.time() - t0:.1f} s")


if __name__ == "__main__":
    main()
