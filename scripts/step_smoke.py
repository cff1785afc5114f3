"""Quick GPU check of the specialized step on the `small` preset: graph vs eager vs generic path."""
import copy
import time

import torch

from dsv41_decode.config import ModelConfig
from dsv41_decode.stack import AttentionStack
from dsv41_decode.state import DecodeState
from dsv41_decode.testing.synthetic import fill_state, random_checkpoint

cfg = ModelConfig.preset("small")
stack = AttentionStack(random_checkpoint(cfg, "cuda", progress=False))
st = DecodeState(cfg, max_requests=4, max_context=1024, page_size=16, device="cuda", stage_rows=16)
fill_state(st, {"a": 300, "b": 77, "c": 5})
states = [copy.deepcopy(st) for _ in range(3)]
t = time.time()
graph_step = stack.decode_step(states[0], max_rows=16)
eager_step = stack.decode_step(states[1], max_rows=16, graphs=False)
print(f"built + captured in {time.time() - t:.1f} s")
g = torch.Generator(device="cuda").manual_seed(0)
for k in range(40):
    rows = [("a", 1), ("b", 4), ("c", 2)] if k % 3 else [("a", 3), ("c", 1)]
    n = sum(c for _, c in rows)
    x = torch.randn(n, cfg.hc_mult, cfg.dim, generator=g, device="cuda").to(torch.bfloat16)
    og, pg = graph_step(x, rows)
    oe, pe = eager_step(x, rows)
    ref, pref = stack.forward(x, states[2].plan(rows), states[2])
    err = ((og.float() - ref.float()).norm() / ref.float().norm()).item()
    print(f"step {k}: graph==eager {torch.equal(og, oe) and torch.equal(pg, pe)}, rel rms vs generic {err:.2e}")
