"""GPU tests of the fused ring-attention kernels (ops/*.cu through msparallel_ds.ops.attention).

Skipped, with the reason, where torch has no CUDA or the GPU is older than sm_80. Where CUDA is there, the
extension is built on first use (cached in $TORCH_EXTENSIONS_DIR) and a failing build FAILS the tests.

What is checked (fresh random inputs everywhere, never zeros; fp64 references from the same rounded inputs):
- forward step, every mode, odd lengths, GQA ratios 1/4/8, bf16/fp16, d 64/128, on top of a non-empty running
  state: the fp32 state (acc, m, l) and the finalized (out, lse) against ops.reference in fp64; rows a mode must
  not touch are bitwise unchanged; finalize writes into NaN-poisoned buffers;
- single blocks against torch SDPA (fp64 math) forward and backward, and through the "cuda_fused" Backend;
- backward step, every mode: delta into a poisoned buffer; dq/dk/dv accumulate on top of random fp32 contents;
  the increments against ops.reference in fp64; parts a mode must not touch are bitwise unchanged;
- N zigzag ring steps run one after another (no communication) == one full attention, forward and backward, for
  N in 1, 2, 3, 4, 8; error at N = 8 no worse than at N = 1;
- the one-pass merge kernel against kernels.merge's torch code (any head dim, fp32/bf16/fp16 blocks, -inf rows);
- strided views are read in place, and bad arguments fail with a clear error.
Tolerances are relative L2 errors (‖got - ref‖ / ‖ref‖); bf16 rounding of P and dS dominates them.
"""
import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from msparallel_ds import ops
from msparallel_ds.context_parallel import kernels, ring, sharding
from msparallel_ds.ops import reference as ref
from msparallel_ds.ops.modes import Mode
from msparallel_ds.ops.ring_steps import simulate_ring

_REASON = ops.unavailable_reason()
pytestmark = pytest.mark.skipif(_REASON is not None, reason=f"fused CUDA kernels cannot run here: {_REASON}")

DEV = torch.device("cuda")
BF16, FP16 = torch.bfloat16, torch.float16
DTYPES = pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
HEAD_DIMS = pytest.mark.parametrize("d", [64, 128])
GQA = pytest.mark.parametrize("h,hkv", [(4, 4), (8, 2), (8, 1)], ids=["gqa1", "gqa4", "gqa8"])
# (s_q, s_k): single rows, odd lengths, exact tiles, lengths one off a tile, s_q > s_k and s_q < s_k
LENGTHS = [(1, 1), (17, 33), (64, 64), (63, 65), (200, 78), (258, 130), (130, 258)]
TOL = {BF16: {"out": 1e-2, "grad": 3e-2}, FP16: {"out": 2e-3, "grad": 6e-3}}
LSE_ATOL = 2e-3


@pytest.fixture(scope="module")
def fa():
    try:
        ops.load()
    except ops.OpsUnavailable as exc:
        pytest.fail(f"CUDA is here but the fused kernels do not build or load: {exc}")
    from msparallel_ds.ops import attention

    return attention


def _randn(*shape, dtype=torch.float32, seed):
    g = torch.Generator(device=DEV).manual_seed(seed)
    return torch.randn(*shape, generator=g, device=DEV, dtype=torch.float32).to(dtype)


def _nan(*shape, dtype=torch.float32):
    return torch.full(shape, float("nan"), dtype=dtype, device=DEV)


def _rel(got, want) -> float:
    got, want = got.double(), want.double()
    return ((got - want).norm() / want.norm().clamp_min(1e-300)).item()


def _close(got, want, tol, what):
    torch.cuda.synchronize()
    assert torch.isfinite(got).all(), f"{what}: non-finite values (unwritten elements or NaN)"
    err = _rel(got, want)
    assert err <= tol, f"{what}: relative error {err:.3e} > {tol:.1e}"


def _lse_close(got, want, what):
    """lse: the same rows empty (-inf) on both sides, the finite ones within LSE_ATOL."""
    assert not torch.isnan(got).any(), f"{what}: NaN (unwritten)"
    empty_got, empty_want = torch.isneginf(got), torch.isneginf(want)
    assert torch.equal(empty_got, empty_want), f"{what}: rows without keys differ"
    err = (got.double() - want.double())[~empty_want].abs().max().item() if (~empty_want).any() else 0.0
    assert err <= LSE_ATOL, f"{what}: max abs error {err:.3e} > {LSE_ATOL}"


