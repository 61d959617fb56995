"""Hostile input: load_config / make_plan raise ConfigError and nothing else, quickly, for ANY input.

Every ConfigError must carry at least one issue and a non-empty message, and the issue's key must name the
YAML key path of the offending value.
"""
from __future__ import annotations

import copy
import json
import math
import os
import pathlib
import subprocess
import sys
import textwrap
import time

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import msparallel_ds as msp
from msparallel_ds.config import ConfigWarning, schema
from msparallel_ds.config.mindformers import MODEL_ALIASES, PARALLELISM_FIELDS

pytestmark = pytest.mark.filterwarnings("ignore::msparallel_ds.config.errors.ConfigWarning")

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# --------------------------------------------------------------------------------------------------------------
# helpers


def check_outcome(fn, *args, **kwargs):
    """Call fn; return its result or the ConfigError. Any other exception fails the test."""
    try:
        return fn(*args, **kwargs)
    except msp.ConfigError as exc:
        assert exc.issues, "ConfigError without issues"
        assert str(exc).strip(), "ConfigError with an empty message"
        for issue in exc.issues:
            str(issue)  # every issue renders
        return exc


def check_load_and_plan(source):
    """load_config and make_plan give a ParallelConfig/Plan or a ConfigError; accepted plans also export."""
    cfg = check_outcome(msp.load_config, source)
    assert isinstance(cfg, (msp.ParallelConfig, msp.ConfigError)), type(cfg)
    plan = check_outcome(msp.make_plan, source)
    assert isinstance(plan, (msp.Plan, msp.ConfigError)), type(plan)
    if isinstance(cfg, msp.ConfigError):
        assert isinstance(plan, msp.ConfigError), "make_plan accepted what load_config rejected"
    if isinstance(plan, msp.Plan):
        assert plan.world_size == math.prod(plan.mesh.shape)
        plan.to_json()
        plan.to_deepspeed()
        plan.to_accelerate()
    return cfg


def issues_of(source, **kwargs) -> list:
    with pytest.raises(msp.ConfigError) as info:
        msp.make_plan(source, **kwargs)
    assert info.value.issues and str(info.value).strip()
    return info.value.issues


# --------------------------------------------------------------------------------------------------------------
# strategies

NASTY_INTS = st.sampled_from([0, 1, 2, 3, 4, 8, -1, -3, 10**30, -10**30, 2**63, 2**1000, 1 << 20, (1 << 20) + 1])
NASTY_STRINGS = st.sampled_from(["", "two", "level1", "level3", "hybird_cp", "hybrid_cp", "ulysses_cp",
                                 "bfloat16", "BF16", "fp32", "1f1b", "seqpipe", "zero_bubble_v", "true", "8",
                                 "DynamicLossScaleUpdateCell", "data_parallel", "../../etc/passwd", "\x00", "é"])
LEAVES = (st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70) | NASTY_INTS
          | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=12) | NASTY_STRINGS)
KEYS = st.text(max_size=8) | NASTY_STRINGS | st.none() | st.booleans() | st.integers(-5, 5) | st.floats(-2, 2)
TREES = st.recursive(LEAVES, lambda inner: st.lists(inner, max_size=4)
                     | st.dictionaries(KEYS, inner, max_size=4), max_leaves=16)

BASE_GOOD = {
    "parallel_config": {"data_parallel": 2, "model_parallel": 2, "pipeline_stage": 2, "micro_batch_num": 4,
                        "use_seq_parallel": True},
    "model": {"model_config": {"num_layers": 4, "num_heads": 8, "n_kv_heads": 4, "hidden_size": 64,
                               "seq_length": 128, "vocab_size": 256}},
}
BASES = st.sampled_from([{}, BASE_GOOD])

