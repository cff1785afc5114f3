"""Run by tests/ops/test_exact_mm.py in a subprocess without the Triton interpreter (the kernel must
be a real JIT function to compile), and by hand: compiles `ops.exact_mm`'s kernel for sm_90 in
the configurations of fused wq_a|wkv's plan at 1 row, wo_b's at 4 rows and its FP32 plan at 1 (a
GPU with slow FP64 takes it), one with a K split, wq_b's plans at 1 and 4 rows with the query-RoPE
epilogue and wo_b's plans at 1 row (FP64 and FP32 sums) with the mHC boundary epilogue (`--tp1`:
the four TP1 shapes' plans at 1, 2 and 4 rows, with FP64 at full rate and slow; `--all`: every real
shape's, TP shards included; or the configurations given as bn:bk:rows:warps:stages[:split[:f64]]
arguments; `--rope` / `--boundary`: those with that epilogue, the boundary's at dim 5120 with the
step's plan and the launcher's register cap) and prints, per configuration, its
registers, stack, local memory and spill instructions, the main loop's instruction mix and the
FP32-pipe instructions (FFMA, FADD, FMUL, HADD2, HFMA2, HMUL2) per weight element and row (with the
boundary the main loop found is the one over row passes, which holds the epilogue; `k_loop`, the
innermost loop, is the one over K). `--json`: one JSON object per line instead."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from dsv41_decode.ops import exact_mm as E
from dsv41_decode.ops import exact_mm_plan as P
from dsv41_decode.ops.mhc import MhcBoundaryPlan
from dsv41_decode.testing.sm90 import compile_sm90, loops, main_loop, opcode_counts, resources, rope_epilogue, sass

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))      # tests/: the loop finder's helpers

# The V4.1-Flash shapes the op serves (N, K), with the TP shards of wq_b and wo_b.
REAL_SHAPES = [(1792, 5120), (32768, 1280), (16384, 1280), (8192, 1280), (4096, 1280),
               (5120, 8192), (5120, 4096), (5120, 2048), (5120, 1024)]
TP1_SHAPES = [(1792, 5120), (32768, 1280), (4096, 1280), (5120, 8192)]
FP32_PIPE = ("FFMA", "FADD", "FMUL", "HADD2", "HFMA2", "HMUL2")
TYPES = {"x_ptr": "*fp8e4nv", "sx_ptr": "*u8", "w_ptr": "*fp8e4nv", "sw_ptr": "*u8", "y_ptr": "*i16",
         "ws_ptr": "*fp32", "cnt_ptr": "*i32"}


# The mHC boundary epilogue's (`exact_mm.boundary_kwargs`) at dim 5120 with the step's plan (chunks
# of 512 columns), or all None; the strides divisible by 16 as the step's buffers give them (the
# mixer's and the plan's rows are 4, 16 and 10 wide).
BOUNDARY_TYPES = {"bx_ptr": "*bf16", "post_ptr": "*fp32", "comb_ptr": "*fp32", "pre_ptr": "*fp32", "nw_ptr": "*bf16",
                  "xo_ptr": "*i16", "u_ptr": "*i16", "codes_ptr": "*u8", "scales_ptr": "*u8", "bws_ptr": "*fp32",
                  "bcnt_ptr": "*i32", "ccnt_ptr": "*i32", "eps": "fp32"}
BOUNDARY_DIVISIBLE = ("stride_bxn", "stride_bxh", "stride_cn", "stride_xon", "stride_xoh", "stride_u", "stride_codes",
                      "stride_scales")
NO_BOUNDARY = dict.fromkeys((*BOUNDARY_TYPES, *BOUNDARY_DIVISIBLE, "stride_post", "stride_ci", "stride_pre",
                             "stride_bws", "stride_ccnt"))


def boundary_consts(cfg: P.ExactConfig, dim: int = 5120, block_d: int = 512) -> dict:
    """The boundary epilogue's constexprs as `exact_mm.boundary_kwargs` sets them."""
    return E.boundary_constexprs(MhcBoundaryPlan.build(dim, 1, "cpu", block_d), cfg.num_warps)


