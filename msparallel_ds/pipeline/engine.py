"""PipelineEngine: msp.initialize's engine when parallel_config.pipeline_stage > 1 (same surface as engine.Engine).

Built on torch.distributed.pipelining, not DeepSpeed's PipelineModule (ZeRO <= 1 only, no mpu, 1F1B only):
1. Split first: split.split_model cuts this pp rank's stage chunks (HF parameter names kept), then each chunk goes
   through strategy.parallelize_part, the path a whole model takes under the other engine: tp (+SP, vocab parallel:
   MindFormers forces vocab_emb_dp false with pp), cp attention, recompute (recompute_config lists are per stage
   and per virtual chunk) and multi-copy interleave inside each micro-batch. SP's sequence split sits on layer 0
   (first stage); later stages receive the already split hidden state. The other ranks' modules are moved to the
   meta device (the HF shell stays only for save_pretrained's config).
2. The engine holds the chunks' combined record (strategy.Applied: shard spec, recompute map) for checkpoints.
3. train_batch: the batch (this dp rank's rows: batch_size x mbi x micro_batch_num) is cp-sharded once
   (context_parallel.batch.shard_batch: shifted labels, global position_ids); the schedule splits it into
   micro_batch_num micro-batches. position_ids (and doc_ids) travel as keywords to every stage; only the hidden
   state crosses stages. The last stage's loss_fn returns sum(token losses) / N, N = valid tokens of the GLOBAL
   batch; schedules run with scale_grads=False, so after the schedule each rank holds d(its tokens' loss sum)/N.
4. Gradients are then summed over dp x cp (one flat all-reduce per step), so every rank holds d(global sum)/N:
   the non-pipelined step's gradient exactly. Global-norm clipping sums squared norms over pp x tp, counting
   tp-sharded parameters on every tp rank and replicated ones once (tp rank 0), with torch's clip_grad_norm_ formula.
5. Optimizer parallel (parallel.enable_parallel_optimizer) = torch's ZeroRedundancyOptimizer over dp_cp inside each
   stage (with expert parallel: dense states over dp_cp, expert states over edp, pipeline.zero): ZeRO-1 (optimizer state sharded, gradients all-reduced, updated parameters broadcast by their owner).
   It is chosen over DeepSpeed's stage-1 partitioner because that one lives inside DeepSpeed's engine, which cannot
   wrap a pipeline stage with our mpu. optimizer_level level2/level3 run as level1 here, with a warning that says so.
6. The loss returned is the global-batch mean on every rank: summed over dp x cp on the last stage, then over pp.
   A non-finite loss or gradient norm stops the step before the update (loss.check_finite_step).
7. The stages' P2P buffer shapes follow the batch: a new sequence length re-runs torch's stage shape inference.
8. A tied output head (GPT-2) or multi-token prediction shares the word embedding between the first and the last
   stage as Megatron does (pipeline.shared: a copy on the last stage, its grad summed with the first's over the
   embedding group before clipping, counted once in the norm, saved once). MTP (models.mtp, mcore semantics as at
   pp = 1): the MTP layers sit on the last stage; depth k's shifted ids travel to it as the keyword `mtp_ids` and its
   targets with the LM's in the schedule's target ([b, 1 + D, s]); the last stage returns (logits, depth logits...),
   the loss adds mtp_loss_scaling_factor / D x each depth's global token mean, logged apart as last_mtp_loss.
"""
from __future__ import annotations

import dataclasses
import inspect
import warnings
from typing import Any, Mapping, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..context_parallel.batch import inputs_and_targets
from ..distributed.collectives import all_reduce_flat, clip_grad_norm_, global_grad_norm, sum_over
from ..distributed.layout import ParallelLayout
from ..context_parallel.api import inputs_agreed
from ..labels import IGNORE_INDEX
from ..loss import check_batch_and_count, check_finite_step, token_loss_sum
from ..models.mtp import shift_left
from ..strategy import Applied
from .mtp import install_mtp, without_mtp
from .schedule import build_schedule, reset_stage_shapes
from .split import split_model

