"""AttentionStep: one layer of the specialized decode step, in the order of design section 2.

Built once per layer from the layer's own weights (`AttentionLayer.w`), the stack's `DecodeState`
and the step's shared `StepMeta`/`Scratch`/`Lanes`; `run(rows)` enqueues the layer's work for the
first `rows` rows (a row bucket) and is what the CUDA graph captures. Host work - eligibility,
fused weights, kernel plans and their workspaces - happens in the constructor, never in `run`.

Eligibility (decided here, once): every linear of the step must be an FP8 weight with 32x32 UE8M0
scales (the low-latency MXFP8 GEMM) or a BF16/FP32 side projection (`ll_bf16`); `wo_a` streams as
stored (BF16, or FP8 + scale when the checkpoint ships it so) unless the step was built with
`wo_a_fp8=True`, which quantizes a BF16 `wo_a` once and changes the numbers (ops.wo_a.quantize_wo_a).
The FP8 linears run with the contract's bits (`ExactLinear`: each 32-deep block sum exact and
rounded once, then K order; `ExactMM` or `GluonExactFMA` on CUDA cores at few rows, `GluonExactMM`
above where that measured faster: FP16 MMAs over the codes' digits in the measured plans, the FP64
MMA for unlisted shapes), or with `exact_linears=False` on FP8 tensor cores (`GluonMM` on sm_90,
else `LowLatencyMM`: truncated block sums, outside the contract);
`fp32_dots=True` gives the sparse MLA and `wo_a` FP32 operands with IEEE dots (CUDA-core FMAs:
FP32 round-to-nearest sums where a tensor-core MMA truncates; `SparseMlaPlan.for_step(fp32_dots=
True)`, `WoAPlan.build(ieee_dot=True)`). A `wo_a` runs the Gluon kernel on sm_90 otherwise
(`wo_a_plan`): a BF16 one with the Triton plan's bits, faster; an FP8 one through its folded
consumer (the block scales folded into an exact conversion to BF16: `ops.gluon_wo_a`; its scale
bytes checked at build, `foldable_scale`: else the Triton plan).
A layer that is not eligible raises `NotEligible`, and the caller keeps the generic path.
"""

from __future__ import annotations

from typing import Callable, Mapping

import torch
import triton

from ..config import FULL, REUSE, SWA
from ..layer import AttentionLayer
from ..ops import LOW_BATCH_MAX_ROWS
from ..ops.compressor import compress_ratio2_
from ..ops.compressor_tail import CompressorTailPlan, compressor_tail_, plan_misfit
from ..ops.index_query import index_query_
from ..ops.indexer import index_scores_mxfp4_
from ..ops.kv_write import compressed_entry_store_, query_rope_
from ..ops.common import is_sm90
from ..ops.exact_linear import ExactLinear
from ..ops.exact_mm_plan import ExactConfig
from ..ops.gluon_indexer import gluon_index_scores_mxfp4_
from ..ops.gluon_mm import GluonMM
from ..ops.gluon_wo_a import GluonWoAConfig, GluonWoAPlan, foldable_scale, gluon_wo_a_
from ..ops.gluon_sparse_mla import GluonSparseMlaPlan, gluon_sparse_mla_
from ..ops.ll_bf16 import LlBf16Plan, ll_bf16_
from ..ops.mhc import BoundaryOperands
from ..ops.pdl import supported as pdl_supported
from ..ops.rms_norm import rms_norm_, rms_norm_pair_
from ..ops.low_latency_mm import LowLatencyConfig, LowLatencyMM
from ..ops.sparse_mla import SUPPORTED_HEADS, SparseMlaPlan, sparse_mla_
from ..ops.sparse_tables import records_prefetch_l2_, topk_slots_
from ..ops.topk import TopKPlan, candidate_mask_, topk_ascending_
from ..ops.wo_a import WoAPlan, quantize_wo_a, wo_a_
from ..state import DecodeState
from .buffers import IndexSelection, Scratch, storage_bytes
from .lanes import AUX_COMPRESSOR, AUX_INDEX_Q, AUX_INDEX_W, AUX_MIXER, Event, Lanes, StepEvents
from .tables import StepMeta


class NotEligible(ValueError):
    """A layer's weights do not suit the specialized step (the message names the tensor)."""


def _few_programs(device: torch.device) -> bool:
    """On the CPU the kernels run in Triton's interpreter, where each program costs ~0.1 s whatever
    its size: plans there use one split and wide tiles (the numbers are the same contract)."""
    return device.type != "cuda"


def fp8_linear_plan(weight: torch.Tensor, scale: torch.Tensor, max_rows: int, exact: bool = False,
                    workspace=None, fuse_scales: bool = False, pair_slots: bool = False):
    """The GEMM plan of one FP8 linear, the same call whichever it is: `ops.exact_linear.ExactLinear`
    (the contract's bits: `ExactMM` on CUDA cores, and on sm_90 `GluonExactFMA` on CUDA cores and
    `GluonExactMM` - FP16 MMAs over the codes' digits in the measured plans, the FP64 MMA for
    unlisted shapes - where those measured faster) when `exact`; else FP8 tensor cores, whose
    32-deep block sums truncate (docs/gemm.md, "Exactness"): the Gluon tier `ops.gluon_mm.GluonMM`
    on an sm_90 GPU where it builds (K a multiple of 128, aligned rows), otherwise the Triton tier
    `ops.low_latency_mm.LowLatencyMM`. Each plan's reduction order is fixed per weight, whatever
    the rows (batch invariance). workspace: None (the plan's own split-K workspace) or the step's
    `Workspaces` pool, for a linear on the main stream only (the plans' `workspace` contract).
    fuse_scales: the exact linear's `GluonExactMM` with its fused scaling (`ExactLinear(fuse_scales=)`;
    the same bits); pair_slots: with the ring's slots two at a time along K
    (`ExactLinear(pair_slots=)`; the same bits)."""
    n, k = weight.shape
    few = _few_programs(weight.device)
    # in the interpreter: one program per 512 weight rows, the deepest K step that divides K
    wide_n, deep_k = min(512, triton.next_power_of_2(n)), next((b for b in (256, 128, 64) if k % b == 0), 32)
    if exact:
        config = ExactConfig(block_n=wide_n, block_k=deep_k, rows=4) if few else None
        return ExactLinear(weight, scale, max_rows, config, workspace, fuse_scales=fuse_scales, pair_slots=pair_slots)
    if is_sm90(weight.device):
        try:
            return GluonMM(weight, scale, max_rows, workspace=workspace)
        except ValueError:          # a shape or alignment the Gluon tier does not take
            pass
    config = LowLatencyConfig(block_n=wide_n, block_k=deep_k, split=1) if few else None
    return LowLatencyMM(weight, scale, max_rows, config, workspace)


# The indexer's head weights take their own lane (`DecodeStep(weights_lane=True)`) in the buckets of
# at most this many rows: on an H200 (32K, bench step at cc6dab9) the step took 3697 / 4471 us at
# 1 / 2 rows with it against 3739 / 4506 without, and 5121 / 5256 / 7119 us at 4 / 8 / 16 rows
# against 5067 / 5217 / 7099 (0.2-0.3 % slower at 32-64): docs/step.md
WEIGHTS_LANE_MAX_ROWS = 2

# The exact wq_b launched by PDL after the norm pair (`DecodeStep(wq_b_pdl=True)`) in the buckets of at
# most this many rows: on an H100 (32K, two passes of scripts/probe_step_schedule.py at 0a0e41f+, both
# PDL launches against neither) 3930 / 5060-5064 us at 1 / 8 rows against 4042-4049 / 5148-5151 with
# 1.6 / 0.6 % of it from wq_b's launch (3906 / 5053 against wo_a's alone 3968 / 5084 in bench step),
# but wq_b's launch by PDL 0.5-1.0 % slower than wo_a's alone at 16-64 rows (0.8-1.2 % slower than
# neither with wq_b's alone): docs/step.md
WQ_B_PDL_MAX_ROWS = 8

