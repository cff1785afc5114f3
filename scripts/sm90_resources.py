"""Compile the sparse MLA kernel for sm_90 on any machine (no GPU: Triton's own ptxas) and print
registers, spills and shared memory per plan variant: what a variant costs in registers before
any device time is spent. Usage: python scripts/sm90_resources.py [variant ...]"""

from __future__ import annotations

import sys

from dsv41_decode.ops import sparse_mla as sm
from dsv41_decode.testing.sm90 import compile_sm90, resources

VARIANTS = {
    "bh16_w4": dict(BLOCK_H=16, num_warps=4),
    "bh16_w8": dict(BLOCK_H=16, num_warps=8),
    "bh32_w4": dict(BLOCK_H=32, num_warps=4),
    "bh32_w8": dict(BLOCK_H=32, num_warps=8),
    "bh64_w8": dict(BLOCK_H=64, num_warps=8),
}


def compile_variant(name: str, opts: dict) -> str:
    """One line: the registers, stack and shared memory of the sparse-MLA kernel with `opts`
    (BLOCK_H, num_warps) at 64 heads, 128 + 512 keys, split into its 64-key blocks."""
    types = {"q_ptr": "*bf16", "wpool_ptr": "*u8", "cpool_ptr": "*u8", "wtab_ptr": "*i32", "ctab_ptr": "*i32",
             "sink_ptr": "*fp32", "out_ptr": "*i16", "part_acc_ptr": "*fp32", "part_ml_ptr": "*fp32",
             "block_max_ptr": "*fp32", "flag_ptr": "*i32", "count_ptr": "*i32", "ticket_ptr": "*i32",
             "scale": "fp32"}
    w, kc = 128, 512
    nb = -(-(w + kc) // sm.BLOCK_KEYS)
    consts = dict(W=w, W_P2=w, KC=kc, HG=64 // opts["BLOCK_H"], SPLIT=True, NB_P2=1 << (nb - 1).bit_length(),
                  BLOCK_H=opts["BLOCK_H"], BF16_DOT=True, NATIVE_FP8=True)
    r = resources(compile_sm90(sm._sparse_mla_kernel, types, consts, num_warps=opts["num_warps"]))
    return f"{name:10s} regs {r['REG']} stack {r['STACK']} shared {r['SHARED']} local {r['LOCAL']}"


if __name__ == "__main__":
    names = sys.argv[1:] or list(VARIANTS)
    for n in names:
        print(compile_variant(n, VARIANTS[n]), flush=True)
