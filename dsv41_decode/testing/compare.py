"""Comparison helpers shared by the trace verifier and the tests."""

from __future__ import annotations

import torch


def selected(idx: torch.Tensor) -> list[int]:
    """A top-k row's selection as a set: its valid (>= 0) indices, sorted (-1 padding dropped)."""
    return sorted(idx[idx >= 0].tolist())


def _finite_abs(t: torch.Tensor) -> torch.Tensor:
    """|t| in FP32 with NaN and infinities as 0 (the magnitudes an ulp is measured at)."""
    return torch.nan_to_num(t.float().abs(), nan=0.0, posinf=0.0, neginf=0.0)


def abs_difference(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|a - b| in FP32, elementwise: 0 where the two are equal (the same infinity, or NaN on both
    sides), inf where they differ and either is not finite (NaN against a number, inf against a
    finite value), so that a maximum over it cannot lose a non-finite mismatch."""
    af, bf = a.float(), b.float()
    same = (af == bf) | (torch.isnan(af) & torch.isnan(bf))
    d = torch.where(same, torch.zeros_like(af), (af - bf).abs())
    return torch.where(~same & ~(torch.isfinite(af) & torch.isfinite(bf)), torch.full_like(d, float("inf")), d)


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest |a - b| in units of the BF16 ulp at max(|a|, |b|): 0 when equal (NaN on both sides
    counts as equal), inf where one side is not finite and they differ."""
    if a.shape != b.shape:
        raise ValueError(f"shapes differ: {tuple(a.shape)} vs {tuple(b.shape)}")
    if a.numel() == 0:
        return 0.0
    d = abs_difference(a, b)
    mag = torch.maximum(_finite_abs(a), _finite_abs(b)).clamp(min=2.0 ** -126)
    ulp = torch.exp2(torch.floor(torch.log2(mag)) - 7)   # BF16 has 8 significant bits
    return float((d / ulp).max())


def rel_rms(a: torch.Tensor, ref: torch.Tensor) -> float:
    """rms(a - ref) / rms(ref) in FP32 (0 when both are zero)."""
    d = (a.float() - ref.float()).pow(2).mean().sqrt()
    r = ref.float().pow(2).mean().sqrt()
    return float(d / r) if r > 0 else float(d)


def bits_differ(a: torch.Tensor, b: torch.Tensor) -> int:
    """How many elements of two same-dtype tensors differ bitwise."""
    if a.shape != b.shape or a.dtype != b.dtype:
        raise ValueError(f"cannot compare {a.dtype}{tuple(a.shape)} with {b.dtype}{tuple(b.shape)}")
    ia = a.contiguous().view(torch.uint8).view(*a.shape, -1)
    ib = b.contiguous().view(torch.uint8).view(*b.shape, -1)
    return int((ia != ib).any(-1).sum())


def topk_agreement(ours: torch.Tensor, theirs: torch.Tensor, scores: torch.Tensor) -> str:
    """'equal' (same index sets), 'tie' (different indices, same multiset of scores) or 'differ'.

    ours / theirs: [k] int indices with -1 padding; scores: [m] the row's scores (ours).
    """
    a, b = selected(ours), selected(theirs)
    if a == b:
        return "equal"
    if len(a) == len(b) and all(i < scores.numel() for i in b):
        if sorted(scores[a].tolist()) == sorted(scores[b].tolist()):
            return "tie"
    return "differ"


def check_topk_invariants(idx: torch.Tensor, scores: torch.Tensor, k: int) -> None:
    """Assert a row's top-k: k valid entries first (unique, ascending, in range), -1 after, and the
    selected scores are the k largest (ties allowed). idx: [>=k] int; scores: [m]."""
    valid = idx[idx >= 0]
    assert valid.numel() == k, f"expected {k} valid indices, got {valid.numel()}"
    assert bool((idx[k:] == -1).all()), "padding after the valid entries must be -1"
    assert bool((valid[1:] > valid[:-1]).all()), f"indices must be unique and ascending: {valid.tolist()}"
    assert valid.numel() == 0 or int(valid.max()) < scores.numel(), "index beyond the visible entries"
    if k:
        chosen = scores[valid].float()
        rest = torch.ones(scores.numel(), dtype=torch.bool)
        rest[valid] = False
        if bool(rest.any()):
            assert float(chosen.min()) >= float(scores[rest].float().max()), "a larger score was left out"


def row_ulp_distance(a: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest |a - ref| in units of the BF16 ulp of the largest |ref| in its row (last dim).

    For sums that cancel (the mHC post-mix), where an element-wise ulp is meaninglessly small.
    """
    if a.numel() == 0:
        return 0.0
    mag = _finite_abs(ref).amax(-1, keepdim=True).clamp(min=2.0 ** -126)   # the row's finite values
    ulp = torch.exp2(torch.floor(torch.log2(mag)) - 7)
    return float((abs_difference(a, ref) / ulp).max())     # inf where a non-finite value differs
