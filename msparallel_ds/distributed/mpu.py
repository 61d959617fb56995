"""DeepSpeed's `mpu` (model parallel unit) duck type over a ParallelLayout.

What DeepSpeed 0.19.8 does with each group when given `deepspeed.initialize(..., mpu=layout.mpu())`
(runtime/engine.py, runtime/config.py, runtime/zero/stage_1_and_2.py, stage3.py, runtime/utils.py, utils/groups.py):

- data_parallel -> layout "dp" (pure data parallel: ranks that see different samples).
  Batch math: train_batch_size == micro * gradient_accumulation_steps * dp (config.py), the data sampler
  rank/size, checkpoint dp peer ranks (get_data_parallel_group_ranks), the overflow check.
- sequence_data_parallel -> "dp_cp". engine.seq_data_parallel_group: the initial parameter broadcast (from
  its rank 0), ZeRO 1/2/3 partitioning (`dp_process_group`) and the gradient reduction, also without ZeRO.
- sequence_parallel -> "cp". DeepSpeed only takes its size (`sequence_parallel_size`): gradients are SUMMED
  over dp_cp and divided by dp_cp/cp = dp (also with gradient_predivide_factor / postscale). So the gradient
  is the mean over dp of the sum over cp: each cp rank's loss must be its share of the full-sequence loss
  (sum over its tokens / tokens of the whole sequence), not the mean over its own tokens.
- tensor_model_parallel -> "tp": the tp rank decides which rank counts replicated (non-tp) parameters in
  gradient/weight norms (via deepspeed.utils.bwc); the src rank is used by DeepSpeed's AutoTP broadcast.
- model_parallel: rank and world_size -> "tp" (checkpoint file names mp_rank_XX, stage-3 norm filter);
  group -> "pp_tp", the Megatron convention (equal to the tp group when pp == 1): ZeRO sums gradient
  norms and ORs overflow flags over it, so with pp > 1 every stage clips with the global norm.
  Note: with pp > 1 DeepSpeed's own checkpoint names do not include the pp stage.
- pipeline_model_parallel -> "pp" (checkpoint metadata, norms of MoE grads).

Deliberately absent: `initialize_sequence_parallel` (DeepSpeed would treat us as its own ALST mpu and ignore
our data-parallel groups) and `get_slice_parallel_*` (an older alias that would shadow tensor_model_parallel).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .layout import ParallelLayout

__all__ = ["DeepSpeedMPU"]


def _rank_size_group(name: str):
    return (lambda self: self.layout.rank(name),
            lambda self: self.layout.size(name),
            lambda self: self.layout.group(name))


class DeepSpeedMPU:
    """Pass to deepspeed.initialize(mpu=...). Build with ParallelLayout.mpu()."""

    def __init__(self, layout: ParallelLayout):
        self.layout = layout

    (get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size,
     get_tensor_model_parallel_group) = _rank_size_group("tp")
    (get_pipeline_model_parallel_rank, get_pipeline_model_parallel_world_size,
     get_pipeline_model_parallel_group) = _rank_size_group("pp")
    get_data_parallel_rank, get_data_parallel_world_size, get_data_parallel_group = _rank_size_group("dp")
    (get_sequence_parallel_rank, get_sequence_parallel_world_size,
     get_sequence_parallel_group) = _rank_size_group("cp")
    (get_sequence_data_parallel_rank, get_sequence_data_parallel_world_size,
     get_sequence_data_parallel_group) = _rank_size_group("dp_cp")
    get_model_parallel_rank = get_tensor_model_parallel_rank
    get_model_parallel_world_size = get_tensor_model_parallel_world_size

    def get_model_parallel_group(self):
        return self.layout.group("pp_tp")

    def get_tensor_model_parallel_src_rank(self):
        return self.layout.ranks("tp")[0]

    def get_data_parallel_group_ranks(self):
        return list(self.layout.ranks("dp"))

    def __repr__(self) -> str:
        return f"DeepSpeedMPU({self.layout!r})"
