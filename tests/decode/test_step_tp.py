"""The specialized step under tensor parallelism on the CPU: 2 or 4 gloo processes, eager, interpreter.

TP2: each rank runs its 8 of 16 heads and 2 of 4 wo_a groups over every layer kind; TP4 (the
4-rank layout): 8 of 32 heads and 1 of 4 groups over the indexer layers (`LAYERS`). Each reduces wo_b's FP32 partials through
`TensorParallel.reduce_partials` (the collective fallback boundary). The Full layers' dense
indexers run row-sharded (`indexer_shard_rows` forced to 1): each rank scores its `row_share` of
3 rows (shares 2 + 1 at TP2: a full share and a short one; 1 + 1 + 1 + 0 at TP4: an empty one) and
the ranks gather the top-k and the candidate pool, which the Reindex layer then reads. Against the one-rank step on the same inputs
(run on rank 0): every rank holds the same bits (streams, carried pre, selections, sparse-index
tables, candidate pools, caches), and they equal TP1's. The replicated indexer under TP (below the
threshold) is the one-rank code (`AttentionStep._select`), which the one-rank step tests cover.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from dsv41_decode.decode import attention
from dsv41_decode.parallel import TensorParallel
from dsv41_decode.stack import AttentionStack
from dsv41_decode.state import DecodeState
from dsv41_decode.weights import load_checkpoint, write_synthetic_checkpoint

from safetensors.torch import load_file, save_file
from helpers import reduced_config, rel, run_ranks, streams

pytestmark = pytest.mark.slow        # among the longest files on the CPU: it runs first (conftest.py)

# per world, the row-sharded step's rows (not a multiple of tp), its own bucket; at TP4 3 rows rather
# than 5 (2 + 2 + 1 + 0): the share kinds are the same, and the interpreter's linears take their rows
# 4 at a time (a fifth row costs each of the five processes a second pass, ~10 s on CI's two cores)
STEPS = {2: [("a", 1), ("b", 2)], 4: [("a", 1), ("b", 2)]}
# per world, the layers built: TP2 one of each kind, the first five of `reduced_config` (its layer 5
# is a second Reuse); TP4 (four processes on CI's two cores) the indexer layers only - Full r2, the
# candidate source and the Reindex consumer - the SWA and Reuse layers' TP path being TP2's
LAYERS = {2: (0, 1, 2, 3, 4), 4: (1, 3, 4)}
STATE = ("window", "compressed", "index_keys", "comp_kv", "comp_score")


def _state(cfg, rows: int):
    st = DecodeState(cfg, max_requests=2, max_context=64, page_size=4, stage_rows=rows)
    st.admit("a")
    st.admit("b")
    return st


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _outputs(step, st, y, pre, n: int) -> dict[str, torch.Tensor]:
    """What a step leaves, by name: streams, carried pre, each index source's top-k and table,
    the candidate pools (rows [0, n)) and the state's caches."""
    out = {"y": y, "pre": pre}
    for i, sel in step.selections.items():
        out[f"topk.{i}"], out[f"table.{i}"] = sel.topk[:n], sel.table[:n]
    for i, mask in step.candidate_masks.items():
        out[f"candidates.{i}"] = mask[:n]
    for name in STATE:
        for L, t in getattr(st, name).items():
            out[f"{name}.{L}"] = t
    return out


