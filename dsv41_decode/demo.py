"""The demo: serve several requests through the reference stack and check decode against prefill.

Run A serves the requests as an engine would: one call prefills every prompt (of different
lengths), then K decode steps, some requests carrying draft rows (1 + d rows at p, p+1, ...) of
which a random prefix is accepted (speculative decoding: the rejected rows get junk inputs, and
`DecodeState.accept` drops them). Run B prefills each request's accepted sequence in one call: the
run that never saw a rejected token. The reference is batch-invariant, so every layer's output at
every decoded position must agree bit for bit; the demo prints the agreement and the time per step
for each layer kind.
"""

from __future__ import annotations

import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from .config import ModelConfig
from .layer import CallContext
from .parallel import TensorParallel
from .runtime import Steps
from .stack import AttentionStack
from .state import DecodeState
from .testing.compare import selected, ulp_distance
from .weights import load_checkpoint, write_synthetic_checkpoint


@dataclass
class DemoPlan:
    prompts: tuple[int, ...] = (37, 64, 5, 90)     # prompt lengths (odd, across the window, ...)
    drafts: tuple[int, ...] = (2, 0, 3, 0)          # draft rows per decode step, per request
    steps: int = 6
    seed: int = 0                                   # weights, inputs and which drafts are accepted


@dataclass
class KindStats:
    layers: set = field(default_factory=set)
    rows: int = 0
    bitwise: int = 0
    max_ulp: float = 0.0
    topk_equal: int = 0
    topk_rows: int = 0
    decode_s: float = 0.0
    prefill_s: float = 0.0


@dataclass
class DemoResult:
    """What a demo run found: the per-kind figures, and whether every rank of a tensor-parallel
    group held the same outputs (True on one rank)."""
    stats: dict[str, KindStats]
    ranks_same: bool = True

    @property
    def ok(self) -> bool:
        """Decode equals prefill at every decoded position and the ranks agree."""
        return self.ranks_same and all(s.bitwise == s.rows for s in self.stats.values())


_PHASE = {None: "prefill", "decode_s": "decode step", "prefill_s": "whole-sequence prefill"}


def _run(stack, state, calls, embed, stats, progress, junk=None):
    """Run `calls` ((phase, [(req_id, start, count, kept)]) pairs; the time of each layer kind is
    added to `stats[kind].<phase>` unless phase is None); return {(layer, req, pos): (attn_out,
    topk)}. A request's first `kept` rows take its tokens `embed[r][start:start + kept]`, the other
    rows (rejected drafts) random inputs from `junk`, and `state.accept` keeps the first `kept`."""
    cfg = stack.cfg
    out = {}
    for phase, call in calls:
        step = state.plan([(r, n) for r, _, n, _ in call])
        x = torch.cat([torch.cat([embed[r][s:s + k], torch.randn(n - k, cfg.dim, generator=junk).to(torch.bfloat16)])
                       for r, s, n, k in call]).to(state.device)
        x = x[:, None].expand(-1, cfg.hc_mult, -1).contiguous()
        ctx = CallContext()
        keys = [(r, s + j) for r, s, n, _ in call for j in range(n)]
        last = [time.perf_counter()]

        def observe(i, rec, keys=keys, ctx=ctx, last=last, phase=phase):
            if phase is not None:
                st = stats[cfg.plan[i].label]
                setattr(st, phase, getattr(st, phase) + time.perf_counter() - last[0])
            src = cfg.plan[i].index_source
            for k, key in enumerate(keys):
                sel = ctx.topk[src][k] if src is not None else None
                out[(i, *key)] = (rec.attn_out[k], sel)
            last[0] = time.perf_counter()

        stack.forward(x, step, state, ctx=ctx, observe=observe)
        state.accept({r: k for r, _, n, k in call if k < n})
        progress.advance(f"{_PHASE[phase]}, {len(call)} request(s), {len(keys)} rows")
    return out


