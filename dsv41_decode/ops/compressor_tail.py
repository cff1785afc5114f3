"""The compressor's tail in one launch (spec section 3 steps 5-6): the latent's RMSNorm, the indexer's
wk projection of it, and the compressed-KV record + index key of each completed group, the same
bits as the three launches

    rms_norm_(c, norm_w, eps, lat)
    ll_bf16_(wk_plan, lat, w_wk, wk_out)
    compressed_entry_store_(lat, wk_out, k_norm, cos, sin, slots, compressed, index_keys, eps)

on the GPU and in Triton's interpreter: lat bitwise `ops.rms_norm.rms_norm_`'s, wk_out bitwise
`ops.ll_bf16.ll_bf16_`'s with the plan, the records bitwise `ops.kv_write.compressed_entry_store_`'s.

Grid (G, T + 1) for the wk plan's T = ceil(128 / block_n) N tiles (4 of 32 outputs on the GPU's
plan, 1 of 256 in the interpreter's), one group (row) g per T + 1 programs, 4 warps (rms_norm_'s,
whose norm factor's summation order follows the [512] row's layout over 4 warps):

- program (g, t), t < T: the norm factor (`rms_norm.rms_row`, rms_norm_'s [512] sum), then wk's
  N tile t (block_n outputs, past 128 masked) over K = 512 in the plan's K steps: each step's
  latent tile recomputed elementwise from c (`rms_norm.normed`, the same roundings as lat) and
  multiplied by the weight tile with ll_bf16's dot (`ll_bf16.ll_dot`, TF32 inputs: exact products
  of BF16 values); it stores its wk_out tile. The row's last tile program to arrive (an acq_rel
  atomic on the row's counter in `CompressorTailPlan.counters`, which it resets to 0, so the next
  launch or graph replay finds it clean: `ops.common.splitk_reduce`'s pattern) writes the index
  key from the row's wk_out, loaded with `.cg` (`kv_write.index_key_record`, which reads it as
  compressed_entry_store_ does: the k_norm sum follows that load's layout). With T = 1 the one
  tile program writes it after a barrier, no counter;
- program (g, T): the norm (`rms_norm._rms_norm_row`, which stores lat) and the compressed record
  from the BF16 values in registers (`kv_write.compressed_record`: elementwise and max
  reductions, whose bits do not depend on the layout).

Why this grid: the wk projection is latency-bound (a 128 KB weight, 4 K steps of dependent loads
and MMAs per N tile), so each N tile gets its own program, as in `ll_bf16_`'s launch: at 1 row the
critical path is one N tile (32 KB of w_wk in 4 K steps), one store/atomic/reload of wk_out (two
dependent global round trips) and the index key, where one program reading all four tiles in turn
measured 20.7-26.4 us in the step (docs/step.md, "What limits it"). The weight tile is loaded into
registers two K steps ahead of its dot, the first two steps before the norm factor's [512]
reduction (they do not depend on it; in the sm_90 code their loads issue between the c row's load
and the reduction's shuffles, where the compiler's cp.async pipeline issued them after the
reduction). Launches: three (G, 4 x ceil(G / 16 or 32) and 2G programs on
the GPU's plan) become one of 5G programs; 4 layers of the V4.1 step own a compressor, so 8
launches fewer a step.

Bits. Each tile program's dot runs the plan's tile (BLOCK_M 16 or 32: mma.sync m16n8k8; BLOCK_N,
the plan's; BLOCK_K, its K steps) with row 0 the group's and the other rows zeros: an MMA forms
each output from its own row and column only, and the FP32 sums run along K in the plan's order,
so the outputs are the plan's (on the GPU whatever the other rows hold, as ll_bf16's batch
invariance has it). In the interpreter the dot is a numpy matmul of each K step plus the
accumulator, whose sums can depend on the tile's shape (they differ between N tiles of 32 and of
128): the same tile shapes give the same sums there too. The sm_90 compile test checks that the
MMA instruction and layout and every FP32 sum's layout are the three kernels' (no spills).
The wk plan must be the one `ll_bf16_` would run: BF16 weight [128, 512], one K split (the step's
plans on the H200 and in the interpreter); another split sums partials in another order, and the
plan refuses it (`ValueError` naming wk_plan). The interpreter runs the programs one after another,
so the last arriver there is the row's last tile program.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..records import COMPRESSED_KV_BYTES, INDEX_KEY_BYTES
from .checks import require_tensor
from .fp4 import bf16_round
from .kv_write import DIM, INDEX_DIM, _HALF_ROPE, compressed_record, index_key_record
from .ll_bf16 import MODE_TF32, LlBf16Plan, ll_dot
from .rms_norm import _rms_norm_row, normed, rms_row
from .rounding import bf16_widen, to_f32


@triton.jit
def _compressor_tail_kernel(
    c_ptr, nw_ptr, lat_ptr, w_ptr, wk_out_ptr, knw_ptr, cos_ptr, sin_ptr, slots_ptr, ckv_ptr, ik_ptr, cnt_ptr,
    S_CKV, S_IK, eps, stride_c, stride_lat, stride_w, stride_wo, stride_cn, stride_sn, stride_ckv, stride_ik,
    ROUND_IN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    N_TILES: tl.constexpr = (128 + BLOCK_N - 1) // BLOCK_N
    g = tl.program_id(0).to(tl.int64)
    t = tl.program_id(1)
    c_row = c_ptr + g * stride_c
    cs_row = cos_ptr + g * stride_cn
    sn_row = sin_ptr + g * stride_sn
    slot = tl.load(slots_ptr + g)
    if t == N_TILES:
        # lat (stored) and its compressed record from the BF16 values in registers
        lat_row = lat_ptr + g * stride_lat
        bits = _rms_norm_row(c_row, nw_ptr, lat_row, lat_row, lat_row, eps, 512, 512, ROUND_IN, False)
        xe, xo = tl.split(tl.reshape(bf16_widen(bits), (32, 8, 2)))    # pairs [32 groups, 8 pairs]
        compressed_record(xe, xo, cs_row, sn_row, slot, ckv_ptr, S_CKV, stride_ckv, False)
    else:
        rm = tl.arange(0, BLOCK_M)       # the dot's rows (the plan's BLOCK_M): row 0 the group's
        rk = tl.arange(0, BLOCK_K)
        n = t * BLOCK_N + tl.arange(0, BLOCK_N)                          # the plan's N tile t
        first = (rm == 0)[:, None]
        x_ptrs = c_row + rm[:, None] * 0 + rk[None, :]
        w_ptrs = w_ptr + n[:, None] * stride_w + rk[None, :]
        n_ok = (n < 128)[:, None]
        # the weight two K steps ahead in registers, its first two steps issued before the norm's
        # reduction (they do not depend on it)
        w_a = tl.load(w_ptrs, mask=n_ok, other=0.0)
        w_b = tl.load(w_ptrs + BLOCK_K, mask=n_ok, other=0.0)
        _, r = rms_row(c_row, eps, 512, 512, ROUND_IN)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in tl.range(0, 512, BLOCK_K, num_stages=1):      # the prefetch above is the pipeline
            x = to_f32(tl.load(x_ptrs + k0, mask=first, other=0.0))
            if ROUND_IN:
                x = bf16_round(x)
            nw = to_f32(tl.load(nw_ptr + k0 + rk))
            lat = bf16_round(normed(x, nw[None, :], r))                  # lat's values, row 0
            w = to_f32(w_a)
            w_a = w_b
            w_b = tl.load(w_ptrs + k0 + 2 * BLOCK_K, mask=n_ok & (k0 + 2 * BLOCK_K + rk < 512)[None, :], other=0.0)
            acc = ll_dot(lat, w, acc, 0)
        wo_row = wk_out_ptr + g * stride_wo
        tl.store(wo_row + rm[:, None] * 0 + n[None, :], acc, mask=first & (n < 128)[None, :])
        tl.debug_barrier()                     # the tile stored by all of the program's threads
        if N_TILES == 1:
            index_key_record(wo_row, knw_ptr, cs_row, sn_row, slot, ik_ptr, S_IK, stride_ik, eps, False, "")
        else:
            # the row's last tile program to arrive (its counter back to 0) reads the other tiles
            arrived = tl.atomic_add(cnt_ptr + g, 1, sem="acq_rel", scope="gpu")
            if arrived == N_TILES - 1:
                tl.store(cnt_ptr + g, 0)
                index_key_record(wo_row, knw_ptr, cs_row, sn_row, slot, ik_ptr, S_IK, stride_ik, eps, False, ".cg")


def plan_misfit(wk_plan: LlBf16Plan) -> str | None:
    """Why `compressor_tail_` cannot run with this wk plan (a phrase after "wk_plan"), or None when
    it gives the plan's bits: a [128, 512] BF16 weight with one K split and every row bucket's tile
    the TF32 dot."""
    if (wk_plan.n, wk_plan.k, wk_plan.weight_dtype) != (INDEX_DIM, DIM, torch.bfloat16):
        return (f"must be a plan of a [{INDEX_DIM}, {DIM}] bfloat16 weight, got [{wk_plan.n}, {wk_plan.k}] "
                f"{wk_plan.weight_dtype}")
    if wk_plan.split != 1:
        return f"splits K {wk_plan.split} ways: the fused tail sums K in one chain (a one-split plan's bits)"
    if any(t.mode != MODE_TF32 for t in wk_plan.tiles):
        return "has a tile that is not the TF32 dot"
    return None


@dataclass(frozen=True, eq=False)
class CompressorTailPlan:
    """`compressor_tail_`'s wk plan and its own workspace: build once per wk plan with
    `CompressorTailPlan.build`; launches reuse it. Not for concurrent launches on two streams (they
    would share the counters).

    wk_plan: the `LlBf16Plan` whose bits wk_out reproduces (its N tiles are the launch's tile
    programs; max_rows, the most groups a launch may pass). counters: [wk_plan.max_rows] int32, one
    per row (its tile programs' arrivals), 0 between launches.
    """
    wk_plan: LlBf16Plan
    counters: torch.Tensor

    @property
    def max_rows(self) -> int:
        return self.wk_plan.max_rows

    @classmethod
    def build(cls, wk_plan: LlBf16Plan) -> "CompressorTailPlan":
        """The plan of a wk plan that `plan_misfit` accepts (else ValueError naming wk_plan)."""
        if not isinstance(wk_plan, LlBf16Plan):
            raise TypeError(f"wk_plan must be an LlBf16Plan, got {type(wk_plan).__name__}")
        why = plan_misfit(wk_plan)
        if why:
            raise ValueError(f"wk_plan {why}")
        return cls(wk_plan, torch.zeros(wk_plan.max_rows, dtype=torch.int32, device=wk_plan.device))


def compressor_tail_(c: torch.Tensor, norm_w: torch.Tensor, eps: float, lat: torch.Tensor, plan: CompressorTailPlan,
                     w_wk: torch.Tensor, wk_out: torch.Tensor, k_norm: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor, slots: torch.Tensor, compressed: torch.Tensor,
                     index_keys: torch.Tensor) -> None:
    """`rms_norm_(c, norm_w, eps, lat)`, `ll_bf16_(plan.wk_plan, lat, w_wk, wk_out)` and
    `compressed_entry_store_(lat, wk_out, k_norm, cos, sin, slots, compressed, index_keys, eps)` in
    one launch, bit for bit the same (module docstring).

    c: [G, 512] float32 (rounded to BF16 first, as rms_norm_) or bfloat16, unit stride in the last
       dim; norm_w: [512] bfloat16 or float32 (the compressor's norm); eps: both norms' epsilon.
    lat: [G, 512] bfloat16 out. plan: `CompressorTailPlan` with max_rows >= G (its wk plan:
       [128, 512] BF16 with one K split); w_wk: [128, 512] bfloat16; wk_out: [G, 128] float32 out.
    k_norm: [128] bfloat16 or float32; cos, sin: [G, 32] float32 at each group's first position;
    slots: [G] int64 entry slot (a slot outside a pool's rows: that record skipped);
    compressed: [S, 288] uint8 pool; index_keys: [S', 68] uint8 pool. All on c's device.
    """
    if not isinstance(plan, CompressorTailPlan):
        raise TypeError(f"plan must be a CompressorTailPlan, got {type(plan).__name__}")
    wk_plan = plan.wk_plan
    require_tensor(slots, "slots", (torch.int64,), (None,))
    g, dev = slots.shape[0], slots.device
    if g > plan.max_rows:
        raise ValueError(f"slots: {g} groups exceed plan.max_rows={plan.max_rows}")
    if wk_plan.device != dev:
        raise ValueError(f"plan is on {wk_plan.device}, slots on {dev}")
    require_tensor(c, "c", (torch.float32, torch.bfloat16), (g, DIM), dev)
    require_tensor(norm_w, "norm_w", (torch.bfloat16, torch.float32), (DIM,), dev)
    require_tensor(lat, "lat", (torch.bfloat16,), (g, DIM), dev)
    require_tensor(w_wk, "w_wk", (torch.bfloat16,), (INDEX_DIM, DIM), dev)
    require_tensor(wk_out, "wk_out", (torch.float32,), (g, INDEX_DIM), dev)
    require_tensor(k_norm, "k_norm", (torch.bfloat16, torch.float32), (INDEX_DIM,), dev)
    require_tensor(cos, "cos", (torch.float32,), (g, _HALF_ROPE), dev)
    require_tensor(sin, "sin", (torch.float32,), (g, _HALF_ROPE), dev)
    require_tensor(compressed, "compressed", (torch.uint8,), (None, COMPRESSED_KV_BYTES), dev)
    require_tensor(index_keys, "index_keys", (torch.uint8,), (None, INDEX_KEY_BYTES), dev)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0:
        raise ValueError(f"eps must be a non-negative float, got {eps!r}")
    if g == 0:
        return
    t = wk_plan.tile(g)
    lat_bits = lat.view(torch.int16)
    _compressor_tail_kernel[(g, wk_plan.n_tiles + 1)](
        c, norm_w, lat_bits, w_wk, wk_out, k_norm, cos, sin, slots, compressed, index_keys, plan.counters,
        compressed.shape[0], index_keys.shape[0], float(eps), c.stride(0), lat_bits.stride(0), w_wk.stride(0),
        wk_out.stride(0), cos.stride(0), sin.stride(0), compressed.stride(0), index_keys.stride(0),
        ROUND_IN=c.dtype == torch.float32, BLOCK_M=t.block_m, BLOCK_N=wk_plan.block_n, BLOCK_K=t.block_k,
        num_warps=4, enable_fp_fusion=False,
    )
