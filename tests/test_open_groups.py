"""`open_groups.OpenGroups` alone: where a restore reads a group's rows, the restore itself, a group
left stale and read as a later call reads it, a slot's reset. The state's use of it (accept,
abandon, the deferral) is in test_state.py and test_speculative.py."""

from __future__ import annotations

import torch

from dsv41_decode.open_groups import OpenGroups
from dsv41_decode.upload import HostUpload

LAYERS, SLOTS, DIM, HISTORY = (2, 8), 3, 4, 5


def _groups() -> OpenGroups:
    g = OpenGroups(LAYERS, SLOTS, DIM, HISTORY, torch.device("cpu"))
    for L in LAYERS:                      # position p of slot s holds the value 100 s + p (kv) and -(it) (score)
        for s in range(SLOTS):
            pos = list(range(7, 7 + HISTORY))
            vals = torch.tensor([[100.0 * s + p + L / 10] for p in pos]).expand(-1, DIM)
            g.keep_rows(L, s, pos, torch.cat([vals, -vals], dim=1))
    return g


def _row(L: int, s: int, p: int) -> torch.Tensor:
    return torch.full((DIM,), 100.0 * s + p + L / 10)


def test_rows_of_a_group_at_a_length_and_of_a_fresh_group():
    g = _groups()
    assert g.row(1, 9) == (1, 1, 1, 9 % HISTORY)
    assert g.at_length(2, 10) == [(2, 1, 2, 9 % HISTORY), (2, 0, 2, 8 % HISTORY)]
    assert g.at_length(0, 1) == [(0, 0, 0, 0), (0, 1, SLOTS, 0)]     # position -1: the fresh group's row


def test_restore_copies_every_source_and_leaves_the_other_slots():
    g, up = _groups(), HostUpload(torch.device("cpu"), slot_bytes=4096)
    before = {L: (g.kv[L].clone(), g.score[L].clone()) for L in LAYERS}
    g.restore(g.at_length(1, 11) + g.at_length(2, 1), up)
    for L in LAYERS:
        assert torch.equal(g.kv[L][1, 10 % 2], _row(L, 1, 10)) and torch.equal(g.kv[L][1, 9 % 2], _row(L, 1, 9))
        assert torch.equal(g.score[L][1, 0], -_row(L, 1, 10))
        assert torch.equal(g.kv[L][2, 0], _row(L, 2, 10))       # position 0's row p % 5 = 0, which p = 10 holds
        assert torch.equal(g.kv[L][2, 1], torch.zeros(DIM))                                 # a fresh group's
        assert torch.equal(g.score[L][2, 1], torch.full((DIM,), float("-inf")))
        assert torch.equal(g.kv[L][0], before[L][0][0]) and torch.equal(g.score[L][0], before[L][1][0])


def test_a_stale_group_reads_as_restored_until_sync_then_is():
    g, up = _groups(), HostUpload(torch.device("cpu"), slot_bytes=4096)
    g.leave(1)
    lengths = [0, 11, 0]
    kv, score = g.read(8, 1, lengths[1])
    assert torch.equal(kv[0], _row(8, 1, 10)) and torch.equal(score[1], -_row(8, 1, 9))
    assert torch.equal(g.kv[8][1], torch.zeros(2, DIM))                # not restored yet
    g.sync(lengths, up)
    assert not g.stale
    assert torch.equal(g.kv[8][1], kv) and torch.equal(g.score[8][1], score)
    g.leave(1)
    g.leave(2)
    g.settle([0, 1])
    assert g.stale == {2}


def test_reset_gives_a_fresh_group_and_no_rows():
    g, up = _groups(), HostUpload(torch.device("cpu"), slot_bytes=4096)
    g.restore(g.at_length(2, 9), up)
    g.leave(2)
    g.reset(2)
    assert not g.stale
    for L in LAYERS:
        assert torch.equal(g.kv[L][2], torch.zeros(2, DIM))
        assert bool((g.score[L][2] == float("-inf")).all())
        assert torch.equal(g.rows[L][2, :, :DIM], torch.zeros(HISTORY, DIM))
        assert bool((g.rows[L][2, :, DIM:] == float("-inf")).all())
        assert torch.equal(g.rows[L][1, 0, :DIM], _row(L, 1, 10))      # another slot's rows stay


def test_nbytes_counts_the_groups_and_the_rows():
    g = _groups()
    assert g.nbytes() == SLOTS * 2 * len(LAYERS) * 2 * DIM * 4 + (SLOTS + 1) * HISTORY * len(LAYERS) * 2 * DIM * 4


def test_without_history_nothing_is_kept_or_restored():
    g = OpenGroups(LAYERS, SLOTS, DIM, 0, torch.device("cpu"))
    g.keep_rows(2, 0, [0], torch.ones(1, 2 * DIM))
    g.restore([g.row(0, -1)], HostUpload(torch.device("cpu"), slot_bytes=4096))
    assert g.rows == {} and torch.equal(g.kv[2], torch.zeros(SLOTS, 2, DIM))
    assert g.nbytes() == SLOTS * 2 * len(LAYERS) * 2 * DIM * 4
