"""The indexer's query and head weights of a decode step, one launch (spec section 3 step 7):

    iq = mxfp4_fake(rope_tail(indexer.wq_b(qr) viewed [N, Hi, 128], cis, 64))   # BF16
    w  = bf16(bf16(weights_proj(x)) * scale)                                     # BF16

the contract of `reference.indexer.index_query` after its linear and of `index_weights` after its
linear (their FP32 sums come from `low_latency_mm` and `ll_bf16`). Bit-exact: RoPE as torch's
complex multiply without FMA contraction (`kv_write.rope_pairs`), MXFP4 by `fp4.mx_quant_pairs`
and its exact dequantization, the weight scale rounded as torch rounds a BF16 tensor times a float.

`index_query_tile` is the iq half on a GEMM's output tile: the epilogue of the indexer's wq_b in
the Triton tier (`LowLatencyMM(..., index_query=)`; the Gluon tier has its own port,
`gluon_epilogues.index_query_tile`), the same bits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .checks import require_ndim, require_tensor
from .fp4 import bf16_round, mx_dequant_pairs, mx_quant_pairs
from .kv_write import rope_pairs, rope_rows
from .rounding import bf16_rne_bits, bf16_widen

HEAD_DIM = 128
_HD = tl.constexpr(HEAD_DIM)   # the kernel's copy (Triton reads only constexpr globals)


@triton.jit
def _index_query_kernel(raw_ptr, wp_ptr, cos_ptr, sin_ptr, iq_ptr, w_ptr, scale, H,
                        stride_raw, stride_wp, stride_cn, stride_sn, stride_iqn, stride_iqh, stride_w,
                        HB: tl.constexpr, BLOCK_H: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    # [HB heads x 4 blocks, 16 pairs]: row = head * 4 + block, pair in head = block * 16 + col
    r = tl.arange(0, HB * 4)[:, None]
    col = tl.arange(0, 16)[None, :]
    head = hb * HB + r // 4
    j = (r % 4) * 16 + col
    ok = head < H
    src = raw_ptr + n * stride_raw + head * _HD + 2 * j
    xe = bf16_widen(tl.load(src, mask=ok, other=0))
    xo = bf16_widen(tl.load(src + 1, mask=ok, other=0))
    xe, xo = rope_pairs(xe, xo, cos_ptr + n * stride_cn, sin_ptr + n * stride_sn, j, 32)
    ce, co, sb = mx_quant_pairs(xe, xo, False)
    ye, yo = mx_dequant_pairs(ce, co, sb, False)
    dst = iq_ptr + n * stride_iqn + head * stride_iqh + 2 * j
    tl.store(dst, bf16_rne_bits(ye), mask=ok)
    tl.store(dst + 1, bf16_rne_bits(yo), mask=ok)
    if hb == 0:
        h = tl.arange(0, BLOCK_H)
        wp = tl.load(wp_ptr + n * stride_wp + h, mask=h < H, other=0.0)
        wb = bf16_round(wp)
        tl.store(w_ptr + n * stride_w + h, bf16_rne_bits(wb * scale), mask=h < H)


@triton.jit
def index_query_tile(yb, off_n, rm, M, cos_ptr, sin_ptr, stride_cm, stride_sm, BLOCK_N: tl.constexpr,
                     BLOCK_M: tl.constexpr, ASM: tl.constexpr):
    """`index_query_`'s iq on a GEMM's output tile: yb [BLOCK_N, BLOCK_M] FP32 holding the BF16
    outputs of columns off_n + n (n = head * 128 + channel) and rows rm. Each head's tail pairs
    (channels 64..127, pair i = channel / 2 - 32) of rows m < M are rotated by cos/sin[m, i]
    (`kv_write.rope_rows`: `rope_rotate`, explicitly rounded with ASM, then BF16), then every
    32-column MX block of every row is MXFP4 quantized and dequantized (`fp4.mx_quant_pairs`,
    `mx_dequant_pairs`; exact, no sum to contract). off_n and BLOCK_N multiples of 32 (whole MX
    blocks; the launchers check). Returns the tile [BLOCK_N, BLOCK_M], FP32 (BF16 on rounding;
    rows at or past M hold values to be masked at the store)."""
    e, o = tl.split(tl.reshape(tl.trans(yb), (BLOCK_M, BLOCK_N // 2, 2)))
    col = (off_n + 2 * tl.arange(0, BLOCK_N // 2)) % _HD
    e, o = rope_rows(e, o, col, rm, M, cos_ptr, sin_ptr, stride_cm, stride_sm, 64, ASM)
    # [BLOCK_M, BLOCK_N / 2] pairs as [blocks, 16]: a row's 16 consecutive pairs are one MX block
    NB: tl.constexpr = BLOCK_M * BLOCK_N // 32
    ce, co, sb = mx_quant_pairs(tl.reshape(e, (NB, 16)), tl.reshape(o, (NB, 16)), False)
    ye, yo = mx_dequant_pairs(ce, co, sb, False)
    y = tl.join(tl.reshape(ye, (BLOCK_M, BLOCK_N // 2)), tl.reshape(yo, (BLOCK_M, BLOCK_N // 2)))
    return tl.trans(tl.reshape(y, (BLOCK_M, BLOCK_N)))


def index_query_(iq_raw: torch.Tensor, wproj: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, scale: float,
                 iq_out: torch.Tensor, w_out: torch.Tensor) -> None:
    """Write iq_out and w_out (see the module docstring) for N rows.

    iq_raw: [N, Hi*128] bfloat16 (the indexer's wq_b output), unit stride in the last dim.
    wproj: [N, Hi] float32 (weights_proj output, FP32 sums); scale: head_dim^-0.5 * Hi^-0.5.
    cos, sin: [N, 32] float32 at each row's position. iq_out: [N, Hi, 128] bfloat16 (last dim
    contiguous); w_out: [N, Hi] bfloat16. All on one device.
    """
    n, h = require_ndim(wproj, "wproj", "[N, Hi]")
    dev = wproj.device
    require_tensor(wproj, "wproj", (torch.float32,), (n, h), dev)
    require_tensor(iq_raw, "iq_raw", (torch.bfloat16,), (n, h * HEAD_DIM), dev)
    require_tensor(cos, "cos", (torch.float32,), (n, 32), dev)
    require_tensor(sin, "sin", (torch.float32,), (n, 32), dev)
    require_tensor(iq_out, "iq_out", (torch.bfloat16,), (n, h, HEAD_DIM), dev)
    require_tensor(w_out, "w_out", (torch.bfloat16,), (n, h), dev)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a float, got {type(scale).__name__}")
    if n == 0 or h == 0:
        return
    # Two heads a program (32 programs of one pair a thread at Hi = 64, 16 at 32): the launch is a
    # few microseconds of latency beside the step's main-stream GEMMs, whose CTAs share the SMs and
    # their issue slots, so its work is spread thin (the bits are elementwise: any split is the same).
    hb = min(2, triton.next_power_of_2(h))
    iq16, w16, raw16 = iq_out.view(torch.int16), w_out.view(torch.int16), iq_raw.view(torch.int16)
    _index_query_kernel[(n, triton.cdiv(h, hb))](
        raw16, wproj, cos, sin, iq16, w16, float(scale), h, raw16.stride(0), wproj.stride(0), cos.stride(0),
        sin.stride(0), iq16.stride(0), iq16.stride(1), w16.stride(0),
        HB=hb, BLOCK_H=triton.next_power_of_2(h), num_warps=4, enable_fp_fusion=False)


def index_query(iq_raw: torch.Tensor, wproj: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, scale: float
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Allocating form of `index_query_`: (iq [N, Hi, 128] bfloat16, w [N, Hi] bfloat16)."""
    n, h = require_ndim(wproj, "wproj", "[N, Hi]")
    iq = torch.empty(n, h, HEAD_DIM, dtype=torch.bfloat16, device=wproj.device)
    w = torch.empty(n, h, dtype=torch.bfloat16, device=wproj.device)
    index_query_(iq_raw, wproj, cos, sin, scale, iq, w)
    return iq, w
