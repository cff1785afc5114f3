"""Prefill: fill one request's decode state from its prompt, chunk by chunk.

    streams, pre = stack.prefill(state, "a", x, chunk=64)          # x: [n, hc, dim] BF16 prompt streams

Two paths write the same cache records (window rings, compressed KV, index keys, the ratio-2
compressors' open groups) and advance the request by the prompt's length:

- "reference": `AttentionStack.forward` over each chunk (the readable reference of `layer.py`;
  exact and batch-invariant, serial per row: ~0.1 s per token at V4.1-Flash sizes on an H200);
- "kernels": the specialized step's kernels (`decode.DecodeStep`, CUDA graphs of up to `chunk` rows)
  over each chunk: a chunk is a step of `chunk` rows of one request at consecutive positions, the
  shape a speculative step already has. The step stages each row's window record past the rings and
  moves it into its ring slot only after the layer's sparse MLA has read the ring, so rows of a
  chunk longer than the ring still see the positions p-W+1..p they need; the compressor's open
  group, the published entries and index keys, the indexer's scores over every visible entry and
  the per-row top-k are the step's own. On the CPU the kernels run in Triton's interpreter (what
  the tests use at small configurations; far too slow at V4.1-Flash sizes).

"auto" (the default) takes "kernels" on CUDA and "reference" elsewhere.

What the kernel path's numbers are, relative to the reference (the step's contract, measured in
tests/decode and tests/test_prefill.py): given the same layer input, a layer writes the reference's
records (bitwise on the CPU; on the H200 the window records bit for bit with the step's default
exact linears, and with `exact_linears=False` >= 99.48 % of the window-record bytes, where the
fused wq_a|wkv GEMM's tensor-core block sums truncate and a BF16 value can round the other way),
the reference's top-k up to ties, and an output within the step's tolerance
(`tests/helpers.CPU_TOL`). Over the whole stack the layers' inputs then drift by the earlier
layers' output differences, so later layers' records are close but not bitwise the reference's. The kernel path is deterministic and
batch-invariant: its records and outputs do not depend on the chunk size (a chunk's rows give the
bits they give alone, spec decision 12), and a decode step after it continues it exactly.
"""

from __future__ import annotations

from typing import Hashable

import torch

from .ops import LOW_BATCH_MAX_ROWS
from .state import DecodeState

PATHS = ("auto", "kernels", "reference")
DEFAULT_CHUNK = 64


def prefill_path(path: str, device: torch.device) -> str:
    """The path `path` resolves to on `device` ("auto": "kernels" on CUDA, else "reference")."""
    if path not in PATHS:
        raise ValueError(f"prefill: path must be one of {PATHS}, got {path!r}")
    if path == "auto":
        return "kernels" if device.type == "cuda" else "reference"
    return path


def prefill_step(stack, state: DecodeState, chunk: int = DEFAULT_CHUNK, graphs: bool = True, **options):
    """The kernel path's `DecodeStep` for chunks of up to `chunk` rows (buckets 1, 2, 4, ... below
    `chunk`, and `chunk`: a shorter last chunk runs in the smallest that holds it, with padding rows
    that write nothing). Build it once and pass it to `prefill(..., step=)` to prefill several
    requests without rebuilding plans and graphs (graphs=False: eager, as on the CPU). options:
    DecodeStep's other keyword arguments (e.g. exact_linears=False: tensor-core linears, outside
    the contract)."""
    _check_chunk(chunk, "kernels")
    if chunk > state.stage_rows:
        raise ValueError(f"prefill: chunk={chunk} exceeds the state's stage_rows={state.stage_rows} (the "
                         f"kernel path stages a chunk's window records there); build the DecodeState "
                         f"with stage_rows >= {chunk} or pass a smaller chunk")
    return stack.decode_step(state, max_rows=chunk, graphs=graphs, **options)


def _check_chunk(chunk: int, path: str) -> None:
    if not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 1:
        raise ValueError(f"prefill: chunk must be a positive integer, got {chunk!r}")
    if path == "kernels" and chunk > LOW_BATCH_MAX_ROWS:
        raise ValueError(f"prefill: the kernel path runs chunks of 1..{LOW_BATCH_MAX_ROWS} rows "
                         f"(LOW_BATCH_MAX_ROWS), got chunk={chunk}")


