"""The regular MXFP8 GEMM, for row counts above the low-batch limit (`LOW_BATCH_MAX_ROWS`): `bench
gemm`'s regular baseline; the step and the prefill run the low-batch linears, in chunks of at most
64 rows.

y[M, N] BF16 = sum over 32-wide K blocks of (codes . weight codes) * 2^sx * 2^sw, FP32 accumulation:
the contract of `reference.linear.mxfp8_mm`. Hopper has FP8 tensor cores but no MX-scaled ones, so
each 32-deep FP8 `tl.dot` is scaled by both UE8M0 scales in registers before it joins the FP32
accumulator; every scale is a power of two, so the scaling itself is exact.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .act_quant import act_quant_mxfp8
from .checks import require_int, require_ndim, require_num_warps, require_tensor
from .common import num_sms
from .rounding import bf16_rne_bits, ue8m0_to_fp32


@triton.jit
def _fp8_mm_kernel(
    a_ptr, sa_ptr, w_ptr, sw_ptr, out_ptr, M, N, K,
    stride_am, stride_sam, stride_wn, stride_swn, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    # Grouped tile order: GROUP_M row tiles share each weight tile while it is in L2.
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    first_m = (pid // (GROUP_M * tiles_n)) * GROUP_M
    group_m = min(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * tiles_n)) % group_m
    pid_n = (pid % (GROUP_M * tiles_n)) // group_m

    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # Rows and columns past the edge read (wrapped) valid data and are masked at the store, so the
    # loads of the K loop need no masks (K is a multiple of BLOCK_K).
    lm = rm % M
    ln = rn % N
    rk = tl.arange(0, 32)
    a_ptrs = a_ptr + lm[:, None] * stride_am + rk[None, :]  # [BLOCK_M, 32]
    w_ptrs = w_ptr + ln[:, None] * stride_wn + rk[None, :]  # [BLOCK_N, 32]
    sa_ptrs = sa_ptr + lm * stride_sam
    sw_ptrs = sw_ptr + (ln // 32) * stride_swn

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        for j in tl.static_range(BLOCK_K // 32):
            kb = k0 // 32 + j
            a = tl.load(a_ptrs + (k0 + 32 * j))
            w = tl.load(w_ptrs + (k0 + 32 * j))
            sa = ue8m0_to_fp32(tl.load(sa_ptrs + kb))
            sw = ue8m0_to_fp32(tl.load(sw_ptrs + kb))
            # One 32-deep FP8 dot per scale block: its FP32 partial is scaled before it is added.
            part = tl.dot(a, tl.trans(w))
            acc += part * (sa[:, None] * sw[None, :])

    mask = (rm[:, None] < M) & (rn[None, :] < N)
    tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :], bf16_rne_bits(acc), mask=mask)


class Fp8MmConfig(NamedTuple):
    """Tile sizes and launch options of `_fp8_mm_kernel` (chosen once per shape): block_m, block_n
    powers of two >= 16 (a dot's M and N), block_k a positive multiple of 32 dividing K, group_m >= 1
    row tiles per group, num_warps a power of two in 1..16, num_stages >= 1 (`check_config`)."""
    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int


def check_config(config, k: int) -> None:
    """Raise TypeError unless config is an Fp8MmConfig, ValueError naming the field unless its
    fields are as `Fp8MmConfig` says for a product of depth k."""
    if not isinstance(config, Fp8MmConfig):
        raise TypeError(f"config must be an Fp8MmConfig, got {type(config).__name__}")
    require_int(config.block_m, "config.block_m", 16, power_of_two=True)
    require_int(config.block_n, "config.block_n", 16, power_of_two=True)
    require_int(config.block_k, "config.block_k")
    if k % config.block_k or config.block_k % 32:
        raise ValueError(f"config.block_k={config.block_k} must be a multiple of 32 dividing K={k}")
    require_int(config.group_m, "config.group_m")
    require_num_warps(config.num_warps, "config.num_warps")
    require_int(config.num_stages, "config.num_stages")


# Largest tile first. 128x128 with 8 warps: two m64 warpgroups, the FP32 accumulator plus the
# 32-deep partial at 128 registers per thread (128x256 would spill), 32 KB of operands per stage.
# Smaller tiles only when the large ones leave SMs idle.
_TILES = ((128, 128, 8), (64, 128, 4), (64, 64, 4))


def fp8_mm_config(m: int, n: int, k: int, device: torch.device | str = "cuda") -> Fp8MmConfig:
    """The fixed config for an [m, k] x [n, k]^T product on `device`: the largest tile that still
    gives every SM a tile, else the smallest; BLOCK_K four 32-blocks when K allows it."""
    sms = num_sms(torch.device(device))
    block_m, block_n, warps = _TILES[-1]
    for bm, bn, w in _TILES:
        if triton.cdiv(m, bm) * triton.cdiv(n, bn) >= sms:
            block_m, block_n, warps = bm, bn, w
            break
    block_k = next(bk for bk in (128, 64, 32) if k % bk == 0) if k % 32 == 0 else 32
    return Fp8MmConfig(block_m, block_n, block_k, group_m=8, num_warps=warps, num_stages=4)


def fp8_mm_(codes: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, w_scale: torch.Tensor,
            out: torch.Tensor, config: Fp8MmConfig | None = None) -> None:
    """Write y = `reference.linear.mxfp8_mm(codes, x_scale, weight, w_scale)` into out.

    codes: [M, K] float8_e4m3fn (or uint8 bytes), MXFP8 activation codes, K a multiple of 32.
    x_scale: [M, K/32] uint8 UE8M0 bytes (or float8_e8m0fnu).
    weight: [N, K] float8_e4m3fn (or uint8 bytes).
    w_scale: [ceil(N/32), K/32] uint8 UE8M0 bytes (or float8_e8m0fnu), one per 32x32 weight block.
    out: [M, N] bfloat16.
    config: from `fp8_mm_config` (default: chosen from the shape; pass it to keep host work at build).
    Every operand needs unit stride in its last dimension and the same device. Scale bytes must be
    1..254 (unchecked; the MX scale rule gives 105..247 for activations, 255 gives NaN).
    """
    m, k = require_ndim(codes, "codes", "[M, K]")
    n = require_ndim(weight, "weight", "[N, K]")[0]
    if k % 32:
        raise ValueError(f"codes: K={k} must be a multiple of 32 (the MXFP8 block)")
    fp8 = (torch.float8_e4m3fn, torch.uint8)
    ue8m0 = (torch.uint8, torch.float8_e8m0fnu)
    dev = codes.device
    require_tensor(codes, "codes", fp8, (m, k), dev)
    require_tensor(x_scale, "x_scale", ue8m0, (m, k // 32), dev)
    require_tensor(weight, "weight", fp8, (n, k), dev)
    require_tensor(w_scale, "w_scale", ue8m0, (triton.cdiv(n, 32), k // 32), dev)
    require_tensor(out, "out", (torch.bfloat16,), (m, n), dev)
    if config is not None:
        check_config(config, k)
    if m == 0 or n == 0:
        return
    if k == 0:
        out.zero_()
        return
    cfg = fp8_mm_config(m, n, k, dev) if config is None else config
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n),)
    _fp8_mm_kernel[grid](
        codes.view(torch.float8_e4m3fn), x_scale.view(torch.uint8), weight.view(torch.float8_e4m3fn),
        w_scale.view(torch.uint8), out.view(torch.int16), m, n, k,
        codes.stride(0), x_scale.stride(0), weight.stride(0), w_scale.stride(0), out.stride(0),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )


def fp8_mm(codes: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """y = `reference.linear.mxfp8_mm(codes, x_scale, weight, w_scale)`; operands as in `fp8_mm_`.

    Returns bfloat16 [M, N].
    """
    if not isinstance(codes, torch.Tensor) or not isinstance(weight, torch.Tensor):
        raise TypeError("codes and weight must be torch.Tensors")
    out = torch.empty(codes.shape[0], weight.shape[0], dtype=torch.bfloat16, device=codes.device)
    fp8_mm_(codes, x_scale, weight, w_scale, out)
    return out


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """y = `reference.linear.fp8_linear(x, weight, w_scale)`: MXFP8-quantize x, then `fp8_mm`.

    x: [M, K] bfloat16, K a multiple of 32; weight: [N, K] float8_e4m3fn;
    w_scale: [ceil(N/32), K/32] UE8M0 bytes. Returns bfloat16 [M, N].
    """
    return fp8_mm(*act_quant_mxfp8(x), weight, w_scale)
