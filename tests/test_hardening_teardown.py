"""Hardening round 2, item 6b: a rank died at teardown (1 of 7 two-node torchrun runs of examples/train_deepspeed.py:
rank 3 aborted with "terminate called without an active exception", SIGABRT, after every step finished). The entry
points now end with msparallel_ds.runtime.teardown() (barrier, DeepSpeed's and our groups destroyed, then exit).
This loops a short 2-process torchrun run and requires exit 0 every time: 3 runs by default (each costs a torchrun
start, ~10 s here), MSP_TEARDOWN_RUNS=20 for the 20-run check of the issue."""
import os
import socket
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_short_runs_exit_cleanly_every_time(tmp_path):
    raw = yaml.safe_load((ROOT / "configs" / "tiny_dp1.yaml").read_text())
    raw["parallel_config"]["data_parallel"] = 2
    raw["runner_config"]["batch_size"] = 1
    raw["model"]["model_config"].update(num_layers=1, hidden_size=16, num_heads=2, n_kv_heads=1, seq_length=8)
    cfg = tmp_path / "tiny_dp2.yaml"
    cfg.write_text(yaml.safe_dump(raw))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    runs = int(os.environ.get("MSP_TEARDOWN_RUNS", "3"))
    for i in range(runs):
        res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                              "--master_port", str(_free_port()), "examples/train_deepspeed.py", "--config", str(cfg),
                              "--max-steps", "1", "--seq", "8"],
                             cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
        assert res.returncode == 0 and "terminate called" not in res.stderr, (i, res.stderr[-3000:])
        assert "step 1 loss" in res.stdout, res.stdout[-2000:]
