"""Run by tests/ops/test_exact_f64_mm.py in a subprocess without the Triton interpreter (the kernel
must be a real JIT function to compile), and by hand: compiles `ops.exact_f64_mm`'s kernel for
sm_90 in the plans' default configurations (`_DEFAULT_CONFIGS`), other tile shapes and a K split and prints per
configuration its registers, stack, local memory, spill instructions, main-loop length and its FP64
MMA (DMMA) instructions. Arguments "block_n:block_m:num_warps:num_stages:split" pick the
configurations instead; `--json`: one JSON object per line.
"""

from __future__ import annotations

import json
import sys

from dsv41_decode.ops import exact_f64_mm as E
from dsv41_decode.testing.sm90 import compile_sm90, main_loop, opcode_counts, resources, sass

CONFIGS = [c for _, c in E._DEFAULT_CONFIGS] + [E.F64Config(block_n=128, block_m=16),
           E.F64Config(block_n=32, block_m=8, num_warps=2, split=4)]


def measure(cfg: E.F64Config) -> dict:
    fn = E._exact_f64_mm_kernel
    types = {"x_ptr": "*i64", "sx_ptr": "*u8", "w_ptr": "*i64", "sw_ptr": "*u8", "y_ptr": "*i16",
             "ws_ptr": "*fp32", "cnt_ptr": "*i32"}
    kernel = compile_sm90(fn, types, dict(BLOCK_N=cfg.block_n, BLOCK_M=cfg.block_m, OUT_F32=False,
                                          STAGES=cfg.num_stages, ASM=True, SPLIT=cfg.split),
                          divisible=[a for a in fn.arg_names if a.endswith("_ptr") or a == "K"],
                          num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    whole = opcode_counts([t for _, t in sass(kernel)])
    loop = main_loop(kernel)
    return dict(config=str(cfg), **resources(kernel), loop=len(loop), dmma=whole.get("DMMA", 0),
                loop_dmma=opcode_counts(loop).get("DMMA", 0), spills=whole.get("STL", 0) + whole.get("LDL", 0),
                mul_rn="mul.rn.f32" in kernel.asm["ptx"], cvt_rn="cvt.rn.f32.f64" in kernel.asm["ptx"])


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    configs = [E.F64Config(*map(int, a.split(":"))) for a in args] or CONFIGS
    for cfg in configs:
        r = measure(cfg)
        if "--json" in sys.argv:
            print(json.dumps(r), flush=True)
        else:
            print(f"{r['config']}: REG {r['REG']} STACK {r['STACK']} LOCAL {r['LOCAL']} STL/LDL {r['spills']} "
                  f"SHARED {r['SHARED']} main loop {r['loop']} instructions, DMMA {r['dmma']} "
                  f"({r['loop_dmma']} in the loop)", flush=True)


if __name__ == "__main__":
    main()
