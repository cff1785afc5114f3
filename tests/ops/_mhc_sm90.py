"""Run by tests/ops/test_mhc.py in a subprocess without the Triton interpreter (the kernel must be a
real JIT function to compile), and by hand: compiles `ops.mhc`'s co-resident boundary kernel and the
split one for sm_90 at dim 5120 with the step's plan (chunks of 512 columns, 4 warps) and prints,
per kernel, one JSON object: registers, stack, shared and local memory, spill instructions (STL/LDL)
and the programs an H200 SM holds at once by registers, threads and shared memory."""

from __future__ import annotations

import json

from dsv41_decode.ops import mhc
from dsv41_decode.testing.sm90 import compile_sm90, opcode_counts, resources, sass

TYPES = {"y_ptr": "*bf16", "x_ptr": "*bf16", "post_ptr": "*fp32", "comb_ptr": "*fp32", "pre_ptr": "*fp32",
         "w_ptr": "*bf16", "xo_ptr": "*i16", "u_ptr": "*i16", "codes_ptr": "*u8", "scales_ptr": "*u8",
         "ws_ptr": "*fp32", "cnt_ptr": "*i32", "eps": "fp32"}
# the step's buffers: the streams' and outputs' rows 16-divisible; the mixer's rows (4, 16 wide)
# and the plan's workspace row (10 wide) as the launcher finds them
DIVISIBLE = ("stride_y", "stride_xn", "stride_xh", "stride_cn", "stride_xon", "stride_xoh", "stride_u",
             "stride_codes", "stride_scales")
DIM, BLOCK_D, WARPS = 5120, 512, 4


def programs_per_sm(res: dict) -> int:
    """Programs of WARPS warps an H200 SM holds at once: 64K registers (allocated 8 a thread at a
    time), 2048 threads, 228 KB of shared memory (1 KB of it reserved per program), 32 programs."""
    regs = -(-res["REG"] // 8) * 8 * WARPS * 32
    return min(65536 // regs, 2048 // (WARPS * 32), 228 * 1024 // (res["SHARED"] + 1024), 32)


def row(name: str, fn, consts: dict) -> dict:
    divisible = [a for a in fn.arg_names if TYPES.get(a, "").startswith("*") or a in DIVISIBLE]
    kernel = compile_sm90(fn, TYPES, dict(D=DIM, BLOCK_D=BLOCK_D, NCH=DIM // BLOCK_D, NCH_P2=16, **consts),
                          divisible=divisible, num_warps=WARPS, enable_fp_fusion=False)
    res = resources(kernel)
    ops = opcode_counts([t for _, t in sass(kernel)])
    return dict(name=name, **res, spills=ops.get("STL", 0) + ops.get("LDL", 0), per_sm=programs_per_sm(res))


def main() -> None:
    for r in (row("coresident", mhc._mhc_boundary_coresident_kernel, {}),
              row("split", mhc._mhc_boundary_split_kernel, dict(BLOCK_N=1024))):
        print(json.dumps(r), flush=True)


if __name__ == "__main__":
    main()
