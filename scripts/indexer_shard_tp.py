"""Where the row-sharded dense indexer pays: the TP step (V4.1-Flash, random weights, CUDA-graph
replay, the default boundary) with its Full layers' indexers replicated (`indexer_shard_rows` past
every bucket) and row-sharded (`indexer_shard_rows = 1`), on the same state and inputs, per row
count and context; plus each Full layer kind alone (`DecodeStep.layer_call`: the candidate source
and a ratio-2 Full layer, whose sharded form holds the gathers). Checks once per row count that
both give the same streams. Rank 0 prints a table and writes `indexer-shard-tp<N>-<gpu>.jsonl`
(bench `indexer_shard`: `us` is the sharded time, `baselines.replicated` the replicated one); the
smallest row count from which `ratio` stays below 1 at the contexts served is the threshold
(`decode.step.INDEXER_SHARD_ROWS`).

    PYTHONPATH=. torchrun --nproc-per-node 2 scripts/indexer_shard_tp.py --rows=4,8,16,32,64 \\
        --contexts=32768,131072 --out=docs/results
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from _args import arg
from dsv41_decode.bench.floor import read_bandwidth_gbps
from dsv41_decode.bench.results import format_table, record, run_info, write_jsonl
from dsv41_decode.bench.step import _arm, _replay_us, kv_bytes, weight_bytes
from dsv41_decode.bench.step_tp import NO_MULTICAST
from dsv41_decode.bench.timing import graph_time_us
from dsv41_decode.config import ModelConfig
from dsv41_decode.ops import LOW_BATCH_MAX_ROWS
from dsv41_decode.parallel import from_environment
from dsv41_decode.stack import AttentionStack
from dsv41_decode.state import DecodeState
from dsv41_decode.testing.synthetic import fill_state, random_checkpoint


def main() -> None:
    rows = [int(r) for r in arg("rows", "4,8,16,32,64").split(",")]
    contexts = [int(c) for c in arg("contexts", "32768,131072").split(",")]
    out_dir = arg("out", "out")
    for k, v in NO_MULTICAST.items():
        os.environ.setdefault(k, v)
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    tp = from_environment("nccl")
    if tp.tp < 2:
        raise SystemExit("launch with torchrun --nproc-per-node 2 (or more): the script compares TP steps")
    say = print if tp.rank == 0 else (lambda *_: None)
    info, floor = run_info(), read_bandwidth_gbps()
    cfg = ModelConfig.preset("v41-flash")
    stack = AttentionStack(random_checkpoint(cfg, "cuda", progress=tp.rank == 0), tp=tp)
    wbytes = weight_bytes(stack)
    kinds = {}                                   # one Full layer of each label: the candidate source, "full"
    for i in stack.ids:
        if cfg.plan[i].kind == "full":
            kinds.setdefault(cfg.plan[i].label, i)
    gen = torch.Generator(device="cuda").manual_seed(1)
    results, max_rows = [], max(rows)
    for ctx in contexts:
        state = DecodeState(cfg, max_requests=max_rows, max_context=ctx + 1024, page_size=64, device="cuda")
        fill_state(state, {i: ctx for i in range(max_rows)})
        steps = {"replicated": stack.decode_step(state, max_rows=max_rows, buckets=rows),
                 "sharded": stack.decode_step(state, max_rows=max_rows, buckets=rows)}
        steps["replicated"].indexer_shard_rows = LOW_BATCH_MAX_ROWS + 1      # recaptures
        steps["sharded"].indexer_shard_rows = 1
        say(f"ctx {ctx}: boundary {steps['sharded'].boundary_mode}")
        for n in rows:
            step_rows = [(i, 1) for i in range(n)]
            x = torch.randn(n, cfg.hc_mult, cfg.dim, generator=gen, device="cuda").to(torch.bfloat16)
            outs = {}
            for v, step in steps.items():
                step.replay(step.prepare(step_rows, x))
                outs[v] = step.io.x_out[:n].clone()
            same = torch.equal(outs["replicated"], outs["sharded"])
            times, layer_times = {}, {}
            for v, step in steps.items():
                bucket = _arm(step, step_rows, gen)
                dist.barrier()
                times[v] = _replay_us(step, bucket)
                for label, i in kinds.items():
                    dist.barrier()
                    layer_times[(v, label)] = graph_time_us(step.layer_call(i, bucket), replays=20)
            nbytes = wbytes + kv_bytes(cfg, ctx, n)
            extra = {"equal": same, "ratio": round(times["sharded"] / times["replicated"], 3)}
            results.append({**record("indexer_shard", {"op": "step_40_layers", "rows": n, "context": ctx,
                                                       "tp": tp.tp}, times["sharded"], nbytes, floor,
                                     {"replicated": times["replicated"]}, info), **extra})
            for label in kinds:
                results.append(record("indexer_shard", {"op": f"layer_{label}", "rows": n, "context": ctx,
                                                        "tp": tp.tp}, layer_times[("sharded", label)], 0, floor,
                                      {"replicated": layer_times[("replicated", label)]}, info))
            say(f"ctx {ctx} rows {n}: step sharded {times['sharded']:.1f} us, replicated "
                f"{times['replicated']:.1f} us (x{extra['ratio']}), equal {same}; "
                + ", ".join(f"{label} {layer_times[('sharded', label)]:.1f} vs "
                            f"{layer_times[('replicated', label)]:.1f} us" for label in kinds))
        del steps, state
        torch.cuda.empty_cache()
        dist.barrier()
    if tp.rank == 0:
        path = write_jsonl(results, out_dir, f"indexer-shard-tp{tp.tp}")
        print(format_table(results, ["op", "rows", "context", "tp"]))
        print(f"wrote {path}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
