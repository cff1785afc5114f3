"""The sparse MLA decode in Gluon for Hopper (sm_90), key-major: the contract of `ops.sparse_mla`
(spec section 3 step 8; that module's doc is the contract as implemented) with every record read
and decoded once per row, for all local heads of the row at once.

One program per (row, 64-key block of the row's joined key list): the split of `ops.sparse_mla`'s
split plans, with its decoupled look-back for the running max and its workspace layout, so the
blocks' partials are combined by the same second launch (`sparse_mla._sparse_mla_combine_kernel`,
in block order), or with `GluonSparseMlaConfig.combine="spread"` by all of the row's programs in
the same launch, with that kernel's arithmetic (the same bits); with `combine="pv"` the programs
store their block's P instead of its partial, and P.V and the combination run in a second launch
(`ops.gluon_sparse_mla_pv`, the same MMAs and arithmetic). A program:

- takes its (row, block) from the plan's atomic ticket (blocks in ascending order, so it only
  waits for programs already running), or from its program id where the whole grid is resident at
  once (the spread combination; "pv" where its programs fit the SMs), loads q [H, 512] of its row
  into shared memory as four [64, 128] chunks (heads past H as zeros: the wgmma's M is 64, so 8,
  16 and 32 heads are padded to 64 rows; `GluonSparseMlaConfig.q_buffers` 2: the last two chunks
  reuse the first two's buffers once their score MMAs have read them, 104 KB of shared memory
  instead of 136, two programs per SM);
- gathers its block's 64 records (window: ring slots into the [S_w, 528] MXFP8 pool; compressed:
  slots into the [S_c, 288] NVFP4 pool; -1 entries masked to zero) with plain loads into registers
  (16 code bytes a thread for the window, 8 for the compressed codes with `fp4_packed`, whose
  nibbles are split and interleaved in registers; with `prefetch` every chunk's loads are in flight
  before the first is decoded), decodes them exactly to BF16 (E4M3 code *
  2^(e - 127) per 32 dims; E2M1 * E4M3 scale per 16) and stores the 64 x 512 keys into shared
  memory, four 128-dim chunks (K = V);
- S = sum over the chunks in order of q_c k_c^T on `warpgroup_mma` (BF16 operands from shared
  memory, FP32 accumulator; 8 warps: the two warpgroups take 32 keys each, every key's 512-long sum
  in one warpgroup), scaled, -inf where a key is invalid;
- publishes its block's score max per head (then a bit of the row's flag words) and takes the
  running max of the sequential loop there: the max of the maxima of the blocks before it, each
  published by its own program, read at once when every earlier block's bit is set (two round trips
  to L2 whatever the block, where waiting on and reading one earlier block at a time costs two per
  block; max is exact, so the bits are the same); then
  P = bf16(exp(s - max)) with exp the CUDA math library's expf (torch's), the block's sum of the
  unrounded exp, and acc = P V, one 128-dim chunk at a time on `warpgroup_mma` (P from shared
  memory, each warpgroup 64 of the chunk's dims), stored to the plan's FP32 workspace as summed
  (with `dim_split` S, S programs share a block: each computes the scores and the look-back and
  does P.V for 512 / S of the dims);
- with the spread combination, counts its arrival on its row's counter (acq_rel), waits for the
  row's other programs, then combines its share of the row's output from every block's partial in
  block order.

The arithmetic is `sparse_mla`'s split plans': the same blocks, the same running max per block, P
rounded to BF16 against it, the same sums stored per block and combined by the same kernel. What
the hardware decides is the FP32 order of the tensor cores' sums (the score's 512 products, P.V's
64, as `sparse_mla`'s BF16 dots) and of the block's exp sum (a tree over the 64 keys in this
kernel's layout), which the tolerance of tests/ops/test_sparse_mla.py covers. Nothing depends on
the other rows of the launch: a row's blocks, their order and their arithmetic are the same at
every row count.

Gluon (Triton 3.6.0) has no gather TMA on sm_90 (Hopper's TMA has no gather mode), so the records
are loaded with `gl.load` into registers and stored to shared memory by the 8 warps themselves
(`ops.gluon_mla_records`, the gather and decode both launches of "pv" share).

Several blocks a program (the contract's sequential loop over them, the accumulator carried from
block to block) would write fewer partials, but it sums in another FP32 order than the per-block
partials' combination, so a step could only use it at every row count, where at 1-8 rows it runs
a row's blocks in series instead of side by side; built and measured on an H200 (5-7x slower than
one block a program at 1 row, 1.4x at 64 rows, its blocks decoded in eight dependent 64-dim
round trips), it was removed. No configuration here changes a bit, so the step may pick one per
row count.

The options (`GluonSparseMlaConfig`), the plan (`GluonSparseMlaPlan`: a `SparseMlaPlan` with
`split=True`, `separate_combine=True` and all heads in one group, the spread combination's counters
and the debug phase log) and the step's configurations per row and head count (`STEP_CONFIGS`) live in
`ops.gluon_sparse_mla_plan`; this module re-exports them with the kernel and its launcher.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.extra import libdevice
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from .checks import require_tensor
from .common import is_sm90, num_sms
from .gluon_epilogues import add_combine, max_combine
from .gluon_mla_records import (_CREC, _DC, _KEYS, _M, _WARPS, _WREC, NUM_WARPS, _bf16_rne_bits, _block_slots,
                                _decode_chunk, _decode_loaded, _decode_mixed_chunk, _load_chunk)
from .gluon_sparse_mla_plan import (PHASE_COLS, PHASE_NAMES, STEP_CONFIGS, GluonSparseMlaConfig, GluonSparseMlaPlan,
                                   programs_per_sm, specialization_key)
from .gluon_ring import tma_desc
from .gluon_sparse_mla_pv import mla_pv_
from .pdl import gluon_gate_signal, gluon_launch_dependents, gluon_wait, launch_options, require_supported
from .sparse_mla import check_sparse_mla_args, combine_partials_

__all__ = ["NUM_WARPS", "PHASE_NAMES", "STEP_CONFIGS", "GluonSparseMlaConfig", "GluonSparseMlaPlan", "gluon_sparse_mla_",
           "q_by_tma"]

# Polls of the look-back before a program gives up (about a microsecond each: seconds in all). The
# blocks a program waits for belong to programs already running, so the wait always ends; the bound
# turns a broken invariant (say a ticket not reset) into NaN outputs instead of a hung GPU.
_SPIN_LIMIT: gl.constexpr = gl.constexpr(1 << 22)

# Where a program signals a gate (`gluon_sparse_mla_(signal_after=)`): the kernel's SIGNAL 1, 2.
SIGNAL_POINTS = ("decoded", "stored")


@gluon.jit
def _decode_block(k_smem, pool_ptr, base, ok, WINDOW: gl.constexpr, FP4_PACKED: gl.constexpr,
                  PREFETCH: gl.constexpr, layout: gl.constexpr, log_row, PHASES: gl.constexpr,
                  FP4_LUT: gl.constexpr = False):
    """The block's 64 records of one pool decoded into k_smem (four [64, 128] BF16 chunks); with
    PREFETCH every chunk's loads are issued before the first decode (one memory latency, not four).
    PHASES: the phase log's `gathered` once the first chunk is stored (its bytes have arrived)."""
    if PREFETCH:
        c0, s0 = _load_chunk(pool_ptr, base, ok, 0, WINDOW, FP4_PACKED, layout)
        c1, s1 = _load_chunk(pool_ptr, base, ok, 1, WINDOW, FP4_PACKED, layout)
        c2, s2 = _load_chunk(pool_ptr, base, ok, 2, WINDOW, FP4_PACKED, layout)
        c3, s3 = _load_chunk(pool_ptr, base, ok, 3, WINDOW, FP4_PACKED, layout)
        k_smem.index(0).store(_decode_loaded(c0, s0, ok, 0, WINDOW, FP4_PACKED, layout, 128, FP4_LUT).to(gl.bfloat16))
        _stamp(log_row, 3, PHASES)
        k_smem.index(1).store(_decode_loaded(c1, s1, ok, 1, WINDOW, FP4_PACKED, layout, 128, FP4_LUT).to(gl.bfloat16))
        k_smem.index(2).store(_decode_loaded(c2, s2, ok, 2, WINDOW, FP4_PACKED, layout, 128, FP4_LUT).to(gl.bfloat16))
        k_smem.index(3).store(_decode_loaded(c3, s3, ok, 3, WINDOW, FP4_PACKED, layout, 128, FP4_LUT).to(gl.bfloat16))
    else:
        for c in gl.static_range(4):
            k_smem.index(c).store(_decode_chunk(pool_ptr, base, ok, c, WINDOW, FP4_PACKED, layout, 128,
                                                FP4_LUT).to(gl.bfloat16))
            if c == 0:
                _stamp(log_row, 3, PHASES)


