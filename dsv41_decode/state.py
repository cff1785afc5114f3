"""The decode state of many requests for one attention stack: caches, compressor state, rows.

`DecodeState` owns every cache buffer of the stack, allocated once at construction from explicit
capacities (spec sections 2, 3 and 6):

- a window ring per layer (every layer has one): 528-byte MXFP8 records, `M = W + max_drafts`
  slots per request slot (`W = window_size`); position p of request slot s lives at ring slot
  `s * M + p % M`;
- for each KV source (kind "full") of ratio r: a paged compressed-KV cache (288-byte NVFP4 records)
  and a paged index-key cache (68-byte MXFP4 records), both addressed through the block table of
  ratio r, which the KV sources of that ratio share (they complete their entries on the same
  tokens, so one page list per request serves them all);
- the open-group state of each ratio-2 compressor (spec section 3, step 4) and, when the state
  takes drafts, the compressor's last `max_drafts + 2` input rows per request, which `accept`
  restores the open group from (`open_groups.OpenGroups`: the buffers and the restore; the state
  decides which slots and positions, and when);
- the tokens held per request slot, on the host and mirrored on the device (`seq_lens`).

A call's rows are `rows.StepRows`; a capacity that would be exceeded raises `rows.CapacityError`.
The generic path's reads and writes of single records (`write_window`, `read_window`,
`write_compressor_rows`, `entry_slots`, `write_entries`, `read_entries`) and the argument checks
are `cache_io.CacheIO`'s, a base class of `DecodeState`.

Only the block tables (int32) grow with `max_context`; the record pools are sized by `max_tokens`,
the total held over all live requests, plus one partly-filled page per request slot and ratio.

A call (a prefill chunk or a decode step) is `plan()`ned, run through every layer, then
`advance()`d. Between the two, the call's rows are *pending*: layers may write the window records
and completed compressed entries of the planned positions, and read them back. After `advance`,
`accept({req: kept})` keeps only the first `kept` rows of a request's call (speculative decoding:
the sampler accepted a prefix of the 1 + d rows) and leaves the state a run fed only the kept rows
would hold (spec decision 12). A call that fails between its plan and its advance is `abandon`ed.
"""

from __future__ import annotations

import copy
import heapq
import uuid
from typing import Hashable, Mapping, Sequence

import numpy as np
import torch

from .config import FULL, ModelConfig
from .cache_io import CacheIO
from .records import COMPRESSED_KV_BYTES, INDEX_KEY_BYTES, WINDOW_KV_BYTES
from .open_groups import OpenGroups
from .ops.checks import require_device
from .rows import CapacityError, StepRows, as_count
from .upload import HostUpload


def abandon_after(state: "DecodeState", step: "StepRows", err: BaseException) -> None:
    """`state.abandon(step)` for a call that raised `err`, which the caller then re-raises: where
    the state cannot abandon it (the call's own hooks advanced or replaced the plan), err keeps
    that reason as a note (Python >= 3.11) instead of being replaced by it."""
    try:
        state.abandon(step)
    except Exception as why:
        if hasattr(err, "add_note"):
            err.add_note(f"(the call could not be abandoned: {why})")


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def free_bytes(device: torch.device) -> int | None:
    """Memory a new allocation on `device` can take: on CUDA the device's free bytes plus what
    torch's caching allocator holds unused (reserved, not allocated: freed tensors it reuses), the
    host's MemAvailable (Linux /proc/meminfo) for the CPU; None where neither is known."""
    if device.type == "cuda":
        return (torch.cuda.mem_get_info(device)[0] + torch.cuda.memory_reserved(device)
                - torch.cuda.memory_allocated(device))
    if device.type == "cpu":
        try:
            with open("/proc/meminfo") as f:
                for line in f:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
        except (OSError, ValueError, IndexError):
            return None
    return None


