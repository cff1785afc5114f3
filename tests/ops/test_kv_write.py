"""ops/kv_write.py against records.py and the reference, bit for bit (interpreter on the CPU; GPU at
V4.1-Flash sizes).

requant=True records equal what the reference state stores (`pack_*(reference fake-quantized
values)`); requant=False records equal `pack_*` of the unquantized (RoPE'd) values. Both decode to
the reference's fake-quantized values for MXFP8/MXFP4; for NVFP4 only requant=True does always.
"""

import pytest
import torch

from dsv41_decode.formats import mxfp8_fake as _mxfp8_fake
from dsv41_decode.records import (
    pack_compressed_kv,
    pack_index_key,
    pack_window_kv,
    unpack_compressed_kv,
    unpack_index_key,
    unpack_window_kv,
)
from dsv41_decode.ops.kv_write import (
    compressed_entry_store_,
    compressed_kv_records,
    compressed_kv_store_,
    index_key_records,
    index_key_store_,
    qkv_rope_insert,
    qkv_rope_insert_,
    query_rope_,
    rope_cos_sin,
)
from dsv41_decode.reference import compressor as ref_comp
from dsv41_decode.reference.linear import rms_norm, rowwise_dot
from dsv41_decode.reference.rope import rope_cis, rope_tail

_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
_EPS = 1e-6
_POSITIONS = [0, 1, 127, 128, 5000]


def _freqs() -> torch.Tensor:
    # YaRN-like mix of fast and slow frequencies; only cos/sin reach the kernels.
    return 1.0 / (160000 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64))


