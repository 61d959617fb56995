"""Train a tiny Llama under a MindFormers YAML with msp.initialize, launched by torchrun or the deepspeed launcher.

    torchrun --nproc_per_node 4 examples/train_deepspeed.py --config configs/tiny_dp2_tp2.yaml --max-steps 5
    deepspeed --num_gpus 4 examples/train_deepspeed.py --config configs/tiny_dp2_tp2.yaml --max-steps 5
    python examples/train_deepspeed.py --config configs/tiny_dp1.yaml --max-steps 5     # one process
    torchrun ... --save-dir ckpt --save-every 2      # engine.save every 2 steps (a kill leaves the last one intact)
    torchrun ... --config OTHER.yaml --resume ckpt   # continue from it under any layout with the same global batch
    torchrun --nproc_per_node 4 examples/train_deepspeed.py --config configs/tiny_pp2.yaml --max-steps 5  # pipeline

The same script runs pipeline parallel (pipeline_stage > 1): msp.initialize returns the pipeline engine and
train_batch runs the YAML's schedule (configs/tiny_pp2.yaml: pp 2 x tp 2 + SP, interleaved 1F1B, 4 micro-batches;
checked on 4 CPU processes with torchrun). accelerate / the HF Trainer cannot drive a pipeline: use this launcher.

Both launchers set RANK / WORLD_SIZE / MASTER_ADDR; the deepspeed launcher also passes --local_rank, accepted
and ignored here (LOCAL_RANK is in the environment too). On a machine without a GPU, msp.initialize starts gloo;
`deepspeed --num_gpus N` then needs DS_ACCELERATOR=cpu (the launcher counts CPU "devices" by NUMA node otherwise).
The model is built from a LlamaConfig (no download) and trains on the public-domain text shipped with the package
(byte tokens). Optimizer and learning-rate schedule come from the YAML (`optimizer:`, `lr_schedule:`), the same as
under the accelerate and Trainer examples; `--lr` overrides the learning rate (the schedule's peak too). Rank 0
prints which optimizer and schedule run, then the global-batch mean loss of every step.
"""
import argparse

import torch

import msparallel_ds as msp
from msparallel_ds.runtime import quiet_deepspeed, teardown
from msparallel_ds.tiny import dp_rows, text_batches, tiny_llama

DEFAULT_LR = 3e-3  # only when the YAML has no optimizer section and no --lr is given


def optimizer_choice(plan, lr):
    """(optimizer factory or None for the YAML's, lr_scheduler or None for the YAML's, a line saying what runs)."""
    yaml_opt, sched = plan.optimizer, plan.lr_schedule
    if yaml_opt and lr is None:  # msp.build_optimizer / msp.build_lr_scheduler, as msp.initialize builds them
        what = f"lr schedule: {sched['type']} (the YAML's lr_schedule)" if sched else "constant lr"
        return None, None, f"optimizer: the YAML's {yaml_opt['mindformers_type']} as {yaml_opt['runs_as']}; {what}"
    params = dict(yaml_opt["params"]) if yaml_opt else {}  # --lr over the YAML's betas / eps / weight decay
    params = {k: tuple(v) if k == "betas" else v for k, v in params.items() if k in ("betas", "eps", "weight_decay")}
    params["lr"] = DEFAULT_LR if lr is None else lr
    source = "--lr" if lr is not None else "the example's default (the YAML has no optimizer: section)"
    no_schedule = lambda opt: None  # noqa: E731  --lr: a constant rate, the YAML's schedule left out
    return (lambda p: torch.optim.AdamW(p, **params)), no_schedule, f"optimizer: AdamW {params} ({source})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True, help="MindFormers YAML")
    ap.add_argument("--max-steps", type=int, default=10)
    ap.add_argument("--seq", type=int, default=64, help="tokens per row")
    ap.add_argument("--lr", type=float, default=None,
                    help=f"learning rate (default: the YAML's optimizer; {DEFAULT_LR} if it has none)")
    ap.add_argument("--save-dir", default=None, help="engine.save here every --save-every steps")
    ap.add_argument("--save-every", type=int, default=1)
    ap.add_argument("--resume", default=None, help="engine.load this checkpoint and continue after its step")
    ap.add_argument("--local_rank", "--local-rank", type=int, default=None, help="set by the deepspeed launcher")
    args = ap.parse_args()

    quiet_deepspeed()  # before DeepSpeed is imported: no per-rank accelerator line or FutureWarning
    torch.set_num_threads(1)
    cfg = msp.load_config(args.config)
    optimizer, lr_scheduler, line = optimizer_choice(msp.make_plan(cfg), args.lr)
    engine = msp.initialize(tiny_llama, cfg, optimizer=optimizer, lr_scheduler=lr_scheduler,
                            total_steps=args.max_steps)  # total_steps: the YAML's `total_steps: -1`
    lay = engine.layout
    if lay.global_rank == 0:
        print(engine.plan.summary(), flush=True)
        print(line, flush=True)
    done = engine.load(args.resume)["global_steps"] if args.resume else 0
    for step, batch in enumerate(text_batches(args.max_steps, engine.plan.global_batch_size, args.seq)):
        if step < done:  # the same data order as the uninterrupted run
            continue
        loss = engine.train_batch(dp_rows(batch, lay))
        if lay.global_rank == 0:
            print(f"step {step + 1} loss {loss.item():.6f}", flush=True)
        if args.save_dir and (step + 1) % args.save_every == 0:
            engine.save(args.save_dir)


if __name__ == "__main__":
    main()
    teardown()  # barrier, DeepSpeed's and our groups destroyed, then exit (no rank aborts at exit)
