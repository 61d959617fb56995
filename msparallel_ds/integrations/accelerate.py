"""MindFormersAccelerator: an `accelerate.Accelerator` that runs a MindFormers parallel strategy (YAML).

    from msparallel_ds.integrations.accelerate import MindFormersAccelerator

    accelerator = MindFormersAccelerator("run.yaml")    # or no argument and MSPARALLEL_CONFIG=run.yaml
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    for batch in loader:
        with accelerator.accumulate(model):
            loss = model(**batch).loss                  # this rank's loss (see "Loss" below)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        logged = accelerator.reduce_loss(loss)          # the global-batch mean, the same on every rank

Launch (4 processes, on CPU as on GPU):

    msparallel-ds export run.yaml --to accelerate -o accelerate.yaml
    MSPARALLEL_CONFIG=run.yaml accelerate launch --config_file accelerate.yaml train.py

`torchrun` works too (the accelerator starts the process group itself); a world size other than the YAML's
stops every rank before any model is built.

What it does, and why:
- Process group: gloo on a CPU-only machine (with DeepSpeed on CPU accelerate picks no backend and every rank
  believes it is rank 0 of 1), nccl on GPU. A PartialState left broken that way by an earlier
  `TrainingArguments(deepspeed=...)` is rebuilt. `cpu=True` is refused: it switches DeepSpeed off.
- DeepSpeed: the plugin holds the plan's DeepSpeed config (ZeRO stage over dp x cp, micro batch and gradient
  accumulation, clipping, precision: fp32 on CPU); the launcher file's own deepspeed fields are not used, the YAML
  is. DeepSpeed gets our process groups (`layout.mpu()`) and always a torch optimizer.
- `prepare(model, optimizer, ...)`: the model is parallelized in place (msp.parallelize: TP/SP/vocab parallel, CP
  attention, recompute, all from the YAML). An optimizer built on the unsharded model is re-pointed IN PLACE to the
  sharded parameters, by parameter name: same object, class, param groups and hyperparameters, so a scheduler built on
  it stays valid. It must not have state yet; `yaml_optimizer(model)` / `yaml_lr_scheduler(opt, total_steps)`:
  msp.build_optimizer / msp.build_lr_scheduler (stepped once per optimizer step).
- Data: dataloaders are split over the data-parallel ranks only (num_processes = dp, process_index = dp rank):
  the tp and cp peers of a dp rank see the same samples. An LR scheduler left to accelerate steps dp times per
  optimizer step (accelerate's rule, with dp replicas instead of processes). With cp > 1 every forward shards
  the batch over cp (context_parallel.batch.shard_batch: labels shifted before the split, global position_ids,
  doc_ids for packed rows), so `model(**batch)` takes the full sequences.
- Loss: with cp > 1, `model(**batch).loss` back-propagates this rank's SHARE of the micro-batch mean (its token
  losses / the micro-batch's valid tokens on the whole cp group): DeepSpeed sums gradients over dp x cp and
  divides by dp. Its VALUE is the micro-batch mean (share + (mean - share).detach()), so logging it is right. With
  `num_items_in_batch` in the batch (HF Trainer) the share is (its token losses) / num_items_in_batch instead.
  Vocab parallel (vocab_emb_dp: false) uses the vocab-parallel cross-entropy (the model's loss_function).
  Under cp the returned logits are this rank's sequence shard (zigzag order for a causal ring).
- `gather_for_metrics` keeps one copy per dp replica (tp and cp peers hold duplicates); `gather` is untouched.
  `micro_batch_interleave_num` copies are not interleaved here (use msp.initialize for that); the per-device
  batch is runner_config.batch_size x micro_batch_interleave_num, as in the engine.
"""
from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from contextlib import contextmanager, nullcontext
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.scheduler import AcceleratedScheduler
from accelerate.utils import InitProcessGroupKwargs
from torch import nn

from .. import optim as msp_optim
from ..distributed.collectives import sum_over
from ..labels import IGNORE_INDEX
from .config import CONFIG_ENV, refuse_pipeline, resolve_config

if TYPE_CHECKING:
    from ..distributed.layout import ParallelLayout

__all__ = ["CONFIG_ENV", "MindFormersAccelerator", "resolve_config"]

# accelerate features that would fight ours over the model, the groups or the DeepSpeed config
_REFUSED = ("deepspeed_plugin", "deepspeed_plugins", "fsdp_plugin", "megatron_lm_plugin", "torch_tp_plugin",
            "parallelism_config")


