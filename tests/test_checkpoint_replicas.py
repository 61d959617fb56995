"""Fault recovery from data-parallel replicas (checkpoint.replicas): engine.save(dir, replicas=1) on dp2 x tp2 + SP
(ZeRO-1, 4 gloo processes) also writes each rank's files on its data-parallel peer; deleting a whole node's files
(ranks 0 and 1: the tp pair, with global rank 0's metadata and progress) and restarting resumes from the peers'
copies with the uninterrupted run's losses. Losing a rank and its peer is a clear error that loads nothing.
`msparallel-ds plan`'s save report (checkpoint.save_plan) gives each rank the tensor bytes that save wrote."""
import os
import shutil

import pytest
from engine_cases import global_batch, tiny_config, tiny_model
from harness import run_distributed

pytestmark = pytest.mark.distributed

ROWS = 4


def _engine():
    import torch

    import msparallel_ds as msp

    cfg = msp.load_config(tiny_config(dp=2, tp=2, sp=True, vocab_dp=False, bs=2))
    return msp.initialize(tiny_model(), cfg,
                          optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1))


def _steps(engine, first, last):
    rows, d = ROWS // engine.layout.size("dp"), engine.layout.rank("dp")
    out = []
    for step in range(first, last):
        ids, labels = global_batch(step, ROWS)
        out.append(engine.train_batch({"input_ids": ids[d * rows:(d + 1) * rows],
                                       "labels": labels[d * rows:(d + 1) * rows]}).item())
    return out


def _data(folder):
    return os.path.join(folder, next(d for d in os.listdir(folder) if d.startswith("dcp-")))


def _lose(folder, ranks):
    """Delete the files of `ranks` (their node is gone): their DCP files, rank 0's metadata, their mirrors."""
    data = _data(folder)
    for name in os.listdir(data):
        if any(name.startswith(f"__{r}_") for r in ranks) or (0 in ranks and name in (".metadata", "progress.pt")):
            os.remove(os.path.join(data, name))
    for r in ranks:
        shutil.rmtree(os.path.join(data, "mirror", f"by{r}"))


def _sizes(folder):
    data = _data(folder)
    own = sum(os.path.getsize(os.path.join(data, f)) for f in os.listdir(data) if f.startswith("__") or
              f == ".metadata")
    mirror = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(os.path.join(data, "mirror"))
                 for f in fs if f != "progress.pt")
    return own, mirror


def _run(rank, world, root):
    import torch.distributed as dist

    from msparallel_ds.checkpoint.sharded import wait_pending

    sync, asy = os.path.join(root, "sync"), os.path.join(root, "async")
    engine = _engine()
    full = _steps(engine, 0, 2)
    engine.save(sync, sharded=True, replicas=1)
    engine.save(asy, async_save=True, replicas=1)  # staged; the files and their copies are written meanwhile
    full += _steps(engine, 2, 4)
    wait_pending()
    dist.barrier()
    out = {"full": full}
    if rank == 0:
        out["sizes"] = _sizes(sync)
        _lose(asy, [0, 1])  # one node: the tp pair of dp rank 0
        _lose(sync, [0, 2])  # rank 0 and its data-parallel peer
    dist.barrier()
    engine = _engine()
    try:
        engine.load(sync)
        out["both_lost"] = "loaded"
    except ValueError as e:
        out["both_lost"] = str(e)
    info = engine.load(asy)
    out["resumed"] = (_steps(engine, 2, 4), info["global_steps"])
    out["restored"] = sorted(os.listdir(_data(asy)))
    out["pp"] = _pipeline_save(rank, os.path.join(root, "pp"))
    return out


def _pp_config():
    raw = tiny_config(dp=2, bs=1)  # the YAML's AdamW: build_optimizer's weight-decay and no-decay groups
    raw["parallel_config"].update(pipeline_stage=2, micro_batch_num=2)
    raw["parallel"]["pipeline_config"] = {"pipeline_interleave": False, "pipeline_scheduler": "1f1b"}
    raw["model"]["model_config"]["ffn_hidden_size"] = 128  # tiny_model's intermediate_size
    return raw


