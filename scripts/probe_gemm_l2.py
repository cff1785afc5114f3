"""A Reuse layer's linears in the 40-layer V4.1-Flash step with their weights L2-cold and L2-hot:
the fused `wq_a|wkv` GEMM, `wq_b`, and `wo_a` + `wo_b` (the layer's `_output`), each captured in a
CUDA graph and timed by replay (median of 30) at 1 / 8 / 16 / 64 rows:

    cold  the op after a 512 MB read (which evicts the L2), minus that read alone
    hot   ten calls of the op in a row, per call (the weight stays in the 60 MB L2 where it fits;
          `wq_b`'s 42 MB does, `wo_a`'s 67 MB does not)

cold / hot says how much of the op's time the DRAM read is: near 1, its time is spent inside the SMs
and an L2 prefetch ahead of it cannot pay (docs/spec-decisions.md decision 30, measured on the
Triton tier); well above 1, it can.

    PYTHONPATH=. python scripts/probe_gemm_l2.py

(GPU, ~60 s on an H200.)
"""
from __future__ import annotations

import statistics

import torch

from dsv41_decode.config import ModelConfig
from dsv41_decode.stack import AttentionStack
from dsv41_decode.state import DecodeState
from dsv41_decode.testing.synthetic import fill_state, random_checkpoint

ROWS = (1, 8, 16, 64)


def graph_us(fn, reps: int = 30) -> float:
    """Median replay time (us) of a CUDA graph holding fn's launches (one warm-up call first)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return statistics.median(times)


def main() -> None:
    cfg = ModelConfig.preset("v41-flash")
    stack = AttentionStack(random_checkpoint(cfg, "cuda"))
    state = DecodeState(cfg, max_requests=max(ROWS), max_context=32768 + 1024, page_size=64, device="cuda")
    fill_state(state, {i: 32768 for i in range(max(ROWS))})
    step = stack.decode_step(state, max_rows=max(ROWS), buckets=ROWS)
    L = next(i for i, layer in step.layers.items() if layer.spec.kind == "reuse")
    layer, s = step.layers[L], step.layers[L].s
    flush = torch.randn(512 * 2**20 // 4, device="cuda")
    total = torch.empty(1, device="cuda")

    def read():
        torch.sum(flush, dim=0, keepdim=True, out=total)

    print(f"layer {L} ({layer.spec.kind}): us cold / hot (cold over hot)", flush=True)
    for rows in ROWS:
        ops = {"fused_wqa_wkv": lambda: layer.mm_qkv(step.boundary.codes[:rows], step.boundary.scales[:rows],
                                                      s.qkv_a[:rows]),
               "wq_b": lambda: layer.mm_wq_b(s.qr_codes[:rows], s.qr_scales[:rows], s.q[:rows].view(rows, -1)),
               "wo_a+wo_b": lambda: layer._output(rows, s.o[:rows], step.io.y[:rows])}
        t_read = graph_us(read)
        cells = []
        for name, fn in ops.items():
            cold = graph_us(lambda: (read(), fn())) - t_read
            hot = graph_us(lambda: [fn() for _ in range(10)]) / 10
            cells.append(f"{name} {cold:6.2f} / {hot:6.2f} ({cold / hot:4.2f}x)")
        print(f"  rows {rows:2d}: " + " | ".join(cells), flush=True)


if __name__ == "__main__":
    main()
