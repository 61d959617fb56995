"""The MoE part of a Plan (pure arithmetic): the expert-data-parallel size, notes on what MindFormers' MoE keys mean
here, and the parameters a rank holds per pipeline stage, experts and MTP layers counted (memory.py).

Layout (MindFormers mcore / Megatron-Core, for both YAML spellings): inside a pipeline stage the dp x cp x tp ranks
are cut into expert-parallel groups of `ep` consecutive ranks; each holds num_experts / ep whole experts, and the
dp x cp x tp / ep ranks holding the same experts form the expert-data-parallel group (edp), over which expert
gradients are reduced and ZeRO shards expert optimizer state.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from ..config.errors import ConfigError, ConfigIssue
from ..model_params import dense_layer, moe_layer, mtp_extra

if TYPE_CHECKING:
    from ..config.schema import ParallelConfig
    from ..plan import Mesh, Plan

SCOPES = {"sub_sequence": "each rank's own tokens (sub_seq_aux_loss; MindFormers' legacy MoE)",
          "sequence": "each sequence (seq_aux_loss)", "global_batch": "the global batch (gbs_aux_loss)"}


def expert_data_parallel(cfg: "ParallelConfig", mesh: "Mesh") -> int:
    """edp = dp x cp x tp / ep. The YAML rules check this when the degrees are written out; this also covers a data
    parallel degree taken from the world size."""
    fold, ep = mesh.dp * mesh.cp * mesh.tp, cfg.ep
    if fold % ep:
        raise ConfigError([ConfigIssue(cfg.key("parallel_config.expert_parallel"), ep,
                                       f"must divide data_parallel x context_parallel x model_parallel = "
                                       f"{mesh.dp}x{mesh.cp}x{mesh.tp} = {fold}: expert-parallel groups are folded "
                                       "out of those ranks",
                                       f"use one of {[d for d in range(1, min(fold, 4096) + 1) if fold % d == 0]}, "
                                       "or a world size that makes the product a multiple of it")])
    return fold // ep


def moe_notes(cfg: "ParallelConfig", mesh: "Mesh") -> list[str]:
    s, ep = cfg.moe, cfg.ep
    fold = mesh.dp * mesh.cp * mesh.tp
    notes: list[str] = []
    if ep > 1:
        notes.append(f"expert parallel: ep={ep} ranks split the experts; expert data parallel edp = dp x cp x tp / ep "
                     f"= {mesh.dp}x{mesh.cp}x{mesh.tp}/{ep} = {fold // ep}; the ep groups are blocks of {ep} "
                     "consecutive ranks folded out of dp x cp x tp inside each pipeline stage (MindFormers mcore / "
                     "Megatron-Core); expert gradients are reduced, and ZeRO-sharded, over the expert-dp group")
    if s is not None and s.source == "moe_config" and ep > 1 and mesh.tp > 1:
        if s.expert_model_parallel == 1:
            notes.append("moe_config.expert_model_parallel=1: whole experts per rank, folded out of dp x cp x tp as "
                         f"MindFormers does (expert dp = dp x cp x mp / ep = {fold // ep})")
        else:
            notes.append(f"moe_config (legacy): MindFormers splits each expert over model_parallel={mesh.tp} too "
                         f"(expert dp = dp x cp / ep = {mesh.dp * mesh.cp // ep}); msparallel_ds keeps whole experts "
                         f"per rank, folded as above: the same math, {mesh.tp}x the expert weights per rank"
                         + (f"; expert_parallel: {ep * mesh.tp} holds as few as MindFormers" if s.num_experts and
                            not s.num_experts % (ep * mesh.tp) and not fold % (ep * mesh.tp) else ""))
    if s is None:
        if ep > 1:
            notes.append("MoE: the YAML sets no MoE keys; the HF model's experts are used (checked when the model "
                         "is parallelized); the memory estimate counts no experts")
        return notes
    experts = f"{s.num_experts} experts" if s.num_experts else "the HF model's experts (the YAML sets no count)"
    top = f"top-{s.top_k}" if s.top_k else "the HF model's top-k"
    route = "dropless (no capacity factor)" if s.capacity_factor is None else \
        f"capacity factor {s.capacity_factor:g} (tokens over an expert's capacity are dropped, policy {s.drop_policy})"
    aux = f"load-balancing aux loss x{s.aux_loss_coeff:g} over {SCOPES.get(s.aux_loss_scope, s.aux_loss_scope)}" \
        if s.aux_loss_coeff else "no load-balancing aux loss"
    extra = (f"; z-loss x{s.z_loss_coeff:g}" if s.z_loss_coeff else "") + \
        (f"; router expert bias (aux-loss-free balancing, update rate {s.bias_update_rate:g})" if s.expert_bias
         and s.bias_update_rate is not None else "; router expert bias (aux-loss-free balancing)" if s.expert_bias
         else "")
    if s.norm_topk_prob is not None or s.routed_scaling_factor is not None:  # the YAML's, over the HF config's
        norm = {True: "normalised over the top-k", False: "not normalised", None: "normalised as the HF model does"}
        extra += f"; routing weights {norm[s.norm_topk_prob]}, x{s.routed_scaling_factor or 1:g} (router.py:290-295)"
    dense = f"; the first {s.dense_layers} layer(s) dense" if s.dense_layers else ""
    notes.append(f"MoE ({s.source}): {experts}, {top}, {route}; {aux}{extra}{dense}")
    if not s.num_experts:
        notes.append("MoE: the memory estimate counts no experts (the YAML sets no expert count)")
    return notes


def stage_layer_kinds(plan: "Plan") -> list[tuple[int, int, int]]:
    """Per pipeline stage: (dense layers, MoE layers, MTP layers). Plan.layers_per_stage is [virtual chunk][stage],
    chunks placed in order (chunk-major); the first first_k_dense_replace layers are dense (all of them without an
    expert count). MTP layers follow the split of config.schema.ParallelConfig.pipeline_layers: the legacy models
    split them with the decoder layers (the last mtp_depth of the split), mcore adds them to the last stage."""
    cfg, s = plan.config, plan.moe
    n, mtp = cfg.model.num_layers, cfg.model.mtp_depth
    counts = plan.layers_per_stage or [[cfg.pipeline_layers]]
    dense = s.dense_layers if s is not None and s.num_experts else n
    out = [[0, 0, 0] for _ in counts[0]]
    start = 0
    for row in counts:
        for j, c in enumerate(row):
            main = max(0, min(start + c, n) - start)
            d = max(0, min(start + main, dense) - start)
            out[j][0] += d
            out[j][1] += main - d
            out[j][2] += c - main
            start += c
    if not cfg.use_legacy:
        out[-1][2] += mtp
    return [(d, e, k) for d, e, k in out]


def stage_params(plan: "Plan") -> list[tuple[int, int]]:
    """Per pipeline stage: (parameters a rank holds in its decoder and MTP layers outside the routed experts,
    routed-expert parameters); model_params.py counts each layer, with num_experts / ep whole routed experts per
    rank. An MTP layer's decoder is of the model's last layer kind. The embedding and head are memory.py's."""
    cfg, s, t = plan.config, plan.moe, plan.mesh.tp
    dense = dense_layer(cfg).per_rank(t)
    moe = experts = 0
    if s is not None and s.num_experts:
        rest, experts = moe_layer(cfg, s, plan.expert_parallel)
        moe = rest.per_rank(t)
    last_moe = bool(experts) and cfg.model.num_layers > s.dense_layers
    mtp = mtp_extra(cfg.model).per_rank(t) + (moe if last_moe else dense)
    mtp_experts = experts if last_moe else 0
    return [(d * dense + e * moe + k * mtp, e * experts + k * mtp_experts) for d, e, k in stage_layer_kinds(plan)]
