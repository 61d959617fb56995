"""MindFormers 2.1's pynative schema (`parallelism:` + `training:` + top-level `recompute:`, names from torchtitan)
-> the same fields as parallel_config. Every key keeps the meaning of MindFormers 2.1's pynative trainer
(mindformers/pynative/config/config.py ParallelismConfig / TrainingConfig / RecomputeConfig, trainer.py
_compute_data_parallel_size, distributed/fsdp.py, pipeline_parallel.py, activation_checkpoint.py):

- data parallel = world // (tensor x context x pipeline): data_parallel_shard -1 shards over all of it, N > 0 shards
  over N and replicates over data_parallel // N (HSDP); resolved by the plan from the world size
- the shard group (FSDP over dp_shard x cp) is ZeRO-3; with expert parallel it runs as ZeRO-2 (plan._zero)
- training.global_batch_size = data_parallel x local_batch_size x accumulation steps; the accumulation steps are the
  pipeline's micro-batches when pipeline_parallel > 1; max_norm > 0 clips (default 1.0); steps: the run's length
- recompute.mode full / select with layer ranges ("0-42"); None: no recompute
"""
from __future__ import annotations

import difflib
import warnings
from typing import Any, Mapping

from .errors import ConfigIssue, ConfigWarning

CP_METHODS = {"colossal": "colossalai_cp", "colossalai": "colossalai_cp", "colossalai_cp": "colossalai_cp",
              "ulysses": "ulysses_cp", "ulysses_cp": "ulysses_cp", "hybrid": "hybrid_cp", "hybrid_cp": "hybrid_cp"}
PP_SCHEDULES = {"1f1b": "1f1b", "interleaved_1f1b": "1f1b", "gpipe": "gpipe", "zero_bubble_v": "zero_bubble_v",
                "zbv": "zero_bubble_v"}
# read for their meaning (data_parallel_replicate and micro_batch_num: spellings of earlier 2.x drafts)
READ = ("data_parallel_replicate", "data_parallel_shard", "data_parallel_shard_strategy",
        "reshard_after_forward_policy", "cpu_offload", "disable_gradient_division", "dense_fsdp_shard_size",
        "tensor_parallel", "context_parallel", "context_parallel_method", "context_parallel_mask_type",
        "ulysses_degree_in_cp", "pipeline_parallel", "pipeline_parallel_layers_per_stage",
        "pipeline_parallel_interleave_num", "pipeline_parallel_schedule", "pipeline_parallel_microbatch_size",
        "sequence_parallel", "expert_parallel", "micro_batch_num", "moe_token_dispatcher_type")
# Ascend speed switches with the same maths (overlap, fused kernels, dispatch variants, device counts): accepted
SAME_MATH = ("context_parallel_async", "pipeline_parallel_overlap_p2p", "pipeline_parallel_overlap_b_f",
             "pipeline_parallel_enable_dxdw_split", "pipeline_parallel_p2p_transport", "enable_mc2",
             "enable_loss_parallel", "npu_nums_per_device", "expert_parallel_async_d2h",
             "expert_parallel_use_safe_tokens")
PARALLELISM_FIELDS = READ + SAME_MATH
TRAINING_READ = ("steps", "local_batch_size", "global_batch_size", "max_norm")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _warn(msg: str) -> None:
    warnings.warn(msg, ConfigWarning, stacklevel=6)