def run_demo(cfg: ModelConfig, plan: DemoPlan, device: str = "cpu", console: Console | None = None,
             tp: TensorParallel | None = None, checkpoint: str | Path | None = None) -> DemoResult:
    """Run the demo and print its table (rank 0 under tensor parallelism); returns the per-kind
    figures and whether the ranks agree (`DemoResult.ok`: what the command's exit status says).

    tp: this process's rank of a tensor-parallel group: every rank runs the demo on its shard of
    the heads and groups, and the table adds whether every rank holds the same outputs.
    checkpoint: a checkpoint folder to load (its configuration must be `cfg`'s plan) instead of
    writing a synthetic one of `cfg`. Progress: a line per call on stderr when it is not a terminal.
    """
    tp = tp or TensorParallel()
    console = console or Console(quiet=tp.rank != 0)
    if len(plan.prompts) != len(plan.drafts):
        raise ValueError("prompts and drafts need one entry per request")
    reqs = [f"req{i}" for i in range(len(plan.prompts))]
    g = torch.Generator().manual_seed(plan.seed)
    # the sampler's verdict: each step keeps a random prefix (1 .. 1 + d rows) of each request's rows
    kept = [[int(torch.randint(1, d + 2, (1,), generator=g)) for d in plan.drafts] for _ in range(plan.steps)]
    total = {r: p + sum(k[i] for k in kept) for i, (r, p) in enumerate(zip(reqs, plan.prompts))}
    embed = {r: torch.randn(total[r], cfg.dim, generator=g).to(torch.bfloat16) for r in reqs}
    if checkpoint is not None:
        ckpt = load_checkpoint(checkpoint, device=device, config=cfg)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            write_synthetic_checkpoint(cfg, tmp, seed=plan.seed)
            ckpt = load_checkpoint(tmp, device=device)
    stack = AttentionStack(ckpt, tp=tp)
    stats: dict[str, KindStats] = defaultdict(KindStats)
    for s in cfg.plan:
        stats[s.label].layers.add(s.layer)

    def new_state():
        st = DecodeState(cfg, max_requests=len(reqs), max_context=max(total.values()) + max(plan.drafts),
                         device=device, max_drafts=max(plan.drafts))
        for r in reqs:
            st.admit(r)
        return st

    serve = [(None, [(r, 0, p, p) for r, p in zip(reqs, plan.prompts)])]
    start = list(plan.prompts)
    for k in range(plan.steps):
        serve.append(("decode_s", [(r, start[i], 1 + d, kept[k][i])
                                   for i, (r, d) in enumerate(zip(reqs, plan.drafts))]))
        start = [s + kept[k][i] for i, s in enumerate(start)]
    oneshot = [("prefill_s", [(r, 0, total[r], total[r])]) for r in reqs]
    with Steps("demo: call", len(serve) + len(oneshot),
               Console(stderr=True), quiet=tp.rank != 0) as progress:
        a = _run(stack, new_state(), serve, embed, stats, progress, torch.Generator().manual_seed(plan.seed + 1))
        b = _run(stack, new_state(), oneshot, embed, stats, progress)
    # every kept position (a rejected row's position is decoded again later, or lies past the end)
    decoded = {(i, r, p) for (i, r, p) in a if plan.prompts[reqs.index(r)] <= p < total[r]}
    for key in sorted(decoded, key=str):
        st = stats[cfg.plan[key[0]].label]
        (ya, ta), (yb, tb) = a[key], b[key]
        st.rows += 1
        st.bitwise += int(torch.equal(ya, yb))
        st.max_ulp = max(st.max_ulp, ulp_distance(ya, yb))
        if ta is not None:
            st.topk_rows += 1
            st.topk_equal += int(selected(ta) == selected(tb))
    same = tp.same_on_all_ranks(torch.stack([a[k][0] for k in sorted(a, key=str)]))
    drafted = plan.steps * sum(plan.drafts)
    accepted = sum(k - 1 for step in kept for k in step)
    _print(console, cfg, plan, stats, sum(total.values()), tp, same, (accepted, drafted))
    return DemoResult(dict(stats), same)


def _print(console, cfg, plan, stats, n_tokens, tp: TensorParallel, ranks_same: bool,
           drafts_accepted: tuple[int, int] = (0, 0)) -> None:
    where = f", tp={tp.tp} (gloo processes)" if tp.tp > 1 else f", {torch.get_num_threads()} CPU thread(s)"
    t = Table(title=f"decode vs prefill, {len(cfg.plan)} layers, {len(plan.prompts)} requests, "
                    f"{plan.steps} steps (drafts {list(plan.drafts)}, {drafts_accepted[0]} of "
                    f"{drafts_accepted[1]} draft rows accepted){where}")
    for col in ("layer kind", "layers", "decoded rows", "bitwise equal", "max ulp", "top-k sets equal",
                "decode ms/step", "prefill ms/token"):
        t.add_column(col, justify="right")
    for label in ("swa", "full", "full+cand", "reindex", "reuse"):
        if label not in stats:
            continue
        s = stats[label]
        topk = f"{s.topk_equal}/{s.topk_rows}" if s.topk_rows else "-"
        t.add_row(label, ",".join(map(str, sorted(s.layers))), str(s.rows), f"{s.bitwise}/{s.rows}",
                  f"{s.max_ulp:g}", topk, f"{1e3 * s.decode_s / plan.steps:.1f}",
                  f"{1e3 * s.prefill_s / n_tokens:.2f}")
    console.print(t)
    ok = all(s.bitwise == s.rows for s in stats.values())
    console.print("[green]decode equals prefill at every decoded position[/green]" if ok else
                  "[red]decode differs from prefill: see the table[/red]")
    if drafts_accepted[1]:
        console.print(f"(speculative decoding: {drafts_accepted[0]} of {drafts_accepted[1]} draft rows accepted at "
                      f"random, the rest dropped by DecodeState.accept; the prefill saw only the accepted tokens)")
    if tp.tp > 1:
        console.print(f"[green]all {tp.tp} ranks hold the same outputs[/green]" if ranks_same else
                      f"[red]the {tp.tp} ranks' outputs differ[/red]")


def run_demo_tp(cfg: ModelConfig, plan: DemoPlan, tp: int, console: Console,
                checkpoint: str | Path | None = None) -> bool:
    """Run the demo on `tp` gloo processes of this machine (CPU); True when decode equals prefill on
    every rank and the ranks agree. Rank 0 prints."""
    import torch.multiprocessing as mp
    with tempfile.TemporaryDirectory() as tmp:
        ctx = mp.get_context("spawn")
        results = ctx.Queue()
        procs = [ctx.Process(target=_demo_rank, args=(r, tp, cfg, plan, f"{tmp}/store", results, console.width,
                                                         checkpoint))
                 for r in range(tp)]
        for p in procs:
            p.start()
        oks = [results.get() for _ in procs]
        for p in procs:
            p.join()
    return all(oks) and all(p.exitcode == 0 for p in procs)


def _demo_rank(rank, world, cfg, plan, store, results, width, checkpoint=None) -> None:
    import torch.distributed as dist
    ok = False
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
        tp = TensorParallel(world, rank)
        ok = run_demo(cfg, plan, "cpu", Console(width=width, quiet=rank != 0), tp, checkpoint).ok
        dist.destroy_process_group()
    except Exception as e:   # one line per rank, as the command line prints its own errors
        import sys
        sys.stderr.write(f"dsv41-decode demo: rank {rank}: error: {' '.join(str(e).split())}\n")
        sys.stderr.flush()
    finally:
        results.put(ok)
