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


def interpreting() -> bool:
    """True under the Triton interpreter (TRITON_INTERPRET=1): kernels run on the CPU in NumPy."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
