"""MindSpore parallel strategy files, and cutting / merging parameter slices the way MindSpore lays them out.

A strategy file (set_auto_parallel_context(strategy_ckpt_config={"save_file": ...}); MindFormers writes
output/strategy/ckpt_strategy_rank_{r}.ckpt, one per pipeline stage that matters) is a serialized
ParallelStrategyMap (proto.py), or JSON when its name ends in ".json". Each parameter has a ParallelLayouts:

- dev_matrix: the device matrix of the parameter's pipeline stage; a rank's coordinate in it is row-major with
  the last axis fastest, of rank % prod(dev_matrix) (stages are consecutive blocks of equal size);
- tensor_map: per tensor dim the device-matrix axis that splits it, counted from the right (axis a is
  dev_matrix[-1 - a]), -1 = not split. With several TensorMap entries (the mindspore.parallel.Layout form) each
  entry is one tensor dim and may list several axes: the dim is cut into prod(sizes) chunks, the first listed
  axis the most significant (mindspore/parallel/_tensor.py, _get_tensor_strategy, _expand_layout);
- opt_weight_shard_size / _step: the parallel-optimizer shard. The ranks holding one model-parallel slice are
  the slice's repeat group (ascending); consecutive runs of opt_weight_shard_size of them form one optimizer
  group, and a rank's position in its run picks its contiguous chunk of the slice's dim 0. -1 means the whole
  repeat group; size or step 0 means no optimizer shard. A checkpoint saved with integrated_save=False holds
  these optimizer shards (MindSpore's transform_checkpoints assumes so whenever the size is > 0);
- field, param_split_shape, indices_offset: embedding fields and uneven splits, which are refused here.

Merged multi-stage files (mindspore.parallel.merge_pipeline_strategys) name parameters "<stage>-<name>".
"""
from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from typing import Sequence

import torch

from .proto import ParallelStrategyMap

_STAGE_PREFIX = re.compile(r"^(\d+)-(.+)$")


@dataclass(frozen=True)
class Layout:
    """One parameter's layout; tensor_map holds per tensor dim the splitting axes (empty = not split)."""
    dev_matrix: tuple[int, ...]
    tensor_map: tuple[tuple[int, ...], ...]
    opt_shard_step: int = 0
    opt_shard_size: int = 0  # resolved: -1 became the repeat-group size; 0 or 1 = no optimizer shard
    field: int = 0
    param_split_shape: tuple[int, ...] = ()
    indices_offset: tuple[int, ...] = ()

    @property
    def device_num(self) -> int:
        return math.prod(self.dev_matrix)

    def axis_size(self, axis: int) -> int:
        if not 0 <= axis < len(self.dev_matrix):
            raise ValueError(f"tensor_map axis {axis} is outside dev_matrix {list(self.dev_matrix)}")
        return self.dev_matrix[len(self.dev_matrix) - 1 - axis]

    @property
    def splits(self) -> tuple[int, ...]:
        """How many model-parallel chunks each tensor dim is cut into."""
        return tuple(math.prod(self.axis_size(a) for a in axes) for axes in self.tensor_map)

    @property
    def opt_size(self) -> int:
        return self.opt_shard_size if self.opt_shard_step != 0 and self.opt_shard_size > 1 else 1


