"""Test support shared by the Gluon linears' tests (test_gluon_mm.py, test_gluon_exact_mm.py,
test_gluon_exact_fma.py; imported as a sibling module, as the tests import test_exact_mm): their
kernels compiled for sm_90 as the plans launch them (`testing.sm90.compile_linear`; the exact ones'
query-RoPE epilogue arguments: `testing.sm90.rope_epilogue`), what every such compile must show (`spill_free`;
with the exact ones' query-RoPE epilogue, `check_rope_compile`; the SASS loops their checks read:
`testing.sm90.loops`, `loop_with`), the operands of the bitwise GPU tests (`kind_operands`,
`subnormal_operands`), a call's check against the reference into a window of a poisoned buffer (`check_window`) and the
argument errors the exact plans share (`check_exact_plan_errors`, `check_tma_alignment_errors`)."""

import re

import torch
from helpers import linear_operands, raises
from test_exact_mm import _bits, _exact_operands, _gen, _poisoned

from dsv41_decode.ops.gluon_ring import SHARED_LIMIT
from dsv41_decode.reference.linear import mxfp8_mm
from dsv41_decode.testing import sm90


def spill_free(kernel, max_regs: int, shared_bytes: int) -> tuple[dict, list[str], dict]:
    """Assert what every Gluon linear's sm_90 compile must show: no spills (no local memory or
    stack, no STL / LDL), at most `max_regs` registers, its shared memory within `shared_bytes`
    (its module's count), itself within sm_90's. Returns (its resources, its SASS instructions'
    texts, their opcode counts)."""
    res = sm90.resources(kernel)
    ins = [t for _, t in sm90.sass(kernel)]
    ops = sm90.opcode_counts(ins)
    assert res["LOCAL"] == 0 and res["STACK"] == 0 and ops.get("STL", 0) == 0 and ops.get("LDL", 0) == 0, (res, ops)
    assert res["REG"] <= max_regs, res
    assert kernel.metadata.shared <= shared_bytes <= SHARED_LIMIT, kernel.metadata.shared
    return res, ins, ops


def check_rope_compile(kernel, plain, max_regs: int, shared_bytes: int, loop_op: str) -> int:
    """What an exact Gluon linear's sm_90 compile with the query-RoPE epilogue (`kernel`) must show
    against the same configuration without it (`plain`): `spill_free`'s; the rotation's products
    and sums each rounded on its own (libdevice's sub_rn in the PTX; FMUL, no FFMA: nothing
    contracted), FP32 subnormals kept (no .ftz), the cos/sin loads; the consumer's loop (the one
    holding every `loop_op`) with as many `loop_op` and at most 1 % more instructions other than the
    register allocator's moves (MOV, NOP: at a cap of 80 registers the epilogue's live values move
    a few of the loop's registers). Returns the kernel's registers."""
    res, _, ops = spill_free(kernel, max_regs, shared_bytes)
    plain_ops = sm90.opcode_counts([t for _, t in sm90.sass(plain)])
    ptx = kernel.asm["ptx"]
    assert "sub.rn.f32" in ptx and "sub.rn.f32" not in plain.asm["ptx"] and re.search(r"\.ftz\.f32\b", ptx) is None
    assert ops.get("FFMA", 0) == plain_ops.get("FFMA", 0), (ops.get("FFMA"), plain_ops.get("FFMA"))
    assert ops.get("FMUL", 0) >= plain_ops.get("FMUL", 0) + 4 and ops.get("LDG", 0) >= plain_ops.get("LDG", 0) + 2, (
        ops, plain_ops)
    loop, plain_loop = sm90.loop_with(kernel, loop_op), sm90.loop_with(plain, loop_op)
    assert sm90.opcode_counts(loop)[loop_op] == sm90.opcode_counts(plain_loop)[loop_op]
    work, plain_work = ([t for t in ins if not t.startswith(("MOV ", "NOP"))] for ins in (loop, plain_loop))
    assert len(work) <= 1.01 * len(plain_work), (len(work), len(plain_work), len(loop), len(plain_loop))
    return res["REG"]


