"""The tensor-parallel boundary in one launch (design section 3): a one-shot all-reduce of the ranks'
`wo_b` partials over peer-readable memory, fused with the mHC boundary of `ops.mhc`.

The mailbox (`Mailbox`): every rank owns a data buffer [2, max_rows, dim] FP32 and a flag (int64),
both readable by every peer (CUDA symmetric memory on GPUs; plain tensors in one process for the
tests). Layer k of step e publishes generation g = e * stride + k + 1 (`stride` even, > layers):
its `wo_b` writes the rank's FP32 partial into its own data slot g % 2 (fixed per layer, so a CUDA
graph can bake the address), then the boundary kernel

1. sets the rank's flag to g (one program; release, system scope),
2. in every program, waits until every rank's flag is >= g (acquire; at most `Mailbox.wait_ns` of
   GPU time by `%globaltimer`, and at most `max_spin` polls - the interpreter's only bound). A rank
   that does not arrive in time is written to the error word as rank + 1 and the program carries
   on, so nothing hangs; once the error word is set, later boundaries do not wait at all (a dead
   rank costs one bound per step, not one per layer); `Mailbox.check()` raises the error naming it,
3. adds the ranks' partials of its chunk in rank order in FP32 (the same bits on every rank) and
   rounds once to BF16: the site output y,
4. runs the mHC boundary on y exactly as `ops.mhc.mhc_boundary_` with a plan (post-mix, collapse,
   RMSNorm, MXFP8), each row spread over chunks.

Slot reuse is safe with two slots: a rank can only publish g + 2 after it saw every flag >= g + 1,
which each peer set after it had read generation g. The epoch e lives on the device (`Mailbox.epoch`,
advanced once per step by `Mailbox.next_step()`), so replays need no host arguments.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .checks import interpreting, require_int, require_tensor
from .mhc import MhcBoundaryPlan, _boundary_block_d, check_boundary_operands, mix_chunk, split_finish
from .rounding import bf16_rne_bits, bf16_widen



@triton.jit
def _now_ns(TIMER: tl.constexpr):
    """The GPU's global nanosecond timer (0 in the interpreter, which has no inline assembly)."""
    if TIMER:
        t = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)
    else:
        t = tl.zeros((), dtype=tl.int64)
    return t


@triton.jit
def _allreduce_boundary_kernel(
    data_ptrs, flag_ptrs, epoch_ptr, err_ptr, y_ptr,
    x_ptr, post_ptr, comb_ptr, pre_ptr, w_ptr, xo_ptr, u_ptr, codes_ptr, scales_ptr, ws_ptr, cnt_ptr, eps,
    max_spin, wait_ns, stride_x_slot, stride_dn,
    stride_xn, stride_xh, stride_post, stride_cn, stride_ci, stride_pre,
    stride_xon, stride_xoh, stride_u, stride_codes, stride_scales, stride_ws, stride_y,
    RANK: tl.constexpr, TP: tl.constexpr, GEN_STRIDE: tl.constexpr, LAYER_GEN: tl.constexpr,
    D: tl.constexpr, BLOCK_D: tl.constexpr, NCH: tl.constexpr, NCH_P2: tl.constexpr, BLOCK_N: tl.constexpr,
    TIMER: tl.constexpr,
):
    n = tl.program_id(0).to(tl.int64)
    ch = tl.program_id(1)
    gen = tl.load(epoch_ptr) * GEN_STRIDE + LAYER_GEN
    own_flag = tl.load(flag_ptrs + RANK).to(tl.pointer_type(tl.int64))
    if (n == 0) & (ch == 0):
        tl.atomic_xchg(own_flag, gen, sem="release", scope="sys")
    for r in tl.static_range(TP):
        if r != RANK:
            flag = tl.load(flag_ptrs + r).to(tl.pointer_type(tl.int64))
            seen = tl.atomic_add(flag, 0, sem="acquire", scope="sys")
            failed = tl.atomic_add(err_ptr, 0, sem="relaxed", scope="gpu")
            start = _now_ns(TIMER)
            spins = 0
            waiting = (seen < gen) & (failed == 0)
            while waiting:
                seen = tl.atomic_add(flag, 0, sem="acquire", scope="sys")
                spins += 1
                waiting = (seen < gen) & (spins < max_spin) & (_now_ns(TIMER) - start < wait_ns)
            if seen < gen:
                tl.atomic_max(err_ptr, r + 1)
    d = ch * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = d < D
    slot_off = (LAYER_GEN % 2) * stride_x_slot + n * stride_dn
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for r in tl.static_range(TP):
        base = tl.load(data_ptrs + r).to(tl.pointer_type(tl.float32))
        acc += tl.load(base + slot_off + d, mask=mask, other=0.0, cache_modifier=".cv")
    y_bits = bf16_rne_bits(acc)
    tl.store(y_ptr + n * stride_y + d, y_bits, mask=mask)
    b0, b1, b2, b3, c = mix_chunk(bf16_widen(y_bits), x_ptr + n * stride_xn, stride_xh, post_ptr + n * stride_post,
                                  comb_ptr + n * stride_cn, stride_ci, pre_ptr + n * stride_pre, d, mask)
    split_finish(b0, b1, b2, b3, c, n, ch, d, mask, w_ptr, xo_ptr, u_ptr, codes_ptr, scales_ptr, ws_ptr, cnt_ptr,
                 eps, stride_xon, stride_xoh, stride_u, stride_codes, stride_scales, stride_ws,
                 D, NCH, NCH_P2, BLOCK_N)


