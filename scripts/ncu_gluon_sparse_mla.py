"""One Gluon sparse MLA configuration (`ops.gluon_sparse_mla`) at V4.1-Flash's key list (128 window +
512 compressed keys) and one row and head count, called a few times, for Nsight Compute to profile
on a GPU (sm_90): what a launch's time is made of (warp stalls, issue slots, pipes, occupancy)
where timing alone cannot say, e.g. the combination "pv"'s second launch, which runs a row's blocks
in series at about 1.7 us a block (`docs/attn.md`):

    ncu --clock-control none --kernel-name regex:_gluon_mla_pv_kernel --launch-skip 3 --launch-count 1 \\
        --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section Occupancy \\
        --section ComputeWorkloadAnalysis --section LaunchStats --section SourceCounters \\
        python scripts/ncu_gluon_sparse_mla.py --config=pv1 --rows=64 --heads=64

--config: a name of `scripts/probe_gluon_sparse_mla.py`'s CONFIGS (default pv1); --rows: 1-64;
--heads: 8, 16, 32 or 64; --calls: calls made (default 5). Prints the configuration and its bits
against the default configuration's (`=` or the count of differing outputs); the times are ncu's.
"""

from __future__ import annotations

import torch

from dsv41_decode.bench.attn import TOPK as K, WINDOW as W, sparse_mla_inputs
from dsv41_decode.ops import gluon_sparse_mla as G
from dsv41_decode.ops.sparse_mla import HEAD_DIM

from _args import arg   # scripts/ is on sys.path when run as python scripts/<probe>.py
from probe_gluon_sparse_mla import CONFIGS


def main() -> None:
    name = arg("config", "pv1")
    if name not in CONFIGS:
        raise SystemExit(f"--config must be one of {sorted(CONFIGS)}, got {name!r}")
    rows, heads = int(arg("rows", "64")), int(arg("heads", "64"))
    gen = torch.Generator(device="cuda").manual_seed(rows + heads)
    q, win, comp, wtab, ctab, sink = sparse_mla_inputs(rows, heads, gen)
    scale = HEAD_DIM ** -0.5
    plan = G.GluonSparseMlaPlan.build(rows, heads, W, K, "cuda", config=CONFIGS[name])
    out = torch.empty_like(q)
    for _ in range(int(arg("calls", "5"))):
        G.gluon_sparse_mla_(plan, q, win, comp, wtab, ctab, sink, scale, out)
    want = torch.empty_like(q)
    G.gluon_sparse_mla_(G.GluonSparseMlaPlan.build(rows, heads, W, K, "cuda"), q, win, comp, wtab, ctab, sink,
                        scale, want)
    torch.cuda.synchronize()
    diff = int((out.view(torch.int16) != want.view(torch.int16)).sum())
    print(f"{name} rows={rows} heads={heads} {CONFIGS[name]}: bits {'=' if diff == 0 else f'{diff} differ'}",
          flush=True)


if __name__ == "__main__":
    main()
