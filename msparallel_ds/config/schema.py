"""ParallelConfig: one validated, immutable object; every field keeps MindFormers' meaning and name.

The sections mirror the YAML (parallel_config, parallel, recompute_config, runner_config, runner_wrapper,
optimizer, lr_schedule, model.model_config) so a validation error's location is the YAML key path.
Cross-field rules live in rules.py; turning YAML (legacy, mcore or `parallelism:`) into this shape lives in
mindformers.py.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

# A degree above this is not a cluster anyone runs; it also keeps arithmetic on hostile input bounded.
MAX_DEGREE = 1 << 20
MAX_COUNT = 1 << 40

Degree = Annotated[StrictInt, Field(ge=1, le=MAX_DEGREE)]
Count = Annotated[StrictInt, Field(ge=1, le=MAX_COUNT)]
NonNegCount = Annotated[StrictInt, Field(ge=0, le=MAX_COUNT)]
Number = Annotated[float, Field(allow_inf_nan=False, ge=-1e30, le=1e30)]
PosNumber = Annotated[float, Field(allow_inf_nan=False, gt=0, le=1e30)]
Pattern = Annotated[StrictStr, Field(max_length=1000)]

CP_ALGOS = ("colossalai_cp", "ulysses_cp", "hybrid_cp")
PP_SCHEDULERS = ("gpipe", "1f1b", "seqpipe", "seqvpp", "seqsmartvpp", "zero_bubble_v")
SUPPORTED_PP_SCHEDULERS = ("1f1b", "gpipe", "zero_bubble_v")
SEQ_PP_SCHEDULERS = ("seqpipe", "seqvpp", "seqsmartvpp")  # run as (interleaved) 1F1B: config.rules
PARALLEL_MODES = ("data_parallel", "semi_auto_parallel", "auto_parallel", "hybrid_parallel", "stand_alone")
DTYPES = ("float32", "float16", "bfloat16")


class _Section(BaseModel):
    # Unknown keys in most sections are MindFormers features outside our scope; they are ignored there.
    # parallel_config is the exception (MindFormers itself rejects unknown keys): see ParallelConfigSection.
    model_config = ConfigDict(frozen=True, extra="ignore", populate_by_name=True)


class ParallelConfigSection(_Section):
    """`parallel_config:` (TransformerOpParallelConfig), with MindFormers' defaults."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    data_parallel: Degree = 1
    model_parallel: Degree = 1
    context_parallel: Degree = 1
    expert_parallel: Degree = 1
    pipeline_stage: Degree = 1
    micro_batch_num: Count = 1
    seq_split_num: Count = 1
    use_seq_parallel: StrictBool = False
    optimizer_shard: Optional[StrictBool] = None  # deprecated in MindFormers, no effect
    gradient_aggregation_group: Count = 4
    vocab_emb_dp: StrictBool = True
    context_parallel_algo: Literal["colossalai_cp", "ulysses_cp", "hybrid_cp"] = "colossalai_cp"
    ulysses_degree_in_cp: Degree = 1
    mem_coeff: Number = 0.1


class ParallelOptimizerConfig(_Section):
    optimizer_level: Literal["level1", "level2", "level3"] = "level1"
    gradient_accumulation_shard: StrictBool = False
    parallel_optimizer_threshold: Annotated[StrictInt, Field(ge=0, le=MAX_COUNT)] = 64  # KB
    optimizer_weight_shard_size: Annotated[StrictInt, Field(ge=-1, le=MAX_DEGREE)] = -1


class PipelineConfig(_Section):
    pipeline_interleave: StrictBool = False
    pipeline_scheduler: Literal["gpipe", "1f1b", "seqpipe", "seqvpp", "seqsmartvpp", "zero_bubble_v"] = "1f1b"


class ParallelSection(_Section):
    """`parallel:` (MindSpore auto-parallel context)."""

    parallel_mode: Literal["data_parallel", "semi_auto_parallel", "auto_parallel", "hybrid_parallel",
                           "stand_alone"] = "semi_auto_parallel"
    gradients_mean: StrictBool = False
    enable_alltoall: StrictBool = False
    full_batch: StrictBool = True
    enable_parallel_optimizer: StrictBool = False
    parallel_optimizer_config: ParallelOptimizerConfig = ParallelOptimizerConfig()
    pipeline_config: PipelineConfig = PipelineConfig()
    strategy_ckpt_save_file: Optional[Pattern] = None
    strategy_ckpt_load_file: Optional[Pattern] = None
    strategy_ckpt_config: Optional[dict[str, Any]] = None