def make_layout(dev_matrix: Sequence[int], tensor_map: Sequence, opt_shard_step: int = 0, opt_shard_size: int = 0,
                field: int = 0, param_split_shape: Sequence[int] = (), indices_offset: Sequence[int] = ()) -> Layout:
    """A Layout from MindSpore's raw values: tensor_map entries are axis ids, -1, or lists of them."""
    dev = _ints(dev_matrix, "dev_matrix")
    if not 0 < len(dev) <= _MAX_AXES or any(d < 1 for d in dev):
        raise ValueError(f"dev_matrix {list(dev)} must list 1 to {_MAX_AXES} device counts, each >= 1")
    tmap = tuple(tuple(a for a in _ints(m if isinstance(m, (list, tuple)) else [m], "tensor_map") if a != -1)
                 for m in _seq(tensor_map, "tensor_map"))
    axes = [a for m in tmap for a in m]
    if any(not 0 <= a < len(dev) for a in axes) or len(set(axes)) != len(axes):
        raise ValueError(f"tensor_map {list(tensor_map)} must name each axis of dev_matrix {list(dev)} at most once "
                         f"(axes 0..{len(dev) - 1}, -1 = not split)")
    step, size, fld = _ints([opt_shard_step, opt_shard_size, field], "opt_weight_shard_step/size, field")
    if size < -1:
        raise ValueError(f"opt_weight_shard_size {size} must be -1 (the whole repeat group), 0 (none) or a size")
    lay = Layout(dev, tmap, step, 0, fld, _ints(param_split_shape, "param_split_shape"),
                 _ints(indices_offset, "indices_offset"))
    if size == -1:  # the whole repeat group (mindspore.parallel._tensor._extract_layout_item)
        size = lay.device_num // math.prod(lay.splits)
    return Layout(lay.dev_matrix, lay.tensor_map, lay.opt_shard_step, size, lay.field, lay.param_split_shape,
                  lay.indices_offset)


_MAX_AXES = 32


def _seq(v, what: str) -> Sequence:
    if not isinstance(v, (list, tuple)):
        raise ValueError(f"{what} must be a list, got {v!r}")
    return v


def _ints(v, what: str) -> tuple[int, ...]:
    v = _seq(v, what)
    if not all(isinstance(x, int) and not isinstance(x, bool) for x in v):
        raise ValueError(f"{what} must hold integers, got {list(v)!r}")
    return tuple(v)


def _from_proto(layouts) -> Layout:
    if len(layouts.tensor_map) > 1:  # Layout form: one TensorMap per tensor dim (empty ones skipped, as MindSpore)
        tmap = [list(m.dim) for m in layouts.tensor_map if list(m.dim)]
    else:
        tmap = list(layouts.tensor_map[0].dim) if layouts.tensor_map else []
    first = (lambda rep: list(rep[0].dim) if rep else [])
    return make_layout(first(layouts.dev_matrix), tmap, layouts.opt_weight_shard_step, layouts.opt_weight_shard_size,
                       layouts.field, first(layouts.param_split_shape), first(layouts.indices_offset))


def _add(out: dict[str, Layout], raw_name: str, layout: Layout, path: str) -> None:
    m = _STAGE_PREFIX.match(raw_name)
    name = m.group(2) if m else raw_name
    if name in out and out[name] != layout:
        raise ValueError(f"{path}: parameter {name!r} has two different layouts: {out[name]} and {layout}")
    out[name] = layout


def read_strategy(path: str | os.PathLike) -> dict[str, Layout]:
    """Parameter name -> Layout of one strategy file (protobuf, or JSON when named *.json)."""
    path = os.fspath(path)
    out: dict[str, Layout] = {}
    if path.endswith(".json"):
        with open(path, encoding="utf-8") as f:
            try:
                data = json.load(f)
            except ValueError as e:
                raise ValueError(f"{path}: not a MindSpore parallel strategy file (JSON: {e})") from None
        items = data.get("parallel_layout_item") if isinstance(data, dict) else None
        if not isinstance(items, dict) or not items:
            raise ValueError(f"{path}: not a MindSpore parallel strategy file (expected an object with "
                             "'parallel_layout_item': {parameter: {dev_matrix, tensor_map, ...}})")
        for name, it in items.items():
            try:
                if not isinstance(it, dict) or "dev_matrix" not in it or "tensor_map" not in it:
                    raise ValueError("needs 'dev_matrix' and 'tensor_map'")
                layout = make_layout(it["dev_matrix"], it["tensor_map"], it.get("opt_weight_shard_step", 0),
                                     it.get("opt_weight_shard_size", 0), it.get("field", 0),
                                     it.get("param_split_shape", ()), it.get("indices_offset", ()))
            except ValueError as e:
                raise ValueError(f"{path}: parameter {name!r}: {e}") from None
            _add(out, name, layout, path)
        return out
    with open(path, "rb") as f:
        data = f.read()
    msg = ParallelStrategyMap()
    try:
        msg.ParseFromString(data)
    except Exception as e:
        raise ValueError(f"{path}: not a MindSpore parallel strategy file ({type(e).__name__}: {e})") from None
    if not data or (not msg.parallel_layout_item and not msg.parallel_strategy_item):
        raise ValueError(f"{path}: not a MindSpore parallel strategy file (no layouts in it)")
    for item in msg.parallel_layout_item:
        try:
            layout = _from_proto(item.parallel_layouts)
        except ValueError as e:
            raise ValueError(f"{path}: parameter {item.param_name!r}: {e}") from None
        _add(out, item.param_name, layout, path)
    return out


