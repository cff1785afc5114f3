"""Run by tests/ops/test_gluon_indexer.py in a subprocess without the Triton interpreter (the kernel calls
`fp4.bf16_round`, a Triton JIT function that the interpreter would replace), and by hand: compiles
`ops.gluon_indexer`'s kernel for sm_90 in CASES and prints one JSON object per case: its registers,
stack, local memory and shared memory, the opcode counts, the wgmma instructions and waits.
`python tests/ops/_gluon_indexer_sm90.py [heads:page:stages:cand:hist[:maxnreg[:packed[:pairs[:kperm
[:group[:qf[:fold]]]]]]]] ...]` (one case per argument, colon-separated) compiles the given cases instead."""

from __future__ import annotations

import sys

from dsv41_decode.ops import gluon_indexer as GI
from dsv41_decode.testing import sm90

# (heads, page, stages, candidate mask, histogram[, register cap[, packed terms[, wgmma pairs[, key order[, row group[,
# query scales in shared memory[, query fold]]]]]]]): the step's dense call (32 heads, pages of 64) with and without the
# fused histogram in both of the launch's default configurations (`default_options`: four wgmmas in flight at small
# calls; two at a time with the permuted key order, 128 registers uncapped, above), the candidate-restricted call, 64
# heads, the tests' pages of 16, the wgmmas two at a time with the BF16x2 terms (a deeper ring and a cap of 112), the
# permuted key order alone (candidate mode at pages of 16), every option with the histogram; rows scored four at a time
# (`row_group`) in both default configurations, with and without the histogram, and two at a time; the query's powers of
# two and head weights read from shared memory each tile (`qf_smem`) with the wgmmas two at a time and the permuted key
# order, with and without the histogram, with a candidate mask, and with the four wgmmas in flight; the query fold
# (`fold_q`) in both default configurations, with the histogram, with a candidate mask, at 64 heads
CASES = [(32, 64, 4, 0, 0), (32, 64, 4, 0, 1), (32, 64, 4, 1, 0), (64, 64, 4, 0, 0), (32, 16, 4, 0, 0),
         (32, 64, 4, 0, 0, 0, 0, 1, 1), (32, 64, 4, 0, 1, 0, 0, 1, 1), (32, 64, 6, 0, 0, 112, 1, 1),
         (32, 16, 4, 1, 0, 0, 0, 0, 1), (32, 64, 4, 0, 1, 0, 1, 1, 1),
         (32, 64, 4, 0, 0, 0, 0, 1, 1, 4), (32, 64, 4, 0, 1, 0, 0, 1, 1, 4), (32, 64, 4, 0, 1, 0, 0, 0, 0, 4),
         (32, 64, 4, 0, 0, 0, 0, 1, 1, 2),
         (32, 64, 4, 0, 0, 0, 0, 1, 1, 1, 1), (32, 64, 4, 0, 1, 0, 0, 1, 1, 1, 1), (32, 64, 4, 1, 0, 0, 0, 1, 1, 1, 1),
         (32, 64, 4, 0, 0, 0, 0, 0, 0, 1, 1),
         (32, 64, 4, 0, 0, 0, 0, 1, 1, 1, 0, 1), (32, 64, 4, 0, 0, 0, 0, 0, 0, 1, 0, 1),
         (32, 64, 4, 0, 1, 0, 0, 1, 1, 1, 0, 1), (32, 64, 4, 1, 0, 0, 0, 1, 1, 1, 0, 1),
         (64, 64, 4, 0, 0, 0, 0, 1, 1, 1, 0, 1)]
TYPES = {"iq_ptr": "*bf16", "w_ptr": "*bf16", "pool_ptr": "*i32", "bt_ptr": "*i32", "slot_ptr": "*i64",
         "nvis_ptr": "*i32", "cand_ptr": "*u8", "out_ptr": "*fp32", "hist_ptr": "*i32",
         "scratch_ptr": "*i32"}


def compile_case(heads: int, page: int, stages: int, cand: int, hist: int, maxnreg: int = 0, packed: int = 0,
                 pairs: int = 0, kperm: int = 0, group: int = 1, qf: int = 0, fold: int = 0):
    """The kernel as the launcher builds it, compiled for sm_90 (pointers 16-byte divisible)."""
    opts = GI.launch_options(heads, page, stages, bool(cand), bool(hist), maxnreg or None, bool(packed), bool(pairs),
                             bool(kperm), group, bool(qf), bool(fold))
    options = {k: opts.pop(k) for k in ("num_warps", "maxnreg") if k in opts}
    kernel = GI._gluon_index_scores_kernel
    return sm90.compile_sm90(kernel, TYPES, opts, divisible=[a for a in kernel.arg_names if a.endswith("_ptr")],
                             **options)


def measure(heads: int, page: int, stages: int, cand: int = 0, hist: int = 0, maxnreg: int = 0,
            packed: int = 0, pairs: int = 0, kperm: int = 0, group: int = 1, qf: int = 0, fold: int = 0) -> dict:
    case = [heads, page, stages, cand, hist, maxnreg, packed, pairs, kperm]
    while len(case) > 5 and not case[-1]:
        case.pop()
    if group != 1 or qf or fold:
        case += [0] * (9 - len(case)) + [group] + ([qf] if qf or fold else []) + ([fold] if fold else [])
    kernel = compile_case(heads, page, stages, cand, hist, maxnreg, packed, pairs, kperm, group, qf, fold)
    ins = [t for _, t in sm90.sass(kernel)]
    return {"case": case, "maxnreg": maxnreg, "block_h": GI.block_h(heads),
            "shared_limit": GI.shared_bytes(stages, heads, group, bool(qf)), "shared": kernel.metadata.shared,
            **sm90.resources(kernel), "ops": sm90.opcode_counts(ins),
            "loop_ops": sm90.opcode_counts(sm90.main_loop(kernel)),
            "loop_len": len(sm90.main_loop(kernel)), "loop_loads": sm90.load_use_distances(sm90.main_loop(kernel)),
            "gmma": sm90.wgmma_ops(ins), "skips": skipped_runs(kernel),
            "ldgsts": sorted({t.split()[0] for t in ins if t.startswith("LDGSTS")}),
            "waits": sorted({t for t in ins if t.startswith("WARPGROUP.DEPBAR") or t.startswith("LDGDEPBAR")
                             or t.startswith("DEPBAR")})}


def skipped_runs(kernel) -> list[dict]:
    """The opcode counts of the instructions each forward conditional branch jumps over, in order."""
    ins = sm90.sass(kernel)
    at = {a: i for i, (a, _) in enumerate(ins)}
    runs = []
    for i, (a, t) in enumerate(ins):
        if t.startswith("@") and sm90.unpredicated(t).split()[0] == "BRA" and "0x" in t.split()[-1]:
            j = at.get(int(t.split()[-1], 16))
            if j is not None and j > i:
                runs.append(sm90.opcode_counts([x for _, x in ins[i + 1:j]]))
    return runs


def main() -> None:
    sm90.print_cases(measure, CASES, sys.argv[1:])


if __name__ == "__main__":
    main()
