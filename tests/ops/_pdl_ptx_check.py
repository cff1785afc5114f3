"""Run by tests/ops/test_pdl.py in a subprocess without the Triton interpreter (the kernels must be
real JIT functions to compile): compiles the PDL-aware kernels for sm_90 with Triton's own ptxas
and checks their PTX. Exits non-zero, naming the kernel, on a violation."""

from __future__ import annotations

import sys

import triton
import triton.language as tl

from dsv41_decode.ops import (act_quant, exact_mm, kv_write, low_latency_mm, mhc, pdl, rms_norm, sparse_mla,
                              sparse_tables, wo_a)
from dsv41_decode.testing.sm90 import compile_sm90, pdl_prologue


@triton.jit
def _loads_too_early(x_ptr, y_ptr, PDL: tl.constexpr):
    v = tl.load(x_ptr + tl.arange(0, 128))      # a dependent load before the wait: a violation
    pdl.enter(PDL)
    tl.store(y_ptr + tl.arange(0, 128), v)


def check_the_checker():
    try:
        _assert_waits_first(_ptx(_loads_too_early, {"x_ptr": "*fp32", "y_ptr": "*fp32"}, dict(PDL=True)))
    except AssertionError:
        return
    raise AssertionError("a load before griddepcontrol.wait went unnoticed")


def _ptx(fn, types: dict, consts: dict, num_warps: int = 4) -> str:
    """PTX of `fn` for sm_90 with PDL on (`testing.sm90.compile_sm90`)."""
    return compile_sm90(fn, types, consts, num_warps=num_warps, launch_pdl=True).asm["ptx"]


def _assert_waits_first(ptx: str) -> None:
    copies, other = pdl_prologue(ptx)
    assert copies == 0 and not other, f"{other or 'a TMA copy'} before griddepcontrol.wait"
    body = ptx[ptx.index(".entry"):]
    assert body.index("griddepcontrol.launch_dependents") > body.index("griddepcontrol.wait")


def _assert_releases_after_main_loop(ptx: str, marker: str) -> None:
    """A long kernel lets its successor launch only after its main loop (the last `marker`)."""
    body = ptx[ptx.index(".entry"):]
    assert body.rindex(marker) < body.index("griddepcontrol.launch_dependents"), \
        f"griddepcontrol.launch_dependents before the last {marker}"


def check_low_latency_mm(dequant):
    fn = low_latency_mm._mxfp8_ll_mm_kernel
    types = {"x_ptr": "*u8", "sx_ptr": "*u8", "w_ptr": "*fp8e4nv", "sw_ptr": "*u8", "y_ptr": "*i16",
             "ws_ptr": "*fp32", "cnt_ptr": "*i32"}
    consts = dict(N_SPLIT=4, BLOCK_N=64, BLOCK_M=16, BLOCK_K=128, SPLIT_K=True, DEQUANT=dequant, DOT_F32=False,
                  OUT_F32=False, PDL=True)
    types["x_ptr"] = "*fp8e4nv"
    for words in (False, True):    # the scales read before the loop with scale_words: after the wait
        ptx = _ptx(fn, types, dict(consts, SCALE_WORDS=words))
        _assert_waits_first(ptx)
        _assert_releases_after_main_loop(ptx, "mma")
        assert "cp.async.bulk.prefetch.L2" in ptx[:ptx.index("griddepcontrol.wait")]


def check_exact_mm():
    """ExactMM by PDL (the step's exact wo_b and fused wq_a|wkv at 1-2 rows, in their plans' FP64
    and FP32 block sums, with a K split too): the first weight bytes asked of L2, then the wait,
    before anything else; no early release (its successors start at its end)."""
    fn = exact_mm._exact_mm_kernel
    types = {"x_ptr": "*fp8e4nv", "sx_ptr": "*u8", "w_ptr": "*fp8e4nv", "sw_ptr": "*u8", "y_ptr": "*i16",
             "ws_ptr": "*fp32", "cnt_ptr": "*i32"}
    for consts in (dict(BLOCK_N=2, BLOCK_K=1024, ROWS=1, F64=True), dict(BLOCK_N=8, BLOCK_K=1024, ROWS=2),
                   dict(BLOCK_N=8, BLOCK_K=512, ROWS=4, SPLIT=4, STAGES=4)):
        ptx = _ptx(fn, types, dict(consts, OUT_F32=False, PDL=True), num_warps=2)
        copies, other = pdl_prologue(ptx)
        assert copies == 0 and not other, f"{other or 'a TMA copy'} before griddepcontrol.wait"
        assert "cp.async.bulk.prefetch.L2" in ptx[:ptx.index("griddepcontrol.wait")], consts
        assert "griddepcontrol.launch_dependents" not in ptx, consts


def check_wo_a():
    fn = wo_a._wo_a_kernel
    types = {"o_ptr": "*bf16", "cos_ptr": "*fp32", "sin_ptr": "*fp32", "w_ptr": "*bf16", "s_ptr": "*bf16",
             "z_ptr": "*i16", "part_ptr": "*fp32", "count_ptr": "*i32", "codes_ptr": "*u8", "scales_ptr": "*u8"}
    consts = dict(R=1024, HEADS_PER_GROUP=8, HEAD_DIM=512, ROPE_DIM=64, K_PER_SPLIT=2048, SPLIT=2,
                  BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, FP8=False, NUM_STAGES=3, QUANT=True, PDL=True)
    for bf16_dot in (False, True):
        ptx = _ptx(fn, types, dict(consts, BF16_DOT=bf16_dot))
        _assert_waits_first(ptx)
        _assert_releases_after_main_loop(ptx, "mma")


