"""The launch configurations of `ops.exact_mm.ExactMM` and the plans measured for the step's shapes:
`ExactConfig` (one configuration; every one gives the same bits), the tuned tables per (N, K, row
bucket) with their FP32 fallbacks for GPUs whose FP64 runs slowly, the rule for shapes without an
entry (`planned_config`), and the register caps of the mHC boundary epilogue's launches. The
kernel and its launcher live in `ops.exact_mm`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .checks import require_int, require_num_warps
from .common import CPU_SMS


@dataclass(frozen=True)
class ExactConfig:
    """One launch configuration of `exact_mm`'s kernel; every configuration gives the same bits.

    block_n: W rows per program, a power of two (>= 2). block_k: K bytes per weight row per loop
    step, 32 times a power of two (32 .. 1024), dividing K. rows: x rows per pass over the weight
    (1, 2 or 4; more rows take several passes). num_warps, num_stages: Triton's (the K loop's
    loads are software-pipelined num_stages - 1 steps ahead through shared memory). split: K
    splits (programs per N tile) for calls of at most 4 rows, which then take one pass; their block
    terms go through a workspace and the tile's last program adds them, in K order (the plan may
    use fewer splits so that none is empty; calls of more than 4 rows take one split). f64: each
    block's exact dot on the FP64 cores (`exact_mm._block_sums_f64`: one DFMA per weight code and
    row, the codes made FP64 operands by integer operations) instead of the FP32 chained split
    (four FP32 instructions per code and row); the same partials.
    """

    block_n: int = 16
    block_k: int = 256
    rows: int = 4
    num_warps: int = 4
    num_stages: int = 4
    split: int = 1
    f64: bool = False

    def __post_init__(self):
        for name in ("block_n", "block_k", "rows", "num_warps", "num_stages", "split"):
            require_int(getattr(self, name), f"ExactConfig.{name}")
        require_num_warps(self.num_warps, "ExactConfig.num_warps")
        if not isinstance(self.f64, bool):
            raise ValueError(f"ExactConfig.f64 must be a bool, got {self.f64!r}")
        if self.block_n < 2 or self.block_n & (self.block_n - 1):
            raise ValueError(f"ExactConfig.block_n must be a power of two >= 2, got {self.block_n}")
        if self.block_k not in (32, 64, 128, 256, 512, 1024):
            raise ValueError(f"ExactConfig.block_k must be 32 times a power of two up to 1024, got {self.block_k}")
        if self.rows not in (1, 2, 4):
            raise ValueError(f"ExactConfig.rows must be 1, 2 or 4, got {self.rows}")

    @classmethod
    def from_spec(cls, spec: str) -> "ExactConfig":
        """The configuration a spec string names, block_n:block_k:rows:num_warps:num_stages[:split[:f64]]
        (split absent: 1; f64 0 or 1, absent: 0), the form scripts/probe_exact_mm.py takes and
        tests/ops/_exact_mm_sm90.py prints. Too few or too many fields, or one that is not an
        integer, raise a ValueError naming the form; a bad value, the field's own error."""
        form = "block_n:block_k:rows:num_warps:num_stages[:split[:f64]]"
        try:
            v = [int(t) for t in str(spec).split(":")]
        except ValueError:
            raise ValueError(f"an ExactConfig spec is {form}, integers, got {spec!r}") from None
        if not 5 <= len(v) <= 7:
            raise ValueError(f"an ExactConfig spec is {form}, got {spec!r} ({len(v)} fields)")
        return cls(*v[:6], f64=bool(v[6])) if len(v) == 7 else cls(*v)

    @property
    def spec(self) -> str:
        """The spec string `from_spec` reads back as this configuration (the f64 field only when set)."""
        return (f"{self.block_n}:{self.block_k}:{self.rows}:{self.num_warps}:{self.num_stages}:{self.split}"
                + (":1" if self.f64 else ""))


