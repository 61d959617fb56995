"""msp.build_optimizer / msp.build_lr_scheduler against MindSpore's own numbers (tests/fixtures/mindspore_optim:
5-step trajectories of nn.AdamWeightDecay and MindFormers' optimizers on fixed gradients, and every lr schedule's
values, made by MindSpore 2.7 running the 1.3.2 / 2.1.0 wheels' source), through build_optimizer, msp.initialize on
one process and ZeRO-1 over dp2 (gloo); MindFormers' decay groups, grouped_lr_schedule, and the errors."""
import json
import math
from pathlib import Path

import pytest
import torch
from torch import nn

import msparallel_ds as msp
from harness import run_distributed

FIX = Path(__file__).parent / "fixtures" / "mindspore_optim"
OPTIM = json.loads((FIX / "optim.json").read_text())
LR = json.loads((FIX / "lr.json").read_text())
RTOL = 1e-6


class Toy(nn.Module):
    """The fixture's parameters under their names (w: 2-D, decays; proj.bias and norm.weight: no decay); the
    forward's gradient with respect to each parameter is the fixed gradient passed in."""

    def __init__(self, init):
        super().__init__()
        self.w = nn.Parameter(torch.tensor(init["w"]))
        self.proj, self.norm = nn.Module(), nn.Module()
        self.proj.bias = nn.Parameter(torch.tensor(init["proj.bias"]))
        self.norm.weight = nn.Parameter(torch.tensor(init["norm.weight"]))

    def forward(self, grads):
        return sum((p * grads[n]).sum() for n, p in self.named_parameters())


def _cfg(case, **extra):
    opt = dict(case["optimizer"])
    sched = opt.pop("lr_schedule", None)
    cfg = {"optimizer": {**opt, "learning_rate": OPTIM["learning_rate"], "weight_decay": OPTIM["weight_decay"]},
           **extra}
    if sched:
        cfg["lr_schedule"] = sched
    return cfg


def _grads(step):
    return {k: torch.tensor(v, dtype=torch.float32) for k, v in OPTIM["grads"][step].items()}


def _worst(model, ref):
    return max(((p.detach() - torch.tensor(ref[n])).abs() / torch.tensor(ref[n]).abs()).max().item()
               for n, p in model.named_parameters())


@pytest.mark.parametrize("name", sorted(OPTIM["cases"]))
def test_trajectory_matches_mindspore(name):
    case = OPTIM["cases"][name]
    model = Toy(OPTIM["init"])
    cfg = _cfg(case)
    opt = msp.build_optimizer(model, cfg)
    sched = msp.build_lr_scheduler(opt, cfg)
    groups = {g["group_name"]: [id(p) for p in g["params"]] for g in opt.param_groups}
    assert groups == {"weight_decay": [id(model.w)], "no_weight_decay": [id(model.proj.bias), id(model.norm.weight)]}
    # AdamWeightDecayX replaces the groups' decay with its own (MindSpore decays every parameter, as measured)
    want = OPTIM["weight_decay"] if case["optimizer"]["type"] == "AdamWeightDecayX" else 0.0
    assert [g["weight_decay"] for g in opt.param_groups] == [OPTIM["weight_decay"], want]
    for step, ref in enumerate(case["trajectory"]):
        for n, p in model.named_parameters():
            p.grad = _grads(step)[n]
        opt.step()
        if sched is not None:
            sched.step()
        assert _worst(model, ref) <= RTOL, (name, step)


def test_no_bias_and_adamw_types_differ():
    """The fixture's two families really differ (so the trajectory test can tell them apart)."""
    a = OPTIM["cases"]["FP32StateAdamWeightDecay-1.3.2"]["trajectory"][-1]["w"]
    b = OPTIM["cases"]["AdamW-2.1.0"]["trajectory"][-1]["w"]
    assert max(abs(x - y) for r, s in zip(a, b) for x, y in zip(r, s)) > 1e-3


@pytest.mark.parametrize("name", sorted(LR["cases"]))
def test_lr_schedule_matches_mindspore(name):
    case = LR["cases"][name]
    peak = case["lr_schedule"].get("learning_rate") or case["lr_schedule"]["base_lr"]
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = msp.build_lr_scheduler(opt, {"lr_schedule": case["lr_schedule"]})
    for step, want in enumerate(case["values"]):
        got = opt.param_groups[0]["lr"]
        # MindSpore computes in float32: near lr_end its cancellation error is ~1e-7 of the peak
        assert abs(got - want) <= RTOL * abs(want) + 0.1 * RTOL * peak, (name, step, got, want)
        opt.step()
        sched.step()


