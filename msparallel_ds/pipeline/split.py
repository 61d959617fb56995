"""Cut a HF decoder into pipeline stage modules by MindFormers' layer rule (the family adapter cuts the modules).

Layer counts come from Plan.layers_per_stage ([vpp][pp] = num_layers // (pp*vpp) + offset, validated by
config.rules with errors naming `model.model_config.offset`). Global stage s (0 .. pp*vpp-1) runs consecutive layers:
interleaved / looped schedules put chunk c of pp rank r at s = c*pp + r (Megatron, torch's Interleaved1F1B);
zero_bubble_v puts chunk 0 at s = r and chunk 1 at s = 2pp-1-r (the V). offset[c][r] always means chunk c of pp rank
r, wherever that chunk sits in the order.

A stage (models.stage.StageModule) keeps the HF module objects under the HF names, so state-dict keys map 1:1 to
the HF checkpoint and the TP plan and shard spec apply to it as to the whole model. Stages are cut first and then
parallelized one by one (strategy.parallelize_part), the same function a whole model goes through.
"""
from __future__ import annotations

from typing import Callable, Optional

from torch import nn

__all__ = ["layer_ranges", "stage_chunks", "split_model"]


def stage_chunks(pp: int, vpp: int, rank: int, schedule: str | None) -> list[int]:
    """Global stage indices held by pp rank `rank`, in chunk order (chunk c -> list[c])."""
    if schedule == "zero_bubble_v":
        return [rank, 2 * pp - 1 - rank]
    return [rank + c * pp for c in range(vpp)]


def layer_ranges(counts: list[list[int]], schedule: str | None) -> list[range]:
    """[vpp][pp] layer counts -> the layer range of every global stage, in stage order."""
    vpp, pp = len(counts), len(counts[0])
    owner = {}  # global stage -> (chunk, rank)
    for r in range(pp):
        for c, s in enumerate(stage_chunks(pp, vpp, r, schedule)):
            owner[s] = (c, r)
    ranges, start = [], 0
    for s in range(pp * vpp):
        c, r = owner[s]
        ranges.append(range(start, start + counts[c][r]))
        start += counts[c][r]
    return ranges


def split_model(model: nn.Module, counts: list[list[int]], pp_rank: int, schedule: str | None,
                prepare: Optional[Callable[[nn.Module, int], None]] = None, mtp: int = 0
                ) -> tuple[list[nn.Module], nn.Module, list[int]]:
    """This pp rank's stages of `model`, a view holding all its modules under HF names (for state dicts and the
    optimizer), and the global stage indices. `prepare(stage, chunk)` runs on each stage before the view is built
    (the engine parallelizes them there). `model` itself (and the other ranks' layers) is no longer referenced.
    `mtp`: the model's MTP layers (after its decoder layers) go to the last stage with a copy of the embedding;
    a tied head or MTP embedding is joined across stages afterwards (pipeline.shared)."""
    from ..models import adapter_for

    adapter = adapter_for(model)
    vpp, pp = len(counts), len(counts[0])
    n_layers = adapter.layer_count(model) - mtp
    if sum(map(sum, counts)) != n_layers:
        raise ValueError(f"model.model_config.num_layers: the YAML's layer split {counts} covers "
                         f"{sum(map(sum, counts))} layers but the model has {n_layers}; set num_layers: {n_layers} "
                         "(and offsets summing to its remainder)")
    ranges = layer_ranges(counts, schedule)
    ids = stage_chunks(pp, vpp, pp_rank, schedule)
    last = pp * vpp - 1
    extra = {"mtp": mtp} if mtp else {}
    stages = [adapter.make_stage(model, ranges[s], first=s == 0, last=s == last, **extra) for s in ids]
    for chunk, stage in enumerate(stages):
        if prepare is not None:
            prepare(stage, chunk)
    return stages, adapter.merge_stages(stages), ids
