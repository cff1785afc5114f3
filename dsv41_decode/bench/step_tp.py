"""`torchrun --nproc-per-node N -m dsv41_decode bench step --tp N`: the tensor-parallel step and the
boundary on N GPUs of one host (docs/tp.md).

Every rank builds the same random V4.1-Flash weights (same seed) and keeps its shard, fills the same
synthetic state, and builds the step twice: with the collective boundary (gather + rank-ordered sum)
and with the fused one-shot boundary (`tp_boundary="fused"`). Rank 0 times CUDA-graph replays (the
collectives keep the ranks in step) and writes `step-tp<N>-<gpu>.jsonl`. The boundary alone is timed
too: the fused kernel against the collective reduction + `mhc_boundary_`, at each row count. The
weights and cache bytes of the floor are the rank's own (its heads' share of `wq_b`, `wo_a`, `wo_b`).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from ..config import ModelConfig
from ..ops.allreduce_boundary import Mailbox, allreduce_boundary_
from ..ops.mhc import MhcBoundaryPlan, mhc_boundary_
from ..parallel import from_environment
from ..stack import AttentionStack
from ..state import DecodeState
from ..testing.synthetic import fill_state, random_checkpoint
from .floor import read_bandwidth_gbps
from .results import format_table, record, run_info, write_jsonl
from .step import _arm, _replay_us, kv_bytes, weight_bytes
from .timing import graph_time_us

NO_MULTICAST = {"TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NCCL_NVLS_ENABLE": "0", "NVSHMEM_DISABLE_NVLS": "1"}
TP_CONTEXTS = (32768,)      # bench step --tp's default contexts


def run_step_bench_tp(tp_size: int, rows=(1, 2, 4, 8, 16, 32, 64), contexts=TP_CONTEXTS, out_dir="out",
                      progress=print) -> list[dict]:
    """The TP step (collective vs fused) and the boundary at each row count; rank 0 writes results."""
    for k, v in NO_MULTICAST.items():
        os.environ.setdefault(k, v)
    if int(os.environ.get("WORLD_SIZE", "1")) != tp_size:
        raise SystemExit(f"--tp {tp_size}: launch with `torchrun --nproc-per-node {tp_size} -m dsv41_decode "
                         f"bench step --tp {tp_size}` (WORLD_SIZE is {os.environ.get('WORLD_SIZE', 'unset')})")
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    tp = from_environment("nccl")
    say = progress if tp.rank == 0 else (lambda *_: None)
    info = run_info()
    floor = read_bandwidth_gbps()
    say(f"streaming read: {floor:.0f} GB/s per GPU; tp={tp.tp}")
    cfg = ModelConfig.preset("v41-flash")
    stack = AttentionStack(random_checkpoint(cfg, "cuda", progress=tp.rank == 0), tp=tp)
    wbytes = weight_bytes(stack)
    gen = torch.Generator(device="cuda").manual_seed(1)
    results = _bench_boundary(tp, cfg, rows, floor, info, say)
    max_rows = max(rows)
    for ctx in contexts:
        state = DecodeState(cfg, max_requests=max_rows, max_context=ctx + 1024, page_size=64, device="cuda")
        fill_state(state, {i: ctx for i in range(max_rows)})
        steps = {v: stack.decode_step(state, max_rows=max_rows, buckets=rows, tp_boundary=v)
                 for v in ("collective", "fused")}
        say(f"boundary modes: {[s.boundary_mode for s in steps.values()]}")
        for n in rows:
            times = {}
            for v, step in steps.items():
                bucket = _arm(step, [(i, 1) for i in range(n)], gen)
                dist.barrier()
                times[v] = _replay_us(step, bucket)
            nbytes = wbytes + kv_bytes(cfg, ctx, n)
            results.append(record("step_tp", {"op": "step_40_layers", "rows": n, "context": ctx, "tp": tp.tp},
                                  times["fused"], nbytes, floor, {"collective": times["collective"]}, info))
            say(f"ctx {ctx} rows {n}: fused {times['fused']:.1f} us, collective {times['collective']:.1f} us")
        del steps, state
        torch.cuda.empty_cache()
        dist.barrier()
        if tp.rank == 0:
            results += _tp1_reference(cfg, ctx, rows, floor, info, gen, say)
        dist.barrier()
    if tp.rank == 0:
        for r in results:
            r["read_gbps"] = round(floor, 1)
        path = write_jsonl(results, out_dir, f"step-tp{tp.tp}")
        from .step_plot import plot_step
        plot_step(results, path.with_suffix(".png"))
        print(format_table(results, ["op", "rows", "context", "tp"]))
    dist.barrier()
    dist.destroy_process_group()
    return results


def _tp1_reference(cfg: ModelConfig, ctx: int, rows, floor, info, gen, say) -> list[dict]:
    """The one-GPU step on rank 0's GPU in the same run (the TP speedup's denominator)."""
    stack = AttentionStack(random_checkpoint(cfg, "cuda", progress=False))
    wbytes, max_rows = weight_bytes(stack), max(rows)
    state = DecodeState(cfg, max_requests=max_rows, max_context=ctx + 1024, page_size=64, device="cuda")
    fill_state(state, {i: ctx for i in range(max_rows)})
    step = stack.decode_step(state, max_rows=max_rows, buckets=rows)
    out = []
    for n in rows:
        t = _replay_us(step, _arm(step, [(i, 1) for i in range(n)], gen))
        out.append(record("step_tp", {"op": "step_40_layers", "rows": n, "context": ctx, "tp": 1}, t,
                          wbytes + kv_bytes(cfg, ctx, n), floor, {}, info))
        say(f"ctx {ctx} rows {n}: TP1 {t:.1f} us")
    del step, state, stack
    torch.cuda.empty_cache()
    return out


def _bench_boundary(tp, cfg: ModelConfig, rows, floor, info, say) -> list[dict]:
    """The boundary alone: fused one-shot kernel vs collective reduction + mhc_boundary_."""
    out = []
    dim, max_rows = cfg.dim, max(rows)
    layers = 8     # one epoch advance per 8 boundaries, as a step advances it once per 40 layers
    box = Mailbox.symmetric(tp, max_rows, dim, layers, "cuda")
    plan = MhcBoundaryPlan.build(dim, max_rows, "cuda")
    g = torch.Generator(device="cuda").manual_seed(2)
    x = torch.randn(max_rows, 4, dim, generator=g, device="cuda").to(torch.bfloat16)
    post = torch.rand(max_rows, 4, generator=g, device="cuda")
    comb = torch.softmax(torch.randn(max_rows, 4, 4, generator=g, device="cuda"), -1)
    pre = torch.rand(max_rows, 4, generator=g, device="cuda")
    w = torch.ones(dim, dtype=torch.bfloat16, device="cuda")
    box.data.normal_(generator=g)
    bufs = dict(x_out=torch.empty_like(x), u=torch.empty(max_rows, dim, dtype=torch.bfloat16, device="cuda"),
                codes=torch.empty(max_rows, dim, dtype=torch.uint8, device="cuda"),
                scales=torch.empty(max_rows, dim // 32, dtype=torch.uint8, device="cuda"),
                y=torch.empty(max_rows, dim, dtype=torch.bfloat16, device="cuda"))
    for n in rows:
        b = {k: v[:n] for k, v in bufs.items()}

        def fused(n=n, b=b):
            box.next_step()
            for k in range(layers):
                allreduce_boundary_(box, k, n, x[:n], post[:n], comb[:n], pre[:n], w, 1e-6, b["x_out"], b["u"],
                                    b["codes"], b["scales"], b["y"], plan)

        def collective(n=n, b=b):
            y = tp.reduce_partials(box.slot(0)[:n]).to(torch.bfloat16)
            mhc_boundary_(y, x[:n], post[:n], comb[:n], pre[:n], w, 1e-6, b["x_out"], b["u"], b["codes"],
                          b["scales"], plan)

        dist.barrier()
        t_fused = graph_time_us(fused, calls_per_graph=layers, replays=30)
        dist.barrier()
        t_col = graph_time_us(collective, replays=30)
        # partials read, streams read and written, the reduced y (BF16), u (BF16) and u's MXFP8 codes
        # and scales written
        nbytes = n * dim * 4 * tp.tp + n * 4 * dim * 2 * 2 + n * dim * (2 + 2 + 1) + n * dim // 32
        out.append(record("boundary", {"op": "boundary", "rows": n, "tp": tp.tp}, t_fused, nbytes, floor,
                          {"collective": t_col}, info))
        say(f"boundary rows {n}: fused {t_fused:.2f} us, collective + boundary {t_col:.2f} us")
    box.check()
    return out
