"""Grouped `wo_a` at low batch: inverse RoPE and the 8-group output projection in one launch.

z[m, g*R:(g+1)*R] = bf16(o'_g[m] @ wo_a_g^T), where o' is o with the conjugate rotation at row
m's position applied to the last `rope_dim` channels of every head (FP32 math, rounded to BF16),
o'_g the H/G consecutive heads of group g flattened ((H/G)*512 wide) and R = o_lora_rank: the
contract of `reference.attention.grouped_wo_a` (spec section 3 step 9).

The input stays BF16; it is never quantized. The weight streams either as BF16 or as FP8 E4M3
with 32x32 UE8M0 scales, dequantized in registers: each 32-deep partial is scaled by its block's
power-of-two scale before it joins the FP32 accumulator, which is exact when the checkpoint ships
`wo_a` in FP8. Products are exact: the operands (rotated BF16 activations, BF16 or E4M3 weights)
fit BF16's and TF32's significant bits, so the dots run on the tensor cores with BF16 operands (the
measured default for a BF16 weight) or at TF32 input precision on FP32 operands (an FP8 weight, and
always in the interpreter, where BF16 dots are wrong). A tensor-core MMA truncates while it adds its
products, so its sums are not FP32 round-to-nearest sums; with `ieee_dot` (the exact step's
option) the dots take FP32 operands at IEEE precision, CUDA-core FMAs whose every add rounds to
nearest, in K order.

The grid is (G*R / BLOCK_N output tiles, split): under tensor parallelism a rank holds H/tp heads
and G/tp groups (one group of 1024 rows at TP8), so K (the group width, 4096) is split across
programs and reduced deterministically by `ll_bf16.splitk_reduce` (the last program of a tile
adds the FP32 partials in split order, then rounds to BF16). The launch turns off FMA
contraction so that the rotation rounds exactly as torch's complex product on the CPU; the GEMM
runs on the tensor cores, which that does not touch, or with `ieee_dot` as FMAs, which it may split
into a multiply and an add: the same bits, the product being exact.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..formats import E4M3_MAX, MXFP8_AMAX_FLOOR, fp8_block_quantize
from . import pdl
from .act_quant import INV_E4M3_MAX, mxfp8_quantize_tile
from .checks import (interpreting, planned_rows, require_bool, require_int, require_ndim, require_num_warps,
                     require_tensor)
from .common import num_sms, plan_workspace, splitk_reduce
from .rounding import bf16_rne_bits, to_f32, ue8m0_to_fp32

_BLOCK_K = 128   # K per loop step: four 32-wide scale blocks
MAX_UNSWAPPED_ROWS = 32   # rows per unswapped launch: mma.sync up to BLOCK_M 32, wgmma at 64
# the MXFP8 constants of the fused output quantization (kernels may read only constexpr globals)
_AMAX_FLOOR = tl.constexpr(MXFP8_AMAX_FLOOR)
_INV_QMAX = tl.constexpr(INV_E4M3_MAX)
_QMAX = tl.constexpr(E4M3_MAX)


@triton.jit
def _inverse_rope_bf16(x, cos_ptr, sin_ptr, rm, m_ok, pair0, stride_cm, stride_sm, BLOCK_M: tl.constexpr):
    """bf16(conj rotation) of a [BLOCK_M, 32] chunk x of rotary channels, as exact FP32 values.

    The chunk holds the adjacent pairs (2i, 2i+1) for i = pair0 .. pair0 + 15 (spec section 5);
    the pairs are split in registers, so no second load of o is needed. Each sum rounds as in
    torch's complex product, fl(fl(a c) + fl(b s)), provided the launch turns off FMA contraction.
    """
    rp = tl.arange(0, 16)
    c = tl.load(cos_ptr + rm[:, None] * stride_cm + (pair0 + rp)[None, :], mask=m_ok[:, None], other=0.0)
    s = tl.load(sin_ptr + rm[:, None] * stride_sm + (pair0 + rp)[None, :], mask=m_ok[:, None], other=0.0)
    a, b = tl.split(tl.reshape(x, (BLOCK_M, 16, 2)))
    # (a + jb)(c - js) = (a c + b s) + j (b c - a s)
    rot = tl.reshape(tl.join(a * c + b * s, b * c - a * s), (BLOCK_M, 32))
    return (bf16_rne_bits(rot).to(tl.int32) << 16).to(tl.float32, bitcast=True)


@triton.jit
def _wo_a_kernel(
    o_ptr, cos_ptr, sin_ptr, w_ptr, s_ptr, z_ptr, part_ptr, count_ptr, codes_ptr, scales_ptr,
    cp_pool_ptr, cp_src_ptr, cp_dst_ptr, M,
    stride_om, stride_oh, stride_cm, stride_sm, stride_wn, stride_sn, stride_zm, stride_ps, stride_pm,
    stride_codes, stride_scales,
    R: tl.constexpr, HEADS_PER_GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, ROPE_DIM: tl.constexpr,
    K_PER_SPLIT: tl.constexpr, SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, FP8: tl.constexpr, NUM_STAGES: tl.constexpr, QUANT: tl.constexpr = False,
    PDL: tl.constexpr = False, BF16_DOT: tl.constexpr = False, SWAP_AB: tl.constexpr = False,
    COPY_WORDS: tl.constexpr = 0, COPY_BLOCK: tl.constexpr = 1, N_TILES: tl.constexpr = 1,
    IEEE_DOT: tl.constexpr = False,
):
    PRECISION: tl.constexpr = "ieee" if IEEE_DOT else "tf32"   # FP32 operands: CUDA-core FMAs or TF32 MMAs
    NOPE: tl.constexpr = HEAD_DIM - ROPE_DIM
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rm = tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)   # output columns, all in group g
    rc = tl.arange(0, 32)
    m_ok = rm < M
    g = (pid_n * BLOCK_N) // R
    k_lo = pid_k * K_PER_SPLIT

    # With PDL: the program's weight bytes start towards L2 while the predecessor still runs.
    pdl.prefetch_rows_l2(w_ptr + rn * stride_wn + k_lo, K_PER_SPLIT * (1 if FP8 else 2), PDL)
    pdl.enter(PDL, RELEASE=False)
    if SWAP_AB:   # acc^T = W x^T: the weight rows are the MMA's M (wgmma on sm_90, W read from shared memory)
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kk in tl.range(0, K_PER_SPLIT, BLOCK_K, num_stages=NUM_STAGES):
        k0 = k_lo + kk
        for j in tl.static_range(BLOCK_K // 32):
            kc = k0 + 32 * j                   # first channel of the chunk within the group
            d0 = tl.multiple_of(kc % HEAD_DIM, 32)   # lets the activation loads vectorize
            o_ptrs = o_ptr + rm[:, None] * stride_om + (g * HEADS_PER_GROUP + kc // HEAD_DIM) * stride_oh \
                + (d0 + rc)[None, :]
            x = to_f32(tl.load(o_ptrs, mask=m_ok[:, None], other=0.0))
            if d0 >= NOPE:
                x = _inverse_rope_bf16(x, cos_ptr, sin_ptr, rm, m_ok, (d0 - NOPE) // 2,
                                       stride_cm, stride_sm, BLOCK_M)
            w = tl.load(w_ptr + rn[:, None] * stride_wn + (kc + rc)[None, :])
            if BF16_DOT:   # BF16 operands: exact too (x holds BF16 values; E4M3 fits BF16)
                wd = w.to(tl.bfloat16)
                xd = x.to(tl.bfloat16)
            else:          # FP32 operands: TF32 MMAs, or FMAs with IEEE_DOT (the interpreter: FP32 either way)
                wd = w.to(tl.float32)
                xd = x
            if FP8:
                scale = ue8m0_to_fp32(tl.load(s_ptr + (rn // 32) * stride_sn + kc // 32))
                if SWAP_AB:
                    acc += tl.dot(wd, tl.trans(xd), input_precision=PRECISION) * scale[:, None]
                else:
                    acc += tl.dot(xd, tl.trans(wd), input_precision=PRECISION) * scale[None, :]
            elif SWAP_AB:
                acc = tl.dot(wd, tl.trans(xd), acc, input_precision=PRECISION)
            else:
                acc = tl.dot(xd, tl.trans(wd), acc, input_precision=PRECISION)
    pdl.release(PDL)   # the successor may launch once every program is past its K loop
    if SWAP_AB:
        acc = tl.trans(acc)   # [BLOCK_M, BLOCK_N] for the epilogue (one exchange per program)

    mask = tl.broadcast_to(m_ok[:, None], (BLOCK_M, BLOCK_N))
    z_ptrs = z_ptr + rm[:, None] * stride_zm + rn[None, :]
    if SPLIT == 1:
        total = acc
    else:
        part_ptrs = part_ptr + rm[:, None] * stride_pm + rn[None, :]
        last, total = splitk_reduce(acc, part_ptrs, stride_ps, mask, count_ptr + pid_n, pid_k, SPLIT)
        mask = mask & last
    z_bits = bf16_rne_bits(total)
    tl.store(z_ptrs, z_bits, mask=mask)
    if QUANT:
        # the MXFP8 of z for wo_b, from the BF16 values just rounded: act_quant_mxfp8_ fused here
        # (BLOCK_N is a multiple of 32, so the tile holds whole blocks)
        z = (z_bits.to(tl.int32) << 16).to(tl.float32, bitcast=True)
        codes, sbytes = mxfp8_quantize_tile(z, _AMAX_FLOOR, _INV_QMAX, _QMAX)
        tl.store(codes_ptr + rm[:, None] * stride_codes + rn[None, :], codes, mask=mask)
        rb = pid_n * (BLOCK_N // 32) + tl.arange(0, BLOCK_N // 32)
        s_mask = tl.broadcast_to(m_ok[:, None], (BLOCK_M, BLOCK_N // 32))
        if SPLIT > 1:
            s_mask = s_mask & last
        tl.store(scales_ptr + rm[:, None] * stride_scales + rb[None, :], sbytes.to(tl.uint8), mask=s_mask)
    if COPY_WORDS > 0:
        # the piggybacked record copy (`window_copy`): the programs of split 0 move rows pid_n,
        # pid_n + N_TILES, ...; it must stay after pdl.enter: under PDL that is what orders it
        # after the predecessors (the readers of the destinations), without PDL stream order does
        if pid_k == 0:
            rw = tl.arange(0, COPY_BLOCK)
            for r0 in tl.static_range(0, BLOCK_M, N_TILES):   # BLOCK_M >= M rows, masked
                r = r0 + pid_n
                ok = r < M
                src = tl.load(cp_src_ptr + r, mask=ok, other=0)
                dst = tl.load(cp_dst_ptr + r, mask=ok, other=0)
                w_ok = (rw < COPY_WORDS) & ok
                rec = tl.load(cp_pool_ptr + src * COPY_WORDS + rw, mask=w_ok)
                tl.store(cp_pool_ptr + dst * COPY_WORDS + rw, rec, mask=w_ok)


class GroupedShape:
    """The shape properties every grouped-`wo_a` plan derives from its fields heads, o_groups,
    rank and head_dim (`WoAPlan`, `gluon_wo_a.GluonWoAPlan`)."""

    @property
    def group_width(self) -> int:
        """K of each group's GEMM: (H/G) * head_dim."""
        return self.heads // self.o_groups * self.head_dim

    @property
    def n_out(self) -> int:
        return self.o_groups * self.rank


