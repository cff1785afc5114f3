"""The mHC boundary around each site (spec section 4), all in FP32 with BF16 streams.

Streams X [n, hc, dim] BF16 (hc = 4). A site's mixer turns the streams entering it into
`pre` [n, hc], `post` [n, hc] and the Sinkhorn-normalised `comb` [n, hc, hc].
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .linear import rowwise_dot


class Mix(NamedTuple):
    pre: torch.Tensor    # [n, hc] FP32: how the next site collapses the streams
    post: torch.Tensor   # [n, hc] FP32: how the site's output enters each stream
    comb: torch.Tensor   # [n, hc, hc] FP32: comb[i, j] = weight of stream i in new stream j


def sinkhorn(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Row softmax + eps, then column normalisation, then `iters - 1` more (row, column) rounds.

    logits: [..., hc, hc] FP32. Each normalisation divides by the sums plus `eps`.
    """
    c = torch.exp(logits - logits.amax(-1, keepdim=True))
    c = c / c.sum(-1, keepdim=True) + eps
    c = c / (c.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        c = c / (c.sum(-1, keepdim=True) + eps)
        c = c / (c.sum(-2, keepdim=True) + eps)
    return c


def hc_mixes(x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
             norm_eps: float, hc_eps: float, sinkhorn_iters: int) -> Mix:
    """A site's mixer from the streams entering it.

    x: [n, hc, dim] BF16; fn: [hc*(2+hc), hc*dim] FP32; scale: [3] FP32; base: [hc*(2+hc)] FP32.
    m = (flatten(x) @ fn^T) * rsqrt(mean(flatten(x)^2) + norm_eps).
    """
    n, hc, _ = x.shape
    # Batch invariance: torch's CPU kernels evaluate exp/sigmoid/rsqrt with vector code in chunks
    # of up to 32 floats and the last partial chunk with scalar code, which can differ by an ulp;
    # the rows are padded with zeros to a multiple of 32, so every element takes the vector code
    # whatever n is (a zero row's m is 0: rsqrt(norm_eps) is finite).
    v = x.flatten(1).float()                                             # [n, hc*dim]
    v = torch.cat([v, v.new_zeros(-n % _ROWS, v.shape[1])]) if n % _ROWS else v
    m = rowwise_dot(v, fn.float()) * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + norm_eps)  # [n', 24]
    pre = torch.sigmoid(m[:, :hc] * scale[0] + base[:hc]) + hc_eps
    post = 2 * torch.sigmoid(m[:, hc:2 * hc] * scale[1] + base[hc:2 * hc])
    logits = (m[:, 2 * hc:] * scale[2] + base[2 * hc:]).reshape(-1, hc, hc)
    return Mix(pre[:n], post[:n], sinkhorn(logits, sinkhorn_iters, hc_eps)[:n])


_ROWS = 32   # hc_mixes pads its rows to a multiple of this (see there)


def hc_pre(x: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """Collapse: bf16(sum_i pre[i] * x[i]); x [n, hc, dim] BF16, pre [n, hc] FP32 -> [n, dim] BF16."""
    return (pre.unsqueeze(-1) * x.float()).sum(1).to(torch.bfloat16)


def hc_post(y: torch.Tensor, x: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """Post-mix: new stream j = bf16(post[j] * y + sum_i comb[i, j] * x[i]).

    y: [n, dim] the site's output; x: [n, hc, dim] the streams that entered the site.
    """
    mixed = (comb.unsqueeze(-1) * x.float().unsqueeze(2)).sum(1)        # [n, hc(j), dim]
    return (post.unsqueeze(-1) * y.float().unsqueeze(1) + mixed).to(torch.bfloat16)
