"""The cross-field rules MindFormers enforces (tools/check_rules.py, LayerSetting, the model code), plus the ones
msparallel_ds needs so that nothing runs silently wrong. Each broken rule is one ConfigIssue; all are collected."""
from __future__ import annotations

import warnings
from typing import Any

from .errors import ConfigIssue, ConfigWarning
from .schema import SEQ_PP_SCHEDULERS, SUPPORTED_PP_SCHEDULERS, ParallelConfig

PC = "parallel_config"
MAX_PIPELINE_CHUNKS = 1 << 16  # far beyond any real model; keeps the per-chunk tables small
MC = "model.model_config"


def ulysses_degree(cfg: ParallelConfig) -> int:
    """The Ulysses (head-sharding) part of cp: 1 for all-gather/ring, cp for ulysses_cp, the given degree for hybrid."""
    algo = cfg.parallel_config.context_parallel_algo
    if cfg.cp == 1 or algo == "colossalai_cp":
        return 1
    if algo == "ulysses_cp":
        return cfg.cp
    return cfg.parallel_config.ulysses_degree_in_cp


def virtual_stages(cfg: ParallelConfig) -> int:
    """pp_interleave_num acts only when parallel.pipeline_config.pipeline_interleave is on and pp > 1."""
    if cfg.pp == 1 or not cfg.parallel.pipeline_config.pipeline_interleave:
        return 1
    return cfg.model.pp_interleave_num


def _warn(text: str) -> None:
    warnings.warn(text, ConfigWarning, stacklevel=4)


def check_rules(cfg: ParallelConfig) -> list[ConfigIssue]:
    issues: list[ConfigIssue] = []
    for rule in (_cp_rules, _head_rules, _sequence_rules, _interleave_rules, _pipeline_rules, _offset_rules,
                 _swap_rules, _recompute_rules, _optimizer_rules):
        issues.extend(rule(cfg))
    return issues


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, min(n, 4096) + 1) if n % d == 0]


def _cp_rules(cfg: ParallelConfig):
    pc, k = cfg.parallel_config, cfg.key
    if pc.context_parallel_algo == "hybrid_cp" and cfg.cp % pc.ulysses_degree_in_cp != 0:
        yield ConfigIssue(k(f"{PC}.ulysses_degree_in_cp"), pc.ulysses_degree_in_cp,
                          f"must divide {k(f'{PC}.context_parallel')}={cfg.cp}",
                          f"use one of {_divisors(cfg.cp)}")
    if pc.ulysses_degree_in_cp > 1 and pc.context_parallel_algo != "hybrid_cp":
        _warn(f"{PC}.ulysses_degree_in_cp={pc.ulysses_degree_in_cp} only acts with context_parallel_algo=hybrid_cp "
              f"(got {pc.context_parallel_algo}); ignored")
    if cfg.cp > 1 and "use_flash_attention" in cfg.model.model_fields_set and not cfg.model.use_flash_attention:
        yield ConfigIssue(f"{MC}.use_flash_attention", False,
                          f"must be true when {k(f'{PC}.context_parallel')}={cfg.cp} > 1 "
                          "(MindFormers runs context parallel only with flash attention)",
                          f"set {MC}.use_flash_attention: true")
    if cfg.model.use_ring_attention and (cfg.cp == 1 or pc.context_parallel_algo != "colossalai_cp"):
        _warn(f"{MC}.use_ring_attention=true acts only with context_parallel > 1 and colossalai_cp "
              f"(got context_parallel={cfg.cp}, {pc.context_parallel_algo}); ignored")


