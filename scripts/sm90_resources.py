"""Compile the sparse MLA kernel for sm_90 on any machine (no GPU: Triton's own ptxas) and print
registers, spills and shared memory per plan variant: what a variant costs in registers before
any device time is spent. Usage: python scripts/sm90_resources.py [variant ...] (default: the BF16
variants; `fp32`: the FP32-operand ones, `SparseMlaPlan.dot_dims`, 20-150 s each; `all`)."""

from __future__ import annotations

import sys

from dsv41_decode.ops import sparse_mla as sm
from dsv41_decode.testing.sm90 import compile_sm90, opcode_counts, resources, sass

VARIANTS = {
    "bh16_w4": dict(BLOCK_H=16, num_warps=4),
    "bh16_w8": dict(BLOCK_H=16, num_warps=8),
    "bh32_w4": dict(BLOCK_H=32, num_warps=4),
    "bh32_w8": dict(BLOCK_H=32, num_warps=8),
    "bh64_w8": dict(BLOCK_H=64, num_warps=8),
}
# FP32 operands with IEEE dots (the exact step's; `FP32_STEP_TILING` is fp32_bh16_d64), measured:
# bh16 d128 (the BF16 tiling's held 128-dim chunks) stack 10088 B; bh16 d64 195 registers, d32 170,
# d16 128 + 8 B of stack; bh32 d64 255 + 264 B, bh32 d32 218; bh16 d64 with the inline combination 255
FP32_VARIANTS = {
    "fp32_bh16_d128": dict(BLOCK_H=16, num_warps=8, DOT_DIMS=128),
    "fp32_bh16_d64": dict(BLOCK_H=16, num_warps=8, DOT_DIMS=64),
    "fp32_bh16_d32": dict(BLOCK_H=16, num_warps=8, DOT_DIMS=32),
    "fp32_bh32_d64": dict(BLOCK_H=32, num_warps=8, DOT_DIMS=64),
    "fp32_bh32_d32": dict(BLOCK_H=32, num_warps=8, DOT_DIMS=32),
    "fp32_bh16_d64_inline": dict(BLOCK_H=16, num_warps=8, DOT_DIMS=64, SEPARATE=False),
}


def compile_variant(name: str, opts: dict) -> str:
    """One line: the registers, stack and shared memory of the sparse-MLA kernel with `opts`
    (BLOCK_H, num_warps; DOT_DIMS: FP32 operands, in dots of that many dims; SEPARATE: default
    True with DOT_DIMS, as the step) at 64 heads, 128 + 512 keys, split into its 64-key blocks."""
    types = {"q_ptr": "*bf16", "wpool_ptr": "*u8", "cpool_ptr": "*u8", "wtab_ptr": "*i32", "ctab_ptr": "*i32",
             "sink_ptr": "*fp32", "out_ptr": "*i16", "part_acc_ptr": "*fp32", "part_ml_ptr": "*fp32",
             "block_max_ptr": "*fp32", "flag_ptr": "*i32", "count_ptr": "*i32", "ticket_ptr": "*i32",
             "scale": "fp32"}
    w, kc = 128, 512
    nb = -(-(w + kc) // sm.BLOCK_KEYS)
    consts = dict(W=w, W_P2=w, KC=kc, HG=64 // opts["BLOCK_H"], SPLIT=True, NB_P2=1 << (nb - 1).bit_length(),
                  BLOCK_H=opts["BLOCK_H"], BF16_DOT="DOT_DIMS" not in opts, NATIVE_FP8=True)
    if "DOT_DIMS" in opts:
        consts.update(DOT_DIMS=opts["DOT_DIMS"], SEPARATE=opts.get("SEPARATE", True))
    kernel = compile_sm90(sm._sparse_mla_kernel, types, consts, num_warps=opts["num_warps"])
    r = resources(kernel)
    ops = opcode_counts([t for _, t in sass(kernel)])
    return (f"{name:20s} regs {r['REG']} stack {r['STACK']} shared {r['SHARED']} local {r['LOCAL']} "
            f"STL/LDL {ops.get('STL', 0) + ops.get('LDL', 0)} FFMA {ops.get('FFMA', 0)} HMMA {ops.get('HMMA', 0)}")


if __name__ == "__main__":
    every = {**VARIANTS, **FP32_VARIANTS}
    names = sys.argv[1:] or list(VARIANTS)
    if names == ["fp32"]:
        names = list(FP32_VARIANTS)
    elif names == ["all"]:
        names = list(every)
    for n in names:
        print(compile_variant(n, every[n]), flush=True)
