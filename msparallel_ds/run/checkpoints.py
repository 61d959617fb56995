"""CheckpointMonitor: engine.save every save_checkpoint_steps into output_dir/checkpoint/step_<k> (sharded, each rank
its own chunks through torch.distributed.checkpoint: MindFormers' default integrated_save: False), the trainer's own
state beside it (step, data position, each rank's RNG), keep_checkpoint_max honoured. A checkpoint is complete once
its folder is renamed from step_<k>.partial (after every rank's part is written); the oldest complete one is removed
only then. Only engine.save / engine.load are used, so the saver behind them can change.

MindFormers' other CheckpointMonitor keys, as checkpoint/monitor.py reads them: async_save (engine.save returns once
the state is staged; the folder becomes complete, and older ones are pruned, when its files are written: at the next
save or the end of training, so a crash meanwhile leaves the previous complete checkpoint), integrated_save (also a
merged weights-only HF folder step_<k>/hf in bounded files, checkpoint.merged) and checkpoint_format (ckpt /
safetensors: the sharded state is DCP's files either way)."""
from __future__ import annotations

import json
import os
import random
import re
import shutil
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

STATE = "trainer_state.json"
_DIR = re.compile(r"^step_(\d+)$")


def complete_checkpoints(folder: str) -> list[tuple[int, str]]:
    """(step, path) of the complete checkpoints in folder, oldest first."""
    if not os.path.isdir(folder):
        return []
    found = [(int(m.group(1)), os.path.join(folder, d)) for d in os.listdir(folder)
             if (m := _DIR.match(d)) and os.path.isfile(os.path.join(folder, d, STATE))]
    return sorted(found)


def latest(folder: str) -> Optional[str]:
    """The newest complete checkpoint under folder, or folder itself when it is one."""
    if os.path.isfile(os.path.join(folder, STATE)):
        return folder
    found = complete_checkpoints(folder)
    return found[-1][1] if found else None


def _rng_state() -> dict:
    """Tensors and plain numbers only, so torch.load(weights_only=True) reads it back (no pickle)."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    version, words, gauss_next = random.getstate()
    return {"torch": torch.get_rng_state(), "numpy": torch.from_numpy(keys.astype(np.int64)),
            "numpy_rest": [kind, int(pos), int(has_gauss), float(gauss)],
            "python": torch.tensor(words, dtype=torch.int64), "python_rest": [version, gauss_next],
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def _set_rng(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    kind, pos, has_gauss, gauss = state["numpy_rest"]
    np.random.set_state((kind, state["numpy"].numpy().astype(np.uint32), pos, has_gauss, gauss))
    version, gauss_next = state["python_rest"]
    random.setstate((version, tuple(int(x) for x in state["python"].tolist()), gauss_next))
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class CheckpointMonitor:
    def __init__(self, output_dir: str, every: Optional[int], keep: Optional[int], rank: int, replicas: int = 0,
                 async_save: bool = False, integrated_save: bool = False, fmt: str = "ckpt"):
        from ..checkpoint.monitor import KEY, check_keys

        check_keys(replicas, fmt)
        for name, value in (("async_save", async_save), ("integrated_save", integrated_save)):
            if not isinstance(value, bool):
                raise ValueError(f"{KEY}.{name}={value!r} must be true or false")
        self.folder, self.replicas = os.path.join(output_dir, "checkpoint"), replicas
        self.every, self.keep, self.rank = every, keep if keep and keep > 0 else None, rank
        self.async_save, self.integrated_save = async_save, integrated_save
        self._pending: Optional[tuple] = None  # (tmp, final, state) of the save in flight

    def start(self, engine) -> None:
        """Before the first step: with async_save, the checkpoint's gloo group now (collective, every rank), so the
        first background save only stages (as checkpoint/monitor.CheckpointSaver and torchtitan do)."""
        if self.async_save and self.every:
            from ..checkpoint.sharded import _group

            _group(engine.layout)

    def due(self, step: int) -> bool:
        return bool(self.every) and step % self.every == 0

    def save(self, engine, step: int, state: dict) -> str:
        """Save after `step`; with async_save returns once staged (the folder is complete after finish())."""
        self.finish(engine)  # at most one save in flight
        final = os.path.join(self.folder, f"step_{step}")
        tmp = final + ".partial"
        if self.rank == 0:
            os.makedirs(self.folder, exist_ok=True)
            for stale in (tmp, final):  # a crash mid-save, or a rerun of the same step
                shutil.rmtree(stale, ignore_errors=True)
        dist.barrier()
        engine.save(tmp, sharded=True, async_save=self.async_save, replicas=self.replicas)
        torch.save(_rng_state(), os.path.join(tmp, f"rng_rank{self.rank}.pt"))
        self._pending = (tmp, final, state)
        if not self.async_save:
            self.finish(engine)
        return final

    def finish(self, engine) -> None:
        """Complete the save in flight: wait for its files (a failure is raised here), write the merged HF folder
        with integrated_save, then mark it complete and prune; every rank calls it (the runner at the end)."""
        if self._pending is None:
            return
        from ..checkpoint.sharded import _group, wait_pending

        tmp, final, state = self._pending
        self._pending = None
        wait_pending()
        dist.barrier()
        if self.integrated_save:
            from ..checkpoint.merged import export_merged

            export_merged(tmp, os.path.join(tmp, "hf"), group=_group(engine.layout))
            dist.barrier()
        if self.rank == 0:
            with open(os.path.join(tmp, STATE), "w") as f:
                json.dump(state, f)
            os.replace(tmp, final)
            self._prune()
        dist.barrier()

    def _prune(self) -> None:
        if self.keep is None:
            return
        done = complete_checkpoints(self.folder)
        for _, path in done[:-self.keep]:
            shutil.rmtree(path, ignore_errors=True)

    def load(self, engine, where: str) -> dict:
        """Resume from the newest complete checkpoint under `where` (model, optimizer, lr schedule, step, RNG)."""
        path = latest(where)
        if path is None:
            raise FileNotFoundError(f"resume_training: no complete checkpoint under {where} (folders step_<k> holding "
                                    f"{STATE}); fix: train without resume_training first, or point it at one")
        engine.load(path)
        with open(os.path.join(path, STATE)) as f:
            state = json.load(f)
        rng = os.path.join(path, f"rng_rank{self.rank}.pt")
        if os.path.isfile(rng):
            _set_rng(torch.load(rng, weights_only=True))
        state["path"] = path
        return state
