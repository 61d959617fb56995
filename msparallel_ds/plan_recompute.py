"""The plan's recompute entry: MindFormers' recompute_config (bool, per-stage counts, select patterns) or MindFormers
2.1's `recompute:` layer ids (config.parallelism) -> counts of each pipeline chunk's leading layers."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from .config.errors import ConfigError, ConfigIssue
from .config.schema import ParallelConfig

DEFAULT_SELECT = [r"feed_forward\.mul", r"feed_forward\.w1\.activation\.silu"]  # MindFormers' defaults
DEFAULT_SELECT_COMM = [r".*\.norm"]


@dataclass(frozen=True)
class RecomputePlan:
    """Full-layer recompute counts per [virtual chunk][stage] (first N layers of each), plus submodule patterns."""

    mode: str  # none | full | layers | select
    layers: Optional[list[list[int]]] = None
    select: dict[str, Any] = field(default_factory=dict)  # pattern -> "all" | per-stage counts
    select_comm: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {"mode": self.mode, "layers": self.layers, "select": self.select, "select_comm": self.select_comm}



def _per_stage(value: Any, pp: int, vpp: int, layers: Optional[list[list[int]]]) -> Any:
    """MindFormers' recompute value -> "all", None, or [vpp][pp] counts of the first layers in each chunk."""
    if value is True:
        return "all"
    if value is False or value == []:
        return None
    if isinstance(value, list) and value and all(isinstance(v, list) for v in value):
        return [list(row) + [0] * (pp - len(row)) for row in value]
    if isinstance(value, list) and all(isinstance(v, int) for v in value):
        counts = list(value) + [0] * (pp - len(value))
        if layers is None:
            return [counts] if vpp == 1 else counts
        grid = [[0] * pp for _ in range(vpp)]
        for j, n in enumerate(counts):
            for i, got in enumerate(_round_robin(n, [layers[i][j] for i in range(vpp)])):
                grid[i][j] = got
        return grid
    return "all"


def _round_robin(n: int, caps: list[int]) -> list[int]:
    """LayerSetting hands a stage's n recomputed layers to its virtual chunks one at a time, round-robin,
    skipping full chunks. Closed form: every chunk gets min(cap, k) for the largest k that fits, and the
    remaining layers go one each to the first chunks that still have room."""
    n = min(n, sum(caps))
    lo, hi = 0, max(caps, default=0)
    while lo < hi:  # largest k with sum(min(c, k)) <= n
        mid = (lo + hi + 1) // 2
        if sum(min(c, mid) for c in caps) <= n:
            lo = mid
        else:
            hi = mid - 1
    got = [min(c, lo) for c in caps]
    rest = n - sum(got)
    for i, c in enumerate(caps):
        if rest and c > lo:
            got[i] += 1
            rest -= 1
    return got


def recompute_plan(cfg: ParallelConfig, pp: int, vpp: int, layers) -> RecomputePlan:
    rc = cfg.recompute_config
    if rc.by_layer_id:
        rc = by_layer_id(cfg, pp, vpp, layers)
    full = _per_stage(rc.recompute, pp, vpp, layers) if not isinstance(rc.recompute, dict) else None

    def patterns(value: Any, defaults: list[str]) -> dict[str, Any]:
        if value is False or value is None or value == []:
            return {}
        if isinstance(value, dict):
            return {p: _per_stage(v, pp, vpp, layers) for p, v in value.items() if _per_stage(v, pp, vpp, layers)}
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            return {p: "all" for p in value}
        return {p: _per_stage(value, pp, vpp, layers) for p in defaults}

    select = patterns(rc.select_recompute, DEFAULT_SELECT)
    select_comm = patterns(rc.select_comm_recompute, DEFAULT_SELECT_COMM)
    if full == "all":
        mode = "full"
    elif full:
        mode = "layers"
    elif select or select_comm:
        mode = "select"
    else:
        mode, full = "none", None
    return RecomputePlan(mode=mode, layers=None if full in (None, "all") else full, select=select,
                         select_comm=select_comm)


def _ids_to_counts(ids: list[int], key: str, pp: int, vpp: int, layers) -> Any:
    """Layer ids -> True (every layer) or [vpp][pp] leading-layer counts; chunk c of stage s holds the layers after
    those of every earlier (c, s) in MindFormers' order (virtual stage c * pp + s)."""
    if layers is None:
        n = max(ids) + 1
        if pp * vpp == 1 and ids == list(range(n)):
            return [n]
        raise ConfigError([ConfigIssue(key, _ranges(ids), "needs the model's num_hidden_layers to place the layers on "
                                       "pipeline stages", "set model num_hidden_layers in the YAML")])
    chosen, start, counts, total = set(ids), 0, [[0] * pp for _ in range(vpp)], 0
    for c in range(vpp):
        for s in range(pp):
            n = layers[c][s]
            picked = [i for i in range(start, start + n) if i in chosen]
            if picked != list(range(start, start + len(picked))):
                raise ConfigError([ConfigIssue(key, _ranges(ids), f"recomputes layers {_ranges(picked)} of the stage "
                                               f"holding layers {start}-{start + n - 1}, not its leading layers (the "
                                               "recompute here checkpoints each stage's first N layers)",
                                               f"list leading layers, e.g. '{start}-{start + len(picked) - 1}'")])
            counts[c][s], start, total = len(picked), start + n, total + n
    return True if all(counts[c][s] == layers[c][s] for c in range(vpp) for s in range(pp)) else counts


def _ranges(ids: list[int]) -> str:
    return f"{min(ids)}-{max(ids)}" if ids else "none"


def by_layer_id(cfg: ParallelConfig, pp: int, vpp: int, layers):
    """recompute_config written from `recompute:` (layer ids; MTP ids past the decoder layers are the MTP layers,
    recomputed with their decoder layers here) -> the per-stage form the rest of the plan reads."""
    rc = cfg.recompute_config
    n = cfg.model.num_layers
    keep = (lambda ids: [i for i in ids if i < n]) if n else (lambda ids: ids)
    update: dict[str, Any] = {"by_layer_id": False}
    if isinstance(rc.recompute, list) and rc.recompute:
        update["recompute"] = _ids_to_counts(keep(rc.recompute), "recompute.full_recompute_layer", pp, vpp, layers)
    if isinstance(rc.select_recompute, dict):
        update["select_recompute"] = {p: _ids_to_counts(keep(v), f"recompute.select_module.{p}", pp, vpp, layers)
                                      for p, v in rc.select_recompute.items() if keep(v)}
    return rc.model_copy(update=update)
