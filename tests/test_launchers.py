"""examples/train_deepspeed.py under torchrun and the deepspeed launcher (4 CPU processes, dp2 x tp2 + SP + vocab
parallel) prints the same per-step losses as the plain single-process run of configs/tiny_dp1.yaml. Failures: a
YAML for another world size stops every rank with the message before the model is built; a rank that raises
mid-training stops the whole run quickly, naming the rank and the error; a run killed (SIGKILL) after saving
resumes under another layout with the uninterrupted run's losses."""
import signal
import os
import time
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.distributed
ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ["examples/train_deepspeed.py", "--max-steps", "3", "--lr", "3e-3"]  # one lr for every YAML compared


def _losses(cmd, steps=3, **env):
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "1", **env})
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    losses = [float(x) for x in re.findall(r"^step \d+ loss (\S+)$", run.stdout, re.M)]
    assert len(losses) == steps, run.stdout[-2000:]
    return losses


@pytest.fixture(scope="module")
def single():
    return _losses([sys.executable, *SCRIPT, "--config", "configs/tiny_dp1.yaml"])


@pytest.mark.parametrize("launcher", ["torchrun", "deepspeed"])
def test_launcher_matches_single_process(launcher, single):
    cfg = ["--config", "configs/tiny_dp2_tp2.yaml"]
    if launcher == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "4", *SCRIPT, *cfg]
        env = {}
    else:
        exe = shutil.which("deepspeed")
        if exe is None:
            pytest.skip("the deepspeed launcher is not on PATH")
        cmd, env = [exe, "--num_gpus", "4", *SCRIPT, *cfg], {"DS_ACCELERATOR": "cpu"}
    got = _losses(cmd, **env)
    assert max(abs(a - b) / b for a, b in zip(got, single)) <= 1e-4, (got, single)


def _world_size_mismatch(rank, world, config):
    import msparallel_ds as msp

    built = []
    try:
        msp.initialize(lambda: built.append(1), msp.load_config(config))
    except msp.ConfigError as e:
        return str(e), built
    return None, built


def test_world_size_mismatch_stops_before_the_model_is_built():
    from harness import run_distributed

    results = run_distributed(_world_size_mismatch, 2, str(ROOT / "configs" / "tiny_dp2_tp2.yaml"), timeout=120)
    for message, built in results:
        assert message and "world_size=2 does not equal" in message and "data_parallel" in message, message
        assert built == []  # the model factory never ran


def test_a_failing_rank_stops_every_rank():
    start = time.monotonic()
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "4",
                          "tests/scripts/fail_one_rank.py", "configs/tiny_dp2_tp2.yaml"], cwd=ROOT,
                         capture_output=True, text=True, timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"})
    elapsed = time.monotonic() - start
    out = run.stdout + run.stderr
    assert run.returncode != 0, out[-3000:]
    assert "injected failure on rank 1" in out and re.search(r"rank\s*:\s*1\b", out), out[-3000:]
    assert elapsed < 120, f"the run took {elapsed:.0f} s to stop"


def _kill_matching(text):
    """SIGKILL every process whose command line contains `text` (Linux /proc)."""
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if text in cmdline.read_bytes().decode(errors="replace"):
                os.kill(int(cmdline.parent.name), signal.SIGKILL)
        except (OSError, ValueError):
            pass  # gone already


def test_killed_run_resumes_under_another_layout(tmp_path):
    """dp2 x tp2 saves every 2 steps and is SIGKILLed once a checkpoint exists; tp1 x dp1 resumes it and prints the
    uninterrupted single-process run's losses for the following steps."""
    import json

    from msparallel_ds.checkpoint.folder import MANIFEST

    ckpt = tmp_path / "ckpt"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "4"]
    proc = subprocess.Popen([*torchrun, "examples/train_deepspeed.py", "--lr", "3e-3",
                             "--config", "configs/tiny_dp2_tp2.yaml", "--max-steps", "1000", "--save-dir", str(ckpt),
                             "--save-every", "2"], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    deadline = time.monotonic() + 240
    try:
        while not (ckpt / MANIFEST).exists():  # engine.save's default, sharded: the manifest is written last
            assert proc.poll() is None and time.monotonic() < deadline, "the run ended or stalled before saving"
            time.sleep(0.2)
    finally:  # torchrun starts its workers in sessions of their own: kill every process of this run
        _kill_matching(str(ckpt))
        proc.wait()
    done = json.loads((ckpt / MANIFEST).read_text())["global_steps"]
    assert done >= 2 and done % 2 == 0
    steps = done + 2
    single = [sys.executable, *SCRIPT[:1], "--max-steps", str(steps), "--config", "configs/tiny_dp1.yaml"]
    want = _losses(single, steps)[done:]
    got = _losses([sys.executable, *SCRIPT[:1], "--max-steps", str(steps), "--config", "configs/tiny_dp1.yaml",
                   "--resume", str(ckpt)], 2)
    assert max(abs(a - b) / b for a, b in zip(got, want)) <= 1e-5, (got, want)
