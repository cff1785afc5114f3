"""ops/compressor.py against `reference.compressor.compress_ratio2` run request by request
(interpreter on the CPU at small shapes; GPU at decode sizes under `gpu`).

The state is a copy, compared bit for bit; c within 24 FP32 rounding units of sum_j p_j |kv_j|
elementwise and 1e-6 of max|c| (_C_ULPS, _C_TOL). c is not bitwise: torch's CPU
softmax uses its own vectorized exp (its dim-0 and last-dim softmaxes of the same values already
differ in the last bit) and the interpreter NumPy's; measured over 600 random batches here: max
|c - ref| = 1.6e-7 * max|c| (4.8e-7 absolute), 6.5% of the elements off by an ulp or so.
"""

import pytest
import torch

from dsv41_decode.ops.compressor import compress_ratio2, compress_ratio2_
from dsv41_decode.reference import compressor as ref_comp
from dsv41_decode.reference.linear import fp32_linear

# c = sum_j p_j kv_j over a group's two rows, p = softmax of their scores. A side's exp is within 2
# FP32 ulps (4u relative, u = 2^-24) of the exact value (CUDA documents expf, which the kernel's
# libdevice and torch's CUDA softmax use, to 2 ulps; NumPy's and torch's CPU exp are within 1), the
# sum of the two adds a rounding (5u) and the division another: p_j within 10u; the products and
# their sum add 2u. So c is within 12u of sum_j p_j |kv_j| a side, 24u between the two sides,
# elementwise (measured on the CPU at most 3.7u).
_C_ULPS = 24
# Relative to the largest |c| of the batch: 1e-6 (16.8u; measured 2.4u on the CPU) - the elementwise
# bound with exps to 1 ulp (16u) where the group's rows agree in sign (sum_j p_j |kv_j| = |c|); kept
# as it was, tighter than the 24u the GPU's expf allows.
_C_TOL = 1e-6
_PAD = None     # a padding row in a layout

# (slot, first position, rows) per request, _PAD for a padding row: 1..4 rows, even and odd
# starts, padding first, between and last.
_LAYOUTS = {
    "mixed": [_PAD, (2, 0, 1), (0, 5, 3), _PAD, (4, 7, 4), (1, 2, 2), _PAD],
    "odd_starts": [(3, 1, 1), (1, 3, 2), (0, 9, 4), (5, 11, 3), _PAD, (2, 0, 2)],
    "one_request": [(4, 6, 4)],
    "singles": [(0, 0, 1), (1, 1, 1), _PAD, (2, 4, 1), (3, 13, 1), (4, 2, 1), (5, 1, 1)],
    "padding_only": [_PAD, _PAD, _PAD],
}


def _batch(layout, n_slots, d, dim, fresh, seed, device="cpu", row_pad=0):
    """kv_score [N, 2d] (row stride 2d + row_pad), req_slot, positions, x, wkv, wgate, state_kv,
    state_score [n_slots, 2, d]; all on `device`."""
    g = torch.Generator().manual_seed(seed)
    slots, pos = [], []
    for item in layout:
        if item is _PAD:
            slots.append(-1)
            pos.append(int(torch.randint(0, 50, (1,), generator=g)))
            continue
        s, p0, k = item
        slots += [s] * k
        pos += list(range(p0, p0 + k))
    n = len(slots)
    x = torch.randn(n, dim, generator=g).to(torch.bfloat16).to(device)
    wkv = (torch.randn(d, dim, generator=g) / dim ** 0.5).to(device)
    wgate = (torch.randn(d, dim, generator=g) * (3.0 / dim ** 0.5)).to(device)   # scores of a few units
    # Projected on the device the reference runs on: the state must be its bit copy.
    kv_score = torch.full((n, 2 * d + row_pad), float("nan"), device=device)[:, :2 * d]
    kv_score.copy_(torch.cat([fp32_linear(x, wkv), fp32_linear(x, wgate)], dim=1))
    skv = torch.randn(n_slots, 2, d, generator=g)
    ssc = torch.randn(n_slots, 2, d, generator=g) * 3.0
    if fresh:
        skv.zero_()
        ssc.fill_(float("-inf"))
    else:
        ssc[0, 1] = float("-inf")     # a slot whose group was opened by one row (odd row still -inf)
    return dict(kv_score=kv_score, req_slot=torch.tensor(slots, dtype=torch.int64, device=device),
                positions=torch.tensor(pos, dtype=torch.int64, device=device), x=x, wkv=wkv,
                wgate=wgate, state_kv=skv.to(device), state_score=ssc.to(device))


