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
from ..ops import LOW_BATCH_MAX_ROWS
from ..ops.checks import require_int
from ..records import unpack_window_kv
from ..reference.attention import grouped_wo_a
from ..reference.linear import rms_norm
from ..reference.mhc import hc_mixes, hc_post, hc_pre
from ..reference.rope import rope_cis
from ..stack import AttentionStack
from ..state import DecodeState
from ..weights import load_checkpoint
from .attribution import Flip, explain_o_row, explain_wo_b_row, mix_bounds
from .compare import (abs_difference, bits_differ, rel_rms, row_ulp_distance, selected, topk_agreement,
                      ulp_distance)

# Spec section 9: quantized values bit-exact, top-k equal as sets (of scores when BF16 scores tie),
# attention outputs within about one BF16 ulp. "About one": each side rounds once, so two ulps.
# A row past it is accepted only when one FP8 code flip of wo_b's input explains it
# (attribution.explain_wo_b_row: the official code is not batch-invariant).
MAX_ULP = 2.0
# The mHC mixer coefficients: per coefficient, the bound derived in attribution.mix_bounds (FP32
# evaluation order of both sides); the result holds the largest |difference| / bound.
MAX_MIX_RATIO = 1.0
# Ties explain a stray row: over the trace, at most one in TIE_SHARE of a layer's top-k rows (and
# always one) may differ from the recorded selection by tied scores; a scorer whose scores collapse
# (all equal, or rounded coarsely) ties nearly every row. The official cases: one tie row in 54.
TIE_SHARE = 8
PATHS = ("reference", "step")


@dataclass
class CallLayerResult:
    """The error figures of one (call, layer)."""

    call: str
    layer: int
    kind: str
    path: str = "reference"          # what ran the layer: "reference" (the generic layer) or "step"
    attn_out_ulp: float = 0.0
    attn_out_rel_rms: float = 0.0
    flips: list[Flip] = field(default_factory=list)   # rows past MAX_ULP explained by one FP8 flip
    attn_out_unexplained_ulp: float = 0.0             # the largest row distance once flips are applied
    attn_out_worst_row: int = 0                       # its row (batch-major: b * s + position in the call)
    topk_differ_rows: list[int] = field(default_factory=list)   # the rows whose top-k differs
    quant_bits: dict[str, int] = field(default_factory=dict)   # name -> elements differing bitwise
    latent_ulp: float = 0.0
    topk: dict[str, int] = field(default_factory=dict)         # equal / tie / differ -> rows
    ties_past_bound: tuple[int, int] | None = None   # (tie rows, rows) of the layer over the trace, on its last call
    recorded_topk_rows_differ: int = 0   # an index source's recorded compress_topk rows not equal to its indexer_topk
    candidate_rows_differ: int = 0
    boundary_ulp: float = 0.0        # attn_in: element ulps; block_out: ulps of each stream's max
    mix_abs: float = 0.0             # largest |coefficient difference|
    mix_ratio: float = 0.0           # largest |coefficient difference| / its bound
    attn_out: torch.Tensor | None = field(default=None, repr=False)   # ours [rows, dim] BF16 (CPU)

    @property
    def failures(self) -> list[str]:
        out = [f"{k}: {v} values not bit-exact" for k, v in self.quant_bits.items() if v]
        if self.topk.get("differ"):
            rows = f" (rows {', '.join(map(str, self.topk_differ_rows[:8]))})" if self.topk_differ_rows else ""
            out.append(f"top-k: {self.topk['differ']} rows select different scores{rows}")
        if self.recorded_topk_rows_differ:
            out.append(f"compress_topk: {self.recorded_topk_rows_differ} rows differ from the layer's recorded "
                       f"indexer_topk (an index source attends to its own selection)")
        if self.ties_past_bound is not None:
            ties, rows = self.ties_past_bound
            out.append(f"top-k: {ties} of the layer's {rows} rows differ by tied scores, more than "
                       f"{max(1, rows // TIE_SHARE)} (one in {TIE_SHARE}): scores that collapse")
        if self.candidate_rows_differ:
            out.append(f"candidates: {self.candidate_rows_differ} rows differ")
        if self.attn_out_unexplained_ulp > MAX_ULP:
            out.append(f"attn_out: {self.attn_out_unexplained_ulp:.3g} ulp > {MAX_ULP} at row {self.attn_out_worst_row} "
                       f"(not explained by one FP8 code flip of wo_b's input)")
        for name, v in (("compressor_latent", self.latent_ulp), ("boundary streams", self.boundary_ulp)):
            if v > MAX_ULP:
                out.append(f"{name}: {v:.3g} ulp > {MAX_ULP}")
        if self.mix_ratio > MAX_MIX_RATIO:
            out.append(f"mHC coefficients: {self.mix_abs:.3g} off, {self.mix_ratio:.3g}x the derived bound")
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


