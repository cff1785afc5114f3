"""Low-latency side projections: y[M, N] FP32 = x[M, K] BF16 @ W[N, K]^T for 1 <= M <= 64.

The shapes (spec section 3 steps 4, 5, 7): the compressor 5120 -> 1024 (ratio 2: `wkv` and `wgate`
stacked, FP32 weights) or 5120 -> 512 (ratio 1, BF16), `indexer.weights_proj` 5120 -> 32 and
`indexer.wk` 512 -> 128 (BF16). At these row counts the op is bound by reading W once, and N is
too small to give every SM a tile, so K is split across programs as well.

Math: every product is formed and accumulated in FP32. For a BF16 weight the kernel runs an FP32
`tl.dot` at TF32 input precision: BF16 values have 8 significant bits and TF32 keeps 11, so the
operands pass unchanged and every product is exact, as in an FP32 FMA, but on the tensor cores
(and right in the interpreter, where BF16 dots are not). The tensor cores add in FP32 with their
own rounding (about 1e-6 relative here, against ~1e-7 for FMAs) and may flush subnormal inputs
(below 2^-126). An FP32 weight would lose bits in TF32: it takes a `tf32x3` dot (W = big + small
TF32 parts, x exact in TF32), whose products are within ~2^-22 relative of FP32's exact ones, on
the tensor cores - an IEEE FP32 dot lowers to FMAs and measured 4x slower at 16 rows on an H200.

Batch invariance: a row's outputs do not depend on the other rows or the row count. Per weight
dtype one arithmetic serves every row count (the FP32 weight's register-blocked FMAs at 1-8 rows
are gone: their K depth, and so their summation tree, changed with the rows), the K split is the
plan's, and a program takes at most 32 rows (BLOCK_M 16 or 32; more rows run as more row tiles):
at BLOCK_M = 64 Triton lowers the dot to wgmma instead of mma.sync m16n8k8 (sm_90 PTX), another
MMA whose sums inside may round differently.

Split K: each program owns BLOCK_N rows of W and a K range, writes its FP32 partial to the plan's
workspace, and the last program of a tile to arrive (an atomic counter per tile) adds the
partials in split order and resets the counter (`splitk_reduce`). One launch, deterministic; a
second reduction kernel would cost another launch (~1.3 us in a CUDA graph) on ops whose floor is
1-5 us. A plan's `group` lets one program run that many consecutive K ranges one after another,
each its own partial: fewer programs, the same partials and the same sums, so the same bits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .checks import planned_rows, require_int, require_tensor
from .common import num_sms, splitk_reduce
from .fp4 import bf16_round
from .rounding import bf16_rne_bits, to_f32

MODE_TF32 = 0   # tl.dot, TF32 inputs: exact products of BF16-valued operands, tensor cores
MODE_IEEE = 1   # tl.dot, tf32x3 (split FP32 weight, tensor cores): FP32 weights
MODE_FMA = 2    # register-blocked FMA, reduced over K once at the end (ops.hc_mix)
MAX_BLOCK_M = 32  # rows per program: mma.sync m16n8k8 at 16 and 32 (wgmma from 64)

_K_GRAIN = 128  # every split but the last covers a multiple of this, so every BLOCK_K divides it


@triton.jit
def ll_dot(x, w, acc, MODE: tl.constexpr):
    """One K step of the projection: acc + x @ w^T for x [BLOCK_M, BLOCK_K] and w [BLOCK_N, BLOCK_K]
    FP32 (BF16 values, or the FP32 weight), the dot of MODE_TF32 or MODE_IEEE (module docstring).
    The one home of the dot form, also run by `ops.compressor_tail` on the latent it normalizes."""
    if MODE == 0:
        return tl.dot(x, tl.trans(w), acc, input_precision="tf32")
    else:
        return tl.dot(x, tl.trans(w), acc, input_precision="tf32x3")


@triton.jit
def _ll_bf16_kernel(
    x_ptr, w_ptr, out_ptr, part_ptr, count_ptr, M, N, K,
    stride_xm, stride_wn, stride_om, stride_ps, stride_pm, scale,
    K_PER_SPLIT: tl.constexpr, SPLIT: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, MODE: tl.constexpr,
    NUM_STAGES: tl.constexpr, HEAD_W: tl.constexpr,
):
    # Grid: (N tiles, K splits / GROUP, row tiles of BLOCK_M rows); a program runs the GROUP
    # consecutive splits from pid_k * GROUP, each from a zero accumulator, as GROUP programs would.
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    n_ok = rn < N
    x_ptrs = x_ptr + rm[:, None] * stride_xm + rk[None, :]
    w_ptrs = w_ptr + rn[:, None] * stride_wn + rk[None, :]
    mask = m_ok[:, None] & n_ok[None, :]
    part_ptrs = part_ptr + rm[:, None] * stride_pm + rn[None, :]

    for g in tl.static_range(GROUP):
        pid_k = tl.program_id(1) * GROUP + g
        k_lo = pid_k * K_PER_SPLIT
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        # A constant trip count; past K (only in the last split) the loads are masked off.
        for kk in tl.range(0, K_PER_SPLIT, BLOCK_K, num_stages=NUM_STAGES):
            k0 = k_lo + kk
            k_ok = (k0 + rk) < K
            x = to_f32(tl.load(x_ptrs + k0, mask=m_ok[:, None] & k_ok[None, :], other=0.0))
            w = to_f32(tl.load(w_ptrs + k0, mask=n_ok[:, None] & k_ok[None, :], other=0.0))
            acc = ll_dot(x, w, acc, MODE)
        y = acc
        if g < GROUP - 1:   # published now; the last one in splitk_reduce
            tl.store(part_ptrs + pid_k * stride_ps, y, mask=mask)

    out_ptrs = out_ptr + rm[:, None] * stride_om + rn[None, :]
    if SPLIT == 1:
        _store_out(out_ptrs, y, mask, scale, HEAD_W)
    else:
        last, total = splitk_reduce(y, part_ptrs, stride_ps, mask, count_ptr + pid_m * tl.num_programs(0) + pid_n,
                                    pid_k, SPLIT, GROUP)
        _store_out(out_ptrs, total, mask & last, scale, HEAD_W)


@triton.jit
def _store_out(out_ptrs, y, mask, scale, HEAD_W: tl.constexpr):
    """Store the FP32 sums y, or (HEAD_W) the indexer's head weights bf16(bf16(y) * scale) as BF16
    bits into an int16 view: `index_query`'s rounding of w, two RNE roundings with the FP32 product
    between them (a product alone: no FMA contraction can touch it)."""
    if HEAD_W:
        tl.store(out_ptrs, bf16_rne_bits(bf16_round(y) * scale), mask=mask)
    else:
        tl.store(out_ptrs, y, mask=mask)


class LlBf16Tile(NamedTuple):
    """Kernel tile and launch options for one power-of-two bucket of rows."""
    block_m: int
    block_k: int
    mode: int          # MODE_TF32 or MODE_IEEE
    num_warps: int
    num_stages: int


def _tile_for(rows: int, weight_dtype: torch.dtype) -> LlBf16Tile:
    # Only BLOCK_M follows the rows (16 or 32; more rows take more row tiles): the mode and the K
    # depth of each dot, which order the FP32 sums (tf32x3 sums its small-part products per dot),
    # are the weight dtype's for every row count.
    bm = min(max(16, triton.next_power_of_2(rows)), MAX_BLOCK_M)
    if weight_dtype == torch.bfloat16:
        return LlBf16Tile(bm, 128, MODE_TF32, 4, 3)
    return LlBf16Tile(bm, 32, MODE_IEEE, 4, 3)


@dataclass(frozen=True, eq=False)
class LlBf16Plan:
    """Split and tiles of `ll_bf16` for one weight shape, and the split-K workspace it owns.

    Build once per (N, K, max rows, weight dtype) with `LlBf16Plan.build`; launches reuse it. Not
    for concurrent launches on two streams (they would share the workspace and counters).

    n, k: the weight's [N, K]; max_rows: the most rows a launch may pass (1..64).
    weight_dtype: torch.bfloat16 or torch.float32.
    block_n: weight rows per program; k_per_split: K columns per program (a multiple of 128);
    split: K ranges per block of rows (ceil(K / k_per_split)), each its own FP32 partial.
    group: K ranges a program runs one after another (a divisor of split): split / group programs
    per block of rows, the same partials and sums, so the same bits as group 1.
    tiles: per row bucket 1, 2, 4, ... up to next_pow2(max_rows), the kernel tile (`tile(m)`).
    partials: [split, max_rows, n] FP32 workspace; counters: [ceil(max_rows / MAX_BLOCK_M) *
    ceil(n / block_n)] int32 (per row tile and N tile), all 0 between launches.
    """
    n: int
    k: int
    max_rows: int
    weight_dtype: torch.dtype
    block_n: int
    k_per_split: int
    split: int
    tiles: tuple[LlBf16Tile, ...]
    partials: torch.Tensor
    counters: torch.Tensor
    group: int = 1

    @property
    def device(self) -> torch.device:
        return self.partials.device

    @property
    def n_tiles(self) -> int:
        return triton.cdiv(self.n, self.block_n)

    def tile(self, rows: int) -> LlBf16Tile:
        """The tile of a launch with `rows` rows (1 <= rows <= max_rows)."""
        return self.tiles[(rows - 1).bit_length()]

    @classmethod
    def build(cls, n: int, k: int, max_rows: int, weight_dtype: torch.dtype,
              device: torch.device | str = "cuda", *, split: int | None = None,
              block_n: int = 32, group: int = 1) -> "LlBf16Plan":
        """Choose the split for about two programs per SM and allocate the workspace.

        split: K ranges (default: about 2 * SMs / ceil(n / block_n), at most K / 512);
        block_n: weight rows per program, a power of two >= 16;
        group: K ranges per program, a divisor of the split (fewer programs, the same bits).
        """
        for name, v in (("n", n), ("k", k), ("max_rows", max_rows), ("block_n", block_n)):
            require_int(v, name)
        if max_rows > 64:
            raise ValueError(f"max_rows must be at most 64 (the low-batch limit), got {max_rows}")
        if weight_dtype not in (torch.bfloat16, torch.float32):
            raise TypeError(f"weight_dtype must be torch.bfloat16 or torch.float32, got {weight_dtype}")
        if block_n < 16 or block_n & (block_n - 1):
            raise ValueError(f"block_n must be a power of two >= 16, got {block_n}")
        device = torch.device(device)
        n_tiles = triton.cdiv(n, block_n)
        grains = triton.cdiv(k, _K_GRAIN)
        if split is None:
            # About two programs per SM, but at least 4 K steps each: the tiny weights are bound
            # by latency, where fewer, longer (pipelined) programs and fewer partials win.
            split = max(1, min(round(2 * num_sms(device) / n_tiles), triton.cdiv(grains, 4)))
        else:
            require_int(split, "split")
        k_per_split = triton.cdiv(grains, min(split, grains)) * _K_GRAIN
        split = triton.cdiv(k, k_per_split)
        require_int(group, "group")
        if split % group:
            raise ValueError(f"group must divide the plan's split ({split} K ranges), got {group}")
        tiles = tuple(_tile_for(1 << i, weight_dtype) for i in range((max_rows - 1).bit_length() + 1))
        partials = torch.empty(split if split > 1 else 0, max_rows, n, dtype=torch.float32, device=device)
        counters = torch.zeros(triton.cdiv(max_rows, MAX_BLOCK_M) * n_tiles, dtype=torch.int32, device=device)
        return cls(n, k, max_rows, weight_dtype, block_n, k_per_split, split, tiles, partials, counters, group)


def ll_bf16_(plan: LlBf16Plan, x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, *,
             scale: float | None = None) -> None:
    """Write out = x.float() @ w.float()^T, accumulated in FP32, using the plan's workspace.

    plan: from `LlBf16Plan.build(N, K, max_rows, w.dtype, device)`.
    x: [M, K] bfloat16, 1 <= M <= plan.max_rows (M = 0 writes nothing), unit stride in K.
    w: [N, K] plan.weight_dtype: bfloat16, or float32 for the ratio-2 compressor, whose FP32
       weights keep FP32 semantics (the products are FP32 roundings, the sums FP32).
    out: [M, N] float32, unit stride in N. All on plan.device.
    scale: None, or a float: then out is [M, N] bfloat16 and receives the indexer's head weights
       w = bf16(bf16(y) * scale) of the FP32 sums y (spec section 3 step 7, `index_weights`), bit
       for bit what `index_query_` writes as w_out from wproj = y (the same FP32 sums, the same two
       roundings), written by the program that finishes the sums: no launch of their own.
    Batch-invariant: a row's outputs do not depend on the other rows or on M (the FP32 summation
    order is the plan's for every row count; see the module docstring).
    """
    m = planned_rows(plan, LlBf16Plan, x, "x", "[M, K]")
    dev = plan.device
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))):
        raise TypeError(f"scale must be a float or None, got {type(scale).__name__}")
    head_w = scale is not None
    require_tensor(x, "x", (torch.bfloat16,), (m, plan.k), dev)
    require_tensor(w, "w", (plan.weight_dtype,), (plan.n, plan.k), dev)
    require_tensor(out, "out", (torch.bfloat16 if head_w else torch.float32,), (m, plan.n), dev)
    if m == 0:
        return
    t = plan.tile(m)
    part = plan.partials
    dst = out.view(torch.int16) if head_w else out     # BF16 bits stored as int16 (`bf16_rne_bits`)
    _ll_bf16_kernel[(plan.n_tiles, plan.split // plan.group, triton.cdiv(m, t.block_m))](
        x, w, dst, part, plan.counters, m, plan.n, plan.k,
        x.stride(0), w.stride(0), dst.stride(0), part.stride(0), part.stride(1), float(scale or 0.0),
        K_PER_SPLIT=plan.k_per_split, SPLIT=plan.split, GROUP=plan.group, BLOCK_M=t.block_m, BLOCK_N=plan.block_n,
        BLOCK_K=t.block_k, MODE=t.mode, NUM_STAGES=t.num_stages, HEAD_W=head_w, num_warps=t.num_warps,
        num_stages=t.num_stages,
    )


def ll_bf16(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None,
            plan: LlBf16Plan | None = None, *, scale: float | None = None) -> torch.Tensor:
    """y = x.float() @ w.float()^T in FP32: x [M, K] bfloat16 (M <= 64), w [N, K] bfloat16 or float32.

    out: optional [M, N] float32 buffer (bfloat16 with scale); plan: optional `LlBf16Plan`
    (default: built here, which allocates; pass one for CUDA graphs); scale: as `ll_bf16_` (the
    head weights bf16(bf16(y) * scale) instead of y). Returns out (or a new [M, N] tensor).
    """
    if not isinstance(x, torch.Tensor) or not isinstance(w, torch.Tensor) or x.dim() != 2 or w.dim() != 2:
        raise ValueError("x and w must be 2-D tensors: x [M, K], w [N, K]")
    if w.dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(f"w must have dtype torch.bfloat16 or torch.float32, got {w.dtype}")
    if x.shape[0] > 64:
        raise ValueError(f"x has {x.shape[0]} rows; ll_bf16 serves at most 64 (the low-batch limit)")
    if plan is None:
        plan = LlBf16Plan.build(w.shape[0], w.shape[1], max(1, x.shape[0]), w.dtype, x.device)
    if out is None:
        out = torch.empty(x.shape[0], w.shape[0], dtype=torch.float32 if scale is None else torch.bfloat16,
                          device=x.device)
    ll_bf16_(plan, x, w, out, scale=scale)
    return out
