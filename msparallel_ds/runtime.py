"""What every training entry point (msp.initialize, the pipeline engine, accelerate, the HF Trainer, the demo) does
the same way: start torch.distributed from the launcher's environment, pick the device, turn the YAML's optimizer
into a torch optimizer (msparallel_ds.optim), and derive DeepSpeed's config from the plan (CPU-safe)."""
from __future__ import annotations

import os
import warnings
from typing import TYPE_CHECKING, Mapping, Optional

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from .distributed.layout import ParallelLayout

__all__ = ["cpu_float32", "deepspeed_config", "disable_inference_shm_build", "ensure_distributed", "teardown",
           "quiet_deepspeed", "training_device"]


def quiet_deepspeed() -> None:
    """For scripts, before DeepSpeed is imported: on a machine without CUDA name DeepSpeed's accelerator (cpu), so
    no rank prints "Setting accelerator to CPU ... unable to detect it"; and silence the FutureWarnings DeepSpeed
    triggers by calling torch's deprecated collectives (nothing for the user to act on)."""
    if "DS_ACCELERATOR" not in os.environ and not torch.cuda.is_available():
        os.environ["DS_ACCELERATOR"] = "cpu"
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"deepspeed(\.|$)")
    warnings.filterwarnings("ignore", message=r".*torch\.distributed\..* (is|will be) deprecated",
                            category=FutureWarning)


def ensure_distributed(timeout_s: Optional[float]) -> None:
    """Under torchrun / the deepspeed launcher / accelerate launch the env holds RANK etc.; start the default
    group with the device's backend if the script has not (gloo on CPU, where DeepSpeed would pick none)."""
    if dist.is_available() and dist.is_initialized():
        return
    if "RANK" not in os.environ and "OMPI_COMM_WORLD_RANK" not in os.environ:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=os.environ.get("MASTER_PORT", "29500"))
    import deepspeed
    from datetime import timedelta

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    kwargs = {"timeout": timedelta(seconds=timeout_s)} if timeout_s else {}
    deepspeed.init_distributed(dist_backend=backend, **kwargs)


def training_device(layout: ParallelLayout) -> torch.device:
    if layout.device_type == "cuda":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", torch.cuda.current_device())))
    return torch.device(layout.device_type)


def cpu_float32(model: torch.nn.Module, layout: ParallelLayout, plan=None) -> torch.nn.Module:
    """Off CUDA, DeepSpeed trains in float32 only (deepspeed_config drops fp16/bf16 there): a model in float16 or
    bfloat16 (e.g. `model.half()`) would fail inside DeepSpeed's gradient reduction ("unsupported grad type"). Cast it
    to float32 in place (Parameter objects are kept, so an optimizer built on them stays valid), saying so."""
    if layout.device_type == "cuda":
        return model
    half = sorted({str(t.dtype).replace("torch.", "") for t in (*model.parameters(), *model.buffers())
                   if t.dtype in (torch.float16, torch.bfloat16)})
    if half:
        yaml = (f"; the YAML's model.model_config.compute_dtype={plan.config.model.compute_dtype} applies on GPUs"
                if plan is not None else "")
        warnings.warn(f"the model's {'/'.join(half)} parameters are cast to float32: DeepSpeed trains in float32 "
                      f"on {layout.device_type} (its half-precision paths need an accelerator){yaml}", stacklevel=3)
        model.float()
    return model


def deepspeed_config(plan, layout: ParallelLayout, *, overrides: Optional[Mapping], own_clip: bool = False) -> dict:
    """The DeepSpeed config for `plan` on `layout`. own_clip: the caller clips with the true global norm itself when
    DeepSpeed's would be wrong (ZeRO-0 with expert parallel), so DeepSpeed's clipping is switched off then."""
    ds = plan.to_deepspeed()
    ds.pop("optimizer", None)  # always msp.build_optimizer's or the caller's torch optimizer (with its groups)
    if layout.device_type != "cuda":
        for key in ("bf16", "fp16"):
            if ds.pop(key, None):
                warnings.warn(f"model.model_config.compute_dtype={plan.config.model.compute_dtype}: running in "
                              "float32 on CPU (DeepSpeed's half-precision paths need an accelerator)", stacklevel=3)
    stage = ds.get("zero_optimization", {}).get("stage", 0)
    if plan.zero.downgrade:  # parallelism.data_parallel_shard (ZeRO-3) with expert parallel: ZeRO-2 (plan_pynative)
        warnings.warn(plan.zero.downgrade, stacklevel=3)
    if stage == 3 and layout.size("tp") * layout.size("cp") > 1:
        raise ValueError(
            "parallel.parallel_optimizer_config.optimizer_level=level3 (ZeRO-3) does not compose with "
            f"parallel_config.model_parallel={layout.size('tp')} / context_parallel={layout.size('cp')} here: ZeRO-3 "
            "re-partitions the tensor-parallel shards (and their gradient hooks), and DeepSpeed 0.19's ZeRO-3 "
            "averages gradients over dp x cp inconsistently with a sequence-parallel mpu (measured: wrong updates). "
            "Use level1 or level2 (ZeRO-1/2) with model_parallel/context_parallel > 1, or level3 with data_parallel "
            "only")
    if layout.size("ep") > 1:
        if stage == 3:
            raise ValueError(
                f"parallel_config.expert_parallel={layout.size('ep')} with optimizer_level=level3 (ZeRO-3): DeepSpeed "
                "0.19's ZeRO-3 does not partition expert-parallel parameters over their expert-data-parallel group; "
                "use level1 or level2 (expert optimizer states are then sharded over that group)")
        if stage == 0 and ds.get("gradient_clipping"):
            # DeepSpeed's ZeRO-0 clip averages per-rank norms over dp, which differ when experts do
            if own_clip:
                ds["gradient_clipping"] = 0.0
            else:
                warnings.warn(f"parallel_config.expert_parallel={layout.size('ep')} without optimizer parallel: "
                              "DeepSpeed's ZeRO-0 gradient clipping uses the mean of per-rank norms, not the global "
                              "norm; use optimizer_level level1/level2 (exact) or msp.initialize", stacklevel=3)
    ds.update(overrides or {})
    return ds


def disable_inference_shm_build() -> None:
    """On CPU deepspeed.initialize would JIT-compile its shm all-reduce op (about a minute); that op only serves
    inference_all_reduce, never training. deepspeed.ops keeps this dict as its cache of op availability."""
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def teardown() -> None:
    """End a distributed run in order, on every rank: a barrier (no rank leaves while a peer's collective is still in
    flight), DeepSpeed's communication backend and group tables dropped, then every process group destroyed (ours and
    DeepSpeed's), so no communicator thread is alive when the interpreter exits. Exiting with live process groups
    can abort a rank at exit ("terminate called without an active exception", SIGABRT) after all steps finished."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    dist.barrier()
    try:
        import deepspeed.comm.comm as ds_comm
        from deepspeed.utils import groups as ds_groups
    except ImportError:  # DeepSpeed not installed: only torch's groups to destroy
        pass
    else:
        for name, value in list(vars(ds_groups).items()):  # handles to groups about to be destroyed
            if name.startswith("_") and name.upper() == name and "GROUP" in name:
                if isinstance(value, dict):
                    value.clear()
                elif value is not None and not callable(value):
                    setattr(ds_groups, name, None)
        ds_comm.cdb = None
    dist.destroy_process_group()  # the default group and every subgroup made from it
