"""Tensor-parallel shards: they tile the checkpoint, and the ranks' partial outputs, reduced in FP32
in rank order, give the unsharded output projection within one BF16 ulp of each row's largest value
(only the FP32 summation order differs: every MXFP8 block of the wo_b input stays on one rank)."""

import pytest
import torch

from dsv41_decode.config import ConfigError, ModelConfig
from dsv41_decode.reference.attention import grouped_wo_a, output_projection
from dsv41_decode.reference.linear import fp8_linear
from dsv41_decode.reference.rope import rope_cis, rope_freqs
from dsv41_decode.sharding import shard_layer
from dsv41_decode.testing.compare import row_ulp_distance
from dsv41_decode.weights import load_checkpoint, write_synthetic_checkpoint

SHARDED_ROWS = ("attn.wq_b.weight", "attn.wq_b.scale", "attn.attn_sink", "attn.wo_a.weight")


@pytest.fixture(scope="module", params=["tiny", "small"])
def layer(request, tmp_path_factory):
    cfg = ModelConfig.preset(request.param)
    d = tmp_path_factory.mktemp(request.param)
    write_synthetic_checkpoint(cfg, d, seed=3, layers=[2])
    return cfg, load_checkpoint(d, layers=[2]).layer(2)


def _tps(cfg):
    return [tp for tp in (1, 2, 4, 8) if cfg.n_heads % tp == 0 and cfg.o_groups % tp == 0]


def test_shards_tile_the_checkpoint(layer):
    cfg, w = layer
    for tp in _tps(cfg):
        shards = [shard_layer(cfg, w, tp, r) for r in range(tp)]
        for name in SHARDED_ROWS:
            assert torch.equal(torch.cat([s[name] for s in shards]).view(torch.uint8),
                               w[name].contiguous().view(torch.uint8)), (tp, name)
        for name in ("attn.wo_b.weight", "attn.wo_b.scale"):
            assert torch.equal(torch.cat([s[name] for s in shards], 1).view(torch.uint8),
                               w[name].view(torch.uint8)), (tp, name)
        for name in set(w) - set(SHARDED_ROWS) - {"attn.wo_b.weight", "attn.wo_b.scale"}:
            assert all(s[name] is w[name] for s in shards), name   # replicated


def test_partial_outputs_reduce_to_the_unsharded_projection(layer):
    cfg, w = layer
    n = 5
    g = torch.Generator().manual_seed(9)
    o = (torch.randn(n, cfg.n_heads, cfg.head_dim, generator=g) * 0.3).to(torch.bfloat16)
    cis = rope_cis(rope_freqs(cfg, 1), torch.arange(100, 100 + n))
    wo_a = w["attn.wo_a.weight"].to(torch.bfloat16)
    y = output_projection(o, cis, wo_a, w["attn.wo_b.weight"], w["attn.wo_b.scale"], cfg.o_groups, 64)
    z = grouped_wo_a(o, cis, wo_a, cfg.o_groups, 64)
    for tp in _tps(cfg)[1:]:
        heads, partial, zs = cfg.n_heads // tp, torch.zeros(n, cfg.dim), []
        for r in range(tp):   # rank order, FP32
            s = shard_layer(cfg, w, tp, r)
            z_r = grouped_wo_a(o[:, r * heads:(r + 1) * heads], cis, s["attn.wo_a.weight"].to(torch.bfloat16),
                               cfg.o_groups // tp, 64)
            zs.append(z_r)
            partial += fp8_linear(z_r, s["attn.wo_b.weight"], s["attn.wo_b.scale"], out_dtype=torch.float32)
        assert torch.equal(torch.cat(zs, 1), z), tp          # wo_a is exact per group
        assert row_ulp_distance(partial.to(torch.bfloat16), y) <= 1.0, tp


def test_bad_tp_and_rank_are_named(layer):
    cfg, w = layer
    with pytest.raises(ConfigError, match="n_heads|o_groups"):
        shard_layer(cfg, w, 3, 0)
    with pytest.raises(ValueError, match="rank"):
        shard_layer(cfg, w, 2, 2)