def check_sparse_mla():
    fn = sparse_mla._sparse_mla_kernel
    types = {"q_ptr": "*bf16", "wpool_ptr": "*u8", "cpool_ptr": "*u8", "wtab_ptr": "*i32", "ctab_ptr": "*i32",
             "sink_ptr": "*fp32", "out_ptr": "*i16", "part_acc_ptr": "*fp32", "part_ml_ptr": "*fp32",
             "block_max_ptr": "*fp32", "flag_ptr": "*i32", "count_ptr": "*i32", "ticket_ptr": "*i32",
             "scale": "fp32"}
    consts = dict(W=128, W_P2=128, KC=512, HG=1, SPLIT=True, NB_P2=16, BLOCK_H=16, BF16_DOT=True,
                  NATIVE_FP8=True, PDL=True)
    ptx = _ptx(fn, types, consts)
    _assert_waits_first(ptx)
    _assert_releases_after_main_loop(ptx, "mma")



def check_sparse_mla_combine():
    types = {"part_acc_ptr": "*fp32", "part_ml_ptr": "*fp32", "flag_ptr": "*i32", "sink_ptr": "*fp32",
             "out_ptr": "*i16"}
    _assert_waits_first(_ptx(sparse_mla._sparse_mla_combine_kernel, types,
                             dict(SPLIT=20, SPLIT_P2=32, BLOCK_H=16, CHUNK=16, PDL=True)))


def check_rms_norm():
    types = {"xa_ptr": "*bf16", "wa_ptr": "*bf16", "oa_ptr": "*i16", "ca_ptr": "*u8", "sa_ptr": "*u8",
             "xb_ptr": "*bf16", "wb_ptr": "*bf16", "ob_ptr": "*i16", "eps": "fp32"}
    _assert_waits_first(_ptx(rms_norm._rms_norm_pair_kernel, types,
                             dict(D_A=1024, BLOCK_A=1024, D_B=512, BLOCK_B=512, PDL=True)))
    types = {"x_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*i16", "codes_ptr": "*u8", "scales_ptr": "*u8",
             "eps": "fp32"}
    _assert_waits_first(_ptx(rms_norm._rms_norm_kernel, types,
                             dict(D=512, BLOCK=512, ROUND_IN=False, QUANT=True, PDL=True)))


def check_act_quant():
    types = {"x_ptr": "*bf16", "codes_ptr": "*u8", "scales_ptr": "*u8"}
    consts = dict(AMAX_FLOOR=act_quant.MXFP8_AMAX_FLOOR, INV_QMAX=act_quant.INV_E4M3_MAX,
                  QMAX=act_quant.E4M3_MAX, BLOCK_M=16, BLOCK_K=256, PDL=True)
    _assert_waits_first(_ptx(act_quant._act_quant_mxfp8_kernel, types, consts))


def check_kv_write():
    types = {"q_ptr": "*i16", "kv_ptr": "*bf16", "cos_ptr": "*fp32", "sin_ptr": "*fp32", "slots_ptr": "*i64",
             "pool_ptr": "*u8"}
    _assert_waits_first(_ptx(kv_write._qkv_rope_insert_kernel, types, dict(HB=16, REQUANT=False, PDL=True)))


def check_mhc():
    types = {"y_ptr": "*bf16", "x_ptr": "*bf16", "post_ptr": "*fp32", "comb_ptr": "*fp32", "pre_ptr": "*fp32",
             "w_ptr": "*bf16", "xo_ptr": "*i16", "u_ptr": "*i16", "codes_ptr": "*u8", "scales_ptr": "*u8",
             "ws_ptr": "*fp32", "cnt_ptr": "*i32", "eps": "fp32"}
    consts = dict(D=4096, BLOCK_D=1024, NCH=4, NCH_P2=4, BLOCK_N=1024, PDL=True)
    _assert_waits_first(_ptx(mhc._mhc_boundary_split_kernel, types, consts))
    consts = dict(D=4096, BLOCK_D=1024, NCH=4, NCH_P2=4, PDL=True)
    _assert_waits_first(_ptx(mhc._mhc_boundary_coresident_kernel, types, consts))


def check_topk_slots():
    """The sparse-index table (`topk_slots_(release=True)`, which releases the sparse MLA launched by
    PDL after it): its wait (a no-op when launched plainly) and its release before anything else."""
    types = {"topk_ptr": "*i32", "slot_ptr": "*i64", "bt_ptr": "*i32", "out_ptr": "*i32", "len_ptr": "*i32"}
    ptx = _ptx(sparse_tables._topk_slots_kernel, types, dict(PAGE=64, BLOCK_K=512, PDL=True))
    _assert_waits_first(ptx)
    body = ptx[ptx.index(".entry"):]
    first_global = min(body.index(m) for m in ("ld.global", "st.global") if m in body)
    assert body.index("griddepcontrol.launch_dependents") < first_global, "the release after a global access"


if __name__ == "__main__":
    check_the_checker()
    for name, check in (("low_latency_mm f8", lambda: check_low_latency_mm(False)),
                        ("low_latency_mm dequant", lambda: check_low_latency_mm(True)),
                        ("exact_mm", check_exact_mm), ("wo_a", check_wo_a), ("sparse_mla", check_sparse_mla),
                        ("sparse_mla combine", check_sparse_mla_combine), ("rms_norm", check_rms_norm),
                        ("act_quant", check_act_quant), ("kv_write", check_kv_write), ("mhc boundary", check_mhc),
                        ("topk_slots", check_topk_slots)):
        try:
            check()
        except AssertionError as e:
            sys.exit(f"{name}: {e}")
        print(f"{name}: waits before its first dependent access")
