"""Timing on the GPU: CUDA-graph replay, CUDA events, median of many."""

from __future__ import annotations

import statistics
from typing import Callable

import torch


def graph_time_us(fn: Callable[[], None], calls_per_graph: int = 1, replays: int = 50, warmup: int = 3,
                  min_calls: int = 32) -> float:
    """Median time of one op call in microseconds, from replays of a CUDA graph of `fn`.

    `fn` makes `calls_per_graph` op calls (it may loop over rotated inputs). The graph holds `fn`
    repeated until it makes at least `min_calls` calls, so that the time between the events is the
    GPU's: with a graph of one short kernel, the GPU sits idle while the host submits the replay,
    and that latency (~10 us) would be counted as the kernel's. What remains per call is the
    launch gap between kernels inside a graph, as in a captured decode step. `fn` is run eagerly
    `warmup` times first, so compilation and allocation stay out of the capture.
    """
    repeat = max(1, -(-min_calls // calls_per_graph))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(repeat):
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
        times.append(start.elapsed_time(end) * 1e3 / (calls_per_graph * repeat))
    return statistics.median(times)


def l2_rotation(nbytes_per_copy: int, l2_bytes: int | None = None, min_copies: int = 2, max_copies: int = 64) -> int:
    """How many copies of an operand to rotate through so the set exceeds twice the L2 cache."""
    if l2_bytes is None:
        l2_bytes = torch.cuda.get_device_properties(0).L2_cache_size
    need = -(-2 * l2_bytes // max(1, nbytes_per_copy)) + 1
    return max(min_copies, min(max_copies, need))
