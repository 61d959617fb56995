"""The plan's reading of MindFormers 2.1's pynative schema (config.parallelism): batch arithmetic from `training:`,
the pipeline split from pipeline_parallel_layers_per_stage, and the FSDP shard group as a ZeRO stage."""
from __future__ import annotations

from typing import Any, Optional

from .config.errors import ConfigError, ConfigIssue
from .config.schema import ParallelConfig

PARAM_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


def pynative_batch(cfg: ParallelConfig, dp: int, pp: int,
                   notes: Optional[list[str]] = None) -> Optional[tuple[int, int, int]]:
    """(micro_batch_num, gradient_accumulation_steps, global batch) as the pynative trainer derives them
    (trainer.py _compute_data_parallel_size): accumulation = global_batch_size / (data_parallel x local_batch_size),
    and with pipeline_parallel > 1 those are the pipeline's micro-batches (pipeline_parallel_microbatch_size).
    A batch MindFormers refuses (trainer.py:595-601) is an error; with `notes` (the `plan` command, which reports a
    layout rather than starts it) it becomes a note saying the run refuses it, and the nearest valid batch is planned."""
    t = cfg.training
    if cfg.parallelism is None or t is None:
        return None
    base = dp * t.local_batch_size
    gbs = t.global_batch_size or base
    issue = None
    if gbs % base:
        fix = f"use a multiple of {base}" + (f" (e.g. {base * max(1, round(gbs / base))})" if gbs > base else "")
        issue = ConfigIssue("training.global_batch_size", gbs, f"must be divisible by data_parallel({dp}) "
                            f"x training.local_batch_size({t.local_batch_size}) = {base} (MindFormers 2.1: "
                            "data_parallel = world_size // (tensor x context x pipeline parallel))",
                            fix + ", or launch a world size whose data_parallel divides it")
        valid = base * -(-gbs // base)
    elif pp > 1 and gbs // base < pp:
        issue = ConfigIssue("training.global_batch_size", gbs, f"gives {gbs // base} pipeline micro-batches "
                            f"(global / (data_parallel {dp} x local_batch_size "
                            f"{t.local_batch_size})), fewer than parallelism.pipeline_parallel={pp}",
                            f"use at least {base * pp}")
        valid = base * pp
    if issue is not None:
        if notes is None:
            raise ConfigError([issue])
        notes.append(f"{issue.key}={gbs} {issue.rule}: a run refuses it (as MindFormers 2.1 does); planned with "
                     f"the nearest valid global batch {valid} (fix: {issue.fix})")
        gbs = valid
    accum = gbs // base
    if pp > 1:
        return accum, 1, gbs
    return 1, accum, gbs


def pynative_layers(cfg: ParallelConfig, n_layers: Optional[int], pp: int, vpp: int) -> Optional[list[list[int]]]:
    """parallelism.pipeline_parallel_layers_per_stage (one "a-b[,c-d]" string per pp rank, a range per virtual chunk;
    pipeline_parallel.py) -> [vpp][pp] layer counts; None: the even split ("auto", which needs divisibility)."""
    src = cfg.parallelism
    spec = src.pipeline_parallel_layers_per_stage if src is not None else None
    key = "parallelism.pipeline_parallel_layers_per_stage"
    if pp == 1 or src is None:
        return None
    if spec in (None, "auto"):
        if n_layers is not None and n_layers % (pp * vpp):
            raise ConfigError([ConfigIssue(key, spec or "auto", f"splits evenly only: num_hidden_layers={n_layers} "
                                           f"is not divisible by pipeline_parallel x interleave = {pp * vpp}",
                                           "list each stage's layers, e.g. ['0-3', '4-8']")])
        return None
    if len(spec) != pp:
        raise ConfigError([ConfigIssue(key, spec, f"has {len(spec)} entries for pipeline_parallel={pp}",
                                       "write one 'start-end' string per pipeline rank")])
    grid, ranges = [[0] * pp for _ in range(vpp)], {}
    for s, text in enumerate(spec):
        parts = text.split(",")
        if len(parts) != vpp:
            raise ConfigError([ConfigIssue(key, text, f"has {len(parts)} chunk(s) but the interleave num is {vpp}",
                                           f"write {vpp} comma-separated ranges per rank")])
        for c, r in enumerate(parts):
            lo, _, hi = r.strip().partition("-")
            try:
                ranges[c * pp + s] = (int(lo), int(hi or lo))
            except ValueError:
                raise ConfigError([ConfigIssue(key, r, "is not a layer range", "write 'start-end'")]) from None
    start = 0
    for v in range(pp * vpp):  # the virtual stages must tile the layers in order (the split cuts contiguously)
        lo, hi = ranges[v]
        if lo != start or hi < lo:
            raise ConfigError([ConfigIssue(key, spec, f"virtual stage {v} holds layers {lo}-{hi}; the stages must "
                                           f"tile the layers in order starting at {start}", "fix the ranges")])
        grid[v // pp][v % pp], start = hi - lo + 1, hi + 1
    if n_layers is not None and start != n_layers:
        raise ConfigError([ConfigIssue(key, spec, f"covers {start} layers, the model has {n_layers}",
                                       "cover every layer once")])
    return grid


def pynative_zero(cfg: ParallelConfig, dp: int, cp: int, ep: int, stage: int, params: Optional[int],
                  notes: list[str]) -> tuple[int, Optional[int], Optional[str], bool]:
    """(ZeRO stage, hpZ sub-group, downgrade warning, reshard after forward) for the FSDP of data_parallel_shard.
    FSDP shards over dp_shard x cp; dp_replicate = dp // dp_shard replicates (HSDP = ZeRO-3 with a sub-group)."""
    src = cfg.parallelism
    shard = src.data_parallel_shard
    replicate = max(dp // shard, 1) if shard > 0 and not src.replicate_written else src.data_parallel_replicate
    group = (dp // replicate) * cp if shard != -1 else dp * cp
    hpz = group if stage == 3 and replicate > 1 and 1 < group < dp * cp else None
    if src.dense_fsdp_shard_size and stage == 3:
        hpz = src.dense_fsdp_shard_size
    policy = src.reshard_after_forward_policy
    reshard = policy == "always" or (policy == "default" and cfg.pp == 1)  # distributed/fsdp.py
    warn = None
    if stage == 3 and ep > 1:
        stage, hpz = 2, None
        size = PARAM_BYTES[cfg.model.param_init_type]
        more = (f" = {params * size * (1 - 1 / (dp * cp)) / 2**30:.2f} GiB more per rank for this model"
                if params else "")
        warn = (f"parallelism.data_parallel_shard with parallelism.expert_parallel={ep}: DeepSpeed's ZeRO-3 does not "
                "shard expert-parallel parameters over their expert-data-parallel group, so this runs ZeRO-2 (optimizer "
                "states and gradients sharded: dense over data_parallel x context_parallel, experts over expert data "
                "parallel; the same updates). Each rank keeps its whole weights instead of 1/"
                f"{dp * cp} of them: (1 - 1/{dp * cp}) x the weight bytes{more}")
        notes.append(warn)
    return stage, hpz, warn, reshard
