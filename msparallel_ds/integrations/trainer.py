"""The HF Trainer on a MindFormers parallel strategy: MindFormersTrainer and training_arguments_from_yaml.

    from msparallel_ds.integrations.trainer import MindFormersTrainer, training_arguments_from_yaml

    args = training_arguments_from_yaml("run.yaml", output_dir="out", max_steps=100, logging_steps=10)
    trainer = MindFormersTrainer(model=model, args=args, train_dataset=ds, parallel_config="run.yaml")
    trainer.train()

Run it under torchrun or accelerate launch (`msparallel-ds export run.yaml --to accelerate`), on CPU or GPU.

training_arguments_from_yaml maps runner_config, optimizer, lr_schedule, clipping and precision to
TrainingArguments (table in msparallel_ds/export/trainer.py) and carries the plan's DeepSpeed config; keyword
arguments override any field.

MindFormersTrainer is a transformers.Trainer whose accelerator is a MindFormersAccelerator (built in
create_accelerator_and_postprocess, the only place the Trainer builds one): the model is parallelized from the
YAML when the Trainer prepares it, the optimizer the Trainer created is re-pointed to the shards, dataloaders are
split over dp (tp and cp peers read the same rows), DeepSpeed runs with msparallel_ds's groups. Differences from
a plain Trainer, all so that the logged loss is the global-batch token mean of a single-process Trainer with the
same data, order and hyperparameters:
- per_device_train_batch_size is runner_config.batch_size x micro_batch_interleave_num, and
  gradient_accumulation_steps is runner_config.gradient_accumulation_steps, when the YAML gives them (a warning
  says when the TrainingArguments said otherwise).
- get_tp_size() returns tp x cp: the Trainer uses it to count data-parallel replicas (world // tp_size) when it
  sums num_items_in_batch over processes and scales the loss; tp and cp peers hold the same rows and must not
  count as replicas. get_cp_size() and get_sp_size() return 1 for that reason.
- Under cp each rank back-propagates its share of the tokens (sum / num_items_in_batch), DeepSpeed sums over
  dp x cp and divides by dp, the Trainer multiplies by dp: the update is d(sum over the global batch / tokens).
- save_model writes a plain HF checkpoint of the FULL model (tp shards and ZeRO-3 partitions gathered; global
  rank 0 writes). Each checkpoint-N folder also holds DeepSpeed's own files and msparallel_ds's layout-independent
  checkpoint (sharded: msp_checkpoint.json + dcp-*/, as engine.save writes it; not at ZeRO-3).
  train(resume_from_checkpoint=...)
  loads the latter when present, so a run resumes under the same or ANOTHER YAML layout (same global batch) with
  the losses of the uninterrupted run; the Trainer restores its own state, scheduler and RNG as usual.
The DeepSpeed config's batch, accumulation and clipping entries are "auto": the TrainingArguments fill them. When
the YAML has `optimizer:` / `lr_schedule:` sections, create_optimizer / create_scheduler build them
(msp.build_optimizer / msp.build_lr_scheduler, MindSpore's maths); without them the TrainingArguments decide the
optimizer and schedule. Clipping comes from the TrainingArguments (training_arguments_from_yaml takes the YAML's).
Evaluation before any training step needs ZeRO-3 under DeepSpeed (a transformers rule); during and after
training it works, with one copy per dp replica gathered.
"""
from __future__ import annotations

import os
import warnings
from contextlib import contextmanager
from typing import Any

import torch
from transformers import Trainer, TrainingArguments

from .accelerate import MindFormersAccelerator
from .config import refuse_pipeline, resolve_config

__all__ = ["MindFormersTrainer", "load_deepspeed_weights_only", "training_arguments_from_yaml"]

# The Trainer's TrainingArguments fill these (HfTrainerDeepSpeedConfig.trainer_config_process)
_TRAINER_FILLS = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
                  "gradient_clipping": "auto"}


@contextmanager
def _without_launcher_deepspeed_fields():
    """Under `accelerate launch` with a DeepSpeed section, accelerate refuses a DeepSpeed config dict while the
    launcher's deepspeed fields are in the environment; the YAML's config is the one meant."""
    saved = os.environ.pop("ACCELERATE_CONFIG_DS_FIELDS", None)
    try:
        yield
    finally:
        if saved is not None:
            os.environ["ACCELERATE_CONFIG_DS_FIELDS"] = saved


