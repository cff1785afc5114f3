"""Run by tests/ops/test_compressor_tail.py in a subprocess without the Triton interpreter (the kernel
must be a real JIT function to compile), and by hand: compiles `ops.compressor_tail`'s kernel for
sm_90 with the step's GPU plan (ll_bf16's default tiles for wk: 32 outputs per N tile, one tile
program each, the row's last arriver writing the index key; K steps of 128; 4 warps) at
its two row tiles (BLOCK_M 16: 1-16 rows, 32: 17-64) for an FP32 input and at 16 for a BF16 one,
and the three kernels it fuses (`rms_norm_`'s at D = 512, `ll_bf16_`'s with that plan and row tile,
`compressed_entry_store_`'s), and prints per fused case one JSON object: registers, stack, shared
and local memory, spill instructions (STL/LDL), its atomics and `.cg` loads (PTX), its MMA
instructions and layouts, and its FP32 add reductions (shape and layout, in order); then one
object of the same MMA and reduction facts of the three kernels."""

from __future__ import annotations

import json
import re

import torch

from dsv41_decode.ops import compressor_tail, kv_write, ll_bf16, rms_norm
from dsv41_decode.testing.sm90 import compile_sm90, opcode_counts, resources, sass

TYPES = {"nw_ptr": "*bf16", "lat_ptr": "*i16", "w_ptr": "*bf16", "wk_out_ptr": "*fp32", "knw_ptr": "*bf16",
         "cos_ptr": "*fp32", "sin_ptr": "*fp32", "slots_ptr": "*i64", "ckv_ptr": "*u8", "ik_ptr": "*u8",
         "cnt_ptr": "*i32", "eps": "fp32"}
CASES = (("*fp32", 16), ("*fp32", 64), ("*bf16", 16))   # (c's type, rows of the plan's tile)


def facts(kernel) -> dict:
    """MMA instructions (SASS), MMA layouts and the FP32 add reductions as (shape, layout) (TTGIR)."""
    ttgir = kernel.asm["ttgir"]
    layouts = dict(re.findall(r"^(#\w+) = (#ttg\.[^\n]*)$", ttgir, re.M))
    lines = ttgir.splitlines()
    adds = []
    for i, line in enumerate(lines):
        if '"tt.reduce"' not in line:
            continue
        end = next(i + j for j, s in enumerate(lines[i:]) if s.strip().startswith("})"))
        if any("arith.addf" in s for s in lines[i:end]):
            shape, lay = re.search(r"\(tensor<([^,]*), (#\w+)>\)", lines[end]).groups()
            adds.append([shape, layouts[lay]])
    mma = sorted({t.split()[0] for _, t in sass(kernel) if "MMA" in t.split()[0]})
    return dict(mma=mma, mma_layouts=sorted(set(re.findall(r"#ttg\.nvidia_mma<[^>]*>", ttgir))), adds=adds)


def fused(c_type: str, rows: int) -> dict:
    tile = ll_bf16._tile_for(rows, torch.bfloat16)
    kernel = compile_sm90(compressor_tail._compressor_tail_kernel, {**TYPES, "c_ptr": c_type},
                          dict(ROUND_IN=c_type == "*fp32", BLOCK_M=tile.block_m, BLOCK_N=32, BLOCK_K=tile.block_k),
                          num_warps=4, enable_fp_fusion=False)
    res = resources(kernel)
    ops = opcode_counts([t for _, t in sass(kernel)])
    ptx = kernel.asm["ptx"]
    return dict(name=f"fused c {c_type} BLOCK_M {tile.block_m}", **res, spills=ops.get("STL", 0) + ops.get("LDL", 0),
                atomics=re.findall(r"atom\.[\w.]+", ptx), cg_loads=len(re.findall(r"ld\.global\.cg", ptx)),
                **facts(kernel))


def apart(c_type: str, rows: int) -> dict:
    tile = ll_bf16._tile_for(rows, torch.bfloat16)
    norm = compile_sm90(rms_norm._rms_norm_kernel, {"x_ptr": c_type, "w_ptr": "*bf16", "out_ptr": "*i16",
                                                    "codes_ptr": "*i16", "scales_ptr": "*i16", "eps": "fp32"},
                        dict(D=512, BLOCK=512, ROUND_IN=c_type == "*fp32", QUANT=False), num_warps=4,
                        enable_fp_fusion=False)
    mm = compile_sm90(ll_bf16._ll_bf16_kernel, {"x_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*fp32",
                                                "part_ptr": "*fp32", "count_ptr": "*i32", "scale": "fp32"},
                      dict(K_PER_SPLIT=512, SPLIT=1, GROUP=1, BLOCK_M=tile.block_m, BLOCK_N=32, BLOCK_K=tile.block_k,
                           MODE=tile.mode, NUM_STAGES=tile.num_stages, HEAD_W=False),
                      num_warps=tile.num_warps, num_stages=tile.num_stages)
    entry = compile_sm90(kv_write._compressed_entry_kernel,
                         {"lat_ptr": "*bf16", "wk_ptr": "*fp32", "knw_ptr": "*bf16", "cos_ptr": "*fp32",
                          "sin_ptr": "*fp32", "slots_ptr": "*i64", "ckv_ptr": "*u8", "ik_ptr": "*u8", "eps": "fp32"},
                         dict(DO_CKV=True, DO_IK=True, IK_PID=1, REQUANT=False), num_warps=4, enable_fp_fusion=False)
    n, m, e = facts(norm), facts(mm), facts(entry)
    return dict(name=f"apart c {c_type} BLOCK_M {tile.block_m}", mma=m["mma"], mma_layouts=m["mma_layouts"], adds=n["adds"] + e["adds"])


def main() -> None:
    for c_type, rows in CASES:
        print(json.dumps(fused(c_type, rows)), flush=True)
        print(json.dumps(apart(c_type, rows)), flush=True)


if __name__ == "__main__":
    main()
