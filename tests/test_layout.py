"""ParallelLayout on 4 gloo processes: every group matches DESIGN.md's rank formula and really works."""

import itertools
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from harness import run_distributed

DIMS = ("pp", "dp", "cp_ring", "cp_ulysses", "tp")
FLAT = {"cp": ("cp_ring", "cp_ulysses"), "dp_cp": ("dp", "cp_ring", "cp_ulysses"), "pp_tp": ("pp", "tp")}
WORLD = 4
# Every (pp, dp, cp_ring, cp_ulysses, tp) with product 4: 5 shapes with one dim = 4, 10 with two dims = 2.
SHAPES = sorted({s for s in itertools.product((1, 2, 4), repeat=5) if s[0] * s[1] * s[2] * s[3] * s[4] == WORLD})


def _plan(shape, world_size=WORLD, as_dict=False):
    mesh = dict(zip(DIMS, shape))
    return SimpleNamespace(world_size=world_size, mesh=mesh if as_dict else SimpleNamespace(**mesh))


def _rank_of(coord, sizes):
    """DESIGN.md: rank = (((pp_i*dp + d)*cp_ring + r)*cp_ulysses + u)*tp + t, written out."""
    pp_i, d, r, u, t = (coord[n] for n in DIMS)
    return (((pp_i * sizes["dp"] + d) * sizes["cp_ring"] + r) * sizes["cp_ulysses"] + u) * sizes["tp"] + t


def expected_groups(shape, rank):
    """For each name: the global ranks of `rank`'s group, in group order (varying dims row-major)."""
    sizes = dict(zip(DIMS, shape))
    coords = {}
    for c in itertools.product(*(range(s) for s in shape)):
        coords[_rank_of(dict(zip(DIMS, c)), sizes)] = dict(zip(DIMS, c))
    assert sorted(coords) == list(range(WORLD))
    mine = coords[rank]
    out = {}
    for name, varying in [(n, (n,)) for n in DIMS] + list(FLAT.items()):
        out[name] = [_rank_of({**mine, **dict(zip(varying, v))}, sizes)
                     for v in itertools.product(*(range(sizes[n]) for n in varying))]
    return out


def _check_layout(rank, world_size, shape):
    from msparallel_ds.distributed import GROUP_NAMES, init_parallel

    lay = init_parallel(_plan(shape, as_dict=rank % 2 == 1), timeout=timedelta(seconds=45))
    assert lay.world_size == world_size and lay.global_rank == rank
    assert tuple(lay.mesh.mesh_dim_names) == DIMS and tuple(lay.mesh.shape) == shape
    report = {}
    for name, ranks in expected_groups(shape, rank).items():
        assert name in GROUP_NAMES
        assert list(lay.ranks(name)) == ranks, (name, lay.ranks(name), ranks)
        assert lay.rank(name) == ranks.index(rank)
        assert lay.size(name) == len(ranks)
        grp = lay.group(name)
        assert dist.get_world_size(grp) == len(ranks) and dist.get_rank(grp) == lay.rank(name)
        t = torch.ones(1)
        dist.all_reduce(t, group=grp)  # the group is real and holds exactly these ranks
        assert t.item() == len(ranks), (name, t.item())
        s = torch.tensor([float(rank)])
        dist.all_reduce(s, group=grp)
        assert s.item() == sum(ranks)
        # The timeout reached the subgroups (DeviceMesh would otherwise use torch's 30 min default).
        assert grp._get_backend(torch.device("cpu")).options._timeout == timedelta(seconds=45)
        report[name] = (lay.rank(name), lay.size(name))
    assert lay.is_first_stage == (lay.rank("pp") == 0)
    assert lay.is_last_stage == (lay.rank("pp") == shape[0] - 1)
    with pytest.raises(ValueError, match="valid names: pp, dp, cp_ring"):
        lay.size("mp")
    with pytest.raises(ValueError, match="unknown parallel dim 'model'"):
        lay.group("model")

    # The mpu maps onto the same groups.
    mpu = lay.mpu()
    assert mpu.get_tensor_model_parallel_group() is lay.group("tp")
    assert mpu.get_model_parallel_rank() == lay.rank("tp")
    assert mpu.get_model_parallel_world_size() == lay.size("tp")
    assert mpu.get_model_parallel_group() is lay.group("pp_tp")
    assert mpu.get_pipeline_model_parallel_rank() == lay.rank("pp")
    assert mpu.get_data_parallel_world_size() == lay.size("dp")
    assert mpu.get_data_parallel_group_ranks() == list(lay.ranks("dp"))
    assert mpu.get_sequence_parallel_world_size() == lay.size("cp")
    assert mpu.get_sequence_data_parallel_group() is lay.group("dp_cp")
    assert mpu.get_sequence_data_parallel_rank() == lay.rank("dp_cp")
    assert mpu.get_tensor_model_parallel_src_rank() == lay.ranks("tp")[0]
    assert not hasattr(mpu, "initialize_sequence_parallel")
    return report