def training_arguments_from_yaml(config: Any = None, output_dir: str = "trainer_output", *,
                                 deepspeed: bool = True, **overrides: Any) -> TrainingArguments:
    """TrainingArguments for the MindFormers YAML `config` (path, dict, YAML text or ParallelConfig; None: the
    path in MSPARALLEL_CONFIG). `overrides` are TrainingArguments fields and win. Half precision (bf16/fp16 from
    compute_dtype) only on GPU. Run where the processes are launched: the world size (WORLD_SIZE) is checked
    against the YAML's."""
    from ..runtime import disable_inference_shm_build
    from ..export.trainer import training_arguments_kwargs
    from ..plan import make_plan

    cfg = resolve_config(config)
    world = int(os.environ["WORLD_SIZE"]) if os.environ.get("WORLD_SIZE") else None
    plan = make_plan(cfg, world_size=world)
    cuda = torch.cuda.is_available()
    if not cuda:
        disable_inference_shm_build()  # TrainingArguments(deepspeed=...) starts DeepSpeed's comm: no JIT build
    kwargs = training_arguments_kwargs(plan, output_dir, gpu=cuda, deepspeed=deepspeed, **overrides)
    with _without_launcher_deepspeed_fields():
        return TrainingArguments(**kwargs)


class MindFormersTrainer(Trainer):
    """transformers.Trainer running the MindFormers YAML `parallel_config` (path, dict, YAML text or
    ParallelConfig; None: MSPARALLEL_CONFIG) through MindFormersAccelerator. Every other argument is the
    Trainer's; `args` defaults to training_arguments_from_yaml(parallel_config)."""

    def __init__(self, model=None, args: TrainingArguments | None = None, *trainer_args,
                 parallel_config: Any = None, **trainer_kwargs):
        cfg = resolve_config(parallel_config)
        refuse_pipeline(cfg, "MindFormersTrainer")
        self.msp_config = cfg
        if args is None:
            args = training_arguments_from_yaml(cfg)
        if args.use_cpu:
            raise ValueError("TrainingArguments(use_cpu=True) switches DeepSpeed off; leave it out: "
                             "MindFormersTrainer runs DeepSpeed on CPU over gloo by itself")
        given = cfg.runner_config.model_fields_set
        bs, mbi = cfg.runner_config.batch_size, cfg.micro_batch_interleave_num
        batch_from = (f"runner_config.batch_size={bs}" if mbi == 1 else
                      f"runner_config.batch_size={bs} x micro_batch_interleave_num={mbi}")
        gas = cfg.runner_config.gradient_accumulation_steps
        for key, field, value, source in (
                ("batch_size", "per_device_train_batch_size", bs * mbi, batch_from),
                ("gradient_accumulation_steps", "gradient_accumulation_steps", gas,
                 f"runner_config.gradient_accumulation_steps={gas}")):
            if key in given and getattr(args, field) != value:
                warnings.warn(f"TrainingArguments.{field}={getattr(args, field)} replaced by {value}, from the "
                              f"YAML's {source}", stacklevel=2)
                setattr(args, field, value)
        super().__init__(model, args, *trainer_args, **trainer_kwargs)

    # ------------------------------------------------------------------------------------------ accelerator
    def create_accelerator_and_postprocess(self) -> None:
        import transformers.trainer as hf_trainer
        from transformers.integrations.deepspeed import (
            HfTrainerDeepSpeedConfig,
            propagate_args_to_deepspeed,
        )

        cfg = self.msp_config

        def build(**kwargs):
            kwargs.pop("deepspeed_plugin", None)  # the YAML's, built by MindFormersAccelerator
            for key in ("fsdp_plugin", "parallelism_config"):
                if kwargs.pop(key, None) is not None:
                    raise ValueError(f"MindFormersTrainer: TrainingArguments ask for {key}; the MindFormers YAML "
                                     "decides the parallelism, leave fsdp / parallelism_config unset")
            return MindFormersAccelerator(cfg, deepspeed_config=_TRAINER_FILLS, **kwargs)

        original = hf_trainer.Accelerator
        hf_trainer.Accelerator = build
        try:
            with _without_launcher_deepspeed_fields():
                super().create_accelerator_and_postprocess()
        finally:
            hf_trainer.Accelerator = original
        plugin = self.accelerator.state.deepspeed_plugin
        if not isinstance(plugin.hf_ds_config, HfTrainerDeepSpeedConfig):  # the Trainer skips it when args.deepspeed
            propagate_args_to_deepspeed(self.accelerator, self.args)

    @property
    def layout(self):
        return self.accelerator.layout

    def get_tp_size(self) -> int:
        """Ranks that hold the same rows (tp x cp): the Trainer divides the world by this to count dp replicas."""
        return self.accelerator.layout.size("tp") * self.accelerator.layout.size("cp")

    def get_cp_size(self) -> int:
        return 1  # counted in get_tp_size (see the module docstring)

    def get_sp_size(self) -> int:
        return 1

    # ------------------------------------------------------------------------------------------ optimizer, schedule
    def create_optimizer(self):
        """The YAML's `optimizer:` (msp.build_optimizer: its type's maths, MindFormers' decay groups) when the YAML
        has one and no optimizer was passed in; otherwise the Trainer's own (TrainingArguments decide)."""
        if self.optimizer is None and self.msp_config.optimizer is not None:
            from ..optim import build_optimizer

            self.optimizer = build_optimizer(self.model, self.msp_config)
        return super().create_optimizer()

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        """The YAML's lr_schedule (msp.build_lr_scheduler; total_steps -1 is the Trainer's num_training_steps) when
        the YAML has one; otherwise the Trainer's lr_scheduler_type."""
        cfg = self.msp_config
        if self.lr_scheduler is None and (cfg.lr_schedule is not None or cfg.grouped_lr_schedule is not None):
            from ..optim import build_lr_scheduler

            self.lr_scheduler = build_lr_scheduler(optimizer or self.optimizer, cfg, total_steps=num_training_steps)
            self._created_lr_scheduler = True
        return super().create_scheduler(num_training_steps, optimizer)

    # ------------------------------------------------------------------------------------------ checkpoints
    def _checkpoint_view(self):
        """What msparallel_ds.checkpoint needs of an engine; the Trainer saves and restores its scheduler itself."""
        from types import SimpleNamespace

        from ..strategy import applied_to

        return SimpleNamespace(ds=self.model_wrapped, layout=self.layout, model=self.model, lr_scheduler=None,
                               global_steps=self.state.global_step, spec=applied_to(self.model).spec)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        super()._save_optimizer_and_scheduler(output_dir)  # DeepSpeed's own files (same-layout resume)
        if self.is_deepspeed_enabled and self.model_wrapped.zero_optimization_stage() < 3:
            from ..checkpoint.zero import save_checkpoint

            save_checkpoint(self._checkpoint_view(), output_dir)

    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        """Trainer.train; a checkpoint with ours (msp_checkpoint.json, or msp_universal.pt) resumes under any layout (see the module docstring)."""
        import transformers.trainer as hf_trainer

        from ..checkpoint.folder import has_checkpoint
        from ..checkpoint.zero import load_checkpoint

        deepspeed_load = hf_trainer.deepspeed_load_checkpoint

        def load(engine, path, **load_kwargs):
            if has_checkpoint(path):  # ours in any format (msp_universal.pt, sharded, converted)
                load_checkpoint(self._checkpoint_view(), path)
            else:  # not ours: DeepSpeed's files, never unpickled with code (hardening round 2, item 8)
                load_deepspeed_weights_only(deepspeed_load, engine, path, **load_kwargs)

        hf_trainer.deepspeed_load_checkpoint = load
        try:
            return super().train(resume_from_checkpoint, *args, **kwargs)
        finally:
            hf_trainer.deepspeed_load_checkpoint = deepspeed_load

    # ------------------------------------------------------------------------------------------ saving
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """A plain HF checkpoint of the full model (every rank must call; global rank 0 writes)."""
        model = self.model
        from ..strategy import applied_to

        if applied_to(model) is None:  # not prepared (parallelized) yet: the Trainer's own save
            return super().save_model(output_dir, _internal_call)
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        self.accelerator.save_pretrained(model, output_dir)
        if self.args.should_save:
            from transformers.trainer import TRAINING_ARGS_NAME

            if self.processing_class is not None:
                self.processing_class.save_pretrained(output_dir)
            torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)


