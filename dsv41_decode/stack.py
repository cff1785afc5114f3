"""AttentionStack: a chosen list of attention layers with the mHC boundaries between them (spec section 4).

The streams X [N, hc, dim] BF16 enter each block; the attention site's mixer is computed from
them, the carried `pre` collapses them into the attention input, and the post-mix folds the
attention output back in. With no FFN plugged in, the attention site's `pre` is carried to the
next attention; an FFN hook `ffn(layer, u) -> ffn_out` ([N, dim] BF16 in and out) adds the FFN
site exactly as the official block does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from .config import ModelConfig
from .layer import AttentionLayer, CallContext
from .parallel import TensorParallel
from .reference.linear import rms_norm
from .reference.mhc import Mix, hc_mixes, hc_post, hc_pre
from .rows import StepRows, same_device
from .state import DecodeState, abandon_after
from .weights import Checkpoint

FfnHook = Callable[[int, torch.Tensor], torch.Tensor]


@dataclass
class BlockRecord:
    """One block's boundary quantities for one call (what a trace records)."""

    attn_in: torch.Tensor
    attn_out: torch.Tensor
    mix: Mix


class AttentionStack:
    """Layers `layer_ids` (ascending; every KV and index source they need must be among them).

    A stack of some of the configuration's layers runs on a `DecodeState` of the whole configuration
    and advances its requests as a call of every layer would: the other layers' caches are not
    written, so a later stack that runs them reads nothing for those positions. Serve with one
    stack of all layers; a partial stack is for tests and benchmarks of its layers."""

    def __init__(self, ckpt: Checkpoint, layer_ids: Sequence[int] | None = None, tp: TensorParallel | None = None):
        """Build the layers from a loaded checkpoint (its tensors stay on the device they were loaded to).

        tp: this rank's place in a tensor-parallel group (default: one rank); each layer keeps its
        rank's shard and reduces its output across the ranks (AttentionLayer).
        """
        if not isinstance(ckpt, Checkpoint):
            raise TypeError(f"ckpt must be a Checkpoint (load_checkpoint(path) reads one), got a "
                            f"{type(ckpt).__name__}: {ckpt!r}")
        cfg = ckpt.config
        if layer_ids is not None:
            layer_ids = list(layer_ids)
            if not layer_ids:
                raise ValueError("layer_ids: empty; a stack needs at least one layer (None: all of them)")
            bad = [i for i in layer_ids if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < cfg.n_layers]
            if bad:
                raise ValueError(f"layer_ids: {bad[0]!r} is not a layer id of this configuration "
                                 f"(0..{cfg.n_layers - 1})")
            if len(set(layer_ids)) < len(layer_ids):
                twice = min(i for i in layer_ids if layer_ids.count(i) > 1)
                raise ValueError(f"layer_ids: layer {twice} is listed twice")
        ids = list(range(cfg.n_layers)) if layer_ids is None else sorted(layer_ids)
        for i in ids:
            spec = cfg.plan[i]
            for src, what in ((spec.kv_source, "KV source"), (spec.index_source, "index source")):
                if src is not None and src not in ids:
                    raise ValueError(f"layer {i} needs its {what} layer {src} in the stack; got {ids}")
        self.cfg: ModelConfig = cfg
        self.ids = ids
        self.tp = tp or TensorParallel()
        if ckpt.shard != (1, 0) and ckpt.shard != (self.tp.tp, self.tp.rank):
            raise ValueError(f"the checkpoint holds the part of (tp, rank) = {ckpt.shard}, but this stack is "
                             f"rank {self.tp.rank} of tp={self.tp.tp}")
        sharded = ckpt.shard != (1, 0)
        self.layers = {i: AttentionLayer(cfg, cfg.plan[i], ckpt.layer(i), self.tp, sharded) for i in ids}

    def initial_pre(self, n: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """The carried `pre` entering the first block: one-hot on stream 0, [n, hc] FP32."""
        pre = torch.zeros(n, self.cfg.hc_mult, device=device)
        pre[:, 0] = 1.0
        return pre

    def block(self, i: int, x: torch.Tensor, pre_in: torch.Tensor, step: StepRows, state: DecodeState,
              ctx: CallContext, ffn: FfnHook | None = None) -> tuple[torch.Tensor, torch.Tensor, BlockRecord]:
        """One block: returns (streams out [N, hc, dim] BF16, carried pre [N, hc] FP32, record)."""
        cfg, w = self.cfg, self.layers[i].w
        mix = hc_mixes(x, w["hc_attn_fn"], w["hc_attn_scale"], w["hc_attn_base"], cfg.norm_eps,
                       cfg.hc_eps, cfg.hc_sinkhorn_iters)
        u = rms_norm(hc_pre(x, pre_in), w["attn_norm.weight"], cfg.norm_eps)
        y = self.layers[i].forward(u, step, state, ctx)
        mid = hc_post(y, x, mix.post, mix.comb)
        rec = BlockRecord(u, y, mix)
        if ffn is None:
            return mid, mix.pre, rec
        f = hc_mixes(mid, w["hc_ffn_fn"], w["hc_ffn_scale"], w["hc_ffn_base"], cfg.norm_eps, cfg.hc_eps,
                     cfg.hc_sinkhorn_iters)
        h = rms_norm(hc_pre(mid, mix.pre), w["ffn_norm.weight"], cfg.norm_eps)
        out = ffn(i, h)
        if not isinstance(out, torch.Tensor) or out.shape != h.shape or out.dtype != torch.bfloat16:
            raise ValueError(f"ffn(layer={i}, h) must return a {list(h.shape)} bfloat16 tensor like h, got "
                             f"{tuple(getattr(out, 'shape', ()))} {getattr(out, 'dtype', type(out).__name__)}")
        return hc_post(out, mid, f.post, f.comb), f.pre, rec

    def forward(self, x: torch.Tensor, step: StepRows, state: DecodeState, pre_in: torch.Tensor | None = None,
                ffn: FfnHook | None = None, ctx: CallContext | None = None,
                observe: Callable[[int, BlockRecord], None] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Run every layer of the stack on one call's rows, then advance the state (by every row;
        speculative decoding then keeps a prefix of each request's rows with `state.accept`).

        x: [N, hc, dim] BF16 streams entering the first layer; pre_in: [N, hc] FP32 (default one-hot).
        observe(layer, record) is called after each block. Returns (streams [N, hc, dim] BF16,
        carried pre [N, hc] FP32).
        Everything is checked before any cache is written (`DecodeState.check_step`: a stale, foreign
        or replaced step, a freed request; the state's layer plan; the types, shapes, dtypes and
        devices of x and pre_in: TypeError / ValueError naming them). An
        exception in a layer, an `ffn` hook or `observe` abandons the call (`DecodeState.abandon`:
        its rows can be planned again) before it propagates.
        """
        if not isinstance(state, DecodeState):
            raise TypeError(f"forward: state must be a DecodeState, got a {type(state).__name__} "
                            f"(the arguments are x, step, state)")
        state.check_step(step, "forward")
        if state.cfg is not self.cfg and state.cfg != self.cfg:
            raise ValueError("forward: the DecodeState was built for another configuration than the stack")
        for name, t in (("x", x), ("pre_in", pre_in)):
            if t is not None and not isinstance(t, torch.Tensor):
                raise TypeError(f"forward: {name} must be a torch.Tensor, got a {type(t).__name__}")
        if x.dim() != 3 or x.shape[0] != step.n_rows or x.shape[1:] != (self.cfg.hc_mult, self.cfg.dim) \
                or x.dtype != torch.bfloat16:
            raise ValueError(f"forward: streams x must be [{step.n_rows}, {self.cfg.hc_mult}, {self.cfg.dim}] "
                             f"bfloat16, got {tuple(x.shape)} {x.dtype}")
        if pre_in is not None and (pre_in.shape != (step.n_rows, self.cfg.hc_mult) or pre_in.dtype != torch.float32):
            raise ValueError(f"forward: pre_in must be [{step.n_rows}, {self.cfg.hc_mult}] float32, got "
                             f"{tuple(pre_in.shape)} {pre_in.dtype}")
        for name, t in (("x", x), ("pre_in", pre_in)):
            if t is not None and not same_device(t.device, state.device):
                raise ValueError(f"forward: {name} is on {t.device}, the state on {state.device}: move it to "
                                 f"the state's device")
        ctx = ctx if ctx is not None else CallContext()
        pre = self.initial_pre(step.n_rows, x.device) if pre_in is None else pre_in
        try:
            for i in self.ids:
                x, pre, rec = self.block(i, x, pre, step, state, ctx, ffn)
                if observe is not None:
                    observe(i, rec)
        except BaseException as err:
            abandon_after(state, step, err)
            raise
        state.advance(step)
        return x, pre

    def prefill(self, state: DecodeState, request, x: torch.Tensor, chunk: int = 64, path: str = "auto",
                pre: torch.Tensor | None = None, step=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Fill `request`'s decode state from its prompt streams x [n, hc, dim] BF16, `chunk` rows per
        call: through the step's kernels on CUDA (path "auto" or "kernels"), through `forward`
        elsewhere ("reference"). Returns the streams and carried pre leaving the last layer; see
        `prefill.prefill` for the paths' numbers, `step=` reuse and the errors."""
        from .prefill import prefill
        return prefill(self, state, request, x, chunk=chunk, path=path, pre=pre, step=step)

    def decode_step(self, state: DecodeState, max_rows: int = 16, **options):
        """The specialized decode step of this stack over `state` (`decode.DecodeStep`): plans,
        buffers and CUDA graphs (one per row bucket up to max_rows) are built here, once.

        options: the keyword arguments of DecodeStep (buckets, graphs, overlap, tp_boundary,
        wo_a_fp8, exact_linears, fp32_dots, fold_index_chain, fold_boundary, weights_lane, comp_tail,
        mix_late_rows, index_row_group, fuse_scales, pair_slots), documented there.
        """
        from .decode import DecodeStep   # decode/ composes the stack, not the other way round
        return DecodeStep(self, state, max_rows=max_rows, **options)
