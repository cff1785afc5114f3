"""ops.rms_norm against reference.linear.rms_norm (+ formats.mxfp8_quantize of its output)."""

import pytest
import torch

from dsv41_decode.formats import mxfp8_quantize
from dsv41_decode.ops.kv_write import qkv_rope_insert_, rope_cos_sin
from dsv41_decode.ops.rms_norm import rms_norm, rms_norm_, rms_norm_pair_
from dsv41_decode.records import WINDOW_KV_BYTES
from dsv41_decode.reference.rope import rope_cis
from dsv41_decode.reference.compressor import latent
from dsv41_decode.reference.linear import rms_norm as ref_rms_norm

_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


# One BF16 ulp: the kernel sums the squares in another order than the reference (a few FP32 ulps
# of the mean, ~2^-21 relative), and torch's vectorized CPU rsqrt differs from an IEEE 1/sqrt by up
# to 2 FP32 ulps; so the FP32 x * r * w of the two sides differ by a few parts in 2^21, far under
# a BF16 ulp (2^-8..2^-7 relative): the BF16 roundings can differ only by the one step where that
# straddles a rounding midpoint.
def _ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    return int((a.view(torch.int16).int() - b.view(torch.int16).int()).abs().max())


@pytest.mark.parametrize("n,d", [(1, 128), (3, 512), (5, 1280), (2, 96)])
def test_matches_reference_within_one_ulp(n, d):
    g = torch.Generator().manual_seed(n * d)
    x = (3 * torch.randn(n, 2 * d, generator=g)).to(torch.bfloat16)[:, :d]   # a strided view
    w = (1 + 0.1 * torch.randn(d, generator=g)).to(torch.bfloat16)
    out = torch.full((n, d), float("nan"), dtype=torch.bfloat16, device=_DEVICE)
    codes = torch.zeros(n, d, dtype=torch.float8_e4m3fn, device=_DEVICE)
    scales = torch.zeros(n, d // 32, dtype=torch.uint8, device=_DEVICE)
    rms_norm_(x.to(_DEVICE), w.to(_DEVICE), 1e-20, out, codes, scales)
    out, codes, scales = out.cpu(), codes.cpu(), scales.cpu()
    assert _ulps(out, ref_rms_norm(x, w, 1e-20)) <= 1
    rc, rs = mxfp8_quantize(out)
    assert torch.equal(codes.view(torch.uint8), rc.view(torch.uint8)) and torch.equal(scales, rs)


def test_bf16_subnormal_inputs_are_read_exactly():
    # Rows of normal values with BF16 subnormals in them (and a weight with subnormals): the
    # subnormal x * r * w lands in BF16's subnormal range, where a wrong widening (Triton 3.6's
    # interpreter's own bf16 -> fp32 conversion: 5.877e-39 -> 0.0) differs by many ulps.
    g = torch.Generator().manual_seed(5)
    d = 256
    x = torch.randn(2, d, generator=g)
    x[:, ::3] = torch.randint(1, 128, (2, len(range(0, d, 3))), generator=g).float() * 2.0**-133
    w = 1 + 0.1 * torch.randn(d, generator=g)
    w[1::7] = 2.0**-130
    x, w = x.to(torch.bfloat16), w.to(torch.bfloat16)
    out = torch.empty(2, d, dtype=torch.bfloat16, device=_DEVICE)
    codes = torch.zeros(2, d, dtype=torch.float8_e4m3fn, device=_DEVICE)
    scales = torch.zeros(2, d // 32, dtype=torch.uint8, device=_DEVICE)
    rms_norm_(x.to(_DEVICE), w.to(_DEVICE), 1e-20, out, codes, scales)
    want = ref_rms_norm(x, w, 1e-20)
    assert bool((want.float().abs() < 2.0**-126).sum() > 50), "the case must produce BF16 subnormals"
    assert _ulps(out.cpu(), want) <= 1


def test_fp32_input_is_the_compressor_latent():
    g = torch.Generator().manual_seed(1)
    c = torch.randn(4, 512, generator=g)
    w = (1 + 0.1 * torch.randn(512, generator=g)).to(torch.bfloat16)
    assert _ulps(rms_norm(c.to(_DEVICE), w.to(_DEVICE), 1e-20).cpu(), latent(c, w, 1e-20)) <= 1


@pytest.mark.parametrize("n", [1, 3])
def test_pair_equals_two_launches(n):
    # the step's q_norm (with MXFP8) and kv_norm in one launch, from one strided qkv buffer
    g = torch.Generator().manual_seed(7 + n)
    qkv = (3 * torch.randn(n, 1024 + 512, generator=g)).to(torch.bfloat16).to(_DEVICE)
    wq = (1 + 0.1 * torch.randn(1024, generator=g)).to(torch.bfloat16).to(_DEVICE)
    wkv = (1 + 0.1 * torch.randn(512, generator=g)).to(torch.bfloat16).to(_DEVICE)
    outs = []
    for pair in (False, True):
        qr = torch.empty(n, 1024, dtype=torch.bfloat16, device=_DEVICE)
        codes = torch.empty(n, 1024, dtype=torch.uint8, device=_DEVICE)
        scales = torch.empty(n, 32, dtype=torch.uint8, device=_DEVICE)
        kv = torch.empty(n, 512, dtype=torch.bfloat16, device=_DEVICE)
        if pair:
            rms_norm_pair_(qkv[:, :1024], wq, qr, codes, scales, qkv[:, 1024:], wkv, kv, 1e-6)
        else:
            rms_norm_(qkv[:, :1024], wq, 1e-6, qr, codes, scales)
            rms_norm_(qkv[:, 1024:], wkv, 1e-6, kv)
        outs.append((qr, codes, scales, kv))
    for a, b in zip(*outs):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="same rows"):
        rms_norm_pair_(qkv[:, :1024], wq, qr, codes, scales, qkv.new_zeros(n + 1, 512), wkv,
                       kv.new_zeros(n + 1, 512), 1e-6)


def _norm_insert_case(n: int, seed: int, fused: bool, pool_rows: int = 40, pdl: bool = False):
    """(qr, codes, scales, kv, window pool) of the step's q/kv norm pair and window insert, fused
    (`rms_norm_pair_(window=...)`, with `pdl` launched by PDL right after the copy that writes its
    input) or as before (`rms_norm_pair_` then `qkv_rope_insert_`), on a pool poisoned with 0xA5;
    slots: the rows in a scattered order, one padding row (-1) and one past the pool."""
    g = torch.Generator().manual_seed(seed)
    qkv_in = (3 * torch.randn(n, 1024 + 512, generator=g)).to(torch.bfloat16).to(_DEVICE)
    wq = (1 + 0.1 * torch.randn(1024, generator=g)).to(torch.bfloat16).to(_DEVICE)
    wkv = (1 + 0.1 * torch.randn(512, generator=g)).to(torch.bfloat16).to(_DEVICE)
    pos = torch.randint(0, 200000, (n,), generator=g)
    cis = rope_cis(1.0 / (160000 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64)), pos)
    cos, sin = (t.to(_DEVICE) for t in rope_cos_sin(cis))
    slots = torch.randperm(pool_rows, generator=g)[:n].to(torch.int64)
    if n > 2:
        slots[1], slots[2] = -1, pool_rows          # written nowhere
    slots = slots.to(_DEVICE)
    qr = torch.empty(n, 1024, dtype=torch.bfloat16, device=_DEVICE)
    codes = torch.empty(n, 1024, dtype=torch.uint8, device=_DEVICE)
    scales = torch.empty(n, 32, dtype=torch.uint8, device=_DEVICE)
    kv = torch.empty(n, 512, dtype=torch.bfloat16, device=_DEVICE)
    pool = torch.full((pool_rows, WINDOW_KV_BYTES), 0xA5, dtype=torch.uint8, device=_DEVICE)
    qkv = qkv_in.clone()
    if fused:
        rms_norm_pair_(qkv[:, :1024], wq, qr, codes, scales, qkv[:, 1024:], wkv, kv, 1e-6,
                       window=pool, slots=slots, cos=cos, sin=sin, pdl=pdl)
    else:
        rms_norm_pair_(qkv[:, :1024], wq, qr, codes, scales, qkv[:, 1024:], wkv, kv, 1e-6)
        q = torch.zeros(n, 1, 512, dtype=torch.bfloat16, device=_DEVICE)
        qkv_rope_insert_(q, kv, cos, sin, slots, pool)
    return qr, codes, scales, kv, pool


