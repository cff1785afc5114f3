"""Compile the sparse MLA kernel for sm_90 on any machine (no GPU: Triton's own ptxas) and print
registers, spills and shared memory per plan variant: what a variant costs in registers before
any device time is spent. Usage: python scripts/sm90_resources.py [variant ...]"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from dsv41_decode.ops import sparse_mla as sm

VARIANTS = {
    "bh16_w4": dict(BLOCK_H=16, BLOCK_KEYS=16, num_warps=4),
    "bh16_w8": dict(BLOCK_H=16, BLOCK_KEYS=16, num_warps=8),
    "bh32_w4": dict(BLOCK_H=32, BLOCK_KEYS=16, num_warps=4),
    "bh32_w8": dict(BLOCK_H=32, BLOCK_KEYS=16, num_warps=8),
    "bh64_w8": dict(BLOCK_H=64, BLOCK_KEYS=16, num_warps=8),
}


def compile_variant(name: str, opts: dict, extra_constexprs: dict | None = None, module=sm) -> str:
    fn = module._sparse_mla_kernel
    ptrs = {"q_ptr": "*bf16", "wpool_ptr": "*u8", "cpool_ptr": "*u8", "wtab_ptr": "*i32", "ctab_ptr": "*i32",
            "sink_ptr": "*fp32", "out_ptr": "*i16", "part_acc_ptr": "*fp32", "part_ml_ptr": "*fp32",
            "count_ptr": "*i32"}
    ints = ["H", "zero", "stride_qn", "stride_qh", "stride_wt", "stride_ct", "stride_on", "stride_oh"]
    consts = dict(W=128, KC=512, SPLIT=opts.get("SPLIT", 4), BLOCKS_PER_SPLIT=opts.get("BPS", 10), BLOCK_H=opts["BLOCK_H"],
                  BLOCK_KEYS=opts["BLOCK_KEYS"], BF16_DOT=True, NATIVE_FP8=True, **(extra_constexprs or {}))
    sig = {}
    for a in fn.arg_names:
        if a in ptrs:
            sig[a] = ptrs[a]
        elif a in ints:
            sig[a] = "i32"
        elif a == "scale":
            sig[a] = "fp32"
        elif a in consts:
            sig[a] = "constexpr"
        else:
            sig[a] = "i32"
    div16 = [[i] for i, a in enumerate(fn.arg_names) if a in ptrs or a in ("stride_qn", "stride_qh", "stride_on", "stride_oh")]
    src = ASTSource(fn, sig, {(fn.arg_names.index(k),): v for k, v in consts.items()},
                    {(k[0],): [["tt.divisibility", 16]] for k in div16})
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": opts["num_warps"]})
    with tempfile.TemporaryDirectory() as d:
        cubin = Path(d) / "k.cubin"
        cubin.write_bytes(k.asm["cubin"])
        tool = Path(triton.__file__).parent / "backends/nvidia/bin/cuobjdump"
        res = subprocess.run([str(tool), "--dump-resource-usage", str(cubin)], capture_output=True, text=True).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", res)
    return f"{name:10s} " + (f"regs {m.group(1)} stack {m.group(2)} shared {m.group(3)} local {m.group(4)}" if m else res)


if __name__ == "__main__":
    names = sys.argv[1:] or list(VARIANTS)
    for n in names:
        print(compile_variant(n, VARIANTS[n]), flush=True)
