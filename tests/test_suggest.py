"""msparallel-ds suggest: the search keeps only layouts MindFormers' rules accept and that fit in memory, the cost
model moves the right way when a figure changes, and the CLI writes a YAML that `validate` accepts."""
from __future__ import annotations

import os
import subprocess
import sys
import warnings
from dataclasses import replace
from pathlib import Path

import pytest

from msparallel_ds.config.errors import ConfigError
from msparallel_ds.config.mindformers import load_config
from msparallel_ds.plan import make_plan
from msparallel_ds.suggest import Layout, Links, read_model, search
from msparallel_ds.suggest.search import evaluate

REPO = Path(__file__).resolve().parents[1]
GIB = 2**30
LLAMA3_70B = {"num_hidden_layers": 80, "hidden_size": 8192, "num_attention_heads": 64, "num_key_value_heads": 8,
              "intermediate_size": 28672, "vocab_size": 128256}
TINY = {"num_hidden_layers": 4, "hidden_size": 256, "num_attention_heads": 8, "num_key_value_heads": 4,
        "intermediate_size": 512, "vocab_size": 1024}


@pytest.fixture(scope="module")
def llama70b():
    spec = read_model(LLAMA3_70B, seq_length=4096, global_batch=512)
    return search(spec, 64, 80 * GIB, Links())


def _plan(y, world):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return make_plan(load_config(y), world_size=world)


def test_llama70b_on_64_devices(llama70b):
    res = llama70b
    assert res.candidates and res.counts["kept"] == len(res.candidates)
    assert res.counts["enumerated"] == res.counts["invalid_by_rule"] + res.counts["over_memory"] + res.counts["kept"]
    assert res.counts["over_memory"] > 0  # 70B does not fit everywhere on 80 GiB
    best = res.candidates[0]
    plan = _plan(best.yaml(), 64)  # the written YAML validates as is
    assert plan.world_size == 64 and plan.global_batch_size == 512
    assert plan.memory.total_gib < 80 * 0.9
    assert plan.mesh.tp <= 8  # tensor parallel stays inside a node
    times = [c.step_time for c in res.candidates]
    assert times == sorted(times)
    # compute alone: 6 * params * tokens / (world * F) is a floor under every prediction
    tokens = 512 * 4096
    floor = 6 * 69e9 * tokens / (64 * 400e12 * 0.4)
    assert best.step_time > floor


def test_more_inter_node_bandwidth_never_slows_a_layout(llama70b):
    slow, fast = Links(inter_bw=12.5e9), Links(inter_bw=100e9)
    for cand in llama70b.candidates[:40:3] + llama70b.candidates[-40::7]:
        a = evaluate(cand.spec, cand.layout, 64, slow, plan=cand.plan).step_time
        b = evaluate(cand.spec, cand.layout, 64, fast, plan=cand.plan).step_time
        assert b <= a * (1 + 1e-12), cand.label


def test_doubling_the_global_batch_doubles_compute():
    lay = Layout(dp=2, tp=2, cp=1, pp=1, sp=True, micro_batch=1, micro_batches=4)
    one = evaluate(read_model(TINY, 128, 8), lay, 4, Links())
    two = evaluate(read_model(TINY, 128, 16), replace(lay, micro_batches=8), 4, Links())
    assert two.costs["compute"] == pytest.approx(2 * one.costs["compute"], rel=1e-9)
    assert two.step_time == pytest.approx(2 * one.step_time, rel=0.05)


@pytest.mark.parametrize("m", [2, 4, 16])
def test_1f1b_bubble_share(m):
    p = 2
    lay = Layout(dp=2, tp=1, cp=1, pp=p, schedule="1f1b", micro_batch=1, micro_batches=m)
    c = evaluate(read_model(TINY, 128, 2 * m), lay, 4, Links()).costs
    assert c["tp"] == c["cp"] == c["ep"] == 0
    assert c["bubble"] / (c["compute"] + c["bubble"]) == pytest.approx((p - 1) / (m + p - 1))
    v2 = evaluate(read_model(TINY, 128, 2 * m), replace(lay, vpp=2), 4, Links()).costs
    assert v2["bubble"] == pytest.approx(c["bubble"] / 2)  # interleaving divides the bubble by v


