"""CPU checks of the pure-Python side of the fused ring kernels (msparallel_ds.ops), no GPU needed.

- modes: the mask mode chosen per zigzag step matches what ring.forward_step computes (same numbers, fp64);
- reference: the kernels' contract in torch (running state in log2 units, finalize, backward with the final lse,
  rows that see no key, untouched rows of the half modes) against plain attention in fp64;
- ring_steps: N zigzag ring steps run one after another equal one full attention, forward and backward (fp64);
- the package imports and fails cleanly without CUDA, and the CPU block backends are unchanged.
The CUDA kernels themselves are held to the same reference by tests/test_ops_gpu.py.
"""
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from msparallel_ds import ops
from msparallel_ds.context_parallel import kernels, ring
from msparallel_ds.ops import reference as ref
from msparallel_ds.ops.modes import Mode, ring_schedule, step_mode
from msparallel_ds.ops.ring_steps import simulate_ring

DT = torch.float64
TOL = {"rtol": 1e-10, "atol": 1e-10}


def _rand(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=DT)


def _full_attention(q, k, v, dout, causal, scale):
    """out, lse, dq, dk, dv of plain attention on the whole sequence (fp64 autograd; kv repeated for GQA)."""
    g = q.shape[1] // k.shape[1]
    qq, kk, vv = (x.detach().clone().requires_grad_() for x in (q, k, v))
    ke, ve = kk.repeat_interleave(g, 1), vv.repeat_interleave(g, 1)
    out = F.scaled_dot_product_attention(qq, ke, ve, is_causal=causal, scale=scale)
    s = qq @ ke.transpose(-1, -2) * scale
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    lse = torch.logsumexp(s, -1)
    out.backward(dout)
    return out.detach(), lse.detach(), qq.grad, kk.grad, vv.grad


def test_ring_schedule_and_modes():
    assert ring_schedule(1, 4, True) == [(1, Mode.CAUSAL), (0, Mode.KV_FIRST_HALF), (3, Mode.Q_SECOND_HALF),
                                         (2, Mode.Q_SECOND_HALF)]
    assert ring_schedule(0, 1, True) == [(0, Mode.CAUSAL)]
    assert all(m == Mode.FULL for _, m in ring_schedule(2, 3, False))
    assert [int(m) for m in Mode] == [0, 1, 2, 3]  # msp_ops::Mode in ops/ring_attn.h
    with pytest.raises(ValueError, match="outside a ring"):
        ring_schedule(4, 4, True)
    # every rank: one diagonal and R-1 half blocks; every (rank, src) pair appears once
    for R in (2, 3, 5):
        pairs = [(r, src) for r in range(R) for src, _ in ring_schedule(r, R, True)]
        assert sorted(pairs) == [(r, s) for r in range(R) for s in range(R)]
        for r in range(R):
            modes = [m for _, m in ring_schedule(r, R, True)]
            assert modes.count(Mode.CAUSAL) == 1 and len(modes) == R


@pytest.mark.parametrize("R", [2, 3, 4])
def test_mode_matches_ring_forward_step(R):
    """For every (rank, src): the diagonal, then src's block with step_mode, through the reference kernels equals
    ring.forward_step (which slices the blocks itself) with the math backend."""
    b, h, hkv, half, d = 1, 4, 2, 3, 8
    s, scale = 2 * half, d ** -0.5
    math_be = kernels.BACKENDS["math"]
    for rank in range(R):
        q = _rand(b, h, s, d, seed=rank)
        kv = {src: (_rand(b, hkv, s, d, seed=100 + src), _rand(b, hkv, s, d, seed=200 + src)) for src in range(R)}
        for src in range(R):
            if src == rank:
                continue
            out, lse = ring.forward_step(q, *kv[rank], rank, rank, None, None, causal=True, scale=scale,
                                         backend=math_be)
            out, lse = ring.forward_step(q, *kv[src], src, rank, out, lse, causal=True, scale=scale, backend=math_be)
            st = ref.new_state(q)
            ref.forward_step(q, *kv[rank], st, step_mode(rank, rank, True), scale)
            ref.forward_step(q, *kv[src], st, step_mode(src, rank, True), scale)
            o, l = ref.finalize(st, DT)
            torch.testing.assert_close(o, out, **TOL)
            torch.testing.assert_close(l, lse, **TOL)


