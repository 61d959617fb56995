"""Pictures of a plan (msparallel_ds.draw): `plan --draw DIR` writes three readable PNGs, and the schedule table
behind schedule.png is the schedule torch runs (order facts, bubble = theory)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")
import matplotlib.image as mpimg  # noqa: E402
import yaml  # noqa: E402

from msparallel_ds.config.mindformers import load_config  # noqa: E402
from msparallel_ds.draw import draw_plan, schedule_table  # noqa: E402
from msparallel_ds.draw.mesh import rank_grid  # noqa: E402
from msparallel_ds.memory import parse_memory_gib  # noqa: E402
from msparallel_ds.plan import make_plan  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "msparallel_ds" / "data" / "demo.yaml"
PP2 = ROOT / "configs" / "tiny_pp2.yaml"  # pp 2 x tp 2, interleaved 1F1B, 2 chunks, 4 micro-batches


def _pp8_interleaved(tmp_path: Path) -> Path:
    """8 stages x 2 virtual chunks, 16 micro-batches, model shape known, device memory in context."""
    cfg = {"context": {"max_device_memory": "58GB"},
           "parallel_config": {"data_parallel": 1, "model_parallel": 1, "pipeline_stage": 8, "micro_batch_num": 16},
           "parallel": {"parallel_mode": 1, "pipeline_config": {"pipeline_interleave": True,
                                                                "pipeline_scheduler": "1f1b"}},
           "runner_config": {"batch_size": 1},
           "model": {"model_config": {"num_layers": 16, "pp_interleave_num": 2, "num_heads": 8, "hidden_size": 512,
                                      "seq_length": 256, "vocab_size": 1000}}}
    path = tmp_path / "pp8_interleaved.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "msparallel_ds.cli", "plan", *args], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=300)


def _check_png(path: Path) -> None:
    img = mpimg.imread(path)
    assert img.ndim == 3 and img.shape[2] in (3, 4), img.shape
    assert img.shape[0] > 200 and img.shape[1] > 200, img.shape
    assert img[..., :3].std() > 0, f"{path} is blank"


def _theory(p: int, m: int, v: int = 1) -> float:
    return (p - 1) / (v * m + p - 1)


@pytest.mark.parametrize("which", ["demo", "pp2", "pp8"])
def test_cli_draw_writes_three_pngs(tmp_path, which):
    path = {"demo": DEMO, "pp2": PP2, "pp8": None}[which] or _pp8_interleaved(tmp_path)
    out = tmp_path / "pics" / "nested"  # created by --draw
    res = _cli(str(path), "--draw", str(out))
    assert res.returncode == 0, res.stderr
    for name in ("mesh", "schedule", "memory"):
        png = out / f"{name}.png"
        assert f"wrote {name}: {png}" in res.stdout
        _check_png(png)
    bubble = float(re.search(r"bubble fraction ([0-9.]+)", res.stdout).group(1))
    plan = make_plan(load_config(path))
    p, m, v = plan.mesh.pp, plan.micro_batch_num, plan.pp_virtual_stages
    assert bubble == pytest.approx(0.0 if p == 1 else _theory(p, m, v), abs=1e-6)


def test_cli_draw_json_keeps_stdout_json(tmp_path):
    import json

    res = _cli(str(PP2), "--format", "json", "--draw", str(tmp_path))
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["mesh"]["pp"] == 2
    assert "wrote schedule" in res.stderr


@pytest.mark.parametrize("name", ["1f1b", "gpipe"])
@pytest.mark.parametrize("p,m", [(2, 4), (4, 4), (4, 8), (8, 128), (3, 7)])
def test_single_chunk_bubble_matches_theory_and_order(name, p, m):
    plan = make_plan(load_config({
        "parallel_config": {"pipeline_stage": p, "micro_batch_num": m},
        "parallel": {"pipeline_config": {"pipeline_scheduler": name}},
        "model": {"model_config": {"num_layers": 2 * p}}}))
    t = schedule_table(plan)
    assert (t.name, t.pp, t.micro_batches) == (name, p, m)
    assert t.bubble == pytest.approx(_theory(p, m))
    assert t.makespan == 2 * (m + p - 1)
    _check_order(t)
    if name == "1f1b":  # at most pp - rank micro-batches in flight on rank r (1F1B's memory bound)
        for r, acts in t.actions.items():
            live = peak = 0
            for _, kind, _ in acts:
                live += 1 if kind == "F" else -1
                peak = max(peak, live)
            assert peak == min(m, p - r)


def _check_order(t) -> None:
    """Each action exactly once; forward of stage s after stage s-1; backward after stage s+1's (reverse order)."""
    end = {}
    for r, blocks in t.blocks.items():
        assert [(b.stage, b.kind, b.microbatch) for b in blocks] == t.actions[r]  # timed in torch's order
        for a, b in zip(blocks, blocks[1:]):
            assert b.start >= a.end  # one thing at a time per rank
        for b in blocks:
            assert (b.stage, b.kind, b.microbatch) not in end
            end[(b.stage, b.kind, b.microbatch)] = (b.start, b.end)
    grad = "I" if any(k == "I" for _, k, _ in end) else "B"
    for mb in range(t.micro_batches):
        for s in range(t.n_stages):
            assert (s, "F", mb) in end and (s, grad, mb) in end
            if s:
                assert end[(s, "F", mb)][0] >= end[(s - 1, "F", mb)][1]
            if s < t.n_stages - 1:
                assert end[(s, grad, mb)][0] >= end[(s + 1, grad, mb)][1]
            assert end[(s, grad, mb)][0] >= end[(s, "F", mb)][1]
            if grad == "I":
                assert end[(s, "W", mb)][0] >= end[(s, "I", mb)][1]


