"""The low-batch MXFP8 linear in Gluon for Hopper (sm_90): y[M, N] BF16 = MXFP8 activation x FP8
weight with 32x32 UE8M0 block scales, FP32 accumulation, 1 <= M <= 64 rows. Same contract and
arguments as `ops.low_latency_mm` (the Triton tier, the portable path) and
`reference.linear.mxfp8_mm`.

What Gluon gives here that `tl.dot` does not (docs/notes-low-latency-mm.md, "What the sweep shows"):

- **Swap AB.** A program computes y^T[BLOCK_N = 64, BLOCK_T] = W[64 rows, K range] @ x^T: the
  weight rows are the wgmma's M (one warpgroup, m64), the rows of x (padded to BLOCK_T = 8, 16, 32
  or 64; TMA fills the rows past M with zeros) its N. One program reads its weight bytes once.
- **A TMA producer warp.** `warp_specialize` splits the program into a 1-warp producer that
  streams 64 x 128 FP8 weight tiles (8 KB) and the matching [BLOCK_T, 128] activation tiles
  through a ring of STAGES >= 3 shared-memory slots, each completed on its `ready` mbarrier (TMA
  transaction bytes) and handed back on its `empty` mbarrier, and a 4-warp consumer warpgroup.
- **Per-32-block FP8 wgmma with FP32 promotion, two groups in flight.** A 128-deep step holds
  four 32-wide K blocks. For each block kb the consumer issues one asynchronous wgmma
  m64 n{BLOCK_T} k32 over the 32-column slice of the slot (`use_acc=False`: the block's partial
  alone, from zero), then retires the previous block's group (`warpgroup_mma_wait(1)`: at most one
  group left in flight) and promotes it: `acc += (part * sx[m, kb]) * sw[n // 32, kb]` in FP32,
  the reference's order. So block kb+1's MMA runs while block kb is scaled, and the FP32
  accumulator only ever receives scaled block partials, in K order.

  Why per block and not per 128 (DeepGEMM's promotion interval): the contract scales each 32-wide
  block's partial by that block's two scales before it joins the sum (spec-decisions, decision 1),
  and the scales differ per block, so the partial cannot be longer than one block. Within one
  block the wgmma k32 adds the 32 products in the tensor core. The exact sum needs up to 41 bits
  (products of E4M3 codes are multiples of 2^-18 below 2^18; the reference forms it in FP64 and
  rounds once to FP32), so no FP32 result is exact in general: at best the correctly rounded sum,
  and Hopper's FP8 MMA does not promise even that (it aligns the products to the largest with a
  limited number of bits). The block partial is therefore the hardware's - the same instruction,
  from a zero accumulator (SASS: QGMMA.64xNx32.F32.E4M3.E4M3 ... RZ), that `low_latency_mm`'s
  32-deep `tl.dot` compiles to - and it is the only step that is not exactly the reference's. The scaling by two powers of two is exact (outside FP32's subnormal range) and the
  K-ordered FP32 adds are the reference's adds.
- **The scales** of a step (four UE8M0 bytes per weight-row block and per activation row) are
  loaded as one 32-bit word per row, one step ahead of their use (loop-carried registers), and
  split with shifts; the plan requires K % 128 == 0 and word-aligned scale rows.
- **Split-K with a deterministic reduction**, as `low_latency_mm`: grid (N tiles, K splits); each
  split stores its FP32 partial of the M real rows to the plan's workspace, then one acq_rel
  atomic on the tile's counter; the last split to arrive adds the partials in split order (from
  zero), rounds to BF16 (round to nearest even), stores y and resets the counter (replayable in a
  CUDA graph with no memset).

With the same K split bounds the kernel adds the same FP32 values in the same order as
`low_latency_mm`'s FP8 loop, so the two give the same bits (tests/ops/test_gluon_mm.py checks it
on the GPU); `GluonMM.reduction_order` names the bounds.

A `GluonMM` plan binds one weight (its TMA descriptor, the split, the workspace and counters)
once; calling it validates and launches. `gluon_mm` is the allocating convenience form. The plan
is not yet used by the decode step.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from .checks import UE8M0_DTYPES, mxfp8_linear_args, require_tensor
from .common import is_sm90, num_sms, plan_workspace
from .low_latency_mm import _Operands   # the plan cache's key: same memory, same view

MAX_ROWS = 64
BLOCK_N = 64           # weight rows per program: the wgmma's M, one warpgroup
BLOCK_K = 128          # K per ring slot: four 32-wide scale blocks, one 32-bit scale word per row
ROW_BUCKETS = (8, 16, 32, 64)   # BLOCK_T: the wgmma's N


@gluon.jit
def _producer(w_desc, x_desc, w_smem, x_smem, ready, empty, off_n, step_lo, n_steps,
              STAGES: gl.constexpr):
    """The 1-warp TMA producer: step i's weight tile [64, 128] and activation tile [BLOCK_T, 128]
    into slot i % STAGES once the consumer has released it."""
    for i in range(n_steps):
        s = i % STAGES
        # A fresh barrier counts as having completed the phase before its first: the first pass
        # over the ring does not wait.
        mbarrier.wait(empty.index(s), ((i // STAGES) & 1) ^ 1)
        mbarrier.expect(ready.index(s), w_desc.block_type.nbytes + x_desc.block_type.nbytes)
        k = (step_lo + i) * w_desc.block_type.shape[1]
        tma.async_copy_global_to_shared(w_desc, [off_n, k], ready.index(s), w_smem.index(s))
        tma.async_copy_global_to_shared(x_desc, [0, k], ready.index(s), x_smem.index(s))


@gluon.jit
def _scale(word, j: gl.constexpr):
    """Byte j (little-endian) of UE8M0 scale words as FP32 2^(b - 127); byte 255 gives NaN and
    byte 0 gives 0.0, as `ops.rounding.ue8m0_to_fp32`."""
    b = (word >> (8 * j)) & 255
    value = (b << 23).to(gl.float32, bitcast=True)
    return gl.where(b == 255, float("nan"), value)


@gluon.jit
def _consumer(w_smem, x_smem, ready, empty, sw_words, sx_words, step_lo, n_steps,
              STAGES: gl.constexpr, BN: gl.constexpr, BT: gl.constexpr, mma_layout: gl.constexpr):
    """The consumer warpgroup: per step, four 32-deep FP8 wgmmas, each block partial scaled by its
    two scales and added to the FP32 accumulator in K order (see the module doc). Returns (acc, )."""
    SUB: gl.constexpr = 4
    acc = gl.zeros([BN, BT], gl.float32, mma_layout)
    zero = gl.zeros([BN, BT], gl.float32, mma_layout)
    sw_next = gl.load(sw_words + step_lo)          # [BN] int32: the step's four weight scale bytes
    sx_next = gl.load(sx_words + step_lo)          # [BT] int32: the step's four activation scale bytes
    for i in range(n_steps):
        sw_word = sw_next
        sx_word = sx_next
        nxt = step_lo + gl.minimum(i + 1, n_steps - 1)
        sw_next = gl.load(sw_words + nxt)
        sx_next = gl.load(sx_words + nxt)
        s = i % STAGES
        mbarrier.wait(ready.index(s), (i // STAGES) & 1)
        w_tile = w_smem.index(s)
        x_tile = x_smem.index(s)
        prev = warpgroup_mma(w_tile.slice(0, 32, dim=1), x_tile.slice(0, 32, dim=1).permute((1, 0)), zero,
                             use_acc=False, is_async=True)
        for j in gl.static_range(1, SUB):
            cur = warpgroup_mma(w_tile.slice(32 * j, 32, dim=1), x_tile.slice(32 * j, 32, dim=1).permute((1, 0)),
                                zero, use_acc=False, is_async=True)
            part = warpgroup_mma_wait(num_outstanding=1, deps=(prev, ))
            acc += (part * _scale(sx_word, j - 1)[None, :]) * _scale(sw_word, j - 1)[:, None]
            prev = cur
        part = warpgroup_mma_wait(num_outstanding=0, deps=(prev, ))
        # Every wgmma reading slot s has retired: hand it back to the producer.
        mbarrier.arrive(empty.index(s), count=1)
        acc += (part * _scale(sx_word, SUB - 1)[None, :]) * _scale(sw_word, SUB - 1)[:, None]
    return (acc, )


@gluon.jit(do_not_specialize=["M", "stride_sxm", "stride_swn", "steps_per_split"])
def _gluon_mxfp8_mm_kernel(
    w_desc, x_desc, sx_ptr, sw_ptr, y_ptr, ws_ptr, cnt_ptr,
    M, N, stride_sxm, stride_swn, stride_ym, steps_per_split, n_steps_total,
    N_SPLIT: gl.constexpr, BT: gl.constexpr, STAGES: gl.constexpr, OUT_F32: gl.constexpr,
):
    # Grid (N tiles, K splits): program (t, s) covers weight rows [t*64, +64) and K steps
    # [s*steps_per_split, +steps_per_split) of 128; sx_ptr and sw_ptr point at the scales as int32
    # words (four UE8M0 bytes, one step), strides in words.
    BN: gl.constexpr = w_desc.block_type.shape[0]
    pid_n = gl.program_id(0)
    pid_s = gl.program_id(1)
    off_n = pid_n * BN
    step_lo = pid_s * steps_per_split
    n_steps = gl.minimum(steps_per_split, n_steps_total - step_lo)

    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BT, 32])
    rows_l: gl.constexpr = gl.SliceLayout(1, mma_layout)
    cols_l: gl.constexpr = gl.SliceLayout(0, mma_layout)
    rn = off_n + gl.arange(0, BN, layout=rows_l)
    rm = gl.arange(0, BT, layout=cols_l)
    # Rows past N or M read the last valid row's scales and are masked at the store.
    sw_words = sw_ptr + (gl.minimum(rn, N - 1) // 32) * stride_swn
    sx_words = sx_ptr + gl.minimum(rm, M - 1) * stride_sxm

    w_smem = gl.allocate_shared_memory(w_desc.dtype, [STAGES] + w_desc.block_type.shape, w_desc.layout)
    x_smem = gl.allocate_shared_memory(x_desc.dtype, [STAGES] + x_desc.block_type.shape, x_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)

    acc, = gl.warp_specialize([
        (_consumer, (w_smem, x_smem, ready, empty, sw_words, sx_words, step_lo, n_steps,
                     STAGES, BN, BT, mma_layout)),
        (_producer, (w_desc, x_desc, w_smem, x_smem, ready, empty, off_n, step_lo, n_steps, STAGES)),
    ], [1], [24])

    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(i))
        mbarrier.invalidate(empty.index(i))

    # The epilogue in a layout where each thread holds 8 consecutive n of one row m (16-byte
    # stores of y and of the workspace, both n-contiguous) instead of the wgmma's scattered pairs.
    out_l: gl.constexpr = gl.BlockedLayout(size_per_thread=[8, 1], threads_per_warp=[8, 4],
                                           warps_per_cta=[1, 4], order=[0, 1])
    acc = gl.convert_layout(acc, out_l)
    rn = off_n + gl.arange(0, BN, layout=gl.SliceLayout(1, out_l))
    rm = gl.arange(0, BT, layout=gl.SliceLayout(0, out_l))
    mask = (rn[:, None] < N) & (rm[None, :] < M)
    y_ptrs = y_ptr + rm[None, :] * stride_ym + rn[:, None]
    if N_SPLIT > 1:
        # Partial s of tile t at ws[(t * N_SPLIT + s) * M * BN + m * BN + n]: the M real rows.
        rn_l = gl.arange(0, BN, layout=gl.SliceLayout(1, out_l))
        m_ok = (rm[None, :] < M) & (rn_l[:, None] < BN)
        tile_ws = ws_ptr + pid_n * N_SPLIT * M * BN + rm[None, :] * BN + rn_l[:, None]
        gl.store(tile_ws + pid_s * M * BN, acc, mask=m_ok)
        # Every thread's partial is written before one thread's release of the counter.
        gl.thread_barrier()
        arrived = gl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if arrived == N_SPLIT - 1:
            gl.thread_barrier()
            total = gl.zeros([BN, BT], gl.float32, out_l)
            for s in gl.static_range(N_SPLIT):
                # .cg: from L2, never from a line this SM's L1 kept from an earlier launch.
                total += gl.load(tile_ws + s * M * BN, mask=m_ok, other=0.0, cache_modifier=".cg")
            if OUT_F32:
                gl.store(y_ptrs, total, mask=mask)
            else:
                gl.store(y_ptrs, total.to(gl.bfloat16), mask=mask)
            gl.atomic_xchg(cnt_ptr + pid_n, 0, sem="relaxed", scope="gpu")
    else:
        if OUT_F32:
            gl.store(y_ptrs, acc, mask=mask)
        else:
            gl.store(y_ptrs, acc.to(gl.bfloat16), mask=mask)


def maxnreg(block_t: int) -> int:
    """The launch's register cap per thread for row bucket `block_t`. The kernel runs 8 warps (the
    consumer warpgroup and the producer's, padded to a warpgroup), and a CTA holds 256 x this many
    registers however `setmaxnreg` moves them between the two (the producer drops to 24, the
    consumer rises to 2 x cap - 24): 80 keeps 3 CTAs per SM resident (128 would keep 2, and
    Triton's default of 256 one), and the 64-row bucket, whose FP32 tiles need more, spills below
    128 (sm_90 compile: 200 bytes of stack at 80)."""
    return 128 if block_t > 32 else 80


@dataclass(frozen=True)
class GluonMMConfig:
    """split: K splits requested (the plan may use fewer so that none is empty); stages: ring slots
    (>= 3); None = the default rule (`_default_split`, 4 stages)."""

    split: int | None = None
    stages: int = 4

    def __post_init__(self):
        if self.split is not None and (isinstance(self.split, bool) or not isinstance(self.split, int)
                                       or self.split < 1):
            raise ValueError(f"GluonMMConfig.split must be None or a positive int, got {self.split!r}")
        if isinstance(self.stages, bool) or not isinstance(self.stages, int) or not 3 <= self.stages <= 8:
            raise ValueError(f"GluonMMConfig.stages must be an int in [3, 8], got {self.stages!r}")


def _default_split(n: int, k: int, sms: int) -> int:
    """About two programs per SM (all resident in one wave), as `low_latency_mm`'s default rule."""
    tiles = -(-n // BLOCK_N)
    return max(1, min(k // BLOCK_K, round(2 * sms / tiles)))


def split_bounds(split: int, k: int) -> tuple[int, int]:
    """(k_per_split, splits actually used) for `split` requested K splits of 128-deep steps: the
    same rule as `low_latency_mm.reduction_order` with block_k 128, so equal bounds give equal bits."""
    steps = k // BLOCK_K
    per = -(-steps // min(split, steps))
    return per * BLOCK_K, -(-steps // per)




def _words(scale: torch.Tensor, name: str) -> torch.Tensor:
    """The UE8M0 bytes of `scale` viewed as int32 words (four 32-wide blocks, one 128-deep step)."""
    b = scale.view(torch.uint8)
    if b.stride(0) % 4 or b.data_ptr() % 4:
        raise ValueError(f"{name} rows must start on 4-byte boundaries (row stride {b.stride(0)} bytes, "
                         f"address {b.data_ptr():#x}): the kernel loads four scale bytes as one word")
    return b.view(torch.int32)   # [rows, K/128], row stride in words


class GluonMM:
    """y[M, N] = bf16(sum over 32-wide K blocks kb of (codes[:, kb] . weight[:, kb]) * sx * sw) for
    1 <= M <= max_rows <= 64, with the weight bound once; sm_90 only.

    weight: [N, K] float8_e4m3fn, unit stride along K, 16-byte aligned rows (TMA); K a multiple of
        128.
    w_scale: [ceil(N/32), K/32] UE8M0 (float8_e8m0fnu or uint8), unit stride along K, rows on
        4-byte boundaries.
    max_rows: the most rows a call may bring (1..64).
    config: a GluonMMConfig (the K split and the ring depth), else the default rule.
    workspace: None (the plan allocates its split-K workspace and counters) or a shared pool, as
        `ops.common.plan_workspace` says (FP32 slot 0, int32 slot 0).

    The plan owns (or takes) an FP32 workspace and one int32 counter per N tile (zero between
    calls). Calls must not overlap in time (one stream, or ordered streams).
    """

    def __init__(self, weight: torch.Tensor, w_scale: torch.Tensor, max_rows: int = MAX_ROWS,
                 config: GluonMMConfig | None = None, workspace=None):
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
            raise ValueError(f"weight must be a 2-D [N, K] tensor, got "
                             f"{tuple(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__}")
        n, k = weight.shape
        if k % BLOCK_K or k == 0 or n == 0:
            raise ValueError(f"weight must be [N, K] with N >= 1 and K a positive multiple of {BLOCK_K}, "
                             f"got {(n, k)} (use ops.low_latency_mm)")
        require_tensor(weight, "weight", (torch.float8_e4m3fn,), (n, k))
        require_tensor(w_scale, "w_scale", UE8M0_DTYPES, (-(-n // 32), k // 32))
        if w_scale.device != weight.device:
            raise ValueError(f"w_scale is on {w_scale.device} but weight is on {weight.device}")
        if not is_sm90(weight.device):
            raise ValueError(f"weight must be on a CUDA device of compute capability 9.0 (the Gluon tier is "
                             f"sm_90 code: TMA, wgmma), got {weight.device}")
        if weight.stride(0) % 16 or weight.data_ptr() % 16:
            raise ValueError(f"weight rows must be 16-byte aligned for TMA (row stride {weight.stride(0)}, "
                             f"address {weight.data_ptr():#x})")
        if isinstance(max_rows, bool) or not isinstance(max_rows, int) or not 1 <= max_rows <= MAX_ROWS:
            raise ValueError(f"max_rows must be an int in [1, {MAX_ROWS}], got {max_rows!r}")
        if config is not None and not isinstance(config, GluonMMConfig):
            raise TypeError(f"config must be a GluonMMConfig, got {type(config).__name__}")
        config = config or GluonMMConfig()
        self.weight, self.w_scale = weight, w_scale.view(torch.uint8)
        self._sw_words = _words(self.w_scale, "w_scale")
        self.n, self.k, self.max_rows, self.device = n, k, max_rows, weight.device
        self.stages = config.stages
        want = config.split or _default_split(n, k, num_sms(self.device))
        self.k_per_split, self.split = split_bounds(want, k)
        self.grid = (-(-n // BLOCK_N), self.split)
        w_layout = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_K], gl.float8e4nv)
        self._w_desc = TensorDescriptor.from_tensor(weight, [BLOCK_N, BLOCK_K], w_layout)
        ws_elems = self.grid[0] * self.split * max_rows * BLOCK_N if self.split > 1 else 1
        self._workspace = plan_workspace(workspace, 0, ws_elems, torch.float32, self.device)
        self._counters = plan_workspace(workspace, 0, self.grid[0], torch.int32, self.device)

    def block_t(self, rows: int) -> int:
        """The row bucket (the wgmma's N) used for `rows` rows."""
        return next(b for b in ROW_BUCKETS if b >= rows)

    def reduction_order(self) -> tuple[bool, int, int]:
        """As `low_latency_mm.LowLatencyMM.reduction_order`: (dequantize loop, K per split, K per
        dot). Equal tuples mean equal bits."""
        return (False, self.k_per_split, 32)

    def __call__(self, codes: torch.Tensor, x_scale: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """y = codes x weight^T with both block scales, into out.

        codes: [M, K] float8_e4m3fn, unit stride along K, 16-byte aligned rows; 1 <= M <= max_rows.
        x_scale: [M, K/32] UE8M0 (uint8 or float8_e8m0fnu), unit stride along K, rows on 4-byte
            boundaries.
        out: [M, N] BF16, unit stride along N; allocated when None. A float32 out receives the
            unrounded FP32 sums (a tensor-parallel partial).
        Returns out.
        """
        out = mxfp8_linear_args(codes, x_scale, out, self.n, self.k, self.max_rows, self.device)
        m = codes.shape[0]
        if codes.stride(0) % 16 or codes.data_ptr() % 16:
            raise ValueError(f"codes rows must be 16-byte aligned for TMA (row stride {codes.stride(0)}, "
                             f"address {codes.data_ptr():#x})")
        sx_words = _words(x_scale, "x_scale")
        bt = self.block_t(m)
        x_layout = gl.NVMMASharedLayout.get_default_for([bt, BLOCK_K], gl.float8e4nv)
        x_desc = TensorDescriptor.from_tensor(codes, [bt, BLOCK_K], x_layout)
        _gluon_mxfp8_mm_kernel[self.grid](
            self._w_desc, x_desc, sx_words, self._sw_words, out, self._workspace, self._counters,
            m, self.n, sx_words.stride(0), self._sw_words.stride(0), out.stride(0),
            self.k_per_split // BLOCK_K, self.k // BLOCK_K,
            N_SPLIT=self.split, BT=bt, STAGES=self.stages, OUT_F32=out.dtype == torch.float32, num_warps=4,
            maxnreg=maxnreg(bt),
        )
        return out


@functools.lru_cache(maxsize=64)
def _plan_for(operands: _Operands) -> GluonMM:
    return GluonMM(operands.weight, operands.w_scale)


def gluon_mm(codes: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, w_scale: torch.Tensor,
             out: torch.Tensor | None = None) -> torch.Tensor:
    """y[M, N] BF16 = MXFP8 codes [M, K] (+ x_scale [M, K/32]) x FP8 weight [N, K] (+ w_scale
    [ceil(N/32), K/32]); see `GluonMM`. Builds a plan on first use for these weight tensors and
    keeps it (up to 64 weights); code that captures CUDA graphs should build its plans itself."""
    for name, t in (("weight", weight), ("w_scale", w_scale)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    return _plan_for(_Operands(weight, w_scale))(codes, x_scale, out)
