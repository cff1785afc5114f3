"""DecodeStep: one decode step over every attention layer of a stack, captured per row bucket.

    step = stack.decode_step(state, max_rows=16)        # plans, buffers, graphs: once
    x, pre = step(x, [("a", 1), ("b", 4)])               # one step: 1 row of "a", 1 + 3 draft rows of "b"
    step.accept({"b": 2})                                # speculative decoding: keep "b"'s first 2 rows

A call plans the step's rows in the `DecodeState` (page allocation, capacity checks), loads one
small record per row to the device, replays the CUDA graph of the smallest bucket that holds the
rows (rows past the step's are padding that writes nothing), and advances the state by every row.
None of it waits for the device: the host tables go up from pinned memory (`upload.HostUpload`)
ordered on the current stream, so the host prepares the next step while the device runs this one;
`accept` then keeps a prefix of each request's rows (speculative decoding: `DecodeState.accept`,
on a state built with `max_drafts`). Requests are admitted and freed on the state between steps;
nothing is recaptured. Eager mode (`graphs=False`, and always on the CPU) runs the same schedule
without a graph. `prepare` and `replay` are the two halves of a call without the state's advance
(what a benchmark repeats; `prepare` says when repeats recompute the same values).

The step leaves the tensors of the generic path (`AttentionStack.forward`) at every boundary, up to
the kernels' rounding (see tests/decode); it does not run an FFN between the attention sublayers.
Under tensor parallelism (a stack built with `tp`) each rank runs its heads and groups and reduces
`wo_b`'s FP32 partials before the single-GPU boundary: either `TensorParallel.reduce_partials`
(gather + rank-ordered sum, NCCL or gloo; the collective fallback of design section 3) or, with
the fused boundary, `wo_b` publishing its partial into a symmetric-memory mailbox and one kernel
doing the one-shot all-reduce with the boundary (`ops.allreduce_boundary`). In the buckets of at
least `indexer_shard_rows` rows the Full layers' dense indexers score only the rank's share of the
rows and the ranks gather the selections (`AttentionStep.run(shard=)`).
"""

from __future__ import annotations

import functools
import warnings
from typing import Callable, Sequence

import torch

from ..ops import LOW_BATCH_MAX_ROWS
from ..ops.allreduce_boundary import Mailbox
from ..ops.gluon_indexer import ROW_GROUPS
from ..ops.pdl import supported as pdl_supported
from ..rows import StepRows, as_count, same_device
from ..state import DecodeState, abandon_after
from .attention import AttentionStep
from .boundary import Boundary
from .buffers import IndexSelection, Scratch, StepIO, storage_bytes
from .lanes import Lanes, StepEvents
from .tables import StepMeta

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64)

# From this many rows (a bucket's) up, a TP step row-shards its Full layers' dense indexers: each
# rank scores ceil(rows / tp) rows and the ranks all-gather the top-k and candidate pools (one or
# two collectives per Full layer, a few us each on NVLink). On one H200 the indexer and top-k of a
# Full layer at 128K take ~240 us at 16 rows and ~1 ms at 64 (~15 us a row; a quarter of that at
# 32K), so at 16 rows TP2 saves ~120 us per Full layer at 128K and ~30 us at 32K against the
# gathers' few us; at 8 rows and short contexts the saving shrinks to the gathers' cost (on the
# main stream, where the sharded candidate pool runs too: the replicated one runs on a side lane).
# Not yet measured on two GPUs:
# scripts/indexer_shard_tp.py measures where it pays (spec decision 28).
INDEXER_SHARD_ROWS = 16

# From this many rows (a bucket's) up, each site's mHC mixer is enqueued at the end of the next
# layer's input projections (the fused wq_a|wkv GEMM, the norm pair, the side projections) instead
# of right after the boundary that writes its streams: there the next layer's first GEMMs run
# without the mixer's 640 programs beside them. On an H200 (32K, exact linears,
# `scripts/probe_step_schedule.py --variants=default,mix_early --passes=2` at 4f65f7a, docs/step.md)
# 10277 / 16904 us at 32 / 64 rows against 10346 / 17179 (0.6 / 1.6 % faster); at 1 row it
# measured slower (3802 against 3781 us at e9c7c92), so the smaller buckets keep the early mixer.
# The same bits.
MIX_LATE_ROWS = 32

# The options that launch a kernel by programmatic dependent launch (each on by default; False for
# all of them launches every kernel plainly, the same bits)
PDL_OPTIONS = ("wo_a_pdl", "wq_b_pdl", "qkv_pdl", "wo_b_pdl", "norm_pdl", "boundary_pdl", "mla_pdl")


class StepError(ValueError):
    """A step the captured DecodeStep cannot run (the message names the rows, request or bucket)."""


