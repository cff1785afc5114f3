"""The mixer of an mHC site (spec section 4; `reference.mhc.hc_mixes`): pre, post and comb from the
streams entering the site, one launch.

The [24, hc*dim] projection and the sum of squares run split over K: each program writes an FP32
partial [rows, 25] (the 24 projections, then the sum of squares packed in column 24) to the plan's
workspace, and the last program of a row tile to arrive (an atomic counter that it resets, so a
CUDA-graph replay needs no memset; `common.splitk_reduce`) adds the partials in split order, then
computes the sigmoids and the Sinkhorn rounds. The epilogue's sums over 4 and 8 terms run in fixed
trees (`_pair_sum`: never `tl.sum`, whose tree follows the register layout, and that follows the
tile's shape). Deterministic and batch-invariant: a row's outputs do not depend on the other rows
or the row count. Two kernels, the plan's `kernel`:

- "fma" (the step's default): FP32 products (FMA on the GPU) accumulated in 32 lanes along K, one
  lane per K residue mod 32, in K order, then the lanes added in a fixed pairwise tree; a program
  takes at most 8 rows, more rows take more row tiles, so at 64 rows the weight is read 8 times.
- "mma": the tensor cores. x is BF16 and the FP32 weight splits exactly into three BF16 planes,
  w = w0 + w1 + w2 (`_bf16_planes`: bit masks and subtractions in registers as the weight streams
  in, 4 bytes a weight read, not 6), so x . w = x . w2 + x . w1 + x . w0 with exact products.
  Every program runs [64, 64] x [64, 32] dots whatever the call's rows (rows past its own are
  zeros; wgmma m64n32k16 on sm_90, the same instructions at every row count), so up to 64 rows
  share one weight read (how many a program takes, 16, 32 or 64, is the plan's per row bucket and
  moves no bits); per 64-deep K block one zero-started chain of 12 MMAs (the planes smallest
  first), then one FP32 add into the program's accumulator; the sum of squares in 64 FP32 lanes
  beside it; the K split a plan constant (512 columns a program by default). The last program of
  a row group sums and finishes only its rows.

Accuracy. Sums are in another order than the reference's (and on the GPU the products may be
FMA-contracted, and exp and division approximate to a few ulps), so the outputs agree with the
reference within 1e-5 absolute, not bit for bit (tests/ops/test_mhc.py; "fma" measured at most
4.8e-7 in the interpreter at dims 64-5120, 1-70 rows). The "mma" kernel adds one error of its own,
the MMA's adds: a tensor core aligns an instruction's 16 exact products and its accumulator to the
largest of them, T, truncating each below T's last FP32 bit, and truncates the normalized sum
(Fasi et al., PeerJ Comput. Sci. 7:e330, 2021, V100-A100; Khattak and Mikaitis, arXiv:2512.07004,
H100). One instruction so errs by < 18 * 2^-23 * S, S = its |acc| + sum of its |products|.
Worst case: a block's chain carries at most A_b = sum over the block of |x_k| |w_k|; its four
w0 instructions err by < 4 * 18 * 2^-23 A_b = 8.6e-6 A_b, the eight w1 and w2 ones (products and
accumulator < 2^-7 A_b, smallest first) by < 6e-8 A_b; with the FP32 adds of the blocks and the
splits (gamma_48) the dot errs by < 1.2e-5 * sum_k |x_k w_k|, below the FMA kernel's own bound
(gamma_725 = 4.3e-5 times the same sum). Typical (the tests' inputs at dim 5120: x ~ N(0, 1),
w ~ N(0, 1/dim), |m| ~ 1.6), from an emulation of the kernel's arithmetic under that model
(scripts/hc_mix_mma_error_model.py): max |dm| 1.2e-6 when the aligned terms truncate toward zero,
2.7e-6 (a bias of -1.7e-6) were they floored, against 1.6e-6 for torch's FP32 matmul. pre, post
and comb move by at most |scale| / 4, |scale| / 2 and about |scale| / 4 of it (sigmoid' <= 1/4;
the Sinkhorn map's Jacobian, `testing.attribution.mix_bounds`): < 1e-6, far inside the 1e-5
bound. The GPU tests measure it at every row count.

Takes hc = 4 streams (the model's hc_mult; config.py rejects others).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .checks import interpreting, planned_rows, require_tensor
from .common import num_sms, splitk_reduce
from .mhc import HC, N_MIX

_MIX_COLS = 32             # the outputs padded to a power of two; column N_MIX carries the sum of squares
_K_GRAIN = 128  # every split but the last covers a multiple of this, so every BLOCK_K divides it
_BLOCK_K = 32     # K lanes of the FMA accumulator, at every row count
_MAX_BLOCK_M = 8  # the [BLOCK_M, 32, 32] accumulator at <= 64 FP32 registers per thread (4 warps)
_MMA_BLOCK_M = tl.constexpr(64)  # the tensor-core kernel's dot rows at every row count (wgmma m64 on sm_90)
_MMA_BLOCK_K = tl.constexpr(64)  # its K block: one zero-started MMA chain per plane, then an FP32 add
_MMA_EPI_M_MIN = 16    # its epilogue's fewest rows (`hc_mix_`), and its programs' fewest rows
_MMA_ROWS_PER_PROGRAM = 64  # the call's rows a program takes by default (`_mma_tile`)
_MMA_K_PER_SPLIT = 512  # its default K per program: 40 programs at dim 5120 (not tuned on a GPU)


@triton.jit
def _halve(x):
    """[R, C] -> [R, C/2]: x[:, 2i] + x[:, 2i + 1]."""
    R: tl.constexpr = x.shape[0]
    C: tl.constexpr = x.shape[1]
    a, b = tl.split(tl.reshape(x, (R, C // 2, 2)))
    return a + b


@triton.jit
def _pair_sum(x):
    """[R, C] -> [R]: each row summed in one fixed pairwise tree ((x0 + x1) + (x2 + x3)) + ...,
    C a power of two from 2 to 64. Unlike `tl.sum`, whose tree follows the register layout (which
    Triton picks from the whole tile's shape), the same bits whatever R is."""
    R: tl.constexpr = x.shape[0]
    C: tl.constexpr = x.shape[1]
    if C >= 64:
        x = _halve(x)
    if C >= 32:
        x = _halve(x)
    if C >= 16:
        x = _halve(x)
    if C >= 8:
        x = _halve(x)
    if C >= 4:
        x = _halve(x)
    return tl.reshape(_halve(x), (R,))


@triton.jit
def _pair_sum_last(x):
    """[A, B, C] -> [A, B, 1]: `_pair_sum` over the last axis."""
    A: tl.constexpr = x.shape[0]
    B: tl.constexpr = x.shape[1]
    C: tl.constexpr = x.shape[2]
    return tl.reshape(_pair_sum(tl.reshape(x, (A * B, C))), (A, B, 1))


@triton.jit
def _pair_sum_groups(x):
    """[A, B, C] -> [A, 1, C]: `_pair_sum` over the middle axis."""
    return tl.permute(_pair_sum_last(tl.permute(x, (0, 2, 1))), (0, 2, 1))


@triton.jit
def _mix_epilogue(total, rm, m_ok, scale_ptr, base_ptr, pre_ptr, post_ptr, comb_ptr,
                  stride_pre, stride_post, stride_cn, norm_eps, hc_eps,
                  K: tl.constexpr, ITERS: tl.constexpr, BLOCK_M: tl.constexpr):
    """pre, post, comb of the rows rm from total [BLOCK_M, 32] = (x @ fn^T | sum x^2 | 0...)."""
    col = tl.arange(0, 32)[None, :]
    ss = tl.sum(tl.where(col == 24, total, 0.0), axis=1)  # the other terms are +0: exact
    ms = tl.div_rn(ss, tl.full([BLOCK_M], K, tl.float32))
    root = tl.sqrt_rn(ms + norm_eps)
    inv = tl.div_rn(tl.full([BLOCK_M], 1.0, tl.float32), root)
    # Group g of 4 columns: 0 pre, 1 post, 2..5 rows i = g - 2 of comb, 6..7 padding.
    g = tl.arange(0, 8)[None, :, None]
    j = tl.arange(0, 4)[None, None, :]
    m3 = tl.reshape(total * inv[:, None], (BLOCK_M, 8, 4))
    sc = tl.load(scale_ptr + tl.minimum(g, 2))
    bs = tl.load(base_ptr + g * 4 + j, mask=g < 6, other=0.0)
    z = m3 * sc + bs
    sig = tl.sigmoid(z)
    row = rm[:, None, None]
    ok = m_ok[:, None, None]
    tl.store(pre_ptr + row * stride_pre + j + g * 0, sig + hc_eps, mask=ok & (g == 0))
    tl.store(post_ptr + row * stride_post + j + g * 0, 2.0 * sig, mask=ok & (g == 1))
    is_c = (g >= 2) & (g < 6)
    e = tl.exp(z - tl.max(z, axis=2, keep_dims=True))
    # The row and column sums in fixed trees (the padding groups add exact zeros to the column sums)
    c = e / _pair_sum_last(e) + hc_eps
    c = c / (_pair_sum_groups(tl.where(is_c, c, 0.0)) + hc_eps)
    for _ in range(ITERS - 1):
        c = c / (_pair_sum_last(c) + hc_eps)
        c = c / (_pair_sum_groups(tl.where(is_c, c, 0.0)) + hc_eps)
    tl.store(comb_ptr + row * stride_cn + (g - 2) * 4 + j, c, mask=ok & is_c)


@triton.jit
def _hc_mix_kernel(
    x_ptr, fn_ptr, scale_ptr, base_ptr, pre_ptr, post_ptr, comb_ptr, part_ptr, count_ptr, M, norm_eps, hc_eps,
    stride_xm, stride_fn, stride_pre, stride_post, stride_cn, stride_ps, stride_pm,
    K: tl.constexpr, ITERS: tl.constexpr, K_PER_SPLIT: tl.constexpr, SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.arange(0, 32)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    n_ok = rn < 24
    k_lo = pid_k * K_PER_SPLIT
    x_ptrs = x_ptr + rm[:, None].to(tl.int64) * stride_xm + rk[None, :]
    w_ptrs = fn_ptr + rn[:, None] * stride_fn + rk[None, :]

    # One FP32 accumulator per (row, output, K lane): pure FMAs in the loop, then each lane set
    # summed in a fixed tree (the same arithmetic for a row at every BLOCK_M).
    acc = tl.zeros((BLOCK_M, 32, BLOCK_K), dtype=tl.float32)
    sq = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
    # The loop's own num_stages makes Triton pipeline the loads (cp.async) without a dot.
    for kk in tl.range(0, K_PER_SPLIT, BLOCK_K, num_stages=NUM_STAGES):
        k0 = k_lo + kk
        k_ok = (k0 + rk) < K
        x = tl.load(x_ptrs + k0, mask=m_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        w = tl.load(w_ptrs + k0, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        sq += x * x
        acc += x[:, None, :] * w[None, :, :]
    y = tl.reshape(_pair_sum(tl.reshape(acc, (BLOCK_M * 32, BLOCK_K))), (BLOCK_M, 32))
    y = tl.where(rn[None, :] == 24, _pair_sum(sq)[:, None], y)

    if SPLIT == 1:
        _mix_epilogue(y, rm, m_ok, scale_ptr, base_ptr, pre_ptr, post_ptr, comb_ptr, stride_pre, stride_post,
                      stride_cn, norm_eps, hc_eps, K, ITERS, BLOCK_M)
    else:
        mask = m_ok[:, None] & (rn[None, :] <= 24)
        part_ptrs = part_ptr + rm[:, None] * stride_pm + rn[None, :]
        last, total = splitk_reduce(y, part_ptrs, stride_ps, mask, count_ptr + pid_m, pid_k, SPLIT)
        if last:
            _mix_epilogue(total, rm, m_ok, scale_ptr, base_ptr, pre_ptr, post_ptr, comb_ptr, stride_pre,
                          stride_post, stride_cn, norm_eps, hc_eps, K, ITERS, BLOCK_M)


@triton.jit
def _bf16_planes(w):
    """FP32 w -> (w0, w1, w2) BF16 with w0 + w1 + w2 == w exactly: w0 = w truncated to BF16 (its
    FP32 bits with the low 16 cleared), w1 = w - w0 truncated likewise, w2 = w - w0 - w1. Each
    subtraction is exact and w2 fits BF16: w - w0 holds the 16 significand bits below w0's 8, w1
    takes the top 8 of them. |w1| < 2^-7 |w|, |w2| < 2^-15 |w|. Bit masks and two FP32 subtractions
    (no rounding to evaluate), the same in the interpreter. Holds for normal w down to ~2^-110 (w2
    stays normal); an inf or NaN w gives a NaN plane."""
    w0 = (w.to(tl.uint32, bitcast=True) & 0xFFFF0000).to(tl.float32, bitcast=True)
    r = w - w0
    w1 = (r.to(tl.uint32, bitcast=True) & 0xFFFF0000).to(tl.float32, bitcast=True)
    return w0.to(tl.bfloat16), w1.to(tl.bfloat16), (r - w1).to(tl.bfloat16)


@triton.jit
def _hc_mix_mma_kernel(
    x_ptr, fn_ptr, scale_ptr, base_ptr, pre_ptr, post_ptr, comb_ptr, part_ptr, count_ptr, M, norm_eps, hc_eps,
    stride_xm, stride_fn, stride_pre, stride_post, stride_cn, stride_ps, stride_pm,
    K: tl.constexpr, ITERS: tl.constexpr, K_PER_SPLIT: tl.constexpr, SPLIT: tl.constexpr,
    ROWS: tl.constexpr, EPI_M: tl.constexpr, BF16_DOT: tl.constexpr, NUM_STAGES: tl.constexpr,
):
    # Grid: (SPLIT, row groups of ROWS <= 64). Every dot is [64, 64] x [64, 32] whatever M and ROWS
    # are (rows past the group load as zeros), so each row's sums run through the same MMA
    # instructions at every row count and every ROWS.
    BLOCK_M: tl.constexpr = _MMA_BLOCK_M
    BLOCK_K: tl.constexpr = _MMA_BLOCK_K
    pid_k = tl.program_id(0)
    pid_m = tl.program_id(1)
    rm = pid_m * ROWS + tl.arange(0, BLOCK_M)
    rn = tl.arange(0, 32)
    rk = tl.arange(0, BLOCK_K)
    m_ok = (tl.arange(0, BLOCK_M) < ROWS) & (rm < M)
    n_ok = rn < 24
    k_lo = pid_k * K_PER_SPLIT
    x_ptrs = x_ptr + rm[:, None].to(tl.int64) * stride_xm + rk[None, :]
    w_ptrs = fn_ptr + rn[:, None] * stride_fn + rk[None, :]

    acc = tl.zeros((BLOCK_M, 32), dtype=tl.float32)
    sq = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
    for kk in tl.range(0, K_PER_SPLIT, BLOCK_K, num_stages=NUM_STAGES):
        k0 = k_lo + kk
        k_ok = (k0 + rk) < K
        x = tl.load(x_ptrs + k0, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs + k0, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        xf = x.to(tl.float32)
        sq += xf * xf                       # exact products (16 significant bits), FP32 adds per lane
        w0, w1, w2 = _bf16_planes(w)
        # One zero-started chain of MMAs per block, smallest plane first, then one FP32 add: the
        # products are exact, the chain's truncating adds span 3 x 64 products (module docstring).
        if BF16_DOT:
            d = tl.dot(x, tl.trans(w2))
            d = tl.dot(x, tl.trans(w1), d)
            d = tl.dot(x, tl.trans(w0), d)
        else:   # the interpreter, whose BF16 dots are wrong: the same BF16-valued operands in FP32
            d = tl.dot(xf, tl.trans(w2.to(tl.float32)), input_precision="ieee")
            d = tl.dot(xf, tl.trans(w1.to(tl.float32)), d, input_precision="ieee")
            d = tl.dot(xf, tl.trans(w0.to(tl.float32)), d, input_precision="ieee")
        acc += d
    y = tl.where(rn[None, :] == 24, _pair_sum(sq)[:, None], acc)

    # Split-K as `splitk_reduce`, but the last program sums and finishes only the EPI_M rows the
    # call has (its epilogue's work and latency follow the rows, its per-row arithmetic does not).
    # Whole 32-column rows (columns 25-31 hold zeros), so the loads need no column mask.
    part_ptrs = part_ptr + rm[:, None] * stride_pm + rn[None, :]
    tl.store(part_ptrs + pid_k * stride_ps, y, mask=m_ok[:, None])
    tl.debug_barrier()
    arrived = tl.atomic_add(count_ptr + pid_m, 1, sem="acq_rel", scope="gpu")
    if arrived == SPLIT - 1:
        tl.store(count_ptr + pid_m, 0)
        re = pid_m * ROWS + tl.arange(0, EPI_M)
        e_ok = (tl.arange(0, EPI_M) < ROWS) & (re < M)
        mask = e_ok[:, None]
        sum_ptrs = part_ptr + re[:, None] * stride_pm + rn[None, :]
        total = tl.load(sum_ptrs, mask=mask, other=0.0, cache_modifier=".cg")
        for s in tl.static_range(1, SPLIT):
            total += tl.load(sum_ptrs + s * stride_ps, mask=mask, other=0.0, cache_modifier=".cg")
        _mix_epilogue(total, re, e_ok, scale_ptr, base_ptr, pre_ptr, post_ptr, comb_ptr, stride_pre,
                      stride_post, stride_cn, norm_eps, hc_eps, K, ITERS, EPI_M)


class HcMixTile(NamedTuple):
    """Kernel tile and launch options for one power-of-two bucket of rows."""
    block_m: int
    block_k: int
    num_warps: int
    num_stages: int


def _mix_tile(rows: int) -> HcMixTile:
    # Only BLOCK_M follows the rows (1-8; more rows take more row tiles): the K lanes, which order
    # the FP32 sums, are the same at every row count (batch invariance).
    return HcMixTile(min(triton.next_power_of_2(rows), _MAX_BLOCK_M), _BLOCK_K, 4, 3)


def _mma_tile(rows: int) -> HcMixTile:
    # The dot's 64 rows and K block fix the arithmetic (4 warps: one warpgroup, so one wgmma covers
    # the 64 rows); block_m is only how many of the call's rows a program takes (16, 32 or 64; the
    # rest of its dot rows are zeros), which moves no bits: all of them while the weight read
    # dominates, fewer where the last program's sum of the partials would (not yet measured).
    return HcMixTile(_MMA_ROWS_PER_PROGRAM, int(_MMA_BLOCK_K), 4, 4)


KERNELS = ("fma", "mma")


@dataclass(frozen=True, eq=False)
class HcMixPlan:
    """Split and tiles of `hc_mix_` for one model dim and row capacity, and the workspace it owns.

    Build once with `HcMixPlan.build`; launches reuse it. Not for concurrent launches on two
    streams (they would share the workspace and counters).

    dim: the model dim (K = 4 * dim); max_rows: the most rows a launch may pass.
    k_per_split: K columns per program (a multiple of 128); split: programs per row tile.
    tiles: per row bucket 1, 2, 4, ... up to next_pow2(max_rows), the kernel tile (`tile(m)`).
    partials: [split, max_rows, 32] FP32 workspace (the FMA kernel: empty when split = 1);
    counters: one int32 per row tile (the FMA kernel: 8 rows, the MMA kernel: 16, its smallest
    rows per program), all 0 between launches.
    kernel: "fma" (FP32 FMAs in 32 K lanes, at most 8 rows a program) or "mma" (tensor cores: x
    BF16 times the weight's three exact BF16 planes, 64 rows a program; module docstring).
    """
    dim: int
    max_rows: int
    k_per_split: int
    split: int
    tiles: tuple[HcMixTile, ...]
    partials: torch.Tensor
    counters: torch.Tensor
    kernel: str = "fma"

    @property
    def k(self) -> int:
        return HC * self.dim

    @property
    def device(self) -> torch.device:
        return self.counters.device

    def tile(self, rows: int) -> HcMixTile:
        """The tile of a launch with `rows` rows (1 <= rows <= max_rows)."""
        return self.tiles[(rows - 1).bit_length()]

    @classmethod
    def build(cls, dim: int, max_rows: int, device: torch.device | str = "cuda", *,
              split: int | None = None, kernel: str = "fma") -> "HcMixPlan":
        """Choose the split and allocate the workspace.

        dim: the model dim, a multiple of 32; max_rows: >= 1.
        split: programs along K per row tile (default: for "fma" about 2 * SMs, at least 2 K
        grains of 128 per program: 80 programs of 256 columns at dim 5120; for "mma" 512 columns
        a program: 40 at dim 5120; neither tuned on a GPU). Not a function of max_rows, so that a
        row's bits do not depend on the plan's capacity either.
        kernel: "fma" or "mma" (`KERNELS`; see the class docstring). They give different bits.
        """
        for name, v in (("dim", dim), ("max_rows", max_rows)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if dim % 32:
            raise ValueError(f"dim={dim} must be a multiple of 32")
        if kernel not in KERNELS:
            raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
        mma = kernel == "mma"
        device = torch.device(device)
        grains = triton.cdiv(HC * dim, _K_GRAIN)
        row_tiles = triton.cdiv(max_rows, _MMA_EPI_M_MIN if mma else _MAX_BLOCK_M)
        if split is None and mma:
            split = triton.cdiv(grains, _MMA_K_PER_SPLIT // _K_GRAIN)
        elif split is None:
            split = max(1, min(2 * num_sms(device), triton.cdiv(grains, 2)))
        elif not isinstance(split, int) or isinstance(split, bool) or split < 1:
            raise ValueError(f"split must be a positive int, got {split!r}")
        k_per_split = triton.cdiv(grains, min(split, grains)) * _K_GRAIN
        split = triton.cdiv(HC * dim, k_per_split)
        tiles = tuple((_mma_tile if mma else _mix_tile)(1 << i) for i in range((max_rows - 1).bit_length() + 1))
        # the MMA kernel's last program reads every split's partial back, its own included
        partials = torch.empty(split if split > 1 or mma else 0, max_rows, _MIX_COLS, dtype=torch.float32,
                               device=device)
        counters = torch.zeros(row_tiles, dtype=torch.int32, device=device)
        return cls(dim, max_rows, k_per_split, split, tiles, partials, counters, kernel)


def hc_mix_(x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, norm_eps: float,
            hc_eps: float, sinkhorn_iters: int, pre_out: torch.Tensor, post_out: torch.Tensor,
            comb_out: torch.Tensor, plan: HcMixPlan) -> None:
    """A site's mixer (`reference.mhc.hc_mixes`) into the buffers, one launch, using the plan's workspace:
    m = (flatten(x) @ fn^T) * rsqrt(mean(flatten(x)^2) + norm_eps);
    pre = sigmoid(m[0:4] scale[0] + base[0:4]) + hc_eps; post = 2 sigmoid(m[4:8] scale[1] + base[4:8]);
    comb = sinkhorn(m[8:24] scale[2] + base[8:24] as [4, 4], sinkhorn_iters, hc_eps).

    x: [M, 4, dim] bfloat16, 0 <= M <= plan.max_rows, each row contiguous (any row stride).
    fn: [24, 4*dim] float32; scale: [3] float32; base: [24] float32 (unit stride in the last dim).
    norm_eps, hc_eps: floats; sinkhorn_iters: int >= 1 (a compile-time constant of the kernel).
    pre_out, post_out: [M, 4] float32; comb_out: [M, 4, 4] float32, comb[i, j] = weight of stream i
        in new stream j; unit stride in the last dim (comb_out: in the last two).
    plan: from `HcMixPlan.build(dim, max_rows, device)`; all tensors on plan.device.
    Within 1e-5 of the reference (not bitwise); batch-invariant: a row's outputs do not depend on
    the other rows or on M (the summation order is the plan's for every row count).
    """
    m = planned_rows(plan, HcMixPlan, x, "x", "[M, 4, dim]")
    dev, dim = plan.device, plan.dim
    require_tensor(x, "x", (torch.bfloat16,), (m, HC, dim), dev)
    if x.stride(1) != dim:
        raise ValueError(f"x must have each row contiguous ([4, dim] strides ({dim}, 1)), got strides {x.stride()}")
    require_tensor(fn, "fn", (torch.float32,), (N_MIX, HC * dim), dev)
    require_tensor(scale, "scale", (torch.float32,), (3,), dev)
    require_tensor(base, "base", (torch.float32,), (N_MIX,), dev)
    require_tensor(pre_out, "pre_out", (torch.float32,), (m, HC), dev)
    require_tensor(post_out, "post_out", (torch.float32,), (m, HC), dev)
    require_tensor(comb_out, "comb_out", (torch.float32,), (m, HC, HC), dev)
    if comb_out.stride(1) != HC:
        raise ValueError(f"comb_out must have each row's [4, 4] contiguous, got strides {comb_out.stride()}")
    for v, name in ((norm_eps, "norm_eps"), (hc_eps, "hc_eps")):
        if not isinstance(v, (int, float)) or isinstance(v, bool):
            raise TypeError(f"{name} must be a float, got {type(v).__name__}")
    if not isinstance(sinkhorn_iters, int) or isinstance(sinkhorn_iters, bool) or sinkhorn_iters < 1:
        raise ValueError(f"sinkhorn_iters must be a positive int, got {sinkhorn_iters!r}")
    if m == 0:
        return
    t = plan.tile(m)
    part = plan.partials
    if plan.kernel == "mma":
        # EPI_M: the epilogue's rows, 16, 32 or 64 to cover the call's (a row's arithmetic is the
        # same at any; below 16 rows its latency, not its width, is the cost: three compiles, not seven)
        _hc_mix_mma_kernel[(plan.split, triton.cdiv(m, t.block_m))](
            x, fn, scale, base, pre_out, post_out, comb_out, part, plan.counters, m, float(norm_eps),
            float(hc_eps), x.stride(0), fn.stride(0), pre_out.stride(0), post_out.stride(0), comb_out.stride(0),
            part.stride(0), part.stride(1),
            K=plan.k, ITERS=sinkhorn_iters, K_PER_SPLIT=plan.k_per_split, SPLIT=plan.split,
            ROWS=t.block_m, EPI_M=min(max(triton.next_power_of_2(m), _MMA_EPI_M_MIN), t.block_m),
            BF16_DOT=not interpreting(),
            NUM_STAGES=t.num_stages, num_warps=t.num_warps, num_stages=t.num_stages,
        )
        return
    _hc_mix_kernel[(triton.cdiv(m, t.block_m), plan.split)](
        x, fn, scale, base, pre_out, post_out, comb_out, part, plan.counters, m, float(norm_eps), float(hc_eps),
        x.stride(0), fn.stride(0), pre_out.stride(0), post_out.stride(0), comb_out.stride(0),
        part.stride(0), part.stride(1),
        K=plan.k, ITERS=sinkhorn_iters, K_PER_SPLIT=plan.k_per_split, SPLIT=plan.split,
        BLOCK_M=t.block_m, BLOCK_K=t.block_k, NUM_STAGES=t.num_stages,
        num_warps=t.num_warps, num_stages=t.num_stages,
    )


def hc_mix(x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, norm_eps: float,
           hc_eps: float, sinkhorn_iters: int, plan: HcMixPlan | None = None
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(pre [M, 4], post [M, 4], comb [M, 4, 4]) float32 of `hc_mix_`; x [M, 4, dim] bfloat16.

    plan: optional `HcMixPlan` (default: built here for M rows, which allocates; pass one for CUDA graphs).
    """
    if not isinstance(x, torch.Tensor) or x.dim() != 3:
        raise ValueError(f"x must be a 3-D tensor [M, 4, dim], got {getattr(x, 'shape', type(x).__name__)}")
    m = x.shape[0]
    if plan is None:
        plan = HcMixPlan.build(x.shape[2], max(1, m), x.device)
    pre = torch.empty(m, HC, dtype=torch.float32, device=x.device)
    post = torch.empty(m, HC, dtype=torch.float32, device=x.device)
    comb = torch.empty(m, HC, HC, dtype=torch.float32, device=x.device)
    hc_mix_(x, fn, scale, base, norm_eps, hc_eps, sinkhorn_iters, pre, post, comb, plan)
    return pre, post, comb
