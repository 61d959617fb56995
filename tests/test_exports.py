"""The exported configs are accepted by DeepSpeed's and accelerate's own config classes, with the numbers
MindFormers' YAML implies (batch math, ZeRO stage, precision, loss scale, clipping, optimizer, scheduler).

DeepSpeedConfig asks deepspeed.comm for the rank and silently falls back to a world of 1 (ignoring the mpu)
when no backend is initialized, so these tests run inside a 1-process gloo group; the fake mpu then supplies
the data-parallel size, exactly as msparallel_ds.distributed.mpu.DeepSpeedMPU does in a real run.
"""
from __future__ import annotations

import copy
import json
import socket
import warnings

import pytest
import yaml

import msparallel_ds as msp
from msparallel_ds.cli import main as cli_main

pytestmark = pytest.mark.filterwarnings("ignore::msparallel_ds.config.errors.ConfigWarning")

deepspeed = pytest.importorskip("deepspeed")
torch_dist = pytest.importorskip("torch.distributed")
from deepspeed.runtime.config import DeepSpeedConfig  # noqa: E402


# --------------------------------------------------------------------------------------------------------------
# fixtures and helpers


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ds_comm():
    """A 1-process gloo group that deepspeed.comm knows about; destroyed after this module."""
    if torch_dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    torch_dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    try:
        import deepspeed.comm as ds_dist

        ds_dist.init_distributed(dist_backend="gloo", dist_init_required=False)
        assert ds_dist.get_rank() == 0
        yield
    finally:
        torch_dist.destroy_process_group()


class FakeMpu:
    """The sizes DeepSpeed reads from an mpu, taken from the plan (ranks are all 0: one process)."""

    def __init__(self, plan: msp.Plan):
        m = plan.mesh
        self.sizes = {"data": m.dp, "sequence": m.cp, "sequence_data": m.dp * m.cp, "tensor_model": m.tp,
                      "model": m.tp, "pipeline_model": m.pp}

    def __getattr__(self, name: str):
        for kind, size in self.sizes.items():
            if name == f"get_{kind}_parallel_world_size":
                return lambda: size
            if name == f"get_{kind}_parallel_rank":
                return lambda: 0
        raise AttributeError(name)


def ds_config(plan: msp.Plan, **kwargs) -> DeepSpeedConfig:
    return DeepSpeedConfig(copy.deepcopy(plan.to_deepspeed(**kwargs)), mpu=FakeMpu(plan))


MODEL = {"num_layers": 4, "num_heads": 8, "n_kv_heads": 4, "hidden_size": 64, "seq_length": 128,
         "vocab_size": 256, "compute_dtype": "bfloat16"}


def cfg(pc: dict | None = None, *, batch_size: int = 2, gas: int = 1, model: dict | None = None, **top) -> dict:
    doc = {"parallel_config": dict(pc or {"data_parallel": 4}),
           "runner_config": {"batch_size": batch_size, "gradient_accumulation_steps": gas},
           "model": {"model_config": {**MODEL, **(model or {})}}}
    doc.update(top)
    return doc


def zero(level: str | None = None, shard: bool = False, **poc) -> dict:
    if level is None and not shard:
        return {"enable_parallel_optimizer": False}
    conf = {"gradient_accumulation_shard": shard, **poc}
    if level:
        conf["optimizer_level"] = level
    return {"enable_parallel_optimizer": True, "parallel_optimizer_config": conf}


DYNAMIC = {"scale_sense": {"type": "DynamicLossScaleUpdateCell", "loss_scale_value": 65536, "scale_factor": 2,
                           "scale_window": 1000}}
OPTIMIZER = {"type": "AdamW", "betas": [0.9, 0.95], "eps": 1.0e-8, "learning_rate": 1.0e-5, "weight_decay": 0.1}
LR_SCHEDULE = {"type": "CosineWithWarmUpLR", "learning_rate": 1.0e-5, "lr_end": 1.0e-6, "warmup_ratio": 0.01,
               "total_steps": 1000}