def prefill(stack, state: DecodeState, request: Hashable, x: torch.Tensor, *, chunk: int = DEFAULT_CHUNK,
            path: str = "auto", pre: torch.Tensor | None = None, step=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the prompt rows `x` of an admitted `request` through every layer of `stack`, in chunks of
    `chunk` rows, writing their cache records into `state` and advancing the request by len(x).

    x: [n, hc, dim] BF16 streams entering the stack's first layer, at positions
        state.length(request) .. + n - 1 (a prefill may continue a request that holds tokens); on
        another device than the state's it is moved there once, whole.
    pre: [n, hc] FP32 carried pre (default one-hot on stream 0, as `AttentionStack.forward`; moved
        like x).
    path: "auto", "kernels" or "reference" (module docstring). chunk: rows per call (kernel path:
        1..LOW_BATCH_MAX_ROWS and at most the state's stage_rows).
    step: the kernel path's `prefill_step(stack, state, c)` with c >= chunk, reused across calls
        (default: built here for this call).
    Returns (streams [n, hc, dim] BF16, carried pre [n, hc] FP32) leaving the last layer.
    Errors (before any cache is written): ValueError for a bad path, chunk, step (or a step given
    on the reference path, which takes none), x or pre; TypeError for an x, pre or step of the wrong
    type; KeyError for a request the state does not hold; CapacityError when the whole prompt would
    pass the state's capacities (its context or its pages, as `DecodeState.plan` of all n rows
    says). An error while a chunk runs abandons that chunk's call (`DecodeState.abandon`); the
    chunks before it stay committed: the request then holds `state.length(request)` tokens. Where
    the failed chunk overwrote rows the request still reads (more than `max_drafts + 1` rows after a
    cached token: any chunk but a fresh request's first, as a rule), its next plan raises ValueError
    naming it: free it and prefill it again; else prefill the rest from there.
    """
    cfg = stack.cfg
    path = prefill_path(path, state.device)
    _check_chunk(chunk, path)
    for name, t in (("x", x), ("pre", pre)):
        if t is not None and not isinstance(t, torch.Tensor):
            raise TypeError(f"prefill: {name} must be a torch.Tensor, got a {type(t).__name__}")
    if x.dim() != 3 or x.shape[1:] != (cfg.hc_mult, cfg.dim) or x.dtype != torch.bfloat16 or x.shape[0] < 1:
        raise ValueError(f"prefill: x must be [n >= 1, {cfg.hc_mult}, {cfg.dim}] bfloat16, got "
                         f"{tuple(x.shape)} {x.dtype}")
    n = x.shape[0]
    if pre is not None and (pre.shape != (n, cfg.hc_mult) or pre.dtype != torch.float32):
        raise ValueError(f"prefill: pre must be [{n}, {cfg.hc_mult}] float32, got {tuple(pre.shape)} {pre.dtype}")
    state.slot(request)                                   # KeyError naming an unknown request
    if state.cfg is not cfg and state.cfg != cfg:
        raise ValueError("prefill: the DecodeState was built for another configuration than the stack")
    if path == "kernels":
        if step is None:
            step = prefill_step(stack, state, chunk)
        elif not hasattr(step, "state") or not hasattr(step, "max_rows"):
            raise TypeError(f"prefill: step must be a DecodeStep of prefill_step(), got a {type(step).__name__}")
        elif step.state is not state or step.stack is not stack:
            raise ValueError("prefill: the given step was built for another stack or state")
        elif step.max_rows < chunk:
            raise ValueError(f"prefill: the given step holds {step.max_rows} rows, fewer than chunk={chunk}")
    elif step is not None:
        raise ValueError("prefill: a step was given but the path is 'reference', which takes none "
                         "(path='kernels' runs the step)")
    # the whole prompt planned once, never advanced: a CapacityError before the first chunk (the
    # first chunk's plan replaces it, and the pages it allocated past that chunk go back)
    whole = state.plan([(request, n)])
    try:                                                  # one copy, not one a chunk (the step refuses another device)
        x = x.to(state.device)
        pre = None if pre is None else pre.to(state.device)
    except BaseException:
        state.abandon(whole, ran=False)                   # e.g. out of memory: the plan's pages go back
        raise
    outs, pres = [], []
    for a in range(0, n, chunk):
        b = min(n, a + chunk)
        p = None if pre is None else pre[a:b]
        if path == "kernels":
            o, q = step(x[a:b], [(request, b - a, state.length(request))], p)
        else:
            o, q = stack.forward(x[a:b], state.plan([(request, b - a)]), state, pre_in=p)
        outs.append(o)
        pres.append(q)
    return torch.cat(outs), torch.cat(pres)
