"""engine.save / engine.load with pipeline.zero.SplitZero (pipeline + optimizer parallel + expert parallel: dense
Adam states sharded over dp x cp, expert states over edp): a tiny DeepSeek-V3 at pp2 x dp2 x ep2 with ZeRO-1 trains
2 steps, saves (sharded and single-file), and resumes in a fresh engine of the same layout, at pp2 x dp2 without ep
(one ZeroRedundancyOptimizer) and at pp2 x dp2 x ep2 from the single file; the 2 resumed steps' losses equal the
uninterrupted run's on every rank. The same for the YAML's Muon (momentum per matrix, AdamW moments for the rest)
under optimizer parallel at dp4 x ep2 (whole-parameter ZeRO: dense states over dp, experts' over edp = 2), resumed as
itself (sharded and single-file) and at dp4 x ep2 without optimizer parallel (one plain Muon)."""
import os

import pytest
from deepseek_cases import deepseek_model
from engine_cases import global_batch
from harness import run_distributed
from moe_cases import adamw, ep_yaml

pytestmark = pytest.mark.distributed

LAYOUTS = {"pp2xdp2_ep2": dict(dp=2, zero=1, ep=2, pp=2), "pp2xdp2": dict(dp=2, zero=1, ep=1, pp=2),
           "muon_dp4_ep2": dict(dp=4, zero=1, ep=2), "muon_dp4_ep2_zero0": dict(dp=4, zero=0, ep=2)}


def _engine(name):
    import torch

    import msparallel_ds as msp
    from msparallel_ds.checkpoint.optim_state import parts

    y = ep_yaml(clip=0.05, **LAYOUTS[name])
    if name.startswith("muon"):  # the YAML's Muon (optimizer=None)
        y["optimizer"] = {"type": "Muon", "learning_rate": 1e-2, "weight_decay": 0.1}
        engine = msp.initialize(deepseek_model(), msp.load_config(y))
        for muon, _, _ in parts(engine.optimizer):  # float32 Newton-Schulz: in bfloat16 the summation-order
            muon.ns_dtype = torch.float32  # difference of ZeRO's and DeepSpeed's gradient reductions can flip a rounding
        return engine
    return msp.initialize(deepseek_model(), msp.load_config(y), optimizer=adamw)


def _steps(engine, first, last):
    lay = engine.layout
    rows = engine.micro_batch_size * engine.gradient_accumulation_steps
    out = []
    for step in range(first, last):
        ids, labels = global_batch(step, rows * lay.size("dp"))
        share = slice(lay.rank("dp") * rows, (lay.rank("dp") + 1) * rows)
        out.append(engine.train_batch({"input_ids": ids[share], "labels": labels[share]}).item())
    return out


def _run(rank, world, root):
    import torch

    torch.set_num_threads(1)
    out = {}
    for first, resumed in (("pp2xdp2_ep2", ("pp2xdp2_ep2", "pp2xdp2")),
                           ("muon_dp4_ep2", ("muon_dp4_ep2", "muon_dp4_ep2_zero0"))):
        engine = _engine(first)
        out[first] = {"opt": type(engine.optimizer).__name__}
        _steps(engine, 0, 2)
        engine.save(os.path.join(root, first, "sharded"), sharded=True)
        engine.save(os.path.join(root, first, "file"), sharded=False)
        out[first]["whole"] = _steps(engine, 2, 4)
        for key, name, ckpt in (("same", resumed[0], "sharded"), ("other", resumed[1], "sharded"),
                                ("file", resumed[0], "file")):
            engine = _engine(name)
            info = engine.load(os.path.join(root, first, ckpt))
            out[first][key] = (_steps(engine, 2, 4), info["global_steps"], type(engine.optimizer).__name__)
    return out


def test_split_zero_resume_equals_uninterrupted(tmp_path):
    results = run_distributed(_run, 4, str(tmp_path), timeout=300)
    for rank, res in enumerate(results):
        for first, other in (("pp2xdp2_ep2", "ZeroRedundancyOptimizer"), ("muon_dp4_ep2", "Muon")):
            r = res[first]
            assert r["opt"] == "SplitZero", (first, r["opt"])
            for key in ("same", "other", "file"):
                losses, steps, opt = r[key]
                assert steps == 2, (first, key, steps)
                rel = max(abs(a - b) / abs(b) for a, b in zip(losses, r["whole"]))
                assert rel <= 1e-6, (rank, first, key, losses, r["whole"])
            assert r["other"][2] == other, (first, r["other"][2])
