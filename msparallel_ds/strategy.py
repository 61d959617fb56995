"""parallelize: the YAML's strategy applied to one model part, in one place and one order, for every engine.

A part is a whole HF causal LM (msp.parallelize, the DeepSpeed engine, accelerate, the Trainer) or one pipeline
stage/chunk cut from it first (the pipeline engine calls this once per chunk). The order:
1. tensor / sequence / vocab parallel (replaces Linear / Embedding modules by the adapter's TP plan), then expert
   parallel (a MoE layer's experts cut to this rank's E/ep and run through the all-to-all dispatch: moe/);
2. context-parallel attention (an attention-function switch, no module change);
3. recompute (wraps the forwards of the final modules; per pipeline stage and chunk), then activation offload of
   the swap_config layers (wraps their forwards too);
4. multi-copy / fine-grain interleave (the part's decoder layers run through the interleave runner).
It returns `Applied`, a small record of what was done (the shard spec among it), which the engine holds.

(The module is not named `parallelize`: a submodule of that name would replace the function `msp.parallelize` as
an attribute of the package as soon as it is imported.)
"""
from __future__ import annotations

import dataclasses
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any, Optional

from torch import nn

from .distributed.layout import ParallelLayout
from .models import DecoderAdapter, adapter_for
from .tensor_parallel.spec import ShardSpec

__all__ = ["Applied", "Interleave", "Options", "applied_to", "combine", "parallelize", "parallelize_part"]


@dataclass(frozen=True)
class Interleave:
    """micro_batch_interleave_num (copies), fine_grain_interleave (chunks per layer) and how copies' losses add."""

    copies: int = 1
    fine_grain: int = 1
    copy_loss: str = "mean"

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


DEFAULT_MTP_SCALE = 0.3  # MindFormers' mtp_loss_factor default (research/deepseek3 deepseek3_config.py)


@dataclass(frozen=True)
class Options:
    """What to apply; `Options.from_plan(layout.plan)` is the YAML's, overrides come through dataclasses.replace."""

    sequence_parallel: bool = False
    vocab_parallel: bool = False
    cp_algo: Optional[str] = None
    cp_backend: Optional[str] = None
    recompute: Any = None              # a Plan.recompute
    activation_offload: Any = None     # a Plan.activation_offload: "all" or global layer indices
    interleave: Interleave = field(default_factory=Interleave)
    capacity: Any = None               # moe.capacity rule (None: dropless)
    aux_loss: Optional[dict] = None    # AuxLoss fields (coeff, scope, z_coeff, forwards_per_step) (moe.aux_loss)
    expert_bias_rate: Optional[float] = None  # aux-loss-free balancing's update rate (moe.expert_bias); None: off
    mtp_depth: int = 0                 # multi-token-prediction layers (models.mtp); 0: off
    mtp_scale: float = 0.0             # mtp_loss_scaling_factor
    mtp_legacy: bool = False           # MindFormers' legacy MTP: pre-norm hidden, [hnorm(h), enorm(emb)]
    indexer_loss_coeff: float = 0.0    # dsa_indexer_loss_coeff: DeepSeek-V4's indexer loss (adapter.install_losses)

    @classmethod
    def from_plan(cls, plan: Any) -> Options:
        get = lambda name, default: getattr(plan, name, default)  # noqa: E731 - a bare plan stand-in is fine
        moe, capacity = get("moe", None), None
        if moe is not None and moe.capacity_factor:
            from .moe.capacity import Capacity

            # legacy MindFormers rounds the capacity up to a multiple of model_parallel
            round_to = plan.mesh.tp if moe.source == "moe_config" else 1
            capacity = Capacity(moe.capacity_factor, moe.drop_policy, round_to)
        forwards = get("micro_batch_num", 1) * get("gradient_accumulation_steps", 1) * \
            get("micro_batch_interleave_num", 1)  # per router and step (gbs_aux_loss accumulates over them)
        aux = (None if moe is None else {"coeff": moe.aux_loss_coeff, "scope": moe.aux_loss_scope,
                                          "z_coeff": moe.z_loss_coeff, "forwards_per_step": forwards})
        bias = None if moe is None or not moe.expert_bias else moe.bias_update_rate_or_default
        model, mtp = getattr(getattr(plan, "config", None), "model", None), {}
        if model is not None and model.mtp_depth:
            scale = DEFAULT_MTP_SCALE if model.mtp_loss_factor is None else float(model.mtp_loss_factor)
            mtp = dict(mtp_depth=model.mtp_depth, mtp_scale=scale, mtp_legacy=plan.config.use_legacy)
        indexer = float(getattr(model, "dsa_indexer_loss_coeff", None) or 0.0)
        return cls(capacity=capacity, aux_loss=aux, expert_bias_rate=bias, **mtp, indexer_loss_coeff=indexer,
                   sequence_parallel=bool(get("sequence_parallel", False)),
                   vocab_parallel=bool(get("vocab_parallel", False)), cp_algo=get("cp_algo", None),
                   recompute=get("recompute", None), activation_offload=get("activation_offload", None),
                   interleave=Interleave(get("micro_batch_interleave_num", 1), get("fine_grain_interleave", 1)))


