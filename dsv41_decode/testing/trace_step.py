"""The specialized step (`decode.DecodeStep`) teacher-forced on a golden trace, one layer at a time.

`StepReplay` builds the step eagerly (no CUDA graph) over a `DecodeState` and, for one decode call,
runs each layer's `AttentionStep` on the trace's recorded `attn_in` (quantized to MXFP8 as the
step's boundary would) instead of the streams its boundary computes: what `DecodeStep._schedule`
does per layer, minus the mHC boundary, so every layer sees the recorded input whatever the
earlier layers produced. The layers still share the step's tables, selections and candidate pool
within the call, as in the captured step.

`pad_heads`: the step runs 8, 16, 32 or 64 local heads; a checkpoint with fewer gets zero heads,
which contribute exactly nothing (see there).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..decode.lanes import StepEvents
from ..ops.act_quant import act_quant_mxfp8_
from ..ops.sparse_mla import SUPPORTED_HEADS
from ..weights import Checkpoint


def step_heads(n_heads: int, o_groups: int) -> int:
    """The smallest head count the step runs that holds `n_heads` with whole `wo_a` groups."""
    for h in SUPPORTED_HEADS:
        if h >= n_heads and h % o_groups == 0:
            return h
    raise ValueError(f"n_heads={n_heads}: the step runs {SUPPORTED_HEADS} local heads; no padding fits "
                     f"{o_groups} wo_a groups")


def pad_heads(ckpt: Checkpoint, heads: int) -> Checkpoint:
    """`ckpt` with `heads` query heads: each `wo_a` group g keeps its heads first and gets
    heads - n_heads zero heads after them (heads_per_group grows from H/G to heads/G).

    A padded head's query is zero (zero rows in `wq_b`, scale byte 1.0), so its attention output is
    some average of the keys, and its `wo_a` columns are zero, so each of its products in `wo_a` is
    exactly +-0: an FP32 sum of the real heads' products plus zeros is bit for bit the same sum,
    and z, `wo_b` and attn_out are unchanged (tests/test_trace_step.py checks this on the reference
    layers: every attn_out of official-tiny bitwise equal with and without the padding). The sink
    of a padded head is 0 (any finite value: the head's output is multiplied by zeros).
    Nothing else depends on the head count (the indexer has its own heads).
    """
    cfg = ckpt.config
    H, G, D = cfg.n_heads, cfg.o_groups, cfg.head_dim
    if heads == H:
        return ckpt
    if heads < H or heads % G:
        raise ValueError(f"cannot pad {H} heads in {G} groups to {heads}")
    hpg, new_hpg = H // G, heads // G
    # new head index of each old head: group g keeps slots g*new_hpg .. g*new_hpg + hpg - 1
    keep = torch.tensor([g * new_hpg + j for g in range(G) for j in range(hpg)])

    def as_bytes(t: torch.Tensor) -> torch.Tensor:          # FP8 / UE8M0 tensors are moved as bytes
        return t.view(torch.uint8) if t.element_size() == 1 and t.is_floating_point() else t

    def rows_by_head(t: torch.Tensor, per_head: int, fill: int = 0) -> torch.Tensor:
        src = as_bytes(t)
        out = src.new_full((heads * per_head, *src.shape[1:]), fill)
        out.view(heads, per_head, *src.shape[1:])[keep.to(src.device)] = src.view(H, per_head, *src.shape[1:])
        return out.view(t.dtype)

    def cols_by_group(t: torch.Tensor, per_head: int, fill: int = 0) -> torch.Tensor:
        src = as_bytes(t)
        n = src.shape[0]
        out = src.new_full((n, new_hpg, per_head), fill)     # row r of group r // o_lora_rank
        out[:, :hpg] = src.view(n, hpg, per_head)
        return out.reshape(n, new_hpg * per_head).view(t.dtype)

    layers = {}
    for i, w in ckpt.layers.items():
        w = dict(w)
        one = 127                                             # UE8M0 byte of 2^0
        w["attn.wq_b.weight"] = rows_by_head(w["attn.wq_b.weight"], D)
        w["attn.wq_b.scale"] = rows_by_head(w["attn.wq_b.scale"], D // 32, one)
        w["attn.attn_sink"] = rows_by_head(w["attn.attn_sink"], 1)
        w["attn.wo_a.weight"] = cols_by_group(w["attn.wo_a.weight"], D)
        if "attn.wo_a.scale" in w:
            w["attn.wo_a.scale"] = cols_by_group(w["attn.wo_a.scale"], D // 32, one)
        layers[i] = w
    return Checkpoint(cfg.replace(n_heads=heads), layers, ckpt.path, ckpt.shard)


@dataclass
class StepLayerOut:
    """What one layer of the step left for the verifier (CPU tensors, the call's n rows)."""

    y: torch.Tensor                      # [n, dim] BF16 attention output
    z: torch.Tensor                      # [n, o_groups * o_lora_rank] BF16, wo_b's input
    o: torch.Tensor                      # [n, H, 512] BF16, the sparse MLA's output
    topk: torch.Tensor | None            # [n, k] this layer's own selection (index sources)
    scores: torch.Tensor | None          # [n, width] the indexer's scores (index sources)
    latent: torch.Tensor | None          # [n, 512] the compressor latent (KV sources)
    candidates: torch.Tensor | None      # [n, width] bool candidate pool (candidate source)


class StepReplay:
    """A `DecodeStep` of `stack` over `state` (eager), driven one layer at a time."""

    def __init__(self, stack, state, max_rows: int, exact_linears: bool = True, fp32_dots: bool = False):
        self.stack, self.state = stack, state
        self.step = stack.decode_step(state, max_rows=max_rows, graphs=False, exact_linears=exact_linears,
                                      fp32_dots=fp32_dots)
        self.rows = self.bucket = 0
        self.events = StepEvents()

    def begin(self, planned) -> None:
        """Load a planned call's rows (`DecodeState.plan`) into the step's tables."""
        step = self.step
        self.rows, self.bucket = planned.n_rows, step.bucket_for(planned.n_rows)
        step.meta.load(planned, self.bucket)
        step.meta.derive(self.bucket)
        self.events = StepEvents()

    def run_layer(self, layer: int, u: torch.Tensor, forced: list[torch.Tensor] | None = None) -> StepLayerOut:
        """Run layer `layer` on inputs u [n, dim] BF16 (the recorded attn_in) and read its outputs.

        forced: per row, a selection (entry ids) that replaces the index source's own top-k (the
        recorded one, where ours differs only by tied scores); the layers after it that reuse the
        selection read it too. Running a layer again is safe: every write of a layer goes to a
        place fixed by the row's position (ring and staging slots, entry slots, the compressor's
        p % 2 state), with the same values."""
        step, n, b = self.step, self.rows, self.bucket
        bd, s = step.boundary, step.scratch
        bd.u[:n].copy_(u)
        bd.u[n:b].zero_()                                    # the bucket's padding rows
        act_quant_mxfp8_(bd.u[:b], bd.codes[:b], bd.scales[:b])
        att = step.layers[layer]
        if forced is not None:
            k = att.cfg.index_topk
            table = torch.full((b, k), -1, dtype=torch.int32)
            for r, ids in enumerate(forced):
                table[r, :ids.numel()] = ids.sort().values.to(torch.int32)
            att.forced_topk = table.to(step.device)
        try:
            att.run(b, bd.u[:b], bd.codes[:b], bd.scales[:b], step.y[:b], self.events)
        finally:
            att.forced_topk = None
        if step.device.type == "cuda":
            torch.cuda.synchronize(step.device)             # side lanes included
        spec = step.layers[layer].spec
        sel, cand = att.selection, att.candidate_mask
        return StepLayerOut(
            y=step.y[:n].cpu().clone(), z=s.z[:n].cpu().clone(), o=s.o[:n].cpu().clone(),
            topk=None if sel is None else sel.topk[:n].cpu().long(),
            scores=None if sel is None else s.scores[:n].cpu().clone(),
            latent=s.lat[:n].cpu().clone() if spec.owns_compressor else None,
            candidates=None if cand is None else cand[:n].cpu().bool())

    def selection(self, layer: int) -> torch.Tensor:
        """Index source `layer`'s selection of the current call: [n, k] int64, -1 padded."""
        return self.step.selections[layer].topk[:self.rows].cpu().long()


class StepBoundaryOps:
    """The step's boundary kernels on a trace's recorded tensors: its mixer (`ops.hc_mix.hc_mix_`),
    its first input (`ops.mhc.mhc_enter_`) and its fused post-mix + collapse + norm + MXFP8
    (`ops.mhc.mhc_boundary_`), with the plans the
    step builds (`decode.boundary.Boundary`), for `rows` rows on `device`."""

    def __init__(self, dim: int, rows: int, device: torch.device | str):
        from ..ops.hc_mix import HcMixPlan
        from ..ops.mhc import MhcBoundaryPlan
        dev = torch.device(device)
        self.dim, self.rows, self.device = dim, rows, dev
        self.mix_plan = HcMixPlan.build(dim, rows, dev, **({"split": 1} if dev.type != "cuda" else {}))
        self.exit_plan = MhcBoundaryPlan.build(dim, rows, dev)

    def mixer(self, x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, cfg):
        """(pre, post, comb) of the site with weights fn/scale/base for streams x [n, hc, dim] (CPU out)."""
        from ..ops.hc_mix import hc_mix_
        from ..reference.mhc import Mix
        n, hc, dev = x.shape[0], x.shape[1], self.device
        pre, post = torch.zeros(n, hc, device=dev), torch.zeros(n, hc, device=dev)
        comb = torch.zeros(n, hc, hc, device=dev)
        hc_mix_(x.to(dev).contiguous(), fn.to(dev), scale.to(dev), base.to(dev), cfg.norm_eps, cfg.hc_eps,
                cfg.hc_sinkhorn_iters, pre, post, comb, self.mix_plan)
        return Mix(pre.cpu(), post.cpu(), comb.cpu())

    def enter(self, x: torch.Tensor, pre: torch.Tensor, norm: torch.Tensor, eps: float) -> torch.Tensor:
        """The first layer's input u [n, dim] of `mhc_enter_` (the step's `Boundary.enter`; CPU out)."""
        from ..ops.mhc import mhc_enter_
        dev = self.device
        n, _, d = x.shape
        u = torch.zeros(n, d, dtype=torch.bfloat16, device=dev)
        codes = torch.zeros(n, d, dtype=torch.float8_e4m3fn, device=dev)
        scales = torch.zeros(n, d // 32, dtype=torch.uint8, device=dev)
        mhc_enter_(x.to(dev).contiguous(), pre.to(dev), norm.to(dev), eps, u, codes, scales)
        return u.cpu()

    def exit(self, y: torch.Tensor, x: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, pre: torch.Tensor,
             norm: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(new streams [n, hc, dim], next input u [n, dim]) of `mhc_boundary_` (CPU out)."""
        from ..ops.mhc import mhc_boundary_
        dev = self.device
        n, hc, d = x.shape
        x_out = torch.zeros(n, hc, d, dtype=torch.bfloat16, device=dev)
        u = torch.zeros(n, d, dtype=torch.bfloat16, device=dev)
        codes = torch.zeros(n, d, dtype=torch.float8_e4m3fn, device=dev)
        scales = torch.zeros(n, d // 32, dtype=torch.uint8, device=dev)
        mhc_boundary_(y.to(dev), x.to(dev).contiguous(), post.to(dev), comb.to(dev), pre.to(dev), norm.to(dev), eps,
                      x_out, u, codes, scales, self.exit_plan)
        return x_out.cpu(), u.cpu()