# section path -> the keys its validators read (from schema.py / the front-end's alias tables)
_MODEL_KEYS = sorted({s for spellings in MODEL_ALIASES.values() for s in spellings} | {"multi_query_attention"})
SECTIONS: dict[str, list[str]] = {
    "parallel_config": sorted(schema.ParallelConfigSection.model_fields) + ["recompute"],
    "parallel": sorted(schema.ParallelSection.model_fields),
    "parallel.parallel_optimizer_config": sorted(schema.ParallelOptimizerConfig.model_fields),
    "parallel.pipeline_config": sorted(schema.PipelineConfig.model_fields),
    "recompute_config": sorted(schema.RecomputeConfig.model_fields),
    "runner_config": sorted(schema.RunnerConfig.model_fields),
    "runner_wrapper": sorted(schema.RunnerWrapper.model_fields),
    "runner_wrapper.scale_sense": ["type", "loss_scale_value", "scale_factor", "scale_window"],
    "optimizer": sorted(schema.OptimizerConfig.model_fields),
    "lr_schedule": sorted(schema.LrSchedule.model_fields),
    "model.model_config": _MODEL_KEYS,
    "parallelism": list(PARALLELISM_FIELDS),
    "micro_batch_interleave_num": [],
    "use_parallel": [],
    "model": ["model_config"],
}


def test_section_tables_are_not_empty():
    assert "data_parallel" in SECTIONS["parallel_config"]
    assert "optimizer_level" in SECTIONS["parallel.parallel_optimizer_config"]
    assert "num_attention_heads" in SECTIONS["model.model_config"]
    assert "data_parallel_shard" in SECTIONS["parallelism"]


def put(doc: dict, dotted: str, value) -> None:
    """doc[a][b][c] = value for 'a.b.c', replacing any non-mapping on the way."""
    parts = dotted.split(".")
    node = doc
    for p in parts[:-1]:
        if not isinstance(node.get(p), dict):
            node[p] = {}
        node = node[p]
    node[parts[-1]] = value


@st.composite
def injected(draw):
    """A base config with 1-3 hostile trees placed as whole sections or as values of known keys."""
    doc = copy.deepcopy(draw(BASES))
    for _ in range(draw(st.integers(1, 3))):
        section = draw(st.sampled_from(sorted(SECTIONS)))
        keys = SECTIONS[section]
        tree = draw(TREES)
        if keys and draw(st.booleans()):
            put(doc, f"{section}.{draw(st.sampled_from(keys))}", tree)
        else:
            put(doc, section, tree)
    return doc


# --------------------------------------------------------------------------------------------------------------
# (a) trees as python objects


@FUZZ
@given(TREES)
def test_any_tree_at_top_level(tree):
    check_load_and_plan(tree)


@FUZZ
@given(injected())
def test_trees_injected_into_real_sections(doc):
    check_load_and_plan(doc)


@FUZZ
@given(st.sampled_from(sorted(SECTIONS["parallel_config"])), LEAVES)
def test_scalar_values_for_parallel_config_keys(key, value):
    doc = copy.deepcopy(BASE_GOOD)
    doc["parallel_config"][key] = value
    out = check_load_and_plan(doc)
    if isinstance(out, msp.ConfigError):
        assert out.issues


# --------------------------------------------------------------------------------------------------------------
# (b) the same trees as YAML text, as a str path and as a pathlib.Path


def _dump(tree) -> str:
    return yaml.safe_dump(tree, allow_unicode=True, default_flow_style=False)


@FUZZ
@given(TREES | injected())
def test_trees_as_yaml_text(tree):
    check_load_and_plan(_dump(tree))


@pytest.fixture(scope="module")
def scratch(tmp_path_factory) -> pathlib.Path:
    return tmp_path_factory.mktemp("hostile")


@FUZZ
@given(tree=TREES | injected())
def test_trees_as_yaml_files(scratch, tree):
    path = scratch / "fuzz.yaml"
    path.write_text(_dump(tree), encoding="utf-8")
    check_load_and_plan(str(path))
    check_load_and_plan(path)


# --------------------------------------------------------------------------------------------------------------
# (c) arbitrary bytes


@FUZZ
@given(data=st.binary(max_size=300))
def test_arbitrary_bytes_in_a_file(scratch, data):
    path = scratch / "fuzz.bin.yaml"
    path.write_bytes(data)
    check_load_and_plan(path)
    check_load_and_plan(data)