# name -> (config, world size, expected: global batch, micro per DeepSpeed step, gas, ZeRO stage)
CASES = {
    "zero0_bf16": (cfg(batch_size=2, gas=3, parallel=zero()), 4, 24, 2, 3, 0),
    "zero1": (cfg(parallel=zero("level1")), 4, 8, 2, 1, 1),
    "zero2": (cfg(parallel=zero("level2")), 4, 8, 2, 1, 2),
    "zero2_by_gradient_accumulation_shard": (cfg(parallel=zero(shard=True)), 4, 8, 2, 1, 2),
    "zero3": (cfg(parallel=zero("level3")), 4, 8, 2, 1, 3),
    "zero3_hpz": (cfg({"data_parallel": 8}, parallel=zero("level3", optimizer_weight_shard_size=4)), 8, 16, 2, 1, 3),
    "tp2_dp2_gas4": (cfg({"data_parallel": 2, "model_parallel": 2}, batch_size=3, gas=4), 4, 24, 3, 4, 0),
    # pp > 1: global = batch_size * dp * micro_batch_num * mbi; gradient_accumulation_steps is ignored
    "pp2_mbn8": (cfg({"data_parallel": 2, "pipeline_stage": 2, "micro_batch_num": 8}, batch_size=2, gas=5),
                 4, 32, 2, 8, 0),
    # pp == 1 with multi-copy: global = batch_size * dp * mbi * gas; one DeepSpeed micro step holds all copies
    "mbi2_gas3": (cfg({"data_parallel": 2}, batch_size=2, gas=3, micro_batch_interleave_num=2), 2, 24, 4, 3, 0),
    "pp2_mbn8_mbi2": (cfg({"data_parallel": 2, "model_parallel": 2, "pipeline_stage": 2, "micro_batch_num": 8},
                          batch_size=1, micro_batch_interleave_num=2), 8, 32, 2, 8, 0),
    # cp ranks share samples: DeepSpeed's data-parallel world is dp, not dp x cp
    "cp2_ulysses_zero2": (cfg({"data_parallel": 2, "context_parallel": 2, "context_parallel_algo": "ulysses_cp"},
                              batch_size=2, gas=2, parallel=zero("level2")), 4, 8, 2, 2, 2),
}


@pytest.fixture(params=sorted(CASES))
def case(request):
    doc, world, global_batch, micro, gas, stage = CASES[request.param]
    plan = msp.make_plan(doc, world_size=world)
    return plan, global_batch, micro, gas, stage


# --------------------------------------------------------------------------------------------------------------
# (a) DeepSpeedConfig


def test_without_a_backend_deepspeed_ignores_the_mpu():
    """Why the gloo group is needed: documents DeepSpeed 0.19's fallback (world 1, mpu unused)."""
    import deepspeed.comm as ds_dist

    if ds_dist.is_initialized():
        pytest.skip("deepspeed.comm already initialized in this process")
    plan = msp.make_plan(cfg(), world_size=4)
    assert DeepSpeedConfig(plan.to_deepspeed(), mpu=FakeMpu(plan)).world_size == 1


def test_batch_math_and_zero_stage(ds_comm, case):
    plan, global_batch, micro, gas, stage = case
    assert plan.global_batch_size == global_batch
    assert plan.zero_stage == stage
    c = ds_config(plan)
    assert c.world_size == plan.mesh.dp
    assert c.train_micro_batch_size_per_gpu == micro
    assert c.gradient_accumulation_steps == gas
    assert c.train_batch_size == plan.global_batch_size == global_batch
    assert c.zero_optimization_stage == stage
    assert c.zero_enabled == (stage > 0)
    assert c.bfloat16_config.enabled and not c.float16_config.enabled
    if stage:
        assert c.zero_config.reduce_bucket_size == plan.zero.reduce_bucket_size
        assert c.zero_config.overlap_comm is True
    assert c.zero_allow_untested_optimizer is True