def test_reference_state_and_single_block():
    """One FULL / CAUSAL step from the empty state: m = row max in log2 units, lse natural, out = softmax(s) v."""
    b, h, hkv, sq, sk, d = 2, 4, 1, 5, 7, 8
    scale = 0.3
    q, k, v = _rand(b, h, sq, d, seed=1), _rand(b, hkv, sk, d, seed=2), _rand(b, hkv, sk, d, seed=3)
    for mode, causal in ((Mode.FULL, False), (Mode.CAUSAL, True)):
        st = ref.new_state(q)
        ref.forward_step(q, k, v, st, mode, scale)
        out, lse = ref.finalize(st, DT)
        ke, ve = k.repeat_interleave(h // hkv, 1), v.repeat_interleave(h // hkv, 1)
        s = q @ ke.transpose(-1, -2) * scale
        if causal:  # bottom-right aligned, like kernels._scores
            s = s.masked_fill(~torch.ones(sq, sk, dtype=torch.bool).tril(sk - sq), float("-inf"))
        torch.testing.assert_close(st.m, s.amax(-1) * ref.LOG2E, **TOL)
        torch.testing.assert_close(lse, torch.logsumexp(s, -1), **TOL)
        torch.testing.assert_close(out, torch.softmax(s, -1) @ ve, **TOL)


def test_reference_rows_without_keys():
    """Causal with s_q > s_k: the first rows see no key: out 0, lse -inf, zero gradients, no NaN anywhere."""
    b, h, sq, sk, d = 1, 2, 6, 3, 4
    q, k, v, do = _rand(b, h, sq, d, seed=4), _rand(b, h, sk, d, seed=5), _rand(b, h, sk, d, seed=6), \
        _rand(b, h, sq, d, seed=7)
    st = ref.new_state(q)
    ref.forward_step(q, k, v, st, Mode.CAUSAL, 0.5)
    out, lse = ref.finalize(st, DT)
    blind = sq - sk  # rows 0..2 see nothing (key j visible iff j <= i - 3)
    assert torch.equal(out[:, :, :blind], torch.zeros_like(out[:, :, :blind]))
    assert torch.isneginf(lse[:, :, :blind]).all() and torch.isfinite(lse[:, :, blind:]).all()
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    ref.backward_step(do, q, k, v, lse, ref.backward_preprocess(out, do), dq, dk, dv, Mode.CAUSAL, 0.5)
    assert all(torch.isfinite(t).all() for t in (dq, dk, dv))
    assert torch.equal(dq[:, :, :blind], torch.zeros_like(dq[:, :, :blind]))
    g = kernels._math_backward(do, q, k, v, out, lse, True, 0.5)
    for got, want in zip((dq, dk, dv), g):
        torch.testing.assert_close(got, want, **TOL)


def test_reference_half_modes_touch_only_their_part():
    b, h, s, d = 1, 2, 6, 4
    q, k, v, do = (_rand(b, h, s, d, seed=i) for i in range(4))
    st = ref.new_state(q)
    ref.forward_step(q, k, v, st, Mode.CAUSAL, 0.5)
    before = [t.clone() for t in st]
    ref.forward_step(q, k, v, st, Mode.Q_SECOND_HALF, 0.5)
    for t0, t1 in zip(before, st):
        assert torch.equal(t0[:, :, : s // 2], t1[:, :, : s // 2])
        assert not torch.equal(t0[:, :, s // 2:], t1[:, :, s // 2:])
    out, lse = ref.finalize(st, DT)
    delta = ref.backward_preprocess(out, do)
    dq, dk, dv = _rand(b, h, s, d, seed=10), _rand(b, h, s, d, seed=11), _rand(b, h, s, d, seed=12)
    dq0, dk0, dv0 = dq.clone(), dk.clone(), dv.clone()
    ref.backward_step(do, q, k, v, lse, delta, dq, dk, dv, Mode.KV_FIRST_HALF, 0.5)
    assert torch.equal(dk[:, :, s // 2:], dk0[:, :, s // 2:]) and torch.equal(dv[:, :, s // 2:], dv0[:, :, s // 2:])
    dq0 = dq.clone()
    ref.backward_step(do, q, k, v, lse, delta, dq, dk, dv, Mode.Q_SECOND_HALF, 0.5)
    assert torch.equal(dq[:, :, : s // 2], dq0[:, :, : s // 2])
    with pytest.raises(ValueError, match="even"):
        ref.forward_step(q[:, :, :5], k[:, :, :5], v[:, :, :5], ref.new_state(q[:, :, :5]), Mode.Q_SECOND_HALF, 1.0)


@pytest.mark.parametrize("R", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("h,hkv", [(2, 2), (4, 1), (8, 2)])
def test_simulated_ring_equals_full_attention(R, causal, h, hkv):
    """All ranks' zigzag steps through the reference kernels == one attention over the whole sequence (odd chunk)."""
    b, chunk, d = 1, 3, 8
    S, scale = 2 * R * chunk, d ** -0.5
    q, k, v, do = _rand(b, h, S, d, seed=1), _rand(b, hkv, S, d, seed=2), _rand(b, hkv, S, d, seed=3), \
        _rand(b, h, S, d, seed=4)
    got = simulate_ring(q, k, v, do, R, causal=causal, scale=scale, kern=ref)
    want = dict(zip(("out", "lse", "dq", "dk", "dv"), _full_attention(q, k, v, do, causal, scale)))
    for name, w in want.items():
        torch.testing.assert_close(got[name], w, **TOL, msg=lambda m, n=name: f"{n}: {m}")


def test_reference_merge_matches_kernels_merge():
    b, h, s, d = 2, 3, 5, 6
    acc, out = _rand(b, h, s, d, seed=1).float(), _rand(b, h, s, d, seed=2).bfloat16()
    la, lb = _rand(b, h, s, seed=3).float(), _rand(b, h, s, seed=4).float()
    la[0, 0, 0] = lb[0, 0, 0] = float("-inf")  # both empty
    la[0, 0, 1] = float("-inf")  # only the block
    lb[0, 1, 2] = float("-inf")  # only the accumulator
    a1, l1 = kernels.merge(acc.clone(), la.clone(), out, lb)
    a2 = acc.clone()
    l2 = ref.merge_(a2, la.clone(), out, lb)
    torch.testing.assert_close(a2, a1, rtol=0, atol=0)
    torch.testing.assert_close(l2, l1, rtol=0, atol=0)
    assert torch.isfinite(a2).all() and a2[0, 0, 0].abs().max() == 0


def test_package_is_cpu_safe():
    """Importing needs no CUDA; asking for the kernels without CUDA fails with a reason, never a crash."""
    assert ops.source_dir().joinpath("ring_attn_fwd.cu").is_file()
    if torch.cuda.is_available():
        pytest.skip("CUDA present: the CPU-only behaviour is not observable here")
    assert ops.unavailable_reason() is not None
    assert not ops.available() and ops.loaded() is None
    with pytest.raises(ops.OpsUnavailable, match="CUDA"):
        ops.load()
    cli = subprocess.run([sys.executable, "-m", "msparallel_ds.ops", "build"], capture_output=True, text=True,
                         timeout=120, check=False)
    assert cli.returncode == 1 and "CUDA" in cli.stderr, cli.stderr
    info = subprocess.run([sys.executable, "-m", "msparallel_ds.ops", "info"], capture_output=True, text=True,
                          timeout=120, check=False)
    assert info.returncode == 0 and "runnable here: no" in info.stdout, info.stdout + info.stderr


def test_cpu_backend_selection_unchanged():
    cpu = torch.device("cpu")
    for dt in (torch.float32, torch.bfloat16, torch.float64):
        assert kernels.select_backend(cpu, dt).name == "cpu_flash"
    assert kernels.select_backend(cpu, torch.float32, has_mask=True).name == "math"
    assert not kernels.BACKENDS["cuda_fused"].supports(cpu, torch.bfloat16, False)
    with pytest.raises(ValueError, match="cuda_fused"):
        kernels.select_backend(cpu, torch.bfloat16, name="cuda_fused")
    # the CPU merge path is the torch code (the fused merge is only consulted for CUDA tensors)
    a, lse = kernels.merge(None, None, torch.ones(1, 1, 2, 4), torch.zeros(1, 1, 2))
    a, lse = kernels.merge(a, lse, torch.ones(1, 1, 2, 4), torch.zeros(1, 1, 2))
    torch.testing.assert_close(lse, torch.full((1, 1, 2), 2.0).log())
    torch.testing.assert_close(a, torch.ones(1, 1, 2, 4))
