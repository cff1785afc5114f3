"""`dsv41-decode bench attn`: the sparse-attention kernels on synthetic state (random valid records
and top-k, no prefill), timed by CUDA-graph replay, against the reference path on the GPU and
FlashMLA's Hopper sparse decode (when the `flash_mla` package of the sgl-flash-mla wheel imports)."""

from __future__ import annotations

import statistics
import traceback
from typing import Callable

import torch

from ..records import pack_compressed_kv, pack_window_kv
from ..reference.attention import sparse_attention_records
from .floor import read_bandwidth_gbps
from .attn_plot import plot_attn
from .results import format_table, record, run_info, write_jsonl
from .timing import graph_time_us

WINDOW, TOPK, HEAD_DIM = 128, 512, 512


def _records(n: int, gen: torch.Generator, pack) -> torch.Tensor:
    x = (torch.randn(n, HEAD_DIM, generator=gen, device="cuda") * 0.5).to(torch.bfloat16)
    return pack(x)


def eager_time_us(fn: Callable[[], None], reps: int = 5) -> float:
    """Median of CUDA-event timings of eager calls (for baselines that sync with the host)."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return statistics.median(times)


def _flash_mla_v4(rows: int, heads: int, gen: torch.Generator) -> Callable[[], None] | None:
    """FlashMLA's legacy SM90 sparse decode on the older V4 584-byte record, 128 + 512 keys per row
    (its V4.1 formats are rejected on SM90). None when the package is missing."""
    try:
        import flash_mla
    except ImportError:
        return None
    n_tok = 64 * 1024
    cache = torch.randint(0, 0x40, (n_tok // 64, 64, 1, 584), generator=gen, device="cuda", dtype=torch.uint8)
    q = (torch.randn(rows, 1, max(64, heads), 512, generator=gen, device="cuda") * 0.5).to(torch.bfloat16)
    idx = torch.randint(0, n_tok, (rows, 1, WINDOW + TOPK), generator=gen, device="cuda", dtype=torch.int32)
    sink = torch.randn(max(64, heads), device="cuda")
    meta, _ = flash_mla.get_mla_metadata()

    def run():
        flash_mla.flash_mla_with_kvcache(q, cache.view(torch.float8_e4m3fn), None, None, 512, meta,
                                         indices=idx, attn_sink=sink, is_fp8_kvcache=True,
                                         use_legacy=True, kv_format="V4")
    return run


def sparse_mla_inputs(rows: int, heads: int, gen: torch.Generator):
    """Synthetic sparse-MLA operands on the GPU: q [rows, heads, 512], a window pool of 2 x WINDOW
    records per row, a 64K-record compressed pool, random tables of WINDOW + TOPK valid slots per
    row, a sink. Returns (q, win, comp, wtab, ctab, sink)."""
    n_w, n_c = rows * WINDOW * 2, 64 * 1024
    win, comp = _records(n_w, gen, pack_window_kv), _records(n_c, gen, pack_compressed_kv)
    wtab = torch.randint(0, n_w, (rows, WINDOW), generator=gen, device="cuda", dtype=torch.int32)
    ctab = torch.randint(0, n_c, (rows, TOPK), generator=gen, device="cuda", dtype=torch.int32)
    q = (torch.randn(rows, heads, HEAD_DIM, generator=gen, device="cuda") * 0.5).to(torch.bfloat16)
    sink = torch.randn(heads, generator=gen, device="cuda")
    return q, win, comp, wtab, ctab, sink


def bench_sparse_mla(ops, rows_list, heads_list, floor, info, gen, progress) -> list[dict]:
    out = []
    for heads in heads_list:
        for rows in rows_list:
            q, win, comp, wtab, ctab, sink = sparse_mla_inputs(rows, heads, gen)
            ours = ops.sparse_mla(q, win, wtab, comp, ctab, sink, HEAD_DIM ** -0.5)
            us = graph_time_us(ours, replays=50)
            base = {}
            fm = _flash_mla_v4(rows, heads, gen)
            if fm is not None:
                base["flash_mla_v4_64h"] = graph_time_us(fm, replays=50)
            if hasattr(ops, "sparse_mla_triton"):
                base["triton_step"] = graph_time_us(ops.sparse_mla_triton(q, win, wtab, comp, ctab, sink,
                                                                          HEAD_DIM ** -0.5), replays=50)
            if rows <= 4:
                base["reference_gpu"] = eager_time_us(lambda: _reference_rows(q, win, wtab, comp, ctab, sink))
            nbytes = rows * (WINDOW * 528 + TOPK * 288 + heads * HEAD_DIM * 4)
            out.append(record("attn", {"op": "sparse_mla", "rows": rows, "heads": heads, "keys": WINDOW + TOPK},
                              us, nbytes, floor, base, info))
            progress(f"sparse_mla heads={heads} rows={rows}: {us:.2f} us {base}")
    return out


def _reference_rows(q, win, wtab, comp, ctab, sink):
    sparse_attention_records(q, win, comp, wtab, ctab, sink, HEAD_DIM ** -0.5)


def run_attn_bench(ops, rows=(1, 4, 16, 64), heads=(8, 16, 32, 64), contexts=(4096, 32768, 131072, 1 << 20),
                   out_dir="out", progress=print, families=("sparse_mla", "indexer", "kv_write"),
                   bench_name="attn") -> list[dict]:
    """Each kernel family at each size; families whose op is missing or fails are reported and skipped."""
    info = run_info()
    floor = read_bandwidth_gbps()
    progress(f"streaming read: {floor:.0f} GB/s on {info['gpu']}")
    gen = torch.Generator(device="cuda").manual_seed(0)
    results = []
    for name, fn in (("sparse_mla", lambda: bench_sparse_mla(ops, rows, heads, floor, info, gen, progress)),
                     ("indexer", lambda: ops.bench_indexer(rows, contexts, floor, info, gen, progress)),
                     ("kv_write", lambda: ops.bench_kv_write(rows, floor, info, gen, progress))):
        if name not in families:
            continue
        try:
            results += fn()
        except Exception:  # report and go on: one family's failure must not hide the others' numbers
            progress(f"{name}: FAILED\n{traceback.format_exc()}")
    for r in results:
        r["read_gbps"] = round(floor, 1)
    if results:
        path = write_jsonl(results, out_dir, bench_name)
        plot_attn(results, path.with_suffix(".png"))
        print(format_table(results, ["op", "rows", "heads", "context"]))
    return results
