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
same order; the partials only never leave the SM. A slice's output leaves in 16-byte stores, staged
through the keys' shared-memory buffer (up to two slices a program). The program of a row's first
slice clears the row's flag words for the next launch, as the separate combination does.

How a block's bytes arrive (`GluonSparseMlaConfig.pv_stages`): loaded into registers at the block's
start, P a block ahead (`_direct_slice`), or copied asynchronously (cp.async, zero-filled where a
pool does not hold a key) into a ring of shared-memory slots, pv_stages - 2 blocks of work ahead, each
thread copying the code bytes it later decodes, the scales a block ahead in registers and P read
by the MMA from its slot (`_ring_slice`): the same values into the same MMA in the same order.
Nothing the first launch writes is read before the kernel's `griddepcontrol.wait`, so the launch may
be a programmatic dependent one (`GluonSparseMlaConfig.pv_pdl`): with the ring, the row's slots and
its first blocks' codes are on their way by then.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.extra import libdevice
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma

from .gluon_epilogues import add_combine
from .gluon_mla_records import (_CREC, _KEYS, _M, _WARPS, _WREC, NUM_WARPS, _bf16_rne_bits, _block_slots,
                                _decode_loaded, _fp4_lut, _load_chunk, _ue8m0_value)
from .pdl import gluon_launch_dependents, gluon_wait, launch_options, supported

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
    W: gl.constexpr, W_P2: gl.constexpr, KC: gl.constexpr, NB: gl.constexpr, NB_P2: gl.constexpr,
    PH: gl.constexpr, CPP: gl.constexpr, FP4_PACKED: gl.constexpr, FP4_LUT: gl.constexpr, DW: gl.constexpr = 128,
    RING: gl.constexpr = 0, RELEASE: gl.constexpr = False,
):
    # Grid: rows x (512 / (DW CPP)) programs, the slice the fastest; a program the CPP DW-wide dim
    # slices (DW: 128 or 64) sl CPP, ..., sl CPP + CPP - 1 of its row. p_ptr: BF16 [N, NB, PH, 64],
    # the blocks' P; part_ml_ptr: FP32 [N, NB, 3, PH] (max, sum, valid-key count); flag_ptr: int32
    # [N, NB], the first launch's look-back words (zeroed here).
    SL: gl.constexpr = 512 // (DW * CPP)
    if RELEASE:
        # the kernel after this one, where launched with PDL (`gluon_wo_a_(pdl=True)`, which waits for
        # this one before it reads o), may start once every program of this one has started
        gluon_launch_dependents()
    pid = gl.program_id(0)
    r = pid // SL
    sl = pid % SL
    # the loads and decode of a [64, DW] slice of the keys (DW / 8 consecutive dims a thread); P.V's
    # accumulator (the two warpgroups DW / 2 dims each)
    ld: gl.constexpr = gl.BlockedLayout([1, DW // 8], [4, 8], [_WARPS, 1], [1, 0])
    o_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, DW // 2, 16])
    v_smem = gl.allocate_shared_memory(gl.bfloat16, [_KEYS, DW], gl.NVMMASharedLayout.get_default_for(
        [_KEYS, DW], gl.bfloat16))
    tile = r.to(gl.int64) * NB

    # (RING) the row's slots, the ring's slots, and (one slice a program, the step's form; with more
    # `_ring_slice` copies them after the wait) the codes of the ring's first RING - 1 blocks copied
    # now: the tables and pools are this step's inputs, written before the first launch started
    T: gl.constexpr = DW // 8
    TC: gl.constexpr = DW // 16
    l3w: gl.constexpr = gl.BlockedLayout([1, 1, T], [4, T // 4, 32 // T], [_WARPS, 1, 1], [2, 1, 0])
    l3c: gl.constexpr = gl.BlockedLayout([1, 1, TC], [4, TC, 8 // TC], [_WARPS, 1, 1], [2, 1, 0])
    plain: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[2, 1, 0])
    if RING > 0:
        nw, w_slots, c_slots = _row_slots(wtab_ptr + r * stride_wt, ctab_ptr + r * stride_ct, W, W_P2, KC, NB, NB_P2,
                                          True, ld)
        wcode_r = gl.allocate_shared_memory(gl.uint8, [RING, _KEYS, DW // 32, 32], plain)
        ccode_r = gl.allocate_shared_memory(gl.uint8, [RING, _KEYS, DW // 16, 8], plain)
        p_r = gl.allocate_shared_memory(gl.bfloat16, [RING, _M, _KEYS], gl.NVMMASharedLayout.get_default_for(
            [_M, _KEYS], gl.bfloat16))
        for i in gl.static_range(RING - 1):
            if (i < NB) and (CPP == 1):
                _ring_codes(wcode_r.index(i), ccode_r.index(i), i, sl * CPP, nw, w_slots, c_slots, wpool_ptr,
                            cpool_ptr, DW, l3w, l3c)

    # The first launch's P, statistics and look-back words from here on: with PDL
    # (`GluonSparseMlaConfig.pv_pdl`) this launch starts before the first has ended, and waits here
    # until it has (at once without PDL). Without the ring the row's slots after it (sm_90 spills
    # less in that order at the 64-dim slices' cap of 80).
    gluon_wait()
    # the sink (constant) asked for before the statistics' loads: read with them, not after them
    ho = gl.arange(0, _M, layout=gl.SliceLayout(1, o_l))
    sink = gl.load(sink_ptr + ho, mask=ho < H, other=0.0)
    if sl == 0:
        fw = gl.arange(0, 32, layout=gl.SliceLayout(1, ld))
        for w0 in range(0, NB, 32):
            gl.store(flag_ptr + tile + w0 + fw, gl.zeros([32], gl.int32, gl.SliceLayout(1, ld)), mask=w0 + fw < NB)

    # The row's statistics per head (the combination's): the max over the blocks and the valid-key
    # count (exact in any order), each block's factor exp(m_b - m_all), the sums rescaled and added
    # in block order, the denominator with the sink.
    h_st = ho < PH
    ml = part_ml_ptr + tile * (3 * PH) + ho
    m_all = gl.full([_M], -1e30, gl.float32, gl.SliceLayout(1, o_l))
    n_all = gl.zeros([_M], gl.float32, gl.SliceLayout(1, o_l))
    for b in range(NB):
        m_all = gl.maximum(m_all, gl.load(ml + b * (3 * PH), mask=h_st, other=-1e30))
        n_all += gl.load(ml + b * (3 * PH) + 2 * PH, mask=h_st, other=0.0)
    l_all = gl.zeros([_M], gl.float32, gl.SliceLayout(1, o_l))
    if RING > 0:
        # (RING) each block's factor kept in shared memory for the blocks' loop (read there after its
        # first barrier): no global load in the loop
        f_smem = gl.allocate_shared_memory(gl.float32, [NB, _M], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
    for b in range(NB):
        f = libdevice.exp(gl.load(ml + b * (3 * PH), mask=h_st, other=-1e30) - m_all)
        l_all += gl.load(ml + b * (3 * PH) + PH, mask=h_st, other=0.0) * f
        if RING > 0:
            f_smem.index(b).store(f)
    h_ok = ho < H
    den = gl.where(n_all > 0, l_all + libdevice.exp(sink - m_all), float("inf"))     # no valid key: o is 0
    if RING == 0:
        nw, w_slots, c_slots = _row_slots(wtab_ptr + r * stride_wt, ctab_ptr + r * stride_ct, W, W_P2, KC, NB, NB_P2,
                                          False, ld)

    # the output stored 16 bytes a thread (`st`: a row's DW dims over DW / 8 threads), each slice's
    # BF16 bits staged through v_smem, where the accumulator's layout would store 4 bytes at a time;
    # at four slices a program in that layout (staged, sm_90 spills 16 bytes at the cap of 128)
    st: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (DW // 8), DW // 8], [_WARPS, 1], [1, 0])
    for cc in gl.static_range(CPP):
        c = sl * CPP + cc
        if RING > 0:
            o = _ring_slice(p_ptr, tile, PH, w_slots, c_slots, c, nw, wpool_ptr, cpool_ptr, f_smem, v_smem,
                            wcode_r, ccode_r, p_r, (cc == 0) and (CPP == 1), NB, RING, DW, ld, l3w, l3c, o_l)
        else:
            o = _direct_slice(p_ptr, tile, PH, w_slots, c_slots, c, nw, wpool_ptr, cpool_ptr, ml, m_all, h_st, v_smem,
                              NB, FP4_PACKED, FP4_LUT, DW, ld, o_l)
        if CPP < 4:
            gl.thread_barrier()               # every warp's last MMA has read v_smem
            v_smem.store(_bf16_rne_bits(o / den[:, None]).to(gl.bfloat16, bitcast=True))
            gl.thread_barrier()
            hs = gl.arange(0, _M, layout=gl.SliceLayout(1, st))
            ds = gl.arange(0, DW, layout=gl.SliceLayout(0, st))
            gl.store(out_ptr + r * stride_on + hs[:, None] * stride_oh + (c * DW + ds)[None, :],
                     v_smem.load(st).to(gl.int16, bitcast=True), mask=(hs < H)[:, None])
        else:
            do = gl.arange(0, DW, layout=gl.SliceLayout(0, o_l))
            gl.store(out_ptr + r * stride_on + ho[:, None] * stride_oh + (c * DW + do)[None, :],
                     _bf16_rne_bits(o / den[:, None]), mask=h_ok[:, None])


@gluon.jit
def _row_slots(wtab_row, ctab_row, W: gl.constexpr, W_P2: gl.constexpr, KC: gl.constexpr, NB: gl.constexpr,
               NB_P2: gl.constexpr, ONE_LOAD: gl.constexpr, ld: gl.constexpr):
    """The row's window key count nw (the valid suffix of its window table), as the first launch, and
    every block's window and compressed slots (`_block_slots`' values) in shared memory (int32 [NB,
    64] each, or [NB_P2, 64] with ONE_LOAD; -1 where none; after a barrier). ONE_LOAD: every block's
    slots of a table in one [NB_P2, 64] load (a few values a thread), else one [64] load a block and
    table (sm_90 spills less in the direct form's loop that way at the 64-dim slices' cap of 80)."""
    rw = gl.arange(0, W_P2, layout=gl.SliceLayout(0, ld))
    nw = gl.reduce((gl.load(wtab_row + rw, mask=rw < W, other=-1) >= 0).to(gl.int32), 0, add_combine)
    if ONE_LOAD:
        sl: gl.constexpr = gl.BlockedLayout([1, 4], [2, 16], [_WARPS, 1], [1, 0])
        plain2: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0])
        w2 = gl.allocate_shared_memory(gl.int32, [NB_P2, _KEYS], plain2)
        c2 = gl.allocate_shared_memory(gl.int32, [NB_P2, _KEYS], plain2)
        j = (gl.arange(0, NB_P2, layout=gl.SliceLayout(1, sl))[:, None] * _KEYS
             + gl.arange(0, _KEYS, layout=gl.SliceLayout(0, sl))[None, :])
        # `_block_slots`' loads over the row's NB_P2 x 64 keys at once (past the joined list: -1)
        w2.store(gl.load(wtab_row + (W - nw) + j, mask=j < nw, other=-1))
        jc = j - nw
        c2.store(gl.load(ctab_row + jc, mask=(jc >= 0) & (jc < KC), other=-1))
        # the same rows as the per-block form's buffers, whose .index(b) is a 1-D row
        plain1: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
        w_slots = w2._reinterpret(gl.int32, [NB_P2, _KEYS], plain1)
        c_slots = c2._reinterpret(gl.int32, [NB_P2, _KEYS], plain1)
    else:
        w_slots = gl.allocate_shared_memory(gl.int32, [NB, _KEYS], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
        c_slots = gl.allocate_shared_memory(gl.int32, [NB, _KEYS], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
        for b in gl.static_range(NB):
            ws, cs = _block_slots(wtab_row, ctab_row, b, nw, W, KC, gl.SliceLayout(1, ld))
            w_slots.index(b).store(ws)
            c_slots.index(b).store(cs)
    gl.thread_barrier()
    return nw, w_slots, c_slots


@gluon.jit
def _direct_slice(p_ptr, tile, PH: gl.constexpr, w_slots, c_slots, c, nw, wpool_ptr, cpool_ptr, ml, m_all, h_st,
                  v_smem, NB: gl.constexpr, FP4_PACKED: gl.constexpr, FP4_LUT: gl.constexpr, DW: gl.constexpr,
                  ld: gl.constexpr, o_l: gl.constexpr):
    """Slice c's FP32 sum over the row's blocks (the rescaled P.V of each, in block order), each
    block's P and bytes loaded into registers at its start (P one block ahead), decoded, stored
    into shared memory for the MMA."""
    pl: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [_WARPS, 1], [1, 0])
    p_smem = gl.allocate_shared_memory(gl.bfloat16, [_M, _KEYS], gl.NVMMASharedLayout.get_default_for(
        [_M, _KEYS], gl.bfloat16))
    rp = gl.arange(0, _M, layout=gl.SliceLayout(1, pl))
    kp = gl.arange(0, _KEYS, layout=gl.SliceLayout(0, pl))
    p_rows = p_ptr + (tile * PH + rp[:, None]) * _KEYS + kp[None, :]
    p_in = (rp < PH)[:, None]
    zero = gl.zeros([_M, DW], gl.float32, o_l)
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
    return o


@gluon.jit
def _ring_codes(wcode_s, ccode_s, b, c, nw, w_slots, c_slots, wpool_ptr, cpool_ptr, DW: gl.constexpr,
                l3w: gl.constexpr, l3c: gl.constexpr):
    """Block b's asynchronous copies of its codes into one ring slot (wcode_s [64, DW / 32, 32] and
    ccode_s [64, DW / 16, 8] u8): the codes of dims [DW c, DW c + DW) of its window records where the
    block holds window keys and of its compressed records where it holds compressed entries (keys a
    pool does not hold: zeros, as the masked-off copy writes), in `_ring_slice`'s layouts."""
    NG: gl.constexpr = DW // 32
    NS: gl.constexpr = DW // 16
    start = b * _KEYS
    if start < nw:
        ws = w_slots.index(b).load(gl.SliceLayout(1, gl.SliceLayout(2, l3w)))
        ok = ws >= 0
        base = gl.where(ok, ws, 0).to(gl.int64) * _WREC + c * DW
        g = gl.arange(0, NG, layout=gl.SliceLayout(0, gl.SliceLayout(2, l3w)))
        e = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(1, l3w)))
        off = (base[:, None] + g[None, :] * 32)[:, :, None] + e[None, None, :]
        async_copy.async_copy_global_to_shared(wcode_s, wpool_ptr + off, mask=ok[:, None, None])
    if start + _KEYS > nw:
        cs = c_slots.index(b).load(gl.SliceLayout(1, gl.SliceLayout(2, l3c)))
        ok = cs >= 0
        base = gl.where(ok, cs, 0).to(gl.int64) * _CREC + c * (DW // 2)
        g = gl.arange(0, NS, layout=gl.SliceLayout(0, gl.SliceLayout(2, l3c)))
        e = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, l3c)))
        off = (base[:, None] + g[None, :] * 8)[:, :, None] + e[None, None, :]
        async_copy.async_copy_global_to_shared(ccode_s, cpool_ptr + off, mask=ok[:, None, None])


@gluon.jit
def _ring_p(p_s, b, p_ptr, tile, PH: gl.constexpr, lp: gl.constexpr):
    """Block b's P (BF16 [64, 64], heads past PH zeros) copied asynchronously into a ring slot."""
    rp = gl.arange(0, _M, layout=gl.SliceLayout(1, lp))
    kp = gl.arange(0, _KEYS, layout=gl.SliceLayout(0, lp))
    async_copy.async_copy_global_to_shared(p_s, p_ptr + ((tile + b) * PH + rp[:, None]) * _KEYS + kp[None, :],
                                           mask=(rp < PH)[:, None])


@gluon.jit
def _ring_scales(b, c, w_slots, c_slots, wpool_ptr, cpool_ptr, DW: gl.constexpr, l3w: gl.constexpr,
                 l3c: gl.constexpr):
    """Block b's scale bytes of slice c into registers (one a thread and pool: issued a block
    ahead of their use): the window's UE8M0 per 32 dims [64, DW / 32] (127 = 2^0 where a key is
    not there) and the compressed records' E4M3 per 16 dims [64, DW / 16] (0 where not), in the
    slices of `_ring_slice`'s code layouts that hold each group's codes."""
    NG: gl.constexpr = DW // 32
    NS: gl.constexpr = DW // 16
    ws = w_slots.index(b).load(gl.SliceLayout(1, gl.SliceLayout(2, l3w)))
    w_ok = ws >= 0
    g = gl.arange(0, NG, layout=gl.SliceLayout(0, gl.SliceLayout(2, l3w)))
    wsc = gl.load(wpool_ptr + (gl.where(w_ok, ws, 0).to(gl.int64) * _WREC + 512 + c * NG)[:, None] + g[None, :],
                  mask=w_ok[:, None], other=127)
    cs = c_slots.index(b).load(gl.SliceLayout(1, gl.SliceLayout(2, l3c)))
    c_ok = cs >= 0
    s = gl.arange(0, NS, layout=gl.SliceLayout(0, gl.SliceLayout(2, l3c)))
    csc = gl.load(cpool_ptr + (gl.where(c_ok, cs, 0).to(gl.int64) * _CREC + 256 + c * NS)[:, None] + s[None, :],
                  mask=c_ok[:, None], other=0)
    return wsc, csc


@gluon.jit
def _ring_decode(wcode_s, ccode_s, wsc, csc, b, nw, DW: gl.constexpr, ld: gl.constexpr, l3w: gl.constexpr,
                 l3c: gl.constexpr):
    """Block b's keys of the slice from its ring slot and scales, decoded exactly as
    `gluon_mla_records._decode_loaded` does (window: E4M3 code * 2^(e - 127); compressed: the FP4
    LUT's BF16 pairs), both pools' values added where the window ends (each +0 off its own keys:
    code 0 times scale 2^0 or 0): BF16 [64, DW] in `ld`."""
    start = b * _KEYS
    if start + _KEYS <= nw:
        v = _ring_window(wcode_s, wsc, l3w, DW, ld).to(gl.bfloat16)
    elif start >= nw:
        v = _ring_compressed(ccode_s, csc, l3c, DW, ld)
    else:
        v = (_ring_window(wcode_s, wsc, l3w, DW, ld) + _ring_compressed(ccode_s, csc, l3c, DW, ld)).to(gl.bfloat16)
    return v


@gluon.jit
def _ring_window(wcode_s, wsc, l3w: gl.constexpr, DW: gl.constexpr, ld: gl.constexpr):
    """The window codes of a ring slot times their UE8M0 scales (255: NaN, as
    `rounding.ue8m0_to_fp32`): FP32 [64, DW] in `ld`."""
    sv = _ue8m0_value(wsc)
    k = wcode_s.load(l3w).to(gl.float8e4nv, bitcast=True).to(gl.float32) * sv[:, :, None]
    return gl.convert_layout(gl.reshape(k, [_KEYS, DW]), ld, assert_trivial=True)


@gluon.jit
def _ring_compressed(ccode_s, csc, l3c: gl.constexpr, DW: gl.constexpr, ld: gl.constexpr):
    """The compressed codes of a ring slot times their E4M3 scales, 8 values a PRMT table lookup
    (`gluon_mla_records._FP4_LUT_ASM`, low nibble first): BF16 [64, DW] in `ld`."""
    codes = ccode_s.load(l3c)
    codes, sc = gl.broadcast(codes, gl.expand_dims(csc, 2))
    lo, hi = _fp4_lut(codes, sc)
    return gl.convert_layout(gl.reshape(gl.join(lo, hi), [_KEYS, DW]), ld, assert_trivial=True)


@gluon.jit
def _ring_slice(p_ptr, tile, PH: gl.constexpr, w_slots, c_slots, c, nw, wpool_ptr, cpool_ptr, f_smem, v_smem,
                wcode_r, ccode_r, p_r, CODES_ISSUED: gl.constexpr, NB: gl.constexpr, RING: gl.constexpr,
                DW: gl.constexpr, ld: gl.constexpr, l3w: gl.constexpr, l3c: gl.constexpr, o_l: gl.constexpr):
    """`_direct_slice`'s sum with each block's codes and P copied asynchronously (cp.async) into the
    ring of RING slots wcode_r, ccode_r, p_r (block b + RING - 1's issued after block b's MMA: RING -
    2 blocks of work ahead of its use), its scales loaded into registers a block ahead (after the
    block before's fence, which waits for the thread's loads in flight), its factor exp(m_b - m_all)
    from f_smem (FP32 [NB, 64]): the same values into the same MMA in the same order, so the same
    bits. CODES_ISSUED: the codes of the ring's first RING - 1 blocks are already on their way (the
    kernel copies a one-slice program's before its PDL wait; their P here, each block's in its own
    group with them). The decoded keys go through v_smem as there; P is read by the MMA from its
    slot. Layouts: window codes [64, DW / 32, 32] (l3w: a thread DW / 8 consecutive bytes, within
    one 32-dim scale group), compressed codes [64, DW / 16, 8] (l3c: a thread DW / 16 consecutive
    bytes, within one 16-dim scale group), P [64, 64] BF16 (8 a thread, twice): each thread copies
    the code bytes it later decodes."""
    lp: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [_WARPS, 1], [1, 0])
    if not CODES_ISSUED:
        gl.thread_barrier()               # every warp is done with the ring's slots of the slice before
    for i in gl.static_range(RING - 1):
        if i < NB:
            if not CODES_ISSUED:
                _ring_codes(wcode_r.index(i), ccode_r.index(i), i, c, nw, w_slots, c_slots, wpool_ptr, cpool_ptr, DW,
                            l3w, l3c)
            _ring_p(p_r.index(i), i, p_ptr, tile, PH, lp)
        async_copy.commit_group()
    wsc_n, csc_n = _ring_scales(0, c, w_slots, c_slots, wpool_ptr, cpool_ptr, DW, l3w, l3c)
    zero = gl.zeros([_M, DW], gl.float32, o_l)
    o = gl.zeros([_M, DW], gl.float32, o_l)
    for b in range(NB):
        # block b's copies (this thread's) have landed; after the barrier every thread's have, and
        # every thread is done with block b - 1 (its MMA has returned: v_smem is free)
        async_copy.wait_group(RING - 2)
        gl.thread_barrier()
        cur = b % RING
        v = _ring_decode(wcode_r.index(cur), ccode_r.index(cur), wsc_n, csc_n, b, nw, DW, ld, l3w, l3c)
        v_smem.store(v)
        fence_async_shared()
        # block b + 1's scales loaded after the fence, which waits for this thread's loads in flight
        wsc_n, csc_n = _ring_scales(gl.minimum(b + 1, NB - 1), c, w_slots, c_slots, wpool_ptr, cpool_ptr, DW, l3w,
                                      l3c)
        f = f_smem.index(b).load(gl.SliceLayout(1, o_l))
        gl.thread_barrier()
        a = warpgroup_mma(p_r.index(cur), v_smem, zero, use_acc=False)
        # block b + RING - 1 into block b - 1's slot, which every warp was done with (its decode and
        # both warpgroups' MMA) at the barrier above; issued after this block's MMA, so that no
        # barrier is needed between a copy and the ring's reads in this block (none where the
        # prologue issued every block: NB <= RING - 1; sm_90's LLVM lowering fails on the dead
        # branch's slot-table read at NB = 1)
        nxt = b + RING - 1
        if (NB > RING - 1) and (nxt < NB):
            _ring_codes(wcode_r.index(nxt % RING), ccode_r.index(nxt % RING), nxt, c, nw, w_slots, c_slots,
                        wpool_ptr, cpool_ptr, DW, l3w, l3c)
            _ring_p(p_r.index(nxt % RING), nxt, p_ptr, tile, PH, lp)
        async_copy.commit_group()
        o += a * f[:, None]
    async_copy.wait_group(0)
    return o


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
    # the scales a load per code byte: held a block ahead, the broadcast form spills 16 bytes at
    # 128 registers at the compile tests' mixed shape (16 + 72 keys, 64 heads; sm_90)
    kc, ksc = _load_chunk(cpool_ptr, gl.where(c_ok, cs, 0).to(gl.int64) * _CREC, c_ok, c, False, FP4_PACKED, ld, DW,
                          False)
    return w_ok, c_ok, wc, wsc, kc, ksc


def mla_pv_(base, config, p: torch.Tensor, window_pool: torch.Tensor, comp_pool: torch.Tensor,
            window_table: torch.Tensor, comp_table: torch.Tensor, sink: torch.Tensor, o16: torch.Tensor,
            rows: int, release: bool = False) -> None:
    """`_gluon_mla_pv_kernel` over `rows` rows (arguments checked by the caller,
    `gluon_sparse_mla_`): base the plan's `SparseMlaPlan` (its shape, statistics and look-back
    words), config its `GluonSparseMlaConfig` (pv_chunks slices of pv_dims dims a program, the
    record decode's options), p the first launch's P (BF16 [rows, blocks, block_h, 64]), o16 the
    output's int16 view; release: its programs let a next kernel launched by PDL start at their
    start (`gluon_sparse_mla_(release=)`)."""
    nb = base.n_blocks
    opts = launch_options(config.pv_pdl and supported(p.device))
    _gluon_mla_pv_kernel[(rows * (512 // (config.pv_dims * config.pv_chunks)), )](
        p, base.part_ml, base.flags, window_pool, comp_pool, window_table, comp_table, sink, o16,
        base.heads, window_table.stride(0), max(comp_table.stride(0), 1), o16.stride(0), o16.stride(1),
        W=base.window, W_P2=triton.next_power_of_2(base.window), KC=base.topk, NB=nb,
        NB_P2=max(2, triton.next_power_of_2(nb)), PH=base.block_h,
        CPP=config.pv_chunks,
        FP4_PACKED=config.fp4_packed, FP4_LUT=config.fp4_lut, DW=config.pv_dims, RING=config.pv_stages,
        RELEASE=release, num_warps=NUM_WARPS, maxnreg=config.pv_maxnreg, **opts)
