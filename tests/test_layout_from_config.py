"""init_parallel from a real YAML config on 4 gloo processes: the groups hold DESIGN.md's ranks."""
from pathlib import Path

import pytest

from harness import run_distributed

ROOT = Path(__file__).resolve().parents[1]


def _layout_groups(rank, world_size, config_paths):
    import torch
    import torch.distributed as dist

    import msparallel_ds as msp

    results = []
    for path in config_paths:  # several layouts in one process group: spawning 4 processes is the slow part
        lay = msp.init_parallel(msp.load_config(path))
        names = ("pp", "dp", "cp_ring", "cp_ulysses", "tp", "cp", "dp_cp")
        out = {n: (lay.rank(n), lay.size(n), list(lay.ranks(n))) for n in names}
        t = torch.ones(1)
        dist.all_reduce(t, group=lay.group("dp_cp"))
        out["dp_cp_sum"] = t.item()
        results.append(out)
    return results


def _expected(rank, shape):
    pp, dp, cr, cu, tp = shape
    coords, r = [], rank
    for size in reversed(shape):
        coords.append(r % size)
        r //= size
    coords = dict(zip(("tp", "cp_ulysses", "cp_ring", "dp", "pp"), coords))

    def rank_of(c):
        return (((c["pp"] * dp + c["dp"]) * cr + c["cp_ring"]) * cu + c["cp_ulysses"]) * tp + c["tp"]

    def group(dims):
        import itertools
        sizes = dict(zip(("pp", "dp", "cp_ring", "cp_ulysses", "tp"), shape))
        members = []
        for vals in itertools.product(*(range(sizes[d]) for d in dims)):
            members.append(rank_of({**coords, **dict(zip(dims, vals))}))
        return sorted(members)

    return {"tp": group(["tp"]), "cp": group(["cp_ring", "cp_ulysses"]), "dp_cp": group(["dp", "cp_ring", "cp_ulysses"]),
            "pp": group(["pp"]), "cp_ring": group(["cp_ring"])}


CASES = [("tiny_dp2_tp2.yaml", (1, 2, 1, 1, 2)), ("tiny_cp4_hybrid.yaml", (1, 1, 2, 2, 1)),
         ("tiny_pp2_dp2.yaml", (2, 2, 1, 1, 1))]


@pytest.mark.distributed
def test_init_parallel_from_yaml():
    results = run_distributed(_layout_groups, 4, [str(ROOT / "configs" / n) for n, _ in CASES], timeout=120)
    for rank, per_config in enumerate(results):
        for (name, shape), got in zip(CASES, per_config):
            exp = _expected(rank, shape)
            for n, members in exp.items():
                assert sorted(got[n][2]) == members, (name, rank, n)
                assert got[n][1] == len(members)
            assert got["dp_cp_sum"] == shape[1] * shape[2] * shape[3]
