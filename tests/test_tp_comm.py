"""Autograd collectives (tensor_parallel/mappings.py over distributed/collectives.py) on 4 gloo processes against
single-process math.

Every rank builds every rank's input and upstream grad from fixed seeds, runs one collective forward + backward on
its own tensors, and compares the output and the input grad with what plain torch computes from all of them. Groups:
tp=4, tp=2 inside dp2 x tp2 (the sums must cover the tp group only, not the world) and tp=1 (no communication).
"""
from types import SimpleNamespace

import pytest

from harness import run_distributed, worst_over_ranks

TOL = 1e-5
DIMS = ("pp", "dp", "cp_ring", "cp_ulysses", "tp")
MESHES = {"tp4": (1, 1, 1, 1, 4), "dp2xtp2": (1, 2, 1, 1, 2)}
SHAPE = (4, 8, 12)  # every dim divisible by 2 and 4
OPS = ("copy", "reduce", "gather_seq", "reduce_scatter_seq", "scatter", "gather")


def _layout(mesh):
    from msparallel_ds.distributed import init_parallel

    return init_parallel(SimpleNamespace(world_size=4, mesh=dict(zip(DIMS, mesh))))


def _randn(shape, seed):
    import torch

    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _leaf(t, contiguous):
    """A leaf with t's values; the non-contiguous variant is a transposed view, so the collectives see strides."""
    if contiguous:
        leaf = t.clone().requires_grad_()
        return leaf, lambda: leaf.grad
    leaf = t.transpose(0, -1).contiguous().requires_grad_()
    return leaf.transpose(0, -1), lambda: leaf.grad.transpose(0, -1)


def _expected(op, X, G, ranks, me, dim):
    """(output, input grad) from plain torch: X[r] / G[r] are rank r's input / upstream grad."""
    import torch

    n, i = len(ranks), ranks.index(me)

    def total(T):
        return sum(T[r] for r in ranks)

    def cat(T):
        return torch.cat([T[r] for r in ranks], dim)

    return {
        "copy": lambda: (X[me], total(G)),
        "reduce": lambda: (total(X), G[me]),
        "gather_seq": lambda: (cat(X), total(G).chunk(n, dim)[i]),
        "reduce_scatter_seq": lambda: (total(X).chunk(n, dim)[i], cat(G)),
        "scatter": lambda: (X[me].chunk(n, dim)[i], cat(G)),  # X is replicated for scatter
        "gather": lambda: (cat(X), G[me].chunk(n, dim)[i]),
    }[op]()


def _grad_shape(op, n, dim):
    shape = list(SHAPE)
    if op in ("gather_seq", "gather"):
        shape[dim] *= n
    elif op in ("reduce_scatter_seq", "scatter"):
        shape[dim] //= n
    return tuple(shape)


def _run_op(op, x, group, dim):
    from msparallel_ds.tensor_parallel import mappings

    return {"copy": lambda: mappings.copy_to_region(x, group),
            "reduce": lambda: mappings.reduce_from_region(x, group),
            "gather_seq": lambda: mappings.gather_from_sequence_region(x, group, dim),
            "reduce_scatter_seq": lambda: mappings.reduce_scatter_to_sequence_region(x, group, dim),
            "scatter": lambda: mappings.scatter_to_region(x, group, dim),
            "gather": lambda: mappings.gather_from_region(x, group, dim)}[op]()


