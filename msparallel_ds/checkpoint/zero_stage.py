"""Staging a DeepSpeed ZeRO-1/2 optimizer for a sharded save without a collective on the training groups.

engine.save must return after a cheap local step (async_save: training goes on while the files are written), but
the sharded format stores each parameter's whole tp-local fp32 weight and Adam moments, which ZeRO 1/2 keep as flat
partitions spread over the data-parallel group. So the save splits DeepSpeed's safe_get_full_fp32_param /
safe_get_full_optimizer_state in two:

- `snapshot` (the caller's thread, local): a CPU copy of this rank's fragment of every trainable parameter (the
  `_hp_mapping` view into the flat fp32 partition and the same range of each moment), with its flat offset in the
  parameter, and the ranks of the group DeepSpeed partitions it over (`p._dp_group`: dp x cp, or the expert
  data-parallel group). Its size is this rank's ZeRO share of the state.
- `Rebuild.__call__` (the writer thread): per parameter, in the same order on every rank, each member of that
  group puts its fragment into a zero buffer and the buffer is summed onto the replica that writes the chunk
  (`dist.reduce`), on a gloo CLONE of the group made once per layout, never the training group, so it cannot
  interleave with training's collectives. The fragments are disjoint, so the sum is exact (DeepSpeed's own
  all-reduce computes the same sum). Each fragment is freed once reduced.
"""
from __future__ import annotations

from typing import Iterator

import torch
import torch.distributed as dist

__all__ = ["Rebuild", "snapshot"]


def _clones(layout, sets: set, group) -> dict:
    """{global ranks: gloo group} for every rank set any rank partitions over; new ones made by every rank of the
    checkpoint group in the same (sorted) order, kept on the layout (a later engine on it reuses them)."""
    cache = layout.__dict__.setdefault("_msp_ckpt_dp_clones", {})
    every: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, sorted(sets), group=group)
    for ranks in sorted({tuple(r) for part in every for r in part}):
        if ranks not in cache:
            cache[ranks] = dist.new_group(list(ranks), backend="gloo")
    return cache


class Rebuild:
    """The trainable ZeRO-1/2 parameters' records, rebuilt in the writer thread from a snapshot (module doc).
    `staged`: the snapshot's tensors by name (the save's non-finite check reads them before returning);
    `groups`: the shard groups of the chunks it yields (their DCP meshes are made before the thread starts)."""

    def __init__(self, items: list, clones: dict, group):
        self.items, self.clones, self.group = items, clones, group
        self.staged = {f"{it['name']}/{k}": t for it in items if it["frag"] is not None
                       for k, t in it["frag"][2].items()}
        self.groups = {it["shard"].group for it in items if it["mine"] and it["shard"].is_split}

    def __call__(self) -> Iterator:
        me = dist.get_rank()
        mine: list = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(mine, (me, [it["index"] for it in self.items if it["mine"]]), group=self.group)
        writers = {}
        for rank, indices in mine:
            for i in indices:
                writers.setdefault(i, set()).add(rank)
        self.staged = {}
        for it in self.items:
            frag, it["frag"] = it["frag"], None
            dst = sorted(writers.get(it["index"], set()) & set(it["ranks"]))
            if not dst:  # no replica in this data-parallel group writes the chunk (a tp-replicated tensor)
                continue
            numel = torch.Size(it["shape"]).numel()
            rec = {}
            for k in it["keys"]:
                buf = torch.zeros(numel, dtype=torch.float32)
                if frag is not None:
                    start, n, parts = frag
                    buf[start:start + n] = parts[k]
                if len(it["ranks"]) > 1:
                    dist.reduce(buf, dst=dst[0], group=self.clones[it["ranks"]])
                if it["mine"]:
                    rec[k] = buf.view(it["shape"])
            if it["mine"]:
                yield it["name"], it["shard"], rec


def snapshot(engine, params, keys, group) -> Rebuild:
    """`params`: (index, name, parameter, shard, this rank writes it) of the trainable ZeRO-1/2 parameters, in
    named_parameters order. Local copies only, plus (first save per layout) the gloo clones of their groups."""
    items, sets = [], set()
    for index, name, p, shard, mine in params:
        m = getattr(p, "_hp_mapping", None)
        ranks = tuple(sorted(dist.get_process_group_ranks(p._dp_group)))
        sets.add(ranks)
        frag = None
        if m is not None:
            parts = {"fp32": m.hp_fragment}
            parts.update({k: m.get_optim_state_fragment(k) for k in keys})
            frag = (m.lp_fragment_address.start, m.lp_fragment_address.numel,
                    {k: v.detach().to("cpu", torch.float32, copy=True).reshape(-1) for k, v in parts.items()})
        items.append({"index": index, "name": name, "shard": shard, "mine": mine, "ranks": ranks, "frag": frag,
                      "shape": tuple(p.shape), "keys": ("fp32",) + tuple(keys)})
    ds_opt = engine.ds.optimizer  # its parameters' groups are fixed for its life: the clones are made once
    if getattr(ds_opt, "_msp_ckpt_clones", None) is None:
        ds_opt._msp_ckpt_clones = _clones(engine.layout, sets, group)
    return Rebuild(items, ds_opt._msp_ckpt_clones, group)
