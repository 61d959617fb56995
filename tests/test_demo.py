"""`msparallel-ds demo`, the README's main job: a real 8-process run whose losses equal one process's."""
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.distributed


def _demo(*args, timeout=240):
    cmd = [sys.executable, "-m", "msparallel_ds.cli", "demo", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def _parity(stdout):
    m = re.search(r"parity: max \|loss - single-process loss\| = (\S+) over (\d+) steps \(max relative (\S+);", stdout)
    assert m, stdout[-2000:]
    return float(m.group(1)), int(m.group(2)), float(m.group(3))


def test_demo_default_matches_single_process():
    run = _demo("--steps", "4")
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    worst, steps, rel = _parity(run.stdout)
    assert steps == 4 and rel <= 1e-4, run.stdout
    assert "mesh (pp, dp, cp_ring, cp_ulysses, tp)  1 x 2 x 2 x 1 x 2" in run.stdout  # dp, cp ring and tp mixed
    assert len(re.findall(r"step +\d+/4 \[", run.stdout)) == 4  # progress with the loss of every step
    assert "all_gather_into_tensor" not in run.stderr


def test_demo_other_config_and_bad_input(tmp_path):
    run = _demo("--config", "configs/tiny_cp4_hybrid.yaml", "--steps", "2")
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    assert _parity(run.stdout)[2] <= 1e-4
    bad = tmp_path / "bad.yaml"
    bad.write_text("parallel_config:\n  data_parallel: 2\n  model_parallel: 3\n")
    run = _demo("--config", str(bad), "--steps", "1", timeout=60)
    assert run.returncode == 2 and "model_parallel" in run.stderr, run.stderr
