"""RoPE with YaRN (spec section 5): adjacent channel pairs of the 64-dim tail, FP32, in place."""

from __future__ import annotations

import math

import torch

from ..config import ModelConfig


def rope_freqs(cfg: ModelConfig, ratio: int) -> torch.Tensor:
    """Per-pair frequencies f_i [rope_head_dim/2] FP32 of a layer with compress ratio `ratio`.

    SWA layers (ratio 0): base `rope_theta`, no YaRN. Compressed layers: base
    `compress_rope_theta` with YaRN (`rope_factor`, `original_seq_len`, `beta_fast`, `beta_slow`).
    """
    dim = cfg.rope_head_dim
    base = cfg.rope_theta if ratio == 0 else cfg.compress_rope_theta
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    if ratio != 0 and cfg.original_seq_len > 0:
        def corr(n_rot: float) -> float:
            return dim * math.log(cfg.original_seq_len / (n_rot * 2 * math.pi)) / (2 * math.log(base))

        low = max(math.floor(corr(cfg.beta_fast)), 0)
        high = min(math.ceil(corr(cfg.beta_slow)), dim - 1)
        ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / max(high - low, 1e-3), 0, 1)
        freqs = freqs / cfg.rope_factor * ramp + freqs * (1 - ramp)
    return freqs


def rope_cis(freqs: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Rotations e^(j * p * f_i) [n, dim/2] complex64 for positions [n] (angle computed in FP32)."""
    angles = torch.outer(positions.to(torch.float32), freqs.to(positions.device))  # [n, dim/2]
    return torch.polar(torch.ones_like(angles), angles)


def apply_rope(x: torch.Tensor, cis: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate the adjacent pairs (2i, 2i+1) of `x` [n, ..., 64] by `cis` [n, 32]; FP32 math, x's dtype out.

    inverse=True applies the conjugate rotation (the output's inverse RoPE).
    """
    n = x.shape[0]
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2).contiguous())
    c = cis.conj() if inverse else cis
    c = c.reshape(n, *([1] * (x.dim() - 2)), c.shape[-1])  # broadcast over heads
    return torch.view_as_real(xc * c).flatten(-2).to(x.dtype)


def rope_tail(x: torch.Tensor, cis: torch.Tensor, rope_dim: int, inverse: bool = False) -> torch.Tensor:
    """`x` [n, ..., D] with RoPE applied to its last `rope_dim` channels (a new tensor)."""
    out = x.clone()
    out[..., -rope_dim:] = apply_rope(x[..., -rope_dim:], cis, inverse)
    return out
