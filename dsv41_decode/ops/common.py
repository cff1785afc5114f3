"""Helpers shared by the kernel families: the SM count that plans size their grids by, whether a
device is sm_90 (the Hopper-only tiers) and runs FP64 at full rate (the exact linears' FP64
forms), the workspaces plans own or take from a shared pool, the split-K reduction that lets one
launch sum its programs' partials, and sums of register tiles in fixed orders (`column`,
`in_order_sum`, `butterfly_sum`: the same bits whatever layout the compiler gives the tile, unlike
`tl.sum`, whose tree follows the layout).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

# The SM count plans assume off the GPU: an H200's, so that the interpreter (and a CPU tool computing
# a GPU step's workspaces) builds the same plans, splits and grids as the GPU it stands in for.
CPU_SMS = 132


@functools.lru_cache(maxsize=None)
def num_sms(device: torch.device) -> int:
    """SMs of a CUDA device; `CPU_SMS` (an H200's 132) on any other device."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return CPU_SMS


def one_wave_programs(n_rows: int, n_tiles: int, programs_per_sm: int, device) -> int:
    """Programs a row for a launch over N rows whose programs each loop over a share of their row's
    n_tiles tiles: floor(programs_per_sm * SMs / N), at least one and at most n_tiles, so that the
    launch's programs start in one wave at programs_per_sm an SM (where N divides it unevenly, one
    program more a row would leave a second wave of a few programs, each a whole share of a row)."""
    return min(n_tiles, max(1, programs_per_sm * num_sms(device) // n_rows))


def is_sm90(device: torch.device) -> bool:
    """A CUDA device of compute capability 9.0 (H100 / H200 / H20): the Gluon and integer-MMA tiers'."""
    device = torch.device(device)
    return device.type == "cuda" and torch.cuda.get_device_capability(device) == (9, 0)


# CU_DEVICE_ATTRIBUTE_SINGLE_TO_DOUBLE_PRECISION_PERF_RATIO (cuda.h): FP32 over FP64 throughput
_CU_FP32_TO_FP64_RATIO = 87


@functools.lru_cache(maxsize=None)
def fp64_rate_ratio(device: torch.device) -> int | None:
    """A CUDA device's FP32 : FP64 throughput ratio as its driver reports it (2 on the data-center
    parts with full FP64 units: P100, V100, A100, H100, H200 - the H200's measured; 32-64 on the
    consumer parts; the Hopper parts whose data sheets give cut FP64 units, the H20 and H800, not
    measured here), or None off CUDA or where the driver library (`libcuda.so.1`: Linux) cannot
    be queried. Asked of the driver once per device (as `num_sms`): every plan's build reads it."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    import ctypes
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    ordinal = device.index if device.index is not None else torch.cuda.current_device()
    dev, value = ctypes.c_int(), ctypes.c_int()
    if lib.cuInit(0) or lib.cuDeviceGet(ctypes.byref(dev), ordinal) or \
            lib.cuDeviceGetAttribute(ctypes.byref(value), _CU_FP32_TO_FP64_RATIO, dev):
        return None
    return value.value


def full_rate_fp64(device: torch.device) -> bool:
    """Whether a device runs FP64 at half its FP32 rate (`fp64_rate_ratio` <= 2): what the exact
    linears' FP64 forms (`exact_mm_plan.ExactConfig.f64`, `gluon_exact_fma.GluonExactFMA`) need to
    pay; where FP64 runs at 1/32-1/64 of FP32 the plans keep FP32 sums. False off CUDA."""
    ratio = fp64_rate_ratio(device)
    return ratio is not None and ratio <= 2


def plan_workspace(workspace, slot: int, shape: int | tuple[int, ...], dtype: torch.dtype,
                   device: torch.device) -> torch.Tensor:
    """A plan's workspace of `shape` (an int: 1-D), contiguous: its own (`torch.empty`; integer
    dtypes zeroed: flags and counters start at 0) when `workspace` is None, else a view taken from
    the shared pool `workspace` (`take(slot, shape, dtype)`, e.g. `decode.buffers.Workspaces`, zero
    when taken), which must be on `device` (ValueError otherwise). A plan takes its simultaneous
    workspaces from distinct slots; the pool's contract says who else may hold the memory. Sharing
    is sound for plans whose launches never overlap in time (one stream, in order; the caller
    guarantees it) and that leave their counters and flags at zero and write their FP32 scratch
    before reading it within a launch (the GEMM plans and the sparse MLA do), so the bits do not
    depend on who else used the memory."""
    device = torch.device(device)
    if workspace is None:
        alloc = torch.empty if dtype.is_floating_point else torch.zeros
        return alloc(shape, dtype=dtype, device=device)
    if torch.device(workspace.device).type != device.type:
        raise ValueError(f"the workspace pool is on {workspace.device} but the plan on {device}")
    return workspace.take(slot, shape, dtype)


@triton.jit
def splitk_reduce(y, part_ptrs, stride_ps, mask, count_ptr, pid_k, SPLIT: tl.constexpr, GROUP: tl.constexpr = 1):
    """Publish this program's FP32 partial y; the last of the tile's SPLIT programs to arrive sums them.

    part_ptrs: [BLOCK_M, BLOCK_N] pointers to split 0's partial, split s at + s * stride_ps; mask:
    [BLOCK_M, BLOCK_N] elements to store. count_ptr: the tile's int32 counter, 0 at launch; the last
    program resets it, so the next launch (stream-ordered, or a graph replay) finds it clean.
    GROUP: the partials a program publishes (its last one y here, the GROUP - 1 before it already
    stored), so SPLIT / GROUP programs arrive; the sum is the same SPLIT partials in split order.
    Returns (last, total): in the last program, total = the partials added in split order (the same
    bits whichever program comes last); elsewhere total = y. The sum is unrolled, so the loads are
    independent straight-line code that the compiler issues together (one L2 round trip, not SPLIT).
    The barrier orders every thread's partial store before thread 0's release (the CUTLASS
    semaphore pattern); `.cg` loads read the partials from L2, never a stale L1 line.
    """
    tl.store(part_ptrs + pid_k * stride_ps, y, mask=mask)
    tl.debug_barrier()
    arrived = tl.atomic_add(count_ptr, 1, sem="acq_rel", scope="gpu")
    last = arrived == SPLIT // GROUP - 1
    total = y
    if last:
        tl.store(count_ptr, 0)
        total = tl.load(part_ptrs, mask=mask, other=0.0, cache_modifier=".cg")
        for s in tl.static_range(1, SPLIT):
            total += tl.load(part_ptrs + s * stride_ps, mask=mask, other=0.0, cache_modifier=".cg")
    return last, total


@triton.jit
def column(t, j: tl.constexpr, SUB: tl.constexpr):
    """Column j of t [R, SUB] (SUB a power of two) as [R]: tl.split halves the last dimension into
    its even and odd columns, which moves no data where a thread holds whole rows."""
    if SUB == 1:
        return tl.reshape(t, [t.shape[0]])
    else:
        even, odd = tl.split(tl.reshape(t, [t.shape[0], SUB // 2, 2]))
        if j % 2 == 0:
            return column(even, j // 2, SUB // 2)
        else:
            return column(odd, j // 2, SUB // 2)


@triton.jit
def in_order_sum(t):
    """[R, S] -> [R]: ((t[:, 0] + t[:, 1]) + t[:, 2]) + ... + t[:, S - 1], S a power of two (the
    order in which a thread adds the values it holds)."""
    S: tl.constexpr = t.shape[1]
    acc = column(t, 0, S)
    for j in tl.static_range(1, S):
        acc = acc + column(t, j, S)
    return acc


@triton.jit
def butterfly_sum(t):
    """[R, L] -> [R], L a power of two: t[:, i] + t[:, i + L/2] for i < L/2, then the same over those
    L/2 sums, down to one (the order of a shuffle-xor reduction over L lanes, xor L/2 first). Each
    step adds two values, which rounds alike in either order, so the bits do not depend on the
    layout (up to the sign of a zero sum: the interpreter may start a sum from +0)."""
    R: tl.constexpr = t.shape[0]
    L: tl.constexpr = t.shape[1]
    if L == 1:
        return tl.reshape(t, [R])
    else:
        return butterfly_sum(tl.sum(tl.reshape(t, [R, 2, L // 2]), axis=1))
