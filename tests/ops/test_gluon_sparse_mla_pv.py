"""ops.gluon_sparse_mla_pv, the sparse MLA's P.V and combination in a second launch (the combination
"pv" of `GluonSparseMlaConfig`; sm_90 only).

On the CPU: both launches compile for sm_90 (Triton's own ptxas) at the plans' shapes without
spills at the register cap that puts two programs on an SM; the first launch holds the scores'
wgmmas and none of P.V's, the second P.V's (one m64 n64 per warpgroup and 16 keys, four per block
and chunk) and none of the scores'; the configuration's errors name the option. On the GPU the
combination is one of `tests/ops/test_gluon_sparse_mla.py`'s configurations (PV, PV2): the same
bits as every other configuration on every row, against the reference, run to run, a row alone
among others, the workspace clear after each launch (PV64: 64-dim slices, whose m64 n32 wgmma must
sum each output as the first launch's m64 n64 does; PV64R80: the same at a register cap of 80).
"""

from collections import Counter

import pytest
from triton.experimental.gluon import language as gl

from dsv41_decode.ops import gluon_sparse_mla as G
from dsv41_decode.ops import gluon_sparse_mla_pv as PV
from dsv41_decode.testing import sm90
from test_gluon_sparse_mla import _TYPES as FIRST_TYPES

# the first launch's, with P (BF16) where the other configurations' partials (FP32) go
# (q's TMA descriptor as the launcher makes it with q_tma; without Q_TMA the kernel ignores it)
_Q_LAYOUT = gl.NVMMASharedLayout.get_default_for([64, 128], gl.bfloat16)
_FIRST_TYPES = dict(FIRST_TYPES, part_acc_ptr="*bf16", q_desc=f"tensordesc<bf16[64, 128],{_Q_LAYOUT!r}>")
# 228 KB of shared memory and 64K registers an SM, 1 KB reserved per program
SM_SHARED, SM_REGS = 228 * 1024, 65536


def _shape(heads, w, k):
    base = G.GluonSparseMlaPlan.build(1, heads, w, k, "cpu").base
    return base.n_blocks, base.block_h


def _compile_first(heads, w, k, maxnreg, **extra):
    """The first launch of "pv" (P_OUT: the blocks' P, no P.V) compiled for sm_90 as the launcher
    runs it with fp4_lut and two q buffers, at the register cap `maxnreg`; extra: more constexprs."""
    nb, ph = _shape(heads, w, k)
    consts = dict(W=w, W_P2=1 << (w - 1).bit_length(), KC=k, NB=nb, NB_P2=max(2, 1 << (nb - 1).bit_length()), PH=ph,
                  Q_BUFFERS=2, FP4_PACKED=True, PREFETCH=True, DSPLIT=1, SPREAD=False, VALUES=False, TICKET=True,
                  FP4_LUT=True, P_OUT=True)
    consts.update(extra)
    return sm90.compile_sm90(G._gluon_sparse_mla_kernel, _FIRST_TYPES, consts, num_warps=G.NUM_WARPS, maxnreg=maxnreg)


def _block_loops(kernel):
    """The SASS of the kernel's loops over the blocks (those holding the P.V wgmma)."""
    return [loop for loop in sm90.loops(kernel) if any("HGMMA" in t for t in loop)]


# V4.1-Flash (128 window + 512 top-k keys) at every TP shard's head count, one, two and four slices a
# program of 128 dims at 64 heads, of 64 dims at 64 and 8, and a window ending inside a block with a
# top-k not a multiple of 64 at 64 heads (at 16 and 32 heads that small shape spills one register
# inside the loop of 128-dim slices: not a step shape)
@pytest.mark.parametrize("heads,w,k,chunks,dims", [
    (64, 128, 512, 1, 128), (64, 128, 512, 2, 128), (64, 128, 512, 4, 128), (32, 128, 512, 1, 128),
    (16, 128, 512, 1, 128), (8, 128, 512, 1, 128), (64, 16, 72, 1, 128),
    (64, 128, 512, 1, 64), (64, 128, 512, 2, 64), (8, 128, 512, 1, 64), (64, 16, 72, 1, 64)],
    ids=["64h-1", "64h-2", "64h-4", "32h-1", "16h-1", "8h-1", "64h-mix-1", "64h-1x64", "64h-2x64", "8h-1x64",
         "64h-mix-1x64"])
