"""The on-disk format of layout-independent training checkpoints: names, atomic writes, one clear read error.

    engine.save("ckpt/")      # every rank calls; global rank 0 writes ckpt/msp_universal.pt
    engine.load("ckpt/")      # in a new run, after msp.initialize, under the same or another YAML

What is stored, per parameter under its HF name: the fp32 master weight and the Adam moments (exp_avg,
exp_avg_sq), FULL size: ZeRO partitions are gathered over dp x cp and tensor-parallel shards over tp (by the shard
spec, msparallel_ds.tensor_parallel.spec). Plus the optimizer step, the engine's step count, the lr scheduler state
and the HF model config. Loading slices the same tensors for the new layout's tp rank, so the continued run takes
exactly the steps the uninterrupted one would have. Rank 0 holds the full state while saving; meant for models that
fit in one host's memory (resharding a 70B run would stream per parameter instead).

The file is written under a temporary name and renamed into place, so a run killed while saving leaves the
previous checkpoint intact; a missing, truncated or foreign file is one clear error. `msparallel-ds
convert-checkpoint SRC DST --to-config NEW.yaml` (checkpoint.convert) pre-slices a checkpoint for another layout
offline: DST holds one file per (pp, tp) coordinate (SHARDED_FORMAT, same keys, tensors already sliced) plus the
index SHARDED_INDEX, and engine.load reads only its own file.
"""
from __future__ import annotations

import json
import os
import tempfile
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from ..distributed.layout import ParallelLayout

__all__ = ["FILE", "FORMAT", "SHARDED_FORMAT", "SHARDED_INDEX", "atomic_save", "check_names", "record_for",
           "resume_progress",
           "read_checkpoint_file", "read_for_layout", "shard_file"]

FILE = "msp_universal.pt"
FORMAT = "msparallel_ds.universal/1"
SHARDED_INDEX = "msp_sharded.json"
SHARDED_FORMAT = "msparallel_ds.sharded/1"


def shard_file(pp_rank: int, tp_rank: int) -> str:
    """The file of one (pp, tp) coordinate in a converted folder (dp and cp peers read the same one)."""
    return f"msp_shard_pp{pp_rank:03d}_tp{tp_rank:03d}.pt"


def atomic_save(obj: Any, path: str) -> None:
    """torch.save to a temporary name in the same folder, then rename: readers see the old file or the new one."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".pt", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def read_checkpoint_file(path: str, expected_format: str) -> dict[str, Any]:
    """torch.load (mmapped) with one clear error for a missing, truncated or foreign file."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"no msparallel_ds checkpoint at {path} (write one with engine.save(dir))")
    try:
        ck = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except Exception as e:  # a truncated zip, a pickle of something else, a text file...
        raise ValueError(f"{path} is not a readable msparallel_ds checkpoint ({type(e).__name__}: {e}); it may be "
                         "truncated or from another tool: load an earlier checkpoint or save again") from None
    if not isinstance(ck, dict) or ck.get("format") != expected_format:
        found = ck.get("format") if isinstance(ck, dict) else type(ck).__name__
        raise ValueError(f"{path}: unknown checkpoint format {found!r} (expected {expected_format})")
    return ck


def check_names(names, saved, source: str, *, subset: bool = False) -> None:
    """The model's parameter names must all be in the checkpoint and, unless this rank holds a `subset` of the model
    (one pipeline stage), the checkpoint must hold no others."""
    names, saved = set(names), set(saved)
    missing, unexpected = sorted(names - saved), [] if subset else sorted(saved - names)
    if missing or unexpected:
        raise ValueError(f"{source} does not match this model: missing {missing[:5]}, unexpected {unexpected[:5]}")


def read_for_layout(load_dir: str, layout: ParallelLayout) -> tuple[dict[str, Any], bool]:
    """The checkpoint's content for this rank and whether its tensors are already sliced for this layout (a folder
    written by convert-checkpoint) or full size (engine.save)."""
    index = os.path.join(load_dir, SHARDED_INDEX)
    if not os.path.exists(index):
        return read_checkpoint_file(os.path.join(load_dir, FILE), FORMAT), False
    with open(index) as f:
        meta = json.load(f)
    want = {"pp": layout.size("pp"), "tp": layout.size("tp")}
    if meta.get("format") != SHARDED_FORMAT or meta.get("mesh", {}) != want:
        raise ValueError(f"{load_dir} was converted for pipeline_stage={meta.get('mesh', {}).get('pp')}, "
                         f"model_parallel={meta.get('mesh', {}).get('tp')} ({meta.get('config')}); this run has "
                         f"pipeline_stage={want['pp']}, model_parallel={want['tp']}: convert the original checkpoint "
                         "again with msparallel-ds convert-checkpoint SRC DST --to-config THIS.yaml, or load the "
                         "original (layout-independent) one")
    return read_checkpoint_file(os.path.join(load_dir, shard_file(layout.rank("pp"), layout.rank("tp"))),
                                SHARDED_FORMAT), True


def record_for(engine, params: dict, optimizer_step: float, model) -> dict[str, Any]:
    """engine.save's file content: `params` ({HF name: {fp32, Adam moments}}, full size) plus the engine's progress
    (optimizer step, global steps, lr scheduler) and `model`'s config, which convert-checkpoint reads."""
    sched, config = engine.lr_scheduler, getattr(model, "config", None)
    return {"format": FORMAT, "params": params, "optimizer_step": optimizer_step, "global_steps": engine.global_steps,
            "lr_scheduler": sched.state_dict() if sched is not None else None,
            "model_config": config.to_dict() if hasattr(config, "to_dict") else None}


def resume_progress(engine, ck: dict[str, Any]) -> dict[str, Any]:
    """After the tensors of `ck` are loaded on every rank: the lr scheduler and step count, then a barrier."""
    import torch.distributed as dist

    if ck["lr_scheduler"] is not None and engine.lr_scheduler is not None:
        engine.lr_scheduler.load_state_dict(ck["lr_scheduler"])
    engine.global_steps = ck["global_steps"]
    dist.barrier()
    return {"global_steps": ck["global_steps"], "optimizer_step": ck["optimizer_step"]}
