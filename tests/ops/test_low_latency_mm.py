"""ops.low_latency_mm against reference.linear.mxfp8_mm (tight, same operands) and against the
unquantized BF16 product (loose), in the interpreter at small shapes and on the GPU at the
V4.1-Flash shapes.

Thresholds: the kernel and the reference add the same FP32 block partials (each exact up to one
FP32 rounding), so without split-K they add them in the same order and can differ only where a
partial's rounding tips a BF16 rounding: at most one BF16 ulp. Split-K regroups the FP32 sum, which
moves it by a few FP32 ulps of the row's largest terms: at most one BF16 ulp of the row's largest
output. On top, rel RMS < 1e-3 says such flips are rare: one ulp is at most 2^-7 of an element,
so a share f of elements one ulp off gives a relative RMS of at most 2^-7 sqrt(f), and 1e-3
allows f up to 1.6 %, while a flip needs the FP32 sum within a partial's rounding (a few FP32
ulps, ~2^-22 relative) of a BF16 rounding midpoint: about 2^-13 of the elements. The FP32 output
(the unrounded partial) differs from the reference's FP32 sum only by the order of its K / 32
block partials (and a split's partial sums): about sqrt(K / 64) u relative, 1.2e-7 at K = 256
(u = 2^-24), so rel RMS < 1e-6. The loose comparison (BF16 activations times the stored FP8
weight) is bounded by MXFP8's 3 mantissa bits: E4M3's spacing / sqrt(12) against the value,
about 2.6e-2 on Gaussian data: rel RMS < 3e-2.
"""

import dataclasses

import pytest
import torch

from dsv41_decode.formats import fp8_block_dequantize, fp8_block_quantize, mxfp4_fake, mxfp8_quantize
from dsv41_decode.ops.index_query import index_query_
from dsv41_decode.ops.kv_write import query_rope_
from dsv41_decode.ops.low_latency_mm import LowLatencyConfig, LowLatencyMM, low_latency_mm
from dsv41_decode.reference.linear import mxfp8_mm
from dsv41_decode.reference.rope import rope_tail
from dsv41_decode.testing.compare import bits_differ, rel_rms, row_ulp_distance, ulp_distance
from helpers import FLASH_LINEAR_SHAPES, check_mxfp8_plan_errors, linear_operands, raises, rope_operands

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _poisoned(m: int, n: int) -> torch.Tensor:
    return torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=DEVICE)


# Small tiles so that the tiny shapes have several N tiles (partial last ones) and K steps.
_NO_SPLIT = LowLatencyConfig(block_n=64, block_k=64, split=1)
_SPLIT = LowLatencyConfig(block_n=32, block_k=32, split=4)


@pytest.mark.parametrize("split", [False, True], ids=["nosplit", "splitk"])
@pytest.mark.parametrize("m", [1, 3, 16, 37, 64])
@pytest.mark.parametrize("n,k", [(32, 256), (96, 64), (160, 256)])
def test_matches_reference_on_the_same_operands(m, n, k, split):
    _, _, codes, x_scale, weight, w_scale = linear_operands(_gen(m * 1000 + n + k), m, n, k)
    plan = LowLatencyMM(weight, w_scale, config=_SPLIT if split else _NO_SPLIT)
    assert (plan.launch_for(m).split > 1) == split
    y = plan(codes, x_scale, _poisoned(m, n))
    ref = mxfp8_mm(codes, x_scale, weight, w_scale)
    assert not torch.isnan(y).any(), "unwritten output elements"
    assert rel_rms(y, ref) < 1e-3
    if split:
        assert row_ulp_distance(y, ref) <= 1
    else:
        assert ulp_distance(y, ref) <= 1


