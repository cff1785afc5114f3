"""Run by tests/ops/test_fp32_dots_sm90.py in a subprocess without the Triton interpreter (the kernels
must be real JIT functions to compile), and by hand: compiles for sm_90 the kernels of the exact
step's FP32 dots - the sparse MLA with `FP32_STEP_TILING` (64 heads, 128 + 512 keys, the step's
separate combination; `--inline`: also the combination by the last block, 27 s more) and the grouped
wo_a with `ieee_dot` at the tiles of 1, 16 and 32 rows (`WoAPlan.ieee_tile`; the V4.1-Flash shape,
BF16 and FP8 weights) - and prints one JSON object per kernel: registers, stack, local memory, spill
instructions, FMAs and MMAs in the SASS. `sparse_mla` or `wo_a` as an argument: that kernel only."""

from __future__ import annotations

import json
import sys

import torch

from dsv41_decode.ops import sparse_mla, wo_a
from dsv41_decode.ops.sparse_mla_plan import FP32_STEP_TILING
from dsv41_decode.testing.sm90 import compile_sm90, opcode_counts, resources, sass

MLA_TYPES = {"q_ptr": "*bf16", "wpool_ptr": "*u8", "cpool_ptr": "*u8", "wtab_ptr": "*i32", "ctab_ptr": "*i32",
             "sink_ptr": "*fp32", "out_ptr": "*i16", "part_acc_ptr": "*fp32", "part_ml_ptr": "*fp32",
             "block_max_ptr": "*fp32", "flag_ptr": "*i32", "count_ptr": "*i32", "ticket_ptr": "*i32",
             "scale": "fp32"}
WO_A_TYPES = {"o_ptr": "*bf16", "cos_ptr": "*fp32", "sin_ptr": "*fp32", "s_ptr": "*u8", "z_ptr": "*i16",
              "part_ptr": "*fp32", "count_ptr": "*i32", "codes_ptr": "*u8", "scales_ptr": "*u8",
              "cp_pool_ptr": "*i32", "cp_src_ptr": "*i64", "cp_dst_ptr": "*i64"}


def _row(name: str, kernel) -> dict:
    ops = opcode_counts([t for _, t in sass(kernel)])
    return dict(name=name, **resources(kernel), spills=ops.get("STL", 0) + ops.get("LDL", 0),
                ffma=ops.get("FFMA", 0), mma=sum(n for op, n in ops.items() if "MMA" in op))


def sparse_mla_rows(inline: bool = False) -> list[dict]:
    t = FP32_STEP_TILING
    w, kc, bh = 128, 512, t["block_h"]
    nb = -(-(w + kc) // sparse_mla.BLOCK_KEYS)
    rows = []
    for separate in (True, False) if inline else (True,):
        consts = dict(W=w, W_P2=w, KC=kc, HG=64 // bh, SPLIT=True, NB_P2=1 << (nb - 1).bit_length(), BLOCK_H=bh,
                      BF16_DOT=t["bf16_dot"], NATIVE_FP8=True, SEPARATE=separate, DOT_DIMS=t["dot_dims"])
        k = compile_sm90(sparse_mla._sparse_mla_kernel, MLA_TYPES, consts, num_warps=t["num_warps"])
        rows.append(_row(f"sparse_mla fp32 bh{bh} w{t['num_warps']} d{t['dot_dims']} "
                         f"{'separate' if separate else 'inline'}", k))
    return rows


def wo_a_rows() -> list[dict]:
    rows = []
    for dtype in (torch.bfloat16, torch.float8_e4m3fn):
        fp8 = dtype == torch.float8_e4m3fn
        # the H200's splits (`WoAPlan.build`: about 2 programs a SM for BF16, 4 for FP8)
        plan = wo_a.WoAPlan.build(64, 8, 1024, 64, dtype, "cpu", ieee_dot=True, split=4 if fp8 else 2)
        for m in (1, 16, 32):
            block_m, warps = plan.ieee_tile(m)
            consts = dict(R=1024, HEADS_PER_GROUP=8, HEAD_DIM=512, ROPE_DIM=64, K_PER_SPLIT=plan.k_per_split,
                          SPLIT=plan.split, BLOCK_M=block_m, BLOCK_N=plan.block_n, BLOCK_K=128, FP8=fp8,
                          NUM_STAGES=plan.stages(m), QUANT=True, IEEE_DOT=True)
            k = compile_sm90(wo_a._wo_a_kernel, dict(WO_A_TYPES, w_ptr="*fp8e4nv" if fp8 else "*bf16"), consts,
                             num_warps=warps, num_stages=plan.stages(m), enable_fp_fusion=False)
            rows.append(_row(f"wo_a ieee {'fp8' if fp8 else 'bf16'} m{block_m} w{warps}", k))
    return rows


if __name__ == "__main__":
    only = [a for a in sys.argv[1:] if not a.startswith("--")]
    rows = (wo_a_rows() if not only or "wo_a" in only else []) + \
        (sparse_mla_rows("--inline" in sys.argv) if not only or "sparse_mla" in only else [])
    for r in rows:
        print(json.dumps(r), flush=True)
