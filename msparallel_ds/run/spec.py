"""The run's YAML: the file, merged with override YAMLs and --set key=value, checked for what the runner needs."""
from __future__ import annotations

import copy
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Optional, Sequence

import yaml

from ..config.errors import ConfigError, ConfigIssue, ConfigWarning

KNOWN_CALLBACKS = {"MFLossMonitor", "CheckpointMonitor"}


def _err(key, value, rule, fix=""):
    return ConfigError(ConfigIssue(key, value, rule, fix))


def merge(base: dict, over: Mapping) -> dict:
    """Deep merge: mappings merge key by key, anything else (lists included) is replaced."""
    out = dict(base)
    for k, v in over.items():
        out[k] = merge(out[k], v) if isinstance(v, Mapping) and isinstance(out.get(k), Mapping) else copy.deepcopy(v)
    return out


def apply_set(raw: dict, item: str) -> dict:
    """--set a.b.c=VALUE (VALUE read as YAML: 2, true, [1, 2], text)."""
    if "=" not in item:
        raise _err("--set", item, "must be KEY.PATH=VALUE", "e.g. --set runner_config.epochs=2")
    key, value = item.split("=", 1)
    over: dict = {}
    node = over
    parts = key.strip().split(".")
    for p in parts[:-1]:
        node = node.setdefault(p, {})
    node[parts[-1]] = yaml.safe_load(value) if value.strip() else None
    return merge(raw, over)


@dataclass
class RunSpec:
    """Everything the Trainer reads from the YAML, in the YAML's order."""

    raw: dict
    source: str
    output_dir: str
    stop_after: Optional[int] = None
    tensorboard: Optional[str] = None
    callbacks: list = field(default_factory=list)

    @classmethod
    def load(cls, path: str, overrides: Sequence[str] = (), sets: Sequence[str] = (), *,
             output_dir: Optional[str] = None, stop_after: Optional[int] = None,
             tensorboard: Optional[str] = None) -> "RunSpec":
        raw = _read(path)
        for o in overrides:
            raw = merge(raw, _read(o))
        for s in sets:
            raw = apply_set(raw, s)
        mode = raw.get("run_mode", "train")
        if mode not in ("train", "finetune"):
            raise _err("run_mode", mode, "is not in this command (it trains: train / finetune)",
                       "use MindFormers' predict/eval tooling, or set run_mode: train")
        out = output_dir or raw.get("output_dir") or "./output"
        if stop_after is not None and stop_after < 1:
            raise _err("--stop-after", stop_after, "must be >= 1")
        callbacks = raw.get("callbacks") or [{"type": "MFLossMonitor"}]
        unknown = sorted({c.get("type") for c in callbacks if isinstance(c, Mapping)} - KNOWN_CALLBACKS)
        if unknown:
            warnings.warn(f"callbacks: {', '.join(map(str, unknown))} not run here (only MFLossMonitor and "
                          "CheckpointMonitor are)", ConfigWarning, stacklevel=2)
        return cls(raw=raw, source=str(path), output_dir=str(out), stop_after=stop_after, tensorboard=tensorboard,
                   callbacks=[dict(c) for c in callbacks if isinstance(c, Mapping)])

    # ------------------------------------------------------------------ top-level keys
    @property
    def seed(self) -> int:
        return int(self.raw.get("seed", 0) or 0)

    @property
    def resume(self) -> Optional[str]:
        """resume_training: true -> the newest complete checkpoint in output_dir; a path -> that folder's newest."""
        r = self.raw.get("resume_training", False)
        if r is True:
            return os.path.join(self.output_dir, "checkpoint")
        if isinstance(r, str) and r:
            return r
        return None

    def callback(self, kind: str) -> Optional[dict]:
        return next((c for c in self.callbacks if c.get("type") == kind), None)

    # ------------------------------------------------------------------ runner_config
    @property
    def epochs(self) -> int:
        e = (self.raw.get("runner_config") or {}).get("epochs", 1)
        if not isinstance(e, int) or e < 1:
            raise _err("runner_config.epochs", e, "must be a positive int")
        return e

    def write(self, folder: str) -> str:
        """The merged YAML as run (output_dir/run.yaml): the record of the run, and what model_from_yaml reads."""
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, "run.yaml")
        tmp = path + f".tmp{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as f:
            yaml.safe_dump(self.raw, f, sort_keys=False)
        os.replace(tmp, path)
        return path


def _read(path: str) -> dict:
    p = Path(path)
    if not p.is_file():
        raise _err("RUN.yaml", str(path), "does not exist", "pass the path of a MindFormers YAML")
    data = yaml.safe_load(p.read_text(encoding="utf-8"))
    if not isinstance(data, dict):
        raise _err("RUN.yaml", str(path), "is not a YAML mapping")
    return data