def test_second_launch_compiles_for_sm90_two_programs_an_sm(heads, w, k, chunks, dims):
    kernel = sm90.compile_mla_pv(heads, w, k, dims=dims, chunks=chunks)
    res = sm90.resources(kernel)
    assert res["LOCAL"] == 0 and res["STACK"] == 0, res
    assert len(_block_loops(kernel)) == chunks          # one loop over the blocks per slice of the program
    assert 2 * (kernel.metadata.shared + 1024) <= SM_SHARED, kernel.metadata.shared
    assert 2 * res["REG"] * 32 * PV.NUM_WARPS <= SM_REGS, res
    ins = [t for _, t in sm90.sass(kernel)]
    gmma = [t.split()[0] for t in ins if "GMMA" in t]
    # P.V only: per slice the block's four k16 steps of m64 n(dims / 2) (the loop over the blocks
    # is not unrolled)
    assert gmma == [f"HGMMA.64x{dims // 2}x16.F32.BF16"] * (4 * chunks), sorted(set(gmma))


# 64-dim slices at a cap of 80 registers (`pv_maxnreg=80`) at 64 heads and V4.1-Flash's keys (the
# TP1 step's shape; at 8-32 heads and at the small shape sm_90 spills inside the blocks' loop): three
# programs an SM by registers and shared memory, one register spilled outside the loop over the
# blocks (its store before the loop, its load after), none in it
def test_second_launch_at_80_registers_three_programs_an_sm():
    kernel = sm90.compile_mla_pv(64, 128, 512, dims=64, maxnreg=80)
    res = sm90.resources(kernel)
    assert res["REG"] <= 80 and 3 * res["REG"] * 32 * PV.NUM_WARPS <= SM_REGS, res
    assert 3 * (kernel.metadata.shared + 1024) <= SM_SHARED, kernel.metadata.shared
    (block_loop, ) = _block_loops(kernel)
    assert not [t for t in block_loop if "STL" in t or "LDL" in t], res
    assert res["STACK"] <= 16, res


# the ring (`pv_stages`): at every TP shard's head count, both slice widths, two slices a program,
# the small shape and a single block (every block in the ring's first fill), at the default cap:
# no spills, two programs an SM by registers and shared memory (the ring's slots: 21 KB a stage at
# 128 dims), the block's codes and P copied by cp.async (LDGSTS; in the blocks' loop where the row
# has more blocks than the ring's first fill), P.V's wgmma as without it; at 64-dim slices, three
# stages and a cap of 80 three programs an SM, no spill in the loop
@pytest.mark.parametrize("heads,w,k,chunks,dims,stages", [
    (64, 128, 512, 1, 128, 3), (64, 128, 512, 1, 128, 4), (32, 128, 512, 1, 128, 3),
    (16, 128, 512, 1, 128, 3), (8, 128, 512, 1, 128, 3), (64, 16, 72, 1, 128, 3), (64, 128, 512, 2, 128, 3),
    (64, 128, 512, 1, 64, 3), (8, 128, 512, 1, 64, 3), (64, 16, 72, 1, 64, 3), (16, 16, 8, 1, 128, 3)],
    ids=["64h-s3", "64h-s4", "32h-s3", "16h-s3", "8h-s3", "64h-mix-s3", "64h-2-s3", "64h-x64-s3",
         "8h-x64-s3", "64h-mix-x64-s3", "16h-one-block-s3"])
def test_second_launch_ring_compiles_for_sm90(heads, w, k, chunks, dims, stages):
    nb, _ = _shape(heads, w, k)
    kernel = sm90.compile_mla_pv(heads, w, k, dims=dims, chunks=chunks, ring=stages)
    res = sm90.resources(kernel)
    assert res["LOCAL"] == 0 and res["STACK"] == 0, res
    assert 2 * (kernel.metadata.shared + 1024) <= SM_SHARED, kernel.metadata.shared
    assert 2 * res["REG"] * 32 * PV.NUM_WARPS <= SM_REGS, res
    block_loops = _block_loops(kernel)
    assert len(block_loops) == (chunks if nb > 1 else 0)   # one block: the loop unrolled away
    ins = [t for _, t in sm90.sass(kernel)]
    assert any("LDGSTS" in t for t in ins), "no cp.async"
    if nb >= stages:                           # blocks past the ring's first fill: copied in the loop
        for loop in block_loops:
            assert any("LDGSTS" in t for t in loop), "no cp.async in the loop"
    gmma = [t.split()[0] for t in ins if "GMMA" in t]
    assert gmma == [f"HGMMA.64x{dims // 2}x16.F32.BF16"] * (4 * chunks), sorted(set(gmma))
    if dims == 64 and heads == 64 and w == 128:
        kernel = sm90.compile_mla_pv(heads, w, k, dims=dims, chunks=chunks, ring=stages, maxnreg=80)
        res = sm90.resources(kernel)
        assert 3 * res["REG"] * 32 * PV.NUM_WARPS <= SM_REGS and 3 * (kernel.metadata.shared + 1024) <= SM_SHARED
        (loop, ) = _block_loops(kernel)
        # a few registers spilled outside the loop (24 bytes on sm_90 with Triton 3.6.0)
        assert not [t for t in loop if "STL" in t or "LDL" in t] and res["STACK"] <= 32, res


