"""Context-parallel attention with a value head dim different from the query/key one (DeepSeek MLA: d_qk 24, d_v 16).

Every algorithm runs through context_parallel_attention on 4 gloo processes (one set of processes for all cases) and
is compared with plain softmax attention in fp64 on the unsharded tensors (out, dq, dk, dv). The block kernels are
checked in one process: math takes the two head dims as they are, cpu_flash (like every fused/CUDA backend) gets
them zero-padded to one head dim by kernels.block_forward / block_backward.
"""
from types import SimpleNamespace

import pytest
import torch

from harness import run_distributed, worst_over_ranks

B, S, H, D_QK, D_V = 2, 32, 4, 24, 16
TOL = {torch.float64: 1e-10, torch.float32: 1e-5}
DIMS = ("pp", "dp", "cp_ring", "cp_ulysses", "tp")


def _attention(q, k, v, causal, scale):
    """Plain softmax attention, [b, h, s, d] layout, kv heads repeated for GQA."""
    rep = q.shape[1] // k.shape[1]
    s = q @ k.repeat_interleave(rep, 1).transpose(-1, -2) * scale
    if causal:
        s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool).tril(), float("-inf"))
    return torch.softmax(s, -1) @ v.repeat_interleave(rep, 1)


def _reference(q, k, v, dout, causal, scale):
    """(out, dq, dk, dv) in fp64 through autograd; every tensor in the layout it came in."""
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    out = _attention(*leaves, causal, scale)
    out.backward(dout.double())
    return out.detach(), *(t.grad for t in leaves)


def _full(h_kv, dtype, seed):
    """q, k [b, s, h(_kv), 24], v [b, s, h_kv, 16], dout [b, s, h, 16] (HF/flash layout)."""
    g = torch.Generator().manual_seed(seed)
    shapes = ((H, D_QK), (h_kv, D_QK), (h_kv, D_V), (H, D_V))
    return [torch.randn(B, S, n, d, generator=g, dtype=torch.float64).to(dtype) for n, d in shapes]


def _layout(ring, uly):
    from msparallel_ds.distributed import init_parallel

    return init_parallel(SimpleNamespace(world_size=ring * uly, mesh=dict(zip(DIMS, (1, 1, ring, uly, 1)))))


def _case(lay, algo, h_kv, causal, dtype, seed):
    """Max abs errors (out, dq, dk, dv) of this rank's shard against the fp64 reference."""
    from msparallel_ds.context_parallel.api import context_parallel_attention, shard_sequence

    full = _full(h_kv, dtype, seed)
    ref = _reference(*(t.transpose(1, 2) for t in full), causal, D_QK ** -0.5)
    ref = [t.transpose(1, 2) for t in ref]
    q, k, v, dout = (shard_sequence(t, lay, dim=1, algo=algo) for t in full)
    leaves = [t.requires_grad_() for t in (q, k, v)]
    out = context_parallel_attention(*leaves, lay, causal=causal, algo=algo)  # default scale: 1/sqrt(d_qk)
    assert out.shape == (B, q.shape[1], H, D_V) and out.dtype == dtype
    out.backward(dout)
    got = (out.detach(), *(t.grad for t in leaves))
    assert [t.shape[-1] for t in got] == [D_V, D_QK, D_QK, D_V]
    return [(a.double() - shard_sequence(r, lay, dim=1, algo=algo)).abs().max().item() for a, r in zip(got, ref)]


def _mla_cases(rank, world_size):
    cases = [("allgather", (4, 1), 2, True, torch.float64), ("allgather", (4, 1), 2, False, torch.float64),
             ("ring", (4, 1), 2, True, torch.float64), ("ring", (4, 1), 4, True, torch.float32),
             ("ulysses", (1, 4), 4, True, torch.float64), ("ulysses", (1, 4), 2, True, torch.float64),
             ("hybrid", (2, 2), 2, True, torch.float64)]
    layouts = {mesh: _layout(*mesh) for mesh in {c[1] for c in cases}}
    errors = {case: _case(layouts[case[1]], case[0], *case[2:], seed=i) for i, case in enumerate(cases)}

    from msparallel_ds.context_parallel.api import context_parallel_attention, shard_sequence
    from msparallel_ds.integrations.hf_attention import make_cp_attention

    lay = layouts[(4, 1)]
    full = _full(2, torch.float64, 0)
    q, k, v, _ = (shard_sequence(t, lay, dim=1, algo="ring") for t in full)
    # the HF backend as DeepseekV3Attention calls it: [b, h, s, d] views, v with its own head dim, scaling given
    module = SimpleNamespace(is_causal=True, training=False)
    out, _ = make_cp_attention(lay, algo="ring")(module, *(t.transpose(1, 2) for t in (q, k, v)), None, scaling=0.2)
    ref = _reference(*(t.transpose(1, 2) for t in full[:3]), full[3].transpose(1, 2), True, 0.2)[0].transpose(1, 2)
    errors["hf backend"] = [(out - shard_sequence(ref, lay, dim=1, algo="ring")).abs().max().item()]
    # cp peers called with different value head dims: one clear error on every rank, not a hang
    with pytest.raises(ValueError, match=r"cp rank 3 \(global rank 3\) has v_head_dim=8 where cp rank 0 has 16"):
        context_parallel_attention(q, k, v[..., :8] if rank == 3 else v, lay, algo="ring")
    return errors


