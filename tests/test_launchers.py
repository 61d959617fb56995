"""examples/train_deepspeed.py under torchrun and the deepspeed launcher (4 CPU processes, dp2 x tp2 + SP + vocab
parallel) prints the same per-step losses as the plain single-process run of configs/tiny_dp1.yaml."""
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.distributed
ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ["examples/train_deepspeed.py", "--max-steps", "3"]


def _losses(cmd, **env):
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "1", **env})
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    losses = [float(x) for x in re.findall(r"^step \d+ loss (\S+)$", run.stdout, re.M)]
    assert len(losses) == 3, run.stdout[-2000:]
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
