"""The specialized step under TP on 2 GPUs (NCCL; the `nvidia-h200-x2` machine): the fused one-shot
boundary equals the collective fallback bit for bit, every rank holds the same bits, and a rank
that stops publishing is named by the other within the bounded wait. Skipped with fewer than 2 GPUs.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dsv41_decode.config import ModelConfig
from dsv41_decode.parallel import TensorParallel
from dsv41_decode.stack import AttentionStack
from dsv41_decode.state import DecodeState
from dsv41_decode.testing.synthetic import fill_state, random_checkpoint

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")]

NO_MULTICAST = {"TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NCCL_NVLS_ENABLE": "0", "NVSHMEM_DISABLE_NVLS": "1"}


def _rank(rank: int, world: int, store: str) -> None:
    os.environ.update(NO_MULTICAST)
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        cfg = ModelConfig.preset("small").replace(n_heads=16, o_groups=4)
        tp = TensorParallel(world, rank)
        ckpt = random_checkpoint(cfg, "cuda", seed=3, progress=False)   # same seed: same weights
        stack = AttentionStack(ckpt, tp=tp)
        base = DecodeState(cfg, max_requests=4, max_context=1024, page_size=16, device="cuda", stage_rows=16)
        fill_state(base, {"a": 300, "b": 77, "c": 5})
        s_col, s_fused = copy.deepcopy(base), copy.deepcopy(base)
        col = stack.decode_step(s_col, max_rows=8)
        fused = stack.decode_step(s_fused, max_rows=8, tp_boundary="fused")
        g = torch.Generator(device="cuda").manual_seed(0)
        for k in range(12):
            rows = [("a", 1), ("b", 4), ("c", 2)] if k % 2 else [("a", 3), ("c", 1)]
            x = torch.randn(sum(c for _, c in rows), cfg.hc_mult, cfg.dim, generator=g, device="cuda")
            x = x.to(torch.bfloat16)
            y1, p1 = col(x, rows)
            y2, p2 = fused(x, rows)
            assert torch.equal(y1, y2) and torch.equal(p1, p2), f"step {k}: fused != collective"
            assert tp.same_on_all_ranks(y2), f"step {k}: ranks differ"
        # rank 1 stops publishing: rank 0's next call names it within the bounded wait
        dist.barrier()
        if rank == 0:
            with pytest.raises(RuntimeError, match="rank 1 of 2 did not publish"):
                fused(x, rows)
    finally:
        dist.destroy_process_group()


def test_fused_boundary_equals_collective_on_two_gpus(tmp_path):
    mp.spawn(_rank, args=(2, str(tmp_path / "store")), nprocs=2, join=True)