def _repair_partial_state() -> None:
    """accelerate keeps one process-wide state. One built under DeepSpeed on a CPU-only machine (TrainingArguments
    with `deepspeed=`, or a plain Accelerator()) has no backend and says rank 0 of 1 while torch.distributed spans
    every rank: drop it, so ours is built with the backend."""
    from accelerate.state import AcceleratorState, PartialState

    shared = PartialState._shared_state
    if shared and shared.get("backend") is None and dist.is_initialized() and dist.get_world_size() > 1:
        AcceleratorState._reset_state(reset_partial_state=True)


def _deepspeed_plugin(ds_config: dict):
    """A DeepSpeedPlugin holding exactly `ds_config`. Under `accelerate launch` the launcher's deepspeed fields
    (ACCELERATE_CONFIG_DS_FIELDS, ACCELERATE_DEEPSPEED_*) would make accelerate refuse a config dict or fill it
    from the environment; the YAML is the source of truth, so the plugin's fields are given explicitly."""
    from accelerate.utils import DeepSpeedPlugin

    zero = ds_config.get("zero_optimization", {})
    stage = zero.get("stage", 0)
    env_stage = os.environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE")
    if env_stage is not None and env_stage.isdigit() and int(env_stage) != stage:
        warnings.warn(f"the accelerate launch config says zero_stage={env_stage}; the MindFormers YAML's ZeRO stage "
                      f"{stage} is used (regenerate the launch file with `msparallel-ds export FILE --to accelerate`)",
                      stacklevel=3)
    saved = os.environ.pop("ACCELERATE_CONFIG_DS_FIELDS", None)
    try:
        return DeepSpeedPlugin(hf_ds_config=ds_config, zero_stage=stage, zero3_init_flag=False,
                               gradient_accumulation_steps=ds_config.get("gradient_accumulation_steps", 1),
                               gradient_clipping=ds_config.get("gradient_clipping", 0.0),
                               offload_optimizer_device="cpu" if "offload_optimizer" in zero else "none",
                               offload_param_device="cpu" if "offload_param" in zero else "none")
    finally:
        if saved is not None:
            os.environ["ACCELERATE_CONFIG_DS_FIELDS"] = saved


@contextmanager
def _deepspeed_initialize_with(mpu):
    """accelerate calls deepspeed.initialize without an mpu (it passes one only for its own Ulysses SP): add ours."""
    import deepspeed

    original = deepspeed.initialize

    def initialize(*args, **kwargs):
        if kwargs.get("mpu") is None:
            kwargs["mpu"] = mpu
        return original(*args, **kwargs)

    deepspeed.initialize = initialize
    try:
        yield
    finally:
        deepspeed.initialize = original


def _repoint_optimizer(optimizer: torch.optim.Optimizer, names_before: dict[int, str], model: nn.Module) -> None:
    """Swap the optimizer's parameters for the parallelized model's, by name, in place (accelerate does the same
    for XLA and TransformerEngine): class, param groups, hyperparameters and schedulers built on it are kept."""
    after = dict(model.named_parameters(remove_duplicate=False))
    current = {id(p) for p in after.values()}
    stale = [p for g in optimizer.param_groups for p in g["params"] if id(p) not in current]
    if not stale:
        return
    if any(optimizer.state.get(p) for p in stale):
        raise ValueError("the optimizer passed to prepare() already has state for parameters that msp.parallelize "
                         "replaced (tensor-parallel shards): build it before training, or build it on the model "
                         "returned by msp.parallelize(model, accelerator.layout)")
    for group in optimizer.param_groups:
        params = []
        for p in group["params"]:
            if id(p) in current:
                params.append(p)
                continue
            name = names_before.get(id(p))
            if name is None or name not in after:
                raise ValueError(f"the optimizer holds a parameter {'' if name is None else repr(name) + ' '}that is "
                                 "not one of the prepared model's; build the optimizer on that model's parameters")
            params.append(after[name])
        group["params"] = params


