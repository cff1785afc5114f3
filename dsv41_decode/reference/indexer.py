"""The lightning indexer, candidate blocks and top-k (spec section 3, step 7). One row at a time."""

from __future__ import annotations

import torch

from ..formats import mxfp4_fake
from .linear import bf16_linear, fp8_linear, rowwise_dot
from .rope import rope_tail


def index_query(qr: torch.Tensor, wq_b: torch.Tensor, wq_b_scale: torch.Tensor, cis: torch.Tensor,
                n_heads: int, rope_dim: int) -> torch.Tensor:
    """iq = mxfp4(rope(indexer.wq_b(qr))) viewed [n, n_heads, head_dim] BF16; qr [n, q_lora_rank] BF16."""
    iq = fp8_linear(qr, wq_b, wq_b_scale).view(qr.shape[0], n_heads, -1)
    return mxfp4_fake(rope_tail(iq, cis, rope_dim))


def index_weights(x: torch.Tensor, weights_proj: torch.Tensor, head_dim: int) -> torch.Tensor:
    """w = weights_proj(x) * (head_dim^-0.5 * n_heads^-0.5), BF16 [n, n_heads]; x [n, dim] BF16."""
    n_heads = weights_proj.shape[0]
    return bf16_linear(x, weights_proj) * (head_dim ** -0.5 * n_heads ** -0.5)


def index_scores(iq: torch.Tensor, w: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """score[j] = sum_h w[h] * relu(bf16(iq[h] . keys[j])), BF16 as the official code computes it.

    iq: [H, 128] BF16 (one row); w: [H] BF16; keys: [m, 128] BF16 (the visible index keys).
    Returns [m] BF16: products rounded to BF16, summed over heads in FP32, result rounded to BF16.
    """
    logits = rowwise_dot(iq.float(), keys.float()).to(torch.bfloat16)   # [H, m]
    weighted = torch.relu(logits) * w.unsqueeze(-1)                     # [H, m] BF16
    return weighted.float().sum(0).to(torch.bfloat16)


def rank_descending(values: torch.Tensor) -> torch.Tensor:
    """Indices of `values` [m] ordered by value, largest first; among equal values the higher index
    first (the tie rule: the newer entry wins). int64 [m].

    The order is total and explicit: a stable sort, descending, of the values read from the end
    (index m - 1 first), so equal values keep that high-to-low index order. Equal means equal as
    numbers: -0.0 is made +0.0 first (x + 0.0), so no sort implementation can order the two zeros.
    Values must not be NaN.
    """
    m = values.shape[0]
    order = torch.sort((values.float() + 0.0).flip(0), descending=True, stable=True).indices
    return (m - 1) - order


def candidate_mask(scores: torch.Tensor, block_size: int, topk_blocks: int) -> torch.Tensor:
    """The candidate source's pool: entries of the top `topk_blocks` blocks by block max.

    scores: [m] the row's scores over its m visible entries. The block holding the newest entry
    (m - 1) is forced in; blocks whose max is -inf are never kept. At equal block maxima the higher
    block wins (`rank_descending`). Returns a bool mask [m].
    """
    m = scores.shape[0]
    n_blocks = -(-m // block_size)
    padded = torch.full((n_blocks * block_size,), float("-inf"), device=scores.device)
    padded[:m] = scores.float()
    block = padded.view(n_blocks, block_size).amax(-1)                   # [n_blocks]
    if n_blocks:
        block[-1] = float("inf")
    k = min(topk_blocks, n_blocks)
    top = rank_descending(block)[:k]
    top = top[block[top] != float("-inf")]
    keep = torch.zeros(n_blocks, dtype=torch.bool, device=scores.device)
    keep[top] = True
    return keep.repeat_interleave(block_size)[:m]


def topk_ascending(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices [k] (int64) of the k largest scores, sorted ascending; entries scored -inf become -1
    (placed after the valid indices).

    scores: [m] with k <= m. At equal scores the higher index wins (`rank_descending`): of the
    entries tied at the k-th largest score, those with the highest indices are taken.
    """
    if k == 0:
        return torch.zeros(0, dtype=torch.long, device=scores.device)
    idx = rank_descending(scores)[:k]
    idx = torch.where(scores[idx].float() == float("-inf"), torch.full_like(idx, -1), idx)
    idx, _ = torch.sort(idx)
    return torch.cat([idx[idx >= 0], idx[idx < 0]])
