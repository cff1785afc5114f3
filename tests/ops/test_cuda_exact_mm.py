"""CudaExactMM (ops/cuda_exact_mm.py, ops/csrc/exact_digits_mm.cu): bitwise the reference's
`mxfp8_mm` on the GPU at small and real shapes, 1-16 rows, every instantiated configuration, BF16
and FP32 outputs, a CUDA graph's replays, and stream-K grids (calls in a row, graph replays); on
the CPU the source's sm_90 build (no spills, the instantiations the op knows) where nvcc is
present, and the errors that name the argument.

Tolerance: none. The op computes the contract's bits (each block's exact dot rounded once, the
scalings and the K-ordered FP32 sum), so every test compares bitwise."""

from __future__ import annotations

import re

import pytest
import torch

from dsv41_decode.formats import fp8_block_quantize, mxfp8_quantize
from dsv41_decode.ops import cuda_build
from dsv41_decode.ops.cuda_exact_mm import ROWS_PER_TILE, CudaExactConfig, CudaExactMM, compiled_kernels
from dsv41_decode.ops.exact_linear import ExactLinear
from dsv41_decode.reference.linear import mxfp8_mm
from dsv41_decode.testing.synthetic import heavy_e4m3


def _nvcc_or_skip():
    try:
        return cuda_build.find_nvcc()
    except cuda_build.CudaBuildError:
        pytest.skip("nvcc not found: the CUDA C++ build is checked where CUDA's compiler is installed")