# --------------------------------------------------------------------------------------------------------------
# (d) explicit cases


def _billion_laughs(levels: int = 9, width: int = 9) -> str:
    lines = ["l0: &l0 [" + ", ".join(["lol"] * width) + "]"]
    for i in range(1, levels):
        lines.append(f"l{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * width) + "]")
    return "\n".join(lines) + "\n"


BOMB = _billion_laughs()

FILE_CASES = {
    "empty": b"",
    "whitespace": b"   \n\t\n  \n",
    "comment_only": b"# just a comment\n",
    "top_level_list": b"- parallel_config\n- 2\n",
    "top_level_scalar": b"42\n",
    "invalid_syntax": b"parallel_config:\n  data_parallel: [1, 2\n  model_parallel: }\n",
    "tab_indent": b"parallel_config:\n\tdata_parallel: 2\n",
    "nul_bytes": b"parallel_config:\x00\n  data_parallel: 2\n",
    "not_utf8": b"parallel_config:\n  data_parallel: \xff\xfe\xfd\n",
    "utf16": "parallel_config:\n  data_parallel: 2\n".encode("utf-16"),
    "deep_lists": b"[" * 5000 + b"\n" + b"]" * 5000 + b"\n",
    "deep_block_maps": ("a:\n" + "".join("  " * i + f"k{i}:\n" for i in range(1, 2000))).encode(),
    "bomb_unused": BOMB.encode(),
    "duplicate_keys": b"parallel_config:\n  data_parallel: 2\nparallel_config:\n  data_parallel: three\n",
    "unknown_tag": b"parallel_config: !!python/object:os.system {}\n",
    "huge_dp": b"parallel_config:\n  data_parallel: " + b"9" * 100 + b"\n",
}


@pytest.mark.parametrize("name", sorted(FILE_CASES))
def test_explicit_bad_files(tmp_path, name):
    path = tmp_path / f"{name}.yaml"
    path.write_bytes(FILE_CASES[name])
    start = time.perf_counter()
    out = check_outcome(msp.load_config, str(path))
    assert time.perf_counter() - start < 5, f"{name} took too long"
    if name != "bomb_unused":  # an unused anchor block is just ignored top-level keys
        assert isinstance(out, msp.ConfigError), f"{name} was accepted"
    check_outcome(msp.make_plan, path)


def test_missing_path_and_directory(tmp_path):
    for source in (tmp_path / "nope.yaml", str(tmp_path / "nope.yaml"), tmp_path, str(tmp_path) + os.sep):
        out = check_load_and_plan(source)
        assert isinstance(out, msp.ConfigError)


@pytest.mark.parametrize("obj", [0, 7, -1, 1.5, float("nan"), [], [1, 2], ("a",), {1, 2}, object(), None, True,
                                 msp.ConfigError, len, b"\xff\xfe"], ids=repr)
def test_non_config_python_objects(obj):
    out = check_load_and_plan(obj)
    assert isinstance(out, msp.ConfigError)


def test_self_referencing_dict():
    doc: dict = {"parallel_config": {}}
    doc["parallel_config"]["data_parallel"] = doc
    doc["model"] = doc
    assert isinstance(check_load_and_plan(doc), msp.ConfigError)


class _OverBudget(BaseException):
    """Raised by the step counter's hook once its budget is spent (a BaseException: no `except Exception` in the
    code under test swallows it)."""


def _counted_steps(fn, budget: int):
    """(fn()'s result or None, Python steps it took: function calls plus lines executed, loop iterations included,
    counted by a trace hook). Past `budget` steps the hook stops fn, so an explosive regression fails at once
    instead of running for minutes."""
    steps = [0]

    def hook(frame, event, arg):
        steps[0] += 1
        if steps[0] > budget:
            raise _OverBudget
        return hook

    sys.settrace(hook)
    try:
        return fn(), steps[0]
    except _OverBudget:
        return None, steps[0]
    finally:
        sys.settrace(None)


BUDGET = 200_000