def _skip_mode(mode, sq, sk) -> bool:
    """The half modes need an even length (the zigzag halves)."""
    return (mode == Mode.KV_FIRST_HALF and sk % 2) or (mode == Mode.Q_SECOND_HALF and sq % 2)


def _poisoned(fa):
    """fa with every freshly allocated output of finalize / backward_preprocess filled with NaN first."""
    def finalize(state, dtype):
        return fa.finalize(state, dtype, out=_nan(*state.acc.shape, dtype=dtype), lse=_nan(*state.m.shape))

    def backward_preprocess(out, dout):
        return fa.backward_preprocess(out, dout, delta=_nan(*out.shape[:3]))

    return SimpleNamespace(new_state=fa.new_state, forward_step=fa.forward_step, finalize=finalize,
                           backward_preprocess=backward_preprocess, backward_step=fa.backward_step)


def _two_block_inputs(b, h, hkv, sq, sk, d, dtype, seed=0):
    """q, a prior k/v block every row sees (FULL, 50 keys), the block under test, and dout."""
    q = _randn(b, h, sq, d, dtype=dtype, seed=seed + 1)
    kp, vp = _randn(b, hkv, 50, d, dtype=dtype, seed=seed + 2), _randn(b, hkv, 50, d, dtype=dtype, seed=seed + 3)
    k, v = _randn(b, hkv, sk, d, dtype=dtype, seed=seed + 4), _randn(b, hkv, sk, d, dtype=dtype, seed=seed + 5)
    do = _randn(b, h, sq, d, dtype=dtype, seed=seed + 6)
    return q, kp, vp, k, v, do


def _ref_state(q, kp, vp, k, v, mode, scale):
    """fp64 reference state after the prior block (FULL) and the block under test (mode)."""
    st = ref.new_state(q.double())
    ref.forward_step(q.double(), kp.double(), vp.double(), st, Mode.FULL, scale)
    ref.forward_step(q.double(), k.double(), v.double(), st, mode, scale)
    return st


# ------------------------------------------------------------------------------------------------ forward step
@DTYPES
@HEAD_DIMS
@GQA
@pytest.mark.parametrize("sq,sk", LENGTHS)
def test_forward_step_vs_reference(fa, dtype, d, h, hkv, sq, sk):
    b, scale = 2, d ** -0.5
    q, kp, vp, k, v, _ = _two_block_inputs(b, h, hkv, sq, sk, d, dtype)
    for mode in Mode:
        if _skip_mode(mode, sq, sk):
            continue
        what = f"{mode.name} {dtype} d={d} h={h}/{hkv} sq={sq} sk={sk}"
        st = fa.new_state(q)
        fa.forward_step(q, kp, vp, st, Mode.FULL, scale)
        before = [t.clone() for t in st]
        fa.forward_step(q, k, v, st, mode, scale)
        want = _ref_state(q, kp, vp, k, v, mode, scale)
        first = ref.parts(mode, sq, sk)[0].start  # rows before it are not this mode's
        for name, t0, t1 in zip(("acc", "m", "l"), before, st):
            assert torch.equal(t0[:, :, :first], t1[:, :, :first]), f"{what}: {name} rows < {first} touched"
        torch.testing.assert_close(st.m, want.m.float(), rtol=1e-5, atol=1e-4, msg=lambda m, w=what: f"{w}: m {m}")
        _close(st.l, want.l, 1e-3, f"{what}: l")
        _close(st.acc, want.acc, TOL[dtype]["out"], f"{what}: acc")
        out, lse = fa.finalize(st, dtype, out=_nan(b, h, sq, d, dtype=dtype), lse=_nan(b, h, sq))
        out_ref, lse_ref = ref.finalize(want, torch.float64)
        _close(out, out_ref, TOL[dtype]["out"], f"{what}: out")
        _lse_close(lse, lse_ref, f"{what}: lse")
        out32, _ = fa.finalize(st, torch.float32, out=_nan(b, h, sq, d), lse=_nan(b, h, sq))
        _close(out32, out_ref, TOL[dtype]["out"], f"{what}: fp32 out")


