"""The step's contract-exact FP8 linear: `ExactLinear` runs each call on whichever exact op measured
faster at its row count: `ops.exact_mm.ExactMM` (CUDA cores, every device and the interpreter) or,
on an sm_90 GPU, `ops.gluon_exact_fma.GluonExactFMA` (the FP64 CUDA cores from a TMA ring, 1-4
rows) or `ops.gluon_exact_mm.GluonExactMM` (the FP64 MMA, or FP16 MMAs on the codes' two digits,
from a TMA ring) or `ops.cuda_exact_mm.CudaExactMM` (FP16 MMAs on the digits in CUDA C++, at the
row counts `_CUDA_PLAN` lists, for calls without an epilogue). All give the bits of
`reference.linear.mxfp8_mm` (each 32-deep block sum exact, rounded once to FP32, scaled, added in K
order: docs/spec-decisions.md decision 1) in the same reduction order, so a row's result never
depends on which op ran or how many rows shared the call (batch invariance).

ExactMM's time grows with the rows (about 4 FP32 instructions per product, or one DFMA with
`ExactConfig.f64`), GluonExactMM's stays near its FP64 MMA's (at least 8 x rows per MMA) up to 8
rows, GluonExactFMA's (one DFMA per code and row) grows with the rows from a lower start on the
widest shape: GluonExactFMA runs 1-2 rows of `wq_b` (`_FMA_PLAN`); ExactMM 1-2 rows of the fused
wq_a|wkv, the indexer's wq_b and wo_b (`exact_mm_plan._TUNED`: FP64 block sums at 1 row of the fused
wq_a|wkv and 1-2 of wo_b); GluonExactMM above (`_GLUON_PLAN`; all measured).
Each op takes the query RoPE epilogue (`rope=(cos, sin)`, the step's wq_b) with the same bits, so
the step rotates its queries in wq_b's launch whichever op runs it."""

from __future__ import annotations

import dataclasses

import torch

from .checks import require_bool, require_int
from .common import full_rate_fp64, is_sm90
from .cuda_build import CudaBuildError
from .cuda_exact_mm import MAX_ROWS as CUDA_MAX_ROWS, CudaExactMM
from .exact_mm import ExactMM, reduction_order
from .gluon_exact_fma import MAX_ROWS as FMA_MAX_ROWS, GluonExactFMA, GluonExactFMAConfig
from .gluon_exact_mm import GluonExactConfig, GluonExactMM
from .mhc import BoundaryOperands

MAX_ROWS = 64


_cfg = GluonExactConfig.from_spec
_fma_cfg = GluonExactFMAConfig.from_spec


