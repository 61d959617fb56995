"""`msparallel-ds train RUN.yaml`: a whole MindFormers run (model, weights, data, loop, callbacks, resume) on PyTorch.

torchtitan-style: one Trainer built from the YAML (run/trainer.py), each concern a small component:
  spec.py         the YAML (+ overrides), run_mode, output_dir, steps from runner_config
  model.py        HF model from model.model_config or pretrained_model_dir; weights (HF, engine.save, MindSpore)
  batches.py      this dp rank's rows (msparallel_ds.data) -> step batches; the position is a function of the step
  checkpoints.py  CheckpointMonitor: engine.save every save_checkpoint_steps, keep_checkpoint_max, resume
  monitor.py      MFLossMonitor: progress lines, metrics.jsonl, TensorBoard
  launch.py       the command: under torchrun / deepspeed / accelerate launch, or N local processes of its own
Nothing outside run/ imports it.
"""
from __future__ import annotations

__all__ = ["Trainer", "RunSpec"]


def __getattr__(name):
    if name == "Trainer":
        from .trainer import Trainer
        return Trainer
    if name == "RunSpec":
        from .spec import RunSpec
        return RunSpec
    raise AttributeError(name)
