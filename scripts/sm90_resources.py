"""Compile the sparse MLA kernel for sm_90 on any machine (no GPU: Triton's own ptxas) and print
registers, spills and shared memory per plan variant: what a variant costs in registers before
any device time is spent. Usage: python scripts/sm90_resources.py [variant ...]"""

from __future__ import annotations

import sys

from dsv41_decode.ops import sparse_mla as sm
from dsv41_decode.testing.sm90 import compile_sm90, resources

VARIANTS = {
    "bh16_w4": dict(BLOCK_H=16, BLOCK_KEYS=16, num_warps=4),
    "bh16_w8": dict(BLOCK_H=16, BLOCK_KEYS=16, num_warps=8),
    "bh32_w4": dict(BLOCK_H=32, BLOCK_KEYS=16, num_warps=4),
    "bh32_w8": dict(BLOCK_H=32, BLOCK_KEYS=16, num_warps=8),
    "bh64_w8": dict(BLOCK_H=64, BLOCK_KEYS=16, num_warps=8),
}


def compile_variant(name: str, opts: dict, extra_constexprs: dict | None = None, module=sm) -> str:
    """One line: the registers, stack and shared memory of the sparse-MLA kernel with `opts`
    (BLOCK_H, BLOCK_KEYS, num_warps; SPLIT and BPS optional) at 128 + 512 keys."""
    types = {"q_ptr": "*bf16", "wpool_ptr": "*u8", "cpool_ptr": "*u8", "wtab_ptr": "*i32", "ctab_ptr": "*i32",
             "sink_ptr": "*fp32", "out_ptr": "*i16", "part_acc_ptr": "*fp32", "part_ml_ptr": "*fp32",
             "count_ptr": "*i32", "scale": "fp32"}
    consts = dict(W=128, KC=512, SPLIT=opts.get("SPLIT", 4), BLOCKS_PER_SPLIT=opts.get("BPS", 10),
                  BLOCK_H=opts["BLOCK_H"], BLOCK_KEYS=opts["BLOCK_KEYS"], BF16_DOT=True, NATIVE_FP8=True,
                  **(extra_constexprs or {}))
    r = resources(compile_sm90(module._sparse_mla_kernel, types, consts, num_warps=opts["num_warps"]))
    return f"{name:10s} regs {r['REG']} stack {r['STACK']} shared {r['SHARED']} local {r['LOCAL']}"


if __name__ == "__main__":
    names = sys.argv[1:] or list(VARIANTS)
    for n in names:
        print(compile_variant(n, VARIANTS[n]), flush=True)