RecomputeValue = Union[StrictBool, list[StrictInt], list[list[StrictInt]], list[Pattern],
                       dict[Pattern, Union[StrictBool, list[StrictInt], list[list[StrictInt]]]]]


class LayerSwap(_Section):
    """One `swap_config.layer_swap` entry: these decoder layers keep their activations on the host."""

    layers: Union[StrictBool, list[NonNegCount], list[list[NonNegCount]]] = True
    backward_prefetch: Count = 1


class SwapConfig(_Section):
    """`swap_config:` (MindFormers' activation swap; tools/check_rules.py _check_swap): swap on, the layers whose
    activations go to the host, per-operator swap, prefetch distance."""

    swap: StrictBool = False
    default_prefetch: Annotated[StrictInt, Field(le=MAX_COUNT)] = 1  # >= 1 when swap is on (config.rules)
    layer_swap: Optional[list[LayerSwap]] = None
    op_swap: Optional[dict[str, Any]] = None


class RecomputeConfig(_Section):
    """`recompute_config:`: bool, a per-stage layer count list, or submodule patterns (optionally per stage)."""

    recompute: RecomputeValue = False
    select_recompute: RecomputeValue = False
    select_comm_recompute: RecomputeValue = False
    parallel_optimizer_comm_recompute: StrictBool = False
    mp_comm_recompute: StrictBool = True
    recompute_slice_activation: StrictBool = False
    # MindFormers 2.1 `recompute:` (config.parallelism): `recompute` / `select_recompute` hold layer ids, which the
    # plan turns into per-stage counts of leading layers
    by_layer_id: StrictBool = False


class RunnerConfig(_Section):
    batch_size: Count = 1
    gradient_accumulation_steps: Count = 1
    epochs: Optional[NonNegCount] = None
    sink_mode: Optional[StrictBool] = None
    sink_size: Optional[Annotated[StrictInt, Field(ge=-1, le=MAX_COUNT)]] = None


class LossScale(_Section):
    """runner_wrapper.scale_sense: a number (static scale) or a DynamicLossScaleUpdateCell/FixedLossScaleUpdateCell."""

    kind: Literal["static", "dynamic"] = "static"
    value: PosNumber = 1.0
    factor: PosNumber = 2.0
    window: Count = 1000


class RunnerWrapper(_Section):
    type: Optional[Pattern] = None
    scale_sense: LossScale = LossScale()
    use_clip_grad: StrictBool = False
    max_grad_norm: PosNumber = 1.0


class OptimizerConfig(_Section):
    type: Pattern = "AdamW"
    swap: StrictBool = False  # MindFormers' optimizer state on the host (core/optim/adamw.py) -> DeepSpeed offload
    learning_rate: Optional[Number] = None
    betas: Optional[tuple[Number, Number]] = None  # 2.x spelling (AdamW)
    beta1: Optional[Number] = None  # 1.x spelling (AdamWeightDecay family)
    beta2: Optional[Number] = None
    eps: Optional[Number] = None
    weight_decay: Optional[Number] = None
    use_fused: StrictBool = False  # 2.x AdamW/PmaAdamW: the fused kernel, same maths
    # PmaAdamW / FusedPmaAdamW (2.x core/optim/pma_adamw.py): weight fusion every interleave_step steps
    fused_num: Optional[Count] = None
    interleave_step: Optional[Count] = None
    fused_algo: Optional[Literal["ema", "sma"]] = None
    ema_alpha: Optional[Number] = None
    # Muon (2.1 core/optim/muon.py; the deepseek4 configs)
    matched_adamw_rms: Optional[Number] = None
    momentum: Optional[Number] = None
    nesterov: Optional[StrictBool] = None
    adamw_betas: Optional[tuple[Number, Number]] = None
    adamw_eps: Optional[Number] = None
    # ns_steps / ns_coefficients / comm_strategy: unread by 2.1's core muon.py (optim.muon warns); the pynative Muon
    # (`parallelism:` YAMLs) reads them and eps / adamw_include / use_fused_adamw (optim.muon_pynative)
    ns_steps: Optional[Count] = None
    ns_coefficients: Optional[list[Any]] = None
    comm_strategy: Optional[str] = None
    adamw_include: Optional[Union[str, list[str]]] = None
    use_fused_adamw: Optional[StrictBool] = None
    qk_clip_enabled: Optional[StrictBool] = None
    qk_clip_threshold: Optional[Number] = None