def _strided(t):
    """A copy of state t [R, 2, d] with row stride 3d (a view of a larger buffer)."""
    v = torch.full((t.shape[0], 3, t.shape[2]), float("nan"), device=t.device)[:, :2]
    return v.copy_(t)


def _reference(b, absolute: bool = False):
    """(out [N, d], done [N], state_kv, state_score) from the reference, one request at a time.
    absolute: of |kv| instead (with the same scores): out = sum_j p_j |kv_j|, the scale of c's
    rounding errors (_C_ULPS)."""
    skv, ssc = b["state_kv"].clone(), b["state_score"].clone()
    if absolute:
        skv = skv.abs()
    slots = b["req_slot"].tolist()
    n, d = len(slots), skv.shape[2]
    out = torch.zeros(n, d, device=skv.device)
    done = torch.zeros(n, dtype=torch.int32, device=skv.device)
    r = 0
    while r < n:
        s = slots[r]
        e = r + 1
        while e < n and s >= 0 and slots[e] == s:
            e += 1
        if s >= 0:
            kv, score = ref_comp.ratio2_inputs(b["x"][r:e], b["wkv"], b["wgate"])
            c, rows = ref_comp.compress_ratio2_rows(kv.abs() if absolute else kv, score, b["positions"][r:e],
                                                    skv[s], ssc[s])
            out[r + rows] = c
            done[r + rows] = 1
        r = e
    return out, done, skv, ssc


def _check(b, out, done, state_kv, state_score):
    ref_out, ref_done, ref_kv, ref_sc = _reference(b)
    assert torch.equal(done.cpu(), ref_done.cpu())
    assert torch.equal(state_kv.cpu(), ref_kv.cpu())
    assert torch.equal(state_score.cpu(), ref_sc.cpu())
    out, ref_out = out.cpu(), ref_out.cpu()
    assert not out.isnan().any()
    assert torch.equal(out[ref_done.cpu() == 0], torch.zeros_like(out[ref_done.cpu() == 0]))
    scale = ref_out.abs().max().clamp(min=1e-30)
    assert (out - ref_out).abs().max() / scale <= _C_TOL
    c_abs = _reference(b, absolute=True)[0].cpu()
    assert bool(((out - ref_out).abs() <= _C_ULPS * 2.0 ** -24 * c_abs).all())


@pytest.mark.parametrize("fresh", [True, False], ids=["fresh", "prefilled"])
@pytest.mark.parametrize("layout", list(_LAYOUTS))
def test_compress_ratio2_matches_reference(layout, fresh):
    b = _batch(_LAYOUTS[layout], n_slots=6, d=512, dim=64, fresh=fresh, seed=len(layout) + fresh,
               row_pad=3)
    n = b["kv_score"].shape[0]
    out = torch.full((n, 512 + 5), float("nan"))[:, :512]            # any row stride; all rows written
    done = torch.full((n,), 777, dtype=torch.int32)
    state_kv, state_score = _strided(b["state_kv"]), _strided(b["state_score"])
    compress_ratio2_(b["kv_score"], b["req_slot"], b["positions"], state_kv, state_score, out, done)
    _check(b, out, done, state_kv, state_score)


@pytest.mark.parametrize("d", [200, 64])
def test_compress_ratio2_partial_channel_block(d):
    b = _batch(_LAYOUTS["mixed"], n_slots=5, d=d, dim=32, fresh=False, seed=d)
    state_kv, state_score = b["state_kv"].clone(), b["state_score"].clone()
    out, done = compress_ratio2(b["kv_score"], b["req_slot"], b["positions"], state_kv, state_score)
    assert out.shape == (b["kv_score"].shape[0], d) and done.dtype == torch.int32
    _check(b, out, done, state_kv, state_score)


