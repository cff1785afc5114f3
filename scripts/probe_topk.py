"""Probe the top-k and candidate-mask kernels (`ops/topk.py`) on a GPU at the step's plans (top-512,
group 1; 2048 blocks of 8, chunk 512): graph-replay time per call and the determinism of 10 eager
runs, rows x visible entries, on BF16 randn scores and on tie-heavy ones (a handful of BF16 values).

Top-k columns (us per call): `four` the four-launch path (`separate_count=True`, FP32 scores: the
path before the linked one); per score dtype (fp32, bf16) `linked` the linked path's three
launches and `ready` its two with `hist_ready`. A scorer adds the histogram in its own launch; here
the graph copies a precomputed one into the plan before each call, so `ready` is that pair's time
less the copy's alone (`copy`, printed once per case). `distinct`: how many different results 10
runs of the linked path gave (1: deterministic); `same`: whether every path and dtype gave the
four-launch path's bits. `mask` (with `--mask=1`): the candidate mask's time. With `--table=1`
(FP32 scores, the first chunk/warps pair, pages of 64 entries): `+slots` the `ready` pair followed by
`topk_slots_` (the sparse-index table as its own launch) and `+table` the `ready` pair writing the
table itself (`table=`), both less the copy; `tsame`: whether both gave the same table and lengths
(not with `--one=1`: the one-launch top-k has no table).

Options: `--rows=1,4,16,64`, `--entries=32768,131072,1048576`, `--dist=randn` (or `randn,few`),
`--chunks=1024` and `--warps=4` (lists: every pair is a plan for the linked columns; the default is
`TopKPlan`'s, the step's; the four-launch path keeps chunk 4096, 4 warps), `--dtypes=fp32,bf16` (the linked columns' score dtypes; a column
left out prints 0), `--pdl=0` (1: the linked launches with PDL), `--one=0` (1: the linked columns
time the one-launch top-k, `one_launch=True`, instead; its chunk grows until the grid fits the
SMs), `--mask=0`, `--table=0`.
`--module=PATH` times another copy of the module's `topk_ascending_` / `candidate_mask_` in the
`four` column instead (e.g. an earlier version written out with `git show
REV:dsv41_decode/ops/topk.py > /tmp/topk_rev.py`). Prints; writes nothing. The default set runs in
about a minute on an H200.
"""

from __future__ import annotations

import importlib.util
import sys

import torch

from dsv41_decode.bench.timing import graph_time_us
from dsv41_decode.ops import topk
from dsv41_decode.ops.sparse_tables import topk_slots_

from _args import arg   # scripts/ is on sys.path when run as python scripts/<probe>.py

FEW = (2.0, 1.0, 0.5, 0.0, -1.5, float("-inf"))