@pytest.mark.distributed
def test_all_algorithms_with_a_smaller_value_head_dim():
    worst = worst_over_ranks(run_distributed(_mla_cases, 4, timeout=120))
    hf = worst.pop("hf backend")[0]
    print(f"HF backend (ring, [b, h, s, d] views, scaling=0.2): max abs err out = {hf:.2e}")
    for case, e in worst.items():
        print(f"{case[0]:9s} cp {case[1]} h_kv={case[2]} causal={case[3]!s:5s} {str(case[4])[6:]}: max abs err "
              "out/dq/dk/dv = " + " / ".join(f"{x:.2e}" for x in e))
    bad = {c: e for c, e in worst.items() if max(e) > TOL[c[4]]}
    assert len(worst) == 7 and not bad and hf < 1e-10, (bad, hf)


@pytest.mark.parametrize("backend", ["math", "cpu_flash"])
@pytest.mark.parametrize("d_qk, d_v", [(24, 16), (16, 24)])
@pytest.mark.parametrize("causal", [True, False])
def test_block_kernels_with_their_own_value_head_dim(backend, d_qk, d_v, causal):
    from msparallel_ds.context_parallel import kernels

    g = torch.Generator().manual_seed(d_qk + 2 * causal)
    q, k, v, dout = (torch.randn(2, n, 12, d, generator=g, dtype=torch.float64)
                     for n, d in ((4, d_qk), (2, d_qk), (2, d_v), (4, d_v)))
    scale = d_qk ** -0.5
    be = kernels.BACKENDS[backend]
    assert be.same_head_dim == (backend != "math")  # cpu_flash, cuda_* and cuda_fused: padded to one head dim
    out, lse = kernels.block_forward(q, k, v, causal=causal, scale=scale, backend=be)
    grads = kernels.block_backward(dout, q, k, v, out, lse, causal=causal, scale=scale, backend=be)
    ref = _reference(q, k, v, dout, causal, scale)
    assert out.shape == ref[0].shape and [t.shape for t in grads] == [t.shape for t in ref[1:]]
    errs = [(a - r).abs().max().item() for a, r in zip((out, *grads), ref)]
    assert max(errs) < 1e-12, errs


def test_padding_is_exact_and_keeps_unpadded_shapes():
    """The helper the fused/CUDA backends rely on: zero columns leave the scores, out and grads unchanged."""
    from msparallel_ds.context_parallel import kernels

    v = torch.randn(1, 2, 4, 3)
    padded = kernels.pad_head_dim(v, 5)
    assert padded.shape == (1, 2, 4, 5) and torch.equal(padded[..., :3], v) and not padded[..., 3:].any()
    assert kernels.pad_head_dim(v, 3) is v

    seen = []

    def strict_forward(q, k, v, causal, scale, mask=None):  # stands in for an op that needs one head dim
        seen.append((q.shape[-1], k.shape[-1], v.shape[-1]))
        return kernels._math_forward(q, k, v, causal, scale)

    def strict_backward(dout, q, k, v, out, lse, causal, scale, mask=None):
        seen.append((dout.shape[-1], q.shape[-1], k.shape[-1], v.shape[-1], out.shape[-1]))
        return kernels._math_backward(dout, q, k, v, out, lse, causal, scale)

    strict = kernels.Backend("strict", strict_forward, strict_backward, lambda dev, dt, m: True)
    q, k = torch.randn(1, 2, 6, 8, dtype=torch.float64), torch.randn(1, 1, 6, 8, dtype=torch.float64)
    v, dout = torch.randn(1, 1, 6, 3, dtype=torch.float64), torch.randn(1, 2, 6, 3, dtype=torch.float64)
    out, lse = kernels.block_forward(q, k, v, causal=True, scale=0.3, backend=strict)
    grads = kernels.block_backward(dout, q, k, v, out, lse, causal=True, scale=0.3, backend=strict)
    assert seen == [(8, 8, 8), (8, 8, 8, 8, 8)]
    assert out.is_contiguous() and out.shape == (1, 2, 6, 3)
    ref = _reference(q, k, v, dout, True, 0.3)
    assert max((a - r).abs().max().item() for a, r in zip((out, *grads), ref)) < 1e-12


class _Layout:
    """Enough of a ParallelLayout for checks that fail before any collective."""

    def size(self, name):
        return {"cp_ring": 2, "cp_ulysses": 1, "cp": 2}[name]

    def rank(self, name):
        return 0

    def group(self, name):
        raise AssertionError("no collective expected")


def _qkv(v_shape, k_dim=D_QK):
    return torch.randn(B, 8, H, D_QK), torch.randn(B, 8, 2, k_dim), torch.randn(*v_shape)


@pytest.mark.parametrize("qkv, match", [
    (_qkv((B, 8, 1, D_V)), r"k and v must have the same shape \[batch, s_local, kv_heads\]"),
    (_qkv((B, 4, 2, D_V)), r"k and v must have the same shape .*got \(2, 8, 2, 24\) and \(2, 4, 2, 16\)"),
    (_qkv((1, 8, 2, D_V)), r"k and v must have the same shape"),
    (_qkv((B, 8, 2, D_V), k_dim=D_V), r"head_dim differs: q has 24, k/v have 16"),
    (_qkv((B, 8, 2, D_QK), k_dim=D_V), r"head_dim differs: q has 24, k has 16 \(k must have q's head_dim"),
    (_qkv((B, 8, 2, 0)), r"empty input: .*v shape \(2, 8, 2, 0\)"),
])
def test_value_shape_errors(qkv, match):
    from msparallel_ds.context_parallel.api import context_parallel_attention

    with pytest.raises(ValueError, match=match):
        context_parallel_attention(*qkv, _Layout())