def measure(cfg: P.ExactConfig, rope: bool = False, boundary: bool = False) -> dict:
    fn = E._exact_mm_kernel
    rope_args = rope_epilogue(rope)      # the query-RoPE epilogue's arguments as the plan passes them
    types = {**TYPES, **rope_args.get("types", {}), **(BOUNDARY_TYPES if boundary else {})}
    kernel = compile_sm90(fn, types,
                          dict(BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, ROWS=cfg.rows, OUT_F32=False,
                               SPLIT=cfg.split, STAGES=cfg.num_stages, CHAIN=True, ASM=True, F64=cfg.f64,
                               **rope_args["consts"],
                               **(boundary_consts(cfg) if boundary else NO_BOUNDARY)),
                          # as the launcher sees the real shapes: K and the codes' / weight's / y's
                          # row strides multiples of 16 (M and the scale strides are not specialized)
                          divisible=[a for a in fn.arg_names
                                     if a.endswith("_ptr") or a in ("K", "stride_xm", "stride_wn", "stride_ym")
                                     or boundary and a in BOUNDARY_DIVISIBLE],
                          num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                          # as the launcher compiles the boundary epilogue (`ExactMM.__call__`)
                          **({"enable_fp_fusion": False, "maxnreg": P._BOUNDARY_MAXNREG.get(cfg)} if boundary else {}))
    loop = main_loop(kernel)
    k_loop = min(loops(kernel), key=len)       # the innermost loop: over K
    ops = opcode_counts(loop)
    whole = opcode_counts([t for _, t in sass(kernel)])
    elems = cfg.block_n * cfg.block_k / (32 * cfg.num_warps)     # weight elements per thread per step
    fp32 = sum(ops.get(o, 0) for o in FP32_PIPE)
    ptx = kernel.asm["ptx"]
    return dict(config=cfg.spec,
                rows=cfg.rows, rope=rope, boundary=boundary,
                # the rotation's inline PTX (`kv_write.rope_rotate`: mul.rn / sub.rn / add.rn into its
                # own registers a, b), and no FP32 op that flushes subnormals
                rotation="mul.rn.f32 a," in ptx, ftz=".ftz.f32" in ptx,
                **resources(kernel), loop=len(loop), per_elem_row=round(len(loop) / elems / cfg.rows, 2),
                fp32_per_elem_row=round(fp32 / elems / cfg.rows, 2), LDGSTS=ops.get("LDGSTS", 0),
                dfma_per_elem_row=round(ops.get("DFMA", 0) / elems / cfg.rows, 2),
                k_loop=len(k_loop), k_loop_fp32={o: n for o, n in opcode_counts(k_loop).items() if o in FP32_PIPE},
                spills=whole.get("STL", 0) + whole.get("LDL", 0),
                mul_rn="mul.rn.f32" in ptx, top=dict(list(ops.items())[:14]))


def main() -> None:
    specs = [a for a in sys.argv[1:] if not a.startswith("--")]
    rope, boundary = "--rope" in sys.argv, "--boundary" in sys.argv
    if specs:
        configs = [(P.ExactConfig.from_spec(s), rope, boundary) for s in specs]
    elif "--all" in sys.argv or "--tp1" in sys.argv:
        shapes = REAL_SHAPES if "--all" in sys.argv else TP1_SHAPES
        configs = [(c, rope, boundary)
                   for c in dict.fromkeys(P.planned_config(n, k, b, fp64=f) for n, k in shapes for b in (1, 2, 4)
                                          for f in (True, False))]
    else:   # fused wq_a|wkv's plan at 1 row (FP64 sums, as wo_b's), wo_b's FP32 plan at 1 (where FP64 runs
        # slowly) and its plan at 4 (its registers are the most), a K split;
        # wq_b's plans at 1 and 4 rows with the query RoPE (at 4 rows the most registers with it);
        # wo_b's plans at 1 row (FP64 and FP32 sums) with the mHC boundary epilogue (the step's
        # with fold_boundary)
        configs = [(P.planned_config(1792, 5120, 1, fp64=True), False, False),
                   (P.planned_config(5120, 8192, 1, fp64=False), False, False),
                   (P.planned_config(5120, 8192, 4, fp64=True), False, False),
                   (P.ExactConfig(block_n=8, block_k=1024, rows=2, num_warps=4, num_stages=3, split=2), False, False),
                   (P.planned_config(32768, 1280, 1, fp64=True), True, False),
                   (P.planned_config(32768, 1280, 4, fp64=True), True, False),
                   (P.planned_config(5120, 8192, 1, fp64=True), False, True),
                   (P.planned_config(5120, 8192, 1, fp64=False), False, True)]
    for cfg, with_rope, with_boundary in configs:
        r = measure(cfg, with_rope, with_boundary)
        if "--json" in sys.argv:
            print(json.dumps(r), flush=True)
        else:
            print(f"{r['config']:16s}{' rope' if r['rope'] else ''}{' boundary' if r['boundary'] else ''} "
                  f"REG {r['REG']:3d} STACK {r['STACK']} "
                  f"LOCAL {r['LOCAL']} STL/LDL {r['spills']}  "
                  f"main loop {r['loop']:4d} instructions, {r['per_elem_row']:5.2f} per weight element and row, "
                  f"FP32 pipe {r['fp32_per_elem_row']:5.2f} DFMA {r['dfma_per_elem_row']:4.2f}  {r['top']}", flush=True)


if __name__ == "__main__":
    main()
