"""Run by tests/ops/test_exact_int8_mm.py in a subprocess without the Triton interpreter (the kernel
must be a real JIT function to compile), and by hand: compiles `ops.exact_int8_mm`'s kernels for
sm_90 in the measured configurations of wq_b at 16 rows (x rows on the MMA's N side) and 64 rows (on
its M side) and of wo_b at 64 rows (`--all`: every measured configuration), with the weight's digit
planes as the plans read them, and prints per configuration its registers, stack, local memory,
spill instructions, main-loop length and integer MMA instructions. `--json`: one JSON object per line.
"""

from __future__ import annotations

import json
import sys

from dsv41_decode.ops import exact_int8_mm as E
from dsv41_decode.testing.sm90 import compile_sm90, main_loop, opcode_counts, resources, sass

TYPES = {"x_ptr": "*u8", "sx_ptr": "*u8", "w_ptr": "*i8", "sw_ptr": "*u8", "y_ptr": "*i16"}


def measure(cfg: E.Int8Config) -> dict:
    fn = E._exact_int8_mm_tm_kernel if cfg.tokens_m else E._exact_int8_mm_kernel
    kernel = compile_sm90(fn, TYPES, dict(BLOCK_N=cfg.block_n, BLOCK_M=cfg.block_m, OUT_F32=False,
                                          STAGES=cfg.num_stages, ASM=True, DIGITS=True),
                          divisible=[a for a in fn.arg_names
                                     if a.endswith("_ptr") or a in ("K", "stride_xm", "stride_wn", "stride_ym")],
                          num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    whole = opcode_counts([t for _, t in sass(kernel)])
    return dict(config=str(cfg), **resources(kernel), loop=len(main_loop(kernel)),
                int_mma=whole.get("IGMMA", 0) + whole.get("IMMA", 0),
                spills=whole.get("STL", 0) + whole.get("LDL", 0), mul_rn="mul.rn.f32" in kernel.asm["ptx"])


def main() -> None:
    if "--all" in sys.argv:
        configs = list(dict.fromkeys(c for _, tiles in E._TUNED.values() for c in tiles.values()))
    else:
        configs = [E.planned_config(32768, 1280, 16), E.planned_config(32768, 1280, 64),
                   E.planned_config(5120, 8192, 64)]
    for cfg in configs:
        r = measure(cfg)
        if "--json" in sys.argv:
            print(json.dumps(r), flush=True)
        else:
            print(f"{r['config']}: REG {r['REG']} STACK {r['STACK']} LOCAL {r['LOCAL']} STL/LDL {r['spills']} "
                  f"main loop {r['loop']} instructions, integer MMA {r['int_mma']}", flush=True)


if __name__ == "__main__":
    main()
