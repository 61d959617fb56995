"""MindFormers' CheckpointMonitor for the train runner: when to save, in which form, how many to keep.

    saver = CheckpointSaver(engine, output_dir, save_steps=100, keep_max=5, integrated_save=False, async_save=True)
    for k in range(1, steps + 1):
        engine.train_batch(...)
        saver.step(k)          # saves at every save_steps-th step
    saver.finish()             # waits for the save in flight; every rank calls both

Each save is a new folder OUTPUT_DIR/checkpoint/step-KKKKKKKK written by engine.save(folder, sharded=True) (every
rank its chunks, torch.distributed.checkpoint; engine.load resumes it under any layout). Semantics of the
CheckpointMonitor keys:
- integrated_save False (MindFormers' default): the sharded save only; True: additionally a merged weights-only HF
  folder (safetensors, STEP/hf) written in bounded files by every rank in turn (checkpoint.merged), never the whole
  state in one rank's memory; it waits for the step's files, so it is not hidden behind training steps.
- async_save: engine.save returns once the state is staged on CPU; the files are written while training goes on,
  at most one save in flight (the next save or finish() waits for it).
- keep_checkpoint_max (keep_max): once a save is complete, complete step folders older than the newest keep_max
  are deleted (a save in flight or a folder without its manifest is never deleted). None or 0 keeps all.
- checkpoint_format (fmt): "ckpt" or "safetensors" (MindFormers' values): both save the sharded training state
  (DCP's .distcp files are its only sharded form); the merged export is safetensors either way.
- replicas (msparallel_ds's key, not MindFormers'): 1 writes each rank's files also on a data-parallel peer
  (checkpoint.replicas), so a lost node's part resumes from the copy; 0 (default) writes every chunk once.
"""
from __future__ import annotations

import os
import re
import shutil
from typing import Optional

import torch.distributed as dist

from .folder import MANIFEST

__all__ = ["CheckpointSaver", "step_folders"]

FORMATS = ("ckpt", "safetensors")
KEY = "callbacks CheckpointMonitor"


def check_keys(replicas, fmt: str) -> None:
    """The CheckpointMonitor keys both savers read (this one and run/checkpoints.py's): replicas, checkpoint_format."""
    if isinstance(replicas, bool) or replicas not in (0, 1):
        raise ValueError(f"{KEY}.replicas={replicas!r} must be 0 or 1 (1: each rank's checkpoint files also "
                         "written by a data-parallel peer); set e.g. replicas: 1")
    if fmt not in FORMATS:
        raise ValueError(f"{KEY}.checkpoint_format={fmt!r} is not supported; use one of {', '.join(FORMATS)}")


_STEP = re.compile(r"step-(\d{8})")


def step_folders(root: str, *, complete: bool = True) -> list[tuple[int, str]]:
    """(step, folder) of the step folders under root, oldest first (only those with a manifest when `complete`)."""
    if not os.path.isdir(root):
        return []
    out = []
    for name in os.listdir(root):
        m = _STEP.fullmatch(name)
        if m and (not complete or os.path.exists(os.path.join(root, name, MANIFEST))):
            out.append((int(m.group(1)), os.path.join(root, name)))
    return sorted(out)


class CheckpointSaver:
    def __init__(self, engine, output_dir: str, save_steps: int, keep_max: Optional[int] = 5,
                 integrated_save: bool = False, async_save: bool = False, fmt: str = "ckpt", replicas: int = 0):
        if isinstance(save_steps, bool) or not isinstance(save_steps, int) or save_steps < 1:
            raise ValueError(f"{KEY}.save_checkpoint_steps={save_steps!r} must be a positive integer (save every N "
                             "steps); set e.g. save_checkpoint_steps: 100")
        if keep_max is not None and (isinstance(keep_max, bool) or not isinstance(keep_max, int) or keep_max < 0):
            raise ValueError(f"{KEY}.keep_checkpoint_max={keep_max!r} must be a non-negative integer (0 keeps all); "
                             "set e.g. keep_checkpoint_max: 5")
        check_keys(replicas, fmt)
        self.engine, self.root = engine, os.path.join(output_dir, "checkpoint")
        self.save_steps, self.keep_max = save_steps, keep_max or None
        self.integrated_save, self.async_save, self.fmt = bool(integrated_save), bool(async_save), fmt
        self.replicas = replicas
        self.saved: list[str] = []
        if self.async_save:  # the checkpoint's gloo group now (collective, every rank builds its saver), as torchtitan
            from .sharded import _group  # makes its async group at start: the first background save then only stages

            _group(engine.layout)

    def folder(self, step: int) -> str:
        return os.path.join(self.root, f"step-{step:08d}")

    def step(self, k: int) -> Optional[str]:
        """After training step k (1-based): save when k is a multiple of save_steps; returns the folder or None."""
        if k % self.save_steps:
            return None
        self._prune()
        folder = self.folder(k)
        self.engine.save(folder, sharded=True, async_save=self.async_save, replicas=self.replicas)
        if self.integrated_save:
            from .merged import export_merged
            from .sharded import _group, wait_pending

            wait_pending()
            export_merged(folder, os.path.join(folder, "hf"), group=_group(self.engine.layout))
        self.saved.append(folder)
        return folder

    def finish(self) -> None:
        """Wait for the save in flight (its failure is raised here), then drop what keep_max supersedes."""
        from .sharded import wait_pending

        wait_pending()
        self._prune()
        if dist.is_initialized():
            dist.barrier()

    def _prune(self) -> None:
        """Global rank 0 deletes complete step folders older than the newest keep_max complete ones."""
        if self.keep_max is None or (dist.is_initialized() and dist.get_rank() != 0):
            return
        complete = step_folders(self.root)
        for _, folder in complete[:-self.keep_max]:
            shutil.rmtree(folder, ignore_errors=True)
