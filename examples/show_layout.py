"""Build the process groups a MindFormers YAML describes and print each rank's place in them.

Run on CPU with 4 processes (gloo):
    torchrun --nproc_per_node 4 examples/show_layout.py --config configs/tiny_dp2_tp2.yaml
The deepspeed launcher works too: deepspeed --num_gpus 4 examples/show_layout.py --config ...
"""
import argparse
import os

import torch
import torch.distributed as dist

import msparallel_ds as msp


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--local_rank", type=int, default=None)  # passed by the deepspeed launcher
    args = ap.parse_args()
    cfg = msp.load_config(args.config)
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend)
    layout = msp.init_parallel(cfg)
    rank = dist.get_rank()
    if rank == 0:
        print(msp.make_plan(cfg, world_size=dist.get_world_size()).summary(), flush=True)
    dist.barrier()
    names = ("pp", "dp", "cp_ring", "cp_ulysses", "tp", "cp", "dp_cp")
    line = ", ".join(f"{n} {layout.rank(n)}/{layout.size(n)} {list(layout.ranks(n))}" for n in names)
    for r in range(dist.get_world_size()):  # print in rank order
        if r == rank:
            print(f"rank {rank}: {line}", flush=True)
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