@pytest.mark.parametrize("split", [False, True], ids=["nosplit", "splitk"])
def test_fp32_out_is_the_unrounded_partial(split):
    # a tensor-parallel partial: the FP32 sums, which round to the BF16 output of the same plan
    m, n, k = 5, 96, 256
    _, _, codes, x_scale, weight, w_scale = linear_operands(_gen(7), m, n, k)
    plan = LowLatencyMM(weight, w_scale, config=_SPLIT if split else _NO_SPLIT)
    y32 = plan(codes, x_scale, torch.full((m, n), float("nan"), device=DEVICE))
    y16 = plan(codes, x_scale, _poisoned(m, n))
    assert y32.dtype == torch.float32 and not torch.isnan(y32).any()
    assert torch.equal(y32.to(torch.bfloat16), y16)
    ref = mxfp8_mm(codes, x_scale, weight, w_scale, out_dtype=torch.float32)
    assert rel_rms(y32, ref) < 1e-6


@pytest.mark.parametrize("m", [3, 37])
def test_dequant_variant_matches_reference(m):
    n, k = 96, 256
    _, _, codes, x_scale, weight, w_scale = linear_operands(_gen(7 + m), m, n, k)
    ref = mxfp8_mm(codes, x_scale, weight, w_scale)
    for cfg in (LowLatencyConfig(block_n=64, block_k=128, split=1, dequant=True),
                LowLatencyConfig(block_n=32, block_k=64, split=2, dequant=True)):
        y = LowLatencyMM(weight, w_scale, config=cfg)(codes, x_scale, _poisoned(m, n))
        assert rel_rms(y, ref) < 1e-3 and row_ulp_distance(y, ref) <= 1, cfg