def test_zero3_details(ds_comm):
    plan = msp.make_plan(cfg({"data_parallel": 8}, parallel=zero("level3", optimizer_weight_shard_size=4,
                                                                    parallel_optimizer_threshold=64)),
                         world_size=8)
    c = ds_config(plan)
    assert c.zero_optimization_stage == 3
    assert c.zero_config.zero_hpz_partition_size == 4
    assert c.zero_config.param_persistence_threshold == 64 * 1024 // 4  # KB of fp32 params -> elements


def test_fp16_dynamic_loss_scale(ds_comm):
    plan = msp.make_plan(cfg(model={"compute_dtype": "float16"}, runner_wrapper=DYNAMIC), world_size=4)
    c = ds_config(plan)
    fp16 = c.float16_config
    assert fp16.enabled and not c.bfloat16_config.enabled
    assert fp16.loss_scale == 0  # 0 = dynamic
    assert fp16.initial_dynamic_scale() == 65536
    assert fp16.loss_scale_window == 1000
    assert fp16.dynamic_loss_scale_args()["init_scale"] == 65536


def test_fp16_static_loss_scale(ds_comm):
    plan = msp.make_plan(cfg(model={"compute_dtype": "fp16"}, runner_wrapper={"scale_sense": 1024}), world_size=4)
    c = ds_config(plan)
    assert c.float16_config.enabled
    assert c.float16_config.loss_scale == 1024


def test_bf16_drops_the_loss_scale(ds_comm):
    plan = msp.make_plan(cfg(runner_wrapper=DYNAMIC), world_size=4)
    c = ds_config(plan)
    assert c.bfloat16_config.enabled and not c.float16_config.enabled
    assert "fp16" not in plan.to_deepspeed()


def test_fp32_has_no_mixed_precision(ds_comm):
    plan = msp.make_plan(cfg(model={"compute_dtype": "float32"}), world_size=4)
    c = ds_config(plan)
    assert not c.float16_config.enabled and not c.bfloat16_config.enabled


@pytest.mark.parametrize("use_clip,norm,expected", [(True, 0.5, 0.5), (True, 1.0, 1.0), (False, 0.5, 0.0)])
def test_gradient_clipping(ds_comm, use_clip, norm, expected):
    plan = msp.make_plan(cfg(runner_wrapper={"use_clip_grad": use_clip, "max_grad_norm": norm}), world_size=4)
    assert ds_config(plan).gradient_clipping == expected


def test_optimizer_and_scheduler(ds_comm):
    plan = msp.make_plan(cfg(optimizer=OPTIMIZER, lr_schedule=LR_SCHEDULE), world_size=4)
    c = ds_config(plan)
    assert c.optimizer_name == "adamw"
    assert c.optimizer_params["lr"] == pytest.approx(1e-5)
    assert list(c.optimizer_params["betas"]) == pytest.approx([0.9, 0.95])
    assert c.optimizer_params["eps"] == pytest.approx(1e-8)
    assert c.optimizer_params["weight_decay"] == pytest.approx(0.1)
    # no DeepSpeed scheduler (its curves differ from MindFormers'); the schedule is data in the plan and the engines
    # run msp.build_lr_scheduler
    assert c.scheduler_name is None
    assert plan.lr_schedule["total_steps"] == 1000 and plan.lr_schedule["warmup_steps"] == 10  # ratio 0.01 x 1000
    # the optimizer can be left out (the trainer builds torch ones)
    assert ds_config(plan, include_optimizer=False).optimizer_name is None
    # the nn.AdamWeightDecay family: FusedAdam without bias correction
    fp32 = msp.make_plan(cfg(optimizer={"type": "FP32StateAdamWeightDecay", "beta1": 0.9, "beta2": 0.95,
                                        "learning_rate": 1e-5}), world_size=4)
    assert ds_config(fp32).optimizer_params["bias_correction"] is False