def test_total_steps_from_the_caller():
    """total_steps: -1 takes the caller's count (same values as the YAML writing it); no count: one clear error."""
    case = LR["cases"]["CosineWithWarmUpLR@2.1.0"]
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0)
    cfg = {"lr_schedule": {**case["lr_schedule"], "total_steps": -1}}
    sched = msp.build_lr_scheduler(opt, cfg, total_steps=case["lr_schedule"]["total_steps"])
    assert sched.lr_at(7) == pytest.approx(case["values"][7], rel=RTOL)
    with pytest.raises(ValueError, match=r"lr_schedule\.total_steps .*total_steps=N"):
        msp.build_lr_scheduler(opt, cfg)
    resumed = msp.build_lr_scheduler(torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0), cfg, total_steps=20)
    for _ in range(7):
        opt.step()
        sched.step()
    resumed.load_state_dict(sched.state_dict())  # engine.load: the next update runs at lr(7)
    assert resumed.optimizer.param_groups[0]["lr"] == pytest.approx(case["values"][7], rel=RTOL)
    const = {"lr_schedule": {"type": "ConstantWarmUpLR", "learning_rate": 1e-3, "warmup_steps": 0, "total_steps": -1}}
    assert msp.build_lr_scheduler(opt, const).get_last_lr() == [1e-3]  # warmup 0, no total needed


def test_decay_groups_of_a_hf_model_and_its_own_list():
    from msparallel_ds.tiny import tiny_llama

    model = tiny_llama()
    opt = msp.build_optimizer(model, {"optimizer": {"type": "AdamW", "weight_decay": 0.1, "learning_rate": 1e-3}})
    names = {id(p): n for n, p in model.named_parameters()}
    by = {g["group_name"]: (g["weight_decay"], [names[id(p)] for p in g["params"]]) for g in opt.param_groups}
    assert by["weight_decay"][0] == 0.1 and by["no_weight_decay"][0] == 0.0
    assert all(n.endswith("norm.weight") for n in by["no_weight_decay"][1])
    assert sorted(by["weight_decay"][1] + by["no_weight_decay"][1]) == sorted(names.values())
    model.no_weight_decay = lambda: {"model.embed_tokens.weight"}  # a model's own list (MindFormers' hook)
    opt = msp.build_optimizer(model, {"optimizer": {"type": "AdamW", "weight_decay": 0.1, "learning_rate": 1e-3}})
    assert any(p is model.model.embed_tokens.weight for g in opt.param_groups if g["weight_decay"] == 0
               for p in g["params"])


def test_grouped_lr_schedule():
    """2.x grouped_lr_schedule: the matched parameters follow their group's schedule, the rest `default`; the decay
    split stays inside each."""
    model = Toy(OPTIM["init"])
    cfg = {"optimizer": {"type": "AdamW", "weight_decay": 0.1},
           "grouped_lr_schedule": {
               "default": {"type": "ConstantWarmUpLR", "learning_rate": 1e-3, "warmup_steps": 0},
               "grouped": [{"type": "LinearWithWarmUpLR", "learning_rate": 5e-3, "warmup_steps": 2,
                            "total_steps": 10, "params": ["proj.*", "*w"]}]}}  # substring or fnmatch
    opt = msp.build_optimizer(model, cfg)
    sched = msp.build_lr_scheduler(opt, cfg)
    names = [g["group_name"] for g in opt.param_groups]
    assert names == ["group_0_weight_decay", "group_0_no_weight_decay", "no_weight_decay"]
    for step in range(4):
        lrs = [g["lr"] for g in opt.param_groups]
        linear = 5e-3 * step / 2 if step < 2 else 5e-3 * (10 - step) / 8
        assert lrs == pytest.approx([linear, linear, 1e-3]), step
        opt.step()
        sched.step()
    cfg["grouped_lr_schedule"]["grouped"][0]["params"] = ["nothing"]
    with pytest.raises(ValueError, match=r"grouped_lr_schedule\.grouped\[0\]\.params"):
        msp.build_optimizer(model, cfg)


@pytest.mark.parametrize("optimizer, match", [
    ({"type": "Came"}, "optimizer.type='Came'.*not yet built"),
    ({"type": "SGDX"}, "optimizer.type='SGDX'.*FP32StateAdamWeightDecay"),
    ({"type": "AdamW", "betas": [0.9, 0.95], "beta2": 0.999, "learning_rate": 1e-3}, "optimizer.betas"),
    ({"type": "AdamW"}, "optimizer.learning_rate"),
])
def test_optimizer_errors(optimizer, match):
    with pytest.raises(ValueError, match=match):
        msp.build_optimizer(Toy(OPTIM["init"]), {"optimizer": optimizer})


