"""The device bytes a V4.1-Flash decode step owns (`DecodeStep.memory_bytes`), computed on the CPU
with the plans the step builds on an H200 (132 SMs; the CPU's few-program plans switched off), for
one layer of each kind and ratio, scaled to the 40 layers by the kinds' counts.

    TRITON_INTERPRET=1 PYTHONPATH=. python scripts/probe_step_memory.py [--max-rows 64]

The per-layer figures cover the layer's weight copies (the fused wq_a|wkv, the FP32 ratio-2
compressor weights) and its kernels' own workspaces (the side lanes' plans); the main-stream
kernels' workspaces (sparse MLA, wq_a|wkv, wq_b, wo_a, wo_b) are one pool for all layers, sized for
the largest taker (`decode.buffers.Workspaces`: the same for this subset as for the 40 layers, whose
shapes it holds) and counted once. The other shared families (scratch, scores, tables, streams,
selections) are printed as this subset's step builds them (the scores buffer grows with the state's
max_context, set small here). Builds random weights for six layers (about 1 GB).
"""

from __future__ import annotations

import argparse
import collections

import torch

from dsv41_decode.config import ModelConfig
from dsv41_decode.decode import attention
from dsv41_decode.stack import AttentionStack
from dsv41_decode.state import DecodeState
from dsv41_decode.testing.synthetic import random_checkpoint


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--max-rows", type=int, default=64)
    args = ap.parse_args()
    cfg = ModelConfig.preset("v41-flash")
    attention._few_programs = lambda device: False          # plan as on the GPU (132 SMs)
    counts = collections.Counter(f"{s.label}/r{s.ratio}" for s in cfg.plan[:cfg.n_layers])
    reps: dict[str, int] = {}
    for s in cfg.plan[:cfg.n_layers]:
        reps.setdefault(f"{s.label}/r{s.ratio}", s.layer)
    ids = sorted(set(reps.values()) | {cfg.plan[L].kv_source for L in reps.values() if cfg.plan[L].kv_source is not None}
                 | {cfg.plan[L].index_source for L in reps.values() if cfg.plan[L].index_source is not None})
    torch.manual_seed(0)
    stack = AttentionStack(random_checkpoint(cfg, "cpu", layers=ids, progress=False), ids)
    state = DecodeState(cfg, max_requests=args.max_rows, max_context=4096, page_size=64, device="cpu",
                        stage_rows=args.max_rows)
    step = stack.decode_step(state, max_rows=args.max_rows)
    total = 0
    for kind, L in reps.items():
        mb = step.layers[L].memory_bytes() / 2**20
        total += mb * counts[kind]
        print(f"layer {L:2d} {kind:13s} x{counts[kind]:2d}: {mb:7.1f} MiB per layer")
    print(f"40 layers at max_rows={args.max_rows}: {total:.0f} MiB of weight copies and kernel workspaces")
    mem = step.memory_bytes()
    pool = mem["workspaces"] / 2**20
    print(f"the main-stream kernels' workspaces, shared by all layers (once): {pool:.1f} MiB")
    others = sum(v for k, v in mem.items() if k not in ("layers", "workspaces")) / 2**20
    print("shared families of this subset's step (MiB):",
          {k: round(v / 2**20, 1) for k, v in mem.items() if k != "layers"})
    print(f"the step's own memory at max_rows={args.max_rows}: about {total + pool + others:.0f} MiB "
          f"(40 layers, the pool, this subset's other shared families)")


if __name__ == "__main__":
    main()
