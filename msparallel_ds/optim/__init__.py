"""The YAML's optimizer and lr schedule with MindSpore/MindFormers' maths: msp.build_optimizer and
msp.build_lr_scheduler, which every training entry point (msp.initialize, the pipeline engine, accelerate, the HF
Trainer, the demo) uses. Torch-heavy parts load on first use (types.py and lr.py are pure: plan/export read them)."""
from .lr import LR_TYPES
from .types import OPTIMIZER_TYPES

_LAZY = {"AdamWeightDecay": "adam", "PmaAdamW": "adam", "build_optimizer": "build", "optimizer_spec": "build",
         "param_groups": "groups", "Muon": "muon", "MindFormersLR": "scheduler", "build_lr_scheduler": "scheduler",
         "check_optim": "scheduler"}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'msparallel_ds.optim' has no attribute {name!r}")


__all__ = ["AdamWeightDecay", "LR_TYPES", "MindFormersLR", "Muon", "OPTIMIZER_TYPES", "PmaAdamW", "build_lr_scheduler",
           "build_optimizer", "check_optim", "optimizer_spec", "param_groups"]