class DecodeState(CacheIO):
    """Caches and bookkeeping of up to `max_requests` live requests for one attention stack.

    cfg: the model configuration; its `plan` decides which layers own compressed caches.
    max_requests: request slots (the most requests live at once).
    max_context: the most tokens one request may hold; sizes only the block tables.
    max_tokens: the most tokens held over all live requests together (default
        `max_requests * max_context`); sizes the page pools. It is not checked on its own: a call
        fails with `CapacityError` when the pages it needs are not free.
    page_size: compressed entries per page.
    stage_rows: window records past the rings, where a decode step stages its own rows' records
        (row i at `stage_base + i`) until its attention has read the old ring slots they replace
        (a request's later rows would otherwise overwrite positions its earlier rows still see).
    max_drafts: the most rows of one request's call that `accept` may reject (0: every row is
        committed). Each ring gets `max_drafts` extra slots, so that the rows a call writes past the
        kept ones never overwrite the W positions the kept length still needs, and the ratio-2
        compressors keep their last `max_drafts + 2` input rows per request (`comp_rows`).
    device: where every buffer lives.

    Buffers (allocated here - comp_kv, comp_score and comp_rows by `open_groups.OpenGroups`, whose
    views they are - never reallocated; all on `device`):
      window[L]: uint8 [max_requests * M + stage_rows, 528] for every layer L (`M = ring_size =
        W + max_drafts`): the rings, then the staging rows from `stage_base = max_requests * M`.
      compressed[L]: uint8 [pages_r * page_size, 288] for every KV source L of ratio r.
      index_keys[L]: uint8 [pages_r * page_size, 68] for every KV source L of ratio r.
      block_table[r]: int32 [max_requests, ceil(max_context / r / page_size)], -1 where unallocated;
        entry j of request slot s lives at global slot
        `block_table[r][s, j // page_size] * page_size + j % page_size`.
      comp_kv[L]: float32 [max_requests, 2, head_dim], zeros; comp_score[L]: float32
        [max_requests, 2, head_dim], -inf: the open group of every ratio-2 KV source L, row `p % 2`;
        reset when a slot is admitted. Views of one buffer over all ratio-2 sources (any strides
        but the last), so that `accept` restores every layer's in one indexed copy. After
        `accept(defer=True)` a request's rows here wait for its next call (or `sync`; `open_group`
        reads them as that call will).
      comp_rows[L] (max_drafts > 0 only): float32 [max_requests, max_drafts + 2, 2 * head_dim]: the
        FP32 inputs `kv | score` of the compressor's rows at positions p, at row `p % (max_drafts
        + 2)`, written by every call that runs the source (the generic layer and the step's
        compressor kernel alike), reset with the open group when a slot is admitted; the step's
        compressor kernel reads each call's open groups from here.
      seq_lens: int32 [max_requests], the tokens each slot held after the last `advance`, eager
        `accept` or `sync` (0 for a free slot; a deferred accept's lengths arrive with the next of
        those); the host-side `length()` is the source of truth.
    with `pages_r = ceil(max_tokens / r / page_size) + max_requests`.

    The host tables a call writes to the device (its rows' slots and positions, at their first read
    from the `StepRows`; new block-table entries, `seq_lens`, the rows `accept` restores) go
    through pinned host memory (`upload.HostUpload`), ordered on the current stream (the rows' at
    their first read): `plan`, `advance` and `accept` enqueue their device work and never wait for
    the device.

    The constructor refuses (CapacityError, naming the sizes) caches larger than the device's free
    memory (`free_bytes`) before it allocates any.
    """

    def __init__(self, cfg: ModelConfig, max_requests: int, max_context: int,
                 max_tokens: int | None = None, page_size: int = 64,
                 device: str | torch.device = "cpu", stage_rows: int = 64, max_drafts: int = 0) -> None:
        if not isinstance(cfg, ModelConfig):
            raise TypeError(f"DecodeState: cfg must be a ModelConfig (e.g. ModelConfig.preset(name)), got a "
                            f"{type(cfg).__name__}")
        for name, v in (("max_requests", max_requests), ("max_context", max_context),
                        ("page_size", page_size)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"DecodeState: {name} must be a positive integer, got {v!r}")
        if not isinstance(stage_rows, int) or isinstance(stage_rows, bool) or stage_rows < 0:
            raise ValueError(f"DecodeState: stage_rows must be a non-negative integer, got {stage_rows!r}")
        if not isinstance(max_drafts, int) or isinstance(max_drafts, bool) or max_drafts < 0:
            raise ValueError(f"DecodeState: max_drafts must be a non-negative integer, got {max_drafts!r}")
        if max_tokens is None:
            max_tokens = max_requests * max_context
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise ValueError(f"DecodeState: max_tokens must be a positive integer, got {max_tokens!r}")

        self.cfg = cfg
        self.layer_plan = cfg.plan
        self.max_requests = max_requests
        self.max_context = max_context
        self.max_tokens = max_tokens
        self.page_size = page_size
        self.device = require_device(device, "DecodeState: device")
        self.window_size = cfg.window_size
        self.head_dim = cfg.head_dim
        self.stage_rows = stage_rows
        self.max_drafts = max_drafts
        self.ring_size = cfg.window_size + max_drafts
        self.stage_base = max_requests * self.ring_size
        # rows of compressor input kept per request: the kept length's last two positions survive
        # any call that rejects at most max_drafts rows (spec decision 12)
        self.comp_history = max_drafts + 2 if max_drafts else 0

        M, dev = self.ring_size, self.device
        self.kv_sources: tuple[int, ...] = tuple(
            s.layer for s in self.layer_plan if s.kind == FULL)
        self.ratios: tuple[int, ...] = tuple(sorted({cfg.ratio(L) for L in self.kv_sources}))
        self.n_pages: dict[int, int] = {
            r: _cdiv(max_tokens, r * page_size) + max_requests for r in self.ratios}
        # the caches' shapes: window ring rows, pool slots per ratio, block-table columns per ratio;
        # their bytes against the device's free memory before any is allocated: a refusal naming the
        # sizes, not an allocator's error (or, on a host that overcommits, the process killed while
        # the zeros are written)
        window_rows = max_requests * M + stage_rows
        pool_slots = {r: n * page_size for r, n in self.n_pages.items()}
        table_cols = {r: _cdiv(max_context, r * page_size) for r in self.ratios}
        need = (len(self.layer_plan) * window_rows * WINDOW_KV_BYTES
                + sum(pool_slots[cfg.ratio(L)] * (COMPRESSED_KV_BYTES + INDEX_KEY_BYTES) for L in self.kv_sources)
                + sum(max_requests * cols * 4 for cols in table_cols.values()))
        free = free_bytes(dev)
        if free is not None and need > free:
            raise CapacityError(
                f"DecodeState: its caches take {need / 2**30:.2f} GiB (max_requests={max_requests}, "
                f"max_context={max_context}, max_tokens={max_tokens}, page_size={page_size}), more than the "
                f"{free / 2**30:.2f} GiB free on {dev}")

        self.window: dict[int, torch.Tensor] = {
            s.layer: torch.zeros(window_rows, WINDOW_KV_BYTES, dtype=torch.uint8, device=dev)
            for s in self.layer_plan}
        self.compressed: dict[int, torch.Tensor] = {}
        self.index_keys: dict[int, torch.Tensor] = {}
        for L in self.kv_sources:
            slots = pool_slots[cfg.ratio(L)]
            self.compressed[L] = torch.zeros(slots, COMPRESSED_KV_BYTES, dtype=torch.uint8, device=dev)
            self.index_keys[L] = torch.zeros(slots, INDEX_KEY_BYTES, dtype=torch.uint8, device=dev)
        self._groups = OpenGroups([L for L in self.kv_sources if cfg.ratio(L) == 2], max_requests,
                                  self.head_dim, self.comp_history, dev)
        self.comp_kv = self._groups.kv
        self.comp_score = self._groups.score
        self.comp_rows = self._groups.rows
        self.block_table: dict[int, torch.Tensor] = {
            r: torch.full((max_requests, cols), -1, dtype=torch.int32, device=dev) for r, cols in table_cols.items()}
        self.seq_lens = torch.zeros(max_requests, dtype=torch.int32, device=dev)
        # a slot holds the largest table of a call of up to stage_rows rows: its rows' slots and
        # positions (16 B a row), a ratio's new pages (16 B each, at most 2 a row), the restored
        # rows of accept (64 B a request)
        self._upload = HostUpload(dev, slot_bytes=max(4096, 64 * max_requests, 32 * stage_rows))

        # Host bookkeeping. Slots are handed out lowest first; pages from a LIFO free list.
        self._req_slot: dict[Hashable, int] = {}
        self._slot_req: list[Hashable | None] = [None] * max_requests
        self._free_slots: list[int] = list(range(max_requests))
        self._lengths: list[int] = [0] * max_requests
        self._pending: list[int] = [0] * max_requests  # rows of the planned, not yet advanced call
        # (this state's id, plan number) of the last plan() not yet advanced (check_step)
        self._plan_key: tuple[str, int] = (uuid.uuid4().hex, 0)
        self._planned: tuple | None = None
        self._accepting: dict[int, tuple[int, int]] = {}  # slot -> (start, count) of the last advanced call
        self._stale_mirror = False              # seq_lens behind the lengths since a deferred accept
        self._pages: dict[int, list[list[int]]] = {
            r: [[] for _ in range(max_requests)] for r in self.ratios}
        self._free_pages: dict[int, list[int]] = {
            r: list(range(n - 1, -1, -1)) for r, n in self.n_pages.items()}
        # 1 + the highest position written through write_window since admission, per layer (row
        # _window_row[L]) and slot: the ring has lost every position below it minus W, whatever the
        # lengths say. One array, so that a slot's column is reset or cut in one operation.
        self._window_row: dict[int, int] = {L: i for i, L in enumerate(self.window)}
        self._window_hi = np.zeros((len(self.window), max_requests), dtype=np.int64)
        # slot -> rows of the abandoned call that overwrote what the slot's next call would read
        self._lost: dict[int, int] = {}
        # the generic path wrote caches for the current plan (a plan() may not replace it then)
        self._written = False

    def __deepcopy__(self, memo) -> "DecodeState":
        """A snapshot: every tensor and table copied; a plan id of its own for the plans made after
        the copy (so neither state takes the other's later steps), the pending plan kept (so the
        snapshot can still advance the rows planned before it)."""
        twin = type(self).__new__(type(self))
        memo[id(self)] = twin
        for k, v in self.__dict__.items():
            setattr(twin, k, copy.deepcopy(v, memo))
        twin._plan_key = (uuid.uuid4().hex, self._plan_key[1])
        return twin

    # ----- requests -----
    def admit(self, req_id: Hashable) -> int:
        """Give `req_id` a free request slot holding 0 tokens and return the slot.

        The slot's compressor state is reset; its window ring and pages are not cleared (reads are
        guarded by lengths). Raises ValueError for an id already live, CapacityError when all
        `max_requests` slots are in use. An id is any hashable but None (ValueError; TypeError for
        an unhashable one).
        """
        if req_id is None:
            raise ValueError("admit: None is not a request id (it marks a free slot); use any other hashable")
        try:
            hash(req_id)
        except TypeError:
            raise TypeError(f"admit: request ids must be hashable, got a {type(req_id).__name__}") from None
        if req_id in self._req_slot:
            raise ValueError(f"admit: request {req_id!r} is already live in slot "
                             f"{self._req_slot[req_id]}")
        if not self._free_slots:
            raise CapacityError(f"requests: all {self.max_requests} request slots are in use "
                                f"(max_requests={self.max_requests}); cannot admit {req_id!r}")
        s = heapq.heappop(self._free_slots)
        self._req_slot[req_id] = s
        self._slot_req[s] = req_id
        self._lengths[s] = 0
        self._pending[s] = 0
        self._accepting.pop(s, None)
        self._lost.pop(s, None)
        self._window_hi[:, s] = 0
        self._groups.reset(s)
        self.seq_lens[s] = 0
        return s

    def free(self, req_id: Hashable) -> None:
        """Release `req_id`'s slot and return its pages to the pools. KeyError for an unknown id."""
        s = self.slot(req_id)
        for r in self.ratios:
            self._give_back_pages(r, s, 0)
        del self._req_slot[req_id]
        self._slot_req[s] = None
        self._lost.pop(s, None)
        self._lengths[s] = 0
        self._pending[s] = 0
        self._accepting.pop(s, None)
        self._groups.settle((s,))
        self.seq_lens[s] = 0
        heapq.heappush(self._free_slots, s)

    def _give_back_pages(self, r: int, s: int, keep: int) -> None:
        """Slot s's pages of ratio r past its first `keep` back to the pool (last first, so the next
        allocations take them in entry order again); their block-table entries -1."""
        held = self._pages[r][s]
        self._free_pages[r].extend(reversed(held[keep:]))
        del held[keep:]
        self.block_table[r][s, keep:].fill_(-1)

    def slot(self, req_id: Hashable) -> int:
        """The request slot of live request `req_id`; KeyError naming it otherwise (TypeError for an
        unhashable id, as `admit`'s)."""
        try:
            return self._req_slot[req_id]
        except KeyError:
            raise KeyError(f"request {req_id!r} is not live in this DecodeState") from None
        except TypeError:
            raise TypeError(f"request ids must be hashable, got a {type(req_id).__name__}: {req_id!r}") from None

    def length(self, req_id: Hashable) -> int:
        """Tokens `req_id` holds (advanced calls only; a planned call is not counted)."""
        return self._lengths[self.slot(req_id)]

    @property
    def live_requests(self) -> tuple:
        """The live request ids, in admission order."""
        return tuple(self._req_slot)

    def free_pages(self, ratio: int) -> int:
        """Pages of `ratio` not held by any request."""
        self._check_ratio(ratio)
        return len(self._free_pages[ratio])

    def pages_of(self, req_id: Hashable, ratio: int) -> tuple[int, ...]:
        """The pages of `ratio` that `req_id` holds, in entry order (host copy of its table row)."""
        self._check_ratio(ratio)
        return tuple(self._pages[ratio][self.slot(req_id)])

    # ----- calls -----
    def plan(self, rows: Sequence[tuple[Hashable, int]]) -> StepRows:
        """Lay out one call's rows and allocate the pages of the entries the call completes.

        rows: (req_id, count) per request, in call order (a list, tuple or other ordered iterable of
            pairs; a count is a Python or numpy int); request i gets positions
            `length(req_id) .. length(req_id) + count - 1`.
        For each ratio r, a request holds pages for entries `0 .. (start + count) // r - 1` after
        this call. Either every page is allocated or, on an error, none: KeyError for an unknown id,
        ValueError for an empty call, a count < 1 or a request listed twice, CapacityError when a
        request would exceed `max_context` or a ratio's free pages do not suffice.
        A new plan replaces an earlier one that was not advanced: that plan's requests keep the
        pages of their lengths (or of this call), the rest of what it allocated goes back to the
        pools (and counts as free for this call).
        """
        if isinstance(rows, (dict, str, bytes, set, frozenset)):   # a set has no call order
            raise ValueError(f"plan: rows must be a list of (req_id, count) pairs, got a {type(rows).__name__}"
                             + (" (list(rows.items()) makes one)" if isinstance(rows, dict) else ""))
        if not isinstance(rows, (list, tuple)):
            try:
                it = iter(rows)
            except TypeError:
                raise ValueError(f"plan: rows must be a list of (req_id, count) pairs, got a "
                                 f"{type(rows).__name__}") from None
            rows = list(it)
        if len(rows) == 0:
            raise ValueError("plan: the call has no rows")
        if self._planned is not None and self._written:
            raise ValueError("plan: the current plan's layers have written the caches, and it was neither advanced "
                             "nor abandoned (a plan() from inside a forward: its FFN hook or observer?)")
        ids, counts, starts, slots = [], [], [], []
        seen = set()
        for entry in rows:
            try:
                if entry.__class__ is str:
                    raise TypeError
                req_id, count = entry
            except (TypeError, ValueError):
                raise ValueError(f"plan: rows entries must be (req_id, count) pairs, got {entry!r}") from None
            s = self.slot(req_id)
            if req_id in seen:
                raise ValueError(f"plan: request {req_id!r} is listed twice in one call")
            if s in self._lost:
                raise ValueError(
                    f"plan: request {req_id!r} lost cached rows in an abandoned call of {self._lost[s]} rows "
                    f"(they overwrote window records or the open compressor group that its next rows read; "
                    f"max_drafts={self.max_drafts}): free it and prefill it again")
            n = as_count(count)
            if n is None or n < 1:
                raise ValueError(f"plan: request {req_id!r} has count {count!r}; need an integer >= 1 "
                                 f"(a Python or numpy int)")
            count = n
            start = self._lengths[s]
            if start + count > self.max_context:
                raise CapacityError(
                    f"context: request {req_id!r} would hold {start + count} tokens ({start} cached "
                    f"+ {count} new), more than max_context={self.max_context}")
            seen.add(req_id)
            ids.append(req_id)
            counts.append(count)
            starts.append(start)
            slots.append(s)

        # the requests of a replaced plan (planned, not advanced) go back to the pages their
        # lengths need: the pages it allocated for its rows count as free for this call
        replaced = [s for s, c in enumerate(self._pending) if c] if self._planned is not None else ()
        grants: dict[int, list[tuple[int, int]]] = {}  # ratio -> (slot, pages to add)
        trims: dict[int, list[tuple[int, int]]] = {}   # ratio -> (slot, pages to keep)
        for r in self.ratios:
            keep = [(s, _cdiv((start + count) // r, self.page_size)) for s, start, count in zip(slots, starts, counts)]
            if replaced:
                call = set(slots)
                keep += [(s, _cdiv(self._lengths[s] // r, self.page_size)) for s in replaced if s not in call]
            need, todo, back = 0, [], []
            for s, want in keep:
                have = len(self._pages[r][s])
                if want > have:
                    need += want - have
                    todo.append((s, want - have))
                elif want < have:
                    back.append((s, want))
            free = len(self._free_pages[r]) + sum(len(self._pages[r][s]) - want for s, want in back)
            if need > free:
                raise CapacityError(
                    f"pages of ratio {r}: the call needs {need} more page(s) but only {free} of "
                    f"{self.n_pages[r]} are free (page_size={self.page_size}, "
                    f"max_tokens={self.max_tokens})")
            grants[r], trims[r] = todo, back
        for r, todo in grants.items():
            table = self.block_table[r]
            for s, want in trims[r]:
                self._give_back_pages(r, s, want)
            t_flat, t_pages = [], []      # flat index of (slot, column) in the table, page
            for s, n in todo:
                held = self._pages[r][s]
                for _ in range(n):
                    t_flat.append(s * table.shape[1] + len(held))
                    held.append(self._free_pages[r].pop())
                    t_pages.append(held[-1])
            if t_flat:
                grant = self._upload.tensor([t_flat, t_pages], torch.int64)
                table.view(-1).index_copy_(0, grant[0], grant[1].to(torch.int32))

        self._pending = [0] * self.max_requests
        self._accepting = {}   # a new call: the last one can no longer be accepted
        row_start, n = [], 0
        for s, count in zip(slots, counts):
            self._pending[s] = count
            row_start.append(n)
            n += count
        self._plan_key = (self._plan_key[0], self._plan_key[1] + 1)
        self._planned = self._plan_key
        self._written = False
        return StepRows(req_ids=tuple(ids), counts=tuple(counts), starts=tuple(starts), row_start=tuple(row_start),
                        plan_key=self._plan_key, slots=tuple(slots), upload=self._upload)

    def check_step(self, step: StepRows, what: str = "step") -> list[int]:
        """Raise unless `step` is this state's current plan; return its requests' slots.

        KeyError when one of its requests was freed; ValueError when it is stale (advanced already: a
        request's length no longer equals its start), planned by another DecodeState, replaced by a
        later `plan()`, or when a request was re-admitted since. Reads host bookkeeping only, so
        callers check before they write any cache (`AttentionStack.forward`, `advance`).
        """
        if not isinstance(step, StepRows):
            raise TypeError(f"{what}: expected the StepRows of DecodeState.plan, got {type(step).__name__}")
        slots = [self.slot(req_id) for req_id in step.req_ids]
        for req_id, s, start in zip(step.req_ids, slots, step.starts):
            if self._lengths[s] != start:
                raise ValueError(f"{what}: stale step: request {req_id!r} holds "
                                 f"{self._lengths[s]} tokens but the step starts at {start}")
        if step.plan_key != self._planned:
            raise ValueError(f"{what}: the step is not this state's current plan (planned by another "
                             f"DecodeState, or replaced by a later plan())")
        for req_id, s, count in zip(step.req_ids, slots, step.counts):
            if self._pending[s] != count:
                raise ValueError(f"{what}: request {req_id!r} was freed or re-admitted after the step was planned")
        return slots

    def advance(self, step: StepRows) -> None:
        """Commit a planned call after every layer ran: each request's length += its count. The
        call's layers read and rewrote its requests' open groups (`sync` or the step's
        compressor kernels, which read them from `comp_rows`): none is left to restore.

        `check_step` first (nothing changes on an error): ValueError when `step` is stale or not the
        current plan, KeyError when one of its requests was freed.
        """
        slots = self.check_step(step, "advance")
        self._planned = None
        self._written = False
        self._groups.settle(slots)
        for s, start, count in zip(slots, step.starts, step.counts):
            self._lengths[s] += count
            self._pending[s] = 0
            self._accepting[s] = (start, count)
        self._mirror_lengths()

    def abandon(self, step: StepRows, *, ran: bool = True) -> None:
        """Undo a planned call that will not be advanced: its layers stopped midway (an exception in
        `AttentionStack.forward` or a step's call, which call this before they re-raise).

        `step` must be the current plan (ValueError otherwise); a request freed since the plan is
        skipped. Each other request of the call keeps its length; what a retry of its rows (or any
        later call) reads is restored, as `accept` restores it for rejected rows (spec decision
        12): the window ring's positions `length - W + 1 .. length - 1`, the ratio-2 compressors'
        open group (from `comp_rows`), the pages of its length (the rest go back to the pools).
        Where the call's rows overwrote one of those - a ring slot of a cached position from
        `length - W + 1` on (more than `max_drafts + 1` rows after a cached token), or the open
        group's first row (an odd length, at least `max_drafts + 2` rows; 2 without drafts) - the
        request has lost cached rows: a later `plan` of it raises ValueError naming it (free it and
        prefill it again). ran=False: the caller vouches that no layer of the call ran (nothing was
        written): the requests only give back the plan's pages and lose nothing (ValueError where the
        generic path's layers have written; the step's kernels write unseen by the state).
        """
        if not isinstance(step, StepRows):
            raise TypeError(f"abandon: expected the StepRows of DecodeState.plan, got {type(step).__name__}")
        if step.plan_key != self._planned:
            raise ValueError("abandon: the step is not this state's current plan (advanced, abandoned, planned by "
                             "another DecodeState, or replaced by a later plan())")
        if not ran and self._written:
            raise ValueError("abandon: ran=False, but the call's layers have written the caches")
        self._planned = None
        self._written = False
        self._accepting = {}
        H, M, W = self.comp_history, self.ring_size, self.window_size
        restore = []   # (slot, p % 2, source slot, p % H) of the rows a later call reads
        for req_id, s, start, count in zip(step.req_ids, step.slots, step.starts, step.counts):
            if self._slot_req[s] != req_id or self._pending[s] != count or self._lengths[s] != start:
                continue                                  # freed (and maybe re-admitted) since the plan
            self._pending[s] = 0
            self._cut_to(s, start)
            if not ran:
                continue                                  # nothing written: nothing overwritten (a group left
                                                          # to restore still is)
            self._groups.settle((s,))                     # restored below, or the request is lost
            # the call's rows took the ring slots of positions start - M .. start + count - 1 - M, of
            # which a later call reads the cached ones from start - W + 1 on; the open group's row
            # start - 1 (odd start) sits in comp slot (start - 1) % 2, which row start + 1 overwrote,
            # and in comp_rows row (start - 1) % H, which row start - 1 + H overwrote
            ring_lost = start > 0 and start + count - 1 - M >= max(0, start - W + 1)
            group_lost = bool(self.comp_kv) and start % 2 == 1 and count >= (H if H else 2)
            if ring_lost or group_lost:
                self._lost[s] = count
                continue
            # position p's compressor row is held at p % H unless the call overwrote it (p + H is
            # one of its rows); start - 1 survives here, start - 2 is read by no later call
            restore += [self._groups.row(s, p) for p in (start - 1, start - 2) if p < 0 or p + H >= start + count]
        self._groups.restore(restore, self._upload)

    def _cut_to(self, s: int, n: int) -> None:
        """Slot s back to n tokens in what the generic path's ring reads (its high-water mark) and
        in pages (those past n's entries go back to the pools)."""
        col = self._window_hi[:, s]
        np.minimum(col, n, out=col)
        for r in self.ratios:
            want = _cdiv(n // r, self.page_size)
            if len(self._pages[r][s]) > want:
                self._give_back_pages(r, s, want)

    def _mirror_lengths(self) -> None:
        """Upload the host lengths into `seq_lens` (none is then left to a deferred accept)."""
        self._stale_mirror = False
        self._upload.copy_(self.seq_lens, self._lengths)

    def accept(self, kept: Mapping[Hashable, int], *, defer: bool = False) -> None:
        """Keep only the first `kept[req]` rows of each listed request's last advanced call.

        Speculative decoding: a call scored 1 + d rows of a request (its next token and d drafts)
        and the sampler accepted a prefix of them. kept: {req_id: rows kept}, each a Python or numpy
        int in `count - max_drafts .. count` and >= 1; requests not listed keep every row. Afterwards the
        state is what a run that only ever saw the kept rows holds, in everything a later call
        reads (spec decision 12): the request's length is `start + kept`; the window ring holds
        positions `length - W .. length - 1` (the rejected rows' records sit in ring slots of
        positions below `length - W`, or of positions >= length, rewritten before they are read);
        compressed entries and index keys that rejected rows published lie at entries >= length // r
        (rewritten when their positions come again) and the pages past the kept entries go back to
        the pools; each ratio-2 compressor's open group (both rows, bit for bit) is restored from
        `comp_rows`. Device work: one small host-to-device copy, one gather and one indexed copy
        over every ratio-2 source, per ratio a `block_table[r][slot, pages:].fill_(-1)` for each
        request whose pages go back, the `seq_lens` mirror; nothing waits for the device.

        defer=True (what `decode.DecodeStep.accept` passes when its stack runs every ratio-2
        source): the device work is left to the next call - the step's compressor kernels read a
        call's requests' open groups from `comp_rows` themselves, the generic layer
        (`AttentionLayer.forward`) runs `sync` first, and the next `advance` uploads `seq_lens` - so
        `comp_kv` / `comp_score` hold what the call left (its rejected rows' values among them) for
        those requests until each one's next call or `sync`, and `seq_lens` the lengths before the
        accept until the next `advance`, eager accept or `sync`. What is left on the device: a
        block-table fill where a request's pages go back.

        Once per call and request: the next `plan` (or a second `accept` of the request) ends it.
        KeyError for a request that is not live; ValueError for a request that was not in the last
        advanced call, a kept count that is not an integer or outside `1 .. count`, or more rejected
        rows than `max_drafts`; TypeError when kept is not a mapping. Nothing changes on an error.
        """
        if not isinstance(kept, Mapping):
            raise TypeError(f"accept: kept must be a mapping {{req_id: rows kept}}, got a {type(kept).__name__}")
        if not isinstance(defer, bool):
            raise TypeError(f"accept: defer must be a bool, got {defer!r}")
        todo = []
        for req_id, k in kept.items():
            s = self.slot(req_id)
            if s not in self._accepting:
                raise ValueError(f"accept: request {req_id!r} was not in the last advanced call "
                                 f"(or its rows were already accepted); accept after advance, "
                                 f"before the next plan")
            start, count = self._accepting[s]
            n = as_count(k)
            if n is None:
                raise ValueError(f"accept: request {req_id!r} keeps {k!r} rows; need an integer (a Python "
                                 f"or numpy int) in 1..{count}")
            if not 1 <= n <= count:
                raise ValueError(f"accept: request {req_id!r} keeps {k!r} rows; its call had {count} "
                                 f"rows and keeps 1..{count}")
            k = n
            if count - k > self.max_drafts:
                raise ValueError(f"accept: request {req_id!r} rejects {count - k} of its {count} rows, "
                                 f"more than max_drafts={self.max_drafts} (build the DecodeState with "
                                 f"max_drafts >= {count - k})")
            todo.append((s, start + k, start + count))
        restore = []   # (slot, p % 2, source slot, p % H) of the open group's two rows
        changed = False
        for s, n, old in todo:
            self._accepting.pop(s)
            if n == old:
                continue
            changed = True
            self._lengths[s] = n
            self._cut_to(s, n)
            if defer:
                self._groups.leave(s)
            else:
                restore += self._groups.at_length(s, n)
        self._groups.restore(restore, self._upload)
        if changed and defer:
            self._stale_mirror = True
        elif changed:
            self._mirror_lengths()

    def open_group(self, layer: int, req_slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(kv, score), float32 [2, head_dim] each (row p % 2): ratio-2 source `layer`'s open group of
        `req_slot` as a later call reads it - `comp_kv` / `comp_score`, or, where a deferred accept
        left the group to restore, the rows `sync` would copy there (after an abandoned call
        a row no later output reads may differ from the step's view: spec decision 12). Copies;
        nothing changes."""
        r = self._check_source(layer, "open_group")
        if r != 2:
            raise ValueError(f"open_group: layer {layer} has ratio {r}; only ratio-2 compressors keep an open group")
        self._check_slot(req_slot, "open_group")
        return self._groups.read(layer, req_slot, self._lengths[req_slot])

    def sync(self) -> None:
        """Do the device work that `accept(defer=True)` left: restore the open groups (each
        request's last two positions' rows from `comp_rows`, as `accept` copies them) and upload
        `seq_lens`; afterwards `comp_kv` / `comp_score` hold every live request's group and
        `seq_lens` its length. Device work only where some is left (one upload, one gather, one
        indexed copy; one upload); the generic layer (`AttentionLayer.forward`) runs it before it reads."""
        if self._stale_mirror:
            self._mirror_lengths()
        self._groups.sync(self._lengths, self._upload)

    # ----- reporting -----
    def memory_bytes(self) -> dict[str, int]:
        """Bytes per buffer family: window, compressed, index_keys, compressor (comp_kv +
        comp_score + comp_rows), tables (block tables + seq_lens)."""
        def size(ts) -> int:
            return sum(t.numel() * t.element_size() for t in ts)
        return {
            "window": size(self.window.values()),
            "compressed": size(self.compressed.values()),
            "index_keys": size(self.index_keys.values()),
            "compressor": self._groups.nbytes(),
            "tables": size(self.block_table.values()) + size([self.seq_lens]),
        }

    def describe(self) -> str:
        """A few lines: capacities, pools per ratio and memory per buffer family (MB)."""
        mem = self.memory_bytes()
        lines = [f"DecodeState on {self.device}: {len(self._req_slot)}/{self.max_requests} requests "
                 f"live, max_context={self.max_context}, max_tokens={self.max_tokens}, "
                 f"page_size={self.page_size}, window={self.window_size} x {len(self.window)} layers"]
        for r in self.ratios:
            srcs = [L for L in self.kv_sources if self.cfg.ratio(L) == r]
            lines.append(f"  ratio {r}: {self.n_pages[r]} pages ({len(self._free_pages[r])} free), "
                         f"KV sources {srcs}")
        lines.append("  memory: " + ", ".join(f"{k} {v / 2**20:.2f} MB" for k, v in mem.items())
                     + f"; total {sum(mem.values()) / 2**20:.2f} MB")
        return "\n".join(lines)