def test_interleaved_table(tmp_path):
    plan = make_plan(load_config(_pp8_interleaved(tmp_path)))
    t = schedule_table(plan)
    assert (t.name, t.pp, t.n_stages, t.micro_batches) == ("interleaved_1f1b", 8, 16, 16)
    assert t.bubble == pytest.approx(_theory(8, 16, 2))  # (p-1)/(v*m+p-1) for interleaved 1F1B
    _check_order(t)
    for r, acts in t.actions.items():  # looped placement: rank r holds stages r and r + pp
        assert {s for s, _, _ in acts} == {r, r + 8}


def test_zero_bubble_v_table():
    plan = make_plan(load_config({
        "parallel_config": {"pipeline_stage": 4, "micro_batch_num": 8},
        "parallel": {"pipeline_config": {"pipeline_scheduler": "zero_bubble_v", "pipeline_interleave": True}},
        "model": {"model_config": {"num_layers": 16, "pp_interleave_num": 2}}}))
    t = schedule_table(plan)
    _check_order(t)
    for r, acts in t.actions.items():  # V placement
        assert {s for s, _, _ in acts} == {r, 7 - r}
    assert t.bubble < _theory(4, 8, 2)  # W fills the bubble


def test_no_pipeline_table():
    t = schedule_table(make_plan(load_config(DEMO)))
    assert t.pp == 1 and t.bubble == 0 and t.actions[0][:2] == [(0, "F", 0), (0, "B", 0)]


def test_mesh_order_is_design_order(tmp_path):
    plan = make_plan(load_config({"parallel_config": {"data_parallel": 2, "model_parallel": 2,
                                                      "context_parallel": 4, "pipeline_stage": 2,
                                                      "micro_batch_num": 2, "context_parallel_algo": "hybrid_cp",
                                                      "ulysses_degree_in_cp": 2}}))
    g, m = rank_grid(plan), plan.mesh
    assert (m.cp_ring, m.cp_ulysses) == (2, 2)
    for p in range(m.pp):
        for d in range(m.dp):
            for r in range(m.cp_ring):
                for u in range(m.cp_ulysses):
                    for t in range(m.tp):
                        assert int(g[p, d, r, u, t]) == (((p * m.dp + d) * m.cp_ring + r) * m.cp_ulysses + u) * m.tp + t
    paths = draw_plan(plan, tmp_path)
    assert set(paths) == {"mesh", "schedule", "memory"}
    for path in paths.values():
        _check_png(path)  # the memory picture says "no memory estimate" instead of failing


def test_large_world_is_sliced(tmp_path):
    plan = make_plan(load_config(ROOT / "configs" / "llama3_70b_pretrain_128p.yaml"))
    assert plan.world_size > 64
    paths = draw_plan(plan, tmp_path, device_memory_gib=64)
    for path in paths.values():
        _check_png(path)


def test_parse_memory():
    assert parse_memory_gib("58GB") == 58
    assert parse_memory_gib("1024MB") == 1
    assert parse_memory_gib(" 59.5 gb ") == 59.5
    assert parse_memory_gib("lots") is None and parse_memory_gib(0) is None


def test_without_matplotlib_is_a_clear_error(tmp_path):
    code = ("import sys; sys.modules['matplotlib'] = None; from msparallel_ds.cli import main; "
            f"sys.exit(main(['plan', {str(DEMO)!r}, '--draw', {str(tmp_path)!r}]))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert res.returncode == 2
    assert "pip install msparallel-ds[plot]" in res.stderr and "Traceback" not in res.stderr
    assert not list(tmp_path.iterdir())
