"""Plan -> a DeepSpeed 0.19 config dict.

Batch math: DeepSpeed checks train_batch = micro x gas x dp_world, with dp_world from our mpu (pure dp). One
DeepSpeed micro step carries all micro_batch_interleave_num copies (they run inside one forward), so
micro = batch_size x mbi; gas = micro_batch_num when pp > 1 (MindFormers ignores gradient_accumulation_steps
there), else gradient_accumulation_steps. Then micro x gas x dp == MindFormers' global batch.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..plan import Plan



def deepspeed_batch(plan: "Plan") -> tuple[int, int]:
    """(train_micro_batch_size_per_gpu, gradient_accumulation_steps) for DeepSpeed."""
    micro = plan.micro_batch_size * plan.micro_batch_interleave_num
    gas = plan.micro_batch_num if plan.mesh.pp > 1 else plan.gradient_accumulation_steps
    return micro, gas


def to_deepspeed(plan: "Plan", *, with_mpu: bool = True, include_optimizer: bool = True) -> dict[str, Any]:
    """No `scheduler` entry: DeepSpeed's schedulers compute other curves than MindFormers' (warmup shape, the decay
    end); the engines pass msp.build_lr_scheduler's torch scheduler, and plan.lr_schedule describes it as data. The
    `optimizer` entry only where DeepSpeed's FusedAdam computes the YAML type's update (bias_correction false for
    the nn.AdamWeightDecay family); parameter groups (no decay for 1-D / bias) come from msp.build_optimizer."""
    micro, gas = deepspeed_batch(plan)
    ds: dict[str, Any] = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": gas}
    if not with_mpu and plan.world_size == plan.mesh.dp:
        ds["train_batch_size"] = plan.global_batch_size  # without an mpu DeepSpeed's dp world is the world
    ds["zero_optimization"] = _zero(plan)
    # We pass torch optimizers on CPU (no JIT build) and ZeRO must accept them.
    ds["zero_allow_untested_optimizer"] = True
    if plan.zero.offload_optimizer:  # ... and, offloaded, run them on the host instead of DeepSpeed's CPU Adam
        ds["zero_force_ds_cpu_optimizer"] = False
    ds.update(_precision(plan))
    # DeepSpeed 0.19 clips at 1.0 unless told otherwise; MindFormers clips only with use_clip_grad.
    ds["gradient_clipping"] = plan.gradient_clipping or 0.0
    if include_optimizer and plan.optimizer and plan.optimizer["type"] == "AdamW":
        ds["optimizer"] = {"type": "AdamW", "params": dict(plan.optimizer["params"])}
    ds["steps_per_print"] = 1 << 30
    ds["wall_clock_breakdown"] = False
    return ds


def _zero(plan: "Plan") -> dict[str, Any]:
    z = plan.zero
    if z.stage == 0:
        return {"stage": 0}
    out: dict[str, Any] = {"stage": z.stage, "overlap_comm": z.overlap_comm, "contiguous_gradients": True,
                           "reduce_bucket_size": z.reduce_bucket_size}
    if z.stage in (1, 2):
        out.update(reduce_scatter=True, allgather_bucket_size=z.reduce_bucket_size)
    if z.offload_optimizer:  # MindFormers optimizer.swap; with a torch optimizer (not DeepSpeedCPUAdam) on the host
        out["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if z.offload_param:  # parallelism.cpu_offload (ZeRO-3 only)
        out["offload_param"] = {"device": "cpu", "pin_memory": True}
    if z.stage == 3:
        if z.param_persistence_threshold is not None:
            out["stage3_param_persistence_threshold"] = z.param_persistence_threshold
        if z.hpz_partition_size:
            out["zero_hpz_partition_size"] = z.hpz_partition_size
        if not z.reshard_after_forward:  # parallelism.reshard_after_forward_policy never (default with pp):
            # gathered parameters stay until backward reuses them, released at the step's end (FSDP's False)
            out.update(stage3_max_reuse_distance=10**15, stage3_max_live_parameters=10**15)
    return out


def _precision(plan: "Plan") -> dict[str, Any]:
    if plan.compute_dtype == "bf16":
        return {"bf16": {"enabled": True}}
    if plan.compute_dtype != "fp16":
        return {}
    ls = plan.loss_scale
    fp16: dict[str, Any] = {"enabled": True}
    if ls.kind == "dynamic":
        fp16.update(loss_scale=0, initial_scale_power=max(0, int(round(math.log2(ls.initial)))),
                    loss_scale_window=ls.window, hysteresis=1, min_loss_scale=1)  # MindSpore halves on the first overflow
    else:
        fp16["loss_scale"] = ls.initial
    return {"fp16": fp16}
