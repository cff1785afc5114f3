"""ops.l2_prefetch: the plan's byte arithmetic and errors (CPU), and on a GPU that the prefetches
launch at every segment shape and change no value (the weight's bytes and a GEMM that follows)."""

from __future__ import annotations

import pytest
import torch

from dsv41_decode.ops.l2_prefetch import MAX_PREFETCH, L2Prefetch
from dsv41_decode.ops.low_latency_mm import LowLatencyMM


def test_plan_bytes_per_segment():
    w = torch.zeros(64, 1280, dtype=torch.uint8)
    p = L2Prefetch(w, 1280, 0.25)                        # one segment per row, 320 bytes of 1280
    assert (p.segs, p.pf_bytes, p.items, p.nbytes) == (1, 320, 64, 64 * 320)
    p = L2Prefetch(w, 512, 0.5)                          # segments 512, 512, 256 (short last one)
    assert (p.segs, p.pf_bytes) == (3, 256)
    assert p.nbytes == 64 * (256 + 256 + 256)
    p = L2Prefetch(w, 512, 1.0)                          # whole rows
    assert p.nbytes == w.numel()
    p = L2Prefetch(w, 512, 0.01)                         # rounded up to 16 bytes
    assert p.pf_bytes == 16
    bf = torch.zeros(8, 4096, dtype=torch.bfloat16)      # element size counts
    assert L2Prefetch(bf, 2048, 0.5).pf_bytes == 2048
    big = torch.zeros(2, 1 << 20, dtype=torch.uint8)     # at most 65,520 bytes per segment
    assert L2Prefetch(big).pf_bytes == MAX_PREFETCH
    assert not L2Prefetch(w).active                      # a no-op off CUDA


def test_plan_capped_at_part_of_l2():
    w = torch.zeros(32768, 1280, dtype=torch.uint8)     # wq_b's 42 MB against a 50 MB L2
    p = L2Prefetch(w, 1280, 1.0, max_fraction=0.5)
    assert p.nbytes <= 0.5 * 50 * 2**20 and p.pf_bytes % 16 == 0 and p.pf_bytes > 0


@pytest.mark.parametrize("bad, match", [
    (lambda w: L2Prefetch(w[0]), "2-D"),
    (lambda w: L2Prefetch(w.t()), "contiguous"),
    (lambda w: L2Prefetch(w, 0), "seg_cols"),
    (lambda w: L2Prefetch(w, 2000), "seg_cols"),
    (lambda w: L2Prefetch(w, 512, 0.0), "fraction"),
    (lambda w: L2Prefetch(w, 512, 1.5), "fraction"),
    (lambda w: L2Prefetch(w, 500), "16-byte aligned"),
    (lambda w: L2Prefetch(w, 512, 0.5, max_fraction=0), "max_fraction"),
    (lambda w: L2Prefetch([1, 2]), "2-D tensor"),
])
def test_errors_name_the_argument(bad, match):
    with pytest.raises(ValueError, match=match):
        bad(torch.zeros(64, 1280, dtype=torch.uint8))


@pytest.mark.gpu
def test_gpu_prefetch_changes_no_value():
    g = torch.Generator(device="cuda").manual_seed(0)
    n, k = 4096, 1280
    w = (torch.randn(n, k, generator=g, device="cuda") * 0.5).to(torch.float8_e4m3fn)
    s = torch.randint(118, 125, (n // 32, k // 32), generator=g, device="cuda", dtype=torch.uint8)
    before = w.view(torch.uint8).clone()
    mm = LowLatencyMM(w, s, 64)
    codes = torch.randn(8, k, generator=g, device="cuda").to(torch.float8_e4m3fn)
    xs = torch.full((8, k // 32), 127, dtype=torch.uint8, device="cuda")
    ref = mm(codes, xs).clone()
    odd = torch.zeros(37, 4096 + 48, dtype=torch.bfloat16, device="cuda")
    plans = [L2Prefetch(w, mm.launch_for(8).k_per_split, f) for f in (0.1, 0.5, 1.0)]
    plans += [L2Prefetch(w), L2Prefetch(w, 128, 0.3), L2Prefetch(odd, 1032, 0.7), L2Prefetch(odd)]
    assert all(p.active for p in plans)
    for p in plans:
        p()
        out = mm(codes, xs)
        torch.cuda.synchronize()
        assert torch.equal(out, ref)
    assert torch.equal(w.view(torch.uint8), before)
    assert not odd.any()
