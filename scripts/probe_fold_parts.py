"""The parts of `DecodeStep(fold_index_chain=True)` one by one, recaptured on one 40-layer V4.1-Flash step
with its FP8 linears on tensor cores (`exact_linears=False`: the exact linears take no index query
in their epilogue, so with them only the table folds) (32K, graph replay): us per replay at 1 / 8 /
16 / 64 rows and whether the 8-row output is bitwise the first variant's, for
    off         neither part (the default step)
    all         the index query in the index GEMM's epilogue (with the head weights in weights_proj's)
                and the sparse-index table in the top-k's last launch
    iq_only     the first part alone
    table_only  the second part alone
then `off` again; after each `off` and `all`, the kernels (start into the layer, us, stream,
name) of layers 2, 20 and 24 at 1 row from one profiled replay. A profiled replay leaves the
profiler's overhead on the later replays (about 6 % on the H200): compare the variants with the
last `off`, not the first.

    PYTHONPATH=. python scripts/probe_fold_parts.py

(GPU, ~100 s on an H200.) The variants set the indexer layers' `fold_index_chain` and
`index_query_in_gemm` attributes before each capture, in this process only.
"""
import torch

from dsv41_decode.bench.step import _arm, output_and_times
from dsv41_decode.bench.step_timeline import replay_kernels
from dsv41_decode.config import ModelConfig
from dsv41_decode.stack import AttentionStack
from dsv41_decode.state import DecodeState
from dsv41_decode.testing.synthetic import fill_state, random_checkpoint

VARIANTS = {"off": (False, False), "all": (True, True), "iq_only": (False, True), "table_only": (True, False)}
ROWS = (1, 8, 16, 64)


def print_layers(name: str, kernels: list[dict], layers=(2, 20, 24)) -> None:
    """Each layer from the end of the boundary before it to the end of its own (the first layer's
    entry is also a boundary kernel): its length and its kernels."""
    bounds = [k for k in kernels if "boundary" in k["name"]]
    for L in layers:
        if L + 1 >= len(bounds):
            continue
        lo = bounds[L]["ts"] + bounds[L]["dur"]
        hi = bounds[L + 1]["ts"] + bounds[L + 1]["dur"]
        print(f"  {name} layer {L}: {hi - lo:.1f} us (boundary end to boundary end)")
        for k in kernels:
            if lo - 1 <= k["ts"] < hi and "boundary" not in k["name"]:
                print(f"    {k['ts'] - lo:7.1f} {k['dur']:6.1f} s{k['args'].get('stream')} {k['name'][:50]}")


def main() -> None:
    cfg = ModelConfig.preset("v41-flash")
    stack = AttentionStack(random_checkpoint(cfg, "cuda"))
    state = DecodeState(cfg, max_requests=64, max_context=32768 + 1024, page_size=64, device="cuda", max_drafts=3)
    fill_state(state, {i: 32768 for i in range(64)})
    step = stack.decode_step(state, max_rows=64, buckets=ROWS, fold_index_chain=True, exact_linears=False)
    idx_layers = [i for i, layer in step.layers.items() if layer.spec.runs_indexer]
    print("indexer layers", idx_layers, flush=True)
    first = None
    for name in ["off", "all", "iq_only", "table_only", "off"]:
        fold, iq = VARIANTS[name]
        for i in idx_layers:
            step.layers[i].fold_index_chain = fold
            step.layers[i].index_query_in_gemm = iq
        step.graphs = {}
        step._capture()
        out, t = output_and_times(step, ROWS)
        same = "-" if first is None else str(torch.equal(out, first))
        first = out if first is None else first
        print(f"{name:11s} | " + "  ".join(f"{r}: {t[r]:8.1f}" for r in ROWS) + f" us | 8-row out == off: {same}",
              flush=True)
        if name in ("off", "all"):
            _arm(step, [(0, 1)], torch.Generator(device="cuda").manual_seed(1))
            print_layers(name, replay_kernels(step.graphs[1]))


if __name__ == "__main__":
    main()
