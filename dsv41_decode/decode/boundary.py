"""The single-GPU boundary of the specialized step (design section 3; spec section 4).

Between attention sublayer i and i+1 (no FFN plugged in): the post-mix of layer i's output into
the streams with the `post`/`comb` of site i, the collapse of the new streams with site i's `pre`
(the carried pre), the next layer's attn_norm and the MXFP8 quantization of the next input - one
fused launch on the main stream (`exit`: `ops.mhc.mhc_boundary_`, each row spread over chunks;
on CUDA in the co-resident form, `MhcBoundaryPlan.coresident`: every chunk normalizes itself once
the row's sum of squares is complete), or, with `DecodeStep(fold_boundary=True)` on one GPU where layer i's wo_b runs `ExactMM`
(`AttentionStep.takes_boundary`), the same work in wo_b's epilogue with the same bits
(`operands`, passed to `AttentionStep.run`). Site i+1's mixer depends only on the streams
entering it, so it runs on a side lane (`ops.hc_mix.hc_mix_`): in the buckets below
`DecodeStep(mix_late_rows=)` rows (default `MIX_LATE_ROWS`) from the moment those streams are
written, in the others enqueued after layer i+1's input projections; it is joined where its
post/comb/pre are first read (before the boundary's launch, or before wo_b when wo_b runs it).

Buffers are double-buffered by site parity: site k's mixer writes set k % 2 while the boundary of
site k-1 reads set (k-1) % 2.
"""

from __future__ import annotations

import torch

from ..ops.allreduce_boundary import Mailbox, allreduce_boundary_
from ..ops.hc_mix import HcMixPlan, hc_mix_
from ..ops.mhc import BoundaryOperands, MhcBoundaryPlan, mhc_enter_
from .lanes import AUX_MIXER, Event, Lanes


class Boundary:
    """The streams, mixer outputs and next-layer inputs of a step, and the ops between layers."""

    def __init__(self, stack, max_rows: int, device: torch.device, mailbox: Mailbox | None = None):
        """mailbox: the tensor-parallel mailbox of the fused all-reduce boundary (None: one rank, or
        the collective fallback, where the layer hands over its already reduced output)."""
        cfg = stack.cfg
        self.cfg, self.stack, self.mailbox = cfg, stack, mailbox
        B, hc, d = max_rows, cfg.hc_mult, cfg.dim
        self.u = torch.zeros(B, d, dtype=torch.bfloat16, device=device)
        self.codes = torch.zeros(B, d, dtype=torch.float8_e4m3fn, device=device)
        self.scales = torch.zeros(B, d // 32, dtype=torch.uint8, device=device)
        self.streams = [torch.zeros(B, hc, d, dtype=torch.bfloat16, device=device) for _ in range(2)]
        self.pre = [torch.zeros(B, hc, dtype=torch.float32, device=device) for _ in range(2)]
        self.post = [torch.zeros(B, hc, dtype=torch.float32, device=device) for _ in range(2)]
        self.comb = [torch.zeros(B, hc, hc, dtype=torch.float32, device=device) for _ in range(2)]
        # each row over chunks of 512 columns; co-resident on CUDA (outside the interpreter)
        self.exit_plan = MhcBoundaryPlan.build(d, B, device)
        # one plan per parity: two sites' mixers may be in flight at once
        self.plans = [HcMixPlan.build(d, B, device, **({"split": 1} if device.type != "cuda" else {}))
                      for _ in range(2)]

    def _w(self, layer: int, name: str) -> torch.Tensor:
        return self.stack.layers[layer].w[name]

    def mix(self, layer: int, x: torch.Tensor, slot: int, rows: int, lanes: Lanes, done: Event | None = None):
        """Enqueue site `layer`'s mixer of streams x [rows, hc, dim] on the side lane into set `slot`;
        returns the event that marks post/comb/pre written (`done` where given, from `Lanes.event`;
        None when it ran inline)."""
        cfg = self.cfg
        x_ready = lanes.mark()                                 # protects x (the new streams)
        with lanes.side(AUX_MIXER):
            lanes.wait(x_ready)
            hc_mix_(x, self._w(layer, "hc_attn_fn"), self._w(layer, "hc_attn_scale"),
                    self._w(layer, "hc_attn_base"), cfg.norm_eps, cfg.hc_eps, cfg.hc_sinkhorn_iters,
                    self.pre[slot][:rows], self.post[slot][:rows], self.comb[slot][:rows], self.plans[slot])
            return lanes.mark(done)

    def enter(self, layer: int, x: torch.Tensor, pre_in: torch.Tensor, rows: int) -> None:
        """The first layer's input: attn_norm(collapse(x, pre_in)) as BF16 and MXFP8, one launch
        (`ops.mhc.mhc_enter_`: the collapse adds the streams in the reference's order, ((t0 + t1) +
        t2) + t3, the norm runs one program per row, so a row's bits do not depend on the others)."""
        mhc_enter_(x, pre_in, self._w(layer, "attn_norm.weight"), self.cfg.norm_eps, self.u[:rows],
                   self.codes[:rows], self.scales[:rows])

    def operands(self, layer: int, nxt: int | None, x: torch.Tensor, slot: int, x_new: torch.Tensor,
                 rows: int) -> BoundaryOperands:
        """The single-GPU boundary after layer `layer` but its output: streams x [rows, hc, dim]
        that entered the site, its mixer's set `slot`, new streams into x_new, the next layer's
        input (collapse with this site's pre, its attn_norm - `layer`'s own when no layer follows -
        and MXFP8) into u/codes/scales, with `exit_plan` (for `exit`, or wo_b's epilogue)."""
        norm = self._w(nxt if nxt is not None else layer, "attn_norm.weight")
        return BoundaryOperands(x, self.post[slot][:rows], self.comb[slot][:rows], self.pre[slot][:rows], norm,
                                self.cfg.norm_eps, x_new, self.u[:rows], self.codes[:rows], self.scales[:rows],
                                self.exit_plan)

    def exit(self, layer: int, nxt: int | None, y: torch.Tensor, x: torch.Tensor, slot: int,
             x_new: torch.Tensor, rows: int, index: int = 0, release: bool = False, pdl: bool = False) -> None:
        """Post-mix layer `layer`'s output y into x_new; when a next layer follows, write its input
        (collapse with this site's pre, its attn_norm, MXFP8) into u/codes/scales (`operands`). With
        a mailbox, y is first the rank-ordered sum of the ranks' partials of the `index`-th boundary
        (written to y). release: the launch lets a next kernel launched by PDL start at its start
        (`mhc_boundary_(release=)`; not with a mailbox). pdl: the launch itself by PDL
        (`mhc_boundary_(pdl=)`; not with a mailbox)."""
        b = self.operands(layer, nxt, x, slot, x_new, rows)
        if self.mailbox is not None:
            allreduce_boundary_(self.mailbox, index, rows, b.x, b.post, b.comb, b.pre, b.norm_weight, b.eps, b.x_out,
                                b.u_out, b.codes_out, b.scales_out, y, b.plan)
            return
        b.launch(y, release, pdl)

    def memory_bytes(self) -> int:
        ts = [self.u, self.codes, self.scales, *self.streams, *self.pre, *self.post, *self.comb]
        ts += [t for p in self.plans for t in (p.partials, p.counters)]
        ts += [self.exit_plan.ws, self.exit_plan.counters, self.exit_plan.chunk_counters]
        return sum(t.numel() * t.element_size() for t in ts)