def subnormal_operands(gen, m: int, n: int, k: int):
    """Codes whose exponent field is 0 or 1 (the E4M3 subnormals, the smallest normals, +-0), every
    sign: products down to 2^-18, FP64 subnormals where a kernel's conversion makes the weight's
    codes FP64 patterns ("int", "raw" and their packed forms; `gluon_exact_fma`'s)."""
    codes, x_scale, weight, w_scale = _exact_operands(gen, m, n, k, "uniform")
    return (codes.view(torch.uint8).bitwise_and(0x8F).view(torch.float8_e4m3fn), x_scale,
            weight.view(torch.uint8).bitwise_and(0x8F).view(torch.float8_e4m3fn), w_scale)


def kind_operands(kind: str, m: int, n: int, k: int):
    """(codes, x_scale, weight, w_scale) of a bitwise test's `kind`, seeded by m + n + k:
    "quantized" (MXFP8 activations and a block-quantized weight, as the model has them:
    helpers.linear_operands), "subnormal" (`subnormal_operands`), else test_exact_mm's "heavy" or
    "uniform" codes (`_exact_operands`)."""
    gen = _gen(m + n + k)
    if kind == "quantized":
        return linear_operands(gen, m, n, k)[2:]
    if kind == "subnormal":
        return subnormal_operands(gen, m, n, k)
    return _exact_operands(gen, m, n, k, kind)


def check_window(plan, codes, x_scale, ref: torch.Tensor, pad_rows: int, what) -> torch.Tensor:
    """Check `plan(codes, x_scale, out)` with out a window of a poisoned (NaN) buffer `pad_rows` rows
    and 8 columns larger, of ref's dtype: bitwise `ref` ([M, N]), the buffer's rows and columns past
    the window untouched; `what` names the case in a failure. Returns the window."""
    m, n = ref.shape
    buf = _poisoned(m + pad_rows, n + 8, ref.dtype)
    y = plan(codes, x_scale, buf[:m, :n])
    assert torch.equal(_bits(y), _bits(ref)), what
    assert buf[m:].isnan().all() and buf[:, n:].isnan().all(), what
    return y


def check_exact_plan_errors(plan_type, config_name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The construction errors the exact Gluon plans share on the CPU, each naming its argument:
    the device (sm_90 code only), K not a multiple of 128, the weight's dtype, w_scale's shape, a
    config that is not a `config_name`. Returns the good (weight [64, 256], w_scale) they start
    from, for the plan's own checks."""
    w = torch.zeros(64, 256, dtype=torch.float8_e4m3fn)
    s = torch.zeros(2, 8, dtype=torch.uint8)
    raises("compute capability 9.0", lambda: plan_type(w, s))          # the CPU: sm_90 code only
    raises("K a positive multiple of 128", lambda: plan_type(torch.zeros(64, 96, dtype=torch.float8_e4m3fn),
                                                             torch.zeros(2, 3, dtype=torch.uint8)))
    raises("weight must have dtype", lambda: plan_type(w.view(torch.uint8), s))
    raises("w_scale must have shape", lambda: plan_type(w, s[:, :7]))
    raises(f"config must be a {config_name}", lambda: plan_type(w, s, config="fast"))
    return w, s


def check_tma_alignment_errors(plan_type, plan, codes, x_scale, weight, w_scale) -> None:
    """The TMA alignment errors of a Gluon plan (`plan`, of `plan_type`, bound to weight and
    w_scale; codes [m, k] and x_scale a call's) on the GPU, each naming its argument: codes' rows
    not 16-byte aligned, x_scale's not on 4-byte boundaries, a weight's not 16-byte aligned; then
    the plan's call on the good operands is bitwise `mxfp8_mm`."""
    (m, k), n, device = codes.shape, weight.shape[0], codes.device
    raw = torch.zeros(m * k + 16, dtype=torch.uint8, device=device)
    misaligned = raw[1:1 + m * k].view(torch.float8_e4m3fn).view(m, k)
    sraw = torch.zeros(m * (k // 32) + 4, dtype=torch.uint8, device=device)
    raises("codes rows must be 16-byte aligned", lambda: plan(misaligned, x_scale))
    raises("x_scale rows must start on 4-byte boundaries", lambda: plan(codes, sraw[1:1 + m * (k // 32)].view(m, -1)))
    raises("weight rows must be 16-byte aligned", lambda: plan_type(
        torch.zeros(n * k + 16, dtype=torch.uint8, device=device)[8:8 + n * k].view(torch.float8_e4m3fn).view(n, k),
        w_scale))
    assert torch.equal(_bits(plan(codes, x_scale)), _bits(mxfp8_mm(codes, x_scale, weight, w_scale)))
