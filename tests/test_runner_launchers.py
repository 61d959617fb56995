"""`msparallel-ds train` under every launcher the command supports gives the same per-step losses: self-spawned
(`python -m msparallel_ds.train RUN.yaml --nproc 2`, which is also the `python -m` entry), torchrun, the deepspeed
launcher (one node: it starts the ranks locally, no pdsh/ssh) and `accelerate launch`; 2 processes (dp2), the tiny
MindFormers-derived YAML of tests/fixtures/mf_reference and its MindRecord, --stop-after 2, losses read from each
run's output_dir/metrics.jsonl. The launched runs start together (each on its own port) to keep the test short."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from harness import _free_port

pytestmark = pytest.mark.distributed
ROOT = Path(__file__).resolve().parents[1]
REF = ROOT / "tests" / "fixtures" / "mf_reference"
ACCELERATE = """compute_environment: LOCAL_MACHINE
distributed_type: MULTI_GPU
mixed_precision: 'no'
num_machines: 1
machine_rank: 0
num_processes: 2
rdzv_backend: static
same_network: true
use_cpu: false
"""


def _train_args(out):
    return [str(REF / "run.yaml"), "--output-dir", str(out), "--stop-after", "2", "--set", "load_checkpoint=",
            "--set", f"train_dataset.data_loader.dataset_dir={REF / 'data'}", "--set", "use_parallel=True",
            "--set", "parallel_config.data_parallel=2", "--set", "runner_config.batch_size=1"]


def _losses(out):
    return [json.loads(x)["loss"] for x in (Path(out) / "metrics.jsonl").read_text().splitlines()]


def test_every_launcher_gives_the_self_spawned_losses(tmp_path):
    module = ["-m", "msparallel_ds.train"]
    cmds = {"self": [sys.executable, *module, *_train_args(tmp_path / "self"), "--nproc", "2"],
            "torchrun": [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                         str(_free_port()), *module, *_train_args(tmp_path / "torchrun")]}
    exe = shutil.which("deepspeed")
    if exe is not None:  # tests/test_launchers.py's condition: the launcher is a console script of the DeepSpeed wheel
        cmds["deepspeed"] = [exe, "--num_gpus", "2", "--master_port", str(_free_port()), "--module",
                             "msparallel_ds.train", *_train_args(tmp_path / "deepspeed")]
    (tmp_path / "accelerate.yaml").write_text(ACCELERATE)
    cmds["accelerate"] = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                          str(tmp_path / "accelerate.yaml"), "--main_process_port", str(_free_port()), *module,
                          *_train_args(tmp_path / "accelerate")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    procs = {k: subprocess.Popen(c, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
             for k, c in cmds.items()}
    try:
        outs = {k: p.communicate(timeout=240)[0] for k, p in procs.items()}
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
    for k, p in procs.items():
        assert p.returncode == 0, (k, outs[k][-4000:])
    want = _losses(tmp_path / "self")
    assert len(want) == 2 and "step 2/" in outs["self"]
    for k in cmds:  # the same processes and collectives: equal up to float noise (they came out identical)
        got = _losses(tmp_path / k)
        assert len(got) == 2 and max(abs(g - w) / w for g, w in zip(got, want)) <= 1e-6, (k, got, want)
