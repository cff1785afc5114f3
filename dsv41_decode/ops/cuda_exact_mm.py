"""`CudaExactMM`: the contract-exact low-batch MXFP8 linear (y[M, N] = MXFP8 activation x FP8 weight
with 32x32 UE8M0 block scales, bitwise `reference.linear.mxfp8_mm`) for 1-16 rows on FP16 tensor
cores over the codes' digits, in CUDA C++ (`ops/csrc/exact_digits_mm.cu`, built on first use by
`ops.cuda_build`).

The arithmetic is `GluonExactMM`'s FP16 digits with `chained_dot` (docs/gemm.md, "The FP16
digits"); what differs is the schedule, which Triton 3.6 cannot express: Gluon puts a CTA barrier
before every mbarrier wait and arrive of a partition of more than one warp, so its consumer warps
run slot by slot in lockstep (40-53 % of their stall cycles at those barriers). Here each compute
warp streams its own K stages by cp.async (32 x `blocks` K of its CTA's tile of weight rows and of every x
row a stage with their scale bytes, `stages` deep) and synchronizes with nothing but the CTA's
accumulating warp, which adds the block terms in K order through a ring of shared-memory slots with
per-slot mbarriers. A CTA owns a tile of 16 x `m_tiles` weight rows (16 the m16n8k16 MMA's M; x's rows
are its N, eight an n-tile), so the grid is one CTA a tile (fewer on a stream-K grid:
`CudaExactConfig.ctas_per_sm`) of
`warps` + 1 warps, each compute warp taking every `warps`-th stage of K (`blocks` 32-deep blocks
of each row a stage). Measured on an H100 on par with
`ExactLinear`'s ops at 16 rows of `wo_b` and slower at most shapes and row counts, bound by its
instructions a weight byte and an unbalanced grid (docs/gemm.md, "Exactness"), so no plan takes it.

Requirements (ValueError naming the argument): N a multiple of 16 (of the tile's rows for each
configuration), K of 128; weight and codes
rows contiguous and 16-byte aligned, scales rows 4-byte aligned; a CUDA device of compute
capability >= 8.9 (the E4M3 pair conversion) with nvcc to build the kernels (`cuda_build`).
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

import torch

from .checks import config_for_rows, mxfp8_linear_args, mxfp8_weight_args, row_configs
from .cuda_build import CSRC, CudaFunction, load_module
from .gluon_ring import require_tma_rows, scale_words

SOURCE = "exact_digits_mm.cu"
MAX_ROWS = 16
ROWS_PER_TILE = 8           # x rows per n-tile (the MMA's N)
CP_ASYNC = "the kernel's 16-byte cp.async copies"


@dataclass(frozen=True)
class CudaExactConfig:
    """warps: compute warps a CTA (each taking every warps-th K stage; the CTA has one more, the
    accumulating warp); stages: each compute warp's cp.async ring depth in K stages; blocks: 32-deep
    K blocks a stage (K must be a multiple of 32 x blocks); ctas_per_sm: 0 for one CTA a 16-row
    tile, else the grid min(tiles, ctas_per_sm x SMs) with the tiles' K stages split evenly over it
    (stream-K: a tile split between two CTAs hands its accumulator on in K order; the kernel's
    `StageRange`), which must not exceed the CTAs an SM holds; m_tiles: 16-row MMA tiles of weight
    rows a CTA's tile (each compute warp forms x's digits of a stage once for all of them; N must be
    a multiple of 16 x m_tiles)."""

    warps: int = 4
    stages: int = 4
    blocks: int = 4
    ctas_per_sm: int = 0
    m_tiles: int = 1

    def kernel(self, n_tiles: int) -> str:
        m = f"_m{self.m_tiles}" if self.m_tiles > 1 else ""
        return f"exact_digits_mm_nt{n_tiles}_p{self.warps}_s{self.stages}_g{self.blocks}{m}"

    @classmethod
    def from_spec(cls, spec: str) -> "CudaExactConfig":
        """The configuration a spec string names, p<warps>s<stages>g<blocks>[m<m_tiles>][k<ctas_per_sm>]
        (absent: m_tiles 1, ctas_per_sm 0), the form the probe (scripts/probe_cuda_exact_mm.py) prints."""
        parsed = re.fullmatch(r"p(\d+)s(\d+)g(\d+)(?:m(\d+))?(?:k(\d+))?", spec)
        if parsed is None:
            raise ValueError(f"a CudaExactConfig spec is p<warps>s<stages>g<blocks>[m<m_tiles>][k<ctas_per_sm>], "
                             f"got {spec!r}")
        p, s, g, mt, ctas = parsed.groups()
        return cls(int(p), int(s), int(g), int(ctas or 0), int(mt or 1))

    @property
    def spec(self) -> str:
        """The spec string `from_spec` reads back as this configuration (m and k written where not 1 / 0)."""
        return (f"p{self.warps}s{self.stages}g{self.blocks}" + (f"m{self.m_tiles}" if self.m_tiles > 1 else "")
                + (f"k{self.ctas_per_sm}" if self.ctas_per_sm else ""))

    @property
    def tile_rows(self) -> int:
        """Weight rows a CTA's tile."""
        return 16 * self.m_tiles


