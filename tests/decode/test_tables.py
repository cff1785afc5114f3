"""StepMeta.derive (one table kernel + one batched RoPE) against its readable torch form."""

import pytest
import torch

from dsv41_decode.config import ModelConfig
from dsv41_decode.decode.tables import StepMeta
from dsv41_decode.state import DecodeState

_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("rows, bucket, max_drafts", [([("a", 1)], 1, 0), ([("a", 3), ("b", 1), ("c", 2)], 8, 0),
                                                      ([("b", 4), ("c", 1)], 5, 0), ([("b", 4), ("c", 4)], 8, 3)])
def test_derive_equals_reference(rows, bucket, max_drafts):
    cfg = ModelConfig.preset("small")                    # ratios 1 and 2, window 32 (ring 32 + max_drafts)
    st = DecodeState(cfg, max_requests=4, max_context=512, page_size=8, device=_DEVICE, stage_rows=8,
                     max_drafts=max_drafts)
    for req, n in (("a", 0), ("b", 45), ("c", 301)):     # empty, window not full, wrapped + pages
        st.admit(req)
        if n:
            st.advance(st.plan([(req, n)]))
    meta = StepMeta(cfg, st, 8)
    meta.load(st.plan(rows), bucket)                     # rows past the step's: padding
    meta.derive(bucket)
    ref = meta.derive_reference(bucket)
    got = {"window_table": meta.window_table, "stage_slot": meta.stage_slot, "ring_dst": meta.ring_dst,
           "kernel_slot": meta.kernel_slot}
    for r in st.ratios:
        got.update({f"n_vis{r}": meta.n_vis[r], f"entry_slot{r}": meta.entry_slot[r],
                    f"group_cos{r}": meta.group_cos[r], f"group_sin{r}": meta.group_sin[r]})
    for r in meta.cos:
        got.update({f"cos{r}": meta.cos[r], f"sin{r}": meta.sin[r]})
    assert set(got) == set(ref)
    for name, want in ref.items():
        assert torch.equal(got[name][:bucket], want), name
    n = sum(c for _, c in rows)
    assert bool((meta.window_table[n:bucket] == -1).all()) and bool((meta.stage_slot[n:bucket] == -1).all())
    assert bool((meta.entry_slot[1][:n] >= 0).all())     # every ratio-1 row completes an entry
    step = st.plan(rows)   # the cached positions' window-table entries are the state's ring slots
    for i in range(step.n_requests):
        r0, start = step.row_start[i], step.starts[i]
        q = torch.arange(step.positions[r0] - cfg.window_size + 1, start, device=_DEVICE)
        q = q[q >= 0]
        slots = st.window_slots(step.req_slot[r0].expand(len(q)), q)
        assert torch.equal(meta.window_table[r0, cfg.window_size - 1 - len(q):cfg.window_size - 1].long(), slots)
