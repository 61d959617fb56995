"""engine.save / engine.load with pipeline.zero.SplitZero (pipeline + optimizer parallel + expert parallel: dense
Adam states sharded over dp x cp, expert states over edp): a tiny DeepSeek-V3 at pp2 x dp2 x ep2 with ZeRO-1 trains
2 steps, saves (sharded and single-file), and resumes in a fresh engine of the same layout, at pp2 x dp2 without ep
(one ZeroRedundancyOptimizer) and at pp2 x dp2 x ep2 from the single file; the 2 resumed steps' losses equal the
uninterrupted run's on every rank."""
import os

import pytest
from deepseek_cases import deepseek_model
from engine_cases import global_batch
from harness import run_distributed
from moe_cases import adamw, ep_yaml

pytestmark = pytest.mark.distributed

LAYOUTS = {"pp2xdp2_ep2": dict(dp=2, zero=1, ep=2, pp=2), "pp2xdp2": dict(dp=2, zero=1, ep=1, pp=2)}


def _engine(name):
    import msparallel_ds as msp

    return msp.initialize(deepseek_model(), msp.load_config(ep_yaml(clip=0.05, **LAYOUTS[name])), optimizer=adamw)


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
    engine = _engine("pp2xdp2_ep2")
    out = {"opt": type(engine.optimizer).__name__}
    _steps(engine, 0, 2)
    engine.save(os.path.join(root, "sharded"), sharded=True)
    engine.save(os.path.join(root, "file"))
    out["whole"] = _steps(engine, 2, 4)
    for key, name, ckpt in (("same", "pp2xdp2_ep2", "sharded"), ("no_ep", "pp2xdp2", "sharded"),
                            ("file", "pp2xdp2_ep2", "file")):
        engine = _engine(name)
        info = engine.load(os.path.join(root, ckpt))
        out[key] = (_steps(engine, 2, 4), info["global_steps"], type(engine.optimizer).__name__)
    return out


def test_split_zero_resume_equals_uninterrupted(tmp_path):
    results = run_distributed(_run, 4, str(tmp_path), timeout=300)
    for rank, r in enumerate(results):
        assert r["opt"] == "SplitZero", r["opt"]
        for key in ("same", "no_ep", "file"):
            losses, steps, opt = r[key]
            assert steps == 2, (key, steps)
            rel = max(abs(a - b) / abs(b) for a, b in zip(losses, r["whole"]))
            assert rel <= 1e-6, (rank, key, losses, r["whole"])
        assert r["no_ep"][2] == "ZeroRedundancyOptimizer", r["no_ep"][2]