def _module(path: str):
    if not path:
        return None
    spec = importlib.util.spec_from_file_location("topk_probe_alt", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod          # dataclasses look their module up by name
    spec.loader.exec_module(mod)
    return mod


def _scores(rows: int, entries: int, dist: str, g: torch.Generator) -> torch.Tensor:
    if dist == "few":
        vals = torch.tensor(FEW, device="cuda")
        return vals[torch.randint(0, len(vals), (rows, entries), generator=g, device="cuda")]
    return torch.randn(rows, entries, generator=g, device="cuda").bfloat16().float()


def _ints(name: str, default: str) -> list[int]:
    return [int(v) for v in arg(name, default).split(",")]


def _table_columns(s, nv, idx, plan, h, one, t_copy, g) -> str:
    """`+slots`, `+table` and `tsame` of the module docstring for FP32 scores s (plan: fresh-zeroed
    histograms and counters, h: s's high-byte histogram)."""
    rows, entries = s.shape
    page = 64
    pages = -(-entries // page)
    bt = torch.randperm(rows * pages, generator=g, device="cuda").to(torch.int32).reshape(rows, pages)
    req = torch.arange(rows, device="cuda").flip(0).contiguous()
    tab = [torch.empty(rows, 512, dtype=torch.int32, device="cuda") for _ in range(2)]
    lens = [torch.empty(rows, dtype=torch.int32, device="cuda") for _ in range(2)]

    def slots():
        plan.hist_hi[:rows].copy_(h)
        topk.topk_ascending_(s, nv, idx, plan, hist_ready=True, **one)
        topk_slots_(idx, req, bt, page, tab[0], lens[0])

    def table():
        plan.hist_hi[:rows].copy_(h)
        topk.topk_ascending_(s, nv, idx, plan, hist_ready=True, table=(req, bt, page, tab[1], lens[1]), **one)

    t_slots = graph_time_us(slots, replays=30) - t_copy
    t_table = graph_time_us(table, replays=30) - t_copy
    slots()
    table()
    same = torch.equal(tab[0], tab[1]) and torch.equal(lens[0], lens[1])
    return f" {t_slots:7.2f} {t_table:7.2f} {'yes' if same else 'NO':>5s}"


def main() -> None:
    alt = _module(arg("module", ""))
    rows_list = _ints("rows", "1,4,16,64")
    entries_list = _ints("entries", "32768,131072,1048576")
    dists = arg("dist", "randn").split(",")
    configs = [(c, w) for c in _ints("chunks", "1024") for w in _ints("warps", "4")]
    pdl = arg("pdl", "0") == "1"
    one = {"one_launch": True} if arg("one", "0") == "1" else {"pdl": pdl, "separate_count": False}
    dtypes = [{"fp32": torch.float32, "bf16": torch.bfloat16}[d] for d in arg("dtypes", "fp32,bf16").split(",")]
    with_mask = arg("mask", "0") == "1"
    with_table = arg("table", "0") == "1"
    if with_table and "one_launch" in one:
        raise SystemExit("--table=1: not with --one=1 (the one-launch top-k has no table)")
    g = torch.Generator(device="cuda").manual_seed(0)
    print(f"four-launch column: {alt.__file__ if alt else 'separate_count=True'}; linked columns: {one}")
    print(f"{'dist':>5s} {'rows':>4s} {'entries':>8s} {'chunk':>5s} {'warps':>5s} {'four':>7s} {'copy':>6s} "
          f"{'fp32 linked':>11s} {'fp32 ready':>10s} {'bf16 linked':>11s} {'bf16 ready':>10s} {'distinct':>8s} "
          f"{'same':>4s}" + (f" {'mask':>7s}" if with_mask else "")
          + (f" {'+slots':>7s} {'+table':>7s} {'tsame':>5s}" if with_table else ""))
    for dist in dists:
        for entries in entries_list:
            for rows in rows_list:
                if rows * entries > (64 << 20):
                    continue
                s = _scores(rows, entries, dist, g)
                sb = s.bfloat16()
                nv = torch.full((rows,), entries, dtype=torch.int32, device="cuda")
                nv[1::2] -= 7                                       # odd rows see a few entries fewer
                idx = torch.empty(rows, 512, dtype=torch.int32, device="cuda")
                if alt:
                    aplan = alt.TopKPlan.build(rows, 512, 1, "cuda")
                    t_four = graph_time_us(lambda: alt.topk_ascending_(s, nv, idx, aplan), replays=30)
                else:
                    aplan = topk.TopKPlan.build(rows, 512, 1, "cuda", chunk=4096)
                    t_four = graph_time_us(lambda: topk.topk_ascending_(s, nv, idx, aplan, separate_count=True),
                                           replays=30)
                want = topk.topk_ascending_(s, nv, torch.empty_like(idx), topk.TopKPlan.build(rows, 512, 1, "cuda"),
                                            separate_count=True)
                hist = {x.dtype: topk.key_high_histogram(x, nv) for x in (s, sb)}
                t_mask = 0.0
                if with_mask:
                    cplan = topk.TopKPlan.build(rows, 2048, 8, "cuda", chunk=512)
                    mask = torch.empty(rows, entries, dtype=torch.uint8, device="cuda")
                    t_mask = graph_time_us(lambda: topk.candidate_mask_(s, nv, mask, cplan), replays=30)
                    del mask
                t_copy = None
                for chunk, warps in configs:
                    times, same = dict.fromkeys([(d, c) for d in (torch.float32, torch.bfloat16)
                                                 for c in ("linked", "ready")], 0.0), True
                    for x in (s, sb):
                        if x.dtype not in dtypes:
                            continue
                        plan = topk.TopKPlan.build(rows, 512, 1, "cuda", chunk=chunk, warps=warps,
                                                   wide_chunk=chunk, wide_warps=warps)
                        h = hist[x.dtype]

                        def copy(plan=plan, h=h):
                            plan.hist_hi[:rows].copy_(h)

                        def ready(x=x, plan=plan, copy=copy):
                            copy()
                            topk.topk_ascending_(x, nv, idx, plan, hist_ready=True, **one)

                        times[x.dtype, "linked"] = graph_time_us(
                            lambda x=x, plan=plan: topk.topk_ascending_(x, nv, idx, plan, **one), replays=30)
                        if t_copy is None:
                            t_copy = graph_time_us(copy, replays=30)
                            plan.ws.zero_()
                        times[x.dtype, "ready"] = graph_time_us(ready, replays=30) - t_copy
                        ready()
                        same &= torch.equal(idx, want)
                        same &= torch.equal(topk.topk_ascending_(x, nv, torch.empty_like(idx), plan, **one), want)
                    plan = topk.TopKPlan.build(rows, 512, 1, "cuda", chunk=chunk, warps=warps)
                    runs = {topk.topk_ascending_(s, nv, torch.empty_like(idx), plan, **one).cpu().numpy().tobytes()
                            for _ in range(10)}
                    tab_cols = _table_columns(s, nv, idx, plan, hist[torch.float32], one, t_copy, g) \
                        if with_table and (chunk, warps) == configs[0] else ""
                    print(f"{dist:>5s} {rows:4d} {entries:8d} {chunk:5d} {warps:5d} {t_four:7.2f} {t_copy:6.2f} "
                          f"{times[torch.float32, 'linked']:11.2f} {times[torch.float32, 'ready']:10.2f} "
                          f"{times[torch.bfloat16, 'linked']:11.2f} {times[torch.bfloat16, 'ready']:10.2f} "
                          f"{len(runs):8d} {'yes' if same else 'NO':>4s}" + (f" {t_mask:7.2f}" if with_mask else "")
                          + tab_cols, flush=True)
                del s, sb


if __name__ == "__main__":
    main()
