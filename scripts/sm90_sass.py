"""Compile kernels for sm_90 on any machine (no GPU: Triton's own ptxas and cuobjdump) and print the
SASS instruction counts that docs/attn.md, docs/gemm.md and docs/step.md cite: per kernel the
registers, the whole kernel's instructions, and the main loop's (per entry for the indexer; for the
exact linear `GluonExactMM`, its consumer's loop over the ring's slots with its opcode mix, per
configuration of the step's plan `_GLUON_PLAN`, or per `SPEC@ROWS` given after `exact_mm`; for the
sparse MLA's combination "pv", its second launch's loop over the blocks per slice width).
Usage: python scripts/sm90_sass.py [indexer] [combine] [mla_pv] [wo_a] [ll_tail] [ll_scales] [exact_mm [SPEC@ROWS ...]]
(default: all; e.g. `exact_mm f16w:64:32:1:32:4:1:80@64`)."""

from __future__ import annotations

import dataclasses
import sys

import triton

from dsv41_decode.ops import gluon_exact_mm, gluon_sparse_mla_pv, indexer, low_latency_mm, sparse_mla, wo_a
from dsv41_decode.ops.exact_linear import _GLUON_PLAN
from dsv41_decode.testing.sm90 import (compile_exact_mm, compile_mla_pv, compile_sm90, loops_with,
                                       main_loop, opcode_counts, resources, sass)


def _line(name: str, kernel, loop_note: str = "") -> str:
    loop = main_loop(kernel)
    top = ", ".join(f"{op} {n}" for op, n in list(opcode_counts(loop or [t for _, t in sass(kernel)]).items())[:6])
    return (f"{name:34s} regs {resources(kernel)['REG']:3d}  instructions {len(sass(kernel)):5d}  "
            f"main loop {len(loop):5d}{loop_note}  [{top}]")


def indexer_paths() -> None:
    types = {"iq_ptr": "*bf16", "w_ptr": "*bf16", "pool_ptr": "*i32", "pool8_ptr": "*u8", "bt_ptr": "*i32",
             "slot_ptr": "*i32", "nvis_ptr": "*i32", "cand_ptr": "*fp32", "out_ptr": "*fp32"}
    for fp8 in (False, True):
        for block_e, warps in ((128, 4), (128, 8)):
            k = compile_sm90(indexer._index_scores_kernel, types,
                             dict(BLOCK_H=32, BLOCK_E=block_e, HAS_CAND=False, DOT_BF16=True, FP8=fp8, ASM=True),
                             num_warps=warps)
            per_entry = len(main_loop(k)) * warps / block_e
            print(_line(f"indexer {'fp8' if fp8 else 'bf16'} E{block_e} w{warps}", k,
                        f" ({per_entry:.1f} warp-instr/entry)"), flush=True)


def combine() -> None:
    types = {"part_acc_ptr": "*fp32", "part_ml_ptr": "*fp32", "flag_ptr": "*i32", "sink_ptr": "*fp32",
             "out_ptr": "*i16"}
    for split, block_h in ((10, 16), (10, 32)):     # 128 + 512 keys: ten 64-key blocks
        chunk, sub_h = sparse_mla.combine_tiling(split, block_h)
        k = compile_sm90(sparse_mla._sparse_mla_combine_kernel, types,
                         dict(SPLIT=split, SPLIT_P2=1 << (split - 1).bit_length(), BLOCK_H=block_h, CHUNK=chunk,
                              SUB_H=sub_h, PDL=False), num_warps=4)
        print(_line(f"sparse-MLA combine S{split} H{block_h} C{chunk} h{sub_h}", k), flush=True)


def mla_pv() -> None:
    """The sparse MLA's combination "pv", its second launch (`gluon_sparse_mla_pv`) at V4.1-Flash's
    128 + 512 keys and 64 heads, one slice a program of 128 and of 64 dims, with and without the ring of
    three cp.async slots (`pv_stages=3`): the loop over the blocks (its three kinds of block
    together; a block runs one)."""
    for dims in gluon_sparse_mla_pv.PV_DIMS:
        for ring in (0, 3):
            k = compile_mla_pv(64, 128, 512, dims=dims, ring=ring)
            name = f"sparse-MLA pv second launch, {dims} dims" + (f", ring {ring}" if ring else "")
            print(_line(name, k), flush=True)


def wo_a_paths() -> None:
    types = {"o_ptr": "*bf16", "cos_ptr": "*fp32", "sin_ptr": "*fp32", "w_ptr": "*bf16", "s_ptr": "*u8",
             "z_ptr": "*i16", "part_ptr": "*fp32", "count_ptr": "*i32", "codes_ptr": "*u8", "scales_ptr": "*u8",
             "cp_pool_ptr": "*i32", "cp_src_ptr": "*i64", "cp_dst_ptr": "*i64"}
    for fp8, bf16_dot, swap, copy in ((False, False, False, 0), (False, True, False, 0), (True, False, False, 0),
                                      (True, True, False, 0), (False, True, True, 0), (False, True, True, 132)):
        consts = dict(R=1024, HEADS_PER_GROUP=8, HEAD_DIM=512, ROPE_DIM=64, K_PER_SPLIT=2048, SPLIT=2,
                      BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, FP8=fp8, NUM_STAGES=3, QUANT=True, PDL=False,
                      BF16_DOT=bf16_dot, SWAP_AB=swap, COPY_WORDS=copy, COPY_BLOCK=256 if copy else 1,
                      N_TILES=128)
        k = compile_sm90(wo_a._wo_a_kernel, dict(types, w_ptr="*fp8e4nv" if fp8 else "*bf16"), consts,
                         num_warps=4, num_stages=3, enable_fp_fusion=False)
        print(_line(f"wo_a {'fp8' if fp8 else 'bf16'} weight, {'bf16' if bf16_dot else 'tf32'} dot"
                    f"{', swap' if swap else ''}{', window copy' if copy else ''}", k), flush=True)