# The exact fused wq_a|wkv launched by PDL after the mHC boundary's launch (`DecodeStep(qkv_pdl=True)`)
# in the buckets of at most this many rows (ExactMM's at V4.1-Flash's TP1): on an H100 (32K, two passes
# of scripts/probe_step_schedule.py at 69790cb) 3859.5 / 3861.2 us at 1 row against 3935.0 / 3924.6,
# 4426.6 / 4411.9 at 2 against 4492.1 / 4502.6 (1.8 / 1.7 % less), the same at 4, 2.8 % slower at 8 (and
# 1.7 / 6.6 % at 16 / 64 at 2ad2dea): docs/step.md
QKV_PDL_MAX_ROWS = 2

# The records each layer's sparse MLA will gather asked into L2 at the layer's start
# (`DecodeStep(prefetch_records=True)`) in the buckets of at most this many rows: in the step at 1 row
# the MLA's record gather took 3.4 us a program against 0.96 with the records in L2 (H100, run FU,
# scripts/probe_step_mla_phases.py), 2.3 with the prefetch; the step 3654.3 / 3647.9 us at 1 row
# against 3686.2 / 3676.6 (0.8 % less, processes of their own, two passes: run FV); at 2 rows 4279.2 /
# 4280.2 against 4305.7 / 4290.0, within the default's own spread of its two passes, so not taken
# there; at 8 rows 2.6 % slower (run FW); at L2's normal priority instead of evict_last 1.2-1.6 %
# slower at 1 row (run GA): docs/step.md
PREFETCH_RECORDS_MAX_ROWS = 1


# The ring slots of an FP8 `wo_a`'s folded Gluon consumer (a slot holds half the bytes of the BF16
# weight's, whose plan keeps its default 6): 14.0 / 14.1 / 14.3 / 14.9 / 19.0 us at 1 / 2 / 8 / 16 /
# 64 rows against 6 slots' 14.5 / 14.5 / 14.8 / 15.3 / 19.5, the same bits (H200,
# `scripts/probe_gluon_wo_a.py --fp8fold`, docs/results/gpu-tests-h200.txt run BL)
FP8_WO_A_STAGES = 8

# The ring slots whose weight tiles the Gluon `wo_a`, launched by PDL during the sparse MLA
# (`wo_a_pdl`), requests before its wait (`GluonWoAConfig.prefill`; None: all its slots, 6 for a BF16
# weight: ~12.6 MB over its 256 programs at TP1, asked of DRAM as the MLA's record gathers start). The
# same values whatever it is. With one slot the 1-row MLA's programs span 11.8 us a Reuse layer
# instead of 14.3 (their gather 1.45 us against 3.07), but the step is 0.7 % slower (two slots 0.5 %):
# wo_a then reads those bytes after its wait (H100, run FW, docs/step.md), so all slots.
WO_A_PREFILL: int | None = None

# Where the Gluon sparse MLA's programs signal the gate (`gluon_sparse_mla_(signal_after=)`:
# "decoded", once a program's records are in shared memory; "stored", once its partial is) at which
# the Gluon `wo_a`, launched by PDL, waits after requesting its first `WO_A_GATE_PREFILL` ring slots
# and before requesting the rest (`gluon_wo_a_(gate=)`): its weight stream beside the MLA without
# queueing ahead of the MLA's gathers, in the launches of `WO_A_GATE_ROWS` rows. None: no gate. The
# same values whatever they are. The MLA's gathers speed up but its scores and look-back slow by as
# much: with two slots before the gate the step is 0.2-0.9 % faster at 8 rows (22 us; three H100s,
# runs FX, FY and FZ), within the spread at 4 rows, 0.2-0.3 % slower at 16, 0.2-0.9 % at 2 and
# 0.6-2.0 % at 1 (H100, docs/step.md), so the gate runs at 5-8 rows: so set, 4908.7 us at 8 rows
# against 4922.1 without any gate (medians of three passes, H100, run GA).
WO_A_GATE: str | None = "decoded"
WO_A_GATE_ROWS: tuple[int, int] = (5, 8)
WO_A_GATE_PREFILL = 2


def wo_a_plan(heads: int, groups: int, rank: int, max_rows: int, weight_dtype: torch.dtype,
              device: torch.device, *, head_dim: int = 512, rope_dim: int = 64, workspace=None,
              fp32_dots: bool = False, gluon_fp8: bool = True):
    """The plan of the grouped `wo_a` (launched by `wo_a_launch`): on an sm_90 GPU a BF16 weight
    without `fp32_dots` runs the Gluon kernel (`ops.gluon_wo_a.GluonWoAPlan`, where it builds: the
    Triton plan's split and K order, the same bits on the H200 at every TP shard and 1-64 rows, and
    19.7-25.4 us at 1-64 rows where the Triton plan takes 21.6-54.3: docs/gemm.md), and so does an
    FP8 weight with gluon_fp8 (below); otherwise `ops.wo_a.WoAPlan` (FP32 IEEE dots with
    `fp32_dots`, other GPUs, the interpreter with one split, an FP8 weight with gluon_fp8=False).
    The reduction order is fixed per plan, whatever the rows (batch invariance).
    workspace: None or the step's `Workspaces` pool (the plans' `workspace` contract).
    gluon_fp8: an FP8 weight on sm_90 runs the Gluon kernel's folded consumer with its bit
    conversion (`GluonWoAConfig(fold_scales=True, fold_bits=True)`: the same bits as the F16 -> FP32
    conversion, 14.5-15.6 against 15.3-15.9 us at 1-16 rows on an H200, docs/gemm.md) in a ring of
    `FP8_WO_A_STAGES` slots instead of the Triton plan; callers pass `gluon_wo_a.foldable_scale(scale)`,
    which reads the scale bytes once."""
    device = torch.device(device)
    if is_sm90(device) and (weight_dtype == torch.bfloat16 or gluon_fp8) and not fp32_dots:
        ring = {"prefill": WO_A_PREFILL} | ({} if weight_dtype == torch.bfloat16 else {"stages": FP8_WO_A_STAGES})
        try:
            return GluonWoAPlan.build(heads, groups, rank, max_rows, weight_dtype, device, head_dim=head_dim,
                                      rope_dim=rope_dim, workspace=workspace,
                                      config=GluonWoAConfig(fold_scales=True, fold_bits=True, **ring))
        except ValueError:          # a shape the Gluon kernel does not take
            pass
    few = {"split": 1} if _few_programs(device) else {}
    return WoAPlan.build(heads, groups, rank, max_rows, weight_dtype, device, head_dim=head_dim,
                         rope_dim=rope_dim, workspace=workspace, ieee_dot=fp32_dots, **few)


def wo_a_launch(plan, *args, **kwargs) -> None:
    """Launch the grouped `wo_a` of a `wo_a_plan` plan: `ops.gluon_wo_a.gluon_wo_a_` or
    `ops.wo_a.wo_a_`, which take the same arguments."""
    (gluon_wo_a_ if isinstance(plan, GluonWoAPlan) else wo_a_)(plan, *args, **kwargs)