__all__ = ["PipelineEngine", "initialize_pipeline"]


def _drop_other_modules(model: nn.Module, view: nn.Module) -> None:
    """Free what this rank does not run: every module whose parameters are not in `view` goes to meta."""
    keep = {id(p) for p in view.parameters()}
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is not None and id(p) not in keep:
                module._parameters[name] = nn.Parameter(p.detach().to("meta"), requires_grad=p.requires_grad)


def _optimizer_parts(optimizer, plan, view: nn.Module):
    """(optimizer class, its defaults, params or groups) from a callable params -> Optimizer, an Optimizer, or None
    (the YAML's: msp.build_optimizer's class and MindFormers' groups over this stage's parameters)."""
    if optimizer is None:
        from ..optim.build import optimizer_groups, optimizer_spec

        cls, kwargs = optimizer_spec(plan.config)
        return cls, kwargs, optimizer_groups(view, plan.config, cls, kwargs)
    if isinstance(optimizer, torch.optim.Optimizer):
        probe = optimizer
    else:
        probe = optimizer([nn.Parameter(torch.zeros(1))])
    accepted = inspect.signature(type(probe).__init__).parameters
    params = [p for p in view.parameters() if p.requires_grad]
    return type(probe), {k: v for k, v in probe.defaults.items() if k in accepted}, params


def _build_optimizer(view: nn.Module, optimizer, plan, layout: ParallelLayout) -> torch.optim.Optimizer:
    cls, defaults, params = _optimizer_parts(optimizer, plan, view)
    zero = plan.zero.stage if plan.config.parallel.enable_parallel_optimizer else 0
    if zero > 1:
        warnings.warn(f"parallel.parallel_optimizer_config.optimizer_level=level{zero} with pipeline_stage > 1 runs "
                      "as level1 (ZeRO-1: optimizer state sharded over data_parallel x context_parallel inside each "
                      "stage; gradients and weights stay whole)", stacklevel=3)
    if plan.zero.offload_optimizer:
        warnings.warn("optimizer.swap with pipeline_stage > 1: the pipeline engine keeps the optimizer state on the "
                      "device (DeepSpeed's offload lives inside its own engine); set pipeline_stage: 1 to offload",
                      stacklevel=3)
    if zero and layout.size("dp_cp") > 1:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        if layout.size("ep") > 1:  # experts differ across dp x cp: their states shard over edp (pipeline.zero)
            from .zero import split_zero

            return split_zero(params, cls, defaults, layout)
        return ZeroRedundancyOptimizer(params, optimizer_class=cls, process_group=layout.group("dp_cp"), **defaults)
    return cls(params, **defaults)


