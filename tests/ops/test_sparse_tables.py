"""Sparse-index tables against torch references, bit-exact, and the records prefetch's spans and
checks (interpreter here; GPU under `gpu`; its sm_90 code compiled on the CPU)."""

from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl

from dsv41_decode.ops import sparse_tables
from dsv41_decode.ops.sparse_tables import records_prefetch_l2_, step_rows_, topk_slots_, window_table_
from dsv41_decode.records import COMPRESSED_KV_BYTES, WINDOW_KV_BYTES

from helpers import compile_script


def ref_window_table(req_slot, positions, window, ring=None):
    m = window if ring is None else ring      # the ring's slots per request (W + max_drafts)
    q = positions[:, None] - window + 1 + torch.arange(window, device=positions.device)
    ring = req_slot[:, None] * m + q.remainder(m)
    return torch.where(q >= 0, ring, -1).to(torch.int32)


def ref_topk_slots(topk, req_slot, block_table, page):
    j = topk.long()
    ok = j >= 0
    jj = j.clamp(min=0)
    pages = block_table.long()[req_slot[:, None], jj // page]
    out = torch.where(ok, pages * page + jj % page, -1).to(torch.int32)
    return out, ok.sum(1).to(torch.int32)


def _devices():
    return ["cpu"] + ([pytest.param("cuda", marks=pytest.mark.gpu)])


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("window, ring", [(1, None), (16, None), (128, None), (100, None), (16, 19), (1, 4)])
def test_window_table(device, window, ring):
    g = torch.Generator().manual_seed(window)
    n = 7
    req_slot = torch.tensor([0, 3, 3, 1, 2, 5, 4], dtype=torch.int64)
    positions = torch.randint(0, 3 * window, (n,), generator=g)
    positions[0] = 0
    positions[1] = window - 2 if window > 1 else 0    # window not yet full
    positions[2] = positions[1] + 1                   # the next (draft) row of the same request
    req_slot, positions = req_slot.to(device), positions.to(device)
    out = torch.full((n, window), 12345, dtype=torch.int32, device=device)
    window_table_(req_slot, positions, window, out, ring=ring)
    assert torch.equal(out.cpu(), ref_window_table(req_slot, positions, window, ring).cpu())


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("k,page", [(8, 4), (40, 16), (512, 64), (1, 1)])
def test_topk_slots(device, k, page):
    g = torch.Generator().manual_seed(k + page)
    n, r, p = 5, 6, 12
    block_table = torch.randperm(r * p, generator=g).to(torch.int32).reshape(r, p)
    req_slot = torch.tensor([2, 2, 0, 5, 3], dtype=torch.int64)
    topk = torch.randint(0, p * page, (n, k), generator=g).to(torch.int32)
    topk[topk.float().uniform_(generator=g) < 0.3] = -1
    topk[3] = -1                                       # no entries yet
    req_slot, block_table, topk = req_slot.to(device), block_table.to(device), topk.to(device)
    out = torch.full((n, k), 777, dtype=torch.int32, device=device)
    lengths = torch.full((n,), 777, dtype=torch.int32, device=device)
    topk_slots_(topk, req_slot, block_table, page, out, lengths)
    ref, ref_len = ref_topk_slots(topk, req_slot, block_table, page)
    assert torch.equal(out.cpu(), ref.cpu())
    assert torch.equal(lengths.cpu(), ref_len.cpu())


def test_bad_inputs_name_the_argument():
    n, w = 3, 8
    slot = torch.zeros(n, dtype=torch.int64)
    pos = torch.zeros(n, dtype=torch.int64)
    out = torch.zeros(n, w, dtype=torch.int32)
    with pytest.raises(TypeError, match="positions"):
        window_table_(slot, pos.int(), w, out)
    with pytest.raises(ValueError, match="out"):
        window_table_(slot, pos, w, out[:, :4])
    with pytest.raises(ValueError, match="window"):
        window_table_(slot, pos, 0, out)
    with pytest.raises(TypeError, match="req_slot"):
        window_table_(slot.int(), pos, w, out)
    with pytest.raises(ValueError, match="ring must be an int >= window=8"):
        window_table_(slot, pos, w, out, ring=7)
    topk = torch.zeros(n, 4, dtype=torch.int32)
    bt = torch.zeros(2, 3, dtype=torch.int32)
    o = torch.zeros(n, 4, dtype=torch.int32)
    ln = torch.zeros(n, dtype=torch.int32)
    with pytest.raises(TypeError, match="topk"):
        topk_slots_(topk.long(), slot, bt, 4, o, ln)
    with pytest.raises(TypeError, match="block_table"):
        topk_slots_(topk, slot, bt.long(), 4, o, ln)
    with pytest.raises(ValueError, match="page_size"):
        topk_slots_(topk, slot, bt, 0, o, ln)
    with pytest.raises(ValueError, match="lengths_out"):
        topk_slots_(topk, slot, bt, 4, o, ln[:2])
    with pytest.raises(ValueError, match="out"):
        topk_slots_(topk, slot, bt, 4, o[:, :2], ln)
    with pytest.raises(ValueError, match="req_slot"):
        topk_slots_(topk, slot[:2], bt, 4, o, ln)
    with pytest.raises(ValueError, match="release must be a bool, got 1"):
        topk_slots_(topk, slot, bt, 4, o, ln, release=1)


def test_step_rows_bad_arguments_name_the_argument():
    n, w = 2, 4
    record = torch.tensor([[0, 0], [5, 6], [5, 5], [0, 0], [6, 6]], dtype=torch.int64)
    tables = [torch.zeros(n, w, dtype=torch.int32)] + [torch.zeros(n, dtype=torch.int64) for _ in range(3)]
    n_vis, entry = torch.zeros(1, n, dtype=torch.int32), torch.zeros(1, n, dtype=torch.int64)
    bt = torch.zeros(2, 3, dtype=torch.int32)
    for stage_base, match in ((None, "got None"), (2.0, "got 2.0"), (-1, "got -1")):
        with pytest.raises(ValueError, match=f"stage_base must be a non-negative int, {match}"):
            step_rows_(record, w, stage_base, [(1, bt)], 4, *tables, n_vis, entry)
    with pytest.raises(TypeError, match=r"block_tables must be a list of \(ratio, block table\) pairs, got NoneType"):
        step_rows_(record, w, 8, None, 4, *tables, n_vis, entry)
    pair = r"block_tables: each entry must be a \(ratio, block table\) pair, got a "
    with pytest.raises(ValueError, match=pair + "tuple of 1"):
        step_rows_(record, w, 8, [(1,)], 4, *tables, n_vis, entry)
    with pytest.raises(ValueError, match=pair + "Tensor"):
        step_rows_(record, w, 8, [bt], 4, *tables, n_vis, entry)


def test_step_rows_refuses_a_block_table_without_columns():
    """A block table of no columns would send the kernel's last-column clamp to column -1."""
    n, w = 2, 4
    record = torch.tensor([[0, 0], [5, 6], [5, 5], [0, 0], [6, 6]], dtype=torch.int64)
    tables = [torch.zeros(n, w, dtype=torch.int32)] + [torch.zeros(n, dtype=torch.int64) for _ in range(3)]
    n_vis, entry = torch.zeros(1, n, dtype=torch.int32), torch.zeros(1, n, dtype=torch.int64)
    with pytest.raises(ValueError, match="block table of ratio 1 must be a 2-D int32 tensor with at least one column"):
        step_rows_(record, w, 8, [(1, torch.empty(2, 0, dtype=torch.int32))], 4, *tables, n_vis, entry)
    step_rows_(record, w, 8, [(1, torch.zeros(2, 3, dtype=torch.int32))], 4, *tables, n_vis, entry)   # one column is enough
    assert n_vis[0].tolist() == [6, 7]


@pytest.mark.parametrize("device", _devices())
def test_step_rows_rope_angles_are_torchs_cast_and_product(device):
    """`step_rows_(rope=(offsets, freqs, angles))`: angles[u, i] = FP32(max(pos_i + offsets[u], 0)) *
    freqs[u], bitwise torch's cast and product (as `reference.rope.rope_cis` computes them), for positions up
    to past 2^24 (where the cast rounds to nearest even), padding rows (-1) and offsets below 0."""
    n, w, half = 6, 4, 32
    pos = torch.tensor([0, 1, 4097, (1 << 20) + 3, (1 << 24) + 3, -1], dtype=torch.int64)
    record = torch.stack([torch.where(pos >= 0, 0, -1), pos, pos.clamp(min=0), torch.zeros(n, dtype=torch.int64),
                          pos]).to(device)
    tables = [torch.zeros(n, w, dtype=torch.int32)] + [torch.zeros(n, dtype=torch.int64) for _ in range(3)]
    tables = [t.to(device) for t in tables]
    n_vis, entry = torch.zeros(1, n, dtype=torch.int32, device=device), torch.zeros(1, n, dtype=torch.int64, device=device)
    offsets = torch.tensor([0, -1, -3], dtype=torch.int64, device=device)
    freqs = (1.0 / (160000 ** (torch.arange(0, 2 * half, 2, dtype=torch.float32) / (2 * half)))).repeat(3, 1)
    freqs = (freqs * torch.tensor([[1.0], [0.37], [3.1]])).to(device)
    angles = torch.full((3, n + 2, half), float("nan"), device=device)
    bt = [(1, torch.zeros(2, 3, dtype=torch.int32, device=device))]
    step_rows_(record, w, 8, bt, 4, *tables, n_vis, entry, rope=(offsets, freqs, angles))
    want = (pos.to(device)[None, :] + offsets[:, None]).clamp(min=0).to(torch.float32)[:, :, None] * freqs[:, None, :]
    assert torch.equal(angles[:, :n], want)
    assert bool(angles[:, n:].isnan().all())                       # rows past N untouched
    bad = torch.zeros(3, n, 2 * half + 1, device=device)[..., :half]   # rows not half apart
    with pytest.raises(ValueError, match="rope"):
        step_rows_(record, w, 8, bt, 4, *tables, n_vis, entry, rope=(offsets, freqs, bad))
    with pytest.raises(ValueError, match="rope freqs"):
        step_rows_(record, w, 8, bt, 4, *tables, n_vis, entry, rope=(offsets, freqs[:2], angles))


def _prefetch_args(device, n=3, w=16, k=40, s_w=64, s_c=100):
    g = torch.Generator().manual_seed(3)
    wp = torch.randint(0, 256, (s_w, WINDOW_KV_BYTES), generator=g, dtype=torch.uint8)
    cp = torch.randint(0, 256, (s_c, COMPRESSED_KV_BYTES), generator=g, dtype=torch.uint8)
    wt = torch.randint(-1, s_w, (n, w), generator=g, dtype=torch.int32)
    ct = torch.randint(-1, s_c, (n, k), generator=g, dtype=torch.int32)
    return [t.to(device) for t in (wp, wt, cp, ct)]


def test_records_prefetch_bad_inputs_name_the_argument():
    """records_prefetch_l2_ checks its pools and tables as the sparse MLA does (each error names the
    argument), and on the CPU (no sm_90 bulk prefetch) refuses naming window_pool."""
    wp, wt, cp, ct = _prefetch_args("cpu")
    cases = [
        (("wp", wt), "window_pool must be a 2-D tensor"),
        ((wp[:, :100], wt), r"window_pool must have shape \(64, 528\)"),
        ((wp.to(torch.int8), wt), "window_pool must have dtype torch.uint8"),
        ((wp[::2], wt), "window_pool must have contiguous records"),
        ((wp, wt.long()), "window_table must have dtype torch.int32"),
        ((wp, wt[0]), "window_table must be a 2-D tensor"),
        ((wp, wt, cp), "comp_pool and comp_table must be given together"),
        ((wp, wt, cp[:, :64], ct), r"comp_pool must have shape \(100, 288\)"),
        ((wp, wt, cp, ct[:2]), r"comp_table must have shape \(3, 40\)"),
        ((wp, wt, cp, ct.long()), "comp_table must have dtype torch.int32"),
        ((wp, wt, cp, ct, 1), "evict_last must be a bool"),
        ((wp, wt, cp, ct), "window_pool: the records' bulk prefetch needs"),
    ]
    for args, culprit in cases:
        with pytest.raises((ValueError, TypeError), match=culprit):
            records_prefetch_l2_(*args[:4], **({"evict_last": args[4]} if len(args) > 4 else {}))


def test_records_prefetch_compiles_for_sm90_with_evict_last():
    """The kernel compiled for sm_90 (tests/ops/_records_prefetch_sm90.py, in a subprocess without the
    interpreter), with and without the compressed records: one bulk L2 prefetch of a record's bytes
    under an evict_last policy in the PTX (evict_last=False: one without a policy), the bulk
    prefetch in the SASS, no local memory."""
    rows = compile_script(Path(__file__).with_name("_records_prefetch_sm90.py"))[1]
    assert [(r["kc"], r["last"]) for r in rows] == [(0, True), (512, True), (512, False)]
    for r in rows:
        assert r["prefetches"] == 1 and r["sass_prefetches"] >= 1 and r["LOCAL"] == 0, r
        assert (r["evict_last"] >= 1 and r["hinted"] == 1) if r["last"] else (r["evict_last"] == r["hinted"] == 0), r


@triton.jit
def _spans_kernel(win_table, comp_table, in_w_out, off_out, size_out, stride_w, stride_c, W: tl.constexpr,
                  KC: tl.constexpr, WREC: tl.constexpr, CREC: tl.constexpr, NJ: tl.constexpr):
    r = tl.program_id(0)
    j = tl.arange(0, NJ)
    in_w, off, size = sparse_tables.record_spans(win_table, comp_table, r, j, stride_w, stride_c, W, KC, WREC, CREC)
    tl.store(in_w_out + r * NJ + j, in_w.to(tl.int32))
    tl.store(off_out + r * NJ + j, off)
    tl.store(size_out + r * NJ + j, size.to(tl.int32))


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("k", [0, 40])
def test_record_spans_are_the_records_the_mla_reads(device, k):
    """record_spans (the prefetch's byte spans): entry j < W is window_pool's record
    window_table[r, j] (bytes [slot * 528, +528)), the next K entries comp_pool's comp_table[r, j - W]
    ([slot * 288, +288)) - the records `sparse_mla_` reads (window_pool[window_table[r, i]],
    comp_pool[comp_table[r, k]]) - with no bytes for -1 slots and past the list."""
    wp, wt, cp, ct = _prefetch_args("cpu", k=max(k, 1))
    wt[0, :5] = -1                                    # a window not yet full
    ct = ct[:, :k].contiguous()
    n, w = wt.shape
    nj = 64
    outs = [torch.zeros(n, nj, dtype=dt, device=device) for dt in (torch.int32, torch.int64, torch.int32)]
    _spans_kernel[(n,)](wt.to(device), (ct if k else wt).to(device), *outs, wt.stride(0), (ct if k else wt).stride(0),
                        W=w, KC=k, WREC=WINDOW_KV_BYTES, CREC=COMPRESSED_KV_BYTES, NJ=nj)
    in_w, off, size = (t.cpu() for t in outs)
    slots = torch.full((n, nj), -1, dtype=torch.int64)
    slots[:, :w] = wt.long()
    slots[:, w:w + k] = ct.long()
    rec = torch.full((n, nj), COMPRESSED_KV_BYTES, dtype=torch.int64)
    rec[:, :w] = WINDOW_KV_BYTES
    assert torch.equal(in_w, (torch.arange(nj) < w).int().expand(n, nj))
    assert torch.equal(size.long(), torch.where(slots >= 0, rec, 0))
    live = slots >= 0
    assert torch.equal(off[live], (slots * rec)[live])


@pytest.mark.gpu
@pytest.mark.parametrize("comp, last", [(False, True), (True, True), (True, False)])
def test_gpu_records_prefetch_writes_nothing(comp, last):
    """On the GPU the prefetch launches (each form, and with no rows none) and leaves its pools and
    tables as they were; which bytes it asks for is `record_spans`'s test."""
    if not sparse_tables.pdl.supported("cuda"):
        pytest.skip("needs sm_90")
    wp, wt, cp, ct = _prefetch_args("cuda")
    wt[0, -1], ct[0, -1] = wp.shape[0] - 1, cp.shape[0] - 1
    before = [t.clone() for t in (wp, wt, cp, ct)]
    records_prefetch_l2_(wp, wt, *((cp, ct) if comp else ()), evict_last=last)
    records_prefetch_l2_(wp, wt[:0], *((cp, ct[:0]) if comp else ()), evict_last=last)   # no rows: nothing launched
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(before, (wp, wt, cp, ct)))
