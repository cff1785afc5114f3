"""The PNG of `bench attn`: sparse-MLA time per row count and head count (FlashMLA's legacy SM90
decode as the dashed baseline, the Triton step tiling dotted), indexer-logits GB/s per context and
row count (the step's scorer, the Triton FP8 path and the BF16 path where the records hold them)
against the streaming read, and top-512 time per context."""

from __future__ import annotations

from pathlib import Path

from .results import runs_label


def plot_attn(rows: list[dict], path: str | Path) -> None:
    """Three panels from `bench attn` records (the JSON lines it writes); panels without records
    stay empty."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a_mla, a_idx, a_top) = plt.subplots(1, 3, figsize=(16, 4.6))
    mla = [r for r in rows if r["case"]["op"] == "sparse_mla"]
    for heads in sorted({r["case"]["heads"] for r in mla}):
        sel = sorted((r for r in mla if r["case"]["heads"] == heads), key=lambda r: r["case"]["rows"])
        a_mla.plot([r["case"]["rows"] for r in sel], [r["us"] for r in sel], "o-", label=f"ours, {heads} heads")
    fm = sorted((r for r in mla if r["case"]["heads"] == 64 and "flash_mla_v4_64h" in r["baselines"]),
                key=lambda r: r["case"]["rows"])
    if fm:
        a_mla.plot([r["case"]["rows"] for r in fm], [r["baselines"]["flash_mla_v4_64h"] for r in fm], "k.--",
                   label="FlashMLA legacy SM90, 64 heads, V4 record")
    tri = sorted((r for r in mla if r["case"]["heads"] == 64 and "triton_step" in r["baselines"]),
                 key=lambda r: r["case"]["rows"])
    if tri:
        a_mla.plot([r["case"]["rows"] for r in tri], [r["baselines"]["triton_step"] for r in tri], ".:",
                   color="gray", label="Triton step tiling, 64 heads")
    a_mla.set(xscale="log", yscale="log", xlabel="rows", ylabel="us (graph replay, median)",
              title="sparse MLA, 128 window + 512 compressed keys per row")
    a_mla.set_xscale("log", base=2)
    a_mla.legend(fontsize=8)
    logits = [r for r in rows if r["case"]["op"] == "indexer_logits"]
    for n in sorted({r["case"]["rows"] for r in logits}):
        sel = sorted((r for r in logits if r["case"]["rows"] == n), key=lambda r: r["case"]["context"])
        ctx = [r["case"]["context"] for r in sel]
        line, = a_idx.plot(ctx, [r["gbps"] for r in sel], "o-", label=f"step's scorer, {n} rows")
        if all("triton_fp8" in r["baselines"] for r in sel):
            a_idx.plot(ctx, [r["gbps"] * r["us"] / r["baselines"]["triton_fp8"] for r in sel], ":",
                       color=line.get_color(), label=f"Triton FP8 path, {n} rows")
        if all("bf16_path" in r["baselines"] for r in sel):
            a_idx.plot(ctx, [r["gbps"] * r["us"] / r["baselines"]["bf16_path"] for r in sel], ".--",
                       color=line.get_color(), label=f"BF16 path, {n} rows")
    if logits and "read_gbps" in logits[0]:     # the indexer rows' own run's floor
        a_idx.axhline(logits[0]["read_gbps"], color="gray", lw=0.8, label="streaming read")
        a_idx.axhline(0.7 * logits[0]["read_gbps"], color="gray", lw=0.8, ls=":", label="70 % target")
    a_idx.set(xlabel="visible entries (ratio 1)", ylabel="GB/s (68-byte keys + FP32 scores)",
              title="indexer logits, 32 index heads")
    a_idx.set_xscale("log", base=2)
    a_idx.legend(fontsize=7, ncol=2)
    topk = [r for r in rows if r["case"]["op"] == "topk512"]
    for n in sorted({r["case"]["rows"] for r in topk}):
        sel = sorted((r for r in topk if r["case"]["rows"] == n), key=lambda r: r["case"]["context"])
        a_top.plot([r["case"]["context"] for r in sel], [r["us"] for r in sel], "o-", label=f"{n} rows")
    a_top.set(xlabel="visible entries", ylabel="us", title="top-512 (ascending, -1 padded)", yscale="log")
    a_top.set_xscale("log", base=2)
    a_top.legend(fontsize=8)
    if rows:
        fig.suptitle(f"bench attn on {rows[0]['gpu']} ({runs_label(rows)})")
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    fig.savefig(path, dpi=90)
    plt.close(fig)
