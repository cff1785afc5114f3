"""Compile a Triton kernel for sm_90 on any machine - no GPU: Triton ships ptxas and cuobjdump - to
read what the GPU would run: its PTX (tests/ops/test_pdl.py checks the PDL contract there), its
registers, stack and shared memory (scripts/sm90_resources.py) and its SASS instructions and loops
(scripts/sm90_sass.py); a Gluon linear kernel compiled as its plan launches it (`compile_linear`;
`GluonExactMM`'s: `compile_exact_mm`), the sparse MLA's pv second launch as its launcher does
(`compile_mla_pv`)."""

from __future__ import annotations

import re
import subprocess
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource


def compile_sm90(fn, types: dict, consts: dict, divisible=None, **options):
    """`fn` (a @triton.jit or @gluon.jit function, not the interpreter's) compiled for sm_90.

    types: Triton types of runtime arguments ("*bf16", "fp32", ...; default "i32"); consts: the
    constexpr arguments; divisible: arguments marked 16-divisible as the launcher would find them
    (default: every pointer and every argument named stride_*); options: Triton's (num_warps, ...).
    """
    # constexpr parameters with a default take it when not given (else they would compile as
    # runtime i32 arguments and a `if FLAG:` would trace both branches); the others must be given
    missing = [p.name for p in fn.params if p.is_constexpr and not p.has_default and p.name not in consts]
    if missing:
        raise ValueError(f"constexpr arguments without a default must be given: {missing}")
    consts = {**{p.name: p.default for p in fn.params if p.is_constexpr and p.has_default}, **consts}
    sig = {a: ("constexpr" if a in consts else types.get(a, "i32")) for a in fn.arg_names}
    if divisible is None:
        divisible = [a for a in fn.arg_names if sig[a].startswith("*") or a.startswith("stride_")]
    source = GluonASTSource if fn.is_gluon() else ASTSource
    src = source(fn, sig, {(fn.arg_names.index(k),): v for k, v in consts.items()},
                 {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in divisible})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def _cuobjdump(kernel, flag: str) -> str:
    """cuobjdump's output for the compiled kernel's cubin with `flag` (Triton ships the tool), run
    once per kernel and flag: the output is kept in the kernel's `asm` dict, as Triton keeps its own
    disassembly there ("sass") once asked. Disassembling a kernel takes ~0.3 s, and the compile
    tests read a kernel's SASS more than once (`sass`, `main_loop`, a test's own loop finders)."""
    key = f"cuobjdump {flag}"
    if key not in kernel.asm:
        tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
        with tempfile.TemporaryDirectory() as d:
            cubin = Path(d) / "k.cubin"
            cubin.write_bytes(kernel.asm["cubin"])
            kernel.asm[key] = subprocess.run([str(tool), flag, str(cubin)], capture_output=True, text=True,
                                             check=True).stdout
    return kernel.asm[key]


def resources(kernel) -> dict[str, int]:
    """REG, STACK, SHARED, LOCAL of a compiled kernel, from cuobjdump's resource usage."""
    out = _cuobjdump(kernel, "--dump-resource-usage")
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", out)
    if m is None:
        raise RuntimeError(f"no resource usage in cuobjdump's output: {out[:300]}")
    return dict(zip(("REG", "STACK", "SHARED", "LOCAL"), map(int, m.groups())))


