"""MindFormersAccelerator (accelerate + DeepSpeed + our groups) on 4 CPU processes equals one unsharded process.

The tiny Llama of msparallel_ds.tiny trains 3 AdamW steps on the shipped text; every global batch is the same
rows in both runs (the dp-sharded loader gives dp replica d micro-batch d of each step's block). The per-step
global-batch mean losses match the single-process model's with relative error <= 1e-4, and so do DeepSpeed's
gradient norms (AdamW alone would hide a wrong gradient scale). The in-process cases ignore each row's first 8
labels, so cp shards hold unequal token counts (each cp rank must back-propagate its share, not its own mean):
- dp2 x tp2 + sequence parallel + vocab parallel, launched for real: `msparallel-ds export --to accelerate`, then
  `accelerate launch --config_file <exported>` of examples/train_accelerate.py, the YAML path in MSPARALLEL_CONFIG;
- tp2 x cp2 (causal ring, SP) and dp2 x cp2 (Ulysses, ZeRO-2, 2 accumulated micro-batches, a scheduler) through
  run_distributed, with an optimizer built on the unsharded model before prepare(); the tp2 x cp2 run saves with
  accelerator.save_pretrained and a plain process loads the full trained model.
"""
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from engine_cases import tiny_config
from harness import run_distributed

ROOT = Path(__file__).resolve().parents[1]
STEPS, SEQ, MASKED, RTOL = 3, 32, 8, 1e-4


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def global_batches(global_batch, steps=STEPS, seq=SEQ, masked=0):
    """The shipped text as `steps` global batches; labels of each row's first `masked` tokens ignored (-100), so cp
    shards hold unequal token counts while every dp replica holds the same number."""
    from msparallel_ds.tiny import text_batches

    batches = text_batches(steps, global_batch, seq)
    for b in batches:
        b["labels"][:, :masked] = -100
    return batches


def reference_run(cfg_dict, steps=STEPS, seq=SEQ, masked=0, lr_lambda=None):
    """One process, unsharded tiny Llama, the YAML's AdamW and clipping, HF's loss on each whole global batch.
    Returns the per-step losses, gradient norms (before clipping) and the trained model."""
    import torch

    import msparallel_ds as msp
    from msparallel_ds.tiny import tiny_llama

    plan = msp.make_plan(msp.load_config(cfg_dict), world_size=4)
    model = tiny_llama()
    p = plan.optimizer["params"]
    opt = torch.optim.AdamW(model.parameters(), lr=p["lr"], betas=tuple(p["betas"]), eps=p["eps"],
                            weight_decay=p["weight_decay"])
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda) if lr_lambda else None
    losses, norms = [], []
    for batch in global_batches(plan.global_batch_size, steps, seq, masked):
        loss = model(**batch).loss
        opt.zero_grad()
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), plan.gradient_clipping or float("inf")).item())
        opt.step()
        if sched:
            sched.step()
        losses.append(loss.item())
    return losses, norms, model


def _assert_close(got, want, what="loss"):
    assert len(got) == len(want), (got, want)
    for step, (g, w) in enumerate(zip(got, want)):
        rel = abs(g - w) / abs(w)
        assert rel <= RTOL, f"step {step + 1} {what}: {g} vs single process {w} (relative error {rel:.2e})"


