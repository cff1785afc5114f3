"""Helpers shared by the test modules (tests import this module, never each other):

- the independent oracle of the number-format and cache-record tests (test_formats.py,
  test_records.py): codes by searching the sorted table of every representable value (ties to the
  even code), scale exponents from an exact float64 product and frexp - never the module's bit
  tricks - and the varied test data;
- the decode step's reduced configuration, inputs and teacher-forced comparison against the
  generic path (tests/decode/test_step.py on the CPU, test_step_gpu.py on a GPU, test_step_tp.py
  under TP);
- the rank processes of the CPU tensor-parallel tests (test_parallel.py, test_step_tp.py);
- the runner of the sm_90 compile scripts (tests/ops/_*_sm90.py, `compile_script`).

`tests/` is on sys.path (pytest inserts the folder of tests/conftest.py), so `import helpers`
works from every test folder.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.multiprocessing as mp

from dsv41_decode import formats as fm
from dsv41_decode.config import ModelConfig
from dsv41_decode.decode import AttentionStep
from dsv41_decode.decode.boundary import Boundary
from dsv41_decode.decode.tables import StepMeta
from dsv41_decode.layer import CallContext
from dsv41_decode.records import unpack_compressed_kv, unpack_index_key, unpack_window_kv
from dsv41_decode.reference import attention as ref_attention
from dsv41_decode.reference.attention import output_projection
from dsv41_decode.reference.linear import rms_norm
from dsv41_decode.reference.mhc import hc_mixes, hc_post, hc_pre
from dsv41_decode.reference.rope import rope_cis
from dsv41_decode.stack import AttentionStack
from dsv41_decode.state import DecodeState
from dsv41_decode.testing.compare import rel_rms as rel
from dsv41_decode.testing.compare import row_ulp_distance, ulp_distance
from dsv41_decode.testing.trace import MAX_ULP, attribute_attn_out, wo_b_input


# ------------------------------------------------------------------------ the format oracle
E4M3_BYTES = torch.arange(127, dtype=torch.uint8)  # 0x00..0x7E: every non-negative finite code
E4M3_GRID = E4M3_BYTES.view(torch.float8_e4m3fn).double()  # ascending, index == byte
E2M1_GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)


def run_b32_ptx(asm: str, regs: dict, ops: dict | None = None) -> dict:
    """Interpret straight-line PTX `asm` (an inline-asm body: `{`, .reg lines, instructions, `}`)
    on uint32 numpy arrays, one lane per element: prmt.b32 in its default mode, shl.b32, and.b32 and
    mov.b32, plus `ops` ({opcode: f(*source values) -> uint32 array}) for others; regs holds the
    operands ("$0", "$1", ...) and immediates read as ints. Returns every register after the last
    instruction (an unknown opcode raises, naming it)."""
    import numpy as np

    regs = dict(regs)

    def val(tok):
        tok = tok.strip()
        return regs[tok] if tok in regs else np.uint32(int(tok, 0))

    body = [line.strip().rstrip(";") for line in asm.strip().strip("{}").splitlines()]
    for line in body:
        if not line or line.startswith(".reg"):
            continue
        op, args = line.split(None, 1)
        d, *src = [a.strip() for a in args.split(",")]
        if op == "prmt.b32":
            a, b, sel = (np.asarray(val(x), dtype=np.uint64) for x in src)
            pool = a | (b << np.uint64(32))
            out = np.zeros(np.broadcast(pool, sel).shape, dtype=np.uint64)
            for i in range(4):
                nib = (sel >> np.uint64(4 * i)) & np.uint64(0xF)
                byte = (pool >> ((nib & np.uint64(7)) * np.uint64(8))) & np.uint64(0xFF)
                rep = np.where(byte & np.uint64(0x80), np.uint64(0xFF), np.uint64(0))
                out |= np.where(nib & np.uint64(8), rep, byte) << np.uint64(8 * i)
            regs[d] = out.astype(np.uint32)
        elif op == "shl.b32":
            regs[d] = (np.asarray(val(src[0]), dtype=np.uint64) << np.uint64(int(src[1], 0))).astype(np.uint32)
        elif op == "and.b32":
            regs[d] = np.asarray(val(src[0]), dtype=np.uint32) & np.asarray(val(src[1]), dtype=np.uint32)
        elif op == "mov.b32":
            regs[d] = np.asarray(val(src[0]), dtype=np.uint32)
        elif ops and op in ops:
            regs[d] = ops[op](*(val(x) for x in src))
        else:
            raise AssertionError(f"the model does not know {op!r}: extend it with the instruction's semantics")
    return regs


def finite_e4m3_bytes() -> torch.Tensor:
    """All 254 bytes of finite E4M3 values (both signs, +0 and -0; not 0x7F / 0xFF)."""
    return torch.cat((E4M3_BYTES, E4M3_BYTES | 0x80))


def nearest_even_index(v: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
    """Index into the ascending grid of the nearest grid value to |v| (ties to the even index)."""
    a = v.double().abs().clamp(max=float(grid[-1]))
    hi = torch.searchsorted(grid, a).clamp(1, len(grid) - 1)
    lo = hi - 1
    d_lo, d_hi = a - grid[lo], grid[hi] - a
    return torch.where((d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0)), hi, lo)


def ref_e4m3_bytes(v: torch.Tensor) -> torch.Tensor:
    sign = torch.signbit(v).to(torch.uint8) << 7
    return nearest_even_index(v, E4M3_GRID).to(torch.uint8) | sign


def ref_e2m1_codes(v: torch.Tensor) -> torch.Tensor:
    sign = torch.signbit(v).to(torch.uint8) << 3
    return nearest_even_index(v, E2M1_GRID).to(torch.uint8) | sign


def ref_ceil_log2_scale(amax: torch.Tensor, inv_qmax: float) -> torch.Tensor:
    """ceil(log2(fp32(amax * fp32(inv_qmax)))): exact float64 product, one rounding to FP32."""
    p = (amax.double() * float(torch.tensor(inv_qmax, dtype=torch.float32))).float().double()
    mantissa, exponent = torch.frexp(p)  # p = mantissa * 2^exponent, mantissa in [0.5, 1)
    return (exponent - (mantissa == 0.5).to(exponent.dtype)).to(torch.int32)


def ref_mx(x: torch.Tensor, block: int, floor: float, qmax: float, ref_codes):
    """(codes, UE8M0 bytes) of an MX format, from the oracle."""
    xb = x.float().reshape(*x.shape[:-1], -1, block)
    amax = xb.abs().amax(-1).clamp(min=floor)
    k = ref_ceil_log2_scale(amax, 1.0 / qmax)
    s = torch.tensor(2.0, dtype=torch.float64) ** k.double()
    codes = ref_codes((xb.double() / s.unsqueeze(-1)).float())
    return codes.reshape(x.shape), (k + 127).to(torch.uint8)


def ref_nvfp4(x: torch.Tensor, group: int = 16):
    """(E2M1 codes, E4M3 scale bytes) of NVFP4, from the oracle."""
    xg = x.float().reshape(*x.shape[:-1], -1, group)
    amax = xg.abs().amax(-1).clamp(min=fm.NVFP4_AMAX_FLOOR)
    # The FP32 quotient amax / 6: a float64 quotient rounded once to FP32 is the correctly rounded
    # FP32 quotient (53 >= 2 * 24 + 2 bits), then RNE to E4M3.
    scale_bytes = ref_e4m3_bytes((amax.double() / 6.0).float())
    s = scale_bytes.view(torch.float8_e4m3fn).double()
    codes = ref_e2m1_codes((xg.double() / s.unsqueeze(-1)).float())
    return codes.reshape(x.shape), scale_bytes


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).reshape(*packed.shape[:-1], -1)


def raw_bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of t, so that equality is bit equality (NaN, -0.0 included)."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def varied(shape, seed: int, dtype=torch.float32, decades: int = 30) -> torch.Tensor:
    """Random values whose blocks of 16 span 1e-decades .. 1e+decades, some mixing tiny and huge."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g, dtype=torch.float64)
    blocks = x.reshape(-1, 16)
    magnitude = 10.0 ** torch.randint(-decades, decades + 1, (blocks.shape[0], 1), generator=g).double()
    mixed = torch.rand(blocks.shape, generator=g) < 0.1
    spread = 10.0 ** torch.randint(-decades, decades + 1, blocks.shape, generator=g).double()
    blocks = torch.where(mixed, blocks * spread, blocks * magnitude)
    blocks[::7, 3] = 0.0
    blocks[::5, 4] = -0.0
    return blocks.reshape(shape).to(dtype)


