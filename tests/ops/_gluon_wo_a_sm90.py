"""Run by tests/ops/test_gluon_wo_a.py in a subprocess without the Triton interpreter (the kernel calls
`act_quant.mxfp8_quantize_tile`, a Triton JIT function that the interpreter would replace), and by
hand: compiles `ops.gluon_wo_a`'s kernel for sm_90 at the real shapes' plans (CASES: each TP
shard's split, each row bucket, one- and two-warpgroup programs), with the step's call (the fused
MXFP8 of z and the window copy of 528-byte records), and prints one JSON object per case: its
registers, stack, local memory and shared memory, the opcode counts, the wgmma instructions, the
writes to an in-flight wgmma's register operand (`sm90.wgmma_register_hazards`), the wgmma waits
and the plan's split, steps per program and register cap. `python tests/ops/_gluon_wo_a_sm90.py
[heads:bt:warpgroups[:split[:fp8[:pdl[:release[:prefill[:gate]]]]]] ...]` compiles the given cases instead (fp8: 0
BF16, 1 FP8 block partials, 2 FP8 folded, 3 FP8 folded with `fold_bits`, 4 that in the step's ring of
`decode.attention.FP8_WO_A_STAGES` slots; pdl: 1 for the launch by programmatic dependent launch;
release: 1 for the release of a PDL successor after the main loop; prefill: with pdl, the slots requested before
the wait, `GluonWoAConfig.prefill`, 0 for all; gate: 1 for the gate after those slots, `gluon_wo_a_(gate=)`)."""

from __future__ import annotations

import sys

import torch
from triton.experimental.gluon import language as gl

from dsv41_decode.decode.attention import FP8_WO_A_STAGES
from dsv41_decode.ops import gluon_wo_a as W
from dsv41_decode.testing import sm90

RANK = 1024   # o_lora_rank of V4.1; 8 heads per group
# (heads, row bucket, warpgroups, split or 0 for the plan's, weight: 0 BF16, 1 FP8 with the
# block-partial consumer, 2 FP8 with the folded consumer, 3 the folded consumer's bit conversion,
# `fold_bits`, 4 that in the step's ring of `FP8_WO_A_STAGES` slots): BF16 at TP1, 2, 4, 8 (splits 2, 4, 8,
# 16), each bucket once, 128-row programs once, the epilogue without split-K once; FP8 block
# partials at its tightest bucket with one and two warpgroups, and at 1 row; FP8 folded at every
# bucket (TP1..8) and with two warpgroups; its bit conversion at every bucket, and in the step's ring
# at the smallest and the largest bucket; a sixth field 1: the launch by programmatic dependent launch
# (`gluon_wo_a_(pdl=True)`), BF16 at 1 row and the folded FP8 consumer in the step's ring at 64; a
# seventh field 1: the release of a successor after the main loop (`release=True`), with the PDL launch;
# an eighth: the slots requested before the PDL wait (`GluonWoAConfig.prefill`), one (BF16) and two (the
# folded FP8 consumer in the step's ring, with the release) at 1 row; a ninth: the gate after them
# (`gluon_wo_a_(gate=)`), BF16 at 1 row after one slot and the folded FP8 consumer in the step's ring
# at 64 rows after two, with the release
CASES = [(64, 8, 1, 0, 0, 1, 0, 1, 1), (64, 64, 1, 0, 4, 1, 1, 2, 1),
         (64, 8, 1, 0, 0, 1), (64, 64, 1, 0, 4, 1), (64, 16, 1, 0, 0, 1, 1), (64, 8, 1, 0, 0, 1, 0, 1),
         (64, 8, 1, 0, 4, 1, 1, 2), (64, 8, 1, 0, 0), (32, 16, 1, 0, 0), (16, 32, 1, 0, 0), (8, 64, 1, 0, 0), (64, 64, 2, 0, 0),
         (8, 16, 1, 1, 0), (64, 8, 1, 0, 1), (16, 64, 1, 0, 1), (64, 64, 2, 0, 1),
         (64, 8, 1, 0, 2), (32, 16, 1, 0, 2), (16, 32, 1, 0, 2), (8, 64, 1, 0, 2), (64, 64, 2, 0, 2),
         (64, 8, 1, 0, 3), (32, 16, 1, 0, 3), (16, 32, 1, 0, 3), (8, 64, 1, 0, 3),
         (64, 8, 1, 0, 4), (64, 64, 1, 0, 4)]
COPY_WORDS = 132   # the window record: 528 bytes


def _desc(block, fp8: bool = False) -> str:
    """The signature of a Gluon TMA descriptor of BF16 (or E4M3) tiles `block`, as the launcher
    specializes it."""
    layout = gl.NVMMASharedLayout.get_default_for(block, gl.float8e4nv if fp8 else gl.bfloat16)
    return f"tensordesc<{'fp8e4nv' if fp8 else 'bf16'}[{block[0]}, {block[1]}],{layout!r}>"


