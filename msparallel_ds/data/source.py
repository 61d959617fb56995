"""open_train_dataset: the YAML's train_dataset -> this dp rank's rows, in MindFormers' order, resumable."""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Union

import numpy as np
import yaml

from ..config.errors import ConfigError, ConfigIssue
from .order import minddataset_order
from .rows import Table, TrainRows, rank_positions

_MINDRECORD = re.compile(r"mindrecord\d*$")


def _err(key: str, value: Any, rule: str, fix: str = "") -> ConfigError:
    return ConfigError(ConfigIssue(key, value, rule, fix))


def _load(cfg: Union[str, os.PathLike, Mapping]) -> Mapping:
    if isinstance(cfg, Mapping):
        return cfg
    raw = getattr(cfg, "raw", None)  # a loaded ParallelConfig keeps its source dict, when it has one
    if isinstance(raw, Mapping):
        return raw
    path = Path(cfg)
    if not path.is_file():
        raise _err("", str(cfg), "is not a YAML file", "pass the path of the MindFormers YAML or its dict")
    with open(path, "r", encoding="utf-8") as f:
        data = yaml.safe_load(f)
    if not isinstance(data, Mapping):
        raise _err("", str(cfg), "is not a YAML mapping")
    return data


def train_dataset_section(cfg) -> Mapping:
    """The YAML's train_dataset (or train_dataset_task.dataset_config when that is where it lives)."""
    data = _load(cfg)
    section = data.get("train_dataset")
    if not isinstance(section, Mapping):
        task = data.get("train_dataset_task") or {}
        section = task.get("dataset_config") if isinstance(task, Mapping) else None
    if not isinstance(section, Mapping) or not isinstance(section.get("data_loader"), Mapping):
        raise _err("train_dataset.data_loader", None if not isinstance(section, Mapping) else section.get("data_loader"),
                   "is missing", "add train_dataset.data_loader with a type (MindDataset, "
                   "BlendedMegatronDatasetDataLoader) and its paths")
    return section


def _rows_per_step(data: Mapping) -> Optional[int]:
    rc = data.get("runner_config") or {}
    if not isinstance(rc, Mapping) or rc.get("batch_size") is None:
        return None
    pc = data.get("parallel_config") or {}
    mbi = int(data.get("micro_batch_interleave_num", 1) or 1)
    if int(pc.get("pipeline_stage", 1) or 1) > 1:
        return int(rc["batch_size"]) * int(pc.get("micro_batch_num", 1) or 1) * mbi
    return int(rc["batch_size"]) * int(rc.get("gradient_accumulation_steps", 1) or 1) * mbi


def open_train_dataset(cfg, dp_rank: int = 0, dp_size: int = 1) -> TrainRows:
    """The YAML's train_dataset as this dp rank's rows, in MindFormers' order (see TrainRows)."""
    data = _load(cfg)
    section = train_dataset_section(data)
    if not 0 <= dp_rank < dp_size:
        raise _err("dp_rank", dp_rank, f"must be in [0, dp_size={dp_size})")
    loader = section["data_loader"]
    kind = loader.get("type")
    if kind == "MindDataset":
        table = _mind_dataset(section)
    elif kind == "BlendedMegatronDatasetDataLoader":
        from .megatron import gpt_table
        table = gpt_table(section)
    elif kind == "HFDataLoader":
        from .hf import hf_table
        table = hf_table(section, data)
    else:
        raise _err("train_dataset.data_loader.type", kind, "is not a data loader this reader knows",
                   "use MindDataset, BlendedMegatronDatasetDataLoader or HFDataLoader")
    per_step = _rows_per_step(data)
    full = _full_batch(data, dp_size)
    sharded = not full
    positions = rank_positions(table.n_rows, dp_rank, dp_size, full, per_step or 1)
    rows = TrainRows(table.n_rows, table.get, lambda epoch: table.order(epoch, sharded), positions, table.columns,
                     table.kind)
    if per_step is not None and len(rows) < per_step:
        raise _err("train_dataset", f"{rows.n_rows} rows", f"give dp rank {dp_rank} of {dp_size} {len(rows)} rows, "
                   f"fewer than one step needs ({per_step} = runner_config.batch_size x accumulation/micro batches)",
                   "add data or lower runner_config.batch_size")
    return rows


