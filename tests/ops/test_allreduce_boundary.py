"""ops.allreduce_boundary with simulated ranks in one process (the mailboxes are plain tensors):
the rank-ordered sum of the published partials, then bitwise the boundary of ops.mhc on it; every
rank gets the same bits; a rank that never publishes is named after the bounded wait."""

import pytest
import torch

from dsv41_decode.ops.allreduce_boundary import Mailbox, allreduce_boundary_
from dsv41_decode.ops.mhc import MhcBoundaryPlan, mhc_boundary

_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EPS = 1e-6


def _case(n, dim, tp, seed, cancelling=False):
    """Boundary operands and tp partials: Gaussian ones, or (cancelling, tp >= 3) a, b, -a[, -b]
    over many powers of two, whose FP32 sum depends on the order of the adds (rank order:
    ((a + b) - a) - b keeps b's rounding error, other orders do not)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, dim, generator=g).to(torch.bfloat16)
    post = 2 * torch.rand(n, 4, generator=g)
    comb = torch.softmax(torch.randn(n, 4, 4, generator=g), -1)
    pre = torch.rand(n, 4, generator=g) + 0.1
    w = (1 + 0.1 * torch.randn(dim, generator=g)).to(torch.bfloat16)
    if cancelling:
        a, b = (torch.randn(n, dim, generator=g) * 2.0 ** torch.randint(-10, 11, (n, dim), generator=g).float()
                for _ in range(2))
        parts = [a, b, -a, -b][:tp]
    else:
        parts = [torch.randn(n, dim, generator=g) * 3 for _ in range(tp)]
    return [t.to(_DEVICE) for t in (x, post, comb, pre, w)], [p.to(_DEVICE) for p in parts]


def _outputs(n, dim):
    return (torch.empty(n, 4, dim, dtype=torch.bfloat16, device=_DEVICE),
            torch.empty(n, dim, dtype=torch.bfloat16, device=_DEVICE),
            torch.empty(n, dim, dtype=torch.uint8, device=_DEVICE),
            torch.empty(n, dim // 32, dtype=torch.uint8, device=_DEVICE),
            torch.empty(n, dim, dtype=torch.bfloat16, device=_DEVICE))


@pytest.mark.parametrize("tp,cancelling", [(2, False), (4, False), (3, True), (4, True)])
def test_every_rank_gets_the_boundary_of_the_rank_ordered_sum(tp, cancelling):
    # Gaussian partials (the boundary's bits), and partials whose sum depends on the order of the
    # adds, so that a rank adding in another order (its own partial first) shows
    n, dim, layers, k = 3, 256, 4, 2
    boxes = Mailbox.local_group(tp, 4, dim, layers, _DEVICE)
    (x, post, comb, pre, w), parts = _case(n, dim, tp, seed=tp, cancelling=cancelling)
    if cancelling:          # the order shows: some rank starting from its own partial would differ
        sums = []
        for r in range(tp):
            acc = parts[r].clone()
            for p in parts[r + 1:] + parts[:r]:
                acc += p
            sums.append(acc.to(torch.bfloat16))
        assert any(not torch.equal(t, sums[0]) for t in sums[1:])
    for box, p in zip(boxes, parts):              # every rank's wo_b publishes into its slot
        box.slot(k)[:n] = p
    total = parts[0].clone()
    for p in parts[1:]:
        total += p
    want = mhc_boundary(total.to(torch.bfloat16), x, post, comb, pre, w, EPS,
                        plan=MhcBoundaryPlan.build(dim, 4, _DEVICE, block_d=64))
    gen = k + 1                                   # epoch 0
    got = []
    for r, box in enumerate(boxes):
        for other in boxes[r + 1:]:               # ranks that have not run yet have arrived elsewhere
            other.flag.fill_(gen)
        out = _outputs(n, dim)
        allreduce_boundary_(box, k, n, x, post, comb, pre, w, EPS, *out,
                            plan=MhcBoundaryPlan.build(dim, 4, _DEVICE, block_d=64), max_spin=4)
        box.check()
        assert int(box.flag) == gen
        assert torch.equal(out[4], total.to(torch.bfloat16))
        for a, b in zip(out[:4], want):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        got.append(out)
    for out in got[1:]:
        for a, b in zip(out, got[0]):
            assert torch.equal(a, b)


def test_a_missing_rank_is_named_after_the_bounded_wait():
    n, dim = 2, 64
    boxes = Mailbox.local_group(3, 2, dim, 4, _DEVICE)
    (x, post, comb, pre, w), parts = _case(n, dim, 3, seed=7)
    boxes[1].flag.fill_(1)                        # rank 1 published generation 1; rank 2 nothing
    out = _outputs(n, dim)
    allreduce_boundary_(boxes[0], 0, n, x, post, comb, pre, w, EPS, *out,
                        plan=MhcBoundaryPlan.build(dim, 2, _DEVICE), max_spin=3)
    with pytest.raises(RuntimeError, match="rank 2 of 3 did not publish"):
        boxes[0].check()


def test_generations_advance_per_step_and_keep_slot_parity():
    box = Mailbox.local_group(2, 1, 32, 5, _DEVICE)[0]
    assert box.gen_stride == 6 and box.gen_stride % 2 == 0
    assert box.slot(0).data_ptr() == box.data[1].data_ptr() and box.slot(1).data_ptr() == box.data[0].data_ptr()
    box.next_step()
    assert int(box.epoch) == 1


def test_bad_arguments():
    box = Mailbox.local_group(2, 2, 64, 2, _DEVICE)[0]
    (x, post, comb, pre, w), _ = _case(2, 64, 2, seed=1)
    out = _outputs(2, 64)
    with pytest.raises(ValueError, match="layer_index"):
        allreduce_boundary_(box, 2, 2, x, post, comb, pre, w, EPS, *out, plan=MhcBoundaryPlan.build(64, 2, _DEVICE))
    with pytest.raises(ValueError, match="rows=3"):
        allreduce_boundary_(box, 0, 3, x, post, comb, pre, w, EPS, *out, plan=MhcBoundaryPlan.build(64, 4, _DEVICE))
    with pytest.raises(ValueError, match="plan is for dim=128"):
        allreduce_boundary_(box, 0, 2, x, post, comb, pre, w, EPS, *out, plan=MhcBoundaryPlan.build(128, 2, _DEVICE))


def test_bad_scalar_arguments_name_the_argument():
    box = Mailbox.local_group(2, 2, 64, 2, _DEVICE)[0]
    (x, post, comb, pre, w), _ = _case(2, 64, 2, seed=1)
    args = dict(box=box, layer_index=0, rows=2, x=x, post=post, comb=comb, pre=pre, norm_weight=w, eps=EPS,
                **dict(zip(("x_out", "u_out", "codes_out", "scales_out", "y_out"), _outputs(2, 64))),
                plan=MhcBoundaryPlan.build(64, 2, _DEVICE))
    for kw, match in ((dict(layer_index=None), r"layer_index must be an int in 0..1, got None"),
                      (dict(layer_index=0.0), r"layer_index must be an int in 0..1, got 0.0"),
                      (dict(rows=None), "rows must be a positive int, got None"),
                      (dict(rows=2.0), "rows must be a positive int, got 2.0"),
                      (dict(max_spin=0), r"max_spin must be an int in 1..\d+, got 0"),
                      (dict(max_spin=2.5), r"max_spin must be an int in 1..\d+, got 2.5"),
                      (dict(max_spin=None), r"max_spin must be an int in 1..\d+, got None")):
        with pytest.raises(ValueError, match=match):
            allreduce_boundary_(**{**args, **kw})
    for bad in (None, 2, 2.0, -1):
        with pytest.raises(ValueError, match=rf"layer_index must be an int in 0..1, got {bad}"):
            box.slot(bad)
    for name in ("tp", "max_rows", "dim", "layers"):
        with pytest.raises(ValueError, match=f"{name} must be a positive int, got None"):
            Mailbox.local_group(**{**dict(tp=2, max_rows=2, dim=64, layers=2), name: None})
