"""The Gluon tier's weight ring and what its linears share (sm_90): `gluon_mm.GluonMM`,
`gluon_wo_a`, `gluon_exact_mm` and `gluon_exact_fma` stream their weights through it.

- **The ring** (`ring`): STAGES shared-memory slots of a weight tile and an activation tile (their
  TMA descriptors' boxes), each with a `ready` mbarrier (completed by TMA's transaction bytes) and
  an `empty` one (the consumer hands the slot back); `producer` is the 1-warp TMA producer that
  fills it in K order.
- **The PDL prologue** (`ring_prefill`, then `producer_prefilled` or `ring_producer`): a kernel
  launched by programmatic dependent launch (`ops.pdl`) requests its first slots' weight tiles (the
  weights are constant data) before `griddepcontrol.wait`, optionally in two parts around a gate
  (`ops.pdl.gluon_gate_await`), and everything else after it; the same slots, tiles and barriers
  as the producer alone, so the same values.
- **Scale words** (`slot_words`, `scale_byte`, `scale_words`): a step's four UE8M0 bytes per row
  loaded as one 32-bit word and split by shifts.
- **Host checks and descriptors** shared by the plans (`tma_desc`, `fp8_desc`,
  `activation_operands`, `require_tma_rows`, `require_sm90_weight`, `require_maxnreg`,
  `SHARED_LIMIT`), each naming the argument it refuses.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from .common import is_sm90
from .pdl import gluon_gate_await, gluon_gate_close, gluon_wait

SHARED_LIMIT = 227 * 1024     # sm_90's dynamic shared memory per block


@gluon.jit
def ring(w_desc, x_desc, STAGES: gl.constexpr):
    """The Gluon tier's TMA ring in shared memory: STAGES slots of the weight's and the activation's
    descriptor tiles and a `ready` and an `empty` mbarrier per slot (initialized, count 1), as
    (w_smem, x_smem, ready, empty); `producer` fills it."""
    w_smem = gl.allocate_shared_memory(w_desc.dtype, [STAGES] + w_desc.block_type.shape, w_desc.layout)
    x_smem = gl.allocate_shared_memory(x_desc.dtype, [STAGES] + x_desc.block_type.shape, x_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    return w_smem, x_smem, ready, empty


@gluon.jit
def producer(w_desc, x_desc, w_smem, x_smem, ready, empty, off_n, x_row, x_col, step_lo, n_steps, c0,
             n_steps_total, STAGES: gl.constexpr, RETILED: gl.constexpr):
    """The 1-warp TMA producer of the Gluon tier's rings (`gluon_wo_a`, `gluon_exact_mm` run it too):
    step i's weight tile [BN, BLOCK_K] at (off_n, k) and activation tile [BLOCK_T, BLOCK_K] at
    (x_row, x_col + k), k = (step_lo + i) x BLOCK_K, into ring slot (c0 + i) % STAGES once the
    consumer has released it (c0: the slots the program filled before, for the persistent loop;
    else 0). RETILED: the weight descriptor is the plan's tile-contiguous copy ([N tiles x K steps x
    BN, BLOCK_K]: tile t's step s at row (t x n_steps_total + s) x BN)."""
    BN: gl.constexpr = w_desc.block_type.shape[0]
    for i in range(n_steps):
        c = c0 + i
        s = c % STAGES
        # A fresh barrier counts as having completed the phase before its first: the first pass
        # over the ring does not wait.
        mbarrier.wait(empty.index(s), ((c // STAGES) & 1) ^ 1)
        mbarrier.expect(ready.index(s), w_desc.block_type.nbytes + x_desc.block_type.nbytes)
        k = (step_lo + i) * w_desc.block_type.shape[1]
        if RETILED:
            tma.async_copy_global_to_shared(w_desc, [off_n * n_steps_total + (step_lo + i) * BN, 0], ready.index(s),
                                            w_smem.index(s))
        else:
            tma.async_copy_global_to_shared(w_desc, [off_n, k], ready.index(s), w_smem.index(s))
        tma.async_copy_global_to_shared(x_desc, [x_row, x_col + k], ready.index(s), x_smem.index(s))


@gluon.jit
def _request_weights(w_desc, x_desc, w_smem, ready, off_n, step_lo, n_steps, LO: gl.constexpr, HI: gl.constexpr,
                     SLOTS: gl.constexpr):
    """`ring_prefill`'s requests of the weight tiles of the ring's slots [LO, HI) (wait units of SLOTS
    slots, each unit's `ready` barrier expecting its weight and activation tiles' bytes at once)."""
    BK: gl.constexpr = w_desc.block_type.shape[1]
    for u in gl.static_range(LO // SLOTS, HI // SLOTS):
        if u * SLOTS < n_steps:
            mbarrier.expect(ready.index(u * SLOTS), SLOTS * (w_desc.block_type.nbytes + x_desc.block_type.nbytes))
            for t in gl.static_range(SLOTS):
                tma.async_copy_global_to_shared(w_desc, [off_n, (step_lo + u * SLOTS + t) * BK], ready.index(u * SLOTS),
                                                w_smem.index(u * SLOTS + t))


@gluon.jit
def ring_prefill(w_desc, x_desc, w_smem, ready, off_n, step_lo, n_steps, STAGES: gl.constexpr,
                 SLOTS: gl.constexpr = 1, PREFILL: gl.constexpr = 0, gate_ptr=None, gate_count=0,
                 GATE: gl.constexpr = False):
    """The prologue of a ring's kernel launched by programmatic dependent launch (`ops.pdl`), run by
    the whole program before it forks its producer: the weight tiles of the ring's first
    min(P, n_steps) slots (P = PREFILL, or STAGES where PREFILL is 0; steps step_lo, step_lo + 1,
    ...; the weight is constant data) are requested while the kernel before this one still runs,
    each wait unit's `ready` barrier (its first slot's) expecting its weight and activation tiles'
    bytes at once; then `griddepcontrol.wait`: everything after it may read what that kernel wrote.
    SLOTS: the ring's slots a wait unit (1, or 2 for `gluon_exact_mm`'s pair_slots, n_steps even;
    P a multiple of it). The producer (`producer_prefilled` with the same PREFILL, or
    `gluon_exact_mm`'s pair producer) then fills the rest: the same slots, tiles and barriers as its
    producer alone, so the same values.

    GATE (SLOTS 1): between the first P slots and the wait, the program waits at the gate
    (`ops.pdl.gluon_gate_await(gate_ptr, gate_count)`: until the kernel before this one has
    signalled gate_count times) and then requests the rest of the ring's slots, so that it asks for
    them once that kernel's programs are past their own reads; after the wait it closes the gate
    (`gluon_gate_close`). Every slot is then requested: the producer follows with PREFILL 0."""
    P: gl.constexpr = STAGES if PREFILL == 0 else PREFILL
    _request_weights(w_desc, x_desc, w_smem, ready, off_n, step_lo, n_steps, 0, P, SLOTS)
    if GATE:
        gl.static_assert(SLOTS == 1)
        gluon_gate_await(gate_ptr, gate_count)
        _request_weights(w_desc, x_desc, w_smem, ready, off_n, step_lo, n_steps, P, STAGES, 1)
    gluon_wait()
    if GATE:
        gluon_gate_close(gate_ptr)


@gluon.jit
def producer_prefilled(w_desc, x_desc, w_smem, x_smem, ready, empty, off_n, x_row, x_col, step_lo, n_steps,
                       STAGES: gl.constexpr, PREFILL: gl.constexpr = 0):
    """`producer` after `ring_prefill` (the same PREFILL): the activation tiles of the prefilled
    slots, then the ring from the first step past them (the slots `ring_prefill` left are fresh: the
    producer fills them as its first pass would). The producer warp waits for the predecessor
    itself first (the program's wait in `ring_prefill` already returned, so at once): its copies are
    ordered after the wait by its own instruction, not only by the fork."""
    gluon_wait()
    BK: gl.constexpr = w_desc.block_type.shape[1]
    P: gl.constexpr = STAGES if PREFILL == 0 else PREFILL
    for i in gl.static_range(P):
        if i < n_steps:
            tma.async_copy_global_to_shared(x_desc, [x_row, x_col + (step_lo + i) * BK], ready.index(i),
                                            x_smem.index(i))
    pre = gl.minimum(n_steps, P)
    producer(w_desc, x_desc, w_smem, x_smem, ready, empty, off_n, x_row, x_col, step_lo + pre, n_steps - pre, pre,
             n_steps, STAGES, False)


@gluon.jit
def ring_producer(w_desc, x_desc, w_smem, x_smem, ready, empty, off_n, x_row, x_col, step_lo, n_steps,
                  STAGES: gl.constexpr, PREFILLED: gl.constexpr, PREFILL: gl.constexpr = 0):
    """A ring kernel's producer partition over steps step_lo .. step_lo + n_steps - 1:
    `producer_prefilled` after the PDL launch's `ring_prefill` (PREFILLED; PREFILL as theirs), else
    `producer`."""
    if PREFILLED:
        producer_prefilled(w_desc, x_desc, w_smem, x_smem, ready, empty, off_n, x_row, x_col, step_lo, n_steps,
                           STAGES, PREFILL)
    else:
        producer(w_desc, x_desc, w_smem, x_smem, ready, empty, off_n, x_row, x_col, step_lo, n_steps, 0, n_steps,
                 STAGES, False)


@gluon.jit
def scale_byte(word, j: gl.constexpr):
    """Byte j (little-endian) of UE8M0 scale words as FP32 2^(b - 127); byte 255 gives NaN and
    byte 0 gives 0.0, as `ops.rounding.ue8m0_to_fp32`."""
    b = (word >> (8 * j)) & 255
    value = (b << 23).to(gl.float32, bitcast=True)
    return gl.where(b == 255, float("nan"), value)


@gluon.jit
def slot_words(sw_words, sx_words, step, WORDS: gl.constexpr):
    """The scale words of ring slot `step` ([BN] weight, [BT] activation int32 words, four UE8M0
    bytes each): (sw0, sw1, sx0, sx1), word 1 for K blocks 4..7 of a 256-deep slot (= word 0 when
    the slot is 128 deep)."""
    sw0 = gl.load(sw_words + step * WORDS)
    sx0 = gl.load(sx_words + step * WORDS)
    if WORDS == 2:
        sw1 = gl.load(sw_words + step * WORDS + 1)
        sx1 = gl.load(sx_words + step * WORDS + 1)
    else:
        sw1 = sw0
        sx1 = sx0
    return sw0, sw1, sx0, sx1


def require_maxnreg(config) -> None:
    """ValueError naming `<config's class>.maxnreg` unless config.maxnreg is None or a multiple of 8
    in [24, 256] (a launch's register cap per thread, as Triton takes it): GluonMMConfig's,
    `gluon_exact_mm.GluonExactConfig`'s and `gluon_exact_fma.GluonExactFMAConfig`'s check."""
    v = config.maxnreg
    if v is not None and (not isinstance(v, int) or isinstance(v, bool) or not 24 <= v <= 256 or v % 8):
        raise ValueError(f"{type(config).__name__}.maxnreg must be None or a multiple of 8 in [24, 256], got {v!r}")


def require_tma_rows(t: torch.Tensor, name: str, needs: str = "TMA") -> None:
    """ValueError naming `name` unless the 2-D tensor t's rows start 16-byte aligned, as a TMA
    descriptor needs (the Gluon tier's weights and activations) or 16-byte copies (`needs`, for the
    message)."""
    if t.stride(0) * t.element_size() % 16 or t.data_ptr() % 16:
        raise ValueError(f"{name} rows must be 16-byte aligned for {needs} (row stride {t.stride(0)} elements, "
                         f"address {t.data_ptr():#x})")


def scale_words(scale: torch.Tensor, name: str) -> torch.Tensor:
    """The UE8M0 bytes of `scale` viewed as int32 words (four 32-wide blocks, one 128-deep step)."""
    b = scale.view(torch.uint8)
    if b.stride(0) % 4 or b.data_ptr() % 4:
        raise ValueError(f"{name} rows must start on 4-byte boundaries (row stride {b.stride(0)} bytes, "
                         f"address {b.data_ptr():#x}): the kernel loads four scale bytes as one word")
    return b.view(torch.int32)   # [rows, K/128], row stride in words


def require_sm90_weight(weight: torch.Tensor, needs: str) -> None:
    """ValueError naming the weight unless it is on a CUDA device of compute capability 9.0 (a Gluon
    plan's kernel is sm_90 code; `needs`: what of sm_90 it uses, for the message) and its rows are
    16-byte aligned (TMA): the device checks of the Gluon tier's linear plans (GluonMM,
    `gluon_exact_mm.GluonExactMM`, `gluon_exact_fma.GluonExactFMA`)."""
    if not is_sm90(weight.device):
        raise ValueError(f"weight must be on a CUDA device of compute capability 9.0 (the Gluon tier is "
                         f"sm_90 code: {needs}), got {weight.device}")
    require_tma_rows(weight, "weight")


def tma_desc(t: torch.Tensor, block: list[int], name: str) -> TensorDescriptor:
    """A TMA descriptor of the 2-D BF16 or E4M3 tensor t with box `block` (swizzled tiles: the NVMMA
    shared layout's default), after `require_tma_rows` (naming `name`)."""
    require_tma_rows(t, name)
    layout = gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16 if t.dtype == torch.bfloat16 else gl.float8e4nv)
    return TensorDescriptor.from_tensor(t, block, layout)


def fp8_desc(t: torch.Tensor, box: list[int]) -> TensorDescriptor:
    """The TMA descriptor of the 2-D FP8 tensor t's [box[0], box[1]] tiles in the NVMMA shared layout
    (128-byte swizzle) the Gluon tier's rings take; t's rows unchecked (`require_tma_rows`)."""
    box = list(box)
    return TensorDescriptor.from_tensor(t, box, gl.NVMMASharedLayout.get_default_for(box, gl.float8e4nv))


def activation_operands(codes: torch.Tensor, x_scale: torch.Tensor, bt: int,
                        block_k: int) -> tuple[TensorDescriptor, torch.Tensor]:
    """A Gluon linear launch's activation side: the TMA descriptor of codes' [bt, block_k] tiles and
    x_scale's int32 words (`scale_words`), after checks that name them (codes' rows 16-byte aligned,
    x_scale's on 4-byte boundaries)."""
    desc = tma_desc(codes, [bt, block_k], "codes")
    return desc, scale_words(x_scale, "x_scale")