def _mindrecord_files(loader: Mapping) -> List[str]:
    from .mindrecord import MindRecordShard
    if loader.get("dataset_dir"):
        key, where = "train_dataset.data_loader.dataset_dir", str(loader["dataset_dir"])
        if os.path.isdir(where):  # MindFormers: every file under it matching mindrecord\d*$, sorted
            files = sorted(os.path.join(r, f) for r, _, fs in os.walk(where) for f in fs if _MINDRECORD.search(f))
        elif _MINDRECORD.search(where) and os.path.isfile(where):
            files = [where]
        else:
            files = []
        if not files:
            raise _err(key, where, "holds no MindRecord file (names ending in mindrecord<N>)",
                       "point it at the folder or file that MindFormers' preprocessing wrote")
        if os.path.isfile(where):  # one file name: MindSpore reads every shard written with it
            files = MindRecordShard(where).shard_paths()
        return files
    if loader.get("dataset_files"):
        files = loader["dataset_files"]
        if isinstance(files, str):
            if not os.path.isfile(files):
                raise _err("train_dataset.data_loader.dataset_files", files, "does not exist", "fix the path")
            return MindRecordShard(files).shard_paths()
        missing = [f for f in files if not os.path.isfile(str(f))]
        if missing:
            raise _err("train_dataset.data_loader.dataset_files", missing[0], "does not exist", "fix the path")
        return [str(f) for f in files]
    raise _err("train_dataset.data_loader", dict(loader), "has neither dataset_dir nor dataset_files",
               "set dataset_dir to the MindRecord folder")


def _full_batch(data: Mapping, dp_size: int) -> bool:
    """MindFormers reads the whole stream on every rank (no sampler split) in semi-auto / auto parallel with
    parallel.full_batch; a YAML without a parallel section reads as one MindDataset would: unsplit for one rank,
    MindSpore's distributed sampler for several."""
    par = data.get("parallel")
    if not isinstance(par, Mapping):
        return dp_size == 1
    mode = par.get("parallel_mode", 1)
    semi = mode in (1, 2, "semi_auto_parallel", "auto_parallel") and data.get("use_parallel", True) is not False
    return bool(semi and par.get("full_batch", False))


def _mind_dataset(section: Mapping) -> Table:
    from .mindrecord import MindRecordError, MindRecordFiles
    loader = section["data_loader"]
    files = _mindrecord_files(loader)
    columns = section.get("input_columns") or ["input_ids"]
    try:
        table = MindRecordFiles(files, columns, "train_dataset.input_columns")
    except MindRecordError as e:
        raise _err("train_dataset.data_loader", files[0], str(e)) from None
    shuffle = loader.get("shuffle", True)  # MindDataset's default is a global shuffle
    if shuffle not in (True, False):
        raise _err("train_dataset.data_loader.shuffle", shuffle, "is not reproduced here (only true/false)",
                   "use true (global shuffle) or false")
    seed = int(section.get("seed", 0) or 0)
    n = len(table)
    if n == 0:
        raise _err("train_dataset.data_loader", files[0], "holds no rows")
    orders: Dict[tuple, np.ndarray] = {}

    def order(epoch: int, sharded: bool) -> np.ndarray:
        if (epoch, sharded) not in orders:
            orders.clear()
            orders[(epoch, sharded)] = minddataset_order(n, epoch, seed, bool(shuffle), sharded=sharded)
        return orders[(epoch, sharded)]
    return Table(n, table.__getitem__, order, columns, "MindDataset")
