"""Multi-copy (micro_batch_interleave_num) and fine-grain (fine_grain_interleave) interleave of tensor/sequence-
parallel collectives with compute, for HF decoders parallelized by msp.parallelize."""
from .fine_grain import layer_steps
from .multi_copy import COPY_LOSS_MODES, install, round_robin, run, run_layers

__all__ = ["COPY_LOSS_MODES", "install", "layer_steps", "round_robin", "run", "run_layers"]