def test_layouts_over_memory_are_dropped():
    spec = read_model(TINY, 128, 8)
    everything = search(spec, 4, 1 * GIB, Links())
    limit = sorted(c.memory_gib for c in everything.candidates)[len(everything.candidates) // 2]
    res = search(spec, 4, limit * GIB, Links(), headroom=1.0)
    assert res.counts["over_memory"] > 0 and res.candidates
    assert all(c.memory_gib <= limit for c in res.candidates)
    assert not search(spec, 4, 1e-6 * GIB, Links()).candidates


def test_layouts_mindformers_rejects_are_never_suggested():
    spec = read_model({**TINY, "num_attention_heads": 6, "num_key_value_heads": 6, "hidden_size": 192}, 128, 8)
    res = search(spec, 4, GIB, Links())
    assert res.candidates and all(c.layout.tp in (1, 2) for c in res.candidates)  # 6 heads: no tp 4
    with pytest.raises(ConfigError, match="num_heads"):
        evaluate(spec, Layout(dp=1, tp=4, cp=1, pp=1), 4, Links())
    for c in res.candidates:  # every kept one validates as written
        _plan(c.yaml(), 4)


def test_moe_searches_expert_parallel_under_the_moe_rules():
    moe = {**TINY, "num_local_experts": 4, "num_experts_per_tok": 2}
    res = search(read_model(moe, 128, 8), 4, GIB, Links())
    eps = {c.layout.ep for c in res.candidates}
    assert eps >= {1, 2, 4}
    # MindFormers (tools/check_rules.py) needs sequence parallel for a MoE model with model_parallel > 1
    assert res.counts["invalid_by_rule"] > 0
    assert not [c for c in res.candidates if c.layout.tp > 1 and not c.layout.sp]
    assert any(c.costs["ep"] > 0 for c in res.candidates)


def test_cli_suggest_writes_a_yaml_that_validates(tmp_path):
    (tmp_path / "config.json").write_text(__import__("json").dumps(TINY))
    out = tmp_path / "best.yaml"
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    run = [sys.executable, "-m", "msparallel_ds.cli"]
    proc = subprocess.run(run + ["suggest", "--model", str(tmp_path / "config.json"), "--world-size", "4",
                                 "--device-memory", "2GiB", "--seq-length", "128", "--global-batch-size", "8",
                                 "--top", "3", "-o", str(out)], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "enumerated" in proc.stdout and " 1 pp" in proc.stdout
    assert out.read_text().startswith("# Written by `msparallel-ds suggest`")
    check = subprocess.run(run + ["validate", str(out), "--world-size", "4"], capture_output=True, text=True,
                           env=env, timeout=120)
    assert check.returncode == 0 and check.stdout.startswith("ok"), check.stdout + check.stderr


def test_shared_cores_bubble_is_the_longer_of_path_and_total_work():
    """Ranks that share K cores (a CPU run): a waiting rank's core goes to the others, so the step is the longer of
    the busiest rank's path at a whole core (K/world x busy x (1 + f)) and the total work; with own devices
    (shared_cores 0) the whole bubble counts."""
    spec = read_model(TINY, 128, 8)
    lay = Layout(dp=1, tp=1, cp=1, pp=4, schedule="gpipe", micro_batch=2, micro_batches=4)
    own = evaluate(spec, lay, 4, Links()).costs
    busy = own["compute"] + own["tp"] + own["cp"] + own["ep"]
    assert own["bubble"] == pytest.approx(3 / 4 * busy)  # (p - 1) / m
    for cores, share in ((2, 2 / 4), (3, 3 / 4)):  # the path is 0.875 x the total work: hidden; 1.31 x: not
        shared = evaluate(spec, lay, 4, Links(shared_cores=cores)).costs
        work = shared["compute"] + shared["tp"] + shared["cp"] + shared["ep"]
        assert work < busy  # the stages' mean work (the head is on the last stage only), not the busiest's
        assert shared["bubble"] == pytest.approx(max(0.0, share * work * (1 + 3 / 4) - work))
    assert shared["bubble"] > 0


def test_auto_parallel_yaml_runs_what_suggest_chooses(tmp_path):
    """parallel_mode: 2 (MindSpore's auto_parallel): `plan` takes suggest's best layout, says so, and ignores the
    hand-written degrees."""
    import yaml

    from msparallel_ds.suggest.search import resolve_auto_parallel

    spec = read_model(TINY, 128, 8)
    raw = dict(spec.base)
    raw["parallel"] = {"parallel_mode": 2}
    raw["parallel_config"] = {"data_parallel": 1, "model_parallel": 4}
    path = tmp_path / "auto.yaml"
    path.write_text(yaml.safe_dump(raw))
    chosen, note = resolve_auto_parallel(raw, 4, 2 * GIB)
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "msparallel_ds.cli", "plan", str(path), "--world-size", "4",
                           "--device-memory", "2", "--format", "json"], capture_output=True, text=True, env=env,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "suggest chose" in proc.stderr and "not used" in proc.stderr, proc.stderr
    mesh = __import__("json").loads(proc.stdout)["mesh"]
    pc = chosen["parallel_config"]
    assert (mesh["dp"], mesh["tp"], mesh["pp"]) == (pc["data_parallel"], pc["model_parallel"], pc["pipeline_stage"])
    assert note.split("chose ")[1].split(" out of")[0] in proc.stderr


def test_auto_parallel_keeps_the_pipeline_and_batch():
    """parallel_mode: 2 searches operator sharding only (MindSpore's auto_parallel; the pipeline comes from the
    parallel context as written, core/context/parallel.py:46-57 pipeline_stages): pipeline_stage, the scheduler,
    micro_batch_num, micro_batch_interleave_num and the global batch stay the YAML's, dp / tp are searched."""
    from msparallel_ds.suggest.search import resolve_auto_parallel

    raw = dict(read_model(TINY, 128, 8).base)
    raw["parallel"] = {"parallel_mode": 2, "pipeline_config": {"pipeline_interleave": False,
                                                              "pipeline_scheduler": "gpipe"}}
    raw["parallel_config"] = {"data_parallel": 1, "model_parallel": 2, "pipeline_stage": 2, "micro_batch_num": 4}
    raw["runner_config"] = {"batch_size": 2}
    raw["model"]["model_config"]["offset"] = [1, -1]
    chosen, note = resolve_auto_parallel(raw, 4, 2 * GIB)
    pc = chosen["parallel_config"]
    assert (pc["pipeline_stage"], pc["micro_batch_num"], chosen["micro_batch_interleave_num"]) == (2, 4, 1)
    assert chosen["parallel"]["pipeline_config"] == raw["parallel"]["pipeline_config"]
    assert chosen["model"]["model_config"]["offset"] == [1, -1]
    plan = _plan(chosen, 4)
    assert plan.global_batch_size == 8 and plan.mesh.pp == 2 and "gpipe" in plan.pp_schedule.lower()
    assert "keeping the YAML's pipeline_stage=2, gpipe x1, micro_batch_num=4" in note
    with pytest.raises(ConfigError, match="with the YAML's pipeline_stage=2, gpipe x1, micro_batch_num=4"):
        resolve_auto_parallel(raw, 4, 0.001 * GIB)  # nothing fits: the error names what was kept
