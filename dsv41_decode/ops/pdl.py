"""Programmatic dependent launch (PDL, Hopper and later) for the decode step's main-stream kernels.

In a decode step at small batch most kernels are short and depend on the one before, so each pays
its launch and ramp-up latency in series. With PDL a kernel launched with the
`CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION` attribute (Triton: `launch_pdl=True`) may
start while its predecessor still runs, once every program of the predecessor has executed
`griddepcontrol.launch_dependents` (or exited). Its programs then run what does not depend on the
predecessor - a GEMM prefetches the first part of its weight into L2 (`prefetch_rows_l2`) - and
execute `griddepcontrol.wait`, which returns once the predecessor has completed and its memory is
visible, before they touch anything the predecessor writes or reads.

The contract of a PDL-aware kernel (constexpr `PDL`, see `enter`): before `enter` it reads only
constant data (weights) and writes nothing; `enter` waits for the predecessor, then lets the
successor launch. Because every PDL-launched kernel waits before its first dependent access,
ordering is transitive: when kernel n + 2 passes its wait, kernel n + 1 has completed, and it
completed only after its own wait saw kernel n complete. Kernels launched without the attribute
(torch ops, side-stream kernels) keep full stream serialization.

Gluon kernels take the same two instructions from `gluon_wait` and `gluon_launch_dependents`. A
Gluon ring kernel launched by PDL (`gluon_ring.ring_prefill`) requests its ring's first weight tiles
(constant data, by TMA into its own shared memory) before its wait and nothing else; the step's
predecessors that release such a kernel (the sparse MLA's launch that writes o, the q/kv norm pair)
do so at their programs' start, before anything of their own but their own wait where they are
launched by PDL themselves (the sparse MLA after the sparse-index table) - the successor's wait still
orders every dependent access after their completion.

A gate (`gluon_gate_signal`, `gluon_gate_await`, `gluon_gate_close`) paces such a prologue: the
successor requests its first slots, polls a counter that each program of the predecessor
increments at a point of its own (the sparse MLA: once its records are gathered), requests the
rest, then waits as above. The polls are the one read before the wait of memory the predecessor
writes, and no value depends on them: they only decide when constant data is requested.

A launcher passes `PDL=False` (and no launch attribute) unless its caller asks for PDL on that
launch. PDL never works in the interpreter (the instructions are inline PTX) or below sm_90
(`supported`). Measured on an H200, the decode step with PDL on every main-stream kernel was slower
(docs/step.md); the step launches six kernels a layer by PDL (seven in a layer that runs its indexer):
three after a predecessor that releases
it at its start and reads little of DRAM, the Gluon `wo_a` after the sparse MLA, at 1-8 rows the
exact `wq_b` after the q/kv norm pair and at 1-2 rows the exact fused `wq_a|wkv` after the mHC
boundary, and the exact `wo_b` after `wo_a`'s main loops (`DecodeStep(wo_a_pdl=, wq_b_pdl=,
qkv_pdl=, wo_b_pdl=)`), each with its ring's first weight tiles requested before its wait
(`gluon_ring.ring_prefill`), or on `ExactMM` its first weight bytes asked of L2; and two short
launches whose predecessor releases nothing early, the q/kv norm pair after the fused GEMM and the
boundary after `wo_b` (`DecodeStep(norm_pdl=, boundary_pdl=)`: only the launch overlaps the
predecessor's tail); and in a layer that runs its indexer (not with `fold_index_chain`, whose
top-k writes the table) the Gluon sparse MLA after the sparse-index table, which releases it at its
start (`DecodeStep(mla_pdl=)`: the MLA's programs are resident before the table ends). The sparse MLA's second launch stays plain (`GluonSparseMlaConfig.pv_pdl`,
docs/attn.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from .checks import interpreting


def supported(device: torch.device | str) -> bool:
    """PDL can be used on `device`: CUDA, compute capability 9.0 or later, not the interpreter."""
    device = torch.device(device)
    return (device.type == "cuda" and not interpreting() and torch.cuda.is_available()
            and torch.cuda.get_device_capability(device)[0] >= 9)


def require_supported(device: torch.device | str) -> None:
    """ValueError naming `pdl` unless PDL can be used on `device` (`supported`): a launcher's check of
    its caller's `pdl=True`."""
    if not supported(device):
        raise ValueError(f"pdl: programmatic dependent launch needs sm_90 or later outside the interpreter, "
                         f"got {torch.device(device)}")


def launch_options(pdl: bool = False) -> dict:
    """Extra keyword arguments of a Triton launch: {"launch_pdl": True} with `pdl`, else {}."""
    return {"launch_pdl": True} if pdl else {}


def kernel_options(device: torch.device | str, pdl: bool = False, release: bool = False) -> dict:
    """The launch keywords of a kernel that enters by `enter(PDL)` (wait, then release) for its
    caller's `pdl` (launched by PDL: `require_supported`, ValueError naming `pdl` where PDL is not
    available) and `release` (lets a successor launched by PDL start at its programs' start; ignored
    where PDL is not available): {"PDL": the constexpr, **launch_options(pdl)}."""
    if pdl:
        require_supported(device)
    return {"PDL": pdl or (release and supported(device)), **launch_options(pdl)}