def _pipeline_save(rank, folder):
    """pp2 x dp2 ZeRO-1 with two param groups: one step, a sharded save (its per-rank bytes vs the plan's); and
    torch's ZeroRedundancyOptimizer's owners for groups where the group order changes them, vs save_plan._owners."""
    import torch
    from torch.distributed.optim import ZeroRedundancyOptimizer

    import msparallel_ds as msp
    from msparallel_ds.checkpoint.save_plan import _owners

    engine = msp.initialize(tiny_model(), msp.load_config(_pp_config()))
    groups = len(engine.optimizer.param_groups)
    _steps(engine, 0, 1)
    engine.save(folder)
    sizes = [[3], [5, 1, 2, 2]]  # as one group, 5 would go to rank 0 and 3 to rank 1; in two, 3 to 0 and 5 to 1
    params = [[torch.nn.Parameter(torch.zeros(n)) for n in g] for g in sizes]
    z = ZeroRedundancyOptimizer([{"params": g} for g in params], optimizer_class=torch.optim.SGD, lr=0.1,
                                process_group=engine.layout.group("dp_cp"))
    real = [z._param_to_rank[p] for g in params for p in g]
    flat = [n for g in sizes for n in g]
    return groups, real, _owners(flat, 2, [[0], [1, 2, 3, 4]]), _owners(flat, 2, [[0, 1, 2, 3, 4]])


def _written_per_rank(folder):
    """Tensor bytes in each rank's DCP file, from DCP's own metadata."""
    import math

    from torch.distributed.checkpoint import FileSystemReader

    md = FileSystemReader(_data(folder)).read_metadata()
    out = {}
    for index, info in md.storage_data.items():
        rank = int(info.relative_path.split("_")[2])
        chunk = next(c for c in md.state_dict_metadata[index.fqn].chunks if tuple(c.offsets) == tuple(index.offset))
        out[rank] = out.get(rank, 0) + 4 * math.prod(chunk.sizes)
    return [out[r] for r in sorted(out)]


def _plan_report(raw=None):
    import msparallel_ds as msp
    from msparallel_ds.checkpoint.save_plan import format_save_report, save_report

    if raw is None:
        raw = tiny_config(dp=2, tp=2, sp=True, vocab_dp=False, bs=2)
        raw["model"]["model_config"]["ffn_hidden_size"] = 128  # tiny_model's intermediate_size
    plan = msp.make_plan(msp.load_config(raw), world_size=4)
    report = save_report(plan)
    return report, format_save_report(plan, report)


def test_lost_node_resumes_from_data_parallel_peers(tmp_path):
    res = run_distributed(_run, 4, str(tmp_path), timeout=240)
    report, text = _plan_report()  # the plan's save report: the bytes each rank wrote, from the same writer rule
    assert [r["weights"] + r["optimizer"] for r in report["ranks"]] == _written_per_rank(str(tmp_path / "async"))
    assert report["total"] == sum(_written_per_rank(str(tmp_path / "async"))) and "largest file" in text
    full = res[0]["full"]
    own, mirror = res[0]["sizes"]
    assert own > 0 and mirror == own, (own, mirror)  # every byte twice, no more
    for r in res:
        losses, steps = r["resumed"]
        assert steps == 2 and losses == full[2:], (losses, full)  # the uninterrupted run, bit for bit
        assert "no data-parallel peer kept a copy" in r["both_lost"] and "Nothing was loaded" in r["both_lost"], r
        assert {"__0_0.distcp", "__1_0.distcp", ".metadata", "progress.pt"} <= set(r["restored"]), r["restored"]
    # pp2 x dp2, ZeRO-1 (torch ZeroRedundancyOptimizer) over two param groups: the plan's owner rule is torch's
    groups, real, planned, one_group = res[0]["pp"]
    assert groups == 2 and real == planned and planned != one_group, (groups, real, planned, one_group)
    pp_report = _plan_report(_pp_config())[0]
    assert [r["weights"] + r["optimizer"] for r in pp_report["ranks"]] == _written_per_rank(str(tmp_path / "pp"))


def test_replicas_option_is_checked():
    from types import SimpleNamespace

    from msparallel_ds.checkpoint.replicas import check_replicas

    lay = SimpleNamespace(size=lambda name: {"dp_cp": 1}[name])
    with pytest.raises(ValueError, match="needs a data-parallel peer"):
        check_replicas(1, lay)
    with pytest.raises(ValueError, match="must be 0"):
        check_replicas(2, lay)
    assert check_replicas(0, lay) == 0