@dataclass(frozen=True, eq=False)
class WoAPlan(GroupedShape):
    """Split and tiles of `wo_a` for one rank's shape, and its split-K workspace (its own, or views
    of a shared pool: `build(workspace=)`).

    Build once with `WoAPlan.build`; launches reuse it. Not for concurrent launches on two streams.

    heads, o_groups: this rank's H and G (H/tp and o_groups/tp under TP; H/G heads per group).
    rank: R = o_lora_rank, outputs per group; head_dim, rope_dim: 512 and 64 in V4.1.
    max_rows: the most rows a launch may pass (1..64); weight_dtype: bfloat16 or float8_e4m3fn.
    block_n: output columns per program; k_per_split: group channels per program; split: programs
    along K per output tile; num_warps, num_stages: launch options (num_stages None: `stages(rows)`
    picks per launch); bf16_dot: BF16 tensor-core
    operands instead of TF32 on FP32 ones (equally exact: the rotated input holds BF16 values, the
    weight BF16 or E4M3; the sums' order inside the MMA differs, so outputs move by BF16 ulps).
    Never under the interpreter, whose BF16 dots are wrong. swap_ab: compute z^T = W o'^T (the
    weight rows as the MMA's M: wgmma on sm_90 reading W from shared memory, instead of mma.sync
    with W through registers); the same products, another summation order inside the MMA. None:
    `swapped` picks, the same for every row count. ieee_dot: FP32 operands with IEEE dots, for
    either weight (CUDA-core FMAs: every product exact, every sum an FP32 round-to-nearest add; a
    tensor-core MMA, BF16 or TF32, truncates while it adds its products: the exact step's option,
    docs/spec-decisions.md); excludes bf16_dot; its launches tile by `ieee_tile`. In the interpreter
    the same numbers as TF32 (its dots are NumPy's FP32 products and sums either way).
    partials: [split, max_rows, G*R] FP32; counters: [G*R / block_n] int32, all 0 between launches.

    Batch invariance: a row's outputs do not depend on the other rows or the row count. The split,
    the dot operands and the swap are the plan's, not the launch's; a swapped launch is wgmma
    m64nBMk8 / k16 at every row count (N = 16, 32 or 64 rows), and an unswapped one takes at most
    32 rows (`MAX_UNSWAPPED_ROWS`; 33-64 rows run as two launches), where Triton lowers the dot to
    mma.sync m16n8k8 / k16: at BLOCK_M = 64 it would pick wgmma, another MMA (sm_90 PTX). With
    ieee_dot each output's sum runs in K order whatever the tile (an FMA chain per output), so the
    tile may follow the launch's rows.
    """
    heads: int
    o_groups: int
    rank: int
    head_dim: int
    rope_dim: int
    max_rows: int
    weight_dtype: torch.dtype
    block_n: int
    k_per_split: int
    split: int
    num_warps: int
    num_stages: int | None
    partials: torch.Tensor
    counters: torch.Tensor
    bf16_dot: bool = False
    swap_ab: bool | None = None
    ieee_dot: bool = False

    @property
    def device(self) -> torch.device:
        return self.partials.device

    def ieee_tile(self, rows: int) -> tuple[int, int]:
        """(BLOCK_M, num_warps) of a launch of `rows` rows with ieee_dot: BLOCK_M the rows' power of
        two, at least 8, and four outputs a thread (an FMA dot's operands are replicated per thread
        over its 32-deep chunk). Compiled for sm_90 with 64-column tiles (tests/ops/_fp32_dots_sm90.py):
        126-128 registers at 8 and 16 rows, 96-104 at 32, no spills for either weight; at 16 rows
        and 4 warps (eight outputs a thread) 240-252, and 2 or 4 rows at two outputs a thread spill."""
        block_m = max(8, triton.next_power_of_2(rows))
        return block_m, max(1, block_m * self.block_n // 128)

    @property
    def swapped(self) -> bool:
        """Whether the launches run the swapped wgmma, at every row count: swap_ab when given, else
        what was measured at 1-16 rows (see `build`): on for a BF16 weight with BF16 dots, off for
        an FP8 weight (swapped measured faster only above 16 rows, and a row's bits must not depend
        on the row count) and for a BF16 weight with TF32 dots (not measured swapped); off off the
        GPU and in the interpreter."""
        if self.swap_ab is not None:
            return self.swap_ab
        if self.device.type != "cuda" or interpreting():
            return False
        return self.weight_dtype == torch.bfloat16 and self.bf16_dot

    def stages(self, rows: int) -> int:
        """K steps in flight for a launch of `rows` rows: num_stages when given, else 2 for an FP8
        weight up to 16 rows (measured, see `build`) and 3 otherwise (for an FP8 weight 2 stages
        measured 5 % slower at 32 rows and the same at 64: docs/results/wo-a-probe-h200.txt)."""
        if self.num_stages is not None:
            return self.num_stages
        return 2 if self.weight_dtype == torch.float8_e4m3fn and rows <= 16 else 3

    @classmethod
    def build(cls, heads: int, o_groups: int, rank: int, max_rows: int, weight_dtype: torch.dtype,
              device: torch.device | str = "cuda", *, head_dim: int = 512, rope_dim: int = 64,
              split: int | None = None, num_warps: int = 4, num_stages: int | None = None,
              bf16_dot: bool | None = None, swap_ab: bool | None = None, workspace=None,
              ieee_dot: bool = False) -> "WoAPlan":
        """Choose the split and the dot operands, and allocate the workspace (or take it: `workspace`).

        Defaults measured on an H200 at 64 heads, 1-16 rows (scripts/probe_wo_a.py,
        docs/results/wo-a-probe-h200.txt): a BF16 weight streams best at about 2 programs per SM
        with BF16 dot operands (23.7 vs 25.7 us at 1 row) read by a swapped wgmma (21.6 vs 23.4 us at
        1 row, 23.1 vs 24.5 at 4, 25.4 vs 26.2 at 16), an FP8 weight at about 4 programs
        per SM with TF32 dots, unswapped (21.3 us; swapped 27.4; BF16 operands gain nothing there)
        and 2 stages (20.5 vs 21.3 us at 1 row, 21.6 vs 22.7 at 16).
        split: programs along K (default: the largest divisor of group_width / 128 at most
        (2 for BF16, 4 for FP8) * SMs / output tiles); bf16_dot: None = on for a BF16 weight;
        num_warps: warps per program up to 16 rows (a power of two in 1..16), twice that above
        (4: one m16 MMA row of 64 columns; 32-64 rows at 4 warps spill; not used with ieee_dot,
        whose launches take `ieee_tile`); num_stages: K steps in
        flight, >= 1 (None: `stages(rows)` picks per launch); swap_ab: None = `swapped` picks (a BF16
        weight with BF16 dots swapped, an FP8 one unswapped at every row count, for batch
        invariance: swapped measured 45.6 vs 48.0 us at 32 rows and 61.2 vs 85.6 at 64, but 27.4
        vs 21.3 at 1; unswapped, 33-64 rows run as two launches of at most 32;
        docs/results/wo-a-probe-h200.txt); ieee_dot: FP32 operands with IEEE dots (the class doc;
        bf16_dot None then means off, and True is an error).
        workspace: None - the plan allocates its partials and counters; else a pool
        (`ops.common.plan_workspace`: `decode.buffers.Workspaces`) that it takes them from (FP32
        slot 0, int32 slot 0), shared with the pool's other takers: the caller guarantees that no
        two launches using the pool overlap in time (one stream, in order). The counters are zero
        between launches and the partials are written before they are read within a launch
        (`splitk_reduce`), so the bits do not depend on who else used the memory.
        """
        for name, v in (("heads", heads), ("o_groups", o_groups), ("rank", rank), ("max_rows", max_rows),
                        ("head_dim", head_dim), ("rope_dim", rope_dim)):
            require_int(v, name)
        if heads % o_groups:
            raise ValueError(f"heads={heads} must be a multiple of o_groups={o_groups}")
        if rank % 32:
            raise ValueError(f"rank={rank} must be a multiple of 32 (the weight's scale blocks)")
        if head_dim % 128 or rope_dim % 32 or rope_dim > head_dim:
            raise ValueError(f"head_dim={head_dim} must be a multiple of 128 and rope_dim={rope_dim} "
                             f"a multiple of 32 no larger")
        if max_rows > 64:
            raise ValueError(f"max_rows must be at most 64 (the low-batch limit), got {max_rows}")
        if weight_dtype not in (torch.bfloat16, torch.float8_e4m3fn):
            raise TypeError(f"weight_dtype must be torch.bfloat16 or torch.float8_e4m3fn, got {weight_dtype}")
        device = torch.device(device)
        block_n = 64 if rank % 64 == 0 else 32
        n_tiles = o_groups * rank // block_n
        grains = heads // o_groups * head_dim // _BLOCK_K
        fp8 = weight_dtype == torch.float8_e4m3fn
        if not isinstance(ieee_dot, bool):
            raise TypeError(f"ieee_dot must be a bool, got {type(ieee_dot).__name__}")
        require_bool(bf16_dot, "bf16_dot", optional=True)
        require_bool(swap_ab, "swap_ab", optional=True)
        require_num_warps(num_warps)
        if num_stages is not None:
            require_int(num_stages, "num_stages")
        if ieee_dot and bf16_dot:
            raise ValueError("ieee_dot and bf16_dot exclude each other: IEEE dots take FP32 operands")
        if bf16_dot is None:
            bf16_dot = not fp8 and not ieee_dot
        if split is None:
            target = max(1, round((4 if fp8 else 2) * num_sms(device) / n_tiles))
            split = max(d for d in range(1, grains + 1) if grains % d == 0 and d <= target)
        elif isinstance(split, bool) or not isinstance(split, int) or split < 1 or grains % split:
            raise ValueError(f"split must be a positive divisor of group_width / {_BLOCK_K} = {grains}, "
                             f"got {split!r}")
        partials = plan_workspace(workspace, 0, (split if split > 1 else 0, max_rows, o_groups * rank),
                                  torch.float32, device)
        counters = plan_workspace(workspace, 0, n_tiles, torch.int32, device)
        return cls(heads, o_groups, rank, head_dim, rope_dim, max_rows, weight_dtype, block_n,
                   grains // split * _BLOCK_K, split, num_warps, num_stages, partials, counters,
                   bool(bf16_dot) and device.type == "cuda" and not interpreting(),
                   None if swap_ab is None else bool(swap_ab), ieee_dot)


def _window_copy_args(window_copy, m: int, dev: torch.device, dummy: torch.Tensor):
    """(pool as int32 words, src, dst, words per record) of a `window_copy`, or unused pointers."""
    if window_copy is None:
        return dummy, dummy, dummy, 0
    if not isinstance(window_copy, (tuple, list)) or len(window_copy) != 3:
        raise ValueError("window_copy must be a tuple (pool, src, dst)")
    pool, src, dst = window_copy
    if not isinstance(pool, torch.Tensor) or pool.dtype != torch.uint8:
        raise TypeError(f"window_copy: pool must be a uint8 tensor, got {type(pool).__name__} "
                        f"{getattr(pool, 'dtype', '')}")
    if pool.dim() != 2:
        raise ValueError(f"window_copy: pool must be 2-D [slots, record bytes], got {tuple(pool.shape)}")
    if not pool.is_contiguous() or pool.shape[1] % 4 or pool.storage_offset() % 4 or pool.device != dev:
        raise ValueError(f"window_copy: pool must be contiguous on {dev} with records of a multiple of 4 bytes "
                         f"at a 4-byte aligned offset, got {tuple(pool.shape)} on {pool.device}")
    for t, name in ((src, "src"), (dst, "dst")):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.int64:
            raise TypeError(f"window_copy: {name} must be an int64 tensor, got {type(t).__name__} "
                            f"{getattr(t, 'dtype', '')}")
        if t.dim() != 1 or t.shape[0] < m or t.stride(0) != 1 or t.device != dev:
            raise ValueError(f"window_copy: {name} must be a contiguous vector of at least {m} entries "
                             f"on {dev}, got shape {tuple(t.shape)} strides {t.stride()} on {t.device}")
    return pool.view(torch.int32), src, dst, pool.shape[1] // 4


class WoAArgs(NamedTuple):
    """`wo_a_args`' result: the call's rows and what a launch passes for the optional tensors (byte
    views; the plan's counters stand in for the MXFP8 outputs a launch does not write)."""
    m: int
    scale: torch.Tensor | None      # the FP8 weight's scales as uint8, None for a BF16 weight
    quant: bool                     # codes_out and scales_out given
    codes_out: torch.Tensor
    scales_out: torch.Tensor
    window_copy: tuple              # `_window_copy_args`: (pool, src, dst, words per record)


def wo_a_args(plan, plan_type: type, o: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, weight: torch.Tensor,
              scale: torch.Tensor | None, out: torch.Tensor, codes_out: torch.Tensor | None,
              scales_out: torch.Tensor | None, window_copy) -> WoAArgs:
    """The checks of `wo_a_`'s arguments (see there), shared by the op's launchers (`wo_a_` and
    `gluon_wo_a.gluon_wo_a_`): plan must be a plan_type with `WoAPlan`'s fields (heads, head_dim,
    rope_dim, weight_dtype, n_out, group_width, device, counters). An error names the first bad
    argument; nothing is launched or written."""
    m = planned_rows(plan, plan_type, o, "o", "[M, H, head_dim]")
    dev = plan.device
    if o.dtype != torch.bfloat16:
        raise TypeError(f"o must have dtype torch.bfloat16, got {o.dtype}")
    if tuple(o.shape[1:]) != (plan.heads, plan.head_dim):
        raise ValueError(f"o must have shape [M, {plan.heads}, {plan.head_dim}], got {tuple(o.shape)}")
    if o.stride(2) != 1 or o.device != dev:
        raise ValueError(f"o must have unit stride in its last dimension and be on {dev}, got strides "
                         f"{o.stride()} on {o.device}")
    require_tensor(cos, "cos", (torch.float32,), (m, plan.rope_dim // 2), dev)
    require_tensor(sin, "sin", (torch.float32,), (m, plan.rope_dim // 2), dev)
    require_tensor(weight, "weight", (plan.weight_dtype,), (plan.n_out, plan.group_width), dev)
    if plan.weight_dtype == torch.float8_e4m3fn:
        if scale is None:
            raise ValueError("scale is required with an FP8 weight")
        require_tensor(scale, "scale", (torch.uint8, torch.float8_e8m0fnu),
                       (plan.n_out // 32, plan.group_width // 32), dev)
        scale = scale.view(torch.uint8)
    elif scale is not None:
        raise ValueError("scale must be None with a BF16 weight")
    require_tensor(out, "out", (torch.bfloat16,), (m, plan.n_out), dev)
    quant = codes_out is not None or scales_out is not None
    if quant:
        if codes_out is None or scales_out is None:
            raise ValueError("codes_out and scales_out go together (the MXFP8 of out)")
        require_tensor(codes_out, "codes_out", (torch.float8_e4m3fn, torch.uint8), (m, plan.n_out), dev)
        require_tensor(scales_out, "scales_out", (torch.uint8, torch.float8_e8m0fnu), (m, plan.n_out // 32), dev)
        codes_out, scales_out = codes_out.view(torch.uint8), scales_out.view(torch.uint8)
    else:
        codes_out = scales_out = plan.counters     # unused pointers
    copy = _window_copy_args(window_copy, m, dev, plan.counters)
    return WoAArgs(m, scale, quant, codes_out, scales_out, copy)


def wo_a_(plan: WoAPlan, o: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, weight: torch.Tensor,
          scale: torch.Tensor | None, out: torch.Tensor, codes_out: torch.Tensor | None = None,
          scales_out: torch.Tensor | None = None,
          window_copy: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> None:
    """Write z = `reference.attention.grouped_wo_a(o, cos + j sin, weight', G, rope_dim)` into out.

    plan: from `WoAPlan.build(H, G, R, max_rows, weight.dtype, device)`.
    o: [M, H, head_dim] bfloat16, 1 <= M <= plan.max_rows (M = 0 writes nothing), unit stride in
       the last dimension (any row and head strides).
    cos, sin: [M, rope_dim/2] float32, the real and imaginary parts of `reference.rope.rope_cis` at
       each row's position (built once per step by the caller); unit stride in the last dimension.
    weight: [G*R, (H/G)*head_dim] bfloat16, or float8_e4m3fn with `scale` (weight' = its
       `formats.fp8_block_dequantize`); unit stride in the last dimension.
    scale: [G*R/32, (H/G)*head_dim/32] UE8M0 bytes (uint8 or float8_e8m0fnu) for an FP8 weight,
       None for BF16. Bytes must be 1..254 (unchecked; the checkpoint's scale rule gives no others).
    out: [M, G*R] bfloat16, unit stride in the last dimension. All on plan.device.
    codes_out, scales_out: optionally also the MXFP8 of out (`act_quant_mxfp8_(out, codes_out,
       scales_out)`, bit for bit, in the same launch): [M, G*R] float8_e4m3fn (or uint8) and
       [M, G*R/32] uint8 (or float8_e8m0fnu), unit stride in the last dimension.
    window_copy: optionally (pool, src, dst): also do `pool.index_copy_(0, dst[:M],
       pool.index_select(0, src[:M]))` in the same launch (the decode step's staged window records
       moved into their ring slots, without two side-stream kernels beside this one). pool: [S, B]
       uint8, contiguous, B a multiple of 4; src, dst: int64 [>= M]; unchecked: the ids lie in
       0..S-1, no dst is another row's src and the dsts are distinct (the step's tables give that).
       The copy runs after the kernel's wait for its predecessors (stream order; `pdl.enter` under
       programmatic dependent launch), so it may overwrite what they read; it is not ordered
       against this kernel's other programs.
    """
    m, scale, quant, codes_out, scales_out, (cp_pool, cp_src, cp_dst, copy_words) = wo_a_args(
        plan, WoAPlan, o, cos, sin, weight, scale, out, codes_out, scales_out, window_copy)
    fp8 = scale is not None
    if m == 0:
        return
    part = plan.partials
    s_arg = scale if fp8 else weight
    swap = plan.swapped
    stages = plan.stages(m)
    chunk = m if swap else MAX_UNSWAPPED_ROWS   # see the class docstring (batch invariance)
    for r0 in range(0, m, chunk):
        r1 = min(m, r0 + chunk)
        if plan.ieee_dot:
            block_m, warps = plan.ieee_tile(r1 - r0)
        else:
            block_m = max(16, triton.next_power_of_2(r1 - r0))
            warps = plan.num_warps * (2 if block_m > 16 else 1)
        codes, scales = (codes_out[r0:r1], scales_out[r0:r1]) if quant else (codes_out, scales_out)
        src, dst = (cp_src[r0:r1], cp_dst[r0:r1]) if copy_words else (cp_src, cp_dst)
        _wo_a_kernel[(plan.n_out // plan.block_n, plan.split)](
            o[r0:r1], cos[r0:r1], sin[r0:r1], weight, s_arg, out[r0:r1].view(torch.int16), part, plan.counters,
            codes, scales, cp_pool, src, dst, r1 - r0,
            o.stride(0), o.stride(1), cos.stride(0), sin.stride(0), weight.stride(0), s_arg.stride(0),
            out.stride(0), part.stride(0), part.stride(1), codes.stride(0), scales.stride(0),
            R=plan.rank, HEADS_PER_GROUP=plan.heads // plan.o_groups, HEAD_DIM=plan.head_dim,
            ROPE_DIM=plan.rope_dim, K_PER_SPLIT=plan.k_per_split, SPLIT=plan.split, QUANT=quant,
            BLOCK_M=block_m, BLOCK_N=plan.block_n, BLOCK_K=_BLOCK_K, FP8=fp8, NUM_STAGES=stages,
            num_warps=warps, num_stages=stages,
            enable_fp_fusion=False,   # the rotation's sums rounded as torch rounds them (no FMA)
            PDL=False, BF16_DOT=plan.bf16_dot, SWAP_AB=swap, IEEE_DOT=plan.ieee_dot,
            COPY_WORDS=copy_words, COPY_BLOCK=triton.next_power_of_2(max(copy_words, 1)),
            N_TILES=plan.n_out // plan.block_n,
        )


def wo_a(o: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, weight: torch.Tensor, o_groups: int,
         scale: torch.Tensor | None = None, out: torch.Tensor | None = None,
         plan: WoAPlan | None = None) -> torch.Tensor:
    """z = `reference.attention.grouped_wo_a`: o [M, H, 512] bfloat16 -> [M, G*R] bfloat16.

    Operands as in `wo_a_`; o_groups: G on this rank (R = weight.shape[0] / G). plan: optional
    (default: built here, which allocates; pass one for CUDA graphs). Returns out or a new tensor.
    """
    require_ndim(o, "o", "[M, H, head_dim]")
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise ValueError(f"weight must be a 2-D tensor, got {getattr(weight, 'shape', type(weight).__name__)}")
    if not isinstance(o_groups, int) or o_groups < 1 or weight.shape[0] % o_groups:
        raise ValueError(f"o_groups={o_groups!r} must be a positive int dividing weight rows {weight.shape[0]}")
    if o.shape[0] > 64:
        raise ValueError(f"o has {o.shape[0]} rows; wo_a serves at most 64 (the low-batch limit)")
    if plan is None:
        plan = WoAPlan.build(o.shape[1], o_groups, weight.shape[0] // o_groups, max(1, o.shape[0]),
                             weight.dtype, o.device, head_dim=o.shape[2],
                             rope_dim=2 * cos.shape[-1] if isinstance(cos, torch.Tensor) else 64)
    if out is None:
        out = torch.empty(o.shape[0], plan.n_out, dtype=torch.bfloat16, device=o.device)
    wo_a_(plan, o, cos, sin, weight, scale, out)
    return out


def quantize_wo_a(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 E4M3 codes and 32x32 UE8M0 scales of a BF16 `wo_a` weight (`formats.fp8_block_quantize`).

    This changes the numbers: the official inference layout ships `wo_a` in BF16 and the spec
    multiplies by those values, so quantizing rounds every weight to 4 significant bits (a relative
    error up to 2^-4; about 2.6% relative RMS in z for Gaussian weights). Use it only when the user
    asks for FP8 `wo_a` (half the bytes to stream); a checkpoint that ships `wo_a` in FP8 needs no
    call and stays exact.

    w: [G*R, (H/G)*512] bfloat16 (or float). Returns (weight float8_e4m3fn, scale float8_e8m0fnu
    [G*R/32, (H/G)*512/32]).
    """
    return fp8_block_quantize(w)
