"""ops/fp8_mm.py (the regular MXFP8 GEMM) against reference/linear.py.

Two references (architecture.md section 3): tight, rel RMS < 1e-3, against `mxfp8_mm` on the same
codes and scales (isolates the kernel: only the FP32 summation order and, on the GPU, the FP8
tensor-core accumulation inside a 32-deep dot may differ, about 1e-7, then the BF16 output rounding,
a rare one-ulp flip: a share f of elements one ulp off, at most 2^-7 of the element, gives a
relative RMS of at most 2^-7 sqrt(f), so 1e-3 allows f up to 1.6 %, while a flip needs a sum within
~1e-7 relative of a BF16 rounding midpoint, about 2^-14 of the elements); loose, rel RMS < 3e-2,
against the BF16 product of the unquantized activation and the checkpoint's weight values (FP8 in
the checkpoint, dequantized): that bounds the error the op adds by quantizing its input, about 2.7%
RMS for Gaussian data (E4M3 keeps 3 mantissa bits: spacing / sqrt(12) against the value).
"""

import pytest
import torch

from dsv41_decode.formats import fp8_block_dequantize, fp8_block_quantize, mxfp8_dequantize, mxfp8_quantize
from dsv41_decode.ops.fp8_mm import Fp8MmConfig, fp8_linear, fp8_mm, fp8_mm_, fp8_mm_config
from dsv41_decode.reference import linear as ref
from dsv41_decode.testing.compare import rel_rms