class PipelineEngine:
    """This pp rank's stages, their schedule, the optimizer and layout. Build with msp.initialize."""

    is_pipeline = True

    def __init__(self, hf_model, view, stages, schedule, stage_ids, layout: ParallelLayout, plan, optimizer,
                 lr_scheduler, device, applied: Applied, records: tuple = ()):
        self._hf, self.model, self.stages, self.schedule = hf_model, view, stages, schedule
        self.applied = applied
        self._records = tuple(records)  # every chunk's record (each has its own aux-loss state)
        self.last_aux_loss: Optional[float] = None  # the routers' aux + z loss of the last step (logged apart)
        self.last_mtp_loss: Optional[float] = None  # the multi-token-prediction cross-entropy (logged apart)
        self.global_grad_norm: Optional[float] = None
        self.shared = None  # pipeline.shared.SharedEmbedding: this rank's end of a cross-stage word embedding
        self.mtp_depth, self.mtp_scale, self.tied_names = 0, 0.0, {}  # set by initialize_pipeline
        self.stage_ids, self.layout, self.plan, self.device = stage_ids, layout, plan, device
        self.optimizer, self.lr_scheduler = optimizer, lr_scheduler
        self.micro_batch_size = plan.micro_batch_size * plan.micro_batch_interleave_num
        self.gradient_accumulation_steps = plan.micro_batch_num
        self.global_steps = 0
        self.n_stages = layout.size("pp") * plan.pp_virtual_stages
        self.holds_first, self.holds_last = 0 in stage_ids, self.n_stages - 1 in stage_ids
        self._n_tokens: Optional[Tensor] = None
        self._head = applied.output_head(view)
        self._batch_shape: Optional[tuple] = None  # the input shape the schedule's P2P buffers were built for

    @property
    def spec(self):
        """The shard spec parallelize cut this rank's stages by (name -> tp split), for gathers and checkpoints."""
        return self.applied.spec

    # ------------------------------------------------------------------------------------------ loss
    def _loss_fn(self, out, targets: Tensor) -> Tensor:
        if not self.mtp_depth:
            loss = token_loss_sum(out, targets, self._head) / self._n_tokens[0]
            self._parts.append((loss.detach().float(), None))
            return loss
        logits, *depths = out  # LM targets first, then depth k's ([b, 1 + D, s])
        loss = token_loss_sum(logits, targets[:, 0].contiguous(), self._head) / self._n_tokens[0]
        sums = [token_loss_sum(x, targets[:, k].contiguous(), self._head) for k, x in enumerate(depths, start=1)]
        self._parts.append((loss.detach().float(), torch.stack([s_.detach().float() for s_ in sums])))
        return loss + sum(s_ * (self.mtp_scale / self.mtp_depth) / n for s_, n in zip(sums, self._n_tokens[1:]))

    # ------------------------------------------------------------------------------------------ batches
    def _inputs(self, batch: Mapping[str, Any]) -> tuple[Tensor, Tensor, dict]:
        """(input_ids, targets, schedule kwargs); sets the step's global token count, which rides in the batch
        agreement's all-gather (the pp peers are always checked unless check_batch_agreement is off)."""
        shifted = isinstance(batch, Mapping) and batch.get("shift_labels") is not None  # (S per row) win over labels
        depth = self.mtp_depth

        def counted(labels):  # the LM's targets, then each MTP depth's (labels shifted left by k)
            first = batch["shift_labels"] if shifted else labels
            return [first] + [shift_left(labels, k, IGNORE_INDEX) for k in range(1, depth + 1)]
        ids, _, counts = check_batch_and_count(batch, self, "parallel_config.micro_batch_num", counted,
                                               shifted=shifted, n_counts=1 + depth)
        self._n_tokens = counts()
        batch = {k: v.to(self.device) if torch.is_tensor(v) else v for k, v in batch.items()}
        inputs, targets = inputs_and_targets(batch, self.layout)
        if self.layout.size("cp") == 1:
            inputs.pop("attention_mask", None)  # causal masks are rebuilt per stage; padding masks are not supported
            if inputs.get("position_ids") is None:
                s = ids.shape[1]
                inputs["position_ids"] = torch.arange(s, device=self.device).unsqueeze(0).expand(ids.shape[0], s)
        kwargs = {k: v.expand(ids.shape[0], -1).contiguous() if k == "position_ids" else v
                  for k, v in inputs.items() if k in ("position_ids", "doc_ids")}
        if self.mtp_depth:  # depth k's shifted ids to the last stage, its targets with the LM's
            from ..models.mtp import mtp_inputs

            mtp_ids, mtp_targets = mtp_inputs(batch["input_ids"], batch.get("labels", batch["input_ids"]),
                                              self.layout, self.mtp_depth)
            kwargs["mtp_ids"] = torch.stack(mtp_ids, 1)
            targets = torch.stack([targets, *mtp_targets], 1)
        if getattr(self.applied.adapter, "stage_token_ids", False):  # DeepSeek-V4's hash routers read the ids
            kwargs["token_ids"] = inputs["input_ids"]
        return inputs["input_ids"], targets, kwargs

    # ------------------------------------------------------------------------------------------ step
    def _follow_batch_shape(self, ids: Tensor) -> None:
        """torch.distributed.pipelining fixes each stage's P2P buffer shapes at its first step; when the sequence
        length (or row count) changes, the stages infer their shapes again at the next step (dynamic padding)."""
        shape = tuple(ids.shape)
        if self._batch_shape is not None and shape != self._batch_shape:
            reset_stage_shapes(self.schedule, self.stages, self._batch_shape, shape)
        if shape != self._batch_shape:  # this step starts with a shape-inference forward of every stage
            for record in self._records:
                if record.aux_loss is not None:
                    record.aux_loss.skip_inference()
        self._batch_shape = shape

    def _sync_and_clip(self):
        params = [p for p in self.model.parameters() if p.requires_grad]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if self.shared is not None:  # the word embedding's two copies: grads summed (first and last stage)
            self.shared.sync_grads()
        experts = [p.grad for p in params if getattr(p, "expert_parallel", False)]
        # Buckets of the plan's reduce_bucket_size (the parameters / gradient_aggregation_group), so the flat
        # copy is one bucket, not all the gradients
        bucket = self.plan.zero.reduce_bucket_size
        all_reduce_flat([p.grad for p in params if not getattr(p, "expert_parallel", False)], self.layout, "dp_cp",
                        bucket)
        if experts:  # each expert lives on the edp ranks only (moe.apply)
            all_reduce_flat(experts, self.layout, "edp", bucket)
        clip = self.plan.gradient_clipping
        if clip:
            norm = clip_grad_norm_(params, clip, self.layout, device=self.device)
        else:  # the norm costs what a per-rank finiteness flag would; non-finite if any gradient is
            norm = global_grad_norm(params, self.layout, device=self.device)
        self.global_grad_norm = float(norm)
        return self.global_grad_norm

    @property
    def _forwards(self) -> int:
        """Real forwards per router and step: the schedule's shape-inference forward comes before them."""
        return self.plan.micro_batch_num * self.plan.micro_batch_interleave_num

    def _log_aux_loss(self) -> None:
        """The routers' aux + z loss of the step (every rank's shares summed, averaged over micro-batches)."""
        losses = [r.aux_loss for r in self._records if r.aux_loss is not None]
        if not losses:
            return
        t = sum(aux.pop_total(last=aux.terms * self._forwards).float().cpu() for aux in losses).to(self.device)
        for aux in losses:
            aux.end_step()
        for name in ("dp_cp", "tp", "pp"):
            sum_over(self.layout, name, t)
        self.last_aux_loss = float(t) / self.plan.micro_batch_num

    def train_batch(self, batch: Mapping[str, Any]) -> Tensor:
        """One optimizer step on this dp rank's share of the global batch; returns the global-batch mean loss
        (detached, float32) on every rank."""
        shifted = batch.get("shift_labels") is not None  # already shifted targets (S per row) win over labels
        if shifted and self.mtp_depth:
            raise ValueError("train_batch: batch['shift_labels'] with MTP (mtp_depth > 0) is not supported; "
                             "pass HF-style batch['labels'] instead")
        ids, targets, kwargs = self._inputs(batch)
        self._follow_batch_shape(ids)
        self._parts = []  # per loss_fn call: (LM loss, MTP depth sums); a first step's shape inference adds one
        for stage in self.stages:
            stage.submod.train()
        args = (ids,) if self.holds_first else ()
        target = targets if self.holds_last else None
        # return_outputs=False: the step needs only the losses, which _loss_fn keeps in self._parts (the schedule's
        # own list is not asked for); merging the last stage's logits would cost memory and time for nothing
        agreed = self.layout.size("cp") > 1 and getattr(self, "check_batch_agreement", True)  # (check_batch_and_count)
        with inputs_agreed(self.layout, agreed):
            self.schedule.step(*args, target=target, losses=None, return_outputs=False, **kwargs)
        parts = self._parts[len(self._parts) - self.plan.micro_batch_num:] if self.holds_last else []
        total = torch.zeros((), dtype=torch.float32, device=self.device)  # the LM part of the losses
        for lm, _ in parts:
            total += lm
        sum_over(self.layout, "dp_cp", total)
        sum_over(self.layout, "pp", total)  # only the last stage's ranks hold a loss
        if self.mtp_depth:  # each depth's global token-mean cross-entropy, averaged over depths
            sums = torch.zeros(self.mtp_depth, dtype=torch.float32, device=self.device)
            for _, depth_sums in parts:
                sums += depth_sums
            for name in ("dp_cp", "pp"):
                sum_over(self.layout, name, sums)
            self.last_mtp_loss = float((sums / self._n_tokens[1:]).mean())
        self._log_aux_loss()
        check_finite_step(self.global_steps, loss=total)  # global values: the same verdict on every rank
        check_finite_step(self.global_steps, grad_norm=self._sync_and_clip())  # before the update
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        for record in self._records:  # aux-loss-free balancing (the schedule's shape-inference pass excluded)
            if record.expert_bias is not None:
                record.expert_bias.update(last=self._forwards)
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()
        self.global_steps += 1
        return total

    # ------------------------------------------------------------------------------------------ weights
    def full_state_dict(self, *, rank0_only: bool = False) -> Optional[dict]:
        """The HF-keyed full state dict (stages and tp shards gathered), on CPU; every rank must call."""
        from ..checkpoint.reshard import gather_full_state_dict

        full = gather_full_state_dict(self.model, self.layout, spec=self.spec, rank0_only=rank0_only)
        for head, embed in (self.tied_names.items() if full is not None else ()):  # one tensor, as HF's state dict
            if embed in full:
                full[head] = full[embed]
        return full

    def save_pretrained(self, save_dir: str, **hf_kwargs) -> None:
        """A normal HF checkpoint of the full model, written by global rank 0; every rank must call."""
        from ..checkpoint.hf import clean_saved_config

        full = self.full_state_dict(rank0_only=True)
        if self.layout.global_rank == 0:
            total = sum(t.numel() for t in {id(t): t for t in full.values()}.values())
            self._hf.save_pretrained(save_dir, state_dict=full, is_main_process=True, **hf_kwargs)
            clean_saved_config(save_dir, total)
        dist.barrier()

    def save(self, save_dir: str, *, sharded: bool = True, async_save: bool = False, replicas: int = 0) -> None:
        """The layout-independent checkpoint of msparallel_ds.checkpoint (loads under any layout); sharded /
        async_save / replicas as engine.Engine.save."""
        from ..checkpoint.pipeline import save_pipeline_checkpoint

        save_pipeline_checkpoint(self, save_dir, sharded=sharded, async_save=async_save, replicas=replicas)

    def load(self, load_dir: str) -> dict:
        from ..checkpoint.pipeline import load_pipeline_checkpoint

        return load_pipeline_checkpoint(self, load_dir)


