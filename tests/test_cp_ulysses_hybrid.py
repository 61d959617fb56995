"""Ulysses and hybrid (Ulysses inside ring) attention on 2 and 4 gloo processes against single-process SDPA.

Every rank builds the same full q/k/v/dout from a fixed seed, takes its shard (sharding.py, the layout each
algorithm expects), runs forward + backward and compares output and dq/dk/dv with the unsharded reference's
rows at the same positions. All cases of one world size share one set of processes (spawning is the slow part).
"""
from types import SimpleNamespace

import pytest

from harness import run_distributed, worst_over_ranks

TOL = 1e-4
B, H, D = 2, 8, 16
DIMS = ("pp", "dp", "cp_ring", "cp_ulysses", "tp")


def _layout(mesh):
    from msparallel_ds.distributed import init_parallel

    return init_parallel(SimpleNamespace(world_size=mesh[0] * mesh[1] * mesh[2] * mesh[3] * mesh[4],
                                         mesh=dict(zip(DIMS, mesh))))


def _reference(s, h_kv, causal, seed):
    """Full tensors [b, h, s, d] and SDPA's out/grads on the whole sequence (kv repeated for GQA)."""
    import torch
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, n, s, D, generator=g) for n in (H, h_kv, h_kv))
    dout = torch.randn(B, H, s, D, generator=g)
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    rep = H // h_kv
    out = F.scaled_dot_product_attention(qr, kr.repeat_interleave(rep, 1), vr.repeat_interleave(rep, 1),
                                         is_causal=causal)
    out.backward(dout)
    return (q, k, v, dout), (out.detach(), qr.grad, kr.grad, vr.grad)


def _parity(fn, ring, uly, ring_rank, uly_rank, s, h_kv, causal, seed=0):
    """Max abs errors (out, dq, dk, dv) of fn(q, k, v) on this rank's shard vs the full reference."""
    import torch

    from msparallel_ds.context_parallel.sharding import shard

    (q, k, v, dout), ref = _reference(s, h_kv, causal, seed)
    loc = [shard(t, 2, ring, uly, ring_rank, uly_rank).requires_grad_() for t in (q, k, v)]
    out = fn(*loc, causal=causal, scale=D ** -0.5)
    out.backward(shard(dout, 2, ring, uly, ring_rank, uly_rank))
    got = (out.detach(), loc[0].grad, loc[1].grad, loc[2].grad)
    assert all(t.dtype == torch.float32 for t in got)
    return tuple((a - shard(r, 2, ring, uly, ring_rank, uly_rank)).abs().max().item() for a, r in zip(got, ref))


def _run_cases(rank, world_size, meshes, seq_len):
    """meshes: (pp, dp, cp_ring, cp_ulysses, tp) shapes; each runs Ulysses (if cp_ring == 1) and hybrid."""
    import torch
    import torch.distributed as dist

    from msparallel_ds.context_parallel.hybrid import hybrid_attention
    from msparallel_ds.context_parallel.ulysses import head_to_seq, seq_to_head, ulysses_attention

    results = {}
    for mesh in meshes:
        lay = _layout(mesh)
        R, U = lay.size("cp_ring"), lay.size("cp_ulysses")
        r, u = lay.rank("cp_ring"), lay.rank("cp_ulysses")
        grp = lay.group("cp_ulysses")

        # the all-to-all pair: inverse of each other, and seq_to_head's backward is head_to_seq
        x = torch.randn(2, H, 4, 3, generator=torch.Generator().manual_seed(rank)).requires_grad_()
        y = seq_to_head(x, grp)
        assert y.shape == (2, H // U, 4 * U, 3)
        assert torch.equal(head_to_seq(y, grp), x)
        w = torch.randn(y.shape, generator=torch.Generator().manual_seed(100 + rank))
        (y * w).sum().backward()
        assert torch.equal(x.grad, head_to_seq(w, grp))

        for h_kv in (8, 2):
            for causal in (True, False):
                if R == 1:
                    fn = lambda *t, **kw: ulysses_attention(*t, grp, **kw)  # noqa: E731
                    results[("ulysses", mesh, h_kv, causal)] = _parity(fn, 1, U, 0, u, seq_len, h_kv, causal)
                fn = lambda *t, **kw: hybrid_attention(*t, lay, **kw)  # noqa: E731
                results[("hybrid", mesh, h_kv, causal)] = _parity(fn, R, U, r, u, seq_len, h_kv, causal)
        # the (ring_group, ulysses_group) pair works like the layout
        fn = lambda *t, **kw: hybrid_attention(*t, (lay.group("cp_ring"), grp), **kw)  # noqa: E731
        results[("hybrid-groups", mesh, 2, True)] = _parity(fn, R, U, r, u, seq_len, 2, True)

        if U == 2:  # h_kv=3 cannot be split over 2 ranks nor replicated: one clear error, before any collective
            q = torch.randn(B, 6, 8, D)
            k = torch.randn(B, 3, 8, D)
            with pytest.raises(ValueError, match=r"num_kv_heads=3 and the Ulysses degree 2.*nearest: 1 or 3"):
                ulysses_attention(q, k, k, grp, causal=True, scale=0.25)
            with pytest.raises(ValueError, match=r"num_kv_heads=3 and the Ulysses degree 2"):
                hybrid_attention(q, k, k, lay, causal=True, scale=0.25)
        dist.barrier()
    return results


def _check(results_per_rank):
    worst = worst_over_ranks(results_per_rank)
    for case, errs in sorted(worst.items(), key=str):
        print(f"{case}: max abs err out/dq/dk/dv = " + " / ".join(f"{e:.2e}" for e in errs))
    bad = {c: e for c, e in worst.items() if max(e) > TOL}
    assert not bad, f"errors above {TOL}: {bad}"
    return worst


@pytest.mark.distributed
def test_ulysses_and_hybrid_2_ranks():
    # U=2 (Ulysses and hybrid 1x2) and ring-only hybrid 2x1
    meshes = [(1, 1, 1, 2, 1), (1, 1, 2, 1, 1)]
    worst = _check(run_distributed(_run_cases, 2, meshes, 32, timeout=150))
    assert len(worst) == 9 + 5  # ulysses + hybrid + pair call per U>1 mesh; hybrid + pair otherwise


@pytest.mark.distributed
def test_ulysses_and_hybrid_4_ranks():
    # U=4 (replicates h_kv=2 kv heads 2x), 2x2, 4x1, and U=2 inside dp=2 (the groups are not the world)
    meshes = [(1, 1, 1, 4, 1), (1, 1, 2, 2, 1), (1, 1, 4, 1, 1), (1, 2, 1, 2, 1)]
    worst = _check(run_distributed(_run_cases, 4, meshes, 64, timeout=170))
    assert len(worst) == 9 + 5 + 5 + 9


def test_head_rule_messages():
    from msparallel_ds.context_parallel.ulysses import check_ulysses_heads, valid_ulysses_degrees

    assert valid_ulysses_degrees(8, 2) == [1, 2, 4, 8]  # 4 and 8 replicate the 2 kv heads
    assert valid_ulysses_degrees(6, 3) == [1, 3, 6]
    check_ulysses_heads(8, 2, 4)
    with pytest.raises(ValueError, match=r"num_heads=8 is not divisible by the Ulysses degree 3.*nearest: 2 or 4"):
        check_ulysses_heads(8, 8, 3)
    with pytest.raises(ValueError, match=r"num_kv_heads=3 and the Ulysses degree 2 .*\[1, 3, 6\]; nearest: 1 or 3"):
        check_ulysses_heads(6, 3, 2)
