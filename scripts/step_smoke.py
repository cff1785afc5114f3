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

# teacher-forced: each layer of one eager step against the reference layer on the same input
from dsv41_decode.decode.attention import AttentionStep  # noqa: E402
from dsv41_decode.layer import CallContext  # noqa: E402

cap = {}
orig = AttentionStep.run


def run(self, rows, u, c, s, y, shared):
    uu = u.clone()
    orig(self, rows, u, c, s, y, shared)
    cap[self.spec.layer] = (uu, y.clone())
    if self.spec.runs_indexer:
        cap[("topk", self.spec.layer)] = self.selections[self.spec.layer].topk[:rows].clone()


AttentionStep.run = run
base = copy.deepcopy(states[1])
rows = [("a", 1), ("b", 4), ("c", 2)]
x = torch.randn(7, cfg.hc_mult, cfg.dim, generator=g, device="cuda").to(torch.bfloat16)
eager_step(x, rows)
sp = base.plan(rows)
ctx = CallContext()
for i in stack.ids:
    u, y = cap[i]
    yr = stack.layers[i].forward(u[:7], sp, base, ctx)
    msg = f"layer {i} {cfg.plan[i].label}: y rel {((y[:7].float() - yr.float()).norm() / yr.float().norm()).item():.2e}"
    if ("topk", i) in cap:
        mine = [set(t[t >= 0].tolist()) for t in cap[("topk", i)][:7]]
        ref = [set(t[t >= 0].tolist()) for t in ctx.topk[i]]
        msg += f", top-k rows equal {sum(a == b for a, b in zip(mine, ref))}/7"
    print(msg)