# Per (N, K, row bucket): the fastest configuration measured on an H200 (scripts/probe_exact_mm.py
# --rows=1,4,16, commit 3a051ea, one weight copy; bucket 2: --rows=1,2 --copies=20, commit e98c91e,
# the weights from DRAM: docs/results/gpu-tests-h200.txt run AV; the FP64 block sums (f64): --rows=1,2,4
# --copies=l2 at 655feb6, runs BA and BC; every configuration gives the same bits). Shapes and
# buckets without an entry (the TP shards; bucket 2 of the shapes that run GluonExactFMA at 2 rows
# on sm_90) take `_default_config`.
_TUNED: dict[tuple[int, int, int], ExactConfig] = {
    # FP64 sums: 6.22 / 6.22 us at 1 (runs BA / BC) against 4:1024:1:2:3's 6.36 / 6.39 (FP32); in
    # the step 6.9 us a layer against that plan's 6.4 and 7.2 (runs AY and BG, the same kernel: one
    # profiled replay's spread)
    (1792, 5120, 1): ExactConfig(block_n=2, block_k=1024, rows=1, num_warps=1, num_stages=3, split=1, f64=True),
    # FP32 sums: with FP64 ones 9.00 / 9.06 us alone against 9.21 / 9.33 (runs BA, BC), but 11.3 us a
    # layer in the step against this plan's 10.2 and 10.9 (runs BF against AY and BG); run AV: 9.38,
    # the rule 11.14
    (1792, 5120, 2): ExactConfig(block_n=2, block_k=1024, rows=2, num_warps=1, num_stages=3, split=1),
    (1792, 5120, 4): ExactConfig(block_n=8, block_k=1024, rows=4, num_warps=4, num_stages=3, split=1),   # 8:1024:4:4:3: 14.64 us at 4
    (1792, 5120, 64): ExactConfig(block_n=8, block_k=1024, rows=4, num_warps=4, num_stages=3, split=1),   # 8:1024:4:4:3:2: 53.58 us at 16
    (32768, 1280, 1): ExactConfig(block_n=32, block_k=256, rows=1, num_warps=2, num_stages=3, split=1),   # 32:256:4:2:3: 13.97 us at 1
    (32768, 1280, 4): ExactConfig(block_n=32, block_k=256, rows=4, num_warps=2, num_stages=3, split=1),   # 32:256:4:2:3: 42.90 us at 4
    (32768, 1280, 64): ExactConfig(block_n=16, block_k=256, rows=4, num_warps=2, num_stages=3, split=1),   # 16:256:4:2:3: 162.25 us at 16
    (4096, 1280, 1): ExactConfig(block_n=4, block_k=256, rows=1, num_warps=1, num_stages=3, split=1),   # 4:256:4:1:3: 3.90 us at 1
    (4096, 1280, 2): ExactConfig(block_n=8, block_k=256, rows=2, num_warps=2, num_stages=3, split=1),   # 8:256:4:2:3: 6.10 us at 2 (rule: 6.40)
    (4096, 1280, 4): ExactConfig(block_n=4, block_k=256, rows=4, num_warps=1, num_stages=3, split=1),   # 4:256:4:1:3: 8.12 us at 4
    (4096, 1280, 64): ExactConfig(block_n=4, block_k=256, rows=4, num_warps=1, num_stages=3, split=1),   # 4:256:4:1:3: 27.51 us at 16
    # FP64 sums: 16.44 / 16.57 us at 1 (runs BA / BC) against 4:1024:1:2:3's 16.94 / 17.17 (FP32);
    # 16.3 / 16.4 us a layer in the step against 16.8 (runs BF, BG against AY)
    (5120, 8192, 1): ExactConfig(block_n=2, block_k=1024, rows=1, num_warps=1, num_stages=3, split=1, f64=True),
    # FP64 sums: 24.49 / 25.04 us at 2 (runs BA / BC) against GluonExactFMA's K split 25.24 / 25.29
    # and 30.29 / 30.36 with FP32 sums; 24.5 us a layer in the step against the K split's 25.4 (runs
    # BF, BG against AY)
    (5120, 8192, 2): ExactConfig(block_n=8, block_k=1024, rows=2, num_warps=2, num_stages=3, split=1, f64=True),
    (5120, 8192, 4): ExactConfig(block_n=8, block_k=512, rows=4, num_warps=2, num_stages=4, split=1),   # 8:512:4:2:4: 53.27 us at 4
    (5120, 8192, 64): ExactConfig(block_n=8, block_k=512, rows=4, num_warps=2, num_stages=4, split=1),   # 8:512:4:2:4: 203.52 us at 16
}