def sparse_mla_plans(max_rows: int, heads: int, window: int, topk: int, device: torch.device, *,
                     workspace=None, fp32_dots: bool = False) -> list:
    """The sparse MLA plans of a layer (ascending max_rows: a launch takes the first that holds its
    rows; launched by `sparse_mla_launch`). On an sm_90 GPU without `fp32_dots` the Gluon plans of
    `GluonSparseMlaPlan.for_step` (`ops.gluon_sparse_mla`: key-major, each record decoded once per
    row), one configuration per row bucket and head count (`STEP_CONFIGS`): at 1-2 rows dim_split
    4 with the spread combination, the values look-back and fp4_lut (12.8 / 13.2 us at 64 heads on
    the H200, the default 17.7 / 17.4), at 3-4 rows the same with dim_split 2 and maxnreg 128 (14.8 at 4 rows), at
    5-12 rows (at 32 heads 5-26 and 33-52, at 8-16 heads every row count above 4) the spread combination with the values
    look-back, fp4_lut and maxnreg 128 (17.6 / 28.6 at 8 / 16, 17.2 at 4; the default 17.9 / 19.2 /
    34.9 at 4 / 8 / 16), at 64 heads from 13 rows P.V and the combination in a
    second launch (`combine="pv"`, fp4_lut) after a first launch of two key buffers at maxnreg 80
    (three programs an SM) with q copied by TMA: at 13-16 rows on 64-dim slices through a 3-slot
    cp.async ring at a cap of 80 (pv_dims 64, pv_stages 3, pv_maxnreg 80; 23.8 at 16 against the
    spread combination's 26.5, FlashMLA 16.0), above on 128-dim slices through a 4-slot ring
    (pv_stages 4; 30.7 / 52.4 at 32 / 64; the default 52.0 / 91.7; the Triton tilings 261.8 at 64:
    docs/attn.md), and at 32 heads that 128-dim ring at 27-32 and 53-64 rows (29.6 / 51.5 at 32 /
    64 against the spread combination's 31.7 / 57.6). Every
    configuration gives the same bits on every row (the probe's and the GPU tests' check), so a row's outputs do not
    depend on the bucket: batch invariance holds. With `fp32_dots` the Triton FP32 plan
    (`SparseMlaPlan.for_step(fp32_dots=True)`); other GPUs the Triton `STEP_TILINGS`; the
    interpreter one unsplit plan. Each is one reduction order whatever the rows (batch invariance).
    workspace: None or the step's `Workspaces` pool (the plans' `workspace` contract; the plans of
    one layer share its views, so it holds the largest plan's workspaces)."""
    device = torch.device(device)
    if _few_programs(device):
        return [SparseMlaPlan.build(max_rows, heads, window, topk, device, split=False, workspace=workspace)]
    if is_sm90(device) and not fp32_dots:
        return GluonSparseMlaPlan.for_step(max_rows, heads, window, topk, device, workspace=workspace)
    return SparseMlaPlan.for_step(max_rows, heads, window, topk, device, workspace=workspace, fp32_dots=fp32_dots)


def sparse_mla_launch(plan, *args, **kwargs) -> None:
    """Launch the sparse MLA of a `sparse_mla_plans` plan: `ops.gluon_sparse_mla.gluon_sparse_mla_`
    or `ops.sparse_mla.sparse_mla_`, which take the same arguments."""
    (gluon_sparse_mla_ if isinstance(plan, GluonSparseMlaPlan) else sparse_mla_)(plan, *args, **kwargs)


# The fused histogram pays where the top-k's pass it saves costs more than the scorer's extra
# work: on an H200 (`bench attn` at 2ca745c, docs/attn.md) scores + top-k with it against without
# it: 23.0 / 25.7 us at 1 row x 32K entries, 30.2 / 31.8 at 4 x 32K, 30.9 / 32.6 at 1 x 128K; but
# 58.4 / 53.7 at 4 x 128K, 83.0 / 69.3 at 16 x 32K, 272 / 199 at 64 x 32K, 103 / 89 at 1 x 1M.
# With the scorer's current defaults (`gluon_indexer.default_options`, H200 at 27e9b3b) it costs
# the scorer 1.2 us at 1 x 8K and 1 x 32K, 2.4 at 1 x 128K, 16 at 1 x 1M, 30 at 16 x 128K, 234 at
# 64 x 128K. It saves the top-k's high-byte pass: the linked top-k takes 14.2 us at 1 x 128K with
# it against ~19 without (three launches); but it saves only 10 us at 16 x 128K (26.0 / 36.1) and
# 32 at 64 x 128K (81.0 / 113.1), and at 1 x 1M the four-launch path without it (32.5) is about the
# linked path with it (33.8). So the bound stands.
FUSED_HISTOGRAM_MAX = 1 << 17       # rows x entries per call at which the step lets the scorer build it
# The Gluon scorer's query fold (`gluon_index_scores_mxfp4_(fold_q=)`: the same bits for the step's
# MXFP4 index queries) in the step's scorer: the step 0.1-0.3 % faster with it at 1-64 rows (H100, both
# passes; `scripts/probe_step_schedule.py`'s no_index_fold variant times it off; docs/attn.md)
INDEX_FOLD_Q = True
# The step's top-k in one launch (`topk_ascending_(one_launch=True)`: its programs wait for each other
# within the launch, every wait bounded; the same selection) at calls of at most this many rows on
# sm_90, else the linked path's two launches. H100, each pass and variant in a process of its own
# (`scripts/probe_step_schedule.py --variants=default,topk_one`, topk_one at up to 8 rows; docs/step.md):
# the step 0.56 / 0.57 % less at 1 row in two runs, 0.43 / 0.16 % at 2, 0.41 % at 4, 0.46 % more at
# 8; in the 1-row timelines 8.9 us from the scores' end to the table's start against 10.3-10.6. Only
# where the scorer built the top-k's high-byte histogram (`topk_launch`'s hist_ready): `bench attn`'s
# pair in one launch on an H100 (run GN at f0f383b) took 1.2-3.2 us less at 1-4 rows x 32K and 128K,
# all with the histogram, but at 1 x 1M, without it, 128.2 us against 86.9 on the linked path (2 x
# 1M 149.6 against 142.0; docs/attn.md)
TOPK_ONE_LAUNCH_MAX_ROWS = 4


def index_scores_launch(iq, w, pool, block_table, page, req_slot, n_vis, out, cand_mask=None,
                        hist: torch.Tensor | None = None, row_group: int = 1) -> bool:
    """The step's indexer scores, the bits of `ops.indexer.index_scores_mxfp4_(..., fp8_dot=True)`:
    on an sm_90 GPU the Gluon scorer (`ops.gluon_indexer` at its size's defaults; on the H200
    1.3-2x faster than the Triton path from 1 row x 128K up, slower at 1 x 32K, 7.3 against 5.9 us,
    where the histogram it builds saves the top-k more; docs/attn.md), which also adds the top-k's
    high-byte histogram into `hist` (a `TopKPlan.hist_hi` view) when given and the call is small
    enough for that to pay (rows x entries <= FUSED_HISTOGRAM_MAX); elsewhere the Triton FP8 path. Returns whether `hist` was
    filled (the top-k's `hist_ready`; the selection is the same either way). row_group: the Gluon
    scorer's (a request's rows scored that many at a time on each key tile read; the same bits),
    unused elsewhere; the Gluon scorer folds the query where it can (INDEX_FOLD_Q)."""
    if is_sm90(iq.device):
        if hist is not None and out.shape[0] * out.shape[1] > FUSED_HISTOGRAM_MAX:
            hist = None
        gluon_index_scores_mxfp4_(iq, w, pool, block_table, page, req_slot, n_vis, out, cand_mask, hist=hist,
                                  row_group=row_group, fold_q=INDEX_FOLD_Q)
        return hist is not None
    index_scores_mxfp4_(iq, w, pool, block_table, page, req_slot, n_vis, out, cand_mask, fp8_dot=True)
    return False