def strategy_files(path: str | os.PathLike) -> list[str]:
    """The strategy file itself, or the *.ckpt / *.json files of a folder (sorted)."""
    path = os.fspath(path)
    if os.path.isfile(path):
        return [path]
    if not os.path.isdir(path):
        raise FileNotFoundError(f"no strategy file or folder at {path}")
    files = sorted(os.path.join(path, f) for f in os.listdir(path)
                   if f.endswith((".ckpt", ".json")) and os.path.isfile(os.path.join(path, f)))
    if not files:
        raise ValueError(f"{path}: no MindSpore strategy files (*.ckpt, *.json) in this folder")
    return files


def read_strategies(path: str | os.PathLike) -> dict[str, Layout]:
    """Union of the layouts in a strategy file or a folder of them (one per pipeline stage, say)."""
    out: dict[str, Layout] = {}
    where: dict[str, str] = {}
    for file in strategy_files(path):
        for name, layout in read_strategy(file).items():
            if name in out and out[name] != layout:
                raise ValueError(f"parameter {name!r} has different layouts in {where[name]} ({out[name]}) "
                                 f"and {file} ({layout})")
            out.setdefault(name, layout)
            where.setdefault(name, file)
    return out


def _raw_tensor_map(layout: Layout) -> list:
    if all(len(axes) <= 1 for axes in layout.tensor_map):
        return [axes[0] if axes else -1 for axes in layout.tensor_map]
    return [list(axes) or [-1] for axes in layout.tensor_map]


def write_strategy(path: str | os.PathLike, layouts: dict[str, Layout], *, stage: int = 0) -> None:
    """Write a strategy file MindSpore reads (protobuf, or JSON when named *.json); for tests and tools."""
    path = os.fspath(path)
    if path.endswith(".json"):
        items = {n: {"dev_matrix": list(lay.dev_matrix), "tensor_map": _raw_tensor_map(lay), "field": lay.field,
                     "opt_weight_shard_step": lay.opt_shard_step, "opt_weight_shard_size": lay.opt_shard_size,
                     "param_split_shape": list(lay.param_split_shape), "indices_offset": list(lay.indices_offset)}
                 for n, lay in layouts.items()}
        data = json.dumps({"current_stage": stage, "parallel_strategy_item": {"Default": {"stage": stage}},
                           "parallel_layout_item": items}).encode()
    else:
        msg = ParallelStrategyMap(current_stage=stage)
        # MindSpore's merge_pipeline_strategys reads the stage from the first strategy item
        msg.parallel_strategy_item.add(node_name="Default").parallel_strategys.stage = stage
        for name, lay in layouts.items():
            pl = msg.parallel_layout_item.add(param_name=name).parallel_layouts
            pl.dev_matrix.add().dim.extend(lay.dev_matrix)
            tmap = _raw_tensor_map(lay)
            for dims in ([tmap] if not tmap or not isinstance(tmap[0], list) else tmap):
                pl.tensor_map.add().dim.extend(dims)
            pl.param_split_shape.add().dim.extend(lay.param_split_shape)  # MindSpore reads entry [0]
            pl.indices_offset.add().dim.extend(lay.indices_offset)
            pl.field, pl.opt_weight_shard_step, pl.opt_weight_shard_size = lay.field, lay.opt_shard_step, \
                lay.opt_shard_size
        data = msg.SerializeToString()
    with open(path, "wb") as f:
        f.write(data)