def initialize_pipeline(model: nn.Module, layout: ParallelLayout, optimizer=None, *,
                        lr_scheduler=None, total_steps: Optional[int] = None) -> PipelineEngine:
    """msp.initialize for pipeline_stage > 1 (called by engine.initialize; same arguments)."""
    from ..config.rules import layers_per_stage
    from ..models import adapter_for
    from ..runtime import training_device
    from ..models.mtp import add_mtp_layers
    from ..strategy import Options, applied_to, combine, parallelize_part

    plan = layout.plan
    if applied_to(model) is not None:
        raise ValueError("parallel_config.pipeline_stage > 1: pass msp.initialize the plain HF model (not one from "
                         "msp.parallelize / msp.from_pretrained); the pipeline engine splits and shards it itself")
    pp, vpp, pp_rank = layout.size("pp"), plan.pp_virtual_stages, layout.rank("pp")
    options = Options.from_plan(plan)
    depth = options.mtp_depth
    if depth:  # the MTP layers (models.mtp) join the model before the cut: the last stage takes them
        from ..strategy import check_mtp

        check_mtp(layout, depth)
        add_mtp_layers(model, depth, getattr(adapter_for(model), "make_mtp_layer", None))  # a family's own
    counts = plan.layers_per_stage
    if counts is None:  # the YAML gives no num_layers: the model's count with the YAML's offsets
        n = adapter_for(model).layer_count(model) - depth
        counts = layers_per_stage(n, pp, vpp, plan.config.model.offset)
        if sum(map(sum, counts)) != n or min(map(min, counts)) < 1:
            raise ValueError(f"model.model_config.offset={plan.config.model.offset!r} does not split the model's {n} "
                             f"layers over pipeline_stage={pp} x pp_interleave_num={vpp} (layers per stage "
                             f"{counts}); set model.model_config.num_layers: {n} to get the full offset checks")
    if depth and plan.config.use_legacy:  # legacy MindFormers counts the MTP layers in the last stage's share
        counts = without_mtp(counts, pp, vpp, plan.pp_schedule, depth)
    if plan.config.model.compute_dtype not in ("float32", None) and layout.device_type != "cuda":
        warnings.warn(f"model.model_config.compute_dtype={plan.config.model.compute_dtype}: the pipeline engine "
                      "runs the model in its own dtype (float32 on CPU)", stacklevel=3)
    # split first, then the one parallelize path on every chunk (TP/SP/vocab, cp, recompute, interleave)
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    modules_ = {id(m): n for n, m in model.named_modules()}  # the HF names of the embedding's and head's weights
    embed_name = modules_[id(model.get_input_embeddings())] + ".weight"
    head_name = modules_[id(model.get_output_embeddings())] + ".weight" if tied else None
    records, stage_options = [], dataclasses.replace(options, mtp_depth=0)  # stages: MTP set up below
    modules, view, stage_ids = split_model(model, counts, pp_rank, plan.pp_schedule, prepare=lambda stage, chunk: (
        records.append(parallelize_part(stage, layout, stage_options, stage=pp_rank, chunk=chunk))), mtp=depth)
    _drop_other_modules(model, view)
    for record in records:  # the routers' aux loss: averaged over micro-batches (grads are summed over dp x cp)
        if record.aux_loss is not None:
            record.aux_loss.scale = 1.0 / plan.micro_batch_num
    device = training_device(layout)
    view.to(device)
    shared = None
    if tied or depth:  # the word embedding on the first and the last stage (pipeline.shared)
        from .shared import share_embedding

        shared = share_embedding(modules, layout, vpp, plan.pp_schedule, embed_name=embed_name,
                                 head_name=head_name, mtp=bool(depth))
    if depth:
        install_mtp(modules, layout, options)
    engine_box: list = []

    def loss_fn(logits, targets):
        return engine_box[0]._loss_fn(logits, targets)

    schedule, stages = build_schedule(plan.pp_schedule, modules, stage_ids, pp * vpp, layout, device,
                                      plan.micro_batch_num, loss_fn)
    opt = _build_optimizer(view, optimizer, plan, layout)
    if lr_scheduler is None:
        from ..optim import build_lr_scheduler

        sched = build_lr_scheduler(opt, plan.config, total_steps)
    else:  # an LR scheduler, or (as DeepSpeed accepts) a callable optimizer -> scheduler
        sched = lr_scheduler if hasattr(lr_scheduler, "step") else lr_scheduler(opt)
    engine = PipelineEngine(model, view, stages, schedule, stage_ids, layout, plan, opt, sched, device,
                            combine(records), records)
    engine.shared, engine.tied_names = shared, ({head_name: embed_name} if tied else {})
    engine.mtp_depth, engine.mtp_scale = depth, options.mtp_scale
    engine_box.append(engine)
    return engine