# the first launch with two key buffers (`k_buffers=2`) at a cap of 80 registers, at the step's shape
# and every TP shard's head count: no spills, three programs an SM by registers and shared memory
# (q's two buffers and the keys' two: 64 KB), the scores' wgmmas only (a window ending inside a
# block, not a step shape, spills 24 bytes at 64 heads on sm_90)
@pytest.mark.parametrize("heads,w,k", [(64, 128, 512), (32, 128, 512), (8, 128, 512)], ids=["64h", "32h", "8h"])
def test_first_launch_with_two_key_buffers_three_programs_an_sm(heads, w, k):
    kernel = _compile_first(heads, w, k, maxnreg=80, K_BUFFERS=2)
    res = sm90.resources(kernel)
    assert res["LOCAL"] == 0 and res["STACK"] == 0, res
    assert kernel.metadata.shared == 4 * 16384, kernel.metadata.shared
    assert 3 * (kernel.metadata.shared + 1024) <= SM_SHARED and 3 * res["REG"] * 32 * G.NUM_WARPS <= SM_REGS, res
    gmma = [t.split()[0] for t in (t for _, t in sm90.sass(kernel)) if "GMMA" in t]
    assert gmma == ["HGMMA.64x32x16.F32.BF16"] * 32, sorted(set(gmma))


# the same with q copied by TMA (`q_tma`, the step's 17-64-row configuration at 64 heads; at 32
# heads a row's q the first half of its [64, 128] tiles): still no spills and three programs an SM
# (two mbarriers more, 16 bytes), q's four [64, 128] chunks as four TMA copies (two from the start,
# two during chunk 2's decode) and none of q's 16-byte loads
@pytest.mark.parametrize("heads", [64, 32])
def test_first_launch_with_q_by_tma_three_programs_an_sm(heads):
    kernel = _compile_first(heads, 128, 512, maxnreg=80, K_BUFFERS=2, Q_TMA=True)
    res = sm90.resources(kernel)
    assert res["LOCAL"] == 0 and res["STACK"] == 0, res
    assert kernel.metadata.shared == 4 * 16384 + 16, kernel.metadata.shared
    assert 3 * (kernel.metadata.shared + 1024) <= SM_SHARED and 3 * res["REG"] * 32 * G.NUM_WARPS <= SM_REGS, res
    assert kernel.asm["ptx"].count("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier") == 4

    def wide_loads(k):
        return sum("LDG.E.128" in t for _, t in sm90.sass(k))
    # q's four chunks of 64 x 128 BF16 over 256 threads, 16 bytes a load
    plain = _compile_first(heads, 128, 512, maxnreg=80, K_BUFFERS=2)
    assert wide_loads(plain) - wide_loads(kernel) == 4 * 64 * 128 * 2 // 256 // 16, (wide_loads(plain),
                                                                                   wide_loads(kernel))


# where the first launch's grid is resident at once (up to 39 rows at the step's shape) the launcher
# runs it without the atomic ticket (TICKET off: the program id gives the row and block): the same
# code but for the ticket's atomic add, still no spills and three programs an SM
def test_first_launch_without_the_ticket_three_programs_an_sm():
    def atomics(k):
        return [t for _, t in sm90.sass(k) if sm90.unpredicated(t).split()[0].startswith("ATOMG")]
    ticket = _compile_first(64, 128, 512, maxnreg=80, K_BUFFERS=2, Q_TMA=True)
    kernel = _compile_first(64, 128, 512, maxnreg=80, K_BUFFERS=2, Q_TMA=True, TICKET=False)
    res = sm90.resources(kernel)
    assert res["LOCAL"] == 0 and res["STACK"] == 0, res
    assert 3 * (kernel.metadata.shared + 1024) <= SM_SHARED and 3 * res["REG"] * 32 * G.NUM_WARPS <= SM_REGS, res
    assert len(atomics(ticket)) == 1 and not atomics(kernel), (atomics(ticket), atomics(kernel))


