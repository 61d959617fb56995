"""The msparallel-ds command line: plan / export / validate, exit codes 0 (ok), 2 (config error), 1 (internal)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import yaml

import msparallel_ds.cli as cli

REPO = Path(__file__).resolve().parents[1]
REAL_CONFIGS = Path(__file__).resolve().parents[2] / "shared" / "mindformers-configs"

GOOD_YAML = """\
parallel_config:
  data_parallel: 2
  model_parallel: 2
  pipeline_stage: 2
  micro_batch_num: 4
  use_seq_parallel: true
runner_config:
  batch_size: 2
model:
  model_config:
    num_layers: 4
    num_heads: 8
    n_kv_heads: 4
    hidden_size: 64
    seq_length: 128
    vocab_size: 256
    compute_dtype: bfloat16
"""

ZERO_YAML = """\
parallel_config:
  data_parallel: 4
  model_parallel: 2
runner_config:
  batch_size: 3
  gradient_accumulation_steps: 2
parallel:
  enable_parallel_optimizer: true
  parallel_optimizer_config:
    optimizer_level: level2
runner_wrapper:
  use_clip_grad: true
  max_grad_norm: 1.0
model:
  model_config:
    num_layers: 4
    num_heads: 8
    hidden_size: 64
    seq_length: 128
    vocab_size: 256
    compute_dtype: bfloat16
"""

BAD_YAML = """\
parallel_config:
  data_parallel: two
  model_parallel: 2
