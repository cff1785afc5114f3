"""The second launch of the sparse MLA's combination "pv" (`GluonSparseMlaConfig(combine="pv")`), in
Gluon for Hopper (sm_90): P.V and the blocks' combination per (row, dim slice), from the blocks' P
that the first launch (`ops.gluon_sparse_mla`'s kernel with P_OUT) stored instead of their FP32
partials.

The first launch is the block programs' scores, look-back and P, as in every configuration; each
block stores its P (BF16 [heads, 64], 8 KB at 64 heads) and its (max, sum, valid-key count), not
its [heads, 512] FP32 partial (128 KB at 64 heads: 84 MB each way at 64 rows). A program here
takes one row and `pv_chunks` slices of `pv_dims` (128 or 64) of its output's 512 dims and, block
by block in order, loads the block's P into shared memory, gathers and decodes the slice's dims of
the block's 64 records (`gluon_mla_records`, the bytes and decode of the first launch), runs the
block's P.V on `warpgroup_mma` from a zero accumulator (the first launch's MMA at 128 dims: m64 n64
k16 per warpgroup, the two warpgroups 64 dims each; at 64 dims m64 n32) and adds it, rescaled by
exp(m_b - m_all), to the slice's FP32 sum:
`sparse_mla._sparse_mla_combine_kernel`'s arithmetic element for element (the maxima and the
counts, the sums rescaled and added in block order, o = acc / (sum + exp(sink - m_all)) rounded to
nearest even, zeros where the row has no valid key). So every value is the one the other
configurations compute: the same P, the same MMA on the same operands, the same combination in the
same order; the partials only never leave the SM. The program of a row's first slice clears the
row's flag words for the next launch, as the separate combination does.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.extra import libdevice
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma

from .gluon_mla_records import (_CREC, _KEYS, _M, _WARPS, _WREC, NUM_WARPS, _add, _bf16_rne_bits, _block_slots,
                                _decode_loaded, _load_chunk)

PV_CHUNKS = (1, 2, 4)                        # GluonSparseMlaConfig.pv_chunks: dim slices a program
PV_DIMS = (128, 64)                          # GluonSparseMlaConfig.pv_dims: the dims of a slice
# The register cap's default (`GluonSparseMlaConfig.pv_maxnreg`): two programs an SM (8 warps x 128
# registers); sm_90 compiles without spills at 1-4 chunks a program (Triton's own choice is 136-140
# registers: one program an SM).
_MAXNREG = 128


@gluon.jit
def _gluon_mla_pv_kernel(
    p_ptr, part_ml_ptr, flag_ptr, wpool_ptr, cpool_ptr, wtab_ptr, ctab_ptr, sink_ptr, out_ptr,
    H, stride_wt, stride_ct, stride_on, stride_oh,
    W: gl.constexpr, W_P2: gl.constexpr, KC: gl.constexpr, NB: gl.constexpr,
    PH: gl.constexpr, CPP: gl.constexpr, FP4_PACKED: gl.constexpr, FP4_LUT: gl.constexpr, DW: gl.constexpr = 128,
):
    # Grid: rows x (512 / (DW CPP)) programs, the slice the fastest; a program the CPP DW-wide dim
    # slices (DW: 128 or 64) sl CPP, ..., sl CPP + CPP - 1 of its row. p_ptr: BF16 [N, NB, PH, 64],
    # the blocks' P; part_ml_ptr: FP32 [N, NB, 3, PH] (max, sum, valid-key count); flag_ptr: int32
    # [N, NB], the first launch's look-back words (zeroed here).
    SL: gl.constexpr = 512 // (DW * CPP)
    pid = gl.program_id(0)
    r = pid // SL
    sl = pid % SL
    # the loads and decode of a [64, DW] slice of the keys (DW / 8 consecutive dims a thread); P;
    # P.V's accumulator (the two warpgroups DW / 2 dims each)
    ld: gl.constexpr = gl.BlockedLayout([1, DW // 8], [4, 8], [_WARPS, 1], [1, 0])
    pl: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [_WARPS, 1], [1, 0])
    o_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, DW // 2, 16])
    p_smem = gl.allocate_shared_memory(gl.bfloat16, [_M, _KEYS], gl.NVMMASharedLayout.get_default_for(
        [_M, _KEYS], gl.bfloat16))
    v_smem = gl.allocate_shared_memory(gl.bfloat16, [_KEYS, DW], gl.NVMMASharedLayout.get_default_for(
        [_KEYS, DW], gl.bfloat16))
    tile = r.to(gl.int64) * NB
    if sl == 0:
        fw = gl.arange(0, 32, layout=gl.SliceLayout(1, ld))
        for w0 in range(0, NB, 32):
            gl.store(flag_ptr + tile + w0 + fw, gl.zeros([32], gl.int32, gl.SliceLayout(1, ld)), mask=w0 + fw < NB)

    # The row's statistics per head (the combination's): the max over the blocks and the valid-key
    # count (exact in any order), each block's factor exp(m_b - m_all), the sums rescaled and added
    # in block order, the denominator with the sink.
    ho = gl.arange(0, _M, layout=gl.SliceLayout(1, o_l))
    h_st = ho < PH
    ml = part_ml_ptr + tile * (3 * PH) + ho
    m_all = gl.full([_M], -1e30, gl.float32, gl.SliceLayout(1, o_l))
    n_all = gl.zeros([_M], gl.float32, gl.SliceLayout(1, o_l))
    for b in range(NB):
        m_all = gl.maximum(m_all, gl.load(ml + b * (3 * PH), mask=h_st, other=-1e30))
        n_all += gl.load(ml + b * (3 * PH) + 2 * PH, mask=h_st, other=0.0)
    l_all = gl.zeros([_M], gl.float32, gl.SliceLayout(1, o_l))
    for b in range(NB):
        f = libdevice.exp(gl.load(ml + b * (3 * PH), mask=h_st, other=-1e30) - m_all)
        l_all += gl.load(ml + b * (3 * PH) + PH, mask=h_st, other=0.0) * f
    h_ok = ho < H
    sink = gl.load(sink_ptr + ho, mask=h_ok, other=0.0)
    den = gl.where(n_all > 0, l_all + libdevice.exp(sink - m_all), float("inf"))     # no valid key: o is 0

    # The row's window key count (the valid suffix of its window table), as the first launch, and
    # every block's window and compressed slots (`_block_slots`' values) into shared memory.
    wtab_row = wtab_ptr + r * stride_wt
    ctab_row = ctab_ptr + r * stride_ct
    rw = gl.arange(0, W_P2, layout=gl.SliceLayout(0, ld))
    nw = gl.reduce((gl.load(wtab_row + rw, mask=rw < W, other=-1) >= 0).to(gl.int32), 0, _add)
    w_slots = gl.allocate_shared_memory(gl.int32, [NB, _KEYS], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
    c_slots = gl.allocate_shared_memory(gl.int32, [NB, _KEYS], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
    for b in gl.static_range(NB):
        ws, cs = _block_slots(wtab_row, ctab_row, b, nw, W, KC, gl.SliceLayout(1, ld))
        w_slots.index(b).store(ws)
        c_slots.index(b).store(cs)
    gl.thread_barrier()

    rp = gl.arange(0, _M, layout=gl.SliceLayout(1, pl))
    kp = gl.arange(0, _KEYS, layout=gl.SliceLayout(0, pl))
    p_rows = p_ptr + (tile * PH + rp[:, None]) * _KEYS + kp[None, :]
    p_in = (rp < PH)[:, None]
    do = gl.arange(0, DW, layout=gl.SliceLayout(0, o_l))
    out_rows = out_ptr + r * stride_on + ho[:, None] * stride_oh + do[None, :]
    zero = gl.zeros([_M, DW], gl.float32, o_l)
    for cc in gl.static_range(CPP):
        c = sl * CPP + cc
        o = gl.zeros([_M, DW], gl.float32, o_l)
        # block b's P is loaded during block b - 1; its keys' bytes (both pools' codes of the chunk:
        # the loads of keys a pool does not hold are masked off) at its start
        p = gl.load(p_rows, mask=p_in, other=0.0)
        for b in range(NB):
            p1 = gl.load(p_rows + gl.minimum(b + 1, NB - 1) * (PH * _KEYS), mask=p_in, other=0.0)
            w_ok, c_ok, wc, wsc, kc, ksc = _block_bytes(w_slots, c_slots, b, c, wpool_ptr, cpool_ptr, FP4_PACKED, ld,
                                                        DW)
            start = b * _KEYS
            if start + _KEYS <= nw:           # window keys only
                v = _decode_loaded(wc, wsc, w_ok, c, True, FP4_PACKED, ld, DW).to(gl.bfloat16)
            elif start >= nw:                 # compressed entries only
                v = _decode_loaded(kc, ksc, c_ok, c, False, FP4_PACKED, ld, DW, FP4_LUT).to(gl.bfloat16)
            else:                             # where the window ends: each decode is 0 off its keys
                v = (_decode_loaded(wc, wsc, w_ok, c, True, FP4_PACKED, ld, DW)
                     + _decode_loaded(kc, ksc, c_ok, c, False, FP4_PACKED, ld, DW, FP4_LUT)).to(gl.bfloat16)
            f = libdevice.exp(gl.load(ml + b * (3 * PH), mask=h_st, other=-1e30) - m_all)
            gl.thread_barrier()               # every warp's MMA of the block before has read the buffers
            p_smem.store(p)
            v_smem.store(v)
            fence_async_shared()
            gl.thread_barrier()
            a = warpgroup_mma(p_smem, v_smem, zero, use_acc=False)
            o += a * f[:, None]
            p = p1
        gl.store(out_rows + c * DW, _bf16_rne_bits(o / den[:, None]), mask=h_ok[:, None])


@gluon.jit
def _block_bytes(w_slots, c_slots, b, c, wpool_ptr, cpool_ptr, FP4_PACKED: gl.constexpr, ld: gl.constexpr,
                 DW: gl.constexpr):
    """Block b's keys: their validity per pool and the bytes of dims [DW c, DW c + DW) of their
    window and compressed records (`_load_chunk`; nothing loaded for keys a pool does not hold), the
    slots from shared memory (w_slots / c_slots: [NB, 64] int32, -1 where none)."""
    ws = w_slots.index(b).load(gl.SliceLayout(1, ld))
    cs = c_slots.index(b).load(gl.SliceLayout(1, ld))
    w_ok = ws >= 0
    c_ok = cs >= 0
    wc, wsc = _load_chunk(wpool_ptr, gl.where(w_ok, ws, 0).to(gl.int64) * _WREC, w_ok, c, True, FP4_PACKED, ld, DW)
    kc, ksc = _load_chunk(cpool_ptr, gl.where(c_ok, cs, 0).to(gl.int64) * _CREC, c_ok, c, False, FP4_PACKED, ld, DW)
    return w_ok, c_ok, wc, wsc, kc, ksc


def mla_pv_(base, config, p: torch.Tensor, window_pool: torch.Tensor, comp_pool: torch.Tensor,
            window_table: torch.Tensor, comp_table: torch.Tensor, sink: torch.Tensor, o16: torch.Tensor,
            rows: int) -> None:
    """`_gluon_mla_pv_kernel` over `rows` rows (arguments checked by the caller,
    `gluon_sparse_mla_`): base the plan's `SparseMlaPlan` (its shape, statistics and look-back
    words), config its `GluonSparseMlaConfig` (pv_chunks slices of pv_dims dims a program, the
    record decode's options), p the first launch's P (BF16 [rows, blocks, block_h, 64]), o16 the
    output's int16 view."""
    nb = base.n_blocks
    _gluon_mla_pv_kernel[(rows * (512 // (config.pv_dims * config.pv_chunks)), )](
        p, base.part_ml, base.flags, window_pool, comp_pool, window_table, comp_table, sink, o16,
        base.heads, window_table.stride(0), max(comp_table.stride(0), 1), o16.stride(0), o16.stride(1),
        W=base.window, W_P2=triton.next_power_of_2(base.window), KC=base.topk, NB=nb, PH=base.block_h,
        CPP=config.pv_chunks,
        FP4_PACKED=config.fp4_packed, FP4_LUT=config.fp4_lut, DW=config.pv_dims, num_warps=NUM_WARPS,
        maxnreg=config.pv_maxnreg)