@triton.jit
def bulk_prefetch_l2(addr, size, EVICT_LAST: tl.constexpr = False):
    """Ask L2 for `size` bytes (int32, a multiple of 16; none when <= 0) at each 16-byte aligned
    int64 address `addr` (`cp.async.bulk.prefetch.L2`, sm_90; inline PTX, so never in the
    interpreter). Reads nothing back, writes nothing. EVICT_LAST: at L2's evict_last priority (a
    `createpolicy.fractional` policy of fraction 1.0 on the prefetch: L2 is to evict lines of the
    normal priority, a streamed weight's, before these), else the normal one."""
    if EVICT_LAST:
        tl.inline_asm_elementwise("{\n\t.reg .pred p;\n\t.reg .b64 pol;\n\tsetp.gt.s32 p, $2, 0;\n\t"
                                  "createpolicy.fractional.L2::evict_last.b64 pol, 1.0;\n\t"
                                  "@p cp.async.bulk.prefetch.L2.global.L2::cache_hint [$1], $2, pol;\n\t"
                                  "mov.u32 $0, 0;\n\t}",
                                  "=r,l,r", [addr, size], dtype=tl.int32, is_pure=False, pack=1)
    else:
        tl.inline_asm_elementwise("{\n\t.reg .pred p;\n\tsetp.gt.s32 p, $2, 0;\n\t"
                                  "@p cp.async.bulk.prefetch.L2.global [$1], $2;\n\tmov.u32 $0, 0;\n\t}",
                                  "=r,l,r", [addr, size], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def enter(PDL: tl.constexpr, RELEASE: tl.constexpr = True):
    """Wait for the predecessor kernel (its writes visible), then (RELEASE) allow the successor to
    launch. A kernel with a long main loop passes RELEASE=False and calls `release` after the loop,
    so that its successor launches (and starts its weight prefetch) only near its end. A no-op
    without PDL."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        if RELEASE:
            tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def release(PDL: tl.constexpr):
    """Allow the successor kernel to launch (once every program of this kernel has released or
    exited); after the main loop of a kernel that entered with RELEASE=False. A no-op without PDL."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def prefetch_rows_l2(row_ptrs, nbytes, PDL: tl.constexpr, MAX_BYTES: tl.constexpr = 1024):
    """Ask L2 to fetch min(`nbytes`, MAX_BYTES) (multiples of 16; none when <= 0) from each 16-byte
    aligned address of `row_ptrs` (one bulk prefetch per row: `cp.async.bulk.prefetch.L2`, sm_90):
    the first steps of a weight stream, not all of it (the whole next weight competed with the
    running kernel's stream for L2). Only with PDL, where it overlaps the predecessor; results are
    never read, so it changes no value."""
    if PDL:
        size = tl.zeros(row_ptrs.shape, dtype=tl.int32) + tl.minimum(nbytes, MAX_BYTES)
        bulk_prefetch_l2(row_ptrs.to(tl.int64), size)


@gluon.jit
def gluon_wait():
    """`griddepcontrol.wait` in a Gluon kernel: returns once the predecessor kernel has completed and
    its memory is visible (at once where the kernel was launched without PDL)."""
    gl.inline_asm_elementwise("griddepcontrol.wait; // dummy $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)


# Polls of a gate (`gluon_gate_await`, each ~0.3-1 us: a nanosleep and an L2 round trip) before a
# program stops waiting: milliseconds, far past any predecessor's signal, so a gate whose
# predecessor never signals (a broken pairing) costs time, never a hung GPU or a value.
_GATE_POLLS: gl.constexpr = gl.constexpr(1 << 13)


@gluon.jit
def gluon_gate_signal(gate_ptr):
    """Count this program's arrival in gate_ptr[0] (int32; one relaxed atomic a program): the signal a
    successor launched by PDL waits for in `gluon_gate_await` before it asks more of DRAM. A
    schedule signal only: it orders no memory (the successor's `griddepcontrol.wait` does)."""
    gl.atomic_add(gate_ptr, 1, sem="relaxed", scope="gpu")


@gluon.jit
def gluon_gate_await(gate_ptr, count):
    """Poll gate_ptr[0] (int32) until it reaches `count` (the predecessor's programs that signal,
    `gluon_gate_signal`), sleeping between polls, or until _GATE_POLLS polls have passed. Before
    `griddepcontrol.wait` in a kernel launched by PDL: every program of the predecessor has
    started when this kernel's programs run (PDL launches them once all have released), so the
    count is reached whenever the predecessor signals once a program. Reads only; changes no value."""
    seen = gl.load(gate_ptr, volatile=True)
    polls = 0
    while (seen < count) & (polls < _GATE_POLLS):
        gl.inline_asm_elementwise("nanosleep.u32 256; // dummy $0", "=r", [], dtype=gl.int32, is_pure=False,
                                  pack=1)
        seen = gl.load(gate_ptr, volatile=True)
        polls += 1


@gluon.jit
def gluon_gate_close(gate_ptr):
    """After `griddepcontrol.wait` (the predecessor complete: every signal counted) in every program
    that ran `gluon_gate_await`: count this program in gate_ptr[1]; the grid's last sets both words
    back to 0 (every program is past its polls), so the next launch pair finds the gate closed."""
    n = gl.num_programs(0) * gl.num_programs(1) * gl.num_programs(2)
    done = gl.atomic_add(gate_ptr + 1, 1, sem="relaxed", scope="gpu")
    if done == n - 1:
        gl.atomic_xchg(gate_ptr, 0, sem="relaxed", scope="gpu")
        gl.atomic_xchg(gate_ptr + 1, 0, sem="relaxed", scope="gpu")


@gluon.jit
def gluon_launch_dependents():
    """`griddepcontrol.launch_dependents` in a Gluon kernel: the successor launched with PDL may launch
    once every program of this kernel has executed it (or exited); a no-op without one."""
    gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // dummy $0", "=r", [], dtype=gl.int32,
                              is_pure=False, pack=1)
