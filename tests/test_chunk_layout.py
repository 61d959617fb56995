"""Fine-grain chunk layouts (interleave/chunk_layout.py) on 4 gloo processes against index math on the whole
sequence: in the chunk layout, rank r's chunk j is block j*tp + r of the sequence (so the gathered chunk j is the
contiguous rows of 1/n of the sequence), the scatter into it and the all-to-alls between the layouts place every
block where that says, forward and backward. tp=4 and tp=2 inside dp2 x tp2; 2, 3 and 4 chunks.
"""
from types import SimpleNamespace

import pytest

from harness import run_distributed

pytestmark = pytest.mark.distributed

DIMS = ("pp", "dp", "cp_ring", "cp_ulysses", "tp")
MESHES = {"tp4": (1, 1, 1, 1, 4), "dp2xtp2": (1, 2, 1, 1, 2)}
BLOCK = 3  # rows per block


def _cases(rank, world_size):
    import torch

    from msparallel_ds.distributed import init_parallel
    from msparallel_ds.distributed.collectives import all_gather_along
    from msparallel_ds.interleave import chunk_layout as cl

    def randn(shape, seed):
        return torch.randn(shape, generator=torch.Generator().manual_seed(seed))

    checked = []
    for name, mesh in MESHES.items():
        lay = init_parallel(SimpleNamespace(world_size=4, mesh=dict(zip(DIMS, mesh))))
        group, tp, r = lay.group("tp"), lay.size("tp"), lay.rank("tp")
        for n in (2, 3, 4):
            seq = tp * n * BLOCK
            full = randn((2, seq, 5), n)  # the whole sequence, the same on every rank (layer 0's input)
            blocks = full.split(BLOCK, 1)
            chunk_of = [blocks[j * tp + r] for j in range(n)]  # the chunk layout, by its definition
            rank_of = list(full.chunk(tp, 1)[r].chunk(n, 1))  # sequence parallel's own slice, in n chunks
            grads = [randn((2, BLOCK, 5), 100 * n + 10 * r + j) for j in range(n)]

            # the scatter into the chunk layout (the model's layer 0): forward and the grad of the whole sequence
            x = full.clone().requires_grad_()
            hs = cl.enter(x, n, group, scatter=True, chunked=True)
            assert all(torch.equal(h, c) for h, c in zip(hs, chunk_of)), (name, n)
            sum((h * g).sum() for h, g in zip(hs, grads)).backward()
            every = [all_gather_along(g, group, 0) for g in grads]  # [tp * 2, BLOCK, 5]: every rank's grads
            # the whole sequence's grad: block j*tp + q holds rank q's grad of its chunk j
            g_full = torch.cat([every[j].unflatten(0, (tp, 2))[q] for j in range(n) for q in range(tp)], 1)
            assert torch.equal(x.grad, g_full), (name, n, "scatter grad")

            # the gathered chunk j is the contiguous rows [j*S/n, (j+1)*S/n): a causal prefix block
            for j in range(n):
                assert torch.equal(all_gather_along(hs[j].detach(), group, 1), full.chunk(n, 1)[j]), (name, n, j)

            # rank layout -> chunk layout -> rank layout, and the grads back through both moves
            x = [c.clone().requires_grad_() for c in rank_of]
            moved = cl.to_chunk_layout(x, group)
            assert all(torch.equal(m, c) for m, c in zip(moved, chunk_of)), (name, n, "to chunks")
            back = cl.to_rank_layout(moved, group)
            assert all(torch.equal(b, c) for b, c in zip(back, rank_of)), (name, n, "to ranks")
            sum((m * g).sum() for m, g in zip(moved, grads)).backward()
            # the grad of a rank-layout chunk is the grad its blocks got in the chunk layout
            want = g_full.chunk(tp, 1)[r].chunk(n, 1)
            assert all(torch.equal(a.grad, w) for a, w in zip(x, want)), (name, n, "move grad")
            checked.append((name, n))

        # the clear errors: a sequence the scatter or the chunks cannot split evenly
        with pytest.raises(ValueError, match="not divisible by the group size"):
            cl.enter(torch.ones(1, tp * 3 + 1, 2), 3, group, scatter=True, chunked=True)
        with pytest.raises(ValueError, match="fine_grain_interleave=4"):
            cl.enter(torch.ones(1, tp * 6, 2), 4, group, scatter=True, chunked=True)
    return checked


def test_chunk_layout_places_every_block():
    per_rank = run_distributed(_cases, 4, timeout=120)
    assert all(len(c) == 2 * 3 for c in per_rank), per_rank


def test_a_run_uses_the_chunk_layout_only_where_it_pays():
    from msparallel_ds.interleave.chunk_layout import wanted

    assert wanted(2, 2, True, True, layers=1, free_entry=True)
    assert wanted(2, 2, True, True, layers=2, free_entry=False)
    assert not wanted(2, 2, True, True, layers=1, free_entry=False)  # two all-to-alls for one barrier
    assert not wanted(1, 2, True, True, layers=4, free_entry=True)  # one chunk: no barrier
    assert not wanted(2, 2, False, True, layers=4, free_entry=True)  # no SP: the chunks are contiguous already
    assert not wanted(2, 2, True, False, layers=4, free_entry=True)  # cp / non-causal: whole attention
