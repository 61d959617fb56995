"""Offline resharding: `msparallel-ds convert-checkpoint SRC DST --to-config NEW.yaml`.

engine.save writes one layout-independent file (full-size fp32 weights and Adam moments); engine.load slices it
for any layout, but every rank then reads the whole file. The converter does that slicing once, ahead of the
run: it starts NEW.yaml's world of local CPU processes (gloo), builds the saved model's architecture on the meta
device (no weights are allocated), parallelizes it for NEW.yaml with the same code a training run uses, and lets
one rank per (pp, tp) coordinate write exactly the slices that coordinate's ranks will load (dp and cp peers hold
the same slices; ZeRO partitions are cut by DeepSpeed's setters at load time). DST gets one file per (pp, tp)
coordinate and an index; engine.load(DST) under NEW.yaml reads only its own file, and refuses DST under a layout
with another pp or tp, naming the fix. DST is written under a temporary name and renamed when complete.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Callable, Optional

from .checkpoint import (
    FILE,
    FORMAT,
    SHARDED_FORMAT,
    SHARDED_INDEX,
    atomic_save,
    check_names,
    read_checkpoint_file,
    shard_file,
    tp_slice,
)

__all__ = ["convert_checkpoint"]


def meta_model(model_config: dict[str, Any]):
    """The saved model's architecture on the meta device (shapes only)."""
    from transformers import AutoConfig

    from .weights import build_on_meta

    spec = dict(model_config)
    return build_on_meta(AutoConfig.for_model(spec.pop("model_type"), **spec))


def _convert_rank(rank: int, world: int, src: str, tmp: str, cfg, send) -> int:
    import msparallel_ds as msp

    layout = msp.init_parallel(cfg)
    if layout.size("pp") > 1:
        raise ValueError(f"parallel_config.pipeline_stage={layout.size('pp')}: convert-checkpoint prepares "
                         "pipeline_stage 1 layouts; a pipeline run loads the layout-independent checkpoint directly "
                         "(engine.load(SRC))")
    ck = read_checkpoint_file(os.path.join(src, FILE), FORMAT)
    model = msp.parallelize(meta_model(ck["model_config"]), layout)
    names = dict(model.named_parameters())
    check_names(names, ck["params"], f"{src} (against its own model config)")
    if layout.rank("dp_cp") != 0:
        return 0
    params = {name: {k: tp_slice(v, p, layout).clone() for k, v in ck["params"][name].items()}
              for name, p in names.items()}
    atomic_save({"format": SHARDED_FORMAT, "params": params, "optimizer_step": ck["optimizer_step"],
                 "global_steps": ck["global_steps"], "lr_scheduler": ck["lr_scheduler"],
                 "model_config": ck["model_config"]},
                os.path.join(tmp, shard_file(layout.rank("pp"), layout.rank("tp"))))
    send(shard_file(layout.rank("pp"), layout.rank("tp")))
    return len(params)


def convert_checkpoint(src: str, dst: str, config: Any, *, timeout: float = 600,
                       echo: Optional[Callable[[str], None]] = None) -> dict[str, Any]:
    """Slice engine.save's checkpoint in `src` for the layout of `config` (YAML path, dict or ParallelConfig) into
    the new folder `dst`. Returns the index written to dst."""
    import torch  # noqa: F401  heavy imports before the workers fork
    import transformers  # noqa: F401

    from .config import ParallelConfig, load_config
    from .launch import run_local
    from .plan import make_plan

    cfg = config if isinstance(config, ParallelConfig) else load_config(config)
    plan = make_plan(cfg)
    source = read_checkpoint_file(os.path.join(src, FILE), FORMAT)  # fails here, before any process starts
    if not source.get("model_config"):
        raise ValueError(f"{src}/{FILE} carries no model config (saved by an older msparallel_ds); resume it with "
                         "engine.load under the new layout instead")
    del source
    dst_path = Path(dst)
    if dst_path.exists() and any(dst_path.iterdir()):
        raise FileExistsError(f"{dst} exists and is not empty; convert-checkpoint writes a new folder")
    tmp = f"{dst_path.as_posix().rstrip('/')}.tmp-{os.getpid()}"
    os.makedirs(tmp, exist_ok=True)
    try:
        run_local(_convert_rank, plan.world_size, (os.path.abspath(src), tmp, cfg), timeout=timeout,
                  on_message=(lambda rank, name: echo(f"  wrote {name}")) if echo else None)
        index = {"format": SHARDED_FORMAT, "source": os.path.abspath(src),
                 "config": str(config) if isinstance(config, (str, os.PathLike)) else None,
                 "mesh": {"pp": plan.mesh.pp, "tp": plan.mesh.tp},
                 "files": sorted(f for f in os.listdir(tmp) if f.endswith(".pt"))}
        with open(os.path.join(tmp, SHARDED_INDEX), "w") as f:
            json.dump(index, f, indent=1)
        if dst_path.exists():
            dst_path.rmdir()  # empty (checked above)
        os.replace(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return index