# Per (N, K) of the step's FP8 linears at TP1 (V4.1-Flash): the most rows at which ExactMM is still
# faster, and GluonExactMM's configuration per row count above it (`{most rows: GluonExactConfig}`,
# in the probe's spec form). Measured on an H200 (scripts/probe_gluon_exact_mm.py; us per call,
# weights beyond L2; docs/results/gpu-tests-h200.txt): runs B1 and C2 of that file as of 8415a49
# (the FP64 forms), run C as of 55c49a1 (commit 9b9a03f: the FP16 digits, "f16d", at 4-64 rows) and
# its run G (commit c9bad52: the FP16 digits with four warps along K, 256-deep slots, at 4-32 rows
# of the shapes with few weight rows for their K), and that file's runs A, D and E (commits
# b2be577, 6cc6592, 177088a: the register cap and the tiles at 16-64 rows, the step's bench) and
# runs F, I, J (89300cd, 2a4cc76, 636b0b3: the digits' rounding in `chained_dot`): the
# fastest configuration per row count, and the
# threshold where ExactMM's time, linear in the rows between the measured counts, crosses
# GluonExactMM's. Shapes without an entry (the TP shards) run GluonExactMM in its default
# configuration above 4 rows where FP64 runs at full rate (else ExactMM at every row count).
# Every configuration gives the same bits.
_GLUON_PLAN: dict[tuple[int, int], tuple[int, dict[int, GluonExactConfig]]] = {
    # fused wq_a|wkv: the FP16 digits along K 11.3 us at 4-8 rows, 14.0 at 16, 21.0 at 32 against
    # the FP64 forms' 12.7 / 15.7 / 24.0; at 64 the FP16 digits 33.9 against 42.3 (run F); ExactMM
    # 15.9 at 4, 9.2-9.4 at 2 on its bucket-2 entry (runs AV and AX, weights from DRAM); with x's
    # scales decoded once a slot, at 17-32 rows on 16 x 16 tiles 18.4 against 32 x 8's 20.5 (run W);
    # at 33-64 rows with the fused scaling 33.23 against 34.78 (run DB at 5f33af4)
    (1792, 5120): (2, {16: _cfg("f16d:16:8:1:32:4:1:80:4:256"), 32: _cfg("f16d:16:16:1:32:4:1:80:4:256"),
                       64: _cfg("f16d:128:8:1:32:3:1:128:1:256:1:0")}),
    # wq_b: the FP16 digits (`chained_dot`) 18.9-19.0 at 4-8 rows and 26.4 at 16 on 128 x 16 tiles
    # (19.4 at 4-8 on 128 x 8 at a cap of 80), on wgmma ("f16wp", 64 x 32) 44.6 / 85.2 at 32 / 64
    # (mma.sync 49.4 / 94.8 on 64 x 32; 128 x 16 at a cap of 80 spills with `chained_dot`) against
    # the FP64 forms' 22.0, 34.4, 65.2, 126.3 (runs C, D, E, F and I; the step at 32 / 64 rows 10.40
    # / 17.54 ms against 10.41 / 17.60 on mma.sync, run J); "f16w" 64 x 32 at a register cap of 80
    # (three programs an SM, the consumer warpgroup at 136 registers without spills) 43.8 / 78.1 at
    # 32 / 64 against "f16wp"'s 44.7 / 84.5 (run R); with x's scales decoded once a slot 46.6 / 71.5,
    # no configuration faster at 17-64 rows, 26.1 on the plan's 128 x 16 at 16 (run V). ExactMM 16.1
    # at 1, 26.6 at 2 (23.6 at best with the weights from DRAM, run AV; 1-2 rows run GluonExactFMA:
    # _FMA_PLAN); at 17-32 rows "f16w" at a cap of 104 (two programs an SM) 43.58 alone against the
    # cap of 80's 46.64 (at 64 83.96 against 71.96; run DB at 5f33af4), but the step's 32-row bucket
    # with it and wo_b's 17-32-row pair below no faster (9118 / 9057 us against 9048 / 9050, run DE)
    (32768, 1280): (1, {16: _cfg("f16d:128:16:1:32:4:1"), 64: _cfg("f16w:64:32:1:32:4:1:80")}),
    # the indexer's wq_b: the FP16 digits along K 6.2 at 4-8, 7.9 at 16, 11.6 at 32 against the
    # FP64 forms' 6.5 / 8.6 / 11.6; at 64 16.0 against 21.2 (run F); ExactMM 8.8 at 4, 6.1-6.2 at
    # 2 on its bucket-2 entry (runs AV and AX)
    (4096, 1280): (2, {16: _cfg("f16d:16:16:1:32:4:1:80:4:256"), 32: _cfg("f16d:32:16:1:32:4:1:128:4"),
                       64: _cfg("f16d:128:16:1:32:4:1")}),
    # wo_b: the FP16 digits along K 27.2-27.7 at 4-8, 42.7 / 71.2 at 16 / 32 against the FP64 forms'
    # 29.7-29.9 / 46.1 / 80.4; at 64 in 256-deep slots 126.8 (run F; 136.3 in 128-deep ones before
    # `chained_dot`, run D) against the FP64 forms' 158.2; ExactMM 17.0 at 1, 27.3-27.6 at 2 at
    # best (runs AV and AX), with FP64 block sums 16.4-16.6 at 1 and 24.5-25.0 at 2 against
    # GluonExactFMA's K split 25.2-25.3 (runs BA and BC); at 33-64 rows
    # 32 x 16 tiles with four warps along K at a register cap of 80 (three programs an SM) 119.5
    # against 64 x 8's 127.0 at 64 rows (run T); the ring two slots a wait (`pair_slots`) 25.61 /
    # 26.49 at 4 / 8 rows against 26.42 / 27.18 (no gain at 16: 41.60 against 41.17), and 32 x 16
    # with the fused scaling and two slots a wait 64.72 / 106.41 at 32 / 64 against the plan's 66.36
    # / 111.16 (run CY at 623d897): taken at 3-8 and 33-64 rows (the step with them and the fused
    # wq_a|wkv's 33-64-row entry 4412 / 4398 us at 4 rows against 4418 / 4423, 14184 / 14174 at 64
    # against 14415 / 14418, run DE; at 17-32 rows, with wq_b's cap of 104, no faster, above)
    (5120, 8192): (2, {8: _cfg("f16d:16:16:1:32:4:1:80:4:256:0:1"), 32: _cfg("f16d:16:16:1:32:4:1:80:4:256"),
                       64: _cfg("f16d:32:16:1:32:4:1:80:4:128:1:1")}),
}
# Per (N, K): the row counts GluonExactFMA (FP64 CUDA cores) runs, ahead of both ops above, first
# to last, and its configuration (rows_per_thread:warps_k:lanes_k:stages[:maxnreg[:split]]).
# Measured on an H200 (scripts/probe_gluon_exact_fma.py, docs/results/gpu-tests-h200.txt runs F
# and H at commit 8415a49, K at c2f8a73): wq_b 14.9 / 18.4 us at 1 / 2 rows against ExactMM's 16.1 and
# GluonExactMM's 22.2 (ExactMM with FP64 block sums 15.8 / 21.6 at best, run BA: the ring's TMA
# streams the weight faster than ExactMM's cp.async steps); wo_b at 2 rows with the K split over 6
# programs 25.2-25.3 against ExactMM's 24.5-25.0 with FP64 block sums (runs BA and BC; at 1 row
# every candidate 20.0 us or more against ExactMM's 16.8, run AV), so ExactMM runs wo_b; at the
# fused wq_a|wkv and the indexer's wq_b ExactMM or GluonExactMM is as fast or faster at every row
# count (fused 9.6 / 11.1 at 1 / 2 rows with the split against ExactMM's 6.5 / 11.1 on the rule's
# configuration, 9.2 on the bucket-2 entry of exact_mm_plan._TUNED, run AX; the indexer's 6.6 against 4.6).
# wq_b's register cap of 96 (two programs an SM, as at 128, with a quarter of the SM's registers
# left to the kernels beside them; sm_90: no spills, the consumer's loop at most 2.3 % longer than
# at 128): the step 0.22 / 0.82 % faster at 1 / 2 rows, the same at 8 (H100, scripts/ab_step.py,
# three processes a side, medians 3684.3 / 4295.5 us against 3692.4 / 4330.9 at bd26461, run FH).
_FMA_PLAN: dict[tuple[int, int], tuple[int, int, GluonExactFMAConfig]] = {
    (32768, 1280): (1, 2, _fma_cfg("2:2:1:4:96")),
}
_DEFAULT_ABOVE = 4
# Per (N, K): the (first, last) row counts at which `CudaExactMM` (the FP16 digits in CUDA C++) runs
# the calls without the RoPE epilogue or the mHC boundary, on sm_90 where it builds (nvcc present);
# none until measured faster in the step (scripts/probe_cuda_exact_mm.py, scripts/ab_step.py).
_CUDA_PLAN: dict[tuple[int, int], tuple[int, int]] = {}