def _head_rules(cfg: ParallelConfig):
    m, k = cfg.model, cfg.key
    if m.num_heads is None:
        return
    kv = m.kv_heads
    if m.num_heads % kv != 0:
        yield ConfigIssue(f"{MC}.n_kv_heads", kv, f"must divide {MC}.num_heads={m.num_heads} (GQA groups)",
                          f"use one of {_divisors(m.num_heads)}")
    u = ulysses_degree(cfg)
    shards = cfg.tp * u
    what = f"{k(f'{PC}.model_parallel')}={cfg.tp}" + (f" x ulysses degree {u}" if u > 1 else "")
    if m.num_heads % shards != 0:
        yield ConfigIssue(f"{MC}.num_heads", m.num_heads,
                          f"must be divisible by {what} = {shards} (attention heads are split over them)",
                          f"make model_parallel{' x ulysses degree' if u > 1 else ''} one of "
                          f"{_divisors(m.num_heads)}")
    elif kv % shards != 0:
        if shards % kv == 0:  # beyond MindFormers: each kv head replicated (Megatron / DeepSpeed ALST do the same)
            _warn(f"{MC}.n_kv_heads={kv} is not divisible by {what} = {shards} (MindFormers refuses this); "
                  f"each kv head is replicated {shards // kv}x over the ranks that share it")
        else:
            yield ConfigIssue(f"{MC}.n_kv_heads", kv,
                              f"and {what} = {shards}: neither divides the other, so kv heads can be neither split "
                              "nor replicated evenly",
                              f"make model_parallel{' x ulysses degree' if u > 1 else ''} a divisor of {kv} or a "
                              f"multiple of {kv} that divides num_heads={m.num_heads}")