# the blocks' P and the second launch's output leave in 16-byte stores (each through shared
# memory from the accumulator's layout, whose stores are 4 bytes): the first launch's P [64, 64]
# BF16 over 256 threads is two a thread (one at 8-16 heads, whose rows past 16 it leaves), and its
# other global stores (the statistics, the flags) 4-byte ones; the second launch's [64, dims] BF16
# a slice is 64 x dims x 2 / 256 / 16 a thread and slice, its one other store a flag word's (at
# four slices a program the accumulator's layout: staged, sm_90 spills there at the cap of 128)
@pytest.mark.parametrize("heads", [64, 8])
def test_p_and_the_output_leave_in_16_byte_stores(heads):
    def stores(kernel):
        ops = [sm90.unpredicated(t).split()[0] for _, t in sm90.sass(kernel)]
        return dict(Counter(op for op in ops if op.startswith("STG.")))
    first = stores(_compile_first(heads, 128, 512, maxnreg=80, K_BUFFERS=2))
    _, block_h = _shape(heads, 128, 512)      # P's rows past block_h (32 a store) are not stored
    assert first.get("STG.E.128") == -(-block_h // 32) and set(first) == {"STG.E", "STG.E.128"}, first
    for dims, chunks, ring in ((128, 1, 4), (128, 2, 0), (64, 1, 3), (128, 4, 0)):
        second = stores(sm90.compile_mla_pv(heads, 128, 512, dims=dims, chunks=chunks, ring=ring))
        if chunks < 4:
            assert second == {"STG.E.128": chunks * 64 * dims * 2 // 256 // 16, "STG.E": 1}, (dims, chunks, second)
        else:
            assert "STG.E.128" not in second, second


# the ring's loop over the blocks: its only global loads are the next block's scale bytes, issued
# after the fence before the block's MMA (the fence, MEMBAR on sm_90, waits for the thread's loads in
# flight), and each block's factor comes from shared memory, at both slice widths
@pytest.mark.parametrize("dims", [128, 64])
def test_second_launch_ring_loop_waits_on_no_global_load(dims):
    kernel = sm90.compile_mla_pv(64, 128, 512, dims=dims, ring=4 if dims == 128 else 3)
    (loop, ) = _block_loops(kernel)
    ops = [sm90.unpredicated(t).split()[0] for t in loop]
    fence = ops.index("MEMBAR.ALL.CTA")
    loads = [i for i, op in enumerate(ops) if op.startswith("LDG.")]
    assert loads and min(loads) > fence, (fence, loads)
    assert {ops[i] for i in loads} == {"LDG.E.U8"}, {ops[i] for i in loads}


# PDL (`pv_pdl`): the first launch lets the second launch start (`griddepcontrol.launch_dependents`,
# once, at its start); the second copies its tables' slots and its first three blocks' codes (window
# and compressed, two 16-byte copies a thread each) before its wait (ACQBULK), and P, the statistics
# and the look-back words only after it: no P copy, no store to global memory before the wait
def test_second_launch_reads_the_first_ones_output_after_its_wait():
    first = _compile_first(64, 128, 512, maxnreg=80, K_BUFFERS=2, Q_TMA=True)
    assert first.asm["ptx"].count("griddepcontrol.launch_dependents") == 1
    for ring in (4, 0):
        kernel = sm90.compile_mla_pv(64, 128, 512, ring=ring)
        ins = [t for _, t in sm90.sass(kernel)]
        (wait, ) = [i for i, t in enumerate(ins) if "ACQBULK" in t]
        before = ins[:wait]
        assert sum("LDGSTS" in t for t in before) == (3 * 4 if ring else 0), before
        assert not [t for t in before if "STG" in t], before


@pytest.mark.parametrize("heads", [64, 8])
def test_first_launch_has_no_pv(heads):
    kernel = _compile_first(heads, 128, 512, maxnreg=128)
    res = sm90.resources(kernel)
    assert res["LOCAL"] == 0 and res["STACK"] == 0, res
    gmma = [t.split()[0] for t in (t for _, t in sm90.sass(kernel)) if "GMMA" in t]
    # the scores (512 / 16 steps of m64 n32 per warpgroup), no P.V
    assert gmma == ["HGMMA.64x32x16.F32.BF16"] * 32, sorted(set(gmma))
    assert 2 * (kernel.metadata.shared + 1024) <= SM_SHARED and 2 * res["REG"] * 32 * G.NUM_WARPS <= SM_REGS


def test_config_errors_name_the_option():
    for bad in (dict(dim_split=2), dict(dim_split=4)):
        with pytest.raises(ValueError, match="dim_split"):
            G.GluonSparseMlaConfig(combine="pv", **bad)
    for chunks in (0, 3, 8, True, 2.0):
        with pytest.raises(ValueError, match="pv_chunks"):
            G.GluonSparseMlaConfig(combine="pv", pv_chunks=chunks)
    with pytest.raises(ValueError, match="lookback"):
        G.GluonSparseMlaConfig(combine="pv", lookback="values")
    for kb in (1, 3, 8, True, 2.0):
        with pytest.raises(ValueError, match="k_buffers"):
            G.GluonSparseMlaConfig(combine="pv", k_buffers=kb)
    for bad in (dict(combine="separate"), dict(combine="spread"), dict(combine="pv", q_buffers=4)):
        with pytest.raises(ValueError, match="k_buffers=2"):
            G.GluonSparseMlaConfig(k_buffers=2, **bad)
    assert G.GluonSparseMlaConfig(combine="pv", k_buffers=2).k_buffers == 2
    for dims in (32, 256, 64.0, True):
        with pytest.raises(ValueError, match="pv_dims"):
            G.GluonSparseMlaConfig(combine="pv", pv_dims=dims)
    for cap in (32, 256, 80.0, True, None):
        with pytest.raises(ValueError, match="pv_maxnreg"):
            G.GluonSparseMlaConfig(combine="pv", pv_maxnreg=cap)
    for stages in (1, 2, 5, -1, 3.0, True):
        with pytest.raises(ValueError, match="pv_stages"):
            G.GluonSparseMlaConfig(combine="pv", fp4_lut=True, pv_stages=stages)
    with pytest.raises(ValueError, match="fp4_lut"):
        G.GluonSparseMlaConfig(combine="pv", pv_stages=3)
    assert G.GluonSparseMlaConfig(combine="pv", pv_dims=64).pv_dims == 64
    assert G.GluonSparseMlaConfig(combine="pv", pv_chunks=4).pv_chunks == 4
    assert G.GluonSparseMlaConfig().pv_maxnreg == PV._MAXNREG == 128
    for bad in (dict(combine="separate"), dict(combine="spread")):
        with pytest.raises(ValueError, match="pv_pdl"):
            G.GluonSparseMlaConfig(pv_pdl=True, **bad)
    with pytest.raises(TypeError, match="pv_pdl"):
        G.GluonSparseMlaConfig(combine="pv", pv_pdl=1)
    assert G.GluonSparseMlaConfig(combine="pv", pv_pdl=True).pv_pdl


def test_second_launch_releases_its_successor_at_its_start():
    """`mla_pv_(release=True)` (the step's `wo_a_pdl` from 13 rows, in the step's 13-64-row form: 64-dim
    slices, a ring of three, a cap of 80): one griddepcontrol.launch_dependents before the program's
    first global access, the loop over the blocks still without spills; none without release."""
    for release in (False, True):
        kernel = sm90.compile_mla_pv(64, 128, 512, dims=64, ring=3, maxnreg=80, release=release)
        ptx = kernel.asm["ptx"].split("\n")
        marks = [i for i, line in enumerate(ptx) if "griddepcontrol.launch_dependents" in line]
        assert len(marks) == int(release), marks
        if release:
            first_global = next(i for i, line in enumerate(ptx) if ".global" in line and ("ld." in line or "cp.async" in line))
            assert marks[0] < first_global, (marks, first_global)
        (loop, ) = _block_loops(kernel)
        assert not [t for t in loop if "STL" in t or "LDL" in t] and sm90.resources(kernel)["STACK"] <= 32