def _deepspeed_safe_globals() -> list:
    """The only non-plain objects DeepSpeed's ZeRO-1/2/3 files hold (fp16/bf16 loss scalers, the stage enum, the
    fragment map): plain data classes, allowed to the weights-only unpickler."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


def load_deepspeed_weights_only(deepspeed_load, engine, path: str, **load_kwargs) -> Any:
    """DeepSpeed's checkpoint loader with every torch.load in it weights-only. DeepSpeed unpickles its files
    (torch.load(weights_only=False)), so a crafted mp_rank_00_model_states.pt in a folder handed to resume would run
    code; here such a file is refused with a message naming the folder."""
    import pickle

    real = torch.load

    def weights_only(*args, **kwargs):
        kwargs["weights_only"] = True
        return real(*args, **kwargs)

    torch.load = weights_only
    try:
        with torch.serialization.safe_globals(_deepspeed_safe_globals()):
            return deepspeed_load(engine, path, **load_kwargs)
    except pickle.UnpicklingError as e:
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
        detail = next((ln for ln in lines if "Unsupported global" in ln), lines[0] if lines else type(e).__name__)
        raise ValueError(
            f"{path}: DeepSpeed's checkpoint files hold objects other than tensors and plain data ({detail}); "
            f"msparallel_ds reads DeepSpeed's files weights-only and will not unpickle them. Resume from a checkpoint "
            f"msparallel_ds saved (it holds {_ours_name()}), or check where this folder came from.") from None
    finally:
        torch.load = real


def _ours_name() -> str:
    from ..checkpoint.folder import MANIFEST
    from ..checkpoint.format import FILE

    return f"{MANIFEST} (or the older {FILE})"
