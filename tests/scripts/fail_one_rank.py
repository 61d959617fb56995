"""Launched by tests/test_launchers.py under torchrun: every rank starts training, rank 1 raises after the first
step while the others are inside the next step's collectives. torchrun must stop them all (no hang)."""
import sys

import torch

import msparallel_ds as msp
from msparallel_ds.tiny import dp_rows, text_batches, tiny_llama

torch.set_num_threads(1)
engine = msp.initialize(tiny_llama, msp.load_config(sys.argv[1]),
                        optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3))
for step, batch in enumerate(text_batches(3, engine.plan.global_batch_size, 32)):
    if step == 1 and engine.layout.global_rank == 1:
        raise RuntimeError("injected failure on rank 1")
    engine.train_batch(dp_rows(batch, engine.layout))
