"""Compile a Triton kernel for sm_90 on any machine - no GPU: Triton ships ptxas and cuobjdump - to
read what the GPU would run: its PTX (tests/ops/test_pdl.py checks the PDL contract there) and its
registers, stack and shared memory (scripts/sm90_resources.py)."""

from __future__ import annotations

import re
import subprocess
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource


def compile_sm90(fn, types: dict, consts: dict, divisible=None, **options):
    """`fn` (a @triton.jit function, not the interpreter's) compiled for sm_90.

    types: Triton types of runtime arguments ("*bf16", "fp32", ...; default "i32"); consts: the
    constexpr arguments; divisible: arguments marked 16-divisible as the launcher would find them
    (default: every pointer and every argument named stride_*); options: Triton's (num_warps, ...).
    """
    sig = {a: ("constexpr" if a in consts else types.get(a, "i32")) for a in fn.arg_names}
    if divisible is None:
        divisible = [a for a in fn.arg_names if sig[a].startswith("*") or a.startswith("stride_")]
    src = ASTSource(fn, sig, {(fn.arg_names.index(k),): v for k, v in consts.items()},
                    {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in divisible})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def resources(kernel) -> dict[str, int]:
    """REG, STACK, SHARED, LOCAL of a compiled kernel, from cuobjdump's resource usage."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.TemporaryDirectory() as d:
        cubin = Path(d) / "k.cubin"
        cubin.write_bytes(kernel.asm["cubin"])
        out = subprocess.run([str(tool), "--dump-resource-usage", str(cubin)], capture_output=True, text=True,
                             check=True).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", out)
    if m is None:
        raise RuntimeError(f"no resource usage in cuobjdump's output: {out[:300]}")
    return dict(zip(("REG", "STACK", "SHARED", "LOCAL"), map(int, m.groups())))
