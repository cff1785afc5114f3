"""Sparse MLA decode against `reference.attention.sparse_attention` fed the same (decoded) keys.

Tolerances. The contract fixes every rounding that matters at the BF16 level: the 64-key blocks of
the joined key list, P rounded to BF16 against the running max at each block, o rounded once. What
it leaves open is the order of FP32 sums (the 512-long score dot, P.V, the running sum) and the
last bit of exp. So:
- On exact-score inputs (`exact_case`: key values on a grid of 0.5 below 8, q on a grid of 1/8 below
  4, a power-of-two scale) every score is exact in FP32 whatever the summation order, so P is the
  contract's bit for bit; what can still differ is the FP32 order of P.V and of the sum, which moves
  o across a BF16 rounding boundary only when acc / sum lies within a few FP32 ulps of one (a
  chance of about 2^-14 per element). There the kernel must give the reference's bits except for
  such rare elements, each within 1 BF16 ulp (`check_exact`: the CPU, where the interpreter's exp
  and the reference's are NumPy's and torch's FP32 exp). A kernel that rounds P against another
  block's max fails this (`test_other_block_boundaries_fail`: 16-, 32- and 128-key blocks differ in
  0.1-2 % of the elements, by up to 132 ulps). On the GPU the kernel's exp (the CUDA math library's
  expf) and torch's may still differ in the last FP32 bit, which flips P where exp(s - max) lies
  within that bit of a BF16 rounding boundary (a chance of about 2^-15 per probability); so there
  the exact-score check is the flip bound below, at least 99.5 % of the elements bitwise equal, and
  `out` nearer the contract's reference than the references of 16-, 32-, 128- and 1024-key blocks,
  which on some cases differ from it in fewer elements than that allowance (`check_exact_gpu`).
- On random inputs a score's FP32 sum order can differ from the reference's by a few FP32 ulps,
  which flips P's BF16 rounding where exp(s - max) lies that close to a rounding boundary; a flip
  moves P_j by one BF16 ulp (<= 2^-7 P_j). Every P flipping at once bounds |o - o_ref| by
  2^-7 * sum_j softmax_j |K_j| + 1 ulp of o (`flip_bound`), elementwise.
"""

import math

import pytest
import torch

import dsv41_decode.reference.attention as ref_attention
from dsv41_decode.ops.sparse_mla import (BLOCK_KEYS, FP32_STEP_TILING, STEP_TILINGS, SparseMlaPlan, sparse_mla,
                                         sparse_mla_)
from dsv41_decode.records import pack_compressed_kv, pack_window_kv, unpack_compressed_kv, unpack_window_kv
from dsv41_decode.reference.attention import sparse_attention_records

D = 512
SCALE = 1.0 / math.sqrt(576)
EXACT_SCALE = 2.0 ** -4


