"""DecodeState: requests, rows, paged compressed caches, window rings, capacities (CPU)."""

import copy
import re

import pytest
import torch

from dsv41_decode.config import ModelConfig
from dsv41_decode.records import (
    pack_compressed_kv,
    pack_index_key,
    pack_window_kv,
    unpack_compressed_kv,
    unpack_index_key,
    unpack_window_kv,
)
from dsv41_decode.rows import CapacityError, StepRows
from dsv41_decode.state import DecodeState


@pytest.fixture(scope="module")
def tiny():
    return ModelConfig.preset("tiny")  # W=16; layer 1 Full r=2, layer 3 Full r=1


@pytest.fixture(scope="module")
def small():
    return ModelConfig.preset("small")  # W=32; Full layers 2, 4 (r=2) and 6 (r=1)


def rand_bf16(gen, *shape, scale=3.0):
    return (torch.randn(*shape, generator=gen) * scale).to(torch.bfloat16)


def bits(t):
    return t.view(torch.int16)


def decode_one(st, req_id):
    """Plan and advance a single decode row for `req_id`; return its position."""
    step = st.plan([(req_id, 1)])
    st.advance(step)
    return step.starts[0]


# ----- requests -----

def test_admit_free_reuse_slots(tiny):
    st = DecodeState(tiny, max_requests=3, max_context=64, page_size=4)
    assert [st.admit(x) for x in ("a", "b", "c")] == [0, 1, 2]
    assert st.live_requests == ("a", "b", "c")
    with pytest.raises(CapacityError, match=r"requests: all 3 request slots .*max_requests=3.*'d'"):
        st.admit("d")
    with pytest.raises(ValueError, match="'a' is already live in slot 0"):
        st.admit("a")
    st.free("b")
    assert st.live_requests == ("a", "c")
    assert st.admit("d") == 1
    assert st.slot("d") == 1 and st.length("d") == 0
    with pytest.raises(KeyError, match="'zz'"):
        st.free("zz")
    with pytest.raises(KeyError, match="'b'"):
        st.length("b")


def test_free_returns_pages_and_admit_reuses_them(tiny):
    st = DecodeState(tiny, max_requests=2, max_context=64, page_size=4)
    st.admit("a")
    st.advance(st.plan([("a", 20)]))
    pages = {r: st.pages_of("a", r) for r in (1, 2)}
    assert len(pages[1]) == 5 and len(pages[2]) == 3
    free_before = {r: st.free_pages(r) for r in (1, 2)}
    st.free("a")
    assert {r: st.free_pages(r) for r in (1, 2)} == {r: free_before[r] + len(pages[r])
                                                     for r in (1, 2)}
    assert bool((st.block_table[1][0] == -1).all()) and bool((st.block_table[2][0] == -1).all())
    assert int(st.seq_lens[0]) == 0
    assert st.admit("b") == 0
    st.advance(st.plan([("b", 20)]))
    assert {r: st.pages_of("b", r) for r in (1, 2)} == pages


def test_compressor_state_reset_on_admit(small):
    st = DecodeState(small, max_requests=2, max_context=64)
    assert sorted(st.comp_kv) == [2, 4]  # ratio-2 KV sources only
    for L in (2, 4):
        assert st.comp_kv[L].shape == (2, 2, 512) and st.comp_kv[L].dtype == torch.float32
        assert st.comp_score[L].shape == (2, 2, 512)
        assert bool((st.comp_kv[L] == 0).all()) and bool(torch.isneginf(st.comp_score[L]).all())
    s = st.admit("a")
    for L in (2, 4):
        st.comp_kv[L][s].normal_()
        st.comp_score[L][s].normal_()
    st.free("a")
    assert st.admit("b") == s
    for L in (2, 4):
        assert bool((st.comp_kv[L][s] == 0).all())
        assert bool(torch.isneginf(st.comp_score[L][s]).all())


def test_seq_lens_mirror_and_stale_advance(tiny):
    st = DecodeState(tiny, max_requests=3, max_context=64)
    st.admit("a"), st.admit("b")
    step = st.plan([("a", 3), ("b", 5)])
    assert st.length("a") == 0  # planned rows are not held until advance
    st.advance(step)
    assert st.seq_lens.dtype == torch.int32 and st.seq_lens.tolist() == [3, 5, 0]
    with pytest.raises(ValueError, match=r"stale step: request 'a' holds 3 tokens .* starts at 0"):
        st.advance(step)
    assert st.seq_lens.tolist() == [3, 5, 0]


# ----- plan -----

