"""AttentionLayer: one layer's weights and caches, and its generic forward (the reference schedule).

The forward takes the rows of one call (a prefill chunk, a decode step, or a mix; several rows of
one request sit at consecutive positions) and runs spec section 3 on them through the math of
`reference/`, reading and writing the layer's caches in `DecodeState` as packed records. Layers of
one call share a `CallContext`: the top-k of each index source and the candidate pool, which the
Reuse and Reindex layers that follow read.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .config import FULL, SWA, LayerSpec, ModelConfig
from .formats import mxfp8_fake
from .reference import attention as ref_attn
from .reference import compressor as ref_comp
from .reference import indexer as ref_idx
from .reference.linear import fp8_linear, rms_norm
from .reference.rope import rope_cis, rope_freqs, rope_tail
from .parallel import TensorParallel
from .sharding import shard_layer
from .rows import StepRows
from .state import DecodeState
from .weights import dequantized


@dataclass
class CallContext:
    """What the layers of one call hand to each other, and optional recorded intermediates.

    topk[L]: per row, the selected compressed entries of index source L (int64 [k], ascending,
    -1 padded); candidates[L]: per row, the candidate source's pool as a bool mask over the visible
    entries. record: when not None, intermediates are stored under `layers.{L}.{name}` (per-row
    lists for `index_scores`). force_topk[L]: per row, a selection that replaces index source L's
    own top-k (a verifier uses it to feed a recorded selection after comparing its own).
    """

    topk: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    candidates: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    record: dict[str, object] | None = None
    force_topk: dict[int, list[torch.Tensor]] = field(default_factory=dict)

    def put_rows(self, table: dict, layer: int, n_rows: int, rows: slice, values: list) -> None:
        table.setdefault(layer, [None] * n_rows)[rows] = values

    def put(self, layer: int, name: str, req_id: object, value: object) -> None:
        """Record `value` of request `req_id` under `layers.{layer}.{name}` (a dict by request)."""
        if self.record is not None:
            self.record.setdefault(f"layers.{layer}.{name}", {})[req_id] = value


class AttentionLayer:
    """Layer `spec.layer` of the stack: its checkpoint tensors (names without `layers.N.`) and forward."""

    def __init__(self, cfg: ModelConfig, spec: LayerSpec, weights: dict[str, torch.Tensor],
                 tp: TensorParallel | None = None, sharded: bool = False):
        """cfg: the model's configuration; weights: the layer's full tensors, or (sharded=True) this
        rank's part of them (`load_checkpoint(..., tp=, rank=)` or `sharding.shard_layer`).

        Under tensor parallelism the layer runs its rank's heads and `wo_a` groups (`self.cfg` is
        the rank-local view: n_heads / tp, o_groups / tp), and its output is the rank-ordered FP32
        reduction of every rank's `wo_b` partial, rounded to BF16 once.
        """
        self.tp = tp or TensorParallel()
        if self.tp.tp > 1:
            cfg.check_tp(self.tp.tp)
            if not sharded:
                weights = shard_layer(cfg, weights, self.tp.tp, self.tp.rank)
            cfg = cfg.replace(n_heads=cfg.n_heads // self.tp.tp, o_groups=cfg.o_groups // self.tp.tp)
        self.cfg, self.spec, self.w = cfg, spec, weights
        # the dense indexer of a Full layer scores only this rank's share of the rows (design 2.4)
        self.row_sharded = self.tp.tp > 1 and spec.kind == FULL
        self.device = weights["attn.attn_sink"].device
        self.freqs = rope_freqs(cfg, spec.ratio).to(self.device)
        # wo_a is a BF16 matmul with BF16 weights; an FP8 checkpoint's values are exact in BF16.
        self.wo_a = dequantized(weights, "attn.wo_a").to(torch.bfloat16)

    def _fp8(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return fp8_linear(x, self.w[f"attn.{name}.weight"], self.w[f"attn.{name}.scale"])

    def forward(self, x: torch.Tensor, step: StepRows, state: DecodeState, ctx: CallContext) -> torch.Tensor:
        """The layer's attention output y [N, dim] BF16 for inputs x [N, dim] BF16 (already normed).

        Writes this call's window records (and, on a KV source, compressed entries and index keys)
        into `state`; `step.starts` are the lengths before the call (state.advance comes later).
        """
        cfg, spec, w = self.cfg, self.spec, self.w
        state.check_step(step, f"layer {spec.layer}")   # before any cache is written
        state.sync()         # open groups a deferred accept left: this layer reads comp_kv as it stands
        if x.shape != (step.n_rows, cfg.dim) or x.dtype != torch.bfloat16:
            raise ValueError(f"layer {spec.layer}: x must be [{step.n_rows}, {cfg.dim}] bfloat16, got "
                             f"{tuple(x.shape)} {x.dtype}")
        eps, rd = cfg.norm_eps, cfg.rope_head_dim
        dev = x.device
        pos = step.positions.to(dev)
        cis = rope_cis(self.freqs, pos)
        qr = rms_norm(self._fp8(x, "wq_a"), w["attn.q_norm.weight"], eps)            # [N, q_lora]
        kv = rms_norm(self._fp8(x, "wkv"), w["attn.kv_norm.weight"], eps)            # [N, 512]
        q = rope_tail(self._fp8(qr, "wq_b").view(-1, cfg.n_heads, cfg.head_dim), cis, rd)  # [N, H, 512]
        # The cache stores the codes of the rotated values, quantized once; they decode to window_kv.
        window_rot = rope_tail(kv, cis, rd)                                           # [N, 512]
        window_kv = mxfp8_fake(window_rot)
        if spec.runs_indexer:
            iq = ref_idx.index_query(qr, w["attn.indexer.wq_b.weight"], w["attn.indexer.wq_b.scale"],
                                     cis, cfg.index_n_heads, rd)                    # [N, Hi, 128]
            iw = ref_idx.index_weights(x, w["attn.indexer.weights_proj.weight"], cfg.index_head_dim)
        o = torch.zeros(step.n_rows, cfg.n_heads, cfg.head_dim, dtype=torch.bfloat16, device=dev)
        prepared = []
        for i, rid in enumerate(step.req_ids):
            rows = step.request_rows(i)
            slot, start, p_rows = state.slot(rid), step.starts[i], pos[rows]
            keys_w, pos_w = self._window(state, slot, start, p_rows, window_kv[rows], window_rot[rows])
            if spec.owns_compressor:
                self._compress(x[rows], p_rows, state, rid, ctx)
            comp = None
            if spec.kind != SWA:
                n_vis = (int(p_rows[-1]) + 1) // spec.ratio
                comp = state.read_entries(spec.kv_source, slot, n_vis) if n_vis else None
            self._select(rows, step.n_rows, p_rows, comp, iq if spec.runs_indexer else None,
                         iw if spec.runs_indexer else None, ctx)
            prepared.append((rows, p_rows, keys_w, pos_w, comp))
        if self.row_sharded:
            self._exchange_rows(step, ctx)
        for rows, p_rows, keys_w, pos_w, comp in prepared:
            topk = None if spec.kind == SWA else ctx.topk[spec.index_source][rows]
            for r, p in zip(range(rows.start, rows.stop), p_rows.tolist()):
                in_window = (pos_w > p - cfg.window_size) & (pos_w <= p)
                keys, valid = keys_w[in_window], torch.ones(int(in_window.sum()), dtype=torch.bool, device=dev)
                if topk is not None and topk[r - rows.start].numel():
                    sel = topk[r - rows.start]
                    keys = torch.cat([keys, comp[0][sel.clamp(min=0)]])
                    valid = torch.cat([valid, sel >= 0])
                o[r] = ref_attn.sparse_attention(q[r], keys, valid, w["attn.attn_sink"],
                                                 cfg.softmax_scale)
        if ctx.record is not None:
            ctx.record[f"layers.{spec.layer}.o"] = o     # the attention output before wo_a (trace verifier)
        if self.tp.tp == 1:
            return ref_attn.output_projection(o, cis, self.wo_a, w["attn.wo_b.weight"], w["attn.wo_b.scale"],
                                              cfg.o_groups, rd)
        z = ref_attn.grouped_wo_a(o, cis, self.wo_a, cfg.o_groups, rd)
        partial = fp8_linear(z, w["attn.wo_b.weight"], w["attn.wo_b.scale"], out_dtype=torch.float32)
        return self.tp.reduce_partials(partial).to(torch.bfloat16)

    def _window(self, state: DecodeState, slot: int, start: int, p_rows: torch.Tensor,
                new: torch.Tensor, new_rot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write this request's new window rows (their rotated values `new_rot`, which the records
        quantize once to exactly `new`); return (keys, positions) of the window the rows see."""
        W = self.cfg.window_size
        past = torch.arange(max(0, start - W + 1), start, dtype=torch.long, device=new.device)
        keys = torch.cat([state.read_window(self.spec.layer, slot, past), new]) if past.numel() else new
        keep = slice(max(0, new.shape[0] - state.ring_size), None)  # the ring holds the last M positions
        state.write_window(self.spec.layer, slot, p_rows[keep], new_rot[keep])
        return keys, torch.cat([past, p_rows])

    def _compress(self, x: torch.Tensor, p_rows: torch.Tensor, state: DecodeState, req_id: object,
                  ctx: CallContext) -> None:
        """Compressor step of a KV source: publish every group these rows complete."""
        cfg, w, r = self.cfg, self.w, self.spec.ratio
        slot = state.slot(req_id)
        if r == 2:
            kv, score = ref_comp.ratio2_inputs(x, w["attn.compressor.wkv.weight"],
                                               w["attn.compressor.wgate.weight"])
            c, done = ref_comp.compress_ratio2_rows(kv, score, p_rows, state.comp_kv[self.spec.layer][slot],
                                                    state.comp_score[self.spec.layer][slot])
            state.write_compressor_rows(self.spec.layer, slot, p_rows, kv, score)  # what accept restores
        else:
            c, done = ref_comp.compress_ratio1(x, w["attn.compressor.wkv.weight"]), torch.arange(x.shape[0], device=x.device)
        if not done.numel():
            return
        lat = ref_comp.latent(c, w["attn.compressor.norm.weight"], cfg.norm_eps)
        first = p_rows[done] + 1 - r                                # each group's first position
        cis = rope_cis(self.freqs, first)
        # the records quantize the rotated values once (to exactly compressed_kv / index_key)
        ik = ref_comp.index_key_rotated(lat, w["attn.indexer.wk.weight"], w["attn.indexer.k_norm.weight"], cis,
                                        cfg.rope_head_dim, cfg.norm_eps)
        ckv = rope_tail(lat, cis, cfg.rope_head_dim)
        state.write_entries(self.spec.layer, slot, (p_rows[done] + 1) // r - 1, ckv, ik)
        ctx.put(self.spec.layer, "compressor_latent", req_id, lat)

    def _select(self, rows: slice, n_rows: int, p_rows: torch.Tensor, comp, iq, iw, ctx: CallContext) -> None:
        """Per row of one request, the compressed entries this layer attends to, into `ctx.topk`
        (an index source; a Reuse layer reads its source's). With the row-sharded indexer, rows of
        other ranks get empty placeholders until `_exchange_rows`."""
        spec, cfg = self.spec, self.cfg
        if spec.kind == SWA or not spec.runs_indexer:
            return
        out, masks, all_scores = [], [], []
        for r, p in zip(range(rows.start, rows.stop), p_rows.tolist()):
            if self.row_sharded and r % self.tp.tp != self.tp.rank:   # another rank scores this row
                out.append(torch.zeros(0, dtype=torch.long, device=self.device))
                masks.append(torch.zeros(0, dtype=torch.bool, device=self.device))
                all_scores.append(None)
                continue
            m = (p + 1) // spec.ratio
            scores = ref_idx.index_scores(iq[r], iw[r], comp[1][:m]) if m else torch.zeros(0, device=self.device)
            if spec.candidate_role == "source":
                masks.append(ref_idx.candidate_mask(scores, cfg.candidate_block_size,
                                                    cfg.candidate_topk_blocks))
            elif spec.candidate_role == "consumer":
                scores = scores.masked_fill(~ctx.candidates[spec.kv_source][r], float("-inf"))
            all_scores.append(scores)
            out.append(ref_idx.topk_ascending(scores, min(cfg.index_topk, m)))
        if spec.candidate_role == "source":
            ctx.put_rows(ctx.candidates, spec.layer, n_rows, rows, masks)
        if ctx.record is not None:
            ctx.put_rows(ctx.record, f"layers.{spec.layer}.index_scores", n_rows, rows, all_scores)
        if spec.layer in ctx.force_topk:
            out = ctx.force_topk[spec.layer][rows]
        ctx.put_rows(ctx.topk, spec.layer, n_rows, rows, out)

    def _exchange_rows(self, step: StepRows, ctx: CallContext) -> None:
        """Row-sharded dense indexer: rank r % tp scored row r; every rank gets every row's top-k
        (and, at the candidate source, its pool) from its owner (`TensorParallel.exchange_rows`)."""
        spec, tp, L = self.spec, self.tp, self.spec.layer
        ctx.topk[L] = tp.exchange_rows(ctx.topk[L], pad=-2)
        if spec.candidate_role == "source":
            masks = tp.exchange_rows([t.to(torch.int64) for t in ctx.candidates[L]], pad=-2)
            ctx.candidates[L] = [t.to(torch.bool) for t in masks]