@pytest.mark.parametrize("dequant", [False, True], ids=["f8", "dq"])
@pytest.mark.parametrize("block_k, split", [(128, 1), (128, 3), (256, 1)])
def test_scale_words_give_the_byte_path_bits(block_k, split, dequant):
    """scale_words loads the same scale bytes as words one step ahead: the same bits, in both
    loops, also with split-K and at block_k 256 (64-bit words); a misaligned x_scale row falls back
    to byte loads."""
    m, n, k = 5, 96, 768
    _, _, codes, x_scale, weight, w_scale = linear_operands(_gen(11 + block_k + split), m, n, k)
    base = dict(block_n=32, block_k=block_k, split=split, dequant=dequant)
    bytewise = LowLatencyConfig(**base, scale_words=False)
    ref = LowLatencyMM(weight, w_scale, config=bytewise)(codes, x_scale, _poisoned(m, n))
    words = LowLatencyMM(weight, w_scale, config=LowLatencyConfig(**base, scale_words=True))
    assert torch.equal(words(codes, x_scale, _poisoned(m, n)), ref)
    wide = torch.zeros(m, k // 32 + 1, dtype=x_scale.dtype, device=x_scale.device)
    wide[:, 1:] = x_scale                            # rows start at an odd byte: no word loads
    assert torch.equal(words(codes, wide[:, 1:], _poisoned(m, n)), ref)


def test_against_unquantized_bf16():
    # The weight is FP8 in the checkpoint: "unquantized" is the BF16 activation times the weight
    # as stored. Plain Gaussian activations (the spread blocks of _operands put many codes in
    # E4M3's subnormal range, which is the format's error, not the kernel's): MXFP8's 3 mantissa
    # bits alone give about 2.6e-2 relative RMS on them.
    m, n, k = 5, 96, 256
    g = _gen(3)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    weight, w_scale = fp8_block_quantize(torch.randn(n, k, generator=g) * k ** -0.5)
    exact = x.double() @ fp8_block_dequantize(weight, w_scale).double().T
    codes, x_scale = (t.to(DEVICE) for t in mxfp8_quantize(x))
    weight, w_scale = weight.to(DEVICE), w_scale.to(DEVICE)
    for y in (low_latency_mm(codes, x_scale, weight, w_scale),
              LowLatencyMM(weight, w_scale, config=_SPLIT)(codes, x_scale)):
        assert rel_rms(y.cpu(), exact) < 3e-2


def test_replay_resets_the_counters():
    m, n, k = 3, 96, 256
    _, _, codes, x_scale, weight, w_scale = linear_operands(_gen(4), m, n, k)
    plan = LowLatencyMM(weight, w_scale, config=_SPLIT)
    first = plan(codes, x_scale, _poisoned(m, n))
    assert int(plan._counters.abs().sum()) == 0
    second = plan(codes, x_scale, _poisoned(m, n))
    assert bits_differ(first, second) == 0
    # Other inputs through the same plan: the counters do not carry state between calls.
    _, _, codes2, x_scale2, _, _ = linear_operands(_gen(5), m, n, k)
    y2 = plan(codes2, x_scale2)
    assert row_ulp_distance(y2, mxfp8_mm(codes2, x_scale2, weight, w_scale)) <= 1


def test_plans_sharing_a_workspace_give_their_own_bits():
    # two weights' split plans taking their workspace and counters from one pool (the decode step's
    # main-stream linears: decode.buffers.Workspaces), called in turn: each gives its own plan's
    # bits and leaves the shared counters at zero
    from dsv41_decode.decode.buffers import Workspaces
    pool = Workspaces(DEVICE)
    ops = [linear_operands(_gen(6 + i), 3, n, k) for i, (n, k) in enumerate(((96, 256), (160, 64)))]
    shared = [LowLatencyMM(o[4], o[5], 16, _SPLIT, workspace=pool) for o in ops]
    assert shared[0]._workspace.untyped_storage().data_ptr() == shared[1]._workspace.untyped_storage().data_ptr()
    for i in (0, 1, 0):
        _, _, codes, x_scale, weight, w_scale = ops[i]
        own = LowLatencyMM(weight, w_scale, 16, _SPLIT)(codes, x_scale, _poisoned(3, weight.shape[0]))
        assert bits_differ(shared[i](codes, x_scale, _poisoned(3, weight.shape[0])), own) == 0
        assert int(shared[0]._counters.abs().sum()) == int(shared[1]._counters.abs().sum()) == 0


def test_function_form_caches_the_plan_and_takes_scale_bytes():
    m, n, k = 2, 32, 64
    _, _, codes, x_scale, weight, w_scale = linear_operands(_gen(6), m, n, k)
    a = low_latency_mm(codes, x_scale, weight, w_scale)
    out = torch.empty(m, n, dtype=torch.bfloat16, device=DEVICE)
    b = low_latency_mm(codes, x_scale, weight, w_scale.view(torch.uint8), out=out)
    assert b is out and bits_differ(a, b) == 0


def test_bad_inputs_name_the_argument():
    m, n, k = 2, 64, 128
    _, _, codes, x_scale, weight, w_scale = linear_operands(_gen(8), m, n, k)
    check_mxfp8_plan_errors(LowLatencyMM, codes, x_scale, weight, w_scale)
    raises("block_k=256 must divide", lambda: LowLatencyMM(weight, w_scale, config=LowLatencyConfig(block_k=256)))
    raises("block_n must be a power of two", lambda: LowLatencyConfig(block_n=96))
    raises("scale_words must be None, True or False", lambda: LowLatencyConfig(scale_words="yes"))
    raises("weight must be a torch.Tensor", lambda: low_latency_mm(codes, x_scale, None, w_scale))


def test_bad_num_warps_name_the_field():
    # Triton takes a power of two: any other count would reach the compiler
    for bad in (3, 6, 32, 64):
        raises(rf"LowLatencyConfig.num_warps must be a power of two in 1..16, got {bad}",
               lambda: LowLatencyConfig(num_warps=bad))


# (name, N, K) of the V4.1-Flash attention linears the op serves, with the TP shards of wq_b
# (N / tp) and wo_b (K / tp); the indexer's wq_b is wq_b's TP8 shape.
FLASH_SHAPES = FLASH_LINEAR_SHAPES   # the real shapes and TP shards (tests/helpers.py)


def test_plans_for_the_flash_shapes_are_consistent():
    # Host-side only: every row bucket of every shape gets a launch that covers K with no empty split.
    for _, n, k in FLASH_SHAPES:
        weight = torch.empty(n, k, dtype=torch.float8_e4m3fn, device=DEVICE)
        plan = LowLatencyMM(weight, torch.empty(-(-n // 32), k // 32, dtype=torch.uint8, device=weight.device))
        for m in (1, 2, 4, 8, 16, 32, 64):
            launch = plan.launch_for(m)
            assert launch.block_m >= m and k % launch.config.block_k == 0
            assert launch.k_per_split % launch.config.block_k == 0
            assert (launch.split - 1) * launch.k_per_split < k <= launch.split * launch.k_per_split


@pytest.mark.gpu
@pytest.mark.parametrize("name,n,k", FLASH_SHAPES, ids=[s[0] for s in FLASH_SHAPES])
def test_flash_shapes_on_gpu(name, n, k):
    gen = _gen(n + k)
    x_all, _, codes_all, sx_all, weight, w_scale = linear_operands(gen, 64, n, k)
    plan = LowLatencyMM(weight, w_scale)
    for m in (1, 2, 4, 8, 16, 32, 64):
        codes, x_scale = codes_all[:m], sx_all[:m]
        ref = mxfp8_mm(codes, x_scale, weight, w_scale)
        for _ in range(2):   # the second call replays the split-K counters
            y = plan(codes, x_scale, _poisoned(m, n))
            assert not torch.isnan(y).any(), f"{name} M={m}: unwritten output elements"
            assert rel_rms(y, ref) < 1e-3, (name, m)
            # FP8 MMAs keep fewer than 24 bits while adding a block's 32 products: allow 2 ulps.
            assert row_ulp_distance(y, ref) <= 2, (name, m, row_ulp_distance(y, ref))
        assert int(plan._counters.abs().sum()) == 0


WORD_SHAPES = [s for s in FLASH_SHAPES if s[0] in ("fused_wqa_wkv", "wq_b", "wo_b", "wo_b_tp2")]


@pytest.mark.gpu
@pytest.mark.parametrize("name,n,k", WORD_SHAPES, ids=[s[0] for s in WORD_SHAPES])
def test_gpu_scale_words_give_the_byte_path_bits(name, n, k):
    """At the real shapes (and `wo_b`'s TP2 shard, whose tuned table dequantizes: the other loop),
    every row bucket whose tuned config can load words (block_k 128 or 256): the tuned configs with
    word-loaded scales give the bits of the same configs with byte loads."""
    x_all, _, codes_all, sx_all, weight, w_scale = linear_operands(_gen(n + k + 1), 64, n, k)
    tuned = LowLatencyMM(weight, w_scale)
    words, plan = (LowLatencyMM(weight, w_scale, config={b: dataclasses.replace(tuned.launch_for(b).config,
                                                                                scale_words=on)
                                                         for b in (16, 32, 64)}) for on in (True, False))
    ran = []
    for m in (1, 5, 16, 17, 32, 33, 64):
        if not words.launch_for(m).scale_word:        # a 64-deep step: bytes on both sides
            continue
        assert plan.launch_for(m).scale_word == 0, (name, m)
        y = plan(codes_all[:m], sx_all[:m], _poisoned(m, n))
        assert torch.equal(words(codes_all[:m], sx_all[:m], _poisoned(m, n)), y), (name, m)
        ran.append(words.launch_for(m).config.dequant)
    assert ran and (name != "wo_b_tp2" or any(ran)), (name, ran)


def _check_rope_epilogue(plan: LowLatencyMM, codes, x_scale, cos, sin, what) -> None:
    """The plan's query-RoPE epilogue gives the GEMM's bits followed by `query_rope_`'s; the
    non-rotary columns are the plain GEMM's, and the rotary ones moved."""
    m, n = codes.shape[0], plan.n
    plain = plan(codes, x_scale, _poisoned(m, n))
    want = plain.clone()
    query_rope_(want.view(m, -1, 512), cos, sin)
    got = plan(codes, x_scale, _poisoned(m, n), rope=(cos, sin))
    tail = (torch.arange(n, device=DEVICE) % 512) >= 448
    assert bits_differ(got, want) == 0, f"{what}: {bits_differ(got, want)} outputs differ from GEMM + query RoPE"
    assert bits_differ(got[:, ~tail], plain[:, ~tail]) == 0 and bits_differ(got[:, tail], plain[:, tail]) > 0, what


@pytest.mark.parametrize("config", [LowLatencyConfig(block_n=512, block_k=256, split=1),
                                    LowLatencyConfig(block_n=128, block_k=128, split=2)], ids=["one-split", "splitk"])
def test_rope_epilogue_is_gemm_then_query_rope(config):
    # 1024 x 256: two heads; the split-K plan rotates in the last arriver, one tile in four.
    m, n, k = 3, 1024, 256
    _, _, codes, x_scale, weight, w_scale = linear_operands(_gen(11), m, n, k)
    cos, sin = rope_operands(_gen(2), m)
    _check_rope_epilogue(LowLatencyMM(weight, w_scale, config=config), codes, x_scale, cos, sin, str(config))
    plan = LowLatencyMM(weight, w_scale, config=config)
    for bad, word in (((cos,), "rope"), ((cos[:2], sin), "cos"), ((cos, sin.double()), "sin")):
        with pytest.raises((TypeError, ValueError), match=word):
            plan(codes, x_scale, rope=bad)
    with pytest.raises(ValueError, match="bfloat16"):
        plan(codes, x_scale, torch.empty(m, n, device=DEVICE), rope=(cos, sin))


@pytest.mark.gpu
@pytest.mark.parametrize("name,n,k", [s for s in FLASH_SHAPES if s[0].startswith("wq_b")],
                         ids=[s[0] for s in FLASH_SHAPES if s[0].startswith("wq_b")])
def test_rope_epilogue_on_gpu(name, n, k):
    # The tuned plans at wq_b and its TP shards, every row count: the epilogue's inline-PTX
    # rotation gives query_rope_'s bits (compiled with fp fusion off).
    _, _, codes_all, sx_all, weight, w_scale = linear_operands(_gen(n + k + 2), 64, n, k)
    cos_all, sin_all = rope_operands(_gen(n), 64)
    plan = LowLatencyMM(weight, w_scale)
    for m in range(1, 65):
        _check_rope_epilogue(plan, codes_all[:m], sx_all[:m], cos_all[:m], sin_all[:m], f"{name} M={m}")
    assert int(plan._counters.abs().sum()) == 0


def _check_index_query_epilogue(plan: LowLatencyMM, codes, x_scale, cos, sin, what, reference=False) -> None:
    """The plan's index-query epilogue gives the bits of the GEMM followed by `index_query_`'s iq
    (RoPE on each head's channels 64..127, MXFP4 fake-quant per 32-channel block); both halves of
    every head moved (the fake-quant touches all), on the GPU the plain call's bits did not (the
    interpreter runs the same plain kernel in the other tests). reference: the
    iq from the reference's `mxfp4_fake(rope_tail(...))` instead, index_query_'s bits
    (tests/ops/test_index_query.py) in a fraction of the interpreter's time."""
    m, n = codes.shape[0], plan.n
    plain = plan(codes, x_scale, _poisoned(m, n))
    if reference:
        cis = torch.complex(cos, sin).cpu()
        want = mxfp4_fake(rope_tail(plain.cpu().view(m, n // 128, 128), cis, 64)).to(DEVICE)
    else:
        want = torch.empty(m, n // 128, 128, dtype=torch.bfloat16, device=DEVICE)
        index_query_(plain, torch.zeros(m, n // 128, device=DEVICE), cos, sin, 1.0, want,
                     torch.empty(m, n // 128, dtype=torch.bfloat16, device=DEVICE))
    got = plan(codes, x_scale, _poisoned(m, n), index_query=(cos, sin))
    assert bits_differ(got, want.view(m, n)) == 0, \
        f"{what}: {bits_differ(got, want.view(m, n))} outputs differ from GEMM + index_query_"
    tail = (torch.arange(n, device=DEVICE) % 128) >= 64
    assert bits_differ(got[:, tail], plain[:, tail]) > 0 and bits_differ(got[:, ~tail], plain[:, ~tail]) > 0, what
    if DEVICE == "cuda":
        assert bits_differ(plan(codes, x_scale, _poisoned(m, n)), plain) == 0, f"{what}: plain bits moved"


@pytest.mark.parametrize("heads", [32, 64])
def test_index_query_epilogue_is_gemm_then_index_query(heads):
    # The indexer's wq_b at both head counts (K cut to 64: the epilogue does not see K) with the
    # step's interpreter plan (512-row tiles, one split): 1 row, 3 rows (the row bucket's edge) and
    # 16 (a full bucket; against the reference's iq, which is index_query_'s: its 128 interpreted
    # programs would take 2-3 s), ~1.5 s a head count.
    n, k = heads * 128, 64
    _, _, codes_all, sx_all, weight, w_scale = linear_operands(_gen(heads), 16, n, k)
    cos_all, sin_all = rope_operands(_gen(heads + 1), 16)
    plan = LowLatencyMM(weight, w_scale, config=LowLatencyConfig(block_n=512, block_k=64, split=1))
    for m in (1, 3, 16):
        _check_index_query_epilogue(plan, codes_all[:m], sx_all[:m], cos_all[:m], sin_all[:m], f"Hi={heads} M={m}",
                                    reference=m == 16)


def test_index_query_epilogue_split_k_and_small_tiles():
    # Split-K (the last arriver applies it) with 32-row tiles, one MX block each (a quarter head:
    # tiles without, then with rotary pairs), at an edge row count; 16-row tiles, half an MX
    # block, are refused by name, as are the other bad arguments.
    m, n, k = 5, 256, 128
    _, _, codes, x_scale, weight, w_scale = linear_operands(_gen(12), m, n, k)
    cos, sin = rope_operands(_gen(3), m)
    plan = LowLatencyMM(weight, w_scale, config=LowLatencyConfig(block_n=32, block_k=32, split=2))
    assert plan.launch_for(m).split == 2
    _check_index_query_epilogue(plan, codes, x_scale, cos, sin, "split-K block_n 32")
    assert int(plan._counters.abs().sum()) == 0
    small = LowLatencyMM(weight, w_scale, config=LowLatencyConfig(block_n=16, block_k=32, split=1))
    odd = LowLatencyMM(*linear_operands(_gen(13), m, 192, k)[4:])
    cases = [
        (lambda: small(codes, x_scale, index_query=(cos, sin)), "index_query.*block_n"),
        (lambda: plan(codes, x_scale, index_query=cos), "index_query"),
        (lambda: plan(codes, x_scale, index_query=(cos[:2], sin)), "cos"),
        (lambda: plan(codes, x_scale, index_query=(cos, sin.double())), "sin"),
        (lambda: plan(codes, x_scale, torch.empty(m, n, device=DEVICE), index_query=(cos, sin)), "bfloat16"),
        (lambda: plan(codes, x_scale, index_query=(cos, sin), rope=(cos, sin)), "index_query and rope"),
        (lambda: odd(codes, x_scale, index_query=(cos, sin)), "index_query.*128"),
    ]
    for make, word in cases:
        raises(word, make)


INDEXER_WQ_B_SHAPES = [("indexer_wq_b", 4096, 1280), ("indexer_wq_b_64heads", 8192, 1280)]


@pytest.mark.gpu
@pytest.mark.parametrize("name,n,k", INDEXER_WQ_B_SHAPES, ids=[s[0] for s in INDEXER_WQ_B_SHAPES])
def test_index_query_epilogue_on_gpu(name, n, k):
    # The step's plans for the indexer's wq_b at 32 and 64 index heads (the measured table: split-K
    # at 32 heads, one split at 64), every row count 1..64 (every row bucket's configuration): the
    # epilogue gives GEMM + index_query_'s bits (its rotation as inline PTX, that kernel's with fp
    # fusion off).
    _, _, codes_all, sx_all, weight, w_scale = linear_operands(_gen(n + k + 3), 64, n, k)
    cos_all, sin_all = rope_operands(_gen(n + 1), 64)
    plan = LowLatencyMM(weight, w_scale)
    for m in range(1, 65):
        _check_index_query_epilogue(plan, codes_all[:m], sx_all[:m], cos_all[:m], sin_all[:m], f"{name} M={m}")
    assert int(plan._counters.abs().sum()) == 0