# ------------------------------------------------------------------------ the decode step
# (name, N, K) of the V4.1-Flash attention linears the low-batch GEMM plans serve, with the TP
# shards of wq_b (N / tp) and wo_b (K / tp); the indexer's wq_b is wq_b's TP8 shape.
FLASH_LINEAR_SHAPES = [
    ("fused_wqa_wkv", 1792, 5120),
    ("wq_b", 32768, 1280), ("wq_b_tp2", 16384, 1280), ("wq_b_tp4", 8192, 1280), ("wq_b_tp8", 4096, 1280),
    ("wo_b", 5120, 8192), ("wo_b_tp2", 5120, 4096), ("wo_b_tp4", 5120, 2048), ("wo_b_tp8", 5120, 1024),
]


def linear_operands(gen: torch.Generator, m: int, n: int, k: int, device: str | None = None):
    """(x BF16, w FP32, codes, x_scale, weight, w_scale) of an MXFP8 x FP8 linear: activations whose
    32-blocks span six orders of magnitude and a weight whose 32x32 tiles differ by up to 2^6, so
    that every scale matters; the last four on `device` (default: CUDA when there is one)."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    blocks = 10.0 ** torch.empty(m, k // 32).uniform_(-3, 3, generator=gen)
    x = torch.randn(m, k, generator=gen) * blocks.repeat_interleave(32, 1)
    w = torch.randn(n, k, generator=gen) * k ** -0.5
    tiles = 2.0 ** torch.randint(-3, 4, (-(-n // 32), k // 32), generator=gen).float()
    w = w * tiles.repeat_interleave(32, 0).repeat_interleave(32, 1)[:n]
    x = x.to(torch.bfloat16)
    codes, x_scale = fm.mxfp8_quantize(x)
    weight, w_scale = fm.fp8_block_quantize(w)
    return (x, w, *(t.to(device) for t in (codes, x_scale, weight, w_scale)))


def rope_operands(gen: torch.Generator, m: int, device: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [m, 32] FP32 of m random positions below 2^20 (YaRN-like frequencies), as the step's
    per-row RoPE tables hold them; on `device` (default: CUDA when there is one)."""
    from dsv41_decode.ops.kv_write import rope_cos_sin
    from dsv41_decode.reference.rope import rope_cis
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    pos = torch.randint(0, 1 << 20, (m,), generator=gen)
    cos, sin = rope_cos_sin(rope_cis(1.0 / (160000 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64)), pos))
    return cos.to(device), sin.to(device)


