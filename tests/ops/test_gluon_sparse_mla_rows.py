"""ops.gluon_sparse_mla_rows, the first launch of the sparse MLA's combination "pv" with one program
per row (`GluonSparseMlaConfig(scores="rows")`; sm_90 only).

On the CPU: the kernel compiles for sm_90 (Triton's own ptxas) at every TP shard's head count, a
window ending inside a block and a single block, without spills, one program an SM by its shared
memory and registers; it holds the scores' wgmmas (m64 n32 per warpgroup, 512 / 16 steps) and none
of P.V's, copies the next block's codes by cp.async inside its loop over the blocks, and takes no
ticket (no atomics); the configuration's errors name the option. On the GPU the configuration is one
of `tests/ops/test_gluon_sparse_mla.py`'s (ROWS): the same bits as every other configuration on
every row (P and the statistics are the block programs'), against the reference, run to run, the
workspace clear after each launch.
"""

import pytest

from dsv41_decode.ops import gluon_sparse_mla as G
from dsv41_decode.testing import sm90

# 228 KB of shared memory and 64K registers an SM, 1 KB reserved per program
SM_SHARED, SM_REGS = 228 * 1024, 65536


@pytest.mark.parametrize("heads,w,k", [(64, 128, 512), (32, 128, 512), (16, 128, 512), (8, 128, 512), (64, 16, 72),
                                       (16, 16, 8)],
                         ids=["64h", "32h", "16h", "8h", "64h-mix", "16h-one-block"])
def test_row_scores_compile_for_sm90_one_program_an_sm(heads, w, k):
    nb = G.GluonSparseMlaPlan.build(1, heads, w, k, "cpu").base.n_blocks
    kernel = sm90.compile_mla_row_scores(heads, w, k)
    res = sm90.resources(kernel)
    assert res["LOCAL"] == 0 and res["STACK"] == 0, res
    # q and the decoded keys (four [64, 128] BF16 chunks each), the codes' slot (window 32 KB,
    # compressed 16 KB) and the blocks' slots
    assert kernel.metadata.shared + 1024 <= SM_SHARED < 2 * (kernel.metadata.shared + 1024), kernel.metadata.shared
    assert res["REG"] * 32 * G.NUM_WARPS <= SM_REGS, res
    ins = [t for _, t in sm90.sass(kernel)]
    gmma = [t.split()[0] for t in ins if "GMMA" in t]
    assert gmma == ["HGMMA.64x32x16.F32.BF16"] * 32, sorted(set(gmma))
    ops = sm90.opcode_counts(ins)
    assert ops.get("ATOMG", 0) == 0 and ops.get("RED", 0) == 0, ops
    loops = [loop for loop in sm90.loops(kernel) if any("HGMMA" in t for t in loop)]
    if nb > 1:
        (loop, ) = loops
        assert any("LDGSTS" in t for t in loop), "no cp.async in the blocks' loop"
    assert any("LDGSTS" in t for t in ins), "no cp.async"


def test_config_errors_name_the_option():
    for bad in ("block", "row", "", None, True):
        with pytest.raises(ValueError, match="scores"):
            G.GluonSparseMlaConfig(combine="pv", fp4_lut=True, scores=bad)
    for combine in ("separate", "spread"):
        with pytest.raises(ValueError, match="scores='rows'"):
            G.GluonSparseMlaConfig(combine=combine, fp4_lut=True, scores="rows")
    with pytest.raises(ValueError, match="fp4_lut"):
        G.GluonSparseMlaConfig(combine="pv", scores="rows")
    assert G.GluonSparseMlaConfig(combine="pv", fp4_lut=True, scores="rows").scores == "rows"
    assert G.GluonSparseMlaConfig().scores == "blocks"