def test_compress_ratio2_steps_chain():
    # Two decode steps on one state: the second continues the groups the first left open.
    step1 = [(0, 0, 1), (1, 3, 2), (2, 6, 3)]
    step2 = [(2, 9, 1), (0, 1, 2), _PAD, (1, 5, 1)]
    b1 = _batch(step1, n_slots=4, d=512, dim=32, fresh=True, seed=1)
    b2 = _batch(step2, n_slots=4, d=512, dim=32, fresh=True, seed=2)
    state_kv, state_score = b1["state_kv"].clone(), b1["state_score"].clone()
    compress_ratio2(b1["kv_score"], b1["req_slot"], b1["positions"], state_kv, state_score)
    b2["state_kv"], b2["state_score"] = state_kv.clone(), state_score.clone()
    out, done = compress_ratio2(b2["kv_score"], b2["req_slot"], b2["positions"], state_kv, state_score)
    _check(b2, out, done, state_kv, state_score)


@pytest.mark.parametrize("hist", [3])
def test_compress_ratio2_history_rows(hist):
    """With `history` (DecodeState.comp_rows), each row's kv_score row lands bit for bit at
    [slot, p % H] (the last H rows of a request survive); padding rows and other slots write
    nothing; out, done and the state are what they are without it."""
    b = _batch(_LAYOUTS["mixed"], n_slots=6, d=512, dim=32, fresh=False, seed=21)
    n = b["kv_score"].shape[0]
    history = torch.full((6, hist, 1024), float("nan"))
    sentinel = history.clone()
    state = (b["state_kv"].clone(), b["state_score"].clone())
    out, done = torch.zeros(n, 512), torch.zeros(n, dtype=torch.int32)
    compress_ratio2_(b["kv_score"], b["req_slot"], b["positions"], *state, out, done, history)
    want = sentinel.clone()
    for r in range(n):
        s, p = int(b["req_slot"][r]), int(b["positions"][r])
        if s >= 0:
            want[s, p % hist] = b["kv_score"][r]
    assert torch.equal(history.view(torch.int32), want.view(torch.int32))
    state0 = (b["state_kv"].clone(), b["state_score"].clone())
    out0, done0 = compress_ratio2(b["kv_score"], b["req_slot"], b["positions"], *state0)
    assert torch.equal(out, out0) and torch.equal(done, done0)
    assert torch.equal(state[0], state0[0]) and torch.equal(state[1], state0[1])
    for bad, err in ((history[:5], ValueError), (history.double(), TypeError), (history[:, :, :512], ValueError)):
        with pytest.raises(err, match="history"):
            compress_ratio2_(b["kv_score"], b["req_slot"], b["positions"], *state, out, done, bad)


@pytest.mark.parametrize("layout", ["mixed", "odd_starts", "singles"])
def test_compress_ratio2_restore_reads_the_group_from_history(layout):
    """restore=True: each request's open group comes from history at its first position p0's
    p0 - 1 and p0 - 2 (fresh below 0), whatever the state holds (NaN here): out, done and the state
    are the reference's run from that group, bit for bit for the state."""
    H = 4
    b = _batch(_LAYOUTS[layout], n_slots=6, d=512, dim=32, fresh=False, seed=23)
    g = torch.Generator().manual_seed(24)
    history = torch.randn(6, H, 1024, generator=g)
    group_kv, group_sc = torch.zeros(6, 2, 512), torch.full((6, 2, 512), float("-inf"))
    slots, pos = b["req_slot"].tolist(), b["positions"].tolist()
    for r, (s, p0) in enumerate(zip(slots, pos)):
        if s < 0 or (r > 0 and slots[r - 1] == s):
            continue
        for q in (p0 - 1, p0 - 2):
            if q >= 0:
                group_kv[s, q % 2], group_sc[s, q % 2] = history[s, q % H, :512], history[s, q % H, 512:]
    state = (torch.full((6, 2, 512), float("nan")), torch.full((6, 2, 512), float("nan")))
    n = b["kv_score"].shape[0]
    out, done = torch.zeros(n, 512), torch.zeros(n, dtype=torch.int32)
    compress_ratio2_(b["kv_score"], b["req_slot"], b["positions"], *state, out, done, history, restore=True)
    b["state_kv"], b["state_score"] = group_kv, group_sc
    served = {s for s in slots if s >= 0}
    for t, ref in zip(state, (group_kv, group_sc)):      # slots no row served keep what they held
        for s in range(6):
            if s not in served:
                assert t[s].isnan().all(), s
                t[s] = ref[s]
    _check(b, out, done, *state)
    for bad in (None, history[:, :1]):
        with pytest.raises(ValueError, match="restore=True"):
            compress_ratio2_(b["kv_score"], b["req_slot"], b["positions"], *state, out, done, bad, restore=True)


