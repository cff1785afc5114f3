"""Sparse attention with the sink and the output projection (spec section 3, steps 8-9). One row at a time."""

from __future__ import annotations

import torch

from ..records import unpack_compressed_kv, unpack_window_kv
from .linear import fp8_linear, rowwise_dot
from .rope import rope_tail

BLOCK_KEYS = 64


def sparse_attention(q: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor, sink: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """o[h] = sum_j softmax_j(q[h] . K[j] * scale, sink[h]) K[j], as the kernels compute it.

    q: [H, D] BF16; keys: [m, D] BF16 (K = V: the window keys, then the selected compressed
    entries); valid: [m] bool (False for -1 entries); sink: [H] FP32. Online softmax over blocks of
    64 keys: FP32 running max from -1e30 and sum, probabilities rounded to BF16 before P.V, FP32
    accumulator; then sum += exp(sink - max) and o = bf16(acc / sum). No valid key -> zeros.
    """
    h, d = q.shape
    if not bool(valid.any()):
        return torch.zeros(h, d, dtype=torch.bfloat16, device=q.device)
    qf = q.float()
    run_max = torch.full((h,), -1e30, device=q.device)
    run_sum = torch.zeros(h, device=q.device)
    acc = torch.zeros(h, d, device=q.device)
    for b in range(0, keys.shape[0], BLOCK_KEYS):
        kb = keys[b:b + BLOCK_KEYS].float()                               # [64, D]
        s = rowwise_dot(qf, kb) * scale                                   # [H, 64]
        s = s.masked_fill(~valid[b:b + BLOCK_KEYS], float("-inf"))
        new_max = torch.maximum(run_max, s.amax(-1))
        alpha = torch.exp(run_max - new_max)
        p = torch.exp(s - new_max.unsqueeze(-1))                          # [H, 64] FP32
        run_sum = run_sum * alpha + p.sum(-1)
        acc = acc * alpha.unsqueeze(-1) + rowwise_dot(p.to(torch.bfloat16).float(), kb.T.contiguous())
        run_max = new_max
    run_sum = run_sum + torch.exp(sink.float() - run_max)
    return (acc / run_sum.unsqueeze(-1)).to(torch.bfloat16)


def sparse_attention_records(q: torch.Tensor, window_pool: torch.Tensor, comp_pool: torch.Tensor,
                             window_table: torch.Tensor, comp_table: torch.Tensor, sink: torch.Tensor,
                             scale: float) -> torch.Tensor:
    """`sparse_attention` of each row over its cache records: the arguments of `ops.sparse_mla.sparse_mla_`.

    q: [N, H, 512] BF16; window_pool: [S_w, 528] uint8 window records; comp_pool: [S_c, 288] uint8
    compressed records; window_table: [N, W] int32 ring slots, oldest first (-1 = none);
    comp_table: [N, K] int32 slots (-1 = none); sink: [H] FP32. Row r's key list joins its valid
    window keys (in table order) and its K top-k entries (-1 entries stay as invalid positions, so
    the 64-key blocks fall where the kernel's do). Returns [N, H, 512] BF16.
    """
    window_keys, comp_keys = unpack_window_kv(window_pool), unpack_compressed_kv(comp_pool)
    out = []
    for r in range(q.shape[0]):
        w = window_table[r].long()
        w = w[w >= 0]
        c = comp_table[r].long()
        keys = torch.cat((window_keys[w], comp_keys[c.clamp(min=0)]))           # [m, 512]
        valid = torch.cat((torch.ones_like(w, dtype=torch.bool), c >= 0))      # [m]
        out.append(sparse_attention(q[r], keys, valid, sink.float(), scale))
    return torch.stack(out) if out else q.new_zeros(0, q.shape[1], q.shape[2])


def grouped_wo_a(o: torch.Tensor, cis: torch.Tensor, wo_a: torch.Tensor, o_groups: int,
                 rope_dim: int) -> torch.Tensor:
    """z = bf16(o_g @ wo_a_g^T) per group g, with o inverse-rotated at its position first.

    o: [n, H, 512] BF16 (the attention output); cis: [n, rope_dim/2]; wo_a:
    [o_groups*o_lora_rank, (H/o_groups)*512] BF16 (an FP8 checkpoint's values dequantized, exact
    in BF16). Consecutive heads form a group; the input is not quantized. Returns [n, o_groups *
    o_lora_rank] BF16 (the contract of `ops.wo_a`).
    """
    n = o.shape[0]
    o = rope_tail(o, cis, rope_dim, inverse=True).reshape(n, o_groups, -1)   # [n, G, (H/G)*512]
    wa = wo_a.float().view(o_groups, -1, o.shape[-1])                       # [G, R, (H/G)*512]
    z = torch.stack([rowwise_dot(o[:, g].float(), wa[g]) for g in range(o_groups)], 1)  # [n, G, R]
    return z.to(torch.bfloat16).reshape(n, -1)


def output_projection(o: torch.Tensor, cis: torch.Tensor, wo_a: torch.Tensor, wo_b: torch.Tensor,
                      wo_b_scale: torch.Tensor, o_groups: int, rope_dim: int) -> torch.Tensor:
    """y = wo_b(grouped_wo_a(o)): [n, H, 512] BF16 -> [n, dim] BF16 (wo_b an FP8 linear + its scale)."""
    return fp8_linear(grouped_wo_a(o, cis, wo_a, o_groups, rope_dim), wo_b, wo_b_scale)
