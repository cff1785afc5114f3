"""Attributing differences to a trace recorded by an implementation that is not batch-invariant.

The official code accumulates its BF16 and FP32 matrix products in an order that depends on how
many rows share the call, so a row of a batch-2 trace is not bit-identical to the same request
alone; our reference (and the step) is batch-invariant. The verifier does not widen its
tolerances for that: where a value is past them it asks whether the difference is one that the
formats explain, with a criterion derived below that a genuinely wrong value fails.

1. `explain_wo_b_row`: an `attn_out` row past MAX_ULP. `attn_out = bf16(wo_b(mxfp8(z)))` with z
   the BF16 output of `wo_a`. Two implementations whose z differ by an ulp or two round at most
   MAX_ULP apart after `wo_b` - unless one of those z elements sits next to an E4M3 rounding
   boundary of its MXFP8 block, where a 1-ulp change of z moves its FP8 code by one step (1/8 of
   a binade: 16 BF16 ulps at once), and `wo_b` then spreads that step over every output of the row
   (`W[:, c] * step`, several BF16 ulps where |W| is large, or all of them where the sum cancels).
   The criterion: the row is explained when moving ONE element z[c] by at most FLIP_ULPS BF16 ulps
   (the same "each side rounds once" budget as MAX_ULP) changes its MXFP8 code or block scale so
   that `wo_b` on the moved input is within MAX_ULP of the recorded row at every element. A single
   code step has a fixed signature over the whole row (a column of wo_b), so an output that is
   wrong by anything else - a wrong head, a wrong selection, a sign, a corrupted element - is not
   explained (tests/test_trace_attribution.py shows such cases failing).

   One op upstream, the same argument for the attention output o (`explain_o_row`): the
   sparse attention sums its scores in an order of its own (the step's kernel in chunks of 128
   dims), so its o may be an ulp off the reference's at an element (the kernel's contract);
   `wo_a` turns that into an absolute change |W| ulp(o) of z, which is many BF16 ulps of the z
   elements whose sums cancel, and MXFP8 then moves their codes. The criterion: moving ONE
   element of o by at most FLIP_ULPS BF16 ulps, through the reference's inverse RoPE, `wo_a`,
   MXFP8 and `wo_b`, lands within MAX_ULP of the recorded row (measured: the step on
   official-batch2, decode03 layer 2, one o element 1 ulp off -> three codes of z -> 224 ulp).

2. `mix_bounds`: the mHC mixer coefficients (pre, post, Sinkhorn comb) computed from the same
   recorded streams differ only by the FP32 evaluation order of both sides. The bound, per
   coefficient, from the formats (u = 2^-24, n = hc * dim products):
   - m_k = (v . fn_k) * r with v the BF16 streams (exact in FP32), r = rsqrt(mean(v^2) + eps).
     An n-term FP32 dot in any order errs by at most gamma_n sum_c |v_c fn_kc|, gamma_n = n u /
     (1 - n u) (Higham, Accuracy and Stability, 3.1), a worst case that needs every rounding to
     push the same way; with rounding errors that are mean-independent, the error is at most
     g(lam) sum_c |v_c fn_kc| with g(lam) = exp(lam sqrt(n) u + n u^2 / (1 - u)) - 1, except with
     probability 2n exp(-lam^2 (1 - u)^2 / 2) (Higham and Mary, SIAM J. Sci. Comput. 41(5), 2019,
     Theorem 2.4). lam = LAMBDA = 8: below 2e-11 per dot product at n = 512, and a bound 2.8x
     tighter than gamma_n there (which would pass coefficients up to 3e-4 off on the tiny cases;
     this one passes ~1e-4 at most, the figure the verifier used before, and 4e-6 on comb).
     r: the sum of n positive squares (each exact: 16 significant bits) within the same g, the
     rsqrt and the final product add 3u. Both sides err: delta_k = 2 (g r sum_c |v_c fn_kc| +
     |m_k| (g / 2 + 3u)).
   - pre = sigmoid(m sc0 + b) + eps: sigmoid' <= 1/4, so |d pre| <= |sc0| delta / 4 + 8u (the
     sigmoid's own rounding, 4u a side); post = 2 sigmoid(...): |sc1| delta / 2 + 16u.
   - comb = Sinkhorn(m sc2 + b): first order through the Sinkhorn map's Jacobian J (computed in
     FP64 at our logits): |d comb_ij| <= sum_kl |J_ij,kl| |sc2| delta_kl, plus the map's own FP32
     rounding: 2 iters + 1 normalisations, each a 4-term sum and a division (5u relative), both
     sides: 2 (2 iters + 1) 5u comb_ij. (The perturbations are ~1e-5, so the first order holds to
     ~1e-10.)
   Measured on the public official cases: every coefficient within 0.005 of its bound (off by
   5e-7 at most). What it catches: a coefficient computed from other streams, weights or
   formulas. Its resolution: a one-ulp change of a single BF16 stream element (one of 512) moves
   the coefficients by 0.04-2.7x the bound (median 0.6; official-tiny, decode03, layer 3), so
   single-ulp input errors show about half the time and anything larger always (an error of 1e-4
   in one coefficient is 1-30x its bound).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..formats import mxfp8_quantize
from ..reference.linear import mxfp8_mm
from ..reference.mhc import Mix, sinkhorn
from .compare import ulp_distance

# wo_b's input is a BF16 result computed on both sides from BF16 values that may each be one ulp
# apart; each side rounds once, so the same two-ulp budget as MAX_ULP.
FLIP_ULPS = 2
U32 = 2.0 ** -24
LAMBDA = 8.0       # the probabilistic bound's confidence (module docstring, item 2)


@dataclass(frozen=True)
class Flip:
    """One MXFP8 code (or block scale) flip of wo_b's input that explains a row of attn_out, and
    where the ulp-level move that caused it sits (`where`: "z", wo_b's input, or "o", the attention
    output)."""

    row: int
    column: int        # the element that moved: of z (wo_b's input), or of o (flat h * 512 + d)
    ulps: int          # by how many BF16 ulps (signed, along the real line)
    residual_ulp: float   # attn_out's distance to the recorded row after the flip (<= MAX_ULP)
    where: str = "z"


def bf16_steps(z: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """z [K] BF16 moved by `steps` [S] BF16 ulps along the real line (through zero, sign-magnitude
    bits): returns [S, K, K] where [s, c] is z with only element c moved by steps[s]."""
    bits = z.contiguous().view(torch.int16).to(torch.int32) & 0xFFFF
    mag = bits & 0x7FFF
    signed = torch.where(bits & 0x8000 != 0, -mag, mag)                  # monotone in the value
    moved = signed[None, :] + steps[:, None].to(torch.int32)              # [S, K]
    new_bits = torch.where(moved < 0, (-moved) | 0x8000, moved).to(torch.int16)
    out = z.view(1, 1, -1).repeat(steps.numel(), z.numel(), 1)            # [S, K, K]
    k = torch.arange(z.numel())
    out.view(torch.int16)[:, k, k] = new_bits
    return out


def explain_wo_b_row(z: torch.Tensor, recorded: torch.Tensor, wo_b: torch.Tensor, wo_b_scale: torch.Tensor,
                     max_ulp: float, row: int = 0) -> Flip | None:
    """The single MXFP8 flip of `z` (wo_b's BF16 input, [K]) that brings `wo_b(z)` within `max_ulp`
    of `recorded` ([N] BF16) at every element (see the module docstring), or None.

    Every element is moved by +-1 .. +-FLIP_ULPS BF16 ulps; the moves that change the row's MXFP8
    codes or scales are run through the reference `mxfp8_mm` (CPU, FP64-exact block sums)."""
    z, recorded = z.detach().cpu().to(torch.bfloat16), recorded.detach().cpu()
    wo_b, wo_b_scale = wo_b.cpu(), wo_b_scale.cpu()
    steps = torch.tensor([s for k in range(1, FLIP_ULPS + 1) for s in (-k, k)])
    moved = bf16_steps(z, steps).reshape(-1, z.numel())                  # [S*K, K]
    codes, scales = mxfp8_quantize(z[None])
    m_codes, m_scales = mxfp8_quantize(moved)
    changed = ((m_codes.view(torch.uint8) != codes.view(torch.uint8)).any(-1)
               | (m_scales != scales).any(-1))
    idx = changed.nonzero().flatten()
    best: Flip | None = None
    for chunk in idx.split(1024):
        y = mxfp8_mm(m_codes[chunk], m_scales[chunk], wo_b, wo_b_scale)
        for i, y_row in zip(chunk.tolist(), y):
            d = ulp_distance(y_row, recorded)
            if d <= max_ulp and (best is None or d < best.residual_ulp):
                s, c = divmod(i, z.numel())
                best = Flip(row, c, int(steps[s]), d)
    return best


def explain_o_row(o: torch.Tensor, cis: torch.Tensor, wo_a: torch.Tensor, o_groups: int, rope_dim: int,
                  recorded: torch.Tensor, wo_b: torch.Tensor, wo_b_scale: torch.Tensor, max_ulp: float,
                  row: int = 0) -> Flip | None:
    """The single element of `o` ([H, 512] BF16, one row's attention output; `cis` its RoPE
    [rope_dim/2]) whose move by at most FLIP_ULPS BF16 ulps brings `output_projection(o)` within
    `max_ulp` of `recorded` ([N]) at every element (module docstring), or None. Flip.column is
    the element's flat index h * 512 + d.

    The moves that change z's MXFP8 codes are found in FP64 (z of the moved o per wo_a group, one
    BLAS product), then confirmed through the reference `output_projection` (CPU)."""
    from ..reference.attention import output_projection
    from ..reference.rope import rope_tail
    o, cis, recorded = o.detach().cpu(), cis.detach().cpu(), recorded.detach().cpu()
    wo_a, wo_b, wo_b_scale = wo_a.cpu(), wo_b.cpu(), wo_b_scale.cpu()
    H, D = o.shape
    hpg, R = H // o_groups, wo_a.shape[0] // o_groups
    wa = wo_a.double().view(o_groups, R, hpg * D)
    steps = torch.tensor([s for k in range(1, FLIP_ULPS + 1) for s in (-k, k)])

    def z_of(batch: torch.Tensor) -> torch.Tensor:          # [M, H, D] BF16 -> [M, G*R] BF16 via FP64
        rot = rope_tail(batch, cis.expand(batch.shape[0], -1), rope_dim, inverse=True).double()
        rot = rot.view(batch.shape[0], o_groups, hpg * D)
        return torch.einsum("mgk,grk->mgr", rot, wa).reshape(batch.shape[0], -1).to(torch.bfloat16)

    codes0, scales0 = mxfp8_quantize(z_of(o[None]))
    live = (wa.abs().amax(1) > 0).view(o_groups, hpg, D).any(-1).flatten()   # heads with wo_a columns
    best: Flip | None = None
    for h in live.nonzero().flatten().tolist():
        moved = bf16_steps(o[h], steps).reshape(-1, D)                        # [S*D, D]
        batch = o[None].repeat(moved.shape[0], 1, 1)
        batch[:, h] = moved
        codes, scales = mxfp8_quantize(z_of(batch))
        changed = ((codes.view(torch.uint8) != codes0.view(torch.uint8)).any(-1) | (scales != scales0).any(-1))
        idx = changed.nonzero().flatten()
        if not idx.numel():
            continue
        y = output_projection(batch[idx], cis.expand(idx.numel(), -1), wo_a, wo_b, wo_b_scale, o_groups, rope_dim)
        for i, y_row in zip(idx.tolist(), y):
            d = ulp_distance(y_row, recorded)
            if d <= max_ulp and (best is None or d < best.residual_ulp):
                st, dim = divmod(i, D)
                best = Flip(row, h * D + dim, int(steps[st]), d, "o")
    return best


def _dot_bound(v: torch.Tensor, fn: torch.Tensor, m: torch.Tensor, norm_eps: float) -> torch.Tensor:
    """delta_k of the module docstring: [n, 24] bound on |m_ours - m_theirs| (both FP32, any order)."""
    n_terms = v.shape[-1]
    g = math.expm1(LAMBDA * math.sqrt(n_terms) * U32 + n_terms * U32 ** 2 / (1 - U32))
    vd = v.double()
    r = torch.rsqrt(vd.pow(2).mean(-1, keepdim=True) + norm_eps)
    abs_dot = vd.abs() @ fn.double().abs().T                            # [n, 24]
    return 2 * (g * r * abs_dot + m.double().abs() * (g / 2 + 3 * U32))


def mix_bounds(x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, norm_eps: float,
               sinkhorn_iters: int, hc_eps: float) -> Mix:
    """Per-coefficient bounds (FP64) on how far two FP32 evaluations of `hc_mixes(x, ...)` in
    different orders can be apart (module docstring). x: [n, hc, dim] BF16 streams."""
    n, hc, _ = x.shape
    v = x.flatten(1).double()
    fnd = fn.double()
    m = (v @ fnd.T) * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + norm_eps)
    delta = _dot_bound(x.flatten(1).float(), fn, m, norm_eps)
    sc = scale.double().abs()
    pre = sc[0] * delta[:, :hc] / 4 + 8 * U32
    post = sc[1] * delta[:, hc:2 * hc] / 2 + 16 * U32
    logits = (m[:, 2 * hc:] * scale.double()[2] + base.double()[2 * hc:]).reshape(n, hc, hc)
    d_logits = (sc[2] * delta[:, 2 * hc:]).reshape(n, hc, hc)
    # rows are independent: the Jacobian of the row-summed map is [i, j, row, k, l]
    jac = torch.autograd.functional.jacobian(lambda lg: sinkhorn(lg, sinkhorn_iters, hc_eps).sum(0), logits,
                                             vectorize=True).permute(2, 0, 1, 3, 4)
    comb_val = sinkhorn(logits, sinkhorn_iters, hc_eps)
    comb = (jac.abs() * d_logits[:, None, None]).sum((-2, -1)) + 2 * (2 * sinkhorn_iters + 1) * 5 * U32 * comb_val
    return Mix(pre, post, comb)