def apply_parallelism(p: dict, out: dict, issues: list[ConfigIssue]) -> None:
    for key in list(p):
        if key not in PARALLELISM_FIELDS:
            close = difflib.get_close_matches(key, PARALLELISM_FIELDS, n=1, cutoff=0.6)
            _warn(f"parallelism.{key} is not a MindFormers 2.1 parallelism key; ignored"
                  + (f" (did you mean `{close[0]}`?)" if close else ""))
    pc: dict[str, Any] = {}
    replicate = p.get("data_parallel_replicate", 1)
    shard = p.get("data_parallel_shard", -1)
    if shard == 0 and _is_int(shard):
        issues.append(ConfigIssue("parallelism.data_parallel_shard", 0, "must be -1 (auto) or a positive degree",
                                  "write -1 to take it from the world size"))
    src = {"data_parallel_replicate": replicate, "data_parallel_shard": shard,
           "replicate_written": "data_parallel_replicate" in p}
    for key in ("cpu_offload", "reshard_after_forward_policy", "disable_gradient_division", "dense_fsdp_shard_size",
                "pipeline_parallel_layers_per_stage"):
        if p.get(key) is not None:
            src[key] = p[key]
    out["parallelism"] = src
    strategy = p.get("data_parallel_shard_strategy", "optim_grads_params")
    if strategy != "optim_grads_params":
        issues.append(ConfigIssue("parallelism.data_parallel_shard_strategy", strategy,
                                  "must be optim_grads_params (the one strategy MindFormers 2.1 implements)",
                                  "write optim_grads_params"))
    if _is_int(replicate) and _is_int(shard) and shard >= 1 and replicate >= 1:
        pc["data_parallel"] = replicate * shard  # without --world-size; the plan re-derives it from the world
    elif _is_int(replicate):
        pc["data_parallel"] = replicate
    for ours, theirs in (("model_parallel", "tensor_parallel"), ("context_parallel", "context_parallel"),
                         ("pipeline_stage", "pipeline_parallel"), ("ulysses_degree_in_cp", "ulysses_degree_in_cp"),
                         ("use_seq_parallel", "sequence_parallel"), ("expert_parallel", "expert_parallel"),
                         ("micro_batch_num", "micro_batch_num")):
        if theirs in p:
            pc[ours] = p[theirs]
    method = p.get("context_parallel_method")
    if method is not None:
        if isinstance(method, str) and method.lower() in CP_METHODS:
            pc["context_parallel_algo"] = CP_METHODS[method.lower()]
        else:
            issues.append(ConfigIssue("parallelism.context_parallel_method", method,
                                      "must be one of colossal, ulysses, hybrid", "pick one of those"))
    mask = p.get("context_parallel_mask_type", "causal")
    if mask != "causal":
        issues.append(ConfigIssue("parallelism.context_parallel_mask_type", mask,
                                  "must be causal (the one mask MindFormers 2.1's pynative CP prepares)",
                                  "write causal"))
    dispatcher = p.get("moe_token_dispatcher_type", "alltoall")
    if dispatcher not in ("alltoall", "alltoall_deredundancy"):
        issues.append(ConfigIssue("parallelism.moe_token_dispatcher_type", dispatcher,
                                  "must be alltoall or alltoall_deredundancy", "write alltoall"))
    if p.get("disable_gradient_division") is False:
        _warn("parallelism.disable_gradient_division=false: MindFormers 2.1 then divides gradients twice (the "
              "loss.backward sense 1/(world/pipeline_parallel) and FSDP's mean over the shard group); this runs "
              "the global-batch mean gradient, as with the default true")
    schedule = p.get("pipeline_parallel_schedule")
    vpp = p.get("pipeline_parallel_interleave_num")
    pipeline_config = dict(out["parallel"].get("pipeline_config") or {})
    if schedule is not None:
        if isinstance(schedule, str) and schedule.lower() in PP_SCHEDULES:
            pipeline_config["pipeline_scheduler"] = PP_SCHEDULES[schedule.lower()]
            if schedule.lower() == "interleaved_1f1b":
                pipeline_config["pipeline_interleave"] = True
        else:
            issues.append(ConfigIssue("parallelism.pipeline_parallel_schedule", schedule,
                                      "must be one of 1f1b, interleaved_1f1b, gpipe", "pick one of those"))
    if vpp is not None:
        out["model"]["pp_interleave_num"] = vpp
        if _is_int(vpp) and vpp > 1:
            pipeline_config["pipeline_interleave"] = True
    out["parallel"]["pipeline_config"] = pipeline_config
    if shard != 1 and not out["parallel"].get("enable_parallel_optimizer"):
        # dp_shard is FSDP sharding of parameters, gradients and optimizer states: ZeRO-3 (plan._zero resolves the
        # shard group from the world and runs ZeRO-2 where expert parallel rules ZeRO-3 out)
        out["parallel"]["enable_parallel_optimizer"] = True
        poc = dict(out["parallel"].get("parallel_optimizer_config") or {})
        poc.setdefault("optimizer_level", "level3")
        out["parallel"]["parallel_optimizer_config"] = poc
    if out["parallel_config"]:
        _warn("both `parallelism:` and `parallel_config:` are present; `parallelism:` wins")
    out["parallel_config"] = {**out["parallel_config"], **pc}


