"""Linears and RMSNorm (spec section 3), computed per row so that results do not depend on the
number of rows in a call.

An FP8 linear quantizes its BF16 input per row in MXFP8 blocks of 32, multiplies each 32-wide K
block of codes by the FP8 weight's codes in FP32, scales the block partial by both UE8M0 scales,
adds the partials in K order in FP32 and rounds the output to BF16.
"""

from __future__ import annotations

import torch

from ..formats import mxfp8_quantize, ue8m0_decode

# Rows per chunk of the elementwise dot products: bounds the [rows, out, in] temporary.
_CHUNK_ELEMS = 1 << 20


def rowwise_dot(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [n, K] FP32 times w [N, K] FP32 transposed -> [n, N] FP32, each row reduced on its own.

    A plain matmul may round differently for different n; a per-element reduction over K does
    not, which makes the reference batch-invariant.
    """
    n, k = x.shape
    step = max(1, _CHUNK_ELEMS // max(1, w.shape[0] * k))
    return torch.cat([(x[i:i + step, None, :] * w[None]).sum(-1) for i in range(0, n, step)]) \
        if n else x.new_zeros(0, w.shape[0])


def _scale_bytes(scale: torch.Tensor) -> torch.Tensor:
    return scale.view(torch.uint8) if scale.dtype != torch.uint8 else scale


def _block_partials(xq: torch.Tensor, wq: torch.Tensor) -> torch.Tensor:
    """partial[r, o, b] = sum_c xq[r, b, c] * wq[o, b, c] for E4M3 codes xq [n, KB, 32], wq [N, KB, 32].

    Computed in FP64, where it is exact whatever the summation order (each product of two E4M3
    values is a multiple of 2^-18 below 2^18, so a sum of 32 needs at most 41 bits), then rounded
    once to FP32: the same for any number of rows.
    """
    p = torch.bmm(xq.transpose(0, 1).double(), wq.permute(1, 2, 0).double())   # [KB, n, N]
    return p.permute(1, 2, 0).float()


def mxfp8_mm(codes: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
             out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """y = bf16(sum_kb (xq[:, kb] . wq[:, kb]) * sx[:, kb] * sw[:, kb]): an MXFP8 activation times an
    FP8 weight with 32x32 UE8M0 block scales (the contract of `ops.low_latency_mm`).

    codes: [n, K] float8_e4m3fn; x_scale: [n, K/32] UE8M0 (uint8); weight: [N, K] float8_e4m3fn;
    scale: [ceil(N/32), K/32] UE8M0 (float8_e8m0fnu or uint8). Returns [n, N] in `out_dtype`
    (BF16; FP32 gives the unrounded sum, a tensor-parallel partial that is reduced before rounding).
    """
    n, k = codes.shape
    out = weight.shape[0]
    if weight.shape[1] != k:
        raise ValueError(f"mxfp8_mm: activation has K={k} but weight is {tuple(weight.shape)}")
    kb = k // 32
    partial = _block_partials(codes.float().reshape(n, kb, 32), weight.float().reshape(out, kb, 32))  # [n, N, KB]
    sw = ue8m0_decode(_scale_bytes(scale)).repeat_interleave(32, 0)[:out, :kb]   # [N, KB]
    sxf = ue8m0_decode(_scale_bytes(x_scale))                                     # [n, KB]
    acc = torch.zeros(n, out, dtype=torch.float32, device=codes.device)
    for b in range(kb):  # K order
        acc = acc + partial[:, :, b] * sxf[:, b:b + 1] * sw[None, :, b]
    return acc.to(out_dtype)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
               out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """An FP8 linear: quantize x [n, K] BF16 per row to MXFP8 (blocks of 32), then `mxfp8_mm`.

    weight: [N, K] float8_e4m3fn; scale: [ceil(N/32), ceil(K/32)] UE8M0. Requires K % 32 == 0.
    Returns [n, N] in out_dtype (BF16, or the FP32 sum before rounding).
    """
    if weight.shape[1] != x.shape[1]:
        raise ValueError(f"fp8_linear: x has K={x.shape[1]} but weight is {tuple(weight.shape)}")
    codes, sx = mxfp8_quantize(x)                                   # [n, K], [n, K/32]
    return mxfp8_mm(codes, sx, weight, scale, out_dtype)


def bf16_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """y = bf16(x @ weight^T) with FP32 accumulation; x [n, K] BF16, weight [N, K] BF16 -> [n, N] BF16."""
    return rowwise_dot(x.float(), weight.float()).to(torch.bfloat16)


def fp32_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """y = x.float() @ weight.float()^T in FP32 (the ratio-2 compressor); [n, K] -> [n, N] FP32."""
    return rowwise_dot(x.float(), weight.float())


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """bf16(weight * (x * rsqrt(mean(x^2) + eps))) computed in FP32 over the last dim."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * xf).to(torch.bfloat16)