def _fused_mailbox(tp, rows: int, dim: int, layers: int, dev: torch.device) -> Mailbox | None:
    """The fused boundary's mailbox, or None (after a RuntimeWarning naming the reason; Python's
    default filter shows it once per reason and call site) when the ranks' GPUs cannot reach each
    other peer-to-peer or symmetric memory cannot be set up. Collective."""
    why = tp.peer_access(dev)
    if why is None:
        try:
            return Mailbox.symmetric(tp, rows, dim, layers, dev)
        except (RuntimeError, NotImplementedError) as err:   # every rank fails alike (rendezvous)
            why = f"symmetric memory is not available ({err})"
    warnings.warn(f"fused TP boundary unavailable: {why}; using NCCL gather + the single-GPU boundary",
                  RuntimeWarning, stacklevel=3)
    return None


class DecodeStep:
    """The specialized decode step of `stack` over `state` (design section 1): kernel plans, buffers
    and (on CUDA) one CUDA graph per row bucket, built here once.

    max_rows: the largest bucket when `buckets` is not given.
    buckets: the row counts captured (each 1..LOW_BATCH_MAX_ROWS, at most the state's stage_rows);
        default 1, 2, 4, ... below max_rows, and max_rows. A step runs in the smallest bucket that
        holds its rows; the largest is the most rows a step may hold (`max_rows` afterwards).
    graphs: capture and replay CUDA graphs (CUDA only); False runs the same schedule eagerly.
    overlap: run the side work (side projections, index query, compressor, candidate pool,
        sparse-index tables, the next site's mixer) on auxiliary streams beside the main chain;
        False runs everything on the main stream. Same values either way.
    tp_boundary: under tensor parallelism, "collective" (gather + rank-ordered sum, then the
        boundary), "fused" (CUDA: `ops.allreduce_boundary` over a symmetric-memory mailbox that
        `wo_b` publishes into) or "auto" (fused when the ranks' GPUs reach each other peer-to-peer).
        Both give the same bits. When the fused boundary cannot be built the step falls back to
        "collective" and says why (a RuntimeWarning); `boundary_mode` tells which runs.
    wo_a_fp8: quantize a BF16 `wo_a` to FP8 once at build (changes the numbers; `ops.wo_a`).
    exact_linears: the FP8 linears with the contract's bits (default; `ops.exact_linear.ExactLinear`,
        whichever op measured faster per shape and rows: `ExactMM` or `GluonExactFMA` on CUDA cores
        at few rows, `GluonExactMM` above, on FP16 MMAs over the codes' digits in the measured plans
        and on the FP64 MMA for unlisted shapes; each with the query RoPE in wq_b's epilogue): the
        cache records a layer writes are the reference's, bit for bit, given its input, and
        `trace verify --path step --device cuda` passes the official cases. False runs them on FP8
        tensor cores (`GluonMM` on sm_90, else `LowLatencyMM`; faster from 2 rows, with the query
        RoPE in wq_b's epilogue and, with fold_index_chain, the index query in the indexer wq_b's),
        outside the contract: their 32-deep block sums truncate, so about 3 % of their BF16 outputs
        land one ulp off the contract's and the official cases fail (spec decision 38; docs/gemm.md,
        "Exactness").
    fp32_dots: run the sparse MLA and `wo_a` with FP32 operands and IEEE dots (CUDA-core FMAs: FP32
        round-to-nearest sums, where the default's BF16 / TF32 tensor-core dots truncate; spec
        decision 40): their outputs then differ from the reference's only by FP32 summation order.
    fold_index_chain: launches off the indexer layers' chain - the sparse-index table in the top-k's
        last launch (`topk_ascending_(..., table=)`), and with exact_linears=False the index query's
        RoPE and MXFP4 in the indexer wq_b's epilogue with its head weights in weights_proj's
        (`GluonMM` / `LowLatencyMM(..., index_query=)`, `ll_bf16_(..., scale=)`; the exact linears
        keep `index_query_`): one launch with the exact linears, two with exact_linears=False; the
        same bits. Off by default: on an H200 the step took 1.02x the default's time at 1 row and
        1.00x at 8-64 (docs/step.md).
    fold_boundary: on one GPU, the mHC boundary after a layer in its wo_b's epilogue wherever wo_b's
        op for the bucket's rows is `ExactMM` (exact linears on an sm_90 GPU: 1-2 rows; off sm_90
        and in the interpreter: every bucket): `ExactMM(..., boundary=)` with `Boundary.operands`,
        one launch less a layer, the same bits (`boundary_folded`). Off by default (the boundary's
        own launch after wo_b, `Boundary.exit`): on an H200 the step took 1.33x / 1.53x the
        default's time at 1 / 2 rows with it (docs/step.md); no layer folds at 3-64 rows there.
    weights_lane: the indexer's head weights (`weights_proj`) on a lane of their own (`AUX_INDEX_W`)
        beside the index query's GEMM, the index query waiting for both (default), in the buckets of
        at most `attention.WEIGHTS_LANE_MAX_ROWS` rows (where it measured faster on an H200),
        instead of ahead of the GEMM on the index query's lane; the same bits (docs/step.md).
    comp_tail: in the layers that own a compressor, the compressor's tail - the latent's RMSNorm,
        the indexer's wk projection and the compressed record + index key - in one launch
        (`ops.compressor_tail`) instead of three (`rms_norm_`, `ll_bf16_`,
        `compressed_entry_store_`), where the wk plan allows it (one K split: the step's plans);
        the same bits. Off by default: its first form (one program per row reading all of wk)
        measured slower on an H200, 20.7-26.4 us a layer in the step at 1 row against 14-17 for
        the three launches; its form of one program per wk N tile measured within noise of them
        (`comp_tail` in scripts/probe_step_schedule.py times both, docs/step.md).
    index_row_group: on an sm_90 GPU, the dense indexers' Gluon scorer scores a request's rows this
        many at a time on each key tile it reads (`gluon_index_scores_mxfp4_(row_group=)`: the keys
        read and widened once for a request's decode and draft rows); the same bits. 1 (default),
        2 or 4; it changes nothing elsewhere, nor in the buckets where a TP step row-shards the dense
        indexers (`AttentionStep._select_shared` scores the rank's share of the rows,
        `TensorParallel.row_share`, without it).
    fuse_scales: the exact linears' `GluonExactMM` (sm_90, from a few rows up) with each K block's
        scaling and K-ordered add in one FMA where the scale bytes allow it (`GluonExactConfig.
        fuse_scales`) in every configuration; the same bits. Off by default (the plan's own
        configurations take it where it measured faster, `ops.exact_linear._GLUON_PLAN`);
        elsewhere it changes nothing.
    pair_slots: the exact linears' `GluonExactMM` configurations with the warps along K (sm_90) taking
        the ring's slots two at a time (`GluonExactConfig.pair_slots`: half the CTA barriers a K
        step) in every configuration that can; the same bits. Off by default (the plan's own
        configurations take it where it measured faster); elsewhere it changes nothing.
    wo_a_pdl: on an sm_90 GPU, each layer's Gluon `wo_a` launched by programmatic dependent launch
        after its Gluon sparse MLA, whose last launch lets it start at that launch's programs' start
        (`gluon_sparse_mla_(release=True)`): its programs request their rings' first weight tiles
        while the MLA runs, then wait for it (`gluon_wo_a_(pdl=True)`); the same bits. On by default
        (on an H100 the step 1.9-2.9 % faster at 1-8 rows, 0.6-0.7 % at 16-64: docs/step.md);
        elsewhere it changes nothing.
    wq_b_pdl: on an sm_90 GPU, in the buckets of at most `attention.WQ_B_PDL_MAX_ROWS` rows, each
        layer's exact wq_b (`ExactLinear`, in its Gluon ops) launched by programmatic dependent
        launch after the q/kv norm pair, which lets it start at the pair's start
        (`rms_norm_pair_(release=True)`): its programs request their rings' first weight tiles while
        the pair runs, then wait for it (`ExactLinear(..., pdl=True)`); the same bits. On by default
        (docs/step.md); elsewhere it changes nothing.
    qkv_pdl: on an sm_90 GPU, in the buckets of at most `attention.QKV_PDL_MAX_ROWS` = 2 rows, each
        layer's exact fused wq_a|wkv GEMM (`ExactLinear`) launched by programmatic dependent launch
        after the mHC boundary's own launch before it, which lets it start at its start
        (`mhc_boundary_(release=True)`): its programs ask L2 for their first weight bytes while the
        boundary runs (`ExactMM` at those rows); the same bits. On by default (on an H100 the step
        1.8 / 1.7 % faster at 1 / 2 rows, the same at 4, slower at 8-64: docs/step.md); elsewhere it
        changes nothing.
    wo_b_pdl: on one sm_90 GPU, each layer's exact wo_b launched by programmatic dependent launch
        after the Gluon wo_a, which lets it start once each of its programs has finished its main
        loop (`gluon_wo_a_(release=True)`): wo_b's rings fill (its `ExactMM`, at 1-2 rows, asks L2
        for its first weight bytes) during wo_a's split-K tails; not where wo_b's epilogue runs the
        boundary. The same bits. On by default (on an H100 the step 0.9 / 0.6 / 1.2 / 1.1 / 0.2 / 0.4 %
        faster at 1 / 2 / 4 / 8 / 16 / 64 rows: docs/step.md); elsewhere it changes nothing.
    norm_pdl: on one sm_90 GPU, each layer's q/kv norm pair launched by programmatic dependent
        launch after the fused wq_a|wkv GEMM (`rms_norm_pair_(pdl=True)`: its launch overlaps the
        GEMM's tail, its programs wait for it at their start); the same bits. On by default (on an
        H100 the step 0.3-0.6 % faster at 1-8 rows: docs/step.md); elsewhere it changes nothing.
    boundary_pdl: on one sm_90 GPU, each mHC boundary's own launch (not where wo_b's epilogue runs
        it) by programmatic dependent launch after wo_b (`mhc_boundary_(pdl=True)`); the same bits.
        On by default (on an H100 the step 0.3-0.5 % faster at 1-8 rows: docs/step.md); elsewhere
        it changes nothing.
    mla_pdl: on one sm_90 GPU, in each layer that runs its indexer (not with fold_index_chain, whose
        top-k's last launch writes the table), the Gluon sparse MLA launched by
        programmatic dependent launch after the sparse-index table's launch, which lets it start at
        its start (`topk_slots_(release=True)`, `gluon_sparse_mla_(pdl=True)`: its programs wait for
        the table at theirs); the same bits. On by default (on an H100 the step 0.65 / 0.32 / 0.21 %
        faster at 1 / 2 / 8 rows: docs/step.md); elsewhere it changes nothing.
    prefetch_records: on an sm_90 GPU with overlap, in the buckets of at most
        `attention.PREFETCH_RECORDS_MAX_ROWS` rows, at each layer's start the records its sparse MLA
        will gather asked into L2 at the evict_last priority on a side lane (`AttentionStep._prefetch`,
        `ops.sparse_tables.records_prefetch_l2_`: the window's, and in the layers that read an
        earlier layer's selection its compressed records), so that the MLA's gather finds them in
        L2; the same bits. On by default (on an H100 the step 0.8 % faster at 1 row, the MLA's
        gather 2.3 us a program against 3.4: docs/step.md); elsewhere it changes nothing.
    mix_late_rows: in the buckets of at least this many rows each site's mixer is enqueued at the
        end of the next layer's input projections instead of right after the boundary before it
        (default `MIX_LATE_ROWS`, where it measured faster on an H200; LOW_BATCH_MAX_ROWS + 1:
        never); the same bits.

    Errors: StepError for buckets outside 1..LOW_BATCH_MAX_ROWS or past the state's stage_rows, a
    state of another configuration, a mix_late_rows that is not an int >= 1, an index_row_group
    outside `ROW_GROUPS`, a max_rows or bucket that is not an int, an option documented as a bool
    (graphs .. pair_slots, wo_a_pdl .. prefetch_records) that is not one, an unknown tp_boundary,
    or tp_boundary="fused" under TP off CUDA; `NotEligible` for a layer whose weights do not suit
    the step.

    Under TP the Full layers' dense indexers run row-sharded in the buckets of at least
    `indexer_shard_rows` rows (default `INDEXER_SHARD_ROWS`; `AttentionStep.run(shard=)`) and
    replicated (every rank scores every row) below; the same bits either way.
    """

    def __init__(self, stack, state: DecodeState, *, max_rows: int = 16, buckets: Sequence[int] | None = None,
                 graphs: bool = True, overlap: bool = True, tp_boundary: str = "auto", wo_a_fp8: bool = False,
                 exact_linears: bool = True, fp32_dots: bool = False, fold_index_chain: bool = False,
                 fold_boundary: bool = False, weights_lane: bool = True, comp_tail: bool = False,
                 mix_late_rows: int = MIX_LATE_ROWS, index_row_group: int = 1, fuse_scales: bool = False,
                 pair_slots: bool = False, wo_a_pdl: bool = True, wq_b_pdl: bool = True, qkv_pdl: bool = True,
                 wo_b_pdl: bool = True, norm_pdl: bool = True, boundary_pdl: bool = True,
                 prefetch_records: bool = True, mla_pdl: bool = True):
        if not isinstance(state, DecodeState):
            raise StepError(f"state must be a DecodeState, got a {type(state).__name__}: {state!r}")
        if as_count(max_rows) is None:
            raise StepError(f"max_rows must be an int, got {max_rows!r}")
        max_rows = int(max_rows)
        if buckets is None:
            buckets = tuple(b for b in DEFAULT_BUCKETS if b < max_rows) + (max_rows,)
        else:
            try:
                given = tuple(buckets) if not isinstance(buckets, (str, bytes)) else None
            except TypeError:
                given = None
            if given is None or not all(as_count(b) is not None for b in given):
                raise StepError(f"buckets must be a sequence of ints, got {buckets!r}")
            buckets = given
        buckets = tuple(sorted({int(b) for b in buckets}))
        if not buckets or buckets[0] < 1 or buckets[-1] > LOW_BATCH_MAX_ROWS:
            raise StepError(f"buckets must lie in 1..{LOW_BATCH_MAX_ROWS} (LOW_BATCH_MAX_ROWS), got {buckets}")
        if state.cfg is not stack.cfg and state.cfg != stack.cfg:
            raise StepError("the state was built for another configuration than the stack")
        if buckets[-1] > state.stage_rows:
            raise StepError(f"buckets up to {buckets[-1]} rows exceed the state's stage_rows={state.stage_rows}; "
                            f"build the DecodeState with stage_rows >= {buckets[-1]}")
        if isinstance(mix_late_rows, bool) or not isinstance(mix_late_rows, int) or mix_late_rows < 1:
            raise StepError(f"mix_late_rows must be an int >= 1, got {mix_late_rows!r}")
        if (isinstance(index_row_group, bool) or not isinstance(index_row_group, int)
                or index_row_group not in ROW_GROUPS):
            raise StepError(f"index_row_group must be one of {ROW_GROUPS}, got {index_row_group!r}")
        flags = dict(graphs=graphs, overlap=overlap, wo_a_fp8=wo_a_fp8, exact_linears=exact_linears,
                     fp32_dots=fp32_dots, fold_index_chain=fold_index_chain, fold_boundary=fold_boundary,
                     weights_lane=weights_lane, comp_tail=comp_tail, fuse_scales=fuse_scales, pair_slots=pair_slots,
                     wo_a_pdl=wo_a_pdl, wq_b_pdl=wq_b_pdl, qkv_pdl=qkv_pdl, wo_b_pdl=wo_b_pdl, norm_pdl=norm_pdl,
                     boundary_pdl=boundary_pdl, prefetch_records=prefetch_records, mla_pdl=mla_pdl)
        for name, flag in flags.items():
            if not isinstance(flag, bool):
                raise StepError(f"{name} must be a bool, got {flag!r}")
        if tp_boundary not in ("auto", "collective", "fused"):
            raise StepError(f"tp_boundary must be 'auto', 'collective' or 'fused', got {tp_boundary!r}")
        dev = state.device
        if tp_boundary == "fused" and stack.tp.tp > 1 and dev.type != "cuda":
            raise StepError("tp_boundary='fused' needs CUDA symmetric memory; on the CPU use 'collective'")
        self.stack, self.state, self.cfg = stack, state, stack.cfg
        self.buckets, self.max_rows = buckets, buckets[-1]
        self.device = dev
        self.fold_boundary = fold_boundary
        # the boundary's own launch by PDL after wo_b (one GPU: `Boundary.exit(pdl=)`)
        self.boundary_pdl = boundary_pdl and pdl_supported(dev) and stack.tp.tp == 1
        self.mix_late_rows = mix_late_rows
        self.plan = dict(low_batch=True, overlap=bool(overlap),
                         layers=[(i, stack.cfg.plan[i].label) for i in stack.ids],
                         indexer_shard_rows=INDEXER_SHARD_ROWS)
        B, cfg = self.max_rows, self.cfg
        self.meta = StepMeta(cfg, state, B)
        self.scratch = Scratch(stack.layers[stack.ids[0]].cfg, state, B)   # this rank's heads and groups
        self.lanes = Lanes(dev, overlap)
        self.layers: dict[int, AttentionStep] = {}
        for i in stack.ids:                       # ascending: a layer's sources are built before it
            self.layers[i] = AttentionStep(stack.layers[i], state, self.meta, self.scratch, self.lanes, B,
                                           self.layers, wo_a_fp8=wo_a_fp8, exact_linears=exact_linears,
                                           fp32_dots=fp32_dots, fold_index_chain=fold_index_chain,
                                           weights_lane=weights_lane, comp_tail=comp_tail,
                                           index_row_group=index_row_group, fuse_scales=fuse_scales,
                                           pair_slots=pair_slots, wo_a_pdl=wo_a_pdl, wq_b_pdl=wq_b_pdl,
                                           qkv_pdl=qkv_pdl, wo_b_pdl=wo_b_pdl, norm_pdl=norm_pdl,
                                           prefetch_records=prefetch_records, mla_pdl=mla_pdl)
        self.scratch.workspaces.seal()           # every plan has its view; the graphs take the addresses
        mailbox = None
        if tp_boundary != "collective" and stack.tp.tp > 1 and dev.type == "cuda":
            mailbox = _fused_mailbox(stack.tp, B, cfg.dim, len(stack.ids), dev)
        for k, i in enumerate(stack.ids if mailbox is not None else ()):
            self.layers[i].publish = mailbox.slot(k)
        self.mailbox = mailbox
        # every ratio-2 source runs here: its compressor kernel reads a call's open groups from
        # comp_rows, so accept can leave them to it (`DecodeState.accept(defer=True)`)
        self.restores_groups = bool(state.comp_rows) and set(state.comp_kv) <= set(self.layers)
        self.boundary_mode = "single" if stack.tp.tp == 1 else ("fused" if mailbox is not None else "collective")
        self.boundary = Boundary(stack, B, dev, mailbox)
        self.io = StepIO(cfg, B, dev, stack.initial_pre(B, dev))
        self.pre_out = self.boundary.pre[(len(stack.ids) - 1) % 2]
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.use_graphs = graphs and dev.type == "cuda"
        if self.use_graphs:
            self._capture()

    @property
    def indexer_shard_rows(self) -> int:
        """The fewest rows (a bucket's) at which a TP step row-shards its dense indexers
        (`plan["indexer_shard_rows"]`, default `INDEXER_SHARD_ROWS`). Setting it (an int >= 1)
        recaptures the CUDA graphs; under TP every rank must set the same value (the gathers are
        collectives)."""
        return self.plan["indexer_shard_rows"]

    @indexer_shard_rows.setter
    def indexer_shard_rows(self, rows: int) -> None:
        if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1:
            raise StepError(f"indexer_shard_rows must be an int >= 1, got {rows!r}")
        self.plan["indexer_shard_rows"] = rows
        if self.use_graphs:
            self._capture()

    def boundary_folded(self, layer: int, rows: int) -> bool:
        """Whether the boundary after layer `layer` runs in its wo_b's epilogue in a step of `rows`
        rows (a bucket): `fold_boundary` on, the single-GPU boundary, and wo_b's op for those rows
        `ExactMM` (`AttentionStep.takes_boundary`)."""
        return self.fold_boundary and self.boundary_mode == "single" and self.layers[layer].takes_boundary(rows)

    def indexer_sharded(self, rows: int) -> bool:
        """Whether a step of `rows` rows (a bucket) runs the dense indexers row-sharded: under TP,
        with a Full layer among the step's, at `indexer_shard_rows` rows or more."""
        return (self.stack.tp.tp > 1 and rows >= self.indexer_shard_rows
                and any(a.row_shardable for a in self.layers.values()))

    @property
    def y(self) -> torch.Tensor:
        """[max_rows, dim] BF16: the last layer's output (this rank's partial before a TP reduction)."""
        return self.io.y

    @property
    def selections(self) -> dict[int, IndexSelection]:
        """Per index source layer, its selection buffers (top-k, sparse-index table, lengths)."""
        return {i: a.selection for i, a in self.layers.items() if a.selection is not None}

    @property
    def candidate_masks(self) -> dict[int, torch.Tensor]:
        """Per candidate source layer, its candidate pool [max_rows, entries] uint8."""
        return {i: a.candidate_mask for i, a in self.layers.items() if a.candidate_mask is not None}

    # ------------------------------------------------------------------ schedule
    def _schedule(self, rows: int) -> None:
        """Every layer for rows [0, rows) from io.x_in/pre_in into io.x_out/pre_out (what a graph holds)."""
        B, lanes, bd, io = rows, self.lanes, self.boundary, self.io
        self.meta.derive(B)
        if self.mailbox is not None:
            self.mailbox.next_step()                          # this step's generations
        events = StepEvents()
        ids = self.stack.ids
        shard = self.indexer_sharded(B)
        late = B >= self.mix_late_rows       # each site's mixer enqueued by its layer after its inputs
        x = io.x_in[:B]
        mix_ready = None if late else bd.mix(ids[0], x, 0, B, lanes)
        bd.enter(ids[0], x, io.pre_in[:B], B)
        for k, i in enumerate(ids):
            nxt = ids[k + 1] if k + 1 < len(ids) else None
            x_new = io.x_out[:B] if nxt is None else bd.streams[k % 2][:B]
            after_inputs = None
            if late:
                mix_ready = lanes.event()                     # recorded by the mixer, before any wait on it
                after_inputs = functools.partial(bd.mix, i, x, k % 2, B, lanes, mix_ready)
            if self.boundary_folded(i, B):                    # wo_b waits for this site's mixer
                self.layers[i].run(B, bd.u[:B], bd.codes[:B], bd.scales[:B], io.y[:B], events, shard,
                                   boundary=bd.operands(i, nxt, x, k % 2, x_new, B), mixed=mix_ready,
                                   after_inputs=after_inputs)
            else:
                self.layers[i].run(B, bd.u[:B], bd.codes[:B], bd.scales[:B], io.y[:B], events, shard,
                                   after_inputs=after_inputs)
                lanes.wait(mix_ready)                         # post/comb/pre of this site
                bd.exit(i, nxt, io.y[:B], x, k % 2, x_new, B, index=k, release=nxt is not None
                        and self.layers[nxt].takes_qkv_pdl(B), pdl=self.boundary_pdl)
            if nxt is not None and not late:
                mix_ready = bd.mix(nxt, x_new, (k + 1) % 2, B, lanes)
            x = x_new
        events.join(lanes)

    def _capture(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        for b in self.buckets:
            self.meta.pad(b)
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):       # compile and allocate outside the capture
                self._schedule(b)
            torch.cuda.current_stream(self.device).wait_stream(side)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool, stream=self.lanes.capture):   # the lanes' priorities
                self._schedule(b)
            self.graphs[b] = g
        torch.cuda.synchronize(self.device)

    # ------------------------------------------------------------------ public call
    def bucket_for(self, rows: int) -> int:
        """The smallest captured bucket holding `rows` rows; StepError past the largest or below 1."""
        if as_count(rows) is None or rows < 1:
            raise StepError(f"bucket_for: rows must be an int >= 1, got {rows!r}")
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
        from DecodeState.plan), StepError for more rows than the largest bucket or a wrong x/pre
        (shape, dtype, or a device other than the step's); an error after the plan (the replay, the
        TP boundary's check) abandons the call (`DecodeState.abandon`) before it propagates. Under
        TP the boundary's check fails on the rank that waited for a rank that never arrived: that
        rank abandons while the others may have advanced, so the ranks' states differ from then on
        (free the call's requests on every rank).

        On the host: the plan (Python bookkeeping), the rows' record (numpy), a few copies and small
        kernels enqueued on the current stream (the tables from pinned memory, x and pre into the
        step's inputs, the outputs' clones) and the graph's replay. It does not synchronize with
        the device (tests/decode/test_step_call.py), except under the fused TP boundary, whose
        check for a rank that never arrived reads the mailbox's error flag.
        """
        planned, bucket = self._upload(rows, x, pre)
        try:
            self.replay(bucket)
            n = planned.n_rows
            out = self.io.x_out[:n].clone(), self.pre_out[:n].clone()
            if self.mailbox is not None:
                self.mailbox.check()                          # a rank that never arrived: raise
        except BaseException as err:
            abandon_after(self.state, planned, err)
            raise
        self.state.advance(planned)
        return out

    def prepare(self, rows: Sequence[tuple], x: torch.Tensor, pre: torch.Tensor | None = None) -> int:
        """The first half of a call: plan `rows` in the state (pages, capacities; the state is not
        advanced) and load their records, x and pre (arguments as for a call) into the step's
        inputs. Returns the bucket that `replay` runs. Where each request has one row, replaying a
        prepared step again recomputes the same values into the same cache slots (what `bench step`
        times). A request of several rows is not replayed so: a replay moves its rows' staged window
        records into the ring (and its ratio-2 compressor's open group forward, where the state takes
        no drafts or the request has more than max_drafts + 1 rows), which a second replay reads
        moved (the same work and time, other values); such a state is a benchmark's only."""
        return self._upload(rows, x, pre)[1]

    def replay(self, bucket: int) -> None:
        """Enqueue the step for the prepared rows of `bucket`: its CUDA graph, or the schedule
        eagerly without graphs. The outputs stay in the step's buffers (a call copies them out)."""
        if bucket not in self.buckets:
            raise StepError(f"bucket {bucket} is not one of the step's buckets {self.buckets}")
        if self.use_graphs:
            self.graphs[bucket].replay()
        else:
            self._schedule(bucket)

    def layer_call(self, layer: int, bucket: int) -> Callable[[], None]:
        """A function that enqueues layer `layer` alone for the prepared rows of `bucket`, on the
        inputs the step's boundary buffers hold, and joins its side work (what a benchmark times
        per layer kind). The step's per-row tables are derived for `bucket` here, once."""
        if layer not in self.layers:
            raise StepError(f"layer {layer} is not one of the step's layers {list(self.layers)}")
        self.meta.derive(bucket)
        att, bd, y = self.layers[layer], self.boundary, self.io.y
        shard = self.indexer_sharded(bucket)

        def call() -> None:
            events = StepEvents()
            att.run(bucket, bd.u[:bucket], bd.codes[:bucket], bd.scales[:bucket], y[:bucket], events, shard)
            events.join(self.lanes)
        return call

    def _upload(self, rows: Sequence[tuple], x: torch.Tensor, pre: torch.Tensor | None) -> tuple[StepRows, int]:
        if isinstance(rows, (dict, str, bytes)):
            raise StepError(f"rows must be a list of (req_id, count[, first_position]) entries, got a "
                            f"{type(rows).__name__}" + (" (list(rows.items()) makes one)" if isinstance(rows, dict)
                                                        else ""))
        plan_rows = []
        for entry in rows:
            if not isinstance(entry, (tuple, list)) or len(entry) not in (2, 3):
                raise StepError(f"rows entries must be (req_id, count[, first_position]), got {entry!r}")
            req, count = entry[0], as_count(entry[1])
            if count is None or count < 1:
                raise StepError(f"request {req!r}: count must be an integer >= 1 (a Python or numpy int), "
                                f"got {entry[1]!r}")
            if len(entry) == 3:
                first, have = entry[2], self.state.length(req)
                if as_count(first) is None:
                    raise StepError(f"request {req!r}: first_position must be an integer, got {first!r}")
                if first != have:
                    raise StepError(f"request {req!r}: the step starts at position {first} but the "
                                    f"request holds {have} tokens; positions must continue it")
            plan_rows.append((req, count))
        if not plan_rows:
            raise StepError("rows: the call has no rows (one (req_id, count) entry or more)")
        n = sum(c for _, c in plan_rows)
        bucket = self.bucket_for(n)
        cfg = self.cfg
        if not isinstance(x, torch.Tensor) or x.shape != (n, cfg.hc_mult, cfg.dim) or x.dtype != torch.bfloat16:
            raise StepError(f"x must be [{n}, {cfg.hc_mult}, {cfg.dim}] bfloat16, got "
                            f"{tuple(getattr(x, 'shape', ()))} {getattr(x, 'dtype', type(x).__name__)}")
        if pre is not None and (not isinstance(pre, torch.Tensor) or pre.shape != (n, cfg.hc_mult)
                                or pre.dtype != torch.float32):
            raise StepError(f"pre must be [{n}, {cfg.hc_mult}] float32, got "
                            f"{tuple(getattr(pre, 'shape', ()))} {getattr(pre, 'dtype', type(pre).__name__)}")
        for name, t in (("x", x), ("pre", pre)):
            # a copy from another device would be synchronous (host memory) or a peer transfer
            if t is not None and not same_device(t.device, self.device):
                raise StepError(f"{name} is on {t.device}, the step on {self.device}: move it to the step's device")
        if not self.restores_groups:
            self.state.sync()      # another step's deferred accept: this one's layers do not all restore
        planned = self.state.plan(plan_rows)
        self.meta.load(planned, bucket)
        # detached: a copy from a tensor that requires grad would chain the step's buffers into its graph
        self.io.x_in[:n].copy_(x.detach() if x.requires_grad else x)
        self.io.pre_in[:n].copy_(self.io.pre_first[:n] if pre is None else pre.detach() if pre.requires_grad else pre)
        return planned, bucket

    def accept(self, kept) -> None:
        """Keep only the first `kept[req]` of each listed request's rows of the last step
        (`DecodeState.accept`: the state is then what a run fed only the kept rows holds); nothing
        waits for the device. Where the stack runs every ratio-2 source (`restores_groups`) it is
        host bookkeeping (and a block-table fill where pages go back): the open groups of requests
        with rejected rows are left to the next call's compressor kernels, which read them from
        `comp_rows`, and `seq_lens` to the next call's advance (`DecodeState.accept(defer=True)`;
        the generic path and `DecodeState.sync` bring them up to date otherwise); else the groups
        are copied and the mirror uploaded here. Later steps that replay the same buckets give the
        kept-only run's bits (spec decision 12)."""
        self.state.accept(kept, defer=self.restores_groups)

    def memory_bytes(self) -> dict[str, int]:
        """Device bytes the step owns beyond the stack's weights and the state's caches (by family):
        the shared scratch and scores, the main-stream kernels' workspaces that every layer shares
        (`Workspaces`, counted once), the selections, the streams and boundary, the per-step tables
        (`StepMeta`), and per layer its weight copies and its kernels' own workspaces
        (`AttentionStep.memory_bytes`)."""
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
                "workspaces": self.scratch.workspaces.memory_bytes(),
                "selections": size(sel) + size(self.candidate_masks.values()),
                "streams": self.io.memory_bytes() + self.boundary.memory_bytes(),
                "tables": storage_bytes(tensors(self.meta)),   # cos/sin per ratio are views
                "layers": sum(layer.memory_bytes() for layer in self.layers.values())}

    def __repr__(self) -> str:
        return (f"DecodeStep({len(self.layers)} layers, buckets {self.buckets}, graphs={self.use_graphs}, "
                f"overlap={self.lanes.overlap})")