def calls_after_first(case: dict) -> int:
    """The calls a trace's `case` (`read_case`) holds after its first (the prefill): the most a
    replay's `calls` may ask for."""
    return len(case["calls"]) - 1


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


def verify_trace(folder: str | Path, progress: bool = False, path: str = "reference", device: str = "cpu",
                 calls: int | None = None, heads: int | None = None, log=None,
                 prefill: str = "reference", exact_linears: bool = True,
                 fp32_dots: bool = False) -> list[CallLayerResult]:
    """Replay a trace folder teacher-forced (every layer gets the recorded `attn_in`) and compare.

    path: "reference" (every call through the generic layers) or "step" (calls of one token per
        request through the specialized step, `trace_step.StepReplay`, and their mHC boundary
        through the step's kernels, `trace_step.StepBoundaryOps`; longer calls - the prefill -
        through the generic layers and the reference boundary, which write the same caches; with
        prefill="kernels", through the step as well: the kernel prefill's chunk, `prefill.py`).
    prefill: "reference" or "kernels" (path "step" only: the longer calls through the step too;
        ValueError when one holds more rows than the step runs, LOW_BATCH_MAX_ROWS).
    device: where the checkpoint, the state and the path run ("cpu" runs the step's kernels in
        Triton's interpreter).
    calls: replay only the first `calls` calls after the first one (None: all; TraceError past the
        trace's).
    heads: pad the checkpoint to this many query heads with zero heads (`trace_step.pad_heads`);
        the step path pads on its own when it does not run the trace's head count natively.
    log: called with a line of text for what the reader should know (the padding).
    exact_linears: path "step" only: the step's FP8 linears with the contract's bits (the step's
        default, `ops.exact_linear.ExactLinear`); False: on FP8 tensor cores, whose block sums
        truncate (the official cases fail on a GPU so: spec decision 38).
    fp32_dots: path "step" only: the step built with `fp32_dots=True` (its sparse MLA and `wo_a` with
        FP32 IEEE dots).
    Rows whose top-k differs from the recorded one only by tied scores are re-run with the recorded
    selection (on either path), so that attn_out is compared on the same keys, and the layers that
    reuse the selection read the recorded one.
    """
    from .trace_step import StepBoundaryOps, StepReplay, pad_heads, step_heads
    if path not in PATHS:
        raise ValueError(f"path must be one of {PATHS}, got {path!r}")
    if prefill not in ("reference", "kernels") or (prefill == "kernels" and path != "step"):
        raise ValueError(f"prefill must be 'reference', or 'kernels' with path 'step'; got {prefill!r} "
                         f"with path {path!r}")
    if calls is not None:
        require_int(calls, "calls", lo=0)
    folder = Path(folder)
    case = read_case(folder / "trace.safetensors")
    if calls is not None and calls > calls_after_first(case):
        raise TraceError(f"{folder}: calls={calls} but the trace holds {calls_after_first(case)} calls after "
                         f"the first")
    ckpt = load_checkpoint(folder, device=device)
    cfg0: ModelConfig = ckpt.config
    if heads is None and path == "step" and cfg0.n_heads != step_heads(cfg0.n_heads, cfg0.o_groups):
        heads = step_heads(cfg0.n_heads, cfg0.o_groups)
    if heads is not None and heads != cfg0.n_heads:
        ckpt = pad_heads(ckpt, heads)
        if log is not None:
            log(f"{cfg0.n_heads} query heads padded to {heads} with zero heads "
                f"({cfg0.n_heads // cfg0.o_groups} real + {(heads - cfg0.n_heads) // cfg0.o_groups} zero per wo_a "
                f"group: zero wq_b rows and wo_a columns, which add exactly nothing)")
    cfg: ModelConfig = ckpt.config
    B, plan = case["batch"], cfg.plan
    names = case["calls"] if calls is None else case["calls"][:1 + calls]
    stack = AttentionStack(ckpt)
    layers = stack.layers
    T = safe_open(str(folder / "trace.safetensors"), framework="pt")
    keys = set(T.keys())
    check_tensors(folder / "trace.safetensors", keys, cfg, names, layers)
    last_pos = T.get_tensor(f"{names[-1]}.positions")
    # the most rows a call through the step holds: B, or with the kernel prefill every call's B * s
    rows = B if prefill == "reference" else max(B * T.get_tensor(f"{c}.positions").numel() for c in names)
    if rows > LOW_BATCH_MAX_ROWS:
        raise ValueError(f"prefill='kernels': a call of {rows} rows exceeds the step's {LOW_BATCH_MAX_ROWS} "
                         f"(LOW_BATCH_MAX_ROWS); verify it with prefill='reference'")
    state = DecodeState(cfg, max_requests=B, max_context=int(last_pos[-1]) + 1, page_size=16, device=device,
                        stage_rows=rows)
    reqs = [f"b{b}" for b in range(B)]
    for r in reqs:
        state.admit(r)
    if (not exact_linears or fp32_dots) and path != "step":
        raise ValueError("exact_linears=False and fp32_dots=True build the step's kernels: use them with path 'step'")
    replay = StepReplay(stack, state, rows, exact_linears=exact_linears, fp32_dots=fp32_dots) \
        if path == "step" else None
    boundary_ops = StepBoundaryOps(cfg.dim, rows, device) if path == "step" else None
    results: list[CallLayerResult] = []
    bar = _progress(progress, len(names) * len(layers))
    for call in names:
        pos = T.get_tensor(f"{call}.positions").long()
        s = pos.numel()
        step = state.plan([(r, s) for r in reqs])
        if step.positions.tolist() != pos.tolist() * B:
            raise ValueError(f"{call}: positions {pos.tolist()} do not continue the earlier calls")
        ctx = CallContext(record={})
        on_step = replay is not None and (s == 1 or prefill == "kernels")
        if on_step:
            replay.begin(step)

        def get(L: int, name: str) -> torch.Tensor | None:
            key = f"{call}.layers.{L}.{name}"
            if key not in keys:
                return None
            t = T.get_tensor(key)
            if name in ("attn_in", "attn_out") and t.numel() != B * s * cfg.dim:
                raise TraceError(f"{folder / 'trace.safetensors'}: {key} has shape {tuple(t.shape)}; the call's "
                                 f"{B} x {s} rows of {cfg.dim} expected")
            return t

        for L in sorted(layers):
            spec = plan[L]
            res = CallLayerResult(call, L, spec.label, "step" if on_step else "reference")
            u = get(L, "attn_in").reshape(B * s, cfg.dim).to(device)
            if spec.runs_indexer and get(L, "compress_topk") is not None:
                res.recorded_topk_rows_differ = sum(
                    selected(a) != selected(b)
                    for a, b in zip(get(L, "compress_topk").reshape(B * s, -1), get(L, "indexer_topk").reshape(B * s, -1)))
            if on_step:
                out = replay.run_layer(L, u)
                y, z, o = out.y, out.z, out.o
                latent = None if out.latent is None else list(out.latent.reshape(B, s, -1))
                if latent is not None and s > 1:          # a prefill call: the rows that complete a group
                    latent = [lat[((pos + 1) % spec.ratio) == 0] for lat in latent]
                if spec.runs_indexer:
                    n_vis = (int(pos[-1]) + 1) // spec.ratio
                    theirs = get(L, "indexer_topk").reshape(B * s, -1).long()
                    if _topk_verdicts(res, out.topk, theirs, out.scores[:, :n_vis]):
                        out = replay.run_layer(L, u, forced=[t[t >= 0] for t in theirs])
                        y, z, o = out.y, out.z, out.o
                elif spec.kind != "swa":
                    _reuse_agreement(res, replay.selection(spec.index_source),
                                     get(L, "compress_topk").reshape(B * s, -1).long())
                cands = None
                if spec.candidate_role == "source":       # per row, over the entries it sees
                    cands = [out.candidates[i, :(int(p) + 1) // spec.ratio]
                             for i, p in enumerate(step.positions.tolist())]
            else:
                y = layers[L].forward(u, step, state, ctx)
                if spec.runs_indexer:
                    theirs = get(L, "indexer_topk").reshape(B * s, -1).long()
                    scores = ctx.record[f"layers.{L}.index_scores"]
                    if _topk_verdicts(res, ctx.topk[L], theirs, scores):  # compare on the recorded selection
                        ctx.force_topk[L] = [t[t >= 0].to(u.device) for t in theirs]   # the layer's device
                        y = layers[L].forward(u, step, state, ctx)
                elif spec.kind != "swa":
                    _reuse_agreement(res, ctx.topk[spec.index_source],
                                     get(L, "compress_topk").reshape(B * s, -1).long())
                o = ctx.record[f"layers.{L}.o"]
                z = wo_b_input(layers[L], o, step.positions)
                lat = ctx.record.get(f"layers.{L}.compressor_latent")
                latent = None if lat is None else [lat[r] for r in reqs]
                cands = ctx.candidates.get(L)
            y = y.cpu()
            res.attn_out = y
            ref = get(L, "attn_out").reshape(B * s, cfg.dim)
            res.attn_out_ulp, res.attn_out_rel_rms = ulp_distance(y, ref), rel_rms(y, ref)
            attribute_attn_out(res, y, z.cpu(), o.cpu(), step.positions, layers[L], ref,
                               o_moves=on_step or torch.device(device).type != "cpu")
            _compare_state(res, cfg, L, state, reqs, pos, get, latent, cands)
            if on_step:
                nxt = L + 1 if L + 1 in layers else None
                _compare_boundary(res, cfg, ckpt.layer(L), get, B, s, kernels=boundary_ops,
                                  next_norm=None if nxt is None else ckpt.layer(nxt)["attn_norm.weight"].cpu())
            else:
                _compare_boundary(res, cfg, ckpt.layer(L), get, B, s)
            results.append(res)
            if bar is not None:
                bar[0].advance(bar[1])
        state.advance(step)
    if bar is not None:
        bar[0].stop()
    _bound_ties(results)
    return results


def _bound_ties(results: list[CallLayerResult]) -> None:
    """Mark the last result of each layer whose tie rows over the trace pass TIE_SHARE."""
    last: dict[int, CallLayerResult] = {}
    count: dict[int, list[int]] = {}
    for res in results:
        if res.topk:
            c = count.setdefault(res.layer, [0, 0])
            c[0] += res.topk.get("tie", 0)
            c[1] += sum(res.topk.values())
            last[res.layer] = res
    for layer, (ties, rows) in count.items():
        if ties > max(1, rows // TIE_SHARE):
            last[layer].ties_past_bound = (ties, rows)


def _topk_verdicts(res, ours, theirs, scores) -> bool:
    """Count each row's top-k agreement into res.topk; True when some row is not 'equal'."""
    verdicts = [topk_agreement(ours[r].cpu(), theirs[r], scores[r].cpu()) for r in range(theirs.shape[0])]
    for r, v in enumerate(verdicts):
        res.topk[v] = res.topk.get(v, 0) + 1
        if v == "differ":
            res.topk_differ_rows.append(r)
    return any(v != "equal" for v in verdicts)


def _reuse_agreement(res, src, theirs) -> None:
    """A Reuse or Reindex-consumer layer's selection is its index source's: compare it as sets."""
    same = [selected(a) == selected(b) for a, b in zip(src, theirs)]
    res.topk["equal"] = sum(same)
    res.topk["differ"] = theirs.shape[0] - res.topk["equal"]
    res.topk_differ_rows = [r for r, ok in enumerate(same) if not ok]


def wo_b_input(layer: AttentionLayer, o: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """z = grouped_wo_a(o), the BF16 input of wo_b, as the generic layer computed it."""
    cis = rope_cis(layer.freqs, positions.to(o.device))
    return grouped_wo_a(o, cis, layer.wo_a, layer.cfg.o_groups, layer.cfg.rope_head_dim)


def attribute_attn_out(res, y, z, o, positions, layer: AttentionLayer, ref, o_moves: bool = True) -> None:
    """Rows of attn_out past MAX_ULP: explained by one FP8 flip of wo_b's input caused by an
    ulp-level move of z (attribution.explain_wo_b_row), or - with o_moves: where the step ran the
    layer, whose sparse MLA sums in an order of its own, or the reference ran on a GPU, whose
    kernels sum in theirs - of o (explain_o_row), or not. The reference's o on the CPU is the
    contract's, so a move of it explains nothing there: one o element moves every z element of its
    wo_a group, and among the moves of 2 ulps some land within MAX_ULP of a row that a corruption
    put a few ulps off."""
    worst = 0.0
    w, cfg = layer.w, layer.cfg
    for r in range(y.shape[0]):
        d = ulp_distance(y[r], ref[r])
        if d > MAX_ULP:
            flip = explain_wo_b_row(z[r], ref[r], w["attn.wo_b.weight"], w["attn.wo_b.scale"], MAX_ULP, r)
            if flip is None and o_moves:
                cis = rope_cis(layer.freqs.cpu(), positions[r:r + 1].cpu())[0]
                flip = explain_o_row(o[r], cis, layer.wo_a, cfg.o_groups, cfg.rope_head_dim, ref[r],
                                     w["attn.wo_b.weight"], w["attn.wo_b.scale"], MAX_ULP, r)
            if flip is not None:
                res.flips.append(flip)
                d = flip.residual_ulp
        if d > worst:
            worst, res.attn_out_worst_row = d, r
    res.attn_out_unexplained_ulp = worst


def _compare_state(res, cfg, L, state, reqs, pos, get, latent, cands) -> None:
    """window_kv, compress_kv and index_k bitwise; the compressor latent (ours: per request, its
    latents, completed groups last) in ulps; the candidate pool (ours: per row, a bool mask over the
    visible entries)."""
    spec = cfg.plan[L]
    last = int(pos[-1])
    wpos = window_positions(last, cfg.window_size)
    held = wpos >= 0
    win_ref = get(L, "window_kv")
    for b, r in enumerate(reqs):
        # the ring records themselves (the step writes them in-kernel, without the state's bookkeeping)
        ring = state.window_slots(torch.full_like(wpos[held], state.slot(r)), wpos[held])
        ours = unpack_window_kv(state.window[L][ring.to(state.device)]).cpu()
        res.quant_bits["window_kv"] = res.quant_bits.get("window_kv", 0) + bits_differ(ours, win_ref[b][held])
    if spec.owns_compressor:
        ckv_ref, ik_ref = get(L, "compress_kv"), get(L, "index_k")
        lat_ref = get(L, "compressor_latent")
        for b, r in enumerate(reqs):
            ckv, ik = state.read_entries(L, state.slot(r), ckv_ref.shape[1])
            res.quant_bits["compress_kv"] = res.quant_bits.get("compress_kv", 0) + bits_differ(ckv.cpu(), ckv_ref[b])
            res.quant_bits["index_k"] = res.quant_bits.get("index_k", 0) + bits_differ(ik.cpu(), ik_ref[b])
            if lat_ref is not None:
                # ours: the request's latents, the generic layer's one per completed group, the
                # step's one per row; the completed groups are the last rows either way
                g = lat_ref.shape[1]
                res.latent_ulp = max(res.latent_ulp, ulp_distance(latent[b][-g:].cpu(), lat_ref[b]))
    if spec.candidate_role == "source":
        cand = get(L, "candidates").reshape(-1, get(L, "candidates").shape[-1])
        res.candidate_rows_differ = sum(bool((cand[r][:m.numel()] != m.cpu()).any()) for r, m in enumerate(cands))


def _compare_boundary(res, cfg, w, get, B, s, next_norm=None, kernels=None) -> None:
    """Recompute attn_in, the attention site's mixer, the FFN site's mixer (pre_mix_out) and
    block_out from the recorded tensors, teacher-forced as the layers are: the FFN site's input
    streams are rebuilt from the recorded attn_out, block_in and attn_post/attn_comb (the official
    code's own coefficients), so each mixer is compared on the streams the trace's was computed
    from (our own attention-site coefficients are compared with the recorded ones first).

    kernels: a `trace_step.StepBoundaryOps` - the step's mixer and fused boundary kernels do the
    work instead of the reference (the step has no FFN, but its boundary is the same op at either
    site); its exit of this block also yields the next layer's input (norm `next_norm`), compared
    with the next layer's recorded attn_in (the step computes every input after the first so).
    """
    block_in = get(res.layer, "block_in")
    if block_in is None:
        return
    w = {k: v.cpu() for k, v in w.items() if k.startswith(("hc_", "attn_norm", "ffn_norm"))}
    n = B * s
    x = block_in.reshape(n, cfg.hc_mult, cfg.dim)
    rec = {name: get(res.layer, name) for name in ("attn_out", "attn_pre", "attn_post", "attn_comb", "ffn_out",
                                                  "pre_mix_in", "pre_mix_out", "block_out", "attn_in")}
    a_post, a_comb = rec["attn_post"].reshape(n, -1), rec["attn_comb"].reshape(n, cfg.hc_mult, cfg.hc_mult)
    args = (cfg.norm_eps, cfg.hc_eps, cfg.hc_sinkhorn_iters)
    u_err = 0.0
    if kernels is None:
        mix = hc_mixes(x, w["hc_attn_fn"], w["hc_attn_scale"], w["hc_attn_base"], *args)
        u = rms_norm(hc_pre(x, rec["pre_mix_in"].reshape(n, -1)), w["attn_norm.weight"], cfg.norm_eps)
        u_err = ulp_distance(u, rec["attn_in"].reshape(n, -1))
        mid = hc_post(rec["attn_out"].reshape(n, -1), x, a_post, a_comb)
        f = hc_mixes(mid, w["hc_ffn_fn"], w["hc_ffn_scale"], w["hc_ffn_base"], *args)
        out = hc_post(rec["ffn_out"].reshape(n, -1), mid, f.post, f.comb)
    else:
        mix = kernels.mixer(x, w["hc_attn_fn"], w["hc_attn_scale"], w["hc_attn_base"], cfg)
        if res.layer == 0:       # the step's first input (Boundary.enter)
            u = kernels.enter(x, rec["pre_mix_in"].reshape(n, -1), w["attn_norm.weight"], cfg.norm_eps)
            u_err = ulp_distance(u, rec["attn_in"].reshape(n, -1))
        mid, _ = kernels.exit(rec["attn_out"].reshape(n, -1), x, a_post, a_comb, rec["attn_pre"].reshape(n, -1),
                              w["ffn_norm.weight"], cfg.norm_eps)
        f = kernels.mixer(mid, w["hc_ffn_fn"], w["hc_ffn_scale"], w["hc_ffn_base"], cfg)
        out, u_next = kernels.exit(rec["ffn_out"].reshape(n, -1), mid, f.post, f.comb,
                                   rec["pre_mix_out"].reshape(n, -1),
                                   next_norm if next_norm is not None else w["attn_norm.weight"], cfg.norm_eps)
        nxt = get(res.layer + 1, "attn_in")
        if next_norm is not None and nxt is not None:
            u_err = ulp_distance(u_next, nxt.reshape(n, -1))
    # the post-mix sums cancel: measure it against each stream's largest value
    res.boundary_ulp = max(u_err, row_ulp_distance(out, rec["block_out"].reshape(n, cfg.hc_mult, -1)))
    bound_args = (cfg.norm_eps, cfg.hc_sinkhorn_iters, cfg.hc_eps)
    b_attn = mix_bounds(x, w["hc_attn_fn"], w["hc_attn_scale"], w["hc_attn_base"], *bound_args)
    b_ffn = mix_bounds(mid, w["hc_ffn_fn"], w["hc_ffn_scale"], w["hc_ffn_base"], *bound_args)
    for a, bound, name in ((mix.pre, b_attn.pre, "attn_pre"), (mix.post, b_attn.post, "attn_post"),
                           (mix.comb, b_attn.comb, "attn_comb"), (f.pre, b_ffn.pre, "pre_mix_out")):
        d = abs_difference(a, rec[name].reshape(a.shape))          # inf where a NaN or inf differs
        res.mix_abs = max(res.mix_abs, float(d.max()))
        ratio = torch.where(d == 0, torch.zeros_like(bound), d.double() / bound)   # a NaN bound: inf
        res.mix_ratio = max(res.mix_ratio, float(torch.nan_to_num(ratio, nan=float("inf")).max()))


def _progress(enabled: bool, total: int):
    if not enabled:
        return None
    from rich.console import Console
    from ..runtime import Steps   # a bar on a terminal, a line per layer on stderr otherwise
    p = Steps("trace verify: layer", total, Console(stderr=True))
    return p, ""