def _check(name: str, layout: Layout, ndim: int) -> None:
    if layout.field != 0 or layout.param_split_shape or layout.indices_offset:
        raise ValueError(f"parameter {name!r}: uneven or field splits (field={layout.field}, param_split_shape="
                         f"{list(layout.param_split_shape)}, indices_offset={list(layout.indices_offset)}) "
                         "are not supported")
    if layout.tensor_map and len(layout.tensor_map) != ndim:
        raise ValueError(f"parameter {name!r}: tensor_map has {len(layout.tensor_map)} dims, the tensor {ndim}")
    if layout.opt_size > 1 and not layout.tensor_map and ndim == 0:
        raise ValueError(f"parameter {name!r}: a 0-d tensor cannot have an optimizer shard")


def _coords(layout: Layout, local: int) -> list[int]:
    coord, rest = [0] * len(layout.dev_matrix), local
    for i in range(len(layout.dev_matrix) - 1, -1, -1):  # row-major, last axis fastest
        coord[i], rest = rest % layout.dev_matrix[i], rest // layout.dev_matrix[i]
    return coord


def _free(layout: Layout) -> list[int]:
    """dev_matrix indices no tensor dim is split over: the repeat group varies along them."""
    used = {len(layout.dev_matrix) - 1 - a for axes in layout.tensor_map for a in axes}
    return [i for i in range(len(layout.dev_matrix)) if i not in used]


def _mp_index(layout: Layout, local: int) -> tuple[int, ...]:
    """The model-parallel chunk index per tensor dim held by stage-local rank `local`."""
    coord = _coords(layout, local)
    out = []
    for axes in layout.tensor_map:
        idx = 0
        for a in axes:  # first listed axis most significant
            idx = idx * layout.axis_size(a) + coord[len(layout.dev_matrix) - 1 - a]
        out.append(idx)
    return tuple(out)


def _position(layout: Layout, local: int) -> int:
    """`local`'s place in its ascending repeat group (the ranks with its chunk), by arithmetic: the group is the
    free axes' coordinates in row-major order, so no loop over the (file-given, maybe absurd) device count."""
    coord, pos = _coords(layout, local), 0
    for i in _free(layout):
        pos = pos * layout.dev_matrix[i] + coord[i]
    return pos


def _check_opt(name: str, layout: Layout) -> None:
    group = math.prod(layout.dev_matrix[i] for i in _free(layout))
    if layout.opt_size > 1 and group % layout.opt_size:
        raise ValueError(f"parameter {name!r}: optimizer shard size {layout.opt_size} does not divide the "
                         f"{group} ranks that hold each slice")


def _holders(layout: Layout, idx: tuple[int, ...], j: int, size: int, limit: int = 8) -> list[int]:
    """The first `limit` stage-local ranks holding chunk `idx`, optimizer shard j of `size` (for messages)."""
    m, coord = len(layout.dev_matrix), [0] * len(layout.dev_matrix)
    for v, axes in zip(idx, layout.tensor_map):
        for a in reversed(axes):
            coord[m - 1 - a], v = v % layout.axis_size(a), v // layout.axis_size(a)
    free = _free(layout)
    out = []
    for p in range(j, math.prod(layout.dev_matrix[i] for i in free), size):
        for i in reversed(free):
            coord[i], p = p % layout.dev_matrix[i], p // layout.dev_matrix[i]
        out.append(sum(c * math.prod(layout.dev_matrix[i + 1:]) for i, c in enumerate(coord)))
        if len(out) == limit:
            break
    return out


def _cut(name: str, t: torch.Tensor, dim: int, parts: int, idx: int) -> torch.Tensor:
    if t.shape[dim] % parts:
        raise ValueError(f"parameter {name!r}: dim {dim} of size {t.shape[dim]} does not split into {parts}")
    size = t.shape[dim] // parts
    return t.narrow(dim, idx * size, size)


