"""`dsv41-decode bench prefill`: one request's prompt through the 40-layer V4.1-Flash stack on one GPU.

Random weights (`testing.synthetic.random_checkpoint`), random prompt streams, one request per
prompt length (4K, 32K, 128K by default), prefilled through the kernel path (`AttentionStack.prefill`,
`path="kernels"`: CUDA graphs of the step's kernels over chunks of `chunk` rows). Rows written:

- `prefill` (one per prompt length): wall time of the whole prefill (host planning per chunk
  included, synchronized before and after; the step's plans and graphs are built beforehand, as a
  server builds them once), tokens per second, and two floors: the bytes floor (every chunk reads
  every layer's weights once, plus the caches its last row reads - window records, selected
  compressed entries, the index keys over the visible entries - which hold what its other rows
  read) over the streaming-read bandwidth measured in the same run, and the compute floor (the
  GEMM FLOPs at the H200's dense FP8 rate plus the attention and indexer FLOPs at its dense BF16
  rate, both from the data sheet: `PEAK_TFLOPS`).
  `pct_floor` is against the larger of the two. Baseline `reference_est`: the reference path's
  measured time per token on a short prompt (`--reference-tokens`) times the prompt length (an
  estimate: the reference's per-row work grows with the context, so it is a lower bound).
- `prefill_layer` (per layer kind, per prompt length): one layer's schedule alone for one chunk of
  `chunk` rows at the end of the prompt (the chunk with the most visible entries), by CUDA-graph
  replay, and that time times the number of chunks and layers of the kind as the kind's share.
"""

from __future__ import annotations

import time

import torch

from ..config import SWA, ModelConfig
from ..prefill import prefill_step
from ..stack import AttentionStack
from ..state import DecodeState
from ..testing.synthetic import random_checkpoint
from .floor import read_bandwidth_gbps
from .results import format_table, record, run_info, write_jsonl
from .step import _layer_kinds, layer_weight_bytes, weight_bytes
from .timing import graph_time_us

PROMPTS = (4096, 32768, 131072)
# H200 SXM dense peaks (data sheet): FP8 tensor cores for the MXFP8 GEMMs, BF16 for the rest.
PEAK_TFLOPS = {"fp8": 1979.0, "bf16": 989.0}


