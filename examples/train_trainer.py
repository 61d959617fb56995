"""Train a tiny Llama under a MindFormers YAML with the HF Trainer (MindFormersTrainer), on 4 CPU processes.

    torchrun --nproc_per_node 4 examples/train_trainer.py --config configs/tiny_dp2_tp2.yaml --max-steps 5

or through accelerate (the launch file from the same YAML):

    msparallel-ds export configs/tiny_dp2_tp2.yaml --to accelerate -o /tmp/accelerate_tiny.yaml
    accelerate launch --config_file /tmp/accelerate_tiny.yaml examples/train_trainer.py \
        --config configs/tiny_dp2_tp2.yaml --max-steps 5

TrainingArguments come from the YAML (training_arguments_from_yaml: batch, accumulation, AdamW, schedule,
clipping, DeepSpeed config); the Trainer's own logging, progress bar and saving run as usual. The model is built
from a LlamaConfig (no download); the data is a torch Dataset of windows of the public-domain text shipped with
the package (byte tokens). Rank 0 prints `step i loss x` for every optimizer step (the Trainer's logged loss: the
global-batch token mean) and saves a plain HF checkpoint of the full model in --output-dir.
"""
import argparse

import torch
from torch.utils.data import Dataset
from transformers import TrainerCallback

import msparallel_ds as msp
from msparallel_ds.runtime import teardown
from msparallel_ds.integrations.accelerate import resolve_config
from msparallel_ds.integrations.trainer import (
    MindFormersTrainer,
    training_arguments_from_yaml,
)
from msparallel_ds.runtime import quiet_deepspeed
from msparallel_ds.tiny import text_tokens, tiny_llama


class TextWindows(Dataset):
    """`n` windows of `seq` byte tokens at seeded random offsets of the shipped text; labels = input_ids."""

    def __init__(self, n: int, seq: int, seed: int = 0):
        self.tokens = text_tokens()
        g = torch.Generator().manual_seed(seed)
        self.starts = torch.randint(0, len(self.tokens) - seq, (n,), generator=g).tolist()
        self.seq = seq

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> dict:
        ids = self.tokens[self.starts[i]:self.starts[i] + self.seq]
        return {"input_ids": ids, "labels": ids.clone()}


class PrintLoss(TrainerCallback):
    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and logs and "loss" in logs:
            print(f"step {state.global_step} loss {logs['loss']:.6f}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=None, help="MindFormers YAML (default: $MSPARALLEL_CONFIG)")
    ap.add_argument("--max-steps", type=int, default=10)
    ap.add_argument("--seq", type=int, default=64, help="tokens per row")
    ap.add_argument("--output-dir", default="trainer_output")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lr", type=float, default=None, help="learning rate (default: the YAML's optimizer)")
    ap.add_argument("--local_rank", "--local-rank", type=int, default=None, help="set by the deepspeed launcher")
    args = ap.parse_args()

    quiet_deepspeed()  # before DeepSpeed is imported: no per-rank accelerator line or FutureWarning
    torch.set_num_threads(1)
    cfg = resolve_config(args.config)  # --config, else $MSPARALLEL_CONFIG
    training_args = training_arguments_from_yaml(
        cfg, output_dir=args.output_dir, max_steps=args.max_steps, logging_steps=1, save_strategy="no",
        report_to=[], seed=args.seed, disable_tqdm=False,
        **({"learning_rate": args.lr} if args.lr is not None else {}))
    rows = msp.make_plan(cfg).global_batch_size * args.max_steps
    trainer = MindFormersTrainer(model=tiny_llama(seed=args.seed), args=training_args,
                                 train_dataset=TextWindows(rows, args.seq, args.seed), parallel_config=cfg,
                                 callbacks=[PrintLoss()])
    if trainer.is_world_process_zero():
        source = "--lr" if args.lr is not None else "the YAML's optimizer" if cfg.optimizer else "the Trainer default"
        optim, sched = (getattr(x, "value", x) for x in (training_args.optim, training_args.lr_scheduler_type))
        sched_source = "the YAML's lr_schedule" if cfg.lr_schedule else "the YAML has none"
        print(f"optimizer: {optim} lr={training_args.learning_rate} ({source}); lr schedule: {sched} "
              f"({sched_source}), warmup {training_args.warmup_steps} steps", flush=True)
    trainer.train()
    trainer.save_model()


if __name__ == "__main__":
    main()
    teardown()  # barrier, DeepSpeed's and our groups destroyed, then exit (no rank aborts at exit)