def slice_of(full: torch.Tensor, layout: Layout, rank: int, *, opt_sharded: bool = True,
             name: str = "tensor") -> torch.Tensor:
    """What global `rank` holds of `full`: its model-parallel slice, then its optimizer shard of dim 0 (the
    checkpoint of an integrated_save=False run) unless opt_sharded=False."""
    _check(name, layout, full.dim())
    local = rank % layout.device_num
    out = full
    for dim, (idx, parts) in enumerate(zip(_mp_index(layout, local), layout.splits)):
        out = _cut(name, out, dim, parts, idx)
    if opt_sharded and layout.opt_size > 1:
        _check_opt(name, layout)
        out = _cut(name, out, 0, layout.opt_size, _position(layout, local) % layout.opt_size)
    return out.clone()


def merge(name: str, layout: Layout, slices: dict[int, torch.Tensor], *, opt_sharded: bool | None = None,
          full_shape: Sequence[int] | None = None) -> torch.Tensor:
    """The full tensor from global rank -> slice (any subset that covers every chunk; replicas: the lowest rank's).

    opt_sharded=None: with full_shape, decided from the slice shapes; without, MindSpore's rule (sharded when the
    layout has an optimizer shard). A missing chunk raises ValueError naming the parameter and the ranks."""
    if not slices:
        raise ValueError(f"parameter {name!r}: no slices to merge")
    ranks = sorted(slices)
    first = slices[ranks[0]]
    _check(name, layout, first.dim())
    for r in ranks:
        if slices[r].shape != first.shape or slices[r].dtype != first.dtype:
            raise ValueError(f"parameter {name!r}: rank {r} holds {tuple(slices[r].shape)} {slices[r].dtype}, "
                             f"rank {ranks[0]} {tuple(first.shape)} {first.dtype}")
    n, size, splits = layout.device_num, layout.opt_size, layout.splits
    if opt_sharded is None:
        opt_sharded = size > 1
        if full_shape is not None and size > 1 and first.dim() > 0:
            mp0 = full_shape[0] // (splits[0] if splits else 1)
            opt_sharded = first.shape[0] * size == mp0 and first.shape[0] != mp0
    size = size if opt_sharded else 1
    by_local: dict[int, torch.Tensor] = {}
    for r in ranks:
        by_local.setdefault(r % n, slices[r])
    if not layout.tensor_map and size == 1:
        out = first
    else:
        _check_opt(name, layout)
        chunks: dict[tuple, torch.Tensor] = {}  # (model-parallel index, optimizer shard) -> the lowest rank's slice
        for local, t in sorted(by_local.items()):
            chunks.setdefault((_mp_index(layout, local), _position(layout, local) % size), t)
        need = math.prod(splits) * size  # bounded by the slices at hand before any loop over it or allocation
        if len(chunks) < need:
            missing = []
            for flat in range(need):  # lazily (itertools.product would materialize each range)
                key = []
                for radix in (*splits, size)[::-1]:
                    flat, digit = divmod(flat, radix)
                    key.append(digit)
                idx, j = tuple(key[:0:-1]), key[0]
                if (idx, j) not in chunks:
                    missing.append(_holders(layout, idx, j, size))
                    if len(missing) > 8:
                        break
            raise ValueError(f"parameter {name!r}: {need - len(chunks)} slice(s) missing, each needs the checkpoint "
                             f"of one of the ranks in {missing[:8]}{' ...' if need - len(chunks) > 8 else ''} "
                             f"(stage-local ranks; add k*{n} for pipeline stage k)")
        piece = list(first.shape)
        if size > 1:
            piece[0] *= size
        shape = [p * s for p, s in zip(piece, splits)] if layout.tensor_map else piece
        out = torch.empty(shape, dtype=first.dtype)
        for idx, j in chunks:
            if j:
                continue  # shard 0 places the whole chunk
            dst = out
            for dim, (i, parts) in enumerate(zip(idx, splits)):
                dst = dst.narrow(dim, i * (shape[dim] // parts), shape[dim] // parts)
            got = [chunks[(idx, k)] for k in range(size)]
            dst.copy_(torch.cat(got, 0) if size > 1 else got[0])
    if full_shape is not None and tuple(out.shape) != tuple(full_shape):
        raise ValueError(f"parameter {name!r}: merged shape {tuple(out.shape)}, expected {tuple(full_shape)}")
    return out
