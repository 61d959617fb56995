"""Plan -> an `accelerate launch --config_file` YAML dict (accelerate 1.15 ClusterConfig keys only)."""
from __future__ import annotations

import textwrap
from typing import TYPE_CHECKING, Any

from .deepspeed import deepspeed_batch

if TYPE_CHECKING:
    from ..plan import Plan

_MIXED = {"bf16": "bf16", "fp16": "fp16", "fp32": "no"}


def pipeline_note(plan: "Plan") -> str | None:
    """Why this launcher file cannot run the YAML as it is (pipeline_stage > 1), or None."""
    pp = plan.mesh.pp
    if pp <= 1:
        return None
    return (f"parallel_config.pipeline_stage={pp}: MindFormersAccelerator (and accelerate's own loop) cannot drive "
            "a pipeline, so a script launched with this file stops at start-up; train this YAML with "
            "msp.initialize under torchrun or the deepspeed launcher (examples/train_deepspeed.py), or set "
            "pipeline_stage: 1 for accelerate")


def header(plan: "Plan", source: str) -> str:
    """The comment lines the CLI writes above the YAML: how to launch it, and what does not work."""
    lines = [f"accelerate launch config made by msparallel-ds from {source}",
             f"run with: MSPARALLEL_CONFIG={source} accelerate launch --config_file THIS_FILE script.py",
             "the script must build msparallel_ds.integrations.accelerate.MindFormersAccelerator (it reads the YAML:",
             "mesh, ZeRO, batch, clipping); a plain accelerate.Accelerator() with this file does not know the",
             "tp/cp groups and fails in DeepSpeed's batch-size assertion"]
    note = pipeline_note(plan)
    if note:
        lines += textwrap.wrap("WARNING: " + note, 110)
    return "".join(f"# {line}\n" for line in lines)


def to_accelerate(plan: "Plan", *, num_machines: int = 1) -> dict[str, Any]:
    """The launcher config. Batch sizes stay with the training script (accelerate reads them from the
    dataloader); MindFormersAccelerator rebuilds the full DeepSpeed config from the plan at run time."""
    _, gas = deepspeed_batch(plan)
    ds: dict[str, Any] = {"zero_stage": plan.zero.stage, "gradient_accumulation_steps": gas,
                          "offload_optimizer_device": "cpu" if plan.zero.offload_optimizer else "none",
                          "offload_param_device": "cpu" if plan.zero.offload_param else "none",
                          "zero3_init_flag": plan.zero.stage == 3}
    ds["gradient_clipping"] = plan.gradient_clipping or 0.0  # DeepSpeed's own default would clip at 1.0
    if num_machines > 1:
        ds["deepspeed_multinode_launcher"] = "standard"
    return {
        "compute_environment": "LOCAL_MACHINE",
        "distributed_type": "DEEPSPEED",
        "deepspeed_config": ds,
        "mixed_precision": _MIXED[plan.compute_dtype],
        "num_machines": num_machines,
        "machine_rank": 0,
        "num_processes": plan.world_size,
        "main_training_function": "main",
        "rdzv_backend": "static",
        "same_network": True,
        "use_cpu": False,
        "debug": False,
        "downcast_bf16": "no",
        "tpu_env": [],
        "tpu_use_cluster": False,
        "tpu_use_sudo": False,
    }