_SASS_LINE = re.compile(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")


def sass(kernel) -> list[tuple[int, str]]:
    """The kernel's SASS instructions as (address, text), in order."""
    return [(int(m.group(1), 16), m.group(2)) for m in map(_SASS_LINE.match, _cuobjdump(kernel, "-sass").splitlines())
            if m]


_BRA = re.compile(r"\bBRA (?:`\()?0x([0-9a-f]+)")


def _backward_branches(ins: list[tuple[int, str]]):
    """(first, last) indices into `ins` (`sass`'s) of each loop: a branch back to an address of the
    kernel, and its target."""
    index = {addr: i for i, (addr, _) in enumerate(ins)}
    for i, (addr, text) in enumerate(ins):
        m = _BRA.search(text)
        if m and int(m.group(1), 16) < addr and int(m.group(1), 16) in index:
            yield index[int(m.group(1), 16)], i


def main_loop(kernel) -> list[str]:
    """The instructions of the kernel's longest backward-branch loop (its main loop), [] if none."""
    ins = sass(kernel)
    spans = list(_backward_branches(ins))
    if not spans:
        return []
    lo, hi = max(spans, key=lambda span: span[1] - span[0])
    return [text for _, text in ins[lo:hi + 1]]


def loops(kernel) -> list[list[str]]:
    """The SASS of each backward-branch loop of the kernel."""
    ins = sass(kernel)
    return [[t for _, t in ins[lo:hi + 1]] for lo, hi in _backward_branches(ins)]


def loop_with(kernel, opcode: str) -> list[str]:
    """The SASS of the innermost loop (backward branch) that holds every `opcode` instruction: in a
    warp-specialized linear the consumer's loop over the ring's slots."""
    ins = sass(kernel)
    hits = [i for i, (_, t) in enumerate(ins) if t.startswith(opcode)]
    _, lo, hi = min((hi - lo, lo, hi) for lo, hi in _backward_branches(ins) if lo <= hits[0] and hi >= hits[-1])
    return [t for _, t in ins[lo:hi + 1]]


def loops_with(kernel, opcode: str) -> list[list[str]]:
    """The SASS of each loop holding `opcode` instructions, in program order: the shortest
    backward-branch spans holding one, pairwise disjoint (a longer span that overlaps a chosen one,
    such as an mbarrier wait's retry branch placed past the loop, is not a loop of its own). A
    kernel with several copies of a loop (an exact linear's consumer with and without its fused
    scaling) has one each; where there is one, `loop_with`'s."""
    ins = sass(kernel)
    hits = [i for i, (_, t) in enumerate(ins) if t.startswith(opcode)]
    chosen: list[tuple[int, int]] = []
    for lo, hi in sorted(_backward_branches(ins), key=lambda span: span[1] - span[0]):
        if any(lo <= h <= hi for h in hits) and all(hi < c_lo or lo > c_hi for c_lo, c_hi in chosen):
            chosen.append((lo, hi))
    return [[t for _, t in ins[lo:hi + 1]] for lo, hi in sorted(chosen)]


def unpredicated(text: str) -> str:
    """A SASS instruction's text without its guard predicate (`@P0 `, `@!UP1 `, ...): its opcode
    with modifiers first."""
    return re.sub(r"^@!?U?P\w+\s+", "", text)


def opcode_counts(texts: list[str]) -> dict[str, int]:
    """How many of each opcode (predicates and modifiers dropped) the instructions hold."""
    counts: dict[str, int] = {}
    for t in texts:
        op = unpredicated(t).split()[0].split(".")[0]
        counts[op] = counts.get(op, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: -kv[1]))


def wgmma_ops(texts: list[str]) -> list[str]:
    """The wgmma instructions (`HGMMA`, `QGMMA`, ...) among SASS texts, without the warpgroup fences."""
    return [t for t in texts if "GMMA" in t and not t.startswith("WARPGROUP")]


# opcodes (by prefix) whose first register operand is not written: stores, reductions without a
# return value, compares into predicates, control and synchronization
_NO_DEST = ("ST", "BAR", "BRA", "BSSY", "BSYNC", "SYNCS", "WARPGROUP", "FENCE", "MEMBAR", "EXIT",
            "CCTL", "ERRBAR", "CGAERRBAR", "NOP", "ISETP", "FSETP", "DSETP", "HSETP2", "PLOP3", "FCHK", "UTMA")
_NO_DEST_OPS = ("RED", "REDG", "REDAS")   # exact base opcodes (REDUX writes a register)


def _written_registers(text: str) -> set[int]:
    """The general registers an instruction writes (its first register operand after any predicate
    destinations, as in `SHFL.IDX PT, R5, ...` or `ATOMG.E.ADD PT, R5, ...`; 64- and 128-bit forms
    2 or 4, `CS2R` 2 unless `.32`), empty for instructions without a register destination and for
    uniform ones."""
    t = unpredicated(text)
    op = t.split()[0]
    if (op.startswith(_NO_DEST) or op.split(".")[0] in _NO_DEST_OPS or op.startswith("U")
            or "GMMA" in op):
        return set()
    rest = re.sub(r"^(?:!?P(?:\d+|T)\s*,\s*)+", "", t[len(op):].strip())
    m = re.match(r"R(\d+)\b", rest)
    if m is None:
        return set()
    wide = ".128" in op or re.search(r"LDSM\S*\.4$", op)
    pair = (".64" in op or op.startswith("IMAD.WIDE") or re.search(r"LDSM\S*\.2$", op)
            or (op.split(".")[0] == "CS2R" and ".32" not in op))
    width = 4 if wide else 2 if pair else 1
    return set(range(int(m.group(1)), int(m.group(1)) + width))


