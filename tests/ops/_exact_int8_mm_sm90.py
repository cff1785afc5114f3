"""Run by tests/ops/test_exact_int8_mm.py in a subprocess without the Triton interpreter (the kernel
must be a real JIT function to compile), and by hand: compiles `ops.exact_int8_mm`'s kernel for
sm_90 in the plans' configurations (`Int8Config()`, and `pairs` at 32 and 64 weight rows, 3 and 4
stages: `_INT8_PLAN`) with the weight's digit planes, with its codes decoded in the kernel, and
with 64 x rows per program (wgmma), and prints per configuration its
registers, stack, local memory, spill instructions, main-loop length and integer MMA instructions.
`--json`: one JSON object per line.
"""

from __future__ import annotations

import json
import sys

from dsv41_decode.ops import exact_int8_mm as E
from dsv41_decode.testing.sm90 import compile_sm90, main_loop, opcode_counts, resources, sass



def measure(cfg: E.Int8Config, digits: bool) -> dict:
    fn = E._exact_int8_mm_kernel
    types = {"x_ptr": "*u8", "sx_ptr": "*u8", "w_ptr": "*i8" if digits else "*u8", "sw_ptr": "*u8", "y_ptr": "*i16"}
    kernel = compile_sm90(fn, types, dict(BLOCK_N=cfg.block_n, BLOCK_M=cfg.block_m, OUT_F32=False,
                                          STAGES=cfg.num_stages, ASM=True, DIGITS=digits, PAIRS=cfg.pairs),
                          divisible=[a for a in fn.arg_names
                                     if a.endswith("_ptr") or a in ("K", "stride_xm", "stride_wn", "stride_ym")],
                          num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    whole = opcode_counts([t for _, t in sass(kernel)])
    return dict(config=f"{cfg} digits={digits}", **resources(kernel), loop=len(main_loop(kernel)),
                int_mma=whole.get("IGMMA", 0) + whole.get("IMMA", 0),
                spills=whole.get("STL", 0) + whole.get("LDL", 0), mul_rn="mul.rn.f32" in kernel.asm["ptx"])


def main() -> None:
    planned = {c for _, table in E._INT8_PLAN.values() for c in table.values()}
    configs = [(E.Int8Config(), False), (E.Int8Config(block_n=32, block_m=64), True)]
    configs += [(c, True) for c in sorted(planned | {E.Int8Config()}, key=str)]
    for cfg, digits in configs:
        r = measure(cfg, digits)
        if "--json" in sys.argv:
            print(json.dumps(r), flush=True)
        else:
            print(f"{r['config']}: REG {r['REG']} STACK {r['STACK']} LOCAL {r['LOCAL']} STL/LDL {r['spills']} "
                  f"main loop {r['loop']} instructions, integer MMA {r['int_mma']}", flush=True)


if __name__ == "__main__":
    main()
