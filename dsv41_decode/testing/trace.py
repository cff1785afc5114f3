"""Golden traces: replay one teacher-forced, layer by layer, and record new ones in the same format.

A trace folder holds `config.json`, `model.safetensors` (the attention-side checkpoint) and
`trace.safetensors` with keys `{call}.positions` (I32 [s]) and `{call}.layers.{i}.{name}` (the
format of shared/oracle/official-tiny/README.md; summarised in this project's README). Its
metadata key `case` is a JSON object with `calls` (a JSON list of call names, in order) and `batch`.
Every request of the batch sits at the same positions in every call.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from ..config import ModelConfig
from ..layer import AttentionLayer, CallContext
from ..reference.linear import rms_norm
from ..reference.mhc import hc_mixes, hc_post, hc_pre
from ..state import DecodeState
from ..weights import load_checkpoint
from .compare import bits_differ, rel_rms, row_ulp_distance, topk_agreement, ulp_distance

# Spec section 9: quantized values bit-exact, top-k equal as sets (of scores when BF16 scores tie),
# attention outputs within about one BF16 ulp. "About one": each side rounds once, so two ulps.
MAX_ULP = 2.0
# The mixer coefficients are FP32 results of a 4*dim-long dot product and 20 Sinkhorn rounds; the
# FFN site's are computed from the recomputed streams, which may differ from the recorded ones by
# an ulp, and move by up to ~3e-5 (measured on official-tiny).
MAX_MIX_ABS = 1e-4


@dataclass
class CallLayerResult:
    """The error figures of one (call, layer)."""

    call: str
    layer: int
    kind: str
    attn_out_ulp: float = 0.0
    attn_out_rel_rms: float = 0.0
    quant_bits: dict[str, int] = field(default_factory=dict)   # name -> elements differing bitwise
    latent_ulp: float = 0.0
    topk: dict[str, int] = field(default_factory=dict)         # equal / tie / differ -> rows
    candidate_rows_differ: int = 0
    boundary_ulp: float = 0.0        # attn_in: element ulps; block_out: ulps of each stream's max
    mix_abs: float = 0.0

    @property
    def failures(self) -> list[str]:
        out = [f"{k}: {v} values not bit-exact" for k, v in self.quant_bits.items() if v]
        if self.topk.get("differ"):
            out.append(f"top-k: {self.topk['differ']} rows select different scores")
        if self.candidate_rows_differ:
            out.append(f"candidates: {self.candidate_rows_differ} rows differ")
        for name, v, tol in (("attn_out", self.attn_out_ulp, MAX_ULP), ("compressor_latent", self.latent_ulp,
                             MAX_ULP), ("boundary streams", self.boundary_ulp, MAX_ULP)):
            if v > tol:
                out.append(f"{name}: {v:.3g} ulp > {tol}")
        if self.mix_abs > MAX_MIX_ABS:
            out.append(f"mHC coefficients: {self.mix_abs:.3g} > {MAX_MIX_ABS}")
        return out


class TraceError(ValueError):
    """A trace file that cannot be replayed: unreadable, without its case, or missing a tensor (named)."""


def read_case(path: Path) -> dict:
    """The `case` metadata of trace.safetensors: calls (names, in order) and batch. TraceError
    naming the file when it is unreadable (truncated, corrupt) or carries no valid case."""
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
    except Exception as e:  # SafetensorError (truncated, bad header) or OSError
        raise TraceError(f"{path}: not a readable safetensors file (truncated or corrupt?): {e}") from None
    if "case" not in meta:
        raise TraceError(f"{path}: no 'case' metadata (expected calls and batch)")
    try:
        case = json.loads(meta["case"])
        calls = case["calls"]
        case["calls"] = json.loads(calls) if isinstance(calls, str) else list(calls)
        case["batch"] = int(case.get("batch", 1))
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise TraceError(f"{path}: 'case' metadata is not a JSON object with calls and batch ({e!r})") from None
    if not case["calls"] or case["batch"] < 1:
        raise TraceError(f"{path}: 'case' metadata names no calls or a batch < 1")
    return case


def required_tensors(cfg: ModelConfig, calls: list[str], layers) -> list[str]:
    """The trace tensors a replay of `calls` over `layers` reads (the boundary's are optional as a
    group: checked when `block_in` is present)."""
    out = []
    for call in calls:
        out.append(f"{call}.positions")
        for L in sorted(layers):
            spec = cfg.plan[L]
            names = ["attn_in", "attn_out", "window_kv"]
            if spec.runs_indexer:
                names.append("indexer_topk")
            elif spec.kind != "swa":
                names.append("compress_topk")
            if spec.owns_compressor:
                names += ["compress_kv", "index_k"]
            if spec.candidate_role == "source":
                names.append("candidates")
            out += [f"{call}.layers.{L}.{n}" for n in names]
    return out


BOUNDARY_TENSORS = ("pre_mix_in", "ffn_out", "block_out", "attn_pre", "attn_post", "attn_comb", "pre_mix_out")


def check_tensors(path: Path, keys: set, cfg: ModelConfig, calls: list[str], layers) -> None:
    """TraceError naming the first tensor a replay needs that `path` (with tensor names `keys`)
    lacks, and how many are missing."""
    need = required_tensors(cfg, calls, layers)
    need += [k.rsplit(".", 1)[0] + f".{n}" for k in sorted(keys)
             if k.endswith(".block_in") and k.split(".layers.")[0] in calls for n in BOUNDARY_TENSORS]
    missing = [k for k in need if k not in keys]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise TraceError(f"{path}: missing tensor {missing[0]}{more}; the format is in the README "
                         f"('Golden trace format')")


def window_positions(last: int, window: int) -> torch.Tensor:
    """Position held by each ring slot after a call ending at `last` (-1 where none yet)."""
    t = torch.arange(window)
    pos = last - ((last - t) % window)
    return torch.where(pos >= 0, pos, torch.full_like(pos, -1))


def verify_trace(folder: str | Path, progress: bool = False) -> list[CallLayerResult]:
    """Replay a trace folder teacher-forced (every layer gets the recorded `attn_in`) and compare.

    Rows whose top-k differs from the recorded one only by tied scores are re-run with the recorded
    selection, so that attn_out is compared on the same keys.
    """
    folder = Path(folder)
    ckpt = load_checkpoint(folder)
    cfg: ModelConfig = ckpt.config
    case = read_case(folder / "trace.safetensors")
    B, plan = case["batch"], cfg.plan
    layers = {i: AttentionLayer(cfg, plan[i], ckpt.layer(i)) for i in ckpt.layers}
    T = safe_open(str(folder / "trace.safetensors"), framework="pt")
    keys = set(T.keys())
    check_tensors(folder / "trace.safetensors", keys, cfg, case["calls"], layers)
    last_pos = T.get_tensor(f"{case['calls'][-1]}.positions")
    state = DecodeState(cfg, max_requests=B, max_context=int(last_pos[-1]) + 1, page_size=16)
    reqs = [f"b{b}" for b in range(B)]
    for r in reqs:
        state.admit(r)
    results: list[CallLayerResult] = []
    total = len(case["calls"]) * len(layers)
    bar = _progress(progress, total)
    for call in case["calls"]:
        pos = T.get_tensor(f"{call}.positions").long()
        s = pos.numel()
        step = state.plan([(r, s) for r in reqs])
        if step.positions.tolist() != pos.tolist() * B:
            raise ValueError(f"{call}: positions {pos.tolist()} do not continue the earlier calls")
        ctx = CallContext(record={})

        def get(L: int, name: str) -> torch.Tensor | None:
            key = f"{call}.layers.{L}.{name}"
            return T.get_tensor(key) if key in keys else None

        for L in sorted(layers):
            spec = plan[L]
            res = CallLayerResult(call, L, spec.label)
            u = get(L, "attn_in").reshape(B * s, cfg.dim)
            y = layers[L].forward(u, step, state, ctx)
            if spec.runs_indexer:
                theirs = get(L, "indexer_topk").reshape(B * s, -1).long()
                scores = ctx.record[f"layers.{L}.index_scores"]
                verdicts = [topk_agreement(ctx.topk[L][r], theirs[r], scores[r]) for r in range(B * s)]
                for v in verdicts:
                    res.topk[v] = res.topk.get(v, 0) + 1
                if any(v != "equal" for v in verdicts):  # compare attention on the recorded selection
                    ctx.force_topk[L] = [t[t >= 0] for t in theirs]
                    y = layers[L].forward(u, step, state, ctx)
            elif spec.kind != "swa":
                theirs = get(L, "compress_topk").reshape(B * s, -1).long()
                src = ctx.topk[spec.index_source]
                res.topk["equal"] = sum(sorted(a[a >= 0].tolist()) == sorted(b[b >= 0].tolist())
                                        for a, b in zip(src, theirs))
                res.topk["differ"] = B * s - res.topk["equal"]
            ref = get(L, "attn_out").reshape(B * s, cfg.dim)
            res.attn_out_ulp, res.attn_out_rel_rms = ulp_distance(y, ref), rel_rms(y, ref)
            _compare_state(res, cfg, L, state, reqs, pos, get, ctx)
            _compare_boundary(res, cfg, ckpt.layer(L), get, B, s)
            results.append(res)
            if bar is not None:
                bar[0].advance(bar[1])
        state.advance(step)
    if bar is not None:
        bar[0].stop()
    return results


def _compare_state(res, cfg, L, state, reqs, pos, get, ctx) -> None:
    spec = cfg.plan[L]
    last = int(pos[-1])
    wpos = window_positions(last, cfg.window_size)
    held = wpos >= 0
    win_ref = get(L, "window_kv")
    for b, r in enumerate(reqs):
        ours = state.read_window(L, state.slot(r), wpos[held])
        res.quant_bits["window_kv"] = res.quant_bits.get("window_kv", 0) + bits_differ(ours, win_ref[b][held])
    if spec.owns_compressor:
        ckv_ref, ik_ref = get(L, "compress_kv"), get(L, "index_k")
        lat_ref = get(L, "compressor_latent")
        for b, r in enumerate(reqs):
            ckv, ik = state.read_entries(L, state.slot(r), ckv_ref.shape[1])
            res.quant_bits["compress_kv"] = res.quant_bits.get("compress_kv", 0) + bits_differ(ckv, ckv_ref[b])
            res.quant_bits["index_k"] = res.quant_bits.get("index_k", 0) + bits_differ(ik, ik_ref[b])
            if lat_ref is not None:
                lat = ctx.record[f"layers.{L}.compressor_latent"][r]
                res.latent_ulp = max(res.latent_ulp, ulp_distance(lat, lat_ref[b]))
    if spec.candidate_role == "source":
        cand = get(L, "candidates").reshape(-1, get(L, "candidates").shape[-1])
        ours = ctx.candidates[L]
        res.candidate_rows_differ = sum(bool((cand[r][:m.numel()] != m).any()) for r, m in enumerate(ours))


def _compare_boundary(res, cfg, w, get, B, s) -> None:
    """Recompute attn_in, the attention mixer, block_out and pre_mix_out from the recorded streams."""
    block_in = get(res.layer, "block_in")
    if block_in is None:
        return
    x = block_in.reshape(B * s, cfg.hc_mult, cfg.dim)
    mix = hc_mixes(x, w["hc_attn_fn"], w["hc_attn_scale"], w["hc_attn_base"], cfg.norm_eps, cfg.hc_eps,
                   cfg.hc_sinkhorn_iters)
    u = rms_norm(hc_pre(x, get(res.layer, "pre_mix_in").reshape(B * s, -1)), w["attn_norm.weight"], cfg.norm_eps)
    mid = hc_post(get(res.layer, "attn_out").reshape(B * s, -1), x, mix.post, mix.comb)
    f = hc_mixes(mid, w["hc_ffn_fn"], w["hc_ffn_scale"], w["hc_ffn_base"], cfg.norm_eps, cfg.hc_eps,
                 cfg.hc_sinkhorn_iters)
    out = hc_post(get(res.layer, "ffn_out").reshape(B * s, -1), mid, f.post, f.comb)
    # the post-mix sums cancel: measure it against each stream's largest value
    res.boundary_ulp = max(ulp_distance(u, get(res.layer, "attn_in").reshape(B * s, -1)),
                           row_ulp_distance(out, get(res.layer, "block_out").reshape(B * s, cfg.hc_mult, -1)))
    pairs = ((mix.pre, "attn_pre"), (mix.post, "attn_post"), (mix.comb, "attn_comb"), (f.pre, "pre_mix_out"))
    res.mix_abs = max(float((a - get(res.layer, n).reshape(a.shape)).abs().max()) for a, n in pairs)


def _progress(enabled: bool, total: int):
    if not enabled:
        return None
    from rich.console import Console
    from ..runtime import Steps   # a bar on a terminal, a line per layer on stderr otherwise
    p = Steps("trace verify: layer", total, Console(stderr=True))
    return p, ""