"""

PLAN_KEYS = {"world_size", "mesh", "global_batch_size", "micro_batch_size", "gradient_accumulation_steps",
             "micro_batch_num", "micro_batch_interleave_num", "fine_grain_interleave", "zero_stage", "cp_algo",
             "sequence_parallel", "vocab_parallel", "pp_schedule", "pp_virtual_stages", "recompute", "memory"}
MESH_KEYS = {"pp", "dp", "cp", "cp_ring", "cp_ulysses", "tp"}


@pytest.fixture
def files(tmp_path) -> dict[str, Path]:
    out = {}
    for name, text in (("good", GOOD_YAML), ("zero", ZERO_YAML), ("bad", BAD_YAML)):
        out[name] = tmp_path / f"{name}.yaml"
        out[name].write_text(text)
    return out


@pytest.fixture
def run(capsys, monkeypatch):
    """main(argv) in-process -> (exit code, stdout, stderr). main() changes global warning state; undo it."""
    def _run(*argv):
        monkeypatch.setattr(warnings, "formatwarning", warnings.formatwarning)
        with warnings.catch_warnings():
            code = cli.main([str(a) for a in argv])
        out, err = capsys.readouterr()
        return code, out, err
    return _run


def check_plan_json(d: dict) -> None:
    assert PLAN_KEYS <= set(d), PLAN_KEYS - set(d)
    mesh = d["mesh"]
    assert MESH_KEYS <= set(mesh)
    assert mesh["cp"] == mesh["cp_ring"] * mesh["cp_ulysses"]
    assert d["world_size"] == mesh["pp"] * mesh["dp"] * mesh["cp"] * mesh["tp"]
    mbi, bs = d["micro_batch_interleave_num"], d["micro_batch_size"]
    if mesh["pp"] > 1:
        assert d["global_batch_size"] == bs * mesh["dp"] * d["micro_batch_num"] * mbi
    else:
        assert d["global_batch_size"] == bs * mesh["dp"] * mbi * d["gradient_accumulation_steps"]


# --- plan ---------------------------------------------------------------------------------------------------------


def test_plan_table(run, files):
    code, out, err = run("plan", files["good"])
    assert code == 0, err
    assert "world size" in out.lower() and "8" in out
    assert "Traceback" not in err


def test_plan_json(run, files):
    code, out, err = run("plan", files["good"], "--format", "json")
    assert code == 0, err
    d = json.loads(out)  # exactly one JSON document on stdout
    assert isinstance(d, dict)
    check_plan_json(d)
    assert d["world_size"] == 8
    assert d["mesh"] == {"pp": 2, "dp": 2, "cp": 1, "cp_ring": 1, "cp_ulysses": 1, "tp": 2}
    assert d["global_batch_size"] == 2 * 2 * 4  # batch_size * dp * micro_batch_num
    assert d["micro_batch_size"] == 2
    assert d["micro_batch_num"] == 4
    assert d["gradient_accumulation_steps"] == 1
    assert d["zero_stage"] == 0
    assert d["cp_algo"] is None
    assert d["sequence_parallel"] is True
    assert d["vocab_parallel"] is True  # forced by pp > 1 with tp > 1
    assert d["pp_schedule"] == "1f1b" and d["pp_virtual_stages"] == 1
    assert d["recompute"]["mode"] == "none"
    assert d["memory"] is not None


def test_plan_json_with_matching_world_size(run, files):
    code, out, _ = run("plan", files["zero"], "--format", "json", "--world-size", "8")
    assert code == 0
    d = json.loads(out)
    check_plan_json(d)
    assert d["zero_stage"] == 2
    assert d["global_batch_size"] == 3 * 4 * 1 * 2  # batch_size * dp * mbi * gas


def test_plan_world_size_mismatch(run, files):
    code, out, err = run("plan", files["good"], "--world-size", "6")
    assert code == 2
    assert out == ""
    assert "Traceback" not in err
    assert "world_size" in err and "6" in err
    assert "2x2x1x2 = 8" in err  # names the degrees and their product


def test_plan_config_error(run, files):
    code, out, err = run("plan", files["bad"], "--format", "json")
    assert code == 2
    assert out == ""
    assert "Traceback" not in err
    assert "parallel_config.data_parallel" in err


def test_plan_missing_file(run, tmp_path):
    code, out, err = run("plan", tmp_path / "nope.yaml")
    assert code == 2 and out == "" and "Traceback" not in err
    assert "nope.yaml" in err


def test_internal_error_exits_1(run, files, monkeypatch):
    def boom(args):
        raise RuntimeError("simulated bug")

    monkeypatch.setattr(cli, "_cmd_plan", boom)
    code, out, err = run("plan", files["good"])
    assert code == 1
    assert "simulated bug" in err and "internal error" in err


# --- export -------------------------------------------------------------------------------------------------------


def test_export_deepspeed_stdout(run, files):
    code, out, err = run("export", files["zero"], "--to", "deepspeed")
    assert code == 0, err
    ds = json.loads(out)
    assert ds["train_micro_batch_size_per_gpu"] == 3
    assert ds["gradient_accumulation_steps"] == 2
    assert ds["zero_optimization"]["stage"] == 2
    assert ds["bf16"] == {"enabled": True}
    assert ds["gradient_clipping"] == 1.0


def test_export_deepspeed_to_file(run, files, tmp_path):
    target = tmp_path / "ds.json"
    code, out, err = run("export", files["good"], "--to", "deepspeed", "-o", target)
    assert code == 0, err
    assert out == ""
    ds = json.loads(target.read_text())
    assert ds["train_micro_batch_size_per_gpu"] == 2
    assert ds["gradient_accumulation_steps"] == 4  # micro_batch_num when pp > 1


def test_export_accelerate_stdout(run, files):
    code, out, err = run("export", files["good"], "--to", "accelerate")
    assert code == 0, err
    assert out.startswith("#")
    cfg = yaml.safe_load(out)
    assert cfg["distributed_type"] == "DEEPSPEED"
    assert cfg["num_processes"] == 8
    assert cfg["mixed_precision"] == "bf16"
    assert cfg["deepspeed_config"]["zero_stage"] == 0


def test_export_config_error(run, files, tmp_path):
    target = tmp_path / "never.json"
    code, out, err = run("export", files["bad"], "--to", "deepspeed", "-o", target)
    assert code == 2 and out == "" and "Traceback" not in err
    assert not target.exists()


def test_export_world_size_mismatch(run, files):
    code, out, err = run("export", files["good"], "--to", "accelerate", "--world-size", "16")
    assert code == 2 and out == "" and "Traceback" not in err


# --- validate -----------------------------------------------------------------------------------------------------


def test_validate_all_good(run, files):
    code, out, err = run("validate", files["good"], files["zero"])
    assert code == 0, err
    lines = out.strip().splitlines()
    assert len(lines) == 2
    assert all(line.startswith("ok") for line in lines)
    assert str(files["good"]) in lines[0] and str(files["zero"]) in lines[1]


def test_validate_one_bad(run, files, tmp_path):
    missing = tmp_path / "missing.yaml"
    code, out, err = run("validate", files["good"], files["bad"], missing, files["zero"])
    assert code == 2
    lines = out.strip().splitlines()
    assert len(lines) == 4
    assert [line.split()[0] for line in lines] == ["ok", "error", "error", "ok"]
    assert "parallel_config.data_parallel" in lines[1]
    assert "Traceback" not in out + err


def test_validate_world_size(run, files):
    code, out, _ = run("validate", files["good"], files["zero"], "--world-size", "8")
    assert code == 0 and len(out.strip().splitlines()) == 2


# --- as a real process --------------------------------------------------------------------------------------------


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def test_subprocess_module(files):
    proc = subprocess.run([sys.executable, "-m", "msparallel_ds.cli", "plan", str(files["good"]), "--format",
                           "json"], capture_output=True, text=True, env=_env(), timeout=120)
    assert proc.returncode == 0, proc.stderr
    check_plan_json(json.loads(proc.stdout))  # warnings never pollute stdout
    assert "warning: parallel_config.vocab_emb_dp" in proc.stderr  # pp > 1 with tp > 1 forces vocab parallel
    bad = subprocess.run([sys.executable, "-m", "msparallel_ds.cli", "plan", str(files["good"]), "--world-size",
                          "3"], capture_output=True, text=True, env=_env(), timeout=120)
    assert bad.returncode == 2 and bad.stdout == ""
    assert "Traceback" not in bad.stderr and "= 8" in bad.stderr


def test_console_script(files):
    exe = shutil.which("msparallel-ds")
    if exe is None:
        pytest.skip("the msparallel-ds console script is not on PATH (package not installed)")
    proc = subprocess.run([exe, "validate", str(files["good"]), str(files["bad"])], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2
    assert [line.split()[0] for line in proc.stdout.strip().splitlines()] == ["ok", "error"]


# --- real MindFormers configs -------------------------------------------------------------------------------------


def _real_configs() -> list[Path]:
    return sorted(REAL_CONFIGS.glob("*.yaml")) if REAL_CONFIGS.is_dir() else []


@pytest.mark.skipif(not REAL_CONFIGS.is_dir(), reason=f"{REAL_CONFIGS} not present (shared MindFormers configs)")
def test_plan_json_real_llama2_70b(run):
    path = REAL_CONFIGS / "llama2__pretrain_llama2_70b.yaml"
    if not path.exists():
        pytest.skip(f"{path.name} not in {REAL_CONFIGS}")
    code, out, err = run("plan", path, "--format", "json")
    assert code == 0, err
    d = json.loads(out)
    check_plan_json(d)
    assert d["mesh"]["pp"] == 8 and d["mesh"]["dp"] == 2 and d["mesh"]["tp"] == 4
    assert d["world_size"] == 64
    assert d["global_batch_size"] == 1 * 2 * 128 * 1  # batch_size * dp * micro_batch_num * mbi


@pytest.mark.skipif(not REAL_CONFIGS.is_dir(), reason=f"{REAL_CONFIGS} not present (shared MindFormers configs)")
@pytest.mark.parametrize("path", _real_configs(), ids=lambda p: p.name)
def test_plan_json_every_real_config(run, path):
    code, out, err = run("plan", path, "--format", "json")
    assert "Traceback" not in err
    if code == 2:  # a documented refusal (e.g. an unsupported pipeline scheduler), never a crash
        assert out == ""
        assert any(line.startswith("error: invalid configuration") for line in err.splitlines())
        return
    assert code == 0, err
    check_plan_json(json.loads(out))


def test_validate_names_the_file_of_each_warning(run, tmp_path):
    warns = tmp_path / "warns.yaml"
    warns.write_text("parallel_config: {model_parallel: 2, pipeline_stage: 2, micro_batch_num: 2, "
                     "vocab_emb_dp: true}\n")
    quiet = tmp_path / "quiet.yaml"
    quiet.write_text("parallel_config: {data_parallel: 2}\n")
    code, out, err = run("validate", warns, quiet)
    assert code == 0, err
    assert [line.split()[0] for line in out.strip().splitlines()] == ["ok", "ok"]
    assert f"warning: {warns}: parallel_config.vocab_emb_dp" in err and str(quiet) not in err
