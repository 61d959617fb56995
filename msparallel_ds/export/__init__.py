"""Plan -> configuration dicts for DeepSpeed and `accelerate launch` (pure producers, no side effects)."""
from .accelerate import to_accelerate
from .deepspeed import to_deepspeed

__all__ = ["to_accelerate", "to_deepspeed"]