def test_deeply_nested_python_dict_and_text():
    """5000 levels of nesting are refused with a ConfigError in a bounded amount of work: a count of the Python steps
    taken (calls and lines; 900-1800 each, as the nesting limit stops the walk early), not a wall-clock bound,
    which a loaded machine made flaky. A walk quadratic in the depth (5000**2 / 2 = 12.5M steps; a check_depth that
    measured each subtree's depth first was stopped at the budget in 0.04 s) fails at once; the budget leaves about
    100x room for ordinary growth of the loader."""
    deep: object = 1
    for _ in range(5000):
        deep = [deep]
    for source in ({"parallel_config": {"data_parallel": deep}}, {"x": deep},
                   "[" * 5000 + "\n" + "]" * 5000 + "\n"):
        result, steps = _counted_steps(lambda: check_load_and_plan(source), budget=BUDGET)
        assert steps <= BUDGET, f"{steps} Python steps or more for 5000 levels of nesting: the walk is not bounded"
        assert isinstance(result, msp.ConfigError), type(result)


# Inputs that a naive implementation expands (alias bombs: 9**9 = 387M leaves) or iterates over (schema-valid but
# huge counts) run in child processes, all at once, with a memory cap and a deadline, so a regression fails in
# seconds instead of hanging the suite or the machine. "Fast" is the child's CPU time inside make_plan.
_CHILD = textwrap.dedent("""
    import json, resource, sys, time, warnings
    resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))
    warnings.simplefilter("ignore")
    import msparallel_ds as msp
    text = sys.stdin.read()
    start = time.process_time()
    try:
        msp.make_plan(text)
        outcome, message, n_issues = "accepted", "", 0
    except msp.ConfigError as exc:
        outcome, message, n_issues = "config_error", str(exc)[:300], len(exc.issues)
    print(json.dumps({"outcome": outcome, "message": message, "issues": n_issues,
                      "cpu_s": time.process_time() - start}))
""")
_DEADLINE_S = 12


