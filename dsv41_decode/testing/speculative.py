"""Speculative decoding against the run that only ever saw the accepted tokens (spec decision 12).

A *drafted* run serves each request 1 + d rows per call (its next token, then d draft tokens), and
the sampler keeps a prefix of them (`DecodeState.accept`); a rejected row's input is junk that the
accepted-only run never sees. The *accepted-only* run serves the same requests with only the kept
rows, call by call. Both runs must give the kept rows the same outputs, and leave the same state
in everything a later call reads (`held_state`).

    plan = acceptance_plan(["a", "b"], steps=12, max_drafts=3, seed=0)
    truth = true_inputs(cfg, {"a": 40, "b": 40}, seed=1)
    drafted = serve(run_drafted, truth, plan, junk_seed=2, accept=state.accept)
    only = serve(run_only, truth, plan)                 # no drafts, no accept
    assert same_outputs(drafted, only)

`run(x, rows)` is one call: streams x [N, hc, dim] BF16 for `rows` = [(req_id, count), ...]; it
returns (streams, pre) of the N rows (`AttentionStack.forward` after `DecodeState.plan`, or a
`DecodeStep`).
"""

from __future__ import annotations

import random
from typing import Callable, Hashable, Mapping, Sequence

import torch

from ..config import ModelConfig
from ..state import DecodeState

Run = Callable[[torch.Tensor, list], tuple[torch.Tensor, torch.Tensor]]


def acceptance_patterns(max_drafts: int) -> list[tuple[int, int]]:
    """Every (drafts d, kept k) with 1 <= d <= max_drafts and 1 <= k <= 1 + d."""
    return [(d, k) for d in range(1, max_drafts + 1) for k in range(1, d + 2)]


def acceptance_plan(requests: Sequence[Hashable], steps: int, max_drafts: int,
                    seed: int = 0) -> list[dict[Hashable, tuple[int, int]]]:
    """Per call, per request, (drafts d, kept k): each request goes through every pattern of
    `acceptance_patterns(max_drafts)` (in its own shuffled order) and then random ones, plain rows
    (d = 0) among them. Deterministic in `seed`."""
    rng = random.Random(seed)
    pats = acceptance_patterns(max_drafts)
    order = {r: rng.sample(pats, len(pats)) for r in requests}
    plan = []
    for k in range(steps):
        call = {}
        for r in requests:
            if k < len(order[r]):
                call[r] = order[r][k]
            else:
                d = rng.randint(0, max_drafts)
                call[r] = (d, rng.randint(1, d + 1))
        plan.append(call)
    return plan


def true_inputs(cfg: ModelConfig, lengths: Mapping[Hashable, int], seed: int = 0,
                device: str | torch.device = "cpu") -> dict[Hashable, torch.Tensor]:
    """Per request, the streams [n, hc, dim] BF16 of its accepted tokens (N(0, 1) values)."""
    g = torch.Generator().manual_seed(seed)
    return {r: torch.randn(n, cfg.hc_mult, cfg.dim, generator=g).to(torch.bfloat16).to(device)
            for r, n in lengths.items()}


def needed_tokens(plan: Sequence[Mapping[Hashable, tuple[int, int]]]) -> dict[Hashable, int]:
    """Accepted tokens each request gets over `plan` (what `true_inputs` must provide)."""
    out: dict[Hashable, int] = {}
    for call in plan:
        for r, (_, k) in call.items():
            out[r] = out.get(r, 0) + k
    return out


