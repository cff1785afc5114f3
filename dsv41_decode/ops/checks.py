"""Argument checks shared by the op launchers: errors that name the argument at fault."""

from __future__ import annotations

import os

import torch


def require_tensor(t, name: str, dtypes, shape, device=None) -> None:
    """Raise TypeError/ValueError naming `name` unless t is a tensor of one of `dtypes` (a dtype or
    a tuple), of `shape` (None entries: any size), with unit stride in its last dimension (when
    that has more than one element), on `device` (None: any)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
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


def planned_rows(plan, plan_type: type, t, name: str, dims: str) -> int:
    """The row count M of `t`, the first operand of a launch that takes a plan, after checking that
    `plan` is a `plan_type` (TypeError), that `t` is a tensor with as many dimensions as `dims`
    names (e.g. "[M, K]"; ValueError naming `name`) and that M <= plan.max_rows (ValueError)."""
    if not isinstance(plan, plan_type):
        raise TypeError(f"plan must be of type {plan_type.__name__}, got {type(plan).__name__}")
    ndim = dims.count(",") + 1
    if not isinstance(t, torch.Tensor) or t.dim() != ndim:
        raise ValueError(f"{name} must be a {ndim}-D tensor {dims}, got {getattr(t, 'shape', type(t).__name__)}")
    m = t.shape[0]
    if m > plan.max_rows:
        raise ValueError(f"{name} has {m} rows, more than the plan's max_rows={plan.max_rows}")
    return m


def interpreting() -> bool:
    """True under the Triton interpreter (TRITON_INTERPRET=1): kernels run on the CPU in NumPy."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