def run_isolated(texts: dict[str, str], expected: dict[str, set[str]]) -> list[str]:
    """make_plan(text) for every text in its own capped child; returns the problems found."""
    procs = {name: subprocess.Popen([sys.executable, "-c", _CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True) for name in texts}
    deadline = time.monotonic() + _DEADLINE_S
    problems = []
    for name, proc in procs.items():
        try:
            out, err = proc.communicate(texts[name], timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            problems.append(f"{name}: make_plan still running after {_DEADLINE_S} s")
            continue
        if proc.returncode != 0:
            problems.append(f"{name}: child exited {proc.returncode} (an exception other than ConfigError?): "
                            f"{err[-800:]}")
            continue
        res = json.loads(out.strip().splitlines()[-1])
        if res["outcome"] not in expected[name]:
            problems.append(f"{name}: {res['outcome']}, expected {sorted(expected[name])}")
        if res["outcome"] == "config_error" and res["issues"] < 1:
            problems.append(f"{name}: ConfigError without issues")
        if res["cpu_s"] > 3:
            problems.append(f"{name}: took {res['cpu_s']:.1f} s of CPU")
        if "MemoryError" in res["message"]:
            problems.append(f"{name}: ran out of memory (2 GiB cap): {res['message']}")
    return problems


BOMB_PLACEMENTS = {
    "top_level_alias": "l_last: *l8\n",
    "whole_parallel_config": "parallel_config: *l8\n",
    "parallel_config_value": "parallel_config:\n  data_parallel: *l8\n",
    "parallel_config_typo_key": "parallel_config:\n  data_paralel: *l8\n",
    "scale_sense_type": "runner_wrapper:\n  scale_sense:\n    type: *l8\n",
    "recompute": "recompute_config:\n  recompute: *l8\n",
    "whole_model": "model: *l8\n",
    "model_config": "model:\n  model_config: *l8\n",
    "offset": "model:\n  model_config:\n    offset: *l8\n",
    "parallelism_method": "parallelism:\n  context_parallel_method: *l8\n",
}


def test_alias_bomb_is_a_fast_config_error_wherever_it_lands():
    texts = {where: BOMB + tail for where, tail in BOMB_PLACEMENTS.items()}
    expected = {where: {"accepted"} if where == "top_level_alias" else {"config_error"} for where in texts}
    problems = run_isolated(texts, expected)
    assert not problems, "\n".join(problems)


_MAX = schema.MAX_COUNT  # 2**40: the largest count the schema accepts
_MAXD = schema.MAX_DEGREE  # 2**20: the largest degree the schema accepts
HUGE_BUT_IN_RANGE = {
    # recompute layer counts spread over virtual chunks one layer at a time
    "recompute_count_2_40": f"recompute_config:\n  recompute: [{_MAX}]\nmodel:\n  model_config:\n"
                            f"    num_layers: {_MAX}\n",
    # layers_per_stage grid of pipeline_stage x pp_interleave_num = 2**40 cells
    "pp_and_vpp_2_20": f"parallel_config:\n  pipeline_stage: {_MAXD}\n  micro_batch_num: {_MAXD}\n"
                       f"parallel:\n  pipeline_config:\n    pipeline_interleave: true\n"
                       f"model:\n  model_config:\n    num_layers: {_MAX}\n    pp_interleave_num: {_MAXD}\n",
    "pp_2_20": f"parallel_config:\n  pipeline_stage: {_MAXD}\n  micro_batch_num: {_MAXD}\n"
               f"model:\n  model_config:\n    num_layers: {_MAXD}\n",
    "all_degrees_2_20": f"parallel_config:\n  data_parallel: {_MAXD}\n  model_parallel: {_MAXD}\n"
                        f"  context_parallel: {_MAXD}\n  context_parallel_algo: hybrid_cp\n"
                        f"  ulysses_degree_in_cp: {_MAXD}\n  micro_batch_num: {_MAX}\n"
                        f"runner_config:\n  batch_size: {_MAX}\n  gradient_accumulation_steps: {_MAX}\n"
                        f"micro_batch_interleave_num: {_MAXD}\nmodel:\n  model_config:\n"
                        f"    num_layers: {_MAX}\n    num_heads: {_MAX}\n    hidden_size: {_MAX}\n"
                        f"    seq_length: {_MAX}\n    vocab_size: {_MAX}\n",
}


def test_huge_but_in_range_values_are_planned_quickly():
    expected = {name: {"accepted", "config_error"} for name in HUGE_BUT_IN_RANGE}
    problems = run_isolated(HUGE_BUT_IN_RANGE, expected)
    assert not problems, "\n".join(problems)


def test_long_single_line_yaml_text_is_parsed():
    """YAML text is documented input; a one-line flow mapping longer than a file name must not be treated
    as a path (Path.exists raises ENAMETOOLONG there)."""
    text = ("{parallel_config: {data_parallel: 2, model_parallel: 1, pipeline_stage: 1, micro_batch_num: 1}, "
            "runner_config: {batch_size: 2, gradient_accumulation_steps: 1}, model: {model_config: {num_layers: 4, "
            "num_heads: 8, hidden_size: 64, seq_length: 128, vocab_size: 256, compute_dtype: bfloat16}}}")
    assert len(text) > 255 and "\n" not in text
    cfg = msp.load_config(text)
    assert cfg.dp == 2 and cfg.runner_config.batch_size == 2


# --------------------------------------------------------------------------------------------------------------
# world_size


@pytest.mark.parametrize("world_size", [0, -1, True, False, "8", 8.0, 10**30, [8], "eight", 2**63])
def test_weird_world_sizes(world_size):
    issues = issues_of(BASE_GOOD, world_size=world_size)
    assert any(i.key == "world_size" for i in issues)


def test_world_size_that_matches_is_accepted():
    assert msp.make_plan(BASE_GOOD, world_size=8).world_size == 8


# --------------------------------------------------------------------------------------------------------------
# each bad value is reported under its YAML key path


def _with(path: str, value) -> dict:
    doc = copy.deepcopy(BASE_GOOD)
    put(doc, path, value)
    return doc


KEYED_CASES = [
    (_with("parallel_config.data_parallel", "two"), "parallel_config.data_parallel"),
    (_with("parallel_config.data_parallel", 10**100), "parallel_config.data_parallel"),
    (_with("parallel_config.data_parallel", 2.0), "parallel_config.data_parallel"),
    (_with("parallel_config.data_parallel", True), "parallel_config.data_parallel"),
    (_with("parallel_config.data_parallel", 0), "parallel_config.data_parallel"),
    (_with("parallel_config.use_seq_parallel", "yes"), "parallel_config.use_seq_parallel"),
    (_with("parallel_config.context_parallel_algo", "bogus_cp"), "parallel_config.context_parallel_algo"),
    (_with("model.model_config.num_heads", -3), "model.model_config.num_heads"),
    (_with("model.model_config.seq_length", float("nan")), "model.model_config.seq_length"),
    (_with("micro_batch_interleave_num", "x"), "micro_batch_interleave_num"),
    (_with("runner_config.batch_size", 0), "runner_config.batch_size"),
    (_with("runner_wrapper.scale_sense", -5), "runner_wrapper.scale_sense"),
    (_with("runner_wrapper.max_grad_norm", float("inf")), "runner_wrapper.max_grad_norm"),
    (_with("parallel.parallel_optimizer_config.optimizer_level", "level9"),
     "parallel.parallel_optimizer_config.optimizer_level"),
    (_with("parallel.pipeline_config.pipeline_scheduler", "nope"), "parallel.pipeline_config.pipeline_scheduler"),
    (_with("parallel.parallel_mode", 10**30), "parallel.parallel_mode"),
    (_with("optimizer.betas", [0.9, float("nan")]), "optimizer.betas[1]"),
    (_with("lr_schedule.warmup_steps", -1), "lr_schedule.warmup_steps"),
    (_with("recompute_config.recompute", [1, 1, 1]), "recompute_config.recompute"),
    (_with("parallel_config", [1, 2]), "parallel_config"),
    ({"model": {"model_config": "x"}}, "model.model_config"),
    ({"parallelism": {"tensor_parallel": "x"}}, "parallelism.tensor_parallel"),
    ({"parallel_config": {"context_parallel": 4, "context_parallel_algo": "hybrid_cp", "ulysses_degree_in_cp": 3}},
     "parallel_config.ulysses_degree_in_cp"),
]


@pytest.mark.parametrize("doc,key", KEYED_CASES, ids=[k for _, k in KEYED_CASES])
def test_issue_names_the_key_path(doc, key):
    issues = issues_of(doc)
    assert key in [i.key for i in issues], [str(i) for i in issues]
    # the key also shows up in the message that users read
    assert any(key in str(i) for i in issues)


def test_typo_suggests_the_right_key():
    issues = issues_of(_with("parallel_config.data_paralel", 2))
    typo = [i for i in issues if i.key == "parallel_config.data_paralel"]
    assert typo, [str(i) for i in issues]
    assert "data_parallel" in typo[0].fix


def test_several_problems_are_reported_together():
    doc = _with("parallel_config.data_parallel", "two")
    doc["model"]["model_config"]["num_heads"] = -3
    keys = {i.key for i in issues_of(doc)}
    assert {"parallel_config.data_parallel", "model.model_config.num_heads"} <= keys


def test_same_issues_from_text_file_and_dict(tmp_path):
    doc = _with("parallel_config.data_parallel", "two")
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(doc))
    for source in (doc, yaml.safe_dump(doc), path):
        assert [i.key for i in issues_of(source)] == ["parallel_config.data_parallel"]


@pytest.mark.parametrize("value, truth", [("Flase", True), ("false", True), ("", False), (0, False), (1, True)])
def test_non_boolean_use_parallel_counts_by_truthiness_with_a_warning(value, truth):
    """MindFormers tests only use_parallel's truthiness (mindformers 2.1.0 core/context/build_context.py:353,
    core/context/parallel.py:42): a real config's `use_parallel: Flase` runs parallel. Same here, said aloud."""
    with pytest.warns(ConfigWarning, match=f"use_parallel={value!r} is not a boolean.*counts as {truth}"):
        cfg = msp.load_config(_with("use_parallel", value))
    assert cfg.use_parallel is truth
