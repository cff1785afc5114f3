"""Argument checks shared by the op launchers: errors that name the argument at fault."""

from __future__ import annotations

import os

import torch


def require_device(device, name: str = "device") -> torch.device:
    """`device` (a str, torch.device or CUDA index, as `torch.device` takes) as a torch.device;
    ValueError naming `name` for a string torch does not parse or a negative index, TypeError for
    another type, ValueError for CUDA where torch sees none."""
    if isinstance(device, bool) or not isinstance(device, (str, torch.device, int)):
        raise TypeError(f"{name} must be a str or torch.device, got a {type(device).__name__}: {device!r}")
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ValueError(f"{name} must name a torch device (cpu, cuda, cuda:N), got {device!r}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"{name} {dev}: CUDA is not available (no GPU visible, or a CPU build of torch)")
    return dev


def require_is_tensor(t, name: str) -> None:
    """Raise TypeError naming `name` unless t is a torch.Tensor."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")


def require_ndim(t, name: str, dims: str) -> torch.Size:
    """The shape of t, after a ValueError naming `name` unless t is a tensor with as many dimensions
    as `dims` names (e.g. "[M, K]")."""
    ndim = dims.count(",") + 1
    if not isinstance(t, torch.Tensor) or t.dim() != ndim:
        raise ValueError(f"{name} must be a {ndim}-D tensor {dims}, got {getattr(t, 'shape', type(t).__name__)}")
    return t.shape


def require_tensor(t, name: str, dtypes, shape, device=None) -> None:
    """Raise TypeError/ValueError naming `name` unless t is a tensor of one of `dtypes` (a dtype or
    a tuple), of `shape` (None entries: any size), with unit stride in its last dimension (when
    that has more than one element), on `device` (None: any)."""
    require_is_tensor(t, name)
    dtypes = dtypes if isinstance(dtypes, tuple) else (dtypes,)
    if t.dtype not in dtypes:
        raise TypeError(f"{name} must have dtype {' or '.join(map(str, dtypes))}, got {t.dtype}")
    if t.dim() != len(shape) or any(s is not None and s != d for s, d in zip(shape, t.shape)):
        want = tuple("*" if s is None else s for s in shape)
        raise ValueError(f"{name} must have shape {want}, got {tuple(t.shape)}")
    if t.dim() and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must have unit stride in its last dimension, got strides {t.stride()}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} must be on {device} like the other operands, got {t.device}")


def require_records(t, name: str, rec: int, device=None) -> None:
    """Raise TypeError/ValueError naming `name` unless t is a pool of contiguous cache records: a
    [S, rec] uint8 tensor whose rows are `rec` bytes apart (on `device`, None: any)."""
    require_ndim(t, name, f"[S, {rec}]")
    require_tensor(t, name, torch.uint8, (t.shape[0], rec), device)
    if t.shape[0] > 1 and t.stride(0) != rec:
        raise ValueError(f"{name} must have contiguous records (row stride {rec}), got strides {t.stride()}")


# The most warps a Triton launch of these ops takes (Triton: a power of two).
MAX_WARPS = 16


def require_int(v, name: str, lo: int = 1, hi: int | None = None, *, power_of_two: bool = False) -> int:
    """Raise ValueError naming `name` and v unless v is an int (a bool is not one) in lo..hi (hi
    None: no upper bound) and, with power_of_two, a power of two. Returns v."""
    if (isinstance(v, bool) or not isinstance(v, int) or v < lo or (hi is not None and v > hi)
            or (power_of_two and v & (v - 1))):
        kind = "a power of two" if power_of_two else "an int"
        if hi is not None:
            want = f"{kind} in {lo}..{hi}"
        elif power_of_two or lo not in (0, 1):
            want = f"{kind} >= {lo}"
        else:
            want = "a positive int" if lo == 1 else "a non-negative int"
        raise ValueError(f"{name} must be {want}, got {v!r}")
    return v


def require_num_warps(v, name: str = "num_warps") -> int:
    """`require_int` for a launch's warps: a power of two in 1..MAX_WARPS. Returns v."""
    return require_int(v, name, 1, MAX_WARPS, power_of_two=True)


def require_bool(v, name: str, optional: bool = False) -> None:
    """Raise TypeError naming `name` unless v is a bool (or, with optional, None)."""
    if not isinstance(v, bool) and not (optional and v is None):
        raise TypeError(f"{name} must be {'None, True or False' if optional else 'a bool'}, got {v!r}")


def planned_rows(plan, plan_type: type, t, name: str, dims: str) -> int:
    """The row count M of `t`, the first operand of a launch that takes a plan, after checking that
    `plan` is a `plan_type` (TypeError), that `t` is a tensor with as many dimensions as `dims`
    names (e.g. "[M, K]"; ValueError naming `name`) and that M <= plan.max_rows (ValueError)."""
    if not isinstance(plan, plan_type):
        raise TypeError(f"plan must be of type {plan_type.__name__}, got {type(plan).__name__}")
    m = require_ndim(t, name, dims)[0]
    if m > plan.max_rows:
        raise ValueError(f"{name} has {m} rows, more than the plan's max_rows={plan.max_rows}")
    return m


UE8M0_DTYPES = (torch.uint8, torch.float8_e8m0fnu)


def mxfp8_weight_args(weight, w_scale, max_rows, max_rows_limit: int) -> tuple[int, int]:
    """Check the weight side of a low-batch MXFP8 x FP8 linear plan (weight [N, K] float8_e4m3fn
    with K a positive multiple of 32, w_scale [ceil(N/32), K/32] UE8M0 on the weight's device, the
    weight on CUDA or under the interpreter, 32-bit offsets, 1 <= max_rows <= max_rows_limit) with
    errors naming the argument; returns (N, K)."""
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise ValueError(f"weight must be a 2-D [N, K] tensor, got "
                         f"{tuple(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__}")
    n, k = weight.shape
    if k % 32 or k == 0 or n == 0:
        raise ValueError(f"weight must be [N, K] with N >= 1 and K a positive multiple of 32, got {(n, k)}")
    require_tensor(weight, "weight", (torch.float8_e4m3fn,), (n, k))
    require_tensor(w_scale, "w_scale", UE8M0_DTYPES, (-(-n // 32), k // 32))
    if w_scale.device != weight.device:
        raise ValueError(f"w_scale is on {w_scale.device} but weight is on {weight.device}")
    if weight.device.type != "cuda" and not interpreting():
        raise ValueError(f"weight must be on a CUDA device (or TRITON_INTERPRET=1), got {weight.device}")
    if isinstance(max_rows, bool) or not isinstance(max_rows, int) or not 1 <= max_rows <= max_rows_limit:
        raise ValueError(f"max_rows must be an int in [1, {max_rows_limit}] (use ops.fp8_mm above), "
                         f"got {max_rows!r}")
    if n * max(weight.stride(0), k) >= 2**31:
        raise ValueError(f"weight {(n, k)} is too large for 32-bit offsets")
    return n, k


def mxfp8_linear_args(codes, x_scale, out, n: int, k: int, max_rows: int, device: torch.device) -> torch.Tensor:
    """Check the activation side of an MXFP8 x FP8 linear launch (codes [M, K] float8_e4m3fn,
    x_scale [M, K/32] UE8M0, out [M, N] BF16 or FP32, all on `device`, 1 <= M <= max_rows) with
    errors naming the argument; returns out, allocated as BF16 when None."""
    if not isinstance(codes, torch.Tensor) or codes.dim() != 2:
        raise ValueError(f"codes must be a 2-D [M, K] tensor, got "
                         f"{tuple(codes.shape) if isinstance(codes, torch.Tensor) else type(codes).__name__}")
    m = codes.shape[0]
    if m > 64:
        raise ValueError(f"codes has M={m} rows; the low-batch linears take at most 64: use the regular "
                         f"path ops.fp8_mm for more")
    if not 1 <= m <= max_rows:
        raise ValueError(f"codes has M={m} rows; this plan takes 1..{max_rows}")
    require_tensor(codes, "codes", (torch.float8_e4m3fn,), (m, k))
    require_tensor(x_scale, "x_scale", UE8M0_DTYPES, (m, k // 32))
    if out is None:
        out = torch.empty(m, n, dtype=torch.bfloat16, device=device)
    require_tensor(out, "out", (torch.bfloat16, torch.float32), (m, n))
    for name, t in (("codes", codes), ("x_scale", x_scale), ("out", out)):
        if t.device != device:
            raise ValueError(f"{name} is on {t.device} but the weight is on {device}")
    return out


def row_configs(config, cls: type, what: str, max_rows: int) -> list[tuple[int, object]]:
    """A plan's launch configurations by row bucket, checked: `config` is one `cls` instance (every
    call up to max_rows) or a dict {most rows: `cls` instance} that covers max_rows. what: how the
    errors name one (e.g. "an Int8Config"). Returns [(most rows, config)] ascending: a call of r
    rows takes the first with r <= most rows (`config_for_rows`)."""
    configs = config if isinstance(config, dict) else {max_rows: config}
    for c in configs.values():
        if not isinstance(c, cls):
            raise TypeError(f"config must be {what} or a dict of them, got {type(c).__name__}")
    if not configs or max(configs) < max_rows:
        raise ValueError(f"config must cover max_rows={max_rows} rows, got keys {sorted(configs)}")
    return sorted(configs.items())


def config_for_rows(configs: list[tuple[int, object]], rows: int):
    """The configuration of `row_configs`' list that a call of `rows` rows launches with."""
    return next(c for most, c in configs if rows <= most)


def rope_epilogue_args(rope, out: torch.Tensor, n: int, m: int, device: torch.device, name: str = "rope",
                       head: int = 512):
    """Check a linear's `rope=(cos, sin)` (its query RoPE epilogue): cos, sin [M, 32] float32 on
    `device`, the output BF16 and N a multiple of `head` (heads of 512). `name`, `head`: the same
    checks for another epilogue that rotates heads (`index_query_epilogue_args`). Returns (cos, sin)."""
    if not isinstance(rope, tuple) or len(rope) != 2:
        raise TypeError(f"{name} must be None or a (cos, sin) tuple, got {type(rope).__name__}")
    if n % head:
        raise ValueError(f"{name}: the weight's N = {n} is not a multiple of {head} (heads of {head})")
    if out.dtype != torch.bfloat16:
        raise ValueError(f"{name}: out must be bfloat16 (the rotated query), got {out.dtype}")
    cos, sin = rope
    require_tensor(cos, "cos", (torch.float32,), (m, 32), device)
    require_tensor(sin, "sin", (torch.float32,), (m, 32), device)
    return cos, sin


def index_query_epilogue_args(index_query, rope, out: torch.Tensor, n: int, m: int, device: torch.device,
                              block_n: int):
    """Check a linear's `index_query=(cos, sin)` (the indexer's query epilogue,
    `index_query.index_query_tile`): not together with `rope`, cos, sin [M, 32] float32 on
    `device`, the output BF16, N a multiple of 128 (index heads of 128), and the launch's tile of
    `block_n` weight rows a multiple of 32 (whole MX blocks; RoPE pairs are adjacent rows, always
    in one tile). Returns (cos, sin)."""
    if rope is not None:
        raise ValueError("index_query and rope are two epilogues of different linears: pass one")
    cos, sin = rope_epilogue_args(index_query, out, n, m, device, "index_query", 128)
    if block_n % 32:
        raise ValueError(f"index_query: the launch's tile of {block_n} weight rows splits an MXFP4 block of 32 "
                         f"between programs (use a configuration with block_n >= 32)")
    return cos, sin


def interpreting() -> bool:
    """True under the Triton interpreter (TRITON_INTERPRET=1): kernels run on the CPU in NumPy."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