def _read_registers(text: str) -> set[int]:
    """The general registers an instruction's source operands name (64-bit operands `Rn.64` as n,
    n + 1; its destination, where `_written_registers` finds one, left out)."""
    t = unpredicated(text)
    op = t.split()[0]
    rest = t[len(op):]
    if _written_registers(text):
        rest = re.sub(r"^(?:\s*!?P(?:\d+|T)\s*,)*\s*R\d+\s*,?", "", rest)
    regs: set[int] = set()
    for m in re.finditer(r"\bR(\d+)(\.64)?\b", rest):
        regs.update(range(int(m.group(1)), int(m.group(1)) + (2 if m.group(2) else 1)))
    return regs


def load_use_distances(loop: list[str]) -> list[tuple[str, int | None]]:
    """Each plain global load (`LDG`, not the asynchronous copies) of a loop's SASS with the number of
    instructions after it up to the first one of the same pass through the loop that reads its
    result (before anything rewrites it; None: none does, the result is read in a later pass).
    A short distance is a load whose latency the iteration waits for early."""
    out = []
    for i, t in enumerate(loop):
        if not unpredicated(t).startswith("LDG."):
            continue
        dest, dist = _written_registers(t), None
        for j, later in enumerate(loop[i + 1:], 1):
            if dest & _read_registers(later):
                dist = j
                break
            dest -= _written_registers(later)
            if not dest:
                break
        out.append((t, dist))
    return out


def wgmma_register_hazards(kernel) -> list[str]:
    """The instructions of the kernel's innermost loop around its register-A wgmmas (`HGMMA ... Rd,
    Ra, gdesc...` reads Ra..Ra+3) that write a register an in-flight wgmma still reads: after the
    wgmma and before a `WARPGROUP.DEPBAR.LE gsb0, N` retires its group (a group ends at the wgmma
    marked gsb0). The loop body is walked twice, so writes at the top of the next iteration count.
    [] when there is none, or no such loop."""
    ins = sass(kernel)
    index = {addr: i for i, (addr, _) in enumerate(ins)}
    body = None
    for i, (addr, text) in enumerate(ins):
        m = re.search(r"\bBRA (?:`\()?0x([0-9a-f]+)", text)
        j = index.get(int(m.group(1), 16)) if m else None
        if j is not None and j < i and any(re.search(r"GMMA\S*\s+R\d+, R\d+,", t) for _, t in ins[j:i]):
            if body is None or i - j < len(body):
                body = [t for _, t in ins[j:i + 1]]
    if body is None:
        return []
    groups, current, hazards = [], set(), []
    for t in body + body:
        a = re.search(r"GMMA\S*\s+R\d+, R(\d+),", t)
        if a:
            current |= set(range(int(a.group(1)), int(a.group(1)) + 4))
        if "GMMA" in t and not t.startswith("WARPGROUP") and "gsb0" in t:
            groups.append(current)
            current = set()
        m = re.match(r"WARPGROUP.DEPBAR.LE gsb0, 0x([0-9a-f]+)", t)
        if m:
            keep = int(m.group(1), 16)
            groups = groups[len(groups) - keep:] if keep else []
        if _written_registers(t) & set().union(current, *groups):
            hazards.append(t)
    return hazards


def print_cases(measure, cases, argv: list[str]) -> None:
    """The `main` of a compile-case script run in a subprocess: one JSON line of `measure(*case)` per
    case, the cases from argv (each "a:b:c", ints) or else `cases`."""
    import json
    for case in [tuple(map(int, a.split(":"))) for a in argv] or cases:
        print(json.dumps(measure(*case)), flush=True)


def fp8_desc_type(block) -> str:
    """The signature of a Gluon TMA descriptor of FP8 tiles `block`, as the launcher specializes it."""
    layout = gl.NVMMASharedLayout.get_default_for(block, gl.float8e4nv)
    return f"tensordesc<fp8e4nv[{block[0]}, {block[1]}],{layout!r}>"


def pdl_prologue(ptx: str) -> tuple[int, list[str]]:
    """What a kernel compiled for a launch by programmatic dependent launch does before its first
    `griddepcontrol.wait` (in its PTX's text order): (the TMA tensor copies there - a ring's
    prefilled weight tiles -, the other global accesses there: ld/st.global, volatile loads, atom,
    red, cp.async), the latter to be none (nothing its predecessor writes may be read or written
    before the wait) but for a gate's polls (`ops.pdl.gluon_gate_await`: volatile loads)."""
    body = ptx[ptx.index(".entry"):]
    before = body[:body.index("griddepcontrol.wait")]
    copies = len(re.findall(r"cp\.async\.bulk\.tensor", before))
    other = re.findall(r"\b(?:ld|st)(?:\.volatile)?\.global\S*|\batom\.\S+|\bred\.\S+|\bcp\.async\.c[ag]\S*",
                       before)
    return copies, other


