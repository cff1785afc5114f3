"""The step's contract-exact FP8 linear: `ExactLinear` runs each call on whichever exact op measured
faster at its row count, `ops.exact_mm.ExactMM` (CUDA cores, every device and the interpreter) or,
on an sm_90 GPU, `ops.gluon_exact_mm.GluonExactMM` (the FP64 MMA from a TMA ring). Both give the
bits of `reference.linear.mxfp8_mm` (each 32-deep block sum exact, rounded once to FP32, scaled,
added in K order: docs/spec-decisions.md decision 1) in the same reduction order, so a row's
result never depends on which op ran or how many rows shared the call (batch invariance).

ExactMM's time grows with the rows (about 4 FP32 instructions per product), GluonExactMM's stays
near its FP64 MMA's (at least 8 x rows per MMA) up to 8 rows: ExactMM is faster at 1-4 rows on the
fused wq_a|wkv, 1-2 on the indexer's wq_b and wo_b and 1 on `wq_b`, GluonExactMM above
(`_GLUON_PLAN`, measured)."""

from __future__ import annotations

import torch

from .common import is_sm90
from .exact_mm import ExactMM, reduction_order
from .gluon_exact_mm import GluonExactConfig, GluonExactMM

MAX_ROWS = 64


_cfg = GluonExactConfig.from_spec


# Per (N, K) of the step's FP8 linears at TP1 (V4.1-Flash): the most rows at which ExactMM is still
# faster, and GluonExactMM's configuration per row count above it (`{most rows: GluonExactConfig}`,
# in the probe's spec form). Measured on an H200 (scripts/probe_gluon_exact_mm.py
# --rows=1,2,4,8,16,32,64; docs/results/gpu-tests-h200.txt runs B1 (commit b579125: wq_b, 26
# configurations) and C2 (commit abd1e18: the other three, their best of B1 and 14 with the warps
# along K), us per call, weights beyond L2): the fastest configuration per row count, and the
# threshold where ExactMM's time, linear in the rows between the measured counts, crosses
# GluonExactMM's. Shapes without an entry (the TP shards) run GluonExactMM in its default
# configuration above 4 rows. Every configuration gives the same bits.
_GLUON_PLAN: dict[tuple[int, int], tuple[int, dict[int, GluonExactConfig]]] = {
    # fused wq_a|wkv: GluonExactMM 16.1-16.3 us at 1-8 rows, 19.0 / 24.1 / 42.3 at 16 / 32 / 64;
    # ExactMM 15.9 at 4, 29.0 at 8
    (1792, 5120): (4, {8: _cfg("int:16:64:1:32:4:1:128:4"), 16: _cfg("raw:16:8:1:32:8:2:80:4"),
                       32: _cfg("int+cvt:16:16:1:16:8:1:80:4"), 64: _cfg("int+cvt:32:16:1:16:6:1:128:4")}),
    # wq_b: 23.1-23.4 at 1-8, 35.1 / 66.0 / 127.5 at 16 / 32 / 64 (the warps along K no faster);
    # ExactMM 16.2 at 1, 26.5 at 2
    (32768, 1280): (1, {8: _cfg("raw:128:8:1:32:4:1:80"), 16: _cfg("int+cvt:128:16:1:32:4:1"),
                        64: _cfg("cvt:64:32:1:32:4:1")}),
    # the indexer's wq_b: 7.2 at 1-8, 9.1 / 13.6 / 21.5 at 16 / 32 / 64; ExactMM 6.3 at 2, 8.7 at 4
    (4096, 1280): (2, {8: _cfg("int:16:64:1:32:4:1:128:4"), 16: _cfg("int+cvt:16:16:1:16:8:1:80:4"),
                       32: _cfg("int+cvt:32:16:1:16:6:1:128:4"), 64: _cfg("raw:64:16:1:16:4:1:128:4")}),
    # wo_b: 36.0 at 1-8, 48.8 / 80.9 / 158.5 at 16 / 32 / 64; ExactMM 30.7 at 2, 54.3 at 4
    (5120, 8192): (2, {4: _cfg("raw:16:8:1:32:8:1:80:4"), 8: _cfg("int+cvt:16:8:1:16:8:1:80:4"),
                       64: _cfg("int+cvt:16:16:1:16:8:1:80:4")}),
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