def test_without_mpu_the_batch_is_explicit(ds_comm):
    """Pure dp (world == dp): train_batch_size is emitted; with one process DeepSpeed's world is 1."""
    plan = msp.make_plan(cfg({"data_parallel": 1}, batch_size=4, gas=2, micro_batch_interleave_num=2), world_size=1)
    ds = plan.to_deepspeed(with_mpu=False)
    assert ds["train_batch_size"] == plan.global_batch_size == 4 * 1 * 2 * 2
    c = DeepSpeedConfig(copy.deepcopy(ds))
    assert (c.train_batch_size, c.train_micro_batch_size_per_gpu, c.gradient_accumulation_steps) == (16, 8, 2)


# --------------------------------------------------------------------------------------------------------------
# (b) accelerate


@pytest.fixture
def clean_accelerate_env(monkeypatch):
    import os

    for key in list(os.environ):
        if key.startswith(("ACCELERATE_", "PARALLELISM_CONFIG_")):
            monkeypatch.delenv(key)


def _accelerate_checks(loaded, plan: msp.Plan) -> None:
    from accelerate.utils import DistributedType

    assert loaded.distributed_type == DistributedType.DEEPSPEED
    assert loaded.num_processes == plan.world_size
    assert loaded.deepspeed_config["zero_stage"] == plan.zero_stage
    expected_mp = {"bf16": "bf16", "fp16": "fp16", "fp32": "no"}[plan.compute_dtype]
    assert str(loaded.mixed_precision) == expected_mp or loaded.mixed_precision.value == expected_mp


def test_accelerate_yaml_loads(tmp_path, case, clean_accelerate_env):
    from accelerate.commands.config.config_args import load_config_from_file

    plan, *_ = case
    path = tmp_path / "accelerate.yaml"
    path.write_text(yaml.safe_dump(plan.to_accelerate()))
    loaded = load_config_from_file(str(path))
    _accelerate_checks(loaded, plan)
    expected_gas = plan.micro_batch_num if plan.mesh.pp > 1 else plan.gradient_accumulation_steps
    assert loaded.deepspeed_config["gradient_accumulation_steps"] == expected_gas


def test_accelerate_yaml_fp16_and_clipping(tmp_path, clean_accelerate_env):
    from accelerate.commands.config.config_args import load_config_from_file

    plan = msp.make_plan(cfg(model={"compute_dtype": "float16"}, runner_wrapper={**DYNAMIC, "use_clip_grad": True,
                                                                              "max_grad_norm": 0.25}), world_size=4)
    path = tmp_path / "accelerate.yaml"
    path.write_text(yaml.safe_dump(plan.to_accelerate()))
    loaded = load_config_from_file(str(path))
    _accelerate_checks(loaded, plan)
    assert loaded.deepspeed_config["gradient_clipping"] == 0.25


def test_deepspeed_plugin_from_exported_dict(case, clean_accelerate_env):
    from accelerate.utils import DeepSpeedPlugin

    plan, _, micro, gas, stage = case
    ds = plan.to_deepspeed()
    try:
        plugin = DeepSpeedPlugin(hf_ds_config=copy.deepcopy(ds))
    except (RuntimeError, ImportError) as exc:  # pragma: no cover - depends on the accelerate build
        pytest.skip(f"DeepSpeedPlugin needs a launch/GPU here: {exc}")
    assert plugin.zero_stage == stage
    assert plugin.gradient_accumulation_steps == gas
    assert plugin.deepspeed_config["train_micro_batch_size_per_gpu"] == micro
    assert plugin.deepspeed_config["zero_optimization"]["stage"] == stage
    assert plugin.zero3_init_flag == (stage == 3)
    assert ds == plan.to_deepspeed()  # the exporter's dict was not shared with the plugin


# --------------------------------------------------------------------------------------------------------------
# (c) the CLI's accelerate file (it starts with comment lines)


