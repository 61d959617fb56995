"""msparallel_ds: run a MindFormers parallel strategy (YAML) on PyTorch with DeepSpeed and accelerate.

The config/plan/export layers are pure Python (no torch.distributed) so `msparallel-ds plan` runs anywhere;
process-group code is imported lazily.
"""
from .config import ConfigError, ConfigWarning, ParallelConfig, load_config
from .plan import Plan, make_plan

__version__ = "0.1.0"


def init_parallel(cfg_or_plan, **kwargs):
    """Build the ParallelLayout (DeviceMesh and every group) inside an initialized torch.distributed."""
    from .distributed.layout import init_parallel as _init

    return _init(cfg_or_plan, **kwargs)


def __getattr__(name):
    if name == "ParallelLayout":
        from .distributed.layout import ParallelLayout

        return ParallelLayout
    raise AttributeError(f"module 'msparallel_ds' has no attribute {name!r}")


__all__ = ["ConfigError", "ConfigWarning", "ParallelConfig", "Plan", "ParallelLayout", "init_parallel",
           "load_config", "make_plan"]
