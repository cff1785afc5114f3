"""Run by tests/ops/test_exact_mm.py in a subprocess without the Triton interpreter (the kernel must
be a real JIT function to compile), and by hand: compiles `ops.exact_mm`'s kernel for sm_90 in
the configurations of fused wq_a|wkv's plan at 1 row and wo_b's at 4 rows, one with a K split,
and wq_b's plans at 1 and 4 rows with the query-RoPE epilogue (`--tp1`: the four
TP1 shapes' plans at 1, 2 and 4 rows; `--all`: every real shape's, TP shards included; or the
configurations given as bn:bk:rows:warps:stages[:split] arguments; `--rope`: those with the
epilogue) and prints, per configuration, its
registers, stack, local memory and spill instructions, the main loop's instruction mix and the
FP32-pipe instructions (FFMA, FADD, FMUL, HADD2, HFMA2, HMUL2) per weight element and row.
`--json`: one JSON object per line instead."""

from __future__ import annotations

import json
import sys

from dsv41_decode.ops import exact_mm as E
from dsv41_decode.testing.sm90 import compile_sm90, main_loop, opcode_counts, resources, sass

# The V4.1-Flash shapes the op serves (N, K), with the TP shards of wq_b and wo_b.
REAL_SHAPES = [(1792, 5120), (32768, 1280), (16384, 1280), (8192, 1280), (4096, 1280),
               (5120, 8192), (5120, 4096), (5120, 2048), (5120, 1024)]
TP1_SHAPES = [(1792, 5120), (32768, 1280), (4096, 1280), (5120, 8192)]
FP32_PIPE = ("FFMA", "FADD", "FMUL", "HADD2", "HFMA2", "HMUL2")
TYPES = {"x_ptr": "*fp8e4nv", "sx_ptr": "*u8", "w_ptr": "*fp8e4nv", "sw_ptr": "*u8", "y_ptr": "*i16",
         "ws_ptr": "*fp32", "cnt_ptr": "*i32"}


# The query-RoPE epilogue's arguments as the plan passes them (`exact_mm.rope_kwargs`): FP32 cos/sin
# pointers with their row strides, or all four None (constexprs: no kernel parameter).
ROPE_TYPES = {"cos_ptr": "*fp32", "sin_ptr": "*fp32"}
NO_ROPE = dict.fromkeys(("cos_ptr", "sin_ptr", "stride_cm", "stride_sm"))


def measure(cfg: E.ExactConfig, rope: bool = False) -> dict:
    fn = E._exact_mm_kernel
    kernel = compile_sm90(fn, {**TYPES, **ROPE_TYPES} if rope else TYPES,
                          dict(BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, ROWS=cfg.rows, OUT_F32=False,
                               SPLIT=cfg.split, STAGES=cfg.num_stages, CHAIN=True, ASM=True,
                               **({"ROPE": True} if rope else NO_ROPE)),
                          # as the launcher sees the real shapes: K and the codes' / weight's / y's
                          # row strides multiples of 16 (M and the scale strides are not specialized)
                          divisible=[a for a in fn.arg_names
                                     if a.endswith("_ptr") or a in ("K", "stride_xm", "stride_wn", "stride_ym")],
                          num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    loop = main_loop(kernel)
    ops = opcode_counts(loop)
    whole = opcode_counts([t for _, t in sass(kernel)])
    elems = cfg.block_n * cfg.block_k / (32 * cfg.num_warps)     # weight elements per thread per step
    fp32 = sum(ops.get(o, 0) for o in FP32_PIPE)
    ptx = kernel.asm["ptx"]
    return dict(config=f"{cfg.block_n}:{cfg.block_k}:{cfg.rows}:{cfg.num_warps}:{cfg.num_stages}:{cfg.split}",
                rows=cfg.rows, rope=rope,
                # the rotation's inline PTX (`kv_write.rope_rotate`: mul.rn / sub.rn / add.rn into its
                # own registers a, b), and no FP32 op that flushes subnormals
                rotation="mul.rn.f32 a," in ptx, ftz=".ftz.f32" in ptx,
                **resources(kernel), loop=len(loop), per_elem_row=round(len(loop) / elems / cfg.rows, 2),
                fp32_per_elem_row=round(fp32 / elems / cfg.rows, 2), LDGSTS=ops.get("LDGSTS", 0),
                spills=whole.get("STL", 0) + whole.get("LDL", 0),
                mul_rn="mul.rn.f32" in ptx, top=dict(list(ops.items())[:14]))


def main() -> None:
    specs = [a for a in sys.argv[1:] if not a.startswith("--")]
    rope = "--rope" in sys.argv
    if specs:
        configs = [(E.ExactConfig(*(int(v) for v in s.split(":"))), rope) for s in specs]
    elif "--all" in sys.argv or "--tp1" in sys.argv:
        shapes = REAL_SHAPES if "--all" in sys.argv else TP1_SHAPES
        configs = [(c, rope) for c in dict.fromkeys(E.planned_config(n, k, b) for n, k in shapes for b in (1, 2, 4))]
    else:   # fused wq_a|wkv's plan at 1 row, wo_b's at 4 (its registers are the most), a K split;
        # wq_b's plans at 1 and 4 rows with the query RoPE (at 4 rows the most registers with it)
        configs = [(E.planned_config(1792, 5120, 1), False), (E.planned_config(5120, 8192, 4), False),
                   (E.ExactConfig(block_n=8, block_k=1024, rows=2, num_warps=4, num_stages=3, split=2), False),
                   (E.planned_config(32768, 1280, 1), True), (E.planned_config(32768, 1280, 4), True)]
    for cfg, with_rope in configs:
        r = measure(cfg, with_rope)
        if "--json" in sys.argv:
            print(json.dumps(r), flush=True)
        else:
            print(f"{r['config']:16s}{' rope' if r['rope'] else ''} REG {r['REG']:3d} STACK {r['STACK']} "
                  f"LOCAL {r['LOCAL']} STL/LDL {r['spills']}  "
                  f"main loop {r['loop']:4d} instructions, {r['per_elem_row']:5.2f} per weight element and row, "
                  f"FP32 pipe {r['fp32_per_elem_row']:5.2f}  {r['top']}", flush=True)


if __name__ == "__main__":
    main()
