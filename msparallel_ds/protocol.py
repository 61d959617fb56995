"""TrainEngine: the surface both engines offer (engine.Engine over DeepSpeed, pipeline.engine.PipelineEngine over
torch.distributed.pipelining), so launchers, checkpoints and tests can take either."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping, Optional, Protocol, runtime_checkable

import torch
from torch import Tensor, nn

if TYPE_CHECKING:
    from .distributed.layout import ParallelLayout
    from .plan import Plan
    from .strategy import Applied
    from .tensor_parallel.spec import ShardSpec

__all__ = ["TrainEngine"]


@runtime_checkable
class TrainEngine(Protocol):
    layout: "ParallelLayout"
    plan: "Plan"
    applied: "Applied"             # what parallelize applied (adapter, TP plan, shard spec, recompute, interleave)
    optimizer: Any
    lr_scheduler: Any
    micro_batch_size: int          # rows per micro-batch (runner_config.batch_size x micro_batch_interleave_num)
    gradient_accumulation_steps: int
    global_steps: int
    global_grad_norm: Optional[float]  # the step's global norm before clipping (None without clipping)
    last_aux_loss: Optional[float]     # the routers' aux + z loss of the last step, logged apart
    last_mtp_loss: Optional[float]     # the multi-token-prediction cross-entropy of the last step, logged apart

    @property
    def model(self) -> nn.Module: ...

    @property
    def device(self) -> torch.device: ...

    @property
    def spec(self) -> "ShardSpec": ...

    def train_batch(self, batch: Mapping[str, Any]) -> Tensor: ...

    def full_state_dict(self, *, rank0_only: bool = False) -> Optional[dict]: ...

    def save_pretrained(self, save_dir: str, **hf_kwargs) -> None: ...

    def save(self, save_dir: str) -> None: ...

    def load(self, load_dir: str) -> dict: ...
