"""The on-disk format of layout-independent training checkpoints: names, atomic writes, one clear read error.

    engine.save("ckpt/")      # every rank calls; global rank 0 writes ckpt/msp_universal.pt
    engine.load("ckpt/")      # in a new run, after msp.initialize, under the same or another YAML

What is stored, per parameter under its HF name: the fp32 master weight and the Adam moments (exp_avg,
exp_avg_sq), FULL size: ZeRO partitions are gathered over dp x cp and tensor-parallel shards over tp (by the shard
spec, msparallel_ds.tensor_parallel.spec). Plus the optimizer step, the engine's step count, the lr scheduler state
and the HF model config. Loading slices the same tensors for the new layout's tp rank, so the continued run takes
exactly the steps the uninterrupted one would have. Rank 0 holds the full state while saving; meant for models that
fit in one host's memory: engine.save(dir, sharded=True) (checkpoint.sharded) has every rank write only its chunks.

The file is written under a temporary name and renamed into place, under the folder's save lock, so a run killed
while saving leaves the previous checkpoint intact (its stale `.tmp-msp-HOST-PID-*` is removed by the next save
into that folder, checkpoint.folder); a save removes the checkpoints it supersedes there; a missing,
truncated or foreign file is one clear error. Saves are agreed on by every rank (write_agreed): rank 0 refuses
non-finite state and reports any failure (disk full: "no space left on device writing PATH") to all ranks, which
raise the same CheckpointSaveError instead of waiting in a barrier. Every tensor's crc32 is stored at save time and
checked at load (flipped bytes are an error); files written before that load with a warning. `msparallel-ds
convert-checkpoint SRC DST --to-config NEW.yaml` (checkpoint.convert) pre-slices a checkpoint for another layout
offline: DST holds one file per (pp, tp) coordinate (SHARDED_FORMAT, same keys, tensors already sliced) plus the
index SHARDED_INDEX, and engine.load reads only its own file.
"""
from __future__ import annotations

import errno
import json
import os
import tempfile
import warnings
import zlib
from typing import TYPE_CHECKING, Any, Optional

import torch

from .folder import (CheckpointSaveError, acquire_lock, checkpoint_kind, release_lock, remove_superseded,
                     sweep_stale_temps, tmp_prefix)
from .paths import set_user_mode

if TYPE_CHECKING:
    from ..distributed.layout import ParallelLayout

__all__ = ["FILE", "FORMAT", "SHARDED_FORMAT", "SHARDED_INDEX", "CheckpointSaveError", "agreed", "atomic_save",
           "atomic_write",
           "check_model_config", "check_names", "nonfinite_tensors", "read_checkpoint_file", "read_for_layout",
           "record_for", "resume_progress", "shard_file", "verify_checksums", "write_agreed"]

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
    sweep_stale_temps(folder)  # only ours, left by a killed save (never a save in flight, never a user's file)
    atomic_write(path, lambda f: torch.save(obj, f))


def atomic_write(path: str, write, *, suffix: str = ".pt") -> None:
    """`write(file)` into a temporary name in path's folder, fsync, then rename: readers see the old file or the
    new one, never a part."""
    fd, tmp = tempfile.mkstemp(prefix=tmp_prefix(), suffix=suffix, dir=os.path.dirname(os.path.abspath(path)))
    try:
        set_user_mode(tmp)  # mkstemp's 0600 -> the umask's mode, as the index and any other file the user writes
        with os.fdopen(fd, "wb") as f:
            write(f)
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
    if checkpoint_kind(load_dir) != "converted":
        return read_checkpoint_file(os.path.join(load_dir, FILE), FORMAT), False
    try:
        with open(index, encoding="utf-8") as f:
            meta = json.load(f)
        if not isinstance(meta, dict) or not isinstance(meta.get("mesh", {}), dict):
            raise ValueError("not an object with format, mesh and files")
    except ValueError as e:
        raise ValueError(f"{index}: not a convert-checkpoint index ({e}); convert the original checkpoint again "
                         "with msparallel-ds convert-checkpoint") from None
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
            "model_config": config.to_dict() if hasattr(config, "to_dict") else None,
            "checksum": "crc32", "checksums": checksums(params)}


def resume_progress(engine, ck: dict[str, Any]) -> dict[str, Any]:
    """After the tensors of `ck` are loaded on every rank: the lr scheduler and step count, then a barrier."""
    import torch.distributed as dist

    if ck["lr_scheduler"] is not None and engine.lr_scheduler is not None:
        engine.lr_scheduler.load_state_dict(ck["lr_scheduler"])
    engine.global_steps = ck["global_steps"]
    dist.barrier()
    return {"global_steps": ck["global_steps"], "optimizer_step": ck["optimizer_step"]}


# ---------------------------------------------------------------------------------------------- saves
def nonfinite_tensors(params: dict) -> list[str]:
    """'name/key' of every tensor in a {name: {key: tensor}} record holding NaN or inf."""
    return [f"{name}/{k}" for name, rec in params.items() for k, t in rec.items()
            if t.is_floating_point() and not bool(torch.isfinite(t).all())]


def _no_space(e: BaseException) -> bool:
    seen = set()
    while e is not None and id(e) not in seen:  # torch's writer hides ENOSPC in the chained exception
        seen.add(id(e))
        if (isinstance(e, OSError) and e.errno == errno.ENOSPC) or "No space left on device" in str(e):
            return True
        e = e.__cause__ or e.__context__
    return False