def _cis(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    pos = torch.tensor(_POSITIONS * (n // len(_POSITIONS) + 1))[:n]
    pos = pos[torch.randperm(n, generator=g)] if n > 1 else pos
    return rope_cis(_freqs(), pos)


def _data(shape, seed: int) -> torch.Tensor:
    """BF16 with per-32-block magnitudes 2^-30..2^30, some blocks tiny, some exact powers of two."""
    g = torch.Generator().manual_seed(seed)
    *lead, k = shape
    x = torch.randn(*lead, k // 16, 16, generator=g)
    x = x * torch.exp2(torch.randint(-30, 31, (*lead, k // 16, 1), generator=g).float())
    kind = torch.randint(0, 6, (*lead, k // 16, 1), generator=g)
    x = torch.where(kind == 1, x * 1e-9, x)
    pow2 = torch.exp2(torch.randint(-8, 8, x.shape, generator=g).float()) * torch.sign(x)
    x = torch.where(kind == 2, pow2, x)
    x = torch.where(kind == 3, torch.zeros_like(x) * torch.sign(x), x)  # signed zeros
    return x.reshape(*lead, k).bfloat16()


def _dev(*ts):
    return [t.to(_DEVICE, copy=True) for t in ts]


def _assert_bytes(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    bad = (got.cpu() != want).nonzero()
    assert bad.numel() == 0, f"{what}: {bad.shape[0]} byte mismatches, first at {bad[:4].tolist()}"


# --- query + window KV ----------------------------------------------------------------------------


def _check_qkv(n: int, h: int, seed: int, requant: bool = True) -> None:
    q = _data((n, h, 512), seed)
    kv = _data((n, 512), seed + 1)
    cis = _cis(n, seed)
    cos, sin = rope_cos_sin(cis)
    pool = torch.full((2 * n + 3, 528), 0xAB, dtype=torch.uint8)
    slots = torch.randperm(pool.shape[0], generator=torch.Generator().manual_seed(seed))[:n]
    qd, kvd, cosd, sind, slotsd, poold = _dev(q, kv, cos, sin, slots, pool)
    qkv_rope_insert_(qd, kvd, cosd, sind, slotsd, poold, requant=requant)
    want_q = rope_tail(q, cis, 64)
    assert torch.equal(qd.cpu().view(torch.int16), want_q.view(torch.int16))
    rot = rope_tail(kv, cis, 64)
    want = pack_window_kv(_mxfp8_fake(rot) if requant else rot)
    _assert_bytes(poold[slotsd].cpu(), want, "window records")
    untouched = torch.ones(pool.shape[0], dtype=torch.bool)
    untouched[slots] = False
    assert bool((poold.cpu()[untouched] == 0xAB).all())
    assert torch.equal(unpack_window_kv(poold[slotsd].cpu()), _mxfp8_fake(rot))


# 1 row, a few, and 11 (odd, no power of two): one program per row, so more rows only repeat a path
@pytest.mark.parametrize("n", [1, 3, 11])
def test_qkv_rope_insert_bit_exact(n):
    _check_qkv(n, 4, seed=10 + n)


@pytest.mark.parametrize("n", [1, 5])
def test_qkv_rope_insert_single_quant(n):
    _check_qkv(n, 3, seed=50 + n, requant=False)  # also an odd head count (masked head block)


def test_window_ring_one_request_consecutive_slots_and_skips():
    """4 rows of one request at positions 126..129, ring W=128 of request slot 2: the slots wrap;
    a -1 slot (a padding row) writes nothing."""
    w, req = 128, 2
    pos = torch.tensor([126, 127, 128, 129, 7])
    slots = req * w + pos % w
    slots[-1] = -1
    kv = _data((5, 512), 3)
    q = _data((5, 2, 512), 4)
    cis = rope_cis(_freqs(), pos)
    cos, sin = rope_cos_sin(cis)
    pool = torch.zeros(4 * w, 528, dtype=torch.uint8)
    qd, kvd, cosd, sind, slotsd, poold = _dev(q, kv, cos, sin, slots, pool)
    qkv_rope_insert_(qd, kvd, cosd, sind, slotsd, poold)
    want = pack_window_kv(_mxfp8_fake(rope_tail(kv, cis, 64)))
    _assert_bytes(poold[slots[:4]].cpu(), want[:4], "ring records")
    assert int(poold.cpu().count_nonzero(dim=1).gt(0).sum()) == 4
    assert torch.equal(qd.cpu(), rope_tail(q, cis, 64))


def test_query_rope_alone_is_the_query_half():
    # 3 heads: a masked head block; the queries as rope_tail rotates them, nothing else written
    n, h = 4, 3
    q, cis = _data((n, h, 512), 21), _cis(n, 2)
    qd, cosd, sind = _dev(q, *rope_cos_sin(cis))
    query_rope_(qd, cosd, sind)
    assert torch.equal(qd.cpu(), rope_tail(q, cis, 64))
    for bad, word in (((q.float(), cosd, sind), "q"), ((qd, cosd[:2], sind), "cos"), ((qd, cosd, sind.double()), "sin")):
        with pytest.raises((TypeError, ValueError), match=word):
            query_rope_(*bad)


def test_qkv_convenience_and_non_finite():
    kv = _data((3, 512), 5)
    kv[0, 3] = float("nan")
    kv[1, 500] = float("inf")
    q = _data((3, 2, 512), 6)
    cis = _cis(3, 1)
    q2, rec = qkv_rope_insert(*_dev(q, kv, *rope_cos_sin(cis)))
    assert torch.equal(q2.cpu(), rope_tail(q, cis, 64))
    # a non-finite block gets scale byte 255 and canonical NaN codes 0x7F, as in formats.py
    _assert_bytes(rec.cpu(), pack_window_kv(rope_tail(kv, cis, 64)), "non-finite rows")  # default: one quantization
    assert int(rec[0, 512]) == 255 and int(rec[1, 512 + 15]) == 255


def test_subnormal_inputs_keep_the_sign_of_zero_codes():
    """BF16 subnormals in the RoPE dims (-0.0 beside 5.9e-39, whose rotations are FP32 subnormals)
    round to zero codes of the right sign in both records: the kernels widen the BF16 bits exactly
    (Triton's interpreter converts BF16 subnormals wrongly)."""
    cis = rope_cis(1.0 / (160000 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64)), torch.tensor([5217]))
    kv = torch.zeros(1, 512, dtype=torch.bfloat16)
    kv.view(torch.int16)[0, 474] = -0x8000                    # -0.0
    kv.view(torch.int16)[0, 475] = 0x0040                     # +5.877e-39
    cos, sin = rope_cos_sin(cis)
    _, rec = qkv_rope_insert(*_dev(torch.zeros(1, 1, 512, dtype=torch.bfloat16), kv, cos, sin))
    _assert_bytes(rec.cpu(), pack_window_kv(rope_tail(kv, cis, 64)), "window record")
    ck = torch.zeros(1, 288, dtype=torch.uint8, device=_DEVICE)
    compressed_kv_store_(*_dev(kv, cos, sin), torch.zeros(1, dtype=torch.int64, device=_DEVICE), ck)
    _assert_bytes(ck.cpu(), pack_compressed_kv(rope_tail(kv, cis, 64)), "compressed record")


# --- compressed KV and index keys -----------------------------------------------------------------


def _entries(g: int, seed: int):
    lat = _data((g, 512), seed)
    gen = torch.Generator().manual_seed(seed)
    wk = (torch.randn(128, 512, generator=gen) * 0.05).bfloat16()
    k_norm = (torch.rand(128, generator=gen) + 0.5).bfloat16()
    wk_out = rowwise_dot(lat.float(), wk.float())
    return lat, wk, k_norm, wk_out, _cis(g, seed)


@pytest.mark.parametrize("g", [1, 3, 11])
@pytest.mark.parametrize("requant", [True, False])
def test_compressed_entries_bit_exact(g, requant):
    lat, wk, k_norm, wk_out, cis = _entries(g, seed=100 + g)
    cos, sin = rope_cos_sin(cis)
    want_ckv_vals = ref_comp.compressed_kv(lat, cis, 64)
    want_ik_vals = ref_comp.index_key(lat, wk, k_norm, cis, 64, _EPS)
    if requant:  # what the reference state stores
        want_ckv, want_ik = pack_compressed_kv(want_ckv_vals), pack_index_key(want_ik_vals)
    else:  # one quantization of the RoPE'd values
        want_ckv = pack_compressed_kv(rope_tail(lat, cis, 64))
        k = rms_norm(wk_out.to(torch.bfloat16), k_norm, _EPS)
        want_ik = pack_index_key(rope_tail(k, cis, 64))
    s = 2 * g + 1
    ckv = torch.zeros(s, 288, dtype=torch.uint8)
    ik = torch.zeros(s + 2, 68, dtype=torch.uint8)
    slots = torch.randperm(s, generator=torch.Generator().manual_seed(g))[:g]
    latd, wkod, knd, cosd, sind, slotsd, ckvd, ikd = _dev(lat, wk_out, k_norm, cos, sin, slots, ckv, ik)
    compressed_entry_store_(latd, wkod, knd, cosd, sind, slotsd, ckvd, ikd, _EPS, requant=requant)
    _assert_bytes(ckvd[slotsd].cpu(), want_ckv, "compressed records")
    _assert_bytes(ikd[slotsd].cpu(), want_ik, "index keys")
    assert torch.equal(unpack_index_key(ikd[slotsd].cpu()), want_ik_vals)
    if requant:
        assert torch.equal(unpack_compressed_kv(ckvd[slotsd].cpu()), unpack_compressed_kv(want_ckv))
    # the separate launchers write the same bytes
    ckv2, ik2 = torch.zeros_like(ckvd), torch.zeros_like(ikd)
    compressed_kv_store_(latd, cosd, sind, slotsd, ckv2, requant=requant)
    index_key_store_(wkod, knd, _EPS, cosd, sind, slotsd, ik2, requant=requant)
    assert torch.equal(ckv2, ckvd) and torch.equal(ik2, ikd)


def test_compressed_convenience_functions():
    lat, wk, k_norm, wk_out, cis = _entries(2, seed=7)
    cos, sin = rope_cos_sin(cis)
    rec = compressed_kv_records(*_dev(lat, cos, sin))
    _assert_bytes(rec.cpu(), pack_compressed_kv(ref_comp.compressed_kv(lat, cis, 64)), "ckv")
    rec = index_key_records(*_dev(wk_out, k_norm), _EPS, *_dev(cos, sin))
    _assert_bytes(rec.cpu(), pack_index_key(ref_comp.index_key(lat, wk, k_norm, cis, 64, _EPS)), "ik")


# --- bad inputs -----------------------------------------------------------------------------------


def _qkv_args(n=2, h=2):
    cos, sin = rope_cos_sin(_cis(n, 0))
    return dict(q=_data((n, h, 512), 0), kv=_data((n, 512), 1), cos=cos, sin=sin,
                slots=torch.arange(n), window=torch.zeros(4, 528, dtype=torch.uint8))


@pytest.mark.parametrize("name,bad", [
    ("q", lambda a: a["q"].float()),
    ("q", lambda a: a["q"][:, :, :448]),
    ("kv", lambda a: a["kv"][:1]),
    ("kv", lambda a: a["kv"].float()),
    ("cos", lambda a: a["cos"].double()),
    ("sin", lambda a: a["sin"][:, :16]),
    ("slots", lambda a: a["slots"].int()),
    ("window", lambda a: torch.zeros(4, 512, dtype=torch.uint8)),
    ("window", lambda a: torch.zeros(4, 528, dtype=torch.int8)),
])
def test_qkv_bad_inputs_name_the_argument(name, bad):
    args = _qkv_args()
    args[name] = bad(args)
    with pytest.raises((TypeError, ValueError), match=name):
        qkv_rope_insert_(**args)


def test_entry_bad_inputs_name_the_argument():
    lat, wk, k_norm, wk_out, cis = _entries(2, seed=1)
    cos, sin = rope_cos_sin(cis)
    slots = torch.arange(2)
    ckv = torch.zeros(2, 288, dtype=torch.uint8)
    ik = torch.zeros(2, 68, dtype=torch.uint8)
    with pytest.raises(ValueError, match="lat"):
        compressed_kv_store_(lat[:, :256], cos, sin, slots, ckv)
    with pytest.raises(ValueError, match="compressed"):
        compressed_kv_store_(lat, cos, sin, slots, ik)
    with pytest.raises(TypeError, match="wk_out"):
        index_key_store_(wk_out.bfloat16(), k_norm, _EPS, cos, sin, slots, ik)
    with pytest.raises(ValueError, match="k_norm"):
        index_key_store_(wk_out, k_norm[:64], _EPS, cos, sin, slots, ik)
    with pytest.raises(ValueError, match="eps"):
        index_key_store_(wk_out, k_norm, None, cos, sin, slots, ik)
    with pytest.raises(ValueError, match="index_keys"):
        index_key_store_(wk_out, k_norm, _EPS, cos, sin, slots, ckv)
    with pytest.raises(ValueError, match="cos"):
        index_key_store_(wk_out, k_norm, _EPS, cos[:1], sin, slots, ik)
    with pytest.raises(ValueError, match="nothing to store"):
        compressed_entry_store_(lat, wk_out, k_norm, cos, sin, slots, None, None, _EPS)


def test_conveniences_name_a_non_tensor_argument():
    n = 2
    q, kv = torch.zeros(n, 4, 512, dtype=torch.bfloat16), torch.zeros(n, 512, dtype=torch.bfloat16)
    cs = torch.zeros(n, 32)
    for bad in (None, [1.0, 2.0]):
        with pytest.raises(ValueError, match="q must be a 3-D tensor"):
            qkv_rope_insert(bad, kv, cs, cs)
        with pytest.raises(ValueError, match="kv must be a 2-D tensor"):
            qkv_rope_insert(q, bad, cs, cs)
        with pytest.raises(ValueError, match="lat must be a 2-D tensor"):
            compressed_kv_records(bad, cs, cs)
        with pytest.raises(ValueError, match="wk_out must be a 2-D tensor"):
            index_key_records(bad, torch.ones(128, dtype=torch.bfloat16), _EPS, cs, cs)
        with pytest.raises(TypeError, match="cis must be a torch.Tensor"):
            rope_cos_sin(bad)


# --- GPU at V4.1-Flash sizes ----------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 2, 4, 16, 33, 64])
def test_gpu_qkv_flash_sizes(n):
    _check_qkv(n, 64, seed=1000 + n)
    _check_qkv(n, 8, seed=2000 + n, requant=False)


@pytest.mark.gpu
@pytest.mark.parametrize("g", [1, 16, 64])
@pytest.mark.parametrize("requant", [True, False])
def test_gpu_compressed_entries(g, requant):
    test_compressed_entries_bit_exact(g, requant)
