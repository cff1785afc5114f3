"""Test-wide settings."""

import os


def _cpu_has_avx512() -> bool:
    """Whether this (Linux) CPU has the AVX-512 subsets OpenBLAS's SkylakeX kernels use."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = set(f.read().split())
    except OSError:
        return False
    return {"avx512f", "avx512bw", "avx512dq", "avx512vl"} <= flags


# Triton's interpreter computes tl.dot with numpy's matmul (OpenBLAS), and the interpreter tests of
# batch invariance (a row alone gives the bits of the same row among others: test_batch_invariance,
# test_step's teacher forcing, test_prefill's chunk invariance) need its sums to come out the same
# in both calls. OpenBLAS picks its kernels by CPU or by OPENBLAS_CORETYPE: with its AVX-512
# "SkylakeX" kernels they do, with the AVX2 "Haswell" ones (which some machines' environments
# force: OPENBLAS_CORETYPE=Haswell) four of those tests fail. So the tests run the SkylakeX kernels
# wherever the CPU has AVX-512, whatever the environment says; set before numpy loads OpenBLAS
# (torch imports numpy).
if _cpu_has_avx512():
    os.environ["OPENBLAS_CORETYPE"] = "SkylakeX"

import pytest  # noqa: E402
import torch  # noqa: E402

# Without a GPU, Triton kernels run in Triton's interpreter; the variable must be set before any
# kernel module is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The reference works on tiny tensors: one intra-op thread is faster than two, and much faster
# when the two cores are shared with other work (OpenMP workers spin-wait).
torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    # The files holding tests marked slow run first, each file's tests in their order: pytest-xdist
    # hands whole files to its workers in the collection's order (pyproject.toml: --dist loadfile
    # --no-loadscope-reorder), so the long files start at once and the short ones fill in at the
    # end, instead of a long file starting last while the other worker idles.
    slow = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (marked gpu)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# Triton's interpreter patches triton.language's builtins while it runs a kernel, and after some
# kernels (those whose helpers use static_range, range, multiple_of, ... from another module) it
# leaves six of them patched (range, static_range, static_assert, multiple_of, max_contiguous,
# max_constancy); an sm_90 compile later in the same process (the Gluon kernels' tests) then
# traces its loops with the interpreter's objects and fails. Which tests share a process depends
# on the order and on pytest-xdist's split, so every test ends with the modules as imported.
import triton.language as _tl  # noqa: E402

_LANGUAGE_AS_IMPORTED = [(module, dict(vars(module))) for module in (_tl, _tl.core)]


@pytest.fixture(autouse=True)
def _triton_language_as_imported():
    yield
    for module, names in _LANGUAGE_AS_IMPORTED:
        now = vars(module)
        for name, value in names.items():
            if now.get(name) is not value:
                setattr(module, name, value)


# A kernel's launch in the interpreter patches triton.language for the kernel's run, and then every
# call of a @triton.jit helper from the kernel patches it again (`InterpretedFunction.__call__` runs
# `_patch_lang`: inspect.getmembers over the language modules, ~15 % of a decode step's time in the
# interpreter). Where the modules the helper sees are patched already (their `load` is no longer the
# builtin) that re-patch replaces nothing - a patched builtin is no builtin any more - and sets the
# same interpreter objects again, so the helper runs without it; elsewhere it runs as before.
# Triton 3.6.0's interpreter (requirements-cpu.txt's pin), whose call this repeats.
import dataclasses  # noqa: E402
import math  # noqa: E402

import numpy as np  # noqa: E402
import triton  # noqa: E402
from triton.runtime import interpreter as _interpreter  # noqa: E402


def _helper_call(self, *args, **kwargs):
    langs = [value for value in self.fn.__globals__.values() if value is _tl or value is _tl.core]
    if not langs or any(_tl.core.is_builtin(lang.load) for lang in langs):
        _interpreter._patch_lang(self.fn)
    fn = self.rewrite()
    try:
        return fn(*args, **kwargs)
    except Exception as e:
        raise _interpreter.InterpreterError(repr(e)) from e


# The NumPy dtype that holds a Triton dtype's values (BF16 as uint16, FP8 as uint8, pointers as
# uint64): the interpreter's `_get_np_dtype` builds its 17-entry table on each of its calls (several
# per interpreted operation, ~8 % of a decode step's time); the same table, built once.
_NP_DTYPES = {
    _tl.int1: np.dtype(bool), _tl.float16: np.dtype(np.float16), _tl.float32: np.dtype(np.float32),
    _tl.float64: np.dtype(np.float64), _tl.int8: np.dtype(np.int8), _tl.uint8: np.dtype(np.uint8),
    _tl.int16: np.dtype(np.int16), _tl.uint16: np.dtype(np.uint16), _tl.int32: np.dtype(np.int32),
    _tl.uint32: np.dtype(np.uint32), _tl.int64: np.dtype(np.int64), _tl.uint64: np.dtype(np.uint64),
    _tl.bfloat16: np.dtype(np.uint16), _tl.float8e5: np.dtype(np.uint8), _tl.float8e5b16: np.dtype(np.uint8),
    _tl.float8e4nv: np.dtype(np.uint8), _tl.float8e4b8: np.dtype(np.uint8), _tl.float8e4b15: np.dtype(np.uint8),
}


def _np_dtype(tt_dtype):
    if isinstance(tt_dtype, _tl.block_type):
        tt_dtype = tt_dtype.element_ty
    if isinstance(tt_dtype, _tl.pointer_type):
        return np.dtype(np.uint64)
    return _NP_DTYPES[tt_dtype]


# Every interpreted operation builds the types of its results, and two of their derived values
# cost more than the operation's NumPy work: a `tl.tuple`'s type (a `tuple_type` with a name
# string, built for every block shape) and a `block_type`'s name (a string of its shape). Both are
# pure functions of values fixed at construction (a tuple's `_setitem` sets its type again), so
# they are computed on first use instead (~25 % of a decode step's time in the interpreter); a
# block_type whose shape holds ints or constexprs of ints reads them directly instead of through
# `_unwrap_shape` (another ~5-10 %); other shapes go the original way. Likewise a tensor's `shape`
# (a `tl.tuple` of constexprs) and `numel`, pure functions of its type, which no operation replaces:
# computed on first use instead of in every result's constructor (most results are never asked;
# another ~30 % of a decode step's time in the interpreter). The compile tests' frontend builds the
# same types, and sees the same values.
from triton._utils import validate_block_shape as _validate_block_shape  # noqa: E402

_core = _tl.core
_BLOCK_TYPE_INIT = _core.block_type.__init__


def _tuple_type_init(self, types, fields=None):
    self.types = types
    self.fields = fields or [''] * len(types)


def _tuple_type_name(self):
    return '[' + ','.join([f"{k}:{v}" for k, v in zip(self.fields, self.types)]) + ']'


def _tuple_init(self, args, type=None):
    self.values = [i for i in args]
    self.type = type if type is None or isinstance(type, _core.tuple_type) else _core.tuple_type(type)


def _tuple_type_get(self):
    t = self.__dict__.get("_type")
    if t is None:
        t = self.__dict__["_type"] = _core._type_for_tuple_values(self.values)
    return t


def _set_type(self, t):
    self.__dict__["_type"] = t


def _block_type_init(self, element_ty, shape):
    kind = type(shape)
    if kind is list or kind is _core.tuple:
        ints = []
        for s in (shape if kind is list else shape.values):
            if type(s) is int:
                ints.append(s)
            elif type(s) is _core.constexpr and type(s.value) is int:
                ints.append(s.value)
            else:
                break
        else:
            if ints:
                self.element_ty = element_ty
                self.shape = _core.tuple(ints)
                self.numel = _validate_block_shape(ints)
                return
    _BLOCK_TYPE_INIT(self, element_ty, shape)


def _block_type_name_get(self):
    n = self.__dict__.get("_name")
    if n is None:
        n = self.__dict__["_name"] = f'<{self.shape}, {self.element_ty}>'
    return n


def _set_name(self, n):
    self.__dict__["_name"] = n


def _tensor_init(self, handle, type):
    self.handle = handle
    self.type = type
    self.dtype = type.scalar


def _tensor_shape_get(self):
    s = self.__dict__.get("_shape")
    if s is None:
        s = self.__dict__["_shape"] = _core.tuple([_core.constexpr(v) for v in
                                                   (self.type.shape if self.type.is_block() else ())])
    return s


def _tensor_shape_set(self, s):
    self.__dict__["_shape"] = s


def _tensor_numel_get(self):
    n = self.__dict__.get("_numel")
    if n is None:
        n = self.__dict__["_numel"] = _core.constexpr(math.prod(self.type.shape if self.type.is_block() else ()))
    return n


def _tensor_numel_set(self, n):
    self.__dict__["_numel"] = n


# The interpreter's options have `debug` off, so `device_assert` emits nothing there; its integer
# overflow check (`sanitize_overflow`, on) still runs each 32-bit int add, sub and mul again in
# int64 with two compares and an and, whose condition that assert then drops: dead work (~35 % of
# a decode step's time in the interpreter), turned off in the interpreter's options (the compiler's
# are its own).
_INTERPRETER_BUILDER_INIT = _interpreter.InterpreterBuilder.__init__


def _interpreter_builder_init(self):
    _INTERPRETER_BUILDER_INIT(self)
    self.options = dataclasses.replace(self.options, sanitize_overflow=False)


if triton.__version__ == "3.6.0":
    _interpreter.InterpretedFunction.__call__ = _helper_call
    _interpreter._get_np_dtype = _np_dtype
    _core.tuple_type.__init__ = _tuple_type_init
    _core.tuple_type.name = property(_tuple_type_name)
    _core.tuple.__init__ = _tuple_init
    _core.tuple.type = property(_tuple_type_get, _set_type)
    _core.block_type.__init__ = _block_type_init
    _core.block_type.name = property(_block_type_name_get, _set_name)
    _core.tensor.__init__ = _tensor_init
    _core.tensor.shape = property(_tensor_shape_get, _tensor_shape_set)
    _core.tensor.numel = property(_tensor_numel_get, _tensor_numel_set)
    _interpreter.InterpreterBuilder.__init__ = _interpreter_builder_init
    _interpreter.interpreter_builder.options = dataclasses.replace(_interpreter.interpreter_builder.options,
                                                                  sanitize_overflow=False)