def takes_pair_slots(config: GluonExactConfig, k: int) -> bool:
    """Whether `ExactLinear(pair_slots=True)` gives `config` `GluonExactConfig.pair_slots` at depth K
    = k: the warps along K (the plan's configurations along the weight rows spill with it: `wq_b`'s
    128 x 16 40 bytes at its cap of 128), no K split, an even number of stages, K a multiple of two
    slots."""
    if config.warps_k == 1 or k % (2 * config.block_k):
        return False
    try:                    # the rest is the configuration's own rule (`GluonExactConfig.__post_init__`)
        dataclasses.replace(config, pair_slots=True)
    except ValueError:
        return False
    return True


class ExactLinear:
    """The contract-exact MXFP8 linear for 1..max_rows rows, whichever exact op is faster per call:
    on an sm_90 GPU where the Gluon tier builds (K a multiple of 128, 16-byte aligned rows),
    `GluonExactFMA` up to the row count `_FMA_PLAN` lists for the shape, then `ExactMM` (CUDA cores)
    up to the row count `_GLUON_PLAN` lists, and `GluonExactMM` above it in the configurations
    listed there; elsewhere ExactMM. All give the reference's bits, so a row's result does not
    depend on which runs (batch invariance). Arguments, errors and the call: `ExactMM`'s
    (exact_config its config; workspace its workspace, which GluonExactMM shares: the ops never
    run at once). mma_above: override the threshold (None: `_GLUON_PLAN`'s, on sm_90 only; 0:
    GluonExactMM for every call that GluonExactFMA does not take; >= max_rows: never); fma_rows:
    override the most rows GluonExactFMA runs (None: `_FMA_PLAN`'s, on sm_90 parts whose FP64 runs
    at full rate only (`common.full_rate_fp64`), none for an unlisted shape; 0: never); where FP64
    runs slowly an unlisted shape's default mma_above is max_rows (GluonExactMM's default
    configuration is the FP64 MMA); both for tests and probes. `fma_rows` the attribute: the
    (first, last) row counts GluonExactFMA runs ((1, 0): none). fuse_scales: GluonExactMM's
    configurations with `GluonExactConfig.fuse_scales` (each block term and its add in one FMA
    where the scales allow it; the same bits). pair_slots: its configurations along K that can take
    it (`takes_pair_slots`) with `GluonExactConfig.pair_slots` (the ring's slots two at a time; the
    same bits). cuda_rows: override the (first, last) row counts at which `CudaExactMM` runs the
    calls without rope or boundary (None: `_CUDA_PLAN`'s, on sm_90 only; (1, 0): never), where it
    builds; `cuda_rows` the attribute: the range it runs ((1, 0): none)."""

    def __init__(self, weight: torch.Tensor, w_scale: torch.Tensor, max_rows: int = MAX_ROWS,
                 exact_config=None, workspace=None, mma_above: int | None = None,
                 fma_rows: int | None = None, fuse_scales: bool = False, pair_slots: bool = False,
                 cuda_rows: tuple[int, int] | None = None):
        for name, v in (("mma_above", mma_above), ("fma_rows", fma_rows)):
            if v is not None:
                require_int(v, name, 0)
        require_bool(fuse_scales, "fuse_scales")
        require_bool(pair_slots, "pair_slots")
        self.cuda_cores = ExactMM(weight, w_scale, max_rows, exact_config, workspace)
        n, k = self.cuda_cores.n, self.cuda_cores.k
        self.n, self.k, self.max_rows, self.device = n, k, max_rows, weight.device
        listed = (n, k) in _GLUON_PLAN
        above, configs = _GLUON_PLAN.get((n, k), (_DEFAULT_ABOVE, None))
        self.fuse_scales, self.pair_slots = bool(fuse_scales), bool(pair_slots)
        if fuse_scales:
            configs = ({rows: dataclasses.replace(c, fuse_scales=True) for rows, c in configs.items()}
                       if listed else GluonExactConfig(fuse_scales=True))
        if pair_slots and listed:       # GluonExactMM's default (one warp along K) takes none
            configs = {rows: dataclasses.replace(c, pair_slots=True) if takes_pair_slots(c, k) else c
                       for rows, c in configs.items()}
        fma_lo, planned_fma_rows, fma_config = _FMA_PLAN.get((n, k), (1, 0, None))
        if is_sm90(weight.device):
            # The FP64 forms only where FP64 runs at full rate (`common.full_rate_fp64`): elsewhere
            # no GluonExactFMA, and a shape without a measured plan (the TP shards), whose
            # GluonExactMM default runs the FP64 MMA, keeps ExactMM at every row count.
            full_fp64 = full_rate_fp64(weight.device)
            planned_above = above if listed or full_fp64 else max_rows
            mma_above = planned_above if mma_above is None else mma_above
            fma_rows = (planned_fma_rows if full_fp64 else 0) if fma_rows is None else fma_rows
        self.mma = None
        if mma_above is not None and mma_above < max_rows:
            try:
                self.mma = GluonExactMM(weight, w_scale, max_rows, configs, workspace)
            except ValueError:      # a shape, alignment or device the Gluon tier does not take
                self.mma = None
        self.mma_above = mma_above if self.mma is not None else None
        self.fma = None
        rows = min(fma_rows or 0, max_rows, FMA_MAX_ROWS)
        if rows >= fma_lo:
            try:
                self.fma = GluonExactFMA(weight, w_scale, rows, fma_config, workspace)
            except ValueError:      # as above
                self.fma = None
        self.fma_rows = (fma_lo, self.fma.max_rows) if self.fma is not None else (1, 0)
        if cuda_rows is not None and (not isinstance(cuda_rows, tuple) or len(cuda_rows) != 2
                                      or not all(isinstance(r, int) and r >= 0 for r in cuda_rows)):
            raise ValueError(f"cuda_rows must be a (first, last) pair of row counts, got {cuda_rows!r}")
        cuda_lo, cuda_hi = (_CUDA_PLAN.get((n, k), (1, 0)) if is_sm90(weight.device) else (1, 0)) \
            if cuda_rows is None else cuda_rows
        cuda_hi = min(cuda_hi, max_rows, CUDA_MAX_ROWS)
        self.cuda = None
        if cuda_hi >= max(cuda_lo, 1):
            try:
                self.cuda = CudaExactMM(weight, w_scale, cuda_hi)
            except (ValueError, CudaBuildError):    # a shape, device or machine (no nvcc) it does not take
                self.cuda = None
        self.cuda_rows = (max(cuda_lo, 1), cuda_hi) if self.cuda is not None else (1, 0)

    def reduction_order(self, rows: int) -> tuple[str, int, int]:
        """`exact_mm.reduction_order(K)`: the same for every row count and every op."""
        return reduction_order(self.k)

    def op_for(self, rows: int, epilogue: bool = False):
        """The op that runs a call of `rows` rows (epilogue: with the RoPE epilogue or the mHC
        boundary, which `CudaExactMM` does not take)."""
        if not epilogue and self.cuda_rows[0] <= rows <= self.cuda_rows[1]:
            return self.cuda
        if self.fma is not None and self.fma_rows[0] <= rows <= self.fma_rows[1]:
            return self.fma
        return self.mma if self.mma is not None and rows > self.mma_above else self.cuda_cores

    def takes_boundary(self, rows: int) -> bool:
        """Whether a call of `rows` rows can take `boundary=`: its op is `ExactMM` (the others have
        no mHC boundary epilogue)."""
        return self.op_for(rows, True) is self.cuda_cores

    def __call__(self, codes: torch.Tensor, x_scale: torch.Tensor, out: torch.Tensor | None = None,
                 rope: tuple[torch.Tensor, torch.Tensor] | None = None,
                 boundary: BoundaryOperands | None = None, *, pdl: bool = False) -> torch.Tensor:
        """`ExactMM.__call__`'s arguments and result; rope=(cos, sin): the query RoPE of
        `kv_write.query_rope_` in the epilogue of whichever op runs (each op's own: the same bits as
        the call without it followed by that op); boundary: `ExactMM`'s mHC boundary epilogue, for
        a call whose op is ExactMM (`takes_boundary`; ValueError naming `boundary` otherwise);
        pdl: the op's launch by programmatic dependent launch (each op's `pdl`)."""
        if not isinstance(codes, torch.Tensor) or codes.dim() != 2:
            return self.cuda_cores(codes, x_scale, out, rope, boundary)     # its error names the argument
        op = self.op_for(codes.shape[0], rope is not None or boundary is not None)
        if op is self.cuda:
            return op(codes, x_scale, out)
        if boundary is None:
            return op(codes, x_scale, out, rope, pdl=pdl)
        if op is not self.cuda_cores:
            raise ValueError(f"boundary: a call of {codes.shape[0]} rows runs {type(op).__name__}, which has no "
                             f"mHC boundary epilogue (ExactLinear.takes_boundary)")
        return op(codes, x_scale, out, rope, boundary, pdl=pdl)
