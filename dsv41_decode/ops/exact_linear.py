"""The step's contract-exact FP8 linear: `ExactLinear` runs each call on whichever exact op measured
faster at its row count, `ops.exact_mm.ExactMM` (CUDA cores, every device and the interpreter) or,
on an sm_90 GPU, `ops.gluon_exact_mm.GluonExactMM` (the FP64 MMA from a TMA ring). Both give the
bits of `reference.linear.mxfp8_mm` (each 32-deep block sum exact, rounded once to FP32, scaled,
added in K order: docs/spec-decisions.md decision 1) in the same reduction order, so a row's
result never depends on which op ran or how many rows shared the call (batch invariance).

ExactMM's time grows with the rows (about 4 FP32 instructions per product), GluonExactMM's stays
near its FP64 MMA's (at least 8 x rows per MMA) up to 8 rows: ExactMM is faster at 1-6 rows on the
small shapes and at 1 row on `wq_b`, GluonExactMM above (`_GLUON_PLAN`, measured)."""

from __future__ import annotations

import torch

from .common import is_sm90
from .exact_mm import ExactMM, reduction_order
from .gluon_exact_mm import GluonExactConfig, GluonExactMM

MAX_ROWS = 64


def _cfg(convert: str, block_n: int, block_m: int, split: int = 1, maxnreg: int | None = 128) -> GluonExactConfig:
    return GluonExactConfig(convert=convert, block_n=block_n, block_m=block_m, split=split, maxnreg=maxnreg)


# Per (N, K) of the step's FP8 linears at TP1 (V4.1-Flash): the most rows at which ExactMM is still
# faster, and GluonExactMM's configuration per row count above it (`{most rows: GluonExactConfig}`).
# Measured on an H200 (scripts/probe_gluon_exact_mm.py --rows=1,2,4,8,16,32,64, commit b579125;
# docs/results/gpu-tests-h200.txt run B1; us per call, weights beyond L2): the fastest of 26
# configurations per row count; the threshold where ExactMM's time, linear in the rows between the
# measured counts, crosses GluonExactMM's. Shapes without an entry (the TP shards) run GluonExactMM
# in its default configuration above 4 rows. Every configuration gives the same bits.
_GLUON_PLAN: dict[tuple[int, int], tuple[int, dict[int, GluonExactConfig]]] = {
    # fused wq_a|wkv: GluonExactMM 24.3 / 34.8 / 34.8 / 51.0 us at 8 / 16 / 32 / 64 rows; ExactMM 16.1
    # at 4, 28.9 at 8 (GluonExactMM 22.9 at 4)
    (1792, 5120): (6, {8: _cfg("int", 64, 32, split=8), 32: _cfg("int", 64, 8, maxnreg=80),
                       64: _cfg("raw", 64, 8, maxnreg=80)}),
    # wq_b: 23.3 / 23.3 / 23.2 / 34.9 / 65.6 / 126.8 at 2 / 4 / 8 / 16 / 32 / 64; ExactMM 15.9 at 1, 26.9 at 2
    (32768, 1280): (1, {8: _cfg("raw", 128, 8, maxnreg=80), 16: _cfg("int+cvt", 128, 16),
                        64: _cfg("cvt", 64, 32)}),
    # the indexer's wq_b: 10.9 / 11.2 / 15.1 / 22.3 at 8 / 16 / 32 / 64 (10.9 at 1-4); ExactMM 8.8 at 4,
    # 15.2 at 8
    (4096, 1280): (5, {8: _cfg("int+cvt", 64, 32), 32: _cfg("int", 64, 8, maxnreg=80),
                       64: _cfg("raw", 128, 8, maxnreg=80)}),
    # wo_b: 53.0 / 53.0 / 74.3 / 102.1 / 171.2 at 4 / 8 / 16 / 32 / 64; ExactMM 30.3 at 2, 53.8 at 4
    (5120, 8192): (3, {8: _cfg("int+cvt", 64, 32), 16: _cfg("cvt", 64, 32), 32: _cfg("raw", 64, 8, maxnreg=80),
                       64: _cfg("raw+cvt", 128, 8, maxnreg=80)}),
}
_DEFAULT_ABOVE = 4


class ExactLinear:
    """The contract-exact MXFP8 linear for 1..max_rows rows, whichever exact op is faster per call:
    `ExactMM` (CUDA cores) up to the row count `_GLUON_PLAN` lists for the shape and, on an sm_90
    GPU where the Gluon tier builds (K a multiple of 128, 16-byte aligned rows), `GluonExactMM`
    above it in the configurations listed there. Both give the reference's bits, so a row's result
    does not depend on which runs (batch invariance). Arguments, errors and the call: `ExactMM`'s
    (exact_config its config; workspace its workspace, which GluonExactMM shares: the two never
    run at once). mma_above: override the threshold (None: `_GLUON_PLAN`'s, on sm_90 only; 0: the
    FP64 MMA for every call; >= max_rows: never), for tests and probes."""

    def __init__(self, weight: torch.Tensor, w_scale: torch.Tensor, max_rows: int = MAX_ROWS,
                 exact_config=None, workspace=None, mma_above: int | None = None):
        self.cuda_cores = ExactMM(weight, w_scale, max_rows, exact_config, workspace)
        n, k = self.cuda_cores.n, self.cuda_cores.k
        self.n, self.k, self.max_rows, self.device = n, k, max_rows, weight.device
        above, configs = _GLUON_PLAN.get((n, k), (_DEFAULT_ABOVE, None))
        if mma_above is None and is_sm90(weight.device):
            mma_above = above
        self.mma = None
        if mma_above is not None and mma_above < max_rows:
            try:
                self.mma = GluonExactMM(weight, w_scale, max_rows, configs, workspace)
            except ValueError:      # a shape, alignment or device the Gluon tier does not take
                self.mma = None
        self.mma_above = mma_above if self.mma is not None else None

    def reduction_order(self, rows: int) -> tuple[str, int, int]:
        """`exact_mm.reduction_order(K)`: the same for every row count and either op."""
        return reduction_order(self.k)

    def op_for(self, rows: int):
        """The op that runs a call of `rows` rows."""
        return self.mma if self.mma is not None and rows > self.mma_above else self.cuda_cores

    def __call__(self, codes: torch.Tensor, x_scale: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """`ExactMM.__call__`'s arguments and result."""
        if not isinstance(codes, torch.Tensor) or codes.dim() != 2:
            return self.cuda_cores(codes, x_scale, out)     # its error names the argument
        return self.op_for(codes.shape[0])(codes, x_scale, out)
