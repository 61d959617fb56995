"""Which rank writes which chunk of a sharded save (checkpoint.sharded); pure, so `msparallel-ds plan` reports a
save with the same rule (checkpoint.save_plan)."""
from __future__ import annotations

from typing import Optional

__all__ = ["writes"]


def writes(layout, shard, index: int, owner: Optional[int] = None) -> bool:
    """Whether this rank writes parameter #index's chunk: one replica per chunk (`owner`: the dp x cp rank that
    must, e.g. ZeRO-1's optimizer-state owner)."""
    if shard.is_split and layout.size(shard.group) > 1:
        group = "edp" if shard.group == "ep" else "dp_cp"
        return layout.rank(group) == (index % layout.size(group) if owner is None else owner)
    dp, tp = layout.size("dp_cp"), layout.size("tp")
    slot = index % (dp * tp)
    return layout.rank("dp_cp") == (slot // tp if owner is None else owner) and layout.rank("tp") == slot % tp