def _rank(rank: int, world: int, ckpt_dir: str, store: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        ckpt = load_checkpoint(ckpt_dir)
        cfg, tp = ckpt.config, TensorParallel(world, rank)
        rows = STEPS[world]
        n = sum(c for _, c in rows)
        many = AttentionStack(ckpt, LAYERS[world], tp=tp)
        one = AttentionStack(ckpt, LAYERS[world]) if rank == 0 else None
        s1, s2 = _state(cfg, n), _state(cfg, n)
        g = torch.Generator().manual_seed(1)
        x = streams(19, cfg, g)
        for stack, st in ((one, s1), (many, s2)):
            if stack is not None:
                stack.forward(x, st.plan([("a", 13), ("b", 6)]), st)
        step2 = many.decode_step(s2, buckets=(n,))
        step1 = one.decode_step(s1, buckets=(n,)) if one is not None else None
        assert not step2.indexer_sharded(n) and step2.indexer_shard_rows > n   # the default: replicated
        step2.indexer_shard_rows = 1
        assert step2.indexer_sharded(n)
        assert step1 is None or not step1.indexer_sharded(n)   # one rank: always replicated
        # the rows each indexer call scores and the share each gather sends, in the step's order
        scored, gathered = [], []
        score, gather = attention.index_scores_mxfp4_, TensorParallel.gather_row_shares

        def scoring(iq, *args, **kwargs):
            scored.append(iq.shape[0])
            return score(iq, *args, **kwargs)

        def gathering(self, part, dst):
            gathered.append(part.shape[0])
            return gather(self, part, dst)
        attention.index_scores_mxfp4_, TensorParallel.gather_row_shares = scoring, gathering
        x = streams(n, cfg, g)
        try:
            y2, p2 = step2(x, rows)
        finally:
            attention.index_scores_mxfp4_, TensorParallel.gather_row_shares = score, gather
        lo, hi, chunk = tp.row_share(n)
        full = [i for i in many.ids if cfg.plan[i].kind == "full"]
        source = [i for i in full if cfg.plan[i].candidate_role == "source"]
        # the Full layers score this rank's share (none on an empty one), the Reindex layer every row
        assert scored == [hi - lo for i in many.ids if cfg.plan[i].kind == "full" and hi > lo] + \
            [n for i in many.ids if cfg.plan[i].kind == "reindex"], (scored, lo, hi)
        assert gathered == [chunk] * (len(full) + len(source)), gathered
        mine = _outputs(step2, s2, y2, p2, n)
        for key, t in mine.items():
            assert tp.same_on_all_ranks(_bits(t)), f"{key} differs between ranks"
        # each rank ran its share of the heads and groups, and its wo_b partial alone is far
        # from the reduced output
        assert step2.scratch.q.shape[1] == cfg.n_heads // world
        assert many.layers[many.ids[0]].w["attn.wo_a.weight"].shape[0] == cfg.o_groups // world * cfg.o_lora_rank
        assert rel(step2.scratch.y_partial[:n].to(torch.bfloat16), step2.y[:n]) > 0.1, "no reduction"
        if step1 is not None:
            ref = _outputs(step1, s1, *step1(x, rows), n)
            assert set(ref) == set(mine) and len(ref) > 2
            differ = sorted(key for key in ref if not torch.equal(_bits(mine[key]), _bits(ref[key])))
            save_file({"rel": torch.tensor([rel(y2, ref["y"])]), "n": torch.tensor([len(differ)])}, out)
            with open(out + ".differ", "w") as f:
                f.write(" ".join(differ))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world, heads", [(2, 16), (4, 32)], ids=["tp2", "tp4"])
def test_tp_step_matches_tp1(world, heads, tmp_path_factory, tmp_path):
    cfg = reduced_config().replace(n_heads=heads, o_groups=4)
    d = write_synthetic_checkpoint(cfg, tmp_path_factory.mktemp("tp_step"), seed=4)
    out = tmp_path / "errs.safetensors"
    run_ranks(_rank, world, (world, str(d), str(tmp_path / "store"), str(out)))
    got = load_file(out)
    differ = open(str(out) + ".differ").read()
    # Bitwise: the selections, tables and candidate pools by construction (each row's is a copy
    # of its owner's, and the indexer's kernels are batch-invariant per row: rows [lo, hi) give
    # what rows [0, n) give there), given the same layer inputs; those, the caches and the
    # streams because the rank-ordered FP32 sum of the ranks' wo_b partials rounds to the same
    # BF16 as the one-rank GEMM's sum on these inputs. The latter is measured, not guaranteed (a
    # reordered FP32 sum can tip a rounding): were a kernel change to tip one, the streams would
    # differ by ulps (rel below) and the sharded step should then be compared with the replicated
    # TP step instead.
    assert int(got["n"]) == 0, f"TP{world} differs from TP1 in {differ} (streams rel RMS {float(got['rel']):.2e})"