@pytest.mark.parametrize("n", [1, 5])
def test_pair_with_window_insert_equals_the_separate_insert(n):
    # The window insert in the norm launch gives qkv_rope_insert_'s record bytes (RoPE on pairs
    # 224..255 of the normalized kv, MXFP8, at slots[r]) and leaves the norms' outputs as they were.
    fused, apart = _norm_insert_case(n, 11 + n, True), _norm_insert_case(n, 11 + n, False)
    for name, a, b in zip(("qr", "codes", "scales", "kv", "window"), fused, apart):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), name
    written = (fused[4] != 0xA5).any(dim=1).sum()
    assert int(written) == (n - 2 if n > 2 else n)      # the padding and out-of-pool rows write nothing


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 8, 17, 64])
def test_pair_with_window_insert_on_gpu(n):
    fused, apart = _norm_insert_case(n, 29 + n, True, 256), _norm_insert_case(n, 29 + n, False, 256)
    for name, a, b in zip(("qr", "codes", "scales", "kv", "window"), fused, apart):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), (name, n)


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 2, 8, 64])
def test_pair_by_pdl_on_gpu(n):
    """Launched by PDL (its programs wait for the copy before it, then read), the pair writes the
    bits of its plain launch."""
    by_pdl, plain = _norm_insert_case(n, 41 + n, True, 256, pdl=True), _norm_insert_case(n, 41 + n, True, 256)
    for name, a, b in zip(("qr", "codes", "scales", "kv", "window"), by_pdl, plain):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), (name, n)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where PDL is not available")