def _sequence_rules(cfg: ParallelConfig):
    """Sharding a sequence that does not divide evenly corrupts silently in peers; refuse it up front."""
    seq, k = cfg.model.seq_length, cfg.key
    if seq is None:
        return
    u = ulysses_degree(cfg)
    ring = cfg.cp // u
    # causal load balance cuts the ring/all-gather part into 2*cp_ring chunks; Ulysses needs seq % cp.
    need = cfg.cp * (2 if ring > 1 or (cfg.cp > 1 and u == 1) else 1)
    if cfg.cp > 1 and seq % need != 0:
        yield ConfigIssue(f"{MC}.seq_length", seq,
                          f"must be divisible by {need} to split it over {k(f'{PC}.context_parallel')}={cfg.cp}"
                          + (" with causal load balancing (2 chunks per rank)" if need != cfg.cp else ""),
                          f"use a seq_length that is a multiple of {need}")
    if cfg.parallel_config.use_seq_parallel and cfg.tp > 1 and (seq // cfg.cp) % cfg.tp != 0:
        yield ConfigIssue(f"{MC}.seq_length", seq,
                          f"per-rank length {seq // cfg.cp} must be divisible by "
                          f"{k(f'{PC}.model_parallel')}={cfg.tp} for sequence parallel",
                          f"use a seq_length that is a multiple of {cfg.cp * cfg.tp}")


def _interleave_rules(cfg: ParallelConfig):
    mbi = cfg.micro_batch_interleave_num
    if not cfg.use_legacy and mbi > 1:
        yield ConfigIssue("micro_batch_interleave_num", mbi, "must be 1 for mcore models (use_legacy: false): "
                          "MindFormers raises 'micro_batch_interleave_num > 1, is not supported when use_legacy=False' "
                          "(trainer/base_trainer.py:544-545)", "set micro_batch_interleave_num: 1, or use_legacy: true")
    fgi = cfg.model.fine_grain_interleave
    if fgi > 1 and not cfg.parallel_config.use_seq_parallel and cfg.cp == 1:
        yield ConfigIssue(f"{MC}.fine_grain_interleave", fgi,
                          f"needs {cfg.key(f'{PC}.use_seq_parallel')}=true or context_parallel > 1",
                          f"set {cfg.key(f'{PC}.use_seq_parallel')}: true, or fine_grain_interleave: 1")
    elif fgi > 1 and cfg.tp == 1:
        _warn(f"{MC}.fine_grain_interleave={fgi} only acts with model_parallel > 1; ignored")


def _pipeline_rules(cfg: ParallelConfig):
    pc, k = cfg.parallel_config, cfg.key
    sched = cfg.parallel.pipeline_config.pipeline_scheduler
    if cfg.pp == 1:
        if cfg.model.pp_interleave_num > 1:
            _warn(f"{MC}.pp_interleave_num={cfg.model.pp_interleave_num} has no effect with pipeline_stage=1")
        return
    if pc.micro_batch_num < cfg.pp and cfg.training is None:  # `training:`: the plan derives it from the world
        yield ConfigIssue(k(f"{PC}.micro_batch_num"), pc.micro_batch_num,
                          f"must be >= {k(f'{PC}.pipeline_stage')}={cfg.pp}",
                          f"set micro_batch_num to at least {cfg.pp}")
    vpp = virtual_stages(cfg)
    if cfg.pp * vpp > MAX_PIPELINE_CHUNKS:
        yield ConfigIssue(k(f"{PC}.pipeline_stage"), cfg.pp,
                          f"x pp_interleave_num {vpp} = {cfg.pp * vpp} pipeline chunks is more than "
                          f"{MAX_PIPELINE_CHUNKS}", "use fewer pipeline stages or virtual chunks")
    if cfg.model.pp_interleave_num > 1 and vpp == 1:
        _warn(f"{MC}.pp_interleave_num={cfg.model.pp_interleave_num} acts only with "
              "parallel.pipeline_config.pipeline_interleave: true; ignored")
    if cfg.model.num_layers is not None and cfg.pipeline_layers < cfg.pp * vpp:
        yield ConfigIssue(f"{MC}.num_layers", cfg.model.num_layers,
                          f"must be >= pipeline_stage x pp_interleave_num = {cfg.pp * vpp} (one layer per stage)",
                          "lower pipeline_stage or pp_interleave_num")
    if sched in SEQ_PP_SCHEDULERS:
        yield from _seq_pipeline_rules(cfg, sched, vpp)
    elif sched not in SUPPORTED_PP_SCHEDULERS:
        yield ConfigIssue(k("parallel.pipeline_config.pipeline_scheduler"), sched,
                          f"is not supported by msparallel_ds (supported: {', '.join(SUPPORTED_PP_SCHEDULERS)})",
                          "use 1f1b (interleaved when pp_interleave_num > 1), gpipe or zero_bubble_v")
    elif sched == "zero_bubble_v" and vpp != 2:
        yield ConfigIssue(k("parallel.pipeline_config.pipeline_scheduler"), sched,
                          f"runs two chunks per stage (V shape) but pp_interleave_num is effectively {vpp}",
                          f"set {MC}.pp_interleave_num: 2 and parallel.pipeline_config.pipeline_interleave: true")
    if cfg.runner_config.gradient_accumulation_steps > 1:
        _warn("runner_config.gradient_accumulation_steps is ignored when pipeline_stage > 1 "
              "(MindFormers accumulates over micro_batch_num)")
    if pc.vocab_emb_dp and cfg.tp > 1:
        _warn(f"{PC}.vocab_emb_dp=true is forced to false when pipeline_stage > 1 (as MindFormers does)")


def _seq_pipeline_rules(cfg: ParallelConfig, sched: str, vpp: int):
    """seqpipe / seqvpp / seqsmartvpp (sequence-chunked pipelines) run as their nearest schedule, same math, with
    MindFormers' own constraints (mindformers 2.1.0): tools/check_rules.py:217-227 seqvpp needs seq_split_num > 1;
    the legacy models forbid full recompute (trainer/base_trainer.py:517-528) and ring attention
    (models/llama/llama.py:113-129); mcore (use_legacy: false) rejects seq_split_num > 1 (base_trainer.py:551-558)."""
    key, n = "parallel.pipeline_config.pipeline_scheduler", cfg.parallel_config.seq_split_num
    if sched == "seqvpp" and n <= 1:
        yield ConfigIssue(f"{PC}.seq_split_num", n, f"must be > 1 with {key}=seqvpp (the sequence is cut into "
                          "seq_split_num chunks)", "set seq_split_num: 2 or more, or pipeline_scheduler: 1f1b")
    if not cfg.use_legacy and n > 1:
        yield ConfigIssue(f"{PC}.seq_split_num", n, "must be 1 for mcore models (use_legacy: false) with "
                          "pipeline_stage > 1", "set seq_split_num: 1, or use_legacy: true")
    if cfg.use_legacy and cfg.recompute_config.recompute is True:
        yield ConfigIssue("recompute_config.recompute", True, f"full recompute is not allowed with {key}={sched}",
                          "recompute selected layers or operators (a per-stage list, select_recompute), or use 1f1b")
    if cfg.use_legacy and cfg.model.use_ring_attention:
        yield ConfigIssue(f"{MC}.use_ring_attention", True, f"is not allowed with {key}={sched}",
                          "set use_ring_attention: false, or pipeline_scheduler: 1f1b")
    runs = "interleaved 1F1B" if vpp > 1 else "1F1B"
    if n <= 1:  # models/llama/llama.py:117-118: seq_pipe only when seq_split_num > 1 (seqvpp: an error above)
        if sched != "seqvpp":
            _warn(f"{key}={sched} with {PC}.seq_split_num=1: nothing is chunked, in MindFormers either (models/llama/"
                  f"llama.py:117-118 cuts the sequence only when seq_split_num > 1): this runs {runs}, whole "
                  "sequences per micro-batch, as MindFormers does; set seq_split_num > 1 for the sequence-chunked "
                  "pipeline")
        return
    _warn(f"{key}={sched}: the sequence-chunked pipeline (seq_split_num={n}) is not built yet; this runs {runs} with "
          f"the same math, holding whole sequences per micro-batch (about {n}x the activation memory of one "
          "sequence chunk in flight)")


def _offset_shape(offset: Any) -> tuple[int, ...]:
    if isinstance(offset, int):
        return ()
    if offset and isinstance(offset[0], list):
        return (len(offset), len(offset[0]))
    return (len(offset),)


def layers_per_stage(num_layers: int, pp: int, vpp: int, offset: Any) -> list[list[int]]:
    """MindFormers' LayerSetting: [vpp][pp] layer counts = num_layers // (pp*vpp) + offset (broadcast)."""
    base = num_layers // (pp * vpp)
    if isinstance(offset, int):
        grid = [[offset] * pp for _ in range(vpp)]
    elif offset and isinstance(offset[0], list):
        grid = [list(row) for row in offset]
    else:
        grid = [list(offset) for _ in range(vpp)]
    return [[base + o for o in row] for row in grid]


def _offset_sum(offset: Any) -> int:
    if isinstance(offset, int):
        return offset
    return sum(sum(r) if isinstance(r, list) else r for r in offset)


def _offset_rules(cfg: ParallelConfig):
    offset, pp, vpp = cfg.model.offset, cfg.pp, virtual_stages(cfg)
    if pp * vpp > MAX_PIPELINE_CHUNKS:
        return  # reported by _pipeline_rules
    key = f"{MC}.offset"
    if not isinstance(offset, int) and not offset:
        yield ConfigIssue(key, offset, "must be an int, a list per stage or a list per virtual chunk", "write 0")
        return
    shape = _offset_shape(offset)
    if len(shape) == 2 and any(len(r) != shape[1] for r in offset):
        yield ConfigIssue(key, offset, "rows must all have the same length", f"give {pp} values per row")
        return
    if shape and shape[-1] != pp:
        yield ConfigIssue(key, offset, f"needs one value per pipeline stage ({pp}), got {shape[-1]}",
                          f"give a list of {pp} values" + (f" per virtual chunk ({vpp} rows)" if vpp > 1 else ""))
        return
    if len(shape) == 2 and shape[0] != vpp:
        yield ConfigIssue(key, offset, f"needs one row per virtual chunk (pp_interleave_num effectively {vpp}), "
                          f"got {shape[0]}", f"give {vpp} rows of {pp} values")
        return
    n = cfg.pipeline_layers
    if n is None:
        return
    remainder = n % (pp * vpp)
    if _offset_sum(offset) != remainder:
        layers = "(num_layers + mtp_depth)" if cfg.model.mtp_depth and cfg.use_legacy else "num_layers"
        yield ConfigIssue(key, offset, f"must sum to {layers} % (pipeline_stage x pp_interleave_num) = "
                          f"{n} % {pp * vpp} = {remainder}, but sums to {_offset_sum(offset)}",
                          "adjust the offsets so they add up to the remainder (layers per stage = "
                          f"{n // (pp * vpp)} + offset)")
        return
    counts = layers_per_stage(n, pp, vpp, offset)
    if sum(map(sum, counts)) != n:  # a flat list is applied to every virtual chunk
        yield ConfigIssue(key, offset, f"gives {sum(map(sum, counts))} layers in total, not {n} "
                          f"(a per-stage list applies to each of the {vpp} virtual chunks)",
                          f"give {vpp} rows of {pp} offsets, one row per virtual chunk")
        return
    flat = [c for row in counts for c in row]  # global stage order: chunk-major
    if cfg.use_legacy and min(flat) < 1:
        yield ConfigIssue(key, offset, f"leaves a stage without layers (layers per stage {counts})",
                          "make every num_layers // (pp x vpp) + offset at least 1")
    elif not cfg.use_legacy and (min(flat) < 0 or min(flat[1:-1], default=1) < 1):
        # mcore LayerSetting: the first and the last stage may hold 0 layers, every stage between needs one
        yield ConfigIssue(key, offset, f"leaves a middle stage without layers, or a stage with fewer than 0 "
                          f"(layers per stage {counts}; with use_legacy: false only the first and last stage may "
                          "hold 0)", "make every middle stage's num_layers // (pp x vpp) + offset at least 1")


def _swap_rules(cfg: ParallelConfig):
    """tools/check_rules.py _check_swap (mindformers 2.1.0 l.353-368): default_prefetch >= 1 when swap is on."""
    sc = cfg.swap_config
    if sc.swap and sc.default_prefetch < 1:
        yield ConfigIssue("swap_config.default_prefetch", sc.default_prefetch, "must be >= 1 when swap is on",
                          "write 1 or more")


def _recompute_rules(cfg: ParallelConfig):
    rc, pp = cfg.recompute_config, cfg.pp
    if rc.by_layer_id:  # MindFormers 2.1 `recompute:` layer ids (config.parallelism; checked when read)
        return
    swap = cfg.swap_config.swap  # with swap on MindFormers drops the per-stage length limit (check_rules l.316-325)
    for name in ("recompute", "select_recompute", "select_comm_recompute"):
        value = getattr(rc, name)
        lists = [("", value)] if isinstance(value, list) else []
        if isinstance(value, dict):
            lists = [(f"[{p!r}]", v) for p, v in value.items() if isinstance(v, list)]
        for suffix, lst in lists:
            if lst and all(isinstance(x, int) for x in lst):
                if len(lst) > pp and not swap:
                    yield ConfigIssue(f"recompute_config.{name}{suffix}", lst,
                                      f"has {len(lst)} entries but there are only {pp} pipeline stages "
                                      "(one layer count per stage)", f"give at most {pp} values")
                if any(x < 0 for x in lst):
                    yield ConfigIssue(f"recompute_config.{name}{suffix}", lst, "layer counts must be >= 0",
                                      "use 0 to switch a stage off")
            elif lst and all(isinstance(x, list) for x in lst):
                if any(len(row) > pp for row in lst) and not swap:
                    yield ConfigIssue(f"recompute_config.{name}{suffix}", lst,
                                      f"rows must have at most {pp} entries (one per pipeline stage)",
                                      f"give at most {pp} values per row")


def _optimizer_rules(cfg: ParallelConfig):
    poc = cfg.parallel.parallel_optimizer_config
    size = poc.optimizer_weight_shard_size
    group = cfg.dp * cfg.cp
    if not (cfg.parallel.enable_parallel_optimizer and size not in (-1, 0) and cfg.parallelism is None):
        return
    if size > group:  # MindSpore then shards each parameter over its whole data-parallel group (no sub-group)
        _warn(f"parallel.parallel_optimizer_config.optimizer_weight_shard_size={size} is larger than the "
              f"optimizer-parallel group data_parallel x context_parallel = {group}: MindSpore shards over the whole "
              f"group then, and so does this run (as -1)")
    elif group % size != 0:
        yield ConfigIssue("parallel.parallel_optimizer_config.optimizer_weight_shard_size", size,
                          f"must divide the optimizer-parallel group data_parallel x context_parallel = {group}",
                          f"use -1 (whole group) or one of {_divisors(group)}")
