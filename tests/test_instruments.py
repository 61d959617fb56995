"""The benchmark instruments on 2 gloo processes: the modelled link floors collectives, and comm_stats splits the
time blocked in them into the link time the schedule left exposed and the real collective finishing late."""
from harness import run_distributed

ALPHA, BW = 0.02, 1e6  # a 12 KB gather: 20 ms + 6 ms modelled


def _cases(rank, world_size):
    import time

    import torch
    import torch.distributed as dist

    from msparallel_ds.distributed.collectives import all_gather_along
    from msparallel_ds.distributed.instruments import comm_stats, modelled_link
    from msparallel_ds.interleave.overlap import AsyncCollective, issue, wait

    torch.set_num_threads(1)
    x = torch.randn(1, 1536, 2)  # 12 KB per rank
    group = dist.group.WORLD
    out = {}
    with modelled_link(ALPHA, BW):
        dist.barrier()
        with comm_stats() as st:  # blocking: the caller waits through the whole modelled time
            t0 = time.perf_counter()
            all_gather_along(x, group, 1)
            out["sync"] = dict(st, wall=time.perf_counter() - t0)
        for late in (0.0, 0.1):  # async, waited at once / after its modelled completion
            dist.barrier()
            with comm_stats() as st:
                link = AsyncCollective("all_gather", group, 1)
                token = issue(x, link)
                time.sleep(late)
                wait(token, link)
                out[f"async_{late}"] = dict(st)
    return out


def test_link_exposed_time():
    for res in run_distributed(_cases, 2, timeout=90):
        modelled = ALPHA + 1536 * 2 * 4 / BW  # bus bytes of a 2-rank all-gather: the other rank's half
        sync = res["sync"]
        assert sync["collectives"] == 1 and abs(sync["modelled_s"] - modelled) < 1e-9
        assert sync["wall"] >= modelled  # the link floored it
        assert abs(sync["link_exposed_s"] - modelled) < 1e-9  # all of it exposed: nothing ran beside it
        assert sync["blocked_s"] >= sync["link_exposed_s"]
        now = res["async_0.0"]
        assert 0.8 * modelled < now["link_exposed_s"] <= modelled
        assert now["blocked_s"] >= now["link_exposed_s"]
        after = res["async_0.1"]  # the sleep hid the whole modelled time
        assert after["link_exposed_s"] == 0.0 and after["modelled_s"] > 0