def apply_training(t: dict, out: dict) -> None:
    """`training:` -> runner_config.batch_size (local_batch_size) and the `training` section the plan reads."""
    out["training"] = {k: t[k] for k in TRAINING_READ if k in t}
    if "local_batch_size" in t:
        out["runner_config"] = {**out["runner_config"], "batch_size": t["local_batch_size"]}


def layer_ids(specs: Any, key: str, issues: list[ConfigIssue]) -> set[int] | None:
    """MindFormers' layer ranges (activation_checkpoint._parse_layer_ids): "a-b" or "n" strings or ints."""
    if isinstance(specs, (str, int)) and not isinstance(specs, bool):
        specs = [specs]
    if not isinstance(specs, (list, tuple)):
        issues.append(ConfigIssue(key, specs, "must be a list of layer ranges", "write e.g. ['0-3']"))
        return None
    out: set[int] = set()
    for item in specs:
        text = str(item).strip()
        left, _, right = text.partition("-")
        try:
            lo, hi = int(left), int(right or left)
        except ValueError:
            issues.append(ConfigIssue(key, item, "is not a layer range", "write 'start-end' or one layer id"))
            return None
        if lo < 0 or lo > hi or hi > 1 << 20:
            issues.append(ConfigIssue(key, item, "must be start-end with 0 <= start <= end", "e.g. '0-3'"))
            return None
        out.update(range(lo, hi + 1))
    return out


def apply_recompute(r: Mapping, out: dict, issues: list[ConfigIssue]) -> None:
    """Top-level `recompute:` (mode None / full / select) -> recompute_config. Full layers are kept as ids; the plan
    turns them into its per-stage counts once the layer split is known (plan._recompute_ids)."""
    mode = r.get("mode", "None")
    if mode in (None, "None", "none"):
        return
    if mode == "full":
        ids = layer_ids(r.get("full_recompute_layer"), "recompute.full_recompute_layer", issues)
        if ids is not None and not ids:
            issues.append(ConfigIssue("recompute.full_recompute_layer", r.get("full_recompute_layer"),
                                      "is empty with mode: full (MindFormers refuses it)",
                                      "list the layers, e.g. ['0-3'], or set mode: None"))
        elif ids:
            out["recompute_config"] = {"recompute": sorted(ids), "by_layer_id": True}
    elif mode == "select":
        sel = r.get("select_module")
        if isinstance(sel, list) and all(isinstance(s, str) for s in sel):
            out["recompute_config"] = {"select_recompute": sel}
        elif isinstance(sel, Mapping):
            select = {}
            for pattern, ranges in sel.items():
                ids = layer_ids(ranges, f"recompute.select_module.{pattern}", issues)
                if ids:
                    select[str(pattern)] = sorted(ids)
            out["recompute_config"] = {"select_recompute": select, "by_layer_id": True}
        else:
            issues.append(ConfigIssue("recompute.select_module", sel, "must list module patterns (a list, or a "
                                      "mapping pattern -> layer ranges) with mode: select", "e.g. ['feed_forward']"))
    else:
        issues.append(ConfigIssue("recompute.mode", mode, "must be None, full or select", "pick one of those"))
    if r.get("exclude_op"):
        _warn("recompute.exclude_op is not applied here: the listed modules are recomputed with their layer")