def _cases(rank, world_size):
    import torch
    import torch.distributed as dist

    from msparallel_ds.distributed import collectives
    from msparallel_ds.tensor_parallel import mappings

    errors = {}
    for name, mesh in MESHES.items():
        lay = _layout(mesh)
        group, ranks, n = lay.group("tp"), list(lay.ranks("tp")), lay.size("tp")
        for op in OPS:
            for dim in ((0,) if op in ("copy", "reduce") else (0, 1, -1)):
                for contiguous in (True, False):
                    seed = 1000 * OPS.index(op) + 100 * (dim % 3) + 10 * contiguous
                    X = {r: _randn(SHAPE, seed + r) for r in range(world_size)}
                    if op == "scatter":  # the input of a scatter is replicated over the group
                        X = {r: X[ranks[0]] for r in range(world_size)}
                    G = {r: _randn(_grad_shape(op, n, dim), seed + 50 + r) for r in range(world_size)}
                    x, grad_of = _leaf(X[rank], contiguous)
                    y = _run_op(op, x, group, dim)
                    y.backward(G[rank])
                    want_y, want_g = _expected(op, X, G, ranks, rank, dim)
                    assert y.shape == want_y.shape and grad_of().shape == want_g.shape, (op, dim)
                    errors[(name, op, dim, contiguous)] = ((y - want_y).abs().max().item(),
                                                           (grad_of() - want_g).abs().max().item())
                    if name == "dp2xtp2" and op in ("copy", "reduce", "reduce_scatter_seq"):
                        # a world-wide sum would differ: the group, not the world, was used
                        world_x, world_g = sum(X.values()), sum(G.values())
                        got, world = ((y, world_x) if op == "reduce" else (grad_of(), world_g) if op == "copy"
                                      else (y, world_x.chunk(n, dim)[ranks.index(rank)]))
                        assert not torch.allclose(got, world, atol=1e-2), (op, dim)

        # uneven slices: the same clear error on every rank, before any collective
        for fn in (mappings.reduce_scatter_to_sequence_region, mappings.scatter_to_region,
                   collectives.reduce_scatter_along):
            with pytest.raises(ValueError, match=rf"has size 3, which is not divisible by the group size {n}"):
                fn(torch.ones(2, 3, requires_grad=True), group, 1)

        # backends without the tensor-form collectives (old gloo) take the list / all-reduce fallbacks
        if name == "tp4":
            def unsupported(*a, **k):
                raise RuntimeError("ProcessGroupGloo does not support _allgather_base")
            saved = {k: getattr(dist, k) for k in ("all_gather_single", "all_gather_into_tensor",
                                                   "reduce_scatter_single", "reduce_scatter_tensor") if hasattr(dist, k)}
            try:
                for k in saved:
                    setattr(dist, k, unsupported)
                for op, dim in (("gather_seq", 0), ("gather_seq", 1), ("reduce_scatter_seq", 0),
                                ("reduce_scatter_seq", 1)):
                    X = {r: _randn(SHAPE, 7 + r) for r in range(world_size)}
                    G = {r: _randn(_grad_shape(op, n, dim), 70 + r) for r in range(world_size)}
                    x, grad_of = _leaf(X[rank], True)
                    y = _run_op(op, x, group, dim)
                    y.backward(G[rank])
                    want_y, want_g = _expected(op, X, G, ranks, rank, dim)
                    errors[(name, op + "-fallback", dim, True)] = ((y - want_y).abs().max().item(),
                                                                   (grad_of() - want_g).abs().max().item())
                    # at dim 0 the send buffer is a view of x: the fallback's all-reduce must not write into it
                    assert torch.equal(x, X[rank]), (op, dim)
            finally:
                for k, v in saved.items():
                    setattr(dist, k, v)
        dist.barrier()

    # a size-1 group: the wrappers return the input itself (no collective, no autograd node)
    lay = _layout((1, 4, 1, 1, 1))
    x = torch.ones(4, 4, requires_grad=True)
    for op in OPS:
        assert _run_op(op, x, lay.group("tp"), 0) is x, op
    for fn in (collectives.all_gather_along, collectives.reduce_scatter_along, collectives.split_along):
        assert fn(x, lay.group("tp"), 0) is x
    return errors


@pytest.mark.distributed
def test_collectives_match_single_process_math():
    per_rank = run_distributed(_cases, 4, timeout=110)
    worst = worst_over_ranks(per_rank)
    print(f"{len(worst)} cases; max abs err forward {max(e[0] for e in worst.values()):.2e}, "
          f"backward {max(e[1] for e in worst.values()):.2e}")
    bad = {c: e for c, e in worst.items() if max(e) > TOL}
    assert not bad, f"errors above {TOL}: {bad}"
    # 2 meshes x (2 ops x 1 dim + 4 ops x 3 dims) x 2 memory layouts + 4 fallback cases
    assert len(worst) == 2 * (2 + 4 * 3) * 2 + 4


def test_ulysses_reexports_the_moved_all_to_all():
    from msparallel_ds.context_parallel import ulysses
    from msparallel_ds.tensor_parallel import mappings as comm

    assert ulysses.seq_to_head is comm.seq_to_head and ulysses.HeadToSeqAllToAll is comm.HeadToSeqAllToAll