def _save_failure(e: BaseException, path: str) -> str:
    if isinstance(e, CheckpointSaveError):
        return str(e)
    if _no_space(e):
        return (f"engine.save: no space left on device writing {path}; free space on that disk or save to another "
                "folder (the previous checkpoint there is kept)")
    return (f"engine.save: writing {path} failed on global rank 0 ({type(e).__name__}: {e}); the previous "
            "checkpoint there is kept")


def _locked_save(record: dict, path: str) -> None:
    """atomic_save under the folder's save lock, then remove what it supersedes (folder.remove_superseded)."""
    folder = os.path.dirname(os.path.abspath(path))
    acquire_lock(folder)
    try:
        atomic_save(record, path)
        remove_superseded(folder, keep=os.path.basename(path))
    finally:
        release_lock(folder)


def write_agreed(record: Optional[dict], path: str, device=None) -> None:
    """Every rank calls; global rank 0 passes the record and writes it (refusing non-finite tensors), the others
    None. The outcome is broadcast, so a failure on rank 0 is the same CheckpointSaveError on every rank (no rank
    is left in a barrier)."""
    import torch.distributed as dist

    message, cause = None, None
    if record is not None:
        try:
            bad = nonfinite_tensors(record["params"])
            if bad:
                raise CheckpointSaveError(
                    f"engine.save: refusing to write non-finite training state to {path}: {len(bad)} tensors hold "
                    f"NaN/inf (first: {bad[:3]}); the previous checkpoint there is kept. Training diverged: lower "
                    "the learning rate or check the data, and resume from the kept checkpoint with engine.load")
            _locked_save(record, path)
        except Exception as e:  # reported to every rank below
            message, cause = _save_failure(e, path), e
    if dist.is_initialized() and dist.get_world_size() > 1:
        box = [message]
        dev = device if device is not None and torch.device(device).type == "cuda" else None
        dist.broadcast_object_list(box, src=0, device=dev)
        message = box[0]
    if message is not None:
        raise CheckpointSaveError(message) from cause


# ---------------------------------------------------------------------------------------------- load checks
def agreed(fn, what: str):
    """fn() on every rank, the failures shared: a rank whose fn raised re-raises its error, the others raise a
    ValueError naming that rank, so no rank goes on into a collective alone (every rank calls)."""
    import torch.distributed as dist

    err = None
    try:
        out = fn()
    except Exception as e:  # shared below
        err, out = e, None
    if dist.is_initialized() and dist.get_world_size() > 1:
        msgs: list = [None] * dist.get_world_size()
        dist.all_gather_object(msgs, None if err is None else f"{type(err).__name__}: {err}")
        failed = [r for r, m in enumerate(msgs) if m is not None]
        if err is None and failed:
            raise ValueError(f"{what} failed on global rank {failed[0]} ({msgs[failed[0]]}); nothing was loaded")
    if err is not None:
        raise err
    return out


ARCH_KEYS = ("model_type", "hidden_size", "num_attention_heads", "num_key_value_heads", "num_hidden_layers",
             "intermediate_size", "vocab_size", "rope_theta", "head_dim", "num_experts", "num_local_experts",
             "n_routed_experts", "moe_intermediate_size", "num_experts_per_tok", "tie_word_embeddings",
             "n_embd", "n_head", "n_layer", "max_position_embeddings")


def check_model_config(saved: Optional[dict], model, source: str) -> None:
    """The saved HF model config against `model`'s: an architecture key both hold with different values is an
    error naming the key and both values (same shapes can hide another model, e.g. 8 vs 4 heads)."""
    config = getattr(model, "config", None)
    mine = config.to_dict() if hasattr(config, "to_dict") else None
    if not saved or not mine:
        return
    for key in ARCH_KEYS:
        if key in saved and key in mine and saved[key] is not None and mine[key] is not None \
                and saved[key] != mine[key]:
            raise ValueError(f"{source} was saved from another model: model config {key}={saved[key]!r} in the "
                             f"checkpoint, {key}={mine[key]!r} in this run's model; build the model with the "
                             "checkpoint's config (or load a checkpoint of this model). Nothing was loaded")


def crc32(t: torch.Tensor) -> int:
    """The crc32 of a CPU tensor's bytes (any dtype)."""
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    return zlib.crc32(flat.view(torch.uint8).numpy()) if flat.numel() else 0


def checksums(params: dict) -> dict:
    return {name: {k: crc32(t) for k, t in rec.items()} for name, rec in params.items()}


_WARNED_NO_CHECKSUM = []


def verify_checksums(ck: dict, names, source: str) -> None:
    """The crc32 stored at save time of every tensor this rank loads; older files (no checksums) warn once."""
    stored = ck.get("checksums")
    if stored is None:
        if not _WARNED_NO_CHECKSUM:
            _WARNED_NO_CHECKSUM.append(True)
            warnings.warn(f"{source}: the checkpoint holds no checksums (written before they were added, or by "
                          "convert-checkpoint); it is loaded without an integrity check", stacklevel=3)
        return
    for name in names:
        for k, t in ck["params"][name].items():
            want = stored.get(name, {}).get(k)
            if want is not None and crc32(t) != want:
                raise ValueError(f"{source}: tensor {name}/{k} does not match its checksum (crc32 {crc32(t):#010x}, "
                                 f"saved {want:#010x}): the file is corrupted (flipped bytes, a bad disk or copy); "
                                 "load an earlier checkpoint or copy it again. Nothing was loaded")