def test_plan_positions_for_several_requests(tiny):
    st = DecodeState(tiny, max_requests=4, max_context=64)
    for x in ("a", "b", "c"):
        st.admit(x)
    st.advance(st.plan([("a", 5), ("c", 2)]))
    step = st.plan([("c", 3), ("a", 1), ("b", 4)])
    assert isinstance(step, StepRows)
    assert step.req_ids == ("c", "a", "b")
    assert step.counts == (3, 1, 4) and step.starts == (2, 5, 0)
    assert step.row_start == (0, 3, 4) and step.n_rows == 8
    assert step.positions.dtype == torch.int64 and step.req_slot.dtype == torch.int64
    assert step.positions.tolist() == [2, 3, 4, 5, 0, 1, 2, 3]
    assert step.req_slot.tolist() == [2, 2, 2, 0, 1, 1, 1, 1]
    assert step.positions[step.request_rows(2)].tolist() == [0, 1, 2, 3]
    assert step.request_rows(1) == slice(3, 4)
    st.advance(step)
    assert (st.length("a"), st.length("b"), st.length("c")) == (6, 4, 5)


def test_step_rows_upload_their_slots_and_positions_once_at_the_first_read(tiny):
    """req_slot and positions come from the plan's host fields at their first read (one upload,
    then the same tensors); a deep copy shares the state's uploader and gives the same values;
    rows without host slots name what they lack."""
    st = DecodeState(tiny, max_requests=4, max_context=64)
    st.admit("a"), st.admit("b")
    st.advance(st.plan([("b", 3)]))
    step = st.plan([("a", 2), ("b", 2)])
    assert "_slot_pos" not in vars(step)                       # nothing uploaded by the plan
    assert step.positions.tolist() == [0, 1, 3, 4] and step.req_slot.tolist() == [0, 0, 1, 1]
    assert step.positions.data_ptr() == step.positions.data_ptr() and step.req_slot.device == st.seq_lens.device
    twin = copy.deepcopy(step)
    assert twin.upload is step.upload and twin.plan_key == step.plan_key
    assert twin.positions.tolist() == [0, 1, 3, 4] and twin.req_slot.tolist() == [0, 0, 1, 1]
    st.advance(twin)                                           # the copy is the same plan
    bare = StepRows(req_ids=("a",), counts=(2,), starts=(0,), row_start=(0,))
    with pytest.raises(ValueError, match="need the rows' host slots"):
        bare.positions


def test_plan_rejects_bad_calls_without_side_effects(tiny):
    st = DecodeState(tiny, max_requests=2, max_context=64, page_size=4)
    st.admit("a"), st.admit("b")
    before = {r: st.free_pages(r) for r in (1, 2)}
    with pytest.raises(KeyError, match="'x'"):
        st.plan([("a", 9), ("x", 1)])
    with pytest.raises(ValueError, match="'a' has count 0"):
        st.plan([("a", 0)])
    with pytest.raises(ValueError, match="'b' is listed twice"):
        st.plan([("b", 1), ("a", 1), ("b", 2)])
    with pytest.raises(ValueError, match="no rows"):
        st.plan([])
    assert {r: st.free_pages(r) for r in (1, 2)} == before
    assert st.length("a") == 0


# ----- capacities -----

def test_context_capacity(tiny):
    st = DecodeState(tiny, max_requests=2, max_context=10)
    st.admit("a")
    with pytest.raises(CapacityError, match=re.escape(
            "context: request 'a' would hold 11 tokens (0 cached + 11 new), more than max_context=10")):
        st.plan([("a", 11)])
    st.advance(st.plan([("a", 6)]))
    with pytest.raises(CapacityError, match=re.escape("11 tokens (6 cached + 5 new)")):
        st.plan([("a", 5)])
    st.advance(st.plan([("a", 4)]))
    assert st.length("a") == 10
    with pytest.raises(CapacityError, match="max_context=10"):
        st.plan([("a", 1)])


def test_page_capacity_exact_numbers_and_no_partial_allocation(tiny):
    # pages_1 = ceil(16 / 1 / 4) + 2 = 6, pages_2 = ceil(16 / 2 / 4) + 2 = 4
    st = DecodeState(tiny, max_requests=2, max_context=64, max_tokens=16, page_size=4)
    assert st.n_pages == {1: 6, 2: 4}
    assert st.block_table[1].shape == (2, 16) and st.block_table[2].shape == (2, 8)
    st.admit("a"), st.admit("b")
    with pytest.raises(CapacityError, match=re.escape(
            "pages of ratio 1: the call needs 7 more page(s) but only 6 of 6 are free "
            "(page_size=4, max_tokens=16)")):
        st.plan([("a", 28)])
    st.advance(st.plan([("a", 17)]))  # ratio 1: 5 pages, ratio 2: 2 pages
    assert (st.free_pages(1), st.free_pages(2)) == (1, 2)
    table1, table2 = st.block_table[1].clone(), st.block_table[2].clone()
    # b's 8 tokens fit ratio 2 (1 page) but not ratio 1 (2 pages): nothing may be allocated.
    with pytest.raises(CapacityError, match=re.escape(
            "pages of ratio 1: the call needs 2 more page(s) but only 1 of 6 are free")):
        st.plan([("b", 8)])
    assert (st.free_pages(1), st.free_pages(2)) == (1, 2)
    assert torch.equal(st.block_table[1], table1) and torch.equal(st.block_table[2], table2)
    st.advance(st.plan([("b", 4)]))
    assert (st.free_pages(1), st.free_pages(2)) == (0, 1)