@dataclass(eq=False)
class Mailbox:
    """One rank's view of the mailbox (see the module docstring).

    data: this rank's [2, max_rows, dim] FP32 slots; flag: its int64 [1] flag; data_ptrs / flag_ptrs:
    int64 [tp] addresses of every rank's data and flag (peer-readable); epoch: int64 [1] step counter;
    error: int32 [1], 0 or (missing rank + 1); layers: the boundaries per step (generation stride);
    wait_ns: the bounded wait of a boundary for a peer's flag, in GPU nanoseconds.
    """

    tp: int
    rank: int
    max_rows: int
    dim: int
    layers: int
    data: torch.Tensor
    flag: torch.Tensor
    data_ptrs: torch.Tensor
    flag_ptrs: torch.Tensor
    epoch: torch.Tensor
    error: torch.Tensor
    wait_ns: int = 1_000_000_000

    @property
    def gen_stride(self) -> int:
        """Generations per step: even (so that a layer's slot parity is fixed) and > layers."""
        return self.layers + 2 - self.layers % 2

    def slot(self, layer_index: int) -> torch.Tensor:
        """Where the `layer_index`-th boundary's partial is published: data[(k + 1) % 2] (0 <= k < layers)."""
        require_int(layer_index, "layer_index", 0, self.layers - 1)
        return self.data[(layer_index + 1) % 2]

    def next_step(self) -> None:
        """Advance the epoch (a device op: captured once, it runs at every replay)."""
        self.epoch += 1

    def check(self) -> None:
        """Raise RuntimeError naming a rank that did not arrive within the bounded wait."""
        missing = int(self.error.item())
        if missing:
            raise RuntimeError(f"tensor-parallel boundary: rank {missing - 1} of {self.tp} did not publish its "
                               f"partial within the bounded wait (rank {self.rank} waited); is it alive?")

    @classmethod
    def local_group(cls, tp: int, max_rows: int, dim: int, layers: int, device="cpu") -> list["Mailbox"]:
        """`tp` mailboxes in one process whose buffers are ordinary tensors (for tests and the
        interpreter): each rank's view points at all of them."""
        for name, v in (("tp", tp), ("max_rows", max_rows), ("dim", dim), ("layers", layers)):
            require_int(v, name)
        data = [torch.zeros(2, max_rows, dim, dtype=torch.float32, device=device) for _ in range(tp)]
        flags = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(tp)]
        dptr = torch.tensor([t.data_ptr() for t in data], dtype=torch.int64, device=device)
        fptr = torch.tensor([t.data_ptr() for t in flags], dtype=torch.int64, device=device)
        return [cls(tp, r, max_rows, dim, layers, data[r], flags[r], dptr, fptr,
                    torch.zeros(1, dtype=torch.int64, device=device), torch.zeros(1, dtype=torch.int32, device=device))
                for r in range(tp)]

    @classmethod
    def symmetric(cls, tp, max_rows: int, dim: int, layers: int, device) -> "Mailbox":
        """A mailbox in CUDA symmetric memory over the ranks of `tp` (a `parallel.TensorParallel`),
        peer-to-peer without NVLink multicast (TORCH_SYMM_MEM_DISABLE_MULTICAST=1 must be set).
        Not yet run on GPUs (docs/tp.md)."""
        import torch.distributed as dist
        import torch.distributed._symmetric_memory as symm_mem
        group = tp.group or dist.group.WORLD
        data = symm_mem.empty(2 * max_rows * dim + 2, dtype=torch.float32, device=device)
        handle = symm_mem.rendezvous(data, group)
        # the flag lives in the last 8 bytes of each rank's buffer
        dptr = torch.tensor(list(handle.buffer_ptrs), dtype=torch.int64, device=device)
        fptr = dptr + 4 * 2 * max_rows * dim
        flag = data[2 * max_rows * dim:].view(torch.int64)
        flag.zero_()
        dist.barrier(group)
        return cls(tp.tp, tp.rank, max_rows, dim, layers, data[:2 * max_rows * dim].view(2, max_rows, dim), flag,
                   dptr, fptr, torch.zeros(1, dtype=torch.int64, device=device),
                   torch.zeros(1, dtype=torch.int32, device=device))