def test_cli_accelerate_file_loads(tmp_path, capsys, monkeypatch, clean_accelerate_env):
    from accelerate.commands.config.config_args import load_config_from_file

    src = tmp_path / "run.yaml"
    src.write_text(yaml.safe_dump(cfg({"data_parallel": 2, "model_parallel": 2, "pipeline_stage": 2,
                                       "micro_batch_num": 4, "use_seq_parallel": True},
                                      parallel=zero("level1"))))
    out = tmp_path / "accelerate.yaml"
    monkeypatch.setattr(warnings, "formatwarning", warnings.formatwarning)  # main() replaces it
    with warnings.catch_warnings():
        assert cli_main(["export", str(src), "--to", "accelerate", "-o", str(out)]) == 0
    capsys.readouterr()
    assert out.read_text().startswith("#")
    loaded = load_config_from_file(str(out))
    plan = msp.make_plan(str(src))
    _accelerate_checks(loaded, plan)
    assert loaded.num_processes == 8
    assert loaded.deepspeed_config["zero_stage"] == 1
    assert loaded.deepspeed_config["gradient_accumulation_steps"] == 4

    ds_out = tmp_path / "ds.json"
    with warnings.catch_warnings():
        assert cli_main(["export", str(src), "--to", "deepspeed", "-o", str(ds_out)]) == 0
    assert json.loads(ds_out.read_text()) == plan.to_deepspeed()


def test_optimizer_swap_offloads_the_optimizer_state():
    """MindFormers' optimizer.swap (Adam state on the host) -> DeepSpeed offload_optimizer, with the torch optimizer
    run on the host (not DeepSpeed's CPU Adam); without a parallel optimizer ZeRO-1 carries it."""
    import msparallel_ds as msp

    base = {"parallel_config": {"data_parallel": 2}, "optimizer": {"type": "AdamW", "swap": True},
            "parallel": {"enable_parallel_optimizer": True, "parallel_optimizer_config": {"optimizer_level": "level2"}}}
    plan = msp.make_plan(msp.load_config(base))
    ds = plan.to_deepspeed()
    assert ds["zero_optimization"]["stage"] == 2 and ds["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert ds["zero_force_ds_cpu_optimizer"] is False
    assert plan.to_accelerate()["deepspeed_config"]["offload_optimizer_device"] == "cpu"
    plain = msp.make_plan(msp.load_config({**base, "parallel": {}}))
    assert plain.zero.stage == 1 and plain.zero.offload_optimizer and any("optimizer.swap" in n for n in plain.notes)
    off = msp.make_plan(msp.load_config({**base, "optimizer": {"type": "AdamW"}})).to_deepspeed()
    assert "offload_optimizer" not in off["zero_optimization"] and "zero_force_ds_cpu_optimizer" not in off


def test_parallelism_cpu_offload_offloads_zero3_parameters():
    """parallelism.cpu_offload (MindFormers' FSDP offload; a real bool, pynative/config/utils.py) -> ZeRO-3
    offload_param; without sharded parameters it is noted and ignored."""
    import msparallel_ds as msp

    plan = msp.make_plan(msp.load_config({"parallelism": {"data_parallel_shard": 4, "cpu_offload": True}}))
    assert plan.zero.stage == 3 and plan.to_deepspeed()["zero_optimization"]["offload_param"]["device"] == "cpu"
    assert plan.to_accelerate()["deepspeed_config"]["offload_param_device"] == "cpu"
    flat = msp.make_plan(msp.load_config({"parallelism": {"data_parallel_shard": 1, "data_parallel_replicate": 4,
                                                         "cpu_offload": True}}))
    assert "offload_param" not in flat.to_deepspeed()["zero_optimization"]
    assert any("parallelism.cpu_offload" in n for n in flat.notes)
    with pytest.raises(msp.ConfigError, match="parallelism.cpu_offload"):
        msp.load_config({"parallelism": {"cpu_offload": "yes"}})