def test_pair_by_pdl_needs_sm90():
    x, kv = torch.zeros(2, 1024, dtype=torch.bfloat16), torch.zeros(2, 512, dtype=torch.bfloat16)
    codes, scales = torch.empty(2, 1024, dtype=torch.uint8), torch.empty(2, 32, dtype=torch.uint8)
    with pytest.raises(ValueError, match="pdl: programmatic dependent launch needs sm_90"):
        rms_norm_pair_(x, torch.ones(1024), torch.empty_like(x), codes, scales, kv, torch.ones(512),
                       torch.empty_like(kv), 1e-6, pdl=True)


def test_window_insert_arguments_name_the_argument():
    x = torch.zeros(2, 1024, dtype=torch.bfloat16)
    kv_in = torch.zeros(2, 512, dtype=torch.bfloat16)
    w1, w2 = torch.ones(1024), torch.ones(512)
    qr, kv = torch.empty_like(x), torch.empty_like(kv_in)
    codes, scales = torch.empty(2, 1024, dtype=torch.uint8), torch.empty(2, 32, dtype=torch.uint8)
    pool, slots, cs = torch.zeros(4, WINDOW_KV_BYTES, dtype=torch.uint8), torch.zeros(2, dtype=torch.int64), \
        torch.zeros(2, 32)
    base = (x, w1, qr, codes, scales, kv_in, w2, kv, 1e-6)
    cases = [
        (dict(window=pool[:, :500], slots=slots, cos=cs, sin=cs), "window"),
        (dict(window=pool, slots=slots.int(), cos=cs, sin=cs), "slots"),
        (dict(window=pool, slots=slots, cos=cs[:, :16], sin=cs), "cos"),
        (dict(window=pool, slots=slots, cos=cs, sin=cs.double()), "sin"),
        (dict(slots=slots), "window"),
    ]
    for kwargs, word in cases:
        with pytest.raises((ValueError, TypeError), match=word):
            rms_norm_pair_(*base, **kwargs)
    with pytest.raises(ValueError, match="512"):
        rms_norm_pair_(x, w1, qr, codes, scales, x[:, :256], w1[:256], qr[:, :256], 1e-6, window=pool,
                       slots=slots, cos=cs, sin=cs)


def test_bad_arguments_name_the_argument():
    x = torch.randn(2, 64).to(torch.bfloat16)
    with pytest.raises(TypeError, match="out"):
        rms_norm_(x, torch.ones(64), 1e-6, torch.empty(2, 64))
    with pytest.raises(ValueError, match="weight"):
        rms_norm_(x, torch.ones(32), 1e-6, torch.empty(2, 64, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="8192"):
        rms_norm(torch.zeros(1, 8224, dtype=torch.bfloat16), torch.ones(8224), 1e-6)


def test_non_tensor_x_and_bad_num_warps_name_the_argument():
    for bad in (None, [1.0, 2.0]):
        with pytest.raises(ValueError, match="x must be a 2-D tensor"):
            rms_norm(bad, torch.ones(64), 1e-6)
    x = torch.zeros(2, 64, dtype=torch.bfloat16)
    base = (x, torch.ones(64), torch.empty_like(x), torch.empty(2, 64, dtype=torch.uint8),
            torch.empty(2, 2, dtype=torch.uint8), x, torch.ones(64), torch.empty_like(x), 1e-6)
    for bad in (0, 3, 32, 4.0, None):
        with pytest.raises(ValueError, match=f"num_warps must be a power of two in 1..16, got {bad}"):
            rms_norm_pair_(*base, num_warps=bad)