def test_replaced_plan_gives_its_pages_back(tiny):
    """A plan that is replaced before it is advanced (its forward refused its input, say) leaves its
    requests the pages of their lengths: what it allocated goes back to the pools, counts as free
    for the plan that replaces it, and the table rows past the kept pages are -1 again (a forward
    that stopped midway abandons its call instead: tests/test_speculative.py)."""
    st = DecodeState(tiny, max_requests=2, max_context=16, max_tokens=8, page_size=2)
    st.admit("a"), st.admit("b")
    free = {r: st.free_pages(r) for r in st.ratios}
    st.plan([("a", 8)])                                     # 4 pages of ratio 1, 2 of ratio 2
    assert (st.free_pages(1), st.free_pages(2)) == (free[1] - 4, free[2] - 2)
    st.advance(st.plan([("a", 1)]))                         # replaces it: a keeps 1 page of ratio 1
    assert {r: len(st.pages_of("a", r)) for r in st.ratios} == {1: 1, 2: 0}
    assert (st.free_pages(1), st.free_pages(2)) == (free[1] - 1, free[2])
    assert st.block_table[1][0, 1:].eq(-1).all() and st.block_table[2][0].eq(-1).all()
    st.advance(st.plan([("b", 6)]))                         # 7 tokens held in all: within max_tokens=8
    # a replaced plan's pages count as free for the plan that replaces it, and a failed replacement
    # leaves the earlier plan as it was
    st2 = DecodeState(tiny, max_requests=2, max_context=16, max_tokens=8, page_size=2)
    st2.admit("a"), st2.admit("b")
    first = st2.plan([("a", 10)])                           # 5 of ratio 1's 6 pages
    with pytest.raises(CapacityError, match="needs 7 more page"):
        st2.plan([("b", 14)])
    assert len(st2.pages_of("a", 1)) == 5
    st2.advance(st2.plan([("b", 11)]))                      # fits once a's 5 pages are back
    assert len(st2.pages_of("a", 1)) == 0 and len(st2.pages_of("b", 1)) == 6
    with pytest.raises(ValueError, match="not this state's current plan"):
        st2.advance(first)


def test_a_copy_numbers_its_own_plans(tiny):
    """A deep copy advances the rows planned before it (a snapshot), and neither state takes the
    other's later steps."""
    import copy
    st = DecodeState(tiny, max_requests=2, max_context=64)
    st.admit("a"), st.admit("b")
    before = st.plan([("a", 2)])
    twin = copy.deepcopy(st)
    twin.advance(before)
    assert twin.length("a") == 2 and st.length("a") == 0
    st.advance(before)
    mine, theirs = st.plan([("a", 1)]), twin.plan([("a", 1), ("b", 1)])
    with pytest.raises(ValueError, match="not this state's current plan"):
        twin.advance(mine)
    with pytest.raises(ValueError, match="not this state's current plan"):
        st.advance(theirs)
    twin.advance(theirs), st.advance(mine)
    assert (st.length("a"), st.length("b"), twin.length("a"), twin.length("b")) == (3, 0, 3, 1)


def test_fill_state_keeps_the_open_group_of_one_token(tiny):
    """`testing.synthetic.fill_state` writes a ratio-2 source's open group and its kept rows at any
    length, 1 included (no entry completed yet): a state that then decodes two rows and keeps one
    holds the group a state that decoded only the kept row holds."""
    from dsv41_decode.testing.synthetic import fill_state
    L, s = 1, 0
    kv, score = torch.randn(2, 512), torch.randn(2, 512)
    states = []
    for drafts, rows in ((1, 2), (0, 1)):
        st = DecodeState(tiny, max_requests=1, max_context=64, max_drafts=drafts)
        fill_state(st, {"a": 1}, seed=0)
        step = st.plan([("a", rows)])
        st.comp_kv[L][s, step.positions % 2] = kv[:rows]
        st.comp_score[L][s, step.positions % 2] = score[:rows]
        st.write_compressor_rows(L, s, step.positions, kv[:rows], score[:rows])
        st.advance(step)
        states.append(st)
    states[0].accept({"a": 1})
    for name in ("comp_kv", "comp_score"):
        assert torch.equal(getattr(states[0], name)[L][s], getattr(states[1], name)[L][s]), name


