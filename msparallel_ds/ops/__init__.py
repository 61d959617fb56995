"""Fused CUDA ring-attention kernels (sources in the repository's ops/, CUDA C++, no Triton) and their Python side.

    from msparallel_ds import ops
    ops.load()                  # the compiled extension; JIT-built on first use (cached), OpsUnavailable if it can't
    ops.attention               # forward_step / finalize / backward_preprocess / backward_step / merge_ (CUDA)
    ops.reference               # the same contract in plain torch (the spec; runs anywhere)
    ops.ring_steps              # the zigzag ring's step sequence over either of them
    python -m msparallel_ds.ops build | check | info

Importing this package needs neither CUDA nor a compiler; only load() does. The context-parallel block backends use
these kernels through context_parallel/kernels.py ("cuda_fused"), and only where CUDA and the extension are there.
"""
from . import modes, reference, ring_steps
from ._build import OpsUnavailable, compile_check, is_built, load, loaded, source_dir, unavailable_reason
from .modes import Mode, ring_schedule, step_mode

__all__ = [
    "Mode",
    "OpsUnavailable",
    "attention",
    "available",
    "compile_check",
    "is_built",
    "load",
    "loaded",
    "modes",
    "reference",
    "ring_schedule",
    "ring_steps",
    "source_dir",
    "step_mode",
    "unavailable_reason",
]


def available(build: bool = False) -> bool:
    """True when the kernels can run here: a CUDA GPU of sm_80+, and the extension loaded, or already compiled in
    the cache (build=False; torch still recompiles sources changed since), or compiled now (build=True, minutes).
    Never raises."""
    if loaded() is not None:
        return True
    try:
        if unavailable_reason() is not None or (not build and not is_built()):
            return False
        load(build=build)
        return True
    except Exception:  # noqa: BLE001  (documented: never raises)
        return False


def __getattr__(name):  # `ops.attention` without importing it (and torch.cuda paths) at package import
    if name == "attention":
        from . import attention

        return attention
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