def test_empty_batch():
    state_kv, state_score = torch.zeros(2, 2, 512), torch.zeros(2, 2, 512)
    out, done = compress_ratio2(torch.zeros(0, 1024), torch.zeros(0, dtype=torch.int64),
                                torch.zeros(0, dtype=torch.int64), state_kv, state_score)
    assert out.shape == (0, 512) and done.shape == (0,)


def test_bad_inputs_name_the_argument():
    n, r, d = 3, 2, 512
    kvs = torch.zeros(n, 2 * d)
    slot = torch.zeros(n, dtype=torch.int64)
    pos = torch.zeros(n, dtype=torch.int64)
    skv, ssc = torch.zeros(r, 2, d), torch.zeros(r, 2, d)
    out = torch.zeros(n, d)
    done = torch.zeros(n, dtype=torch.int32)
    ok = dict(kv_score=kvs, req_slot=slot, positions=pos, state_kv=skv, state_score=ssc, out=out, done=done)
    bad = [
        ("kv_score", kvs.bfloat16(), TypeError),
        ("kv_score", kvs[:, :d], ValueError),
        ("kv_score", kvs[0], ValueError),
        ("kv_score", torch.zeros(2 * d, n).t(), ValueError),            # not unit stride
        ("req_slot", slot.int(), TypeError),
        ("req_slot", slot[:2], ValueError),
        ("req_slot", slot.to("meta"), ValueError),                      # another device
        ("positions", pos.float(), TypeError),
        ("positions", pos[:, None], ValueError),
        ("state_kv", skv[0], ValueError),
        ("state_kv", skv.double(), TypeError),
        ("state_score", torch.zeros(r + 1, 2, d), ValueError),
        ("state_score", torch.zeros(r, 3, d), ValueError),
        ("out", out.bfloat16(), TypeError),
        ("out", out[:, :d - 1], ValueError),
        ("done", done.long(), TypeError),
        ("done", done[:2], ValueError),
        ("state_kv", [[0.0]], ValueError),
        ("out", "out", TypeError),
    ]
    for name, value, err in bad:
        with pytest.raises(err, match=name):
            compress_ratio2_(**{**ok, name: value})
    with pytest.raises(TypeError, match="req_slot"):
        compress_ratio2(kvs, slot.int(), pos, skv, ssc)


@pytest.mark.gpu
@pytest.mark.parametrize("fresh", [True, False], ids=["fresh", "prefilled"])
def test_compress_ratio2_gpu_decode_sizes(fresh):
    # 128 requests of 1..4 rows (MTP drafts) among 160 slots, padding rows at the end; then the same
    # step replayed from a CUDA graph.
    g = torch.Generator().manual_seed(7)
    slots = torch.randperm(160, generator=g)[:128].tolist()
    layout = []
    for s in slots:
        k = int(torch.randint(1, 5, (1,), generator=g))
        layout.append((s, int(torch.randint(0, 100000, (1,), generator=g)), k))
    layout += [_PAD] * 13
    b = _batch(layout, n_slots=160, d=512, dim=4096, fresh=fresh, seed=11, device="cuda")
    n = b["kv_score"].shape[0]
    state_kv, state_score = _strided(b["state_kv"]), _strided(b["state_score"])
    out = torch.full((n, 512), float("nan"), device="cuda")
    done = torch.full((n,), 777, dtype=torch.int32, device="cuda")
    compress_ratio2_(b["kv_score"], b["req_slot"], b["positions"], state_kv, state_score, out, done)
    _check(b, out, done, state_kv, state_score)

    state_kv.copy_(b["state_kv"])
    state_score.copy_(b["state_score"])
    out.fill_(float("nan"))
    done.fill_(777)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        compress_ratio2_(b["kv_score"], b["req_slot"], b["positions"], state_kv, state_score, out, done)
    state_kv.copy_(b["state_kv"])
    state_score.copy_(b["state_score"])
    graph.replay()
    torch.cuda.synchronize()
    _check(b, out, done, state_kv, state_score)
