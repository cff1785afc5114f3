"""tests/conftest.py's patches of Triton 3.6.0's frontend and interpreter give the values the
originals give (CPU; the kernels' own tests check the bits they compute under them)."""

import math

import pytest
import triton
import triton.language as tl
from triton.runtime import interpreter

pytestmark = pytest.mark.skipif(triton.__version__ != "3.6.0", reason="the patches apply to Triton 3.6.0 only")

TYPES = {
    "scalar": tl.float32,
    "ints": tl.block_type(tl.bfloat16, [4, 8]),
    "constexprs": tl.block_type(tl.int32, [tl.constexpr(16), tl.constexpr(2)]),
    "pointers": tl.block_type(tl.pointer_type(tl.float32), [2, 4, 1]),
}


@pytest.mark.parametrize("name", TYPES)
def test_a_tensors_shape_and_numel_are_its_types(name):
    ty = TYPES[name]
    dims = [int(tl.core._unwrap_if_constexpr(s)) for s in ty.shape] if ty.is_block() else []
    a, b = tl.tensor(None, ty), tl.tensor(None, ty)
    assert a.type is ty and a.dtype == ty.scalar
    assert isinstance(a.shape, tl.tuple) and all(isinstance(s, tl.constexpr) for s in a.shape)
    assert [s.value for s in a.shape] == dims
    assert isinstance(a.numel, tl.constexpr) and a.numel.value == math.prod(dims)
    # each tensor's own tuple (a tl.tuple can be assigned to), and an assigned shape is kept
    assert a.shape is a.shape and a.shape is not b.shape
    a.shape = tl.tuple([tl.constexpr(7)])
    assert [s.value for s in a.shape] == [7] and [s.value for s in b.shape] == dims


def test_overflow_check_is_off_only_where_its_assert_is():
    """The interpreter's overflow check only feeds `device_assert`, which emits nothing there
    (`debug` is off): its builders run without the check; the options' own default stays on."""
    for options in (interpreter.interpreter_builder.options, interpreter.InterpreterBuilder().options):
        assert options.debug is False
        assert options.sanitize_overflow is False
    assert interpreter.InterpreterOptions().sanitize_overflow is True