# ---------------------------------------------------------------------------------------------- accelerate launch
@pytest.mark.distributed
def test_accelerate_launch_dp2_tp2_sp_vocab_parallel(tmp_path):
    cfg = tiny_config(dp=2, tp=2, sp=True, vocab_dp=False, bs=2)
    yaml_path = tmp_path / "run.yaml"
    yaml_path.write_text(yaml.safe_dump(cfg))
    launch = tmp_path / "accelerate.yaml"
    subprocess.run([sys.executable, "-m", "msparallel_ds.cli", "export", str(yaml_path), "--to", "accelerate", "-o",
                    str(launch)], check=True, capture_output=True, timeout=60)
    env = {**os.environ, "MSPARALLEL_CONFIG": str(yaml_path), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(launch), "--main_process_port",
           str(_free_port()), str(ROOT / "examples" / "train_accelerate.py"), "--max-steps", str(STEPS),
           "--seq", str(SEQ)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    got = [float(x) for x in re.findall(r"^step \d+ loss ([0-9.]+)$", proc.stdout, re.MULTILINE)]
    assert "vocab parallel                          on" in proc.stdout  # the plan summary, printed once
    _assert_close(got, reference_run(cfg)[0])


# ---------------------------------------------------------------------------------------------- in-process ranks
def _warmup_half(step):
    return 0.5 if step == 0 else 1.0


def _train(rank, world_size, cfg, masked, with_scheduler, save_dir):
    import torch
    from torch.utils.data import DataLoader

    from msparallel_ds.integrations.accelerate import MindFormersAccelerator
    from msparallel_ds.tiny import tiny_llama

    accelerator = MindFormersAccelerator(cfg)
    plan = accelerator.plan
    rows = [{"input_ids": i, "labels": lab} for b in global_batches(plan.global_batch_size, masked=masked)
            for i, lab in zip(b["input_ids"], b["labels"])]
    loader = DataLoader(rows, batch_size=plan.micro_batch_size)
    model = tiny_llama()
    p = plan.optimizer["params"]
    optimizer = torch.optim.AdamW(model.parameters(), lr=p["lr"], betas=tuple(p["betas"]), eps=p["eps"],
                                  weight_decay=p["weight_decay"])  # on the unsharded model: re-pointed by prepare
    objs = [model, optimizer, loader]
    if with_scheduler:
        objs.append(torch.optim.lr_scheduler.LambdaLR(optimizer, _warmup_half))
    model, optimizer, loader, *sched = accelerator.prepare(*objs)
    losses, norms, micro, seen = [], [], [], []
    for batch in loader:
        seen.append(batch["input_ids"][:, 0].tolist())
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            optimizer.step()
            for s in sched:
                s.step()
            optimizer.zero_grad()
        micro.append(accelerator.reduce_loss(loss))
        if accelerator.sync_gradients:
            losses.append(torch.stack(micro).mean().item())
            norms.append(float(model.get_global_grad_norm()))  # DeepSpeed's, before clipping: the gradient's scale
            micro = []
    if save_dir:
        accelerator.save_pretrained(model, save_dir)  # the full model: tp shards gathered
    return {"losses": losses, "norms": norms, "seen": seen, "dp": accelerator.layout.rank("dp"),
            "gas": accelerator.gradient_accumulation_steps}


CASES = {
    "tp2xcp2_ring_sp": ({"tp": 2, "cp": 2, "ring": True, "sp": True, "bs": 2}, False),
    "dp2xcp2_ulysses_zero2_gas2_sched": ({"dp": 2, "cp": 2, "algo": "ulysses_cp", "zero": 2, "gas": 2}, True),
}


@pytest.mark.distributed
@pytest.mark.parametrize("name", list(CASES))
def test_mindformers_accelerator_matches_single_process(name, tmp_path):
    import torch
    from transformers import LlamaForCausalLM

    kwargs, with_scheduler = CASES[name]
    cfg = tiny_config(**kwargs)
    save_dir = str(tmp_path / "hf") if kwargs.get("tp", 1) > 1 else None
    results = run_distributed(_train, 4, cfg, MASKED, with_scheduler, save_dir, timeout=180)
    want, want_norms, ref_model = reference_run(cfg, masked=MASKED,
                                                lr_lambda=_warmup_half if with_scheduler else None)
    for res in results:
        _assert_close(res["losses"], want)
        _assert_close(res["norms"], want_norms, "grad norm")
        assert res["gas"] == kwargs.get("gas", 1)
        peers = [r for r in results if r["dp"] == res["dp"]]
        assert all(r["seen"] == res["seen"] for r in peers), "tp/cp peers of a dp replica must see the same rows"
    if kwargs.get("dp", 1) > 1:
        assert results[0]["seen"] != results[-1]["seen"], "dp replicas must see different rows"
    if save_dir:  # accelerator.save_pretrained: a plain process loads the trained full model
        ids = global_batches(2)[0]["input_ids"]
        with torch.no_grad():
            got = LlamaForCausalLM.from_pretrained(save_dir)(input_ids=ids).logits
            want_logits = ref_model(input_ids=ids).logits
        assert (got - want_logits).abs().max().item() < 1e-3 * want_logits.abs().max().item()


# ---------------------------------------------------------------------------------------------- no processes
def test_config_comes_from_argument_or_environment(monkeypatch, tmp_path):
    from msparallel_ds.integrations.accelerate import (
        CONFIG_ENV,
        MindFormersAccelerator,
        resolve_config,
    )

    monkeypatch.delenv(CONFIG_ENV, raising=False)
    with pytest.raises(ValueError, match=CONFIG_ENV):
        MindFormersAccelerator()
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(tiny_config(dp=2, tp=2)))
    monkeypatch.setenv(CONFIG_ENV, str(path))
    assert resolve_config().parallel_config.model_parallel == 2
    with pytest.raises(ValueError, match="cpu=True"):
        MindFormersAccelerator(str(path), cpu=True)
    with pytest.raises(ValueError, match="deepspeed_plugin"):
        MindFormersAccelerator(str(path), deepspeed_plugin=object())
