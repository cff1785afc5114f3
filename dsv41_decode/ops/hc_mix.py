"""The mixer of an mHC site (spec section 4; `reference.mhc.hc_mixes`): pre, post and comb from the
streams entering the site, one launch.

The [24, hc*dim] projection and the sum of squares run split over K: each program writes an FP32 partial [rows, 25] (the 24
  projections, then the sum of squares packed in column 24) to the plan's workspace, and the last
  program of a row tile to arrive (`common.splitk_reduce`: an atomic counter that it resets, so a
  CUDA-graph replay needs no memset) adds the partials in split order, then computes the sigmoids
  and the Sinkhorn rounds. Deterministic and batch-invariant: a row's outputs do not depend on the
  other rows or the row count. Every row count runs the same arithmetic: FP32 products (FMA on the
  GPU) accumulated in 32 lanes along K, one lane per K residue mod 32, in K order, then the lanes
  added in a fixed pairwise tree, and the epilogue's sums over 4 and 8 terms in fixed trees too
  (`_pair_sum`: never `tl.sum`, whose tree follows the register layout, and that follows the tile's
  shape); a program takes at most 8 rows, more rows take more row tiles. Sums are in a different
  order than the reference's (and on the GPU the products may be FMA-contracted, and exp and
  division approximate to a few ulps), so the outputs agree with the reference within 1e-5
  absolute, not bit for bit (measured in the interpreter at dims 64-5120, 1-70 rows: at most
  4.8e-7; see tests/ops/test_mhc.py).

Takes hc = 4 streams (the model's hc_mult; config.py rejects others).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .checks import planned_rows, require_int, require_ndim, require_tensor
from .common import num_sms, splitk_reduce
from .mhc import HC, N_MIX
from .rounding import to_f32

_MIX_COLS = 32             # the outputs padded to a power of two; column N_MIX carries the sum of squares
_K_GRAIN = 128  # every split but the last covers a multiple of this, so every BLOCK_K divides it
_BLOCK_K = 32     # K lanes of the FMA accumulator, at every row count
_MAX_BLOCK_M = 8  # the [BLOCK_M, 32, 32] accumulator at <= 64 FP32 registers per thread (4 warps)


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
    C a power of two from 2 to 32. Unlike `tl.sum`, whose tree follows the register layout (which
    Triton picks from the whole tile's shape), the same bits whatever R is."""
    R: tl.constexpr = x.shape[0]
    C: tl.constexpr = x.shape[1]
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
        x = to_f32(tl.load(x_ptrs + k0, mask=m_ok[:, None] & k_ok[None, :], other=0.0))
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


@dataclass(frozen=True, eq=False)
class HcMixPlan:
    """Split and tiles of `hc_mix_` for one model dim and row capacity, and the workspace it owns.

    Build once with `HcMixPlan.build`; launches reuse it. Not for concurrent launches on two
    streams (they would share the workspace and counters).

    dim: the model dim (K = 4 * dim); max_rows: the most rows a launch may pass.
    k_per_split: K columns per program (a multiple of 128); split: programs per row tile.
    tiles: per row bucket 1, 2, 4, ... up to next_pow2(max_rows), the kernel tile (`tile(m)`).
    partials: [split, max_rows, 32] FP32 workspace (empty when split = 1); counters:
    [ceil(max_rows / 8)] int32, one per row tile, all 0 between launches.
    """
    dim: int
    max_rows: int
    k_per_split: int
    split: int
    tiles: tuple[HcMixTile, ...]
    partials: torch.Tensor
    counters: torch.Tensor

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
              split: int | None = None) -> "HcMixPlan":
        """Choose the split and allocate the workspace.

        dim: the model dim, a multiple of 32; max_rows: >= 1.
        split: programs along K per row tile (default: about 2 * SMs, at least 2 K grains of 128
        per program: 80 programs of 256 columns at dim 5120; 40 measured slower alone at 1-64
        rows, `docs/results/gpu-tests-h200.txt` run DQ, and 16 slower in the step at 1-8 rows,
        docs/step.md). Not a function of max_rows, so that a row's bits do not depend on the plan's
        capacity either.
        """
        require_int(dim, "dim")
        require_int(max_rows, "max_rows")
        if dim % 32:
            raise ValueError(f"dim={dim} must be a multiple of 32")
        device = torch.device(device)
        grains = triton.cdiv(HC * dim, _K_GRAIN)
        row_tiles = triton.cdiv(max_rows, _MAX_BLOCK_M)
        if split is None:
            split = max(1, min(2 * num_sms(device), triton.cdiv(grains, 2)))
        else:
            require_int(split, "split")
        k_per_split = triton.cdiv(grains, min(split, grains)) * _K_GRAIN
        split = triton.cdiv(HC * dim, k_per_split)
        tiles = tuple(_mix_tile(1 << i) for i in range((max_rows - 1).bit_length() + 1))
        partials = torch.empty(split if split > 1 else 0, max_rows, _MIX_COLS, dtype=torch.float32, device=device)
        counters = torch.zeros(row_tiles, dtype=torch.int32, device=device)
        return cls(dim, max_rows, k_per_split, split, tiles, partials, counters)


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
    require_int(sinkhorn_iters, "sinkhorn_iters")
    if m == 0:
        return
    t = plan.tile(m)
    part = plan.partials
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
    m = require_ndim(x, "x", "[M, 4, dim]")[0]
    if plan is None:
        plan = HcMixPlan.build(x.shape[2], max(1, m), x.device)
    pre = torch.empty(m, HC, dtype=torch.float32, device=x.device)
    post = torch.empty(m, HC, dtype=torch.float32, device=x.device)
    comb = torch.empty(m, HC, HC, dtype=torch.float32, device=x.device)
    hc_mix_(x, fn, scale, base, norm_eps, hc_eps, sinkhorn_iters, pre, post, comb, plan)
    return pre, post, comb