def compile_linear(fn, opts: dict, w_box, x_box, out_f32: bool, types: dict | None = None,
                   consts: dict | None = None):
    """`fn`, a Gluon linear kernel (arguments w_desc, x_desc, sx_ptr, sw_ptr, y_ptr, ws_ptr,
    cnt_ptr, ...), compiled for sm_90 as its plan launches it: `opts` its module's
    `launch_options` (num_warps, maxnreg and enable_reflect_ftz go to Triton's options, the rest
    are constexpr arguments), the weight's and x's FP8 TMA boxes `w_box`, `x_box`, y FP32
    (`out_f32`) or BF16; `types` and `consts`: the kernel's other runtime argument types and
    constexpr arguments. N and y's row stride are 16-divisible, as the launcher sees the real
    shapes (the scale strides are not specialized)."""
    opts = dict(opts)
    launch = {k: opts.pop(k) for k in ("num_warps", "maxnreg", "enable_reflect_ftz") if k in opts}
    types = {"w_desc": fp8_desc_type(w_box), "x_desc": fp8_desc_type(x_box), "sx_ptr": "*i32", "sw_ptr": "*i32",
             "y_ptr": "*fp32" if out_f32 else "*bf16", "ws_ptr": "*fp32", "cnt_ptr": "*i32", **(types or {})}
    return compile_sm90(fn, types, {**opts, "OUT_F32": out_f32, **(consts or {})},
                        divisible=[a for a in fn.arg_names if a.endswith("_ptr") or a in ("N", "stride_ym")],
                        **launch)


def rope_epilogue(rope: bool) -> dict:
    """`compile_linear`'s `types` and `consts` for an exact linear kernel's query-RoPE epilogue
    arguments as its plan passes them (`exact_mm.rope_kwargs`): with `rope`, cos/sin FP32 pointers
    (their row strides runtime ints) and ROPE; without, all four None (constexprs: no kernel
    parameter)."""
    if rope:
        return {"types": {"cos_ptr": "*fp32", "sin_ptr": "*fp32"}, "consts": {"ROPE": True}}
    return {"consts": dict.fromkeys(("cos_ptr", "sin_ptr", "stride_cm", "stride_sm"))}


def compile_exact_mm(config, bt: int, split: int = 1, out_f32: bool = False, rope: bool = False):
    """`ops.gluon_exact_mm`'s kernel compiled for sm_90 as `GluonExactMM` launches `config` (a
    `GluonExactConfig`) at row bucket `bt` with `split` K splits, y FP32 (`out_f32`) or BF16, with or
    without the query-RoPE epilogue."""
    from ..ops import gluon_exact_mm as E
    return compile_linear(E._gluon_exact_mm_kernel, E.launch_options(config, bt, split),
                          [config.block_n, config.block_k], [bt, config.block_k], out_f32, **rope_epilogue(rope))


def compile_mla_pv(heads: int, window: int, topk: int, *, dims: int = 128, chunks: int = 1, ring: int = 0,
                   maxnreg: int | None = None, release: bool = False):
    """`ops.gluon_sparse_mla_pv`'s kernel (the sparse MLA's "pv" second launch) compiled for sm_90 as
    `mla_pv_` launches it for `heads` heads, `window` window slots and `topk` compressed entries a
    row, with the packed FP4 LUT decode: `dims`-wide slices (`pv_dims`), `chunks` a program
    (`pv_chunks`), a ring of `ring` slots (`pv_stages`; 0: none), at the register cap `maxnreg`
    (None: the launcher's default); release: its programs let a PDL successor launch (`mla_pv_`)."""
    from ..ops import gluon_sparse_mla as G, gluon_sparse_mla_pv as PV
    base = G.GluonSparseMlaPlan.build(1, heads, window, topk, "cpu").base
    types = {"p_ptr": "*bf16", "part_ml_ptr": "*fp32", "flag_ptr": "*i32", "wpool_ptr": "*u8", "cpool_ptr": "*u8",
             "wtab_ptr": "*i32", "ctab_ptr": "*i32", "sink_ptr": "*fp32", "out_ptr": "*i16"}
    consts = dict(W=window, W_P2=1 << (window - 1).bit_length(), KC=topk, NB=base.n_blocks,
                  NB_P2=max(2, 1 << (base.n_blocks - 1).bit_length()), PH=base.block_h, CPP=chunks,
                  FP4_PACKED=True, FP4_LUT=True, DW=dims, RING=ring, RELEASE=release)
    return compile_sm90(PV._gluon_mla_pv_kernel, types, consts, num_warps=PV.NUM_WARPS,
                        maxnreg=PV._MAXNREG if maxnreg is None else maxnreg)