def boundary_operands(gen: torch.Generator, m: int, dim: int, block_d: int = 512, device: str | None = None):
    """`ops.mhc.BoundaryOperands` of m rows of width dim on `device` (default: CUDA when there is one):
    streams ~ N(0, 1) BF16, post and pre as the mixer's sigmoids, comb from the reference Sinkhorn,
    a BF16 norm weight near 1, eps 1e-20, poisoned outputs (NaN streams and u, codes 0x7F, scales
    0xFF) and a fresh `MhcBoundaryPlan` of block_d-column chunks for up to max(m, 4) rows."""
    from dsv41_decode.ops.mhc import BoundaryOperands, MhcBoundaryPlan
    from dsv41_decode.reference.mhc import sinkhorn
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    x = torch.randn(m, 4, dim, generator=gen).bfloat16()
    post = 2 * torch.sigmoid(torch.randn(m, 4, generator=gen))
    comb = sinkhorn(2 * torch.randn(m, 4, 4, generator=gen), 20, 1e-6)
    pre = torch.sigmoid(torch.randn(m, 4, generator=gen)) + 1e-6
    w = (1 + 0.2 * torch.randn(dim, generator=gen)).bfloat16()
    nan = float("nan")
    outs = (torch.full((m, 4, dim), nan, dtype=torch.bfloat16), torch.full((m, dim), nan, dtype=torch.bfloat16),
            torch.full((m, dim), 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn),
            torch.full((m, dim // 32), 0xFF, dtype=torch.uint8))
    x, post, comb, pre, w, *outs = (t.to(device) for t in (x, post, comb, pre, w, *outs))
    return BoundaryOperands(x, post, comb, pre, w, 1e-20, *outs, MhcBoundaryPlan.build(dim, max(m, 4), device, block_d))


def raises(match: str, fn) -> None:
    """fn() raises a TypeError or ValueError whose message matches `match`."""
    import pytest
    with pytest.raises((TypeError, ValueError), match=match):
        fn()


def check_mxfp8_plan_errors(plan_type, codes, x_scale, weight, w_scale) -> None:
    """The argument errors every low-batch MXFP8 x FP8 linear plan shares, each naming the
    argument (`ops.checks.mxfp8_linear_args` on the call of `plan_type(weight, w_scale,
    max_rows=8)`, `mxfp8_weight_args` at construction). codes: [m <= 4, 128] with its x_scale; weight
    [n, 128] with its w_scale."""
    m, n = codes.shape[0], weight.shape[0]
    plan = plan_type(weight, w_scale, max_rows=8)
    out = lambda dtype, cols: torch.empty(m, cols, dtype=dtype, device=codes.device)  # noqa: E731
    raises("codes must have dtype", lambda: plan(codes.float(), x_scale))
    raises("codes must have shape", lambda: plan(codes[:, :96], x_scale))
    raises("codes must have unit stride", lambda: plan(codes.repeat(1, 2)[:, ::2], x_scale))
    raises("x_scale must have shape", lambda: plan(codes, x_scale[:, :2]))
    raises("x_scale must have dtype", lambda: plan(codes, x_scale.float()))
    raises("out must have dtype", lambda: plan(codes, x_scale, out(torch.float16, n)))
    raises("out must have shape", lambda: plan(codes, x_scale, out(torch.bfloat16, n + 1)))
    raises("ops.fp8_mm", lambda: plan(codes.repeat(33, 1), x_scale.repeat(33, 1)))
    raises("this plan takes 1..8", lambda: plan(codes.repeat(5, 1), x_scale.repeat(5, 1)))
    raises("M=0", lambda: plan(codes[:0], x_scale[:0]))
    raises("codes is on meta", lambda: plan(codes.to("meta"), x_scale))
    raises("weight must have dtype", lambda: plan_type(weight.view(torch.uint8), w_scale))
    raises("K a positive multiple of 32", lambda: plan_type(weight[:, :100], w_scale))
    raises("w_scale must have shape", lambda: plan_type(weight, w_scale[:1]))
    raises("w_scale must have dtype", lambda: plan_type(weight, w_scale.float()))
    raises("weight must have unit stride", lambda: plan_type(weight.t().contiguous().t(), w_scale))
    raises("max_rows", lambda: plan_type(weight, w_scale, max_rows=65))


def reduced_config() -> ModelConfig:
    """`small` cut to 6 layers, one of each kind (layer: kind, ratio, sources):
    0 SWA; 1 Full r2; 2 Reuse of 1; 3 Full r1 + candidate source; 4 Reindex (consumer of 3);
    5 Reuse of 4. o_lora_rank 64 halves the interpreter's wo_a work (its cost grows with R/block_n).
    """
    return ModelConfig.preset("small").replace(
        n_layers=6, compress_ratios=(0, 2, 2, 1, 1, 1), kv_source_layers=(1, 3),
        index_source_layers=(1, 3, 4), candidate_source_layer=3, window_size=8, index_topk=8,
        candidate_topk_blocks=3, candidate_block_size=4, o_lora_rank=64)


def streams(n: int, cfg: ModelConfig, g: torch.Generator, device="cpu") -> torch.Tensor:
    return torch.randn(n, cfg.hc_mult, cfg.dim, generator=g).to(torch.bfloat16).to(device)


def same_selection(step_ids: torch.Tensor, ref_ids: torch.Tensor, scores: torch.Tensor) -> bool:
    """Equal as sets of entry ids (-1 dropped), or, where they differ, a tie: every entry in one
    set but not the other scores exactly the k-th largest reference score (either choice is the
    k largest)."""
    a = set(step_ids.tolist()) - {-1}
    b = set(ref_ids.tolist()) - {-1}
    if a == b:
        return True
    if len(a) != len(b) or not b:
        return False
    kth = scores[sorted(b)].min()
    return all(bool(scores[e] == kth) for e in a ^ b)


class Recorder:
    """Captures, per step and layer, what the step fed each layer and what it left, and runs the
    reference layer on a snapshot of the state taken just before the step's layer ran.

    Installed by patching `AttentionStep.run`, `Boundary.mix` (the streams entering each site) and
    `StepMeta.load` (the step's planned rows).
    """

    def __init__(self, stack: AttentionStack, monkeypatch):
        self.stack = stack
        self.layers: dict[int, dict] = {}
        self.x_in: dict[int, torch.Tensor] = {}
        self.step_rows = self.o_ref = None
        self.ctx = CallContext(record={})
        rec = self
        run, mix, load = AttentionStep.run, Boundary.mix, StepMeta.load

        def run_(self, rows, u, codes, scales, y, events, shard=False, **boundary):
            L, n = self.spec.layer, rec.step_rows.n_rows
            snap = copy.deepcopy(self.state)
            u_in = u[:n].clone()             # a boundary in wo_b's epilogue overwrites u with the next input
            run(self, rows, u, codes, scales, y, events, shard, **boundary)
            y_ref = rec.stack.layers[L].forward(u_in.clone(), rec.step_rows, snap, rec.ctx)
            layer = rec.stack.layers[L]
            # the reference output projection applied to the step's attention output
            cis = rope_cis(layer.freqs, rec.step_rows.positions)
            y_of_o = output_projection(self.s.o[:n], cis, layer.wo_a, layer.w["attn.wo_b.weight"],
                                       layer.w["attn.wo_b.scale"], layer.cfg.o_groups, layer.cfg.rope_head_dim)
            rec.layers[L] = dict(u=u_in, y=y[:n].clone(), y_ref=y_ref, snap=snap,
                                 o=self.s.o[:n].clone(), o_ref=rec.o_ref, y_of_o=y_of_o,
                                 topk=self.selection.topk[:n].clone() if self.spec.runs_indexer else None)

        def projection_(o, *args):
            rec.o_ref = o.clone()
            return output_projection(o, *args)

        def mix_(self, layer, x, slot, rows, lanes):
            rec.x_in[layer] = x[:rec.step_rows.n_rows].clone()
            return mix(self, layer, x, slot, rows, lanes)

        def load_(self, step, bucket):
            rec.step_rows = step
            return load(self, step, bucket)

        monkeypatch.setattr(AttentionStep, "run", run_)
        monkeypatch.setattr(Boundary, "mix", mix_)
        monkeypatch.setattr(StepMeta, "load", load_)
        monkeypatch.setattr(ref_attention, "output_projection", projection_)

    def reset(self) -> None:
        self.layers, self.x_in, self.step_rows, self.o_ref = {}, {}, None, None
        self.ctx = CallContext(record={})


def written_ring_slots(state: DecodeState, rows) -> torch.Tensor:
    """Ring slots (global window rows) that a step's rows write: each row's s*W + p % W."""
    return state.window_slots(rows.req_slot, rows.positions)


def completed_entry_slots(state: DecodeState, rows, ratio: int) -> torch.Tensor:
    """Global compressed slots of the entries the step's rows complete (ratio `ratio`)."""
    out = []
    for i, rid in enumerate(rows.req_ids):
        s, start, cnt = state.slot(rid), rows.starts[i], rows.counts[i]
        done = range(start // ratio, (start + cnt) // ratio)
        if len(done):
            out.append(state.entry_slots(ratio, s, torch.tensor(list(done))))
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.int64)


@dataclass(frozen=True)
class Ulps:
    """A tolerance in BF16 ulps (`testing.compare.ulp_distance`; 0: bit for bit), where a bare float
    in a tolerance dict is a relative RMS."""

    n: float


# The criteria of the teacher-forced comparison, on the CPU (the interpreter): those of
# `trace verify` (testing/trace.py, spec section 9), which the step meets against the official
# traces, applied to one layer at a time on the same caches and input. What each bounds, and why,
# is next to its assertion in teacher_forced. Measured here (reduced config, TF_STEPS): records,
# o and u bit for bit; y bitwise except one layer-4 row of 161 elements up to 96 ulps (one FP8
# code flip of wo_b's input, explained); the post-mixed streams 1 ulp of the row's largest value
# at 4 elements.
CPU_TOL = dict(o=Ulps(0), proj=Ulps(MAX_ULP), y=Ulps(MAX_ULP), window_bytes=1.0, entry_bytes=1.0,
               boundary=Ulps(MAX_ULP))


def attn_out_ulps(y: torch.Tensor, y_ref: torch.Tensor, o_ref: torch.Tensor, positions: torch.Tensor,
                  layer) -> float:
    """The worst row of `y` (a layer's attn_out, [n, dim]) against the reference's `y_ref` in BF16
    ulps, a row past MAX_ULP counted at its residual when ONE FP8 code flip of wo_b's input explains
    it (`testing.attribution`: z = grouped_wo_a(o_ref) moved at one element by <= FLIP_ULPS ulps, or
    o_ref moved so, through wo_b lands within MAX_ULP of y), at its distance otherwise."""
    res = SimpleNamespace(flips=[], attn_out_unexplained_ulp=0.0)
    o_ref, positions = o_ref.cpu(), positions.cpu()
    z_ref = wo_b_input(layer, o_ref.to(layer.device), positions.to(layer.device)).cpu()
    attribute_attn_out(res, y_ref.cpu(), z_ref, o_ref, positions, layer, y.cpu())
    return res.attn_out_unexplained_ulp


def _within(a: torch.Tensor, b: torch.Tensor, tol, ulps=ulp_distance) -> tuple[bool, str]:
    """(a within tol of b, the figure): tol an Ulps (measured by `ulps`) or a relative RMS."""
    if isinstance(tol, Ulps):
        d = ulps(a, b)
        return d <= tol.n, f"{d:.3g} ulp"
    e = rel(a, b)
    return e <= tol, f"rel RMS {e:.2e}"


def teacher_forced(stack, state, step, rec: Recorder, steps, g, tol) -> dict:
    """Run `steps` (rows lists) through `step` on `state` with `rec` installed and check, for each
    step, every layer alone and every boundary against the generic path. Returns the measurements."""
    cfg, dev = stack.cfg, state.device
    m = dict(kinds=set(), layers=[], window=[], compressed=[], index_keys=[], u=[], streams=[])
    for rows in steps:
        n = sum(r[1] for r in rows)
        x = streams(n, cfg, g, dev)
        rec.reset()
        out, pre = step(x, rows)
        sr = rec.step_rows
        assert sr.n_rows == n and out.shape == (n, cfg.hc_mult, cfg.dim) and pre.shape == (n, cfg.hc_mult)

        # -- every layer alone: output, top-k, records
        for L in stack.ids:
            spec, got = cfg.plan[L], rec.layers[L]
            m["kinds"].add(spec.label)
            e, e_o, e_proj = (rel(got["y"], got["y_ref"]), rel(got["o"], got["o_ref"]),
                              rel(got["y"], got["y_of_o"]))
            m["layers"].append((L, spec.label, e, e_o, e_proj))
            where = f"layer {L} ({spec.label}) rows {rows}"
            # attention output o, bit for bit on the CPU: the sparse MLA fixes every BF16 rounding as
            # the reference does (64-key blocks of the joined key list, P against the running max,
            # o once), its inputs are the same records (asserted below) and q (its projections add
            # the reference's FP32 block partials in the reference's order: they could differ only
            # where a partial's last bit tips a BF16 rounding, tests/ops/test_low_latency_mm.py, and
            # none does here). What the order of the FP32 sums may still move is o across a BF16
            # boundary where acc / sum lies within a few FP32 ulps of one (about 2^-14 per element,
            # tests/ops/test_sparse_mla.py), and none does here: measured bitwise at every layer.
            # Ulps(0) is that; a GPU passes its measured relative RMS instead.
            ok, fig = _within(got["o"], got["o_ref"], tol["o"])
            assert ok, f"{where}: attention output {fig}"
            # wo_a + MXFP8 + wo_b on the step's own o vs the reference projection of it, then y vs
            # the reference layer: as `trace verify` checks attn_out. The step's wo_a sums z's FP32
            # dots in another order, so z may be an ulp off at an element; each side rounds y once,
            # so MAX_ULP = 2 ulps - unless that z element sits at an E4M3 rounding boundary of its
            # MXFP8 block, where the ulp moves its code by 1/8 of a binade and wo_b spreads the step
            # over the row (measured: layer 4, 161 elements up to 96 ulps, o bitwise). Such a row
            # passes only when ONE code flip of z (or an ulp move of one o element) explains it at
            # MAX_ULP (attn_out_ulps; testing/attribution.py derives the criterion).
            y_ulps = lambda a, b: attn_out_ulps(a, b, got["o_ref"], sr.positions, stack.layers[L])
            ok, fig = _within(got["y"], got["y_of_o"], tol["proj"], y_ulps)
            assert ok, f"{where}: output projection of the step's o, {fig}"
            ok, fig = _within(got["y"], got["y_ref"], tol["y"], y_ulps)
            assert ok, f"{where}: y {fig}"
            if spec.runs_indexer:
                scores = rec.ctx.record[f"layers.{L}.index_scores"]
                for row in range(n):
                    assert same_selection(got["topk"][row], rec.ctx.topk[L][row], scores[row]), (
                        f"{where} row {row}: top-k {got['topk'][row].tolist()} vs reference "
                        f"{rec.ctx.topk[L][row].tolist()}")
            snap = got["snap"]      # holds the reference layer's records now
            # window records of the step's rows: the contract's MXFP8 of the RoPE'd BF16 kv, spec
            # section 9's quantized values, which `trace verify` requires bit for bit against the
            # official trace; so every byte equal (window_bytes 1.0; measured 100 % on the CPU,
            # where kv's GEMM adds the reference's FP32 block partials in its order). A GPU passes
            # its measured byte rate: there kv's FP32 sums may differ in the last bit, and a BF16 kv
            # that rounds the other way can move one E4M3 code (>= 99.48 % of the bytes equal on the
            # H200), so the decoded records are also compared.
            ring = written_ring_slots(state, sr)
            a, b = state.window[L][ring], snap.window[L][ring]
            m["window"].append((a == b).float().mean().item())
            assert m["window"][-1] >= tol["window_bytes"], f"{where}: window record bytes differ"
            if tol["window_bytes"] < 1.0:
                assert rel(unpack_window_kv(a), unpack_window_kv(b)) <= 1e-2
            # nothing else in the rings changed (other requests, free slots, padding rows)
            keep = torch.ones(state.stage_base, dtype=torch.bool, device=dev)
            keep[ring] = False
            assert torch.equal(state.window[L][:state.stage_base][keep], snap.window[L][:state.stage_base][keep]), (
                f"{where}: the step wrote ring slots outside its rows")
            if spec.owns_compressor:
                done = completed_entry_slots(state, sr, spec.ratio)
                assert done.numel() > 0
                # NVFP4 compressed KV and MXFP4 index keys: the contract's quantized values of the
                # group's FP32 latent, bit for bit as the window records (measured 100 % of the bytes
                # on the CPU). A GPU passes its measured byte rate: FP32 latents that differ in the
                # last bits can move a 4-bit code one step, and the decoded records are compared.
                ca, cb = state.compressed[L][done], snap.compressed[L][done]
                ia, ib = state.index_keys[L][done], snap.index_keys[L][done]
                m["compressed"].append((ca == cb).float().mean().item())
                m["index_keys"].append((ia == ib).float().mean().item())
                assert m["compressed"][-1] >= tol["entry_bytes"], f"{where}: compressed records differ"
                assert m["index_keys"][-1] >= tol["entry_bytes"], f"{where}: index-key records differ"
                if tol["entry_bytes"] < 1.0:
                    assert rel(unpack_compressed_kv(ca), unpack_compressed_kv(cb)) <= 5e-2
                    assert rel(unpack_index_key(ia), unpack_index_key(ib)) <= 5e-2
                others = torch.ones(state.compressed[L].shape[0], dtype=torch.bool, device=dev)
                others[done] = False
                assert torch.equal(state.compressed[L][others], snap.compressed[L][others])
                assert torch.equal(state.index_keys[L][others], snap.index_keys[L][others])
                if spec.ratio == 2:      # the open group of every request slot
                    # kv = u @ wkv^T and score = u @ wgate^T: FP32 dots of a BF16 row with FP32
                    # weights over dim terms in an order of each side's own, so |a - b| <=
                    # 2 gamma_(dim+1) sum_c |u_c w_c| (Higham 3.1; gamma_n = n 2^-24 / (1 - n 2^-24)),
                    # 2.5e-4..3.8e-4 here: looser than the figure kept below at 95 % of the entries,
                    # so the figure stays (measured on the CPU: at most 7e-7, 0.23 % of the bound;
                    # the entries the step's rows did not write are equal).
                    torch.testing.assert_close(state.comp_kv[L], snap.comp_kv[L], rtol=1e-4, atol=1e-4)
                    torch.testing.assert_close(state.comp_score[L], snap.comp_score[L], rtol=1e-4, atol=1e-4)

        # -- every boundary: the reference mixer and post-mix on the step's streams and outputs, as
        # `trace verify` checks them. The step's mixer sums its FP32 dots in another order
        # (split-K partials), so its coefficients are within attribution.mix_bounds of the
        # reference's (measured 3e-7 relative on the carried pre below), a change that moves
        # the FP32 collapse and post-mix far less than a BF16 ulp: each side then rounds once, so
        # u within MAX_ULP = 2 ulps (measured bitwise on the CPU); the post-mix sums cancel, so the
        # streams are measured in ulps of each stream's largest value (row_ulp_distance), 2 as
        # well (measured 1 ulp at 4 elements). A GPU passes its measured relative RMS instead.
        w = {L: stack.layers[L].w for L in stack.ids}
        pre_prev = stack.initial_pre(n, dev)
        for k, L in enumerate(stack.ids):
            x_k = rec.x_in[L]
            if k == 0:
                assert torch.equal(x_k, x)
            mix = hc_mixes(x_k, w[L]["hc_attn_fn"], w[L]["hc_attn_scale"], w[L]["hc_attn_base"],
                           cfg.norm_eps, cfg.hc_eps, cfg.hc_sinkhorn_iters)
            u_ref = rms_norm(hc_pre(x_k, pre_prev), w[L]["attn_norm.weight"], cfg.norm_eps)
            nxt = rec.x_in[stack.ids[k + 1]] if k + 1 < len(stack.ids) else out
            post_ref = hc_post(rec.layers[L]["y"], x_k, mix.post, mix.comb)
            m["u"].append(rel(rec.layers[L]["u"], u_ref))
            m["streams"].append(rel(nxt, post_ref))
            ok, fig = _within(rec.layers[L]["u"], u_ref, tol["boundary"])
            assert ok, f"layer {L}: input u {fig}"
            ok, fig = _within(nxt, post_ref, tol["boundary"], row_ulp_distance)
            assert ok, f"streams after layer {L}: {fig}"
            pre_prev = mix.pre
        # the carried pre: the step's mixer and the reference's are two FP32 evaluation orders of
        # the same coefficients; the bound the verifier derives for that (attribution.mix_bounds)
        # is 1.7e-4..1.9e-4 here, looser than the figure kept (measured 6e-8, 3e-7 relative).
        torch.testing.assert_close(pre, pre_prev, rtol=1e-4, atol=1e-5)

    return m


def run_ranks(fn, world: int, args: tuple, timeout: float = 600.0) -> None:
    """fn(rank, *args) for rank 0 .. world - 1, each in a process forked from this one, all joined:
    the gloo ranks of the CPU tensor-parallel tests. Forked, not spawned: a forked rank starts with
    this process's modules (torch, Triton, the package, the interpreter's rewritten kernels), which a
    spawned one imports again (~2 s a rank, ~25 s of the two files' CPU time). Raises the first
    failed rank's exception (`torch.multiprocessing.ProcessRaisedException`), or TimeoutError after
    `timeout` seconds with every rank killed (a hung collective fails its test, not the run)."""
    ranks = mp.start_processes(fn, args=args, nprocs=world, join=False, start_method="fork")
    deadline = time.monotonic() + timeout
    while not ranks.join(timeout=max(deadline - time.monotonic(), 0.0)):
        if time.monotonic() >= deadline:
            for p in ranks.processes:
                p.kill()
                p.join()
            raise TimeoutError(f"{world} ranks of {fn.__name__} still running after {timeout:.0f} s")


def one_line_error(capsys) -> str:
    """stderr of a failed command: exactly one line, no traceback, nothing on stdout; returned."""
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert " error: " in lines[0] and not out.strip(), (out, err)
    return lines[0]


# --- the sm_90 compile scripts --------------------------------------------------------------------

def compile_env() -> dict:
    """The environment of a compile script's subprocess: this one's without TRITON_INTERPRET (a
    kernel must be a real JIT function to compile for sm_90) and with the repository on PYTHONPATH."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[1]), env.get("PYTHONPATH", "")])
    return env


def compile_script(script: Path, *args: str) -> tuple[str, list[dict]]:
    """Run a compile script (tests/ops/_*_sm90.py) with `args` in a subprocess (`compile_env`);
    asserts it exits 0 and returns (its stdout, the JSON objects of its lines that start with "{")."""
    res = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, env=compile_env(),
                         timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr[-3000:]
    return res.stdout, [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