# low_latency_mm's runtime pointer arguments, as its launcher passes them
LL_TYPES = {"x_ptr": "*fp8e4nv", "sx_ptr": "*u8", "w_ptr": "*fp8e4nv", "sw_ptr": "*u8", "y_ptr": "*i16",
            "ws_ptr": "*fp32", "cnt_ptr": "*i32"}


def ll_tail() -> None:
    types = LL_TYPES
    k = compile_sm90(low_latency_mm._mxfp8_ll_mm_kernel, types,
                     dict(N_SPLIT=7, BLOCK_N=64, BLOCK_M=16, BLOCK_K=128, SPLIT_K=True, DEQUANT=True,
                          DOT_F32=False, OUT_F32=False, PDL=False), num_warps=4, num_stages=4)
    texts = [t for _, t in sass(k)]
    first_atom = next(i for i, t in enumerate(texts) if "ATOM" in t or t.startswith("RED"))
    tail = texts[first_atom:]
    first_add = next(i for i, t in enumerate(tail) if t.split()[0].startswith("FADD"))
    loads = sum("LDG" in t for t in tail[:first_add])
    print(f"{'low_latency_mm split-K tail, 7 splits':34s} partial loads issued before the first add: {loads}",
          flush=True)


def ll_scales() -> None:
    """low_latency_mm's K loop with byte-loaded vs word-loaded scales (scale_words), both loops."""
    types = LL_TYPES
    for dq, split, stages in ((False, 1, 3), (True, 7, 4)):
        for words in (False, True):
            k = compile_sm90(low_latency_mm._mxfp8_ll_mm_kernel, types,
                             dict(N_SPLIT=split, BLOCK_N=64, BLOCK_M=16, BLOCK_K=128, SPLIT_K=split > 1,
                                  DEQUANT=dq, DOT_F32=False, OUT_F32=False, PDL=False, SCALE_WORDS=words),
                             num_warps=4, num_stages=stages)
            loads = sum(t.startswith("LDG.") for t in main_loop(k))
            print(_line(f"low_latency_mm {'dq' if dq else 'f8'} BK128 {'words' if words else 'bytes'}", k,
                        f" ({loads} LDG)"), flush=True)


def exact_mm(specs: list[str]) -> None:
    """`GluonExactMM`'s consumer loop (the loop holding every MMA: one ring slot, two with
    `pair_slots`) per configuration and row count: `specs` as SPEC@ROWS
    (`GluonExactConfig.from_spec`), default every configuration of `_GLUON_PLAN` at the most rows it
    serves, each also with its fused scaling (`fuse_scales`: its fused loop, then the unfused one
    compiled beside it)."""
    cases = [(s.split("@")[0], int(s.split("@")[1])) for s in specs]
    if not cases:
        cases = list(dict.fromkeys((variant.spec, rows) for _, configs in _GLUON_PLAN.values()
                                   for rows, c in configs.items()
                                   for variant in (c, dataclasses.replace(c, fuse_scales=True))))
    for spec, rows in cases:
        config = gluon_exact_mm.GluonExactConfig.from_spec(spec)
        bt = gluon_exact_mm.block_t(rows, config)
        k = compile_exact_mm(config, bt)
        mma = {"f16d": "HMMA", "f16w": "HGMMA", "f16wp": "HGMMA"}.get(config.convert, "DMMA")
        loops = loops_with(k, mma)
        top = ", ".join(f"{op} {n}" for op, n in list(opcode_counts(loops[0]).items())[:10])
        print(f"exact_mm {spec}@{rows} (x rows {bt}): regs {resources(k)['REG']}, stack {resources(k)['STACK']}, "
              f"consumer loop {' / '.join(str(len(lp)) for lp in loops)} "
              f"{'a unit of two slots' if config.pair_slots else 'a slot'}  [{top}]", flush=True)


STAGES = {"indexer": indexer_paths, "combine": combine, "mla_pv": mla_pv, "wo_a": wo_a_paths, "ll_tail": ll_tail,
          "ll_scales": ll_scales, "exact_mm": exact_mm}

if __name__ == "__main__":
    print(f"sm_90 SASS, Triton {triton.__version__}")
    args = sys.argv[1:]
    cut = args.index("exact_mm") + 1 if "exact_mm" in args else len(args)   # SPECs follow exact_mm
    for name in args[:cut] or list(STAGES):
        if name == "exact_mm":
            exact_mm(args[cut:])
        else:
            STAGES[name]()