def test_source_builds_for_sm90_without_spills(tmp_path, monkeypatch):
    _nvcc_or_skip()
    monkeypatch.setenv("DSV41_CUDA_CACHE", str(tmp_path))
    cubin, report = cuda_build.compile_cubin("exact_digits_mm.cu", "sm_90")
    assert cubin[:4] == b"\x7fELF"
    entries = re.findall(r"Compiling entry function '(\w+)'", report)
    spills = re.findall(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", report)
    assert sorted(entries) == sorted(CudaExactConfig(p, s, g, 0, mt).kernel(nt)
                                     for nt, p, s, g, mt in compiled_kernels())
    assert len(spills) == len(entries) and all(v == ("0", "0", "0") for v in spills), report
    # a second build of the same source and flags comes from the cache
    assert cuda_build.compile_cubin("exact_digits_mm.cu", "sm_90")[0] == cubin


def test_missing_nvcc_is_one_clear_error(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.setenv("CUDA_HOME", "/nonexistent")
    monkeypatch.setattr(cuda_build.os.path, "isfile", lambda p: False)
    with pytest.raises(cuda_build.CudaBuildError, match="nvcc .* not found"):
        cuda_build.find_nvcc()


def test_config_spec_reads_back_and_a_bad_one_names_the_form():
    for c in (CudaExactConfig(4, 3), CudaExactConfig(4, 4, 4, 2), CudaExactConfig(4, 3, 4, 1, 2)):
        assert CudaExactConfig.from_spec(c.spec) == c
    assert CudaExactConfig(4, 3, 4, 1, 2).spec == "p4s3g4m2k1"
    with pytest.raises(ValueError, match="p<warps>s<stages>g<blocks>"):
        CudaExactConfig.from_spec("p4s3")


def test_bad_weight_shape_names_the_argument():
    w = torch.zeros(40, 256, dtype=torch.float8_e4m3fn)
    s = torch.zeros(2, 8, dtype=torch.uint8)
    with pytest.raises(ValueError, match="weight"):
        CudaExactMM(w, s, 8)


def _operands(n, k, m, gen, heavy: bool):
    """An FP8 weight with 32x32 scales and m rows of MXFP8 x: heavy-tailed codes with random scale
    bytes (the hard roundings), or model-like values quantized as the step does."""
    dev = gen.device
    if heavy:
        w = heavy_e4m3((n, k), gen)
        ws = torch.randint(110, 140, (-(-n // 32), k // 32), generator=gen, device=dev, dtype=torch.uint8)
        x = heavy_e4m3((m, k), gen)
        xs = torch.randint(100, 150, (m, k // 32), generator=gen, device=dev, dtype=torch.uint8)
        return x, xs, w, ws
    w, ws = fp8_block_quantize(torch.randn(n, k, generator=gen, device=dev) * k ** -0.5)
    x, xs = mxfp8_quantize(torch.randn(m, k, generator=gen, device=dev).bfloat16())
    return x, xs, w, ws


GPU_SHAPES = [(64, 256), (1792, 5120), (4096, 1280), (5120, 8192), (32768, 1280)]


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", GPU_SHAPES)
@pytest.mark.parametrize("nt,p,s,g,mt", sorted(compiled_kernels()))
def test_gpu_bitwise_the_reference(n, k, nt, p, s, g, mt):
    gen = torch.Generator("cuda").manual_seed(n + k + 7 * nt + p + 3 * mt)
    c = CudaExactConfig(p, s, g, 0, mt)
    rows = sorted({ROWS_PER_TILE * (nt - 1) + 1, ROWS_PER_TILE * nt - 3, ROWS_PER_TILE * nt})
    for heavy in (True, False):
        for m in rows:
            x, xs, w, ws = _operands(n, k, m, gen, heavy)
            op = CudaExactMM(w, ws, ROWS_PER_TILE * nt, {8: c, 16: c})
            for dtype in (torch.bfloat16, torch.float32):
                want = mxfp8_mm(x, xs, w, ws, out_dtype=dtype)
                got = op(x, xs, torch.empty(m, n, dtype=dtype, device="cuda"))
                bad = (got.view(torch.int32 if dtype == torch.float32 else torch.int16)
                       != want.view(torch.int32 if dtype == torch.float32 else torch.int16)).nonzero()
                first = [(r, c, got[r, c].item(), want[r, c].item()) for r, c in bad[:6].tolist()]
                assert len(bad) == 0, (f"{n}x{k} rows={m} heavy={heavy} {dtype}: {len(bad)} outputs differ, "
                                       f"first (x row, weight row, got, want): {first}")


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(4096, 1280), (5120, 8192), (32768, 1280)])
@pytest.mark.parametrize("ctas_per_sm", [1, 2, 3])
def test_gpu_stream_k_bitwise_the_reference_call_after_call(n, k, ctas_per_sm):
    """Stream-K grids (fewer CTAs than tiles, tiles split between CTAs with the accumulator handed on):
    the reference's bits at 1-16 rows on heavy-tailed and model-like operands, in three calls in a row
    (the hand-over flags reset by their readers) and in a CUDA graph's replays."""
    gen = torch.Generator("cuda").manual_seed(n + k + ctas_per_sm)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    ran = 0
    for nt, (p, s, g, mt) in ((1, (4, 4, 4, 1)), (2, (4, 3, 4, 1)), (1, (4, 3, 4, 2)), (2, (4, 3, 4, 2))):
        if (nt, p, s, g, mt) not in compiled_kernels():
            continue
        c = CudaExactConfig(p, s, g, ctas_per_sm, mt)
        for heavy in (True, False):
            m = ROWS_PER_TILE * nt - (0 if heavy else 3)
            x, xs, w, ws = _operands(n, k, m, gen, heavy)
            try:
                op = CudaExactMM(w, ws, 16, {8: c, 16: c})
            except ValueError as e:                     # an SM holds fewer CTAs of this kernel
                assert "ctas_per_sm" in str(e)
                continue
            assert op.grids[(nt, c)] == min(n // c.tile_rows, ctas_per_sm * sms)
            if n == 32768:                              # tiles split between CTAs in every kernel
                assert op.grids[(nt, c)] < n // c.tile_rows
            want = mxfp8_mm(x, xs, w, ws)
            for call in range(3):
                got = op(x, xs)
                assert torch.equal(got.view(torch.int16), want.view(torch.int16)), \
                    (f"{n}x{k} rows={m} heavy={heavy} ctas_per_sm={ctas_per_sm} call {call}: "
                     f"{int((got.view(torch.int16) != want.view(torch.int16)).sum())} outputs differ")
            out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                op(x, xs, out)
            for _ in range(3):
                out.zero_()
                graph.replay()
                torch.cuda.synchronize()
                assert torch.equal(out.view(torch.int16), want.view(torch.int16))
            ran += 1
    assert ran or ctas_per_sm > 2, "an SM should hold two CTAs of every kernel"


@pytest.mark.gpu
def test_gpu_graph_replays_repeat_and_rows_take_their_bucket():
    gen = torch.Generator("cuda").manual_seed(3)
    n, k = 5120, 8192
    x, xs, w, ws = _operands(n, k, 16, gen, False)
    op = CudaExactMM(w, ws, 16)
    outs = {m: torch.empty(m, n, dtype=torch.bfloat16, device="cuda") for m in (1, 2, 4, 8, 16)}
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for m, o in outs.items():
            op(x[:m], xs[:m], o)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for m, o in outs.items():
            op(x[:m], xs[:m], o)
    firsts = []
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        firsts.append({m: o.clone() for m, o in outs.items()})
    for m, o in outs.items():
        want = mxfp8_mm(x[:m], xs[:m], w, ws)
        assert torch.equal(o.view(torch.int16), want.view(torch.int16)), f"rows={m}"
        assert all(torch.equal(f[m], o) for f in firsts)


def test_exact_linear_cuda_rows_checked_and_absent_where_it_does_not_build():
    gen = torch.Generator().manual_seed(1)
    w, ws = fp8_block_quantize(torch.randn(64, 256, generator=gen) * 0.06)
    with pytest.raises(ValueError, match="cuda_rows"):
        ExactLinear(w, ws, 8, cuda_rows=(1,))
    lin = ExactLinear(w, ws, 8, cuda_rows=(1, 8))       # no CUDA device here: the other ops run every call
    assert lin.cuda is None and lin.cuda_rows == (1, 0) and lin.op_for(4) is lin.cuda_cores


@pytest.mark.gpu
def test_gpu_exact_linear_runs_it_at_its_rows_with_the_same_bits():
    gen = torch.Generator("cuda").manual_seed(5)
    n, k = 4096, 1280
    x, xs, w, ws = _operands(n, k, 16, gen, False)
    base, lin = ExactLinear(w, ws, 16, cuda_rows=(1, 0)), ExactLinear(w, ws, 16, cuda_rows=(2, 16))
    assert base.cuda is None and lin.cuda_rows == (2, 16)
    assert lin.op_for(4) is lin.cuda and lin.op_for(1) is not lin.cuda and lin.op_for(4, True) is not lin.cuda
    for m in (1, 2, 5, 16):
        assert torch.equal(lin(x[:m], xs[:m]).view(torch.int16), base(x[:m], xs[:m]).view(torch.int16)), f"rows={m}"
