"""One checkpoint folder: which checkpoint in it is the complete one, who may write it, what a save supersedes.

A folder holds ONE checkpoint, in one of three formats (newest first):
- MANIFEST (msp_checkpoint.json): a sharded save (checkpoint.sharded, torch.distributed.checkpoint); the manifest
  is written last, atomically, and names its data subfolder `dcp-*`, so it is the "complete" mark;
- SHARDED_INDEX (msp_sharded.json + msp_shard_*.pt): convert-checkpoint output;
- FILE (msp_universal.pt): engine.save's single file.
A save removes what it supersedes (the other formats' files, older `dcp-*` data) after its own mark is in place,
so a converted folder that later gets engine.save loads the new save, never the stale shards (a folder holding two
formats, left by an older msparallel_ds, is an error naming both). Saves into one folder are serialized by a lock
file (SAVE_LOCK, holding host and pid): a second save while one is in flight is a clear error, and a lock whose
process is gone (same host) is taken over. Temporary files are named `.tmp-msp-HOST-PID-*`; a save sweeps only
those of this host whose process is gone (never a user's file, never a save in flight).
"""
from __future__ import annotations

import glob
import json
import os
import shutil
import socket
from typing import Optional

__all__ = ["CheckpointSaveError", "MANIFEST", "SAVE_LOCK", "TMP_PREFIX", "acquire_lock", "checkpoint_kind", "has_checkpoint", "release_lock",
           "remove_superseded", "sweep_stale_temps", "tmp_prefix"]

MANIFEST = "msp_checkpoint.json"
SAVE_LOCK = ".msp-save.lock"
TMP_PREFIX = ".tmp-msp-"
_LEGACY = ("msp_universal.pt", "msp_sharded.json")


class CheckpointSaveError(RuntimeError):
    """engine.save failed (on any rank): raised on every rank with the same message; the previous file is kept."""


def _host() -> str:
    return socket.gethostname().replace("-", "_")


def tmp_prefix(pid: Optional[int] = None) -> str:
    """The prefix of this process's (or `pid`'s) temporary files: `.tmp-msp-HOST-PID-`."""
    return f"{TMP_PREFIX}{_host()}-{os.getpid() if pid is None else pid}-"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def _stale(host: str, pid: int) -> bool:
    """Provably stale: written by a process of this host that no longer runs."""
    return host == _host() and pid != os.getpid() and not _alive(pid)


def sweep_stale_temps(folder: str) -> list[str]:
    """Remove the temporary files (and data folders) left in `folder` by killed saves of this host; returns them."""
    removed = []
    for path in glob.glob(os.path.join(glob.escape(folder), TMP_PREFIX + "*")):
        parts = os.path.basename(path)[len(TMP_PREFIX):].split("-")
        if len(parts) < 3 or not parts[1].isdigit() or not _stale(parts[0], int(parts[1])):
            continue
        if os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            try:
                os.remove(path)
            except OSError:
                continue
        removed.append(path)
    return removed


def acquire_lock(folder: str) -> None:
    """Take `folder`'s save lock (creating the folder); a save in flight there is a clear error."""
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, SAVE_LOCK)
    for _ in range(2):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            try:
                with open(path) as f:
                    owner = json.load(f)
                host, pid = str(owner["host"]), int(owner["pid"])
            except (OSError, ValueError, KeyError, TypeError):
                host, pid = "?", -1
            if pid > 0 and _stale(host, pid):  # its save was killed: take the folder over
                os.remove(path)
                continue
            raise CheckpointSaveError(
                f"engine.save: another save into {folder} is in flight (lock {path} held by pid {pid} on host "
                f"{host}); wait for it to finish or save to another folder (if that process is gone, delete the "
                "lock file)") from None
        with os.fdopen(fd, "w") as f:
            json.dump({"host": _host(), "pid": os.getpid()}, f)
        return
    raise CheckpointSaveError(f"engine.save: could not take the save lock {path}")


def release_lock(folder: str) -> None:
    try:
        os.remove(os.path.join(folder, SAVE_LOCK))
    except OSError:
        pass


def checkpoint_kind(folder: str) -> Optional[str]:
    """'sharded' (MANIFEST), 'converted' (SHARDED_INDEX), 'universal' (FILE) or None; two at once is an error."""
    found = [(kind, name) for kind, name in (("sharded", MANIFEST), ("converted", _LEGACY[1]),
                                             ("universal", _LEGACY[0]))
             if os.path.exists(os.path.join(folder, name))]
    if len(found) > 1:
        names = ", ".join(name for _, name in found)
        raise ValueError(f"{folder} holds checkpoints of different formats ({names}): it is unclear which is "
                         "current (an older msparallel_ds saved into a converted folder). Keep the one you want "
                         "(delete the other files) or save again into an empty folder. Nothing was loaded")
    return found[0][0] if found else None


def has_checkpoint(folder: str) -> bool:
    """Whether `folder` holds an msparallel_ds checkpoint in any format (what the Trainer's resume loads as ours)."""
    return any(os.path.exists(os.path.join(folder, n)) for n in (MANIFEST, *_LEGACY))


def remove_superseded(folder: str, keep: str) -> None:
    """After a save into `folder` is complete: remove every other checkpoint there (`keep` is the file or data
    folder just written; the manifest stays with its data)."""
    keep_names = {keep, SAVE_LOCK} | ({MANIFEST} if keep.startswith("dcp-") else set())
    doomed = [os.path.join(folder, n) for n in (*_LEGACY, MANIFEST) if n not in keep_names]
    doomed += glob.glob(os.path.join(glob.escape(folder), "msp_shard_pp*_tp*.pt"))
    doomed += [p for p in glob.glob(os.path.join(glob.escape(folder), "dcp-*")) if os.path.basename(p) != keep]
    for path in doomed:
        if os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
        elif os.path.exists(path):
            os.remove(path)