# Per `_TUNED` key whose entry sums on the FP64 cores: the fastest measured configuration with FP32
# sums, which a GPU that runs FP64 slowly takes (`planned_config(fp64=False)`): runs BA and BC
# (16.94 / 17.17 us at wo_b's 1 row, 6.36 / 6.39 at the fused wq_a|wkv's) and AX (27.62 at wo_b's
# 2 rows on 2:1024:4:1:3, 2 rows a pass there).
_TUNED_FP32: dict[tuple[int, int, int], ExactConfig] = {
    (1792, 5120, 1): ExactConfig(block_n=4, block_k=1024, rows=1, num_warps=2, num_stages=3, split=1),
    (5120, 8192, 1): ExactConfig(block_n=4, block_k=1024, rows=1, num_warps=2, num_stages=3, split=1),
    (5120, 8192, 2): ExactConfig(block_n=2, block_k=1024, rows=2, num_warps=1, num_stages=3, split=1),
}

# Row buckets: a call of M <= 4 rows uses the bucket 2^ceil(log2 M), one of more rows the bucket 64.
_ROW_BUCKETS = (1, 2, 4, 64)


def _default_config(n: int, k: int, rows: int, sms: int) -> ExactConfig:
    """A configuration by rule (until measured): the deepest K step up to 1024 that divides K, 4
    warps, and four weight rows per thread, two with 4 rows of x per pass (on sm_90 Triton gives each
    thread 32 consecutive K of a weight row, one whole block, and the program's weight rows in
    turn: a thread's activation conversion is shared by its weight rows; 4 x 4 would take all 255
    registers); with fewer than two programs per SM, two weight rows per thread, then fewer warps,
    so that more programs share the weight. 3 stages (two steps in flight), 4 where K takes 8
    steps or more and a step is at most 4 KB."""
    block_k = next(b for b in (1024, 512, 256, 128, 64, 32) if k % b == 0)
    warps, per_thread = 4, (4 if rows <= 2 else 2)   # rows: the row bucket
    block_n = lambda: max(2, per_thread * 32 * 32 * warps // block_k)  # noqa: E731
    while -(-n // block_n()) < 2 * sms and (per_thread > 2 or warps > 1):
        if per_thread > 2:
            per_thread //= 2
        else:
            warps //= 2
    bn = block_n()
    return ExactConfig(block_n=bn, block_k=block_k, rows=min(rows, 4), num_warps=warps,
                       num_stages=4 if k // block_k >= 8 and bn * block_k <= 4096 else 3)


def planned_config(n: int, k: int, bucket: int, sms: int = CPU_SMS, *, fp64: bool) -> ExactConfig:
    """The configuration a plan without `config` uses for N x K and the row bucket (1, 2, 4 or 64)
    on a GPU of `sms` SMs; `fp64`: whether it runs FP64 at full rate (`common.full_rate_fp64`), else
    an entry with FP64 sums (`ExactConfig.f64`) gives way to `_TUNED_FP32`'s (or, unlisted, to the
    same tiles with FP32 sums)."""
    key = (n, k, bucket)
    cfg = _TUNED.get(key) or _default_config(n, k, bucket, sms)
    if fp64 or not cfg.f64:
        return cfg
    return _TUNED_FP32.get(key) or dataclasses.replace(cfg, f64=False)


# Per launch configuration: the register cap of its launches with the boundary epilogue, under which
# ptxas allocates what the plain kernel does at the allocation's granularity (8 a thread), so that
# the launch keeps the plain kernel's programs an SM (tests/ops/_exact_mm_sm90.py --boundary checks
# both): wo_b's 1-row plan (2560 programs of one warp) takes 84 plain and, capped at 128, 88 with
# the epilogue's serial tail (both 88 allocated: 23 programs an SM by registers); uncapped it takes
# 94, and at caps of 84-104 it spills. Under the cap nothing spills and the K loop keeps its FP32
# instructions.
_BOUNDARY_MAXNREG: dict[ExactConfig, int] = {
    ExactConfig(block_n=2, block_k=1024, rows=1, num_warps=1, num_stages=3, split=1, f64=True): 128,    # wo_b, 1 row
    # its FP32 plan (`_TUNED_FP32`): 1280 programs of 2 warps, 96 registers plain (10 an SM), 104
    # uncapped with the epilogue (9 an SM: more than one wave)
    ExactConfig(block_n=4, block_k=1024, rows=1, num_warps=2, num_stages=3, split=1): 96,
}