_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _operands(m: int, n: int, k: int, seed: int):
    """(x BF16 [m, k], w_true BF16 [n, k], weight codes [n, k], w_scale [ceil(n/32), k/32]) with
    magnitudes that vary per row of x and per 32x32 tile of w, so that every scale matters."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.exp2(torch.randint(-6, 7, (m, 1), generator=g).float())
    tiles = torch.exp2(torch.randint(-12, -2, ((n + 31) // 32, k // 32), generator=g).float())
    w = torch.randn(n, k, generator=g) * tiles.repeat_interleave(32, 0)[:n].repeat_interleave(32, 1)
    w = w.bfloat16()
    weight, w_scale = fp8_block_quantize(w)
    return x.bfloat16(), w, weight, w_scale


def _to(*ts):
    return [t.to(_DEVICE) for t in ts]


@pytest.mark.parametrize("m", [1, 3, 37, 130])
@pytest.mark.parametrize("n", [64, 96])
@pytest.mark.parametrize("k", [64, 128])
def test_tight_against_the_reference(m, n, k):
    # the loose bound (the error quantizing the input adds): test_loose_against_unquantized_activation
    x, _, weight, w_scale = _operands(m, n, k, seed=m * 1000 + n * 10 + k)
    codes, x_scale = mxfp8_quantize(x)
    y = fp8_mm(*_to(codes, x_scale, weight, w_scale)).cpu()
    assert y.dtype == torch.bfloat16 and y.shape == (m, n)
    assert rel_rms(y, ref.mxfp8_mm(codes, x_scale, weight, w_scale)) < 1e-3


@pytest.mark.parametrize("m,n,k", [(1, 256, 512), (37, 96, 128), (130, 64, 256)])
def test_loose_against_unquantized_activation(m, n, k):
    """The error the op adds by quantizing its input, on Gaussian data with weights of one scale
    (the tight test's tiles span 2^10, where a few tiles dominate each output and the estimate
    spreads): expected ~2.65% for E4M3 (spacing / sqrt(12) averaged over the mantissa), bound 3e-2."""
    g = torch.Generator().manual_seed(m + n + k)
    x = torch.randn(m, k, generator=g).bfloat16()
    weight, w_scale = fp8_block_quantize(torch.randn(n, k, generator=g) * k ** -0.5)
    codes, x_scale = mxfp8_quantize(x)
    y = fp8_mm(*_to(codes, x_scale, weight, w_scale)).cpu()
    assert rel_rms(y, x.float() @ fp8_block_dequantize(weight, w_scale).T) < 3e-2


@pytest.mark.parametrize("cfg", [
    Fp8MmConfig(128, 128, 128, group_m=8, num_warps=8, num_stages=4),
    Fp8MmConfig(64, 128, 64, group_m=2, num_warps=4, num_stages=3),
    Fp8MmConfig(64, 64, 32, group_m=1, num_warps=4, num_stages=2),
])
def test_every_tile_config(cfg):
    # Several row and column tiles, the last of each partial, through the grouped tile order.
    m, n, k = 150, 160, 128
    x, _, weight, w_scale = _operands(m, n, k, seed=5)
    codes, x_scale = mxfp8_quantize(x)
    out = torch.empty(m, n, dtype=torch.bfloat16, device=_DEVICE)
    fp8_mm_(*_to(codes, x_scale, weight, w_scale), out, config=cfg)
    assert rel_rms(out.cpu(), ref.mxfp8_mm(codes, x_scale, weight, w_scale)) < 1e-3


def test_fp8_linear_and_strided_operands():
    x, w, weight, w_scale = _operands(37, 96, 128, seed=11)
    want = ref.fp8_linear(x, weight, w_scale)
    assert rel_rms(fp8_linear(*_to(x, weight, w_scale)).cpu(), want) < 1e-3
    # Row-strided views of codes, scales, weight and out (unit stride in the last dimension).
    codes, x_scale = mxfp8_quantize(x)
    wide = lambda t, pad: torch.cat([t.view(torch.uint8), t.view(torch.uint8)[:, :pad]], 1)[:, :t.shape[1]]
    out = torch.zeros(37, 130, dtype=torch.bfloat16, device=_DEVICE)
    fp8_mm_(*_to(wide(codes, 32), wide(x_scale, 1), wide(weight, 64), wide(w_scale.view(torch.uint8), 2)),
            out[:, 2:98])
    assert rel_rms(out[:, 2:98].cpu(), want) < 1e-3
    assert out[:, :2].abs().sum() == 0 and out[:, 98:].abs().sum() == 0


def test_config_choice():
    assert fp8_mm_config(4096, 32768, 1280, "cpu")[:3] == (128, 128, 128)
    assert fp8_mm_config(128, 1792, 5120, "cpu")[:3] == (64, 64, 128)
    assert fp8_mm_config(37, 96, 96, "cpu").block_k == 32


def _args(m=3, n=64, k=64):
    x, _, weight, w_scale = _operands(m, n, k, seed=0)
    codes, x_scale = mxfp8_quantize(x)
    return codes, x_scale, weight, w_scale, torch.empty(m, n, dtype=torch.bfloat16)


def _meta(t):
    return torch.empty(t.shape, dtype=t.dtype, device="meta")


@pytest.mark.parametrize("case, match", [
    (lambda c, s, w, ws, o: (c.float(), s, w, ws, o), "codes must have dtype"),
    (lambda c, s, w, ws, o: (c[:, :48], s[:, :1], w[:, :48], ws[:, :1], o), "codes: K=48 must be a multiple of 32"),
    (lambda c, s, w, ws, o: (c, s[:, :1], w, ws, o), "x_scale must have shape"),
    (lambda c, s, w, ws, o: (c, s.to(torch.int32), w, ws, o), "x_scale must have dtype"),
    (lambda c, s, w, ws, o: (c, s, w.bfloat16(), ws, o), "weight must have dtype"),
    (lambda c, s, w, ws, o: (c, s, w[:, :32], ws, o), "weight must have shape"),
    (lambda c, s, w, ws, o: (c, s, w, ws[:1], o), "w_scale must have shape"),
    (lambda c, s, w, ws, o: (c, s, w, ws.float(), o), "w_scale must have dtype"),
    (lambda c, s, w, ws, o: (c, s, w, ws, o.float()), "out must have dtype"),
    (lambda c, s, w, ws, o: (c, s, w, ws, o[:2]), "out must have shape"),
    (lambda c, s, w, ws, o: (c, s, w, ws, torch.empty(64, 3, dtype=torch.bfloat16).t()), "out must have unit stride"),
    (lambda c, s, w, ws, o: (c, s, torch.empty(64, 64, dtype=torch.uint8).t(), ws, o), "weight must have unit stride"),
    (lambda c, s, w, ws, o: (c, s, w, ws, _meta(o)), "out must be on"),
    (lambda c, s, w, ws, o: (c, s, _meta(w), ws, o), "weight must be on"),
    (lambda c, s, w, ws, o: (c[0], s, w, ws, o), "codes must be a 2-D"),
])
def test_bad_inputs_raise_naming_the_argument(case, match):
    with pytest.raises((TypeError, ValueError), match=match):
        fp8_mm_(*case(*_args()))


_GOOD = Fp8MmConfig(64, 64, 32, group_m=1, num_warps=4, num_stages=2)


@pytest.mark.parametrize("config, match", [
    (_GOOD._replace(block_m=48), r"config.block_m must be a power of two >= 16, got 48"),
    (_GOOD._replace(block_m=8), r"config.block_m must be a power of two >= 16, got 8"),
    (_GOOD._replace(block_m=64.0), r"config.block_m must be a power of two >= 16, got 64.0"),
    (_GOOD._replace(block_n=0), r"config.block_n must be a power of two >= 16, got 0"),
    (_GOOD._replace(block_n=True), r"config.block_n must be a power of two >= 16, got True"),
    (_GOOD._replace(block_k=0), r"config.block_k must be a positive int, got 0"),
    (_GOOD._replace(block_k=48), r"config.block_k=48 must be a multiple of 32 dividing K=64"),
    (_GOOD._replace(group_m=0), r"config.group_m must be a positive int, got 0"),
    (_GOOD._replace(num_warps=3), r"config.num_warps must be a power of two in 1..16, got 3"),
    (_GOOD._replace(num_warps=32), r"config.num_warps must be a power of two in 1..16, got 32"),
    (_GOOD._replace(num_stages=0), r"config.num_stages must be a positive int, got 0"),
    (tuple(_GOOD), "config must be an Fp8MmConfig, got tuple"),
    ("fast", "config must be an Fp8MmConfig, got str"),
])
def test_bad_configs_raise_naming_the_field(config, match):
    with pytest.raises((TypeError, ValueError), match=match):
        fp8_mm_(*_args(), config=config)


@pytest.mark.gpu
@pytest.mark.parametrize("k, n", [(5120, 1792), (1280, 32768), (8192, 5120)])
@pytest.mark.parametrize("m", [128, 1024, 4096])
def test_gpu_flash_shapes(m, n, k):
    g = torch.Generator(device="cuda").manual_seed(m + n + k)
    x = torch.randn(m, k, device="cuda", generator=g).bfloat16()
    w = (torch.randn(n, k, device="cuda", generator=g) * k ** -0.5).bfloat16()
    weight, w_scale = fp8_block_quantize(w)
    codes, x_scale = mxfp8_quantize(x)
    y = fp8_mm(codes, x_scale, weight, w_scale)
    # Tight: the same dequantized operands, multiplied in FP64 and rounded to BF16 like the output
    # (the reference's per-block FP64 partials would need [K/32, M, N] doubles at these sizes);
    # then the contract itself on a few rows.
    exact = mxfp8_dequantize(codes, x_scale).double() @ fp8_block_dequantize(weight, w_scale).double().T
    exact = exact.float().bfloat16()
    assert rel_rms(y, exact) < 1e-3
    rows = [0, m // 2, m - 1]
    assert rel_rms(y[rows], ref.mxfp8_mm(codes[rows], x_scale[rows], weight, w_scale)) < 1e-3
    assert rel_rms(y, x.float() @ fp8_block_dequantize(weight, w_scale).T) < 3e-2
    assert rel_rms(fp8_linear(x, weight, w_scale), y) == 0