@gluon.jit
def _stamp(log_row, SLOT: gl.constexpr, PHASES: gl.constexpr):
    """PHASES (debug): once every warp has reached this point (a barrier; the phase's loads are
    consumed before it), the SM's cycle counter into log_row[SLOT] (int64; one thread stores)."""
    if PHASES:
        gl.thread_barrier()
        t = gl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l", [], dtype=gl.int64, is_pure=False, pack=1)
        gl.store(log_row + SLOT, t)


@gluon.jit
def _stamp_global(log_row, SLOT: gl.constexpr, ASM: gl.constexpr, PHASES: gl.constexpr):
    """PHASES (debug): a special register read by `ASM` (globaltimer, smid) into log_row[SLOT]."""
    if PHASES:
        t = gl.inline_asm_elementwise(ASM, "=l", [], dtype=gl.int64, is_pure=False, pack=1)
        gl.store(log_row + SLOT, t)


# The phase log's columns past `PHASE_NAMES`' (`gluon_sparse_mla_plan`: what each holds).
_PH_GSTART: gl.constexpr = gl.constexpr(10)
_PH_GEND: gl.constexpr = gl.constexpr(11)
_PH_SM: gl.constexpr = gl.constexpr(12)
_PH_COMBINER: gl.constexpr = gl.constexpr(13)
_PH_CEND: gl.constexpr = gl.constexpr(14)
_PH_COLS: gl.constexpr = gl.constexpr(PHASE_COLS)


