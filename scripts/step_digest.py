"""Digest of a fixed run of the decode step: equal digests mean equal bits.

Builds a random checkpoint of a preset (seeded), a state with four requests filled to fixed
lengths, and `stack.decode_step(state, max_rows=8)`; runs five steps of 1-8 rows (draft rows
included, each followed by `accept`) and prints a SHA-256 over the outputs (streams, pre) and the
state's caches afterwards. Uses only the public step API, so the same script run against another
tree of the package (`PYTHONPATH=that/tree`) checks that a change keeps the step's bits:

    git archive <commit> dsv41_decode | (mkdir -p out/before && tar -x -C out/before)
    PYTHONPATH=out/before python scripts/step_digest.py --device cuda
    PYTHONPATH=. python scripts/step_digest.py --device cuda          # must print the same digest
"""

from __future__ import annotations

import argparse
import hashlib

import torch

from dsv41_decode.config import ModelConfig
from dsv41_decode.stack import AttentionStack
from dsv41_decode.state import DecodeState
from dsv41_decode.testing.synthetic import fill_state, random_checkpoint

STEPS = ([(0, 1)], [(1, 4), (2, 1)], [(3, 2), (0, 3)], [(2, 4), (1, 4)], [(0, 1), (1, 1), (2, 1), (3, 1)])
CACHES = ("window", "compressed", "index_keys", "comp_kv", "comp_score")


def digest(device: str, preset: str, layers: list[int] | None) -> str:
    cfg = ModelConfig.preset(preset)
    stack = AttentionStack(random_checkpoint(cfg, device, seed=0, layers=layers, progress=False), layers)
    state = DecodeState(cfg, max_requests=4, max_context=512, page_size=16, device=device, stage_rows=8,
                        max_drafts=3)
    fill_state(state, {0: 40, 1: 100, 2: 7, 3: 200})
    step = stack.decode_step(state, max_rows=8)
    gen = torch.Generator().manual_seed(1)
    h = hashlib.sha256()

    def add(t: torch.Tensor) -> None:
        h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    for rows in STEPS:
        n = sum(c for _, c in rows)
        x = torch.randn(n, cfg.hc_mult, cfg.dim, generator=gen).to(torch.bfloat16).to(device)
        for t in step(x, rows):
            add(t)
        step.accept({rows[0][0]: 1})
    # the open groups a deferred accept left to the next call (a tree without sync restores them in accept)
    getattr(state, "sync", lambda: None)()
    for name in CACHES:
        for _, t in sorted(getattr(state, name).items()):
            add(t)
    return h.hexdigest()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--preset", default="small")
    ap.add_argument("--layers", default=None, help="comma-separated layer ids (default: all)")
    args = ap.parse_args()
    layers = None if args.layers is None else [int(i) for i in args.layers.split(",")]
    print(f"{args.preset} {args.device} {digest(args.device, args.preset, layers)}")


if __name__ == "__main__":
    main()
