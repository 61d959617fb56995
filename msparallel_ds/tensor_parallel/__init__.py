"""Tensor, sequence and vocab parallel: autograd collectives (mappings), parallel Linear layers, vocab-parallel
embedding / output head / cross-entropy, and the shard spec (spec). Every piece takes its process group explicitly
(layout.group("tp"))."""
from .apply import tp_parallelize, tp_plan, vocab_parallel_causal_lm_loss
from .layers import ColumnParallelLinear, RowParallelLinear
from .mappings import (copy_to_region, gather_from_region, gather_from_sequence_region, reduce_from_region,
                       reduce_scatter_to_sequence_region, scatter_to_region)
from .vocab import ParallelLMHead, VocabParallelEmbedding, vocab_parallel_cross_entropy

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "ParallelLMHead",
           "vocab_parallel_cross_entropy", "copy_to_region", "reduce_from_region", "gather_from_sequence_region",
           "reduce_scatter_to_sequence_region", "scatter_to_region", "gather_from_region", "tp_parallelize",
           "tp_plan", "vocab_parallel_causal_lm_loss"]
