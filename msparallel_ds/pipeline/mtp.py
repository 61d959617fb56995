"""Multi-token prediction on a pipeline (models.mtp, models.stage): the MTP layers run on the last stage.

The split: mcore (use_legacy: false) excludes the MTP layers from num_layers' split over the stages; legacy
MindFormers counts them in the last stage's share (config.schema.pipeline_layers), so they come off its count.
"""
from __future__ import annotations

from ..distributed.layout import ParallelLayout
from .split import stage_chunks

__all__ = ["install_mtp", "without_mtp"]


def without_mtp(counts: list, pp: int, vpp: int, schedule, depth: int) -> list:
    """The decoder layers per stage when the legacy split (num_layers + mtp_depth, config.schema.pipeline_layers)
    counts the MTP layers in the last stage's share."""
    out = [list(row) for row in counts]
    rank = next(r for r in range(pp) if pp * vpp - 1 in stage_chunks(pp, vpp, r, schedule))
    chunk = stage_chunks(pp, vpp, rank, schedule).index(pp * vpp - 1)
    if out[chunk][rank] < depth:
        raise ValueError(f"model.model_config.offset: the last pipeline stage's share ({out[chunk][rank]} layers) "
                         f"must include the mtp_depth={depth} MTP layers (legacy MindFormers counts them there); "
                         "give the last stage a larger offset")
    out[chunk][rank] -= depth
    return out


def install_mtp(stages, layout: ParallelLayout, options) -> None:
    """The last stage runs the MTP layers after its decoder layers (models.stage, models.mtp.StageMTP)."""
    from ..models.mtp import StageMTP
    from ..tensor_parallel.mappings import scatter_to_region

    sp = options.sequence_parallel and layout.size("tp") > 1
    for stage in stages:
        if stage.is_last:
            n = stage.config.num_hidden_layers
            layers = [layer for i, layer in stage.body.layers.items() if int(i) >= n]
            stage.mtp = StageMTP(layers, options.mtp_scale, after_norm=not options.mtp_legacy,
                                 hidden_first=options.mtp_legacy,
                                 scatter=(lambda x: scatter_to_region(x, layout.group("tp"), 1)) if sp else None)
