"""KV compression and index keys of a KV-source (Full) layer (spec section 3, steps 4-6).

Entry j of a ratio-r layer covers positions j*r .. j*r+r-1; it is published by the token that
completes the group (p + 1 = (j + 1) * r) and rotated at the group's first position p + 1 - r.
"""

from __future__ import annotations

import torch

from ..formats import mxfp4_fake, nvfp4_fake
from .linear import bf16_linear, fp32_linear, rms_norm
from .rope import rope_tail


def compress_ratio2(x: torch.Tensor, positions: torch.Tensor, wkv: torch.Tensor, wgate: torch.Tensor,
                    state_kv: torch.Tensor, state_score: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the ratio-2 compressor over one request's rows in order; update its open-group state in place.

    x: [n, dim] BF16 rows at consecutive `positions` [n]; wkv, wgate: [512, dim] FP32.
    state_kv [2, 512] FP32 (zeros when fresh), state_score [2, 512] FP32 (-inf when fresh): the open
    group's rows at slot p % 2. Returns (c [g, 512] FP32 for each completed group, the completing
    rows' indices [g] into the n rows). c = sum_j softmax_j(score_j) * kv_j per channel.
    """
    kv, score = ratio2_inputs(x, wkv, wgate)
    return compress_ratio2_rows(kv, score, positions, state_kv, state_score)


def ratio2_inputs(x: torch.Tensor, wkv: torch.Tensor, wgate: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The ratio-2 compressor's per-row inputs: (kv = x @ wkv^T, score = x @ wgate^T), FP32 [n, 512]."""
    return fp32_linear(x, wkv), fp32_linear(x, wgate)


def compress_ratio2_rows(kv: torch.Tensor, score: torch.Tensor, positions: torch.Tensor,
                         state_kv: torch.Tensor, state_score: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`compress_ratio2` from the rows' inputs (`ratio2_inputs`): row p writes state[p % 2] (a bit
    copy) and, at odd p, completes a group. Returns (c [g, 512] FP32, completing rows [g])."""
    out, rows = [], []
    for i, p in enumerate(positions.tolist()):
        state_kv[p % 2] = kv[i]
        state_score[p % 2] = score[i]
        if (p + 1) % 2 == 0:
            out.append((state_kv * torch.softmax(state_score, dim=0)).sum(0))
            rows.append(i)
    c = torch.stack(out) if out else kv.new_zeros(0, kv.shape[1])
    return c, torch.tensor(rows, dtype=torch.long, device=kv.device)


def compress_ratio1(x: torch.Tensor, wkv: torch.Tensor) -> torch.Tensor:
    """c = x @ wkv^T in BF16 for every row (each token is its own group); [n, dim] -> [n, 512] BF16."""
    return bf16_linear(x, wkv)


def latent(c: torch.Tensor, norm_weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The compressor output: compressor.norm(bf16(c)); [g, 512] -> [g, 512] BF16 (before RoPE)."""
    return rms_norm(c.to(torch.bfloat16), norm_weight, eps)


def index_key_rotated(lat: torch.Tensor, wk: torch.Tensor, k_norm: torch.Tensor, cis: torch.Tensor,
                      rope_dim: int, eps: float) -> torch.Tensor:
    """rope(k_norm(lat @ wk^T)) -> [g, 128] BF16, before its MXFP4 quantization (what a cache packs)."""
    return rope_tail(rms_norm(bf16_linear(lat, wk), k_norm, eps), cis, rope_dim)


def index_key(lat: torch.Tensor, wk: torch.Tensor, k_norm: torch.Tensor, cis: torch.Tensor,
              rope_dim: int, eps: float) -> torch.Tensor:
    """mxfp4(rope(k_norm(lat @ wk^T))) -> [g, 128] BF16; `cis` [g, rope_dim/2] at each group's first position."""
    return mxfp4_fake(index_key_rotated(lat, wk, k_norm, cis, rope_dim, eps))


def compressed_kv(lat: torch.Tensor, cis: torch.Tensor, rope_dim: int) -> torch.Tensor:
    """nvfp4(rope(lat)) -> [g, 512] BF16: the compressed-KV entry (RoPE on the last rope_dim dims).

    A cache stores the codes of `rope_tail(lat, cis, rope_dim)` (quantized once); they decode to
    exactly these values.
    """
    return nvfp4_fake(rope_tail(lat, cis, rope_dim))
