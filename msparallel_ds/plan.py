"""Plan: a pure function of (ParallelConfig, world_size). No torch.distributed here: it runs on a laptop.

It derives what every later layer needs: mesh sizes in DESIGN.md's rank order, the context-parallel algorithm,
MindFormers' batch arithmetic, the ZeRO stage, the pipeline schedule, the recompute plan, precision, clipping,
and (when the model shape is known) a per-rank memory estimate (see memory.py for the formula).
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Optional

from .config.errors import ConfigError, ConfigIssue
from .config.rules import layers_per_stage, ulysses_degree, virtual_stages
from .config.schema import ParallelConfig
from .memory import MemoryEstimate, estimate_memory, missing_shape_note, shape_notes
from .moe.plan import expert_data_parallel, moe_notes
from .optim_plan import activation_offload_entry, lr_schedule_entry, optimizer_entry
from .plan_pynative import pynative_batch, pynative_layers, pynative_zero
from .plan_recompute import RecomputePlan, recompute_plan

DTYPE_SHORT = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}


@dataclass(frozen=True)
class Mesh:
    """Mesh sizes, outermost first: pp, dp, cp_ring, cp_ulysses, tp (cp = cp_ring x cp_ulysses)."""

    pp: int
    dp: int
    cp_ring: int
    cp_ulysses: int
    tp: int

    @property
    def cp(self) -> int:
        return self.cp_ring * self.cp_ulysses

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.pp, self.dp, self.cp_ring, self.cp_ulysses, self.tp)

    names = ("pp", "dp", "cp_ring", "cp_ulysses", "tp")

    def __getitem__(self, name: str) -> int:
        if name == "dp_cp":
            return self.dp * self.cp
        return getattr(self, name)

    def as_dict(self) -> dict[str, int]:
        return {"pp": self.pp, "dp": self.dp, "cp": self.cp, "cp_ring": self.cp_ring,
                "cp_ulysses": self.cp_ulysses, "tp": self.tp}


@dataclass(frozen=True)
class ZeroPlan:
    stage: int
    group_size: int  # ranks the optimizer state is sharded over (dp x cp)
    hpz_partition_size: Optional[int] = None  # optimizer_weight_shard_size, when it is a real sub-group
    offload_optimizer: bool = False  # optimizer.swap: Adam state and the update on the host (DeepSpeed offload)
    offload_param: bool = False  # parallelism.cpu_offload: ZeRO-3 parameter partitions on the host
    reduce_bucket_size: int = 500_000_000
    param_persistence_threshold: Optional[int] = None  # elements; from parallel_optimizer_threshold (KB)
    overlap_comm: bool = True
    reshard_after_forward: bool = True  # ZeRO-3: parameters re-partitioned after forward (parallelism: policy)
    downgrade: Optional[str] = None  # why the YAML's ZeRO-3 runs as ZeRO-2 (warned by msp.initialize)


@dataclass(frozen=True)
class LossScalePlan:
    kind: Optional[str]  # "dynamic" | "static" | None (bf16 / fp32: no scaling)
    initial: float = 1.0
    factor: float = 2.0
    window: int = 1000


@dataclass(frozen=True)
class Plan:
    config: ParallelConfig
    world_size: int
    mesh: Mesh
    expert_parallel: int
    cp_algo: Optional[str]
    sequence_parallel: bool
    vocab_parallel: bool
    micro_batch_size: int
    micro_batch_num: int
    gradient_accumulation_steps: int
    micro_batch_interleave_num: int
    fine_grain_interleave: int
    global_batch_size: int
    zero: ZeroPlan
    pp_schedule: Optional[str]
    pp_virtual_stages: int
    layers_per_stage: Optional[list[list[int]]]
    recompute: RecomputePlan
    compute_dtype: str
    param_dtype: str
    loss_scale: LossScalePlan
    gradient_clipping: Optional[float]
    optimizer: Optional[dict[str, Any]]
    lr_schedule: Optional[dict[str, Any]]
    memory: Optional[MemoryEstimate]
    notes: tuple[str, ...] = ()
    activation_offload: Any = None  # swap_config / cpu_offloading: "all" or the decoder layers whose activations
                                    # are kept on the host between forward and backward
    moe: Any = None  # moe.settings.MoESettings (None: the YAML sets no MoE keys)
    expert_data_parallel: int = 1  # edp = dp x cp x tp / expert_parallel (moe/plan.py)
    train_steps: Optional[int] = None  # training.steps (MindFormers 2.1 `training:`)

    @property
    def zero_stage(self) -> int:
        return self.zero.stage

    def as_dict(self) -> dict[str, Any]:
        return {
            "world_size": self.world_size,
            "mesh": self.mesh.as_dict(),
            "expert_parallel": self.expert_parallel, "expert_data_parallel": self.expert_data_parallel,
            "moe": self.moe.as_dict() if self.moe is not None else None,
            "global_batch_size": self.global_batch_size,
            "micro_batch_size": self.micro_batch_size,
            "gradient_accumulation_steps": self.gradient_accumulation_steps,
            "micro_batch_num": self.micro_batch_num,
            "micro_batch_interleave_num": self.micro_batch_interleave_num,
            "fine_grain_interleave": self.fine_grain_interleave,
            "zero_stage": self.zero.stage,
            "zero": asdict(self.zero),
            "cp_algo": self.cp_algo,
            "sequence_parallel": self.sequence_parallel,
            "vocab_parallel": self.vocab_parallel,
            "pp_schedule": self.pp_schedule,
            "pp_virtual_stages": self.pp_virtual_stages,
            "layers_per_stage": self.layers_per_stage,
            "recompute": self.recompute.as_dict(),
            "compute_dtype": self.compute_dtype,
            "param_dtype": self.param_dtype,
            "loss_scale": asdict(self.loss_scale),
            "gradient_clipping": self.gradient_clipping,
            "train_steps": self.train_steps,
            "optimizer": self.optimizer,
            "lr_schedule": self.lr_schedule,
            "memory": self.memory.as_dict() if self.memory else None,
            "activation_offload": list(self.activation_offload) if isinstance(self.activation_offload, tuple)
            else self.activation_offload,
            "notes": list(self.notes),
        }

    def to_json(self) -> str:
        return json.dumps(self.as_dict(), indent=2)

    def summary(self) -> str:
        from .summary import render_summary

        return render_summary(self)

    def to_deepspeed(self, **kwargs) -> dict[str, Any]:
        from .export.deepspeed import to_deepspeed

        return to_deepspeed(self, **kwargs)

    def to_accelerate(self, **kwargs) -> dict[str, Any]:
        from .export.accelerate import to_accelerate

        return to_accelerate(self, **kwargs)


def make_plan(cfg: ParallelConfig | Any, world_size: Optional[int] = None, *, report: bool = False) -> Plan:
    """Derive the Plan. `cfg` may be a ParallelConfig or anything load_config accepts. `report` (the `plan`
    command): a global batch that a run refuses becomes a note and the nearest valid batch is planned."""
    if not isinstance(cfg, ParallelConfig):
        from .config.mindformers import load_config

        cfg = load_config(cfg)
    notes: list[str] = []
    mesh = _mesh(cfg, world_size, notes)
    world = math.prod(mesh.shape)
    tp, pp = mesh.tp, mesh.pp
    vpp = virtual_stages(cfg)
    mbi = cfg.micro_batch_interleave_num
    bs = cfg.runner_config.batch_size
    if pp > 1:
        mbn, gas = cfg.parallel_config.micro_batch_num, 1
        global_batch = bs * mesh.dp * mbn * mbi
    else:
        mbn, gas = 1, cfg.runner_config.gradient_accumulation_steps
        global_batch = bs * mesh.dp * mbi * gas
    pynative = pynative_batch(cfg, mesh.dp, pp, notes if report else None)  # MindFormers 2.1 `training:`
    if pynative is not None:
        mbn, gas, global_batch = pynative
    sp = cfg.parallel_config.use_seq_parallel and tp > 1
    if cfg.parallel_config.use_seq_parallel and tp == 1:
        notes.append("use_seq_parallel has no effect with model_parallel=1")
    fgi = cfg.model.fine_grain_interleave if tp > 1 else 1
    n_layers = cfg.pipeline_layers
    layers = layers_per_stage(n_layers, pp, vpp, cfg.model.offset) if n_layers is not None else None
    layers = pynative_layers(cfg, n_layers, pp, vpp) or layers
    zero = _zero(cfg, mesh, notes)
    recompute = recompute_plan(cfg, pp, vpp, layers)
    clip = cfg.runner_wrapper.max_grad_norm if cfg.runner_wrapper.use_clip_grad else None
    if cfg.training is not None:  # MindFormers 2.1: training.max_norm > 0 clips (default 1.0)
        clip = cfg.training.max_norm or None
    plan = Plan(
        config=cfg, world_size=world, mesh=mesh, expert_parallel=cfg.ep, cp_algo=_cp_algo(cfg),
        sequence_parallel=sp, vocab_parallel=tp > 1 and (not cfg.parallel_config.vocab_emb_dp or pp > 1),
        micro_batch_size=bs, micro_batch_num=mbn, gradient_accumulation_steps=gas, micro_batch_interleave_num=mbi,
        fine_grain_interleave=fgi, global_batch_size=global_batch, zero=zero,
        pp_schedule=_pp_schedule(cfg, pp, vpp), pp_virtual_stages=vpp if pp > 1 else 1, layers_per_stage=layers,
        recompute=recompute, compute_dtype=DTYPE_SHORT[cfg.model.compute_dtype],
        param_dtype=DTYPE_SHORT[cfg.model.param_init_type], loss_scale=_loss_scale(cfg, notes),
        gradient_clipping=clip, train_steps=cfg.training.steps if cfg.training is not None else None,
        optimizer=optimizer_entry(cfg), lr_schedule=lr_schedule_entry(cfg), memory=None, notes=(),
        activation_offload=activation_offload_entry(cfg, notes), moe=cfg.moe,
        expert_data_parallel=expert_data_parallel(cfg, mesh),
    )
    notes += moe_notes(cfg, mesh) + shape_notes(cfg)
    if cfg.parallel.parallel_mode in ("auto_parallel", "hybrid_parallel"):
        notes.append(f"parallel_mode={cfg.parallel.parallel_mode}: the parallel_config degrees are used as given")
    memory = estimate_memory(plan)
    if memory is None and missing_shape_note(cfg):
        notes.append(missing_shape_note(cfg))
    return replace(plan, memory=memory, notes=tuple(notes))


def _mesh(cfg: ParallelConfig, world_size: Optional[int], notes: list[str]) -> Mesh:
    if world_size is not None and (not isinstance(world_size, int) or isinstance(world_size, bool)
                                   or world_size < 1):
        raise ConfigError([ConfigIssue("world_size", world_size, "must be a positive whole number",
                                       "pass the number of processes, e.g. --world-size 8")])
    tp, cp, pp = cfg.tp, cfg.cp, cfg.pp
    u = ulysses_degree(cfg)
    dp = cfg.dp
    derived = _dp_from_world(cfg)
    if derived is not None:
        others = tp * cp * pp * derived[1]
        if world_size is None:
            notes.append(f"{derived[0]}: data parallel degree comes from the world size; pass --world-size "
                         f"(planned for {dp * tp * cp * pp} device(s))")
        elif world_size % others != 0:
            raise ConfigError([ConfigIssue(derived[0], "auto", f"cannot fill world_size={world_size}: it is not a "
                                           f"multiple of the other degrees' product {others}",
                                           f"use a world size that is a multiple of {others}")])
        else:
            dp = world_size // (tp * cp * pp)
    product = dp * tp * cp * pp
    if world_size is not None and world_size != product:
        k = cfg.key
        names = (f"{k('parallel_config.data_parallel')} x {k('parallel_config.model_parallel')} x "
                 f"{k('parallel_config.context_parallel')} x {k('parallel_config.pipeline_stage')}")
        fix = (f"set data_parallel to {world_size // (tp * cp * pp)}" if world_size % (tp * cp * pp) == 0
               else f"launch {product} processes or change the degrees")
        raise ConfigError([ConfigIssue("world_size", world_size,
                                       f"does not equal {names} = {dp}x{tp}x{cp}x{pp} = {product}", fix)])
    return Mesh(pp=pp, dp=dp, cp_ring=cp // u, cp_ulysses=u, tp=tp)


def _dp_from_world(cfg: ParallelConfig) -> Optional[tuple[str, int]]:
    """(key, fixed factor) when MindFormers takes the data-parallel degree from the device count."""
    src = cfg.parallelism
    if src is not None and (src.data_parallel_shard == -1 or not src.replicate_written):
        # MindFormers 2.1: data_parallel = world // (tensor x context x pipeline); the shard degree splits it
        return "parallelism.data_parallel_shard", 1
    if cfg.use_parallel and cfg.parallel.parallel_mode == "data_parallel":
        return "parallel.parallel_mode", 1
    return None


def _cp_algo(cfg: ParallelConfig) -> Optional[str]:
    if cfg.cp == 1:
        return None
    algo = cfg.parallel_config.context_parallel_algo
    if algo == "colossalai_cp":
        return "ring" if cfg.model.use_ring_attention else "allgather"
    return {"ulysses_cp": "ulysses", "hybrid_cp": "hybrid"}[algo]


def _zero(cfg: ParallelConfig, mesh: Mesh, notes: list[str]) -> ZeroPlan:
    par = cfg.parallel
    poc = par.parallel_optimizer_config
    group = mesh.dp * mesh.cp
    stage = 0
    if par.enable_parallel_optimizer:
        stage = {"level1": 1, "level2": 2, "level3": 3}[poc.optimizer_level]
        if poc.gradient_accumulation_shard:
            stage = max(stage, 2)
        if group == 1:
            notes.append("enable_parallel_optimizer with data_parallel x context_parallel = 1: nothing to shard")
    hpz = None
    size = poc.optimizer_weight_shard_size
    if stage and 1 < size < group:
        if stage == 3:
            hpz = size
        else:
            notes.append(f"optimizer_weight_shard_size={size}: DeepSpeed ZeRO-{stage} shards over the whole "
                         f"dp x cp group ({group}); a sub-group (hpZ) exists only at ZeRO-3")
    bucket = 500_000_000
    params = _params_per_rank(cfg, mesh)
    if params:
        bucket = max(1_000_000, math.ceil(params / cfg.parallel_config.gradient_aggregation_group))
    threshold = None
    if stage == 3:
        threshold = poc.parallel_optimizer_threshold * 1024 // (4 if cfg.model.param_init_type == "float32" else 2)
    swap = cfg.optimizer is not None and cfg.optimizer.swap
    if swap and stage == 0:
        stage = 1  # DeepSpeed offloads the optimizer of its ZeRO engines only
        notes.append("optimizer.swap without parallel.enable_parallel_optimizer: ZeRO-1 over data_parallel x "
                     f"context_parallel = {group} carries the host (CPU) offload of the optimizer state")
    downgrade, reshard = None, True
    if cfg.parallelism is not None:
        stage, hpz, downgrade, reshard = pynative_zero(cfg, mesh.dp, mesh.cp, cfg.ep, stage, params, notes)
    offload_param = cfg.parallelism is not None and cfg.parallelism.cpu_offload
    if offload_param and stage != 3:
        offload_param = False
        notes.append("parallelism.cpu_offload offloads sharded parameters (data_parallel_shard > 1, ZeRO-3); ignored")
    return ZeroPlan(stage=stage, group_size=group, hpz_partition_size=hpz, reduce_bucket_size=bucket,
                    param_persistence_threshold=threshold, overlap_comm=stage > 0, offload_optimizer=swap,
                    offload_param=offload_param, reshard_after_forward=reshard, downgrade=downgrade)


def _params_per_rank(cfg: ParallelConfig, mesh: Mesh) -> Optional[int]:
    from .memory import param_counts

    counts = param_counts(cfg)
    if counts is None:
        return None
    per_layer, embed = counts
    layers = math.ceil(cfg.model.num_layers / mesh.pp)
    return (layers * per_layer + embed) // mesh.tp


def _pp_schedule(cfg: ParallelConfig, pp: int, vpp: int) -> Optional[str]:
    if pp == 1:
        return None
    sched = cfg.parallel.pipeline_config.pipeline_scheduler
    if sched in ("1f1b", "seqpipe", "seqvpp", "seqsmartvpp"):  # the seq* schedulers run as 1F1B (config.rules)
        return "interleaved_1f1b" if vpp > 1 else "1f1b"
    if sched == "gpipe":
        return "looped_bfs" if vpp > 1 else "gpipe"
    return sched


def _loss_scale(cfg: ParallelConfig, notes: list[str]) -> LossScalePlan:
    ls = cfg.runner_wrapper.scale_sense
    if cfg.model.compute_dtype != "float16":
        if ls.kind == "dynamic" or ls.value != 1.0:
            notes.append(f"loss scaling ({ls.kind}, {ls.value:g}) is not needed with "
                         f"{cfg.model.compute_dtype} compute; DeepSpeed bf16/fp32 runs unscaled")
        return LossScalePlan(kind=None)
    if ls.kind == "dynamic":
        if ls.factor != 2:
            notes.append(f"scale_factor={ls.factor:g}: DeepSpeed's dynamic loss scaler always uses 2")
        if math.log2(ls.value) != round(math.log2(ls.value)):
            notes.append(f"loss_scale_value={ls.value:g} starts at 2^{round(math.log2(ls.value))} in DeepSpeed "
                         "(initial scales are powers of two)")
    return LossScalePlan(kind=ls.kind, initial=ls.value, factor=ls.factor, window=ls.window)
