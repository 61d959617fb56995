"""The MindFormers YAML for the accelerate and Trainer integrations: where it comes from, and what they refuse."""
from __future__ import annotations

import os
from typing import Any

__all__ = ["CONFIG_ENV", "refuse_pipeline", "resolve_config"]

CONFIG_ENV = "MSPARALLEL_CONFIG"


def refuse_pipeline(cfg, who: str) -> None:
    """accelerate's and the Trainer's loops run one forward/backward per batch; a pipeline schedule runs all
    micro-batches across stages, so pipeline_stage > 1 goes through msp.initialize instead."""
    pp = cfg.parallel_config.pipeline_stage
    if pp > 1:
        raise ValueError(f"parallel_config.pipeline_stage={pp}: {who} cannot drive a pipeline (its loop runs one "
                         "forward/backward per batch; a schedule runs all micro-batches across stages). Use "
                         "engine = msp.initialize(model, cfg, optimizer=...) and engine.train_batch(batch) under "
                         "torchrun or the deepspeed launcher (example: examples/train_deepspeed.py --config "
                         "configs/tiny_pp2.yaml), or set pipeline_stage: 1")


def resolve_config(config: Any = None):
    """A ParallelConfig from a path, dict, YAML text or ParallelConfig; None reads the path from MSPARALLEL_CONFIG."""
    from ..config import ParallelConfig, load_config

    if config is None:
        config = os.environ.get(CONFIG_ENV)
        if not config:
            raise ValueError(f"no MindFormers YAML given: pass config=PATH (or a dict) or set {CONFIG_ENV}=PATH "
                             "(e.g. `MSPARALLEL_CONFIG=run.yaml accelerate launch --config_file acc.yaml train.py`)")
    return config if isinstance(config, ParallelConfig) else load_config(config)
