"""The specialized step under tensor parallelism on the CPU: 2 or 4 gloo processes, eager, interpreter.

TP2: each rank runs its 8 of 16 heads and 2 of 4 wo_a groups; TP4 (the 4-rank layout): 8 of 32
heads and 1 of 4 groups. Each reduces wo_b's FP32 partials through
`TensorParallel.reduce_partials` (the collective fallback boundary). Against the one-rank step on
the same inputs (run on rank 0): every rank holds the same bits, the first layer's cache records
(replicated work on identical inputs) are bitwise equal, and the streams agree to the rounding of
the reordered partial sums as it compounds over the layers.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dsv41_decode.parallel import TensorParallel
from dsv41_decode.stack import AttentionStack
from dsv41_decode.state import DecodeState
from dsv41_decode.weights import load_checkpoint, write_synthetic_checkpoint

from safetensors.torch import load_file, save_file
from helpers import reduced_config, rel, streams

STEPS = [[("a", 1), ("b", 3)]]


def _state(cfg):
    st = DecodeState(cfg, max_requests=2, max_context=64, page_size=4, stage_rows=4)
    st.admit("a")
    st.admit("b")
    return st


def _rank(rank: int, world: int, ckpt_dir: str, store: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        ckpt = load_checkpoint(ckpt_dir)
        cfg, tp = ckpt.config, TensorParallel(world, rank)
        many = AttentionStack(ckpt, tp=tp)
        one = AttentionStack(ckpt) if rank == 0 else None
        s1, s2 = _state(cfg), _state(cfg)
        g = torch.Generator().manual_seed(1)
        x = streams(19, cfg, g)
        for stack, st in ((one, s1), (many, s2)):
            if stack is not None:
                stack.forward(x, st.plan([("a", 13), ("b", 6)]), st)
        step2 = many.decode_step(s2, max_rows=4)
        step1 = one.decode_step(s1, max_rows=4) if one is not None else None
        errs = []
        for rows in STEPS:
            x = streams(sum(c for _, c in rows), cfg, g)
            y2, p2 = step2(x, rows)
            assert tp.same_on_all_ranks(y2) and tp.same_on_all_ranks(p2), "ranks differ"
            # each rank ran its share of the heads and groups, and its wo_b partial alone is far
            # from the reduced output
            assert step2.scratch.q.shape[1] == cfg.n_heads // world
            assert many.layers[many.ids[0]].w["attn.wo_a.weight"].shape[0] == cfg.o_groups // world * cfg.o_lora_rank
            assert rel(step2.scratch.y_partial[:4].to(torch.bfloat16), step2.y[:4]) > 0.1, "no reduction"
            if step1 is not None:
                y1, p1 = step1(x, rows)
                L0 = one.ids[0]
                assert torch.equal(s1.window[L0], s2.window[L0]), "first layer's window records differ"
                errs.append(rel(y2, y1))
        if rank == 0:
            save_file({"errs": torch.tensor(errs)}, out)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world, heads", [(2, 16), (4, 32)], ids=["tp2", "tp4"])
def test_tp_step_matches_tp1(world, heads, tmp_path_factory, tmp_path):
    cfg = reduced_config().replace(n_heads=heads, o_groups=4)
    d = write_synthetic_checkpoint(cfg, tmp_path_factory.mktemp("tp_step"), seed=4)
    out = tmp_path / "errs.safetensors"
    mp.spawn(_rank, args=(world, str(d), str(tmp_path / "store"), str(out)), nprocs=world, join=True)
    errs = load_file(out)["errs"]
    # 2e-2 is not derived: the ranks' wo_b partials are added in another order than the one-rank
    # sum, which can tip a BF16 rounding of y, and such a flip compounds through the boundaries
    # and later layers in a way no format bound covers. Measured: 0 (bit for bit) at TP2 and TP4.
    assert len(errs) == len(STEPS) and float(errs.max()) <= 2e-2, f"TP{world} vs TP1 streams rel RMS per step: {errs.tolist()}"