def serve(run: Run, truth: Mapping[Hashable, torch.Tensor], plan, junk_seed: int | None = None,
          accept: Callable[[dict], None] | None = None, after: Callable[[int], None] | None = None
          ) -> dict[Hashable, list[tuple[torch.Tensor, torch.Tensor]]]:
    """Serve `plan` and return, per request, (streams, pre) of each kept row in position order.

    truth[r][i]: the input of request r's i-th accepted token in this run (after whatever it held
    before). junk_seed None: the accepted-only run (k rows per request and call). Otherwise the
    drafted run: 1 + d rows, the first k of them the true inputs, the rest junk (random, never a
    true input), then `accept({r: k})`. after(k) is called once call k is done (and accepted).
    """
    gen = torch.Generator().manual_seed(junk_seed) if junk_seed is not None else None
    done = {r: 0 for r in truth}
    out: dict[Hashable, list] = {r: [] for r in truth}
    for step, call in enumerate(plan):
        xs, rows = [], []
        for r, (d, k) in call.items():
            x = truth[r][done[r]:done[r] + k]
            if gen is not None and d + 1 > k:
                junk = torch.randn(d + 1 - k, *x.shape[1:], generator=gen).to(x.dtype).to(x.device)
                x = torch.cat([x, junk])
            xs.append(x)
            rows.append((r, x.shape[0]))
        y, pre = run(torch.cat(xs), rows)
        at = 0
        for (r, (d, k)), (_, n) in zip(call.items(), rows):
            out[r] += [(y[at + i], pre[at + i]) for i in range(k)]
            at += n
            done[r] += k
        if gen is not None and accept is not None:
            accept({r: k for r, (_, k) in call.items()})
        if after is not None:
            after(step)
    return out


def first_difference(a: Mapping[Hashable, list], b: Mapping[Hashable, list]) -> str | None:
    """None when both runs gave every kept row the same bits, else a line naming the first row that
    differs (request, index among its kept rows)."""
    for r in a:
        if len(a[r]) != len(b[r]):
            return f"request {r!r}: {len(a[r])} vs {len(b[r])} kept rows"
        for i, ((x, p), (y, q)) in enumerate(zip(a[r], b[r])):
            if not (torch.equal(x, y) and torch.equal(p, q)):
                err = (x.float() - y.float()).abs().max().item()
                return f"request {r!r}, kept row {i}: outputs differ (max |diff| {err:.3g})"
    return None


def held_state(state: DecodeState, req_id: Hashable, layers: Sequence[int] | None = None
               ) -> dict[str, torch.Tensor | int]:
    """What a later call can read of `req_id`, as raw bytes / bits (for equality across states of
    any ring size): its length, per layer the window records of positions length-W .. length-1,
    per KV source the compressed-KV and index-key records of entries 0 .. length // r - 1, and
    per ratio-2 source the compressor's open group (both rows).

    layers: the layers the calls run (`AttentionStack.ids`; None: every layer of the state). A
    state holds buffers for every layer of the configuration, but a stack of some layers never
    writes or reads the others: their rings hold only what was there before the calls (a cached
    prefix's records at the slots of `p % ring_size`, which alias other positions under another
    ring size) and their open groups whatever `accept` copied from rows no call wrote, in either
    run, so they are not held state and are left out."""
    s, n, W = state.slot(req_id), state.length(req_id), state.window_size
    dev = state.device
    keep = set(state.window) if layers is None else set(layers)
    out: dict[str, torch.Tensor | int] = {"length": n}
    pos = torch.arange(max(0, n - W), n, device=dev)
    ring = state.window_slots(torch.full_like(pos, s), pos)
    for L, pool in state.window.items():
        if L in keep:
            out[f"window.{L}"] = pool[ring]
    for L in state.kv_sources:
        if L not in keep:
            continue
        r = state.cfg.ratio(L)
        idx = state.entry_slots(r, s, torch.arange(n // r, device=dev))
        out[f"compressed.{L}"] = state.compressed[L][idx]
        out[f"index_keys.{L}"] = state.index_keys[L][idx]
    for L in state.comp_kv:
        if L in keep:
            kv, score = state.open_group(L, s)     # as the next call reads it (a deferred accept's too)
            out[f"comp_kv.{L}"] = kv.view(torch.int32)
            out[f"comp_score.{L}"] = score.view(torch.int32)
    return out


def state_difference(a: DecodeState, b: DecodeState, requests: Sequence[Hashable],
                     layers: Sequence[int] | None = None) -> str | None:
    """None when `held_state` (of `layers`: the stack's; None: every layer) of every request is
    bit-identical in both states, else a line naming the first request and buffer that differ."""
    for r in requests:
        ha, hb = held_state(a, r, layers), held_state(b, r, layers)
        for key, va in ha.items():
            vb = hb[key]
            same = va == vb if isinstance(va, int) else (va.shape == vb.shape and torch.equal(va, vb))
            if not same:
                return f"request {r!r}: {key} differs"
    return None