def make_case(n, h, w, k, *, device="cpu", seed=0, window_fill=None, comp_valid=0.8, sink_inf=False,
              s_w=None, s_c=None, exact=False):
    """Random operands: pools of records, q, tables (window_fill[r]: the valid trailing window
    entries of row r; comp_valid: the share of valid top-k entries), a sink. exact: key values on
    a grid of 0.5 below 8 and q on a grid of 1/8 below 4 (every score exact in FP32)."""
    g = torch.Generator().manual_seed(seed)
    s_w = s_w or max(2 * w, 8)
    s_c = s_c or max(2 * k, 8)
    if exact:
        wvals = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0])
        wv = wvals[torch.randint(0, len(wvals), (s_w, D), generator=g)]
        wv = wv * (torch.randint(0, 2, (s_w, D), generator=g) * 2 - 1)
        wpool = torch.cat((wv.to(torch.float8_e4m3fn).view(torch.uint8),
                           torch.full((s_w, D // 32), 127, dtype=torch.uint8)), 1)     # scale 1.0
        cpool = torch.cat((torch.randint(0, 256, (s_c, D // 2), generator=g, dtype=torch.uint8),
                           torch.full((s_c, D // 16), 0x38, dtype=torch.uint8)), 1)    # E4M3 1.0
        q = (torch.randint(-31, 32, (n, h, D), generator=g) / 8).to(torch.bfloat16)
    else:
        wpool = pack_window_kv(torch.randn(s_w, D, generator=g) * 2.0)
        cpool = pack_compressed_kv(torch.randn(s_c, D, generator=g))
        q = (torch.randn(n, h, D, generator=g) * 0.5).to(torch.bfloat16)
    wt = torch.randint(0, s_w, (n, w), generator=g).to(torch.int32)
    for r, f in enumerate(window_fill or []):
        wt[r, : w - f] = -1
    ct = torch.randint(0, s_c, (n, k), generator=g).to(torch.int32)
    ct[torch.rand(n, k, generator=g) >= comp_valid] = -1
    sink = torch.randn(h, generator=g) * 4
    if sink_inf:
        sink[:] = float("-inf")
    return tuple(x.to(device) for x in (q, wpool, cpool, wt, ct, sink))


def reference(q, wpool, cpool, wt, ct, sink, scale=SCALE):
    """On q's device (the GPU tests' reference runs on the GPU); returned on the CPU."""
    return sparse_attention_records(q, wpool, cpool, wt, ct, sink, scale).cpu()


def flip_bound(q, wpool, cpool, wt, ct, sink, ref, scale=SCALE):
    """Elementwise 2^-7 * sum_j softmax_j |K_j| + 1 ulp of ref (module doc), on the CPU."""
    bounds = []
    wkeys, ckeys = unpack_window_kv(wpool), unpack_compressed_kv(cpool)
    for r in range(q.shape[0]):
        w, c = wt[r].long(), ct[r].long()
        keys = torch.cat((wkeys[w[w >= 0]], ckeys[c.clamp(min=0)]))          # the joined key list
        valid = torch.cat((torch.ones(int((w >= 0).sum()), dtype=torch.bool, device=w.device), c >= 0))
        s = (q[r].float() @ keys.float().T * scale).masked_fill(~valid, float("-inf"))   # [H, m]
        s = torch.cat((s, sink.float()[:, None]), 1)
        w = torch.softmax(s, 1)[:, :-1].nan_to_num(0.0)
        bounds.append(2.0 ** -7 * (w @ keys.float().abs()))
    ref = ref.float()
    ulp = torch.where(ref == 0, torch.full_like(ref, 2.0 ** -133),
                      2.0 ** (torch.floor(torch.log2(ref.abs().clamp(min=1e-38))) - 7))
    return torch.stack(bounds).cpu() + ulp


def ulps(a, b):
    """Elementwise distance in BF16 ulps (the integers of the order-preserving bit mapping)."""
    def key(x):
        x16 = x.cpu().contiguous().view(torch.int16).long()
        return torch.where(x16 < 0, -(x16 & 0x7FFF), x16)
    return (key(a) - key(b)).abs()


def check_exact(out, ref):
    """Exact-score inputs (module doc): the reference's bits except rare elements, each 1 ulp off."""
    u = ulps(out, ref)
    assert int(u.max()) <= 1, f"max {int(u.max())} ulp"
    assert int((u > 0).sum()) <= max(2, u.numel() // 2000), f"{int((u > 0).sum())} of {u.numel()} differ"


def check_exact_gpu(out, case, ref, scale):
    """Exact-score inputs on the GPU (module doc): the flip bound, at least 99.5 % of the elements
    bitwise, and nearer the contract's 64-key blocks than any other: wherever a reference with
    16-, 32-, 128- or 1024-key blocks differs from the contract's, `out` differs from it in more
    elements than from the contract's (the bound and the count alone pass another block size on
    some cases: a few elements differ there)."""
    check_bound(out, case, ref, scale)
    u = ulps(out, ref)
    differ = int((u > 0).sum())
    assert differ <= u.numel() // 200, f"{differ} of {u.numel()} differ"
    for keys in OTHER_BLOCK_KEYS:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(ref_attention, "BLOCK_KEYS", keys)
            other = reference(*case, scale)
        if bool((ulps(other, ref) > 0).any()):
            apart = int((ulps(out, other) > 0).sum())
            assert differ < apart, (f"nearer {keys}-key blocks than the contract's 64: {differ} elements differ from "
                                    f"the contract's reference, {apart} from that one")


OTHER_BLOCK_KEYS = (16, 32, 128, 1024)      # check_exact_gpu's other block sizes (1024: one block a row)


def check_bound(out, case, ref, scale=SCALE):
    err = (out.cpu().float() - ref.float()).abs()
    bound = flip_bound(*case, ref, scale)
    assert torch.isfinite(out.float()).all()
    assert bool((err <= bound).all()), f"max excess {float((err - bound).max()):.3g}"


def run(plan, case, scale=SCALE):
    out = torch.empty(case[0].shape[0], plan.heads, D, dtype=torch.bfloat16, device=case[0].device)
    sparse_mla_(plan, *case, scale, out)
    return out


def workspace_is_clear(plan):
    return int(plan.flags.abs().sum()) == 0 and int(plan.counters.abs().sum()) == 0 and int(plan.ticket) == 0


def test_block_keys_are_the_contracts():
    assert BLOCK_KEYS == ref_attention.BLOCK_KEYS == 64


@pytest.mark.parametrize("split, separate", [(False, False), (True, False), (True, True)])
def test_exact_scores_give_the_contracts_bits(split, separate):
    # rows: full window; window ending inside a block (60 keys: block 0 mixes window and top-k);
    # one window key; 100 top-k entries (not a multiple of 64) with -1 entries among them
    n, h, w, k = 3, 16, 128, 100
    case = make_case(n, h, w, k, seed=5, window_fill=[128, 60, 1], exact=True)
    plan = SparseMlaPlan.build(n, h, w, k, "cpu", split=split, separate_combine=separate)
    check_exact(run(plan, case, EXACT_SCALE), reference(*case, EXACT_SCALE))
    assert workspace_is_clear(plan)


def test_other_block_boundaries_fail(monkeypatch):
    # the exact-score check catches P rounded against another block's running max
    n, h, w, k = 1, 16, 128, 100
    case = make_case(n, h, w, k, seed=6, window_fill=[60], exact=True)
    out = run(SparseMlaPlan.build(n, h, w, k, "cpu", split=False), case, EXACT_SCALE)
    monkeypatch.setattr(ref_attention, "BLOCK_KEYS", 16)
    with pytest.raises(AssertionError):
        check_exact(out, reference(*case, EXACT_SCALE))


@pytest.mark.parametrize("keys", OTHER_BLOCK_KEYS)
def test_the_gpu_check_refuses_other_block_sizes(keys, monkeypatch):
    # `check_exact_gpu` (the GPU tests' exact-score check) on the CPU: the kernel's output passes,
    # the reference of another block size fails, also where the count alone lets it pass (16-, 32-
    # and 128-key blocks on this case: the nearness to the contract's blocks catches them)
    n, h, w, k = 2, 8, 128, 512
    case = make_case(n, h, w, k, seed=8, window_fill=[128, 60], exact=True)
    ref = reference(*case, EXACT_SCALE)
    check_exact_gpu(run(SparseMlaPlan.build(n, h, w, k, "cpu", split=False), case, EXACT_SCALE), case, ref, EXACT_SCALE)
    with monkeypatch.context() as mp:
        mp.setattr(ref_attention, "BLOCK_KEYS", keys)
        other = reference(*case, EXACT_SCALE)
    differ = int((ulps(other, ref) > 0).sum())
    within = differ <= other.numel() // 200
    assert differ > 0 and within == (keys != 1024), differ
    with pytest.raises(AssertionError, match="nearer" if within else "differ"):
        check_exact_gpu(other, case, ref, EXACT_SCALE)


@pytest.mark.parametrize("n, h, k", [(2, 16, 40), (1, 32, 200)])
def test_random_inputs_within_the_flip_bound(n, h, k):
    case = make_case(n, h, 128, k, seed=n * 100 + h + k, window_fill=[128, 3][:n])
    out = sparse_mla(*case, SCALE)
    check_bound(out, case, reference(*case))


def test_edge_rows_and_separate_combine_bits():
    # row 0: nothing valid -> zeros; row 1: no top-k entries yet; row 2: window not yet full;
    # sinks of -inf; split rows combined by the last block to arrive or by a second launch
    n, h, w, k = 3, 32, 16, 72
    q, wpool, cpool, wt, ct, sink = case = make_case(n, h, w, k, seed=11, sink_inf=True, exact=True)
    wt[0] = -1
    ct[0] = -1
    ct[1] = -1
    wt[2, :13] = -1
    outs = [run(SparseMlaPlan.build(n, h, w, k, "cpu", split=True, separate_combine=sep), case, EXACT_SCALE)
            for sep in (False, True)]
    assert torch.equal(outs[0], outs[1])
    assert torch.equal(outs[0][0].float(), torch.zeros(h, D))
    check_exact(outs[0], reference(*case, EXACT_SCALE))


def test_a_row_alone_gives_its_bits_among_others():
    # batch invariance: a row's bits do not depend on the rows beside it (the block programs take
    # their (row, head group, block) from tickets: a wrong mapping mixes rows up)
    n, h, w, k = 3, 16, 16, 64
    case = make_case(n, h, w, k, seed=13, window_fill=[16, 9, 16], exact=True)
    plan = SparseMlaPlan.build(4, h, w, k, "cpu", split=True)
    together = run(plan, case, EXACT_SCALE)
    for r in range(n):
        alone = run(plan, tuple(t[r:r + 1] if i in (0, 3, 4) else t for i, t in enumerate(case)), EXACT_SCALE)
        assert torch.equal(alone[0], together[r])
    assert workspace_is_clear(plan)


def test_plans_sharing_a_workspace_give_their_own_bits():
    # what the decode step does (decode.buffers.Workspaces): plans of two shapes (2 and 4 blocks of
    # 64 keys; the second grows the pool's buffers, re-seating the first's views) and both
    # combinations take their workspaces from one pool and run in turn; each gives
    # the bits of a plan with its own workspace, and the flags, counters and ticket they share are
    # zero after every launch (the contract that makes the sharing safe)
    from dsv41_decode.decode.buffers import Workspaces
    pool = Workspaces("cpu")
    n, h, w = 1, 16, 16
    shapes = [(72, False), (200, True)]
    cases = [make_case(n, h, w, k, seed=20 + k, window_fill=[5], exact=True) for k, _ in shapes]
    shared = [SparseMlaPlan.build(n, h, w, k, "cpu", split=True, separate_combine=sep, workspace=pool)
              for k, sep in shapes]
    own = [SparseMlaPlan.build(n, h, w, k, "cpu", split=True, separate_combine=sep) for k, sep in shapes]
    for a, b in (("part_acc", "flags"), ("ticket", "counters")):
        assert getattr(shared[0], a).untyped_storage().data_ptr() == getattr(shared[1], a).untyped_storage().data_ptr()
        assert getattr(own[0], b).untyped_storage().data_ptr() != getattr(own[1], b).untyped_storage().data_ptr()
    expected = [run(p, c, EXACT_SCALE) for p, c in zip(own, cases)]
    for i in (1, 0, 1):
        assert torch.equal(run(shared[i], cases[i], EXACT_SCALE), expected[i])
        assert all(workspace_is_clear(p) for p in shared)


def test_step_tilings_cover_every_row_count():
    plans = SparseMlaPlan.for_step(64, 64, 128, 512, "cpu")
    assert [p.max_rows for p in plans] == [hi for hi, _ in STEP_TILINGS if hi < 64] + [64]
    assert all(p.split for p in plans)                 # one combination order at every row count
    assert all(p.n_blocks == 10 for p in plans)
    assert all(p.block_h == 16 for p in SparseMlaPlan.for_step(4, 8, 16, 16, "cpu"))   # 8 heads pad to 16


def test_fp32_tiling_in_the_interpreter():
    # The exact step's plan (`for_step(fp32_dots=True)`: FP32 operands, dots of 64 dims, the keys
    # decoded per chunk, each chunk of P.V stored as it is summed) and a 32-dim variant. Exact-score
    # inputs: every score is exact whatever the chunks, so P is the contract's, and each P.V output
    # is the same 64-long NumPy dot of the same operands: the default tiling's bits (and the
    # reference's, `check_exact`), the inline combination's too. Random inputs: only the score's
    # FP32 order differs from the default's (128-dim dots), within the flip bound.
    n, h, w, k = 3, 16, 16, 72
    case = make_case(n, h, w, k, seed=31, window_fill=[16, 5, 1], exact=True)
    (plan,) = SparseMlaPlan.for_step(4, 8, w, k, "cpu", fp32_dots=True)     # 8 heads pad to 16
    assert (plan.max_rows, plan.block_h, plan.num_warps, plan.split, plan.separate_combine) == (4, 16, 8, True, True)
    assert plan.bf16_dot is False and plan.dot_dims == FP32_STEP_TILING["dot_dims"] == 64
    plan = SparseMlaPlan.for_step(4, h, w, k, "cpu", fp32_dots=True)[0]
    default = run(SparseMlaPlan.build(n, h, w, k, "cpu", split=True), case, EXACT_SCALE)
    out = run(plan, case, EXACT_SCALE)
    assert torch.equal(out, default)
    assert torch.equal(run(SparseMlaPlan.build(n, h, w, k, "cpu", bf16_dot=False, dot_dims=32), case, EXACT_SCALE),
                       default)
    check_exact(out, reference(*case, EXACT_SCALE))
    assert workspace_is_clear(plan)
    case = make_case(2, 32, 128, 40, seed=32, window_fill=[128, 3])
    check_bound(run(SparseMlaPlan.build(2, 32, 128, 40, "cpu", bf16_dot=False, dot_dims=64), case), case,
                reference(*case))


def test_dot_dims_needs_fp32_operands_and_the_split():
    assert SparseMlaPlan.build(2, 16, 16, 8, "cpu").dot_dims == 128          # the interpreter's one tiling
    with pytest.raises(ValueError, match="dot_dims=64 needs FP32 operands"):
        SparseMlaPlan.build(2, 16, 16, 8, "cpu", split=False, dot_dims=64)
    with pytest.raises(ValueError, match="dot_dims=32 needs FP32 operands"):
        SparseMlaPlan.build(2, 16, 16, 8, "cpu", bf16_dot=True, dot_dims=32)
    with pytest.raises(ValueError, match="dot_dims must be one of"):
        SparseMlaPlan.build(2, 16, 16, 8, "cpu", dot_dims=48)
    with pytest.raises(ValueError, match="bf16_dot=True needs a CUDA device outside Triton's interpreter"):
        SparseMlaPlan.build(2, 16, 16, 8, "cpu", bf16_dot=True)
    with pytest.raises(TypeError, match="fp32_dots"):
        SparseMlaPlan.for_step(2, 16, 16, 8, "cpu", fp32_dots="yes")


def check_bad_launch_args(launch, plan, n: int, h: int, w: int, k: int) -> dict:
    """`launch(plan, **args)` (`sparse_mla_`'s arguments, n rows of h heads, w window slots and k
    top-k entries, plan built for n rows) raises an error that names each bad argument in turn and
    names max_rows for more rows than the plan's; returns the good arguments."""
    q, wpool, cpool, wt, ct, sink = make_case(n, h, w, k, seed=1)
    out = torch.empty(n, h, D, dtype=torch.bfloat16)
    args = dict(q=q, window_pool=wpool, comp_pool=cpool, window_table=wt, comp_table=ct, sink=sink,
                scale=SCALE, out=out)
    bad = {
        "q": (q.float(), TypeError),
        "window_pool": (wpool[:, :512], ValueError),
        "comp_pool": (cpool.to(torch.int8), TypeError),
        "window_table": (wt.long(), TypeError),
        "comp_table": (ct[:, :4], ValueError),
        "sink": (sink[:4], ValueError),
        "out": (out.float(), TypeError),
        "scale": ("0.1", TypeError),
    }
    for name, (value, exc) in bad.items():
        with pytest.raises(exc, match=name):
            launch(plan, **{**args, name: value})
    with pytest.raises(ValueError, match="max_rows"):
        launch(plan, **{**args, "q": torch.cat((q, q))})
    return args


def test_bad_inputs_name_the_argument():
    n, h, w, k = 2, 8, 16, 8
    args = check_bad_launch_args(sparse_mla_, SparseMlaPlan.build(2, h, w, k, "cpu"), n, h, w, k)
    with pytest.raises(ValueError, match="heads"):
        SparseMlaPlan.build(2, 12, w, k, "cpu")
    with pytest.raises(ValueError, match="max_rows"):
        SparseMlaPlan.build(300, h, w, k, "cpu")
    with pytest.raises(TypeError, match="split"):
        SparseMlaPlan.build(2, h, w, k, "cpu", split=2)
    with pytest.raises(TypeError, match="plan"):
        sparse_mla_(None, **args)


@pytest.mark.parametrize("kw, exc, match", [
    (dict(num_warps=3), ValueError, "num_warps must be a power of two in 1..16, got 3"),
    (dict(num_warps=32), ValueError, "num_warps must be a power of two in 1..16, got 32"),
    (dict(heads=16.0), ValueError, "heads must be one of"),
    (dict(dot_dims=64.0), ValueError, "dot_dims must be one of"),
    (dict(separate_combine="yes"), TypeError, "separate_combine must be a bool, got 'yes'"),
    (dict(native_fp8="no"), TypeError, "native_fp8 must be None, True or False, got 'no'"),
    (dict(bf16_dot=0), TypeError, "bf16_dot must be None, True or False, got 0"),
])
def test_bad_plan_options_name_the_option(kw, exc, match):
    args = dict(max_rows=2, heads=16, window=16, topk=8, device="cpu") | kw
    with pytest.raises(exc, match=match):
        SparseMlaPlan.build(**args)


GPU_POOLS = dict(device="cuda", s_w=4096, s_c=8192, comp_valid=0.95)


def gpu_tables(n):
    """Window fills of the GPU cases: full windows, one ending inside a block, a single key."""
    return [128, 60, 1][:n] + [128] * max(0, n - 3)


@pytest.mark.gpu
@pytest.mark.parametrize("h", [8, 16, 32, 64])
@pytest.mark.parametrize("n", [1, 2, 4, 8, 16, 32, 64])
def test_gpu_step_plans(h, n):
    # the step's plan of every row count and head count: exact-score bits, the random-input bound,
    # two launches give the same bits, the workspace is clear after each
    w, k = 128, 512
    plan = next(p for p in SparseMlaPlan.for_step(64, h, w, k, "cuda") if n <= p.max_rows)
    case = make_case(n, h, w, k, seed=h * 1000 + n, window_fill=gpu_tables(n), exact=True, **GPU_POOLS)
    out = run(plan, case, EXACT_SCALE)
    assert torch.equal(out, run(plan, case, EXACT_SCALE))
    check_exact_gpu(out, case, reference(*case, EXACT_SCALE), EXACT_SCALE)
    case = make_case(n, h, w, k, seed=h * 1000 + n + 1, window_fill=gpu_tables(n), **GPU_POOLS)
    check_bound(run(plan, case), case, reference(*case))
    torch.cuda.synchronize()
    assert workspace_is_clear(plan)


@pytest.mark.gpu
def test_gpu_unsplit_and_every_tiling_agree():
    # the sequential loop (one program per row) and every split tiling give the exact-score bits;
    # the step's split tilings (16 or 32 heads a program, 8 warps) give each other's bits (one
    # combination order; 64-head programs and 4 warps take other MMA shapes, which were measured to
    # round the FP32 sums differently)
    n, h, w, k = 5, 64, 128, 512
    case = make_case(n, h, w, k, seed=5, window_fill=[128, 60, 1, 0, 128], exact=True, **GPU_POOLS)
    case[4][3] = -1                                  # row 3: no valid key at all
    ref = reference(*case, EXACT_SCALE)
    split_outs = []
    for opts in ({"split": False}, {"split": False, "block_h": 32}, {}, {"block_h": 32},
                 {"separate_combine": True}, {"block_h": 32, "separate_combine": True}, {"block_h": 64},
                 {"bf16_dot": False}, {"native_fp8": False}):
        out = run(SparseMlaPlan.build(n, h, w, k, "cuda", **opts), case, EXACT_SCALE)
        assert torch.equal(out[3].float().cpu(), torch.zeros(h, D)), opts
        check_exact_gpu(out, case, ref, EXACT_SCALE)
        if opts.get("split", True) and opts.get("block_h", 16) <= 32 and "bf16_dot" not in opts:
            split_outs.append(out)
    assert all(torch.equal(o, split_outs[0]) for o in split_outs)


@pytest.mark.gpu
@pytest.mark.parametrize("others", [1, 3, 7, 15, 31, 63])
def test_gpu_a_row_alone_gives_its_bits_among_others(others):
    # batch invariance through the step's plans: the bucket of 1 row against the bucket of 1 + others
    h, w, k = 64, 128, 512
    n = 1 + others
    case = make_case(n, h, w, k, seed=900 + n, window_fill=gpu_tables(n), **GPU_POOLS)
    plans = SparseMlaPlan.for_step(64, h, w, k, "cuda")
    together = run(next(p for p in plans if n <= p.max_rows), case)
    for r in (0, 1, n - 1):
        alone = run(plans[0], tuple(t[r:r + 1] if i in (0, 3, 4) else t for i, t in enumerate(case)))
        assert torch.equal(alone[0], together[r]), r


@pytest.mark.gpu
@pytest.mark.parametrize("h", [64, 8])
@pytest.mark.parametrize("n", [1, 16, 64])
def test_gpu_fp32_step_plan(h, n):
    # the exact step's plan (FP32 operands, IEEE dots: CUDA-core FMAs) at the V4.1-Flash shape (64
    # heads, a TP8 rank's 8; 128 window + 512 top-k keys): exact-score bits as the step's BF16 plans
    # are held to (`check_exact_gpu`), the random-input flip bound, two launches give the same bits,
    # the workspace is clear
    (plan,) = SparseMlaPlan.for_step(64, h, 128, 512, "cuda", fp32_dots=True)
    assert plan.bf16_dot is False and plan.dot_dims == 64
    check_repeatable_on_gpu(plan, n, h, h * 1000 + n + 7, run, workspace_is_clear)


def check_repeatable_on_gpu(plan, n, h, seed, run, workspace_is_clear):
    """A plan at the V4.1-Flash key shape (128 window + 512 top-k keys; n rows, h heads, windows
    `gpu_tables(n)`): exact-score bits (`check_exact_gpu`, case seed `seed`) and the random-input
    flip bound (seed + 1), two launches giving the same bits in each, the workspace clear after.
    run(plan, case, scale) launches it; workspace_is_clear(plan) checks its flags."""
    w, k = 128, 512
    case = make_case(n, h, w, k, seed=seed, window_fill=gpu_tables(n), exact=True, **GPU_POOLS)
    out = run(plan, case, EXACT_SCALE)
    assert torch.equal(out, run(plan, case, EXACT_SCALE))
    check_exact_gpu(out, case, reference(*case, EXACT_SCALE), EXACT_SCALE)
    case = make_case(n, h, w, k, seed=seed + 1, window_fill=gpu_tables(n), **GPU_POOLS)
    out = run(plan, case)
    assert torch.equal(out, run(plan, case))
    check_bound(out, case, reference(*case))
    torch.cuda.synchronize()
    assert workspace_is_clear(plan)


@pytest.mark.gpu
def test_gpu_fp32_tilings_agree_and_rows_are_invariant():
    # With FMA dots each score is one FMA chain over the 512 dims in order and each P.V output one
    # over the block's 64 keys, whatever the chunk width: dots of 32 and 64 dims and both
    # combinations give the same bits; and a row alone gives its bits among 63 others
    n, h, w, k = 64, 64, 128, 512
    case = make_case(n, h, w, k, seed=77, window_fill=gpu_tables(n), **GPU_POOLS)
    (plan,) = SparseMlaPlan.for_step(64, h, w, k, "cuda", fp32_dots=True)
    together = run(plan, case)
    for opts in (dict(dot_dims=32), dict(separate_combine=False)):
        other = SparseMlaPlan.build(n, h, w, k, "cuda", **dict(FP32_STEP_TILING, **opts))
        assert torch.equal(run(other, case), together), opts
    for r in (0, 1, n - 1):
        alone = run(plan, tuple(t[r:r + 1] if i in (0, 3, 4) else t for i, t in enumerate(case)))
        assert torch.equal(alone[0], together[r]), r
