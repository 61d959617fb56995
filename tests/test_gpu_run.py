"""benchmarks/gpu/run.sh (the one-call GPU run) end to end on a machine without CUDA: every stage writes its JSON,
the GPU stages say "skipped: no CUDA", the environment stage runs, and the summary names every stage.

On a CUDA machine this test skips: there run.sh does the real GPU work (minutes); run it directly.
"""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks" / "gpu"))
from stages import STAGES  # noqa: E402

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA here: run.sh would run the real GPU stages")


@pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None, reason="needs bash and timeout")
def test_run_sh_dry_run_without_cuda(tmp_path):
    out = tmp_path / "out"
    env = dict(os.environ, PYTHON=sys.executable, MSP_GPU_WHEELS=str(tmp_path / "no_wheels"),
               MSP_GPU_SITE=str(tmp_path / "site"), PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu" / "run.sh"), str(out)], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=180, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for name in STAGES:
        doc = json.loads((out / f"{name}.json").read_text())
        assert doc["stage"] == name
        assert (out / f"{name}.log").is_file()
        if name == "1_env":
            assert doc["status"] == "ok", (out / "1_env.log").read_text()[-3000:]
            env_rep = doc["results"]["data"]
            assert env_rep["torch"] == torch.__version__ and env_rep["cuda_available"] is False
            assert env_rep["import_errors"] == [] and "msparallel_ds" in env_rep["packages"]
        else:
            assert doc["status"].startswith("skipped: no CUDA"), (name, doc["status"])
    summary = json.loads((out / "summary.json").read_text())
    assert list(summary) == list(STAGES)
    assert "5_train_step" in proc.stdout and "skipped: no CUDA" in proc.stdout


def test_stage_json_embeds_results_and_junit(tmp_path):
    """stages.py: a stage's own result JSON and JUnit counts land in its status JSON, and the summary's table line
    reads them; a timeout's rc shows as such."""
    import stages

    (tmp_path / "3_gpu_tests.junit.xml").write_text(
        '<testsuites><testsuite tests="3" failures="1" errors="0" skipped="1" time="1.5">'
        '<testcase classname="t" name="a"/><testcase classname="t" name="b"><failure message="boom"/></testcase>'
        '<testcase classname="t" name="c"><skipped/></testcase></testsuite></testsuites>')
    assert stages.main(["write", str(tmp_path), "3_gpu_tests", "--status", "failed (rc=1)", "--rc", "1"]) == 0
    doc = json.loads((tmp_path / "3_gpu_tests.json").read_text())
    j = doc["results"]["junit"]
    assert (j["tests"], j["passed"], j["failures"], j["skipped"]) == (3, 1, 1, 1) and "boom" in j["first_failures"][0]
    (tmp_path / "5_train_step.result.json").write_text(json.dumps(
        {"variants": {"msp_off": {"status": "ok", "tokens_per_s": 1234.0, "mfu": 0.41},
                      "ds_off": {"status": "timeout"}}}))
    stages.main(["write", str(tmp_path), "5_train_step", "--status", "ok", "--rc", "0"])
    line = stages._headline(json.loads((tmp_path / "5_train_step.json").read_text()))
    assert "msp_off 1234 tok/s mfu 0.41" in line and "ds_off timeout" in line
    assert stages.main(["summary", str(tmp_path)]) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["0_install_wheels"]["status"].startswith("missing")