def _install_cp_batch_hooks(model: nn.Module, layout: ParallelLayout) -> None:
    """Shard every forward's batch over cp and turn the loss into this rank's share of the micro-batch mean
    (gradient) whose value is the micro-batch mean (logging). See the module docstring."""
    if getattr(model, "_msp_cp_hooks", False):
        return
    from ..context_parallel.batch import shard_batch

    def shard_inputs(module, args, kwargs):
        if args:
            if len(args) > 1 or "input_ids" in kwargs:
                raise TypeError("under context parallel call the model with keyword arguments: model(**batch)")
            kwargs = {"input_ids": args[0], **kwargs}
        has_labels = kwargs.get("labels") is not None or kwargs.get("shift_labels") is not None
        kwargs.setdefault("use_cache", False)
        out = shard_batch(kwargs, layout)
        if has_labels:
            targets = out["shift_labels"]
            out["labels"] = targets  # HF computes a loss only when labels are given; shift_labels are not re-shifted
            if out.get("num_items_in_batch") is None:
                count = sum_over(layout, "cp", (targets != IGNORE_INDEX).sum().to(torch.float32))
                out["num_items_in_batch"] = count.clamp_min(1.0)  # loss = local token sum / micro-batch tokens
        return (), out

    def mean_value(module, args, kwargs, output):
        if kwargs.get("shift_labels") is None:
            return output
        loss = output["loss"] if isinstance(output, Mapping) else output[0]
        if loss is None:
            return output
        total = sum_over(layout, "cp", loss.detach().clone())
        loss = loss + (total - loss.detach())  # gradient: the share; value: the micro-batch loss
        if isinstance(output, Mapping):
            output["loss"] = loss
            return output
        return (loss, *output[1:])

    model.register_forward_pre_hook(shard_inputs, with_kwargs=True)
    model.register_forward_hook(mean_value, with_kwargs=True)
    model._msp_cp_hooks = True


class _DataParallelScheduler(AcceleratedScheduler):
    """accelerate steps a scheduler num_processes times per optimizer step (each process's loader holds 1/N of
    the samples); here the loader is split over the dp replicas only, so it steps dp times."""

    data_parallel_size = 1

    def step(self, *args, **kwargs):
        if (not self.step_with_optimizer or not self.gradient_state.sync_gradients or self.split_batches
                or any(opt.step_was_skipped for opt in self.optimizers)):
            return super().step(*args, **kwargs)
        for _ in range(self.data_parallel_size):
            if hasattr(self.scheduler, "total_steps") and self.scheduler._step_count > self.scheduler.total_steps:
                break
            self.scheduler.step(*args, **kwargs)