def topk_launch(scores, n_vis, out, plan: TopKPlan, hist_ready: bool) -> torch.Tensor:
    """The step's top-k after `index_scores_launch` (`hist_ready`: what that returned): in one launch
    at calls of at most TOPK_ONE_LAUNCH_MAX_ROWS rows on an sm_90 GPU whose scorer built the
    high-byte histogram (hist_ready), else the linked path's launches (`topk_ascending_`; the same
    selection either way). Returns out."""
    one = hist_ready and scores.shape[0] <= TOPK_ONE_LAUNCH_MAX_ROWS and is_sm90(scores.device)
    return topk_ascending_(scores, n_vis, out, plan, hist_ready=hist_ready, one_launch=one)


def _fp8_weight(w: dict, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight, scale bytes) of an FP8 linear; NotEligible naming it otherwise."""
    weight, scale = w.get(f"attn.{name}.weight"), w.get(f"attn.{name}.scale")
    if weight is None or scale is None or weight.dtype != torch.float8_e4m3fn:
        raise NotEligible(f"attn.{name} must be an FP8 weight with 32x32 UE8M0 scales for the low-latency GEMM")
    return weight, scale.view(torch.uint8)


def _fp8_plan(w: dict, name: str, max_rows: int, exact: bool = False, workspace=None, fuse_scales: bool = False,
              pair_slots: bool = False):
    return fp8_linear_plan(*_fp8_weight(w, name), max_rows, exact, workspace, fuse_scales, pair_slots)


class AttentionStep:
    """Layer `layer.spec.layer` of the specialized step (see the module docstring)."""

    def __init__(self, layer: AttentionLayer, state: DecodeState, meta: StepMeta, scratch: Scratch,
                 lanes: Lanes, max_rows: int, sources: Mapping[int, "AttentionStep"] | None = None,
                 wo_a_fp8: bool = False, exact_linears: bool = True, fp32_dots: bool = False,
                 fold_index_chain: bool = False, weights_lane: bool = True, comp_tail: bool = False,
                 index_row_group: int = 1, fuse_scales: bool = False, pair_slots: bool = False,
                 wo_a_pdl: bool = True, wq_b_pdl: bool = True, qkv_pdl: bool = True, wo_b_pdl: bool = True,
                 norm_pdl: bool = True, prefetch_records: bool = True, mla_pdl: bool = True):
        """sources: the step's layers built before this one (by id), among them this layer's index and
        KV sources: a layer that reuses a selection or a candidate pool reads its source's buffers.
        The layer's own selection and candidate pool (when it makes them) are its attributes
        `selection` and `candidate_mask`."""
        cfg, spec, w = layer.cfg, layer.spec, layer.w
        if not 1 <= max_rows <= LOW_BATCH_MAX_ROWS:
            raise NotEligible(f"max_rows={max_rows}: the specialized step serves 1..{LOW_BATCH_MAX_ROWS} rows")
        if (cfg.head_dim, cfg.rope_head_dim, cfg.index_head_dim) != (512, 64, 128):
            raise NotEligible(f"head_dim/rope_head_dim/index_head_dim = {cfg.head_dim}/{cfg.rope_head_dim}/"
                              f"{cfg.index_head_dim}: the kernels are built for V4.1's 512/64/128")
        if cfg.n_heads not in SUPPORTED_HEADS:
            raise NotEligible(f"n_heads={cfg.n_heads}: sparse MLA runs {SUPPORTED_HEADS} local heads")
        self.cfg, self.spec, self.w, self.layer = cfg, spec, w, layer
        # the indexer's head weights (weights_proj) on a lane of their own, beside the index query's
        # GEMM, instead of ahead of it on the index query's lane (a schedule choice: the same bits)
        self.proj_own_lane = bool(weights_lane)
        # wo_a_pdl: the Gluon wo_a launched by PDL after the Gluon sparse MLA, which releases it at
        # its programs' start (a schedule choice: the same bits; `_attend`, `_output`)
        self.wo_a_pdl = bool(wo_a_pdl) and pdl_supported(state.device)
        self.state, self.meta, self.s, self.lanes = state, meta, scratch, lanes
        dev = state.device
        # fused_wqa_wkv: one low-latency GEMM over the stacked weights (both FP8, 32-row blocks)
        if cfg.q_lora_rank % 32:
            raise NotEligible(f"q_lora_rank={cfg.q_lora_rank} must be a multiple of 32 to stack wq_a and wkv")
        (wq_a, s_q), (wkv, s_kv) = _fp8_weight(w, "wq_a"), _fp8_weight(w, "wkv")
        self.w_qkv, self.s_qkv = torch.cat([wq_a, wkv]), torch.cat([s_q, s_kv])
        # The main stream's kernels take their split workspaces from the step's shared pool (they
        # run one after another, these and every other layer's: `buffers.Workspaces`): the fused
        # wq_a|wkv, wq_b, wo_a, wo_b and the sparse MLA. The plans of the side lanes (the indexer's
        # wq_b, the BF16 side projections, the candidate pool) keep their own, and so does the
        # top-k's (main stream, under a MiB).
        pool = scratch.workspaces
        self.mm_qkv = fp8_linear_plan(self.w_qkv, self.s_qkv, max_rows, exact_linears, pool, fuse_scales, pair_slots)
        self.mm_wq_b = _fp8_plan(w, "wq_b", max_rows, exact_linears, pool, fuse_scales, pair_slots)
        # the query RoPE runs in wq_b's epilogue where its plan has one (the exact linears, the
        # Gluon and Triton tiers), else as its own launch after it; the window insert runs in the
        # q/kv norm pair's launch
        self.rope_in_wq_b = isinstance(self.mm_wq_b, (ExactLinear, GluonMM, LowLatencyMM))
        # wq_b_pdl: the exact wq_b launched by PDL after the q/kv norm pair, which releases it at its
        # start, in the buckets of at most WQ_B_PDL_MAX_ROWS rows (a schedule choice: the same bits;
        # `_inputs`, `_prepare`, `takes_wq_b_pdl`)
        self.wq_b_pdl = bool(wq_b_pdl) and pdl_supported(dev) and isinstance(self.mm_wq_b, ExactLinear)
        # qkv_pdl: the exact fused wq_a|wkv launched by PDL after the mHC boundary's launch, which
        # releases it at its start, in the buckets of at most QKV_PDL_MAX_ROWS rows (a schedule
        # choice: the same bits; `_inputs`, `DecodeStep._schedule`, `takes_qkv_pdl`)
        self.qkv_pdl = bool(qkv_pdl) and pdl_supported(dev) and isinstance(self.mm_qkv, ExactLinear)
        self.mm_wo_b = _fp8_plan(w, "wo_b", max_rows, exact_linears, pool, fuse_scales, pair_slots)
        # wo_b_pdl: the exact wo_b launched by PDL after the Gluon wo_a, which releases it once each
        # program's main loop is done (a schedule choice: the same bits; `_output`, one GPU, no
        # boundary in wo_b's epilogue)
        self.wo_b_pdl = bool(wo_b_pdl) and pdl_supported(dev) and isinstance(self.mm_wo_b, ExactLinear)
        # norm_pdl: the q/kv norm pair launched by PDL after the fused wq_a|wkv GEMM (its launch
        # overlaps the GEMM's tail; a schedule choice: the same bits; `_inputs`, one GPU)
        self.norm_pdl = bool(norm_pdl) and pdl_supported(dev) and layer.tp.tp == 1
        # mla_pdl: in a layer that runs its indexer, the Gluon sparse MLA launched by PDL after the
        # sparse-index table's own launch (not with fold_index_chain), which releases it at its start
        # (a schedule choice: the same bits; `takes_mla_pdl`, `_tables`, `_attend`, one GPU)
        self.mla_pdl = bool(mla_pdl) and pdl_supported(dev) and layer.tp.tp == 1
        # prefetch_records: the records the sparse MLA will gather asked into L2 at the layer's start,
        # on a side lane, in the buckets of at most PREFETCH_RECORDS_MAX_ROWS rows (a schedule aid:
        # the same bits; `run`, `takes_prefetch`; sm_90, the lanes overlapping)
        self.prefetch_records = bool(prefetch_records) and pdl_supported(dev) and lanes.overlap
        if "attn.wo_a.scale" in w:
            self.wo_a_w, self.wo_a_s = w["attn.wo_a.weight"], w["attn.wo_a.scale"]
        elif wo_a_fp8:
            self.wo_a_w, self.wo_a_s = quantize_wo_a(w["attn.wo_a.weight"])
        else:
            self.wo_a_w, self.wo_a_s = w["attn.wo_a.weight"].to(torch.bfloat16), None
        few = {"split": 1} if _few_programs(dev) else {}
        # an FP8 wo_a takes the folded Gluon consumer where its scale bytes allow the exact fold (any
        # weight quantize_wo_a gives; checked once here), else the Triton plan
        self.wo_a_plan = wo_a_plan(cfg.n_heads, cfg.o_groups, cfg.o_lora_rank, max_rows, self.wo_a_w.dtype, dev,
                                   head_dim=cfg.head_dim, rope_dim=cfg.rope_head_dim, workspace=pool,
                                   fp32_dots=fp32_dots, gluon_fp8=foldable_scale(self.wo_a_s))
        topk_w = 0 if spec.kind == SWA else cfg.index_topk
        # The Gluon kernel on sm_90, else the Triton tilings; FP32 dots with fp32_dots (`sparse_mla_plans`)
        self.mla_plans = sparse_mla_plans(max_rows, cfg.n_heads, cfg.window_size, topk_w, dev, workspace=pool,
                                          fp32_dots=fp32_dots)
        # wo_a_gate: the gate between the Gluon sparse MLA and the Gluon wo_a launched by PDL after it
        # (`WO_A_GATE`; a schedule choice: the same bits; `_attend`, `_output`), where the layer can
        # take one (`gate_capable`: both kernels Gluon, wo_a by PDL), in the launches of
        # `wo_a_gate_rows` rows (`gates`), which run `wo_a_gated_plan`: `wo_a_plan` (its workspace,
        # counters and gate) with the prefill of `WO_A_GATE_PREFILL` slots
        self.gate_capable = self.wo_a_pdl and isinstance(self.wo_a_plan, GluonWoAPlan) and all(
            isinstance(p, GluonSparseMlaPlan) for p in self.mla_plans)
        self.wo_a_gate = WO_A_GATE if self.gate_capable else None
        self.wo_a_gate_rows = WO_A_GATE_ROWS
        self.wo_a_gated_plan = self.wo_a_plan.with_prefill(WO_A_GATE_PREFILL) if self.gate_capable else None
        wide = {"split": 1, "block_n": 256} if few else {}
        self.sink = w["attn.attn_sink"].float().contiguous()
        self.publish: torch.Tensor | None = None   # set by DecodeStep with the fused TP boundary
        # a selection [rows, index_topk] int32 that replaces this layer's own top-k in an eager run
        # (the trace verifier's teacher forcing at a tie, testing.trace_step); None in a step
        self.forced_topk: torch.Tensor | None = None
        self.comp_tail_fused = False
        self.index_row_group = index_row_group      # the dense scorer's row_group (`index_scores_launch`)
        self.comp_tail_plan: CompressorTailPlan | None = None
        if spec.owns_compressor:
            if spec.ratio == 2:
                self.w_comp = torch.cat([w["attn.compressor.wkv.weight"], w["attn.compressor.wgate.weight"]]).float()
            else:
                self.w_comp = w["attn.compressor.wkv.weight"]
            self.comp_plan = LlBf16Plan.build(self.w_comp.shape[0], cfg.dim, max_rows, self.w_comp.dtype, dev, **wide)
            self.w_wk = w["attn.indexer.wk.weight"]
            self.wk_plan = LlBf16Plan.build(cfg.index_head_dim, cfg.head_dim, max_rows, self.w_wk.dtype, dev, **wide)
            # comp_tail: the latent's norm, wk and the two records in one launch (`ops.compressor_tail`)
            # where that gives the three launches' bits (a BF16 wk whose plan sums K in one chain);
            # its plan (a counter per row) is built wherever it fits, so a schedule probe may switch
            # the flag on a built step
            if plan_misfit(self.wk_plan) is None:
                self.comp_tail_plan = CompressorTailPlan.build(self.wk_plan)
            self.comp_tail_fused = bool(comp_tail) and self.comp_tail_plan is not None
        self.selection: IndexSelection | None = None          # this layer's, when it runs the indexer
        self.candidate_mask: torch.Tensor | None = None      # this layer's, when it is the candidate source
        # Under TP a Full layer's dense indexer may run row-sharded (`run(shard=True)`): each rank
        # scores its `TensorParallel.row_share` of the rows into the `*_part` buffers and
        # `gather_row_shares` places every rank's share in the selection (and candidate pool),
        # which then hold tp * ceil(max_rows / tp) rows (the last rank's share padded).
        tp = layer.tp.tp
        self.row_shardable = tp > 1 and spec.kind == FULL
        sel_rows = tp * -(-max_rows // tp) if self.row_shardable else max_rows
        if spec.runs_indexer:
            self.mm_idx_wq_b = _fp8_plan(w, "indexer.wq_b", max_rows, exact_linears, fuse_scales=fuse_scales,
                                         pair_slots=pair_slots)
            # fold_index_chain: the index query's RoPE + MXFP4 in the indexer wq_b's epilogue and its
            # head weights in weights_proj's (the Gluon and Triton tiers; the exact linears keep
            # `index_query_` after both), the sparse-index table in the top-k's last launch; the
            # same bits either way
            self.fold_index_chain = bool(fold_index_chain)
            self.index_query_in_gemm = self.fold_index_chain and isinstance(self.mm_idx_wq_b, (GluonMM, LowLatencyMM))
            self.index_scale = cfg.index_head_dim ** -0.5 * cfg.index_n_heads ** -0.5
            self.w_proj = w["attn.indexer.weights_proj.weight"]
            self.proj_plan = LlBf16Plan.build(cfg.index_n_heads, cfg.dim, max_rows, self.w_proj.dtype, dev, **wide)
            self.topk_plan = TopKPlan.build(max_rows, cfg.index_topk, 1, dev)
            self.selection = IndexSelection.empty(sel_rows, cfg.index_topk, dev)
            if spec.candidate_role == "source":
                self.cand_plan = TopKPlan.build(max_rows, cfg.candidate_topk_blocks, cfg.candidate_block_size,
                                                dev, chunk=512)
                self.candidate_mask = torch.zeros(sel_rows, self.s.scores.shape[1], dtype=torch.uint8, device=dev)
            if self.row_shardable:
                share = -(-max_rows // tp)
                self.topk_part = torch.full((share, cfg.index_topk), -1, dtype=torch.int32, device=dev)
                if self.candidate_mask is not None:
                    self.cand_part = torch.zeros(share, self.candidate_mask.shape[1], dtype=torch.uint8, device=dev)
        # the selection this layer's sparse MLA reads (its index source's) and, for a candidate
        # consumer, the candidate pool its indexer scores (its KV source's)
        self.source_selection = self._source(sources, spec.index_source, "selection")
        self.source_candidates = (self._source(sources, spec.kv_source, "candidate_mask")
                                  if spec.candidate_role == "consumer" else None)

    def _source(self, sources, layer: int | None, name: str):
        if layer is None:
            return None
        if layer == self.spec.layer:
            return getattr(self, name)
        found = getattr((sources or {}).get(layer), name, None)
        if found is None:
            raise NotEligible(f"layer {self.spec.layer} reads the {name} of layer {layer}, which is not "
                              f"among the step's layers built before it")
        return found

    # ------------------------------------------------------------------ the schedule
    def takes_wq_b_pdl(self, rows: int) -> bool:
        """Whether a call of `rows` rows launches wq_b by PDL after the q/kv norm pair (`wq_b_pdl`, at
        most WQ_B_PDL_MAX_ROWS rows), which then releases it at its start."""
        return self.wq_b_pdl and rows <= WQ_B_PDL_MAX_ROWS

    def table_in_topk(self) -> bool:
        """Whether the top-k's last launch writes the layer's sparse-index table (fold_index_chain
        without a forced selection), else the table is a launch of its own after it (`_tables`)."""
        return self.fold_index_chain and self.forced_topk is None

    def takes_mla_pdl(self, rows: int) -> bool:
        """Whether a call of `rows` rows launches the Gluon sparse MLA by PDL right after the layer's
        own sparse-index table (`mla_pdl`: a layer that runs its indexer, the table in its own launch,
        not `table_in_topk`), which then releases it at its start."""
        return (self.mla_pdl and self.spec.runs_indexer and not self.table_in_topk()
                and isinstance(self._mla_plan(rows), GluonSparseMlaPlan))

    def takes_qkv_pdl(self, rows: int) -> bool:
        """Whether a call of `rows` rows launches the fused wq_a|wkv by PDL after the mHC boundary's
        launch (`qkv_pdl`, at most QKV_PDL_MAX_ROWS rows), which then releases it at its start."""
        return self.qkv_pdl and rows <= QKV_PDL_MAX_ROWS

    def takes_prefetch(self, rows: int) -> bool:
        """Whether a call of `rows` rows asks L2 for its sparse MLA's records at its start
        (`prefetch_records`, at most PREFETCH_RECORDS_MAX_ROWS rows)."""
        return self.prefetch_records and rows <= PREFETCH_RECORDS_MAX_ROWS

    def takes_boundary(self, rows: int) -> bool:
        """Whether `run(rows, ..., boundary=)` can run the mHC boundary in wo_b's epilogue: one rank
        (no TP reduction between wo_b and the boundary) and wo_b's op for `rows` rows is `ExactMM`
        (`ExactLinear.takes_boundary`)."""
        return (self.layer.tp.tp == 1 and self.publish is None and isinstance(self.mm_wo_b, ExactLinear)
                and self.mm_wo_b.takes_boundary(rows))

    def run(self, rows: int, u: torch.Tensor, u_codes: torch.Tensor, u_scales: torch.Tensor,
            y: torch.Tensor, events: StepEvents, shard: bool = False, boundary: BoundaryOperands | None = None,
            mixed: Event | None = None, after_inputs: Callable[[], None] | None = None) -> None:
        """Enqueue the layer for rows [0, rows): inputs u [rows, dim] BF16 and its MXFP8 codes/scales
        (written by the boundary), output y [rows, dim] BF16 (this rank's partial, reduced here
        under the collective TP boundary). events: the step's cross-layer events, read and updated.
        shard: under TP, a Full layer's dense indexer scores only this rank's share of the rows
        (index query, scores, top-k, candidate pool) and gathers every rank's share of the top-k
        and candidate pool before the sparse-index table (`_select_shared`); the same bits as the
        replicated indexer, whose kernels are batch-invariant per row. Ignored by other layers and
        at TP1; every rank must pass the same value (the gather is a collective).
        boundary: the mHC boundary after this layer, run in wo_b's epilogue (`takes_boundary(rows)`
        must hold; `Boundary.operands`: it overwrites u, codes and scales with the next layer's
        input once this layer no longer reads them); mixed: with boundary, the event of the mixer
        that wrote its post/comb/pre (waited for before wo_b; None: already ordered); unused
        without it. after_inputs: called once the input projections are enqueued (the step's late
        mixer, `DecodeStep.mix_late_rows`).

        Phases (design section 2), each enqueued in order on the main stream with its side work on
        the lanes: `_inputs` (the fused wq_a|wkv GEMM and the norms; the side projections),
        `_prepare` (index query, compressor and index key, the query with its RoPE),
        `_select` (index scores, top-k, candidate pool, sparse-index table), `_attend` (sparse MLA),
        `_output` (wo_a with the staged window copy, wo_b).
        """
        if self.takes_prefetch(rows):
            self._prefetch(rows, events)
        part = self.layer.tp.row_share(rows) if shard and self.row_shardable else None
        own = slice(0, rows) if part is None else slice(part[0], part[1])   # the rows this rank indexes
        kv_score, qr_ready, proj_ready = self._inputs(rows, u, u_codes, u_scales, own)
        if after_inputs is not None:
            after_inputs()
        iq_ready = self._prepare(rows, kv_score, qr_ready, proj_ready, own)
        if self.spec.runs_indexer:
            if part is None:
                self._select(rows, iq_ready, events)
            else:
                self._select_shared(rows, part, iq_ready, events)
        o = self._attend(rows)
        self._output(rows, o, y, boundary, mixed)

    def _prefetch(self, B: int, events: StepEvents) -> None:
        """Ask L2 for the records `_attend` will gather (`records_prefetch_l2_`, evict_last) on the
        weights lane, after the main stream's work so far: the window's and, in a layer that reads an
        earlier layer's selection, the selection's compressed records (after that selection's table;
        an indexer layer's own selection comes later: its window's only). Its event in
        `events.prefetch`, joined at the step's end (it writes nothing)."""
        spec, m, st, lanes = self.spec, self.meta, self.state, self.lanes
        comp = spec.kind == REUSE
        ready = lanes.mark()
        with lanes.side(AUX_INDEX_W):
            lanes.wait(ready)
            source = (st.compressed[spec.kv_source], self.source_selection.table[:B]) if comp else ()
            records_prefetch_l2_(st.window[spec.layer], m.window_table[:B], *source)
            events.prefetch = lanes.mark()

    def _inputs(self, B: int, u, u_codes, u_scales, own: slice):
        """The input projections: the fused wq_a|wkv GEMM and the q/kv norm on the main stream, the
        compressor's and the indexer's side projections on their lanes (the indexer's for the rows
        `own` only). The side projections wait only for u but are enqueued after the GEMM, so that
        the GEMM takes the SMs first (their large grids would otherwise hold it back: on an H200 a
        Full layer at 1 row took 122 us this way against 131). The indexer's head weights run on a
        lane of their own (`proj_own_lane`, at most WEIGHTS_LANE_MAX_ROWS rows; their event
        `proj_ready`, waited on the index query's lane in `_prepare`), else on the index query's
        lane, which reads them next. Returns (the compressor's kv_score or None, the event of qr,
        proj_ready or None)."""
        cfg, spec, s, lanes = self.cfg, self.spec, self.s, self.lanes
        start = lanes.mark()                                  # protects u (written by the boundary)
        qkv = self.mm_qkv(u_codes, u_scales, s.qkv_a[:B], **(dict(pdl=True) if self.takes_qkv_pdl(B) else {}))
        kv_score = proj_ready = None
        if spec.owns_compressor:
            with lanes.side(AUX_COMPRESSOR):
                lanes.wait(start)
                kv_score = s.kv_score[:B, :self.w_comp.shape[0]]
                ll_bf16_(self.comp_plan, u, self.w_comp, kv_score)
        own_lane = self.proj_own_lane and B <= WEIGHTS_LANE_MAX_ROWS
        if spec.runs_indexer:     # on the index query's lane, which reads it next, or on its own
            with lanes.side(AUX_INDEX_W if own_lane else AUX_INDEX_Q):
                lanes.wait(start)
                if own.stop > own.start and self.index_query_in_gemm:     # the head weights w
                    ll_bf16_(self.proj_plan, u[own], self.w_proj, s.iw[own], scale=self.index_scale)
                elif own.stop > own.start:
                    ll_bf16_(self.proj_plan, u[own], self.w_proj, s.wproj[own])
                if own_lane:
                    proj_ready = lanes.mark()                 # protects wproj / iw (read on lane 2)
        ql = cfg.q_lora_rank
        m, r = self.meta, spec.ratio     # one launch: q_norm (+ MXFP8), kv_norm + the window insert
        rms_norm_pair_(qkv[:, :ql], self.w["attn.q_norm.weight"], s.qr[:B], s.qr_codes[:B], s.qr_scales[:B],
                       qkv[:, ql:], self.w["attn.kv_norm.weight"], s.kv[:B], cfg.norm_eps,
                       window=self.state.window[spec.layer], slots=m.stage_slot[:B], cos=m.cos[r][:B], sin=m.sin[r][:B],
                       release=self.takes_wq_b_pdl(B), pdl=self.norm_pdl)
        return kv_score, lanes.mark(), proj_ready             # the second event protects qr codes

    def _prepare(self, B: int, kv_score, qr_ready, proj_ready, own: slice):
        """The index query of the rows `own` (lane 2), the compressor's state update, latent and
        index key (lane 0; the latent's norm, wk and the records in one launch with
        `comp_tail_fused`), the query (wq_b) and its RoPE, in wq_b's epilogue or after it (main); the main
        stream then waits for the compressed and index-key records; the index query's lane waits for
        proj_ready (the head weights' lane, from `_inputs`). Returns the event of the index query
        (None without)."""
        cfg, spec, s, m, lanes = self.cfg, self.spec, self.s, self.meta, self.lanes
        st, L, r = self.state, spec.layer, spec.ratio
        iq_ready = latent_ready = None
        if spec.runs_indexer:
            with lanes.side(AUX_INDEX_Q):
                lanes.wait(qr_ready)
                n_own = own.stop - own.start
                if n_own and self.index_query_in_gemm:              # iq from the GEMM's epilogue
                    self.mm_idx_wq_b(s.qr_codes[own], s.qr_scales[own], s.iq[own].view(n_own, -1),
                                     index_query=(m.cos[r][own], m.sin[r][own]))
                elif n_own:
                    self.mm_idx_wq_b(s.qr_codes[own], s.qr_scales[own], s.iq_raw[own])
                # the head weights' lane (`proj_own_lane`): wproj read next, or iw protected by
                # iq_ready; waited also without rows, so that the lane is always joined
                lanes.wait(proj_ready)
                if n_own and not self.index_query_in_gemm:
                    index_query_(s.iq_raw[own], s.wproj[own], m.cos[r][own], m.sin[r][own], self.index_scale,
                                 s.iq[own], s.iw[own])
                iq_ready = lanes.mark()                       # protects iq, iw
        if spec.owns_compressor:
            with lanes.side(AUX_COMPRESSOR):
                if r == 2:
                    # with drafts, the open group comes from comp_rows (what a deferred accept leaves)
                    compress_ratio2_(kv_score, m.record[0, :B], m.record[1, :B], st.comp_kv[L],
                                     st.comp_score[L], s.c[:B], s.done[:B], st.comp_rows.get(L),
                                     restore=L in st.comp_rows)
                    c = s.c[:B]
                else:
                    c = kv_score
                lat, norm_w = s.lat[:B], self.w["attn.compressor.norm.weight"]
                k_norm = self.w["attn.indexer.k_norm.weight"]
                cos, sin, slots = m.group_cos[r][:B], m.group_sin[r][:B], m.entry_slot[r][:B]
                if self.comp_tail_fused:     # latent (reference latent()), wk, records: one launch
                    compressor_tail_(c, norm_w, cfg.norm_eps, lat, self.comp_tail_plan, self.w_wk, s.wk_out[:B], k_norm,
                                     cos, sin, slots, st.compressed[L], st.index_keys[L])
                else:
                    rms_norm_(c, norm_w, cfg.norm_eps, lat)   # reference latent()
                    ll_bf16_(self.wk_plan, lat, self.w_wk, s.wk_out[:B])
                    compressed_entry_store_(lat, s.wk_out[:B], k_norm, cos, sin, slots, st.compressed[L],
                                            st.index_keys[L], cfg.norm_eps)
                latent_ready = lanes.mark()                   # protects compressed + index-key records
        q = s.q[:B]
        if self.takes_wq_b_pdl(B):  # by PDL after the norm pair (an exact wq_b: the RoPE in its epilogue)
            self.mm_wq_b(s.qr_codes[:B], s.qr_scales[:B], q.view(B, -1), rope=(m.cos[r][:B], m.sin[r][:B]), pdl=True)
        elif self.rope_in_wq_b:     # the query RoPE in wq_b's epilogue (the window insert ran in the norm pair)
            self.mm_wq_b(s.qr_codes[:B], s.qr_scales[:B], q.view(B, -1), rope=(m.cos[r][:B], m.sin[r][:B]))
        else:
            self.mm_wq_b(s.qr_codes[:B], s.qr_scales[:B], q.view(B, -1))
            query_rope_(q, m.cos[r][:B], m.sin[r][:B])
        lanes.wait(latent_ready)
        return iq_ready

    def _select(self, B: int, iq_ready, events: StepEvents) -> None:
        """The indexer (main): scores over the visible entries (or the candidate pool), top-k (with
        fold_index_chain and no forced selection, the sparse-index table in its last launch, else
        after it on the main stream); the candidate pool (lane 1, a candidate source) follows on the side;
        the events in `events`."""
        spec, s, m, lanes = self.spec, self.s, self.meta, self.lanes
        st, r = self.state, spec.ratio
        lanes.wait(iq_ready, events.candidates)               # the expansion still reads the scores
        events.candidates = None
        sel = self.selection
        n_vis = m.n_vis[r][:B]
        width = -(-st.max_context // r)
        scores = s.scores[:B, :width]
        cand = self.source_candidates[:B, :width] if self.source_candidates is not None else None
        ready = index_scores_launch(s.iq[:B], s.iw[:B], st.index_keys[spec.kv_source], st.block_table[r],
                                    st.page_size, m.kernel_slot[:B], n_vis, scores, cand,
                                    hist=self.topk_plan.hist_hi[:B], row_group=self.index_row_group)
        if self.table_in_topk():
            topk_ascending_(scores, n_vis, sel.topk[:B], self.topk_plan, hist_ready=ready,
                            table=(m.kernel_slot[:B], st.block_table[r], st.page_size, sel.table[:B],
                                   sel.lengths[:B]))
        else:
            topk_launch(scores, n_vis, sel.topk[:B], self.topk_plan, ready)
            if self.forced_topk is not None:
                sel.topk[:B].copy_(self.forced_topk[:B])
        if spec.candidate_role == "source":
            scored = lanes.mark()                             # protects scores (read by the expansion)
            with lanes.side(AUX_MIXER):
                lanes.wait(scored)
                candidate_mask_(scores, n_vis, self.candidate_mask[:B, :width], self.cand_plan)
                events.candidates = lanes.mark()              # protects the candidate mask, frees scores
        if not self.table_in_topk():
            self._tables(B)

    def _select_shared(self, B: int, part: tuple[int, int, int], iq_ready, events: StepEvents) -> None:
        """The row-sharded dense indexer (main): scores, top-k and (a candidate source) candidate
        pool of this rank's rows [lo, hi) into the `*_part` buffers, then every rank's share
        gathered into the selection and the candidate pool (`TensorParallel.gather_row_shares`;
        rows [B, tp * chunk) are padding), and the sparse-index table of every row (main stream)."""
        spec, s, m, st = self.spec, self.s, self.meta, self.state
        lo, hi, chunk = part
        tp, r = self.layer.tp, spec.ratio
        self.lanes.wait(iq_ready, events.candidates)          # the expansion still reads the scores
        events.candidates = None
        width = -(-st.max_context // r)
        if hi > lo:
            n_vis = m.n_vis[r][lo:hi]
            scores = s.scores[lo:hi, :width]
            ready = index_scores_launch(s.iq[lo:hi], s.iw[lo:hi], st.index_keys[spec.kv_source],
                                        st.block_table[r], st.page_size, m.kernel_slot[lo:hi], n_vis, scores,
                                        hist=self.topk_plan.hist_hi[:hi - lo])
            topk_ascending_(scores, n_vis, self.topk_part[:hi - lo], self.topk_plan, hist_ready=ready)
            if spec.candidate_role == "source":
                candidate_mask_(scores, n_vis, self.cand_part[:hi - lo, :width], self.cand_plan)
        sel = self.selection
        tp.gather_row_shares(self.topk_part[:chunk], sel.topk)
        if self.forced_topk is not None:
            sel.topk[:B].copy_(self.forced_topk[:B])
        if spec.candidate_role == "source":
            tp.gather_row_shares(self.cand_part[:chunk], self.candidate_mask)
        self._tables(B)

    def _tables(self, B: int) -> None:
        """The sparse-index table of the selection's rows [0, B) on the main stream, after the top-k
        and before the sparse MLA that reads it (no lane to join on the critical path; a later
        layer's side-lane reader, the records prefetch, starts after the main stream's work so far);
        it releases the MLA launched by PDL right after it where the layer takes that
        (`takes_mla_pdl`)."""
        m, st, r, sel = self.meta, self.state, self.spec.ratio, self.selection
        topk_slots_(sel.topk[:B], m.kernel_slot[:B], st.block_table[r], st.page_size, sel.table[:B], sel.lengths[:B],
                    release=self.takes_mla_pdl(B))

    def _attend(self, B: int) -> torch.Tensor:
        """Sparse MLA over the window and the index source's selection; returns o [B, heads, 512].
        Every sparse-index table is built on the main stream (`_tables`, or the top-k's last launch),
        so stream order puts the source's table before this launch. Where the layer takes
        `takes_mla_pdl`, launched by PDL right after the layer's own table."""
        cfg, spec, s, m, st = self.cfg, self.spec, self.s, self.meta, self.state
        if spec.kind == SWA:
            comp_pool, comp_table = s.empty_comp, s.empty_table[:B]
        else:
            comp_pool, comp_table = st.compressed[spec.kv_source], self.source_selection.table[:B]
        o = s.o[:B]
        plan = self._mla_plan(B)
        pdl = dict(release=True) if self.wo_a_pdl and isinstance(plan, GluonSparseMlaPlan) else {}
        if self.gates(B):
            pdl.update(signal=self.wo_a_plan.gate, signal_after=self.wo_a_gate)
        if self.takes_mla_pdl(B):
            pdl.update(pdl=True)
        sparse_mla_launch(plan, s.q[:B], st.window[spec.layer], comp_pool, m.window_table[:B], comp_table, self.sink,
                          cfg.softmax_scale, o, **pdl)
        return o

    def gates(self, B: int) -> bool:
        """Whether a B-row launch runs the gate between the sparse MLA and `wo_a` (`wo_a_gate`, in
        the launches of `wo_a_gate_rows` rows)."""
        lo, hi = self.wo_a_gate_rows
        return self.wo_a_gate is not None and lo <= B <= hi

    def _mla_plan(self, B: int):
        """The sparse MLA's plan of a B-row launch: the first of `mla_plans` that holds B rows."""
        return next(p for p in self.mla_plans if B <= p.max_rows)

    def _output(self, B: int, o: torch.Tensor, y: torch.Tensor, boundary: BoundaryOperands | None = None,
                mixed: Event | None = None) -> None:
        """Inverse RoPE + grouped wo_a (which also moves the staged window records into their ring
        slots, after the sparse MLA has read the ring, and quantizes z to MXFP8), then wo_b (with
        `boundary`, the mHC boundary in its epilogue)."""
        s, m, r = self.s, self.meta, self.spec.ratio
        copy = (self.state.window[self.spec.layer], m.stage_src, m.ring_dst)
        gluon = isinstance(self.wo_a_plan, GluonWoAPlan)
        wo_b_pdl = self.wo_b_pdl and gluon and boundary is None and self.publish is None and self.layer.tp.tp == 1
        pdl = dict(pdl=self.wo_a_pdl, release=wo_b_pdl) if gluon else {}
        plan = self.wo_a_plan
        if self.gates(B):
            plan = self.wo_a_gated_plan
            pdl["gate"] = self._mla_plan(B).programs(B)     # the MLA's signals: one a program
        wo_a_launch(plan, o, m.cos[r][:B], m.sin[r][:B], self.wo_a_w, self.wo_a_s, s.z[:B],
                    s.z_codes[:B], s.z_scales[:B], window_copy=copy, **pdl)
        if boundary is not None:
            if not self.takes_boundary(B):
                raise ValueError(f"boundary: layer {self.spec.layer}'s wo_b at {B} rows has no boundary epilogue")
            self.lanes.wait(mixed)                            # post/comb/pre of this site, read by the epilogue
            self.mm_wo_b(s.z_codes[:B], s.z_scales[:B], y, boundary=boundary)
        elif self.publish is not None:
            # the fused boundary: the FP32 partial goes straight into this rank's mailbox slot
            self.mm_wo_b(s.z_codes[:B], s.z_scales[:B], self.publish[:B])
        elif self.layer.tp.tp > 1:
            # the collective fallback boundary: each rank's FP32 partial, reduced in rank order
            # (identical bits on every rank), rounded once (parallel.TensorParallel)
            self.mm_wo_b(s.z_codes[:B], s.z_scales[:B], s.y_partial[:B])
            y.copy_(self.layer.tp.reduce_partials(s.y_partial[:B]))
        else:
            self.mm_wo_b(s.z_codes[:B], s.z_scales[:B], y, **(dict(pdl=True) if wo_b_pdl else {}))

    # attributes that hold what the step or the stack shares between layers (not this layer's own)
    _SHARED = frozenset(("state", "meta", "s", "lanes", "selection", "candidate_mask", "source_selection",
                         "source_candidates", "layer", "w", "cfg", "spec", "publish", "forced_topk"))

    def memory_bytes(self) -> int:
        """Device bytes this layer's step owns: its copies of weights (the fused wq_a|wkv, the FP32
        compressor weights at ratio 2, a converted or quantized wo_a, the FP32 sink) and its
        kernels' own plan workspaces (split-K partials and counters), plans within plans included. Not the stack's weights (storages of
        `layer.w`), the state, or what the step shares between layers (scratch, tables, selections,
        and the workspaces its main-stream plans take from `scratch.workspaces`)."""
        found = []

        def visit(item) -> None:
            found.append(item)
            if type(item).__module__.startswith("dsv41_decode.ops") and hasattr(item, "__dict__"):
                for v in vars(item).values():   # a plan: its workspace, counters, tables, inner plans
                    visit(v)
        for name, v in vars(self).items():
            if name in self._SHARED:
                continue
            for item in (v if isinstance(v, (list, tuple)) else (v,)):
                visit(item)
        theirs = {t.untyped_storage().data_ptr() for t in self.w.values()} | self.s.workspaces.storages()
        return storage_bytes([t for t in found if isinstance(t, torch.Tensor)], theirs)
