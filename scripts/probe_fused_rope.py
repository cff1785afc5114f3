"""Probe the step's RoPE fusions on a GPU (sm_90) in under a minute: the query RoPE in the Gluon wq_b
GEMM's epilogue (`GluonMM(..., rope=(cos, sin))`), the window-KV insert in the q/kv norm pair's
launch (`rms_norm_pair_(window=...)`) and the index query (RoPE + MXFP4) in the indexer wq_b's
epilogue (`GluonMM(..., index_query=(cos, sin))`), against the launches they replace.

Per row count (`--rows=1,8,64`), CUDA-graph replay (median us per call, `bench.timing`):
- gemm: wq_b's plan (`--n=32768`, K 1280; `--n=16384,8192,4096`: the TP shards) plain, with the
  RoPE epilogue, and plain followed by `kv_write.query_rope_` (what the fused call replaces); the
  weight rotated over copies beyond L2, as `bench gemm`;
- norm: `rms_norm_pair_` (q_lora 1024 with its MXFP8, kv 512) plain, with the window insert, and
  plain followed by `qkv_rope_insert_` (the old chain's second launch: query RoPE + insert);
- chain: the old main-stream chain norm pair -> wq_b -> qkv_rope_insert_ against the new norm pair
  (insert) -> wq_b (RoPE epilogue), each as one graph;
- index: the indexer's wq_b (`--index=32,64` index heads: N 4096, 8192, K 1280) plain, with the
  index-query epilogue, and plain followed by `index_query_` (the launch the epilogue's iq half
  replaces; it also writes the head weights w, which move elsewhere), weights rotated beyond L2.
Each line also says whether the fused path's bits equal the unfused path's (queries, window
records, index queries; "bits =" or the count of differing bytes). Writes nothing. Options:
`--rows=`, `--n=`, `--index=` (empty: none), `--parts=query,index` (which of the two to run),
`--replays=50`.
"""

from __future__ import annotations

import torch

from dsv41_decode.bench.timing import graph_time_us, l2_rotation
from dsv41_decode.formats import fp8_block_quantize, mxfp8_quantize
from dsv41_decode.ops.gluon_mm import GluonMM
from dsv41_decode.ops.index_query import index_query_
from dsv41_decode.ops.kv_write import qkv_rope_insert_, query_rope_, rope_cos_sin
from dsv41_decode.ops.rms_norm import rms_norm_pair_
from dsv41_decode.records import WINDOW_KV_BYTES
from dsv41_decode.reference.rope import rope_cis

from _args import arg   # scripts/ is on sys.path when run as python scripts/<probe>.py

K, KV_DIM, POOL = 1280, 512, 4096    # wq_b's K = q_lora_rank (V4.1-Flash)
Q_LORA = K
DEV = "cuda"


def _differ(a: torch.Tensor, b: torch.Tensor) -> str:
    n = int((a.contiguous().view(torch.uint8) != b.contiguous().view(torch.uint8)).sum())
    return "bits =" if n == 0 else f"bits DIFFER ({n} bytes)"


def _rope(m: int, g: torch.Generator):
    pos = torch.randint(0, 1 << 20, (m,), generator=g)
    cos, sin = rope_cos_sin(rope_cis(1.0 / (160000 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64)), pos))
    return cos.to(DEV), sin.to(DEV)


