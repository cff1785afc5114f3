"""Probe the top-k and candidate-mask kernels (`ops/topk.py`) on a GPU at the step's plans (top-512,
group 1; 2048 blocks of 8, chunk 512): graph-replay time per call and the determinism of 10 eager
runs, rows x visible entries, on BF16 randn scores and on tie-heavy ones (a handful of BF16 values).
`--module=PATH` times another copy of the module instead (e.g. an earlier version written out with
`git show REV:dsv41_decode/ops/topk.py > /tmp/topk_rev.py`), so two versions compare side by side.
`--rows=1,16,64`, `--entries=8192,131072,1048576`, `--dist=randn,few`. Prints; writes nothing.
"""

from __future__ import annotations

import importlib.util
import sys

import torch

from dsv41_decode.bench.timing import graph_time_us
from dsv41_decode.ops import topk as topk_default

from _args import arg   # scripts/ is on sys.path when run as python scripts/<probe>.py

FEW = (2.0, 1.0, 0.5, 0.0, -1.5, float("-inf"))


def _module(path: str):
    if not path:
        return topk_default
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


def main() -> None:
    mod = _module(arg("module", ""))
    rows_list = [int(r) for r in arg("rows", "1,4,16,64").split(",")]
    entries_list = [int(e) for e in arg("entries", "8192,32768,131072,262144,1048576").split(",")]
    dists = arg("dist", "randn,few").split(",")
    g = torch.Generator(device="cuda").manual_seed(0)
    print(f"module {mod.__file__}")
    print("distinct: how many different results 10 runs on the same scores gave (1: deterministic)")
    print(f"{'dist':>5s} {'rows':>4s} {'entries':>8s} {'topk us':>8s} {'mask us':>8s} {'topk distinct':>13s} "
          f"{'mask distinct':>13s}")
    for dist in dists:
        for entries in entries_list:
            for rows in rows_list:
                if rows * entries > (64 << 20):
                    continue
                s = _scores(rows, entries, dist, g)
                nv = torch.full((rows,), entries, dtype=torch.int32, device="cuda")
                nv[1::2] -= 7                                       # odd rows see a few entries fewer
                tplan = mod.TopKPlan.build(rows, 512, 1, "cuda")
                cplan = mod.TopKPlan.build(rows, 2048, 8, "cuda", chunk=512)
                idx = torch.empty(rows, 512, dtype=torch.int32, device="cuda")
                mask = torch.empty(rows, entries, dtype=torch.uint8, device="cuda")
                t_topk = graph_time_us(lambda: mod.topk_ascending_(s, nv, idx, tplan), replays=30)
                t_mask = graph_time_us(lambda: mod.candidate_mask_(s, nv, mask, cplan), replays=30)
                tk = {mod.topk_ascending_(s, nv, torch.empty_like(idx), tplan).cpu().numpy().tobytes()
                      for _ in range(10)}
                mk = {mod.candidate_mask_(s, nv, torch.empty_like(mask), cplan).cpu().numpy().tobytes()
                      for _ in range(10)}
                print(f"{dist:>5s} {rows:4d} {entries:8d} {t_topk:8.2f} {t_mask:8.2f} {len(tk):13d} {len(mk):13d}",
                      flush=True)
                del s, mask


if __name__ == "__main__":
    main()