class MindFormersAccelerator(Accelerator):
    """accelerate.Accelerator running the MindFormers YAML `config` (path, dict, YAML text or ParallelConfig;
    default: the path in MSPARALLEL_CONFIG) over DeepSpeed with msparallel_ds's groups. Other keyword arguments go
    to Accelerator (except the plugins and parallelism_config, which the YAML decides). `deepspeed_config` entries
    override the plan's DeepSpeed config. Attributes: `layout` (ParallelLayout), `plan`, `msp_config`."""

    def __init__(self, config: Any = None, *, deepspeed_config: Mapping[str, Any] | None = None,
                 **accelerator_kwargs):
        from ..distributed.layout import init_parallel
        from .. import runtime

        for key in _REFUSED:
            if accelerator_kwargs.get(key) is not None:
                raise ValueError(f"MindFormersAccelerator builds `{key}` from the MindFormers YAML; do not pass it")
        if accelerator_kwargs.get("cpu"):
            raise ValueError("cpu=True turns DeepSpeed off in accelerate; on a machine without GPUs leave it out: "
                             "MindFormersAccelerator runs DeepSpeed on CPU over gloo by itself")
        cfg = resolve_config(config)
        refuse_pipeline(cfg, "MindFormersAccelerator")  # before any process group: nothing to clean up
        cuda = torch.cuda.is_available()
        handlers = list(accelerator_kwargs.pop("kwargs_handlers", None) or [])
        init = next((h for h in handlers if isinstance(h, InitProcessGroupKwargs)), None)
        if init is None and not cuda:
            init = InitProcessGroupKwargs(backend="gloo")
            handlers.append(init)
        if cuda:  # before any NCCL group (the layout's DeviceMesh is built before accelerate's state)
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        else:
            runtime.disable_inference_shm_build()  # before deepspeed's comm backend starts: else a 1-minute JIT build
        runtime.ensure_distributed(init.timeout.total_seconds() if init is not None and init.timeout else None)
        _repair_partial_state()
        layout = init_parallel(cfg)
        plan = layout.plan

        ds = runtime.deepspeed_config(plan, layout, overrides=deepspeed_config)
        wanted = {"bf16": "bf16", "fp16": "fp16"}.get(plan.compute_dtype, "no") if cuda else "no"
        given = accelerator_kwargs.pop("mixed_precision", None)
        if given is not None and str(given) not in ("no", wanted):
            warnings.warn(f"mixed_precision={given!r} ignored: the YAML's compute_dtype ({plan.compute_dtype}) decides "
                          f"({wanted!r} here)", stacklevel=2)
        gas = ds.get("gradient_accumulation_steps")
        if isinstance(gas, int) and accelerator_kwargs.get("gradient_accumulation_plugin") is None:
            accelerator_kwargs.setdefault("gradient_accumulation_steps", gas)  # accelerate takes DeepSpeed's anyway
        super().__init__(deepspeed_plugin=_deepspeed_plugin(ds), kwargs_handlers=handlers, mixed_precision=wanted,
                         **accelerator_kwargs)
        if self.num_processes != layout.world_size:
            raise RuntimeError(f"accelerate sees {self.num_processes} processes but torch.distributed has "
                               f"{layout.world_size}: its state was created before MindFormersAccelerator without a "
                               "process-group backend")
        self.layout, self.plan, self.msp_config = layout, plan, cfg

    # ------------------------------------------------------------------------------------------ ranks
    @property
    def data_parallel_size(self) -> int:
        return self.layout.size("dp")

    @property
    def data_parallel_rank(self) -> int:
        return self.layout.rank("dp")

    @property
    def tensor_parallel_rank(self) -> int:
        return self.layout.rank("tp")

    @property
    def context_parallel_rank(self) -> int:
        return self.layout.rank("cp")

    # ------------------------------------------------------------------------------------------ helpers
    def yaml_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        """msp.build_optimizer(model, YAML) on the unsharded model (prepare() re-points it to the shards)."""
        return msp_optim.build_optimizer(model, self.msp_config)

    def yaml_lr_scheduler(self, optimizer, total_steps: Optional[int] = None):
        """msp.build_lr_scheduler (None without an lr_schedule); prepare() steps it once per optimizer step."""
        return msp_optim.build_lr_scheduler(optimizer, self.msp_config, total_steps)

    def reduce_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """`loss` (this rank's micro-batch mean, as model(**batch).loss returns it) averaged over the dp replicas:
        the global-batch mean when the replicas hold equally many tokens; detached, float32, on every rank."""
        out = sum_over(self.layout, "dp", loss.detach().float().clone())
        if self.layout.size("dp") > 1:
            out /= self.layout.size("dp")
        return out

    def end_training(self):
        """Every rank meets before the process groups are shut down: a rank whose gloo pairs close while a peer is
        still leaving its last collective can abort that peer at exit (CI once: SIGABRT, 'terminate called without
        an active exception', after all steps had run)."""
        if dist.is_initialized():
            dist.barrier()
        super().end_training()

    def gather_for_metrics(self, input_data, use_gather_object=False):
        """accelerate's gather_for_metrics with one copy per dp replica (tensors; objects are gathered as is)."""
        self._msp_dedup = True
        try:
            return super().gather_for_metrics(input_data, use_gather_object=use_gather_object)
        finally:
            self._msp_dedup = False

    def gather(self, tensor):
        out = super().gather(tensor)
        if not getattr(self, "_msp_dedup", False) or self.layout.size("tp") * self.layout.size("cp") == 1:
            return out
        from accelerate.utils import recursively_apply

        world = self.layout.world_size
        peers = world // self.layout.size("dp")  # rank = (d * cp + c) * tp + t with pp == 1
        keep = list(range(0, world, peers))
        return recursively_apply(lambda t: torch.cat([t.chunk(world)[r] for r in keep]), out)

    # ------------------------------------------------------------------------------------------ weights
    def get_state_dict(self, model, unwrap=True):
        """The FULL state dict: tensor-parallel shards all-gathered (on every rank, CPU); otherwise accelerate's
        (ZeRO-3 needs stage3_gather_16bit_weights_on_model_save there)."""
        inner = self.unwrap_model(model) if unwrap else model
        inner = getattr(inner, "module", inner)
        from ..strategy import applied_to

        done = applied_to(inner)
        if done is not None and self.layout.size("tp") > 1:
            from ..checkpoint.reshard import gather_full_state_dict

            return gather_full_state_dict(inner, self.layout, spec=done.spec, rank0_only=False)
        return super().get_state_dict(model, unwrap)

    def save_pretrained(self, model, save_dir: str, **hf_kwargs) -> None:
        """A plain HF checkpoint of the full model (tp shards and ZeRO-3 partitions gathered, the attention
        implementation reset so a plain process loads it); every rank must call, global rank 0 writes."""
        from ..checkpoint.hf import save_pretrained, zero3_gathered

        from ..strategy import applied_to

        inner = self.unwrap_model(model)
        done = applied_to(inner)
        with zero3_gathered(inner, self.deepspeed_plugin.deepspeed_config.get("zero_optimization", {}).get("stage")):
            save_pretrained(inner, self.layout, save_dir, spec=done.spec if done else None, **hf_kwargs)

    # ------------------------------------------------------------------------------------------ prepare
    def prepare_data_loader(self, data_loader, device_placement=None, slice_fn_for_dispatch=None):
        """accelerate's prepare_data_loader split over the dp replicas (tp and cp peers get the same batches)."""
        if getattr(data_loader, "_is_accelerate_prepared", False):
            return super().prepare_data_loader(data_loader, device_placement, slice_fn_for_dispatch)
        from accelerate.data_loader import prepare_data_loader

        dispatch = self.dispatch_batches
        if dispatch and self.layout.size("tp") * self.layout.size("cp") > 1:
            raise ValueError("dispatch_batches=True sends batches to every process; with model_parallel or "
                             "context_parallel > 1 leave it unset (each dp replica reads its own shard)")
        if device_placement is None:
            device_placement = self.device_placement
        micro = self.plan.micro_batch_size * self.plan.micro_batch_interleave_num
        if getattr(data_loader, "batch_size", None) not in (None, micro):
            warnings.warn(f"DataLoader batch_size={data_loader.batch_size} differs from the YAML's per-device batch "
                          f"{micro} (runner_config.batch_size x micro_batch_interleave_num); the loader's is used",
                          stacklevel=3)
        prepared = prepare_data_loader(
            data_loader, self.device, num_processes=self.layout.size("dp"), process_index=self.layout.rank("dp"),
            split_batches=self.split_batches, put_on_device=device_placement, rng_types=self.rng_types.copy(),
            dispatch_batches=False if dispatch is None else dispatch, even_batches=self.even_batches,
            slice_fn_for_dispatch=slice_fn_for_dispatch, use_seedable_sampler=self.use_seedable_sampler,
            data_seed=self.dataloader_config.data_seed, non_blocking=self.non_blocking,
            use_stateful_dataloader=self.use_stateful_dataloader)
        self._dataloaders.append(prepared)
        return prepared

    def _prepare_deepspeed(self, *args):
        from torch.optim.lr_scheduler import LRScheduler

        from .. import runtime
        from ..pet import require_lora
        from ..strategy import applied_to, parallelize, prepare_user_loop

        models = [a for a in args if isinstance(a, nn.Module)]
        if models:
            require_lora(models[0], self.plan.config.pet)  # pet_config: LoRA must predate the optimizer
            model = runtime.cpu_float32(models[0], self.layout, self.plan)  # in place: the optimizer stays valid
            names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
            parallelize(model, self.layout)
            prepare_user_loop(model, next((a for a in args if isinstance(a, torch.optim.Optimizer)), None))
            if self.layout.size("cp") > 1:
                _install_cp_batch_hooks(model, self.layout)
            for obj in args:
                if isinstance(obj, torch.optim.Optimizer):
                    _repoint_optimizer(obj, names, model)
        ds = self.deepspeed_plugin.deepspeed_config
        if "scheduler" in ds and any(isinstance(a, LRScheduler) for a in args):
            ds.pop("scheduler")  # the script's own scheduler replaces the YAML's lr_schedule
        from ..moe.deepspeed import deepspeed_moe

        optimizer = next((a for a in args if isinstance(a, torch.optim.Optimizer)), None)
        moe = deepspeed_moe(models[0], self.layout, optimizer) if models and optimizer is not None else nullcontext()
        with moe, _deepspeed_initialize_with(self.layout.mpu()):  # experts reduced over their expert-dp group
            result = super()._prepare_deepspeed(*args)
        aux = applied_to(models[0]).aux_loss if models else None
        if aux is not None:  # the router's aux / z / indexer loss averaged as msp.initialize's engine does
            aux.deepspeed_scale(self.layout.size("dp"), self.gradient_accumulation_steps)  # DeepSpeed's, now
        for obj in result:
            if type(obj) is AcceleratedScheduler:
                obj.__class__ = _DataParallelScheduler
                obj.data_parallel_size = 1 if isinstance(obj.scheduler, msp_optim.MindFormersLR) else self.layout.size("dp")
        return result