class LrSchedule(_Section):
    """`lr_schedule:` with every field MindFormers' schedules read (core/lr/lr_schedule.py)."""

    type: Pattern = "ConstantWarmUpLR"
    learning_rate: Optional[Number] = None
    lr_end: Optional[Number] = None
    warmup_ratio: Optional[Number] = None
    warmup_steps: Optional[NonNegCount] = None
    warmup_lr_init: Optional[Number] = None
    total_steps: Optional[Annotated[StrictInt, Field(ge=-1, le=MAX_COUNT)]] = None
    num_cycles: Optional[Number] = None
    power: Optional[Number] = None
    decay_steps: Optional[NonNegCount] = None
    decay_ratio: Optional[Number] = None
    keep_steps: Optional[NonNegCount] = None  # ConstantWithCoolDownLR
    final_steps: Optional[NonNegCount] = None
    lr_end1: Optional[Number] = None
    lr_end2: Optional[Number] = None
    decay_start_steps: Optional[NonNegCount] = None  # WarmUpStableDecayLR
    decay_start_ratio: Optional[Number] = None
    base_lr: Optional[Number] = None  # CosineAnnealingLR / CosineAnnealingWarmRestarts
    t_max: Optional[Count] = None
    t_0: Optional[Count] = None
    t_mult: Optional[Count] = None
    eta_min: Optional[Number] = None


class GroupedLr(LrSchedule):
    params: list[Pattern] = []  # parameter name patterns (substring or fnmatch) that follow this schedule


class GroupedLrSchedule(_Section):
    """2.x `grouped_lr_schedule:` (trainer/base_trainer.py): `default` for the rest, `grouped` per name pattern."""

    default: LrSchedule
    grouped: list[GroupedLr] = []


Offset = Union[StrictInt, list[StrictInt], list[list[StrictInt]]]


class ModelShape(_Section):
    """The parts of `model.model_config` that parallelism depends on (legacy and mcore/HF spellings)."""

    fine_grain_interleave: Degree = 1
    use_ring_attention: StrictBool = False
    use_flash_attention: StrictBool = False
    pp_interleave_num: Degree = 1
    offset: Offset = 0
    num_layers: Optional[Count] = None
    mtp_depth: Annotated[StrictInt, Field(ge=0, le=MAX_DEGREE)] = 0  # multi-token-prediction layers (pipelined too)
    num_heads: Optional[Count] = None
    n_kv_heads: Optional[Count] = None
    hidden_size: Optional[Count] = None
    ffn_hidden_size: Optional[Count] = None
    seq_length: Optional[Count] = None
    vocab_size: Optional[Count] = None
    # Multi-head Latent Attention (DeepSeek-V2/V3; on when kv_lora_rank is set): model_params.py counts it
    q_lora_rank: Optional[NonNegCount] = None  # None / 0: q is one projection (no low-rank query)
    kv_lora_rank: Optional[Count] = None
    qk_rope_head_dim: Optional[Count] = None
    qk_nope_head_dim: Optional[Count] = None
    v_head_dim: Optional[Count] = None
    mtp_loss_factor: Optional[Number] = None  # reported in the plan's notes only
    # DeepSeek-V4's lightning-indexer KL loss (models/deepseek4_indexer.py); 0 / unset: off
    dsa_indexer_loss_coeff: Optional[Annotated[float, Field(allow_inf_nan=False, ge=0, le=1e30)]] = None
    # the block's structure beyond the Llama shape (config/model_traits.py reads it per family; model_params.py counts)
    head_dim: Optional[Count] = None  # None: hidden_size / num_heads
    qkv_bias: StrictBool = False
    qk_norm: StrictBool = False  # per-head q/k norms
    post_norms: StrictBool = False  # two more norms per layer (after attention and after the MLP)
    gated_mlp: StrictBool = True  # gate/up/down (SwiGLU); False: fc -> act -> proj
    linear_bias: StrictBool = False  # every projection and norm has a bias (LayerNorm)
    position_embeddings: Optional[Count] = None  # rows of a learned position table
    tie_word_embeddings: StrictBool = False
    compute_dtype: Literal["float32", "float16", "bfloat16"] = "float16"
    param_init_type: Literal["float32", "float16", "bfloat16"] = "float32"

    @property
    def kv_heads(self) -> Optional[int]:
        return self.n_kv_heads or self.num_heads


class ParallelismSource(_Section):
    """What MindFormers 2.1's `parallelism:` said that the plan resolves against the world size
    (config.parallelism has the meanings)."""

    data_parallel_replicate: Degree = 1
    replicate_written: StrictBool = False  # data_parallel_replicate given: dp = shard x replicate, not from the world
    data_parallel_shard: Annotated[StrictInt, Field(ge=-1, le=MAX_DEGREE)] = -1
    cpu_offload: StrictBool = False  # FSDP parameters on the host (MindFormers pynative) -> ZeRO-3 offload_param
    reshard_after_forward_policy: Literal["default", "always", "never"] = "default"
    disable_gradient_division: StrictBool = True
    dense_fsdp_shard_size: Optional[Degree] = None  # dense weights sharded over this many ranks (hpZ), experts not
    pipeline_parallel_layers_per_stage: Optional[Union[Literal["auto"], list[Pattern]]] = None