@dataclass(frozen=True)
class Applied:
    """What parallelize applied to a part: the adapter, the TP plan and its shard spec, the effective SP / vocab /
    cp settings, the recomputed modules ({global layer index: [submodule names]}, '' = the whole layer) and the
    interleave (None when off)."""

    layout: ParallelLayout
    adapter: Optional[DecoderAdapter]  # None: a model family without an adapter, run with dp / ZeRO / cp only
    tp_plan: dict[str, str]
    spec: ShardSpec                    # tp and ep splits
    sequence_parallel: bool
    vocab_parallel: bool
    cp_algo: Optional[str]
    recompute: dict[str, list[str]]
    interleave: Optional[Interleave]
    offloaded: tuple[str, ...] = ()  # decoder layers whose activations are kept on the host (swap_config)
    ep_plan: dict[str, str] = field(default_factory=dict)  # MoE experts split over ep ({} when ep == 1)
    aux_loss: Any = None  # moe.aux_loss.AuxLoss when the YAML sets a load-balancing or z loss
    expert_bias: Any = None  # moe.expert_bias.ExpertBias when the YAML turns on aux-loss-free balancing
    mtp: Any = None  # models.mtp.MultiTokenPrediction when the YAML sets MTP layers

    def output_head(self, part: nn.Module) -> Optional[nn.Module]:
        """The part's output head (vocab-parallel under vocab_emb_dp: false), for the engines' loss."""
        return self.adapter.output_head(part) if self.adapter is not None else part.get_output_embeddings()


def _adapter(part: nn.Module, needed: bool) -> Optional[DecoderAdapter]:
    """The part's family adapter. Data parallel, ZeRO and context parallel need none (cp swaps HF's attention
    function), so a family without one still runs them; tp, recompute and interleave raise the adapter error."""
    try:
        return adapter_for(part)
    except ValueError:
        if needed:
            raise
        return None


def combine(records: list[Applied]) -> Applied:
    """One record for the parts one rank holds (a pipeline rank's chunks): specs and recompute maps merged."""
    first = records[0]
    spec = ShardSpec({n: s for r in records for n, s in r.spec.items()})
    recompute = {k: v for r in records for k, v in r.recompute.items()}
    offloaded = tuple(i for r in records for i in r.offloaded)
    return dataclasses.replace(first, spec=spec, recompute=recompute, offloaded=offloaded)