def _visible(cfg: ModelConfig, layer: int, positions) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row at `positions` (a range or a tensor; float64): the window keys and the visible
    compressed entries."""
    if isinstance(positions, range):
        p = torch.arange(positions.start, positions.stop, positions.step, dtype=torch.float64)
    else:
        p = positions.to(torch.float64)
    window = torch.clamp(p + 1, max=cfg.window_size)
    ratio = cfg.plan[layer].ratio
    n_vis = torch.div(p + 1, ratio, rounding_mode="floor") if cfg.plan[layer].kind != SWA else torch.zeros_like(p)
    return window, n_vis


def layer_flops(cfg: ModelConfig, layer: int, positions: range) -> tuple[float, float]:
    """(GEMM FLOPs, attention + indexer FLOPs) of one layer over the rows at `positions`."""
    spec, n = cfg.plan[layer], len(positions)
    H, D = cfg.n_heads, cfg.head_dim
    gemm = 2 * n * (cfg.dim * (cfg.q_lora_rank + D) + cfg.q_lora_rank * H * D   # wq_a|wkv, wq_b
                    + H * D * cfg.o_lora_rank                                    # wo_a (grouped)
                    + cfg.o_groups * cfg.o_lora_rank * cfg.dim)                  # wo_b
    if spec.runs_indexer:
        gemm += 2 * n * cfg.q_lora_rank * cfg.index_n_heads * cfg.index_head_dim
    if spec.owns_compressor:
        gemm += 2 * n * cfg.dim * D * (2 if spec.ratio == 2 else 1)
    window, n_vis = _visible(cfg, layer, positions)
    keys = window + torch.clamp(n_vis, max=cfg.index_topk)
    attn = 2 * 2 * H * D * keys.sum().item()                                     # q.K and P.V
    if spec.runs_indexer:
        attn += 2 * cfg.index_n_heads * cfg.index_head_dim * n_vis.sum().item()
    return float(gemm), attn


def layer_cache_bytes(cfg: ModelConfig, layer: int, positions) -> float:
    """Cache bytes the rows at `positions` read in one layer: window records, selected compressed
    entries, and the index keys over the visible entries of a Full layer (a Reindex layer's
    candidate pool counted whole, an upper bound)."""
    window, n_vis = _visible(cfg, layer, positions)
    total = 528 * window + 288 * torch.clamp(n_vis, max=cfg.index_topk)
    if cfg.plan[layer].runs_indexer:
        total = total + 68 * n_vis
    return total.sum().item()


def floors_us(stack: AttentionStack, n: int, chunk: int, read_gbps: float) -> tuple[float, float, float]:
    """(bytes, bytes floor us, compute floor us) of a prefill of n tokens in chunks of `chunk`: every
    chunk reads every layer's weights once, and the caches its last row reads once (what its other
    rows read is a part of that); the FLOPs are every row's."""
    cfg = stack.cfg
    nbytes = -(-n // chunk) * weight_bytes(stack)
    last = torch.tensor([min(n, a + chunk) - 1 for a in range(0, n, chunk)])
    gemm = attn = 0.0
    for L in stack.ids:
        nbytes += layer_cache_bytes(cfg, L, last)
        g, t = layer_flops(cfg, L, range(n))
        gemm, attn = gemm + g, attn + t
    compute_us = (gemm / (PEAK_TFLOPS["fp8"] * 1e12) + attn / (PEAK_TFLOPS["bf16"] * 1e12)) * 1e6
    return nbytes, nbytes / (read_gbps * 1e9) * 1e6, compute_us


def _reference_us_per_token(stack: AttentionStack, tokens: int, gen: torch.Generator) -> float:
    """The reference path's time per token on a `tokens`-row prompt (one call)."""
    cfg = stack.cfg
    st = DecodeState(cfg, max_requests=1, max_context=tokens, page_size=64, device="cuda")
    st.admit(0)
    x = torch.randn(tokens, cfg.hc_mult, cfg.dim, generator=gen, device="cuda").to(torch.bfloat16)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    stack.prefill(st, 0, x, chunk=tokens, path="reference")
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e6 / tokens


def run_prefill_bench(prompts=PROMPTS, chunk: int = 64, out_dir="docs/results", progress=print,
                      reference_tokens: int = 32, bench_name: str = "prefill", kinds: bool = True,
                      exact_linears: bool = True, fp32_dots: bool = False) -> list[dict]:
    """Every prompt length through the kernel prefill (exact_linears, fp32_dots: its step built with
    those options; the rows' key says `linears: "tensor_cores"` without exact linears, `dots:
    "fp32"` with FP32 dots); returns and writes the result rows."""
    info = run_info()
    floor = read_bandwidth_gbps()
    progress(f"streaming read: {floor:.0f} GB/s on {info['gpu']}")
    cfg = ModelConfig.preset("v41-flash")
    stack = AttentionStack(random_checkpoint(cfg, "cuda"))
    gen = torch.Generator(device="cuda").manual_seed(1)
    ref_us = _reference_us_per_token(stack, reference_tokens, gen) if reference_tokens else None
    if ref_us is not None:
        progress(f"reference path: {ref_us / 1e3:.1f} ms per token ({reference_tokens}-token prompt)")
    results: list[dict] = []
    for n in prompts:
        state = DecodeState(cfg, max_requests=1, max_context=n + chunk, page_size=64, device="cuda",
                            stage_rows=chunk)
        state.admit(0)
        progress(f"prompt {n}: building + capturing the step ({chunk}-row chunks)")
        step = prefill_step(stack, state, chunk, exact_linears=exact_linears, fp32_dots=fp32_dots)
        x = torch.randn(n, cfg.hc_mult, cfg.dim, generator=gen, device="cuda").to(torch.bfloat16)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        stack.prefill(state, 0, x, chunk=chunk, path="kernels", step=step)
        torch.cuda.synchronize()
        us = (time.perf_counter() - t0) * 1e6
        del x
        nbytes, bytes_us, compute_us = floors_us(stack, n, chunk, floor)
        base = {"reference_est": ref_us * n} if ref_us is not None else {}
        key = {"op": "prefill", "tokens": n, "chunk": chunk, "layers": len(stack.ids), **_options(exact_linears, fp32_dots)}
        rec = record(bench_name, key, us, nbytes, floor, base, info)
        # the floor is the larger of the bytes' and the compute's, and pct_floor = 100 floor_us / us
        floor_us = max(bytes_us, compute_us)
        rec.update(tokens_per_s=round(n / (us * 1e-6), 1), s=round(us * 1e-6, 3),
                   bytes_floor_us=round(bytes_us, 1), compute_floor_us=round(compute_us, 1),
                   floor_us=round(floor_us, 3), pct_floor=round(100 * floor_us / us, 1), peak_tflops=PEAK_TFLOPS)
        results.append(rec)
        progress(f"prompt {n}: {us * 1e-6:.2f} s, {n / (us * 1e-6):.0f} tokens/s (floors: bytes "
                 f"{bytes_us * 1e-6:.2f} s, compute {compute_us * 1e-6:.2f} s)")
        if kinds:
            results += _kind_rows(stack, step, state, n, chunk, floor, info, gen, bench_name, progress,
                                  _options(exact_linears, fp32_dots))
        del step, state
        torch.cuda.empty_cache()
    for r in results:
        r["read_gbps"] = round(floor, 1)
    path = write_jsonl(results, out_dir, bench_name)
    progress(f"wrote {path}")
    print(format_table(results, ["op", "tokens", "chunk", "kind", "linears", "dots"]))
    return results


def _options(exact_linears: bool, fp32_dots: bool) -> dict:
    """The step options' part of a row's key (none for the default step)."""
    return {**({} if exact_linears else {"linears": "tensor_cores"}), **({"dots": "fp32"} if fp32_dots else {})}


def _kind_rows(stack, step, state, n, chunk, floor, info, gen, bench_name, progress,
               options: dict | None = None) -> list[dict]:
    """One layer of each kind alone for one chunk at the end of the prompt (graph of repeated calls)."""
    cfg, out = stack.cfg, []
    x = torch.randn(chunk, cfg.hc_mult, cfg.dim, generator=gen, device="cuda").to(torch.bfloat16)
    bucket = step.prepare([(0, chunk)], x)             # rows n..n+chunk-1; the state is not advanced
    chunks = -(-n // chunk)
    count = {label: sum(1 for L in stack.ids if f"{cfg.plan[L].label}/r{cfg.plan[L].ratio}" == label)
             for label in _layer_kinds(cfg)}
    for label, L in _layer_kinds(cfg).items():
        us = graph_time_us(step.layer_call(L, bucket), replays=20, min_calls=4)
        nbytes = layer_weight_bytes(stack.layers[L]) + layer_cache_bytes(cfg, L, torch.tensor([n + chunk - 1]))
        key = {"op": "prefill_layer", "kind": label, "layer": L, "tokens": n, "chunk": chunk, **(options or {})}
        rec = record(bench_name, key, us, nbytes, floor, {}, info)
        rec["share_s"] = round(us * 1e-6 * chunks * count[label], 3)   # an upper estimate: the last chunk's cost
        out.append(rec)
        progress(f"  prompt {n} layer {L} {label}: {us:.1f} us per {chunk}-row chunk "
                 f"(x {chunks} chunks x {count[label]} layers <= {rec['share_s']:.2f} s)")
    return out