class TrainingSection(_Section):
    """MindFormers 2.1 `training:` (pynative/config TrainingConfig; defaults as there)."""

    steps: Count = 1000
    local_batch_size: Count = 1
    global_batch_size: Optional[Count] = None  # None: data_parallel x local_batch_size (no accumulation)
    max_norm: Annotated[float, Field(allow_inf_nan=False, ge=0, le=1e30)] = 1.0  # > 0: clip to this global norm


class ParallelConfig(_Section):
    """Everything msparallel_ds needs from a MindFormers YAML, validated and immutable."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    parallel_config: ParallelConfigSection = ParallelConfigSection()
    parallel: ParallelSection = ParallelSection()
    micro_batch_interleave_num: Degree = 1
    use_parallel: StrictBool = True
    use_legacy: StrictBool = True  # False: MindFormers 2.x mcore models (their pipeline offsets exclude MTP layers)
    pretrained_model_dir: Optional[str] = None  # where a 2.x YAML takes the model (HF config) from; not read by plan
    recompute_config: RecomputeConfig = RecomputeConfig()
    swap_config: SwapConfig = SwapConfig()
    runner_config: RunnerConfig = RunnerConfig()
    runner_wrapper: RunnerWrapper = RunnerWrapper()
    optimizer: Optional[OptimizerConfig] = None
    lr_schedule: Optional[LrSchedule] = None
    grouped_lr_schedule: Optional[GroupedLrSchedule] = None
    model: ModelShape = ModelShape()
    # Set when the YAML used the `parallelism:` schema (MindFormers 2.1) instead of parallel_config.
    parallelism: Optional[ParallelismSource] = None
    training: Optional[TrainingSection] = None  # MindFormers 2.1 `training:` (with `parallelism:` only)
    source: Optional[str] = None
    # moe.settings.MoESettings read from `moe_config:` / the mcore model_config MoE keys by config.moe (never from
    # the YAML directly); None when the YAML describes no experts
    moe: Optional[Any] = None
    pet: Optional[Any] = None  # config.pet.LoraSettings from model.model_config.pet_config; None: every weight trains

    # Short names used across the package.
    @property
    def dp(self) -> int:
        return self.parallel_config.data_parallel

    @property
    def tp(self) -> int:
        return self.parallel_config.model_parallel

    @property
    def cp(self) -> int:
        return self.parallel_config.context_parallel

    @property
    def pp(self) -> int:
        return self.parallel_config.pipeline_stage

    @property
    def pipeline_layers(self) -> Optional[int]:
        """Layers the pipeline offsets split: the legacy models count MTP layers with the decoder layers; mcore
        (use_legacy: false) places MTP on the last stage and excludes it (LayerSetting, transformer/utils.py)."""
        n = self.model.num_layers
        if n is None:
            return None
        return n + self.model.mtp_depth if self.use_legacy else n

    @property
    def ep(self) -> int:
        return self.parallel_config.expert_parallel

    @property
    def cp_algo(self) -> str:
        return self.parallel_config.context_parallel_algo

    def key(self, field: str) -> str:
        """The YAML key path a user wrote for a field (differs for the `parallelism:` schema)."""
        if self.parallelism is not None and field in PARALLELISM_KEYS:
            return PARALLELISM_KEYS[field]
        return field


# parallel_config key -> `parallelism:` key, for error messages about files in the newer schema.
PARALLELISM_KEYS = {
    "parallel_config.data_parallel": "parallelism.data_parallel_shard",
    "parallel_config.model_parallel": "parallelism.tensor_parallel",
    "parallel_config.context_parallel": "parallelism.context_parallel",
    "parallel_config.context_parallel_algo": "parallelism.context_parallel_method",
    "parallel_config.ulysses_degree_in_cp": "parallelism.ulysses_degree_in_cp",
    "parallel_config.pipeline_stage": "parallelism.pipeline_parallel",
    "parallel_config.use_seq_parallel": "parallelism.sequence_parallel",
    "parallel_config.expert_parallel": "parallelism.expert_parallel",
    "parallel_config.micro_batch_num": "parallelism.micro_batch_num",
    "model.model_config.pp_interleave_num": "parallelism.pipeline_parallel_interleave_num",
    "parallel.pipeline_config.pipeline_scheduler": "parallelism.pipeline_parallel_schedule",
}
