"""parallel_mode: 2 (auto_parallel): MindSpore searches the operator sharding itself; here suggest searches it.

    source = auto_parallel_source("run.yaml", world_size=64)   # the chosen YAML dict, or "run.yaml" unchanged

Used by `msparallel-ds plan` and `msp.initialize` before the config is loaded, so every path that reads a YAML
runs what suggest picked, with a ConfigWarning saying what that was. The hand-written operator-sharding degrees
(data / model / context / expert parallel, sequence parallel) are ignored, as MindSpore's auto-parallel mode ignores
them; the pipeline (pipeline_stage, schedule, micro_batch_num), micro_batch_interleave_num, gradient accumulation and
the global batch are the YAML's, as MindSpore keeps them (suggest.search.resolve_auto_parallel)."""
from __future__ import annotations

import os
import warnings
from typing import Any, Optional

from ..config.errors import ConfigWarning

AUTO = (2, "2", "auto_parallel", "AUTO_PARALLEL")
GIB = float(1 << 30)


def is_auto_parallel(data: Any) -> bool:
    par = data.get("parallel") if isinstance(data, dict) else None
    return isinstance(par, dict) and par.get("parallel_mode") in AUTO


def _device_memory(data: dict) -> float:
    """context.max_device_memory ("58GB": MindSpore means GiB), else this machine's accelerator, else 80 GiB."""
    from ..memory import max_device_memory_gib

    gib = max_device_memory_gib(data)
    if gib:
        return gib * GIB
    try:
        import torch

        if torch.cuda.is_available():
            return float(torch.cuda.get_device_properties(0).total_memory)
    except Exception:  # noqa: BLE001  no accelerator information: the default
        pass
    return 80 * GIB


def auto_parallel_source(source: Any, *, world_size: Optional[int] = None,
                         device_memory_bytes: Optional[float] = None) -> Any:
    """`source` unchanged unless its YAML asks for auto_parallel; then the YAML dict suggest chooses for
    world_size (default: the launcher's WORLD_SIZE, else the YAML's degrees)."""
    from ..config.reader import read_source
    from ..config.schema import ParallelConfig
    from .search import resolve_auto_parallel

    if isinstance(source, ParallelConfig):
        return source
    data, _ = read_source(source, None)
    if not is_auto_parallel(data):
        return source
    world = world_size or (int(os.environ["WORLD_SIZE"]) if os.environ.get("WORLD_SIZE") else None)
    chosen, note = resolve_auto_parallel(data, world, device_memory_bytes or _device_memory(data))
    warnings.warn(note + "; the hand-written operator-sharding degrees (data/model/context/expert parallel) are not "
                  "used", ConfigWarning, stacklevel=2)
    return chosen


def load_config_auto(source: Any, *, world_size: Optional[int] = None,
                     device_memory_bytes: Optional[float] = None):
    """load_config(auto_parallel_source(source)) with the YAML read and parsed once (a large file is not parsed a
    second time), errors labelled with the file's name."""
    from ..config import load_config
    from ..config.reader import read_source
    from ..config.schema import ParallelConfig

    if isinstance(source, ParallelConfig):
        return source
    try:
        data, label = read_source(source, None)
    except Exception:  # noqa: BLE001  load_config turns every reading problem into its one ConfigError
        return load_config(source)
    if is_auto_parallel(data):
        data = auto_parallel_source(data, world_size=world_size, device_memory_bytes=device_memory_bytes)
    return load_config(data, name=label)
