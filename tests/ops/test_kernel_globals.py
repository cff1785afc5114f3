"""Every Triton kernel and helper in dsv41_decode.ops reads only globals that compile on the GPU.

Triton's compiler rejects a `@triton.jit` function that reads a module global unless the global is
a `tl.constexpr`, another jit function or a module; the interpreter (which the CPU tests run) does
not, so the mistake would first show on a GPU. This walks each jit function's source and checks
the module globals it names.
"""

from __future__ import annotations

import ast
import builtins
import importlib
import inspect
import pkgutil
import textwrap
import types

import pytest
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

import dsv41_decode.ops as ops_pkg

# What @triton.jit returns: a JITFunction on a GPU, an InterpretedFunction under TRITON_INTERPRET=1.
# The interpreter module is imported explicitly: on a GPU nothing else imports it, so it is not an
# attribute of triton.runtime there.
_JIT_TYPES = (triton.runtime.JITFunction, InterpretedFunction)
# What @gluon.constexpr_function returns: a helper the compiler evaluates at compile time (layouts,
# form predicates), which a jit function may read as a global.
_CONSTEXPR_FUNCTION = triton.runtime.jit.ConstexprFunction


def _jit_functions():
    for info in pkgutil.iter_modules(ops_pkg.__path__):
        mod = importlib.import_module(f"dsv41_decode.ops.{info.name}")
        for name, obj in vars(mod).items():
            fn = getattr(obj, "fn", None)
            if isinstance(obj, _JIT_TYPES) and fn is not None and getattr(fn, "__module__", None) == mod.__name__:
                yield f"{info.name}.{name}", fn


def _allowed(value) -> bool:
    return (isinstance(value, (tl.constexpr, types.ModuleType, _CONSTEXPR_FUNCTION))
            or isinstance(value, _JIT_TYPES)
            or getattr(value, "__module__", "").startswith("triton"))


def _global_reads(fn) -> set[str]:
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    func = tree.body[0]
    local = {a.arg for a in func.args.args + func.args.kwonlyargs}
    for node in ast.walk(func):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            local.add(node.id)
    return {node.id for node in ast.walk(func)
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and node.id not in local}


KERNELS = sorted(_jit_functions())


def test_there_are_kernels_to_check():
    assert len(KERNELS) > 20


@pytest.mark.parametrize("name, fn", KERNELS, ids=[k for k, _ in KERNELS])
def test_jit_function_reads_only_constexpr_globals(name, fn):
    bad = []
    for g in sorted(_global_reads(fn)):
        if g in fn.__globals__:
            if not _allowed(fn.__globals__[g]):
                bad.append(f"{g} ({type(fn.__globals__[g]).__name__})")
        elif not hasattr(builtins, g):
            bad.append(f"{g} (undefined)")
    assert not bad, f"{name} reads non-constexpr globals: {', '.join(bad)}"


_NOT_CONSTEXPR = 448.0
_CONSTEXPR = tl.constexpr(448.0)


@triton.jit
def _reads_a_float_global(x_ptr):
    tl.store(x_ptr, tl.load(x_ptr) * _NOT_CONSTEXPR + _CONSTEXPR)


def test_the_check_catches_a_plain_global():
    fn = _reads_a_float_global.fn
    reads = _global_reads(fn)
    assert {"_NOT_CONSTEXPR", "_CONSTEXPR", "tl"} <= reads
    assert not _allowed(fn.__globals__["_NOT_CONSTEXPR"]) and _allowed(fn.__globals__["_CONSTEXPR"])