@pytest.mark.distributed
def test_all_4_rank_meshes_match_the_rank_formula_and_sum_flat_in_buckets():
    # All 15 shapes in one set of processes: a spawn costs seconds, a layout milliseconds.
    run_distributed(_check_all, WORLD, timeout=120)


def _check_all(rank, world_size):
    for shape in SHAPES:
        _check_layout(rank, world_size, shape)
    _check_flat_sums(rank)


def _check_flat_sums(rank):
    """all_reduce_flat over dp of a dp2 x tp2 layout: exact sums, and each all-reduce's size shows the buckets."""
    from unittest import mock

    from msparallel_ds.distributed import init_parallel
    from msparallel_ds.distributed.collectives import all_reduce_flat

    lay = init_parallel(_plan((1, 2, 1, 1, 2)))

    def grads(r):  # a, b (not contiguous), c (big), d, e
        return [torch.arange(15.).view(3, 5) * (r + 1), (torch.arange(24.).view(4, 6) + r).t(),
                torch.full((50,), float(r)), torch.tensor([r, -r], dtype=torch.float32), torch.arange(7.) - r]

    expected = [sum(ts) for ts in zip(*(grads(r) for r in lay.ranks("dp")))]
    real = dist.all_reduce
    for bucket, sizes in [(None, [98]), (10, [15, 24, 50, 9]), (1, [15, 24, 50, 2, 7])]:
        seen = []
        tensors = grads(rank)
        with mock.patch.object(dist, "all_reduce", lambda t, **kw: (seen.append(t.numel()), real(t, **kw))[1]):
            all_reduce_flat(tensors, lay, "dp", bucket)
        assert seen == sizes, (bucket, seen)  # a contiguous tensor >= bucket goes alone, in place
        for got, want in zip(tensors, expected):
            assert torch.equal(got, want), bucket


def test_shapes_cover_every_dim_at_2_and_4():
    assert len(SHAPES) == 15
    for i in range(5):
        assert {s[i] for s in SHAPES} == {1, 2, 4}
    for s in [(1, 1, 2, 2, 1), (2, 1, 1, 1, 2), (1, 2, 1, 1, 2), (1, 1, 4, 1, 1), (1, 1, 1, 4, 1),
              (1, 1, 1, 1, 4), (2, 2, 1, 1, 1)]:
        assert s in SHAPES


def test_expected_groups_spot_check():
    # Independent of the formula code: hybrid cp (1,1,2,2,1) puts Ulysses inside ring.
    g = expected_groups((1, 1, 2, 2, 1), 1)
    assert g["cp_ulysses"] == [0, 1] and g["cp_ring"] == [1, 3] and g["cp"] == [0, 1, 2, 3]
    g = expected_groups((2, 1, 1, 1, 2), 3)  # pp outermost, tp innermost
    assert g["pp"] == [1, 3] and g["tp"] == [2, 3] and g["pp_tp"] == [0, 1, 2, 3] and g["dp_cp"] == [3]


def test_requires_initialized_process_group():
    from msparallel_ds.distributed import init_parallel

    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="init_process_group.*torchrun"):
        init_parallel(_plan((1, 4, 1, 1, 1)))


def _wrong_world_size(rank, world_size):
    from msparallel_ds.distributed import init_parallel

    with pytest.raises(ValueError, match=r"world_size=8.*world_size=4"):
        init_parallel(_plan((2, 4, 1, 1, 1), world_size=8))
    with pytest.raises(ValueError, match=r"1\*2\*1\*1\*1 = 2 but plan.world_size=4"):
        init_parallel(_plan((1, 2, 1, 1, 1), world_size=4))
    with pytest.raises(ValueError, match="cp_ring\\*cp_ulysses"):
        init_parallel(SimpleNamespace(world_size=4, mesh=dict(zip(DIMS, (1, 2, 2, 1, 1)), cp=4)))
    # Still usable after the errors: a good plan builds, and without `timeout` its groups take the
    # default group's timeout (the harness passes its own, 60 s, to init_process_group).
    lay = init_parallel(_plan((1, 2, 2, 1, 1)))
    assert lay.timeout == timedelta(seconds=60)
    assert lay.group("cp")._get_backend(torch.device("cpu")).options._timeout == timedelta(seconds=60)
    return lay.ranks("dp_cp")


@pytest.mark.distributed
def test_world_size_mismatch_is_a_clear_error_and_timeout_defaults():
    out = run_distributed(_wrong_world_size, WORLD, timeout=60)
    assert out == [(0, 1, 2, 3)] * 4
