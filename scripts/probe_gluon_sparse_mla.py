"""Probe the Gluon sparse MLA (`ops.gluon_sparse_mla`) on an H200 against the Triton kernel's step
tiling (`SparseMlaPlan.for_step`) and FlashMLA's Hopper sparse decode on the V4 record (when
`flash_mla` imports; `bench.attn`'s baseline): 128 window + 512 compressed keys, CUDA-graph replay.
Per (heads, rows) cell: the time of the Gluon kernel in each configuration of `--configs` (names
in CONFIGS; default: default), of the Triton step tiling and of FlashMLA; the max BF16 ulp distance
of each Gluon configuration's and of the Triton kernel's outputs from the reference on the GPU (on
the first, middle and last rows: rows are independent, and the reference runs row by row); whether
the Gluon configurations give the same bits as each other (`cfg==`; seq2, seq5 and their
publish-first forms seq2p, seq5p, several blocks a program, sum in another order than default) and the first one the Triton
kernel's (`==triton`). `--heads=64,16`, `--rows=1,2,4,8,16,32,64`. Prints; writes nothing."""

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

CONFIGS = {
    "default": G.GluonSparseMlaConfig(),
    "plain": G.GluonSparseMlaConfig(q_buffers=4, fp4_packed=False, prefetch=False),
    "q4": G.GluonSparseMlaConfig(q_buffers=4),
    "noprefetch": G.GluonSparseMlaConfig(prefetch=False),
    "bytes": G.GluonSparseMlaConfig(fp4_packed=False),
    "seq2": G.GluonSparseMlaConfig(q_buffers=4, blocks_per_program=2),     # other bits than G = 1
    "seq5": G.GluonSparseMlaConfig(q_buffers=4, blocks_per_program=5),
    "seq2p": G.GluonSparseMlaConfig(q_buffers=4, blocks_per_program=2, publish_first=True),
    "seq5p": G.GluonSparseMlaConfig(q_buffers=4, blocks_per_program=5, publish_first=True),
}


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
    names = arg("configs", "default").split(",")
    configs = [CONFIGS[n] for n in names]
    gen = torch.Generator(device="cuda").manual_seed(0)
    scale = HEAD_DIM ** -0.5
    print("us per call (graph replay), then max ulp from the reference")
    print("heads rows | " + " ".join(f"{n:>10s}" for n in names) + "     triton  flash_mla | best/triton best/flash | "
          + " ".join(f"{'ulp ' + n:>14s}" for n in names) + "  ulp triton | cfg== ==triton")
    for heads in heads_list:
        gplans = [G.GluonSparseMlaPlan.build(max(rows_list), heads, W, K, "cuda", config=c) for c in configs]
        tplans = SparseMlaPlan.for_step(max(rows_list), heads, W, K, "cuda")
        for rows in rows_list:
            q, win, comp, wtab, ctab, sink = sparse_mla_inputs(rows, heads, gen)
            tplan = next(p for p in tplans if rows <= p.max_rows)
            outs, times = [], []
            for gplan in gplans:
                o = torch.empty_like(q)
                fn = lambda o=o, p=gplan: G.gluon_sparse_mla_(p, q, win, comp, wtab, ctab, sink, scale, o)  # noqa: E731
                times.append(graph_time_us(fn, replays=20))
                fn()
                outs.append(o)
            ot = torch.empty_like(q)
            ft = lambda: sparse_mla_(tplan, q, win, comp, wtab, ctab, sink, scale, ot)  # noqa: E731
            us_t = graph_time_us(ft, replays=20)
            ft()
            fm = _flash_mla_v4(rows, heads, gen)
            us_f = graph_time_us(fm, replays=20) if fm is not None else float("nan")
            picked = sorted({0, rows // 2, rows - 1})
            ref = sparse_attention_records(q[picked], win, comp, wtab[picked], ctab[picked], sink, scale)
            outs, ot = [o[picked] for o in outs], ot[picked]
            best = min(times)
            same = all(torch.equal(o, outs[0]) for o in outs)     # on the picked rows
            print(f"{heads:5d} {rows:4d} | " + " ".join(f"{t:10.2f}" for t in times) + f" {us_t:10.2f} {us_f:10.2f} | "
                  f"{best / us_t:11.2f} {best / us_f:10.2f} | " + " ".join(f"{ulp_max(o, ref):14d}" for o in outs)
                  + f" {ulp_max(ot, ref):11d} | {same!s:5s} {bool(torch.equal(outs[0], ot))}", flush=True)
    print(f"done in {time.time() - t0:.1f} s")


if __name__ == "__main__":
    main()