def parallelize_part(part: nn.Module, layout: ParallelLayout, options: Options, *, stage: int = 0,
                     chunk: int = 0) -> Applied:
    """Apply `options` to `part` in place (see the module docstring) and return what was applied. `stage` and
    `chunk`: the part's pipeline stage and virtual chunk (recompute lists are per stage and chunk)."""
    from .moe.apply import apply_ep
    from .offload import offload_activations
    from .recompute import apply_recompute
    from .tensor_parallel.apply import apply_tp

    tp, ep, inter = layout.size("tp"), layout.size("ep"), options.interleave
    recompute_on = options.recompute is not None and options.recompute.mode != "none"
    interleave_on = inter.copies > 1 or inter.fine_grain > 1 or inter.copy_loss != "mean"
    hf_recompute = recompute_on and options.recompute.mode == "full"  # whole layers: HF's own checkpointing
    adapter = _adapter(part, needed=tp > 1 or ep > 1 or (recompute_on and not hf_recompute) or interleave_on
                       or bool(options.activation_offload))
    if adapter is not None and hasattr(adapter, "check_options"):
        adapter.check_options(layout, options)  # what the family refuses, before anything is sharded
    if options.mtp_depth:
        _add_mtp(part, layout, options.mtp_depth, adapter)
    names = [n for n, _ in part.named_parameters(remove_duplicate=False)]
    plan: dict[str, str] = {}
    if tp > 1:
        plan = adapter.tp_plan(part.config, tp, sequence_parallel=options.sequence_parallel,
                               vocab_parallel=options.vocab_parallel)
        apply_tp(part, layout, adapter, plan)
    settings = getattr(getattr(layout, "plan", None), "moe", None)
    if ep > 1 or settings is not None:
        from .moe.settings import check_model

        check_model(settings, part.config, ep)  # the YAML's MoE keys vs the HF model
        from .moe.routing import apply_routing, routing_of

        if routing_of(settings):  # norm_topk_prob / routed_scaling_factor: the YAML's, as MindFormers computes
            apply_routing(part, adapter or adapter_for(part), settings)
    ep_plan, aux_loss = apply_ep(part, layout, adapter, options.capacity, options.aux_loss)
    if adapter is not None and hasattr(adapter, "install_losses"):  # a family's own auxiliary losses (V4: indexer)
        aux_loss = adapter.install_losses(part, layout, options, aux_loss)
    elif options.indexer_loss_coeff:
        warnings.warn(f"model.dsa_indexer_loss_coeff={options.indexer_loss_coeff:g} is not applied to "
                      f"{type(part).__name__}: only DeepSeek-V4's CSA indexers get that loss here", stacklevel=2)
    if layout.size("pp") == 1:
        from .tensor_parallel.replicated import install as sum_replicated_grads

        sum_replicated_grads(part)  # the tp-replicated weights' grad sums: async, one wait per backward
    expert_bias = None
    if options.expert_bias_rate is not None:
        from .moe.expert_bias import install_expert_bias

        expert_bias = install_expert_bias(part, adapter or adapter_for(part), layout, options.expert_bias_rate)
    mtp = None
    if options.mtp_depth:
        from .models.mtp import MultiTokenPrediction
        from .tensor_parallel.mappings import scatter_to_region

        sp = options.sequence_parallel and tp > 1
        mtp = MultiTokenPrediction(part, options.mtp_scale, after_norm=not options.mtp_legacy,
                                   hidden_first=options.mtp_legacy,
                                   scatter=(lambda x: scatter_to_region(x, layout.group("tp"), 1)) if sp else None)
    spec = ShardSpec.from_plan({**plan, **ep_plan}, names)
    cp_algo = None
    if layout.size("cp") > 1:
        from .context_parallel.api import resolve_algo
        from .integrations.hf_attention import use_cp_attention

        use_cp_attention(part, layout, algo=options.cp_algo, backend=options.cp_backend)
        cp_algo = resolve_algo(layout, options.cp_algo)
    if recompute_on and adapter is None:
        from .recompute import hf_gradient_checkpointing

        recompute = hf_gradient_checkpointing(part)
    else:
        recompute = apply_recompute(part, options.recompute, stage=stage, chunk=chunk) if recompute_on else {}
    offloaded = tuple(offload_activations(part, options.activation_offload, recompute))
    interleave = None
    if interleave_on:
        from .interleave.multi_copy import install

        install(part, inter.copies, inter.fine_grain, copy_loss=inter.copy_loss)
        interleave = inter
    return Applied(layout=layout, adapter=adapter, tp_plan=plan, spec=spec,
                   sequence_parallel=bool(options.sequence_parallel and tp > 1),
                   vocab_parallel=bool(options.vocab_parallel and tp > 1), cp_algo=cp_algo, recompute=recompute,
                   interleave=interleave, offloaded=offloaded, ep_plan=ep_plan, aux_loss=aux_loss,
                   expert_bias=expert_bias, mtp=mtp)


def check_mtp(layout: ParallelLayout, depth: int) -> None:
    """MTP's limits (models.mtp): the multi-copy interleave does not run it."""
    plan = getattr(layout, "plan", None)
    if plan is not None and plan.micro_batch_interleave_num > 1:
        raise ValueError(f"model.model_config.mtp_depth={depth} with micro_batch_interleave_num="
                         f"{plan.micro_batch_interleave_num}: multi-token prediction does not run with the multi-copy "
                         "interleave yet; set micro_batch_interleave_num: 1")


