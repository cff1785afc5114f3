"""CUDA C++ kernels built on first use and launched through the CUDA driver API (for the pieces the
Triton / Gluon tiers cannot express; docs/gemm.md, "CudaExactMM").

A source file under `ops/csrc/` is compiled by `nvcc` (found on PATH, under $CUDA_HOME or
/usr/local/cuda) to a cubin for the device's architecture, once per (source, flags, compiler),
cached under $DSV41_CUDA_CACHE (default ~/.cache/dsv41_decode/cuda); the cubin is loaded into the
device's primary context (the one PyTorch uses) with `cuModuleLoadData` and its `extern "C"`
kernels launched with `cuLaunchKernel` on PyTorch's current stream, so that they order with
PyTorch's work and are captured into CUDA graphs like any other launch. libcuda is reached through
ctypes: no PyTorch headers and no extension build.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import torch

CSRC = Path(__file__).with_name("csrc")
# Exact arithmetic needs these: no FMA contraction, no flushed subnormals (the nvcc defaults besides
# --fmad), so that every rounding is the source's.
NVCC_FLAGS = ("-O3", "-std=c++17", "--fmad=false", "-ftz=false", "-prec-div=true", "-prec-sqrt=true")
_CU_FUNC_ATTRIBUTE_NUM_REGS = 4
_CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES = 3
_CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8


class CudaBuildError(RuntimeError):
    """nvcc missing or failing, or the driver refusing a module or launch (the message says which)."""


def find_nvcc() -> str:
    """The path of nvcc: on PATH, else $CUDA_HOME/bin, else /usr/local/cuda/bin; CudaBuildError if none."""
    for cand in (shutil.which("nvcc"), os.path.join(os.environ.get("CUDA_HOME", ""), "bin", "nvcc"),
                 "/usr/local/cuda/bin/nvcc"):
        if cand and os.path.isfile(cand) and os.access(cand, os.X_OK):
            return cand
    raise CudaBuildError("nvcc (CUDA's compiler) not found on PATH, under $CUDA_HOME or in /usr/local/cuda: "
                         "the CUDA C++ kernels are built on first use with it")


def cache_dir() -> Path:
    return Path(os.environ.get("DSV41_CUDA_CACHE", Path.home() / ".cache" / "dsv41_decode" / "cuda"))


def compile_cubin(source: str, arch: str, extra_flags: tuple[str, ...] = ()) -> tuple[bytes, str]:
    """(cubin bytes, ptxas's report) of `ops/csrc/<source>` for `arch` (e.g. "sm_90"), from the cache
    when the source, flags and compiler version are unchanged. CudaBuildError with nvcc's output on
    failure."""
    nvcc = find_nvcc()
    src = (CSRC / source).read_bytes()
    flags = (*NVCC_FLAGS, f"-arch={arch}", *extra_flags)
    version = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=False).stdout
    key = hashlib.sha256(src + repr(flags).encode() + version.encode()).hexdigest()[:24]
    out = cache_dir() / f"{Path(source).stem}-{arch}-{key}.cubin"
    report = out.with_suffix(".ptxas.txt")
    if out.is_file() and report.is_file():
        return out.read_bytes(), report.read_text()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(f".tmp{os.getpid()}")
    done = subprocess.run([nvcc, "-cubin", *flags, "-Xptxas", "-v", "-o", str(tmp), str(CSRC / source)],
                          capture_output=True, text=True, check=False)
    if done.returncode:
        raise CudaBuildError(f"nvcc failed on {source} ({' '.join(flags)}):\n{done.stderr.strip()}")
    report.write_text(done.stderr)
    os.replace(tmp, out)
    return out.read_bytes(), done.stderr


@functools.lru_cache(maxsize=1)
def _libcuda():
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        raise CudaBuildError(f"libcuda.so.1 (the CUDA driver) could not be loaded: {e}") from None
    p, vp, i, u, sz = ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, ctypes.c_uint, ctypes.c_size_t
    sigs = {
        "cuGetErrorString": (i, ctypes.POINTER(ctypes.c_char_p)),
        "cuCtxGetCurrent": (vp,),
        "cuModuleLoadData": (vp, p),
        "cuModuleGetFunction": (vp, p, ctypes.c_char_p),
        "cuModuleGetGlobal_v2": (ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(sz), p, ctypes.c_char_p),
        "cuMemcpyDtoH_v2": (p, ctypes.c_uint64, sz),
        "cuFuncSetAttribute": (p, i, i),
        "cuFuncGetAttribute": (ctypes.POINTER(i), i, p),
        "cuLaunchKernel": (p, u, u, u, u, u, u, u, p, vp, vp),
        "cuOccupancyMaxActiveBlocksPerMultiprocessor": (ctypes.POINTER(i), p, i, sz),
    }
    for name, argtypes in sigs.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, i
    return lib


def _check(rc: int, what: str) -> None:
    if rc:
        msg = ctypes.c_char_p()
        _libcuda().cuGetErrorString(rc, ctypes.byref(msg))
        raise CudaBuildError(f"{what}: CUDA driver error {rc} ({(msg.value or b'?').decode()})")


@dataclass(frozen=True)
class CudaFunction:
    """One loaded kernel: its handle, registers and local (spill) bytes a thread, and the dynamic
    shared memory it was allowed."""

    name: str
    handle: int
    registers: int
    local_bytes: int
    smem: int

    def resident_ctas(self, threads: int) -> int:
        """How many CTAs of `threads` threads (and `self.smem` bytes of shared memory) an SM holds at once."""
        n = ctypes.c_int()
        _check(_libcuda().cuOccupancyMaxActiveBlocksPerMultiprocessor(ctypes.byref(n), self.handle, threads, self.smem),
               f"occupancy of {self.name}")
        return n.value

    def launch(self, grid: tuple[int, int, int], threads: int, stream: int, args: list[tuple[str, int]]) -> None:
        """Launch on `stream` (a CUDA stream handle, e.g. torch.cuda.current_stream().cuda_stream) with
        `self.smem` bytes of dynamic shared memory; args: ("p", pointer) or ("i", int32) in the
        kernel's parameter order."""
        values = [ctypes.c_uint64(v) if kind == "p" else ctypes.c_int32(v) for kind, v in args]
        params = (ctypes.c_void_p * len(values))(*[ctypes.cast(ctypes.byref(v), ctypes.c_void_p) for v in values])
        _check(_libcuda().cuLaunchKernel(self.handle, grid[0], grid[1], grid[2], threads, 1, 1, self.smem,
                                         stream, params, None), f"launching {self.name}")


class CudaModule:
    """A cubin loaded into `device`'s primary context (PyTorch's): its kernels and device integers."""

    def __init__(self, cubin: bytes, device: torch.device):
        device = torch.device(device)
        if device.type != "cuda":
            raise ValueError(f"CUDA C++ kernels run on a CUDA device, got {device}")
        self.device = device
        with torch.cuda.device(device):
            torch.zeros(1, device=device)           # the runtime makes the primary context current here
            ctx = ctypes.c_void_p()
            _check(_libcuda().cuCtxGetCurrent(ctypes.byref(ctx)), "cuCtxGetCurrent")
            if not ctx.value:
                raise CudaBuildError(f"no current CUDA context on {device} after PyTorch's first use of it")
            handle = ctypes.c_void_p()
            _check(_libcuda().cuModuleLoadData(ctypes.byref(handle), ctypes.create_string_buffer(cubin, len(cubin))),
                   "loading the cubin")
        self.handle = handle.value
        self._functions: dict[tuple[str, int], CudaFunction] = {}
        self._ints: dict[str, int] = {}

    def global_int(self, name: str) -> int:
        """The value of the module's `extern "C" __device__ int <name>` (read once)."""
        if name in self._ints:
            return self._ints[name]
        lib, ptr, size = _libcuda(), ctypes.c_uint64(), ctypes.c_size_t()
        with torch.cuda.device(self.device):
            _check(lib.cuModuleGetGlobal_v2(ctypes.byref(ptr), ctypes.byref(size), self.handle, name.encode()),
                   f"finding {name}")
            value = ctypes.c_int32()
            _check(lib.cuMemcpyDtoH_v2(ctypes.byref(value), ptr.value, 4), f"reading {name}")
        self._ints[name] = value.value
        return value.value

    def function(self, name: str, smem: int = 0) -> CudaFunction:
        """Kernel `name`, allowed `smem` bytes of dynamic shared memory (above 48 KB by the attribute);
        looked up once per (name, smem), so the plans that share a kernel share its handle."""
        if (name, smem) in self._functions:
            return self._functions[(name, smem)]
        lib, fn = _libcuda(), ctypes.c_void_p()
        with torch.cuda.device(self.device):
            _check(lib.cuModuleGetFunction(ctypes.byref(fn), self.handle, name.encode()), f"finding kernel {name}")
            if smem > 48 * 1024:
                _check(lib.cuFuncSetAttribute(fn, _CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem),
                       f"allowing {name} {smem} bytes of shared memory")
            regs, local = ctypes.c_int(), ctypes.c_int()
            _check(lib.cuFuncGetAttribute(ctypes.byref(regs), _CU_FUNC_ATTRIBUTE_NUM_REGS, fn), "registers")
            _check(lib.cuFuncGetAttribute(ctypes.byref(local), _CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES, fn), "local bytes")
        self._functions[(name, smem)] = CudaFunction(name, fn.value, regs.value, local.value, smem)
        return self._functions[(name, smem)]


@functools.lru_cache(maxsize=None)
def load_module(source: str, device_index: int) -> CudaModule:
    """`ops/csrc/<source>` built for CUDA device `device_index`'s architecture and loaded there (once
    per process)."""
    major, minor = torch.cuda.get_device_capability(device_index)
    cubin, _ = compile_cubin(source, f"sm_{major}{minor}")
    return CudaModule(cubin, torch.device("cuda", device_index))