def compile_case(plan: W.GluonWoAPlan, bt: int, quant: bool = True, copy_words: int = COPY_WORDS, pdl: bool = False,
                 release: bool = False, gate: bool = False):
    """The kernel of `plan`'s launch at row bucket `bt`, compiled for sm_90 as the launcher would."""
    opts = W.launch_options(plan, bt, pdl, release, gate)
    opts.pop("launch_pdl", None)                       # a launch option, not the compiler's
    options = {k: opts.pop(k) for k in ("num_warps", "maxnreg", "enable_fp_fusion")}
    w_block = [plan.config.block_n, W.BLOCK_K]
    types = {"w_desc": _desc(w_block, plan.fp8), "x_desc": _desc([bt, W.BLOCK_K]),
             "cos_ptr": "*fp32", "sin_ptr": "*fp32", "s_ptr": "*u8" if plan.fp8 else "*i32", "z_ptr": "*bf16", "ws_ptr": "*fp32", "cnt_ptr": "*i32",
             "codes_ptr": "*u8", "scales_ptr": "*u8", "cp_pool_ptr": "*i32", "cp_src_ptr": "*i64",
             "cp_dst_ptr": "*i64", "gate_ptr": "*i32"}
    consts = {**opts, "QUANT": quant, "COPY_WORDS": copy_words,
              "COPY_BLOCK": max(32, 1 << (max(copy_words, 1) - 1).bit_length()), "N_TILES": plan.n_tiles}
    kernel = W._gluon_wo_a_kernel
    # as the launcher sees the real shapes: pointers and the outputs' row strides multiples of 16
    return sm90.compile_sm90(kernel, types, consts,
                             divisible=[a for a in kernel.arg_names
                                        if a.endswith("_ptr") or a in ("stride_zm", "stride_codes", "stride_sn")],
                             **options)


def measure(heads: int, bt: int, wg: int, split: int = 0, fp8: int = 0, pdl: int = 0, release: int = 0,
            prefill: int = 0, gate: int = 0) -> dict:
    config = W.GluonWoAConfig(warpgroups=wg, split=split or None, fold_scales=fp8 >= 2, fold_bits=fp8 >= 3,
                              prefill=prefill or None, **({"stages": FP8_WO_A_STAGES} if fp8 == 4 else {}))
    dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
    plan = W.GluonWoAPlan.build(heads, heads // 8, RANK, 64, dtype, "cpu", config=config)
    kernel = compile_case(plan, bt, pdl=bool(pdl), release=bool(release), gate=bool(gate))
    ins = [t for _, t in sm90.sass(kernel)]
    ptx = kernel.asm["ptx"]
    # by PDL: what the kernel does before its first griddepcontrol.wait (`sm90.pdl_prologue`)
    prologue = sm90.pdl_prologue(ptx) if "griddepcontrol.wait" in ptx else None
    # with the gate: the weight tiles requested before its first poll
    body = ptx[ptx.index(".entry"):]
    before_gate = body.count("cp.async.bulk.tensor", 0, body.index("ld.volatile.global")) if gate else None
    # the release: its PTX lines after the last wgmma (the main loop's), -1 if none
    lines = ptx.split("\n")
    marks = [i for i, line in enumerate(lines) if "griddepcontrol.launch_dependents" in line]
    last_mma = max((i for i, line in enumerate(lines) if "wgmma.mma_async" in line), default=-1)
    case = [heads, bt, wg, split, fp8] + ([pdl, release, prefill, gate] if gate else [pdl, release, prefill] if prefill
                                         else [pdl, release] if release else [pdl] if pdl else [])
    return {"case": case, "bt": bt, "stages": plan.config.stages, "prefill": prefill, "gate": gate,
            "before_gate": before_gate,
            "releases": len(marks),
            "released_after_loop": bool(marks) and marks[0] > last_mma,
            "pdl_prologue": prologue, "split": plan.split, "n_tiles": plan.n_tiles,
            "steps": plan.k_per_split // W.BLOCK_K, "maxnreg": W.register_cap(plan.config, bt, plan.fp8),
            "shared_limit": W.shared_bytes(plan.config, bt, plan.fp8), "shared": kernel.metadata.shared,
            **sm90.resources(kernel), "ops": sm90.opcode_counts(ins),
            "gmma": sm90.wgmma_ops(ins), "a_hazards": sm90.wgmma_register_hazards(kernel),
            "waits": sorted({t for t in ins if t.startswith("WARPGROUP.DEPBAR")})}


def main() -> None:
    sm90.print_cases(measure, CASES, sys.argv[1:])


if __name__ == "__main__":
    main()