@pytest.mark.parametrize("sched, match", [
    ({"type": "MegatronLR", "learning_rate": 1e-3}, "auto_register"),
    ({"type": "StepLR", "learning_rate": 1e-3}, "lr_schedule.type='StepLR'"),
    ({"type": "PolynomialWithWarmUpLR", "learning_rate": 1e-3, "lr_end": 1e-2, "total_steps": 9}, "lr_end"),
    ({"type": "LinearWithWarmUpLR", "learning_rate": 1e-3, "warmup_ratio": 0.1}, "lr_schedule.total_steps"),
])
def test_lr_errors(sched, match):
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0)
    with pytest.raises(ValueError, match=match):
        msp.build_lr_scheduler(opt, {"lr_schedule": sched})


def test_plan_and_export_describe_without_a_disagreeing_scheduler():
    cfg = _cfg(OPTIM["cases"]["FP32StateAdamWeightDecay-1.3.2+CosineWithWarmUpLR"])
    plan = msp.make_plan(cfg, world_size=1)
    ds = plan.to_deepspeed()
    assert "scheduler" not in ds and plan.lr_schedule["type"] == "CosineWithWarmUpLR"
    assert ds["optimizer"]["params"]["bias_correction"] is False  # FusedAdam's form of nn.AdamWeightDecay
    assert plan.optimizer["runs_as"].startswith("AdamWeightDecay")


CASES_1P = ("FP32StateAdamWeightDecay-1.3.2+CosineWithWarmUpLR", "AdamW-2.1.0+CosineWithWarmUpLR", "PmaAdamW-2.1.0")


def _engine_run(rank, world, zero):
    """msp.initialize(optimizer=None) on the fixture: the same type and groups as msp.build_optimizer, and the
    trajectory, per case (worst relative error)."""
    import warnings

    warnings.simplefilter("ignore")
    out = {}
    for name in CASES_1P:
        case = OPTIM["cases"][name]
        extra = {"parallel_config": {"data_parallel": world}}
        if zero:
            extra["parallel"] = {"enable_parallel_optimizer": True,
                                 "parallel_optimizer_config": {"optimizer_level": "level1"}}
        cfg = _cfg(case, **extra)
        sched = case["optimizer"].get("lr_schedule")
        if sched:  # -1: the count comes from msp.initialize(total_steps=)
            cfg["lr_schedule"] = {**sched, "total_steps": -1}
        model = Toy(OPTIM["init"])
        alone = msp.build_optimizer(Toy(OPTIM["init"]), cfg)
        engine = msp.initialize(model, cfg, total_steps=sched["total_steps"] if sched else None)
        base = engine.optimizer.optimizer if zero else engine.optimizer
        same = (type(base) is type(alone) and
                [(g["group_name"], g["weight_decay"], len(g["params"])) for g in alone.param_groups] ==
                [(g["group_name"], g["weight_decay"], len(g["params"])) for g in base.param_groups]
                if not zero else type(base) is type(alone))
        worst = 0.0
        for step, ref in enumerate(case["trajectory"]):
            loss = engine.ds(_grads(step))
            engine.ds.backward(loss)
            engine.ds.step()
            worst = max(worst, _worst(model, ref))
        out[name] = (same, worst)
    return out


def test_initialize_one_process_matches_mindspore():
    for name, (same, worst) in run_distributed(_engine_run, 1, False, timeout=120)[0].items():
        assert same and worst <= RTOL, (name, worst)


def test_zero1_dp2_matches_mindspore():
    for rank in run_distributed(_engine_run, 2, True, timeout=180):
        for name, (same, worst) in rank.items():
            assert same and worst <= RTOL, (name, worst)


def _resume_run(rank, world, save_dir):
    """FP32StateAdamWeightDecay + CosineWithWarmUpLR under ZeRO-1: engine.save after 2 steps, a fresh engine loads
    it and runs steps 3-5; the trajectory equals MindSpore's (moments, step count and lr schedule restored)."""
    import warnings

    warnings.simplefilter("ignore")
    name = "FP32StateAdamWeightDecay-1.3.2+CosineWithWarmUpLR"
    case = OPTIM["cases"][name]
    cfg = _cfg(case, parallel_config={"data_parallel": world},
               parallel={"enable_parallel_optimizer": True, "parallel_optimizer_config": {"optimizer_level": "level1"}})
    first = msp.initialize(Toy(OPTIM["init"]), cfg)
    for step in range(2):
        first.ds.backward(first.ds(_grads(step)))
        first.ds.step()
    first.save(save_dir)
    model = Toy(OPTIM["init"])
    engine = msp.initialize(model, cfg)
    engine.load(save_dir)
    worst = 0.0
    for step in range(2, len(case["trajectory"])):
        engine.ds.backward(engine.ds(_grads(step)))
        engine.ds.step()
        worst = max(worst, _worst(model, case["trajectory"][step]))
    return worst


def test_save_load_resumes_the_mindspore_trajectory(tmp_path):
    for worst in run_distributed(_resume_run, 2, str(tmp_path / "ck"), timeout=180):
        assert worst <= RTOL, worst