def _add_mtp(part: nn.Module, layout: ParallelLayout, depth: int, adapter=None) -> None:
    """The YAML's MTP layers on a whole model (models.mtp); the pipeline engine adds them before its cut."""
    from .models.mtp import add_mtp_layers

    if not hasattr(part, "get_input_embeddings"):
        raise ValueError(f"model.model_config.mtp_depth={depth} (multi-token prediction): the model has no input "
                         "embedding to share with its MTP layers; set mtp_depth: 0")
    check_mtp(layout, depth)
    add_mtp_layers(part, depth, getattr(adapter, "make_mtp_layer", None))  # a family's own MTP layer, if any


# models parallelized by msp.parallelize -> their record, for msp.initialize / accelerate / the Trainer
_APPLIED: "weakref.WeakKeyDictionary[nn.Module, Applied]" = weakref.WeakKeyDictionary()


def applied_to(model: nn.Module) -> Optional[Applied]:
    """The record of msp.parallelize(model, ...), or None if it was not parallelized that way."""
    return _APPLIED.get(model)


def parallelize(model: nn.Module, layout: ParallelLayout, *, sequence_parallel: Optional[bool] = None,
                vocab_parallel: Optional[bool] = None, cp_algo: Optional[str] = None, recompute: Any = None,
                cp_backend: Optional[str] = None, copy_loss: str = "mean") -> nn.Module:
    """Shard a whole HF causal LM in place for `layout` and return it. Every rank must pass the same weights (same
    seed or checkpoint); each keeps only its shards. A model on the meta device is fine (load weights afterwards
    with msparallel_ds.checkpoint.load_sharded_checkpoint, or use msp.from_pretrained).

    Every option defaults to the layout's Plan (use_seq_parallel, vocab_emb_dp, context_parallel_algo,
    recompute_config, micro_batch_interleave_num, fine_grain_interleave); pass one to override it. copy_loss:
    "mean" (default) keeps the non-interleaved step's gradient; "sum" is MindSpore's summed copies (each copy's
    token mean, summed; msp.initialize's engine applies it). The input sequence is sharded over cp by the caller
    (context_parallel.batch.shard_batch, which msp.initialize's engine does for every micro-batch)."""
    done = applied_to(model)
    if done is not None:
        if done.layout is not layout:
            raise ValueError("this model was already parallelized for another ParallelLayout; build a fresh model")
        return model
    if layout.size("pp") > 1:
        raise ValueError(f"parallel_config.pipeline_stage={layout.size('pp')}: msp.parallelize cannot pipeline a "
                         "model by itself; pass the plain HF model to msp.initialize(model, cfg, optimizer=...), whose "
                         "pipeline engine splits it into stages and runs the schedule (under torchrun or the "
                         "deepspeed launcher)")
    from .interleave.multi_copy import check_copy_loss

    check_copy_loss(copy_loss)  # before anything is sharded
    options = Options.from_plan(getattr(layout, "plan", None))
    overrides = {k: v for k, v in (("sequence_parallel", sequence_parallel), ("vocab_parallel", vocab_parallel),
                                   ("cp_algo", cp_algo), ("recompute", recompute), ("cp_backend", cp_backend))
                 if v is not None}
    options = dataclasses.replace(options, interleave=dataclasses.replace(options.interleave, copy_loss=copy_loss),
                                  **overrides)
    _APPLIED[model] = parallelize_part(model, layout, options)
    return model


def prepare_user_loop(model: nn.Module, optimizer) -> None:
    """A parallelized model trained by the user's own loop (accelerate, the Trainer): the expert-bias update runs after
    each optimizer step (a step post-hook); multi-token prediction needs the engine's loss, so it is refused here."""
    applied = applied_to(model)
    if applied.mtp is not None:
        raise ValueError(f"model.model_config.mtp_depth={applied.mtp.depth}: the multi-token-prediction loss is added "
                         "by msp.initialize's engine (train_batch), not by the HF loss accelerate and the Trainer "
                         "back-propagate; train with msp.initialize, or set mtp_depth: 0")
    if applied.expert_bias is not None:
        if optimizer is None:
            raise ValueError("the router expert bias (moe_router_enable_expert_bias / balance_via_topk_bias) is "
                             "updated after each optimizer step: pass the optimizer to prepare() with the model")
        optimizer.register_step_post_hook(lambda *_: applied.expert_bias.update())
