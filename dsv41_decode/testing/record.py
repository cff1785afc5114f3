"""Record a golden trace from our own stack, in the official-tiny format (see testing/trace.py).

The trace needs an FFN output at every block; this package has no MoE, so the recorder plugs in a
small deterministic stand-in (`SyntheticFfn`). The streams entering layer 0 are a random
embedding repeated over the hc streams, as the official model's are.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..layer import CallContext
from ..reference.linear import rowwise_dot
from ..stack import AttentionStack
from ..state import DecodeState
from ..weights import Checkpoint
from .trace import window_positions


class SyntheticFfn:
    """ffn_out = bf16(tanh(u @ R_L^T)) with a fixed random R_L [dim, dim] per layer (rows independent)."""

    def __init__(self, dim: int, layers, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.r = {i: torch.randn(dim, dim, generator=g) * dim ** -0.5 for i in layers}

    def __call__(self, layer: int, u: torch.Tensor) -> torch.Tensor:
        return torch.tanh(rowwise_dot(u.float(), self.r[layer])).to(torch.bfloat16)


def record_trace(ckpt: Checkpoint, out: str | Path, prefill_len: int, decode_steps: int, batch: int = 1,
                 seed: int = 0, progress=None) -> Path:
    """Run a prefill of `prefill_len` tokens, then `decode_steps` single-token calls, on `batch`
    requests, and write config.json, model.safetensors and trace.safetensors into `out`."""
    cfg = ckpt.config
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    stack = AttentionStack(ckpt)
    ffn = SyntheticFfn(cfg.dim, stack.ids, seed)
    total = prefill_len + decode_steps
    state = DecodeState(cfg, max_requests=batch, max_context=total, page_size=16)
    reqs = [f"b{b}" for b in range(batch)]
    for r in reqs:
        state.admit(r)
    g = torch.Generator().manual_seed(seed + 1)
    embed = torch.randn(batch, total, cfg.dim, generator=g).to(torch.bfloat16)
    calls = [("prefill", 0, prefill_len)] + [(f"decode{i:02d}", prefill_len + i, 1) for i in range(decode_steps)]
    tensors: dict[str, torch.Tensor] = {}
    for name, start, s in calls:
        step = state.plan([(r, s) for r in reqs])
        ctx = CallContext(record={})
        x = embed[:, start:start + s].reshape(batch * s, 1, cfg.dim).expand(-1, cfg.hc_mult, -1).contiguous()
        pre = stack.initial_pre(batch * s)
        for i in stack.ids:
            ffn_out = {}

            def hook(layer, u, _keep=ffn_out):
                _keep["y"] = ffn(layer, u)
                return _keep["y"]

            x_out, pre_out, rec = stack.block(i, x, pre, step, state, ctx, hook)
            put = _putter(tensors, f"{name}.layers.{i}", batch, s)
            put("block_in", x)
            put("pre_mix_in", pre)
            put("attn_pre", rec.mix.pre)
            put("attn_post", rec.mix.post)
            put("attn_comb", rec.mix.comb)
            put("attn_in", rec.attn_in)
            put("attn_out", rec.attn_out)
            put("ffn_out", ffn_out["y"])
            put("block_out", x_out)
            put("pre_mix_out", pre_out)
            _record_layer(tensors, f"{name}.layers.{i}", cfg, i, state, reqs, start + s - 1, ctx, batch, s)
            x, pre = x_out, pre_out
            if progress is not None:
                progress()
        tensors[f"{name}.positions"] = torch.arange(start, start + s, dtype=torch.int32)
        state.advance(step)
    case = {"calls": json.dumps([c[0] for c in calls]), "batch": str(batch), "prefill_len": str(prefill_len),
            "decode_steps": str(decode_steps), "recorded_by": "dsv41_decode trace record"}
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "trace.safetensors"),
              metadata={"case": json.dumps(case)})
    _write_checkpoint(ckpt, out)
    return out


def _putter(tensors, prefix, batch, s):
    def put(name, t):
        tensors[f"{prefix}.{name}"] = t.reshape(batch, s, *t.shape[1:]).clone()
    return put


def _record_layer(tensors, prefix, cfg, L, state, reqs, last, ctx, batch, s) -> None:
    spec = cfg.plan[L]
    wpos = window_positions(last, cfg.window_size)
    held = wpos >= 0
    win = torch.zeros(batch, cfg.window_size, cfg.head_dim, dtype=torch.bfloat16)
    for b, r in enumerate(reqs):
        win[b, held] = state.read_window(L, state.slot(r), wpos[held])
    tensors[f"{prefix}.window_kv"] = win
    if spec.kind == "swa":
        return
    n_vis = (last + 1) // spec.ratio
    k = min(cfg.index_topk, n_vis)

    def rows_to(t_rows, width, fill, dtype):
        out = torch.full((batch * s, width), fill, dtype=dtype)
        for r, t in enumerate(t_rows):
            t = t[:width]
            out[r, :t.numel()] = t.to(dtype)
        return out.reshape(batch, s, width)

    tensors[f"{prefix}.compress_topk"] = rows_to(ctx.topk.get(spec.index_source, []), k, -1, torch.int32)
    if spec.runs_indexer:
        tensors[f"{prefix}.indexer_topk"] = tensors[f"{prefix}.compress_topk"].clone()
    if spec.candidate_role == "source":
        tensors[f"{prefix}.candidates"] = rows_to(ctx.candidates[L], n_vis, False, torch.bool)
    if spec.owns_compressor:
        ents = [state.read_entries(L, state.slot(r), n_vis) for r in reqs]
        tensors[f"{prefix}.compress_kv"] = torch.stack([e[0] for e in ents])
        tensors[f"{prefix}.index_k"] = torch.stack([e[1] for e in ents])
        lat = ctx.record.get(f"layers.{L}.compressor_latent")
        if lat:
            tensors[f"{prefix}.compressor_latent"] = torch.stack([lat[r] for r in reqs])


def _write_checkpoint(ckpt: Checkpoint, out: Path) -> None:
    flat = {f"layers.{i}.{k}": v.contiguous() for i, d in ckpt.layers.items() for k, v in d.items()}
    save_file(flat, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(ckpt.config.to_dict(), indent=2))