def allreduce_boundary_(box: Mailbox, layer_index: int, rows: int, x: torch.Tensor, post: torch.Tensor,
                        comb: torch.Tensor, pre: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                        x_out: torch.Tensor, u_out: torch.Tensor, codes_out: torch.Tensor, scales_out: torch.Tensor,
                        y_out: torch.Tensor, plan: MhcBoundaryPlan, max_spin: int = 1 << 40) -> None:
    """y = bf16(sum over ranks in rank order of their published partials of `layer_index`), then
    `ops.mhc.mhc_boundary_(y, x, post, comb, pre, norm_weight, eps, x_out, u_out, codes_out,
    scales_out, plan)`; y is also written to y_out. Shapes as in `mhc_boundary_` with N = rows;
    y_out: [rows, dim] bfloat16. The partials must be in `box.slot(layer_index)[:rows]` of every rank.
    max_spin: polls of a peer's flag before the wait gives up (besides `box.wait_ns`), 1 .. 2**63 - 1.
    """
    if not isinstance(box, Mailbox):
        raise TypeError(f"box must be a Mailbox, got {type(box).__name__}")
    if not isinstance(plan, MhcBoundaryPlan):
        raise TypeError(f"plan must be an MhcBoundaryPlan, got {type(plan).__name__}")
    require_int(layer_index, "layer_index", 0, box.layers - 1)
    require_int(rows, "rows")
    if rows > min(box.max_rows, plan.max_rows):
        raise ValueError(f"rows={rows} must lie in 1..{min(box.max_rows, plan.max_rows)}")
    require_int(max_spin, "max_spin", 1, 2**63 - 1)
    dim, dev = box.dim, box.data.device
    if plan.dim != dim:
        raise ValueError(f"plan is for dim={plan.dim}, the mailbox for dim={dim}")
    check_boundary_operands(rows, dim, dev, x, post, comb, pre, norm_weight, x_out, u_out, codes_out, scales_out)
    require_tensor(y_out, "y_out", (torch.bfloat16,), (rows, dim), dev)
    xo, u, y16 = x_out.view(torch.int16), u_out.view(torch.int16), y_out.view(torch.int16)
    codes, scales = codes_out.view(torch.uint8), scales_out.view(torch.uint8)
    _allreduce_boundary_kernel[(rows, plan.chunks)](
        box.data_ptrs, box.flag_ptrs, box.epoch, box.error, y16,
        x, post, comb, pre, norm_weight, xo, u, codes, scales, plan.ws, plan.counters, float(eps),
        int(max_spin), int(box.wait_ns), box.data.stride(0), box.data.stride(1),
        x.stride(0), x.stride(1), post.stride(0), comb.stride(0), comb.stride(1), pre.stride(0),
        xo.stride(0), xo.stride(1), u.stride(0), codes.stride(0), scales.stride(0), plan.ws.stride(0), y16.stride(0),
        RANK=box.rank, TP=box.tp, GEN_STRIDE=box.gen_stride, LAYER_GEN=layer_index + 1,
        D=dim, BLOCK_D=plan.block_d, NCH=plan.chunks, NCH_P2=triton.next_power_of_2(plan.chunks),
        BLOCK_N=_boundary_block_d(dim), TIMER=dev.type == "cuda" and not interpreting(),
        num_warps=4, enable_fp_fusion=False,
    )