def _norm_inputs(m: int, g: torch.Generator):
    qkv = (3 * torch.randn(m, Q_LORA + KV_DIM, generator=g)).to(torch.bfloat16).to(DEV)
    wq = (1 + 0.1 * torch.randn(Q_LORA, generator=g)).to(torch.bfloat16).to(DEV)
    wkv = (1 + 0.1 * torch.randn(KV_DIM, generator=g)).to(torch.bfloat16).to(DEV)
    out = dict(qr=torch.empty(m, Q_LORA, dtype=torch.bfloat16, device=DEV),
               codes=torch.empty(m, Q_LORA, dtype=torch.uint8, device=DEV),
               scales=torch.empty(m, Q_LORA // 32, dtype=torch.uint8, device=DEV),
               kv=torch.empty(m, KV_DIM, dtype=torch.bfloat16, device=DEV))
    slots = torch.randperm(POOL, generator=g)[:m].to(DEV)
    return qkv, wq, wkv, out, slots


def _index_query(rows: list[int], heads: int, replays: int, g: torch.Generator, gd: torch.Generator) -> None:
    """The indexer's wq_b at `heads` index heads: plain, with the index-query epilogue, plain then
    `index_query_`; per row count, graph replay over weight copies beyond L2."""
    n = heads * 128
    copies = l2_rotation(n * K + (n // 32) * (K // 32))
    weights = [fp8_block_quantize(torch.randn(n, K, generator=gd, device=DEV) * K ** -0.5) for _ in range(copies)]
    plans = [GluonMM(w, s, max_rows=max(rows)) for w, s in weights]
    print(f"indexer wq_b Hi={heads} N={n} K={K}: {plans[0].config}, split {plans[0].split}, {copies} weight copies")
    for m in rows:
        codes, sx = mxfp8_quantize(torch.randn(m, K, generator=gd, device=DEV).to(torch.bfloat16))
        cos, sin = _rope(m, g)
        ys = [torch.empty(m, n, dtype=torch.bfloat16, device=DEV) for _ in plans]
        iq = torch.empty(m, heads, 128, dtype=torch.bfloat16, device=DEV)
        wproj = torch.randn(m, heads, generator=gd, device=DEV)
        w_out = torch.empty(m, heads, dtype=torch.bfloat16, device=DEV)

        def plain():
            for p, y in zip(plans, ys):
                p(codes, sx, y)

        def fused():
            for p, y in zip(plans, ys):
                p(codes, sx, y, index_query=(cos, sin))

        def unfused():
            for p, y in zip(plans, ys):
                p(codes, sx, y)
                index_query_(y, wproj, cos, sin, 128 ** -0.5 * heads ** -0.5, iq, w_out)

        plans[0](codes, sx, ys[0])
        index_query_(ys[0], wproj, cos, sin, 1.0, iq, w_out)
        plans[0](codes, sx, ys[0], index_query=(cos, sin))
        bits = _differ(ys[0].view(m, heads, 128), iq)
        t = {name: graph_time_us(fn, calls_per_graph=copies, replays=replays)
             for name, fn in (("plain", plain), ("fused", fused), ("unfused", unfused))}
        print(f"  M={m:2d} plain {t['plain']:6.2f}  +index_query epilogue {t['fused']:6.2f}  "
              f"plain, index_query_ {t['unfused']:6.2f} us  ({t['unfused'] - t['fused']:+.2f} saved; iq {bits})")


def main() -> None:
    rows = [int(r) for r in arg("rows", "1,8,64").split(",")]
    ns = [int(n) for n in arg("n", "32768").split(",")]
    index_heads = [int(h) for h in arg("index", "32,64").split(",") if h]
    parts = arg("parts", "query,index").split(",")
    replays = int(arg("replays", "50"))
    g = torch.Generator().manual_seed(0)                    # host-made operands
    gd = torch.Generator(device=DEV).manual_seed(0)         # device-made ones (the weights)
    for heads in index_heads if "index" in parts else ():
        _index_query(rows, heads, replays, g, gd)
    for n in ns if "query" in parts else ():
        copies = l2_rotation(n * K + (n // 32) * (K // 32))
        weights = [fp8_block_quantize(torch.randn(n, K, generator=gd, device=DEV) * K ** -0.5) for _ in range(copies)]
        plans = [GluonMM(w, s, max_rows=max(rows)) for w, s in weights]
        print(f"wq_b N={n} K={K}: {plans[0].config}, split {plans[0].split}, {copies} weight copies")
        for m in rows:
            codes, sx = mxfp8_quantize(torch.randn(m, K, generator=gd, device=DEV).to(torch.bfloat16))
            cos, sin = _rope(m, g)
            ys = [torch.empty(m, n, dtype=torch.bfloat16, device=DEV) for _ in plans]
            qkv, wq, wkv, o, slots = _norm_inputs(m, g)
            pools = [torch.zeros(POOL, WINDOW_KV_BYTES, dtype=torch.uint8, device=DEV) for _ in range(2)]

            def norm(pool=None):
                extra = dict(window=pool, slots=slots, cos=cos, sin=sin) if pool is not None else {}
                rms_norm_pair_(qkv[:, :Q_LORA], wq, o["qr"], o["codes"], o["scales"], qkv[:, Q_LORA:], wkv, o["kv"],
                               1e-6, **extra)

            def gemm_plain():
                for p, y in zip(plans, ys):
                    p(codes, sx, y)

            def gemm_rope():
                for p, y in zip(plans, ys):
                    p(codes, sx, y, rope=(cos, sin))

            def gemm_then_rope():
                for p, y in zip(plans, ys):
                    p(codes, sx, y)
                    query_rope_(y.view(m, -1, 512), cos, sin)

            def chain_old():
                for p, y in zip(plans, ys):
                    norm()
                    p(codes, sx, y)
                    qkv_rope_insert_(y.view(m, -1, 512), o["kv"], cos, sin, slots, pools[0])

            def chain_new():
                for p, y in zip(plans, ys):
                    norm(pools[1])
                    p(codes, sx, y, rope=(cos, sin))

            # bits: the fused paths against the unfused ones
            gemm_then_rope()
            want = ys[0].clone()
            gemm_rope()
            q_bits = _differ(ys[0], want)
            chain_old()
            want_pool = pools[0].clone()
            chain_new()
            w_bits = _differ(pools[1], want_pool)
            t = {name: graph_time_us(fn, calls_per_graph=copies, replays=replays) for name, fn in (
                ("gemm", gemm_plain), ("gemm+rope epilogue", gemm_rope), ("gemm, query_rope_", gemm_then_rope),
                ("old chain", chain_old), ("new chain", chain_new))}
            t.update({name: graph_time_us(fn, replays=replays) for name, fn in (
                ("norm pair", norm), ("norm pair+insert", lambda: norm(pools[1])),
                ("norm pair, qkv_rope_insert_",
                 lambda: (norm(), qkv_rope_insert_(ys[0].view(m, -1, 512), o["kv"], cos, sin, slots, pools[0]))))})
            print(f"  M={m:2d} gemm: plain {t['gemm']:6.2f}  +rope epilogue {t['gemm+rope epilogue']:6.2f}  "
                  f"plain, query_rope_ {t['gemm, query_rope_']:6.2f} us  (query {q_bits})")
            print(f"       norm: pair {t['norm pair']:6.2f}  +insert {t['norm pair+insert']:6.2f}  "
                  f"pair, qkv_rope_insert_ {t['norm pair, qkv_rope_insert_']:6.2f} us  (window {w_bits})")
            print(f"       chain norm -> wq_b -> rope/insert: old {t['old chain']:6.2f}  new {t['new chain']:6.2f} us "
                  f"({t['old chain'] - t['new chain']:+.2f} saved)")


if __name__ == "__main__":
    main()
