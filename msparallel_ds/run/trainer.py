"""The Trainer: built from the YAML, one component per concern, the loop in `train` (one screen)."""
from __future__ import annotations

import os
import shutil
import time

import torch
import torch.distributed as dist

import msparallel_ds as msp

from .. import runtime
from ..data import open_train_dataset
from .batches import StepBatches
from .checkpoints import CheckpointMonitor
from .model import build_model, check_sources
from .monitor import LossMonitor
from .spec import RunSpec


class Trainer:
    def __init__(self, spec: RunSpec, echo=print):
        self.spec, raw = spec, spec.raw
        check_sources(raw)                                            # load_checkpoint, src_strategy_path_or_dir
        self.cfg = msp.load_config(raw)                               # parallel_config, parallel, runner_config, ...
        if not torch.cuda.is_available():  # as msp.initialize does: no JIT build of DeepSpeed's inference-only op
            runtime.disable_inference_shm_build()
        runtime.ensure_distributed(None)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.layout = msp.init_parallel(self.cfg)
        plan = self.layout.plan
        run_yaml = spec.write(spec.output_dir)                        # output_dir/run.yaml: the merged YAML
        dp, d = self.layout.size("dp"), self.layout.rank("dp")
        rows = open_train_dataset(raw, dp_rank=d, dp_size=dp)         # train_dataset
        mc = (raw.get("model") or {}).get("model_config") or {}
        pad = mc.get("pad_token_id", 0)                              # LlamaConfig's default
        self.data = StepBatches(rows, plan.global_batch_size // dp, plan.global_batch_size,
                                int(mc.get("seq_length") or 0), bool(mc.get("input_sliced_sig", False)),
                                None if pad is None else int(pad))
        self.total_steps = spec.epochs * self.data.steps_per_epoch     # runner_config.epochs x samples / global batch
        self.stop = min(self.total_steps, spec.stop_after or self.total_steps)
        n_params = []

        def model():                                                  # model (+ load_checkpoint), seeded init
            m = build_model(raw, run_yaml, spec.seed)
            n_params.append(sum(p.numel() for p in m.parameters()))
            return m
        self.engine = msp.initialize(model, self.cfg, layout=self.layout, total_steps=self.total_steps)
        torch.manual_seed(spec.seed + self.rank)                      # dropout etc.: per rank, restored on resume
        ck = spec.callback("CheckpointMonitor") or {}                 # callbacks
        self.checkpoints = CheckpointMonitor(spec.output_dir, ck.get("save_checkpoint_steps"),
                                             ck.get("keep_checkpoint_max"), self.rank, ck.get("replicas", 0),
                                             ck.get("async_save", False), ck.get("integrated_save", False),
                                             ck.get("checkpoint_format", "ckpt"))
        self.checkpoints.start(self.engine)
        lm = spec.callback("MFLossMonitor") or {}
        self.monitor = LossMonitor(spec.output_dir, lm.get("per_print_times", 1), self.total_steps, self.rank,
                                   self.world, n_params[0], spec.tensorboard, echo)
        self.tokens_per_step = plan.global_batch_size * (int(mc.get("seq_length") or 0) or 1)
        self.step = 0
        if spec.resume:                                               # resume_training
            self.step = self.checkpoints.load(self.engine, spec.resume)["step"]
            self.monitor.resumed_at(self.step)
        self.echo = echo if self.rank == 0 else (lambda *_: None)

    def train(self) -> dict:
        self.echo(f"training {self.total_steps} steps ({self.spec.epochs} epochs x {self.data.steps_per_epoch}); "
                  f"from step {self.step}" + (f", stopping after step {self.stop}" if self.stop < self.total_steps
                                              else ""))
        losses = {}
        while self.step < self.stop:
            t0 = time.perf_counter()
            lr = self.engine.optimizer.param_groups[0]["lr"]
            loss = float(self.engine.train_batch(self.data.batch(self.step)))
            self.step += 1
            losses[self.step] = loss
            self.monitor.log(self.step, loss, lr, self.engine.global_grad_norm, self.tokens_per_step,
                             time.perf_counter() - t0, self.engine.last_aux_loss, self.engine.last_mtp_loss)
            if self.checkpoints.due(self.step):
                self.checkpoints.save(self.engine, self.step, {"step": self.step, "total_steps": self.total_steps})
        self.checkpoints.finish(self.engine)                          # an async save still in flight
        if self.step == self.total_steps:                             # the end of the schedule: a HF folder
            hf = os.path.join(self.spec.output_dir, "hf")
            if self.rank == 0:
                shutil.rmtree(hf, ignore_errors=True)
            dist.barrier()
            self.engine.save_pretrained(hf)
        self.monitor.close()
        return {"losses": losses, "step": self.step, "total_steps": self.total_steps}