@gluon.constexpr_function
def _combine_layout(PH):
    """The combination's [PH, 1024 / PH] layout over the program's warps: 4 values a thread."""
    return gl.BlockedLayout([1, 4], [PH // 8, 256 // PH], [NUM_WARPS, 1], [1, 0])


@gluon.jit
def _load_sink(sink_ptr, H, PH: gl.constexpr):
    """sink [PH] (0 past the H heads) in the combination's head slice (`_combine_slice`'s sink)."""
    hd = gl.arange(0, PH, layout=gl.SliceLayout(1, _combine_layout(PH)))
    return gl.load(sink_ptr + hd, mask=hd < H, other=0.0)


@gluon.jit
def _combine_slice(part_acc_ptr, part_ml_ptr, sink, out_ptr, r, H, stride_on, stride_oh, i0, stuck,
                   NB: gl.constexpr, NB_P2: gl.constexpr, PH: gl.constexpr, STEP: gl.constexpr):
    """The row's NB block partials combined over the [PH, CW] dim steps i0, i0 + STEP, ... of its
    [PH, 512] output (NaN where stuck > 0), out as BF16 bits: the
    arithmetic of `sparse_mla._sparse_mla_combine_kernel` element for element (the maxima, the
    valid-key counts, then each block's acc and sum rescaled by exp(m_b - m_all) and added in block
    order, o = acc / (sum + exp(sink - m_all)) rounded to nearest even, zeros where the row had no
    valid key), spread over the program's warps [PH, CW] at a time, every block's slice in flight
    at once (`.cg`: the partials from L2, where their programs just wrote them)."""
    D: gl.constexpr = 512
    CW: gl.constexpr = 1024 // PH               # [PH, CW]: 4 values a thread per block and step
    cl: gl.constexpr = _combine_layout(PH)
    hd = gl.arange(0, PH, layout=gl.SliceLayout(1, cl))
    dd = gl.arange(0, CW, layout=gl.SliceLayout(0, cl))
    sb = gl.arange(0, NB_P2, layout=gl.SliceLayout(0, cl))
    # the blocks' (max, sum, count) per head as [PH, NB_P2] tiles, loaded at once; the maximum and
    # the count (whole numbers) are exact in any order
    ml = part_ml_ptr + (r.to(gl.int64) * NB) * (3 * PH) + sb[None, :] * (3 * PH) + hd[:, None]
    in_nb = (sb < NB)[None, :]
    m2 = gl.load(ml, mask=in_nb, other=-1e30, cache_modifier=".cg")
    l2 = gl.load(ml + PH, mask=in_nb, other=0.0, cache_modifier=".cg")
    n_all = gl.reduce(gl.load(ml + 2 * PH, mask=in_nb, other=0.0, cache_modifier=".cg"), 1, add_combine)
    m_all = gl.maximum(gl.reduce(m2, 1, max_combine), -1e30)
    # each block's factor exp(m_b - m_all) and its rescaled sum, the sums added in block order
    f_smem = gl.allocate_shared_memory(gl.float32, [PH, NB_P2], gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0]))
    l_smem = gl.allocate_shared_memory(gl.float32, [PH, NB_P2], gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0]))
    f_smem.store(libdevice.exp(m2 - m_all[:, None]))
    l_smem.store(l2)
    gl.thread_barrier()
    l_all = gl.zeros([PH, 1], gl.float32, cl)
    for s in gl.static_range(NB):
        l_all += l_smem.slice(s, 1, dim=1).load(cl) * f_smem.slice(s, 1, dim=1).load(cl)
    h_ok = hd < H
    m_all = m_all[:, None]
    # no valid key: acc is 0, o is 0
    den = gl.where(n_all[:, None] > 0, l_all + libdevice.exp(sink[:, None] - m_all), float("inf"))
    den = gl.where(stuck > 0, float("nan"), den)      # never by design: a bug shows as NaN, not a hang
    acc = part_acc_ptr + (r.to(gl.int64) * NB) * (PH * D) + hd[:, None] * D + dd[None, :]
    out_rows = out_ptr + r * stride_on + hd[:, None] * stride_oh + dd[None, :]
    for i in range(i0, D // CW, STEP):
        a = gl.zeros([PH, CW], gl.float32, cl)
        for s in gl.static_range(NB):
            a += gl.load(acc + s * (PH * D) + i * CW, cache_modifier=".cg") * f_smem.slice(s, 1, dim=1).load(cl)
        gl.store(out_rows + i * CW, _bf16_rne_bits(a / den), mask=h_ok[:, None])


@gluon.jit
def _clear_row(flags, board, NB: gl.constexpr, NB_P2: gl.constexpr, PH: gl.constexpr, VALUES: gl.constexpr,
               ld: gl.constexpr):
    """The row's look-back state back to zero for the next launch (every program of the row is past
    its look-back): its flag words, and with VALUES its board of maxima."""
    fw = gl.arange(0, NB_P2, layout=gl.SliceLayout(1, ld))
    gl.store(flags + fw, gl.zeros([NB_P2], gl.int32, gl.SliceLayout(1, ld)), mask=fw < (NB + 31) // 32)
    if VALUES:
        mh = gl.arange(0, _M, layout=gl.SliceLayout(0, ld))
        gl.store(board + fw[:, None] * PH + mh[None, :], gl.zeros([NB_P2, _M], gl.int32, ld),
                 mask=(fw < NB)[:, None] & (mh < PH)[None, :])


@gluon.jit
def _gluon_sparse_mla_kernel(
    q_ptr, wpool_ptr, cpool_ptr, wtab_ptr, ctab_ptr,
    part_acc_ptr, part_ml_ptr, block_max_ptr, flag_ptr, ticket_ptr,
    sink_ptr, out_ptr, count_ptr, log_ptr, board_ptr, q_desc, signal_ptr,
    N, H, scale, stride_qn, stride_qh, stride_wt, stride_ct, stride_on, stride_oh,
    W: gl.constexpr, W_P2: gl.constexpr, KC: gl.constexpr, NB: gl.constexpr, NB_P2: gl.constexpr, PH: gl.constexpr,
    Q_BUFFERS: gl.constexpr = 4, FP4_PACKED: gl.constexpr = False, PREFETCH: gl.constexpr = False,
    DSPLIT: gl.constexpr = 1, SPREAD: gl.constexpr = False, VALUES: gl.constexpr = False,
    TICKET: gl.constexpr = True, PV_PIPELINE: gl.constexpr = False,
    FP4_LUT: gl.constexpr = False,
    PHASES: gl.constexpr = False, P_OUT: gl.constexpr = False, K_BUFFERS: gl.constexpr = 4,
    Q_TMA: gl.constexpr = False, RELEASE: gl.constexpr = False, SIGNAL: gl.constexpr = 0,
    WAIT: gl.constexpr = False,
):
    # Workspaces (`SparseMlaPlan` with one head group of PH = block_h heads): acc [N, NB, PH, 512],
    # ml [N, NB, 3, PH] (max, sum, valid-key count), block_max [N, NB, PH], flags [N, NB] (here a
    # bit per block: the row's first ceil(NB / 32) words; the combination zeroes them). Without
    # SPREAD the separate launch combines; with it, counters [N] (`GluonSparseMlaPlan.counters`):
    # the row's arrivals. PHASES: log [N * NB * DSPLIT, 16] int64 by ticket. P_OUT (the combination
    # "pv"): no P.V here; part_acc_ptr is BF16 [N, NB, PH, 64], where the block's P goes, for
    # `gluon_sparse_mla_pv`'s launch (P.V, the combination, the flags' reset). SIGNAL (1, 2): one
    # signal a program to signal_ptr (`ops.pdl.gluon_gate_signal`) once its records are decoded into
    # shared memory (1) or once its partial (or P) is stored (2); 0: none. WAIT: launched by PDL, the
    # program waits for the kernel before it (`griddepcontrol.wait`) before anything else.
    D: gl.constexpr = 512
    NC: gl.constexpr = D // _DC
    NCP: gl.constexpr = NC // DSPLIT        # the 128-dim chunks of P.V and of the partial a program does
    gl.static_assert(Q_BUFFERS == NC or Q_BUFFERS == 2)
    gl.static_assert(DSPLIT == 1 or DSPLIT == 2 or DSPLIT == 4)
    if WAIT:
        gluon_wait()
    if P_OUT or RELEASE:
        # the second launch, where launched with PDL (`GluonSparseMlaConfig.pv_pdl`), or (RELEASE)
        # the kernel after this one, where launched with PDL (`gluon_wo_a_(pdl=True)`), may start once
        # every program of this one has (its reads and copies, then its wait before what this writes)
        gluon_launch_dependents()
    if PHASES:
        t0 = gl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l", [], dtype=gl.int64, is_pure=False, pack=1)
        g0 = gl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=gl.int64, is_pure=False, pack=1)
    # One ticket per program, in the order the programs start: block-major (then row, then dim
    # slice), so a program's earlier blocks belong to programs that already run.
    # Without TICKET (the spread combination, where every program of the grid is resident at once)
    # the program id stands for it: no program waits on one that cannot start.
    if TICKET:
        ticket = gl.atomic_add(ticket_ptr, 1, sem="relaxed", scope="gpu")
        if ticket == N * NB * DSPLIT - 1:
            gl.store(ticket_ptr, 0)      # every program has its ticket: ready for the next launch
    else:
        ticket = gl.program_id(0)
    if SPREAD:
        # the sink (constant) asked for now: the combination reads it after the row's wait, which
        # a load issued there could not move ahead of
        sink = _load_sink(sink_ptr, H, PH)
    b = ticket // (N * DSPLIT)
    r = (ticket // DSPLIT) % N
    sl = ticket % DSPLIT                 # the dims of P.V and of the partial: chunks [sl NCP, sl NCP + NCP)
    log_row = log_ptr + ticket.to(gl.int64) * _PH_COLS
    if PHASES:
        gl.store(log_row, t0)
        gl.store(log_row + _PH_GSTART, g0)
        for c in gl.static_range(8, 10):      # not passed by every program
            gl.store(log_row + c, 0)
        gl.store(log_row + _PH_COMBINER, 0)
        _stamp_global(log_row, _PH_SM, "{ .reg .u32 t; mov.u32 t, %smid; cvt.u64.u32 $0, t; }", PHASES)

    # Layouts: loads of 16 consecutive bytes or values per thread; the MMAs' accumulators (two
    # warpgroups side by side along N).
    ld: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [_WARPS, 1], [1, 0])
    s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, 32, 16])
    o_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, 64, 16])
    chunk_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([_M, _DC], gl.bfloat16)
    p_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([_M, _KEYS], gl.bfloat16)
    q_smem = gl.allocate_shared_memory(gl.bfloat16, [Q_BUFFERS, _M, _DC], chunk_sl)
    k_smem = gl.allocate_shared_memory(gl.bfloat16, [K_BUFFERS, _KEYS, _DC], chunk_sl)
    if not P_OUT:
        p_smem = gl.allocate_shared_memory(gl.bfloat16, [_M, _KEYS], p_sl)
    if Q_TMA:
        # (q viewed [rows x H, 512], H = PH: the row's heads are the first H of the [64, 512] tile
        # at row r H; past them the next rows' q or the TMA's zeros past the tensor, in the padded
        # heads' rows, whose values no store writes) q's first Q_BUFFERS chunks copied by TMA from
        # the program's start, completing on q_bar[0]; with two key buffers its last two during
        # chunk 2's decode, on q_bar[1] (below)
        q_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        mbarrier.init(q_bar.index(0), count=1)
        mbarrier.init(q_bar.index(1), count=1)
        fence_async_shared()          # the initialized barriers before the async proxy's copies
        mbarrier.expect(q_bar.index(0), Q_BUFFERS * q_desc.block_type.nbytes)
        for c in gl.static_range(Q_BUFFERS):
            tma.async_copy_global_to_shared(q_desc, [r * H, c * _DC], q_bar.index(0), q_smem.index(c))

    # The row's window key count (the valid suffix of its window table), then the block's slots.
    wtab_row = wtab_ptr + r * stride_wt
    ctab_row = ctab_ptr + r * stride_ct
    rw = gl.arange(0, W_P2, layout=gl.SliceLayout(0, ld))
    nw = gl.reduce((gl.load(wtab_row + rw, mask=rw < W, other=-1) >= 0).to(gl.int32), 0, add_combine)
    ws, cs = _block_slots(wtab_row, ctab_row, b, nw, W, KC, gl.SliceLayout(1, ld))
    w_ok = ws >= 0
    c_ok = cs >= 0
    wbase = gl.where(w_ok, ws, 0).to(gl.int64) * _WREC
    cbase = gl.where(c_ok, cs, 0).to(gl.int64) * _CREC
    _stamp(log_row, 1, PHASES)

    # q [64, 512] of the row (heads past H: zeros), chunk by chunk: all four into shared memory, or
    # (Q_BUFFERS == 2) the first two, the last two loaded now into registers and stored into the
    # same buffers once the first two's score MMAs have read them. (ptxas issues the first two
    # chunks' loads before the slots' on its own: in flight while the tables are read.)
    rh = gl.arange(0, _M, layout=gl.SliceLayout(1, ld))
    rd = gl.arange(0, _DC, layout=gl.SliceLayout(0, ld))
    q_rows = q_ptr + r * stride_qn + rh[:, None] * stride_qh + rd[None, :]
    h_in = (rh < H)[:, None]
    if not Q_TMA:
        for c in gl.static_range(Q_BUFFERS):
            q_smem.index(c).store(gl.load(q_rows + c * _DC, mask=h_in, other=0.0))
    if Q_BUFFERS < NC and K_BUFFERS == NC:    # in flight during the decode, stored after the first MMAs
        q2 = gl.load(q_rows + 2 * _DC, mask=h_in, other=0.0)
        q3 = gl.load(q_rows + 3 * _DC, mask=h_in, other=0.0)
    _stamp(log_row, 2, PHASES)

    # The block's records, decoded into shared memory.
    start = b * _KEYS
    s = gl.zeros([_M, _KEYS], gl.float32, s_l)
    if K_BUFFERS == 2:
        # (P_OUT) a chunk at a time into two buffers, each chunk's score MMA after its decode: S
        # in the same chunk order and MMAs as below; q's last two chunks loaded into q's buffers
        # once both warpgroups' MMAs of the first two are done
        gl.static_assert(P_OUT and Q_BUFFERS == 2)
        for c in gl.static_range(NC):
            if c >= 2:
                gl.thread_barrier()   # both warpgroups' MMAs of chunk c - 2 have read its buffers
                if c == 2:            # (loaded here: no registers held through the decodes)
                    if Q_TMA:         # in flight during chunk 2's decode
                        mbarrier.expect(q_bar.index(1), 2 * q_desc.block_type.nbytes)
                        tma.async_copy_global_to_shared(q_desc, [r * H, 2 * _DC], q_bar.index(1), q_smem.index(0))
                        tma.async_copy_global_to_shared(q_desc, [r * H, 3 * _DC], q_bar.index(1), q_smem.index(1))
                    else:
                        q_smem.index(0).store(gl.load(q_rows + 2 * _DC, mask=h_in, other=0.0))
                        q_smem.index(1).store(gl.load(q_rows + 3 * _DC, mask=h_in, other=0.0))
            kb = k_smem.index(c % 2)
            if start + _KEYS <= nw:
                kb.store(_decode_chunk(wpool_ptr, wbase, w_ok, c, True, FP4_PACKED, ld).to(gl.bfloat16))
            elif start >= nw:
                kb.store(_decode_chunk(cpool_ptr, cbase, c_ok, c, False, FP4_PACKED, ld, 128, FP4_LUT).to(gl.bfloat16))
            else:
                kb.store(_decode_mixed_chunk(wpool_ptr, wbase, w_ok, cpool_ptr, cbase, c_ok, c, FP4_PACKED, ld,
                                             FP4_LUT))
            fence_async_shared()
            gl.thread_barrier()
            if Q_TMA and c % 2 == 0:
                mbarrier.wait(q_bar.index(c // 2), 0)
            s = warpgroup_mma(q_smem.index(c % 2), k_smem.index(c % 2).permute((1, 0)), s)
        _stamp(log_row, 4, PHASES)
        if SIGNAL == 1:
            gluon_gate_signal(signal_ptr)
    elif start + _KEYS <= nw:         # window keys only
        _decode_block(k_smem, wpool_ptr, wbase, w_ok, True, FP4_PACKED, PREFETCH, ld, log_row, PHASES)
    elif start >= nw:                 # compressed entries only
        _decode_block(k_smem, cpool_ptr, cbase, c_ok, False, FP4_PACKED, PREFETCH, ld, log_row, PHASES, FP4_LUT)
    else:                             # the block where the window ends
        for c in gl.static_range(NC):
            k_smem.index(c).store(_decode_mixed_chunk(wpool_ptr, wbase, w_ok, cpool_ptr, cbase, c_ok, c, FP4_PACKED,
                                                      ld, FP4_LUT))
            if c == 0:
                _stamp(log_row, 3, PHASES)
    if K_BUFFERS == NC:
        fence_async_shared()
        gl.thread_barrier()
        _stamp(log_row, 4, PHASES)
        if SIGNAL == 1:
            gluon_gate_signal(signal_ptr)
        if Q_TMA:
            mbarrier.wait(q_bar.index(0), 0)

    # S = sum over the chunks in order of q_c k_c^T (with two key buffers, summed above), then
    # scaled; -inf where a key is invalid.
    if K_BUFFERS == 2:
        pass
    elif Q_BUFFERS == NC:
        for c in gl.static_range(NC):
            s = warpgroup_mma(q_smem.index(c), k_smem.index(c).permute((1, 0)), s)
    else:
        acc = warpgroup_mma(q_smem.index(0), k_smem.index(0).permute((1, 0)), s, is_async=True)
        acc = warpgroup_mma(q_smem.index(1), k_smem.index(1).permute((1, 0)), acc, is_async=True)
        s = warpgroup_mma_wait(0, deps=[acc])
        gl.thread_barrier()           # both warpgroups' MMAs have read the buffers
        q_smem.index(0).store(q2)
        q_smem.index(1).store(q3)
        fence_async_shared()
        gl.thread_barrier()
        s = warpgroup_mma(q_smem.index(0), k_smem.index(2).permute((1, 0)), s)
        s = warpgroup_mma(q_smem.index(1), k_smem.index(3).permute((1, 0)), s)
    ws_s, cs_s = _block_slots(wtab_row, ctab_row, b, nw, W, KC, gl.SliceLayout(0, s_l))
    ok = (ws_s >= 0) | (cs_s >= 0)
    s = gl.where(ok[None, :], s * scale, float("-inf"))
    s_max = gl.reduce(s, 1, max_combine)
    _stamp(log_row, 5, PHASES)

    # Publish this block's max (bit b % 32 of the row's flag word b // 32, set with release once
    # every thread's store is done); the running max of the sequential loop before this block is the
    # max over the blocks before it, each published by its own program. Waiting on the row's words
    # (one for up to 32 blocks), then loading every earlier block's maxima at once, costs two
    # round trips to L2 whatever b is, where a flag per block waited and read in turn costs two per
    # earlier block; the max is exact, so the order in which the maxima are combined does not matter.
    # With DSPLIT > 1 each of the block's programs publishes the same max (the same bits: the same
    # scores) and sets the same bit; the first to do so releases the later blocks.
    hs = gl.arange(0, _M, layout=gl.SliceLayout(1, s_l))
    h_st = hs < PH
    tile = r.to(gl.int64) * NB
    flags = flag_ptr + tile
    mb = gl.arange(0, NB_P2, layout=gl.SliceLayout(1, ld))
    mh = gl.arange(0, _M, layout=gl.SliceLayout(0, ld))
    stuck = 0
    if VALUES:
        # The maxima are their own flags: the row's board (int32 [NB, PH], zero between launches)
        # takes ~bits(max) per head (never 0 but for the NaN 0xFFFFFFFF), and the earlier blocks'
        # entries are polled until none is 0: one round trip once they are there, where the bits
        # cost a fence, a poll and the maxima's load.
        board = board_ptr + tile * PH
        gl.store(board + b * PH + hs, ~s_max.to(gl.int32, bitcast=True), mask=h_st)
        need = (mb < b)[:, None] & (mh < PH)[None, :]
        got = gl.zeros([NB_P2, _M], gl.int32, ld)
        pending = 1
        polls = 0
        while (pending > 0) & (polls < _SPIN_LIMIT):
            got = gl.load(board + mb[:, None] * PH + mh[None, :], mask=need, other=-1, volatile=True)
            pending = gl.reduce(gl.reduce((got == 0).to(gl.int32), 1, add_combine), 0, add_combine)
            polls += 1
        stuck = (pending > 0).to(gl.int32)
        earlier = gl.where(need, (~got).to(gl.float32, bitcast=True), -1e30)
    else:
        gl.store(block_max_ptr + (tile + b) * PH + hs, s_max, mask=h_st)
        gl.thread_barrier()
        gl.atomic_or(flags + b // 32, 1 << (b % 32), sem="release", scope="gpu")
        for w in range(0, b // 32 + 1):
            need = -1                      # the words below b's: every bit
            if w == b // 32:
                need = (1 << (b % 32)) - 1  # b's word: the bits of the blocks below b
            polls = 0
            while ((gl.atomic_add(flags + w, 0, sem="acquire", scope="gpu") & need) != need) & (polls < _SPIN_LIMIT):
                polls += 1
            stuck += (polls >= _SPIN_LIMIT).to(gl.int32)
        earlier = gl.load(block_max_ptr + tile * PH + mb[:, None] * PH + mh[None, :],
                          mask=(mb < b)[:, None] & (mh < PH)[None, :], other=-1e30, cache_modifier=".cg")
    m_i = gl.convert_layout(gl.reduce(earlier, 0, max_combine), gl.SliceLayout(1, s_l))
    m_i = gl.where(stuck > 0, float("nan"), m_i)    # never by design: a bug shows as NaN, not a hang
    new_max = gl.maximum(m_i, s_max)
    _stamp(log_row, 6, PHASES)
    p = libdevice.exp(s - new_max[:, None])
    l_i = gl.reduce(p, 1, add_combine)
    nv = gl.reduce(ok.to(gl.int32), 0, add_combine)
    if P_OUT:
        # the block's P (rounded to nearest even: the contract's) for the second launch's P.V, 16
        # bytes a thread (`pst`; the accumulator's layout would store 4 at a time)
        pst: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [_WARPS, 1], [1, 0])
        hp = gl.arange(0, _M, layout=gl.SliceLayout(1, pst))
        kp = gl.arange(0, _KEYS, layout=gl.SliceLayout(0, pst))
        gl.store(part_acc_ptr + ((tile + b) * PH + hp[:, None]) * _KEYS + kp[None, :],
                 gl.convert_layout(p.to(gl.bfloat16), pst), mask=(hp < PH)[:, None])
    else:
        p_smem.store(p.to(gl.bfloat16))          # round to nearest even: the contract's P
        fence_async_shared()
        gl.thread_barrier()
        # acc = P V, chunk by chunk (this program's NCP chunks), each stored as summed: this block's
        # partial [PH, 512] (or its dim slice).
        ho = gl.arange(0, _M, layout=gl.SliceLayout(1, o_l))
        do = gl.arange(0, _DC, layout=gl.SliceLayout(0, o_l))
        acc_rows = part_acc_ptr + (tile + b) * (PH * D) + ho[:, None] * D + do[None, :]
        zero = gl.zeros([_M, _DC], gl.float32, o_l)
        if PV_PIPELINE and NCP > 1:
            # chunk c + 1's MMA in flight while chunk c is stored (two accumulators live)
            prev = warpgroup_mma(p_smem, k_smem.index(sl * NCP), zero, use_acc=False, is_async=True)
            for c in gl.static_range(1, NCP):
                nxt = warpgroup_mma(p_smem, k_smem.index(sl * NCP + c), zero, use_acc=False, is_async=True)
                prev = warpgroup_mma_wait(1, deps=[prev])
                gl.store(acc_rows + (sl * NCP + c - 1) * _DC, prev, mask=(ho < PH)[:, None])
                prev = nxt
            prev = warpgroup_mma_wait(0, deps=[prev])
            gl.store(acc_rows + (sl * NCP + NCP - 1) * _DC, prev, mask=(ho < PH)[:, None])
        else:
            for c in gl.static_range(NCP):
                if DSPLIT == 1:
                    a = warpgroup_mma(p_smem, k_smem.index(c), zero, use_acc=False)
                    gl.store(acc_rows + c * _DC, a, mask=(ho < PH)[:, None])
                else:
                    a = warpgroup_mma(p_smem, k_smem.index(sl * NCP + c), zero, use_acc=False)
                    gl.store(acc_rows + (sl * NCP + c) * _DC, a, mask=(ho < PH)[:, None])
    ml = part_ml_ptr + (tile + b) * (3 * PH) + hs
    gl.store(ml, new_max, mask=h_st)
    gl.store(ml + PH, l_i, mask=h_st)
    gl.store(ml + 2 * PH, gl.zeros([_M], gl.float32, gl.SliceLayout(1, s_l)) + nv.to(gl.float32), mask=h_st)
    _stamp(log_row, 7, PHASES)
    if SIGNAL == 2:
        gluon_gate_signal(signal_ptr)

    cnt = count_ptr + r
    if SPREAD:
        # Every program of the row waits until all NB x DSPLIT have arrived (the launcher runs this
        # only where the whole grid is resident at once, so the wait ends), then combines its share
        # of the [PH, 512] output: the combination's steps j, j + NB DSPLIT, ... for the row's j-th
        # program. The last to arrive (every program of the row is past its look-back) clears the
        # row's flag words (and board) and sets the counter back to 0 with release: the others
        # wait for 0 (or the full count, seen before the reset), so none has to count its leaving.
        P: gl.constexpr = NB * DSPLIT
        gl.thread_barrier()
        arrived = gl.atomic_add(cnt, 1, sem="acq_rel", scope="gpu")
        polls = 0
        if arrived == P - 1:
            _clear_row(flags, board_ptr + tile * PH, NB, NB_P2, PH, VALUES, ld)
            gl.atomic_xchg(cnt, 0, sem="release", scope="gpu")
            if PHASES:
                gl.store(log_row + _PH_COMBINER, 1)
        else:
            seen = gl.atomic_add(cnt, 0, sem="acquire", scope="gpu")
            while (seen != 0) & (seen < P) & (polls < _SPIN_LIMIT):
                seen = gl.atomic_add(cnt, 0, sem="acquire", scope="gpu")
                polls += 1
        _stamp(log_row, 8, PHASES)
        _combine_slice(part_acc_ptr, part_ml_ptr, sink, out_ptr, r, H, stride_on, stride_oh,
                       b * DSPLIT + sl, (polls >= _SPIN_LIMIT).to(gl.int32), NB, NB_P2, PH, P)
        _stamp(log_row, 9, PHASES)
    if PHASES:
        _stamp(log_row, _PH_CEND, PHASES)
        _stamp_global(log_row, _PH_GEND, "mov.u64 $0, %globaltimer;", PHASES)


def q_by_tma(config: GluonSparseMlaConfig, base, q: torch.Tensor) -> bool:
    """Whether a launch of `base` (the plan's `SparseMlaPlan`) on q copies q by TMA: with
    `config.q_tma`, where the heads are the program's (block_h: 16, 32 or 64), q is contiguous and
    has at least one [64, 512] tile of rows x heads. A row's q is then the first heads of the tile
    that starts at its first head; the tile's other rows (the next rows' heads, or the TMA's zeros
    past the tensor) fill the MMA rows of the padded heads, whose values no store writes."""
    return bool(config.q_tma and base.heads == base.block_h and q.is_contiguous()
                and q.shape[0] * base.heads >= _M.value)


def _q_desc(plan: GluonSparseMlaPlan, q: torch.Tensor) -> TensorDescriptor:
    """The TMA descriptor of q's [64, 128] chunks, q (contiguous [rows, heads, 512], rows x heads >=
    64) viewed [rows x heads, 512], made once per (address, rows) and kept in the plan
    (`GluonSparseMlaConfig.q_tma`)."""
    key = (q.data_ptr(), q.shape[0])
    desc = plan.q_descs.get(key)
    if desc is None:
        desc = plan.q_descs[key] = tma_desc(q.view(-1, q.shape[-1]), [64, 128], "q")
    return desc


def gluon_sparse_mla_(plan: GluonSparseMlaPlan, q: torch.Tensor, window_pool: torch.Tensor, comp_pool: torch.Tensor,
                      window_table: torch.Tensor, comp_table: torch.Tensor, sink: torch.Tensor, scale: float,
                      out: torch.Tensor, *, release: bool = False, signal: torch.Tensor | None = None,
                      signal_after: str = "decoded", pdl: bool = False) -> None:
    """`sparse_mla.sparse_mla_`'s contract and arguments (see its doc), with a `GluonSparseMlaPlan`:
    out[r, h] = sparse_attention(q[r, h], keys of row r, sink[h], scale). sm_90 only; every
    configuration gives the same bits.

    release: where the configuration's last launch writes o (the combination "spread" with every
    program resident, or "pv"'s second launch), its programs let the next kernel on the stream start
    at their own start (the spread launch with pdl: after its wait), if that kernel is launched by
    programmatic dependent launch
    (`gluon_wo_a_(pdl=True)`, which waits for this one before it reads o); a no-op otherwise. The
    same values.

    signal: an int32 tensor (a `GluonWoAPlan.gate`) whose first word every program of the scores'
    launch (`plan.programs(rows)` of them) increments once (`ops.pdl.gluon_gate_signal`), after its
    block's records are decoded into shared memory (signal_after "decoded") or after its partial (or,
    with the combination "pv", its P) is stored ("stored"): the gate a PDL successor waits at before
    it asks for more of its weight (`gluon_wo_a_(gate=)`); None: no signal. The same values.

    pdl: the scores' launch by programmatic dependent launch: its programs wait for the kernel
    before it on the stream (`griddepcontrol.wait`, before any access) at their start, so that they
    are resident when that kernel ends if it lets them launch early (`sparse_tables.topk_slots_(
    release=True)`); the same values. ValueError naming `pdl` where PDL is not available."""
    if not isinstance(plan, GluonSparseMlaPlan):
        raise TypeError(f"plan must be a GluonSparseMlaPlan, got {type(plan).__name__}")
    base, config = plan.base, plan.config
    n = check_sparse_mla_args(base, q, window_pool, comp_pool, window_table, comp_table, sink, scale, out)
    if signal_after not in SIGNAL_POINTS:
        raise ValueError(f"signal_after must be one of {SIGNAL_POINTS}, got {signal_after!r}")
    if not isinstance(pdl, bool):
        raise ValueError(f"pdl must be a bool, got {pdl!r}")
    if pdl:
        require_supported(base.device)
    if signal is not None:
        require_tensor(signal, "signal", torch.int32, (None,), base.device)
        if signal.numel() == 0:
            raise ValueError("signal must hold at least one int32 word (the gate's count), got none")
    if not is_sm90(base.device):
        raise ValueError(f"plan and operands must be on a CUDA device of compute capability 9.0 (the kernel is "
                         f"sm_90 code: wgmma), got {base.device}")
    if n == 0:
        return
    nb = base.n_blocks
    o16 = out.view(torch.int16)
    grid = n * nb * config.dim_split
    combine = config.combine
    log = plan.phase_log if plan.phase_log is not None else plan.counters
    # with the combination "pv" the blocks' P goes into the partials' workspace (BF16 [n, nb,
    # block_h, 64] fits in its FP32 [n, nb, block_h, 512])
    acc_ws = base.part_acc.view(torch.bfloat16) if combine == "pv" else base.part_acc
    q_tma = q_by_tma(config, base, q)
    q_desc = _q_desc(plan, q) if q_tma else None
    args = (q, window_pool, comp_pool, window_table, comp_table,
            acc_ws, base.part_ml, base.block_max, base.flags, base.ticket, sink, o16, plan.counters, log,
            plan.board, q_desc, plan.counters if signal is None else signal, n, base.heads, float(scale), q.stride(0),
            q.stride(1), window_table.stride(0), max(comp_table.stride(0), 1), o16.stride(0), o16.stride(1))
    consts = dict(W=base.window, W_P2=triton.next_power_of_2(base.window), KC=base.topk, NB=nb,
                  NB_P2=max(2, triton.next_power_of_2(nb)), PH=base.block_h, Q_BUFFERS=config.q_buffers,
                  FP4_PACKED=config.fp4_packed, PREFETCH=config.prefetch, DSPLIT=config.dim_split,
                  VALUES=config.lookback == "values",
                  PV_PIPELINE=config.pv_pipeline, FP4_LUT=config.fp4_lut, PHASES=config.phases,
                  K_BUFFERS=config.k_buffers, Q_TMA=q_tma,
                  SIGNAL=0 if signal is None else SIGNAL_POINTS.index(signal_after) + 1, WAIT=pdl,
                  num_warps=NUM_WARPS)
    if config.maxnreg is not None:
        consts["maxnreg"] = config.maxnreg
    resident = False
    if combine in ("spread", "pv"):
        # whether every program of the grid is resident at once: the registers and shared memory of
        # the kernel these arguments compile to decide (`specialization_key`: the one-row kernel's
        # registers differ from the others'); the programs then take their (row, block) from the
        # program id (TICKET off); the spread launch's kernel with its release, as launched below
        flags = dict(SPREAD=True, RELEASE=release) if combine == "spread" else dict(SPREAD=False, P_OUT=True)
        key = (combine, release and combine == "spread", consts["SIGNAL"], pdl, specialization_key(args))
        per_sm = plan.resident.get(key)
        if per_sm is None:
            kernel = _gluon_sparse_mla_kernel.warmup(*args, grid=(grid, ), TICKET=False, **flags, **consts)
            per_sm = plan.resident[key] = programs_per_sm(kernel)
        resident = grid <= num_sms(base.device) * per_sm
    if combine == "spread" and not resident:
        # not every program resident at once: the row's wait could hang; the separate launch
        # with the flag look-back (the board of maxima stays untouched, zero)
        combine = "separate"
        consts["VALUES"] = False
    if combine == "pv":
        # the blocks' scores and P (with the ticket where the grid is not resident at once: a
        # block's look-back then only waits on programs that have started), then P.V and the
        # combination
        _gluon_sparse_mla_kernel[(grid, )](*args, SPREAD=False, TICKET=not resident, P_OUT=True, **consts,
                                           **launch_options(pdl))
        mla_pv_(base, config, acc_ws, window_pool, comp_pool, window_table, comp_table, sink, o16, n, release=release)
        return
    spread = combine == "spread"
    _gluon_sparse_mla_kernel[(grid, )](*args, SPREAD=spread, TICKET=not spread, RELEASE=release and spread,
                                       **consts, **launch_options(pdl))
    if combine == "separate":
        combine_partials_(base.part_acc, base.part_ml, base.flags, sink, o16, base.heads, 1, n, nb, base.block_h)
