"""parallel.pipeline_config.pipeline_scheduler -> a torch.distributed.pipelining schedule over layout.group("pp").

| YAML (Plan.pp_schedule)                          | torch schedule              | stages of pp rank r        |
|--------------------------------------------------|-----------------------------|----------------------------|
| 1f1b (default)                                   | Schedule1F1B                | r                          |
| gpipe                                            | ScheduleGPipe               | r                          |
| 1f1b + pp_interleave_num v > 1 + pipeline_interleave | ScheduleInterleaved1F1B | r, r+pp, ..., r+(v-1)pp    |
| gpipe + pp_interleave_num v > 1 (looped_bfs)     | ScheduleLoopedBFS           | r, r+pp, ..., r+(v-1)pp    |
| zero_bubble_v (pp_interleave_num 2)              | ScheduleZBVZeroBubble       | r, 2pp-1-r (V shape)       |

seqpipe / seqvpp / seqsmartvpp are refused by config.rules before anything runs (the error names the key and the
supported values). Schedules run with scale_grads=False: torch's default divides gradients by n_microbatches, while
the engine's loss is already sum(token losses) / N over the global batch.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch
from torch import nn

if TYPE_CHECKING:
    from ..distributed.layout import ParallelLayout

__all__ = ["SCHEDULES", "build_schedule", "reset_stage_shapes"]


def _classes() -> dict:
    from torch.distributed import pipelining as P

    return {"1f1b": P.Schedule1F1B, "gpipe": P.ScheduleGPipe, "interleaved_1f1b": P.ScheduleInterleaved1F1B,
            "looped_bfs": P.ScheduleLoopedBFS, "zero_bubble_v": P.ScheduleZBVZeroBubble}


SCHEDULES = ("1f1b", "gpipe", "interleaved_1f1b", "looped_bfs", "zero_bubble_v")


def build_schedule(name: str, modules: list[nn.Module], stage_ids: list[int], n_stages: int, layout: ParallelLayout,
                   device: torch.device, n_microbatches: int, loss_fn: Callable):
    """PipelineStage per local module and the schedule that runs them; returns (schedule, stages)."""
    from torch.distributed.pipelining import PipelineStage

    if name not in SCHEDULES:
        raise ValueError(f"parallel.pipeline_config.pipeline_scheduler: schedule {name!r} is not supported (supported:"
                         f" 1f1b, gpipe, 1f1b/gpipe with pp_interleave_num > 1, zero_bubble_v)")
    group = layout.group("pp")
    stages = [PipelineStage(m, s, n_stages, device, group=group) for m, s in zip(modules, stage_ids)]
    cls = _classes()[name]
    if len(stages) == 1 and name in ("1f1b", "gpipe"):
        return cls(stages[0], n_microbatches, loss_fn=loss_fn, scale_grads=False), stages
    return cls(stages, n_microbatches, loss_fn=loss_fn, scale_grads=False), stages


_INIT_FLAGS = ("_stages_forward_initialized", "_stages_backward_initialized", "_stage_forward_initialized",
               "_stage_backward_initialized", "_stages_initialized", "_stage_initialized")


def reset_stage_shapes(schedule, stages, old: tuple, new: tuple) -> None:
    """Make the schedule infer its stages' input/output shapes (and P2P buffers) again at the next step. Every rank
    of the pp group sees the same batch shape, so all of them re-run the (collective) shape inference together."""
    flags = [f for f in _INIT_FLAGS if hasattr(schedule, f)]
    if not flags:  # a torch whose schedules keep their shapes elsewhere: refuse before any collective
        raise ValueError(f"pipeline_stage > 1: the batch shape changed from {old} to {new}, and this torch "
                         f"({torch.__version__}) pipelining schedule cannot re-infer its stage buffer shapes; pad "
                         f"every batch to one sequence length (e.g. {old[1]} = model.model_config.seq_length)")
    for flag in flags:
        setattr(schedule, flag, False)
    for stage in stages:
        stage.clear_runtime_states()
        stage.args_recv_info.clear()
        stage.grad_recv_info.clear()
        stage.grad_send_info = None
        for attr in ("inputs_meta", "_outputs_meta"):  # torch < 2.9 keeps the inferred shapes here
            if hasattr(stage, attr):
                setattr(stage, attr, None)
