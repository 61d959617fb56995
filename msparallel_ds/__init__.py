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


def from_pretrained(checkpoint_dir, cfg_or_layout, **kwargs):
    """A HF causal LM built on the meta device, parallelized for the YAML (or a ParallelLayout) and filled with only
    this rank's shards of the checkpoint (no rank materializes the full model). kwargs: dtype, device, model_cls.
    Given a YAML outside a launcher (plain python), it starts the process group the way msp.initialize does."""
    from .checkpoint.hf import check_checkpoint_dir
    from .checkpoint.hf import from_pretrained as _load
    from .distributed.layout import ParallelLayout
    from .strategy import parallelize

    check_checkpoint_dir(checkpoint_dir)  # before any process group is started
    if isinstance(cfg_or_layout, ParallelLayout):
        layout = cfg_or_layout
    else:
        from .runtime import ensure_distributed

        cfg = cfg_or_layout if isinstance(cfg_or_layout, ParallelConfig) else load_config(cfg_or_layout)
        ensure_distributed(None)
        layout = init_parallel(cfg)
    return _load(checkpoint_dir, layout, parallelize_fn=parallelize, **kwargs)


_LAZY = {  # torch-heavy parts load on first use, so `msparallel-ds plan` stays light
    "ParallelLayout": ("distributed.layout", "ParallelLayout"),
    "context_parallel_attention": ("context_parallel.api", "context_parallel_attention"),
    "shard_sequence": ("context_parallel.api", "shard_sequence"),
    "unshard_sequence": ("context_parallel.api", "unshard_sequence"),
    "shard_batch": ("context_parallel.batch", "shard_batch"),
    "parallelize": ("strategy", "parallelize"),
    "initialize": ("engine", "initialize"),
    "Engine": ("engine", "Engine"),
    "build_optimizer": ("optim", "build_optimizer"),
    "build_lr_scheduler": ("optim", "build_lr_scheduler"),
}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        return getattr(importlib.import_module(f".{module}", __name__), attr)
    raise AttributeError(f"module 'msparallel_ds' has no attribute {name!r}")


__all__ = ["ConfigError", "ConfigWarning", "Engine", "ParallelConfig", "Plan", "ParallelLayout",
           "build_lr_scheduler", "build_optimizer", "context_parallel_attention", "from_pretrained", "init_parallel", "initialize", "load_config", "make_plan",
           "parallelize", "shard_batch", "shard_sequence", "unshard_sequence"]
