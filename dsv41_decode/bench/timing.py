"""Timing on the GPU: CUDA-graph replay, CUDA events, median of many."""

from __future__ import annotations

import statistics
from typing import Callable

import torch


def graph_time_us(fn: Callable[[], None], calls_per_graph: int = 1, replays: int = 50, warmup: int = 3) -> float:
    """Median time of one `fn` call in microseconds, from replays of a CUDA graph of `fn`.

    `fn` is captured once (it may loop over rotated inputs: pass `calls_per_graph` = how many
    op calls one `fn` makes, and the per-call time is returned). It is run eagerly `warmup` times
    first, so compilation and allocation stay out of the capture.
    """
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(replays):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls_per_graph)
    return statistics.median(times)


def l2_rotation(nbytes_per_copy: int, l2_bytes: int | None = None, min_copies: int = 2, max_copies: int = 64) -> int:
    """How many copies of an operand to rotate through so the set exceeds twice the L2 cache."""
    if l2_bytes is None:
        l2_bytes = torch.cuda.get_device_properties(0).L2_cache_size
    need = -(-2 * l2_bytes // max(1, nbytes_per_copy)) + 1
    return max(min_copies, min(max_copies, need))