# ----- paging on group boundaries -----

def test_pages_allocated_exactly_when_groups_complete(tiny):
    ps = 4
    st = DecodeState(tiny, max_requests=2, max_context=64, page_size=ps)
    st.admit("other")
    st.advance(st.plan([("other", 3)]))  # takes the first pages, so "a" gets others
    s = st.admit("a")
    first_new = {}
    for p in range(24):
        step = st.plan([("a", 1)])
        for r in (1, 2):
            n_entries = (p + 1) // r
            want = -(-n_entries // ps)
            held = st.pages_of("a", r)
            assert len(held) == want, (r, p)
            row = st.block_table[r][s].tolist()
            assert row[:want] == list(held) and all(v == -1 for v in row[want:]), (r, p)
            first_new.setdefault((r, want), p)
        st.advance(step)
    # ratio 1: entry 4k completes at p = 4k; ratio 2: entry 4k (positions 8k, 8k+1) at p = 8k+1.
    assert [first_new[(1, k)] for k in (1, 2, 3)] == [0, 4, 8]
    assert [first_new[(2, k)] for k in (1, 2, 3)] == [1, 9, 17]
    assert set(st.pages_of("a", 1)).isdisjoint(st.pages_of("other", 1))


def test_prefill_chunk_allocates_completed_entries_only(tiny):
    st = DecodeState(tiny, max_requests=1, max_context=64, page_size=4)
    st.admit("a")
    st.advance(st.plan([("a", 7)]))  # ratio 2: 3 entries (one odd token open), ratio 1: 7
    assert len(st.pages_of("a", 2)) == 1 and len(st.pages_of("a", 1)) == 2
    st.advance(st.plan([("a", 1)]))  # ratio 2: entry 3 completes, still page 0
    assert len(st.pages_of("a", 2)) == 1 and len(st.pages_of("a", 1)) == 2
    st.plan([("a", 2)])  # 10 tokens: ratio 2 entry 4 -> second page; ratio 1 entry 9 -> third
    assert len(st.pages_of("a", 2)) == 2 and len(st.pages_of("a", 1)) == 3


# ----- caches: round trips and guards -----

def test_window_round_trip_bit_exact(small):
    gen = torch.Generator().manual_seed(0)
    st = DecodeState(small, max_requests=3, max_context=128)
    st.admit("a"), st.admit("b")
    step = st.plan([("a", 5), ("b", 3)])
    expect = {}
    for layer in range(small.n_layers):
        for i, rid in enumerate(step.req_ids):
            rows = step.request_rows(i)
            x = rand_bf16(gen, step.counts[i], 512)
            st.write_window(layer, st.slot(rid), step.positions[rows], x)
            expect[layer, rid] = unpack_window_kv(pack_window_kv(x))
    st.advance(step)
    for (layer, rid), want in expect.items():
        got = st.read_window(layer, st.slot(rid), torch.arange(st.length(rid)))
        assert got.dtype == torch.bfloat16 and got.shape == want.shape
        assert torch.equal(bits(got), bits(want))


def test_entries_round_trip_bit_exact(small):
    gen = torch.Generator().manual_seed(1)
    st = DecodeState(small, max_requests=2, max_context=512, page_size=8)
    st.admit("pad")
    st.advance(st.plan([("pad", 9)]))
    s = st.admit("a")
    st.plan([("a", 37)])
    for layer in st.kv_sources:  # 2, 4 (ratio 2) and 6 (ratio 1)
        r = small.ratio(layer)
        n = 37 // r
        kv, ik = rand_bf16(gen, n, 512), rand_bf16(gen, n, 128, scale=0.5)
        perm = torch.randperm(n, generator=gen)  # write order does not matter
        st.write_entries(layer, s, perm, kv[perm], ik[perm])
        got_kv, got_ik = st.read_entries(layer, s, n)
        assert got_kv.dtype == torch.bfloat16 and got_kv.shape == (n, 512)
        assert got_ik.dtype == torch.bfloat16 and got_ik.shape == (n, 128)
        assert torch.equal(bits(got_kv), bits(unpack_compressed_kv(pack_compressed_kv(kv))))
        assert torch.equal(bits(got_ik), bits(unpack_index_key(pack_index_key(ik))))
        slots = st.entry_slots(r, s, torch.arange(n))
        pages = st.pages_of("a", r)
        assert slots.tolist() == [pages[j // 8] * 8 + j % 8 for j in range(n)]


def test_entry_guards(small):
    st = DecodeState(small, max_requests=2, max_context=64, page_size=4)
    s = st.admit("a")
    st.advance(st.plan([("a", 5)]))  # ratio 2: entries 0, 1; ratio 1: entries 0..4
    kv, ik = torch.zeros(1, 512, dtype=torch.bfloat16), torch.zeros(1, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="entry 2 is not completed; entries 0..1 are"):
        st.write_entries(2, s, torch.tensor([2]), kv, ik)
    with pytest.raises(ValueError, match=r"layer 3 \(reuse\) owns no compressed cache; its KV source is 2"):
        st.write_entries(3, s, torch.tensor([0]), kv, ik)
    with pytest.raises(ValueError, match="only 5 entries are completed"):
        st.read_entries(6, s, 6)
    with pytest.raises(ValueError, match="entry 8 of ratio 1, slot 0 has no page allocated"):
        st.entry_slots(1, s, torch.tensor([0, 8]))
    with pytest.raises(ValueError, match="entry 64 of ratio 1 is outside 0..63"):
        st.entry_slots(1, s, torch.tensor([64]))
    with pytest.raises(ValueError, match=r"ratio 3 has no compressed caches.*\[1, 2\]"):
        st.entry_slots(3, s, torch.tensor([0]))
    with pytest.raises(ValueError, match="kv must be bfloat16"):
        st.write_entries(2, s, torch.tensor([0]), kv.float(), ik)
    with pytest.raises(ValueError, match=r"index_key must have shape \[1, 128\]"):
        st.write_entries(2, s, torch.tensor([0]), kv, torch.zeros(1, 64, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="request slot 1 is not a live slot"):
        st.read_entries(2, 1, 0)
    assert st.read_entries(2, s, 0)[0].shape == (0, 512)


def test_window_ring_wrap_and_eviction(tiny):
    gen = torch.Generator().manual_seed(2)
    W = tiny.window_size
    st = DecodeState(tiny, max_requests=2, max_context=64)
    st.admit("pad")
    s = st.admit("a")
    layer = 3
    want = {}
    for p in range(W + 2):
        step = st.plan([("a", 1)])
        x = rand_bf16(gen, 1, 512)
        st.write_window(layer, s, step.positions, x)
        want[p] = unpack_window_kv(pack_window_kv(x))[0]
        # the row just written is readable before advance
        assert torch.equal(bits(st.read_window(layer, s, step.positions)[0]), bits(want[p]))
        st.advance(step)
    edge = torch.tensor([W - 2, W - 1, W, W + 1])
    assert st.window_slots(torch.full((4,), s), edge).tolist() == [
        s * W + W - 2, s * W + W - 1, s * W, s * W + 1]
    got = st.read_window(layer, s, edge)
    for i, p in enumerate(edge.tolist()):
        assert torch.equal(bits(got[i]), bits(want[p]))
    held = torch.arange(2, W + 2)
    assert torch.equal(bits(st.read_window(layer, s, held)),
                       bits(torch.stack([want[p] for p in held.tolist()])))
    for p in (0, 1):
        with pytest.raises(ValueError, match=f"position {p} is not held .* holds positions 2..{W + 1}"):
            st.read_window(layer, s, torch.tensor([p]))
    with pytest.raises(ValueError, match=f"position {W + 2} is not held"):
        st.read_window(layer, s, torch.tensor([W + 2]))


def test_window_multi_row_call_and_long_chunk(tiny):
    gen = torch.Generator().manual_seed(3)
    W = tiny.window_size
    st = DecodeState(tiny, max_requests=1, max_context=64)
    s = st.admit("a")
    # A prefill chunk longer than W: only the last W positions survive in the ring.
    step = st.plan([("a", 40)])
    x = rand_bf16(gen, 40, 512)
    st.write_window(0, s, step.positions, x)
    st.advance(step)
    tail = torch.arange(40 - W, 40)
    assert torch.equal(bits(st.read_window(0, s, tail)),
                       bits(unpack_window_kv(pack_window_kv(x[40 - W:]))))
    # A 5-row call: the cached window is readable before the rows are written, and the positions
    # the new rows overwrite are not readable after.
    step = st.plan([("a", 5)])
    st.read_window(0, s, torch.arange(40 - W, 40))
    with pytest.raises(ValueError, match="position 40 is not held"):
        st.read_window(0, s, step.positions)  # not written yet
    st.write_window(0, s, step.positions, rand_bf16(gen, 5, 512))
    st.read_window(0, s, torch.arange(45 - W, 45))
    with pytest.raises(ValueError, match=f"position {44 - W} is not held .* {45 - W}..44"):
        st.read_window(0, s, torch.tensor([44 - W]))
    with pytest.raises(ValueError, match=r"positions 45..45 are outside 0..44"):
        st.write_window(0, s, torch.tensor([45]), rand_bf16(gen, 1, 512))


def test_reused_slot_window_is_guarded(tiny):
    st = DecodeState(tiny, max_requests=1, max_context=64)
    s = st.admit("a")
    step = st.plan([("a", 3)])
    st.write_window(2, s, step.positions, rand_bf16(torch.Generator().manual_seed(4), 3, 512))
    st.advance(step)
    st.free("a")
    assert st.admit("b") == s
    with pytest.raises(ValueError, match="position 0 is not held"):
        st.read_window(2, s, torch.tensor([0]))
    with pytest.raises(ValueError, match="only 0 entries are completed"):
        st.read_entries(1, s, 1)


# ----- memory -----

def test_memory_does_not_grow_with_max_context(small):
    a = DecodeState(small, max_requests=4, max_context=256, max_tokens=1024)
    b = DecodeState(small, max_requests=4, max_context=8192, max_tokens=1024)
    ma, mb = a.memory_bytes(), b.memory_bytes()
    assert set(ma) == {"window", "compressed", "index_keys", "compressor", "tables"}
    for k in ma:
        if k != "tables":
            assert ma[k] == mb[k], k
    assert mb["tables"] > ma["tables"]
    # window: 12 layers x (4 slots x 32 ring slots + 64 staging rows) x 528 B; compressor: 2 layers x 2 x [4, 2, 512] FP32
    assert ma["window"] == 12 * (4 * 32 + 64) * 528   # + 64 staging rows per layer (stage_rows)
    assert ma["compressor"] == 2 * 2 * 4 * 2 * 512 * 4
    # ratio 2: ceil(1024/2/64) + 4 = 12 pages for layers 2, 4; ratio 1: 16 + 4 = 20 pages for layer 6
    assert ma["compressed"] == (2 * 12 + 20) * 64 * 288
    assert ma["index_keys"] == (2 * 12 + 20) * 64 * 68
    assert "MB" in a.describe() and "ratio 2: 12 pages" in a.describe()
    for t in list(a.window.values()) + list(a.compressed.values()) + list(a.block_table.values()):
        assert t.device == torch.device("cpu")


# ----- speculative decoding: accept -----
def _call(st, rows):
    step = st.plan(rows)
    st.advance(step)
    return step


def test_accept_bookkeeping_and_pages(tiny):
    st = DecodeState(tiny, max_requests=3, max_context=64, page_size=2, max_drafts=3)
    assert st.ring_size == tiny.window_size + 3 and st.stage_base == 3 * st.ring_size
    assert st.window[0].shape[0] == 3 * st.ring_size + st.stage_rows
    assert sorted(st.comp_rows) == [1] and st.comp_rows[1].shape == (3, 5, 1024)
    for r in ("a", "b", "c"):
        st.admit(r)
    _call(st, [("a", 3), ("b", 2)])
    _call(st, [("a", 4), ("b", 4), ("c", 1)])        # a: 3..6, b: 2..5, c: 0
    pages = {r: st.pages_of("a", r) for r in st.ratios}
    free = {r: st.free_pages(r) for r in st.ratios}
    st.accept({"a": 1, "b": 4})                       # "c" not listed: keeps its row
    assert [st.length(r) for r in "abc"] == [4, 6, 1]
    assert st.seq_lens.tolist() == [4, 6, 1]
    # a holds 4 tokens: ratio 1 entries 0..3 (2 pages of 2), ratio 2 entries 0..1 (1 page)
    assert st.pages_of("a", 1) == pages[1][:2] and st.pages_of("a", 2) == pages[2][:1]
    assert st.free_pages(1) == free[1] + 2 and st.free_pages(2) == free[2] + 1
    assert st.block_table[1][0, 2:].eq(-1).all() and st.block_table[2][0, 1:].eq(-1).all()
    with pytest.raises(ValueError, match="request 'a' was not in the last advanced call"):
        st.accept({"a": 1})                           # once per call and request
    st.accept({"c": 1})                               # the others still can, once
    _call(st, [("a", 2)])
    with pytest.raises(ValueError, match="request 'b' was not in the last advanced call"):
        st.accept({"b": 1})
    st.plan([("a", 1)])
    with pytest.raises(ValueError, match="request 'a' was not in the last advanced call"):
        st.accept({"a": 1})                           # a new plan ends the last call's acceptance


@pytest.mark.parametrize("kept, match", [
    (0, r"keeps 0 rows; its call had 4 rows and keeps 1..4"),
    (5, r"keeps 5 rows"),
    (True, r"keeps True rows"),
])
def test_accept_rejects_bad_counts(tiny, kept, match):
    st = DecodeState(tiny, max_requests=1, max_context=64, max_drafts=3)
    st.admit("a")
    _call(st, [("a", 4)])
    with pytest.raises(ValueError, match=match):
        st.accept({"a": kept})
    assert st.length("a") == 4
    with pytest.raises(KeyError, match="'z' is not live"):
        st.accept({"z": 1})


def test_accept_needs_max_drafts(tiny):
    st = DecodeState(tiny, max_requests=1, max_context=64, max_drafts=1)
    st.admit("a")
    _call(st, [("a", 3)])
    with pytest.raises(ValueError, match=r"rejects 2 of its 3 rows, more than max_drafts=1 .*max_drafts >= 2"):
        st.accept({"a": 1})
    st.accept({"a": 2})
    assert st.length("a") == 2
    plain = DecodeState(tiny, max_requests=1, max_context=64)
    assert plain.ring_size == tiny.window_size and not plain.comp_rows
    plain.admit("a")
    _call(plain, [("a", 2)])
    with pytest.raises(ValueError, match="more than max_drafts=0"):
        plain.accept({"a": 1})
    plain.accept({"a": 2})                              # keeping every row is always allowed
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="max_drafts must be a non-negative integer"):
            DecodeState(tiny, max_requests=1, max_context=64, max_drafts=bad)


def test_accept_restores_the_open_group(tiny):
    """Both rows of the ratio-2 open group come back bit for bit: from this call's kept rows, the
    previous call's last row, or a fresh group (kept length 1)."""
    gen = torch.Generator().manual_seed(4)
    L = 1
    for start, count, kept in [(0, 4, 1), (0, 3, 2), (5, 4, 1), (5, 4, 2), (6, 4, 3), (6, 2, 1)]:
        st, s, kv, score = _drafted_state(tiny, gen, start, count)
        st.accept({"a": kept})
        n = start + kept
        for p in (n - 1, n - 2):
            want_kv = kv[p] if p >= 0 else torch.zeros(512)
            want_sc = score[p] if p >= 0 else torch.full((512,), float("-inf"))
            assert torch.equal(st.comp_kv[L][s, p % 2], want_kv), (start, count, kept, p)
            assert torch.equal(st.comp_score[L][s, p % 2], want_sc), (start, count, kept, p)
        assert st.comp_kv[L][0].eq(0).all() and st.comp_score[L][0].isneginf().all()   # other slots untouched


def _drafted_state(tiny, gen, start, count):
    """(state, slot of "a", kv, score): a state with drafts, a request "pad" in slot 0 and "a",
    whose compressor rows at positions 0 .. start + count - 1 are kv, score (written as the
    compressor leaves them: the open group and comp_rows), in two advanced calls (start, count)."""
    L = 1
    st = DecodeState(tiny, max_requests=3, max_context=64, max_drafts=3)
    st.admit("pad")
    s = st.admit("a")
    kv = torch.randn(start + count, 512, generator=gen)
    score = torch.randn(start + count, 512, generator=gen)
    for lo, hi in ((0, start), (start, start + count)):
        if hi > lo:
            step = st.plan([("a", hi - lo)])
            pos = step.positions
            st.comp_kv[L][s, pos % 2] = kv[lo:hi]
            st.comp_score[L][s, pos % 2] = score[lo:hi]
            st.write_compressor_rows(L, s, pos, kv[lo:hi], score[lo:hi])
            st.advance(step)
    return st, s, kv, score


def test_a_deferred_accept_leaves_the_open_group_to_the_next_reader(tiny):
    """accept(defer=True) copies nothing into comp_kv / comp_score and leaves seq_lens at the
    lengths before it; open_group reads the group as the next call would, and sync writes it and
    the lengths: the eager accept's bits."""
    L = 1
    for start, count, kept in [(0, 4, 1), (5, 4, 1), (5, 4, 2), (6, 4, 3), (6, 2, 1)]:
        eager, s, _, _ = _drafted_state(tiny, torch.Generator().manual_seed(start * 10 + kept), start, count)
        lazy = _drafted_state(tiny, torch.Generator().manual_seed(start * 10 + kept), start, count)[0]
        eager.accept({"a": kept})
        before = [t.clone() for t in (lazy.comp_kv[L], lazy.comp_score[L])]
        lazy.accept({"a": kept}, defer=True)
        assert all(torch.equal(t, b) for t, b in zip((lazy.comp_kv[L], lazy.comp_score[L]), before)), \
            "a deferred accept wrote the open groups"
        assert lazy.length("a") == eager.length("a") == start + kept
        assert (lazy.seq_lens[s].item(), eager.seq_lens[s].item()) == (start + count, start + kept)
        for got, want in zip(lazy.open_group(L, s), (eager.comp_kv[L][s], eager.comp_score[L][s])):
            assert torch.equal(got.view(torch.int32), want.view(torch.int32)), (start, count, kept)
        for _ in range(2):                           # the second: nothing left, no change
            lazy.sync()
            for name in ("comp_kv", "comp_score"):
                got, want = getattr(lazy, name)[L], getattr(eager, name)[L]
                assert torch.equal(got.view(torch.int32), want.view(torch.int32)), (start, count, kept, name)
            assert torch.equal(lazy.seq_lens, eager.seq_lens)


def test_what_ends_a_deferred_restore(tiny):
    """A deferred group stays left to restore (open_group reads other rows than comp_kv holds: both
    of the kept length 7's rows were overwritten by rejected rows 7 and 8) until a call that ran
    advances (its layers read and rewrote it; plan + advance alone stand in for it here), a call
    that ran is abandoned (restored there: the eager accept's group), or the request is freed; an
    abandon with ran=False and another request's call leave it."""
    L = 1

    def deferred():
        st, s, _, _ = _drafted_state(tiny, torch.Generator().manual_seed(1), 5, 4)
        eager = copy.deepcopy(st)
        eager.accept({"a": 2})
        st.accept({"a": 2}, defer=True)
        return st, s, (eager.comp_kv[L][s], eager.comp_score[L][s])

    def pending(st, s) -> bool:
        return not all(torch.equal(g, h) for g, h in zip(st.open_group(L, s), (st.comp_kv[L][s], st.comp_score[L][s])))
    st, s, _ = deferred()
    assert pending(st, s)
    st.abandon(st.plan([("a", 1)]), ran=False)
    assert pending(st, s)
    st.advance(st.plan([("a", 1)]))
    assert not pending(st, s)
    assert st.seq_lens.tolist()[:2] == [0, 8]           # the advance's upload: the kept 7 + 1
    st, s, restored = deferred()
    st.abandon(st.plan([("a", 1)]))
    assert not pending(st, s)
    assert all(torch.equal(g, h) for g, h in zip((st.comp_kv[L][s], st.comp_score[L][s]), restored))
    st, s, _ = deferred()
    st.advance(st.plan([("pad", 1)]))                     # another request's call: still left
    assert pending(st, s)
    st.free("a")
    assert not st._groups.stale                           # a freed slot has nothing left to restore
    with pytest.raises(TypeError, match="defer must be a bool"):
        deferred()[0].accept({"a": 1}, defer=1)


def test_open_group_names_a_bad_layer_or_slot(tiny):
    st, s = _drafted_state(tiny, torch.Generator().manual_seed(2), 2, 1)[:2]
    with pytest.raises(ValueError, match="open_group: layer 0"):
        st.open_group(0, s)
    with pytest.raises(ValueError, match="open_group: layer 3 has ratio 1"):
        st.open_group(3, s)
    with pytest.raises(ValueError, match="not a live slot"):
        st.open_group(1, 2)


def test_window_ring_with_drafts(tiny):
    """Rejected rows overwrite only ring slots of positions below length - W: the W positions the
    kept length needs stay readable; the rejected positions are not."""
    gen = torch.Generator().manual_seed(6)
    W, layer = tiny.window_size, 3
    st = DecodeState(tiny, max_requests=1, max_context=64, max_drafts=3)
    s = st.admit("a")
    want = {}
    n = 0
    for count, kept in [(4, 1), (4, 2), (3, 3), (4, 1)] * 7:
        step = st.plan([("a", count)])
        x = rand_bf16(gen, count, 512)
        st.write_window(layer, s, step.positions, x)
        st.advance(step)
        st.accept({"a": kept})
        for i in range(kept):
            want[n + i] = unpack_window_kv(pack_window_kv(x[i:i + 1]))[0]
        n += kept
        held = torch.arange(max(0, n - W), n)
        got = st.read_window(layer, s, held)
        assert torch.equal(bits(got), bits(torch.stack([want[p] for p in held.tolist()])))
        with pytest.raises(ValueError, match=f"position {n} is not held"):
            st.read_window(layer, s, torch.tensor([n]))
    assert n > 2 * st.ring_size
