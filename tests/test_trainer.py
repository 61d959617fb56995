"""MindFormersTrainer on 4 gloo processes logs the losses of a plain single-process Trainer (relative error <= 1e-4).

Both runs use TrainingArguments from the same YAML (training_arguments_from_yaml; the reference has the whole
global batch per device, no DeepSpeed), the same seed, data and order, logging_steps=1, 3 steps, the YAML's AdamW,
clipping and HF's default linear decay. Rows ignore a different number of leading labels, so dp replicas and cp
shards hold unequal token counts: the Trainer's num_items_in_batch normalisation must count each dp replica once
(tp and cp peers hold the same rows) and each cp rank must back-propagate its share. The logged gradient norms
match too (DeepSpeed's, before clipping), and so does trainer.evaluate()'s eval_loss (one copy per dp replica
gathered, the padded last batch dropped). The dp2 x tp2 run also saves: a Trainer checkpoint at step 2 (DeepSpeed
files, msparallel_ds's layout-independent checkpoint and a full HF model) and save_model's HF checkpoint, which a
plain process loads with the reference's weights; new processes then resume the step-2 checkpoint under dp2 x cp2
Ulysses ZeRO-2 and log the uninterrupted step 3.
"""
import importlib.util
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from engine_cases import tiny_config
from harness import run_distributed

ROOT = Path(__file__).resolve().parents[1]
STEPS, SEQ, RTOL, SAVE_AT = 3, 32, 1e-4, 2
COMMON = {"max_steps": STEPS, "logging_steps": 1, "report_to": [], "seed": 0, "disable_tqdm": True,
          "per_device_eval_batch_size": 2}
EVAL_ROWS = 6  # 3 eval batches of 2: dp replica 1 gets a padded last batch, dropped again by gather_for_metrics


class MaskedTextWindows:
    """Windows of the shipped text; row i ignores its first (7 i) % 11 labels."""

    def __init__(self, n, seq=SEQ):
        import torch

        from msparallel_ds.tiny import text_tokens

        tokens = text_tokens()
        g = torch.Generator().manual_seed(0)
        self.rows = [tokens[s:s + seq] for s in torch.randint(0, len(tokens) - seq, (n,), generator=g).tolist()]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        ids = self.rows[i]
        labels = ids.clone()
        labels[: (7 * i) % 11] = -100
        return {"input_ids": ids, "labels": labels}


def _logged(trainer, key, after=0):
    return [h[key] for h in trainer.state.log_history if key in h and h["step"] > after]


def _train(rank, world_size, cfg, out_dir, save, resume=None):
    import msparallel_ds as msp
    from msparallel_ds.integrations.trainer import (
        MindFormersTrainer,
        training_arguments_from_yaml,
    )
    from msparallel_ds.tiny import tiny_llama

    args = training_arguments_from_yaml(cfg, output_dir=out_dir, save_strategy="steps" if save else "no",
                                        save_steps=SAVE_AT, **COMMON)
    rows = msp.make_plan(cfg).global_batch_size * STEPS
    trainer = MindFormersTrainer(model=tiny_llama(), args=args, train_dataset=MaskedTextWindows(rows),
                                 parallel_config=cfg)
    trainer.train(resume_from_checkpoint=resume)
    if resume:
        # the log history restored from the checkpoint holds steps 1..SAVE_AT; this run logged the rest
        return {"loss": _logged(trainer, "loss", SAVE_AT), "grad_norm": _logged(trainer, "grad_norm", SAVE_AT),
                "restored": _logged(trainer, "loss")[:SAVE_AT]}
    if save:
        trainer.save_model(f"{out_dir}/final")
    eval_loss = trainer.evaluate(MaskedTextWindows(EVAL_ROWS))["eval_loss"]
    return {"loss": _logged(trainer, "loss"), "grad_norm": _logged(trainer, "grad_norm"), "eval_loss": eval_loss,
            "dp": trainer.layout.size("dp"), "total_batch": trainer.get_total_train_batch_size(trainer.args)}


