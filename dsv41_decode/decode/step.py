"""DecodeStep: one decode step over every attention layer of a stack, captured per row bucket.

    step = stack.decode_step(state, max_rows=16)        # plans, buffers, graphs: once
    x, pre = step(x, [("a", 1), ("b", 4)])               # one step: 1 row of "a", 1 + 3 draft rows of "b"
    step.accept({"b": 2})                                # speculative decoding: keep "b"'s first 2 rows

A call plans the step's rows in the `DecodeState` (page allocation, capacity checks), loads one
small record per row to the device, replays the CUDA graph of the smallest bucket that holds the
rows (rows past the step's are padding that writes nothing), and advances the state by every row;
`accept` then keeps a prefix of each request's rows (speculative decoding: `DecodeState.accept`,
on a state built with `max_drafts`). Requests are admitted and freed on the state between steps;
nothing is recaptured. Eager mode (`graphs=False`,
and always on the CPU) runs the same schedule without a graph.

The step leaves the tensors of the generic path (`AttentionStack.forward`) at every boundary, up to
the kernels' rounding (see tests/decode); it does not run an FFN between the attention sublayers.
Under tensor parallelism (a stack built with `tp`) each rank runs its heads and groups and reduces
`wo_b`'s FP32 partials with `TensorParallel.reduce_partials` (gather + rank-ordered sum, NCCL or
gloo) before the single-GPU boundary: the collective fallback of design section 3; with `tp_boundary="fused"` (or "auto" and peer access
between the ranks' GPUs) `wo_b` publishes its partial into a symmetric-memory mailbox instead and one
kernel does the one-shot all-reduce with the boundary (`ops.allreduce_boundary`).
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..ops import LOW_BATCH_MAX_ROWS
from ..ops import pdl as pdl_launch
from ..ops.allreduce_boundary import Mailbox
from ..state import DecodeState
from .attention import AttentionStep, IndexSelection, Scratch, storage_bytes
from .boundary import Boundary
from .lanes import Lanes
from .tables import StepMeta

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64)


class StepError(ValueError):
    """A step the captured DecodeStep cannot run (the message names the rows, request or bucket)."""


_FALLBACK_REPORTED: set[str] = set()


def _fused_mailbox(tp, rows: int, dim: int, layers: int, dev: torch.device) -> Mailbox | None:
    """The fused boundary's mailbox, or None (after one warning per reason) when the ranks' GPUs
    cannot reach each other peer-to-peer or symmetric memory cannot be set up. Collective."""
    import warnings
    why = tp.peer_access(dev)
    if why is None:
        try:
            return Mailbox.symmetric(tp, rows, dim, layers, dev)
        except (RuntimeError, NotImplementedError) as err:   # every rank fails alike (rendezvous)
            why = f"symmetric memory is not available ({err})"
    if why not in _FALLBACK_REPORTED:
        _FALLBACK_REPORTED.add(why)
        warnings.warn(f"fused TP boundary unavailable: {why}; using NCCL gather + the single-GPU boundary",
                      RuntimeWarning, stacklevel=3)
    return None


class DecodeStep:
    """The specialized decode step of `stack` over `state` (design section 1).

    buckets: row counts captured as CUDA graphs (ascending, each 1..LOW_BATCH_MAX_ROWS); default
        1, 2, 4, ... up to max_rows.
    overlap_inputs / overlap_candidates: side work on auxiliary streams (design section 1, plan).
    graphs: capture and replay CUDA graphs (CUDA only); False runs eagerly (debugging).
    wo_a_fp8: quantize a BF16 `wo_a` to FP8 once at build (changes the numbers; see ops.wo_a).
    tp_boundary: under tensor parallelism, "collective" (gather + rank-ordered sum, then the
        boundary), "fused" (CUDA: `ops.allreduce_boundary` over a symmetric-memory mailbox, `wo_b`
        publishing into it) or "auto" (the default: fused when the ranks' GPUs reach each other
        peer-to-peer, on 2 H200s bitwise equal to "collective" and 1.7x faster per boundary).
        When the fused boundary cannot be built (no peer access, no symmetric memory) the step
        falls back to "collective" and says why once (a warning); `boundary_mode` tells which ran.
    pdl: launch the main chain's Triton kernels with programmatic dependent launch (`ops.pdl`:
        each waits for its predecessor in-kernel, GEMMs prefetch their weights into L2 first);
        Hopper and later, ignored elsewhere. Off: measured 3-15 % slower below 64 rows on an H200
        (docs/step.md).
    wo_a_bf16_dot: BF16 instead of TF32 dot operands in `wo_a` (None: the plan's measured default,
        on for a BF16 weight; docs/gemm.md). indexer_fp8: the indexer's FP8 dot path
        (`index_scores_mxfp4_(fp8_dot=True)`, docs/attn.md); on by default (`bench step` on an H200:
        the step 1-8 % faster at 1-64 rows, 32K); False: the BF16 dot path.
    l2_prefetch: 0 (the default) or the part (0, 1] of every GEMM program's weight stream that
        `ops.l2_prefetch` warms in L2 on a side lane while the main stream runs kernels that barely
        read DRAM: wq_b's from the layer's start, wo_a's and wo_b's once wq_b is done. Changes no
        value. Off: measured slower on an H200 (docs/step.md: the GEMMs take nearly as long on
        L2-resident weights, and the prefetches compete with them).
    window_copy_in_wo_a: move each layer's staged window records into their ring slots inside its
        `wo_a` launch (`ops.wo_a.wo_a_(window_copy=...)`) instead of two torch kernels on a side
        lane beside `wo_a` (the timeline shows them there, and `wo_a` 3 us slower in the step than
        alone). Same values. On by default: `bench step` on an H200 (docs/results/step-s7-h200.*)
        measured it 1-2 % faster at 1-64 rows and 5 % at 32 rows (32K); False: the torch copy on the
        side lane (`bench step --variants window_copy_torch`).
    indexer_first: in the layers that run the indexer, launch the index query's GEMM (indexer.wq_b)
        on the main stream before wq_b instead of beside it on a side lane, so it runs with the
        whole GPU and the scoring and top-k chain (the critical path of those layers in the
        timeline: the main stream waits for the top-k) starts sooner. Same values. Off: measured 1 %
        slower at 1-16 rows, 32K (docs/results/step-s7c-h200.txt): wq_b and the RoPE insert, which
        the main stream enqueues before the scores, start later, and the chain after the GEMM
        (scores, top-k, tables) is most of the wait.
    """

    def __init__(self, stack, state: DecodeState, max_rows: int = 16, buckets: Sequence[int] | None = None,
                 overlap_inputs: bool = True, overlap_candidates: bool = True, graphs: bool = True,
                 wo_a_fp8: bool = False, tp_boundary: str = "auto", pdl: bool = False,
                 wo_a_bf16_dot: bool | None = None, indexer_fp8: bool = True,
                 l2_prefetch: float = 0.0, window_copy_in_wo_a: bool = True,
                 indexer_first: bool = False):
        if buckets is None:
            buckets = tuple(b for b in DEFAULT_BUCKETS if b < max_rows) + (max_rows,)
        buckets = tuple(sorted(set(buckets)))
        if not buckets or buckets[0] < 1 or buckets[-1] > LOW_BATCH_MAX_ROWS:
            raise StepError(f"buckets must lie in 1..{LOW_BATCH_MAX_ROWS} (LOW_BATCH_MAX_ROWS), got {buckets}")
        if state.cfg is not stack.cfg and state.cfg != stack.cfg:
            raise StepError("the state was built for another configuration than the stack")
        if buckets[-1] > state.stage_rows:
            raise StepError(f"buckets up to {buckets[-1]} rows exceed the state's stage_rows={state.stage_rows}; "
                            f"build the DecodeState with stage_rows >= {buckets[-1]}")
        self.stack, self.state, self.cfg = stack, state, stack.cfg
        self.pdl = bool(pdl)
        self.buckets, self.max_rows = buckets, buckets[-1]
        dev = state.device
        self.device = dev
        self.plan = dict(low_batch=True, overlap_inputs=overlap_inputs, overlap_candidates=overlap_candidates,
                         layers=[(i, stack.cfg.plan[i].label) for i in stack.ids])
        B, cfg = self.max_rows, self.cfg
        self.meta = StepMeta(cfg, state, B)
        self.scratch = Scratch(stack.layers[stack.ids[0]].cfg, state, B)   # this rank's heads and groups
        if not (isinstance(l2_prefetch, (int, float)) and 0.0 <= l2_prefetch <= 1.0):
            raise StepError(f"l2_prefetch must be a fraction in [0, 1], got {l2_prefetch!r}")
        self.lanes = Lanes(dev, overlap_inputs, overlap_candidates, l2_prefetch > 0)
        self.selections: dict[int, IndexSelection] = {}
        self.candidate_masks: dict[int, torch.Tensor] = {}
        self.layers = {i: AttentionStep(stack.layers[i], state, self.meta, self.scratch, self.lanes,
                                        self.selections, self.candidate_masks, B, wo_a_fp8,
                                        wo_a_bf16_dot=wo_a_bf16_dot, indexer_fp8=indexer_fp8,
                                        l2_prefetch=float(l2_prefetch),
                                        window_copy_in_wo_a=window_copy_in_wo_a, indexer_first=indexer_first)
                       for i in stack.ids}
        if tp_boundary not in ("auto", "collective", "fused"):
            raise StepError(f"tp_boundary must be 'auto', 'collective' or 'fused', got {tp_boundary!r}")
        if tp_boundary == "fused" and stack.tp.tp > 1 and dev.type != "cuda":
            raise StepError("tp_boundary='fused' needs CUDA symmetric memory; on the CPU use 'collective'")
        mailbox = None
        if tp_boundary != "collective" and stack.tp.tp > 1 and dev.type == "cuda":
            mailbox = _fused_mailbox(stack.tp, B, cfg.dim, len(stack.ids), dev)
        for k, i in enumerate(stack.ids if mailbox is not None else ()):
            self.layers[i].publish = mailbox.slot(k)
        self.mailbox = mailbox
        self.boundary_mode = "single" if stack.tp.tp == 1 else ("fused" if mailbox is not None else "collective")
        self.boundary = Boundary(stack, B, dev, mailbox)
        hc, d = cfg.hc_mult, cfg.dim
        self.x_in = torch.zeros(B, hc, d, dtype=torch.bfloat16, device=dev)
        self.pre_in = torch.zeros(B, hc, dtype=torch.float32, device=dev)
        self.x_out = torch.zeros(B, hc, d, dtype=torch.bfloat16, device=dev)
        self.y = torch.zeros(B, d, dtype=torch.bfloat16, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.use_graphs = graphs and dev.type == "cuda"
        if self.use_graphs:
            self._capture()

    # ------------------------------------------------------------------ schedule
    def _body(self, rows: int) -> None:
        """Every layer for rows [0, rows) from x_in/pre_in into x_out/pre_out (what a graph holds)."""
        with pdl_launch.launching(self.pdl, self.device):
            self._schedule(rows)

    def _schedule(self, rows: int) -> None:
        B, lanes, bd = rows, self.lanes, self.boundary
        self.meta.derive(B)
        if self.mailbox is not None:
            self.mailbox.next_step()                          # this step's generations
        shared: dict = {}
        ids = self.stack.ids
        x = self.x_in[:B]
        mix_ready = bd.mix(ids[0], x, 0, B, lanes)
        bd.enter(ids[0], x, self.pre_in[:B], B)
        for k, i in enumerate(ids):
            self.layers[i].run(B, bd.u[:B], bd.codes[:B], bd.scales[:B], self.y[:B], shared)
            lanes.wait(mix_ready)                             # post/comb/pre of this site
            nxt = ids[k + 1] if k + 1 < len(ids) else None
            x_new = self.x_out[:B] if nxt is None else bd.streams[k % 2][:B]
            bd.exit(i, nxt, self.y[:B], x, k % 2, x_new, B, index=k)
            if nxt is not None:
                mix_ready = bd.mix(nxt, x_new, (k + 1) % 2, B, lanes)
            x = x_new
        self.pre_out = bd.pre[(len(ids) - 1) % 2]
        lanes.wait(shared.get("candidates"), *shared.get("staged", ()), *(s.ready for s in self.selections.values()))

    def _capture(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        for b in self.buckets:
            self.meta.pad(b)
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):       # compile and allocate outside the capture
                self._body(b)
            torch.cuda.current_stream(self.device).wait_stream(side)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool):
                self._body(b)
            self.graphs[b] = g
        torch.cuda.synchronize(self.device)

    # ------------------------------------------------------------------ public call
    def bucket_for(self, rows: int) -> int:
        """The smallest captured bucket holding `rows` rows; StepError past the largest."""
        for b in self.buckets:
            if rows <= b:
                return b
        raise StepError(f"the step has {rows} rows, more than the largest captured bucket "
                        f"{self.buckets[-1]} (buckets {self.buckets}); run the generic path "
                        f"(AttentionStack.forward) or build the step with more rows")

    def __call__(self, x: torch.Tensor, rows: Sequence[tuple], pre: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run one decode step; returns (streams [N, hc, dim] BF16, carried pre [N, hc] FP32).

        x: [N, hc, dim] BF16 streams entering the first layer (N = total rows).
        rows: per request in row order, (req_id, count) or (req_id, count, first_position); count is
            1 + draft rows; a given first_position must equal the request's cached length
            (StepError otherwise: positions that go backwards or skip).
        pre: [N, hc] FP32 carried pre (default: one-hot on stream 0, as the stack's first block).
        Errors: KeyError for an unknown request, CapacityError past the state's capacities (both
        from DecodeState.plan), StepError for more rows than the largest bucket.
        """
        plan_rows = []
        for entry in rows:
            if len(entry) == 3:
                req, count, first = entry
                have = self.state.length(req)
                if first != have:
                    raise StepError(f"request {req!r}: the step starts at position {first} but the "
                                    f"request holds {have} tokens; positions must continue it")
            elif len(entry) == 2:
                req, count = entry
            else:
                raise StepError(f"rows entries must be (req_id, count[, first_position]), got {entry!r}")
            plan_rows.append((req, count))
        n = sum(c for _, c in plan_rows)
        bucket = self.bucket_for(n)
        cfg = self.cfg
        if x.shape != (n, cfg.hc_mult, cfg.dim) or x.dtype != torch.bfloat16:
            raise StepError(f"x must be [{n}, {cfg.hc_mult}, {cfg.dim}] bfloat16, got {tuple(x.shape)} {x.dtype}")
        if pre is not None and (not isinstance(pre, torch.Tensor) or pre.shape != (n, cfg.hc_mult)
                                or pre.dtype != torch.float32):
            raise StepError(f"pre must be [{n}, {cfg.hc_mult}] float32, got "
                            f"{tuple(getattr(pre, 'shape', ()))} {getattr(pre, 'dtype', type(pre).__name__)}")
        step = self.state.plan(plan_rows)
        self.meta.load(step, bucket)
        self.x_in[:n].copy_(x)
        if pre is None:
            self.pre_in[:n] = self.stack.initial_pre(n, self.device)
        else:
            self.pre_in[:n].copy_(pre)
        if self.use_graphs:
            self.graphs[bucket].replay()
        else:
            self._body(bucket)
        out = self.x_out[:n].clone(), self.pre_out[:n].clone()
        if self.mailbox is not None:
            self.mailbox.check()                              # a rank that never arrived: raise
        self.state.advance(step)
        return out

    def accept(self, kept) -> None:
        """Keep only the first `kept[req]` of each listed request's rows of the last step
        (`DecodeState.accept`: the state is then what a run fed only the kept rows holds). Host
        bookkeeping plus a few small device copies outside the graphs; nothing waits for the device.
        Later steps that replay the same buckets give the kept-only run's bits (spec decision 12)."""
        self.state.accept(kept)

    def memory_bytes(self) -> dict[str, int]:
        """Device bytes the step owns beyond the stack's weights and the state's caches (by family):
        the shared scratch and scores, the selections, the streams and boundary, the per-step tables
        (`StepMeta`), and per layer its weight copies and kernel workspaces (`AttentionStep.memory_bytes`)."""
        def size(ts) -> int:
            return sum(t.numel() * t.element_size() for t in ts)

        def tensors(obj) -> list[torch.Tensor]:
            out = []
            for v in vars(obj).values():
                items = v if isinstance(v, (list, tuple)) else v.values() if isinstance(v, dict) else (v,)
                out += [t for t in items if isinstance(t, torch.Tensor)]
            return out
        sel = [t for s in self.selections.values() for t in (s.topk, s.table, s.lengths)]
        return {"scratch": size(tensors(self.scratch)) - self.scratch.scores.numel() * 4,
                "scores": self.scratch.scores.numel() * 4,
                "selections": size(sel) + size(self.candidate_masks.values()),
                "streams": size([self.x_in, self.x_out, self.pre_in, self.y]) + self.boundary.memory_bytes(),
                "tables": storage_bytes(tensors(self.meta)),   # cos/sin per ratio are views
                "layers": sum(layer.memory_bytes() for layer in self.layers.values())}

    def __repr__(self) -> str:
        return (f"DecodeStep({len(self.layers)} layers, buckets {self.buckets}, graphs={self.use_graphs}, "
                f"overlap_inputs={self.lanes.overlap_inputs}, overlap_candidates={self.lanes.overlap_candidates})")
