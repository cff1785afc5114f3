"""The options, plan and step configurations of the Gluon sparse MLA (`ops.gluon_sparse_mla`, whose
kernel and launcher take them): `GluonSparseMlaConfig` (every option gives the same bits), the
decode step's configurations per row count and head count `STEP_CONFIGS`, and
`GluonSparseMlaPlan`, which binds a `SparseMlaPlan` (the split's blocks, workspace and
combination), the configuration, the spread combination's counters, the board of maxima and the
debug phase log (`PHASE_NAMES`), and the spread combination's residency (`programs_per_sm` of a
compiled kernel, per `specialization_key` of the launch's arguments)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .common import plan_workspace
from .gluon_sparse_mla_pv import _MAXNREG as _PV_MAXNREG, PV_CHUNKS, PV_DIMS
from .sparse_mla_plan import SparseMlaPlan

__all__ = ["PHASE_COLS", "PHASE_NAMES", "STEP_CONFIGS", "GluonSparseMlaConfig", "GluonSparseMlaPlan", "programs_per_sm",
           "specialization_key"]

_COMBINES = ("separate", "spread", "pv")     # GluonSparseMlaConfig.combine

# The phase log's columns (`GluonSparseMlaConfig.phases`, one int64 row per ticket): clock64 at the
# program's phase boundaries (0 where the program did not pass one: `arrived` and `combined` without
# the spread combination), then globaltimer at its start and end, its SM, whether it was the row's
# last to arrive (spread: it cleared the row's look-back state), and clock64 at its end (with
# globaltimer: the clock's rate).
PHASE_NAMES = ("start", "tables", "q_loaded", "gathered", "decoded", "scores", "look_back", "pv_stored",
               "arrived", "combined")
PHASE_COLS = 16


@dataclass(frozen=True)
class GluonSparseMlaConfig:
    """The kernel's options; none of them changes a bit of the output (tests/ops/test_gluon_sparse_mla.py
    checks every one against the default on the GPU), so a step may pick them per row count.

    q_buffers, the [64, 128] q chunks held in shared memory (4: all of q, 136 KB a program, one
    program per SM; 2: the last two chunks held in registers from the start and stored into the
    first two's buffers once their score MMAs have read them, 104 KB, two programs per SM);
    fp4_packed, the compressed records' codes loaded 8 bytes to a thread and their nibbles split in
    registers (else one byte load per dim); prefetch, a block's loads of all four 128-dim chunks
    issued before the first is decoded (one memory latency instead of four; the block where the
    window ends keeps chunk by chunk).

    dim_split S (1, 2 or 4): S programs per (row, block), each computing the block's scores and
    look-back in full (the same bits: the same MMAs on the same operands) and P.V and the partial
    for 512 / S of V's dims: S times the programs (more SMs busy at 1-8 rows), each with 1 / S of
    the P.V MMAs and of the partial's store; S times the decode and score work in all.

    combine: "separate", the blocks' partials combined by a second launch
    (`sparse_mla._sparse_mla_combine_kernel`); "spread", by all the row's programs in the same launch:
    each waits until the row's NB x S programs have arrived (an acq_rel counter per row in
    `GluonSparseMlaPlan.counters`), then combines its share of the row's [heads, 512] with the separate
    kernel's arithmetic in its block order (the same bits), so a row's combination runs on NB x S SMs.
    (The last-arriving program of a row combining it alone, measured on the H200, took 37 us at 1 row
    against the spread combination's 18.8: it was removed.) Waiting on programs that may not have
    started is only sound where the whole grid is resident at once: the launcher runs "spread" where the
    launch's programs fit the SMs (`programs_per_sm` of its compiled kernel: two a SM at <= 128
    registers with q_buffers=2) and the separate combination with the flag look-back elsewhere (the same
    bits either way). Where it runs, every program is resident, so the programs take their (row, block)
    from the program id, not the atomic ticket (one round trip less).

    "pv": the block programs store their P (BF16 [heads, 64]) and statistics instead of their FP32
    partials, and a second launch (`gluon_sparse_mla_pv`) runs P.V and the combination per row and
    `pv_chunks` 128-dim chunks of its output, block by block in order, each block's P.V rescaled
    into the chunk's sum as the separate kernel does: the same MMAs on the same operands and the
    same arithmetic, so the same bits, with the partials kept in registers (84 MB each way at 64
    rows and 64 heads for the other two) and the keys' dims decoded once more there (dim_split 1
    and the flag look-back only). Where the first launch's programs fit the SMs at once (three an
    SM at the step's cap of 80: up to 39 rows of ten blocks) they take their (row, block) from the
    program id, as the spread combination's do, not from the atomic ticket.

    lookback: how a block's program learns the maxima of the blocks before it: "flags" (each
    program stores its block's maxima, then sets its bit of the row's flag words with release; the
    later ones poll the words with acquire, then load the maxima: a fence and two round trips), or
    "values" (with the spread combination, whose last program of a row clears it: each program
    stores ~bits(max) into the row's int32 board, zero between launches, and the later ones poll the
    board itself until every earlier entry is nonzero: one round trip once they are there; a max
    whose bits are 0xFFFFFFFF, a NaN, never counts as published: its row's outputs come out NaN).

    fp4_lut (with fp4_packed): the compressed records' E2M1 codes decoded 8 values at a time in
    BF16 pairs by inline PTX (a PRMT table of the magnitudes' bytes, the sign ORed in, one BF16 pair
    multiply by the scale; exact, so the same values), where the FP32 path spends ~19 instructions a
    value: the decode is the longest phase of a program (2.7 us of 13 at 1 row on the H200).

    maxnreg: the registers ptxas may give a thread (None: its own choice); 128 fits two programs an
    SM (fp4_lut takes 154-156 on its own: capped at 128, the spread combination's kernel compiles
    without spills, the separate one's spills 112 bytes).

    pv_pipeline: a program's P.V chunks issued asynchronously, the next one's MMA in flight while
    the one before is stored (ptxas already overlaps the next chunk's MMA issue with the stores in
    part without it).

    phases (debug; slower): each program writes its SM's cycle counter at its phase boundaries
    (`PHASE_NAMES`; each after a barrier, so the time at which every warp has passed it), globaltimer
    at its start and end, its SM and whether it combined into `GluonSparseMlaPlan.phase_log`, one
    row per ticket (`scripts/probe_gluon_sparse_mla.py --phases` prints them).

    pv_chunks (with combine="pv"): the dim slices of a row's output a program of the second launch
    takes (1, 2 or 4; each slice's keys decoded and P.V run once per block); pv_dims: the dims of a
    slice, 128 (the first launch's P.V MMA, m64 n64 per warpgroup) or 64 (m64 n32: 8 / pv_chunks
    programs a row, each with half the decode and P.V a block; the same bits wherever the 32-wide
    wgmma sums each output as the 64-wide one does, which the GPU tests check); pv_maxnreg: the
    second launch's register cap (128: two 8-warp programs an SM, no spills at every pv_chunks and
    pv_dims; 80 with pv_dims=64 at 64 heads: three an SM, 24 warps to hide the blocks' load latency
    with, one register spilled outside the blocks' loop on sm_90; at 8-32 heads it spills inside);
    pv_stages: 0, the second launch loads each block's P and codes into registers at the block's
    start (P one block ahead); 3 or 4 (with fp4_lut), copies them asynchronously (cp.async) into a
    ring of that many shared-memory slots, each block's issued pv_stages - 2 blocks of work ahead of
    its use, the scales into registers a block ahead (`gluon_sparse_mla_pv._ring_slice`: the same
    values, so the same bits).

    k_buffers (with combine="pv"): the [64, 128] key chunks of a block program in shared memory: 4
    (the block's whole 512 dims, decoded before the scores) or 2 (with q_buffers=2: a chunk at a
    time, each chunk's score MMA after its decode, q's last two chunks loaded once the first two's
    MMAs are done: the same MMAs in the same order, so the same bits; 64 KB of shared memory, three
    programs an SM at maxnreg=80 without spills on sm_90).

    q_tma (at 16, 32 or 64 heads, the heads of block_h, with q contiguous and at least 64 of its
    [rows x heads, 512] rows; elsewhere ignored): q's chunks copied into shared memory by TMA from
    the program's start instead of loaded into registers and stored (with k_buffers=2 its last two
    chunks during chunk 2's decode; with four, q_buffers=2 still loads the last two into
    registers): a row's q is the first heads of the [64, 512] tile that starts at its first head,
    the tile's other rows (the next rows' heads, or the TMA's zeros past the tensor) in the MMA
    rows of the padded heads, whose values no store writes. The same values.

    pv_pdl (with combine="pv", on sm_90 outside the interpreter): the second launch launched with
    programmatic dependent launch (`ops.pdl`), so that its programs start as the first launch's last
    ones end: with the ring (pv_stages) each reads the row's tables, stores its slots and (one slice
    a program) copies the codes of its first blocks, then waits (`griddepcontrol.wait`) until the
    first launch has completed before it reads anything that launch writes (P, the statistics, the
    look-back words; without the ring it waits first); without PDL the same code runs after the
    first launch, the wait returning at once. The same values."""

    q_buffers: int = 2
    fp4_packed: bool = True
    prefetch: bool = True
    dim_split: int = 1
    combine: str = "separate"
    lookback: str = "flags"
    pv_pipeline: bool = False
    fp4_lut: bool = False
    maxnreg: int | None = None
    phases: bool = False
    pv_chunks: int = 1
    pv_dims: int = 128
    pv_maxnreg: int = _PV_MAXNREG
    pv_stages: int = 0
    k_buffers: int = 4
    q_tma: bool = False
    pv_pdl: bool = False

    def __post_init__(self):
        if self.q_buffers not in (2, 4) or isinstance(self.q_buffers, bool):
            raise ValueError(f"GluonSparseMlaConfig.q_buffers must be 2 or 4, got {self.q_buffers!r}")
        d = self.dim_split
        if isinstance(d, bool) or not isinstance(d, int) or d not in (1, 2, 4):
            raise ValueError(f"GluonSparseMlaConfig.dim_split must be 1, 2 or 4, got {self.dim_split!r}")
        if self.combine not in _COMBINES:
            raise ValueError(f"GluonSparseMlaConfig.combine must be one of {_COMBINES}, got {self.combine!r}")
        if self.lookback not in ("flags", "values"):
            raise ValueError(f"GluonSparseMlaConfig.lookback must be 'flags' or 'values', got {self.lookback!r}")
        if self.lookback == "values" and self.combine == "separate":
            raise ValueError("GluonSparseMlaConfig.lookback='values' needs combine='spread' (its last program of a "
                             "row clears the board of maxima), got combine='separate'")
        if self.combine == "pv" and (self.dim_split != 1 or self.lookback != "flags"):
            raise ValueError(f"GluonSparseMlaConfig.combine='pv' runs P.V in its second launch: it needs dim_split=1 "
                             f"and lookback='flags', got dim_split={self.dim_split!r}, lookback={self.lookback!r}")
        kb = self.k_buffers
        if isinstance(kb, bool) or not isinstance(kb, int) or kb not in (2, 4):
            raise ValueError(f"GluonSparseMlaConfig.k_buffers must be 2 or 4, got {kb!r}")
        if kb == 2 and (self.combine != "pv" or self.q_buffers != 2):
            raise ValueError(f"GluonSparseMlaConfig.k_buffers=2 decodes a block's chunks between its score MMAs, "
                             f"which only the first launch of combine='pv' (no P.V there) with q_buffers=2 takes, "
                             f"got combine={self.combine!r}, q_buffers={self.q_buffers!r}")
        c = self.pv_chunks
        if isinstance(c, bool) or not isinstance(c, int) or c not in PV_CHUNKS:
            raise ValueError(f"GluonSparseMlaConfig.pv_chunks must be one of {PV_CHUNKS}, got {self.pv_chunks!r}")
        d = self.pv_dims
        if isinstance(d, bool) or not isinstance(d, int) or d not in PV_DIMS:
            raise ValueError(f"GluonSparseMlaConfig.pv_dims must be one of {PV_DIMS}, got {self.pv_dims!r}")
        m = self.maxnreg
        if m is not None and (isinstance(m, bool) or not isinstance(m, int) or not 64 <= m <= 255):
            raise ValueError(f"GluonSparseMlaConfig.maxnreg must be None or an int in [64, 255], got {m!r}")
        m = self.pv_maxnreg
        if isinstance(m, bool) or not isinstance(m, int) or not 64 <= m <= 255:
            raise ValueError(f"GluonSparseMlaConfig.pv_maxnreg must be an int in [64, 255], got {m!r}")
        st = self.pv_stages
        if isinstance(st, bool) or not isinstance(st, int) or st not in (0, 3, 4):
            raise ValueError(f"GluonSparseMlaConfig.pv_stages must be 0, 3 or 4, got {st!r}")
        if st and not self.fp4_lut:
            raise ValueError("GluonSparseMlaConfig.pv_stages decodes the ring's compressed codes with the FP4 LUT: it "
                             "needs fp4_lut=True")
        if self.fp4_lut is True and not self.fp4_packed:
            raise ValueError("GluonSparseMlaConfig.fp4_lut decodes fp4_packed's 8-byte loads: it needs fp4_packed=True")
        if self.pv_pdl is True and self.combine != "pv":
            raise ValueError(f"GluonSparseMlaConfig.pv_pdl launches the second launch of combine='pv' with PDL: it "
                             f"needs combine='pv', got combine={self.combine!r}")
        for name in ("fp4_packed", "prefetch", "pv_pipeline", "fp4_lut", "phases", "q_tma", "pv_pdl"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"GluonSparseMlaConfig.{name} must be a bool, got {type(getattr(self, name)).__name__}")


_SPLIT4SVL = GluonSparseMlaConfig(dim_split=4, combine="spread", lookback="values", fp4_lut=True)
_SPLIT2SVLC = GluonSparseMlaConfig(dim_split=2, combine="spread", lookback="values", fp4_lut=True, maxnreg=128)
_SPREADVLC = GluonSparseMlaConfig(combine="spread", lookback="values", fp4_lut=True, maxnreg=128)
_PVRINGK2T = GluonSparseMlaConfig(combine="pv", fp4_lut=True, maxnreg=80, pv_stages=4, k_buffers=2, q_tma=True)
_PV64RINGK2T = GluonSparseMlaConfig(combine="pv", fp4_lut=True, maxnreg=80, k_buffers=2, q_tma=True, pv_dims=64,
                                    pv_maxnreg=80, pv_stages=3)

# The decode step's configuration per row count, by the heads a program holds (`block_h`: 16 for 8
# and 16 local heads, which the kernel pads to 16, then 32, 64; `GluonSparseMlaPlan.for_step`;
# (most rows, config), ascending: a launch takes the first plan that holds its rows; None: every
# row count above). Measured on an H200 (`scripts/probe_gluon_sparse_mla.py`, 128 window + 512
# top-k keys, graph replay; `docs/results/gpu-tests-h200.txt`), at 64 heads (27e9b3b; us at 1 / 2 /
# 4 / 8 / 16 / 64 rows): the default 17.68 / 17.38 / 17.87 / 19.15 / 34.93 / 101.08; dim_split 4 +
# spread + values look-back + fp4_lut 12.82 / 13.20 / 18.97 / 30.02 / 46.89 / 183.55; spread +
# values look-back + fp4_lut + maxnreg 128 17.65 / 17.40 / 17.16 / 17.59 / 28.60 / 106.46 (FlashMLA
# on the V4 record, same run: 12.20 / 12.63 / 13.30 / 14.01 / 16.13 / 42.24). At 3-4 rows dim_split
# 2 + spread + values look-back + fp4_lut + maxnreg 128 (two programs an SM, all 80 of 4 rows
# resident): 14.75 us at 4 rows against spreadvlc's 17.62, 22.07 at 8 against 17.85 (32 heads:
# 12.96 / 18.71 against 14.11 / 14.32; FlashMLA 12.59 / 13.50; run Y at 76a2b89). Above 16 rows at
# 64 heads P.V and the combination in a second launch + fp4_lut + maxnreg 128, its codes and P
# through a 4-slot cp.async ring (`pv_stages`; run AL at 5ad2f48: 44.88 / 64.77 us at 32 / 64 rows
# against 47.25 / 67.64 without the ring, 45.39 / 75.62 on 64-dim slices, spreadvlc's 54.81 / 97.59;
# 33.11 at 16 against spreadvlc's 27.24), its first launch with two key buffers at a cap of 80
# (three programs an SM: run AT at 487b63c, 40.75 against 44.85 us at 32 rows) and q copied by TMA
# (run CF at 169d31d: 36.20 / 56.48 us at 32 / 64 rows against 38.58 / 62.51 without, and the
# four-buffer first launch's 40.27 / 62.53; 29.99 at 16 against spreadvlc's 26.47; at 1-16 rows
# q by TMA moved the other configurations by at most 1 %, so they load it with plain loads). Its
# second launch by PDL (`pv_pdl`; run CN at 2a13c76) is 4-7 % faster alone at 17 and 40-64 rows and
# 13-18 % slower at 24-32 (26.33 / 34.04 / 37.71 / 43.44 / 51.79 us at 17 / 24 / 32 / 40 / 64 rows
# against 28.14 / 28.75 / 33.37 / 46.63 / 53.75), and left the step at 64 rows within its run-to-run
# spread (14500 us against 14508 without, run CL): the step launches it without. At 13-16 rows the
# same first launch with 64-dim slices in the second launch (eight programs a row, a three-slot
# ring at a cap of 80: three an SM; run CU at cc5f8b3: 21.49 / 23.76 / 28.81 / 28.92 us at 12 / 16
# / 20 / 24 rows against spreadvlc's 18.09 / 26.51 / 27.79 / 33.51 and the 128-dim ring's 24.69 /
# 26.90 / 27.13 / 27.04; FlashMLA 15.14 / 16.03 / 18.74 / 19.36).
# At 32 heads the same ring (two key buffers, q by TMA) where the spread combination's grid is past
# one wave of the GPU and the ring's is not: 29.59 / 29.66 us at 32 rows against spreadvlc's 31.69 /
# 31.66, 51.49 / 51.63 at 64 against 57.57 / 57.53 (two probes of run DC at 5f33af4), at 27-32 and
# 53-64 rows likewise (27: 29.17 against 29.98; 56: 50.64 against 54.28), and slower at 12-26 and
# 33-52 (24: 26.98 against 19.96; 40: 44.35 against 38.22; 52: 47.93 against 45.48; FlashMLA at 64
# heads 21.14 / 41.23 at 32 / 64 rows). At 8-16 heads the spread combination beats the second
# launch at every row count measured: 16 heads 16.95 / 26.61 / 42.44 us at 16 / 32 / 64 rows
# against the ring's 26.62 / 30.70 / 51.68 (run CZ at 5f33af4). Every configuration gives
# the default's bits on every row (the probe's `cfg==` in every cell;
# `test_gpu_every_config_gives_the_same_bits`), so a row's outputs do not depend on the bucket its
# step runs in: batch invariance holds across the buckets.
STEP_CONFIGS: dict[int, tuple] = {
    16: ((2, _SPLIT4SVL), (4, _SPLIT2SVLC), (None, _SPREADVLC)),
    32: ((2, _SPLIT4SVL), (4, _SPLIT2SVLC), (26, _SPREADVLC), (32, _PVRINGK2T), (52, _SPREADVLC), (None, _PVRINGK2T)),
    64: ((2, _SPLIT4SVL), (4, _SPLIT2SVLC), (12, _SPREADVLC), (16, _PV64RINGK2T), (None, _PVRINGK2T)),
}


@dataclass(frozen=True, eq=False)
class GluonSparseMlaPlan:
    """The kernel's plan: `base`, the `SparseMlaPlan` whose split, workspace and combination it
    shares (split into 64-key blocks, combined by the separate launch, all heads in one group of
    block_h = max(16, heads): the workspace's heads, which the kernel pads to the wgmma's 64),
    `config`, `counters` (int32 [max_rows], zero between launches: the spread combination's
    arrivals per row), `board` (int32 [max_rows, blocks, block_h] with lookback="values", zero
    between launches; else one unused int32), `resident` (the spread combination's and the "pv" first
    launch's programs per SM by (combine, `specialization_key` of the launch's arguments), from
    the compiled kernel of the first launch with that key), `q_descs` (with `config.q_tma`, q's TMA
    descriptors by address and rows, made at a launch's first use) and `phase_log` (int64 [max_rows x blocks x
    dim_split, 16] with `config.phases`, else None). Build with `GluonSparseMlaPlan.build` (or the
    step's, `for_step`); not for concurrent launches (as `base`)."""

    base: SparseMlaPlan
    config: GluonSparseMlaConfig
    counters: torch.Tensor
    board: torch.Tensor
    phase_log: torch.Tensor | None = None
    resident: dict = field(default_factory=dict)
    q_descs: dict = field(default_factory=dict)

    @classmethod
    def build(cls, max_rows: int, heads: int, window: int, topk: int, device="cuda", *, workspace=None,
              config: GluonSparseMlaConfig | None = None) -> "GluonSparseMlaPlan":
        """A plan for launches of up to max_rows rows of `heads` (8, 16, 32 or 64) heads, `window`
        window slots and `topk` compressed entries a row; workspace: as `SparseMlaPlan.build`'s
        (the step's shared pool; the counters from its int32 slot 3); config: None for the default
        `GluonSparseMlaConfig`."""
        if heads not in (8, 16, 32, 64):
            raise ValueError(f"heads must be one of (8, 16, 32, 64), got {heads!r}")
        if config is None:
            config = GluonSparseMlaConfig()
        if not isinstance(config, GluonSparseMlaConfig):
            raise TypeError(f"config must be a GluonSparseMlaConfig, got {type(config).__name__}")
        base = SparseMlaPlan.build(max_rows, heads, window, topk, device, block_h=max(16, heads), split=True,
                                   separate_combine=True, workspace=workspace)
        counters = plan_workspace(workspace, 3, max_rows, torch.int32, base.device)
        board = plan_workspace(workspace, 4, max_rows * base.n_blocks * base.block_h if config.lookback == "values"
                               else 1, torch.int32, base.device)
        log = None
        if config.phases:
            log = torch.zeros(max_rows * base.n_blocks * config.dim_split, PHASE_COLS, dtype=torch.int64,
                              device=base.device)
        return cls(base, config, counters, board, log)

    @classmethod
    def for_step(cls, max_rows: int, heads: int, window: int, topk: int, device="cuda", *,
                 workspace=None) -> list["GluonSparseMlaPlan"]:
        """The decode step's plans for rows 1..max_rows, one per bucket of `STEP_CONFIGS` (at the
        heads' block_h, max(16, heads)) that holds some of them (ascending max_rows, the last one's
        max_rows = max_rows; a launch takes the first that holds its rows). workspace: as
        `build`'s; with the step's pool the plans share its views (they run on the main stream one
        after another, each leaving its integer views at zero), so the pool holds the largest
        plan's workspaces, not their sum."""
        if heads not in (8, 16, 32, 64):
            raise ValueError(f"heads must be one of (8, 16, 32, 64), got {heads!r}")
        plans, lo = [], 0
        for hi, config in STEP_CONFIGS[max(16, heads)]:
            if lo >= max_rows:
                break
            rows = max_rows if hi is None else min(hi, max_rows)
            plans.append(cls.build(rows, heads, window, topk, device, workspace=workspace, config=config))
            lo = rows
        return plans

    @property
    def max_rows(self) -> int:
        return self.base.max_rows

    @property
    def heads(self) -> int:
        return self.base.heads

    @property
    def device(self) -> torch.device:
        return self.base.device

    def programs(self, rows: int) -> int:
        """The programs of the scores' launch at `rows` rows (one a row, 64-key block and dim slice):
        the signals a launch with `signal` gives (`gluon_sparse_mla_`)."""
        return rows * self.base.n_blocks * self.config.dim_split


def programs_per_sm(kernel) -> int:
    """How many programs of a compiled sm_90 kernel an SM holds at once: 64K registers (allocated per
    warp, 8 a thread at a time) and 228 KB of shared memory (1 KB of it reserved per program)."""
    if hasattr(kernel, "result"):      # a compilation still under way (Triton's async mode)
        kernel = kernel.result()
    kernel._init_handles()
    regs = -(-kernel.n_regs // 8) * 8 * kernel.metadata.num_warps * 32
    return max(0, min(65536 // regs, 228 * 1024 // (kernel.metadata.shared + 1024), 32))


def specialization_key(args) -> tuple:
    """What Triton's JIT specializes a kernel on among launch arguments of these kinds, one entry an
    argument: tensors by dtype and a 16-byte aligned data pointer, ints by == 1, divisibility by 16
    and range (int32, int64, uint64), bools, floats and None by their type. Arguments with the same
    key (and the same constexprs) launch the same compiled kernel; a key may be finer than
    Triton's, never coarser."""
    def one(a):
        if isinstance(a, torch.Tensor):
            return (a.dtype, a.data_ptr() % 16 == 0)
        if isinstance(a, int) and not isinstance(a, bool):
            return (int, a == 1, a % 16 == 0, -2**31 <= a < 2**31, a < 2**63)
        return type(a)
    return tuple(one(a) for a in args)
