"""Multi-copy (micro_batch_interleave_num) and fine-grain (fine_grain_interleave) interleave of tensor/sequence-
parallel collectives with compute, for HF decoders parallelized by msp.parallelize: the async issue/wait
collectives (overlap), the round-robin scheduler (schedule), one layer as steps (fine_grain) and the copies
(multi_copy)."""
from .fine_grain import decoder_steps
from .multi_copy import COPY_LOSS_MODES, install, installed, run_layers
from .schedule import round_robin, run

__all__ = ["COPY_LOSS_MODES", "install", "installed", "decoder_steps", "round_robin", "run", "run_layers"]