@functools.cache
def compiled_kernels() -> frozenset[tuple[int, int, int, int, int]]:
    """The (n_tiles, warps, stages, blocks, m_tiles) the source instantiates (its DSV41_EXACT_DIGITS_MM
    and DSV41_EXACT_DIGITS_MM_M lines)."""
    text = (CSRC / SOURCE).read_text()
    return frozenset((*map(int, t[:4]), int(t[4] or 1)) for t in
                     re.findall(r"^DSV41_EXACT_DIGITS_MM(?:_M)?\((\d+), (\d+), (\d+), (\d+)(?:, (\d+))?\)", text, re.M))


# The configuration a call of at most this many rows takes by default.
DEFAULT_CONFIG = {8: CudaExactConfig(4, 4), 16: CudaExactConfig(4, 3)}


class CudaExactMM:
    """The plan of one weight: `CudaExactMM(weight, w_scale, max_rows, config)` binds it and loads the
    kernels its row buckets take; calling it launches one kernel on the current stream.

    weight [N, K] float8_e4m3fn, w_scale [ceil(N/32), K/32] UE8M0 (`ops.checks.mxfp8_weight_args`);
    config: a CudaExactConfig or {most rows: CudaExactConfig} covering max_rows (default
    DEFAULT_CONFIG); each (rows / 8 rounded up, warps, stages) must be one the source instantiates."""

    def __init__(self, weight: torch.Tensor, w_scale: torch.Tensor, max_rows: int = MAX_ROWS,
                 config: CudaExactConfig | dict[int, CudaExactConfig] | None = None):
        n, k = mxfp8_weight_args(weight, w_scale, max_rows, MAX_ROWS)
        if n % 16 or k % 128:
            raise ValueError(f"weight must be [N, K] with N a multiple of 16 and K of 128, got {(n, k)}")
        require_tma_rows(weight, "weight", CP_ASYNC)
        scale_words(w_scale, "w_scale")
        configs = row_configs(DEFAULT_CONFIG if config is None else config, CudaExactConfig,
                              "a CudaExactConfig", max_rows)
        if weight.device.type != "cuda" or torch.cuda.get_device_capability(weight.device) < (8, 9):
            raise ValueError(f"weight must be on a CUDA device of compute capability >= 8.9, got {weight.device}")
        built = compiled_kernels()
        module = load_module(SOURCE, weight.device.index if weight.device.index is not None
                             else torch.cuda.current_device())
        self.functions: dict[tuple[int, CudaExactConfig], CudaFunction] = {}
        lo = 1
        for most, c in configs:
            for tiles in range(-(-lo // ROWS_PER_TILE), -(-min(most, max_rows) // ROWS_PER_TILE) + 1):
                if (tiles, c.warps, c.stages, c.blocks, c.m_tiles) not in built:
                    raise ValueError(f"config {c} at {tiles * ROWS_PER_TILE} rows: the source instantiates "
                                     f"(n_tiles, warps, stages, blocks, m_tiles) only for {sorted(built)}")
                if n % c.tile_rows:
                    raise ValueError(f"config {c}: N={n} is not a multiple of its {c.tile_rows}-row tiles")
                if k % (32 * c.blocks):
                    raise ValueError(f"config {c}: K={k} is not a multiple of 32 x {c.blocks} blocks a stage")
                name = c.kernel(tiles)
                self.functions[(tiles, c)] = module.function(name, module.global_int(f"{name}_smem"))
            lo = most + 1
        # stream-K grids and their hand-over buffers (one accumulator fragment and one flag a CTA)
        sms = torch.cuda.get_device_properties(weight.device).multi_processor_count
        self.grids: dict[tuple[int, CudaExactConfig], int] = {}
        self.handoff: dict[tuple[int, CudaExactConfig], tuple[torch.Tensor, torch.Tensor]] = {}
        for (tiles, c), fn in self.functions.items():
            grid = n // c.tile_rows
            if c.ctas_per_sm:
                held = fn.resident_ctas(32 * (c.warps + 1))
                if c.ctas_per_sm > held:
                    raise ValueError(f"config {c}: an SM holds {held} CTAs of {fn.name}, fewer than "
                                     f"ctas_per_sm={c.ctas_per_sm} (a CTA would wait on one never started)")
                grid = min(grid, c.ctas_per_sm * sms)
                self.handoff[(tiles, c)] = (torch.zeros(grid * c.m_tiles * tiles * 128, dtype=torch.float32,
                                                        device=weight.device),
                                            torch.zeros(grid, dtype=torch.int32, device=weight.device))
            self.grids[(tiles, c)] = grid
        self.weight, self.w_scale, self.n, self.k, self.max_rows = weight, w_scale, n, k, max_rows
        self.configs, self.device = configs, weight.device

    def function_for(self, rows: int) -> tuple[CudaFunction, CudaExactConfig]:
        c = config_for_rows(self.configs, rows)
        return self.functions[(-(-rows // ROWS_PER_TILE), c)], c

    def __call__(self, codes: torch.Tensor, x_scale: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """y = codes x weight^T with the contract's roundings: codes [M, K] float8_e4m3fn, x_scale
        [M, K/32] UE8M0, 1 <= M <= max_rows; out [M, N] BF16 or FP32 (allocated BF16 when None).
        Returns out."""
        out = mxfp8_linear_args(codes, x_scale, out, self.n, self.k, self.max_rows, self.device)
        require_tma_rows(codes, "codes", CP_ASYNC)
        scale_words(x_scale, "x_scale")
        m = codes.shape[0]
        fn, c = self.function_for(m)
        key = (-(-m // ROWS_PER_TILE), c)
        handoff, flags = self.handoff.get(key, (None, None))
        fn.launch((self.grids[key], 1, 1), 32 * (c.warps + 1), torch.cuda.current_stream(self.device).cuda_stream,
                  [("p", codes.data_ptr()), ("p", x_scale.data_ptr()), ("p", self.weight.data_ptr()),
                   ("p", self.w_scale.data_ptr()), ("p", out.data_ptr()), ("i", m), ("i", self.k),
                   ("i", codes.stride(0)), ("i", x_scale.stride(0)), ("i", self.weight.stride(0)),
                   ("i", self.w_scale.stride(0)), ("i", out.stride(0)), ("i", int(out.dtype == torch.float32)),
                   ("i", self.n // c.tile_rows), ("p", 0 if handoff is None else handoff.data_ptr()),
                   ("p", 0 if flags is None else flags.data_ptr())])
        return out