def reference(cfg, out_dir, dataset=None, eval_dataset=None, **args):
    """A plain Trainer in this process: one device holds the whole global batch."""
    from accelerate.state import AcceleratorState
    from transformers import Trainer, TrainingArguments

    import msparallel_ds as msp
    from msparallel_ds.export.trainer import training_arguments_kwargs
    from msparallel_ds.tiny import tiny_llama

    plan = msp.make_plan(cfg)
    kwargs = training_arguments_kwargs(plan, out_dir, deepspeed=False, save_strategy="no", use_cpu=True,
                                       **{**COMMON, **args})
    kwargs["per_device_train_batch_size"] *= plan.mesh.dp
    try:
        trainer = Trainer(model=tiny_llama(), args=TrainingArguments(**kwargs),
                          train_dataset=dataset or MaskedTextWindows(plan.global_batch_size * STEPS))
        trainer.train()
        eval_loss = trainer.evaluate(eval_dataset or MaskedTextWindows(EVAL_ROWS))["eval_loss"]
        return _logged(trainer, "loss"), _logged(trainer, "grad_norm"), eval_loss, trainer.model
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)


def _assert_close(got, want, what, first=0):
    assert len(got) == len(want) == STEPS - first, (got, want)
    for step, (g, w) in enumerate(zip(got, want), start=first):
        rel = abs(g - w) / abs(w)
        assert rel <= RTOL, f"step {step + 1} {what}: {g} vs single process {w} (relative error {rel:.2e})"


CASES = {
    "dp2xtp2_sp_vocab_parallel_save": ({"dp": 2, "tp": 2, "sp": True, "vocab_dp": False, "bs": 2}, True),
    "dp2xcp2_ulysses_zero2_gas2": ({"dp": 2, "cp": 2, "algo": "ulysses_cp", "zero": 2, "gas": 2}, False),
}


@pytest.mark.distributed
@pytest.mark.parametrize("name", list(CASES))
def test_mindformers_trainer_logs_single_process_losses(name, tmp_path):
    import torch

    kwargs, save = CASES[name]
    cfg = tiny_config(**kwargs)
    out = str(tmp_path / "run")
    results = run_distributed(_train, 4, cfg, out, save, timeout=240)
    want_loss, want_norm, want_eval, ref_model = reference(cfg, str(tmp_path / "ref"))
    for res in results:
        _assert_close(res["loss"], want_loss, "loss")
        _assert_close(res["grad_norm"], want_norm, "grad norm")
        assert abs(res["eval_loss"] - want_eval) <= RTOL * want_eval, (res["eval_loss"], want_eval)
        assert res["total_batch"] == kwargs.get("bs", 1) * res["dp"] * kwargs.get("gas", 1)
    if save:
        from transformers import LlamaForCausalLM

        ckpt = tmp_path / "run" / f"checkpoint-{SAVE_AT}"
        assert (ckpt / "model.safetensors").exists() and (ckpt / f"global_step{SAVE_AT}").is_dir(), list(ckpt.iterdir())
        assert (ckpt / "msp_checkpoint.json").exists(), list(ckpt.iterdir())  # engine.save's default: sharded
        saved = LlamaForCausalLM.from_pretrained(tmp_path / "run" / "final")
        ids = MaskedTextWindows(2)[1]["input_ids"][None]
        with torch.no_grad():
            a, b = saved(input_ids=ids).logits, ref_model.eval()(input_ids=ids).logits
        assert (a - b).abs().max().item() < 1e-3 * b.abs().max().item()
        resumed_cfg = tiny_config(dp=2, cp=2, algo="ulysses_cp", zero=2, bs=2)  # same global batch, new layout
        resumed = run_distributed(_train, 4, resumed_cfg, str(tmp_path / "resumed"), False, str(ckpt), timeout=240)
        for res in resumed:
            assert len(res["loss"]) == STEPS - SAVE_AT, res
            _assert_close(res["loss"], want_loss[SAVE_AT:], "resumed loss", first=SAVE_AT)
            _assert_close(res["grad_norm"], want_norm[SAVE_AT:], "resumed grad norm", first=SAVE_AT)


