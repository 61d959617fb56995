"""Train a tiny Llama under a MindFormers YAML with accelerate (MindFormersAccelerator), on 4 CPU processes.

    msparallel-ds export configs/tiny_dp2_tp2.yaml --to accelerate -o /tmp/accelerate_tiny.yaml
    MSPARALLEL_CONFIG=configs/tiny_dp2_tp2.yaml accelerate launch --config_file /tmp/accelerate_tiny.yaml \
        examples/train_accelerate.py --max-steps 5

`--config FILE` works instead of MSPARALLEL_CONFIG, and so does `torchrun --nproc_per_node 4
examples/train_accelerate.py --config configs/tiny_dp2_tp2.yaml`. The launch file sets the process count and
says "DeepSpeed"; the parallel strategy, ZeRO stage, batch sizes, clipping and optimizer come from the YAML.
The model is built from a LlamaConfig (no download) and trains on the public-domain text shipped with the package
(byte tokens). It is an ordinary accelerate loop: prepare, accumulate, backward, step. Rank 0 prints the
global-batch mean loss of every optimizer step as `step i loss x`.
"""
import argparse

import torch
from torch.utils.data import DataLoader

from msparallel_ds.integrations.accelerate import MindFormersAccelerator
from msparallel_ds.runtime import quiet_deepspeed, teardown
from msparallel_ds.tiny import text_batches, tiny_llama

DEFAULT_LR = 3e-3  # only when the YAML has no optimizer section and no --lr is given


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=None, help="MindFormers YAML (default: $MSPARALLEL_CONFIG)")
    ap.add_argument("--max-steps", type=int, default=10)
    ap.add_argument("--seq", type=int, default=64, help="tokens per row")
    ap.add_argument("--lr", type=float, default=None,
                    help=f"learning rate (default: the YAML's optimizer; {DEFAULT_LR} if it has none)")
    ap.add_argument("--seed", type=int, default=0, help="data offsets and initial weights")
    args = ap.parse_args()

    quiet_deepspeed()  # before DeepSpeed is imported: no per-rank accelerator line or FutureWarning
    torch.set_num_threads(1)
    accelerator = MindFormersAccelerator(args.config)
    plan = accelerator.plan
    accelerator.print(plan.summary())

    # One global batch per optimizer step, laid out step after step: the dp-sharded loader hands each dp replica
    # its micro-batches of step k from rows [k*G, (k+1)*G), G = the YAML's global batch.
    rows = [row for batch in text_batches(args.max_steps, plan.global_batch_size, args.seq, seed=args.seed)
            for row in batch["input_ids"]]
    dataset = [{"input_ids": r, "labels": r} for r in rows]
    loader = DataLoader(dataset, batch_size=plan.micro_batch_size * plan.micro_batch_interleave_num, shuffle=False)

    model = tiny_llama(seed=args.seed)
    if plan.optimizer:
        optimizer = accelerator.yaml_optimizer(model)  # msp.build_optimizer: the type's maths, MindFormers' groups
        source = f"the YAML's {plan.optimizer['mindformers_type']}"
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=DEFAULT_LR)
        source = "the example's default (the YAML has no optimizer: section)"
    if args.lr is not None:
        for group in optimizer.param_groups:
            group["lr"] = args.lr
        source = "--lr"
    # msp.build_lr_scheduler: MindFormers' formula per optimizer step (total_steps: -1 becomes --max-steps)
    sched = accelerator.yaml_lr_scheduler(optimizer, total_steps=args.max_steps) if args.lr is None else None
    accelerator.print(f"optimizer: {type(optimizer).__name__} lr={optimizer.param_groups[0]['lr']} ({source}); "
                      + (f"lr schedule: {plan.lr_schedule['type']} (the YAML's lr_schedule)" if sched
                         else "lr schedule: constant"))
    if sched is not None:
        model, optimizer, loader, sched = accelerator.prepare(model, optimizer, loader, sched)  # parallelized here
    else:
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

    model.train()
    step, micro_losses = 0, []
    for batch in loader:
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            optimizer.step()
            if sched is not None:
                sched.step()  # once per optimizer step (skipped on accumulation micro-steps)
            optimizer.zero_grad()
        micro_losses.append(accelerator.reduce_loss(loss))
        if accelerator.sync_gradients:
            step += 1
            accelerator.print(f"step {step} loss {torch.stack(micro_losses).mean().item():.6f}", flush=True)
            micro_losses = []
    accelerator.end_training()


if __name__ == "__main__":
    main()
    teardown()  # barrier, DeepSpeed's and our groups destroyed, then exit (no rank aborts at exit)
