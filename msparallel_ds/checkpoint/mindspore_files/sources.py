"""Full model weights out of what MindSpore / MindFormers saved, without MindSpore.

    w = read_mindspore_weights("output/checkpoint")        # rank_*/ folders + output/strategy/ found by itself
    w.tensors["model.layers.0.attention.wq.weight"]         # full, merged tensors (their saved dtype)

Accepted sources: a .ckpt; a .safetensors; a *.safetensors.index.json (HF weight_map) or MindFormers'
param_name_map.json; a folder holding one of those, several .safetensors or .ckpt files; a folder of rank_{r}/
subfolders (MindFormers: output/checkpoint/rank_{r}/{prefix}_rank_{r}-{epoch}_{step}.ckpt, or .safetensors), whose
slices are merged with the parallel strategy (strategy.py). With several checkpoints in one folder the latest by
(epoch, step) in the name is read; every rank must have that same (epoch, step).

Optimizer states, training-state scalars and strings are left out and listed in `dropped`; every other name is
kept as saved (the caller maps names and reports the ones it does not know).
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import torch

from ..paths import contained
from .ckpt_file import has_crc, read_ckpt
from .strategy import Layout, merge, read_strategies

# Prefixes MindSpore optimizers give their state (Parameter.clone(prefix=...)): AdamWeightDecay and MindFormers'
# AdamW / FP32StateAdamWeightDecay "adam_m"/"adam_v", Adam "moment1"/"moment2", Momentum "moments", Lamb
# "lamb_m"/"lamb_v", mint AdamW "exp_avg"/..., Adagrad/Adadelta "accum"/"accum_update", RMSProp "mean_grad"/
# "mean_square", MindFormers' gradient accumulation "accu_grads". Generic ones ("linear", "stat", "prev", "ax")
# are left out on purpose: model parameters use them too.
OPTIMIZER_PREFIXES = ("adam_m.", "adam_v.", "moment1.", "moment2.", "moments.", "lamb_m.", "lamb_v.", "exp_avg.",
                      "exp_avg_sq.", "max_exp_avg_sq.", "exp_inf.", "vhat.", "accum.", "accum_update.", "mean_grad.",
                      "mean_square.", "accu_grads.", "accumulated_grads.")
STATE_NAMES = frozenset({"epoch_num", "step_num", "global_step", "loss_scale", "scale_sense", "current_iterator_step",
                         "last_overflow_iterator_step", "learning_rate", "beta1_power", "beta2_power",
                         "total_steps", "consumed_samples"})
_STRATEGY_FILE = re.compile(r"ckpt_strategy.*\.(ckpt|json)$")
_RANK_DIR = re.compile(r"^rank_(\d+)$")
_EPOCH_STEP = re.compile(r"-(\d+)_(\d+)\.(?:ckpt|safetensors)$")
_WEIGHT_EXT = (".ckpt", ".safetensors")


@dataclass
class MindSporeWeights:
    tensors: dict[str, torch.Tensor]  # full tensors, in the order first seen (rank 0's file order first)
    dropped: dict[str, str] = field(default_factory=dict)  # name -> why it is not a model weight
    uncovered: set[str] = field(default_factory=set)  # from sliced rank folders with no layout: rank 0's copy
    files: list[str] = field(default_factory=list)  # the files read (strategy files included)


def why_dropped(name: str, value) -> str | None:
    """Why `name` is not a model weight (None = keep it)."""
    if isinstance(value, str):
        return "string"
    if name.startswith(OPTIMIZER_PREFIXES):
        return "optimizer state"
    if name in STATE_NAMES:
        return "training state scalar"
    if isinstance(value, torch.Tensor) and value.dim() == 0:
        return "scalar"
    return None


def _read_safetensors(path: str) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    from safetensors import SafetensorError

    out = {}
    try:
        with safe_open(path, framework="pt") as f:
            meta = f.metadata() or {}
            for name in f.keys():
                if meta.get(name) == "Int4":  # MindSpore marks qint4x2 tensors in the metadata
                    raise ValueError(f"{path}: parameter {name!r}: Int4 (qint4x2) tensors are not supported")
                out[name] = f.get_tensor(name)
    except SafetensorError as e:  # a truncated or corrupt file: one line naming it, not safetensors' traceback
        raise ValueError(f"{path}: not a readable .safetensors file ({e}); re-copy or re-export it") from None
    return out


def _read_file(path: str) -> dict:
    return read_ckpt(path) if path.endswith(".ckpt") else _read_safetensors(path)


def _epoch_step(path: str) -> tuple[int, int] | None:
    m = _EPOCH_STEP.search(os.path.basename(path))
    return (int(m.group(1)), int(m.group(2))) if m else None


def _latest(folder: str, files: list[str]) -> str:
    """The one checkpoint of a folder, or the latest by (epoch, step) in the names."""
    if len(files) == 1:
        return files[0]
    keyed = [(_epoch_step(f), f) for f in files]
    if any(k is None for k, _ in keyed):
        raise ValueError(f"{folder}: several checkpoints and not all named <prefix>-<epoch>_<step>: "
                         f"{[os.path.basename(f) for f in files]}; pass one file")
    keyed.sort()
    if keyed[-1][0] == keyed[-2][0]:
        raise ValueError(f"{folder}: two checkpoints for the same epoch and step: "
                         f"{os.path.basename(keyed[-2][1])}, {os.path.basename(keyed[-1][1])}; pass one file")
    return keyed[-1][1]


def _weight_files(folder: str) -> list[str]:
    return sorted(os.path.join(folder, f) for f in os.listdir(folder)
                  if f.endswith(_WEIGHT_EXT) and os.path.isfile(os.path.join(folder, f)))


def _read_index(path: str) -> tuple[dict[str, torch.Tensor], list[str]]:
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    wmap = data.get("weight_map", data) if isinstance(data, dict) else None
    if not isinstance(wmap, dict) or not all(isinstance(v, str) for v in wmap.values()):
        raise ValueError(f"{path}: not a weight map (expected {{'weight_map': {{name: file}}}} or {{name: file}})")
    folder = os.path.dirname(os.path.abspath(path))
    files = sorted(set(wmap.values()))
    full = {f: contained(folder, f, path) for f in files}  # every entry checked before any file is opened
    out: dict[str, torch.Tensor] = {}
    for file in files:
        for name, t in _read_file(full[file]).items():
            if wmap.get(name) == file:
                out[name] = t
    missing = [n for n in wmap if n not in out]
    if missing:
        raise ValueError(f"{path}: {len(missing)} names of the weight map are not in their files, e.g. {missing[:5]}")
    return {n: out[n] for n in wmap}, [os.path.join(folder, f) for f in files]


def _read_plain(src: str) -> tuple[dict, list[str]]:
    """One unsliced checkpoint: a file, an index, or a folder of them."""
    if os.path.isfile(src):
        if src.endswith(".json"):
            return _read_index(src)
        if not src.endswith(_WEIGHT_EXT):
            raise ValueError(f"{src}: not a MindSpore checkpoint (.ckpt, .safetensors or *.index.json)")
        return _read_file(src), [src]
    indexes = sorted(f for f in os.listdir(src) if f.endswith(".safetensors.index.json")
                     or f == "param_name_map.json")
    if len(indexes) > 1:
        raise ValueError(f"{src}: several weight maps {indexes}; pass one of them")
    if indexes:
        return _read_index(os.path.join(src, indexes[0]))
    files = _weight_files(src)
    ckpts = [f for f in files if f.endswith(".ckpt")]
    sts = [f for f in files if f.endswith(".safetensors")]
    if ckpts and sts:
        raise ValueError(f"{src}: holds both .ckpt and .safetensors files; pass one file")
    if ckpts:
        one = _latest(src, ckpts)
        return read_ckpt(one), [one]
    if not sts:
        raise ValueError(f"{src}: no MindSpore checkpoint (.ckpt, .safetensors, rank_*/ folders) in this folder")
    out: dict = {}
    for f in sts:  # a sharded safetensors checkpoint without an index: the union of its files
        for name, t in _read_safetensors(f).items():
            if name in out:
                raise ValueError(f"{src}: {name!r} is in more than one .safetensors file")
            out[name] = t
    return out, sts


def _rank_dirs(src: str) -> dict[int, str]:
    if not os.path.isdir(src):
        return {}
    found = {int(m.group(1)): os.path.join(src, d) for d in os.listdir(src)
             if (m := _RANK_DIR.match(d)) and os.path.isdir(os.path.join(src, d))}
    return dict(sorted(found.items()))


def _find_strategy(root: str) -> str | None:
    """MindFormers writes output/strategy/ next to output/checkpoint/; a run's `strategy_ckpt_save_file` (the real
    YAMLs write "./ckpt_strategy.ckpt", also under parallel.strategy_ckpt_config.save_file) lands next to the rank
    folders or one level up. Look inside the source, then next to it."""
    for cand in (os.path.join(root, "strategy"), os.path.join(os.path.dirname(root), "strategy")):
        if os.path.isdir(cand) and any(f.endswith((".ckpt", ".json")) for f in os.listdir(cand)):
            return cand
    for folder in (root, os.path.dirname(root)):
        found = sorted(f for f in os.listdir(folder) if _STRATEGY_FILE.match(f)
                       and os.path.isfile(os.path.join(folder, f)))
        if len(found) > 1:
            raise ValueError(f"{folder}: several strategy files ({', '.join(found)}) next to the rank folders; "
                             "pass the one of the run that saved them with --strategy (or a folder of them)")
        if found:
            return os.path.join(folder, found[0])
    return None


def _merge_ranks(root: str, ranks: dict[int, str], strategy, full_shapes: Mapping[str, Sequence[int]]) \
        -> MindSporeWeights:
    picked: dict[int, str] = {}
    for r, folder in ranks.items():
        files = _weight_files(folder)
        if not files:
            raise ValueError(f"{folder}: no checkpoint (.ckpt / .safetensors) in this rank folder")
        picked[r] = _latest(folder, files)
    steps = {_epoch_step(p) for p in picked.values()}
    if len(steps) > 1:
        raise ValueError(f"{root}: the rank folders' latest checkpoints are from different (epoch, step)s "
                         f"{sorted(s for s in steps if s)}: {sorted(os.path.basename(p) for p in picked.values())}")
    layouts: dict[str, Layout] = {}
    strat_files: list[str] = []
    strategy = strategy if strategy is not None else _find_strategy(root)
    if strategy is not None or len(ranks) > 1:
        if strategy is None:
            raise ValueError(f"{root}: sliced checkpoints (rank_* folders) but no parallel strategy file next to "
                             "them (strategy/ckpt_strategy_rank_*.ckpt or ckpt_strategy.ckpt); pass --strategy")
        layouts = read_strategies(strategy)
        strat_files = [strategy] if os.path.isfile(strategy) else sorted(
            os.path.join(strategy, f) for f in os.listdir(strategy) if f.endswith((".ckpt", ".json")))
    slices: dict[str, dict[int, torch.Tensor]] = {}
    out = MindSporeWeights({}, files=list(picked.values()) + strat_files)
    # one save writes every rank's file with or without a crc: a .ckpt without one among files with one lost it
    crc = any(has_crc(p) for p in picked.values() if p.endswith(".ckpt"))
    for r, path in picked.items():
        values = read_ckpt(path, require_crc=crc) if path.endswith(".ckpt") else _read_file(path)
        for name, value in values.items():
            if name in out.dropped:
                continue
            why = why_dropped(name, value)
            if why:
                out.dropped[name] = why
                continue
            slices.setdefault(name, {})[r] = value
    for name, by_rank in slices.items():
        layout = layouts.get(name)
        if layout is None:
            if len(ranks) > 1:
                out.uncovered.add(name)
            out.tensors[name] = by_rank[min(by_rank)]
        else:
            out.tensors[name] = merge(name, layout, by_rank, full_shape=full_shapes.get(name))
    return out


def read_mindspore_weights(src: str | os.PathLike, *, strategy: str | os.PathLike | None = None,
                           full_shapes: Mapping[str, Sequence[int]] | None = None) -> MindSporeWeights:
    """Full model weights from a MindSpore / MindFormers checkpoint (see the module docstring for `src`).

    strategy: a strategy file or folder for rank_* folders; by default strategy/ inside `src` or next to it.
    full_shapes: the model's full shape per name, when known: it tells a rank file saved with integrated_save=True
    (the model-parallel slice) from one holding its optimizer shard; without it, MindSpore's rule (sharded)."""
    src = os.path.abspath(os.fspath(src))
    strategy = os.fspath(strategy) if strategy is not None else None
    if not os.path.exists(src):
        raise FileNotFoundError(f"no MindSpore checkpoint at {src}")
    root = src
    ranks = _rank_dirs(src)
    if not ranks and os.path.isdir(os.path.join(src, "checkpoint")):  # given MindFormers' output/ folder
        root = os.path.join(src, "checkpoint")
        ranks = _rank_dirs(root)
    if ranks:
        if strategy is None and root != src:
            strategy = _find_strategy(src)
        return _merge_ranks(root, ranks, strategy, full_shapes or {})
    values, files = _read_plain(src)
    out = MindSporeWeights({}, files=files)
    for name, value in values.items():
        why = why_dropped(name, value)
        if why:
            out.dropped[name] = why
        else:
            out.tensors[name] = value
    return out