@pytest.mark.distributed
def test_torchrun_example_cp4_hybrid(tmp_path):
    """examples/train_trainer.py under torchrun (the process group starts from the launcher's environment) with the
    shipped configs/tiny_cp4_hybrid.yaml (Ulysses 2 inside ring 2, recompute) prints the plain Trainer's losses."""
    import msparallel_ds as msp

    config = ROOT / "configs" / "tiny_cp4_hybrid.yaml"
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "4", "--master_port", str(port),
           str(ROOT / "examples" / "train_trainer.py"), "--config", str(config), "--max-steps", str(STEPS),
           "--seq", str(SEQ), "--lr", "1e-3", "--output-dir", str(tmp_path / "out")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=tmp_path, check=False,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    got = [float(x) for x in re.findall(r"^step \d+ loss ([0-9.]+)$", proc.stdout, re.MULTILINE)]
    spec = importlib.util.spec_from_file_location("train_trainer", ROOT / "examples" / "train_trainer.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    rows = msp.make_plan(msp.load_config(str(config))).global_batch_size * STEPS
    want, _, _, _ = reference(str(config), str(tmp_path / "ref"), dataset=example.TextWindows(rows, SEQ, 0),
                              eval_dataset=example.TextWindows(2, SEQ, 1), learning_rate=1e-3)
    _assert_close(got, want, "loss")
    assert (tmp_path / "out" / "model.safetensors").exists()


# ---------------------------------------------------------------------------------------------- pure mapping
def test_training_arguments_kwargs_map_the_yaml():
    import msparallel_ds as msp
    from msparallel_ds.export.trainer import training_arguments_kwargs

    cfg = tiny_config(dp=2, tp=2, bs=2, gas=4, clip=0.5)
    cfg["micro_batch_interleave_num"] = 2
    cfg["model"]["model_config"]["compute_dtype"] = "bfloat16"
    cfg["optimizer"].update(learning_rate=2e-4, weight_decay=0.1)
    cfg["lr_schedule"] = {"type": "CosineWithWarmUpLR", "learning_rate": 2e-4, "lr_end": 1e-6, "warmup_ratio": 0.03,
                          "total_steps": 1000}
    plan = msp.make_plan(msp.load_config(cfg))
    cpu = training_arguments_kwargs(plan, "out")
    assert cpu["per_device_train_batch_size"] == 4 and cpu["gradient_accumulation_steps"] == 4  # bs x mbi, gas
    assert (cpu["learning_rate"], cpu["adam_beta1"], cpu["adam_beta2"], cpu["adam_epsilon"], cpu["weight_decay"]) == (
        2e-4, 0.9, 0.95, 1e-8, 0.1)
    assert cpu["optim"] == "adamw_torch" and cpu["max_grad_norm"] == 0.5
    assert cpu["lr_scheduler_type"] == "cosine_with_min_lr" and cpu["lr_scheduler_kwargs"] == {"min_lr": 1e-6}
    assert cpu["warmup_steps"] == 30 and cpu["max_steps"] == 1000  # the plan turns warmup_ratio into steps
    assert "bf16" not in cpu and "bf16" not in cpu["deepspeed"]  # CPU: fp32
    ds = cpu["deepspeed"]
    assert ds["zero_optimization"]["stage"] == 1 and "optimizer" not in ds and "scheduler" not in ds
    assert {ds[k] for k in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "gradient_clipping")} == {
        "auto"}
    gpu = training_arguments_kwargs(plan, "out", gpu=True, logging_steps=5, lr_scheduler_type="linear")
    assert gpu["bf16"] is True and gpu["deepspeed"]["bf16"] == {"enabled": "auto"}
    assert gpu["logging_steps"] == 5 and gpu["lr_scheduler_type"] == "linear" and "lr_scheduler_kwargs" not in gpu
    cfg["lr_schedule"]["type"] = "MegatronLR"
    with pytest.raises(ValueError, match="lr_scheduler_type"):
        training_arguments_kwargs(msp.make_plan(msp.load_config(cfg)), "out")
    assert training_arguments_kwargs(msp.make_plan(msp.load_config(cfg)), "out",
                                     lr_scheduler_type="cosine")["lr_scheduler_type"] == "cosine"
