"""Tensor parallelism of the reference on the CPU: 2 and 4 gloo processes against one.

Each rank runs the same calls (a prefill of two requests, then decode steps with draft rows) with
every layer teacher-forced: layer i of the TP run takes the TP1 run's input to layer i. The
replicated work (projections, caches, compressor, indexer) must then be bitwise equal to TP1's - also
the top-k of the Full layers, whose rows each rank scores only its share of (r % tp == rank) and
exchanges - the
layer outputs (rank-ordered FP32 reductions of the ranks' wo_b partials) within one BF16 ulp of
each row's largest value, and every rank must hold the same bits.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from dsv41_decode.config import ModelConfig
from dsv41_decode.layer import CallContext
from dsv41_decode.parallel import TensorParallel
from dsv41_decode.sharding import shard_layer
from dsv41_decode.stack import AttentionStack
from dsv41_decode.state import DecodeState
from dsv41_decode.testing.compare import row_ulp_distance
from dsv41_decode.weights import load_checkpoint, write_synthetic_checkpoint
from helpers import reduced_config, run_ranks

CALLS = [[("a", 21), ("b", 6)], [("a", 1), ("b", 3)], [("a", 2), ("b", 1)], [("a", 4)], [("b", 2), ("a", 1)]]


def _new_state(cfg):
    st = DecodeState(cfg, max_requests=2, max_context=64, page_size=4)
    st.admit("a")
    st.admit("b")
    return st


def _rank(rank: int, world: int, ckpt_dir: str, store: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        ckpt = load_checkpoint(ckpt_dir)
        cfg = ckpt.config
        tp = TensorParallel(world, rank)
        # rank 0 shards the whole checkpoint in memory; the others read only their slices
        part = ckpt if rank == 0 else load_checkpoint(ckpt_dir, tp=world, rank=rank)
        one, many = AttentionStack(ckpt), AttentionStack(part, tp=tp)
        assert many.layers[one.ids[0]].cfg.n_heads == cfg.n_heads // world
        # the dense indexers (Full layers) score only this rank's share of the rows
        assert all(many.layers[i].row_sharded == (cfg.plan[i].kind == "full") for i in many.ids)
        s1, s2 = _new_state(cfg), _new_state(cfg)
        g = torch.Generator().manual_seed(5)
        for call in CALLS:
            n = sum(c for _, c in call)
            x = torch.randn(n, cfg.hc_mult, cfg.dim, generator=g).to(torch.bfloat16)
            rec1, c1 = {}, CallContext()
            one.forward(x, s1.plan(call), s1, ctx=c1, observe=lambda i, r: rec1.__setitem__(i, r))
            step2, c2 = s2.plan(call), CallContext()
            for i in many.ids:                               # teacher-forced with TP1's inputs
                y = many.layers[i].forward(rec1[i].attn_in, step2, s2, c2)
                assert row_ulp_distance(y, rec1[i].attn_out) <= 1.0, f"layer {i}: more than one ulp"
                assert tp.same_on_all_ranks(y), f"layer {i}: ranks differ"
                if cfg.plan[i].runs_indexer:
                    for a, b in zip(c2.topk[i], c1.topk[i]):
                        assert torch.equal(a, b), f"layer {i}: top-k differs"
            s2.advance(step2)
            for name in ("window", "compressed", "index_keys", "comp_kv", "comp_score"):
                for key, t in getattr(s1, name).items():
                    assert torch.equal(t, getattr(s2, name)[key]), f"{name}[{key}] differs"
    finally:
        dist.destroy_process_group()


def _checkpoint(tmp_path_factory, preset: str) -> str:
    d = tmp_path_factory.mktemp(preset)
    cfg = reduced_config() if preset == "every-kind" else ModelConfig.preset(preset)
    write_synthetic_checkpoint(cfg, d, seed=9)
    return str(d)


# tiny: 4 heads, 2 wo_a groups (TP2); every-kind: `small` cut to one layer of each kind (8 heads, 4
# groups, window 8, top-k 8, so that the calls wrap the window and saturate the top-k), the 4-rank
# layout (TP4)
@pytest.mark.parametrize("preset, world", [("tiny", 2), ("every-kind", 4)])
def test_tp_reference_matches_tp1(preset, world, tmp_path_factory, tmp_path):
    ckpt_dir = _checkpoint(tmp_path_factory, preset)
    run_ranks(_rank, world, (world, ckpt_dir, str(tmp_path / "store")))


def test_reduce_partials_is_rank_ordered_and_rejects_bf16(monkeypatch):
    tp = TensorParallel()
    p = torch.randn(3, 8)
    assert tp.reduce_partials(p) is p
    # four ranks' partials whose FP32 sum depends on the order (the gather stubbed: every rank
    # receives the same list): ((p0 + p1) + p2) + p3, on each rank
    parts = [torch.tensor([[1.0, 3.0]]), torch.tensor([[2.0 ** 24, 2.0 ** -30]]), torch.tensor([[1.0, -3.0]]),
             torch.tensor([[-2.0 ** 24, 1.0]])]

    def gather(out, mine, group=None):
        for o, q in zip(out, parts):
            o.copy_(q)
    monkeypatch.setattr(dist, "all_gather", gather)
    want = ((parts[0] + parts[1]) + parts[2]) + parts[3]
    assert not torch.equal(want, ((parts[3] + parts[2]) + parts[1]) + parts[0])      # the order shows
    for rank in range(4):
        assert torch.equal(TensorParallel(4, rank).reduce_partials(parts[rank]), want), rank
    with pytest.raises(TypeError, match="float32"):
        tp.reduce_partials(p.to(torch.bfloat16))
    with pytest.raises(ValueError, match="rank"):
        TensorParallel(2, 2)


def test_row_shares_cover_the_rows_once_in_rank_order():
    for tp, rows in ((2, 3), (4, 5), (4, 16), (2, 1), (8, 64)):
        shares = [TensorParallel(tp, r).row_share(rows) for r in range(tp)]
        chunk = -(-rows // tp)
        assert all(c == chunk and hi - lo <= chunk for lo, hi, c in shares)
        assert [i for lo, hi, _ in shares for i in range(lo, hi)] == list(range(rows)), (tp, rows, shares)
    assert [TensorParallel(4, r).row_share(5)[:2] for r in range(4)] == [(0, 2), (2, 4), (4, 5), (5, 5)]
    one = TensorParallel()
    part, out = torch.arange(6, dtype=torch.int32).view(2, 3), torch.full((4, 3), -1, dtype=torch.int32)
    assert torch.equal(one.gather_row_shares(part, out), part) and int(out[2:].max()) == -1
    with pytest.raises(ValueError, match="cannot hold"):
        TensorParallel(2, 0).gather_row_shares(part, out[:3])


def test_loading_a_shard_reads_the_rank_slices(tmp_path_factory):
    d = _checkpoint(tmp_path_factory, "small")
    full = load_checkpoint(d, layers=[2])
    for rank in range(4):
        part = load_checkpoint(d, layers=[2], tp=4, rank=rank)
        assert part.shard == (4, rank)
        want = shard_layer(full.config, full.layer(2), 4, rank)
        got = part.layer(2)
        assert set(got) == set(want)
        for name, t in want.items():
            assert torch.equal(got[name].view(torch.uint8), t.view(torch.uint8)), name
    with pytest.raises(ValueError, match="rank 1 of tp=4"):
        AttentionStack(load_checkpoint(d, layers=[0], tp=4, rank=0), tp=TensorParallel(4, 1))


def test_single_process_environment(monkeypatch):
    from dsv41_decode.parallel import from_environment
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert from_environment() == TensorParallel()
    assert os.environ.get("WORLD_SIZE") is None