@DTYPES
@HEAD_DIMS
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("s", [1, 77, 128, 300])
def test_single_block_vs_sdpa(fa, dtype, d, causal, s):
    """Empty state, one FULL / CAUSAL step, finalize == torch SDPA in fp64 (kv repeated for the reference only);
    backward == fp64 autograd through SDPA."""
    b, h, hkv = 2, 8, 2
    scale = d ** -0.5
    q, _, _, k, v, do = _two_block_inputs(b, h, hkv, s, s, d, dtype, seed=10)
    st = fa.new_state(q)
    fa.forward_step(q, k, v, st, Mode.CAUSAL if causal else Mode.FULL, scale)
    out, lse = fa.finalize(st, dtype, out=_nan(b, h, s, d, dtype=dtype), lse=_nan(b, h, s))
    q64, k64, v64 = (x.double().requires_grad_() for x in (q, k, v))
    ke, ve = k64.repeat_interleave(h // hkv, 1), v64.repeat_interleave(h // hkv, 1)
    want = F.scaled_dot_product_attention(q64, ke, ve, is_causal=causal, scale=scale)
    scores = (q64 @ ke.transpose(-1, -2) * scale).detach()
    if causal:
        scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool, device=DEV).triu(1), float("-inf"))
    _close(out, want.detach(), TOL[dtype]["out"], "out vs SDPA")
    _lse_close(lse, torch.logsumexp(scores, -1), "lse vs logsumexp")
    want.backward(do.double())
    delta = fa.backward_preprocess(out, do, delta=_nan(b, h, s))
    dq = torch.zeros(b, h, s, d, device=DEV)
    dk, dv = torch.zeros(b, hkv, s, d, device=DEV), torch.zeros(b, hkv, s, d, device=DEV)
    fa.backward_step(do, q, k, v, lse, delta, dq, dk, dv, Mode.CAUSAL if causal else Mode.FULL, scale)
    for name, got, g in (("dq", dq, q64.grad), ("dk", dk, k64.grad), ("dv", dv, v64.grad)):
        _close(got, g, TOL[dtype]["grad"], f"{name} vs SDPA autograd")


# ------------------------------------------------------------------------------------------------ backward step
@DTYPES
@HEAD_DIMS
@GQA
@pytest.mark.parametrize("sq,sk", LENGTHS)
def test_backward_step_vs_reference(fa, dtype, d, h, hkv, sq, sk):
    b, scale = 2, d ** -0.5
    q, kp, vp, k, v, do = _two_block_inputs(b, h, hkv, sq, sk, d, dtype, seed=20)
    q64, k64, v64, do64 = q.double(), k.double(), v.double(), do.double()
    for mode in Mode:
        if _skip_mode(mode, sq, sk):
            continue
        what = f"{mode.name} {dtype} d={d} h={h}/{hkv} sq={sq} sk={sk}"
        # the FINAL statistics of the two-block attention (exact), as the ring's backward gets them
        out64, lse64 = ref.finalize(_ref_state(q, kp, vp, k, v, mode, scale), torch.float64)
        out, lse = out64.to(dtype), lse64.float()
        delta = fa.backward_preprocess(out, do, delta=_nan(b, h, sq))
        _close(delta, ref.backward_preprocess(out.double(), do64), 1e-5, f"{what}: delta")
        dq0 = _randn(b, h, sq, d, seed=31)
        dk0, dv0 = _randn(b, hkv, sk, d, seed=32), _randn(b, hkv, sk, d, seed=33)
        dq, dk, dv = dq0.clone(), dk0.clone(), dv0.clone()
        fa.backward_step(do, q, k, v, lse, delta, dq, dk, dv, mode, scale)
        gq, gk, gv = torch.zeros_like(q64), torch.zeros_like(k64), torch.zeros_like(v64)
        ref.backward_step(do64, q64, k64, v64, lse64, ref.backward_preprocess(out64, do64), gq, gk, gv, mode, scale)
        rows, keys, _ = ref.parts(mode, sq, sk)
        assert torch.equal(dq[:, :, : rows.start], dq0[:, :, : rows.start]), f"{what}: dq rows outside touched"
        assert torch.equal(dk[:, :, keys.stop:], dk0[:, :, keys.stop:]), f"{what}: dk keys outside touched"
        assert torch.equal(dv[:, :, keys.stop:], dv0[:, :, keys.stop:]), f"{what}: dv keys outside touched"
        for name, got, base, g in (("dq", dq, dq0, gq), ("dk", dk, dk0, gk), ("dv", dv, dv0, gv)):
            _close(got.double() - base.double(), g, TOL[dtype]["grad"], f"{what}: {name}")


