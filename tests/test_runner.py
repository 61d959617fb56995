"""`msparallel-ds train` on a real MindFormers pretrain YAML (llama2 70b, scaled down by
configs/run/tiny_llama2_override.yaml, data: a MindRecord MindSpore wrote): 4 processes (dp2 x tp2 + SP, ZeRO-1,
vocab parallel) vs 1 process on the same global batches, loss falling, checkpoints at the configured steps with
keep_checkpoint_max, and stop-after + resume_training equal to the straight run (that one with async_save and
integrated_save)."""
import json
import os
from argparse import Namespace
from pathlib import Path

import pytest

from harness import run_isolated  # a fresh interpreter: the runner forks its ranks
from msparallel_ds.config.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
YAML = Path(__file__).resolve().parents[2] / "shared" / "mindformers-configs" / "llama2__pretrain_llama2_70b.yaml"
OVERRIDE = ROOT / "configs" / "run" / "tiny_llama2_override.yaml"
DATA = ROOT / "tests" / "fixtures" / "mindrecord" / "text"

pytestmark = pytest.mark.skipif(not YAML.is_file(), reason=f"{YAML} not found (shared MindFormers configs)")


def _args(out, *sets, nproc=None, stop_after=None, overrides=()):
    return Namespace(file=str(YAML), nproc=nproc, output_dir=str(out), stop_after=stop_after, tensorboard=None,
                     override=[str(OVERRIDE), *map(str, overrides)], set=[f"train_dataset.data_loader.dataset_dir={DATA}",
                                                    "runner_config.epochs=1", *sets], timeout=300)


def _metrics(out):
    return [json.loads(x) for x in (Path(out) / "metrics.jsonl").read_text().splitlines()]


def test_train_4_processes_equals_1_process_and_resumes(tmp_path):
    from msparallel_ds.run.launch import run

    straight = run_isolated(run, _args(tmp_path / "a", nproc=4))
    steps = straight["total_steps"]
    assert steps == 96 // 8 and straight["step"] == steps  # 96 rows / (batch 4 x dp 2), one epoch
    losses = [straight["losses"][s] for s in range(1, steps + 1)]
    assert sum(losses[-3:]) / 3 < losses[0] - 0.5, losses
    ck = sorted(os.listdir(tmp_path / "a" / "checkpoint"))
    assert ck == [f"step_{steps - 2}", f"step_{steps}"]  # every 2 steps, keep_checkpoint_max 2
    assert (tmp_path / "a" / "hf" / "config.json").is_file()
    assert [m["step"] for m in _metrics(tmp_path / "a")] == list(range(1, steps + 1))

    one = run_isolated(run, _args(tmp_path / "one", "parallel_config.data_parallel=1",
                                  "parallel_config.model_parallel=1", "runner_config.batch_size=8"))  # the same global batches (full_batch: the same rows per step)
    assert max(abs(one["losses"][s] - straight["losses"][s]) for s in range(1, steps + 1)) < 2e-4
    norms = [(m["grad_norm"], r["grad_norm"]) for m, r in zip(_metrics(tmp_path / "a"), _metrics(tmp_path / "one"))]
    assert all(g is not None for pair in norms for g in pair), norms  # logged in every layout, never 'n/a'
    assert max(abs(g - r) / r for g, r in norms) < 1e-3, norms  # the global norm: the same as one process's

    # weights from the run's HF folder and from its engine.save checkpoint (weights only): the same model
    one_proc = ("parallel_config.data_parallel=1", "parallel_config.model_parallel=1", "runner_config.batch_size=8")
    from_hf = run_isolated(run, _args(tmp_path / "c", f"load_checkpoint={tmp_path / 'a' / 'hf'}", *one_proc,
                                      stop_after=1))
    from_ck = run_isolated(run, _args(tmp_path / "d", f"load_checkpoint={tmp_path / 'a' / 'checkpoint' / f'step_{steps}'}",
                                      *one_proc, stop_after=1))
    assert abs(from_hf["losses"][1] - from_ck["losses"][1]) < 1e-5
    assert from_hf["losses"][1] < straight["losses"][1] - 1.0  # trained weights, not a fresh init

    # MindFormers' async_save and integrated_save: step_4 is written in the background and completed at the end
    # (stop-after), each step folder also holds a merged HF folder; the resume is the same
    background = tmp_path / "async.yaml"
    background.write_text("callbacks:\n  - type: MFLossMonitor\n  - type: CheckpointMonitor\n"
                          "    save_checkpoint_steps: 2\n    keep_checkpoint_max: 2\n    async_save: true\n"
                          "    integrated_save: true\n    checkpoint_format: safetensors\n")
    first = run_isolated(run, _args(tmp_path / "b", nproc=4, stop_after=5, overrides=[background]))
    assert first["step"] == 5 and sorted(os.listdir(tmp_path / "b" / "checkpoint")) == ["step_2", "step_4"]
    assert all((tmp_path / "b" / "checkpoint" / s / "hf" / "config.json").is_file() for s in ("step_2", "step_4"))
    resumed = run_isolated(run, _args(tmp_path / "b", "resume_training=true", nproc=4, overrides=[background]))
    assert sorted(resumed["losses"]) == list(range(5, steps + 1))  # from the newest complete checkpoint, step 4
    assert max(abs(resumed["losses"][s] - straight["losses"][s]) for s in resumed["losses"]) < 1e-6
    assert [m["step"] for m in _metrics(tmp_path / "b")] == list(range(1, steps + 1))  # step 5 logged once


def test_bad_run_yaml_errors_name_the_key(tmp_path):
    from msparallel_ds.run.launch import run

    with pytest.raises(ConfigError, match="run_mode"):
        run(_args(tmp_path, "run_mode=predict"))
    with pytest.raises(ConfigError, match="train_dataset.data_loader.dataset_dir"):
        run(_args(tmp_path, f"train_dataset.data_loader.dataset_dir={tmp_path}"))
    with pytest.raises(ConfigError, match="load_checkpoint"):
        run(_args(tmp_path, f"load_checkpoint={tmp_path / 'nope'}"))
    with pytest.raises(ConfigError, match="fewer than one"):
        run(_args(tmp_path, "runner_config.batch_size=64"))
