"""`msparallel-ds train` logs MindFormers' own loss curve: 20 steps of a tiny legacy Llama that MindFormers 1.6.0
trained stand-alone on CPU from a YAML derived from a real pretrain config, starting from a MindSpore .ckpt
(load_checkpoint) and reading MindRecord data (tests/fixtures/mf_reference, made by its make_reference.py). Same
YAML, checkpoint and data here, on 1 process and on dp2 x tp2 (the same global batch of 2 rows): every loss within
1e-4 relative. This needs MindFormers' targets (input_ids[:, :-1] on input_ids[:, 1:]: all S targets of a row),
its token mean over the batch, clipping by max_grad_norm with no epsilon, the YAML's optimizer and lr schedule."""
import json
from argparse import Namespace
from pathlib import Path

import pytest

from harness import run_isolated

REF = Path(__file__).resolve().parent / "fixtures" / "mf_reference"


def _train(out, nproc, *sets):
    from msparallel_ds.run.launch import run

    args = Namespace(file=str(REF / "run.yaml"), nproc=nproc, output_dir=str(out), stop_after=None, tensorboard=None,
                     override=[], set=[f"load_checkpoint={REF / 'tiny.ckpt'}",
                                       f"train_dataset.data_loader.dataset_dir={REF / 'data'}", *sets], timeout=300)
    return run_isolated(run, args)  # a fresh interpreter: the runner forks its ranks


def _check(result, out):
    ref = json.loads((REF / "losses.json").read_text())["losses"]
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert all(m["grad_norm"] > 0 for m in metrics), metrics  # ZeRO-0 with clipping: the norm is logged too
    assert len(ref) == 20 and result["step"] == 20
    got = [result["losses"][s] for s in range(1, 21)]
    rel = [abs(g - r) / r for g, r in zip(got, ref)]
    assert max(rel) <= 1e-4, list(zip(got, ref))
    assert min(ref[-5:]) < ref[0] - 0.1  # the curve moves: the YAML's lr schedule is doing something


def test_one_process_logs_mindformers_losses(tmp_path):
    _check(_train(tmp_path / "one", 1), tmp_path / "one")


@pytest.mark.distributed
def test_dp2_tp2_logs_mindformers_losses(tmp_path):
    _check(_train(tmp_path / "dp2tp2", 4, "use_parallel=True", "parallel_config.data_parallel=2",
                  "parallel_config.model_parallel=2", "runner_config.batch_size=1"), tmp_path / "dp2tp2")