# ------------------------------------------------------------------------------------------------ ring
def _shard(x, n, r):
    return sharding.shard(x, 2, n, 1, r, 0)


def _unshard(parts, n):
    return sharding.unshard(parts, 2, n, 1)


def _full_reference(q, k, v, do, causal, scale):
    """out, lse (and with dout: dq, dk, dv) of one attention over the whole sequence in fp64 (autograd via SDPA)."""
    g = q.shape[1] // k.shape[1]
    q64, k64, v64 = (x.double().requires_grad_() for x in (q, k, v))
    ke, ve = k64.repeat_interleave(g, 1), v64.repeat_interleave(g, 1)
    out = F.scaled_dot_product_attention(q64, ke, ve, is_causal=causal, scale=scale)
    s = (q64 @ ke.transpose(-1, -2) * scale).detach()
    if causal:
        n = s.shape[-1]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=DEV).triu(1), float("-inf"))
    res = {"out": out.detach(), "lse": torch.logsumexp(s, -1)}
    if do is not None:
        out.backward(do.double())
        res.update(dq=q64.grad, dk=k64.grad, dv=v64.grad)
    return res


@DTYPES
@HEAD_DIMS
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("N", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("chunk", [37, 150])
def test_ring_steps_equal_full_attention(fa, dtype, d, causal, N, chunk):
    """Every rank's N zigzag steps (own kernels, fp32 state, one rounding) == one attention on the whole sequence.
    chunk = S / 2N tokens: 37 (odd, under one tile), 150 (several tiles, ragged)."""
    b, h, hkv = 1, 8, 2
    S, scale = 2 * N * chunk, d ** -0.5
    q = _randn(b, h, S, d, dtype=dtype, seed=41)
    k, v = _randn(b, hkv, S, d, dtype=dtype, seed=42), _randn(b, hkv, S, d, dtype=dtype, seed=43)
    do = _randn(b, h, S, d, dtype=dtype, seed=44)
    got = simulate_ring(q, k, v, do, N, causal=causal, scale=scale, kern=_poisoned(fa))
    want = _full_reference(q, k, v, do, causal, scale)
    what = f"N={N} {'causal' if causal else 'full'} {dtype} d={d} S={S}"
    _close(got["out"], want["out"], TOL[dtype]["out"], f"{what}: out")
    _lse_close(got["lse"], want["lse"], f"{what}: lse")
    for name in ("dq", "dk", "dv"):
        _close(got[name], want[name], TOL[dtype]["grad"], f"{what}: {name}")


def test_ring_error_does_not_grow_with_ring_size(fa):
    """fp32 running state across steps: the fp32 output's max error at N = 8 is no worse than at N = 1 (50% slack:
    other tile groupings round other P values); the unfused per-step path rounds every block (benchmarks show it)."""
    b, h, hkv, d, S = 1, 8, 2, 128, 4096
    scale = d ** -0.5
    q = _randn(b, h, S, d, dtype=BF16, seed=51)
    k, v = _randn(b, hkv, S, d, dtype=BF16, seed=52), _randn(b, hkv, S, d, dtype=BF16, seed=53)
    want = _full_reference(q, k, v, None, True, scale)["out"]
    errs = {}
    for N in (1, 8):
        shards = [[_shard(x, N, r) for x in (q, k, v)] for r in range(N)]
        outs = []
        for r in range(N):
            st = fa.new_state(shards[r][0])
            for src, mode in ops.ring_schedule(r, N, True):
                fa.forward_step(shards[r][0], shards[src][1], shards[src][2], st, mode, scale)
            outs.append(fa.finalize(st, torch.float32)[0])
        got = _unshard(outs, N)
        errs[N] = (got.double() - want).abs().max().item()
    assert errs[8] <= 1.5 * errs[1] + 1e-6, errs


# ------------------------------------------------------------------------------------------------ merge
@pytest.mark.parametrize("out_dtype", [torch.float32, BF16, FP16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("d", [40, 64, 96, 128])
def test_merge_kernel_vs_torch(fa, out_dtype, d):
    b, h, s = 2, 3, 129
    acc_full = _randn(b, h, 2 * s, d, seed=61)
    acc = acc_full[:, :, s:]  # a strided view, as the ring's second half
    acc_lse, lse = _randn(b, h, s, seed=62) * 3, _randn(b, h, s, seed=63) * 3
    out = _randn(b, h, s, d, dtype=out_dtype, seed=64)
    acc_lse[0, 0, :5] = float("-inf")
    lse[0, 0, 3:8] = float("-inf")  # rows 3, 4 empty on both sides; 0-2 block only; 5-7 accumulator only
    want_acc = acc.clone()
    want_lse = ref.merge_(want_acc, acc_lse.clone(), out, lse)
    first_half = acc_full[:, :, :s].clone()
    acc_lse_in = acc_lse.clone()
    new_lse = fa.merge_(acc, acc_lse, out, lse, new_lse=_nan(b, h, s))
    torch.cuda.synchronize()
    assert torch.equal(acc_full[:, :, :s], first_half), "merge wrote outside its view"
    assert torch.equal(acc_lse, acc_lse_in), "acc_lse must be left as it was"
    torch.testing.assert_close(acc, want_acc, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(new_lse, want_lse, rtol=1e-6, atol=1e-6)
    assert torch.equal(acc[0, 0, 3:5], torch.zeros_like(acc[0, 0, 3:5])), "empty rows must merge to 0"
    # kernels.merge dispatches to it for CUDA fp32 accumulators once the extension is loaded
    acc2 = _randn(b, h, s, d, seed=61)
    want2 = acc2.clone()
    want2_lse = ref.merge_(want2, acc_lse, out, lse)
    got2, got2_lse = kernels.merge(acc2, acc_lse, out, lse)
    assert got2 is acc2
    torch.testing.assert_close(got2, want2, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got2_lse, want2_lse, rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------------------------------------------ the Backend
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128, 96])  # 96: no fused kernel, the backend falls back to torch's kernels
@pytest.mark.parametrize("sq,sk", [(100, 100), (64, 200), (1, 65)])
def test_fused_backend_block_calls(fa, causal, d, sq, sk):
    if d == 96 and causal and sq != sk:
        pytest.skip("torch's flash and efficient kernels align a non-square causal block differently (allgather.py)")
    dtype, scale = BF16, d ** -0.5
    be = kernels.select_backend(DEV, dtype, name="cuda_fused")
    assert be.name == "cuda_fused"
    q, _, _, k, v, do = _two_block_inputs(2, 8, 2, sq, sk, d, dtype, seed=70)
    out, lse = kernels.block_forward(q, k, v, causal=causal, scale=scale, backend=be)
    o64, l64 = kernels._math_forward(q.double(), k.double(), v.double(), causal, scale)
    _close(out, o64, TOL[dtype]["out"], "block_forward out")
    _lse_close(lse, l64, "block_forward lse")
    if d in (64, 128):
        assert out.dtype == torch.float32, "the fused backend hands the merge an unrounded block"
    g = kernels.block_backward(do, q, k, v, out.to(dtype), lse, causal=causal, scale=scale, backend=be)
    want = kernels._math_backward(do.double(), q.double(), k.double(), v.double(), o64, l64, causal, scale)
    for name, got, w in zip(("dq", "dk", "dv"), g, want):
        _close(got, w, TOL[dtype]["grad"], f"block_backward {name}")


def test_fused_backend_is_opt_in(fa):
    """Until verified on a GPU the fused kernels run only when named; fp32 and masks never reach them."""
    assert kernels.select_backend(DEV, BF16).name != "cuda_fused"
    assert kernels.select_backend(DEV, BF16, name="cuda_fused").name == "cuda_fused"
    with pytest.raises(ValueError, match="cuda_fused"):
        kernels.select_backend(DEV, torch.float32, name="cuda_fused")
    assert kernels.select_backend(DEV, BF16, has_mask=True).name == "math"


@pytest.mark.parametrize("R", [2, 4])
def test_ring_forward_step_through_backend(fa, R):
    """ring.forward_step (the real ring's step: sliced views, merges into out[:, :, half:]) with the fused backend
    and the fused merge equals the in-place step kernels and the fp64 attention."""
    b, h, hkv, d, chunk, dtype = 1, 8, 2, 64, 70, BF16
    S, scale = 2 * R * chunk, d ** -0.5
    be = kernels.select_backend(DEV, dtype, name="cuda_fused")
    q = _randn(b, h, S, d, dtype=dtype, seed=81)
    k, v = _randn(b, hkv, S, d, dtype=dtype, seed=82), _randn(b, hkv, S, d, dtype=dtype, seed=83)
    want = _full_reference(q, k, v, None, True, scale)
    shards = [[_shard(x, R, r) for x in (q, k, v)] for r in range(R)]
    outs = []
    for r in range(R):
        out = lse = None
        for src, _ in ops.ring_schedule(r, R, True):
            out, lse = ring.forward_step(shards[r][0], shards[src][1], shards[src][2], src, r, out, lse, causal=True,
                                         scale=scale, backend=be)
        outs.append(out)
    _close(_unshard(outs, R), want["out"], TOL[dtype]["out"], "ring.forward_step with cuda_fused")


# ------------------------------------------------------------------------------------------------ layouts, errors
def test_strided_views_are_read_in_place(fa):
    """q as a transposed [b, s, h, d] tensor and k/v as halves of a packed [2, b, h_kv, s, d] buffer: same result
    as contiguous copies, bitwise (the forward is deterministic)."""
    b, s, h, hkv, d, scale = 2, 96, 8, 2, 128, 0.1
    q_bshd = _randn(b, s, h, d, dtype=BF16, seed=91)
    q = q_bshd.transpose(1, 2)
    kv = torch.stack([_randn(b, hkv, s, d, dtype=BF16, seed=92), _randn(b, hkv, s, d, dtype=BF16, seed=93)])
    k_half, v_half = kv[0][:, :, : s // 2], kv[1][:, :, : s // 2]
    st1, st2 = fa.new_state(q), fa.new_state(q)
    fa.forward_step(q, k_half, v_half, st1, Mode.FULL, scale)
    fa.forward_step(q.contiguous(), k_half.contiguous(), v_half.contiguous(), st2, Mode.FULL, scale)
    for a, c in zip(st1, st2):
        assert torch.equal(a, c)
    # a misaligned operand (2-byte offset) is copied by the wrapper, still right
    big = _randn(b, h, s, d + 1, dtype=BF16, seed=94)
    q_odd = big[..., 1:]
    st3 = fa.new_state(q_odd)
    fa.forward_step(q_odd, k_half, v_half, st3, Mode.FULL, scale)
    st4 = fa.new_state(q_odd)
    fa.forward_step(q_odd.contiguous(), k_half, v_half, st4, Mode.FULL, scale)
    assert torch.equal(st3.acc, st4.acc)


def test_bad_arguments_fail_clearly(fa):
    q = _randn(1, 4, 16, 64, dtype=BF16, seed=1)
    k = _randn(1, 2, 16, 64, dtype=BF16, seed=2)
    st = fa.new_state(q)
    with pytest.raises(RuntimeError, match="float16 or bfloat16"):
        fa.forward_step(q.float(), k.float(), k.float(), st, Mode.FULL, 1.0)
    with pytest.raises(RuntimeError, match="no fused kernel"):
        q96, k96 = _randn(1, 4, 16, 96, dtype=BF16, seed=3), _randn(1, 2, 16, 96, dtype=BF16, seed=4)
        fa.forward_step(q96, k96, k96, fa.new_state(q96), Mode.FULL, 1.0)
    with pytest.raises(RuntimeError, match="multiple of kv heads"):
        k3 = _randn(1, 3, 16, 64, dtype=BF16, seed=5)
        fa.forward_step(q, k3, k3, st, Mode.FULL, 1.0)
    with pytest.raises(ValueError, match="float32"):
        fa.forward_step(q, k, k, fa.State(st.acc.double(), st.m, st.l), Mode.FULL, 1.0)
    with pytest.raises(RuntimeError, match="mode"):
        fa.forward_step(q, k, k, st, 7, 1.0)
    assert not fa.supports(q.cpu(), k.cpu()) and not fa.supports(q.float(), k.float())
    assert math.isfinite(st.acc.sum().item())  # nothing above launched a kernel on bad input
