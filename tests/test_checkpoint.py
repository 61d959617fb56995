"""engine.save / engine.load: a run resumed from a checkpoint takes the same steps as the uninterrupted run, under
the same layout, under another layout (tp2 x cp2 -> dp2 x tp2, dp2 x tp2 ZeRO-2 -> tp4 + SP), in one process, and
from the offline conversion (msparallel-ds convert-checkpoint) for dp2 x tp2. Broken or missing files are clear
errors and a failed save leaves the previous checkpoint intact."""
import os
import subprocess
import sys

import pytest
from engine_cases import global_batch, tiny_config, tiny_model
from harness import run_distributed

pytestmark = pytest.mark.distributed

ROWS = 4  # global batch rows (tiny_config bs per dp rank = 4 / dp)
LAYOUTS = {
    "tp2xcp2": dict(tp=2, cp=2, ring=True, sp=True, bs=4),
    "dp2xtp2_zero2": dict(dp=2, tp=2, zero=2, bs=2),
    "dp2xtp2": dict(dp=2, tp=2, sp=True, vocab_dp=False, bs=2),
    "tp4_sp": dict(tp=4, sp=True, bs=4),
    "one": dict(bs=4, zero=0),
}


def _engine(name):
    import torch

    import msparallel_ds as msp

    return msp.initialize(tiny_model(), msp.load_config(tiny_config(**LAYOUTS[name])),
                          optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1))


def _steps(engine, first, last):
    lay = engine.layout
    rows, d = ROWS // lay.size("dp"), lay.rank("dp")
    out = []
    for step in range(first, last):
        ids, labels = global_batch(step, ROWS)
        out.append(engine.train_batch({"input_ids": ids[d * rows:(d + 1) * rows],
                                       "labels": labels[d * rows:(d + 1) * rows]}).item())
    return out


def _uninterrupted_and_save(rank, world, name, ckpt):
    engine = _engine(name)
    first = _steps(engine, 0, 2)
    engine.save(ckpt, sharded=False)  # the single file (convert-checkpoint's source); sharded: test_checkpoint_sharded
    return first + _steps(engine, 2, 4)


def _resume(rank, world, runs):
    out = {}
    for key, name, ckpt in runs:  # several layouts, one after another, in the same processes
        engine = _engine(name)
        try:
            info = engine.load(ckpt)
        except ValueError as e:
            out[key] = str(e)
            continue
        out[key] = (_steps(engine, 2, 4), info)
    return out


def _yaml_file(path, name):
    import yaml

    path.write_text(yaml.safe_dump(tiny_config(**LAYOUTS[name])))
    return str(path)


def test_resume_equals_uninterrupted_under_any_layout(tmp_path):
    """Saved from tp2 x cp2 (ring, SP, ZeRO-1); resumed there, in dp2 x tp2 (vocab parallel), dp2 x tp2 ZeRO-2,
    tp4 + SP (kv heads replicated) and in one process."""
    ckpt, conv = str(tmp_path / "ckpt"), str(tmp_path / "conv")
    full = run_distributed(_uninterrupted_and_save, 4, "tp2xcp2", ckpt, timeout=300)[0]
    assert abs(full[3] - full[2]) > 1e-3  # the steps really move the loss
    cli = subprocess.run([sys.executable, "-m", "msparallel_ds.cli", "convert-checkpoint", ckpt, conv, "--to-config",
                          _yaml_file(tmp_path / "dp2xtp2.yaml", "dp2xtp2")], capture_output=True, text=True,
                         timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert cli.returncode == 0, cli.stdout + cli.stderr
    assert sorted(os.listdir(conv)) == ["msp_shard_pp000_tp000.pt", "msp_shard_pp000_tp001.pt", "msp_sharded.json"]
    runs = [(n, n, ckpt) for n in ("tp2xcp2", "dp2xtp2", "dp2xtp2_zero2", "tp4_sp")]
    runs += [("dp2xtp2 from convert-checkpoint", "dp2xtp2", conv), ("tp4 from the dp2xtp2 conversion", "tp4_sp", conv)]
    resumed = run_distributed(_resume, 4, runs, timeout=300)[0]
    resumed.update(run_distributed(_resume, 1, [("one", "one", ckpt)], timeout=300)[0])
    wrong = resumed.pop("tp4 from the dp2xtp2 conversion")
    assert "model_parallel=2" in wrong and "convert-checkpoint" in wrong, wrong
    for name, (losses, info) in resumed.items():
        assert info["global_steps"] == 2 and info["optimizer_step"] == 2, (name, info)
        assert max(abs(a - b) / b for a, b in zip(losses, full[2:])) <= 1e-5, (name, losses, full)


def test_missing_or_broken_checkpoint_is_a_clear_error(tmp_path):
    from types import SimpleNamespace

    from msparallel_ds.checkpoint import FILE, load_checkpoint

    engine = SimpleNamespace(ds=None, layout=None)
    with pytest.raises(FileNotFoundError, match="no msparallel_ds checkpoint"):
        load_checkpoint(engine, str(tmp_path))
    (tmp_path / FILE).write_bytes(b"PK\x03\x04 truncated")
    with pytest.raises(ValueError, match="not a readable msparallel_ds checkpoint.*truncated"):
        load_checkpoint(engine, str(tmp_path))


def test_failed_save_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    import torch

    from msparallel_ds import checkpoint

    path = str(tmp_path / checkpoint.FILE)
    checkpoint.atomic_save({"format": checkpoint.FORMAT, "step": 1}, path)

    def dies_halfway(obj, f):
        f.write(b"PK\x03\x04 half a file")
        raise KeyboardInterrupt  # a kill while writing

    monkeypatch.setattr(torch, "save", dies_halfway)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.atomic_save({"format": checkpoint.FORMAT, "step": 2}, path)
    monkeypatch.undo()
    assert checkpoint.read_checkpoint_file(path, checkpoint.FORMAT)["step"] == 1
    assert os.listdir(tmp_path) == [checkpoint.FILE]  # no temporary file left behind


def test_convert_checkpoint_errors_before_starting(tmp_path):
    from msparallel_ds.cli import main

    assert main(["convert-checkpoint", str(tmp_path / "nothing"), str(tmp_path / "out"), "--to-config",
                 _yaml_file(tmp_path / "c.yaml", "dp2xtp2")]) == 2
    assert not (tmp_path / "out").exists()
