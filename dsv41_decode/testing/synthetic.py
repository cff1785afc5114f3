"""Synthetic checkpoints and states built directly on a device (benchmarks at V4.1-Flash size).

`random_checkpoint` draws every tensor of `weights.expected_tensors` on the device with the
magnitudes of `weights.write_synthetic_checkpoint` (not the same values: that writer draws on the
CPU for byte-identical files). `fill_state` admits requests and gives them `length` cached tokens
of random valid records (window rings, compressed KV, index keys, ratio-2 compressor state)
without a prefill.
"""

from __future__ import annotations

import math
from typing import Hashable, Mapping

import torch

from ..config import ModelConfig
from ..formats import fp8_block_quantize
from ..records import pack_compressed_kv, pack_index_key, pack_window_kv
from ..state import DecodeState
from ..weights import FP8, UE8M0, Checkpoint, expected_tensors


def heavy_e4m3(shape, generator: torch.Generator) -> torch.Tensor:
    """Heavy-tailed E4M3 codes on the generator's device: randn^3, each row (last dim) scaled so
    that its largest magnitude is 448 - values from 448 down to the subnormals, the operands where
    a block sum's rounding is hardest (the exact linears' tests and probes)."""
    v = torch.randn(shape, generator=generator, device=generator.device) ** 3
    return (v * (448 / v.abs().amax(-1, keepdim=True))).to(torch.float8_e4m3fn)


def random_layer(cfg: ModelConfig, layer: int, device, gen: torch.Generator, wo_a_fp8: bool = False
                 ) -> dict[str, torch.Tensor]:
    """One layer's tensors (names without `layers.N.`), drawn on `device`."""
    out: dict[str, torch.Tensor] = {}
    spec = expected_tensors(cfg, layer, wo_a_fp8=wo_a_fp8)
    prefix = f"layers.{layer}."
    for full, (dtype, shape) in spec.items():
        name = full[len(prefix):]
        if dtype == UE8M0:
            continue   # written with its weight
        if name.endswith("_fn"):
            t = torch.randn(shape, generator=gen, device=device) / math.sqrt(cfg.dim)
        elif name.endswith("_base") or name == "attn.attn_sink":
            t = 0.5 * torch.randn(shape, generator=gen, device=device)
        elif name.endswith("_scale"):
            t = (0.5 + 0.5 * torch.rand(shape, generator=gen, device=device)).to(torch.bfloat16).float()
        elif len(shape) == 1:
            t = 1.0 + 0.1 * torch.randn(shape, generator=gen, device=device)
        else:
            t = torch.randn(shape, generator=gen, device=device) / math.sqrt(shape[1])
        if dtype == FP8:
            base = name[:-len(".weight")]
            out[name], out[f"{base}.scale"] = fp8_block_quantize(t)
        else:
            out[name] = t.to(dtype).contiguous()
    return out


def random_checkpoint(cfg: ModelConfig, device="cuda", seed: int = 0, layers=None, wo_a_fp8: bool = False,
                      progress: bool = True) -> Checkpoint:
    """Random attention weights of every (or the given) layer on `device` (a progress bar on a terminal)."""
    from rich.progress import Progress
    gen = torch.Generator(device=device).manual_seed(seed)
    ids = list(range(cfg.n_layers)) if layers is None else sorted(layers)
    tensors = {}
    with Progress(transient=True, disable=not progress) as bar:
        task = bar.add_task("random weights", total=len(ids))
        for i in ids:
            tensors[i] = random_layer(cfg, i, device, gen, wo_a_fp8)
            bar.advance(task)
    return Checkpoint(cfg, tensors)


def _random_records(n: int, pack, width: int, device, gen: torch.Generator, chunk: int = 1 << 16) -> torch.Tensor:
    """n packed records of N(0, 0.25) values; a pool of `chunk` distinct records repeated."""
    m = min(n, chunk)
    base = pack((0.5 * torch.randn(m, width, generator=gen, device=device)).to(torch.bfloat16))
    reps = -(-n // m)
    return base.repeat(reps, 1)[:n]


def fill_state(state: DecodeState, lengths: Mapping[Hashable, int], seed: int = 0) -> None:
    """Admit each request of `lengths` and give it that many cached tokens of random valid records."""
    dev, cfg = state.device, state.cfg
    gen = torch.Generator(device=dev).manual_seed(seed)
    for req, n in lengths.items():
        state.admit(req)
        step = state.plan([(req, n)])
        s = state.slot(req)
        keep = min(n, state.window_size)
        ring = state.window_slots(torch.full((keep,), s), torch.arange(n - keep, n)).to(dev)
        for L, pool in state.window.items():
            pool[ring] = _random_records(keep, pack_window_kv, cfg.head_dim, dev, gen)
        for L in state.kv_sources:
            r = cfg.ratio(L)
            m = n // r
            if m:
                slots = state.entry_slots(r, s, torch.arange(m, device=dev))
                state.compressed[L][slots] = _random_records(m, pack_compressed_kv, cfg.head_dim, dev, gen)
                state.index_keys[L][slots] = _random_records(m, pack_index_key, cfg.index_head_dim, dev, gen)
            if r == 2:   # the open group's rows (positions n-2, n-1), kept for accept as a run would
                pos = torch.arange(max(0, n - 2), n, device=dev)
                kv = torch.randn(len(pos), cfg.head_dim, generator=gen, device=dev)
                score = torch.randn(len(pos), cfg.head_dim, generator=gen, device=dev)
                state.comp_kv[L][s, pos % 2] = kv
                state.comp_score[L][s, pos % 2] = score
                state.write_compressor_rows(L, s, pos, kv, score)
        state.advance(step)
